"""The GPU's ceiling for fp32 atomic adds (L2 reductions), in the grad_input kernel's access pattern.

    PYTHONPATH=src python benchmarks/experiments/atomic_ceiling.py --rows 1094400 --channels 256

A kernel that does nothing but grad_input's scatter: each program adds tiles of [ROWS, C] fp32 values (C
consecutive channels of ROWS pixel rows, relaxed `tl.atomic_add`, as the grad_input kernel does) into a
[pixels, channels] buffer, for every C-channel chunk of the row. The pixel of each row follows a pattern:
``seq`` (consecutive pixels), ``local`` (a 3x3 convolution's 4 corners x 9 taps around consecutive output
positions, like zero offsets) or ``rand`` (uniform over the buffer). Reported: 32-byte sectors a second
(rows x channels x 4 bytes / 32 / time), the rate to hold the grad_input kernel's scatter against
(benchmarks/NOTES.md, v11). The defaults are det-s4's scatter: 30400 positions x 9 taps x 4 corners rows
of 256 channels into 8 x 50 x 76 pixels. Each run's buffer is checked against ``index_add_`` of the same
values (max |diff| / max |ref|), then timed with ``triton.testing.do_bench`` (median; the buffer keeps
accumulating while timed). Prints a table, last; ``--out`` writes the records as JSON.

Without a GPU (TRITON_INTERPRET=1) it runs on the CPU and only checks: a smoke test (tests/test_experiments.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import List

import torch
import triton
import triton.language as tl

from common import markdown


@triton.jit
def _scatter_kernel(buf_ptr, pix_ptr, NROWS, CIN, ITERS, ROWS: tl.constexpr, C: tl.constexpr):
    """buf [pixels, CIN] fp32 += value(row, channel) at row r's pixel pix[r] for the NROWS rows, ITERS tiles of
    ROWS rows a program, every C-channel chunk."""
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)
    c = tl.arange(0, C)
    for it in range(ITERS):
        rows = (pid * ITERS + it) * ROWS + r
        live = rows < NROWS
        pix = tl.load(pix_ptr + rows, mask=live, other=0).to(tl.int64)
        for c0 in range(0, CIN, C):
            val = _value(rows[:, None], c0 + c[None, :])
            tl.atomic_add(buf_ptr + pix[:, None] * CIN + (c0 + c)[None, :], val, mask=live[:, None], sem="relaxed")


@triton.jit
def _value(row, ch):
    """A signed value per (row, channel) that sums exactly in fp32 (multiples of 1/64 in [-2, 2))."""
    return ((row * 7 + ch * 3) % 256 - 128).to(tl.float32) * 0.015625


def _values(rows: int, cin: int, device) -> torch.Tensor:
    """_value of every (row, channel), on the host, for the check."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cin, device=device)[None, :]
    return ((r * 7 + c * 3) % 256 - 128).float() * 0.015625


def pixels_of(pattern: str, rows: int, pixels: int, width: int, device) -> torch.Tensor:
    """Row -> pixel (int32) for a pattern (see the module docstring)."""
    if pattern == "seq":
        return (torch.arange(rows, device=device) % pixels).int()
    if pattern == "rand":
        return torch.randint(0, pixels, (rows,), device=device, dtype=torch.int32)
    if pattern == "local":
        taps = torch.tensor([dy * width + dx for dy in (-1, 0, 1) for dx in (-1, 0, 1)], device=device)
        corners = torch.tensor([0, 1, width, width + 1], device=device)
        base = torch.arange(triton.cdiv(rows, 36), device=device)
        pix = (base[:, None, None] + taps[None, :, None] + corners[None, None, :]) % pixels
        return pix.reshape(-1)[:rows].int()
    raise ValueError(f"pattern: expected seq, local or rand, got {pattern!r}")


def run(patterns: List[str], tiles: List[str], rows: int, cin: int, pixels: int, width: int, iters: int,
        device: torch.device, log=print) -> List[dict]:
    records = []
    for pattern, tile in itertools.product(patterns, tiles):
        block_rows, c, warps = (int(v) for v in tile.split(","))
        if cin % c:
            raise ValueError(f"--tiles {tile}: C must divide --channels ({cin})")
        pix = pixels_of(pattern, rows, pixels, width, device)
        buf = torch.zeros(pixels, cin, device=device)
        grid = (triton.cdiv(rows, block_rows * iters),)

        def launch():
            _scatter_kernel[grid](buf, pix, rows, cin, iters, ROWS=block_rows, C=c, num_warps=warps)

        launch()
        ref = torch.zeros_like(buf).index_add_(0, pix.long(), _values(rows, cin, device))
        err = ((buf - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        rec = dict(pattern=pattern, rows=rows, channels=cin, tile=tile, max_rel_err=err)
        if device.type == "cuda":
            ms = triton.testing.do_bench(launch, warmup=5, rep=50)
            sectors = rows * cin * 4 / 32
            rec.update(median_ms=ms, g_sectors_per_s=sectors / ms / 1e6)
        log(json.dumps(rec))
        records.append(rec)
    return records


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--patterns", nargs="+", default=["seq", "local", "rand"])
    ap.add_argument("--tiles", nargs="+", default=["64,32,4", "64,64,4", "32,128,4", "128,32,8"],
                    help="ROWS,C,num_warps per variant")
    ap.add_argument("--rows", type=int, default=30400 * 9 * 4)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--pixels", type=int, default=8 * 50 * 76)
    ap.add_argument("--width", type=int, default=76, help="image width, for the local pattern")
    ap.add_argument("--iters", type=int, default=8, help="row tiles a program")
    ap.add_argument("--out", help="write the records as JSON")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records = run(args.patterns, args.tiles, args.rows, args.channels, args.pixels, args.width, args.iters, device)
    bad = [r for r in records if r["max_rel_err"] != 0.0]  # NaN counts as bad
    rows = [[r["pattern"], r["tile"], f"{r['max_rel_err']:.1e}", f"{r.get('median_ms', float('nan')):.3f}",
             f"{r.get('g_sectors_per_s', float('nan')):.1f}"] for r in records]
    print(markdown(["pattern", "ROWS,C,warps", "max rel err", "median ms", "G sectors/s"], rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    if bad:
        sys.exit(f"{len(bad)} variant(s) disagree with index_add_: {bad}")
    return records


if __name__ == "__main__":
    main()
