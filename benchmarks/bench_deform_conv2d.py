"""Benchmark deform_conv2d side by side with torchvision.ops.deform_conv2d and F.conv2d (cuDNN).

Run on a CUDA GPU:

    python benchmarks/bench_deform_conv2d.py --out benchmarks/results/h200.json

Times are ``triton.testing.do_bench`` medians (ms) on fresh signed random data, forward and forward+backward
(all five gradients: input, offset, mask, weight, bias), plus the first-call time of a new shape (compile and
config choice included) and the extra peak memory of one forward+backward. Every shape has a mask and
padding k//2. Records: {"shape", "dtype", "impl", "pass", "median_ms", ...} with the GPU, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, Cin, Cout, H, W, k, offset groups)
    "det-s3": (8, 128, 128, 100, 152, 3, 1),
    "det-s4": (8, 256, 256, 50, 76, 3, 1),
    "det-s5": (8, 512, 512, 25, 38, 3, 1),
    "cls-14": (64, 256, 256, 14, 14, 3, 1),
    "hires-g8": (16, 64, 64, 128, 128, 3, 8),
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make_inputs(shape, dtype, device, requires_grad=False, seed=0):
    n, cin, cout, h, w, k, g = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    ho, wo = h, w  # stride 1, padding k//2
    t = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, device=device) * scale).to(dtype)  # noqa: E731
    x = t(n, cin, h, w)
    offset = t(n, 2 * g * k * k, ho, wo, scale=2.0)
    mask = torch.rand(n, g * k * k, ho, wo, generator=gen, device=device).to(dtype)
    weight = t(cout, cin, k, k, scale=1.0 / math.sqrt(cin * k * k))
    bias = t(cout)
    tensors = [x, offset, weight, bias, mask]
    if requires_grad:
        for v in tensors:
            v.requires_grad_(True)
    return tensors


def bench(fn, grads=None):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def extra_peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run(shapes, dtypes, impls, passes, device="cuda"):
    import deformconv

    try:
        import torchvision
    except ImportError:
        torchvision = None
    torch.backends.cudnn.benchmark = True
    records = []
    for name in shapes:
        shape = SHAPES[name]
        k = shape[5]
        pad = k // 2
        for dname in dtypes:
            dtype = DTYPES[dname]
            fns = {
                "deformconv": lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=pad, mask=m),
                "torchvision": (lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, padding=pad, mask=m))
                if torchvision else None,
                "conv2d": lambda x, o, w, b, m: F.conv2d(x, w, b, padding=pad),
            }
            for impl in impls:
                fn = fns[impl]
                if fn is None:
                    continue
                base = {"shape": name, "dtype": dname, "impl": impl, "N": shape[0], "Cin": shape[1],
                        "Cout": shape[2], "H": shape[3], "W": shape[4], "k": k, "offset_groups": shape[6]}
                if "fwd" in passes:
                    rec = dict(base, **{"pass": "fwd"})
                    try:
                        args = make_inputs(shape, dtype, device)
                        with torch.no_grad():
                            if impl == "deformconv":
                                torch.cuda.synchronize()
                                t0 = time.perf_counter()
                                fn(*args)
                                torch.cuda.synchronize()
                                rec["first_call_s"] = time.perf_counter() - t0
                            rec["median_ms"] = bench(lambda: fn(*args))
                    except Exception as e:  # e.g. torchvision has no bfloat16
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
                if "fwd+bwd" in passes:
                    rec = dict(base, **{"pass": "fwd+bwd"})
                    try:
                        args = make_inputs(shape, dtype, device, requires_grad=True)
                        if impl == "conv2d":
                            for a in (args[1], args[4]):
                                a.requires_grad_(False)
                        gout = torch.randn_like(fn(*args))

                        def step():
                            fn(*args).backward(gout)

                        if impl == "deformconv":
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            step()
                            torch.cuda.synchronize()
                            rec["first_call_s"] = time.perf_counter() - t0
                        for a in args:
                            a.grad = None
                        rec["extra_peak_mib"] = extra_peak_mib(step)
                        rec["median_ms"] = bench(step, grads=args)
                        rec["input_mib"] = args[0].numel() * args[0].element_size() / 2**20
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
    return records


def environment() -> dict:
    import triton

    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "timer": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
    }
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    import deformconv

    env["deformconv"] = deformconv.__version__
    return env


def table(records) -> str:
    """Markdown table: per shape and dtype, ours vs torchvision vs conv2d and the ratios."""
    idx = {(r["shape"], r["dtype"], r["impl"], r["pass"]): r.get("median_ms") for r in records}
    keys = sorted({(r["shape"], r["dtype"], r["pass"]) for r in records},
                  key=lambda k: (k[2], list(SHAPES).index(k[0]), list(DTYPES).index(k[1])))
    lines = ["| pass | shape | dtype | deformconv ms | torchvision ms | conv2d ms | ours/conv | tv/ours |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else "-"  # noqa: E731
    for shape, dtype, p in keys:
        ours, tv, conv = (idx.get((shape, dtype, i, p)) for i in ("deformconv", "torchvision", "conv2d"))
        r1 = f"{ours / conv:.2f}" if ours and conv else "-"
        r2 = f"{tv / ours:.1f}" if ours and tv else "-"
        lines.append(f"| {p} | {shape} | {dtype} | {fmt(ours)} | {fmt(tv)} | {fmt(conv)} | {r1} | {r2} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--impls", nargs="+", default=["deformconv", "torchvision", "conv2d"])
    ap.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--out", help="write {'environment', 'records'} JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (python -m deformconv bench runs small CPU shapes)")
    records = run(args.shapes, args.dtypes, args.impls, args.passes)
    env = environment()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "records": records}, f, indent=1)
    print(json.dumps(env))
    print(table(records))


if __name__ == "__main__":
    main()
