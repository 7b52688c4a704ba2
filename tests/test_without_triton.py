"""Without Triton: PyTorch's CPU, macOS and Windows wheels ship none, and every CPU path must work there.

Each test runs a script in a fresh interpreter where ``import triton`` fails as it does when Triton is not installed
(``sys.modules["triton"] = None``: ModuleNotFoundError, and ``importlib.util.find_spec`` says absent, as torch asks).
"""

import os
import subprocess
import sys
import textwrap

import pytest

BLOCK_TRITON = """
import sys
sys.modules["triton"] = None
"""


def run_without_triton(body: str, *args: str, timeout: int = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEFORMCONV_BACKEND")}
    script = BLOCK_TRITON + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def test_import_and_every_family_forward_backward_on_the_cpu():
    out = run_without_triton("""
        import torch
        import deformconv
        assert "triton" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
        from deformconv.ops.deform_conv2d import reference as ref

        torch.manual_seed(0)
        # deform_conv2d (DCNv2) against its float64 oracle, forward and every gradient
        x = torch.randn(2, 6, 9, 7, dtype=torch.float64, requires_grad=True)
        off = torch.randn(2, 18, 9, 7, dtype=torch.float64, requires_grad=True)
        w = torch.randn(5, 6, 3, 3, dtype=torch.float64, requires_grad=True)
        m = torch.rand(2, 9, 9, 7, dtype=torch.float64, requires_grad=True)
        out = deformconv.deform_conv2d(x, off, w, padding=1, mask=m)
        expected = ref.deform_conv2d_forward(x, off, w, None, m, (1, 1), (1, 1), (1, 1))
        torch.testing.assert_close(out, expected)
        out.square().sum().backward()
        assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, off, w, m))

        layer = deformconv.ModulatedDeformConv2dPack(6, 4, 3, padding=1)
        layer(torch.randn(1, 6, 8, 8)).sum().backward()
        deformconv.DCNv3(channels=16, group=2)(torch.randn(1, 5, 6, 16)).sum().backward()
        deformconv.DCNv4(channels=32, group=2)(torch.randn(1, 30, 32), shape=(5, 6)).sum().backward()
        attn = deformconv.MultiScaleDeformableAttention(embed_dims=32, num_heads=2, num_levels=2, num_points=2,
                                                         batch_first=True)
        shapes = torch.tensor([[6, 5], [3, 3]])
        value = torch.randn(1, 39, 32)
        attn(torch.randn(1, 4, 32), value=value, reference_points=torch.rand(1, 4, 2, 2),
             spatial_shapes=shapes, level_start_index=torch.tensor([0, 30])).sum().backward()
        pool = deformconv.DeformRoIPoolPack((3, 3), 8, spatial_scale=0.5)
        rois = torch.tensor([[0, 1.0, 2.0, 9.0, 11.0]])
        pool(torch.randn(1, 8, 10, 10), rois).sum().backward()
        deformconv.deform_psroi_pool(torch.randn(1, 18, 10, 10), rois, None, 0.5, 3, 2, True, group_size=3).sum()

        for family in ("triton",):
            reasons = deformconv.not_supported_reasons(torch.device("cpu"), torch.float32)[family]
            assert "Triton is not installed" in reasons, reasons
        print("ok", deformconv.select_backend(torch.device("cpu"), torch.float32))
    """)
    assert out.split() == ["ok", "cpu"]


def test_info_says_triton_is_not_installed():
    out = run_without_triton("""
        from deformconv.cli import main
        main(["info"])
    """)
    assert "Triton is not installed" in out


def test_demo_runs(tmp_path):
    out = run_without_triton("""
        from deformconv.cli import main
        main(["demo", "--epochs", "1", "--train", "64", "--test", "32", "--size", "16", "--width", "4",
              "--device", "cpu", "--no-progress", "--out", sys.argv[1]])
    """, str(tmp_path))
    assert "DCNv2" in out
    assert (tmp_path / "sampling_locations.png").exists()


def test_onnx_export_and_compile(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnx")
    run_without_triton("""
        import torch
        import deformconv

        layer = deformconv.DeformConv2dPack(4, 3, 3, padding=1).eval()
        x = torch.randn(1, 4, 7, 6)
        deformconv.onnx.export(layer, (x,), sys.argv[1], opset_version=19)  # checked by onnx.checker
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), layer(x))
    """, str(tmp_path / "layer.onnx"))
