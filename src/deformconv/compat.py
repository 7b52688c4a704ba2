"""Triton and torch version differences, in one place.

Feature detection where a feature can be probed (host-side TMA descriptors); otherwise one named
:class:`CodegenProfile` per Triton whose code generation differs, passed to the kernels as constexpr arguments
(never read from globals inside a kernel). docs/tuning.md has the measurements behind each spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import triton

from .config import options

try:  # host-side TMA descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: every tile is read through pointers
    TensorDescriptor = None


def triton_version() -> Tuple[int, int]:
    """(major, minor) of the Triton in use: "3.8.0" or "3.8.0+git1234" -> (3, 8)."""
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


# --- torch's tracing of custom ops (the compile route, library.py) -------------------------------------------


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
