"""Deformable position-sensitive RoI pooling (the Deformable ConvNets papers' ``DeformablePSROIPooling``, as in the
original code and its PyTorch ports' ``DCNv2Pooling``) in plain PyTorch: any device and dtype, vectorised over RoIs,
output channels, bins and samples, in chunks of RoIs; the backward written out.

    input    [N, output_dim · group_size², H, W]
    rois     [R, 5]                            (batch index, x1, y1, x2, y2), image coordinates (rounded)
    offset   [R, 2 · classes, part, part]      (x, y) per part, in units of trans_std · the RoI's size
    out      [R, output_dim, P, P]

RoI (x1, y1, x2, y2) spans [round(x1)·s − 0.5, (round(x2) + 1)·s − 0.5] (halves rounded away from zero; at least
0.1 wide) and is cut into P × P bins. Bin (i, j) of output channel o reads input channel (o·G + gi)·G + gj, with
gi = ⌊i·G/P⌋ (G = group_size), moves by trans_std · (width, height) · offset[r, (2k, 2k + 1), ⌊i·part/P⌋,
⌊j·part/P⌋] (k = o // (output_dim / classes)), and is the mean of its samples at the starts of sample_per_part²
sub-bins that lie in [−0.5, W − 0.5] × [−0.5, H − 0.5] (each clamped to the image and interpolated bilinearly; 0 if
none does). The part and group cells are integer divisions (the original computes them in floating point, which can
round a boundary the other way).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

GATHER_BUDGET = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def roi_boxes(rois: Tensor, spatial_scale: float, ctype: torch.dtype) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(start_w, start_h, roi_w, roi_h) [R] of each RoI in input pixels: rounded (C's round), the end one pixel on, at
    least 0.1 wide."""
    r = rois.to(ctype)
    r = torch.where(r >= 0, torch.floor(r + 0.5), torch.ceil(r - 0.5))  # C's round: halves away from zero
    start_w = r[:, 1] * spatial_scale - 0.5
    start_h = r[:, 2] * spatial_scale - 0.5
    roi_w = ((r[:, 3] + 1) * spatial_scale - 0.5 - start_w).clamp(min=0.1)
    roi_h = ((r[:, 4] + 1) * spatial_scale - 0.5 - start_h).clamp(min=0.1)
    return start_w, start_h, roi_w, roi_h


def _geometry(input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size, sample_per_part,
              trans_std, ctype):
    """Sample coordinates (y, x) [R, O, P, P, S, S], the input channel of each (o, i, j) [O, P, P], the offset's
    (channel, part row, part col) of each (o, i, j), and the RoIs' sizes [R]."""
    dev = rois.device
    P, S, G = pooled_size, sample_per_part, group_size
    start_w, start_h, roi_w, roi_h = roi_boxes(rois, spatial_scale, ctype)
    bin_w, bin_h = roi_w / P, roi_h / P
    o = torch.arange(output_dim, device=dev)
    i = torch.arange(P, device=dev)
    gi = (i * G // P).clamp(0, G - 1)
    channel = (o[:, None, None] * G + gi[None, :, None]) * G + gi[None, None, :]  # [O, P, P]
    part = i * part_size // P
    classes = 1 if offset is None else offset.shape[1] // 2
    cls = o // (output_dim // classes)
    ii = torch.arange(P, dtype=ctype, device=dev)
    wstart = (ii[None, None, None, :] * bin_w[:, None, None, None] + start_w[:, None, None, None]).expand(
        -1, output_dim, P, P)
    hstart = (ii[None, None, :, None] * bin_h[:, None, None, None] + start_h[:, None, None, None]).expand(
        -1, output_dim, P, P)
    if offset is not None:
        off = offset.to(ctype)
        tx = off[:, 2 * cls][:, :, part][:, :, :, part] * trans_std  # [R, O, P, P]
        ty = off[:, 2 * cls + 1][:, :, part][:, :, :, part] * trans_std
        wstart = wstart + tx * roi_w[:, None, None, None]
        hstart = hstart + ty * roi_h[:, None, None, None]
    s = torch.arange(S, dtype=ctype, device=dev)
    x = wstart[..., None, None] + (s * (bin_w / S)[:, None])[:, None, None, None, None, :]
    y = hstart[..., None, None] + (s * (bin_h / S)[:, None])[:, None, None, None, :, None]
    return y, x, channel, (cls, part), roi_w, roi_h


def _axis(c: Tensor, size: int):
    """The original's bilinear along one axis: counts within [-0.5, size - 0.5]; clamped to [0, size - 1]; floor and
    ceil corners; the slope of the ceil weight (zero where clamped or where floor == ceil)."""
    inside = (c >= -0.5) & (c <= size - 0.5)
    cc = torch.where(inside, c, torch.zeros_like(c)).clamp(0, size - 1)
    lo, hi = torch.floor(cc), torch.ceil(cc)
    frac = cc - lo
    slope = (inside & (c >= 0) & (c <= size - 1) & (hi > lo)).to(c.dtype)
    return lo.to(torch.int64), hi.to(torch.int64), 1 - frac, frac, slope, inside


def _corners(y, x, H, W):
    yl, yh, wyl, wyh, sy, in_y = _axis(y, H)
    xl, xh, wxl, wxh, sx, in_x = _axis(x, W)
    live = in_y & in_x
    corners = [(yl * W + xl, wyl * wxl, -sy * wxl, -wyl * sx), (yl * W + xh, wyl * wxh, -sy * wxh, wyl * sx),
               (yh * W + xl, wyh * wxl, sy * wxl, -wyh * sx), (yh * W + xh, wyh * wxh, sy * wxh, wyh * sx)]
    return corners, live


def _chunk(output_dim: int, P: int, S: int) -> int:
    return max(1, GATHER_BUDGET // max(output_dim * P * P * S * S * 4, 1))


def deform_psroi_pool_forward(input: Tensor, rois: Tensor, offset: Optional[Tensor], spatial_scale: float,
                              pooled_size: int, output_dim: int, group_size: int, part_size: int,
                              sample_per_part: int, trans_std: float) -> Tensor:
    """out [R, output_dim, P, P] in input's dtype."""
    ctype = compute_dtype(input.dtype)
    N, C, H, W = input.shape
    R, P = rois.shape[0], pooled_size
    out = torch.zeros(R, output_dim, P, P, dtype=ctype, device=input.device)
    if R == 0 or H * W == 0:
        return out.to(input.dtype)
    flat = input.to(ctype).reshape(-1)
    step = _chunk(output_dim, P, sample_per_part)
    for s in range(0, R, step):
        e = min(R, s + step)
        y, x, channel, _, _, _ = _geometry(input, rois[s:e], None if offset is None else offset[s:e], spatial_scale,
                                           P, output_dim, group_size, part_size, sample_per_part, trans_std, ctype)
        corners, live = _corners(y, x, H, W)
        base = ((rois[s:e, 0].to(torch.int64)[:, None, None, None] * C + channel) * (H * W))[..., None, None]
        acc = 0
        for idx, wgt, _, _ in corners:
            acc = acc + torch.where(live, wgt * flat[(base + idx).reshape(-1)].reshape(idx.shape), 0)
        count = live.sum((-1, -2)).to(ctype)
        out[s:e] = torch.where(count > 0, acc.sum((-1, -2)) / count.clamp(min=1), 0)
    return out.to(input.dtype)


def deform_psroi_pool_backward(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor],
                               spatial_scale: float, pooled_size: int, output_dim: int, group_size: int,
                               part_size: int, sample_per_part: int, trans_std: float, need_input: bool,
                               need_offset: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset); None where not needed (or without an offset)."""
    ctype = compute_dtype(input.dtype)
    N, C, H, W = input.shape
    R, P = rois.shape[0], pooled_size
    need_offset = need_offset and offset is not None
    g_flat = torch.zeros(input.numel(), dtype=ctype, device=input.device) if need_input else None
    g_off = torch.zeros(offset.shape, dtype=ctype, device=input.device) if need_offset else None
    if R and H * W and (need_input or need_offset):
        flat = input.to(ctype).reshape(-1)
        step = _chunk(output_dim, P, sample_per_part)
        for s in range(0, R, step):
            e = min(R, s + step)
            off = None if offset is None else offset[s:e]
            y, x, channel, (cls, part), roi_w, roi_h = _geometry(input, rois[s:e], off, spatial_scale, P, output_dim,
                                                                 group_size, part_size, sample_per_part, trans_std,
                                                                 ctype)
            corners, live = _corners(y, x, H, W)
            count = live.sum((-1, -2)).to(ctype)
            g = torch.where(count > 0, grad_out[s:e].to(ctype) / count.clamp(min=1), 0)[..., None, None] * live
            base = ((rois[s:e, 0].to(torch.int64)[:, None, None, None] * C + channel) * (H * W))[..., None, None]
            gx = gy = 0
            for idx, wgt, dwy, dwx in corners:
                where = (base + idx).reshape(-1)
                if need_input:
                    g_flat.index_add_(0, where, (g * wgt).reshape(-1))
                if need_offset:
                    v = flat[where].reshape(idx.shape)
                    gx = gx + (g * dwx * v).sum((-1, -2))
                    gy = gy + (g * dwy * v).sum((-1, -2))
            if need_offset:  # each (o, i, j) adds to its class's channel and its part cell
                n = e - s
                classes, parts = offset.shape[1] // 2, offset.shape[2]
                cell = (part[:, None] * parts + part[None, :])  # [P, P]
                for comp, gc, size in ((0, gx, roi_w), (1, gy, roi_h)):
                    target = ((2 * cls + comp)[:, None, None] * parts * parts + cell[None]).expand(output_dim, P, P)
                    rows = (torch.arange(n, device=input.device) * (2 * classes * parts * parts))[:, None, None, None]
                    g_off.view(-1).index_add_(0, (s * 2 * classes * parts * parts + rows + target).reshape(-1),
                                              (gc * trans_std * size[:, None, None, None]).reshape(-1))
    g_in = None if g_flat is None else g_flat.reshape(input.shape).to(input.dtype)
    return g_in, (None if g_off is None else g_off.to(offset.dtype))
