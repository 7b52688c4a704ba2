"""Experiment: a warp-specialised deformable-conv forward in Gluon (Triton's explicit-layout dialect), Hopper only.

The question: does splitting the forward's work across warps -- gather warps that sample the input and write the A
tile into shared memory (and start the weight tile's TMA load), and a consumer warpgroup that only issues wgmma --
beat the product's software-pipelined Triton kernel, whose warps do both in turn and which Nsight found waiting on
gather latency at 1-2 CTAs per multiprocessor (benchmarks/NOTES.md, v8)? Answer (H200, fp16, v27 in NOTES.md,
benchmarks/results/h200-gluon-forward.json): it reaches parity, not more. The best variant ran at 1.00x the
product at det-s4, 1.01-1.03x at det-s5 and 0.99x at cls-14 (channels-last tensors, CUDA graph). Timed apart, the
gathers alone take 78-86% of the whole kernel's time, and the weight loads with the wgmma alone 37-49%. So the
forward is bound by its gathers (det-s4: 560 MB of corner loads in 0.124 ms), and overlapping the two cannot take it
far below the gathers' own time. Their rate follows the loads in flight: det-s5 in 512-wide tiles gathers half the
bytes, but two accumulators leave registers for 4 gather warps only, and it ran at 1.12x.

Scope (a prototype, not a backend): 16-bit NHWC input, groups = offset groups = 1, Cin a multiple of BLOCK_K, a mask,
finite offsets, an NHWC output [M, Cout]. Partitions (gl.warp_specialize), each walking the same tiles and steps (a step: one tap,
one chunk of BK input channels; step i of a program uses stage i % STAGES):

    consumer (default, 4 or 8 warps): acc[BM, BN] += A[s] @ B[s] (async wgmma, one group in flight); per tile the
                                      bias and the NHWC store
    gather   (NPART partitions of GATHER_WARPS warps; partition p takes the steps j % NPART == p):
                                      B[s] = packed weight rows [tap*Cin + c0 : +BK, n0 : +BN] through TMA;
                                      each row's sample point (offsets, mask, bilinear weights), the 4 corners
                                      [BM, BK] from the NHWC input, blended, stored as A[s]

    barriers of stage s: a_ready[s] (gather -> consumer), b_ready[s] (TMA bytes), empty[s] (consumer -> gathers)

    python benchmarks/experiments/gluon_forward.py [--shapes det-s4,cls-14] [--variants V,V] [--out FILE]

checks each variant against the float64 reference on random signed inputs (2 images) and times it beside the
product's forward and cuDNN's conv2d on the same channels-last tensors (CUDA-graph do_bench medians; variant names in
parse_variant). Needs an sm_90 GPU and a Triton with Gluon (built with 3.6 on the device and 3.8 here;
tests/test_experiments.py builds it for sm_90 without a GPU).
"""
import argparse
import json
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


# --- partitions ------------------------------------------------------------------------------------------------
# Every partition walks the same tiles (tile = program_id, program_id + programs, ...: one tile per program unless the
# grid is persistent) and the same steps; step i (counted over all of a program's tiles) uses stage i % STAGES.


@gluon.jit
def _consumer(run, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PART_ONLY: gl.constexpr,
              HALF: gl.constexpr, NSPLIT: gl.constexpr):
    """Per tile: acc [BM, BN] fp32 = sum over the steps of A[s] @ B[s] (one wgmma group stays in flight; a stage is
    handed back, empty, once the wgmma that read it has finished); then bias and the NHWC store. With NSPLIT 2 two
    consumers share each A tile, this one (HALF) taking columns HALF*BN .. of the tile's 2*BN. PART_ONLY 1 (a
    measurement, wrong results): no wgmma, the stages handed straight back (the gathers alone)."""
    a_bufs, b_bufs, a_ready, b_ready, empty, b_ptr, out_ptr, M, COUT, m_tiles, n_tiles, n_steps = run
    WM: gl.constexpr = min(gl.num_warps(), BLOCK_M // 16)  # warps along M (16 rows each), the rest split N
    WN: gl.constexpr = gl.num_warps() // WM
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                     instr_shape=[16, BLOCK_N // WN, 16])
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    g = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        for j in range(n_steps):
            i = g + j
            s = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(a_ready.index(s), phase)
            mbarrier.wait(b_ready.index(s), phase)
            if PART_ONLY != 1:
                b = b_bufs.index(s * NSPLIT + HALF)
                acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
                acc, _, _ = warpgroup_mma_wait(1, deps=(acc, a_bufs.index(s), b))
            # the previous step's wgmma is done: its stage may be refilled
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=j > 0)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((g + n_steps - 1) % STAGES))  # the tile's last stage
        g += n_steps
        # --- epilogue: bias, NHWC store (the gather warps are already on the next tile) ---
        val = gl.convert_layout(acc, out_l)
        rows = (tile % m_tiles) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_l))
        cols = ((tile // m_tiles) * NSPLIT + HALF) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_l))
        col_ok = cols < COUT
        val = val + gl.load(b_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * COUT + cols[None, :], val.to(out_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & col_ok[None, :])
    return (g,)  # a tuple: Triton 3.6's warp_specialize wants one from the default partition (3.8 takes either)


@gluon.jit
def _gather(run, KH: gl.constexpr, KW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, PART: gl.constexpr, NPART: gl.constexpr,
            BLEND16: gl.constexpr, CHUNK_MAJOR: gl.constexpr, PART_ONLY: gl.constexpr, NSPLIT: gl.constexpr):
    """A gather partition (one of NPART; of each tile's steps j = 0 .. KH*KW*(C // BK) - 1 it takes those with
    j % NPART == PART): once a step's stage is free, starts the weight tile's TMA load (rows tap*Cin + c0 .. of the
    packed [KH*KW*Cin, Cout] weight, NSPLIT blocks of BN columns; b_ready counts their bytes), then gathers and
    blends the A tile (in fp32, or with BLEND16 in the input's dtype) and signals a_ready. PART_ONLY 2 (a measurement, wrong results): no sampling and no
    corner loads, the A stage signalled as it is (the weight's TMA and the wgmma alone)."""
    x_ptr, off_ptr, msk_ptr, w_desc, a_bufs, b_bufs, a_ready, b_ready, empty, m_tiles, n_tiles = run[:11]
    H, W, C, HO, WO, M, SH, SW, PH, PW, DH, DW = run[11:]
    # --- layout: rows are output positions, columns a chunk of BK channels (8 a thread: 16-byte loads) ---
    TK: gl.constexpr = BLOCK_K // 8  # threads along a row of the tile
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TK, TK], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, blk)
    cols_l: gl.constexpr = gl.SliceLayout(0, blk)
    L = HO * WO
    offs_k = gl.arange(0, BLOCK_K, layout=cols_l)
    n_chunks = C // BLOCK_K
    n_steps = KH * KW * n_chunks
    g = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        # --- the tile's rows: image, position ---
        offs_m = (tile % m_tiles) * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
        n0 = (tile // m_tiles) * BLOCK_N * NSPLIT
        m_ok = offs_m < M
        n_img = offs_m // L
        l = offs_m % L
        ho = l // WO
        wo = l - ho * WO
        off_row = n_img.to(gl.int64) * (2 * KH * KW * L) + l
        msk_row = n_img.to(gl.int64) * (KH * KW * L) + l
        img_base = n_img.to(gl.int64) * H * W * C
        for j in range(PART, n_steps, NPART):
            if CHUNK_MAJOR:  # the taps of one chunk of channels in turn: the chunk's corners stay in L1 across taps
                tap = j % (KH * KW)
                c0 = (j // (KH * KW)) * BLOCK_K
            else:
                tap = j // n_chunks
                c0 = (j % n_chunks) * BLOCK_K
            i = g + j
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(b_ready.index(s), NSPLIT * w_desc.block_type.nbytes)
            for h in gl.static_range(NSPLIT):
                tma.async_copy_global_to_shared(w_desc, [tap * C + c0, n0 + h * BLOCK_N], b_ready.index(s),
                                                b_bufs.index(s * NSPLIT + h))
            if PART_ONLY != 2:
                # --- the tap's sample point per row: (dy, dx) offsets, mask, 4 corners and their weights ---
                dy = gl.load(off_ptr + off_row + (2 * tap) * L, mask=m_ok, other=0.0).to(gl.float32)
                dx = gl.load(off_ptr + off_row + (2 * tap + 1) * L, mask=m_ok, other=0.0).to(gl.float32)
                mk = gl.load(msk_ptr + msk_row + tap * L, mask=m_ok, other=0.0).to(gl.float32)
                y = (ho * SH - PH + (tap // KW) * DH).to(gl.float32) + dy
                x = (wo * SW - PW + (tap % KW) * DW).to(gl.float32) + dx
                y0f = gl.floor(y)
                x0f = gl.floor(x)
                ly = y - y0f
                lx = x - x0f
                y0 = y0f.to(gl.int32)
                x0 = x0f.to(gl.int32)
                inside = m_ok & (y > -1.0) & (y < H) & (x > -1.0) & (x < W)
                ok_y0 = inside & (y0 >= 0)
                ok_y1 = inside & (y0 + 1 < H)
                ok_x0 = x0 >= 0
                ok_x1 = x0 + 1 < W
                m00 = ok_y0 & ok_x0
                m01 = ok_y0 & ok_x1
                m10 = ok_y1 & ok_x0
                m11 = ok_y1 & ok_x1
                w00 = gl.where(m00, (1.0 - ly) * (1.0 - lx) * mk, 0.0)
                w01 = gl.where(m01, (1.0 - ly) * lx * mk, 0.0)
                w10 = gl.where(m10, ly * (1.0 - lx) * mk, 0.0)
                w11 = gl.where(m11, ly * lx * mk, 0.0)
                # --- the 4 corners [BM, BK], blended ---
                ptrs = x_ptr + ((img_base + (y0 * W + x0).to(gl.int64) * C + c0)[:, None] + offs_k[None, :])
                v00 = gl.load(ptrs, mask=m00[:, None], other=0.0)
                v01 = gl.load(ptrs + C, mask=m01[:, None], other=0.0)
                v10 = gl.load(ptrs + W * C, mask=m10[:, None], other=0.0)
                v11 = gl.load(ptrs + (W * C + C), mask=m11[:, None], other=0.0)
                if BLEND16:
                    dt = v00.dtype
                    a = (w00.to(dt)[:, None] * v00 + w01.to(dt)[:, None] * v01 + w10.to(dt)[:, None] * v10
                         + w11.to(dt)[:, None] * v11)
                else:
                    a = (w00[:, None] * v00.to(gl.float32) + w01[:, None] * v01.to(gl.float32)
                         + w10[:, None] * v10.to(gl.float32) + w11[:, None] * v11.to(gl.float32))
                a_bufs.index(s).store(a.to(a_bufs.dtype))
            fence_async_shared()
            mbarrier.arrive(a_ready.index(s))
        g += n_steps


@gluon.jit
def _deform_fwd_ws_kernel(
    x_ptr, off_ptr, msk_ptr, w_desc, b_ptr, out_ptr,
    H, W, C, HO, WO, M, COUT, SH, SW, PH, PW, DH, DW, m_tiles, n_tiles,
    KH: gl.constexpr, KW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr, NPART: gl.constexpr,
    BLEND16: gl.constexpr, CHUNK_MAJOR: gl.constexpr, PART_ONLY: gl.constexpr = 0, NSPLIT: gl.constexpr = 1,
    CONSUMER_REGS: gl.constexpr = 0,
):
    """out [M, Cout] (NHWC) = deformable conv of x [N, H, W, C] (NHWC) with offsets [N, 2*KH*KW, Ho, Wo], mask
    [N, KH*KW, Ho, Wo] and the packed weight [KH*KW*C, Cout] (w_desc, blocks [BK, BN]), plus bias. Tiles: m_tiles
    of BM output positions times Cout / (NSPLIT*BN); a program takes tiles program_id, program_id + programs, ...
    With NSPLIT 2 a second consumer partition (num_warps warps, CONSUMER_REGS registers) takes the tile's second BN
    columns: the tile is 2*BN wide and gathered once (one gather partition)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(2 * BLOCK_K, 128), element_bitwidth=16,
                                                  rank=2)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * NSPLIT, BLOCK_K, BLOCK_N], w_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(s), count=1)
        mbarrier.init(b_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=NSPLIT)
    n_steps = KH * KW * (C // BLOCK_K)
    # the partitions' runtime arguments as tuples, their constexprs written into each list (argument tuples joined
    # with + lost them: a plain int that warp_specialize cannot pass on); one list per partition count
    crun = (a_bufs, b_bufs, a_ready, b_ready, empty, b_ptr, out_ptr, M, COUT, m_tiles, n_tiles, n_steps)
    grun = (x_ptr, off_ptr, msk_ptr, w_desc, a_bufs, b_bufs, a_ready, b_ready, empty, m_tiles, n_tiles,
            H, W, C, HO, WO, M, SH, SW, PH, PW, DH, DW)
    if NSPLIT == 2:
        gl.static_assert(NPART == 1, "two consumers leave room for one gather partition")
        gl.warp_specialize([
            (_consumer, (crun, BLOCK_M, BLOCK_N, STAGES, PART_ONLY, 0, 2)),
            (_consumer, (crun, BLOCK_M, BLOCK_N, STAGES, PART_ONLY, 1, 2)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 1, BLEND16, CHUNK_MAJOR, PART_ONLY, 2)),
        ], [gl.num_warps(), GATHER_WARPS], [CONSUMER_REGS, GATHER_REGS])
    elif NPART == 1:
        gl.warp_specialize([
            (_consumer, (crun, BLOCK_M, BLOCK_N, STAGES, PART_ONLY, 0, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 1, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
        ], [GATHER_WARPS], [GATHER_REGS])
    elif NPART == 2:
        gl.warp_specialize([
            (_consumer, (crun, BLOCK_M, BLOCK_N, STAGES, PART_ONLY, 0, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 2, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 1, 2, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
        ], [GATHER_WARPS] * 2, [GATHER_REGS] * 2)
    else:
        gl.static_assert(NPART == 3, "1 to 3 gather partitions")
        gl.warp_specialize([
            (_consumer, (crun, BLOCK_M, BLOCK_N, STAGES, PART_ONLY, 0, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 0, 3, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 1, 3, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
            (_gather, (grun, KH, KW, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, 2, 3, BLEND16, CHUNK_MAJOR, PART_ONLY, 1)),
        ], [GATHER_WARPS] * 3, [GATHER_REGS] * 3)


# --- launcher --------------------------------------------------------------------------------------------------


# the weight tiles' shared-memory layout (128-byte swizzle, 16-bit), in the TMA descriptor and its signature
W_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def packed_weight(weight):
    """[Cout, Cin, kh, kw] -> [kh*kw*Cin, Cout] (tap-major rows, as the product's pack for groups = 1)."""
    cout, cin, kh, kw = weight.shape
    return weight.permute(2, 3, 1, 0).reshape(kh * kw * cin, cout).contiguous()


def forward(x_nhwc, offset, mask, wp, bias, kh, kw, stride=1, padding=1, dilation=1, block_m=64, block_n=256,
            block_k=64, stages=4, gather_warps=4, gather_regs=128, consumer_warps=4, out=None, npart=2, blend16=True,
            chunk_major=True, persistent=0, part_only=0, nsplit=1, consumer_regs=0):
    """x_nhwc [N, H, W, C] (a contiguous NHWC view), offset [N, 2*kh*kw, Ho, Wo], mask [N, kh*kw, Ho, Wo], wp the
    packed weight [kh*kw*C, Cout] (packed_weight), bias [Cout]; returns out [N, Ho, Wo, Cout] (NHWC). block_n is the
    tile's width: with nsplit 2, two consumers take half of it each."""
    n, h, w, c = x_nhwc.shape
    cout = wp.shape[1]
    ho = (h + 2 * padding - dilation * (kh - 1) - 1) // stride + 1
    wo = (w + 2 * padding - dilation * (kw - 1) - 1) // stride + 1
    assert c % block_k == 0 and offset.shape[1] == 2 * kh * kw
    m = n * ho * wo
    if out is None:
        out = torch.empty((n, ho, wo, cout), dtype=x_nhwc.dtype, device=x_nhwc.device)
    w_desc = TensorDescriptor(wp, list(wp.shape), list(wp.stride()), [block_k, block_n // nsplit], W_LAYOUT)
    m_tiles = triton.cdiv(m, block_m)
    n_tiles = m_tiles * triton.cdiv(cout, block_n)
    grid = (min(n_tiles, persistent) if persistent else n_tiles,)
    _deform_fwd_ws_kernel[grid](x_nhwc, offset, mask, w_desc, bias, out, h, w, c, ho, wo, m, cout,
                                stride, stride, padding, padding, dilation, dilation, m_tiles, n_tiles,
                                kh, kw, block_m, block_n // nsplit, block_k, stages, gather_warps, gather_regs, npart,
                                blend16, chunk_major, part_only, nsplit, consumer_regs, num_warps=consumer_warps)
    return out


# --- variants, a build without a GPU, check and time --------------------------------------------------------

SMS = 132  # multiprocessors for the persistent grid ('p'): the H200's; main() reads the GPU's


def parse_variant(v: str) -> dict:
    """'BMxBNxBK:gather warps:stages[:gather partitions[:consumer warps[:gather registers[:flags]]]]'; flags: '16'
    blends in the input's dtype, 'c' takes the steps chunk-major (all taps of a chunk of channels in turn), 'p' makes
    the grid persistent (one program a multiprocessor), 's' splits the tile's BN columns over two consumer
    partitions (one gather partition; the second consumer gets what the gathers leave of the registers); 'g' times
    the gathers alone, 'm' the weight loads and wgmma alone (measurements: wrong results, not checked)."""
    f = v.split(":")
    bm, bn, bk = (int(t) for t in f[0].split("x"))
    gw, st = int(f[1]), int(f[2])
    npart = int(f[3]) if len(f) > 3 else 1
    cw = int(f[4]) if len(f) > 4 else 4
    regs = int(f[5]) if len(f) > 5 else (152 if gw == 4 and npart == 1 else 128)
    return dict(block_m=bm, block_n=bn, block_k=bk, stages=st, gather_warps=gw, npart=npart, consumer_warps=cw,
                gather_regs=regs, blend16=len(f) > 6 and "16" in f[6], chunk_major=len(f) > 6 and "c" in f[6],
                persistent=SMS if len(f) > 6 and "p" in f[6] else 0,
                part_only=(1 if "g" in f[6] else 2 if "m" in f[6] else 0) if len(f) > 6 else 0,
                nsplit=2 if len(f) > 6 and "s" in f[6] else 1, consumer_regs=(512 - regs) // 2 // 8 * 8)


def compile_sm90(variant: str, c: int = 256, cout: int = 256):
    """Build the kernel of a variant for sm_90 without a GPU (Triton's own ptxas, through ptx_summary.compile_kernel),
    as a 3x3 det-s4-like layer with c input and cout output channels would launch it; returns Triton's compiled kernel
    (asm: ttgir, ptx, cubin)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from ptx_summary import compile_kernel

    kv = parse_variant(variant)
    h, w, n = 50, 76, 8
    m = n * h * w
    tiles = triton.cdiv(m, kv["block_m"]) * triton.cdiv(cout, kv["block_n"])
    block_n = kv["block_n"] // kv["nsplit"]  # the kernel's BLOCK_N: one consumer's columns
    ints = dict(H=h, W=w, C=c, HO=h, WO=w, M=m, COUT=cout, SH=1, SW=1, PH=1, PW=1, DH=1, DW=1,
                m_tiles=triton.cdiv(m, kv["block_m"]), n_tiles=tiles)
    const = dict(KH=3, KW=3, BLOCK_M=kv["block_m"], BLOCK_N=block_n, BLOCK_K=kv["block_k"],
                 STAGES=kv["stages"], GATHER_WARPS=kv["gather_warps"], GATHER_REGS=kv["gather_regs"],
                 NPART=kv["npart"], BLEND16=kv["blend16"], CHUNK_MAJOR=kv["chunk_major"], PART_ONLY=kv["part_only"],
                 NSPLIT=kv["nsplit"], CONSUMER_REGS=kv["consumer_regs"])
    pointers = {name: "*fp16" for name in ("x_ptr", "off_ptr", "msk_ptr", "b_ptr", "out_ptr")}
    pointers["w_desc"] = f"tensordesc<fp16[{kv['block_k']}, {block_n}],{W_LAYOUT!r}>"
    return compile_kernel(_deform_fwd_ws_kernel, pointers, const, ints, kv["consumer_warps"], source=GluonASTSource)


SHAPES = {  # name: (N, Cin, Cout, H, W, k) -- the benchmark's det/cls shapes (offset groups 1)
    "det-s3": (8, 128, 128, 100, 152, 3),
    "det-s4": (8, 256, 256, 50, 76, 3),
    "det-s5": (8, 512, 512, 25, 38, 3),
    "cls-14": (64, 256, 256, 14, 14, 3),
}


def main(argv=None):
    import deformconv
    from common import graph_ms  # here, not at import: compile_sm90 builds without torch (a stub will do)
    from deformconv.ops.reference import deform_conv2d_forward as reference

    global SMS
    SMS = torch.cuda.get_device_properties(0).multi_processor_count  # the persistent grid ('p') on this GPU
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="det-s4,det-s5,cls-14,det-s3")
    # the best of v27's runs, and the two bounds of the first (gathers alone, weight loads and wgmma alone)
    p.add_argument("--variants", default="64x256x32:4:8:3:8:96:16cp,64x256x64:4:4:2:4:128:16cp,"
                                         "64x256x32:4:8:3:8:96:16cpg,64x256x32:4:8:3:8:96:16cpm")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        n, cin, cout, h, w, k = SHAPES[name]
        dt = torch.float16
        x = torch.randn(n, cin, h, w, device="cuda", dtype=dt).contiguous(memory_format=torch.channels_last)
        off = (2 * torch.randn(n, 2 * k * k, h, w, device="cuda")).to(dt)
        msk = torch.rand(n, k * k, h, w, device="cuda").to(dt)
        wt = (torch.randn(cout, cin, k, k, device="cuda") / (cin * k * k) ** 0.5).to(dt)
        b = torch.randn(cout, device="cuda").to(dt)
        ref = reference(x[:2].double(), off[:2].double(), wt.double(), b.double(), msk[:2].double(), (1, 1), (1, 1),
                        (1, 1))
        prod = lambda: deformconv.deform_conv2d(x, off, wt, b, padding=1, mask=msk)  # noqa: E731
        t_prod = graph_ms(prod)
        err_prod = (prod()[:2].double() - ref).abs().max().item()
        rows.append(dict(shape=name, variant="product", ms=t_prod, max_err=err_prod))
        print(f"{name:8s} product            {t_prod:.4f} ms  err {err_prod:.2e}", flush=True)
        torch.backends.cudnn.benchmark = True
        t_conv = graph_ms(lambda: torch.nn.functional.conv2d(x, wt, b, padding=k // 2))
        rows.append(dict(shape=name, variant="conv2d", ms=t_conv, max_err=0.0))
        print(f"{name:8s} conv2d (cuDNN)     {t_conv:.4f} ms", flush=True)
        wp = packed_weight(wt)
        xn = x.permute(0, 2, 3, 1)  # channels-last storage: a contiguous NHWC view
        for v in args.variants.split(","):
            kw_ = parse_variant(v)
            try:
                out = torch.full((n, h, w, cout), float("nan"), device="cuda", dtype=dt)
                out = forward(xn, off, msk, wp, b, k, k, out=out, **kw_)
                torch.cuda.synchronize()
                err = (out[:2].permute(0, 3, 1, 2).double() - ref).abs().max().item()
                t = graph_ms(lambda: forward(xn, off, msk, wp, b, k, k, **kw_))
            except Exception as e:  # a variant that does not compile or launch: say so, go on
                print(f"{name:8s} {v:18s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(shape=name, variant=v, error=str(e)[:300]))
                continue
            rows.append(dict(shape=name, variant=v, ms=t, max_err=err))
            assert kw_["part_only"] or (err == err and err < 1e-2), f"{name} {v}: max error {err}"
            print(f"{name:8s} {v:18s} {t:.4f} ms  err {err:.2e}  vs product {t / t_prod:.3f}", flush=True)
        t_again = graph_ms(prod)  # the product once more: drift over the shape's runs
        rows.append(dict(shape=name, variant="product again", ms=t_again, max_err=err_prod))
        print(f"{name:8s} product again      {t_again:.4f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
    print("\nshape    variant            ms       vs product  max err")
    base = {r["shape"]: r["ms"] for r in rows if r["variant"] == "product"}
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:8s} {r['variant']:18s} {r['ms']:.4f}   {r['ms'] / base[r['shape']]:.3f}      "
                  f"{r['max_err']:.2e}")


if __name__ == "__main__":
    sys.exit(main())
