"""Compile the Triton kernels for sm_90 on a machine without a GPU and count what their PTX does per kernel:
global loads/stores by width, cp.async copies, atomics, wgmma. Integers are specialised as Triton does at
run time (== 1 becomes a constant, multiples of 16 are marked divisible), pointers 16-byte aligned.

    PYTHONPATH=src python benchmarks/experiments/ptx_summary.py

Static counts (instructions in the code, not executed ones): they show whether a tile load is vectorised or
pipelined, not how long it takes. Also the registers per thread and the stack (spills) of the cubin Triton
built, and its K loop's SASS (instructions, barriers, shared-memory traffic: see k_loop), read with the
cuobjdump that ships with Triton. To see what the device builds, put its Triton first on PYTHONPATH (e.g.
``pip install --no-deps --target /tmp/tri36 triton==3.6.0``): its register counts matched Nsight's on the
device (NOTES.md, v12). Results of 2026-12-02 (triton 3.8) are quoted in benchmarks/NOTES.md.
"""
import os
import re
import subprocess
import tempfile
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


TARGET = GPUTarget("cuda", 90, 32)
PATTERN = re.compile(r"(ld\.global[.\w:]*|st\.global[.\w:]*|atom\.global[.\w:]*|cp\.async[.\w:]*|wgmma\.mma_async)")


def compile_kernel(fn, pointers: dict, constexprs: dict, ints: dict, num_warps: int, num_stages: int = 2,
                   maxnreg: Optional[int] = None, source=ASTSource):
    """pointers: name -> '*fp16'/'*fp32'; ints: name -> the value a run would pass. source: the kernel's AST source
    class (Gluon kernels: GluonASTSource)."""
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:  # a pointer ('*fp16'), or a TMA descriptor ('tensordesc<fp16[32,256]>')
            signature[name] = pointers[name]
            if pointers[name].startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints[name] == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=TARGET, options=options)


def _cuobjdump(compiled, flag: str) -> str:
    """cuobjdump's output for the kernel's cubin ('' without the cuobjdump that ships with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def resources(compiled) -> str:
    """'regs=R stack=S' of the kernel's cubin (stack > 0: register spills), or '' without cuobjdump."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(compiled, "-res-usage"))
    return f"regs={m.group(1)} stack={m.group(2)} " if m else ""


SASS_KINDS = ("BAR", "STS", "LDS", "LDSM", "SHFL", "LDG", "LDGSTS", "REDG", "HGMMA")


def k_loop(compiled, sass: str = "") -> str:
    """The K loop's SASS: the innermost loop (a backward branch) holding a tensor-core instruction, as
    'kloop=N instr' plus counts of barriers, shared-memory stores/loads, shuffles, global loads/copies,
    reductions and wgmma (a barrier and a shared round trip per layout conversion show here); '' if none.
    sass: the kernel's `cuobjdump -sass` text, where the caller has it already."""
    code = []
    for line in (sass or _cuobjdump(compiled, "-sass")).splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", line)
        if m:
            target = re.match(r"\s+(0x[0-9a-f]+)", m.group(3)) if m.group(2) == "BRA" else None
            code.append((int(m.group(1), 16), m.group(2), int(target.group(1), 16) if target else None))
    best = None
    for addr, _, target in code:
        if target is not None and target < addr:
            body = [op for a, op, _ in code if target <= a <= addr]
            if any(op.startswith(("HGMMA", "HMMA")) for op in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        return ""
    return f"kloop={len(best)} instr " + " ".join(f"{k}={sum(op == k for op in best)}" for k in SASS_KINDS) + " "


def counts(compiled) -> str:
    found = {}
    for m in PATTERN.findall(compiled.asm["ptx"]):
        found[m] = found.get(m, 0) + 1
    return (resources(compiled) + k_loop(compiled) + f"shared={compiled.metadata.shared} "
            + " ".join(f"{k}={v}" for k, v in sorted(found.items())))


def shape_ints(n, cin, cout, h, w, og, channels_last: bool) -> dict:
    """Integer arguments of a stride-1, padding-1, 3x3 layer; output/grad_out NCHW or channels-last."""
    L = h * w
    sl, sc = (cout, 1) if channels_last else (1, L)
    return dict(H=h, W=w, CIN=cin, HO=h, WO=w, M=n * L, CIN_G=cin, COUT_G=cout, COG=cin // og, G=og, GROUPS=1,
                STRIDE_H=1, STRIDE_W=1, PAD_H=1, PAD_W=1, DIL_H=1, DIL_W=1, out_sn=cout * L, out_sl=sl, out_sc=sc,
                go_sn=cout * L, go_sl=sl, go_sc=sc, SPLIT=6)


def packed_partial_strides(n, cin, cout, h, w, og) -> dict:
    """The grad_weight kernel's gw_* strides for fp32 partials [split, groups, 3*3, Cin, Cout] (one conv group)."""
    tap = cin * cout
    return dict(gw_ss=9 * tap, gw_sg=9 * tap, gw_sh=3 * tap, gw_sw=tap, gw_si=cout, gw_so=1)


SHAPES = {"det-s4": ((8, 256, 256, 50, 76, 1), 256, 1), "hires-g8": ((16, 64, 64, 128, 128, 8), 8, 4)}


def main(shapes=tuple(SHAPES), tilings=(False, True), log=print):
    """One line per (shape, tiling, kernel): static PTX counts (see counts). Tiles through TMA descriptors
    (Config.tma) where the default configs take them: at det-s4, all three kernels."""
    import deformconv.ops.deform_conv2d as K  # here, not at import: compile_kernel needs no torch (gluon_forward.py)

    h = "*fp16"
    fwd = dict(x_ptr=h, off_ptr=h, msk_ptr=h, w_ptr=h, b_ptr=h, out_ptr=h)
    data = dict(x_ptr=h, off_ptr=h, msk_ptr=h, w_ptr=h, go_ptr=h, gin_ptr="*fp32", goff_ptr=h, gmsk_ptr=h,
                scale_ptr="*fp32")
    weight = dict(x_ptr=h, off_ptr=h, msk_ptr=h, go_ptr=h, gw_ptr="*fp32", gb_ptr="*fp32")
    common = dict(KH=3, KW=3, HAS_MASK=True, DOT_PRECISION="tf32")
    for name in shapes:
        shape, seg, nseg = SHAPES[name]
        for per_image in tilings:
            out_ints = shape_ints(*shape, channels_last=False)  # the forward writes the NCHW output
            go_ints = shape_ints(*shape, channels_last=True)    # the backward reads grad_out channels-last
            tag = f"{name} {'per-image' if per_image else 'flat'} tiles"
            bn = 256 if shape[2] >= 256 else 64
            bk = 64 if nseg == 1 else 32
            tma = shape[2] >= 256
            resident = shape[2] <= min(bn, 128)
            go_desc = f"tensordesc<fp16[1,64,{bn}]>" if per_image else f"tensordesc<fp16[64,{bn}]>"
            tma_fwd = dict(w_ptr=f"tensordesc<fp16[{bk},{bn}]>") if tma else {}
            tma_data = dict(w_ptr=f"tensordesc<fp16[{bk},{min(bn, 128)}]>", go_ptr=go_desc.replace(str(bn), str(min(bn, 128))))
            log(tag, "fwd   ", counts(compile_kernel(K._deform_conv2d_fwd_kernel, dict(fwd, **tma_fwd), dict(
                common, SEG=seg, NSEG=nseg, HAS_BIAS=True, EVEN_K=True, PER_IMAGE=per_image, GROUPED=nseg > 1,
                W_K_MAJOR=False, SAMPLE_AHEAD=False, TMA=tma, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk,
                RUN_STORE=8 if nseg == 1 and shape[3] * shape[4] % 8 == 0 else 0), out_ints,  # as _run_store
                8 if bn == 256 else 4)))  # fp16 layout
            log(tag, "data  ", counts(compile_kernel(K._deform_conv2d_bwd_data_kernel, dict(data, **(tma_data if tma else {})), dict(
                common, SEG=seg, NSEG=nseg, NEED_GIN=True, NEED_GOFF=True, NEED_GMSK=True, FIXED_GIN=False, EVEN_K=True,
                PER_IMAGE=per_image, GO_RESIDENT=resident, TAP_SPLIT=1, GROUPED=nseg > 1, TMA=tma and not resident,
                BLOCK_M=64, BLOCK_N=min(bn, 128), BLOCK_K=bk), go_ints, 8 if bn == 256 else 4)))
            for need_bias in (False, True):
                log(tag, f"weight{' +bias' if need_bias else ''}", counts(compile_kernel(
                    K._deform_conv2d_bwd_weight_kernel, dict(weight, **(dict(go_ptr=go_desc) if tma else {})), dict(
                        common, SEG=seg, NSEG=64 // seg if nseg > 1 else 1, EVEN_K=True, PER_IMAGE=per_image,
                        GROUPED=nseg > 1, TMA=tma, NEED_BIAS=need_bias, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=64),
                    dict(go_ints, **packed_partial_strides(*shape)), 8)))


if __name__ == "__main__":
    main()
