"""Shared test set-up: Triton's interpreter on CPU-only machines, the tolerance table, input makers."""

import contextlib
import os
import types
from contextlib import contextmanager

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. This must be set before the kernels
# are first imported (deformconv imports them lazily, on the first Triton call).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
# Triton kernels on CPU tensors (the layout kernels forced onto the CPU) need the interpreter
requires_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                          reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


# The README's quick command (`-m "not full"`) leaves these out: the Triton kernels in Triton's CPU interpreter (tests
# whose name or parameters say triton, interpreter, kernels or planned calls, the kernel modules' own CPU tests under
# tests/ops/, the compile route's traced kernels), the kernels compiled to machine code, the property tests and the
# benchmark tools' tests.
FULL_FILES = ("test_kernels_compile.py", "test_properties.py", "test_properties_family.py", "test_bench_isolate.py",
              "test_bench_transformers.py", "test_planned_deform_conv2d.py", "test_compile_route.py")
FULL_WORDS = ("interpreter", "triton", "kernels", "planned", "half_error", "bench")


def _full_only(item) -> bool:
    callspec = getattr(item, "callspec", None)
    words = item.name if callspec is None else f"{item.originalname}[{callspec.id}]"
    return ("/tests/ops/" in item.path.as_posix() or item.path.name in FULL_FILES
            or any(word in words for word in FULL_WORDS))


def pytest_collection_modifyitems(config, items):
    """Tests skipped by requires_cuda carry the cuda marker too, as the GPU-only modules do (`-m cuda` selects them
    all); the whole suite's tests beyond the quick command's carry the full marker."""
    for item in items:
        if any(m.name == "skipif" and m.kwargs.get("reason") == requires_cuda.kwargs["reason"]
               for m in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)
        if _full_only(item):
            item.add_marker(pytest.mark.full)


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pytest-xdist, the README's test command): one a CPU core on a CPU-only machine, where
    Triton's interpreter makes the suite CPU-bound; none with a GPU, where the suite runs in one process as before."""
    return 0 if HAS_CUDA else (os.cpu_count() or 1)

# (atol, rtol) by dtype of the computation under test, against a float64 oracle. atol is relative to the
# largest |value| of the expected tensor (so it means the same for outputs and for every gradient).
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 1e-2),
    torch.bfloat16: (2e-2, 4e-2),
}


@contextmanager
def nan_filled_empty():
    """Inside the block torch.empty returns NaN-filled tensors: outputs allocated by the code under test are
    poisoned, so an element it never writes shows up."""
    real_empty = torch.empty
    torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
    try:
        yield
    finally:
        torch.empty = real_empty


def assert_close(actual, expected, dtype, what=""):
    """Compare against a float64 oracle with the dtype's tolerance; NaN never passes."""
    assert actual is not None and expected is not None, what
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    atol, rtol = TOL[dtype]
    exp = expected.detach().double().cpu()
    act = actual.detach().double().cpu()
    assert not torch.isnan(act).any(), f"{what}: NaN in result"
    scale = max(exp.abs().max().item(), 1e-30) if exp.numel() else 1.0
    torch.testing.assert_close(act, exp, atol=atol * scale, rtol=rtol, msg=lambda m: f"{what}: {m}")


# The Triton backend's fp16/bf16 error as a multiple of the least any result in that dtype can have: the exact
# (float64) result rounded to it. (mean ratio, max ratio) by result. Measured: the forward (corners blended in the
# input's dtype) 1.25-1.4x in mean, <= 1.8x in max, on the CPU (fp16) and the H200 (fp16, bf16); an fp32 blend
# gives 1.1x; an fp16 GEMM as torchvision's 4.5x (CPU) and 35-70x (H200). grad_weight (blended in fp32) 1.6x in
# mean on the CPU, 2.7x with a 16-bit blend.
HALF_ERROR_LIMITS = {"output": (1.6, 2.5), "grad_weight": (2.0, 2.5)}


def assert_near_rounding(actual, exact, dtype, what):
    """actual's error against the float64 `exact`, in mean and in max, within HALF_ERROR_LIMITS[what] times the
    error of exact rounded to dtype; NaN never passes."""
    mean_limit, max_limit = HALF_ERROR_LIMITS[what]
    actual, exact = actual.detach().double().cpu(), exact.detach().double().cpu()
    assert not torch.isnan(actual).any(), f"{what}: NaN in result"
    rounding = (exact.to(dtype).double() - exact).abs()
    err = (actual - exact).abs()
    mean_ratio, max_ratio = (err.mean() / rounding.mean()).item(), (err.max() / rounding.max()).item()
    assert mean_ratio <= mean_limit, f"{what}: mean error {mean_ratio:.2f}x the rounding's (limit {mean_limit})"
    assert max_ratio <= max_limit, f"{what}: max error {max_ratio:.2f}x the rounding's (limit {max_limit})"


def out_size(size, k, stride, pad, dil):
    return (size + 2 * pad - (dil * (k - 1) + 1)) // stride + 1


def make_case(n, cin, cout, h, w, kh, kw, groups=1, offset_groups=1, stride=1, padding=0, dilation=1,
              mask="random", dtype=torch.float64, device="cpu", seed=0, offset_scale=2.0, bias=True):
    """Fresh signed random inputs of one configuration: (args, kwargs) for deform_conv2d."""
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    ho, wo = out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)  # noqa: E731
    x = r(n, cin, h, w)
    offset = torch.randn(n, 2 * offset_groups * kh * kw, ho, wo, generator=g, dtype=torch.float64) * offset_scale
    # Sample points are whole numbers plus offsets. One within fp32's rounding of a whole number can land on the
    # other side of it in fp32 arithmetic (kernels, torchvision), and grad_offset jumps there (the bilinear weights'
    # slopes change at grid lines): seed 29 of og8-packed-segments had 24 + (-4.00000095) = 20.0 in fp32, its
    # grad_offset 0.46 off the float64 one. So random offsets keep 1e-4 away from whole numbers (zero offsets,
    # offset_scale=0, stay zero).
    if offset_scale:
        offset = torch.where((offset - offset.round()).abs() < 1e-4, offset + 2e-4, offset)
    offset = offset.to(dtype).to(device)
    weight = r(cout, cin // groups, kh, kw, scale=(cin // groups * kh * kw) ** -0.5)
    b = r(cout) if bias else None
    if mask == "random":
        m = torch.rand(n, offset_groups * kh * kw, ho, wo, generator=g, dtype=torch.float64).to(dtype).to(device)
    elif mask == "zero":
        m = torch.zeros(n, offset_groups * kh * kw, ho, wo, dtype=dtype, device=device)
    else:
        m = None
    return (x, offset, weight, b), dict(stride=(sh, sw), padding=(ph, pw), dilation=(dh, dw), mask=m)


@pytest.fixture
def forced():
    """forced(**changes): deformconv.config.options.override(**changes) until the test ends (caches emptied on the
    way in and out). Calls nest; each is undone in reverse order."""
    from deformconv.config import options

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(options.override(**changes))


@pytest.fixture
def implicit_gemm_for_groups(forced):
    """Grouped cases on the implicit GEMM's kernels (options.narrow_groups False), where narrow groups would otherwise
    take the column kernels (ops/deform_conv2d/triton/narrow_groups.py): for the tests of those kernels' routes."""
    forced(narrow_groups=False)


def kernel_modules():
    """The Triton backend's modules of deform_conv2d, by short name (imported here: tests that need them)."""
    import importlib

    names = ("configs", "geometry", "schedule", "packing", "forward", "backward", "backward_data", "backward_weight",
             "tiles", "columns")
    mods = {n: importlib.import_module(f"deformconv.ops.deform_conv2d.triton.{n}") for n in names}
    for n in ("launch", "layout", "sampling"):
        mods[n] = importlib.import_module(f"deformconv.ops.common.{n}")
    return types.SimpleNamespace(**mods)


def plans():
    """The launch plans made so far (forward and backward)."""
    from deformconv.config import options

    return list(options.cache("plans").values())


class CountingKernel:
    """A Triton kernel stand-in (monkeypatched over one in the module that launches it) that records each launch
    (its grid) in log and runs the kernel."""

    def __init__(self, kernel, log):
        self.kernel, self.log, self.arg_names = kernel, log, kernel.arg_names

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]


def launch_metas():
    """The meta-parameters (constexprs) of the planned launches, forward then grad_input then grad_weight kernel."""
    launches = [getattr(plan, kind) for plan in plans() for kind in ("launch", "data", "weight")
                if getattr(plan, kind, None) is not None]
    return [run.meta for run in launches]


# finish_grads cases: (conv groups, grad_weight's partials or None, grad_bias's partials or None, weight layout)
FINISH_CASES = [(1, 3, 5, "contiguous"), (2, 1, 7, "channels_last"), (3, 4, None, "channels_last"),
                (1, None, 2, "contiguous"), (2, 2, 75, "contiguous")]
FINISH_CASE_IDS = ["split3-bias5", "groups2-split1-bias7-channels-last", "groups3-split4-no-bias-channels-last",
                   "bias-only", "groups2-bias75-several-steps"]


def check_finish_grads(device, dtype, groups, split_w, split_b, layout, input_dtype=None):
    """finish_grads: grad_weight is its packed fp32 partials summed in index order, unpacked to the weight's layout
    (inverse of pack_weight) and cast: bitwise the sequential fp32 sum rounded to dtype. grad_bias is its partials'
    sum (32 rows a step: hundreds of partials where a transpose made them), cast: the float64 sum's within fp32
    rounding and dtype's, the same bits on a second call. Every element written (the outputs come from NaN-filled
    allocations). With an input_dtype other than dtype (a float32 weight used in a 16-bit dtype), both are those
    sums rounded to input_dtype, in dtype."""
    from deformconv.ops.deform_conv2d.triton import backward_weight as kernels

    cout, cin_g, kh, kw = 6 * groups, 5, 3, 2
    g = torch.Generator().manual_seed(groups * 100 + (split_w or 0) * 10 + (split_b or 0))
    weight = torch.randn(cout, cin_g, kh, kw, generator=g).to(device, dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    weight = weight.contiguous(memory_format=fmt)
    pw = None if split_w is None else torch.randn(split_w, groups, kh * kw, cin_g, cout // groups,
                                                  generator=g).to(device)
    pb = None if split_b is None else torch.randn(split_b, cout, generator=g).to(device)
    with nan_filled_empty():
        gw, gb = kernels.finish_grads(weight, pw, pb)

    def in_order(parts):
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    if pw is None:
        assert gw is None
    else:
        packed = in_order(pw)  # [groups, kh*kw, Cin_g, Cout_g]
        want = packed.permute(0, 3, 2, 1).reshape(cout, cin_g, kh, kw).to(dtype)
        assert gw.dtype == dtype and gw.is_contiguous(memory_format=fmt)
        torch.testing.assert_close(gw, want, atol=0, rtol=0)
    if pb is None:
        assert gb is None
    else:
        assert gb.dtype == dtype and not torch.isnan(gb).any()
        # rounding to dtype (eps relative), plus the fp32 sum's own error (|partials| < 6 here: 1e-6 a term)
        torch.testing.assert_close(gb.double(), pb.double().sum(0), atol=1e-6 * split_b, rtol=torch.finfo(dtype).eps)
        assert torch.equal(kernels.finish_grads(weight, pw, pb)[1], gb)
    if input_dtype is not None and input_dtype != dtype:
        with nan_filled_empty():
            rw, rb = kernels.finish_grads(weight, pw, pb, input_dtype)
        for r, plain in ((rw, gw), (rb, gb)):
            if plain is not None:
                assert r.dtype == dtype and torch.equal(r, plain.to(input_dtype).to(dtype))
                assert not torch.equal(r, plain)  # the rounding happened (fp32 sums of randn: not all 16-bit values)
