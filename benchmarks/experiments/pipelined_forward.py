"""Experiment (not product code): the forward kernel with its K loop flattened over (tap, chunk) steps and
the next step's offsets/corners loaded before the current step's blend + dot (hand software pipelining),
optionally with M tiles that never cross an image (PER_IMAGE): then l = ho*Wo + wo is provably contiguous
within a tile, so the offset/mask loads and the NCHW output stores can be vectorised (compiled for sm_90
without a GPU, the product kernel stores det-s4's NCHW output with 128 scalar st.global.b16 per thread and
loads offsets with scalar ld.global.b16, because l = offs_m % L defeats Triton's contiguity analysis).

Run on CPU (interpreter) for correctness:  TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/experiments/pipelined_forward.py check
Run on the GPU for timing:                 PYTHONPATH=src python benchmarks/experiments/pipelined_forward.py bench
"""
import sys

import torch
import triton
import triton.language as tl

import deformconv.ops.deform_conv2d as K


@triton.jit
def _step_corners(x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid, step, gc,
                  H, W, CIN, L, CIN_G, COG, DIL_H, DIL_W,
                  KH: tl.constexpr, KW: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
                  HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step = tap * n_chunks + chunk: the blend weights [BM, NSEG] and the 4 corners [BM, NSEG, SEG]."""
    KK: tl.constexpr = KH * KW
    n_chunks = tl.cdiv(CIN_G, BLOCK_K)
    tap = step // n_chunks
    c0 = (step - tap * n_chunks) * BLOCK_K
    i = tap // KW
    j = tap - i * KW
    y_ref = y_out + (i * DIL_H).to(tl.float32)
    x_ref = x_out + (j * DIL_W).to(tl.float32)
    offs_s = tl.arange(0, NSEG)
    offs_t = tl.arange(0, SEG)
    c_first = gc * CIN_G + c0 + offs_s * SEG
    p00, v00, v01, v10, v11, ly, lx, mv = K._chunk_sample_points(
        off_ptr, msk_ptr, off_row, msk_row, c_first, c0 + offs_s * SEG < CIN_G, tap, COG, KK, L,
        y_ref, x_ref, pix_base, H, W, CIN, m_valid, HAS_MASK)
    ptrs = x_ptr + p00[:, :, None] + (c_first[:, None] + offs_t[None, :])[None, :, :]
    row = W * CIN
    c00 = tl.load(ptrs, mask=v00[:, :, None], other=0.0)
    c01 = tl.load(ptrs + CIN, mask=v01[:, :, None], other=0.0)
    c10 = tl.load(ptrs + row, mask=v10[:, :, None], other=0.0)
    c11 = tl.load(ptrs + row + CIN, mask=v11[:, :, None], other=0.0)
    return ((1.0 - ly) * (1.0 - lx) * mv, (1.0 - ly) * lx * mv, ly * (1.0 - lx) * mv, ly * lx * mv,
            c00, c01, c10, c11)


@triton.jit
def _fwd_pipelined_kernel(
    x_ptr, off_ptr, msk_ptr, w_ptr, b_ptr, out_ptr,
    H, W, CIN, HO, WO, M, CIN_G, COUT_G, COG, G,
    STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H, DIL_W,
    out_sn, out_sl, out_sc,
    KH: tl.constexpr, KW: tl.constexpr, SEG: tl.constexpr, NSEG: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, PER_IMAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Same contract as K._deform_conv2d_fwd_kernel with NSEG*SEG == BLOCK_K (any SEG a power of two:
    NSEG = 1 covers long segments too, one sample point per chunk)."""
    pid = tl.program_id(0)
    gc = tl.program_id(1)
    num_n = tl.cdiv(COUT_G, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    KK: tl.constexpr = KH * KW
    L = HO * WO
    if PER_IMAGE:  # tile pid_m = (image, tile of that image's positions): l contiguous, one image
        tiles = tl.cdiv(L, BLOCK_M)
        img = (pid_m // tiles).to(tl.int64)
        l32 = (pid_m % tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = l32 < L
        ho = l32 // WO
        wo = l32 % WO
        l = l32.to(tl.int64)
        n_img = tl.zeros((BLOCK_M,), tl.int64) + img
        pix_base = n_img * H * W * CIN
        off_row = img * (2 * G * KK) * L + l
        msk_row = img * (G * KK) * L + l
        y_out = (ho * STRIDE_H - PAD_H).to(tl.float32)
        x_out = (wo * STRIDE_W - PAD_W).to(tl.float32)
    else:
        m_valid, n_img, l, pix_base, off_row, msk_row, y_out, x_out = K._position_setup(
            pid_m, M, HO, WO, H, W, CIN, G, KK, STRIDE_H, STRIDE_W, PAD_H, PAD_W, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COUT_G
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_chunks = tl.cdiv(CIN_G, BLOCK_K)
    n_steps = KK * n_chunks

    # --- prologue: step 0's corners in flight ---
    w00, w01, w10, w11, c00, c01, c10, c11 = _step_corners(
        x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid, 0, gc,
        H, W, CIN, L, CIN_G, COG, DIL_H, DIL_W, KH, KW, SEG, NSEG, HAS_MASK, BLOCK_M, BLOCK_K)
    for step in range(n_steps):
        # --- issue the next step's loads first (the last iteration re-loads step 0, harmlessly) ---
        nxt = (step + 1) % n_steps
        n00, n01, n10, n11, d00, d01, d10, d11 = _step_corners(
            x_ptr, off_ptr, msk_ptr, off_row, msk_row, pix_base, y_out, x_out, m_valid, nxt, gc,
            H, W, CIN, L, CIN_G, COG, DIL_H, DIL_W, KH, KW, SEG, NSEG, HAS_MASK, BLOCK_M, BLOCK_K)
        # --- this step: blend, B tile, dot ---
        a3 = (w00[:, :, None] * c00.to(tl.float32) + w01[:, :, None] * c01.to(tl.float32)
              + w10[:, :, None] * c10.to(tl.float32) + w11[:, :, None] * c11.to(tl.float32))
        a = tl.reshape(a3, (BLOCK_M, BLOCK_K))
        tap = step // n_chunks
        c0 = (step - tap * n_chunks) * BLOCK_K
        w_rows = ((gc * KK + tap) * CIN_G + c0 + offs_k).to(tl.int64)
        b = tl.load(w_ptr + w_rows[:, None] * COUT_G + offs_n[None, :],
                    mask=(c0 + offs_k < CIN_G)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
        w00, w01, w10, w11, c00, c01, c10, c11 = n00, n01, n10, n11, d00, d01, d10, d11

    co = gc * COUT_G + offs_n
    if HAS_BIAS:
        acc += tl.load(b_ptr + co, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + (n_img * out_sn + l * out_sl)[:, None] + (co.to(tl.int64) * out_sc)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_ok[None, :])


def forward(input, offset, weight, bias, mask, padding, cfg: K.Config, per_image: bool = False):
    geo = K.geometry_from_tensors(input, offset, weight, (1, 1), (padding, padding), (1, 1))
    seg = K.segment_length(geo)
    assert seg & (seg - 1) == 0
    seg_used = min(seg, cfg.block_k)
    x, off, msk, wp = K._prepare(input, offset, weight, mask)
    msk = mask.contiguous() if mask is not None else off
    out = torch.empty((geo.batch, geo.out_channels, geo.out_h, geo.out_w), dtype=input.dtype, device=input.device)
    M = geo.batch * geo.out_h * geo.out_w
    m_tiles = geo.batch * triton.cdiv(geo.out_h * geo.out_w, cfg.block_m) if per_image else triton.cdiv(M, cfg.block_m)
    grid = (m_tiles * triton.cdiv(geo.out_channels // geo.groups, cfg.block_n), geo.groups)
    _fwd_pipelined_kernel[grid](
        x, off, msk, wp, bias if bias is not None else wp, out,
        *K._sizes(geo), *geo.stride, *geo.padding, *geo.dilation, *K._position_strides(out),
        KH=geo.kernel_h, KW=geo.kernel_w, SEG=seg_used, NSEG=cfg.block_k // seg_used,
        HAS_MASK=mask is not None, HAS_BIAS=bias is not None, DOT_PRECISION=K._dot_precision(input.dtype),
        PER_IMAGE=per_image, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _inputs(shape, dtype, device, seed=0):
    from deformconv.benchmark import make_inputs
    return make_inputs(shape, dtype, device, seed=seed)


def check():
    import deformconv
    for shape, cfg in [((1, 16, 8, 5, 6, 3, 2), K.Config(16, 16, 16, 4)),     # SEG 8, NSEG 2
                       ((2, 64, 16, 4, 5, 3, 8), K.Config(16, 16, 32, 4)),    # SEG 8, NSEG 4
                       ((1, 32, 16, 5, 4, 3, 1), K.Config(16, 16, 16, 4))]:   # SEG 32 -> NSEG 1, 2 chunks
        x, off, w, b, m = _inputs(shape, torch.float32, "cpu")
        ref = deformconv.deform_conv2d(x.double(), off.double(), w.double(), b.double(), padding=1, mask=m.double(),
                                       backend="reference")
        for per_image in (False, True):
            ours = forward(x, off, w, b, m, 1, cfg, per_image)
            err = (ours.double() - ref).abs().max().item() / ref.abs().max().item()
            print(shape, cfg, f"per_image={per_image} rel err {err:.2e}")
            assert err < 1e-4


def bench():
    import deformconv
    from deformconv.benchmark import GPU_SHAPES
    from triton.testing import do_bench_cudagraph
    C = K.Config
    for name, cfgs in [("hires-g8", [C(128, 64, 32, 4), C(128, 64, 32, 8), C(64, 64, 32, 4), C(128, 64, 16, 4)]),
                       ("det-s4", [C(128, 256, 64, 8), C(128, 128, 32, 4), C(128, 128, 64, 8)]),
                       ("det-s3", [C(128, 128, 32, 4), C(128, 128, 64, 8)])]:
        shape = GPU_SHAPES[name]
        x, off, w, b, m = _inputs(shape, torch.float16, "cuda")
        pad = shape[5] // 2
        ref = deformconv.deform_conv2d(x, off, w, b, padding=pad, mask=m)
        t_prod = do_bench_cudagraph(lambda: deformconv.deform_conv2d(x, off, w, b, padding=pad, mask=m), rep=50,
                                    return_mode="median")
        for cfg in cfgs:
            for per_image in (False, True):
                try:
                    out = forward(x, off, w, b, m, pad, cfg, per_image)
                    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    t = do_bench_cudagraph(lambda: forward(x, off, w, b, m, pad, cfg, per_image), rep=50,
                                           return_mode="median")
                except Exception as e:  # noqa: BLE001
                    t, err = float("nan"), float("nan")
                    print(name, cfg, "FAILED", str(e)[:300])
                print(f"{name:9s} product {t_prod:.3f} ms | pipelined per_image={per_image:d} {cfg} {t:.3f} ms"
                      f"  rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    {"check": check, "bench": bench}[sys.argv[1] if len(sys.argv) > 1 else "check"]()
