"""The N-d forms on a GPU: deform_conv3d, deform_conv1d and the transposed forms beside the dense floor (cuDNN's
F.conv3d / conv1d / conv_transpose*d of the same shape, channels as given) and tvdcn where it is importable.

    python benchmarks/bench_deform_conv_nd.py [--dtypes float32 bfloat16] [--loads ...] [--out PATH]

Loads (issue #66): a D3Dnet-like video layer (2×64→64, 7×64×64, 3×3×3), a 3D U-Net block (1×32→32, 64³, 3×3×3),
a 1D sequence layer (8×256→256, 1024, k 5) and a 3D decoder's transposed layer (1×64→32, 32³ → 64³, k 4, stride 2).
Offsets normal × 2 voxels, a mask uniform in (0, 1). Forward and forward+backward (every gradient), `do_bench` medians
of eager calls and `do_bench_cudagraph` medians of CUDA-graph replays; the extra peak memory of one forward+backward;
ours split by kernel kind (torch.profiler: sampling, its gradient, GEMMs, the rest) and timed without the input's
gradient (its scatter's share). tvdcn (inspiros/tvdcn, built from its sources on the machine: `pip install
--no-build-isolation .` with a CUDA toolkit) joins as the `tvdcn` row where `import tvdcn` works; it computes in fp32
and fp64 only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

# name: (rank, transposed, N, Cin, Cout, size, kernel, stride, padding, output_padding)
LOADS = {
    "d3dnet-like": (3, False, 2, 64, 64, (7, 64, 64), 3, 1, 1, 0),
    "unet3d-block": (3, False, 1, 32, 32, (64, 64, 64), 3, 1, 1, 0),
    "sequence-1d": (1, False, 8, 256, 256, (1024,), 5, 1, 2, 0),
    "decoder3d-transposed": (3, True, 1, 64, 32, (32, 32, 32), 4, 2, 1, 0),
}


def _inputs(load, dtype):
    rank, transposed, n, cin, cout, size, k, stride, pad, out_pad = LOADS[load]
    gen = torch.Generator(device="cuda").manual_seed(0)
    kernel = (k,) * rank
    K = k ** rank
    if transposed:
        positions = list(size)
        weight = torch.randn(cin, cout, *kernel, device="cuda", generator=gen) / math.sqrt(cin * K)
    else:
        positions = [(s + 2 * pad - k) // stride + 1 for s in size]
        weight = torch.randn(cout, cin, *kernel, device="cuda", generator=gen) / math.sqrt(cin * K)
    x = torch.randn(n, cin, *size, device="cuda", generator=gen)
    offset = torch.randn(n, rank * K, *positions, device="cuda", generator=gen) * 2
    mask = torch.rand(n, K, *positions, device="cuda", generator=gen)
    bias = torch.randn(cout, device="cuda", generator=gen)
    return [t.to(dtype).requires_grad_() for t in (x, offset, weight, bias, mask)]


def _calls(load):
    """{name: fn(x, offset, weight, bias, mask)} for deformconv, the dense floor and tvdcn (where importable)."""
    import deformconv

    rank, transposed, *_, k, stride, pad, out_pad = LOADS[load]
    if transposed:
        ours = getattr(deformconv, f"deform_conv_transpose{rank}d")
        dense = getattr(F, f"conv_transpose{rank}d")
        calls = {"deformconv": lambda x, o, w, b, m: ours(x, o, w, b, stride, pad, out_pad, 1, m),
                 "dense": lambda x, o, w, b, m: dense(x, w, b, stride, pad, out_pad)}
    else:
        ours = getattr(deformconv, f"deform_conv{rank}d")
        dense = getattr(F, f"conv{rank}d")
        calls = {"deformconv": lambda x, o, w, b, m: ours(x, o, w, b, stride, pad, 1, m),
                 "dense": lambda x, o, w, b, m: dense(x, w, b, stride, pad)}
    try:
        import tvdcn

        fn = getattr(tvdcn.ops, f"deform_conv_transpose{rank}d" if transposed else f"deform_conv{rank}d")
        # its ops take per-axis lists only (an int fails its schema), dilation and groups given
        st, pd, opd, dil = [stride] * rank, [pad] * rank, [out_pad] * rank, [1] * rank
        if transposed:
            calls["tvdcn"] = lambda x, o, w, b, m: fn(x, w, o, m, b, st, pd, opd, dil, 1)
        else:
            calls["tvdcn"] = lambda x, o, w, b, m: fn(x, w, o, m, b, st, pd, dil, 1)
    except Exception as e:  # not installed: the row is left out
        print(f"tvdcn: {type(e).__name__}: {e}"[:200], file=sys.stderr)
    return calls


def _phases(fb) -> dict:
    """GPU time (ms) of one forward+backward by kernel kind, from torch.profiler: the sampling kernel, its gradient's,
    the GEMMs (cuBLAS), the rest (copies, fills, casts, the bias)."""
    from torch.profiler import ProfilerActivity, profile

    fb()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fb()
        torch.cuda.synchronize()
    phases = dict(sampling=0.0, sampling_grad=0.0, gemm=0.0, other=0.0)
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        low = e.name.lower()
        kind = ("sampling_grad" if low.startswith("_columns_grad_kernel") else "sampling"
                if low.startswith("_columns_kernel") else "gemm"
                if any(k in low for k in ("gemm", "sm90", "xmma", "cutlass", "splitk")) else "other")
        phases[kind] += e.device_time / 1e3
    return {k: round(v, 4) for k, v in phases.items()}


def main(argv=None):
    from triton.testing import do_bench, do_bench_cudagraph

    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    rows = []
    for load in args.loads:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            leaves = _inputs(load, dtype)
            for name, fn in _calls(load).items():
                row = dict(load=load, dtype=dt, impl=name)
                try:
                    out = fn(*leaves)
                    gout = torch.randn_like(out)
                    del out  # a live autograd graph would tie a captured backward to the default stream

                    def fb():
                        return torch.autograd.grad(fn(*leaves), leaves if name != "dense" else
                                                   [leaves[0], leaves[2], leaves[3]], gout)

                    row["fwd_ms"] = do_bench(lambda: fn(*leaves), return_mode="median")
                    row["fb_ms"] = do_bench(fb, return_mode="median")
                    row["fwd_graph_ms"] = do_bench_cudagraph(lambda: fn(*leaves), return_mode="median")
                    row["fb_graph_ms"] = do_bench_cudagraph(fb, return_mode="median")
                    if name == "deformconv":
                        row["fb_phases_ms"] = _phases(fb)
                        rest = [t for i, t in enumerate(leaves) if i != 0]  # the input's gradient's share: without it

                        def fb_no_input(rest=rest):
                            return torch.autograd.grad(fn(leaves[0].detach(), *rest), rest, gout)

                        row["fb_no_input_grad_graph_ms"] = do_bench_cudagraph(fb_no_input, return_mode="median")
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fb()
                    torch.cuda.synchronize()
                    row["fb_extra_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
                except Exception as e:  # an implementation that fails here (tvdcn in bf16): recorded
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| load | dtype | impl | fwd ms | fwd graph ms | fwd+bwd ms | fwd+bwd graph ms | extra peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("fwd_ms", "fwd_graph_ms", "fb_ms", "fb_graph_ms")]
        print(f"| {r['load']} | {r['dtype']} | {r['impl']} | " + " | ".join(cells)
              + f" | {r.get('fb_extra_peak_mib', float('nan')):.0f} |" + (f" {r['error']}" if "error" in r else ""))
    if args.out:
        write_results(args.out, environment(torch.device("cuda")), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
