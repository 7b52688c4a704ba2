"""Deformable convolution of rank 1 and 3 and the transposed forms of rank 1 to 3: the functions, with
deform_conv2d's (torchvision's) argument names and order (``output_padding`` and ``groups`` as ``F.conv_transpose``
has them), and the modules, whose parameters and state_dict keys are ``nn.Conv*d``'s / ``nn.ConvTranspose*d``'s (and
tvdcn's). Semantics: ops/deform_conv_nd/reference.py."""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.fx
from torch import Tensor, nn

from .checks import _check_tensor, check_once, int_at_least, ntuple
from .ops.common import dispatch
from .ops.common.eager import autocasting, run_eager
from .ops.deform_conv_nd import op as _op
from .ops.deform_conv_nd.reference import out_size, transposed_size

IntOrTuple = Union[int, Sequence[int]]
_AXES = {1: "W", 2: "H, W", 3: "D, H, W"}


def _tensor(t, name: str, rank: int) -> Tensor:
    """t checked as a floating-point tensor [N, C, *spatial] of rank + 2 dimensions (checks._check_tensor)."""
    _check_tensor(t, name, rank + 2, f"[N, C, {_AXES[rank]}]")
    return t


def _check(name: str, input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups
           ) -> Tuple[tuple, tuple, tuple, tuple, int]:
    """The N-d forms' argument checks (bad input raises, naming the argument): stride, padding, dilation,
    output_padding as tuples and the convolution groups (check_once keeps them for the signature's later calls)."""
    rank, transposed = _op.FORMS[name]
    input, weight = _tensor(input, "input", rank), _tensor(weight, "weight", rank)
    stride, dilation = ntuple(stride, "stride", rank, 1), ntuple(dilation, "dilation", rank, 1)
    padding = ntuple(padding, "padding", rank, 0)
    output_padding = ntuple(output_padding, "output_padding", rank, 0)
    cin, kernel, size = input.shape[1], list(weight.shape[2:]), list(input.shape[2:])
    if transposed:
        groups = int_at_least(groups, "groups")
        if weight.shape[0] != cin or cin % groups:
            raise ValueError(f"weight.shape[0] must be input's channels ({cin}) and divisible by groups ({groups}), "
                             f"got weight {tuple(weight.shape)}")
        if any(op >= max(s, d) for op, s, d in zip(output_padding, stride, dilation)):
            raise ValueError(f"output_padding must be smaller than stride or dilation on each axis, got "
                             f"output_padding {output_padding}, stride {stride}, dilation {dilation}")
        out_channels, sampled_channels = weight.shape[1] * groups, weight.shape[1] * groups
        positions, spatial = size, transposed_size(size, kernel, stride, padding, output_padding, dilation)
    else:
        if weight.shape[1] == 0 or cin % weight.shape[1]:
            raise ValueError(f"input channels ({cin}) must be divisible by weight.shape[1] (Cin/groups = "
                             f"{weight.shape[1]})")
        groups = cin // weight.shape[1]
        if weight.shape[0] == 0 or weight.shape[0] % groups:
            raise ValueError(f"weight.shape[0] (Cout = {weight.shape[0]}) must be a positive multiple of groups "
                             f"({groups})")
        out_channels, sampled_channels = weight.shape[0], cin
        positions = spatial = out_size(size, kernel, stride, padding, dilation)
    if min(spatial) <= 0 or min(kernel) <= 0:
        raise ValueError(f"computed output size {tuple(spatial)} is not positive (input {tuple(size)}, kernel "
                         f"{tuple(kernel)}, stride {stride}, padding {padding}, dilation {dilation})")
    K = math.prod(kernel)
    offset = _tensor(offset, "offset", rank)
    if offset.shape[1] == 0 or offset.shape[1] % (rank * K):
        raise ValueError(f"offset.shape[1] must be {rank}*offset_groups*K (a positive multiple of {rank * K}), got "
                         f"{offset.shape[1]}")
    offset_groups = offset.shape[1] // (rank * K)
    if sampled_channels % offset_groups:
        raise ValueError(f"the sampled channels ({sampled_channels}) must be divisible by offset groups "
                         f"({offset_groups})")
    want = [input.shape[0], None, *positions]
    for t, tname, channels in ((offset, "offset", offset.shape[1]), (mask, "mask", offset_groups * K)):
        if t is None:
            continue
        t = _tensor(t, tname, rank)
        want[1] = channels
        if list(t.shape) != want:
            raise ValueError(f"{tname} must have shape {tuple(want)}, got {tuple(t.shape)}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (out_channels,)):
        raise ValueError(f"bias must be a 1-D tensor of {out_channels} elements, got "
                         f"{tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__}")
    mixed = autocasting(input)
    for t, tname in ((offset, "offset"), (weight, "weight"), (bias, "bias"), (mask, "mask")):
        if t is None:
            continue
        if t.device != input.device:
            raise ValueError(f"{tname} must be on the same device as input ({input.device}), got {t.device}")
        if not t.is_floating_point():
            raise TypeError(f"{tname} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dtype != input.dtype and not mixed:
            raise TypeError(f"{tname} must have the same dtype as input ({input.dtype}), got {t.dtype}")
    return tuple(stride), tuple(padding), tuple(dilation), tuple(output_padding), groups


def _plain(value):
    """A setting as check_once keys it: a tuple or list of ints as a string of its type and items (a plain value
    that tells (1, 2) from [1, 2] and from 1), anything else as it is (an int is plain; other types: checked)."""
    if type(value) in (tuple, list) and all(type(v) is int for v in value):
        return f"{type(value).__name__}{tuple(value)}"
    return value


def _call(name: str, input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups,
          backend: Optional[str]) -> Tensor:
    params = check_once(name, (input, offset, weight, bias, mask),
                        lambda: _check(name, input, offset, weight, bias, mask, stride, padding, dilation,
                                       output_padding, groups),
                        (*map(_plain, (stride, padding, dilation, output_padding)), groups, autocasting(input)))
    args = (input, offset, weight, bias, mask, *map(list, params[:4]), params[4],
            dispatch.backend_argument(name, backend))
    if not torch.jit.is_tracing():
        _, forward, backward = _op.OPS[name]
        out = run_eager(forward, backward, (0, 1, 2, 3, 4), args)
        if out is not None:
            return out
    return getattr(torch.ops.deformconv, name)(*args)


# torch.fx's symbolic tracing records one call of _call (functions and modules alike), which checks its arguments
# when the traced graph runs
torch.fx.wrap("_call")


def deform_conv1d(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  stride: IntOrTuple = 1, padding: IntOrTuple = 0, dilation: IntOrTuple = 1,
                  mask: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    r"""Deformable 1-D convolution: :func:`deform_conv2d` along one axis. Tap j of offset group g samples the input
    linearly at ``wo*stride - padding + j*dilation + offset[:, g*kw + j, wo]``.

    Args:
        input (Tensor[N, Cin, W]): input.
        offset (Tensor[N, offset_groups * kw, Wo]): one shift per tap and output position.
        weight (Tensor[Cout, Cin / groups, kw]): convolution weights; ``groups = Cin // weight.shape[1]``.
        bias (Tensor[Cout], optional): Default: ``None``.
        stride, padding, dilation (int or Tuple[int]): as ``F.conv1d``'s. Default: 1, 0, 1.
        mask (Tensor[N, offset_groups * kw, Wo], optional): modulation of each sample. Default: ``None``.
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"`` to force one, ``None`` for
            automatic. Default: ``None``.

    Returns:
        Tensor[N, Cout, Wo], ``Wo = (W + 2*padding - dilation*(kw-1) - 1) // stride + 1``.

    Example::

        >>> import torch, deformconv
        >>> x, w = torch.randn(2, 4, 10), torch.randn(6, 4, 3)
        >>> deformconv.deform_conv1d(x, torch.randn(2, 3, 10), w, padding=1).shape
        torch.Size([2, 6, 10])
    """
    return _call("deform_conv1d", input, offset, weight, bias, mask, stride, padding, dilation, 0, 1, backend)


def deform_conv3d(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  stride: IntOrTuple = 1, padding: IntOrTuple = 0, dilation: IntOrTuple = 1,
                  mask: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    r"""Deformable 3-D convolution (D3Dnet's, tvdcn's): each tap samples the input trilinearly, moved by three
    offsets (d, h, w) per tap: ``offset[:, 3*(g*K + t) + i]`` for axis i, taps t row-major over (kd, kh, kw).

    Args:
        input (Tensor[N, Cin, D, H, W]): input.
        offset (Tensor[N, 3 * offset_groups * kd * kh * kw, Do, Ho, Wo]): shifts.
        weight (Tensor[Cout, Cin / groups, kd, kh, kw]): convolution weights.
        bias (Tensor[Cout], optional): Default: ``None``.
        stride, padding, dilation (int or Tuple[int, int, int]): as ``F.conv3d``'s. Default: 1, 0, 1.
        mask (Tensor[N, offset_groups * kd * kh * kw, Do, Ho, Wo], optional): modulation. Default: ``None``.
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"`` to force one, ``None`` for
            automatic. Default: ``None``.

    Returns:
        Tensor[N, Cout, Do, Ho, Wo].

    Example::

        >>> import torch, deformconv
        >>> x, w = torch.randn(1, 2, 4, 5, 6), torch.randn(3, 2, 3, 3, 3)
        >>> deformconv.deform_conv3d(x, torch.zeros(1, 81, 4, 5, 6), w, padding=1).shape
        torch.Size([1, 3, 4, 5, 6])
    """
    return _call("deform_conv3d", input, offset, weight, bias, mask, stride, padding, dilation, 0, 1, backend)


def _transpose_doc(rank: int) -> str:
    axes = {1: "W", 2: "H, W", 3: "D, H, W"}[rank]
    kernel = {1: "kw", 2: "kh, kw", 3: "kd, kh, kw"}[rank]
    taps = {1: "kw", 2: "kh * kw", 3: "kd * kh * kw"}[rank]
    return f"""Transposed deformable {rank}-D convolution (tvdcn's): the adjoint of :func:`deform_conv{rank}d` with
    respect to its input, in ``F.conv_transpose{rank}d``'s layout. Each input position spreads its weighted values
    over the sample points of the output that the convolution would read there, moved by the offsets at that input
    position. With zero offsets and no mask it is ``F.conv_transpose{rank}d``.

    Args:
        input (Tensor[N, Cin, {axes}]): input.
        offset (Tensor[N, {rank} * offset_groups * {taps}, {axes}]): shifts at each input position, {rank} a tap
            in axis order.
        weight (Tensor[Cin, Cout / groups, {kernel}]): weights, ``F.conv_transpose{rank}d``'s layout.
        bias (Tensor[Cout], optional): Default: ``None``.
        stride, padding, output_padding, dilation (int or Tuple): as ``F.conv_transpose{rank}d``'s. Default: 1, 0, 0,
            1.
        mask (Tensor[N, offset_groups * {taps}, {axes}], optional): modulation. Default: ``None``.
        groups (int): blocked connections. Default: 1.
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"`` to force one, ``None`` for
            automatic. Default: ``None``.

    Returns:
        Tensor[N, Cout, ...], each size ``(size - 1)*stride - 2*padding + dilation*(k - 1) + 1 + output_padding``.
    """


def _transpose(rank: int):
    name = f"deform_conv_transpose{rank}d"

    def fn(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride: IntOrTuple = 1,
           padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, dilation: IntOrTuple = 1,
           mask: Optional[Tensor] = None, groups: int = 1, *, backend: Optional[str] = None) -> Tensor:
        return _call(name, input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups,
                     backend)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = _transpose_doc(rank) + f"""
    Example::

        >>> import torch, deformconv
        >>> x, w = torch.randn(1, 4, *[5] * {rank}), torch.randn(4, 2, *[3] * {rank})
        >>> deformconv.{name}(x, torch.zeros(1, {rank * 3 ** rank}, *[5] * {rank}), w, stride=2).shape[2:]
        torch.Size([{", ".join(["11"] * rank)}])
    """
    return fn


deform_conv_transpose1d = _transpose(1)
deform_conv_transpose2d = _transpose(2)
deform_conv_transpose3d = _transpose(3)


# --- modules -------------------------------------------------------------------------------------------------------

_CONV = {1: nn.Conv1d, 3: nn.Conv3d}
_CONV_ANY = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _conv_class(rank: int):
    name = f"deform_conv{rank}d"

    class DeformConv(_CONV[rank]):
        __doc__ = f"""Deformable {rank}-D convolution with externally supplied offsets (and optional mask).

    Parameters, initialisation and state_dict keys are ``nn.Conv{rank}d``'s (and tvdcn's ``DeformConv{rank}d``'s), so
    their checkpoints load.

    Args:
        in_channels (int), out_channels (int), kernel_size (int or tuple), stride (int or tuple, Default: 1),
        padding (int or tuple, Default: 0), dilation (int or tuple, Default: 1), groups (int, Default: 1),
        bias (bool, Default: ``True``): as ``nn.Conv{rank}d``'s (zero padding only).

    Shape:
        - input: ``[N, Cin, *S]``; offset: ``[N, {rank} * offset_groups * K, *O]``; mask: ``[N, offset_groups * K, *O]``
          or ``None``; output: ``[N, Cout, *O]`` (K the kernel's taps, O the output size).

    Example::

        >>> import torch, deformconv
        >>> conv = deformconv.DeformConv{rank}d(2, 4, 3, padding=1)
        >>> x = torch.randn(1, 2, *[5] * {rank})
        >>> conv(x, torch.zeros(1, {rank * 3 ** rank}, *[5] * {rank})).shape[1:2]
        torch.Size([4])
    """

        def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
                     padding: IntOrTuple = 0, dilation: IntOrTuple = 1, groups: int = 1, bias: bool = True):
            super().__init__(int_at_least(in_channels, "in_channels"), int_at_least(out_channels, "out_channels"),
                             ntuple(kernel_size, "kernel_size", rank, 1), ntuple(stride, "stride", rank, 1),
                             ntuple(padding, "padding", rank, 0), ntuple(dilation, "dilation", rank, 1),
                             int_at_least(groups, "groups"), bool(bias))

        def forward(self, input: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
            return _call(name, input, offset, self.weight, self.bias, mask, self.stride, self.padding, self.dilation,
                         0, 1, None)

    DeformConv.__name__ = DeformConv.__qualname__ = f"DeformConv{rank}d"
    return DeformConv


def _transpose_class(rank: int):
    name = f"deform_conv_transpose{rank}d"

    class DeformConvTranspose(_CONV_T[rank]):
        __doc__ = f"""Transposed deformable {rank}-D convolution with externally supplied offsets (and optional mask):
    :func:`deform_conv_transpose{rank}d` with ``nn.ConvTranspose{rank}d``'s parameters, initialisation and state_dict
    keys (and tvdcn's ``DeformConvTranspose{rank}d``'s).

    Args:
        in_channels, out_channels, kernel_size, stride (Default: 1), padding (Default: 0), output_padding
        (Default: 0), groups (Default: 1), bias (Default: ``True``), dilation (Default: 1): as
        ``nn.ConvTranspose{rank}d``'s, in its order (zero padding only).

    Shape:
        - input: ``[N, Cin, *I]``; offset: ``[N, {rank} * offset_groups * K, *I]``; mask: ``[N, offset_groups * K, *I]``
          or ``None``; output: ``[N, Cout, *Z]``.

    Example::

        >>> import torch, deformconv
        >>> up = deformconv.DeformConvTranspose{rank}d(4, 2, 3, stride=2, padding=1, output_padding=1)
        >>> x = torch.randn(1, 4, *[5] * {rank})
        >>> up(x, torch.zeros(1, {rank * 3 ** rank}, *[5] * {rank})).shape[2:]
        torch.Size([{", ".join(["10"] * rank)}])
    """

        def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
                     padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1, bias: bool = True,
                     dilation: IntOrTuple = 1):
            super().__init__(int_at_least(in_channels, "in_channels"), int_at_least(out_channels, "out_channels"),
                             ntuple(kernel_size, "kernel_size", rank, 1), ntuple(stride, "stride", rank, 1),
                             ntuple(padding, "padding", rank, 0), ntuple(output_padding, "output_padding", rank, 0),
                             int_at_least(groups, "groups"), bool(bias), ntuple(dilation, "dilation", rank, 1))

        def forward(self, input: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
            return _call(name, input, offset, self.weight, self.bias, mask, self.stride, self.padding, self.dilation,
                         self.output_padding, self.groups, None)

    DeformConvTranspose.__name__ = DeformConvTranspose.__qualname__ = f"DeformConvTranspose{rank}d"
    return DeformConvTranspose


DeformConv1d = _conv_class(1)
DeformConv3d = _conv_class(3)
DeformConvTranspose1d = _transpose_class(1)
DeformConvTranspose2d = _transpose_class(2)
DeformConvTranspose3d = _transpose_class(3)


def _pack_class(base, rank: int, transposed: bool):
    class Pack(base):
        __doc__ = f"""{base.__name__} that learns its own offsets (and, with ``modulated``, its mask: a sigmoid) with a
    zero-initialised ``conv_offset`` (``nn.Conv{rank}d``; at initialisation the layer is its plain convolution).
    {"conv_offset reads the input with a 3-wide kernel, stride 1 and padding 1 (the offsets live on the input's "
     "positions)" if transposed else "conv_offset has the layer's kernel, stride, padding and dilation"}.

    Args:
        as {base.__name__}'s, then offset_groups (int, Default: 1), modulated (bool, Default: ``False``).

    Example::

        >>> import torch, deformconv
        >>> layer = deformconv.{base.__name__}Pack(2, 4, 3, padding=1, modulated=True)
        >>> layer(torch.randn(1, 2, *[5] * {rank})).shape[1:2]
        torch.Size([4])
    """

        def __init__(self, *args, offset_groups: int = 1, modulated: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.offset_groups = int_at_least(offset_groups, "offset_groups")
            sampled = self.out_channels if transposed else self.in_channels
            if sampled % self.offset_groups:
                raise ValueError(f"{'out' if transposed else 'in'}_channels ({sampled}) must be divisible by "
                                 f"offset_groups ({self.offset_groups})")
            self.modulated = bool(modulated)
            taps = math.prod(self.kernel_size)
            self.offset_channels = self.offset_groups * taps * rank
            channels = self.offset_channels + (self.offset_groups * taps if self.modulated else 0)
            conv = _CONV_ANY[rank]
            if transposed:
                self.conv_offset = conv(self.in_channels, channels, 3, padding=1)
            else:
                self.conv_offset = conv(self.in_channels, channels, self.kernel_size, self.stride, self.padding,
                                        self.dilation)
            nn.init.zeros_(self.conv_offset.weight)
            nn.init.zeros_(self.conv_offset.bias)

        def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
            out = self.conv_offset(input)
            offset = out[:, :self.offset_channels]
            mask = torch.sigmoid(out[:, self.offset_channels:]) if self.modulated else None
            return super().forward(input, offset, mask)

    Pack.__name__ = Pack.__qualname__ = f"{base.__name__}Pack"
    return Pack


DeformConv1dPack = _pack_class(DeformConv1d, 1, False)
DeformConv3dPack = _pack_class(DeformConv3d, 3, False)
DeformConvTranspose1dPack = _pack_class(DeformConvTranspose1d, 1, True)
DeformConvTranspose2dPack = _pack_class(DeformConvTranspose2d, 2, True)
DeformConvTranspose3dPack = _pack_class(DeformConvTranspose3d, 3, True)
