"""The DCNv3/DCNv4 Triton kernels on a CUDA GPU (skipped without one): forward and gradients against the float64
reference by dtype at InternImage's layer shapes and odd ones, DCNv4's offset_mask, deterministic mode, bf16
training of the modules."""

import pytest
import torch
from conftest import HAS_CUDA, assert_close

import deformconv
from deformconv.ops.dcnv.geometry import DcnGeometry
from deformconv.ops.dcnv.reference import sampling_coordinates

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]
# (N, H, W, G, D, k, stride, pad, dilation, offset_scale, remove_center)
SHAPES = {
    "internimage-t-stage1": (2, 56, 56, 4, 16, 3, 1, 1, 1, 1.0, False),
    "dcnv4-bench-d32": (2, 28, 28, 4, 32, 3, 1, 1, 1, 1.0, False),
    "d64-remove-center": (1, 17, 23, 2, 64, 3, 1, 1, 1, 0.5, True),
    "odd-d5-stride2": (3, 19, 21, 3, 5, 3, 2, 1, 2, 1.3, False),
    "5x5-d24": (2, 13, 11, 2, 24, 5, 1, 2, 1, 1.0, True),
}


def _leaves(name, seed=0):
    n, h, w, g, d, k, s, p, dil, scale, rc = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ho, wo = (h + 2 * p - (dil * (k - 1) + 1)) // s + 1, (w + 2 * p - (dil * (k - 1) + 1)) // s + 1
    kk = k * k - int(rc)
    x = torch.randn(n, h, w, g * d, device="cuda", generator=gen, dtype=torch.float64)
    offset = torch.randn(n, ho, wo, g * kk * 2, device="cuda", generator=gen, dtype=torch.float64) * 2
    # sample points kept 1e-3 px from whole pixels, where the derivative jumps (fp32 and fp64 may round a point there
    # to either side)
    geo = DcnGeometry(n, h, w, g, d, (k, k), (s, s), (p, p), (dil, dil), scale, rc)
    py, px = sampling_coordinates(offset, geo, torch.float64)
    pairs = offset.view(n, ho, wo, g, kk, 2)
    pairs[..., 0] += ((px - px.round()).abs() < 1e-3) * 3e-3 / scale
    pairs[..., 1] += ((py - py.round()).abs() < 1e-3) * 3e-3 / scale
    mask = torch.rand(n, ho, wo, g * kk, device="cuda", generator=gen, dtype=torch.float64)
    return [x, offset, mask], (k, k, s, s, p, p, dil, dil, g, d, scale), rc


def _run(backend, dtype, leaves, params, rc, gout):
    cast = [t.to(dtype).to(torch.float64 if backend == "reference" else dtype).requires_grad_(True) for t in leaves]
    out = deformconv.dcnv3(*cast, *params, 256, rc, backend=backend)
    return [out, *torch.autograd.grad(out, cast, gout.to(out.dtype))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_dcnv3_against_the_reference(name, dtype):
    leaves, params, rc = _leaves(name)
    n, ho, wo = leaves[2].shape[:3]
    gout = torch.randn(n, ho, wo, leaves[0].shape[3], device="cuda", dtype=torch.float64)
    ours = _run("triton", dtype, leaves, params, rc, gout)
    ref = _run("reference", dtype, leaves, params, rc, gout)
    for what, a, b in zip(("output", "grad_input", "grad_offset", "grad_mask"), ours, ref):
        assert_close(a, b, dtype, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dcnv4_against_the_reference(dtype):
    (x, offset, mask), params, rc = _leaves("dcnv4-bench-d32", seed=1)
    om = deformconv.dcnv3_to_dcnv4(offset, mask, params[8])
    gout = torch.randn(*mask.shape[:3], x.shape[3], device="cuda", dtype=torch.float64)
    res = {}
    for backend in ("triton", "reference"):
        cast = [t.to(dtype).to(torch.float64 if backend == "reference" else dtype).requires_grad_(True)
                for t in (x, om)]
        out = deformconv.dcnv4(*cast, *params, 256, rc, backend=backend)
        res[backend] = [out, *torch.autograd.grad(out, cast, gout.to(out.dtype))]
    for what, a, b in zip(("output", "grad_input", "grad_offset_mask"), res["triton"], res["reference"]):
        assert_close(a, b, dtype, what)


def test_deterministic_grad_input_is_bitwise_reproducible():
    leaves, params, rc = _leaves("internimage-t-stage1", seed=2)
    gout = torch.randn(*leaves[2].shape[:3], leaves[0].shape[3], device="cuda", dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        a, b = (_run("triton", torch.float16, leaves, params, rc, gout) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(a[1], b[1])
    assert_close(a[1], _run("reference", torch.float16, leaves, params, rc, gout)[1], torch.float16, "grad_input")


@pytest.mark.parametrize("module", ["DCNv3", "DCNv4"])
def test_modules_train_in_bf16_under_autocast(module):
    torch.manual_seed(0)
    m = getattr(deformconv, module)(channels=64, group=4).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(4, 14, 14, 64, device="cuda")
    if module == "DCNv4":
        x = x.reshape(4, 196, 64)
    target = torch.randn_like(x)  # a regression: DCNv4's published init (zero aggregation weights) outputs zeros
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = (m(x).float() - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
