"""The gather kernels' point parameters, loaded a point at a time or all of a row's first, timed side by side on a GPU.

DCNv3/DCNv4: each point's offsets and weight loaded at that point (options.preload_points=False), or a position's
offsets and weights for all its points loaded first (the default where K ≤ 16), the latter at other tiles too
(options.gather_tile); the forward beside DCNv4's CUDA kernel where importable (bench_dcnv.py's docstring says how to
build it). Loads: bench_dcnv.py's, and shapes it never tuned for (5×5, stride 2, wide and odd groups, a small batch).
Multi-scale deformable attention (--family msda): the same two ways of loading a query's locations and weights, and
smaller tiles, at bench_msda.py's loads and a one-image decoder.

    python benchmarks/tools/point_loads.py [--family dcnv|msda] [--dtype float16] [--out PATH]

GPU time: `do_bench_cudagraph` medians (ms) of the forward's kernel (DCNv4's eager call is bound by its host), then
of the backward's (both gradients) with and without the preload. Each variant's results are compared with the
first's (the backward's relative to their largest: its atomics add in any order). docs/tuning.md keeps the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (N, H, W, G, D, k, stride, pad, remove_center): bench_dcnv.py's loads, then others
LOADS = {
    "dcnv4-bench": (64, 56, 56, 4, 32, 3, 1, 1, False),
    "internimage-t-s1": (64, 56, 56, 4, 16, 3, 1, 1, False),
    "internimage-t-s2": (64, 28, 28, 8, 16, 3, 1, 1, False),
    "internimage-t-s3": (64, 14, 14, 16, 16, 3, 1, 1, False),
    "internimage-t-s4": (64, 7, 7, 32, 16, 3, 1, 1, False),
    "3x3-remove-center-d24": (16, 45, 37, 4, 24, 3, 1, 1, True),
    "stride2-d8-odd": (8, 61, 83, 6, 8, 3, 2, 1, False),
    "d64": (32, 28, 28, 4, 64, 3, 1, 1, False),
    "d128": (32, 28, 28, 2, 128, 3, 1, 1, False),
    "small-batch-d32": (1, 20, 30, 8, 32, 3, 1, 1, False),
    "5x5-d16": (16, 28, 28, 8, 16, 5, 1, 2, False),
}
# (label, options) of the forward
VARIANTS = [
    ("per-point loads", dict(preload_points=False)),
    ("preload", dict(preload_points=True)),
    ("preload 2048x8", dict(preload_points=True, gather_tile=(2048, 8))),
    ("preload 512x4", dict(preload_points=True, gather_tile=(512, 4))),
]


# (label, options) of attention's kernels: both ways of loading at the former 1024x4 tile and at smaller ones (more
# programs at the decoders' few queries); "preload 256x2" is the default
ATTENTION_VARIANTS = [
    ("per-point loads", dict(preload_points=False, gather_tile=(1024, 4))),
    ("preload", dict(preload_points=True, gather_tile=(1024, 4))),
    ("preload 512x4", dict(preload_points=True, gather_tile=(512, 4))),
    ("preload 256x2", dict(preload_points=True, gather_tile=(256, 2))),
    ("per-point 256x2", dict(preload_points=False, gather_tile=(256, 2))),
]


def attention_rows(dtype, bench, options):
    """bench_msda.py's loads, and a single-image decoder: forward and backward (all three gradients) of each
    variant."""
    import bench_msda

    from deformconv.ops.msda import triton as kernels

    rows = []
    loads = dict(bench_msda.LOADS, **{"decoder-100-batch1": 100})
    for name, queries in loads.items():
        value, shapes, starts, loc, attn = (t.detach() for t in bench_msda._inputs(queries, dtype))
        if name.endswith("batch1"):
            value, loc, attn = value[:1].contiguous(), loc[:1].contiguous(), attn[:1].contiguous()
        go = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda", dtype=dtype)
        row, first, err = dict(load=name), None, 0.0
        for label, changes in ATTENTION_VARIANTS:
            with options.override(**changes):
                got = [kernels.ms_deform_attn_forward(value, shapes, starts, loc, attn),
                       *kernels.ms_deform_attn_backward(go, value, shapes, starts, loc, attn, (True, True, True))]
                first = got if first is None else first
                err = max([err] + [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                   for a, b in zip(got, first)])
                row[label] = bench(lambda: kernels.ms_deform_attn_forward(value, shapes, starts, loc, attn),
                                   return_mode="median")
                row[f"bwd: {label}"] = bench(lambda: kernels.ms_deform_attn_backward(
                    go, value, shapes, starts, loc, attn, (True, True, True)), return_mode="median")
        row["max difference"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    from triton.testing import do_bench_cudagraph as bench

    import deformconv
    from deformconv.benchmark import environment, write_results
    from deformconv.config import options
    from deformconv.ops.dcnv3 import triton as kernels
    from deformconv.ops.dcnv3.geometry import DcnGeometry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="dcnv", choices=["dcnv", "msda"])
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    try:
        from DCNv4.functions import DCNv4Function
    except Exception:  # not installed: its column is left out
        DCNv4Function = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [] if args.family == "dcnv" else attention_rows(dtype, bench, options)
    for name, (n, h, w, g, d, k, s, p, rc) in (LOADS if args.family == "dcnv" else {}).items():
        geo = DcnGeometry(n, h, w, g, d, (k, k), (s, s), (p, p), (1, 1), 1.0, rc)
        kk = geo.points
        x = torch.randn(n, h, w, g * d, device="cuda", generator=gen).to(dtype)
        offset = torch.randn(n, geo.out_h, geo.out_w, g * kk * 2, device="cuda", generator=gen) * 2
        mask = torch.softmax(torch.randn(n, geo.out_h, geo.out_w, g, kk, device="cuda", generator=gen), -1)
        om = deformconv.dcnv3_to_dcnv4(offset, mask.reshape(n, geo.out_h, geo.out_w, -1), g).to(dtype)
        row = dict(load=name)
        ref, err = None, 0.0
        for label, changes in VARIANTS:
            with options.override(**changes):
                out = kernels.dcnv4_forward(x, om, geo).float()
                ref = out if ref is None else ref
                err = max(err, (out - ref).abs().max().item())
                row[label] = bench(lambda: kernels.dcnv4_forward(x, om, geo), return_mode="median")
        go = torch.randn_like(x)
        grads = None
        for label, preload in (("bwd: per-point loads", False), ("bwd: preload", True)):
            with options.override(preload_points=preload):
                got = kernels.dcnv4_backward(go, x, om, geo, (True, True))
                grads = got if grads is None else grads
                err = max(err, max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                   for a, b in zip(got, grads)))
                row[label] = bench(lambda: kernels.dcnv4_backward(go, x, om, geo, (True, True)),
                                   return_mode="median")
        if DCNv4Function is not None and d % 16 == 0 and (k, s, rc) == (3, 1, False):  # what its kernel takes
            params = (k, k, s, s, p, p, 1, 1, g, d, 1.0, 256, rc)
            row["DCNv4 CUDA"] = bench(lambda: DCNv4Function.apply(x, om, *params), return_mode="median")
        row["max difference"] = err
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("load", "max difference")))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.family}, {args.dtype}, ms "
          "(do_bench_cudagraph medians); the largest difference from the first variant\n")
    print("| load | " + " | ".join(keys) + " | max difference |")
    print("|---|" + "---|" * (len(keys) + 1))
    for r in rows:
        print(f"| {r['load']} | " + " | ".join(f"{r[k]:.3f}" if k in r else "" for k in keys)
              + f" | {r['max difference']:.1e} |")
    if args.out:
        env = dict(environment("cuda"), family=args.family, dtype=args.dtype, timer="triton.testing.do_bench_cudagraph median, ms",
                   dcnv4_cuda="installed" if DCNv4Function is not None else "not installed")
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
