"""Tiles of the deform_conv2d kernels: output positions of an M tile, the sample points of a packed K step, and
the weight and grad_out tiles (through pointers, or TMA descriptors built here on the host).

M tiles are either flat over N·Ho·Wo (a tile may end in the next image) or per image (``PER_IMAGE``: none crosses
into the next, so image and position come from one scalar division per tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ....checks import ConvGeometry
from ....compat import TensorDescriptor
from ...common.sampling import (
    MASK_LOGITS,
    corner_pairs,
    mask_offset_grads,
    pair_sums,
    pair_weights,
    sample_point,
    scatter_pairs,
    segment_channels,
)

# --- @triton.jit helpers -------------------------------------------------------------------------------


@triton.jit
def tile_start(pid_m, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """M tile pid_m's first position: (image index, l0 = ho*Wo + wo), int32 scalars. PER_IMAGE: cdiv(L, BLOCK_M)
    tiles an image, none crossing into the next; else M is tiled flat (a tile may end in the next image)."""
    if PER_IMAGE:
        tiles = tl.cdiv(L, BLOCK_M)
        return pid_m // tiles, (pid_m % tiles) * BLOCK_M
    img = (pid_m * BLOCK_M) // L
    return img, pid_m * BLOCK_M - img * L


@triton.jit
def tile_positions(pid_m, M, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """M tile pid_m's positions: (valid, image index int64, l = ho*Wo + wo int32), [BM] each; see position_setup."""
    if PER_IMAGE:
        img, l0 = tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        l32 = l0 + tl.arange(0, BLOCK_M)
        return l32 < L, tl.zeros((BLOCK_M,), tl.int64) + img.to(tl.int64), l32
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_m < M, (offs_m // L).to(tl.int64), offs_m % L


@triton.jit
def position_setup(pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, HAS_MASK: tl.constexpr,
                    PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per output position of M tile pid_m: validity, image index, l = ho*Wo + wo (int64, for addresses), the
    NHWC image base, the offset/mask row bases (int64) and the undeformed top-left sample point. The offset's and
    mask's images are 2·G·KK and G·KK planes apart, or with MASK_LOGITS both 3·G·KK (channel ranges of one tensor).
    PER_IMAGE: tiles never cross an image (N * cdiv(Ho*Wo, BLOCK_M) of them), so the image index and l come
    from one scalar division per tile instead of a division by Ho*Wo per position; else M is tiled flat."""
    L = HO * WO
    if HAS_MASK == MASK_LOGITS:
        off_planes = 3 * G * KK
        msk_planes = 3 * G * KK
    else:
        off_planes = 2 * G * KK
        msk_planes = G * KK
    if PER_IMAGE:
        img, l0 = tile_start(pid_m, L, PER_IMAGE, BLOCK_M)
        img = img.to(tl.int64)
        l32 = l0 + tl.arange(0, BLOCK_M)
        m_valid = l32 < L
        n_img = tl.zeros((BLOCK_M,), tl.int64) + img
        l = l32.to(tl.int64)
        off_row = img * off_planes * L + l
        msk_row = img * msk_planes * L + l
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = offs_m < M
        n_img = (offs_m // L).to(tl.int64)
        l32 = offs_m % L
        l = l32.to(tl.int64)
        off_row = n_img * off_planes * L + l
        msk_row = n_img * msk_planes * L + l
    ho = l32 // WO
    wo = l32 % WO
    pix_base = n_img * H * W * CIN
    y_out = (ho * STRIDE_H - PAD_H).to(tl.float32)
    x_out = (wo * STRIDE_W - PAD_W).to(tl.float32)
    return m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out


@triton.jit
def tap_origin(tap, y_out, x_out, KW: tl.constexpr, DIL_H, DIL_W):
    """The undeformed sample point of tap (row-major over the kernel window): fp32 [BM] y and x."""
    i = tap // KW
    j = tap - i * KW
    return y_out + (i * DIL_H).to(tl.float32), x_out + (j * DIL_W).to(tl.float32)


@triton.jit
def chunk_sample_points(off_ptr, msk_ptr, off_row, msk_row, c_first, seg_ok, tap, COG, KK: tl.constexpr, L,
                         y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK: tl.constexpr):
    """sample_point for a K chunk of NSEG short segments: one sample point per (position, segment), all
    [BM, NSEG]. c_first [NSEG] is each segment's first channel, seg_ok [NSEG] which segments exist."""
    ch = (c_first // COG) * KK + tap
    return sample_point(off_ptr, msk_ptr, off_row[:, None], msk_row[:, None], ch[None, :], L, y_ref[:, None],
                         x_ref[:, None], pix_base[:, None], H, W, PIX, m_valid[:, None] & seg_ok[None, :], HAS_MASK)


@triton.jit
def packed_step(x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, live, step, gc,
                 H, W, PIX, GS, L, CIN_G, COG, DIL_H, DIL_W,
                 KW: tl.constexpr, KK: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
                 HAS_MASK: tl.constexpr, GROUPED: tl.constexpr, PAIRS_OUTER: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step `step` (= tap * chunks + chunk) of a packed-segment K loop of conv group gc: the blend weights as
    pair_weights [BM, NSEG, 2] (fp32, mask folded in) and the corners as corner_pairs [BM, NSEG, 2, SEG]
    (input dtype), so that they can be issued one step ahead. Positions with `live` False load nothing."""
    n_chunks = tl.cdiv(CIN_G, BLOCK_K)
    tap = step // n_chunks
    c0 = (step - tap * n_chunks) * BLOCK_K
    y_ref, x_ref = tap_origin(tap, y_out, x_out, KW, DIL_H, DIL_W)
    offs_s = tl.arange(0, NSEG)
    c_first = gc * CIN_G + c0 + offs_s * SEG
    p00, v00, v01, v10, v11, ly, lx, mv = chunk_sample_points(
        off_ptr, msk_ptr, off_row, msk_row, c_first, c0 + offs_s * SEG < CIN_G, tap, COG, KK, L,
        y_ref, x_ref, pix_base, H, W, PIX, live, HAS_MASK)
    channels = segment_channels(c_first, GS, SEG, GROUPED)
    top, bottom = corner_pairs(x_ptr, p00, channels, v00, v01, v10, v11, W * PIX, PIX, PAIRS_OUTER)
    wt, wb = pair_weights(ly, lx, mv)
    return wt, wb, top, bottom


@triton.jit
def segment_grads(x_ptr, gin_ptr, p00, cc, g, wt, wb, v00, v01, v10, v11, ROW, PIX, scale, s00, sdx, sdy, sdy1,
                  NEED_SUMS: tl.constexpr, NEED_GIN: tl.constexpr, FIXED: tl.constexpr, PAIRS_OUTER: tl.constexpr,
                  c_ok=None):
    """One channel chunk of one segment's grad_col g [BM, 1, BK] (fp32): its pair_sums added to the running sums
    (s00, sdx, sdy, sdy1) [BM, 1] that grad_offset and grad_mask are linear in (NEED_SUMS), and its scatter to the
    4 corners of grad_input (NEED_GIN; fixed point if FIXED). Returns the sums."""
    if NEED_SUMS:
        top, bottom = corner_pairs(x_ptr, p00, cc, v00, v01, v10, v11, ROW, PIX, PAIRS_OUTER, c_ok)
        a00, adx, ady, ady1 = pair_sums(g, top, bottom)
        s00 += a00
        sdx += adx
        sdy += ady
        sdy1 += ady1
    if NEED_GIN:
        scatter_pairs(gin_ptr, p00, cc, g, wt, wb, v00, v01, v10, v11, ROW, PIX, scale, FIXED, PAIRS_OUTER, c_ok)
    return s00, sdx, sdy, sdy1


@triton.jit
def store_point_grads(goff_ptr, gmsk_ptr, off_row, msk_row, ch, L, s00, sdx, sdy, sdy1, ly, lx, mv, m_valid,
                      HAS_MASK: tl.constexpr, NEED_GOFF: tl.constexpr, NEED_GMSK: tl.constexpr):
    """grad_offset and grad_mask of one (tap, offset group) [BM, 1] from segment_grads' sums, stored (NCHW, as the
    offset and mask: each element owned by one program)."""
    g_m, g_y, g_x = mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv, HAS_MASK)
    done = m_valid[:, None]
    if NEED_GOFF:
        gy_row = off_row[:, None] + (2 * ch).to(tl.int64) * L
        tl.store(goff_ptr + gy_row, g_y.to(goff_ptr.dtype.element_ty), mask=done)
        tl.store(goff_ptr + gy_row + L, g_x.to(goff_ptr.dtype.element_ty), mask=done)
    if NEED_GMSK:
        tl.store(gmsk_ptr + msk_row[:, None] + ch.to(tl.int64) * L, g_m.to(gmsk_ptr.dtype.element_ty), mask=done)


@triton.jit
def weight_tile(w_ptr, rows, tap_row, k_ok, n_ok, offs_n, CIN_G, COUT_G, K_MAJOR: tl.constexpr, EVEN_K: tl.constexpr):
    """B tile [BK, BN] of the packed weight (pack_weight): rows (int64 [BK], k_ok which exist) of its
    groups*KK*Cin_g input-channel rows, all in the conv group and tap whose rows start at tap_row (int64), x output
    channels offs_n. (Both row forms are passed: deriving rows from tap_row in here changed the N-major build's
    register allocation, and its packed bf16 forward spilled.)"""
    if K_MAJOR:  # [groups, KK, Cout_g, Cin_g]
        ptrs = w_ptr + tap_row * COUT_G + (rows - tap_row)[:, None] + offs_n[None, :] * CIN_G
    else:  # [groups, KK, Cin_g, Cout_g]
        ptrs = w_ptr + rows[:, None] * COUT_G + offs_n[None, :]
    if EVEN_K:
        b = tl.load(ptrs, mask=n_ok[None, :], other=0.0)
    else:
        b = tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return b


@triton.jit
def weight_tma_tile(w_ptr, tap_index, k0, n0, CIN_G, COUT_G, K_MAJOR: tl.constexpr):
    """weight_tile through the TMA descriptor w_ptr (weight_descriptor): B [BK, BN] of input channels k0.. (counted
    from the conv group's first) x output channels n0.. of tap_index = gc * KH*KW + tap. K_MAJOR reads the [BN, BK]
    block and transposes it in shared memory; its rows past the tap's Cout_g are the next tap's, which reach only
    accumulator columns that are never stored."""
    if K_MAJOR:
        b = w_ptr.load([tap_index * COUT_G + n0, k0]).T
    else:
        b = w_ptr.load([tap_index * CIN_G + k0, n0])
    return b


@triton.jit
def grad_out_tile(go_ptr, tile, col, L, PER_IMAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The grad_out tile [BM, BN] of M tile `tile` (as position_setup numbers them), channels col.., through its
    TMA descriptor go_ptr: [N, Ho*Wo, Cout] in blocks [1, BM, BN] for PER_IMAGE tiles, else [M, Cout] in blocks
    [BM, BN]. Rows past an image or past M read zeros."""
    if PER_IMAGE:
        img, l0 = tile_start(tile, L, PER_IMAGE, BLOCK_M)
        return tl.reshape(go_ptr.load([img, l0, col]), (BLOCK_M, BLOCK_N))
    else:
        return go_ptr.load([tile * BLOCK_M, col])


# --- host: TMA descriptors -----------------------------------------------------------------------------


def weight_descriptor(wp: Tensor, block_k: int, block_n: int, k_major: bool = False):
    """TMA descriptor of the packed weight [groups, kh*kw, Cin_g, Cout_g] as a [groups*kh*kw*Cin_g, Cout_g] matrix,
    in [block_k, block_n] blocks (columns past Cout_g read zeros); with k_major, of [groups, kh*kw, Cout_g, Cin_g] as
    [groups*kh*kw*Cout_g, Cin_g] in [block_n, block_k] blocks (rows past a tap's Cout_g read the next tap's)."""
    row = wp.shape[-1]
    block = [block_n, block_k] if k_major else [block_k, block_n]
    return TensorDescriptor(wp, [wp.numel() // row, row], [row, 1], block)


def grad_out_tma_ok(go: Tensor, geo: ConvGeometry, block_n: int) -> bool:
    """Whether grad_out's tiles can come through grad_out_descriptor (beside tma_launch's checks): dense NHWC, and
    a tile of block_n channels never reaches into the next conv group's channels."""
    cout_g = geo.out_channels // geo.groups
    return go.is_contiguous(memory_format=torch.channels_last) and (geo.groups == 1 or cout_g % block_n == 0)


def grad_out_descriptor(go: Tensor, per_image: bool, block_m: int, block_n: int):
    """TMA descriptor of grad_out (dense NHWC) for grad_out_tile: [N, Ho*Wo, Cout] in [1, block_m, block_n] blocks
    for per-image M tiles, else [M, Cout] in [block_m, block_n] blocks."""
    n, c, h, w = go.shape
    if per_image:
        return TensorDescriptor(go, [n, h * w, c], [h * w * c, c, 1], [1, block_m, block_n])
    return TensorDescriptor(go, [n * h * w, c], [c, 1], [block_m, block_n])
