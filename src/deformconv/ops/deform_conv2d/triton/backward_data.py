"""The grad_input / grad_offset / grad_mask kernel (one kernel for the three, sharing its sample points).

Shapes as the forward's (forward.py), plus
    grad_out     [N, Cout, Ho, Wo]     read channels-last (a copy where it comes NCHW)
    grad_input   accumulated in fp32 (int64 fixed point in deterministic mode) in the input copy's layout
    grad_offset  like offset, grad_mask like mask: each element owned by one program (plain stores)

Per M tile and run of taps: grad_col = grad_out @ Wᵀ chunk by chunk on the tensor cores, scattered to the 4
corners of each sample point (atomics), and reduced over channels into grad_offset and grad_mask.
"""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl
from torch import Tensor

from ....checks import ConvGeometry
from ....compat import codegen_profile
from ...common.launch import Launch, tma_launch
from ...common.sampling import (
    corner_pairs,
    mask_offset_grads,
    pair_sums,
    pair_weights,
    sample_point,
    scatter_pairs,
    segment_channels,
)
from .configs import Config
from .geometry import count_m_tiles, go_resident, k_chunks_whole, per_image_tiles, segments_per_chunk
from .tiles import (
    chunk_sample_points,
    grad_out_descriptor,
    grad_out_tile,
    grad_out_tma_ok,
    position_setup,
    segment_grads,
    store_point_grads,
    tap_origin,
    weight_descriptor,
)

# --- kernel --------------------------------------------------------------------------------------------


@triton.jit
def _grad_col(go_ptr, go_row, go_res, w_ptr, w_row, k_ok, gc, m_valid, COUT_G, go_sc, pid_m, L,
              GO_RESIDENT: tl.constexpr, TMA: tl.constexpr, PER_IMAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """grad_col [BM, BK] = grad_out[:, conv group gc] @ Wp[w_row:w_row + BK]^T (fp32). With GO_RESIDENT the grad_out
    tile is go_res, loaded once by the caller; else it is loaded here, N tile by N tile. With TMA the weight
    tiles (and grad_out's, unless resident) come through the descriptors w_ptr and go_ptr (see the kernel)."""
    offs_n = tl.arange(0, BLOCK_N)
    w_rows = w_row + tl.arange(0, BLOCK_K)
    if GO_RESIDENT:
        if TMA:
            wt = w_ptr.load([w_row.to(tl.int32), 0]).T
        else:
            wt = tl.load(w_ptr + w_rows[None, :] * COUT_G + offs_n[:, None],
                         mask=k_ok[None, :] & (offs_n < COUT_G)[:, None], other=0.0)
        gcol = tl.dot(go_res.to(wt.dtype), wt, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    else:
        gcol = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for n0 in range(0, COUT_G, BLOCK_N):
            if TMA:
                go = grad_out_tile(go_ptr, pid_m, gc * COUT_G + n0, L, PER_IMAGE, BLOCK_M, BLOCK_N)
                wt = w_ptr.load([w_row.to(tl.int32), n0]).T
            else:
                n_ok = n0 + offs_n < COUT_G
                go = tl.load(go_ptr + go_row[:, None] + ((gc * COUT_G + n0 + offs_n).to(tl.int64) * go_sc)[None, :],
                             mask=m_valid[:, None] & n_ok[None, :], other=0.0)
                wt = tl.load(w_ptr + w_rows[None, :] * COUT_G + (n0 + offs_n)[:, None],
                             mask=k_ok[None, :] & n_ok[:, None], other=0.0)
            gcol = tl.dot(go.to(wt.dtype), wt, gcol, input_precision=DOT_PRECISION)
    return gcol


@triton.jit
def _deform_conv2d_bwd_data_kernel(
    # pointers
    x_ptr,        # input  NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read if HAS_MASK; logits: sampling.MASK_LOGITS)
    w_ptr,        # weight packed [groups, KH*KW, Cin_g, Cout_g]; if TMA a descriptor of it as [groups*KH*KW*Cin_g,
                  # Cout_g], blocks [BLOCK_K, BLOCK_N]
    go_ptr,       # grad_out [N, Cout, Ho, Wo], strides below; if TMA and not GO_RESIDENT a descriptor (grad_out_tile)
    gin_ptr,      # grad_input in x's layout, zeroed (atomic adds; if NEED_GIN): fp32, or int64 if FIXED_GIN
    goff_ptr,     # grad_offset NCHW like offset (if NEED_GOFF)
    gmsk_ptr,     # grad_mask NCHW like mask (if NEED_GMSK)
    scale_ptr,    # fp32 [1]: grad_input's fixed-point scale (read only if FIXED_GIN)
    # sizes
    H, W, CIN, HO, WO, M,
    CIN_G, COUT_G, COG, G,
    # geometry
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    # grad_out strides in elements: image, position, channel
    go_sn, go_sl, go_sc,
    # meta
    KH: tl.constexpr, KW: tl.constexpr, SEG: tl.constexpr, HAS_MASK: tl.constexpr,
    NSEG: tl.constexpr,           # segments per K chunk; > 1 only when each offset group is one segment
    NEED_GIN: tl.constexpr, NEED_GOFF: tl.constexpr, NEED_GMSK: tl.constexpr,
    FIXED_GIN: tl.constexpr,      # deterministic mode: grad_input in int64 fixed point (see scatter_add)
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PER_IMAGE: tl.constexpr,      # M tiles never cross an image (see position_setup)
    GO_RESIDENT: tl.constexpr,    # one conv group and Cout <= BLOCK_N: the grad_out tile is loaded once
    TAP_SPLIT: tl.constexpr,      # programs per M tile, each taking a run of taps (more programs for few positions)
    GROUPED: tl.constexpr,        # NSEG > 1 only: input and grad_input in the offset-grouped layout
    TMA: tl.constexpr,            # weight (and grad_out) tiles through descriptors (EVEN_K only)
    PAIRS_OUTER: tl.constexpr,    # corner pairs addressed pair axis outermost (compat.CodegenProfile)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Per M tile and run of taps: grad_col = grad_out @ Wp^T chunk by chunk on tensor cores, then scatter it
    to the 4 corners of grad_input (atomics) and reduce it over channels into grad_offset and grad_mask (each
    (position, tap, offset group) is owned by one program: plain stores). Grid: (M tiles, TAP_SPLIT)."""
    tl.static_assert(NSEG > 1 or not GROUPED, "the offset-grouped input layout is for packed segments")
    # --- which tile, which taps ---
    pid_m = tl.program_id(0)
    KK: tl.constexpr = KH * KW
    if TAP_SPLIT == 1:
        tap_lo = 0
        tap_hi = KK
    else:
        tap_lo = tl.program_id(1) * KK // TAP_SPLIT
        tap_hi = (tl.program_id(1) + 1) * KK // TAP_SPLIT
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK, PER_IMAGE, BLOCK_M)
    L = HO * WO
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    go_row = n_img * go_sn + l * go_sl
    if FIXED_GIN:
        scale = tl.load(scale_ptr)
    else:
        scale = 1.0  # unused
    if GO_RESIDENT:  # read once here instead of once per (tap, chunk): the loops' largest repeated load
        go_res = tl.load(go_ptr + go_row[:, None] + (offs_n.to(tl.int64) * go_sc)[None, :],
                         mask=m_valid[:, None] & (offs_n < COUT_G)[None, :], other=0.0)
    else:
        go_res = tl.zeros((BLOCK_M, BLOCK_N), dtype=x_ptr.dtype.element_ty)  # unused

    if NSEG > 1:  # --- short segments: chunks of NSEG whole offset groups, one sample point per group ---
        offs_s = tl.arange(0, NSEG)
        PIX = SEG if GROUPED else CIN  # pixel and offset-group strides of x and grad_input (see the forward)
        GS = tl.cast(H * W, tl.int64) * SEG if GROUPED else 0  # tl.cast: H, W may be constants (torch.compile)
        for tap in range(tap_lo, tap_hi):
            y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            for gc in range(CIN // CIN_G):
                for c0 in range(0, CIN_G, BLOCK_K):
                    k_ok = c0 + offs_k < CIN_G
                    seg_ok = c0 + offs_s * SEG < CIN_G
                    c_first = gc * CIN_G + c0 + offs_s * SEG
                    w_row = ((gc * KK + tap) * CIN_G + c0).to(tl.int64)
                    # --- grad_col [BM, BK] = grad_out[:, group gc] @ Wp[gc, tap, chunk]^T ---
                    gcol = _grad_col(go_ptr, go_row, go_res, w_ptr, w_row, k_ok, gc, m_valid, COUT_G, go_sc, pid_m, L,
                                     GO_RESIDENT, TMA, PER_IMAGE, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
                    # --- corner pairs [BM, NSEG, 2, SEG], reductions over each group's channels, scatter ---
                    p00, v00, v01, v10, v11, ly, lx, mv = chunk_sample_points(
                        off_ptr, msk_ptr, off_row, msk_row, c_first, seg_ok, tap, COG, KK, L,
                        y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK)
                    cc = segment_channels(c_first, GS, SEG, GROUPED)
                    g3 = tl.reshape(gcol, (BLOCK_M, NSEG, SEG))
                    ch = (c_first // COG) * KK + tap
                    done = m_valid[:, None] & seg_ok[None, :]
                    # grad_mask and grad_offset from 4 channel sums (fewer operations per element)
                    if NEED_GMSK or NEED_GOFF:
                        top, bottom = corner_pairs(x_ptr, p00, cc, v00, v01, v10, v11, W * PIX, PIX, PAIRS_OUTER)
                        s00, sdx, sdy, sdy1 = pair_sums(g3, top, bottom)
                        g_m, g_y, g_x = mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv, HAS_MASK)
                        if NEED_GMSK:
                            tl.store(gmsk_ptr + msk_row[:, None] + (ch.to(tl.int64) * L)[None, :],
                                     g_m.to(gmsk_ptr.dtype.element_ty), mask=done)
                        if NEED_GOFF:
                            gy_row = off_row[:, None] + ((2 * ch).to(tl.int64) * L)[None, :]
                            tl.store(goff_ptr + gy_row, g_y.to(goff_ptr.dtype.element_ty), mask=done)
                            tl.store(goff_ptr + gy_row + L, g_x.to(goff_ptr.dtype.element_ty), mask=done)
                    if NEED_GIN:
                        wt, wb = pair_weights(ly, lx, mv)
                        scatter_pairs(gin_ptr, p00, cc, g3, wt, wb, v00, v01, v10, v11, W * PIX, PIX, scale, FIXED_GIN,
                                      PAIRS_OUTER)
    else:  # --- taps x offset groups x segments x channel chunks, each chunk's corners as pairs [BM, 1, 2, BK] ---
        # (the packed loop's helpers with one segment a chunk: grad_col leaves the MMA layout twice a chunk;
        # elementwise against 4 separately loaded corners, with 3 sums, Triton moved 10 [BM, BK] fp32 tiles
        # between layouts a chunk)
        for tap in range(tap_lo, tap_hi):
            y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            for og in range(G):
                ch = og * KK + tap
                p00, v00, v01, v10, v11, ly, lx, mv = sample_point(
                    off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
                p00, v00, v01, v10, v11 = p00[:, None], v00[:, None], v01[:, None], v10[:, None], v11[:, None]
                ly, lx, mv = ly[:, None], lx[:, None], mv[:, None]  # [BM, 1]: one segment
                wt, wb = pair_weights(ly, lx, mv)
                s00 = tl.zeros((BLOCK_M, 1), tl.float32)  # the pair_sums over all of the group's channels
                sdx = tl.zeros((BLOCK_M, 1), tl.float32)
                sdy = tl.zeros((BLOCK_M, 1), tl.float32)
                sdy1 = tl.zeros((BLOCK_M, 1), tl.float32)
                for s in range(COG // SEG):
                    c_lo = og * COG + s * SEG
                    gc = c_lo // CIN_G
                    w_row = ((gc * KK + tap) * CIN_G + (c_lo - gc * CIN_G)).to(tl.int64)
                    for c0 in range(0, SEG, BLOCK_K):
                        k_ok = c0 + offs_k < SEG
                        cc = (c_lo + c0 + offs_k).to(tl.int64)[None, :]
                        c_ok = None if EVEN_K else k_ok[None, :]
                        # --- grad_col [BM, BK] = grad_out[:, group gc] @ Wp[gc, tap, chunk]^T ---
                        gcol = _grad_col(go_ptr, go_row, go_res, w_ptr, w_row + c0, k_ok, gc, m_valid, COUT_G, go_sc,
                                         pid_m, L, GO_RESIDENT, TMA, PER_IMAGE, DOT_PRECISION, BLOCK_M, BLOCK_N,
                                         BLOCK_K)
                        # --- corner pairs, sums over channels, scatter ---
                        s00, sdx, sdy, sdy1 = segment_grads(
                            x_ptr, gin_ptr, p00, cc, tl.reshape(gcol, (BLOCK_M, 1, BLOCK_K)), wt, wb, v00, v01, v10,
                            v11, W * CIN, CIN, scale, s00, sdx, sdy, sdy1, NEED_GMSK or NEED_GOFF, NEED_GIN, FIXED_GIN,
                            PAIRS_OUTER, c_ok)
                # --- this (tap, offset group) is complete: store its offset and mask gradients ---
                store_point_grads(goff_ptr, gmsk_ptr, off_row, msk_row, ch, L, s00, sdx, sdy, sdy1, ly, lx, mv,
                                  m_valid, HAS_MASK, NEED_GOFF, NEED_GMSK)


# --- launcher ------------------------------------------------------------------------------------------


def _data_operands(run: Launch, wp: Tensor, go: Tensor) -> Tuple:
    """The weight and grad_out arguments of a launch: tensors, or with TMA descriptors (grad_out stays a tensor
    where it is resident)."""
    m = run.meta
    if not m["TMA"]:
        return wp, go
    go_op = go if m["GO_RESIDENT"] else grad_out_descriptor(go, m["PER_IMAGE"], m["BLOCK_M"], m["BLOCK_N"])
    return weight_descriptor(wp, m["BLOCK_K"], m["BLOCK_N"]), go_op


def run_grad_data(run: Launch, x: Tensor, off: Tensor, msk: Tensor, wp: Tensor, go: Tensor, gin: Tensor,
                  goff: Tensor, gmsk: Tensor, scale: Tensor) -> None:
    """Relaunch a planned grad_input/offset/mask launch (pointers not needed fall back to off: never touched)."""
    run(x, off, msk, *_data_operands(run, wp, go), gin, goff, gmsk, scale)


def launch_grad_data(geo: ConvGeometry, seg: int, args: tuple, meta: dict, cfg: Config, needs: Tuple[bool, bool, bool],
                     fixed: bool, x: Tensor, off: Tensor, msk: Tensor, wp: Tensor, go: Tensor, gin: Tensor,
                     goff: Tensor, gmsk: Tensor, scale: Tensor) -> Launch:
    """Plan and run the grad_input/offset/mask kernel with cfg. needs: (grad_input, grad_offset, grad_mask); fixed:
    deterministic mode (no TMA: its tiles are the default's); meta: the constexprs shared with grad_weight."""
    need_in, need_off, need_mask = needs
    dtype = x.dtype
    cout_g = geo.out_channels // geo.groups
    nseg = segments_per_chunk(geo, seg, cfg.block_k, "bwd_data")
    per_image = per_image_tiles(geo, cfg.block_m, "bwd_data", nseg)
    even_k = k_chunks_whole(geo, seg, cfg.block_k, "bwd_data")
    resident = go_resident(geo, cfg.block_n)
    # a resident grad_out tile is loaded once through pointers; the weight's come through TMA
    go_tma_ok = resident or grad_out_tma_ok(go, geo, cfg.block_n)
    tma = not fixed and go_tma_ok and tma_launch(cfg, dtype, even_k, [(wp, cout_g), (go, geo.out_channels)])
    data_meta = dict(meta, NSEG=nseg, NEED_GIN=need_in, NEED_GOFF=need_off, NEED_GMSK=need_mask, FIXED_GIN=fixed,
                     EVEN_K=even_k, PER_IMAGE=per_image, GO_RESIDENT=resident, TAP_SPLIT=cfg.split, TMA=tma,
                     PAIRS_OUTER=codegen_profile().pair_axis_outer, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, **cfg.launch_options())
    run = Launch(_deform_conv2d_bwd_data_kernel, (count_m_tiles(geo, cfg.block_m, per_image), cfg.split), args,
                 data_meta)
    run_grad_data(run, x, off, msk, wp, go, gin, goff, gmsk, scale)
    return run
