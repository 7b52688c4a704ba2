"""Bad input gets a clear exception naming the argument, what was expected and what came, before any
kernel runs: one pytest.raises(match=...) per check."""

import pytest
import torch

import deformconv


def _good():
    x = torch.randn(2, 4, 7, 8)
    offset = torch.randn(2, 18, 7, 8)
    weight = torch.randn(6, 4, 3, 3)
    bias = torch.randn(6)
    mask = torch.rand(2, 9, 7, 8)
    return dict(input=x, offset=offset, weight=weight, bias=bias, padding=1, mask=mask)


def _call(**changes):
    kw = _good()
    kw.update(changes)
    return deformconv.deform_conv2d(**kw)


def test_good_call_runs():
    assert _call().shape == (2, 6, 7, 8)


CASES = {
    "input-ndim": (dict(input=torch.randn(4, 7, 8)), ValueError,
        r"input must be a 4-D tensor \[N, Cin, H, W\], got 3-D"),
    "offset-ndim": (dict(offset=torch.randn(2, 18, 56)), ValueError, r"offset must be a 4-D tensor .* got 3-D"),
    "weight-ndim": (dict(weight=torch.randn(6, 4, 9)), ValueError, r"weight must be a 4-D tensor .* got 3-D"),
    "mask-ndim": (dict(mask=torch.rand(2, 9, 56)), ValueError, r"mask must be a 4-D tensor .* got 3-D"),
    "bias-ndim": (dict(bias=torch.randn(6, 1)), ValueError, r"bias must be a 1-D tensor \[Cout\], got 2-D"),
    "offset-channels": (dict(offset=torch.randn(2, 17, 7, 8)), ValueError,
        r"offset.shape\[1\] must be 2\*offset_groups\*kh\*kw .*multiple of 18\), got 17"),
    "mask-channels": (dict(mask=torch.rand(2, 8, 7, 8)), ValueError,
        r"mask.shape\[1\] must be offset_groups\*kh\*kw = 9, got 8"),
    "offset-spatial": (dict(offset=torch.randn(2, 18, 7, 7)), ValueError,
        r"offset spatial size must be the output size \(7, 8\), got \(7, 7\)"),
    "mask-spatial": (dict(mask=torch.rand(2, 9, 6, 8)), ValueError,
        r"mask spatial size must be the output size \(7, 8\), got \(6, 8\)"),
    "offset-batch": (dict(offset=torch.randn(3, 18, 7, 8)), ValueError,
        r"offset batch size must equal input's \(2\), got 3"),
    "mask-batch": (dict(mask=torch.rand(1, 9, 7, 8)), ValueError, r"mask batch size must equal input's \(2\), got 1"),
    "cin-not-divisible-by-weight": (dict(weight=torch.randn(6, 3, 3, 3)), ValueError,
        r"input channels \(4\) must be divisible by weight.shape\[1\] \(Cin/groups = 3\)"),
    "cout-not-divisible-by-groups": (dict(weight=torch.randn(5, 2, 3, 3), bias=torch.randn(5)), ValueError,
        r"weight.shape\[0\] \(Cout = 5\) must be a positive multiple of groups \(2\)"),
    "cin-not-divisible-by-offset-groups": (
        dict(input=torch.randn(2, 4, 7, 8), offset=torch.randn(2, 54, 7, 8), mask=torch.rand(2, 27, 7, 8)), ValueError,
        r"input channels \(4\) must be divisible by offset groups \(3\)"),
    "bias-size": (dict(bias=torch.randn(5)), ValueError, r"bias must have Cout = 6 elements, got 5"),
    "stride-zero": (dict(stride=0), ValueError, r"stride must be positive, got \(0, 0\)"),
    "stride-negative": (dict(stride=(1, -2)), ValueError, r"stride must be positive, got \(1, -2\)"),
    "dilation-zero": (dict(dilation=(0, 1)), ValueError, r"dilation must be positive, got \(0, 1\)"),
    "padding-negative": (dict(padding=-1), ValueError, r"padding must be non-negative, got \(-1, -1\)"),
    "stride-type": (dict(stride=1.5), TypeError, r"stride must be an int or a pair of ints, got float 1.5"),
    "stride-bool": (dict(stride=True), TypeError, r"stride must be an int or a pair of ints, got bool True"),
    "dilation-bool-in-pair": (dict(dilation=(1, True)), TypeError,
        r"dilation must be an int or a pair of ints, got \(1, True\)"),
    "padding-triple": (dict(padding=(1, 1, 1)), TypeError,
        r"padding must be an int or a pair of ints, got \(1, 1, 1\)"),
    "output-size": (dict(input=torch.randn(2, 4, 2, 2), padding=0), ValueError,
        r"computed output size \(0, 0\) is not positive"),
    "device-mismatch": (dict(offset=torch.randn(2, 18, 7, 8, device="meta")), ValueError,
        r"offset must be on the same device as input \(cpu\), got meta"),
    "mixed-dtypes": (dict(weight=torch.randn(6, 4, 3, 3, dtype=torch.float64)), TypeError,
        r"weight must have the same dtype as input \(torch.float32\), got torch.float64"),
    "integer-input": (dict(input=torch.ones(2, 4, 7, 8, dtype=torch.int64)), TypeError,
        r"input must be a floating-point tensor, got dtype torch.int64"),
    "complex-offset": (dict(offset=torch.randn(2, 18, 7, 8, dtype=torch.complex64)), TypeError,
        r"offset must be a floating-point tensor, got dtype torch.complex64"),
    "not-a-tensor": (dict(weight=[[1.0]]), TypeError, r"weight must be a Tensor, got list"),
    "unknown-backend": (dict(backend="cuda-magic"), ValueError,
        r"backend must be one of \['triton', 'cpu', 'reference'\] .*got 'cuda-magic'"),
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-a-good-call"])
@pytest.mark.parametrize("changes,exc,match", list(CASES.values()), ids=list(CASES))
def test_bad_argument_raises(changes, exc, match, warm):
    """Also right after a good call of the same shapes, whose signature the checks remember (checks._VALID): a
    remembered signature never lets a bad argument through (stride True hashes as 1, for one)."""
    if warm:
        _call()
    with pytest.raises(exc, match=match):
        _call(**changes)


def test_a_repeated_signature_skips_the_checks(monkeypatch):
    """A good call's signature (shapes, dtypes, devices, integer arguments) is remembered with its geometry: the same
    signature again returns it without checking; the memory stays bounded."""
    from deformconv import checks

    monkeypatch.setattr(checks, "_VALID", {})
    monkeypatch.setattr(checks, "_MAX_VALID", 3)
    kw = _good()
    args = (kw["input"], kw["offset"], kw["weight"], kw["bias"], 1, 1, 1, kw["mask"])
    geo = checks.check_deform_conv2d_args(*args)
    calls = []
    monkeypatch.setattr(checks, "_check_args", lambda *a: calls.append(a))
    assert checks.check_deform_conv2d_args(*args) is geo and calls == []
    checks.check_deform_conv2d_args(*args[:5], (1, 1), [1, 1], args[7])  # the same pairs spelled otherwise
    assert calls == []
    checks.check_deform_conv2d_args(*args[:4], 2, *args[5:])  # another stride: checked
    assert len(calls) == 1
    monkeypatch.undo()
    monkeypatch.setattr(checks, "_MAX_VALID", 3)
    for n in range(1, 6):  # five signatures: batches of 1 to 5
        geo = checks.check_deform_conv2d_args(torch.randn(n, 4, 7, 8), torch.randn(n, 18, 7, 8), *args[2:7],
                                               torch.rand(n, 9, 7, 8))
        assert geo.batch == n and len(checks._VALID) <= 3


def test_check_once_checks_each_new_signature_and_remembers_only_passes(monkeypatch):
    """The other ops' shared cache (checks.check_once): a signature that passed is not checked again; one that raised
    is checked every time (it raises again); other shapes, dtypes, an op of another name and non-tensors are checked;
    the memory stays bounded."""
    from deformconv import checks

    monkeypatch.setattr(checks, "_PASSED", {})
    monkeypatch.setattr(checks, "_MAX_VALID", 3)
    calls = []

    def check(fail=False):
        calls.append(1)
        if fail:
            raise ValueError("bad")

    a, b = torch.randn(2, 3), torch.randn(4)
    for _ in range(3):
        checks.check_once("op", (a, b), check)
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            checks.check_once("op", (torch.randn(5), b), lambda: check(fail=True))
    assert len(calls) == 3
    checks.check_once("op", (a.double(), b), check)
    checks.check_once("other op", (a, b), check)
    checks.check_once("op", (a, 3), check)
    checks.check_once("op", (a, 3), check)  # not a tensor: never remembered
    assert len(calls) == 7 and len(checks._PASSED) <= 3


def test_ms_deform_attn_checks_after_a_good_call():
    """A remembered good signature lets no bad attention call through: wrong shapes still raise, naming the argument."""
    shapes, starts = torch.tensor([[4, 5]]), torch.tensor([0])
    value, loc, attn = torch.randn(1, 20, 2, 3), torch.rand(1, 6, 2, 1, 2, 2), torch.rand(1, 6, 2, 1, 2)
    deformconv.ms_deform_attn(value, shapes, starts, loc, attn)
    with pytest.raises(ValueError, match="attention_weights"):
        deformconv.ms_deform_attn(value, shapes, starts, loc, attn[..., :1])
    with pytest.raises(ValueError, match="covers|cover"):
        deformconv.ms_deform_attn(value, torch.tensor([[4, 4]]), starts, loc, attn)


def test_dcnv_checks_after_a_good_call():
    """DCNv3/DCNv4 remember a good call's geometry by its tensors and plain arguments, each with its type: True in
    place of 1, a wrong offset shape or a string offset_scale still raise after the same call passed."""
    x = torch.randn(1, 5, 6, 2 * 3)
    offset, mask = torch.randn(1, 5, 6, 2 * 9 * 2), torch.rand(1, 5, 6, 2 * 9)
    args = [3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, False]
    deformconv.dcnv3(x, offset, mask, *args)
    with pytest.raises(TypeError, match="stride_h"):
        deformconv.dcnv3(x, offset, mask, *args[:2], True, *args[3:])
    with pytest.raises(ValueError, match="offset must have shape"):
        deformconv.dcnv3(x, offset[..., :-2], mask, *args)
    with pytest.raises(TypeError, match="offset_scale"):
        deformconv.dcnv3(x, offset, mask, *args[:-2], "1.0", False)
    om = torch.randn(1, 5, 6, 56)
    deformconv.dcnv4(x, om, *args)
    with pytest.raises(ValueError, match="offset_mask"):
        deformconv.dcnv4(x, om[..., :50], *args)


def test_forced_backend_that_cannot_run_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kw = _good()
    x64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with pytest.raises(RuntimeError, match=r"backend='triton' cannot run on device cpu with dtype torch.float64: "
                                           r".*float64 has no tensor-core path"):
        deformconv.deform_conv2d(**x64, backend="triton")


def test_environment_variable_selects_backend(monkeypatch):
    monkeypatch.setenv("DEFORMCONV_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"DEFORMCONV_BACKEND must be one of \['auto', 'cpu', 'reference', 'triton'\] "
                                         r"\(or unset\), got 'nope'"):
        _call()
    for name in ("reference", "cpu"):
        monkeypatch.setenv("DEFORMCONV_BACKEND", name)
        assert deformconv.select_backend(torch.device("cpu"), torch.float32) == name
    monkeypatch.setenv("DEFORMCONV_BACKEND", "auto")
    assert deformconv.select_backend(torch.device("cpu"), torch.float32) == "cpu"


def test_reasons_are_listed_per_backend():
    reasons = deformconv.not_supported_reasons(torch.device("cpu"), torch.float64)
    assert reasons["reference"] == [] and reasons["cpu"] == []
    assert any("float64" in r for r in reasons["triton"])
    assert deformconv.not_supported_reasons(torch.device("cuda"), torch.float32)["cpu"] == ["runs on CPU tensors only"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_cpu_tensors_go_to_the_cpu_backend(dtype, monkeypatch):
    monkeypatch.delenv("DEFORMCONV_BACKEND", raising=False)
    assert deformconv.select_backend(torch.device("cpu"), dtype) == "cpu"


def test_triton_refuses_bfloat16_under_the_interpreter(monkeypatch):
    """The interpreter's bfloat16 tl.dot multiplies the raw bits (triton-lang/triton#11584): forcing the Triton
    backend on bfloat16 CPU tensors raises, naming why, instead of returning garbage; float16 still runs."""
    from deformconv.ops.common import dispatch as backends

    monkeypatch.setattr(backends, "triton_interpret_mode", lambda: True)
    monkeypatch.delenv("DEFORMCONV_BACKEND", raising=False)
    reasons = deformconv.not_supported_reasons(torch.device("cpu"), torch.bfloat16)["triton"]
    assert any("bfloat16" in r and "interpreter" in r for r in reasons)
    assert deformconv.not_supported_reasons(torch.device("cpu"), torch.float16)["triton"] == []
    x, offset, weight = torch.randn(1, 4, 5, 5), torch.randn(1, 18, 5, 5), torch.randn(4, 4, 3, 3)
    with pytest.raises(RuntimeError, match=r"backend='triton'.*bfloat16.*interpreter"):
        deformconv.deform_conv2d(x.bfloat16(), offset.bfloat16(), weight.bfloat16(), padding=1, backend="triton")
    assert deformconv.select_backend(torch.device("cpu"), torch.bfloat16) == "cpu"


@pytest.mark.parametrize("capability,dtype,expected", [
    ((9, 0), torch.bfloat16, "triton"),
    ((9, 0), torch.float32, "triton"),
    ((7, 5), torch.float16, "triton"),
    ((7, 5), torch.bfloat16, "reference"),
    ((9, 0), torch.float64, "reference"),
], ids=["h100-bf16", "h100-fp32", "t4-fp16", "t4-bf16", "h100-fp64"])
def test_cuda_selection_by_capability(monkeypatch, capability, dtype, expected):
    """The CUDA branch of the dispatch, with the GPU faked: Triton where it can run, else the reference."""
    from deformconv.ops.common import dispatch as backends

    monkeypatch.delenv("DEFORMCONV_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "FakeGPU")
    backends._cuda_capability.cache_clear()
    try:
        assert deformconv.select_backend(torch.device("cuda"), dtype) == expected
        assert deformconv.select_backend(torch.device("cuda", 0), dtype) == expected
        if expected == "reference" and dtype == torch.bfloat16:
            reasons = deformconv.not_supported_reasons(torch.device("cuda"), dtype)["triton"]
            assert reasons == ["bfloat16 needs compute capability >= 8.0, FakeGPU has less"]
    finally:
        backends._cuda_capability.cache_clear()


def test_triton_launches_on_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device; the backend switches to the input's (faked GPUs)."""
    from types import SimpleNamespace

    from deformconv.ops.common.launch import on_device_of

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or __import__("contextlib").nullcontext())
    on_device_of(SimpleNamespace(is_cuda=True, get_device=lambda: 1))
    on_device_of(SimpleNamespace(is_cuda=True, get_device=lambda: 0))
    on_device_of(SimpleNamespace(is_cuda=False, get_device=lambda: -1))
    assert entered == [1]


# Module constructors: a bad setting raises at construction, naming it, as the functions' checks do (not later, in
# forward, from deep inside torch). (class, good keyword arguments, the bad one, exception, message)
_PACK = dict(in_channels=4, out_channels=6, kernel_size=3)
_POOL = dict(output_size=3, output_channels=4, deform_fc_channels=8)
_PS = dict(spatial_scale=0.5, pooled_size=3, output_dim=4, no_trans=True)
MODULE_CASES = [
    ("DeformConv2d", _PACK, dict(stride=-1), ValueError, r"stride must be positive, got \(-1, -1\)"),
    ("DeformConv2dPack", _PACK, dict(padding=(1, -2)), ValueError, r"padding must be non-negative, got \(1, -2\)"),
    ("ModulatedDeformConv2dPack", _PACK, dict(stride=-1), ValueError, r"stride must be positive"),
    ("ModulatedDeformConv2dPack", _PACK, dict(dilation=0), ValueError, r"dilation must be positive"),
    ("ModulatedDeformConv2dPack", _PACK, dict(kernel_size=0), ValueError, r"kernel_size must be positive"),
    ("ModulatedDeformConv2dPack", _PACK, dict(groups=0), ValueError, r"groups must be an int >= 1, got 0"),
    ("ModulatedDeformConv2dPack", _PACK, dict(in_channels=4.0), TypeError, r"in_channels must be an int >= 1"),
    ("DeformConv2dPack", _PACK, dict(offset_groups=-2), ValueError, r"offset_groups must be an int >= 1, got -2"),
    ("DCNv3", dict(channels=16, group=2), dict(stride=0), ValueError, r"stride must be an int >= 1, got 0"),
    ("DCNv3", dict(channels=16, group=2), dict(pad=-1), ValueError, r"pad must be an int >= 0, got -1"),
    ("DCNv3", dict(channels=16, group=2), dict(dilation=0), ValueError, r"dilation must be an int >= 1"),
    ("DCNv3", dict(channels=16, group=2), dict(group=0), ValueError, r"group must be an int >= 1, got 0"),
    ("DCNv3", dict(channels=16, group=2), dict(dw_kernel_size=0), ValueError, r"dw_kernel_size must be an int >= 1"),
    ("DCNv4", dict(channels=16, group=2), dict(kernel_size=0), ValueError, r"kernel_size must be an int >= 1"),
    ("DCNv4", dict(channels=16, group=2), dict(offset_scale="1"), TypeError, r"offset_scale must be a number"),
    ("DCNv4", dict(channels=16, group=2), dict(stride=-1), ValueError, r"stride must be an int >= 1, got -1"),
    ("MultiScaleDeformableAttention", dict(embed_dims=32, num_heads=4), dict(num_points=0), ValueError,
     r"num_points must be an int >= 1, got 0"),
    ("MultiScaleDeformableAttention", dict(embed_dims=32, num_heads=4), dict(num_heads=0), ValueError,
     r"num_heads must be an int >= 1, got 0"),
    ("MultiScaleDeformableAttention", dict(embed_dims=32, num_heads=4), dict(dropout=1.5), ValueError,
     r"dropout must be a probability in \[0, 1\], got 1.5"),
    ("MultiScaleDeformableAttention", dict(embed_dims=32, num_heads=4), dict(value_proj_ratio=0.01), ValueError,
     r"embed_dims \* value_proj_ratio \(0\) must be divisible by num_heads"),
    ("MSDeformAttn", dict(d_model=32, n_heads=4), dict(n_levels=0), ValueError, r"n_levels must be an int >= 1, got 0"),
    ("MSDeformAttn", dict(d_model=32, n_heads=4), dict(n_heads=0), ValueError, r"n_heads must be an int >= 1, got 0"),
    ("DeformRoIPool", dict(output_size=3), dict(output_size=(3, 0)), ValueError, r"output_size must be positive"),
    ("DeformRoIPool", dict(output_size=3), dict(sampling_ratio=-1), ValueError, r"sampling_ratio must be an int >= 0"),
    ("DeformRoIPool", dict(output_size=3), dict(spatial_scale=0.0), ValueError,
     r"spatial_scale must be a finite positive number, got 0.0"),
    ("DeformRoIPoolPack", _POOL, dict(output_channels=0), ValueError, r"output_channels must be an int >= 1"),
    ("ModulatedDeformRoIPoolPack", _POOL, dict(deform_fc_channels=0), ValueError,
     r"deform_fc_channels must be an int >= 1, got 0"),
    ("DeformPSRoIPooling", _PS, dict(group_size=0), ValueError, r"group_size must be an int >= 1, got 0"),
    ("DeformPSRoIPooling", _PS, dict(sample_per_part=0), ValueError, r"sample_per_part must be an int >= 1"),
    ("DeformPSRoIPooling", _PS, dict(trans_std=float("nan")), ValueError, r"trans_std must be a finite number"),
]


@pytest.mark.parametrize("name, good, bad, exc, match", MODULE_CASES,
                         ids=[f"{c[0]}-{next(iter(c[2]))}" for c in MODULE_CASES])
def test_module_constructors_check_their_arguments(name, good, bad, exc, match):
    cls = getattr(deformconv, name)
    cls(**good)  # the good settings build
    with pytest.raises(exc, match=match):
        cls(**{**good, **bad})


def _op_calls():
    """One call of each op on small CPU inputs, by name."""
    x, offset, mask = torch.randn(1, 5, 6, 12), torch.randn(1, 5, 6, 54), torch.rand(1, 5, 6, 27)
    value, loc, attn = torch.randn(1, 30, 2, 4), torch.rand(1, 3, 2, 1, 2, 2), torch.rand(1, 3, 2, 1, 2)
    feat, rois = torch.randn(1, 18, 10, 10), torch.tensor([[0, 1.0, 2.0, 9.0, 11.0]])
    return {
        "dcnv3": lambda: deformconv.dcnv3(x, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0),
        "dcnv4": lambda: deformconv.dcnv4(x, torch.randn(1, 5, 6, 88), 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0),
        "ms_deform_attn": lambda: deformconv.ms_deform_attn(value, torch.tensor([[5, 6]]), torch.tensor([0]), loc,
                                                            attn),
        "deform_roi_pool": lambda: deformconv.deform_roi_pool(feat, rois, None, 3, 0.5),
        "deform_psroi_pool": lambda: deformconv.deform_psroi_pool(feat, rois, None, 0.5, 3, 2, True, group_size=3),
    }


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4", "ms_deform_attn", "deform_roi_pool", "deform_psroi_pool"])
def test_environment_variable_selects_every_ops_backend(op, monkeypatch):
    """DEFORMCONV_BACKEND forces the backend of every op, as it does deform_conv2d's: the implementation that runs is
    the one named (RoI pooling, which has no cpu backend, takes cpu as its reference: its CPU path); a bad value and
    a backend that cannot run raise naming the variable."""
    from deformconv.ops.common import dispatch

    real, ran = dispatch.implementation, []

    def spy(called, *args):
        impl = real(called, *args)
        if called == op:
            ran.append(impl.__name__.split(".")[-1])
        return impl

    monkeypatch.setattr(dispatch, "implementation", spy)
    call = _op_calls()[op]
    roi = op.startswith("deform_")
    for forced, expected in (("reference", "reference"), ("cpu", "reference" if roi else "cpu"),
                             (None, "reference" if roi else "cpu")):
        if forced is None:
            monkeypatch.delenv("DEFORMCONV_BACKEND", raising=False)
        else:
            monkeypatch.setenv("DEFORMCONV_BACKEND", forced)
        ran.clear()
        call()
        assert ran and set(ran) == {expected}, (forced, ran)
    monkeypatch.setenv("DEFORMCONV_BACKEND", "nope")
    with pytest.raises(ValueError, match="DEFORMCONV_BACKEND must be one of"):
        call()
    monkeypatch.setenv("DEFORMCONV_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(deformconv.ops.common.dispatch, "triton_interpret_mode", lambda: False)
    with pytest.raises(RuntimeError, match="DEFORMCONV_BACKEND='triton' cannot run on device cpu"):
        call()
