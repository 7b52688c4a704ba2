"""deform_conv2d (DCNv1/DCNv2): ``reference`` (plain PyTorch, the oracle), and the Triton backend: ``forward``,
``backward`` (``backward_data``: grad_input/offset/mask; ``backward_weight``: grad_weight/bias; ``columns``:
grad_weight through a column buffer and cuBLAS, optional), ``configs`` (tile candidates), ``schedule`` (the
backward's chunks and streams), ``geometry``, ``tiles`` and ``packing`` (the kernels' host-side and device-side
building blocks). docs/design.md explains how the kernels work.

The Triton modules are imported on first use (``backends.TritonBackend``, ``launched_kernels``), so the reference
runs without Triton.
"""


def launched_kernels() -> list:
    """Every ``@triton.jit`` kernel the Triton backend launches (the compile route registers them with torch)."""
    from ..common import layout
    from . import backward_data, backward_weight, columns, forward, packing

    return [forward._deform_conv2d_fwd_kernel, backward_data._deform_conv2d_bwd_data_kernel,
            backward_weight._deform_conv2d_bwd_weight_kernel, backward_weight._finish_grads_kernel,
            columns._columns_kernel,
            packing._pack_weight_kernel, packing._pack_and_transpose_kernel, layout._transpose_kernel,
            layout._transpose_pair_kernel, layout._channel_sum_kernel]
