"""An independent, naive DCNv3: explicit Python loops over images, positions, groups and points, written from the
definition in ops/dcnv/geometry.py, float64; gradients by autograd through it. Tiny sizes only."""

import math

import torch


def bilinear(img, y, x):
    """img [H, W, D]; y, x 0-d tensors (pixels) -> [D]: counted only strictly inside (-1, H) x (-1, W), each corner
    outside the image zero (DCNv3's rule, and grid_sample's with zero padding, as multi-scale deformable attention
    samples)."""
    H, W, D = img.shape
    yf, xf = float(y.detach()), float(x.detach())
    out = img.new_zeros(D)
    if not (-1 < yf < H and -1 < xf < W):
        return out
    y0, x0 = math.floor(yf), math.floor(xf)
    for yc, wy in ((y0, (y0 + 1) - y), (y0 + 1, y - y0)):
        for xc, wx in ((x0, (x0 + 1) - x), (x0 + 1, x - x0)):
            if 0 <= yc < H and 0 <= xc < W:
                out = out + wy * wx * img[yc, xc]
    return out


def naive_dcnv3(input, offset, mask, kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                group, group_channels, offset_scale, remove_center):
    N, H, W, C = input.shape
    Ho = (H + 2 * pad_h - (dilation_h * (kernel_h - 1) + 1)) // stride_h + 1
    Wo = (W + 2 * pad_w - (dilation_w * (kernel_w - 1) + 1)) // stride_w + 1
    ch, cw = (dilation_h * (kernel_h - 1)) // 2, (dilation_w * (kernel_w - 1)) // 2
    taps = [(i, j) for i in range(kernel_w) for j in range(kernel_h)
            if not (remove_center and i == kernel_w // 2 and j == kernel_h // 2)]
    K = len(taps)
    rows = []
    for n in range(N):
        for oh in range(Ho):
            for ow in range(Wo):
                cells = []
                for g in range(group):
                    img = input[n, :, :, g * group_channels:(g + 1) * group_channels]
                    acc = input.new_zeros(group_channels)
                    for k, (i, j) in enumerate(taps):
                        dx = offset[n, oh, ow, (g * K + k) * 2]
                        dy = offset[n, oh, ow, (g * K + k) * 2 + 1]
                        y = oh * stride_h - pad_h + ch + (j * dilation_h - ch + dy) * offset_scale
                        x = ow * stride_w - pad_w + cw + (i * dilation_w - cw + dx) * offset_scale
                        acc = acc + mask[n, oh, ow, g * K + k] * bilinear(img, y, x)
                    cells.append(acc)
                rows.append(torch.cat(cells))
    return torch.stack(rows).reshape(N, Ho, Wo, C)
