"""Deformable RoI pooling in plain PyTorch, both operators: any device, any float dtype (float64 for the
oracle), vectorised over RoIs, bins, samples and channels, in chunks of RoIs; the backwards written out (the
derivative of the forward as defined: a clamped coordinate's is zero).

``deform_roi_pool`` (mmcv's ``DeformRoIPool``):
    input    [N, C, H, W]
    rois     [R, 5]            (batch index, x1, y1, x2, y2), image coordinates
    offset   [R, 2, ph, pw]    optional: (x, y) shift of each bin, in units of gamma · the RoI's size
    out      [R, C, ph, pw]

``deform_psroi_pool``, the position-sensitive variant (the Deformable ConvNets papers' ``DeformablePSROIPooling``,
as in the original code and its PyTorch ports' ``DCNv2Pooling``):
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

GATHER_BUDGET = 1 << 24  # elements of one chunk's gathered corners


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def roi_geometry(rois: Tensor, offset: Optional[Tensor], output_size, spatial_scale: float, sampling_ratio: int,
                 gamma: float, ctype: torch.dtype):
    """Per RoI: (start_x, start_y) [R, ph, pw] of each bin (offset applied), (bin_w, bin_h) [R], (grid_h, grid_w)
    samples per bin [R] (int64), (roi_w, roi_h) [R]."""
    ph, pw = output_size
    r = rois.to(ctype)
    x1, y1 = r[:, 1] * spatial_scale - 0.5, r[:, 2] * spatial_scale - 0.5
    roi_w = r[:, 3] * spatial_scale - 0.5 - x1
    roi_h = r[:, 4] * spatial_scale - 0.5 - y1
    bin_w, bin_h = roi_w / pw, roi_h / ph
    if sampling_ratio > 0:
        grid_h = torch.full_like(roi_h, sampling_ratio, dtype=torch.int64)
        grid_w = torch.full_like(roi_w, sampling_ratio, dtype=torch.int64)
    else:
        # ceil(roi size / bins) in fp32 as the CUDA kernels compute it; a RoI of no (or negative) size samples nothing
        grid_h = torch.ceil((roi_h / ph).float()).clamp(min=0).to(torch.int64)
        grid_w = torch.ceil((roi_w / pw).float()).clamp(min=0).to(torch.int64)
    start_x = x1[:, None, None] + torch.arange(pw, dtype=ctype, device=r.device) * bin_w[:, None, None]
    start_y = y1[:, None, None] + torch.arange(ph, dtype=ctype, device=r.device)[:, None] * bin_h[:, None, None]
    start_x = start_x.expand(-1, ph, pw)
    start_y = start_y.expand(-1, ph, pw)
    if offset is not None:
        off = offset.to(ctype)
        start_x = start_x + gamma * roi_w[:, None, None] * off[:, 0]
        start_y = start_y + gamma * roi_h[:, None, None] * off[:, 1]
    return start_x, start_y, bin_w, bin_h, grid_h, grid_w, roi_w, roi_h


def _axis(coord: Tensor, size: int):
    """RoIAlign's bilinear along one axis: (low, high) int64 indices, (weight of low, weight of high), d weights /
    d coord (zero where the coordinate is clamped) and whether the sample counts (inside [-1, size])."""
    inside = (coord >= -1) & (coord <= size)
    c = torch.where(inside, coord, torch.zeros_like(coord)).clamp(min=0)
    low = torch.floor(c).to(torch.int64)
    at_end = low >= size - 1
    low = torch.where(at_end, torch.full_like(low, size - 1), low)
    high = torch.where(at_end, low, low + 1)
    c = torch.where(at_end, low.to(c.dtype), c)
    frac = c - low.to(c.dtype)
    free = inside & (coord > 0) & ~at_end  # where the value moves with the coordinate
    slope = free.to(c.dtype)
    return low, high, 1 - frac, frac, -slope, slope, inside


def _batches(geom, C: int, bins: int):
    """RoIs in batches of one sample grid (gh, gw) (no RoI padded to another's grid), each small enough for
    GATHER_BUDGET: (indices [r], gh, gw)."""
    grid_h, grid_w = geom[4], geom[5]
    keys, inverse = torch.unique(torch.stack([grid_h, grid_w], 1), dim=0, return_inverse=True)
    for k, (gh, gw) in enumerate(keys.tolist()):
        sel = (inverse == k).nonzero()[:, 0]
        step = max(1, GATHER_BUDGET // max(C * bins * max(gh * gw, 1) * 4, 1))
        for s in range(0, sel.numel(), step):
            yield sel[s:s + step], gh, gw


def _samples(geom, sel: Tensor, gh: int, gw: int, ctype):
    """Sample coordinates (y, x) [r, ph, pw, gh, gw] of the RoIs sel (all of grid gh x gw), and whether they exist
    (none for a grid of no samples)."""
    start_x, start_y, bin_w, bin_h = (t[sel] for t in geom[:4])
    dev = sel.device
    exists = gh > 0 and gw > 0
    gh, gw = max(gh, 1), max(gw, 1)
    iy = (torch.arange(gh, device=dev, dtype=ctype) + 0.5) / gh
    ix = (torch.arange(gw, device=dev, dtype=ctype) + 0.5) / gw
    y = start_y[..., None, None] + (iy * bin_h[:, None])[:, None, None, :, None]
    x = start_x[..., None, None] + (ix * bin_w[:, None])[:, None, None, None, :]
    return y, x, torch.full(y.shape, exists, dtype=torch.bool, device=dev)


def _corners(input_rows: Tensor, batch: Tensor, y: Tensor, x: Tensor, exists: Tensor, H: int, W: int):
    """The 4 corners of every sample: (row index into input_rows [N·H·W, C], weight, d weight / dy, d weight / dx);
    a sample that does not exist or lies outside has weight 0."""
    yl, yh, wyl, wyh, dyl, dyh, in_y = _axis(y, H)
    xl, xh, wxl, wxh, dxl, dxh, in_x = _axis(x, W)
    live = (exists & in_y & in_x).to(y.dtype)
    base = (batch * (H * W))[:, None, None, None, None]
    out = []
    for yi, wy, dy in ((yl, wyl, dyl), (yh, wyh, dyh)):
        for xi, wx, dx in ((xl, wxl, dxl), (xh, wxh, dxh)):
            out.append((base + yi * W + xi, wy * wx * live, dy * wx * live, wy * dx * live))
    return out


def _counts(geom) -> Tensor:
    grid_h, grid_w = geom[4], geom[5]
    return (grid_h * grid_w).clamp(min=1)


def deform_roi_pool_forward(input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size, spatial_scale: float,
                            sampling_ratio: int, gamma: float) -> Tensor:
    """out [R, C, ph, pw] in input's dtype."""
    ctype = compute_dtype(input.dtype)
    N, C, H, W = input.shape
    R, (ph, pw) = rois.shape[0], output_size
    out = torch.zeros(R, C, ph, pw, dtype=ctype, device=input.device)
    if R == 0 or N * H * W == 0:
        return out.to(input.dtype)
    rows = input.to(ctype).permute(0, 2, 3, 1).reshape(N * H * W, C)
    geom = roi_geometry(rois, offset, output_size, spatial_scale, sampling_ratio, gamma, ctype)
    count = _counts(geom).to(ctype)
    batch = rois[:, 0].to(torch.int64)
    bins = ph * pw
    for sel, gh, gw in _batches(geom, C, bins):
        y, x, exists = _samples(geom, sel, gh, gw, ctype)
        # the bins as one sparse product: each bin is a weighted sum of input rows (its samples' corners), so
        # out [r·bins, C] = S @ rows with S holding each corner's weight / count; no [samples, C] gather is made
        bin_of = torch.arange(sel.numel() * bins, device=input.device).reshape(-1, ph, pw, 1, 1)
        index, value = [], []
        for idx, wgt, _, _ in _corners(rows, batch[sel], y, x, exists, H, W):
            idx, wgt = torch.broadcast_tensors(idx, wgt)
            index.append(torch.stack([bin_of.expand(idx.shape).reshape(-1), idx.reshape(-1)]))
            value.append((wgt / count[sel, None, None, None, None]).reshape(-1))
        S = torch.sparse_coo_tensor(torch.cat(index, 1), torch.cat(value), (sel.numel() * bins, N * H * W),
                                    check_invariants=False)
        out[sel] = torch.sparse.mm(S, rows).reshape(-1, ph, pw, C).permute(0, 3, 1, 2)
    return out.to(input.dtype)


def deform_roi_pool_backward(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size,
                             spatial_scale: float, sampling_ratio: int, gamma: float, need_input: bool,
                             need_offset: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset); None where not needed (or without an offset)."""
    ctype = compute_dtype(input.dtype)
    N, C, H, W = input.shape
    R, (ph, pw) = rois.shape[0], output_size
    need_offset = need_offset and offset is not None
    g_rows = torch.zeros(N * H * W, C, dtype=ctype, device=input.device) if need_input else None
    g_off = torch.zeros(R, 2, ph, pw, dtype=ctype, device=input.device) if need_offset else None
    if R and N * H * W and (need_input or need_offset):
        rows = input.to(ctype).permute(0, 2, 3, 1).reshape(N * H * W, C)
        geom = roi_geometry(rois, offset, output_size, spatial_scale, sampling_ratio, gamma, ctype)
        roi_w, roi_h = geom[6], geom[7]
        g = grad_out.to(ctype).permute(0, 2, 3, 1) / _counts(geom).to(ctype)[:, None, None, None]  # [R, ph, pw, C]
        batch = rois[:, 0].to(torch.int64)
        for sel, gh, gw in _batches(geom, C, ph * pw):
            y, x, exists = _samples(geom, sel, gh, gw, ctype)
            gs = g[sel][:, :, :, None, None, :]  # [r, ph, pw, 1, 1, C]
            gx = gy = 0
            for idx, wgt, dwy, dwx in _corners(rows, batch[sel], y, x, exists, H, W):
                if need_input:
                    g_rows.index_add_(0, idx.reshape(-1), (wgt[..., None] * gs).reshape(-1, C))
                if need_offset:
                    gv = (gs * rows[idx.reshape(-1)].reshape(*idx.shape, C)).sum(-1)  # [r, ph, pw, gh, gw]
                    gx = gx + (dwx * gv).sum((3, 4))
                    gy = gy + (dwy * gv).sum((3, 4))
            if need_offset:
                g_off[sel, 0] = gamma * roi_w[sel, None, None] * gx
                g_off[sel, 1] = gamma * roi_h[sel, None, None] * gy
    g_in = None if g_rows is None else g_rows.reshape(N, H, W, C).permute(0, 3, 1, 2).to(input.dtype)
    return g_in, (None if g_off is None else g_off.to(offset.dtype))


# --- the position-sensitive variant --------------------------------------------------------------------


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


def _ps_geometry(input, rois, offset, spatial_scale, pooled_size, output_dim, group_size, part_size, sample_per_part,
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


def _ps_axis(c: Tensor, size: int):
    """The original's bilinear along one axis: counts within [-0.5, size - 0.5]; clamped to [0, size - 1]; floor and
    ceil corners; the slope of the ceil weight (zero where clamped or where floor == ceil)."""
    inside = (c >= -0.5) & (c <= size - 0.5)
    cc = torch.where(inside, c, torch.zeros_like(c)).clamp(0, size - 1)
    lo, hi = torch.floor(cc), torch.ceil(cc)
    frac = cc - lo
    slope = (inside & (c >= 0) & (c <= size - 1) & (hi > lo)).to(c.dtype)
    return lo.to(torch.int64), hi.to(torch.int64), 1 - frac, frac, slope, inside


def _ps_corners(y, x, H, W):
    yl, yh, wyl, wyh, sy, in_y = _ps_axis(y, H)
    xl, xh, wxl, wxh, sx, in_x = _ps_axis(x, W)
    live = in_y & in_x
    corners = [(yl * W + xl, wyl * wxl, -sy * wxl, -wyl * sx), (yl * W + xh, wyl * wxh, -sy * wxh, wyl * sx),
               (yh * W + xl, wyh * wxl, sy * wxl, -wyh * sx), (yh * W + xh, wyh * wxh, sy * wxh, wyh * sx)]
    return corners, live


def _ps_chunk(output_dim: int, P: int, S: int) -> int:
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
    step = _ps_chunk(output_dim, P, sample_per_part)
    for s in range(0, R, step):
        e = min(R, s + step)
        y, x, channel, _, _, _ = _ps_geometry(input, rois[s:e], None if offset is None else offset[s:e], spatial_scale,
                                           P, output_dim, group_size, part_size, sample_per_part, trans_std, ctype)
        corners, live = _ps_corners(y, x, H, W)
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
        step = _ps_chunk(output_dim, P, sample_per_part)
        for s in range(0, R, step):
            e = min(R, s + step)
            off = None if offset is None else offset[s:e]
            y, x, channel, (cls, part), roi_w, roi_h = _ps_geometry(input, rois[s:e], off, spatial_scale, P, output_dim,
                                                                 group_size, part_size, sample_per_part, trans_std,
                                                                 ctype)
            corners, live = _ps_corners(y, x, H, W)
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
