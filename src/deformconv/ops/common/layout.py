"""Layout kernels and their launchers: the copies between torch's layouts and the ones the kernels read.

The convolution kernels read an image channels-last (NHWC: a bilinear corner is a contiguous run of channels),
or offset-grouped ([N, G, H, W, C/G]: where each offset group has few channels, a pair of neighbouring corners
is one run). An NCHW tensor gets there in one transpose pass (``_transpose_kernel``: 64x64 tiles through shared
memory), which can zero an accumulator of the same size and sum the tensor's channels on the way; two passes can
share one launch. On CUDA these are Triton kernels (fewer launches than torch's copies); on the CPU torch's
copies (much faster under Triton's interpreter) unless ``options.layout_kernels_on_cpu``.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...config import options
from .launch import Launch, aligned16, ceil_div, memoized, pow2_clamp, remember

# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def tile_of(t, TILES_X, TILES_Y):
    """A flat program index t of a fused layout launch as its (x tile, y tile, z int64): x fastest, then y."""
    return t % TILES_X, (t // TILES_X) % TILES_Y, (t // (TILES_X * TILES_Y)).to(tl.int64)


@triton.jit
def transpose_tile(src_ptr, dst_ptr, zero_ptr, sum_ptr, A, B, pid_a, pid_b, n, tiles_b,
                    ZERO: tl.constexpr, SUM: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """_transpose_kernel's tile (pid_a, pid_b) of image n (int64); tiles_b: the B tiles an image."""
    offs_a = pid_a * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    ok = (offs_a < A)[:, None] & (offs_b < B)[None, :]
    tile = tl.load(src_ptr + n * A * B + offs_a[:, None] * B + offs_b[None, :], mask=ok, other=0.0)
    dst = n * A * B + offs_b[None, :] * A + offs_a[:, None]
    tl.store(dst_ptr + dst, tile.to(dst_ptr.dtype.element_ty), mask=ok)
    if ZERO:
        tl.store(zero_ptr + dst, tl.zeros((BLOCK_A, BLOCK_B), dtype=zero_ptr.dtype.element_ty), mask=ok)
    if SUM:
        part = (n * tiles_b + pid_b) * A
        tl.store(sum_ptr + part + offs_a, tl.sum(tile.to(tl.float32), axis=1), mask=offs_a < A)


@triton.jit
def _transpose_kernel(
    src_ptr,      # [N, A, B] contiguous
    dst_ptr,      # [N, B, A] contiguous (cast to its dtype on store)
    zero_ptr,     # [N, B, A] contiguous, any dtype: set to zero beside dst (written only with ZERO)
    sum_ptr,      # fp32 [N, B tiles, A]: each program's sums over its B range (written only with SUM)
    A, B,
    ZERO: tl.constexpr, SUM: tl.constexpr,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """dst[n, b, a] = src[n, a, b]: NCHW <-> NHWC in one pass (with a dtype cast). On the way, with ZERO, a buffer of
    dst's shape is zeroed (the backward's grad_input accumulator, beside the input's copy), and with SUM src is summed
    over b in fp32 (grad_bias's partials, from grad_out's copy). Grid: (A tiles, B tiles, N)."""
    transpose_tile(src_ptr, dst_ptr, zero_ptr, sum_ptr, A, B, tl.program_id(0), tl.program_id(1),
                    tl.program_id(2).to(tl.int64), tl.num_programs(1), ZERO, SUM, BLOCK_A, BLOCK_B)


@triton.jit
def _transpose_pair_kernel(
    src1_ptr, dst1_ptr, zero1_ptr, sum1_ptr,  # the first transpose's tensors (see _transpose_kernel)
    src2_ptr, dst2_ptr, zero2_ptr, sum2_ptr,  # the second's
    A1, B1, TILES_A1, TILES_B1, PROGRAMS1,    # the first's sizes (src viewed [images, A1, B1]), tiles, programs
    A2, B2, TILES_A2, TILES_B2,               # the second's sizes and tiles
    ZERO1: tl.constexpr, SUM1: tl.constexpr, BLOCK_A1: tl.constexpr, BLOCK_B1: tl.constexpr,
    ZERO2: tl.constexpr, SUM2: tl.constexpr, BLOCK_A2: tl.constexpr, BLOCK_B2: tl.constexpr,
):
    """Two _transpose_kernel passes in one launch (the backward's grad_out and input copies): programs [0, PROGRAMS1)
    do the first (PROGRAMS1 = TILES_A1 * TILES_B1 * its images), the rest the second. Grid: (all programs,)."""
    pid = tl.program_id(0)
    if pid < PROGRAMS1:
        pid_a, pid_b, n = tile_of(pid, TILES_A1, TILES_B1)
        transpose_tile(src1_ptr, dst1_ptr, zero1_ptr, sum1_ptr, A1, B1, pid_a, pid_b, n, TILES_B1, ZERO1, SUM1,
                        BLOCK_A1, BLOCK_B1)
    else:
        pid_a, pid_b, n = tile_of(pid - PROGRAMS1, TILES_A2, TILES_B2)
        transpose_tile(src2_ptr, dst2_ptr, zero2_ptr, sum2_ptr, A2, B2, pid_a, pid_b, n, TILES_B2, ZERO2, SUM2,
                        BLOCK_A2, BLOCK_B2)


@triton.jit
def _channel_sum_kernel(
    src_ptr,      # [N, C, L] with the strides below (an NCHW or channels-last [N, C, H, W] tensor, L = H*W)
    part_ptr,     # [N, L tiles, C] fp32: one partial sum per program
    L, C,
    s_n, s_l, s_c,            # src strides in elements: image, position, channel
    ROWS: tl.constexpr,       # positions per program (a multiple of BLOCK_P)
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """part[n, i, c] = sum of src[n, c, l] over the ROWS positions l of program (i, n), in fp32: grad_bias in
    either memory format, without the fp32 staging copies torch's reduction makes of a channels-last tensor
    (4x its size, measured). Grid: (L tiles, C tiles, N)."""
    pid_p = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = tl.program_id(2).to(tl.int64)
    c_ok = offs_c < C
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_P):
        offs_p = pid_p * ROWS + r + tl.arange(0, BLOCK_P)
        ptrs = src_ptr + n * s_n + offs_p.to(tl.int64)[:, None] * s_l + offs_c.to(tl.int64)[None, :] * s_c
        acc += tl.sum(tl.load(ptrs, mask=(offs_p < L)[:, None] & c_ok[None, :], other=0.0).to(tl.float32), 0)
    tl.store(part_ptr + (n * tl.num_programs(0) + pid_p) * C + offs_c, acc, mask=c_ok)


# --- launchers -----------------------------------------------------------------------------------------


def transpose_blocks(a: int, b: int) -> Tuple[int, int]:
    """_transpose_kernel's (BLOCK_A, BLOCK_B): 64 x 64 tiles; a short side (the few channels of an offset group) gets
    its own size, the other the rest."""
    block_a = pow2_clamp(a, 8, 64) if b >= a else 4096 // pow2_clamp(b, 8, 64)
    return block_a, 4096 // block_a


def transpose_tiles(a: int, b: int) -> Tuple[int, int, int, int]:
    """An [a, b] -> [b, a] pass's (BLOCK_A, BLOCK_B, tiles along a, tiles along b): see transpose_blocks."""
    block_a, block_b = transpose_blocks(a, b)
    return block_a, block_b, ceil_div(a, block_a), ceil_div(b, block_b)


def _transpose_key(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor], sums: Optional[Tensor]) -> tuple:
    """What a transpose pass's launch is specialised on (beside the device): dtypes, images, sizes, 16-byte
    alignments, and which extras (zero, sums) it has."""
    extras = tuple((t.dtype, aligned16(t)) if t is not None else None for t in (zero, sums))
    return (src.dtype, out.dtype, src.shape[0], a, b, aligned16(src), aligned16(out), extras)


def _transpose_tensors(src: Tensor, out: Tensor, zero: Optional[Tensor], sums: Optional[Tensor]) -> List[Tensor]:
    """A transpose pass's pointer arguments (src, dst, zero, sums): a missing extra falls back to out, never written."""
    return [src, out, zero if zero is not None else out, sums if sums is not None else out]


def transpose_last(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor] = None,
                    sums: Optional[Tensor] = None, jobs: Optional[list] = None) -> Tensor:
    """out (viewed [N, b, a]) = src (viewed [N, a, b]) transposed, with out's dtype. zero: a tensor of out's size
    zeroed in the same pass; sums: fp32 [N, cdiv(b, BLOCK_B), a] that receives src's sums over b by tiles
    (transpose_sum_rows). jobs: a list that receives the pass instead, for run_transposes."""
    if jobs is not None:
        jobs.append((src, a, b, out, zero, sums))
        return out
    return _transpose_one(src, a, b, out, zero, sums)


def _transpose_one(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor],
                   sums: Optional[Tensor], memo: Optional[dict] = None) -> Tensor:
    """transpose_last's pass: one _transpose_kernel launch. memo: see run_transposes."""
    run = memoized(memo, "transpose", lambda: _one_launch(src, a, b, out, zero, sums))
    run(*_transpose_tensors(src, out, zero, sums))
    return out


def _one_launch(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor], sums: Optional[Tensor]) -> Launch:
    """_transpose_one's launch for this pass's signature."""
    key = (src.device, _transpose_key(src, a, b, out, zero, sums))
    cache = options.cache("transposes")
    run = cache.get(key)
    if run is None:
        block_a, block_b, tiles_a, tiles_b = transpose_tiles(a, b)
        run = remember(cache, key, Launch(_transpose_kernel, (tiles_a, tiles_b, src.shape[0]), (a, b),
                                          dict(ZERO=zero is not None, SUM=sums is not None, BLOCK_A=block_a,
                                               BLOCK_B=block_b, num_warps=4)))
    return run


def run_transposes(jobs: list, memo: Optional[dict] = None) -> None:
    """Run the passes transpose_last collected in jobs: two in one launch (each launch costs host time: tens of
    microseconds), else one by one (or with options.paired_transposes off). memo: a dict kept by a caller that knows
    the jobs' signature (the backward's), which holds the pair's launch once there is one: no key built again."""
    if len(jobs) == 2 and options.paired_transposes:
        _transpose_pair(*jobs, memo=memo)
    else:
        for job in jobs:
            _transpose_one(*job)
    jobs.clear()


def _transpose_pair(first: tuple, second: tuple, memo: Optional[dict] = None) -> None:
    """transpose_last's two passes (src, a, b, out, zero, sums) in one _transpose_pair_kernel launch."""
    run = memoized(memo, "transpose_pair", lambda: _pair_launch(first, second))
    src1, _, _, out1, zero1, sums1 = first
    src2, _, _, out2, zero2, sums2 = second
    run(*_transpose_tensors(src1, out1, zero1, sums1), *_transpose_tensors(src2, out2, zero2, sums2))


def _pair_launch(first: tuple, second: tuple) -> Launch:
    """_transpose_pair's launch for these two passes' signature."""
    key = (first[0].device, _transpose_key(*first), _transpose_key(*second))
    cache = options.cache("transpose_pairs")
    run = cache.get(key)
    if run is None:
        sizes, meta = [], dict(num_warps=4)
        for i, (src, a, b, out, zero, sums) in enumerate((first, second), 1):
            block_a, block_b, tiles_a, tiles_b = transpose_tiles(a, b)
            sizes.append((a, b, tiles_a, tiles_b, tiles_a * tiles_b * src.shape[0]))
            meta.update({f"ZERO{i}": zero is not None, f"SUM{i}": sums is not None, f"BLOCK_A{i}": block_a,
                         f"BLOCK_B{i}": block_b})
        grid = (sizes[0][4] + sizes[1][4],)
        run = remember(cache, key, Launch(_transpose_pair_kernel, grid, (*sizes[0], *sizes[1][:4]), meta))
    return run


@functools.lru_cache(maxsize=256)
def transpose_sum_rows(a: int, b: int) -> int:
    """Rows of sums per image that transpose_last writes for an [a, b] -> [b, a] transpose."""
    return ceil_div(b, transpose_blocks(a, b)[1])


def channel_sum(t: Tensor) -> Tensor:
    """Partial sums over N, H, W of an [N, C, H, W] tensor (NCHW or channels-last): [P, C] fp32, one row per program
    (P = N * position tiles), for finish_grads to add in a fixed order."""
    if not t.is_contiguous(memory_format=torch.channels_last):
        t = t.contiguous()
    n, c, h, w = t.shape
    rows, block_c = 256, pow2_clamp(c, 1, 128)
    part = torch.empty((n, ceil_div(h * w, rows), c), dtype=torch.float32, device=t.device)
    if part.numel():
        # image, position l = h*W + w (a size-1 dim's stride is arbitrary: W = 1 steps along H), channel
        strides = (t.stride(0), t.stride(3) if w > 1 else t.stride(2), t.stride(1))
        key = (t.device, t.dtype, n, h * w, c, strides, aligned16(t))
        cache = options.cache("channel_sums")
        run = cache.get(key)
        if run is None:
            grid = (part.shape[1], ceil_div(c, block_c), n)
            run = remember(cache, key, Launch(_channel_sum_kernel, grid, (h * w, c, *strides),
                                                        dict(ROWS=rows, BLOCK_P=32, BLOCK_C=block_c, num_warps=4)))
        run(t, part)
    return part.view(-1, c)


def uses_layout_kernel(t: Tensor) -> bool:
    """Whether a layout copy of t goes through a Triton kernel (_transpose_kernel, _pack_weight_kernel): a non-empty
    tensor on CUDA, or on the CPU with options.layout_kernels_on_cpu."""
    return (t.is_cuda or options.layout_kernels_on_cpu) and t.numel() > 0  # is_cuda: no device object a call


def _nhwc_pass(t: Tensor) -> bool:
    """Whether to_nhwc copies t in a transpose pass (not channels_last already, and uses_layout_kernel)."""
    return not t.is_contiguous(memory_format=torch.channels_last) and uses_layout_kernel(t)


def to_nhwc(t: Tensor, zero: Optional[Tensor] = None, sums: Optional[Tensor] = None,
          jobs: Optional[list] = None) -> Tensor:
    """The tensor's data in NHWC order: itself if channels_last already, else one transpose pass. zero: a tensor of
    t's size to zero, in that pass where there is one (else zeroed here); sums: see to_nhwc_summed (pass only); jobs:
    see transpose_last (the copy is then written when they run)."""
    if not _nhwc_pass(t):
        if zero is not None:
            zero.zero_()
        return t.contiguous(memory_format=torch.channels_last)
    t = t.contiguous()
    n, c, h, w = t.shape
    out = torch.empty_like(t, memory_format=torch.channels_last)
    return transpose_last(t, c, h * w, out, zero, sums, jobs)


def to_nhwc_summed(t: Tensor, jobs: Optional[list] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(to_nhwc(t), and where that is a transpose pass, t's fp32 channel sums by tiles of positions from the same pass,
    [N * tiles, C], for finish_grads; else None). jobs: see to_nhwc."""
    if not _nhwc_pass(t):
        return to_nhwc(t), None
    n, c, h, w = t.shape
    sums = torch.empty((n, transpose_sum_rows(c, h * w), c), dtype=torch.float32, device=t.device)
    return to_nhwc(t, sums=sums, jobs=jobs), sums.view(-1, c)


def to_offset_grouped(t: Tensor, offset_groups: int, zero: Optional[Tensor] = None,
                    jobs: Optional[list] = None) -> Tensor:
    """The tensor's data as [N, G, H, W, C/G] (each offset group's channels of a pixel contiguous, pixels of
    one group contiguous): one transpose pass from NCHW, a permuting copy from channels_last. zero: a tensor of t's
    size to zero, in that pass where there is one; jobs: see to_nhwc."""
    n, c, h, w = t.shape
    cog = c // offset_groups
    if t.is_contiguous() and uses_layout_kernel(t):
        out = offset_grouped_empty(t, offset_groups)
        transpose_last(t.view(n * offset_groups, cog, h * w), cog, h * w, out.view(n * offset_groups, h * w, cog),
                        zero, jobs=jobs)
        return out
    if zero is not None:
        zero.zero_()
    return t.permute(0, 2, 3, 1).reshape(n, h, w, offset_groups, cog).permute(0, 3, 1, 2, 4).contiguous()


def offset_grouped_empty(t: Tensor, offset_groups: int) -> Tensor:
    """An empty [N, G, H, W, C/G] buffer for t's data in the offset-grouped layout (t's dtype and device)."""
    n, c, h, w = t.shape
    return torch.empty((n, offset_groups, h, w, c // offset_groups), dtype=t.dtype, device=t.device)


def from_offset_grouped(buf: Tensor, out: Tensor, memo: Optional[dict] = None) -> Tensor:
    """out [N, C, H, W] (NCHW-contiguous or channels_last, any dtype) = a [N, G, H, W, C/G] buffer (G = 1:
    an NHWC buffer). memo: see run_transposes."""
    n, g, h, w, cog = buf.shape
    if out.is_contiguous() and uses_layout_kernel(out):
        _transpose_one(buf.view(n * g, h * w, cog), h * w, cog, out.view(n * g, cog, h * w), None, None, memo)
        return out
    out.unflatten(1, (g, cog)).copy_(buf.permute(0, 1, 4, 2, 3))
    return out
