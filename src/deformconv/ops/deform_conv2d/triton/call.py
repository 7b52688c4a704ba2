"""deform_conv2d's per-signature eager call on the Triton kernels (common/eager.py: run_planned, PlannedCall).

The eager path looks the call signature up once (../eager.py: shapes, strides, dtypes, devices, pointer
alignments, arguments, the settings the plans depend on); a Call then runs the forward and backward launchers with
the plans they found at the signature's first call, kept in its memos, so that no argument check, backend choice or
plan key is worked out again. A modulated layer's Call (``n_off``) takes its offset conv's output: where that is
NCHW-contiguous (geometry.reads_logits) the kernels read the offset and the mask's logits from it as they are and
write both gradients into one tensor like it (no split, copy or sigmoid kernel either way); else it splits it into
offset and mask itself (modulation.split_into), as eager.ModulatedDeformConv2dFunction does.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from .... import config
from ....checks import suggest_memory_format
from ...common.launch import on_device_of
from ..modulation import joined_grad, split_into
from .backward import deform_conv2d_backward
from .forward import deform_conv2d_forward
from .geometry import reads_logits


class Call:
    """One call signature of deform_conv2d (or, with n_off, of a modulated layer from its offset conv's output):
    forward(*tensors), forward_saving(*tensors) -> (out, kept), grads(grad_out, *tensors, needs, kept). Tensors:
    (input, offset, weight, bias, mask), or with n_off (input, out, weight, bias). Backward plans are kept per grad_out
    layout, needs and the settings that change them (deterministic mode, workspace budget, side streams)."""

    keeps = True  # PlannedCall: the forward's packed weight and operands go to the backward

    def __init__(self, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                 n_off: Optional[int] = None, out_format: torch.memory_format = torch.contiguous_format,
                 logits: bool = False):
        self.params = (list(stride), list(padding), list(dilation))
        self.n_off, self.out_format = n_off, out_format
        self.logits = logits  # a modulated Call whose kernels read the offset conv's output where it is
        self.forward_memo: dict = {}
        self.backward_memos: dict = {}

    def _operands(self, tensors) -> List[Optional[Tensor]]:
        """(input, offset, weight, bias, mask): a modulated Call's offset and mask (logits, with self.logits) from the
        offset conv's output."""
        if self.n_off is None:
            return list(tensors)
        input, out, weight, bias = tensors
        if self.logits:
            return [input, out[:, :self.n_off], weight, bias, out[:, self.n_off:]]
        offset, mask = split_into(out, self.n_off)
        return [input, offset, weight, bias, mask]

    def forward(self, *tensors) -> Tensor:
        input, offset, weight, bias, mask = self._operands(tensors)
        with on_device_of(input):
            return deform_conv2d_forward(input, offset, weight, bias, mask, *self.params, memo=self.forward_memo,
                                         logits=self.logits)

    def forward_saving(self, *tensors):
        """(out, kept): kept = (packed weight, offset and mask as the kernels read them), each possibly None."""
        input, offset, weight, bias, mask = self._operands(tensors)
        keep: dict = {}
        with on_device_of(input):
            out = deform_conv2d_forward(input, offset, weight, bias, mask, *self.params, keep=keep,
                                        memo=self.forward_memo, logits=self.logits)
        if self.n_off is not None:  # the split's tensors (or the views of logits) are the operands the kernels read
            return out, (keep.get("packed_weight"), offset, mask)
        return out, (keep.get("packed_weight"), keep.get("offset"), keep.get("mask"))

    def grads(self, grad_out: Tensor, *args, kept) -> tuple:
        """The gradients of the Call's tensors (PlannedCall's backward): args = (*tensors, needs)."""
        *tensors, needs = args
        packed, off, msk = kept
        if self.n_off is None:
            input, offset, weight, bias, mask = tensors
            n_in, n_off, n_w, n_b, n_mask = (bool(n) for n in needs)
            need5 = (n_in, n_off, n_mask and mask is not None, n_w, n_b and bias is not None)
        else:
            input, out, weight, bias = tensors
            offset, mask = off, msk
            n_in, n_out, n_w, n_b = (bool(n) for n in needs)
            need5 = (n_in, n_out, n_out, n_w, n_b and bias is not None)
        key = (need5, grad_out.stride(), grad_out.dtype, grad_out.data_ptr() % 16,
               torch.are_deterministic_algorithms_enabled(), config.workspace_budget(), config.backward_streams())
        memo = self.backward_memos.get(key)
        if memo is None:
            memo = self.backward_memos[key] = {}
        with on_device_of(input):
            g_in, g_off, g_mask, g_w, g_b = deform_conv2d_backward(
                grad_out, input, offset, weight, mask, *self.params, need5, packed_weight=packed, operands=(off, msk),
                memo=memo, logits=self.logits)
        if self.n_off is None:
            return g_in, g_off, g_w, g_b, g_mask
        g_out = None
        if self.logits:  # the offset conv output's gradient itself
            g_out = g_off
        elif need5[1]:
            g_out = joined_grad(out.shape, self.out_format, self.n_off, mask, g_off, g_mask)
        return g_in, g_out, g_w, g_b


def call_for(stride, padding, dilation, n_off: Optional[int] = None, out: Optional[Tensor] = None) -> Call:
    """A new signature's Call (../eager.py keeps it: run_planned's cache); out: a modulated layer's offset conv
    output, whose memory format its gradient takes, and which the kernels read as it is where they can."""
    if out is None:
        return Call(stride, padding, dilation, n_off)
    return Call(stride, padding, dilation, n_off, suggest_memory_format(out), reads_logits(out))
