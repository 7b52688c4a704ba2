"""Versions, devices, and which backend each dtype would use on each device (with the reasons when a
backend cannot run), deform_conv2d's and the other ops'."""

from __future__ import annotations

import argparse
import platform

import torch

HELP = "versions, devices and the backend chosen for each dtype"

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    import deformconv
    from deformconv.backends import (ROI_BACKENDS, not_supported_reasons, select_backend, select_op_backend,
                                     triton_interpret_mode)
    import os

    print(f"deformconv  {deformconv.__version__}")
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__}")
    for mod in ("triton", "torchvision"):
        try:
            print(f"{mod:<11} {__import__(mod).__version__}")
        except ImportError:
            print(f"{mod:<11} not installed")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    print()
    for d in devices:
        name = torch.cuda.get_device_name(d) if d.type == "cuda" else (platform.processor() or platform.machine())
        extra = f" (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(d)))})" if d.type == "cuda" else ""
        print(f"device {d}: {name}{extra}")
    if triton_interpret_mode():
        print("TRITON_INTERPRET=1: Triton kernels run in the CPU interpreter (slow; for testing)")
    from deformconv.config import ENVIRONMENT

    for name, var in ENVIRONMENT.items():
        if os.environ.get(name):
            print(f"{name}={os.environ[name]}: {var.effect}")
    print()
    print(f"{'device':<8} {'dtype':<10} {'backend':<10} the other backends")
    for d in devices:
        for dt in DTYPES:
            reasons = not_supported_reasons(d, dt)
            try:
                chosen = select_backend(d, dt)
            except RuntimeError:
                chosen = "none"
            why = "; ".join(f"{b}: {'cannot run: ' + ', '.join(r) if r else 'can run, with backend=' + repr(b)}"
                            for b, r in reasons.items() if b != chosen)
            print(f"{str(d):<8} {str(dt).split('.')[-1]:<10} {chosen:<10} {why}")
    print()
    print(f"{'device':<8} {'dtype':<10} {'DCNv3/DCNv4, attention':<24} RoI pooling")
    for d in devices:
        for dt in DTYPES:
            print(f"{str(d):<8} {str(dt).split('.')[-1]:<10} {select_op_backend(d, dt, ''):<24} "
                  f"{select_op_backend(d, dt, '', ROI_BACKENDS)}")
    return 0
