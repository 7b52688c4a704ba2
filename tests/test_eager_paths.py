"""The new ops' eager fast path (ops/common/eager.run_eager): plain eager calls skip the custom-op dispatcher and
give the registered op's results and gradients exactly, plainly and under autocast; calls the op must see (here
under a TorchDispatchMode) still take it."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deformconv


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _calls():
    """(name, function of the leaves, leaves) for each new op, fresh random signed inputs."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, 6)
    dcn = (torch.randn(2, 5, 6, 2 * 9 * 2), torch.rand(2, 5, 6, 2 * 9))
    shapes, starts = torch.tensor([[4, 5], [2, 3]]), torch.tensor([0, 20])
    rois = torch.tensor([[0, 1.0, 1.0, 9.0, 7.0], [1, 0.0, 2.0, 11.0, 11.0]])
    return [
        ("dcnv3", lambda x, o, m: deformconv.dcnv3(x, o, m, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0),
         [torch.randn(2, 5, 6, 6), *dcn]),
        ("dcnv4", lambda x, om: deformconv.dcnv4(x, om, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0),
         [torch.randn(2, 5, 6, 6), torch.randn(2, 5, 6, 56)]),
        ("ms_deform_attn", lambda v, loc, a: deformconv.ms_deform_attn(v, shapes, starts, loc, a),
         [torch.randn(2, 26, 2, 3), torch.rand(2, 4, 2, 2, 3, 2), torch.rand(2, 4, 2, 2, 3)]),
        ("deform_roi_pool", lambda x, o: deformconv.deform_roi_pool(x, rois, o, 2, 0.5, 2),
         [x, torch.randn(2, 2, 2, 2)]),
        ("deform_psroi_pool", lambda x, o: deformconv.deform_psroi_pool(x[:, :4], rois, o, 0.5, 2, 4, False,
                                                                         sample_per_part=2, trans_std=0.1),
         [x, torch.randn(2, 2, 2, 2)]),
    ]


def _run(fn, leaves):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    return out, grads


@pytest.mark.parametrize("name,fn,leaves", _calls(), ids=[c[0] for c in _calls()])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast-bf16"])
def test_fast_path_equals_the_op_and_skips_the_dispatcher(name, fn, leaves, autocast):
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    with ctx():
        out, grads = _run(fn, leaves)
        assert type(out.grad_fn).__name__ == "_EagerOpBackward", type(out.grad_fn).__name__
        seen = _Seen()
        with seen:  # a dispatch mode: the registered op
            op_out, op_grads = _run(fn, leaves)
    assert any(f"deformconv.{name}" in op for op in seen.ops), seen.ops[:5]
    assert out.dtype == op_out.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(out, op_out, atol=0, rtol=0)
    for g, og in zip(grads, op_grads):
        torch.testing.assert_close(g, og, atol=0, rtol=0)


def _all_calls():
    """_calls() and deform_conv2d."""
    torch.manual_seed(1)
    conv = ("deform_conv2d", lambda x, o, w, b, m: deformconv.deform_conv2d(x, o, w, b, padding=1, mask=m),
            [torch.randn(2, 4, 5, 7), torch.randn(2, 18, 5, 7), torch.randn(6, 4, 3, 3), torch.randn(6),
             torch.rand(2, 9, 5, 7)])
    return _calls() + [conv]


@pytest.mark.parametrize("name,fn,leaves", _all_calls(), ids=[c[0] for c in _all_calls()])
@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast-bf16"])
@pytest.mark.parametrize("how", ["no_grad", "no-input-requires-grad"])
def test_calls_without_gradients_build_no_node_and_equal_the_op(name, fn, leaves, autocast, how):
    """Inference (grad mode off, or no input requiring grad) skips the autograd node as well, with the op's result."""
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    grad_mode = torch.no_grad if how == "no_grad" else contextlib.nullcontext
    leaves = [t.detach().clone().requires_grad_(how == "no_grad") for t in leaves]
    with ctx(), grad_mode():
        out = fn(*leaves)
        seen = _Seen()
        with seen:
            op_out = fn(*leaves)
    assert out.grad_fn is None and not out.requires_grad
    assert any(f"deformconv.{name}" in op for op in seen.ops), seen.ops[:5]
    assert out.dtype == op_out.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(out, op_out, atol=0, rtol=0)


def _once_differentiable_calls():
    """(name, function of the leaves, leaves): one call on each kind of eager node: the new ops' run_eager node
    (cpu backend), their per-signature Call and deform_conv2d's (triton backend, interpreted), deform_conv2d's own
    Function and a modulated layer's."""
    torch.manual_seed(1)
    shapes, starts = torch.tensor([[4, 5], [2, 3]]), torch.tensor([0, 20])
    layer = deformconv.ModulatedDeformConv2dPack(3, 4, 3, padding=1)
    torch.nn.init.normal_(layer.conv_offset.weight, std=0.1)
    msda = lambda backend: (lambda v, loc, a: deformconv.ms_deform_attn(  # noqa: E731
        v, shapes, starts, loc, a, backend=backend))
    msda_leaves = [torch.randn(2, 26, 2, 3), torch.rand(2, 4, 2, 2, 3, 2), torch.rand(2, 4, 2, 2, 3)]
    dcn_leaves = [torch.randn(2, 3, 5, 5), torch.randn(2, 18, 5, 5), torch.randn(4, 3, 3, 3), torch.rand(2, 9, 5, 5)]
    dcn = lambda backend: (lambda x, o, w, m: deformconv.deform_conv2d(  # noqa: E731
        x, o, w, padding=1, mask=m, backend=backend))
    return [
        ("ms_deform_attn-cpu", msda("cpu"), msda_leaves),
        ("ms_deform_attn-triton", msda("triton"), msda_leaves),
        ("dcnv3-triton", lambda x, o, m: deformconv.dcnv3(x, o, m, 3, 3, 1, 1, 1, 1, 1, 1, 2, 3, 1.0, backend="triton"),
         [torch.randn(2, 5, 6, 6), torch.randn(2, 5, 6, 36), torch.rand(2, 5, 6, 18)]),
        ("deform_conv2d-cpu", dcn("cpu"), dcn_leaves),
        ("deform_conv2d-triton", dcn("triton"), dcn_leaves),
        ("modulated-layer", layer, [torch.randn(2, 3, 5, 5)]),
    ]


@pytest.mark.parametrize("name,fn,leaves", _once_differentiable_calls(),
                         ids=[c[0] for c in _once_differentiable_calls()])
def test_every_eager_node_is_differentiable_once(name, fn, leaves):
    """A gradient taken with create_graph=True through any eager node, differentiated again, raises (torch's
    once_differentiable, which eager.once_differentiable runs wherever grad mode is on) instead of passing a silent
    zero; without create_graph the gradients are those of a plain backward."""
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    (plain,) = torch.autograd.grad(out.square().sum(), leaves[0], retain_graph=True)
    (g,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
    assert torch.equal(g.detach(), plain) and torch.isfinite(plain).all() and plain.abs().sum() > 0
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.square().sum().backward()
