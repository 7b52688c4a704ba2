"""Bilinear sampling through ``F.grid_sample`` and its backward, for the CPU backends of the NHWC ops (DCNv3/DCNv4,
multi-scale deformable attention): PyTorch's vectorised C++ sampler instead of the references' gathers.

The rule is the references' (gather.py): a point counts only strictly inside (−1, H) × (−1, W), corners outside the
image read zero. grid_sample alone would let a point on the border (y = −1 exactly) pass a gradient to its
coordinates, so the points that do not count are moved far outside (every corner unread: no sample, no gradient,
nothing non-finite read) and their weights set to zero.

Whole-pixel points (every point of a layer whose offsets are zero) must keep their pixel exactly where gradients are
taken: bilinear sampling's derivative jumps there, and the references take the corners (y0, y0 + 1) of
y0 = floor(y). Normalising to grid_sample's [−1, 1] by dividing by H does not round-trip exactly (2/7 does not exist
in binary), so for the backward (exact=True) each map is zero-padded to 2^k + 1 pixels a side and sampled with
align_corners=True: the grid is pixel / 2^(k−1) − 1, which grid_sample undoes exactly for whole pixels, and the
padding reads zero, as outside the image. A sample itself is continuous there (it moves by the rounding only), so
the forward (exact=False) samples the maps as they are, without the padded copy.

    planes    [B, D, H, W]     the maps sampled, one per (image, group or head); [B, D, H', W'] padded if exact
    y, x      [B, Q, P]        points in pixels of the H × W image (Q positions or queries, P points each)
    grid      [B, Q, P, 2]     grid_sample's normalised (x, y)
    samples   [B, D, Q, P]
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

_OUTSIDE = -3.0  # normalised coordinate of a point that does not count: all four corners far outside
Sizes = Union[int, Sequence[int]]


def _padded(size: int) -> int:
    """2^k + 1 >= size pixels."""
    return (1 << max(size - 2, 0).bit_length()) + 1


def planes_of(maps: Tensor, exact: bool) -> Tensor:
    """The maps [..., D, H, W] (any strides; the leading dims flattened into B) as grid_sample's input [B, D, H, W]: a
    view where the leading dims merge (one image), else a copy; if exact, a copy zero-padded to [B, D, H', W']
    (H' = 2^k + 1 >= H, likewise W')."""
    *lead, d, h, w = maps.shape
    if not exact:
        return maps.reshape(-1, d, h, w)
    planes = maps.new_empty(*lead, d, _padded(h), _padded(w))
    planes[..., :h, :w] = maps
    planes[..., h:, :] = 0  # the padding only: the maps' own pixels are written once
    planes[..., :h, w:] = 0
    return planes.view(-1, d, planes.shape[-2], planes.shape[-1])


def pixel_grid(y: Tensor, x: Tensor, H: Sizes, W: Sizes, exact: bool) -> Tuple[Tensor, Tensor]:
    """(grid, inside): grid_sample's grid for pixel points (y, x) of an H × W image (for planes_of(..., exact)), and
    which of them count. H and W may be lists, one size per level: then y and x are [..., L, Q, P], level by level."""
    (sy, oy, hy), (sx, ox, wx) = _axis(H, exact, y), _axis(W, exact, x)
    inside = (y > -1) & (y < hy) & (x > -1) & (x < wx)
    gx, gy = x * sx + ox, y * sy + oy
    return torch.stack((torch.where(inside, gx, _OUTSIDE), torch.where(inside, gy, _OUTSIDE)), -1), inside


def _axis(sizes: Sizes, exact: bool, like: Tensor):
    """(scale, shift, size) of one axis, grid = pixel · scale + shift: exact, pixel · 2 / 2^k − 1 (no rounding);
    else align_corners=False's (2 · pixel + 1) / size − 1. Python numbers for one size, [L, 1, 1] tensors for a list."""
    def one(size: int):
        return (2.0 / (_padded(size) - 1), -1.0, size) if exact else (2.0 / size, 1.0 / size - 1.0, size)
    if isinstance(sizes, int):
        return one(sizes)
    columns = list(zip(*[one(size) for size in sizes]))
    return tuple(torch.tensor(c, dtype=like.dtype, device=like.device).view(-1, 1, 1) for c in columns)


def sample(planes: Tensor, grid: Tensor, exact: bool) -> Tensor:
    """samples [B, D, Q, P] of planes at grid (zero outside), both made with the same exact."""
    return F.grid_sample(planes, grid, mode="bilinear", padding_mode="zeros", align_corners=exact)


def sample_backward(grad_samples: Tensor, planes: Tensor, grid: Tensor, H: int, W: int, need_planes: bool,
                    need_points: bool) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """From grad_samples [B, D, Q, P] of exact planes and grid: (grad of the H × W maps [B, D, H, W] (a view), grad_y,
    grad_x [B, Q, P] in pixels), None where not needed. A point that does not count gets zero from its unread
    corners."""
    g_planes, g_grid = torch.ops.aten.grid_sampler_2d_backward(grad_samples, planes, grid, 0, 0, True,
                                                              [need_planes, need_points])
    g_maps = g_planes[:, :, :H, :W] if need_planes else None
    if not need_points:
        return g_maps, None, None
    # grid = pixel · 2 / (size' − 1) − 1
    return g_maps, g_grid[..., 1] * (2.0 / (planes.shape[-2] - 1)), g_grid[..., 0] * (2.0 / (planes.shape[-1] - 1))
