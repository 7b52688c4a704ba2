"""Deformable RoI pooling on a GPU (and the CPU): deformconv beside torchvision.ops.roi_align, the floor (the same
pooling without offsets).

    python benchmarks/bench_roi_pool.py [--dtypes float32 float16 bfloat16] [--cpu] [--out PATH]

Loads (Faster R-CNN-like: 2 images, 512 RoIs each, 7x7 bins): an FPN level of 256x200x304 (stride 4) and one of
256x50x76 (stride 16), sampling_ratio 2 and 0 (adaptive); RoIs uniform over the image, up to half its size. Forward
and forward+backward (gradients of input and offsets; roi_align's of input), `do_bench` medians of eager calls and
of CUDA-graph replays, and the first call's time. --cpu times the same on the CPU (float32), medians of wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LEVELS = {"p2-200x304": (200, 304, 0.25), "p4-50x76": (50, 76, 1 / 16)}


def _inputs(level, dtype, device, rois_per_image=512, channels=256, images=2):
    h, w, scale = LEVELS[level]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(images, channels, h, w, device=device, generator=gen).to(dtype).requires_grad_()
    size = torch.tensor([w, h], device=device) / scale
    r = images * rois_per_image
    xy = torch.rand(r, 2, device=device, generator=gen) * size
    wh = torch.rand(r, 2, device=device, generator=gen) * size * 0.5
    batch = torch.arange(images, device=device).repeat_interleave(rois_per_image)[:, None].float()
    rois = torch.cat([batch, xy, xy + wh], 1)
    offset = (torch.randn(r, 2, 7, 7, device=device, generator=gen) * 0.3).to(dtype).requires_grad_()
    return x, rois, offset, scale


def main(argv=None):
    import torchvision

    import deformconv
    from deformconv.benchmark import environment, time_ms, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu)")
    rows = []
    for level in LEVELS:
        for sr in (2, 0):
            for dt_name in (["float32"] if args.cpu else args.dtypes):
                x, rois, offset, scale = _inputs(level, getattr(torch, dt_name), device)
                row = dict(level=level, sampling_ratio=sr, dtype=dt_name, rois=rois.shape[0])
                fns = {"deformconv": (lambda: deformconv.deform_roi_pool(x, rois, offset, 7, scale, sr), [x, offset]),
                       "roi_align": (lambda: torchvision.ops.roi_align(x, rois, 7, scale, sr, aligned=True), [x])}
                for name, (fn, leaves) in fns.items():
                    try:
                        t0 = time.perf_counter()
                        gout = torch.randn_like(fn())
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)

                        def step(fn=fn, gout=gout):
                            fn().backward(gout)

                        if device.type == "cpu":
                            row[f"{name}_fwd_ms"] = time_ms(fn, device, cpu_reps=10)
                            row[f"{name}_fb_ms"] = time_ms(step, device, cpu_reps=10)
                            continue
                        from triton.testing import do_bench, do_bench_cudagraph

                        row[f"{name}_fwd_ms"] = do_bench(fn, return_mode="median")
                        row[f"{name}_fb_ms"] = do_bench(step, grad_to_none=leaves, return_mode="median")
                        row[f"{name}_fwd_graph_ms"] = do_bench_cudagraph(fn, return_mode="median")
                        row[f"{name}_fb_graph_ms"] = do_bench_cudagraph(step, grad_to_none=leaves,
                                                                        return_mode="median")
                    except Exception as e:  # torchvision has no bf16 kernel on some builds
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
    env = environment(device)
    print(f"\n{env.get('device')}, torch {torch.__version__}; medians in ms (ratios: deformconv / roi_align)\n")
    print("| level | sampling | dtype | fwd | roi_align fwd | ratio | fwd+bwd | roi_align fwd+bwd | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = []
        for p in ("fwd", "fb"):
            a, b = r.get(f"deformconv_{p}_ms"), r.get(f"roi_align_{p}_ms")
            cells += ["-" if a is None else f"{a:.3f}", "-" if b is None else f"{b:.3f}",
                      f"{a / b:.2f}" if a and b else "-"]
        print(f"| {r['level']} | {r['sampling_ratio']} | {r['dtype']} | " + " | ".join(cells) + " |")
    if args.out:
        write_results(args.out, env, rows)


if __name__ == "__main__":
    main()
