"""deform_conv2d's CPU test cases, shared by tests/test_deform_conv2d.py and tests/ops/deform_conv2d/: the backends that
run here, small named configurations, and the comparison of a backend's output and gradients against an oracle."""

import contextlib

import pytest
import torch
from conftest import assert_close

import deformconv


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
    "nonsquare-og4": dict(n=1, cin=8, cout=4, h=6, w=7, kh=2, kw=3, groups=2, offset_groups=4, stride=(1, 2),
                          padding=(1, 0)),
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


def leaves_with_grad(args, kwargs, dtype):
    """Leaf copies (requires_grad) of the case's tensors in dtype, in GRAD_NAMES order."""
    x, offset, weight, bias = args
    tensors = [x, offset, weight, bias, kwargs["mask"]]
    return [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in tensors]


@contextlib.contextmanager
def deterministic_mode(flag=True):
    """torch.use_deterministic_algorithms(flag) inside the block, off again after it (even after an error)."""
    torch.use_deterministic_algorithms(flag)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def channels_last_leaf(t):
    """A channels_last leaf copy of t (requires_grad)."""
    return t.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)


def fwd_bwd(fn, leaves, kwargs, grad_seed=1):
    x, offset, weight, bias, mask = leaves
    out = fn(x, offset, weight, bias, stride=kwargs["stride"], padding=kwargs["padding"],
             dilation=kwargs["dilation"], mask=mask)
    g = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    wrt = [t for t in leaves if t is not None]
    # allow_unused: the naive oracle never touches an input whose every sample falls outside the image.
    grads = torch.autograd.grad(out, wrt, grad_out, allow_unused=True)
    it = iter(torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads))
    return out, [None if t is None else next(it) for t in leaves]


def compare_to_oracle(backend, dtype, leaves64, kwargs, oracle):
    ours_leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in leaves64]
    out, grads = fwd_bwd(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), ours_leaves, kwargs)
    # The oracle sees exactly the values we computed on (rounded to dtype), in float64.
    oracle_leaves = [None if t is None else t.detach().double().requires_grad_(True) for t in ours_leaves]
    ref_out, ref_grads = fwd_bwd(oracle, oracle_leaves, kwargs)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "output")
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads):
        if r is None:
            assert g is None
            continue
        assert_close(g, r, dtype, f"grad_{name}")


TRITON_BACKENDS = [p for p in BACKENDS if p.values[0] == "triton"]
