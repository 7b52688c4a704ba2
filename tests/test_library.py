"""The torch.library op: opcheck, torch.compile(fullgraph=True), torch.export, autocast."""

import pytest
import torch

import deformconv
from conftest import make_case


def _op_args(backend="reference", dtype=torch.float64, mask="random", seed=0):
    args, kw = make_case(2, 4, 6, 6, 7, 3, 3, groups=2, offset_groups=2, padding=1, mask=mask, dtype=dtype, seed=seed)
    x, offset, weight, bias = (t.requires_grad_(True) for t in args)
    m = kw["mask"].requires_grad_(True) if kw["mask"] is not None else None
    return (x, offset, weight, bias, m, [1, 1], [1, 1], [1, 1], backend)


@pytest.mark.parametrize("mask", ["random", None], ids=["dcnv2", "dcnv1"])
def test_opcheck_forward(mask):
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d.default, _op_args(mask=mask))


def test_opcheck_backward():
    x, offset, weight, bias, m, s, p, d, be = _op_args()
    grad_out = torch.randn(2, 6, 6, 7, dtype=torch.float64)
    args = (grad_out, x.detach(), offset.detach(), weight.detach(), m.detach(), s, p, d, [True, True, True, True, True], be)
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d_backward.default, args)
    args_partial = args[:8] + ([False, True, False, True, False], be)
    torch.library.opcheck(torch.ops.deformconv.deform_conv2d_backward.default, args_partial)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dcn = deformconv.ModulatedDeformConv2dPack(4, 8, 3, padding=1)
        with torch.no_grad():
            self.dcn.conv_offset.weight.normal_(0, 0.2)

    def forward(self, x):
        return torch.relu(self.dcn(x))


def test_compile_fullgraph_cpu_forward_and_backward():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    eager = net(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for g, p in zip(grads, net.parameters()):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4)


def test_compile_inductor_cpu():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    torch._dynamo.reset()
    compiled = torch.compile(net, fullgraph=True)
    torch.testing.assert_close(compiled(x), net(x), atol=1e-5, rtol=1e-5)


def test_export_has_one_op_and_runs():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(2, 4, 9, 10)
    ep = torch.export.export(net, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert sum("deformconv.deform_conv2d" in t for t in targets) == 1
    torch.testing.assert_close(ep.module()(x), net(x))


def test_autocast_cpu_runs_in_bfloat16():
    """Under autocast the op runs in the autocast dtype (not upcast to float32)."""
    args, kw = make_case(2, 4, 6, 6, 7, 3, 3, padding=1, dtype=torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_conv2d(*args, **kw)
    assert out.dtype == torch.bfloat16
    ref = deformconv.deform_conv2d(*[t.bfloat16() for t in args], **dict(kw, mask=kw["mask"].bfloat16()))
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_autocast_accepts_mixed_input_dtypes():
    """Inside autocast, float32 activations with bfloat16 weights are fine (the rule casts them)."""
    args, kw = make_case(1, 4, 6, 6, 7, 3, 3, padding=1, dtype=torch.float32, seed=4)
    x, offset, weight, bias = args
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deformconv.deform_conv2d(x, offset, weight.bfloat16(), bias, **kw)
    assert out.dtype == torch.bfloat16
