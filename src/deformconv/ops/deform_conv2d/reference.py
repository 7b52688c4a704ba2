"""The reference backend: deform_conv2d forward and backward in plain, vectorised PyTorch.

It is the oracle every fast kernel is checked against: short, obviously right, runs on any device and in
any float dtype (float64 included). Half-precision inputs are computed in float32 and cast back.

Sampling follows torchvision exactly. For output position (ho, wo), tap (i, j) and offset group g the
sample point is

    y = ho*stride_h - pad_h + i*dil_h + offset[n, 2*(g*kh*kw + i*kw + j)    , ho, wo]   (dy)
    x = wo*stride_w - pad_w + j*dil_w + offset[n, 2*(g*kh*kw + i*kw + j) + 1, ho, wo]   (dx)

and the sampled value is bilinear over the 4 integer neighbours, each neighbour outside the image
counting as zero, and the whole sample zero unless -1 < y < H and -1 < x < W. Gradients with respect
to the offsets are the one-sided (right) derivatives of this at integer coordinates, as in torchvision.

Memory: the batch is processed in chunks of ``n_chunk`` samples such that one chunk's column tensor
(n_chunk * Cin * kh*kw * Ho*Wo elements) holds at most ``COLUMN_BUDGET`` = 2**24 elements (or one sample,
if a single one is larger). Forward peaks at about 8 such columns in the compute dtype (512 MiB in
float32 at the budget), backward at about 12 (768 MiB), on top of inputs and outputs.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...checks import ConvGeometry, geometry_from_tensors, suggest_memory_format

COLUMN_BUDGET = 1 << 24  # elements of one chunk's column tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_images(geo: ConvGeometry) -> int:
    """Images per chunk: one chunk's column tensor holds at most COLUMN_BUDGET elements (or one image)."""
    per_sample = geo.in_channels * geo.taps * geo.out_h * geo.out_w
    return max(1, COLUMN_BUDGET // max(per_sample, 1))


def _sampling(offset: Tensor, geo: ConvGeometry, ctype: torch.dtype):
    """Bilinear corner indices and weights for every (sample, offset group, tap, position).

    Returns ``corners``: 4 tuples (flat index [n, G, K*L] int64, weight [n, G, K, L], valid [n, G, K, L])
    in the order (y0,x0), (y0,x1), (y1,x0), (y1,x1), plus ``frac`` = (ly, lx, hy, hx) for the derivatives and
    ``nan`` [n, G, K, L]: where a sample point is NaN. Weights of corners outside the image (or of samples outside
    (-1, H) x (-1, W), infinite ones included) are zero.
    """
    n = offset.shape[0]
    G, K, L = geo.offset_groups, geo.taps, geo.out_h * geo.out_w
    H, W = geo.height, geo.width
    dev = offset.device
    off = offset.to(ctype).reshape(n, G, K, 2, L)
    tap_y = (torch.arange(geo.kernel_h, device=dev, dtype=ctype) * geo.dilation[0]).repeat_interleave(geo.kernel_w)
    tap_x = (torch.arange(geo.kernel_w, device=dev, dtype=ctype) * geo.dilation[1]).repeat(geo.kernel_h)
    out_y = torch.arange(geo.out_h, device=dev, dtype=ctype) * geo.stride[0] - geo.padding[0]
    out_x = torch.arange(geo.out_w, device=dev, dtype=ctype) * geo.stride[1] - geo.padding[1]
    base_y = (tap_y[:, None, None] + out_y[None, :, None]).expand(K, geo.out_h, geo.out_w).reshape(K, L)
    base_x = (tap_x[:, None, None] + out_x[None, None, :]).expand(K, geo.out_h, geo.out_w).reshape(K, L)
    y = base_y + off[:, :, :, 0]
    x = base_x + off[:, :, :, 1]

    # y == -1 samples zero (its only in-image corner has weight 0) but keeps that corner's one-sided
    # derivative, as torchvision's offset gradient does.
    inside = (y >= -1) & (y < H) & (x >= -1) & (x < W)
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    hy, hx = 1 - ly, 1 - lx
    # Clamp before the integer cast so huge or non-finite offsets cannot overflow it.
    y0i = y0.clamp(-2, H + 1).to(torch.int64)
    x0i = x0.clamp(-2, W + 1).to(torch.int64)
    corners = []
    for yi, xi, wgt in ((y0i, x0i, hy * hx), (y0i, x0i + 1, hy * lx), (y0i + 1, x0i, ly * hx),
                        (y0i + 1, x0i + 1, ly * lx)):
        valid = inside & (yi >= 0) & (yi < H) & (xi >= 0) & (xi < W)
        flat = (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).reshape(n, G, K * L)
        corners.append((flat, torch.where(valid, wgt, torch.zeros_like(wgt)), valid))
    return corners, (ly, lx, hy, hx), torch.isnan(y) | torch.isnan(x)


def _gather(img: Tensor, flat: Tensor, geo: ConvGeometry) -> Tensor:
    """img [n, G, Cg, H*W]; flat [n, G, K*L] -> values [n, G, Cg, K, L]. Where a corner is outside the
    image the value is that of a clamped pixel: callers multiply by a corner weight that is zero there."""
    n, G, Cg, _ = img.shape
    v = torch.gather(img, 3, flat[:, :, None, :].expand(n, G, Cg, flat.shape[-1]))
    return v.reshape(n, G, Cg, geo.taps, geo.out_h * geo.out_w)


def _columns(input: Tensor, offset: Tensor, mask: Optional[Tensor], geo: ConvGeometry, ctype: torch.dtype):
    """Sampled values [n, G, Cg, K, L] (before the mask) and the sampling geometry."""
    n = input.shape[0]
    G = geo.offset_groups
    img = input.to(ctype).reshape(n, G, geo.in_channels // G, geo.height * geo.width)
    corners, frac, nan = _sampling(offset, geo, ctype)
    val = None
    for flat, wgt, valid in corners:
        # a corner outside the image is skipped, not multiplied by 0 (a NaN or Inf there must not spread)
        v = _gather(img, flat, geo).mul_(wgt[:, :, None]).masked_fill_(~valid[:, :, None], 0)
        val = v if val is None else val.add_(v)
    # a NaN sample point samples NaN, as torchvision's (its bilinear weights are NaN, times corners of 0); an infinite
    # one lies outside the image and samples 0
    val.masked_fill_(nan[:, :, None], float("nan"))
    return val, img, corners, frac


def _modulated(val: Tensor, mask: Optional[Tensor], geo: ConvGeometry) -> Tensor:
    if mask is None:
        return val
    n = val.shape[0]
    return val * mask.to(val.dtype).reshape(n, geo.offset_groups, 1, geo.taps, geo.out_h * geo.out_w)


def deform_conv2d_forward(
    input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], keep: Optional[dict] = None,
) -> Tensor:
    """out [N, Cout, Ho, Wo] in input's dtype and memory format. keep: unused (the backward keeps nothing of the
    forward's)."""
    geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
    ctype = compute_dtype(input.dtype)
    N, L = geo.batch, geo.out_h * geo.out_w
    g, cout_g = geo.groups, geo.out_channels // geo.groups
    w = weight.to(ctype).reshape(g, cout_g, -1)  # [g, Cout_g, Cin_g*K]
    out = torch.empty((N, geo.out_channels, geo.out_h, geo.out_w), dtype=ctype, device=input.device)
    step = chunk_images(geo)
    for s in range(0, N, step):
        e = min(N, s + step)
        m = None if mask is None else mask[s:e]
        val, *_ = _columns(input[s:e], offset[s:e], m, geo, ctype)
        col = _modulated(val, m, geo).reshape(e - s, g, -1, L)  # [n, g, Cin_g*K, L]
        out[s:e] = torch.matmul(w, col).reshape(e - s, geo.out_channels, geo.out_h, geo.out_w)
    if bias is not None:
        out += bias.to(ctype)[None, :, None, None]
    return out.to(input.dtype).contiguous(memory_format=suggest_memory_format(input))


def deform_conv2d_backward(
    grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], needs: Sequence[bool],
    keep: Optional[dict] = None,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset, mask, weight, bias); an entry is None where ``needs`` says it is not wanted
    (``needs`` is in that same order)."""
    need_in, need_off, need_mask, need_w, need_b = needs
    need_mask = need_mask and mask is not None
    geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
    ctype = compute_dtype(input.dtype)
    N, G, K, L = geo.batch, geo.offset_groups, geo.taps, geo.out_h * geo.out_w
    g, cout_g = geo.groups, geo.out_channels // geo.groups
    cg = geo.in_channels // G
    w = weight.to(ctype).reshape(g, cout_g, -1)
    go_all = grad_out.to(ctype)

    # grad_input accumulates as [N, G, H*W, Cg] rows through index_add_ (deterministic on CUDA under
    # torch.use_deterministic_algorithms), and is permuted to [N, G, Cg, H*W] at the end.
    HW = geo.height * geo.width
    grad_in = torch.zeros((N, G, HW, cg), dtype=ctype, device=input.device) if need_in else None
    grad_off = torch.empty((N, G, K, 2, L), dtype=ctype, device=input.device) if need_off else None
    grad_mask = torch.empty((N, G, K, L), dtype=ctype, device=input.device) if need_mask else None
    grad_w = torch.zeros_like(w) if need_w else None

    if need_in or need_off or need_mask or need_w:
        step = chunk_images(geo)
        for s in range(0, N, step):
            e = min(N, s + step)
            n = e - s
            m = None if mask is None else mask[s:e]
            go = go_all[s:e].reshape(n, g, cout_g, L)
            val, img, corners, (ly, lx, hy, hx) = _columns(input[s:e], offset[s:e], m, geo, ctype)
            if need_w:
                col = _modulated(val, m, geo).reshape(n, g, -1, L)
                grad_w += torch.matmul(go, col.transpose(-1, -2)).sum(0)
                del col
            if not (need_in or need_off or need_mask):
                continue
            grad_col = torch.matmul(w.transpose(-1, -2), go).reshape(n, G, cg, K, L)
            if need_mask:
                grad_mask[s:e] = (grad_col * val).sum(2)
            del val
            grad_val = _modulated(grad_col, m, geo)
            del grad_col
            if need_off:
                # d(bilinear)/dy and /dx: derivatives of the corner weights times the corner values.
                dwy = (-hx, -lx, hx, lx)
                dwx = (-hy, hy, -ly, ly)
                gy = torch.zeros((n, G, K, L), dtype=ctype, device=input.device)
                gx = torch.zeros_like(gy)
                for (flat, _, valid), cy, cx in zip(corners, dwy, dwx):
                    # the image value of a corner outside is 0 (not read), its weight's derivative still
                    # multiplies grad_val (as torchvision's: a NaN there spreads to grad_offset)
                    corner = _gather(img, flat, geo).masked_fill_(~valid[:, :, None], 0)
                    corner_sum = (grad_val * corner).sum(2)
                    gy += cy * corner_sum
                    gx += cx * corner_sum
                grad_off[s:e, :, :, 0] = gy
                grad_off[s:e, :, :, 1] = gx
            if need_in:
                rows = grad_in[s:e].view(n * G * HW, cg)
                row_base = (torch.arange(n * G, device=input.device) * HW).view(n, G, 1)
                for flat, wgt, valid in corners:
                    src = (grad_val * wgt[:, :, None]).masked_fill_(~valid[:, :, None], 0)
                    src = src.reshape(n, G, cg, K * L).transpose(2, 3)
                    rows.index_add_(0, (flat + row_base).reshape(-1), src.reshape(-1, cg))

    def _out(t: Optional[Tensor], like: Tensor, keep_format: bool = True) -> Optional[Tensor]:
        """t shaped and typed as like: in like's memory format, or NCHW-contiguous (grad_offset and grad_mask, as
        the Triton backend writes them)."""
        if t is None:
            return None
        fmt = suggest_memory_format(like) if keep_format else torch.contiguous_format
        return t.reshape(like.shape).to(like.dtype).contiguous(memory_format=fmt)

    grad_b = go_all.sum((0, 2, 3)).to(weight.dtype) if need_b else None
    if grad_in is not None:
        grad_in = grad_in.transpose(2, 3)
    return (
        _out(grad_in, input),
        _out(grad_off, offset, False),
        _out(grad_mask, mask, False) if need_mask else None,
        _out(grad_w, weight),
        grad_b,
    )
