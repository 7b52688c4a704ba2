"""The Triton backend: fused implicit-GEMM deformable convolution, forward and backward.

GEMM view per convolution group: M = N*Ho*Wo output positions, N = Cout/groups, K = (Cin/groups)*kh*kw.
The K loop runs over taps, then over *segments* (runs of channels that share one conv group and one offset
group: length SEG = gcd(Cin/groups, Cin/offset_groups)), then over channel chunks of BLOCK_K. Each
position's sample point, bilinear corners and weights (x mask) are computed once per (tap, segment) in
fp32 and reused for every channel chunk; the sampled A tile goes straight from registers into tl.dot, so
no (Cin*kh*kw) x (N*Ho*Wo) column buffer ever exists. Segments shorter than a tensor-core K step (a power
of two below 16, e.g. 8 channels per offset group) are packed NSEG to a chunk instead: one sample point per
(position, segment), corners loaded as pairs [BM, NSEG, 2, SEG] ((x0, x0+1) of a row) and blended into
[BM, NSEG, SEG], reshaped to [BM, BLOCK_K] for the dot.

Layouts: the input is read channels-last (NHWC), so each bilinear corner is a contiguous run of channels;
where packed segments are whole offset groups, offset-grouped instead ([N, G, H, W, Cin/G], see
grouped_input), so that a corner pair is one run. Offset and mask are read NCHW (consecutive positions are
consecutive addresses); the weight is repacked once per call to [groups, kh*kw, Cin/groups, Cout/groups]
(tap-major B rows), or for the fp32 forward to [groups, kh*kw, Cout/groups, Cin/groups] (TF32 wgmma reads its B
tile K-major only: weight_k_major); for an NCHW input that pack and the input's copy are one launch
(forward_operands). The output comes back in the input's memory format; a 16-bit NCHW one is stored in 16-byte runs
along its channel planes where they allow (_run_store). Offsets into the input and gradient buffers are int64. On
Hopper some configs (Config.tma) read the weight tiles and grad_out tiles through TMA descriptors instead of
per-thread copies: one bulk copy a tile, without the 64-bit address arithmetic and predicates of each thread's share
(the corner gathers stay per-thread `cp.async`; Hopper's TMA has no gather).

Precision: the GEMMs accumulate in fp32 (TF32 on the tensor cores for fp32 inputs only where
torch.backends.cudnn.allow_tf32 permits). Sample points and bilinear weights are fp32. The forward blends the 4
corners into A in the input's dtype: fp32 for fp32; for fp16 and bf16 the weights are rounded to that dtype and the
products summed in it (paired 16-bit FMAs), A being rounded to it for the tensor cores in any case. That takes
30-45% of the instructions out of the forward's K loop and 7-16% of its time (H200, v16, benchmarks/NOTES.md),
for a forward error (fp16, against float64) 1.2-1.4x that of rounding the exact result to fp16, where an fp32
blend gives 1.1x and torchvision, which computes in fp16 throughout, 4.5x on the CPU and 35-72x on the H200
(tests/test_deform_conv2d.py, test_half_error_near_the_rounding_of_the_exact_result). The 4 weights sum to the
mask, so with a mask <= 1 every partial sum stays within the corners' range. grad_weight re-samples A in fp32: a
16-bit blend there took its error from 1.6x to 2.7x the rounding's, for 4-7% of that kernel's time.

The launchers cache a plan per call signature and relaunch the compiled kernels directly (``_Launch``). The
backward runs over the batch in chunks of images within a scratch budget (backward_chunk_images); where the batch is
small, grad_weight runs on a side stream beside the grad_input kernel (concurrent_backward).

This file reads top-down: configs/heuristics -> @triton.jit kernels -> launchers -> nothing else (the
torch.library glue is in deformconv/library.py, the dispatch in deformconv/backends.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the kernels read every tile through pointers
    TensorDescriptor = None

from ..checks import ConvGeometry, geometry_from_tensors, suggest_memory_format

# --- configs and heuristics ----------------------------------------------------------------------------


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
    tma: bool = False  # weight and grad_out tiles read through TMA descriptors where the call allows (_tma_launch)

    def launch_options(self) -> dict:
        """Triton's launch options of this config."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


def triton_version() -> Tuple[int, int]:
    """(major, minor) of the Triton in use: "3.8.0" or "3.8.0+git1234" -> (3, 8)."""
    major, minor = (triton.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# _blend's multiply-adds spelled out as FMAs on Triton newer than 3.6. Triton 3.8 packs the 16-bit products into f16x2
# multiplies and leaves their sums scalar, so `a*b + c*d` no longer contracts into FMAs: the fp16 forward's K loop at
# det-s3 went from 268 to 512 SASS instructions (182 of them byte permutes, sm_90), and the H200 ran that forward 1.29x
# slower than with Triton 3.6 (benchmarks/NOTES.md, v29). With explicit FMAs 3.8 builds that loop in 275. Triton 3.6
# keeps the plain expression: it contracts it itself, and explicit FMAs would reorder its SASS.
EXPLICIT_FMA_BLEND = tl.constexpr(triton_version() > (3, 6))
# The forward's epilogue stores a tile that lies inside one image as a run of positions, on Triton newer than 3.6. With
# flat M tiles the positions are m % (Ho*Wo), whose contiguity Triton cannot see; 3.8 then lays the [BM, BN] store out
# channel-major, each thread holding a column of BM positions with an int64 address apiece, and the 64x256 forward
# (det-s5, cls-14: 128 registers a thread) spilled 1096 bytes a thread and ran 1.6-2.0x slower on the H200 than with 3.6.
# Triton 3.6 lays it out position-major without being told, and keeps its measured code.
CONTIGUOUS_FLAT_STORE = tl.constexpr(triton_version() > (3, 6))
# _corner_pairs and _scatter_pairs address their [BM, NSEG, 2, SEG] corner pairs with the pair axis moved outermost
# (permuted back after the load), on Triton newer than 3.6. Triton 3.6 lays those loads out with each pair in one thread;
# 3.8 spreads a pair over two lanes, so the sums over it take shuffles: the grad_input kernel at det-s3 (fp16) then
# spilled 312 bytes a thread and ran 902 SASS instructions a K step (72 more shuffles, 64 selects), against 3.6's 0 and
# 612; with the pair axis outermost 3.8 builds it with 72 and 669, hires-g8's grad_input kernel in 128 registers
# instead of 167 (sm_90 builds of the H200's launches: experiments/launch_builds.py, benchmarks/NOTES.md v29). The
# positions go next to the channels ([2, NSEG, BM, SEG]): as [2, BM, NSEG, SEG] 3.8 spread the packed segments
# (NSEG > 1, hires-g8) over a warp's lanes, and each K step of the forward converted the [BM, NSEG] sample points'
# layout through shared memory (18 barriers a step against 3.6's 2; 2 again with the positions inner, v30: hires-g8's
# forward 0.452 -> 0.355 ms on the H200, 3.6 0.357).
PAIR_AXIS_OUTER = tl.constexpr(triton_version() > (3, 6))


def _ceil_div(a: int, b: int) -> int:
    """triton.cdiv in plain Python, for code that runs at every call (Triton 3.8's costs microseconds a call)."""
    return -(-a // b)


def _pow2_clamp(x: int, lo: int, hi: int) -> int:
    """The power of two at or above x, clamped to [lo, hi] (plain Python: _channel_sum calls it every call)."""
    return max(lo, min(hi, 1 << (max(1, x) - 1).bit_length()))


def segment_length(geo: ConvGeometry) -> int:
    """Channels per segment: the longest run that lies in one conv group and one offset group."""
    return math.gcd(geo.in_channels // geo.groups, geo.in_channels // geo.offset_groups)


def _short_segments(geo: ConvGeometry, seg: int, kind: str) -> bool:
    """Whether a K chunk packs several segments (each with its own sample point): segments shorter than a
    tensor-core K step and a power of two; for the grad_input/offset/mask kernel also one offset group
    each, so that a chunk holds whole offset groups."""
    if seg >= 16 or seg & (seg - 1):
        return False
    return kind != "bwd_data" or seg == geo.in_channels // geo.offset_groups


def _k_run(geo: ConvGeometry, seg: int, kind: str) -> int:
    """The channel run one K chunk lies in: the whole conv group when segments are packed, else a segment."""
    return geo.in_channels // geo.groups if _short_segments(geo, seg, kind) else seg


def segments_per_chunk(geo: ConvGeometry, seg: int, block_k: int, kind: str) -> int:
    """NSEG: 1 when a chunk lies in one segment, else block_k // seg."""
    return block_k // seg if _short_segments(geo, seg, kind) else 1


def _even_k(geo: ConvGeometry, seg: int, block_k: int, kind: str) -> bool:
    """No channel mask needed: the run a chunk lies in is a multiple of block_k."""
    return _k_run(geo, seg, kind) % block_k == 0


def _weight_rows(geo: ConvGeometry, seg: int, block_k: int) -> int:
    """grad_weight programs along K: groups x taps x (segments x chunks, or chunks of packed segments)."""
    cin_g = geo.in_channels // geo.groups
    if _short_segments(geo, seg, "bwd_weight"):
        return geo.groups * geo.taps * triton.cdiv(cin_g, block_k)
    return geo.groups * geo.taps * (cin_g // seg) * triton.cdiv(seg, block_k)


def per_image_tiles(geo: ConvGeometry, block_m: int, kind: str, nseg: int, dtype: torch.dtype,
                    run_store: bool = False) -> bool:
    """Whether M tiles stay inside one image (see _position_setup): no per-position division by Ho*Wo, at
    the cost of a partial tile per image; only where that adds at most 1/3 more tiles than tiling M flat. Measured on
    the H200 (benchmarks/NOTES.md, v5/v6/v10): the backward kernels gain 2-10% at every benchmark shape; the forward
    gains with packed segments (hires-g8 fp16 0.455 -> 0.425 ms, fp32 -2%, bf16 -2%) and with small images
    (Ho*Wo <= 2 tiles: 6%), and lost 10% at det-s3 (v5). With the forward's vectorised NCHW stores (run_store, see
    _run_store) that turned (v23, graph): det-s3's 128-row tiles 0.224 -> 0.218 ms fp16, 0.225 -> 0.217 bf16 (flat
    tiles spill 304 bytes in that epilogue, per-image 8); det-s4's 64-row tiles +0.5%, so 128-row tiles only. On
    Triton newer than 3.6, every forward with a run store (PER_IMAGE_RUN_STORES, see there)."""
    flat = triton.cdiv(geo.batch * geo.out_h * geo.out_w, block_m)
    if 3 * (_m_tiles(geo, block_m, True) - flat) > flat:
        return False
    if kind != "fwd":
        return True
    return nseg > 1 or geo.out_h * geo.out_w <= 2 * block_m or (run_store and (block_m >= 128 or PER_IMAGE_RUN_STORES))


def grouped_input(geo: ConvGeometry, seg: int) -> bool:
    """Packed segments that are whole offset groups: the kernels read the input in the offset-grouped layout
    [N, G, H, W, Cin/G] instead of NHWC (one copy either way, from NCHW), so that the (x0, x0+1) corners of a
    sample point are one run of 2*SEG elements, loaded by two neighbouring threads from one cache line
    (_corner_pairs): half the lines a gather instruction touches. Measured on the H200 (benchmarks/NOTES.md,
    v10), hires-g8 forward, CUDA graph: fp16 0.595 -> 0.425 ms, bf16 0.806 -> 0.436, fp32 1.077 -> 0.807 (NHWC
    with the same paired loads: 0.509 fp16, 0.521 bf16)."""
    return _short_segments(geo, seg, "fwd") and seg == geo.in_channels // geo.offset_groups


def go_resident(geo: ConvGeometry, block_n: int) -> bool:
    """grad_input kernel: one conv group whose grad_out channels fit one N tile, loaded once per program."""
    return geo.groups == 1 and geo.out_channels <= block_n


def _m_tiles(geo: ConvGeometry, block_m: int, per_image: bool) -> int:
    if per_image:
        return geo.batch * triton.cdiv(geo.out_h * geo.out_w, block_m)
    return triton.cdiv(geo.batch * geo.out_h * geo.out_w, block_m)


def _unique(cands: List[Config]) -> List[Config]:
    return list(dict.fromkeys(cands))


# Register caps (Config.maxnreg; ptxas spills what does not fit) where more programs per multiprocessor beat
# the spills. Measured on the H200 in fp16 (experiments/sweep_configs.py --maxnreg, benchmarks/NOTES.md): the
# wide forward's 64x256 tile and (v16, v22) the 16-bit packed forward's 64-row (128) and 32-row (96) tiles at
# <= 64 columns (see _fwd_candidates);
# grad_weight det-s4 (64,256,64,8) 0.341 -> 0.260 ms at 128 registers, cls-14 (128,128,32,4) 0.232 -> 0.205 at
# 128, hires-g8 packed (64,64,64,4, one stage) 1.051 -> 0.719 at 168; the grad_input kernel with packed
# segments (hires-g8, 64,64,32,4) 1.844 -> 1.499 at 128. Slower with a cap: the other forwards (det-s3 0.296 ->
# 0.360 at 168; the 128x256 tile cannot compile under 158) and the chunked grad_input kernel (det-s3 1.31 -> 1.81).
# fp32 (v9): the packed grad_input kernel 1.727 -> 1.621 at 168 (1.647 at 128), packed grad_weight 1.459 -> 1.339
# at 168 (1.883 at 128), the wide grad_weight tile at few positions (see _bwd_weight_candidates); its forwards
# stay uncapped (the 128x256 tile cannot compile under the cap; 64x256 is slower). Re-checked with the paired,
# offset-grouped corner loads (v10, hires-g8, capped vs uncapped): grad_input kernel fp16 1.395 vs 1.459 ms,
# fp32 1.541 vs 1.769; grad_weight fp16 0.436 vs 0.455, fp32 0.951 vs 1.013.
FWD_WIDE_MAXNREG = 128
FWD_PACKED_MAXNREG = 96
DATA_PACKED_MAXNREG = 128
DATA_PACKED_FP32_MAXNREG = 168
WEIGHT_PACKED_MAXNREG = 168
WEIGHT_WIDE_MAXNREG = 128
WEIGHT_NARROW_FP32_MAXNREG = 168
# Pipeline stages of grad_weight's narrow 16-bit tile (64 x <=128, 4 warps; det-s3). Triton 3.8 stages that kernel's
# A tile through shared memory as well (8 KB more: 77840 bytes a program), so 2 programs fit an SM instead of 3, and
# det-s3's 396 programs (sized for 3 an SM, _split_for) took two waves: 0.329 ms (3.6) -> 0.556 ms. Unpipelined it
# needs 32 KB: 0.293 ms fp16, 0.309 bf16 (H200, graph; benchmarks/NOTES.md v30). Triton 3.6 keeps its measured 2.
WEIGHT_NARROW_STAGES = 1 if triton_version() > (3, 6) else 2


# Candidates per kernel, the heuristic default first (chosen from H200 measurements, see
# benchmarks/README.md). The default is used as is; with DEFORMCONV_AUTOTUNE=1 the first call at a new
# shape class times the (at most 4) candidates instead and keeps the fastest: a few seconds, never a sweep.


def _fwd_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype) -> List[Config]:
    cout_g = geo.out_channels // geo.groups
    bk = _pow2_clamp(_k_run(geo, seg, "fwd"), 16, 64 if dtype != torch.float32 else 32)
    bn = _pow2_clamp(cout_g, 16, 128)
    if weight_k_major(dtype):
        # fp32 with the K-major weight (v13): 16-wide chunks, 3 stages. CUDA graph, ms: det-s3 (128,128,16,4,3)
        # 0.440 vs (128,128,32,4) 0.508; 64-row tiles capped at 128 registers: det-s4 0.290 vs (128,256,32,8) 0.361
        # ((128,256,16,8,3) 0.298), det-s5 0.269 vs 0.325, cls-14 0.141 vs 0.162; 4 stages, 8 warps at 128x128,
        # uncapped 64-row tiles and 32-wide chunks in 3 stages were slower
        # packed segments (v14): hires-g8 0.807 (N-major, 128,64,32,4) -> 0.591 ms at (64,64,16,4,3); 4 stages equal,
        # 2 stages 0.736, 32 rows 0.601, 128 rows 0.641, 8 warps 0.787, 32-wide chunks 0.834, capped at 168 0.707
        # the sample points a step ahead (v15): det-s3 0.448 -> 0.427 ms; not for the 64x256 tile (+1.5% at det-s4/s5)
        # the K-major B tile through TMA (v18, graph): det-s3 0.428 -> 0.400 ms, det-s4 0.296 -> 0.286, det-s5 0.273
        # -> 0.257, cls-14 0.144 -> 0.133; packed segments not (hires-g8 0.599 -> 0.593, within noise)
        if cout_g >= 256:
            cands = [Config(64, 256, 16, 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG, tma=True),
                     Config(64, 256, 16, 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG),
                     Config(128, 256, 16, 8, num_stages=3), Config(128, 256, bk, 8)]
        elif _short_segments(geo, seg, "fwd"):
            cands = [Config(64, bn, 16, 4, num_stages=3), Config(128, bn, 16, 4, num_stages=3), Config(128, bn, bk, 4)]
        else:
            cands = [Config(128, bn, 16, 4, num_stages=3, sample_ahead=True, tma=True),
                     Config(128, bn, 16, 4, num_stages=3), Config(128, bn, bk, 4)]
    elif cout_g >= 256:  # fp16/bf16 (fp32 took the K-major branch)
        # 3 stages: det-s4 0.208 -> 0.188 ms, cls-14 -6%, det-s5 -3%; then 64-row tiles capped at 128 registers,
        # two CTAs an SM: det-s4 0.187 -> 0.178 fp16 (0.182 bf16), det-s5 0.170 -> 0.165, cls-14 0.090 (equal);
        # uncapped they are slower (0.240 at det-s4), 2 or 4 stages too (0.190 / 0.247)
        # (measured without packed segments only); then (v17) the B tile through TMA: det-s4 0.164 -> 0.152 ms,
        # det-s5 0.154 -> 0.145, cls-14 0.084 -> 0.075, bf16 det-s4 0.164 -> 0.151 (with TMA: 4 stages 0.219 at
        # det-s4, 64-wide chunks 0.201, cls-14's 128x256 uncapped 0.081)
        cands = [Config(128, 256, min(bk, 32), 8, num_stages=3), Config(128, 256, bk, 8), Config(128, bn, min(bk, 32), 4)]
        if not _short_segments(geo, seg, "fwd"):
            wide = Config(64, 256, min(bk, 32), 8, num_stages=3, maxnreg=FWD_WIDE_MAXNREG)
            cands[:0] = [dataclasses.replace(wide, tma=True), wide]
    elif _short_segments(geo, seg, "fwd"):
        cands = [Config(128, bn, min(bk, 32), 4), Config(128, bn, bk, 4)]
        if bn <= 64:
            # packed segments, 16-bit, <= 64 output channels a group: 64-row tiles capped at 128 registers once the
            # blend was 16-bit (v16, H200, graph): hires-g8 fp16 0.419 -> 0.379 ms, bf16 0.424 -> 0.390 (uncapped
            # 0.473, 64-wide chunks 0.820). Not with 128 columns: (8,128,128,64,96,3,16) 0.299 -> 0.441 ms.
            # Then (v22) 32-row tiles capped at 96: fp16 0.380 -> 0.355 ms, bf16 0.386 -> 0.356 (104 and 88 the same,
            # 128 0.410, 3 stages 0.364; the 64-row tile at 96-104 registers spills: 0.70-0.87)
            cands[:0] = [Config(32, bn, min(bk, 32), 4, maxnreg=FWD_PACKED_MAXNREG),
                         Config(64, bn, min(bk, 32), 4, maxnreg=128)]
    else:
        # each (tap, segment) step's offsets and mask loaded a step ahead, 3 stages (v15, H200, graph): det-s3 fp16
        # 0.294 -> 0.261 ms, bf16 0.315 -> 0.268 (either alone: 0.291); 4 stages 0.414, 64-wide chunks 0.384; the B
        # tile through TMA 0.227 -> 0.235 (v17, not taken)
        cands = [Config(128, bn, min(bk, 32), 4, num_stages=3, sample_ahead=True), Config(128, bn, min(bk, 32), 4)]
    cands += [Config(64, bn, bk, 4), Config(128, bn, bk, 8)]
    return _unique(cands)[:4]


def tma_supported(device: torch.device) -> bool:
    """Whether the kernels can read tiles through TMA descriptors on this device (Config.tma): a GPU of compute
    capability 9.0 or later (the Tensor Memory Accelerator), or the CPU, where Triton's interpreter emulates them;
    and a Triton with host-side descriptors."""
    if TensorDescriptor is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def _tma_possible(dtype: torch.dtype, even_k: bool, row_bytes: int, device: torch.device) -> bool:
    """Whether tiles of an operand with rows of row_bytes (its channels) can come through TMA descriptors at all: the
    dtype is fp16, bf16 or fp32 (not float64), channel chunks are whole (EVEN_K: a weight tile past a segment's end
    would read the next segment's weights, and a non-finite weight there would leak into this one's result), rows a
    multiple of 16 bytes, and the device has TMA (tma_supported). _tma_launch adds the checks of the tensors' memory;
    the candidates use it to know in advance where TMA will be taken."""
    return (dtype in (torch.float16, torch.bfloat16, torch.float32) and even_k and row_bytes % 16 == 0
            and tma_supported(device))


def _tap_split(geo: ConvGeometry, block_m: int, device: torch.device, fixed: bool = False,
               concurrent: bool = False) -> int:
    """The grad_input kernel's programs per M tile (each takes a run of taps). Default mode: one program per tap (at
    most 9) when the M tiles are fewer than two per multiprocessor (less than one wave of its 2 resident 4-warp
    programs); beside grad_weight (concurrent_backward) also 3 below four per multiprocessor; else 1. Measured on
    the H200 (graph medians): v18, the kernel alone: det-s5's 119 tiles, split 3 -> 9: fp16 0.397 -> 0.325 ms, bf16
    0.395 -> 0.327, fp32 0.677 -> 0.596 (split 5: 0.336, 6: 0.342 fp16); cls-14's 196 (split 1 -> 9) 0.246 -> 0.227
    fp16; det-s4's 475 tiles split 3: +1.5%. v19, the backward with grad_weight beside it, split 1 -> 3: det-s4 0.725
    -> 0.675 fp16 and bf16, fp32 1.122 -> 1.122 (2: 1.113); a 32x256x28x28 layer's 416 tiles fp16 0.704 -> 0.586
    (9: 0.580), fp32 1.047 -> 0.939 (9: 0.970). Deterministic mode (measured in v8-v15 only): 3 when the tiles are
    fewer than the multiprocessors (det-s5's 120 tiles 0.510 -> 0.485 ms fp16; split 2: 0.488)."""
    if device.type != "cuda":
        return 1
    tiles, sms = triton.cdiv(geo.batch * geo.out_h * geo.out_w, block_m), _sm_count(device)
    if fixed:
        return min(3, geo.taps) if tiles < sms else 1
    if tiles < 2 * sms:
        return min(9, geo.taps)
    return min(3, geo.taps) if concurrent and tiles < 4 * sms else 1


def _bwd_data_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype, device: torch.device,
                         fixed: bool = False, concurrent: bool = False) -> List[Config]:
    cout_g = geo.out_channels // geo.groups
    bk = _pow2_clamp(_k_run(geo, seg, "bwd_data"), 16, 64 if dtype != torch.float32 else 32)
    bn = _pow2_clamp(cout_g, 16, 128)
    # the weight and grad_out tiles through TMA where grad_out is not resident, with 64-wide chunks in 4 warps (v17,
    # H200, the kernel, fp16, graph): det-s4 0.596 -> 0.552 ms, cls-14 0.280 -> 0.245 (32-wide: 0.588, 0.257), det-s5
    # 0.410 -> 0.387 (against its 8-warp tile; that tile with TMA: 0.428); not with packed segments (hires-g8 1.287
    # -> 1.294); no change where grad_out is resident (det-s3 0.950 -> 0.950). The 64-wide chunks spill 128 bytes a
    # thread at 255 registers (sm_90 build) and still ran faster; measured only with TMA, so taken only where TMA
    # will be (else the tiles stay as before). fp32 (v18, 32-wide chunks in 4 warps): det-s4 0.856 -> 0.758, cls-14
    # 0.389 -> 0.352, det-s5 1.011 -> 0.678 (its 8-warp tile with TMA: 0.711), and where grad_out is resident too
    # (det-s3 1.311 -> 1.268: the weight's tiles)
    short = _short_segments(geo, seg, "bwd_data")
    packed = short and cout_g < 512
    half = dtype != torch.float32
    tma = ((bn < cout_g or not half) and not short
           and _tma_possible(dtype, _even_k(geo, seg, bk, "bwd_data"), cout_g * dtype.itemsize, device))
    if tma:
        first = Config(64, bn, bk, 4, tma=True)
    else:
        first = Config(64, 128, bk, 8) if cout_g >= 512 else Config(64, bn, min(bk, 32), 4)
    packed_first = Config(32, bn, min(bk, 32), 4)  # packed segments: 32-row tiles, uncapped (both modes)
    if fixed:
        # deterministic mode (int64 fixed-point adds, twice the scatter's registers), H200, the kernel alone, graph ms
        # (v14, v15): 16-wide chunks in 4 warps against v7's 16-wide in 8 warps: fp16 det-s3 6.51 -> 3.05, det-s4
        # 3.59 -> 1.79, cls-14 1.78 -> 0.79 (32-wide in 8 warps: 3.31 / 1.86 / 0.85); fp32 det-s3 3.77 -> 3.30, det-s4
        # 2.42 -> 2.18, cls-14 1.17 -> 0.96. 512 output channels take 32-wide chunks in 8 warps: det-s5 fp16
        # 1.27 -> 1.07, fp32 1.63 -> 1.35 against 16-wide in 4 warps. Packed segments keep the default's 32-row
        # tile: hires-g8 fp32 4.30 -> 4.07 against 64 rows, 16-wide, 4 warps (fp16 3.85 -> 3.83)
        if packed:
            cands = [packed_first, Config(64, bn, 16, 4), Config(64, bn, 16, 8)]
        elif cout_g >= 512:
            cands = [Config(64, 128, min(bk, 32), 8), Config(64, 128, 16, 4)]
        else:
            cands = [Config(64, bn, 16, 4), Config(64, _pow2_clamp(cout_g, 16, 64), 16, 4), Config(64, bn, 16, 8)]
    else:
        cands = [first, Config(64, bn, bk, 8), Config(64, _pow2_clamp(cout_g, 16, 64), bk, 4),
                 Config(64, _pow2_clamp(cout_g, 16, 256), min(bk, 32), 8)]
        if packed:
            # packed segments: 32-row tiles, uncapped (v11, H200): hires-g8 fp16 1.355 -> 1.318 ms, bf16 1.356 ->
            # 1.316, fp32 1.536 -> 1.544; (8,128,128,64,96,3,16) fp16 0.779 -> 0.546, fp32 0.831 -> 0.808. The
            # former default, 64 rows capped, stays a candidate
            cap = DATA_PACKED_MAXNREG if dtype != torch.float32 else DATA_PACKED_FP32_MAXNREG
            cands = [packed_first, Config(64, bn, min(bk, 32), 4, maxnreg=cap)] + cands[1:]
    return _unique([dataclasses.replace(c, split=_tap_split(geo, c.block_m, device, fixed, concurrent))
                    for c in cands])[:4]


def _bwd_weight_candidates(geo: ConvGeometry, seg: int, dtype: torch.dtype, device: torch.device,
                           concurrent: bool = False) -> List[Config]:
    cout_g = geo.out_channels // geo.groups
    bk = _pow2_clamp(_k_run(geo, seg, "bwd_weight"), 16, 64 if dtype != torch.float32 else 32)
    half = dtype != torch.float32
    # (block_m, block_n, block_k, warps, stages, register cap); the first of long segments reads its grad_out tile
    # through TMA (v17, H200, fp16): det-s3 0.365 -> 0.336 ms, det-s4 0.262 -> 0.234, det-s5 0.286
    # -> 0.250, cls-14 0.175 -> 0.150, bf16 det-s4 0.264 -> 0.234; packed segments not (hires-g8 0.438 -> 0.443);
    # fp32 (v18): det-s3 0.656 -> 0.609, det-s4 0.643 -> 0.576, det-s5 0.614 -> 0.555, cls-14 0.332 -> 0.310
    narrow = (64, _pow2_clamp(cout_g, 16, 128), bk, 4, WEIGHT_NARROW_STAGES, None)
    if not half:
        # fp32, unpipelined and capped at 168 (v14): det-s3 0.717 -> 0.648 ms (2 stages capped: 0.715-0.724)
        narrow = narrow[:4] + (1, WEIGHT_NARROW_FP32_MAXNREG)
    shapes = [narrow, (64, _pow2_clamp(cout_g, 16, 256), bk, 8, 2, None),
              (128, _pow2_clamp(cout_g, 16, 128), min(bk, 32), 4, 2, None),
              (128, _pow2_clamp(cout_g, 16, 128), bk, 8, 2, None)]
    if _short_segments(geo, seg, "bwd_weight"):
        # packed segments: a 64-wide chunk, unpipelined (plain L1-cached loads instead of cp.async); hires-g8
        # fp16 1.27 -> 1.04 ms, bf16 1.30 -> 1.06, fp32 3.07 -> 1.47 (benchmarks/NOTES.md, v6); then capped
        # (0.719 ms fp16), then paired offset-grouped corners (v10: 0.436 fp16, 0.444 bf16, 0.951 fp32)
        shapes.insert(0, (64, _pow2_clamp(cout_g, 16, 128), _pow2_clamp(_k_run(geo, seg, "bwd_weight"), 16, 64), 4, 1,
                          WEIGHT_PACKED_MAXNREG))
    elif cout_g >= 256:
        # wide: one 256-column tile (the A tile sampled once per 256 output channels), capped at 128 registers:
        # fp16 det-s4 0.341 -> 0.260 ms; det-s5 0.403 -> 0.286 and cls-14 0.205 -> 0.174 against their former
        # 128x128 tile; fp32 det-s5 0.780 -> 0.618, cls-14 0.497 -> 0.330 against 64x128, det-s4 0.894 -> 0.643
        # against uncapped (v14; one stage 0.741, capped at 168 0.822) (benchmarks/NOTES.md)
        shapes.insert(0, shapes.pop(1)[:5] + (WEIGHT_WIDE_MAXNREG,))
    cands = []
    for bm, bn, kk, warps, stages, maxnreg in shapes:
        tiles = _weight_rows(geo, seg, kk) * triton.cdiv(cout_g, bn)
        cands.append(Config(bm, bn, kk, warps, stages, split=_split_for(geo, tiles, bm, device, concurrent, dtype),
                            maxnreg=maxnreg))
    if not _short_segments(geo, seg, "bwd_weight"):
        cands.insert(0, dataclasses.replace(cands[0], tma=True))
    return _unique(cands)[:4]


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


# grad_weight's fp32 split partials may take this many bytes per input element: grad_input's fp32
# accumulator's size, whose memory they reuse (allocated after it is freed, see _backward_images).
SPLIT_PARTIAL_BYTES = 4


# grad_weight's programs per SM when it runs beside the grad_input kernel (concurrent_backward), which takes the rest,
# by the input's element size. v19 sweep (H200, the backward, graph, 0.25 / 0.5 / 1 / 2 a SM): det-s5 (144 tiles)
# split 1 at up to 1 a SM, 0.473 ms fp16 (2 a SM, split 2: 0.499); cls-14 (36 tiles fp16, 72 fp32) fp16 0.470 / 0.322 /
# 0.324 / 0.326, fp32 split 1 -> 2 0.638 -> 0.571; det-s4 fp16 0.953 / 0.739 / 0.726 / 0.699 (tap split 1; with 3:
# 0.675 at 1 a SM), fp32 1.195 / 1.195 / 1.122 / 1.142. v24 (fp16 fwd+bwd, graph, same process, 1 -> 0.5 a SM):
# cls-14 0.386 -> 0.386 ms with its workspace 5.61 -> 4.96x the input (split 4 -> 2), det-s4 0.825 -> 0.818 and
# 4.68 -> 4.40x, det-s5 unchanged (split 1): so half a SM in 16 bits (fewer partials, same time), one in fp32
# (half lost 6-12% there in v19).
CONCURRENT_WEIGHT_PROGRAMS_PER_SM = {2: 0.5, 4: 1.0}


def _split_for(geo: ConvGeometry, tiles: int, block_m: int, device: torch.device, concurrent: bool = False,
               dtype: torch.dtype = torch.float32) -> int:
    """Split-M factor for grad_weight: about 3 programs per SM (CONCURRENT_WEIGHT_PROGRAMS_PER_SM for dtype beside
    the grad_input kernel), at least 4 M tiles each, and the fp32 partial sums within SPLIT_PARTIAL_BYTES per input
    element or 4 weights, whichever is more."""
    m_tiles = triton.cdiv(geo.batch * geo.out_h * geo.out_w, block_m)
    sms = _sm_count(device)
    beside = CONCURRENT_WEIGHT_PROGRAMS_PER_SM.get(dtype.itemsize, 1.0)
    programs = beside * sms if concurrent else 3 * sms
    want = triton.cdiv(max(1, round(programs)), max(tiles, 1))
    weight_elems = geo.out_channels * (geo.in_channels // geo.groups) * geo.taps
    input_elems = geo.batch * geo.in_channels * geo.height * geo.width
    by_memory = max(4, (SPLIT_PARTIAL_BYTES * input_elems) // (4 * weight_elems))
    return max(1, min(want, m_tiles // 4, by_memory, 64))


# Backward workspace: the scratch memory of one backward beyond the gradients it returns. Per image: the
# copies of input and grad_out (NHWC, when they come NCHW; the input's always where it is read offset-grouped,
# see grouped_input), grad_input's accumulator (fp32; int64 plus an fp32 conversion in deterministic mode) and
# grad_weight's split partials (which reuse the accumulator's memory, or exist beside it where grad_weight runs
# on a side stream: concurrent_backward, _backward_images). Over the whole batch at once that was 4.4x the
# input's size at det-s3 in fp16; the batch is processed in chunks of images instead, so that it stays within
# WORKSPACE_BUDGET times the input's size, but a chunk keeps at least MIN_CHUNK_PROGRAMS M tiles of the grad_input
# kernel (small images: a chunk must still fill the GPU, or it runs at a fraction of its speed). The environment
# variable DEFORMCONV_WORKSPACE_BUDGET overrides the budget ("inf": the whole batch at once, the fastest), and a
# budget set there is kept down to one image a chunk, without that floor (the user asked for the memory; small
# images then run slower: det-s4 +8%, cls-14 +31% fwd+bwd at 2 in v24), except where chunks would not save memory at
# all (grad_weight's fp32 sums over them: _chunked_weight_bytes).
# Measured on the H200 (benchmarks/NOTES.md): det-s3 fp16 NCHW 4.1x -> 1.6x the input for +5% fwd+bwd time.
WORKSPACE_BUDGET = 1.5
MIN_CHUNK_PROGRAMS = 512


def budget_from_environment() -> bool:
    """Whether DEFORMCONV_WORKSPACE_BUDGET sets the budget (then kept without the MIN_CHUNK_PROGRAMS floor)."""
    return bool(os.environ.get("DEFORMCONV_WORKSPACE_BUDGET", ""))


def workspace_budget() -> float:
    """The backward's scratch budget in multiples of the input's size (DEFORMCONV_WORKSPACE_BUDGET, else
    WORKSPACE_BUDGET)."""
    text = os.environ.get("DEFORMCONV_WORKSPACE_BUDGET", "")
    if not text:
        return WORKSPACE_BUDGET
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"DEFORMCONV_WORKSPACE_BUDGET: expected a number >= 0 (a multiple of the input's size, "
                         f"or inf), got {text!r}")
    return value


def _backward_bytes_per_image(input: Tensor, grad_out: Tensor, need_in: bool, need_w: bool, fixed: bool,
                              grouped: bool, concurrent: bool) -> int:
    """The backward's scratch bytes per image (see WORKSPACE_BUDGET)."""
    _, cin, h, w = input.shape
    _, cout, ho, wo = grad_out.shape
    elem = input.element_size()
    per_image = 0
    if grouped or not input.is_contiguous(memory_format=torch.channels_last):
        per_image += cin * h * w * elem
    if not grad_out.is_contiguous(memory_format=torch.channels_last):
        per_image += cout * ho * wo * elem
    scratch = 0  # bytes per input element
    if need_in:  # grad_input's accumulator: fp32, or int64 and its fp32 conversion (deterministic)
        scratch = 8 + 4 if fixed else 4
    if need_w:  # grad_weight's partials, in the accumulator's place or beside it
        scratch = scratch + SPLIT_PARTIAL_BYTES if concurrent else max(scratch, SPLIT_PARTIAL_BYTES)
    return per_image + cin * h * w * scratch


def _image_tiles(grad_out: Tensor) -> int:
    """M tiles of 64 positions in one image (the unit of MIN_CHUNK_PROGRAMS)."""
    return _ceil_div(grad_out.shape[-2] * grad_out.shape[-1], 64)


def _budget_images(input: Tensor, per_image: int) -> int:
    """The images whose scratch (per_image bytes each, > 0) fits the workspace budget, at most the batch."""
    input_bytes = input.numel() * input.element_size()
    return math.floor(min(workspace_budget() * input_bytes / per_image, input.shape[0]))


def backward_chunk_images(input: Tensor, grad_out: Tensor, need_in: bool, need_w: bool, fixed: bool,
                          grouped: bool = False, concurrent: bool = False, weight_elems: int = 0) -> int:
    """Images per chunk of the backward (the whole batch when the budget allows it, at least 1). grouped: the
    input is read offset-grouped (grouped_input), so it is copied even when it comes channels-last. concurrent:
    grad_weight's partials exist beside grad_input's accumulator (concurrent_backward) instead of in its place.
    weight_elems: the weight's elements; with need_w, chunks must save more scratch than grad_weight's fp32 sums
    over them take (_chunked_weight_bytes), else the batch runs whole: measured on the H200 (v24, fp16, budget 2),
    det-s5 (a 512x512x3x3 weight, 60% of its input's elements) went 4.6x -> 6.1x the input in 4-image chunks."""
    batch = input.shape[0]
    per_image = _backward_bytes_per_image(input, grad_out, need_in, need_w, fixed, grouped, concurrent)
    if batch <= 1 or per_image == 0:
        return max(batch, 1)
    images = _budget_images(input, per_image)
    if not budget_from_environment():  # the default budget yields to a chunk that fills the GPU
        images = max(images, _ceil_div(MIN_CHUNK_PROGRAMS, _image_tiles(grad_out)))
    images = max(1, min(batch, images))
    if need_w and images < batch and (batch - images) * per_image <= _chunked_weight_bytes(input, images, weight_elems):
        return batch  # chunks would not save memory: grad_weight's sums over them take what they free
    return images


def _chunked_weight_bytes(input: Tensor, images: int, weight_elems: int) -> int:
    """What grad_weight's fp32 sums over chunks of images hold beyond the chunks' scratch: the running sum and a
    chunk's summed partials (a weight's size each), and the partials' excess over the SPLIT_PARTIAL_BYTES an input
    element the scratch counts for them, where _split_for's floor of 4 weights' worth exceeds that (a weight large
    against a chunk's input: det-s5)."""
    weight_bytes = 4 * weight_elems
    counted = images * (input.numel() // max(input.shape[0], 1)) * SPLIT_PARTIAL_BYTES
    return 2 * weight_bytes + max(0, 4 * weight_bytes - counted)


def concurrent_backward(input: Tensor, grad_out: Tensor, need_in: bool, need_data: bool, need_w: bool, fixed: bool,
                        grouped: bool = False) -> bool:
    """Whether grad_weight runs on a side stream beside the grad_input kernel (need_data: that kernel runs, for
    grad_input, grad_offset or grad_mask). Neither kernel fills the H200 at few positions, and they share only
    read-only operands: H200, graph medians, fp16 backward det-s5 0.562 -> 0.472 ms, cls-14 0.372 -> 0.323, det-s4
    0.787 -> 0.675 (with its splits: _split_for, _tap_split); the benchmark's fwd+bwd 0.707 -> 0.626, 0.453 -> 0.404,
    0.939 -> 0.835 (benchmarks/NOTES.md, v19). Taken on CUDA where the backward is one chunk anyway and small: the
    whole batch has at most MIN_CHUNK_PROGRAMS M tiles (the chunks' floor; not with a budget set through
    DEFORMCONV_WORKSPACE_BUDGET, which is kept), or the budget admits it with grad_weight's partials beside the
    accumulator. Larger backwards stay sequential (det-s3, hires-g8: within 1%, and the partials would
    cost their chunks images). DEFORMCONV_BACKWARD_STREAMS=0 turns it off."""
    if not (need_w and need_data and side_streams_usable(input.device)):
        return False
    batch = input.shape[0]
    if batch * _image_tiles(grad_out) <= MIN_CHUNK_PROGRAMS and not budget_from_environment():
        return True
    per_image = _backward_bytes_per_image(input, grad_out, need_in, need_w, fixed, grouped, True)
    return _budget_images(input, per_image) >= batch


def backward_schedule(input: Tensor, grad_out: Tensor, geo: ConvGeometry, weight_elems: int, need_in: bool,
                      need_data: bool, need_w: bool, fixed: bool) -> Tuple[bool, int]:
    """A backward's (concurrent_backward, images per chunk: backward_chunk_images), with the input's copy
    offset-grouped where the kernels read it so (grouped_input)."""
    grouped = grouped_input(geo, segment_length(geo))
    concurrent = concurrent_backward(input, grad_out, need_in, need_data, need_w, fixed, grouped)
    return concurrent, backward_chunk_images(input, grad_out, need_in, need_w, fixed, grouped, concurrent, weight_elems)


def fused_bias(need_b: bool, split: int) -> bool:
    """Whether the grad_weight kernel sums grad_bias too (GROUPS more rows of programs, _grad_bias_rows), where the
    backward is one chunk and grad_out comes channels-last (an NCHW grad_out's transpose pass sums it: _nhwc_summed):
    instead of the channel-sum launch. Only where grad_weight's M tiles are split (split > 1): H200, fp16
    fwd+bwd, graph, the same process without and with it (v20, benchmarks/NOTES.md): cls-14 (split 4) 0.397 -> 0.391
    ms, but det-s5 (split 1) 0.605 -> 0.658 (presumably its 2 bias programs summing all 120 M tiles one after the
    other: v21's notes); so at split 1 a channels-last grad_out's channels are summed by _channel_sum."""
    return need_b and split > 1


# grad_weight written by its kernel in the weight's own layout and dtype where a single split makes it final (a one-chunk
# backward): no fp32 partials (det-s5 fp16: 9 MiB), no finishing pass over them. See direct_grad_weight.
DIRECT_GRAD_WEIGHT = True


def direct_grad_weight(whole: bool, split: int) -> bool:
    """Whether the grad_weight kernel stores grad_weight itself (DIRECT_GRAD_WEIGHT, a one-chunk backward, split 1)
    instead of fp32 partial sums for _finish_grads."""
    return DIRECT_GRAD_WEIGHT and whole and split == 1


def side_streams_usable(device: torch.device) -> bool:
    """CUDA, and DEFORMCONV_BACKWARD_STREAMS is not "0"."""
    return device.type == "cuda" and os.environ.get("DEFORMCONV_BACKWARD_STREAMS", "1") != "0"


_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The backward's side stream on a CUDA device (one per device, created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def weight_k_major(dtype: torch.dtype) -> bool:
    """Whether the forward reads the weight packed K-major (pack_weight): fp32, whatever the geometry. Hopper's
    TF32 wgmma takes its B operand from shared memory K-major only; from the [Cin_g, Cout_g] packing Triton
    transposes every B tile on its way into shared memory with 4-byte copies (det-s3: 32 a thread per K chunk
    instead of 8 16-byte ones).
    Measured on the H200 (benchmarks/NOTES.md, v13), fp32 forward, CUDA graph: det-s3 0.852 -> 0.509 ms, det-s4
    0.674 -> 0.361, det-s5 0.634 -> 0.330, cls-14 0.334 -> 0.167; the packed loop (hires-g8) with 16-wide chunks
    and 64-row tiles (v14) 0.807 -> 0.591 (with the 128x64x32 tile it spilled: 1.147, v13). 16-bit wgmma reads either
    order (fp16 det-s3 0.294 -> 0.325 K-major, the other shapes within 3%)."""
    return dtype == torch.float32


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use TF32 exactly where F.conv2d would (cudnn.allow_tf32), else full fp32."""
    if dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
        return "ieee"
    return "tf32"


_TUNED: Dict[tuple, Config] = {}


def autotune_enabled() -> bool:
    return os.environ.get("DEFORMCONV_AUTOTUNE", "0") not in ("", "0")


def _pick_config(key: tuple, candidates: List[Config], launch, device: torch.device) -> Config:
    """The heuristic default for this call's shape (candidates[0]); with DEFORMCONV_AUTOTUNE=1 on CUDA, the
    fastest candidate, timed once per shape class and cached: a later shape of the class takes the tuned tile
    with its own split (splits follow the exact number of positions, see _tap_split and _split_for).
    ``launch`` must be safe to repeat (the caller re-initialises any accumulator after the choice). A
    candidate must beat the default by 5% to replace it. chosen_configs() records each class's first choice."""
    if (not autotune_enabled() or len(candidates) == 1 or device.type != "cuda"
            or torch.cuda.is_current_stream_capturing()):
        _TUNED.setdefault(key, candidates[0])
        return candidates[0]
    if key in _TUNED:
        tuned = _TUNED[key]
        return next((c for c in candidates if dataclasses.replace(c, split=tuned.split) == tuned), tuned)
    from triton.testing import do_bench

    times = {}
    for cfg in candidates:
        try:
            launch(cfg)  # compile and warm the clocks before timing
            times[cfg] = do_bench(lambda: launch(cfg), warmup=10, rep=30, return_mode="median")
        except Exception:  # a candidate that does not fit this GPU (e.g. out of shared memory)
            continue
    best = candidates[0]
    for cfg, ms in times.items():
        if ms < 0.95 * times.get(best, float("inf")):
            best = cfg
    _TUNED[key] = best
    return best


def chosen_configs() -> Dict[tuple, Config]:
    """The config in use for each shape class seen so far (for benchmarks and bug reports)."""
    return dict(_TUNED)


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _sample_point(
    off_ptr, msk_ptr,      # offset [N, 2*G*KK, Ho, Wo] and mask [N, G*KK, Ho, Wo], NCHW
    off_row, msk_row,      # int64 [BM]: element offset of (n, channel 0, ho, wo) in offset / mask
    ch, L,                 # channel (= offset group * KK + tap), Ho*Wo
    y_ref, x_ref,          # fp32 [BM]: the regular (undeformed) sample point
    pix_base, H, W, PIX,   # int64 [BM] offset of image n in the input; input sizes; pixel stride (elements)
    m_valid,               # bool [BM]
    HAS_MASK: tl.constexpr,
):
    """Sample point of one tap and offset group: the element offset of its top-left corner (y0, x0) from
    the image's base (pixels PIX elements apart: Cin in NHWC, Cin/G in the offset-grouped layout), which of
    the 4 corners lie inside the image, the fractions (ly, lx) and the mask."""
    dy_row = off_row + (2 * ch).to(tl.int64) * L  # int64: one image's offsets may pass 2**31 elements
    dy = tl.load(off_ptr + dy_row, mask=m_valid, other=0.0).to(tl.float32)
    dx = tl.load(off_ptr + dy_row + L, mask=m_valid, other=0.0).to(tl.float32)
    y = y_ref + dy
    x = x_ref + dx
    inside = m_valid & (y >= -1.0) & (y < H) & (x >= -1.0) & (x < W)  # y == -1: zero value, one-sided grad
    y0f = tl.floor(y)
    x0f = tl.floor(x)
    ly = y - y0f
    lx = x - x0f
    y0 = tl.where(inside, y0f, 0.0).to(tl.int32)
    x0 = tl.where(inside, x0f, 0.0).to(tl.int32)
    top = inside & (y0 >= 0)
    bottom = inside & (y0 + 1 < H)
    left = x0 >= 0
    right = x0 + 1 < W
    p00 = pix_base + (y0 * W + x0).to(tl.int64) * PIX
    if HAS_MASK:
        mv = tl.load(msk_ptr + msk_row + ch.to(tl.int64) * L, mask=m_valid, other=0.0).to(tl.float32)
    else:
        mv = tl.full(ly.shape, 1.0, tl.float32)
    return p00, top & left, top & right, bottom & left, bottom & right, ly, lx, mv


@triton.jit
def _sample_loads(off_ptr, msk_ptr, off_row, msk_row, ch, L, m_valid, HAS_MASK: tl.constexpr):
    """_sample_point's loads alone, so that they can be issued a step ahead: (dy, dx, mask) [BM] in their dtype
    (without HAS_MASK the mask is dy again, never used)."""
    dy_row = off_row + (2 * ch).to(tl.int64) * L
    dy = tl.load(off_ptr + dy_row, mask=m_valid, other=0.0)
    dx = tl.load(off_ptr + dy_row + L, mask=m_valid, other=0.0)
    if HAS_MASK:
        mraw = tl.load(msk_ptr + msk_row + ch.to(tl.int64) * L, mask=m_valid, other=0.0)
    else:
        mraw = dy
    return dy, dx, mraw


@triton.jit
def _sample_from(dy, dx, mraw, y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK: tl.constexpr):
    """_sample_point from its _sample_loads. (The same arithmetic, written out again: _sample_point calling these two
    builds a longer grad_input chunk loop, 612 -> 648 instructions at det-s3, and measured 0.950 -> 0.963 ms; v17.)"""
    y = y_ref + dy.to(tl.float32)
    x = x_ref + dx.to(tl.float32)
    inside = m_valid & (y >= -1.0) & (y < H) & (x >= -1.0) & (x < W)
    y0f = tl.floor(y)
    x0f = tl.floor(x)
    ly = y - y0f
    lx = x - x0f
    y0 = tl.where(inside, y0f, 0.0).to(tl.int32)
    x0 = tl.where(inside, x0f, 0.0).to(tl.int32)
    top = inside & (y0 >= 0)
    bottom = inside & (y0 + 1 < H)
    left = x0 >= 0
    right = x0 + 1 < W
    p00 = pix_base + (y0 * W + x0).to(tl.int64) * PIX
    if HAS_MASK:
        mv = mraw.to(tl.float32)
    else:
        mv = tl.full(ly.shape, 1.0, tl.float32)
    return p00, top & left, top & right, bottom & left, bottom & right, ly, lx, mv


@triton.jit
def _load_corners(ptr, p00, cc, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K: tl.constexpr):
    """The 4 bilinear corners [BM, BK] (the input's dtype, zero outside the image) of channels cc."""
    ptrs = ptr + p00[:, None] + cc[None, :]
    row = W * CIN
    if EVEN_K:
        c00 = tl.load(ptrs, mask=v00[:, None], other=0.0)
        c01 = tl.load(ptrs + CIN, mask=v01[:, None], other=0.0)
        c10 = tl.load(ptrs + row, mask=v10[:, None], other=0.0)
        c11 = tl.load(ptrs + row + CIN, mask=v11[:, None], other=0.0)
    else:
        c00 = tl.load(ptrs, mask=v00[:, None] & k_ok[None, :], other=0.0)
        c01 = tl.load(ptrs + CIN, mask=v01[:, None] & k_ok[None, :], other=0.0)
        c10 = tl.load(ptrs + row, mask=v10[:, None] & k_ok[None, :], other=0.0)
        c11 = tl.load(ptrs + row + CIN, mask=v11[:, None] & k_ok[None, :], other=0.0)
    return c00, c01, c10, c11


@triton.jit
def _bilinear_weights(ly, lx, mv):
    """Weights of the corners (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1) from the fractions, mask folded in."""
    return (1.0 - ly) * (1.0 - lx) * mv, (1.0 - ly) * lx * mv, ly * (1.0 - lx) * mv, ly * lx * mv


@triton.jit
def _blend(w00, w01, w10, w11, c00, c01, c10, c11):
    """The bilinear sample [..., channels] from the corners [..., channels] weighted by their _bilinear_weights
    [...], computed in the corners' dtype (see Precision in the module docstring): fp32 corners in fp32; fp16
    and bf16 corners in their dtype, the weights rounded to it (paired 16-bit FMAs)."""
    dt = c00.dtype
    if EXPLICIT_FMA_BLEND:
        acc = tl.expand_dims(w00.to(dt), -1) * c00
        acc = tl.fma(tl.expand_dims(w01.to(dt), -1), c01, acc)
        acc = tl.fma(tl.expand_dims(w10.to(dt), -1), c10, acc)
        acc = tl.fma(tl.expand_dims(w11.to(dt), -1), c11, acc)
    else:
        acc = (tl.expand_dims(w00.to(dt), -1) * c00 + tl.expand_dims(w01.to(dt), -1) * c01
               + tl.expand_dims(w10.to(dt), -1) * c10 + tl.expand_dims(w11.to(dt), -1) * c11)
    return acc


@triton.jit
def _segment_channels(c_first, GS, SEG: tl.constexpr, GROUPED: tl.constexpr):
    """Element offsets [NSEG, SEG] (int64, from a pixel's address) of the channels of the segments starting at
    c_first [NSEG]: the channel index itself in NHWC; in the offset-grouped layout (where a segment is a whole
    offset group) the group's base, GS = H*W*SEG elements apart, plus 0..SEG-1."""
    if GROUPED:
        base = (c_first // SEG).to(tl.int64) * GS
    else:
        base = c_first.to(tl.int64)
    return base[:, None] + tl.arange(0, SEG)[None, :]


@triton.jit
def _pair_pointers(ptr, p00, cc, PIX):
    """Pointers [BM, NSEG, 2, SEG] to the top corner pairs (row y0: x0, x0+1) of each sample point: p00 is
    [BM, NSEG], cc [NSEG, SEG] (_segment_channels), PIX the pixel stride."""
    j = tl.arange(0, 2)
    return ptr + p00[:, :, None, None] + (cc[None, :, None, :] + (j * PIX).to(tl.int64)[None, None, :, None])


@triton.jit
def _pair_mask(left_ok, right_ok, c_ok=None):
    """Which corners of a pair exist, [BM, NSEG, 2, 1], from the left and right corners' [BM, NSEG] masks;
    [BM, NSEG, 2, SEG] with c_ok [NSEG, SEG], which channels exist (a partial chunk of a long segment)."""
    left = (tl.arange(0, 2) == 0)[None, None, :, None]
    ok = tl.where(left, left_ok[:, :, None, None], right_ok[:, :, None, None])
    if c_ok is not None:
        ok = ok & c_ok[None, :, None, :]
    return ok


@triton.jit
def _pair_axis_outer(t):
    """A corner-pair tensor [BM, NSEG, 2, SEG] (or a mask [BM, NSEG, 2, 1]) as [2, NSEG, BM, SEG]: the pair axis
    outermost and the positions next to the channels, how _corner_pairs and _scatter_pairs address their pairs where
    PAIR_AXIS_OUTER (a view, no data moved). Its own inverse."""
    return tl.permute(t, (2, 1, 0, 3))


@triton.jit
def _corner_pairs(ptr, p00, cc, v00, v01, v10, v11, ROW, PIX, c_ok=None):
    """The 4 corners of each sample point as two pairs [BM, NSEG, 2, SEG] in the input's dtype: top (row y0:
    x0, x0+1) and bottom (row y0+1, ROW elements further), zero outside the image, for masked-off segments
    and for channels c_ok [NSEG, SEG] excludes (if given). In the offset-grouped layout (PIX = SEG) a pair is
    one run of 2*SEG elements, which two neighbouring threads load from one cache line."""
    ptrs = _pair_pointers(ptr, p00, cc, PIX)
    if PAIR_AXIS_OUTER:  # loaded as [2, NSEG, BM, SEG], returned as [BM, NSEG, 2, SEG]
        pt = _pair_axis_outer(ptrs)
        top = _pair_axis_outer(tl.load(pt, mask=_pair_axis_outer(_pair_mask(v00, v01, c_ok)), other=0.0))
        bottom = _pair_axis_outer(tl.load(pt + ROW, mask=_pair_axis_outer(_pair_mask(v10, v11, c_ok)), other=0.0))
    else:
        top = tl.load(ptrs, mask=_pair_mask(v00, v01, c_ok), other=0.0)
        bottom = tl.load(ptrs + ROW, mask=_pair_mask(v10, v11, c_ok), other=0.0)
    return top, bottom


@triton.jit
def _pair_weights(ly, lx, mv):
    """_bilinear_weights as pairs: top (w00, w01) and bottom (w10, w11), each [BM, NSEG, 2]."""
    right = (tl.arange(0, 2) == 1)[None, None, :]
    wx = tl.where(right, lx[:, :, None], 1.0 - lx[:, :, None])
    return ((1.0 - ly) * mv)[:, :, None] * wx, (ly * mv)[:, :, None] * wx


@triton.jit
def _blend_pairs(wt, wb, top, bottom):
    """The bilinear samples [BM, NSEG, SEG] from _corner_pairs and _pair_weights, in the corners' dtype as
    _blend."""
    dt = top.dtype
    return tl.sum(wt[:, :, :, None].to(dt) * top + wb[:, :, :, None].to(dt) * bottom, axis=2)


@triton.jit
def _chunk_sample_points(off_ptr, msk_ptr, off_row, msk_row, c_first, seg_ok, tap, COG, KK: tl.constexpr, L,
                         y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK: tl.constexpr):
    """_sample_point for a K chunk of NSEG short segments: one sample point per (position, segment), all
    [BM, NSEG]. c_first [NSEG] is each segment's first channel, seg_ok [NSEG] which segments exist."""
    ch = (c_first // COG) * KK + tap
    return _sample_point(off_ptr, msk_ptr, off_row[:, None], msk_row[:, None], ch[None, :], L, y_ref[:, None],
                         x_ref[:, None], pix_base[:, None], H, W, PIX, m_valid[:, None] & seg_ok[None, :], HAS_MASK)


@triton.jit
def _tile_start(pid_m, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """M tile pid_m's first position: (image index, l0 = ho*Wo + wo), int32 scalars. PER_IMAGE: cdiv(L, BLOCK_M)
    tiles an image, none crossing into the next; else M is tiled flat (a tile may end in the next image)."""
    if PER_IMAGE:
        tiles = tl.cdiv(L, BLOCK_M)
        return pid_m // tiles, (pid_m % tiles) * BLOCK_M
    img = (pid_m * BLOCK_M) // L
    return img, pid_m * BLOCK_M - img * L


@triton.jit
def _tile_positions(pid_m, M, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """M tile pid_m's positions: (valid, image index int64, l = ho*Wo + wo int32), [BM] each; see _position_setup."""
    if PER_IMAGE:
        img, l0 = _tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        l32 = l0 + tl.arange(0, BLOCK_M)
        return l32 < L, tl.zeros((BLOCK_M,), tl.int64) + img.to(tl.int64), l32
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_m < M, (offs_m // L).to(tl.int64), offs_m % L


@triton.jit
def _position_setup(pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W,
                    PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per output position of M tile pid_m: validity, image index, l = ho*Wo + wo (int64, for addresses), the
    NHWC image base, the offset/mask row bases (int64) and the undeformed top-left sample point.
    PER_IMAGE: tiles never cross an image (N * cdiv(Ho*Wo, BLOCK_M) of them), so the image index and l come
    from one scalar division per tile instead of a division by Ho*Wo per position (det-s3's forward PTX:
    4 instead of 132 div/rem per thread); else M is tiled flat."""
    L = HO * WO
    if PER_IMAGE:
        img, l0 = _tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        img = img.to(tl.int64)
        l32 = l0 + tl.arange(0, BLOCK_M)
        m_valid = l32 < L
        n_img = tl.zeros((BLOCK_M,), tl.int64) + img
        l = l32.to(tl.int64)
        off_row = img * (2 * G * KK) * L + l
        msk_row = img * (G * KK) * L + l
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < M
        n_img = (offs_m // L).to(tl.int64)
        l32 = offs_m % L
        l = l32.to(tl.int64)
        off_row = n_img * (2 * G * KK) * L + l
        msk_row = n_img * (G * KK) * L + l
    ho = l32 // WO
    wo = l32 % WO
    pix_base = n_img * H * W * CIN
    y_out = (ho * STRIDE_H - PAD_H).to(tl.float32)
    x_out = (wo * STRIDE_W - PAD_W).to(tl.float32)
    return m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out


@triton.jit
def _tap_origin(tap, y_out, x_out, KW: tl.constexpr, DIL_H, DIL_W):
    """The undeformed sample point of tap (row-major over the kernel window): fp32 [BM] y and x."""
    i = tap // KW
    j = tap - i * KW
    return y_out + (i * DIL_H).to(tl.float32), x_out + (j * DIL_W).to(tl.float32)


@triton.jit
def _packed_step(x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, live, step, gc,
                 H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W,
                 KW: tl.constexpr, KK: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
                 HAS_MASK: tl.constexpr, GROUPED: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step `step` (= tap * chunks + chunk) of a packed-segment K loop of conv group gc: the blend weights as
    _pair_weights [BM, NSEG, 2] (fp32, mask folded in) and the corners as _corner_pairs [BM, NSEG, 2, SEG]
    (input dtype), so that they can be issued one step ahead. Positions with `live` False load nothing."""
    n_chunks = tl.cdiv(CIN_G, BLOCK_K)
    tap = step // n_chunks
    c0 = (step - tap * n_chunks) * BLOCK_K
    y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
    offs_s = tl.arange(0, NSEG)
    c_first = gc * CIN_G + c0 + offs_s * SEG
    p00, v00, v01, v10, v11, ly, lx, mv = _chunk_sample_points(
        off_ptr, msk_ptr, off_row, msk_row, c_first, c0 + offs_s * SEG < CIN_G, tap, COG, KK, L,
        y_ref, x_ref, pix_base, H, W, PIX, live, HAS_MASK)
    top, bottom = _corner_pairs(x_ptr, p00, _segment_channels(c_first, GS, SEG, GROUPED), v00, v01, v10, v11, W * PIX, PIX)
    wt, wb = _pair_weights(ly, lx, mv)
    return wt, wb, top, bottom


@triton.jit
def _weight_tile(w_ptr, rows, tap_row, k_ok, n_ok, offs_n, CIN_G, COUT_G, K_MAJOR: tl.constexpr, EVEN_K: tl.constexpr):
    """B tile [BK, BN] of the packed weight (pack_weight): rows (int64 [BK], k_ok which exist) of its
    groups*KK*Cin_g input-channel rows, all in the conv group and tap whose rows start at tap_row (int64), x output
    channels offs_n. (Both row forms are passed so that the N-major build keeps v11's exact code: deriving rows
    from tap_row changed its register allocation, and bf16 hires-g8 spilled; benchmarks/NOTES.md, v13.)"""
    if K_MAJOR:  # [groups, KK, Cout_g, Cin_g]
        ptrs = w_ptr + tap_row * COUT_G + (rows - tap_row)[:, None] + offs_n[None, :] * CIN_G
    else:  # [groups, KK, Cin_g, Cout_g]
        ptrs = w_ptr + rows[:, None] * COUT_G + offs_n[None, :]
    if EVEN_K:
        b = tl.load(ptrs, mask=n_ok[None, :], other=0.0)
    else:
        b = tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return b


@triton.jit
def _weight_tma_tile(w_ptr, tap_index, k0, n0, CIN_G, COUT_G, K_MAJOR: tl.constexpr):
    """_weight_tile through the TMA descriptor w_ptr (_weight_descriptor): B [BK, BN] of input channels k0.. (counted
    from the conv group's first) x output channels n0.. of tap_index = gc * KH*KW + tap. K_MAJOR reads the [BN, BK]
    block and transposes it in shared memory; its rows past the tap's Cout_g are the next tap's, which reach only
    accumulator columns that are never stored."""
    if K_MAJOR:
        b = w_ptr.load([tap_index * COUT_G + n0, k0]).T
    else:
        b = w_ptr.load([tap_index * CIN_G + k0, n0])
    return b


@triton.jit
def _pair_sums(g, top, bottom):
    """The 4 sums over each segment's channels that grad_mask and grad_offset are linear in, [BM, NSEG] each,
    from _corner_pairs and grad_col g [BM, NSEG, SEG] (fp32): sum g*c00, and sum g*d for the exact corner
    differences dx = c01 - c00, dy = c10 - c00, dy1 = c11 - c01 (each one rounding, as elementwise)."""
    top = top.to(tl.float32)
    right = (tl.arange(0, 2) == 1)[None, None, :, None]
    c00 = tl.sum(tl.where(right, 0.0, top), axis=2)
    dx = tl.sum(tl.where(right, top, -top), axis=2)
    sdy, sdy1 = tl.split(tl.sum(g[:, :, None, :] * (bottom.to(tl.float32) - top), axis=3))
    return tl.sum(g * c00, axis=2), tl.sum(g * dx, axis=2), sdy, sdy1


@triton.jit
def _mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv):
    """grad_mask, grad_offset_y, grad_offset_x of one sample point from its _pair_sums. The sampled value is
    val = c00 + lx*dx + ly*dy + lx*ly*(dy1 - dy), so grad_mask = sum g*val and grad_offset = mv * sum g *
    (d val/dy, d val/dx) = mv * ((1-lx)*dy + lx*dy1, dx + ly*(dy1 - dy)), summed over channels."""
    dd = sdy1 - sdy
    return s00 + lx * sdx + ly * sdy + lx * ly * dd, mv * (sdy + lx * dd), mv * (sdx + ly * dd)


@triton.jit
def _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, n0, W, CIN, CIN_G, COUT_G,
                 KK: tl.constexpr, SEG: tl.constexpr, EVEN_K: tl.constexpr, W_K_MAJOR: tl.constexpr, TMA: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """The forward's K steps of one tap and (long) segment s of conv group gc: acc [BM, BN] += A·B over the
    segment's channel chunks, A blended from the 4 corners of `sample` (_sample_point), B the weight tile of output
    channels n0.. (through its TMA descriptor w_ptr if TMA). The chunk loop is pipelined by Triton (num_stages)."""
    p00, v00, v01, v10, v11, ly, lx, mv = sample
    w00, w01, w10, w11 = _bilinear_weights(ly, lx, mv)
    dt = x_ptr.dtype.element_ty  # the blend's dtype (_blend): the weights rounded to it once a segment
    w00, w01, w10, w11 = w00.to(dt), w01.to(dt), w10.to(dt), w11.to(dt)
    c_lo = gc * CIN_G + s * SEG
    row0 = (gc * KK + tap) * CIN_G  # the tap's first weight row
    tap_row = row0.to(tl.int64)
    w_row = (row0 + s * SEG).to(tl.int64)
    for c0 in range(0, SEG, BLOCK_K):
        k_ok = c0 + offs_k < SEG
        c00, c01, c10, c11 = _load_corners(x_ptr, p00, c_lo + c0 + offs_k, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K)
        a = _blend(w00, w01, w10, w11, c00, c01, c10, c11)
        if TMA:
            b = _weight_tma_tile(w_ptr, gc * KK + tap, s * SEG + c0, n0, CIN_G, COUT_G, W_K_MAJOR)
        else:
            b = _weight_tile(w_ptr, w_row + c0 + offs_k, tap_row, k_ok, n_ok, offs_n, CIN_G, COUT_G, W_K_MAJOR, EVEN_K)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _deform_conv2d_fwd_kernel(
    # pointers
    x_ptr,        # input  NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read only if HAS_MASK)
    w_ptr,        # weight packed [groups, KH*KW, Cin_g, Cout_g], or [groups, KH*KW, Cout_g, Cin_g] if W_K_MAJOR;
                  # if TMA a descriptor of it (_weight_descriptor): [groups*KH*KW*Cin_g, Cout_g] in blocks
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
    PER_IMAGE: tl.constexpr,           # M tiles never cross an image (see _position_setup)
    GROUPED: tl.constexpr,             # NSEG > 1 only: the input in the offset-grouped layout
    SAMPLE_AHEAD: tl.constexpr,        # NSEG == 1 only: offsets and mask loaded one (tap, segment) step ahead
    TMA: tl.constexpr,                 # B tiles through the descriptor w_ptr (EVEN_K only)
    RUN_STORE: tl.constexpr,           # 0, or (NCHW output: out_sl == 1) elements a store along a plane (_run_store)
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
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = _position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, PER_IMAGE, BLOCK_M)
    L = HO * WO
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COUT_G
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the input's pixel stride (GROUPED: a constexpr, so Triton knows each corner run is SEG-aligned) and group stride
    PIX = SEG if GROUPED else CIN
    GS = (H * W).to(tl.int64) * SEG if GROUPED else 0

    # --- K loop, short segments: one flat loop over (tap, chunk of NSEG segments) steps, one sample point per
    # segment; the next step's offsets and corners are loaded before this step's blend and dot (by hand: the
    # chunk loop alone is too short for Triton's pipelining, e.g. 2 chunks a tap for 64 channels) ---
    if NSEG > 1:
        n_steps = KK * tl.cdiv(CIN_G, BLOCK_K)
        wt, wb, top, bottom = _packed_step(
            x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid, 0, gc,
            H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W, KW, KK, SEG, NSEG, HAS_MASK, GROUPED, BLOCK_K)
        for step in range(n_steps):
            # --- issue the next step's loads (none after the last step) ---
            nwt, nwb, ntop, nbottom = _packed_step(
                x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid & (step + 1 < n_steps),
                step + 1, gc, H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W, KW, KK, SEG, NSEG, HAS_MASK, GROUPED, BLOCK_K)
            # --- this step: blend, B tile, dot ---
            a = tl.reshape(_blend_pairs(wt, wb, top, bottom), (BLOCK_M, BLOCK_K))
            tap = step // tl.cdiv(CIN_G, BLOCK_K)
            c0 = (step - tap * tl.cdiv(CIN_G, BLOCK_K)) * BLOCK_K
            row0 = (gc * KK + tap) * CIN_G  # the tap's first weight row
            if TMA:
                b = _weight_tma_tile(w_ptr, gc * KK + tap, c0, pid_n * BLOCK_N, CIN_G, COUT_G, W_K_MAJOR)
            else:
                b = _weight_tile(w_ptr, (row0 + c0 + offs_k).to(tl.int64), row0.to(tl.int64), c0 + offs_k < CIN_G,
                                 n_ok, offs_n, CIN_G, COUT_G, W_K_MAJOR, EVEN_K)
            acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
            wt, wb, top, bottom = nwt, nwb, ntop, nbottom
    elif SAMPLE_AHEAD:  # --- K loop: (tap, segment) steps, each one's offsets and mask issued a step ahead ---
        n_segs = CIN_G // SEG
        n_steps = KK * n_segs
        ndy, ndx, nmv = _sample_loads(off_ptr, msk_ptr, off_row, msk_row, ((gc * CIN_G) // COG) * KK, L, m_valid,
                                      HAS_MASK)
        for ts in range(n_steps):
            tap = ts // n_segs
            s = ts - tap * n_segs
            dy, dx, mraw = ndy, ndx, nmv
            t1 = (ts + 1) // n_segs  # the next step's tap and first channel
            c1 = gc * CIN_G + (ts + 1 - t1 * n_segs) * SEG
            ndy, ndx, nmv = _sample_loads(off_ptr, msk_ptr, off_row, msk_row, (c1 // COG) * KK + t1, L,
                                          m_valid & (ts + 1 < n_steps), HAS_MASK)
            y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            sample = _sample_from(dy, dx, mraw, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
            acc = _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, pid_n * BLOCK_N, W, CIN,
                               CIN_G, COUT_G, KK, SEG, EVEN_K, W_K_MAJOR, TMA, DOT_PRECISION, BLOCK_K)
    else:  # --- K loop: taps x segments x channel chunks (sample point reused across a segment's chunks) ---
        for tap in range(KK):
            y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            for s in range(CIN_G // SEG):
                ch = ((gc * CIN_G + s * SEG) // COG) * KK + tap
                sample = _sample_point(
                    off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
                acc = _fwd_segment(acc, x_ptr, w_ptr, sample, gc, tap, s, offs_k, n_ok, offs_n, pid_n * BLOCK_N, W, CIN,
                                   CIN_G, COUT_G, KK, SEG, EVEN_K, W_K_MAJOR, TMA, DOT_PRECISION, BLOCK_K)

    # --- epilogue: bias, store in the output's layout ---
    co = gc * COUT_G + offs_n
    if HAS_BIAS:
        acc += tl.load(b_ptr + co, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    val = acc.to(out_ptr.dtype.element_ty)
    cols = (co.to(tl.int64) * out_sc)[None, :]
    if RUN_STORE > 0:
        # an NCHW output (out_sl == 1), and a whole tile inside one image: its positions are the run l0 .. l0 +
        # BLOCK_M - 1 of each channel plane, stored without a position mask and with the runs' alignment (a multiple
        # of RUN_STORE, as Ho*Wo and BLOCK_M are) stated, so that Triton vectorises the stores along them
        img0, l0 = _tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        if l0 + BLOCK_M <= L:
            start = tl.multiple_of(img0.to(tl.int64) * out_sn + l0, RUN_STORE)
            planes = tl.multiple_of(co.to(tl.int64) * out_sc, RUN_STORE)
            tl.store(out_ptr + (start + tl.arange(0, BLOCK_M))[:, None] + planes[None, :], val, mask=n_ok[None, :])
        else:  # the image's last tile, or (flat tiles) one across two images: positions recomputed here
            m_valid, n_img, l32 = _tile_positions(pid_m, M, L, PER_IMAGE, BLOCK_M)
            tl.store(out_ptr + (n_img * out_sn + l32.to(tl.int64) * out_sl)[:, None] + cols, val,
                     mask=m_valid[:, None] & n_ok[None, :])
    elif CONTIGUOUS_FLAT_STORE:
        # a tile inside one image stores its positions as the run l0 .. l0 + BLOCK_M - 1 (see CONTIGUOUS_FLAT_STORE)
        img0, l0 = _tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        if l0 + BLOCK_M <= L:
            rows = img0.to(tl.int64) * out_sn + (l0 + tl.arange(0, BLOCK_M)).to(tl.int64) * out_sl
            tl.store(out_ptr + rows[:, None] + cols, val, mask=n_ok[None, :])
        else:
            tl.store(out_ptr + (n_img * out_sn + l * out_sl)[:, None] + cols, val,
                     mask=m_valid[:, None] & n_ok[None, :])
    else:
        tl.store(out_ptr + (n_img * out_sn + l * out_sl)[:, None] + cols, val, mask=m_valid[:, None] & n_ok[None, :])


@triton.jit
def _scatter_add(ptrs, vals, mask, scale, FIXED: tl.constexpr):
    """grad_input's atomic add of fp32 vals: as fp32, or (FIXED, deterministic mode) as int64 fixed point
    round(vals * scale), whose sum does not depend on the order the programs add in."""
    if FIXED:
        v = vals * scale
        tl.atomic_add(ptrs, (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int64), mask=mask, sem="relaxed")
    else:
        tl.atomic_add(ptrs, vals, mask=mask, sem="relaxed")


@triton.jit
def _scatter_pairs(ptr, p00, cc, g, wt, wb, v00, v01, v10, v11, ROW, PIX, scale, FIXED: tl.constexpr, c_ok=None):
    """grad_input's adds at the 4 corners of each sample point, as _corner_pairs' two pairs: grad_col g
    [BM, NSEG, SEG] (fp32) times the _pair_weights wt, wb [BM, NSEG, 2] (channels c_ok excludes skipped)."""
    ptrs = _pair_pointers(ptr, p00, cc, PIX)
    if PAIR_AXIS_OUTER:
        pt = _pair_axis_outer(ptrs)
        _scatter_add(pt, _pair_axis_outer(g[:, :, None, :] * wt[:, :, :, None]),
                     _pair_axis_outer(_pair_mask(v00, v01, c_ok)), scale, FIXED)
        _scatter_add(pt + ROW, _pair_axis_outer(g[:, :, None, :] * wb[:, :, :, None]),
                     _pair_axis_outer(_pair_mask(v10, v11, c_ok)), scale, FIXED)
    else:
        _scatter_add(ptrs, g[:, :, None, :] * wt[:, :, :, None], _pair_mask(v00, v01, c_ok), scale, FIXED)
        _scatter_add(ptrs + ROW, g[:, :, None, :] * wb[:, :, :, None], _pair_mask(v10, v11, c_ok), scale, FIXED)


@triton.jit
def _grad_out_tile(go_ptr, tile, col, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The grad_out tile [BM, BN] of M tile `tile` (as _position_setup numbers them), channels col.., through its
    TMA descriptor go_ptr: [N, Ho*Wo, Cout] in blocks [1, BM, BN] for PER_IMAGE tiles, else [M, Cout] in blocks
    [BM, BN]. Rows past an image or past M read zeros."""
    if PER_IMAGE:
        img, l0 = _tile_start(tile, L, PER_IMAGE, BLOCK_M)
        return tl.reshape(go_ptr.load([img, l0, col]), (BLOCK_M, BLOCK_N))
    else:
        return go_ptr.load([tile * BLOCK_M, col])


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
                go = _grad_out_tile(go_ptr, pid_m, gc * COUT_G + n0, L, PER_IMAGE, BLOCK_M, BLOCK_N)
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
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read only if HAS_MASK)
    w_ptr,        # weight packed [groups, KH*KW, Cin_g, Cout_g]; if TMA a descriptor of it as [groups*KH*KW*Cin_g,
                  # Cout_g], blocks [BLOCK_K, BLOCK_N]
    go_ptr,       # grad_out [N, Cout, Ho, Wo], strides below; if TMA and not GO_RESIDENT a descriptor (_grad_out_tile)
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
    FIXED_GIN: tl.constexpr,      # deterministic mode: grad_input in int64 fixed point (see _scatter_add)
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PER_IMAGE: tl.constexpr,      # M tiles never cross an image (see _position_setup)
    GO_RESIDENT: tl.constexpr,    # one conv group and Cout <= BLOCK_N: the grad_out tile is loaded once
    TAP_SPLIT: tl.constexpr,      # programs per M tile, each taking a run of taps (more programs for few positions)
    GROUPED: tl.constexpr,        # NSEG > 1 only: input and grad_input in the offset-grouped layout
    TMA: tl.constexpr,            # weight (and grad_out) tiles through descriptors (EVEN_K only)
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
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = _position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, PER_IMAGE, BLOCK_M)
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
        GS = (H * W).to(tl.int64) * SEG if GROUPED else 0
        for tap in range(tap_lo, tap_hi):
            y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
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
                    p00, v00, v01, v10, v11, ly, lx, mv = _chunk_sample_points(
                        off_ptr, msk_ptr, off_row, msk_row, c_first, seg_ok, tap, COG, KK, L,
                        y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK)
                    cc = _segment_channels(c_first, GS, SEG, GROUPED)
                    g3 = tl.reshape(gcol, (BLOCK_M, NSEG, SEG))
                    ch = (c_first // COG) * KK + tap
                    done = m_valid[:, None] & seg_ok[None, :]
                    # grad_mask and grad_offset from 4 channel sums (fewer operations per element: hires-g8's
                    # kernel 1.86 -> 1.77 ms)
                    if NEED_GMSK or NEED_GOFF:
                        top, bottom = _corner_pairs(x_ptr, p00, cc, v00, v01, v10, v11, W * PIX, PIX)
                        s00, sdx, sdy, sdy1 = _pair_sums(g3, top, bottom)
                        g_m, g_y, g_x = _mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv)
                        if NEED_GMSK:
                            tl.store(gmsk_ptr + msk_row[:, None] + (ch.to(tl.int64) * L)[None, :],
                                     g_m.to(gmsk_ptr.dtype.element_ty), mask=done)
                        if NEED_GOFF:
                            gy_row = off_row[:, None] + ((2 * ch).to(tl.int64) * L)[None, :]
                            tl.store(goff_ptr + gy_row, g_y.to(goff_ptr.dtype.element_ty), mask=done)
                            tl.store(goff_ptr + gy_row + L, g_x.to(goff_ptr.dtype.element_ty), mask=done)
                    if NEED_GIN:
                        wt, wb = _pair_weights(ly, lx, mv)
                        _scatter_pairs(gin_ptr, p00, cc, g3, wt, wb, v00, v01, v10, v11, W * PIX, PIX, scale, FIXED_GIN)
    else:  # --- taps x offset groups x segments x channel chunks, each chunk's corners as pairs [BM, 1, 2, BK] ---
        # (the packed loop's helpers with one segment a chunk: grad_col leaves the MMA layout twice a chunk;
        # elementwise against 4 separately loaded corners, with 3 sums, Triton moved 10 [BM, BK] fp32 tiles
        # between layouts a chunk. H200 fp16, the kernel: det-s3 1.323 -> 0.953 ms, det-s4 0.725 -> 0.604)
        for tap in range(tap_lo, tap_hi):
            y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
            for og in range(G):
                ch = og * KK + tap
                p00, v00, v01, v10, v11, ly, lx, mv = _sample_point(
                    off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
                p00, v00, v01, v10, v11 = p00[:, None], v00[:, None], v01[:, None], v10[:, None], v11[:, None]
                ly, lx, mv = ly[:, None], lx[:, None], mv[:, None]  # [BM, 1]: one segment
                wt, wb = _pair_weights(ly, lx, mv)
                s00 = tl.zeros((BLOCK_M, 1), tl.float32)  # the _pair_sums over all of the group's channels
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
                        g3 = tl.reshape(gcol, (BLOCK_M, 1, BLOCK_K))
                        # --- corner pairs, sums over channels, scatter ---
                        if NEED_GMSK or NEED_GOFF:
                            top, bottom = _corner_pairs(x_ptr, p00, cc, v00, v01, v10, v11, W * CIN, CIN, c_ok)
                            a00, adx, ady, ady1 = _pair_sums(g3, top, bottom)
                            s00 += a00
                            sdx += adx
                            sdy += ady
                            sdy1 += ady1
                        if NEED_GIN:
                            _scatter_pairs(gin_ptr, p00, cc, g3, wt, wb, v00, v01, v10, v11, W * CIN, CIN, scale, FIXED_GIN,
                                           c_ok)
                # --- this (tap, offset group) is complete: store its offset and mask gradients ---
                g_m, g_y, g_x = _mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv)
                done = m_valid[:, None]
                if NEED_GOFF:
                    gy_row = off_row[:, None] + (2 * ch).to(tl.int64) * L
                    tl.store(goff_ptr + gy_row, g_y.to(goff_ptr.dtype.element_ty), mask=done)
                    tl.store(goff_ptr + gy_row + L, g_x.to(goff_ptr.dtype.element_ty), mask=done)
                if NEED_GMSK:
                    tl.store(gmsk_ptr + msk_row[:, None] + ch.to(tl.int64) * L, g_m.to(gmsk_ptr.dtype.element_ty),
                             mask=done)


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
            go = _grad_out_tile(go_ptr, mb, gc * COUT_G + pid_n * BLOCK_N, L, PER_IMAGE, BLOCK_M, BLOCK_N)
        else:
            m_valid, n_img, l32 = _tile_positions(mb, M, L, PER_IMAGE, BLOCK_M)
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
    msk_ptr,      # mask   NCHW [N, G*KH*KW, Ho, Wo]         (read only if HAS_MASK)
    go_ptr,       # grad_out [N, Cout, Ho, Wo], strides below; if TMA a descriptor (_grad_out_tile)
    gw_ptr,       # where the SPLIT sums go, strides below, cast to its dtype: fp32 partial sums [SPLIT, groups, KH*KW,
                  # Cin_g, Cout_g], or with SPLIT 1 grad_weight itself [Cout, Cin_g, KH, KW] in the weight's dtype and layout
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
    PER_IMAGE: tl.constexpr,      # M tiles never cross an image (see _position_setup)
    GROUPED: tl.constexpr,        # NSEG > 1 only: the input in the offset-grouped layout
    TMA: tl.constexpr,            # grad_out tiles through the descriptor go_ptr
    NEED_BIAS: tl.constexpr,      # GROUPS more rows of programs (the first) sum grad_out's channels for grad_bias
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
    GS = (H * W).to(tl.int64) * SEG if GROUPED else 0

    # --- M loop (this split's share) ---
    if PER_IMAGE:
        m_tiles = (M // L) * tl.cdiv(L, BLOCK_M)
    else:
        m_tiles = tl.cdiv(M, BLOCK_M)
    for mb in range(pid_s, m_tiles, SPLIT):
        m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = _position_setup(
            mb, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, PER_IMAGE, BLOCK_M)
        y_ref, x_ref = _tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
        if NSEG > 1:
            offs_s = tl.arange(0, NSEG)
            c_first = c_lo + kb * BLOCK_K + offs_s * SEG
            p00, v00, v01, v10, v11, ly, lx, mv = _chunk_sample_points(
                off_ptr, msk_ptr, off_row, msk_row, c_first, kb * BLOCK_K + offs_s * SEG < CIN_G, tap, COG, KK, L,
                y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK)
            top, bottom = _corner_pairs(x_ptr, p00, _segment_channels(c_first, GS, SEG, GROUPED), v00, v01, v10, v11,
                                        W * PIX, PIX)
            wt, wb = _pair_weights(ly, lx, mv)
            # A blended in fp32 here (see Precision in the module docstring)
            a = tl.reshape(_blend_pairs(wt, wb, top.to(tl.float32), bottom.to(tl.float32)), (BLOCK_M, BLOCK_K))
        else:
            p00, v00, v01, v10, v11, ly, lx, mv = _sample_point(
                off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
            c00, c01, c10, c11 = _load_corners(x_ptr, p00, c_lo + offs_k, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K)
            w00, w01, w10, w11 = _bilinear_weights(ly, lx, mv)
            a = _blend(w00, w01, w10, w11,  # in fp32 (see Precision in the module docstring)
                       c00.to(tl.float32), c01.to(tl.float32), c10.to(tl.float32), c11.to(tl.float32))
        if TMA:
            go = _grad_out_tile(go_ptr, mb, gc * COUT_G + pid_n * BLOCK_N, L, PER_IMAGE, BLOCK_M, BLOCK_N)
        else:
            go_cols = (gc * COUT_G + offs_n).to(tl.int64) * go_sc
            go = tl.load(go_ptr + (n_img * go_sn + l * go_sl)[:, None] + go_cols[None, :],
                         mask=m_valid[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(a.to(go.dtype)), go, acc, input_precision=DOT_PRECISION)

    # --- store this split's sum (a partial, or grad_weight itself) ---
    rows = (gc.to(tl.int64) * gw_sg + (tap // KW) * gw_sh + (tap % KW) * gw_sw
            + (s * SEG + offs_k).to(tl.int64) * gw_si)
    dst = gw_ptr + pid_s.to(tl.int64) * gw_ss + rows[:, None] + offs_n.to(tl.int64)[None, :] * gw_so
    tl.store(dst, acc.to(gw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


@triton.jit
def _tile_of(t, TILES_X, TILES_Y):
    """A flat program index t of a fused layout launch as its (x tile, y tile, z int64): x fastest, then y."""
    return t % TILES_X, (t // TILES_X) % TILES_Y, (t // (TILES_X * TILES_Y)).to(tl.int64)


@triton.jit
def _transpose_tile(src_ptr, dst_ptr, zero_ptr, sum_ptr, A, B, pid_a, pid_b, n, tiles_b,
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
    _transpose_tile(src_ptr, dst_ptr, zero_ptr, sum_ptr, A, B, tl.program_id(0), tl.program_id(1),
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
        pid_a, pid_b, n = _tile_of(pid, TILES_A1, TILES_B1)
        _transpose_tile(src1_ptr, dst1_ptr, zero1_ptr, sum1_ptr, A1, B1, pid_a, pid_b, n, TILES_B1, ZERO1, SUM1,
                        BLOCK_A1, BLOCK_B1)
    else:
        pid_a, pid_b, n = _tile_of(pid - PROGRAMS1, TILES_A2, TILES_B2)
        _transpose_tile(src2_ptr, dst2_ptr, zero2_ptr, sum2_ptr, A2, B2, pid_a, pid_b, n, TILES_B2, ZERO2, SUM2,
                        BLOCK_A2, BLOCK_B2)


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
        pid_o, pid_i, g = _tile_of(pid, TILES_O, TILES_I)
        _pack_weight_tile(w_ptr, wp_ptr, CIN_G, COUT_G, w_so, w_si, w_sh, w_sw, pid_o, pid_i, g, KH, KW, K_MAJOR, TAPS,
                          BLOCK_O, BLOCK_I)
    else:
        pid_a, pid_b, n = _tile_of(pid - PACK_PROGRAMS, TILES_A, TILES_B)
        _transpose_tile(src_ptr, dst_ptr, dst_ptr, dst_ptr, A, B, pid_a, pid_b, n, TILES_B, False, False, BLOCK_A,
                        BLOCK_B)


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


@triton.jit
def _finish_grads_kernel(
    pw_ptr,       # fp32 [SPLIT_W, groups, KH*KW, Cin_g, Cout_g]: grad_weight's partial sums, packed (read if HAS_W)
    gw_ptr,       # grad_weight [Cout, Cin_g, KH, KW] in the weight's dtype, strides below (written if HAS_W)
    pb_ptr,       # fp32 [SPLIT_B, Cout]: grad_bias's partial sums (read if HAS_B)
    gb_ptr,       # grad_bias [Cout] in the weight's dtype (written if HAS_B)
    NUMEL_W, CIN_G, COUT_G, COUT, SPLIT_W, SPLIT_B,
    gw_so, gw_si, gw_sh, gw_sw,   # grad_weight's strides in elements: output channel, input channel, tap row, column
    KH: tl.constexpr, KW: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
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
            tl.store(gw_ptr + dst, acc.to(gw_ptr.dtype.element_ty), mask=ok)
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
            tl.store(gb_ptr + offs_c, acc.to(gb_ptr.dtype.element_ty), mask=c_ok)


# --- launchers -----------------------------------------------------------------------------------------


_TRANSPOSES: Dict[tuple, "_Launch"] = {}


def _transpose_blocks(a: int, b: int) -> Tuple[int, int]:
    """_transpose_kernel's (BLOCK_A, BLOCK_B): 64 x 64 tiles; a short side (the few channels of an offset group) gets
    its own size, the other the rest."""
    block_a = _pow2_clamp(a, 8, 64) if b >= a else 4096 // _pow2_clamp(b, 8, 64)
    return block_a, 4096 // block_a


def _transpose_tiles(a: int, b: int) -> Tuple[int, int, int, int]:
    """An [a, b] -> [b, a] pass's (BLOCK_A, BLOCK_B, tiles along a, tiles along b): see _transpose_blocks."""
    block_a, block_b = _transpose_blocks(a, b)
    return block_a, block_b, triton.cdiv(a, block_a), triton.cdiv(b, block_b)


def _transpose_key(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor], sums: Optional[Tensor]) -> tuple:
    """What a transpose pass's launch is specialised on (beside the device): dtypes, images, sizes, 16-byte
    alignments, and which extras (zero, sums) it has."""
    extras = tuple((t.dtype, t.data_ptr() % 16 == 0) if t is not None else None for t in (zero, sums))
    return (src.dtype, out.dtype, src.shape[0], a, b, src.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, extras)


def _transpose_tensors(src: Tensor, out: Tensor, zero: Optional[Tensor], sums: Optional[Tensor]) -> List[Tensor]:
    """A transpose pass's pointer arguments (src, dst, zero, sums): a missing extra falls back to out, never written."""
    return [src, out, zero if zero is not None else out, sums if sums is not None else out]


def _transpose_last(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor] = None,
                    sums: Optional[Tensor] = None, jobs: Optional[list] = None) -> Tensor:
    """out (viewed [N, b, a]) = src (viewed [N, a, b]) transposed, with out's dtype. zero: a tensor of out's size
    zeroed in the same pass; sums: fp32 [N, cdiv(b, BLOCK_B), a] that receives src's sums over b by tiles
    (_transpose_sum_rows). jobs: a list that receives the pass instead, for run_transposes."""
    if jobs is not None:
        jobs.append((src, a, b, out, zero, sums))
        return out
    return _transpose_one(src, a, b, out, zero, sums)


def _transpose_one(src: Tensor, a: int, b: int, out: Tensor, zero: Optional[Tensor],
                   sums: Optional[Tensor]) -> Tensor:
    """_transpose_last's pass: one _transpose_kernel launch."""
    key = (src.device, _transpose_key(src, a, b, out, zero, sums))
    run = _TRANSPOSES.get(key)
    if run is None:
        block_a, block_b, tiles_a, tiles_b = _transpose_tiles(a, b)
        run = _remember(_TRANSPOSES, key, _Launch(_transpose_kernel, (tiles_a, tiles_b, src.shape[0]), (a, b),
                                                  dict(ZERO=zero is not None, SUM=sums is not None, BLOCK_A=block_a,
                                                       BLOCK_B=block_b, num_warps=4)))
    run(*_transpose_tensors(src, out, zero, sums))
    return out


# The backward's two layout passes (grad_out's and the input's copies) in one launch where both are passes
# (_transpose_pair_kernel): one launch fewer a chunk, some 25-30 us of host time each on the H200's host (v24).
PAIRED_TRANSPOSES = True
_TRANSPOSE_PAIRS: Dict[tuple, "_Launch"] = {}


def run_transposes(jobs: list) -> None:
    """Run the passes _transpose_last collected in jobs: two in one launch (PAIRED_TRANSPOSES), else one by one."""
    if len(jobs) == 2 and PAIRED_TRANSPOSES:
        _transpose_pair(*jobs)
    else:
        for job in jobs:
            _transpose_one(*job)
    jobs.clear()


def _transpose_pair(first: tuple, second: tuple) -> None:
    """_transpose_last's two passes (src, a, b, out, zero, sums) in one _transpose_pair_kernel launch."""
    key = (first[0].device, _transpose_key(*first), _transpose_key(*second))
    run = _TRANSPOSE_PAIRS.get(key)
    if run is None:
        sizes, meta = [], dict(num_warps=4)
        for i, (src, a, b, out, zero, sums) in enumerate((first, second), 1):
            block_a, block_b, tiles_a, tiles_b = _transpose_tiles(a, b)
            sizes.append((a, b, tiles_a, tiles_b, tiles_a * tiles_b * src.shape[0]))
            meta.update({f"ZERO{i}": zero is not None, f"SUM{i}": sums is not None, f"BLOCK_A{i}": block_a,
                         f"BLOCK_B{i}": block_b})
        grid = (sizes[0][4] + sizes[1][4],)
        run = _remember(_TRANSPOSE_PAIRS, key, _Launch(_transpose_pair_kernel, grid, (*sizes[0], *sizes[1][:4]), meta))
    src1, _, _, out1, zero1, sums1 = first
    src2, _, _, out2, zero2, sums2 = second
    run(*_transpose_tensors(src1, out1, zero1, sums1), *_transpose_tensors(src2, out2, zero2, sums2))


@functools.lru_cache(maxsize=256)
def _transpose_sum_rows(a: int, b: int) -> int:
    """Rows of sums per image that _transpose_last writes for an [a, b] -> [b, a] transpose."""
    return triton.cdiv(b, _transpose_blocks(a, b)[1])


_CHANNEL_SUMS: Dict[tuple, "_Launch"] = {}


def _channel_sum(t: Tensor) -> Tensor:
    """Partial sums over N, H, W of an [N, C, H, W] tensor (NCHW or channels-last): [P, C] fp32, one row per program
    (P = N * position tiles), for _finish_grads to add in a fixed order."""
    if not t.is_contiguous(memory_format=torch.channels_last):
        t = t.contiguous()
    n, c, h, w = t.shape
    rows, block_c = 256, _pow2_clamp(c, 1, 128)
    part = torch.empty((n, _ceil_div(h * w, rows), c), dtype=torch.float32, device=t.device)
    if part.numel():
        # image, position l = h*W + w (a size-1 dim's stride is arbitrary: W = 1 steps along H), channel
        strides = (t.stride(0), t.stride(3) if w > 1 else t.stride(2), t.stride(1))
        key = (t.device, t.dtype, n, h * w, c, strides, t.data_ptr() % 16 == 0)
        run = _CHANNEL_SUMS.get(key)
        if run is None:
            grid = (part.shape[1], _ceil_div(c, block_c), n)
            run = _remember(_CHANNEL_SUMS, key, _Launch(_channel_sum_kernel, grid, (h * w, c, *strides),
                                                        dict(ROWS=rows, BLOCK_P=32, BLOCK_C=block_c, num_warps=4)))
        run(t, part)
    return part.view(-1, c)


# The layout copies below run Triton kernels on CUDA (_transpose_kernel; pack_weight's _pack_weight_kernel); on the
# CPU (Triton's interpreter) torch's copies, which are much faster there, unless this is set (tests: the kernel path
# as the GPU runs it, under the interpreter).
LAYOUT_KERNELS_ON_CPU = False


def _layout_kernel(t: Tensor) -> bool:
    """Whether a layout copy of t goes through a Triton kernel (_transpose_kernel, _pack_weight_kernel): a non-empty
    tensor on CUDA, or see LAYOUT_KERNELS_ON_CPU."""
    return t.numel() > 0 and (t.device.type == "cuda" or LAYOUT_KERNELS_ON_CPU)


def _nhwc_pass(t: Tensor) -> bool:
    """Whether _nhwc copies t in a transpose pass (not channels_last already, and _layout_kernel)."""
    return not t.is_contiguous(memory_format=torch.channels_last) and _layout_kernel(t)


def _nhwc(t: Tensor, zero: Optional[Tensor] = None, sums: Optional[Tensor] = None,
          jobs: Optional[list] = None) -> Tensor:
    """The tensor's data in NHWC order: itself if channels_last already, else one transpose pass. zero: a tensor of
    t's size to zero, in that pass where there is one (else zeroed here); sums: see _nhwc_summed (pass only); jobs:
    see _transpose_last (the copy is then written when they run)."""
    if not _nhwc_pass(t):
        if zero is not None:
            zero.zero_()
        return t.contiguous(memory_format=torch.channels_last)
    t = t.contiguous()
    n, c, h, w = t.shape
    out = torch.empty_like(t, memory_format=torch.channels_last)
    return _transpose_last(t, c, h * w, out, zero, sums, jobs)


def _nhwc_summed(t: Tensor, jobs: Optional[list] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(_nhwc(t), and where that is a transpose pass, t's fp32 channel sums by tiles of positions from the same pass,
    [N * tiles, C], for _finish_grads; else None). jobs: see _nhwc."""
    if not _nhwc_pass(t):
        return _nhwc(t), None
    n, c, h, w = t.shape
    sums = torch.empty((n, _transpose_sum_rows(c, h * w), c), dtype=torch.float32, device=t.device)
    return _nhwc(t, sums=sums, jobs=jobs), sums.view(-1, c)


def _offset_grouped(t: Tensor, offset_groups: int, zero: Optional[Tensor] = None,
                    jobs: Optional[list] = None) -> Tensor:
    """The tensor's data as [N, G, H, W, C/G] (each offset group's channels of a pixel contiguous, pixels of
    one group contiguous): one transpose pass from NCHW, a permuting copy from channels_last. zero: a tensor of t's
    size to zero, in that pass where there is one; jobs: see _nhwc."""
    n, c, h, w = t.shape
    cog = c // offset_groups
    if t.is_contiguous() and _layout_kernel(t):
        out = _offset_grouped_empty(t, offset_groups)
        _transpose_last(t.view(n * offset_groups, cog, h * w), cog, h * w, out.view(n * offset_groups, h * w, cog),
                        zero, jobs=jobs)
        return out
    if zero is not None:
        zero.zero_()
    return t.permute(0, 2, 3, 1).reshape(n, h, w, offset_groups, cog).permute(0, 3, 1, 2, 4).contiguous()


def _offset_grouped_empty(t: Tensor, offset_groups: int) -> Tensor:
    """An empty [N, G, H, W, C/G] buffer for t's data in the offset-grouped layout (t's dtype and device)."""
    n, c, h, w = t.shape
    return torch.empty((n, offset_groups, h, w, c // offset_groups), dtype=t.dtype, device=t.device)


def _from_offset_grouped(buf: Tensor, out: Tensor) -> Tensor:
    """out [N, C, H, W] (NCHW-contiguous or channels_last, any dtype) = a [N, G, H, W, C/G] buffer (G = 1:
    an NHWC buffer)."""
    n, g, h, w, cog = buf.shape
    if out.is_contiguous() and _layout_kernel(out):
        _transpose_last(buf.view(n * g, h * w, cog), h * w, cog, out.view(n * g, cog, h * w))
        return out
    out.unflatten(1, (g, cog)).copy_(buf.permute(0, 1, 4, 2, 3))
    return out


_PACKS: Dict[tuple, "_Launch"] = {}


def pack_weight(weight: Tensor, groups: int, k_major: bool = False, dtype: Optional[torch.dtype] = None) -> Tensor:
    """[Cout, Cin_g, kh, kw] -> [groups, kh*kw, Cin_g, Cout_g] contiguous (tap-major rows of the B tile), or
    with k_major [groups, kh*kw, Cout_g, Cin_g] (each output channel's input channels contiguous), in dtype
    (default: the weight's). One _pack_weight_kernel pass where _layout_kernel (torch's permuting copy took 17.8 us
    for det-s5's 512x512x3x3 fp16 weight on the H200), else torch's copies."""
    cout, cin_g, kh, kw = weight.shape
    dtype = weight.dtype if dtype is None else dtype
    cout_g = cout // groups
    if not _layout_kernel(weight):
        w = weight.to(dtype).reshape(groups, cout_g, cin_g, kh * kw)
        return (w.permute(0, 3, 1, 2) if k_major else w.permute(0, 3, 2, 1)).contiguous()
    out = _packed_empty(weight, groups, k_major, dtype)
    key = (weight.device, weight.dtype, dtype, weight.shape, weight.stride(), groups, k_major,
           weight.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
    run = _PACKS.get(key)
    if run is None:
        block_o, block_i, taps = _pack_blocks(weight.shape, groups, k_major)
        grid = (triton.cdiv(cout_g, block_o), triton.cdiv(cin_g, block_i), groups)
        meta = dict(KH=kh, KW=kw, K_MAJOR=k_major, TAPS=taps, BLOCK_O=block_o, BLOCK_I=block_i, num_warps=4)
        run = _remember(_PACKS, key, _Launch(_pack_weight_kernel, grid, (cin_g, cout_g, *weight.stride()), meta))
    run(weight, out)
    return out


def _packed_empty(weight: Tensor, groups: int, k_major: bool, dtype: torch.dtype) -> Tensor:
    """An empty packed weight (pack_weight's layout) in dtype, on the weight's device."""
    cout, cin_g, kh, kw = weight.shape
    shape = (groups, kh * kw, cout // groups, cin_g) if k_major else (groups, kh * kw, cin_g, cout // groups)
    return torch.empty(shape, dtype=dtype, device=weight.device)


def _pack_blocks(shape: Sequence[int], groups: int, k_major: bool) -> Tuple[int, int, int]:
    """_pack_weight_tile's (BLOCK_O, BLOCK_I, TAPS) for a weight [Cout, Cin_g, kh, kw]: 4096-element tiles, up to 64
    along the written side (contiguous in the packed layout), all taps."""
    cout, cin_g, kh, kw = shape
    taps = triton.next_power_of_2(kh * kw)
    side = min(_pow2_clamp(cin_g if k_major else cout // groups, 1, 64), max(4096 // taps, 1))
    other = max(4096 // (taps * side), 1)
    block_i, block_o = (side, other) if k_major else (other, side)
    return block_o, block_i, taps


# The forward packs the weight in the launch that copies an NCHW input (_pack_and_transpose_kernel): v23, H200, graph,
# fp16: det-s3 0.228 -> 0.225 ms, cls-14 0.071 -> 0.070, hires-g8 0.359 -> 0.357 (benchmarks/NOTES.md).
FUSED_PREP = True
_PACK_AND_TRANSPOSE: Dict[tuple, "_Launch"] = {}


def forward_operands(input: Tensor, weight: Tensor, groups: int, offset_groups: int, grouped: bool,
                     k_major: bool) -> Tuple[Tensor, Tensor]:
    """The forward's input in the layout its kernel reads (NHWC, or offset-grouped if grouped) and its packed weight
    (pack_weight, in the input's dtype). Where both are Triton passes (an NCHW-contiguous input), one launch of
    _pack_and_transpose_kernel does both."""
    if not (FUSED_PREP and input.is_contiguous() and not input.is_contiguous(memory_format=torch.channels_last)
            and _layout_kernel(input) and _layout_kernel(weight)):
        x = _offset_grouped(input, offset_groups) if grouped else _nhwc(input)
        return x, pack_weight(weight, groups, k_major, input.dtype)
    n, c, h, w = input.shape
    cout, cin_g, kh, kw = weight.shape
    cout_g = cout // groups
    if grouped:
        x = _offset_grouped_empty(input, offset_groups)
        a, images = c // offset_groups, n * offset_groups
    else:
        x = torch.empty((n, c, h, w), dtype=input.dtype, device=input.device, memory_format=torch.channels_last)
        a, images = c, n
    wp = _packed_empty(weight, groups, k_major, input.dtype)
    key = (input.device, input.dtype, weight.dtype, input.shape, weight.shape, weight.stride(), groups, offset_groups,
           grouped, k_major, *(t.data_ptr() % 16 == 0 for t in (input, x, weight, wp)))
    run = _PACK_AND_TRANSPOSE.get(key)
    if run is None:
        block_o, block_i, taps = _pack_blocks(weight.shape, groups, k_major)
        block_a, block_b, *tiles_ab = _transpose_tiles(a, h * w)
        tiles = (triton.cdiv(cout_g, block_o), triton.cdiv(cin_g, block_i))
        pack_programs = tiles[0] * tiles[1] * groups
        grid = (pack_programs + tiles_ab[0] * tiles_ab[1] * images,)
        args = (cin_g, cout_g, *weight.stride(), a, h * w, *tiles, pack_programs, *tiles_ab)
        meta = dict(KH=kh, KW=kw, K_MAJOR=k_major, TAPS=taps, BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_A=block_a,
                    BLOCK_B=block_b, num_warps=4)
        run = _remember(_PACK_AND_TRANSPOSE, key, _Launch(_pack_and_transpose_kernel, grid, args, meta))
    run(weight, wp, input, x)
    return x, wp


def _grad_weight_like(weight: Tensor) -> Tensor:
    """An empty grad_weight: the weight's shape, dtype and memory format."""
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device, memory_format=suggest_memory_format(weight))


_FINISHES: Dict[tuple, "_Launch"] = {}


def _finish_grads(weight: Tensor, pw: Optional[Tensor], pb: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(grad_weight, grad_bias) in the weight's dtype (grad_weight in its memory format) from fp32 partial sums, in one
    launch: pw [split, groups, kh*kw, Cin_g, Cout_g] (pack_weight's layout), pb [splits, Cout]; None for a missing
    one (and None returned for it). The partials' fixed-order sums, the inverse of pack_weight and the casts, which
    took up to five operations before v21 (sum, permuting copy, sum, cast)."""
    cout, cin_g, kh, kw = weight.shape
    gw = _grad_weight_like(weight) if pw is not None else None
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
    key = (weight.device, weight.dtype, weight.shape, strides, split_w, split_b, pw is not None, pb is not None,
           tuple(t.data_ptr() % 16 == 0 for t in pointers))
    run = _FINISHES.get(key)
    if run is None:
        block, block_c = 1024, _pow2_clamp(cout, 16, 64)
        w_blocks = _ceil_div(numel, block) if pw is not None else 0
        b_blocks = _ceil_div(cout, block_c) if pb is not None else 0
        cout_g = pw.shape[-1] if pw is not None else cout
        run = _remember(_FINISHES, key, _Launch(
            _finish_grads_kernel, (w_blocks + b_blocks,),
            (numel, cin_g, cout_g, cout, split_w, split_b, *strides),
            dict(KH=kh, KW=kw, HAS_W=pw is not None, HAS_B=pb is not None, BLOCK=block, BLOCK_C=block_c, ROWS=32,
                 num_warps=4)))
    run(*pointers)
    return gw, gb


def _position_strides(t: Tensor) -> Tuple[int, int, int]:
    """(image, position, channel) element strides of a [N, C, Ho, Wo] tensor whose positions are dense
    (l = ho*Wo + wo has one stride): NCHW-contiguous or channels_last."""
    n_s, c_s, h_s, w_s = t.stride()
    assert h_s == t.shape[3] * w_s or t.shape[2] == 1, "positions must be dense"
    return n_s, w_s, c_s


def _sizes(geo: ConvGeometry):
    """The kernels' runtime size arguments: H, W, CIN, HO, WO, M, CIN_G, COUT_G, COG, G."""
    return (
        geo.height, geo.width, geo.in_channels, geo.out_h, geo.out_w, geo.batch * geo.out_h * geo.out_w,
        geo.in_channels // geo.groups, geo.out_channels // geo.groups, geo.in_channels // geo.offset_groups,
        geo.offset_groups,
    )


def _shape_class(kind: str, geo: ConvGeometry, dtype: torch.dtype, seg: int, has_mask: bool) -> tuple:
    """Tuning cache key: what changes the best config (channels, kernel, segment, dtype, M magnitude)."""
    m = geo.batch * geo.out_h * geo.out_w
    return (kind, dtype, geo.in_channels // geo.groups, geo.out_channels // geo.groups, seg, geo.kernel_h,
            geo.kernel_w, has_mask, triton.next_power_of_2(m), torch.backends.cudnn.allow_tf32)


# A launch plan per call signature (shapes, strides, dtype, device, geometry, flags, pointer alignment): the
# geometry, the chosen configs, grids and the kernels' runtime arguments, worked out once. At small shapes
# the Python that derives them, and Triton's own per-call argument handling, cost as much as the kernels.
_PLANS: Dict[tuple, dict] = {}
_MAX_PLANS = 512


def _plan_key(kind: str, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor], stride, padding,
              dilation, pointers: Sequence[Tensor], *extra) -> tuple:
    # Triton specialises a kernel on each pointer's 16-byte alignment: part of the key.
    aligned = tuple(t.data_ptr() % 16 == 0 for t in pointers)
    return (kind, input.shape, input.stride(), input.dtype, input.device, offset.shape, weight.shape,
            mask is None, tuple(stride), tuple(padding), tuple(dilation), torch.backends.cudnn.allow_tf32,
            autotune_enabled(), aligned, *extra)


def _remember(cache: dict, key: tuple, value):
    """cache[key] = value, the cache emptied first when it holds _MAX_PLANS entries."""
    if len(cache) >= _MAX_PLANS:
        cache.clear()
    cache[key] = value
    return value


def fast_launch_enabled() -> bool:
    return os.environ.get("DEFORMCONV_FAST_LAUNCH", "1") not in ("", "0")


class _Launch:
    """One kernel launch of a plan: grid, runtime arguments and constexprs fixed, tensors given per call.

    The first call goes through Triton's JIT (compiling if needed). Later calls hand the tensors straight to
    the compiled kernel's launcher, skipping Triton's per-call argument binding, specialisation and cache
    lookup (tens of microseconds of Python a launch). That is valid because the plan key fixes everything
    Triton specialises on: the integer arguments, the dtypes and each pointer's alignment. Under the
    interpreter, or with DEFORMCONV_FAST_LAUNCH=0, every call goes through the JIT."""

    def __init__(self, fn, grid: tuple, args: tuple, meta: dict):
        self.fn, self.args, self.meta = fn, args, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled launcher wants all 3 grid dims
        self.runner = None
        self.tail: tuple = ()
        self.fast = fast_launch_enabled()

    def __call__(self, *tensors: Tensor) -> None:
        if self.runner is not None:
            try:
                self.runner(*tensors, *self.args, *self.tail)
                return
            except (TypeError, IndexError, ValueError):  # raised before launching: this Triton's launcher
                self.runner, self.fast = None, False     # wants other arguments; stay on the JIT path
        compiled = self.fn[self.grid](*tensors, *self.args, **self.meta)
        if self.fast and hasattr(compiled, "packed_metadata") and hasattr(compiled, "__getitem__"):
            # the launcher takes every parameter in signature order, constexprs included
            names = self.fn.arg_names[len(tensors) + len(self.args):]
            self.tail = tuple(self.meta[n] for n in names)
            self.runner = compiled[self.grid]


def _tma_launch(cfg: Config, dtype: torch.dtype, even_k: bool, operands: Sequence[Tuple[Tensor, int]]) -> bool:
    """Whether a launch of cfg reads its tiles through TMA descriptors: the config asks for it, each operand (tensor,
    elements a row: channels) passes _tma_possible, and TMA can address its memory: non-empty, a 16-byte-aligned
    base, fewer than 2**31 rows (int32 tile coordinates)."""
    return cfg.tma and all(_tma_possible(dtype, even_k, row * t.element_size(), t.device) and t.numel() > 0
                           and t.data_ptr() % 16 == 0 and t.numel() // row < 2**31 for t, row in operands)


def _weight_descriptor(wp: Tensor, block_k: int, block_n: int, k_major: bool = False):
    """TMA descriptor of the packed weight [groups, kh*kw, Cin_g, Cout_g] as a [groups*kh*kw*Cin_g, Cout_g] matrix,
    in [block_k, block_n] blocks (columns past Cout_g read zeros); with k_major, of [groups, kh*kw, Cout_g, Cin_g] as
    [groups*kh*kw*Cout_g, Cin_g] in [block_n, block_k] blocks (rows past a tap's Cout_g read the next tap's)."""
    row = wp.shape[-1]
    block = [block_n, block_k] if k_major else [block_k, block_n]
    return TensorDescriptor(wp, [wp.numel() // row, row], [row, 1], block)


def _grad_out_tma_ok(go: Tensor, geo: ConvGeometry, block_n: int) -> bool:
    """Whether grad_out's tiles can come through _grad_out_descriptor (beside _tma_launch's checks): dense NHWC, and
    a tile of block_n channels never reaches into the next conv group's channels."""
    cout_g = geo.out_channels // geo.groups
    return go.is_contiguous(memory_format=torch.channels_last) and (geo.groups == 1 or cout_g % block_n == 0)


def _grad_out_descriptor(go: Tensor, per_image: bool, block_m: int, block_n: int):
    """TMA descriptor of grad_out (dense NHWC) for _grad_out_tile: [N, Ho*Wo, Cout] in [1, block_m, block_n] blocks
    for per-image M tiles, else [M, Cout] in [block_m, block_n] blocks."""
    n, c, h, w = go.shape
    if per_image:
        return TensorDescriptor(go, [n, h * w, c], [h * w * c, c, 1], [1, block_m, block_n])
    return TensorDescriptor(go, [n * h * w, c], [c, 1], [block_m, block_n])


# The forward stores a 16-bit NCHW output in 16-byte runs along each channel plane where it can (see _run_store).
RUN_STORES = True
# Triton newer than 3.6: runs of any length that divides both Ho*Wo and the tile, in any dtype (WIDE_RUN_STORES), with
# per-image M tiles wherever a run store applies (PER_IMAGE_RUN_STORES). Triton 3.8 lays a store whose positions it
# cannot see to be contiguous out one address per element: the 64x256 forward (128 registers a thread) spilled 504
# bytes at cls-14 and det-s5 (fp16) and 736 in fp32 with per-image tiles, and a tile across two images spills in any
# layout tried (64 to 1128 bytes; sm_90 builds of the H200's launches, benchmarks/NOTES.md v30). With both, every
# recorded forward builds with at most 16 bytes of stack, and on the H200 (graph, fp16) cls-14's forward took 0.107 ->
# 0.076 ms, det-s5's 0.159 -> 0.139, det-s4's 0.172 -> 0.160. Triton 3.6 keeps the measured choices below.
WIDE_RUN_STORES = triton_version() > (3, 6)
PER_IMAGE_RUN_STORES = triton_version() > (3, 6)


def _run_store(out: Tensor, block_m: int, nseg: int) -> int:
    """The forward's RUN_STORE: 8 (elements a vectorised store writes: 16 bytes) for a 16-bit NCHW output whose
    channel planes (Ho*Wo) and tiles (block_m) are multiples of 8 positions, with unpacked segments; else 0 (the
    accumulator's own layout: each thread's pairs of channels, scalar 2-byte stores Ho*Wo apart). Measured on the
    H200 (v23, graph, same process; benchmarks/NOTES.md): det-s3 fp16 0.228 -> 0.224 ms (0.218 with per-image
    tiles), det-s4 bf16 0.149 -> 0.148. Not where runs would be shorter (cls-14, Ho*Wo = 196: 4-element runs, 0.071
    -> 0.074), nor fp32 (hires-g8's packed fp32 forward 0.595 -> 0.703; det shapes within 1%), nor packed segments
    (hires-g8's stores are vectorised already: Ho*Wo is a multiple of 16). WIDE_RUN_STORES (Triton newer than 3.6):
    the largest power of two dividing Ho*Wo and block_m, up to 16 bytes, in any dtype; 0 below 2 elements."""
    n, c, h, w = out.shape
    if not RUN_STORES or nseg > 1 or out.stride(3) != 1 or out.stride(1) != h * w:
        return 0
    if WIDE_RUN_STORES:
        run = min(math.gcd(h * w, block_m), 16 // out.element_size())
        return run if run > 1 else 0
    if out.element_size() != 2:
        return 0
    return 8 if h * w % 8 == 0 and block_m % 8 == 0 else 0


def _operands(offset: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Offset and mask as the kernels read them: contiguous (a missing mask stays None)."""
    return offset.contiguous(), mask.contiguous() if mask is not None else None


def deform_conv2d_forward(
    input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], keep: Optional[dict] = None,
) -> Tensor:
    """out [N, Cout, Ho, Wo] in input's dtype and memory format. Arguments already validated. keep: a dict that
    receives "packed_weight", the packed weight in the layout the backward reads (16-bit inputs: the forward's own),
    for deform_conv2d_backward's packed_weight."""
    # --- check and prepare ---
    off, msk = _operands(offset, mask)
    msk = msk if msk is not None else off  # the mask and bias pointers fall back to the offset; never read then
    b = bias.contiguous() if bias is not None else off
    key = _plan_key("fwd", input, offset, weight, mask, stride, padding, dilation, (input, off, msk, b), bias is None)
    plan = _PLANS.get(key)
    if plan is None:
        geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
        seg = segment_length(geo)
        plan = dict(geo=geo, seg=seg, memory_format=suggest_memory_format(input),
                    grouped=grouped_input(geo, seg), k_major=weight_k_major(input.dtype))
    geo, seg = plan["geo"], plan["seg"]
    x, wp = forward_operands(input, weight, geo.groups, geo.offset_groups, plan["grouped"], plan["k_major"])
    if keep is not None and not plan["k_major"]:
        keep["packed_weight"] = wp
    # --- allocate ---
    out = torch.empty((geo.batch, geo.out_channels, geo.out_h, geo.out_w), dtype=input.dtype, device=input.device,
                      memory_format=plan["memory_format"])

    # --- launch ---
    def weight_operand(run: _Launch):
        """The forward's weight argument: the packed tensor, or its TMA descriptor."""
        m = run.meta
        return _weight_descriptor(wp, m["BLOCK_K"], m["BLOCK_N"], m["W_K_MAJOR"]) if m["TMA"] else wp

    def launch(cfg: Config) -> _Launch:
        nseg = segments_per_chunk(geo, seg, cfg.block_k, "fwd")
        run_store = _run_store(out, cfg.block_m, nseg)
        per_image = per_image_tiles(geo, cfg.block_m, "fwd", nseg, input.dtype, run_store > 0)
        grid = (_m_tiles(geo, cfg.block_m, per_image) * triton.cdiv(geo.out_channels // geo.groups, cfg.block_n),
                geo.groups)
        args = (*_sizes(geo), *geo.stride, *geo.padding, *geo.dilation, *_position_strides(out))
        even_k = _even_k(geo, seg, cfg.block_k, "fwd")
        tma = _tma_launch(cfg, input.dtype, even_k, [(wp, wp.shape[-1])])
        meta = dict(KH=geo.kernel_h, KW=geo.kernel_w, SEG=seg, NSEG=nseg,
                    HAS_MASK=mask is not None, HAS_BIAS=bias is not None, EVEN_K=even_k,
                    DOT_PRECISION=_dot_precision(input.dtype), W_K_MAJOR=plan["k_major"], PER_IMAGE=per_image,
                    GROUPED=plan["grouped"], SAMPLE_AHEAD=cfg.sample_ahead, TMA=tma, RUN_STORE=run_store,
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options())
        run = _Launch(_deform_conv2d_fwd_kernel, grid, args, meta)
        run(x, off, msk, weight_operand(run), b, out)
        return run

    if "fwd" in plan:
        plan["fwd"](x, off, msk, weight_operand(plan["fwd"]), b, out)
    else:
        shape_class = _shape_class("fwd", geo, input.dtype, seg, mask is not None)
        cfg = _pick_config(shape_class, _fwd_candidates(geo, seg, input.dtype), launch, input.device)
        plan["fwd"] = launch(cfg)
        _remember(_PLANS, key, plan)
    return out


def _fixed_point_scales(go: Tensor, wp: Tensor, mask: Optional[Tensor], count: int) -> Tuple[Tensor, Tensor]:
    """Deterministic mode's grad_input is summed as int64 fixed point (integer adds give the same bits in any
    order): (scale, 1 / scale), powers of two as fp32 [1] tensors, such that no sum can pass 2**62. A
    contribution is grad_col * bilinear weight (<= 1) * mask, with |grad_col| <= max|grad_out| * max over
    rows of sum |W|, and one grad_input element receives at most count = Ho*Wo*kh*kw of them (one per
    position and tap of its image). The resolution is then at most bound * 2**-61: 2**-44 of the largest
    possible contribution at det-s3 and hires-g8 (finer for smaller images), far below fp32's rounding. Computed on the
    device (no sync; CUDA-graph capturable). A bound that is not finite (NaN or Inf in grad_out, weight or
    mask) or beyond fp32's exponent range gives NaN scales, and so a grad_input that is NaN throughout."""
    def max_abs(t: Tensor) -> Tensor:  # float64 scalar; 0 for an empty tensor (an empty batch)
        return torch.linalg.vector_norm(t, float("inf")).double() if t.numel() else t.new_zeros((), dtype=torch.float64)

    bound = max_abs(go) * max_abs(wp.abs().sum(-1)) * count
    if mask is not None:
        bound = bound * max_abs(mask)
    exp = 62 - torch.ceil(torch.log2(bound))  # bound 0: +inf, clamped to the largest scale below
    usable = torch.isfinite(bound) & (exp >= -126)
    exp = torch.where(usable, exp.clamp(max=126), torch.full_like(exp, float("nan")))
    return torch.exp2(exp).float().reshape(1), torch.exp2(-exp).float().reshape(1)


def deform_conv2d_backward(
    grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], needs: Sequence[bool],
    packed_weight: Optional[Tensor] = None,
):
    """Gradients (input, offset, mask, weight, bias), None where not needed. The batch is processed in
    chunks of images (backward_chunk_images) to bound the scratch memory. Under
    torch.use_deterministic_algorithms(True) grad_input is summed in int64 fixed point (_fixed_point_scales)
    instead of with float atomics, so every gradient is bitwise reproducible. packed_weight: the forward's
    pack_weight(weight, groups) of the same weight in input's dtype (weight_k_major False), if it kept one
    (deform_conv2d_forward's keep), else the weight is packed here."""
    # --- check and prepare ---
    need_in, need_off, need_mask, need_w, need_b = needs
    need_in, need_off, need_w = bool(need_in), bool(need_off), bool(need_w)
    need_mask = bool(need_mask and mask is not None)
    grad_out = grad_out.to(input.dtype)
    off, msk = _operands(offset, mask)
    groups = input.shape[1] // weight.shape[1]
    wp = packed_weight if packed_weight is not None else pack_weight(weight, groups, dtype=input.dtype)
    fixed_gin = need_in and torch.are_deterministic_algorithms_enabled()
    scales = None
    if fixed_gin:  # one scale for all chunks, from the whole grad_out
        count = grad_out.shape[-2] * grad_out.shape[-1] * weight.shape[-2] * weight.shape[-1]
        scales = _fixed_point_scales(grad_out, wp, msk, count)

    # --- allocate what is returned ---
    grad_in = torch.empty(input.shape, dtype=input.dtype, device=input.device,
                          memory_format=suggest_memory_format(input)) if need_in else None
    grad_off = torch.empty_like(off) if need_off else None
    grad_mask = torch.empty_like(msk) if need_mask else None

    # --- the kernels chunk by chunk; grad_weight's chunk sums added in a fixed order ---
    grad_w = grad_b = None
    pw = pb = None  # grad_weight's and grad_bias's fp32 partial sums, for _finish_grads
    if need_in or need_off or need_mask or need_w:
        batch = input.shape[0]
        geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
        concurrent, step = backward_schedule(input, grad_out, geo, weight.numel(), need_in,
                                             need_in or need_off or need_mask, need_w, fixed_gin)
        whole = step >= batch  # one chunk: it finishes grad_weight, and grad_bias beside it
        for n0 in range(0, max(batch, 1), step):
            # this chunk's images (slices: a few microseconds each, so not where the chunk is the batch)
            chunk = (lambda t: t) if whole else (lambda t, sl=slice(n0, n0 + step): t[sl])  # noqa: E731
            gw, pb = _backward_images(
                chunk(grad_out), chunk(input), chunk(off), wp, chunk(msk) if msk is not None else None, stride,
                padding, dilation, weight, scales, chunk(grad_in) if need_in else None,
                chunk(grad_off) if need_off else None, chunk(grad_mask) if need_mask else None, need_w, concurrent,
                whole, need_b and whole)
            if not need_w:
                continue
            if gw.dim() == 4:  # grad_weight itself (direct_grad_weight: one chunk)
                grad_w = gw
            elif whole:
                pw = gw
            else:  # this chunk's packed sum, added to the earlier chunks'
                gw = gw[0] if gw.shape[0] == 1 else gw.sum(0)
                pw = gw[None] if pw is None else pw.add_(gw)

    # --- the rest in one launch: grad_weight from its partials, grad_bias from the grad_weight kernel's partials
    # (fused_bias) or else from a channel sum over grad_out ---
    if need_b and pb is None:
        pb = _channel_sum(grad_out)
    if pw is not None or pb is not None:
        fw, grad_b = _finish_grads(weight, pw, pb)
        grad_w = fw if pw is not None else grad_w
    return grad_in, grad_off, grad_mask, grad_w, grad_b


def _backward_images(
    grad_out: Tensor, input: Tensor, off: Tensor, wp: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], weight: Tensor,
    scales: Optional[Tuple[Tensor, Tensor]], grad_in: Optional[Tensor], grad_off: Optional[Tensor],
    grad_mask: Optional[Tensor], need_w: bool, concurrent: bool = False, whole: bool = False, need_b: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The backward of one chunk of images: writes grad_in, grad_off and grad_mask (slices of the returned
    tensors, or None when not needed) and returns what the grad_weight kernel wrote (None without need_w): fp32
    partial sums [split, groups, kh*kw, Cin_g, Cout_g], or where the chunk is the whole batch (whole) and split is 1
    grad_weight itself (the weight's shape, dtype and memory format: direct_grad_weight); and, with need_b, grad_bias's
    fp32 partial sums [rows, Cout]: from grad_out's transpose pass where it has one (NCHW), else from the grad_weight
    kernel where its split is more than 1 (fused_bias), else None. Its scratch: the copies of input (NHWC, or
    offset-grouped: see grouped_input) and grad_out (NHWC), and grad_input's accumulator (in the input copy's layout),
    freed before grad_weight's partials are allocated (so the two never add up) unless concurrent
    (concurrent_backward): then, once planned, grad_weight runs on a side stream beside the grad_input kernel, its
    partials allocated first."""
    # --- prepare ---
    # grad_out channels-last: the kernels read [positions, channels] tiles of it in their inner loops, and
    # with channels contiguous those loads are vectorised and pipelined (cp.async); NCHW tiles compile to
    # scalar 2-byte loads (positions are l = m % (Ho*Wo), not provably contiguous). One transpose pass.
    # grad_bias's partials come from that pass where there is one (NCHW grad_out), else from the grad_weight kernel
    # where its split allows (bias_rows: fused_bias), else the caller sums grad_out's channels.
    need_in, need_off, need_mask = grad_in is not None, grad_off is not None, grad_mask is not None
    jobs: list = []  # grad_out's and the input's transpose passes, run together below (run_transposes)
    go, go_sums = _nhwc_summed(grad_out, jobs) if need_b else (_nhwc(grad_out, jobs=jobs), None)
    bias_rows = need_b and go_sums is None
    msk = mask if mask is not None else off  # the mask pointer falls back to the offset; never read then
    fixed_gin = scales is not None
    key = _plan_key("bwd", input, off, weight, mask, stride, padding, dilation,
                    (input, off, msk, go, grad_off if need_off else off, grad_mask if need_mask else off), go.stride(),
                    need_in, fixed_gin, need_off, need_mask, need_w, concurrent, whole, bias_rows, weight.stride(),
                    DIRECT_GRAD_WEIGHT)
    plan = _PLANS.get(key)
    if plan is None:
        geo = geometry_from_tensors(input, off, weight, stride, padding, dilation)
        seg = segment_length(geo)
        grouped = grouped_input(geo, seg)
        args = (*_sizes(geo), *geo.stride, *geo.padding, *geo.dilation, *_position_strides(go))
        meta = dict(KH=geo.kernel_h, KW=geo.kernel_w, SEG=seg, HAS_MASK=mask is not None,
                    DOT_PRECISION=_dot_precision(input.dtype), GROUPED=grouped)
        # grad_input's accumulator in the layout the kernels read the input in: [N, G, H, W, C/G], G = 1 for NHWC
        layout_groups = geo.offset_groups if grouped else 1
        gin_shape = (geo.batch, layout_groups, geo.height, geo.width, geo.in_channels // layout_groups)
        plan = dict(geo=geo, seg=seg, args=args, meta=meta, gin_shape=gin_shape)
    geo, seg, args, meta = plan["geo"], plan["seg"], plan["args"], plan["meta"]
    grouped = meta["GROUPED"]
    # grad_input's accumulator (fp32, or int64 fixed point when deterministic), zeroed in the input's transpose pass
    gin = torch.empty(plan["gin_shape"], dtype=torch.int64 if fixed_gin else torch.float32,
                      device=input.device) if need_in else None
    x = _offset_grouped(input, geo.offset_groups, gin, jobs) if grouped else _nhwc(input, gin, jobs=jobs)
    run_transposes(jobs)
    cout_g = geo.out_channels // geo.groups
    grad_w, grad_b = None, go_sums

    # --- grad_weight's launcher (split-M partial sums, added in a fixed order) ---
    cin_g = geo.in_channels // geo.groups

    def weight_targets(split: int) -> Tuple[Tensor, Optional[Tensor]]:
        """Where the grad_weight kernel writes: grad_weight itself where it is final (direct_grad_weight), else fp32
        partial sums [split, groups, kh*kw, Cin_g, Cout_g]; and where it sums grad_bias (fused_bias), grad_bias's
        [split, Cout]."""
        if direct_grad_weight(whole, split):
            return _grad_weight_like(weight), None
        gw = torch.empty((split, geo.groups, geo.taps, cin_g, cout_g), dtype=torch.float32, device=input.device)
        if not fused_bias(bias_rows, split):
            return gw, None
        return gw, torch.empty((split, geo.out_channels), dtype=torch.float32, device=input.device)

    def target_strides(gw: Tensor) -> Tuple[int, ...]:
        """The kernel's gw_ss, gw_sg, gw_sh, gw_sw, gw_si, gw_so for weight_targets' gw."""
        if gw.dim() == 4:  # grad_weight [Cout, Cin_g, kh, kw]: one split
            so, si, sh, sw = gw.stride()
            return 0, cout_g * so, sh, sw, si, so
        ss, sg, st, si, so = gw.stride()
        return ss, sg, geo.kernel_w * st, st, si, so

    def weight_pointers(targets: Tuple[Tensor, Optional[Tensor]]) -> Tuple[Tensor, Tensor]:
        """The kernel's gw_ptr and gb_ptr for weight_targets' (gw, gb): gb_ptr falls back to gw, never written then."""
        gw, gb = targets
        return gw, gb if gb is not None else gw

    def weight_go(run: _Launch):
        """grad_weight's grad_out argument: the tensor, or its TMA descriptor."""
        m = run.meta
        return _grad_out_descriptor(go, m["PER_IMAGE"], m["BLOCK_M"], m["BLOCK_N"]) if m["TMA"] else go

    def launch_weight(cfg: Config, targets: Optional[Tuple[Tensor, Optional[Tensor]]] = None):
        gw, gb = weight_targets(cfg.split) if targets is None else targets
        fuse = gb is not None  # grad_bias's partials exist where it is fused (weight_targets)
        grid = (_weight_rows(geo, seg, cfg.block_k) + (geo.groups if fuse else 0), triton.cdiv(cout_g, cfg.block_n),
                cfg.split)
        nseg = segments_per_chunk(geo, seg, cfg.block_k, "bwd_weight")
        even_k = _even_k(geo, seg, cfg.block_k, "bwd_weight")
        # grad_out tiles through TMA (its chunks need not be whole: no weight tile here)
        tma = (_grad_out_tma_ok(go, geo, cfg.block_n)
               and _tma_launch(cfg, input.dtype, True, [(go, geo.out_channels)]))
        weight_meta = dict(meta, NSEG=nseg, EVEN_K=even_k, TMA=tma, NEED_BIAS=fuse,
                           PER_IMAGE=per_image_tiles(geo, cfg.block_m, "bwd_weight", nseg, input.dtype),
                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **cfg.launch_options())
        run = _Launch(_deform_conv2d_bwd_weight_kernel, grid,
                      (*args[:10], geo.groups, cfg.split, *args[10:], *target_strides(gw)), weight_meta)
        run(x, off, msk, weight_go(run), *weight_pointers((gw, gb)))
        return (gw, gb), run

    weight_cfg = None
    if need_w and "weight" not in plan:  # the first call: its config (any timing of candidates runs here)
        shape_class = _shape_class("bwd_weight", geo, input.dtype, seg, mask is not None) + (concurrent,)
        weight_cfg = _pick_config(shape_class, _bwd_weight_candidates(geo, seg, input.dtype, input.device, concurrent),
                                  launch_weight, input.device)

    def weight_partials() -> Tuple[Tensor, Optional[Tensor]]:
        return weight_targets(plan["weight"][0] if weight_cfg is None else weight_cfg.split)

    def grad_weight_into(targets: Tuple[Tensor, Optional[Tensor]]) -> None:
        """grad_weight's partial sums (and grad_bias's, where fused) into targets, on the current stream (planned at
        the first call)."""
        if weight_cfg is None:
            run = plan["weight"][1]
            run(x, off, msk, weight_go(run), *weight_pointers(targets))
        else:
            plan["weight"] = (weight_cfg.split, launch_weight(weight_cfg, targets)[1])

    # Concurrent: grad_weight on the side stream from here, beside the grad_input kernel (not while that kernel's
    # candidates are timed: DEFORMCONV_AUTOTUNE's first call). Every tensor it reads or writes was allocated on this
    # stream before the fork, and this stream waits for it before any of them is freed, so the caching allocator
    # cannot hand their memory out early.
    side = main = part = None
    if need_w and concurrent and not (autotune_enabled() and "data" not in plan):
        part = weight_partials()
        side = _side_stream(input.device)
        main = torch.cuda.current_stream(input.device)  # looked up once (its Stream object costs microseconds)
        side.wait_stream(main)
        torch.cuda.set_stream(side)
        try:
            grad_weight_into(part)
        finally:
            torch.cuda.set_stream(main)

    # --- grad_input (atomics: fp32, or int64 fixed point when deterministic), grad_offset, grad_mask ---
    try:
        if need_in or need_off or need_mask:
            gin = gin if need_in else off
            goff = grad_off if need_off else off
            gmsk = grad_mask if need_mask else off
            scale = scales[0] if fixed_gin else off

            def data_operands(run: _Launch) -> Tuple:
                """The weight and grad_out arguments of a grad_input launch: tensors, or with TMA descriptors (grad_out
                stays a tensor where it is resident)."""
                m = run.meta
                if not m["TMA"]:
                    return wp, go
                go_op = go if m["GO_RESIDENT"] else _grad_out_descriptor(go, m["PER_IMAGE"], m["BLOCK_M"], m["BLOCK_N"])
                return _weight_descriptor(wp, m["BLOCK_K"], m["BLOCK_N"]), go_op

            def launch_data(cfg: Config) -> _Launch:
                nseg = segments_per_chunk(geo, seg, cfg.block_k, "bwd_data")
                per_image = per_image_tiles(geo, cfg.block_m, "bwd_data", nseg, input.dtype)
                even_k = _even_k(geo, seg, cfg.block_k, "bwd_data")
                resident = go_resident(geo, cfg.block_n)
                # a resident grad_out tile is loaded once through pointers; the weight's come through TMA
                go_tma_ok = resident or _grad_out_tma_ok(go, geo, cfg.block_n)
                tma = not fixed_gin and go_tma_ok and _tma_launch(cfg, input.dtype, even_k,
                                                                  [(wp, cout_g), (go, geo.out_channels)])
                data_meta = dict(meta, NSEG=nseg, NEED_GIN=need_in, NEED_GOFF=need_off, NEED_GMSK=need_mask,
                                 FIXED_GIN=fixed_gin, EVEN_K=even_k, PER_IMAGE=per_image, GO_RESIDENT=resident,
                                 TAP_SPLIT=cfg.split, TMA=tma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 BLOCK_K=cfg.block_k, **cfg.launch_options())
                run = _Launch(_deform_conv2d_bwd_data_kernel, (_m_tiles(geo, cfg.block_m, per_image), cfg.split), args,
                              data_meta)
                run(x, off, msk, *data_operands(run), gin, goff, gmsk, scale)
                return run

            if "data" not in plan:
                shape_class = _shape_class("bwd_data", geo, input.dtype, seg, mask is not None) + (
                    need_in, fixed_gin, need_off, need_mask, concurrent)
                cfg = _pick_config(shape_class,
                                   _bwd_data_candidates(geo, seg, input.dtype, input.device, fixed_gin, concurrent),
                                   launch_data, input.device)
                if need_in:
                    gin.zero_()  # again after any tuning runs, which accumulate into it too
                plan["data"] = launch_data(cfg)
            else:
                plan["data"](x, off, msk, *data_operands(plan["data"]), gin, goff, gmsk, scale)
            # grad_input from its accumulator (fp32, or int64 fixed point) into the returned tensor, then the
            # accumulator is freed: grad_weight's partials below take its place (unless they exist already, beside)
            if need_in:
                if fixed_gin:
                    gin = gin.to(torch.float32).mul_(scales[1])
                _from_offset_grouped(gin, grad_in)
                del gin
    finally:  # the side stream joins this one before anything it uses can be freed, even after an error
        if side is not None:
            main.wait_stream(side)

    # --- grad_weight: launched here unless it runs beside grad_input ---
    if need_w:
        if side is None:  # after the accumulator is freed: the partials take its memory
            part = weight_partials()
            grad_weight_into(part)
        grad_w, gb = part
        grad_b = gb if gb is not None else grad_b
        del part
    _remember(_PLANS, key, plan)
    return grad_w, grad_b
