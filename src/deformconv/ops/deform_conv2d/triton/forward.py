"""The forward kernel: out = Σ_k A[m, k]·W[k, n], A sampled bilinearly on the fly (implicit GEMM).

Shapes (per conv group gc): M = N·Ho·Wo output positions, N = Cout/groups, K = (Cin/groups)·kh·kw.
    input   [N, Cin, H, W]          read NHWC (or offset-grouped [N, G, H, W, Cin/G]: geometry.grouped_input)
    offset  [N, 2·G·kh·kw, Ho, Wo]  (dy, dx) per tap, read NCHW
    mask    [N, G·kh·kw, Ho, Wo]    optional (DCNv2)
    weight  [Cout, Cin/groups, kh, kw]  read packed (packing.pack_weight)
    out     [N, Cout, Ho, Wo]       in the input's dtype and memory format

The K loop runs over taps, then segments, then channel chunks: each position's sample point, corners and weights
(× mask) are computed once per (tap, segment) in fp32 and reused for every chunk; the sampled A tile goes from
registers into tl.dot, so no (Cin·kh·kw) × (N·Ho·Wo) column buffer ever exists. Short segments are packed NSEG to
a chunk, their corners loaded as pairs, the next step's loads issued before this step's dot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....checks import ConvGeometry, geometry_from_tensors, suggest_memory_format
from ....compat import codegen_profile
from ....config import options
from ...common.launch import Launch, ceil_div, dot_precision, pick_config, remember, tma_launch
from ...common.sampling import (
    bilinear_weights,
    blend,
    blend_pairs,
    load_corners,
    sample_from,
    sample_loads,
    sample_point,
)
from . import narrow_groups
from .configs import Config, fwd_candidates
from .geometry import (
    contiguous_operands,
    count_m_tiles,
    grouped_input,
    k_chunks_whole,
    mask_kind,
    per_image_tiles,
    plan_key,
    position_strides,
    segment_length,
    segments_per_chunk,
    size_args,
    tuning_class,
    weight_k_major,
)
from .packing import forward_operands
from .tiles import (
    packed_step,
    position_setup,
    tap_origin,
    tile_positions,
    tile_start,
    weight_descriptor,
    weight_tile,
    weight_tma_tile,
)

# --- kernel --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, n0, W, CIN, CIN_G, COUT_G,
                 KK: tl.constexpr, SEG: tl.constexpr, EVEN_K: tl.constexpr, W_K_MAJOR: tl.constexpr, TMA: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, FMA_BLEND: tl.constexpr, BLOCK_K: tl.constexpr):
    """The forward's K steps of one tap and (long) segment s of conv group gc: acc [BM, BN] += A·B over the
    segment's channel chunks, A blended from the 4 corners of `sample` (sample_point), B the weight tile of output
    channels n0.. (through its TMA descriptor w_ptr if TMA). The chunk loop is pipelined by Triton (num_stages)."""
    p00, v00, v01, v10, v11, ly, lx, mv = sample
    w00, w01, w10, w11 = bilinear_weights(ly, lx, mv)
    dt = x_ptr.dtype.element_ty  # the blend's dtype (blend): the weights rounded to it once a segment
    w00, w01, w10, w11 = w00.to(dt), w01.to(dt), w10.to(dt), w11.to(dt)
    c_lo = gc * CIN_G + s * SEG
    row0 = (gc * KK + tap) * CIN_G  # the tap's first weight row
    tap_row = row0.to(tl.int64)
    w_row = (row0 + s * SEG).to(tl.int64)
    for c0 in range(0, SEG, BLOCK_K):
        k_ok = c0 + offs_k < SEG
        c00, c01, c10, c11 = load_corners(x_ptr, p00, c_lo + c0 + offs_k, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K)
        a = blend(w00, w01, w10, w11, c00, c01, c10, c11, FMA_BLEND)
        if TMA:
            b = weight_tma_tile(w_ptr, gc * KK + tap, s * SEG + c0, n0, CIN_G, COUT_G, W_K_MAJOR)
        else:
            b = weight_tile(w_ptr, w_row + c0 + offs_k, tap_row, k_ok, n_ok, offs_n, CIN_G, COUT_G, W_K_MAJOR, EVEN_K)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _deform_conv2d_fwd_kernel(
    # pointers
    x_ptr,        # input  NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read if HAS_MASK; logits: sampling.MASK_LOGITS)
    w_ptr,        # weight packed [groups, KH*KW, Cin_g, Cout_g], or [groups, KH*KW, Cout_g, Cin_g] if W_K_MAJOR;
                  # if TMA a descriptor of it (weight_descriptor): [groups*KH*KW*Cin_g, Cout_g] in blocks
                  # [BLOCK_K, BLOCK_N], or if W_K_MAJOR [groups*KH*KW*Cout_g, Cin_g] in blocks [BLOCK_N, BLOCK_K]
    b_ptr,        # bias [Cout]                              (read only if HAS_BIAS)
    out_ptr,      # output [N, Cout, Ho, Wo], strides below
    # sizes
    H, W, CIN, HO, WO, M,              # M = N*Ho*Wo
    CIN_G, COUT_G, COG, G,             # channels per conv group / offset group; offset groups
    # geometry
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    # output strides in elements: image, position l = ho*Wo + wo, channel
    out_sn, out_sl, out_sc,
    # meta
    KH: tl.constexpr, KW: tl.constexpr,
    SEG: tl.constexpr,                 # channels per segment (one conv group and one offset group)
    NSEG: tl.constexpr,                # segments per K chunk: 1, or BLOCK_K // SEG when segments are short
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    W_K_MAJOR: tl.constexpr,           # the packed weight's input channels contiguous (see weight_k_major)
    PER_IMAGE: tl.constexpr,           # M tiles never cross an image (see position_setup)
    GROUPED: tl.constexpr,             # NSEG > 1 only: the input in the offset-grouped layout
    SAMPLE_AHEAD: tl.constexpr,        # NSEG == 1 only: offsets and mask loaded one (tap, segment) step ahead
    TMA: tl.constexpr,                 # B tiles through the descriptor w_ptr (EVEN_K only)
    RUN_STORE: tl.constexpr,           # 0, or (NCHW output: out_sl == 1) elements a store along a plane
                                       # (run_store_length)
    # codegen spellings (compat.CodegenProfile)
    FMA_BLEND: tl.constexpr, PAIRS_OUTER: tl.constexpr, FLAT_RUNS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[m, gc*Cout_g + n] = sum_k A[m, k] * Wp[gc, k, n], A sampled on the fly. Grid: (M tiles x N tiles, groups)."""
    tl.static_assert(NSEG > 1 or not GROUPED, "the offset-grouped input layout is for packed segments")
    # --- which tile ---
    pid = tl.program_id(0)
    gc = tl.program_id(1)
    num_n = tl.cdiv(COUT_G, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    KK: tl.constexpr = KH * KW
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK, PER_IMAGE, BLOCK_M)
    L = HO * WO
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COUT_G
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the input's pixel stride (GROUPED: a constexpr, so Triton knows each corner run is SEG-aligned) and group stride
    PIX = SEG if GROUPED else CIN
    GS = tl.cast(H * W, tl.int64) * SEG if GROUPED else 0  # tl.cast: H, W may be constants (torch.compile)

    # --- K loop, short segments: one flat loop over (tap, chunk of NSEG segments) steps, one sample point per
    # segment; the next step's offsets and corners are loaded before this step's blend and dot (by hand: the
    # chunk loop alone is too short for Triton's pipelining, e.g. 2 chunks a tap for 64 channels) ---
    if NSEG > 1:
        n_steps = KK * tl.cdiv(CIN_G, BLOCK_K)
        wt, wb, top, bottom = packed_step(
            x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid, 0, gc,
            H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W, KW, KK, SEG, NSEG, HAS_MASK, GROUPED, PAIRS_OUTER, BLOCK_K)
        for step in range(n_steps):
            # --- issue the next step's loads (none after the last step) ---
            nwt, nwb, ntop, nbottom = packed_step(
                x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid & (step + 1 < n_steps),
                step + 1, gc, H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W, KW, KK, SEG, NSEG, HAS_MASK, GROUPED,
                PAIRS_OUTER, BLOCK_K)
            # --- this step: blend, B tile, dot ---
            a = tl.reshape(blend_pairs(wt, wb, top, bottom), (BLOCK_M, BLOCK_K))
            tap = step // tl.cdiv(CIN_G, BLOCK_K)
            c0 = (step - tap * tl.cdiv(CIN_G, BLOCK_K)) * BLOCK_K
            row0 = (gc * KK + tap) * CIN_G  # the tap's first weight row
            if TMA:
                b = weight_tma_tile(w_ptr, gc * KK + tap, c0, pid_n * BLOCK_N, CIN_G, COUT_G, W_K_MAJOR)
            else:
                b = weight_tile(w_ptr, (row0 + c0 + offs_k).to(tl.int64), row0.to(tl.int64), c0 + offs_k < CIN_G,
                                 n_ok, offs_n, CIN_G, COUT_G, W_K_MAJOR, EVEN_K)
            acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
            wt, wb, top, bottom = nwt, nwb, ntop, nbottom
    elif SAMPLE_AHEAD:  # --- K loop: (tap, segment) steps, each one's offsets and mask issued a step ahead ---
        n_segs = CIN_G // SEG
        n_steps = KK * n_segs
        ndy, ndx, nmv = sample_loads(off_ptr, msk_ptr, off_row, msk_row, ((gc * CIN_G) // COG) * KK, L, m_valid,
                                      HAS_MASK)
        for ts in range(n_steps):
            tap = ts // n_segs
            s = ts - tap * n_segs
            dy, dx, mraw = ndy, ndx, nmv
            t1 = (ts + 1) // n_segs  # the next step's tap and first channel
            c1 = gc * CIN_G + (ts + 1 - t1 * n_segs) * SEG
            ndy, ndx, nmv = sample_loads(off_ptr, msk_ptr, off_row, msk_row, (c1 // COG) * KK + t1, L,
                                          m_valid & (ts + 1 < n_steps), HAS_MASK)
            y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            sample = sample_from(dy, dx, mraw, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
            acc = _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, pid_n * BLOCK_N, W, CIN,
                               CIN_G, COUT_G, KK, SEG, EVEN_K, W_K_MAJOR, TMA, DOT_PRECISION, FMA_BLEND, BLOCK_K)
    else:  # --- K loop: taps x segments x channel chunks (sample point reused across a segment's chunks) ---
        for tap in range(KK):
            y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            for s in range(CIN_G // SEG):
                ch = ((gc * CIN_G + s * SEG) // COG) * KK + tap
                sample = sample_point(
                    off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
                acc = _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, pid_n * BLOCK_N, W, CIN,
                                   CIN_G, COUT_G, KK, SEG, EVEN_K, W_K_MAJOR, TMA, DOT_PRECISION, FMA_BLEND, BLOCK_K)

    # --- epilogue: bias, store in the output's layout ---
    co = gc * COUT_G + offs_n
    if HAS_BIAS:
        # in the output's (the input's) dtype, as the weight is used: a wider bias rounded (backward_weight.py)
        acc += tl.load(b_ptr + co, mask=n_ok, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)[None, :]
    val = acc.to(out_ptr.dtype.element_ty)
    cols = (co.to(tl.int64) * out_sc)[None, :]
    if RUN_STORE > 0:
        # an NCHW output (out_sl == 1), and a whole tile inside one image: its positions are the run l0 .. l0 +
        # BLOCK_M - 1 of each channel plane, stored without a position mask and with the runs' alignment (a multiple
        # of RUN_STORE, as Ho*Wo and BLOCK_M are) stated, so that Triton vectorises the stores along them
        img0, l0 = tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        if l0 + BLOCK_M <= L:
            start = tl.multiple_of(img0.to(tl.int64) * out_sn + l0, RUN_STORE)
            planes = tl.multiple_of(co.to(tl.int64) * out_sc, RUN_STORE)
            tl.store(out_ptr + (start + tl.arange(0, BLOCK_M))[:, None] + planes[None, :], val, mask=n_ok[None, :])
        else:  # the image's last tile, or (flat tiles) one across two images: positions recomputed here
            m_valid, n_img, l32 = tile_positions(pid_m, M, L, PER_IMAGE, BLOCK_M)
            tl.store(out_ptr + (n_img * out_sn + l32.to(tl.int64) * out_sl)[:, None] + cols, val,
                     mask=m_valid[:, None] & n_ok[None, :])
    elif FLAT_RUNS:
        # a tile inside one image stores its positions as the run l0 .. l0 + BLOCK_M - 1 (contiguous_flat_store)
        img0, l0 = tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        if l0 + BLOCK_M <= L:
            rows = img0.to(tl.int64) * out_sn + (l0 + tl.arange(0, BLOCK_M)).to(tl.int64) * out_sl
            tl.store(out_ptr + rows[:, None] + cols, val, mask=n_ok[None, :])
        else:
            tl.store(out_ptr + (n_img * out_sn + l * out_sl)[:, None] + cols, val,
                     mask=m_valid[:, None] & n_ok[None, :])
    else:
        tl.store(out_ptr + (n_img * out_sn + l * out_sl)[:, None] + cols, val, mask=m_valid[:, None] & n_ok[None, :])


# --- launcher ------------------------------------------------------------------------------------------


def run_store_length(out: Tensor, block_m: int, nseg: int) -> int:
    """The forward's RUN_STORE: elements a vectorised store writes along an NCHW output's channel plane, or 0 (the
    accumulator's own layout: scalar stores Ho*Wo apart). Only with unpacked segments (packed ones store vectorised
    already) and options.run_stores. With CodegenProfile.wide_run_stores: the largest power of two dividing Ho*Wo
    and block_m, up to 16 bytes, in any dtype, 0 below 2 elements; else 8 (16 bytes) for a 16-bit output whose
    planes and tiles are multiples of 8 positions (shorter runs and fp32 were slower there)."""
    n, c, h, w = out.shape
    if not options.run_stores or nseg > 1 or out.stride(3) != 1 or out.stride(1) != h * w:
        return 0
    if codegen_profile().wide_run_stores:
        run = min(math.gcd(h * w, block_m), 16 // out.element_size())
        return run if run > 1 else 0
    if out.element_size() != 2:
        return 0
    return 8 if h * w % 8 == 0 and block_m % 8 == 0 else 0


@dataclass
class ForwardPlan:
    """What a forward call signature needs, worked out once: its geometry, layouts and (after the first call) its
    launch."""

    geo: ConvGeometry
    seg: int
    memory_format: torch.memory_format
    grouped: bool
    k_major: bool
    launch: Optional[Launch] = None


def _weight_operand(run: Launch, wp: Tensor):
    """The forward's weight argument: the packed tensor, or its TMA descriptor."""
    m = run.meta
    return weight_descriptor(wp, m["BLOCK_K"], m["BLOCK_N"], m["W_K_MAJOR"]) if m["TMA"] else wp


def _launch_forward(plan: ForwardPlan, cfg: Config, x: Tensor, off: Tensor, msk: Tensor, wp: Tensor, b: Tensor,
                    out: Tensor, has_mask: int, has_bias: bool) -> Launch:
    """Plan and run the forward kernel with cfg (compiling it on first use)."""
    geo, seg, dtype = plan.geo, plan.seg, x.dtype
    nseg = segments_per_chunk(geo, seg, cfg.block_k, "fwd")
    run_store = run_store_length(out, cfg.block_m, nseg)
    per_image = per_image_tiles(geo, cfg.block_m, "fwd", nseg, run_store > 0)
    grid = (count_m_tiles(geo, cfg.block_m, per_image) * ceil_div(geo.out_channels // geo.groups, cfg.block_n),
            geo.groups)
    args = (*size_args(geo), *geo.stride, *geo.padding, *geo.dilation, *position_strides(out))
    even_k = k_chunks_whole(geo, seg, cfg.block_k, "fwd")
    profile = codegen_profile()
    meta = dict(KH=geo.kernel_h, KW=geo.kernel_w, SEG=seg, NSEG=nseg, HAS_MASK=has_mask, HAS_BIAS=has_bias,
                EVEN_K=even_k, DOT_PRECISION=dot_precision(dtype), W_K_MAJOR=plan.k_major, PER_IMAGE=per_image,
                GROUPED=plan.grouped, SAMPLE_AHEAD=cfg.sample_ahead,
                TMA=tma_launch(cfg, dtype, even_k, [(wp, wp.shape[-1])]), RUN_STORE=run_store,
                FMA_BLEND=profile.explicit_fma_blend, PAIRS_OUTER=profile.pair_axis_outer,
                FLAT_RUNS=profile.contiguous_flat_store,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options())
    run = Launch(_deform_conv2d_fwd_kernel, grid, args, meta)
    run(x, off, msk, _weight_operand(run, wp), b, out)
    return run


def deform_conv2d_forward(
    input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], keep: Optional[dict] = None,
    memo: Optional[dict] = None, logits: bool = False,
) -> Tensor:
    """out [N, Cout, Ho, Wo] in input's dtype and memory format. Arguments already validated. keep: a dict that
    receives "packed_weight", the packed weight in the layout the backward reads (16-bit inputs: the forward's own),
    for deform_conv2d_backward's packed_weight, and "offset" / "mask", the contiguous copies made of them here (a
    module's offset and mask are channel slices of its offset conv's output), for its operands. memo: a dict kept
    by a caller that knows the call signature already (call.py), which holds the plan once there is one, so that
    no plan key is built at later calls. logits: offset and mask are the channel ranges [:2·G·kh·kw] and
    [2·G·kh·kw:] of one NCHW-contiguous tensor (geometry.reads_logits) and mask holds logits: the kernels read both
    where they are and take the sigmoid themselves (eager calls only: a traced call's kernels read copies). Narrow
    convolution groups go through the column kernels instead (narrow_groups.py)."""
    if narrow_groups.narrow_groups(input, weight):
        return narrow_groups.forward(input, offset, weight, bias, mask, stride, padding, dilation, logits)
    if logits:
        off, msk = offset, mask
    else:
        off, msk = contiguous_operands(offset, mask)
        if keep is not None:
            if off is not offset:
                keep["offset"] = off
            if msk is not mask:
                keep["mask"] = msk
    msk = msk if msk is not None else off  # the mask and bias pointers fall back to the offset; never read then
    b = bias.contiguous() if bias is not None else off
    plan = memo.get("fwd") if memo is not None else None
    if plan is None:
        plans = options.cache("plans")
        key = plan_key("fwd", input, offset, weight, mask, stride, padding, dilation, (input, off, msk, b),
                       bias is None, logits)
        plan = plans.get(key)
    if plan is None:
        geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
        seg = segment_length(geo)
        plan = ForwardPlan(geo, seg, suggest_memory_format(input), grouped_input(geo, seg), weight_k_major(input.dtype))
    geo = plan.geo
    x, wp = forward_operands(input, weight, geo.groups, geo.offset_groups, plan.grouped, plan.k_major, memo)
    if keep is not None and not plan.k_major:
        keep["packed_weight"] = wp
    out = torch.empty((geo.batch, geo.out_channels, geo.out_h, geo.out_w), dtype=input.dtype, device=input.device,
                      memory_format=plan.memory_format)
    if plan.launch is not None:
        plan.launch(x, off, msk, _weight_operand(plan.launch, wp), b, out)
    else:
        kind = mask_kind(mask, logits)

        def launch(cfg: Config) -> Launch:
            return _launch_forward(plan, cfg, x, off, msk, wp, b, out, kind, bias is not None)

        cfg = pick_config(tuning_class("fwd", geo, input.dtype, plan.seg, mask is not None),
                          fwd_candidates(geo, plan.seg, input.dtype, input.device), launch, input.device)
        plan.launch = launch(cfg)
        remember(plans, key, plan)
    if memo is not None:
        memo["fwd"] = plan
    return out
