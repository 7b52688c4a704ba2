"""Side-by-side timing of deform_conv2d, torchvision.ops.deform_conv2d and F.conv2d of the same shape.

Used by ``python -m deformconv bench`` and by ``benchmarks/bench_deform_conv2d.py``. Times are medians in
ms: ``triton.testing.do_bench`` on CUDA (CUDA events), a wall-clock median on the CPU. Inputs are fresh
signed random data (never zeros); every shape has a mask and padding k//2, stride 1.
Records: {"shape", "dtype", "impl", "backend", "pass": "fwd"|"fwd+bwd", "median_ms", ...}.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

Shape = Tuple[int, int, int, int, int, int, int]  # (N, Cin, Cout, H, W, k, offset groups)

# The five shapes of the H200 anchors (../shared/reference): detection-neck stages, a classifier stage and
# a high-resolution layer with 8 offset groups.
GPU_SHAPES: Dict[str, Shape] = {
    "det-s3": (8, 128, 128, 100, 152, 3, 1),
    "det-s4": (8, 256, 256, 50, 76, 3, 1),
    "det-s5": (8, 512, 512, 25, 38, 3, 1),
    "cls-14": (64, 256, 256, 14, 14, 3, 1),
    "hires-g8": (16, 64, 64, 128, 128, 3, 8),
}
CPU_SHAPES: Dict[str, Shape] = {
    "small": (2, 32, 32, 24, 24, 3, 1),
    "small-g4": (2, 32, 32, 24, 24, 3, 4),
    "cpu-32": (2, 64, 64, 32, 32, 3, 1),
    "cpu-56": (1, 128, 128, 56, 56, 3, 1),
    "resnet-c4-b2": (2, 256, 256, 50, 76, 3, 1),  # a ResNet-50-DCNv2 c4 layer at detection resolution, batch 2
}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def make_inputs(shape: Shape, dtype: torch.dtype, device, requires_grad: bool = False,
                seed: int = 0) -> List[torch.Tensor]:
    """[input, offset, weight, bias, mask] for a stride-1, padding k//2 layer: signed normal input,
    offsets of a few pixels, mask in (0, 1), weight scaled by 1/sqrt(fan_in)."""
    n, cin, cout, h, w, k, g = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    tensors = [
        normal(n, cin, h, w),
        normal(n, 2 * g * k * k, h, w, scale=2.0),
        normal(cout, cin, k, k, scale=1.0 / math.sqrt(cin * k * k)),
        normal(cout),
        torch.rand(n, g * k * k, h, w, generator=gen, device=device).to(dtype),
    ]
    return [t.requires_grad_(requires_grad) for t in tensors]


def time_ms(fn: Callable[[], object], device: torch.device, grads: Optional[Sequence[torch.Tensor]] = None,
            cpu_reps: int = 5) -> float:
    """Median time of fn() in ms."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(cpu_reps):
        if grads:
            for t in grads:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _extra_peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def step_memory_mib(step: Callable[[], object], grad_out: torch.Tensor, leaves: Sequence[torch.Tensor]
                    ) -> Tuple[float, float]:
    """(extra peak, workspace) in MiB of one forward+backward ``step`` on CUDA: the peak allocated above what
    was allocated before it, and that peak less what every implementation returns and holds at the step's
    end, the output (grad_out's size) and the gradients of ``leaves``: the scratch (column buffers, copies,
    accumulators)."""
    extra = _extra_peak_mib(step)
    returned = sum(t.numel() * t.element_size() for t in [grad_out] + [a.grad for a in leaves]) / 2**20
    return extra, extra - returned


def _impls(backends: Iterable[str]) -> Dict[str, Tuple[str, Optional[str]]]:
    """label -> (impl, backend)."""
    out = {f"deformconv[{b}]": ("deformconv", b) for b in backends}
    out["torchvision"] = ("torchvision", None)
    out["conv2d"] = ("conv2d", None)
    return out


def _fn(impl: str, backend: Optional[str], pad: int):
    import deformconv

    if impl == "deformconv":
        return lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=pad, mask=m, backend=backend)
    if impl == "torchvision":
        import torchvision

        return lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, padding=pad, mask=m)
    return lambda x, o, w, b, m: F.conv2d(x, w, b, padding=pad)


def run(shapes: Dict[str, Shape], dtypes: Sequence[str], backends: Sequence[str], passes: Sequence[str],
        device, include_torchvision: bool = True, log: Callable[[dict], None] = lambda r: None,
        deterministic: bool = False) -> List[dict]:
    """Time every (shape, dtype, implementation, pass); errors (e.g. torchvision has no bfloat16) become
    an "error" field instead of a time. With ``deterministic``, deformconv's forward+backward is timed a
    second time under torch.use_deterministic_algorithms(True) (records with "mode": "deterministic")."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    impls = _impls(backends)
    if not include_torchvision:
        impls.pop("torchvision")
    records = []
    for name, shape in shapes.items():
        pad = shape[5] // 2
        for dname in dtypes:
            dtype = DTYPES[dname]
            for impl, backend in impls.values():
                fn = _fn(impl, backend, pad)
                base = {"shape": name, "dtype": dname, "impl": impl, "backend": backend, "N": shape[0],
                        "Cin": shape[1], "Cout": shape[2], "H": shape[3], "W": shape[4], "k": shape[5],
                        "offset_groups": shape[6]}
                modes = [("default", p) for p in passes]
                if deterministic and impl == "deformconv" and "fwd+bwd" in passes:
                    modes.append(("deterministic", "fwd+bwd"))
                for mode, p in modes:
                    rec = dict(base, **{"pass": p})
                    if mode != "default":
                        rec["mode"] = mode
                    was = torch.are_deterministic_algorithms_enabled()
                    torch.use_deterministic_algorithms(mode == "deterministic")
                    try:
                        _measure(rec, fn, shape, dtype, device, p, first_call=impl == "deformconv")
                    except Exception as e:
                        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    finally:
                        torch.use_deterministic_algorithms(was)
                    records.append(rec)
                    log(rec)
    return records


def _measure(rec: dict, fn, shape: Shape, dtype: torch.dtype, device: torch.device, p: str, first_call: bool):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if p == "fwd":
        args = make_inputs(shape, dtype, device)

        def step():
            with torch.no_grad():
                return fn(*args)
        grads = None
    else:
        args = make_inputs(shape, dtype, device, requires_grad=True)
        if rec["impl"] == "conv2d":  # a plain conv has no offset or mask
            args[1].requires_grad_(False)
            args[4].requires_grad_(False)
        grad_out = torch.randn_like(fn(*args))

        def step():
            fn(*args).backward(grad_out)
        grads = [a for a in args if a.requires_grad]
    if first_call:
        before = _chosen_configs()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        rec["first_call_s"] = round(time.perf_counter() - t0, 3)
        new = {k[0]: str(v) for k, v in _chosen_configs().items() if k not in before}
        if new:
            rec["configs"] = new
    if p == "fwd+bwd" and device.type == "cuda":
        for a in args:
            a.grad = None
        extra, workspace = step_memory_mib(step, grad_out, grads)
        rec["extra_peak_mib"] = round(extra, 1)
        rec["workspace_mib"] = round(workspace, 1)
        rec["input_mib"] = round(args[0].numel() * args[0].element_size() / 2**20, 1)
    rec["median_ms"] = time_ms(step, device, grads)
    if device.type == "cuda" and rec["impl"] != "torchvision":
        # The same step replayed from a CUDA graph: GPU time alone, without the per-call CPU (Python,
        # launch) cost that bounds small shapes in eager mode. Not for torchvision: its replays measured
        # 3-16x below its eager times on the H200 (e.g. 0.45 vs 7.1 ms), more than launch cost explains,
        # so some of its kernels are presumably not captured; those numbers would not be credible.
        from triton.testing import do_bench_cudagraph

        try:
            rec["graph_ms"] = do_bench_cudagraph(step, rep=100, grad_to_none=grads, return_mode="median")
        except Exception as e:
            rec["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _chosen_configs() -> dict:
    try:
        from deformconv.ops.common.launch import chosen_configs
    except Exception:  # no Triton here
        return {}
    return chosen_configs()


def _cpu_name() -> str:
    """The CPU's model name and the threads torch uses."""
    name = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def environment(device) -> dict:
    import deformconv

    device = torch.device(device)
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
        "deformconv": deformconv.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "timer": "median_ms: triton.testing.do_bench median (warmup 25 ms, rep 100 ms); graph_ms: "
                 "triton.testing.do_bench_cudagraph median (rep 100 ms)" if device.type == "cuda"
        else "wall-clock median of 5 runs after one warm-up",
    }
    for mod in ("triton", "torchvision"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return env


def write_results(path: str, env: dict, records: Sequence, benchmark: Optional[str] = None, **sections) -> None:
    """One run of a benchmark as benchmarks/results keeps them: the benchmark's name (default: the running script's,
    less its ``bench_`` prefix), the date, the environment (device, versions, timer: what makes the numbers
    comparable), the records, and any further sections. A path ending in ``.jsonl`` (a device's table:
    benchmarks/results/<device>.jsonl) gets the run appended as one line; any other path gets the run alone, as
    JSON."""
    if benchmark is None:
        benchmark = os.path.splitext(os.path.basename(sys.argv[0]))[0].removeprefix("bench_")
    run = {"benchmark": benchmark, "date": env.get("date"), "environment": env, "records": list(records), **sections}
    if str(path).endswith(".jsonl"):
        with open(path, "a") as f:
            f.write(json.dumps(run, separators=(",", ":")) + "\n")
    else:
        with open(path, "w") as f:
            json.dump(run, f, indent=1)


def table(records: Sequence[dict], field: str = "median_ms") -> str:
    """Markdown table: each shape, dtype and pass with every implementation's median (``field``:
    "median_ms", eager do_bench, or "graph_ms", CUDA-graph replay) and the ratios."""
    def label(r):
        return r["impl"] if r["backend"] is None else f"{r['impl']}[{r['backend']}]"

    cols = list(dict.fromkeys(label(r) for r in records))
    records = [r for r in records if r.get("mode", "default") == "default"]
    idx = {(r["shape"], r["dtype"], r["pass"], label(r)): r.get(field) for r in records}
    ours = [c for c in cols if c.startswith("deformconv")]
    head = ["pass", "shape", "dtype"] + [f"{c} ms" for c in cols]
    ratios = ([f"{o}/conv2d" for o in ours if "conv2d" in cols]
              + [f"torchvision/{o}" for o in ours if "torchvision" in cols])
    lines = ["| " + " | ".join(head + ratios) + " |", "|" + "---|" * (len(head) + len(ratios))]
    keys = list(dict.fromkeys((r["pass"], r["shape"], r["dtype"]) for r in records))
    keys.sort(key=lambda k: k[0])
    for p, shape, dtype in keys:
        vals = [idx.get((shape, dtype, p, c)) for c in cols]
        cells = [p, shape, dtype] + [f"{v:.3f}" if isinstance(v, float) else "-" for v in vals]
        for o in ours:
            if "conv2d" in cols:
                a, b = idx.get((shape, dtype, p, o)), idx.get((shape, dtype, p, "conv2d"))
                cells.append(f"{a / b:.2f}" if a and b else "-")
        for o in ours:
            if "torchvision" in cols:
                a, b = idx.get((shape, dtype, p, "torchvision")), idx.get((shape, dtype, p, o))
                cells.append(f"{a / b:.1f}" if a and b else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(records: Sequence[dict]) -> str:
    """Markdown table of forward+backward memory, MiB: each implementation's extra peak and workspace (the
    extra peak less the output and gradients), and the workspace as a multiple of the input's size."""
    def label(r):
        return r["impl"] if r.get("mode", "default") == "default" else f"{r['impl']} ({r['mode']})"

    rows: Dict[Tuple[str, str], Dict[str, dict]] = {}
    for r in records:
        if r["pass"] == "fwd+bwd" and "workspace_mib" in r:
            rows.setdefault((r["shape"], r["dtype"]), {})[label(r)] = r
    impls = list(dict.fromkeys(i for by_impl in rows.values() for i in by_impl))
    head = ["shape", "dtype", "input"] + [f"{i} extra / workspace (x input)" for i in impls]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, dtype), by_impl in rows.items():
        cells = [shape, dtype, f"{next(iter(by_impl.values()))['input_mib']:.1f}"]
        for i in impls:
            r = by_impl.get(i)
            cells.append(f"{r['extra_peak_mib']:.0f} / {r['workspace_mib']:.0f} "
                         f"({r['workspace_mib'] / r['input_mib']:.2f}x)" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
