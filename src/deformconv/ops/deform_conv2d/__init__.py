"""deform_conv2d (DCNv1/DCNv2): ``reference`` (plain PyTorch, the oracle), and the Triton backend: ``forward``,
``backward`` (``backward_data``: grad_input/offset/mask; ``backward_weight``: grad_weight/bias), ``configs`` (tile
candidates), ``schedule`` (the backward's chunks and streams), ``geometry``, ``tiles`` and ``packing`` (the kernels'
host-side and device-side building blocks). docs/design.md explains how the kernels work.

The Triton modules are imported on first use (``backends.TritonBackend``), so the reference runs without Triton.
"""
