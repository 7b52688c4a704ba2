"""Deformable convolution of rank 1 to 3 through column buffers: a sampling kernel and its gradient's, around cuBLAS
GEMMs (the column route of deform_conv2d's backward, ops/deform_conv2d/triton/columns.py, for every pass). The N-d
forms' Triton backend (ops/deform_conv_nd/triton.py) and deform_conv2d's for depthwise groups
(ops/deform_conv2d/triton/narrow_groups.py) are built on it.

Shapes (rank r ≤ 3, the input canonicalised to three spatial axes D, H, W, missing ones of size 1; K taps, L output
positions, G offset groups of CG channels, C = G·CG):
    x        [N, D, H, W, C]   channels-last copy of the sampled tensor (one read of CG contiguous channels a corner)
    offset   [N, G, K, r, L]   the op's layout
    mask     [N, G, K, L]
    columns  [n, C, K, LC]     a chunk's sampled values times the mask: rows c·K + k, the layout the weight
                               multiplies; LC positions L0 ≤ l < LE of n images (see Memory)

deform_conv:       columns = sample(x); out = W·columns (per convolution group).
                   backward: grad_columns = Wᵀ·grad_out; the gradient kernel spreads grad_columns·mask over the
                   corners (grad_input, fp32 atomics; int64 fixed point in deterministic mode) and sums grad_offset
                   and grad_mask over the channels; grad_weight = grad_out·columnsᵀ.
deform_conv_transpose (the adjoint): columns = Wᵀ·input spread by the gradient kernel's scatter; its backward is
                   deform_conv's with the roles swapped (op.py: _gradients).

A program owns BLOCK_L positions of one (image, offset group) and TAPS consecutive taps (a row of the kernel's last
axis, whose samples lie a pixel apart: the next tap's corners are mostly in the cache; or one tap where the grid would
otherwise leave the GPU short of programs), and per tap loops over the group's channels in blocks of BLOCK_C; a tap's
2^r corners are computed once for all of them. Accumulation in fp32; the GEMMs' fp32 products take TF32 where
F.conv*d would (compat.conv_matmul_precision).

Memory: the columns go in chunks of at most COLUMN_BUDGET elements: several images where one image's columns fit,
else an image's positions in runs (a 3D U-Net block's fp32 columns are 905 MB whole). grad_input then accumulates over
an image's runs: fp32 atomics into one buffer, or in deterministic mode each run's int64 fixed-point sum added in
float64 in run order.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...compat import conv_matmul_precision
from ...config import options
from .fixed_point import max_abs, scales_for
from .launch import ceil_div, next_pow2, on_device_of, remember, run_cached, sm_count
from .sampling import scatter_add

# --- configs -------------------------------------------------------------------------------------------------------

BLOCK_L = 64           # positions a program (a row of 64 coalesced column stores a channel)
MAX_BLOCK_C = 32       # channels a pass of the channel loop
COLUMN_BUDGET = 1 << 24  # elements of one chunk's columns (64 MiB in fp32; docs/tuning.md: memory)
ROW_PROGRAMS = 4       # a program walks a row of taps where the grid keeps this many programs an SM (docs/tuning.md)


# --- kernels -------------------------------------------------------------------------------------------------------


@triton.jit
def _axis(off_ptr, o, t, size, stride, pad, dil, l_ok):
    """One axis of the sample points: (low corner index, fraction, inside (−1 ≤ x < size), NaN)."""
    x = (o * stride - pad + t * dil).to(tl.float32) + tl.load(off_ptr, mask=l_ok, other=0.0).to(tl.float32)
    ok = (x >= -1.0) & (x < size)
    bad = x != x
    xs = tl.where(ok, x, 0.0)
    low = tl.floor(xs)
    return low.to(tl.int32), xs - low, ok, bad


@triton.jit
def _points(off_ptr, n, g, k, l, l_ok, D, H, W, OH, OW, G, K, L, SD, SH, SW, PD, PH, PW, DD, DH, DW,
            KH: tl.constexpr, KW: tl.constexpr, RANK: tl.constexpr):
    """The sample points of BLOCK_L positions l of tap k, group g, image n: per axis (d, h, w) the low corner and
    fraction (0 on a missing axis), whether the point counts, and whether it is NaN."""
    ow = l % OW
    oh = (l // OW) % OH
    od = l // (OW * OH)
    kw = k % KW
    kh = (k // KW) % KH
    kd = k // (KW * KH)
    base = off_ptr + ((n * G + g) * K + k).to(tl.int64) * (RANK * L) + l
    lw, fw, okw, badw = _axis(base + (RANK - 1) * L, ow, kw, W, SW, PW, DW, l_ok)
    inside = l_ok & okw
    nan = badw
    lh = tl.zeros_like(lw)
    fh = tl.zeros_like(fw)
    ld = lh
    fd = fh
    if RANK >= 2:
        lh, fh, okh, badh = _axis(base + (RANK - 2) * L, oh, kh, H, SH, PH, DH, l_ok)
        inside = inside & okh
        nan = nan | badh
    if RANK == 3:
        ld, fd, okd, badd = _axis(base, od, kd, D, SD, PD, DD, l_ok)
        inside = inside & okd
        nan = nan | badd
    return ld, lh, lw, fd, fh, fw, inside & ~nan, nan


@triton.jit
def _corner(n, ld, lh, lw, fd, fh, fw, inside, D, H, W, CORNER: tl.constexpr):
    """Corner CORNER (bits: w, h, d) of the points: its pixel (int64), validity and weight, and the weight's
    derivative along each axis (0 where invalid)."""
    bw: tl.constexpr = CORNER & 1
    bh: tl.constexpr = (CORNER >> 1) & 1
    bd: tl.constexpr = CORNER >> 2
    iw = lw + bw
    ih = lh + bh
    id = ld + bd
    valid = inside & (iw >= 0) & (iw < W) & (ih >= 0) & (ih < H) & (id >= 0) & (id < D)
    xw = fw if bw else 1.0 - fw
    xh = fh if bh else 1.0 - fh
    xd = fd if bd else 1.0 - fd
    sw = 1.0 if bw else -1.0
    sh = 1.0 if bh else -1.0
    sd = 1.0 if bd else -1.0
    pix = ((n * D + id) * H + ih).to(tl.int64) * W + iw
    zero = tl.zeros_like(fw)
    weight = tl.where(valid, xw * xh * xd, zero)
    return pix, valid, weight, tl.where(valid, sd * xh * xw, zero), tl.where(valid, sh * xd * xw, zero), \
        tl.where(valid, sw * xd * xh, zero)


@triton.jit
def _rows(valid):
    """valid [BL] as a [BL, 1] mask, through int32: Triton 3.6 fails to compile a kernel whose i1 points' validity is
    used both as a 1-D select condition and, broadcast, as a 2-D load mask (its layout pass gives the two uses
    different layouts and cannot convert an i1 between them)."""
    return valid.to(tl.int32)[:, None] != 0


@triton.jit
def _program(off_ptr, msk_ptr, j, D, H, W, OH, OW, G, K, L, L0, LE, SD, SH, SW, PD, PH, PW, DD, DH, DW,
             KH: tl.constexpr, KW: tl.constexpr, RANK: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_L: tl.constexpr,
             TAPS: tl.constexpr):
    """The program's (image n, offset group g) and positions L0 ≤ l < LE, and its j-th tap k (grid: the chunk's
    position tiles, n·G·K/TAPS), the sample points (_points) and mask values (1 without a mask)."""
    pid = tl.program_id(1)
    runs = K // TAPS
    k = (pid % runs) * TAPS + j
    g = (pid // runs) % G
    n = pid // (runs * G)
    l = L0 + tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_ok = l < LE
    ld, lh, lw, fd, fh, fw, inside, nan = _points(off_ptr, n, g, k, l, l_ok, D, H, W, OH, OW, G, K, L, SD, SH, SW, PD,
                                                  PH, PW, DD, DH, DW, KH, KW, RANK)
    m = tl.full((BLOCK_L,), 1.0, tl.float32)
    if HAS_MASK:
        m = tl.load(msk_ptr + ((n * G + g) * K + k).to(tl.int64) * L + l, mask=l_ok, other=0.0).to(tl.float32)
    return n, g, k, l, l_ok, ld, lh, lw, fd, fh, fw, inside, nan, m


@triton.jit
def _columns_kernel(
    x_ptr, off_ptr, msk_ptr, col_ptr,      # see the module docstring
    D, H, W, OH, OW, C, CG, G, K, L,       # sizes (OD follows from L)
    L0, LE, LC,                            # the chunk's positions L0 ≤ l < LE; LC = LE − L0, a column row
    SD, SH, SW, PD, PH, PW, DD, DH, DW,    # stride, padding, dilation per axis
    KH: tl.constexpr, KW: tl.constexpr, RANK: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, TAPS: tl.constexpr,
):
    """columns[n, g·CG + c, k, l − L0] = mask · Σ_corners weight · x[n, corner, g·CG + c]. Grid: (chunk tiles,
    n·G·K/TAPS)."""
    for j in range(TAPS):
        n, g, k, l, l_ok, ld, lh, lw, fd, fh, fw, inside, nan, m = _program(
            off_ptr, msk_ptr, j, D, H, W, OH, OW, G, K, L, L0, LE, SD, SH, SW, PD, PH, PW, DD, DH, DW, KH, KW, RANK,
            HAS_MASK, BLOCK_L, TAPS)
        for c0 in range(0, CG, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            c_ok = cc < CG
            acc = tl.zeros((BLOCK_L, BLOCK_C), tl.float32)
            for corner in tl.static_range(1 << RANK):
                pix, valid, weight, _, _, _ = _corner(n, ld, lh, lw, fd, fh, fw, inside, D, H, W, corner)
                v = tl.load(x_ptr + pix[:, None] * C + (g * CG + cc)[None, :], mask=_rows(valid) & c_ok[None, :],
                            other=0.0).to(tl.float32)
                acc += weight[:, None] * v
            acc = tl.where(nan[:, None], float("nan"), acc) * m[:, None]
            rows = (n * C + g * CG + cc).to(tl.int64) * K + k
            tl.store(col_ptr + rows[None, :] * LC + (l - L0)[:, None], acc.to(col_ptr.dtype.element_ty),
                     mask=l_ok[:, None] & c_ok[None, :])


@triton.jit
def _columns_grad_kernel(
    x_ptr, off_ptr, msk_ptr, gcol_ptr,     # gcol: the chunk columns' gradient [n, C, K, LC] (before the mask)
    gin_ptr,                               # the sampled tensor's gradient accumulator like x: fp32, int64 if FIXED
    goff_ptr, gmsk_ptr,                    # grad_offset, grad_mask in the offset's and mask's layouts
    scale_ptr,                             # fp32 [1]: grad_input's fixed-point scale (read if FIXED)
    D, H, W, OH, OW, C, CG, G, K, L, L0, LE, LC,
    SD, SH, SW, PD, PH, PW, DD, DH, DW,
    KH: tl.constexpr, KW: tl.constexpr, RANK: tl.constexpr, HAS_MASK: tl.constexpr,
    NEED_IN: tl.constexpr, NEED_OFF: tl.constexpr, NEED_MSK: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, TAPS: tl.constexpr,
):
    """grad_input += gcol·mask·weight at each corner; grad_mask = Σ_c gcol·sample; grad_offset along each axis
    = mask·Σ_c gcol·Σ_corners ∂weight·x. Grid: (chunk tiles, n·G·K/TAPS)."""
    scale = 1.0
    if FIXED:
        scale = tl.load(scale_ptr)
    for j in range(TAPS):
        n, g, k, l, l_ok, ld, lh, lw, fd, fh, fw, inside, nan, m = _program(
            off_ptr, msk_ptr, j, D, H, W, OH, OW, G, K, L, L0, LE, SD, SH, SW, PD, PH, PW, DD, DH, DW, KH, KW, RANK,
            HAS_MASK, BLOCK_L, TAPS)
        gm = tl.zeros((BLOCK_L,), tl.float32)
        gd = gm
        gh = gm
        gw = gm
        for c0 in range(0, CG, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)
            c_ok = cc < CG
            tile_ok = l_ok[:, None] & c_ok[None, :]
            rows = (n * C + g * CG + cc).to(tl.int64) * K + k
            gc = tl.load(gcol_ptr + rows[None, :] * LC + (l - L0)[:, None], mask=tile_ok, other=0.0).to(tl.float32)
            for corner in tl.static_range(1 << RANK):
                pix, valid, weight, dd, dh, dw = _corner(n, ld, lh, lw, fd, fh, fw, inside, D, H, W, corner)
                ptrs = pix[:, None] * C + (g * CG + cc)[None, :]
                vm = _rows(valid) & c_ok[None, :]
                if NEED_OFF or NEED_MSK:
                    v = tl.load(x_ptr + ptrs, mask=vm, other=0.0).to(tl.float32)
                    s = tl.sum(gc * v, axis=1)
                    if NEED_MSK:
                        gm += weight * s
                    if NEED_OFF:
                        gw += dw * s
                        if RANK >= 2:
                            gh += dh * s
                        if RANK == 3:
                            gd += dd * s
                if NEED_IN:
                    scatter_add(gin_ptr + ptrs, gc * (weight * m)[:, None], vm, scale, FIXED)
        row = ((n * G + g) * K + k).to(tl.int64)
        if NEED_MSK:
            tl.store(gmsk_ptr + row * L + l, tl.where(nan, float("nan"), gm).to(gmsk_ptr.dtype.element_ty), mask=l_ok)
        if NEED_OFF:
            gdt = goff_ptr.dtype.element_ty
            base = goff_ptr + row * (RANK * L) + l
            tl.store(base + (RANK - 1) * L, (gw * m).to(gdt), mask=l_ok)
            if RANK >= 2:
                tl.store(base + (RANK - 2) * L, (gh * m).to(gdt), mask=l_ok)
            if RANK == 3:
                tl.store(base, (gd * m).to(gdt), mask=l_ok)


# --- launchers -----------------------------------------------------------------------------------------------------


def _three(values: Sequence[int], fill: int) -> list:
    """Per-axis values as (d, h, w), missing leading axes filled."""
    return [fill] * (3 - len(values)) + list(values)


class _Geometry:
    """The sampling of one call: image (the sampled tensor's spatial size), positions, kernel and the settings; its
    chunks and launches are kept for the next call of the same signature (geometry())."""

    def __init__(self, image, positions, kernel, stride, padding, dilation, channels: int, offset_groups: int):
        self.plans: dict = {}
        self.rank = len(kernel)
        self.image, self.positions, self.kernel = list(image), list(positions), list(kernel)
        self.K, self.L, self.P = math.prod(kernel), math.prod(positions), math.prod(image)
        self.C, self.G = channels, offset_groups
        D, H, W = _three(image, 1)
        _, OH, OW = _three(positions, 1)
        self.sizes = (D, H, W, OH, OW, channels, channels // offset_groups, offset_groups, self.K, self.L)
        self.settings = (*_three(stride, 1), *_three(padding, 0), *_three(dilation, 1))
        kh, self.kw = _three(kernel, 1)[1:]
        self.meta = dict(KH=kh, KW=self.kw, RANK=self.rank, BLOCK_L=BLOCK_L,
                         BLOCK_C=max(2, min(MAX_BLOCK_C, next_pow2(channels // offset_groups))))

    def chunks(self, n: int) -> List[Tuple[int, int, List[Tuple[int, int]]]]:
        """[(s, e, [(l0, le), ...])]: images s:e together where their columns fit COLUMN_BUDGET, each with its runs
        of positions (one run, all L, unless a single image's columns exceed the budget). The fewest chunks that fit,
        all of one size (the last may be smaller): the peak is the largest chunk, so equal ones keep it lowest."""
        key = ("chunks", n)
        if key not in self.plans:
            remember(self.plans, key, self._chunks(n))
        return self.plans[key]

    def _chunks(self, n: int) -> List[Tuple[int, int, List[Tuple[int, int]]]]:
        per_image = self.C * self.K * self.L
        if per_image <= COLUMN_BUDGET:
            fit = max(1, COLUMN_BUDGET // max(per_image, 1))
            step = ceil_div(n, ceil_div(n, fit)) if n else 1
            return [(s, min(n, s + step), [(0, self.L)] if self.L else []) for s in range(0, n, step)]
        fit = max(BLOCK_L, COLUMN_BUDGET // (self.C * self.K) // BLOCK_L * BLOCK_L)
        run = ceil_div(ceil_div(self.L, ceil_div(self.L, fit)), BLOCK_L) * BLOCK_L
        runs = [(l0, min(self.L, l0 + run)) for l0 in range(0, self.L, run)]
        return [(s, s + 1, runs) for s in range(n)]

    def launch(self, n: int, l0: int, le: int, device: torch.device) -> Tuple[tuple, tuple, dict]:
        """(grid, size arguments, meta) of the kernels for positions l0:le of n images: a program walks a row of the
        kernel's last axis where the grid still has ROW_PROGRAMS programs an SM, else one tap."""
        key = (n, l0, le, device)
        if key not in self.plans:
            remember(self.plans, key, self._launch(n, l0, le, device))
        return self.plans[key]

    def _launch(self, n: int, l0: int, le: int, device: torch.device) -> Tuple[tuple, tuple, dict]:
        tiles, rows = ceil_div(le - l0, BLOCK_L), n * self.G * (self.K // self.kw)
        taps = self.kw if tiles * rows >= ROW_PROGRAMS * sm_count(device) else 1
        return (tiles, rows * self.kw // taps), (*self.sizes, l0, le, le - l0, *self.settings), dict(self.meta,
                                                                                                 TAPS=taps)


def geometry(image, positions, kernel, stride, padding, dilation, channels: int, offset_groups: int) -> _Geometry:
    """The call's _Geometry, one per signature in the plan caches (options.cache): its Python (sizes, chunks, grids)
    runs once, not every call. Keyed by the module's tunables too, which tests and benchmarks set."""
    key = (*map(tuple, (image, positions, kernel, stride, padding, dilation)), channels, offset_groups, BLOCK_L,
           MAX_BLOCK_C, COLUMN_BUDGET, ROW_PROGRAMS)
    cache = options.cache("nd_geometries")
    geo = cache.get(key)
    if geo is None:
        geo = remember(cache, key, _Geometry(image, positions, kernel, stride, padding, dilation, channels,
                                             offset_groups))
    return geo


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t in dtype (t itself where it is: no dispatch for a no-op cast on the per-call path)."""
    return t if t.dtype == dtype else t.to(dtype)


def _images(s: int, e: int, *tensors: Optional[Tensor]) -> list:
    """Images s:e of each tensor (None kept)."""
    return [None if t is None else t[s:e] for t in tensors]


def _channels_last(t: Tensor) -> Tensor:
    return t.movedim(1, -1).contiguous()


def _columns(x_cl: Tensor, offset: Tensor, mask: Optional[Tensor], geo: _Geometry, l0: int, le: int,
             dtype: torch.dtype) -> Tensor:
    """The columns [n, C, K, le − l0] of positions l0:le of the images x_cl [n, *image, C]."""
    n = x_cl.shape[0]
    cols = torch.empty((n, geo.C, geo.K, le - l0), dtype=dtype, device=x_cl.device)
    grid, sizes, meta = geo.launch(n, l0, le, x_cl.device)
    run_cached(_columns_kernel, grid, [x_cl, offset, mask if mask is not None else offset, cols], sizes,
               dict(meta, HAS_MASK=mask is not None))
    return cols


class _Gradients:
    """The gradient kernel over one image chunk's position runs: grad_offset and grad_mask written in place (each
    run its own positions), the sampled tensor's gradient [n, *image, C] summed over the runs (fp32 atomics; in
    deterministic mode a run's int64 fixed-point sum, added in float64 in run order) into gin: `into` itself where
    that is an fp32 tensor and the mode not deterministic (no buffer and copy), else a buffer to copy from."""

    def __init__(self, x_cl: Optional[Tensor], offset: Tensor, mask: Optional[Tensor], geo: _Geometry,
                 into: Optional[Tensor], grad_offset: Optional[Tensor], grad_mask: Optional[Tensor]):
        self.x_cl, self.offset, self.mask, self.geo = x_cl, offset, mask, geo
        self.into, self.need_in, self.goff, self.gmsk = into, into is not None, grad_offset, grad_mask
        self.fixed = self.need_in and torch.are_deterministic_algorithms_enabled()
        self.gin = None
        if into is not None:
            self.gin = into.zero_() if into.dtype == torch.float32 and not self.fixed else \
                torch.zeros(into.shape, dtype=torch.float64 if self.fixed else torch.float32, device=into.device)

    def finish(self) -> None:
        """into = the summed gradient (nothing to do where it was summed in place)."""
        if self.gin is not self.into:
            self.into.copy_(self.gin)

    def run(self, gcols: Tensor, l0: int, le: int) -> None:
        """The kernel on the columns' gradient gcols [n, C, K, le − l0] of positions l0:le."""
        geo, mask, n = self.geo, self.mask, gcols.shape[0]
        gin = scales = None
        if self.need_in:
            gin = torch.zeros_like(self.gin, dtype=torch.int64) if self.fixed else self.gin
            if self.fixed:  # a contribution is gcol · mask · (weight <= 1); K·(le − l0) of them reach one element
                bound = max_abs(gcols) * (max_abs(mask) if mask is not None else 1.0) * (geo.K * (le - l0))
                scales = scales_for(bound)
        x = self.x_cl if self.x_cl is not None else gcols
        grid, sizes, meta = geo.launch(n, l0, le, gcols.device)
        run_cached(_columns_grad_kernel, grid,
                   [x, self.offset, mask if mask is not None else self.offset, gcols, gin if gin is not None else gcols,
                    self.goff if self.goff is not None else self.offset,
                    self.gmsk if self.gmsk is not None else self.offset, scales[0] if self.fixed else self.offset],
                   sizes, dict(meta, HAS_MASK=mask is not None, NEED_IN=self.need_in, NEED_OFF=self.goff is not None,
                               NEED_MSK=self.gmsk is not None, FIXED=self.fixed))
        if self.fixed:
            self.gin += gin.double() * scales[1].double()


def _operands(input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor], stride, padding, dilation,
              positions: Sequence[int]) -> tuple:
    """(geometry, the input channels-last, offset and mask contiguous, the weight [groups, Cout/groups, Cin/groups·K]
    in the input's dtype) of a convolution's call."""
    cin, kernel = input.shape[1], list(weight.shape[2:])
    groups = cin // weight.shape[1]
    og = offset.shape[1] // (math.prod(kernel) * len(kernel))
    geo = geometry(input.shape[2:], positions, kernel, stride, padding, dilation, cin, og)
    w = _as(weight, input.dtype).reshape(groups, weight.shape[0] // groups, -1)
    return (geo, _channels_last(input), offset.contiguous(), None if mask is None else mask.contiguous(), w)


def deform_conv(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                stride, padding, dilation, positions: Sequence[int]) -> Tensor:
    """The deformable convolution [N, Cout, *positions] (ops/deform_conv_nd/reference.py: deform_conv)."""
    geo, x_cl, offset, mask, w = _operands(input, offset, weight, mask, stride, padding, dilation, positions)
    N, cout, groups, r = input.shape[0], weight.shape[0], w.shape[0], len(positions)
    out = torch.empty((N, cout, *positions), dtype=input.dtype, device=input.device)
    out_g = out.view(N, groups, cout // groups, geo.L)
    with on_device_of(input), conv_matmul_precision(input.dtype):
        for s, e, runs in geo.chunks(N):
            xs, os, ms = (x_cl, offset, mask) if e - s == N else _images(s, e, x_cl, offset, mask)
            for l0, le in runs:
                cols = _columns(xs, os, ms, geo, l0, le, input.dtype).view(e - s, groups, -1, le - l0)
                if e - s == N and le - l0 == geo.L:  # the whole output at once: straight into it
                    torch.matmul(w, cols, out=out_g)
                else:
                    out_g[s:e, ..., l0:le] = torch.matmul(w, cols)
    if bias is not None:
        out += _as(bias, out.dtype).reshape(1, cout, *([1] * r))
    return out


def deform_conv_backward(grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
                         stride, padding, dilation, needs: Sequence[bool]) -> Tuple[Optional[Tensor], ...]:
    """The gradients (input, offset, weight, mask) of deform_conv (reference.py: deform_conv_backward)."""
    need_in, need_off, need_w, need_mask = (bool(v) for v in needs)
    need_mask = need_mask and mask is not None
    geo, x_cl, offset, mask, w = _operands(input, offset, weight, mask, stride, padding, dilation, grad_out.shape[2:])
    N, cin, image, cout, groups, dtype = input.shape[0], input.shape[1], list(input.shape[2:]), weight.shape[0], \
        w.shape[0], input.dtype
    go = _as(grad_out, dtype).reshape(N, groups, cout // groups, geo.L)
    grad_in = torch.empty((N, *image, cin), dtype=dtype, device=input.device) if need_in else None
    grad_off = torch.empty_like(offset) if need_off else None
    grad_mask = torch.empty_like(mask) if need_mask else None
    grad_w = None  # fp32 sums of the chunks' products
    with on_device_of(input), conv_matmul_precision(dtype):
        for s, e, runs in geo.chunks(N):
            whole = (x_cl, offset, mask, go, grad_in, grad_off, grad_mask)
            xs, os, ms, gos, gin, goff, gmsk = whole if e - s == N else _images(s, e, *whole)
            grads = None
            if need_in or need_off or need_mask:
                grads = _Gradients(xs, os, ms, geo, gin, goff, gmsk)
            for l0, le in runs:
                g = gos if le - l0 == geo.L else gos[..., l0:le]
                if need_w:
                    cols = _columns(xs, os, ms, geo, l0, le, dtype).view(e - s, groups, -1, le - l0)
                    part = torch.matmul(g, cols.transpose(-1, -2))
                    # the images' products summed in fp32 (one image's: the product itself where that is fp32)
                    part = part[0] if e - s == 1 and part.dtype == torch.float32 else part.sum(0, dtype=torch.float32)
                    grad_w = part if grad_w is None else grad_w.add_(part)
                    del cols
                if grads is not None:
                    grads.run(torch.matmul(w.transpose(1, 2), g).view(e - s, cin, geo.K, le - l0), l0, le)
            if need_in:
                grads.finish()
    if need_w and grad_w is None:  # no positions
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=input.device)
    return (None if grad_in is None else grad_in.movedim(-1, 1), grad_off,
            None if grad_w is None else _as(grad_w.reshape(weight.shape), weight.dtype), grad_mask)


def deform_conv_transpose(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor],
                          mask: Optional[Tensor], stride, padding, dilation, groups: int,
                          image: Sequence[int]) -> Tensor:
    """The transposed form [N, Cout, *image] (reference.py: deform_conv_transpose): the columns Wᵀ·input spread by the
    gradient kernel's scatter."""
    N, cin, positions = input.shape[0], input.shape[1], list(input.shape[2:])
    kernel = list(weight.shape[2:])
    cout = weight.shape[1] * groups
    r = len(kernel)
    image = list(image)
    G = offset.shape[1] // (math.prod(kernel) * r)
    geo = geometry(image, positions, kernel, stride, padding, dilation, cout, G)
    offset, mask = offset.contiguous(), None if mask is None else mask.contiguous()
    w = weight.to(input.dtype).reshape(groups, cin // groups, -1)
    u = input.reshape(N, groups, cin // groups, geo.L)
    out = torch.empty((N, *image, cout), dtype=input.dtype, device=input.device)
    with on_device_of(input), conv_matmul_precision(input.dtype):
        for s, e, runs in geo.chunks(N):
            grads = _Gradients(None, offset[s:e], None if mask is None else mask[s:e], geo, out[s:e], None, None)
            for l0, le in runs:
                grads.run(torch.matmul(w.transpose(1, 2), u[s:e, ..., l0:le]).view(e - s, cout, geo.K, le - l0),
                          l0, le)
            grads.finish()
    out = out.movedim(-1, 1)
    # a NaN sample point makes its image's output NaN in its offset group's channels (the reference's rule)
    poisoned = torch.isnan(offset.reshape(N, G, -1)).any(-1)
    out = out.masked_fill(poisoned.repeat_interleave(cout // G, 1).reshape(N, cout, *([1] * r)), float("nan"))
    if bias is not None:
        out = out + bias.to(out.dtype).reshape(1, cout, *([1] * r))
    return out.contiguous()
