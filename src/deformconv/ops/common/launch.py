"""Launch machinery shared by the Triton kernels: plans, direct relaunch, TMA checks, config choice.

A launch plan is worked out once per call signature (shapes, strides, dtypes, flags, pointer alignment) and
kept in a cache of ``config.options``; later calls relaunch the compiled kernels directly (:class:`Launch`).
At small shapes the Python that derives a plan, and Triton's own per-call argument handling, cost as much as
the kernels themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Sequence, Tuple

import torch
from torch import Tensor

from ... import config
from ...compat import TensorDescriptor, conv_tf32, direct_launcher, launch_hooks_set
from ...config import options


# Host-side integer helpers in plain Python: Triton's own (triton.cdiv, triton.next_power_of_2) are constexpr
# functions in newer Tritons, whose Python call costs about 2 microseconds, and launchers call them at every call.
def ceil_div(a: int, b: int) -> int:
    """triton.cdiv's value."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """triton.next_power_of_2's value: the power of two at or above x (0 for 0)."""
    return 1 << (x - 1).bit_length() if x > 0 else 0


def pow2_clamp(x: int, lo: int, hi: int) -> int:
    """The power of two at or above x, clamped to [lo, hi] (plain Python: channel_sum calls it every call)."""
    return max(lo, min(hi, next_pow2(max(1, x))))


def unique_configs(cands: list) -> list:
    """The candidates without repeats, in order."""
    return list(dict.fromkeys(cands))


def aligned16(t: Tensor) -> bool:
    """Whether t's data starts on a 16-byte boundary (Triton specialises each pointer argument on it). A traced
    tensor has no address yet: taken as aligned, as Inductor allocates (config.tracing)."""
    return config.tracing() or t.data_ptr() % 16 == 0


def pointer_specs(tensors: Sequence[Tensor]) -> tuple:
    """Each tensor's (dtype, aligned16): what Triton specialises a pointer argument on, so every plan key that fixes a
    compiled launch holds it; one check of config.tracing for them all (plan keys read several a call)."""
    if config.tracing():
        return tuple([(t.dtype, True) for t in tensors])
    return tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])


def gather_tile(default: Tuple[int, int]) -> Tuple[int, int]:
    """(elements, warps) of a program of a gather kernel (DCNv3/DCNv4, attention, RoI pooling): how many
    (position, channel) elements its tile holds, and its warps. options.gather_tile where a benchmark forces one,
    else the family's default (docs/tuning.md: chosen by the registers each compiles to)."""
    return options.gather_tile or default


def preload_points(points: int) -> bool:
    """Whether a gather kernel loads a row's point parameters for all its points first (common/sampling.py:
    row_points): where the points fit one 16-column tile, unless options.preload_points says otherwise
    (docs/tuning.md has the times: DCNv3/DCNv4 and attention)."""
    fits = points <= 16
    return fits if options.preload_points is None else bool(options.preload_points) and fits


def channel_row_blocks(channels: int, default: Tuple[int, int]) -> Tuple[int, int, int]:
    """(BLOCK rows, BLOCK_D, warps) of a gather kernel whose program holds every channel of its rows (positions,
    queries): BLOCK_D the power of two at or above channels, and rows filling the tile (gather_tile), 4 to 128."""
    elements, warps = gather_tile(default)
    block_d = next_pow2(max(channels, 1))
    return max(4, min(128, elements // block_d)), block_d, warps


def backward_warps(warps: int, fixed: bool) -> int:
    """A gather kernel's backward warps: twice the tile's in deterministic mode, whose int64 fixed-point scatters
    take the registers of twice the elements a thread (201-255 a thread at the forward's share, 116-192 at half)."""
    return warps * 2 if fixed else warps


def on_device_of(t: Tensor):
    """Triton launches on the *current* CUDA device: a context making it the tensor's (as a C++ op's device guard
    does), else a call on cuda:1 while cuda:0 is current would launch with foreign pointers. Nothing to enter where
    it is current already, or for traced launches (the compiled code guards its device itself)."""
    if t.is_cuda and not config.tracing():
        index = t.get_device()
        if index != torch.cuda.current_device():
            return torch.cuda.device(index)
    return contextlib.nullcontext()


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use TF32 exactly where F.conv2d would (compat.conv_tf32), else full fp32."""
    if dtype == torch.float32 and not conv_tf32():
        return "ieee"
    return "tf32"


# Entries a plan cache holds before it starts afresh: a bound on memory for programs that see endless shapes.
MAX_PLANS = 512


def remember(cache: dict, key: tuple, value):
    """cache[key] = value, the cache emptied first when it holds MAX_PLANS entries."""
    if len(cache) >= MAX_PLANS:
        cache.clear()
    cache[key] = value
    return value


def memoized(memo, slot: str, make):
    """memo[slot], made by make() on first use; make() alone where there is no memo. A memo is a dict kept by a
    caller that knows the call signature already (ops/deform_conv2d/triton/call.py): what a launcher found for it by its
    own key (a plan, a Launch) is held there, so that later calls build no key."""
    if memo is None:
        return make()
    found = memo.get(slot)
    if found is None:
        found = memo[slot] = make()
    return found


class Launch:
    """One kernel launch of a plan: grid, runtime arguments and constexprs fixed, tensors given per call.

    The first call goes through Triton's JIT (compiling if needed). Later calls hand the tensors straight to
    the compiled kernel's C launcher (compat.direct_launcher), skipping Triton's per-call argument binding,
    specialisation, cache lookup and launch bookkeeping (tens of microseconds of Python a launch). That is valid
    because the plan key fixes everything Triton specialises on: the integer arguments, the dtypes and each
    pointer's alignment. Under the interpreter, with DEFORMCONV_FAST_LAUNCH=0, or while a Triton launch hook is set
    (a profiler's), every call goes through the JIT."""

    def __init__(self, fn, grid: tuple, args: tuple, meta: dict):
        self.fn, self.args, self.meta = fn, args, meta
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # the compiled launcher wants all 3 grid dims
        self.runner = None  # compat.direct_launcher's, after the first call
        self.tail: tuple = ()
        self.fast = config.fast_launch()

    def __call__(self, *tensors: Tensor) -> None:
        if config.tracing():  # recorded into the graph; the compiled code launches it (config.tracing)
            torch.library.wrap_triton(self.fn)[self.grid](*tensors, *self.args, **self.traced_meta())
            return
        if self.runner is not None and not launch_hooks_set():
            try:
                self.runner(self.grid, *tensors, *self.args, *self.tail)
                return
            except (TypeError, IndexError, ValueError):  # raised before launching: this Triton's launcher
                self.runner, self.fast = None, False     # wants other arguments; stay on the JIT path
        compiled = self.fn[self.grid](*tensors, *self.args, **self.meta)
        if self.fast:
            # the launcher takes every parameter in signature order, constexprs included
            names = self.fn.arg_names[len(tensors) + len(self.args):]
            self.tail = tuple(self.meta[n] for n in names)
            self.runner = direct_launcher(compiled)

    def traced_meta(self) -> dict:
        """The meta arguments as a traced launch passes them: without a register cap (maxnreg), which Inductor's
        launch of a user kernel has no place for (the kernel is compiled without it: more registers, same result)."""
        return {k: v for k, v in self.meta.items() if k != "maxnreg"}


def run_cached(fn, grid: tuple, tensors: Sequence[Tensor], args: tuple, meta: dict) -> None:
    """fn[grid](*tensors, *args, **meta) through a Launch kept for exactly this call signature: the grid, every
    runtime argument and meta-parameter, and each tensor's dtype, device and 16-byte alignment (all that Triton
    specialises on). Later calls relaunch the compiled kernel directly (Launch). For the kernels whose plans are this
    simple (one launch a call, no config choice)."""
    # meta in its insertion order (each call site builds it the same way): no sort on the per-call path
    key = (fn, tuple(grid), tuple(args), tuple(meta.items()), tuple([t.device for t in tensors]),
           pointer_specs(tensors))
    cache = options.cache("launches")
    run = cache.get(key)
    if run is None:
        run = remember(cache, key, Launch(fn, grid, args, meta))
    run(*tensors)


def tma_supported(device: torch.device) -> bool:
    """Whether the kernels can read tiles through TMA descriptors on this device (Config.tma): a GPU of compute
    capability 9.0 or later (the Tensor Memory Accelerator), or the CPU, where Triton's interpreter emulates them;
    and a Triton with host-side descriptors."""
    if TensorDescriptor is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def tma_possible(dtype: torch.dtype, even_k: bool, row_bytes: int, device: torch.device) -> bool:
    """Whether tiles of an operand with rows of row_bytes (its channels) can come through TMA descriptors at all: the
    dtype is fp16, bf16 or fp32 (not float64), channel chunks are whole (EVEN_K: a weight tile past a segment's end
    would read the next segment's weights, and a non-finite weight there would leak into this one's result), rows a
    multiple of 16 bytes, and the device has TMA (tma_supported). tma_launch adds the checks of the tensors' memory;
    the candidates use it to know in advance where TMA will be taken. Never while tracing (config.tracing): a
    descriptor is built from a real tensor."""
    return (dtype in (torch.float16, torch.bfloat16, torch.float32) and even_k and row_bytes % 16 == 0
            and not config.tracing() and tma_supported(device))


def tma_launch(cfg, dtype: torch.dtype, even_k: bool, operands: Sequence[Tuple[Tensor, int]]) -> bool:
    """Whether a launch of cfg reads its tiles through TMA descriptors: the config asks for it, each operand (tensor,
    elements a row: channels) passes tma_possible, and TMA can address its memory: non-empty, a 16-byte-aligned
    base, fewer than 2**31 rows (int32 tile coordinates)."""
    return cfg.tma and all(tma_possible(dtype, even_k, row * t.element_size(), t.device) and t.numel() > 0
                           and aligned16(t) and t.numel() // row < 2**31 for t, row in operands)


# Shared memory a block may use on the GPU the tile configs were chosen on (an H100/H200: 227 KiB). A GPU with less
# may not fit the default tile (e.g. grad_weight's fp32 256-column tile takes 105 KiB; an RTX 3090/4090 or L4 has 99).
TUNED_SHARED_MEMORY = 232448


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory a block may use on device (the opt-in maximum)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", TUNED_SHARED_MEMORY)


def pick_config(key: tuple, candidates: list, launch, device: torch.device):
    """The heuristic default for this call's shape (candidates[0]); with DEFORMCONV_AUTOTUNE=1 on CUDA, the
    fastest candidate, timed once per shape class and cached: a later shape of the class takes the tuned tile
    with its own split (splits follow the exact number of positions). On a GPU with less shared memory than the one
    the defaults were chosen on, the first candidate that launches (a tile that does not fit is passed over).
    ``launch`` must be safe to repeat (the caller re-initialises any accumulator after the choice). A
    candidate must beat the default by 5% to replace it. chosen_configs() records each class's first choice."""
    tuned_configs = options.cache("tuned")
    timed = config.autotune() and len(candidates) > 1
    if (device.type != "cuda" or config.tracing()
            or not timed and shared_memory_per_block(device) >= TUNED_SHARED_MEMORY
            or torch.cuda.is_current_stream_capturing()):
        tuned_configs.setdefault(key, candidates[0])
        return candidates[0]
    if key in tuned_configs:
        tuned = tuned_configs[key]
        return next((c for c in candidates if dataclasses.replace(c, split=tuned.split) == tuned), tuned)
    if not timed:
        tuned_configs[key] = best = _first_that_fits(candidates, launch)
        return best
    from triton.testing import do_bench

    times = {}
    for cfg in candidates:
        try:
            launch(cfg)  # compile and warm the clocks before timing
            times[cfg] = do_bench(lambda: launch(cfg), warmup=10, rep=30, return_mode="median")
        except Exception:  # a candidate that does not fit this GPU (e.g. out of shared memory)
            continue
    best = candidates[0]
    for cfg, ms in times.items():
        if ms < 0.95 * times.get(best, float("inf")):
            best = cfg
    tuned_configs[key] = best
    return best


def _first_that_fits(candidates: list, launch):
    """The first candidate whose kernel this GPU can run (each is launched once; Triton raises OutOfResources before
    launching one that needs more shared memory or registers than the GPU has)."""
    from triton.runtime.errors import OutOfResources

    errors = []
    for cfg in candidates:
        try:
            launch(cfg)
            return cfg
        except OutOfResources as e:
            errors.append(f"{cfg}: {e}")
    raise RuntimeError("deformconv: no tile config of this kernel fits this GPU:\n" + "\n".join(errors))


def chosen_configs() -> Dict[tuple, object]:
    """The config in use for each shape class seen so far (for benchmarks and bug reports)."""
    return dict(options.cache("tuned"))
