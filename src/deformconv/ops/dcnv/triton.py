"""DCNv3/DCNv4 Triton kernels: the core's forward and backward (the sampling geometry: geometry.py).

Shapes (NHWC, C = G·D, K points a group):
    input        [N, H, W, C]
    offsets      (Δx, Δy) of point k, group g, output row r = (n, oh, ow):  off[r·OFF_ROW + g·OFF_GROUP + 2k (+1)]
    weights      point k, group g:                                           msk[r·MSK_ROW + g·MSK_GROUP + k]
    out          [N, Ho, Wo, C]
DCNv3's offset and mask are two tensors (OFF_ROW = G·K·2, OFF_GROUP = 2K; MSK_ROW = G·K, MSK_GROUP = K); DCNv4's
offset_mask is one (both rows P, both groups 3K, the weights 2K further on).

A program owns BLOCK_M output positions of one group and all D channels of it (BLOCK_D ≥ D), and takes their K points
one after the other: 4 corner rows of D contiguous channels a point. Where K ≤ 16 (PRELOAD: every 3x3 kernel) a
position's offsets and weights for all its points come first, as tiles of its contiguous run split into per-point
columns in registers (common/sampling.py: row_points), and the backward stores grad_offset and grad_mask as such
tiles too: a load or store a point takes a cache line a position, as many as the 4 corner loads. Otherwise a point's
offsets and weight are loaded at that point. The forward accumulates in fp32; the backward recomputes each sample,
reduces grad_offset and grad_mask over the channels (each written by its one program), and adds grad_input into an
fp32 buffer by atomics (int64 fixed point in deterministic mode: common/fixed_point.py).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...config import options, tracing
from ..common.fixed_point import max_abs, scales_for
from ..common.launch import (
    Launch,
    aligned16,
    backward_warps,
    ceil_div,
    channel_row_blocks,
    on_device_of,
    preload_points,
    remember,
)
from ..common.sampling import accumulate_point, join_columns, point_corners, point_grads, row_points
from .geometry import DcnGeometry

# --- configs -------------------------------------------------------------------------------------------

# (elements, warps) of a program: BLOCK_M·BLOCK_D = 1024 over 4 warps, 8 a thread. Each element holds 4 corner
# values; larger tiles compile to 140-255 registers a thread (2-3 programs an SM), this one to 64-128.
TILE = (1024, 4)
# The backward's: 512 over 4 warps, 4 a thread. Its scatters and channel sums hold more per element than the forward's
# blend; at half the forward's share a thread it runs more programs an SM (docs/tuning.md).
BACKWARD_TILE = (512, 4)
# Sizes the kernels are compiled for any value of: Triton would compile anew for each of them divisible by 16 or not
# (they index pixels, never a contiguous axis), so that images of varying sizes compile each kernel once
# (docs/tuning.md: sizes the kernels are compiled for).
ANY_SIZE = ["H", "W", "HO", "WO"]


# --- kernels -------------------------------------------------------------------------------------------


@triton.jit
def _point_at(dx, dy, mk, k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SCALE,
              KH: tl.constexpr, KW: tl.constexpr, REMOVE_CENTER: tl.constexpr):
    """Point k of every position from its offsets (dx, dy) and weight mk [BLOCK_M] (fp32): its corners
    (point_corners) and its aggregation weight (zero where it does not count)."""
    t = k
    if REMOVE_CENTER:  # the centre, tap c = (KH·KW - 1) / 2 of an odd square kernel, skipped: k // c is 1 past it
        t = k + k // ((KH * KW - 1) // 2)
    i = t // KH  # along the width (outer)
    j = t - i * KH
    ch = (DIL_H * (KH - 1)) // 2
    cw = (DIL_W * (KW - 1)) // 2
    y = (oh * STRIDE_H - PAD_H + ch).to(tl.float32) + ((j * DIL_H - ch).to(tl.float32) + dy) * SCALE
    x = (ow * STRIDE_W - PAD_W + cw).to(tl.float32) + ((i * DIL_W - cw).to(tl.float32) + dx) * SCALE
    p00, v00, v01, v10, v11, ly, lx, inside = point_corners(y, x, n_pix, H, W, C, m_ok)
    return p00, v00, v01, v10, v11, ly, lx, inside, tl.where(inside, mk, 0.0)


@triton.jit
def _point(off_ptr, msk_ptr, off_row, msk_row, k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W,
           DIL_H, DIL_W, SCALE, KH: tl.constexpr, KW: tl.constexpr, REMOVE_CENTER: tl.constexpr):
    """_point_at with point k's offsets and weight loaded here: three loads, each row's in a cache line of its own."""
    dx = tl.load(off_ptr + off_row + 2 * k, mask=m_ok, other=0.0).to(tl.float32)
    dy = tl.load(off_ptr + off_row + 2 * k + 1, mask=m_ok, other=0.0).to(tl.float32)
    mk = tl.load(msk_ptr + msk_row + k, mask=m_ok, other=0.0).to(tl.float32)
    return _point_at(dx, dy, mk, k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
                     SCALE, KH, KW, REMOVE_CENTER)


@triton.jit
def _rows(pid, g, M, HO, WO, H, W, C, OFF_ROW, OFF_GROUP, MSK_ROW, MSK_GROUP, BLOCK_M: tl.constexpr):
    """The program's positions: validity, (oh, ow), the element offset of their image, and their offset and weight
    rows."""
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    L = HO * WO
    n = offs_m // L
    l = offs_m - n * L
    oh = l // WO
    ow = l - oh * WO
    rows = offs_m.to(tl.int64)
    return (m_ok, offs_m, oh, ow, n.to(tl.int64) * H * W * C, rows * OFF_ROW + g * OFF_GROUP,
            rows * MSK_ROW + g * MSK_GROUP)


@triton.jit
def _lanes(g, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Group g's channel lanes: which exist, and their channels g·D + d."""
    offs_d = tl.arange(0, BLOCK_D)
    return offs_d < D, g * D + offs_d


@triton.jit
def _accumulate_point(acc, x_ptr, off_ptr, msk_ptr, off_row, msk_row, k, oh, ow, n_pix, m_ok, cc, d_ok, H, W, C,
                      STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SCALE, D: tl.constexpr, KH: tl.constexpr,
                      KW: tl.constexpr, REMOVE_CENTER: tl.constexpr, BLOCK_D: tl.constexpr):
    """acc + point k's weighted bilinear samples [BLOCK_M, BLOCK_D], its offsets and weight loaded here."""
    p00, v00, v01, v10, v11, ly, lx, inside, mk = _point(
        off_ptr, msk_ptr, off_row, msk_row, k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W,
        DIL_H, DIL_W, SCALE, KH, KW, REMOVE_CENTER)
    return accumulate_point(acc, x_ptr, p00, v00, v01, v10, v11, ly, lx, mk, cc, d_ok, W, C, D, BLOCK_D)


@triton.jit(do_not_specialize=ANY_SIZE)
def _dcn_fwd_kernel(
    x_ptr, off_ptr, msk_ptr, out_ptr,          # see the module docstring; out like x's layout, [N, Ho, Wo, C]
    H, W, HO, WO, M, C,                        # M = N·Ho·Wo
    OFF_ROW, OFF_GROUP, MSK_ROW, MSK_GROUP,
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SCALE,
    D: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, K: tl.constexpr, REMOVE_CENTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PRELOAD: tl.constexpr,                     # the offsets and weights of all K ≤ 16 points loaded first (row_points)
):
    """out[m, g·D + d] = Σ_k w_k · bilinear(x[n, :, :, g·D + d], y_k, x_k). Grid: (M tiles, G)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    m_ok, offs_m, oh, ow, n_pix, off_row, msk_row = _rows(pid, g, M, HO, WO, H, W, C, OFF_ROW, OFF_GROUP, MSK_ROW,
                                                          MSK_GROUP, BLOCK_M)
    d_ok, cc = _lanes(g, D, BLOCK_D)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if PRELOAD:
        dxs, dys, mks = row_points(off_ptr, msk_ptr, off_row, msk_row, m_ok, K, BLOCK_M)
        for k in tl.static_range(K):
            p00, v00, v01, v10, v11, ly, lx, inside, mk = _point_at(
                dxs[k], dys[k], mks[k], k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H,
                DIL_W, SCALE, KH, KW, REMOVE_CENTER)
            acc = accumulate_point(acc, x_ptr, p00, v00, v01, v10, v11, ly, lx, mk, cc, d_ok, W, C, D, BLOCK_D)
    else:
        for k in range(K):
            acc = _accumulate_point(acc, x_ptr, off_ptr, msk_ptr, off_row, msk_row, k, oh, ow, n_pix, m_ok, cc, d_ok,
                                    H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SCALE, D, KH, KW,
                                    REMOVE_CENTER, BLOCK_D)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * C + cc[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=ANY_SIZE)
def _dcn_bwd_kernel(
    x_ptr, off_ptr, msk_ptr, go_ptr,           # go: grad_out [N, Ho, Wo, C]
    gin_ptr,                                   # grad_input accumulator like x: fp32, or int64 if FIXED (NEED_IN)
    goff_ptr, gmsk_ptr,                        # grad_offset and grad_mask, laid out as the offsets and weights
    scale_ptr,                                 # fp32 [1]: grad_input's fixed-point scale (read if FIXED)
    H, W, HO, WO, M, C,
    OFF_ROW, OFF_GROUP, MSK_ROW, MSK_GROUP,
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W, SCALE,
    D: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, K: tl.constexpr, REMOVE_CENTER: tl.constexpr,
    NEED_IN: tl.constexpr, NEED_OFF: tl.constexpr, NEED_MSK: tl.constexpr, FIXED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PRELOAD: tl.constexpr,                     # as _dcn_fwd_kernel's; grad_offset and grad_mask then stored as tiles
):
    """Per point k: grad_mask = Σ_d go·s_k, grad_offset = SCALE·w_k·Σ_d go·∂s_k/∂(x, y) (zero where the point does
    not count), grad_input += go·w_k·(corner weight) at each corner read. Grid: (M tiles, G)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    m_ok, offs_m, oh, ow, n_pix, off_row, msk_row = _rows(pid, g, M, HO, WO, H, W, C, OFF_ROW, OFF_GROUP, MSK_ROW,
                                                          MSK_GROUP, BLOCK_M)
    d_ok, cc = _lanes(g, D, BLOCK_D)
    go = tl.load(go_ptr + offs_m.to(tl.int64)[:, None] * C + cc[None, :], mask=m_ok[:, None] & d_ok[None, :],
                 other=0.0).to(tl.float32)
    if FIXED:
        fixed_scale = tl.load(scale_ptr)
    else:
        fixed_scale = 1.0  # unused
    if PRELOAD:
        dxs, dys, mks = row_points(off_ptr, msk_ptr, off_row, msk_row, m_ok, K, BLOCK_M)
        gms = ()
        gxs = ()
        gys = ()
        for k in tl.static_range(16):
            if k < K:
                p00, v00, v01, v10, v11, ly, lx, inside, mk = _point_at(
                    dxs[k], dys[k], mks[k], k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H,
                    DIL_W, SCALE, KH, KW, REMOVE_CENTER)
                gm, gx, gy = point_grads(x_ptr, go, gin_ptr, p00, v00, v01, v10, v11, ly, lx, inside, mk, SCALE * mk,
                                         SCALE * mk, cc, d_ok, W, C, fixed_scale, D, NEED_IN, NEED_OFF, NEED_MSK,
                                         FIXED, BLOCK_D)
            else:  # the tiles' columns past K (not stored)
                gm = tl.zeros_like(dxs[0])
                gx = gm
                gy = gm
            gms = gms + (gm,)
            gxs = gxs + (gx,)
            gys = gys + (gy,)
        kk = tl.arange(0, 16)
        pm = m_ok[:, None] & (kk < K)[None, :]
        if NEED_MSK:
            tl.store(gmsk_ptr + msk_row[:, None] + kk[None, :],
                     join_columns(gms, BLOCK_M).to(gmsk_ptr.dtype.element_ty), mask=pm)
        if NEED_OFF:
            pair = off_row[:, None, None] + 2 * kk[None, :, None] + tl.arange(0, 2)[None, None, :]
            gxy = tl.join(join_columns(gxs, BLOCK_M), join_columns(gys, BLOCK_M))
            tl.store(goff_ptr + pair, gxy.to(goff_ptr.dtype.element_ty), mask=pm[:, :, None])
    else:
        for k in range(K):
            p00, v00, v01, v10, v11, ly, lx, inside, mk = _point(
                off_ptr, msk_ptr, off_row, msk_row, k, oh, ow, n_pix, m_ok, H, W, C, STRIDE_H, STRIDE_W, PAD_H,
                PAD_W, DIL_H, DIL_W, SCALE, KH, KW, REMOVE_CENTER)
            gm, gx, gy = point_grads(x_ptr, go, gin_ptr, p00, v00, v01, v10, v11, ly, lx, inside, mk, SCALE * mk,
                                     SCALE * mk, cc, d_ok, W, C, fixed_scale, D, NEED_IN, NEED_OFF, NEED_MSK, FIXED,
                                     BLOCK_D)
            if NEED_MSK:
                tl.store(gmsk_ptr + msk_row + k, gm.to(gmsk_ptr.dtype.element_ty), mask=m_ok)
            if NEED_OFF:
                gdt = goff_ptr.dtype.element_ty
                tl.store(goff_ptr + off_row + 2 * k, gx.to(gdt), mask=m_ok)
                tl.store(goff_ptr + off_row + 2 * k + 1, gy.to(gdt), mask=m_ok)


# --- launchers -----------------------------------------------------------------------------------------


def _args(input: Tensor, geo: DcnGeometry, strides: Sequence[int]) -> tuple:
    n, h, w, c = input.shape
    return (h, w, geo.out_h, geo.out_w, n * geo.out_h * geo.out_w, c, *strides, *geo.stride, *geo.pad, *geo.dilation,
            geo.offset_scale)


def _meta(geo: DcnGeometry, tile: Tuple[int, int]) -> dict:
    block_m, block_d, warps = channel_row_blocks(geo.group_channels, tile)  # BLOCK_M positions
    return dict(D=geo.group_channels, KH=geo.kernel[0], KW=geo.kernel[1], K=geo.points,
                REMOVE_CENTER=geo.remove_center, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)


def _grid(geo: DcnGeometry, meta: dict) -> tuple:
    return (ceil_div(geo.batch * geo.out_h * geo.out_w, meta["BLOCK_M"]), geo.group)


class Call:
    """One call signature's launches, worked out once: grid, runtime arguments, meta-parameters and the compiled
    kernels' Launch objects (forward; backward per gradients asked for). A later call allocates its outputs and hands
    the tensors straight to the kernels: at InternImage's late stages the Python that derives a launch costs more
    than the kernels take (dcnv.py keeps these for its eager fast path). DCNv3's tensors are (input, offset, mask),
    DCNv4's (input, offset_mask); all contiguous, with the dtypes, device and pointer alignments of the call it was
    made for (call_for's key)."""

    def __init__(self, geo: DcnGeometry, v4: bool, x: Tensor, offset_channels: int):
        self.geo, self.v4 = geo, v4
        p = offset_channels
        self.strides = (p, 3 * geo.points, p, 3 * geo.points) if v4 else _v3_strides(geo)
        self.meta, self.backward_meta = _meta(geo, TILE), _meta(geo, BACKWARD_TILE)
        self.grid, self.args = _grid(geo, self.meta), _args(x, geo, self.strides)
        self.backward_grid = _grid(geo, self.backward_meta)
        self.out_shape = (geo.batch, geo.out_h, geo.out_w, geo.channels)
        self.dtype, self.device = x.dtype, x.device
        self.preload = preload_points(geo.points)
        self.forward_launch = Launch(_dcn_fwd_kernel, self.grid, self.args,
                                     dict(self.meta, PRELOAD=self.preload))
        self.backward_launches: dict = {}

    def operands(self, tensors) -> tuple:
        """(input, offsets, weights) as the kernels read them: DCNv4's weights are a view of offset_mask."""
        if self.v4:
            x, om = tensors
            return x, om, om[..., 2 * self.geo.points:]
        return tensors

    def forward(self, *tensors) -> Tensor:
        x, off, msk = self.operands(tensors)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        with on_device_of(x):
            self.forward_launch(x, off, msk, out)
        return out

    def grads(self, grad_out: Tensor, *tensors_and_needs) -> tuple:
        """The gradients of the tensors (eager.PlannedCall's backward; the last argument says which are asked for);
        DCNv4's offset_mask's padding channels zero."""
        *tensors, needs = tensors_and_needs
        x, off, msk = self.operands(tensors)
        if self.v4:
            gom = torch.zeros_like(off) if needs[1] else None
            gin = self.backward(grad_out, x, off, msk, gom, gom[..., 2 * self.geo.points:] if needs[1] else None,
                                bool(needs[0]))
            return gin, gom
        goff = torch.empty_like(off) if needs[1] else None  # the kernel stores each of their elements once
        gmsk = torch.empty_like(msk) if needs[2] else None
        return self.backward(grad_out, x, off, msk, goff, gmsk, bool(needs[0])), goff, gmsk

    def backward(self, grad_out: Tensor, x: Tensor, off: Tensor, msk: Tensor, goff: Optional[Tensor],
                 gmsk: Optional[Tensor], need_in: bool) -> Optional[Tensor]:
        """Runs the backward kernel, writing goff and gmsk (laid out as off and msk) where given; returns
        grad_input."""
        go = grad_out.contiguous()
        if not aligned16(go):
            go = go.clone()
        fixed = need_in and torch.are_deterministic_algorithms_enabled()
        gin = scales = None
        if need_in:
            gin = torch.zeros(x.shape, dtype=torch.int64 if fixed else torch.float32, device=self.device)
            if fixed:  # a contribution is go · weight · (bilinear weight <= 1); Ho·Wo·K of them reach one element
                geo = self.geo
                scales = scales_for(max_abs(go) * max_abs(msk) * (geo.out_h * geo.out_w * geo.points))
        key = (need_in, goff is not None, gmsk is not None, fixed, go.dtype)
        launch = self.backward_launches.get(key)
        if launch is None:
            meta = dict(self.backward_meta, NEED_IN=need_in, NEED_OFF=goff is not None, NEED_MSK=gmsk is not None,
                        FIXED=fixed, num_warps=backward_warps(self.backward_meta["num_warps"], fixed),
                        PRELOAD=self.preload)
            launch = self.backward_launches[key] = Launch(_dcn_bwd_kernel, self.backward_grid, self.args, meta)
        with on_device_of(x):
            launch(x, off, msk, go, gin if gin is not None else x, goff if goff is not None else off,
                   gmsk if gmsk is not None else msk, scales[0] if fixed else off)
        if gin is None:
            return None
        if fixed:
            return (gin.double() * scales[1].double()).to(self.dtype)
        return gin.to(self.dtype)


def call_for(geo: DcnGeometry, v4: bool, *tensors: Tensor) -> Call:
    """The Call of these contiguous tensors' signature: the geometry, DCNv3 or DCNv4, and each tensor's shape, dtype,
    device and pointer offset from a 16-byte boundary (a DCNv4 weights view's alignment follows from its
    offset_mask's); kept in options' cache "dcnv_calls"."""
    if tracing():  # no addresses, nothing kept (config.tracing)
        return Call(geo, v4, tensors[0], tensors[1].shape[-1])
    key = (geo, v4, tensors[0].device, tuple([(t.shape, t.dtype, t.data_ptr() % 16) for t in tensors]))
    calls = options.cache("dcnv_calls")
    call = calls.get(key)
    if call is None:
        call = remember(calls, key, Call(geo, v4, tensors[0], tensors[1].shape[-1]))
    return call


def _v3_strides(geo: DcnGeometry) -> tuple:
    k, g = geo.points, geo.group
    return (g * k * 2, 2 * k, g * k, k)


def dcn_forward(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry) -> Tensor:
    """DCNv3: out [N, Ho, Wo, C] in input's dtype."""
    tensors = (input.contiguous(), offset.contiguous(), mask.contiguous())
    return call_for(geo, False, *tensors).forward(*tensors)


def dcn_backward(grad_out: Tensor, input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry,
                 needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """DCNv3: gradients (input, offset, mask); None where needs says so."""
    tensors = (input.contiguous(), offset.contiguous(), mask.contiguous())
    return call_for(geo, False, *tensors).grads(grad_out, *tensors, needs)


def dcnv4_forward(input: Tensor, offset_mask: Tensor, geo: DcnGeometry) -> Tensor:
    """DCNv4: out [N, Ho, Wo, C], reading offset_mask in place."""
    tensors = (input.contiguous(), offset_mask.contiguous())
    return call_for(geo, True, *tensors).forward(*tensors)


def dcnv4_backward(grad_out: Tensor, input: Tensor, offset_mask: Tensor, geo: DcnGeometry,
                   needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """DCNv4: gradients (input, offset_mask), offset_mask's padding channels zero."""
    tensors = (input.contiguous(), offset_mask.contiguous())
    return call_for(geo, True, *tensors).grads(grad_out, *tensors, needs)
