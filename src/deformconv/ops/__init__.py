"""Implementations: ``reference`` (plain PyTorch, the oracle) and ``deform_conv2d`` (Triton kernels)."""
