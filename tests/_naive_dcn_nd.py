"""An independent, naive N-d deformable convolution and its transposed form: explicit Python loops over images,
output positions, groups, taps and corners, written from the definition (ops/deform_conv_nd/reference.py's
docstring), float64; gradients by autograd through it. Tiny sizes only."""

import itertools
import math

import torch


def sample(img, point):
    """img [C, *S]; point: r 0-d tensors (coordinates) -> [C]: N-linear over the 2^r integer neighbours, a neighbour
    outside the image zero, the whole sample zero unless -1 <= x_i < S_i on every axis."""
    size = img.shape[1:]
    coords = [float(p.detach()) for p in point]
    out = img.new_zeros(img.shape[0])
    if not all(-1 <= c < s for c, s in zip(coords, size)):
        return out
    lows = [math.floor(c) for c in coords]
    for bits in itertools.product((0, 1), repeat=len(size)):
        idx = [lo + b for lo, b in zip(lows, bits)]
        if not all(0 <= i < s for i, s in zip(idx, size)):
            continue
        w = 1
        for p, lo, b in zip(point, lows, bits):
            w = w * ((p - lo) if b else (lo + 1 - p))
        out = out + w * img[(slice(None), *idx)]
    return out


def _sizes(image, kernel, stride, padding, dilation):
    return [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip(image, kernel, stride, padding, dilation)]


def naive_deform_conv(input, offset, weight, bias, mask, stride, padding, dilation):
    N, cin, *image = input.shape
    cout, cin_g, *kernel = weight.shape
    r, groups = len(image), cin // cin_g
    positions = _sizes(image, kernel, stride, padding, dilation)
    taps = list(itertools.product(*(range(k) for k in kernel)))
    K = len(taps)
    G = offset.shape[1] // (K * r)
    out = []
    for n in range(N):
        cells = []
        for o in itertools.product(*(range(p) for p in positions)):
            cols = []  # [Cin, K]: the sampled column of position o
            for c in range(cin):
                g = c // (cin // G)
                row = []
                for t, tap in enumerate(taps):
                    base = (g * K + t) * r
                    point = [o[i] * stride[i] - padding[i] + tap[i] * dilation[i] + offset[(n, base + i, *o)]
                             for i in range(r)]
                    v = sample(input[n, c:c + 1], point)[0]
                    if mask is not None:
                        v = v * mask[(n, g * K + t, *o)]
                    row.append(v)
                cols.append(torch.stack(row))
            cols = torch.stack(cols)  # [Cin, K]
            values = []
            for co in range(cout):
                gi = co // (cout // groups)
                values.append((weight[co].reshape(cin_g, K) * cols[gi * cin_g:(gi + 1) * cin_g]).sum())
            cells.append(torch.stack(values))
        out.append(torch.stack(cells, -1).reshape(cout, *positions))
    out = torch.stack(out)
    if bias is not None:
        out = out + bias.reshape(1, cout, *([1] * r))
    return out


def naive_deform_conv_transpose(input, offset, weight, bias, mask, stride, padding, output_padding, dilation, groups):
    """The adjoint with respect to the input, written as its own loops: each input position o and tap t spreads
    W^T·input[o] over the N-linear neighbours of its sample point in the output."""
    N, cin, *positions = input.shape
    _, cout_g, *kernel = weight.shape
    r, cout = len(positions), cout_g * groups
    image = [(s - 1) * st - 2 * p + d * (k - 1) + 1 + op
             for s, k, st, p, op, d in zip(positions, kernel, stride, padding, output_padding, dilation)]
    taps = list(itertools.product(*(range(k) for k in kernel)))
    K = len(taps)
    G = offset.shape[1] // (K * r)
    outs = []
    for n in range(N):
        out = input.new_zeros((cout, *image))
        for o in itertools.product(*(range(p) for p in positions)):
            for t, tap in enumerate(taps):
                for co in range(cout):
                    gi, g = co // cout_g, co // (cout // G)
                    value = (weight[gi * (cin // groups):(gi + 1) * (cin // groups), co % cout_g][(slice(None), *tap)]
                             * input[(n, slice(gi * (cin // groups), (gi + 1) * (cin // groups)), *o)]).sum()
                    if mask is not None:
                        value = value * mask[(n, g * K + t, *o)]
                    base = (g * K + t) * r
                    point = [o[i] * stride[i] - padding[i] + tap[i] * dilation[i] + offset[(n, base + i, *o)]
                             for i in range(r)]
                    coords = [float(p.detach()) for p in point]
                    if not all(-1 <= c < s for c, s in zip(coords, image)):
                        continue
                    lows = [math.floor(c) for c in coords]
                    for bits in itertools.product((0, 1), repeat=r):
                        idx = [lo + b for lo, b in zip(lows, bits)]
                        if not all(0 <= i < s for i, s in zip(idx, image)):
                            continue
                        w = 1
                        for p, lo, b in zip(point, lows, bits):
                            w = w * ((p - lo) if b else (lo + 1 - p))
                        out = out.index_put((torch.tensor(co), *map(torch.tensor, idx)), w * value, accumulate=True)
        outs.append(out)
    out = torch.stack(outs)
    if bias is not None:
        out = out + bias.reshape(1, cout, *([1] * r))
    return out
