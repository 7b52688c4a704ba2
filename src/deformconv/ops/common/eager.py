"""The eager fast path's mechanism: the ops' forward and backward without the custom-op dispatcher.

Going through ``torch.ops.deformconv.*`` costs a few hundred microseconds of Python per training step (dispatcher,
autograd wrapper, aliasing checks), more than the kernels themselves at small shapes. In plain eager calls (under
autocast too, the inputs cast as the op's autocast rule casts them) the public functions run the same
implementations through an ``autograd.Function`` instead: deform_conv2d's own (ops/deform_conv2d/eager.py),
``run_eager`` for the other ops, ``run_planned`` for a call signature's planned launches. Everything else
(torch.compile, torch.export, jit tracing, tensor subclasses such as FakeTensor, functorch transforms, dispatch and
function modes, devices other than CPU and CUDA) keeps the registered op, which those systems need to see.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable as _torch_once_differentiable

from ...checks import PLAIN_TENSOR_TYPES
from ...config import options
from .autocast import autocast_inputs
from .launch import remember

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
    as in the ops' autocast rule (autocast.py), autocast is off. (No guard where autocast is off: calls pay for it.)"""
    if torch.is_autocast_enabled(device_type):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS[device_type]):
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def fast_path_ok(tensors: List[Optional[Tensor]]) -> bool:
    """Whether a call may skip the registered op: a plain eager call on plain CPU/CUDA tensors (under autocast too,
    its inputs cast first). (Called at every call: tensor attributes that build no objects, is_cuda /
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
