"""deform_conv2d's two routes for grouped convolutions timed side by side: the column kernels (narrow_groups.py) and
the implicit GEMM, with cuDNN's grouped convolution as the floor, by input channels a group (1, 2, 4, 8): the
measurement behind narrow_groups.NARROW_CHANNELS (docs/tuning.md: narrow groups).

    python benchmarks/tools/narrow_groups.py [--widths 1 2 4 8 16] [--dtypes float16 float32]
                                             [--out results/<device>.jsonl]

Forward+backward (every gradient) as `do_bench_cudagraph` medians, at two layers (8x128->128 at 56², 4x256->256 at
28², 3x3, one offset group, modulated); inputs as bench_deform_conv2d_shapes.py makes them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = [(8, 128, 56), (4, 256, 28)]  # (N, channels, size)


def _fb_graph_ms(fn, leaves) -> float:
    from triton.testing import do_bench_cudagraph

    out = fn(*leaves)
    gout = torch.randn_like(out)
    del out  # a live autograd graph would tie a captured backward to the default stream
    return do_bench_cudagraph(lambda: fn(*leaves).backward(gout), return_mode="median")


def main(argv=None):
    import bench_deform_conv2d_shapes as shapes

    import deformconv
    from deformconv.config import options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    records = []
    for n, c, hw in LAYERS:
        for width in a.widths:
            for dt in a.dtypes:
                leaves, settings = shapes._inputs((n, c, c, hw, hw, 3, 1, 1, c // width, 1, True), getattr(torch, dt),
                                                  "cuda")
                rec = dict(layer=[n, c, c, hw, hw, 3], channels_a_group=width, dtype=dt)
                for route, name in ((True, "columns"), (False, "implicit_gemm")):
                    options.narrow_groups = route
                    try:
                        rec[f"{name}_fb_graph_ms"] = _fb_graph_ms(
                            lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, mask=m, **settings), leaves)
                    finally:
                        options.narrow_groups = None
                rec["cudnn_fb_graph_ms"] = _fb_graph_ms(
                    lambda x, o, w, b, m: F.conv2d(x, w, b, groups=c // width, **settings), leaves)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    print("\n| layer | channels a group | dtype | columns | implicit GEMM | cuDNN | (ms, forward+backward, CUDA graph)")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['layer']} | {r['channels_a_group']} | {r['dtype']} | {r['columns_fb_graph_ms']:.3f} | "
              f"{r['implicit_gemm_fb_graph_ms']:.3f} | {r['cudnn_fb_graph_ms']:.3f} |")
    if a.out:
        from deformconv.benchmark import environment, write_results

        write_results(a.out, environment("cuda"), records)


if __name__ == "__main__":
    main()
