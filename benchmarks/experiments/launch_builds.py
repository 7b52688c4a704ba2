"""Record the product's kernel launches, then build them for sm_90 under any Triton and compare the builds.

    # on the GPU (or, for a smoke test, the CPU under TRITON_INTERPRET=1): every launch of an fwd+bwd step at each shape
    # and dtype, recorded without running a kernel
    PYTHONPATH=src python benchmarks/experiments/launch_builds.py record --out launches.json
    # anywhere (no GPU): the three main kernels of each recorded launch built for sm_90 with this Python's Triton
    PYTHONPATH=src python benchmarks/experiments/launch_builds.py build launches.json
    # the same under another Triton, in a virtual environment without torch (the kernels' module is imported with
    # torch mocked and without the package's __init__)
    /tmp/v36/bin/python benchmarks/experiments/launch_builds.py build launches.json --src src --stub-torch

Each build prints its registers, stack (spills), the K loop's SASS instruction count (ptx_summary.k_loop) and a hash
of its SASS without line information: two builds with the same hash run the same instructions. v29 found Triton 3.8's
regressions this way (benchmarks/NOTES.md): the records come from the device, because the configs depend on the GPU
(its multiprocessor count, TMA, side streams), and the builds need no GPU at all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import types

MAIN_KERNELS = ("_deform_conv2d_fwd_kernel", "_deform_conv2d_bwd_data_kernel", "_deform_conv2d_bwd_weight_kernel")
TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "int64": "i64"}
OPTIONS = ("num_warps", "num_stages", "maxnreg")


def kernels_module(src: str = "", stub_torch: bool = False):
    """deformconv.ops.deform_conv2d: imported normally, or from src (a checkout's src/ folder) without the package's
    __init__, and with stub_torch against a mocked torch (the kernels need none; a Triton in a venv without torch)."""
    if stub_torch:
        from unittest import mock
        fake = mock.MagicMock()
        for name in ("torch", "torch.nn", "torch.nn.functional", "torch.library", "torch.autograd",
                     "torch.autograd.function", "torch._C"):
            sys.modules.setdefault(name, fake)
    if src:
        package = types.ModuleType("deformconv")
        package.__path__ = [os.path.join(os.path.abspath(src), "deformconv")]
        sys.modules["deformconv"] = package
    import deformconv.ops.deform_conv2d as kernels
    return kernels


# --- record ---

def record(shapes: dict, dtypes, device) -> list:
    """The launches of one fwd+bwd step (all five gradients) of each shape and dtype, each _Launch once: kernel name,
    grid, operands ("ptr", dtype) or ("desc", dtype, block shape), integer arguments and meta (constexprs and launch
    options). No kernel runs: the results are garbage, the launches are the product's."""
    import torch

    import deformconv
    import deformconv.ops.deform_conv2d as kernels
    from deformconv.benchmark import DTYPES, make_inputs

    launches, where = [], {}

    def remember(run, *tensors):
        if getattr(run, "_recorded", False):
            return
        run._recorded = True
        ops = [["ptr", str(t.dtype).replace("torch.", "")] if isinstance(t, torch.Tensor)
               else ["desc", str(t.base.dtype).replace("torch.", ""), [int(b) for b in t.block_shape]] for t in tensors]
        launches.append(dict(where, fn=run.fn.__name__, grid=list(run.grid), ops=ops, args=[int(a) for a in run.args],
                             meta=dict(run.meta)))

    launch = kernels._Launch.__call__
    kernels._Launch.__call__ = remember
    try:
        for name, shape in shapes.items():
            for dtype in dtypes:
                where.update(shape=name, dtype=dtype)
                x, off, w, b, m = make_inputs(shape, DTYPES[dtype], device, requires_grad=True)
                pad = shape[5] // 2
                out = deformconv.deform_conv2d(x, off, w, b, (1, 1), (pad, pad), (1, 1), mask=m, backend="triton")
                out.backward(torch.randn_like(out))
    finally:
        kernels._Launch.__call__ = launch
    return launches


# --- build ---

def compile_launch(kernels, launch: dict):
    """The compiled kernel (sm_90) of one recorded launch, through ptx_summary.compile_kernel."""
    from ptx_summary import compile_kernel

    fn = getattr(kernels, launch["fn"])
    pointers = {}
    for name, op in zip(fn.arg_names, launch["ops"]):
        kind = TRITON_TYPES[op[1]]
        pointers[name] = "*" + kind if op[0] == "ptr" else f"tensordesc<{kind}[{','.join(map(str, op[2]))}]>"
    ints = dict(zip(fn.arg_names[len(launch["ops"]):], launch["args"]))
    meta = dict(launch["meta"])
    options = {k: meta.pop(k) for k in OPTIONS if k in meta}
    return compile_kernel(fn, pointers, meta, ints, options["num_warps"], options.get("num_stages", 2),
                          maxnreg=options.get("maxnreg"))


def sass_hash(sass: str) -> str:
    """12 hex digits of the SASS instructions of a kernel's `cuobjdump -sass` text (no line information), '' for none."""
    code = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,6}\*/\s+([^;]*;)", sass)]
    return hashlib.sha1("\n".join(code).encode()).hexdigest()[:12] if code else ""


def build(launches: list, kernels, log=print) -> list:
    """One line per distinct main-kernel launch: shape, dtype, kernel, tile and options, ptx_summary's resources and K
    loop, and sass_hash."""
    from ptx_summary import _cuobjdump, k_loop, resources

    lines, seen = [], set()
    for launch in launches:
        key = (launch["fn"], json.dumps(launch["meta"], sort_keys=True), json.dumps(launch["ops"]),
               json.dumps(launch["args"]))
        if launch["fn"] not in MAIN_KERNELS or key in seen:
            continue
        seen.add(key)
        m = launch["meta"]
        compiled = compile_launch(kernels, launch)
        sass = _cuobjdump(compiled, "-sass")  # read once for the K loop and the hash
        tile = "x".join(str(m.get(k)) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        opts = " ".join(f"{k}={m[k]}" for k in OPTIONS if k in m)
        line = (f"{launch['shape']} {launch['dtype']} {launch['fn'][len('_deform_conv2d_'):-len('_kernel')]} {tile} "
                f"{opts} {resources(compiled)}{k_loop(compiled, sass).split(' BAR')[0]} sass={sass_hash(sass)}")
        lines.append(line)
        log(line)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record an fwd+bwd step's launches (GPU, or CPU under TRITON_INTERPRET=1)")
    rec.add_argument("--shape", help="one shape N,Cin,Cout,H,W,k,offset_groups instead of the benchmark's five")
    rec.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    rec.add_argument("--out", required=True)
    bld = sub.add_parser("build", help="build the recorded launches for sm_90 with this Python's Triton")
    bld.add_argument("launches")
    bld.add_argument("--src", default="", help="import the kernels from this src/ folder (without the package)")
    bld.add_argument("--stub-torch", action="store_true", help="a mocked torch: for a Triton in a venv without it")
    args = ap.parse_args(argv)
    if args.command == "record":
        import torch

        from deformconv.benchmark import GPU_SHAPES
        shapes = {"custom": tuple(int(v) for v in args.shape.split(","))} if args.shape else GPU_SHAPES
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        launches = record(shapes, args.dtypes, device)
        with open(args.out, "w") as f:
            json.dump(launches, f, indent=0)
        print(f"{len(launches)} launches recorded on {device}")
        return launches
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ptx_summary, a sibling
    kernels = kernels_module(args.src, args.stub_torch)
    import triton
    print("triton", triton.__version__)
    with open(args.launches) as f:
        return build(json.load(f), kernels)


if __name__ == "__main__":
    main()
