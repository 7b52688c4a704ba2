"""The CPU backend: deform_conv2d in plain PyTorch, laid out for the CPU.

The definition is the reference's (reference.py): the same sample points, bilinear weights, zeros outside the
image, torchvision's one-sided offset derivatives and NaN semantics. The layout differs. The reference gathers
every corner value element by element from an NCHW image. This backend reads the image channels-last as rows of
channels, one row per (pixel, offset group), so a corner is one row copied by ``index_select``. It orders the
sample points (image, position, tap, offset group), which makes the blended rows the im2col matrix
``[N·Ho·Wo, kh·kw·Cin]`` as they are written: one GEMM against the weight, and an output that is channels-last
without a copy.

Shapes, per chunk of n images (L = Ho·Wo, K = kh·kw, G offset groups of Cg channels, C = G·Cg):
    rows      [n·H·W·G + 1, Cg]   the image, plus one zero row that every corner outside the image reads
    index     [n, L, K, G]        the row of each corner (4 of them)
    columns   [n·L, K·C]          the blended, modulated samples
    out       [n·L, Cout]         = columns @ weight as [K·C, Cout]

The backward runs the same gathers. grad_input is scattered back into rows with ``index_add_``; contributions of
corners outside the image land on the zero row and are dropped.

The GEMMs of the output and of grad_columns run as oneDNN convolutions where torch has oneDNN: the columns
[n·L, K·C] are the image [n, Ho, Wo·K, C] (channels-last) of a 1×K convolution of stride K, and grad_columns its
transposed convolution. oneDNN is PyTorch's CPU convolution engine, tuned for each CPU; the BLAS behind ``torch.mm``
(MKL) takes a slow path on AMD CPUs (docs/tuning.md). bfloat16 inputs multiply bfloat16 operands (fp32
accumulation, as the GPU's tensor cores), which the CPU's bf16 instructions run faster than fp32 ones; the sampling
stays fp32.
"""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...checks import ConvGeometry, geometry_from_tensors, suggest_memory_format
from .reference import chunk_images, compute_dtype

# Scratch buffers (the samples, a corner, grad_col) are kept per thread between calls up to this many elements
# each (16 MiB in float32): a freshly allocated one costs a page fault per 4 KiB on first touch, several times the
# gather that fills it. Larger ones are allocated for the call.
SCRATCH_CACHED_ELEMENTS = 1 << 22
_SCRATCH = threading.local()


def _scratch(slot: str, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised buffer of shape for use inside one call (never returned to the caller)."""
    numel = math.prod(shape)
    if numel > SCRATCH_CACHED_ELEMENTS or device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buf = buffers.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(slot, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _rows(input: Tensor, geo: ConvGeometry, ctype: torch.dtype) -> Tensor:
    """The images as rows [n·H·W·G + 1, Cg] (pixel-major, then offset group), in ctype, the last row zero."""
    n = input.shape[0]
    cg = geo.in_channels // geo.offset_groups
    rows = torch.empty((n * geo.height * geo.width * geo.offset_groups + 1, cg), dtype=ctype, device=input.device)
    rows[:-1].view(n, geo.height, geo.width, geo.in_channels).copy_(input.permute(0, 2, 3, 1))
    rows[-1].zero_()
    return rows


class _Samples:
    """The sample points of a chunk, ordered [n, L, K, G]: each corner's row index and weight (zero outside), the
    fractions for the derivatives, where a point is NaN, and the mask in the same order."""

    def __init__(self, offset: Tensor, mask: Optional[Tensor], geo: ConvGeometry, ctype: torch.dtype):
        n = offset.shape[0]
        G, K, L, H, W = geo.offset_groups, geo.taps, geo.out_h * geo.out_w, geo.height, geo.width
        dev = offset.device
        off = offset.to(ctype).reshape(n, G, K, 2, L).permute(0, 4, 2, 1, 3)  # [n, L, K, G, 2]
        tap_y = (torch.arange(geo.kernel_h, device=dev, dtype=ctype) * geo.dilation[0]).repeat_interleave(geo.kernel_w)
        tap_x = (torch.arange(geo.kernel_w, device=dev, dtype=ctype) * geo.dilation[1]).repeat(geo.kernel_h)
        out_y = torch.arange(geo.out_h, device=dev, dtype=ctype) * geo.stride[0] - geo.padding[0]
        out_x = torch.arange(geo.out_w, device=dev, dtype=ctype) * geo.stride[1] - geo.padding[1]
        base_y = (out_y[:, None, None] + tap_y[None, None, :]).expand(geo.out_h, geo.out_w, K).reshape(L, K, 1)
        base_x = (out_x[None, :, None] + tap_x[None, None, :]).expand(geo.out_h, geo.out_w, K).reshape(L, K, 1)
        y = (base_y + off[..., 0]).contiguous()  # [n, L, K, G]
        x = (base_x + off[..., 1]).contiguous()
        self.nan = torch.isnan(y) | torch.isnan(x)
        y0, x0 = torch.floor(y), torch.floor(x)
        ly, lx = y - y0, x - x0
        hy, hx = 1 - ly, 1 - lx
        self.frac = (ly, lx, hy, hx)
        # as the reference: y == -1 samples zero but keeps its one-sided derivative; NaN points are outside
        inside = (y >= -1) & (y < H) & (x >= -1) & (x < W)
        y0i = y0.clamp(-2, H + 1).to(torch.int64)  # clamped before the cast: huge or non-finite points stay defined
        x0i = x0.clamp(-2, W + 1).to(torch.int64)
        rows_ok = (inside & (y0i >= 0), inside & (y0i < H - 1))  # rows y0 and y0 + 1 in the image
        cols_ok = (x0i >= 0, x0i < W - 1)                         # columns x0 and x0 + 1
        # row of (image b, pixel p, group g) = (b*H*W + p)*G + g; the zero row is n*H*W*G
        base = ((torch.arange(n, device=dev) * (H * W * G)).view(n, 1, 1, 1)
                + torch.arange(G, device=dev).view(1, 1, 1, G))
        row00 = base + (y0i * W + x0i) * G
        zero_row = n * H * W * G
        self.index: List[Tensor] = []
        self.weight: List[Tensor] = []
        for (dy, dx), wgt in (((0, 0), hy * hx), ((0, 1), hy * lx), ((1, 0), ly * hx), ((1, 1), ly * lx)):
            valid = rows_ok[dy] & cols_ok[dx]
            self.index.append(torch.where(valid, row00 + (dy * W + dx) * G, zero_row).reshape(-1))
            self.weight.append(wgt.masked_fill_(~valid, 0))
        self.mask = None if mask is None else mask.to(ctype).reshape(n, G, K, L).permute(0, 3, 2, 1)
        self.shape = (n, L, K, G, geo.in_channels // G)

    def corner(self, rows: Tensor, i: int, out: Tensor) -> Tensor:
        """Corner i's values [n, L, K, G, Cg] (zero outside the image), into out. (Large buffers are reused rather
        than allocated: a fresh one costs the CPU a page fault per 4 KiB, more than the gather that fills it.)"""
        torch.index_select(rows, 0, self.index[i], out=out.view(-1, rows.shape[1]))
        return out

    def values(self, rows: Tensor, out: Tensor, tmp: Tensor) -> Tensor:
        """The bilinear samples [n, L, K, G, Cg] before the mask, into out (tmp: scratch of the same shape): NaN where
        the sample point is NaN (as torchvision's), zero outside the image."""
        self.corner(rows, 0, out).mul_(self.weight[0][..., None])
        for i in range(1, 4):
            out.addcmul_(self.corner(rows, i, tmp), self.weight[i][..., None])
        if bool(self.nan.any()):
            out.masked_fill_(self.nan[..., None], float("nan"))
        return out

    def modulate_(self, t: Tensor) -> Tensor:
        """t times the mask, in place (t itself without a mask)."""
        return t if self.mask is None else t.mul_(self.mask[..., None])

    def modulated(self, t: Tensor, dtype: torch.dtype, slot: str) -> Tensor:
        """t times the mask (in place), in dtype: t itself if it has it, else a copy into scratch of that dtype (an
        in-place product then a cast: a product into another dtype takes torch's slow mixed-dtype path)."""
        self.modulate_(t)
        return t if t.dtype == dtype else _scratch(slot, tuple(t.shape), dtype, t.device).copy_(t)


def _weight_matrix(weight: Tensor, groups: int, ctype: torch.dtype) -> Tensor:
    """The weight [Cout, Cin_g, kh, kw] as per-group GEMM operands [groups, K·Cin_g, Cout_g] (rows tap-major)."""
    cout, cin_g, kh, kw = weight.shape
    return weight.to(ctype).reshape(groups, cout // groups, cin_g, kh * kw).permute(0, 3, 2, 1).reshape(
        groups, kh * kw * cin_g, cout // groups)


def _by_convolution(gdtype: torch.dtype) -> bool:
    """Whether the GEMMs run as oneDNN convolutions (fp32 and bf16, where torch has oneDNN; float64 stays with BLAS)."""
    return gdtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


def _gemm_dtype(dtype: torch.dtype, ctype: torch.dtype) -> torch.dtype:
    """The GEMMs' operand dtype: bfloat16 for bfloat16 inputs where oneDNN multiplies them, else the computation's
    (the CPU's fp16 GEMMs are slow)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and _by_convolution(torch.bfloat16) else ctype


def _weight_taps(weight: Tensor, gdtype: torch.dtype) -> Tensor:
    """The weight as a 1×K convolution's [Cout, Cin_g, 1, kh·kw] (taps row-major, as the columns), channels-last."""
    cout, cin_g, kh, kw = weight.shape
    return weight.to(gdtype).reshape(cout, cin_g, 1, kh * kw).contiguous(memory_format=torch.channels_last)


def _columns_image(col: Tensor, geo: ConvGeometry) -> Tensor:
    """The columns [n, L, K, C] as the 1×K convolution's input [n, C, Ho, Wo·K] (a channels-last view)."""
    return col.view(col.shape[0], geo.out_h, geo.out_w * geo.taps, geo.in_channels).permute(0, 3, 1, 2)


def _group_columns(col: Tensor, geo: ConvGeometry, gi: int) -> Tensor:
    """Conv group gi's part [n·L, K·Cin_g] of the columns [n, L, K, C]."""
    cin_g = geo.in_channels // geo.groups
    if geo.groups == 1:
        return col.reshape(-1, geo.taps * cin_g)
    return col[..., gi * cin_g:(gi + 1) * cin_g].reshape(-1, geo.taps * cin_g)


def deform_conv2d_forward(
    input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], keep: Optional[dict] = None,
) -> Tensor:
    """out [N, Cout, Ho, Wo] in input's dtype and memory format. keep: unused (the backward keeps nothing of the
    forward's)."""
    geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
    ctype = compute_dtype(input.dtype)
    gdtype = _gemm_dtype(input.dtype, ctype)
    N, L, cout_g = geo.batch, geo.out_h * geo.out_w, geo.out_channels // geo.groups
    conv = _by_convolution(gdtype)
    wm = _weight_taps(weight, gdtype) if conv else _weight_matrix(weight, geo.groups, ctype)
    out = torch.empty((N, geo.out_h, geo.out_w, geo.out_channels), dtype=gdtype, device=input.device)
    flat = out.view(N * L, geo.out_channels)
    step = chunk_images(geo)
    for s in range(0, N, step):
        e = min(N, s + step)
        samples = _Samples(offset[s:e], None if mask is None else mask[s:e], geo, ctype)
        col = _scratch("samples", samples.shape, ctype, input.device)
        samples.values(_rows(input[s:e], geo, ctype), col, _scratch("corner", samples.shape, ctype, input.device))
        col = samples.modulated(col, gdtype, "gemm_columns").view(e - s, L, geo.taps, geo.in_channels)
        if conv:
            res = F.conv2d(_columns_image(col, geo), wm, None if bias is None else bias.to(gdtype),
                           stride=(1, geo.taps), groups=geo.groups)
            out[s:e] = res.permute(0, 2, 3, 1)
            continue
        if geo.groups == 1:  # straight into the output's rows
            torch.mm(_group_columns(col, geo, 0), wm[0], out=flat[s * L:e * L])
        for gi in range(geo.groups if geo.groups > 1 else 0):
            flat[s * L:e * L, gi * cout_g:(gi + 1) * cout_g] = _group_columns(col, geo, gi) @ wm[gi]
    if bias is not None and not conv:
        flat += bias.to(gdtype)
    return out.permute(0, 3, 1, 2).to(input.dtype).contiguous(memory_format=suggest_memory_format(input))


def deform_conv2d_backward(
    grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], needs: Sequence[bool],
    keep: Optional[dict] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset, mask, weight, bias), None where ``needs`` (same order) does not ask for one."""
    need_in, need_off, need_mask, need_w, need_b = needs
    need_mask = need_mask and mask is not None
    geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
    ctype = compute_dtype(input.dtype)
    gdtype = _gemm_dtype(input.dtype, ctype)
    conv = _by_convolution(gdtype)
    N, G, K, L = geo.batch, geo.offset_groups, geo.taps, geo.out_h * geo.out_w
    cout_g, cin_g = geo.out_channels // geo.groups, geo.in_channels // geo.groups
    # the weight as the 1×K convolution's (grad_columns) or as GEMM operands
    wt = _weight_taps(weight, gdtype) if conv else None
    wm = None if conv else _weight_matrix(weight, geo.groups, gdtype)
    go_img = grad_out.to(gdtype).contiguous(memory_format=torch.channels_last)  # [N, Cout, Ho, Wo], NHWC in memory
    go_all = go_img.permute(0, 2, 3, 1).reshape(N * L, geo.out_channels)
    dev = input.device

    grad_b = go_all.sum(0, dtype=ctype).to(weight.dtype) if need_b else None
    grad_wm = torch.zeros((geo.groups, K * cin_g, cout_g), dtype=ctype, device=dev) if need_w else None
    # grad_input as [N, H, W, C]
    grad_in = torch.empty((N, geo.height, geo.width, geo.in_channels), dtype=ctype, device=dev) if need_in else None
    grad_off = torch.empty((N, G, K, 2, L), dtype=ctype, device=dev) if need_off else None
    grad_mask = torch.empty((N, G, K, L), dtype=ctype, device=dev) if need_mask else None

    step = chunk_images(geo)
    for s in range(0, N, step) if (need_in or need_off or need_mask or need_w) else ():
        e = min(N, s + step)
        n = e - s
        go = go_all[s * L:e * L]
        samples = _Samples(offset[s:e], None if mask is None else mask[s:e], geo, ctype)
        rows = _rows(input[s:e], geo, ctype)
        val = _scratch("samples", samples.shape, ctype, dev)
        tmp = _scratch("corner", samples.shape, ctype, dev)  # each corner in turn, and products
        samples.values(rows, val, tmp)
        grad_col = None
        if (need_in or need_off or need_mask) and conv:
            # the 1×K convolution's transpose: [n, C, Ho, Wo·K], channels-last, which is [n, L, K, C] in memory
            gc = F.conv_transpose2d(go_img[s:e], wt, stride=(1, K), groups=geo.groups).permute(0, 2, 3, 1)
            grad_col = gc.to(ctype).contiguous().view(samples.shape)
        elif need_in or need_off or need_mask:
            grad_col = _scratch("grad_col", (n, L, K, geo.in_channels), ctype, dev)
            if geo.groups == 1:
                torch.mm(go, wm[0].t(), out=grad_col.view(n * L, K * cin_g))
            for gi in range(geo.groups if geo.groups > 1 else 0):
                part = go[:, gi * cout_g:(gi + 1) * cout_g] @ wm[gi].t()  # [n·L, K·Cin_g]
                grad_col[..., gi * cin_g:(gi + 1) * cin_g] = part.view(n, L, K, cin_g)
            grad_col = grad_col.view(samples.shape)
        if need_mask:  # the channel sums of grad_col times the unmodulated samples
            grad_mask[s:e] = torch.einsum("...c,...c->...", grad_col, val).permute(0, 3, 2, 1)
        if need_w:
            col = samples.modulated(val, gdtype, "gemm_columns").view(n, L, K, geo.in_channels)
            for gi in range(geo.groups):
                cols, gos = _group_columns(col, geo, gi).t(), go[:, gi * cout_g:(gi + 1) * cout_g]
                if gdtype == ctype:
                    grad_wm[gi].addmm_(cols, gos)
                else:  # bf16 operands, the sum over chunks in fp32
                    grad_wm[gi] += cols @ gos
        del val
        if grad_col is None:
            continue
        grad_val = samples.modulate_(grad_col)
        if need_off:
            sums = [torch.einsum("...c,...c->...", grad_val, samples.corner(rows, i, tmp)) for i in range(4)]
            ly, lx, hy, hx = samples.frac
            gy = hx * (sums[2] - sums[0]) + lx * (sums[3] - sums[1])
            gx = hy * (sums[1] - sums[0]) + ly * (sums[3] - sums[2])
            grad_off[s:e, :, :, 0] = gy.permute(0, 3, 2, 1)
            grad_off[s:e, :, :, 1] = gx.permute(0, 3, 2, 1)
        if need_in:
            acc = torch.zeros((n * geo.height * geo.width * G + 1, geo.in_channels // G), dtype=ctype, device=dev)
            flat_tmp = tmp.view(-1, acc.shape[1])
            for i in range(4):
                torch.mul(grad_val, samples.weight[i][..., None], out=tmp)
                acc.index_add_(0, samples.index[i], flat_tmp)
            grad_in[s:e] = acc[:-1].view(n, geo.height, geo.width, geo.in_channels)

    def _nchw(t: Tensor, like: Tensor) -> Tensor:
        return t.permute(0, 3, 1, 2).to(like.dtype).contiguous(memory_format=suggest_memory_format(like))

    kh, kw = geo.kernel_h, geo.kernel_w
    return (
        _nchw(grad_in, input) if need_in else None,
        grad_off.reshape(offset.shape).to(offset.dtype).contiguous() if need_off else None,
        grad_mask.reshape(mask.shape).to(mask.dtype).contiguous() if need_mask else None,
        grad_wm.reshape(geo.groups, kh, kw, cin_g, cout_g).permute(0, 4, 3, 1, 2).reshape(weight.shape).to(
            weight.dtype).contiguous(memory_format=suggest_memory_format(weight)) if need_w else None,
        grad_b,
    )
