"""The backward's schedule: chunks of images within a scratch budget, and grad_weight beside grad_input.

Scratch: the memory one backward needs beyond the gradients it returns. Per image: the copies of input and
grad_out (NHWC, when they come NCHW; the input's always where it is read offset-grouped: geometry.grouped_input),
grad_input's accumulator (fp32; int64 plus an fp32 conversion in deterministic mode) and grad_weight's split
partials (which reuse the accumulator's memory, or exist beside it where grad_weight runs on a side stream). Over
the whole batch that reaches 4-5x the input's size, so the batch runs in chunks of images within a budget of
``options.default_workspace_budget`` (1.5) times the input, as long as a chunk keeps ``options.min_chunk_programs``
(512) M tiles of 64 positions: a chunk that does not fill the GPU runs at a fraction of its speed.
``DEFORMCONV_WORKSPACE_BUDGET`` sets the budget instead and is then kept down to one image a chunk.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from .... import config
from ....checks import ConvGeometry
from ....config import options
from ...common.launch import ceil_div
from .configs import SPLIT_PARTIAL_BYTES
from .geometry import grouped_input, segment_length


def workspace_budget() -> float:
    """The backward's scratch budget in multiples of the input's size (DEFORMCONV_WORKSPACE_BUDGET, else
    options.default_workspace_budget)."""
    budget = config.workspace_budget()
    return options.default_workspace_budget if budget is None else budget


def _backward_bytes_per_image(input: Tensor, grad_out: Tensor, need_in: bool, need_w: bool, fixed: bool,
                              grouped: bool, concurrent: bool) -> int:
    """The backward's scratch bytes per image (see the module docstring)."""
    _, cin, h, w = input.shape
    _, cout, ho, wo = grad_out.shape
    elem = input.element_size()
    per_image = 0
    if grouped or not input.is_contiguous(memory_format=torch.channels_last):
        per_image += cin * h * w * elem
    if not grad_out.is_contiguous(memory_format=torch.channels_last):
        per_image += cout * ho * wo * elem
    scratch = 0  # bytes per input element
    if need_in:  # grad_input's accumulator: fp32, or int64 and its fp32 conversion (deterministic)
        scratch = 8 + 4 if fixed else 4
    if need_w:  # grad_weight's partials, in the accumulator's place or beside it
        scratch = scratch + SPLIT_PARTIAL_BYTES if concurrent else max(scratch, SPLIT_PARTIAL_BYTES)
    return per_image + cin * h * w * scratch


def _image_tiles(grad_out: Tensor) -> int:
    """M tiles of 64 positions in one image (the unit of options.min_chunk_programs)."""
    return ceil_div(grad_out.shape[-2] * grad_out.shape[-1], 64)


def _budget_images(input: Tensor, per_image: int) -> int:
    """The images whose scratch (per_image bytes each, > 0) fits the workspace budget, at most the batch."""
    input_bytes = input.numel() * input.element_size()
    return math.floor(min(workspace_budget() * input_bytes / per_image, input.shape[0]))


def backward_chunk_images(input: Tensor, grad_out: Tensor, need_in: bool, need_w: bool, fixed: bool,
                          grouped: bool = False, concurrent: bool = False, weight_elems: int = 0) -> int:
    """Images per chunk of the backward (the whole batch when the budget allows it, at least 1). grouped: the
    input is read offset-grouped (grouped_input), so it is copied even when it comes channels-last. concurrent:
    grad_weight's partials exist beside grad_input's accumulator (concurrent_backward) instead of in its place.
    weight_elems: the weight's elements; with need_w, chunks must save more scratch than grad_weight's fp32 sums
    over them take (_chunked_weight_bytes), else the batch runs whole (a weight large against its input: chunks
    took more memory than none)."""
    batch = input.shape[0]
    per_image = _backward_bytes_per_image(input, grad_out, need_in, need_w, fixed, grouped, concurrent)
    if batch <= 1 or per_image == 0:
        return max(batch, 1)
    images = _budget_images(input, per_image)
    if config.workspace_budget() is None:  # the default budget yields to a chunk that fills the GPU
        images = max(images, ceil_div(options.min_chunk_programs, _image_tiles(grad_out)))
    images = max(1, min(batch, images))
    if need_w and images < batch and (batch - images) * per_image <= _chunked_weight_bytes(input, images, weight_elems):
        return batch  # chunks would not save memory: grad_weight's sums over them take what they free
    return images


def _chunked_weight_bytes(input: Tensor, images: int, weight_elems: int) -> int:
    """What grad_weight's fp32 sums over chunks of images hold beyond the chunks' scratch: the running sum and a
    chunk's summed partials (a weight's size each), and the partials' excess over the SPLIT_PARTIAL_BYTES an input
    element the scratch counts for them, where weight_split's floor of 4 weights' worth exceeds that (a weight large
    against a chunk's input)."""
    weight_bytes = 4 * weight_elems
    counted = images * (input.numel() // max(input.shape[0], 1)) * SPLIT_PARTIAL_BYTES
    return 2 * weight_bytes + max(0, 4 * weight_bytes - counted)


def concurrent_backward(input: Tensor, grad_out: Tensor, need_in: bool, need_data: bool, need_w: bool, fixed: bool,
                        grouped: bool = False) -> bool:
    """Whether grad_weight runs on a side stream beside the grad_input kernel (need_data: that kernel runs, for
    grad_input, grad_offset or grad_mask). At few positions neither kernel fills the GPU, and they share only
    read-only operands. Taken on CUDA where the backward is one chunk anyway and small: the whole batch has at most
    options.min_chunk_programs M tiles (without a budget from DEFORMCONV_WORKSPACE_BUDGET, which is kept), or the
    budget admits it with grad_weight's partials beside the accumulator. Larger backwards stay sequential (no gain
    there, and the partials would cost their chunks images). DEFORMCONV_BACKWARD_STREAMS=0 turns it off."""
    if not (need_w and need_data and side_streams_usable(input.device)):
        return False
    batch = input.shape[0]
    if batch * _image_tiles(grad_out) <= options.min_chunk_programs and config.workspace_budget() is None:
        return True
    per_image = _backward_bytes_per_image(input, grad_out, need_in, need_w, fixed, grouped, True)
    return _budget_images(input, per_image) >= batch


def backward_schedule(input: Tensor, grad_out: Tensor, geo: ConvGeometry, weight_elems: int, need_in: bool,
                      need_data: bool, need_w: bool, fixed: bool) -> Tuple[bool, int]:
    """A backward's (concurrent_backward, images per chunk: backward_chunk_images), with the input's copy
    offset-grouped where the kernels read it so (grouped_input)."""
    grouped = grouped_input(geo, segment_length(geo))
    concurrent = concurrent_backward(input, grad_out, need_in, need_data, need_w, fixed, grouped)
    return concurrent, backward_chunk_images(input, grad_out, need_in, need_w, fixed, grouped, concurrent, weight_elems)


def fused_bias(need_b: bool, split: int) -> bool:
    """Whether the grad_weight kernel sums grad_bias too (GROUPS more rows of programs), where the backward is one
    chunk and grad_out comes channels-last (an NCHW grad_out's transpose pass sums it: layout.to_nhwc_summed), instead
    of a channel-sum launch. Only where grad_weight's M tiles are split: at split 1 its few bias programs would sum
    every M tile one after the other."""
    return need_b and split > 1


def direct_grad_weight(whole: bool, split: int) -> bool:
    """Whether the grad_weight kernel stores grad_weight itself in the weight's layout and dtype (a one-chunk
    backward, split 1: its sum is final) instead of fp32 partial sums for finish_grads: no partials, no finishing
    pass (options.direct_grad_weight)."""
    return options.direct_grad_weight and whole and split == 1


def side_streams_usable(device: torch.device) -> bool:
    """CUDA, DEFORMCONV_BACKWARD_STREAMS is not "0", and not tracing (a compiled graph runs on one stream)."""
    return device.type == "cuda" and config.backward_streams() and not config.tracing()


def side_stream(device: torch.device) -> Tuple["torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.Event"]:
    """The backward's side stream on a CUDA device, with the two events that fork it from the calling stream and
    join it back (one set per device, created on first use: an event recorded and waited on at once can be reused,
    and a new one a call costs host time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = options.cache("side_streams")
    if index not in streams:
        streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Event(), torch.cuda.Event())
    return streams[index]
