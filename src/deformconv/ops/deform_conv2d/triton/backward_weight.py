"""The grad_weight kernel (with grad_bias's sums where fused), and the pass that finishes both from partials.

    grad_weight[gc, k, n] = Σ_m A[m, k]·grad_out[m, gc·Cout_g + n], A re-sampled as in the forward, in fp32

Split over M: program (row, n, s) sums the M tiles s, s+SPLIT, ...; the SPLIT partial sums are added in a fixed
order by ``_finish_grads_kernel`` (which also unpacks them to the weight's layout and dtype), or, where one split
makes the sum final, the kernel stores grad_weight itself (schedule.direct_grad_weight).

A weight of a wider dtype than the input's (float32 beside float16/bfloat16: the eager path under autocast keeps it
so, ../eager.py) is used in the input's dtype, cast as it is packed; its gradient, and the bias's, are that cast's
gradient: the fp32 sums rounded to the input's dtype, then stored in the weight's (ROUND, grad_rounding). The result is
bit for bit that of casting the weight first, without the cast's two autograd nodes and kernels a call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....checks import ConvGeometry, suggest_memory_format
from ....compat import codegen_profile
from ....config import options
from ...common.launch import Launch, ceil_div, memoized, pointer_specs, pow2_clamp, remember, tma_launch
from ...common.sampling import (
    bilinear_weights,
    blend,
    blend_pairs,
    corner_pairs,
    load_corners,
    pair_weights,
    sample_point,
    segment_channels,
)
from .configs import Config
from .geometry import k_chunks_whole, per_image_tiles, segments_per_chunk, weight_rows
from .schedule import direct_grad_weight, fused_bias
from .tiles import (
    chunk_sample_points,
    grad_out_descriptor,
    grad_out_tile,
    grad_out_tma_ok,
    position_setup,
    tap_origin,
    tile_positions,
)

# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _rounded(acc, ROUND: tl.constexpr):
    """acc rounded to the 16-bit dtype the gradient is computed in (ROUND, grad_rounding: 0 none, 1 float16,
    2 bfloat16), still in fp32."""
    if ROUND == 1:
        acc = acc.to(tl.float16).to(tl.float32)
    elif ROUND == 2:
        acc = acc.to(tl.bfloat16).to(tl.float32)
    return acc


@triton.jit
def _grad_bias_rows(go_ptr, gb_ptr, gc, pid_n, pid_s, M, HO, WO, COUT_G, COUT, SPLIT, go_sn, go_sl, go_sc,
                    PER_IMAGE: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """grad_bias's share of a grad_weight program (conv group gc, N tile pid_n, split pid_s): the sum over this
    split's M tiles of grad_out's channels gc*Cout_g + pid_n*BLOCK_N.., in fp32, into the partials gb_ptr[pid_s, ...]
    ([SPLIT, Cout]). The same tiles, in the same order, as the grad_weight programs beside it read."""
    L = HO * WO
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COUT_G
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PER_IMAGE:
        m_tiles = (M // L) * tl.cdiv(L, BLOCK_M)
    else:
        m_tiles = tl.cdiv(M, BLOCK_M)
    for mb in range(pid_s, m_tiles, SPLIT):
        if TMA:
            go = grad_out_tile(go_ptr, mb, gc * COUT_G + pid_n * BLOCK_N, L, PER_IMAGE, BLOCK_M, BLOCK_N)
        else:
            m_valid, n_img, l32 = tile_positions(mb, M, L, PER_IMAGE, BLOCK_M)
            row = n_img * go_sn + l32.to(tl.int64) * go_sl
            cols = (gc * COUT_G + offs_n).to(tl.int64) * go_sc
            go = tl.load(go_ptr + row[:, None] + cols[None, :], mask=m_valid[:, None] & n_ok[None, :], other=0.0)
        acc += tl.sum(go.to(tl.float32), axis=0)
    tl.store(gb_ptr + pid_s.to(tl.int64) * COUT + gc * COUT_G + offs_n, acc, mask=n_ok)


@triton.jit
def _deform_conv2d_bwd_weight_kernel(
    # pointers
    x_ptr,        # input  NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read if HAS_MASK; logits: sampling.MASK_LOGITS)
    go_ptr,       # grad_out [N, Cout, Ho, Wo], strides below; if TMA a descriptor (grad_out_tile)
    gw_ptr,       # where the SPLIT sums go, strides below, cast to its dtype: fp32 partial sums [SPLIT, groups, KH*KW,
                  # Cin_g, Cout_g], or with SPLIT 1 grad_weight itself [Cout, Cin_g, KH, KW] in the weight's
                  # dtype and layout
    gb_ptr,       # grad_bias's fp32 partial sums [SPLIT, Cout] (written only with NEED_BIAS)
    # sizes
    H, W, CIN, HO, WO, M,
    CIN_G, COUT_G, COG, G, GROUPS, SPLIT,
    # geometry
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    # grad_out strides in elements: image, position, channel
    go_sn, go_sl, go_sc,
    # gw_ptr's strides in elements: split, conv group, tap row, tap column, input channel (of the group), output
    # channel (of the group)
    gw_ss, gw_sg, gw_sh, gw_sw, gw_si, gw_so,
    # meta
    KH: tl.constexpr, KW: tl.constexpr, SEG: tl.constexpr, HAS_MASK: tl.constexpr, EVEN_K: tl.constexpr,
    NSEG: tl.constexpr,           # segments per K chunk: 1, or BLOCK_K // SEG when segments are short
    DOT_PRECISION: tl.constexpr,
    PER_IMAGE: tl.constexpr,      # M tiles never cross an image (see position_setup)
    GROUPED: tl.constexpr,        # NSEG > 1 only: the input in the offset-grouped layout
    TMA: tl.constexpr,            # grad_out tiles through the descriptor go_ptr
    FMA_BLEND: tl.constexpr, PAIRS_OUTER: tl.constexpr,  # codegen spellings (compat.CodegenProfile)
    NEED_BIAS: tl.constexpr,      # GROUPS more rows of programs (the first) sum grad_out's channels for grad_bias
    ROUND: tl.constexpr,          # grad_weight itself (SPLIT 1) rounded first (_rounded); 0 for partial sums
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """grad_Wp[gc, k, n] = sum_m A[m, k] * grad_out[m, gc*Cout_g + n], A re-sampled as in the forward; with
    NEED_BIAS also grad_bias[gc*Cout_g + n] = sum_m grad_out[m, gc*Cout_g + n] (_grad_bias_rows). Split-M: program
    (row, n, s) sums the M tiles s, s+SPLIT, ...; the host sums the SPLIT partials in a fixed order. Grid:
    ([groups +] groups*KK*segments*K-chunks, N tiles, SPLIT)."""
    tl.static_assert(NSEG > 1 or not GROUPED, "the offset-grouped input layout is for packed segments")
    # --- which (conv group, tap, segment, channel chunk), which N tile, which split ---
    pid_row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if NEED_BIAS:  # the first GROUPS rows sum grad_bias: started first, they end before the weight rows' tail
        if pid_row < GROUPS:
            _grad_bias_rows(go_ptr, gb_ptr, pid_row, pid_n, pid_s, M, HO, WO, COUT_G, GROUPS * COUT_G, SPLIT,
                            go_sn, go_sl, go_sc, PER_IMAGE, TMA, BLOCK_M, BLOCK_N)
            return
        pid_row -= GROUPS
    KK: tl.constexpr = KH * KW
    if NSEG > 1:  # a chunk spans NSEG short segments of the group
        K_RUN = CIN_G
        n_seg = 1
    else:  # a chunk lies in one segment
        K_RUN = SEG
        n_seg = CIN_G // SEG
    n_kb = tl.cdiv(K_RUN, BLOCK_K)
    kb = pid_row % n_kb
    r = pid_row // n_kb
    s = r % n_seg
    r = r // n_seg
    tap = r % KK
    gc = r // KK
    c_lo = gc * CIN_G + s * SEG
    ch = (c_lo // COG) * KK + tap
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K_RUN
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COUT_G
    L = HO * WO
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    PIX = SEG if GROUPED else CIN  # the input's pixel and offset-group strides (see the forward)
    GS = tl.cast(H * W, tl.int64) * SEG if GROUPED else 0  # tl.cast: H, W may be constants (torch.compile)

    # --- M loop (this split's share) ---
    if PER_IMAGE:
        m_tiles = (M // L) * tl.cdiv(L, BLOCK_M)
    else:
        m_tiles = tl.cdiv(M, BLOCK_M)
    for mb in range(pid_s, m_tiles, SPLIT):
        m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = position_setup(
            mb, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK, PER_IMAGE, BLOCK_M)
        y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
        if NSEG > 1:
            offs_s = tl.arange(0, NSEG)
            c_first = c_lo + kb * BLOCK_K + offs_s * SEG
            p00, v00, v01, v10, v11, ly, lx, mv = chunk_sample_points(
                off_ptr, msk_ptr, off_row, msk_row, c_first, kb * BLOCK_K + offs_s * SEG < CIN_G, tap, COG, KK, L,
                y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK)
            top, bottom = corner_pairs(x_ptr, p00, segment_channels(c_first, GS, SEG, GROUPED), v00, v01, v10, v11,
                                       W * PIX, PIX, PAIRS_OUTER)
            wt, wb = pair_weights(ly, lx, mv)
            # A blended in fp32 here (docs/design.md, Precision)
            a = tl.reshape(blend_pairs(wt, wb, top.to(tl.float32), bottom.to(tl.float32)), (BLOCK_M, BLOCK_K))
        else:
            p00, v00, v01, v10, v11, ly, lx, mv = sample_point(
                off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
            c00, c01, c10, c11 = load_corners(x_ptr, p00, c_lo + offs_k, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K)
            w00, w01, w10, w11 = bilinear_weights(ly, lx, mv)
            a = blend(w00, w01, w10, w11,  # in fp32 (docs/design.md, Precision)
                      c00.to(tl.float32), c01.to(tl.float32), c10.to(tl.float32), c11.to(tl.float32), FMA_BLEND)
        if TMA:
            go = grad_out_tile(go_ptr, mb, gc * COUT_G + pid_n * BLOCK_N, L, PER_IMAGE, BLOCK_M, BLOCK_N)
        else:
            go_cols = (gc * COUT_G + offs_n).to(tl.int64) * go_sc
            go = tl.load(go_ptr + (n_img * go_sn + l * go_sl)[:, None] + go_cols[None, :],
                         mask=m_valid[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(a.to(go.dtype)), go, acc, input_precision=DOT_PRECISION)

    # --- store this split's sum (a partial, or grad_weight itself) ---
    rows = (gc.to(tl.int64) * gw_sg + (tap // KW) * gw_sh + (tap % KW) * gw_sw
            + (s * SEG + offs_k).to(tl.int64) * gw_si)
    dst = gw_ptr + pid_s.to(tl.int64) * gw_ss + rows[:, None] + offs_n.to(tl.int64)[None, :] * gw_so
    tl.store(dst, _rounded(acc, ROUND).to(gw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


@triton.jit
def _finish_grads_kernel(
    pw_ptr,       # fp32 [SPLIT_W, groups, KH*KW, Cin_g, Cout_g]: grad_weight's partial sums, packed (read if HAS_W)
    gw_ptr,       # grad_weight [Cout, Cin_g, KH, KW] in the weight's dtype, strides below (written if HAS_W)
    pb_ptr,       # fp32 [SPLIT_B, Cout]: grad_bias's partial sums (read if HAS_B)
    gb_ptr,       # grad_bias [Cout] in the weight's dtype (written if HAS_B)
    NUMEL_W, CIN_G, COUT_G, COUT, SPLIT_W, SPLIT_B,
    gw_so, gw_si, gw_sh, gw_sw,   # grad_weight's strides in elements: output channel, input channel, tap row, column
    KH: tl.constexpr, KW: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    ROUND: tl.constexpr,          # both sums rounded first (_rounded)
    BLOCK: tl.constexpr,          # grad_weight elements a program
    BLOCK_C: tl.constexpr,        # grad_bias channels a program
    ROWS: tl.constexpr,           # grad_bias partials summed a step (hundreds of them where a transpose made them)
):
    """The backward's last step, one launch: grad_weight = the sum of its SPLIT_W packed partials (in index order),
    unpacked to the weight's layout and cast to its dtype; grad_bias = the sum of its SPLIT_B partials (ROWS at a
    time, the steps in index order), cast. A fixed order: the same bits every run. Grid: (weight blocks if HAS_W +
    bias blocks if HAS_B,)."""
    pid = tl.program_id(0)
    if HAS_W:
        w_blocks = tl.cdiv(NUMEL_W, BLOCK)
        if pid < w_blocks:
            # --- grad_weight: read packed (coalesced), written in the weight's layout ---
            offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < NUMEL_W
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in range(SPLIT_W):
                acc += tl.load(pw_ptr + s * NUMEL_W + offs, mask=ok, other=0.0)
            o = offs % COUT_G
            r = offs // COUT_G
            i = r % CIN_G
            r = r // CIN_G
            tap = r % (KH * KW)
            gc = r // (KH * KW)
            dst = (gc * COUT_G + o) * gw_so + i * gw_si + (tap // KW) * gw_sh + (tap % KW) * gw_sw
            tl.store(gw_ptr + dst, _rounded(acc, ROUND).to(gw_ptr.dtype.element_ty), mask=ok)
        pid -= w_blocks
    if HAS_B:
        if pid >= 0:
            # --- grad_bias ---
            offs_c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
            c_ok = offs_c < COUT
            acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
            for r0 in range(0, SPLIT_B, ROWS):
                rows = r0 + tl.arange(0, ROWS)
                part = tl.load(pb_ptr + rows.to(tl.int64)[:, None] * COUT + offs_c[None, :],
                               mask=(rows < SPLIT_B)[:, None] & c_ok[None, :], other=0.0)
                acc += tl.sum(part, axis=0)
            tl.store(gb_ptr + offs_c, _rounded(acc, ROUND).to(gb_ptr.dtype.element_ty), mask=c_ok)


# --- launchers -----------------------------------------------------------------------------------------


def grad_weight_like(weight: Tensor) -> Tensor:
    """An empty grad_weight: the weight's shape, dtype and memory format."""
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device,
                       memory_format=suggest_memory_format(weight))


_ROUND_CODES = {torch.float16: 1, torch.bfloat16: 2}  # _rounded's ROUND


def grad_rounding(weight_dtype: torch.dtype, input_dtype: torch.dtype) -> int:
    """_rounded's ROUND for the gradient of a weight of weight_dtype used in input_dtype: the input's 16-bit dtype
    where the weight's differs (a wider one, which the kernels cast), else 0."""
    return 0 if weight_dtype == input_dtype else _ROUND_CODES.get(input_dtype, 0)


def finish_grads(weight: Tensor, pw: Optional[Tensor], pb: Optional[Tensor],
                 input_dtype: Optional[torch.dtype] = None, memo: Optional[dict] = None
                 ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(grad_weight, grad_bias) in the weight's dtype (grad_weight in its memory format) from fp32 partial sums, in one
    launch: pw [split, groups, kh*kw, Cin_g, Cout_g] (pack_weight's layout), pb [splits, Cout]; None for a missing
    one (and None returned for it). The partials' fixed-order sums, the inverse of pack_weight and the casts, in one
    pass instead of up to five operations. input_dtype (default: the weight's): rounded to it first where it differs
    (grad_rounding). memo: a dict kept by a caller that knows the call signature (the backward's), which holds the
    launch once there is one: no key built again."""
    cout, cin_g, kh, kw = weight.shape
    rounding = grad_rounding(weight.dtype, weight.dtype if input_dtype is None else input_dtype)
    gw = grad_weight_like(weight) if pw is not None else None
    gb = torch.empty((cout,), dtype=weight.dtype, device=weight.device) if pb is not None else None
    numel = weight.numel()
    split_w = pw.shape[0] if pw is not None else 0
    split_b = pb.shape[0] if pb is not None else 0
    strides = gw.stride() if gw is not None else (0, 0, 0, 0)
    fallback = pw if pw is not None else pb  # a pointer never read or written without its HAS_ flag
    if fallback is None or (numel == 0 and pb is None):  # nothing to write
        return gw, gb
    pointers = (pw if pw is not None else fallback, gw if gw is not None else fallback,
                pb if pb is not None else fallback, gb if gb is not None else fallback)
    run = memoized(memo, "finish",
                   lambda: _finish_launch(weight, pw, pb, rounding, strides, split_w, split_b, pointers))
    run(*pointers)
    return gw, gb


def _finish_launch(weight: Tensor, pw: Optional[Tensor], pb: Optional[Tensor], rounding: int, strides: tuple,
                   split_w: int, split_b: int, pointers: tuple) -> Launch:
    """finish_grads' launch for this signature."""
    cout, cin_g, kh, kw = weight.shape
    numel = weight.numel()
    key = (weight.device, weight.dtype, weight.shape, strides, split_w, split_b, pw is not None, pb is not None,
           rounding, pointer_specs(pointers))
    cache = options.cache("finishes")
    run = cache.get(key)
    if run is None:
        block, block_c = 1024, pow2_clamp(cout, 16, 64)
        w_blocks = ceil_div(numel, block) if pw is not None else 0
        b_blocks = ceil_div(cout, block_c) if pb is not None else 0
        cout_g = pw.shape[-1] if pw is not None else cout
        run = remember(cache, key, Launch(
            _finish_grads_kernel, (w_blocks + b_blocks,),
            (numel, cin_g, cout_g, cout, split_w, split_b, *strides),
            dict(KH=kh, KW=kw, HAS_W=pw is not None, HAS_B=pb is not None, ROUND=rounding, BLOCK=block,
                 BLOCK_C=block_c, ROWS=32, num_warps=4)))
    return run


def weight_targets(weight: Tensor, geo: ConvGeometry, split: int, whole: bool,
                   bias_rows: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """Where the grad_weight kernel writes: grad_weight itself where it is final (schedule.direct_grad_weight), else
    fp32 partial sums [split, groups, kh*kw, Cin_g, Cout_g]; and where it sums grad_bias (schedule.fused_bias: with
    bias_rows), grad_bias's fp32 partials [split, Cout], else None."""
    if direct_grad_weight(whole, split):
        return grad_weight_like(weight), None
    cin_g, cout_g = geo.in_channels // geo.groups, geo.out_channels // geo.groups
    gw = torch.empty((split, geo.groups, geo.taps, cin_g, cout_g), dtype=torch.float32, device=weight.device)
    if not fused_bias(bias_rows, split):
        return gw, None
    return gw, torch.empty((split, geo.out_channels), dtype=torch.float32, device=weight.device)


def _target_strides(gw: Tensor, geo: ConvGeometry) -> Tuple[int, ...]:
    """The kernel's gw_ss, gw_sg, gw_sh, gw_sw, gw_si, gw_so for weight_targets' gw."""
    if gw.dim() == 4:  # grad_weight [Cout, Cin_g, kh, kw]: one split
        so, si, sh, sw = gw.stride()
        return 0, (geo.out_channels // geo.groups) * so, sh, sw, si, so
    ss, sg, st, si, so = gw.stride()
    return ss, sg, geo.kernel_w * st, st, si, so


def run_grad_weight(run: Launch, x: Tensor, off: Tensor, msk: Tensor, go: Tensor,
                    targets: Tuple[Tensor, Optional[Tensor]]) -> None:
    """Relaunch a planned grad_weight launch into targets (weight_targets); gb_ptr falls back to gw, never written
    then."""
    m = run.meta
    go_op = grad_out_descriptor(go, m["PER_IMAGE"], m["BLOCK_M"], m["BLOCK_N"]) if m["TMA"] else go
    gw, gb = targets
    run(x, off, msk, go_op, gw, gb if gb is not None else gw)


def launch_grad_weight(geo: ConvGeometry, seg: int, args: tuple, meta: dict, cfg: Config, x: Tensor, off: Tensor,
                       msk: Tensor, go: Tensor, targets: Tuple[Tensor, Optional[Tensor]]) -> Launch:
    """Plan and run the grad_weight kernel with cfg into targets (weight_targets for cfg.split); meta: the
    constexprs shared with the grad_input kernel."""
    gw, gb = targets
    fuse = gb is not None  # grad_bias's partials exist where it is fused
    cout_g = geo.out_channels // geo.groups
    grid = (weight_rows(geo, seg, cfg.block_k) + (geo.groups if fuse else 0), ceil_div(cout_g, cfg.block_n),
            cfg.split)
    nseg = segments_per_chunk(geo, seg, cfg.block_k, "bwd_weight")
    # grad_out tiles through TMA (its chunks need not be whole: no weight tile here)
    tma = grad_out_tma_ok(go, geo, cfg.block_n) and tma_launch(cfg, x.dtype, True, [(go, geo.out_channels)])
    profile = codegen_profile()
    weight_meta = dict(meta, NSEG=nseg, EVEN_K=k_chunks_whole(geo, seg, cfg.block_k, "bwd_weight"), TMA=tma,
                       NEED_BIAS=fuse, PER_IMAGE=per_image_tiles(geo, cfg.block_m, "bwd_weight", nseg),
                       # the direct store (grad_weight itself, 4-D) rounds; partial sums (5-D) round when finished
                       ROUND=grad_rounding(gw.dtype, x.dtype) if gw.dim() == 4 else 0,
                       FMA_BLEND=profile.explicit_fma_blend, PAIRS_OUTER=profile.pair_axis_outer,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options())
    run = Launch(_deform_conv2d_bwd_weight_kernel, grid,
                 (*args[:10], geo.groups, cfg.split, *args[10:], *_target_strides(gw, geo)), weight_meta)
    run_grad_weight(run, x, off, msk, go, targets)
    return run
