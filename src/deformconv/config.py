"""Configuration in one place: every environment variable deformconv reads, and the options object.

Environment variables are parsed here and nowhere else (docs/environment.md lists them). Each is read when it
is used, so a change of ``os.environ`` takes effect at the next call.

``options`` holds what tests and benchmarks switch to force a code path (a kernel's config, a layout, one of
two equivalent launch sequences), and owns the Triton backend's caches (launch plans, tuned configs, compiled
launches), so that one ``options.clear()`` (or leaving ``options.override(...)``) forgets them all. Users never
need to touch it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Tuple


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    effect: str


ENVIRONMENT: Dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("DEFORMCONV_BACKEND", "", "Forces the backend of every op (`triton`, `cpu`, `reference`, or `auto`) "
                                      "where the call names none."),
    EnvVar("DEFORMCONV_AUTOTUNE", "0", "`1`: the first call at a new shape class times up to 4 candidate tile "
                                       "configs on the GPU and keeps the fastest, instead of the heuristic default."),
    EnvVar("DEFORMCONV_FAST_LAUNCH", "1", "`0`: every kernel launch goes through Triton's JIT call path instead of "
                                          "relaunching the compiled kernel directly."),
    EnvVar("DEFORMCONV_WORKSPACE_BUDGET", "", "The backward's scratch memory in multiples of the input's size "
                                              "(`inf`: the whole batch at once). Unset: 1.5, raised where a chunk "
                                              "would not fill the GPU."),
    EnvVar("DEFORMCONV_BACKWARD_STREAMS", "1", "`0`: grad_weight never runs on a side stream beside grad_input."),
    EnvVar("DEFORMCONV_COMPILE_KERNELS", "1", "`1`: torch.compile sees the Triton kernels (the op decomposes into "
                                              "them, launched from Inductor's code); `0`: the op stays opaque and "
                                              "runs its launchers at every call."),
)}


# The variables' raw values, looked up at every read without os.environ's per-key encoding and decoding (its
# underlying dict, where the platform has one): a call reads several, and they are on every call's host path.
_KEYS = tuple(ENVIRONMENT) + ("TRITON_INTERPRET",)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_ENV_DECODE = getattr(os.environ, "decodevalue", None)
_RAW_KEYS = {k: _ENV_ENCODE(k) for k in _KEYS} if None not in (_ENV_DATA, _ENV_ENCODE, _ENV_DECODE) else None


def _raw(name: str) -> str:
    if _RAW_KEYS is None:
        return os.environ.get(name, ENVIRONMENT[name].default if name in ENVIRONMENT else "")
    value = _ENV_DATA.get(_RAW_KEYS[name])
    if value is None:
        return ENVIRONMENT[name].default if name in ENVIRONMENT else ""
    return _ENV_DECODE(value)


def _flag(name: str) -> bool:
    return _raw(name) not in ("", "0")


def backend() -> Optional[str]:
    """DEFORMCONV_BACKEND, or None when unset or empty."""
    return _raw("DEFORMCONV_BACKEND") or None


def autotune() -> bool:
    return _flag("DEFORMCONV_AUTOTUNE")


def fast_launch() -> bool:
    return _flag("DEFORMCONV_FAST_LAUNCH")


def compile_kernels() -> bool:
    return _flag("DEFORMCONV_COMPILE_KERNELS")


def backward_streams() -> bool:
    return _raw("DEFORMCONV_BACKWARD_STREAMS") != "0"


def workspace_budget() -> Optional[float]:
    """DEFORMCONV_WORKSPACE_BUDGET as a number >= 0 (inf allowed), or None when unset."""
    text = _raw("DEFORMCONV_WORKSPACE_BUDGET")
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise ValueError(f"DEFORMCONV_WORKSPACE_BUDGET: expected a number >= 0 (a multiple of the input's size, "
                         f"or inf), got {text!r}")
    return value


def triton_interpret() -> bool:
    """Triton's own TRITON_INTERPRET: kernels run in its CPU interpreter."""
    return _raw("TRITON_INTERPRET") not in ("", "0")


class _TraceState(threading.local):
    on = False  # read at every launch: a class default, not getattr's


_trace_state = _TraceState()


def tracing() -> bool:
    """Whether the Triton backend's launchers are being traced into a graph (the compile route, ops/deform_conv2d/op.py)
    rather than run. Then every launch is recorded through ``torch.library.wrap_triton``, nothing is cached, data
    pointers are unknown (taken as 16-byte aligned: Inductor aligns what it allocates), and the choices that need
    a real call (autotuning, TMA descriptors, the backward's side stream) take their plain alternative."""
    return _trace_state.on


@contextlib.contextmanager
def traced() -> Iterator[None]:
    """The block's launches are traced (see :func:`tracing`)."""
    previous = tracing()
    _trace_state.on = True
    try:
        yield
    finally:
        _trace_state.on = previous


@dataclass
class Options:
    """Switches that force code paths, and the caches that depend on them. The defaults are the product's.

    Every field but ``caches`` may be set through :meth:`override`. Forcing fields (None: the heuristic decides):
    ``configs`` maps a kernel ("fwd", "bwd_data", "bwd_weight") to the one Config it must use (its split still
    follows the shape unless the Config sets one other than 1); ``tma``, ``per_image``, ``grouped_input`` and
    ``go_resident`` force those choices for every launch.
    """

    # Off: the path the product takes where the faster one does not apply (plain stores where runs do not fit, the
    # two passes of a channels-last input, one layout copy a launch, grad_weight through its finishing pass at more
    # than one split, a modulated layer's offset and mask split into copies), forced at shapes where it would not, so
    # that the tests compare both on the same inputs
    run_stores: bool = True              # the forward's vectorised NCHW stores
    fused_prep: bool = True              # the forward's weight pack and input copy in one launch
    paired_transposes: bool = True       # the backward's two layout copies in one launch
    direct_grad_weight: bool = True      # grad_weight stored by its kernel where one split makes it final
    mask_logits: bool = True             # a modulated layer's offset conv output read by the kernels as it is
    layout_kernels_on_cpu: bool = False  # the layout kernels under the interpreter too (else torch's copies)
    # tuning constants of the backward's schedule (configs.py and schedule.py say why)
    default_workspace_budget: float = 1.5
    min_chunk_programs: int = 512
    # kernel codegen spellings (compat.CodegenProfile); None: the one for the installed Triton
    profile: Any = None
    # forced choices
    configs: Dict[str, Any] = field(default_factory=dict)
    tma: Optional[bool] = None
    per_image: Optional[bool] = None
    grouped_input: Optional[bool] = None
    go_resident: Optional[bool] = None
    columns_grad_weight: Optional[bool] = None  # grad_weight through a column buffer and cuBLAS (True: wherever
                                                # usable; None: where columns.columns_usable's rule takes it)
    columns_grad_data: Optional[bool] = None  # grad_input/offset/mask through cuBLAS's grad_col rows (True: wherever
                                              # usable; None: where columns.grad_columns_usable's rule takes it)
    narrow_groups: Optional[bool] = None  # deform_conv2d's grouped calls through the N-d column kernels (True: every
                                          # grouped call; False: none; None: narrow_groups.py's rule)
    gather_tile: Optional[Tuple[int, int]] = None  # (elements, warps) of the gather kernels' programs (launch.py)
    preload_points: Optional[bool] = None  # a row's point parameters loaded for all its points first (None: where
                                           # they fit 16 columns; common/launch.py: preload_points)
    roi_spread: Optional[int] = None  # samples of a bin side by side in RoI pooling's forward spread tile (0: never;
                                      # None: roi_pool/triton/roi.py's BLOCK_S)
    roi_planes: Optional[int] = None  # channels the spread tile takes a pass (1, 2, 4; None: SPREAD_PLANES)
    caches: Dict[str, dict] = field(default_factory=dict, repr=False)

    def cache(self, name: str) -> dict:
        """The named cache (created empty on first use); emptied by clear(). While tracing (see
        :func:`tracing`), a fresh dict each time: nothing worked out for traced tensors is kept."""
        if tracing():
            return {}
        return self.caches.setdefault(name, {})

    def clear(self) -> None:
        """Forget every plan, tuned config and compiled launch."""
        for cache in self.caches.values():
            cache.clear()

    @contextlib.contextmanager
    def override(self, **changes) -> Iterator["Options"]:
        """Set fields for the duration of the block, with empty caches inside and after it."""
        names = {f.name for f in dataclasses.fields(self)} - {"caches"}
        unknown = set(changes) - names
        if unknown:
            raise TypeError(f"options.override: unknown option(s) {sorted(unknown)}; known: {sorted(names)}")
        saved = {k: getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        self.clear()
        try:
            yield self
        finally:
            for k, v in saved.items():
                setattr(self, k, v)
            self.clear()


options = Options()
