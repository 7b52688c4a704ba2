"""The backward's schedule on the CPU (interpreter): image chunks and the workspace budget, side streams,
the layout kernels around the backward."""

import zlib

import pytest
import torch
from _dcn_cases import (
    BACKENDS,
    CONFIGS,
    TRITON_BACKENDS,
    channels_last_leaf,
    compare_to_oracle,
    deterministic_mode,
    leaves_with_grad,
)
from _naive import naive_deform_conv2d
from conftest import CountingKernel, kernel_modules, launch_metas, make_case

pytestmark = pytest.mark.usefixtures("implicit_gemm_for_groups")  # these kernels' routes, grouped cases included

CHUNK_CASES = [pytest.param(c, lay, det, id=f"{c}-{lay}-{'deterministic' if det else 'atomics'}")
               for c, lay, det in [("3x3-pad1", "nchw", False), ("3x3-pad1", "channels_last", False),
                                   ("3x3-pad1", "nchw", True), ("3x3-pad1", "channels_last", True),
                                   ("og4-packed-segments", "nchw", False),
                                   ("og4-packed-segments", "channels_last", False),
                                   ("og4-packed-segments", "channels_last", True)]]


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config,layout,deterministic", CHUNK_CASES)
def test_backward_in_image_chunks(backend, dtype, layout, deterministic, config, monkeypatch, forced):
    """With the workspace budget forced down, the backward runs 2 + 2 + 1 images at a time (an uneven last
    chunk; grad_weight summed over chunks) and every gradient still matches the oracle."""
    kernels = kernel_modules()

    forced(default_workspace_budget=0.0, min_chunk_programs=2)  # one M tile per image at these sizes: 2 images
    # the chunks themselves: these tiny layers' weights are as large as their inputs, so by memory they would run whole
    monkeypatch.setattr(kernels.schedule, "_chunked_weight_bytes", lambda *a: 0)
    chunks = []
    real = kernels.backward._backward_chunk
    monkeypatch.setattr(kernels.backward, "_backward_chunk",
                        lambda go, x, *a: chunks.append(x.shape[0]) or real(go, x, *a))
    args, kwargs = make_case(**dict(CONFIGS[config], n=5), dtype=dtype, seed=zlib.crc32(config.encode()) % 983)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    if layout == "channels_last":
        leaves64[0] = channels_last_leaf(leaves64[0])
    with deterministic_mode(deterministic):
        compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    assert chunks == [2, 2, 1]


def _meta(shape, dtype, channels_last=False):
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.contiguous(memory_format=torch.channels_last) if channels_last else t


@pytest.mark.parametrize("dtype,channels_last,deterministic,images", [
    (torch.float16, False, False, 3),  # NHWC copies of input and grad_out + fp32 accumulator: 4 inputs' worth
    (torch.float16, True, False, 6),   # the accumulator alone: 2 inputs' worth
    (torch.float32, True, False, 8),   # 1 input's worth: the whole batch
    (torch.float16, False, True, 3),   # int64 accumulator + its fp32 conversion: 8 inputs' worth -> 1 image by
                                       # the budget, raised to 3 by the parallelism floor (238 M tiles an image)
], ids=["fp16-nchw", "fp16-channels-last", "fp32-channels-last", "fp16-nchw-deterministic"])
def test_backward_chunk_images_keeps_the_workspace_budget(dtype, channels_last, deterministic, images):
    """det-s3's shape (N=8, 128 channels, 100x152): the images per backward chunk keep the estimated scratch
    within options.default_workspace_budget times the input; a small image count is raised to keep the GPU busy."""
    kernels = kernel_modules()
    x = _meta((8, 128, 100, 152), dtype, channels_last)
    go = _meta((8, 128, 100, 152), dtype, channels_last)
    assert kernels.schedule.backward_chunk_images(x, go, True, True, deterministic) == images
    # without grad_input and grad_weight (grad_offset only), channels-last: there is no scratch to bound; with
    # grad_weight its fp32 partials count as the accumulator would (2 inputs' worth in fp16)
    cl = _meta((8, 128, 100, 152), dtype, True)
    assert kernels.schedule.backward_chunk_images(cl, cl, False, False, False) == 8
    assert kernels.schedule.backward_chunk_images(cl, cl, False, True, False) == (6 if dtype == torch.float16 else 8)
    # small images: a chunk keeps options.min_chunk_programs M tiles (cls-14: 64 images of 14x14 -> 4 tiles each)
    small = _meta((64, 256, 14, 14), dtype, channels_last)
    assert kernels.schedule.backward_chunk_images(small, small, True, True, deterministic) == 64


def test_backward_chunk_images_counts_the_offset_grouped_copy():
    """hires-g8's shape channels-last in fp16: read NHWC in place, the scratch is the fp32 accumulator (2 inputs'
    worth: 12 of 16 images within 1.5x); read offset-grouped, the input's copy counts too (3 inputs' worth: 8)."""
    kernels = kernel_modules()
    x = _meta((16, 64, 128, 128), torch.float16, True)
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 12
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False, grouped=True) == 8


@pytest.mark.parametrize("shape,dtype,channels_last,concurrent", [
    ((8, 256, 50, 76), torch.float16, False, True),      # det-s4: 480 M tiles of 64 positions
    ((64, 256, 14, 14), torch.float16, False, True),     # cls-14: 256
    ((8, 512, 25, 38), torch.float32, True, True),       # det-s5: 120
    ((8, 128, 100, 152), torch.float16, False, False),   # det-s3: 1904 tiles, in chunks of images
    ((8, 128, 100, 152), torch.float32, True, False),    # one chunk, but partials beside the accumulator: 8 bytes
                                                         # an input element against the budget's 6
    ((1, 64, 160, 208), torch.float16, True, False),     # one image of 520 tiles: one chunk, but not small
], ids=["det-s4", "cls-14", "det-s5-fp32-channels-last", "det-s3", "det-s3-fp32-channels-last", "one-large-image"])
def test_concurrent_backward_where_the_batch_is_small(shape, dtype, channels_last, concurrent, monkeypatch, forced):
    """grad_weight runs beside the grad_input kernel (on a side stream) where the whole batch has at most
    options.min_chunk_programs M tiles, or where the budget admits the whole batch with grad_weight's partials beside
    the accumulator; then the backward is one chunk. Only when both kernels run."""
    kernels = kernel_modules()
    monkeypatch.setattr(kernels.schedule, "side_streams_usable", lambda device: True)  # the meta device stands for CUDA
    x, go = _meta(shape, dtype, channels_last), _meta(shape, dtype, channels_last)
    assert kernels.schedule.concurrent_backward(x, go, True, True, True, False) == concurrent
    if concurrent:
        assert kernels.schedule.backward_chunk_images(x, go, True, True, False, concurrent=True) == shape[0]
    assert not kernels.schedule.concurrent_backward(x, go, True, True, False, False)   # no grad_weight
    assert not kernels.schedule.concurrent_backward(x, go, False, False, True, False)  # grad_weight alone
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "inf")  # any whole batch admitted
    assert kernels.schedule.concurrent_backward(x, go, True, True, True, False)


def test_side_streams_only_on_cuda(monkeypatch, forced):
    """The side stream is a CUDA stream (the interpreter's CPU tensors never take it); DEFORMCONV_BACKWARD_STREAMS=0
    turns it off."""
    kernels = kernel_modules()
    monkeypatch.delenv("DEFORMCONV_BACKWARD_STREAMS", raising=False)
    assert kernels.schedule.side_streams_usable(torch.device("cuda"))
    assert not kernels.schedule.side_streams_usable(torch.device("cpu"))
    monkeypatch.setenv("DEFORMCONV_BACKWARD_STREAMS", "0")
    assert not kernels.schedule.side_streams_usable(torch.device("cuda"))


def test_workspace_budget_from_the_environment(monkeypatch, forced):
    """DEFORMCONV_WORKSPACE_BUDGET overrides the default budget ("inf": the whole batch) and is kept even where
    chunks get small; anything that is not a number >= 0 is refused, naming the variable."""
    kernels = kernel_modules()
    x = _meta((8, 128, 100, 152), torch.float16)
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "inf")
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 8
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "2")
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False) == 4
    # a budget set here is kept below the options.min_chunk_programs floor: cls-14's 64 small images (8 bytes of
    # scratch an fp16 input element: 1.5 x 2 / 8 of the batch) run in chunks of 24, not whole, and without the side
    # stream
    monkeypatch.setattr(kernels.schedule, "side_streams_usable", lambda device: True)
    small = _meta((64, 256, 14, 14), torch.float16)
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", "1.5")
    assert kernels.schedule.backward_chunk_images(small, small, True, True, False) == 24
    assert not kernels.schedule.concurrent_backward(small, small, True, True, True, False)
    monkeypatch.delenv("DEFORMCONV_WORKSPACE_BUDGET")
    assert kernels.schedule.backward_chunk_images(small, small, True, True, False) == 64
    assert kernels.schedule.concurrent_backward(small, small, True, True, True, False)
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", bad)
        with pytest.raises(ValueError, match=r"DEFORMCONV_WORKSPACE_BUDGET: expected a number >= 0 .* got '"):
            kernels.schedule.backward_chunk_images(x, x, True, True, False)


@pytest.mark.parametrize("shape,budget,images", [
    ((8, 512, 25, 38), "2", 8),    # det-s5: 4 images by the budget, but its weight's fp32 sums take more than they free
    ((8, 512, 25, 38), "0.5", 8),  # 1 image: still no saving
    ((8, 256, 50, 76), "2", 4),    # det-s4: chunks of 4
    ((64, 256, 14, 14), "2", 32),  # cls-14: chunks of 32 (5.5x -> 3.0x)
    ((64, 256, 14, 14), "3", 48),
], ids=["det-s5-2", "det-s5-0.5", "det-s4-2", "cls-14-2", "cls-14-3"])
def test_backward_chunks_only_where_they_save_memory(shape, budget, images, monkeypatch, forced):
    """With grad_weight, chunks sum it over the batch in fp32 (a running sum, a chunk's sum and split partials of at
    least 4 weights' worth: _chunked_weight_bytes); where that takes what the chunks free, the batch runs whole.
    Without grad_weight, or without the weight's size given, the budget alone decides (det-s5: 4 images at 2)."""
    kernels = kernel_modules()
    monkeypatch.setenv("DEFORMCONV_WORKSPACE_BUDGET", budget)
    n, c, h, w = shape
    x = _meta(shape, torch.float16)
    weight_elems = c * c * 9
    assert kernels.schedule.backward_chunk_images(x, x, True, True, False, weight_elems=weight_elems) == images
    by_budget = kernels.schedule.backward_chunk_images(x, x, True, True, False)
    assert by_budget == (images if images < n else {"2": 4, "0.5": 1}[budget])
    assert kernels.schedule.backward_chunk_images(x, x, True, False, False, weight_elems=weight_elems) == by_budget


@pytest.mark.parametrize("backend,dtype", TRITON_BACKENDS)
@pytest.mark.parametrize("config,input_layout,deterministic", [
    ("3x3-pad1", "nchw", False), ("og4-packed-segments", "nchw", False), ("3x3-pad1", "nchw", True),
    ("3x3-pad1", "channels_last", False)], ids=["nchw", "offset-grouped", "nchw-deterministic", "channels-last-input"])
@pytest.mark.parametrize("paired", [True, False], ids=["paired", "separate"])
def test_backward_through_the_layout_kernels(backend, dtype, config, input_layout, deterministic, paired, monkeypatch,
                                             forced):
    """With the layout copies through _transpose_kernel as on the GPU (options.layout_kernels_on_cpu; the CPU otherwise
    uses torch's): an NCHW input's pass zeroes grad_input's accumulator (fp32, or int64 when deterministic; a
    channels-last input has no pass and gets a plain zeroing), the NCHW grad_out's pass sums grad_bias's partials (no
    channel-sum launch, no bias rows in the grad_weight kernel), the two passes run in one _transpose_pair_kernel launch
    where both exist (options.paired_transposes; else one launch each), and every gradient is the oracle's."""
    kernels = kernel_modules()

    forced(layout_kernels_on_cpu=True, paired_transposes=paired)  # and no cached launches: all are counted
    passes, sums = [], []
    launches = {name: [] for name in ("_transpose_kernel", "_transpose_pair_kernel")}
    for name, log in launches.items():
        monkeypatch.setattr(kernels.layout, name, CountingKernel(getattr(kernels.layout, name), log))
    real_transpose, real_sum = kernels.layout.transpose_last, kernels.backward.channel_sum

    def transpose(src, a, b, out, zero=None, sums=None, jobs=None):
        passes.append((None if zero is None else zero.dtype, sums is not None))
        return real_transpose(src, a, b, out, zero, sums, jobs)

    monkeypatch.setattr(kernels.layout, "transpose_last", transpose)
    monkeypatch.setattr(kernels.backward, "channel_sum", lambda t: sums.append(t.shape) or real_sum(t))
    args, kwargs = make_case(**dict(CONFIGS[config], n=2), dtype=dtype, seed=zlib.crc32(config.encode()) % 967)
    leaves64 = leaves_with_grad(args, kwargs, torch.float64)
    assert leaves64[3] is not None  # a bias
    if input_layout == "channels_last":
        leaves64[0] = channels_last_leaf(leaves64[0])
    with deterministic_mode(deterministic):
        compare_to_oracle(backend, dtype, leaves64, kwargs, naive_deform_conv2d)
    zeroed = [z for z, _ in passes if z is not None]
    assert zeroed == ([] if input_layout == "channels_last" else [torch.int64 if deterministic else torch.float32])
    assert [s for _, s in passes].count(True) == 1 and sums == []  # grad_out's pass (fwd_bwd's grad_out is NCHW)
    assert [m["NEED_BIAS"] for m in launch_metas() if "NEED_BIAS" in m] == [False]
    # the forward's input pass is fused with its weight pack (_pack_and_transpose_kernel); the backward's two
    # passes (an NCHW input's and grad_out's) pair up, grad_input's accumulator goes back in a pass of its own
    nchw = input_layout == "nchw"
    pairs = 1 if paired and nchw else 0
    assert {k: len(v) for k, v in launches.items()} == {
        "_transpose_pair_kernel": pairs, "_transpose_kernel": (1 + nchw - 2 * pairs) + nchw}


@pytest.mark.skipif(not any(p.values[0] == "triton" for p in BACKENDS), reason="needs the Triton backend here")
@pytest.mark.parametrize("n,a,b", [(2, 8, 1000), (3, 1000, 8), (1, 3, 5), (2, 100, 70), (2, 20, 4)],
                         ids=["short-rows", "short-columns", "tiny", "two-partial-tiles", "short-columns-odd"])
def test_transpose_kernel_sizes_its_tiles_to_a_short_side(n, a, b):
    """The layout-copy kernel (NCHW <-> NHWC, NCHW <-> offset-grouped, with a dtype cast): a side of a few
    elements (an offset group's 8 channels) gets its own tile size, either way round; every element lands."""
    kernels = kernel_modules()

    src = torch.randn(n, a, b, generator=torch.Generator().manual_seed(a * b), dtype=torch.float32)
    out = torch.full((n, b, a), float("nan"), dtype=torch.float16)
    kernels.layout.transpose_last(src, a, b, out)
    torch.testing.assert_close(out, src.transpose(1, 2).to(torch.float16), atol=0, rtol=0)


@pytest.mark.skipif(not any(p.values[0] == "triton" for p in BACKENDS), reason="needs the Triton backend here")
@pytest.mark.parametrize("n,a,b,zero_dtype", [(2, 8, 1000, torch.float32), (3, 70, 9, torch.int64),
                                              (1, 3, 5, torch.float32)],
                         ids=["short-rows-fp32-zeros", "short-columns-int64-zeros", "tiny"])
def test_transpose_kernel_zeroes_and_sums_on_the_way(n, a, b, zero_dtype):
    """The transpose pass's two extras (the backward's): a buffer of the output's size zeroed (grad_input's fp32 or
    int64 accumulator, poisoned here), and the source's fp32 sums over b by the pass's tiles (grad_bias's partials):
    their total is the full sum, and each row sums its own tile of b."""
    kernels = kernel_modules()

    src = torch.randn(n, a, b, generator=torch.Generator().manual_seed(a + b)).to(torch.float16)
    out = torch.full((n, b, a), float("nan"), dtype=torch.float16)
    zero = torch.full((n, b, a), -7, dtype=zero_dtype)
    sums = torch.full((n, kernels.layout.transpose_sum_rows(a, b), a), float("nan"), dtype=torch.float32)
    kernels.layout.transpose_last(src, a, b, out, zero=zero, sums=sums)
    torch.testing.assert_close(out, src.transpose(1, 2), atol=0, rtol=0)
    assert torch.equal(zero, torch.zeros_like(zero))
    block_b = kernels.layout.transpose_blocks(a, b)[1]
    want = torch.stack([src[:, :, i:i + block_b].float().sum(-1) for i in range(0, b, block_b)], 1)
    assert want.shape == sums.shape
    torch.testing.assert_close(sums, want, atol=1e-5, rtol=1e-5)
