"""The Triton backend on a CUDA GPU (skipped without one): forward and every gradient against the float64
reference and torchvision, by dtype; poisoned outputs; layouts; int64 indexing; compile/export/autocast;
deterministic mode; a short training run."""

import dataclasses
import math
import random

import pytest
import torch
from conftest import (
    FINISH_CASE_IDS,
    FINISH_CASES,
    HAS_CUDA,
    assert_close,
    assert_near_rounding,
    check_finish_grads,
    kernel_modules,
    launch_metas,
    make_case,
    nan_filled_empty,
)

import deformconv
from deformconv.config import options

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("implicit_gemm_for_groups")]  # these kernels, grouped cases included

DTYPES = [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float32, torch.float16, torch.bfloat16)]

# Realistic and odd shapes: (n, cin, cout, h, w, kh, kw, groups, offset_groups, stride, padding, dilation, mask)
SHAPES = {
    "det-like": (2, 64, 64, 33, 47, 3, 3, 1, 1, 1, 1, 1, "random"),
    "odd-groups-og4-s2-d2": (3, 48, 80, 17, 29, 3, 3, 2, 4, 2, 2, 2, "random"),
    "1x5-no-mask": (1, 32, 24, 20, 21, 1, 5, 1, 2, 1, (0, 2), 1, None),
    "wide-256": (2, 256, 128, 14, 15, 3, 3, 1, 1, 1, 1, 1, "random"),
    "segments-og3-g2": (2, 24, 16, 11, 9, 3, 3, 2, 3, 1, 1, 1, "random"),
    "5x5-cout-odd": (1, 16, 37, 19, 23, 5, 5, 1, 1, 1, 2, 1, "random"),
    "og8-packed-segments": (2, 64, 64, 31, 37, 3, 3, 1, 8, 1, 1, 1, "random"),
    "og12-g2-packed-tail": (2, 48, 40, 13, 19, 3, 3, 2, 12, 1, 1, 1, "random"),
    # the wide configs (>= 256 output channels a group): the forward's 64x256 tile and grad_weight's 256-column
    # tile (register-capped); with 520, three column tiles (the last of 8) and the grad_input kernel's 8-warp form
    "cout-256-wide-tile": (2, 64, 256, 13, 17, 3, 3, 1, 1, 1, 1, 1, "random"),
    "cout-520-three-n-tiles": (1, 40, 520, 7, 9, 3, 3, 1, 1, 1, 1, 1, None),
    # two conv groups of 64 channels: grad_out tiles of each group, never resident (see test_tma_tiles_...)
    "groups2-64": (3, 128, 128, 19, 25, 3, 3, 2, 1, 1, 1, 1, "random"),
    # 512 channels in whole chunks (64-wide in 16 bits, 32 in fp32): the grad_input kernel's 4-warp TMA tile
    "cout-512-tma": (2, 64, 512, 9, 13, 3, 3, 1, 1, 1, 1, 1, "random"),
    # 65 positions an image: both backward kernels tile M flat (per_image_tiles), so grad_out's TMA tiles come
    # through the 2-d [M, Cout] descriptor and cross image boundaries
    "flat-tiles-tma": (6, 64, 256, 5, 13, 3, 3, 1, 1, 1, 1, 1, "random"),
    # Ho*Wo a multiple of 8 (not of 16): a 16-bit NCHW output stored in 8-element runs (run_store_length), from 128-row
    # tiles per image (the last one partial), and from flat 64-row tiles (256 columns) that straddle images
    "runs-per-image": (2, 64, 64, 24, 44, 3, 3, 1, 1, 1, 1, 1, "random"),
    "runs-flat-wide": (3, 64, 256, 12, 18, 3, 3, 1, 1, 1, 1, 1, "random"),
}
NAMES = ("input", "offset", "weight", "bias", "mask")
FUZZ_LAYERS = 32  # random layers of test_random_layers_match_float64_reference
TF32_REL = 5e-3  # fp32 with TF32 products (10-bit mantissas): bound on the relative error in norm against float64


@pytest.fixture(autouse=True)
def _strict_fp32():
    """fp32 comparisons run without TF32 (as F.conv2d with cudnn.allow_tf32 = False)."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = old


def _poison_allocator(nbytes=1 << 28):
    """Fill the caching allocator's free memory with NaN so that unwritten output elements show up."""
    t = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del t


def _case(name, dtype, seed=0, channels_last=False):
    n, cin, cout, h, w, kh, kw, g, og, s, p, d, mask = SHAPES[name]
    args, kwargs = make_case(n, cin, cout, h, w, kh, kw, groups=g, offset_groups=og, stride=s, padding=p,
                             dilation=d, mask=mask, dtype=dtype, device="cuda", seed=seed)
    if channels_last:
        args = (args[0].contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
    return args, kwargs


def _fwd_bwd(args, kwargs, backend, dtype=None):
    x, offset, weight, bias = args
    leaves = [t if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True)
              for t in (x, offset, weight, bias, kwargs["mask"])]
    if dtype is not None and args[0].is_contiguous(memory_format=torch.channels_last):
        leaves[0] = leaves[0].detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    _poison_allocator()
    out = deformconv.deform_conv2d(*leaves[:4], stride=kwargs["stride"], padding=kwargs["padding"],
                                   dilation=kwargs["dilation"], mask=leaves[4], backend=backend)
    gen = torch.Generator(device="cuda").manual_seed(99)
    gout = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float64).to(out.dtype)
    wrt = [t for t in leaves if t is not None]
    _poison_allocator()
    grads = iter(torch.autograd.grad(out, wrt, gout))
    return out, [None if t is None else next(grads) for t in leaves]


@pytest.mark.parametrize("dtype", [pytest.param(d, id=str(d).split(".")[-1]) for d in (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("shape", ["det-like", "cout-256-wide-tile", "og8-packed-segments"])
def test_half_error_near_the_rounding_of_the_exact_result(shape, dtype):
    """fp16/bf16 output and grad_weight within a small multiple of the rounding of the exact result (the
    forward's 128-row, 64x256 and packed loops; see Precision in ops/deform_conv2d.py)."""
    args, kwargs = _case(shape, dtype, seed=5)
    mask = kwargs.pop("mask")
    gout, results = None, {}
    for dt, backend in ((dtype, "triton"), (torch.float64, "reference")):
        x, offset, weight, bias, m = [t.to(dt).requires_grad_(True) for t in (*args, mask)]
        out = deformconv.deform_conv2d(x, offset, weight, bias, **kwargs, mask=m, backend=backend)
        if gout is None:
            gen = torch.Generator(device="cuda").manual_seed(6)
            gout = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
        grad_w, = torch.autograd.grad(out, [weight], gout.to(dt))
        results[dt] = dict(output=out, grad_weight=grad_w)
    for name in ("output", "grad_weight"):
        assert_near_rounding(results[dtype][name], results[torch.float64][name], dtype, name)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_triton_matches_float64_reference(shape, dtype, layout):
    args, kwargs = _case(shape, dtype, seed=len(shape), channels_last=layout == "channels_last")
    out, grads = _fwd_bwd(args, kwargs, "triton")
    ref, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
    assert out.dtype == dtype
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)
    assert_close(out, ref, dtype, "output")
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert (g is None) == (r is None)
        if r is not None:
            assert_close(g, r, dtype, f"grad_{name}")


@pytest.mark.parametrize("dtype", DTYPES[1:])  # 16-bit only (columns_usable, grad_columns_usable)
@pytest.mark.parametrize("shape", ["det-like", "wide-256", "og8-packed-segments", "5x5-cout-odd", "flat-tiles-tma"])
@pytest.mark.parametrize("route", ["columns_grad_weight", "columns_grad_data", "both"])
def test_gradients_through_the_column_buffers(shape, dtype, route, forced):
    """options.columns_grad_weight (columns.py: the sampled columns stored, then cuBLAS), options.columns_grad_data
    (grad_col from cuBLAS, then the grad_columns kernel's scatters and sums), and both, against the float64 reference,
    every gradient, channels_last as a network runs it."""
    forced(**{k: True for k in ("columns_grad_weight", "columns_grad_data") if route in (k, "both")})
    args, kwargs = _case(shape, dtype, seed=3, channels_last=True)
    out, grads = _fwd_bwd(args, kwargs, "triton")
    ref, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
    assert_close(out, ref, dtype, "output")
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert (g is None) == (r is None)
        if r is not None:
            assert_close(g, r, dtype, f"grad_{name}")


def random_layer(seed):
    """A random layer configuration (make_case's arguments, plus the dtype, the input's layout and which of input,
    offset, weight, bias and mask require grad) from a seed: conv and offset groups, kernel sizes, stride, padding
    and dilation, odd sizes, narrow and wide channel counts, batch 0 now and then, mask and bias or not. The GPU's
    counterpart of test_deform_conv2d._random_config, whose layers are tiny for Triton's CPU interpreter."""
    rng = random.Random(seed)
    groups, offset_groups = rng.choice([1, 1, 1, 2, 3]), rng.choice([1, 1, 2, 3, 4, 8])
    unit = math.lcm(groups, offset_groups)
    cin = unit * rng.randint(1, max(1, 160 // unit))
    cout = groups * (rng.choice([64, 128, 256, 260]) if rng.random() < 0.2 else rng.randint(1, 48))
    kh, kw = rng.choice([1, 2, 3, 3, 5]), rng.choice([1, 2, 3, 3, 5])
    stride = (rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2]))
    padding = (rng.randint(0, 2), rng.randint(0, 2))
    dilation = (rng.choice([1, 1, 2]), rng.choice([1, 1, 2]))
    # the smallest input with one output position, then up to 40 more rows and columns
    h = max(1, dilation[0] * (kh - 1) + 1 - 2 * padding[0]) + rng.randint(0, 40)
    w = max(1, dilation[1] * (kw - 1) + 1 - 2 * padding[1]) + rng.randint(0, 40)
    n = 0 if rng.random() < 0.08 else rng.randint(1, 4)
    layer = dict(n=n, cin=cin, cout=cout, h=h, w=w, kh=kh, kw=kw, groups=groups, offset_groups=offset_groups,
                 stride=stride, padding=padding, dilation=dilation, mask=rng.choice(["random", None]),
                 bias=rng.random() < 0.8)
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    channels_last = rng.random() < 0.3
    needs = [rng.random() < 0.7 for _ in NAMES]
    if not any(needs):
        needs[rng.randrange(len(NAMES))] = True
    return layer, dtype, channels_last, needs


def _fwd_grads(leaves, kwargs, backend, needs, gout_seed=99):
    """deform_conv2d's output and the gradients of the leaves that `needs` marks (None for the others), outputs
    poisoned before each step."""
    leaves = [None if t is None else t.detach().requires_grad_(bool(need)) for t, need in zip(leaves, needs)]
    _poison_allocator()
    out = deformconv.deform_conv2d(*leaves[:4], stride=kwargs["stride"], padding=kwargs["padding"],
                                   dilation=kwargs["dilation"], mask=leaves[4], backend=backend)
    wrt = [t for t in leaves if t is not None and t.requires_grad]
    if not wrt:
        return out, [None] * len(leaves)
    gen = torch.Generator(device="cuda").manual_seed(gout_seed)
    gout = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.float64).to(out.dtype)
    _poison_allocator()
    grads = iter(torch.autograd.grad(out, wrt, gout, allow_unused=True))
    return out, [next(grads) if t is not None and t.requires_grad else None for t in leaves]


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(FUZZ_LAYERS)])
def test_random_layers_match_float64_reference(seed):
    """Random layers (random_layer) with a random subset of gradients asked for: the output and each gradient asked
    for against the float64 reference, in the dtype's tolerance (none missing: autograd.grad may return None for an
    unused input here, so a gradient the backward failed to give would show). A sweep over the
    heuristics' branches (packed segments, the offset-grouped input, per-image and flat tiles, run stores, wide
    tiles, tap splits, TMA) that the named shapes above pick by hand."""
    layer, dtype, channels_last, needs = random_layer(seed)
    bias = layer.pop("bias")
    args, kwargs = make_case(**layer, dtype=dtype, device="cuda", seed=1000 + seed, bias=bias)
    x = args[0].contiguous(memory_format=torch.channels_last) if channels_last else args[0]
    leaves = [x, *args[1:], kwargs["mask"]]
    out, grads = _fwd_grads(leaves, kwargs, "triton", needs)
    ref, ref_grads = _fwd_grads([None if t is None else t.double() for t in leaves], kwargs, "reference", needs)
    what = f"{layer}, {dtype}, channels_last={channels_last}, needs={needs}"
    assert out.dtype == dtype, what
    assert_close(out, ref, dtype, f"output of {what}")
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert (g is None) == (r is None), f"grad_{name} of {what}"
        if r is not None:
            assert_close(g, r, dtype, f"grad_{name} of {what}")


@pytest.mark.parametrize("dtype,tf32", [(torch.float16, False), (torch.bfloat16, False), (torch.float32, False),
                                        (torch.float32, True)], ids=["float16", "bfloat16", "float32", "float32-tf32"])
@pytest.mark.parametrize("shape", ["det-like", "cout-256-wide-tile", "og8-packed-segments", "groups2-64",
                                   "cout-512-tma", "flat-tiles-tma"])
def test_tma_tiles_match_pointer_tiles(shape, dtype, tf32, monkeypatch, forced):
    """Every kernel's default config with Config.tma forced on, then off: the forward and grad_weight equal bit for
    bit (the same products in the same order), and both runs match the float64 reference (in TF32, as fp32 runs
    by default: within TF32's error)."""
    torch.backends.cudnn.allow_tf32 = tf32  # the autouse fixture restores it
    forced(columns_grad_weight=False)  # grad_weight's kernel at every width, not the column buffer's cuBLAS product
    args, kwargs = _case(shape, dtype, seed=17)
    ref, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)

    def check(actual, expected, what):
        if not tf32:
            return assert_close(actual, expected, dtype, what)
        assert not torch.isnan(actual).any(), f"{what}: NaN in result"
        rel = ((actual.double() - expected.double()).norm() / expected.double().norm()).item()
        assert rel < TF32_REL, f"{what}: relative error {rel:.2e}"

    runs = {}
    for tma in (True, False):
        with options.override(tma=tma):
            runs[tma] = _fwd_bwd(args, kwargs, "triton")
            metas = launch_metas()
        assert len(metas) == 3 and all(m["TMA"] == tma for m in metas)
        if shape == "flat-tiles-tma":  # both backward kernels tile M flat: the 2-d grad_out descriptor
            assert [m["PER_IMAGE"] for m in metas[1:]] == [False, False]
        out, grads = runs[tma]
        check(out, ref, f"output (tma={tma})")
        for name, g, r in zip(NAMES, grads, ref_grads):
            if r is not None:
                check(g, r, f"grad_{name} (tma={tma})")
    assert torch.equal(runs[True][0], runs[False][0])
    assert torch.equal(runs[True][1][2], runs[False][1][2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wide", [False, True], ids=["16-byte-runs", "wide-runs"])
@pytest.mark.parametrize("shape", ["runs-per-image", "runs-flat-wide", "det-like", "og8-packed-segments"])
def test_forward_runs_and_fused_layout_pass_change_no_bits(shape, wide, dtype, monkeypatch, forced):
    """The forward with its NCHW output stored in runs (options.run_stores) and the weight packed in the input's
    transpose launch (options.fused_prep), then with both off: the same bits, and the float64 reference's numbers. The
    run stores apply to 16-bit outputs whose Ho*Wo is a multiple of 8 (here the two runs-* shapes), or
    (CodegenProfile.wide_run_stores) to any output with unpacked segments, in runs of the largest power of two dividing
    Ho*Wo and the tile, up to 16 bytes; the
    fused pass to every NCHW input."""
    kernels = kernel_modules()

    forced(profile=dataclasses.replace(kernels.forward.codegen_profile(), wide_run_stores=wide))
    args, kwargs = _case(shape, dtype, seed=23)
    ref = deformconv.deform_conv2d(*[t.double() if t is not None else None for t in args],
                                   **dict(kwargs, mask=None if kwargs["mask"] is None else kwargs["mask"].double()),
                                   backend="reference")
    outs, stores = [], []
    for on in (True, False):
        forced(run_stores=on, fused_prep=on)
        _poison_allocator()
        outs.append(deformconv.deform_conv2d(*args, **kwargs, backend="triton"))
        stores.append(launch_metas()[0])
    if wide:
        positions, block_m = outs[0].shape[2] * outs[0].shape[3], stores[0]["BLOCK_M"]
        run = min(math.gcd(positions, block_m), 16 // dtype.itemsize) if stores[0]["NSEG"] == 1 else 0
        expected = run if run > 1 else 0
    else:
        expected = 8 if shape.startswith("runs-") and dtype != torch.float32 else 0
    assert [m["RUN_STORE"] for m in stores] == [expected, 0]
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], ref, dtype, "output")


def test_float64_on_cuda_matches_torchvision():
    tv = pytest.importorskip("torchvision")
    args, kwargs = _case("odd-groups-og4-s2-d2", torch.float64, seed=3)
    out, grads = _fwd_bwd(args, kwargs, None)
    x, offset, weight, bias = [t.detach().requires_grad_(True) for t in args]
    mask = kwargs["mask"].detach().requires_grad_(True)
    ref = tv.ops.deform_conv2d(x, offset, weight, bias, kwargs["stride"], kwargs["padding"], kwargs["dilation"], mask)
    gen = torch.Generator(device="cuda").manual_seed(99)
    gout = torch.randn(ref.shape, generator=gen, device="cuda", dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (x, offset, weight, bias, mask), gout)
    assert_close(out, ref, torch.float64, "output")
    for name, g, r in zip(NAMES, grads, ref_grads):
        assert_close(g, r, torch.float64, f"grad_{name}")


def test_tf32_follows_cudnn_flag():
    """fp32 with cudnn.allow_tf32 on is within TF32 error of the exact result (and not bitwise the ieee one)."""
    args, kwargs = _case("wide-256", torch.float32, seed=5)
    exact = deformconv.deform_conv2d(*[t.double() for t in args], **dict(kwargs, mask=kwargs["mask"].double()),
                                     backend="reference")
    strict = deformconv.deform_conv2d(*args, **kwargs, backend="triton")
    torch.backends.cudnn.allow_tf32 = True
    loose = deformconv.deform_conv2d(*args, **kwargs, backend="triton")
    rel = lambda a: ((a.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert rel(strict) < 1e-5
    assert 1e-6 < rel(loose) < TF32_REL


@pytest.mark.parametrize("k,offset_groups", [(3, 1), (1, 8)], ids=["3x3-nhwc", "1x1-og8-offset-grouped"])
def test_int64_indexing_large_input(k, offset_groups):
    """An input of more than 2**31 elements: the last rows (highest addresses) are right, read channels-last
    or (8-channel offset groups) from the offset-grouped copy."""
    n, cin, cout, h, w = 1, 64, 16, 5800, 5800
    assert n * cin * h * w > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, w, cin, generator=gen, device="cuda", dtype=torch.float16).permute(0, 3, 1, 2)
    offset = (torch.rand(n, 2 * offset_groups * k * k, h, w, generator=gen, device="cuda", dtype=torch.float16) - 0.5)
    weight = torch.randn(cout, cin, k, k, generator=gen, device="cuda", dtype=torch.float16) * 0.05
    out = deformconv.deform_conv2d(x, offset, weight, padding=k // 2, backend="triton")
    crop = 24
    ref = deformconv.deform_conv2d(x[:, :, h - crop:].double(), offset[:, :, h - crop:].double(), weight.double(),
                                   padding=k // 2, backend="reference")
    assert_close(out[:, :, h - crop + 4:], ref[:, :, 4:], torch.float16, "last rows")


def test_compile_export_and_autocast():
    layer = deformconv.ModulatedDeformConv2dPack(16, 32, 3, padding=1).cuda()
    with torch.no_grad():
        layer.conv_offset.weight.normal_(0, 0.1)
    x = torch.randn(2, 16, 12, 13, device="cuda")
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, atol=1e-4, rtol=1e-4)
    exported = torch.export.export(layer, (x,))
    assert any("deformconv.deform_conv2d" in str(nd.target) for nd in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), eager, atol=1e-4, rtol=1e-4)
    for dt in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dt):
            y = layer(x)
        assert y.dtype == dt
        torch.testing.assert_close(y.float(), eager, atol=5e-2, rtol=5e-2)


def test_deterministic_backward_is_bitwise_reproducible():
    args, kwargs = _case("det-like", torch.float16, seed=8)
    torch.use_deterministic_algorithms(True)
    try:
        _, g1 = _fwd_bwd(args, kwargs, "triton")
        _, g2 = _fwd_bwd(args, kwargs, "triton")
    finally:
        torch.use_deterministic_algorithms(False)
    for name, a, b in zip(NAMES, g1, g2):
        assert torch.equal(a, b), f"grad_{name} differs between two deterministic runs"
    ref, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
    for name, g, r in zip(NAMES, g1, ref_grads):
        assert_close(g, r, torch.float16, f"grad_{name}")


def _train(backend, steps=40):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        deformconv.ModulatedDeformConv2dPack(16, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 4),
    ).cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 3, 16, 16, generator=gen, device="cuda")
    y = (x[:, 0, 4:12, 4:12].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    with deformconv_backend(backend):
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


class deformconv_backend:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        import os

        self.old = os.environ.get("DEFORMCONV_BACKEND")
        os.environ["DEFORMCONV_BACKEND"] = self.name

    def __exit__(self, *exc):
        import os

        if self.old is None:
            os.environ.pop("DEFORMCONV_BACKEND", None)
        else:
            os.environ["DEFORMCONV_BACKEND"] = self.old


def test_training_loop_triton_matches_reference():
    tri = _train("triton")
    ref = _train("reference")
    assert tri[-1] < 0.7 * tri[0]
    for a, b in zip(tri, ref):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b))


def test_repeated_calls_and_misaligned_pointers():
    """The second call of a shape relaunches the compiled kernels directly (common/launch.py, Launch):
    it must give the first call's bits. Tensors whose data pointer is not 16-byte aligned (views at an odd
    storage offset) get their own plan and still match the float64 reference."""
    args, kwargs = _case("og8-packed-segments", torch.float16, seed=21)
    out1, grads1 = _fwd_bwd(args, kwargs, "triton")
    out2, grads2 = _fwd_bwd(args, kwargs, "triton")
    assert torch.equal(out1, out2)
    for name, g1, g2 in zip(NAMES, grads1, grads2):
        if name == "input":  # fp32 atomics: equal up to the order of the additions
            assert_close(g2, g1, torch.float16, "grad_input (second call)")
        else:  # plain stores and fixed-order sums: the same bits
            assert torch.equal(g1, g2), f"grad_{name} differs on the second call"
    x, offset, weight, bias = args
    big_off = torch.empty(offset.numel() + 1, dtype=offset.dtype, device="cuda")
    off_view = big_off[1:].view_as(offset).copy_(offset)  # data_ptr % 16 == 2
    big_x = torch.empty(x.numel() + 3, dtype=x.dtype, device="cuda")
    x_view = big_x[3:].view_as(x).copy_(x)
    assert off_view.data_ptr() % 16 != 0 and x_view.data_ptr() % 16 != 0
    for _ in range(2):
        out, grads = _fwd_bwd((x_view, off_view, weight, bias), kwargs, "triton", dtype=torch.float16)
        ref_out, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
        assert_close(out, ref_out, torch.float16, "output (misaligned)")
        for name, g, r in zip(NAMES, grads, ref_grads):
            assert_close(g, r, torch.float16, f"grad_{name} (misaligned)")


@pytest.mark.parametrize("shape", ["og8-packed-segments", "cout-512-tma"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_cuda_graph_replay_matches_eager(deterministic, shape, forced):
    """Forward+backward captured in a CUDA graph (the eager fast path and the direct kernel relaunch inside)
    and replayed on new data gives the eager results on that data; in deterministic mode (the fixed-point
    scale computed on the device, no sync) bit for bit, grad_input included. At 512 output channels grad_weight
    takes the column buffer (forced), beside the grad_input kernel on the side stream (outside deterministic mode)."""
    if shape == "cout-512-tma":
        forced(columns_grad_weight=True)
    torch.use_deterministic_algorithms(deterministic)
    try:
        _graph_replay_matches_eager(deterministic, shape)
    finally:
        torch.use_deterministic_algorithms(False)


def _graph_replay_matches_eager(deterministic, shape):
    args, kwargs = _case(shape, torch.float16, seed=41)
    leaves = [t.detach().requires_grad_(True) for t in (*args, kwargs["mask"])]
    x, offset, weight, bias, mask = leaves
    gen = torch.Generator(device="cuda").manual_seed(42)
    with torch.no_grad():  # a graph built here on the default stream would pin the leaves' grad accumulators
        out0 = deformconv.deform_conv2d(x, offset, weight, bias, stride=kwargs["stride"],  # to that stream,
                                        padding=kwargs["padding"], dilation=kwargs["dilation"], mask=mask)
    gout = torch.randn(out0.shape, generator=gen, device="cuda", dtype=out0.dtype)

    def step():
        out = deformconv.deform_conv2d(x, offset, weight, bias, stride=kwargs["stride"], padding=kwargs["padding"],
                                       dilation=kwargs["dilation"], mask=mask)
        # out detached: the captured graph's autograd nodes, kept alive by static's out, would hold the leaves'
        # grad accumulators to the capture stream when the eager step below runs on the default stream
        return (out.detach(), *torch.autograd.grad(out, leaves, gout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, plans, allocator (torch's documented capture recipe)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():  # new data in the captured inputs
        for t in leaves:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32).to(t.dtype))
        gout.copy_(torch.randn(gout.shape, generator=gen, device="cuda", dtype=torch.float32).to(gout.dtype))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [t.clone() for t in static]
    eager = step()
    for name, r, e in zip(("output",) + NAMES, replayed, eager):
        if name == "input" and not deterministic:  # fp32 atomics: equal up to the order of the additions
            assert_close(r, e, torch.float16, "grad_input (replay)")
        else:
            assert torch.equal(r, e), f"{name} differs between the graph replay and eager"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["cout-512-tma", "og8-packed-segments"])
@pytest.mark.parametrize("columns", [None, True], ids=["fused-grad-weight", "column-buffer"])
def test_concurrent_backward_matches_sequential(shape, dtype, columns, monkeypatch, forced):
    """Small batches run grad_weight on a side stream beside the grad_input kernel (concurrent_backward): the first
    call (planning) and the second (planned) both take the side stream, give grad_weight's bits twice, and match the
    float64 reference as the sequential backward (DEFORMCONV_BACKWARD_STREAMS=0) does; with the column buffer forced
    (columns.py, 16 bits, one conv group) its kernel and product run there instead of the fused kernel."""
    kernels = kernel_modules()
    forced(columns_grad_weight=columns)

    forks = []
    side_stream = kernels.backward.side_stream
    monkeypatch.setattr(kernels.backward, "side_stream", lambda device: forks.append(device) or side_stream(device))
    args, kwargs = _case(shape, dtype, seed=29)
    ref_out, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
    options.clear()
    runs = [_fwd_bwd(args, kwargs, "triton")[1] for _ in range(2)]
    assert len(forks) == 2 and all(d.type == "cuda" for d in forks)
    assert torch.equal(runs[0][2], runs[1][2]), "grad_weight differs between the planning and the planned call"
    monkeypatch.setenv("DEFORMCONV_BACKWARD_STREAMS", "0")
    runs.append(_fwd_bwd(args, kwargs, "triton")[1])
    assert len(forks) == 2
    for grads, how in zip(runs, ("concurrent, first call", "concurrent, planned", "sequential")):
        for name, g, r in zip(NAMES, grads, ref_grads):
            if r is not None:
                assert_close(g, r, dtype, f"grad_{name} ({how})")


@pytest.mark.parametrize("shape", ["segments-og3-g2", "og8-packed-segments"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomics", "deterministic"])
def test_backward_in_one_image_chunks_matches_reference(shape, deterministic, monkeypatch, forced):
    """The backward forced to one image a chunk (segments-og3-g2: the second image's grad_offset/grad_mask
    slices are not 16-byte aligned, so its chunk gets its own plan) matches the float64 reference."""
    kernels = kernel_modules()

    forced(default_workspace_budget=0.0, min_chunk_programs=1)
    # the chunks themselves: these small layers' weights are as large as their inputs, so by memory they would run whole
    monkeypatch.setattr(kernels.schedule, "_chunked_weight_bytes", lambda *a: 0)
    chunks = []
    real = kernels.backward._backward_chunk
    monkeypatch.setattr(kernels.backward, "_backward_chunk",
                        lambda go, x, *a: chunks.append(x.shape[0]) or real(go, x, *a))
    args, kwargs = _case(shape, torch.float16, seed=13)
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, grads = _fwd_bwd(args, kwargs, "triton")
    finally:
        torch.use_deterministic_algorithms(False)
    assert chunks == [1] * args[0].shape[0]
    ref_out, ref_grads = _fwd_bwd(args, kwargs, "reference", dtype=torch.float64)
    assert_close(out, ref_out, torch.float16, "output")
    for name, g, r in zip(NAMES, grads, ref_grads):
        if r is not None:
            assert_close(g, r, torch.float16, f"grad_{name} (one-image chunks)")


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_backward_workspace_at_most_twice_the_input(layout, monkeypatch, forced):
    """det-s3 of the benchmark (N=8, 128 -> 128 channels, 100x152, fp16): the extra peak memory of a
    forward+backward, less the output and the five gradients it returns, stays within 2x the input's size
    (the batch goes through the backward in chunks); the gradients equal the whole-batch backward's."""
    kernels = kernel_modules()

    args, kwargs = make_case(8, 128, 128, 100, 152, 3, 3, padding=1, dtype=torch.float16, device="cuda", seed=17)
    gout = torch.randn(8, 128, 100, 152, device="cuda", dtype=torch.float16)
    if layout == "channels_last":  # grad_out as autograd would give it: in the output's layout
        args = (args[0].contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
        gout = gout.contiguous(memory_format=torch.channels_last)
    leaves = [t.detach().requires_grad_(True) for t in (*args, kwargs["mask"])]

    def step():
        for t in leaves:
            t.grad = None
        out = deformconv.deform_conv2d(*leaves[:4], padding=1, mask=leaves[4], backend="triton")
        out.backward(gout)
        return out.numel() * out.element_size()

    step()  # compile and plan outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out_bytes = step()
    torch.cuda.synchronize()
    returned = out_bytes + sum(t.grad.numel() * t.grad.element_size() for t in leaves)
    workspace = torch.cuda.max_memory_allocated() - base - returned
    input_bytes = args[0].numel() * args[0].element_size()
    assert kernels.schedule.backward_chunk_images(leaves[0], gout, True, True, False) < 8
    assert workspace <= 2 * input_bytes, f"workspace {workspace / input_bytes:.2f}x the input"
    chunked = [t.grad.clone() for t in leaves]
    forced(default_workspace_budget=float("inf"))
    step()
    for name, g, r in zip(NAMES, chunked, [t.grad for t in leaves]):
        assert_close(g, r, torch.float16, f"grad_{name} (chunked vs whole batch)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FINISH_CASES, ids=FINISH_CASE_IDS)
def test_finish_grads_sums_partials_in_order_and_unpacks(case, dtype):
    """The backward's finishing launch on the GPU, bf16 included (and a float32 weight used in bf16): see
    conftest.check_finish_grads."""
    check_finish_grads("cuda", dtype, *case, input_dtype=torch.bfloat16 if dtype == torch.float32 else None)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_backward_layout_passes_zero_and_sum_on_the_way(layout):
    """The backward's layout copies on the GPU: to_nhwc zeroes grad_input's accumulator (poisoned here) whether or not
    it transposes; to_nhwc_summed gives an NCHW grad_out's channel sums from its transpose pass (a channels-last one
    needs no pass and gives None: the backward sums it elsewhere)."""
    kernels = kernel_modules()

    g = torch.Generator(device="cuda").manual_seed(5)
    t = torch.randn(3, 40, 13, 17, generator=g, device="cuda").half()
    if layout == "channels_last":
        t = t.contiguous(memory_format=torch.channels_last)
    acc = torch.full((3, 1, 13, 17, 40), float("nan"), device="cuda")
    x = kernels.layout.to_nhwc(t, acc)
    assert x.is_contiguous(memory_format=torch.channels_last) and torch.equal(x, t)
    assert torch.equal(acc, torch.zeros_like(acc))
    y, sums = kernels.layout.to_nhwc_summed(t)
    assert torch.equal(y, t) and y.is_contiguous(memory_format=torch.channels_last)
    if layout == "channels_last":
        assert sums is None
    else:
        assert sums.dtype == torch.float32 and sums.shape[1] == 40
        torch.testing.assert_close(sums.sum(0), t.float().sum((0, 2, 3)), atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_layout", ["nchw", "channels_last", "strided"])
@pytest.mark.parametrize("k_major", [False, True], ids=["cin-cout", "cout-cin"])
@pytest.mark.parametrize("shape", [(520, 40, 3, 3, 2), (64, 512, 1, 5, 1), (37, 16, 5, 5, 1)],
                         ids=["cout-520-g2", "1x5-cin-512", "5x5-cout-37"])
def test_pack_weight_kernel_matches_torch_permute(shape, k_major, weight_layout, dtype):
    """pack_weight's Triton pass on the GPU (with the cast from an fp32 weight) is bitwise torch's permuting copy of
    weight.to(dtype), for each weight layout; the output is poisoned first."""
    kernels = kernel_modules()

    cout, cin_g, kh, kw, groups = shape
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(cout, cin_g * (2 if weight_layout == "strided" else 1), kh, kw, generator=g, device="cuda")
    if weight_layout == "strided":
        w = w[:, ::2]
    elif weight_layout == "channels_last":
        w = w.contiguous(memory_format=torch.channels_last)
    with nan_filled_empty():
        got = kernels.packing.pack_weight(w, groups, k_major, dtype)
    ref = w.to(dtype).reshape(groups, cout // groups, cin_g, kh * kw)
    ref = (ref.permute(0, 3, 1, 2) if k_major else ref.permute(0, 3, 2, 1)).contiguous()
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", ["packed-og8", "long-segment"])
@pytest.mark.parametrize("where,value", [("offset-dy", float("nan")), ("offset-dy", float("inf")),
                                         ("offset-dx", float("-inf")), ("mask", float("nan")), ("mask", float("inf"))],
                         ids=["dy-nan", "dy-inf", "dx--inf", "mask-nan", "mask-inf"])
def test_non_finite_offsets_and_masks_as_in_torchvision(dtype, layer, where, value):
    """The kernels' output and every gradient are non-finite exactly where torchvision's (float64, on the CPU: its CUDA
    kernel makes illegal memory accesses on such offsets) are, and within the dtype's tolerance elsewhere: a NaN
    sample point samples NaN, an infinite one 0 (the gradient of its other offset component NaN). Packed segments
    (8 offset groups of 8 channels) and one long segment (64)."""
    import torchvision

    og = 8 if layer == "packed-og8" else 1
    args, kwargs = make_case(2, 64, 32, 9, 11, 3, 3, offset_groups=og, padding=1, dtype=torch.float64, seed=12)
    x, offset, weight, bias = (t.cuda() for t in args)
    offset, mask = offset.clone(), kwargs["mask"].cuda().clone()
    if where == "mask":
        mask[0, 4, 2, 3] = value
    else:
        offset[0, 8 if where == "offset-dy" else 9, 2, 3] = value
    gout = torch.randn(2, 32, 9, 11, device="cuda", dtype=torch.float64,
                       generator=torch.Generator("cuda").manual_seed(3))

    def run(fn, cast, device="cuda"):  # both sides see the inputs rounded to dtype
        leaves = [t.detach().to(dtype).to(device, cast).requires_grad_(True) for t in (x, offset, weight, bias, mask)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, gout.to(dtype).to(device, cast))]

    ours = run(lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m, backend="triton"), dtype)
    if where != "mask" and value != value:
        # a NaN offset makes torchvision's kernels index memory with a NaN cast to an integer (the CPU one crashed at
        # these layers): the float64 reference backend, which gives torchvision's results where torchvision's CPU
        # kernel runs (tests/test_deform_conv2d.py), is the oracle
        theirs = run(lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m, backend="reference"),
                     torch.float64, "cpu")
    else:
        theirs = run(lambda x, o, w, b, m: torchvision.ops.deform_conv2d(x, o, w, b, padding=1, mask=m),
                     torch.float64, "cpu")
    ours = [t.cpu() for t in ours]
    for name, a, t in zip(("output", *NAMES), ours, theirs):
        assert torch.equal(torch.isfinite(a), torch.isfinite(t)), (name, int((~torch.isfinite(a)).sum()),
                                                                    int((~torch.isfinite(t)).sum()))
        finite = torch.isfinite(t)
        assert_close(a[finite], t[finite], dtype, name)
