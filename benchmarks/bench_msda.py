"""Multi-scale deformable attention on a GPU: deformconv's Triton kernels beside the plain-PyTorch reference.

    python benchmarks/bench_msda.py [--dtypes float32 bfloat16 float16] [--out PATH]

Loads (Deformable DETR, batch 2, M=8 heads, D=32, L=4 levels 100x150, 50x75, 25x38, 13x19, P=4): the encoder (every
pixel of every level a query, 20,568 queries) and the decoder (300 and 900 queries). Locations uniform over each
level (some outside), attention weights softmaxed. Forward and forward+backward (gradients of value, locations and
weights), `do_bench` medians of eager calls and of CUDA-graph replays; peak memory of one forward+backward; the
first call's time.

Deformable DETR's own CUDA kernel (its `models/ops`, fp32/fp64 only) joins as the `cuda` row where it is importable:
installed from its source with its own setup.py (`pip install --no-build-isolation --target DIR models/ops`, then
DIR on PYTHONPATH), which needs a CUDA toolkit. It compiles after `value.type()` becomes `value.scalar_type()` in its
two AT_DISPATCH lines (torch 2.x removed that conversion), also on a machine without a GPU as bench_dcnv.py says.
Nothing of it is part of this repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LEVELS = [(100, 150), (50, 75), (25, 38), (13, 19)]
LOADS = {"encoder": None, "decoder-300": 300, "decoder-900": 900}


def _inputs(queries, dtype):
    n, m, d, p = 2, 8, 32, 4
    shapes = torch.tensor(LEVELS, device="cuda")
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    lq = int(sizes.sum()) if queries is None else queries
    gen = torch.Generator(device="cuda").manual_seed(0)
    # every leaf a tensor of its own (clone): do_bench_cudagraph detaches its leaves in place, which a view refuses
    value = torch.randn(n, int(sizes.sum()), m, d, device="cuda", generator=gen).to(dtype).clone().requires_grad_()
    loc = (torch.rand(n, lq, m, len(LEVELS), p, 2, device="cuda", generator=gen) * 1.1 - 0.05).clone().requires_grad_()
    attn = torch.softmax(torch.randn(n, lq, m, len(LEVELS) * p, device="cuda", generator=gen), -1)
    attn = attn.view(n, lq, m, len(LEVELS), p).to(dtype).clone().requires_grad_()  # a leaf of its own, not a view
    return value, shapes, starts, loc, attn


def _peer():
    """Deformable DETR's MSDeformAttnFunction.apply where its extension is installed (see the docstring), else the
    reason it is not."""
    try:
        from functions import MSDeformAttnFunction  # Deformable DETR's models/ops package
    except Exception as e:  # not installed: the row is left out
        return None, f"{type(e).__name__}: {e}"[:160]
    return MSDeformAttnFunction.apply, None


def main(argv=None):
    from triton.testing import do_bench, do_bench_cudagraph

    import deformconv
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    peer, peer_missing = _peer()
    rows = []
    for load, queries in LOADS.items():
        for dt_name in args.dtypes:
            value, shapes, starts, loc, attn = _inputs(queries, getattr(torch, dt_name))
            row = dict(load=load, dtype=dt_name, queries=loc.shape[1])
            for backend in ("triton", "reference") + (("cuda",) if peer else ()):
                def fwd(backend=backend):
                    if backend == "cuda":
                        return peer(value, shapes, starts, loc, attn, 64)
                    return deformconv.ms_deform_attn(value, shapes, starts, loc, attn, backend=backend)

                try:
                    t0 = time.perf_counter()
                    gout = torch.randn_like(fwd())
                    torch.cuda.synchronize()
                    row[f"{backend}_first_call_s"] = round(time.perf_counter() - t0, 2)

                    def step(fwd=fwd):
                        fwd().backward(gout)

                    leaves = [value, loc, attn]
                    row[f"{backend}_fwd_ms"] = do_bench(fwd, return_mode="median")
                    row[f"{backend}_fb_ms"] = do_bench(step, grad_to_none=leaves, return_mode="median")
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    step()
                    torch.cuda.synchronize()
                    row[f"{backend}_fb_extra_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
                    if backend != "reference":  # GPU time, the host's share gone (the peer's too)
                        row[f"{backend}_fwd_graph_ms"] = do_bench_cudagraph(fwd, return_mode="median")
                        row[f"{backend}_fb_graph_ms"] = do_bench_cudagraph(step, grad_to_none=leaves,
                                                                           return_mode="median")
                except Exception as e:  # e.g. the reference out of memory at the encoder's size
                    row[f"{backend}_error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = environment(torch.device("cuda"))
    env["deformable_detr_cuda"] = "installed" if peer else f"not installed ({peer_missing})"
    print(f"\n{env.get('device')}, torch {torch.__version__}; medians in ms\n")
    print("| load | dtype | fwd eager / graph | fwd+bwd eager / graph | Deformable DETR CUDA fwd / fwd+bwd (eager; graph) "
          "| reference "
          "fwd / fwd+bwd | extra peak MiB (ours / CUDA) |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda r, k: "-" if k not in r else f"{r[k]:.3f}"  # noqa: E731
    for r in rows:
        print(f"| {r['load']} | {r['dtype']} | {fmt(r, 'triton_fwd_ms')} / {fmt(r, 'triton_fwd_graph_ms')} | "
              f"{fmt(r, 'triton_fb_ms')} / {fmt(r, 'triton_fb_graph_ms')} | {fmt(r, 'cuda_fwd_ms')} / "
              f"{fmt(r, 'cuda_fb_ms')}; {fmt(r, 'cuda_fwd_graph_ms')} / {fmt(r, 'cuda_fb_graph_ms')} | "
              f"{fmt(r, 'reference_fwd_ms')} / {fmt(r, 'reference_fb_ms')} | "
              f"{fmt(r, 'triton_fb_extra_peak_mib')} / {fmt(r, 'cuda_fb_extra_peak_mib')} |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
