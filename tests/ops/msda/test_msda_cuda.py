"""Multi-scale deformable attention's Triton kernels on a CUDA GPU (skipped without one): forward and gradients
against the float64 reference by dtype, at a Deformable DETR encoder's level sizes and odd ones; deterministic mode;
the module training in bf16."""

import pytest
import torch
from conftest import HAS_CUDA, assert_close

import deformconv

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]
# (N, Lq, M, D, levels, P)
CASES = {
    "detr-encoder-small": (1, 500, 8, 32, [(25, 38), (13, 19), (7, 10), (4, 5)], 4),
    "decoder-300": (2, 300, 8, 32, [(50, 75), (25, 38), (13, 19), (7, 10)], 4),
    "odd-d24-one-level": (3, 77, 3, 24, [(17, 23)], 5),
    "d5-heads2": (2, 40, 2, 5, [(9, 13), (1, 1)], 3),
}


def _case(name, seed=0):
    n, lq, m, d, levels, p = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = torch.tensor(levels, dtype=torch.int64, device="cuda")
    sizes = shapes.prod(1)
    starts = torch.cumsum(sizes, 0) - sizes
    value = torch.randn(n, int(sizes.sum()), m, d, device="cuda", generator=gen, dtype=torch.float64)
    loc = torch.rand(n, lq, m, len(levels), p, 2, device="cuda", generator=gen, dtype=torch.float64) * 1.2 - 0.1
    attn = torch.rand(n, lq, m, len(levels), p, device="cuda", generator=gen, dtype=torch.float64)
    return value, shapes, starts, loc, attn


def _run(backend, dtype, value, shapes, starts, loc, attn, gout):
    work = torch.float64 if backend == "reference" else dtype
    leaves = [value.to(dtype).to(work), loc.float().to(torch.float64 if backend == "reference" else torch.float32),
              attn.to(dtype).to(work)]
    leaves = [t.requires_grad_(True) for t in leaves]
    out = deformconv.ms_deform_attn(leaves[0], shapes, starts, leaves[1], leaves[2], backend=backend)
    return [out, *torch.autograd.grad(out, leaves, gout.to(out.dtype))]


@pytest.mark.parametrize("preload", [False, True], ids=["per-point-loads", "preloaded"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_reference(name, dtype, preload):
    """Both ways of loading a query's locations and weights (options.preload_points; preloaded only where L·P ≤ 16)."""
    from deformconv.config import options

    value, shapes, starts, loc, attn = _case(name)
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda",
                       dtype=torch.float64)
    with options.override(preload_points=preload):
        ours = _run("triton", dtype, value, shapes, starts, loc, attn, gout)
    ref = _run("reference", dtype, value, shapes, starts, loc, attn, gout)
    for what, a, b in zip(("output", "grad_value", "grad_locations", "grad_attention"), ours, ref):
        assert_close(a, b, dtype, what)


def test_deterministic_grad_value_is_bitwise_reproducible():
    value, shapes, starts, loc, attn = _case("decoder-300", seed=3)
    gout = torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device="cuda",
                       dtype=torch.float64)
    torch.use_deterministic_algorithms(True)
    try:
        a, b = (_run("triton", torch.bfloat16, value, shapes, starts, loc, attn, gout) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(a[1], b[1])


def test_module_trains_in_bf16():
    torch.manual_seed(0)
    m = deformconv.MSDeformAttn(256, n_levels=2, n_heads=8, n_points=4).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    shapes = torch.tensor([[20, 30], [10, 15]], device="cuda")
    starts = torch.tensor([0, 600], device="cuda")
    q, x, ref = (torch.randn(2, 100, 256, device="cuda"), torch.randn(2, 750, 256, device="cuda"),
                 torch.rand(2, 100, 2, 2, device="cuda"))
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(q, ref, x, shapes, starts).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("method", ["default", "discrete"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [(3, 1, 2), (4, 4, 4), (5, 9, 1, 2)], ids=str)
def test_v2_points_per_level_against_the_reference(counts, dtype, method):
    """ms_deform_attn_v2 on the Triton kernels (each level with points of its own count: every point a level of its
    own; the same count: the levels as they are) against its float64 reference, output and gradients (discrete:
    value and weights only)."""
    levels = [(31, 47), (16, 24), (8, 12), (3, 5)][:len(counts)]
    gen = torch.Generator(device="cuda").manual_seed(len(counts))
    n, lq, m, d, t = 2, 123, 8, 32, sum(counts)
    value = torch.randn(n, sum(h * w for h, w in levels), m, d, device="cuda", generator=gen, dtype=torch.float64)
    loc = torch.rand(n, lq, m, t, 2, device="cuda", generator=gen, dtype=torch.float64) * 1.2 - 0.1
    attn = torch.rand(n, lq, m, t, device="cuda", generator=gen, dtype=torch.float64)
    gout = torch.randn(n, lq, m * d, device="cuda", generator=gen, dtype=torch.float64)
    results = {}
    for backend, work in (("triton", dtype), ("reference", torch.float64)):
        leaves = [value.to(dtype).to(work), loc.float().to(torch.float64 if work == torch.float64 else torch.float32),
                  attn.to(dtype).to(work)]
        leaves = [x.requires_grad_(True) for x in leaves]
        out = deformconv.ms_deform_attn_v2(leaves[0], levels, leaves[1], leaves[2], counts, method, backend=backend)
        need = leaves if method == "default" else [leaves[0], leaves[2]]
        results[backend] = [out, *torch.autograd.grad(out, need, gout.to(out.dtype))]
    names = ("output", "grad_value", "grad_locations", "grad_attention") if method == "default" else (
        "output", "grad_value", "grad_attention")
    for what, a, b in zip(names, results["triton"], results["reference"]):
        assert_close(a, b, dtype, what)
