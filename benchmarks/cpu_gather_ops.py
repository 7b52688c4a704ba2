"""DCNv3/DCNv4 and multi-scale deformable attention on the CPU: the `cpu` backend (grid_sample's sampler) beside the
`reference` (gathers) and a floor, wall-clock medians.

    python benchmarks/cpu_gather_ops.py [--dtypes float32 bfloat16] [--threads N] [--out PATH]

Loads at batch 1, the sizes of a CPU inference or a small fine-tuning step:
- DCNv3 / DCNv4 at InternImage-T's four stages at 224^2 (56^2 x 64 in 4 groups ... 7^2 x 512 in 32), 3x3, offsets
  normal x 2 px, weights softmaxed; the floor is a depthwise 3x3 F.conv2d of the same size.
- Deformable DETR's attention (M=8 heads, D=32, P=4) on levels 50x76, 25x38, 13x19, 7x10 (a 400x608 image): the
  encoder (every pixel a query) and a decoder of 300 queries; locations uniform (some outside); the floor is one
  F.grid_sample of all the points from a map of the first level's size.
Forward (no grad) and forward+backward (gradients of every floating input).

InternImage's `dcnv3_core_pytorch` and Deformable DETR's `ms_deform_attn_core_pytorch` (their pure-PyTorch versions,
for debugging) join as `peer` rows where their packages import (both import their CUDA extension first).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

DCN_SHAPES = {"internimage-t-s1": (1, 56, 56, 4, 16), "internimage-t-s2": (1, 28, 28, 8, 16),
              "internimage-t-s3": (1, 14, 14, 16, 16), "internimage-t-s4": (1, 7, 7, 32, 16)}
LEVELS = [(50, 76), (25, 38), (13, 19), (7, 10)]
MSDA_LOADS = {"encoder": None, "decoder-300": 300}


def _peers() -> dict:
    found = {}
    try:
        from functions.dcnv3_func import dcnv3_core_pytorch  # InternImage's ops_dcnv3
        found["dcnv3"] = dcnv3_core_pytorch
    except Exception:  # not installed: no peer row
        pass
    try:
        from functions.ms_deform_attn_func import ms_deform_attn_core_pytorch  # Deformable DETR's models/ops
        found["msda"] = ms_deform_attn_core_pytorch
    except Exception:
        pass
    return found


def _dcn_cases(shape, dtype, peers):
    import deformconv

    n, h, w, g, d = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, w, g * d, generator=gen).to(dtype)
    offset = (torch.randn(n, h, w, g * 18, generator=gen) * 2).to(dtype)
    mask = torch.softmax(torch.randn(n, h, w, g, 9, generator=gen), -1).reshape(n, h, w, -1).to(dtype)
    om = deformconv.dcnv3_to_dcnv4(offset, mask, g)
    args = (3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0)
    cases = {f"dcnv3_{b}": ((x, offset, mask), lambda a, o, m, b=b: deformconv.dcnv3(a, o, m, *args, backend=b))
             for b in ("cpu", "reference")}
    cases["dcnv4_cpu"] = ((x, om), lambda a, o: deformconv.dcnv4(a, o, *args, backend="cpu"))
    if "dcnv3" in peers:
        cases["dcnv3_peer"] = ((x, offset, mask), lambda a, o, m: peers["dcnv3"](a, o, m, *args, False))
    conv_x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    conv_w = torch.randn(g * d, 1, 3, 3, generator=gen).to(dtype)
    cases["floor"] = ((conv_x, conv_w), lambda a, b: F.conv2d(a, b, padding=1, groups=g * d))
    return cases


def _msda_cases(queries, dtype, peers):
    import deformconv

    n, m, d, p = 1, 8, 32, 4
    shapes = torch.tensor(LEVELS)
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    lq = int(sizes.sum()) if queries is None else queries
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(n, int(sizes.sum()), m, d, generator=gen).to(dtype)
    loc = (torch.rand(n, lq, m, len(LEVELS), p, 2, generator=gen) * 1.1 - 0.05).to(dtype)
    attn = torch.softmax(torch.randn(n, lq, m, len(LEVELS) * p, generator=gen), -1).view(n, lq, m, len(LEVELS), p)
    attn = attn.to(dtype)
    cases = {f"msda_{b}": ((value, loc, attn), lambda v, lo, a, b=b: deformconv.ms_deform_attn(
        v, shapes, starts, lo, a, backend=b)) for b in ("cpu", "reference")}
    if "msda" in peers:
        cases["msda_peer"] = ((value, loc, attn), lambda v, lo, a: peers["msda"](v, shapes, lo, a))
    h0, w0 = LEVELS[0]
    maps = torch.randn(n * m, d, h0, w0, generator=gen).to(dtype)
    grid = (torch.rand(n * m, lq, len(LEVELS) * p, 2, generator=gen) * 2 - 1).to(dtype)
    cases["floor"] = ((maps, grid), lambda a, b: F.grid_sample(a, b, align_corners=False))
    return cases


def main(argv=None):
    from deformconv.benchmark import environment, time_ms, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    peers = _peers()
    loads = [("dcn", k, v) for k, v in DCN_SHAPES.items()] + [("msda", k, v) for k, v in MSDA_LOADS.items()]
    rows = []
    for family, name, load in loads:
        for dt_name in args.dtypes:
            dtype = getattr(torch, dt_name)
            cases = (_dcn_cases if family == "dcn" else _msda_cases)(load, dtype, peers)
            row = dict(load=name, dtype=dt_name, threads=torch.get_num_threads())
            for impl, (inputs, fn) in cases.items():
                leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
                try:
                    with torch.no_grad():
                        row[f"{impl}_fwd_ms"] = time_ms(lambda: fn(*leaves), cpu)
                    out = fn(*leaves)
                    gout = torch.randn_like(out)
                    row[f"{impl}_fb_ms"] = time_ms(lambda: fn(*leaves).backward(gout), cpu, grads=leaves)
                except Exception as e:  # e.g. a peer that refuses bfloat16
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = environment(cpu)
    env["threads"] = torch.get_num_threads()
    env["peers"] = sorted(peers) or "none importable"
    print(f"\n{env.get('device')}, torch {torch.__version__}; wall-clock medians in ms (forward / forward+backward)\n")
    impls = ("cpu", "reference", "peer", "floor")
    print("| load | dtype | " + " | ".join(impls) + " |")
    print("|---|---|" + "---|" * len(impls))
    for r in rows:
        op = "msda" if r["load"] in MSDA_LOADS else "dcnv3"
        cells = []
        for i in impls:
            key = "floor" if i == "floor" else f"{op}_{i}"
            have = f"{key}_fwd_ms" in r and f"{key}_fb_ms" in r
            cells.append(f"{r[f'{key}_fwd_ms']:.2f} / {r[f'{key}_fb_ms']:.2f}" if have else "-")
        print(f"| {r['load']} | {r['dtype']} | " + " | ".join(cells) + " |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
