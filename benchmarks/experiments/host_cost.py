"""The per-call CPU cost of an eager forward+backward (what bounds the small shapes' eager times).

    PYTHONPATH=src python benchmarks/experiments/host_cost.py --shapes cls-14 det-s4 --profile

For each shape: the CPU time of a step (forward, then the backward of all five gradients) over ``--steps``
steps issued without a sync, and the wall time once the GPU has caught up (the larger of the two is the eager
step's time; a CPU time close to it means the step is CPU-bound), the CPU time of a forward alone, and the
number of GPU operations (kernels, copies, fills) a step launches. With ``--profile`` it also prints the
cProfile entries with the most own time and torch.profiler's table of one step's operations. With ``--sections``
it prints each backend function's inclusive CPU time a step (timers wrapped around them, no profiler: what v20's
host analysis used, benchmarks/NOTES.md), and each kernel launch's (with or without TMA descriptor arguments). Without a GPU it
runs on the CPU (the kernels under TRITON_INTERPRET=1): only a smoke test (tests/test_experiments.py), unless
with ``--no-kernels``: the Triton kernels' launches are skipped (results are garbage), so a step times the
backend's host path alone: its Python, plans, checks and aten calls. On the CPU with tiny shapes that is the
Python to work on without a GPU (v19, the command below on a development CPU: 0.47 ms a fwd+bwd step, 0.09 ms
a forward; the device's host took 1.4-1.7 ms a step at cls-14 and det-s5 with its kernels and CUDA launches).

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/experiments/host_cost.py --shape 2,16,16,8,8,3,1 \
        --dtypes float32 --steps 500 --no-kernels --profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time
from typing import List

import torch

import deformconv
import deformconv.eager as eager
import deformconv.functional as functional
import deformconv.library as library
import deformconv.ops.deform_conv2d as kernels
from common import add_shape_args, finish, layer_inputs, markdown, shapes_from_args


def layer_step(shape, dtype_name: str, device: torch.device):
    """(forward, step) of the benchmark layer on fresh inputs: the Triton forward, and an eager forward+backward of all
    five gradients (the leaves' grads reset first)."""
    x, off, w, b, m, (stride, padding, dilation) = layer_inputs(shape, dtype_name, device)
    leaves = [t.requires_grad_(True) for t in (x, off, w, b, m)]

    def forward():
        return deformconv.deform_conv2d(leaves[0], leaves[1], leaves[2], leaves[3], stride, padding, dilation,
                                        mask=leaves[4], backend="triton")

    grad_out = torch.randn_like(forward())

    def step():
        for t in leaves:
            t.grad = None
        forward().backward(grad_out)

    return forward, step


def measure(shape, dtype_name: str, device: torch.device, steps: int, profile: bool, log=print) -> dict:
    forward, step = layer_step(shape, dtype_name, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    with torch.no_grad():
        t3 = time.perf_counter()
        for _ in range(steps):
            forward()
        t4 = time.perf_counter()
    sync()
    rec = dict(cpu_ms=1e3 * (t1 - t0) / steps, wall_ms=1e3 * (t2 - t0) / steps, fwd_cpu_ms=1e3 * (t4 - t3) / steps)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
        sync()
    gpu_ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    rec["gpu_ops"] = len(gpu_ops) if device.type == "cuda" else None
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            step()
        pr.disable()
        sync()
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(20)
        log(text.getvalue())
        log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return rec


def time_sections(shape, dtype_name: str, device: torch.device, steps: int, log=print) -> dict:
    """steps eager fwd+bwd steps (after 3 untimed) with sections_timed; prints sections_table and returns label -> CPU us
    a step."""
    _, step = layer_step(shape, dtype_name, device)
    for _ in range(3):
        step()
    totals: dict = {}
    with sections_timed(totals):
        for _ in range(steps):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"\n{shape} {dtype_name}: inclusive CPU time a step\n\n" + sections_table(totals, steps))
    return {label: 1e6 * sec / steps for label, (sec, _) in totals.items()}


@contextlib.contextmanager
def launches_skipped(skip: bool):
    """With skip, every Triton launch of the backend (kernels._Launch) does nothing until the block ends."""
    if not skip:
        yield
        return
    call = kernels._Launch.__call__
    kernels._Launch.__call__ = lambda self, *tensors: None
    try:
        yield
    finally:
        kernels._Launch.__call__ = call


# Backend functions timed by --sections: (module, name); calls from inside the package go through these attributes.
SECTION_FUNCTIONS = [(kernels, n) for n in (
    "deform_conv2d_forward", "deform_conv2d_backward", "_backward_images", "_channel_sum", "_nhwc", "pack_weight",
    "_finish_grads", "_from_offset_grouped", "_plan_key", "_weight_descriptor", "_grad_out_descriptor",
    "concurrent_backward", "backward_chunk_images", "geometry_from_tensors")] + [
    (functional, "check_deform_conv2d_args"), (functional, "fast_path_ok"), (eager, "forward_impl"),
    (eager, "backward_impl"), (library, "_backend_for")]


@contextlib.contextmanager
def sections_timed(totals: dict):
    """While the block runs, totals[label] accumulates [seconds, calls] of each SECTION_FUNCTIONS entry and of each
    Triton launch of the backend ("launch <kernel>", "+desc" when a TMA descriptor is among its arguments)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in SECTION_FUNCTIONS]
    call = kernels._Launch.__call__

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals.setdefault(label, [0.0, 0])
                entry[0] += time.perf_counter() - t0
                entry[1] += 1
        return wrapper

    def timed_launch(self, *tensors):
        label = "launch " + self.fn.__name__ + (" +desc" if any(type(t).__name__ == "TensorDescriptor" for t in tensors)
                                                else "")
        timed(lambda: call(self, *tensors), label)()

    for mod, name, fn in saved:
        setattr(mod, name, timed(fn, name))
    kernels._Launch.__call__ = timed_launch
    try:
        yield totals
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
        kernels._Launch.__call__ = call


def sections_table(totals: dict, steps: int) -> str:
    """Markdown: each timed section's inclusive CPU us a step and calls a step, costliest first."""
    rows = [[label, f"{1e6 * sec / steps:.1f}", f"{calls / steps:g}"]
            for label, (sec, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])]
    return markdown(["section", "CPU us a step (inclusive)", "calls a step"], rows)


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's and torch.profiler's tables")
    ap.add_argument("--sections", action="store_true",
                    help="also time each backend function and kernel launch a step (inclusive CPU time, no profiler)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip the Triton kernels' launches: time the host path alone (results are garbage)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = []
    for name, shape in shapes_from_args(args).items():
        for dtype_name in args.dtypes:
            with launches_skipped(args.no_kernels):
                rec = dict(shape=name, dtype=dtype_name, no_kernels=args.no_kernels,
                           **measure(shape, dtype_name, device, args.steps, args.profile))
                if args.sections:
                    rec["sections_us"] = time_sections(shape, dtype_name, device, args.steps)
            records.append(rec)
    rows = [[r["shape"], r["dtype"], f"{r['cpu_ms']:.3f}", f"{r['wall_ms']:.3f}", f"{r['fwd_cpu_ms']:.3f}",
             str(r["gpu_ops"]) if r["gpu_ops"] is not None else "-"] for r in records]
    return finish(records, args.out, markdown(["shape", "dtype", "CPU ms a step", "wall ms a step (synced)",
                                               "forward CPU ms", "GPU ops a step"], rows))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
