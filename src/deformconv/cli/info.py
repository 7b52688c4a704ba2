"""Versions, devices, and which backend each op would use for each dtype on each device, with the reasons where a
backend cannot run."""

from __future__ import annotations

import argparse
import platform

import torch

HELP = "versions, devices and the backend chosen for each dtype"

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    import os

    import deformconv
    from deformconv.ops.common.dispatch import BACKENDS, ops, select_backend, triton_interpret_mode

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
        extra = ""
        if d.type == "cuda":
            extra = f" (compute capability {'.'.join(map(str, torch.cuda.get_device_capability(d)))})"
        print(f"device {d}: {name}{extra}")
    if triton_interpret_mode():
        print("TRITON_INTERPRET=1: Triton kernels run in the CPU interpreter (slow; for testing)")
    from deformconv.config import ENVIRONMENT

    for name, var in ENVIRONMENT.items():
        if os.environ.get(name):
            print(f"{name}={os.environ[name]}: {var.effect}")
    print()
    names = ops()
    width = max(len(n) for n in names) + 2
    print("the backend each op takes (DEFORMCONV_BACKEND or backend= may force another that can run)")
    for d in devices:
        print(f"{'device ' + str(d):<{width}}" + "".join(f"{str(dt).split('.')[-1]:<11}" for dt in DTYPES).rstrip())
        for op in names:
            row = []
            for dt in DTYPES:
                try:
                    row.append(select_backend(d, dt, op=op))
                except RuntimeError:
                    row.append("none")
            print(f"{op:<{width}}" + "".join(f"{b:<11}" for b in row).rstrip())
        print()
    print("the backends that cannot run, and why")
    for d in devices:
        for dt in DTYPES:
            for b, backend in BACKENDS.items():
                why = backend.not_supported_reasons(d, dt)
                if why:
                    print(f"{str(d):<8} {str(dt).split('.')[-1]:<10} {b:<10} {'; '.join(why)}")
    return 0
