"""Bilinear sampling in plain PyTorch by gathers, for the references of the NHWC ops (DCNv3/DCNv4, multi-scale
deformable attention): points count only strictly inside (−1, H) × (−1, W) (a NaN point nowhere), corners outside
the image read zero, and no NaN or Inf of a pixel that is not read, or of a point that does not count, reaches a
result or a gradient."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor


def bilinear_corners(value: Tensor, y: Tensor, x: Tensor, H: int, W: int) -> Tuple[List[tuple], Tensor]:
    """The 4 bilinear corners of points (y, x) [n, Q, G, P] (pixels) in value [n, H·W, G, D], group by group.

    Returns (corners, inside): per corner (index [n, Q·P, G] into value's pixels, its value [n, Q, G, P, D] (zero
    where not read), weight, d weight / dy, d weight / dx [n, Q, G, P]); inside [n, Q, G, P]: the points that count.
    """
    n, q, g, p = y.shape
    d = value.shape[-1]
    inside = (y > -1) & (y < H) & (x > -1) & (x < W)
    y = torch.where(inside, y, torch.zeros_like(y))  # before the fractions: nothing non-finite reaches a product
    x = torch.where(inside, x, torch.zeros_like(x))
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    hy, hx = 1 - ly, 1 - lx
    y0i, x0i = y0.to(torch.int64), x0.to(torch.int64)
    corners = []
    for dy, dx, wgt, dwy, dwx in ((0, 0, hy * hx, -hx, -hy), (0, 1, hy * lx, -lx, hy), (1, 0, ly * hx, hx, -ly),
                                  (1, 1, ly * lx, lx, ly)):
        yi, xi = y0i + dy, x0i + dx
        valid = inside & (yi >= 0) & (yi < H) & (xi >= 0) & (xi < W)
        # gather's index: [n, Q·P, G] (points before groups, so that the group axis meets value's)
        flat = (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).transpose(-1, -2).reshape(n, -1, g)
        v = torch.gather(value, 1, flat[..., None].expand(n, flat.shape[1], g, d))
        v = v.reshape(n, q, p, g, d).transpose(2, 3)  # [n, Q, G, P, D]
        v = torch.where(valid[..., None], v, torch.zeros_like(v))
        corners.append((flat, v, torch.where(valid, wgt, torch.zeros_like(wgt)), dwy, dwx))
    return corners, inside


def samples(corners) -> Tensor:
    """The bilinear samples [n, Q, G, P, D] from bilinear_corners."""
    out = None
    for _, v, wgt, _, _ in corners:
        term = wgt[..., None] * v
        out = term if out is None else out + term
    return out


def scatter_corners(grad_value: Tensor, corners, grad_samples: Tensor) -> None:
    """grad_value [n, H·W, G, D] += the corners' shares (their weights) of grad_samples [n, Q, G, P, D]."""
    n, _, g, d = grad_value.shape
    for flat, _, wgt, _, _ in corners:
        contrib = (grad_samples * wgt[..., None]).transpose(2, 3).reshape(n, -1, g, d)  # [n, Q·P, G, D]
        grad_value.scatter_add_(1, flat[..., None].expand(n, flat.shape[1], g, d), contrib)


def coordinate_grads(corners, grad_samples: Tensor) -> Tuple[Tensor, Tensor]:
    """Σ_d grad_samples · ∂sample/∂(y, x), each [n, Q, G, P] (zero for a point that does not count: its corners read
    nothing)."""
    gy = sum(dwy[..., None] * v for _, v, _, dwy, _ in corners)
    gx = sum(dwx[..., None] * v for _, v, _, _, dwx in corners)
    return (grad_samples * gy).sum(-1), (grad_samples * gx).sum(-1)
