"""The benchmark experiments still run against the current kernels (they monkeypatch the kernels' heuristics,
so a renamed helper or a new constexpr would otherwise break them unnoticed): a tiny smoke run each."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import deformconv

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"

pytestmark = pytest.mark.skipif(
    bool(deformconv.not_supported_reasons(torch.device("cpu"), torch.float32)["triton"]) and not torch.cuda.is_available(),
    reason="the Triton backend cannot run here")


def _load(name):
    if str(EXPERIMENTS) not in sys.path:  # the scripts import their shared helpers (common.py) as a sibling
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel", ["fwd", "bwd_data", "bwd_weight"])
def test_sweep_configs_checks_every_variant(kernel, capsys, monkeypatch):
    """Two configs x two tilings x two input layouts on a tiny packed-segment shape: every variant runs and
    agrees with the first (fp32), and the kernels' heuristics are restored afterwards."""
    from deformconv.ops import deform_conv2d as kernels

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # on a GPU: full fp32, so 1e-4 holds
    before = (kernels.per_image_tiles, kernels.grouped_input, kernels._bwd_weight_candidates)
    sweep = _load("sweep_configs")
    records = sweep.main(["--kernel", kernel, "--shape", "2,16,8,5,6,3,4", "--dtypes", "float32",
                          "--configs", "default", "16,16,16,4", "--tilings", "flat", "image", "--layouts", "auto", "nhwc"])
    assert len(records) == 8
    for rec in records:
        assert "error" not in rec, rec
        assert rec["max_rel_err"] < 1e-4, rec
    assert (kernels.per_image_tiles, kernels.grouped_input, kernels._bwd_weight_candidates) == before
    assert "| kernel | shape |" in capsys.readouterr().out


def test_sweep_configs_rejects_a_malformed_config():
    sweep = _load("sweep_configs")
    with pytest.raises(ValueError, match="--configs: expected 'default' or block_m"):
        sweep.main(["--kernel", "fwd", "--shape", "1,4,4,5,5,3,1", "--dtypes", "float32", "--configs", "64,64"])


def test_backward_parts_agree_with_the_full_backward(capsys, monkeypatch):
    """Each subset of gradients equals the same gradients of the full backward (fp32, packed segments)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    parts = _load("backward_parts")
    records = parts.main(["--shape", "2,16,8,5,6,3,4", "--dtypes", "float32"])
    assert [r["part"] for r in records] == ["input", "offset+mask", "input+offset+mask", "weight", "all", "fwd"]
    for rec in records[:-1]:
        assert rec["max_rel_err"] < 1e-5, rec
    assert "| shape | dtype | input ms |" in capsys.readouterr().out


def _sm90_build(*argv: str) -> str:
    """stdout of `python *argv` run for an sm_90 build without a GPU: in a subprocess, since the builds need the compiled
    (not interpreted) kernels and this process may run under TRITON_INTERPRET=1, with the experiments importable.
    Skips where ptxas cannot build for sm_90 here."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(EXPERIMENTS), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr.lower():
        pytest.skip(f"cannot compile for sm_90 here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_ptx_summary_compiles_every_kernel_for_sm90():
    """The static PTX tool compiles the three kernels for sm_90 (no GPU needed) with the current constexprs (grad_weight
    with and without its grad_bias rows), and the counts show tensor-core MMAs, the grad_input kernel's vector atomics and a K loop with wgmma in
    SASS. In a subprocess: it needs the compiled (not interpreted) kernels, and this process may run under
    TRITON_INTERPRET=1."""
    stdout = _sm90_build("-c", "import ptx_summary; ptx_summary.main(shapes=('hires-g8',), tilings=(True,))")
    lines = stdout.strip().splitlines()
    assert len(lines) == 4 and "weight +bias" in lines[3], stdout
    assert all("wgmma.mma_async" in line for line in lines), lines
    assert "atom.global.gpu.relaxed.add.v4.f32" in lines[1], lines[1]
    if all("regs=" in line for line in lines):  # cuobjdump found: the K loop's SASS is counted too
        assert all(re.search(r"kloop=\d+ instr .*HGMMA=[1-9]", line) for line in lines), lines


# Four kernels of the H200's recorded launches built for sm_90 in a subprocess (as in
# test_ptx_summary_compiles_every_kernel_for_sm90): det-s3's 16-bit forward, cls-14's 64x256 forward (NCHW output, 128
# registers), det-s5's grad_input kernel and hires-g8's forward (packed segments). Prints the first one's 16-bit FMAs
# and scalar 16-bit adds (PTX), the next two's registers and stack, and the barriers in hires-g8's K loop (SASS).
# The launches are those the host code makes with this Triton: benchmarks/results/h200-launches.json (Triton 3.6's
# choices, and --as-3.6), or h200-launches-triton38.json (newer: WIDE_RUN_STORES, PER_IMAGE_RUN_STORES).
_CODEGEN = """
import json, re, sys
import launch_builds as lb
from ptx_summary import _cuobjdump, k_loop, resources
K = lb.kernels_module()
if "--as-3.6" in sys.argv:  # what the product builds without its newer-Triton paths (the test's own check)
    for flag in ("EXPLICIT_FMA_BLEND", "CONTIGUOUS_FLAT_STORE", "PAIR_AXIS_OUTER"):
        setattr(K, flag, K.tl.constexpr(False))
launches = {(r["shape"], r["dtype"], r["fn"]): r for r in json.load(open(sys.argv[1]))}
build = lambda shape, kernel: lb.compile_launch(K, launches[(shape, "float16", "_deform_conv2d_" + kernel + "_kernel")])
ptx = build("det-s3", "fwd").asm["ptx"]
loop = re.search(r"BAR=(\\d+)", k_loop(None, _cuobjdump(build("hires-g8", "fwd"), "-sass")))
print(len(re.findall(r"fma\\.rn\\.f16", ptx)), len(re.findall(r"\\badd\\.f16", ptx)),
      resources(build("cls-14", "fwd")) or "regs=? stack=?", "|", resources(build("det-s5", "bwd_data")) or "regs=? stack=?",
      "|", loop.group(1) if loop else "?")
"""
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _codegen(*flags):
    """(16-bit FMAs, scalar 16-bit adds, the wide forward's stack, the grad_input kernel's stack, the packed forward's
    K-loop barriers) of _CODEGEN's builds; the last three None without cuobjdump."""
    from deformconv.ops import deform_conv2d as kernels

    newer = kernels.WIDE_RUN_STORES and kernels.PER_IMAGE_RUN_STORES and "--as-3.6" not in flags
    record = RESULTS / ("h200-launches-triton38.json" if newer else "h200-launches.json")
    fmas, adds, rest = _sm90_build("-c", _CODEGEN, str(record), *flags).split(maxsplit=2)
    parts = rest.split("|")
    stacks = [re.search(r"stack=(\d+)", part) for part in parts[:2]]
    barriers = parts[2].strip()
    return (int(fmas), int(adds), *(int(m.group(1)) if m else None for m in stacks),
            int(barriers) if barriers.isdigit() else None)


def test_kernels_build_without_triton_38_regressions():
    """With the Triton installed here (sm_90, no GPU): the forward's 16-bit blend compiles to fused multiply-adds, the
    64x256 forward fits its 128 registers (a few words of stack at most, outside its loops), the grad_input kernel
    spills little and the packed forward's K loop converts no layouts through shared memory (at most 4 barriers).
    Triton 3.8 left the plain `a*b + c*d` blend unfused (f16x2 multiplies, scalar adds: 1.29x det-s3's forward), laid
    the flat tiles' NCHW store out channel-major (1096 bytes of spills: det-s5 1.6x, cls-14 2.0x), spread the corner
    pairs over two lanes (the grad_input kernel's stack 48 -> 208 bytes at det-s5; hires-g8's forward 18 barriers a K
    step), until EXPLICIT_FMA_BLEND, CONTIGUOUS_FLAT_STORE and PAIR_AXIS_OUTER (benchmarks/NOTES.md, v29, v30); per-image
    tiles with run stores (WIDE_RUN_STORES, PER_IMAGE_RUN_STORES, v30) bring cls-14's forward to 8 bytes. Where those
    flags are on, the same builds without them must show the regressions, or this test would not catch their return."""
    from deformconv.ops import deform_conv2d as kernels

    fmas, adds, wide_stack, data_stack, barriers = _codegen()
    assert fmas > 0 and adds == 0, (fmas, adds)
    if wide_stack is not None:  # cuobjdump found (it ships with Triton)
        assert wide_stack <= 16 and data_stack <= 128 and barriers <= 4, (wide_stack, data_stack, barriers)
    flags = (kernels.EXPLICIT_FMA_BLEND, kernels.CONTIGUOUS_FLAT_STORE, kernels.PAIR_AXIS_OUTER)
    if all(flags) and kernels.triton_version() >= (3, 8):
        fmas, adds, wide_stack, data_stack, barriers = _codegen("--as-3.6")
        assert fmas == 0 and adds > 0, (fmas, adds)
        assert wide_stack is None or (wide_stack > 256 and data_stack > 128 and barriers > 4), (
            wide_stack, data_stack, barriers)


def test_launch_builds_records_and_builds_every_main_kernel(tmp_path):
    """launch_builds records an fwd+bwd step's launches without running them (on the GPU, or on the CPU under the
    interpreter: the outputs stay garbage, the launches are the product's), and builds the three main kernels of each
    for sm_90 in a subprocess without the interpreter, with registers, K loop and a SASS hash where cuobjdump is
    found."""
    lb = _load("launch_builds")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    launches = lb.record({"tiny": (2, 16, 32, 6, 7, 3, 1)}, ["float16"], device)
    names = {launch["fn"] for launch in launches}
    assert set(lb.MAIN_KERNELS) <= names, names
    assert all(launch["shape"] == "tiny" and launch["meta"].get("num_warps") for launch in launches), launches[0]
    path = tmp_path / "launches.json"
    path.write_text(__import__("json").dumps(launches))
    stdout = _sm90_build(str(EXPERIMENTS / "launch_builds.py"), "build", str(path))
    lines = [line for line in stdout.splitlines() if line.startswith("tiny float16 ")]
    assert sorted(line.split()[2] for line in lines) == ["bwd_data", "bwd_weight", "fwd"], stdout
    if all("regs=" in line for line in lines):  # cuobjdump found
        assert all(re.search(r"stack=\d+ kloop=\d+ instr sass=[0-9a-f]{12}$", line) for line in lines), lines


def test_backward_chunks_agree_with_the_whole_batch(capsys):
    """Forced 1-image chunks give the whole-batch gradients (fp32; up to summation order) in both layouts. (10x12
    images: large enough against the weight that chunks save memory, see _chunked_weight_bytes.)"""
    chunks = _load("backward_chunks")
    records = chunks.main(["--shape", "3,16,4,10,12,3,4", "--dtypes", "float32", "--layouts", "nchw", "channels_last",
                           "--variants", "whole", "0,1"])
    assert [(r["layout"], r["variant"], r["images_per_chunk"]) for r in records] == [
        ("nchw", "whole", 3), ("nchw", "0,1", 1), ("channels_last", "whole", 3), ("channels_last", "0,1", 1)]
    for rec in records:
        assert rec["max_rel_err"] < 1e-5, rec
    assert "| shape | dtype | layout | variant |" in capsys.readouterr().out


def test_backward_chunks_rejects_a_malformed_variant():
    chunks = _load("backward_chunks")
    with pytest.raises(ValueError, match="--variants: expected 'default', 'whole' or budget,min_programs"):
        chunks.main(["--shape", "1,4,4,5,5,3,1", "--variants", "1.5"])


def test_host_cost_times_a_step(capsys):
    """The host-cost script runs a few eager fwd+bwd steps and reports their CPU and wall time."""
    host = _load("host_cost")
    records = host.main(["--shape", "1,8,8,5,6,3,1", "--dtypes", "float32", "--steps", "2", "--profile"])
    assert len(records) == 1 and records[0]["cpu_ms"] > 0 and records[0]["wall_ms"] >= records[0]["cpu_ms"]
    out = capsys.readouterr().out
    assert "| shape | dtype | CPU ms a step |" in out and "tottime" in out


def test_host_cost_without_kernels_times_the_host_path(capsys):
    """--no-kernels skips the Triton launches for the measurement only (the host path's time), then restores them."""
    host = _load("host_cost")
    from deformconv.ops import deform_conv2d as kernels

    call = kernels._Launch.__call__
    records = host.main(["--shape", "1,8,8,5,6,3,1", "--dtypes", "float32", "--steps", "2", "--no-kernels"])
    assert len(records) == 1 and records[0]["no_kernels"] and records[0]["cpu_ms"] > 0
    assert kernels._Launch.__call__ is call
    assert "| shape | dtype | CPU ms a step |" in capsys.readouterr().out


def test_host_cost_sections_time_the_backend_functions(capsys):
    """--sections times each backend function and kernel launch of a step, then puts the functions back."""
    host = _load("host_cost")
    from deformconv.ops import deform_conv2d as kernels

    before = [getattr(mod, name) for mod, name in host.SECTION_FUNCTIONS]
    call = kernels._Launch.__call__
    records = host.main(["--shape", "1,8,8,5,6,3,1", "--dtypes", "float32", "--steps", "2", "--sections"])
    sections = records[0]["sections_us"]
    assert sections["deform_conv2d_backward"] >= sections["_backward_images"] > 0
    assert any(label.startswith("launch _deform_conv2d_fwd_kernel") for label in sections)
    assert [getattr(mod, name) for mod, name in host.SECTION_FUNCTIONS] == before
    assert kernels._Launch.__call__ is call
    assert "| section | CPU us a step (inclusive) |" in capsys.readouterr().out


def test_atomic_ceiling_sums_exactly(capsys):
    """The atomic-add kernel's buffer equals index_add_ of the same values, for every pixel pattern (290 rows:
    a partial last tile)."""
    ceiling = _load("atomic_ceiling")
    records = ceiling.main(["--rows", "290", "--channels", "16", "--pixels", "30", "--width", "6", "--iters", "2",
                            "--tiles", "8,8,4", "16,16,4"])
    assert len(records) == 6 and all(r["max_rel_err"] == 0.0 for r in records)
    assert "| pattern |" in capsys.readouterr().out


@pytest.mark.parametrize("variant", ["64x256x64:4:4:2:4:128:16cp", "64x256x32:4:8:3:8:96:16c",
                                     "64x512x32:4:4:1:4:112:16cps"])
def test_gluon_forward_builds_for_hopper(variant):
    """The warp-specialised Gluon prototype (runs on an H200 only) still builds for sm_90 with this Triton, without a
    GPU: its partitions' warps add up, the consumer issues wgmma, the gather warps start the weight's TMA loads, and
    the partitions get their register budgets (setmaxnreg)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    gluon_forward = _load("gluon_forward")
    kv = gluon_forward.parse_variant(variant)
    kernel = gluon_forward.compile_sm90(variant)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.num_warps == kv["nsplit"] * kv["consumer_warps"] + kv["npart"] * kv["gather_warps"]
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier.try_wait"):
        assert instruction in ptx, instruction


def test_gluon_forward_variant_names():
    """The variant names the script's --variants takes (parse_variant), each field and flag."""
    gluon_forward = _load("gluon_forward")
    kv = gluon_forward.parse_variant("64x256x32:4:8:3:8:96:16cpg")
    assert (kv["block_m"], kv["block_n"], kv["block_k"], kv["gather_warps"], kv["stages"]) == (64, 256, 32, 4, 8)
    assert (kv["npart"], kv["consumer_warps"], kv["gather_regs"]) == (3, 8, 96)
    assert kv["blend16"] and kv["chunk_major"] and kv["persistent"] == gluon_forward.SMS and kv["part_only"] == 1
    plain = gluon_forward.parse_variant("64x256x64:8:3")
    assert (plain["npart"], plain["consumer_warps"], plain["blend16"], plain["persistent"]) == (1, 4, False, 0)
    assert plain["nsplit"] == 1 and gluon_forward.parse_variant("64x512x32:4:4:1:4:112:16s")["nsplit"] == 2


def test_window_gather_checks_every_mode(capsys):
    """The window-gather experiment's kernel on a tiny layer (CPU: interpreter; GPU: compiled): plain corner loads of
    2-D and flat tiles, the window with its fallback loads, the L2-only loads -- each checked by the script against
    the float64 reference on outputs poisoned with NaN (it raises otherwise); the window without its fallback drops
    samples, and the script says so by its error."""
    window_gather = _load("window_gather")
    rows = window_gather.main(["--tiny", "--variants", "0:2x4:8x8:32:4:1,1:2x4:8x8:32:4:1,3:1x16:8x8:32:4:1,"
                                                       "2:2x4:8x8:32:4:1"])
    assert [r["variant"] for r in rows] == ["0:2x4:8x8:32:4:1", "1:2x4:8x8:32:4:1", "3:1x16:8x8:32:4:1",
                                            "2:2x4:8x8:32:4:1"]
    assert all(r["rel_err"] < 2e-3 for r in rows[:3]) and rows[3]["rel_err"] > 1e-2
    assert "rel err" in capsys.readouterr().out


def test_window_gather_builds_for_hopper():
    """The experiment's kernels build for sm_90 without a GPU: plain loads as 16-byte vectors (through the L1, or
    `.cg` in MODE 3), and the window's 1-D tl.gather on Triton's shared-memory path (no warp-local layout; 64-bit
    shared loads, paired by Triton 3.6). In a subprocess, as test_ptx_summary_compiles_every_kernel_for_sm90."""
    code = ("import re\nimport window_gather as g\n"
            "for v in ('0:1x64:16x32:32:8:1', '3:1x64:16x32:32:8:1', '1:4x16:16x32:32:8:1'):\n"
            "    asm = g.compile_sm90(v).asm\n"
            "    ptx, ttgir = asm['ptx'], asm['ttgir']\n"
            "    print(v, 'v4' if 'ld.global.v4' in ptx else '', 'cg.v4' if 'ld.global.cg.v4' in ptx else '',\n"
            "          'gather' if 'tt.gather' in ttgir else '', 'warp-local' if 'efficient_layout' in ttgir else '',\n"
            "          'lds64' if re.search(r'ld\\.shared(\\.v[24])?\\.b64', ptx) else '')")
    plain, cg, window = (line.split() for line in _sm90_build("-c", code).strip().splitlines())
    assert plain[1:] == ["v4"] and cg[1:] == ["cg.v4"], (plain, cg)
    assert "gather" in window and "lds64" in window and "warp-local" not in window, window


def test_window_gather_variant_names():
    window_gather = _load("window_gather")
    assert window_gather.parse_variant("1:4x16:16x32:64:8:2:3") == dict(
        mode=1, th=4, tw=16, wh=16, ww=32, bk=64, warps=8, stages=2, ctas_per_sm=3)
    assert window_gather.parse_variant("0:1x64:16x32:32:8:1")["ctas_per_sm"] == 0
    with pytest.raises(ValueError, match="expected 'MODE:THxTW:WHxWW:BK:warps:stages"):
        window_gather.parse_variant("1:4x16:32:8:1")
