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

from .checks import PLAIN_TENSOR_TYPES
from .library import _setup_context, backward_impl, forward_impl, input_grads

_AUTOCAST_KEYS = {d: torch._C.DispatchKeySet(torch._C.DispatchKey.__members__["Autocast" + torch._C._dispatch_key_for_device(d)])
                  for d in ("cuda", "cpu")}

# functorch's check, looked up once (a torch without it: every tensor counts as wrapped, so calls take the op)
_FUNCTORCH_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _is_functorch_wrapped(t: Tensor) -> bool:
    return bool(_FUNCTORCH_WRAPPED(t)) if _FUNCTORCH_WRAPPED is not None else True


def fast_path_ok(tensors: List[Optional[Tensor]]) -> bool:
    """Whether a call may skip the registered op: a plain eager call on plain CPU/CUDA tensors (under autocast too,
    its inputs cast first: functional.py). (Called at every call: tensor attributes that build no objects, is_cuda /
    is_cpu rather than device.type.)"""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TENSOR_TYPES or not (t.is_cuda or t.is_cpu) or _is_functorch_wrapped(t):
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
        device_type = "cuda" if input.is_cuda else "cpu"
        if torch.is_autocast_enabled(device_type):
            # the inputs are cast already; inside, autocast is off, as in the op's autocast rule (library.py)
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS[device_type]):
                out = forward_impl(*args, keep=keep)
        else:
            out = forward_impl(*args, keep=keep)
        _setup_context(ctx, args, out, keep)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return input_grads(ctx, grad_out, backward_impl, pass_kept=True)
