"""A DCNv4 forward with the points on an axis of the program's tile ([rows, points, channels]) timed beside
deformconv's forward (rows × channels, a point at a time) and DCNv4's CUDA kernel, at bench_dcnv.py's loads (fp16).

    python benchmarks/tools/dcn_points_axis.py           # on a GPU: check against deformconv.dcnv4, then time
    TRITON_INTERPRET=1 python benchmarks/tools/dcn_points_axis.py   # on a CPU: the check alone, at a small shape

Why (docs/tuning.md, the DCNv3/DCNv4 forward at 16 channels a group): deformconv's forward loads a point's two offsets
and weight with three loads a point, each row's in a cache line of its own; with the points on a tile axis a row's
parameters for all its points come in three loads. The kernel here covers DCNv4's layout at 3x3, stride 1, padding 1,
dilation 1, offset scale 1 (points padded to 16): enough to time the formulation before the library takes it.
DCNv4's kernel joins where importable (bench_dcnv.py's docstring says how to build it).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from deformconv.ops.common.sampling import bilinear_weights, point_corners
from deformconv.ops.dcnv3.triton import _rows


@triton.jit
def _points_axis_fwd(
    x_ptr,       # input [N, H, W, C] (C = G·D), contiguous
    om_ptr,      # offset_mask [N, Ho, Wo, P]: group g's 2K offsets (Δx, Δy) then K weights from channel g·3K
    out_ptr,     # out [N, Ho, Wo, C]
    H, W, HO, WO, M, C, P,  # M = N·Ho·Wo
    D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,  # channels a group; points (3x3: 9), padded to KP
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[m, g·D + d] = Σ_k w_k · bilinear(x[n, :, :, g·D + d], y_k, x_k), the tile [BLOCK_M, KP, BLOCK_D]: a row's
    offsets and weights for all its points in three loads. Grid: (M tiles, G)."""
    g = tl.program_id(1)
    # the rows as deformconv's kernels take them; DCNv4's offsets and weights share a row, group g's from channel g·3K
    m_ok, offs_m, oh, ow, n_pix, row, _ = _rows(tl.program_id(0), g, M, HO, WO, H, W, C, P, 3 * K, P, 3 * K,
                                                BLOCK_M)
    kk = tl.arange(0, KP)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    pm = m_ok[:, None] & (kk < K)[None, :]
    dx = tl.load(om_ptr + row[:, None] + 2 * kk[None, :], mask=pm, other=0.0).to(tl.float32)
    dy = tl.load(om_ptr + row[:, None] + 2 * kk[None, :] + 1, mask=pm, other=0.0).to(tl.float32)
    mk = tl.load(om_ptr + row[:, None] + 2 * K + kk[None, :], mask=pm, other=0.0).to(tl.float32)
    i = kk // 3  # 3x3, points kw-outer, stride 1, padding 1, dilation 1, offset scale 1
    j = kk - i * 3
    y = oh.to(tl.float32)[:, None] + ((j - 1).to(tl.float32)[None, :] + dy)
    x = ow.to(tl.float32)[:, None] + ((i - 1).to(tl.float32)[None, :] + dx)
    p00, v00, v01, v10, v11, ly, lx, inside = point_corners(y, x, n_pix[:, None], H, W, C, pm)
    w00, w01, w10, w11 = bilinear_weights(ly, lx, tl.where(inside, mk, 0.0))
    pix = p00 + g * D
    base = x_ptr + pix[:, :, None] + dd[None, None, :]
    dm = d_ok[None, None, :]
    c00 = tl.load(base, mask=v00[:, :, None] & dm, other=0.0).to(tl.float32)
    c01 = tl.load(base + C, mask=v01[:, :, None] & dm, other=0.0).to(tl.float32)
    c10 = tl.load(base + W * C, mask=v10[:, :, None] & dm, other=0.0).to(tl.float32)
    c11 = tl.load(base + W * C + C, mask=v11[:, :, None] & dm, other=0.0).to(tl.float32)
    s = w00[:, :, None] * c00 + w01[:, :, None] * c01 + w10[:, :, None] * c10 + w11[:, :, None] * c11
    acc = tl.sum(s, axis=1)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * C + (g * D + dd)[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def points_axis_forward(x, om, g, d, block_m, warps=4):
    """DCNv4's forward (3x3, stride 1, padding 1) through _points_axis_fwd: out [N, H, W, C]."""
    n, h, w, c = x.shape
    out = torch.empty_like(x)
    m = n * h * w
    _points_axis_fwd[(triton.cdiv(m, block_m), g)](x, om, out, h, w, h, w, m, c, om.shape[-1], D=d, K=9, KP=16,
                                                   BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(d),
                                                   num_warps=warps)
    return out


# (rows a program, warps)
VARIANTS = [(2, 4), (4, 4), (8, 4), (8, 8), (16, 8)]


def main():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_dcnv

    import deformconv

    def dcnv4(x, om, g, d, **kw):
        return deformconv.dcnv4(x, om, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256, False, **kw)

    if not torch.cuda.is_available():  # the check alone, under the interpreter, at a small shape
        gen = torch.Generator().manual_seed(0)
        n, h, w, g, d = 2, 5, 7, 3, 5
        x = torch.randn(n, h, w, g * d, generator=gen)
        om = deformconv.dcnv3_to_dcnv4(torch.randn(n, h, w, g * 18, generator=gen) * 2,
                                       torch.randn(n, h, w, g * 9, generator=gen), g)
        ref = dcnv4(x.double(), om.double(), g, d, backend="reference")
        for block_m, _ in VARIANTS[:2]:
            err = (points_axis_forward(x, om, g, d, block_m).double() - ref).abs().max().item()
            print(f"{block_m} rows a program: max error {err:.2e} against the float64 reference")
            assert err < 1e-4
        return
    from triton.testing import do_bench

    try:
        from DCNv4.functions import DCNv4Function
    except Exception:  # not installed: its column is left out
        DCNv4Function = None
    rows = []
    for name, shape in bench_dcnv.SHAPES.items():
        n, h, w, g, d = shape
        x, om = (t.detach() for t in bench_dcnv._inputs(shape, torch.float16, "dcnv4"))
        ref = dcnv4(x, om, g, d)
        row = dict(shape=name, deformconv=do_bench(lambda: dcnv4(x, om, g, d), return_mode="median"))
        if DCNv4Function is not None:
            row["DCNv4 CUDA"] = do_bench(lambda: DCNv4Function.apply(x, om, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256,
                                                                     False), return_mode="median")
        errors = []
        for block_m, warps in VARIANTS:
            out = points_axis_forward(x, om, g, d, block_m, warps)
            errors.append((out.float() - ref.float()).abs().max().item())
            row[f"points axis {block_m}x{warps}"] = do_bench(lambda: points_axis_forward(x, om, g, d, block_m, warps),
                                                             return_mode="median")
        row["max error"] = max(errors)
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = [k for k in rows[0] if k not in ("shape", "max error")]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, fp16, forward ms (do_bench medians)\n")
    print("| load | " + " | ".join(keys) + " | max error against deformconv |")
    print("|---|" + "---|" * (len(keys) + 1))
    for r in rows:
        print(f"| {r['shape']} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + f" | {r['max error']:.1e} |")


if __name__ == "__main__":
    main()
