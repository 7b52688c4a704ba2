"""TorchScript: scripted and traced modules give eager's results, trace without warnings of ours, and a saved model
runs in a fresh process that imports deformconv."""

import subprocess
import sys
import warnings
from typing import Optional

import pytest
import torch

import deformconv

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*is deprecated:FutureWarning")


def _modules():
    torch.manual_seed(0)
    v2 = deformconv.ModulatedDeformConv2dPack(4, 6, 3, padding=1)
    v1 = deformconv.DeformConv2dPack(4, 6, 3, stride=2, padding=1, dilation=1, offset_groups=2)
    for m in (v1, v2):  # offsets that move the samples
        torch.nn.init.normal_(m.conv_offset.weight, std=0.1)
    return {"dcnv2-pack": v2.double(), "dcnv1-pack": v1.double()}


def _input():
    return torch.randn(2, 4, 7, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("name", ["dcnv2-pack", "dcnv1-pack"])
def test_scripted_packs_equal_eager(name):
    m = _modules()[name]
    x = _input()
    scripted = torch.jit.script(m)
    torch.testing.assert_close(scripted(x), m(x), atol=0, rtol=0)
    xg = x.clone().requires_grad_()
    scripted(xg).sum().backward()
    xe = x.clone().requires_grad_()
    m(xe).sum().backward()
    torch.testing.assert_close(xg.grad, xe.grad, atol=0, rtol=0)


def test_scripted_deform_conv2d_with_and_without_mask():
    torch.manual_seed(2)
    d = deformconv.DeformConv2d(4, 6, 3, padding=1, groups=2).double()
    x = _input()
    g = torch.Generator().manual_seed(3)
    offset = torch.randn(2, 18, 7, 9, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 9, 7, 9, generator=g, dtype=torch.float64)
    scripted = torch.jit.script(d)
    torch.testing.assert_close(scripted(x, offset, mask), d(x, offset, mask), atol=0, rtol=0)
    torch.testing.assert_close(scripted(x, offset), d(x, offset), atol=0, rtol=0)
    f = torch.jit.script(deformconv.deform_conv2d_script)
    torch.testing.assert_close(f(x, offset, d.weight, d.bias, [1, 1], [1, 1], [1, 1], mask), d(x, offset, mask))
    with pytest.raises(RuntimeError, match=r"ValueError: offset.shape\[1\] must be 2\*offset_groups\*kh\*kw .* got 10"):
        scripted(x, offset[:, :10])  # the op's own checks: a clear error, not garbage


def _user_function(x: torch.Tensor, offset: torch.Tensor, weight: torch.Tensor, mask: Optional[torch.Tensor]):
    """A user's function calling deform_conv2d as torchvision's is called, keywords and tuples included."""
    return deformconv.deform_conv2d(x, offset, weight, None, stride=(1, 2), padding=(1, 1), dilation=(1, 1),
                                    mask=mask)


def test_functions_calling_deform_conv2d_script():
    """torch.jit.script of deform_conv2d itself and of a function calling it (torchvision's test_backward scripts
    exactly this): the same results and gradients as eager; backend= stays for eager callers."""
    g = torch.Generator().manual_seed(4)
    x = _input().requires_grad_()
    offset = torch.randn(2, 18, 7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 9, 7, 5, generator=g, dtype=torch.float64)
    scripted = torch.jit.script(_user_function)
    for m in (mask, None):
        out = scripted(x, offset, weight, m)
        want = _user_function(x, offset, weight, m)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        grads = torch.autograd.grad(out.sum(), (x, offset, weight))
        for a, b in zip(grads, torch.autograd.grad(want.sum(), (x, offset, weight))):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    f = torch.jit.script(deformconv.deform_conv2d)
    torch.testing.assert_close(f(x, offset, weight, None, (1, 2), (1, 1)),
                               deformconv.deform_conv2d(x, offset, weight, stride=(1, 2), padding=1, backend="cpu"))


def test_trace_without_warnings_of_ours():
    m = _modules()["dcnv2-pack"]
    x = _input()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(m, x)
    ours = [str(w.message) for w in caught if not issubclass(w.category, FutureWarning)]
    assert ours == []
    torch.testing.assert_close(traced(x), m(x), atol=0, rtol=0)
    x2 = torch.randn(1, 4, 5, 6, dtype=torch.float64)  # the trace holds no shapes of the example input
    torch.testing.assert_close(traced(x2), m(x2), atol=0, rtol=0)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_saved_model_runs_in_a_fresh_process(how, tmp_path):
    m = _modules()["dcnv2-pack"]
    x = _input()
    model = torch.jit.script(m) if how == "script" else torch.jit.trace(m, x)
    path = tmp_path / "model.pt"
    model.save(str(path))
    torch.save({"x": x, "y": m(x).detach()}, tmp_path / "io.pt")
    code = ("import torch, deformconv; m = torch.jit.load(r'%s'); d = torch.load(r'%s'); "
            "torch.testing.assert_close(m(d['x']), d['y'], atol=0, rtol=0); print('ok')") % (path, tmp_path / "io.pt")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
