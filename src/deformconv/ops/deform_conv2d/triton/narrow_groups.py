"""deform_conv2d whose convolution groups are narrow (depthwise and up to NARROW_CHANNELS input channels a group)
through the column kernels of the N-d forms at rank 2 (ops/common/columns_nd.py) instead of the implicit GEMM.

Why: the implicit GEMM runs a program per (group, position tile), each gathering its group's few channels of every
corner on its own: at a depthwise layer (8×128→128, 56², 3×3, fp16) 128 programs read 2 bytes each of the same
256-byte corner row, and the tensor-core tile pads a group's K (9 taps × 1 channel) and N (1 output channel) to 16:
the forward took 3.2 ms against cuDNN's 0.02 (benchmarks/README.md, the untuned shapes). The column kernels sample
each corner row once for all of an offset group's channels (coalesced) into columns [N, C, K, L], and the per-group
products are cuBLAS's batched GEMMs, which a narrow group turns into the bandwidth-bound sums they are.

Same arguments and results as forward.deform_conv2d_forward and backward.deform_conv2d_backward, the logits form
included (the mask's sigmoid taken here, the gradient with respect to the logits returned in the joined tensor).
Nothing is kept for the backward, which samples again. Eager calls only (narrow_groups).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from ....checks import suggest_memory_format
from ....config import options, tracing
from ...common import columns_nd as columns

# The most input channels a group that goes through the column kernels: at 1, 2, 4 and 8 channels a group the column
# route's forward+backward took 0.07-0.88x the implicit GEMM's time (fp16 and fp32, two layer shapes), the ratio rising
# with the channels toward 1 (0.85-0.88 at 8 in fp32); wider groups were not measured (docs/tuning.md: narrow groups)
NARROW_CHANNELS = 8


def narrow_groups(input: Tensor, weight: Tensor) -> bool:
    """Whether the call goes through the column kernels: more than one group, each of at most NARROW_CHANNELS
    input channels (one group of few channels, a network's first layer, keeps the implicit GEMM:
    its programs gather each corner once). options.narrow_groups forces either way. Not while tracing: the compile
    route's decomposition traces the implicit GEMM's kernels only. The column route's torch ops (copies, cuBLAS
    products under a TF32 setting held only while they run) have not been traced: the CPU harness of
    tests/test_compile_route.py cannot trace any copy of a fake CUDA tensor, and no GPU test covers it."""
    if input.shape[1] == weight.shape[1] or tracing():
        return False
    if options.narrow_groups is not None:
        return options.narrow_groups
    return weight.shape[1] <= NARROW_CHANNELS


def forward(input: Tensor, offset: Tensor, weight: Tensor, bias: Optional[Tensor], mask: Optional[Tensor],
            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], logits: bool = False) -> Tensor:
    if logits:
        mask = torch.sigmoid(mask)
    out = columns.deform_conv(input, offset, weight, bias, mask, list(stride), list(padding), list(dilation),
                              offset.shape[2:])
    return out.contiguous(memory_format=suggest_memory_format(input))


def backward(grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
             stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], needs: Sequence[bool],
             logits: bool = False) -> Tuple[Optional[Tensor], ...]:
    """(grad_input, grad_offset, grad_mask, grad_weight, grad_bias); with logits (grad_input, the offset's and the
    logits' gradients joined as the offset conv's output, None, grad_weight, grad_bias)."""
    need_in, need_off, need_mask, need_w, need_b = (bool(n) for n in needs)
    sig = None
    if logits:
        sig = torch.sigmoid(mask)
        need_off = need_mask = need_off or need_mask
    need_mask = need_mask and mask is not None
    g_in, g_off, g_w, g_mask = columns.deform_conv_backward(
        grad_out, input, offset, weight, sig if logits else mask, list(stride), list(padding), list(dilation),
        (need_in, need_off, need_w, need_mask))
    if g_in is not None:  # the gradients of input and weight in their tensors' layouts, as the op's fake promises
        g_in = g_in.contiguous(memory_format=suggest_memory_format(input))
    if g_w is not None:
        g_w = g_w.contiguous(memory_format=suggest_memory_format(weight))
    g_b = grad_out.sum((0, 2, 3), dtype=torch.float32).to(weight.dtype) if need_b else None
    if logits:
        joined = None
        if need_off:
            joined = torch.cat([g_off, (g_mask.float() * sig * (1 - sig)).to(g_mask.dtype)], 1)
        return g_in, joined, None, g_w, g_b
    return g_in, g_off, g_mask, g_w, g_b

