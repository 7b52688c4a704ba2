"""The one dispatch point: which implementation runs a deform_conv2d call.

Each backend says why it cannot run a given (device, dtype) through ``not_supported_reasons`` (an empty
list means it can). Selection, in order: the ``backend=`` keyword, else the environment variable
``DEFORMCONV_BACKEND``, else the first backend of ``PRIORITY`` that supports the call and may be chosen
automatically on that device (Triton's CPU interpreter is never chosen automatically). A forced backend
that cannot run raises with its reasons; when none can, the error lists every backend's reasons.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import config
from .ops.common.launch import on_device_of

ENV_VAR = "DEFORMCONV_BACKEND"


class Backend:
    """An implementation of the forward and backward of deform_conv2d."""

    name: str = ""

    def not_supported_reasons(self, device: torch.device, dtype: torch.dtype) -> List[str]:
        raise NotImplementedError

    def automatic(self, device: torch.device) -> bool:
        """Whether the automatic choice may pick this backend on this device (it must also support it)."""
        return True

    def forward(self, input, offset, weight, bias, mask, stride, padding, dilation, keep=None):
        """The output. keep: a dict the backend may fill with tensors its backward can reuse (the eager path's
        autograd context holds them until the backward, which gets the same dict)."""
        raise NotImplementedError

    def backward(self, grad_out, input, offset, weight, mask, stride, padding, dilation, needs, keep=None):
        """Gradients (input, offset, mask, weight, bias). keep: what the forward kept, or None."""
        raise NotImplementedError


class ReferenceBackend(Backend):
    """Plain PyTorch: any device, any float dtype. Slow but obviously right."""

    name = "reference"

    def not_supported_reasons(self, device, dtype):
        if not dtype.is_floating_point:
            return [f"dtype {dtype} is not a floating-point type"]
        return []

    def forward(self, *args, keep=None):
        from .ops.deform_conv2d import reference

        return reference.deform_conv2d_forward(*args)

    def backward(self, *args, keep=None):
        from .ops.deform_conv2d import reference

        return reference.deform_conv2d_backward(*args)


class CpuBackend(Backend):
    """Plain PyTorch laid out for the CPU (channels-last row gathers, one GEMM): CPU tensors, float dtypes."""

    name = "cpu"

    def not_supported_reasons(self, device, dtype):
        reasons = []
        if torch.device(device).type != "cpu":
            reasons.append("runs on CPU tensors only")
        if not dtype.is_floating_point:
            reasons.append(f"dtype {dtype} is not a floating-point type")
        return reasons

    def forward(self, *args, keep=None):
        from .ops.deform_conv2d import cpu

        return cpu.deform_conv2d_forward(*args)

    def backward(self, *args, keep=None):
        from .ops.deform_conv2d import cpu

        return cpu.deform_conv2d_backward(*args)


def traced_through_cache(maxsize: Optional[int] = None):
    """functools.lru_cache for a choice that torch.compile's Dynamo traces through (the public functions choose a
    backend while traced). Dynamo calls the function itself, as it would anyway: it ignores an lru_cache wrapper,
    warning once a process that this may be silently wrong, which a pure choice like these is not; eager calls hit
    the cache. ``cache_clear`` as lru_cache's."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        call.cache_clear = cached.cache_clear
        return call
    return wrap


@traced_through_cache()
def _cuda_capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _triton_import_error() -> Optional[str]:
    from .compat import TRITON_IMPORT_ERROR

    return TRITON_IMPORT_ERROR


def triton_interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return config.triton_interpret()


class TritonBackend(Backend):
    """Fused implicit-GEMM Triton kernels: CUDA, or CPU tensors under TRITON_INTERPRET=1."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def not_supported_reasons(self, device, dtype):
        reasons = []
        err = _triton_import_error()
        if err:
            reasons.append(err)
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                reasons.append("CUDA is not available")
            else:
                major = _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0]
                if major < 7:
                    reasons.append("Triton needs compute capability >= 7.0")
                elif major < 8 and dtype == torch.bfloat16:
                    reasons.append(f"bfloat16 needs compute capability >= 8.0, {torch.cuda.get_device_name(device)} has less")
        elif device.type == "cpu":
            if not triton_interpret_mode():
                reasons.append("CPU tensors run on Triton only under TRITON_INTERPRET=1 (the interpreter)")
            elif dtype == torch.bfloat16:
                # the interpreter keeps bfloat16 as its uint16 bits, and its tl.dot multiplies those bits
                # (triton-lang/triton#11584: results ~1e10 off; not supported upstream)
                reasons.append("Triton's interpreter (TRITON_INTERPRET=1) computes bfloat16 tl.dot on the raw bits; "
                               "bfloat16 on the CPU runs on the cpu backend")
        else:
            reasons.append(f"device type {device.type!r} is not supported (CUDA only)")
        if dtype == torch.float64:
            reasons.append("float64 has no tensor-core path; the cpu and reference backends compute float64")
        elif dtype not in self.dtypes:
            reasons.append(f"dtype {dtype} is not one of float16, bfloat16, float32")
        return reasons

    def automatic(self, device):
        # Triton's CPU interpreter is for testing: CPU tensors go to the cpu backend unless forced.
        return torch.device(device).type == "cuda"

    def forward(self, input, *args, keep=None):
        from .ops.deform_conv2d.forward import deform_conv2d_forward

        with on_device_of(input):
            return deform_conv2d_forward(input, *args, keep=keep)

    def backward(self, grad_out, input, *args, keep=None):
        from .ops.deform_conv2d.backward import deform_conv2d_backward

        with on_device_of(input):
            keep = keep or {}  # None where the forward kept nothing
            return deform_conv2d_backward(grad_out, input, *args, packed_weight=keep.get("packed_weight"),
                                          operands=(keep.get("offset"), keep.get("mask")))


BACKENDS: Dict[str, Backend] = {b.name: b for b in (TritonBackend(), CpuBackend(), ReferenceBackend())}
# Automatic choice tries these in order.
PRIORITY: Sequence[str] = ("triton", "cpu", "reference")


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} (or None for automatic), got {name!r}") from None


# The other ops have a Triton backend, which runs where deform_conv2d's does, and a reference; DCNv3/DCNv4 and
# multi-scale deformable attention also a CPU backend (grid_sample's C++ sampler), the automatic choice on CPU tensors.
OP_BACKENDS: Sequence[str] = ("triton", "cpu", "reference")
ROI_BACKENDS: Sequence[str] = ("triton", "reference")


def op_backend_name(backend: Optional[str], available: Sequence[str] = OP_BACKENDS) -> str:
    """A public function's backend= for the other ops as their op takes it ("" for None); an unknown name raises."""
    if backend is not None and backend not in available:
        raise ValueError(f"backend must be one of {list(available)} (or None for automatic), got {backend!r}")
    return backend or ""


def select_op_backend(device: torch.device, dtype: torch.dtype, requested: str,
                      available: Sequence[str] = OP_BACKENDS) -> str:
    """The backend that runs a call of one of the other ops: the one requested (backend=, else DEFORMCONV_BACKEND;
    it must be able to run the call), else the Triton kernels where they run automatically (CUDA; fp16, bf16, fp32),
    else the CPU backend on CPU tensors where the op has one, else the reference. An op without a cpu backend (RoI
    pooling) takes DEFORMCONV_BACKEND=cpu as its reference, which is its CPU path."""
    op_backend_name(requested or None, available)  # an unknown name raises (calls of the op itself)
    source = "backend="
    if not requested:
        forced = environment_backend()
        if forced is not None:
            requested = forced if forced in available else "reference"
            source = f"{ENV_VAR}={forced!r}: "
    if requested == "reference":
        return "reference"
    if requested:
        reasons = BACKENDS[requested].not_supported_reasons(device, dtype)
        if reasons:
            raise RuntimeError(f"{source}{requested!r} cannot run on device {device} with dtype {dtype}: "
                               + "; ".join(reasons))
        return requested
    if not BACKENDS["triton"].not_supported_reasons(device, dtype) and BACKENDS["triton"].automatic(device):
        return "triton"
    if "cpu" in available and not BACKENDS["cpu"].not_supported_reasons(device, dtype):
        return "cpu"
    return "reference"


def not_supported_reasons(device: torch.device, dtype: torch.dtype) -> Dict[str, List[str]]:
    """For every backend, why it cannot run this (device, dtype): an empty list means it can."""
    return {name: BACKENDS[name].not_supported_reasons(device, dtype) for name in PRIORITY}


def environment_backend() -> Optional[str]:
    """The backend DEFORMCONV_BACKEND forces on every op, or None (unset, empty or auto); another value raises."""
    forced = config.backend()
    if forced is None or forced == "auto":
        return None
    if forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {['auto', *sorted(BACKENDS)]} (or unset), got {forced!r}")
    return forced


def select_backend(device: torch.device, dtype: torch.dtype, requested: Optional[str] = None) -> str:
    """The name of the backend that runs a deform_conv2d call on (device, dtype)."""
    source = "backend="
    if requested is None:
        requested = environment_backend()
        source = f"{ENV_VAR}="
    if requested is not None:
        if requested == "auto":
            requested = None
        else:
            reasons = get_backend(requested).not_supported_reasons(device, dtype)
            if reasons:
                raise RuntimeError(
                    f"{source}{requested!r} cannot run on device {device} with dtype {dtype}: " + "; ".join(reasons)
                )
            return requested
    all_reasons = not_supported_reasons(device, dtype)
    for name in PRIORITY:
        if not all_reasons[name] and BACKENDS[name].automatic(device):
            return name
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in all_reasons.items())
    raise RuntimeError(f"no deform_conv2d backend can run on device {device} with dtype {dtype} ({detail})")
