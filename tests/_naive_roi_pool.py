"""An independent, naive deformable RoI pooling: Python loops over RoIs, bins and samples, RoIAlign's bilinear
written out (mmcv's and torchvision's), float64; gradients by autograd through it. Tiny sizes only."""

import math

import torch


def _bilinear(img, y, x):
    """img [C, H, W]; y, x 0-d tensors -> [C]: 0 outside [-1, H] x [-1, W]; inside, clamped to the image."""
    C, H, W = img.shape
    yf, xf = float(y.detach()), float(x.detach())
    if yf < -1 or yf > H or xf < -1 or xf > W:
        return img.new_zeros(C)
    if yf <= 0:
        y = y * 0
    if xf <= 0:
        x = x * 0
    y_low, x_low = int(math.floor(max(yf, 0))), int(math.floor(max(xf, 0)))
    if y_low >= H - 1:
        y_low = y_high = H - 1
        y = y * 0 + (H - 1)
    else:
        y_high = y_low + 1
    if x_low >= W - 1:
        x_low = x_high = W - 1
        x = x * 0 + (W - 1)
    else:
        x_high = x_low + 1
    ly, lx = y - y_low, x - x_low
    hy, hx = 1 - ly, 1 - lx
    return (hy * hx * img[:, y_low, x_low] + hy * lx * img[:, y_low, x_high] + ly * hx * img[:, y_high, x_low]
            + ly * lx * img[:, y_high, x_high])


def naive_deform_roi_pool(input, rois, offset, output_size, spatial_scale=1.0, sampling_ratio=0, gamma=0.1):
    ph, pw = output_size
    outs = []
    for r in range(rois.shape[0]):
        b = int(rois[r, 0])
        x1, y1 = rois[r, 1] * spatial_scale - 0.5, rois[r, 2] * spatial_scale - 0.5
        roi_w = rois[r, 3] * spatial_scale - 0.5 - x1
        roi_h = rois[r, 4] * spatial_scale - 0.5 - y1
        bin_w, bin_h = roi_w / pw, roi_h / ph
        gh = sampling_ratio if sampling_ratio > 0 else max(math.ceil(float(roi_h.detach()) / ph), 0)
        gw = sampling_ratio if sampling_ratio > 0 else max(math.ceil(float(roi_w.detach()) / pw), 0)
        count = max(gh * gw, 1)
        bins = []
        for i in range(ph):
            for j in range(pw):
                sx, sy = x1 + j * bin_w, y1 + i * bin_h
                if offset is not None:
                    sx = sx + gamma * roi_w * offset[r, 0, i, j]
                    sy = sy + gamma * roi_h * offset[r, 1, i, j]
                acc = input.new_zeros(input.shape[1])
                for iy in range(gh):
                    y = sy + (iy + 0.5) * bin_h / gh
                    for ix in range(gw):
                        x = sx + (ix + 0.5) * bin_w / gw
                        acc = acc + _bilinear(input[b], y, x)
                bins.append(acc / count)
        outs.append(torch.stack(bins, -1).reshape(input.shape[1], ph, pw))
    return torch.stack(outs) if outs else input.new_zeros(0, input.shape[1], ph, pw)


def _interp(img, y, x):
    """The Deformable ConvNets code's bilinear: img [H, W]; y, x clamped to the image already; floor and ceil
    corners."""
    yf, xf = float(y.detach()), float(x.detach())
    y1, y2, x1, x2 = math.floor(yf), math.ceil(yf), math.floor(xf), math.ceil(xf)
    dy, dx = y - y1, x - x1
    return ((1 - dx) * (1 - dy) * img[y1, x1] + (1 - dx) * dy * img[y2, x1] + dx * (1 - dy) * img[y1, x2]
            + dx * dy * img[y2, x2])


def naive_deform_psroi_pool(input, rois, offset, spatial_scale, pooled_size, output_dim, no_trans, group_size=1,
                            part_size=None, sample_per_part=4, trans_std=0.0):
    N, C, H, W = input.shape
    P, G, S = pooled_size, group_size, sample_per_part
    part_size = part_size or P
    classes = 1 if no_trans else offset.shape[1] // 2
    per_class = output_dim // classes
    def c_round(v):  # halves away from zero
        v = float(v)
        return math.floor(v + 0.5) if v >= 0 else math.ceil(v - 0.5)

    outs = []
    for r in range(rois.shape[0]):
        b = int(rois[r, 0])
        sw = c_round(rois[r, 1]) * spatial_scale - 0.5
        sh = c_round(rois[r, 2]) * spatial_scale - 0.5
        rw = max((c_round(rois[r, 3]) + 1) * spatial_scale - 0.5 - sw, 0.1)
        rh = max((c_round(rois[r, 4]) + 1) * spatial_scale - 0.5 - sh, 0.1)
        bw, bh = rw / P, rh / P
        vals = []
        for o in range(output_dim):
            k = o // per_class
            for i in range(P):
                for j in range(P):
                    hs, ws = i * bh + sh, j * bw + sw
                    if not no_trans:
                        pi, pj = i * part_size // P, j * part_size // P
                        ws = ws + offset[r, 2 * k, pi, pj] * trans_std * rw
                        hs = hs + offset[r, 2 * k + 1, pi, pj] * trans_std * rh
                    gi, gj = min(max(i * G // P, 0), G - 1), min(max(j * G // P, 0), G - 1)
                    c = (o * G + gi) * G + gj
                    total, count = input.new_zeros(()), 0
                    for ih in range(S):
                        for iw in range(S):
                            w = ws + iw * bw / S
                            h = hs + ih * bh / S
                            wf, hf = float(torch.as_tensor(w).detach()), float(torch.as_tensor(h).detach())
                            if wf < -0.5 or wf > W - 0.5 or hf < -0.5 or hf > H - 0.5:
                                continue
                            if wf < 0 or wf > W - 1:
                                w = input.new_tensor(min(max(wf, 0.0), W - 1.0))
                            if hf < 0 or hf > H - 1:
                                h = input.new_tensor(min(max(hf, 0.0), H - 1.0))
                            total = total + _interp(input[b, c], h if torch.is_tensor(h) else input.new_tensor(h),
                                                    w if torch.is_tensor(w) else input.new_tensor(w))
                            count += 1
                    vals.append(total / count if count else input.new_zeros(()))
        outs.append(torch.stack(vals).reshape(output_dim, P, P))
    return torch.stack(outs) if outs else input.new_zeros(0, output_dim, P, P)
