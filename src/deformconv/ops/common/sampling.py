"""Bilinear sampling helpers shared by the Triton kernels (``@triton.jit``, inlined into their callers).

A sample point is fractional (y, x) in an image whose pixels are ``PIX`` elements apart (channels contiguous
within a pixel). Its value is the blend of the 4 corners (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1) with
weights (1-ly)(1-lx), (1-ly)lx, ly(1-lx), ly·lx, and zero for corners outside the image. These helpers compute
the corners' addresses and validity, load them one by one or as pairs along x, blend them, and scatter a
gradient back to them (atomics), and reduce the gradient with respect to the sample point and its modulation.

Non-finite sample points give torchvision's results. A NaN point samples NaN (its fractions are NaN). An infinite
one lies outside the image and samples 0, yet the offset gradient of its other coordinate is NaN (torchvision's
bilinear derivative multiplies that coordinate's NaN fraction by zero corners). So an infinite coordinate's fraction
is +inf (``fraction``): the weights read it as 0 (``weight_fraction``), the offset gradient as it is (inf·0 = NaN).

Corner pairs: for short channel runs the corners come as ``[BM, NSEG, 2, SEG]`` tensors (position, segment,
x0 / x0+1, channel), top row and bottom row apart; in a layout where a segment's channels are a pixel's whole
run, a pair is one contiguous run of 2·SEG elements.

A row's point parameters: where a row's (up to 16) points keep their coordinates and weights in contiguous runs
(DCNv3/DCNv4's offsets and weights; attention's locations and weights are laid out alike), ``row_points`` loads them
as tiles and splits them into per-point columns in registers (``split_columns``); ``join_columns`` puts per-point
results back into a tile for one store.
"""

import triton
import triton.language as tl

# deform_conv2d's HAS_MASK, the mask operand the kernels read: none (0), mask values (MASK_VALUES), or a modulated
# layer's mask logits (MASK_LOGITS: the sigmoid taken in the kernel, its derivative folded into grad_mask; the offset
# and the logits are then the channel ranges [:2·G·KK] and [2·G·KK:] of one NCHW tensor, its offset conv's output,
# read where they are instead of split into two copies)
MASK_VALUES = tl.constexpr(1)
MASK_LOGITS = tl.constexpr(2)


@triton.jit
def div(a, b):
    """a / b rounded as IEEE division (PyTorch, nvcc's default, torchvision's kernels). Triton's `/` on fp32 is
    div.full.f32 (up to 2 ulp), which can put an exact quotient an ulp off: a RoI whose size is a whole multiple of
    its bins would then count one adaptive sample more (ceil) than torchvision and mmcv do."""
    return tl.math.div_rn(a, tl.cast(b, tl.float32))  # (div_rn takes fp32 only: b may be a count or an int)


@triton.jit
def fraction(v, v0):
    """The fraction v - v0 of a coordinate v above v0 = floor(v): NaN for a NaN v, +inf for an infinite v."""
    return tl.where(tl.abs(v) == float("inf"), float("inf"), v - v0)


@triton.jit
def weight_fraction(f):
    """A fraction as the bilinear weights and the sampled value take it: an infinite coordinate's (+inf) as 0, so that
    an infinite sample point, whose corners are all outside and zero, samples 0."""
    return tl.where(f == float("inf"), 0.0, f)


@triton.jit
def corner_addresses(y0, x0, inside, pix_base, H, W, PIX):
    """The element offset p00 of top-left corner (y0, x0) from pix_base (pixels PIX elements apart), and which of the
    4 corners lie in the image (none where inside is off): (p00, top-left, top-right, bottom-left, bottom-right)."""
    top = inside & (y0 >= 0)
    bottom = inside & (y0 + 1 < H)
    left = x0 >= 0
    right = x0 + 1 < W
    p00 = pix_base + (y0 * W + x0).to(tl.int64) * PIX
    return p00, top & left, top & right, bottom & left, bottom & right


@triton.jit
def dcn_point(y, x, pix_base, H, W, PIX, m_valid):
    """A deform_conv2d sample point (y, x) [BM] (fp32), torchvision's rule: it counts inside [-1, H) x [-1, W) (at
    -1 its value is zero and its gradient one-sided); (p00, the 4 corners' flags, the fractions ly, lx)."""
    inside = m_valid & (y >= -1.0) & (y < H) & (x >= -1.0) & (x < W)
    y0f = tl.floor(y)
    x0f = tl.floor(x)
    ly = fraction(y, y0f)
    lx = fraction(x, x0f)
    y0 = tl.where(inside, y0f, 0.0).to(tl.int32)
    x0 = tl.where(inside, x0f, 0.0).to(tl.int32)
    p00, v00, v01, v10, v11 = corner_addresses(y0, x0, inside, pix_base, H, W, PIX)
    return p00, v00, v01, v10, v11, ly, lx


@triton.jit
def sample_point(
    off_ptr, msk_ptr,      # offset [N, 2*G*KK, Ho, Wo] and mask [N, G*KK, Ho, Wo], NCHW (or as MASK_LOGITS says)
    off_row, msk_row,      # int64 [BM]: element offset of (n, channel 0, ho, wo) in offset / mask
    ch, L,                 # channel (= offset group * KK + tap), Ho*Wo
    y_ref, x_ref,          # fp32 [BM]: the regular (undeformed) sample point
    pix_base, H, W, PIX,   # int64 [BM] offset of image n in the input; input sizes; pixel stride (elements)
    m_valid,               # bool [BM]
    HAS_MASK: tl.constexpr,
):
    """Sample point of one tap and offset group: the element offset of its top-left corner (y0, x0) from
    the image's base (pixels PIX elements apart: Cin in NHWC, Cin/G in the offset-grouped layout), which of
    the 4 corners lie inside the image, the fractions (ly, lx) and the mask."""
    dy_row = off_row + (2 * ch).to(tl.int64) * L  # int64: one image's offsets may pass 2**31 elements
    dy = tl.load(off_ptr + dy_row, mask=m_valid, other=0.0).to(tl.float32)
    dx = tl.load(off_ptr + dy_row + L, mask=m_valid, other=0.0).to(tl.float32)
    p00, v00, v01, v10, v11, ly, lx = dcn_point(y_ref + dy, x_ref + dx, pix_base, H, W, PIX, m_valid)
    if HAS_MASK:
        mv = mask_value(tl.load(msk_ptr + msk_row + ch.to(tl.int64) * L, mask=m_valid, other=0.0), HAS_MASK)
    else:
        mv = tl.full(ly.shape, 1.0, tl.float32)
    return p00, v00, v01, v10, v11, ly, lx, mv


@triton.jit
def mask_value(raw, HAS_MASK: tl.constexpr):
    """The modulation (fp32) from the mask operand as loaded: itself, or the sigmoid of a logit (MASK_LOGITS), its
    division rounded as IEEE's (div; tl.sigmoid's is approximate)."""
    if HAS_MASK == MASK_LOGITS:
        return div(1.0, 1.0 + tl.exp(-raw.to(tl.float32)))
    return raw.to(tl.float32)


@triton.jit
def sample_loads(off_ptr, msk_ptr, off_row, msk_row, ch, L, m_valid, HAS_MASK: tl.constexpr):
    """sample_point's loads alone, so that they can be issued a step ahead: (dy, dx, mask) [BM] in their dtype
    (without HAS_MASK the mask is dy again, never used)."""
    dy_row = off_row + (2 * ch).to(tl.int64) * L
    dy = tl.load(off_ptr + dy_row, mask=m_valid, other=0.0)
    dx = tl.load(off_ptr + dy_row + L, mask=m_valid, other=0.0)
    if HAS_MASK:
        mraw = tl.load(msk_ptr + msk_row + ch.to(tl.int64) * L, mask=m_valid, other=0.0)
    else:
        mraw = dy
    return dy, dx, mraw


@triton.jit
def sample_from(dy, dx, mraw, y_ref, x_ref, pix_base, H, W, PIX, m_valid, HAS_MASK: tl.constexpr):
    """sample_point from its sample_loads. (sample_point keeps its own loads: one built from these two compiled to a
    longer grad_input loop.)"""
    p00, v00, v01, v10, v11, ly, lx = dcn_point(y_ref + dy.to(tl.float32), x_ref + dx.to(tl.float32), pix_base, H, W,
                                                PIX, m_valid)
    if HAS_MASK:
        mv = mask_value(mraw, HAS_MASK)
    else:
        mv = tl.full(ly.shape, 1.0, tl.float32)
    return p00, v00, v01, v10, v11, ly, lx, mv


@triton.jit
def point_corners(y, x, pix_base, H, W, PIX, live):
    """A sample point (y, x) [BM] (fp32) that counts only strictly inside (-1, H) x (-1, W) (DCNv3's, DCNv4's and
    multi-scale deformable attention's rule; a NaN point nowhere): the element offset p00 of its top-left corner
    (pixels PIX elements apart from pix_base), which of the 4 corners are read (none for a point that does not
    count), its fractions (ly, lx) (finite: a point that does not count has its coordinates replaced first), and
    whether it counts."""
    inside = live & (y > -1.0) & (y < H) & (x > -1.0) & (x < W)
    y = tl.where(inside, y, 0.0)
    x = tl.where(inside, x, 0.0)
    y0f = tl.floor(y)
    x0f = tl.floor(x)
    p00, v00, v01, v10, v11 = corner_addresses(y0f.to(tl.int32), x0f.to(tl.int32), inside, pix_base, H, W, PIX)
    return p00, v00, v01, v10, v11, y - y0f, x - x0f, inside


@triton.jit
def load_grid_corners(base, row0, row1, col0, col1, mask):
    """The 4 corners base + row + col (rows row0 / row1, columns col0 / col1: element offsets, broadcast together), as
    fp32, zero where mask is off: (top-left, top-right, bottom-left, bottom-right). For images read through their
    strides (RoI pooling)."""
    v00 = tl.load(base + row0 + col0, mask=mask, other=0.0).to(tl.float32)
    v01 = tl.load(base + row0 + col1, mask=mask, other=0.0).to(tl.float32)
    v10 = tl.load(base + row1 + col0, mask=mask, other=0.0).to(tl.float32)
    v11 = tl.load(base + row1 + col1, mask=mask, other=0.0).to(tl.float32)
    return v00, v01, v10, v11


@triton.jit
def load_corners(ptr, p00, cc, k_ok, v00, v01, v10, v11, W, CIN, EVEN_K: tl.constexpr):
    """The 4 bilinear corners [BM, BK] (the input's dtype, zero outside the image) of channels cc."""
    ptrs = ptr + p00[:, None] + cc[None, :]
    row = W * CIN
    if EVEN_K:
        c00 = tl.load(ptrs, mask=v00[:, None], other=0.0)
        c01 = tl.load(ptrs + CIN, mask=v01[:, None], other=0.0)
        c10 = tl.load(ptrs + row, mask=v10[:, None], other=0.0)
        c11 = tl.load(ptrs + row + CIN, mask=v11[:, None], other=0.0)
    else:
        c00 = tl.load(ptrs, mask=v00[:, None] & k_ok[None, :], other=0.0)
        c01 = tl.load(ptrs + CIN, mask=v01[:, None] & k_ok[None, :], other=0.0)
        c10 = tl.load(ptrs + row, mask=v10[:, None] & k_ok[None, :], other=0.0)
        c11 = tl.load(ptrs + row + CIN, mask=v11[:, None] & k_ok[None, :], other=0.0)
    return c00, c01, c10, c11


@triton.jit
def bilinear_weights(ly, lx, mv):
    """Weights of the corners (y0, x0), (y0, x0+1), (y0+1, x0), (y0+1, x0+1) from the fractions, mask folded in."""
    ly = weight_fraction(ly)
    lx = weight_fraction(lx)
    return (1.0 - ly) * (1.0 - lx) * mv, (1.0 - ly) * lx * mv, ly * (1.0 - lx) * mv, ly * lx * mv


@triton.jit
def blend(w00, w01, w10, w11, c00, c01, c10, c11, FMA: tl.constexpr):
    """The bilinear sample [..., channels] from the corners [..., channels] weighted by their bilinear_weights
    [...], computed in the corners' dtype (docs/design.md, Precision): fp32 corners in fp32; fp16 and bf16 corners
    in their dtype, the weights rounded to it (paired 16-bit FMAs). FMA: spelled as explicit FMAs
    (CodegenProfile.explicit_fma_blend)."""
    dt = c00.dtype
    if FMA:
        acc = tl.expand_dims(w00.to(dt), -1) * c00
        acc = tl.fma(tl.expand_dims(w01.to(dt), -1), c01, acc)
        acc = tl.fma(tl.expand_dims(w10.to(dt), -1), c10, acc)
        acc = tl.fma(tl.expand_dims(w11.to(dt), -1), c11, acc)
    else:
        acc = (tl.expand_dims(w00.to(dt), -1) * c00 + tl.expand_dims(w01.to(dt), -1) * c01
               + tl.expand_dims(w10.to(dt), -1) * c10 + tl.expand_dims(w11.to(dt), -1) * c11)
    return acc


@triton.jit
def segment_channels(c_first, GS, SEG: tl.constexpr, GROUPED: tl.constexpr):
    """Element offsets [NSEG, SEG] (int64, from a pixel's address) of the channels of the segments starting at
    c_first [NSEG]: the channel index itself in NHWC; in the offset-grouped layout (where a segment is a whole
    offset group) the group's base, GS = H*W*SEG elements apart, plus 0..SEG-1."""
    if GROUPED:
        base = (c_first // SEG).to(tl.int64) * GS
    else:
        base = c_first.to(tl.int64)
    return base[:, None] + tl.arange(0, SEG)[None, :]


@triton.jit
def pair_pointers(ptr, p00, cc, PIX):
    """Pointers [BM, NSEG, 2, SEG] to the top corner pairs (row y0: x0, x0+1) of each sample point: p00 is
    [BM, NSEG], cc [NSEG, SEG] (segment_channels), PIX the pixel stride."""
    j = tl.arange(0, 2)
    return ptr + p00[:, :, None, None] + (cc[None, :, None, :] + (j * PIX).to(tl.int64)[None, None, :, None])


@triton.jit
def pair_mask(left_ok, right_ok, c_ok=None):
    """Which corners of a pair exist, [BM, NSEG, 2, 1], from the left and right corners' [BM, NSEG] masks;
    [BM, NSEG, 2, SEG] with c_ok [NSEG, SEG], which channels exist (a partial chunk of a long segment)."""
    left = (tl.arange(0, 2) == 0)[None, None, :, None]
    ok = tl.where(left, left_ok[:, :, None, None], right_ok[:, :, None, None])
    if c_ok is not None:
        ok = ok & c_ok[None, :, None, :]
    return ok


@triton.jit
def pair_axis_outer(t):
    """A corner-pair tensor [BM, NSEG, 2, SEG] (or a mask [BM, NSEG, 2, 1]) as [2, NSEG, BM, SEG]: the pair axis
    outermost and the positions next to the channels, how corner_pairs and scatter_pairs address their pairs where
    PAIR_AXIS_OUTER (a view, no data moved). Its own inverse."""
    return tl.permute(t, (2, 1, 0, 3))


@triton.jit
def corner_pairs(ptr, p00, cc, v00, v01, v10, v11, ROW, PIX, PAIRS_OUTER: tl.constexpr, c_ok=None):
    """The 4 corners of each sample point as two pairs [BM, NSEG, 2, SEG] in the input's dtype: top (row y0:
    x0, x0+1) and bottom (row y0+1, ROW elements further), zero outside the image, for masked-off segments
    and for channels c_ok [NSEG, SEG] excludes (if given). In the offset-grouped layout (PIX = SEG) a pair is
    one run of 2*SEG elements, which two neighbouring threads load from one cache line."""
    ptrs = pair_pointers(ptr, p00, cc, PIX)
    if PAIRS_OUTER:  # loaded as [2, NSEG, BM, SEG], returned as [BM, NSEG, 2, SEG]
        pt = pair_axis_outer(ptrs)
        top = pair_axis_outer(tl.load(pt, mask=pair_axis_outer(pair_mask(v00, v01, c_ok)), other=0.0))
        bottom = pair_axis_outer(tl.load(pt + ROW, mask=pair_axis_outer(pair_mask(v10, v11, c_ok)), other=0.0))
    else:
        top = tl.load(ptrs, mask=pair_mask(v00, v01, c_ok), other=0.0)
        bottom = tl.load(ptrs + ROW, mask=pair_mask(v10, v11, c_ok), other=0.0)
    return top, bottom


@triton.jit
def pair_weights(ly, lx, mv):
    """bilinear_weights as pairs: top (w00, w01) and bottom (w10, w11), each [BM, NSEG, 2]."""
    ly = weight_fraction(ly)
    lx = weight_fraction(lx)
    right = (tl.arange(0, 2) == 1)[None, None, :]
    wx = tl.where(right, lx[:, :, None], 1.0 - lx[:, :, None])
    return ((1.0 - ly) * mv)[:, :, None] * wx, (ly * mv)[:, :, None] * wx


@triton.jit
def blend_pairs(wt, wb, top, bottom):
    """The bilinear samples [BM, NSEG, SEG] from corner_pairs and pair_weights, in the corners' dtype as
    blend."""
    dt = top.dtype
    return tl.sum(wt[:, :, :, None].to(dt) * top + wb[:, :, :, None].to(dt) * bottom, axis=2)


@triton.jit
def scatter_add(ptrs, vals, mask, scale, FIXED: tl.constexpr):
    """grad_input's atomic add of fp32 vals: as fp32, or (FIXED, deterministic mode) as int64 fixed point
    round(vals * scale), whose sum does not depend on the order the programs add in."""
    if FIXED:
        v = vals * scale
        tl.atomic_add(ptrs, (v + tl.where(v >= 0, 0.5, -0.5)).to(tl.int64), mask=mask, sem="relaxed")
    else:
        tl.atomic_add(ptrs, vals, mask=mask, sem="relaxed")


@triton.jit
def scatter_corners(ptr, p00, cc, d_ok, g, w00, w01, w10, w11, v00, v01, v10, v11, ROW, PIX, scale,
                    FIXED: tl.constexpr):
    """grad_input's adds of g [BM, BC] (fp32) times each corner's weight [BM] at the 4 corners of each sample point
    (load_corners' layout: channels cc, those d_ok marks, from p00; rows ROW and pixels PIX elements apart)."""
    ptrs = ptr + p00[:, None] + cc[None, :]
    dm = d_ok[None, :]
    scatter_add(ptrs, g * w00[:, None], v00[:, None] & dm, scale, FIXED)
    scatter_add(ptrs + PIX, g * w01[:, None], v01[:, None] & dm, scale, FIXED)
    scatter_add(ptrs + ROW, g * w10[:, None], v10[:, None] & dm, scale, FIXED)
    scatter_add(ptrs + ROW + PIX, g * w11[:, None], v11[:, None] & dm, scale, FIXED)


@triton.jit
def accumulate_point(acc, ptr, p00, v00, v01, v10, v11, ly, lx, wt, cc, d_ok, W, PIX, D: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """acc + a sample point's bilinear samples [BM, BLOCK_D] of channels cc (those d_ok marks), weighted by wt [BM]
    (fp32; images W pixels wide, pixels PIX elements apart: load_corners)."""
    c00, c01, c10, c11 = load_corners(ptr, p00, cc, d_ok, v00, v01, v10, v11, W, PIX, BLOCK_D == D)
    w00, w01, w10, w11 = bilinear_weights(ly, lx, wt)
    return acc + blend(w00, w01, w10, w11, c00.to(tl.float32), c01.to(tl.float32), c10.to(tl.float32),
                       c11.to(tl.float32), False)


@triton.jit
def point_grads(ptr, go, gptr, p00, v00, v01, v10, v11, ly, lx, inside, wt, fx, fy, cc, d_ok, W, PIX, scale,
                D: tl.constexpr, NEED_SRC: tl.constexpr, NEED_XY: tl.constexpr, NEED_WT: tl.constexpr,
                FIXED: tl.constexpr, BLOCK_D: tl.constexpr):
    """A weighted sample point's share of the gradients, from grad_out go [BM, BLOCK_D] (fp32) of the output that
    accumulate_point adds it to. The source's, go·wt·(corner weight), is scattered to the corners (gptr:
    scatter_corners). Returned, [BM] each and zero where the point does not count or the gradient is not needed:
    the weight's Σ go·s, and the point's coordinates' fx·Σ go·∂s/∂x and fy·Σ go·∂s/∂y (fx, fy: wt times the
    coordinates' pixels a unit)."""
    gw = tl.zeros_like(ly)
    gx = gw
    gy = gw
    if NEED_XY or NEED_WT:
        c00, c01, c10, c11 = load_corners(ptr, p00, cc, d_ok, v00, v01, v10, v11, W, PIX, BLOCK_D == D)
        c00, c01, c10, c11 = c00.to(tl.float32), c01.to(tl.float32), c10.to(tl.float32), c11.to(tl.float32)
        if NEED_WT:
            w00, w01, w10, w11 = bilinear_weights(ly, lx, 1.0)
            s = blend(w00, w01, w10, w11, c00, c01, c10, c11, False)
            gw = tl.where(inside, tl.sum(go * s, axis=1), 0.0)
        if NEED_XY:
            # ∂s/∂y = (1-lx)(c10 - c00) + lx(c11 - c01); ∂s/∂x = (1-ly)(c01 - c00) + ly(c11 - c10)
            sy = tl.sum(go * ((1.0 - lx)[:, None] * (c10 - c00) + lx[:, None] * (c11 - c01)), axis=1)
            sx = tl.sum(go * ((1.0 - ly)[:, None] * (c01 - c00) + ly[:, None] * (c11 - c10)), axis=1)
            gx = tl.where(inside, fx * sx, 0.0)
            gy = tl.where(inside, fy * sy, 0.0)
    if NEED_SRC:
        w00, w01, w10, w11 = bilinear_weights(ly, lx, wt)
        scatter_corners(gptr, p00, cc, d_ok, go, w00, w01, w10, w11, v00, v01, v10, v11, W * PIX, PIX, scale, FIXED)
    return gw, gx, gy


@triton.jit
def scatter_pairs(ptr, p00, cc, g, wt, wb, v00, v01, v10, v11, ROW, PIX, scale, FIXED: tl.constexpr,
                  PAIRS_OUTER: tl.constexpr, c_ok=None):
    """grad_input's adds at the 4 corners of each sample point, as corner_pairs' two pairs: grad_col g
    [BM, NSEG, SEG] (fp32) times the pair_weights wt, wb [BM, NSEG, 2] (channels c_ok excludes skipped)."""
    ptrs = pair_pointers(ptr, p00, cc, PIX)
    if PAIRS_OUTER:
        pt = pair_axis_outer(ptrs)
        scatter_add(pt, pair_axis_outer(g[:, :, None, :] * wt[:, :, :, None]),
                    pair_axis_outer(pair_mask(v00, v01, c_ok)), scale, FIXED)
        scatter_add(pt + ROW, pair_axis_outer(g[:, :, None, :] * wb[:, :, :, None]),
                    pair_axis_outer(pair_mask(v10, v11, c_ok)), scale, FIXED)
    else:
        scatter_add(ptrs, g[:, :, None, :] * wt[:, :, :, None], pair_mask(v00, v01, c_ok), scale, FIXED)
        scatter_add(ptrs + ROW, g[:, :, None, :] * wb[:, :, :, None], pair_mask(v10, v11, c_ok), scale, FIXED)


@triton.jit
def pair_sums(g, top, bottom):
    """The 4 sums over each segment's channels that grad_mask and grad_offset are linear in, [BM, NSEG] each,
    from corner_pairs and grad_col g [BM, NSEG, SEG] (fp32): sum g*c00, and sum g*d for the exact corner
    differences dx = c01 - c00, dy = c10 - c00, dy1 = c11 - c01 (each one rounding, as elementwise)."""
    top = top.to(tl.float32)
    right = (tl.arange(0, 2) == 1)[None, None, :, None]
    c00 = tl.sum(tl.where(right, 0.0, top), axis=2)
    dx = tl.sum(tl.where(right, top, -top), axis=2)
    sdy, sdy1 = tl.split(tl.sum(g[:, :, None, :] * (bottom.to(tl.float32) - top), axis=3))
    return tl.sum(g * c00, axis=2), tl.sum(g * dx, axis=2), sdy, sdy1


@triton.jit
def mask_offset_grads(s00, sdx, sdy, sdy1, ly, lx, mv, HAS_MASK: tl.constexpr):
    """grad_mask, grad_offset_y, grad_offset_x of one sample point from its pair_sums. The sampled value is
    val = c00 + lx*dx + ly*dy + lx*ly*(dy1 - dy), so grad_mask = sum g*val and grad_offset = mv * sum g *
    (d val/dy, d val/dx) = mv * ((1-lx)*dy + lx*dy1, dx + ly*(dy1 - dy)), summed over channels. grad_mask takes the
    fractions as the value does (weight_fraction), grad_offset as they are (an infinite coordinate's +inf makes the
    other coordinate's gradient NaN, as torchvision's). With MASK_LOGITS, grad_mask is the logit's: times
    mv·(1 - mv), the sigmoid's derivative."""
    dd = sdy1 - sdy
    wy = weight_fraction(ly)
    wx = weight_fraction(lx)
    g_m = s00 + wx * sdx + wy * sdy + wx * wy * dd
    if HAS_MASK == MASK_LOGITS:
        g_m = g_m * (mv * (1.0 - mv))
    return g_m, mv * (sdy + lx * dd), mv * (sdx + ly * dd)


# --- a row's point parameters as per-point columns -------------------------------------------------------------


@triton.jit
def _halves(t, BM: tl.constexpr, N: tl.constexpr):
    """t [BM, N] as its even and its odd columns, [BM, N / 2] each."""
    return tl.split(tl.reshape(t, [BM, N // 2, 2]))


@triton.jit
def split_columns(t, BM: tl.constexpr):
    """The 16 columns of t [BM, 16] as a tuple of [BM]: a tree of splits, each of which keeps a pair in one thread's
    registers, so that a column costs no load, shuffle or reduction (taking a column with tl.where and tl.sum reduces
    across the threads a tile's columns are spread over: 15,000 instructions where this takes hundreds)."""
    e, o = _halves(t, BM, 16)       # columns 0 2 4 .. 14 | 1 3 5 .. 15
    ee, eo = _halves(e, BM, 8)      # 0 4 8 12 | 2 6 10 14
    oe, oo = _halves(o, BM, 8)      # 1 5 9 13 | 3 7 11 15
    c0_8, c4_12 = _halves(ee, BM, 4)
    c2_10, c6_14 = _halves(eo, BM, 4)
    c1_9, c5_13 = _halves(oe, BM, 4)
    c3_11, c7_15 = _halves(oo, BM, 4)
    c0, c8 = tl.split(c0_8)
    c4, c12 = tl.split(c4_12)
    c2, c10 = tl.split(c2_10)
    c6, c14 = tl.split(c6_14)
    c1, c9 = tl.split(c1_9)
    c5, c13 = tl.split(c5_13)
    c3, c11 = tl.split(c3_11)
    c7, c15 = tl.split(c7_15)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)


@triton.jit
def _pair_up(even, odd, BM: tl.constexpr, N: tl.constexpr):
    """_halves' inverse: [BM, N] from its even and its odd columns ([BM, N / 2] each)."""
    return tl.reshape(tl.join(even, odd), [BM, N])


@triton.jit
def join_columns(cols, BM: tl.constexpr):
    """split_columns' inverse: the tile [BM, 16] of a tuple of 16 [BM] columns."""
    c0_8 = tl.join(cols[0], cols[8])
    c4_12 = tl.join(cols[4], cols[12])
    c2_10 = tl.join(cols[2], cols[10])
    c6_14 = tl.join(cols[6], cols[14])
    c1_9 = tl.join(cols[1], cols[9])
    c5_13 = tl.join(cols[5], cols[13])
    c3_11 = tl.join(cols[3], cols[11])
    c7_15 = tl.join(cols[7], cols[15])
    e = _pair_up(_pair_up(c0_8, c4_12, BM, 4), _pair_up(c2_10, c6_14, BM, 4), BM, 8)
    o = _pair_up(_pair_up(c1_9, c5_13, BM, 4), _pair_up(c3_11, c7_15, BM, 4), BM, 8)
    return _pair_up(e, o, BM, 16)


@triton.jit
def row_points(pair_ptr, w_ptr, pair_row, w_row, live, K: tl.constexpr, BM: tl.constexpr):
    """The parameters of K ≤ 16 points of each of BM rows, each row's points a contiguous run: (a, b) pairs at
    pair_ptr + pair_row + 2k (+1) (DCNv3's (Δx, Δy), attention's (x, y)) and weights at w_ptr + w_row + k. Two loads
    of a row's runs, where loading them a point at a time takes three loads a point, each row's in a cache line of its
    own. Returns three tuples of 16 [BM] columns (a, b, weight; fp32, zero past K and where live is off)."""
    kk = tl.arange(0, 16)
    pm = live[:, None] & (kk < K)[None, :]
    pair = pair_row[:, None, None] + 2 * kk[None, :, None] + tl.arange(0, 2)[None, None, :]
    a, b = tl.split(tl.load(pair_ptr + pair, mask=pm[:, :, None], other=0.0).to(tl.float32))
    w = tl.load(w_ptr + w_row[:, None] + kk[None, :], mask=pm, other=0.0).to(tl.float32)
    return split_columns(a, BM), split_columns(b, BM), split_columns(w, BM)
