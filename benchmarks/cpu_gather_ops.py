"""DCNv3/DCNv4 and multi-scale deformable attention on the CPU: the `cpu` backend (grid_sample's sampler) beside the
`reference` (gathers) and a floor, wall-clock medians of repetitions in which the implementations take turns.

    python benchmarks/cpu_gather_ops.py [--dtypes float32 bfloat16] [--threads N] [--reps N] [--out PATH]
                                        [--peer-dcnv3 DIR] [--peer-msda DIR]

Loads at batch 1, the sizes of a CPU inference or a small fine-tuning step:
- DCNv3 / DCNv4 at InternImage-T's four stages at 224^2 (56^2 x 64 in 4 groups ... 7^2 x 512 in 32), 3x3, offsets
  normal x 2 px, weights softmaxed; the floor is a depthwise 3x3 F.conv2d of the same size.
- Deformable DETR's attention (M=8 heads, D=32, P=4) on levels 50x76, 25x38, 13x19, 7x10 (a 400x608 image): the
  encoder (every pixel a query) and a decoder of 300 queries; locations uniform (some outside); the floor is one
  F.grid_sample of all the points from a map of the first level's size.
Forward (no grad) and forward+backward (gradients of every floating input).

InternImage's `dcnv3_core_pytorch` and Deformable DETR's `ms_deform_attn_core_pytorch` (their pure-PyTorch versions,
for debugging) join as `peer` rows with --peer-dcnv3 / --peer-msda: the folders their setup.py installed into
(`pip install --target`). Where their CUDA extension is not built for this Python, a placeholder module stands in for
it (the pure-PyTorch functions never call it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

DCN_SHAPES = {"internimage-t-s1": (1, 56, 56, 4, 16), "internimage-t-s2": (1, 28, 28, 8, 16),
              "internimage-t-s3": (1, 14, 14, 16, 16), "internimage-t-s4": (1, 7, 7, 32, 16)}
LEVELS = [(50, 76), (25, 38), (13, 19), (7, 10)]
MSDA_LOADS = {"encoder": None, "decoder-300": 300}


def _load_peer(root: str, name: str, extension: str):
    """The package `functions` of a peer's install folder root (pip install --target), imported under a private name
    (both peers call their package `functions`); extension: the compiled module it imports first, a placeholder where
    it is not built for this Python (their pure-PyTorch functions never call it)."""
    import importlib
    import importlib.util
    import types

    try:
        importlib.import_module(extension)
    except ImportError:
        sys.modules[extension] = types.ModuleType(extension)
    if root not in sys.path:
        sys.path.append(root)  # its dist-info (the DCNv3 package reads its own version)
    folder = os.path.join(root, "functions")
    spec = importlib.util.spec_from_file_location(f"_peer_{name}", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _peers(dcnv3_root, msda_root) -> dict:
    """InternImage's dcnv3_core_pytorch and Deformable DETR's ms_deform_attn_core_pytorch from their install folders,
    where given and importable."""
    import importlib

    found = {}
    for key, root, extension, module, attr in (
            ("dcnv3", dcnv3_root, "DCNv3", "dcnv3_func", "dcnv3_core_pytorch"),
            ("msda", msda_root, "MultiScaleDeformableAttention", "ms_deform_attn_func", "ms_deform_attn_core_pytorch")):
        if root:
            try:
                package = _load_peer(root, key, extension)
                found[key] = getattr(importlib.import_module(f"{package.__name__}.{module}"), attr)
            except Exception as e:  # a folder without the function: no peer row
                print(f"peer {key} not loaded: {type(e).__name__}: {e}", file=sys.stderr)
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


def _interleaved(cases: dict, reps: int) -> dict:
    """{impl_fwd_ms, impl_fb_ms: medians} (or impl_error), the implementations timed in turn within each repetition:
    a shared machine's slow spells then fall on all of them alike."""
    import statistics
    import time

    leaves = {k: [t.detach().requires_grad_(t.is_floating_point()) for t in inputs] for k, (inputs, _) in cases.items()}
    times: dict = {k: ([], []) for k in cases}
    errors = {}
    for rep in range(reps + 1):  # the first a warm-up
        for impl, (_, fn) in cases.items():
            if impl in errors:
                continue
            try:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fn(*leaves[impl])
                    t1 = time.perf_counter()
                out = fn(*leaves[impl])
                gout = torch.ones_like(out)
                for t in leaves[impl]:
                    t.grad = None
                t2 = time.perf_counter()
                fn(*leaves[impl]).backward(gout)
                t3 = time.perf_counter()
            except Exception as e:  # e.g. a peer that refuses bfloat16
                errors[impl] = f"{type(e).__name__}: {e}"[:160]
                continue
            if rep:
                times[impl][0].append((t1 - t0) * 1e3)
                times[impl][1].append((t3 - t2) * 1e3)
    row = {f"{k}_error": v for k, v in errors.items()}
    for impl, (fwd, fb) in times.items():
        if impl not in errors:
            row[f"{impl}_fwd_ms"], row[f"{impl}_fb_ms"] = statistics.median(fwd), statistics.median(fb)
    return row


def main(argv=None):
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's)")
    ap.add_argument("--reps", type=int, default=9, help="timed repetitions (medians), implementations in turn")
    ap.add_argument("--peer-dcnv3", help="InternImage's ops_dcnv3 installed here (pip install --target)")
    ap.add_argument("--peer-msda", help="Deformable DETR's models/ops installed here (pip install --target)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    peers = _peers(args.peer_dcnv3, args.peer_msda)
    loads = [("dcn", k, v) for k, v in DCN_SHAPES.items()] + [("msda", k, v) for k, v in MSDA_LOADS.items()]
    rows = []
    for family, name, load in loads:
        for dt_name in args.dtypes:
            dtype = getattr(torch, dt_name)
            cases = (_dcn_cases if family == "dcn" else _msda_cases)(load, dtype, peers)
            row = dict(load=name, dtype=dt_name, threads=torch.get_num_threads())
            row.update(_interleaved(cases, args.reps))
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
