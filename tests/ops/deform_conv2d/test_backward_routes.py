"""The backward's routes on the CPU (interpreter), each against the oracle: grad_input's split taps, grad_weight's
splits and bias sums, the column buffers, deterministic mode's fixed-point sums, the finishing pass."""

import dataclasses
import zlib

import pytest
import torch
from _dcn_cases import (
    BACKENDS,
    CONFIGS,
    GRAD_NAMES,
    TRITON_BACKENDS,
    channels_last_leaf,
    compare_to_oracle,
    deterministic_mode,
    fwd_bwd,
    leaves_with_grad,
)
from _naive import naive_deform_conv2d
from conftest import (
    FINISH_CASE_IDS,
    FINISH_CASES,
    assert_close,
    check_finish_grads,
    kernel_modules,
    launch_metas,
    make_case,
)

import deformconv

pytestmark = pytest.mark.usefixtures("implicit_gemm_for_groups")  # these kernels' routes, grouped cases included


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("split", [2, 4, 7], ids=["taps-split-2", "taps-split-4", "taps-split-7-some-empty"])
@pytest.mark.parametrize("config", ["3x3-pad1", "nonsquare-og4", "og4-packed-segments", "groups2-og4-packed-tail"])
def test_grad_input_kernel_taps_split_across_programs(backend, dtype, split, config, monkeypatch, forced):
    """The grad_input/offset/mask kernel with each M tile's taps split over `split` programs (Config.split)
    gives the oracle's gradients, also where some programs get no tap (nonsquare-og4 has 6)."""

    kernels = kernel_modules()

    forced(configs={"bwd_data": lambda c: dataclasses.replace(c, split=split)})
    forced()
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 983)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert [cfg.split for key, cfg in kernels.launch.chosen_configs().items() if key[0] == "bwd_data"] == [split]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("split,per_image", [(1, None), (3, True), (3, False)],
                         ids=["split-1-channel-sum", "split-3-bias-fused-tiles-per-image",
                              "split-3-bias-fused-tiles-flat"])
@pytest.mark.parametrize("config,weight_layout", [("3x3-pad1", "contiguous"), ("3x3-pad1", "channels_last"),
                                                  ("zero-mask-no-bias", "contiguous"),
                                                  ("groups2-og4-packed-tail", "channels_last")],
                         ids=["3x3-pad1", "3x3-pad1-channels-last-weight", "zero-mask-no-bias",
                              "groups2-og4-packed-tail-channels-last-weight"])
def test_grad_weight_kernel_sums_grad_bias(backend, dtype, split, per_image, weight_layout, config, monkeypatch,
                                           forced):
    """In a one-chunk backward whose grad_weight is split (fused_bias) the grad_weight kernel also sums grad_bias, in
    extra programs, into fp32 partials summed after, and no separate channel sum runs; with split 1 the channel sum
    does. Both give the oracle's gradients, with either weight layout (grad_weight comes back in the weight's); the
    fused sums with M tiles per image and flat (per_image: forced for every kernel; None: the heuristic's)."""

    kernels = kernel_modules()

    if per_image is not None:
        forced(per_image=per_image)
    forced(configs={"bwd_weight": lambda c: dataclasses.replace(c, split=split)})
    forced()
    sums, finishes = [], []
    real_sum, real_finish = kernels.backward.channel_sum, kernels.backward.finish_grads
    monkeypatch.setattr(kernels.backward, "channel_sum", lambda t: sums.append(t.shape) or real_sum(t))
    monkeypatch.setattr(kernels.backward, "finish_grads",
                        lambda w, pw, pb, *a: (finishes.append((pw is not None, pb is not None))
                                               or real_finish(w, pw, pb, *a)))
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 977)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    if weight_layout == "channels_last":
        leaves64[2] = channels_last_leaf(leaves64[2])
    compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    has_bias = leaves64[3] is not None
    fused = has_bias and split > 1
    assert len(sums) == (1 if has_bias and not fused else 0)
    assert [cfg.split for key, cfg in kernels.launch.chosen_configs().items() if key[0] == "bwd_weight"] == [split]
    metas = [m for m in launch_metas() if "NEED_BIAS" in m]
    assert [m["NEED_BIAS"] for m in metas] == [fused]
    # split 1: the kernel stores grad_weight itself, the finishing launch only sums the channel sum's partials (if a
    # bias); split 3: it finishes grad_weight, with grad_bias's partials where fused
    assert finishes == ([(False, True)] if has_bias else []) if split == 1 else [(True, fused)]


def _column_products(kernels, buffers, monkeypatch, forced, **route):
    """Forces a column-buffer route (an options field) with buffers "one" (the defaults), "several" (one image a chunk,
    one M tile of rows a buffer) or "unbounded" (an infinite workspace budget); returns the list that records the
    shape of each cuBLAS product's first operand."""
    forced(**route)
    if buffers == "several":
        forced(default_workspace_budget=0.0, min_chunk_programs=1)
    if buffers == "unbounded":
        forced(default_workspace_budget=float("inf"))
    if buffers != "one":
        monkeypatch.setattr(kernels.columns, "MIN_BUFFER", 0)
    products = []
    real = kernels.columns.mm_fp32
    monkeypatch.setattr(kernels.columns, "mm_fp32", lambda a, b: products.append(a.shape) or real(a, b))
    return products


def _compare_column_route(backend, dtype, config, n, products):
    """CONFIGS[config] with n images (9x9 for 3x3-pad1: 81 positions an image, 2 M tiles) against the oracle, every
    gradient; the route took cuBLAS's products where it applies (one conv group, 16 bits: returned), else none."""
    larger = dict(h=9, w=9) if config == "3x3-pad1" else {}
    args, kwargs = make_case(**dict(CONFIGS[config], n=n, **larger), dtype=dtype,
                             seed=zlib.crc32(config.encode()) % 991)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    uses = CONFIGS[config].get("groups", 1) == 1 and dtype != torch.float32
    assert bool(products) == uses
    return uses


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config", ["3x3-pad1", "stride2-dil2", "1x1-no-mask", "og4-packed-segments",
                                    "long-segment-partial-chunk", "groups2-og2"])
@pytest.mark.parametrize("buffers", ["one", "several", "unbounded"],
                         ids=["one-buffer", "chunks-and-several-buffers", "infinite-budget"])
def test_grad_weight_through_the_column_buffer(backend, dtype, config, buffers, monkeypatch, forced):
    """options.columns_grad_weight: grad_weight from the sampled column buffer and one product per buffer gives the
    oracle's gradients (the others unchanged), with the input read NHWC or offset-grouped (short segments), also with
    the batch in chunks of images and each chunk's buffer holding one M tile of rows, and under an infinite workspace
    budget (one buffer; 16 bits, one layer); conv groups and fp32 (which keep the fused kernel) too."""
    if buffers == "unbounded" and (config != "3x3-pad1" or dtype == torch.float32):
        pytest.skip("the infinite budget: one 16-bit layer")
    if buffers == "several" and (config == "groups2-og2" or dtype == torch.float32):
        pytest.skip("the route does not apply: the buffers' bounds do not matter")
    kernels = kernel_modules()
    products = _column_products(kernels, buffers, monkeypatch, forced, columns_grad_weight=True)
    uses = _compare_column_route(backend, dtype, config, 3, products)
    if config == "3x3-pad1" and uses:  # one product a call, or one per image and M tile
        assert len(products) == (3 * 2 if buffers == "several" else 1)


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config,buffers", [("3x3-pad1", "one"), ("3x3-pad1", "several"), ("far-outside", "one"),
                                            ("og2-long-segments", "several"), ("long-segment-partial-chunk", "one"),
                                            ("groups2-og2", "one")])
def test_grad_data_through_the_grad_col_buffer(backend, dtype, config, buffers, monkeypatch, forced):
    """options.columns_grad_data: grad_col from one product per buffer, scattered and summed by the grad_columns
    kernel, gives the oracle's gradients, with offset groups, partial channel chunks, points outside the image, the
    batch in one-image chunks and one M tile of rows a buffer, the input read NHWC or offset-grouped (short
    segments); where it does not apply (conv groups, fp32) the fused kernel runs instead."""
    kernels = kernel_modules()
    products = _column_products(kernels, buffers, monkeypatch, forced, columns_grad_data=True)
    uses = _compare_column_route(backend, dtype, config, 2, products)
    if config == "3x3-pad1" and uses:  # one product of all 162 rows, or buffers of at most one M tile of rows
        assert sum(p[0] for p in products) == 2 * 81
        assert len(products) == 1 if buffers == "one" else max(p[0] for p in products) <= kernels.columns.BLOCK_M


def _compare_grads_wrt(backend, dtype, wrt, seed, deterministic=False):
    """3x3-pad1 with only the leaves named in wrt requiring grad (so the backward's needs leave the others out): their
    gradients, ours (in deterministic mode if asked) against the oracle's."""
    args, kwargs = make_case(**dict(CONFIGS["3x3-pad1"], n=2), dtype=dtype, seed=seed)
    leaves = {k: v.detach().requires_grad_(k in wrt) for k, v in zip(GRAD_NAMES, leaves_with_grad(args, kwargs, dtype))}
    leaves64 = {k: v.detach().double().requires_grad_(k in wrt) for k, v in leaves.items()}
    g = torch.Generator().manual_seed(3)
    grads = {}
    for name, ls, fn in (("ours", leaves, lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend)),
                         ("oracle", leaves64, naive_deform_conv2d)):
        with deterministic_mode(deterministic and name == "ours"):
            out = fn(ls["input"], ls["offset"], ls["weight"], ls["bias"], stride=kwargs["stride"],
                     padding=kwargs["padding"], dilation=kwargs["dilation"], mask=ls["mask"])
            if name == "ours":
                gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
            grads[name] = torch.autograd.grad(out, [ls[k] for k in wrt], gout.to(out.dtype))
    for k, ours, ref in zip(wrt, grads["ours"], grads["oracle"]):
        assert_close(ours, ref, dtype, f"grad_{k}")


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("wrt", [("offset", "mask"), ("input",)], ids=["offset-mask-only", "input-only"])
def test_grad_data_through_the_grad_col_buffer_computes_what_is_asked(backend, dtype, wrt, forced):
    """options.columns_grad_data with only some of grad_input, grad_offset and grad_mask asked for (only those leaves
    require grad, so the backward's needs leave the others out): those equal the oracle's."""
    forced(columns_grad_data=True)
    _compare_grads_wrt(backend, dtype, wrt, seed=211)


@pytest.mark.parametrize("backend,dtype", [p for p in TRITON_BACKENDS if p.values[1] != torch.float32])
@pytest.mark.parametrize("wrt", [("offset", "weight", "mask"), ("input", "weight")], ids=["no-grad-input", "all"])
def test_column_routes_stay_off_in_deterministic_mode(backend, dtype, wrt, monkeypatch, forced):
    """Both column routes forced, in deterministic mode: the fused kernels run (cuBLAS's products would need
    CUBLAS_WORKSPACE_CONFIG there), also where grad_input, and with it the fixed-point accumulator, is not asked for;
    the gradients asked for equal the oracle's."""
    kernels = kernel_modules()
    products = _column_products(kernels, "one", monkeypatch, forced, columns_grad_weight=True, columns_grad_data=True)
    _compare_grads_wrt(backend, dtype, wrt, seed=307, deterministic=True)
    assert not products


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_eager_backward_keeps_the_fused_kernels(backend, dtype, monkeypatch, forced):
    """Unforced, an eager call's backward takes the fused kernels at any width (the column buffers are the compile
    route's from columns.MIN_COUT output and columns.MIN_CIN_GRAD_COL input channels on: test_compile_route.py), and
    gives the oracle's gradients."""
    kernels = kernel_modules()
    products = _column_products(kernels, "one", monkeypatch, forced)
    cin, cout = kernels.columns.MIN_CIN_GRAD_COL, kernels.columns.MIN_COUT
    args, kwargs = make_case(n=2, cin=cin, cout=cout, h=5, w=4, kh=3, kw=3, padding=1, dtype=dtype, seed=cout)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert not products


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("direct", [True, False], ids=["stored-by-its-kernel", "finished-from-partials"])
@pytest.mark.parametrize("weight_layout", ["contiguous", "channels_last"])
def test_grad_weight_at_split_1_stored_directly_or_finished(backend, dtype, direct, weight_layout, monkeypatch, forced):
    """At split 1 in a one-chunk backward the grad_weight kernel writes grad_weight in the weight's layout and dtype
    (options.direct_grad_weight), or, turned off, fp32 partials that finish_grads unpacks: the oracle's gradients either
    way, in the weight's memory format."""

    kernels = kernel_modules()

    forced(configs={"bwd_weight": lambda c: dataclasses.replace(c, split=1)})
    forced()
    forced(direct_grad_weight=direct)
    finishes = []
    real_finish = kernels.backward.finish_grads
    monkeypatch.setattr(kernels.backward, "finish_grads",
                        lambda w, pw, pb, *a: finishes.append(pw is not None) or real_finish(w, pw, pb, *a))
    config = "groups2-og4-packed-tail"
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 971)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    if weight_layout == "channels_last":
        leaves64[2] = channels_last_leaf(leaves64[2])
    assert leaves64[3] is not None  # a bias: its channel sum's partials are finished either way
    compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    assert finishes == [not direct]  # one finishing launch (grad_bias), with grad_weight's partials unless direct
    x, offset, weight, bias, _ = (t.detach().to(dtype).requires_grad_(True) for t in leaves64)
    deformconv.deform_conv2d(x, offset, weight, bias, **kwargs, backend=backend).sum().backward()
    fmt = torch.channels_last if weight_layout == "channels_last" else torch.contiguous_format
    assert weight.grad.is_contiguous(memory_format=fmt) and weight.grad.dtype == dtype


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_grad_weight_channels_last_weight_keeps_its_format(backend, dtype):
    """grad_weight comes back in the weight's memory format (a channels_last weight: channels_last), with its values."""
    args, kwargs = make_case(n=2, cin=4, cout=6, h=5, w=6, kh=3, kw=3, padding=1, dtype=dtype, seed=17)
    x, offset, weight, bias = args
    w = weight.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    deformconv.deform_conv2d(x, offset, w, bias, **kwargs, backend=backend).square().sum().backward()
    assert w.grad.is_contiguous(memory_format=torch.channels_last) and w.grad.dtype == dtype


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_backward_reuses_the_forward_packed_weight(backend, dtype, monkeypatch, forced):
    """In eager autograd the backward takes the weight the forward packed (16-bit: the same layout) instead of packing
    it again; fp32's forward packs K-major, so its backward packs its own. Through the registered op (what
    torch.compile sees) every call packs. The gradients are the oracle's either way."""
    kernels = kernel_modules()

    packs = []
    real = kernels.packing.pack_weight
    for module in (kernels.packing, kernels.backward):  # the forward's pack, and the backward's own
        monkeypatch.setattr(module, "pack_weight", lambda *a, **k: packs.append(1) or real(*a, **k))
    args, kwargs = make_case(n=2, cin=4, cout=6, h=5, w=6, kh=3, kw=3, padding=1, seed=23)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    assert len(packs) == (2 if kernels.geometry.weight_k_major(dtype) else 1)
    packs.clear()
    leaves = leaves_with_grad(args, kwargs, dtype)
    x, offset, weight, bias, mask = leaves
    out = torch.ops.deformconv.deform_conv2d(x, offset, weight, bias, mask, list(kwargs["stride"]),
                                             list(kwargs["padding"]), list(kwargs["dilation"]), backend)
    out.sum().backward()
    assert len(packs) == 2 and weight.grad is not None


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config", ["3x3-pad1", "groups2-og2", "og4-packed-segments", "far-outside"])
def test_deterministic_mode_sums_grad_input_in_fixed_point(backend, dtype, config, monkeypatch, forced):
    """Under torch.use_deterministic_algorithms(True) grad_input goes through the kernel's int64 fixed-point
    scatter (a scale is found: not the reference's fallback), and every gradient still matches the oracle."""
    kernels = kernel_modules()

    scales = []
    real = kernels.backward.fixed_point_scales
    monkeypatch.setattr(kernels.backward, "fixed_point_scales", lambda *a: scales.append(real(*a)) or scales[-1])
    args, kwargs = make_case(**CONFIGS[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 991)
    with deterministic_mode():
        compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert scales and all(s is not None for s in scales)


def _grad_input(x, offset, weight, mask, grad_out, backend, deterministic):
    x = x.detach().requires_grad_(True)
    with deterministic_mode(deterministic):
        out = deformconv.deform_conv2d(x, offset, weight, padding=1, mask=mask, backend=backend)
        return torch.autograd.grad(out, x, grad_out)[0]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_deterministic_mode_with_non_finite_or_zero_grad_out(backend, dtype):
    """The fixed-point scale is bounded from grad_out, weight and mask: a NaN or an Inf among them makes
    deterministic grad_input NaN throughout (never finite garbage); the default path is unaffected. An
    all-zero grad_out (the largest scale) gives exactly zero."""
    args, kwargs = make_case(**CONFIGS["3x3-pad1"], dtype=dtype, seed=5)
    x, offset, weight, _ = args
    grad_out = torch.randn(2, 6, 5, 6, generator=torch.Generator().manual_seed(6)).to(dtype)
    for bad in (float("nan"), float("-inf")):
        poisoned = grad_out.clone()
        poisoned[1, 2, 3, 4] = bad
        assert torch.isnan(_grad_input(x, offset, weight, kwargs["mask"], poisoned, backend, True)).all()
        assert torch.isfinite(_grad_input(x, offset, weight, kwargs["mask"], poisoned, backend, False)).any()
    zero = _grad_input(x, offset, weight, kwargs["mask"], torch.zeros_like(grad_out), backend, True)
    assert torch.equal(zero, torch.zeros_like(zero))


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_deterministic_mode_with_an_empty_batch(backend, dtype):
    """An empty batch has no grad_out to bound: the fixed-point scale still exists and the gradients are
    empty (input, offset, mask) or zero (weight)."""
    args, kwargs = make_case(**dict(CONFIGS["3x3-pad1"], n=0), dtype=dtype, seed=3)
    leaves = leaves_with_grad(args, kwargs, dtype)
    with deterministic_mode():
        _, grads = fwd_bwd(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)
    for name, leaf, g in zip(GRAD_NAMES, leaves, grads):
        assert g.shape == leaf.shape, name
        assert torch.equal(g, torch.zeros_like(g)), name


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "width-one"])
def test_bias_gradient_alone(backend, dtype, layout):
    """Only the bias needs a gradient: the Triton backward's channel-sum kernel (fp32, 2 programs of
    positions an image, a channel tile wider than Cout = 37) gives grad_out's sum over N, H, W, in either
    layout; "width-one": W = 1 and grad_out's stride along that size-1 dim is arbitrary (999)."""
    width = 1 if layout == "width-one" else 16
    args, kwargs = make_case(n=3, cin=4, cout=37, h=17, w=width, kh=3, kw=3, padding=1, dtype=dtype, seed=8)
    x, offset, weight, bias = args
    b = bias.detach().requires_grad_(True)
    out = deformconv.deform_conv2d(x, offset, weight, b, **kwargs, backend=backend)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    if layout == "channels_last":
        grad_out = grad_out.contiguous(memory_format=torch.channels_last)
    elif layout == "width-one":
        n, c, h, _ = out.shape
        odd = torch.empty_strided(out.shape, (h * c, 1, c, 999), dtype=torch.float64)
        grad_out = odd.copy_(grad_out)
        assert grad_out.is_contiguous(memory_format=torch.channels_last)
    out.backward(grad_out.to(dtype))
    assert_close(b.grad, grad_out.to(dtype).double().sum((0, 2, 3)), dtype, "grad_bias")


@pytest.mark.skipif(not any(p.values[0] == "triton" for p in BACKENDS), reason="needs the Triton backend here")
@pytest.mark.parametrize("dtype,input_dtype", [(torch.float32, None), (torch.float16, None),
                                               (torch.float32, torch.float16)], ids=["fp32", "fp16", "fp32-fp16-input"])
@pytest.mark.parametrize("case", FINISH_CASES, ids=FINISH_CASE_IDS)
def test_finish_grads_sums_partials_in_order_and_unpacks(case, dtype, input_dtype):
    """finish_grads on the CPU (interpreter): see conftest.check_finish_grads. bf16 on the GPU only: the
    interpreter's fp32 -> bf16 cast rounds otherwise than torch's (1 ulp apart in 40% of elements, measured)."""
    check_finish_grads("cpu", dtype, *case, input_dtype=input_dtype)
