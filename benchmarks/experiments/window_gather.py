"""Experiment: are the forward's gathers cheaper from a window of the input staged in shared memory?

v27 (benchmarks/NOTES.md) found the forward bound by its gathers: det-s4 loads 560 MB of bilinear corners, every one
from the L2 (the 16-byte corner copies are `cp.async.cg`), 36 times the input's bytes. Neighbouring output positions
and taps share most of their corners, so a tile could load the input pixels around it once per channel chunk (a
window) and take its corners from there, falling back to global loads for the samples whose offsets take them out of
the window. Triton has no indexed shared-memory load; its one way there is `tl.gather`, which stores its source
tensor into shared memory and loads each gathered element from it (GatherOpToLLVM's shared-memory path; a 2-D gather
is given a warp-local layout instead, 16 shuffles an element here, so the window is gathered as a 1-D tensor). This
script measures that route on the gathers alone -- no weights, no MMA: per output position and channel, the sum over
the taps of the mask-weighted bilinear samples -- against plain global corner loads of the same tiles.

Answer (H200, fp16, v28 in NOTES.md, benchmarks/results/h200-window-gather.json, run "final"): the window loses.
MODE 1 took 0.244 / 0.234 / 0.114 ms at det-s4 / det-s5 / cls-14 against 0.081 / 0.117 / 0.055 for plain loads of the
same 4x16 tiles, and without its fallback loads (MODE 2) 0.37 / 0.36 / 0.18. But the plain gathers alone, at 4 CTAs of
8 warps a multiprocessor, take half the product's forward: det-s4 0.071 ms (flat 64-position tiles) against 0.143,
with 49% of their loads hitting the L1 (the product's: 0.3%). Their time follows the warps in flight: det-s4 0.142 /
0.094 / 0.090 / 0.071 ms at 1 / 2 / 3 / 4 CTAs a multiprocessor (ctas_per_sm), and the product's kernel, whose
64x256 fp32 accumulator takes half its registers, runs 2.

Variants 'MODE:THxTW:WHxWW:BK:warps:stages[:ctas_per_sm]' (a tile: TH x TW output positions of one image, or with TH = 1
TW consecutive positions of the image in row-major order (the product's per-image tiles); the window: WH x WW input
pixels around it (MODE 1, 2; TH > 1); BK channels a chunk; ctas_per_sm: a grid of that many programs a multiprocessor,
each looping over tiles, else one program a tile):

    MODE 0  per tap, the 4 corners [BM, BK] loaded from global memory (fp16, 16-byte vectors, through the L1)
    MODE 1  per chunk, the window [WH*WW*BK/4] loaded once (int64 = 4 fp16 channels, zero outside the image); per
            tap, the 4 corners of every sample in one tl.gather from it, and global loads for the samples outside it
    MODE 2  MODE 1 without the fallback (samples outside the window dropped: a bound, wrong results)
    MODE 3  MODE 0 with the corner loads through the L2 only (`.cg`, as the product's cp.async copies)

Samples are blended in fp16 (as the product does) and summed over the taps in fp32.

    python benchmarks/experiments/window_gather.py [--shapes det-s4,det-s5] [--variants V,V] [--out FILE]

checks MODEs 0, 1 and 3 against the float64 reference (a depthwise deformable conv with a weight of ones) on random
signed inputs, offsets ~ N(0, 2^2) pixels as the benchmark's, on outputs poisoned with NaN, and times each variant
(CUDA-graph do_bench medians) beside the product's forward of the same layer (Cout = Cin) for scale. Runs on a GPU, or
on the CPU under TRITON_INTERPRET=1 (--tiny: a tiny shape, no timing); tests/test_experiments.py builds it for sm_90.
"""
import argparse
import json

import torch
import triton
import triton.language as tl

from deformconv.ops.deform_conv2d import _bilinear_weights

# (N, C, H, W) of the benchmark's layers (k = 3, stride 1, padding 1)
SHAPES = {"det-s3": (8, 128, 100, 152), "det-s4": (8, 256, 50, 76), "det-s5": (8, 512, 25, 38),
          "cls-14": (64, 256, 14, 14), "tiny": (1, 32, 7, 9)}


# --- kernel ------------------------------------------------------------------------------------------------------


@triton.jit
def _unpack16(v, K: tl.constexpr):
    """Field K (bits 16K..16K+15) of the int64 tensor v, as fp16: channel 4j + K of an int64 holding channels
    4j..4j+3."""
    return (v >> (16 * K)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _quad(a00, a01, a10, a11):
    """[BM, 4] from four [BM] tensors, column p*2 + q holding corner (row q, column p): a00, a10, a01, a11."""
    t = tl.join(tl.join(a00, a01), tl.join(a10, a11))  # [BM, 2 (column p), 2 (row q)]
    return tl.reshape(t, [a00.shape[0], 4])


@triton.jit
def _window_gather_kernel(
    x_ptr, x64_ptr,            # NHWC input [N, H, W, C] fp16, and the same memory as int64 [N, H, W, C/4]
    off_ptr, msk_ptr,          # offset [N, 2*KH*KW, H, W] and mask [N, KH*KW, H, W], NCHW (stride 1: Ho = H)
    out_ptr,                   # [N, H, W, C] fp32: the sum over the taps of each position's mask-weighted samples
    N, H, W, C, tiles_h, tiles_w,
    KH: tl.constexpr, KW: tl.constexpr,      # kernel size (padding KH//2, KW//2; stride and dilation 1)
    TH: tl.constexpr, TW: tl.constexpr,      # a tile: TH x TW positions of one image (TH 1: a row-major run of TW)
    WH: tl.constexpr, WW: tl.constexpr,      # its window: WH x WW input pixels (MODE 1, 2)
    BK: tl.constexpr,                        # channels a chunk
    MODE: tl.constexpr,                      # see the module docstring
):
    """Grid: N * tiles_h * tiles_w programs (one tile each), or fewer, each taking every num_programs-th tile (to
    set the CTAs a multiprocessor runs). Per tile, per chunk of BK channels, per tap: sample points,
    corners, fp16 blend, fp32 sum; the chunk's sums stored."""
    BM: tl.constexpr = TH * TW
    KK: tl.constexpr = KH * KW
    Q: tl.constexpr = BK // 4  # int64 words a pixel's chunk
    # --- the tile's positions
    pid = tl.program_id(0)
    per_img = tiles_h * tiles_w
    for tile in range(pid, N * per_img, tl.num_programs(0)):  # one tile a program unless the grid is smaller
        n = tile // per_img
        t = tile - n * per_img
        offs = tl.arange(0, BM)
        L = H * W
        if TH == 1:  # flat: BM consecutive positions l = ho*W + wo of the image (the product's per-image tiles)
            l = t * BM + offs
            valid = l < L
            ho = l // W
            wo = l % W
            ho0 = (t * BM) // W
            wo0 = 0
        else:
            ho0 = (t // tiles_w) * TH
            wo0 = (t % tiles_w) * TW
            ho = ho0 + offs // TW
            wo = wo0 + offs % TW
            valid = (ho < H) & (wo < W)
            l = ho * W + wo
        img = n.to(tl.int64)
        off_row = img * (2 * KK) * L + l
        msk_row = img * KK * L + l
        pix_img = img * L  # the image's first pixel
        # the window's top-left pixel: the undeformed samples' corners span TH + KH rows, the slack is split around them
        wy0 = ho0 - KH // 2 - (WH - TH - KH) // 2
        wx0 = wo0 - KW // 2 - (WW - TW - KW) // 2
        cq = tl.arange(0, Q)
        for c0 in range(0, C, BK):
            # --- the window (MODE 1, 2): one load a chunk
            widx = tl.arange(0, WH * WW)
            wy = wy0 + widx // WW
            wx = wx0 + widx % WW
            in_img = (wy >= 0) & (wy < H) & (wx >= 0) & (wx < W)
            win = tl.zeros([WH * WW * Q], tl.int64)
            if MODE == 1 or MODE == 2:  # flat [WH*WW*Q]: pixel-major, Q words a pixel
                wptr = x64_ptr + ((pix_img + wy * W + wx) * (C // 4) + c0 // 4)[:, None] + cq[None, :]
                win = tl.reshape(tl.load(wptr, mask=in_img[:, None], other=0), [WH * WW * Q])
            acc = tl.zeros([BM, BK], tl.float32)
            acc0 = tl.zeros([BM, Q], tl.float32)
            acc1 = tl.zeros([BM, Q], tl.float32)
            acc2 = tl.zeros([BM, Q], tl.float32)
            acc3 = tl.zeros([BM, Q], tl.float32)
            for tap in range(KK):
                # --- the sample points: the arithmetic of the product's _sample_point, written out because the window
                # needs the corner's pixel coordinates (y0, x0), which _sample_point folds into an element offset
                i = tap // KW
                j = tap - i * KW
                dy = tl.load(off_ptr + off_row + (2 * tap) * L, mask=valid, other=0.0).to(tl.float32)
                dx = tl.load(off_ptr + off_row + (2 * tap + 1) * L, mask=valid, other=0.0).to(tl.float32)
                mv = tl.load(msk_ptr + msk_row + tap * L, mask=valid, other=0.0).to(tl.float32)
                y = (ho - KH // 2 + i).to(tl.float32) + dy
                x = (wo - KW // 2 + j).to(tl.float32) + dx
                inside = valid & (y > -1.0) & (y < H) & (x > -1.0) & (x < W)
                y0f = tl.floor(y)
                x0f = tl.floor(x)
                ly = y - y0f
                lx = x - x0f
                y0 = tl.where(inside, y0f, 0.0).to(tl.int32)
                x0 = tl.where(inside, x0f, 0.0).to(tl.int32)
                w00, w01, w10, w11 = _bilinear_weights(ly, lx, tl.where(inside, mv, 0.0))
                top = inside & (y0 >= 0)
                bottom = inside & (y0 + 1 < H)
                left = x0 >= 0
                right = x0 + 1 < W
                p00 = pix_img + (y0 * W + x0).to(tl.int64)
                if MODE == 0 or MODE == 3:
                    # --- global corner loads [BM, BK] (MODE 3: L2 only, as the product's cp.async.cg copies)
                    ptrs = x_ptr + (p00 * C + c0)[:, None] + tl.arange(0, BK)[None, :]
                    CM: tl.constexpr = ".cg" if MODE == 3 else ""
                    c00 = tl.load(ptrs, mask=(top & left)[:, None], other=0.0, cache_modifier=CM)
                    c01 = tl.load(ptrs + C, mask=(top & right)[:, None], other=0.0, cache_modifier=CM)
                    c10 = tl.load(ptrs + W * C, mask=(bottom & left)[:, None], other=0.0, cache_modifier=CM)
                    c11 = tl.load(ptrs + W * C + C, mask=(bottom & right)[:, None], other=0.0, cache_modifier=CM)
                    s = (w00.to(tl.float16)[:, None] * c00 + w01.to(tl.float16)[:, None] * c01
                         + w10.to(tl.float16)[:, None] * c10 + w11.to(tl.float16)[:, None] * c11)
                    acc += s.to(tl.float32)
                else:
                    # --- the 4 corners of every sample from the window: [BM, Q, 4] int64, flattened for tl.gather (a
                    # 1-D gather takes Triton's shared-memory path; a 2-D one gets a warp-local layout: 16 shuffles an
                    # element here)
                    ry = y0 - wy0
                    rx = x0 - wx0
                    in_win = (ry >= 0) & (ry < WH - 1) & (rx >= 0) & (rx < WW - 1)
                    base = tl.where(in_win, ry * WW + rx, 0)
                    corner = tl.reshape(_quad(base, base + 1, base + WW, base + WW + 1), [BM, 1, 4])
                    idx = tl.reshape(corner * Q + cq[None, :, None], [BM * Q * 4])
                    g = tl.reshape(tl.gather(win, idx, 0), [BM, Q, 4])
                    if MODE == 1:
                        # --- and from global memory for the samples outside the window
                        pix = tl.reshape(_quad(p00, p00 + 1, p00 + W, p00 + W + 1), [BM, 1, 4])
                        ok = tl.reshape(_quad(top & left, top & right, bottom & left, bottom & right), [BM, 1, 4])
                        near = in_win[:, None, None]
                        far = tl.load(x64_ptr + pix * (C // 4) + c0 // 4 + cq[None, :, None], mask=ok & ~near, other=0)
                        g = tl.where(near, g, far)
                    wq = tl.reshape(_quad(w00, w01, w10, w11), [BM, 1, 4]).to(tl.float16)
                    acc0 += tl.sum(wq * _unpack16(g, 0), axis=2).to(tl.float32)
                    acc1 += tl.sum(wq * _unpack16(g, 1), axis=2).to(tl.float32)
                    acc2 += tl.sum(wq * _unpack16(g, 2), axis=2).to(tl.float32)
                    acc3 += tl.sum(wq * _unpack16(g, 3), axis=2).to(tl.float32)
            # --- the chunk's sums, NHWC
            rows = ((pix_img + l) * C + c0)[:, None]
            if MODE == 0 or MODE == 3:
                tl.store(out_ptr + rows + tl.arange(0, BK)[None, :], acc, mask=valid[:, None])
            else:  # acc_k[:, j] is channel 4j + k
                tl.store(out_ptr + rows + 4 * cq[None, :], acc0, mask=valid[:, None])
                tl.store(out_ptr + rows + 4 * cq[None, :] + 1, acc1, mask=valid[:, None])
                tl.store(out_ptr + rows + 4 * cq[None, :] + 2, acc2, mask=valid[:, None])
                tl.store(out_ptr + rows + 4 * cq[None, :] + 3, acc3, mask=valid[:, None])


# --- launcher ----------------------------------------------------------------------------------------------------


def parse_variant(v: str) -> dict:
    """'MODE:THxTW:WHxWW:BK:warps:stages[:ctas_per_sm]' -> keyword arguments of gather_sums."""
    try:
        mode, tile, win, bk, warps, stages, *per_sm = v.split(":")
        assert len(per_sm) <= 1
        th, tw = (int(s) for s in tile.split("x"))
        wh, ww = (int(s) for s in win.split("x"))
        return dict(mode=int(mode), th=th, tw=tw, wh=wh, ww=ww, bk=int(bk), warps=int(warps), stages=int(stages),
                    ctas_per_sm=int(per_sm[0]) if per_sm else 0)
    except (ValueError, AssertionError):
        raise ValueError(f"variant {v!r}: expected 'MODE:THxTW:WHxWW:BK:warps:stages[:ctas_per_sm]', e.g. "
                         "'1:4x16:16x32:32:8:1'")


def gather_sums(x_nhwc, offset, mask, k=3, mode=1, th=4, tw=16, wh=16, ww=32, bk=32, warps=8, stages=1, ctas_per_sm=0,
                out=None):
    """out [N, H, W, C] fp32 = sum over the k*k taps of each position's mask-weighted bilinear samples (stride 1,
    padding k//2), from an NHWC fp16 input (a contiguous [N, H, W, C] tensor, C a multiple of bk)."""
    n, h, w, c = x_nhwc.shape
    assert x_nhwc.dtype == torch.float16 and x_nhwc.is_contiguous() and c % bk == 0 and bk % 4 == 0
    assert mode in (0, 3) or (th > 1 and wh >= th + k + 1 and ww >= tw + k + 1), \
        "the window must hold the tile's undeformed corners"
    if out is None:
        out = torch.empty(n, h, w, c, device=x_nhwc.device, dtype=torch.float32)
    tiles_h, tiles_w = (triton.cdiv(h * w, tw), 1) if th == 1 else (triton.cdiv(h, th), triton.cdiv(w, tw))
    tiles = n * tiles_h * tiles_w
    if ctas_per_sm and x_nhwc.is_cuda:  # (the interpreter runs the programs one by one anyway)
        tiles = min(tiles, ctas_per_sm * torch.cuda.get_device_properties(x_nhwc.device).multi_processor_count)
    _window_gather_kernel[(tiles,)](
        x_nhwc, x_nhwc.view(torch.int64), offset, mask, out, n, h, w, c, tiles_h, tiles_w,
        KH=k, KW=k, TH=th, TW=tw, WH=wh, WW=ww, BK=bk, MODE=mode, num_warps=warps, num_stages=stages)
    return out


def compile_sm90(variant: str, c: int = 256, h: int = 50, w: int = 76):
    """Build a variant's kernel for sm_90 without a GPU (ptx_summary.compile_kernel), as a det-s4-like layer (c
    channels, h x w) would launch it; returns Triton's compiled kernel (asm: ttgir, ptx, cubin)."""
    from ptx_summary import compile_kernel

    kv = parse_variant(variant)
    tiles_h, tiles_w = (triton.cdiv(h * w, kv["tw"]), 1) if kv["th"] == 1 else (triton.cdiv(h, kv["th"]),
                                                                                 triton.cdiv(w, kv["tw"]))
    ints = dict(N=8, H=h, W=w, C=c, tiles_h=tiles_h, tiles_w=tiles_w)
    const = dict(KH=3, KW=3, TH=kv["th"], TW=kv["tw"], WH=kv["wh"], WW=kv["ww"], BK=kv["bk"], MODE=kv["mode"])
    pointers = dict(x_ptr="*fp16", x64_ptr="*i64", off_ptr="*fp16", msk_ptr="*fp16", out_ptr="*fp32")
    return compile_kernel(_window_gather_kernel, pointers, const, ints, kv["warps"], kv["stages"])


def reference_sums(x_nchw, offset, mask, k=3):
    """gather_sums in float64 through the reference backend: a depthwise deformable conv whose weight is all ones."""
    from deformconv.ops.reference import deform_conv2d_forward as reference
    c = x_nchw.shape[1]
    ones = torch.ones(c, 1, k, k, device=x_nchw.device, dtype=torch.float64)
    return reference(x_nchw.double(), offset.double(), ones, None, mask.double(), (1, 1), (k // 2, k // 2), (1, 1))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="det-s4,det-s5,cls-14")
    # the window (1, 2) against plain loads (0) of the same 4x16 tiles; plain loads of flat tiles, through the L1 (0)
    # or not (3), and on 1-4 CTAs a multiprocessor
    p.add_argument("--variants", default="0:4x16:16x32:32:8:1,1:4x16:16x32:32:8:1,2:4x16:16x32:32:8:1,"
                                         "1:8x8:16x16:32:8:1,0:1x64:16x32:32:8:1,3:1x64:16x32:32:8:1,"
                                         "0:1x64:16x32:32:8:1:1,0:1x64:16x32:32:8:1:2,0:1x64:16x32:32:8:1:3,"
                                         "0:1x64:16x32:32:8:1:4")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="the tiny shape only, no timing (CPU, TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    variants = [parse_variant(v) for v in args.variants.split(",")]
    torch.manual_seed(0)
    rows = []
    for name in shapes:
        n, c, h, w = SHAPES[name]
        k = 3
        x = torch.randn(n, c, h, w, device=device).to(torch.float16)
        off = (2 * torch.randn(n, 2 * k * k, h, w, device=device)).to(torch.float16)
        msk = torch.rand(n, k * k, h, w, device=device).to(torch.float16)
        xn = x.permute(0, 2, 3, 1).contiguous()
        nref = min(n, 2)
        ref = reference_sums(x[:nref], off[:nref], msk[:nref], k).permute(0, 2, 3, 1)
        scale = ref.abs().max().item()
        t_prod = None
        if not args.tiny:
            import deformconv
            from common import graph_ms
            wt = (torch.randn(c, c, k, k, device=device) / (c * k * k) ** 0.5).to(torch.float16)
            xc = x.contiguous(memory_format=torch.channels_last)
            t_prod = graph_ms(lambda: deformconv.deform_conv2d(xc, off, wt, None, padding=1, mask=msk))
            rows.append(dict(shape=name, variant="product forward (Cout = Cin)", ms=t_prod))
            print(f"{name:7s} product forward (Cout = Cin)  {t_prod:.4f} ms", flush=True)
        for v, kw in zip(args.variants.split(","), variants):
            out = torch.full((n, h, w, c), float("nan"), device=device)
            try:
                gather_sums(xn, off, msk, k, out=out, **kw)
                err = ((out[:nref].double() - ref).abs().max() / scale).item()
                t = None if args.tiny else graph_ms(lambda: gather_sums(xn, off, msk, k, out=out, **kw))
            except Exception as e:  # a variant that does not compile or launch: say so, go on
                print(f"{name:7s} {v:26s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(shape=name, variant=v, error=str(e)[:300]))
                continue
            rows.append(dict(shape=name, variant=v, ms=t, rel_err=err))
            if kw["mode"] != 2:  # MODE 2 drops samples by design
                assert err == err and err < 2e-3, f"{name} {v}: relative error {err}"
            ms = "" if t is None else f"{t:.4f} ms  vs product forward {t / t_prod:.3f}"
            print(f"{name:7s} {v:26s} {ms}  rel err {err:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1)
    print("\nshape   variant                      ms       rel err")
    for r in rows:
        if "error" not in r:
            ms = "-" if r["ms"] is None else f"{r['ms']:.4f}"
            print(f"{r['shape']:7s} {r['variant']:28s} {ms:8s} {r.get('rel_err', 0.0):.1e}")
    return rows


if __name__ == "__main__":
    main()
