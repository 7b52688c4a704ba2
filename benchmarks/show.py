"""Print a recorded run of a benchmark as a markdown table: the runs of a device's table
(benchmarks/results/<device>.jsonl, one run a line), the latest of a benchmark, or the one of a date.

    python benchmarks/show.py benchmarks/results/h200.jsonl                      # the runs: benchmark, variant, date
    python benchmarks/show.py benchmarks/results/h200.jsonl deform_conv2d        # its latest run's records
    python benchmarks/show.py benchmarks/results/h100.jsonl msda --date 2026-12-06 --variant shared-helpers
"""

from __future__ import annotations

import argparse
import json
import sys


def runs(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def records_table(records: list) -> str:
    """A markdown table of records (dicts): one column per key, in first-seen order; floats to 3 decimals."""
    keys = list(dict.fromkeys(k for r in records for k in r))

    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in records]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a device's table: benchmarks/results/<device>.jsonl")
    ap.add_argument("benchmark", nargs="?", help="a benchmark's name (none: list the runs)")
    ap.add_argument("--date", help="the run of this date (default: the latest)")
    ap.add_argument("--variant", help="the run of this variant")
    a = ap.parse_args(argv)
    all_runs = runs(a.table)
    if a.benchmark is None:
        for r in all_runs:
            print(f"{r['benchmark']:<22} {r.get('variant') or '':<18} {r.get('date')}")
        return 0
    chosen = [r for r in all_runs if r["benchmark"] == a.benchmark and (a.date is None or r.get("date") == a.date)
              and (a.variant is None or r.get("variant") == a.variant)]
    if not chosen:
        print(f"no run of {a.benchmark!r} in {a.table} (list them: show.py {a.table})", file=sys.stderr)
        return 1
    run = chosen[-1]
    env = run.get("environment", {})
    print(f"{run['benchmark']} {run.get('variant') or ''} {run.get('date')}: {env.get('device', '')}, torch "
          f"{env.get('torch', '?')}, Triton {env.get('triton', '-')}; {env.get('timer', '')}\n")
    records = run.get("records")
    if isinstance(records, list) and records and all(isinstance(r, dict) for r in records):
        if {"impl", "shape", "pass"} <= set(records[0]):
            from deformconv.benchmark import table

            print(table(records))
        else:
            print(records_table(records))
    others = [k for k in run if k not in ("benchmark", "variant", "date", "source", "environment", "records")]
    if others:
        print(f"\nother sections (JSON): {', '.join(others)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
