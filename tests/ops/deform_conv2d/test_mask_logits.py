"""A modulated layer's planned call reading its offset conv's output as it is (sampling.MASK_LOGITS): the kernels take
the offset and the mask's logits from the one NCHW tensor, apply the sigmoid themselves and write both gradients into
one tensor like it. Against the float64 oracle from the offset conv's output as computed (the split, the sigmoid and the
naive op), on every route the kernels take: packed and long segments, sample points loaded ahead or in the step, the
column buffers, deterministic mode, the batch in chunks, narrow groups' column kernels; and a channels_last output,
which takes the split, bit for bit as before."""

import dataclasses

import pytest
import torch
from _dcn_cases import TRITON_BACKENDS, deterministic_mode
from _naive import naive_deform_conv2d
from conftest import HAS_CUDA, assert_close, kernel_modules, requires_interpreter

import deformconv

CASES = {  # ModulatedDeformConv2dPack(cin, cout, k, **kwargs) on [n, cin, h, w]; the interpreter's (tiny)
    "packed-og2-stride2": dict(cin=4, cout=5, k=3, n=2, h=9, w=11, stride=2, padding=1, offset_groups=2),
    "long-segment-og2": dict(cin=64, cout=3, k=3, n=1, h=4, w=5, padding=1, offset_groups=2),
    "groups2-og3-5x5": dict(cin=6, cout=4, k=5, n=1, h=6, w=7, padding=2, groups=2, offset_groups=3),
}
GPU_CASES = {  # a network's layer shapes and odd ones
    "resnet-c4-like": dict(cin=256, cout=256, k=3, n=2, h=15, w=17, padding=1),
    "og8-packed-stride2": dict(cin=64, cout=96, k=3, n=3, h=29, w=23, stride=2, padding=1, offset_groups=8),
    "groups2-og3-5x5-dil2": dict(cin=48, cout=40, k=5, n=1, h=21, w=19, padding=4, dilation=2, groups=2,
                                 offset_groups=3),
}
ROUTES = ["kernels", "sample-in-step", "columns", "deterministic", "image-chunks", "narrow-groups"]
GPU_DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]


def _layer(case, dtype, seed, device="cpu"):
    """The layer and an input in dtype; the offset conv's output comes out as a new leaf each call (a forward hook,
    kept in layer.logits_leaves), so that the op's gradient with respect to it is taken alone."""
    torch.manual_seed(seed)
    cfg = dict(case)
    cin, cout, k, n, h, w = (cfg.pop(key) for key in ("cin", "cout", "k", "n", "h", "w"))
    layer = deformconv.ModulatedDeformConv2dPack(cin, cout, k, **cfg)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.5)  # offsets of a few pixels, logits of both signs
    torch.nn.init.normal_(layer.conv_offset.bias, std=1.0)
    layer = layer.to(device, dtype)
    layer.logits_leaves = []

    def leaf(module, inputs, output):
        layer.logits_leaves.append(output.detach().requires_grad_(True))
        return layer.logits_leaves[-1]

    layer.conv_offset.register_forward_hook(leaf)
    return layer, torch.randn(n, cin, h, w).to(device, dtype).requires_grad_(True)


def _reference(x, offset, weight, bias, stride, padding, dilation, mask):
    return deformconv.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask, backend="reference")


def _oracle(layer, x, out, gout, op=naive_deform_conv2d):
    """The op in float64 from the values ours computed on (the input, the offset conv's output, the weight, the
    bias, grad_out) as its definition reads: split, sigmoid, the naive op (or on the GPU the float64 reference,
    itself tested against it); gradients of the four."""
    x, out, weight, bias = (t.detach().double().requires_grad_(True) for t in (x, out, layer.weight, layer.bias))
    n_off = out.shape[1] * 2 // 3
    y = op(x, out[:, :n_off], weight, bias, layer.stride, layer.padding, layer.dilation,
           mask=torch.sigmoid(out[:, n_off:]))
    return [y, *torch.autograd.grad(y, [x, out, weight, bias], gout.double())]


def _route(route, forced, monkeypatch, kernels):
    forced(narrow_groups=route == "narrow-groups")  # grouped cases: the column kernels on that route only
    if route == "sample-in-step":
        forced(configs={"fwd": lambda c: dataclasses.replace(c, sample_ahead=False)})
    elif route == "columns":
        forced(columns_grad_weight=True, columns_grad_data=True)
    elif route == "image-chunks":
        forced(default_workspace_budget=0.0, min_chunk_programs=2)
        monkeypatch.setattr(kernels.schedule, "_chunked_weight_bytes", lambda *a: 0)
    elif route == "kernels":
        forced(configs={"fwd": lambda c: dataclasses.replace(c, sample_ahead=True)})


def _check_logits_route(case, dtype, route, forced, monkeypatch, device="cpu", op=naive_deform_conv2d):
    """Output and the gradients of the input, the offset conv's output (the offsets' and the logits'), the weight and
    the bias, with the logits route taken: no split, and the Call built for logits."""
    kernels = kernel_modules()
    monkeypatch.setenv("DEFORMCONV_BACKEND", "triton")
    forced()  # empty caches: this test's Call is the only one
    _route(route, forced, monkeypatch, kernels)
    from deformconv.ops.deform_conv2d.triton import call

    def no_split(*args):
        raise AssertionError("the offset conv output was split")

    monkeypatch.setattr(call, "split_into", no_split)
    layer, x = _layer(case, dtype, seed=len(str(case)), device=device)
    with deterministic_mode(route == "deterministic"):
        y = layer(x)
        gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        out = layer.logits_leaves[-1]
        ours = [y, *torch.autograd.grad(y, [x, out, layer.weight, layer.bias], gout)]
    assert type(y.grad_fn).__name__ == "PlannedCallBackward"
    from deformconv.config import options

    assert [c.logits for c in options.cache("dcn_eager").values() if c is not None] == [True]
    expected = _oracle(layer, x, out, gout, op)
    for name, a, b in zip(["output", "grad_input", "grad_offset_conv_output", "grad_weight", "grad_bias"], ours,
                          expected):
        assert a.dtype == dtype and a.is_contiguous(), name
        assert_close(a, b, dtype, name)


@requires_interpreter
@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(CASES))
def test_logits_read_in_place_match_the_oracle(backend, dtype, case, route, forced, monkeypatch):
    """The logits route under the interpreter against the naive float64 op."""
    _check_logits_route(CASES[case], dtype, route, forced, monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("route", ["kernels", "columns", "deterministic", "image-chunks"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_logits_read_in_place_on_the_gpu(dtype, route, case, forced, monkeypatch):
    """The logits route on the GPU, at a network's layer shapes and odd ones, against the float64 reference (fp32
    without TF32, as F.conv2d with cudnn.allow_tf32 = False: the kernels follow that switch)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    _check_logits_route(GPU_CASES[case], dtype, route, forced, monkeypatch, "cuda", _reference)


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_channels_last_output_takes_the_split_bit_for_bit(backend, dtype, monkeypatch):
    """A channels_last offset conv output (channels_last input) is not read in place: the planned Call splits it, and
    gives the split and the registered op's results bit for bit."""
    monkeypatch.setenv("DEFORMCONV_BACKEND", "triton")
    layer, x = _layer(CASES["packed-og2-stride2"], dtype, seed=5)
    x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    out = layer(x)
    assert layer.logits_leaves[-1].is_contiguous(memory_format=torch.channels_last)
    assert type(out.grad_fn).__name__ == "PlannedCallBackward"
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    params = [layer.logits_leaves[-1], layer.weight, layer.bias]
    planned = [out, *torch.autograd.grad(out, [x, *params], gout)]
    offset, mask = layer._split(params[0])
    ref = torch.ops.deformconv.deform_conv2d(x, offset, layer.weight, layer.bias, mask, [2, 2], [1, 1], [1, 1],
                                             "triton")
    two_step = [ref, *torch.autograd.grad(ref, [x, *params], gout)]
    for i, (a, b) in enumerate(zip(planned, two_step)):
        assert torch.equal(a, b), i
