"""Time the kernels under each codegen profile (compat.CodegenProfile) with the installed Triton, side by side.

    python benchmarks/tools/codegen_profiles.py [--dtypes float16 ...] [--out PATH]

For every benchmark shape: forward and forward+backward, CUDA-graph medians (GPU time), with the profile of Triton
3.6 and of Triton 3.8 forced in turn; the two runs' outputs must agree within the dtype's rounding. A profile that
costs nothing on a Triton it was not written for can become the only spelling (docs/tuning.md, codegen profiles).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None):
    from triton.testing import do_bench_cudagraph

    import deformconv
    from deformconv.benchmark import GPU_SHAPES, environment, make_inputs, write_results
    from deformconv.compat import TRITON_3_6, TRITON_3_8
    from deformconv.config import options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=list(GPU_SHAPES))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for name in args.shapes:
        shape = GPU_SHAPES[name]
        k = shape[5]
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            x, off, w, b, m = make_inputs(shape, dtype, "cuda", requires_grad=True)
            g = torch.randn(x.shape[0], w.shape[0], x.shape[2], x.shape[3], device="cuda", dtype=dtype)
            row = dict(shape=name, dtype=dt)
            outs = {}
            for label, profile in (("3.6", TRITON_3_6), ("3.8", TRITON_3_8)):
                with options.override(profile=profile):
                    def fwd():
                        return deformconv.deform_conv2d(x, off, w, b, padding=k // 2, mask=m)

                    def fwd_bwd():
                        out = fwd()
                        out.backward(g)

                    with torch.no_grad():
                        outs[label] = fwd().float()
                    fwd_bwd()
                    torch.cuda.synchronize()
                    with torch.no_grad():
                        row[f"fwd_{label}"] = do_bench_cudagraph(fwd, rep=100, return_mode="median")
                    row[f"fb_{label}"] = do_bench_cudagraph(fwd_bwd, rep=100, grad_to_none=[x, off, w, b, m],
                                                            return_mode="median")
            eps = torch.finfo(dtype).eps if dtype != torch.float32 else 2e-3  # fp32 runs as TF32
            err = ((outs["3.6"] - outs["3.8"]).abs().max() / outs["3.6"].abs().max()).item()
            row["rel_diff"] = err
            assert err <= 4 * eps, f"{name} {dt}: profiles disagree by {err:.2e}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| shape | dtype | fwd 3.6-profile | fwd 3.8-profile | ratio | fwd+bwd 3.6-profile | fwd+bwd 3.8-profile "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['dtype']} | {r['fwd_3.6']:.3f} | {r['fwd_3.8']:.3f} "
              f"| {r['fwd_3.8'] / r['fwd_3.6']:.3f} "
              f"| {r['fb_3.6']:.3f} | {r['fb_3.8']:.3f} | {r['fb_3.8'] / r['fb_3.6']:.3f} |")
    if args.out:
        write_results(args.out, environment("cuda"), rows)


if __name__ == "__main__":
    main()
