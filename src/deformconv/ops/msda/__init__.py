"""Multi-scale deformable attention (Deformable DETR's ``ms_deform_attn``): ``reference`` (plain PyTorch, any device
and dtype, the oracle), ``cpu`` (the CPU backend: grid_sample's sampler), ``triton`` (the kernels and their
launchers) and ``op`` (the ``torch.library`` op).

For each query, head m and level l, P points are sampled bilinearly from that level's value map at pixel
(x·W_l − 0.5, y·H_l − 0.5) (``grid_sample(align_corners=False)``; points count only strictly inside
(−1, H_l) × (−1, W_l), corners outside read zero) and summed with their attention weights over levels and points.
"""
