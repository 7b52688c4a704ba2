"""The backward through column buffers and cuBLAS, instead of the fused kernels: grad_weight from the sampled A stored
by a kernel, and grad_input, grad_offset and grad_mask from grad_col's rows.

    grad_weight[k, n] = Σ_m A[m, k]·grad_out[m, n]      (one conv group; k = (tap, input channel))
    grad_col[m, k]    = Σ_n grad_out[m, n]·W[k, n]

Shapes (groups = 1):
    input     [N, H, W, Cin]       NHWC (the backward's copy, or a channels_last input), or offset-grouped
                                   [N, G, H, W, Cin/G] where the backward reads it so (geometry.grouped_input)
    offset, mask                   as the forward's (forward.py)
    cols      [R, kh·kw·Cin]       A's rows m0 .. m0 + R - 1, in the input's dtype; columns in pack_weight's row order
    gcol      [R, kh·kw·Cin]       grad_col's rows m0 .. m0 + R - 1, fp32; columns as A's
    grad_out  [M, Cout]            channels-last rows
    result    [1, 1, kh·kw, Cin, Cout] fp32: finish_grads' partial layout

The fused grad_weight kernel samples A again for every N tile and sums over M in split partials; here A is sampled
once and the product runs at cuBLAS's speed, for the price of writing and reading A: kh·kw times the input's size at
stride 1. A is built R rows at a time (columns_rows bounds its memory). The compile route takes it from MIN_COUT
output channels on (columns_usable); docs/tuning.md has the measurements.

The same buffer the other way: grad_col = grad_out @ Wᵀ by cuBLAS into fp32 rows [R, kh·kw·Cin], then a kernel that
reads them and samples the corners again, scatters grad_col to grad_input and sums grad_offset and grad_mask, as the
fused grad_input kernel does after its own product (backward_data.py). The compile route takes it from MIN_CIN_GRAD_COL
input channels on (grad_columns_usable).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....checks import ConvGeometry
from ....compat import codegen_profile, mm_fp32
from ....config import options, tracing
from ...common.launch import Launch, ceil_div, next_pow2, pointer_specs, remember
from ...common.sampling import bilinear_weights, blend, load_corners, pair_weights, sample_point
from .tiles import position_setup, segment_grads, store_point_grads, tap_origin

# --- config --------------------------------------------------------------------------------------------

BLOCK_M = 64          # positions a program (rows of A)
MAX_BLOCK_K = 64      # channels a step
WARPS = 8
GRAD_TILE = (32, 32, 4)  # the grad_col kernel's (positions, channels a step, warps): sm_90 registers in tuning.md
MIN_BUFFER = 64 << 20  # bytes of A at least allowed at once (else workspace_budget times the chunk's input)
# Under the compile route, from this many output channels on, grad_weight takes the column buffer: traced, the fused
# kernel runs without its register caps and TMA, and the launches cost no host time in the compiled graph, while A's
# product runs on cuBLAS. With fewer output channels the product is small against A's round trip through memory. An
# eager call keeps the fused kernel: there it runs beside the grad_input kernel on a side stream, in fewer launches.
MIN_COUT = 128
# Under the compile route, from this many input channels on, grad_input, grad_offset and grad_mask take grad_col's rows:
# the fused grad_input kernel holds a tap run's product, sampling and scatter at once (255 registers, 12% occupancy on
# sm_90) and waits on latency; with rows this wide cuBLAS's product and the light scatter kernel beat it, with fewer
# channels the fp32 rows' round trip through memory costs more than it saves. An eager call keeps the fused kernel,
# which there runs beside the grad_weight kernel on a side stream.
MIN_CIN_GRAD_COL = 512


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _columns_kernel(
    x_ptr,        # input NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask NCHW [N, G*KH*KW, Ho, Wo]   (read if HAS_MASK; logits: sampling.MASK_LOGITS)
    cols_ptr,     # A's rows [R, KH*KW*Cin] from position TILE0*BLOCK_M on
    H, W, CIN, HO, WO, M, COG, G,
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    TILE0,        # the first M tile of this buffer
    KH: tl.constexpr, KW: tl.constexpr, HAS_MASK: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """A[m, tap·Cin + c] = mask · bilinear(x[n, :, :, c], point of (m, tap, offset group of c)). Grid: (M tiles of
    the buffer, taps, offset groups)."""
    pid_m = TILE0 + tl.program_id(0)
    tap = tl.program_id(1)
    og = tl.program_id(2)
    KK: tl.constexpr = KH * KW
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK, False, BLOCK_M)
    y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
    PIX = COG if GROUPED else CIN  # the pixel stride, and where the group's channels start from a pixel's
    group0 = og * (tl.cast(H * W, tl.int64) * COG if GROUPED else COG)  # tl.cast: H, W may be constants
    p00, v00, v01, v10, v11, ly, lx, mv = sample_point(off_ptr, msk_ptr, off_row, msk_row, og * KK + tap, HO * WO,
                                                       y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK)
    w00, w01, w10, w11 = bilinear_weights(ly, lx, mv)  # A blended in fp32 and rounded once, as grad_weight's kernel
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) * (KK * CIN) + tap * CIN
    offs_k = tl.arange(0, BLOCK_K)
    for c0 in range(0, COG, BLOCK_K):
        k_ok = c0 + offs_k < COG
        c00, c01, c10, c11 = load_corners(x_ptr, p00, group0 + c0 + offs_k, k_ok, v00, v01, v10, v11, W, PIX, False)
        a = blend(w00, w01, w10, w11, c00.to(tl.float32), c01.to(tl.float32), c10.to(tl.float32), c11.to(tl.float32),
                  False)
        tl.store(cols_ptr + rows[:, None] + (og * COG + c0 + offs_k)[None, :], a.to(cols_ptr.dtype.element_ty),
                 mask=m_valid[:, None] & k_ok[None, :])


@triton.jit
def _grad_columns_kernel(
    x_ptr,        # input NHWC [N, H, W, Cin], or offset-grouped [N, G, H, W, Cin/G] if GROUPED
    off_ptr,      # offset NCHW [N, 2*G*KH*KW, Ho, Wo]
    msk_ptr,      # mask NCHW [N, G*KH*KW, Ho, Wo]   (read if HAS_MASK; logits: sampling.MASK_LOGITS)
    gcol_ptr,     # grad_col's rows [R, KH*KW*Cin] fp32 from position TILE0*BLOCK_M on
    gin_ptr,      # grad_input's accumulator fp32 in x's layout, zeroed (atomic adds; if NEED_GIN)
    goff_ptr,     # grad_offset like offset (if NEED_GOFF)
    gmsk_ptr,     # grad_mask like mask (if NEED_GMSK)
    H, W, CIN, HO, WO, M, COG, G,
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    TILE0,        # the first M tile of this buffer
    KH: tl.constexpr, KW: tl.constexpr, HAS_MASK: tl.constexpr, GROUPED: tl.constexpr,
    NEED_GIN: tl.constexpr, NEED_GOFF: tl.constexpr, NEED_GMSK: tl.constexpr,
    PAIRS_OUTER: tl.constexpr,    # corner pairs addressed pair axis outermost (compat.CodegenProfile)
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """grad_col[m, tap·Cin + c] scattered to the 4 corners of its sample point (atomics) and summed over the offset
    group's channels into grad_offset and grad_mask (each (position, tap, offset group) owned by one program: plain
    stores). Grid: (M tiles of the buffer, taps, offset groups)."""
    pid_m = TILE0 + tl.program_id(0)
    tap = tl.program_id(1)
    og = tl.program_id(2)
    KK: tl.constexpr = KH * KW
    L = HO * WO
    m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = position_setup(
        pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK, False, BLOCK_M)
    y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
    ch = og * KK + tap
    PIX = COG if GROUPED else CIN  # the pixel stride, and where the group's channels start from a pixel's
    group0 = og * (tl.cast(H * W, tl.int64) * COG if GROUPED else COG)  # tl.cast: H, W may be constants
    p00, v00, v01, v10, v11, ly, lx, mv = sample_point(off_ptr, msk_ptr, off_row, msk_row, ch, L, y_ref, x_ref,
                                                       pix_base, H, W, PIX, m_valid, HAS_MASK)
    # one segment a chunk, as corner_pairs and pair_sums take them: [BM, 1] points, [BM, 1, BK] channels
    p00, v00, v01, v10, v11 = p00[:, None], v00[:, None], v01[:, None], v10[:, None], v11[:, None]
    ly, lx, mv = ly[:, None], lx[:, None], mv[:, None]
    wt, wb = pair_weights(ly, lx, mv)
    s00 = tl.zeros((BLOCK_M, 1), tl.float32)
    sdx = tl.zeros((BLOCK_M, 1), tl.float32)
    sdy = tl.zeros((BLOCK_M, 1), tl.float32)
    sdy1 = tl.zeros((BLOCK_M, 1), tl.float32)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64) * (KK * CIN) + tap * CIN
    offs_k = tl.arange(0, BLOCK_K)
    for c0 in range(0, COG, BLOCK_K):
        k_ok = c0 + offs_k < COG
        g = tl.load(gcol_ptr + rows[:, None] + (og * COG + c0 + offs_k)[None, :], mask=m_valid[:, None] & k_ok[None, :],
                    other=0.0)
        s00, sdx, sdy, sdy1 = segment_grads(x_ptr, gin_ptr, p00, (group0 + c0 + offs_k)[None, :],
                                            tl.reshape(g, (BLOCK_M, 1, BLOCK_K)), wt, wb, v00, v01, v10, v11, W * PIX,
                                            PIX, 1.0, s00, sdx, sdy, sdy1, NEED_GMSK or NEED_GOFF, NEED_GIN, False,
                                            PAIRS_OUTER, k_ok[None, :])
    store_point_grads(goff_ptr, gmsk_ptr, off_row, msk_row, ch, L, s00, sdx, sdy, sdy1, ly, lx, mv, m_valid, HAS_MASK,
                      NEED_GOFF, NEED_GMSK)


# --- launchers -----------------------------------------------------------------------------------------


def columns_usable(geo: ConvGeometry, dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether grad_weight takes the column buffer: at least MIN_COUT output channels (_route_taken, forced by
    options.columns_grad_weight)."""
    return _route_taken(geo, dtype, deterministic, options.columns_grad_weight, geo.out_channels >= MIN_COUT)


def grad_columns_usable(geo: ConvGeometry, dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether grad_input, grad_offset and grad_mask take the grad_col buffer: at least MIN_CIN_GRAD_COL input channels
    (_route_taken, forced by options.columns_grad_data)."""
    return _route_taken(geo, dtype, deterministic, options.columns_grad_data, geo.in_channels >= MIN_CIN_GRAD_COL)


def _route_taken(geo: ConvGeometry, dtype: torch.dtype, deterministic: bool, forced: Optional[bool],
                 wide: bool) -> bool:
    """A column route's rule: where the buffers apply (_buffers_apply), traced for the compile route where the layer is
    wide enough for it; or, forced by its options field, wherever they apply (True) or never (False)."""
    if not _buffers_apply(geo, dtype, deterministic):
        return False
    if forced is not None:
        return bool(forced)
    return tracing() and wide


def _buffers_apply(geo: ConvGeometry, dtype: torch.dtype, deterministic: bool) -> bool:
    """One conv group, 16-bit inputs (fp32's products would follow cuBLAS's TF32 switch, not cuDNN's as the kernels
    do), not in deterministic mode (torch.use_deterministic_algorithms: cuBLAS's products then need its own
    deterministic workspace setting, CUBLAS_WORKSPACE_CONFIG, and fail without it), whatever gradients are asked for."""
    return geo.groups == 1 and dtype in (torch.float16, torch.bfloat16) and not deterministic


def columns_rows(geo: ConvGeometry, images: int, elem: int, budget: float, row_elem: Optional[int] = None) -> int:
    """Rows of a buffer built at once (row_elem bytes an element, else elem, the input's): what max(budget × the
    chunk's input, MIN_BUFFER) bytes hold, in whole M tiles (an infinite budget: all of the chunk's positions)."""
    if math.isinf(budget):
        return max(BLOCK_M, ceil_div(images * geo.out_h * geo.out_w, BLOCK_M) * BLOCK_M)
    row_bytes = geo.kernel_h * geo.kernel_w * geo.in_channels * (row_elem or elem)
    input_bytes = images * geo.in_channels * geo.height * geo.width * elem
    rows = max(budget * input_bytes, MIN_BUFFER) // max(row_bytes, 1)
    return max(BLOCK_M, int(rows) // BLOCK_M * BLOCK_M)


def columns_grad_weight(geo: ConvGeometry, x: Tensor, off: Tensor, msk: Optional[Tensor], go: Tensor,
                        budget: float, grouped: bool, has_mask: int) -> Tensor:
    """grad_weight's fp32 sum [1, 1, kh·kw, Cin, Cout] over the chunk's images (x, off, msk and go: the chunk's; x as
    the kernel reads it, offset-grouped if grouped; go channels-last [n, Cout, Ho, Wo]; has_mask: the kernels'
    HAS_MASK for msk)."""
    n = x.shape[0]
    kk, cin, cout = geo.kernel_h * geo.kernel_w, geo.in_channels, geo.out_channels
    m = n * geo.out_h * geo.out_w
    go_rows = go.permute(0, 2, 3, 1).reshape(m, cout)  # a view of a channels-last grad_out
    if m == 0:  # no positions
        return torch.zeros((1, 1, kk, cin, cout), dtype=torch.float32, device=x.device)
    rows = min(columns_rows(geo, n, x.element_size(), budget), m)  # whole M tiles, or the chunk's positions exactly
    cols = torch.empty((rows, kk * cin), dtype=x.dtype, device=x.device)
    gw: Optional[Tensor] = None
    for m0 in range(0, m, rows):
        r = min(rows, m - m0)
        tensors = (x, off, msk if msk is not None else off, cols)
        _launch(geo, n, m, m0, r, has_mask, grouped, pointer_specs(tensors))(*tensors)
        whole = r == m  # one buffer: no slices (each costs host time, and views of traced tensors more)
        part = mm_fp32((cols if whole else cols[:r]).t(), go_rows if whole else go_rows[m0:m0 + r])
        gw = part if gw is None else gw.add_(part)
    return gw.view(1, 1, kk, cin, cout)


def columns_grad_data(geo: ConvGeometry, x: Tensor, off: Tensor, msk: Optional[Tensor], wp: Tensor, go: Tensor,
                      gin: Optional[Tensor], goff: Optional[Tensor], gmsk: Optional[Tensor], budget: float,
                      grouped: bool, has_mask: int) -> None:
    """grad_input's fp32 adds into gin, grad_offset into goff and grad_mask into gmsk (None: not needed) for the
    chunk's images, through grad_col's rows (x and gin NHWC, or offset-grouped if grouped; off and msk as the
    forward's; wp pack_weight's [1, kh·kw, Cin, Cout]; go channels-last [n, Cout, Ho, Wo])."""
    n = x.shape[0]
    kk, cin, cout = geo.kernel_h * geo.kernel_w, geo.in_channels, geo.out_channels
    m = n * geo.out_h * geo.out_w
    if m == 0:
        return
    go_rows = go.permute(0, 2, 3, 1).reshape(m, cout)
    w_t = wp.reshape(kk * cin, cout).t()  # grad_col = grad_out @ Wpᵀ: columns in pack_weight's row order
    rows = min(columns_rows(geo, n, x.element_size(), budget, row_elem=4), m)  # fp32 rows
    needs = (gin is not None, goff is not None, gmsk is not None)
    for m0 in range(0, m, rows):
        r = min(rows, m - m0)
        gcol = mm_fp32(go_rows if r == m else go_rows[m0:m0 + r], w_t)
        tensors = (x, off, msk if msk is not None else off, gcol, gin if gin is not None else gcol,
                   goff if goff is not None else off, gmsk if gmsk is not None else off)
        _data_launch(geo, n, m, m0, r, has_mask, grouped, needs, pointer_specs(tensors))(*tensors)


def _data_launch(geo: ConvGeometry, n: int, m: int, m0: int, r: int, has_mask: int, grouped: bool, needs: tuple,
                 specs: tuple) -> Launch:
    """The launch of grad_col's rows m0 .. m0 + r - 1, planned once per call signature."""
    return _buffer_launch(_grad_columns_kernel, "grad_columns", (geo, n, m0, r, has_mask, grouped, needs, specs), geo,
                          m, m0, r, GRAD_TILE, lambda: dict(
                              HAS_MASK=has_mask, GROUPED=grouped, NEED_GIN=needs[0], NEED_GOFF=needs[1],
                              NEED_GMSK=needs[2], PAIRS_OUTER=codegen_profile().pair_axis_outer))


def _launch(geo: ConvGeometry, n: int, m: int, m0: int, r: int, has_mask: int, grouped: bool,
            specs: tuple) -> Launch:
    """The launch of rows m0 .. m0 + r - 1 of A, planned once per call signature."""
    return _buffer_launch(_columns_kernel, "columns", (geo, n, m0, r, has_mask, grouped, specs), geo, m, m0, r,
                          (BLOCK_M, MAX_BLOCK_K, WARPS), lambda: dict(HAS_MASK=has_mask, GROUPED=grouped))


def _buffer_launch(kernel, cache: str, key: tuple, geo: ConvGeometry, m: int, m0: int, r: int,
                   tile: Tuple[int, int, int], kernel_meta: Callable[[], dict]) -> Launch:
    """A kernel's launch over a buffer's rows m0 .. m0 + r - 1 (grid: their M tiles, taps, offset groups), kept in the
    named cache under key (the call signature with its tensors' pointer_specs, which Triton specialises on). tile:
    (positions, channels a step, warps); the positions divide BLOCK_M, so a buffer starts at a whole tile.
    kernel_meta: the kernel's own meta-parameters, worked out only when the key is new."""
    runs = options.cache(cache)
    run = runs.get(key)
    if run is None:
        block_m, block_k, warps = tile
        cog = geo.in_channels // geo.offset_groups
        args = (geo.height, geo.width, geo.in_channels, geo.out_h, geo.out_w, m, cog, geo.offset_groups,
                *geo.stride, *geo.padding, *geo.dilation, m0 // block_m)
        meta = dict(kernel_meta(), KH=geo.kernel_h, KW=geo.kernel_w, BLOCK_M=block_m,
                    BLOCK_K=min(block_k, next_pow2(max(cog, 1))), num_warps=warps)
        grid = (ceil_div(r, block_m), geo.kernel_h * geo.kernel_w, geo.offset_groups)
        run = remember(runs, key, Launch(kernel, grid, args, meta))
    return run
