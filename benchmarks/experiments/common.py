"""What the experiment scripts share: their shape/dtype/output arguments, the benchmark inputs of a shape, the
agreement check between two runs' results, CUDA-graph timing, and writing the records out."""

from __future__ import annotations

import argparse
import json
from typing import List, Sequence

import torch

from deformconv.benchmark import DTYPES, GPU_SHAPES, make_inputs


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--shapes / --shape, --dtypes and --out."""
    ap.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=list(GPU_SHAPES))
    ap.add_argument("--shape", help="instead of --shapes: one shape N,Cin,Cout,H,W,k,offset_groups")
    ap.add_argument("--dtypes", nargs="+", default=["float16"], choices=list(DTYPES))
    ap.add_argument("--out", help="write the records here as JSON")


def shapes_from_args(args: argparse.Namespace) -> dict:
    """name -> shape tuple, from --shape if given, else --shapes."""
    if args.shape:
        return {"custom": tuple(int(v) for v in args.shape.split(","))}
    return {k: GPU_SHAPES[k] for k in args.shapes}


def layer_inputs(shape, dtype_name: str, device: torch.device):
    """(input, offset, weight, bias, mask, (stride, padding, dilation)) of the benchmark's stride-1, padding
    k//2 layer of this shape."""
    x, off, w, b, m = make_inputs(shape, DTYPES[dtype_name], device)
    pad = shape[5] // 2
    return x, off, w, b, m, ((1, 1), (pad, pad), (1, 1))


def max_rel_err(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """Largest max|out - ref| / max|ref| over the pairs (in float64)."""
    return max(((o.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30)).item()
               for o, r in zip(outs, refs))


def graph_ms(fn) -> float:
    """fn's do_bench median replayed from a CUDA graph: GPU time, without the host's per-call cost."""
    from triton.testing import do_bench
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=50, rep=300)


def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of these column names and rows of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def finish(records: List[dict], out: str, table: str) -> List[dict]:
    """Write the records as JSON to out (if given), print the table last."""
    if out:
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    print(table)
    return records
