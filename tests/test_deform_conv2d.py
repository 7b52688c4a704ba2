"""deform_conv2d on the CPU: every backend that can run here (reference; triton under TRITON_INTERPRET=1)
against an independent naive implementation and against torchvision, forward and all five gradients: the
definition, its edge cases (non-finite values, borders, empty batches, layouts, half precision) and what a call
saves. The Triton kernels' tile variants and backward routes: tests/ops/deform_conv2d/."""

import math
import random
import zlib

import pytest
import torch
from _dcn_cases import BACKENDS, CONFIGS, GRAD_NAMES, compare_to_oracle, deterministic_mode, leaves_with_grad
from _naive import naive_deform_conv2d
from conftest import TOL, assert_close, assert_near_rounding, kernel_modules, make_case

import deformconv

torchvision = pytest.importorskip("torchvision")


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_against_naive(backend, dtype, config):
    """Forward and every gradient against the naive loops (float64 oracle on the same values)."""
    args, kwargs = make_case(**CONFIGS[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 1000)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)


def _random_config(seed):
    rnd = random.Random(seed)
    groups = rnd.choice([1, 1, 2, 3])
    offset_groups = rnd.choice([1, 1, 2, 4])
    cin = groups * offset_groups * rnd.choice([1, 2, 3])
    kh, kw = rnd.choice([(3, 3), (1, 1), (2, 3), (3, 1), (5, 5)])
    cfg = dict(
        n=rnd.choice([1, 2, 3]), cin=cin, cout=groups * rnd.choice([1, 2, 5]), h=rnd.randint(4, 9),
        w=rnd.randint(4, 9), kh=kh, kw=kw, groups=groups, offset_groups=offset_groups,
        stride=(rnd.randint(1, 3), rnd.randint(1, 2)), padding=(rnd.randint(0, 2), rnd.randint(0, 3)),
        dilation=(rnd.randint(1, 2), rnd.randint(1, 2)), mask=rnd.choice(["random", None, "zero"]),
        offset_scale=rnd.choice([0.5, 2.0, 8.0]), bias=rnd.choice([True, False]),
    )
    # Keep the output non-empty.
    for size, k, s, p, d in ((cfg["h"], kh, 0, 0, 0), (cfg["w"], kw, 1, 1, 1)):
        while size + 2 * cfg["padding"][p] - (cfg["dilation"][d] * (k - 1) + 1) < 0:
            cfg["padding"] = tuple(v + 1 if i == p else v for i, v in enumerate(cfg["padding"]))
    return cfg


RANDOM_SEEDS = list(range(24))


def _tv(x, offset, weight, bias, stride, padding, dilation, mask):
    return torchvision.ops.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("seed", RANDOM_SEEDS, ids=[f"rand{s:02d}" for s in RANDOM_SEEDS])
def test_against_torchvision_random(backend, dtype, seed):
    """Random stride/padding/dilation/groups/offset groups/kernels/masks against torchvision in float64."""
    if backend == "triton" and seed % 3:
        pytest.skip("the Triton interpreter is slow: every third configuration")
    args, kwargs = make_case(**_random_config(seed), dtype=torch.float64, seed=seed)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, _tv)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("poison", ["input", "grad_out"])
def test_non_finite_values_spread_as_in_torchvision(backend, dtype, poison):
    """A NaN or Inf in the input or in grad_out makes the output and each gradient non-finite exactly where
    torchvision's are: a bilinear corner outside the image is skipped (its pixel never read), not multiplied
    by a zero weight; offsets reach past the border so that such corners exist."""
    args, kwargs = make_case(**dict(CONFIGS["3x3-pad1"], offset_scale=3.0), dtype=dtype, seed=5)
    x, offset, weight, _ = args
    x = x.clone()
    grad_out = torch.randn(2, 6, 5, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    if poison == "input":
        x[0, 1, 0, 0] = float("nan")
        x[1, 2, 4, 5] = float("inf")
    else:
        grad_out[1, 2, 3, 4] = float("nan")

    def run(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_(True) for t in (x, offset, weight, kwargs["mask"])]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype))]

    ours = run(lambda x, o, w, m: deformconv.deform_conv2d(x, o, w, padding=1, mask=m, backend=backend), dtype)
    theirs = run(lambda x, o, w, m: torchvision.ops.deform_conv2d(x, o, w, padding=1, mask=m), torch.float64)
    assert not torch.isfinite(theirs[0 if poison == "input" else 1]).all()
    for name, a, t in zip(("output", "grad_input", "grad_offset", "grad_weight", "grad_mask"), ours, theirs):
        assert torch.equal(torch.isfinite(a), torch.isfinite(t)), name


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("config", ["3x3-pad1", "long-segment"])
@pytest.mark.parametrize("where", ["offset-dy", "offset-dx", "mask"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e30, -1e30],
                         ids=["nan", "inf", "-inf", "huge", "-huge"])
def test_non_finite_offsets_and_masks_as_in_torchvision(where, value, config, backend, dtype):
    """One NaN, +-Inf or huge finite value in the offset (either component) or the mask: the output and every gradient
    are non-finite exactly where torchvision's are, and equal elsewhere (a NaN sample point samples NaN; an infinite or
    huge one lies outside the image and samples 0, the gradient of its other offset component NaN). Two layers: 4
    channels (the Triton kernels' packed segments) and 32 (one long segment)."""
    _check_non_finite(where, value, config, backend, dtype)


@pytest.mark.parametrize("where", ["offset-dy", "mask"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend,dtype", [b for b in BACKENDS if b.values[0] in ("reference", "triton")
                                           and b.values[1] == torch.float32])
def test_deterministic_mode_with_non_finite_offsets_and_masks(where, value, backend, dtype):
    """In the deterministic mode a non-finite offset gives torchvision's results as in the default mode: the Triton
    kernels' fixed-point grad_input takes its scale from grad_out, weight and mask, never from the offsets. A
    non-finite mask makes that grad_input NaN throughout (the mode's documented behaviour); the reference backend's
    (an ordered index_add) stays torchvision's."""
    with deterministic_mode():
        _check_non_finite(where, value, "3x3-pad1", backend, dtype, deterministic=True)


def _check_non_finite(where, value, config, backend, dtype, deterministic=False):
    shape = CONFIGS["3x3-pad1"] if config == "3x3-pad1" else dict(CONFIGS["3x3-pad1"], n=1, cin=32)
    if math.isfinite(value):  # huge, yet finite in the dtype, as are its products (1e30 is inf in float16)
        value = math.copysign(min(abs(value), torch.finfo(dtype).max ** 0.5), value)
    args, kwargs = make_case(**shape, dtype=torch.float64, seed=8)
    x, offset, weight, _ = args
    offset, mask = offset.clone(), kwargs["mask"].clone()
    if where == "mask":
        mask[0, 4, 2, 3] = value
    else:
        offset[0, 8 if where == "offset-dy" else 9, 2, 3] = value  # tap 4 (the centre): a dy or a dx
    grad_out = torch.randn(shape["n"], 6, 5, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def run(fn, cast):  # both sides see the inputs rounded to dtype
        leaves = [t.detach().to(dtype).to(cast).requires_grad_(True) for t in (x, offset, weight, mask)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad_out.to(dtype).to(cast))]

    ours = run(lambda x, o, w, m: deformconv.deform_conv2d(x, o, w, padding=1, mask=m, backend=backend), dtype)
    names = ("output", "grad_input", "grad_offset", "grad_weight", "grad_mask")
    if where == "offset-dx" and value != value:
        # torchvision's CPU kernel crashes on a NaN dx (an undefined float-to-int conversion); a NaN sample point is
        # the same whichever component is NaN, so ours must give what torchvision gives for a NaN dy at that tap,
        # with the offset gradient's two components swapped
        offset = offset.clone()
        offset[0, 9, 2, 3], offset[0, 8, 2, 3] = offset[0, 8, 2, 3], value
        theirs = run(lambda x, o, w, m: torchvision.ops.deform_conv2d(x, o, w, padding=1, mask=m), torch.float64)
        g = theirs[2].clone()
        g[0, 8, 2, 3], g[0, 9, 2, 3] = theirs[2][0, 9, 2, 3], theirs[2][0, 8, 2, 3]
        theirs[2] = g
        keep = (0, 2, 3, 4)  # grad_input is not compared: the swapped point samples other corners
        names, ours, theirs = [names[i] for i in keep], [ours[i] for i in keep], [theirs[i] for i in keep]
    else:
        theirs = run(lambda x, o, w, m: torchvision.ops.deform_conv2d(x, o, w, padding=1, mask=m), torch.float64)
    atol, rtol = TOL[dtype]
    for name, a, t in zip(names, ours, theirs):
        if deterministic and backend == "triton" and name == "grad_input" and where == "mask":
            assert torch.isnan(a).all(), "deterministic grad_input with a non-finite mask"
            continue
        assert torch.equal(torch.isfinite(a), torch.isfinite(t)), (name, int((~torch.isfinite(a)).sum()),
                                                                    int((~torch.isfinite(t)).sum()))
        if name == "grad_offset" and where == "offset-dx" and value != value:
            continue  # the swapped point's gradient is another one's; only where it is non-finite is the same
        finite = torch.isfinite(t)
        scale = max(t[finite].abs().max().item(), 1e-30)
        torch.testing.assert_close(a[finite].double(), t[finite], atol=atol * scale, rtol=rtol, msg=name)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_integer_offsets_on_pixels_and_borders(backend, dtype):
    """Offsets that land exactly on pixels, on the border rows/columns, at -1 and H/W, and just inside
    (-1, 0) and (H-1, H): the bilinear edge cases, forward and gradients, against torchvision."""
    args, kwargs = make_case(n=2, cin=4, cout=3, h=5, w=6, kh=3, kw=3, padding=1, dtype=torch.float64, seed=7)
    x, offset, weight, bias = args
    g = torch.Generator().manual_seed(3)
    ints = torch.randint(-7, 8, offset.shape, generator=g).double()
    pick = torch.randint(0, 7, offset.shape, generator=g)
    frac = torch.tensor([0.0, 0.0, 0.0, 0.5, -0.5, 0.25, -0.999])[pick].double()
    offset = ints + frac
    compare_to_oracle(backend, dtype, leaves_with_grad((x, offset, weight, bias), kwargs, torch.float64), kwargs, _tv)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_batch_of_one_and_zero(backend, dtype):
    args, kwargs = make_case(n=1, cin=4, cout=3, h=5, w=6, kh=3, kw=3, padding=1, dtype=dtype, seed=11)
    out = deformconv.deform_conv2d(*args, **kwargs, backend=backend)
    assert out.shape == (1, 3, 5, 6)
    empty_args = [t[:0] if i in (0, 1) else t for i, t in enumerate(args)]
    mask = kwargs["mask"][:0]
    x0 = empty_args[0].requires_grad_(True)
    w = args[2].detach().requires_grad_(True)
    out0 = deformconv.deform_conv2d(x0, empty_args[1], w, args[3], padding=1, mask=mask, backend=backend)
    assert out0.shape == (0, 3, 5, 6)
    out0.sum().backward()
    assert x0.grad.shape == x0.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_non_contiguous_and_channels_last_inputs(backend, dtype):
    """Sliced/transposed views and channels_last inputs give the same numbers; the output keeps the
    input's memory format, as F.conv2d does."""
    args, kwargs = make_case(n=2, cin=4, cout=3, h=6, w=7, kh=3, kw=3, padding=1, dtype=dtype, seed=5)
    x, offset, weight, bias = args
    expected = deformconv.deform_conv2d(*args, **kwargs, backend=backend)
    x_view = x.transpose(2, 3).contiguous().transpose(2, 3)  # same values, non-contiguous strides
    off_view = torch.cat([offset, offset], dim=1)[:, : offset.shape[1]]  # sliced channels
    w_view = weight.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3)
    out = deformconv.deform_conv2d(x_view, off_view, w_view, bias, **kwargs, backend=backend)
    assert not x_view.is_contiguous() and not off_view.is_contiguous()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    out_cl = deformconv.deform_conv2d(x_cl, offset, weight, bias, **kwargs, backend=backend)
    assert out_cl.is_contiguous(memory_format=torch.channels_last)
    atol, rtol = (0, 0) if dtype == torch.float64 else (1e-3, 1e-3)
    torch.testing.assert_close(out_cl, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_offset_and_mask_as_slices_of_one_tensor(backend, dtype):
    """As a module passes them: offset and mask are channel slices of one channels_last tensor (its offset conv's
    output). Output and every gradient are those of contiguous copies, the slices' gradients landing in the one
    tensor's grad."""
    args, kwargs = make_case(n=2, cin=4, cout=3, h=6, w=7, kh=3, kw=3, padding=1, dtype=dtype, seed=6)
    x, offset, weight, bias = args
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(2, 9, 6, 7, generator=gen, dtype=torch.float64).to(dtype)
    both = torch.cat([offset, mask], 1).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, offset, mask, weight)]
    gout = torch.randn(2, 3, 6, 7, generator=gen, dtype=torch.float64).to(dtype)
    expected = deformconv.deform_conv2d(leaves[0], leaves[1], leaves[3], bias, padding=1, mask=leaves[2],
                                        backend=backend)
    grads = torch.autograd.grad(expected, leaves, gout)
    xs, ws = leaves[0].detach().clone().requires_grad_(True), leaves[3].detach().clone().requires_grad_(True)
    out = deformconv.deform_conv2d(xs, both[:, :18], ws, bias, padding=1, mask=both[:, 18:], backend=backend)
    g_x, g_both, g_w = torch.autograd.grad(out, [xs, both, ws], gout)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for what, a, b in (("input", g_x, grads[0]), ("offset", g_both[:, :18], grads[1]),
                       ("mask", g_both[:, 18:], grads[2]), ("weight", g_w, grads[3])):
        torch.testing.assert_close(a, b, msg=lambda m: f"grad_{what}: {m}")


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float16), ("reference", torch.bfloat16),
                                           ("cpu", torch.float16)],
                         ids=["reference-fp16", "reference-bf16", "cpu-fp16"])
def test_half_inputs_are_computed_in_float32_by_the_reference(backend, dtype):
    """The reference backend computes 16-bit inputs in float32 and rounds once: the float64 result rounded. So does the
    cpu backend with fp16 (with bf16 its GEMMs take bf16 operands, as the GPU's: the tests by dtype cover it)."""
    args, kwargs = make_case(n=2, cin=8, cout=4, h=6, w=6, kh=3, kw=3, padding=1, dtype=dtype, seed=2)
    out = deformconv.deform_conv2d(*args, **kwargs, backend=backend)
    assert out.dtype == dtype
    args64 = [t.double() for t in args]
    kw64 = dict(kwargs, mask=kwargs["mask"].double())
    exact = deformconv.deform_conv2d(*args64, **kw64, backend="reference")
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), atol=eps, rtol=2 * eps)


@pytest.mark.skipif(not any(p.values == ("triton", torch.float16) for p in BACKENDS),
                    reason="the Triton backend cannot run float16 here")
@pytest.mark.parametrize("config", ["long-segments", "og8-packed-segments"])
def test_half_error_near_the_rounding_of_the_exact_result(config):
    """fp16 through the Triton backend stays within a small multiple of the unavoidable rounding error, in mean
    and max, for the output and grad_weight (see Precision in ops/deform_conv2d.py)."""
    cfg = dict(n=2, cin=64, cout=48, h=9, w=11, kh=3, kw=3, padding=1,
               offset_groups=8 if config == "og8-packed-segments" else 1)
    args, kwargs = make_case(**cfg, dtype=torch.float64, seed=3)
    mask = kwargs.pop("mask")
    results = {}
    for dtype, backend in ((torch.float16, "triton"), (torch.float64, "reference")):
        x, offset, weight, bias, m = [t.to(torch.float16).to(dtype).requires_grad_(True) for t in (*args, mask)]
        out = deformconv.deform_conv2d(x, offset, weight, bias, **kwargs, mask=m, backend=backend)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        grad_w, = torch.autograd.grad(out, [weight], grad_out.to(torch.float16).to(dtype))
        results[dtype] = dict(output=out.detach().double(), grad_weight=grad_w.double())
    for name in ("output", "grad_weight"):
        assert_near_rounding(results[torch.float16][name], results[torch.float64][name], torch.float16, name)


def test_gradcheck_float64():
    args, kwargs = make_case(n=1, cin=4, cout=2, h=4, w=5, kh=3, kw=2, groups=2, offset_groups=2, padding=1,
                             dtype=torch.float64, seed=13)
    leaves = leaves_with_grad(args, kwargs, torch.float64)

    def fn(x, offset, weight, bias, mask):
        return deformconv.deform_conv2d(x, offset, weight, bias, kwargs["stride"], kwargs["padding"],
                                        kwargs["dilation"], mask, backend="reference")

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_only_required_gradients_are_computed(monkeypatch, forced):
    """The backward op is asked only for the gradients autograd needs."""
    from deformconv.ops.deform_conv2d import reference

    seen = []
    orig = reference.deform_conv2d_backward
    monkeypatch.setattr(reference, "deform_conv2d_backward", lambda *a, **k: seen.append(list(a[-1])) or orig(*a, **k))
    args, kwargs = make_case(n=1, cin=2, cout=2, h=4, w=4, kh=3, kw=3, padding=1, seed=4)
    x, offset, weight, bias = args
    w = weight.clone().requires_grad_(True)
    deformconv.deform_conv2d(x, offset, w, bias, **kwargs, backend="reference").sum().backward()
    assert seen == [[False, False, False, True, False]]
    assert w.grad is not None


@pytest.mark.parametrize("backend,dtype", BACKENDS)
def test_repeated_shape_with_other_flags(backend, dtype):
    """One shape called again with and without mask/bias, NCHW then channels_last, and with fewer
    gradients: each call gets its own launch plan (the Triton backend caches them by call signature)."""
    args, kwargs = make_case(n=2, cin=8, cout=6, h=5, w=7, kh=3, kw=3, offset_groups=2, padding=1, dtype=torch.float64,
                             seed=31)
    x, offset, weight, bias = args
    variants = {
        "dcnv2+bias": dict(bias=bias, mask=kwargs["mask"], x=x),
        "dcnv1": dict(bias=None, mask=None, x=x),
        "channels_last": dict(bias=bias, mask=kwargs["mask"], x=x.contiguous(memory_format=torch.channels_last)),
        "dcnv2+bias again": dict(bias=bias, mask=kwargs["mask"], x=x),
    }
    for name, v in variants.items():
        leaves64 = [v["x"], offset, weight, v["bias"], v["mask"]]
        compare_to_oracle(backend, dtype, leaves64, kwargs, torchvision.ops.deform_conv2d)
    # only grad_offset and grad_weight asked for, on the same shape
    leaves = [t.detach().to(dtype) for t in (x, offset, weight, bias, kwargs["mask"])]
    leaves[1].requires_grad_(True)
    leaves[2].requires_grad_(True)
    out = deformconv.deform_conv2d(*leaves[:4], padding=1, mask=leaves[4], backend=backend)
    g_off, g_w = torch.autograd.grad(out, leaves[1:3], torch.ones_like(out))
    ref = [t.detach().double().requires_grad_(i in (1, 2)) for i, t in enumerate(leaves)]
    ref_out = torchvision.ops.deform_conv2d(*ref[:4], padding=1, mask=ref[4])
    r_off, r_w = torch.autograd.grad(ref_out, ref[1:3], torch.ones_like(ref_out))
    assert_close(g_off, r_off, dtype, "grad_offset")
    assert_close(g_w, r_w, dtype, "grad_weight")


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("wrapper", ["saved-tensor-hooks", "checkpoint"])
def test_kept_tensors_go_through_saved_tensor_hooks_and_checkpointing(backend, dtype, wrapper):
    """What the eager forward keeps for its backward (the packed weight) is saved like the inputs: under
    saved_tensors_hooks every saved tensor goes through pack/unpack, and under non-reentrant activation checkpointing
    the forward is recomputed; the gradients are bitwise those of a plain run either way."""
    from torch.utils.checkpoint import checkpoint

    args, kwargs = make_case(n=2, cin=4, cout=6, h=5, w=6, kh=3, kw=3, padding=1, dtype=dtype, seed=29)

    def grads(run):
        leaves = [None if t is None else t.detach().clone().requires_grad_(True)
                  for t in leaves_with_grad(args, kwargs, dtype)]
        x, offset, weight, bias, mask = leaves

        def layer(*t):
            return deformconv.deform_conv2d(*t[:4], stride=kwargs["stride"], padding=kwargs["padding"],
                                            dilation=kwargs["dilation"], mask=t[4], backend=backend)
        run(layer, leaves).square().sum().backward()
        return [t.grad for t in leaves]

    packed = []
    if wrapper == "saved-tensor-hooks":
        def run(layer, leaves):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t.clone(), lambda t: t):
                return layer(*leaves)
    else:
        def run(layer, leaves):
            return checkpoint(layer, *leaves, use_reentrant=False)
    for name, g, ref in zip(GRAD_NAMES, grads(run), grads(lambda layer, leaves: layer(*leaves))):
        torch.testing.assert_close(g, ref, atol=0, rtol=0, msg=lambda m: f"grad_{name}: {m}")
    if wrapper == "saved-tensor-hooks":  # input, offset, weight, mask, and (Triton, 16-bit) the packed weight; the
        kernels = kernel_modules()       # Triton kernels' per-signature path (eager.PlannedCall) saves the bias too

        triton = backend == "triton"
        assert len(packed) == 4 + triton * (1 + (not kernels.geometry.weight_k_major(dtype)))
