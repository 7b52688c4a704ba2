"""The torch.library op: opcheck, torch.compile(fullgraph=True), torch.export, autocast."""

import pytest
import torch
from conftest import HAS_CUDA, make_case, requires_cuda, requires_interpreter

import deformconv


def _op_args(backend="reference", dtype=torch.float64, mask="random", seed=0, device="cpu"):
    args, kw = make_case(2, 4, 6, 6, 7, 3, 3, groups=2, offset_groups=2, padding=1, mask=mask, dtype=dtype, seed=seed,
                         device=device)
    x, offset, weight, bias = (t.requires_grad_(True) for t in args)
    m = kw["mask"].requires_grad_(True) if kw["mask"] is not None else None
    return (x, offset, weight, bias, m, [1, 1], [1, 1], [1, 1], backend)


@pytest.mark.parametrize("mask", ["random", None], ids=["dcnv2", "dcnv1"])
def test_opcheck_forward(mask):
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d.default, _op_args(mask=mask))


def test_opcheck_backward():
    x, offset, weight, bias, m, s, p, d, be = _op_args()
    grad_out = torch.randn(2, 6, 6, 7, dtype=torch.float64)
    args = (grad_out, x.detach(), offset.detach(), weight.detach(), m.detach(), s, p, d, [True] * 5, be)
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d_backward.default, args)
    args_partial = args[:8] + ([False, True, False, True, False], be)
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d_backward.default, args_partial)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dcn = deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1)
        with torch.no_grad():
            self.dcn.conv_offset.weight.normal_(0, 0.2)

    def forward(self, x):
        return torch.relu(self.dcn(x))


def test_compile_fullgraph_cpu_forward_and_backward():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    eager = net(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4)


def test_compile_inductor_cpu():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True)
    torch.testing.assert_close(compiled(x), net(x), atol=1e-5, rtol=1e-5)


def test_compiling_a_layer_gives_no_dynamo_warning(monkeypatch):
    """Dynamo traces through the backend choice (the autocast rule asks for it) without the warning it gives, once a
    process, for each functools.lru_cache wrapper it meets ("silent incorrectness is a potential risk")."""
    import warnings

    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # what Dynamo warned of earlier in this process
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 4, 9, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for autocast in (False, True):
            torch._dynamo.reset()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                torch.compile(net, fullgraph=True, backend="eager")(x)
    assert [str(w.message) for w in caught if "Dynamo" in str(w.message)] == []


def test_export_has_one_op_and_runs():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    ep = torch.export.export(net, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("deformconv.deform_conv2d" in t for t in targets) == 1
    torch.testing.assert_close(ep.module()(x), net(x))


def test_autocast_cpu_runs_in_bfloat16():
    """Under autocast the op runs in the autocast dtype (not upcast to float32)."""
    args, kw = make_case(2, 4, 6, 6, 7, 3, 3, padding=1, dtype=torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_conv2d(*args, **kw)
    assert out.dtype == torch.bfloat16
    ref = deformconv.deform_conv2d(*[t.bfloat16() for t in args], **dict(kw, mask=kw["mask"].bfloat16()))
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_autocast_accepts_mixed_input_dtypes():
    """Inside autocast, float32 activations with bfloat16 weights are fine (the rule casts them)."""
    args, kw = make_case(1, 4, 6, 6, 7, 3, 3, padding=1, dtype=torch.float32, seed=4)
    x, offset, weight, bias = args
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_conv2d(x, offset, weight.bfloat16(), bias, **kw)
    assert out.dtype == torch.bfloat16


# --- the eager fast path (ops/deform_conv2d/eager.py) must be the op, minus the dispatcher ---


def _grads_of(fn, backend):
    triton = backend == "triton"  # on the GPU where there is one, else under the interpreter
    x, offset, weight, bias, m, s, p, d, _ = _op_args(backend=backend, dtype=torch.float32 if triton else torch.float64,
                                                      seed=7, device="cuda" if triton and HAS_CUDA else "cpu")
    out = fn(x, offset, weight, bias, m, s, p, d, backend)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    return [out] + [t.grad for t in (x, offset, weight, bias, m)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_eager_fast_path_equals_the_op_bitwise(backend):
    """The fast path and the op give the same bits. On a GPU grad_input's float atomics add in any order, so both
    run in deterministic mode there (fixed-point sums: the same bits every run)."""
    deterministic = backend == "triton" and HAS_CUDA
    torch.use_deterministic_algorithms(deterministic)
    try:
        torch.manual_seed(0)
        fast = _grads_of(lambda x, o, w, b, m, s, p, d, be: deformconv.deform_conv2d(
            x, o, w, b, stride=s, padding=p, dilation=d, mask=m, backend=be), backend)
        torch.manual_seed(0)
        op = _grads_of(torch.ops.deformconv.deform_conv2d, backend)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(["out", "input", "offset", "weight", "bias", "mask"], fast, op):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_eager_fast_path_is_taken_only_in_plain_eager():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from deformconv.ops.common.eager import fast_path_ok

    x = torch.randn(1, 2, 3, 3)
    assert fast_path_ok([x, None, torch.nn.Parameter(x)])
    assert not fast_path_ok([x.to("meta")])
    with FakeTensorMode() as mode:
        assert not fast_path_ok([mode.from_tensor(x)])

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Spy():
        assert not fast_path_ok([x])
    seen = []
    torch.vmap(lambda t: seen.append(fast_path_ok([t])) or t)(x)
    assert seen == [False]


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16),
                                          pytest.param("cuda", torch.float16, marks=requires_cuda),
                                          pytest.param("cuda", torch.bfloat16, marks=requires_cuda)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float64], ids=["fp32-weight", "fp64-weight"])
def test_autocast_takes_the_fast_path_with_the_op_results(device, dtype, weight_dtype):
    """Under autocast the public function casts as the op's autocast rule does (floating tensors other than float64
    to the autocast dtype) and runs the eager fast path: no dispatcher, and the output and every gradient equal the
    registered op's bit for bit (float64 stays float64: here the weight, so the call mixes dtypes as autocast
    leaves them)."""
    def grads(fn):
        torch.manual_seed(0)
        x, offset, weight, bias, m, s, p, d, _ = _op_args(dtype=torch.float32, seed=11, device=device)
        weight = weight.detach().to(weight_dtype).requires_grad_(True)
        with torch.autocast(device, dtype=dtype):
            out = fn(x, offset, weight, bias, m, s, p, d)
        out.float().sum().backward()
        return [out] + [t.grad for t in (x, offset, weight, bias, m)]

    torch.use_deterministic_algorithms(device == "cuda")  # grad_input's float atomics add in any order on a GPU
    try:
        fast = grads(lambda x, o, w, b, m, s, p, d: deformconv.deform_conv2d(x, o, w, b, s, p, d, m))
        # the fast path's node (the Triton kernels: their per-signature Call), not the op's
        assert type(fast[0].grad_fn).__name__ == ("PlannedCallBackward" if device == "cuda" else
                                                  "DeformConv2dFunctionBackward"), type(fast[0].grad_fn).__name__
        op = grads(lambda x, o, w, b, m, s, p, d: torch.ops.deformconv.deform_conv2d(x, o, w, b, m, s, p, d, ""))
    finally:
        torch.use_deterministic_algorithms(False)
    assert fast[0].dtype == dtype and fast[1].dtype == torch.float32 and fast[3].dtype == weight_dtype
    for name, a, b in zip(["out", "input", "offset", "weight", "bias", "mask"], fast, op):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float16, marks=requires_interpreter),
                                          pytest.param("cuda", torch.bfloat16, marks=requires_cuda)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_autocast_on_the_kernels_keeps_a_float32_weight_uncast(device, dtype, bias):
    """Under autocast on the Triton kernels the eager path leaves a float32 weight and bias as they are (no cast
    kernels or autograd nodes: they accumulate their gradients directly), and still gives the op's results bit for
    bit: the kernels use them in the autocast dtype and round their gradients as the cast's backward would."""
    def run(fn):
        g = torch.Generator().manual_seed(5)
        x, off = torch.randn(2, 6, 7, 9, generator=g), torch.randn(2, 18, 7, 9, generator=g)
        m, w = torch.rand(2, 9, 7, 9, generator=g), torch.randn(8, 6, 3, 3, generator=g) * 0.3
        b = torch.randn(8, generator=g) if bias else None
        leaves = [t if t is None else t.to(device).requires_grad_(True) for t in (x, off, w, b, m)]
        with torch.autocast(device, dtype=dtype):
            out = fn(*leaves)
        out.float().square().sum().backward()
        return out, [out] + [t.grad for t in leaves if t is not None]

    torch.use_deterministic_algorithms(device == "cuda")  # grad_input's float atomics add in any order on a GPU
    try:
        out, fast = run(lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m, backend="triton"))
        _, op = run(lambda x, o, w, b, m: torch.ops.deformconv.deform_conv2d(x, o, w, b, m, [1, 1], [1, 1], [1, 1],
                                                                             "triton"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert type(out.grad_fn).__name__ == "PlannedCallBackward"  # the per-signature path (functional._planned)
    nodes = [type(f).__name__ for f, _ in out.grad_fn.next_functions]
    # (input, offset, weight[, bias], mask): the float32 inputs are cast (ToCopy), the weight and bias are not
    expected = ["ToCopyBackward0", "ToCopyBackward0"] + ["AccumulateGrad"] * (1 + bias) + ["ToCopyBackward0"]
    assert nodes == expected, nodes
    assert out.dtype == dtype
    for name, a, b in zip(["out", "input", "offset", "weight", "bias", "mask"] if bias else
                          ["out", "input", "offset", "weight", "mask"], fast, op):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_meta_tensors_still_get_the_fake_impl():
    args, kw = make_case(2, 4, 6, 6, 7, 3, 3, padding=1, dtype=torch.float32)
    out = deformconv.deform_conv2d(*[t.to("meta") for t in args], **dict(kw, mask=kw["mask"].to("meta")))
    assert out.device.type == "meta" and out.shape == (2, 6, 6, 7)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_double_backward_raises_instead_of_a_silent_zero(path):
    x, offset, weight, bias, m, s, p, d, be = _op_args()
    if path == "eager":
        out = deformconv.deform_conv2d(x, offset, weight, bias, stride=s, padding=p, dilation=d, mask=m)
    else:
        out = torch.ops.deformconv.deform_conv2d(x, offset, weight, bias, m, s, p, d, be)
    (g,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice|no autograd formula"):
        (g.square().sum() + out.sum()).backward()


@pytest.mark.parametrize("backend,narrow", [("reference", None), ("triton", True), ("triton", False)],
                         ids=["reference", "triton-columns", "triton-implicit-gemm"])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_backward_op_fake_strides_match_the_real_ones(backend, narrow, layout, forced):
    """The backward op's fake impl gives each gradient the strides the real one returns (torch.compile asserts them):
    grad_input and grad_weight in their tensor's memory format, grad_offset and grad_mask NCHW-contiguous, with
    channels_last offset and mask too (a channels_last model's offset conv); on both of the Triton backend's routes
    for these groups of two channels (options.narrow_groups)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    forced(narrow_groups=narrow)
    triton = backend == "triton"
    x, offset, weight, bias, m, s, p, d, _ = _op_args(dtype=torch.float32 if triton else torch.float64, seed=3,
                                                      device="cuda" if triton and HAS_CUDA else "cpu")
    tensors = [t.detach() for t in (x, offset, weight, m)]
    if layout == "channels_last":
        tensors = [t.contiguous(memory_format=torch.channels_last) for t in tensors]
    x, offset, weight, m = tensors
    grad_out = torch.randn(2, 6, 6, 7, dtype=x.dtype, device=x.device)
    args = (grad_out, x, offset, weight, m, s, p, d, [True] * 5, backend)
    real = torch.ops.deformconv.deform_conv2d_backward(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.deformconv.deform_conv2d_backward(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                            for a in args])
    for name, r, f in zip(["input", "offset", "mask", "weight", "bias"], real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), name
    assert real[1].is_contiguous() and real[2].is_contiguous()
