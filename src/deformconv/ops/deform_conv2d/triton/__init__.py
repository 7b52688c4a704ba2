"""deform_conv2d's Triton backend: ``forward``, ``backward`` (``backward_data``: grad_input/offset/mask;
``backward_weight``: grad_weight/bias; ``columns``: grad_weight and grad_input through a column buffer and cuBLAS),
``narrow_groups`` (depthwise and other narrow groups through the N-d forms' column kernels), ``configs`` (tile
candidates), ``schedule`` (the backward's chunks and streams), ``geometry``, ``tiles`` and ``packing`` (the kernels'
host-side and device-side building blocks), ``call`` (a call signature's planned launches, the eager fast path).
docs/design.md explains how the kernels work.
"""

from __future__ import annotations

from typing import Optional

from ...common.launch import on_device_of
from . import backward as _backward
from . import forward as _forward


def deform_conv2d_forward(input, offset, weight, bias, mask, stride, padding, dilation, keep: Optional[dict] = None):
    """The output; keep, where given, gets the packed weight and the operands as the kernels read them."""
    with on_device_of(input):
        return _forward.deform_conv2d_forward(input, offset, weight, bias, mask, stride, padding, dilation, keep=keep)


def deform_conv2d_backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs,
                           keep: Optional[dict] = None):
    """Gradients (input, offset, mask, weight, bias); keep: what the forward kept, or None."""
    keep = keep or {}
    with on_device_of(input):
        return _backward.deform_conv2d_backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs,
                                                packed_weight=keep.get("packed_weight"),
                                                operands=(keep.get("offset"), keep.get("mask")))


def launched_kernels() -> list:
    """Every ``@triton.jit`` kernel the backend launches (the compile route registers them with torch)."""
    from ...common import layout
    from . import backward_data, backward_weight, columns, packing

    return [_forward._deform_conv2d_fwd_kernel, backward_data._deform_conv2d_bwd_data_kernel,
            backward_weight._deform_conv2d_bwd_weight_kernel, backward_weight._finish_grads_kernel,
            columns._columns_kernel,
            packing._pack_weight_kernel, packing._pack_and_transpose_kernel, layout._transpose_kernel,
            layout._transpose_pair_kernel, layout._channel_sum_kernel]
