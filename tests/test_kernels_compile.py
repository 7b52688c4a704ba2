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


SIZES_SCRIPT = r'''
import os, sys, tempfile
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, sys.argv[1])
import compile_check
compile_check.pretend_gpu(90)
compile_check.force_triton_on_cpu(90)
import torch
import deformconv
from deformconv.ops.dcnv import triton as dcnv
from deformconv.ops.msda import triton as msda

# the attention: queries and pixels of each size class (multiples of 16 or not), rows (N*Lq) a multiple of 16 in both
for levels, lq in (([(15, 20), (8, 10)], 40), ([(16, 16), (8, 8)], 32)):
    shapes = torch.tensor(levels)
    sizes = shapes.prod(1)
    value = torch.randn(2, int(sizes.sum()), 8, 32, requires_grad=True)
    loc = torch.rand(2, lq, 8, 2, 4, 2, requires_grad=True)
    attn = torch.rand(2, lq, 8, 2, 4, requires_grad=True)
    starts = torch.cumsum(sizes, 0) - sizes
    deformconv.ms_deform_attn(value, shapes, starts, loc, attn, backend="triton").sum().backward()
# DCNv3: images of each size class, N*Ho*Wo a multiple of 16 in both
for h, w in ((56, 56), (32, 48)):
    x = torch.randn(2, h, w, 64, requires_grad=True)
    off = torch.randn(2, h, w, 72, requires_grad=True)
    m = torch.rand(2, h, w, 36, requires_grad=True)
    deformconv.dcnv3(x, off, m, 3, 3, 1, 1, 1, 1, 1, 1, 4, 16, 1.0, 256, False, backend="triton").sum().backward()
for f in (msda._msda_fwd_kernel, msda._msda_bwd_kernel, dcnv._dcn_fwd_kernel, dcnv._dcn_bwd_kernel):
    print(f.__name__, sum(len(c[0]) for c in f.device_caches.values()))
'''


def test_image_and_query_sizes_compile_no_new_kernels(tmp_path):
    """The attention's and DCNv3's kernels compiled once for inputs whose queries, pixels or image sides are
    multiples of 16 in one call and not in the next (Triton would specialise on each: a model fed images of varying
    sizes would compile anew, 5-15 s a kernel pair)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEFORMCONV_BACKEND")}
    script = tmp_path / "sizes.py"
    script.write_text(SIZES_SCRIPT)
    done = subprocess.run([sys.executable, str(script), os.path.dirname(TOOL)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = dict(line.split() for line in done.stdout.splitlines() if line.startswith("_"))
    assert counts == {"_msda_fwd_kernel": "1", "_msda_bwd_kernel": "1", "_dcn_fwd_kernel": "1",
                      "_dcn_bwd_kernel": "1"}, counts
