"""Time deform_conv2d on this machine: each available backend, torchvision (if installed) and F.conv2d of
the same shape, forward and forward+backward, as a table with ratios. On a CPU-only machine it runs small
shapes; on a GPU the five anchor shapes."""

from __future__ import annotations

import argparse

import torch

from .args import default_device
from .args import device as device_arg

HELP = "time deform_conv2d vs torchvision vs F.conv2d on this machine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device_arg, default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=["float16", "bfloat16", "float32", "float64"],
                        help="default: float16 bfloat16 float32 on CUDA, float32 on the CPU")
    parser.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--shapes", nargs="+", default=None, help="names of shapes (see --list-shapes)")
    parser.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    parser.add_argument("--json", metavar="PATH", help="write the records (benchmarks/results format) here")


def run(args: argparse.Namespace) -> int:
    from deformconv import benchmark
    from deformconv.ops.common.dispatch import PRIORITY, not_supported_reasons

    device = default_device(args.device)
    all_shapes = benchmark.GPU_SHAPES if device.type == "cuda" else benchmark.CPU_SHAPES
    if args.list_shapes:
        for name, s in all_shapes.items():
            print(f"{name}: N={s[0]} Cin={s[1]} Cout={s[2]} H={s[3]} W={s[4]} k={s[5]} offset_groups={s[6]}")
        return 0
    names = args.shapes or list(all_shapes)
    unknown = [n for n in names if n not in all_shapes]
    if unknown:
        raise SystemExit(f"deformconv bench: error: unknown shape(s) {unknown}; choose from {list(all_shapes)}")
    dtypes = args.dtypes or (["float16", "bfloat16", "float32"] if device.type == "cuda" else ["float32"])
    # Every backend that runs here (judged for float32, else the first dtype asked for); on a GPU not the
    # reference, which is too slow for the GPU shapes.
    probe = torch.float32 if "float32" in dtypes else benchmark.DTYPES[dtypes[0]]
    reasons = not_supported_reasons(device, probe)
    backends = [b for b in PRIORITY if not reasons[b]]
    if device.type == "cuda":
        backends = [b for b in backends if b != "reference"] or backends
    try:
        import torchvision  # noqa: F401

        has_tv = True
    except ImportError:
        has_tv = False
    shapes = {n: all_shapes[n] for n in names}
    env = benchmark.environment(device)
    print(f"deformconv bench on {device} ({env['device']}), backends {backends}"
          + ("" if has_tv else ", torchvision not installed"), flush=True)
    records = benchmark.run(shapes, dtypes, backends, args.passes, device, include_torchvision=has_tv,
                            log=lambda r: print(".", end="", flush=True))
    print()
    print(benchmark.table(records))
    if args.json:
        benchmark.write_results(args.json, env, records, benchmark="deform_conv2d")
        print(f"wrote {args.json}")
    return 0
