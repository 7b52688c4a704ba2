"""Multi-scale deformable attention on the CPU: each (image, head) value map of a level sampled by ``F.grid_sample``
at the level's points (common/grid.py), weighted and summed; the backward through grid_sample's own. The same
definition and signatures as reference.py (the oracle), level by level, in chunks of images.

    value of level l  [n, H_l·W_l, M, D]  ->  planes [n·M, D, H_l, W_l]
    points            y, x [n·M, Lq, P]   (pixels: location · size − 0.5)
    out               [N, Lq, M·D]        <-  Σ_l Σ_p weight · samples [n·M, D, Lq, P]

Half inputs compute in float32 and round once.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..common import grid
from .reference import call_plan


def _points(loc: Tensor, attn: Tensor, levels, ctype: torch.dtype, exact: bool) -> Tuple[Tensor, Tensor]:
    """Every level's grid [n·M, L, Lq, P, 2] and weights [n·M, 1, L, Lq, P] (zero for the points that do not count;
    level-major, so that a level's are contiguous), for a chunk of images; exact: for the backward (common/grid.py)."""
    n, lq, m, nl, p, _ = loc.shape
    where = loc.to(ctype).permute(0, 2, 3, 1, 4, 5).reshape(n * m, nl, lq, p, 2)
    hs, ws = [h for h, _, _ in levels], [w for _, w, _ in levels]
    per_level = [torch.tensor(v, dtype=ctype, device=loc.device).view(-1, 1, 1) for v in (hs, ws)]  # [L, 1, 1]
    points, inside = grid.pixel_grid(where[..., 1] * per_level[0] - 0.5, where[..., 0] * per_level[1] - 0.5, hs, ws,
                                     exact)
    a = attn.to(ctype).permute(0, 2, 3, 1, 4).reshape(n * m, 1, nl, lq, p)
    return points, torch.where(inside[:, None], a, 0.0)


def _planes(value: Tensor, h: int, w: int, start: int, ctype: torch.dtype, exact: bool) -> Tensor:
    """A level's value maps of a chunk of images as grid_sample's planes [n·M, D, H, W] (padded if exact)."""
    return grid.planes_of(value[:, start:start + h * w].permute(0, 2, 3, 1).unflatten(-1, (h, w)).to(ctype), exact)


def ms_deform_attn_forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                           sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """out [N, Lq, M·D] in value's dtype."""
    ctype, n_all, lq, m, d, levels, step = call_plan(value, spatial_shapes, level_start_index, sampling_locations)
    if not levels:  # nothing sampled
        return value.new_zeros(n_all, lq, m * d)
    out = value.new_empty(n_all, lq, m * d)
    for s in range(0, n_all, step):
        e = min(n_all, s + step)
        points, a = _points(sampling_locations[s:e], attention_weights[s:e], levels, ctype, False)
        acc = None
        for lvl, (h, w, start) in enumerate(levels):
            samples = grid.sample(_planes(value[s:e], h, w, start, ctype, False), points[:, lvl], False)
            term = (samples * a[:, :, lvl]).sum(-1)  # [n·M, D, Lq]
            acc = term if acc is None else acc.add_(term)
        out[s:e] = acc.reshape(e - s, m, d, lq).permute(0, 3, 1, 2).reshape(e - s, lq, m * d)
    return out


def ms_deform_attn_backward(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                            sampling_locations: Tensor, attention_weights: Tensor, needs: Sequence[bool]
                            ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (value, sampling_locations, attention_weights); None where needs says so (reference.py's formulas:
    grid_sample's backward gives the value's share and Σ_d go·∂s/∂(x, y), times (W_l, H_l) for the locations)."""
    need_v, need_loc, need_attn = (bool(t) for t in needs)
    ctype, n_all, lq, m, d, levels, step = call_plan(value, spatial_shapes, level_start_index, sampling_locations)
    p = sampling_locations.shape[4]
    g_v = torch.zeros_like(value) if need_v else None  # zero: pixels past the last level get nothing
    g_loc = sampling_locations.new_empty(sampling_locations.shape) if need_loc else None
    g_attn = attention_weights.new_empty(attention_weights.shape) if need_attn else None
    if not levels:  # nothing sampled: the location and weight gradients have no elements
        return g_v, g_loc, g_attn
    for s in range(0, n_all, step):
        e = min(n_all, s + step)
        n = e - s
        go = grad_out[s:e].to(ctype).reshape(n, lq, m, d).permute(0, 2, 3, 1).reshape(n * m, d, lq, 1)
        points, a = _points(sampling_locations[s:e], attention_weights[s:e], levels, ctype, True)
        g_a, g_xy = [], []  # each level's [n·M, Lq, P] and [n·M, Lq, P, 2]
        for lvl, (h, w, start) in enumerate(levels):
            planes, where = _planes(value[s:e], h, w, start, ctype, True), points[:, lvl]
            if need_attn:  # Σ_d go · sample, zero for a point that does not count (its grid point samples nothing)
                g_a.append((go * grid.sample(planes, where, True)).sum(1))
            if need_v or need_loc:
                gp, gy, gx = grid.sample_backward(go * a[:, :, lvl], planes, where, h, w, need_v, need_loc)
                if need_v:
                    g_v[s:e, start:start + h * w] += gp.reshape(n, m, d, h * w).permute(0, 3, 1, 2)
                if need_loc:  # pixel = location · size − 0.5
                    g_xy.append(torch.stack((gx * w, gy * h), -1))
        if need_attn:
            g_attn[s:e] = torch.stack(g_a, 2).reshape(n, m, lq, len(levels), p).transpose(1, 2)
        if need_loc:
            g_loc[s:e] = torch.stack(g_xy, 2).reshape(n, m, lq, len(levels), p, 2).transpose(1, 2)
    return g_v, g_loc, g_attn
