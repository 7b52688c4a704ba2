"""The N-d forms' Triton backend: deformable convolution through column buffers (ops/common/columns_nd.py: the
sampling kernel and its gradient's around cuBLAS GEMMs), with the output sizes of reference.py."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from ..common import columns_nd
from .reference import out_size, transposed_size

deform_conv_backward = columns_nd.deform_conv_backward  # the backend's third primitive (op.py), as it is


def deform_conv(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                stride, padding, dilation, positions: Optional[Sequence[int]] = None) -> Tensor:
    """reference.deform_conv's result on the kernels."""
    positions = positions or out_size(list(input.shape[2:]), list(weight.shape[2:]), stride, padding, dilation)
    return columns_nd.deform_conv(input, offset, weight, bias, mask, stride, padding, dilation, positions)


def deform_conv_transpose(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor],
                          mask: Optional[Tensor], stride, padding, output_padding, dilation, groups: int) -> Tensor:
    """reference.deform_conv_transpose's result on the kernels."""
    image = transposed_size(list(input.shape[2:]), list(weight.shape[2:]), stride, padding, output_padding, dilation)
    return columns_nd.deform_conv_transpose(input, offset, weight, bias, mask, stride, padding, dilation, groups,
                                            image)
