"""make_deformable and resnet_stages: which convolutions are replaced, with their weights, and what comes out."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deformconv

torchvision = pytest.importorskip("torchvision")


def _dcn_names(model, cls=deformconv.ModulatedDeformConv2dPack):
    return [name for name, m in model.named_modules() if isinstance(m, cls)]


@pytest.mark.parametrize("stages,count", [((False, True, True, True), 13), ((False, False, False, True), 3),
                                          ((True, True, True, True), 16), ((False, False, False, False), 0)])
def test_resnet50_stages_as_mmdetection(stages, count):
    """stage_with_dcn picks the 3x3 conv2 of every Bottleneck in the flagged stages (ResNet-50: 3, 4, 6, 3 blocks)."""
    net = torchvision.models.resnet50()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a selection gives no warning
        if count:
            deformconv.make_deformable(net, deformconv.resnet_stages(stages))
        else:
            with pytest.warns(UserWarning, match="selected no nn.Conv2d in the ResNet; nothing was changed"):
                deformconv.make_deformable(net, deformconv.resnet_stages(stages))
    names = _dcn_names(net)
    assert len(names) == count
    assert all(name.endswith(".conv2") for name in names)
    flagged = {f"layer{i + 1}" for i, f in enumerate(stages) if f}
    assert {name.split(".")[0] for name in names} == flagged
    plain = [n for n, m in net.named_modules() if type(m) is nn.Conv2d and m.kernel_size == (3, 3)
             and not n.endswith("conv_offset")]
    assert len(plain) == 16 - count
    first = net.layer4[0].conv2 if stages[3] else None
    if first is not None:  # the stride-2 first block keeps its stride
        assert first.stride == (2, 2) and first.padding == (1, 1)


def test_converted_network_starts_as_the_original():
    """DCNv1 with its zero-initialised offset conv samples the regular grid: the converted ResNet computes what the
    original did (float64), weights copied, state_dict keys mmcv's; a wrapper's nested backbone is matched too."""
    torch.manual_seed(0)
    net = torchvision.models.resnet18().double().eval()
    wrapper = nn.ModuleDict({"backbone": net})
    x = torch.randn(2, 3, 45, 37, dtype=torch.float64)
    before = net(x)
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    deformconv.make_deformable(wrapper, deformconv.resnet_stages((False, True, True, True)), modulated=False)
    names = _dcn_names(wrapper, deformconv.DeformConv2dPack)
    assert names == [f"backbone.layer{i}.{j}.conv2" for i in (2, 3, 4) for j in (0, 1)]
    torch.testing.assert_close(net(x), before, atol=1e-10, rtol=1e-10)
    state = net.state_dict()
    for key, value in weights.items():
        assert torch.equal(state[key], value), key
    assert torch.count_nonzero(state["layer2.0.conv2.conv_offset.weight"]) == 0
    assert state["layer2.0.conv2.conv_offset.weight"].shape == (18, 128, 3, 3)


@pytest.mark.parametrize("groups,stride,dilation,padding,bias", [(1, 1, 1, 1, True), (2, 2, 1, 1, False),
                                                                   (1, 1, 2, "same", True), (4, 1, 1, "valid", True)])
def test_dcnv2_layer_is_half_the_convolution_at_first(groups, stride, dilation, padding, bias):
    """Any predicate: a selected conv becomes a DCNv2 layer of its geometry, equal at first to 0.5 x the conv's
    weighted sum plus its bias (the initial mask is sigmoid(0) = 0.5)."""
    torch.manual_seed(1)
    conv = nn.Conv2d(8, 12, 3, stride=stride, dilation=dilation, padding=padding, groups=groups, bias=bias).double()
    model = nn.Sequential(conv)
    x = torch.randn(2, 8, 11, 13, dtype=torch.float64)
    plain = F.conv2d(x, conv.weight, None, conv.stride, conv.padding if isinstance(conv.padding, tuple) else padding,
                     conv.dilation, groups)
    deformconv.make_deformable(model, lambda name, m: name == "0")
    layer = model[0]
    assert isinstance(layer, deformconv.ModulatedDeformConv2dPack) and layer.weight.dtype == torch.float64
    expected = 0.5 * plain + (conv.bias[None, :, None, None] if bias else 0)
    torch.testing.assert_close(layer(x), expected, atol=1e-12, rtol=1e-12)


def test_default_predicate_takes_every_3x3_and_only_plain_convs():
    class MyConv(nn.Conv2d):
        pass

    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), MyConv(4, 4, 3, padding=1),
                          nn.Conv2d(4, 4, (3, 5), padding=(1, 2)))
    deformconv.make_deformable(model, offset_groups=2)
    assert [type(m).__name__ for m in model] == ["ModulatedDeformConv2dPack", "Conv2d", "MyConv", "Conv2d"]
    assert model[0].offset_groups == 2 and model[0].conv_offset.out_channels == 3 * 2 * 9


def test_a_predicate_that_selects_nothing_warns():
    """resnet_stages on a backbone whose blocks are named otherwise (Detectron2's res3.0.conv2) changes nothing, and
    says so."""
    net = nn.Sequential()
    net.add_module("res3", nn.Sequential(nn.Module()))
    net.res3[0].conv2 = nn.Conv2d(8, 8, 3, padding=1)
    with pytest.warns(UserWarning, match="selected no nn.Conv2d in the Sequential"):
        assert deformconv.make_deformable(net, deformconv.resnet_stages()) is net
    assert type(net.res3[0].conv2) is nn.Conv2d


def test_bad_requests_name_the_layer():
    with pytest.raises(ValueError, match=r"0 has padding_mode='reflect'"):
        deformconv.make_deformable(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")))
    with pytest.raises(ValueError, match=r"offset_groups \(3\) must divide 0's in_channels \(4\)"):
        deformconv.make_deformable(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), offset_groups=3)
    with pytest.raises(ValueError, match="offset_groups must be a positive int"):
        deformconv.make_deformable(nn.Sequential(), offset_groups=0)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        deformconv.make_deformable("resnet50")
