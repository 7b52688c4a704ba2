"""The ``deformconv::deform_conv2d`` operator: torch.library registration of the forward op, its backward
op, their fake (meta) implementations, the autograd formula, the compile route and the autocast rule.

Both ops take ``backend`` (a name, or "" for automatic) and pick their implementation at run time through the one
dispatch (ops/common/dispatch.py), so torch.compile and torch.export see one opaque op and no graph break.
``forward_impl`` and ``backward_impl`` are what the ops run; the eager fast path (eager.py) runs the same two
functions without the custom-op dispatcher.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

from ... import config
from ...checks import check_deform_conv2d_args, geometry_from_tensors, suggest_memory_format
from ..common import dispatch
from ..common.autocast import register_autocast

# Every backend's module has deform_conv2d_forward(input, offset, weight, bias, mask, stride, padding, dilation,
# keep=None) and deform_conv2d_backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs,
# keep=None); keep: a dict the forward may fill with tensors its backward reuses (the Triton backend: the packed
# weight), held by the eager path's autograd context until the backward, which gets the same dict.
dispatch.register("deform_conv2d", {"triton": f"{__package__}.triton", "cpu": f"{__package__}.cpu",
                                    "reference": f"{__package__}.reference"})


def backend_for(t: Tensor, requested: str) -> str:
    """The backend that runs a call whose input is t (requested: the op's backend argument)."""
    return dispatch.chosen_backend("deform_conv2d", t.device, t.dtype, requested)


def _implementation(t: Tensor, requested: str):
    return dispatch.implementation("deform_conv2d", t, requested)


# --- forward op ----------------------------------------------------------------------------------------


@torch.library.custom_op("deformconv::deform_conv2d", mutates_args=())
def deform_conv2d_op(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    mask: Optional[Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    backend: str,
) -> Tensor:
    # calls that reach the op without the public function's checks (TorchScript, tracing, direct calls) are checked
    # here; mixed dtypes as the autocast rule leaves them (float64 beside a 16-bit dtype) are allowed
    check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes=True)
    return forward_impl(input, offset, weight, bias, mask, stride, padding, dilation, backend)


def forward_impl(input, offset, weight, bias, mask, stride, padding, dilation, backend: str,
                 keep: Optional[dict] = None) -> Tensor:
    """The forward on the selected backend (an empty batch needs none). keep: see the backends' registration above."""
    if input.shape[0] == 0:
        return _empty_output(input, offset, weight, stride, padding, dilation)
    return _implementation(input, backend).deform_conv2d_forward(input, offset, weight, bias, mask, stride, padding,
                                                                   dilation, keep=keep)


def _empty_output(input, offset, weight, stride, padding, dilation) -> Tensor:
    geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
    return torch.empty(
        (geo.batch, geo.out_channels, geo.out_h, geo.out_w), dtype=input.dtype, device=input.device,
        memory_format=suggest_memory_format(input),
    )


@deform_conv2d_op.register_fake
def _(input, offset, weight, bias, mask, stride, padding, dilation, backend):
    return _empty_output(input, offset, weight, stride, padding, dilation)


# --- backward op ---------------------------------------------------------------------------------------


@torch.library.custom_op("deformconv::deform_conv2d_backward", mutates_args=())
def deform_conv2d_backward_op(
    grad_out: Tensor,
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    mask: Optional[Tensor],
    stride: List[int],
    padding: List[int],
    dilation: List[int],
    needs: List[bool],
    backend: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (input, offset, mask, weight, bias). One that ``needs`` does not ask for (or grad_mask
    without a mask) comes back as an empty tensor."""
    grads = backward_impl(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend)
    # Each unwanted gradient is its own empty tensor: outputs of a custom op may not alias each other.
    return tuple(g if g is not None else input.new_empty(0) for g in grads)  # type: ignore[return-value]


def backward_impl(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend: str,
                  keep: Optional[dict] = None):
    """Gradients (input, offset, mask, weight, bias) on the selected backend; None where ``needs`` is False.
    keep: what the forward kept (forward_impl), or None."""
    if input.shape[0] == 0:
        grads = _zero_grads(input, offset, weight, mask, grad_out)
    else:
        grads = _implementation(input, backend).deform_conv2d_backward(grad_out, input, offset, weight, mask, stride,
                                                                       padding, dilation, needs, keep=keep)
    return tuple([g if need else None for g, need in zip(grads, needs)])


def _zero_grads(input, offset, weight, mask, grad_out):
    return (
        torch.zeros_like(input), torch.zeros_like(offset), None if mask is None else torch.zeros_like(mask),
        torch.zeros_like(weight), grad_out.new_zeros(weight.shape[0], dtype=weight.dtype),
    )


@deform_conv2d_backward_op.register_fake
def _(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend):
    def like(t: Optional[Tensor], need: bool, keep_format: bool = True) -> Tensor:
        if t is None or not need:
            return input.new_empty(0)
        fmt = suggest_memory_format(t) if keep_format else torch.contiguous_format
        return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt)

    # grad_input and grad_weight come in their tensor's memory format, grad_offset and grad_mask NCHW-contiguous (the
    # kernels write them so), from every backend
    need_in, need_off, need_mask, need_w, need_b = needs
    grad_b = weight.new_empty(weight.shape[0]) if need_b else input.new_empty(0)
    return (like(input, need_in), like(offset, need_off, False), like(mask, need_mask, False), like(weight, need_w),
            grad_b)


# --- autograd ------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output, kept: Optional[dict] = None):
    """What the backward needs; also used by the eager path's autograd.Function (eager.py), which
    saves what its forward kept beside (kept: see the backends' registration; input_grads hands it back)."""
    input, offset, weight, bias, mask, stride, padding, dilation, backend = inputs
    kept = kept or {}
    ctx.save_for_backward(input, offset, weight, mask, *kept.values())
    ctx.kept_names = tuple(kept)
    ctx.has_bias = bias is not None
    ctx.has_mask = mask is not None
    ctx.params = (stride, padding, dilation, backend)


def grad_needs(needs_input_grad, has_bias: bool, has_mask: bool) -> List[bool]:
    """Which of (input, offset, mask, weight, bias) need a gradient, from the forward's needs_input_grad
    (ordered input, offset, weight, bias, mask, ...)."""
    n_in, n_off, n_w, n_b, n_mask = needs_input_grad[:5]
    return [bool(n_in), bool(n_off), bool(n_mask and has_mask), bool(n_w), bool(n_b and has_bias)]


def input_grads(ctx, grad_out, backward, pass_kept: bool = False):
    """The autograd backward, in the forward's argument order, with ``backward`` computing the gradients
    (the backward op here, ``backward_impl`` in the eager path, which with pass_kept also gets what the forward kept:
    _setup_context's kept, as keep=). The saved tensors are read once (activation checkpointing allows no more)."""
    saved = ctx.saved_tensors
    input, offset, weight, mask = saved[:4]
    stride, padding, dilation, backend = ctx.params
    needs = grad_needs(ctx.needs_input_grad, ctx.has_bias, ctx.has_mask)
    if not any(needs):
        return (None,) * 9
    kept = dict(keep=dict(zip(ctx.kept_names, saved[4:]))) if pass_kept else {}
    g_in, g_off, g_mask, g_w, g_b = backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs,
                                             backend, **kept)
    need_in, need_off, need_mask, need_w, need_b = needs
    return (
        g_in if need_in else None, g_off if need_off else None, g_w if need_w else None, g_b if need_b else None,
        g_mask if need_mask else None, None, None, None, None,
    )


def _backward(ctx, grad_out):
    return input_grads(ctx, grad_out, deform_conv2d_backward_op)


deform_conv2d_op.register_autograd(_backward, setup_context=_setup_context)


# --- compile route -------------------------------------------------------------------------------------
# Under torch.compile, AOTAutograd's functionalisation decomposes both ops, where they run on the Triton backend on
# CUDA, into their kernels: the launchers run once, at compile time, with every launch recorded through
# torch.library.wrap_triton (config.tracing), so Inductor launches the kernels from its generated code and no Python
# of ours runs per call; CUDA graphs (mode="reduce-overhead") capture them like any kernel. This is what
# torch.library.triton_op does, with two differences: the ops keep their own fake implementations, and calls on
# other backends (reference, cpu, the interpreter) stay opaque ops. torch.export keeps the ops whole.


def _decomposes(args: tuple, input_index: int, backend: str) -> bool:
    """Whether a call decomposes: DEFORMCONV_COMPILE_KERNELS=1, the Triton backend on CUDA (wrap_triton does not
    trace the interpreter's kernels), static shapes (the launchers plan with Python integers; a symbolic size, from
    dynamic=True or a recompile for a new shape, keeps the op opaque, its plans then made per call and cached per
    shape as in eager), and a non-empty batch."""
    if not config.compile_kernels():
        return False
    input = args[input_index]
    if not (input.is_cuda and not config.triton_interpret() and backend_for(input, backend) == "triton"):
        return False
    for a in args:
        sizes = (*a.shape, *a.stride()) if isinstance(a, Tensor) else a if isinstance(a, (list, tuple)) else (a,)
        if any(isinstance(v, torch.SymInt) for v in sizes):
            return False
    return input.shape[0] > 0


def _exact_layout(t: Optional[Tensor]) -> Optional[Tensor]:
    """t with its strides fixed for Inductor: a view (as_strided) of a one-dimensional view of t in t's memory order
    (NCHW- or channels_last-contiguous; any other layout is made contiguous first).

    The traced launches read the op's inputs with the strides they had when traced, as constants. Inductor promises
    a user kernel's arguments only the traced stride *order*: it may pad a buffer's strides when it fixes its layout
    (comprehensive padding: an image stride of 1980 elements becomes 1984) or hand over another tensor of that order
    (pytorch#132102, #147828), and the kernels then read the wrong elements: a compiled ModulatedDeformConv2dPack,
    whose offset and mask are copies of channel slices, got wrong gradients. A one-dimensional view has a single
    layout, and as_strided's input keeps its exact strides, so the kernels read what was traced; where the buffer's
    layout was still free this costs nothing, else one copy."""
    if t is None or t.dim() == 0 or t.numel() == 0:
        return t
    if t.is_contiguous():
        flat = t.view(-1)
    elif t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        flat = t.permute(0, 2, 3, 1).reshape(-1)
    else:
        t = t.contiguous()
        flat = t.view(-1)
    return flat.as_strided(t.shape, t.stride())


def _traced_forward(input, offset, weight, bias, mask, stride, padding, dilation, backend):
    check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes=True)
    input, offset, weight, bias, mask = map(_exact_layout, (input, offset, weight, bias, mask))
    return forward_impl(input, offset, weight, bias, mask, stride, padding, dilation, backend)


def _traced_backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend):
    grad_out, input, offset, weight, mask = map(_exact_layout, (grad_out, input, offset, weight, mask))
    grads = backward_impl(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, backend)
    return tuple(g if g is not None else input.new_empty(0) for g in grads)


def _decomposition(traced_impl, input_index: int, backend_index: int):
    def rule(mode, op, types, args, kwargs):
        if any(t not in (Tensor, FunctionalTensor) and not issubclass(t, FakeTensor) for t in types):
            return NotImplemented  # another tensor subclass: its own dispatch decides
        from ...compat import custom_op_decomposition_disabled

        if custom_op_decomposition_disabled() or not _decomposes(args, input_index, args[backend_index]):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode, config.traced():
            return traced_impl(*args, **kwargs)

    return rule


def _register_decompositions() -> None:
    deform_conv2d_op.register_torch_dispatch(FunctionalTensorMode, _decomposition(_traced_forward, 0, 8))
    deform_conv2d_backward_op.register_torch_dispatch(FunctionalTensorMode, _decomposition(_traced_backward, 1, 9))
    from ...compat import register_op_kernels, triton

    if triton is None:  # no Triton: nothing decomposes
        return
    from .triton import launched_kernels

    # the kernels the decompositions launch, for torch's compile caches (compat.register_op_kernels)
    kernels = launched_kernels()
    register_op_kernels("deformconv::deform_conv2d", kernels)
    register_op_kernels("deformconv::deform_conv2d_backward", kernels)


_register_decompositions()


# --- autocast (ops/common/autocast.py) -----------------------------------------------------------------

register_autocast("deform_conv2d")
