"""The DCNv3/DCNv4 sampling geometry, shared by every backend.

Point k of output (oh, ow), group g, samples the input at

    y = oh·stride_h − pad_h + c_h + (j·dil_h − c_h + Δy)·offset_scale
    x = ow·stride_w − pad_w + c_w + (i·dil_w − c_w + Δx)·offset_scale,   c = (dil·(kernel − 1)) >> 1,

with the points ordered kw-outer (k = i·kh + j, i along the width, j along the height) and, with remove_center,
the centre tap (i = kw // 2, j = kh // 2) skipped. A point counts only strictly inside (−1, H) × (−1, W), its corners
outside the image reading zero (the reference CUDA kernels' rule; a NaN point counts nowhere).

Offsets come as (Δx, Δy) pairs: DCNv3's ``offset [N, Ho, Wo, G·K·2]`` and ``mask [N, Ho, Wo, G·K]``; DCNv4's one
``offset_mask [N, Ho, Wo, P]``, group g's block of 3K channels at g·3K (2K offsets, then K weights), P ≥ 3·G·K (its
module rounds it up to a multiple of 8; the rest is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from torch import Tensor


@dataclass(frozen=True)
class DcnGeometry:
    batch: int
    height: int
    width: int
    group: int
    group_channels: int
    kernel: Tuple[int, int]      # (kh, kw)
    stride: Tuple[int, int]
    pad: Tuple[int, int]
    dilation: Tuple[int, int]
    offset_scale: float
    remove_center: bool

    @property
    def out_h(self) -> int:
        return (self.height + 2 * self.pad[0] - (self.dilation[0] * (self.kernel[0] - 1) + 1)) // self.stride[0] + 1

    @property
    def out_w(self) -> int:
        return (self.width + 2 * self.pad[1] - (self.dilation[1] * (self.kernel[1] - 1) + 1)) // self.stride[1] + 1

    @property
    def points(self) -> int:
        """K: sampling points per group and position."""
        return self.kernel[0] * self.kernel[1] - int(self.remove_center)

    @property
    def channels(self) -> int:
        return self.group * self.group_channels

    def taps(self):
        """(i, j) of each point in order: i along the width (outer), j along the height, the centre skipped with
        remove_center."""
        kh, kw = self.kernel
        return [(i, j) for i in range(kw) for j in range(kh)
                if not (self.remove_center and i == kw // 2 and j == kh // 2)]

    def dcnv4_channels(self) -> int:
        """The fewest offset_mask channels DCNv4 takes: 3·G·K."""
        return 3 * self.group * self.points


def padded_dcnv4_channels(group: int, points: int) -> int:
    """offset_mask's channels as DCNv4's module makes them: 3·G·K rounded up to a multiple of 8."""
    return -(-3 * group * points // 8) * 8


def split_offset_mask(offset_mask: Tensor, group: int, points: int) -> Tuple[Tensor, Tensor]:
    """DCNv4's offset_mask [N, Ho, Wo, P] as DCNv3's (offset [N, Ho, Wo, G·K·2], mask [N, Ho, Wo, G·K]) (copies)."""
    n, ho, wo, _ = offset_mask.shape
    blocks = offset_mask[..., :3 * group * points].reshape(n, ho, wo, group, 3 * points)
    offset = blocks[..., :2 * points].reshape(n, ho, wo, group * 2 * points)
    mask = blocks[..., 2 * points:].reshape(n, ho, wo, group * points)
    return offset, mask


def join_offset_mask(offset: Tensor, mask: Tensor, group: int, points: int, channels: int) -> Tensor:
    """DCNv3's offset and mask as DCNv4's offset_mask with `channels` channels (>= 3·G·K; the rest zero)."""
    n, ho, wo, _ = offset.shape
    out = offset.new_zeros(n, ho, wo, channels)
    blocks = out[..., :3 * group * points].view(n, ho, wo, group, 3 * points)
    blocks[..., :2 * points] = offset.reshape(n, ho, wo, group, 2 * points)
    blocks[..., 2 * points:] = mask.reshape(n, ho, wo, group, points)
    return out
