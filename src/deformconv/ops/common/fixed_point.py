"""Deterministic mode's fixed-point sums: atomics that add int64 give the same bits in any order.

A gradient summed by atomics from contributions each at most ``bound`` in magnitude, ``count`` of them into one
element, is summed as round(value · scale) in int64 with scale a power of two such that no sum can pass 2**62.
Computed on the device (no sync; CUDA-graph capturable). A bound that is not finite (a NaN or Inf among its
factors) or beyond fp32's exponent range gives NaN scales, and so a gradient that is NaN throughout.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def max_abs(t: Tensor) -> Tensor:
    """max |t| as a float64 scalar on t's device; 0 for an empty tensor."""
    return torch.linalg.vector_norm(t, float("inf")).double() if t.numel() else t.new_zeros((), dtype=torch.float64)


def scales_for(bound: Tensor) -> Tuple[Tensor, Tensor]:
    """(scale, 1 / scale), fp32 [1] tensors, for sums of magnitude at most bound (a float64 scalar tensor)."""
    exp = 62 - torch.ceil(torch.log2(bound))  # bound 0: +inf, clamped to the largest scale below
    usable = torch.isfinite(bound) & (exp >= -126)
    exp = torch.where(usable, exp.clamp(max=126), torch.full_like(exp, float("nan")))
    return torch.exp2(exp).float().reshape(1), torch.exp2(-exp).float().reshape(1)
