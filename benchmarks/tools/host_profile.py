"""Where the host time of one tiny deform_conv2d call goes, on a CUDA GPU: torch.profiler's CPU table (aten ops, CUDA
runtime calls, autograd nodes) of a loop of forward+backward calls, deformconv beside torchvision, and cProfile's
Python functions of deformconv's loop. host_cost.py gives the totals; this gives the split.

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
