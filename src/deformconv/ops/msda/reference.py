"""Multi-scale deformable attention in plain PyTorch: any device, any float dtype (float64 for the oracle),
vectorised over queries, heads and points, level by level, in chunks of images; the backward written out.

    value                [N, S, M, D]         S = Σ_l H_l·W_l, levels one after another
    spatial_shapes       [L, 2]               (H_l, W_l), int64
    level_start_index    [L]                  int64
    sampling_locations   [N, Lq, M, L, P, 2]  (x, y) in [0, 1] across the level (outside allowed)
    attention_weights    [N, Lq, M, L, P]
    out                  [N, Lq, M·D]

Half inputs compute in float32 and round once.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..common.gather import bilinear_corners, coordinate_grads, samples, scatter_corners

GATHER_BUDGET = 1 << 24  # elements of one chunk's gathered corners of one level


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _levels(spatial_shapes: Tensor, level_start_index: Tensor) -> List[Tuple[int, int, int]]:
    """(H_l, W_l, start_l) as Python ints (a host read of two small tensors)."""
    return [(int(h), int(w), int(s)) for (h, w), s in zip(spatial_shapes.tolist(), level_start_index.tolist())]


def _chunk(loc: Tensor, value: Tensor) -> int:
    n, lq, m, _, p, _ = loc.shape
    return max(1, GATHER_BUDGET // max(lq * m * p * value.shape[-1], 1))


def call_plan(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor):
    """What every backend on plain PyTorch works out first: (compute dtype, N, Lq, M, D, levels as _levels gives
    them, images a chunk)."""
    n_all, lq, m = sampling_locations.shape[:3]
    return (compute_dtype(value.dtype), n_all, lq, m, value.shape[-1], _levels(spatial_shapes, level_start_index),
            _chunk(sampling_locations, value))


def _level_points(value, loc, level, h, w, start, ctype):
    """bilinear_corners of level `level`'s points for a chunk of images: [n, Lq, M, P]."""
    v = value[:, start:start + h * w].to(ctype)
    x = loc[:, :, :, level, :, 0].to(ctype) * w - 0.5
    y = loc[:, :, :, level, :, 1].to(ctype) * h - 0.5
    return bilinear_corners(v, y, x, h, w)


def ms_deform_attn_forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                           sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """out [N, Lq, M·D] in value's dtype."""
    ctype, n_all, lq, m, d, levels, step = call_plan(value, spatial_shapes, level_start_index, sampling_locations)
    out = torch.zeros(n_all, lq, m, d, dtype=ctype, device=value.device)
    for s in range(0, n_all, step):
        e = min(n_all, s + step)
        for lvl, (h, w, start) in enumerate(levels):
            corners, _ = _level_points(value[s:e], sampling_locations[s:e], lvl, h, w, start, ctype)
            a = attention_weights[s:e, :, :, lvl].to(ctype)  # [n, Lq, M, P]
            out[s:e] += (samples(corners) * a[..., None]).sum(3)
    return out.reshape(n_all, lq, m * d).to(value.dtype)


def ms_deform_attn_backward(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                            sampling_locations: Tensor, attention_weights: Tensor, needs: Sequence[bool]
                            ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (value, sampling_locations, attention_weights); None where needs says so. With s the sample of a
    point and a its weight: grad_attention = Σ_d go·s; grad_location = a·Σ_d go·∂s/∂(x, y)·(W_l, H_l); grad_value
    gets go·a·(corner weight) at each corner read."""
    need_v, need_loc, need_attn = needs
    ctype, n_all, lq, m, d, levels, step = call_plan(value, spatial_shapes, level_start_index, sampling_locations)
    g_v = torch.zeros(value.shape, dtype=ctype, device=value.device) if need_v else None
    g_loc = torch.zeros(sampling_locations.shape, dtype=ctype, device=value.device) if need_loc else None
    g_attn = torch.zeros(attention_weights.shape, dtype=ctype, device=value.device) if need_attn else None
    for s in range(0, n_all, step):
        e = min(n_all, s + step)
        go = grad_out[s:e].to(ctype).reshape(e - s, lq, m, 1, d)
        for lvl, (h, w, start) in enumerate(levels):
            corners, _ = _level_points(value[s:e], sampling_locations[s:e], lvl, h, w, start, ctype)
            a = attention_weights[s:e, :, :, lvl].to(ctype)
            if need_attn:
                g_attn[s:e, :, :, lvl] = (go * samples(corners)).sum(-1)
            if need_loc:
                gy, gx = coordinate_grads(corners, go)
                g_loc[s:e, :, :, lvl, :, 0] = gx * a * w
                g_loc[s:e, :, :, lvl, :, 1] = gy * a * h
            if need_v:
                scatter_corners(g_v[s:e, start:start + h * w], corners, go * a[..., None])
    grads = (g_v, g_loc, g_attn)
    return tuple(None if g is None else g.to(t.dtype)
                 for g, t in zip(grads, (value, sampling_locations, attention_weights)))
