"""The DCNv3/DCNv4 core on the CPU: each (image, group) a map of D channels sampled by ``F.grid_sample`` at its K
points a position (common/grid.py), the points weighted and summed; the backward through grid_sample's own. The same
definition and signatures as reference.py (the oracle), in chunks of images.

    input   [N, H, W, G·D]  ->  planes [n·G, D, H, W]
    points  y, x [n·G, Ho·Wo, K]
    out     [N, Ho, Wo, G·D]  <-  Σ_k weight · samples [n·G, D, Ho·Wo, K]

Half inputs compute in float32 and round once.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..common import grid
from . import reference
from .geometry import DcnGeometry
from .reference import _chunk, compute_dtype, sampling_coordinates


def _setup(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry, ctype: torch.dtype, exact: bool):
    """A chunk's planes, grid and weights [n·G, 1, Ho·Wo, K] (zero for the points that do not count); exact: for the
    backward (common/grid.py)."""
    n, G, D, K = input.shape[0], geo.group, geo.group_channels, geo.points
    planes = grid.planes_of(input.reshape(n, geo.height, geo.width, G, D).permute(0, 3, 4, 1, 2).to(ctype), exact)
    y, x = (c.permute(0, 3, 1, 2, 4).reshape(n * G, -1, K) for c in sampling_coordinates(offset, geo, ctype))
    points, inside = grid.pixel_grid(y, x, geo.height, geo.width, exact)
    m = mask.to(ctype).reshape(n, -1, G, K).transpose(1, 2).reshape(n * G, 1, -1, K)
    return planes, points, inside, torch.where(inside[:, None], m, 0.0)


def _to_nhwc(t: Tensor, n: int, geo: DcnGeometry) -> Tensor:
    """[n·G, D, Ho·Wo] -> [n, Ho, Wo, G·D]."""
    return t.reshape(n, geo.group, geo.group_channels, geo.out_h, geo.out_w).permute(0, 3, 4, 1, 2).reshape(
        n, geo.out_h, geo.out_w, geo.channels)


def dcn_forward(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry) -> Tensor:
    """out [N, Ho, Wo, G·D] in input's dtype."""
    ctype = compute_dtype(input.dtype)
    out = input.new_empty(geo.batch, geo.out_h, geo.out_w, geo.channels)
    step = _chunk(geo)
    for s in range(0, geo.batch, step):
        planes, points, _, m = _setup(input[s:s + step], offset[s:s + step], mask[s:s + step], geo, ctype, False)
        out[s:s + step] = _to_nhwc((grid.sample(planes, points, False) * m).sum(-1), planes.shape[0] // geo.group, geo)
    return out


def dcn_backward(grad_out: Tensor, input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry,
                 needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset, mask), each in its tensor's dtype; None where needs says so (reference.dcn_backward's
    formulas: grid_sample's backward gives the input's share and Σ_d go·∂s/∂(x, y))."""
    need_in, need_off, need_mask = (bool(t) for t in needs)
    ctype = compute_dtype(input.dtype)
    N, Ho, Wo, G, D, K = geo.batch, geo.out_h, geo.out_w, geo.group, geo.group_channels, geo.points
    g_in = input.new_empty(input.shape) if need_in else None
    g_off = offset.new_empty(N, Ho, Wo, G, K, 2) if need_off else None
    g_mask = mask.new_empty(N, Ho, Wo, G, K) if need_mask else None
    step = _chunk(geo)
    for s in range(0, N, step):
        e = min(N, s + step)
        n = e - s
        planes, points, inside, m = _setup(input[s:e], offset[s:e], mask[s:e], geo, ctype, True)
        go = grad_out[s:e].to(ctype).reshape(n, Ho * Wo, G, D).permute(0, 2, 3, 1).reshape(n * G, D, Ho * Wo, 1)
        if need_mask:  # Σ_d go · sample, zero for a point that does not count (its grid point samples nothing)
            gm = (go * grid.sample(planes, points, True)).sum(1)
            g_mask[s:e] = gm.reshape(n, G, Ho, Wo, K).permute(0, 2, 3, 1, 4)
        if need_in or need_off:
            gp, gy, gx = grid.sample_backward(go * m, planes, points, geo.height, geo.width, need_in, need_off)
            if need_in:
                g_in[s:e] = gp.reshape(n, G, D, geo.height, geo.width).permute(0, 3, 4, 1, 2).reshape(
                    n, geo.height, geo.width, geo.channels)
            if need_off:  # the points are (y, x) = origin + (tap + Δ)·offset_scale
                g = torch.stack((gx, gy), -1) * geo.offset_scale  # [n·G, Ho·Wo, K, (Δx, Δy)]
                g_off[s:e] = g.reshape(n, G, Ho, Wo, K, 2).permute(0, 2, 3, 1, 4, 5)
    return (g_in, None if g_off is None else g_off.reshape(offset.shape),
            None if g_mask is None else g_mask.reshape(mask.shape))


def dcnv4_forward(input: Tensor, offset_mask: Tensor, geo: DcnGeometry) -> Tensor:
    """DCNv4: this core on offset_mask's offsets and weights."""
    return reference.dcnv4_forward(input, offset_mask, geo, core=dcn_forward)


def dcnv4_backward(grad_out: Tensor, input: Tensor, offset_mask: Tensor, geo: DcnGeometry,
                   needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """DCNv4: gradients (input, offset_mask), offset_mask's padding channels zero."""
    return reference.dcnv4_backward(grad_out, input, offset_mask, geo, needs, core=dcn_backward)
