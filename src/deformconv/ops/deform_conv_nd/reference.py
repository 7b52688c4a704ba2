"""The reference backend of the N-d forms: deformable convolution of rank 1, 2 or 3 and its transposed form, in
plain, vectorised, differentiable PyTorch (the backward is autograd's of this forward). Any device, any float dtype
(float64 for the oracle); half-precision inputs are computed in float32 and cast back.

Shapes (rank r, K = k_1·…·k_r taps, G offset groups, g convolution groups)::

    deform_conv         input [N, Cin, *S]   weight [Cout, Cin/g, *k]   offset [N, G·K·r, *O]   mask [N, G·K, *O]
                        out [N, Cout, *O],   O_i = (S_i + 2·p_i − d_i·(k_i − 1) − 1) // s_i + 1
    deform_conv_transpose input [N, Cin, *I] weight [Cin, Cout/g, *k]   offset [N, G·K·r, *I]   mask [N, G·K, *I]
                        out [N, Cout, *Z],   Z_i = (I_i − 1)·s_i − 2·p_i + d_i·(k_i − 1) + 1 + output_padding_i

Tap t = (t_1, …, t_r), row-major over the kernel's axes, of offset group γ at output position o samples the input at

    x_i = o_i·s_i − p_i + t_i·d_i + offset[n, (γ·K + t)·r + i, o]        (i = 1…r, in axis order: d, h, w)

N-linearly over its 2^r integer neighbours, a neighbour outside the input counting as zero and the whole sample zero
unless −1 ≤ x_i < S_i on every axis (at exactly −1 the value is zero and the one-sided derivative is kept, as
deform_conv2d's); the sample is multiplied by mask[n, γ·K + t, o] (1 without a mask). Rank 2 is deform_conv2d
(torchvision's). The transposed form is its adjoint with respect to the input: each of its input positions o
spreads W^T·input over the same sample points of the output (Z taking the place of S), the layout of
``F.conv_transpose``; a NaN sample point makes its image's output NaN in its offset group's channels.

Memory: the batch goes in chunks whose sampled columns (n·C·K·L elements) stay within COLUMN_BUDGET.
"""

from __future__ import annotations

import itertools
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

COLUMN_BUDGET = 1 << 23  # elements of one chunk's columns (autograd keeps several)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def out_size(size: Sequence[int], kernel: Sequence[int], stride, padding, dilation) -> List[int]:
    """The deformable convolution's output size."""
    return [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip(size, kernel, stride, padding, dilation)]


def transposed_size(size: Sequence[int], kernel: Sequence[int], stride, padding, output_padding, dilation) -> List[int]:
    """The transposed form's output size."""
    return [(s - 1) * st - 2 * p + d * (k - 1) + 1 + op
            for s, k, st, p, op, d in zip(size, kernel, stride, padding, output_padding, dilation)]


def _points(offset: Tensor, kernel, image: Sequence[int], positions: Sequence[int], stride, padding, dilation,
            ctype) -> Tuple[list, Tensor]:
    """The sample points' 2^r corners: [(flat index [n, G, K·L] into the image, weight [n, G, K, L], its derivatives
    along each axis [r of them]), ...], each zero where the corner or the whole sample lies outside; and where a point
    is NaN [n, G, K, L]."""
    n, r = offset.shape[0], len(kernel)
    K, L = math.prod(kernel), math.prod(positions)
    G = offset.shape[1] // (K * r)
    dev = offset.device
    off = offset.to(ctype).reshape(n, G, K, r, L)
    taps = torch.tensor(list(itertools.product(*(range(k) for k in kernel))), device=dev, dtype=ctype)  # [K, r]
    grid = torch.meshgrid(*(torch.arange(o, device=dev, dtype=ctype) for o in positions), indexing="ij")
    coords, inside, nan = [], None, None
    for i in range(r):
        base = taps[:, i, None] * dilation[i] + (grid[i].reshape(L) * stride[i] - padding[i])[None, :]  # [K, L]
        x = base + off[:, :, :, i]
        ok = (x >= -1) & (x < image[i])
        inside = ok if inside is None else inside & ok
        nan = torch.isnan(x) if nan is None else nan | torch.isnan(x)
        low = torch.floor(x)
        frac = x - low
        low = low.clamp(-2, image[i] + 1).to(torch.int64)  # before the cast: no overflow from huge or infinite ones
        coords.append((low, frac))
    strides = [math.prod(image[i + 1:]) for i in range(r)]
    corners = []
    zero = torch.zeros((), dtype=ctype, device=dev)
    for bits in itertools.product((0, 1), repeat=r):
        flat, valid = 0, inside
        factors = []  # the corner's weight along each axis
        for i, bit in enumerate(bits):
            low, frac = coords[i]
            idx = low + bit
            valid = valid & (idx >= 0) & (idx < image[i])
            flat = flat + idx.clamp(0, image[i] - 1) * strides[i]
            factors.append(frac if bit else 1 - frac)
        weight = math.prod(factors[1:], start=factors[0])
        # d(weight)/dx_i: the other axes' factors, signed by the corner's side along i
        slopes = [math.prod([f for j, f in enumerate(factors) if j != i], start=torch.ones_like(factors[0]))
                  * (1 if bits[i] else -1) for i in range(r)]
        corners.append((flat.reshape(n, G, K * L), torch.where(valid, weight, zero),
                        [torch.where(valid, d, zero) for d in slopes]))
    return corners, nan


def _sample(img: Tensor, corners: list, nan: Tensor, K: int, L: int) -> Tensor:
    """img [n, G, Cg, P] sampled at the points: [n, G, Cg, K, L] (NaN where the point is)."""
    n, G, Cg, _ = img.shape
    val = None
    for flat, weight, _ in corners:
        v = torch.gather(img, 3, flat[:, :, None, :].expand(n, G, Cg, K * L)).reshape(n, G, Cg, K, L)
        # a corner outside is skipped, not multiplied by 0: a NaN or Inf at the clamped pixel must not spread
        v = torch.where(weight[:, :, None] != 0, v * weight[:, :, None], torch.zeros((), dtype=v.dtype,
                                                                                     device=v.device))
        val = v if val is None else val + v
    return val.masked_fill(nan[:, :, None], float("nan"))


def _splat(values: Tensor, corners: list, size: int) -> Tensor:
    """values [n, G, Cg, K, L] spread over the points' corners, times their weights: [n, G, Cg, size] (the
    adjoint of _sample)."""
    n, G, Cg, K, L = values.shape
    out = values.new_zeros((n, G, Cg, size))
    for flat, weight, _ in corners:
        src = (values * weight[:, :, None]).reshape(n, G, Cg, K * L)
        out.scatter_add_(3, flat[:, :, None, :].expand(n, G, Cg, K * L), src)
    return out


def _chunk(per_image: int) -> int:
    return max(1, COLUMN_BUDGET // max(per_image, 1))


def deform_conv(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
                stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                positions: Optional[Sequence[int]] = None) -> Tensor:
    """The rank-r deformable convolution (arguments checked by the caller); differentiable. positions: the output
    positions computed along each axis (default: all; the transposed form's backward asks for its input's, fewer
    where its output_padding reached beyond the stride)."""
    ctype = compute_dtype(input.dtype)
    r = input.dim() - 2
    N, cin, image = input.shape[0], input.shape[1], list(input.shape[2:])
    cout, kernel = weight.shape[0], list(weight.shape[2:])
    groups = cin // weight.shape[1]
    positions = list(positions or out_size(image, kernel, stride, padding, dilation))
    K, L = math.prod(kernel), math.prod(positions)
    G = offset.shape[1] // (K * r)
    w = weight.to(ctype).reshape(groups, cout // groups, -1)  # [g, Cout/g, Cin/g·K]
    outs = []
    step = _chunk(cin * K * L)
    for s in range(0, N, step):
        e = min(N, s + step)
        n = e - s
        corners, nan = _points(offset[s:e], kernel, image, positions, stride, padding, dilation, ctype)
        img = input[s:e].to(ctype).reshape(n, G, cin // G, -1)
        val = _sample(img, corners, nan, K, L)  # [n, G, Cg, K, L]
        if mask is not None:
            val = val * mask[s:e].to(ctype).reshape(n, G, 1, K, L)
        outs.append(torch.matmul(w, val.reshape(n, groups, -1, L)).reshape(n, cout, *positions))
    out = torch.cat(outs) if outs else input.new_zeros((0, cout, *positions), dtype=ctype)
    if bias is not None:
        out = out + bias.to(ctype).reshape(1, cout, *([1] * r))
    return out.to(input.dtype)


def deform_conv_transpose(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor],
                          mask: Optional[Tensor], stride: Sequence[int], padding: Sequence[int],
                          output_padding: Sequence[int], dilation: Sequence[int], groups: int) -> Tensor:
    """The rank-r transposed deformable convolution (arguments checked by the caller); differentiable. Its weight
    [Cin, Cout/groups, *k] does not tell the groups, which come as an argument (as F.conv_transpose's)."""
    ctype = compute_dtype(input.dtype)
    r = input.dim() - 2
    N, cin, positions = input.shape[0], input.shape[1], list(input.shape[2:])
    kernel = list(weight.shape[2:])
    cout = weight.shape[1] * groups
    image = transposed_size(positions, kernel, stride, padding, output_padding, dilation)
    K, L, P = math.prod(kernel), math.prod(positions), math.prod(image)
    G = offset.shape[1] // (K * r)
    cg = cout // G
    w = weight.to(ctype).reshape(groups, cin // groups, -1)  # [g, Cin/g, Cout/g·K]
    outs = []
    step = _chunk(cout * K * L)
    for s in range(0, N, step):
        e = min(N, s + step)
        n = e - s
        corners, nan = _points(offset[s:e], kernel, image, positions, stride, padding, dilation, ctype)
        u = input[s:e].to(ctype).reshape(n, groups, cin // groups, L)
        cols = torch.matmul(w.transpose(1, 2), u).reshape(n, G, cg, K, L)  # [n, G, Cout/G, K, L]
        if mask is not None:
            cols = cols * mask[s:e].to(ctype).reshape(n, G, 1, K, L)
        out = _splat(cols, corners, P)
        poisoned = nan.reshape(n, G, K * L).any(-1)  # [n, G]
        out = out.masked_fill(poisoned[:, :, None, None], float("nan"))
        outs.append(out.reshape(n, cout, *image))
    out = torch.cat(outs) if outs else input.new_zeros((0, cout, *image), dtype=ctype)
    if bias is not None:
        out = out + bias.to(ctype).reshape(1, cout, *([1] * r))
    return out.to(input.dtype)


def deform_conv_backward(grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
                         stride, padding, dilation, needs: Sequence[bool]) -> Tuple[Optional[Tensor], ...]:
    """deform_conv's gradients (input, offset, weight, mask), None where needs (in that order) says so: grad_input
    the sampled columns' gradient spread back over the corners, grad_offset the corner weights' derivatives times
    the corner values, grad_mask and grad_weight from the columns. The output positions are grad_out's."""
    need_in, need_off, need_w, need_mask = needs
    need_mask = need_mask and mask is not None
    ctype = compute_dtype(input.dtype)
    r = input.dim() - 2
    N, cin, image = input.shape[0], input.shape[1], list(input.shape[2:])
    cout, kernel = weight.shape[0], list(weight.shape[2:])
    groups = cin // weight.shape[1]
    positions = list(grad_out.shape[2:])
    K, L, P = math.prod(kernel), math.prod(positions), math.prod(image)
    G = offset.shape[1] // (K * r)
    cg = cin // G
    w = weight.to(ctype).reshape(groups, cout // groups, -1)
    grad_in = torch.zeros((N, G, cg, P), dtype=ctype, device=input.device) if need_in else None
    grad_off = torch.empty((N, G, K, r, L), dtype=ctype, device=input.device) if need_off else None
    grad_mask = torch.empty((N, G, K, L), dtype=ctype, device=input.device) if need_mask else None
    grad_w = torch.zeros_like(w) if need_w else None
    step = _chunk(cin * K * L)
    for s in range(0, N, step):
        e = min(N, s + step)
        n = e - s
        corners, nan = _points(offset[s:e], kernel, image, positions, stride, padding, dilation, ctype)
        img = input[s:e].to(ctype).reshape(n, G, cg, P)
        m = None if mask is None else mask[s:e].to(ctype).reshape(n, G, 1, K, L)
        go = grad_out[s:e].to(ctype).reshape(n, groups, cout // groups, L)
        val = _sample(img, corners, nan, K, L)
        if need_w:
            col = (val if m is None else val * m).reshape(n, groups, -1, L)
            grad_w += torch.matmul(go, col.transpose(-1, -2)).sum(0)
        grad_col = torch.matmul(w.transpose(1, 2), go).reshape(n, G, cg, K, L)
        if need_mask:
            grad_mask[s:e] = (grad_col * val).sum(2)
        grad_val = grad_col if m is None else grad_col * m
        if need_off:
            for i in range(r):
                acc = None
                for flat, _, slopes in corners:
                    corner = torch.gather(img, 3, flat[:, :, None, :].expand(n, G, cg, K * L)).reshape(n, G, cg, K, L)
                    corner = torch.where(slopes[i][:, :, None] != 0, corner, torch.zeros((), dtype=ctype,
                                                                                         device=img.device))
                    term = slopes[i] * (grad_val * corner).sum(2)
                    acc = term if acc is None else acc + term
                grad_off[s:e, :, :, i] = acc
        if need_in:
            grad_in[s:e] = _splat(grad_val, corners, P)

    def shaped(t: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
        return None if t is None else t.reshape(like.shape).to(like.dtype)

    return (shaped(grad_in, input), shaped(grad_off, offset), shaped(grad_w, weight),
            shaped(grad_mask, mask) if need_mask else None)
