"""``DCNv3`` and ``DCNv4`` modules with InternImage's / FlashInternImage's constructor arguments, forward signatures,
initialisation and state_dict keys, so that their checkpoints load."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import int_at_least, real_number
from .dcnv import dcnv3, dcnv4


class _ToChannelsLast(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 2, 3, 1)


class _ToChannelsFirst(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 3, 1, 2)


def _check_input(input: Tensor, layout: str, channels: int) -> None:
    """A block's input: len(layout) dimensions (layout names them, e.g. "[N, H, W, C]"), its last of size channels."""
    dims = layout.count(",") + 1
    if not isinstance(input, Tensor) or input.dim() != dims or input.shape[-1] != channels:
        got = f"shape {tuple(input.shape)}" if isinstance(input, Tensor) else type(input).__name__
        raise ValueError(f"input must be {layout} with C = channels = {channels}, got {got}")


def _check_settings(channels, kernel_size, dw_kernel_size, stride, pad, dilation, group, offset_scale,
                    remove_center) -> None:
    """The blocks' constructor arguments, checked as dcnv3/dcnv4 check theirs (naming the argument)."""
    channels, group = int_at_least(channels, "channels"), int_at_least(group, "group")
    if channels % group != 0:
        raise ValueError(f"channels must be a positive multiple of group ({group}), got {channels}")
    kernel_size = int_at_least(kernel_size, "kernel_size")
    if dw_kernel_size is not None:
        int_at_least(dw_kernel_size, "dw_kernel_size")
    int_at_least(stride, "stride"), int_at_least(pad, "pad", 0), int_at_least(dilation, "dilation")
    real_number(offset_scale, "offset_scale")
    if remove_center and kernel_size % 2 == 0:
        raise ValueError(f"remove_center needs an odd kernel_size, got {kernel_size}")


def _norm(channels: int, norm_layer: str) -> nn.Sequential:
    """NCHW in, NHWC out, with the source's layer order (its state_dict keys: dw_conv.1.0 for BN, .1.1 for LN)."""
    if norm_layer == "BN":
        return nn.Sequential(nn.BatchNorm2d(channels), _ToChannelsLast())
    if norm_layer == "LN":
        return nn.Sequential(_ToChannelsLast(), nn.LayerNorm(channels, eps=1e-6))
    raise ValueError(f"norm_layer must be 'LN' or 'BN', got {norm_layer!r}")


def _act(act_layer: str) -> nn.Module:
    acts = {"ReLU": lambda: nn.ReLU(inplace=True), "SiLU": lambda: nn.SiLU(inplace=True), "GELU": nn.GELU}
    if act_layer not in acts:
        raise ValueError(f"act_layer must be one of {sorted(acts)}, got {act_layer!r}")
    return acts[act_layer]()


def _center_feature_scale(module: nn.Module, query: Tensor, channels: int, group: int) -> Tensor:
    """The per-group blend factor sigmoid(query @ W^T + b), repeated over each group's channels."""
    scale = F.linear(query, module.center_feature_scale_proj_weight, module.center_feature_scale_proj_bias).sigmoid()
    return scale[..., None].repeat(1, 1, 1, 1, channels // group).flatten(-2)


def _add_center_feature_scale(module: nn.Module, channels: int, group: int) -> None:
    module.center_feature_scale_proj_weight = nn.Parameter(torch.zeros(group, channels))
    module.center_feature_scale_proj_bias = nn.Parameter(torch.zeros(group))


class DCNv3(nn.Module):
    r"""InternImage's DCNv3 block: input_proj, a depthwise conv + norm + activation predicting offsets and
    (softmaxed) aggregation weights, the DCNv3 core (:func:`deformconv.dcnv3`), output_proj.

    Args:
        channels (int): C. Default: 64.
        kernel_size (int): Default: 3.
        dw_kernel_size (int, optional): the offset branch's depthwise kernel. Default: ``kernel_size``.
        stride (int): Default: 1. pad (int): Default: 1. dilation (int): Default: 1.
        group (int): G, dividing C. Default: 4.
        offset_scale (float): Default: 1.0.
        act_layer (str): ``"GELU"``, ``"ReLU"`` or ``"SiLU"``. Default: ``"GELU"``.
        norm_layer (str): ``"LN"`` or ``"BN"``. Default: ``"LN"``.
        center_feature_scale (bool): blend the output with input_proj's by a learned per-group factor.
            Default: ``False``.
        remove_center (bool): skip the centre point (odd kernel_size). Default: ``False``.

    Shape:
        - input: ``[N, H, W, C]``; output: ``[N, Ho, Wo, C]``.

    Example::

        >>> import torch, deformconv
        >>> m = deformconv.DCNv3(channels=32, group=4)
        >>> m(torch.randn(2, 9, 11, 32)).shape
        torch.Size([2, 9, 11, 32])
    """

    def __init__(self, channels: int = 64, kernel_size: int = 3, dw_kernel_size: Optional[int] = None,
                 stride: int = 1, pad: int = 1, dilation: int = 1, group: int = 4, offset_scale: float = 1.0,
                 act_layer: str = "GELU", norm_layer: str = "LN", center_feature_scale: bool = False,
                 remove_center: bool = False):
        super().__init__()
        _check_settings(channels, kernel_size, dw_kernel_size, stride, pad, dilation, group, offset_scale,
                        remove_center)
        dw_kernel_size = dw_kernel_size if dw_kernel_size is not None else kernel_size
        self.channels, self.kernel_size, self.dw_kernel_size = channels, kernel_size, dw_kernel_size
        self.stride, self.pad, self.dilation, self.group = stride, pad, dilation, group
        self.group_channels = channels // group
        self.offset_scale = offset_scale
        self.center_feature_scale = center_feature_scale
        self.remove_center = int(remove_center)
        points = kernel_size * kernel_size - self.remove_center
        self.dw_conv = nn.Sequential(
            nn.Conv2d(channels, channels, dw_kernel_size, stride=1, padding=(dw_kernel_size - 1) // 2, groups=channels),
            _norm(channels, norm_layer), _act(act_layer))
        self.offset = nn.Linear(channels, group * points * 2)
        self.mask = nn.Linear(channels, group * points)
        self.input_proj = nn.Linear(channels, channels)
        self.output_proj = nn.Linear(channels, channels)
        self._reset_parameters()
        if center_feature_scale:
            _add_center_feature_scale(self, channels, group)

    def _reset_parameters(self) -> None:
        for layer in (self.offset, self.mask):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        for layer in (self.input_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, input: Tensor) -> Tensor:
        _check_input(input, "[N, H, W, C]", self.channels)
        n, h, w = input.shape[0], input.shape[1], input.shape[2]
        x = self.input_proj(input)
        x_proj = x
        x1 = self.dw_conv(input.permute(0, 3, 1, 2))
        offset = self.offset(x1)
        points = self.mask.out_features // self.group  # sizes spelled out, not -1: an empty batch reshapes too
        mask = F.softmax(self.mask(x1).reshape(n, h, w, self.group, points), -1)
        mask = mask.reshape(n, h, w, self.group * points).type(x.dtype)
        x = dcnv3(x, offset, mask, self.kernel_size, self.kernel_size, self.stride, self.stride, self.pad,
                  self.pad, self.dilation, self.dilation, self.group, self.group_channels, self.offset_scale,
                  256, bool(self.remove_center))
        if self.center_feature_scale:
            scale = _center_feature_scale(self, x1, self.channels, self.group)
            x = x * (1 - scale) + x_proj * scale
        return self.output_proj(x)


class DCNv4(nn.Module):
    r"""FlashInternImage's DCNv4 block: value_proj, one Linear predicting offsets and raw aggregation weights
    (optionally after a depthwise conv), the DCNv4 core (:func:`deformconv.dcnv4`), output_proj. Any group_channels
    (DCNv4's own module asserts a multiple of 16).

    Args:
        channels (int): C. Default: 64.
        kernel_size (int): Default: 3. stride (int): Default: 1. pad (int): Default: 1. dilation (int): Default: 1.
        group (int): G, dividing C. Default: 4.
        offset_scale (float): Default: 1.0.
        dw_kernel_size (int, optional): a depthwise conv before the offset_mask Linear. Default: ``None`` (none).
        center_feature_scale (bool): Default: ``False``.
        remove_center (bool): Default: ``False``.
        output_bias (bool): output_proj's bias. Default: ``True``.
        without_pointwise (bool): no value_proj / output_proj. Default: ``False``.

    Shape:
        - input: ``[N, L, C]`` with L = H*W (``shape=(H, W)``, or a square H = W = sqrt(L)); output: ``[N, L, C]``
          (stride 1 and "same" padding keep L).

    Example::

        >>> import torch, deformconv
        >>> m = deformconv.DCNv4(channels=64, group=4)
        >>> m(torch.randn(2, 9 * 11, 64), shape=(9, 11)).shape
        torch.Size([2, 99, 64])
    """

    def __init__(self, channels: int = 64, kernel_size: int = 3, stride: int = 1, pad: int = 1, dilation: int = 1,
                 group: int = 4, offset_scale: float = 1.0, dw_kernel_size: Optional[int] = None,
                 center_feature_scale: bool = False, remove_center: bool = False, output_bias: bool = True,
                 without_pointwise: bool = False, **kwargs):
        super().__init__()
        _check_settings(channels, kernel_size, dw_kernel_size, stride, pad, dilation, group, offset_scale,
                        remove_center)
        self.channels, self.kernel_size, self.stride, self.pad = channels, kernel_size, stride, pad
        self.dilation, self.group, self.group_channels = dilation, group, channels // group
        self.offset_scale, self.dw_kernel_size = offset_scale, dw_kernel_size
        self.center_feature_scale = center_feature_scale
        self.remove_center = int(remove_center)
        self.without_pointwise = without_pointwise
        self.K = group * (kernel_size * kernel_size - self.remove_center)
        if dw_kernel_size is not None:
            self.offset_mask_dw = nn.Conv2d(channels, channels, dw_kernel_size, stride=1,
                                            padding=(dw_kernel_size - 1) // 2, groups=channels)
        self.offset_mask = nn.Linear(channels, int(math.ceil((self.K * 3) / 8) * 8))
        if not without_pointwise:
            self.value_proj = nn.Linear(channels, channels)
            self.output_proj = nn.Linear(channels, channels, bias=output_bias)
        self._reset_parameters()
        if center_feature_scale:
            _add_center_feature_scale(self, channels, group)

    def _reset_parameters(self) -> None:
        nn.init.zeros_(self.offset_mask.weight)
        nn.init.zeros_(self.offset_mask.bias)
        if not self.without_pointwise:
            nn.init.xavier_uniform_(self.value_proj.weight)
            nn.init.zeros_(self.value_proj.bias)
            nn.init.xavier_uniform_(self.output_proj.weight)
            if self.output_proj.bias is not None:
                nn.init.zeros_(self.output_proj.bias)

    def forward(self, input: Tensor, shape: Optional[Tuple[int, int]] = None) -> Tensor:
        _check_input(input, "[N, L, C]", self.channels)
        n, length, c = input.shape[0], input.shape[1], input.shape[2]
        hw = _grid(length, shape)
        h, w = hw[0], hw[1]
        x = self.value_proj(input) if not self.without_pointwise else input
        x = x.reshape(n, h, w, x.shape[-1])  # sizes spelled out, not -1: an empty batch reshapes too
        if self.dw_kernel_size is not None:
            om_in = self.offset_mask_dw(input.view(n, h, w, c).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(
                n, length, c)
        else:
            om_in = input
        offset_mask = self.offset_mask(om_in).reshape(n, h, w, self.offset_mask.out_features)
        x_proj = x
        x = dcnv4(x, offset_mask, self.kernel_size, self.kernel_size, self.stride, self.stride, self.pad,
                  self.pad, self.dilation, self.dilation, self.group, self.group_channels, self.offset_scale,
                  256, bool(self.remove_center))
        if self.center_feature_scale:
            scale = _center_feature_scale(self, x, self.channels, self.group)
            x = x * (1 - scale) + x_proj * scale
        x = x.reshape(n, x.shape[1] * x.shape[2], x.shape[-1])
        return self.output_proj(x) if not self.without_pointwise else x


def _grid(length: int, shape: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """DCNv4's (H, W) for an input of L positions: shape, else a square."""
    h, w = shape if shape is not None else (math.isqrt(length), math.isqrt(length))
    if h * w != length:
        raise ValueError(f"input's length {length} is not H*W for shape {(h, w)} (pass shape=(H, W))")
    return h, w


# torch.fx traces the blocks' forwards through; these run as one call each when the traced module runs (they read
# sizes as ints, which symbolic tracing cannot), the ops as one call of each.
torch.fx.wrap("_check_input")
torch.fx.wrap("_grid")
torch.fx.wrap("dcnv3")
torch.fx.wrap("dcnv4")
