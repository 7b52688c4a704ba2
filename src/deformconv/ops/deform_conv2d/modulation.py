"""A modulated layer's offset conv output split into deform_conv2d's offset and mask, and the gradient joined back:
one autograd node and two GPU kernels each way (split_offset_mask), used by the modules, the eager path and the
planned calls whose kernels cannot read the output as it is (triton/geometry.reads_logits)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...checks import suggest_memory_format
from ..common.eager import fast_path_ok, once_differentiable


def split_into(out: Tensor, n_off: int):
    """(offset, mask) of a modulated layer's offset conv output [N, C, H, W]: its first n_off channels as a contiguous
    copy and the sigmoid of the others written into a fresh buffer (two GPU kernels), as the kernels read them."""
    n, c, h, w = out.shape
    offset = out[:, :n_off].contiguous()
    mask = torch.empty((n, c - n_off, h, w), dtype=out.dtype, device=out.device)
    torch.sigmoid(out[:, n_off:], out=mask)
    return offset, mask


def joined_grad(shape, memory_format, n_off: int, mask: Tensor, grad_offset: Optional[Tensor],
                grad_mask: Optional[Tensor]) -> Tensor:
    """The gradient of split_into's input from those of its outputs (None: zero), in the input's memory format (two
    GPU kernels)."""
    grad = torch.empty(shape, dtype=mask.dtype, device=mask.device, memory_format=memory_format)
    if grad_offset is None:
        grad[:, :n_off].zero_()
    else:
        grad[:, :n_off].copy_(grad_offset)
    if grad_mask is None:
        grad[:, n_off:].zero_()
    else:
        torch.ops.aten.sigmoid_backward.grad_input(grad_mask, mask, grad_input=grad[:, n_off:])
    return grad


class _SplitOffsetMask(torch.autograd.Function):
    """split_offset_mask's autograd node."""

    @staticmethod
    def forward(ctx, out: Tensor, n_off: int):
        offset, mask = split_into(out, n_off)
        ctx.save_for_backward(mask)
        ctx.n_off, ctx.shape, ctx.memory_format = n_off, out.shape, suggest_memory_format(out)
        return offset, mask

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_offset, grad_mask):
        (mask,) = ctx.saved_tensors
        return joined_grad(ctx.shape, ctx.memory_format, ctx.n_off, mask, grad_offset, grad_mask), None


def split_offset_mask(out: Tensor, n_off: int):
    """A modulated layer's (offset, mask) from its offset conv's output [N, C, H, W]: its first n_off channels, and the
    sigmoid of the others; or None where the call must take torch's own ops (fast_path_ok: under torch.compile they
    fuse there). Both come contiguous, as the kernels read them, from one autograd node and two GPU kernels each way,
    where slices, a sigmoid and the op's contiguous copies take three nodes, three kernels forward and eight
    backward."""
    if not fast_path_ok([out]):
        return None
    return _SplitOffsetMask.apply(out, n_off)
