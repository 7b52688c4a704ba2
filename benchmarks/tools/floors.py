"""The floor of each kernel at its benchmark loads: the bytes it must move and the FLOPs it must do, the time those
take at the GPU's peak bandwidth and throughput, and the fraction of that floor a recorded run reaches (issue #64).

    python benchmarks/tools/floors.py [--markdown]

Bytes: every tensor the pass must read or write, once (the sampled input read once, as if its gathers all hit
cache; a gather that cannot reuse its corners moves more). FLOPs: the GEMMs' 2·M·N·K on the tensor cores; the
sampling's multiply-adds (bilinear: 4 corner FMAs a sampled value; its gradients: the corner values times the
weights' derivatives, the scatter's 4 adds) on the CUDA cores. Floor = the largest of bytes / bandwidth, tensor
FLOPs / tensor peak, CUDA-core FLOPs / fp32 peak. Times are the records' CUDA-graph medians (GPU time; the host
excluded), from benchmarks/results. Peaks: NVIDIA's datasheets (SXM parts; dense, no sparsity).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(__file__), "..", "results")

# bytes/s, tensor FLOP/s by dtype (fp32 as TF32), CUDA-core fp32 FLOP/s
PEAKS = {
    "NVIDIA H100 80GB HBM3": dict(bw=3.35e12, tensor={"float16": 989e12, "bfloat16": 989e12, "float32": 494e12},
                                  simt=67e12),
    "NVIDIA H200": dict(bw=4.8e12, tensor={"float16": 989e12, "bfloat16": 989e12, "float32": 494e12}, simt=67e12),
}
SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def _run(device_file: str, benchmark: str, variant=None, triton=None) -> dict:
    with open(os.path.join(RESULTS, device_file)) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    found = [r for r in runs if r["benchmark"] == benchmark and r.get("variant") == variant
             and (triton is None or r.get("environment", {}).get("triton") == triton)]
    if not found:
        raise SystemExit(f"no run of {benchmark} {variant or ''} in {device_file}")
    return found[-1]


def _row(kernel, load, dtype, device, bytes_, tensor_flops, simt_flops, ms, peer_ms=None) -> dict:
    p = PEAKS[device]
    floor_s = max(bytes_ / p["bw"], tensor_flops / p["tensor"][dtype], simt_flops / p["simt"])
    bound = max((("memory", bytes_ / p["bw"]), ("tensor", tensor_flops / p["tensor"][dtype]),
                 ("CUDA cores", simt_flops / p["simt"])), key=lambda t: t[1])[0]
    row = dict(kernel=kernel, load=load, dtype=dtype, device=device, mib=bytes_ / 2 ** 20, gflop=tensor_flops / 1e9,
               simt_gflop=simt_flops / 1e9, floor_ms=floor_s * 1e3, bound=bound, ms=ms,
               of_floor=floor_s * 1e3 / ms if ms else None, bw_fraction=bytes_ / (ms * 1e-3) / p["bw"] if ms else None)
    if peer_ms:
        row["peer_ms"], row["peer_of_floor"] = peer_ms, floor_s * 1e3 / peer_ms
    return row


def deform_conv2d_rows() -> list:
    """deform_conv2d at the five backbone layers (H200, Triton 3.6), forward and forward+backward, beside cuDNN's
    dense convolution of the same shape (the peer column: how near the floor a dense kernel gets)."""
    run = _run("h200.jsonl", "deform_conv2d", triton="3.6.0")
    device = run["environment"]["device"]
    dense = {(r["shape"], r["dtype"], r["pass"]): r.get("graph_ms") for r in run["records"] if r["impl"] == "conv2d"}
    rows = []
    for r in run["records"]:
        if r["impl"] != "deformconv" or not r.get("graph_ms"):
            continue
        e, n, cin, cout, h, w, k, g = SIZE[r["dtype"]], r["N"], r["Cin"], r["Cout"], r["H"], r["W"], r["k"], \
            r["offset_groups"]
        K, L = k * k, h * w  # stride 1, padding k // 2
        x, om, wt, y = n * cin * h * w, n * g * K * L * 3, cout * cin * K, n * cout * L  # offsets 2, mask 1 a tap
        gemm = 2 * n * cout * cin * K * L
        sample = 8 * n * cin * K * L
        if r["pass"] == "fwd":
            rows.append(_row("deform_conv2d fwd", r["shape"], r["dtype"], device, e * (x + om + wt + y), gemm, sample,
                             r["graph_ms"], dense.get((r["shape"], r["dtype"], r["pass"]))))
        else:  # the backward reads grad_out and the operands again and writes a gradient of each operand
            both = (x + om + wt + y) + (y + 2 * (x + om + wt))
            # GEMMs: the forward's, grad_input's columns and grad_weight; sampling: the forward's, the backward's
            # recomputed samples, the offsets' derivatives (2 a corner) and the scatter
            rows.append(_row("deform_conv2d fwd+bwd", r["shape"], r["dtype"], device, e * both, 3 * gemm, 5 * sample,
                             r["graph_ms"], dense.get((r["shape"], r["dtype"], r["pass"]))))
    return rows


def dcnv4_rows() -> list:
    """DCNv4's forward at InternImage-T's stages (H100, fp16), beside DCNv4's CUDA kernel."""
    run = _run("h100.jsonl", "dcnv")
    device = run["environment"]["device"]
    rows = []
    for r in run["records"]:
        n, h, w, g = r["N"], r["H"], r["W"], r["G"]
        e, K, c = SIZE[r["dtype"]], 9, g * r["D"]
        om = -(-3 * g * K // 8) * 8  # offset_mask's channels, padded to 8
        bytes_ = e * (n * h * w * c * 2 + n * h * w * om)
        simt = n * h * w * c * K * 8 + n * h * w * g * K * 30  # 4 corner FMAs a value; a point's index math
        rows.append(_row("dcnv4 fwd", r["shape"], r["dtype"], device, bytes_, 0, simt,
                         r.get("dcnv4_triton_fwd_graph_ms"), r.get("dcnv4_cuda_fwd_graph_ms")))
    return rows


def roi_pool_rows() -> list:
    """Deformable RoI pooling's forward at the FPN loads (H100, fp32; 2 images, 256 channels, 1024 RoIs, 7×7 bins),
    beside roi_align (the same reads without the offsets)."""
    run = _run("h100.jsonl", "roi_pool")
    device = run["environment"]["device"]
    sizes = {"p2-200x304": (200, 304), "p4-50x76": (50, 76)}
    rows = []
    for r in run["records"]:
        h, w = sizes[r["level"]]
        e, c, rois, bins = SIZE[r["dtype"]], 256, r["rois"], 49
        samples = 4 if r["sampling_ratio"] == 2 else None  # adaptive: depends on the boxes
        gathered = rois * bins * c * (samples or 1) * 4
        bytes_ = e * (min(2 * c * h * w, gathered) + rois * c * bins + rois * 2 * bins + rois * 5)
        simt = gathered * 2 if samples else 0
        load = f"{r['level']} sr{r['sampling_ratio']}"
        rows.append(_row("deform_roi_pool fwd", load, r["dtype"], device, bytes_, 0, simt,
                         r["deformconv_fwd_graph_ms"], r["roi_align_fwd_graph_ms"]))
    return rows


def msda_rows() -> list:
    """Multi-scale deformable attention's forward+backward at Deformable DETR's loads (H100; batch 2, M 8, D 32,
    4 levels × 4 points), beside Deformable DETR's CUDA kernel (fp32 only)."""
    run = _run("h100.jsonl", "msda", "shared-helpers")
    device = run["environment"]["device"]
    value_rows = (100 * 150 + 50 * 75 + 25 * 38 + 13 * 19)  # the encoder's four levels, rows of M·D
    rows = []
    for r in run["records"]:
        e, n, m, d, lp = SIZE[r["dtype"]], 2, 8, 32, 16
        q = r["queries"]
        value = n * value_rows * m * d
        gathered = n * q * m * lp * 4 * d
        points = n * q * m * lp
        # forward: value (its gathered share), locations (fp32) and weights, the output; backward: grad_out, the
        # same reads, grad_value (a dense tensor: written whole, once), grad_locations, grad_weights
        fwd = e * min(value, gathered) + 4 * points * 2 + e * points + e * n * q * m * d
        back = e * n * q * m * d + e * min(value, gathered) + 4 * points * 2 + e * points + e * value \
            + 4 * points * 2 + e * points
        simt = gathered * 2 * 4  # the forward's blend, the backward's blend, derivatives and scatter
        rows.append(_row("ms_deform_attn fwd+bwd", r["load"], r["dtype"], device, fwd + back, 0, simt,
                         r.get("triton_fb_graph_ms"), r.get("cuda_fb_graph_ms")))
    return rows


def table(rows: list) -> str:
    lines = ["| kernel | load | dtype | MiB | tensor GFLOP | CUDA-core GFLOP | floor ms (bound) | ours ms | ours at "
             "floor | peer at floor |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['peer_of_floor']:.0%}" if r.get("peer_of_floor") else "-"
        ours = f"{r['of_floor']:.0%}" if r.get("of_floor") else "-"
        lines.append(f"| {r['kernel']} | {r['load']} | {r['dtype']} | {r['mib']:.0f} | {r['gflop']:.1f} | "
                     f"{r['simt_gflop']:.1f} | {r['floor_ms']:.3f} ({r['bound']}) | "
                     f"{r['ms']:.3f} | {ours} | {peer} |" if r["ms"] else "")
    return "\n".join(line for line in lines if line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    rows = deform_conv2d_rows() + dcnv4_rows() + roi_pool_rows() + msda_rows()
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
