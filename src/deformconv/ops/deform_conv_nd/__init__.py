"""Deformable convolution of rank 1 and 3 and the transposed forms of rank 1 to 3: ``op`` (the ``torch.library``
ops), ``reference`` (plain PyTorch, any device and dtype, the oracle; the CPU path) and ``triton`` (a sampling kernel
and its gradient's around cuBLAS GEMMs). reference.py states the sampling rule.
"""
