"""An independent, naive multi-scale deformable attention: Python loops over images, queries, heads, levels and
points, bilinear sampling written out (as grid_sample with align_corners=False and zero padding), float64; gradients
by autograd through it. Tiny sizes only."""

import torch
from _naive_dcn import bilinear


def naive_ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    N, S, M, D = value.shape
    _, Lq, _, L, P, _ = sampling_locations.shape
    rows = []
    for n in range(N):
        for q in range(Lq):
            heads = []
            for m in range(M):
                acc = value.new_zeros(D)
                for lvl in range(L):
                    h, w = (int(v) for v in spatial_shapes[lvl])
                    start = int(level_start_index[lvl])
                    img = value[n, start:start + h * w, m].reshape(h, w, D)
                    for p in range(P):
                        x = sampling_locations[n, q, m, lvl, p, 0] * w - 0.5
                        y = sampling_locations[n, q, m, lvl, p, 1] * h - 0.5
                        acc = acc + attention_weights[n, q, m, lvl, p] * bilinear(img, y, x)
                heads.append(acc)
            rows.append(torch.cat(heads))
    return torch.stack(rows).reshape(N, Lq, M * D) if rows else value.new_zeros(N, Lq, M * D)
