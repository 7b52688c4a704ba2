"""transformers models on deformconv: a training step and inference, each path side by side in one run.

    python benchmarks/bench_transformers.py [--models deformable_detr rt_detr mask2former] [--paths default deformconv
        deformops] [--dtypes float32 bfloat16] [--modes train infer] [--iters 10] [--out PATH]

Models at their published sizes, random initialisation, nothing downloaded: Deformable DETR (ResNet-50, batch 2 at
800x1216), RT-DETR (ResNet-50-D, batch 8 at 640x640), Mask2Former (Swin-T, batch 4 at 512x512). Random images,
and for the training step random targets (5 boxes an image; Mask2Former 5 masks) through the model's own loss
(Hungarian matching included).

Paths: ``default`` (transformers' own attention), ``deformconv`` (deformconv.integrations.transformers.patch),
``deformops`` (deformops' own transformers patch on its Triton backend, where it patches the model), ``cuda``
(Deformable DETR's own CUDA kernel in place of transformers' attention module, where its extension is importable).
bfloat16 runs under ``torch.autocast``. The paths' models live side by side and their timed steps take turns.
Each row: the median wall time of a step (eager, as a user runs it; synchronised), the GPU time of one step and the
share of it in the attention's kernels (torch.profiler: the sum of the step's kernel times), and peak memory (what
the step allocates beyond what was allocated before it, plus the path's own model, gradients and inputs). A
training step is zero_grad, forward with the loss, backward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = {"deformable_detr": (2, 800, 1216), "rt_detr": (8, 640, 640), "mask2former": (4, 512, 512)}
LABELS = {"deformable_detr": 91, "rt_detr": 80, "mask2former": 150}  # COCO's, and ADE20K's for Mask2Former
# kernel names of the multi-scale attention on each path (the share column)
ATTENTION_KERNELS = ("grid_sampler", "msda", "ms_deform", "deformable")


def build(name: str):
    import transformers as T

    if name == "deformable_detr":
        config = T.DeformableDetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                                        backbone_config=T.ResNetConfig(out_features=["stage2", "stage3", "stage4"]),
                                        num_labels=91)
        return T.DeformableDetrForObjectDetection(config)
    if name == "rt_detr":
        return T.RTDetrForObjectDetection(T.RTDetrConfig(num_labels=80))
    if name == "mask2former":
        swin_t = T.SwinConfig(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24], window_size=7,
                              out_features=["stage1", "stage2", "stage3", "stage4"])
        return T.Mask2FormerForUniversalSegmentation(T.Mask2FormerConfig(backbone_config=swin_t, num_labels=150))
    raise ValueError(f"unknown model {name!r}")


def inputs(name: str, train: bool, device, batch=None, size=None):
    b, h, w = SIZES[name]
    b, h, w = batch or b, (size or (h, w))[0], (size or (h, w))[1]
    g = torch.Generator().manual_seed(0)
    args = {"pixel_values": torch.randn(b, 3, h, w, generator=g).to(device)}
    if not train:
        return args
    if name == "mask2former":
        args["mask_labels"] = [(torch.rand(5, h, w, generator=g) > 0.5).float().to(device) for _ in range(b)]
        args["class_labels"] = [torch.randint(0, LABELS[name], (5,), generator=g).to(device) for _ in range(b)]
    else:
        centre, extent = torch.rand(b, 5, 2, generator=g) * 0.6 + 0.2, torch.rand(b, 5, 2, generator=g) * 0.3 + 0.05
        boxes = torch.cat([centre, extent], -1)
        args["labels"] = [{"class_labels": torch.randint(0, LABELS[name], (5,), generator=g).to(device),
                           "boxes": boxes[i].to(device)} for i in range(b)]
    return args


def apply_path(model, path: str):
    """The model on a path, or the reason it cannot take it."""
    if path == "default":
        return model, None
    if path == "deformconv":
        from deformconv.integrations.transformers import patch

        return patch(model), None
    if path == "deformops":
        try:
            from deformops.integrations.transformers import patch as deformops_patch
        except Exception as e:
            return None, f"deformops is not importable: {type(e).__name__}: {e}"[:200]
        try:  # its Triton backend: its CUDA one compiles an extension on first use, minutes on a fresh machine
            from deformops.registry import Backend

            return deformops_patch(model, backend=Backend.TRITON), None
        except Exception as e:
            return None, f"deformops does not patch it: {type(e).__name__}: {e}"[:200]
    if path == "cuda":
        return _on_original_kernel(model)
    raise ValueError(f"unknown path {path!r}")


def _on_original_kernel(model):
    """Deformable DETR's own CUDA kernel (MSDeformAttnFunction, fp32 only: 16-bit inputs cast to fp32, as its users
    wrap it) in place of transformers' MultiScaleDeformableAttention, where its extension is installed (built on the
    device from its models/ops as bench_msda.py says; nothing of it is part of this repository)."""
    import types

    try:
        from functions import MSDeformAttnFunction
    except Exception as e:
        return None, f"Deformable DETR's extension is not importable: {type(e).__name__}: {e}"[:200]

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step):
        with torch.autocast("cuda", enabled=False):
            return MSDeformAttnFunction.apply(value.float(), value_spatial_shapes, level_start_index,
                                              sampling_locations.float(), attention_weights.float(), im2col_step)

    found = 0
    for m in model.modules():
        if type(m).__name__ == "MultiScaleDeformableAttention":
            m.forward = types.MethodType(forward, m)
            found += 1
    return (model, None) if found else (None, "no MultiScaleDeformableAttention module")


def step_fn(model, args, train: bool, dtype):
    autocast = torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32)

    def train_step():
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = model(**args).loss
        loss.backward()

    def infer():
        with torch.no_grad(), autocast:
            model(**args)

    return train_step if train else infer


def gpu_time(step) -> tuple:
    """(ms of kernels in one step, ms of them in the attention's kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = attention = 0.0
    for event in prof.key_averages():
        t = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        total += t
        if any(k in event.key.lower() for k in ATTENTION_KERNELS):
            attention += t
    return total / 1e3, attention / 1e3


def _resident_mib(model, args) -> float:
    """MiB held by one path's model (parameters, buffers, gradients) and inputs: its share of what is allocated."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [t for v in args.values() for t in (v if isinstance(v, list) else [v])
                for t in (t.values() if isinstance(t, dict) else [t])]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total / 2**20


def measure(name, paths, dtype, train, iters, compiled=False, warmup=3):
    """{path: record}: every path's model built, warmed and then timed in turns (step i of each path, then step i + 1),
    so that a drift of the host's speed during the run falls on every path alike."""
    import transformers

    steps, records, models = {}, {}, {}
    for path in paths:
        try:
            torch.manual_seed(0)
            model, why = apply_path(build(name).cuda().train(train), path)
            if model is None:
                records[path] = {"skipped": why}
                continue
            args = inputs(name, train, "cuda")
            # torch.compile's default mode over the model (the loss's Hungarian matching runs on the host between
            # graphs)
            step = step_fn(torch.compile(model) if compiled else model, args, train, dtype)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first = (time.perf_counter() - t0) * 1e3
            for _ in range(warmup):
                step()
            torch.cuda.synchronize()
            # peak: what the step adds to what is allocated, plus this path's own model and inputs
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before + _resident_mib(model, args) * 2**20
            steps[path], models[path] = step, (model, args)
            records[path] = {"first_ms": first, "peak_mib": peak / 2**20, "times": [],
                             "transformers": transformers.__version__}
        except Exception as e:  # a path that fails at this load: recorded, the run goes on
            records[path] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for _ in range(iters):
        for path, step in steps.items():
            try:
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                records[path]["times"].append((time.perf_counter() - t0) * 1e3)
            except Exception as e:
                records[path] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for path, step in steps.items():
        r = records[path]
        if "error" in r:
            continue
        r["ms"] = statistics.median(r.pop("times"))
        r["gpu_ms"], r["attention_gpu_ms"] = gpu_time(step)
    del steps, models
    torch.cuda.empty_cache()
    return records


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SIZES))
    ap.add_argument("--paths", nargs="+", default=["default", "deformconv", "deformops"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=["train", "infer"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (the first step compiles)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    from deformconv.benchmark import environment, write_results

    records = []
    print(f"{'model':<16} {'mode':<6} {'dtype':<9} {'path':<11} {'ms':>8} {'GPU ms':>8} {'attn GPU':>9} "
          f"{'peak MiB':>9}  first ms")
    for name in a.models:
        for mode in a.modes:
            for dt in a.dtypes:
                results = measure(name, a.paths, getattr(torch, dt), mode == "train", a.iters, a.compile)
                for path, r in results.items():
                    r.update(model=name, mode=mode, dtype=dt, path=path, compiled=a.compile)
                    records.append(r)
                    if "ms" in r:
                        print(f"{name:<16} {mode:<6} {dt:<9} {path:<11} {r['ms']:>8.2f} {r['gpu_ms']:>8.2f} "
                              f"{r['attention_gpu_ms']:>9.2f} {r['peak_mib']:>9.0f}  {r['first_ms']:.0f}", flush=True)
                    else:
                        print(f"{name:<16} {mode:<6} {dt:<9} {path:<11} {r.get('skipped') or r.get('error')}",
                              flush=True)
    if a.out:
        env = environment("cuda")
        env["timer"] = ("ms: median wall time of synchronised eager steps; gpu_ms, attention_gpu_ms: torch.profiler's "
                        "kernel times of one step")
        write_results(a.out, env, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
