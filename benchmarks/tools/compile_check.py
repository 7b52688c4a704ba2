"""Compiles every Triton kernel the ops launch, for a GPU this machine need not have: each op family's forward and
backward at odd shapes, in fp32, fp16 and bf16, with and without deterministic mode, down to the GPU's machine code
(cubin), without launching anything. Reports each compiled kernel's registers, shared memory, local memory (spills)
and the cases that failed to compile.

What Triton's CPU interpreter (the CI's kernel tests) cannot show: code that compiles for the interpreter but not
for a GPU (types, layouts, atomics of a dtype), shared memory over the GPU's limit, register spills. Run it after a
kernel change on a machine without a GPU; the GPU tests are still what checks results.

    python benchmarks/tools/compile_check.py [--arch 90] [--quick] [--json out.json] [--compare earlier.json]

How: Triton's driver answers as the target GPU's; every JIT call compiles only (``warmup``), and refuses a kernel
that needs more shared memory than the GPU has, as Triton does before a launch (the tile choice then takes the next
candidate, as on such a GPU); the ops run on CPU tensors with the Triton backend forced (outputs are left
unwritten, so values mean nothing). The cuobjdump Triton ships with reads the registers and local memory of each
cubin, and its machine code: --compare lists the variants whose machine code differs from an earlier run's --json
(a refactor that should change no kernel, checked without a GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
import types
from typing import Tuple

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
os.environ["DEFORMCONV_FAST_LAUNCH"] = "0"  # every launch through the JIT (which compiles and returns)
os.environ.pop("DEFORMCONV_BACKEND", None)
os.environ.pop("DEFORMCONV_AUTOTUNE", None)  # the heuristic tiles (autotuning would time on the GPU)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# bytes of shared memory a block may use, by compute capability (CUDA C programming guide, opt-in maximum)
SHARED_MEMORY = {70: 98304, 75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                 120: 101376}
SHARED_LIMIT = {"bytes": 232448}
SCALARS_CONSTANT = {"on": False}
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1"}
COMPILED: dict = {}  # cubin hash -> record
CASE = {"name": ""}


def pretend_gpu(arch: int) -> None:
    """Triton compiles for sm_<arch>; every JIT call compiles and records, launching nothing."""
    triton.runtime.driver.set_active(types.SimpleNamespace(
        get_current_target=lambda: GPUTarget("cuda", arch, 32), get_current_device=lambda: 0,
        get_current_stream=lambda device=None: 0))
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        md = kernel.metadata
        rec = COMPILED.setdefault(md.hash, dict(kernel=md.name, shared=md.shared, warps=md.num_warps,
                                                stages=md.num_stages, maxnreg=getattr(md, "maxnreg", None),
                                                cases=[], cubin=kernel.asm["cubin"],
                                                # fp32 divisions of 2 ulp (Triton's `/`); the kernels divide through
                                                # common.sampling.div (IEEE rounding) instead
                                                approx_div=kernel.asm["ptx"].count("div.full.f32")
                                                + kernel.asm["ptx"].count("div.approx")))
        rec["cases"].append(CASE["name"])
        if SCALARS_CONSTANT["on"]:
            compile_with_constant_scalars(self, args, kwargs, kernel.metadata.target)
        if md.shared > SHARED_LIMIT["bytes"]:  # as Triton refuses it before launching on such a GPU
            raise OutOfResources(md.shared, SHARED_LIMIT["bytes"], "shared memory")
        return kernel

    JITFunction.run = compile_only


def compile_with_constant_scalars(fn, args, kwargs, target) -> None:
    """The kernel compiled again with every scalar argument a constant, as torch.compile's analysis of which tensors
    a kernel writes compiles it in some torch versions (torch 2.11's did): code that calls a tensor method on an
    expression of scalar arguments only (e.g. `(H * W).to(...)`) fails there; tl.cast works in both."""
    from triton.compiler import ASTSource

    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
    bound.apply_defaults()
    signature, constants = {}, {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        elif hasattr(value, "block_shape"):  # a TMA descriptor
            signature[name] = f"tensordesc<{POINTER_TYPES[value.base.dtype][1:]}{list(value.block_shape)}>"
        else:
            signature[name], constants[(i,)] = "constexpr", value
    triton.compile(ASTSource(fn, signature, constants, {}), target=target, options=options)


def force_triton_on_cpu(arch: int) -> None:
    """CPU tensors take the Triton backend (which compiles for the pretend GPU), layout kernels included."""
    from deformconv.config import options
    from deformconv.ops.common import dispatch as backends
    from deformconv.ops.common import launch
    from deformconv.ops.deform_conv2d.triton import backward, forward

    # the tile choice as on a CUDA device of this shared memory (a tile that does not fit is passed over) and
    # compute capability (TMA from 9.0 on)
    launch.tma_supported = lambda device: arch >= 90
    launch.shared_memory_per_block = lambda device: SHARED_LIMIT["bytes"]
    torch.cuda.is_current_stream_capturing = lambda: False
    for module in (forward, backward):
        module.pick_config = lambda key, cands, run, device, pick=launch.pick_config: pick(
            key, cands, run, torch.device("cuda"))
    backends.TritonBackend.not_supported_reasons = lambda self, device, dtype: (
        [] if dtype in self.dtypes else [f"dtype {dtype}"])
    backends.TritonBackend.automatic = lambda self, device: True
    options.layout_kernels_on_cpu = True


# --- the cases: (name, thunk) ------------------------------------------------------------------------------


def _grads(out, leaves):
    leaves = [t for t in leaves if t is not None and t.requires_grad]
    torch.autograd.grad(out, leaves, torch.randn_like(out))


def _leaf(*shape, dtype):
    return torch.randn(*shape, dtype=dtype).requires_grad_(True)


def deform_conv2d_cases(dtypes):
    import deformconv

    # (n, cin, cout, h, w, k, groups, offset_groups, stride, padding, dilation, mask)
    shapes = {
        "resnet-c3-s2": (2, 128, 128, 57, 41, 3, 1, 1, 2, 1, 1, True),
        "resnet-c4": (3, 256, 256, 14, 14, 3, 1, 1, 1, 1, 1, True),
        "odd-groups-og4": (2, 36, 48, 13, 11, 3, 2, 4, 1, 1, 1, True),
        "5x5-no-mask-dil2": (2, 16, 24, 19, 23, 5, 1, 1, 1, 4, 2, False),
        "og8-wide": (2, 64, 64, 14, 15, 3, 1, 8, 1, 1, 1, True),
        "cin3": (1, 3, 20, 9, 7, 3, 1, 1, 1, 1, 1, True),
    }
    for name, (n, cin, cout, h, w, k, g, og, s, p, d, has_mask) in shapes.items():
        for dtype in dtypes:
            def run(n=n, cin=cin, cout=cout, h=h, w=w, k=k, g=g, og=og, s=s, p=p, d=d, has_mask=has_mask,
                    dtype=dtype):
                ho, wo = (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1
                x, off = _leaf(n, cin, h, w, dtype=dtype), _leaf(n, 2 * og * k * k, ho, wo, dtype=dtype)
                wt, b = _leaf(cout, cin // g, k, k, dtype=dtype), _leaf(cout, dtype=dtype)
                m = _leaf(n, og * k * k, ho, wo, dtype=dtype) if has_mask else None
                out = deformconv.deform_conv2d(x, off, wt, b, (s, s), (p, p), (d, d), m, backend="triton")
                _grads(out, [x, off, wt, b, m])
            yield f"deform_conv2d {name} {str(dtype)[6:]}", run
            if name == "resnet-c4" and dtype != torch.float32:  # float32 weight and bias under autocast (ROUND)
                def run_autocast(n=n, cin=cin, cout=cout, h=h, w=w, k=k, dtype=dtype):
                    x, off = _leaf(n, cin, h, w, dtype=dtype), _leaf(n, 2 * k * k, h, w, dtype=dtype)
                    m = _leaf(n, k * k, h, w, dtype=dtype)
                    wt, b = _leaf(cout, cin, k, k, dtype=torch.float32), _leaf(cout, dtype=torch.float32)
                    with torch.autocast("cpu", dtype=dtype):
                        out = deformconv.deform_conv2d(x, off, wt, b, 1, 1, 1, m, backend="triton")
                    _grads(out, [x, off, wt, b, m])
                yield f"deform_conv2d {name} float32-weight {str(dtype)[6:]}", run_autocast
            if name in ("resnet-c3-s2", "og8-wide"):  # the column buffers, both ways (columns.py)
                def run_columns(run=run):
                    from deformconv.config import options

                    with options.override(columns_grad_weight=True, columns_grad_data=True):
                        run()
                yield f"deform_conv2d {name} columns {str(dtype)[6:]}", run_columns

                def run_logits(n=n, cin=cin, cout=cout, h=h, w=w, k=k, og=og, s=s, p=p, d=d, dtype=dtype):
                    # a modulated layer's planned Call reading its offset conv output's logits (sampling.MASK_LOGITS),
                    # with the kernels' own backward and with the column buffers
                    from deformconv.config import options
                    from deformconv.ops.deform_conv2d.triton.call import Call

                    ho, wo = (h + 2 * p - d * (k - 1) - 1) // s + 1, (w + 2 * p - d * (k - 1) - 1) // s + 1
                    x, o = _leaf(n, cin, h, w, dtype=dtype), _leaf(n, 3 * og * k * k, ho, wo, dtype=dtype)
                    wt, b = _leaf(cout, cin, k, k, dtype=dtype), _leaf(cout, dtype=dtype)
                    for columns in (False, True):
                        with options.override(columns_grad_weight=columns, columns_grad_data=columns):
                            call = Call((s, s), (p, p), (d, d), 2 * og * k * k, logits=True)
                            out, kept = call.forward_saving(x, o, wt, b)
                            call.grads(torch.randn_like(out), x, o, wt, b, (True,) * 4, kept=kept)
                yield f"deform_conv2d {name} logits {str(dtype)[6:]}", run_logits


def dcnv_cases(dtypes):
    import deformconv

    # (n, h, w, g, d, k, stride, pad, dilation, offset_scale, remove_center)
    shapes = {
        "internimage-t": (2, 56, 56, 4, 16, 3, 1, 1, 1, 1.0, False),
        "d32": (2, 28, 28, 4, 32, 3, 1, 1, 1, 1.0, False),
        "d64-rc": (1, 17, 23, 2, 64, 3, 1, 1, 1, 0.5, True),
        "d5-s2-dil2": (3, 19, 21, 3, 5, 3, 2, 1, 2, 1.3, False),
        "5x5-d24": (2, 13, 11, 2, 24, 5, 1, 2, 1, 1.0, True),
        "sizes-of-16": (1, 32, 48, 4, 16, 3, 1, 1, 1, 1.0, False),  # every size a multiple of 16
    }
    for name, (n, h, w, g, d, k, s, p, dil, scale, rc) in shapes.items():
        for dtype in dtypes:
            def run(n=n, h=h, w=w, g=g, d=d, k=k, s=s, p=p, dil=dil, scale=scale, rc=rc, dtype=dtype):
                ho, wo = (h + 2 * p - dil * (k - 1) - 1) // s + 1, (w + 2 * p - dil * (k - 1) - 1) // s + 1
                kk = k * k - int(rc)
                x = _leaf(n, h, w, g * d, dtype=dtype)
                off, m = _leaf(n, ho, wo, g * kk * 2, dtype=dtype), _leaf(n, ho, wo, g * kk, dtype=dtype)
                out = deformconv.dcnv3(x, off, m, k, k, s, s, p, p, dil, dil, g, d, scale, 256, rc, backend="triton")
                _grads(out, [x, off, m])
                om = _leaf(n, ho, wo, -(-3 * g * kk // 8) * 8, dtype=dtype)
                out = deformconv.dcnv4(x, om, k, k, s, s, p, p, dil, dil, g, d, scale, 256, rc, backend="triton")
                _grads(out, [x, om])
            yield f"dcnv3/4 {name} {str(dtype)[6:]}", run


def msda_cases(dtypes):
    import deformconv

    # (n, lq, m, d, levels, p)
    shapes = {
        "encoder": (1, 120, 8, 32, [(25, 38), (13, 19), (7, 10), (4, 5)], 4),
        "d24-one-level": (3, 77, 3, 24, [(17, 23)], 5),
        "d5-heads2": (2, 40, 2, 5, [(9, 13), (1, 1)], 3),
        "d64": (1, 50, 4, 64, [(10, 12), (5, 6)], 4),
        "sizes-of-16": (2, 64, 8, 32, [(8, 8), (4, 4)], 4),  # rows, queries and pixels all multiples of 16
        "d128": (1, 30, 2, 128, [(6, 7), (3, 4)], 4),
    }
    for name, (n, lq, m, d, levels, p) in shapes.items():
        for dtype in dtypes:
            def run(n=n, lq=lq, m=m, d=d, levels=levels, p=p, dtype=dtype):
                shapes_t = torch.tensor(levels, dtype=torch.int64)
                sizes = shapes_t.prod(1)
                starts = torch.cumsum(sizes, 0) - sizes
                value = _leaf(n, int(sizes.sum()), m, d, dtype=dtype)
                loc = torch.rand(n, lq, m, len(levels), p, 2).requires_grad_(True)
                attn = _leaf(n, lq, m, len(levels), p, dtype=dtype)
                out = deformconv.ms_deform_attn(value, shapes_t, starts, loc, attn, backend="triton")
                _grads(out, [value, loc, attn])
            yield f"msda {name} {str(dtype)[6:]}", run


def roi_pool_cases(dtypes):
    import deformconv

    # (n, c, h, w, rois, output size, spatial_scale, sampling_ratio, channels_last)
    shapes = {
        "p2-sr2": (2, 64, 100, 152, 50, (7, 7), 0.25, 2, False),
        "p5-adaptive": (2, 64, 25, 38, 50, (7, 7), 1 / 32, 0, False),
        "odd-cl": (3, 13, 17, 23, 37, (3, 5), 0.5, 0, True),
    }
    for name, (n, c, h, w, r, out_size, scale, sr, cl) in shapes.items():
        for dtype in dtypes:
            def run(n=n, c=c, h=h, w=w, r=r, out_size=out_size, scale=scale, sr=sr, cl=cl, dtype=dtype):
                x = torch.randn(n, c, h, w, dtype=dtype)
                x = (x.contiguous(memory_format=torch.channels_last) if cl else x).requires_grad_(True)
                size = torch.tensor([w, h], dtype=torch.float32) / scale
                xy = torch.rand(r, 2) * size
                rois = torch.cat([torch.randint(0, n, (r, 1)).float(), xy, xy + torch.rand(r, 2) * size * 0.5], 1)
                off = _leaf(r, 2, *out_size, dtype=dtype)
                y = deformconv.deform_roi_pool(x, rois, off, out_size, scale, sr, 0.1, backend="triton")
                _grads(y, [x, off])
                y = deformconv.deform_roi_pool(x, rois, None, out_size, scale, sr, backend="triton")
                _grads(y, [x])
            yield f"roi_pool {name} {str(dtype)[6:]}", run
    for dtype in dtypes:
        def run_ps(dtype=dtype):
            x = _leaf(2, 2 * 3 * 3, 19, 23, dtype=dtype)
            xy = torch.rand(21, 2) * 60
            rois = torch.cat([torch.randint(0, 2, (21, 1)).float(), xy, xy + torch.rand(21, 2) * 40], 1)
            off = _leaf(21, 2, 3, 3, dtype=dtype)
            y = deformconv.deform_psroi_pool(x, rois, off, 0.25, 3, 2, False, 3, 3, 2, 0.1, backend="triton")
            _grads(y, [x, off])
        yield f"ps_roi_pool {str(dtype)[6:]}", run_ps


def deform_conv_nd_cases(dtypes):
    import deformconv

    # (function, input shape, weight shape, offset/mask positions, extra positional arguments after bias)
    shapes = {
        "conv3d": ("deform_conv3d", (1, 8, 4, 5, 6), (4, 8, 3, 3, 3), (4, 5, 6), (1, 1, 1)),
        "conv3d-c64": ("deform_conv3d", (1, 64, 3, 4, 5), (32, 64, 3, 3, 3), (3, 4, 5), (1, 1, 1)),  # wide tiles
        "conv1d-og2": ("deform_conv1d", (2, 8, 11), (6, 4, 3), (11,), (1, 1, 1)),
        "transpose2d": ("deform_conv_transpose2d", (1, 6, 5, 7), (6, 4, 3, 3), (5, 7), (2, 1, 1, 1)),
        "transpose3d": ("deform_conv_transpose3d", (1, 4, 3, 4, 5), (4, 2, 2, 2, 2), (3, 4, 5), (2, 0, 0, 1)),
    }
    for name, (fn_name, x_shape, w_shape, positions, extra) in shapes.items():
        for dtype in dtypes:
            def run(fn_name=fn_name, x_shape=x_shape, w_shape=w_shape, positions=positions, extra=extra, dtype=dtype):
                fn = getattr(deformconv, fn_name)
                rank, taps = len(positions), 1
                for k in w_shape[2:]:
                    taps *= k
                og = 2 if name == "conv1d-og2" else 1
                x, w = _leaf(*x_shape, dtype=dtype), _leaf(*w_shape, dtype=dtype)
                off = _leaf(x_shape[0], og * taps * rank, *positions, dtype=dtype)
                mask = _leaf(x_shape[0], og * taps, *positions, dtype=dtype)
                out = fn(x, off, w, None, *extra, mask, backend="triton")
                _grads(out, [x, off, w, mask])
            yield f"deform_conv_nd {name} {str(dtype)[6:]}", run


FAMILIES = {"deform_conv2d": deform_conv2d_cases, "dcnv": dcnv_cases, "msda": msda_cases, "roi_pool": roi_pool_cases,
            "deform_conv_nd": deform_conv_nd_cases}


# --- resources and report ----------------------------------------------------------------------------------------


def sass_digest(text: str) -> Tuple[str, int]:
    """(hash, instruction count) of cuobjdump's SASS listing, addresses and encodings left out: equal hashes are the
    same machine code."""
    lines = [re.sub(r"/\*.*?\*/", "", ln).strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("//", ".", "Function", "code for", "Fatbin", "arch",
                                                               "host", "compile_size"))]
    return hashlib.sha1("\n".join(lines).encode()).hexdigest(), len(lines)


def resource_usage(records) -> None:
    """REG and LOCAL (bytes of local memory a thread: spills) of each cubin, from the cuobjdump Triton ships, and its
    machine code's sass_digest."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        for i, rec in enumerate(records):
            path = os.path.join(tmp, f"{i}.cubin")
            with open(path, "wb") as f:
                f.write(rec.pop("cubin"))
            text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
            line = next((ln for ln in text.splitlines() if "REG:" in ln), "")
            fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
            rec["regs"] = int(fields.get("REG", -1))
            rec["local"] = int(fields.get("LOCAL", -1))
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
            rec["sass"], rec["instructions"] = sass_digest(sass)


def compare(records, path: str) -> None:
    """Prints the kernel variants (kernel and first case) whose machine code differs from an earlier --json's: a
    refactor meant to change nothing changes none."""
    with open(path) as fh:
        old = {(r["kernel"], r["cases"][0]): r for r in json.load(fh)["records"]}
    new = {(r["kernel"], r["cases"][0]): r for r in records}
    same = [k for k in new if k in old and old[k].get("sass") == new[k]["sass"]]
    changed = [k for k in new if k in old and old[k].get("sass") != new[k]["sass"]]
    print(f"\nagainst {path}: {len(same)} variants the same machine code, {len(changed)} changed, "
          f"{len(set(new) - set(old))} new, {len(set(old) - set(new))} gone")
    for k in changed:
        o, n = old[k], new[k]
        print(f"  {k[0]} ({k[1]}): {o.get('instructions')} -> {n['instructions']} instructions, "
              f"{o.get('regs')} -> {n['regs']} registers")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as Triton writes it (90: H100/H200)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    ap.add_argument("--quick", action="store_true", help="fp32, and bf16 in deterministic mode (else every dtype in "
                    "both modes)")
    ap.add_argument("--smem-limit", type=int, help="bytes of shared memory a block may use (default: the arch's, "
                    "as CUDA's programming guide lists them)")
    ap.add_argument("--profile", choices=["3.6", "3.8"], help="the kernels' spellings for that Triton (compat."
                    "CodegenProfile); default: the installed Triton's")
    ap.add_argument("--scalars-constant", action="store_true", help="also compile each kernel with every scalar "
                    "argument a constant, as torch.compile's mutation analysis does in some torch versions")
    ap.add_argument("--preload", action="store_true", help="the gather kernels with a row's point parameters loaded "
                    "first wherever they fit (options.preload_points=True; the default where they fit 16 columns)")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--compare", help="an earlier --json: list the variants whose machine code changed")
    a = ap.parse_args(argv)

    if a.smem_limit is None:
        a.smem_limit = SHARED_MEMORY.get(a.arch, 101376)
    SHARED_LIMIT["bytes"] = a.smem_limit
    SCALARS_CONSTANT["on"] = a.scalars_constant
    pretend_gpu(a.arch)
    force_triton_on_cpu(a.arch)
    from deformconv.config import options

    if a.profile:
        from deformconv import compat

        options.profile = compat.TRITON_3_6 if a.profile == "3.6" else compat.TRITON_3_8
    if a.preload:
        options.preload_points = True
    torch.manual_seed(0)
    # --quick: each kernel's constexpr branches once: fp32 as is, bf16 in deterministic mode
    runs = ([(torch.float32, False), (torch.bfloat16, True)] if a.quick else
            [(dt, det) for dt in (torch.float32, torch.float16, torch.bfloat16) for det in (False, True)])
    failures = []
    for family in a.families.split(","):
        for dtype, deterministic in runs:
            for name, run in FAMILIES[family]((dtype,)):
                CASE["name"] = name + (" deterministic" if deterministic else "")
                torch.use_deterministic_algorithms(deterministic)
                try:
                    run()
                except Exception as e:  # a kernel that does not compile for the target
                    failures.append(dict(case=CASE["name"], error=f"{type(e).__name__}: {e}"[:2000],
                                         where=traceback.format_exc(limit=-3)[-1500:]))
                    print(f"FAILED {CASE['name']}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
    torch.use_deterministic_algorithms(False)

    records = list(COMPILED.values())
    resource_usage(records)
    over = [r for r in records if r["shared"] > a.smem_limit]
    spills = [r for r in records if r["local"] > 0]
    by_kernel: dict = {}
    for r in records:
        k = by_kernel.setdefault(r["kernel"], dict(variants=0, regs=0, shared=0, local=0))
        k["variants"] += 1
        k["regs"], k["shared"], k["local"] = max(k["regs"], r["regs"]), max(k["shared"], r["shared"]), \
            max(k["local"], r["local"])
    print(f"\nsm_{a.arch}, Triton {triton.__version__}, torch {torch.__version__}: {len(records)} kernel variants "
          f"compiled, {len(failures)} failed cases, {len(over)} refused for more than {a.smem_limit} B of shared "
          "memory "
          f"(the next tile taken), "
          f"{len(spills)} with local memory")
    print(f"{'kernel':<44} {'variants':>8} {'max regs':>8} {'max smem':>9} {'max local':>9}")
    for name, k in sorted(by_kernel.items()):
        print(f"{name:<44} {k['variants']:>8} {k['regs']:>8} {k['shared']:>9} {k['local']:>9}")
    for f in failures:
        print(f"\nFAILED {f['case']}\n{f['error']}\n{f['where']}")
    if a.compare:
        compare(records, a.compare)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(arch=a.arch, triton=triton.__version__, torch=torch.__version__, records=records,
                           failures=failures), fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
