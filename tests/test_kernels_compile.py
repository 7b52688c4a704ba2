"""Every Triton kernel compiles for an H200 (sm_90) down to machine code, on this machine, GPU or not: what Triton's
CPU interpreter, which runs the kernels in the CI, cannot show (a kernel the interpreter runs but the GPU compiler
rejects, shared memory over the GPU's limit, register spills). And for a GPU with 99 KiB of shared memory a block
(sm_86: RTX 3090, A10), where a default tile that does not fit gives way to the next candidate.
benchmarks/tools/compile_check.py does the compiling, in a child process (it replaces Triton's driver and JIT call).
Results on a GPU: the GPU tests (tests/ops/)."""

import json
import os
import subprocess
import sys

import pytest
import triton

TOOL = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tools", "compile_check.py")
TOOLS = [os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", t) for t in ("ptxas", "cuobjdump")]
H200_SHARED_MEMORY = 232448  # bytes a block may use (227 KiB)

pytestmark = pytest.mark.skipif(not all(map(os.path.exists, TOOLS)),
                                reason="this Triton ships no ptxas and cuobjdump (no NVIDIA backend)")


@pytest.mark.parametrize("family, arch, extra", [("deform_conv2d", 90, []), ("dcnv", 90, []), ("msda", 90, []),
                                                 ("msda", 90, ["--preload"]), ("roi_pool", 90, []),
                                                 ("deform_conv_nd", 90, []),
                                                 ("deform_conv2d", 86, []),
                                                 ("deform_conv2d", 90, ["--scalars-constant"])],
                         ids=["deform_conv2d-sm90", "dcnv-sm90", "msda-sm90", "msda-preload-sm90", "roi_pool-sm90",
                              "deform_conv_nd-sm90",
                              "deform_conv2d-sm86", "deform_conv2d-scalars-constant"])
def test_every_kernel_compiles_without_spills(family, arch, extra, tmp_path):
    """--scalars-constant: the kernels the compile route hands to torch.compile also compile as its analysis of what
    they write compiles them in torch 2.11, with every scalar argument a constant (that analysis failing made every
    input count as written, and a written leaf that requires grad fails the compile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEFORMCONV_BACKEND")}
    out = tmp_path / "records.json"
    done = subprocess.run([sys.executable, TOOL, "--quick", "--families", family, "--arch", str(arch), "--json",
                           str(out), *extra], env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert not result["failures"], result["failures"]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = result["records"]
    assert records, "nothing was compiled"
    for r in records:
        assert 0 < r["regs"] <= 255, r
        assert r["local"] == 0, f"{r['kernel']} spills ({r['local']} bytes of local memory a thread): {r['cases']}"
        # Triton's fp32 `/` is div.full.f32 (up to 2 ulp: an exact quotient can come out an ulp off, e.g. a RoI's
        # adaptive sample count); every kernel divides as IEEE does (common.sampling.div)
        assert r["approx_div"] == 0, f"{r['kernel']} has {r['approx_div']} approximate fp32 divisions: {r['cases']}"
        if arch == 90:  # the defaults were chosen on an H200: every candidate taken fits it
            assert r["shared"] <= H200_SHARED_MEMORY, r
