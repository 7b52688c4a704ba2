"""DCNv3 and DCNv4: the functions, with InternImage's and FlashInternImage's argument names and order, converters
between their offset conventions and deform_conv2d's, and the ``DCNv3`` and ``DCNv4`` modules with InternImage's /
FlashInternImage's constructor arguments, forward signatures, initialisation and state_dict keys, so that their
checkpoints load. Semantics: ops/dcnv/geometry.py."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn

from . import config
from .checks import check_once, int_at_least, real_number
from .ops.common import dispatch
from .ops.common.eager import autocasting, run_eager, run_planned
from .ops.dcnv import op as _op
from .ops.dcnv.geometry import DcnGeometry, join_offset_mask, padded_dcnv4_channels, split_offset_mask


def _check(input: Tensor, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group,
           group_channels, offset_scale, remove_center) -> DcnGeometry:
    if not isinstance(input, Tensor) or input.dim() != 4:
        raise ValueError(f"input must be a 4-D tensor [N, H, W, group * group_channels] (NHWC), got "
                         f"{tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    kh, kw = int_at_least(kernel_h, "kernel_h"), int_at_least(kernel_w, "kernel_w")
    sh, sw = int_at_least(stride_h, "stride_h"), int_at_least(stride_w, "stride_w")
    ph, pw = int_at_least(pad_h, "pad_h", 0), int_at_least(pad_w, "pad_w", 0)
    dh, dw = int_at_least(dilation_h, "dilation_h"), int_at_least(dilation_w, "dilation_w")
    g, d = int_at_least(group, "group"), int_at_least(group_channels, "group_channels")
    if input.shape[3] != g * d:
        raise ValueError(f"input's last dim must be group * group_channels = {g} * {d} = {g * d} (NHWC), got "
                         f"{input.shape[3]} (input {tuple(input.shape)})")
    if remove_center and (kh != kw or kh % 2 == 0):
        raise ValueError(f"remove_center needs an odd square kernel, got kernel_h={kh}, kernel_w={kw}")
    if not isinstance(offset_scale, (int, float)) or isinstance(offset_scale, bool):
        raise TypeError(f"offset_scale must be a number, got {type(offset_scale).__name__}")
    geo = DcnGeometry(input.shape[0], input.shape[1], input.shape[2], g, d, (kh, kw), (sh, sw), (ph, pw), (dh, dw),
                      float(offset_scale), bool(remove_center))
    if geo.out_h <= 0 or geo.out_w <= 0:
        raise ValueError(f"the output would be empty ({geo.out_h}x{geo.out_w}) for input {tuple(input.shape)} with "
                         f"kernel ({kh}, {kw}), stride ({sh}, {sw}), pad ({ph}, {pw}), dilation ({dh}, {dw})")
    return geo


def _check_tensor(t, name: str, shape: Tuple[int, ...], input: Tensor, last_at_least: bool = False,
                  also: str = "") -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    ok = t.dim() == 4 and tuple(t.shape[:3]) == shape[:3] and (
        t.shape[3] >= shape[3] if last_at_least else t.shape[3] == shape[3])
    if not ok:
        want = f"[{shape[0]}, {shape[1]}, {shape[2]}, {'>= ' if last_at_least else ''}{shape[3]}]"
        raise ValueError(f"{name} must have shape {want}{' ' + also if also else ''}, got {tuple(t.shape)}")
    if t.device != input.device:
        raise ValueError(f"{name} must be on input's device {input.device}, got {t.device}")
    if t.dtype != input.dtype and not autocasting(input):
        raise TypeError(f"{name} must have input's dtype {input.dtype}, got {t.dtype}")


def _checked_v3(input: Tensor, offset: Tensor, mask: Tensor, params: tuple) -> DcnGeometry:
    """dcnv3's argument checks (bad input raises, naming the argument): its geometry."""
    geo = _check(input, *params)
    _check_tensor(offset, "offset", (geo.batch, geo.out_h, geo.out_w, geo.group * geo.points * 2), input)
    _check_tensor(mask, "mask", (geo.batch, geo.out_h, geo.out_w, geo.group * geo.points), input,
                  also=f"or [{geo.batch}, {geo.out_h}, {geo.out_w}, {geo.group}, {geo.points}]")
    return geo


def _checked_v4(input: Tensor, offset_mask: Tensor, params: tuple) -> DcnGeometry:
    """dcnv4's argument checks: its geometry."""
    geo = _check(input, *params)
    _check_tensor(offset_mask, "offset_mask", (geo.batch, geo.out_h, geo.out_w, geo.dcnv4_channels()), input,
                  last_at_least=True)
    return geo


_PLAIN_PARAMS = (int, float, bool)


def _planned(op: str, tensors: tuple, params: tuple, backend: Optional[str]) -> Optional[Tensor]:
    """The op's result through its call signature's Call of the Triton kernels (ops/dcnv/triton.py;
    common/eager.run_planned), or None where the call takes the general path (run_planned says when; also arguments
    of other types, an empty batch, another backend)."""
    if (backend is not None and type(backend) is not str) or not all(type(p) in _PLAIN_PARAMS for p in params):
        return None
    return run_planned("dcnv_eager", list(tensors), (op, params, backend, config.backend()),
                       lambda t: _new_call(op, t, params, backend))


def _new_call(op: str, tensors: list, params: tuple, backend: Optional[str]):
    """_planned's Call for a new signature (the checks run here: bad input raises), or None: the general path."""
    geo = _checked_v3(*tensors, params) if op == "dcnv3" else _checked_v4(*tensors, params)
    input = tensors[0]
    if input.shape[0] == 0 or dispatch.chosen_backend(op, input.device, input.dtype,
                                                      dispatch.backend_argument(op, backend)) != "triton":
        return None
    from .ops.dcnv import triton as kernels

    return kernels.call_for(geo, op == "dcnv4", *tensors)


def dcnv3(input: Tensor, offset: Tensor, mask: Tensor, kernel_h: int, kernel_w: int, stride_h: int, stride_w: int,
          pad_h: int, pad_w: int, dilation_h: int, dilation_w: int, group: int, group_channels: int,
          offset_scale: float, im2col_step: int = 256, remove_center: bool = False, *,
          backend: Optional[str] = None) -> Tensor:
    r"""DCNv3's core (InternImage): each group's channels aggregated over K deformed sampling points.

    Arguments in the order of InternImage's ``DCNv3Function.apply``. Point k of output (oh, ow) and group g
    samples the input bilinearly at ``y = oh*stride_h - pad_h + c_h + (j*dilation_h - c_h + dy)*offset_scale``
    (likewise x with i, dx), ``c = (dilation*(kernel-1)) // 2``, points ordered kw-outer (k = i*kernel_h + j), the
    centre skipped with ``remove_center``; only points strictly inside (-1, H) x (-1, W) count, corners outside
    the image read zero.

    Args:
        input (Tensor[N, H, W, group * group_channels]): NHWC.
        offset (Tensor[N, Ho, Wo, group * K * 2]): ``(dx, dy)`` per point.
        mask (Tensor[N, Ho, Wo, group * K] or Tensor[N, Ho, Wo, group, K]): aggregation weights (softmaxed over K
            by the caller).
        kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w (int): as a convolution's.
        group (int): G. group_channels (int): D.
        offset_scale (float): scales offsets and the taps' spread.
        im2col_step (int): accepted for compatibility; any value works. Default: 256.
        remove_center (bool): skip the centre point (odd square kernels), K = kh*kw - 1. Default: ``False``.
        backend (str, optional, keyword-only): ``"triton"``, ``"cpu"`` or ``"reference"``; ``None``: automatic.
            Default: ``None``.

    Returns:
        Tensor[N, Ho, Wo, group * group_channels], Ho and Wo as a convolution's.

    Example::

        >>> import torch, deformconv
        >>> x = torch.randn(2, 9, 11, 4 * 8)
        >>> offset, mask = torch.randn(2, 9, 11, 4 * 9 * 2), torch.rand(2, 9, 11, 4 * 9)
        >>> deformconv.dcnv3(x, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 4, 8, 1.0).shape
        torch.Size([2, 9, 11, 32])
    """
    params = (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group, group_channels,
              offset_scale, remove_center)
    if isinstance(mask, Tensor) and mask.dim() == 5 and mask.shape[3] == group:
        mask = mask.flatten(3)  # [N, Ho, Wo, G, K], as InternImage's CUDA op reads it too: the same elements
    out = _planned("dcnv3", (input, offset, mask), params, backend)
    if out is not None:
        return out
    geo = check_once("dcnv3", (input, offset, mask), lambda: _checked_v3(input, offset, mask, params),
                     params + (autocasting(input),))  # (the dtype rule depends on it)
    args = (input, offset, mask, list(geo.kernel), list(geo.stride), list(geo.pad), list(geo.dilation), geo.group,
            geo.group_channels, geo.offset_scale, geo.remove_center, dispatch.backend_argument("dcnv3", backend))
    out = run_eager(_op.dcnv3_forward, _op.dcnv3_backward, (0, 1, 2), args)
    return out if out is not None else torch.ops.deformconv.dcnv3(*args)


def dcnv4(input: Tensor, offset_mask: Tensor, kernel_h: int, kernel_w: int, stride_h: int, stride_w: int, pad_h: int,
          pad_w: int, dilation_h: int, dilation_w: int, group: int, group_channels: int, offset_scale: float,
          im2col_step: int = 256, remove_center: bool = False, *, backend: Optional[str] = None) -> Tensor:
    r"""DCNv4's core (FlashInternImage): DCNv3's sampling with one ``offset_mask`` tensor and raw (unnormalised)
    aggregation weights.

    Arguments in the order of FlashInternImage's ``DCNv4Function.apply``; any group_channels (DCNv4's CUDA kernels
    need a multiple of 16).

    Args:
        input (Tensor[N, H, W, group * group_channels]): NHWC.
        offset_mask (Tensor[N, Ho, Wo, P]): P >= 3 * group * K; group g's block of 3K channels starts at g*3K: K
            ``(dx, dy)`` pairs, then K weights. Channels past 3*group*K are ignored (DCNv4's module pads P to a
            multiple of 8).
        others: as :func:`dcnv3`.

    Returns:
        Tensor[N, Ho, Wo, group * group_channels].

    Example::

        >>> import torch, deformconv
        >>> x = torch.randn(2, 9, 11, 4 * 16)
        >>> om = torch.randn(2, 9, 11, 112)  # 3 * 4 * 9 = 108, padded to 112
        >>> deformconv.dcnv4(x, om, 3, 3, 1, 1, 1, 1, 1, 1, 4, 16, 1.0).shape
        torch.Size([2, 9, 11, 64])
    """
    params = (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, group, group_channels,
              offset_scale, remove_center)
    out = _planned("dcnv4", (input, offset_mask), params, backend)
    if out is not None:
        return out
    geo = check_once("dcnv4", (input, offset_mask), lambda: _checked_v4(input, offset_mask, params),
                     params + (autocasting(input),))  # (the dtype rule depends on it)
    args = (input, offset_mask, list(geo.kernel), list(geo.stride), list(geo.pad), list(geo.dilation), geo.group,
            geo.group_channels, geo.offset_scale, geo.remove_center, dispatch.backend_argument("dcnv4", backend))
    out = run_eager(_op.dcnv4_forward, _op.dcnv4_backward, (0, 1), args)
    return out if out is not None else torch.ops.deformconv.dcnv4(*args)


class DCNv3Function:
    """``DCNv3Function.apply(...)`` as InternImage's, for code that calls it directly: :func:`dcnv3`."""

    apply = staticmethod(dcnv3)


class DCNv4Function:
    """``DCNv4Function.apply(...)`` as FlashInternImage's: :func:`dcnv4`."""

    apply = staticmethod(dcnv4)


# --- converters ----------------------------------------------------------------------------------------


def dcnv4_to_dcnv3(offset_mask: Tensor, group: int, points: int) -> Tuple[Tensor, Tensor]:
    """DCNv4's ``offset_mask [N, Ho, Wo, P]`` as DCNv3's ``(offset [N, Ho, Wo, G*K*2], mask [N, Ho, Wo, G*K])``."""
    return split_offset_mask(offset_mask, group, points)


def dcnv3_to_dcnv4(offset: Tensor, mask: Tensor, group: int, channels: Optional[int] = None) -> Tensor:
    """DCNv3's offset and mask as DCNv4's ``offset_mask`` with ``channels`` channels (Default: DCNv4's module's
    count, 3*G*K rounded up to a multiple of 8; the padding is zero)."""
    points = mask.shape[-1] // group
    return join_offset_mask(offset, mask, group, points, channels or padded_dcnv4_channels(group, points))


def dcnv3_to_deform_conv2d(offset: Tensor, mask: Tensor, kernel_h: int, kernel_w: int, dilation_h: int,
                           dilation_w: int, group: int, offset_scale: float,
                           remove_center: bool = False) -> Tuple[Tensor, Tensor]:
    r"""DCNv3's offset and mask in deform_conv2d's convention: ``(offset [N, 2*G*kh*kw, Ho, Wo]`` with ``(dy, dx)``
    per tap in row-major order, ``mask [N, G*kh*kw, Ho, Wo])``, NCHW, offset_scale applied (and the removed centre a
    zero-weight tap). Then, for an input ``x`` [N, H, W, C] (C = G*D)::

        dcnv3(x, offset, mask, kh, kw, sh, sw, ph, pw, dh, dw, G, D, offset_scale) ==
        deform_conv2d(x.permute(0, 3, 1, 2), off, torch.ones(C, 1, kh, kw), stride=(sh, sw), padding=(ph, pw),
                      dilation=(dh, dw), mask=m).permute(0, 2, 3, 1)

    (a depthwise convolution of ones: groups = C, offset groups = G), except at a NaN sample point, which DCNv3
    skips and deform_conv2d samples as NaN.
    """
    n, ho, wo, _ = offset.shape
    geo = DcnGeometry(n, 1, 1, group, 1, (kernel_h, kernel_w), (1, 1), (0, 0), (dilation_h, dilation_w),
                      float(offset_scale), bool(remove_center))
    K = geo.points
    ch, cw = (dilation_h * (kernel_h - 1)) // 2, (dilation_w * (kernel_w - 1)) // 2
    dev, dt = offset.device, offset.dtype
    taps = torch.tensor(geo.taps(), device=dev, dtype=torch.int64)  # [K, (i, j)]
    off = offset.reshape(n, ho, wo, group, K, 2)
    # deform_conv2d samples at the regular tap (j*dil_h, i*dil_w) plus its offset; DCNv3 at c + (tap - c + d)*scale
    dy = (taps[:, 1] * dilation_h - ch).to(dt) * (offset_scale - 1) + off[..., 1] * offset_scale
    dx = (taps[:, 0] * dilation_w - cw).to(dt) * (offset_scale - 1) + off[..., 0] * offset_scale
    row_major = taps[:, 1] * kernel_w + taps[:, 0]  # deform_conv2d's tap index of each DCNv3 point
    out_off = offset.new_zeros(n, ho, wo, group, kernel_h * kernel_w, 2)
    out_mask = mask.new_zeros(n, ho, wo, group, kernel_h * kernel_w)
    out_off[..., row_major, 0] = dy
    out_off[..., row_major, 1] = dx
    out_mask[..., row_major] = mask.reshape(n, ho, wo, group, K)
    return (out_off.reshape(n, ho, wo, -1).permute(0, 3, 1, 2).contiguous(),
            out_mask.reshape(n, ho, wo, -1).permute(0, 3, 1, 2).contiguous())


# --- modules -----------------------------------------------------------------------------------------------


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
