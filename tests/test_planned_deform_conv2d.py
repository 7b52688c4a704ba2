"""deform_conv2d's per-signature eager path (ops/deform_conv2d/eager.py: _planned; triton/call.py) against the
registered op on the same Triton kernels: bit for bit, under the interpreter, at every change of what a signature or a
backward plan depends on."""

import pytest
import torch
from conftest import requires_interpreter

import deformconv

pytestmark = requires_interpreter


def _leaves(seed, grads=(True,) * 5, bias=True, mask=True, size=(2, 6, 7, 9)):
    g = torch.Generator().manual_seed(seed)
    n, c, h, w = size
    x, off = torch.randn(n, c, h, w, generator=g), torch.randn(n, 2 * 2 * 9, h, w, generator=g)  # 2 offset groups
    wt = torch.randn(5, c, 3, 3, generator=g) * 0.3
    b = torch.randn(5, generator=g) if bias else None
    m = torch.rand(n, 2 * 9, h, w, generator=g) if mask else None
    return [t if t is None else t.requires_grad_(r) for t, r in zip((x, off, wt, b, m), grads)]


def _planned(x, off, w, b, m):
    return deformconv.deform_conv2d(x, off, w, b, padding=1, mask=m, backend="triton")


def _registered(x, off, w, b, m):
    return torch.ops.deformconv.deform_conv2d(x, off, w, b, m, [1, 1], [1, 1], [1, 1], "triton")


def _check(leaves, gout=None, autocast=None, node="PlannedCallBackward"):
    """The output and every gradient asked for, equal between the two paths; the planned path's node is node."""
    results = []
    for fn in (_planned, _registered):
        with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
            out = fn(*leaves)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)) if gout is None else gout
        wanted = [t for t in leaves if t is not None and t.requires_grad] if torch.is_grad_enabled() else []
        grads = iter(torch.autograd.grad(out, wanted, g.to(out.dtype)) if wanted else ())
        results.append([out] + [next(grads) if any(t is u for u in wanted) else None for t in leaves])
        if fn is _planned:
            assert (out.grad_fn and type(out.grad_fn).__name__) == node
    for i, (a, b) in enumerate(zip(*results)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), i
    return results[0]


def _calls():
    from deformconv.config import options

    return [c for c in options.cache("dcn_eager").values() if c is not None]


def test_planned_calls_equal_the_registered_op():
    from deformconv.config import options

    options.clear()
    first = _check(_leaves(0))
    assert len(_calls()) == 1  # the planned path taken
    second = _check(_leaves(1))  # the same signature, new data: the same Call
    assert len(_calls()) == 1 and not torch.equal(first[0], second[0])
    call = _calls()[0]
    _check(_leaves(2, (True, False, False, False, False)))  # other needs: other backward plans of the same Call
    _check(_leaves(3, (False, True, False, True, True)))
    _check(_leaves(4, (False, False, True, True, False)))
    assert len(_calls()) == 1 and len(call.backward_memos) == 4
    x, off, w, b, m = _leaves(5)
    _check([x, off, w, b, m], gout=torch.randn(1, 5, 1, 1).expand(2, 5, 7, 9))  # a broadcast grad_out
    _check([x, off, w, b, m], gout=torch.randn(2, 7, 9, 5).permute(0, 3, 1, 2))  # a channels-last grad_out
    torch.use_deterministic_algorithms(True)  # a setting the backward's plan depends on
    try:
        _check(_leaves(6))
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(call.backward_memos) == 7
    _check(_leaves(7, bias=False, mask=False))  # DCNv1 without bias: another signature
    with torch.no_grad():
        _check(_leaves(8), node=None)


def test_planned_calls_follow_layouts_alignment_and_autocast():
    """Other strides (a channels-last input, a sliced offset), a misaligned pointer and autocast are other signatures,
    each with the op's results; the first call of a signature with bad input raises as the general path does."""
    x, off, w, b, m = _leaves(0)
    _check([x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(), off, w, b, m])
    wide = torch.randn(2, 40, 7, 9)
    _check([x, wide[:, 1:37].requires_grad_(), w, b, wide[:, 2:20].abs().requires_grad_()])
    misaligned = torch.empty(x.numel() + 1)[1:].view(x.shape).copy_(x).requires_grad_()
    assert misaligned.data_ptr() % 16
    _check([misaligned, off, w, b, m])
    _check(_leaves(1), autocast=torch.float16)
    with pytest.raises(ValueError, match="offset"):
        deformconv.deform_conv2d(x, off[:, :17], w, b, padding=1, mask=m, backend="triton")
    before = len(_calls())
    with pytest.raises(ValueError, match="offset"):
        deformconv.deform_conv2d(x, off[:, :17], w, b, padding=1, mask=m, backend="triton")
    assert len(_calls()) == before  # a signature whose checks raise keeps no Call
