"""Benchmark deform_conv2d side by side with torchvision.ops.deform_conv2d and F.conv2d (cuDNN) on a GPU.

    python benchmarks/bench_deform_conv2d.py --out benchmarks/results/h200.jsonl   # appends the run to the H200's table

The five shapes of the H200 anchors (N, Cin, Cout, H, W, k, offset groups), all with a mask, padding k//2;
float16, bfloat16 and float32; forward and forward+backward (all five gradients), each a
``triton.testing.do_bench`` median on fresh signed random data; plus the first-call time of a new shape
(compile and config choice included) and the extra peak memory of one forward+backward. Writes
{"environment": {...GPU, versions, date}, "records": [...]} and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deformconv.benchmark import GPU_SHAPES, environment, memory_table, run, table, write_results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=list(GPU_SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    ap.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--out", help="a device's table (.jsonl: the run appended) or a .json file (the run alone)")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--deterministic", action="store_true",
                    help="also time deformconv forward+backward under torch.use_deterministic_algorithms(True)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU (python -m deformconv bench runs small shapes on the CPU)")
    shapes = {k: GPU_SHAPES[k] for k in args.shapes}
    records = run(shapes, args.dtypes, ["triton"], args.passes, "cuda", log=lambda r: print(json.dumps(r), flush=True),
                  deterministic=args.deterministic)
    env = environment("cuda")
    md = ("### Eager (`triton.testing.do_bench` median, ms)\n\n" + table(records)
          + "\n\n### CUDA-graph replay (`do_bench_cudagraph` median, ms): GPU time without per-call CPU cost "
          "(torchvision not replayed: see benchmark.py)\n\n"
          + table(records, "graph_ms")
          + "\n\n### Forward+backward memory (MiB): extra peak / workspace = the extra peak less the output and "
          "the gradients returned\n\n" + memory_table(records))
    if args.out:
        write_results(args.out, env, records)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")
    print(json.dumps(env))
    print(md)


if __name__ == "__main__":
    main()
