"""Deformable position-sensitive RoI pooling's Triton kernels, forward and backward (the rule: ../reference.py).

A program owns one RoI and a block of output channels, all P·P bins of them at once ([BLOCK_BINS, BLOCK_O] tiles: each
(bin, channel) reads its own input channel and, with offsets, moves by its class's part offset). The input is read
in place through its strides. The backward sums each (bin, channel)'s offset gradient over its samples in
registers and adds it to its class's part cell by an atomic; grad_input goes by atomics too. In deterministic mode
both are summed in int64 fixed point (common/fixed_point.py), with bounds computed on the device.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...common.fixed_point import max_abs, scales_for
from ...common.launch import ceil_div, next_pow2, run_cached
from ...common.sampling import div, load_grid_corners, scatter_add
from ..reference import roi_boxes

TILE_ELEMENTS = 4096  # BLOCK_BINS·BLOCK_O of a program


def _blocks(bins: int, channels: int) -> Tuple[int, int]:
    block_bins = next_pow2(bins)
    return block_bins, max(8, min(next_pow2(channels), TILE_ELEMENTS // block_bins))


@triton.jit
def _c_round(v):
    """C's round: halves away from zero."""
    return tl.where(v >= 0, tl.floor(v + 0.5), tl.ceil(v - 0.5))


@triton.jit
def _tile(rois_ptr, off_ptr, r, offs_o, o_ok, N, O, CLASSES, SCALE, TRANS_STD,
          P: tl.constexpr, G: tl.constexpr, PART: tl.constexpr, S: tl.constexpr, HAS_OFFSET: tl.constexpr,
          BLOCK_BINS: tl.constexpr, BLOCK_O: tl.constexpr):
    """RoI r's geometry for the tile (bins x output channels): image, live mask, input channel, the bins' sample
    starts (offsets applied), the sub-bin sizes, the RoI's size, and the offset cell each (bin, channel) reads."""
    bins = tl.arange(0, BLOCK_BINS)
    bin_ok = bins < P * P
    i = bins // P
    j = bins - i * P
    b = tl.load(rois_ptr + r * 5).to(tl.int64)
    b_ok = (b >= 0) & (b < N)  # checked on the host where it can look; out of range samples nothing
    x1 = _c_round(tl.load(rois_ptr + r * 5 + 1).to(tl.float32))
    y1 = _c_round(tl.load(rois_ptr + r * 5 + 2).to(tl.float32))
    x2 = _c_round(tl.load(rois_ptr + r * 5 + 3).to(tl.float32))
    y2 = _c_round(tl.load(rois_ptr + r * 5 + 4).to(tl.float32))
    start_w = x1 * SCALE - 0.5
    start_h = y1 * SCALE - 0.5
    roi_w = tl.maximum((x2 + 1.0) * SCALE - 0.5 - start_w, 0.1)
    roi_h = tl.maximum((y2 + 1.0) * SCALE - 0.5 - start_h, 0.1)
    bin_w = div(roi_w, P)
    bin_h = div(roi_h, P)
    gi = tl.minimum(tl.maximum(i * G // P, 0), G - 1)
    gj = tl.minimum(tl.maximum(j * G // P, 0), G - 1)
    channel = (offs_o[None, :] * G + gi[:, None]) * G + gj[:, None]
    live = (bin_ok & b_ok)[:, None] & o_ok[None, :]
    wstart = (j.to(tl.float32) * bin_w + start_w)[:, None] + tl.zeros((BLOCK_BINS, BLOCK_O), tl.float32)
    hstart = (i.to(tl.float32) * bin_h + start_h)[:, None] + tl.zeros((BLOCK_BINS, BLOCK_O), tl.float32)
    cell = tl.zeros((BLOCK_BINS, BLOCK_O), tl.int64)
    if HAS_OFFSET:
        cls = offs_o // (O // CLASSES)
        cell = ((r.to(tl.int64) * 2 * CLASSES + 2 * cls[None, :]) * PART + (i * PART // P)[:, None]) * PART \
            + (j * PART // P)[:, None]
        tx = tl.load(off_ptr + cell, mask=live, other=0.0).to(tl.float32) * TRANS_STD
        ty = tl.load(off_ptr + cell + PART * PART, mask=live, other=0.0).to(tl.float32) * TRANS_STD
        wstart += tx * roi_w
        hstart += ty * roi_h
    return b, live, channel, wstart, hstart, div(bin_w, S), div(bin_h, S), roi_w, roi_h, cell


@triton.jit
def _axis(c, size):
    """The original's bilinear along one axis: whether the sample counts (within [-0.5, size - 0.5]), floor and ceil
    of the clamped coordinate, the fraction, and the slope (zero where clamped or where floor == ceil)."""
    ok = (c >= -0.5) & (c <= size - 0.5)
    cc = tl.minimum(tl.maximum(c, 0.0), size - 1.0)
    lo = tl.floor(cc)
    hi = tl.ceil(cc)
    slope = ((c >= 0.0) & (c <= size - 1.0) & (hi > lo)).to(tl.float32)
    return ok, lo.to(tl.int32), hi.to(tl.int32), cc - lo, slope


@triton.jit
def _psroi_fwd_kernel(
    x_ptr,        # input [N, O·G·G, H, W], strides below
    rois_ptr,     # [R, 5]
    off_ptr,      # [R, 2·CLASSES, PART, PART] (read if HAS_OFFSET)
    out_ptr,      # [R, O, P, P]
    N, H, W, sn, sc, sh, sw, O, CLASSES, SCALE, TRANS_STD,
    P: tl.constexpr, G: tl.constexpr, PART: tl.constexpr, S: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_BINS: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """out[r, o, i, j] = the mean of the bin's samples that count (0 if none). Grid: (R, output channel blocks)."""
    r = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < O
    b, live, channel, wstart, hstart, sub_w, sub_h, _, _, _ = _tile(
        rois_ptr, off_ptr, r, offs_o, o_ok, N, O, CLASSES, SCALE, TRANS_STD, P, G, PART, S, HAS_OFFSET, BLOCK_BINS,
        BLOCK_O)
    base = x_ptr + b * sn + channel.to(tl.int64) * sc
    acc = tl.zeros((BLOCK_BINS, BLOCK_O), dtype=tl.float32)
    count = tl.zeros((BLOCK_BINS, BLOCK_O), dtype=tl.float32)
    for ih in tl.static_range(S):
        ok_y, y1, y2, dy, _ = _axis(hstart + ih * sub_h, H)
        for iw in tl.static_range(S):
            ok_x, x1, x2, dx, _ = _axis(wstart + iw * sub_w, W)
            ok = live & ok_y & ok_x
            v11, v21, v12, v22 = load_grid_corners(base, y1 * sh, y2 * sh, x1 * sw, x2 * sw, ok)  # v<x><y>
            val = (1 - dx) * (1 - dy) * v11 + (1 - dx) * dy * v12 + dx * (1 - dy) * v21 + dx * dy * v22
            acc += tl.where(ok, val, 0.0)
            count += ok.to(tl.float32)
    bins = tl.arange(0, BLOCK_BINS)
    out = out_ptr + (r.to(tl.int64) * O + offs_o[None, :]) * (P * P) + bins[:, None]
    res = tl.where(count > 0, div(acc, tl.maximum(count, 1.0)), 0.0)
    tl.store(out, res.to(out_ptr.dtype.element_ty), mask=(bins < P * P)[:, None] & o_ok[None, :])


@triton.jit
def _psroi_bwd_kernel(
    x_ptr, rois_ptr, off_ptr,
    go_ptr,       # grad_out [R, O, P, P] contiguous
    gin_ptr,      # grad_input accumulator [N, O·G·G, H, W] contiguous: fp32, or int64 if FIXED (NEED_IN)
    goff_ptr,     # grad_offset accumulator like offset: fp32, or int64 if FIXED (NEED_OFF)
    scale_ptr,    # fp32 [2]: the fixed-point scales of grad_input and grad_offset (read if FIXED)
    N, H, W, sn, sc, sh, sw, O, CLASSES, SCALE, TRANS_STD,
    P: tl.constexpr, G: tl.constexpr, PART: tl.constexpr, S: tl.constexpr, HAS_OFFSET: tl.constexpr,
    NEED_IN: tl.constexpr, NEED_OFF: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_BINS: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """grad_input += g / count · (corner weight) at each sample's corners; the offset cell of each (bin, channel) +=
    trans_std · (roi width, height) · Σ_samples g / count · ∂sample/∂(x, y). Grid: (R, output channel blocks)."""
    r = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_ok = offs_o < O
    b, live, channel, wstart, hstart, sub_w, sub_h, roi_w, roi_h, cell = _tile(
        rois_ptr, off_ptr, r, offs_o, o_ok, N, O, CLASSES, SCALE, TRANS_STD, P, G, PART, S, HAS_OFFSET, BLOCK_BINS,
        BLOCK_O)
    if FIXED:
        in_scale = tl.load(scale_ptr)
        off_scale = tl.load(scale_ptr + 1)
    else:
        in_scale = 1.0  # unused
        off_scale = 1.0
    bins = tl.arange(0, BLOCK_BINS)
    # the samples that count, to divide the bin's gradient among them
    count = tl.zeros((BLOCK_BINS, BLOCK_O), dtype=tl.float32)
    for ih in tl.static_range(S):
        ok_y, _, _, _, _ = _axis(hstart + ih * sub_h, H)
        for iw in tl.static_range(S):
            ok_x, _, _, _, _ = _axis(wstart + iw * sub_w, W)
            count += (live & ok_y & ok_x).to(tl.float32)
    g = tl.load(go_ptr + (r.to(tl.int64) * O + offs_o[None, :]) * (P * P) + bins[:, None], mask=live, other=0.0)
    g = tl.where(count > 0, div(g.to(tl.float32), tl.maximum(count, 1.0)), 0.0)
    base = x_ptr + b * sn + channel.to(tl.int64) * sc
    gbase = gin_ptr + (b * (O * G * G) + channel.to(tl.int64)) * (H * W)
    gx = tl.zeros((BLOCK_BINS, BLOCK_O), dtype=tl.float32)
    gy = tl.zeros((BLOCK_BINS, BLOCK_O), dtype=tl.float32)
    for ih in tl.static_range(S):
        ok_y, y1, y2, dy, sly = _axis(hstart + ih * sub_h, H)
        for iw in tl.static_range(S):
            ok_x, x1, x2, dx, slx = _axis(wstart + iw * sub_w, W)
            ok = live & ok_y & ok_x
            if NEED_IN:
                scatter_add(gbase + y1 * W + x1, g * (1 - dx) * (1 - dy), ok, in_scale, FIXED)
                scatter_add(gbase + y2 * W + x1, g * (1 - dx) * dy, ok, in_scale, FIXED)
                scatter_add(gbase + y1 * W + x2, g * dx * (1 - dy), ok, in_scale, FIXED)
                scatter_add(gbase + y2 * W + x2, g * dx * dy, ok, in_scale, FIXED)
            if NEED_OFF:
                v11, v21, v12, v22 = load_grid_corners(base, y1 * sh, y2 * sh, x1 * sw, x2 * sw, ok)
                gx += tl.where(ok, g * slx * ((1 - dy) * (v21 - v11) + dy * (v22 - v12)), 0.0)
                gy += tl.where(ok, g * sly * ((1 - dx) * (v12 - v11) + dx * (v22 - v21)), 0.0)
    if NEED_OFF:
        scatter_add(goff_ptr + cell, gx * TRANS_STD * roi_w, live, off_scale, FIXED)
        scatter_add(goff_ptr + cell + PART * PART, gy * TRANS_STD * roi_h, live, off_scale, FIXED)


# --- launchers -----------------------------------------------------------------------------------------


def _meta(pooled_size, output_dim, group_size, part_size, sample_per_part, has_offset) -> dict:
    block_bins, block_o = _blocks(pooled_size * pooled_size, output_dim)
    return dict(P=pooled_size, G=group_size, PART=part_size, S=sample_per_part, HAS_OFFSET=has_offset,
                BLOCK_BINS=block_bins, BLOCK_O=block_o, num_warps=4)


def deform_psroi_pool_forward(input: Tensor, rois: Tensor, offset: Optional[Tensor], spatial_scale: float,
                              pooled_size: int, output_dim: int, group_size: int, part_size: int,
                              sample_per_part: int, trans_std: float) -> Tensor:
    """out [R, output_dim, P, P] in input's dtype."""
    N, _, H, W = input.shape
    R = rois.shape[0]
    out = torch.empty(R, output_dim, pooled_size, pooled_size, dtype=input.dtype, device=input.device)
    if out.numel() == 0:
        return out
    if H * W == 0:
        return out.zero_()
    meta = _meta(pooled_size, output_dim, group_size, part_size, sample_per_part, offset is not None)
    classes = offset.shape[1] // 2 if offset is not None else 1
    off = offset.contiguous() if offset is not None else rois
    run_cached(_psroi_fwd_kernel, (R, ceil_div(output_dim, meta["BLOCK_O"])), (input, rois.contiguous(), off, out),
               (N, H, W, *input.stride(), output_dim, classes, float(spatial_scale), float(trans_std)), meta)
    return out


def _max_roi_size(rois: Tensor, spatial_scale: float) -> Tensor:
    """The largest RoI side in input pixels, on the device (for the fixed-point bound of grad_offset)."""
    _, _, roi_w, roi_h = roi_boxes(rois, spatial_scale, torch.float64)
    return torch.cat([roi_w, roi_h]).max() if roi_w.numel() else roi_w.new_zeros(())


def deform_psroi_pool_backward(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor],
                               spatial_scale: float, pooled_size: int, output_dim: int, group_size: int,
                               part_size: int, sample_per_part: int, trans_std: float, need_input: bool,
                               need_offset: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset); None where not needed (or without an offset)."""
    N, _, H, W = input.shape
    R = rois.shape[0]
    need_offset = need_offset and offset is not None
    fixed = (need_input or need_offset) and torch.are_deterministic_algorithms_enabled()
    acc_dtype = torch.int64 if fixed else torch.float32
    gin = torch.zeros(input.shape, dtype=acc_dtype, device=input.device) if need_input else None
    goff = torch.zeros(offset.shape, dtype=acc_dtype, device=input.device) if need_offset else None
    go = grad_out.contiguous()
    scales = None
    if fixed:
        # grad_input: one element gets at most Σ |g| over the RoIs' P·P bins of its output channel (a bin's sample
        # weights sum to 1). A part cell gets at most output_dim·P·P (bin, channel) shares, each at most
        # |g| · 2 max|input| · trans_std · the largest RoI side.
        bins = R * pooled_size * pooled_size
        s_in = scales_for(max_abs(go) * bins)
        s_off = scales_for(max_abs(go) * 2 * max_abs(input) * abs(trans_std) * _max_roi_size(rois, spatial_scale)
                           * output_dim * pooled_size * pooled_size)
        scales = (torch.cat([s_in[0], s_off[0]]), s_in[1], s_off[1])
    if R and H * W and (need_input or need_offset):
        meta = _meta(pooled_size, output_dim, group_size, part_size, sample_per_part, offset is not None)
        classes = offset.shape[1] // 2 if offset is not None else 1
        off = offset.contiguous() if offset is not None else rois
        tensors = (input, rois.contiguous(), off, go, gin if gin is not None else go,
                   goff if goff is not None else go, scales[0] if fixed else go)
        run_cached(_psroi_bwd_kernel, (R, ceil_div(output_dim, meta["BLOCK_O"])), tensors,
                   (N, H, W, *input.stride(), output_dim, classes, float(spatial_scale), float(trans_std)),
                   dict(meta, NEED_IN=need_input, NEED_OFF=need_offset, FIXED=fixed))
    if gin is not None:
        gin = (gin.double() * scales[1].double()).to(input.dtype) if fixed else gin.to(input.dtype)
    if goff is not None:
        goff = (goff.double() * scales[2].double()).to(offset.dtype) if fixed else goff.to(offset.dtype)
    return gin, goff
