"""nn.Modules: torchvision- and mmcv-compatible parameters and state_dicts; the Pack layers are a plain
convolution at initialisation."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, make_case, requires_cuda, requires_interpreter

import deformconv

torchvision = pytest.importorskip("torchvision")


def test_deform_conv2d_loads_torchvision_state_dict_and_matches():
    tv = torchvision.ops.DeformConv2d(6, 8, (3, 2), stride=(1, 2), padding=(1, 0), dilation=1, groups=2).double()
    ours = deformconv.DeformConv2d(6, 8, (3, 2), stride=(1, 2), padding=(1, 0), dilation=1, groups=2).double()
    assert set(tv.state_dict()) == set(ours.state_dict()) == {"weight", "bias"}
    ours.load_state_dict(tv.state_dict())
    args, kw = make_case(2, 6, 8, 7, 9, 3, 2, groups=2, offset_groups=3, stride=(1, 2), padding=(1, 0), seed=1)
    x, offset = args[0], args[1]
    torch.testing.assert_close(ours(x, offset, kw["mask"]), tv(x, offset, kw["mask"]), atol=1e-12, rtol=1e-12)


def test_deform_conv2d_without_bias():
    layer = deformconv.DeformConv2d(4, 4, 3, bias=False)
    assert layer.bias is None and set(layer.state_dict()) == {"weight"}
    assert "bias=False" in repr(layer)


def test_module_rejects_bad_channels():
    with pytest.raises(ValueError, match=r"in_channels must be a positive multiple of groups \(2\), got 5"):
        deformconv.DeformConv2d(5, 4, 3, groups=2)
    with pytest.raises(ValueError, match=r"in_channels \(6\) must be divisible by offset_groups, got offset_groups=4"):
        deformconv.DeformConv2dPack(6, 4, 3, offset_groups=4)


MMCV_KEYS = {"weight", "bias", "conv_offset.weight", "conv_offset.bias"}


@pytest.mark.parametrize("cls,per_tap", [(deformconv.DeformConv2dPack, 2), (deformconv.ModulatedDeformConv2dPack, 3)],
                         ids=["dcnv1", "dcnv2"])
def test_pack_state_dict_keys_and_shapes_are_mmcvs(cls, per_tap):
    layer = cls(8, 16, 3, padding=1, deform_groups=2)
    sd = layer.state_dict()
    assert set(sd) == MMCV_KEYS
    assert sd["conv_offset.weight"].shape == (2 * per_tap * 9, 8, 3, 3)
    assert layer.offset_groups == layer.deform_groups == 2
    # An mmcv checkpoint (same keys and shapes) loads strictly; so does an old `conv_offset_mask` one.
    fresh = cls(8, 16, 3, padding=1, offset_groups=2)
    fresh.load_state_dict({k: torch.randn_like(v) for k, v in sd.items()})
    old = {k.replace("conv_offset.", "conv_offset_mask."): v for k, v in sd.items()}
    fresh.load_state_dict(old)
    torch.testing.assert_close(fresh.conv_offset.weight, sd["conv_offset.weight"])


@pytest.mark.parametrize("stride,padding,dilation", [(1, 1, 1), (2, 2, 2), ((1, 2), (0, 1), (2, 1))],
                         ids=["s1", "s2d2", "mixed"])
def test_pack_layers_are_plain_convs_at_init(stride, padding, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 11, 10, dtype=torch.float64)
    v1 = deformconv.DeformConv2dPack(4, 6, 3, stride, padding, dilation, offset_groups=2).double()
    conv = F.conv2d(x, v1.weight, v1.bias, stride, padding, dilation)
    torch.testing.assert_close(v1(x), conv, atol=1e-12, rtol=1e-12)
    v2 = deformconv.ModulatedDeformConv2dPack(4, 6, 3, stride, padding, dilation).double()
    conv2 = F.conv2d(x, v2.weight, None, stride, padding, dilation)
    torch.testing.assert_close(v2(x), 0.5 * conv2 + v2.bias[None, :, None, None], atol=1e-12, rtol=1e-12)


def test_modulated_pack_learns_offsets_and_mask():
    """Gradients reach conv_offset (offsets and mask), so the layer can learn where to look."""
    torch.manual_seed(0)
    layer = deformconv.ModulatedDeformConv2dPack(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    layer(x).square().sum().backward()
    g = layer.conv_offset.weight.grad
    assert g is not None and g[:18].abs().sum() > 0 and g[18:].abs().sum() > 0
    offset, mask = layer.offset_and_mask(x)
    assert offset.shape == (2, 18, 8, 8) and mask.shape == (2, 9, 8, 8)
    torch.testing.assert_close(mask, torch.full_like(mask, 0.5))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("device,backend", [("cpu", "cpu"), pytest.param("cpu", "triton", marks=requires_interpreter),
                                            pytest.param("cuda", "auto", marks=requires_cuda)],
                         ids=["cpu", "interpreter", "cuda"])
def test_modulated_pack_eager_nodes_equal_torchs_ops(monkeypatch, channels_last, autocast, device, backend):
    """A modulated layer's eager forward takes its offset conv's output into one autograd node (split and op:
    ops/deform_conv2d/eager.py: modulated_from_offset_conv); where that does not apply, the split is one node
    (split_offset_mask) beside the op's. Both give the output and every gradient of torch's own slices and sigmoid;
    offset_and_mask's split node too, also where only the mask or only the offset is used, within the dtype's
    rounding."""
    if backend == "triton" and autocast:
        pytest.skip("bfloat16 under Triton's interpreter runs on the cpu backend")
    monkeypatch.setenv("DEFORMCONV_BACKEND", backend)
    torch.manual_seed(0)
    layer = deformconv.ModulatedDeformConv2dPack(4, 5, 3, stride=2, padding=1, offset_groups=2).to(device)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.3)
    torch.nn.init.normal_(layer.conv_offset.bias, std=0.3)
    x = torch.randn(2, 4, 9, 11, device=device)
    if channels_last:
        x, layer = x.contiguous(memory_format=torch.channels_last), layer.to(memory_format=torch.channels_last)
    gout = torch.randn(2, 5, 5, 6, device=device)
    from deformconv.ops.deform_conv2d import eager

    one_node, split_node = eager.modulated_from_offset_conv, deformconv.deform_conv.split_offset_mask

    def run(fused, split):
        monkeypatch.setattr(eager, "modulated_from_offset_conv", fused)
        monkeypatch.setattr(deformconv.deform_conv, "split_offset_mask", split)
        leaves = [x.clone().requires_grad_(True), *layer.parameters()]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = layer(leaves[0])
            offset, mask = layer.offset_and_mask(leaves[0])
        node = type(out.grad_fn).__name__
        grads = torch.autograd.grad(out, leaves, gout.to(out.dtype))
        only_mask = torch.autograd.grad(mask.float().square().sum(), leaves[0], retain_graph=True)
        only_offset = torch.autograd.grad(offset.float().square().sum(), leaves[0])
        return node, (out, offset, mask, *grads, *only_mask, *only_offset)

    node, fused = run(one_node, split_node)
    # on the Triton kernels, the per-signature path (ops/deform_conv2d/eager.py: _planned) takes the same output in
    # its one node
    expected = "PlannedCallBackward" if backend in ("triton", "auto") else "ModulatedDeformConv2dFunctionBackward"
    assert node == expected, node
    _, split = run(lambda *args: None, split_node)
    _, plain = run(lambda *args: None, lambda out, n_off: None)
    assert split[1].is_contiguous() and split[2].is_contiguous()
    # Within rounding, not bitwise: the paths hand the offset conv gradients laid out differently, and a CPU GEMM
    # picks its blocking by layout and thread count (a channels-last case differed by 3e-8 in 19 of 300 elements);
    # on a GPU grad_input's float atomics add in any order.
    # Tolerances by the dtype computed in (bf16 under autocast, whatever the result's dtype): where the kernels read
    # the offset conv output as logits (NCHW on the GPU), the mask is the sigmoid of the bf16 logit in fp32, not a
    # bf16 sigmoid, and every result differs from torch's ops by bf16's rounding
    for i, (a, b, c) in enumerate(zip(fused, split, plain)):
        assert_close(a, c, torch.bfloat16 if autocast else a.dtype, f"one node, result {i}")
        assert_close(b, c, torch.bfloat16 if autocast else b.dtype, f"split node, result {i}")


def test_modulated_pack_one_node_takes_the_offset_convs_output():
    """The eager layer's node reads the offset conv's output directly (no split node between them), in training and
    without gradients alike the output is the two-step one; under autocast an offset conv output that is not in
    the autocast dtype takes the two-step path (its split runs before the cast)."""
    from deformconv.ops.deform_conv2d import eager

    torch.manual_seed(1)
    layer = deformconv.ModulatedDeformConv2dPack(3, 4, 3, padding=1)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.3)
    x = torch.randn(2, 3, 7, 6)
    out = layer(x)
    assert [type(f).__name__ for f, _ in out.grad_fn.next_functions[:4]] == [
        "NoneType", "ConvolutionBackward0", "AccumulateGrad", "AccumulateGrad"]
    offset, mask = layer.offset_and_mask(x)
    two_step = deformconv.deform_conv2d(x, offset, layer.weight, layer.bias, 1, 1, 1, mask)
    torch.testing.assert_close(out, two_step, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), two_step, atol=0, rtol=0)
    om = torch.randn(2, 27, 7, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert eager.modulated_from_offset_conv(x, om, 18, layer.weight, layer.bias, [1, 1], [1, 1], [1, 1]) is None
