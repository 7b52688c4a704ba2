"""The backward of deform_conv2d: the batch in chunks of images, each running the grad_input/offset/mask kernel
(backward_data.py) and the grad_weight kernel (backward_weight.py), then one pass that finishes grad_weight and
grad_bias from their partial sums.

Per chunk: grad_out and the input are copied to the layouts the kernels read (one launch for both where both are
NCHW: common.layout), grad_input is accumulated in fp32 (int64 fixed point in deterministic mode) and copied back
to the input's layout, and grad_weight runs after it (its partials reuse the accumulator's memory) or, for small
batches, beside it on a side stream (schedule.concurrent_backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .... import config
from ....checks import ConvGeometry, geometry_from_tensors, suggest_memory_format
from ....config import options
from ...common.fixed_point import max_abs, scales_for
from ...common.launch import Launch, dot_precision, memoized, pick_config, remember
from ...common.layout import (
    channel_sum,
    from_offset_grouped,
    run_transposes,
    to_nhwc,
    to_nhwc_summed,
    to_offset_grouped,
)
from . import narrow_groups
from .backward_data import launch_grad_data, run_grad_data
from .backward_weight import finish_grads, launch_grad_weight, run_grad_weight, weight_targets
from .columns import columns_grad_data, columns_grad_weight, columns_usable, grad_columns_usable
from .configs import Config, bwd_data_candidates, bwd_weight_candidates
from .geometry import (
    contiguous_operands,
    grouped_input,
    mask_kind,
    plan_key,
    position_strides,
    segment_length,
    size_args,
    tuning_class,
)
from .packing import pack_weight
from .schedule import backward_schedule, side_stream, workspace_budget


def fixed_point_scales(go: Tensor, wp: Tensor, mask: Optional[Tensor], count: int, logits: bool = False
                       ) -> Tuple[Tensor, Tensor]:
    """Deterministic mode's grad_input is summed as int64 fixed point (integer adds give the same bits in any
    order): (scale, 1 / scale), powers of two as fp32 [1] tensors, such that no sum can pass 2**62. A
    contribution is grad_col * bilinear weight (<= 1) * mask, with |grad_col| <= max|grad_out| * max over
    rows of sum |W|, and one grad_input element receives at most count = Ho*Wo*kh*kw of them (one per
    position and tap of its image). The resolution is then at most bound * 2**-61: 2**-44 of the largest
    possible contribution at 100x152 images with 3x3 kernels (finer for smaller images), far below fp32's rounding.
    Computed on the device (no sync; CUDA-graph capturable). A bound that is not finite (NaN or Inf in grad_out, weight
    or mask) or beyond fp32's exponent range gives NaN scales, and so a grad_input that is NaN throughout. A mask of
    logits modulates by at most sigmoid(max |logit|) (the sigmoid is increasing), NaN where a logit is."""
    bound = max_abs(go) * max_abs(wp.abs().sum(-1)) * count
    if mask is not None:
        bound = bound * (torch.sigmoid(max_abs(mask)) if logits else max_abs(mask))
    return scales_for(bound)



def deform_conv2d_backward(
    grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], needs: Sequence[bool],
    packed_weight: Optional[Tensor] = None, operands: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
    memo: Optional[dict] = None, logits: bool = False,
):
    """Gradients (input, offset, mask, weight, bias), None where not needed. The batch is processed in
    chunks of images (schedule.backward_chunk_images) to bound the scratch memory. Under
    torch.use_deterministic_algorithms(True) grad_input is summed in int64 fixed point (fixed_point_scales)
    instead of with float atomics, so every gradient is bitwise reproducible. packed_weight: the forward's
    pack_weight(weight, groups) of the same weight in input's dtype (weight_k_major False), if it kept one
    (deform_conv2d_forward's keep), else the weight is packed here. operands: the forward's contiguous copies of
    (offset, mask), where it kept them. memo: a dict kept by a caller that knows the call signature, grad_out's
    layout, needs and the settings the plans depend on already (call.py): it holds the schedule and the plan once
    there are, so that no plan key is built at later calls. logits: offset and mask as deform_conv2d_forward's
    logits (views of one tensor, the mask's logits): the offset's and the mask's gradients are then written into one
    new tensor like it, returned in grad_offset's place (grad_mask None), the mask's with respect to the logits.
    Narrow convolution groups go through the column kernels instead (narrow_groups.py)."""
    if narrow_groups.narrow_groups(input, weight):
        return narrow_groups.backward(grad_out, input, offset, weight, mask, stride, padding, dilation, needs, logits)
    # --- check and prepare ---
    need_in, need_off, need_mask, need_w, need_b = needs
    need_in, need_off, need_w = bool(need_in), bool(need_off), bool(need_w)
    need_mask = bool(need_mask and mask is not None)
    grad_out = grad_out.to(input.dtype)
    if logits:  # one gradient tensor for both: the kernels store the two at once
        off, msk = offset, mask
        need_off = need_mask = need_off or need_mask
    else:
        off, msk = contiguous_operands(offset if operands[0] is None else operands[0],
                                       mask if operands[1] is None else operands[1])
    groups = input.shape[1] // weight.shape[1]
    wp = packed_weight if packed_weight is not None else pack_weight(weight, groups, dtype=input.dtype)
    fixed_gin = need_in and torch.are_deterministic_algorithms_enabled()
    scales = None
    if fixed_gin:  # one scale for all chunks, from the whole grad_out
        count = grad_out.shape[-2] * grad_out.shape[-1] * weight.shape[-2] * weight.shape[-1]
        scales = fixed_point_scales(grad_out, wp, msk, count, logits)

    # --- allocate what is returned ---
    grad_in = torch.empty(input.shape, dtype=input.dtype, device=input.device,
                          memory_format=suggest_memory_format(input)) if need_in else None
    joined = None
    if logits and need_off:
        joined = torch.empty((off.shape[0], off.shape[1] + msk.shape[1], *off.shape[2:]), dtype=off.dtype,
                             device=off.device)
        grad_off, grad_mask = joined[:, :off.shape[1]], joined[:, off.shape[1]:]
    else:
        grad_off = torch.empty_like(off) if need_off else None
        grad_mask = torch.empty_like(msk) if need_mask else None

    # --- the kernels chunk by chunk; grad_weight's chunk sums added in a fixed order ---
    grad_w = None
    pw = pb = None  # grad_weight's and grad_bias's fp32 partial sums, for finish_grads
    if need_in or need_off or need_mask or need_w:
        batch = input.shape[0]
        concurrent, step = memoized(memo, "schedule", lambda: _schedule(
            grad_out, input, offset, weight, mask, stride, padding, dilation, need_in, need_off or need_mask, need_w,
            fixed_gin))
        whole = step >= batch  # one chunk: it finishes grad_weight, and grad_bias beside it
        for n0 in range(0, max(batch, 1), step):
            # this chunk's images (slices cost microseconds each, so none where the chunk is the batch)
            tensors = (grad_out, input, off, msk, grad_in, grad_off, grad_mask)
            if not whole:
                tensors = tuple(t if t is None else t[n0:n0 + step] for t in tensors)
            go_c, in_c, off_c, msk_c, gin_c, goff_c, gmsk_c = tensors
            gw, pb = _backward_chunk(go_c, in_c, off_c, wp, msk_c, stride, padding, dilation, weight, scales, gin_c,
                                     goff_c, gmsk_c, need_w, concurrent, whole, need_b and whole,
                                     memo if whole else None, logits)
            if not need_w:
                continue
            if gw.dim() == 4:  # grad_weight itself (direct_grad_weight: one chunk)
                grad_w = gw
            elif whole:
                pw = gw
            else:  # this chunk's packed sum, added to the earlier chunks'
                gw = gw[0] if gw.shape[0] == 1 else gw.sum(0)
                pw = gw[None] if pw is None else pw.add_(gw)

    # --- the rest in one launch: grad_weight from its partials, grad_bias from the grad_weight kernel's partials
    # (fused_bias) or else from a channel sum over grad_out ---
    grad_b = None
    if need_b and pb is None:
        pb = channel_sum(grad_out)
    if pw is not None or pb is not None:
        fw, grad_b = finish_grads(weight, pw, pb, input.dtype, memo)
        grad_w = fw if pw is not None else grad_w
    if logits:
        return grad_in, joined, None, grad_w, grad_b
    return grad_in, grad_off, grad_mask, grad_w, grad_b


def _schedule(grad_out: Tensor, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor], stride, padding,
              dilation, need_in: bool, need_off_mask: bool, need_w: bool, fixed_gin: bool) -> Tuple[bool, int]:
    """schedule.backward_schedule of this call signature (and budget), worked out once."""
    schedules = options.cache("schedules")
    key = plan_key("schedule", input, offset, weight, mask, stride, padding, dilation, (), grad_out.stride(), need_in,
                   need_off_mask, need_w, fixed_gin, config.workspace_budget(), config.backward_streams())
    found = schedules.get(key)
    if found is None:
        geo = geometry_from_tensors(input, offset, weight, stride, padding, dilation)
        found = remember(schedules, key, backward_schedule(input, grad_out, geo, weight.numel(), need_in,
                                                           need_in or need_off_mask, need_w, fixed_gin))
    return found


@dataclass
class BackwardPlan:
    """What a chunk's call signature needs, worked out once: geometry, the kernels' shared runtime arguments and
    constexprs, the accumulator's shape, and (after the first call) the two launches."""

    geo: ConvGeometry
    seg: int
    args: tuple
    meta: dict
    gin_shape: Tuple[int, ...]
    data: Optional[Launch] = None
    weight_split: int = 1
    weight: Optional[Launch] = None


def _backward_plan(input: Tensor, off: Tensor, weight: Tensor, mask: Optional[Tensor], go: Tensor, stride, padding,
                   dilation, logits: bool) -> BackwardPlan:
    geo = geometry_from_tensors(input, off, weight, stride, padding, dilation)
    seg = segment_length(geo)
    grouped = grouped_input(geo, seg)
    args = (*size_args(geo), *geo.stride, *geo.padding, *geo.dilation, *position_strides(go))
    meta = dict(KH=geo.kernel_h, KW=geo.kernel_w, SEG=seg, HAS_MASK=mask_kind(mask, logits),
                DOT_PRECISION=dot_precision(input.dtype), GROUPED=grouped)
    # grad_input's accumulator in the layout the kernels read the input in: [N, G, H, W, C/G], G = 1 for NHWC
    layout_groups = geo.offset_groups if grouped else 1
    gin_shape = (geo.batch, layout_groups, geo.height, geo.width, geo.in_channels // layout_groups)
    return BackwardPlan(geo, seg, args, meta, gin_shape)


def _backward_chunk(
    grad_out: Tensor, input: Tensor, off: Tensor, wp: Tensor, mask: Optional[Tensor],
    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], weight: Tensor,
    scales: Optional[Tuple[Tensor, Tensor]], grad_in: Optional[Tensor], grad_off: Optional[Tensor],
    grad_mask: Optional[Tensor], need_w: bool, concurrent: bool = False, whole: bool = False, need_b: bool = False,
    memo: Optional[dict] = None, logits: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The backward of one chunk of images: writes grad_in, grad_off and grad_mask (slices of the returned
    tensors, or None when not needed) and returns what the grad_weight kernel wrote (None without need_w):
    weight_targets' fp32 partial sums or grad_weight itself; and, with need_b, grad_bias's fp32 partial sums
    [rows, Cout] from grad_out's transpose pass where it has one (NCHW), else from the grad_weight kernel where it
    sums them (fused_bias), else None. grad_input's accumulator is freed before grad_weight's partials are
    allocated (the two never add up) unless concurrent: then grad_weight runs on a side stream beside the grad_input
    kernel, its partials allocated first. memo: deform_conv2d_backward's, where the chunk is the batch."""
    # --- layouts: grad_out channels-last (vectorised, pipelined tile loads); the input NHWC or offset-grouped ---
    need_in, need_off, need_mask = grad_in is not None, grad_off is not None, grad_mask is not None
    jobs: list = []  # grad_out's and the input's transpose passes, run together below (run_transposes)
    go, go_sums = to_nhwc_summed(grad_out, jobs) if need_b else (to_nhwc(grad_out, jobs=jobs), None)
    bias_rows = need_b and go_sums is None
    msk = mask if mask is not None else off  # the mask pointer falls back to the offset; never read then
    fixed_gin = scales is not None
    plans = options.cache("plans")
    plan = key = None
    if memo is not None:
        plan = memo.get("bwd")
    if plan is None:
        key = plan_key("bwd", input, off, weight, mask, stride, padding, dilation,
                       (input, off, msk, go, grad_off if need_off else off, grad_mask if need_mask else off),
                       go.stride(), need_in, fixed_gin, need_off, need_mask, need_w, concurrent, whole, bias_rows,
                       weight.stride(), logits)
        plan = plans.get(key)
    if plan is None:
        plan = _backward_plan(input, off, weight, mask, go, stride, padding, dilation, logits)
    geo, seg, dtype = plan.geo, plan.seg, input.dtype
    # grad_input's accumulator (fp32, or int64 fixed point when deterministic), zeroed in the input's transpose pass
    gin = torch.empty(plan.gin_shape, dtype=torch.int64 if fixed_gin else torch.float32,
                      device=input.device) if need_in else None
    if plan.meta["GROUPED"]:
        x = to_offset_grouped(input, geo.offset_groups, gin, jobs)
    else:
        x = to_nhwc(input, gin, jobs=jobs)
    run_transposes(jobs, memo)

    # --- grad_weight's config (the first call; any timing of candidates runs here), unless it takes the column
    # buffer (columns.py) ---
    # not in deterministic mode, whether or not grad_input's fixed-point sums are asked for (columns._buffers_apply)
    deterministic = torch.are_deterministic_algorithms_enabled()
    columns = need_w and columns_usable(geo, dtype, deterministic)
    weight_kernel = need_w and not columns
    weight_cfg: Optional[Config] = None
    if weight_kernel and plan.weight is None:
        def launch_weight(cfg: Config) -> Launch:
            targets = weight_targets(weight, geo, cfg.split, whole, bias_rows)
            return launch_grad_weight(geo, seg, plan.args, plan.meta, cfg, x, off, msk, go, targets)

        weight_cfg = pick_config(tuning_class("bwd_weight", geo, dtype, seg, mask is not None) + (concurrent,),
                                 bwd_weight_candidates(geo, seg, dtype, input.device, concurrent),
                                 launch_weight, input.device)

    def grad_weight_into(targets: Tuple[Tensor, Optional[Tensor]]) -> None:
        """grad_weight's sums (and grad_bias's, where fused) into targets, on the current stream."""
        if weight_cfg is None:
            run_grad_weight(plan.weight, x, off, msk, go, targets)
        else:
            plan.weight_split = weight_cfg.split
            plan.weight = launch_grad_weight(geo, seg, plan.args, plan.meta, weight_cfg, x, off, msk, go, targets)

    def new_targets() -> Tuple[Tensor, Optional[Tensor]]:
        return weight_targets(weight, geo, plan.weight_split if weight_cfg is None else weight_cfg.split, whole,
                              bias_rows)

    # Concurrent: grad_weight on the side stream from here, beside the grad_input kernel (not while that kernel's
    # candidates are timed: DEFORMCONV_AUTOTUNE's first call). Every tensor it reads or writes was allocated on this
    # stream before the fork, and this stream waits for it before any of them is freed, so the caching allocator
    # cannot hand their memory out early.
    # The column buffer's route runs there too; its result, allocated on the side stream, is marked as used by this
    # one, so that its memory is not handed to the side stream again while this one still reads it.
    side = main = join = targets = grad_w = None
    if need_w and concurrent and not (config.autotune() and plan.data is None):
        targets = None if columns else new_targets()
        side, fork, join = side_stream(input.device)
        main = torch.cuda.current_stream(input.device)  # looked up once (its Stream object costs microseconds)
        fork.record(main)
        side.wait_event(fork)
        torch.cuda.set_stream(side)
        try:
            if columns:
                grad_w = columns_grad_weight(geo, x, off, mask, go, workspace_budget(), plan.meta["GROUPED"],
                                             plan.meta["HAS_MASK"])
                grad_w.record_stream(main)
            else:
                grad_weight_into(targets)
        finally:
            torch.cuda.set_stream(main)

    # --- grad_input (atomics: fp32, or int64 fixed point when deterministic), grad_offset, grad_mask ---
    try:
        if need_in or need_off or need_mask:
            if config.tracing():
                # torch's analysis of what a kernel writes follows loaded values into the addresses they index, so it
                # counts the offsets and mask (which place grad_input's scatters) as written, and a written graph
                # input fails the compile: the traced kernel reads copies
                off, msk = off.clone(), msk.clone()
            acc = gin if need_in else off
            goff = grad_off if need_off else off
            gmsk = grad_mask if need_mask else off
            scale = scales[0] if fixed_gin else off
            operands = (x, off, msk, wp, go, acc, goff, gmsk, scale)
            if grad_columns_usable(geo, dtype, deterministic):
                columns_grad_data(geo, x, off, msk if mask is not None else None, wp, go, gin, grad_off, grad_mask,
                                  workspace_budget(), plan.meta["GROUPED"], plan.meta["HAS_MASK"])
            elif plan.data is None:
                def launch_data(cfg: Config) -> Launch:
                    return launch_grad_data(geo, seg, plan.args, plan.meta, cfg, (need_in, need_off, need_mask),
                                            fixed_gin, *operands)

                tuning = tuning_class("bwd_data", geo, dtype, seg, mask is not None) + (
                    need_in, fixed_gin, need_off, need_mask, concurrent)
                cfg = pick_config(tuning, bwd_data_candidates(geo, seg, dtype, input.device, fixed_gin, concurrent),
                                  launch_data, input.device)
                if need_in:
                    gin.zero_()  # again after any tuning runs, which accumulate into it too
                plan.data = launch_data(cfg)
            else:
                run_grad_data(plan.data, *operands)
            # grad_input from its accumulator (fp32, or int64 fixed point) into the returned tensor, then the
            # accumulator is freed: grad_weight's partials below take its place (unless they exist already, beside)
            if need_in:
                if fixed_gin:
                    gin = gin.to(torch.float32).mul_(scales[1])
                from_offset_grouped(gin, grad_in, memo)
            del gin, acc, operands
    finally:  # the side stream joins this one before anything it uses can be freed, even after an error
        if side is not None:
            join.record(side)
            main.wait_event(join)

    # --- grad_weight: launched here unless it runs beside grad_input ---
    grad_b = go_sums
    if columns:
        if side is None:  # after the accumulator is freed: the column buffer takes its memory
            grad_w = columns_grad_weight(geo, x, off, mask, go, workspace_budget(), plan.meta["GROUPED"],
                                         plan.meta["HAS_MASK"])
    elif need_w:
        if side is None:  # after the accumulator is freed: the partials take its memory
            targets = new_targets()
            grad_weight_into(targets)
        grad_w, gb = targets
        grad_b = gb if gb is not None else grad_b
        del targets
    if key is not None:
        remember(plans, key, plan)
        if memo is not None:
            memo["bwd"] = plan
    return grad_w, grad_b
