"""Deformable RoI pooling's Triton kernels, forward and backward (shapes and rule: reference.py, __init__.py).

The input is read in place through its strides (NCHW or channels_last). A forward program owns one RoI and BLOCK_C
channels: all its ph·pw bins at once (a [BLOCK_C, BLOCK_BINS] tile, bins along the threads, for an NCHW input;
[BLOCK_BINS, BLOCK_C] for channels_last), looping over the RoI's own sample grid (adaptive sampling: runtime loop
bounds). Where an NCHW RoI's bins hold at least 2·BLOCK_S samples each, the program instead takes its channels
SPREAD_PLANES at a time with each bin's samples along the threads ([BLOCK_BINS, BLOCK_S]): such samples lie at most a
pixel apart, so a warp's loads share cache lines, where bins along the threads put each load in a line of its own;
each sample's position and weights serve every channel of the pass. A backward program owns one RoI and loops over
the channel blocks, so each bin's offset gradient is summed in registers and stored once; grad_input is added by
atomics into an fp32 buffer (int64 fixed point in deterministic mode: common/fixed_point.py).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....config import options
from ...common.fixed_point import max_abs, scales_for
from ...common.launch import backward_warps, ceil_div, gather_tile, next_pow2, run_cached
from ...common.sampling import div, load_grid_corners, scatter_add

# --- configs -------------------------------------------------------------------------------------------

# (elements, warps) of a program: BLOCK_BINS·BLOCK_C = 1024 over 8 warps, 4 a thread. The backward's four
# scatters and corner loads a sample compile to 150-170 registers a thread at this tile, 255 at twice as many a thread.
TILE = (1024, 8)


# Samples of a bin side by side in the forward's spread tile ([BLOCK_BINS, BLOCK_S]). Only RoIs with 2·BLOCK_S or more
# samples a bin take it: the last BLOCK_S of a bin's samples are partly masked lanes, so from two tiles on at least
# two thirds of the lanes load; RoIs with fewer samples keep the [BLOCK_C, BLOCK_BINS] tile.
BLOCK_S = 16
# Channel planes the spread tile takes a pass: each sample's position, weights and flags serve them all. Two: at four
# the forward compiles to 172 registers a thread (one 8-warp program an SM where two fit) and is slower
# (docs/tuning.md).
SPREAD_PLANES = 2


def _blocks(bins: int, channels: int) -> Tuple[int, int, int]:
    """(BLOCK_BINS, BLOCK_C, warps): every bin of the RoI, and channels filling the tile (at least 8)."""
    elements, warps = gather_tile(TILE)
    block_bins = next_pow2(bins)
    return block_bins, max(8, min(next_pow2(channels), elements // block_bins)), warps


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _roi(rois_ptr, off_ptr, r, bins, bin_ok, N, SCALE, GAMMA, PH: tl.constexpr, PW: tl.constexpr,
         SAMPLING: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """RoI r: its image, each bin's start (sx, sy) [BLOCK_BINS] (offset applied), the bin size, the sample grid
    (gh, gw) and the RoI's size."""
    b = tl.load(rois_ptr + r * 5).to(tl.int64)  # in range: checked on the host (op.py), and bins_live here
    x1 = tl.load(rois_ptr + r * 5 + 1).to(tl.float32) * SCALE - 0.5
    y1 = tl.load(rois_ptr + r * 5 + 2).to(tl.float32) * SCALE - 0.5
    roi_w = tl.load(rois_ptr + r * 5 + 3).to(tl.float32) * SCALE - 0.5 - x1
    roi_h = tl.load(rois_ptr + r * 5 + 4).to(tl.float32) * SCALE - 0.5 - y1
    bin_w = div(roi_w, PW)
    bin_h = div(roi_h, PH)
    if SAMPLING > 0:
        gh = SAMPLING
        gw = SAMPLING
    else:  # ceil(roi size / bins); a RoI of no (or negative) size samples nothing
        gh = tl.maximum(tl.ceil(bin_h), 0.0).to(tl.int32)
        gw = tl.maximum(tl.ceil(bin_w), 0.0).to(tl.int32)
    i = bins // PW
    j = bins - i * PW
    sx = x1 + j.to(tl.float32) * bin_w
    sy = y1 + i.to(tl.float32) * bin_h
    if HAS_OFFSET:
        ox = tl.load(off_ptr + r * 2 * PH * PW + bins, mask=bin_ok, other=0.0).to(tl.float32)
        oy = tl.load(off_ptr + r * 2 * PH * PW + PH * PW + bins, mask=bin_ok, other=0.0).to(tl.float32)
        sx += GAMMA * roi_w * ox
        sy += GAMMA * roi_h * oy
    # an image index out of range (not checkable on the host without waiting for the GPU) samples nothing
    live = bin_ok & (b >= 0) & (b < N)
    return tl.where((b >= 0) & (b < N), b, 0), live, sx, sy, bin_w, bin_h, gh, gw, roi_w, roi_h


@triton.jit
def _axis(c, size):
    """RoIAlign's bilinear along one axis: low and high indices, their weights, the slope of the high weight (zero
    where the coordinate is clamped), and whether the sample counts (inside [-1, size])."""
    inside = (c >= -1.0) & (c <= size)
    c0 = tl.maximum(tl.where(inside, c, 0.0), 0.0)
    low = tl.floor(c0).to(tl.int32)
    at_end = low >= size - 1
    low = tl.where(at_end, size - 1, low)
    high = tl.where(at_end, low, low + 1)
    c0 = tl.where(at_end, low.to(tl.float32), c0)
    frac = c0 - low.to(tl.float32)
    slope = (inside & (c > 0.0) & ~at_end).to(tl.float32)
    return low, high, 1.0 - frac, frac, slope, inside


@triton.jit
def _grid_axis(start, i, size, n, limit):
    """_axis of sample i of a bin's n along one axis: at start + (i + 0.5) · size / n (size: the bin's extent)."""
    return _axis(start + div((i + 0.5) * size, n), limit)


@triton.jit
def _per_bin(v, BINS_FAST: tl.constexpr):
    """A [BLOCK_BINS] vector as a column of the forward's tile: [1, BLOCK_BINS] where bins run along the threads
    (BINS_FAST), else [BLOCK_BINS, 1]."""
    if BINS_FAST:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def _per_channel(v, BINS_FAST: tl.constexpr):
    """A [BLOCK_C] vector as the other axis of the forward's tile (see _per_bin)."""
    if BINS_FAST:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def _pool_block_store(x_image, out_r, offs_c, c_ok, sc, bins, bin_ok, bin_live, sx, sy, bin_w, bin_h, gh, gw, H, W,
                      sh, sw, PH: tl.constexpr, PW: tl.constexpr, BLOCK_BINS: tl.constexpr, BLOCK_C: tl.constexpr,
                      BINS_FAST: tl.constexpr):
    """Every (channel, bin) of the block at once, one sample of each at a time over the RoI's sample grid; their
    means stored to the RoI's output out_r."""
    base = x_image + _per_channel(offs_c.to(tl.int64) * sc, BINS_FAST)
    c_live = _per_channel(c_ok, BINS_FAST)
    if BINS_FAST:
        acc = tl.zeros((BLOCK_C, BLOCK_BINS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_BINS, BLOCK_C), dtype=tl.float32)
    for iy in range(gh):
        yl, yh, wyl, wyh, sly, in_y = _grid_axis(sy, iy, bin_h, gh, H)
        for ix in range(gw):
            xl, xh, wxl, wxh, slx, in_x = _grid_axis(sx, ix, bin_w, gw, W)
            live = _per_bin(bin_live & in_y & in_x, BINS_FAST) & c_live
            v00, v01, v10, v11 = load_grid_corners(base, _per_bin(yl * sh, BINS_FAST), _per_bin(yh * sh, BINS_FAST),
                                                   _per_bin(xl * sw, BINS_FAST), _per_bin(xh * sw, BINS_FAST), live)
            acc += _per_bin(wyl * wxl, BINS_FAST) * v00 + _per_bin(wyl * wxh, BINS_FAST) * v01 \
                + _per_bin(wyh * wxl, BINS_FAST) * v10 + _per_bin(wyh * wxh, BINS_FAST) * v11
    count = tl.maximum(gh * gw, 1).to(tl.float32)
    out = out_r + _per_channel(offs_c.to(tl.int64) * (PH * PW), BINS_FAST) + _per_bin(bins, BINS_FAST)
    tl.store(out, div(acc, count).to(out_r.dtype.element_ty), mask=_per_bin(bin_ok, BINS_FAST) & c_live)


@triton.jit
def _blend(base, r0, r1, c0, c1, live, w00, w01, w10, w11):
    """One channel plane's bilinear samples at corners (r0 | r1) + (c0 | c1), weighted: w00·v00 + ... + w11·v11."""
    v00, v01, v10, v11 = load_grid_corners(base, r0, r1, c0, c1, live)
    return w00 * v00 + w01 * v01 + w10 * v10 + w11 * v11


@triton.jit
def _pool_spread(x_base, sc, c_left, bins, bin_live, sx, sy, bin_w, bin_h, gh, gw, H, W, sh, sw,
                 BLOCK_BINS: tl.constexpr, BLOCK_S: tl.constexpr, PLANES: tl.constexpr):
    """The sums [BLOCK_BINS] of PLANES (1, 2 or 4) neighbouring channel planes x_base + p·sc (those with p < c_left
    are channels; the others read nothing and sum to zero): each bin's samples BLOCK_S at a time, along the threads
    (sample s of a bin is grid point (s // gw, s % gw)). Each sample's position, weights and flags serve every
    plane's loads."""
    n_s = gh * gw
    offs_s = tl.arange(0, BLOCK_S)
    acc0 = tl.zeros((BLOCK_BINS, BLOCK_S), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_BINS, BLOCK_S), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_BINS, BLOCK_S), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_BINS, BLOCK_S), dtype=tl.float32)
    for s0 in range(0, n_s, BLOCK_S):
        s = s0 + offs_s
        iy = s // gw
        ix = s - iy * gw
        yl, yh, wyl, wyh, sly, in_y = _grid_axis(sy[:, None], iy[None, :], bin_h, gh, H)
        xl, xh, wxl, wxh, slx, in_x = _grid_axis(sx[:, None], ix[None, :], bin_w, gw, W)
        live = bin_live[:, None] & (s < n_s)[None, :] & in_y & in_x
        r0, r1, c0, c1 = yl * sh, yh * sh, xl * sw, xh * sw
        w00, w01, w10, w11 = wyl * wxl, wyl * wxh, wyh * wxl, wyh * wxh
        acc0 += _blend(x_base, r0, r1, c0, c1, live & (c_left > 0), w00, w01, w10, w11)
        if PLANES >= 2:
            acc1 += _blend(x_base + sc, r0, r1, c0, c1, live & (c_left > 1), w00, w01, w10, w11)
        if PLANES >= 4:
            acc2 += _blend(x_base + 2 * sc, r0, r1, c0, c1, live & (c_left > 2), w00, w01, w10, w11)
            acc3 += _blend(x_base + 3 * sc, r0, r1, c0, c1, live & (c_left > 3), w00, w01, w10, w11)
    return tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), tl.sum(acc2, axis=1), tl.sum(acc3, axis=1)


@triton.jit
def _roi_pool_fwd_kernel(
    x_ptr,        # input [N, C, H, W], strides below (any layout)
    rois_ptr,     # [R, 5]
    off_ptr,      # [R, 2, PH, PW] (read if HAS_OFFSET)
    out_ptr,      # [R, C, PH, PW]
    N, C, H, W, sn, sc, sh, sw, SCALE, GAMMA,
    PH: tl.constexpr, PW: tl.constexpr, SAMPLING: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_BINS: tl.constexpr, BLOCK_C: tl.constexpr,
    BINS_FAST: tl.constexpr,  # the tile [BLOCK_C, BLOCK_BINS], bins along the threads (an input whose channels are
                              # planes apart: neighbouring bins' samples lie near each other); else
                              # [BLOCK_BINS, BLOCK_C]
    BLOCK_S: tl.constexpr,    # (BINS_FAST) RoIs with 2·BLOCK_S or more samples a bin take the spread tile; 0: none
    PLANES: tl.constexpr,     # channels the spread tile takes a pass (1, 2, 4)
):
    """out[r, c, i, j] = the mean of bin (i, j)'s bilinear samples of channel c. Grid: (R, channel blocks)."""
    r = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    bins = tl.arange(0, BLOCK_BINS)
    bin_ok = bins < PH * PW
    # no tuple target is named "_": Triton would carry it through the loops below with changing types
    b, bin_live, sx, sy, bin_w, bin_h, gh, gw, roi_w, roi_h = _roi(rois_ptr, off_ptr, r, bins, bin_ok, N, SCALE, GAMMA,
                                                                 PH, PW, SAMPLING, HAS_OFFSET)
    out_r = out_ptr + r.to(tl.int64) * C * PH * PW
    if BINS_FAST and BLOCK_S > 0:  # (nested: a BLOCK_S of 0 must not reach the spread tile's code)
        if gh * gw >= 2 * BLOCK_S:
            count = (gh * gw).to(tl.float32)
            for ci in range(0, BLOCK_C, PLANES):  # PLANES channels a pass (BLOCK_C: a power of two, at least 8)
                c = tl.program_id(1) * BLOCK_C + ci
                sums0, sums1, sums2, sums3 = _pool_spread(x_ptr + b * sn + c.to(tl.int64) * sc, sc, C - c, bins,
                                                          bin_live, sx, sy, bin_w, bin_h, gh, gw, H, W, sh, sw,
                                                          BLOCK_BINS, BLOCK_S, PLANES)
                dst = out_r + c.to(tl.int64) * (PH * PW) + bins
                dtype = out_ptr.dtype.element_ty
                tl.store(dst, div(sums0, count).to(dtype), mask=bin_ok & (c < C))
                if PLANES >= 2:
                    tl.store(dst + PH * PW, div(sums1, count).to(dtype), mask=bin_ok & (c + 1 < C))
                if PLANES >= 4:
                    tl.store(dst + 2 * PH * PW, div(sums2, count).to(dtype), mask=bin_ok & (c + 2 < C))
                    tl.store(dst + 3 * PH * PW, div(sums3, count).to(dtype), mask=bin_ok & (c + 3 < C))
        else:
            _pool_block_store(x_ptr + b * sn, out_r, offs_c, c_ok, sc, bins, bin_ok, bin_live, sx, sy, bin_w, bin_h,
                              gh, gw, H, W, sh, sw, PH, PW, BLOCK_BINS, BLOCK_C, BINS_FAST)
    else:
        _pool_block_store(x_ptr + b * sn, out_r, offs_c, c_ok, sc, bins, bin_ok, bin_live, sx, sy, bin_w, bin_h,
                          gh, gw, H, W, sh, sw, PH, PW, BLOCK_BINS, BLOCK_C, BINS_FAST)


@triton.jit
def _roi_pool_bwd_kernel(
    x_ptr, rois_ptr, off_ptr,
    go_ptr,       # grad_out [R, C, PH, PW] contiguous
    gin_ptr,      # grad_input accumulator [N, C, H, W] contiguous: fp32, or int64 if FIXED (NEED_IN)
    goff_ptr,     # grad_offset [R, 2, PH, PW] (NEED_OFF)
    scale_ptr,    # fp32 [1]: grad_input's fixed-point scale (read if FIXED)
    N, C, H, W, sn, sc, sh, sw, SCALE, GAMMA,
    PH: tl.constexpr, PW: tl.constexpr, SAMPLING: tl.constexpr, HAS_OFFSET: tl.constexpr,
    NEED_IN: tl.constexpr, NEED_OFF: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_BINS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per sample: grad_input += g / count · (corner weight) at its 4 corners; grad_offset of a bin = gamma · (roi
    width, height) · Σ_c Σ_samples g / count · ∂sample/∂(x, y). Grid: (R,)."""
    r = tl.program_id(0)
    bins = tl.arange(0, BLOCK_BINS)
    bin_ok = bins < PH * PW
    b, bin_live, sx, sy, bin_w, bin_h, gh, gw, roi_w, roi_h = _roi(rois_ptr, off_ptr, r, bins, bin_ok, N, SCALE, GAMMA,
                                                                 PH, PW, SAMPLING, HAS_OFFSET)
    count = tl.maximum(gh * gw, 1).to(tl.float32)
    if FIXED:
        fixed_scale = tl.load(scale_ptr)
    else:
        fixed_scale = 1.0  # unused
    gx = tl.zeros((BLOCK_BINS,), dtype=tl.float32)
    gy = tl.zeros((BLOCK_BINS,), dtype=tl.float32)
    HW = H * W
    for c0 in range(0, C, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        g = div(tl.load(go_ptr + r.to(tl.int64) * C * PH * PW + (offs_c.to(tl.int64) * (PH * PW))[None, :]
                        + bins[:, None], mask=bin_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32), count)
        base = x_ptr + b * sn + (offs_c.to(tl.int64) * sc)[None, :]
        gbase = gin_ptr + (b * C + offs_c.to(tl.int64))[None, :] * HW
        for iy in range(gh):
            yl, yh, wyl, wyh, sly, in_y = _grid_axis(sy, iy, bin_h, gh, H)
            for ix in range(gw):
                xl, xh, wxl, wxh, slx, in_x = _grid_axis(sx, ix, bin_w, gw, W)
                live = (bin_live & in_y & in_x)[:, None] & c_ok[None, :]
                if NEED_IN:
                    scatter_add(gbase + (yl * W + xl)[:, None], g * (wyl * wxl)[:, None], live, fixed_scale, FIXED)
                    scatter_add(gbase + (yl * W + xh)[:, None], g * (wyl * wxh)[:, None], live, fixed_scale, FIXED)
                    scatter_add(gbase + (yh * W + xl)[:, None], g * (wyh * wxl)[:, None], live, fixed_scale, FIXED)
                    scatter_add(gbase + (yh * W + xh)[:, None], g * (wyh * wxh)[:, None], live, fixed_scale, FIXED)
                if NEED_OFF:
                    v00, v01, v10, v11 = load_grid_corners(base, (yl * sh)[:, None], (yh * sh)[:, None],
                                                           (xl * sw)[:, None], (xh * sw)[:, None], live)
                    dx = wyl[:, None] * (v01 - v00) + wyh[:, None] * (v11 - v10)
                    dy = wxl[:, None] * (v10 - v00) + wxh[:, None] * (v11 - v01)
                    gx += slx * tl.sum(g * dx, axis=1)
                    gy += sly * tl.sum(g * dy, axis=1)
    if NEED_OFF:
        goff = goff_ptr + r * 2 * PH * PW + bins
        tl.store(goff, (GAMMA * roi_w * gx).to(goff_ptr.dtype.element_ty), mask=bin_ok)
        tl.store(goff + PH * PW, (GAMMA * roi_h * gy).to(goff_ptr.dtype.element_ty), mask=bin_ok)


# --- launchers -----------------------------------------------------------------------------------------


def bins_fast(input: Tensor) -> bool:
    """The forward's tile orientation (_roi_pool_fwd_kernel's BINS_FAST): bins along the threads unless the input's
    channels lie next to each other (channels_last), where a warp's loads of one sample's channels are contiguous."""
    return input.stride(1) != 1 or input.shape[1] == 1


def spread_samples(sampling_ratio: int) -> int:
    """The forward's spread tile width (BLOCK_S; options.roi_spread where a benchmark forces one), or 0 where no RoI
    can take it: with adaptive sampling each RoI has its own sample count; a fixed sampling_ratio gives every RoI
    sampling_ratio² samples a bin."""
    block_s = BLOCK_S if options.roi_spread is None else options.roi_spread
    return block_s if block_s and (sampling_ratio <= 0 or sampling_ratio * sampling_ratio >= 2 * block_s) else 0


def spread_planes() -> int:
    """Channels the forward's spread tile takes a pass (PLANES): options.roi_planes where a benchmark forces it, else
    SPREAD_PLANES."""
    planes = options.roi_planes or SPREAD_PLANES
    if planes not in (1, 2, 4):
        raise ValueError(f"options.roi_planes must be 1, 2 or 4 (or None), got {planes!r}")
    return planes


def _meta(output_size, C: int, sampling_ratio: int, has_offset: bool) -> dict:
    ph, pw = output_size
    block_bins, block_c, warps = _blocks(ph * pw, C)
    return dict(PH=ph, PW=pw, SAMPLING=max(int(sampling_ratio), 0), HAS_OFFSET=has_offset, BLOCK_BINS=block_bins,
                BLOCK_C=block_c, num_warps=warps)


def deform_roi_pool_forward(input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size, spatial_scale: float,
                            sampling_ratio: int, gamma: float) -> Tensor:
    """out [R, C, ph, pw] in input's dtype."""
    N, C, H, W = input.shape
    R = rois.shape[0]
    out = torch.empty(R, C, *output_size, dtype=input.dtype, device=input.device)
    if out.numel() == 0:
        return out
    if N * H * W == 0:
        return out.zero_()
    meta = _meta(output_size, C, sampling_ratio, offset is not None)
    off = offset.contiguous() if offset is not None else rois
    run_cached(_roi_pool_fwd_kernel, (R, ceil_div(C, meta["BLOCK_C"])), (input, rois.contiguous(), off, out),
               (N, C, H, W, *input.stride(), float(spatial_scale), float(gamma)),
               dict(meta, BINS_FAST=bins_fast(input), BLOCK_S=spread_samples(sampling_ratio),
                    PLANES=spread_planes()))
    return out


def deform_roi_pool_backward(grad_out: Tensor, input: Tensor, rois: Tensor, offset: Optional[Tensor], output_size,
                             spatial_scale: float, sampling_ratio: int, gamma: float, need_input: bool,
                             need_offset: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset); None where not needed (or without an offset)."""
    N, C, H, W = input.shape
    R = rois.shape[0]
    need_offset = need_offset and offset is not None
    fixed = need_input and torch.are_deterministic_algorithms_enabled()
    gin = torch.zeros(input.shape, dtype=torch.int64 if fixed else torch.float32, device=input.device) \
        if need_input else None
    goff = torch.zeros_like(offset, memory_format=torch.contiguous_format) if need_offset else None
    go = grad_out.contiguous()
    scales = None
    if fixed:  # one grad_input element gets at most Σ over RoIs and bins of |g| (a bin's sample weights sum to 1)
        scales = scales_for(max_abs(go) * (R * output_size[0] * output_size[1]))
    if R and C and N * H * W and (need_input or need_offset):
        meta = _meta(output_size, C, sampling_ratio, offset is not None)
        off = offset.contiguous() if offset is not None else rois
        tensors = (input, rois.contiguous(), off, go, gin if gin is not None else go,
                   goff if goff is not None else go, scales[0] if fixed else go)
        run_cached(_roi_pool_bwd_kernel, (R,), tensors, (N, C, H, W, *input.stride(), float(spatial_scale),
                                                         float(gamma)),
                   dict(meta, NEED_IN=need_input, NEED_OFF=need_offset, FIXED=fixed,
                        num_warps=backward_warps(meta["num_warps"], fixed)))
    g_in = None
    if gin is not None:
        g_in = (gin.double() * scales[1].double()) if fixed else gin
        g_in = g_in.to(input.dtype).contiguous(memory_format=torch.channels_last if input.is_contiguous(
            memory_format=torch.channels_last) and not input.is_contiguous() else torch.contiguous_format)
    return g_in, goff
