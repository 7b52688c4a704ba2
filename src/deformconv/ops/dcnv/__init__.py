"""DCNv3 and DCNv4 (InternImage, FlashInternImage): depthwise deformable aggregation in NHWC, no weight tensor.

``geometry`` (the sampling geometry shared by both conventions), ``reference`` (plain PyTorch, any device and dtype,
the oracle), ``cpu`` (the CPU backend: grid_sample's sampler), ``triton`` (the kernels and their launchers) and
``op`` (the ``torch.library`` ops). Both operators reduce to one core: each output position (oh, ow) and group g
sums, over its K points, the point's aggregation weight times the input bilinearly sampled there (zero outside the
image).
"""
