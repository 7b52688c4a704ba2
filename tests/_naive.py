"""An independent, naive deform_conv2d: explicit Python loops over images, positions, offset groups and
taps, bilinear sampling written out corner by corner, float64. Gradients come from autograd through it.
Tiny sizes only."""

import math

import torch


def _bilinear(img, y, x):
    """img [C, H, W]; y, x 0-d tensors -> [C]: zero outside (-1, H) x (-1, W), each corner outside the
    image counting as zero; corners from floor(), so derivatives at integers are one-sided (right)."""
    C, H, W = img.shape
    yf, xf = float(y.detach()), float(x.detach())
    out = img.new_zeros(C)
    if not (-1 <= yf < H and -1 <= xf < W):  # at exactly -1 the value is 0 but the derivative is not
        return out
    y0, x0 = math.floor(yf), math.floor(xf)
    for yc, wy in ((y0, (y0 + 1) - y), (y0 + 1, y - y0)):
        for xc, wx in ((x0, (x0 + 1) - x), (x0 + 1, x - x0)):
            if 0 <= yc < H and 0 <= xc < W:
                out = out + wy * wx * img[:, yc, xc]
    return out


def naive_deform_conv2d(input, offset, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), mask=None):
    N, Cin, H, W = input.shape
    Cout, Cg, kh, kw = weight.shape
    groups = Cin // Cg
    K = kh * kw
    G = offset.shape[1] // (2 * K)
    Cpg = Cin // G
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    Ho = (H + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    Wo = (W + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    w = weight.reshape(groups, Cout // groups, Cg * K)
    images = []
    for n in range(N):
        positions = []
        for ho in range(Ho):
            for wo in range(Wo):
                col = []  # per offset group: [K, Cpg]
                for g in range(G):
                    taps = []
                    for i in range(kh):
                        for j in range(kw):
                            t = g * K + i * kw + j
                            y = ho * sh - ph + i * dh + offset[n, 2 * t, ho, wo]
                            x = wo * sw - pw + j * dw + offset[n, 2 * t + 1, ho, wo]
                            v = _bilinear(input[n, g * Cpg:(g + 1) * Cpg], y, x)
                            if mask is not None:
                                v = v * mask[n, t, ho, wo]
                            taps.append(v)
                    col.append(torch.stack(taps))  # [K, Cpg]
                col = torch.stack(col).permute(0, 2, 1).reshape(groups, Cg * K)  # channel-major, tap-minor
                positions.append(torch.einsum("gok,gk->go", w, col).reshape(Cout))
        images.append(torch.stack(positions, dim=1).reshape(Cout, Ho, Wo))
    out = torch.stack(images)
    if bias is not None:
        out = out + bias[None, :, None, None]
    return out
