"""DCNv3 / DCNv4 on a GPU: deformconv's Triton kernels beside the plain-PyTorch reference and the floor, a depthwise
3x3 F.conv2d (cuDNN, channels_last) of the same size.

    python benchmarks/bench_dcnv.py [--dtypes float16 bfloat16] [--out PATH]

Shapes (N, H, W, G, D): DCNv4's own benchmark layer (64, 56, 56, 4, 32) and InternImage-T's four stages at batch
64 and 224^2 (channels 64/128/256/512, groups 4/8/16/32). 3x3, stride 1, padding 1, offsets normal x 2 px,
aggregation weights softmaxed. Forward and forward+backward (gradients of input, offsets and weights; the conv's of
input and weight), `do_bench` medians of eager calls and `do_bench_cudagraph` medians of CUDA-graph replays.

DCNv4's and DCNv3's own CUDA kernels join as the `dcnv4_cuda` and `dcnv3_cuda` rows where they are importable:
installed from their sources with their own setup.py (`pip install --no-build-isolation --target DIR DCNv4_op`,
likewise InternImage's `classification/ops_dcnv3` into another DIR, then the DIR on PYTHONPATH), which needs a CUDA
toolkit. DCNv4_op (OpenGVLab/DCNv4 at 4b848f7) compiles as published; ops_dcnv3 after `input.type()` becomes
`input.scalar_type()` in its two AT_DISPATCH lines (torch 2.x removed that conversion), and its functions import
after `pkg_resources` (gone from recent setuptools) gives way to `importlib.metadata`. Both build on a machine
without a GPU for one that has it: in a virtual environment with that machine's Python and torch, setup.py's
`torch.cuda.is_available()` test dropped, `TORCH_CUDA_ARCH_LIST=9.0`, and `CPATH` at the nvidia wheels' include
folder (cusparse.h). Nothing of them is part of this repository.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = {
    "dcnv4-bench": (64, 56, 56, 4, 32),
    "internimage-t-s1": (64, 56, 56, 4, 16),
    "internimage-t-s2": (64, 28, 28, 8, 16),
    "internimage-t-s3": (64, 14, 14, 16, 16),
    "internimage-t-s4": (64, 7, 7, 32, 16),
}


def _inputs(shape, dtype, op):
    n, h, w, g, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, w, g * d, device="cuda", generator=gen).to(dtype).requires_grad_()
    offset = (torch.randn(n, h, w, g * 9 * 2, device="cuda", generator=gen) * 2).to(dtype)
    mask = torch.softmax(torch.randn(n, h, w, g, 9, device="cuda", generator=gen), -1).reshape(n, h, w, -1).to(dtype)
    if op == "dcnv4":
        import deformconv

        return [x, deformconv.dcnv3_to_dcnv4(offset, mask, g).requires_grad_()]
    return [x, offset.requires_grad_(), mask.requires_grad_()]


def _peers() -> dict:
    """{name: Function.apply or the reason it is missing} for the published CUDA kernels (see the docstring). Both
    take the same arguments as deformconv.dcnv4 / dcnv3."""
    found = {}
    try:
        from DCNv4.functions import DCNv4Function  # FlashInternImage's DCNv4_op
        found["dcnv4_cuda"] = DCNv4Function.apply
    except Exception as e:  # not installed: the row is left out
        found["dcnv4_cuda"] = f"{type(e).__name__}: {e}"[:160]
    try:
        from functions import DCNv3Function  # InternImage's ops_dcnv3 package
        found["dcnv3_cuda"] = DCNv3Function.apply
    except Exception as e:
        found["dcnv3_cuda"] = f"{type(e).__name__}: {e}"[:160]
    return found


def main(argv=None):
    from triton.testing import do_bench, do_bench_cudagraph

    import deformconv
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    peers = _peers()
    rows = []
    for name in args.shapes:
        n, h, w, g, d = shape = SHAPES[name]
        for dt_name in args.dtypes:
            dtype = getattr(torch, dt_name)
            row = dict(shape=name, dtype=dt_name, N=n, H=h, W=w, G=g, D=d)
            conv_x = torch.randn(n, g * d, h, w, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
            conv_x.requires_grad_()
            conv_w = torch.randn(g * d, 1, 3, 3, device="cuda", dtype=dtype, requires_grad=True)
            fns = {"conv_dw": ([conv_x, conv_w], lambda a, b: F.conv2d(a, b, padding=1, groups=g * d))}
            for op in ("dcnv3", "dcnv4"):
                for backend in ("triton", "reference"):
                    leaves = _inputs(shape, dtype, op)
                    f = getattr(deformconv, op)
                    fns[f"{op}_{backend}"] = (leaves, lambda *t, f=f, backend=backend: f(
                        *t, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256, False, backend=backend))
                peer = peers[f"{op}_cuda"]
                if callable(peer):
                    fns[f"{op}_cuda"] = (_inputs(shape, dtype, op), lambda *t, peer=peer: peer(
                        *t, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256, False))
            for impl, (leaves, fn) in fns.items():
                try:  # a published kernel may refuse a dtype (DCNv3's bf16; DCNv4's bf16 backward)
                    gout = torch.randn_like(fn(*leaves))
                    row[f"{impl}_fwd_ms"] = do_bench(lambda: fn(*leaves), return_mode="median")
                    step = lambda: fn(*leaves).backward(gout)  # noqa: E731
                    row[f"{impl}_fb_ms"] = do_bench(step, grad_to_none=leaves, return_mode="median")
                    if not impl.endswith("reference"):
                        row[f"{impl}_fwd_graph_ms"] = do_bench_cudagraph(lambda: fn(*leaves), return_mode="median")
                        row[f"{impl}_fb_graph_ms"] = do_bench_cudagraph(step, grad_to_none=leaves, return_mode="median")
                except Exception as e:  # e.g. out of memory in the reference
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = environment(torch.device("cuda"))
    env.update({k: "installed" if callable(v) else f"not installed ({v})" for k, v in peers.items()})
    print(f"\n{env.get('device')}, torch {torch.__version__}; medians in ms (eager / CUDA graph)\n")
    print("| shape | dtype | dcnv3 fwd | dcnv4 fwd | DCNv3 CUDA fwd | DCNv4 CUDA fwd | dw conv fwd | dcnv3 fwd+bwd | "
          "dcnv4 fwd+bwd | DCNv3 CUDA fwd+bwd | DCNv4 CUDA fwd+bwd | dw conv fwd+bwd | reference fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda r, k: "-" if k not in r else f"{r[k]:.3f}"  # noqa: E731
    for r in rows:
        impls = ("dcnv3_triton", "dcnv4_triton", "dcnv3_cuda", "dcnv4_cuda", "conv_dw")
        cells = [f"{fmt(r, f'{i}_fwd_ms')} / {fmt(r, f'{i}_fwd_graph_ms')}" for i in impls]
        cells += [f"{fmt(r, f'{i}_fb_ms')} / {fmt(r, f'{i}_fb_graph_ms')}" for i in impls]
        cells.append(fmt(r, "dcnv3_reference_fb_ms"))
        print(f"| {r['shape']} | {r['dtype']} | " + " | ".join(cells) + " |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
