"""Narrow convolution groups (depthwise and near it) through the N-d forms' column kernels
(ops/deform_conv2d/triton/narrow_groups.py): output and every gradient against the naive float64 op, plain and from a
modulated layer's depthwise offset conv output (the logits form, taken by the rule), in deterministic mode too; the
rule (groups of at most NARROW_CHANNELS input channels) and not one group of few channels."""

import pytest
import torch
from _dcn_cases import TRITON_BACKENDS, compare_to_oracle, deterministic_mode, leaves_with_grad
from _naive import naive_deform_conv2d
from conftest import HAS_CUDA, assert_close, make_case, requires_interpreter

import deformconv

CASES = {  # make_case's arguments
    "depthwise-og2": dict(n=2, cin=4, cout=4, h=5, w=7, kh=3, kw=3, groups=4, offset_groups=2, padding=1),
    "depthwise-x2-stride2": dict(n=1, cin=3, cout=6, h=8, w=7, kh=3, kw=3, groups=3, stride=2, padding=1),
    "groups2-og3-5x5-no-mask": dict(n=1, cin=6, cout=4, h=6, w=7, kh=5, kw=5, groups=2, offset_groups=3, padding=2,
                                    mask=None),
}
GPU_CASES = {  # (options.narrow_groups, make_case's arguments): a network's depthwise layer, taken by the rule, and
    # groups of 4 channels, which the rule leaves to the implicit GEMM, forced onto the route (odd sizes, dilation)
    "depthwise-128": (None, dict(n=2, cin=128, cout=128, h=23, w=29, kh=3, kw=3, groups=128, padding=1)),
    "groups16-og4-dil2": (True, dict(n=3, cin=64, cout=48, h=17, w=13, kh=3, kw=3, groups=16, offset_groups=4,
                                     padding=2, dilation=2)),
}


def _route_counter(monkeypatch):
    from deformconv.ops.deform_conv2d.triton import narrow_groups

    calls = []
    for name in ("forward", "backward"):
        fn = getattr(narrow_groups, name)
        monkeypatch.setattr(narrow_groups, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or
                            _fn(*a, **k))
    return calls


@requires_interpreter
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_narrow_groups_against_the_oracle(case, backend, dtype, deterministic, forced, monkeypatch):
    forced(narrow_groups=True)  # the route at every narrow case, also those the rule leaves to the implicit GEMM
    calls = _route_counter(monkeypatch)
    args, kwargs = make_case(**CASES[case], dtype=torch.float64, seed=len(case))
    with deterministic_mode(deterministic):
        compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert "forward" in calls and "backward" in calls


@requires_interpreter
@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_modulated_layer_logits_on_narrow_groups(backend, dtype, forced, monkeypatch):
    """A modulated depthwise layer's planned call (the mask as logits of the offset conv's output): output and the
    gradients of the input, the offset conv's output, weight and bias against the float64 op from the same values."""
    forced(narrow_groups=None)
    monkeypatch.setenv("DEFORMCONV_BACKEND", "triton")
    calls = _route_counter(monkeypatch)
    torch.manual_seed(4)
    layer = deformconv.ModulatedDeformConv2dPack(6, 6, 3, padding=1, groups=6, offset_groups=3)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.5)
    torch.nn.init.normal_(layer.conv_offset.bias, std=1.0)
    layer = layer.to(dtype)
    leaves = []
    layer.conv_offset.register_forward_hook(
        lambda m, i, o: leaves.append(o.detach().requires_grad_(True)) or leaves[-1])
    x = torch.randn(2, 6, 7, 9).to(dtype).requires_grad_(True)
    y = layer(x)
    out = leaves[-1]
    gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    ours = [y, *torch.autograd.grad(y, [x, out, layer.weight, layer.bias], gout)]
    x64, out64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, out, layer.weight, layer.bias))
    want = naive_deform_conv2d(x64, out64[:, :54], w64, b64, layer.stride, layer.padding, layer.dilation,
                               mask=torch.sigmoid(out64[:, 54:]))
    expected = [want, *torch.autograd.grad(want, [x64, out64, w64, b64], gout.double())]
    for name, a, b in zip(["output", "input", "offset conv output", "weight", "bias"], ours, expected):
        assert a.dtype == dtype, name
        assert_close(a, b, dtype, name)
    assert "forward" in calls and "backward" in calls


def test_the_rule_keeps_one_group_of_few_channels_on_the_implicit_gemm():
    from deformconv.ops.deform_conv2d.triton.narrow_groups import NARROW_CHANNELS, narrow_groups

    x = torch.empty(1, 3, 4, 4)
    assert not narrow_groups(x, torch.empty(8, 3, 3, 3))  # one group: a first layer's RGB
    assert narrow_groups(x, torch.empty(3, 1, 3, 3))  # depthwise
    assert narrow_groups(x, torch.empty(6, 1, 3, 3))  # depthwise, two output channels a group
    wide = torch.empty(1, 4 * NARROW_CHANNELS, 4, 4)
    assert narrow_groups(wide, torch.empty(4, NARROW_CHANNELS, 3, 3))  # four groups of the widest narrow width
    wider = torch.empty(1, 2 * (NARROW_CHANNELS + 1), 4, 4)
    assert not narrow_groups(wider, torch.empty(4, NARROW_CHANNELS + 1, 3, 3))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_narrow_groups_on_the_gpu(case, dtype, forced, monkeypatch):
    """Against the float64 reference (fp32 without TF32, as F.conv2d with cudnn.allow_tf32 = False)."""
    route, case_args = GPU_CASES[case]
    forced(narrow_groups=route)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    calls = _route_counter(monkeypatch)
    args, kwargs = make_case(**case_args, dtype=torch.float64, seed=7, device="cuda")

    def reference(x, offset, weight, bias, stride, padding, dilation, mask):
        return deformconv.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask,
                                        backend="reference")

    compare_to_oracle("triton", dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, reference)
    assert "forward" in calls and "backward" in calls
