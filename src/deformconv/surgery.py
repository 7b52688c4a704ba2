"""Model surgery: turn a model's convolutions into deformable ones, keeping their weights."""

from __future__ import annotations

import re
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .deform_conv import DeformConv2dPack, ModulatedDeformConv2dPack

Predicate = Callable[[str, nn.Conv2d], bool]


def is_3x3(name: str, conv: nn.Conv2d) -> bool:
    """The default predicate: every 3×3 convolution."""
    return tuple(conv.kernel_size) == (3, 3)


def resnet_stages(stage_with_dcn: Sequence[bool] = (False, True, True, True)) -> Predicate:
    """A predicate for ResNet-style models (torchvision's ResNet, and any model that contains one, e.g. a detection
    backbone): the 3×3 convolution of every block (``layer{i}.{block}.conv2``) in the stages whose flag is set, as
    mmdetection's ``stage_with_dcn`` (``(False, True, True, True)``: stages c3-c5, i.e. layer2-layer4).

    Args:
        stage_with_dcn (Sequence[bool]): one flag per stage, layer1 first. Default: ``(False, True, True, True)``.
    """
    flags = tuple(bool(f) for f in stage_with_dcn)
    pattern = re.compile(r"(?:^|\.)layer(\d+)\.\d+\.conv2$")

    def predicate(name: str, conv: nn.Conv2d) -> bool:
        match = pattern.search(name)
        if match is None or tuple(conv.kernel_size) != (3, 3):
            return False
        stage = int(match.group(1))
        return 1 <= stage <= len(flags) and flags[stage - 1]

    return predicate


def _padding(conv: nn.Conv2d, name: str):
    if conv.padding_mode != "zeros":
        raise ValueError(f"make_deformable: {name} has padding_mode={conv.padding_mode!r}; only 'zeros' padding "
                         f"has a deformable counterpart")
    if isinstance(conv.padding, str):  # "valid" or "same" (stride 1, as torch requires)
        if conv.padding == "valid":
            return (0, 0)
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in total):
            raise ValueError(f"make_deformable: {name} has padding='same' with an even effective kernel "
                             f"(dilation*(kernel-1) = {total}), which pads unevenly; deformable layers pad evenly")
        return tuple(t // 2 for t in total)
    return tuple(conv.padding)


def make_deformable(model: nn.Module, predicate: Optional[Predicate] = None, *, modulated: bool = True,
                    offset_groups: int = 1) -> nn.Module:
    r"""Replace the ``nn.Conv2d`` layers of ``model`` that ``predicate`` selects by deformable ones, in place.

    Each selected convolution becomes a :class:`ModulatedDeformConv2dPack` (DCNv2) or, with ``modulated=False``, a
    :class:`DeformConv2dPack` (DCNv1) of the same geometry (kernel, stride, padding, dilation, groups, bias), with the
    convolution's weight and bias copied, on its device and in its dtype, and a zero-initialised offset conv: at
    first the layer samples the regular grid (DCNv1: exactly the convolution; DCNv2: the convolution's weight times
    the initial mask of 0.5, plus its bias). Train it with the offset conv's learning rate lowered (DCNv2 uses 0.1×).

    Args:
        model (nn.Module): the model to change (in place; also returned).
        predicate (Callable[[str, nn.Conv2d], bool], optional): which convolutions to replace, given their qualified
            name in ``model`` and the module; e.g. :func:`resnet_stages`. Default: every 3×3 convolution.
        modulated (bool): DCNv2 (offsets and mask) if True, DCNv1 (offsets) if False. Default: ``True``.
        offset_groups (int): offset fields per layer; must divide each selected layer's input channels. Default: 1.

    Returns:
        nn.Module: ``model``, changed. A ``UserWarning`` says so where the predicate selected nothing.

    Example::

        >>> import torch, torchvision, deformconv
        >>> net = torchvision.models.resnet50()
        >>> deformconv.make_deformable(net, deformconv.resnet_stages((False, True, True, True)))
        ResNet(...)
        >>> sum(isinstance(m, deformconv.ModulatedDeformConv2dPack) for m in net.modules())
        13
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_deformable: model must be an nn.Module, got {type(model).__name__}")
    if isinstance(offset_groups, bool) or not isinstance(offset_groups, int) or offset_groups <= 0:
        raise ValueError(f"make_deformable: offset_groups must be a positive int, got {offset_groups!r}")
    predicate = predicate or is_3x3
    cls = ModulatedDeformConv2dPack if modulated else DeformConv2dPack
    chosen = [(name, m) for name, m in model.named_modules()
              if type(m) is nn.Conv2d and predicate(name, m)]  # subclasses (quantised, LoRA...) are left alone
    if not chosen:  # most often a predicate written for other module names (e.g. resnet_stages on res3.0.conv2)
        warnings.warn(f"make_deformable: the predicate selected no nn.Conv2d in the {type(model).__name__}; "
                      f"nothing was changed", stacklevel=2)
    for name, conv in chosen:
        if conv.in_channels % offset_groups:
            raise ValueError(f"make_deformable: offset_groups ({offset_groups}) must divide {name}'s in_channels "
                             f"({conv.in_channels})")
        layer = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, _padding(conv, name),
                    conv.dilation, conv.groups, offset_groups, bias=conv.bias is not None)
        layer = layer.to(device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(conv.weight)
            if conv.bias is not None:
                layer.bias.copy_(conv.bias)
        layer.train(conv.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    return model
