"""deform_conv2d (DCNv1/DCNv2): ``op`` (the ``torch.library`` ops: fake, autograd, compile route, autocast),
``eager`` (the eager fast path: autograd Functions around the same implementations, without the dispatcher),
``modulation`` (a modulated layer's offset/mask split), and the backends: ``reference`` (plain PyTorch, the oracle),
``cpu`` and ``triton`` (the kernels). The Triton modules are imported on first use, so the others run without
Triton.
"""
