"""deform_conv2d on the CPU: every backend that can run here (reference; triton under TRITON_INTERPRET=1)
against an independent naive implementation and against torchvision, forward and all five gradients."""

import contextlib
import random
import zlib

import dataclasses
import math

import pytest
import torch

import deformconv
from conftest import (FINISH_CASE_IDS, FINISH_CASES, CountingKernel, assert_close, assert_near_rounding,
                      check_finish_grads, kernel_modules, launch_metas, make_case, nan_filled_empty, plans, TOL)
from _naive import naive_deform_conv2d

torchvision = pytest.importorskip("torchvision")


def cpu_backends():
    """(backend, dtype) pairs that run on this machine's CPU."""
    pairs = [("reference", torch.float64), ("reference", torch.float32), ("cpu", torch.float64), ("cpu", torch.float32),
             ("cpu", torch.bfloat16)]  # the cpu backend's bf16 GEMMs: bf16 operands, as the GPU's
    if not deformconv.not_supported_reasons(torch.device("cpu"), torch.float32)["triton"]:
        pairs += [("triton", torch.float32), ("triton", torch.float16)]
    return pairs


BACKENDS = [pytest.param(b, d, id=f"{b}-{str(d).split('.')[-1]}") for b, d in cpu_backends()]

# Small named configurations (the naive oracle loops in Python: keep them tiny).
CONFIGS = {
    "3x3-pad1": dict(n=2, cin=4, cout=6, h=5, w=6, kh=3, kw=3, padding=1),
    "stride2-dil2": dict(n=1, cin=4, cout=4, h=9, w=8, kh=3, kw=3, stride=2, padding=2, dilation=2),
    "groups2-og2": dict(n=2, cin=4, cout=6, h=5, w=5, kh=3, kw=3, groups=2, offset_groups=2, padding=1),
    "nonsquare-og4": dict(n=1, cin=8, cout=4, h=6, w=7, kh=2, kw=3, groups=2, offset_groups=4, stride=(1, 2), padding=(1, 0)),
    "og3-groups2-segments": dict(n=1, cin=6, cout=4, h=5, w=4, kh=3, kw=3, groups=2, offset_groups=3, padding=1),
    "1x1-no-mask": dict(n=2, cin=3, cout=5, h=4, w=5, kh=1, kw=1, mask=None),
    "zero-mask-no-bias": dict(n=1, cin=4, cout=4, h=5, w=5, kh=3, kw=3, padding=1, mask="zero", bias=False),
    "og4-packed-segments": dict(n=1, cin=16, cout=8, h=5, w=6, kh=3, kw=3, offset_groups=4, padding=1),
    "groups2-og4-packed-tail": dict(n=1, cin=16, cout=4, h=4, w=5, kh=3, kw=3, groups=2, offset_groups=4, padding=1),
    "far-outside": dict(n=1, cin=4, cout=4, h=5, w=5, kh=3, kw=3, padding=1, offset_scale=20.0),
    # long segments (the kernels' chunked loops): 48 channels = a full and a partial 32-wide chunk of the
    # grad_input kernel, its channel sums carried across chunks; 2 offset groups of 32, whole chunks
    "long-segment-partial-chunk": dict(n=1, cin=48, cout=4, h=4, w=5, kh=3, kw=3, padding=1),
    "og2-long-segments": dict(n=1, cin=64, cout=4, h=3, w=4, kh=3, kw=3, offset_groups=2, padding=1),
}

GRAD_NAMES = ("input", "offset", "weight", "bias", "mask")


def _with_grad(args, kwargs, dtype):
    """Leaf copies (requires_grad) of the case's tensors in dtype, in GRAD_NAMES order."""
    x, offset, weight, bias = args
    tensors = [x, offset, weight, bias, kwargs["mask"]]
    return [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in tensors]


@contextlib.contextmanager
def _deterministic(flag=True):
    """torch.use_deterministic_algorithms(flag) inside the block, off again after it (even after an error)."""
    torch.use_deterministic_algorithms(flag)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _channels_last_leaf(t):
    """A channels_last leaf copy of t (requires_grad)."""
    return t.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)


def _run(fn, leaves, kwargs, grad_seed=1):
    x, offset, weight, bias, mask = leaves
    out = fn(x, offset, weight, bias, stride=kwargs["stride"], padding=kwargs["padding"],
             dilation=kwargs["dilation"], mask=mask)
    g = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    wrt = [t for t in leaves if t is not None]
    # allow_unused: the naive oracle never touches an input whose every sample falls outside the image.
    grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    it = iter(torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads))
    return out, [None if t is None else next(it) for t in leaves]


def _compare(backend, dtype, leaves64, kwargs, oracle):
    ours_leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in leaves64]
    out, grads = _run(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), ours_leaves, kwargs)
    # The oracle sees exactly the values we computed on (rounded to dtype), in float64.
    oracle_leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in ours_leaves]
    ref_out, ref_grads = _run(oracle, oracle_leaves, kwargs)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "output")
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert_close(g, r, dtype, f"grad_{name}")


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_against_naive(backend, dtype, config):
    """Forward and every gradient against the naive loops (float64 oracle on the same values)."""
    args, kwargs = make_case(**CONFIGS[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 1000)
    leaves64 = _with_grad(args, kwargs, torch.float64)
    _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)


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
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, _tv)


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
    with _deterministic():
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
    frac = torch.tensor([0.0, 0.0, 0.0, 0.5, -0.5, 0.25, -0.999])[torch.randint(0, 7, offset.shape, generator=g)].double()
    offset = ints + frac
    _compare(backend, dtype, _with_grad((x, offset, weight, bias), kwargs, torch.float64), kwargs, _tv)


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
    for what, a, b in (("input", g_x, grads[0]), ("offset", g_both[:, :18], grads[1]), ("mask", g_both[:, 18:], grads[2]),
                       ("weight", g_w, grads[3])):
        torch.testing.assert_close(a, b, msg=lambda m: f"grad_{what}: {m}")


@pytest.mark.parametrize("backend,dtype", [("reference", torch.float16), ("reference", torch.bfloat16),
                                           ("cpu", torch.float16)], ids=["reference-fp16", "reference-bf16", "cpu-fp16"])
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
    leaves = _with_grad(args, kwargs, torch.float64)

    def fn(x, offset, weight, bias, mask):
        return deformconv.deform_conv2d(x, offset, weight, bias, kwargs["stride"], kwargs["padding"],
                                        kwargs["dilation"], mask, backend="reference")

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def test_only_required_gradients_are_computed(monkeypatch, forced):
    """The backward op is asked only for the gradients autograd needs."""
    from deformconv.backends import BACKENDS as REGISTRY

    seen = []
    ref = REGISTRY["reference"]
    orig = type(ref).backward
    monkeypatch.setattr(type(ref), "backward", lambda self, *a, **k: seen.append(list(a[-1])) or orig(self, *a, **k))
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
    args, kwargs = make_case(n=2, cin=8, cout=6, h=5, w=7, kh=3, kw=3, offset_groups=2, padding=1, dtype=torch.float64, seed=31)
    x, offset, weight, bias = args
    variants = {
        "dcnv2+bias": dict(bias=bias, mask=kwargs["mask"], x=x),
        "dcnv1": dict(bias=None, mask=None, x=x),
        "channels_last": dict(bias=bias, mask=kwargs["mask"], x=x.contiguous(memory_format=torch.channels_last)),
        "dcnv2+bias again": dict(bias=bias, mask=kwargs["mask"], x=x),
    }
    for name, v in variants.items():
        leaves64 = [v["x"], offset, weight, v["bias"], v["mask"]]
        _compare(backend, dtype, leaves64, kwargs, torchvision.ops.deform_conv2d)
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


TRITON_BACKENDS = [p for p in BACKENDS if p.values[0] == "triton"]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat-grad-out-reloaded"])
@pytest.mark.parametrize("config", ["3x3-pad1", "stride2-dil2", "og4-packed-segments", "groups2-og4-packed-tail"])
def test_position_tilings(backend, dtype, per_image, config, monkeypatch, forced):
    """Both ways of tiling the output positions (M tiles inside one image, or across images), the second
    with grad_out re-read per K chunk in the grad_input kernel instead of held, give the oracle's forward
    and gradients, with 3 images so that flat tiles straddle image boundaries."""
    forced(per_image=per_image)
    if not per_image:
        forced(go_resident=False)
    args, kwargs = make_case(**dict(CONFIGS[config], n=3), dtype=dtype, seed=zlib.crc32(config.encode()) % 997)
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)


# RUN_STORE by (Ho*Wo, element size) for 64- and 128-row tiles: (CodegenProfile.wide_run_stores on, off). 320 positions: the old
# rule's 8-element runs for 16 bits; wide runs: up to 16 bytes of any dtype, as far as Ho*Wo and the tile both divide
# (gcd(196, 64 or 128) = 4); None: not run (the old rule stores no runs at 196 positions, so both calls would be alike).
RUN_STORE_CASES = {(16, 20, 2): (8, 8), (16, 20, 4): (4, 0), (14, 14, 2): (4, None), (14, 14, 4): (4, None)}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat"])
@pytest.mark.parametrize("hw,wide", [((16, 20), True), ((16, 20), False), ((14, 14), True)],
                         ids=["16x20-wide-runs", "16x20-16-byte-runs", "14x14-wide-runs"])  # 14x14 has no 16-byte runs
def test_forward_stores_nchw_output_in_runs(backend, dtype, per_image, hw, wide, monkeypatch, forced):
    """An NCHW output (unpacked segments: 16 channels) is stored in runs along each channel plane from whole tiles
    inside one image (RUN_STORE, run_store_length: RUN_STORE_CASES), else from the accumulator's layout: the same bits either
    way, every element written (outputs poisoned), and the float64 reference's numbers. 3 images in 128-row tiles
    (fp32: 64); 196 positions divide into neither, so per-image tiles end in a partial tile and flat tiles straddle
    images."""
    kernels = kernel_modules()

    forced(per_image=per_image)
    forced(profile=dataclasses.replace(kernels.forward.codegen_profile(), wide_run_stores=wide))
    h, w = hw
    args, kwargs = make_case(n=3, cin=16, cout=8, h=h, w=w, kh=3, kw=3, padding=1, dtype=dtype, seed=31)
    outs, metas = [], []
    for runs in (True, False):
        forced(run_stores=runs)
        with nan_filled_empty():
            outs.append(deformconv.deform_conv2d(*args, **kwargs, backend=backend))
        metas.append(launch_metas()[0])
    run = RUN_STORE_CASES[(h, w, dtype.itemsize)][0 if wide else 1]
    assert [(m["RUN_STORE"], m["PER_IMAGE"]) for m in metas] == [(run, per_image), (0, per_image)]
    assert all(m["BLOCK_M"] in (64, 128) and m["BLOCK_M"] < h * w for m in metas)  # whole tiles among them
    assert torch.equal(outs[0], outs[1])
    ref = deformconv.deform_conv2d(*[t.double() if t is not None else None for t in args],
                                   **dict(kwargs, mask=kwargs["mask"].double()), backend="reference")
    assert_close(outs[0], ref, dtype, "output")


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("config", ["og4-packed-segments", "groups2-og4-packed-tail"])
def test_offset_grouped_input_layout_matches_nhwc(backend, dtype, layout, config, monkeypatch, forced):
    """Where segments are whole packed offset groups the kernels read the input (and accumulate grad_input)
    offset-grouped, [N, G, H, W, C/G]; forced to NHWC they compute the same numbers in the same order, so
    the output and every gradient agree bit for bit, and the grouped run matches the oracle."""
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 991)
    if layout == "channels_last":
        args = (args[0].contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
    leaves = _with_grad(args, kwargs, dtype)
    if layout == "channels_last":
        leaves[0] = _channels_last_leaf(leaves[0])
    run = lambda: _run(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)  # noqa: E731
    forced()
    out, grads = run()
    assert any(getattr(plan, "grouped", False) for plan in plans())
    forced(grouped_input=False)
    out_nhwc, grads_nhwc = run()
    assert not any(getattr(plan, "grouped", False) for plan in plans())
    torch.testing.assert_close(out, out_nhwc, atol=0, rtol=0)
    for name, g, g_nhwc in zip(GRAD_NAMES, grads, grads_nhwc):
        torch.testing.assert_close(g, g_nhwc, atol=0, rtol=0, msg=lambda m: f"grad_{name}: {m}")
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)


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
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert [cfg.split for key, cfg in kernels.launch.chosen_configs().items() if key[0] == "bwd_data"] == [split]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("split,per_image", [(1, None), (3, True), (3, False)],
                         ids=["split-1-channel-sum", "split-3-bias-fused-tiles-per-image", "split-3-bias-fused-tiles-flat"])
@pytest.mark.parametrize("config,weight_layout", [("3x3-pad1", "contiguous"), ("3x3-pad1", "channels_last"),
                                                  ("zero-mask-no-bias", "contiguous"),
                                                  ("groups2-og4-packed-tail", "channels_last")],
                         ids=["3x3-pad1", "3x3-pad1-channels-last-weight", "zero-mask-no-bias",
                              "groups2-og4-packed-tail-channels-last-weight"])
def test_grad_weight_kernel_sums_grad_bias(backend, dtype, split, per_image, weight_layout, config, monkeypatch, forced):
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
                        lambda w, pw, pb, *a: finishes.append((pw is not None, pb is not None)) or real_finish(w, pw, pb, *a))
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 977)
    leaves64 = _with_grad(args, kwargs, torch.float64)
    if weight_layout == "channels_last":
        leaves64[2] = _channels_last_leaf(leaves64[2])
    _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
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
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
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
    leaves = {k: v.detach().requires_grad_(k in wrt) for k, v in zip(GRAD_NAMES, _with_grad(args, kwargs, dtype))}
    leaves64 = {k: v.detach().double().requires_grad_(k in wrt) for k, v in leaves.items()}
    g = torch.Generator().manual_seed(3)
    grads = {}
    for name, ls, fn in (("ours", leaves, lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend)),
                         ("oracle", leaves64, naive_deform_conv2d)):
        with _deterministic(deterministic and name == "ours"):
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
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert not products


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("direct", [True, False], ids=["stored-by-its-kernel", "finished-from-partials"])
@pytest.mark.parametrize("weight_layout", ["contiguous", "channels_last"])
def test_grad_weight_at_split_1_stored_directly_or_finished(backend, dtype, direct, weight_layout, monkeypatch, forced):
    """At split 1 in a one-chunk backward the grad_weight kernel writes grad_weight in the weight's layout and dtype
    (options.direct_grad_weight), or, turned off, fp32 partials that finish_grads unpacks: the oracle's gradients either way,
    in the weight's memory format."""

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
    leaves64 = _with_grad(args, kwargs, torch.float64)
    if weight_layout == "channels_last":
        leaves64[2] = _channels_last_leaf(leaves64[2])
    assert leaves64[3] is not None  # a bias: its channel sum's partials are finished either way
    _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
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
    leaves64 = _with_grad(args, kwargs, torch.float64)
    _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    assert len(packs) == (2 if kernels.geometry.weight_k_major(dtype) else 1)
    packs.clear()
    leaves = _with_grad(args, kwargs, dtype)
    x, offset, weight, bias, mask = leaves
    out = torch.ops.deformconv.deform_conv2d(x, offset, weight, bias, mask, list(kwargs["stride"]),
                                             list(kwargs["padding"]), list(kwargs["dilation"]), backend)
    out.sum().backward()
    assert len(packs) == 2 and weight.grad is not None


@pytest.mark.parametrize("backend,dtype", BACKENDS)
@pytest.mark.parametrize("wrapper", ["saved-tensor-hooks", "checkpoint"])
def test_kept_tensors_go_through_saved_tensor_hooks_and_checkpointing(backend, dtype, wrapper):
    """What the eager forward keeps for its backward (the packed weight) is saved like the inputs: under
    saved_tensors_hooks every saved tensor goes through pack/unpack, and under non-reentrant activation checkpointing
    the forward is recomputed; the gradients are bitwise those of a plain run either way."""
    from torch.utils.checkpoint import checkpoint

    args, kwargs = make_case(n=2, cin=4, cout=6, h=5, w=6, kh=3, kw=3, padding=1, dtype=dtype, seed=29)

    def grads(run):
        leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in _with_grad(args, kwargs, dtype)]
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


# long segments (16 channels or more, or a length that is not a power of two): the forward's per-(tap, segment)
# loop; the last case has two segments of 6 channels a conv group
LONG_SEGMENT_CASES = {
    "og2-long-segments": CONFIGS["og2-long-segments"],
    "long-segment-partial-chunk": CONFIGS["long-segment-partial-chunk"],
    "1x1-no-mask": CONFIGS["1x1-no-mask"],
    "groups2-og4-segments-of-6": dict(n=2, cin=24, cout=4, h=5, w=4, kh=3, kw=2, groups=2, offset_groups=4, padding=1,
                                      stride=(2, 1)),
}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("ahead", [True, False], ids=["sample-ahead", "sample-in-step"])
@pytest.mark.parametrize("config", list(LONG_SEGMENT_CASES), ids=list(LONG_SEGMENT_CASES))
def test_forward_sample_points_loaded_ahead_or_in_step(backend, dtype, ahead, config, monkeypatch, forced):
    """The forward with long segments, each (tap, segment) step's offsets and mask loaded one step ahead
    (Config.sample_ahead) or in the step, gives the oracle's output (and gradients) across tap, segment and conv
    group boundaries."""

    kernels = kernel_modules()

    forced(configs={"fwd": lambda c: dataclasses.replace(c, sample_ahead=ahead)})
    forced()
    cfg = LONG_SEGMENT_CASES[config]
    args, kwargs = make_case(**cfg, dtype=dtype, seed=zlib.crc32(config.encode()) % 991)
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert [c.sample_ahead for key, c in kernels.launch.chosen_configs().items() if key[0] == "fwd"] == [ahead]


WIDE_CASES = {  # >= 256 output channels a group: the wide tiles (see the GPU tests' shapes of the same names)
    "cout-256-wide-tile": dict(n=1, cin=64, cout=256, h=5, w=6, kh=3, kw=3, padding=1),
    "cout-520-three-n-tiles": dict(n=1, cin=40, cout=520, h=4, w=5, kh=3, kw=3, padding=1, mask=None),
    # 512 channels in whole chunks (64-wide in 16 bits, 32 in fp32): the grad_input kernel's 4-warp TMA tile
    "cout-512-tma": dict(n=1, cin=64, cout=512, h=3, w=5, kh=3, kw=3, padding=1),
}


def _reference(x, offset, weight, bias, stride, padding, dilation, mask):
    return deformconv.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask, backend="reference")


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config", list(WIDE_CASES), ids=list(WIDE_CASES))
def test_wide_configs(backend, dtype, config, monkeypatch, forced):
    """The default configs for >= 256 output channels a group (the forward's 64x256 tile, grad_weight's 256-column
    tile, the grad_input kernel's 8-warp form at >= 512 without TMA, its 4-warp TMA form with whole chunks), with a
    partial last column tile at 520, give the float64 reference's output and gradients."""
    kernels = kernel_modules()

    forced(columns_grad_weight=False)  # the fused grad_weight kernel's wide tile, not the column buffer
    args, kwargs = make_case(**WIDE_CASES[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 977)
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, _reference)
    used = {key[0]: cfg for key, cfg in kernels.launch.chosen_configs().items()}
    assert used["fwd"].block_n == 256 and used["bwd_weight"].block_n == 256
    tma = WIDE_CASES[config]["cin"] % (32 if dtype == torch.float32 else 64) == 0  # whole chunks
    assert used["bwd_data"].tma == tma
    assert used["bwd_data"].num_warps == (8 if WIDE_CASES[config]["cout"] >= 512 and not tma else 4)


# Config.tma: weight and grad_out tiles read through TMA descriptors (fp16, bf16, fp32; whole channel chunks)
TMA_CASES = {
    # long segments; 24 output channels in a 32-column tile (the descriptor reads zeros past them); grad_out
    # resident in the grad_input kernel unless the tiles are flat
    "long-cout-24": dict(n=3, cin=32, cout=24, h=5, w=6, kh=3, kw=3, padding=1),
    # two conv groups: grad_out tiles at each group's channels, never resident; a stride
    "groups2-cout-64": dict(n=3, cin=64, cout=64, h=4, w=7, kh=3, kw=3, groups=2, padding=1, stride=(1, 2)),
    # packed segments (8 offset groups of 8 channels), the forward's flat step loop
    "og8-packed": dict(n=2, cin=64, cout=16, h=4, w=5, kh=3, kw=3, offset_groups=8, padding=1),
}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat"])
@pytest.mark.parametrize("config", list(TMA_CASES), ids=list(TMA_CASES))
def test_tma_tiles_match_pointer_tiles(backend, dtype, per_image, config, monkeypatch, forced):
    """With Config.tma the three kernels read their weight and grad_out tiles through TMA descriptors (emulated
    by the interpreter), in per-image or flat M tiles (grad_out's 3-d or 2-d descriptor): the output and every
    gradient equal those of pointer loads bit for bit, and the oracle's."""
    forced(per_image=per_image)
    if not per_image:
        forced(go_resident=False)
    args, kwargs = make_case(**TMA_CASES[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 971)
    leaves = _with_grad(args, kwargs, dtype)
    results = {}
    for tma in (False, True):
        forced(tma=tma)
        results[tma] = _run(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)
        metas = launch_metas()
        assert len(metas) == 3
        assert all(m["TMA"] == tma for m in metas)
    (out, grads), (out_tma, grads_tma) = results[False], results[True]
    torch.testing.assert_close(out_tma, out, atol=0, rtol=0)
    for name, g, g_tma in zip(GRAD_NAMES, grads, grads_tma):
        torch.testing.assert_close(g_tma, g, atol=0, rtol=0, msg=lambda m: f"grad_{name}: {m}")
    _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)


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
    with _deterministic():
        _compare(backend, dtype, _with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert scales and all(s is not None for s in scales)


def _grad_input(x, offset, weight, mask, grad_out, backend, deterministic):
    x = x.detach().requires_grad_(True)
    with _deterministic(deterministic):
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
    leaves = _with_grad(args, kwargs, dtype)
    with _deterministic():
        _, grads = _run(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)
    for name, leaf, g in zip(GRAD_NAMES, leaves, grads):
        assert g.shape == leaf.shape, name
        assert torch.equal(g, torch.zeros_like(g)), name


CHUNK_CASES = [pytest.param(c, lay, det, id=f"{c}-{lay}-{'deterministic' if det else 'atomics'}")
               for c, lay, det in [("3x3-pad1", "nchw", False), ("3x3-pad1", "channels_last", False),
                                   ("3x3-pad1", "nchw", True), ("3x3-pad1", "channels_last", True),
                                   ("og4-packed-segments", "nchw", False),
                                   ("og4-packed-segments", "channels_last", False),
                                   ("og4-packed-segments", "channels_last", True)]]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config,layout,deterministic", CHUNK_CASES)
def test_backward_in_image_chunks(backend, dtype, layout, deterministic, config, monkeypatch, forced):
    """With the workspace budget forced down, the backward runs 2 + 2 + 1 images at a time (an uneven last
    chunk; grad_weight summed over chunks) and every gradient still matches the oracle."""
    kernels = kernel_modules()

    forced(default_workspace_budget=0.0, min_chunk_programs=2)  # one M tile per image at these sizes: 2 images
    # the chunks themselves: these tiny layers' weights are as large as their inputs, so by memory they would run whole
    monkeypatch.setattr(kernels.schedule, "_chunked_weight_bytes", lambda *a: 0)
    chunks = []
    real = kernels.backward._backward_chunk
    monkeypatch.setattr(kernels.backward, "_backward_chunk", lambda go, x, *a: chunks.append(x.shape[0]) or real(go, x, *a))
    args, kwargs = make_case(**dict(CONFIGS[config], n=5), dtype=dtype, seed=zlib.crc32(config.encode()) % 983)
    leaves64 = _with_grad(args, kwargs, torch.float64)
    if layout == "channels_last":
        leaves64[0] = _channels_last_leaf(leaves64[0])
    with _deterministic(deterministic):
        _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    assert chunks == [2, 2, 1]


def _meta(shape, dtype, channels_last=False):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


@pytest.mark.parametrize("dtype,channels_last,deterministic,images", [
    (torch.float16, False, False, 3),  # NHWC copies of input and grad_out + fp32 accumulator: 4 inputs' worth
    (torch.float16, True, False, 6),   # the accumulator alone: 2 inputs' worth
    (torch.float32, True, False, 8),   # 1 input's worth: the whole batch
    (torch.float16, False, True, 3),   # int64 accumulator + its fp32 conversion: 8 inputs' worth -> 1 image by
                                       # the budget, raised to 3 by the parallelism floor (238 M tiles an image)
], ids=["fp16-nchw", "fp16-channels-last", "fp32-channels-last", "fp16-nchw-deterministic"])
def test_backward_chunk_images_keeps_the_workspace_budget(dtype, channels_last, deterministic, images):
    """det-s3's shape (N=8, 128 channels, 100x152): the images per backward chunk keep the estimated scratch
    within options.default_workspace_budget times the input; a small image count is raised to keep the GPU busy."""
    kernels = kernel_modules()
    x = _meta((8, 128, 100, 152), dtype, channels_last)
    go = _meta((8, 128, 100, 152), dtype, channels_last)
    assert kernels.schedule.backward_chunk_images(x, go, True, True, deterministic) == images
    # without grad_input and grad_weight (grad_offset only), channels-last: there is no scratch to bound; with
    # grad_weight its fp32 partials count as the accumulator would (2 inputs' worth in fp16)
    cl = _meta((8, 128, 100, 152), dtype, True)
    assert kernels.schedule.backward_chunk_images(cl, cl, False, False, False) == 8
    assert kernels.schedule.backward_chunk_images(cl, cl, False, True, False) == (6 if dtype == torch.float16 else 8)
    # small images: a chunk keeps options.min_chunk_programs M tiles (cls-14: 64 images of 14x14 -> 4 tiles each)
    small = _meta((64, 256, 14, 14), dtype, channels_last)
    assert kernels.schedule.backward_chunk_images(small, small, True, True, deterministic) == 64


def test_backward_chunk_images_counts_the_offset_grouped_copy():
    """hires-g8's shape channels-last in fp16: read NHWC in place, the scratch is the fp32 accumulator (2 inputs'
    worth: 12 of 16 images within 1.5x); read offset-grouped, the input's copy counts too (3 inputs' worth: 8)."""
    kernels = kernel_modules()
    x = _meta((16, 64, 128, 128), torch.float16, True)
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 12
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False, grouped=True) == 8


@pytest.mark.parametrize("shape,dtype,channels_last,concurrent", [
    ((8, 256, 50, 76), torch.float16, False, True),      # det-s4: 480 M tiles of 64 positions
    ((64, 256, 14, 14), torch.float16, False, True),     # cls-14: 256
    ((8, 512, 25, 38), torch.float32, True, True),       # det-s5: 120
    ((8, 128, 100, 152), torch.float16, False, False),   # det-s3: 1904 tiles, in chunks of images
    ((8, 128, 100, 152), torch.float32, True, False),    # one chunk, but partials beside the accumulator: 8 bytes
                                                         # an input element against the budget's 6
    ((1, 64, 160, 208), torch.float16, True, False),     # one image of 520 tiles: one chunk, but not small
], ids=["det-s4", "cls-14", "det-s5-fp32-channels-last", "det-s3", "det-s3-fp32-channels-last", "one-large-image"])
def test_concurrent_backward_where_the_batch_is_small(shape, dtype, channels_last, concurrent, monkeypatch, forced):
    """grad_weight runs beside the grad_input kernel (on a side stream) where the whole batch has at most
    options.min_chunk_programs M tiles, or where the budget admits the whole batch with grad_weight's partials beside the
    accumulator; then the backward is one chunk. Only when both kernels run."""
    kernels = kernel_modules()
    monkeypatch.setattr(kernels.schedule, "side_streams_usable", lambda device: True)  # the meta device stands for CUDA
    x, go = _meta(shape, dtype, channels_last), _meta(shape, dtype, channels_last)
    assert kernels.schedule.concurrent_backward(x, go, True, True, True, False) == concurrent
    if concurrent:
        assert kernels.schedule.backward_chunk_images(x, go, True, True, False, concurrent=True) == shape[0]
    assert not kernels.schedule.concurrent_backward(x, go, True, True, False, False)   # no grad_weight
    assert not kernels.schedule.concurrent_backward(x, go, False, False, True, False)  # grad_weight alone
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "inf")  # any whole batch admitted
    assert kernels.schedule.concurrent_backward(x, go, True, True, True, False)


def test_side_streams_only_on_cuda(monkeypatch, forced):
    """The side stream is a CUDA stream (the interpreter's CPU tensors never take it); DEFORMCONV_BACKWARD_STREAMS=0
    turns it off."""
    kernels = kernel_modules()
    monkeypatch.delenv("DEFORMCONV_BACKWARD_STREAMS", raising=False)
    assert kernels.schedule.side_streams_usable(torch.device("cuda"))
    assert not kernels.schedule.side_streams_usable(torch.device("cpu"))
    monkeypatch.setenv("DEFORMCONV_BACKWARD_STREAMS", "0")
    assert not kernels.schedule.side_streams_usable(torch.device("cuda"))


def test_workspace_budget_from_the_environment(monkeypatch, forced):
    """DEFORMCONV_WORKSPACE_BUDGET overrides the default budget ("inf": the whole batch) and is kept even where
    chunks get small; anything that is not a number >= 0 is refused, naming the variable."""
    kernels = kernel_modules()
    x = _meta((8, 128, 100, 152), torch.float16)
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "inf")
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 8
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "2")
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 4
    # a budget set here is kept below the options.min_chunk_programs floor: cls-14's 64 small images (8 bytes of scratch an
    # fp16 input element: 1.5 x 2 / 8 of the batch) run in chunks of 24, not whole, and without the side stream
    monkeypatch.setattr(kernels.schedule, "side_streams_usable", lambda device: True)
    small = _meta((64, 256, 14, 14), torch.float16)
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "1.5")
    assert kernels.schedule.backward_chunk_images(small, small, True, True, False) == 24
    assert not kernels.schedule.concurrent_backward(small, small, True, True, True, False)
    monkeypatch.delenv("DEFORMCONV_WORKSPACE_BUDGET")
    assert kernels.schedule.backward_chunk_images(small, small, True, True, False) == 64
    assert kernels.schedule.concurrent_backward(small, small, True, True, True, False)
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", bad)
        with pytest.raises(ValueError, match=r"DEFORMCONV_WORKSPACE_BUDGET: expected a number >= 0 .* got '"):
            kernels.schedule.backward_chunk_images(x, x, True, True, False)


@pytest.mark.parametrize("shape,budget,images", [
    ((8, 512, 25, 38), "2", 8),    # det-s5: 4 images by the budget, but its weight's fp32 sums take more than they free
    ((8, 512, 25, 38), "0.5", 8),  # 1 image: still no saving
    ((8, 256, 50, 76), "2", 4),    # det-s4: chunks of 4
    ((64, 256, 14, 14), "2", 32),  # cls-14: chunks of 32 (5.5x -> 3.0x)
    ((64, 256, 14, 14), "3", 48),
], ids=["det-s5-2", "det-s5-0.5", "det-s4-2", "cls-14-2", "cls-14-3"])
def test_backward_chunks_only_where_they_save_memory(shape, budget, images, monkeypatch, forced):
    """With grad_weight, chunks sum it over the batch in fp32 (a running sum, a chunk's sum and split partials of at
    least 4 weights' worth: _chunked_weight_bytes); where that takes what the chunks free, the batch runs whole.
    Without grad_weight, or without the weight's size given, the budget alone decides (det-s5: 4 images at 2)."""
    kernels = kernel_modules()
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", budget)
    n, c, h, w = shape
    x = _meta(shape, torch.float16)
    weight_elems = c * c * 9
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False, weight_elems=weight_elems) == images
    by_budget = kernels.schedule.backward_chunk_images(x, x, True, True, False)
    assert by_budget == (images if images < n else {"2": 4, "0.5": 1}[budget])
    assert kernels.schedule.backward_chunk_images(x, x, True, False, False, weight_elems=weight_elems) == by_budget


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


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config,input_layout,deterministic", [
    ("3x3-pad1", "nchw", False), ("og4-packed-segments", "nchw", False), ("3x3-pad1", "nchw", True),
    ("3x3-pad1", "channels_last", False)], ids=["nchw", "offset-grouped", "nchw-deterministic", "channels-last-input"])
@pytest.mark.parametrize("paired", [True, False], ids=["paired", "separate"])
def test_backward_through_the_layout_kernels(backend, dtype, config, input_layout, deterministic, paired, monkeypatch, forced):
    """With the layout copies through _transpose_kernel as on the GPU (options.layout_kernels_on_cpu; the CPU otherwise uses
    torch's): an NCHW input's pass zeroes grad_input's accumulator (fp32, or int64 when deterministic; a channels-last
    input has no pass and gets a plain zeroing), the NCHW grad_out's pass sums grad_bias's partials (no channel-sum
    launch, no bias rows in the grad_weight kernel), the two passes run in one _transpose_pair_kernel launch where
    both exist (options.paired_transposes; else one launch each), and every gradient is the oracle's."""
    kernels = kernel_modules()

    forced(layout_kernels_on_cpu=True, paired_transposes=paired)  # and no cached launches: all are counted
    passes, sums = [], []
    launches = {name: [] for name in ("_transpose_kernel", "_transpose_pair_kernel")}
    for name, log in launches.items():
        monkeypatch.setattr(kernels.layout, name, CountingKernel(getattr(kernels.layout, name), log))
    real_transpose, real_sum = kernels.layout.transpose_last, kernels.backward.channel_sum

    def transpose(src, a, b, out, zero=None, sums=None, jobs=None):
        passes.append((None if zero is None else zero.dtype, sums is not None))
        return real_transpose(src, a, b, out, zero, sums, jobs)

    monkeypatch.setattr(kernels.layout, "transpose_last", transpose)
    monkeypatch.setattr(kernels.backward, "channel_sum", lambda t: sums.append(t.shape) or real_sum(t))
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 967)
    leaves64 = _with_grad(args, kwargs, torch.float64)
    assert leaves64[3] is not None  # a bias
    if input_layout == "channels_last":
        leaves64[0] = _channels_last_leaf(leaves64[0])
    with _deterministic(deterministic):
        _compare(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    zeroed = [z for z, _ in passes if z is not None]
    assert zeroed == ([] if input_layout == "channels_last" else [torch.int64 if deterministic else torch.float32])
    assert [s for _, s in passes].count(True) == 1 and sums == []  # grad_out's pass (_run's grad_out is NCHW)
    assert [m["NEED_BIAS"] for m in launch_metas() if "NEED_BIAS" in m] == [False]
    # the forward's input pass is fused with its weight pack (_pack_and_transpose_kernel); the backward's two
    # passes (an NCHW input's and grad_out's) pair up, grad_input's accumulator goes back in a pass of its own
    nchw = input_layout == "nchw"
    pairs = 1 if paired and nchw else 0
    assert {k: len(v) for k, v in launches.items()} == {
        "_transpose_pair_kernel": pairs, "_transpose_kernel": (1 + nchw - 2 * pairs) + nchw}


@pytest.mark.skipif(not any(p.values[0] == "triton" for p in BACKENDS), reason="needs the Triton backend here")
@pytest.mark.parametrize("n,a,b", [(2, 8, 1000), (3, 1000, 8), (1, 3, 5), (2, 100, 70), (2, 20, 4)],
                         ids=["short-rows", "short-columns", "tiny", "two-partial-tiles", "short-columns-odd"])
def test_transpose_kernel_sizes_its_tiles_to_a_short_side(n, a, b):
    """The layout-copy kernel (NCHW <-> NHWC, NCHW <-> offset-grouped, with a dtype cast): a side of a few
    elements (an offset group's 8 channels) gets its own tile size, either way round; every element lands."""
    kernels = kernel_modules()

    src = torch.randn(n, a, b, generator=torch.Generator().manual_seed(a * b), dtype=torch.float32)
    out = torch.full((n, b, a), float("nan"), dtype=torch.float16)
    kernels.layout.transpose_last(src, a, b, out)
    torch.testing.assert_close(out, src.transpose(1, 2).to(torch.float16), atol=0, rtol=0)


@pytest.mark.skipif(not any(p.values[0] == "triton" for p in BACKENDS), reason="needs the Triton backend here")
@pytest.mark.parametrize("n,a,b,zero_dtype", [(2, 8, 1000, torch.float32), (3, 70, 9, torch.int64), (1, 3, 5, torch.float32)],
                         ids=["short-rows-fp32-zeros", "short-columns-int64-zeros", "tiny"])
def test_transpose_kernel_zeroes_and_sums_on_the_way(n, a, b, zero_dtype):
    """The transpose pass's two extras (the backward's): a buffer of the output's size zeroed (grad_input's fp32 or
    int64 accumulator, poisoned here), and the source's fp32 sums over b by the pass's tiles (grad_bias's partials):
    their total is the full sum, and each row sums its own tile of b."""
    kernels = kernel_modules()

    src = torch.randn(n, a, b, generator=torch.Generator().manual_seed(a + b)).to(torch.float16)
    out = torch.full((n, b, a), float("nan"), dtype=torch.float16)
    zero = torch.full((n, b, a), -7, dtype=zero_dtype)
    sums = torch.full((n, kernels.layout.transpose_sum_rows(a, b), a), float("nan"), dtype=torch.float32)
    kernels.layout.transpose_last(src, a, b, out, zero=zero, sums=sums)
    torch.testing.assert_close(out, src.transpose(1, 2), atol=0, rtol=0)
    assert torch.equal(zero, torch.zeros_like(zero))
    block_b = kernels.layout.transpose_blocks(a, b)[1]
    want = torch.stack([src[:, :, i:i + block_b].float().sum(-1) for i in range(0, b, block_b)], 1)
    assert want.shape == sums.shape
    torch.testing.assert_close(sums, want, atol=1e-5, rtol=1e-5)
