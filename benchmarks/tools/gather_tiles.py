"""The gather kernels' program tile (options.gather_tile: elements, warps) timed on a GPU, at each family's benchmark
loads: DCNv3 and DCNv4 (bench_dcnv.py's shapes), multi-scale deformable attention (bench_msda.py's), deformable RoI
pooling (bench_roi_pool.py's). One run compares the defaults with the other candidates side by side; docs/tuning.md
keeps the outcome.

    python benchmarks/tools/gather_tiles.py [--dtypes bfloat16 float32] [--families ...] [--tiles 1024x4 ...]
                                            [--roi-spread 0 8 32] [--roi-planes 1 4] [--out PATH]

Forward and forward+backward, `do_bench` medians (ms) of eager calls: the default as the library runs it (no tile
forced: the attention's 16-bit forward then runs its tile on half the warps, msda/triton.py: forward_warps), and each
candidate forced as given (the default's own tile among them), with its time relative to the default last.
--roi-spread adds RoI pooling's forward with other spread tile widths (options.roi_spread, 0: none), --roi-planes
with other numbers of channels the spread tile takes a pass (options.roi_planes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CANDIDATES = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8)]


def _loads(dtype):
    """(family, load, forward callable, leaves)."""
    import bench_dcnv
    import bench_msda
    import bench_roi_pool

    import deformconv

    for name in ("dcnv4-bench", "internimage-t-s1", "internimage-t-s3"):
        n, h, w, g, d = shape = bench_dcnv.SHAPES[name]
        for op in ("dcnv3", "dcnv4"):
            leaves = bench_dcnv._inputs(shape, dtype, op)
            f = getattr(deformconv, op)
            yield op, name, (lambda f=f, leaves=leaves, g=g, d=d: f(*leaves, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256,
                                                                     False)), leaves
    for load in bench_msda.LOADS:
        if load == "host":  # the host's load: the GPU idles, no tile to tell apart
            continue
        value, shapes, starts, loc, attn = bench_msda._inputs(load, dtype)
        yield "msda", load, (lambda v=value, s=shapes, st=starts, lo=loc, a=attn: deformconv.ms_deform_attn(
            v, s, st, lo, a)), [value, loc, attn]
    for level in bench_roi_pool.LEVELS:
        for sr in (2, 6, 0):
            x, rois, offset, scale = bench_roi_pool._inputs(level, dtype, torch.device("cuda"))
            call = lambda x=x, r=rois, o=offset, s=scale, sr=sr: deformconv.deform_roi_pool(x, r, o, 7, s, sr)  # noqa: E731
            yield "roi_pool", f"{level} sr{sr}", call, [x, offset]


def unique_tiles(tiles):
    return list(dict.fromkeys(tiles))


def main(argv=None):
    from triton.testing import do_bench

    from deformconv.benchmark import environment, write_results
    from deformconv.config import options
    from deformconv.ops.dcnv.triton import TILE as DCN_TILE
    from deformconv.ops.msda.triton import TILE as MSDA_TILE
    from deformconv.ops.roi_pool.triton.roi import TILE as ROI_TILE

    defaults = {"dcnv3": DCN_TILE, "dcnv4": DCN_TILE, "msda": MSDA_TILE, "roi_pool": ROI_TILE}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tiles", nargs="+", default=[f"{e}x{w}" for e, w in CANDIDATES],
                    help="candidate tiles, elements x warps (each family's default is always timed)")
    ap.add_argument("--families", nargs="+", default=["dcnv3", "dcnv4", "msda", "roi_pool"])
    ap.add_argument("--roi-spread", nargs="*", type=int, default=[],
                    help="RoI pooling's forward spread tile widths to time beside the default (0: none)")
    ap.add_argument("--roi-planes", nargs="*", type=int, default=[],
                    help="RoI pooling's channels a pass of the spread tile to time beside the default (1, 2, 4)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = []
    for dt_name in args.dtypes:
        for family, load, fwd, leaves in _loads(getattr(torch, dt_name)):
            if family not in args.families:
                continue
            gout = torch.randn_like(fwd())
            row = dict(family=family, load=load, dtype=dt_name, default=list(defaults[family]))  # its tile
            tiles = unique_tiles([tuple(defaults[family])] + [tuple(map(int, t.split("x"))) for t in args.tiles])
            variants = [("default", {})] + [(f"{e}x{w}", dict(gather_tile=(e, w))) for e, w in tiles]
            if family == "roi_pool":
                variants += [(f"spread{n}", dict(roi_spread=n)) for n in args.roi_spread]
                variants += [(f"planes{n}", dict(roi_planes=n)) for n in args.roi_planes]
            for key, changes in variants:
                with options.override(**changes):
                    try:
                        row[f"{key}_fwd_ms"] = do_bench(fwd, return_mode="median")
                        row[f"{key}_fb_ms"] = do_bench(lambda: fwd().backward(gout), grad_to_none=leaves,
                                                       return_mode="median")
                    except Exception as e:  # a tile that does not fit (out of resources)
                        row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = environment(torch.device("cuda"))
    print(f"\n{env.get('device')}, torch {torch.__version__}; forward / forward+backward time relative to the "
          "default as it runs; columns: tiles forced (elements x warps)\n")
    timed = unique_tiles(["{}x{}".format(*defaults[f]) for f in args.families] + args.tiles)
    columns = timed + [f"spread{n}" for n in args.roi_spread] + [f"planes{n}" for n in args.roi_planes]
    print("| family | load | dtype | default ms | " + " | ".join(columns) + " |")
    print("|---|---|---|---|" + "---|" * len(columns))
    for r in rows:
        base_f, base_b = r.get("default_fwd_ms"), r.get("default_fb_ms")
        cells = []
        for key in columns:
            f, b = r.get(f"{key}_fwd_ms"), r.get(f"{key}_fb_ms")
            cells.append("-" if None in (f, b, base_f, base_b) else f"{f / base_f:.2f} / {b / base_b:.2f}")
        base = "-" if None in (base_f, base_b) else f"{base_f:.3f} / {base_b:.3f}"
        print(f"| {r['family']} | {r['load']} | {r['dtype']} | {base} | " + " | ".join(cells) + " |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
