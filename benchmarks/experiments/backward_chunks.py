"""Time and size the backward's image chunks side by side: forward+backward under several workspace budgets.

    PYTHONPATH=src python benchmarks/experiments/backward_chunks.py --shapes det-s3 det-s4 --dtypes float16 \
        --layouts nchw channels_last --variants whole default 1.5,0 1.5,256

The Triton backward processes the batch in chunks of images (``backward_chunk_images``) so that its scratch
memory (NHWC copies, grad_input's accumulator, grad_weight's partials) stays within ``WORKSPACE_BUDGET`` times
the input's size, unless a chunk would then have fewer than ``MIN_CHUNK_PROGRAMS`` M tiles. A variant is
"default" (the committed values), "whole" (no chunks: the batch at once) or
"budget,min_programs[,split_partial_bytes]" (the last: grad_weight's partials per input element). For each:
images per chunk, forward+backward time through the public op (``triton.testing.do_bench_cudagraph`` median),
the extra peak memory of one forward+backward, the workspace (that peak less the output and the gradients,
which any implementation returns) as a multiple of the input's size, and every gradient checked against the
"whole" variant's (max |diff| / max |ref|: only grad_input's atomics may add in another order).
Prints a table, last; ``--out`` writes the records as JSON.

Without a GPU (TRITON_INTERPRET=1) it runs on the CPU and only checks: a smoke test (tests/test_experiments.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import List

import torch

import deformconv
import deformconv.ops.deform_conv2d as K
from common import add_shape_args, finish, layer_inputs, markdown, max_rel_err, shapes_from_args
from deformconv.benchmark import step_memory_mib


def _variant(text: str):
    """(WORKSPACE_BUDGET, MIN_CHUNK_PROGRAMS, SPLIT_PARTIAL_BYTES) of a variant."""
    if text == "default":
        return K.WORKSPACE_BUDGET, K.MIN_CHUNK_PROGRAMS, K.SPLIT_PARTIAL_BYTES
    if text == "whole":
        return float("inf"), 0, K.SPLIT_PARTIAL_BYTES
    try:
        fields = text.split(",")
        if len(fields) not in (2, 3):
            raise ValueError
        return float(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else K.SPLIT_PARTIAL_BYTES
    except ValueError:
        raise ValueError(f"--variants: expected 'default', 'whole' or budget,min_programs[,split_partial_bytes] "
                         f"(e.g. 1.5,512 or 1.5,512,2), got {text!r}")


def run(shapes: dict, dtypes: List[str], layouts: List[str], variants: List[str], device: torch.device,
        log=print) -> List[dict]:
    settings = {v: _variant(v) for v in ["whole"] + [v for v in variants if v != "whole"]}
    saved = (K.WORKSPACE_BUDGET, K.MIN_CHUNK_PROGRAMS, K.SPLIT_PARTIAL_BYTES)
    records = []
    try:
        for (shape_name, shape), dtype_name, layout in itertools.product(shapes.items(), dtypes, layouts):
            x, off, w, b, m, (stride, padding, dilation) = layer_inputs(shape, dtype_name, device)
            if layout == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            leaves = [t.detach().requires_grad_(True) for t in (x, off, w, b, m)]

            def forward():
                return deformconv.deform_conv2d(*leaves[:4], stride=stride, padding=padding, dilation=dilation,
                                                mask=leaves[4], backend="triton")

            grad_out = torch.randn_like(forward())

            def step():
                forward().backward(grad_out)

            input_bytes = x.numel() * x.element_size()
            geo = K.geometry_from_tensors(x, off, w, stride, padding, dilation)
            reference = None
            for name, setting in settings.items():
                K.WORKSPACE_BUDGET, K.MIN_CHUNK_PROGRAMS, K.SPLIT_PARTIAL_BYTES = setting
                K._TUNED.clear()  # the split is derived when a config is chosen, and kept in the plans
                K._PLANS.clear()
                rec = dict(shape=shape_name, dtype=dtype_name, layout=layout, variant=name,
                           images_per_chunk=K.backward_schedule(x, grad_out, geo, w.numel(), True, True, True,
                                                                False)[1],
                           batch=x.shape[0])
                for t in leaves:
                    t.grad = None
                if device.type == "cuda":
                    extra, workspace = step_memory_mib(step, grad_out, leaves)
                    rec.update(extra_peak_mib=extra, workspace_x_input=workspace * 2**20 / input_bytes)
                else:
                    step()
                grads = [t.grad.clone() for t in leaves]
                if reference is None:
                    reference = grads
                rec["max_rel_err"] = max_rel_err(grads, reference)
                if device.type == "cuda":
                    from triton.testing import do_bench_cudagraph

                    rec["graph_ms"] = do_bench_cudagraph(step, rep=60, grad_to_none=leaves, return_mode="median")
                records.append(rec)
                log(json.dumps(rec))
    finally:
        K.WORKSPACE_BUDGET, K.MIN_CHUNK_PROGRAMS, K.SPLIT_PARTIAL_BYTES = saved
        K._TUNED.clear()
        K._PLANS.clear()
    return records


def table(records: List[dict]) -> str:
    def cell(r, field, fmt):
        return format(r[field], fmt) if field in r else "-"

    return markdown(
        ["shape", "dtype", "layout", "variant", "images/chunk", "fwd+bwd ms", "extra peak MiB", "workspace / input",
         "max rel err"],
        [[r["shape"], r["dtype"], r["layout"], r["variant"], f"{r['images_per_chunk']}/{r['batch']}",
          cell(r, "graph_ms", ".3f"), cell(r, "extra_peak_mib", ".1f"), cell(r, "workspace_x_input", ".2f"),
          cell(r, "max_rel_err", ".1e")] for r in records])


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--layouts", nargs="+", default=["nchw"], choices=["nchw", "channels_last"])
    ap.add_argument("--variants", nargs="+", default=["whole", "default"])
    args = ap.parse_args(argv)
    for v in args.variants:
        _variant(v)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = run(shapes_from_args(args), args.dtypes, args.layouts, args.variants, device)
    return finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
