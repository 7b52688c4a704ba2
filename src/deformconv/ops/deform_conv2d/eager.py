"""deform_conv2d's eager fast path: the op's forward and backward implementations (op.py) around autograd Functions,
without the custom-op dispatcher (common/eager.py says why and when), and on the Triton backend a call signature's
planned launches (triton/call.py, through common/eager.run_planned)."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ... import config
from ...checks import check_deform_conv2d_args, suggest_memory_format
from ...compat import conv_tf32
from ..common import dispatch
from ..common.autocast import autocast_inputs
from ..common.eager import autocasting, fast_path_ok, needs_grad, once_differentiable, run_planned, without_autocast
from .modulation import joined_grad, split_into
from .op import _setup_context, backend_for, backward_impl, forward_impl, input_grads


class DeformConv2dFunction(torch.autograd.Function):
    """The op's autograd registration (op.py) around the implementations themselves."""

    @staticmethod
    def forward(ctx, input, offset, weight, bias, mask, stride, padding, dilation, backend):
        args = (input, offset, weight, bias, mask, stride, padding, dilation, backend)
        # what the backend's forward keeps for its backward (the Triton backend: the packed weight, one aten copy
        # fewer a step), held until the backward; only when a gradient can be asked for
        keep = {} if any(ctx.needs_input_grad[:5]) else None
        out = without_autocast("cuda" if input.is_cuda else "cpu", forward_impl, *args, keep=keep)
        _setup_context(ctx, args, out, keep)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return input_grads(ctx, grad_out, backward_impl, pass_kept=True)


def forward_without_grad(args: tuple) -> Tensor:
    """DeformConv2dFunction's forward where no gradient can be asked for (grad mode off, or no input requiring one):
    no autograd node to build (inference calls, which gain the node's host time)."""
    return without_autocast("cuda" if args[0].is_cuda else "cpu", forward_impl, *args)


class ModulatedDeformConv2dFunction(torch.autograd.Function):
    """A modulated layer's deform_conv2d taken from its offset conv's output in one autograd node: split_into, the
    argument checks and DeformConv2dFunction's forward; backward, DeformConv2dFunction's and joined_grad. One node a
    layer where the split and the op took two: each Python node costs host time of its own both ways
    (benchmarks/README.md, Where the host time goes: the floor). Arguments: input, out, weight, bias (already cast
    under autocast), n_off, stride, padding, dilation (lists), backend, and whether autocast is on."""

    @staticmethod
    def forward(ctx, input, out, weight, bias, n_off, stride, padding, dilation, backend, autocasting):
        offset, mask = split_into(out, n_off)
        check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask,
                                 allow_mixed_dtypes=autocasting)
        args = (input, offset, weight, bias, mask, stride, padding, dilation, backend)
        keep = {} if any(ctx.needs_input_grad[:4]) else None
        result = without_autocast("cuda" if input.is_cuda else "cpu", forward_impl, *args, keep=keep)
        _setup_context(ctx, args, result, keep)
        ctx.n_off, ctx.shape, ctx.memory_format = n_off, out.shape, suggest_memory_format(out)
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_result):
        n_in, n_out, n_w, n_b = (bool(n) for n in ctx.needs_input_grad[:4])
        saved = ctx.saved_tensors  # read once (activation checkpointing allows no more)
        input, offset, weight, mask = saved[:4]
        stride, padding, dilation, backend = ctx.params
        needs = [n_in, n_out, n_out, n_w, n_b and ctx.has_bias]  # input, offset, mask, weight, bias
        g_in = g_out = g_w = g_b = None
        if any(needs):
            g_in, g_off, g_mask, g_w, g_b = backward_impl(grad_result, input, offset, weight, mask, stride, padding,
                                                          dilation, needs, backend,
                                                          keep=dict(zip(ctx.kept_names, saved[4:])))
            if n_out:
                g_out = joined_grad(ctx.shape, ctx.memory_format, ctx.n_off, mask, g_off, g_mask)
        return g_in, g_out, g_w, g_b, None, None, None, None, None, None


def _autocast(tensors: List[Optional[Tensor]], device_type: str, backend: Optional[str]) -> List[Optional[Tensor]]:
    """The cast the op's autocast rule makes (op.py), done for the eager fast path; but where the Triton kernels
    run, a float32 weight and bias stay float32: the kernels use them in the autocast dtype and return that cast's
    gradients bit for bit (triton/backward_weight.py), without the casts' kernels and autograd nodes."""
    cast = autocast_inputs(tensors, device_type, keep=(2, 3))
    weight, bias = tensors[2], tensors[3]
    if not (weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and backend_for(cast[0], backend or "") == "triton"):
        cast[2:4] = autocast_inputs(tensors[2:4], device_type)
    return cast


def _geometry_arg(v):
    """stride, padding or dilation as a signature holds it (hashable), or None where it is of another type (the general
    path's checks say what is wrong with it)."""
    if type(v) is int or type(v) is tuple:
        return v
    return tuple(v) if type(v) is list else None


def _planned(tensors: list, stride, padding, dilation, backend: Optional[str], n_off: Optional[int] = None
             ) -> Optional[Tensor]:
    """The call through its signature's Call of the Triton kernels (triton/call.py; common/eager.run_planned), or
    None where it takes the general path: eager.run_planned says when; also arguments of other types, an empty batch,
    another backend. The signature holds the settings the plans depend on (cuDNN's TF32 setting, DEFORMCONV_AUTOTUNE,
    DEFORMCONV_BACKEND); the backward's are looked up by the Call. n_off: a modulated layer's call
    (modulated_from_offset_conv), tensors (input, out, weight, bias)."""
    geometry = (_geometry_arg(stride), _geometry_arg(padding), _geometry_arg(dilation))
    if None in geometry or (backend is not None and type(backend) is not str):
        return None
    extras = (geometry, backend, n_off, conv_tf32(), config.autotune(), config.backend())
    cast = _autocast if n_off is None else _autocast_modulated
    return run_planned("dcn_eager", tensors, extras,
                       lambda t: _new_call(t, stride, padding, dilation, backend, n_off),
                       cast=lambda t, device_type: cast(t, device_type, backend), strided=True)


def _autocast_modulated(tensors: list, device_type: str, backend: Optional[str]) -> list:
    return _autocast([*tensors, None], device_type, backend)[:4]


def _new_call(tensors: list, stride, padding, dilation, backend: Optional[str], n_off: Optional[int]):
    """_planned's Call for a new signature (the checks run here: bad input raises), or None: the general path."""
    input, weight, bias = tensors[0], tensors[2], tensors[3]
    if n_off is None:
        offset, mask = tensors[1], tensors[4]
    else:
        with torch.no_grad():  # for the checks only
            offset, mask = split_into(tensors[1], n_off)
    geo = check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask,
                                   allow_mixed_dtypes=autocasting(input))
    if backend is not None:
        dispatch.backend_argument("deform_conv2d", backend)  # an unknown name raises, listing the known ones
    if input.shape[0] == 0 or backend_for(input, backend or "") != "triton":
        return None
    from .triton.call import call_for

    return call_for(geo.stride, geo.padding, geo.dilation, n_off, tensors[1] if n_off is not None else None)


def deform_conv2d(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding, dilation,
                  mask: Optional[Tensor], backend: Optional[str]) -> Tensor:
    """The public function's call outside tracing and export: a planned call of the Triton kernels where one applies,
    else the argument checks and the op's implementations through DeformConv2dFunction (plain eager) or the registered
    op (everything else: common/eager.fast_path_ok)."""
    planned = _planned([input, offset, weight, bias, mask], stride, padding, dilation, backend)
    if planned is not None:
        return planned
    autocast_on = autocasting(input)
    geo = check_deform_conv2d_args(
        input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes=autocast_on
    )
    if backend is not None:
        dispatch.backend_argument("deform_conv2d", backend)  # an unknown name raises, listing the known ones
    tensors = [input, offset, weight, bias, mask]
    if autocast_on:
        tensors = _autocast(tensors, input.device.type, backend)
    args = (*tensors, list(geo.stride), list(geo.padding), list(geo.dilation), backend or "")
    if fast_path_ok(tensors):  # plain eager: the same impls, without the dispatcher
        return DeformConv2dFunction.apply(*args) if needs_grad(tensors) else forward_without_grad(args)
    return torch.ops.deformconv.deform_conv2d(*args)


def modulated_from_offset_conv(input: Tensor, out: Tensor, n_off: int, weight: Tensor, bias: Optional[Tensor],
                               stride: List[int], padding: List[int], dilation: List[int]) -> Optional[Tensor]:
    """A modulated layer's deform_conv2d from its offset conv's output ``out``: offsets its first n_off channels, the
    mask the sigmoid of the others; in one autograd node (ModulatedDeformConv2dFunction). None where the call
    must take the split and deform_conv2d one after the other (they give the same result): not a plain eager call
    (fast_path_ok), or under autocast an ``out`` not in the autocast dtype (the split runs in out's dtype, the cast
    after it)."""
    autocast_on = autocasting(input)
    tensors = [input, out, weight, bias]
    if autocast_on:
        device_type = input.device.type
        if out.dtype != torch.get_autocast_dtype(device_type):
            return None
    planned = _planned(tensors, stride, padding, dilation, None, n_off)
    if planned is not None:
        return planned
    if autocast_on:
        tensors = _autocast([input, out, weight, bias, None], device_type, None)[:4]
    if not fast_path_ok(tensors):
        return None
    if needs_grad(tensors):
        return ModulatedDeformConv2dFunction.apply(*tensors, n_off, stride, padding, dilation, "", autocast_on)
    input, out, weight, bias = tensors
    offset, mask = split_into(out, n_off)
    check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask,
                             allow_mixed_dtypes=autocast_on)
    return forward_without_grad((input, offset, weight, bias, mask, stride, padding, dilation, ""))
