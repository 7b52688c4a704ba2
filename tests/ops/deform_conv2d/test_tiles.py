"""The Triton kernels' tile variants on the CPU (interpreter), each against the oracle: position tilings, NCHW
outputs stored in runs, the offset-grouped input layout, sample points loaded ahead, the wide tiles, TMA tiles."""

import dataclasses
import zlib

import pytest
import torch
from _dcn_cases import (
    CONFIGS,
    GRAD_NAMES,
    TRITON_BACKENDS,
    channels_last_leaf,
    compare_to_oracle,
    fwd_bwd,
    leaves_with_grad,
)
from _naive import naive_deform_conv2d
from conftest import assert_close, kernel_modules, launch_metas, make_case, nan_filled_empty, plans

import deformconv

pytestmark = pytest.mark.usefixtures("implicit_gemm_for_groups")  # these kernels' routes, grouped cases included


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat-grad-out-reloaded"])
@pytest.mark.parametrize("config", ["3x3-pad1", "stride2-dil2", "og4-packed-segments", "groups2-og4-packed-tail"])
def test_position_tilings(backend, dtype, per_image, config, monkeypatch, forced):
    """Both ways of tiling the output positions (M tiles inside one image, or across images), the second
    with grad_out re-read per K chunk in the grad_input kernel instead of held, give the oracle's forward
    and gradients, with 3 images so that flat tiles straddle image boundaries."""
    forced(per_image=per_image)
    if not per_image:
        forced(go_resident=False)
    args, kwargs = make_case(**dict(CONFIGS[config], n=3), dtype=dtype, seed=zlib.crc32(config.encode()) % 997)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)


# RUN_STORE by (Ho*Wo, element size) for 64- and 128-row tiles: (CodegenProfile.wide_run_stores on, off). 320 positions:
# the old rule's 8-element runs for 16 bits; wide runs: up to 16 bytes of any dtype, as far as Ho*Wo and the tile both
# divide (gcd(196, 64 or 128) = 4); None: not run (the old rule stores no runs at 196 positions, so both calls would be
# alike).
RUN_STORE_CASES = {(16, 20, 2): (8, 8), (16, 20, 4): (4, 0), (14, 14, 2): (4, None), (14, 14, 4): (4, None)}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat"])
@pytest.mark.parametrize("hw,wide", [((16, 20), True), ((16, 20), False), ((14, 14), True)],
                         ids=["16x20-wide-runs", "16x20-16-byte-runs", "14x14-wide-runs"])  # 14x14 has no 16-byte runs
def test_forward_stores_nchw_output_in_runs(backend, dtype, per_image, hw, wide, monkeypatch, forced):
    """An NCHW output (unpacked segments: 16 channels) is stored in runs along each channel plane from whole tiles
    inside one image (RUN_STORE, run_store_length: RUN_STORE_CASES), else from the accumulator's layout: the same bits
    either way, every element written (outputs poisoned), and the float64 reference's numbers. 3 images in 128-row tiles
    (fp32: 64); 196 positions divide into neither, so per-image tiles end in a partial tile and flat tiles straddle
    images."""
    kernels = kernel_modules()

    forced(per_image=per_image)
    forced(profile=dataclasses.replace(kernels.forward.codegen_profile(), wide_run_stores=wide))
    h, w = hw
    args, kwargs = make_case(n=3, cin=16, cout=8, h=h, w=w, kh=3, kw=3, padding=1, dtype=dtype, seed=31)
    outs, metas = [], []
    for runs in (True, False):
        forced(run_stores=runs)
        with nan_filled_empty():
            outs.append(deformconv.deform_conv2d(*args, **kwargs, backend=backend))
        metas.append(launch_metas()[0])
    run = RUN_STORE_CASES[(h, w, dtype.itemsize)][0 if wide else 1]
    assert [(m["RUN_STORE"], m["PER_IMAGE"]) for m in metas] == [(run, per_image), (0, per_image)]
    assert all(m["BLOCK_M"] in (64, 128) and m["BLOCK_M"] < h * w for m in metas)  # whole tiles among them
    assert torch.equal(outs[0], outs[1])
    ref = deformconv.deform_conv2d(*[t.double() if t is not None else None for t in args],
                                   **dict(kwargs, mask=kwargs["mask"].double()), backend="reference")
    assert_close(outs[0], ref, dtype, "output")


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("config", ["og4-packed-segments", "groups2-og4-packed-tail"])
def test_offset_grouped_input_layout_matches_nhwc(backend, dtype, layout, config, monkeypatch, forced):
    """Where segments are whole packed offset groups the kernels read the input (and accumulate grad_input)
    offset-grouped, [N, G, H, W, C/G]; forced to NHWC they compute the same numbers in the same order, so
    the output and every gradient agree bit for bit, and the grouped run matches the oracle."""
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 991)
    if layout == "channels_last":
        args = (args[0].contiguous(memory_format=torch.channels_last),) + tuple(args[1:])
    leaves = leaves_with_grad(args, kwargs, dtype)
    if layout == "channels_last":
        leaves[0] = channels_last_leaf(leaves[0])
    run = lambda: fwd_bwd(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)  # noqa: E731
    forced()
    out, grads = run()
    assert any(getattr(plan, "grouped", False) for plan in plans())
    forced(grouped_input=False)
    out_nhwc, grads_nhwc = run()
    assert not any(getattr(plan, "grouped", False) for plan in plans())
    torch.testing.assert_close(out, out_nhwc, atol=0, rtol=0)
    for name, g, g_nhwc in zip(GRAD_NAMES, grads, grads_nhwc):
        torch.testing.assert_close(g, g_nhwc, atol=0, rtol=0, msg=lambda m: f"grad_{name}: {m}")
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert grads[0].is_contiguous(memory_format=torch.channels_last)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)


# long segments (16 channels or more, or a length that is not a power of two): the forward's per-(tap, segment)
# loop; the last case has two segments of 6 channels a conv group
LONG_SEGMENT_CASES = {
    "og2-long-segments": CONFIGS["og2-long-segments"],
    "long-segment-partial-chunk": CONFIGS["long-segment-partial-chunk"],
    "1x1-no-mask": CONFIGS["1x1-no-mask"],
    "groups2-og4-segments-of-6": dict(n=2, cin=24, cout=4, h=5, w=4, kh=3, kw=2, groups=2, offset_groups=4, padding=1,
                                      stride=(2, 1)),
}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("ahead", [True, False], ids=["sample-ahead", "sample-in-step"])
@pytest.mark.parametrize("config", list(LONG_SEGMENT_CASES), ids=list(LONG_SEGMENT_CASES))
def test_forward_sample_points_loaded_ahead_or_in_step(backend, dtype, ahead, config, monkeypatch, forced):
    """The forward with long segments, each (tap, segment) step's offsets and mask loaded one step ahead
    (Config.sample_ahead) or in the step, gives the oracle's output (and gradients) across tap, segment and conv
    group boundaries."""

    kernels = kernel_modules()

    forced(configs={"fwd": lambda c: dataclasses.replace(c, sample_ahead=ahead)})
    forced()
    cfg = LONG_SEGMENT_CASES[config]
    args, kwargs = make_case(**cfg, dtype=dtype, seed=zlib.crc32(config.encode()) % 991)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
    assert [c.sample_ahead for key, c in kernels.launch.chosen_configs().items() if key[0] == "fwd"] == [ahead]


WIDE_CASES = {  # >= 256 output channels a group: the wide tiles (see the GPU tests' shapes of the same names)
    "cout-256-wide-tile": dict(n=1, cin=64, cout=256, h=5, w=6, kh=3, kw=3, padding=1),
    "cout-520-three-n-tiles": dict(n=1, cin=40, cout=520, h=4, w=5, kh=3, kw=3, padding=1, mask=None),
    # 512 channels in whole chunks (64-wide in 16 bits, 32 in fp32): the grad_input kernel's 4-warp TMA tile
    "cout-512-tma": dict(n=1, cin=64, cout=512, h=3, w=5, kh=3, kw=3, padding=1),
}


def _reference(x, offset, weight, bias, stride, padding, dilation, mask):
    return deformconv.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask, backend="reference")


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config", list(WIDE_CASES), ids=list(WIDE_CASES))
def test_wide_configs(backend, dtype, config, monkeypatch, forced):
    """The default configs for >= 256 output channels a group (the forward's 64x256 tile, grad_weight's 256-column
    tile, the grad_input kernel's 8-warp form at >= 512 without TMA, its 4-warp TMA form with whole chunks), with a
    partial last column tile at 520, give the float64 reference's output and gradients."""
    kernels = kernel_modules()

    forced(columns_grad_weight=False)  # the fused grad_weight kernel's wide tile, not the column buffer
    args, kwargs = make_case(**WIDE_CASES[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 977)
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, _reference)
    used = {key[0]: cfg for key, cfg in kernels.launch.chosen_configs().items()}
    assert used["fwd"].block_n == 256 and used["bwd_weight"].block_n == 256
    tma = WIDE_CASES[config]["cin"] % (32 if dtype == torch.float32 else 64) == 0  # whole chunks
    assert used["bwd_data"].tma == tma
    assert used["bwd_data"].num_warps == (8 if WIDE_CASES[config]["cout"] >= 512 and not tma else 4)


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
def test_traced_wide_tile_matches_the_reference(backend, dtype, monkeypatch, forced):
    """The forward's 128x256 tile that the compile route takes past one wave of 64-row programs
    (configs.traced_wide_tile, chosen here with one pretend SM), launched eagerly, with a partial last column tile at
    520 output channels: the float64 reference's output."""
    kernels = kernel_modules()
    case = WIDE_CASES["cout-520-three-n-tiles"]
    args, kwargs = make_case(**case, dtype=dtype, seed=zlib.crc32(b"traced-wide") % 977)
    geo = deformconv.checks.geometry_from_tensors(args[0], args[1], args[2], kwargs["stride"], kwargs["padding"],
                                                  kwargs["dilation"])
    monkeypatch.setattr(kernels.configs, "sm_count", lambda device: 1)
    with deformconv.config.traced():
        tall = kernels.configs.fwd_candidates(geo, kernels.geometry.segment_length(geo), dtype, torch.device("cuda"))[0]
    assert (tall.block_m, tall.block_n, tall.maxnreg) == (128, 256, None)
    forced(configs={"fwd": tall})
    out = deformconv.deform_conv2d(*args, **kwargs, backend=backend)
    ref = naive_deform_conv2d(*[t.double() for t in args], **{k: v if not torch.is_tensor(v) else v.double()
                                                             for k, v in kwargs.items()})
    assert [c.block_m for key, c in kernels.launch.chosen_configs().items() if key[0] == "fwd"] == [128]
    assert_close(out, ref, dtype, "output")


# Config.tma: weight and grad_out tiles read through TMA descriptors (fp16, bf16, fp32; whole channel chunks)
TMA_CASES = {
    # long segments; 24 output channels in a 32-column tile (the descriptor reads zeros past them); grad_out
    # resident in the grad_input kernel unless the tiles are flat
    "long-cout-24": dict(n=3, cin=32, cout=24, h=5, w=6, kh=3, kw=3, padding=1),
    # two conv groups: grad_out tiles at each group's channels, never resident; a stride
    "groups2-cout-64": dict(n=3, cin=64, cout=64, h=4, w=7, kh=3, kw=3, groups=2, padding=1, stride=(1, 2)),
    # packed segments (8 offset groups of 8 channels), the forward's flat step loop
    "og8-packed": dict(n=2, cin=64, cout=16, h=4, w=5, kh=3, kw=3, offset_groups=8, padding=1),
}


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("per_image", [True, False], ids=["tiles-per-image", "tiles-flat"])
@pytest.mark.parametrize("config", list(TMA_CASES), ids=list(TMA_CASES))
def test_tma_tiles_match_pointer_tiles(backend, dtype, per_image, config, monkeypatch, forced):
    """With Config.tma the three kernels read their weight and grad_out tiles through TMA descriptors (emulated
    by the interpreter), in per-image or flat M tiles (grad_out's 3-d or 2-d descriptor): the output and every
    gradient equal those of pointer loads bit for bit, and the oracle's."""
    forced(per_image=per_image)
    if not per_image:
        forced(go_resident=False)
    args, kwargs = make_case(**TMA_CASES[config], dtype=dtype, seed=zlib.crc32(config.encode()) % 971)
    leaves = leaves_with_grad(args, kwargs, dtype)
    results = {}
    for tma in (False, True):
        forced(tma=tma)
        results[tma] = fwd_bwd(lambda *a, **k: deformconv.deform_conv2d(*a, **k, backend=backend), leaves, kwargs)
        metas = launch_metas()
        assert len(metas) == 3
        assert all(m["TMA"] == tma for m in metas)
    (out, grads), (out_tma, grads_tma) = results[False], results[True]
    torch.testing.assert_close(out_tma, out, atol=0, rtol=0)
    for name, g, g_tma in zip(GRAD_NAMES, grads, grads_tma):
        torch.testing.assert_close(g_tma, g, atol=0, rtol=0, msg=lambda m: f"grad_{name}: {m}")
    compare_to_oracle(backend, dtype, leaves_with_grad(args, kwargs, torch.float64), kwargs, naive_deform_conv2d)
