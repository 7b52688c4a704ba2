"""Deformable RoI pooling's Triton kernels on a CUDA GPU (skipped without one): forward and gradients against the
float64 reference by dtype at Faster R-CNN-like loads and odd ones, NCHW and channels_last; torchvision's roi_align
without offsets; deterministic mode."""

import pytest
import torch
import torchvision
from conftest import HAS_CUDA, TOL, assert_close

import deformconv

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]
# (N, C, H, W, RoIs, output size, spatial_scale, sampling_ratio)
CASES = {
    "fpn-p2-like": (2, 64, 100, 152, 200, (7, 7), 0.25, 2),
    "fpn-p5-adaptive": (2, 64, 25, 38, 200, (7, 7), 1 / 32, 0),
    "fpn-p2-adaptive": (2, 24, 100, 152, 100, (7, 7), 0.25, 0),  # large RoIs: the forward's spread tile
    "odd": (3, 13, 17, 23, 37, (3, 5), 0.5, 0),
}
# Cases whose sample points are exact in fp32: RoIs a whole number of pixels a bin on a 1/16-pixel grid, dyadic offsets
# and gamma. Their bins hold up to 121 samples, so many that fp32 rounding of the points (1e-5 px at 150 px) moves
# grad_offset by up to a third of its fp32 tolerance and puts samples of one bin on both sides of whole pixels at
# once, which no shifted reference reproduces; with exact points fp32 and float64 sample the same places.
EXACT = {"fpn-p2-adaptive": 0.125}  # name: gamma


def _case(name, seed=0):
    n, c, h, w, r, out, scale, sr = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c, h, w, device="cuda", generator=gen, dtype=torch.float64)
    if name in EXACT:
        def grid(lo, hi, step, *shape):  # uniform on [lo, hi) in multiples of step
            steps = torch.randint(0, int((hi - lo) / step), shape, device="cuda", generator=gen)
            return lo + steps.double() * step
        # feature-pixel corners on a 1/16 grid, partly outside the image; sizes of 1 to 11 whole pixels a bin
        xy = torch.stack([grid(-w // 16, w + w // 16, 1 / 16, r), grid(-h // 16, h + h // 16, 1 / 16, r)], 1)
        bins = torch.tensor([out[1], out[0]], device="cuda", dtype=torch.float64)
        wh = torch.randint(1, 12, (r, 2), device="cuda", generator=gen).double() * bins
        batch = torch.randint(0, n, (r, 1), device="cuda", generator=gen).double()
        rois = torch.cat([batch, (xy + 0.5) / scale, (xy + wh + 0.5) / scale], 1)  # aligned: -0.5 px in the op
        offset = grid(-1, 1, 1 / 64, r, 2, *out)
        return x, rois, offset, out, scale, sr
    size = torch.tensor([w, h], device="cuda", dtype=torch.float64) / scale
    xy = torch.rand(r, 2, device="cuda", generator=gen, dtype=torch.float64) * size * 1.1 - 0.05 * size
    wh = torch.rand(r, 2, device="cuda", generator=gen, dtype=torch.float64) * size * 0.5
    batch = torch.randint(0, n, (r, 1), device="cuda", generator=gen).double()
    rois = torch.cat([batch, xy, xy + wh], 1)
    offset = torch.randn(r, 2, *out, device="cuda", generator=gen, dtype=torch.float64) * 0.5
    return x, rois, offset, out, scale, sr


def _run(backend, dtype, x, rois, offset, out, scale, sr, gout, channels_last=False, gamma=0.1):
    work = torch.float64 if backend == "reference" else dtype
    xx = x.to(dtype).to(work)
    if channels_last:
        xx = xx.contiguous(memory_format=torch.channels_last)
    leaves = [xx.requires_grad_(True), offset.to(dtype).to(work).requires_grad_(True)]
    r = rois.float().to(torch.float64 if backend == "reference" else torch.float32)
    y = deformconv.deform_roi_pool(leaves[0], r, leaves[1], out, scale, sr, gamma, backend=backend)
    return [y, *torch.autograd.grad(y, leaves, gout.to(y.dtype))]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_reference(name, dtype, channels_last):
    x, rois, offset, out, scale, sr = _case(name)
    gamma = EXACT.get(name, 0.1)
    gout = torch.randn(rois.shape[0], x.shape[1], *out, device="cuda", dtype=torch.float64)
    ours = _run("triton", dtype, x, rois, offset, out, scale, sr, gout, channels_last, gamma)
    ref = _run("reference", dtype, x, rois, offset, out, scale, sr, gout, gamma=gamma)
    for what, a, b in zip(("output", "grad_input"), ours, ref):
        assert_close(a, b, dtype, what)
    # grad_offset: where a sample point lies within rounding of a whole pixel its derivative is one-sided, and fp32
    # (ours) and fp64 (the reference) may take either side; there ours must match the reference at an offset moved by
    # 0.01 either way. Everywhere else (all but at most one in 10^3), the reference itself. With exact sample points
    # (EXACT; exact in every dtype: they are computed in fp32 from dyadic values) no side is in doubt: the reference
    # itself everywhere.
    atol, rtol = TOL[dtype]
    a, b = ours[2].detach().double(), ref[2].detach().double()
    assert not torch.isnan(a).any(), "grad_offset: NaN"
    if name in EXACT:
        torch.testing.assert_close(a, b, atol=atol * b.abs().max().item(), rtol=rtol, msg="grad_offset")
        return
    sides = [b] + [_run("reference", dtype, x, rois, offset + d, out, scale, sr, gout, gamma=gamma)[2].detach().double()
                   for d in (0.01, -0.01)]
    near = [(a - s).abs() <= atol * b.abs().max() + rtol * s.abs() for s in sides]
    assert (near[0] | near[1] | near[2]).all(), "grad_offset: an element matches the reference on neither side"
    assert near[0].double().mean() > 0.999, f"grad_offset: {int((~near[0]).sum())} elements off the reference"


def test_without_offset_is_roi_align():
    x, rois, _, out, scale, sr = _case("fpn-p2-like", seed=1)
    x, rois = x.float(), rois.float()
    ours = deformconv.deform_roi_pool(x, rois, None, out, scale, sr, backend="triton")
    # fp32 coordinates of ~300 px carry ~3e-5 px of rounding: the fp32 row of the tolerance table, not exact equality
    assert_close(ours, torchvision.ops.roi_align(x, rois, out, scale, sr, aligned=True), torch.float32, "output")


def test_deterministic_grad_input_is_bitwise_reproducible():
    x, rois, offset, out, scale, sr = _case("fpn-p5-adaptive", seed=2)
    gout = torch.randn(rois.shape[0], x.shape[1], *out, device="cuda", dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        a, b = (_run("triton", torch.float16, x, rois, offset, out, scale, sr, gout) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("no_trans", [False, True], ids=["offsets", "no-trans"])
def test_position_sensitive_against_the_reference(dtype, no_trans):
    """R-FCN-like: 7x7 bins, group_size 7, 21 classes of offsets (class-specific), 2 samples a part."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    O, P, G, classes = 42, 7, 7, 21
    x = torch.randn(2, O * G * G, 38, 50, device="cuda", generator=gen, dtype=torch.float64)
    rois = _case("fpn-p5-adaptive", seed=5)[1][:64] * (1 / 32) * 16  # boxes across a 16x-strided map
    rois[:, 0] = torch.randint(0, 2, (64,), device="cuda", generator=gen).double()
    offset = torch.randn(64, 2 * classes, P, P, device="cuda", generator=gen, dtype=torch.float64)
    gout = torch.randn(64, O, P, P, device="cuda", dtype=torch.float64)
    res = {}
    for backend in ("triton", "reference"):
        work = torch.float64 if backend == "reference" else dtype
        leaves = [x.to(dtype).to(work).requires_grad_(True), offset.to(dtype).to(work).requires_grad_(True)]
        y = deformconv.deform_psroi_pool(leaves[0], rois.float().to(torch.float64 if backend == "reference" else
                                                                     torch.float32),
                                         None if no_trans else leaves[1], 1 / 16, P, O, no_trans, G, P, 2, 0.1,
                                         backend=backend)
        wrt = leaves[:1] if no_trans else leaves
        res[backend] = [y, *torch.autograd.grad(y, wrt, gout.to(y.dtype))]
    for what, a, b in zip(("output", "grad_input", "grad_offset"), res["triton"], res["reference"]):
        assert_close(a, b, dtype, what)
