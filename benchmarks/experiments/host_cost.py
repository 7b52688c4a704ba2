"""The per-call CPU cost of an eager forward+backward (what bounds the small shapes' eager times).

    PYTHONPATH=src python benchmarks/experiments/host_cost.py --shapes cls-14 det-s4 --profile

For each shape: the CPU time of a step (forward, then the backward of all five gradients) over ``--steps``
steps issued without a sync, and the wall time once the GPU has caught up (the larger of the two is the eager
step's time; a CPU time close to it means the step is CPU-bound), the CPU time of a forward alone, and the
number of GPU operations (kernels, copies, fills) a step launches. With ``--profile`` it also prints the
cProfile entries with the most own time and torch.profiler's table of one step's operations. Without a GPU it
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
import deformconv.ops.deform_conv2d as kernels
from common import add_shape_args, finish, layer_inputs, markdown, shapes_from_args


def measure(shape, dtype_name: str, device: torch.device, steps: int, profile: bool, log=print) -> dict:
    x, off, w, b, m, (stride, padding, dilation) = layer_inputs(shape, dtype_name, device)
    leaves = [t.requires_grad_(True) for t in (x, off, w, b, m)]

    def forward():
        return deformconv.deform_conv2d(leaves[0], leaves[1], leaves[2], leaves[3], stride, padding, dilation,
                                        mask=leaves[4], backend="triton")

    grad_out = torch.randn_like(forward())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        for t in leaves:
            t.grad = None
        forward().backward(grad_out)

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


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's and torch.profiler's tables")
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
            records.append(rec)
    rows = [[r["shape"], r["dtype"], f"{r['cpu_ms']:.3f}", f"{r['wall_ms']:.3f}", f"{r['fwd_cpu_ms']:.3f}",
             str(r["gpu_ops"]) if r["gpu_ops"] is not None else "-"] for r in records]
    return finish(records, args.out, markdown(["shape", "dtype", "CPU ms a step", "wall ms a step (synced)",
                                               "forward CPU ms", "GPU ops a step"], rows))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
