"""Host cost of one call: microseconds of CPU a tiny layer's forward and forward+backward take, GPU idle.

    python benchmarks/host_cost.py [--shape N,Cin,Cout,H,W] [--calls 300] [--profile PATH] [--out PATH] [--eager-only]

A tiny layer (default 2x16->16 at 8x8, 3x3, a mask) keeps the GPU far from busy, so the wall time of a loop of calls
is the host's time per call. Rows: F.conv2d (the floor), torchvision.ops.deform_conv2d and deformconv, in plain
eager (fp16, fp32), under autocast (bf16, fp16; fp32 inputs) and compiled (torch.compile, fullgraph, fp16; the op
opaque, and decomposed into its kernels with DEFORMCONV_COMPILE_KERNELS=1), each the median of 7 loops; ratios
against torchvision's. --profile writes cProfile's statistics of deformconv's fp16 forward+backward loop. --floor
prints, in plain fp16, the floor any op written as a Python autograd.Function stands on: one that only allocates its
output and its 5 gradients, and the same with 1 + 4 trivial Triton launches (as many as deform_conv2d's) through
Triton's own launch path.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _inputs(shape, dtype, device, grad):
    n, cin, cout, h, w = shape
    g = torch.Generator(device=device).manual_seed(0)
    t = [torch.randn(n, cin, h, w, generator=g, device=device), torch.randn(n, 18, h, w, generator=g, device=device),
         torch.randn(cout, cin, 3, 3, generator=g, device=device) * 0.1, torch.randn(cout, generator=g, device=device),
         torch.rand(n, 9, h, w, generator=g, device=device)]
    return [x.to(dtype).requires_grad_(grad) for x in t]


def _loop_us(step, calls: int, device) -> float:
    for _ in range(20):  # warm: compile, plans, allocator
        step()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        t1 = time.perf_counter()  # host time: launches are queued, the GPU is far from busy
        torch.cuda.synchronize(device)
        times.append((t1 - t0) / calls * 1e6)
    return statistics.median(times)


def python_profile(step, calls: int, device, rows: int, orders=("tottime",)) -> str:
    """cProfile's statistics of `calls` calls of step (warmed first), sorted by each of orders, `rows` lines each."""
    _loop_us(step, 10, device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    for order in orders:
        stats.sort_stats(order).print_stats(rows)
    return text.getvalue()


@triton.jit
def _touch_kernel(p, N: tl.constexpr):
    """A trivial kernel: 16 zeros stored."""
    tl.store(p + tl.arange(0, N), tl.zeros((N,), p.dtype.element_ty))


class _EmptyOp(torch.autograd.Function):
    """The floor of a Python op (--floor): the output and the 5 gradients allocated, nothing computed; with launches,
    one trivial Triton kernel launched forward and four backward."""

    @staticmethod
    def forward(ctx, x, o, w, b, m, launches):
        out = torch.empty((x.shape[0], w.shape[0], x.shape[2], x.shape[3]), dtype=x.dtype, device=x.device)
        if launches:
            _touch_kernel[(1,)](out, N=16)
        ctx.save_for_backward(x, o, w, m)
        ctx.launches = launches
        return out

    @staticmethod
    def backward(ctx, g):
        x, o, w, m = ctx.saved_tensors
        grads = [torch.empty_like(x), torch.empty_like(o), torch.empty_like(w),
                 torch.empty(w.shape[0], dtype=w.dtype, device=w.device), torch.empty_like(m)]
        if ctx.launches:
            for t in grads[:4]:
                _touch_kernel[(1,)](t, N=16)
        return (*grads, None)


def floor_rows(shape, calls: int, device) -> list:
    """(name, fwd µs, fwd+bwd µs) of F.conv2d and the two empty Python ops, plain fp16."""
    impls = {
        "F.conv2d": lambda x, o, w, b, m: F.conv2d(x, w, b, padding=1),
        "empty autograd.Function": lambda x, o, w, b, m: _EmptyOp.apply(x, o, w, b, m, False),
        "the same, 5 Triton launches": lambda x, o, w, b, m: _EmptyOp.apply(x, o, w, b, m, True),
    }
    rows = []
    for name, impl in impls.items():
        times = []
        for grad in (False, True):
            leaves = _inputs(shape, torch.float16, device, grad)

            def step():
                out = impl(*leaves)
                if grad:
                    out.backward(torch.ones_like(out))

            times.append(_loop_us(step, calls, device))
        rows.append((name, *times))
    return rows


def main(argv=None):
    import torchvision

    import deformconv
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,16,16,8,8", help="N,Cin,Cout,H,W (3x3, padding 1)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", help="write cProfile stats of deformconv's fp16 fwd+bwd loop here")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--floor", action="store_true", help="also print the floor of a Python op (see the docstring)")
    ap.add_argument("--eager-only", action="store_true", help="leave out the torch.compile rows (their compiles)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.device("cuda")
    shape = tuple(int(v) for v in args.shape.split(","))
    impls = {
        "F.conv2d": lambda x, o, w, b, m: F.conv2d(x, w, b, padding=1),
        "torchvision": lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, padding=1, mask=m),
        "deformconv": lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m),
    }
    # (label, dtype, autocast dtype, compiled: DEFORMCONV_COMPILE_KERNELS under torch.compile, or False for eager)
    cases = [("fp16", torch.float16, None, False), ("fp32", torch.float32, None, False),
             ("autocast bf16", torch.float32, torch.bfloat16, False),
             ("autocast fp16", torch.float32, torch.float16, False),
             ("compiled fp16", torch.float16, None, "0"), ("compiled fp16, kernels visible", torch.float16, None, "1")]
    if args.eager_only:
        cases = [c for c in cases if not c[3]]
    rows = []
    for label, dtype, autocast, compiled in cases:
        for name, impl in impls.items():
            row = dict(case=label, impl=name)
            for grad in (False, True):
                if compiled:
                    os.environ["DEFORMCONV_COMPILE_KERNELS"] = compiled
                fn = torch.compile(impl, fullgraph=True) if compiled else impl
                leaves = _inputs(shape, dtype, device, grad)
                ctx = (lambda: torch.autocast("cuda", dtype=autocast)) if autocast else contextlib.nullcontext

                def step():
                    with ctx():
                        out = fn(*leaves)
                    if grad:
                        out.backward(torch.ones_like(out))

                try:
                    row["fwd+bwd_us" if grad else "fwd_us"] = _loop_us(step, args.calls, device)
                except Exception as e:  # torchvision has no bf16
                    row["fwd+bwd_us" if grad else "fwd_us"] = None
                    row["error"] = f"{type(e).__name__}: {e}"[:120]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nHost time per call (us), layer {shape} 3x3 with a mask, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}\n")
    print("| case | F.conv2d fwd | torchvision fwd | deformconv fwd | ours / tv | F.conv2d fwd+bwd "
          "| torchvision fwd+bwd | deformconv fwd+bwd | ours / tv |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for label, *_ in cases:
        r = {row["impl"]: row for row in rows if row["case"] == label}
        cells = []
        for p in ("fwd_us", "fwd+bwd_us"):
            conv, tv, ours = r["F.conv2d"][p], r["torchvision"][p], r["deformconv"][p]
            ratio = f"{ours / tv:.2f}" if tv and ours else "-"
            cells += [fmt(conv), fmt(tv), fmt(ours), ratio]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.floor:
        print("\nThe floor of a Python op (fp16, us a call):\n\n| op | fwd | fwd+bwd |\n|---|---|---|")
        for name, fwd, both in floor_rows(shape, args.calls, device):
            print(f"| {name} | {fwd:.0f} | {both:.0f} |")
    if args.out:
        env = dict(environment("cuda"), timer=f"median of 7 loops of {args.calls} calls, wall time per call, GPU idle",
                   layer=f"{shape}, 3x3, mask")
        write_results(args.out, env, rows)
    if args.profile:
        leaves = _inputs(shape, torch.float16, device, True)

        def step():
            out = impls["deformconv"](*leaves)
            out.backward(torch.ones_like(out))

        with open(args.profile, "w") as f:
            f.write(python_profile(step, args.calls, device, 45, ("tottime", "cumulative")))


if __name__ == "__main__":
    main()
