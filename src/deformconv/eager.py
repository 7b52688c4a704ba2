"""The eager fast path: the op's forward and backward without the custom-op dispatcher.

Going through ``torch.ops.deformconv.deform_conv2d`` costs a few hundred microseconds of Python per
training step (dispatcher, autograd wrapper, aliasing checks), more than the kernels themselves at small
shapes. In plain eager calls the public function runs the same ``forward_impl``/``backward_impl`` through
this ``autograd.Function`` instead. Everything else (torch.compile, torch.export, jit tracing, autocast,
tensor subclasses such as FakeTensor, functorch transforms, dispatch and function modes, devices other
than CPU and CUDA) keeps the registered op, which those systems need to see.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .library import backward_impl, forward_impl, grad_needs

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DEVICES = ("cuda", "cpu")


def _is_functorch_wrapped(t: Tensor) -> bool:
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(t)) if check is not None else True  # unknown torch: be safe, take the op


def fast_path_ok(tensors: List[Optional[Tensor]], autocasting: bool) -> bool:
    """Whether a call may skip the registered op: a plain eager call on plain CPU/CUDA tensors."""
    if autocasting or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.device.type not in _DEVICES or _is_functorch_wrapped(t):
            return False
    return True


class DeformConv2dFunction(torch.autograd.Function):
    """Same forward, saved tensors and backward as the op's autograd registration (library.py)."""

    @staticmethod
    def forward(ctx, input, offset, weight, bias, mask, stride, padding, dilation, backend):
        ctx.save_for_backward(input, offset, weight, mask)
        ctx.has_bias = bias is not None
        ctx.has_mask = mask is not None
        ctx.params = (stride, padding, dilation, backend)
        return forward_impl(input, offset, weight, bias, mask, stride, padding, dilation, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        input, offset, weight, mask = ctx.saved_tensors
        stride, padding, dilation, backend = ctx.params
        needs = grad_needs(ctx.needs_input_grad, ctx.has_bias, ctx.has_mask)
        if not any(needs):
            return (None,) * 9
        g_in, g_off, g_mask, g_w, g_b = backward_impl(
            grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend)
        return g_in, g_off, g_w, g_b, g_mask, None, None, None, None
