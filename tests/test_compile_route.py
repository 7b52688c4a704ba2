"""The compile route's tracing, on this machine's CPU with a pretend GPU (fake CUDA tensors, torch.cuda's queries
answered as an H200's): both ops decompose into wrapped Triton kernel launches whose outputs have the shapes, strides
and dtypes the ops' fake implementations promise; only under DEFORMCONV_COMPILE_KERNELS=1; symbolic sizes and
torch.export keep the ops opaque. The kernels' results under torch.compile are tested on a GPU
(tests/ops/deform_conv2d/test_compile_cuda.py).

wrap_triton traces compiled kernels only, not the interpreter's, so the tracing runs in a child process without
TRITON_INTERPRET (this file run as a script), which prints what each trace launched."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

# (n, cin, cout, h, w, k, groups, offset_groups, stride, padding, mask)
SHAPES = {
    "odd-s2": (3, 24, 40, 17, 23, 3, 1, 1, 2, 1, True),
    "groups-og4": (2, 32, 48, 13, 11, 3, 2, 4, 1, 1, True),
    "5x5-no-mask": (2, 16, 24, 15, 19, 5, 1, 1, 1, 2, False),
    "og8-packed": (2, 64, 64, 14, 15, 3, 1, 8, 1, 1, True),
}
# at columns.MIN_COUT output channels grad_weight, at columns.MIN_CIN_GRAD_COL input channels grad_input/offset/mask,
# through the column buffers by default in 16 bits
WIDE = {"cout-128": (2, 16, 128, 9, 11, 3, 1, 1, 1, 1, True), "cin-512": (2, 512, 16, 5, 7, 3, 1, 1, 1, 1, True)}
# 256 output channels: the forward's 64x256 tile within one wave of its programs (132 pretend SMs), the 128x256 tile
# past it (configs.traced_wide_tile)
WAVES = {"cout-256-one-wave": (2, 16, 256, 9, 11, 3, 1, 1, 1, 1, True),
         "cout-256-two-waves": (4, 16, 256, 60, 60, 3, 1, 1, 1, 1, True)}
# depthwise: eager calls take the N-d forms' column kernels (ops/deform_conv2d/triton/narrow_groups.py), the compile
# route the implicit GEMM
NARROW = {"depthwise-og2": (2, 16, 16, 9, 11, 3, 16, 2, 1, 1, True)}
DTYPES = ("float32", "float16", "bfloat16")
MAIN_KERNELS = ("_deform_conv2d_fwd_kernel", "_deform_conv2d_bwd_data_kernel", "_deform_conv2d_bwd_weight_kernel")


# --- the child: traces on a pretend GPU ----------------------------------------------------------------


def _pretend_gpu():
    """torch.cuda and Triton's driver answer as an H200's would (Triton's target: compiling a kernel to TTIR, as
    torch's analysis of what it stores does, needs no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget

    triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_properties = lambda *a: types.SimpleNamespace(multi_processor_count=132, name="H200")
    torch.cuda.get_device_name = lambda *a: "pretend H200"


def _fake_inputs(name, dtype, symbolic=False):
    """Fake CUDA tensors of a case; symbolic: the batch size a symbol (as torch.compile's dynamic shapes make it)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    n, cin, cout, h, w, k, g, og, s, p, has_mask = {**SHAPES, **WIDE, **WAVES, **NARROW}[name]
    ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    env = ShapeEnv() if symbolic else None
    if symbolic:
        n = env.create_symintnode(env.create_symbol(n, ConstantSource("batch")), hint=n)
    sizes = [(n, cin, h, w), (n, 2 * og * k * k, ho, wo), (cout, cin // g, k, k), (cout,),
             (n, og * k * k, ho, wo) if has_mask else None, (n, cout, ho, wo)]
    with FakeTensorMode(shape_env=env):
        tensors = [None if sz is None else torch.empty(sz, device="cuda", dtype=dtype) for sz in sizes]
    return tensors, [s, s], [p, p]


def _both_ops(needs, stride, padding, has_mask):
    def run(*ts):
        x, off, w, b = ts[:4]
        m, gout = (ts[4], ts[5]) if has_mask else (None, ts[4])
        out = torch.ops.deformconv.deform_conv2d(x, off, w, b, m, stride, padding, [1, 1], "")
        grads = torch.ops.deformconv.deform_conv2d_backward(gout, x, off, w, m, stride, padding, [1, 1], needs, "")
        return (out, *grads)

    return run


def _trace(name, dtype, needs=None, tracing_mode="fake", keep_whole=False):
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors, stride, padding = _fake_inputs(name, getattr(torch, dtype), symbolic=tracing_mode == "symbolic")
    has_mask = tensors[4] is not None
    needs = needs or [True, True, has_mask, True, True]
    present = [t for t in tensors if t is not None]
    run = _both_ops(needs, stride, padding, has_mask)
    with torch._functorch.config.patch(decompose_custom_triton_ops=not keep_whole):
        gm = make_fx(dispatch_functionalize(run), tracing_mode=tracing_mode)(*present)
    launched, stores = [], []
    for nd in gm.graph.nodes:
        if "triton_kernel_wrapper" in str(nd.target):
            kernel = kernel_side_table.get_kernel(nd.kwargs["kernel_idx"]).fn.__name__
            launched.append(kernel)
            written = list(nd.kwargs["tensors_to_clone"])
            inputs = [name for name in written if getattr(nd.kwargs["kwargs"].get(name), "op", "") == "placeholder"]
            tile = [nd.kwargs["kwargs"].get(k) for k in ("BLOCK_M", "BLOCK_N")]
            stores.append(dict(kernel=kernel, written=written, writes_inputs=inputs, tile=tile))
    opaque = [str(nd.target) for nd in gm.graph.nodes if "deformconv" in str(nd.target)]
    traced = [nd.meta["val"] for nd in gm.graph.output_node().args[0]]
    promised = run(*present)  # fake tensors outside any tracing: the ops' fake implementations

    def layouts(ts):
        return [[str(list(t.shape)), str(list(t.stride())), str(t.dtype), str(t.device)] for t in ts]

    return dict(launched=launched, stores=stores, opaque=opaque, traced=layouts(traced), promised=layouts(promised))


def _child() -> dict:
    _pretend_gpu()
    import deformconv  # noqa: F401  (registers the ops)

    results = {f"{name}:{dtype}": _trace(name, dtype) for name in SHAPES for dtype in DTYPES}
    results["input-grad-only"] = _trace("odd-s2", "float16", needs=[True, False, False, False, False])
    results["symbolic"] = _trace("groups-og4", "float16", tracing_mode="symbolic")
    results["export"] = _trace("groups-og4", "float16", keep_whole=True)
    from deformconv.config import options

    with options.override(columns_grad_weight=True):
        results["columns"] = _trace("odd-s2", "bfloat16")
    for dtype in ("bfloat16", "float32"):
        for name in WIDE:
            results[f"{name}:{dtype}"] = _trace(name, dtype)
    with options.override(columns_grad_data=True):
        results["grad-columns"] = _trace("odd-s2", "bfloat16")
    for name, dtype in (("cout-256-one-wave", "bfloat16"), ("cout-256-two-waves", "bfloat16"),
                        ("cout-256-two-waves", "float32")):
        results[f"{name}:{dtype}"] = _trace(name, dtype, needs=[False, False, False, False, False])
    for dtype in DTYPES:
        results[f"depthwise-og2:{dtype}"] = _trace("depthwise-og2", dtype)
    os.environ["DEFORMCONV_COMPILE_KERNELS"] = "0"
    results["switched-off"] = _trace("groups-og4", "float16")
    return results


# --- the tests -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traces():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEFORMCONV_BACKEND")}
    env["DEFORMCONV_COMPILE_KERNELS"] = "1"
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_decompose_into_the_kernels_with_the_promised_outputs(traces, name, dtype):
    t = traces[f"{name}:{dtype}"]
    assert not t["opaque"], t["opaque"]
    for kernel in MAIN_KERNELS:
        assert kernel in t["launched"], t["launched"]
    assert t["traced"] == t["promised"]  # torch.compile plans the graph with the fake implementations' layouts


@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow_groups_trace_the_implicit_gemm(traces, dtype):
    """A depthwise call, which eager calls take through the column kernels, traces into the implicit GEMM's kernels
    with the promised outputs; no kernel writes a graph input."""
    t = traces[f"depthwise-og2:{dtype}"]
    assert not t["opaque"], t["opaque"]
    assert set(MAIN_KERNELS) <= set(t["launched"]) and "_columns_grad_kernel" not in t["launched"], t["launched"]
    assert t["traced"] == t["promised"]
    for launch in t["stores"]:
        assert not launch["writes_inputs"], launch


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_forward_kernel_writes_only_the_output(traces, dtype):
    """torch's analysis of the kernel (its TTIR) finds its one store: functionalisation copies no input for it."""
    for name in SHAPES:
        for launch in traces[f"{name}:{dtype}"]["stores"]:
            if launch["kernel"] == "_deform_conv2d_fwd_kernel":
                assert launch["written"] == ["out_ptr"], launch


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_kernel_writes_an_input_of_the_graph(traces, dtype):
    """torch's analysis counts the grad_input kernel's offsets and mask as written (their loaded values place its
    scatters); a written graph input that requires grad fails torch.compile (seen on the H200), so the traced kernel
    reads copies of them."""
    for name in SHAPES:
        for launch in traces[f"{name}:{dtype}"]["stores"]:
            assert not launch["writes_inputs"], launch


def test_grad_weight_through_the_column_buffer_traces(traces):
    """options.columns_grad_weight under the compile route: the column kernel launched from the graph (through
    wrap_triton) and the product an aten op of it, instead of the grad_weight kernel; outputs as promised."""
    t = traces["columns"]
    assert "_columns_kernel" in t["launched"] and "_deform_conv2d_bwd_weight_kernel" not in t["launched"], t["launched"]
    assert not t["opaque"], t["opaque"]
    assert t["traced"] == t["promised"]
    assert not any(launch["writes_inputs"] for launch in t["stores"]), t["stores"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grad_weight_takes_the_column_buffer_by_default_when_compiled(traces, dtype):
    """Unforced, at columns.MIN_COUT output channels the compile route's grad_weight is the column kernel and its
    product in 16 bits, and the fused kernel in fp32; outputs as promised either way."""
    t = traces[f"cout-128:{dtype}"]
    columns = dtype == "bfloat16"
    assert ("_columns_kernel" in t["launched"]) == columns, t["launched"]
    assert ("_deform_conv2d_bwd_weight_kernel" in t["launched"]) != columns, t["launched"]
    assert not t["opaque"], t["opaque"]
    assert t["traced"] == t["promised"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grad_data_takes_the_grad_col_buffer_by_default_when_compiled(traces, dtype):
    """Unforced, at columns.MIN_CIN_GRAD_COL input channels the compile route's grad_input, grad_offset and grad_mask
    come from the grad_columns kernel in 16 bits, and from the fused kernel in fp32; grad_weight from the fused kernel
    (16 output channels); outputs as promised either way."""
    t = traces[f"cin-512:{dtype}"]
    columns = dtype == "bfloat16"
    assert ("_grad_columns_kernel" in t["launched"]) == columns, t["launched"]
    assert ("_deform_conv2d_bwd_data_kernel" in t["launched"]) != columns, t["launched"]
    assert "_deform_conv2d_bwd_weight_kernel" in t["launched"] and "_columns_kernel" not in t["launched"]
    assert not t["opaque"], t["opaque"]
    assert t["traced"] == t["promised"]
    assert not any(launch["writes_inputs"] for launch in t["stores"]), t["stores"]


def test_grad_data_through_the_grad_col_buffer_traces(traces):
    """options.columns_grad_data under the compile route: grad_col an aten product, the grad_columns kernel launched
    from the graph instead of the grad_input kernel, writing no graph input; outputs as promised."""
    t = traces["grad-columns"]
    launched = t["launched"]
    assert "_grad_columns_kernel" in launched and "_deform_conv2d_bwd_data_kernel" not in launched, launched
    assert not t["opaque"], t["opaque"]
    assert t["traced"] == t["promised"]
    assert not any(launch["writes_inputs"] for launch in t["stores"]), t["stores"]


@pytest.mark.parametrize("case,rows", [("cout-256-one-wave:bfloat16", 64), ("cout-256-two-waves:bfloat16", 128),
                                       ("cout-256-two-waves:float32", 128)])
def test_traced_forward_takes_the_taller_wide_tile_past_one_wave(traces, case, rows):
    """A traced forward has no register cap: at 256 output channels its tile is 64x256 where those programs fit one
    wave (one an SM), else 128x256 (configs.traced_wide_tile); outputs as promised either way."""
    t = traces[case]
    tiles = [launch["tile"] for launch in t["stores"] if launch["kernel"] == "_deform_conv2d_fwd_kernel"]
    assert tiles == [[rows, 256]], tiles
    assert t["traced"] == t["promised"]


def test_only_the_gradients_asked_for_are_computed(traces):
    launched = traces["input-grad-only"]["launched"]
    assert "_deform_conv2d_bwd_data_kernel" in launched and "_deform_conv2d_bwd_weight_kernel" not in launched


@pytest.mark.parametrize("case", ["symbolic", "export", "switched-off"])
def test_symbolic_sizes_export_and_the_switch_keep_the_ops_opaque(traces, case):
    t = traces[case]
    assert len(t["opaque"]) == 2 and not t["launched"], t
    assert t["traced"] == t["promised"]


if __name__ == "__main__":
    print(json.dumps(_child()))
