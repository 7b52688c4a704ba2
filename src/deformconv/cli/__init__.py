"""Command line: ``python -m deformconv {demo,bench,info}`` (also the ``deformconv`` console script)."""

from __future__ import annotations

import argparse
from typing import List, Optional

from . import bench, demo, info

COMMANDS = {"demo": demo, "bench": bench, "info": info}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deformconv",
        description="Deformable convolution (DCNv1/DCNv2) for PyTorch. Start with `deformconv demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,bench,info}", required=True)
    for name, mod in COMMANDS.items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.__doc__)
        mod.add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args) or 0
