"""The Python host path of one eager call of each op, on any machine: microseconds a call of a tiny load with the
Triton kernels' launches stubbed out (Launch.__call__ does nothing), so that what is timed is the Python around them:
argument checks, fast-path tests, plan lookups, allocations, the autograd node. The kernels run under Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, set here), never launched; outputs are garbage and not read.

    python benchmarks/tools/host_paths.py [--calls 300] [--ops deform_conv2d dcnv3 dcnv4 ms_deform_attn deform_conv1d
                                                             deform_conv3d]

Rows: forward without grad, forward with grad, forward+backward (leaves' .grad reset to None each step, as a
training loop's zero_grad leaves them), each the median of 7 loops. A GPU host adds the launches and the CUDA
allocator's calls to these; host_cost.py times deform_conv2d there. Compare commits by running this at each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def _loop_us(step, calls: int) -> float:
    for _ in range(20):
        step()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _loads():
    """(op, forward callable, leaves): tiny loads (an InternImage late stage's groups, a 300-query decoder)."""
    import deformconv

    g = torch.Generator().manual_seed(0)
    x, off, w, b, m = (torch.randn(2, 16, 8, 8, generator=g), torch.randn(2, 18, 8, 8, generator=g),
                       torch.randn(16, 16, 3, 3, generator=g), torch.randn(16, generator=g),
                       torch.rand(2, 9, 8, 8, generator=g))
    yield "deform_conv2d", lambda: deformconv.deform_conv2d(x, off, w, b, padding=1, mask=m, backend="triton"), \
        [x, off, w, b, m]
    gr, d = 8, 16
    xi = torch.randn(2, 7, 7, gr * d, generator=g)
    o3, m3 = torch.randn(2, 7, 7, gr * 18, generator=g), torch.rand(2, 7, 7, gr * 9, generator=g)
    om = torch.randn(2, 7, 7, 3 * gr * 9, generator=g)
    params = (3, 3, 1, 1, 1, 1, 1, 1, gr, d, 1.0, 256, False)
    yield "dcnv3", lambda: deformconv.dcnv3(xi, o3, m3, *params, backend="triton"), [xi, o3, m3]
    yield "dcnv4", lambda: deformconv.dcnv4(xi, om, *params, backend="triton"), [xi, om]
    shapes = torch.tensor([[10, 15], [5, 8], [3, 4], [2, 2]])
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    value = torch.randn(2, int(sizes.sum()), 8, 32, generator=g)
    loc, attn = torch.rand(2, 300, 8, 4, 4, 2, generator=g), torch.rand(2, 300, 8, 4, 4, generator=g)
    yield "ms_deform_attn", lambda: deformconv.ms_deform_attn(value, shapes, starts, loc, attn, backend="triton"), \
        [value, loc, attn]
    x1, w1, b1 = torch.randn(2, 16, 32, generator=g), torch.randn(16, 16, 3, generator=g), torch.randn(16, generator=g)
    o1, m1 = torch.randn(2, 3, 32, generator=g), torch.rand(2, 3, 32, generator=g)
    yield "deform_conv1d", lambda: deformconv.deform_conv1d(x1, o1, w1, b1, padding=1, mask=m1, backend="triton"), \
        [x1, o1, w1, b1, m1]
    x3, w3 = torch.randn(1, 8, 4, 6, 6, generator=g), torch.randn(8, 8, 3, 3, 3, generator=g)
    o3d, m3d = torch.randn(1, 81, 4, 6, 6, generator=g), torch.rand(1, 27, 4, 6, 6, generator=g)
    yield "deform_conv3d", lambda: deformconv.deform_conv3d(x3, o3d, w3, None, padding=1, mask=m3d,
                                                            backend="triton"), [x3, o3d, w3, m3d]


def main(argv=None):
    from deformconv.config import options
    from deformconv.ops.common import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--ops", nargs="+", default=["deform_conv2d", "dcnv3", "dcnv4", "ms_deform_attn", "deform_conv1d",
                                                 "deform_conv3d"])
    args = ap.parse_args(argv)
    launch.Launch.__call__ = lambda self, *tensors: None  # the Python around the launches only
    options.layout_kernels_on_cpu = True  # layout copies through their (stubbed) kernels, as on a GPU
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}; us a call, launches stubbed\n")
    print("| op | forward, no grad | forward | forward+backward |")
    print("|---|---|---|---|")
    for op, fwd, leaves in _loads():
        if op not in args.ops:
            continue
        for t in leaves:
            t.requires_grad_(False)
        with torch.no_grad():
            no_grad = _loop_us(fwd, args.calls)
        for t in leaves:
            t.requires_grad_(True)
        gout = torch.randn_like(fwd())

        def step():
            fwd().backward(gout)
            for t in leaves:
                t.grad = None

        print(f"| {op} | {no_grad:.1f} | {_loop_us(fwd, args.calls):.1f} | {_loop_us(step, args.calls):.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
