"""The weight's packing: [Cout, Cin_g, kh, kw] to the layout the kernels read, alone or with the input's copy.

The kernels read the weight as ``[groups, kh*kw, Cin_g, Cout_g]`` (tap-major rows of the B tile, output channels
contiguous) or, for the fp32 forward, ``[groups, kh*kw, Cout_g, Cin_g]`` (K-major: configs.weight_k_major). The
pack is one Triton pass on CUDA; the forward runs it in the same launch as the NCHW input's copy.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....config import options
from ...common.launch import Launch, aligned16, ceil_div, memoized, next_pow2, pointer_specs, pow2_clamp, remember
from ...common.layout import (
    offset_grouped_empty,
    tile_of,
    to_nhwc,
    to_offset_grouped,
    transpose_tile,
    transpose_tiles,
    uses_layout_kernel,
)

# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _pack_weight_tile(w_ptr, wp_ptr, CIN_G, COUT_G, w_so, w_si, w_sh, w_sw, pid_o, pid_i, g,
                      KH: tl.constexpr, KW: tl.constexpr, K_MAJOR: tl.constexpr, TAPS: tl.constexpr,
                      BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    """_pack_weight_kernel's tile (pid_o, pid_i) of conv group g (int64)."""
    KK: tl.constexpr = KH * KW
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    tap = tl.arange(0, TAPS)
    ok = (offs_o < COUT_G)[:, None, None] & (offs_i < CIN_G)[None, :, None] & (tap < KK)[None, None, :]
    src = ((g * COUT_G + offs_o) * w_so)[:, None, None] + (offs_i.to(tl.int64) * w_si)[None, :, None] \
        + ((tap // KW) * w_sh + (tap % KW) * w_sw)[None, None, :]
    tile = tl.load(w_ptr + src, mask=ok, other=0.0)
    row = g * KK + tap  # the packed [groups * KH*KW] index
    if K_MAJOR:
        dst = ((row[None, None, :] * COUT_G + offs_o[:, None, None]) * CIN_G) + offs_i[None, :, None]
    else:
        dst = ((row[None, None, :] * CIN_G + offs_i[None, :, None]) * COUT_G) + offs_o[:, None, None]
    tl.store(wp_ptr + dst, tile.to(wp_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _pack_weight_kernel(
    w_ptr,        # weight [Cout, Cin_g, KH, KW], strides below (any layout)
    wp_ptr,       # packed [groups, KH*KW, Cin_g, Cout_g], or [groups, KH*KW, Cout_g, Cin_g] if K_MAJOR (cast on store)
    CIN_G, COUT_G,
    w_so, w_si, w_sh, w_sw,   # the weight's strides in elements: output channel, input channel, tap row, column
    KH: tl.constexpr, KW: tl.constexpr, K_MAJOR: tl.constexpr,
    TAPS: tl.constexpr,       # KH*KW rounded up to a power of two
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """pack_weight's permutation and cast in one pass: a [BLOCK_O, BLOCK_I, TAPS] tile of (output channel, input
    channel, tap), read along the weight's contiguous side (taps for NCHW, input channels for channels_last) and
    written along the packed layout's (output channels, or input channels if K_MAJOR); the tile changes layout in
    shared memory, as in _transpose_kernel. Grid: (o tiles, i tiles, groups)."""
    _pack_weight_tile(w_ptr, wp_ptr, CIN_G, COUT_G, w_so, w_si, w_sh, w_sw, tl.program_id(0), tl.program_id(1),
                      tl.program_id(2).to(tl.int64), KH, KW, K_MAJOR, TAPS, BLOCK_O, BLOCK_I)


@triton.jit
def _pack_and_transpose_kernel(
    w_ptr, wp_ptr,                         # pack_weight's weight and packed weight (see _pack_weight_kernel)
    src_ptr, dst_ptr,                      # the input and its copy (see _transpose_kernel)
    CIN_G, COUT_G, w_so, w_si, w_sh, w_sw,  # the pack's sizes and the weight's strides
    A, B,                                  # the transpose's: src viewed [images, A, B]
    # tiles: the pack's along o and i (times the groups: PACK_PROGRAMS), the transpose's along a and b
    TILES_O, TILES_I, PACK_PROGRAMS, TILES_A, TILES_B,
    KH: tl.constexpr, KW: tl.constexpr, K_MAJOR: tl.constexpr, TAPS: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The forward's two layout copies in one launch: programs [0, PACK_PROGRAMS) pack the weight, the rest
    transpose the input (NCHW -> NHWC, or to the offset-grouped layout), so that the small pack runs beside the
    transpose instead of after it. Grid: (PACK_PROGRAMS + TILES_A * TILES_B * images,)."""
    pid = tl.program_id(0)
    if pid < PACK_PROGRAMS:
        pid_o, pid_i, g = tile_of(pid, TILES_O, TILES_I)
        _pack_weight_tile(w_ptr, wp_ptr, CIN_G, COUT_G, w_so, w_si, w_sh, w_sw, pid_o, pid_i, g, KH, KW, K_MAJOR, TAPS,
                          BLOCK_O, BLOCK_I)
    else:
        pid_a, pid_b, n = tile_of(pid - PACK_PROGRAMS, TILES_A, TILES_B)
        transpose_tile(src_ptr, dst_ptr, dst_ptr, dst_ptr, A, B, pid_a, pid_b, n, TILES_B, False, False, BLOCK_A,
                        BLOCK_B)


# --- launchers -----------------------------------------------------------------------------------------


def pack_weight(weight: Tensor, groups: int, k_major: bool = False, dtype: Optional[torch.dtype] = None,
                memo: Optional[dict] = None) -> Tensor:
    """[Cout, Cin_g, kh, kw] -> [groups, kh*kw, Cin_g, Cout_g] contiguous (tap-major rows of the B tile), or
    with k_major [groups, kh*kw, Cout_g, Cin_g] (each output channel's input channels contiguous), in dtype
    (default: the weight's). One _pack_weight_kernel pass where uses_layout_kernel (faster than torch's permuting
    copy), else torch's copies. memo: a dict kept by a caller that knows the call signature (call.py), which holds the
    launch once there is one: no key built again."""
    cout, cin_g, kh, kw = weight.shape
    dtype = weight.dtype if dtype is None else dtype
    cout_g = cout // groups
    if not uses_layout_kernel(weight):
        w = weight.to(dtype).reshape(groups, cout_g, cin_g, kh * kw)
        return (w.permute(0, 3, 1, 2) if k_major else w.permute(0, 3, 2, 1)).contiguous()
    out = packed_empty(weight, groups, k_major, dtype)
    memoized(memo, "pack", lambda: _pack_launch(weight, out, groups, k_major))(weight, out)
    return out


def _pack_launch(weight: Tensor, out: Tensor, groups: int, k_major: bool) -> Launch:
    """pack_weight's launch of _pack_weight_kernel for this signature (out: the packed weight)."""
    cout, cin_g, kh, kw = weight.shape
    cout_g = cout // groups
    key = (weight.device, weight.dtype, out.dtype, weight.shape, weight.stride(), groups, k_major,
           aligned16(weight), aligned16(out))
    cache = options.cache("packs")
    run = cache.get(key)
    if run is None:
        block_o, block_i, taps = pack_blocks(weight.shape, groups, k_major)
        grid = (ceil_div(cout_g, block_o), ceil_div(cin_g, block_i), groups)
        meta = dict(KH=kh, KW=kw, K_MAJOR=k_major, TAPS=taps, BLOCK_O=block_o, BLOCK_I=block_i, num_warps=4)
        run = remember(cache, key, Launch(_pack_weight_kernel, grid, (cin_g, cout_g, *weight.stride()), meta))
    return run


def packed_empty(weight: Tensor, groups: int, k_major: bool, dtype: torch.dtype) -> Tensor:
    """An empty packed weight (pack_weight's layout) in dtype, on the weight's device."""
    cout, cin_g, kh, kw = weight.shape
    shape = (groups, kh * kw, cout // groups, cin_g) if k_major else (groups, kh * kw, cin_g, cout // groups)
    return torch.empty(shape, dtype=dtype, device=weight.device)


def pack_blocks(shape: Sequence[int], groups: int, k_major: bool) -> Tuple[int, int, int]:
    """_pack_weight_tile's (BLOCK_O, BLOCK_I, TAPS) for a weight [Cout, Cin_g, kh, kw]: 4096-element tiles, up to 64
    along the written side (contiguous in the packed layout), all taps."""
    cout, cin_g, kh, kw = shape
    taps = next_pow2(kh * kw)
    side = min(pow2_clamp(cin_g if k_major else cout // groups, 1, 64), max(4096 // taps, 1))
    other = max(4096 // (taps * side), 1)
    block_i, block_o = (side, other) if k_major else (other, side)
    return block_o, block_i, taps


def forward_operands(input: Tensor, weight: Tensor, groups: int, offset_groups: int, grouped: bool,
                     k_major: bool, memo: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """The forward's input in the layout its kernel reads (NHWC, or offset-grouped if grouped) and its packed weight
    (pack_weight, in the input's dtype). Where both are Triton passes (an NCHW-contiguous input), one launch of
    _pack_and_transpose_kernel does both. memo: see pack_weight."""
    if not (options.fused_prep and input.is_contiguous() and not input.is_contiguous(memory_format=torch.channels_last)
            and uses_layout_kernel(input) and uses_layout_kernel(weight)):
        x = to_offset_grouped(input, offset_groups) if grouped else to_nhwc(input)
        return x, pack_weight(weight, groups, k_major, input.dtype, memo)
    if grouped:
        x = offset_grouped_empty(input, offset_groups)
    else:
        x = torch.empty(input.shape, dtype=input.dtype, device=input.device, memory_format=torch.channels_last)
    wp = packed_empty(weight, groups, k_major, input.dtype)
    run = memoized(memo, "pack_and_transpose",
                   lambda: _pack_and_transpose_launch(input, weight, x, wp, groups, offset_groups, grouped, k_major))
    run(weight, wp, input, x)
    return x, wp


def _pack_and_transpose_launch(input: Tensor, weight: Tensor, x: Tensor, wp: Tensor, groups: int, offset_groups: int,
                               grouped: bool, k_major: bool) -> Launch:
    """forward_operands' launch of _pack_and_transpose_kernel for this signature."""
    n, c, h, w = input.shape
    cout, cin_g, kh, kw = weight.shape
    cout_g = cout // groups
    a, images = (c // offset_groups, n * offset_groups) if grouped else (c, n)
    key = (input.device, input.dtype, weight.dtype, input.shape, weight.shape, weight.stride(), groups, offset_groups,
           grouped, k_major, *pointer_specs((input, x, weight, wp)))
    cache = options.cache("pack_and_transpose")
    run = cache.get(key)
    if run is None:
        block_o, block_i, taps = pack_blocks(weight.shape, groups, k_major)
        block_a, block_b, *tiles_ab = transpose_tiles(a, h * w)
        tiles = (ceil_div(cout_g, block_o), ceil_div(cin_g, block_i))
        pack_programs = tiles[0] * tiles[1] * groups
        grid = (pack_programs + tiles_ab[0] * tiles_ab[1] * images,)
        args = (cin_g, cout_g, *weight.stride(), a, h * w, *tiles, pack_programs, *tiles_ab)
        meta = dict(KH=kh, KW=kw, K_MAJOR=k_major, TAPS=taps, BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_A=block_a,
                    BLOCK_B=block_b, num_warps=4)
        run = remember(cache, key, Launch(_pack_and_transpose_kernel, grid, args, meta))
    return run
