"""The ``deformconv::deform_roi_pool`` operator: torch.library registration of the forward and backward ops, their
fake implementations, the autograd formula and the autocast rule (the RoIs keep their dtype: box coordinates in 16
bits would be off by up to a pixel). ``backend`` is a name or "" (automatic:
common/dispatch.py)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..common import dispatch
from ..common.autocast import register_autocast

# No cpu backend: the reference is the CPU path (DEFORMCONV_BACKEND=cpu takes it). The modules implement
# deform_roi_pool_forward/backward and deform_psroi_pool_forward/backward.
dispatch.register("deform_roi_pool", {"triton": f"{__package__}.triton.roi", "reference": f"{__package__}.reference"})
dispatch.register("deform_psroi_pool", {"triton": f"{__package__}.triton.ps", "reference": f"{__package__}.reference"})


def _impl(input: Tensor, backend: str):
    return dispatch.implementation("deform_roi_pool", input, backend)


def roi_pool_forward(input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, backend) -> Tensor:
    """The op's forward (also the eager fast path's: common/eager.run_eager)."""
    return _impl(input, backend).deform_roi_pool_forward(input, rois, offset, output_size, spatial_scale,
                                                         sampling_ratio, gamma)


def roi_pool_backward(grad_out, input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, backend,
                      needs):
    """Gradients (input, offset); None where not needed (or without an offset)."""
    return _impl(input, backend).deform_roi_pool_backward(grad_out, input, rois, offset, output_size, spatial_scale,
                                                          sampling_ratio, gamma, *needs)


@torch.library.custom_op("deformconv::deform_roi_pool", mutates_args=())
def deform_roi_pool_op(input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size: List[int],
                       spatial_scale: float, sampling_ratio: int, gamma: float, backend: str) -> Tensor:
    return roi_pool_forward(input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, backend)


@deform_roi_pool_op.register_fake
def _(input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, backend):
    return input.new_empty(rois.shape[0], input.shape[1], *output_size)


@torch.library.custom_op("deformconv::deform_roi_pool_backward", mutates_args=())
def deform_roi_pool_backward_op(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor],
                                output_size: List[int], spatial_scale: float, sampling_ratio: int, gamma: float,
                                needs: List[bool], backend: str) -> Tuple[Tensor, Tensor]:
    """Gradients (input, offset); one not needed (or without an offset) comes back empty."""
    g_in, g_off = roi_pool_backward(grad_out, input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma,
                                    backend, needs)
    return (g_in if g_in is not None else input.new_empty(0), g_off if g_off is not None else input.new_empty(0))


@deform_roi_pool_backward_op.register_fake
def _(grad_out, input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, needs, backend):
    fmt = torch.channels_last if input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous() \
        else torch.contiguous_format
    g_in = torch.empty_like(input, memory_format=fmt) if needs[0] else input.new_empty(0)
    g_off = torch.empty_like(offset, memory_format=torch.contiguous_format) if needs[1] and offset is not None \
        else input.new_empty(0)
    return g_in, g_off


def _setup(ctx, inputs, output):
    input, rois, offset, *params = inputs
    ctx.save_for_backward(input, rois, offset)
    ctx.params = params


def _backward(ctx, grad_out):
    input, rois, offset = ctx.saved_tensors
    need_in, need_off = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[2]) and offset is not None
    if not (need_in or need_off):
        return (None,) * 8
    *params, backend = ctx.params
    g_in, g_off = deform_roi_pool_backward_op(grad_out, input, rois, offset, *params, [need_in, need_off], backend)
    return (g_in if need_in else None, None, g_off if need_off else None) + (None,) * 5


deform_roi_pool_op.register_autograd(_backward, setup_context=_setup)
register_autocast("deform_roi_pool", keep=(1,))


# --- the position-sensitive variant ---------------------------------------------------------------------


def _ps_impl(input: Tensor, backend: str):
    return dispatch.implementation("deform_psroi_pool", input, backend)


def psroi_pool_forward(input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size,
                       sample_per_part, trans_std, backend) -> Tensor:
    """The op's forward (also the eager fast path's)."""
    return _ps_impl(input, backend).deform_psroi_pool_forward(input, rois, offset, spatial_scale, pooled_size,
                                                              output_dim, group_size, part_size, sample_per_part,
                                                              trans_std)


def psroi_pool_backward(grad_out, input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size,
                        sample_per_part, trans_std, backend, needs):
    """Gradients (input, offset); None where not needed (or without an offset)."""
    return _ps_impl(input, backend).deform_psroi_pool_backward(grad_out, input, rois, offset, spatial_scale,
                                                               pooled_size, output_dim, group_size, part_size,
                                                               sample_per_part, trans_std, *needs)


@torch.library.custom_op("deformconv::deform_psroi_pool", mutates_args=())
def deform_psroi_pool_op(input: Tensor, rois: Tensor, offset: Optional[Tensor], spatial_scale: float,
                         pooled_size: int, output_dim: int, group_size: int, part_size: int, sample_per_part: int,
                         trans_std: float, backend: str) -> Tensor:
    return psroi_pool_forward(input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size,
                              sample_per_part, trans_std, backend)


@deform_psroi_pool_op.register_fake
def _(input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size, sample_per_part, trans_std,
      backend):
    return input.new_empty(rois.shape[0], output_dim, pooled_size, pooled_size)


@torch.library.custom_op("deformconv::deform_psroi_pool_backward", mutates_args=())
def deform_psroi_pool_backward_op(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor],
                                  spatial_scale: float, pooled_size: int, output_dim: int, group_size: int,
                                  part_size: int, sample_per_part: int, trans_std: float, needs: List[bool],
                                  backend: str) -> Tuple[Tensor, Tensor]:
    """Gradients (input, offset); one not needed (or without an offset) comes back empty."""
    g_in, g_off = psroi_pool_backward(grad_out, input, rois, offset, spatial_scale, pooled_size, output_dim,
                                      group_size, part_size, sample_per_part, trans_std, backend, needs)
    return (g_in if g_in is not None else input.new_empty(0), g_off if g_off is not None else input.new_empty(0))


@deform_psroi_pool_backward_op.register_fake
def _(grad_out, input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size, sample_per_part,
      trans_std, needs, backend):
    g_in = torch.empty_like(input, memory_format=torch.contiguous_format) if needs[0] else input.new_empty(0)
    g_off = torch.empty_like(offset, memory_format=torch.contiguous_format) if needs[1] and offset is not None \
        else input.new_empty(0)
    return g_in, g_off


def _ps_backward(ctx, grad_out):
    input, rois, offset = ctx.saved_tensors
    need_in, need_off = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[2]) and offset is not None
    if not (need_in or need_off):
        return (None,) * 11
    *params, backend = ctx.params
    g_in, g_off = deform_psroi_pool_backward_op(grad_out, input, rois, offset, *params, [need_in, need_off], backend)
    return (g_in if need_in else None, None, g_off if need_off else None) + (None,) * 8


deform_psroi_pool_op.register_autograd(_ps_backward, setup_context=_setup)
register_autocast("deform_psroi_pool", keep=(1,))
