"""benchmarks/bench_transformers.py's measure on stand-in models (no GPU, no transformers model built): the paths'
timed steps take turns, a path that fails or cannot be taken is recorded and the others go on, and a path's peak
memory counts its own model and inputs, not the other paths'."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

pytest.importorskip("transformers")
import bench_transformers  # noqa: E402


class _Memory:
    """torch.cuda's allocation counters, kept by hand: allocated now and the peak since the last reset."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)


def test_paths_take_turns_and_failures_are_recorded(monkeypatch):
    mem, order = _Memory(), []
    sizes = {"a": 800, "b": 2400, "fails-later": 400}  # bytes of each path's model; a step's activations: twice that

    def apply_path(model, path):
        if path == "skipped":
            return None, "cannot patch it"
        model = torch.nn.Linear(1, sizes[path] // 8, bias=False, dtype=torch.float64)  # sizes[path] bytes
        model.path = path
        return model, None

    def step_fn(model, args, train, dtype):
        path = model.path
        calls = {"n": 0}

        def step():
            calls["n"] += 1
            if path == "fails-later" and calls["n"] > 6:  # first call, 3 warm-ups, the peak step, then one timed step
                raise RuntimeError("out of memory")
            order.append(path)
            mem.add(2 * sizes[path])  # the step's activations, freed at its end
            mem.add(-2 * sizes[path])

        return step

    monkeypatch.setattr(bench_transformers, "build", lambda name: torch.nn.Identity())
    monkeypatch.setattr(bench_transformers, "apply_path", apply_path)
    monkeypatch.setattr(bench_transformers, "inputs", lambda *a, **k: {})
    monkeypatch.setattr(bench_transformers, "step_fn", step_fn)
    monkeypatch.setattr(bench_transformers, "gpu_time", lambda step: (1.0, 0.5))
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: mem.now)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: mem.peak)

    def reset():
        mem.peak = mem.now

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    mem.add(1000)  # what other paths' models hold
    records = bench_transformers.measure("deformable_detr", ["a", "skipped", "b", "fails-later"], torch.float32,
                                         True, iters=3, warmup=3)
    assert records["skipped"] == {"skipped": "cannot patch it"}
    assert "out of memory" in records["fails-later"]["error"]
    timed = order[-7:]  # the timed steps: a, b, fails-later (once), then a, b twice
    assert timed == ["a", "b", "fails-later", "a", "b", "a", "b"], order
    for path in ("a", "b"):
        r = records[path]
        assert r["gpu_ms"] == 1.0 and r["attention_gpu_ms"] == 0.5 and r["ms"] >= 0
        assert r["peak_mib"] * 2**20 == pytest.approx(3 * sizes[path])  # its model, then its activations
