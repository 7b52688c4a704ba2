"""Argument checks for deform_conv2d, and the cache of passed call signatures the other ops' checks share: every bad
input becomes a ValueError/TypeError that names the argument, what was expected and what came, before any kernel
runs."""

from __future__ import annotations

import operator
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

IntPair = Union[int, Tuple[int, int], Sequence[int]]


class ConvGeometry(NamedTuple):
    """Everything the kernels need to know about one deform_conv2d call, derived from the shapes (a
    NamedTuple: built at every call, so it must be cheap)."""

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel_h: int
    kernel_w: int
    groups: int
    offset_groups: int
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    out_h: int
    out_w: int

    @property
    def taps(self) -> int:
        return self.kernel_h * self.kernel_w


def ntuple(value, name: str, rank: int, minimum: Optional[int] = None) -> Tuple[int, ...]:
    """An int or a tuple of ``rank`` ints as a tuple of Python ints (the N-d forms' stride, padding, ...); with
    minimum, each at least that (1: positive, 0: non-negative)."""
    what = "an int" if rank == 1 else f"an int or a tuple of {rank} ints"
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be {what}, got a Tensor")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got bool {value!r}")
    if hasattr(value, "__index__"):  # int, numpy integers
        items = (operator.index(value),) * rank
    else:
        try:
            items = tuple(value)
        except TypeError:
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}") from None
        if len(items) != rank or not all(hasattr(v, "__index__") and not isinstance(v, bool) for v in items):
            raise TypeError(f"{name} must be {what}, got {value!r}")
        items = tuple(operator.index(v) for v in items)
    if minimum is not None and min(items) < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else 'non-negative'}, got {items}")
    return items


def pair(value: IntPair, name: str) -> Tuple[int, int]:
    """An int or a pair of ints as a tuple of two Python ints."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int or a pair of ints, got a Tensor")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a pair of ints, got bool {value!r}")
    if hasattr(value, "__index__"):  # int, numpy integers
        v = operator.index(value)
        return (v, v)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be an int or a pair of ints, got {type(value).__name__} {value!r}") from None
    if len(items) != 2 or not all(hasattr(v, "__index__") and not isinstance(v, bool) for v in items):
        raise TypeError(f"{name} must be an int or a pair of ints, got {value!r}")
    return (operator.index(items[0]), operator.index(items[1]))


def int_at_least(value, name: str, minimum: int = 1) -> int:
    """value as an int, which must be one (not bool) and at least minimum: the modules' constructor arguments and the
    ops' integer settings."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def pair_at_least(value: IntPair, name: str, minimum: int) -> Tuple[int, int]:
    """pair(value, name) whose two ints are at least minimum (1: positive, 0: non-negative), with the message the
    functions' checks give."""
    p = pair(value, name)
    if min(p) < minimum:
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else 'non-negative'}, got {p}")
    return p


def real_number(value, name: str, positive: bool = False) -> float:
    """value as a float: an int or float (not bool), finite, and > 0 where positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, got {value!r}")
    return value


def _check_tensor(t: Tensor, name: str, ndim: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D tensor {shape_doc}, got {t.dim()}-D with shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


# Tensor types treated as plain (no subclass behaviour to respect): the checks' cache below, the eager fast path.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

# Call signatures that passed the checks, and their geometry: a repeated call (the same shapes, dtypes, devices and
# integer arguments) skips them. The checks read nothing else, so a signature decides them.
_VALID: Dict[tuple, ConvGeometry] = {}
_MAX_VALID = 256


def _int_pair_key(value) -> Optional[Tuple[int, int]]:
    """value as (a, b) if it is an int or a 2-tuple/list of ints (bool excluded: the checks refuse it), else None."""
    if type(value) is int:
        return (value, value)
    if type(value) in (tuple, list) and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return (value[0], value[1])
    return None


def _signature(tensors: Sequence[Optional[Tensor]], pairs: Sequence[IntPair],
               allow_mixed_dtypes: bool) -> Optional[tuple]:
    """The key of _VALID: every property the checks read, or None where a call is not cached (while torch.compile
    traces; tensor subclasses other than Parameter; arguments of other types)."""
    if torch.compiler.is_compiling():
        return None
    key = [allow_mixed_dtypes]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) in PLAIN_TENSOR_TYPES:
            key.append((t.shape, t.dtype, t.device))
        else:
            return None
    for value in pairs:
        p = _int_pair_key(value)
        if p is None:
            return None
        key.append(p)
    return tuple(key)


# The other ops' call signatures that passed their checks, with what the checks returned (the same rule as _VALID:
# checks that read only the tensors' types, shapes, dtypes and devices and the given plain arguments are decided by
# them; checks of tensor contents stay outside).
_PASSED: Dict[tuple, object] = {}
_PLAIN_EXTRAS = (type(None), bool, int, float, str)


def check_once(op: str, tensors: Sequence[Optional[Tensor]], check: Callable[[], object], extras: tuple = ()):
    """check()'s result (check raises on bad input), run unless a call of op with tensors of the same types, shapes,
    dtypes and devices and the same extras (each with its type: True is not 1) passed it before. Tensor subclasses,
    extras of other types than None, bool, int, float and str, and calls while torch.compile traces are always
    checked."""
    key = _signature(tensors, (), False)
    if key is None or not all(type(v) in _PLAIN_EXTRAS for v in extras):
        return check()
    key = (op, key, tuple((type(v), v) for v in extras))
    if key in _PASSED:
        return _PASSED[key]
    result = check()
    if len(_PASSED) >= _MAX_VALID:
        _PASSED.clear()
    _PASSED[key] = result
    return result


def check_deform_conv2d_args(
    input: Tensor,
    offset: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    stride: IntPair,
    padding: IntPair,
    dilation: IntPair,
    mask: Optional[Tensor],
    *,
    allow_mixed_dtypes: bool = False,
) -> ConvGeometry:
    """Validate a deform_conv2d call and return its geometry. Raises TypeError/ValueError on bad input. A call with
    the signature of one that passed before (_VALID) returns that geometry without checking again."""
    key = _signature((input, offset, weight, bias, mask), (stride, padding, dilation), allow_mixed_dtypes)
    geo = _VALID.get(key) if key is not None else None
    if geo is None:
        geo = _check_args(input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes)
        if key is not None:
            if len(_VALID) >= _MAX_VALID:
                _VALID.clear()
            _VALID[key] = geo
    return geo


def _check_args(input, offset, weight, bias, stride, padding, dilation, mask, allow_mixed_dtypes) -> ConvGeometry:
    """check_deform_conv2d_args's checks."""
    _check_tensor(input, "input", 4, "[N, Cin, H, W]")
    _check_tensor(offset, "offset", 4, "[N, 2*offset_groups*kh*kw, Ho, Wo]")
    _check_tensor(weight, "weight", 4, "[Cout, Cin/groups, kh, kw]")
    if mask is not None:
        _check_tensor(mask, "mask", 4, "[N, offset_groups*kh*kw, Ho, Wo]")
    if bias is not None:
        _check_tensor(bias, "bias", 1, "[Cout]")

    named = [("offset", offset), ("weight", weight), ("mask", mask), ("bias", bias)]
    for name, t in named:
        if t is None:
            continue
        if t.device != input.device:
            raise ValueError(f"{name} must be on the same device as input ({input.device}), got {t.device}")
        if t.dtype != input.dtype and not allow_mixed_dtypes:
            raise TypeError(f"{name} must have the same dtype as input ({input.dtype}), got {t.dtype}")

    sh, sw = pair(stride, "stride")
    ph, pw = pair(padding, "padding")
    dh, dw = pair(dilation, "dilation")
    if sh <= 0 or sw <= 0:
        raise ValueError(f"stride must be positive, got {(sh, sw)}")
    if ph < 0 or pw < 0:
        raise ValueError(f"padding must be non-negative, got {(ph, pw)}")
    if dh <= 0 or dw <= 0:
        raise ValueError(f"dilation must be positive, got {(dh, dw)}")

    n, cin, h, w = input.shape
    cout, cin_per_group, kh, kw = weight.shape
    if kh <= 0 or kw <= 0:
        raise ValueError(f"weight must have a non-empty kernel, got kernel size {(kh, kw)}")
    if cin_per_group <= 0 or cin % cin_per_group != 0:
        raise ValueError(
            f"input channels ({cin}) must be divisible by weight.shape[1] (Cin/groups = {cin_per_group})"
        )
    groups = cin // cin_per_group
    if cout <= 0 or cout % groups != 0:
        raise ValueError(f"weight.shape[0] (Cout = {cout}) must be a positive multiple of groups ({groups})")
    if bias is not None and bias.shape[0] != cout:
        raise ValueError(f"bias must have Cout = {cout} elements, got {bias.shape[0]}")

    taps = kh * kw
    if offset.shape[1] == 0 or offset.shape[1] % (2 * taps) != 0:
        raise ValueError(
            f"offset.shape[1] must be 2*offset_groups*kh*kw (a positive multiple of {2 * taps}), got {offset.shape[1]}"
        )
    offset_groups = offset.shape[1] // (2 * taps)
    if cin % offset_groups != 0:
        raise ValueError(f"input channels ({cin}) must be divisible by offset groups ({offset_groups})")

    out_h = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    out_w = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    if out_h <= 0 or out_w <= 0:
        raise ValueError(
            f"computed output size {(out_h, out_w)} is not positive for input size {(h, w)}, kernel {(kh, kw)}, "
            f"stride {(sh, sw)}, padding {(ph, pw)}, dilation {(dh, dw)}"
        )
    if offset.shape[0] != n:
        raise ValueError(f"offset batch size must equal input's ({n}), got {offset.shape[0]}")
    if tuple(offset.shape[2:]) != (out_h, out_w):
        raise ValueError(f"offset spatial size must be the output size {(out_h, out_w)}, got {tuple(offset.shape[2:])}")
    if mask is not None:
        if mask.shape[0] != n:
            raise ValueError(f"mask batch size must equal input's ({n}), got {mask.shape[0]}")
        if mask.shape[1] != offset_groups * taps:
            raise ValueError(
                f"mask.shape[1] must be offset_groups*kh*kw = {offset_groups * taps}, got {mask.shape[1]}"
            )
        if tuple(mask.shape[2:]) != (out_h, out_w):
            raise ValueError(f"mask spatial size must be the output size {(out_h, out_w)}, got {tuple(mask.shape[2:])}")

    return ConvGeometry(
        batch=n, in_channels=cin, height=h, width=w, out_channels=cout, kernel_h=kh, kernel_w=kw,
        groups=groups, offset_groups=offset_groups, stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
        out_h=out_h, out_w=out_w,
    )


def geometry_from_tensors(
    input: Tensor, offset: Tensor, weight: Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int],
) -> ConvGeometry:
    """Geometry of an already-validated call (no checks): used inside backends."""
    n, cin, h, w = input.shape
    cout, cin_g, kh, kw = weight.shape
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    return ConvGeometry(
        batch=n, in_channels=cin, height=h, width=w, out_channels=cout, kernel_h=kh, kernel_w=kw,
        groups=cin // cin_g, offset_groups=offset.shape[1] // (2 * kh * kw),
        stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw),
        out_h=(h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1,
        out_w=(w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1,
    )


def suggest_memory_format(t: Tensor) -> torch.memory_format:
    """channels_last when t is laid out NHWC (and not also plain-contiguous), else contiguous: the layout
    F.conv2d gives its output."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
