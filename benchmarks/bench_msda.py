"""Multi-scale deformable attention on a GPU: deformconv's Triton kernels beside the plain-PyTorch reference and the
peers.

    python benchmarks/bench_msda.py [--dtypes float32 bfloat16 float16] [--loads ...] [--backends ...] [--out PATH]

Loads (M=8 heads, D=32, P=4): Deformable DETR's (batch 2, L=4 levels 100x150, 50x75, 25x38, 13x19) encoder (every
pixel of every level a query, 20,568 queries) and decoder (300 and 900 queries); Mask2Former's pixel decoder (L=3
levels at strides 8-32, every pixel a query) at 512x512 (batch 4, 5,376 queries) and 1024x1024 (batch 1, 21,504). The
`host` load (batch 1, two levels 8x8 and 4x4, 16 queries) keeps the GPU idle: its eager time is the host's time a call
(the CUDA-graph time beside it is the GPU's). Locations uniform over each level (some outside), attention weights
softmaxed. Forward and forward+backward (gradients of value, locations and weights), `do_bench` medians of eager calls
and of CUDA-graph replays; peak memory of one forward+backward; the first call's time. A dtype `autocast-bfloat16` (or
`autocast-float16`) runs fp32 inputs under autocast, as a model's step under autocast does.

transformers' own attention (Deformable DETR's module: a `grid_sample` a level) joins as `transformers` where
transformers is importable; deformops' Triton and CUDA backends join as `deformops_triton` and `deformops_cuda` where
deformops is importable (its wheel is pure Python; the CUDA backend compiles on first use). Deformable DETR's own CUDA
kernel (its `models/ops`, fp32/fp64 only) joins as the `cuda` row where it is importable: installed from its source
with its own setup.py (`pip install --no-build-isolation --target DIR models/ops`, then DIR on PYTHONPATH), which
needs a CUDA toolkit. It compiles after `value.type()` becomes `value.scalar_type()` in its two AT_DISPATCH lines
(torch 2.x removed that conversion), also on a machine without a GPU as bench_dcnv.py says.
Nothing of it is part of this repository.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LEVELS = [(100, 150), (50, 75), (25, 38), (13, 19)]
M2F_512 = [(64, 64), (32, 32), (16, 16)]  # Mask2Former's pixel decoder (strides 8-32) at 512x512
M2F_1024 = [(128, 128), (64, 64), (32, 32)]
# load: (batch, levels, queries: None for every pixel of every level, the encoder's)
LOADS = {"encoder": (2, LEVELS, None), "decoder-300": (2, LEVELS, 300), "decoder-900": (2, LEVELS, 900),
         "m2f-pixel-decoder-512": (4, M2F_512, None), "m2f-pixel-decoder-1024": (1, M2F_1024, None),
         "host": (1, [(8, 8), (4, 4)], 16)}


def _inputs(load, dtype):
    n, levels, queries = LOADS[load]
    m, d, p = 8, 32, 4
    shapes = torch.tensor(levels, device="cuda")
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    lq = int(sizes.sum()) if queries is None else queries
    gen = torch.Generator(device="cuda").manual_seed(0)
    # every leaf a tensor of its own (clone): do_bench_cudagraph detaches its leaves in place, which a view refuses
    value = torch.randn(n, int(sizes.sum()), m, d, device="cuda", generator=gen).to(dtype).clone().requires_grad_()
    loc = (torch.rand(n, lq, m, len(levels), p, 2, device="cuda", generator=gen) * 1.1 - 0.05).clone().requires_grad_()
    attn = torch.softmax(torch.randn(n, lq, m, len(levels) * p, device="cuda", generator=gen), -1)
    attn = attn.view(n, lq, m, len(levels), p).to(dtype).clone().requires_grad_()  # a leaf of its own, not a view
    return value, shapes, starts, loc, attn


def _deformops():
    """deformops' msda with a backend of its own ("triton" or "cuda"), where deformops is importable."""
    try:
        from deformops.registry import Backend, msda
    except Exception as e:
        return {}, f"{type(e).__name__}: {e}"[:160]

    def on(backend):
        return lambda value, shapes, starts, loc, attn: msda(value, shapes, starts, loc, attn, backend=backend)

    return {"deformops_triton": on(Backend.TRITON), "deformops_cuda": on(Backend.CUDA)}, None


def _peer():
    """Deformable DETR's MSDeformAttnFunction.apply where its extension is installed (see the docstring), else the
    reason it is not."""
    try:
        from functions import MSDeformAttnFunction  # Deformable DETR's models/ops package
    except Exception as e:  # not installed: the row is left out
        return None, f"{type(e).__name__}: {e}"[:160]
    return MSDeformAttnFunction.apply, None


def _transformers():
    """transformers' own attention (Deformable DETR's module: a grid_sample a level), where transformers is
    importable."""
    try:
        from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:160]
    return MultiScaleDeformableAttention(), None


def main(argv=None):
    from triton.testing import do_bench, do_bench_cudagraph

    import deformconv
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                    choices=["float32", "bfloat16", "float16", "autocast-bfloat16", "autocast-float16"])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--backends", nargs="+", default=["triton", "reference", "transformers", "cuda",
                                                      "deformops_triton", "deformops_cuda"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    peer, peer_missing = _peer()
    deformops, deformops_missing = _deformops()
    hf, hf_missing = _transformers()
    rows = []
    for load in args.loads:
        for dt_name in args.dtypes:
            amp = dt_name.startswith("autocast-")
            value, shapes, starts, loc, attn = _inputs(load, torch.float32 if amp else getattr(torch, dt_name))
            amp_dtype = getattr(torch, dt_name.split("-")[-1])
            row = dict(load=load, dtype=dt_name, queries=loc.shape[1])
            backends = [b for b in args.backends if b not in ("cuda",) or peer]
            backends = [b for b in backends if not b.startswith("deformops") or b in deformops]
            backends = [b for b in backends if b != "transformers" or hf]
            hf_shapes = [tuple(level) for level in LOADS[load][1]]
            for backend in backends:
                def fwd(backend=backend):
                    with torch.autocast("cuda", amp_dtype, enabled=amp):
                        return _call(backend)

                def _call(backend):
                    if backend == "cuda":
                        return peer(value, shapes, starts, loc, attn, 64)
                    if backend == "transformers":
                        return hf(value, shapes, hf_shapes, starts, loc, attn, 64)
                    if backend in deformops:
                        return deformops[backend](value, shapes, starts, loc, attn)
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
    env["deformops"] = "importable" if deformops else f"not importable ({deformops_missing})"
    env["transformers"] = "importable" if hf else f"not importable ({hf_missing})"
    print(f"\n{env.get('device')}, torch {torch.__version__}; medians in ms, eager / CUDA-graph replay\n")
    measured = [b for b in args.backends if any(f"{b}_fb_ms" in r for r in rows)]
    fmt = lambda r, k: "-" if k not in r else f"{r[k]:.3f}"  # noqa: E731
    print("| load | dtype | " + " | ".join(f"{b} fwd | {b} fwd+bwd" for b in measured) + " |")
    print("|---|---|" + "---|---|" * len(measured))
    for r in rows:
        cells = [f"{fmt(r, f'{b}_fwd_ms')} / {fmt(r, f'{b}_fwd_graph_ms')} | "
                 f"{fmt(r, f'{b}_fb_ms')} / {fmt(r, f'{b}_fb_graph_ms')}" for b in measured]
        print(f"| {r['load']} | {r['dtype']} | " + " | ".join(cells) + " |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
