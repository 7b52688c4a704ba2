"""The ``deformconv::ms_deform_attn`` operator: torch.library registration of the forward and backward ops, their
fake implementations, the autograd formula and the autocast rule. ``backend`` is a name or "" (automatic:
common/dispatch.py)."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ..common import dispatch
from ..common.autocast import register_autocast

# Every backend's module has ms_deform_attn_forward and ms_deform_attn_backward.
dispatch.register("ms_deform_attn", {"triton": f"{__package__}.triton", "cpu": f"{__package__}.cpu",
                                     "reference": f"{__package__}.reference"})


def _impl(value: Tensor, backend: str):
    return dispatch.implementation("ms_deform_attn", value, backend)


def msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend) -> Tensor:
    """The op's forward (also the eager fast path's: common/eager.run_eager)."""
    return _impl(value, backend).ms_deform_attn_forward(value, spatial_shapes, level_start_index, sampling_locations,
                                                        attention_weights)


def msda_backward(grad_out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend,
                  needs):
    """Gradients (value, sampling_locations, attention_weights); None where needs says so."""
    return _impl(value, backend).ms_deform_attn_backward(grad_out, value, spatial_shapes, level_start_index,
                                                         sampling_locations, attention_weights, needs)


@torch.library.custom_op("deformconv::ms_deform_attn", mutates_args=())
def ms_deform_attn_op(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
                      attention_weights: Tensor, backend: str) -> Tensor:
    return msda_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend)


@ms_deform_attn_op.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend):
    n, _, m, d = value.shape
    return value.new_empty(n, sampling_locations.shape[1], m * d)


@torch.library.custom_op("deformconv::ms_deform_attn_backward", mutates_args=())
def ms_deform_attn_backward_op(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                               sampling_locations: Tensor, attention_weights: Tensor, needs: List[bool],
                               backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (value, sampling_locations, attention_weights); one not needed comes back empty."""
    grads = msda_backward(grad_out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                          backend, needs)
    return tuple(g if g is not None else value.new_empty(0) for g in grads)  # type: ignore[return-value]


@ms_deform_attn_backward_op.register_fake
def _(grad_out, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, needs, backend):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need else value.new_empty(0)
                 for t, need in zip((value, sampling_locations, attention_weights), needs))


def _setup(ctx, inputs, output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    ctx.backend = backend


def _backward(ctx, grad_out):
    value, shapes, starts, loc, attn = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [bool(n[0]), bool(n[3]), bool(n[4])]
    if not any(needs):
        return (None,) * 6
    g_v, g_loc, g_attn = ms_deform_attn_backward_op(grad_out, value, shapes, starts, loc, attn, needs, ctx.backend)
    pick = lambda g, need: g if need else None  # noqa: E731
    return pick(g_v, needs[0]), None, None, pick(g_loc, needs[1]), pick(g_attn, needs[2]), None


ms_deform_attn_op.register_autograd(_backward, setup_context=_setup)
# Under autocast the sampling locations and the attention weights stay as they come (fp32; the value and the output
# take the autocast dtype). Normalised coordinates in 16 bits would be off by up to 1/256 of a level's width (bf16), a
# pixel and more on a large level. The weights' gradient goes into their softmax's backward, a·(g − Σ a·g), a
# difference of nearly equal terms that keeps only the digits g has: kept in fp32 it carries fp32's rounding, not
# bf16's (transformers' own path keeps the weights in fp32 too), and no cast kernel runs for them.
KEEP = (3, 4)
register_autocast("ms_deform_attn", keep=KEEP)
