"""Time the backward's parts side by side: the backward asked for subsets of the gradients.

    PYTHONPATH=src python benchmarks/experiments/backward_parts.py --shapes det-s3 hires-g8 --dtypes float16

The Triton backward computes only the gradients it is asked for, so asking for subsets splits its time:
"input" is the grad_input/offset/mask kernel doing grad_input alone (its atomics, no corner loads),
"offset+mask" the same kernel without grad_input (no atomics), "input+offset+mask" the whole kernel,
"weight" the grad_weight kernel, "all" the full backward (plus the bias reduction); "fwd" the forward for
scale. Each part's gradients are checked against the same gradients of "all" (max |diff| / max |ref|:
grad_input's float atomics may add in another order on a GPU, nothing more), and timed with
``triton.testing.do_bench_cudagraph`` (median). Prints a table, last; ``--out`` writes the records as JSON.
Results of 2026-12-02 are in benchmarks/NOTES.md (v6).

Without a GPU (TRITON_INTERPRET=1) it runs on the CPU and only checks: a smoke test (tests/test_experiments.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import List

import torch

import deformconv.ops.deform_conv2d as K
from common import add_shape_args, finish, layer_inputs, markdown, max_rel_err, shapes_from_args

GRADS = ("input", "offset", "mask", "weight", "bias")
PARTS = {"input": "input", "offset+mask": "offset mask", "input+offset+mask": "input offset mask",
         "weight": "weight", "all": "input offset mask weight bias"}


def run(shapes: dict, dtypes: List[str], device: torch.device, log=print) -> List[dict]:
    records = []
    for (shape_name, shape), dtype_name in itertools.product(shapes.items(), dtypes):
        x, off, w, b, m, geom = layer_inputs(shape, dtype_name, device)
        go = torch.randn_like(K.deform_conv2d_forward(x, off, w, b, m, *geom))
        steps = {part: (lambda needs=[g in names.split() for g in GRADS]:
                        K.deform_conv2d_backward(go, x, off, w, m, *geom, needs))
                 for part, names in PARTS.items()}
        steps["fwd"] = lambda: (K.deform_conv2d_forward(x, off, w, b, m, *geom),)
        full = steps["all"]()
        for part, step in steps.items():
            rec = dict(shape=shape_name, dtype=dtype_name, part=part)
            outs = step()
            if part != "fwd":
                rec["max_rel_err"] = max_rel_err(*zip(*((o, r) for o, r in zip(outs, full) if o is not None)))
            if device.type == "cuda":
                from triton.testing import do_bench_cudagraph

                rec["graph_ms"] = do_bench_cudagraph(step, rep=40, return_mode="median")
            records.append(rec)
            log(json.dumps(rec))
    return records


def table(records: List[dict]) -> str:
    parts = list(PARTS) + ["fwd"]
    rows = []
    for (shape, dtype), recs in itertools.groupby(records, key=lambda r: (r["shape"], r["dtype"])):
        by_part = {r["part"]: r for r in recs}
        rows.append([shape, dtype] + [f"{by_part[p]['graph_ms']:.3f}" if "graph_ms" in by_part.get(p, {}) else "-"
                                      for p in parts])
    return markdown(["shape", "dtype"] + [f"{p} ms" for p in parts], rows)


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = run(shapes_from_args(args), args.dtypes, device)
    return finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
