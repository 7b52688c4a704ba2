"""Time variants of one Triton kernel side by side: configs, tiling of positions, the input's layout.

    PYTHONPATH=src python benchmarks/experiments/sweep_configs.py --kernel bwd_weight --shapes det-s3 hires-g8 \\
        --dtypes float16 float32 --configs default 64,128,64,4 128,128,32,4
    PYTHONPATH=src python benchmarks/experiments/sweep_configs.py --kernel fwd --shapes hires-g8 \\
        --dtypes bfloat16 --tilings auto flat image --layouts auto nhwc
    PYTHONPATH=src python benchmarks/experiments/sweep_configs.py --kernel bwd_data --shapes det-s3 \\
        --maxnreg none 168 128

A variant replaces the kernel's candidate list with one config ("default": the heuristic's first choice;
else "block_m,block_n,block_k,num_warps[,num_stages[,split]]", grad_weight's split derived as the product
does when omitted) and forces the tiling of output positions and the layout the kernels read the input in
(``nhwc``, or ``auto``: offset-grouped where the heuristic ``grouped_input`` takes it); launch plans are cleared
between variants. ``--maxnreg`` caps the registers per thread of every variant (``auto``: the
heuristic's cap, ``none``: no cap; ptxas spills the rest; fewer registers let more programs share a
multiprocessor). It runs through the product's host path: the forward, or the backward asked for
that kernel's gradients only (bwd_data: input, offset, mask; bwd_weight: weight), so the times include the
host-side copies each path makes. Every variant's results are checked against the first variant's (max
|diff| / max |ref| over its outputs: a wrong variant shows up, it is never silently timed) and timed with
``triton.testing.do_bench_cudagraph`` (median). Prints a table, last; ``--out`` writes the records as JSON.

Without a GPU (TRITON_INTERPRET=1) it runs on the CPU and only checks: a smoke test (tests/test_experiments.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import List, Optional, Sequence

import torch
import triton

import deformconv.ops.deform_conv2d as K
from common import add_shape_args, finish, layer_inputs, markdown, max_rel_err, shapes_from_args
from deformconv.benchmark import DTYPES

KINDS = {"fwd": "_fwd_candidates", "bwd_data": "_bwd_data_candidates", "bwd_weight": "_bwd_weight_candidates"}
NEEDS = {"bwd_data": [True, True, True, False, False], "bwd_weight": [False, False, False, True, False]}


def parse_config(text: str, kind: str, geo, seg: int, device) -> Optional[K.Config]:
    """None for "default", else a Config; grad_weight's split as the product derives it unless given."""
    if text == "default":
        return None
    vals = [int(v) for v in text.split(",")]
    if not 4 <= len(vals) <= 6:
        raise ValueError(f"--configs: expected 'default' or block_m,block_n,block_k,num_warps[,num_stages[,split]], "
                         f"got {text!r}")
    cfg = K.Config(*vals)
    if kind == "bwd_weight" and len(vals) < 6:
        tiles = K._weight_rows(geo, seg, cfg.block_k) * triton.cdiv(geo.out_channels // geo.groups, cfg.block_n)
        cfg = K.Config(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                       split=K._split_for(geo, tiles, cfg.block_m, device))
    return cfg


def sweep(kind: str, shapes: dict, dtypes: List[str], configs: List[str], tilings: List[str],
          layouts: List[str], device: torch.device, log=print, maxnregs: Sequence = ("auto",)) -> List[dict]:
    original = {name: getattr(K, name) for name in (KINDS[kind], "per_image_tiles", "grouped_input")}
    records = []
    try:
        for (shape_name, shape), dtype_name in itertools.product(shapes.items(), dtypes):
            dtype = DTYPES[dtype_name]
            x, off, w, b, m, geom = layer_inputs(shape, dtype_name, device)
            geo = K.geometry_from_tensors(x, off, w, *geom)
            seg = K.segment_length(geo)
            out_hw = (geo.out_h, geo.out_w)
            go = torch.randn(shape[0], shape[2], *out_hw, device=device, dtype=torch.float32).to(dtype)

            def run():
                if kind == "fwd":
                    return (K.deform_conv2d_forward(x, off, w, b, m, *geom),)
                return tuple(g for g in K.deform_conv2d_backward(go, x, off, w, m, *geom, NEEDS[kind]) if g is not None)

            ref = None
            for cfg_text, tiling, layout, maxnreg in itertools.product(configs, tilings, layouts, maxnregs):
                cfg = parse_config(cfg_text, kind, geo, seg, device)
                if cfg is None and maxnreg == "auto":  # the heuristic's choice as is
                    setattr(K, KINDS[kind], original[KINDS[kind]])
                elif cfg is None:  # the heuristic's first choice, with this register cap
                    setattr(K, KINDS[kind], lambda *a, _f=original[KINDS[kind]], _r=maxnreg:
                            [dataclasses.replace(_f(*a)[0], maxnreg=_r)])
                else:
                    cap = None if maxnreg == "auto" else maxnreg
                    setattr(K, KINDS[kind], lambda *a, _c=dataclasses.replace(cfg, maxnreg=cap): [_c])
                K.per_image_tiles = {"auto": original["per_image_tiles"], "flat": lambda *a: False,
                                     "image": lambda *a: True}[tiling]
                K.grouped_input = {"auto": original["grouped_input"], "nhwc": lambda *a: False}[layout]
                K._PLANS.clear()
                K._TUNED.clear()
                rec = dict(kernel=kind, shape=shape_name, dtype=dtype_name, config=cfg_text, tiling=tiling, layout=layout,
                           maxnreg=maxnreg)
                try:
                    outs = run()
                    if ref is None:
                        ref = outs
                    rec["max_rel_err"] = max_rel_err(outs, ref)
                    rec["used"] = str(next(v for k, v in K.chosen_configs().items() if k[0] == kind))
                    if device.type == "cuda":
                        from triton.testing import do_bench_cudagraph

                        rec["graph_ms"] = do_bench_cudagraph(run, rep=40, return_mode="median")
                except Exception as e:  # a variant that does not fit (e.g. shared memory): report, go on
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                records.append(rec)
                log(json.dumps(rec))
    finally:
        for name, fn in original.items():
            setattr(K, name, fn)
        K._PLANS.clear()
        K._TUNED.clear()
    return records


def table(records: List[dict]) -> str:
    rows = []
    for r in records:
        ms = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "-"
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else r.get("error", "-")
        rows.append([r["kernel"], r["shape"], r["dtype"], r["config"], r["tiling"], r["layout"],
                     str(r.get("maxnreg") or "none"), ms, err, r.get("used", "-")])
    return markdown(["kernel", "shape", "dtype", "config", "tiling", "layout", "maxnreg", "graph ms", "max rel err",
                     "config used"], rows)


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True, choices=list(KINDS))
    add_shape_args(ap)
    ap.add_argument("--configs", nargs="+", default=["default"])
    ap.add_argument("--tilings", nargs="+", default=["auto"], choices=["auto", "flat", "image"])
    ap.add_argument("--layouts", nargs="+", default=["auto"], choices=["auto", "nhwc"],
                    help="auto: the heuristic's (offset-grouped where segments are whole offset groups), nhwc: always NHWC")
    ap.add_argument("--maxnreg", nargs="+", default=["auto"],
                    help="register caps per thread: 'auto' (the heuristic's), 'none' or integers")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    maxnregs = [v if v == "auto" else None if v == "none" else int(v) for v in args.maxnreg]
    records = sweep(args.kernel, shapes_from_args(args), args.dtypes, args.configs, args.tilings, args.layouts,
                    device, maxnregs=maxnregs)
    return finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
