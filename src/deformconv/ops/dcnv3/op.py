"""The ``deformconv::dcnv3`` and ``deformconv::dcnv4`` operators: torch.library registration of each forward and
backward op, their fake implementations, autograd formulas and autocast rules.

Both ops run the DCNv3 core (reference.py); DCNv4's op splits its offset_mask into DCNv3's offset and mask (views
of each group's block) and assembles its gradient back. ``backend`` is a name or "" (automatic). Arguments reach the
ops checked (deformconv.dcnv).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ...backends import select_op_backend
from ...library import register_autocast
from . import reference
from .geometry import DcnGeometry

def geometry(input: Tensor, kernel, stride, pad, dilation, group: int, group_channels: int, offset_scale: float,
             remove_center: bool) -> DcnGeometry:
    n, h, w, _ = input.shape
    return DcnGeometry(n, h, w, group, group_channels, tuple(kernel), tuple(stride), tuple(pad), tuple(dilation),
                       float(offset_scale), bool(remove_center))


def _impl(input: Tensor, backend: str):
    chosen = "reference" if input.shape[0] == 0 else select_op_backend(input.device, input.dtype, backend)
    if chosen == "reference":
        return reference
    if chosen == "cpu":
        from . import cpu

        return cpu
    from . import triton as kernels

    return kernels


# --- DCNv3 ---------------------------------------------------------------------------------------------


def dcnv3_forward(input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                  remove_center, backend) -> Tensor:
    """The op's forward (also the eager fast path's: deformconv.eager.run_eager)."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return _impl(input, backend).dcn_forward(input, offset, mask, geo)


def dcnv3_backward(grad_out, input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                   remove_center, backend, needs):
    """Gradients (input, offset, mask); None where needs says so."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return _impl(input, backend).dcn_backward(grad_out, input, offset, mask, geo, needs)



@torch.library.custom_op("deformconv::dcnv3", mutates_args=())
def dcnv3_op(input: Tensor, offset: Tensor, mask: Tensor, kernel: List[int], stride: List[int], pad: List[int],
             dilation: List[int], group: int, group_channels: int, offset_scale: float, remove_center: bool,
             backend: str) -> Tensor:
    return dcnv3_forward(input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                         remove_center, backend)


@dcnv3_op.register_fake
def _(input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center, backend):
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return input.new_empty(geo.batch, geo.out_h, geo.out_w, geo.channels)


@torch.library.custom_op("deformconv::dcnv3_backward", mutates_args=())
def dcnv3_backward_op(grad_out: Tensor, input: Tensor, offset: Tensor, mask: Tensor, kernel: List[int],
                      stride: List[int], pad: List[int], dilation: List[int], group: int, group_channels: int,
                      offset_scale: float, remove_center: bool, needs: List[bool],
                      backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (input, offset, mask); one that ``needs`` does not ask for comes back empty."""
    grads = dcnv3_backward(grad_out, input, offset, mask, kernel, stride, pad, dilation, group, group_channels,
                           offset_scale, remove_center, backend, needs)
    return tuple(g if g is not None else input.new_empty(0) for g in grads)  # type: ignore[return-value]


@dcnv3_backward_op.register_fake
def _(grad_out, input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center,
      needs, backend):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need else input.new_empty(0)
                 for t, need in zip((input, offset, mask), needs))


def _setup_v3(ctx, inputs, output):
    input, offset, mask, *params = inputs
    ctx.save_for_backward(input, offset, mask)
    ctx.params = params


def _backward_v3(ctx, grad_out):
    input, offset, mask = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if not any(needs):
        return (None,) * 12
    *params, backend = ctx.params
    grads = dcnv3_backward_op(grad_out, input, offset, mask, *params, needs, backend)
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 9


dcnv3_op.register_autograd(_backward_v3, setup_context=_setup_v3)


# --- DCNv4 ---------------------------------------------------------------------------------------------


def split_offset_mask(offset_mask: Tensor, group: int, points: int) -> Tuple[Tensor, Tensor]:
    """DCNv4's offset_mask [N, Ho, Wo, P] as DCNv3's (offset [N, Ho, Wo, G·K·2], mask [N, Ho, Wo, G·K]) (copies)."""
    n, ho, wo, _ = offset_mask.shape
    blocks = offset_mask[..., :3 * group * points].reshape(n, ho, wo, group, 3 * points)
    offset = blocks[..., :2 * points].reshape(n, ho, wo, group * 2 * points)
    mask = blocks[..., 2 * points:].reshape(n, ho, wo, group * points)
    return offset, mask


def join_offset_mask(offset: Tensor, mask: Tensor, group: int, points: int, channels: int) -> Tensor:
    """DCNv3's offset and mask as DCNv4's offset_mask with `channels` channels (>= 3·G·K; the rest zero)."""
    n, ho, wo, _ = offset.shape
    out = offset.new_zeros(n, ho, wo, channels)
    blocks = out[..., :3 * group * points].view(n, ho, wo, group, 3 * points)
    blocks[..., :2 * points] = offset.reshape(n, ho, wo, group, 2 * points)
    blocks[..., 2 * points:] = mask.reshape(n, ho, wo, group, points)
    return out


def dcnv4_forward(input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                  remove_center, backend) -> Tensor:
    """The op's forward (also the eager fast path's)."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return _impl(input, backend).dcnv4_forward(input, offset_mask, geo)


def dcnv4_backward(grad_out, input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                   remove_center, backend, needs):
    """Gradients (input, offset_mask); None where needs says so."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return _impl(input, backend).dcnv4_backward(grad_out, input, offset_mask, geo, needs)


@torch.library.custom_op("deformconv::dcnv4", mutates_args=())
def dcnv4_op(input: Tensor, offset_mask: Tensor, kernel: List[int], stride: List[int], pad: List[int],
             dilation: List[int], group: int, group_channels: int, offset_scale: float, remove_center: bool,
             backend: str) -> Tensor:
    return dcnv4_forward(input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                         remove_center, backend)


@dcnv4_op.register_fake
def _(input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center, backend):
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return input.new_empty(geo.batch, geo.out_h, geo.out_w, geo.channels)


@torch.library.custom_op("deformconv::dcnv4_backward", mutates_args=())
def dcnv4_backward_op(grad_out: Tensor, input: Tensor, offset_mask: Tensor, kernel: List[int], stride: List[int],
                      pad: List[int], dilation: List[int], group: int, group_channels: int, offset_scale: float,
                      remove_center: bool, needs: List[bool], backend: str) -> Tuple[Tensor, Tensor]:
    """Gradients (input, offset_mask); offset_mask's padding channels get zero. One not needed comes back empty."""
    grads = dcnv4_backward(grad_out, input, offset_mask, kernel, stride, pad, dilation, group, group_channels,
                           offset_scale, remove_center, backend, needs)
    return tuple(g if g is not None else input.new_empty(0) for g in grads)  # type: ignore[return-value]


@dcnv4_backward_op.register_fake
def _(grad_out, input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center,
      needs, backend):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need else input.new_empty(0)
                 for t, need in zip((input, offset_mask), needs))


def _setup_v4(ctx, inputs, output):
    input, offset_mask, *params = inputs
    ctx.save_for_backward(input, offset_mask)
    ctx.params = params


def _backward_v4(ctx, grad_out):
    input, offset_mask = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:2]]
    if not any(needs):
        return (None,) * 11
    *params, backend = ctx.params
    grads = dcnv4_backward_op(grad_out, input, offset_mask, *params, needs, backend)
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 9


dcnv4_op.register_autograd(_backward_v4, setup_context=_setup_v4)


# --- autocast: the ops run in the autocast dtype, as deform_conv2d's (library.py) ------------------------

register_autocast("dcnv3")
register_autocast("dcnv4")
