"""Peak memory of one forward+backward on the CPU: deformconv's cpu backend beside torchvision.ops.deform_conv2d and
F.conv2d, at the CPU benchmark's layers (deformconv bench --device cpu).

    python benchmarks/cpu_peak_memory.py [--dtypes float32 bfloat16] [--out PATH]

Each case runs in a fresh process: its inputs are made, the peak resident set size is reset (/proc/self/clear_refs),
two forward+backward steps run, and the peak above the resident size before the first step is the case's memory:
everything the steps needed at once, the memory deformconv keeps for reuse between calls included. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

SHAPES = ("cpu-32", "cpu-56", "resnet-c4-b2")
IMPLS = ("deformconv", "torchvision", "conv2d")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _child(impl: str, shape: str, dtype_name: str) -> None:
    import torch
    import torch.nn.functional as F

    from deformconv.benchmark import CPU_SHAPES as ALL

    n, cin, cout, h, w, k, og = ALL[shape]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)

    def leaf(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(dtype).requires_grad_(True)

    x, wt, b = leaf(n, cin, h, w), leaf(cout, cin, k, k), leaf(cout)
    off, m = leaf(n, 2 * og * k * k, h, w, scale=2.0), leaf(n, og * k * k, h, w)
    if impl == "deformconv":
        import deformconv

        def fwd():
            return deformconv.deform_conv2d(x, off, wt, b, padding=k // 2, mask=m, backend="cpu")
    elif impl == "torchvision":
        import torchvision

        def fwd():
            return torchvision.ops.deform_conv2d(x, off, wt, b, padding=k // 2, mask=m)
    else:
        def fwd():
            return F.conv2d(x, wt, b, padding=k // 2)
    gout = torch.randn(n, cout, h, w, generator=gen).to(dtype)
    base = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size to the current one
    for _ in range(2):
        fwd().backward(gout)
        for t in (x, wt, b, off, m):
            t.grad = None
    print(json.dumps(dict(peak_mib=round((_kib("VmHWM") - base) / 1024, 1))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child)
    import torch

    from deformconv.benchmark import environment, write_results

    rows = []
    for shape in SHAPES:
        for dt in args.dtypes:
            row = dict(shape=shape, dtype=dt)
            for impl in IMPLS:
                if impl == "torchvision" and dt == "bfloat16":
                    continue  # torchvision has no bfloat16 CPU kernel
                done = subprocess.run([sys.executable, __file__, "--child", impl, shape, dt], capture_output=True,
                                      text=True)
                if done.returncode:
                    row[f"{impl}_error"] = done.stderr.strip().splitlines()[-1][:200]
                else:
                    row[f"{impl}_peak_mib"] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nCPU, {torch.get_num_threads()} threads, torch {torch.__version__}: peak MiB of two forward+backward "
          "steps\n")
    print("| layer | dtype | deformconv | torchvision | F.conv2d |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [str(r.get(f"{i}_peak_mib", "-")) for i in IMPLS]
        print(f"| {r['shape']} | {r['dtype']} | " + " | ".join(cells) + " |")
    if args.out:
        env = dict(environment("cpu"), timer="fresh process per case; peak resident set size over two "
                   "forward+backward steps above the resident size before the first (/proc/self/clear_refs)")
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
