"""Deformable RoI pooling (deformconv.deform_roi_pool, its op and modules) against an independent naive loop
implementation in float64 and against torchvision.ops.roi_align(aligned=True) without offsets: RoIs partly or wholly
outside the image, degenerate and reversed RoIs, fixed and adaptive sampling, empty RoI lists, argument errors; the
Triton kernels under the interpreter; the registrations; mmcv's modules."""

import pytest
import torch
import torchvision
from _naive_roi_pool import naive_deform_roi_pool
from conftest import assert_close, requires_interpreter

import deformconv

ROIS = [
    [0, 1.0, 1.0, 30.0, 20.0],     # inside
    [1, -5.0, 2.0, 10.0, 40.0],    # partly outside (left, bottom)
    [0, 3.0, 3.0, 3.0, 3.0],       # degenerate: no size
    [1, 25.0, 25.0, 60.0, 60.0],   # wholly outside (the image is 22 x 18 in image units)
    [0, 0.5, 0.7, 8.2, 16.9],      # fractional
    [1, 12.0, 9.0, 4.0, 2.0],      # reversed: negative size
]


def _case(seed=0, n=2, c=5, h=9, w=11, out=(3, 4)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    rois = torch.tensor(ROIS, dtype=torch.float64)
    offset = torch.randn(len(ROIS), 2, *out, generator=gen, dtype=torch.float64) * 0.6
    return x, rois, offset


def _grads(fn, x, rois, offset, gout):
    leaves = [x.detach().clone().requires_grad_(True)]
    if offset is not None:
        leaves.append(offset.detach().clone().requires_grad_(True))
    out = fn(leaves[0], rois, leaves[1] if offset is not None else None)
    return [out, *torch.autograd.grad(out, leaves, gout.to(out.dtype))]


@pytest.mark.parametrize("sampling_ratio", [0, 2])
@pytest.mark.parametrize("with_offset", [True, False], ids=["offset", "no-offset"])
def test_reference_matches_the_naive_loops(sampling_ratio, with_offset):
    x, rois, offset = _case()
    offset = offset if with_offset else None
    gout = torch.randn(len(ROIS), 5, 3, 4, dtype=torch.float64)
    args = ((3, 4), 0.5, sampling_ratio, 0.15)
    ours = _grads(lambda x, r, o: deformconv.deform_roi_pool(x, r, o, *args, backend="reference"), x, rois, offset,
                  gout)
    naive = _grads(lambda x, r, o: naive_deform_roi_pool(x, r, o, *args), x, rois, offset, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset"), ours, naive):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_interpreter)])
@pytest.mark.parametrize("sampling_ratio", [0, 1, 3])
def test_without_offset_is_torchvisions_aligned_roi_align(backend, sampling_ratio):
    x, rois, _ = _case(seed=1)
    dtype = torch.float64 if backend == "reference" else torch.float32
    gout = torch.randn(len(ROIS), 5, 3, 4, dtype=torch.float64)
    ours = _grads(lambda x, r, o: deformconv.deform_roi_pool(x, r, None, (3, 4), 0.5, sampling_ratio, backend=backend),
                  x.to(dtype), rois.to(dtype), None, gout)
    theirs = _grads(lambda x, r, o: torchvision.ops.roi_align(x, r, (3, 4), 0.5, sampling_ratio, aligned=True),
                    x, rois, None, gout)
    for what, a, b in zip(("output", "grad_input"), ours, theirs):
        assert_close(a, b, dtype, what)


def test_gradcheck():
    x, rois, offset = _case(seed=2, c=2, h=6, w=7, out=(2, 2))
    rois = rois[[0, 1, 4]]
    leaves = [x.requires_grad_(True), offset[[0, 1, 4]].requires_grad_(True)]
    assert torch.autograd.gradcheck(lambda x, o: deformconv.deform_roi_pool(x, rois, o, 2, 0.5, 2), leaves)


def test_empty_roi_list_and_empty_input():
    x, rois, _ = _case()
    x = x.requires_grad_(True)
    out = deformconv.deform_roi_pool(x, rois[:0], None, 7)
    assert out.shape == (0, 5, 7, 7)
    out.sum().backward()
    assert x.grad is not None and not x.grad.any()
    empty = deformconv.deform_roi_pool(torch.zeros(2, 5, 0, 4, dtype=torch.float64), rois[:2], None, 2)
    assert empty.shape == (2, 5, 2, 2) and not empty.any()


@pytest.mark.parametrize("pack", ["DeformRoIPoolPack", "ModulatedDeformRoIPoolPack"])
def test_packs_take_no_rois(pack):
    """An image batch with no proposals (common in detection): an empty output, and zero gradients for the input and
    every parameter."""
    x, rois, _ = _case()
    x = x.float().requires_grad_(True)
    m = getattr(deformconv, pack)(3, output_channels=x.shape[1], deform_fc_channels=16)
    out = m(x, rois[:0].float())
    assert out.shape == (0, x.shape[1], 3, 3)
    out.sum().backward()
    assert not x.grad.any() and all(p.grad is not None and not p.grad.any() for p in m.parameters())


@pytest.mark.parametrize("rois,match", [
    (torch.tensor([[2.0, 0, 0, 4, 4]]), "batch indices in \\[0, 2\\)"),
    (torch.tensor([[-1.0, 0, 0, 4, 4]]), "batch indices"),
    (torch.tensor([[0.5, 0, 0, 4, 4]]), "batch indices"),
    (torch.tensor([[0, 0, 0, 4, 4]]), "rois must be floating point"),
    (torch.tensor([[0.0, 0, 0, 4]]), "rois must be a tensor \\[R, 5\\]"),
])
def test_argument_errors_name_the_argument(rois, match):
    with pytest.raises((ValueError, TypeError), match=match):
        deformconv.deform_roi_pool(torch.randn(2, 3, 8, 8), rois, None, 2)


def test_offset_and_output_size_errors():
    x, rois = torch.randn(2, 3, 8, 8), torch.tensor([[0.0, 0, 0, 4, 4]])
    with pytest.raises(ValueError, match="offset must have shape \\[1, 2, 2, 3\\]"):
        deformconv.deform_roi_pool(x, rois, torch.zeros(1, 2, 3, 2), (2, 3))
    with pytest.raises(ValueError, match="output_size"):
        deformconv.deform_roi_pool(x, rois, None, 0)
    with pytest.raises(ValueError, match="sampling_ratio"):
        deformconv.deform_roi_pool(x, rois, None, 2, sampling_ratio=-1)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("sampling_ratio", [0, 2, 6])  # 6: 36 samples a bin, the forward's spread tile
def test_triton_matches_the_reference(dtype, channels_last, sampling_ratio):
    x, rois, offset = _case(seed=3, c=12)
    x, offset = x.to(dtype).double(), offset.to(dtype).double()  # the reference gets the rounded inputs
    gout = torch.randn(len(ROIS), 12, 3, 4, dtype=torch.float64)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    args = ((3, 4), 0.5, sampling_ratio, 0.1)
    ours = _grads(lambda x, r, o: deformconv.deform_roi_pool(x.contiguous(memory_format=fmt), r, o, *args,
                                                             backend="triton"),
                  x.to(dtype), rois.float(), offset.to(dtype), gout)  # the RoIs stay fp32, as under autocast
    ref = _grads(lambda x, r, o: deformconv.deform_roi_pool(x, r, o, *args, backend="reference"), x,
                 rois.float().double(), offset, gout)
    assert ours[0].dtype == dtype
    for what, a, b in zip(("output", "grad_input", "grad_offset"), ours, ref):
        assert_close(a, b, dtype, what)


@requires_interpreter
@pytest.mark.parametrize("width,planes", [(0, None), (4, 2), (8, 2), (4, 1), (4, 4), (8, 4)])
def test_triton_forward_spread_tile_widths(width, planes):
    """Adaptive sampling with the forward's spread tile at any width (options.roi_spread; 0: none) and any channels a
    pass (options.roi_planes) gives the reference result: widths 4 and 8 (RoIs of 8 and 16 samples a bin or more)
    split this case's RoIs differently between the two tiles; 7 channels, so the spread tile's last pass has fewer
    channels than it takes."""
    from deformconv.config import options

    x, rois, offset = _case(seed=5, c=7)
    ref = deformconv.deform_roi_pool(x, rois, offset, (3, 4), 0.5, 0, 0.1, backend="reference")
    with options.override(roi_spread=width, roi_planes=planes):
        ours = deformconv.deform_roi_pool(x.float(), rois.float(), offset.float(), (3, 4), 0.5, 0, 0.1,
                                          backend="triton")
    assert_close(ours, ref, torch.float32, f"output (width {width}, {planes} planes)")


def test_spread_planes_other_than_1_2_4_are_refused():
    """A pass of 3 channels would leave every third channel unwritten: refused, naming the option."""
    from deformconv.config import options
    from deformconv.ops.roi_pool.triton.roi import spread_planes

    with options.override(roi_planes=3):
        with pytest.raises(ValueError, match="roi_planes must be 1, 2 or 4"):
            spread_planes()


@requires_interpreter
def test_triton_deterministic_mode_is_reproducible_and_right():
    x, rois, offset = _case(seed=4)
    gout = torch.randn(len(ROIS), 5, 3, 4, dtype=torch.float64)
    fn = lambda x, r, o: deformconv.deform_roi_pool(x, r, o, (3, 4), 0.5, 0, 0.1, backend="triton")  # noqa: E731
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(fn, x.float(), rois.float(), offset.float(), gout) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0][1], runs[1][1])
    ref = _grads(lambda x, r, o: deformconv.deform_roi_pool(x, r, o, (3, 4), 0.5, 0, 0.1, backend="reference"),
                 x.float().double(), rois, offset.float().double(), gout)
    assert_close(runs[0][1], ref[1], torch.float32, "grad_input")


def test_registrations_compile_export_and_autocast():
    x, rois, offset = (t.float() for t in _case(seed=5))
    leaves = [x.requires_grad_(True), offset.requires_grad_(True)]
    torch.library.opcheck(torch.ops.deformconv.deform_roi_pool.default,
                          (leaves[0], rois, leaves[1], [3, 4], 0.5, 0, 0.1, ""))
    pool = deformconv.DeformRoIPoolPack((3, 4), output_channels=5, deform_fc_channels=16, spatial_scale=0.5).eval()
    eager = pool(x, rois)
    torch.testing.assert_close(torch.compile(pool, fullgraph=True, backend="aot_eager")(x, rois), eager)
    ep = torch.export.export(pool, (x, rois))
    assert sum("deformconv.deform_roi_pool" in str(nd.target) for nd in ep.graph.nodes) == 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_roi_pool(x, rois, offset, (3, 4), 0.5)
    assert out.dtype == torch.bfloat16
    exact = deformconv.deform_roi_pool(x.bfloat16().double(), rois.double(), offset.bfloat16().double(), (3, 4), 0.5)
    assert_close(out, exact, torch.bfloat16, "rois kept in fp32 under autocast")


def test_modules_keys_and_definition():
    """mmcv's keys (offset_fc.0/2/4, mask_fc.0/2), zero-initialised last layers (RoIAlign at the start, a mask of
    0.5), and the forward written out: pool, FC stack, pool with the offsets (times the mask)."""
    torch.manual_seed(0)
    m = deformconv.ModulatedDeformRoIPoolPack((3, 4), output_channels=5, deform_fc_channels=16,
                                              spatial_scale=0.5).double()
    assert sorted(m.state_dict()) == ["mask_fc.0.bias", "mask_fc.0.weight", "mask_fc.2.bias", "mask_fc.2.weight",
                                      "offset_fc.0.bias", "offset_fc.0.weight", "offset_fc.2.bias",
                                      "offset_fc.2.weight", "offset_fc.4.bias", "offset_fc.4.weight"]
    x, rois, _ = _case(seed=6)
    plain = torchvision.ops.roi_align(x, rois, (3, 4), 0.5, 0, aligned=True)
    torch.testing.assert_close(m(x, rois), plain * 0.5)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    flat = naive_deform_roi_pool(x, rois, None, (3, 4), 0.5).reshape(len(ROIS), -1)
    offset = m.offset_fc(flat).view(len(ROIS), 2, 3, 4)
    mask = m.mask_fc(flat).view(len(ROIS), 1, 3, 4)
    torch.testing.assert_close(m(x, rois), naive_deform_roi_pool(x, rois, offset, (3, 4), 0.5) * mask)
    with pytest.raises(ValueError, match="output_channels = 5"):
        m(x[:, :4], rois)


# --- the position-sensitive variant ----------------------------------------------------------------------

PS_ROIS = [[0, 1.0, 1.0, 30.0, 20.0], [1, -5.0, 2.5, 10.0, 40.0], [0, 3.0, 3.0, 3.0, 3.0], [1, 0.4, 0.7, 8.5, 16.9],
           [0, -2.5, 1.5, 2.5, 4.5]]


def _ps_case(seed=0, G=2, O=6, P=3, part=2, classes=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, O * G * G, 9, 11, generator=gen, dtype=torch.float64)
    rois = torch.tensor(PS_ROIS, dtype=torch.float64)
    offset = torch.randn(len(PS_ROIS), 2 * classes, part, part, generator=gen, dtype=torch.float64) * 0.7
    return x, rois, offset


@pytest.mark.parametrize("no_trans", [False, True], ids=["offsets", "no-trans"])
@pytest.mark.parametrize("G,P,part,S", [(2, 3, 2, 2), (1, 4, 4, 3), (3, 3, 1, 1)])
def test_psroi_reference_matches_the_naive_loops(no_trans, G, P, part, S):
    from _naive_roi_pool import naive_deform_psroi_pool

    x, rois, offset = _ps_case(G=G, P=P, part=part)
    args = (0.5, P, 6, no_trans, G, part, S, 0.2)
    gout = torch.randn(len(PS_ROIS), 6, P, P, dtype=torch.float64)
    ours = _grads(lambda x, r, o: deformconv.deform_psroi_pool(x, r, o, *args), x, rois, None if no_trans else offset,
                  gout)
    naive = _grads(lambda x, r, o: naive_deform_psroi_pool(x, r, o, *args), x, rois, None if no_trans else offset, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset"), ours, naive):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=what)


def test_psroi_agrees_with_torchvisions_ps_roi_align_where_they_meet():
    """Whole-pixel RoIs inside the image, torchvision's moved half a sub-bin back (its samples sit at sub-bin centres,
    the original's at their starts) and one pixel longer (the original's end is round(x2) + 1), group_size =
    pooled_size, sampling_ratio = sample_per_part: the same numbers."""
    P, S, O, scale = 3, 2, 4, 0.5
    x = torch.randn(2, O * P * P, 12, 13, dtype=torch.float64)
    rois = torch.tensor([[0, 2.0, 3.0, 14.0, 17.0], [1, 4.0, 1.0, 20.0, 10.0]], dtype=torch.float64)
    ours = deformconv.deform_psroi_pool(x, rois, None, scale, P, O, True, group_size=P, sample_per_part=S)
    tv_rois = rois.clone()
    tv_rois[:, 3:] += 1
    half_sub = (tv_rois[:, 3:] - tv_rois[:, 1:3]) / (2 * P * S)  # half a sub-bin, in image units
    tv_rois[:, 1:3] -= half_sub
    tv_rois[:, 3:] -= half_sub
    theirs = torchvision.ops.ps_roi_align(x, tv_rois, P, scale, sampling_ratio=S)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)


def test_psroi_gradcheck_module_and_errors():
    x, rois, offset = _ps_case(seed=3, G=1, O=2, P=2, part=2, classes=1)
    leaves = [x[:, :2].clone().requires_grad_(True), offset.requires_grad_(True)]
    rois = rois[[0, 1, 3]]
    leaves[1] = offset[[0, 1, 3]].detach().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x, o: deformconv.deform_psroi_pool(x, rois, o, 0.5, 2, 2, False, 1, 2, 2, 0.3), leaves)
    pool = deformconv.DeformPSRoIPooling(0.5, 2, 2, no_trans=False, part_size=2, sample_per_part=2, trans_std=0.3)
    torch.testing.assert_close(pool(*leaves[:1], rois, leaves[1]),
                               deformconv.deform_psroi_pool(leaves[0], rois, leaves[1], 0.5, 2, 2, False, 1, 2, 2, 0.3))
    with pytest.raises(ValueError, match="output_dim \\* group_size\\*\\*2 = 8"):
        deformconv.deform_psroi_pool(x[:, :2], rois, None, 0.5, 2, 2, True, group_size=2)
    with pytest.raises(ValueError, match="offset is required"):
        deformconv.deform_psroi_pool(x[:, :2], rois, None, 0.5, 2, 2, False)
    with pytest.raises(ValueError, match="multiple of the offset's classes"):
        deformconv.deform_psroi_pool(torch.randn(2, 3, 9, 11, dtype=torch.float64), rois,
                                     torch.zeros(3, 4, 2, 2, dtype=torch.float64), 0.5, 2, 3, False)
    torch.library.opcheck(torch.ops.deformconv.deform_psroi_pool.default,
                          (leaves[0], rois, leaves[1], 0.5, 2, 2, 1, 2, 2, 0.3, ""))


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("no_trans,G,P,part,S", [(False, 2, 3, 2, 2), (True, 3, 3, 3, 1), (False, 1, 4, 4, 3)])
def test_psroi_triton_matches_the_reference(dtype, no_trans, G, P, part, S):
    x, rois, offset = _ps_case(seed=4, G=G, P=P, part=part)
    x, offset = x.to(dtype).double(), offset.to(dtype).double()  # the reference gets the rounded inputs
    args = (0.5, P, 6, no_trans, G, part, S, 0.2)
    gout = torch.randn(len(PS_ROIS), 6, P, P, dtype=torch.float64)
    off = None if no_trans else offset
    ours = _grads(lambda x, r, o: deformconv.deform_psroi_pool(x, r, o, *args, backend="triton"), x.to(dtype),
                  rois.float(), None if off is None else off.to(dtype), gout)
    ref = _grads(lambda x, r, o: deformconv.deform_psroi_pool(x, r, o, *args, backend="reference"), x,
                 rois.float().double(), off, gout)
    assert ours[0].dtype == dtype
    for what, a, b in zip(("output", "grad_input", "grad_offset"), ours, ref):
        assert_close(a, b, dtype, what)


@requires_interpreter
def test_psroi_triton_deterministic_mode_is_reproducible_and_right():
    x, rois, offset = _ps_case(seed=5)
    args = (0.5, 3, 6, False, 2, 2, 2, 0.2)
    gout = torch.randn(len(PS_ROIS), 6, 3, 3, dtype=torch.float64)
    fn = lambda x, r, o: deformconv.deform_psroi_pool(x, r, o, *args, backend="triton")  # noqa: E731
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_grads(fn, x.float(), rois.float(), offset.float(), gout) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    ref = _grads(lambda x, r, o: deformconv.deform_psroi_pool(x, r, o, *args, backend="reference"),
                 x.float().double(), rois.float().double(), offset.float().double(), gout)
    assert_close(runs[0][1], ref[1], torch.float32, "grad_input")
    assert_close(runs[0][2], ref[2], torch.float32, "grad_offset")
