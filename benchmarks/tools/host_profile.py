"""Where the host time of one tiny deform_conv2d call goes, on a CUDA GPU: torch.profiler's CPU table (aten ops, CUDA
runtime calls, autograd nodes) of a loop of forward+backward calls, deformconv beside torchvision, and cProfile's
Python functions of deformconv's loop. host_cost.py gives the totals; this gives the split. First, for each op, the
wall time of the forward, of ``backward()``, and of our backward's Python inside it (the rest is the autograd engine:
its C++, the gradients' accumulation into the leaves, the hand-over to our node), deformconv with its backward's
side stream on and off (DEFORMCONV_BACKWARD_STREAMS).

    python benchmarks/tools/host_profile.py [--shape 2,16,16,8,8] [--dtype float16] [--autocast] [--calls 200]

Rows of the tables are per call (the loop's totals divided by --calls).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def engine_split(step_parts, calls: int, device, reps: int = 7):
    """Medians over reps loops of calls of (forward, backward(), our Python backward inside it) in us a call, the GPU
    idle. step_parts() -> (out, grad) runs the forward; our backward is timed through DeformConv2dFunction.backward."""
    import time

    from deformconv.ops.deform_conv2d import eager

    spent = [0.0]
    original = eager.DeformConv2dFunction.backward

    def timed(ctx, grad_out):
        t0 = time.perf_counter()
        try:
            return original(ctx, grad_out)
        finally:
            spent[0] += time.perf_counter() - t0

    eager.DeformConv2dFunction.backward = staticmethod(timed)
    try:
        for _ in range(20):
            out, grad = step_parts()
            out.backward(grad)
        torch.cuda.synchronize(device)
        rows = []
        for _ in range(reps):
            spent[0], fwd, bwd = 0.0, 0.0, 0.0
            for _ in range(calls):
                t0 = time.perf_counter()
                out, grad = step_parts()
                t1 = time.perf_counter()
                out.backward(grad)
                bwd += time.perf_counter() - t1
                fwd += t1 - t0
            torch.cuda.synchronize(device)
            rows.append((fwd / calls * 1e6, bwd / calls * 1e6, spent[0] / calls * 1e6))
    finally:
        eager.DeformConv2dFunction.backward = original
    rows.sort(key=lambda r: r[0] + r[1])
    return rows[len(rows) // 2]


def main(argv=None):
    import torchvision
    from host_cost import _inputs, _loop_us, python_profile

    import deformconv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2,16,16,8,8")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--autocast", action="store_true", help="fp32 inputs under autocast to --dtype")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device = torch.device("cuda")
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    impls = {
        "torchvision": lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, padding=1, mask=m),
        "deformconv": lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m),
    }
    ctx = (lambda: torch.autocast("cuda", dtype=dtype)) if args.autocast else contextlib.nullcontext
    print("| op | forward | backward() | our Python backward in it | the rest of backward() |\n|---|---|---|---|---|")
    for name, impl, streams in (("torchvision", impls["torchvision"], None), ("deformconv", impls["deformconv"], "1"),
                                ("deformconv, no side stream", impls["deformconv"], "0")):
        leaves = _inputs(shape, torch.float32 if args.autocast else dtype, device, True)

        def parts(impl=impl, leaves=leaves):
            with ctx():
                out = impl(*leaves)
            return out, torch.ones_like(out)

        saved = os.environ.get("DEFORMCONV_BACKWARD_STREAMS")
        if streams is not None:
            os.environ["DEFORMCONV_BACKWARD_STREAMS"] = streams
        try:
            fwd, bwd, ours = engine_split(parts, args.calls, device)
        finally:
            if saved is None:
                os.environ.pop("DEFORMCONV_BACKWARD_STREAMS", None)
            else:
                os.environ["DEFORMCONV_BACKWARD_STREAMS"] = saved
        print(f"| {name} | {fwd:.0f} | {bwd:.0f} | {ours:.0f} | {bwd - ours:.0f} |", flush=True)
    for name, impl in impls.items():
        leaves = _inputs(shape, torch.float32 if args.autocast else dtype, device, True)

        def step():
            with ctx():
                out = impl(*leaves)
            out.backward(torch.ones_like(out))

        print(f"\n## {name}: {_loop_us(step, args.calls, device):.0f} us per fwd+bwd call (host)\n", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                step()
            torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        print(table, flush=True)
        if name == "deformconv":
            print(python_profile(step, args.calls, device, args.rows), flush=True)


if __name__ == "__main__":
    main()
