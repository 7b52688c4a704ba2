"""torch.fx: symbolic tracing of models with deformconv's modules (every family) and of user code calling
deform_conv2d, as torchvision's layers trace: each op one call node, the graph's outputs and gradients those of the
eager model; torchvision's feature extraction on a make_deformable ResNet."""

import inspect

import pytest
import torch
import torch.fx

import deformconv


def _cases():
    """(module, inputs) of every family; the modules' sampling moved off the regular grid."""
    g = torch.Generator().manual_seed(0)
    feat, rois = torch.randn(2, 8, 12, 11, generator=g), torch.tensor([[0, 1.0, 2.0, 19.0, 21.0], [1, 3, 1, 9, 7]])
    shapes, starts = torch.tensor([[6, 5], [3, 3]]), torch.tensor([0, 30])
    query, value, ref = torch.randn(2, 4, 32, generator=g), torch.randn(2, 39, 32, generator=g), torch.rand(2, 4, 2, 2)
    cases = {
        "DeformConv2d": (deformconv.DeformConv2d(4, 6, 3, padding=1),
                         (torch.randn(2, 4, 7, 6, generator=g), torch.randn(2, 18, 7, 6, generator=g))),
        "DeformConv2dPack": (deformconv.DeformConv2dPack(4, 6, 3, stride=2, padding=1), (torch.randn(2, 4, 7, 6),)),
        "ModulatedDeformConv2dPack": (deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1, offset_groups=2),
                                      (torch.randn(2, 4, 7, 6, generator=g),)),
        "DCNv3": (deformconv.DCNv3(16, group=2), (torch.randn(2, 5, 7, 16, generator=g),)),
        "DCNv4": (deformconv.DCNv4(32, group=2, dw_kernel_size=3), (torch.randn(2, 36, 32, generator=g),)),
        "MultiScaleDeformableAttention": (deformconv.MultiScaleDeformableAttention(32, 2, 2, 2, dropout=0.0,
                                                                                  batch_first=True),
                                          dict(query=query, value=value, reference_points=ref, spatial_shapes=shapes,
                                               level_start_index=starts)),
        "MSDeformAttn": (deformconv.MSDeformAttn(32, 2, 2, 2), (query, ref, value, shapes, starts)),
        "DeformRoIPool": (deformconv.DeformRoIPool(3, 0.5, 2), (feat, rois, torch.randn(2, 2, 3, 3, generator=g))),
        "DeformRoIPoolPack": (deformconv.DeformRoIPoolPack(3, 8, 16, 0.5, 2), (feat, rois)),
        "ModulatedDeformRoIPoolPack": (deformconv.ModulatedDeformRoIPoolPack(3, 8, 16, 0.5, 2), (feat, rois)),
        "DeformPSRoIPooling": (deformconv.DeformPSRoIPooling(0.5, 2, 2, False, group_size=2, trans_std=0.1),
                               (feat, rois, torch.randn(2, 2, 2, 2, generator=g))),
    }
    for module, _ in cases.values():
        with torch.no_grad():
            for name, p in module.named_parameters():
                if any(k in name for k in ("conv_offset", "offset", "mask", "fc")):
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_symbolic_trace_of_every_module(name):
    module, inputs = _cases()[name]
    # optional arguments left out are fixed as None, as torch.fx asks of any module's (concrete_args)
    none_args = {"MultiScaleDeformableAttention": ("key", "identity", "query_pos", "key_padding_mask"),
                 "MSDeformAttn": ("input_padding_mask",)}.get(name, ())
    graph_module = torch.fx.symbolic_trace(module, concrete_args={k: None for k in none_args})
    # the op (or a check) runs as a call of its own: the graph holds no deformconv code traced through
    targets = [str(getattr(n.target, "__name__", n.target)) for n in graph_module.graph.nodes
               if n.op == "call_function"]
    assert any(t in ("deform_conv2d", "dcnv3", "dcnv4", "ms_deform_attn", "deform_roi_pool", "deform_psroi_pool")
               or "deformconv" in t for t in targets), targets
    if not isinstance(inputs, dict):  # by name: the graph's forward takes them so too
        inputs = dict(zip(inspect.signature(module.forward).parameters, inputs))
    leaves = {k: t.clone().requires_grad_() if t.is_floating_point() else t for k, t in inputs.items()}
    want = module(**leaves)
    got = graph_module(**leaves)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same operations on the same data
    tensors = [t for t in leaves.values() if t.requires_grad] + list(module.parameters())
    used = [t for t in tensors if t.requires_grad]
    gw = torch.autograd.grad(want.sum(), used, allow_unused=True)
    gg = torch.autograd.grad(got.sum(), used, allow_unused=True)
    for a, b in zip(gg, gw):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_user_code_calling_deform_conv2d_traces_to_the_op():
    """A function calling deform_conv2d as torchvision's is called: one node of torch.ops.deformconv.deform_conv2d,
    which checks its arguments when the graph runs."""
    def f(x, offset, weight, mask):
        return deformconv.deform_conv2d(x, offset, weight, None, stride=1, padding=(1, 1), mask=mask) * 2

    graph_module = torch.fx.symbolic_trace(f)
    ops = [n.target for n in graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.deformconv.deform_conv2d.default in ops or torch.ops.deformconv.deform_conv2d in ops, ops
    x, offset, w = torch.randn(1, 4, 5, 6), torch.randn(1, 18, 5, 6), torch.randn(3, 4, 3, 3)
    mask = torch.rand(1, 9, 5, 6)
    torch.testing.assert_close(graph_module(x, offset, w, mask), f(x, offset, w, mask))
    with pytest.raises(Exception, match=r"offset.shape\[1\] must be 2\*offset_groups\*kh\*kw"):
        graph_module(x, offset[:, :10], w, mask)


def test_feature_extraction_on_a_deformable_resnet():
    """torchvision's create_feature_extractor on make_deformable's ResNet: the same features as the eager model."""
    feature_extraction = pytest.importorskip("torchvision.models.feature_extraction")
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    net = deformconv.make_deformable(torchvision.models.resnet18(), deformconv.resnet_stages((False, True, True,
                                                                                             True))).eval()
    for m in net.modules():
        if isinstance(m, deformconv.ModulatedDeformConv2dPack):
            torch.nn.init.normal_(m.conv_offset.weight, std=0.01)
    nodes = {"layer2": "c3", "layer3": "c4", "layer4": "c5"}
    train_nodes, eval_nodes = feature_extraction.get_graph_node_names(net)
    assert "layer3.0.conv2" in eval_nodes or any(n.startswith("layer3.0.conv2") for n in eval_nodes)
    extractor = feature_extraction.create_feature_extractor(net, nodes)
    x = torch.randn(1, 3, 64, 64)
    features = extractor(x)
    c3 = net.layer2(net.layer1(net.maxpool(net.relu(net.bn1(net.conv1(x))))))
    c4 = net.layer3(c3)
    c5 = net.layer4(c4)
    for name, want in (("c3", c3), ("c4", c4), ("c5", c5)):
        torch.testing.assert_close(features[name], want, atol=0, rtol=0)
