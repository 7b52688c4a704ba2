"""ONNX export: deform_conv2d to the standard ``DeformConv`` operator (opset 19), with both of torch's exporters.

- The dynamo-based exporter (``torch.onnx.export(..., dynamo=True)``, the default): a model calling
  :func:`deformconv.deform_conv2d` or the modules exports as it is (the function emits the ``DeformConv`` node
  itself while exporting); a graph holding ``torch.ops.deformconv.deform_conv2d`` directly needs
  ``custom_translation_table=deformconv.onnx.translation_table()``, which :func:`export` passes.
- The TorchScript-based exporter (``dynamo=False``): a symbolic for the op is registered when deformconv is imported.

DCNv3, DCNv4, multi-scale deformable attention and deformable RoI pooling with a fixed sample grid export as exact
decompositions into standard operators (:func:`translation_table`; their modules need it, which :func:`export`
passes). Deformable RoI pooling with adaptive sampling (sampling_ratio=0) takes a number of samples that depends on
the RoIs' values, and the position-sensitive variant has no decomposition yet: exporting them raises, saying so. The
opset must be at least 19, the first with ``DeformConv``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Sequence

import torch
from torch import Tensor

from .compat import onnx_export_flag

OPSET = 19  # the first opset with DeformConv
_exporting = onnx_export_flag()

_NO_EXPORT = {
    "deform_psroi_pool": "deformable position-sensitive RoI pooling has no ONNX operator",
    **{f"deform_conv_transpose{r}d": "the transposed deformable convolution has no ONNX operator" for r in (1, 2, 3)},
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
    return (_exporting() and not torch.jit.is_tracing()
            and getattr(torch.onnx, "ops", None) is not None and hasattr(torch.onnx.ops, "symbolic"))


def translation_table() -> Dict[Callable, Callable]:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: deformconv's ops to standard ONNX
    operators (onnxscript functions; needs the onnxscript package). deform_conv2d is one ``DeformConv``; DCNv3 and
    DCNv4 are an exact depthwise ``DeformConv`` (group = channels, a weight of ones, offset group = the op's group,
    the aggregation weights as the mask, the offsets reordered to (dy, dx) row-major taps with offset_scale applied);
    multi-scale deformable attention is one ``GridSample`` a level (align_corners=0, zeros: its definition) weighted
    and summed; deformable RoI pooling with sampling_ratio > 0 is one ``GridSample`` over each RoI's image
    (align_corners=1, border: RoIAlign's clamping) masked and averaged. deform_conv1d is a 2-D ``DeformConv`` over a
    unit height (onnxruntime runs it); deform_conv3d the standard's N-d ``DeformConv``, which onnxruntime (1.32) does
    not run: it takes 4-D inputs only. Adaptive sampling, the position-sensitive variant and the transposed forms (no
    ONNX operator) raise."""
    from onnxscript import opset19 as op

    def deform_conv2d(input, offset, weight, bias, mask, stride, padding, dilation, backend):
        attrs = _attributes(input.shape[1], offset.shape[1], weight.shape, stride, padding, dilation)
        return op.DeformConv(input, weight, offset, bias, mask, **attrs)

    def dcnv3(input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center,
              backend):
        return _dcn_as_deform_conv(op, input, offset, mask, kernel, stride, pad, dilation, group, group_channels,
                                   offset_scale, remove_center)

    def dcnv4(input, offset_mask, kernel, stride, pad, dilation, group, group_channels, offset_scale, remove_center,
              backend):
        points = kernel[0] * kernel[1] - int(remove_center)
        blocks = op.Reshape(op.Slice(offset_mask, op.Constant(value_ints=[0]),
                                     op.Constant(value_ints=[3 * group * points]), op.Constant(value_ints=[3])),
                            op.Constant(value_ints=[0, 0, 0, group, 3 * points]))
        offset = op.Slice(blocks, op.Constant(value_ints=[0]), op.Constant(value_ints=[2 * points]),
                          op.Constant(value_ints=[4]))
        mask = op.Slice(blocks, op.Constant(value_ints=[2 * points]), op.Constant(value_ints=[3 * points]),
                        op.Constant(value_ints=[4]))
        return _dcn_as_deform_conv(op, input, op.Reshape(offset, op.Constant(value_ints=[0, 0, 0, -1])),
                                   op.Reshape(mask, op.Constant(value_ints=[0, 0, 0, -1])), kernel, stride, pad,
                                   dilation, group, group_channels, offset_scale, remove_center)

    def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend):
        return _msda_as_grid_sample(op, value, spatial_shapes, level_start_index, sampling_locations,
                                    attention_weights)

    def deform_roi_pool(input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma, backend):
        if sampling_ratio <= 0:
            raise NotImplementedError(
                "deformconv.deform_roi_pool with sampling_ratio=0 cannot be exported to ONNX: each bin then takes "
                "ceil(roi size / bins) samples along each axis, a number that depends on the RoIs' values, which no "
                "static ONNX graph reproduces exactly (set the module's sampling_ratio > 0, e.g. 2, to export)")
        return _roi_pool_as_grid_sample(op, input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma)

    def deform_conv1d(input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend):
        return _deform_conv1d_as_2d(op, input, offset, weight, bias, mask, stride, padding, dilation)

    def deform_conv3d(input, offset, weight, bias, mask, stride, padding, dilation, output_padding, groups, backend):
        k = [int(v) for v in weight.shape[2:]]
        attrs = dict(dilations=[int(d) for d in dilation], group=int(input.shape[1]) // int(weight.shape[1]),
                     kernel_shape=k, offset_group=int(offset.shape[1]) // (3 * k[0] * k[1] * k[2]),
                     pads=[int(p) for p in padding] * 2, strides=[int(v) for v in stride])
        return op.DeformConv(input, weight, offset, bias, mask, **attrs)

    table: Dict[Callable, Callable] = {torch.ops.deformconv.deform_conv2d.default: deform_conv2d,
                                       torch.ops.deformconv.deform_conv1d.default: deform_conv1d,
                                       torch.ops.deformconv.deform_conv3d.default: deform_conv3d,
                                       torch.ops.deformconv.dcnv3.default: dcnv3,
                                       torch.ops.deformconv.dcnv4.default: dcnv4,
                                       torch.ops.deformconv.ms_deform_attn.default: ms_deform_attn,
                                       torch.ops.deformconv.deform_roi_pool.default: deform_roi_pool}
    for name, why in _NO_EXPORT.items():
        def refuse(*args, _why=why, _name=name, **kwargs):
            raise NotImplementedError(f"deformconv.{_name} cannot be exported to ONNX: {_why} and no exact "
                                      f"decomposition into standard operators is provided yet")

        table[getattr(torch.ops.deformconv, name).default] = refuse
    return table


def _deform_conv1d_as_2d(op, input, offset, weight, bias, mask, stride, padding, dilation):
    """deform_conv1d as a 2-D DeformConv over a unit height: the input, weight, offsets and mask given an axis of
    size 1, each tap's offset paired with a zero dy."""
    axis = op.Constant(value_ints=[2])
    kw = int(weight.shape[2])
    taps = int(offset.shape[1])  # offset groups · kw
    dx = op.Unsqueeze(op.Unsqueeze(offset, axis), axis)  # [N, G·kw, 1, 1, Wo]
    dy = op.CastLike(op.ConstantOfShape(op.Shape(dx)), dx)
    pairs = op.Reshape(op.Concat(dy, dx, axis=2), op.Constant(value_ints=[0, 2 * taps, 1, -1]))
    attrs = dict(dilations=[1, int(dilation[0])], group=int(input.shape[1]) // int(weight.shape[1]),
                 kernel_shape=[1, kw], offset_group=taps // kw, pads=[0, int(padding[0]), 0, int(padding[0])],
                 strides=[1, int(stride[0])])
    out = op.DeformConv(op.Unsqueeze(input, axis), op.Unsqueeze(weight, axis), pairs, bias,
                        None if mask is None else op.Unsqueeze(mask, axis), **attrs)
    return op.Squeeze(out, axis)


def _dcn_as_deform_conv(op, input, offset, mask, kernel, stride, pad, dilation, group, group_channels, offset_scale,
                        remove_center):
    """DCNv3's core as a depthwise DeformConv (deformconv.dcnv3_to_deform_conv2d's conversion, in ONNX operators)."""
    import numpy as np
    from onnxscript import ir

    from .ops.dcnv.geometry import DcnGeometry

    kh, kw = kernel
    geo = DcnGeometry(1, 1, 1, group, group_channels, (kh, kw), tuple(stride), tuple(pad), tuple(dilation),
                      float(offset_scale), bool(remove_center))
    taps, channels = geo.taps(), group * group_channels
    points = len(taps)
    ch, cw = (dilation[0] * (kh - 1)) // 2, (dilation[1] * (kw - 1)) // 2
    order = [points] * (kh * kw)  # DeformConv's row-major tap t reads DCNv3's point order[t] (points: a zero one)
    for k, (i, j) in enumerate(taps):
        order[j * kw + i] = k
    spread = offset_scale - 1
    base = np.array([((t // kw * dilation[0] - ch) * spread, (t % kw * dilation[1] - cw) * spread)
                     for t in range(kh * kw)], np.float32)  # the taps' spread scaled: DCNv3 scales it, DeformConv not
    off = op.Reshape(offset, op.Constant(value_ints=[0, 0, 0, group, points, 2]))
    off = op.Pad(off, op.Constant(value_ints=[0] * 10 + [1, 0]))  # the zero point
    off = op.Gather(op.Gather(off, op.Constant(value_ints=order), axis=4), op.Constant(value_ints=[1, 0]), axis=5)
    off = op.Add(op.Mul(off, op.CastLike(op.Constant(value_float=float(offset_scale)), off)),
                 op.CastLike(op.Constant(value=ir.tensor(base)), off))
    off = op.Transpose(op.Reshape(off, op.Constant(value_ints=[0, 0, 0, -1])), perm=[0, 3, 1, 2])
    m = op.Reshape(mask, op.Constant(value_ints=[0, 0, 0, group, points]))
    m = op.Gather(op.Pad(m, op.Constant(value_ints=[0] * 9 + [1])), op.Constant(value_ints=order), axis=4)
    m = op.Transpose(op.Reshape(m, op.Constant(value_ints=[0, 0, 0, -1])), perm=[0, 3, 1, 2])
    ones = op.CastLike(op.Constant(value=ir.tensor(np.ones((channels, 1, kh, kw), np.float32))), input)
    y = op.DeformConv(op.Transpose(input, perm=[0, 3, 1, 2]), ones, off, None, m, dilations=list(dilation),
                      group=channels, kernel_shape=[kh, kw], offset_group=group,
                      pads=[pad[0], pad[1], pad[0], pad[1]], strides=list(stride))
    return op.Transpose(y, perm=[0, 2, 3, 1])


def _msda_as_grid_sample(op, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    """Multi-scale deformable attention as GridSample a level, the levels' sizes read from the shape tensors."""
    n_heads, head_dim = value.shape[2], value.shape[3]
    levels, points = sampling_locations.shape[3], sampling_locations.shape[4]
    out = None
    for lvl in range(levels):
        shape = op.Gather(spatial_shapes, op.Constant(value_int=lvl), axis=0)  # (H, W)
        start = op.Gather(level_start_index, op.Constant(value_ints=[lvl]), axis=0)
        size = op.ReduceProd(shape, keepdims=1)
        v = op.Slice(value, start, op.Add(start, size), op.Constant(value_ints=[1]))  # [N, HW, M, D]
        v = op.Transpose(v, perm=[0, 2, 3, 1])  # [N, M, D, HW]
        v = op.Reshape(v, op.Concat(op.Constant(value_ints=[-1, head_dim]), shape, axis=0))  # [N·M, D, H, W]
        loc = op.Gather(sampling_locations, op.Constant(value_int=lvl), axis=3)  # [N, Lq, M, P, 2]
        loc = op.Transpose(loc, perm=[0, 2, 1, 3, 4])  # [N, M, Lq, P, 2]
        loc = op.Reshape(loc, op.Concat(op.Constant(value_ints=[-1]), op.Shape(loc, start=2, end=3),
                                        op.Constant(value_ints=[points, 2]), axis=0))  # [N·M, Lq, P, 2]
        grid = op.Sub(op.Mul(loc, op.CastLike(op.Constant(value_float=2.0), loc)),
                      op.CastLike(op.Constant(value_float=1.0), loc))
        sampled = op.GridSample(v, op.CastLike(grid, v), align_corners=0, mode="bilinear", padding_mode="zeros")
        a = op.Gather(attention_weights, op.Constant(value_int=lvl), axis=3)  # [N, Lq, M, P]
        a = op.Reshape(op.Transpose(a, perm=[0, 2, 1, 3]), op.Constant(value_ints=[-1, 1, 0, points]))
        term = op.ReduceSum(op.Mul(sampled, a), op.Constant(value_ints=[3]), keepdims=0)  # [N·M, D, Lq]
        out = term if out is None else op.Add(out, term)
    out = op.Reshape(out, op.Concat(op.Constant(value_ints=[-1, n_heads * head_dim]),
                                    op.Shape(out, start=2, end=3), axis=0))  # [N, M·D, Lq]
    return op.Transpose(out, perm=[0, 2, 1])


def _roi_pool_as_grid_sample(op, input, rois, offset, output_size, spatial_scale, sampling_ratio, gamma):
    """Deformable RoI pooling with a fixed sample grid (g = sampling_ratio along each axis) as one GridSample over
    each RoI's image: align_corners=1 and border padding clamp a sample into the image as RoIAlign does, a mask
    zeroes the samples outside [-1, size], and each bin is the mean of its g² samples."""
    ph, pw = output_size
    g = sampling_ratio

    def column(k):  # rois[:, k] as [R, 1, 1, 1, 1]
        return op.Reshape(op.Gather(rois, op.Constant(value_int=k), axis=1), op.Constant(value_ints=[-1, 1, 1, 1, 1]))

    def const(v, like):
        return op.CastLike(op.Constant(value_float=float(v)), like)

    half, scale = const(0.5, rois), const(spatial_scale, rois)
    x1 = op.Sub(op.Mul(column(1), scale), half)
    y1 = op.Sub(op.Mul(column(2), scale), half)
    roi_w = op.Sub(op.Sub(op.Mul(column(3), scale), half), x1)
    roi_h = op.Sub(op.Sub(op.Mul(column(4), scale), half), y1)
    # sample (i, iy, j, ix) of bin (i, j): along y, i + (iy + 0.5) / g bins from the start; likewise x
    steps_y = [[[[i + (iy + 0.5) / g]] for iy in range(g)] for i in range(ph)]  # [ph, g, 1, 1]
    steps_x = [[(j + (ix + 0.5) / g) for ix in range(g)] for j in range(pw)]     # [pw, g]
    import numpy as np
    from onnxscript import ir

    sy = op.CastLike(op.Constant(value=ir.tensor(np.array(steps_y, np.float32))), rois)
    sx = op.CastLike(op.Constant(value=ir.tensor(np.array(steps_x, np.float32))), rois)
    y = op.Add(y1, op.Mul(sy, op.Div(roi_h, const(ph, rois))))  # [R, ph, g, 1, 1]
    x = op.Add(x1, op.Mul(sx, op.Div(roi_w, const(pw, rois))))  # [R, 1, 1, pw, g]
    if offset is not None:  # bin (i, j) moves by gamma · (roi_w, roi_h) · offset[:, :, i, j]
        off = op.CastLike(offset, rois)
        ox = op.Unsqueeze(op.Gather(off, op.Constant(value_int=0), axis=1), op.Constant(value_ints=[2, 4]))
        oy = op.Unsqueeze(op.Gather(off, op.Constant(value_int=1), axis=1), op.Constant(value_ints=[2, 4]))
        x = op.Add(x, op.Mul(op.Mul(const(gamma, rois), roi_w), ox))  # [R, ph, 1, pw, g]
        y = op.Add(y, op.Mul(op.Mul(const(gamma, rois), roi_h), oy))
    both = op.Shape(op.Add(y, x))  # [R, ph, g, pw, g]
    y, x = op.Expand(y, both), op.Expand(x, both)
    size = op.Cast(op.Shape(input, start=2, end=4), to=ir.DataType.FLOAT)  # (H, W)
    h = op.CastLike(op.Gather(size, op.Constant(value_int=0), axis=0), rois)
    w = op.CastLike(op.Gather(size, op.Constant(value_int=1), axis=0), rois)
    minus_one = const(-1.0, rois)
    valid = op.And(op.And(op.GreaterOrEqual(y, minus_one), op.LessOrEqual(y, h)),
                   op.And(op.GreaterOrEqual(x, minus_one), op.LessOrEqual(x, w)))
    one = const(1.0, rois)
    gx = op.Sub(op.Mul(op.Div(x, op.Max(op.Sub(w, one), one)), const(2.0, rois)), one)  # align_corners=1
    gy = op.Sub(op.Mul(op.Div(y, op.Max(op.Sub(h, one), one)), const(2.0, rois)), one)
    grid = op.Concat(op.Unsqueeze(gx, op.Constant(value_ints=[-1])), op.Unsqueeze(gy, op.Constant(value_ints=[-1])),
                     axis=-1)
    grid = op.Reshape(grid, op.Constant(value_ints=[-1, ph * g, pw * g, 2]))
    batch = op.Cast(op.Gather(rois, op.Constant(value_int=0), axis=1), to=ir.DataType.INT64)
    feats = op.Gather(input, batch, axis=0)  # [R, C, H, W]
    sampled = op.GridSample(feats, op.CastLike(grid, feats), align_corners=1, mode="bilinear",
                            padding_mode="border")  # [R, C, ph·g, pw·g]
    keep = op.CastLike(op.Reshape(valid, op.Constant(value_ints=[-1, 1, ph * g, pw * g])), sampled)
    bins = op.Concat(op.Constant(value_ints=[-1]), op.Shape(sampled, start=1, end=2),
                     op.Constant(value_ints=[ph, g, pw, g]), axis=0)
    pooled = op.Reshape(op.Mul(sampled, keep), bins)  # [R, C, ph, g, pw, g]
    return op.ReduceMean(pooled, op.Constant(value_ints=[3, 5]), keepdims=0)


def export(model: torch.nn.Module, args: tuple, path: str | os.PathLike, *, opset: int = OPSET,
           dynamic_shapes: Any = None, check: bool = True, opset_version: Optional[int] = None, **kwargs) -> Any:
    r"""Export a model using deformconv to an ONNX file, its deformable convolutions as standard ``DeformConv`` nodes.

    Args:
        model (nn.Module): in eval mode, as for any export.
        args (tuple): example inputs.
        path (str or PathLike): the ``.onnx`` file to write.
        opset (int): the ONNX opset, at least 19 (the first with DeformConv). Default: 19.
        opset_version (int, optional): the same, by ``torch.onnx.export``'s name for it; give one of the two.
            Default: ``None``.
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
    if opset_version is not None:
        if opset != OPSET and opset != opset_version:
            raise ValueError(f"opset and opset_version name the same setting: give one, got opset={opset!r} and "
                             f"opset_version={opset_version!r}")
        opset = opset_version
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
