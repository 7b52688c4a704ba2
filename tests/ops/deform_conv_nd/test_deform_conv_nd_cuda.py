"""The N-d forms' Triton kernels on a CUDA GPU (skipped without one): output and gradients against the float64
reference by dtype, at a D3Dnet-like 3D layer, a 1D sequence layer and transposed layers of every rank; deterministic
mode reproducible bit for bit."""

import math

import pytest
import torch
from conftest import HAS_CUDA, assert_close

import deformconv
from deformconv.ops.deform_conv_nd import reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]
# name: (rank, transposed, N, Cin, Cout, size, kernel, stride, padding, dilation, output_padding, groups, offset groups)
CASES = {
    "d3dnet-like-3d": (3, False, 2, 32, 32, (5, 24, 24), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), (0, 0, 0), 1, 1),
    "3d-stride2-og2": (3, False, 1, 16, 24, (7, 9, 11), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 2, 1), (0, 0, 0), 2, 2),
    "1d-sequence": (1, False, 4, 64, 64, (301,), (5,), (1,), (2,), (1,), (0,), 1, 4),
    "transpose1d": (1, True, 3, 24, 16, (50,), (4,), (2,), (1,), (1,), (0,), 1, 1),
    "transpose2d": (2, True, 2, 32, 16, (13, 17), (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, 2),
    "transpose3d": (3, True, 1, 16, 8, (4, 6, 7), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 0, 1), 1, 1),
}


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    """fp32 at fp32's tolerance: TF32 off, as F.conv3d with cudnn.allow_tf32 = False (the kernels' products follow
    that flag)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _case(name, seed=0):
    rank, transposed, n, cin, cout, size, kernel, stride, padding, dilation, out_pad, groups, og = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    K = math.prod(kernel)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64) * scale

    if transposed:
        positions = list(size)
        weight = randn(cin, cout // groups, *kernel, scale=1 / math.sqrt(cin * K))
        fn = getattr(deformconv, f"deform_conv_transpose{rank}d")

        def call(*t, backend):
            return fn(t[0], t[1], t[2], t[3], stride, padding, out_pad, dilation, t[4], groups, backend=backend)
    else:
        positions = reference.out_size(size, kernel, stride, padding, dilation)
        weight = randn(cout, cin // groups, *kernel, scale=1 / math.sqrt(cin * K / groups))
        fn = getattr(deformconv, f"deform_conv{rank}d")

        def call(*t, backend):
            return fn(t[0], t[1], t[2], t[3], stride, padding, dilation, t[4], backend=backend)
    leaves = [randn(n, cin, *size), randn(n, og * K * rank, *positions, scale=2.0), weight, randn(cout),
              torch.rand(n, og * K, *positions, device="cuda", generator=gen, dtype=torch.float64)]
    return leaves, call


def _run(call, leaves, backend, dtype, gout):
    ts = [t.to(dtype).requires_grad_(True) for t in leaves]
    out = call(*ts, backend=backend)
    return (out, *torch.autograd.grad(out, ts, gout.to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_against_the_reference(name, dtype):
    leaves, call = _case(name)
    leaves = [t.to(dtype).to(torch.float64) for t in leaves]  # both sides read the same (rounded) inputs
    gout = torch.randn_like(call(*leaves, backend="reference"))
    ref = _run(call, leaves, "reference", torch.float64, gout)
    ours = _run(call, leaves, "triton", dtype, gout)
    for what, a, b in zip(("output", "input", "offset", "weight", "bias", "mask"), ours, ref):
        assert a.dtype == dtype and torch.isfinite(a).all(), what
        assert_close(a, b, dtype, what)


@pytest.mark.parametrize("name", ["3d-stride2-og2", "transpose2d"])
def test_deterministic_mode_is_reproducible(name):
    leaves, call = _case(name, seed=4)
    gout = torch.randn_like(call(*leaves, backend="reference")).float()
    torch.use_deterministic_algorithms(True)
    try:
        first = _run(call, leaves, "triton", torch.float32, gout)
        second = _run(call, leaves, "triton", torch.float32, gout)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_fp32_products_follow_cudnns_tf32_flag(monkeypatch):
    """With cudnn.allow_tf32 on (PyTorch's default) the fp32 forward's products take TF32 as F.conv3d's do: within
    TF32's error of float64 and not the full-fp32 result; torch's matmul flag is as it was after the call."""
    leaves, call = _case("d3dnet-like-3d")
    want = call(*leaves, backend="reference")
    ts = [t.float() for t in leaves]
    full = call(*ts, backend="triton").double()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    before = torch.backends.cuda.matmul.allow_tf32
    tf32 = call(*ts, backend="triton").double()
    assert torch.backends.cuda.matmul.allow_tf32 == before
    err = lambda got: ((got - want).norm() / want.norm()).item()  # noqa: E731
    assert err(full) < 1e-5 and 1e-5 < err(tf32) < 2e-3, (err(full), err(tf32))


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("name", ["d3dnet-like-3d", "transpose3d"])
def test_columns_in_runs_of_positions(name, deterministic, monkeypatch):
    """An image whose columns exceed the column budget goes in runs of its positions (64 each here):
    output and every gradient still equal the float64 reference, grad_input summed over the runs."""
    from deformconv.ops.common import columns_nd as kernels

    monkeypatch.setattr(kernels, "COLUMN_BUDGET", 8 * 27 * 64)
    leaves, call = _case(name, seed=5)
    gout = torch.randn_like(call(*leaves, backend="reference"))
    ref = _run(call, leaves, "reference", torch.float64, gout)
    torch.use_deterministic_algorithms(deterministic)
    try:
        ours = _run(call, leaves, "triton", torch.float32, gout)
    finally:
        torch.use_deterministic_algorithms(False)
    for what, a, b in zip(("output", "input", "offset", "weight", "bias", "mask"), ours, ref):
        assert torch.isfinite(a).all(), what
        assert_close(a, b, torch.float32, what)


def test_peak_memory_keeps_to_the_column_budget():
    """A 3D layer whose whole fp32 columns take 221 MB (32 channels × 27 taps × 40³ positions): its forward and
    backward allocate at most the budget's columns (64 MiB) and their gradient beside the tensors they return."""
    from deformconv.ops.common import columns_nd as kernels

    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(1, 32, 40, 40, 40, device="cuda", generator=gen, requires_grad=True)
    offset = (torch.randn(1, 81, 40, 40, 40, device="cuda", generator=gen) * 2).requires_grad_()
    mask = torch.rand(1, 27, 40, 40, 40, device="cuda", generator=gen).requires_grad_()
    weight = (torch.randn(32, 32, 3, 3, 3, device="cuda", generator=gen) / 30).requires_grad_()
    budget = kernels.COLUMN_BUDGET * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = deformconv.deform_conv3d(x, offset, weight, None, 1, 1, 1, mask, backend="triton")
    gout = torch.ones_like(out)
    grads = torch.autograd.grad(out, (x, offset, weight, mask), gout)
    returned = out.nbytes + gout.nbytes + sum(g.nbytes for g in grads)
    inputs = x.nbytes + offset.nbytes + mask.nbytes  # the kernels' channels-last and contiguous copies at most
    extra = torch.cuda.max_memory_allocated() - base - returned
    assert extra <= 2 * budget + inputs, (extra / 2**20, budget / 2**20, inputs / 2**20)
