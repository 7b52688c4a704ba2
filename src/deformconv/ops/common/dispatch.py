"""The one dispatch: which backend runs a call of each op.

A backend (``triton``, ``cpu``, ``reference``) says why it cannot run a (device, dtype) through
``not_supported_reasons`` (an empty list means it can). Each op family registers, in its ``op.py``, the backends it
has and the module implementing each (:func:`register`). Selection, for every op the same way: the ``backend=``
keyword, else the environment variable ``DEFORMCONV_BACKEND``, else the first of the op's backends in the order
triton, cpu, reference that supports the call and may be chosen automatically on that device (Triton's CPU
interpreter is never chosen automatically). A forced backend that cannot run raises with its reasons; when none can,
the error lists every backend's. An op without a cpu backend (RoI pooling) takes ``DEFORMCONV_BACKEND=cpu`` as its
reference, which is its CPU path.
"""

from __future__ import annotations

import functools
import importlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ... import config

ENV_VAR = "DEFORMCONV_BACKEND"

# The automatic choice tries the backends in this order.
PRIORITY: Sequence[str] = ("triton", "cpu", "reference")


class Backend:
    """A kind of implementation, and where it can run."""

    name: str = ""

    def not_supported_reasons(self, device: torch.device, dtype: torch.dtype) -> List[str]:
        raise NotImplementedError

    def automatic(self, device: torch.device) -> bool:
        """Whether the automatic choice may pick this backend on this device (it must also support it)."""
        return True


class ReferenceBackend(Backend):
    """Plain PyTorch: any device, any float dtype. Slow but obviously right (the tests' oracle)."""

    name = "reference"

    def not_supported_reasons(self, device, dtype):
        if not dtype.is_floating_point:
            return [f"dtype {dtype} is not a floating-point type"]
        return []


class CpuBackend(Backend):
    """Plain PyTorch laid out for the CPU (deform_conv2d: channels-last row gathers and one GEMM; DCNv3/DCNv4 and the
    attention: grid_sample's C++ sampler): CPU tensors, float dtypes."""

    name = "cpu"

    def not_supported_reasons(self, device, dtype):
        reasons = []
        if torch.device(device).type != "cpu":
            reasons.append("runs on CPU tensors only")
        if not dtype.is_floating_point:
            reasons.append(f"dtype {dtype} is not a floating-point type")
        return reasons


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


def triton_interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    return config.triton_interpret()


class TritonBackend(Backend):
    """Fused Triton kernels: CUDA, or CPU tensors under TRITON_INTERPRET=1."""

    name = "triton"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def not_supported_reasons(self, device, dtype):
        from ...compat import TRITON_IMPORT_ERROR

        reasons = [TRITON_IMPORT_ERROR] if TRITON_IMPORT_ERROR else []
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                reasons.append("CUDA is not available")
            else:
                major = _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0]
                if major < 7:
                    reasons.append("Triton needs compute capability >= 7.0")
                elif major < 8 and dtype == torch.bfloat16:
                    reasons.append(f"bfloat16 needs compute capability >= 8.0, {torch.cuda.get_device_name(device)} "
                                   "has less")
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


BACKENDS: Dict[str, Backend] = {b.name: b for b in (TritonBackend(), CpuBackend(), ReferenceBackend())}

# op -> {backend name: module implementing it}, filled by each family's op.py (register)
_OPS: Dict[str, Dict[str, str]] = {}


def register(op: str, implementations: Dict[str, str]) -> None:
    """Op ``op``'s backends: {backend name: the module (absolute name) that implements it}; imported on first use,
    so that an op's reference runs without Triton."""
    unknown = set(implementations) - set(BACKENDS)
    if unknown:
        raise ValueError(f"register({op!r}): unknown backend(s) {sorted(unknown)}; known: {sorted(BACKENDS)}")
    _OPS[op] = {name: implementations[name] for name in PRIORITY if name in implementations}


def ops() -> List[str]:
    """The registered ops' names, in registration order."""
    return list(_OPS)


def backends_of(op: str) -> List[str]:
    """The backends op ``op`` has, in the automatic choice's order."""
    try:
        return list(_OPS[op])
    except KeyError:
        raise ValueError(f"op must be one of {ops()}, got {op!r}") from None


def backend_argument(op: str, backend: Optional[str]) -> str:
    """A public function's ``backend=`` as its op takes it ("" for None, automatic); an unknown name raises."""
    if backend is None:
        return ""
    if not isinstance(backend, str) or backend not in _OPS[op]:
        raise ValueError(f"backend must be one of {backends_of(op)} (or None for automatic), got {backend!r}")
    return backend


def environment_backend() -> Optional[str]:
    """The backend DEFORMCONV_BACKEND forces on every op, or None (unset, empty or auto); another value raises."""
    forced = config.backend()
    if forced is None or forced == "auto":
        return None
    if forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {['auto', *sorted(BACKENDS)]} (or unset), got {forced!r}")
    return forced


def not_supported_reasons(device: torch.device, dtype: torch.dtype, op: str = "deform_conv2d") -> Dict[str, List[str]]:
    """For every backend of ``op``, why it cannot run on (device, dtype): an empty list means it can.

    Example::

        >>> import torch, deformconv
        >>> deformconv.not_supported_reasons(torch.device("cpu"), torch.float32, op="dcnv3")["cpu"]
        []
    """
    return {name: BACKENDS[name].not_supported_reasons(device, dtype) for name in backends_of(op)}


def select_backend(device: torch.device, dtype: torch.dtype, requested: Optional[str] = None,
                   op: str = "deform_conv2d") -> str:
    """The name of the backend that runs a call of ``op`` on (device, dtype): ``requested`` where given (it must be
    able to run the call), else the one ``DEFORMCONV_BACKEND`` forces, else the automatic choice.

    Example::

        >>> import torch, deformconv
        >>> deformconv.select_backend(torch.device("cpu"), torch.float32, op="ms_deform_attn")
        'cpu'
    """
    available = backends_of(op)
    source = "backend="
    if requested is None or requested == "":
        requested = environment_backend()
        if requested is not None and requested not in available:
            return "reference"  # an op without that backend (RoI pooling: cpu) takes its reference
        source = f"{ENV_VAR}="
    elif requested != "auto" and requested not in available:
        raise ValueError(f"backend must be one of {available} (or None for automatic), got {requested!r}")
    if requested is not None and requested != "auto":
        reasons = BACKENDS[requested].not_supported_reasons(device, dtype)
        if reasons:
            raise RuntimeError(f"{source}{requested!r} cannot run on device {device} with dtype {dtype}: "
                               + "; ".join(reasons))
        return requested
    all_reasons = not_supported_reasons(device, dtype, op)
    for name in available:
        if not all_reasons[name] and BACKENDS[name].automatic(device):
            return name
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in all_reasons.items())
    raise RuntimeError(f"no {op} backend can run on device {device} with dtype {dtype} ({detail})")


def chosen_backend(op: str, device: torch.device, dtype: torch.dtype, requested: str) -> str:
    """select_backend for an op's call (requested: its backend argument, "" for automatic), chosen once for each
    (device, dtype, request, environment), not at every call."""
    return _chosen(op, device, dtype, requested, (config.backend(), config.triton_interpret()))


@traced_through_cache(maxsize=512)
def _chosen(op: str, device: torch.device, dtype: torch.dtype, requested: str, env: tuple) -> str:
    # a choice that raises is not cached
    return select_backend(device, dtype, requested or None, op)


@functools.lru_cache(maxsize=None)
def _module(op: str, backend: str):
    return importlib.import_module(_OPS[op][backend])


def implementation(op: str, tensor: torch.Tensor, requested: str):
    """The module implementing ``op`` on the backend chosen for a call whose main input is ``tensor`` (an empty
    batch: the reference, which needs no kernel)."""
    if tensor.shape[0] == 0:
        return _module(op, "reference")
    return _module(op, chosen_backend(op, tensor.device, tensor.dtype, requested))
