"""Where the GPU time of one ResNet-50-DCN training (or inference) step goes, on a CUDA GPU: torch.profiler's kernels
of a few steps of bench_resnet_dcn.py's network, summed by kernel name, for each net and mode asked for. It gives the
GPU split (our kernels, convolutions, the rest) and the GPU total, which is the floor of a CUDA-graph step, beside the
step's wall time (median of 20 synchronised steps, unprofiled): where the wall time is well above the GPU total, the
host bounds the step.

    python benchmarks/tools/step_profile.py [--case b32-224:bfloat16] [--nets plain deformconv] [--modes eager default]
        [--steps-of train infer]

Rows are per step (the profiled steps' totals divided by --steps).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def category(name: str) -> str:
    """A kernel's family, by its name: our Triton kernels, the convolutions and GEMMs, and the rest."""
    low = name.lower()
    if "deform" in low or low.startswith(("_pack", "_transpose", "_channel_sum", "_finish_grads", "_columns",
                                          "_grad_columns")):
        return "deformconv kernels"
    if any(k in low for k in ("conv", "gemm", "sm90", "xmma", "cutlass", "wgrad", "dgrad", "implicit")):
        return "conv / gemm"
    if low.startswith("triton_"):
        return "inductor fused"
    return "other (elementwise, norm, reduce, copy)"


def profile_step(kind, base, case, dtype, mode, steps, rows, which="train"):
    from bench_resnet_dcn import case_steps, timed
    from torch.profiler import ProfilerActivity, profile

    net, train_step, infer_step = case_steps(kind, base, case, dtype, mode)
    net.train(which == "train")  # as bench_resnet_dcn.py times them
    step = train_step if which == "train" else infer_step
    wall = timed(step, steps=20, warmup=5)[0]  # bench_resnet_dcn.py's timer: synchronised steps, median ms
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    counts = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time / steps
            counts[e.name] += 1 / steps
    cats = collections.Counter()
    for name, us in kernels.items():
        cats[category(name)] += us
    print(f"\n## {kind}, {case} {str(dtype).split('.')[-1]}, {mode}, {which}: GPU {sum(kernels.values()) / 1e3:.2f} ms "
          f"a step, {round(sum(counts.values()))} kernels; wall {wall:.2f} ms")
    print("| category | ms a step |\n|---|---|")
    for c, us in cats.most_common():
        print(f"| {c} | {us / 1e3:.3f} |")
    print("| kernel | calls a step | ms a step |\n|---|---|---|")
    for name, us in kernels.most_common(rows):
        print(f"| {name[:110]} | {counts[name]:.0f} | {us / 1e3:.3f} |")
    return {c: us / 1e3 for c, us in cats.items()}


def main(argv=None):
    from bench_resnet_dcn import add_route_args, apply_route_args, resnet50_base

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="b32-224:bfloat16", help="case:dtype, as bench_resnet_dcn.py's --cases")
    ap.add_argument("--nets", nargs="+", default=["plain", "deformconv"])
    ap.add_argument("--modes", nargs="+", default=["eager", "default"], choices=["eager", "default"])
    ap.add_argument("--steps-of", nargs="+", default=["train"], choices=["train", "infer"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    add_route_args(ap)
    args = ap.parse_args(argv)
    apply_route_args(args)
    base = resnet50_base()
    case, dt = args.case.split(":")
    for which in args.steps_of:
        for mode in args.modes:
            for kind in args.nets:
                profile_step(kind, base, case, getattr(torch, dt), mode, args.steps, args.rows, which)


if __name__ == "__main__":
    main()
