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

from ..common import dispatch
from ..common.autocast import register_autocast
from .geometry import DcnGeometry


def geometry(input: Tensor, kernel, stride, pad, dilation, group: int, group_channels: int, offset_scale: float,
             remove_center: bool) -> DcnGeometry:
    n, h, w, _ = input.shape
    return DcnGeometry(n, h, w, group, group_channels, tuple(kernel), tuple(stride), tuple(pad), tuple(dilation),
                       float(offset_scale), bool(remove_center))


# Every backend's module has dcn_forward, dcn_backward (DCNv3) and dcnv4_forward, dcnv4_backward.
for _op_name in ("dcnv3", "dcnv4"):
    dispatch.register(_op_name, {"triton": f"{__package__}.triton", "cpu": f"{__package__}.cpu",
                                 "reference": f"{__package__}.reference"})


# --- DCNv3 ---------------------------------------------------------------------------------------------


def dcnv3_forward(input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                  remove_center, backend) -> Tensor:
    """The op's forward (also the eager fast path's: common/eager.run_eager)."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return dispatch.implementation("dcnv3", input, backend).dcn_forward(input, offset, mask, geo)


def dcnv3_backward(grad_out, input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                   remove_center, backend, needs):
    """Gradients (input, offset, mask); None where needs says so."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return dispatch.implementation("dcnv3", input, backend).dcn_backward(grad_out, input, offset, mask, geo, needs)



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


def dcnv4_forward(input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                  remove_center, backend) -> Tensor:
    """The op's forward (also the eager fast path's)."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return dispatch.implementation("dcnv4", input, backend).dcnv4_forward(input, offset_mask, geo)


def dcnv4_backward(grad_out, input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                   remove_center, backend, needs):
    """Gradients (input, offset_mask); None where needs says so."""
    geo = geometry(input, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center)
    return dispatch.implementation("dcnv4", input, backend).dcnv4_backward(grad_out, input, offset_mask, geo, needs)


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


# --- autocast: the ops run in the autocast dtype, (common/autocast.py) ------------------------

register_autocast("dcnv3")
register_autocast("dcnv4")
