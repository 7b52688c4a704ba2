"""Tile configs of the three deform_conv2d kernels: candidates per shape, heuristic default first.

Each ``*_candidates`` function returns at most 4 configs for a call's shape. The first is the heuristic default,
used as is; with ``DEFORMCONV_AUTOTUNE=1`` the first call at a new shape class times the candidates once and keeps
the fastest (common.launch.pick_config). The defaults were chosen from measurements on an H200; docs/tuning.md
gives each one and the numbers behind it. The rules below say what they are and why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch

from ....checks import ConvGeometry
from ....compat import codegen_profile
from ....config import options, tracing
from ...common.launch import ceil_div, pow2_clamp, sm_count, tma_possible, unique_configs
from .geometry import count_m_tiles, k_chunks_whole, k_run, packs_segments, weight_k_major, weight_rows


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2
    split: int = 1  # programs sharing one output tile: grad_weight's M reduction; the grad_input kernel's taps
    maxnreg: Optional[int] = None  # registers per thread at most (ptxas spills the rest); None: no limit
    sample_ahead: bool = False  # forward, long segments: each step's offsets and mask loaded a step ahead
    tma: bool = False  # weight and grad_out tiles read through TMA descriptors where the call allows (tma_launch)

    def launch_options(self) -> dict:
        """Triton's launch options of this config."""
        launch = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            launch["maxnreg"] = self.maxnreg
        return launch


def forced(kind: str, cands: List[Config]) -> List[Config]:
    """The candidates, or what options force instead: options.configs[kind] alone (a Config, or a function of the
    default Config returning one), or the default with options.tma."""
    force = options.configs.get(kind)
    if force is not None:
        return [force(cands[0]) if callable(force) else force]
    if options.tma is not None:
        return [dataclasses.replace(cands[0], tma=options.tma)]
    return cands


# Register caps (Config.maxnreg; ptxas spills what does not fit) where more resident programs per multiprocessor
# beat the spills. Elsewhere tiles stay uncapped: the caps made them slower (docs/tuning.md, register caps).
FWD_WIDE_MAXNREG = 128           # the forward's 64x256 tile: two programs an SM
FWD_PACKED_MAXNREG = 96          # the 16-bit packed-segment forward's 32-row tile
DATA_PACKED_MAXNREG = 128        # the grad_input kernel's 64-row packed tile (a candidate), 16-bit
DATA_PACKED_FP32_MAXNREG = 168   # likewise, fp32
WEIGHT_PACKED_MAXNREG = 168      # grad_weight with packed segments
WEIGHT_WIDE_MAXNREG = 128        # grad_weight's 256-column tile
WEIGHT_NARROW_FP32_MAXNREG = 168  # grad_weight's narrow fp32 tile (unpipelined)


def fwd_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype, device: torch.device) -> List[Config]:
    """The forward's tiles. fp32 reads the weight K-major, in 16-wide chunks and 3 stages; 256+ output channels a
    group take a 64x256 tile capped at 128 registers (its B tile through TMA), or under the compile route, past one
    wave of it, the 128x256 tile (traced_wide_tile); short packed segments take small M tiles (32 rows capped at 96
    registers in 16 bits with <= 64 output channels, 64 rows in fp32); long segments load each step's offsets and
    mask a step ahead in 128-row tiles."""
    cout_g = geo.out_channels // geo.groups
    bk = pow2_clamp(k_run(geo, seg, "fwd"), 16, 64 if dtype != torch.float32 else 32)
    bn = pow2_clamp(cout_g, 16, 128)
    packed = packs_segments(geo, seg, "fwd")
    if weight_k_major(dtype):
        if cout_g >= 256:
            cands = [Config(64, 256, 16, 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG, tma=True),
                     Config(64, 256, 16, 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG),
                     Config(128, 256, 16, 8, num_stages=3), Config(128, 256, bk, 8)]
        elif packed:
            cands = [Config(64, bn, 16, 4, num_stages=3), Config(128, bn, 16, 4, num_stages=3), Config(128, bn, bk, 4)]
        else:
            cands = [Config(128, bn, 16, 4, num_stages=3, sample_ahead=True, tma=True),
                     Config(128, bn, 16, 4, num_stages=3), Config(128, bn, bk, 4)]
    elif cout_g >= 256:  # fp16/bf16 (fp32 took the K-major branch)
        cands = [Config(128, 256, min(bk, 32), 8, num_stages=3), Config(128, 256, bk, 8),
                 Config(128, bn, min(bk, 32), 4)]
        if not packed:
            wide = Config(64, 256, min(bk, 32), 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG)
            cands[:0] = [dataclasses.replace(wide, tma=True), wide]
    elif packed:
        cands = [Config(128, bn, min(bk, 32), 4), Config(128, bn, bk, 4)]
        if bn <= 64:  # with 128 columns the small capped tiles were slower
            cands[:0] = [Config(32, bn, min(bk, 32), 4, maxnreg=FWD_PACKED_MAXNREG),
                         Config(64, bn, min(bk, 32), 4, maxnreg=128)]
    else:
        cands = [Config(128, bn, min(bk, 32), 4, num_stages=3, sample_ahead=True), Config(128, bn, min(bk, 32), 4)]
    if cout_g >= 256 and tracing():
        cands = traced_wide_tile(geo, cands, device)
    cands += [Config(64, bn, bk, 4), Config(128, bn, bk, 8)]
    return forced("fwd", unique_configs(cands)[:4])


def traced_wide_tile(geo: ConvGeometry, cands: List[Config], device: torch.device) -> List[Config]:
    """The forward's candidates for 256+ output channels a group under the compile route. A traced launch has no
    register cap (Launch.traced_meta): the 64x256 tile uncapped takes about 180 registers a thread, one program an SM.
    Past one wave of those programs the 128x256 tile, half as many, goes first; within one wave the 64-row tile
    spreads over more SMs and stays first (docs/tuning.md, the compile route's tiles)."""
    if cands[0].block_m != 64:
        return cands
    cout_g = geo.out_channels // geo.groups
    programs = count_m_tiles(geo, 64, False) * geo.groups * ceil_div(cout_g, 256)
    if programs <= sm_count(device):
        return cands
    tall = next(c for c in cands if c.block_m == 128 and c.block_n == 256)
    return [tall] + [c for c in cands if c is not tall]


def tap_split(geo: ConvGeometry, block_m: int, device: torch.device, fixed: bool = False,
              concurrent: bool = False) -> int:
    """The grad_input kernel's programs per M tile (each takes a run of taps), so that few positions still fill the
    GPU. Default mode: one program per tap (at most 9) when the M tiles are fewer than two per multiprocessor (less
    than one wave of its 2 resident programs); beside grad_weight (schedule.concurrent_backward) also 3 below four
    per multiprocessor; else 1. Deterministic mode: 3 when the tiles are fewer than the multiprocessors."""
    if device.type != "cuda":
        return 1
    tiles, sms = ceil_div(geo.batch * geo.out_h * geo.out_w, block_m), sm_count(device)
    if fixed:
        return min(3, geo.taps) if tiles < sms else 1
    if tiles < 2 * sms:
        return min(9, geo.taps)
    return min(3, geo.taps) if concurrent and tiles < 4 * sms else 1


def bwd_data_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype, device: torch.device,
                        fixed: bool = False, concurrent: bool = False) -> List[Config]:
    """The grad_input/offset/mask kernel's tiles: 64 rows; where grad_out is not resident (and in fp32) the weight and
    grad_out tiles through TMA with full-width chunks in 4 warps; 512+ output channels 8 warps; packed segments
    32 rows, uncapped. Deterministic mode (int64 atomics, twice the scatter's registers): 16-wide chunks in 4
    warps (32-wide in 8 for 512+ output channels)."""
    cout_g = geo.out_channels // geo.groups
    bk = pow2_clamp(k_run(geo, seg, "bwd_data"), 16, 64 if dtype != torch.float32 else 32)
    bn = pow2_clamp(cout_g, 16, 128)
    short = packs_segments(geo, seg, "bwd_data")
    packed = short and cout_g < 512
    half = dtype != torch.float32
    tma = ((bn < cout_g or not half) and not short
           and tma_possible(dtype, k_chunks_whole(geo, seg, bk, "bwd_data"), cout_g * dtype.itemsize, device))
    if tma:
        first = Config(64, bn, bk, 4, tma=True)
    else:
        first = Config(64, 128, bk, 8) if cout_g >= 512 else Config(64, bn, min(bk, 32), 4)
    packed_first = Config(32, bn, min(bk, 32), 4)
    if fixed:
        if packed:
            cands = [packed_first, Config(64, bn, 16, 4), Config(64, bn, 16, 8)]
        elif cout_g >= 512:
            cands = [Config(64, 128, min(bk, 32), 8), Config(64, 128, 16, 4)]
        else:
            cands = [Config(64, bn, 16, 4), Config(64, pow2_clamp(cout_g, 16, 64), 16, 4), Config(64, bn, 16, 8)]
    else:
        cands = [first, Config(64, bn, bk, 8), Config(64, pow2_clamp(cout_g, 16, 64), bk, 4),
                 Config(64, pow2_clamp(cout_g, 16, 256), min(bk, 32), 8)]
        if packed:  # the capped 64-row tile stays a candidate
            cap = DATA_PACKED_MAXNREG if half else DATA_PACKED_FP32_MAXNREG
            cands = [packed_first, Config(64, bn, min(bk, 32), 4, maxnreg=cap)] + cands[1:]
    cands = [dataclasses.replace(c, split=tap_split(geo, c.block_m, device, fixed, concurrent)) for c in cands]
    return forced("bwd_data", unique_configs(cands)[:4])


def bwd_weight_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype, device: torch.device,
                          concurrent: bool = False) -> List[Config]:
    """grad_weight's tiles (split over M: weight_split): 64 x <=128 in 4 warps by default (fp32 unpipelined and
    capped); 256+ output channels one 256-column tile capped at 128 registers (A sampled once per 256 output
    channels); packed segments a 64-wide chunk, unpipelined, capped. Long segments read grad_out through TMA."""
    cout_g = geo.out_channels // geo.groups
    bk = pow2_clamp(k_run(geo, seg, "bwd_weight"), 16, 64 if dtype != torch.float32 else 32)
    half = dtype != torch.float32
    # (block_m, block_n, block_k, warps, stages, register cap)
    narrow = (64, pow2_clamp(cout_g, 16, 128), bk, 4, codegen_profile().narrow_weight_stages, None)
    if not half:
        narrow = narrow[:4] + (1, WEIGHT_NARROW_FP32_MAXNREG)
    shapes = [narrow, (64, pow2_clamp(cout_g, 16, 256), bk, 8, 2, None),
              (128, pow2_clamp(cout_g, 16, 128), min(bk, 32), 4, 2, None),
              (128, pow2_clamp(cout_g, 16, 128), bk, 8, 2, None)]
    packed = packs_segments(geo, seg, "bwd_weight")
    if packed:
        shapes.insert(0, (64, pow2_clamp(cout_g, 16, 128), pow2_clamp(k_run(geo, seg, "bwd_weight"), 16, 64), 4, 1,
                          WEIGHT_PACKED_MAXNREG))
    elif cout_g >= 256:
        shapes.insert(0, shapes.pop(1)[:5] + (WEIGHT_WIDE_MAXNREG,))
    cands = []
    for bm, bn, kk, warps, stages, maxnreg in shapes:
        tiles = weight_rows(geo, seg, kk) * ceil_div(cout_g, bn)
        cands.append(Config(bm, bn, kk, warps, stages, split=weight_split(geo, tiles, bm, device, concurrent, dtype),
                            maxnreg=maxnreg))
    if not packed:
        cands.insert(0, dataclasses.replace(cands[0], tma=True))
    return forced("bwd_weight", unique_configs(cands)[:4])


# grad_weight's fp32 split partials may take this many bytes per input element: grad_input's fp32 accumulator's
# size, whose memory they reuse (allocated after it is freed: backward.py).
SPLIT_PARTIAL_BYTES = 4

# grad_weight's programs per SM when it runs beside the grad_input kernel (schedule.concurrent_backward), which takes
# the rest, by the input's element size: half an SM in 16 bits (fewer partials, the same time), one in fp32.
CONCURRENT_WEIGHT_PROGRAMS_PER_SM = {2: 0.5, 4: 1.0}


def weight_split(geo: ConvGeometry, tiles: int, block_m: int, device: torch.device, concurrent: bool = False,
                 dtype: torch.dtype = torch.float32) -> int:
    """Split-M factor for grad_weight: about 3 programs per SM (CONCURRENT_WEIGHT_PROGRAMS_PER_SM for dtype beside
    the grad_input kernel), at least 4 M tiles each, and the fp32 partial sums within SPLIT_PARTIAL_BYTES per input
    element or 4 weights, whichever is more."""
    m_tiles = ceil_div(geo.batch * geo.out_h * geo.out_w, block_m)
    sms = sm_count(device)
    beside = CONCURRENT_WEIGHT_PROGRAMS_PER_SM.get(dtype.itemsize, 1.0)
    programs = beside * sms if concurrent else 3 * sms
    want = ceil_div(max(1, round(programs)), max(tiles, 1))
    weight_elems = geo.out_channels * (geo.in_channels // geo.groups) * geo.taps
    input_elems = geo.batch * geo.in_channels * geo.height * geo.width
    by_memory = max(4, (SPLIT_PARTIAL_BYTES * input_elems) // (4 * weight_elems))
    return max(1, min(want, m_tiles // 4, by_memory, 64))
