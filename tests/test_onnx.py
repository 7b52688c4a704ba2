"""ONNX export of deform_conv2d to the standard DeformConv operator, run in onnxruntime (the client), with both of
torch's exporters: every layer configuration the modules take, a small network, another batch and spatial size than
the exported one, and clear errors for what cannot be exported."""

import warnings

import pytest
import torch

import deformconv

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

ATOL = 1e-4  # fp32: ours against onnxruntime's DeformConv (different summation orders), relative to max |output|

LAYERS = {
    "DeformConv2dPack": lambda: deformconv.DeformConv2dPack(8, 12, 3, padding=1),
    "Modulated-groups-og": lambda: deformconv.ModulatedDeformConv2dPack(8, 12, 3, padding=1, groups=2, deform_groups=4),
    "Modulated-stride-dilation": lambda: deformconv.ModulatedDeformConv2dPack(8, 6, 3, stride=2, padding=2, dilation=2),
    "no-bias-5x5": lambda: deformconv.DeformConv2dPack(8, 4, 5, padding=2, bias=False),
    "no-bias-with-mask": lambda: deformconv.ModulatedDeformConv2dPack(8, 4, (3, 1), padding=(1, 0), bias=False),
}


def _randomised(module):
    torch.manual_seed(0)
    for m in module.modules():
        if hasattr(m, "conv_offset"):
            torch.nn.init.normal_(m.conv_offset.weight, std=0.3)
    return module.eval()


def _close(actual, expected):
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(torch.from_numpy(actual), expected, atol=ATOL * scale, rtol=1e-4)


def _ort_run(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]


def _deform_nodes(path):
    model = onnx.load(str(path))
    return [n for n in model.graph.node if n.op_type == "DeformConv"], model


@pytest.mark.parametrize("name", list(LAYERS))
def test_dynamo_export_runs_in_onnxruntime_at_other_sizes(name, tmp_path):
    """deformconv.onnx.export (dynamic batch and spatial size) -> standard DeformConv nodes, checked; onnxruntime's
    outputs equal ours at the exported size and at another batch and spatial size."""
    layer = _randomised(LAYERS[name]())
    x = torch.randn(2, 8, 15, 17)
    path = tmp_path / "layer.onnx"
    batch, h, w = torch.export.Dim("batch"), torch.export.Dim("h", min=5), torch.export.Dim("w", min=5)
    deformconv.onnx.export(layer, (x,), path, dynamic_shapes=({0: batch, 2: h, 3: w},))
    nodes, model = _deform_nodes(path)
    assert len(nodes) == 1 and nodes[0].domain in ("", "ai.onnx")
    assert any(o.domain in ("", "ai.onnx") and o.version >= 19 for o in model.opset_import)
    with torch.no_grad():
        for shape in ((2, 8, 15, 17), (3, 8, 11, 20)):
            xx = torch.randn(*shape)
            _close(_ort_run(path, xx), layer(xx))


def test_plain_torch_onnx_export_of_a_network_needs_no_table(tmp_path):
    """torch.onnx.export(model, args) as is: a network with several deformable layers exports (the function emits
    DeformConv itself while exporting)."""
    net = _randomised(torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        deformconv.ModulatedDeformConv2dPack(8, 8, 3, padding=1), torch.nn.ReLU(),
        deformconv.DeformConv2dPack(8, 16, 3, stride=2, padding=1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()))
    x = torch.randn(2, 3, 20, 24)
    path = tmp_path / "net.onnx"
    torch.onnx.export(net, (x,), dynamo=True, opset_version=19).save(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    assert len(_deform_nodes(path)[0]) == 2
    with torch.no_grad():
        _close(_ort_run(path, x), net(x))


@pytest.mark.parametrize("name", ["Modulated-groups-og", "no-bias-with-mask"])
def test_torchscript_exporter_with_dynamic_axes(name, tmp_path):
    layer = _randomised(LAYERS[name]())
    x = torch.randn(1, 8, 12, 13)
    path = tmp_path / "ts.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation
        torch.onnx.export(layer, (x,), str(path), dynamo=False, opset_version=19, input_names=["x"],
                          dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})
    onnx.checker.check_model(str(path))
    assert len(_deform_nodes(path)[0]) == 1
    with torch.no_grad():
        for shape in ((1, 8, 12, 13), (2, 8, 9, 16)):
            xx = torch.randn(*shape)
            _close(_ort_run(path, xx), layer(xx))


def test_the_raw_op_exports_through_the_translation_table(tmp_path):
    """A graph holding torch.ops.deformconv.deform_conv2d itself (not the function): the documented
    custom_translation_table argument."""
    class Raw(torch.nn.Module):
        def forward(self, x, offset, w):
            return torch.ops.deformconv.deform_conv2d(x, offset, w, None, None, [1, 1], [1, 1], [1, 1], "")

    x, offset, w = torch.randn(1, 4, 7, 8), torch.randn(1, 18, 7, 8), torch.randn(5, 4, 3, 3)
    prog = torch.onnx.export(Raw(), (x, offset, w), dynamo=True, opset_version=19,
                             custom_translation_table=deformconv.onnx.translation_table())
    path = tmp_path / "raw.onnx"
    prog.save(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    got = sess.run(None, dict(zip(names, (x.numpy(), offset.numpy(), w.numpy()))))[0]
    _close(got, deformconv.deform_conv2d(x, offset, w, padding=1))


def test_clear_errors(tmp_path):
    layer = _randomised(LAYERS["DeformConv2dPack"]())
    x = torch.randn(1, 8, 9, 9)
    with pytest.raises(ValueError, match="opset must be >= 19"):
        deformconv.onnx.export(layer, (x,), tmp_path / "old.onnx", opset=18)
    with pytest.raises(ValueError, match="opset must be >= 19"):  # torch.onnx.export's name for it
        deformconv.onnx.export(layer, (x,), tmp_path / "old.onnx", opset_version=17)
    with pytest.raises(ValueError, match="opset and opset_version name the same setting"):
        deformconv.onnx.export(layer, (x,), tmp_path / "both.onnx", opset=20, opset_version=19)
    pool = deformconv.DeformRoIPool(2, spatial_scale=0.5).eval()  # adaptive sampling
    rois = torch.tensor([[0, 1.0, 1.0, 8.0, 8.0]])
    with pytest.raises(Exception, match="sampling_ratio=0 cannot be exported to ONNX: each bin then takes"):
        deformconv.onnx.export(pool, (x, rois), tmp_path / "pool.onnx")
    ps = deformconv.DeformPSRoIPooling(0.5, 2, 8, no_trans=True).eval()
    with pytest.raises(Exception, match="position-sensitive RoI pooling has no ONNX operator"):
        deformconv.onnx.export(ps, (x, rois), tmp_path / "ps.onnx")


def _ort_outputs(path, inputs):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), inputs)})[0]


@pytest.mark.parametrize("module", ["DCNv3", "DCNv4"])
@pytest.mark.parametrize("remove_center", [False, True])
def test_dcnv3_dcnv4_export_as_a_depthwise_deform_conv(module, remove_center, tmp_path):
    """DCNv3/DCNv4 modules (offset_scale != 1, remove_center, D not a power of two): one standard DeformConv with
    group = channels, equal to ours in onnxruntime at the exported size and at another size."""
    torch.manual_seed(0)
    m = getattr(deformconv, module)(channels=12, group=4, offset_scale=0.7, remove_center=remove_center).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    shape = (2, 7, 9, 12) if module == "DCNv3" else (2, 63, 12)
    dims = {0: torch.export.Dim("n"), 1: torch.export.Dim("h"), 2: torch.export.Dim("w")}
    x = torch.randn(*shape)
    args = (x,) if module == "DCNv3" else (x, (7, 9))
    path = tmp_path / "dcn.onnx"
    # (DCNv4's forward takes its (H, W) as a tuple of ints, which torch.onnx's dynamic_shapes cannot describe: static)
    deformconv.onnx.export(m, args, path, dynamic_shapes=(dims,) if module == "DCNv3" else None)
    nodes, _ = _deform_nodes(path)
    assert len(nodes) == 1 and {a.name: a.i for a in nodes[0].attribute}["group"] == 12
    with torch.no_grad():
        _close(_ort_outputs(path, [x]), m(*args))
        if module == "DCNv3":
            x2 = torch.randn(3, 6, 11, 12)
            _close(_ort_outputs(path, [x2]), m(x2))


def test_ms_deform_attn_exports_as_grid_sample(tmp_path):
    """MSDeformAttn: one GridSample a level (align_corners=0, zeros), equal to ours in onnxruntime, also with other
    level sizes fed at run time."""
    torch.manual_seed(0)
    m = deformconv.MSDeformAttn(16, n_levels=2, n_heads=4, n_points=3).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    shapes, starts = torch.tensor([[6, 7], [3, 4]]), torch.tensor([0, 42])
    q, src, ref = torch.randn(2, 9, 16), torch.randn(2, 54, 16), torch.rand(2, 9, 2, 2) * 1.2 - 0.1
    path = tmp_path / "msda.onnx"
    deformconv.onnx.export(m, (q, ref, src, shapes, starts), path,
                           dynamic_shapes=({1: torch.export.Dim("q")}, {1: torch.export.Dim("q")},
                                           {1: torch.export.Dim("s")}, None, None))
    model = onnx.load(str(path))
    assert sum(n.op_type == "GridSample" for n in model.graph.node) == 2
    with torch.no_grad():
        _close(_ort_outputs(path, [q, ref, src, shapes, starts]), m(q, ref, src, shapes, starts))
        shapes2, starts2 = torch.tensor([[5, 5], [2, 3]]), torch.tensor([0, 25])
        q2, src2, ref2 = torch.randn(2, 4, 16), torch.randn(2, 31, 16), torch.rand(2, 4, 2, 2)
        _close(_ort_outputs(path, [q2, ref2, src2, shapes2, starts2]), m(q2, ref2, src2, shapes2, starts2))


@pytest.mark.parametrize("module", ["DeformRoIPoolPack", "ModulatedDeformRoIPoolPack"])
def test_deform_roi_pool_with_a_fixed_grid_exports_as_grid_sample(module, tmp_path):
    """mmcv's pooling modules with sampling_ratio 2: one GridSample (align_corners=1, border) per pooling, equal to
    ours in onnxruntime, with RoIs partly and wholly outside the image, and another number of RoIs at run time."""
    torch.manual_seed(0)
    m = getattr(deformconv, module)((3, 4), output_channels=5, deform_fc_channels=16, spatial_scale=0.5,
                                    sampling_ratio=2).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 9, 11)
    rois = torch.tensor([[0, 1.0, 1.0, 30.0, 20.0], [1, -5.0, 2.0, 10.0, 40.0], [0, 25.0, 25.0, 60.0, 60.0],
                         [1, 0.5, 0.7, 8.2, 16.9]])
    path = tmp_path / "pool.onnx"
    deformconv.onnx.export(m, (x, rois), path, dynamic_shapes=(None, {0: torch.export.Dim("r")}))
    assert sum(n.op_type == "GridSample" for n in onnx.load(str(path)).graph.node) == 2
    with torch.no_grad():
        _close(_ort_outputs(path, [x, rois]), m(x, rois))
        _close(_ort_outputs(path, [x, rois[1:]]), m(x, rois[1:]))


def test_nd_forms_export_what_the_standard_and_onnxruntime_run(tmp_path):
    """deform_conv1d exports as a 2-D DeformConv over a unit height, which onnxruntime runs (our outputs, at another
    length too); deform_conv3d as the standard's N-d DeformConv (onnxruntime 1.32 runs 4-D inputs only, so the file is
    only checked); the transposed forms, which no ONNX operator covers, raise saying so."""
    torch.manual_seed(0)
    layer = deformconv.DeformConv1dPack(4, 6, 3, padding=2, dilation=2, groups=2, offset_groups=2, modulated=True)
    layer = layer.eval()
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.3)
    x = torch.randn(2, 4, 13)
    path = tmp_path / "dcn1d.onnx"
    deformconv.onnx.export(layer, (x,), path, dynamic_shapes=({0: torch.export.Dim("n"), 2: torch.export.Dim("w")},))
    for inp in (x, torch.randn(3, 4, 21)):
        torch.testing.assert_close(torch.from_numpy(_ort_outputs(path, [inp])), layer(inp).detach(), rtol=1e-4,
                                   atol=1e-4)
    path3 = tmp_path / "dcn3d.onnx"
    deformconv.onnx.export(deformconv.DeformConv3dPack(2, 3, 3, padding=1).eval(), (torch.randn(1, 2, 4, 5, 6),), path3)
    node = next(n for n in onnx.load(str(path3)).graph.node if n.op_type == "DeformConv")
    assert {a.name: list(a.ints) for a in node.attribute if a.ints}["kernel_shape"] == [3, 3, 3]
    with pytest.raises(Exception, match="transposed deformable convolution has no ONNX operator"):
        deformconv.onnx.export(deformconv.DeformConvTranspose2dPack(2, 3, 3).eval(), (torch.randn(1, 2, 4, 4),),
                               tmp_path / "t.onnx")
