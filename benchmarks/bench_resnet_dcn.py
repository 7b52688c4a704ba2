"""The real network: ResNet-50 with DCNv2 in stages c3-c5 (mmdetection's stage_with_dcn = (False, True, True,
True), built with deformconv.make_deformable), on deformconv and on torchvision.ops.deform_conv2d, against plain
ResNet-50 with the same weights.

    python benchmarks/bench_resnet_dcn.py [--cases ...] [--modes eager default reduce-overhead] [--layers] [--out PATH]

Per case (batch @ resolution, autocast dtype): a training step (forward, cross-entropy or a feature sum at detection
resolution, backward, SGD step) and an inference forward, each the median wall time of 30 steps after 10 warm-up
steps (synchronised each step: what a training loop sees, host included), and the peak memory of a step. --layers
adds the GPU time (CUDA-graph replay) of forward+backward at each distinct DCN layer shape of the network, against
cuDNN's plain convolution and torchvision's eager call. Compiled modes take the op as DEFORMCONV_COMPILE_KERNELS says
(`1`: decomposed into its kernels; each record says which). deformconv's net compiles with torch's compile caches off
unless --warm-caches (compile_caches): its compile time is then a cold one, and no graph traced under other deformconv
options is served. --isolate runs every net, case and mode in a process of its own, all compiling at once and then
timed one at a time, alone on the host and the GPU (run_isolated): less wall time where compiling dominates; the
compile times are then those of compiles side by side.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

CASES = {"b32-224": (32, 224, 224), "b2-800x1216": (2, 800, 1216)}


class TorchvisionModulatedDeformConv2dPack(nn.Module):
    """The same layer (parameters and offset conv) as deformconv's ModulatedDeformConv2dPack, on torchvision's op, its
    offset and mask split as mmcv's layer splits them (torch's slices and sigmoid)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        import torchvision

        L = self.layer
        out = L.conv_offset(x)
        n_off = 2 * L.offset_groups * L.kernel_size[0] * L.kernel_size[1]
        offset, mask = out[:, :n_off], torch.sigmoid(out[:, n_off:])
        return torchvision.ops.deform_conv2d(x, offset, L.weight, L.bias, L.stride, L.padding, L.dilation, mask)


def build(kind: str, base: nn.Module) -> nn.Module:
    import deformconv

    net = copy.deepcopy(base)
    if kind == "plain":
        return net
    deformconv.make_deformable(net, deformconv.resnet_stages((False, True, True, True)))
    torch.manual_seed(1)
    for m in net.modules():  # offsets that move the samples (a trained net's are not zero)
        if isinstance(m, deformconv.ModulatedDeformConv2dPack):
            nn.init.normal_(m.conv_offset.weight, std=0.01)
    if kind == "torchvision":
        for name, m in list(net.named_modules()):
            if isinstance(m, deformconv.ModulatedDeformConv2dPack):
                parent, _, child = name.rpartition(".")
                setattr(net.get_submodule(parent), child, TorchvisionModulatedDeformConv2dPack(m))
    return net


def timed(step, steps=30, warmup=10):
    """(median ms of synchronised steps, peak MiB allocated, peak MiB reserved, both over the warm-up and the timed
    steps). Called after the first step (compilation, autotuning, cuDNN's search), so the peaks are the steady step's.
    Under CUDA graphs (mode="reduce-overhead") the warm-up records the graphs: allocations while recording count (the
    graphs' private pool), replays allocate nothing. The reserved peak also holds what the allocator kept from the first
    step (the cache is not emptied here: the recorded graphs' pools are what the peaks are meant to count)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20


def case_steps(kind: str, base: nn.Module, case: str, dtype, mode: str):
    """(net, train_step, infer_step) of a case: the network (built, on the GPU, channels_last; at detection
    resolution its features, no classifier) and its SGD training step (forward, cross-entropy or a feature sum,
    backward, step) and inference forward under autocast to dtype, eager or compiled in mode."""
    n, h, w = CASES[case]
    net = build(kind, base).cuda().to(memory_format=torch.channels_last)
    if h != w:  # detection resolution: the backbone's features, no classifier
        net.fc = nn.Identity()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, 3, h, w, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (n,), device="cuda", generator=g)
    fwd = net if mode == "eager" else torch.compile(net, mode=None if mode == "default" else mode)

    def loss_of(out):
        return F.cross_entropy(out.float(), y) if h == w else out.float().square().mean()

    def train_step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_of(fwd(x))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def infer_step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            fwd(x)

    return net, train_step, infer_step


def resnet50_base() -> nn.Module:
    """The seeded ResNet-50 every network of a run is built from (cuDNN benchmarking on); exits without a GPU."""
    import torchvision

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    return torchvision.models.resnet50()


def run_case(kind, base, case, dtype, mode, log, turn=lambda: None):
    """A case's record: built, its first training step (compiling under torch.compile), then turn() (run_isolated: wait
    for the GPU to itself), then the timed training and inference steps. An error is recorded, not raised."""
    from deformconv import config

    rec = dict(net=kind, case=case, dtype=str(dtype).split(".")[-1], mode=mode)
    if mode != "eager":
        rec["compile_kernels"] = config.compile_kernels()  # DEFORMCONV_COMPILE_KERNELS
        rec["compile_caches"] = compile_caches(kind)
        torch.compiler.config.force_disable_caches = not rec["compile_caches"]
    try:
        net, train_step, infer_step = case_steps(kind, base, case, dtype, mode)
        net.train()
        t0 = time.perf_counter()
        train_step()
        torch.cuda.synchronize()
        rec["first_train_step_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:  # e.g. torchvision has no bf16 kernel: recorded, not fatal
        _record_error(rec, e)
        net = None
    turn()
    if net is not None:
        try:
            rec["train_ms"], rec["train_peak_mib"], rec["train_reserved_mib"] = timed(train_step)
            net.eval()
            infer_step()  # under torch.compile: the inference graph's compilation, outside timed()'s peaks
            rec["infer_ms"], rec["infer_peak_mib"], rec["infer_reserved_mib"] = timed(infer_step)
        except Exception as e:
            _record_error(rec, e)
    log(rec)
    return rec


def _record_error(rec, e):
    import traceback

    rec["error"] = f"{type(e).__name__}: {e}"[:200]
    rec["traceback"] = traceback.format_exc()[-1500:]


def run_isolated(specs, settings, log, worker=None):
    """Records of specs, (net, case, dtype name, mode) each, every one in a process of its own, the processes started
    together: they build and compile at once (CPU work, most of a compiled case's time), then time one at a time, the
    others waiting idle, so that no timing shares the host or the GPU. Each record's compiled_beside says how many
    other processes were compiling meanwhile (its first_train_step_s is that long, not a lone compile's). What the first
    steps choose by timing (cuDNN's algorithm search, Inductor's runtime choice among a kernel's configs) they time side
    by side too. settings: main's arguments, as a dict; worker (a test's stand-in) takes _isolated_case's arguments."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")  # CUDA in each child
    results = ctx.Queue()
    workers = []
    for spec in specs:
        ready, go = ctx.Event(), ctx.Event()
        p = ctx.Process(target=worker or _isolated_case, args=(spec, settings, ready, go, results), daemon=True)
        p.start()
        workers.append((spec, p, ready, go))
    for _, p, ready, _ in workers:  # every compile done before the first timing
        while not ready.wait(1) and p.is_alive():
            pass
    records = []
    for (kind, case, dt, mode), p, _, go in workers:
        go.set()
        rec = None
        while rec is None:
            try:
                rec = results.get(timeout=1)
            except queue.Empty:
                if not p.is_alive() and results.empty():
                    rec = dict(net=kind, case=case, dtype=dt, mode=mode,
                               error=f"its process ended with exit code {p.exitcode} and no record")
        p.join()
        rec["compiled_beside"] = len(workers) - 1
        log(rec)
        records.append(rec)
    return records


def _isolated_case(spec, settings, ready, go, results):
    """run_isolated's process of one spec: ready set once its first step is done (or failed), go awaited, its record
    put in results."""
    kind, case, dt, mode = spec

    def turn():
        ready.set()
        go.wait()

    apply_settings(argparse.Namespace(**settings))
    try:
        rec = run_case(kind, resnet50_base(), case, getattr(torch, dt), mode, log=lambda r: None, turn=turn)
    except BaseException as e:  # not a case's error (run_case records those): still a record, so that none waits
        rec = dict(net=kind, case=case, dtype=dt, mode=mode)
        _record_error(rec, e)
    turn()  # where run_case did not get there
    results.put(rec)


def layer_shapes(case):
    """(N, Cin, H, W, stride) of each distinct DCN layer of ResNet-50 c3-c5 at a case: each stage's strided first
    block, then its other blocks."""
    n, h, w = CASES[case]
    shapes, size = [], (h // 4, w // 4)
    for cin in (128, 256, 512):
        shapes.append((n, cin, size[0], size[1], 2))  # torchvision's ResNet-50 strides the 3x3 conv
        size = ((size[0] + 1) // 2, (size[1] + 1) // 2)
        shapes.append((n, cin, size[0], size[1], 1))
    return shapes


def layer_times(case, dtype, log):
    import torchvision
    from triton.testing import do_bench, do_bench_cudagraph

    import deformconv

    rows = []
    for n, c, h, w, s in layer_shapes(case):
        ho, wo = (h - 1) // s + 1, (w - 1) // s + 1
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *sz, scale=1.0: (torch.randn(*sz, device="cuda", generator=g) * scale).to(dtype).requires_grad_()  # noqa: E731
        x, off, wt, b = mk(n, c, h, w), mk(n, 18, ho, wo, scale=2.0), mk(c, c, 3, 3, scale=(9 * c) ** -0.5), mk(c)
        m = torch.rand(n, 9, ho, wo, device="cuda", generator=g).to(dtype).requires_grad_()
        gout = torch.randn(n, c, ho, wo, device="cuda", generator=g).to(dtype)
        leaves = [x, off, wt, b, m]
        fns = {"deformconv": lambda: deformconv.deform_conv2d(x, off, wt, b, s, 1, 1, m),
               "conv2d": lambda: F.conv2d(x, wt, b, s, 1),
               "torchvision": lambda: torchvision.ops.deform_conv2d(x, off, wt, b, s, 1, 1, m)}
        row = dict(case=case, dtype=str(dtype).split(".")[-1], N=n, C=c, H=h, W=w, stride=s)
        for name, fn in fns.items():
            def step(fn=fn):
                fn().backward(gout)
            try:
                step()
                row[f"{name}_fb_ms"] = do_bench(step, grad_to_none=leaves, return_mode="median")
                if name != "torchvision":
                    row[f"{name}_fb_graph_ms"] = do_bench_cudagraph(step, grad_to_none=leaves, return_mode="median")
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:120]
        log(row)
        rows.append(row)
    return rows


def add_route_args(ap: argparse.ArgumentParser) -> None:
    """The backward's column routes (ops/deform_conv2d/triton/columns.py) as command-line switches."""
    ap.add_argument("--columns-grad-weight", choices=["on", "off"], help="grad_weight through the column buffer "
                    "wherever usable, or never (options.columns_grad_weight; unset: columns.columns_usable's rule)")
    ap.add_argument("--columns-grad-data", choices=["on", "off"], help="grad_input, grad_offset and grad_mask through "
                    "cuBLAS's grad_col rows wherever usable, or never (options.columns_grad_data; unset: "
                    "columns.grad_columns_usable's rule)")
    ap.add_argument("--mask-logits", choices=["on", "off"], help="the modulated layers' offset conv outputs read by "
                    "the kernels as they are, or split into offset and mask copies first (options.mask_logits; "
                    "unset: on)")


def apply_route_args(args: argparse.Namespace) -> None:
    """Sets the options that add_route_args' switches ask for, for the rest of the process."""
    from deformconv.config import options

    if args.columns_grad_weight:
        options.columns_grad_weight = args.columns_grad_weight == "on"
    if args.columns_grad_data:
        options.columns_grad_data = args.columns_grad_data == "on"
    if args.mask_logits:
        options.mask_logits = args.mask_logits == "on"


# --warm-caches (apply_settings): torch's compile caches on for every net. See compile_caches.
WARM_CACHES = False


def compile_caches(kind: str) -> bool:
    """Whether the net kind compiles with torch's compile caches on: deformconv's only with --warm-caches, for the
    caches key on the kernels' source, not on the deformconv options that chose them (docs/design.md), so they could
    serve a graph traced under other options; the other nets always: torchvision's compiled step crashed with them off
    and ran with them on (benchmarks/README.md, compiled)."""
    return WARM_CACHES or kind != "deformconv"


def apply_settings(args: argparse.Namespace) -> None:
    """main's arguments that set the process up, in main and in each of run_isolated's processes: the column routes
    and --warm-caches."""
    global WARM_CACHES
    apply_route_args(args)
    WARM_CACHES = args.warm_caches


def main(argv=None):
    from deformconv.benchmark import environment, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["b32-224:bfloat16", "b32-224:float16", "b2-800x1216:bfloat16"],
                    help="case:dtype, cases: " + ", ".join(CASES))
    ap.add_argument("--nets", nargs="+", default=["plain", "deformconv", "torchvision"])
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=["eager", "default", "reduce-overhead"])
    ap.add_argument("--layers", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--warm-caches", action="store_true", help="deformconv's compiled net may take graphs from torch's "
                    "compile caches too (compile_caches)")
    ap.add_argument("--isolate", action="store_true", help="each net, case and mode in a process of its own, all "
                    "compiling at once, then timed one at a time (run_isolated)")
    add_route_args(ap)
    args = ap.parse_args(argv)
    apply_settings(args)
    log = lambda r: print(json.dumps(r), flush=True)  # noqa: E731
    specs = [(kind, *spec.split(":"), mode) for spec in args.cases for mode in args.modes for kind in args.nets]
    if args.isolate:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU")
        records = run_isolated(specs, vars(args), log)
    else:
        base = resnet50_base()
        records = []
        for kind, case, dt, mode in specs:
            records.append(run_case(kind, base, case, getattr(torch, dt), mode, log))
            torch.cuda.empty_cache()
    layers = []
    if args.layers:
        for spec in args.cases:
            case, dt = spec.split(":")
            layers += layer_times(case, getattr(torch, dt), log)
    print("\n| case | dtype | mode | net | train step ms | inference ms | train peak MiB | train reserved MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['case']} | {r['dtype']} | {r['mode']} | {r['net']} | {r.get('train_ms', float('nan')):.1f} | "
              f"{r.get('infer_ms', float('nan')):.1f} | {r.get('train_peak_mib', float('nan')):.0f} | "
              f"{r.get('train_reserved_mib', float('nan')):.0f} |")
    if layers:
        print("\n| case | dtype | N, C, HxW, stride | ours fwd+bwd GPU ms | conv GPU ms | ours/conv | ours eager "
              "| tv eager |")
        print("|---|---|---|---|---|---|---|---|")
        for r in layers:
            ours, conv = r.get("deformconv_fb_graph_ms"), r.get("conv2d_fb_graph_ms")
            print(f"| {r['case']} | {r['dtype']} | {r['N']}, {r['C']}, {r['H']}x{r['W']}, {r['stride']} | "
                  f"{ours:.3f} | {conv:.3f} | {ours / conv:.2f} | {r.get('deformconv_fb_ms', 0):.3f} | "
                  f"{r.get('torchvision_fb_ms', float('nan')):.3f} |")
    if args.out:
        env = dict(environment("cuda"), columns_grad_weight=args.columns_grad_weight,
                   columns_grad_data=args.columns_grad_data, mask_logits=args.mask_logits or "on",
                   warm_caches=args.warm_caches)
        env["timer"] = ("records (steps): median wall ms of 30 steps, each synchronised, after 10 warm-up steps "
                        "(timed); layers: " + env["timer"])
        write_results(args.out, env, records, layers=layers)


if __name__ == "__main__":
    main()
