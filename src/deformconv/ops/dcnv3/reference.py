"""The plain-PyTorch DCNv3/DCNv4 core: any device, any float dtype (float64 for the oracle), vectorised over
positions, groups and points, in chunks of images; the backward written out.

    input   [N, H, W, G·D]        NHWC
    offset  [N, Ho, Wo, G·K·2]    (Δx, Δy) per point
    mask    [N, Ho, Wo, G·K]      aggregation weights
    out     [N, Ho, Wo, G·D]

Half inputs compute in float32 and round once.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .geometry import DcnGeometry

# elements of one chunk's gathered corners [n, Ho·Wo·K, G, D]
GATHER_BUDGET = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sampling_coordinates(offset: Tensor, geo: DcnGeometry, ctype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """(y, x) [n, Ho, Wo, G, K] of every point, in input pixels (geometry.py)."""
    n = offset.shape[0]
    kh, kw = geo.kernel
    (sh, sw), (ph, pw), (dh, dw) = geo.stride, geo.pad, geo.dilation
    ch, cw = (dh * (kh - 1)) >> 1, (dw * (kw - 1)) >> 1
    dev = offset.device
    taps = torch.tensor(geo.taps(), dtype=ctype, device=dev).reshape(-1, 2)  # [K, (i, j)]
    off = offset.to(ctype).reshape(n, geo.out_h, geo.out_w, geo.group, geo.points, 2)
    oy = (torch.arange(geo.out_h, dtype=ctype, device=dev) * sh - ph + ch).reshape(1, -1, 1, 1, 1)
    ox = (torch.arange(geo.out_w, dtype=ctype, device=dev) * sw - pw + cw).reshape(1, 1, -1, 1, 1)
    y = oy + (taps[:, 1] * dh - ch + off[..., 1]) * geo.offset_scale
    x = ox + (taps[:, 0] * dw - cw + off[..., 0]) * geo.offset_scale
    return y, x


def _corners(input: Tensor, offset: Tensor, geo: DcnGeometry, ctype: torch.dtype):
    """For a chunk of images: the 4 bilinear corners of every point, each (index [n, Ho·Wo·K, G] into the input's
    pixels, value [n, Ho, Wo, G, K, D] (zero where the corner is outside or the point does not count), weight,
    d weight / dy, d weight / dx [n, Ho, Wo, G, K]), and which points count."""
    n, H, W = input.shape[0], geo.height, geo.width
    G, D, K = geo.group, geo.group_channels, geo.points
    value = input.to(ctype).reshape(n, H * W, G, D)
    y, x = sampling_coordinates(offset, geo, ctype)
    inside = (y > -1) & (y < H) & (x > -1) & (x < W)  # NaN points too are outside
    # coordinates of points outside replaced before the fractions: no NaN or Inf reaches a product
    y = torch.where(inside, y, torch.zeros_like(y))
    x = torch.where(inside, x, torch.zeros_like(x))
    y0, x0 = torch.floor(y), torch.floor(x)
    ly, lx = y - y0, x - x0
    hy, hx = 1 - ly, 1 - lx
    y0i, x0i = y0.to(torch.int64), x0.to(torch.int64)
    corners = []
    for dy, dx, wgt, dwy, dwx in ((0, 0, hy * hx, -hx, -hy), (0, 1, hy * lx, -lx, hy), (1, 0, ly * hx, hx, -ly),
                                  (1, 1, ly * lx, lx, ly)):
        yi, xi = y0i + dy, x0i + dx
        valid = inside & (yi >= 0) & (yi < H) & (xi >= 0) & (xi < W)
        # gather's index: [n, Ho·Wo·K, G] (points before groups, so that the group axis meets value's)
        flat = (yi.clamp(0, H - 1) * W + xi.clamp(0, W - 1)).transpose(-1, -2).reshape(n, -1, G)
        v = torch.gather(value, 1, flat[..., None].expand(n, flat.shape[1], G, D))
        v = v.reshape(n, geo.out_h, geo.out_w, K, G, D).transpose(3, 4)  # [n, Ho, Wo, G, K, D]
        v = torch.where(valid[..., None], v, torch.zeros_like(v))  # an unread pixel's NaN or Inf never spreads
        corners.append((flat, v, torch.where(valid, wgt, torch.zeros_like(wgt)), dwy, dwx))
    return corners, inside


def _samples(corners) -> Tensor:
    """The bilinear samples [n, Ho, Wo, G, K, D]."""
    out = None
    for _, v, wgt, _, _ in corners:
        term = wgt[..., None] * v
        out = term if out is None else out + term
    return out


def _aggregate(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry, ctype: torch.dtype) -> Tensor:
    """out [n, Ho, Wo, G·D] in ctype for a chunk of images."""
    n = input.shape[0]
    corners, _ = _corners(input, offset, geo, ctype)
    m = mask.to(ctype).reshape(n, geo.out_h, geo.out_w, geo.group, geo.points)
    return (_samples(corners) * m[..., None]).sum(4).reshape(n, geo.out_h, geo.out_w, geo.channels)


def _chunk(geo: DcnGeometry) -> int:
    per_image = geo.out_h * geo.out_w * geo.points * geo.channels
    return max(1, GATHER_BUDGET // max(per_image, 1))


def dcn_forward(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry) -> Tensor:
    """out [N, Ho, Wo, G·D] in input's dtype."""
    ctype = compute_dtype(input.dtype)
    step = _chunk(geo)
    parts = [_aggregate(input[s:s + step], offset[s:s + step], mask[s:s + step], geo, ctype)
             for s in range(0, geo.batch, step)]
    if not parts:
        return input.new_empty(0, geo.out_h, geo.out_w, geo.channels)
    return torch.cat(parts).to(input.dtype)


def dcn_backward(grad_out: Tensor, input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry,
                 needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients (input, offset, mask), each in its tensor's dtype; None where needs says so. With s_k the sample of
    point k and m_k its weight: grad_mask_k = Σ_d go·s_k; grad_offset_k = offset_scale·m_k·Σ_d go·∂s_k/∂(x, y)
    (zero for a point that does not count); grad_input gets go·m_k·(corner weight) at each corner inside."""
    need_in, need_off, need_mask = needs
    ctype = compute_dtype(input.dtype)
    N, Ho, Wo, G, D, K = geo.batch, geo.out_h, geo.out_w, geo.group, geo.group_channels, geo.points
    dev = input.device
    g_in = torch.zeros(N, geo.height * geo.width, G, D, dtype=ctype, device=dev) if need_in else None
    g_off = torch.zeros(N, Ho, Wo, G, K, 2, dtype=ctype, device=dev) if need_off else None
    g_mask = torch.zeros(N, Ho, Wo, G, K, dtype=ctype, device=dev) if need_mask else None
    step = _chunk(geo)
    for s in range(0, N, step):
        e = min(N, s + step)
        n = e - s
        corners, inside = _corners(input[s:e], offset[s:e], geo, ctype)
        go = grad_out[s:e].to(ctype).reshape(n, Ho, Wo, G, 1, D)
        m = mask[s:e].to(ctype).reshape(n, Ho, Wo, G, K)
        if need_mask:
            g_mask[s:e] = (go * _samples(corners)).sum(-1)
        if need_off:
            gy = sum(dwy[..., None] * v for _, v, _, dwy, _ in corners)
            gx = sum(dwx[..., None] * v for _, v, _, _, dwx in corners)
            scale = m * geo.offset_scale * inside
            g_off[s:e, ..., 0] = (go * gx).sum(-1) * scale
            g_off[s:e, ..., 1] = (go * gy).sum(-1) * scale
        if need_in:
            gm = go * m[..., None]  # [n, Ho, Wo, G, K, D]
            for flat, _, wgt, _, _ in corners:
                contrib = (gm * wgt[..., None]).transpose(3, 4).reshape(n, -1, G, D)  # [n, Ho·Wo·K, G, D]
                g_in[s:e].scatter_add_(1, flat[..., None].expand(n, flat.shape[1], G, D), contrib)
    grads = (None if g_in is None else g_in.reshape(input.shape),
             None if g_off is None else g_off.reshape(offset.shape),
             None if g_mask is None else g_mask.reshape(mask.shape))
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, (input, offset, mask)))


def dcnv4_forward(input: Tensor, offset_mask: Tensor, geo: DcnGeometry) -> Tensor:
    """DCNv4: DCNv3's core on offset_mask's offsets and weights."""
    from .op import split_offset_mask

    return dcn_forward(input, *split_offset_mask(offset_mask, geo.group, geo.points), geo)


def dcnv4_backward(grad_out: Tensor, input: Tensor, offset_mask: Tensor, geo: DcnGeometry,
                   needs: Sequence[bool]) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """DCNv4: gradients (input, offset_mask), offset_mask's padding channels zero."""
    from .op import join_offset_mask, split_offset_mask

    need_in, need_om = needs
    offset, mask = split_offset_mask(offset_mask, geo.group, geo.points)
    g_in, g_off, g_mask = dcn_backward(grad_out, input, offset, mask, geo, [need_in, need_om, need_om])
    g_om = join_offset_mask(g_off, g_mask, geo.group, geo.points, offset_mask.shape[-1]) if need_om else None
    return g_in, g_om
