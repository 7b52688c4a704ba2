"""Triton and torch version differences, in one place.

Feature detection where a feature can be probed (host-side TMA descriptors); otherwise one named
:class:`CodegenProfile` per Triton whose code generation differs, passed to the kernels as constexpr arguments
(never read from globals inside a kernel). docs/tuning.md has the measurements behind each spelling.

Triton is optional: PyTorch's CPU, macOS and Windows wheels ship none. Without it ``triton`` is None here, the
Triton backends say so in ``not_supported_reasons``, and nothing imports a kernel module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Tuple

from .config import options

try:
    import triton
except ModuleNotFoundError:  # CPU, macOS and Windows wheels of PyTorch: the reference and CPU backends only
    triton = None
    TRITON_IMPORT_ERROR = "Triton is not installed"
except Exception as error:  # pragma: no cover - a broken install: the CPU paths still work
    triton = None
    TRITON_IMPORT_ERROR = f"Triton is not importable ({type(error).__name__}: {error})"
else:
    TRITON_IMPORT_ERROR = None

try:  # host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # no Triton, or an older one: every tile is read through pointers
    TensorDescriptor = None


def triton_version() -> Tuple[int, int]:
    """(major, minor) of the Triton in use: "3.8.0" or "3.8.0+git1234" -> (3, 8); (0, 0) without Triton."""
    if triton is None:
        return 0, 0
    major, minor = (triton.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


@dataclass(frozen=True)
class CodegenProfile:
    """Spellings of the same computation that one Triton compiles well and another badly.

    explicit_fma_blend: the 16-bit bilinear blend written as explicit FMAs. Triton 3.8 packs the products into
        f16x2 multiplies and leaves their sums unfused unless told; Triton 3.6 contracts the plain expression itself.
    contiguous_flat_store: the forward stores a tile lying in one image as a run of positions even with flat M
        tiles. Triton 3.8 otherwise gives each thread a column of positions with an address apiece and spills.
    pair_axis_outer: corner pairs [BM, NSEG, 2, SEG] are addressed as [2, NSEG, BM, SEG]. Triton 3.8 otherwise
        splits each pair over two lanes (shuffles, spills) and moves packed sample points through shared memory.
    wide_run_stores: the forward's vectorised NCHW runs take any length dividing Ho*Wo and the tile, in any dtype
        (else 16-bit outputs only, in runs of 8).
    per_image_run_stores: every forward with run stores tiles M per image (else only 128-row tiles).
    narrow_weight_stages: pipeline stages of grad_weight's narrow 16-bit tile; Triton 3.8 stages its A tile in
        shared memory as well, so two stages no longer fit three programs an SM.
    """

    explicit_fma_blend: bool
    contiguous_flat_store: bool
    pair_axis_outer: bool
    wide_run_stores: bool
    per_image_run_stores: bool
    narrow_weight_stages: int


TRITON_3_6 = CodegenProfile(explicit_fma_blend=False, contiguous_flat_store=False, pair_axis_outer=False,
                            wide_run_stores=False, per_image_run_stores=False, narrow_weight_stages=2)
TRITON_3_8 = CodegenProfile(explicit_fma_blend=True, contiguous_flat_store=True, pair_axis_outer=True,
                            wide_run_stores=True, per_image_run_stores=True, narrow_weight_stages=1)
_INSTALLED = TRITON_3_6 if triton_version() <= (3, 6) else TRITON_3_8


def codegen_profile() -> CodegenProfile:
    """The profile in use: options.profile if set, else the installed Triton's."""
    return options.profile or _INSTALLED


# --- torch's tracing of custom ops (the compile route, ops/deform_conv2d/op.py) ---------------------------------


def custom_op_decomposition_disabled() -> bool:
    """Whether torch wants custom ops kept whole rather than decomposed into their kernels: torch.export does (its
    programs name ops, not a GPU's kernels), with the same switch torch.library.triton_op reads."""
    import torch

    return not getattr(torch._functorch.config, "decompose_custom_triton_ops", True)


def onnx_export_flag():
    """A callable telling whether torch.onnx's dynamo-based exporter is tracing, read at every deform_conv2d call:
    the exporter's own flag where this torch has it (torch.onnx.is_in_onnx_export imports two modules a call, over a
    microsecond), else the public function."""
    import torch

    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:
        return torch.onnx.is_in_onnx_export
    if not hasattr(_flags, "_is_onnx_exporting"):
        return torch.onnx.is_in_onnx_export
    return lambda: _flags._is_onnx_exporting


def register_op_kernels(qualname: str, kernels: list) -> None:
    """Tell torch which Triton kernels an op's decomposition launches, as torch.library.triton_op does: AOTAutograd's
    cache keys then include their source, so an edited kernel is never served from a stale compiled graph."""
    import torch._library.triton as library_triton

    table = getattr(library_triton, "triton_ops_to_kernels", None)
    if isinstance(table, dict):
        table[qualname] = list(kernels)


# --- kernel launches (ops/common/launch.py) ----------------------------------------------------------------------


def direct_launcher(compiled):
    """A callable launching a compiled kernel, ``go(grid, *args)`` (args: every parameter in signature order,
    constexprs included, as Triton's own launcher takes them), that skips the Python Triton runs around its C
    launcher at every call (the current device and stream looked up through its driver proxy, launch metadata, hooks,
    scratch allocators: tens of microseconds on a slow host); None where this Triton's launcher is not one of the
    forms below, or the kernel needs what that Python does (global or profile scratch memory, instrumentation).
    Launch hooks (a profiler's) are honoured by the caller, who takes Triton's path while one is set.

    The C launcher's arguments: Triton 3.6 takes (grid x, y, z, stream, function, cooperative, pdl, global scratch,
    profile scratch, kernel metadata, launch metadata, enter hook, exit hook, *args); Triton 3.8 takes (grid, stream,
    function, cooperative, pdl, kernel metadata, launch metadata, hooks, scratches, argument annotations, kernel
    signature, args). Other versions get the launcher object's own call, which both share."""
    import torch

    run = getattr(compiled, "run", None)
    function, packed = getattr(compiled, "function", None), getattr(compiled, "packed_metadata", None)
    if run is None or function is None or packed is None:
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "gsan_enabled", False)):
        return None
    stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    device = getattr(torch._C, "_cuda_getDevice", None)
    if stream_of is None or device is None:  # a torch built without CUDA
        return None
    launch = getattr(run, "launch", None)
    coop, pdl = getattr(run, "launch_cooperative_grid", None), getattr(run, "launch_pdl", None)
    version = triton_version()
    c_launcher = launch is not None and coop is not None and pdl is not None
    if c_launcher and version == (3, 6):
        def go(grid, *args):
            launch(grid[0], grid[1], grid[2], stream_of(device()), function, coop, pdl, None, None, packed, None, None,
                   None, *args)
    elif c_launcher and version == (3, 8) and hasattr(run, "arg_annotations"):
        annotations, signature = run.arg_annotations, run.kernel_signature

        def go(grid, *args):
            launch(grid[0], grid[1], grid[2], stream_of(device()), function, coop, pdl, packed, None, None, None, None,
                   None, annotations, signature, args)
    else:
        def go(grid, *args):
            run(grid[0], grid[1], grid[2], stream_of(device()), function, packed, None, None, None, *args)
    return go


_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is set (a profiler's): launches then take Triton's own path, which calls it. (A
    hook is None or a function in Triton 3.6, a chain of functions in Triton 3.8.)"""
    if _RUNTIME_KNOBS is None:
        return False
    enter, leave = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True)))


# --- torch's matrix products ------------------------------------------------------------------------------


def mm_fp32(a, b):
    """a @ b summed and returned in fp32 from 16-bit (or fp32) operands: torch.mm's out_dtype on CUDA where this torch
    has it (aten::mm.dtype), else the operands upcast first (CPU tensors under the interpreter, older torch): the same
    sums, more memory traffic."""
    import torch

    if a.dtype != torch.float32 and a.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _precision(*settings: str) -> str:
    """The first of torch's fp32_precision settings, most specific first, that is set ("none": inherit the next)."""
    for p in settings:
        if p != "none":
            return p
    return "none"


def conv_tf32() -> bool:
    """Whether F.conv*d takes TF32 for fp32 inputs, as set through either of torch's APIs: the legacy
    ``torch.backends.cudnn.allow_tf32`` (on by default) or, since torch 2.9, ``fp32_precision`` (the convolutions',
    else cuDNN's, else the global setting). Once the newer API has been used torch refuses to read the legacy flag, so
    it is read only where torch allows."""
    import torch

    cudnn = torch.backends.cudnn
    try:
        return bool(cudnn.allow_tf32)
    except RuntimeError:  # "mix of the legacy and new APIs"
        return _precision(cudnn.conv.fp32_precision, cudnn.fp32_precision, torch.backends.fp32_precision) != "ieee"


@contextlib.contextmanager
def conv_matmul_precision(dtype):
    """torch.matmul on a convolution's fp32 columns with TF32 exactly where F.conv*d would use it (conv_tf32), as
    the Triton kernels' dots do (launch.dot_precision): torch.matmul by itself follows the matmul setting (off by
    default). The setting is changed for the products' launch and restored (process-wide, as torch's own flag
    contexts), through the API torch accepts in its state: the legacy ``cuda.matmul.allow_tf32`` unless the user
    has set ``fp32_precision``, else that."""
    import torch

    if dtype != torch.float32:
        yield
        return
    want = conv_tf32()
    matmul = torch.backends.cuda.matmul
    try:
        have = bool(matmul.allow_tf32)
        name, set_to, restore = "allow_tf32", want, have
    except RuntimeError:  # "mix of the legacy and new APIs": the user set fp32_precision
        old = matmul.fp32_precision
        have = _precision(old, torch.backends.fp32_precision) == "tf32"
        name, set_to, restore = "fp32_precision", "tf32" if want else "ieee", old
    if have == want:
        yield
        return
    setattr(matmul, name, set_to)
    try:
        yield
    finally:
        setattr(matmul, name, restore)


def _mm_has_out_dtype() -> bool:
    import torch

    try:
        return "out_dtype" in str(torch.ops.aten.mm.dtype._schema)
    except (AttributeError, RuntimeError):
        return False


_MM_OUT_DTYPE = _mm_has_out_dtype()
