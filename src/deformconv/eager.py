"""The eager fast path: the ops' forward and backward without the custom-op dispatcher.

Going through ``torch.ops.deformconv.*`` costs a few hundred microseconds of Python per training step (dispatcher,
autograd wrapper, aliasing checks), more than the kernels themselves at small shapes. In plain eager calls (under
autocast too, the inputs cast as the op's autocast rule casts them) the public functions run the same
implementations through an ``autograd.Function`` instead: ``DeformConv2dFunction`` for deform_conv2d, ``run_eager``
for the other ops. Everything else (torch.compile, torch.export, jit tracing, tensor subclasses such as FakeTensor,
functorch transforms, dispatch and function modes, devices other than CPU and CUDA) keeps the registered op, which
those systems need to see.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable as _torch_once_differentiable

from .checks import PLAIN_TENSOR_TYPES, check_deform_conv2d_args, suggest_memory_format
from .config import options
from .library import _setup_context, autocast_inputs, backward_impl, forward_impl, input_grads
from .ops.common.launch import remember

_AUTOCAST_KEYS = {d: torch._C.DispatchKeySet(
    torch._C.DispatchKey.__members__["Autocast" + torch._C._dispatch_key_for_device(d)]) for d in ("cuda", "cpu")}

# functorch's check, looked up once (a torch without it: every tensor counts as wrapped, so calls take the op)
_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def once_differentiable(backward):
    """torch's ``once_differentiable`` for the nodes' backwards, without its cost where it does nothing: in a backward
    run without ``create_graph`` grad mode is off already, and torch's wrapper then only enters ``no_grad`` around
    the call (microseconds a node, each step). With grad mode on (``create_graph=True``) torch's wrapper runs as it
    is: a second differentiation raises its error instead of passing silent zeros."""
    wrapped = _torch_once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        if torch.is_grad_enabled():
            return wrapped(ctx, *grads)
        return backward(ctx, *grads)

    return run


def autocasting(input) -> bool:
    """Whether autocast is on for input's device type (False for a non-tensor, or a device type autocast does not
    know: meta, ...)."""
    if not isinstance(input, Tensor):
        return False
    try:
        return torch.is_autocast_enabled(input.device.type)
    except RuntimeError:
        return False


def without_autocast(device_type: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with autocast off on device_type where it is on: the inputs are cast already, and inside,
    as in the ops' autocast rule (library.py), autocast is off. (No guard where autocast is off: calls pay for it.)"""
    if torch.is_autocast_enabled(device_type):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS[device_type]):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def fast_path_ok(tensors: List[Optional[Tensor]]) -> bool:
    """Whether a call may skip the registered op: a plain eager call on plain CPU/CUDA tensors (under autocast too,
    its inputs cast first: functional.py). (Called at every call: tensor attributes that build no objects, is_cuda /
    is_cpu rather than device.type.)"""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False
    wrapped = _FUNCTORCH_WRAPPED
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TENSOR_TYPES or not (t.is_cuda or t.is_cpu) or wrapped is None or wrapped(t):
            return False
    return True


class DeformConv2dFunction(torch.autograd.Function):
    """The op's autograd registration (library.py) around the implementations themselves."""

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


def needs_grad(tensors: List[Optional[Tensor]]) -> bool:
    """Whether autograd records a call on these tensors: grad mode on and one of them requiring grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _EagerOp(torch.autograd.Function):
    """The new ops' eager fast path (run_eager): their forward and backward implementations around one autograd node,
    without the custom-op dispatcher. Arguments: forward(*args) -> out; backward(grad_out, *args, needs) -> the
    gradients of the args at `differentiable` (needs: which of those are asked for); then the op's own arguments."""

    @staticmethod
    def forward(ctx, forward, backward, differentiable, *args):
        out = forward(*args)
        ctx.backward_fn, ctx.differentiable = backward, differentiable
        ctx.is_tensor = [isinstance(a, Tensor) for a in args]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if t else a for a, t in zip(ctx.others, ctx.is_tensor)]
        needs = [bool(ctx.needs_input_grad[3 + i]) for i in ctx.differentiable]
        grads = [None] * len(args)
        if any(needs):
            for i, g in zip(ctx.differentiable, ctx.backward_fn(grad_out, *args, needs)):
                grads[i] = g
        return (None, None, None, *grads)


class PlannedCall(torch.autograd.Function):
    """A call of an op whose launches were worked out once for its call signature (a family's ``Call``, e.g.
    ops/msda/triton.py's), around one autograd node: forward(call, *tensors) = call.forward(*tensors); the backward
    takes call.grads(grad_out, *tensors, needs) -> one gradient (or None) per tensor. The leanest eager path: no
    argument handling beyond what the Call itself needs. A Call with ``keeps`` set returns (out, kept) from
    forward_saving(*tensors) where a gradient can be asked for: tensors made in the forward that its backward reuses
    (deform_conv2d's packed weight), saved beside the inputs and handed back as grads(..., kept=kept)."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call, ctx.count, ctx.keeps = call, len(tensors), getattr(call, "keeps", False)
        if ctx.keeps:
            out, kept = call.forward_saving(*tensors)
            ctx.save_for_backward(*tensors, *kept)
            return out
        ctx.save_for_backward(*tensors)
        return call.forward(*tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        needs = ctx.needs_input_grad[1:]
        if not any(needs):
            return (None,) * (1 + len(needs))
        saved = ctx.saved_tensors  # read once (activation checkpointing allows no more)
        if ctx.keeps:
            return (None, *ctx.call.grads(grad_out, *saved[:ctx.count], needs, kept=saved[ctx.count:]))
        return (None, *ctx.call.grads(grad_out, *saved, needs))


_UNSEEN = object()


def run_planned(cache: str, tensors: List[Optional[Tensor]], extras: tuple, new_call, keep=(), each_call=None,
                cast=None, strided: bool = False) -> Optional[Tensor]:
    """An op's call through its call signature's Call (PlannedCall), or None where it takes the general path: not a
    plain eager call (fast_path_ok), a tensor not contiguous (unless strided), or new_call(tensors) gave None for the
    signature.

    The signature: extras (the op's plain arguments and backend), autocast's state, and each tensor's shape, dtype,
    device and pointer offset from a 16-byte boundary (with strided, its strides too; None for a missing optional
    tensor): all that the checks, the backend choice and a compiled launch depend on. new_call runs once a signature
    (its checks raise on bad input); options' cache ``cache`` keeps what it returned. Under autocast the floating
    tensors are cast as the op's autocast rule casts them (all but those at the indices in keep), or by
    cast(tensors, device_type) where given. each_call(): what must run at every call all the same (checks of tensor
    contents)."""
    if not fast_path_ok(tensors):
        return None
    device_type = "cuda" if tensors[0].is_cuda else "cpu"
    autocast_on = torch.is_autocast_enabled(device_type)
    if autocast_on:
        tensors = cast(tensors, device_type) if cast is not None else autocast_inputs(tensors, device_type, keep)
    key = [extras, autocast_on]
    for t in tensors:
        if t is None:
            key.append(None)
        elif strided:
            key.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))
        elif not t.is_contiguous():
            return None
        else:
            key.append((t.shape, t.dtype, t.device, t.data_ptr() % 16))
    key = tuple(key)
    calls = options.cache(cache)
    call = calls.get(key, _UNSEEN)
    if call is _UNSEEN:
        call = remember(calls, key, new_call(tensors))
    if call is None:
        return None
    if each_call is not None:
        each_call()
    if needs_grad(tensors):
        return PlannedCall.apply(call, *tensors)
    return call.forward(*tensors)


def run_eager(forward, backward, differentiable, args, keep=()) -> Optional[Tensor]:
    """A new op's call on its eager fast path, or None where it must take the registered op (fast_path_ok says why).
    Under autocast the floating arguments are cast as the op's autocast rule casts them (all but the indices in keep),
    and the implementations run with autocast off, as inside the op."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    device_type = "cuda" if tensors[0].is_cuda else "cpu"
    autocasting = torch.is_autocast_enabled(device_type)
    if autocasting:
        args = autocast_inputs(args, device_type, keep)
        tensors = [a for a in args if isinstance(a, Tensor)]
    if not fast_path_ok(tensors):
        return None
    if needs_grad(tensors):
        return without_autocast(device_type, _EagerOp.apply, forward, backward, tuple(differentiable), *args)
    return without_autocast(device_type, forward, *args)  # no autograd node (inference)


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
