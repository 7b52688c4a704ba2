"""Bilinear sampling through ``F.grid_sample`` and its backward, for the CPU backends of the NHWC ops (DCNv3/DCNv4,
multi-scale deformable attention): PyTorch's vectorised C++ sampler instead of the references' gathers.

The rule is the references' (gather.py): a point counts only strictly inside (−1, H) × (−1, W), corners outside the
image read zero. grid_sample alone would let a point on the border (y = −1 exactly) pass a gradient to its
coordinates, so the points that do not count are moved far outside (every corner unread: no sample, no gradient,
nothing non-finite read) and their weights set to zero.

Whole-pixel points (every point of a layer whose offsets are zero) must keep their pixel exactly: bilinear sampling's
derivative jumps there, and the references take the corners (y0, y0 + 1) of y0 = floor(y). Normalising to
grid_sample's [−1, 1] by dividing by H does not round-trip exactly (2/7 does not exist in binary), so each map is
zero-padded to 2^k + 1 pixels a side and sampled with align_corners=True: the grid is pixel / 2^(k−1) − 1, which
grid_sample undoes exactly for whole pixels. The padding reads zero, as outside the image.

    planes    [B, D, H', W']   the maps sampled, one per (image, group or head), padded (padded_planes)
    y, x      [B, Q, P]        points in pixels of the H × W image (Q positions or queries, P points each)
    grid      [B, Q, P, 2]     grid_sample's normalised (x, y)
    samples   [B, D, Q, P]
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

_OUTSIDE = -3.0  # normalised coordinate of a point that does not count: all four corners far outside


def _padded(size: int) -> int:
    """2^k + 1 >= size pixels."""
    return (1 << max(size - 2, 0).bit_length()) + 1


def padded_planes(maps: Tensor) -> Tensor:
    """A zero-padded copy [B, D, H', W'] of maps [..., D, H, W] (any strides; the leading dims flattened into B),
    H' = 2^k + 1 >= H (likewise W'): one copy."""
    *lead, d, h, w = maps.shape
    planes = maps.new_zeros(*lead, d, _padded(h), _padded(w))
    planes[..., :h, :w] = maps
    return planes.view(-1, d, planes.shape[-2], planes.shape[-1])


def pixel_grid(y: Tensor, x: Tensor, H: int, W: int) -> Tuple[Tensor, Tensor]:
    """(grid, inside): grid_sample's grid for pixel points (y, x) of an H × W image, and which of them count."""
    inside = (y > -1) & (y < H) & (x > -1) & (x < W)
    gx = torch.where(inside, x * (2.0 / (_padded(W) - 1)) - 1, _OUTSIDE)  # 2 / 2^k: exact
    gy = torch.where(inside, y * (2.0 / (_padded(H) - 1)) - 1, _OUTSIDE)
    return torch.stack((gx, gy), -1), inside


def sample(planes: Tensor, grid: Tensor) -> Tensor:
    """samples [B, D, Q, P] of padded planes at grid (zero outside)."""
    return F.grid_sample(planes, grid, mode="bilinear", padding_mode="zeros", align_corners=True)


def sample_backward(grad_samples: Tensor, planes: Tensor, grid: Tensor, H: int, W: int, need_planes: bool,
                    need_points: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """From grad_samples [B, D, Q, P]: (grad of the H × W maps [B, D, H, W] (a view), grad_y, grad_x [B, Q, P] in
    pixels), None where not needed. A point that does not count gets zero from its unread corners."""
    g_planes, g_grid = torch.ops.aten.grid_sampler_2d_backward(grad_samples, planes, grid, 0, 0, True,
                                                              [need_planes, need_points])
    g_maps = g_planes[:, :, :H, :W] if need_planes else None
    if not need_points:
        return g_maps, None, None
    # grid = pixel · 2 / (size' − 1) − 1
    return g_maps, g_grid[..., 1] * (2.0 / (planes.shape[-2] - 1)), g_grid[..., 0] * (2.0 / (planes.shape[-1] - 1))
