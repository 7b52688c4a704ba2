"""Host-side geometry of a deform_conv2d call as the kernels see it: segments, K chunks, M tiles, layouts, keys.

GEMM view per convolution group: M = N·Ho·Wo output positions, N = Cout/groups, K = (Cin/groups)·kh·kw. K runs
over taps, then over *segments* (runs of channels inside one conv group and one offset group, which share a
sample point), then over channel chunks of BLOCK_K. Segments shorter than a tensor-core K step are *packed*: a
chunk holds NSEG of them, each with its own sample point (docs/design.md).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .... import config
from ....checks import ConvGeometry
from ....compat import codegen_profile, conv_tf32
from ....config import options
from ...common.launch import ceil_div, next_pow2, pointer_specs
from ...common.sampling import MASK_LOGITS, MASK_VALUES


def segment_length(geo: ConvGeometry) -> int:
    """Channels per segment: the longest run that lies in one conv group and one offset group."""
    return math.gcd(geo.in_channels // geo.groups, geo.in_channels // geo.offset_groups)


def packs_segments(geo: ConvGeometry, seg: int, kind: str) -> bool:
    """Whether a K chunk packs several segments (each with its own sample point): segments shorter than a
    tensor-core K step and a power of two; for the grad_input/offset/mask kernel also one offset group
    each, so that a chunk holds whole offset groups."""
    if seg >= 16 or seg & (seg - 1):
        return False
    return kind != "bwd_data" or seg == geo.in_channels // geo.offset_groups


def k_run(geo: ConvGeometry, seg: int, kind: str) -> int:
    """The channel run one K chunk lies in: the whole conv group when segments are packed, else a segment."""
    return geo.in_channels // geo.groups if packs_segments(geo, seg, kind) else seg


def segments_per_chunk(geo: ConvGeometry, seg: int, block_k: int, kind: str) -> int:
    """NSEG: 1 when a chunk lies in one segment, else block_k // seg."""
    return block_k // seg if packs_segments(geo, seg, kind) else 1


def k_chunks_whole(geo: ConvGeometry, seg: int, block_k: int, kind: str) -> bool:
    """No channel mask needed: the run a chunk lies in is a multiple of block_k."""
    return k_run(geo, seg, kind) % block_k == 0


def weight_rows(geo: ConvGeometry, seg: int, block_k: int) -> int:
    """grad_weight programs along K: groups x taps x (segments x chunks, or chunks of packed segments)."""
    cin_g = geo.in_channels // geo.groups
    if packs_segments(geo, seg, "bwd_weight"):
        return geo.groups * geo.taps * ceil_div(cin_g, block_k)
    return geo.groups * geo.taps * (cin_g // seg) * ceil_div(seg, block_k)


def count_m_tiles(geo: ConvGeometry, block_m: int, per_image: bool) -> int:
    """M tiles of block_m positions: per image (none crossing into the next), or over the flat M."""
    if per_image:
        return geo.batch * ceil_div(geo.out_h * geo.out_w, block_m)
    return ceil_div(geo.batch * geo.out_h * geo.out_w, block_m)


def per_image_tiles(geo: ConvGeometry, block_m: int, kind: str, nseg: int, run_store: bool = False) -> bool:
    """Whether M tiles stay inside one image (kernels.tiles.position_setup): one scalar division per tile instead
    of a division by Ho*Wo per position, at the cost of a partial tile per image; only where that adds at most 1/3
    more tiles than tiling M flat. The backward kernels always gain from it. The forward gains with packed
    segments, with small images (Ho*Wo within 2 tiles) and with vectorised NCHW stores (run_store) in 128-row tiles
    (or in any tile under CodegenProfile.per_image_run_stores); elsewhere flat tiles were faster."""
    if options.per_image is not None:
        return options.per_image
    flat = ceil_div(geo.batch * geo.out_h * geo.out_w, block_m)
    if 3 * (count_m_tiles(geo, block_m, True) - flat) > flat:
        return False
    if kind != "fwd":
        return True
    return (nseg > 1 or geo.out_h * geo.out_w <= 2 * block_m
            or (run_store and (block_m >= 128 or codegen_profile().per_image_run_stores)))


def grouped_input(geo: ConvGeometry, seg: int) -> bool:
    """Packed segments that are whole offset groups: the kernels read the input in the offset-grouped layout
    [N, G, H, W, Cin/G] instead of NHWC (one copy either way, from NCHW), so that the (x0, x0+1) corners of a
    sample point are one run of 2*SEG elements, loaded by two neighbouring threads from one cache line
    (sampling.corner_pairs): half the cache lines a gather instruction touches."""
    if options.grouped_input is not None:
        return options.grouped_input and packs_segments(geo, seg, "fwd")
    return packs_segments(geo, seg, "fwd") and seg == geo.in_channels // geo.offset_groups


def go_resident(geo: ConvGeometry, block_n: int) -> bool:
    """grad_input kernel: one conv group whose grad_out channels fit one N tile, loaded once per program."""
    fits = geo.groups == 1 and geo.out_channels <= block_n
    return fits if options.go_resident is None else options.go_resident and fits


def weight_k_major(dtype: torch.dtype) -> bool:
    """Whether the forward reads the weight packed K-major (packing.pack_weight): fp32. Hopper's TF32 wgmma takes
    its B operand from shared memory K-major only; from the [Cin_g, Cout_g] packing Triton would transpose every B
    tile on its way into shared memory with 4-byte copies. 16-bit wgmma reads either order."""
    return dtype == torch.float32


def size_args(geo: ConvGeometry) -> Tuple[int, ...]:
    """The kernels' runtime size arguments: H, W, CIN, HO, WO, M, CIN_G, COUT_G, COG, G."""
    return (
        geo.height, geo.width, geo.in_channels, geo.out_h, geo.out_w, geo.batch * geo.out_h * geo.out_w,
        geo.in_channels // geo.groups, geo.out_channels // geo.groups, geo.in_channels // geo.offset_groups,
        geo.offset_groups,
    )


def position_strides(t: Tensor) -> Tuple[int, int, int]:
    """(image, position, channel) element strides of a [N, C, Ho, Wo] tensor whose positions are dense
    (l = ho*Wo + wo has one stride): NCHW-contiguous or channels_last."""
    n_s, c_s, h_s, w_s = t.stride()
    assert h_s == t.shape[3] * w_s or t.shape[2] == 1, "positions must be dense"
    return n_s, w_s, c_s


def contiguous_operands(offset: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Offset and mask as the kernels read them: contiguous (a missing mask stays None)."""
    return offset.contiguous(), mask.contiguous() if mask is not None else None


def mask_kind(mask: Optional[Tensor], logits: bool) -> int:
    """The kernels' HAS_MASK (common/sampling.py): none (0), mask values, or a modulated layer's mask logits."""
    if mask is None:
        return 0
    return MASK_LOGITS.value if logits else MASK_VALUES.value


def reads_logits(out: Tensor) -> bool:
    """Whether the kernels can read a modulated layer's offset and mask logits straight from its offset conv's output
    [N, 3·G·kh·kw, Ho, Wo] (MASK_LOGITS): where it is NCHW-contiguous, so that its two channel ranges are the offset's
    and the mask's planes, each image 3·G·kh·kw planes on. (A channels_last output takes the split's copies, as every
    output does with options.mask_logits off.)"""
    return options.mask_logits and out.is_contiguous()


def tuning_class(kind: str, geo: ConvGeometry, dtype: torch.dtype, seg: int, has_mask: bool) -> tuple:
    """Tuning cache key: what changes the best config (channels, kernel, segment, dtype, M magnitude)."""
    m = geo.batch * geo.out_h * geo.out_w
    return (kind, dtype, geo.in_channels // geo.groups, geo.out_channels // geo.groups, seg, geo.kernel_h,
            geo.kernel_w, has_mask, next_pow2(m), conv_tf32())


def plan_key(kind: str, input: Tensor, offset: Tensor, weight: Tensor, mask: Optional[Tensor], stride, padding,
             dilation, pointers: Sequence[Tensor], *extra) -> tuple:
    """A launch plan's cache key: everything its geometry, configs and kernel specialisations depend on. Triton
    specialises a kernel on each pointer's dtype and 16-byte alignment, so those are part of it (the weight's dtype
    too: the grad_weight kernel can store into a tensor of it)."""
    return (kind, input.shape, input.stride(), input.dtype, input.device, offset.shape, weight.shape, weight.dtype,
            mask is None, tuple(stride), tuple(padding), tuple(dilation), conv_tf32(),
            config.autotune(), pointer_specs(pointers), *extra)
