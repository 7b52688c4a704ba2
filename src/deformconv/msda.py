"""Multi-scale deformable attention (Deformable DETR) as a function with the reference's arguments, and the modules
of mmcv (``MultiScaleDeformableAttention``) and Deformable DETR (``MSDeformAttn``) with their keys. Semantics:
ops/msda/__init__.py."""

from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx
from torch import Tensor, nn

from . import config
from .checks import check_once, int_at_least, real_number
from .ops.common import dispatch
from .ops.common.eager import run_eager, run_planned
from .ops.common.launch import remember
from .ops.msda import op as _op  # noqa: F401  (registers torch.ops.deformconv.ms_deform_attn)


def _shape_error(name: str, want: str, t: Tensor) -> ValueError:
    return ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _check_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights) -> None:
    """ms_deform_attn's checks of types, shapes, dtypes and devices (checks.check_once runs them once a signature)."""
    if not isinstance(value, Tensor) or value.dim() != 4 or not value.is_floating_point():
        raise ValueError(f"value must be a floating-point tensor [N, S, M, D], got "
                         f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
    n, s, m, _ = value.shape
    for name, t in (("spatial_shapes", spatial_shapes), ("level_start_index", level_start_index)):
        if not isinstance(t, Tensor) or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 tensor, got "
                            f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
        if t.device != value.device:
            raise ValueError(f"{name} must be on value's device {value.device}, got {t.device}")
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise _shape_error("spatial_shapes", "[L, 2]", spatial_shapes)
    levels = spatial_shapes.shape[0]
    if tuple(level_start_index.shape) != (levels,):
        raise _shape_error("level_start_index", f"[{levels}]", level_start_index)
    if (not isinstance(sampling_locations, Tensor) or sampling_locations.dim() != 6
            or sampling_locations.shape[0] != n or sampling_locations.shape[2] != m
            or sampling_locations.shape[3] != levels or sampling_locations.shape[5] != 2):
        raise _shape_error("sampling_locations", f"[{n}, Lq, {m}, {levels}, P, 2]", sampling_locations)
    lq, points = sampling_locations.shape[1], sampling_locations.shape[4]
    if not isinstance(attention_weights, Tensor) or tuple(attention_weights.shape) != (n, lq, m, levels, points):
        raise _shape_error("attention_weights", f"[{n}, {lq}, {m}, {levels}, {points}]", attention_weights)
    _check_points(value, sampling_locations, attention_weights)


def _check_points(value: Tensor, sampling_locations: Tensor, attention_weights: Tensor) -> None:
    """The locations and weights: floating point, on value's device."""
    for name, t in (("sampling_locations", sampling_locations), ("attention_weights", attention_weights)):
        if not t.is_floating_point() or t.device != value.device:
            raise TypeError(f"{name} must be a floating-point tensor on value's device {value.device}, got {t.dtype} "
                            f"on {t.device}")


def ms_deform_attn(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
                   attention_weights: Tensor, im2col_step: int = 64, *, backend: Optional[str] = None) -> Tensor:
    r"""Multi-scale deformable attention: for each query and head, the attention-weighted sum over levels and points
    of the head's value map of that level sampled bilinearly at the point (``grid_sample(align_corners=False)``,
    zeros outside).

    Args:
        value (Tensor[N, S, M, D]): the levels' value maps flattened and concatenated, S = sum of H_l * W_l.
        spatial_shapes (Tensor[L, 2]): int64 (H_l, W_l).
        level_start_index (Tensor[L]): int64, where each level starts in S.
        sampling_locations (Tensor[N, Lq, M, L, P, 2]): (x, y), 0..1 across the level (outside allowed).
        attention_weights (Tensor[N, Lq, M, L, P]): (softmaxed over L*P by the caller).
        im2col_step (int): accepted for compatibility; any value works. Default: 64.
        backend (str, optional, keyword-only): ``"triton"``, ``"cpu"`` or ``"reference"``; ``None``: automatic.
            Default: ``None``.

    Returns:
        Tensor[N, Lq, M * D] in value's dtype. Gradients for value, sampling_locations and attention_weights. Under
        autocast the locations and weights keep their dtype (fp32), the value and output take the autocast dtype.

    With CUDA shape tensors their sizes are not read on the host (no sync): a level reaching past S samples nothing.

    Example::

        >>> import torch, deformconv
        >>> shapes = torch.tensor([[8, 10], [4, 5]])
        >>> starts = torch.tensor([0, 80])
        >>> value = torch.randn(2, 100, 8, 32)
        >>> loc, attn = torch.rand(2, 30, 8, 2, 4, 2), torch.rand(2, 30, 8, 2, 4).softmax(-1)
        >>> deformconv.ms_deform_attn(value, shapes, starts, loc, attn).shape
        torch.Size([2, 30, 256])
    """
    return _attention(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, True)


def _attention(value: Tensor, spatial_shapes: Tensor, level_start_index: Tensor, sampling_locations: Tensor,
               attention_weights: Tensor, backend: Optional[str], tile_value: bool) -> Tensor:
    """ms_deform_attn; tile_value: the levels must tile value's S pixels one after another (checked where the shape
    tensors are on the CPU), else they may overlap (ms_deform_attn_v2's levels of one point each)."""
    out = _planned(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend,
                   tile_value)
    if out is not None:
        return out
    check_once("ms_deform_attn", (value, spatial_shapes, level_start_index, sampling_locations, attention_weights),
               lambda: _check_args(value, spatial_shapes, level_start_index, sampling_locations, attention_weights))
    if tile_value and spatial_shapes.device.type == "cpu" and not torch.compiler.is_compiling():  # free to read
        _check_levels(spatial_shapes, level_start_index, value.shape[1])
    args = (value, spatial_shapes.to(torch.int64), level_start_index.to(torch.int64), sampling_locations,
            attention_weights, dispatch.backend_argument("ms_deform_attn", backend))
    out = run_eager(_op.msda_forward, _op.msda_backward, (0, 3, 4), args, keep=_op.KEEP)
    return out if out is not None else torch.ops.deformconv.ms_deform_attn(*args)


def _check_levels(spatial_shapes: Tensor, level_start_index: Tensor, s: int) -> None:
    """The levels' sizes against value's S pixels and their starts, where the shape tensors are on the CPU (read in
    Python: a few tensor ops would cost more than the kernels at small loads)."""
    shapes = spatial_shapes.tolist()
    sizes = [h * w for h, w in shapes]
    if any(h < 0 or w < 0 for h, w in shapes) or sum(sizes) != s:
        raise ValueError(f"spatial_shapes' levels must cover value's S = {s} pixels, got {shapes} ({sum(sizes)})")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if level_start_index.tolist() != starts:
        raise ValueError(f"level_start_index must be each level's start {starts}, got {level_start_index.tolist()}")


# --- per-level point counts (RT-DETRv2, D-FINE, DEIMv2) -------------------------------------------------------

METHODS = ("default", "discrete")


def ms_deform_attn_v2(value: Tensor, spatial_shapes, sampling_locations: Tensor, attention_weights: Tensor,
                      num_points_list: Sequence[int], method: str = "default", *,
                      level_start_index: Optional[Tensor] = None, backend: Optional[str] = None) -> Tensor:
    r"""Multi-scale deformable attention with a number of points of its own per level (RT-DETRv2's
    ``multi_scale_deformable_attention_v2``, with its arguments in its order).

    Args:
        value (Tensor[N, S, M, D]): the levels' value maps flattened and concatenated, S = sum of H_l * W_l.
        spatial_shapes (Tensor[L, 2] or sequence of (H_l, W_l)): the levels' sizes (int64 on value's device, or
            Python ints).
        sampling_locations (Tensor[N, Lq, M, T, 2]): (x, y), 0..1 across the point's level; T = sum of
            num_points_list, level 0's points first.
        attention_weights (Tensor[N, Lq, M, T]).
        num_points_list (sequence of int): P_l, the points of each level (each >= 1).
        method (str): ``"default"``: bilinear, zeros outside the level (``grid_sample(align_corners=False)``);
            ``"discrete"``: the nearest pixel, ``(x * W_l + 0.5)`` truncated to an int in the locations' dtype and
            clamped to the level, as transformers computes it (no gradient for the locations). Default: ``"default"``.
        level_start_index (Tensor[L], optional, keyword-only): where each level starts in S. Default: from
            spatial_shapes.
        backend (str, optional, keyword-only): as :func:`ms_deform_attn`'s, for ``"default"``; ``"discrete"`` is
            a gather of PyTorch's on every device. Default: ``None``.

    Returns:
        Tensor[N, Lq, M * D] in value's dtype.

    Example::

        >>> import torch, deformconv
        >>> value = torch.randn(2, 80 + 20, 8, 32)
        >>> loc, attn = torch.rand(2, 30, 8, 4 + 2, 2), torch.rand(2, 30, 8, 4 + 2).softmax(-1)
        >>> deformconv.ms_deform_attn_v2(value, [(8, 10), (4, 5)], loc, attn, [4, 2]).shape
        torch.Size([2, 30, 256])
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if not isinstance(value, Tensor) or value.dim() != 4:
        raise ValueError(f"value must be a tensor [N, S, M, D], got "
                         f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
    counts = tuple(int_at_least(p, f"num_points_list[{i}]") for i, p in enumerate(num_points_list))
    levels = _level_table(spatial_shapes, level_start_index, counts, value.device)
    n, _, m, d = value.shape
    t = sum(counts)
    if not isinstance(sampling_locations, Tensor) or sampling_locations.dim() != 5 or tuple(
            sampling_locations.shape[i] for i in (0, 2, 3, 4)) != (n, m, t, 2):
        raise _shape_error("sampling_locations", f"[{n}, Lq, {m}, {t}, 2]", sampling_locations)
    if levels.pixels is not None and levels.pixels != value.shape[1]:
        raise ValueError(f"spatial_shapes' levels must cover value's S = {value.shape[1]} pixels, got "
                         f"{[tuple(hw) for hw in levels.shapes.tolist()]} ({levels.pixels})")
    lq = sampling_locations.shape[1]
    if not isinstance(attention_weights, Tensor) or tuple(attention_weights.shape) != (n, lq, m, t):
        raise _shape_error("attention_weights", f"[{n}, {lq}, {m}, {t}]", attention_weights)
    _check_points(value, sampling_locations, attention_weights)
    if method == "discrete":
        return _discrete(value, sampling_locations, attention_weights, levels)
    if len(set(counts)) == 1:  # the same count at every level: the levels as they are
        p = counts[0]
        return _attention(value, levels.shapes, levels.starts, sampling_locations.reshape(n, lq, m, len(counts), p, 2),
                          attention_weights.reshape(n, lq, m, len(counts), p), backend, levels.pixels is None)
    # Every point its own level of one point (the level's size and start repeated): the same sums, point by point,
    # with nothing padded to the largest count.
    return _attention(value, levels.point_shapes, levels.point_starts, sampling_locations.reshape(n, lq, m, t, 1, 2),
                      attention_weights.reshape(n, lq, m, t, 1), backend, False)


class _Levels(NamedTuple):
    shapes: Tensor        # int64 [L, 2] on value's device
    starts: Tensor        # int64 [L]
    point_shapes: Tensor  # int64 [T, 2]: each point's level's (H, W)
    point_starts: Tensor  # int64 [T]
    pixels: Optional[int]  # S the Python sizes cover; None for the caller's tensor (checked as ms_deform_attn does)


_LEVEL_TABLES: Dict[tuple, object] = {}


def _kept(key: tuple, build):
    """build()'s result, built once a key and kept (constants: a copy to the GPU a call would cost more than the
    kernels); built afresh while torch.compile traces."""
    if torch.compiler.is_compiling():
        return build()
    found = _LEVEL_TABLES.get(key)
    return found if found is not None else remember(_LEVEL_TABLES, key, build())


def _point_levels(counts: Tuple[int, ...]) -> list:
    """Each point's level, level 0's points first."""
    return [lvl for lvl, p in enumerate(counts) for _ in range(p)]


def _level_table(spatial_shapes, level_start_index: Optional[Tensor], counts: Tuple[int, ...],
                 device: torch.device) -> _Levels:
    """The levels as tensors on value's device: the caller's tensors indexed per point, or, from Python sizes, built
    once a (sizes, counts, device) and kept."""
    if isinstance(spatial_shapes, Tensor):
        if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] != len(counts):
            raise _shape_error("spatial_shapes", f"[{len(counts)}, 2] (a level a count of num_points_list)",
                               spatial_shapes)
        shapes = spatial_shapes.to(device=device, dtype=torch.int64)
        if level_start_index is None:
            sizes = shapes[:, 0] * shapes[:, 1]
            level_start_index = sizes.cumsum(0) - sizes
        starts = level_start_index.to(device=device, dtype=torch.int64)
        per_point = _kept(("level of each point", counts, device),
                          lambda: torch.tensor(_point_levels(counts), device=device))
        return _Levels(shapes, starts, shapes[per_point], starts[per_point], None)
    try:
        sizes = tuple((int(h), int(w)) for h, w in spatial_shapes)
    except (TypeError, ValueError):
        raise TypeError(f"spatial_shapes must be a tensor [L, 2] or a sequence of (H, W) pairs, got "
                        f"{spatial_shapes!r}") from None
    if len(sizes) != len(counts):
        raise ValueError(f"num_points_list must have a count per level ({len(sizes)}), got {list(counts)}")

    def build() -> _Levels:
        starts = [sum(h * w for h, w in sizes[:i]) for i in range(len(sizes))]
        point = _point_levels(counts)
        return _Levels(torch.tensor(sizes, dtype=torch.int64, device=device),
                       torch.tensor(starts, dtype=torch.int64, device=device),
                       torch.tensor([sizes[i] for i in point], dtype=torch.int64, device=device).reshape(-1, 2),
                       torch.tensor([starts[i] for i in point], dtype=torch.int64, device=device),
                       sum(h * w for h, w in sizes))

    return _kept((sizes, counts, device), build)


def _discrete(value: Tensor, loc: Tensor, attn: Tensor, levels: _Levels) -> Tensor:
    """The discrete method: each point reads the one pixel (x·W + 0.5, y·H + 0.5) truncated to ints, in the locations'
    dtype, and clamped to its level (transformers' arithmetic); the attention-weighted sum over points."""
    n, s, m, d = value.shape
    lq, t = loc.shape[1], loc.shape[3]
    wh = levels.point_shapes.flip(-1)  # [T, 2]: (W, H), int64: the product takes the locations' dtype
    xy = (loc.detach() * wh + 0.5).to(torch.int64)
    x = torch.minimum(xy[..., 0].clamp_min(0), wh[:, 0] - 1)
    y = torch.minimum(xy[..., 1].clamp_min(0), wh[:, 1] - 1)
    pixel = levels.point_starts + y * wh[:, 0] + x  # [N, Lq, M, T]
    index = pixel.permute(0, 2, 1, 3).reshape(n, m, lq * t, 1).expand(n, m, lq * t, d)
    # Gathered from fp32: the same values, and the gather's backward sums the points that share a pixel in fp32
    # (in a 16-bit value each addition would round, and the atomics' order would change the result).
    source = value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    sampled = torch.gather(source.permute(0, 2, 1, 3), 2, index).view(n, m, lq, t, d)
    out = (sampled * attn.permute(0, 2, 1, 3)[..., None]).sum(3)  # [N, M, Lq, D]
    return out.permute(0, 2, 1, 3).reshape(n, lq, m * d).to(value.dtype)


def _planned(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, backend, tile_value):
    """ms_deform_attn through its call signature's Call of the Triton kernels (ops/msda/triton.py; eager.run_planned),
    or None where the call takes the general path (eager.run_planned says when; also shape tensors not int64, empty
    inputs, another backend). The locations and weights keep their dtype under autocast, as the op's rule has it."""
    if backend is not None and type(backend) is not str:
        return None
    tensors = [value, spatial_shapes, level_start_index, sampling_locations, attention_weights]
    levels = None
    if tile_value and isinstance(spatial_shapes, Tensor) and spatial_shapes.is_cpu:  # contents: read at every call
        levels = lambda: _check_levels(spatial_shapes, level_start_index, value.shape[1])  # noqa: E731
    return run_planned("msda_eager", tensors, (backend, config.backend()), lambda t: _new_call(t, backend),
                       keep=_op.KEEP, each_call=levels)


def _new_call(tensors, backend):
    """_planned's Call for a new signature (its checks run here: bad input raises), or None: the general path."""
    _check_args(*tensors)
    value, shapes, starts, loc, _ = tensors
    if (shapes.dtype != torch.int64 or starts.dtype != torch.int64 or value.numel() == 0 or loc.numel() == 0
            or dispatch.chosen_backend("ms_deform_attn", value.device, value.dtype,
                                       dispatch.backend_argument("ms_deform_attn", backend)) != "triton"):
        return None
    from .ops.msda import triton as kernels

    return kernels.call_for(*tensors)


# --- modules -------------------------------------------------------------------------------------------


def _init_sampling(sampling_offsets: nn.Linear, attention_weights: nn.Linear, value_proj: nn.Linear,
                   output_proj: nn.Linear, heads: int, levels: int, points: int) -> None:
    """The published initialisation: offsets start on a ring of directions (one per head, point i at i + 1 times
    it), attention uniform, the projections Xavier-uniform with zero biases."""
    nn.init.zeros_(sampling_offsets.weight)
    thetas = torch.arange(heads, dtype=torch.float32) * (2.0 * math.pi / heads)
    grid = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(heads, 1, 1, 2).repeat(1, levels, points, 1)
    for i in range(points):
        grid[:, :, i, :] *= i + 1
    with torch.no_grad():
        sampling_offsets.bias.copy_(grid.view(-1))
    nn.init.zeros_(attention_weights.weight)
    nn.init.zeros_(attention_weights.bias)
    for proj in (value_proj, output_proj):
        nn.init.xavier_uniform_(proj.weight)
        nn.init.zeros_(proj.bias)


def _check_shape(name: str, t: Tensor, want: tuple, layout: str, broadcasts: bool = False) -> None:
    """t's dimensions against want (None: any size; with broadcasts, 1 too, as the attention's arithmetic
    broadcasts reference points and the padding mask); layout names them."""
    if not isinstance(t, Tensor) or t.dim() != len(want) or any(
            w is not None and w != g and not (broadcasts and g == 1) for w, g in zip(want, t.shape)):
        got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        sizes = ", ".join("*" if w is None else str(w) for w in want)
        raise ValueError(f"{name} must be {layout}, here [{sizes}], got {got}")


def _attend(module, query: Tensor, value: Tensor, reference_points: Tensor, spatial_shapes: Tensor,
            level_start_index: Tensor, padding_mask: Optional[Tensor], batch_first: bool = True,
            names: Tuple[str, str, str] = ("value", "reference_points", "key_padding_mask")) -> Tensor:
    """The attention shared by both modules: [N, Lq, C] queries, [N, S, C] values -> [N, Lq, C]; without
    batch_first, [Lq, N, C] and [S, N, C] -> [Lq, N, C]. names: the caller's names of value, reference_points and
    padding_mask, for its errors."""
    heads, levels, points = module._heads, module._levels, module._points
    c_query, c_value = module.sampling_offsets.in_features, module.value_proj.in_features
    if batch_first:
        _check_shape("query", query, (None, None, c_query), "[N, Lq, C]")
        _check_shape(names[0], value, (query.shape[0], None, c_value), "[N, S, C]")
    else:
        _check_shape("query", query, (None, None, c_query), "[Lq, N, C] (batch_first=False)")
        _check_shape(names[0], value, (None, query.shape[1], c_value), "[S, N, C] (batch_first=False)")
        query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
    n, lq, s = query.shape[0], query.shape[1], value.shape[1]
    _check_shape(names[1], reference_points, (n, lq, levels, None), "[N, Lq, levels, 2 or 4]", broadcasts=True)
    if padding_mask is not None:
        _check_shape(names[2], padding_mask, (n, s), "[N, S]", broadcasts=True)
    value = module.value_proj(value)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(n, s, heads, value.shape[-1] // heads)  # not -1: an empty batch views too
    offsets = module.sampling_offsets(query).view(n, lq, heads, levels, points, 2)
    attn = module.attention_weights(query).view(n, lq, heads, levels * points).softmax(-1)
    attn = attn.view(n, lq, heads, levels, points)
    loc = _locations(reference_points, offsets, spatial_shapes, points)
    out = module.output_proj(ms_deform_attn(value, spatial_shapes, level_start_index, loc, attn, module.im2col_step))
    return out if batch_first else out.permute(1, 0, 2)


def _locations(reference_points: Tensor, offsets: Tensor, spatial_shapes: Tensor, points: int) -> Tensor:
    """The sampling locations [N, Lq, M, L, P, 2]: reference points [N, Lq, L, 2] moved by the offsets in pixels of
    each level, or box centres [N, Lq, L, 4] (cx, cy, w, h) moved by the offsets / P times half the box's size."""
    if reference_points.shape[-1] == 2:
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
        return reference_points[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
    if reference_points.shape[-1] == 4:
        return (reference_points[:, :, None, :, None, :2]
                + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
    raise ValueError(f"reference_points' last dim must be 2 or 4, got {reference_points.shape[-1]}")


# torch.fx traces the modules through; these run as one call each when the traced module runs (they branch on sizes,
# which symbolic tracing cannot read), the op as one call.
torch.fx.wrap("_check_shape")
torch.fx.wrap("_locations")
torch.fx.wrap("ms_deform_attn")


class MultiScaleDeformableAttention(nn.Module):
    r"""mmcv's ``MultiScaleDeformableAttention``: its constructor arguments, initialisation, state_dict keys
    (``sampling_offsets``, ``attention_weights``, ``value_proj``, ``output_proj``) and forward; the attention on
    :func:`ms_deform_attn` (every device, bf16 and fp16 too).

    Args:
        embed_dims (int): Default: 256. num_heads (int): Default: 8. num_levels (int): Default: 4.
        num_points (int): Default: 4. im2col_step (int): Default: 64 (any works).
        dropout (float): on the output before the residual. Default: 0.1.
        batch_first (bool): queries and values [N, L, C] (else [L, N, C]). Default: ``False``.
        norm_cfg, init_cfg: accepted and unused (mmcv's config plumbing). Default: ``None``.
        value_proj_ratio (float): value_proj's width over embed_dims. Default: 1.0.

    Example::

        >>> import torch, deformconv
        >>> attn = deformconv.MultiScaleDeformableAttention(64, num_heads=4, num_levels=2, batch_first=True)
        >>> shapes, starts = torch.tensor([[8, 10], [4, 5]]), torch.tensor([0, 80])
        >>> q, v, ref = torch.randn(2, 30, 64), torch.randn(2, 100, 64), torch.rand(2, 30, 2, 2)
        >>> attn(q, value=v, reference_points=ref, spatial_shapes=shapes, level_start_index=starts).shape
        torch.Size([2, 30, 64])
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_levels: int = 4, num_points: int = 4,
                 im2col_step: int = 64, dropout: float = 0.1, batch_first: bool = False, norm_cfg=None,
                 init_cfg=None, value_proj_ratio: float = 1.0):
        super().__init__()
        embed_dims, num_heads = int_at_least(embed_dims, "embed_dims"), int_at_least(num_heads, "num_heads")
        num_levels, num_points = int_at_least(num_levels, "num_levels"), int_at_least(num_points, "num_points")
        im2col_step = int_at_least(im2col_step, "im2col_step")
        if not 0.0 <= real_number(dropout, "dropout") <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
        real_number(value_proj_ratio, "value_proj_ratio", positive=True)
        if embed_dims % num_heads != 0:
            raise ValueError(f"embed_dims must be divisible by num_heads, got {embed_dims} and {num_heads}")
        value_size = int(embed_dims * value_proj_ratio)
        if value_size <= 0 or value_size % num_heads != 0:
            raise ValueError(f"embed_dims * value_proj_ratio ({value_size}) must be divisible by num_heads "
                             f"({num_heads})")
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self._heads, self._levels, self._points = num_heads, num_levels, num_points
        self.im2col_step, self.batch_first, self.norm_cfg = im2col_step, batch_first, norm_cfg
        self.dropout = nn.Dropout(dropout)
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        self.value_proj = nn.Linear(embed_dims, value_size)
        self.output_proj = nn.Linear(value_size, embed_dims)
        self.init_weights()

    def init_weights(self) -> None:
        _init_sampling(self.sampling_offsets, self.attention_weights, self.value_proj, self.output_proj,
                       self.num_heads, self.num_levels, self.num_points)

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                identity: Optional[Tensor] = None, query_pos: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, reference_points: Optional[Tensor] = None,
                spatial_shapes: Optional[Tensor] = None, level_start_index: Optional[Tensor] = None,
                **kwargs) -> Tensor:
        """query [Lq, N, C] ([N, Lq, C] if batch_first); value likewise (default: query); reference_points
        [N, Lq, L, 2] (points) or [N, Lq, L, 4] (boxes: cx, cy, w, h); key_padding_mask [N, S] (True: padding).
        Returns dropout(attention) + identity (default: query), in query's layout."""
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        out = _attend(self, query, value, reference_points, spatial_shapes, level_start_index, key_padding_mask,
                      self.batch_first)
        return self.dropout(out) + identity


class MSDeformAttn(nn.Module):
    r"""Deformable DETR's ``MSDeformAttn``: its constructor arguments, initialisation, state_dict keys and forward;
    the attention on :func:`ms_deform_attn`.

    Args:
        d_model (int): Default: 256. n_levels (int): Default: 4. n_heads (int): Default: 8. n_points (int): Default: 4.

    Example::

        >>> import torch, deformconv
        >>> attn = deformconv.MSDeformAttn(64, n_levels=2, n_heads=4)
        >>> shapes, starts = torch.tensor([[8, 10], [4, 5]]), torch.tensor([0, 80])
        >>> q, x, ref = torch.randn(2, 30, 64), torch.randn(2, 100, 64), torch.rand(2, 30, 2, 2)
        >>> attn(q, ref, x, shapes, starts).shape
        torch.Size([2, 30, 64])
    """

    def __init__(self, d_model: int = 256, n_levels: int = 4, n_heads: int = 8, n_points: int = 4):
        super().__init__()
        d_model, n_heads = int_at_least(d_model, "d_model"), int_at_least(n_heads, "n_heads")
        n_levels, n_points = int_at_least(n_levels, "n_levels"), int_at_least(n_points, "n_points")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be divisible by n_heads, but got {d_model} and {n_heads}")
        self.im2col_step = 64
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self._heads, self._levels, self._points = n_heads, n_levels, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        _init_sampling(self.sampling_offsets, self.attention_weights, self.value_proj, self.output_proj,
                       self.n_heads, self.n_levels, self.n_points)

    def forward(self, query: Tensor, reference_points: Tensor, input_flatten: Tensor, input_spatial_shapes: Tensor,
                input_level_start_index: Tensor, input_padding_mask: Optional[Tensor] = None) -> Tensor:
        """query [N, Lq, C]; reference_points [N, Lq, L, 2] or [N, Lq, L, 4]; input_flatten [N, S, C];
        input_padding_mask [N, S] (True: padding). Returns [N, Lq, C]."""
        return _attend(self, query, input_flatten, reference_points, input_spatial_shapes, input_level_start_index,
                       input_padding_mask, names=("input_flatten", "reference_points", "input_padding_mask"))
