"""deform_conv2d (DCNv1 offsets, DCNv2 modulation): the function, a drop-in replacement for
``torchvision.ops.deform_conv2d``, and the modules: ``DeformConv2d`` (torchvision's parameters and keys) and the
``*Pack`` layers that learn their own offsets (and mask) with a zero-initialised ``conv_offset`` (mmcv's keys)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.fx
from torch import Tensor, nn

from . import onnx as _onnx
from .checks import IntPair, check_deform_conv2d_args, int_at_least, pair, pair_at_least
from .ops.common.eager import fast_path_ok
from .ops.deform_conv2d import eager as _eager  # (its op.py registers torch.ops.deformconv.deform_conv2d*)
from .ops.deform_conv2d.modulation import split_offset_mask


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
    return _eager.deform_conv2d(input, offset, weight, bias, stride, padding, dilation, mask, backend)


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


# --- modules -----------------------------------------------------------------------------------------------


class DeformConv2d(nn.Module):
    r"""Deformable convolution with externally supplied offsets (and optional mask).

    Parameter names and initialisation match :class:`torchvision.ops.DeformConv2d`, so its state_dict loads.

    Args:
        in_channels (int): channels of the input, ``Cin``.
        out_channels (int): channels of the output, ``Cout``.
        kernel_size (int or Tuple[int, int]): ``(kh, kw)``.
        stride (int or Tuple[int, int]): Default: 1.
        padding (int or Tuple[int, int]): Default: 0.
        dilation (int or Tuple[int, int]): Default: 1.
        groups (int): blocked connections from input to output channels. Default: 1.
        bias (bool): learn an additive bias. Default: ``True``.

    Shape:
        - input: ``[N, Cin, H, W]``
        - offset: ``[N, 2 * offset_groups * kh * kw, Ho, Wo]`` with ``(dy, dx)`` per tap
        - mask: ``[N, offset_groups * kh * kw, Ho, Wo]`` or ``None``
        - output: ``[N, Cout, Ho, Wo]``

    Example::

        >>> import torch, deformconv
        >>> conv = deformconv.DeformConv2d(4, 8, 3, padding=1)
        >>> x = torch.randn(1, 4, 9, 9)
        >>> conv(x, torch.zeros(1, 18, 9, 9)).shape
        torch.Size([1, 8, 9, 9])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        bias: bool = True,
    ):
        super().__init__()
        in_channels, out_channels = int_at_least(in_channels, "in_channels"), int_at_least(out_channels, "out_channels")
        groups = int_at_least(groups, "groups")
        if in_channels % groups != 0:
            raise ValueError(f"in_channels must be a positive multiple of groups ({groups}), got {in_channels}")
        if out_channels % groups != 0:
            raise ValueError(f"out_channels must be a positive multiple of groups ({groups}), got {out_channels}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = pair_at_least(kernel_size, "kernel_size", 1)
        self.stride = pair_at_least(stride, "stride", 1)
        self.padding = pair_at_least(padding, "padding", 0)
        self.dilation = pair_at_least(dilation, "dilation", 1)
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1] * self.weight.shape[2] * self.weight.shape[3]
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: Tensor, offset: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self._deform(input, offset, mask)

    def _deform(self, input: Tensor, offset: Tensor, mask: Optional[Tensor]) -> Tensor:
        if torch.jit.is_scripting():
            return deform_conv2d_script(input, offset, self.weight, self.bias, [self.stride[0], self.stride[1]],
                                        [self.padding[0], self.padding[1]], [self.dilation[0], self.dilation[1]],
                                        mask)
        return deform_conv2d(input, offset, self.weight, self.bias, self.stride, self.padding, self.dilation, mask)

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
            f", padding={self.padding}, dilation={self.dilation}"
        )
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        return s


class _PackBase(DeformConv2d):
    """A DeformConv2d with its own ``conv_offset``: a plain conv of the same geometry that predicts
    ``channels_per_tap`` values per tap and offset group from the input, initialised to zero."""

    channels_per_tap = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntPair,
        stride: IntPair = 1,
        padding: IntPair = 0,
        dilation: IntPair = 1,
        groups: int = 1,
        offset_groups: int = 1,
        bias: bool = True,
        *,
        deform_groups: Optional[int] = None,
    ):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
        if deform_groups is not None:
            offset_groups = deform_groups
        offset_groups = int_at_least(offset_groups, "offset_groups")
        if in_channels % offset_groups != 0:
            raise ValueError(
                f"in_channels ({in_channels}) must be divisible by offset_groups, got offset_groups={offset_groups}"
            )
        self.offset_groups = offset_groups
        kh, kw = self.kernel_size
        self.conv_offset = nn.Conv2d(
            in_channels,
            offset_groups * self.channels_per_tap * kh * kw,
            self.kernel_size,
            stride=self.stride,
            padding=self.padding,
            dilation=self.dilation,
            bias=True,
        )
        self.init_offset()

    @property
    def deform_groups(self) -> int:  # mmcv's name
        return self.offset_groups

    def init_offset(self) -> None:
        """Zero the offset conv, so that a fresh layer samples the regular grid."""
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Older DCNv2 code names the offset conv `conv_offset_mask`.
        for suffix in ("weight", "bias"):
            old = f"{prefix}conv_offset_mask.{suffix}"
            if old in state_dict:
                state_dict[f"{prefix}conv_offset.{suffix}"] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", offset_groups={self.offset_groups}" if self.offset_groups != 1 else "")


class DeformConv2dPack(_PackBase):
    r"""DCNv1 layer that learns its offsets: ``offset = conv_offset(input)``.

    Args: as :class:`DeformConv2d`, plus ``offset_groups`` (int, alias ``deform_groups`` as in mmcv):
    how many independent offset fields the input channels are split into. Default: 1.
    ``conv_offset`` is a ``Conv2d(in_channels, 2 * offset_groups * kh * kw)`` with the layer's kernel size,
    stride, padding and dilation, initialised to zero: at initialisation the layer is a plain convolution.
    State-dict keys are mmcv's: ``weight``, ``bias``, ``conv_offset.weight``, ``conv_offset.bias``.

    Shape:
        - input: ``[N, Cin, H, W]``; output: ``[N, Cout, Ho, Wo]``

    Example::

        >>> import torch, deformconv
        >>> layer = deformconv.DeformConv2dPack(4, 8, 3, padding=1)
        >>> layer(torch.randn(2, 4, 7, 7)).shape
        torch.Size([2, 8, 7, 7])
    """

    channels_per_tap = 2

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        return self._deform(input, self.conv_offset(input), None)


class ModulatedDeformConv2dPack(_PackBase):
    r"""DCNv2 layer that learns its offsets and modulation mask from the input.

    ``conv_offset`` predicts ``3 * offset_groups * kh * kw`` channels: the first ``2 * offset_groups * kh * kw``
    are the offsets (``(dy, dx)`` per tap), the rest pass through a sigmoid to give the mask. Zero-initialised,
    so a fresh layer is a plain convolution with every sample weighted 0.5 (the DCNv2 recipe). Keys as
    mmcv's ``ModulatedDeformConv2dPack``.

    Args: as :class:`DeformConv2dPack`.

    Shape:
        - input: ``[N, Cin, H, W]``; output: ``[N, Cout, Ho, Wo]``

    Example::

        >>> import torch, deformconv
        >>> layer = deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1)
        >>> layer(torch.randn(2, 4, 7, 7)).shape
        torch.Size([2, 8, 7, 7])
    """

    channels_per_tap = 3

    def offset_and_mask(self, input: Tensor) -> Tuple[Tensor, Tensor]:
        """The learned ``(offset, mask)`` for this input."""
        return self._split(self.conv_offset(input))

    def _split(self, out: Tensor) -> Tuple[Tensor, Tensor]:
        """(offset, mask) of the offset conv's output: its first 2·offset_groups·kh·kw channels, the sigmoid of the
        rest."""
        n_off = self._offset_channels()
        if not torch.jit.is_scripting():
            split = self._split_eagerly(out, n_off)
            if split is not None:
                return split
        return out[:, :n_off], torch.sigmoid(out[:, n_off:])

    def _offset_channels(self) -> int:
        return 2 * self.offset_groups * self.kernel_size[0] * self.kernel_size[1]

    @torch.jit.unused
    def _split_eagerly(self, out: Tensor, n_off: int) -> Optional[Tuple[Tensor, Tensor]]:
        """The same split in one autograd node (ops/deform_conv2d/modulation.py), or None under torch.compile and the
        like."""
        return split_offset_mask(out, n_off)

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        if not torch.jit.is_scripting():
            out = self._forward_eagerly(input)
            if out is not None:
                return out
        offset, mask = self.offset_and_mask(input)
        return self._deform(input, offset, mask)

    @torch.jit.unused
    def _forward_eagerly(self, input: Tensor) -> Optional[Tensor]:
        """The offset conv, then the split and the op in one autograd node (ops/deform_conv2d/eager.py)
        where that applies, else one after the other; None, before anything runs, where the call is not a plain eager
        one (fast_path_ok: under torch.compile and the like, forward takes offset_and_mask and _deform)."""
        if not fast_path_ok([input]):
            return None
        out = self.conv_offset(input)
        result = _eager.modulated_from_offset_conv(input, out, self._offset_channels(), self.weight, self.bias,
                                                   list(self.stride), list(self.padding), list(self.dilation))
        if result is not None:
            return result
        offset, mask = self._split(out)
        return self._deform(input, offset, mask)
