"""ONNX export: deform_conv2d to the standard ``DeformConv`` operator (opset 19), with both of torch's exporters.

- The dynamo-based exporter (``torch.onnx.export(..., dynamo=True)``, the default): a model calling
  :func:`deformconv.deform_conv2d` or the modules exports as it is (the function emits the ``DeformConv`` node
  itself while exporting); a graph holding ``torch.ops.deformconv.deform_conv2d`` directly needs
  ``custom_translation_table=deformconv.onnx.translation_table()``, which :func:`export` passes.
- The TorchScript-based exporter (``dynamo=False``): a symbolic for the op is registered when deformconv is imported.

The other ops have no standard operator, and no exact decomposition is provided yet: exporting them raises. The
opset must be at least 19, the first with ``DeformConv``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

OPSET = 19  # the first opset with DeformConv

_NO_EXPORT = {
    "dcnv3": "DCNv3 has no ONNX operator",
    "dcnv4": "DCNv4 has no ONNX operator",
    "ms_deform_attn": "multi-scale deformable attention has no ONNX operator",
    "deform_roi_pool": "deformable RoI pooling has no ONNX operator",
    "deform_psroi_pool": "deformable position-sensitive RoI pooling has no ONNX operator",
}


def _attributes(input_channels: int, offset_channels: int, weight_shape: Sequence[int], stride, padding,
                dilation) -> Dict[str, Any]:
    """DeformConv's attributes from the op's arguments (channel counts are static in any exported graph)."""
    kh, kw = int(weight_shape[2]), int(weight_shape[3])
    return dict(dilations=[int(d) for d in dilation], group=int(input_channels) // int(weight_shape[1]),
                kernel_shape=[kh, kw], offset_group=int(offset_channels) // (2 * kh * kw),
                pads=[int(padding[0]), int(padding[1]), int(padding[0]), int(padding[1])],
                strides=[int(s) for s in stride])


def symbolic_deform_conv2d(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor],
                           mask: Optional[Tensor], stride, padding, dilation, out_shape) -> Tensor:
    """The ``DeformConv`` node, emitted while the dynamo-based exporter traces (functional.deform_conv2d calls it)."""
    attrs = _attributes(input.shape[1], offset.shape[1], weight.shape, stride, padding, dilation)
    return torch.onnx.ops.symbolic("::DeformConv", [input, weight, offset, bias, mask], attrs, dtype=input.dtype,
                                   shape=out_shape, version=OPSET)


def emits_symbolic() -> bool:
    """Whether a call should emit the ONNX node itself: inside the dynamo-based exporter (not the TorchScript one,
    which traces and uses the registered symbolic)."""
    return (torch.onnx.is_in_onnx_export() and not torch.jit.is_tracing()
            and getattr(torch.onnx, "ops", None) is not None and hasattr(torch.onnx.ops, "symbolic"))


def translation_table() -> Dict[Callable, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: deformconv's ops to ONNX (onnxscript
    functions; needs the onnxscript package)."""
    from onnxscript import opset19 as op

    def deform_conv2d(input, offset, weight, bias, mask, stride, padding, dilation, backend):
        attrs = _attributes(input.shape[1], offset.shape[1], weight.shape, stride, padding, dilation)
        return op.DeformConv(input, weight, offset, bias, mask, **attrs)

    table: Dict[Callable, Callable] = {torch.ops.deformconv.deform_conv2d.default: deform_conv2d}
    for name, why in _NO_EXPORT.items():
        def refuse(*args, _why=why, _name=name, **kwargs):
            raise NotImplementedError(f"deformconv.{_name} cannot be exported to ONNX: {_why} and no exact "
                                      f"decomposition into standard operators is provided yet")

        table[getattr(torch.ops.deformconv, name).default] = refuse
    return table


def export(model: torch.nn.Module, args: tuple, path: str | os.PathLike, *, opset: int = OPSET,
           dynamic_shapes: Any = None, check: bool = True, **kwargs) -> Any:
    r"""Export a model using deformconv to an ONNX file, its deformable convolutions as standard ``DeformConv`` nodes.

    Args:
        model (nn.Module): in eval mode, as for any export.
        args (tuple): example inputs.
        path (str or PathLike): the ``.onnx`` file to write.
        opset (int): the ONNX opset, at least 19 (the first with DeformConv). Default: 19.
        dynamic_shapes: as ``torch.onnx.export``'s (e.g. ``({0: "batch", 2: "h", 3: "w"},)``). Default: ``None``.
        check (bool): run ``onnx.checker.check_model`` on the file (needs the onnx package). Default: ``True``.
        kwargs: passed to ``torch.onnx.export``.

    Returns:
        torch's ``ONNXProgram``.

    Example::

        >>> import torch, deformconv, tempfile, os
        >>> net = deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1).eval()
        >>> path = os.path.join(tempfile.mkdtemp(), "dcn.onnx")
        >>> _ = deformconv.onnx.export(net, (torch.randn(1, 4, 16, 16),), path)  # doctest: +SKIP
    """
    if not isinstance(opset, int) or opset < OPSET:
        raise ValueError(f"opset must be >= {OPSET} (the first ONNX opset with DeformConv), got {opset!r}")
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    program = torch.onnx.export(model, args, dynamo=True, opset_version=opset, dynamic_shapes=dynamic_shapes,
                                custom_translation_table={**translation_table(), **table}, **kwargs)
    program.save(str(path))
    if check:
        import onnx

        onnx.checker.check_model(str(path), full_check=True)
    return program


# --- the TorchScript-based exporter --------------------------------------------------------------------


def _torchscript_symbolic(g, input, offset, weight, bias, mask, stride, padding, dilation, backend):
    from torch.onnx import symbolic_helper as sh

    stride, padding, dilation = (sh._get_const(v, "is", name) for v, name in ((stride, "stride"),
                                                                             (padding, "padding"),
                                                                             (dilation, "dilation")))
    x_sizes, w_sizes, o_sizes = (sh._get_tensor_sizes(t) for t in (input, weight, offset))
    if None in (x_sizes[1], o_sizes[1]) or None in w_sizes:
        raise NotImplementedError("DeformConv export needs static channel counts and weight shape")
    attrs = _attributes(x_sizes[1], o_sizes[1], w_sizes, stride, padding, dilation)
    if sh._is_none(bias):  # a zero bias where a mask follows (an optional input cannot be skipped here)
        bias = g.op("Constant", value_t=torch.zeros(int(w_sizes[0])))
        bias = g.op("CastLike", bias, input)
    inputs = [input, weight, offset, bias] + ([] if sh._is_none(mask) else [mask])
    return g.op("DeformConv", *inputs, dilations_i=attrs["dilations"], group_i=attrs["group"],
                kernel_shape_i=attrs["kernel_shape"], offset_group_i=attrs["offset_group"], pads_i=attrs["pads"],
                strides_i=attrs["strides"])


def _register_torchscript_symbolic() -> None:
    register = getattr(torch.onnx, "register_custom_op_symbolic", None)
    if register is not None:
        register("deformconv::deform_conv2d", _torchscript_symbolic, OPSET)


_register_torchscript_symbolic()
