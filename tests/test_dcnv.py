"""DCNv3 and DCNv4 (deformconv.dcnv3 / dcnv4, their ops and modules) against an independent naive loop
implementation in float64, each convention against the others (DCNv4's offset_mask, deform_conv2d's offsets), the
torch.library registrations, argument errors, and the modules' checkpoint keys."""

import math

import pytest
import torch
import torch.nn.functional as F
from _naive_dcn import naive_dcnv3
from conftest import assert_close, requires_interpreter

import deformconv

# (N, H, W, G, D, kh, kw, stride, pad, dilation, offset_scale, remove_center): odd sizes, D not a multiple of 16,
# strides, dilations, a non-square kernel, offset_scale != 1
CASES = {
    "3x3-same": (2, 6, 7, 3, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1.0, False),
    "remove-center-scale": (1, 7, 5, 2, 3, 3, 3, (1, 1), (1, 1), (1, 1), 0.6, True),
    "stride2-dil2": (2, 9, 8, 1, 4, 3, 3, (2, 2), (2, 2), (2, 2), 1.0, False),
    "nonsquare-stride": (1, 6, 9, 2, 3, 3, 5, (2, 1), (1, 2), (1, 1), 1.7, False),
    "5x5-remove-center": (1, 7, 7, 4, 1, 5, 5, (1, 1), (2, 2), (1, 1), 1.0, True),
    "4x4-sixteen-points": (1, 6, 5, 2, 3, 4, 4, (1, 1), (1, 1), (1, 1), 1.0, False),
    "1x1": (2, 4, 5, 3, 2, 1, 1, (1, 1), (0, 0), (1, 1), 0.8, False),
}


def _case(name, dtype=torch.float64, seed=0):
    n, h, w, g, d, kh, kw, s, p, dil, scale, rc = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    ho = (h + 2 * p[0] - (dil[0] * (kh - 1) + 1)) // s[0] + 1
    wo = (w + 2 * p[1] - (dil[1] * (kw - 1) + 1)) // s[1] + 1
    k = kh * kw - int(rc)
    x = torch.randn(n, h, w, g * d, generator=gen, dtype=torch.float64)
    offset = torch.randn(n, ho, wo, g * k * 2, generator=gen, dtype=torch.float64) * 1.5
    # keep sample points away from whole numbers (bilinear's derivative jumps there)
    offset = torch.where((offset - offset.round()).abs() < 1e-3, offset + 3e-3, offset)
    mask = torch.rand(n, ho, wo, g * k, generator=gen, dtype=torch.float64)
    params = (kh, kw, s[0], s[1], p[0], p[1], dil[0], dil[1], g, d, scale)
    return [t.to(dtype) for t in (x, offset, mask)], params, rc


def _grads(fn, leaves, gout):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, gout.to(out.dtype))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_dcnv3_matches_the_naive_loops(name, backend):
    leaves, params, rc = _case(name)
    gout = torch.randn(naive_dcnv3(*leaves, *params, rc).shape, dtype=torch.float64)
    ours = _grads(lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 64, rc, backend=backend), leaves, gout)
    naive = _grads(lambda x, o, m: naive_dcnv3(x, o, m, *params, rc), leaves, gout)
    torch.testing.assert_close(ours[0], naive[0], atol=1e-12, rtol=1e-12)
    for what, a, b in zip(("input", "offset", "mask"), ours[1], naive[1]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)


def test_gradcheck():
    leaves, params, rc = _case("remove-center-scale")
    leaves = [t.requires_grad_(True) for t in leaves]
    assert torch.autograd.gradcheck(lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 256, rc), leaves)


@pytest.mark.parametrize("name", ["3x3-same", "5x5-remove-center"])
def test_dcnv4_is_dcnv3_with_one_offset_mask(name):
    """DCNv4's offset_mask (groups' blocks of 2K offsets and K weights, padded to a multiple of 8) gives DCNv3's
    output, and its gradient is DCNv3's offset and mask gradients in that layout, zero on the padding."""
    (x, offset, mask), params, rc = _case(name)
    g = params[8]
    om = deformconv.dcnv3_to_dcnv4(offset, mask, g)
    assert om.shape[-1] % 8 == 0 and om.shape[-1] >= 3 * mask.shape[-1]
    om = om + torch.where(torch.arange(om.shape[-1]) >= 3 * mask.shape[-1], 7.0, 0.0).double()  # padding ignored
    gout = torch.randn(x.shape[0], *mask.shape[1:3], x.shape[3], dtype=torch.float64)
    v3 = _grads(lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 256, rc), [x, offset, mask], gout)
    v4 = _grads(lambda x, om: deformconv.dcnv4(x, om, *params, 256, rc), [x, om], gout)
    torch.testing.assert_close(v4[0], v3[0], atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(v4[1][0], v3[1][0], atol=1e-13, rtol=1e-13)
    expected = deformconv.dcnv3_to_dcnv4(v3[1][1], v3[1][2], g, om.shape[-1])
    torch.testing.assert_close(v4[1][1], expected, atol=1e-13, rtol=1e-13)
    back = deformconv.dcnv4_to_dcnv3(om, g, mask.shape[-1] // g)
    torch.testing.assert_close(back[0], offset)
    torch.testing.assert_close(back[1], mask)


@pytest.mark.parametrize("name", list(CASES))
def test_deform_conv2d_convention(name):
    """dcnv3 equals deform_conv2d with a depthwise weight of ones (groups = C, offset groups = G) on the converted
    offsets and mask, forward and input gradient."""
    (x, offset, mask), params, rc = _case(name)
    kh, kw, sh, sw, ph, pw, dh, dw, g, d, scale = params
    off2, mask2 = deformconv.dcnv3_to_deform_conv2d(offset, mask, kh, kw, dh, dw, g, scale, rc)
    ones = torch.ones(g * d, 1, kh, kw, dtype=torch.float64)
    gout = torch.randn(x.shape[0], *mask.shape[1:3], g * d, dtype=torch.float64)
    a = _grads(lambda x: deformconv.dcnv3(x, offset, mask, *params, 256, rc), [x], gout)
    b = _grads(lambda x: deformconv.deform_conv2d(x.permute(0, 3, 1, 2), off2, ones, stride=(sh, sw), padding=(ph, pw),
                                                  dilation=(dh, dw), mask=mask2).permute(0, 2, 3, 1), [x], gout)
    torch.testing.assert_close(a[0], b[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(a[1][0], b[1][0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e30], ids=["nan", "inf", "-huge"])
def test_points_outside_or_nan_count_nowhere(value, backend):
    """A NaN, infinite or huge offset: that point contributes nothing and gets no gradient (as DCNv3's CUDA kernel,
    which skips points outside (-1, H) x (-1, W)); everything else stays finite and equal to the naive loops'."""
    (x, offset, mask), params, rc = _case("3x3-same")
    offset = offset.clone()
    offset[0, 2, 3, 5] = value
    gout = torch.randn(x.shape[0], *mask.shape[1:3], x.shape[3], dtype=torch.float64)
    ours = _grads(lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend), [x, offset, mask],
                  gout)
    for t in (ours[0], *ours[1]):
        assert torch.isfinite(t).all()
    clean = offset.clone()
    clean[0, 2, 3, 5] = 1e6  # far outside: the same point skipped
    naive = _grads(lambda x, o, m: naive_dcnv3(x, o, m, *params, rc), [x, clean, mask], gout)
    torch.testing.assert_close(ours[0], naive[0])
    torch.testing.assert_close(ours[1][0], naive[1][0])
    assert ours[1][1][0, 2, 3, 5] == 0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_points_on_the_border_get_no_gradient(backend):
    """Zero offsets put a 3x3 layer's corner taps on the line y = -1 (or x = -1) exactly: outside the open interval
    (-1, H), such a point counts nowhere and its offsets get no gradient, as in the naive loops (grid_sample alone
    would give the pixel row 0 a say in dy there)."""
    (x, offset, mask), params, rc = _case("3x3-same")
    offset = torch.zeros_like(offset)
    gout = torch.randn(x.shape[0], *mask.shape[1:3], x.shape[3], dtype=torch.float64)
    ours = _grads(lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend), [x, offset, mask],
                  gout)
    naive = _grads(lambda x, o, m: naive_dcnv3(x, o, m, *params, rc), [x, offset, mask], gout)
    for what, a, b in zip(("output", "input", "offset", "mask"), (ours[0], *ours[1]), (naive[0], *naive[1])):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)
    assert (ours[1][1][:, 0, :, 0:2] == 0).all()  # top row, point (i=0, j=0): on y = -1 and x = -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["3x3-same", "nonsquare-stride"])
def test_cpu_backend_in_low_precision(name, dtype):
    """The CPU backend computes float32 and half inputs in float32: against float64 within the dtype's tolerance."""
    leaves, params, rc = _case(name)
    gout = torch.randn(naive_dcnv3(*leaves, *params, rc).shape, dtype=torch.float64)
    fn = lambda x, o, m: deformconv.dcnv3(x, o, m, *params, 256, rc, backend="cpu")  # noqa: E731
    ours = _grads(fn, [t.to(dtype) for t in leaves], gout)
    exact = _grads(fn, [t.to(dtype).double() for t in leaves], gout)
    for what, a, b in zip(("output", "input", "offset", "mask"), (ours[0], *ours[1]), (exact[0], *exact[1])):
        assert a.dtype == dtype and torch.isfinite(a).all(), what
        assert_close(a, b, dtype, what)


def test_half_inputs_compute_in_float32():
    leaves, params, rc = _case("3x3-same", torch.bfloat16)
    out = deformconv.dcnv3(*leaves, *params, 256, rc)
    exact = naive_dcnv3(*[t.double() for t in leaves], *params, rc)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, atol=2e-2 * exact.abs().max().item(), rtol=4e-2)


def test_empty_batch():
    (x, offset, mask), params, rc = _case("3x3-same")
    x0, o0, m0 = (t[:0].requires_grad_(True) for t in (x, offset, mask))
    out = deformconv.dcnv3(x0, o0, m0, *params)
    assert out.shape == (0, *mask.shape[1:3], x.shape[3])
    out.sum().backward()
    assert x0.grad.shape == x0.shape


def test_ops_registrations():
    """opcheck: schemas, fake implementations, autograd registrations of both ops."""
    (x, offset, mask), params, rc = _case("remove-center-scale", torch.float32)
    kh, kw, sh, sw, ph, pw, dh, dw, g, d, scale = params
    common = ([kh, kw], [sh, sw], [ph, pw], [dh, dw], g, d, scale, rc, "")
    leaves = [t.requires_grad_(True) for t in (x, offset, mask)]
    torch.library.opcheck(torch.ops.deformconv.dcnv3.default, (*leaves, *common))
    om = deformconv.dcnv3_to_dcnv4(offset.detach(), mask.detach(), g).requires_grad_(True)
    torch.library.opcheck(torch.ops.deformconv.dcnv4.default, (leaves[0], om, *common))


def test_compile_fullgraph_export_and_autocast():
    m = deformconv.DCNv3(channels=12, group=3).eval()
    torch.nn.init.normal_(m.offset.weight, std=0.1)
    x = torch.randn(2, 7, 9, 12)
    eager = m(x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager)
    ep = torch.export.export(m, (x,))
    assert any("deformconv.dcnv3" in str(nd.target) for nd in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x), eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize("call,match", [
    (lambda x, o, m: deformconv.dcnv3(x, o, m, 3, 3, 1, 1, 1, 1, 1, 1, 5, 3, 1.0), "group \\* group_channels"),
    (lambda x, o, m: deformconv.dcnv3(x, o[..., :-2], m, 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0), "offset must have shape"),
    (lambda x, o, m: deformconv.dcnv3(x, o, m[..., :-1], 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0), "mask must have shape"),
    (lambda x, o, m: deformconv.dcnv3(x, o, m, 3, 3, 0, 1, 1, 1, 1, 1, 3, 4, 1.0), "stride_h"),
    (lambda x, o, m: deformconv.dcnv3(x, o, m, 2, 2, 1, 1, 1, 1, 1, 1, 3, 4, 1.0, 256, True), "remove_center"),
    (lambda x, o, m: deformconv.dcnv3(x, o, m.double(), 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0), "mask must have"),
    (lambda x, o, m: deformconv.dcnv3(x[0], o, m, 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0), "4-D tensor"),
    (lambda x, o, m: deformconv.dcnv3(x, o, m, 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0, backend="cuda"), "backend"),
    (lambda x, o, m: deformconv.dcnv4(x, o, 3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0), "offset_mask must have shape"),
])
def test_argument_errors_name_the_argument(call, match):
    x, offset, mask = torch.randn(2, 5, 6, 12), torch.randn(2, 5, 6, 54), torch.rand(2, 5, 6, 27)
    with pytest.raises((ValueError, TypeError), match=match):
        call(x, offset, mask)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_mask_in_internimages_layouts(backend):
    """The mask as [N, Ho, Wo, G, K] (DCNv4's published test scripts pass DCNv3's so; InternImage's CUDA op reads
    it by pointer) gives what [N, Ho, Wo, G*K] gives, gradient included in that layout; other layouts still raise."""
    torch.manual_seed(0)
    x, offset = torch.randn(2, 5, 6, 12), torch.randn(2, 5, 6, 54)
    mask = torch.rand(2, 5, 6, 3, 9, requires_grad=True)
    args = (3, 3, 1, 1, 1, 1, 1, 1, 3, 4, 1.0)
    out = deformconv.dcnv3(x, offset, mask, *args, backend=backend)
    flat = mask.detach().reshape(2, 5, 6, 27).requires_grad_(True)
    torch.testing.assert_close(out, deformconv.dcnv3(x, offset, flat, *args, backend=backend), rtol=0, atol=0)
    out.square().sum().backward()
    deformconv.dcnv3(x, offset, flat, *args, backend=backend).square().sum().backward()
    assert mask.grad.shape == mask.shape
    torch.testing.assert_close(mask.grad.reshape(2, 5, 6, 27), flat.grad)
    with pytest.raises(ValueError, match=r"mask must have shape \[2, 5, 6, 27\] or \[2, 5, 6, 3, 9\], got "
                                         r"\(2, 5, 6, 9, 3\)"):
        deformconv.dcnv3(x, offset, mask.detach().transpose(3, 4), *args)


# --- modules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module,shape,kw", [
    ("DCNv3", (0, 5, 6, 12), dict(center_feature_scale=True, remove_center=True)),
    ("DCNv4", (0, 30, 12), dict(dw_kernel_size=3, center_feature_scale=True)),
])
def test_modules_take_an_empty_batch(module, shape, kw):
    m = getattr(deformconv, module)(channels=12, group=3, **kw)
    x = torch.randn(*shape, requires_grad=True)
    y = m(x, shape=(5, 6)) if module == "DCNv4" else m(x)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None and not p.grad.any() for p in m.parameters())


@pytest.mark.parametrize("module,shape,match", [
    ("DCNv3", (2, 5, 6), "input must be \\[N, H, W, C\\] with C = channels = 12, got shape \\(2, 5, 6\\)"),
    ("DCNv3", (2, 5, 6, 8), "C = channels = 12, got shape \\(2, 5, 6, 8\\)"),
    ("DCNv4", (2, 5, 6, 12), "input must be \\[N, L, C\\] with C = channels = 12, got shape \\(2, 5, 6, 12\\)"),
    ("DCNv4", (2, 30, 8), "C = channels = 12, got shape \\(2, 30, 8\\)"),
])
def test_module_input_errors_name_the_layout(module, shape, match):
    m = getattr(deformconv, module)(channels=12, group=3)
    with pytest.raises(ValueError, match=match):
        m(torch.randn(*shape))

DCNV3_KEYS = ["center_feature_scale_proj_bias", "center_feature_scale_proj_weight", "dw_conv.0.bias",
              "dw_conv.0.weight", "dw_conv.1.1.bias", "dw_conv.1.1.weight", "input_proj.bias", "input_proj.weight",
              "mask.bias", "mask.weight", "offset.bias", "offset.weight", "output_proj.bias", "output_proj.weight"]
DCNV4_KEYS = ["center_feature_scale_proj_bias", "center_feature_scale_proj_weight", "offset_mask.bias",
              "offset_mask.weight", "offset_mask_dw.bias", "offset_mask_dw.weight", "output_proj.bias",
              "output_proj.weight", "value_proj.bias", "value_proj.weight"]


def test_module_keys_and_shapes_are_internimages():
    """The keys and shapes of InternImage's DCNv3 (LN norm, center_feature_scale) and FlashInternImage's DCNv4
    (dw_kernel_size, center_feature_scale): their checkpoints load with strict=True."""
    m3 = deformconv.DCNv3(channels=64, group=4, center_feature_scale=True)
    assert sorted(m3.state_dict()) == DCNV3_KEYS
    assert m3.offset.weight.shape == (4 * 9 * 2, 64) and m3.mask.weight.shape == (4 * 9, 64)
    m4 = deformconv.DCNv4(channels=64, group=4, dw_kernel_size=3, center_feature_scale=True)
    assert sorted(m4.state_dict()) == DCNV4_KEYS
    assert m4.offset_mask.weight.shape == (112, 64)  # ceil(3 * 4 * 9 / 8) * 8
    m4.load_state_dict({k: torch.randn_like(v) for k, v in m4.state_dict().items()}, strict=True)
    bn = deformconv.DCNv3(channels=16, group=2, norm_layer="BN", remove_center=True)
    assert "dw_conv.1.0.running_mean" in bn.state_dict() and bn.mask.weight.shape == (2 * 8, 16)
    assert deformconv.DCNv4(channels=16, group=2, without_pointwise=True, remove_center=True).offset_mask.weight.shape \
        == (48, 16)


def test_dcnv3_module_is_its_definition():
    """DCNv3's forward: input_proj, dw_conv -> offset / softmaxed mask, the core, the centre blend, output_proj
    (written out here with the naive loops), with weights that move the samples."""
    torch.manual_seed(0)
    m = deformconv.DCNv3(channels=6, group=2, center_feature_scale=True).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 5, 4, 6, dtype=torch.float64)
    v = m.input_proj(x)
    x1 = m.dw_conv(x.permute(0, 3, 1, 2))
    mask = F.softmax(m.mask(x1).reshape(1, 5, 4, 2, 9), -1).reshape(1, 5, 4, 18)
    core = naive_dcnv3(v, m.offset(x1), mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, False)
    s = torch.sigmoid(F.linear(x1, m.center_feature_scale_proj_weight, m.center_feature_scale_proj_bias))
    s = s.repeat_interleave(3, -1)
    torch.testing.assert_close(m(x), m.output_proj(core * (1 - s) + v * s))


def test_dcnv4_module_is_its_definition():
    torch.manual_seed(1)
    m = deformconv.DCNv4(channels=8, group=2, dw_kernel_size=3).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 5 * 3, 8, dtype=torch.float64)
    v = m.value_proj(x).reshape(2, 5, 3, 8)
    om_in = m.offset_mask_dw(x.view(2, 5, 3, 8).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).reshape(2, 15, 8)
    offset, mask = deformconv.dcnv4_to_dcnv3(m.offset_mask(om_in).reshape(2, 5, 3, -1), 2, 9)
    core = naive_dcnv3(v, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 2, 4, 1.0, False)
    torch.testing.assert_close(m(x, shape=(5, 3)), m.output_proj(core.reshape(2, 15, 8)))
    assert math.isqrt(16) == 4 and m(torch.randn(1, 16, 8, dtype=torch.float64)).shape == (1, 16, 8)


# --- the Triton kernels (under the interpreter on a CPU) -------------------------------------------------



def _run(backend, dtype, leaves, fn, gout):
    """Output and gradients of fn on the leaves cast to dtype (the float64 reference gets the same rounded values)."""
    cast = [t.to(dtype).to(torch.float64 if backend == "reference" else dtype).requires_grad_(True) for t in leaves]
    out = fn(*cast, backend)
    return [out, *torch.autograd.grad(out, cast, gout.to(out.dtype))]


@requires_interpreter
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_triton_dcnv3_matches_the_reference(name, dtype):
    leaves, params, rc = _case(name)
    gout = torch.randn(leaves[0].shape[0], *leaves[2].shape[1:3], leaves[0].shape[3], dtype=torch.float64)
    fn = lambda x, o, m, backend: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend)  # noqa: E731
    ours = _run("triton", dtype, leaves, fn, gout)
    ref = _run("reference", dtype, leaves, fn, gout)
    assert ours[0].dtype == dtype
    for what, a, b in zip(("output", "grad_input", "grad_offset", "grad_mask"), ours, ref):
        assert_close(a, b, dtype, what)


@requires_interpreter
@pytest.mark.parametrize("changes", [
    dict(gather_tile=(64, 1)), dict(gather_tile=(4096, 8)), dict(preload_points=False),
    dict(preload_points=False, gather_tile=(64, 1))],
    ids=["64x1", "4096x8", "per-point-loads", "per-point-loads-64x1"])
def test_triton_any_program_tile_is_right(changes):
    """options.gather_tile and preload_points (what benchmarks/tools/gather_tiles.py sweeps): a
    program of a few positions or of many, each point's offsets and weight loaded at that point rather than all
    first, give the reference's results."""
    from deformconv.config import options

    leaves, params, rc = _case("remove-center-scale")  # D = 3: 16 positions a program at 64 elements, 128 at 4096
    gout = torch.randn(leaves[0].shape[0], *leaves[2].shape[1:3], leaves[0].shape[3], dtype=torch.float64)
    fn = lambda x, o, m, backend: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend)  # noqa: E731
    with options.override(**changes):
        ours = _run("triton", torch.float32, leaves, fn, gout)
    ref = _run("reference", torch.float32, leaves, fn, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset", "grad_mask"), ours, ref):
        assert_close(a, b, torch.float32, what)


@requires_interpreter
@pytest.mark.parametrize("preload", [True, False], ids=["preloaded", "per-point-loads"])
@pytest.mark.parametrize("name", ["4x4-sixteen-points", "1x1", "nonsquare-stride"])
def test_triton_parameters_preloaded_or_per_point_are_right(name, preload):
    """A position's offsets and weights loaded for all its points first (up to 16: every column of the tile used at
    4x4, one at 1x1, 15 at 3x5) or a point at a time: both give the reference's output and gradients."""
    from deformconv.config import options

    leaves, params, rc = _case(name)
    gout = torch.randn(leaves[0].shape[0], *leaves[2].shape[1:3], leaves[0].shape[3], dtype=torch.float64)
    fn = lambda x, o, m, backend: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend)  # noqa: E731
    with options.override(preload_points=preload):
        ours = _run("triton", torch.float32, leaves, fn, gout)
    ref = _run("reference", torch.float32, leaves, fn, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset", "grad_mask"), ours, ref):
        assert_close(a, b, torch.float32, what)


@requires_interpreter
def test_triton_dcnv4_matches_the_reference():
    (x, offset, mask), params, rc = _case("5x5-remove-center")
    om = deformconv.dcnv3_to_dcnv4(offset, mask, params[8])
    gout = torch.randn(x.shape[0], *mask.shape[1:3], x.shape[3], dtype=torch.float64)
    fn = lambda x, om, backend: deformconv.dcnv4(x, om, *params, 256, rc, backend=backend)  # noqa: E731
    ours = _run("triton", torch.float32, [x, om], fn, gout)
    ref = _run("reference", torch.float32, [x, om], fn, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset_mask"), ours, ref):
        assert_close(a, b, torch.float32, what)
    assert (ours[2][..., 3 * mask.shape[-1]:] == 0).all()  # the padding channels' gradient


@requires_interpreter
@pytest.mark.parametrize("op", ["dcnv3", "dcnv4"])
def test_planned_calls_match_the_registered_ops(op):
    """The eager fast path's per-signature Call (dcnv._planned: launches worked out once) against the registered op:
    bit for bit, at a second call of the same signature with new inputs (nothing of the first kept), with other
    inputs requiring gradients, under autocast, and where a tensor is not contiguous or not 16-byte aligned (other
    signatures, or the general path)."""
    from deformconv.config import options

    name = "remove-center-scale"
    _, params, rc = _case(name)
    kh, kw, sh, sw, ph, pw, dh, dw, g, d, scale = params

    def leaves_for(seed, grads=None):
        (x, offset, mask), _, _ = _case(name, torch.float32, seed=seed)
        leaves = [x, offset, mask] if op == "dcnv3" else [x, deformconv.dcnv3_to_dcnv4(offset, mask, g)]
        return [t.requires_grad_(r) for t, r in zip(leaves, grads or [True] * len(leaves))]

    def ours(*t):
        return getattr(deformconv, op)(*t, *params, 256, rc, backend="triton")

    def registered(*t):
        return getattr(torch.ops.deformconv, op)(*t, [kh, kw], [sh, sw], [ph, pw], [dh, dw], g, d, scale, rc,
                                                 "triton")

    def check(leaves, autocast=None):
        gout = torch.randn(leaves[0].shape[0], *leaves[1].shape[1:3], leaves[0].shape[3])
        results = []
        for fn in (ours, registered):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                out = fn(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, gout.to(out.dtype)))
            results.append([out] + [next(grads) if t.requires_grad else None for t in leaves])
        for i, (a, b) in enumerate(zip(*results)):
            assert (a is None) == (b is None), i
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), i
        return results[0]

    options.clear()
    first = check(leaves_for(0))
    assert len([c for c in options.cache("dcnv_eager").values() if c is not None]) == 1  # the planned path taken
    second = check(leaves_for(1))
    assert not torch.equal(first[0], second[0])
    assert len(options.cache("dcnv_eager")) == 1  # the same signature: the same Call
    check(leaves_for(2, [False, True, False][:2 if op == "dcnv4" else 3]))
    check(leaves_for(3, [True, False, True][:2 if op == "dcnv4" else 3]))
    check(leaves_for(4), autocast=torch.float16)
    x, *rest = leaves_for(5)
    check([x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(), *rest])
    misaligned = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x).requires_grad_()
    assert misaligned.data_ptr() % 16 and misaligned.is_contiguous()
    check([misaligned, *rest])


@requires_interpreter
def test_triton_deterministic_mode_is_reproducible_and_right():
    """torch.use_deterministic_algorithms(True): grad_input summed in int64 fixed point, the same bits on every run,
    within fp32's tolerance of the reference."""
    leaves, params, rc = _case("stride2-dil2")
    gout = torch.randn(leaves[0].shape[0], *leaves[2].shape[1:3], leaves[0].shape[3], dtype=torch.float64)
    fn = lambda x, o, m, backend: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend)  # noqa: E731
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_run("triton", torch.float32, leaves, fn, gout) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0][1], runs[1][1])
    ref = _run("reference", torch.float32, leaves, fn, gout)
    assert_close(runs[0][1], ref[1], torch.float32, "grad_input")


@requires_interpreter
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_triton_points_outside_or_nan_count_nowhere(value):
    (x, offset, mask), params, rc = _case("3x3-same")
    offset = offset.clone()
    offset[0, 2, 3, 5] = value
    gout = torch.randn(x.shape[0], *mask.shape[1:3], x.shape[3], dtype=torch.float64)
    fn = lambda x, o, m, backend: deformconv.dcnv3(x, o, m, *params, 256, rc, backend=backend)  # noqa: E731
    ours = _run("triton", torch.float32, [x, offset, mask], fn, gout)
    ref = _run("reference", torch.float32, [x, offset, mask], fn, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset", "grad_mask"), ours, ref):
        assert torch.isfinite(a).all(), what
        assert_close(a, b, torch.float32, what)


def test_automatic_backend_and_errors():
    """The one dispatch, for the ops other than deform_conv2d: the CPU backend on CPU tensors where the op has one,
    the reference elsewhere; a forced backend that cannot run and an unknown one raise."""
    from deformconv import select_backend as select

    assert select(torch.device("cpu"), torch.float32, op="dcnv3") == "cpu"
    assert select(torch.device("cpu"), torch.float64, "reference", op="ms_deform_attn") == "reference"
    assert select(torch.device("meta"), torch.float32, op="dcnv4") == "reference"  # the cpu backend: CPU tensors only
    assert select(torch.device("cpu"), torch.float32, op="deform_roi_pool") == "reference"  # RoI pooling has no cpu
    with pytest.raises(RuntimeError, match="backend='triton' cannot run"):
        select(torch.device("cpu"), torch.float64, "triton", op="dcnv3")
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run on device meta"):
        select(torch.device("meta"), torch.float32, "cpu", op="ms_deform_attn")
    with pytest.raises(ValueError, match=r"backend must be one of \['triton', 'reference'\]"):
        select(torch.device("cpu"), torch.float32, "cpu", op="deform_psroi_pool")
    with pytest.raises(ValueError, match="backend must be one of"):
        select(torch.device("cpu"), torch.float32, "cuda", op="dcnv3")
    with pytest.raises(ValueError, match="op must be one of"):
        select(torch.device("cpu"), torch.float32, op="deform_conv4d")


def test_meta_tensors_get_the_fake_impl():
    """Meta tensors (a device type autocast does not know) take the op and its fake implementation: shapes only."""
    x = torch.empty(2, 5, 6, 8, device="meta")
    offset, mask = torch.empty(2, 5, 6, 4 * 9 * 2, device="meta"), torch.empty(2, 5, 6, 4 * 9, device="meta")
    out3 = deformconv.dcnv3(x, offset, mask, 3, 3, 1, 1, 1, 1, 1, 1, 4, 2, 1.0)
    out4 = deformconv.dcnv4(x, torch.empty(2, 5, 6, 112, device="meta"), 3, 3, 1, 1, 1, 1, 1, 1, 4, 2, 1.0)
    assert out3.device.type == out4.device.type == "meta"
    assert out3.shape == out4.shape == (2, 5, 6, 8)
