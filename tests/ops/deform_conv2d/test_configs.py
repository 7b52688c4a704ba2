"""Kernel config choice: the heuristic default, opt-in autotuning (timer faked), bounded candidate lists."""

import pytest
import torch
from conftest import CountingKernel, kernel_modules, nan_filled_empty, requires_interpreter

from deformconv.checks import ConvGeometry
from deformconv.config import options

pytestmark = pytest.mark.usefixtures("implicit_gemm_for_groups")  # these kernels' routes, grouped cases included

K = kernel_modules()


def _geo(cin=256, cout=256, groups=1, og=1, n=8, h=50, w=76):
    return ConvGeometry(batch=n, in_channels=cin, height=h, width=w, out_channels=cout, kernel_h=3, kernel_w=3,
                        groups=groups, offset_groups=og, stride=(1, 1), padding=(1, 1), dilation=(1, 1),
                        out_h=h, out_w=w)


@pytest.mark.parametrize("geo", [_geo(), _geo(128, 128), _geo(64, 64, og=8, n=16, h=128, w=128),
                                 _geo(6, 4, 2, 3, 1, 5, 4)],
                         ids=["det-s4", "det-s3", "hires-g8", "segments-1"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_candidate_lists_are_small_and_valid(geo, dtype):
    seg = K.geometry.segment_length(geo)
    cpu = torch.device("cpu")
    lists = [K.configs.fwd_candidates(geo, seg, dtype, cpu), K.configs.bwd_data_candidates(geo, seg, dtype, cpu),
             K.configs.bwd_weight_candidates(geo, seg, dtype, cpu)]
    for cands in lists:
        assert 1 <= len(cands) <= 4 and len(set(cands)) == len(cands)
        for c in cands:
            assert c.block_k >= 16 and c.block_n >= 16 and c.block_m >= 16 and c.split >= 1
            if dtype == torch.float32:  # 64-wide fp32 chunks only unpipelined: 2 stages of them overflow shared memory
                assert c.block_k <= 32 or c.num_stages == 1
            assert c.maxnreg is None or c.maxnreg >= 96


@pytest.mark.parametrize("taps", [(3, 2), (1, 1), (5, 5)], ids=["3x2", "1x1", "5x5"])
@pytest.mark.parametrize("weight_layout", ["nchw", "channels-last", "strided"])
@pytest.mark.parametrize("path", ["torch", pytest.param("kernel", marks=requires_interpreter)])
@pytest.mark.parametrize("groups", [1, 2], ids=["groups-1", "groups-2"])
@pytest.mark.parametrize("k_major", [False, True], ids=["cin-cout", "cout-cin"])
def test_pack_weight_layouts(groups, k_major, path, weight_layout, taps, monkeypatch, forced):
    """pack_weight: [groups, kh*kw, Cin_g, Cout_g], or K-major [groups, kh*kw, Cout_g, Cin_g], cast to the dtype asked
    for; element by element, from each weight layout, through torch's copies and through _pack_weight_kernel (as on
    the GPU: options.layout_kernels_on_cpu), for several kernel sizes. The output is poisoned first."""
    forced(layout_kernels_on_cpu=path == "kernel")  # and no launches cached by earlier tests: all are counted
    kh, kw = taps
    w = torch.randn(6, 5, kh, kw, dtype=torch.float32)  # Cout 6, Cin_g 5
    if weight_layout == "channels-last":
        w = w.to(memory_format=torch.channels_last)
    elif weight_layout == "strided":
        w = torch.randn(6, 10, kh, kw)[:, ::2]
    launches = []
    monkeypatch.setattr(K.packing, "_pack_weight_kernel", CountingKernel(K.packing._pack_weight_kernel, launches))
    with nan_filled_empty():
        packed = K.packing.pack_weight(w, groups, k_major, torch.float16)
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


@requires_interpreter
@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize("weight_layout", ["nchw", "channels-last"])
@pytest.mark.parametrize("k_major", [False, True], ids=["cin-cout", "cout-cin"])
@pytest.mark.parametrize("grouped", [False, True], ids=["nhwc", "offset-grouped"])
def test_forward_operands_pack_and_transpose_in_one_launch(grouped, k_major, weight_layout, fused, monkeypatch, forced):
    """forward_operands: an NCHW input's copy (NHWC, or offset-grouped [N, G, H, W, C/G]) and the packed weight (cast
    to the input's dtype) from one _pack_and_transpose_kernel launch (options.fused_prep), or from the two separate
    passes: the same bits as torch's permutes either way, every element written (outputs poisoned)."""
    forced(layout_kernels_on_cpu=True, fused_prep=fused)  # and no cached launches: all are counted
    launches = {}
    for name in ("_pack_and_transpose_kernel", "_pack_weight_kernel", "_transpose_kernel"):
        launches[name] = []
        module = K.layout if name == "_transpose_kernel" else K.packing
        monkeypatch.setattr(module, name, CountingKernel(getattr(module, name), launches[name]))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 5, 7, generator=g).to(torch.float16)  # 4 offset groups of 4 channels
    w = torch.randn(6, 8, 3, 3, generator=g)                      # fp32, 2 conv groups
    if weight_layout == "channels-last":
        w = w.to(memory_format=torch.channels_last)
    with nan_filled_empty():
        got_x, got_w = K.packing.forward_operands(x, w, 2, 4, grouped, k_major)
    assert {k: len(v) for k, v in launches.items()} == (
        {"_pack_and_transpose_kernel": 1, "_pack_weight_kernel": 0, "_transpose_kernel": 0} if fused else
        {"_pack_and_transpose_kernel": 0, "_pack_weight_kernel": 1, "_transpose_kernel": 1})
    if grouped:
        assert torch.equal(got_x, x.view(2, 4, 4, 5, 7).permute(0, 1, 3, 4, 2))
    else:
        assert got_x.is_contiguous(memory_format=torch.channels_last) and torch.equal(got_x, x)
    forced(layout_kernels_on_cpu=False)
    assert got_w.dtype == torch.float16 and torch.equal(got_w, K.packing.pack_weight(w, 2, k_major, torch.float16))


@pytest.mark.parametrize("shape,sms,split,concurrent_split,fixed_split", [
    ("det-s5", 132, 9, 9, 3), ("det-s4", 132, 1, 3, 1), ("cls-14", 132, 9, 9, 1), ("cls-14", 64, 1, 3, 1),
    ("cls-14", 32, 1, 1, 1), ("det-s4", 1000, 9, 9, 3), ("1x1", 132, 1, 1, 1), ("7x7", 132, 9, 9, 3),
])
def test_grad_input_kernel_splits_taps_when_tiles_are_few(shape, sms, split, concurrent_split, fixed_split,
                                                          monkeypatch, forced):
    """The grad_input kernel's tap split (Config.split), M tiles of 64 rows: one program per tap (at most 9) when the
    tiles are fewer than two per multiprocessor; beside grad_weight (concurrent) also 3 below four per
    multiprocessor; in deterministic mode 3 when they are fewer than the multiprocessors, concurrent or not; never
    more programs than taps, never on the CPU (the interpreter)."""
    monkeypatch.setattr(K.configs, "sm_count", lambda device: sms)
    monkeypatch.setattr(K.launch, "tma_supported", lambda device: True)  # no GPU to ask here
    small = dict(batch=1, in_channels=8, height=5, width=5, out_channels=8, groups=1, offset_groups=1, stride=(1, 1),
                 dilation=(1, 1), out_h=5, out_w=5)
    geo = {"det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38), "cls-14": _geo(n=64, h=14, w=14),
           "1x1": ConvGeometry(kernel_h=1, kernel_w=1, padding=(0, 0), **small),
           "7x7": ConvGeometry(kernel_h=7, kernel_w=7, padding=(3, 3), **small)}[shape]
    seg = K.geometry.segment_length(geo)
    for fixed in (False, True):
        for concurrent in (False, True):
            cands = K.configs.bwd_data_candidates(geo, seg, torch.float16, torch.device("cuda"), fixed, concurrent)
            want = fixed_split if fixed else concurrent_split if concurrent else split
            assert {c.split for c in cands} == {want}, (fixed, concurrent)
            cpu = K.configs.bwd_data_candidates(geo, seg, torch.float16, torch.device("cpu"), fixed, concurrent)
            assert {c.split for c in cpu} == {1}


@pytest.mark.parametrize("shape,dtype,split,concurrent_split", [
    ("det-s5", torch.float16, 3, 1), ("det-s5", torch.float32, 2, 1), ("cls-14", torch.float16, 5, 2),
    ("cls-14", torch.bfloat16, 5, 2), ("cls-14", torch.float32, 5, 2), ("det-s4", torch.float16, 11, 2),
    ("det-s4", torch.float32, 6, 2),
])
def test_grad_weight_split_beside_grad_input(shape, dtype, split, concurrent_split, monkeypatch, forced):
    """grad_weight's split-M (its first config, 132 multiprocessors): about 3 programs per multiprocessor alone
    (within the partial sums' memory cap), about CONCURRENT_WEIGHT_PROGRAMS_PER_SM beside the grad_input kernel:
    half a multiprocessor in 16 bits (the same time with less workspace), one in
    fp32 (its cls-14 tiles are twice as many: split 2 either way)."""
    monkeypatch.setattr(K.configs, "sm_count", lambda device: 132)
    monkeypatch.setattr(K.launch, "tma_supported", lambda device: True)
    geo = {"det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38), "cls-14": _geo(n=64, h=14, w=14)}[shape]
    seg = K.geometry.segment_length(geo)
    cuda = torch.device("cuda")
    assert K.configs.bwd_weight_candidates(geo, seg, dtype, cuda)[0].split == split
    assert K.configs.bwd_weight_candidates(geo, seg, dtype, cuda, concurrent=True)[0].split == concurrent_split


def test_config_launch_options():
    assert K.configs.Config(64, 64, 32, 4, 1).launch_options() == dict(num_warps=4, num_stages=1)
    assert K.configs.Config(64, 64, 32, 4, 1, maxnreg=168).launch_options() == dict(num_warps=4, num_stages=1,
                                                                                      maxnreg=168)


def test_default_is_the_heuristic_without_autotune(monkeypatch, forced):
    monkeypatch.delenv("DEFORMCONV_AUTOTUNE", raising=False)
    monkeypatch.setattr(K.launch, "shared_memory_per_block", lambda device: K.launch.TUNED_SHARED_MEMORY)
    cands = [K.configs.Config(128, 128, 32, 4), K.configs.Config(64, 64, 32, 4)]
    calls = []
    key = ("test-default", 1)
    options.cache("tuned").pop(key, None)
    assert K.launch.pick_config(key, cands, calls.append, torch.device("cuda")) == cands[0]
    assert calls == []  # nothing launched to choose


def test_a_shape_class_shares_tiles_not_splits(monkeypatch, forced):
    """Shapes of one class (same channels, kernel, dtype, positions up to the next power of two) on either side
    of a split threshold: without autotuning each gets its own heuristic default; with it, the tile tuned for
    the first and the split of its own candidates."""
    key = ("test-class", 1)
    first = [K.configs.Config(64, 128, 32, 4, split=3), K.configs.Config(64, 64, 32, 4, split=3)]
    second = [K.configs.Config(64, 128, 32, 4, split=1), K.configs.Config(64, 64, 32, 4, split=1)]
    monkeypatch.delenv("DEFORMCONV_AUTOTUNE", raising=False)
    monkeypatch.setattr(K.launch, "shared_memory_per_block", lambda device: K.launch.TUNED_SHARED_MEMORY)
    options.cache("tuned").clear()
    assert K.launch.pick_config(key, first, lambda cfg: None, torch.device("cuda")) == first[0]
    assert K.launch.pick_config(key, second, lambda cfg: None, torch.device("cuda")) == second[0]
    assert K.launch.chosen_configs()[key] == first[0]  # the class's first choice, as recorded
    monkeypatch.setenv("DEFORMCONV_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    options.cache("tuned").update({key: first[1]})  # tuned on the first shape: the 64-column tile
    assert K.launch.pick_config(key, second, lambda cfg: None, torch.device("cuda")) == second[1]


def test_a_gpu_with_less_shared_memory_takes_the_first_tile_that_fits(monkeypatch, forced):
    """An RTX 4090 or L4 (99 KiB a block): a default tile needing more is passed over for the next candidate, once per
    shape class; none fitting is a clear error. Triton raises OutOfResources before launching such a kernel."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.delenv("DEFORMCONV_AUTOTUNE", raising=False)
    monkeypatch.setattr(K.launch, "shared_memory_per_block", lambda device: 101376)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    big, small = K.configs.Config(64, 256, 32, 8), K.configs.Config(64, 128, 32, 4, num_stages=1)
    launched = []

    def launch(cfg):
        if cfg.block_n > 128:
            raise OutOfResources(107264, 101376, "shared memory")
        launched.append(cfg)

    key = ("test-fits", 1)
    options.cache("tuned").pop(key, None)
    assert K.launch.pick_config(key, [big, small], launch, torch.device("cuda")) == small
    assert K.launch.pick_config(key, [big, small], launch, torch.device("cuda")) == small
    assert launched == [small]  # the choice is made once
    options.cache("tuned").pop(key)
    with pytest.raises(RuntimeError, match="no tile config of this kernel fits this GPU"):
        K.launch.pick_config(key, [big], launch, torch.device("cuda"))


def test_autotune_keeps_default_unless_5_percent_faster(monkeypatch, forced):
    import triton.testing

    monkeypatch.setenv("DEFORMCONV_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    a, b, c = K.configs.Config(128, 128, 32, 4), K.configs.Config(64, 64, 32, 4), K.configs.Config(64, 128, 64, 8)
    fake = {a: 1.00, b: 0.97, c: 0.80}
    current = {}

    def launch(cfg):
        if cfg == c and current.get("fail"):
            raise RuntimeError("out of resources")
        current["cfg"] = cfg

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), fake[current["cfg"]])[1])
    for key in (("t", 1), ("t", 2)):
        options.cache("tuned").pop(key, None)
    assert K.launch.pick_config(("t", 1), [a, b], launch, torch.device("cuda")) == a  # 3% is noise
    assert K.launch.pick_config(("t", 2), [a, b, c], launch, torch.device("cuda")) == c
    current["fail"] = True
    options.cache("tuned").pop(("t", 2))
    assert K.launch.pick_config(("t", 2), [a, b, c], launch, torch.device("cuda")) == a  # c cannot run
    assert K.launch.chosen_configs()[("t", 2)] == a


# --- Launch: JIT on the first call, the compiled kernel's launcher afterwards (faked Triton objects) ---


class _FakeCompiled:
    """Stands in for triton's CompiledKernel (what its JIT call returns)."""


class _FakeJit:
    arg_names = ["x", "y", "N", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _FakeCompiled()
        return run


def _fake_direct(monkeypatch, log, fail=False):
    """compat.direct_launcher replaced by one whose launcher logs (or refuses its arguments, as a Triton whose
    launcher wants others would)."""
    def direct_launcher(compiled):
        assert isinstance(compiled, _FakeCompiled)

        def go(grid, *args):
            if fail:
                raise IndexError("launcher wants other arguments")
            log.append(("direct", grid, args))
        return go

    monkeypatch.setattr(K.launch, "direct_launcher", direct_launcher)


def test_launch_goes_direct_after_the_first_call(monkeypatch, forced):
    monkeypatch.delenv("DEFORMCONV_FAST_LAUNCH", raising=False)
    fn = _FakeJit()
    _fake_direct(monkeypatch, fn.log)
    run = K.launch.Launch(fn, (4,), (7,), dict(BLOCK=16, FLAG=True, num_warps=4))
    run("a", "b")
    run("c", "d")
    assert fn.log[0] == ("jit", (4, 1, 1), ("a", "b", 7), dict(BLOCK=16, FLAG=True, num_warps=4))
    # every parameter in signature order (constexprs too, launch options not), the grid padded to 3 dims
    assert fn.log[1] == ("direct", (4, 1, 1), ("c", "d", 7, 16, True))


def test_launch_falls_back_to_the_jit_when_the_launcher_refuses(monkeypatch, forced):
    monkeypatch.delenv("DEFORMCONV_FAST_LAUNCH", raising=False)
    fn = _FakeJit()
    _fake_direct(monkeypatch, fn.log, fail=True)
    run = K.launch.Launch(fn, (4, 2), (7,), dict(BLOCK=16, FLAG=False, num_warps=4))
    for t in ("a", "b", "c"):
        run(t, t)
    assert [e[0] for e in fn.log] == ["jit", "jit", "jit"]  # one refused try, then the JIT for good


def test_launch_takes_the_jit_while_a_launch_hook_is_set(monkeypatch, forced):
    """A profiler's launch hook sees every launch: while one is set, launches take Triton's path, which calls it."""
    monkeypatch.delenv("DEFORMCONV_FAST_LAUNCH", raising=False)
    fn = _FakeJit()
    _fake_direct(monkeypatch, fn.log)
    hooked = [False]
    monkeypatch.setattr(K.launch, "launch_hooks_set", lambda: hooked[0])
    run = K.launch.Launch(fn, (4,), (7,), dict(BLOCK=16, FLAG=True, num_warps=4))
    run("a", "b")
    hooked[0] = True
    run("c", "d")
    hooked[0] = False
    run("e", "f")
    assert [e[0] for e in fn.log] == ["jit", "jit", "direct"]


class _FakeLauncher:
    """Stands in for Triton's CudaLauncher: its C launch function and its call, both logged."""

    def __init__(self, log, scratch=0, with_launch=True, annotations=False):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        if with_launch:
            self.launch = lambda *a: log.append(("c", a))
        if annotations:
            self.arg_annotations, self.kernel_signature = "ann", b"sig"
        self.log = log

    def __call__(self, *a):
        self.log.append(("call", a))


class _Compiled:
    function, packed_metadata = 99, (4, 1, 0)

    def __init__(self, run):
        self.run = run


@pytest.mark.parametrize("version,form", [((3, 6), "3.6"), ((3, 8), "3.8"), ((3, 7), "call")])
def test_direct_launcher_passes_each_tritons_launcher_its_arguments(monkeypatch, version, form):
    """compat.direct_launcher hands the C launcher of Triton 3.6 and 3.8 their argument lists (checked against their
    sources: driver.py's format "iiiKKppOOOOOO" and driver.c's "iiiKKpp(iii)OOOOOOy*O"), any other Triton the
    launcher object's own call; the current device's current stream each launch."""
    from deformconv import compat

    log = []
    monkeypatch.setattr(compat, "triton_version", lambda: version)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device)
    launcher = _FakeLauncher(log, with_launch=form != "call", annotations=form == "3.8")
    go = compat.direct_launcher(_Compiled(launcher))
    go((5, 2, 1), "x", 7, 16)
    expected = {
        "3.6": ("c", (5, 2, 1, 1003, 99, False, True, None, None, (4, 1, 0), None, None, None, "x", 7, 16)),
        "3.8": ("c", (5, 2, 1, 1003, 99, False, True, (4, 1, 0), None, None, None, None, None, "ann", b"sig",
                      ("x", 7, 16))),
        "call": ("call", (5, 2, 1, 1003, 99, (4, 1, 0), None, None, None, "x", 7, 16)),
    }[form]
    assert log == [expected]


def test_direct_launcher_leaves_kernels_with_scratch_memory_to_triton(monkeypatch):
    from deformconv import compat

    assert compat.direct_launcher(_Compiled(_FakeLauncher([], scratch=128))) is None
    assert compat.direct_launcher(object()) is None  # not a compiled kernel (e.g. the interpreter's result)


def test_fast_launch_can_be_turned_off(monkeypatch, forced):
    monkeypatch.setenv("DEFORMCONV_FAST_LAUNCH", "0")
    fn = _FakeJit()
    run = K.launch.Launch(fn, (4,), (7,), dict(BLOCK=16, FLAG=True, num_warps=4))
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
    seg = K.geometry.segment_length(geo)
    assert K.geometry.grouped_input(geo, seg) == grouped
    if grouped:
        for kind in ("fwd", "bwd_data", "bwd_weight"):
            assert K.geometry.segments_per_chunk(geo, seg, 32, kind) > 1


BENCH_GEOS = {"det-s3": _geo(128, 128, h=100, w=152), "det-s4": _geo(), "det-s5": _geo(512, 512, h=25, w=38),
              "cls-14": _geo(n=64, h=14, w=14), "hires-g8": _geo(64, 64, og=8, n=16, h=128, w=128)}


def test_tma_launch_refusals(monkeypatch, forced):
    """tma_launch says no unless the config asks, the dtype is fp16, bf16 or fp32, chunks are whole, the device has
    TMA and every operand is addressable (16-byte aligned, rows of a multiple of 16 bytes, not empty)."""
    asks, plain = K.configs.Config(64, 256, 32, 8, tma=True), K.configs.Config(64, 256, 32, 8)
    w = torch.empty(3, 9, 32, 24, dtype=torch.float16)
    ok = [(w, 24)]
    assert K.launch.tma_launch(asks, torch.float16, True, ok)
    assert K.launch.tma_launch(asks, torch.bfloat16, True, ok)
    assert not K.launch.tma_launch(plain, torch.float16, True, ok)
    assert K.launch.tma_launch(asks, torch.float32, True, [(w.float(), 24)])
    assert not K.launch.tma_launch(asks, torch.float32, True, [(torch.empty(3, 9, 32, 6), 6)])  # 24-byte rows
    assert not K.launch.tma_launch(asks, torch.float64, True, ok)
    assert not K.launch.tma_launch(asks, torch.float16, False, ok)
    assert not K.launch.tma_launch(asks, torch.float16, True, [(torch.empty(3, 9, 32, 20, dtype=torch.float16), 20)])
    assert not K.launch.tma_launch(asks, torch.float16, True, [(torch.empty(8 * 24 + 1, dtype=torch.float16)[1:], 24)])
    assert not K.launch.tma_launch(asks, torch.float16, True, [(torch.empty(0, 24, dtype=torch.float16), 24)])
    monkeypatch.setattr(K.launch, "tma_supported", lambda device: False)
    assert not K.launch.tma_launch(asks, torch.float16, True, ok)


@pytest.mark.parametrize("capability,expected", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((8, 0), False)])
def test_tma_supported_from_hopper_on(capability, expected, monkeypatch, forced):
    """TMA descriptors from compute capability 9.0 (Hopper) on; on the CPU the interpreter emulates them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert K.launch.tma_supported(torch.device("cuda", 0)) == expected
    assert K.launch.tma_supported(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_codegen_profile_reaches_the_configs(dtype, forced):
    """compat.CodegenProfile is the one place a Triton version's spellings come from: grad_weight's narrow 16-bit
    tile takes the profile's pipeline stages (fp32's is unpipelined either way)."""
    from deformconv.compat import TRITON_3_6, TRITON_3_8, codegen_profile

    geo = _geo(128, 128, h=100, w=152)
    for profile in (TRITON_3_6, TRITON_3_8):
        forced(profile=profile)
        assert codegen_profile() is profile
        first = K.configs.bwd_weight_candidates(geo, K.geometry.segment_length(geo), dtype, torch.device("cpu"))[0]
        assert (first.block_m, first.block_n) == (64, 128)
        assert first.num_stages == (1 if dtype == torch.float32 else profile.narrow_weight_stages)


def test_forced_configs_replace_the_candidates(forced):
    """options.configs forces one config per kernel (a Config, or a function of the default); options.tma sets the
    default's TMA flag; without them the heuristic's list comes back."""
    import dataclasses

    geo, cpu = _geo(), torch.device("cpu")
    seg = K.geometry.segment_length(geo)
    default = K.configs.fwd_candidates(geo, seg, torch.float16, cpu)
    assert len(default) > 1
    forced(configs={"fwd": K.configs.Config(32, 32, 16, 4), "bwd_data": lambda c: dataclasses.replace(c, split=5)})
    assert K.configs.fwd_candidates(geo, seg, torch.float16, cpu) == [K.configs.Config(32, 32, 16, 4)]
    data = K.configs.bwd_data_candidates(geo, seg, torch.float16, cpu)
    assert len(data) == 1 and data[0].split == 5
    forced(configs={}, tma=True)
    assert [c.tma for c in K.configs.bwd_weight_candidates(geo, seg, torch.float16, cpu)] == [True]
