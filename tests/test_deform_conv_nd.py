"""The N-d forms (deform_conv1d/3d, deform_conv_transpose1d/2d/3d): against naive float64 loops (_naive_dcn_nd.py),
outputs and every gradient; gradcheck; with zero offsets and a mask of ones the dense F.conv*/conv_transpose*;
rank 2 through the N-d path equals deform_conv2d; the ops' registrations (opcheck), bad input, empty batches, the
modules' keys and the Packs at initialisation."""

import math

import pytest
import torch
import torch.nn.functional as F
from _naive_dcn_nd import naive_deform_conv, naive_deform_conv_transpose
from conftest import assert_close, requires_interpreter

import deformconv
from deformconv.ops.deform_conv_nd import reference

# name: (rank, transposed, input size, kernel, stride, padding, dilation, output_padding, groups, offset groups)
CASES = {
    "conv1d-s2-d2-g2-og2": (1, False, (11,), (3,), (2,), (1,), (2,), (0,), 2, 2),
    "conv1d-k4": (1, False, (9,), (4,), (1,), (2,), (1,), (0,), 1, 1),
    "conv3d-mixed": (3, False, (4, 5, 3), (3, 2, 2), (1, 2, 1), (1, 0, 1), (1, 1, 2), (0, 0, 0), 1, 1),
    "conv3d-g2-og2": (3, False, (3, 4, 4), (2, 2, 2), (1, 1, 1), (0, 1, 0), (1, 1, 1), (0, 0, 0), 2, 2),
    "transpose1d-s2-op1": (1, True, (5,), (3,), (2,), (1,), (1,), (1,), 1, 1),
    "transpose1d-g2-og2": (1, True, (6,), (2,), (3,), (0,), (2,), (2,), 2, 2),
    "transpose1d-output-padding-past-stride": (1, True, (5,), (3,), (1,), (1,), (2,), (1,), 1, 1),
    "transpose2d-s2": (2, True, (3, 4), (3, 2), (2, 1), (1, 0), (1, 2), (1, 0), 1, 1),
    "transpose3d-g2": (3, True, (2, 3, 2), (2, 2, 3), (2, 1, 1), (0, 1, 1), (1, 1, 1), (1, 0, 0), 2, 1),
}
FUNCTIONS = {(1, False): deformconv.deform_conv1d, (3, False): deformconv.deform_conv3d,
             (1, True): deformconv.deform_conv_transpose1d, (2, True): deformconv.deform_conv_transpose2d,
             (3, True): deformconv.deform_conv_transpose3d}


def _case(name, dtype=torch.float64, n=2, seed=0, masked=True, scale=1.5):
    """(leaves [input, offset, weight, bias, mask], call(input, offset, weight, bias, mask, backend=None), naive)."""
    rank, transposed, size, kernel, stride, padding, dilation, out_pad, groups, og = CASES[name]
    g = torch.Generator().manual_seed(seed)
    cin, cout = 2 * groups, 3 * groups if not transposed else 2 * groups
    K = math.prod(kernel)
    if transposed:
        positions = list(size)
        weight = torch.randn(cin, cout // groups, *kernel, generator=g, dtype=dtype)
    else:
        positions = reference.out_size(size, kernel, stride, padding, dilation)
        weight = torch.randn(cout, cin // groups, *kernel, generator=g, dtype=dtype)
    x = torch.randn(n, cin, *size, generator=g, dtype=dtype)
    offset = torch.randn(n, og * K * rank, *positions, generator=g, dtype=dtype) * scale
    mask = torch.rand(n, og * K, *positions, generator=g, dtype=dtype) if masked else None
    bias = torch.randn(cout, generator=g, dtype=dtype)
    fn = FUNCTIONS[(rank, transposed)]

    if transposed:
        def call(x, offset, weight, bias, mask, backend=None):
            return fn(x, offset, weight, bias, stride, padding, out_pad, dilation, mask, groups, backend=backend)

        def naive(x, offset, weight, bias, mask):
            return naive_deform_conv_transpose(x, offset, weight, bias, mask, stride, padding, out_pad, dilation,
                                               groups)
    else:
        def call(x, offset, weight, bias, mask, backend=None):
            return fn(x, offset, weight, bias, stride, padding, dilation, mask, backend=backend)

        def naive(x, offset, weight, bias, mask):
            return naive_deform_conv(x, offset, weight, bias, mask, stride, padding, dilation)
    return [x, offset, weight, bias, mask], call, naive


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("name", list(CASES))
def test_against_naive_loops(name, masked):
    """The output and the gradients of input, offset, weight, bias and mask equal the naive loops' (autograd
    through them), float64."""
    leaves, call, naive = _case(name, masked=masked, n=1 if "3d" in name else 2)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in leaves]
    ours, ref = call(*leaves), naive(*leaves)
    assert ours.shape == ref.shape and torch.isfinite(ours).all()
    assert_close(ours, ref, torch.float64, "output")
    gout = torch.randn_like(ref)
    wanted = [t for t in leaves if t is not None]
    for what, a, b in zip(("input", "offset", "weight", "bias", "mask"), torch.autograd.grad(ours, wanted, gout),
                          torch.autograd.grad(ref, wanted, gout)):
        assert torch.isfinite(a).all(), what
        assert_close(a, b, torch.float64, what)


@pytest.mark.parametrize("name", ["conv1d-s2-d2-g2-og2", pytest.param("conv3d-g2-og2", marks=pytest.mark.full),
                                  "transpose1d-g2-og2", "transpose2d-s2"])
def test_gradcheck(name):
    """gradcheck at every rank (3D in the whole suite: 10 s; the quick command has its naive-loop gradients)."""
    leaves, call, _ = _case(name, n=1, scale=0.7)
    leaves = [t.requires_grad_(True) for t in leaves]
    assert torch.autograd.gradcheck(lambda *a: call(*a), leaves, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_zero_offsets_and_a_mask_of_ones_are_the_dense_op(name):
    rank, transposed, size, kernel, stride, padding, dilation, out_pad, groups, og = CASES[name]
    (x, offset, weight, bias, mask), call, _ = _case(name)
    ours = call(x, torch.zeros_like(offset), weight, bias, torch.ones_like(mask))
    if transposed:
        dense = getattr(F, f"conv_transpose{rank}d")(x, weight, bias, stride, padding, out_pad, groups, dilation)
    else:
        dense = getattr(F, f"conv{rank}d")(x, weight, bias, stride, padding, dilation, groups)
    assert_close(ours, dense, torch.float64, "output")


def test_rank_2_through_the_nd_path_is_deform_conv2d():
    """The N-d reference at rank 2 gives deform_conv2d's output and gradients (its own backends' oracle)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 7, 9, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 3, 3, 2, generator=g, dtype=torch.float64)
    offset = torch.randn(2, 2 * 2 * 6, 4, 9, generator=g, dtype=torch.float64) * 2
    mask = torch.rand(2, 2 * 6, 4, 9, generator=g, dtype=torch.float64)
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_(True) for t in (x, offset, weight, bias, mask)]
    nd = reference.deform_conv(*leaves, [2, 1], [1, 1], [1, 2])
    two = deformconv.deform_conv2d(x, offset, weight, bias, (2, 1), (1, 1), (1, 2), mask)
    assert_close(nd, two, torch.float64, "output")
    gout = torch.randn_like(two)
    for what, a, b in zip(("input", "offset", "weight", "bias", "mask"), torch.autograd.grad(nd, leaves, gout),
                          torch.autograd.grad(two, leaves, gout)):
        assert_close(a, b, torch.float64, what)


@pytest.mark.parametrize("name", ["transpose1d-s2-op1", "transpose2d-s2", "transpose3d-g2"])
def test_transposed_form_is_the_adjoint(name):
    """<deform_conv(z), u> = <z, deform_conv_transpose(u)> with the same offsets, mask and weight."""
    rank, _, size, kernel, stride, padding, dilation, out_pad, groups, _ = CASES[name]
    (u, offset, weight, _, mask), call, _ = _case(name)
    t = call(u, offset, weight, None, mask)
    z = torch.randn_like(t)
    y = reference.deform_conv(z, offset, weight, None, mask, stride, padding, dilation)
    assert y.shape == u.shape
    torch.testing.assert_close((y * u).sum(), (z * t).sum(), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precision_against_float64(dtype):
    leaves, call, _ = _case("conv3d-mixed", n=1)
    ours = call(*[t.to(dtype) for t in leaves])
    assert ours.dtype == dtype
    assert_close(ours, call(*leaves), dtype, "output")


def test_autocast_runs_in_the_autocast_dtype():
    leaves, call, _ = _case("transpose1d-s2-op1", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(*leaves)
    assert out.dtype == torch.bfloat16
    assert_close(out, call(*leaves), torch.bfloat16, "output")


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_ops_pass_opcheck(name):
    rank, transposed = name
    case = next(k for k, v in CASES.items() if v[:2] == name)
    _, _, size, kernel, stride, padding, dilation, out_pad, groups, _ = CASES[case]
    leaves, _, _ = _case(case, n=1)
    op = getattr(torch.ops.deformconv, f"deform_conv_transpose{rank}d" if transposed else f"deform_conv{rank}d")
    args = (*[t.requires_grad_(True) for t in leaves], list(stride), list(padding), list(dilation),
            list(out_pad) if transposed else [0] * rank, groups if transposed else 1, "")
    torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_interpreter)])
@pytest.mark.parametrize("name", list(FUNCTIONS), ids=[f"{'transpose' if t else 'conv'}{r}d" for r, t in FUNCTIONS])
def test_backward_op_fake_strides_match_the_real_ones(name, backend):
    """Every gradient the backward op returns has the shape, strides and dtype its fake impl promises (torch.compile
    asserts them where the op stays opaque), on each backend (the Triton backend sums grad_input channels-last)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rank, transposed = name
    case = next(k for k, v in CASES.items() if v[:2] == name)
    _, _, size, kernel, stride, padding, dilation, out_pad, groups, _ = CASES[case]
    (x, offset, weight, bias, mask), call, _ = _case(case, dtype=torch.float32)
    grad_out = torch.randn_like(call(x, offset, weight, bias, mask, backend=backend))
    op = getattr(torch.ops.deformconv, f"deform_conv_transpose{rank}d_backward" if transposed
                 else f"deform_conv{rank}d_backward")
    args = (grad_out, x, offset, weight, bias, mask, list(stride), list(padding), list(dilation),
            list(out_pad) if transposed else [0] * rank, groups if transposed else x.shape[1] // weight.shape[1],
            backend, [True] * 5)
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for what, r, f in zip(["input", "offset", "weight", "bias", "mask"], real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), what


@pytest.mark.parametrize("name", ["conv1d-k4", "conv3d-mixed", "transpose2d-s2"])
def test_empty_batch(name):
    leaves, call, _ = _case(name, n=0)
    leaves = [t.requires_grad_(True) for t in leaves]
    out = call(*leaves)
    assert out.shape[0] == 0
    out.sum().backward()
    assert leaves[0].grad.shape == leaves[0].shape


BAD = {
    "input-rank": (lambda a: dict(a, input=a["input"][0]), ValueError, r"input must be a 5-D tensor \[N, C, D, H, W\]"),
    "integer-input": (lambda a: dict(a, input=a["input"].long()), TypeError, "input must be a floating-point tensor"),
    "stride-zero": (lambda a: dict(a, stride=0), ValueError, r"stride must be positive, got \(0, 0, 0\)"),
    "padding-pair": (lambda a: dict(a, padding=(1, 1)), TypeError, "padding must be an int or a tuple of 3 ints"),
    "offset-channels": (lambda a: dict(a, offset=a["offset"][:, 1:]), ValueError,
                        r"offset.shape\[1\] must be 3\*offset_groups\*K"),
    "offset-size": (lambda a: dict(a, offset=a["offset"][..., 1:]), ValueError, "offset must have shape"),
    "mask-channels": (lambda a: dict(a, mask=a["mask"][:, 1:]), ValueError, "mask must have shape"),
    "weight-dtype": (lambda a: dict(a, weight=a["weight"].float()), TypeError,
                     "weight must have the same dtype as input"),
    "bias-size": (lambda a: dict(a, bias=a["bias"][1:]), ValueError, "bias must be a 1-D tensor of 3 elements"),
    "backend": (lambda a: dict(a, backend="cpu"), ValueError, r"backend must be one of \['triton', 'reference'\]"),
    "backend-cannot-run": (lambda a: dict(a, backend="triton"), RuntimeError,
                           "backend='triton' cannot run on device cpu with dtype torch.float64"),
    "output-size": (lambda a: dict(a, padding=0, input=a["input"][..., :1]), ValueError,
                    "computed output size .* is not positive"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_naming_the_argument(case):
    """Right after a good call too: the checks a signature passed are skipped for its later calls only."""
    (x, offset, weight, bias, mask), _, _ = _case("conv3d-mixed", n=1)
    args = dict(input=x, offset=offset, weight=weight, bias=bias, stride=(1, 2, 1), padding=(1, 0, 1),
                dilation=(1, 1, 2), mask=mask, backend=None)
    deformconv.deform_conv3d(**args)
    change, exc, message = BAD[case]
    with pytest.raises(exc, match=message):
        deformconv.deform_conv3d(**change(args))


def test_mixed_dtypes_pass_under_autocast_only():
    """A call of mixed dtypes that passed under autocast still raises outside it (autocast is part of the key of the
    checks' cache)."""
    (x, offset, weight, bias, mask), _, _ = _case("conv1d-k4", n=1, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        deformconv.deform_conv1d(x, offset, weight.bfloat16(), bias, 1, 2, 1, mask)
    with pytest.raises(TypeError, match="weight must have the same dtype as input"):
        deformconv.deform_conv1d(x, offset, weight.bfloat16(), bias, 1, 2, 1, mask)


def test_transposed_checks():
    (u, offset, weight, bias, mask), call, _ = _case("transpose2d-s2")
    with pytest.raises(ValueError, match="output_padding must be smaller than stride or dilation"):
        deformconv.deform_conv_transpose2d(u, offset, weight, bias, (2, 1), (1, 0), (2, 0), (1, 2), mask)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] must be input's channels \(2\)"):
        deformconv.deform_conv_transpose2d(u, offset, weight, bias, (2, 1), (1, 0), (1, 0), (1, 2), mask, groups=4)


@pytest.mark.parametrize("rank,transposed", list(FUNCTIONS))
def test_modules_load_the_dense_layers_keys_and_packs_start_dense(rank, transposed):
    """The modules' state_dict is nn.Conv*d's / nn.ConvTranspose*d's (and tvdcn's); a Pack at initialisation is the
    dense layer (its offsets zero, its mask 1/2 with modulated)."""
    torch.manual_seed(0)
    if transposed:
        dense = getattr(torch.nn, f"ConvTranspose{rank}d")(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2)
        ours = getattr(deformconv, f"DeformConvTranspose{rank}d")(4, 6, 3, stride=2, padding=1, output_padding=1,
                                                                  groups=2)
        pack = getattr(deformconv, f"DeformConvTranspose{rank}dPack")(4, 6, 3, stride=2, padding=1, output_padding=1,
                                                                      groups=2, offset_groups=3)
    else:
        dense = getattr(torch.nn, f"Conv{rank}d")(4, 6, 3, stride=2, padding=1, groups=2)
        ours = getattr(deformconv, f"DeformConv{rank}d")(4, 6, 3, stride=2, padding=1, groups=2)
        pack = getattr(deformconv, f"DeformConv{rank}dPack")(4, 6, 3, stride=2, padding=1, groups=2, offset_groups=2)
    ours.load_state_dict(dense.state_dict())
    pack.load_state_dict(dense.state_dict(), strict=False)
    x = torch.randn(2, 4, *[5] * rank)
    expected = dense(x)
    K = 3 ** rank
    positions = x.shape[2:] if transposed else expected.shape[2:]
    torch.testing.assert_close(ours(x, torch.zeros(2, rank * K, *positions)), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pack(x), expected, rtol=1e-5, atol=1e-5)
    assert set(pack.state_dict()) - set(dense.state_dict()) == {"conv_offset.weight", "conv_offset.bias"}


def test_modulated_pack_learns_its_offsets():
    pack = deformconv.DeformConv1dPack(2, 3, 3, padding=1, modulated=True)
    x = torch.randn(2, 2, 9)
    pack(x).square().sum().backward()
    assert pack.conv_offset.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"in_channels \(2\) must be divisible by offset_groups \(3\)"):
        deformconv.DeformConv1dPack(2, 3, 3, offset_groups=3)


def test_compile_export_and_fx_see_one_op():
    """torch.compile(fullgraph) runs the op with its gradients; torch.export keeps it whole; torch.fx traces a Pack
    with one call of the op (checked when the graph runs)."""
    (x, offset, weight, bias, mask), call, _ = _case("conv3d-mixed", dtype=torch.float32, n=1)
    leaves = [t.requires_grad_(True) for t in (x, offset, weight)]
    eager = call(*leaves, bias, mask)
    compiled = torch.compile(lambda *a: call(*a, bias, mask), backend="aot_eager", fullgraph=True)(*leaves)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled.sum(), leaves), torch.autograd.grad(eager.sum(), leaves)):
        torch.testing.assert_close(a, b)
    layer = deformconv.DeformConvTranspose2d(2, 3, 3, stride=2)
    u, off = torch.randn(1, 2, 4, 4), torch.randn(1, 18, 4, 4)
    ep = torch.export.export(layer, (u, off))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.deformconv.deform_conv_transpose2d.default]
    torch.testing.assert_close(ep.module()(u, off), layer(u, off))
    pack = deformconv.DeformConv1dPack(2, 3, 3, padding=1, modulated=True)
    traced = torch.fx.symbolic_trace(pack)
    x1 = torch.randn(2, 2, 7)
    torch.testing.assert_close(traced(x1), pack(x1))
    assert sum(n.op == "call_function" and n.target.__name__ == "_call" for n in traced.graph.nodes) == 1


@requires_interpreter
@pytest.mark.parametrize("deterministic, row_programs, runs",
                         [(False, 0, False), (False, 10**9, False), (True, 0, False), (False, 0, True),
                          (True, 0, True)],
                         ids=["atomics-tap-rows", "atomics-a-tap", "deterministic", "position-runs",
                              "deterministic-position-runs"])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernels_against_the_reference(name, deterministic, row_programs, runs, monkeypatch):
    """The Triton backend (its kernels in Triton's interpreter): output and all five gradients equal the float64
    reference within float32's tolerance, in deterministic mode too (int64 fixed-point scatters), with programs
    walking a row of taps and a tap each (the launcher's two grids), and with an image's columns in runs of 4
    positions (the chunks of an image too large for the column budget; grad_input summed over the runs)."""
    from deformconv.ops.common import columns_nd as kernels

    monkeypatch.setattr(kernels, "ROW_PROGRAMS", row_programs)
    if runs:
        monkeypatch.setattr(kernels, "BLOCK_L", 4)
        monkeypatch.setattr(kernels, "COLUMN_BUDGET", 1)
    leaves, call, _ = _case(name, n=2 if "3d" not in name else 1, seed=3)
    torch.use_deterministic_algorithms(deterministic)
    try:
        results = {}
        for backend, dtype in (("triton", torch.float32), ("reference", torch.float64)):
            ts = [t.to(dtype).requires_grad_(True) for t in leaves]
            out = call(*ts, backend=backend)
            gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
            results[backend] = (out, *torch.autograd.grad(out, ts, gout.to(dtype)))
    finally:
        torch.use_deterministic_algorithms(False)
    for what, a, b in zip(("output", "input", "offset", "weight", "bias", "mask"), results["triton"],
                          results["reference"]):
        assert torch.isfinite(a).all(), what
        assert_close(a, b, torch.float32, what)
