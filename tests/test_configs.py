"""Kernel config choice: the heuristic default, opt-in autotuning (timer faked), bounded candidate lists."""

import dataclasses

import pytest
import torch

deform_ops = pytest.importorskip("deformconv.ops.deform_conv2d")
from conftest import CountingKernel, nan_filled_empty  # noqa: E402
from deformconv.checks import ConvGeometry  # noqa: E402


def _geo(cin=256, cout=256, groups=1, og=1, n=8, h=50, w=76):
    return ConvGeometry(batch=n, in_channels=cin, height=h, width=w, out_channels=cout, kernel_h=3, kernel_w=3,
                        groups=groups, offset_groups=og, stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                        out_h=h, out_w=w)


@pytest.mark.parametrize("geo", [_geo(), _geo(128, 128), _geo(64, 64, og=8, n=16, h=128, w=128), _geo(6, 4, 2, 3, 1, 5, 4)],
                         ids=["det-s4", "det-s3", "hires-g8", "segments-1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_candidate_lists_are_small_and_valid(geo, dtype):
    seg = deform_ops.segment_length(geo)
    lists = [deform_ops._fwd_candidates(geo, seg, dtype), deform_ops._bwd_data_candidates(geo, seg, dtype, torch.device("cpu")),
             deform_ops._bwd_weight_candidates(geo, seg, dtype, torch.device("cpu"))]
    for cands in lists:
        assert 1 <= len(cands) <= 4 and len(set(cands)) == len(cands)
        for c in cands:
            assert c.block_k >= 16 and c.block_n >= 16 and c.block_m >= 16 and c.split >= 1
            if dtype == torch.float32:  # 64-wide fp32 chunks only unpipelined: 2 stages of them overflow shared memory
                assert c.block_k <= 32 or c.num_stages == 1
            assert c.maxnreg is None or c.maxnreg >= 96


@pytest.mark.parametrize("shape,dtype,fwd_cap,data_cap,weight_cap", [
    ("det-s3", torch.float16, None, None, None), ("det-s4", torch.float16, 128, None, 128),
    ("cls-14", torch.bfloat16, 128, None, 128), ("hires-g8", torch.float16, 96, None, 168),
    ("hires-g8", torch.float32, None, None, 168), ("det-s4", torch.float32, 128, None, 128),
    ("cls-14", torch.float32, 128, None, 128), ("det-s3", torch.float32, None, None, 168),
])
def test_register_caps_where_measured(shape, dtype, fwd_cap, data_cap, weight_cap):
    """The default configs cap registers exactly where the H200 sweeps measured a gain (see the comment above
    FWD_WIDE_MAXNREG): the wide forward's 64x256 tile (fp32 with the K-major weight too), the 16-bit packed
    forward's 32-row tile (at 96), the packed and wide
    grad_weight kernels, fp32's narrow (unpipelined) grad_weight tile; not det-s3's forward, not the grad_input
    kernel (packed segments take 32-row tiles uncapped, the capped 64-row tile second), not deterministic mode's
    grad_input kernel."""
    geo = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "cls-14": _geo(n=64, h=14, w=14),
           "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128)}[shape]
    seg = deform_ops.segment_length(geo)
    assert deform_ops._fwd_candidates(geo, seg, dtype)[0].maxnreg == fwd_cap
    cpu = torch.device("cpu")
    assert deform_ops._bwd_data_candidates(geo, seg, dtype, cpu)[0].maxnreg == data_cap
    assert deform_ops._bwd_data_candidates(geo, seg, dtype, cpu, fixed=True)[0].maxnreg is None
    assert deform_ops._bwd_weight_candidates(geo, seg, dtype, torch.device("cpu"))[0].maxnreg == weight_cap
    if shape == "hires-g8":
        first, second = deform_ops._bwd_data_candidates(geo, seg, dtype, cpu)[:2]
        assert (first.block_m, second.block_m, second.maxnreg) == (32, 64, 128 if dtype != torch.float32 else 168)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_narrow_grad_weight_tile_stages(stages, dtype, monkeypatch):
    """det-s3's grad_weight tile (64 x 128, 4 warps) runs unpipelined in fp32 always, and in 16 bits with
    WEIGHT_NARROW_STAGES: 1 on Triton newer than 3.6 (whose extra shared-memory A tile let only 2 of its 2-stage
    programs fit an SM), 2 on Triton 3.6."""
    assert deform_ops.WEIGHT_NARROW_STAGES == (1 if deform_ops.triton_version() > (3, 6) else 2)
    monkeypatch.setattr(deform_ops, "WEIGHT_NARROW_STAGES", stages)
    geo = _geo(128, 128, h=100, w=152)
    first = deform_ops._bwd_weight_candidates(geo, deform_ops.segment_length(geo), dtype, torch.device("cpu"))[0]
    assert (first.block_m, first.block_n, first.num_warps) == (64, 128, 4)
    assert first.num_stages == (1 if dtype == torch.float32 else stages)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,expected", [
    ("hires-g8", (32, 64, 32, 4, 96)), ("og16-cout128", (128, 128, 32, 4, None)),
], ids=["hires-g8", "og16-cout128"])
def test_packed_forward_tile_by_width(shape, dtype, expected):
    """The 16-bit packed forward takes 32-row tiles capped at 96 registers with <= 64 output channels a group
    (hires-g8 fp16: 0.419 ms uncapped 64-row tiles, 0.380 capped at 128 (v16), 0.355 (v22)), the 128-row tile
    uncapped with 128 ((8,128,128,64,96,3,16): the capped 64-row tile took 0.441 ms against 0.299)."""
    geo = {"hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128), "og16-cout128": _geo(128, 128, og=16, h=64, w=96)}[shape]
    seg = deform_ops.segment_length(geo)
    assert deform_ops._short_segments(geo, seg, "fwd")
    first = deform_ops._fwd_candidates(geo, seg, dtype)[0]
    assert (first.block_m, first.block_n, first.block_k, first.num_warps, first.maxnreg) == expected


@pytest.mark.parametrize("shape,dtype,k_major", [
    ("det-s3", torch.float32, True), ("cls-14", torch.float32, True), ("hires-g8", torch.float32, True),
    ("det-s3", torch.float16, False), ("det-s4", torch.bfloat16, False), ("hires-g8", torch.float16, False),
])
def test_forward_reads_the_weight_k_major_in_fp32(shape, dtype, k_major):
    """fp32's TF32 wgmma wants its B tile K-major (weight_k_major); 16-bit dots read either order (K-major
    measured slower). Its fp32 candidates then take 16-wide chunks, with packed segments in 64-row tiles."""
    geo = {"det-s3": _geo(128, 128, h=100, w=152), "cls-14": _geo(n=64, h=14, w=14),
           "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128), "det-s4": _geo()}[shape]
    seg = deform_ops.segment_length(geo)
    assert deform_ops.weight_k_major(dtype) == k_major
    first = deform_ops._fwd_candidates(geo, seg, dtype)[0]
    assert (first.block_k == 16) == k_major
    if k_major and shape == "hires-g8":
        assert (first.block_m, first.num_stages) == (64, 3)


@pytest.mark.parametrize("taps", [(3, 2), (1, 1), (5, 5)], ids=["3x2", "1x1", "5x5"])
@pytest.mark.parametrize("weight_layout", ["nchw", "channels-last", "strided"])
@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("groups", [1, 2], ids=["groups-1", "groups-2"])
@pytest.mark.parametrize("k_major", [False, True], ids=["cin-cout", "cout-cin"])
def test_pack_weight_layouts(groups, k_major, path, weight_layout, taps, monkeypatch):
    """pack_weight: [groups, kh*kw, Cin_g, Cout_g], or K-major [groups, kh*kw, Cout_g, Cin_g], cast to the dtype asked
    for; element by element, from each weight layout, through torch's copies and through _pack_weight_kernel (as on
    the GPU: LAYOUT_KERNELS_ON_CPU), for several kernel sizes. The output is poisoned first."""
    monkeypatch.setattr(deform_ops, "LAYOUT_KERNELS_ON_CPU", path == "kernel")
    monkeypatch.setattr(deform_ops, "_PACKS", {})  # launches cached by earlier tests would not be counted
    kh, kw = taps
    w = torch.randn(6, 5, kh, kw, dtype=torch.float32)  # Cout 6, Cin_g 5
    if weight_layout == "channels-last":
        w = w.to(memory_format=torch.channels_last)
    elif weight_layout == "strided":
        w = torch.randn(6, 10, kh, kw)[:, ::2]
    launches = []
    monkeypatch.setattr(deform_ops, "_pack_weight_kernel", CountingKernel(deform_ops._pack_weight_kernel, launches))
    with nan_filled_empty():
        packed = deform_ops.pack_weight(w, groups, k_major, torch.float16)
    assert len(launches) == (path == "kernel")
    cout_g = 6 // groups
    assert packed.is_contiguous() and packed.dtype == torch.float16
    assert packed.shape == ((groups, kh * kw, cout_g, 5) if k_major else (groups, kh * kw, 5, cout_g))
    expected = w.to(torch.float16)
    for g in range(groups):
        for tap in range(kh * kw):
            for o in range(cout_g):
                for c in range(5):
                    got = packed[g, tap, o, c] if k_major else packed[g, tap, c, o]
                    assert got == expected[g * cout_g + o, c, tap // kw, tap % kw]


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("weight_layout", ["nchw", "channels-last"])
@pytest.mark.parametrize("k_major", [False, True], ids=["cin-cout", "cout-cin"])
@pytest.mark.parametrize("grouped", [False, True], ids=["nhwc", "offset-grouped"])
def test_forward_operands_pack_and_transpose_in_one_launch(grouped, k_major, weight_layout, fused, monkeypatch):
    """forward_operands: an NCHW input's copy (NHWC, or offset-grouped [N, G, H, W, C/G]) and the packed weight (cast
    to the input's dtype) from one _pack_and_transpose_kernel launch (FUSED_PREP), or from the two separate passes:
    the same bits as torch's permutes either way, every element written (outputs poisoned)."""
    monkeypatch.setattr(deform_ops, "LAYOUT_KERNELS_ON_CPU", True)
    monkeypatch.setattr(deform_ops, "FUSED_PREP", fused)
    for cache in ("_PACKS", "_TRANSPOSES", "_PACK_AND_TRANSPOSE"):  # cached launches would not be counted
        monkeypatch.setattr(deform_ops, cache, {})
    launches = {}
    for name in ("_pack_and_transpose_kernel", "_pack_weight_kernel", "_transpose_kernel"):
        launches[name] = []
        monkeypatch.setattr(deform_ops, name, CountingKernel(getattr(deform_ops, name), launches[name]))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 5, 7, generator=g).to(torch.float16)  # 4 offset groups of 4 channels
    w = torch.randn(6, 8, 3, 3, generator=g)                      # fp32, 2 conv groups
    if weight_layout == "channels-last":
        w = w.to(memory_format=torch.channels_last)
    with nan_filled_empty():
        got_x, got_w = deform_ops.forward_operands(x, w, 2, 4, grouped, k_major)
    assert {k: len(v) for k, v in launches.items()} == (
        {"_pack_and_transpose_kernel": 1, "_pack_weight_kernel": 0, "_transpose_kernel": 0} if fused else
        {"_pack_and_transpose_kernel": 0, "_pack_weight_kernel": 1, "_transpose_kernel": 1})
    if grouped:
        assert torch.equal(got_x, x.view(2, 4, 4, 5, 7).permute(0, 1, 3, 4, 2))
    else:
        assert got_x.is_contiguous(memory_format=torch.channels_last) and torch.equal(got_x, x)
    monkeypatch.setattr(deform_ops, "LAYOUT_KERNELS_ON_CPU", False)
    assert got_w.dtype == torch.float16 and torch.equal(got_w, deform_ops.pack_weight(w, 2, k_major, torch.float16))


@pytest.mark.parametrize("shape,dtype,block_n", [
    ("det-s4", torch.float16, 256), ("det-s5", torch.float16, 256), ("cls-14", torch.bfloat16, 256),
    ("det-s5", torch.float32, 256), ("det-s3", torch.float16, 128),
])
def test_grad_weight_tile_of_wide_layers(shape, dtype, block_n):
    """grad_weight takes one 256-column tile for Cout >= 256 whatever the number of positions (det-s5 and
    cls-14 measured faster than with 128 columns, fp16 and fp32)."""
    geo = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38),
           "cls-14": _geo(n=64, h=14, w=14)}[shape]
    first = deform_ops._bwd_weight_candidates(geo, deform_ops.segment_length(geo), dtype, torch.device("cpu"))[0]
    assert first.block_n == block_n


@pytest.mark.parametrize("shape,sms,split,concurrent_split,fixed_split", [
    ("det-s5", 132, 9, 9, 3), ("det-s4", 132, 1, 3, 1), ("cls-14", 132, 9, 9, 1), ("cls-14", 64, 1, 3, 1),
    ("cls-14", 32, 1, 1, 1), ("det-s4", 1000, 9, 9, 3), ("1x1", 132, 1, 1, 1), ("7x7", 132, 9, 9, 3),
])
def test_grad_input_kernel_splits_taps_when_tiles_are_few(shape, sms, split, concurrent_split, fixed_split,
                                                          monkeypatch):
    """The grad_input kernel's tap split (Config.split), M tiles of 64 rows: one program per tap (at most 9) when the
    tiles are fewer than two per multiprocessor; beside grad_weight (concurrent) also 3 below four per
    multiprocessor; in deterministic mode 3 when they are fewer than the multiprocessors, concurrent or not; never
    more programs than taps, never on the CPU (the interpreter)."""
    monkeypatch.setattr(deform_ops, "_sm_count", lambda device: sms)
    monkeypatch.setattr(deform_ops, "tma_supported", lambda device: True)  # no GPU to ask here
    small = dict(batch=1, in_channels=8, height=5, width=5, out_channels=8, groups=1, offset_groups=1, stride=(1, 1),
                 dilation=(1, 1), out_h=5, out_w=5)
    geo = {"det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38), "cls-14": _geo(n=64, h=14, w=14),
           "1x1": ConvGeometry(kernel_h=1, kernel_w=1, padding=(0, 0), **small),
           "7x7": ConvGeometry(kernel_h=7, kernel_w=7, padding=(3, 3), **small)}[shape]
    seg = deform_ops.segment_length(geo)
    for fixed in (False, True):
        for concurrent in (False, True):
            cands = deform_ops._bwd_data_candidates(geo, seg, torch.float16, torch.device("cuda"), fixed, concurrent)
            want = fixed_split if fixed else concurrent_split if concurrent else split
            assert {c.split for c in cands} == {want}, (fixed, concurrent)
            cpu = deform_ops._bwd_data_candidates(geo, seg, torch.float16, torch.device("cpu"), fixed, concurrent)
            assert {c.split for c in cpu} == {1}


@pytest.mark.parametrize("shape,dtype,split,concurrent_split", [
    ("det-s5", torch.float16, 3, 1), ("det-s5", torch.float32, 2, 1), ("cls-14", torch.float16, 5, 2),
    ("cls-14", torch.bfloat16, 5, 2), ("cls-14", torch.float32, 5, 2), ("det-s4", torch.float16, 11, 2),
    ("det-s4", torch.float32, 6, 2),
])
def test_grad_weight_split_beside_grad_input(shape, dtype, split, concurrent_split, monkeypatch):
    """grad_weight's split-M (its first config, 132 multiprocessors): about 3 programs per multiprocessor alone
    (within the partial sums' memory cap), about CONCURRENT_WEIGHT_PROGRAMS_PER_SM beside the grad_input kernel:
    half a multiprocessor in 16 bits (v24: cls-14's and det-s4's split 4 -> 2, same time, less workspace), one in
    fp32 (its cls-14 tiles are twice as many: split 2 either way)."""
    monkeypatch.setattr(deform_ops, "_sm_count", lambda device: 132)
    monkeypatch.setattr(deform_ops, "tma_supported", lambda device: True)
    geo = {"det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38), "cls-14": _geo(n=64, h=14, w=14)}[shape]
    seg = deform_ops.segment_length(geo)
    cuda = torch.device("cuda")
    assert deform_ops._bwd_weight_candidates(geo, seg, dtype, cuda)[0].split == split
    assert deform_ops._bwd_weight_candidates(geo, seg, dtype, cuda, concurrent=True)[0].split == concurrent_split


@pytest.mark.parametrize("shape,dtype,block", [
    ("det-s3", torch.float16, (64, 128, 16, 4)), ("det-s4", torch.float16, (64, 128, 16, 4)),
    ("cls-14", torch.float32, (64, 128, 16, 4)), ("det-s5", torch.float16, (64, 128, 32, 8)),
    ("det-s5", torch.float32, (64, 128, 32, 8)), ("hires-g8", torch.float16, (32, 64, 32, 4)),
    ("hires-g8", torch.float32, (32, 64, 32, 4)),
])
def test_deterministic_grad_input_kernel_configs(shape, dtype, block):
    """Deterministic mode's grad_input kernel (int64 fixed-point adds, H200 sweeps of v14/v15): 16-wide chunks in
    4 warps first (about twice as fast as v7's 8 warps, which stay a candidate), but 32-wide chunks in 8 warps for
    512 output channels and the default's 32-row tile for packed segments; never a register cap."""
    geo = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38),
           "cls-14": _geo(n=64, h=14, w=14), "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128)}[shape]
    seg = deform_ops.segment_length(geo)
    cands = deform_ops._bwd_data_candidates(geo, seg, dtype, torch.device("cpu"), fixed=True)
    first = cands[0]
    assert (first.block_m, first.block_n, first.block_k, first.num_warps) == block
    assert all(c.maxnreg is None for c in cands)
    if block[2:] == (16, 4):
        assert dataclasses.replace(first, num_warps=8) in cands
    if shape == "hires-g8":
        assert first == deform_ops._bwd_data_candidates(geo, seg, dtype, torch.device("cpu"))[0]


@pytest.mark.parametrize("shape,dtype,ahead", [
    ("det-s3", torch.float16, True), ("det-s3", torch.bfloat16, True), ("det-s3", torch.float32, True),
    ("det-s4", torch.float16, False), ("cls-14", torch.float32, False), ("hires-g8", torch.float16, False),
    ("hires-g8", torch.float32, False),
])
def test_forward_loads_sample_points_ahead_in_128_row_tiles(shape, dtype, ahead):
    """The forward issues each (tap, segment) step's offsets and mask a step ahead where the H200 measured it
    faster (v15): the 128-row, 4-warp, 3-stage tiles of long segments (det-s3: -11% fp16, -15% bf16, -5% fp32),
    not the wide 64x256 tile (+1.5%) and not packed segments (which prefetch their own way)."""
    geo = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "cls-14": _geo(n=64, h=14, w=14),
           "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128)}[shape]
    seg = deform_ops.segment_length(geo)
    cands = deform_ops._fwd_candidates(geo, seg, dtype)
    assert cands[0].sample_ahead == ahead
    if ahead:
        assert (cands[0].block_m, cands[0].num_warps, cands[0].num_stages) == (128, 4, 3)
        assert not cands[1].sample_ahead and (cands[1].block_m, cands[1].num_warps) == (128, 4)  # the former default
    assert not any(c.sample_ahead for c in cands) or not deform_ops._short_segments(geo, seg, "fwd")


def test_config_launch_options():
    assert deform_ops.Config(64, 64, 32, 4, 1).launch_options() == dict(num_warps=4, num_stages=1)
    assert deform_ops.Config(64, 64, 32, 4, 1, maxnreg=168).launch_options() == dict(num_warps=4, num_stages=1,
                                                                                      maxnreg=168)


def test_default_is_the_heuristic_without_autotune(monkeypatch):
    monkeypatch.delenv("DEFORMCONV_AUTOTUNE", raising=False)
    cands = [deform_ops.Config(128, 128, 32, 4), deform_ops.Config(64, 64, 32, 4)]
    calls = []
    key = ("test-default", 1)
    deform_ops._TUNED.pop(key, None)
    assert deform_ops._pick_config(key, cands, calls.append, torch.device("cuda")) == cands[0]
    assert calls == []  # nothing launched to choose


def test_a_shape_class_shares_tiles_not_splits(monkeypatch):
    """Shapes of one class (same channels, kernel, dtype, positions up to the next power of two) on either side
    of a split threshold: without autotuning each gets its own heuristic default; with it, the tile tuned for
    the first and the split of its own candidates."""
    key = ("test-class", 1)
    first = [deform_ops.Config(64, 128, 32, 4, split=3), deform_ops.Config(64, 64, 32, 4, split=3)]
    second = [deform_ops.Config(64, 128, 32, 4, split=1), deform_ops.Config(64, 64, 32, 4, split=1)]
    monkeypatch.delenv("DEFORMCONV_AUTOTUNE", raising=False)
    monkeypatch.setattr(deform_ops, "_TUNED", {})
    assert deform_ops._pick_config(key, first, lambda cfg: None, torch.device("cuda")) == first[0]
    assert deform_ops._pick_config(key, second, lambda cfg: None, torch.device("cuda")) == second[0]
    assert deform_ops.chosen_configs()[key] == first[0]  # the class's first choice, as recorded
    monkeypatch.setenv("DEFORMCONV_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(deform_ops, "_TUNED", {key: first[1]})  # tuned on the first shape: the 64-column tile
    assert deform_ops._pick_config(key, second, lambda cfg: None, torch.device("cuda")) == second[1]


def test_autotune_keeps_default_unless_5_percent_faster(monkeypatch):
    import triton.testing

    monkeypatch.setenv("DEFORMCONV_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, b, c = deform_ops.Config(128, 128, 32, 4), deform_ops.Config(64, 64, 32, 4), deform_ops.Config(64, 128, 64, 8)
    fake = {a: 1.00, b: 0.97, c: 0.80}
    current = {}

    def launch(cfg):
        if cfg == c and current.get("fail"):
            raise RuntimeError("out of resources")
        current["cfg"] = cfg

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), fake[current["cfg"]])[1])
    for key in (("t", 1), ("t", 2)):
        deform_ops._TUNED.pop(key, None)
    assert deform_ops._pick_config(("t", 1), [a, b], launch, torch.device("cuda")) == a  # 3% is noise
    assert deform_ops._pick_config(("t", 2), [a, b, c], launch, torch.device("cuda")) == c
    current["fail"] = True
    deform_ops._TUNED.pop(("t", 2))
    assert deform_ops._pick_config(("t", 2), [a, b, c], launch, torch.device("cuda")) == a  # c cannot run
    assert deform_ops.chosen_configs()[("t", 2)] == a


# --- _Launch: JIT on the first call, the compiled kernel's launcher afterwards (faked Triton objects) ---


class _FakeCompiled:
    """Stands in for triton's CompiledKernel: ``compiled[grid](*args)`` launches."""

    packed_metadata = object()

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def __getitem__(self, grid):
        def runner(*args):
            if self.fail:
                raise IndexError("launcher wants other arguments")
            self.log.append(("direct", grid, args))
        return runner


class _FakeJit:
    arg_names = ["x", "y", "N", "BLOCK", "FLAG"]

    def __init__(self, fail=False):
        self.log, self.fail = [], fail

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _FakeCompiled(self.log, self.fail)
        return run


def test_launch_goes_direct_after_the_first_call(monkeypatch):
    monkeypatch.delenv("DEFORMCONV_FAST_LAUNCH", raising=False)
    fn = _FakeJit()
    run = deform_ops._Launch(fn, (4,), (7,), dict(BLOCK=16, FLAG=True, num_warps=4))
    run("a", "b")
    run("c", "d")
    assert fn.log[0] == ("jit", (4, 1, 1), ("a", "b", 7), dict(BLOCK=16, FLAG=True, num_warps=4))
    # every parameter in signature order (constexprs too, launch options not), the grid padded to 3 dims
    assert fn.log[1] == ("direct", (4, 1, 1), ("c", "d", 7, 16, True))


def test_launch_falls_back_to_the_jit_when_the_launcher_refuses(monkeypatch):
    monkeypatch.delenv("DEFORMCONV_FAST_LAUNCH", raising=False)
    fn = _FakeJit(fail=True)
    run = deform_ops._Launch(fn, (4, 2), (7,), dict(BLOCK=16, FLAG=False, num_warps=4))
    for t in ("a", "b", "c"):
        run(t, t)
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"]  # one refused try, then the JIT for good


def test_fast_launch_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("DEFORMCONV_FAST_LAUNCH", "0")
    fn = _FakeJit()
    run = deform_ops._Launch(fn, (4,), (7,), dict(BLOCK=16, FLAG=True, num_warps=4))
    run("a", "b")
    run("c", "d")
    assert [e[0] for e in fn.log] == ["jit", "jit"]


@pytest.mark.parametrize("geo,grouped", [
    (_geo(64, 64, og=8, n=16, h=128, w=128), True),   # hires-g8: 8-channel offset groups, packed
    (_geo(16, 8, og=4), True),                          # 4-channel groups
    (_geo(48, 40, groups=2, og=12), True),              # conv groups of whole offset groups (segments = groups)
    (_geo(24, 16, groups=2, og=3), False),              # segments of 4 inside 8-channel offset groups
    (_geo(256, 256, og=1), False),                      # long segments: NHWC
    (_geo(64, 64, og=4), False),                        # 16-channel groups: not packed
], ids=["hires-g8", "og4", "groups2-og12", "segments-in-groups", "det-s4", "og4-c64"])
def test_offset_grouped_layout_where_segments_are_whole_packed_groups(geo, grouped):
    """The kernels read the input offset-grouped exactly where segments are packed and each one a whole offset
    group (then all three kernels take packed segments); NHWC otherwise."""
    seg = deform_ops.segment_length(geo)
    assert deform_ops.grouped_input(geo, seg) == grouped
    if grouped:
        for kind in ("fwd", "bwd_data", "bwd_weight"):
            assert deform_ops.segments_per_chunk(geo, seg, 32, kind) > 1


BENCH_GEOS = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38),
              "cls-14": _geo(n=64, h=14, w=14), "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128)}


@pytest.mark.parametrize("shape,dtype,fwd,data,weight", [
    ("det-s3", torch.float16, False, False, True), ("det-s4", torch.float16, True, True, True),
    ("det-s5", torch.bfloat16, True, True, True), ("cls-14", torch.float16, True, True, True),
    ("hires-g8", torch.float16, False, False, False), ("det-s4", torch.float32, True, True, True),
    ("det-s3", torch.float32, True, True, True), ("det-s5", torch.float32, True, True, True),
    ("hires-g8", torch.float32, False, False, False),
])
def test_tma_where_measured_faster(shape, dtype, fwd, data, weight):
    """Config.tma on the default configs where it measured faster on the H200 (v17, v18): in 16 bits the forward's
    64x256 tile (det-s4 0.164 -> 0.152 ms), the grad_input kernel where grad_out is not resident, in 4 warps (cls-14
    0.280 -> 0.245, det-s5 0.410 -> 0.387 in 4 warps instead of 8), grad_weight with long segments (det-s4 0.262 ->
    0.234); in fp32 all three with long segments, grad_out resident or not (det-s5 grad_input 1.011 -> 0.678,
    det-s3 forward 0.428 -> 0.400). Not the 16-bit 128x128 forward (det-s3 +3%), packed segments, or the
    deterministic grad_input kernel (never measured)."""
    geo = BENCH_GEOS[shape]
    seg, cpu = deform_ops.segment_length(geo), torch.device("cpu")
    assert deform_ops._fwd_candidates(geo, seg, dtype)[0].tma == fwd
    assert deform_ops._bwd_data_candidates(geo, seg, dtype, cpu)[0].tma == data
    assert not deform_ops._bwd_data_candidates(geo, seg, dtype, cpu, fixed=True)[0].tma
    assert deform_ops._bwd_weight_candidates(geo, seg, dtype, cpu)[0].tma == weight


def test_tma_launch_refusals(monkeypatch):
    """_tma_launch says no unless the config asks, the dtype is fp16, bf16 or fp32, chunks are whole, the device has
    TMA and every operand is addressable (16-byte aligned, rows of a multiple of 16 bytes, not empty)."""
    asks, plain = deform_ops.Config(64, 256, 32, 8, tma=True), deform_ops.Config(64, 256, 32, 8)
    w = torch.empty(3, 9, 32, 24, dtype=torch.float16)
    ok = [(w, 24)]
    assert deform_ops._tma_launch(asks, torch.float16, True, ok)
    assert deform_ops._tma_launch(asks, torch.bfloat16, True, ok)
    assert not deform_ops._tma_launch(plain, torch.float16, True, ok)
    assert deform_ops._tma_launch(asks, torch.float32, True, [(w.float(), 24)])
    assert not deform_ops._tma_launch(asks, torch.float32, True, [(torch.empty(3, 9, 32, 6), 6)])  # 24-byte rows
    assert not deform_ops._tma_launch(asks, torch.float64, True, ok)
    assert not deform_ops._tma_launch(asks, torch.float16, False, ok)
    assert not deform_ops._tma_launch(asks, torch.float16, True, [(torch.empty(3, 9, 32, 20, dtype=torch.float16), 20)])
    assert not deform_ops._tma_launch(asks, torch.float16, True, [(torch.empty(8 * 24 + 1, dtype=torch.float16)[1:], 24)])
    assert not deform_ops._tma_launch(asks, torch.float16, True, [(torch.empty(0, 24, dtype=torch.float16), 24)])
    monkeypatch.setattr(deform_ops, "tma_supported", lambda device: False)
    assert not deform_ops._tma_launch(asks, torch.float16, True, ok)


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_tma_supported_from_hopper_on(capability, expected, monkeypatch):
    """TMA descriptors from compute capability 9.0 (Hopper) on; on the CPU the interpreter emulates them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert deform_ops.tma_supported(torch.device("cuda", 0)) == expected
    assert deform_ops.tma_supported(torch.device("cpu"))
