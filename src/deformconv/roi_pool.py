"""Deformable RoI pooling: mmcv's ``deform_roi_pool`` and its modules (``DeformRoIPool``, ``DeformRoIPoolPack``,
``ModulatedDeformRoIPoolPack``) with their arguments and state_dict keys, and the papers' position-sensitive variant
(``deform_psroi_pool``, ``DeformPSRoIPooling``). Semantics: ops/roi_pool/__init__.py and ops/roi_pool/reference.py."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.fx
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from .checks import int_at_least, pair_at_least, real_number
from .ops.common import dispatch
from .ops.common.eager import run_eager
from .ops.roi_pool import op as _op  # registers torch.ops.deformconv.deform_roi_pool and deform_psroi_pool


def _check_input(input) -> None:
    if not isinstance(input, Tensor) or input.dim() != 4 or not input.is_floating_point():
        raise ValueError(f"input must be a floating-point tensor [N, C, H, W], got "
                         f"{tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__}")


def _check_rois(input: Tensor, rois: Tensor) -> None:
    if not isinstance(rois, Tensor) or rois.dim() != 2 or rois.shape[1] != 5:
        raise ValueError(f"rois must be a tensor [R, 5] of (batch index, x1, y1, x2, y2), got "
                         f"{tuple(rois.shape) if isinstance(rois, Tensor) else type(rois).__name__}")
    if not rois.is_floating_point():
        raise TypeError(f"rois must be floating point (box coordinates), got {rois.dtype}")
    if rois.device != input.device:
        raise ValueError(f"rois must be on input's device {input.device}, got {rois.device}")
    if rois.shape[0] and not torch.compiler.is_compiling() and not (
            rois.is_cuda and torch.cuda.is_current_stream_capturing()):
        # RoIs come from a step that has waited for the GPU already (proposals): reading their batch indices is cheap
        batch = rois[:, 0]
        if bool(((batch < 0) | (batch >= input.shape[0]) | (batch != batch.floor())).any()):
            raise ValueError(f"rois[:, 0] must be batch indices in [0, {input.shape[0]}), got values from "
                             f"{float(batch.min())} to {float(batch.max())}")


def deform_roi_pool(input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size: Union[int, Tuple[int, int]],
                    spatial_scale: float = 1.0, sampling_ratio: int = 0, gamma: float = 0.1, *,
                    backend: Optional[str] = None) -> Tensor:
    r"""Deformable RoI pooling (mmcv's ``deform_roi_pool``): aligned RoIAlign whose bins move by learned offsets.

    Each RoI is scaled by ``spatial_scale`` and shifted by -0.5 (no rounding) and cut into ``output_size`` bins;
    bin (i, j) starts ``gamma * (roi_width, roi_height) * offset[:, (0, 1), i, j]`` further, and is the mean of
    ``sampling_ratio**2`` bilinear samples (``0``: ``ceil(roi size / bins)`` along each axis). Without an offset
    this is ``torchvision.ops.roi_align(..., aligned=True)``.

    Args:
        input (Tensor[N, C, H, W]): NCHW or channels_last.
        rois (Tensor[R, 5]): (batch index, x1, y1, x2, y2) in image coordinates; floating point.
        offset (Tensor[R, 2, ph, pw], optional): (x, y) shift of each bin. ``None``: plain aligned RoIAlign.
        output_size (int or Tuple[int, int]): (ph, pw).
        spatial_scale (float): input pixels per image unit. Default: 1.0.
        sampling_ratio (int): samples per bin along each axis; 0: adaptive. Default: 0.
        gamma (float): scale of the offsets. Default: 0.1.
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"``; ``None``: automatic. Default: ``None``.

    Returns:
        Tensor[R, C, ph, pw] in input's dtype. Gradients for input and offset (the derivative of the forward as
        defined; mmcv's CUDA kernel drops part of it where a sample is clamped to the image's last row or column).

    Example::

        >>> import torch, deformconv
        >>> x = torch.randn(2, 16, 25, 38)
        >>> rois = torch.tensor([[0, 10.0, 12.0, 90.0, 70.0], [1, 0.0, 0.0, 150.0, 100.0]])
        >>> deformconv.deform_roi_pool(x, rois, None, 7, spatial_scale=0.25).shape
        torch.Size([2, 16, 7, 7])
    """
    _check_input(input)
    _check_rois(input, rois)
    ph, pw = _pair(output_size)
    if not all(isinstance(v, int) and v > 0 for v in (ph, pw)):
        raise ValueError(f"output_size must be positive ints, got {output_size!r}")
    if not isinstance(sampling_ratio, int) or sampling_ratio < 0:
        raise ValueError(f"sampling_ratio must be an int >= 0, got {sampling_ratio!r}")
    if offset is not None:
        if not isinstance(offset, Tensor) or tuple(offset.shape) != (rois.shape[0], 2, ph, pw):
            raise ValueError(f"offset must have shape [{rois.shape[0]}, 2, {ph}, {pw}], got "
                             f"{tuple(offset.shape) if isinstance(offset, Tensor) else type(offset).__name__}")
        if offset.device != input.device or not offset.is_floating_point():
            raise TypeError(f"offset must be a floating-point tensor on input's device {input.device}, got "
                            f"{offset.dtype} on {offset.device}")
    args = (input, rois, offset, [ph, pw], float(spatial_scale), int(sampling_ratio), float(gamma),
            dispatch.backend_argument("deform_roi_pool", backend))
    out = run_eager(_op.roi_pool_forward, _op.roi_pool_backward, (0, 2), args, keep=(1,))
    return out if out is not None else torch.ops.deformconv.deform_roi_pool(*args)


class DeformRoIPool(nn.Module):
    r"""mmcv's ``DeformRoIPool``: :func:`deform_roi_pool` with fixed settings; ``forward(input, rois, offset=None)``.

    Args:
        output_size (int or Tuple[int, int]). spatial_scale (float): Default: 1.0.
        sampling_ratio (int): Default: 0. gamma (float): Default: 0.1.

    Example::

        >>> import torch, deformconv
        >>> pool = deformconv.DeformRoIPool(7, spatial_scale=0.25)
        >>> pool(torch.randn(1, 8, 20, 20), torch.tensor([[0, 4.0, 4.0, 60.0, 50.0]])).shape
        torch.Size([1, 8, 7, 7])
    """

    def __init__(self, output_size, spatial_scale: float = 1.0, sampling_ratio: int = 0, gamma: float = 0.1):
        super().__init__()
        self.output_size = pair_at_least(output_size, "output_size", 1)
        self.spatial_scale = real_number(spatial_scale, "spatial_scale", positive=True)
        self.sampling_ratio = int_at_least(sampling_ratio, "sampling_ratio", 0)
        self.gamma = real_number(gamma, "gamma")

    def forward(self, input: Tensor, rois: Tensor, offset: Optional[Tensor] = None) -> Tensor:
        return deform_roi_pool(input, rois, offset, self.output_size, self.spatial_scale, self.sampling_ratio,
                               self.gamma)


def _fc_stack(in_features: int, hidden: int, out_features: int, layers: int) -> nn.Sequential:
    """Linear/ReLU layers (``layers`` Linear in all), the last one zero-initialised."""
    mods, width = [], in_features
    for _ in range(layers - 1):
        mods += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
        width = hidden
    mods.append(nn.Linear(width, out_features))
    nn.init.zeros_(mods[-1].weight)
    nn.init.zeros_(mods[-1].bias)
    return nn.Sequential(*mods)


class DeformRoIPoolPack(DeformRoIPool):
    r"""mmcv's ``DeformRoIPoolPack``: pools once, predicts each bin's offset with a 3-layer FC stack (``offset_fc``,
    last layer zero-initialised: training starts from RoIAlign), pools again with it; ``forward(input, rois)``.

    Args:
        output_size, spatial_scale, sampling_ratio, gamma: as :class:`DeformRoIPool`.
        output_channels (int): the input's channels C.
        deform_fc_channels (int): the FC stack's width. Default: 1024.

    Example::

        >>> import torch, deformconv
        >>> pool = deformconv.DeformRoIPoolPack(7, output_channels=8, deform_fc_channels=64, spatial_scale=0.25)
        >>> pool(torch.randn(1, 8, 20, 20), torch.tensor([[0, 4.0, 4.0, 60.0, 50.0]])).shape
        torch.Size([1, 8, 7, 7])
    """

    def __init__(self, output_size, output_channels: int, deform_fc_channels: int = 1024, spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, gamma: float = 0.1):
        super().__init__(output_size, spatial_scale, sampling_ratio, gamma)
        self.output_channels = int_at_least(output_channels, "output_channels")
        self.deform_fc_channels = int_at_least(deform_fc_channels, "deform_fc_channels")
        bins = self.output_size[0] * self.output_size[1]
        self.offset_fc = _fc_stack(bins * output_channels, deform_fc_channels, bins * 2, 3)

    def _pooled(self, input: Tensor, rois: Tensor) -> Tensor:
        _check_channels(input, self.output_channels)
        return deform_roi_pool(input, rois, None, self.output_size, self.spatial_scale, self.sampling_ratio, self.gamma)

    def forward(self, input: Tensor, rois: Tensor) -> Tensor:  # type: ignore[override]
        x = self._pooled(input, rois)
        offset = self.offset_fc(x.flatten(1)).view(rois.shape[0], 2, *self.output_size)  # flatten: no RoIs work too
        return deform_roi_pool(input, rois, offset, self.output_size, self.spatial_scale, self.sampling_ratio,
                               self.gamma)


class ModulatedDeformRoIPoolPack(DeformRoIPoolPack):
    r"""mmcv's ``ModulatedDeformRoIPoolPack``: :class:`DeformRoIPoolPack` times a per-bin sigmoid mask from a 2-layer
    FC stack (``mask_fc``, last Linear zero-initialised: a mask of 0.5 at the start).

    Example::

        >>> import torch, deformconv
        >>> pool = deformconv.ModulatedDeformRoIPoolPack(7, output_channels=8, deform_fc_channels=64)
        >>> pool(torch.randn(1, 8, 20, 20), torch.tensor([[0, 1.0, 1.0, 15.0, 12.0]])).shape
        torch.Size([1, 8, 7, 7])
    """

    def __init__(self, output_size, output_channels: int, deform_fc_channels: int = 1024, spatial_scale: float = 1.0,
                 sampling_ratio: int = 0, gamma: float = 0.1):
        super().__init__(output_size, output_channels, deform_fc_channels, spatial_scale, sampling_ratio, gamma)
        bins = self.output_size[0] * self.output_size[1]
        self.mask_fc = _fc_stack(bins * output_channels, deform_fc_channels, bins, 2)
        self.mask_fc.append(nn.Sigmoid())

    def forward(self, input: Tensor, rois: Tensor) -> Tensor:  # type: ignore[override]
        x = self._pooled(input, rois)
        flat = x.flatten(1)  # not reshape(R, -1): R = 0 RoIs work too
        offset = self.offset_fc(flat).view(rois.shape[0], 2, *self.output_size)
        mask = self.mask_fc(flat).view(rois.shape[0], 1, *self.output_size)
        return deform_roi_pool(input, rois, offset, self.output_size, self.spatial_scale, self.sampling_ratio,
                               self.gamma) * mask


def deform_psroi_pool(input: Tensor, rois: Tensor, offset: Optional[Tensor], spatial_scale: float, pooled_size: int,
                      output_dim: int, no_trans: bool, group_size: int = 1, part_size: Optional[int] = None,
                      sample_per_part: int = 4, trans_std: float = 0.0, *, backend: Optional[str] = None) -> Tensor:
    r"""Deformable position-sensitive RoI pooling, as the Deformable ConvNets papers' code (``DeformablePSROIPooling``;
    ``DCNv2Pooling``'s arguments).

    Args:
        input (Tensor[N, output_dim * group_size**2, H, W]): position-sensitive score maps.
        rois (Tensor[R, 5]): (batch index, x1, y1, x2, y2), image coordinates (rounded to whole pixels).
        offset (Tensor[R, 2 * classes, part_size, part_size], optional): (x, y) per part; ignored with no_trans.
        spatial_scale (float): input pixels per image unit.
        pooled_size (int): P, bins along each axis.
        output_dim (int): output channels (a multiple of the offset's classes).
        no_trans (bool): no offsets: deformable pooling off.
        group_size (int): G, position-sensitive cells along each axis. Default: 1.
        part_size (int, optional): offset cells along each axis. Default: ``pooled_size``.
        sample_per_part (int): samples along each axis of a bin. Default: 4.
        trans_std (float): scale of the offsets. Default: 0.0.
        backend (str, optional, keyword-only): ``"triton"`` or ``"reference"``; ``None``: automatic. Default: ``None``.

    Returns:
        Tensor[R, output_dim, P, P] in input's dtype. Gradients for input and offset (the derivative of the forward as
        defined: the original's offset gradient also counts samples clamped to the image's edge).

    Differences from ``torchvision.ops.ps_roi_align``: RoIs are rounded and their end moved one pixel on; samples sit
    at the start of each sub-bin (not its centre), count only within [-0.5, size - 0.5] and a bin averages those that
    count; group_size need not be the pooled size. They agree where those meet: whole-pixel RoIs inside the image,
    torchvision's shifted by half a sub-bin, group_size = pooled_size and sampling_ratio = sample_per_part.

    Example::

        >>> import torch, deformconv
        >>> x = torch.randn(1, 10 * 3 * 3, 20, 20)
        >>> rois = torch.tensor([[0, 8.0, 8.0, 60.0, 50.0]])
        >>> deformconv.deform_psroi_pool(x, rois, None, 0.25, 3, 10, True, group_size=3).shape
        torch.Size([1, 10, 3, 3])
    """
    _check_input(input)
    _check_rois(input, rois)
    for name, value, least in (("pooled_size", pooled_size, 1), ("output_dim", output_dim, 1),
                               ("group_size", group_size, 1), ("sample_per_part", sample_per_part, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    part_size = pooled_size if part_size is None else part_size
    if not isinstance(part_size, int) or part_size < 1:
        raise ValueError(f"part_size must be an int >= 1, got {part_size!r}")
    if input.shape[1] != output_dim * group_size ** 2:
        raise ValueError(f"input must have output_dim * group_size**2 = {output_dim * group_size ** 2} channels, got "
                         f"{input.shape[1]}")
    if no_trans:
        offset = None
    elif offset is None:
        raise ValueError("offset is required unless no_trans")
    else:
        if (not isinstance(offset, Tensor) or offset.dim() != 4 or offset.shape[0] != rois.shape[0]
                or offset.shape[1] % 2 or offset.shape[1] == 0 or tuple(offset.shape[2:]) != (part_size, part_size)):
            raise ValueError(f"offset must have shape [{rois.shape[0]}, 2 * classes, {part_size}, {part_size}], got "
                             f"{tuple(offset.shape) if isinstance(offset, Tensor) else type(offset).__name__}")
        if output_dim % (offset.shape[1] // 2):
            raise ValueError(f"output_dim ({output_dim}) must be a multiple of the offset's classes "
                             f"({offset.shape[1] // 2})")
        if offset.device != input.device or not offset.is_floating_point():
            raise TypeError(f"offset must be a floating-point tensor on input's device {input.device}, got "
                            f"{offset.dtype} on {offset.device}")
    args = (input, rois, offset, float(spatial_scale), pooled_size, output_dim, group_size, part_size,
            sample_per_part, float(trans_std), dispatch.backend_argument("deform_psroi_pool", backend))
    out = run_eager(_op.psroi_pool_forward, _op.psroi_pool_backward, (0, 2), args, keep=(1,))
    return out if out is not None else torch.ops.deformconv.deform_psroi_pool(*args)


class DeformPSRoIPooling(nn.Module):
    r"""The papers' deformable position-sensitive RoI pooling as a module with ``DCNv2Pooling``'s arguments:
    :func:`deform_psroi_pool`; ``forward(input, rois, offset=None)`` (offset required unless no_trans).

    Example::

        >>> import torch, deformconv
        >>> pool = deformconv.DeformPSRoIPooling(0.25, 3, 10, no_trans=False, group_size=3, trans_std=0.1)
        >>> x, rois = torch.randn(1, 90, 20, 20), torch.tensor([[0, 8.0, 8.0, 60.0, 50.0]])
        >>> pool(x, rois, torch.zeros(1, 2, 3, 3)).shape
        torch.Size([1, 10, 3, 3])
    """

    def __init__(self, spatial_scale: float, pooled_size: int, output_dim: int, no_trans: bool, group_size: int = 1,
                 part_size: Optional[int] = None, sample_per_part: int = 4, trans_std: float = 0.0):
        super().__init__()
        self.spatial_scale = real_number(spatial_scale, "spatial_scale", positive=True)
        self.pooled_size = int_at_least(pooled_size, "pooled_size")
        self.output_dim = int_at_least(output_dim, "output_dim")
        self.no_trans, self.group_size = bool(no_trans), int_at_least(group_size, "group_size")
        self.part_size = self.pooled_size if part_size is None else int_at_least(part_size, "part_size")
        self.sample_per_part = int_at_least(sample_per_part, "sample_per_part")
        self.trans_std = real_number(trans_std, "trans_std")

    def forward(self, input: Tensor, rois: Tensor, offset: Optional[Tensor] = None) -> Tensor:
        return deform_psroi_pool(input, rois, offset, self.spatial_scale, self.pooled_size, self.output_dim,
                                 self.no_trans, self.group_size, self.part_size, self.sample_per_part, self.trans_std)


def _check_channels(input: Tensor, channels: int) -> None:
    if input.shape[1] != channels:
        raise ValueError(f"input must have output_channels = {channels} channels, got {input.shape[1]}")


# torch.fx traces the modules through; these run as one call each when the traced module runs (the check reads a
# size, which symbolic tracing cannot), the ops as one call.
torch.fx.wrap("_check_channels")
torch.fx.wrap("deform_roi_pool")
torch.fx.wrap("deform_psroi_pool")
