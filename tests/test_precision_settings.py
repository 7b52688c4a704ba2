"""TF32 settings made through either of torch's APIs: the legacy ``allow_tf32`` flags or, since torch 2.9,
``fp32_precision``, after whose use torch refuses to read the legacy flags. The ops read cuDNN's setting (their fp32
products take TF32 exactly where F.conv*d does) and must run in every state. Each state in a fresh interpreter:
torch keeps which API was used for the rest of the process."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch without fp32_precision")

# state: (statements, whether F.conv*d takes TF32 in it)
STATES = {
    "legacy-default": ("", True),
    "legacy-off": ("torch.backends.cudnn.allow_tf32 = False", False),
    "global-ieee": ("torch.backends.fp32_precision = 'ieee'", False),
    "global-ieee-conv-tf32": ("torch.backends.fp32_precision = 'ieee'\n"
                              "torch.backends.cudnn.conv.fp32_precision = 'tf32'", True),
    "cudnn-ieee": ("torch.backends.cudnn.fp32_precision = 'ieee'", False),
    "matmul-tf32": ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", True),
}

SCRIPT = """
import json, torch
{state}
import deformconv
from deformconv import compat
from deformconv.ops.common.launch import dot_precision

g = torch.Generator().manual_seed(0)
x = torch.randn(2, 4, 7, 6, generator=g, requires_grad=True)
off = torch.randn(2, 18, 7, 6, generator=g, requires_grad=True)
w = torch.randn(5, 4, 3, 3, generator=g, requires_grad=True)
deformconv.deform_conv2d(x, off, w, padding=1).sum().backward()
x1 = torch.randn(2, 4, 11, generator=g, requires_grad=True)
off1, w1 = torch.randn(2, 3, 11, generator=g), torch.randn(5, 4, 3, generator=g)
deformconv.deform_conv1d(x1, off1, w1, padding=1).sum().backward()
matmul = torch.backends.cuda.matmul
def matmul_state():
    try:
        return ("allow_tf32", matmul.allow_tf32)
    except RuntimeError:
        return ("fp32_precision", matmul.fp32_precision)
before = matmul_state()
with compat.conv_matmul_precision(torch.float32):
    inside = matmul_state()
    torch.matmul(torch.randn(3, 4), torch.randn(4, 2))
print(json.dumps(dict(tf32=compat.conv_tf32(), dot=dot_precision(torch.float32), before=before, inside=inside,
                      after=matmul_state())))
"""


@pytest.mark.parametrize("state", list(STATES))
def test_ops_run_and_read_cudnns_tf32_setting_in_every_api_state(state):
    statements, tf32 = STATES[state]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT).format(state=statements)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tf32"] is tf32 and got["dot"] == ("tf32" if tf32 else "ieee"), got
    assert got["after"] == got["before"], got  # the matmul setting restored, through the API torch accepts
    on = got["inside"][1] in (True, "tf32")
    assert on is tf32, got  # inside: the matmul takes TF32 exactly where the convolution would


GPU_SCRIPT = """
import json, torch
{state}
import deformconv

g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(2, 64, 19, 23, device="cuda", generator=g)
off = torch.randn(2, 18, 19, 23, device="cuda", generator=g)
w = torch.randn(64, 64, 3, 3, device="cuda", generator=g) / 24
err = lambda got, want: ((got.double() - want).norm() / want.norm()).item()
want = deformconv.deform_conv2d(x.double(), off.double(), w.double(), padding=1, backend="reference")
ours = err(deformconv.deform_conv2d(x, off, w, padding=1, backend="triton"), want)
dense = err(torch.nn.functional.conv2d(x, w, padding=1), torch.nn.functional.conv2d(x.double(), w.double(), padding=1))
print(json.dumps(dict(err=ours, conv_err=dense)))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state", ["legacy-default", "legacy-off", "global-ieee", "global-ieee-conv-tf32"])
def test_the_gpu_kernels_follow_cudnn(state):
    """fp32 on the GPU in each state: full fp32 (within 1e-5 of float64) where cuDNN's F.conv2d computes in full
    fp32 in that state, TF32's error where it takes TF32: the oracle is the dense convolution itself, whose reading
    of the two APIs' settings changed between torch versions."""
    statements, _ = STATES[state]
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GPU_SCRIPT).format(state=statements)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    conv_tf32 = got["conv_err"] > 1e-5
    assert (1e-5 < got["err"] < 5e-3) if conv_tf32 else got["err"] < 1e-5, (state, got)
