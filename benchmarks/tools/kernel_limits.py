"""What bounds the gather kernels on a GPU: the backward timed with and without grad_input's scatter (the step left
out and the difference taken), and the kernels run once each for Nsight Compute's hardware counters.

    python benchmarks/tools/kernel_limits.py [--out PATH]                    # the split, CUDA-graph medians
    ncu --clock-control none --profile-from-start off --metrics $(python benchmarks/tools/kernel_limits.py --metrics) \\
        --csv python benchmarks/tools/kernel_limits.py --profile > counters.csv
    python benchmarks/tools/kernel_limits.py --counters counters.csv         # a table of the counters

Loads: deform_conv2d at ResNet-50's stride-1 DCN layers (32 @ 224², bf16, channels_last, as the network runs them)
and DCNv4 at InternImage-T's stage 1 and DCNv4's own layer (fp16), with DCNv4's CUDA kernel where importable
(bench_dcnv.py's docstring says how it is built) and the depthwise 3x3 convolution (cuDNN, channels_last) as the
floor. --profile runs each call twice, then once between cudaProfilerStart and Stop, an NVTX range a call.
docs/tuning.md keeps the outcome.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# the counters --counters prints, and their short names
METRICS = {
    "gpu__time_duration.sum": "ns",
    "launch__registers_per_thread": "regs",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1 %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor %",
    "lts__t_sectors_op_red.sum": "L2 reduction sectors",
    "lts__t_requests_op_red.sum": "L2 reduction requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "L1 load sectors",
    "smsp__inst_executed.sum": "warp instructions",
}
RESNET_LAYERS = [(32, 128, 28, 28), (32, 256, 14, 14), (32, 512, 7, 7)]  # (N, C, H, W), 3x3, stride 1
DCNV4_LOADS = ("internimage-t-s1", "dcnv4-bench")  # bench_dcnv.py's SHAPES


def _resnet_layer(n, c, h, w, gen):
    """A ResNet-50 DCN layer's tensors, bf16 channels_last: (x, offset, weight, bias, mask, grad_out)."""
    bf = torch.bfloat16
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(bf).to(memory_format=torch.channels_last)
    off = (torch.randn(n, 18, h, w, device="cuda", generator=gen) * 2).to(bf)
    wt = (torch.randn(c, c, 3, 3, device="cuda", generator=gen) * (9 * c) ** -0.5).to(bf)
    b = torch.randn(c, device="cuda", generator=gen).to(bf)
    m = torch.rand(n, 9, h, w, device="cuda", generator=gen).to(bf)
    go = torch.randn(n, c, h, w, device="cuda", generator=gen).to(bf).to(memory_format=torch.channels_last)
    return x, off, wt, b, m, go


def _dcnv4_load(name):
    """(x, offset_mask, grad_out, geometry) of bench_dcnv.py's DCNv4 load name, fp16, as that script makes them."""
    import bench_dcnv

    from deformconv.ops.dcnv.geometry import DcnGeometry

    n, h, w, g, d = shape = bench_dcnv.SHAPES[name]
    geo = DcnGeometry(n, h, w, g, d, (3, 3), (1, 1), (1, 1), (1, 1), 1.0, False)
    x, om = (t.detach() for t in bench_dcnv._inputs(shape, torch.float16, "dcnv4"))
    return x, om, torch.randn_like(x), geo


def split_rows():
    """The backward with and without grad_input, and the floor, CUDA-graph medians (ms)."""
    from triton.testing import do_bench_cudagraph as bench

    import deformconv
    from deformconv.ops.dcnv import triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n, c, h, w in RESNET_LAYERS:
        x, off, wt, b, m, go = _resnet_layer(n, c, h, w, gen)
        row = dict(op="deform_conv2d", load=f"{n}x{c}x{h}x{w}")
        row["forward"] = bench(lambda: deformconv.deform_conv2d(x, off, wt, b, 1, 1, 1, m), return_mode="median")
        for label, need_x in (("forward+backward", True), ("forward+backward without grad_input", False)):
            leaves = [x.requires_grad_(need_x), off.requires_grad_(), wt.requires_grad_(), b.requires_grad_(),
                      m.requires_grad_()]
            row[label] = bench(lambda: deformconv.deform_conv2d(x, off, wt, b, 1, 1, 1, m).backward(go),
                               grad_to_none=[t for t in leaves if t.requires_grad], return_mode="median")
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in DCNV4_LOADS:
        x, om, go, geo = _dcnv4_load(name)
        row = dict(op="dcnv4", load=name)
        row["forward"] = bench(lambda: kernels.dcnv4_forward(x, om, geo), return_mode="median")
        for label, needs in (("backward", (True, True)), ("backward without grad_input", (False, True)),
                             ("backward, grad_input only", (True, False))):
            row[label] = bench(lambda: kernels.dcnv4_backward(go, x, om, geo, needs), return_mode="median")
        # the floor as bench_dcnv.py times it: a depthwise 3x3 F.conv2d, channels_last, cuDNN's algorithm benchmarked
        c = x.shape[-1]
        wd = torch.randn(c, 1, 3, 3, device="cuda", generator=gen).half().requires_grad_()
        xc, goc = x.permute(0, 3, 1, 2).detach().requires_grad_(), go.permute(0, 3, 1, 2)
        row["depthwise forward"] = bench(lambda: F.conv2d(xc, wd, padding=1, groups=c), return_mode="median")
        row["depthwise forward+backward"] = bench(lambda: F.conv2d(xc, wd, padding=1, groups=c).backward(goc),
                                                  grad_to_none=[xc, wd], return_mode="median")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def profile() -> None:
    """Each call twice, then once inside the profiler's range (ncu --profile-from-start off)."""
    import deformconv
    from deformconv.ops.dcnv import triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for n, c, h, w in RESNET_LAYERS:
        x, off, wt, b, m, go = _resnet_layer(n, c, h, w, gen)
        for t in (x, off, wt, b, m):
            t.requires_grad_()
        calls.append((f"deform_conv2d {n}x{c}x{h}x{w} forward+backward",
                      lambda x=x, off=off, wt=wt, b=b, m=m, go=go:
                      deformconv.deform_conv2d(x, off, wt, b, 1, 1, 1, m).backward(go)))
    import bench_dcnv

    peer = bench_dcnv._peers()["dcnv4_cuda"]  # a reason (a string) where it is not installed: its rows left out
    for name in DCNV4_LOADS:
        x, om, go, geo = _dcnv4_load(name)
        calls.append((f"dcnv4 {name} forward", lambda x=x, om=om, geo=geo: kernels.dcnv4_forward(x, om, geo)))
        calls.append((f"dcnv4 {name} backward",
                      lambda x=x, om=om, go=go, geo=geo: kernels.dcnv4_backward(go, x, om, geo, (True, True))))
        if callable(peer):
            xx, oo = x.clone().requires_grad_(), om.clone().requires_grad_()
            g, d = geo.group, geo.group_channels
            calls.append((f"DCNv4 CUDA {name} forward+backward",
                          lambda xx=xx, oo=oo, go=go, g=g, d=d:
                          peer(xx, oo, 3, 3, 1, 1, 1, 1, 1, 1, g, d, 1.0, 256, False).backward(go)))
    for _, call in calls:
        call()
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls:
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()


def counters(path: str) -> list:
    """ncu's CSV (--csv, one row a kernel and metric) as one record a kernel, in launch order."""
    with open(path) as f:
        rows = [r for r in csv.reader(f)]
    head = next(r for r in rows if "Metric Name" in r)
    col = {k: head.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
    kernels: dict = {}
    for r in rows:
        if r is head or len(r) < len(head) or r[col["Metric Name"]] not in METRICS:
            continue
        rec = kernels.setdefault(int(r[col["ID"]]), {"kernel": r[col["Kernel Name"]].split("(")[0][:48]})
        rec[METRICS[r[col["Metric Name"]]]] = r[col["Metric Value"]]
    return [kernels[i] for i in sorted(kernels)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="run the calls for ncu")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu")
    ap.add_argument("--counters", help="ncu's CSV: print its table (and add it to --out)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.metrics:
        print(",".join(METRICS))
        return
    if args.profile:
        profile()
        return
    from deformconv.benchmark import environment, write_results

    if args.counters:
        recs = counters(args.counters)
        names = list(METRICS.values())
        print("| kernel | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for r in recs:
            print(f"| {r['kernel']} | " + " | ".join(r.get(k, "") for k in names) + " |")
        if args.out:
            write_results(args.out, environment("cuda"), recs)
        return
    torch.backends.cudnn.benchmark = True
    rows = split_rows()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms, CUDA-graph medians")
    for r in rows:
        print(f"| {r['op']} | {r['load']} | " + " | ".join(f"{k} {v:.3f}" for k, v in r.items()
                                                          if isinstance(v, float)) + " |")
    if args.out:
        write_results(args.out, dict(environment("cuda"), timer="triton.testing.do_bench_cudagraph median, ms"),
                      rows)


if __name__ == "__main__":
    main()
