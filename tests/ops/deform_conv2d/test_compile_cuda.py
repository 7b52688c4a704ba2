"""The compile route on a CUDA GPU (skipped without one): torch.compile decomposes the op into its Triton kernels,
which Inductor launches from its own code (ops/deform_conv2d/op.py); results and gradients equal the float64 reference
within the dtype's tolerance, as eager's do; CUDA graphs (mode="reduce-overhead") capture a training step; symbolic
shapes keep the op opaque and still work; torch.export keeps the op whole."""

import re

import pytest
import torch
from conftest import HAS_CUDA, assert_close, make_case
from torch._inductor.utils import run_and_get_code

import deformconv

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("implicit_gemm_for_groups")]  # these kernels, grouped cases included

# (n, cin, cout, h, w, k, groups, offset_groups, stride, padding, dilation, mask): odd sizes, stride 2, groups, 5x5,
# no mask, packed segments
SHAPES = {
    "odd-s2": (3, 24, 40, 17, 23, 3, 1, 1, 2, 1, 1, "random"),
    "groups-og4": (2, 32, 48, 13, 11, 3, 2, 4, 1, 1, 1, "random"),
    "5x5-no-mask": (2, 16, 24, 15, 19, 5, 1, 1, 1, 2, 1, None),
    "og8-packed": (2, 64, 64, 14, 15, 3, 1, 8, 1, 1, 1, "random"),
    # columns.MIN_COUT output channels: grad_weight through the column buffer in 16 bits (columns_usable)
    "cout-128": (2, 16, 128, 9, 11, 3, 1, 1, 1, 1, 1, "random"),
    # columns.MIN_CIN_GRAD_COL input channels: grad_input/offset/mask through grad_col's rows in 16 bits
    "cin-512": (2, 512, 24, 5, 7, 3, 1, 1, 1, 1, 1, "random"),
    # 256 output channels past one wave of the forward's 64-row programs (225 > 132 SMs): the traced forward's 128x256
    # tile (configs.traced_wide_tile); grad_weight through the column buffer in 16 bits
    "cout-256-waves": (4, 16, 256, 60, 60, 3, 1, 1, 1, 1, 1, "random"),
}
# the kernel that replaces each fused backward kernel under its column route, and the cases that take that route
COLUMN_ROUTES = {"_deform_conv2d_bwd_weight_kernel": (("cout-128", "cout-256-waves"), "_columns_kernel"),
                 "_deform_conv2d_bwd_data_kernel": (("cin-512",), "_grad_columns_kernel")}
KERNELS = ("_deform_conv2d_fwd_kernel", "_deform_conv2d_bwd_data_kernel", "_deform_conv2d_bwd_weight_kernel")


@pytest.fixture(autouse=True)
def _fresh_compiles(monkeypatch):
    monkeypatch.setenv("DEFORMCONV_COMPILE_KERNELS", "1")
    torch._dynamo.reset()
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = old
    torch._dynamo.reset()


def _leaves(name, dtype):
    """The case's inputs in float64, with values that dtype holds exactly: the reference then sees the inputs the
    dtype's run sees (a sample point moved by rounding can cross a grid line, where grad_offset jumps)."""
    n, cin, cout, h, w, k, g, og, s, p, d, mask = SHAPES[name]
    args, kw = make_case(n, cin, cout, h, w, k, k, groups=g, offset_groups=og, stride=s, padding=p, dilation=d,
                         mask=mask, dtype=dtype, seed=sum(map(ord, name)))
    args = tuple(t if t is None else t.double() for t in args)
    kw["mask"] = kw["mask"] if kw["mask"] is None else kw["mask"].double()
    leaves = [t.cuda() for t in (*args, kw["mask"]) if t is not None]
    return leaves, dict(stride=kw["stride"], padding=kw["padding"], dilation=kw["dilation"]), kw["mask"] is not None


def _fwd_bwd(fn, leaves, gout=None):
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    if gout is None:
        gen = torch.Generator("cuda").manual_seed(5)
        gout = torch.randn(out.shape, device="cuda", dtype=torch.float64, generator=gen)
    grads = torch.autograd.grad(out, leaves, gout.to(out.dtype))
    return out, grads, gout


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_compiled_code_launches_the_kernels_and_matches_the_reference(name, dtype):
    leaves64, params, has_mask = _leaves(name, dtype)

    def layer(x, offset, weight, bias, *mask):
        return deformconv.deform_conv2d(x, offset, weight, bias, mask=mask[0] if mask else None, **params)

    compiled = torch.compile(layer, fullgraph=True)
    ref_out, ref_grads, gout = _fwd_bwd(layer, leaves64)  # the float64 reference (CUDA float64: reference backend)
    (out, grads, _), codes = run_and_get_code(lambda: _fwd_bwd(compiled, [t.to(dtype) for t in leaves64], gout))
    code = "\n".join(codes)
    # a kernel's name not inside another's (_columns_kernel in _grad_columns_kernel); Inductor may append an index
    launched = lambda kernel: re.search(rf"(?<!\w){kernel}", code) is not None  # noqa: E731
    for kernel in KERNELS:
        cases, column_kernel = COLUMN_ROUTES.get(kernel, ((), None))
        columns = name in cases and dtype != torch.float32
        assert launched(kernel) != columns, (f"{kernel} launched: {launched(kernel)}, its column route expected: "
                                             f"{columns}")
        if column_kernel is not None:
            assert launched(column_kernel) == columns, f"{column_kernel} launched: {launched(column_kernel)}"
    assert "torch.ops.deformconv" not in code, "the op stayed opaque"
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "output")
    for what, g, ref in zip(("input", "offset", "weight", "bias", "mask"), grads, ref_grads):
        assert_close(g, ref, dtype, f"grad_{what}")


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_compiled_module_reads_its_offset_and_mask_as_traced(channels_last):
    """A compiled ModulatedDeformConv2dPack: its offset is a channel slice of the offset conv's output and its mask a
    sigmoid of another, buffers whose strides Inductor may set otherwise than traced (it may pad an image stride
    such as this one, 18·11·10 = 1980 elements, not a multiple of 32, or pass the slice itself); the output and every
    gradient match the float64 module within fp32's tolerance, as eager's do."""
    torch.manual_seed(0)
    mod = deformconv.ModulatedDeformConv2dPack(16, 24, 3, padding=1, stride=2).cuda()
    torch.nn.init.normal_(mod.conv_offset.weight, std=0.1)
    mod64 = deformconv.ModulatedDeformConv2dPack(16, 24, 3, padding=1, stride=2).cuda().double()
    mod64.load_state_dict(mod.state_dict())
    x = torch.randn(3, 16, 21, 19, device="cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    gout = torch.randn(3, 24, 11, 10, device="cuda", dtype=torch.float64)

    def run(fn, params, xx):
        xx = xx.detach().requires_grad_(True)
        out = fn(xx)
        return [out, *torch.autograd.grad(out, [xx, *params], gout.to(out.dtype))]

    ref = run(mod64, list(mod64.parameters()), x.double())
    got = run(torch.compile(mod, fullgraph=True), list(mod.parameters()), x)
    names = ["output", "grad_input", "grad_weight", "grad_bias", "grad_offset_conv.weight", "grad_offset_conv.bias"]
    for what, g, r in zip(names, got, ref):
        assert_close(g, r, torch.float32, what)


def _train(model, x, steps, compile_model=None):
    """Losses and final parameters of `steps` SGD steps; the model compiled by compile_model (its forward and, through
    AOTAutograd, its backward: Dynamo does not trace a call of Tensor.backward)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = compile_model(model) if compile_model else model
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if compile_model:
            torch.compiler.cudagraph_mark_step_begin()
        loss = run(x).square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()]


def _net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
                              deformconv.ModulatedDeformConv2dPack(16, 24, 3, padding=1, stride=2),
                              torch.nn.ReLU(), deformconv.DeformConv2dPack(24, 16, 3, padding=1)).cuda()
    for m in net.modules():  # non-zero offsets and masks: the sampling paths, not the regular grid
        if hasattr(m, "conv_offset"):
            torch.nn.init.normal_(m.conv_offset.weight, std=0.1)
    return net


def test_reduce_overhead_captures_a_training_step():
    """mode="reduce-overhead": forward and backward replay as CUDA graphs (none skipped), and 4 fp32 SGD steps land as
    near the float64 steps (the reference backend) as eager fp32 steps do. (Compiled and eager fp32 differ from each
    other by their summation orders: atomics, tiles without TMA; each one's distance from float64 is what counts.)"""
    from torch._dynamo.utils import counters

    x = torch.randn(3, 8, 21, 19, device="cuda")
    ref_losses, ref_params = _train(_net().double(), x.double(), 4)
    losses, params = _train(_net(), x, 4)
    counters.clear()
    c_losses, c_params = _train(_net(), x, 4, lambda f: torch.compile(f, mode="reduce-overhead", fullgraph=True))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    compared = [("losses", torch.stack(losses), torch.stack(c_losses), torch.stack(ref_losses)),
                *[(f"parameter {i}", *t) for i, t in enumerate(zip(params, c_params, ref_params))]]
    for what, eager, compiled, ref in compared:
        eager_error = (eager.double() - ref).abs().max().item()
        compiled_error = (compiled.double() - ref).abs().max().item()
        assert compiled_error <= 4 * eager_error + 1e-6 * ref.abs().max().item(), (what, compiled_error, eager_error)


def test_dynamic_shapes_keep_the_op_opaque_and_work():
    """dynamic=True (symbolic sizes): the op stays opaque and plans per call; two sizes, one compile."""
    net = _net()
    compiled = torch.compile(net, dynamic=True, fullgraph=True)
    for h, w in ((21, 19), (17, 30)):
        x = torch.randn(2, 8, h, w, device="cuda")
        torch.testing.assert_close(compiled(x), net(x), atol=1e-5, rtol=1e-5)


def test_export_keeps_the_op_whole():
    net = _net().eval()
    x = torch.randn(2, 8, 13, 12, device="cuda")
    ep = torch.export.export(net, (x,))
    targets = [str(nd.target) for nd in ep.graph.nodes]
    assert sum("deformconv.deform_conv2d" in t for t in targets) == 2
    assert not any("triton_kernel_wrapper" in t for t in targets)
    torch.testing.assert_close(ep.module()(x), net(x), atol=1e-5, rtol=1e-5)
