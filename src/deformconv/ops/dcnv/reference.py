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

from ..common.gather import bilinear_corners, coordinate_grads, samples, scatter_corners
from .geometry import DcnGeometry, join_offset_mask, split_offset_mask

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
    """bilinear_corners of a chunk of images' points, as [n, Ho·Wo, G, K]."""
    n = input.shape[0]
    value = input.to(ctype).reshape(n, geo.height * geo.width, geo.group, geo.group_channels)
    y, x = (c.reshape(n, -1, geo.group, geo.points) for c in sampling_coordinates(offset, geo, ctype))
    return bilinear_corners(value, y, x, geo.height, geo.width)


def _aggregate(input: Tensor, offset: Tensor, mask: Tensor, geo: DcnGeometry, ctype: torch.dtype) -> Tensor:
    """out [n, Ho, Wo, G·D] in ctype for a chunk of images."""
    n = input.shape[0]
    corners, _ = _corners(input, offset, geo, ctype)
    m = mask.to(ctype).reshape(n, -1, geo.group, geo.points)
    return (samples(corners) * m[..., None]).sum(3).reshape(n, geo.out_h, geo.out_w, geo.channels)


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
        go = grad_out[s:e].to(ctype).reshape(n, -1, G, 1, D)
        m = mask[s:e].to(ctype).reshape(n, -1, G, K)
        if need_mask:
            g_mask[s:e] = (go * samples(corners)).sum(-1).reshape(n, Ho, Wo, G, K)
        if need_off:
            gy, gx = coordinate_grads(corners, go)
            scale = m * geo.offset_scale * inside
            g_off[s:e, ..., 0] = (gx * scale).reshape(n, Ho, Wo, G, K)
            g_off[s:e, ..., 1] = (gy * scale).reshape(n, Ho, Wo, G, K)
        if need_in:
            scatter_corners(g_in[s:e], corners, go * m[..., None])
    grads = (None if g_in is None else g_in.reshape(input.shape),
             None if g_off is None else g_off.reshape(offset.shape),
             None if g_mask is None else g_mask.reshape(mask.shape))
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, (input, offset, mask)))


def dcnv4_forward(input: Tensor, offset_mask: Tensor, geo: DcnGeometry, core=dcn_forward) -> Tensor:
    """DCNv4: DCNv3's core (this module's, or another backend's `core`) on offset_mask's offsets and weights."""

    return core(input, *split_offset_mask(offset_mask, geo.group, geo.points), geo)


def dcnv4_backward(grad_out: Tensor, input: Tensor, offset_mask: Tensor, geo: DcnGeometry,
                   needs: Sequence[bool], core=dcn_backward) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """DCNv4: gradients (input, offset_mask), offset_mask's padding channels zero (`core` as in dcnv4_forward)."""

    need_in, need_om = needs
    offset, mask = split_offset_mask(offset_mask, geo.group, geo.points)
    g_in, g_off, g_mask = core(grad_out, input, offset, mask, geo, [need_in, need_om, need_om])
    g_om = join_offset_mask(g_off, g_mask, geo.group, geo.points, offset_mask.shape[-1]) if need_om else None
    return g_in, g_om
