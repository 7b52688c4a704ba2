"""Argument types shared by the commands: each bad value becomes argparse's one-line error and exit status 2."""

from __future__ import annotations

import argparse

import torch


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {s}")
    return v


def device(s: str) -> torch.device:
    """cpu, cuda or cuda:N, available on this machine."""
    try:
        d = torch.device(s)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}") from None
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise argparse.ArgumentTypeError(f"deformconv runs on cpu or cuda, got {s!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{s!r}: CUDA is not available on this machine")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{s!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return d


def default_device(d) -> torch.device:
    """The --device value, or cuda where available, else cpu."""
    return d if d is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
