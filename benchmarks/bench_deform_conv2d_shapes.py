"""deform_conv2d at shapes its tiles were never tuned for, against torchvision's op and cuDNN's convolution (#64's
rule: at each, forward+backward at least 2x faster than torchvision's and at most 3x cuDNN's).

    python benchmarks/bench_deform_conv2d_shapes.py [--dtypes float16 float32] [--out results/<device>.jsonl]
    python benchmarks/bench_deform_conv2d_shapes.py --smoke     # the code path on the CPU, shapes shrunk

Shapes: odd sizes, stride 2, dilation 2, convolution groups, depthwise, 5x5, no mask (DCNv1), batch 1, a tiny map
with wide channels, offset groups on odd sizes; padding keeps the size (dilation * (k // 2)). Per shape and dtype:
forward and forward+backward (every gradient the op has: torchvision's and ours all five, cuDNN's input, weight and
bias) as `do_bench` medians of eager calls, and ours and cuDNN's as `do_bench_cudagraph` medians (torchvision's op
is not captured: eager only). Fresh signed random inputs, offsets normal x 2 px, masks in (0, 1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from deformconv.benchmark import time_ms

# name: (N, Cin, Cout, H, W, k, stride, dilation, groups, offset groups, mask)
SHAPES = {
    "odd-sizes": (3, 96, 80, 37, 53, 3, 1, 1, 1, 1, True),
    "stride-2": (8, 128, 256, 56, 56, 3, 2, 1, 1, 1, True),
    "dilation-2": (4, 256, 256, 33, 47, 3, 1, 2, 1, 1, True),
    "groups-4": (8, 256, 256, 28, 28, 3, 1, 1, 4, 4, True),
    "depthwise": (8, 128, 128, 56, 56, 3, 1, 1, 128, 1, True),
    "5x5": (4, 64, 64, 64, 64, 5, 1, 1, 1, 1, True),
    "no-mask": (8, 256, 256, 50, 76, 3, 1, 1, 1, 1, False),
    "batch-1": (1, 256, 256, 100, 152, 3, 1, 1, 1, 1, True),
    "tiny-wide": (32, 1024, 1024, 7, 7, 3, 1, 1, 1, 1, True),
    "og8-odd": (2, 64, 96, 45, 61, 3, 1, 1, 1, 8, True),
}


def _inputs(shape, dtype, device):
    n, cin, cout, h, w, k, s, d, groups, og, masked = shape
    pad = d * (k // 2)
    ho, wo = (h + 2 * pad - d * (k - 1) - 1) // s + 1, (w + 2 * pad - d * (k - 1) - 1) // s + 1
    gen = torch.Generator(device=device).manual_seed(0)

    def normal(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    x = normal(n, cin, h, w)
    offset = normal(n, 2 * og * k * k, ho, wo, scale=2.0)
    weight = normal(cout, cin // groups, k, k, scale=1 / math.sqrt(cin // groups * k * k))
    bias = normal(cout)
    mask = torch.rand(n, og * k * k, ho, wo, generator=gen, device=device).to(dtype).requires_grad_() if masked \
        else None
    return [x, offset, weight, bias, mask], dict(stride=s, padding=pad, dilation=d)


def _calls(settings):
    import torchvision

    import deformconv

    return {
        "deformconv": (lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, mask=m, **settings), (0, 1, 2, 3, 4)),
        "torchvision": (lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, mask=m, **settings),
                        (0, 1, 2, 3, 4)),
        "cudnn": (lambda x, o, w, b, m: F.conv2d(x, w, b, groups=x.shape[1] // w.shape[1], **settings), (0, 2, 3)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="on the CPU, each shape shrunk (N 1, channels / 16, H, W / 4)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    device = "cpu" if a.smoke else "cuda"
    if device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke)")
        from triton.testing import do_bench, do_bench_cudagraph

        torch.backends.cudnn.benchmark = True
    records = []
    for name in a.shapes:
        shape = SHAPES[name]
        if a.smoke:
            n, cin, cout, h, w, k, s, d, groups, og, masked = shape
            c = max(groups, og, 16) if groups > 1 else 16
            shape = (1, max(cin // 16, c), max(cout // 16, c), max(h // 4, 5), max(w // 4, 5), k, s, d,
                     min(groups, max(cin // 16, c)), og, masked)
        for dt in (["float32"] if a.smoke else a.dtypes):
            leaves, settings = _inputs(shape, getattr(torch, dt), device)
            rec = dict(shape=name, dtype=dt, layer=list(shape))
            for impl, (fn, used) in _calls(settings).items():
                args = [t if i in used or t is None else t.detach() for i, t in enumerate(leaves)]
                need = [args[i] for i in used if args[i] is not None]
                try:
                    out = fn(*args)
                    gout = torch.randn_like(out)
                    del out  # a live autograd graph would tie a captured backward to the default stream

                    def fwd(fn=fn, args=args):
                        with torch.no_grad():
                            return fn(*args)

                    def fb(fn=fn, args=args, need=need, gout=gout):
                        return torch.autograd.grad(fn(*args), need, gout)

                    if device == "cpu":
                        cpu = torch.device("cpu")
                        rec[f"{impl}_fwd_ms"], rec[f"{impl}_fb_ms"] = time_ms(fwd, cpu, cpu_reps=3), time_ms(fb, cpu,
                                                                                                         cpu_reps=3)
                        continue
                    rec[f"{impl}_fwd_ms"] = do_bench(fwd, return_mode="median")
                    rec[f"{impl}_fb_ms"] = do_bench(fb, return_mode="median")
                    if impl != "torchvision":
                        rec[f"{impl}_fwd_graph_ms"] = do_bench_cudagraph(fwd, return_mode="median")
                        rec[f"{impl}_fb_graph_ms"] = do_bench_cudagraph(fb, return_mode="median")
                except Exception as e:  # torchvision has no bf16 kernel on CUDA: the error is the record's
                    rec[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            records.append(rec)
            print(json.dumps(rec), flush=True)
    g = "_graph" if device == "cuda" else ""
    print("\n| shape | dtype | fwd+bwd: torchvision / ours (eager) | ours / cuDNN (GPU time) | ours / cuDNN (eager) |")
    print("|---|---|---|---|---|")
    for r in records:
        def ratio(x, y):
            return f"{r[x] / r[y]:.2f}" if x in r and y in r else "-"
        print(f"| {r['shape']} | {r['dtype']} | {ratio('torchvision_fb_ms', 'deformconv_fb_ms')} | "
              f"{ratio(f'deformconv_fb{g}_ms', f'cudnn_fb{g}_ms')} | {ratio('deformconv_fb_ms', 'cudnn_fb_ms')} |")
    if a.out:
        from deformconv.benchmark import environment, write_results

        write_results(a.out, environment(device), records)


if __name__ == "__main__":
    main()
