"""Multi-scale deformable attention's Triton kernels, forward and backward (shapes: reference.py).

A program owns BLOCK_Q query rows (r = n·Lq + q) of one head m and all D channels of it (BLOCK_D ≥ D). Per level it
reads (H_l, W_l, start_l) from the shape tensors on the device (no host read), and per point 4 corner rows of D
contiguous channels of value [N, S, M, D] (pixels M·D elements apart: common/sampling.py's point_corners and
load_corners). Where its L·P points fit 16 columns (common/launch.py: preload_points) a query's locations and
weights are loaded first for all of them (PRELOAD: row_points, as DCNv3's kernels take their offsets) and the
backward's grad_location and grad_attention go out as tiles; beyond, a point's location and weight are loaded at that
point. The forward accumulates in
fp32. The backward recomputes each sample, reduces grad_location and grad_attention over the channels (each written
by its one program), and adds grad_value into an fp32 buffer by atomics (int64 fixed point in deterministic mode:
common/fixed_point.py).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...config import options
from ..common.fixed_point import max_abs, scales_for
from ..common.launch import (
    Launch,
    aligned16,
    backward_warps,
    ceil_div,
    channel_row_blocks,
    on_device_of,
    pointer_specs,
    preload_points,
    remember,
)
from ..common.sampling import accumulate_point, join_columns, point_corners, point_grads, row_points

# --- configs -------------------------------------------------------------------------------------------

TILE = (256, 2)  # (elements, warps) of a program: 8 queries of 32 channels (docs/tuning.md: point parameters)
# Sizes the kernels are compiled for any value of: Triton would compile anew for each of them divisible by 16 or not,
# and they only index queries and pixels (the default kernels' machine code is the same either way), so that inputs
# of varying sizes compile each kernel once (docs/tuning.md: sizes the kernels are compiled for).
ANY_SIZE = ["LQ", "S"]


def forward_warps(warps: int, dtype: torch.dtype) -> int:
    """The forward's warps: for a 16-bit value half the tile's, so that a thread loads as many bytes of a corner row
    (16: 8 channels, 4 in fp32) from the same programs; the backward, whose threads also add into the fp32 gradient,
    keeps the tile's (docs/tuning.md: the 16-bit forward). A tile forced by options.gather_tile is taken as it is."""
    return max(1, warps // 2) if dtype.itemsize == 2 and options.gather_tile is None else warps


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _program(R, LQ, M, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's query rows (valid, image) and head m, the head's channel lanes, their offsets in a value pixel,
    and a pixel's stride (M·D)."""
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    return rows, rows < R, (rows // LQ).to(tl.int64), m, offs_d, offs_d < D, m * D + offs_d, M * D


@triton.jit
def _level(shapes_ptr, starts_ptr, lvl, r_img, S, PIX):
    """Level lvl's (H, W) and the element offset of its first pixel in each row's image. A level that does not lie
    within the S pixels (shapes not checked on the host: reading them there would wait for the GPU) is taken as
    0 x 0: nothing of it is read."""
    h = tl.load(shapes_ptr + 2 * lvl)
    w = tl.load(shapes_ptr + 2 * lvl + 1)
    start = tl.load(starts_ptr + lvl)
    ok = (start >= 0) & (h >= 0) & (w >= 0) & (start + h * w <= S)
    h = tl.where(ok, h, 0)
    w = tl.where(ok, w, 0)
    return h, w, (r_img * S + start) * PIX


@triton.jit
def _point_at(lx_raw, ly_raw, a, h, w, pix_base, PIX, r_ok):
    """A point of every row from its normalised location (x, y) and attention weight [BLOCK_Q] (fp32): its corners
    (point_corners), its weight (zero where it does not count)."""
    x = lx_raw * w.to(tl.float32) - 0.5
    y = ly_raw * h.to(tl.float32) - 0.5
    p00, v00, v01, v10, v11, ly, lx, inside = point_corners(y, x, pix_base, h, w, PIX, r_ok)
    return p00, v00, v01, v10, v11, ly, lx, inside, tl.where(inside, a, 0.0)


@triton.jit
def _point(loc_ptr, attn_ptr, idx, h, w, pix_base, PIX, r_ok):
    """_point_at with point idx's location and weight loaded here (three loads, each row's in a line of its own)."""
    return _point_at(tl.load(loc_ptr + 2 * idx, mask=r_ok, other=0.0).to(tl.float32),
                     tl.load(loc_ptr + 2 * idx + 1, mask=r_ok, other=0.0).to(tl.float32),
                     tl.load(attn_ptr + idx, mask=r_ok, other=0.0).to(tl.float32), h, w, pix_base, PIX, r_ok)


@triton.jit
def _accumulate_level(acc, value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, point_row, lvl, r_img, r_ok, cc, d_ok,
                      S, PIX, D: tl.constexpr, P: tl.constexpr, BLOCK_D: tl.constexpr):
    """acc + level lvl's attention-weighted bilinear samples [BLOCK_Q, BLOCK_D] of its P points."""
    h, w, pix_base = _level(shapes_ptr, starts_ptr, lvl, r_img, S, PIX)
    for p in range(P):
        acc = _accumulate_point(acc, value_ptr, loc_ptr, attn_ptr, point_row + lvl * P + p, h, w, pix_base, PIX, r_ok,
                                cc, d_ok, D, BLOCK_D)
    return acc


@triton.jit
def _accumulate_point(acc, value_ptr, loc_ptr, attn_ptr, idx, h, w, pix_base, PIX, r_ok, cc, d_ok, D: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """acc + one point's attention-weighted bilinear samples."""
    p00, v00, v01, v10, v11, ly, lx, inside, a = _point(loc_ptr, attn_ptr, idx, h, w, pix_base, PIX, r_ok)
    return accumulate_point(acc, value_ptr, p00, v00, v01, v10, v11, ly, lx, a, cc, d_ok, w, PIX, D, BLOCK_D)


@triton.jit(do_not_specialize=ANY_SIZE)
def _msda_fwd_kernel(
    value_ptr,    # [N, S, M, D]
    shapes_ptr,   # int64 [L, 2]: (H_l, W_l)
    starts_ptr,   # int64 [L]
    loc_ptr,      # [N, Lq, M, L, P, 2]
    attn_ptr,     # [N, Lq, M, L, P]
    out_ptr,      # [N, Lq, M, D]
    R, LQ, S, M,  # R = N·Lq rows
    D: tl.constexpr, L: tl.constexpr, P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    PRELOAD: tl.constexpr,  # the locations and weights of all L·P ≤ 16 points loaded first (row_points)
):
    """out[r, m·D + d] = Σ_l Σ_p a · bilinear(value level l, head m, channel d). Grid: (row tiles, M)."""
    rows, r_ok, r_img, m, offs_d, d_ok, cc, PIX = _program(R, LQ, M, D, BLOCK_Q, BLOCK_D)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    point_row = (rows.to(tl.int64) * M + m) * (L * P)
    if PRELOAD:
        xs, ys, ats = row_points(loc_ptr, attn_ptr, 2 * point_row, point_row, r_ok, L * P, BLOCK_Q)
        for lvl in tl.static_range(L):
            h, w, pix_base = _level(shapes_ptr, starts_ptr, lvl, r_img, S, PIX)
            for p in tl.static_range(P):
                p00, v00, v01, v10, v11, ly, lx, inside, a = _point_at(xs[lvl * P + p], ys[lvl * P + p],
                                                                       ats[lvl * P + p], h, w, pix_base, PIX, r_ok)
                acc = accumulate_point(acc, value_ptr, p00, v00, v01, v10, v11, ly, lx, a, cc, d_ok, w, PIX, D, BLOCK_D)
    else:
        for lvl in range(L):
            acc = _accumulate_level(acc, value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr, point_row, lvl, r_img,
                                    r_ok, cc, d_ok, S, PIX, D, P, BLOCK_D)
    out = out_ptr + (rows.to(tl.int64) * M + m)[:, None] * D + offs_d[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=ANY_SIZE)
def _msda_bwd_kernel(
    value_ptr, shapes_ptr, starts_ptr, loc_ptr, attn_ptr,
    go_ptr,       # grad_out [N, Lq, M, D]
    gv_ptr,       # grad_value accumulator like value: fp32, or int64 if FIXED (NEED_V)
    gloc_ptr,     # grad_location like loc (NEED_LOC)
    gattn_ptr,    # grad_attention like attn (NEED_ATTN)
    scale_ptr,    # fp32 [1]: grad_value's fixed-point scale (read if FIXED)
    R, LQ, S, M,
    D: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
    NEED_V: tl.constexpr, NEED_LOC: tl.constexpr, NEED_ATTN: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
    PRELOAD: tl.constexpr,  # as _msda_fwd_kernel's; grad_location and grad_attention then stored as tiles
):
    """Per point: grad_attention = Σ_d go·s, grad_location = a·Σ_d go·∂s/∂(x, y)·(W_l, H_l) (zero where the point
    does not count), grad_value += go·a·(corner weight) at each corner read. Grid: (row tiles, M)."""
    rows, r_ok, r_img, m, offs_d, d_ok, cc, PIX = _program(R, LQ, M, D, BLOCK_Q, BLOCK_D)
    go = tl.load(go_ptr + (rows.to(tl.int64) * M + m)[:, None] * D + offs_d[None, :],
                 mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if FIXED:
        fixed_scale = tl.load(scale_ptr)
    else:
        fixed_scale = 1.0  # unused
    point_row = (rows.to(tl.int64) * M + m) * (L * P)
    if PRELOAD:
        xs, ys, ats = row_points(loc_ptr, attn_ptr, 2 * point_row, point_row, r_ok, L * P, BLOCK_Q)
        gas = ()
        gxs = ()
        gys = ()
        for lvl in tl.static_range(L):
            h, w, pix_base = _level(shapes_ptr, starts_ptr, lvl, r_img, S, PIX)
            for p in tl.static_range(P):
                p00, v00, v01, v10, v11, ly, lx, inside, a = _point_at(xs[lvl * P + p], ys[lvl * P + p],
                                                                       ats[lvl * P + p], h, w, pix_base, PIX, r_ok)
                ga, gx, gy = point_grads(value_ptr, go, gv_ptr, p00, v00, v01, v10, v11, ly, lx, inside, a,
                                         a * w.to(tl.float32), a * h.to(tl.float32), cc, d_ok, w, PIX, fixed_scale,
                                         D, NEED_V, NEED_LOC, NEED_ATTN, FIXED, BLOCK_D)
                gas = gas + (ga,)
                gxs = gxs + (gx,)
                gys = gys + (gy,)
        zero = tl.zeros_like(xs[0])
        for _ in tl.static_range(L * P, 16):  # the tiles' columns past L·P (not stored)
            gas = gas + (zero,)
            gxs = gxs + (zero,)
            gys = gys + (zero,)
        kk = tl.arange(0, 16)
        pm = r_ok[:, None] & (kk < L * P)[None, :]
        if NEED_ATTN:
            tl.store(gattn_ptr + point_row[:, None] + kk[None, :],
                     join_columns(gas, BLOCK_Q).to(gattn_ptr.dtype.element_ty), mask=pm)
        if NEED_LOC:
            pair = 2 * point_row[:, None, None] + 2 * kk[None, :, None] + tl.arange(0, 2)[None, None, :]
            gxy = tl.join(join_columns(gxs, BLOCK_Q), join_columns(gys, BLOCK_Q))
            tl.store(gloc_ptr + pair, gxy.to(gloc_ptr.dtype.element_ty), mask=pm[:, :, None])
    else:
        for lvl in range(L):
            h, w, pix_base = _level(shapes_ptr, starts_ptr, lvl, r_img, S, PIX)
            for p in range(P):
                idx = point_row + lvl * P + p
                p00, v00, v01, v10, v11, ly, lx, inside, a = _point(loc_ptr, attn_ptr, idx, h, w, pix_base, PIX, r_ok)
                ga, gx, gy = point_grads(value_ptr, go, gv_ptr, p00, v00, v01, v10, v11, ly, lx, inside, a,
                                         a * w.to(tl.float32), a * h.to(tl.float32), cc, d_ok, w, PIX, fixed_scale,
                                         D, NEED_V, NEED_LOC, NEED_ATTN, FIXED, BLOCK_D)
                if NEED_ATTN:
                    tl.store(gattn_ptr + idx, ga.to(gattn_ptr.dtype.element_ty), mask=r_ok)
                if NEED_LOC:
                    gdt = gloc_ptr.dtype.element_ty
                    tl.store(gloc_ptr + 2 * idx, gx.to(gdt), mask=r_ok)
                    tl.store(gloc_ptr + 2 * idx + 1, gy.to(gdt), mask=r_ok)


# --- launchers -----------------------------------------------------------------------------------------


def _setup(value: Tensor, sampling_locations: Tensor):
    n, s, m, d = value.shape
    _, lq, _, levels, points, _ = sampling_locations.shape
    block_q, block_d, warps = channel_row_blocks(d, TILE)  # BLOCK_Q queries
    grid = (ceil_div(n * lq, block_q), m)
    meta = dict(D=d, L=levels, P=points, BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=warps)
    return grid, (n * lq, lq, s, m), meta  # (the sizes: the kernels' runtime arguments)


class Call:
    """One call signature's launches, worked out once: the grid, the runtime sizes and meta-parameters, and the
    compiled kernels' Launch objects (forward, and backward per needs). A later call of the signature allocates its
    outputs and hands the tensors straight to the kernels: at the decoder's loads the Python that derives a launch
    costs more than the kernel takes (msda.py keeps these for its eager fast path). Tensors come contiguous, with the
    dtypes, device and 16-byte alignments of the call it was made for (call_for's key)."""

    def __init__(self, value: Tensor, sampling_locations: Tensor):
        self.grid, self.sizes, self.meta = _setup(value, sampling_locations)
        n, _, m, d = value.shape
        self.out_shape = (n, sampling_locations.shape[1], m * d)
        self.dtype, self.device = value.dtype, value.device
        self.preload = preload_points(self.meta["L"] * self.meta["P"])
        self.forward_launch = Launch(_msda_fwd_kernel, self.grid, self.sizes,
                                     dict(self.meta, PRELOAD=self.preload,
                                          num_warps=forward_warps(self.meta["num_warps"], value.dtype)))
        self.backward_launches: dict = {}

    def forward(self, value, shapes, starts, loc, attn) -> Tensor:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        with on_device_of(value):
            self.forward_launch(value, shapes, starts, loc, attn, out)
        return out

    def grads(self, go, value, shapes, starts, loc, attn, needs: Sequence[bool]) -> tuple:
        """The gradients of the five inputs (eager.PlannedCall's backward; needs: which are asked for): those of
        value, the locations and the weights, None for the shape tensors."""
        go = go.contiguous()
        if not aligned16(go):
            go = go.clone()
        needs3 = (bool(needs[0]), bool(needs[3]), bool(needs[4]))
        gv, gloc, gattn = self.backward(go, value, shapes, starts, loc, attn, needs3,
                                        needs3[0] and torch.are_deterministic_algorithms_enabled())
        return gv, None, None, gloc, gattn

    def backward(self, go, value, shapes, starts, loc, attn, needs: Tuple[bool, bool, bool], fixed: bool):
        """The gradients (see ms_deform_attn_backward); go contiguous and 16-byte aligned."""
        need_v, need_loc, need_attn = needs
        gv = torch.zeros(value.shape, dtype=torch.int64 if fixed else torch.float32,
                         device=self.device) if need_v else None
        gloc = torch.empty_like(loc) if need_loc else None  # the kernel stores each of their elements once
        gattn = torch.empty_like(attn) if need_attn else None
        scales = None
        if fixed:  # a contribution is go · a · (bilinear weight <= 1); Lq·P of them reach one element of a level
            scales = scales_for(max_abs(go) * max_abs(attn) * (loc.shape[1] * loc.shape[4]))
        key = (needs, fixed, go.dtype)
        launch = self.backward_launches.get(key)
        if launch is None:
            meta = dict(self.meta, NEED_V=need_v, NEED_LOC=need_loc, NEED_ATTN=need_attn, FIXED=fixed,
                        num_warps=backward_warps(self.meta["num_warps"], fixed), PRELOAD=self.preload)
            launch = self.backward_launches[key] = Launch(_msda_bwd_kernel, self.grid, self.sizes, meta)
        with on_device_of(value):
            launch(value, shapes, starts, loc, attn, go, gv if gv is not None else value,
                   gloc if gloc is not None else loc, gattn if gattn is not None else attn,
                   scales[0] if fixed else attn)
        if gv is not None:
            gv = (gv.double() * scales[1].double()).to(self.dtype) if fixed else gv.to(self.dtype)
        return gv, gloc, gattn


def call_for(value: Tensor, shapes: Tensor, starts: Tensor, loc: Tensor, attn: Tensor) -> Call:
    """The Call of these (contiguous, non-empty) tensors' signature: shapes, dtypes, device and each pointer's 16-byte
    alignment, all that a compiled launch is specialised on (kept in options' cache "msda_calls")."""
    key = (value.shape, loc.shape, value.device, pointer_specs((value, shapes, starts, loc, attn)))
    calls = options.cache("msda_calls")
    call = calls.get(key)
    if call is None:
        call = remember(calls, key, Call(value, loc))
    return call


def ms_deform_attn_forward(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                           sampling_locations: Tensor, attention_weights: Tensor) -> Tensor:
    """out [N, Lq, M·D] in value's dtype."""
    n, _, m, d = value.shape
    lq = sampling_locations.shape[1]
    if n * lq * m * d == 0:
        return torch.empty(n, lq, m * d, dtype=value.dtype, device=value.device)
    tensors = (value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
               sampling_locations.contiguous(), attention_weights.contiguous())
    return call_for(*tensors).forward(*tensors)


def ms_deform_attn_backward(grad_out: Tensor, value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor,
                            sampling_locations: Tensor, attention_weights: Tensor, needs: Sequence[bool]
                            ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (value, sampling_locations, attention_weights); None where needs says so."""
    need_v, need_loc, need_attn = needs = tuple(bool(x) for x in needs)
    tensors = (value.contiguous(), spatial_shapes.contiguous(), level_start_index.contiguous(),
               sampling_locations.contiguous(), attention_weights.contiguous())
    go = grad_out.contiguous()
    if not (go.numel() and value.numel()):  # nothing sampled: zero gradients
        grads = [torch.zeros_like(t) if need else None for t, need in zip((tensors[0], tensors[3], tensors[4]), needs)]
        return grads[0], grads[1], grads[2]
    fixed = need_v and torch.are_deterministic_algorithms_enabled()
    if not aligned16(go):
        go = go.clone()
    return call_for(*tensors).backward(go, *tensors, needs, fixed)
