"""Tiny models of every transformers family with multi-scale deformable attention, built from their configs (nothing
downloaded; random initialisation), and inputs for them: the integration tests' subjects.

Each family: (config class, model class, config arguments). Sizes are the smallest each family's code accepts:
d_model 32, two heads, one or two layers, small backbones of transformers' own (OmDet-Turbo's default backbone is
timm's, so a Swin of transformers' stands in, and its class_embed_dim differs from decoder_hidden_dim: transformers
5.23 builds no task projection where they are equal, then calls it)."""

import torch

D = 32
IMAGE = 64


def families():
    """{family: () -> (config class, model class, config kwargs)} (imports transformers). A family's classes are looked
    up when it is built: an older transformers without some families still builds the others."""
    import transformers as T

    def resnet():  # RT-DETR's own ResNet
        return T.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[16, 24, 32, 40], depths=[1, 1, 1, 1],
                                    layer_type="bottleneck", out_features=["stage2", "stage3", "stage4"])

    def hgnet(out_features=("stage2", "stage3", "stage4")):
        return T.HGNetV2Config(embedding_size=8, depths=[1, 1, 1, 1], hidden_sizes=[16, 24, 32, 40],
                               stem_channels=[3, 8, 8], stage_in_channels=[8, 16, 24, 32],
                               stage_mid_channels=[8, 8, 8, 8], stage_out_channels=[16, 24, 32, 40],
                               stage_num_blocks=[1, 1, 1, 1], stage_numb_of_layers=[1, 1, 1, 1],
                               stage_kernel_size=[3, 3, 3, 3], stage_downsample=[False, True, True, True],
                               stage_light_block=[False, False, True, True], out_features=list(out_features))

    def swin(out_features):
        return T.SwinConfig(embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], window_size=2,
                            image_size=IMAGE, out_features=list(out_features))

    def bert():
        return T.BertConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=D,
                            vocab_size=100)

    rtdetr = dict(d_model=D, encoder_hidden_dim=D, encoder_in_channels=[24, 32, 40], decoder_in_channels=[D, D, D],
                  encoder_ffn_dim=D,
                  encoder_attention_heads=2, decoder_ffn_dim=D, decoder_attention_heads=2, decoder_layers=2,
                  num_queries=10, decoder_n_points=2, num_labels=3)
    dino = dict(d_model=D, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=D, decoder_ffn_dim=D, num_queries=10, num_feature_levels=3, encoder_n_points=2,
                decoder_n_points=2, backbone_config=swin(["stage2", "stage3", "stage4"]), text_config=bert(),
                max_text_len=16)
    lw = dict(d_model=D, decoder_ffn_dim=D, decoder_layers=2, decoder_self_attention_heads=2,
              decoder_cross_attention_heads=2, num_queries=10, projector_in_channels=[D, D],
              projector_scale_factors=[1.0], num_labels=3)
    return {
        "deformable_detr": lambda: (T.DeformableDetrConfig, T.DeformableDetrForObjectDetection, dict(
            d_model=D, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=D, decoder_ffn_dim=D, num_queries=10, num_feature_levels=3, encoder_n_points=2,
            decoder_n_points=3, two_stage=True, two_stage_num_proposals=10, with_box_refine=True, num_labels=3,
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=T.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
                out_features=["stage2", "stage3", "stage4"]))),
        "rt_detr": lambda: (T.RTDetrConfig, T.RTDetrForObjectDetection, dict(backbone_config=resnet(), **rtdetr)),
        "rt_detr_v2": lambda: (T.RTDetrV2Config, T.RTDetrV2ForObjectDetection,
                               dict(backbone_config=resnet(), **rtdetr)),
        "d_fine": lambda: (T.DFineConfig, T.DFineForObjectDetection, dict(backbone_config=hgnet(), **rtdetr)),
        "deimv2": lambda: (T.Deimv2Config, T.Deimv2ForObjectDetection, dict(backbone_config=hgnet(), **rtdetr)),
        "pp_doclayout_v2": lambda: (T.PPDocLayoutV2Config, T.PPDocLayoutV2ForObjectDetection, dict(
            backbone_config=hgnet(), reading_order_config=dict(
                hidden_size=D, num_hidden_layers=1, num_attention_heads=2, intermediate_size=D, vocab_size=100,
                global_pointer_head_size=8, relation_bias_embed_dim=8), class_thresholds=[0.5] * 3,
            class_order=[0, 1, 2], **rtdetr)),
        "pp_doclayout_v3": lambda: (T.PPDocLayoutV3Config, T.PPDocLayoutV3ForObjectDetection, dict(
            backbone_config=hgnet(("stage1", "stage2", "stage3", "stage4")), x4_feat_dim=16,
            global_pointer_head_size=8, **rtdetr)),
        "pp_doclayout_v4": lambda: (T.PPDocLayoutV4Config, T.PPDocLayoutV4ForObjectDetection, dict(
            backbone_config=hgnet(), global_pointer_head_size=8, **rtdetr)),
        "grounding_dino": lambda: (T.GroundingDinoConfig, T.GroundingDinoForObjectDetection, dino),
        "mm_grounding_dino": lambda: (T.MMGroundingDinoConfig, T.MMGroundingDinoForObjectDetection, dino),
        "omdet_turbo": lambda: (T.OmDetTurboConfig, T.OmDetTurboForObjectDetection, dict(
            backbone_config=swin(["stage2", "stage3", "stage4"]), text_config=T.CLIPTextConfig(
                hidden_size=48, num_hidden_layers=1, num_attention_heads=2, intermediate_size=D, vocab_size=100,
                projection_dim=48, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0),
            text_projection_in_dim=48, text_projection_out_dim=48, task_encoder_hidden_dim=D, class_embed_dim=48,
            num_queries=10, encoder_hidden_dim=D, vision_features_channels=[D, D, D],
            encoder_in_channels=[16, 32, 64], encoder_attention_heads=2, encoder_dim_feedforward=D,
            decoder_hidden_dim=D, decoder_num_heads=2, decoder_num_layers=2, decoder_dim_feedforward=D,
            decoder_num_points=2, image_size=IMAGE, apply_layernorm_after_vision_backbone=False)),
        "lw_detr": lambda: (T.LwDetrConfig, T.LwDetrForObjectDetection, dict(
            backbone_config=T.LwDetrViTConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                                              image_size=IMAGE, patch_size=8, out_indices=[1, 2],
                                              window_block_indices=[0], num_windows=4),
            projector_out_channels=D, **lw)),
        "rf_detr": lambda: (T.RfDetrConfig, T.RfDetrForObjectDetection, dict(
            backbone_config=T.RfDetrDinov2Config(hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                                                 image_size=56, patch_size=14, out_indices=[1, 2],
                                                 intermediate_size=D), **lw)),
        "mask2former": lambda: (T.Mask2FormerConfig, T.Mask2FormerForUniversalSegmentation, dict(
            backbone_config=swin(["stage1", "stage2", "stage3", "stage4"]), feature_size=D, mask_feature_size=D,
            hidden_dim=D, encoder_feedforward_dim=D, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
            dim_feedforward=D, num_queries=5, num_labels=3, train_num_points=64)),
        "oneformer": lambda: (T.OneFormerConfig, T.OneFormerForUniversalSegmentation, dict(
            backbone_config=swin(["stage1", "stage2", "stage3", "stage4"]), conv_dim=D, mask_dim=D, hidden_dim=D,
            encoder_feedforward_dim=D, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
            dim_feedforward=D, num_queries=6, text_encoder_num_layers=1, text_encoder_width=D,
            text_encoder_context_length=8, task_seq_len=8, text_encoder_vocab_size=100, num_labels=3,
            train_num_points=64,
            query_dec_layers=1)),
    }


FAMILIES = ("deformable_detr", "rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v2", "pp_doclayout_v3",
            "pp_doclayout_v4", "grounding_dino", "mm_grounding_dino", "omdet_turbo", "lw_detr", "rf_detr",
            "mask2former", "oneformer")


def build(family: str, seed: int = 0, **overrides):
    """The family's tiny model; the test skipped where the installed transformers has no such family."""
    import pytest
    import transformers

    try:
        config_class, model_class, kwargs = families()[family]()
    except AttributeError as e:
        if "module transformers has no attribute" not in str(e):  # only a class missing from the package itself
            raise
        pytest.skip(f"transformers {transformers.__version__} has no {family} ({e})")
    torch.manual_seed(seed)
    return model_class(config_class(**{**kwargs, **overrides}))


def inputs(family: str, batch: int, dtype=torch.float64, seed: int = 1) -> dict:
    """Forward arguments for a batch of random images (and texts, tasks), no labels."""
    g = torch.Generator().manual_seed(seed)
    size = 56 if family == "rf_detr" else IMAGE
    args = {"pixel_values": torch.randn(batch, 3, size, size, generator=g, dtype=dtype)}
    if family in ("grounding_dino", "mm_grounding_dino"):
        args["input_ids"] = torch.randint(3, 100, (batch, 7), generator=g)
        args["attention_mask"] = torch.ones(batch, 7, dtype=torch.long)
    elif family == "omdet_turbo":
        classes = 3
        args["classes_input_ids"] = torch.randint(3, 100, (batch * classes, 6), generator=g)
        args["classes_attention_mask"] = torch.ones(batch * classes, 6, dtype=torch.long)
        args["tasks_input_ids"] = torch.randint(3, 100, (batch, 6), generator=g)
        args["tasks_attention_mask"] = torch.ones(batch, 6, dtype=torch.long)
        args["classes_structure"] = torch.full((batch,), classes, dtype=torch.long)
    elif family == "oneformer":
        args["task_inputs"] = torch.randint(3, 100, (batch, 8), generator=g)
    return args
