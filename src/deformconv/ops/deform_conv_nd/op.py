"""The N-d forms' operators, one each: ``deformconv::deform_conv1d``, ``deform_conv3d`` and
``deform_conv_transpose1d/2d/3d`` (deform_conv2d is its own family's), with their backward ops, fake
implementations, autograd formulas and autocast rules.

Every op takes the same arguments: (input, offset, weight, bias, mask, stride, padding, dilation, output_padding,
groups, backend); the convolutions' output_padding is zeros and their groups Cin / weight.shape[1]. ``backend`` is a
name or "" (automatic: common/dispatch.py). Arguments reach the ops checked (deformconv.deform_conv_nd).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..common import dispatch
from ..common.autocast import register_autocast
from .reference import out_size, transposed_size

# op name -> (rank, transposed)
FORMS: Dict[str, Tuple[int, bool]] = {
    "deform_conv1d": (1, False), "deform_conv3d": (3, False),
    "deform_conv_transpose1d": (1, True), "deform_conv_transpose2d": (2, True), "deform_conv_transpose3d": (3, True),
}

# Every backend's module has three primitives: deform_conv(input, offset, weight, bias, mask, stride, padding,
# dilation, positions=None), deform_conv_transpose(..., output_padding, dilation, groups) and
# deform_conv_backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs) -> gradients (input,
# offset, weight, mask); the ops' forward and backward below build on them. No cpu backend: the reference,
# vectorised PyTorch, is the CPU path.
for _name in FORMS:
    dispatch.register(_name, {"triton": f"{__package__}.triton", "reference": f"{__package__}.reference"})


def _output(name: str, input: Tensor, weight: Tensor, stride, padding, dilation, output_padding, groups) -> Tensor:
    kernel, size = list(weight.shape[2:]), list(input.shape[2:])
    if FORMS[name][1]:
        spatial, channels = transposed_size(size, kernel, stride, padding, output_padding, dilation), \
            weight.shape[1] * groups
    else:
        spatial, channels = out_size(size, kernel, stride, padding, dilation), weight.shape[0]
    return input.new_empty((input.shape[0], channels, *spatial))


def _gradients(impl, transposed: bool, grad_out, input, offset, weight, bias, mask, stride, padding, dilation,
               needs) -> Tuple[Optional[Tensor], ...]:
    """Gradients (input, offset, weight, bias, mask), None where needs says so. The transposed form's are the
    convolution's with the roles swapped (it is the convolution's adjoint in its input: <g, Aᵀu> = <Ag, u>):
    grad_input is the convolution of grad_out at the input's positions, and the offset, weight and mask gradients
    the convolution's at input grad_out and gradient input."""
    need_in, need_off, need_w, need_b, need_mask = (bool(n) for n in needs)
    grad_b = None
    if need_b and bias is not None:
        grad_b = grad_out.sum([d for d in range(grad_out.dim()) if d != 1]).to(bias.dtype)
    if not transposed:
        g_in, g_off, g_w, g_mask = impl.deform_conv_backward(grad_out, input, offset, weight, mask, stride, padding,
                                                             dilation, (need_in, need_off, need_w, need_mask))
        # contiguous, as the fake promises (the Triton backend sums grad_input channels-last; autograd would copy
        # it to the input's layout anyway)
        return None if g_in is None else g_in.contiguous(), g_off, g_w, grad_b, g_mask
    g = grad_out.to(input.dtype)
    g_in = None
    if need_in:
        g_in = impl.deform_conv(g, offset, weight, None, mask, stride, padding, dilation, input.shape[2:])
    _, g_off, g_w, g_mask = impl.deform_conv_backward(input, g, offset, weight, mask, stride, padding, dilation,
                                                      (False, need_off, need_w, need_mask))
    return g_in, g_off, g_w, grad_b, g_mask


def _define(name: str):
    transposed = FORMS[name][1]

    def forward(input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend):
        impl = dispatch.implementation(name, input, backend)
        if transposed:
            return impl.deform_conv_transpose(input, offset, weight, bias, mask, stride, padding, output_padding,
                                              dilation, groups)
        return impl.deform_conv(input, offset, weight, bias, mask, stride, padding, dilation)

    def backward(grad_out, input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups,
                 backend, needs):
        impl = dispatch.implementation(name, input, backend)
        return _gradients(impl, transposed, grad_out, input, offset, weight, bias, mask, stride, padding, dilation,
                          needs)

    def op_fn(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
              stride: List[int], padding: List[int], dilation: List[int], output_padding: List[int], groups: int,
              backend: str) -> Tensor:
        if input.shape[0] == 0:
            return _output(name, input, weight, stride, padding, dilation, output_padding, groups).zero_()
        return forward(input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend)

    op = torch.library.custom_op(f"deformconv::{name}", op_fn, mutates_args=())

    @op.register_fake
    def _(input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend):
        return _output(name, input, weight, stride, padding, dilation, output_padding, groups)

    def backward_fn(grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor],
                    mask: Optional[Tensor], stride: List[int], padding: List[int], dilation: List[int],
                    output_padding: List[int], groups: int, backend: str,
                    needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        if input.shape[0] == 0:
            grads = [torch.zeros_like(t) if t is not None and need else None
                     for t, need in zip((input, offset, weight, bias, mask), needs)]
        else:
            grads = backward(grad_out, input, offset, weight, bias, mask, stride, padding, dilation, output_padding,
                             groups, backend, needs)
        # outputs of a custom op may not alias: each one not asked for is its own empty tensor
        return tuple(g if g is not None else input.new_empty(0) for g in grads)

    backward_op = torch.library.custom_op(f"deformconv::{name}_backward", backward_fn, mutates_args=())

    @backward_op.register_fake
    def _(grad_out, input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend,
          needs):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if t is not None and need
                     else input.new_empty(0) for t, need in zip((input, offset, weight, bias, mask), needs))

    def setup(ctx, inputs, output):
        input, offset, weight, bias, mask, *params = inputs
        ctx.save_for_backward(input, offset, weight, bias, mask)
        ctx.params = params

    def autograd_backward(ctx, grad_out):
        needs = [bool(n) for n in ctx.needs_input_grad[:5]]
        if not any(needs):
            return (None,) * 11
        grads = backward_op(grad_out, *ctx.saved_tensors, *ctx.params, needs)
        return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 6

    op.register_autograd(autograd_backward, setup_context=setup)
    register_autocast(name)
    return op, forward, backward


OPS = {name: _define(name) for name in FORMS}
