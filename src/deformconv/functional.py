"""The public function: a drop-in replacement for ``torchvision.ops.deform_conv2d``."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.fx
from torch import Tensor

from . import config
from . import library  # noqa: F401  (registers torch.ops.deformconv.*)
from . import onnx as _onnx
from .backends import get_backend
from .checks import IntPair, check_deform_conv2d_args, pair
from .eager import (DeformConv2dFunction, ModulatedDeformConv2dFunction, autocasting, fast_path_ok,
                    forward_without_grad, needs_grad, run_planned, split_into)
from .library import _backend_for, autocast_inputs


def _autocast(tensors: List[Optional[Tensor]], device_type: str, backend: Optional[str]) -> List[Optional[Tensor]]:
    """The cast the op's autocast rule makes (library.py), done for the eager fast path; but where the Triton kernels
    run, a float32 weight and bias stay float32: the kernels use them in the autocast dtype and return that cast's
    gradients bit for bit (ops/deform_conv2d/backward_weight.py), without the casts' kernels and autograd nodes."""
    cast = autocast_inputs(tensors, device_type, keep=(2, 3))
    weight, bias = tensors[2], tensors[3]
    if not (weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and _backend_for(cast[0], backend or "").name == "triton"):
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
    """The call through its signature's Call of the Triton kernels (ops/deform_conv2d/call.py; eager.run_planned), or
    None where it takes the general path: eager.run_planned says when; also arguments of other types, an empty batch,
    another backend. The signature holds the settings the plans depend on (cudnn's TF32 switch, DEFORMCONV_AUTOTUNE,
    DEFORMCONV_BACKEND); the backward's are looked up by the Call. n_off: a modulated layer's call
    (modulated_from_offset_conv), tensors (input, out, weight, bias)."""
    geometry = (_geometry_arg(stride), _geometry_arg(padding), _geometry_arg(dilation))
    if None in geometry or (backend is not None and type(backend) is not str):
        return None
    extras = (geometry, backend, n_off, torch.backends.cudnn.allow_tf32, config.autotune(), config.backend())
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
        get_backend(backend)  # unknown names fail here, with the list of known ones
    if input.shape[0] == 0 or _backend_for(input, backend or "").name != "triton":
        return None
    from .ops.deform_conv2d.call import call_for

    return call_for(geo.stride, geo.padding, geo.dilation, n_off, tensors[1] if n_off is not None else None)


def deform_conv2d(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = (1, 1),
    padding: IntPair = (0, 0),
    dilation: IntPair = (1, 1),
    mask: Optional[Tensor] = None,
    *,
    backend: Optional[str] = None,
) -> Tensor:
    r"""Deformable 2-D convolution: DCNv1 (offsets) or, if ``mask`` is given, DCNv2 (offsets and modulation).

    Same arguments, layouts and results as :func:`torchvision.ops.deform_conv2d`. Each kernel tap ``(i, j)``
    of offset group ``g`` samples the input bilinearly at its regular position moved by
    ``(dy, dx) = (offset[:, 2*(g*kh*kw + i*kw + j)], offset[:, 2*(g*kh*kw + i*kw + j) + 1])``, with zeros
    outside the image, and the sample is multiplied by ``mask[:, g*kh*kw + i*kw + j]`` when a mask is given.

    Args:
        input (Tensor[N, Cin, H, W]): input. NCHW or channels_last.
        offset (Tensor[N, 2 * offset_groups * kh * kw, Ho, Wo]): sampling offsets, ``(dy, dx)`` pairs for each
            tap, taps in row-major order, offset groups outermost. ``offset_groups`` is inferred from the
            channel count; ``Cin`` must be divisible by it.
        weight (Tensor[Cout, Cin / groups, kh, kw]): convolution weights; ``groups = Cin // weight.shape[1]``.
        bias (Tensor[Cout], optional): added to every output position. Default: ``None``.
        stride (int or Tuple[int, int]): distance between output positions. Default: 1.
        padding (int or Tuple[int, int]): implicit zero padding on both sides. Default: 0.
        dilation (int or Tuple[int, int]): spacing between kernel taps. Default: 1.
        mask (Tensor[N, offset_groups * kh * kw, Ho, Wo], optional): modulation of each sample (DCNv2).
            Default: ``None`` (DCNv1, all ones).
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"`` to force an implementation;
            ``None`` picks the fastest one that supports the device and dtype (environment variable
            ``DEFORMCONV_BACKEND`` overrides the automatic choice). Default: ``None``.

    Returns:
        Tensor[N, Cout, Ho, Wo]: in input's dtype and memory format, where
        ``Ho = (H + 2*pad_h - dil_h*(kh-1) - 1) // stride_h + 1`` (likewise ``Wo``).

    Half-precision inputs accumulate in float32. All five gradients (input, offset, mask, weight, bias)
    are supported; only the required ones are computed.

    Example::

        >>> import torch, deformconv
        >>> x = torch.randn(2, 8, 10, 12)
        >>> w = torch.randn(16, 8, 3, 3)
        >>> offset = torch.randn(2, 2 * 3 * 3, 10, 12)
        >>> mask = torch.rand(2, 3 * 3, 10, 12)
        >>> out = deformconv.deform_conv2d(x, offset, w, padding=1, mask=mask)
        >>> out.shape
        torch.Size([2, 16, 10, 12])
    """
    if torch.jit.is_tracing() or isinstance(input, torch.fx.Proxy):
        # traced by torch.jit.trace (the op's own checks run untraced: no TracerWarnings from reading shapes here) or
        # by torch.fx's symbolic tracing (one call node of the op, which checks its arguments when the graph runs)
        stride, padding, dilation = (list(pair(v, n)) for v, n in ((stride, "stride"), (padding, "padding"),
                                                                    (dilation, "dilation")))
        return torch.ops.deformconv.deform_conv2d(input, offset, weight, bias, mask, stride, padding, dilation,
                                                  backend or "")
    if _onnx.emits_symbolic():  # inside torch.onnx.export (dynamo): the standard DeformConv node
        return _onnx_node(input, offset, weight, bias, mask, stride, padding, dilation)
    planned = _planned([input, offset, weight, bias, mask], stride, padding, dilation, backend)
    if planned is not None:
        return planned
    autocast_on = autocasting(input)
    geo = check_deform_conv2d_args(
        input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes=autocast_on
    )
    if backend is not None:
        get_backend(backend)  # unknown names fail here, with the list of known ones
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
    mask the sigmoid of the others; in one autograd node (eager.ModulatedDeformConv2dFunction). None where the call
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


def _onnx_node(input, offset, weight, bias, mask, stride, padding, dilation) -> Tensor:
    check_deform_conv2d_args(input, offset, weight, bias, stride, padding, dilation, mask)
    stride, padding, dilation = (pair(v, n) for v, n in ((stride, "stride"), (padding, "padding"),
                                                         (dilation, "dilation")))
    kh, kw = weight.shape[2], weight.shape[3]
    ho = (input.shape[2] + 2 * padding[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
    wo = (input.shape[3] + 2 * padding[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
    return _onnx.symbolic_deform_conv2d(input, offset, weight, bias, mask, stride, padding, dilation,
                                        [input.shape[0], weight.shape[0], ho, wo])


def deform_conv2d_script(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int],
                         padding: List[int], dilation: List[int], mask: Optional[Tensor]) -> Tensor:
    """:func:`deform_conv2d` in a form TorchScript compiles (``torch.jit.script``): the registered op with its
    arguments checked inside it. The modules call it when scripted. A saved scripted or traced model loads and runs
    in a process that has imported deformconv (which registers the op).

    Args:
        as :func:`deform_conv2d`, with ``stride``, ``padding`` and ``dilation`` as lists of two ints and ``mask``
        positional.

    Example::

        >>> import torch, deformconv
        >>> f = torch.jit.script(deformconv.deform_conv2d_script)
        >>> x, w = torch.randn(1, 4, 6, 6), torch.randn(8, 4, 3, 3)
        >>> f(x, torch.zeros(1, 18, 6, 6), w, None, [1, 1], [1, 1], [1, 1], None).shape
        torch.Size([1, 8, 6, 6])
    """
    return torch.ops.deformconv.deform_conv2d(input, offset, weight, bias, mask, stride, padding, dilation, "")


# --- torch.jit.script of deform_conv2d and of functions calling it -------------------------------------------


def _deform_conv2d_scripted_form(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                                 stride: Tuple[int, int] = (1, 1), padding: Tuple[int, int] = (0, 0),
                                 dilation: Tuple[int, int] = (1, 1), mask: Optional[Tensor] = None) -> Tensor:
    """What TorchScript compiles for deform_conv2d: torchvision's signature (pairs as tuples) on the registered op."""
    return torch.ops.deformconv.deform_conv2d(input, offset, weight, bias, mask, [stride[0], stride[1]],
                                              [padding[0], padding[1]], [dilation[0], dilation[1]], "")


def _register_scripted_form() -> None:
    """torch.jit.script(deform_conv2d), and the scripting of any function that calls it, take the scripted form:
    deform_conv2d's keyword-only backend= and its eager paths are not TorchScript, and TorchScript looks a function
    up in its cache of compiled functions first (as torchvision's ops script: the one-line swap holds for scripted
    code). Compiled once here (a few milliseconds); where TorchScript cannot compile (no sources), scripting raises
    as it would have."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script's deprecation notice is for the caller's use, not ours
            compiled = torch.jit.script(_deform_conv2d_scripted_form)
        torch.jit._state._set_jit_function_cache(deform_conv2d, compiled)
    except Exception:  # pragma: no cover - TorchScript without sources or removed from this torch
        pass


_register_scripted_form()
