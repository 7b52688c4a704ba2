"""deformconv as the multi-scale deformable attention of Hugging Face transformers' models.

transformers computes multi-scale deformable attention as a Python loop of one ``grid_sample`` per level, written in
three shapes; :func:`patch` routes each to deformconv's op (:func:`deformconv.ms_deform_attn`, or
:func:`deformconv.ms_deform_attn_v2` where the levels have points of their own count):

- the module ``MultiScaleDeformableAttention``, ``forward(value, value_spatial_shapes, value_spatial_shapes_list,
  level_start_index, sampling_locations, attention_weights, im2col_step)``: deformable_detr, rt_detr, grounding_dino,
  mm_grounding_dino, omdet_turbo, lw_detr, rf_detr, pp_doclayout_v2, pp_doclayout_v3, pp_doclayout_v4 (transformers
  5.23). patch replaces the instance's ``forward``.
- the function ``multi_scale_deformable_attention_v2(value, spatial_shapes, sampling_locations, attention_weights,
  num_points_list, method)`` called by a module global: rt_detr_v2. patch replaces the calling module's ``forward``
  by the same code reading deformconv's function under another global name (the module's globals otherwise as they
  are); kept on the instance as ``ms_deformable_attn_core``: d_fine, deimv2, where patch replaces the attribute.
- the function ``multi_scale_deformable_attention(value, spatial_shapes, sampling_locations, attention_weights)``
  called by a module global in the pixel decoder: mask2former, oneformer; as rt_detr_v2's.

Sites are found by what the code is, not by the model's name: a module of that class name whose ``forward`` takes
those arguments, a module whose ``forward`` calls one of those functions of transformers' by a global name, a module
holding one as ``ms_deformable_attn_core``. A model family added later in the same shapes is taken as it is.

:func:`enable` does the same for the classes and module globals themselves, so that models built afterwards (inside
a pipeline, ``Trainer`` or someone else's ``from_pretrained``) run on deformconv too.

transformers is never imported by ``import deformconv``; this module imports nothing of it either, until
:func:`enable` imports the model families' modules it patches.
"""

from __future__ import annotations

import dis
import importlib
import inspect
import sys
import types
import warnings
from typing import Callable, Dict, List, Optional, Tuple

from torch import Tensor, nn

from ..msda import ms_deform_attn, ms_deform_attn_v2

TESTED_VERSIONS = ("5.23.0",)

# transformers' model families with multi-scale deformable attention (enable() imports their modeling modules)
FAMILIES = ("deformable_detr", "rt_detr", "rt_detr_v2", "d_fine", "deimv2", "grounding_dino", "mm_grounding_dino",
            "omdet_turbo", "lw_detr", "rf_detr", "pp_doclayout_v2", "pp_doclayout_v3", "pp_doclayout_v4",
            "mask2former", "oneformer")

MODULE_CLASS = "MultiScaleDeformableAttention"
MODULE_PARAMS = ("self", "value", "value_spatial_shapes", "value_spatial_shapes_list", "level_start_index",
                 "sampling_locations", "attention_weights", "im2col_step")
FUNCTIONS = ("multi_scale_deformable_attention", "multi_scale_deformable_attention_v2")
CORE_ATTRIBUTE = "ms_deformable_attn_core"
LOOKED_FOR = (f"a module {MODULE_CLASS} with forward{MODULE_PARAMS[1:]}, a module whose forward calls "
              f"transformers' {' or '.join(FUNCTIONS)}, or a module with {CORE_ATTRIBUTE}")

_BACKEND_KEY = "_deformconv_backend"
_ORIGINAL_CORE_KEY = "_deformconv_original_core"


# --- deformconv's replacements ---------------------------------------------------------------------------


def _module_forward(self, value: Tensor, value_spatial_shapes: Tensor, value_spatial_shapes_list,
                    level_start_index: Tensor, sampling_locations: Tensor, attention_weights: Tensor,
                    im2col_step: int) -> Tensor:
    """MultiScaleDeformableAttention.forward on deformconv: [N, Lq, M·D]."""
    backend = self.__dict__.get(_BACKEND_KEY, _ENABLED["backend"])
    return ms_deform_attn(value, value_spatial_shapes, level_start_index, sampling_locations, attention_weights,
                          im2col_step, backend=backend)


_module_forward.__deformconv__ = True
_FUNCTIONS: Dict[Tuple[str, Optional[str]], Callable] = {}


def _function(name: str, backend: Optional[str]) -> Callable:
    """deformconv's replacement for transformers' function ``name``, with its signature (one per name and backend)."""
    key = (name, backend)
    if key in _FUNCTIONS:
        return _FUNCTIONS[key]
    if name == "multi_scale_deformable_attention_v2":
        def fn(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list, method="default"):
            return ms_deform_attn_v2(value, value_spatial_shapes, sampling_locations, attention_weights,
                                     num_points_list, method, backend=backend)
    else:
        def fn(value, value_spatial_shapes, sampling_locations, attention_weights):
            n, lq, m, levels, points, _ = sampling_locations.shape
            return ms_deform_attn_v2(value, value_spatial_shapes, sampling_locations.reshape(n, lq, m, -1, 2),
                                     attention_weights.reshape(n, lq, m, levels * points), [points] * levels,
                                     backend=backend)
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__deformconv__ = True
    _FUNCTIONS[key] = fn
    return fn


def _ours(obj) -> bool:
    return bool(getattr(obj, "__deformconv__", False))


# --- finding the sites -----------------------------------------------------------------------------------


def _transformers_function(obj) -> Optional[str]:
    """The name of transformers' attention function obj is (or deformconv's replacement of it), else None."""
    if not isinstance(obj, types.FunctionType) or obj.__name__ not in FUNCTIONS:
        return None
    return obj.__name__ if _ours(obj) or obj.__module__.startswith("transformers.") else None


_SITES: Dict[type, Optional[tuple]] = {}


def _class_site(cls: type) -> Optional[tuple]:
    """("module",) for a MultiScaleDeformableAttention class, ("global", global name, function name) for a class
    whose forward calls one of the functions by a global name, else None (kept a class)."""
    if cls in _SITES:
        return _SITES[cls]
    site = None
    forward = getattr(cls, "forward", None)
    if cls.__name__ == MODULE_CLASS and isinstance(forward, types.FunctionType):
        try:
            params = tuple(inspect.signature(forward).parameters)
        except (TypeError, ValueError):
            params = ()
        if params == MODULE_PARAMS:
            site = ("module",)
    elif isinstance(forward, types.FunctionType) and cls.__module__.startswith("transformers."):
        for name in forward.__code__.co_names:
            function = _transformers_function(forward.__globals__.get(name))
            if function is not None and _only_global(forward.__code__, name):
                site = ("global", name, function)
                break
    _SITES[cls] = site
    return site


def _core_site(module: nn.Module) -> Optional[str]:
    """The function name of the attention function a module keeps as ms_deformable_attn_core, else None."""
    return _transformers_function(module.__dict__.get(CORE_ATTRIBUTE))


def _only_global(code: types.CodeType, name: str) -> bool:
    """Whether code reads ``name`` only as a global (co_names also holds attribute names)."""
    uses = [i.opname for i in dis.get_instructions(code) if i.argval == name and i.opname != "LOAD_CONST"]
    return bool(uses) and all(op == "LOAD_GLOBAL" for op in uses)


def _rebound(forward: types.FunctionType, name: str, replacement: Callable) -> types.FunctionType:
    """forward reading deformconv's replacement where it read the global ``name``: the same code with that one name
    changed to one of deformconv's, set in the same module's globals beside transformers' function (which other models
    keep). The module's own globals, not a copy: torch.compile keeps its compiled code there."""
    alias = f"__deformconv_{replacement.__name__}_{id(replacement):x}"
    forward.__globals__[alias] = replacement
    code = forward.__code__.replace(co_names=tuple(alias if n == name else n for n in forward.__code__.co_names))
    fn = types.FunctionType(code, forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    fn.__qualname__, fn.__doc__, fn.__module__ = forward.__qualname__, forward.__doc__, forward.__module__
    fn.__deformconv__ = True
    return fn


# --- patch and unpatch -----------------------------------------------------------------------------------


def _patch_one(module: nn.Module, backend: Optional[str]) -> bool:
    """Route one module's attention to deformconv; False where it has none."""
    site = _class_site(type(module))
    core = _core_site(module)
    if site is None and core is None:
        return False
    if site is not None and site[0] == "module":
        module.__dict__[_BACKEND_KEY] = backend
        module.forward = types.MethodType(_module_forward, module)
    elif site is not None:
        _, name, function = site
        module.forward = types.MethodType(_rebound(type(module).forward, name, _function(function, backend)), module)
    if core is not None:
        current = module.__dict__[CORE_ATTRIBUTE]
        if not _ours(current):
            module.__dict__[_ORIGINAL_CORE_KEY] = current
        module.__dict__[CORE_ATTRIBUTE] = _function(core, backend)
    return True


def _unpatch_one(module: nn.Module) -> None:
    """Give one module transformers' attention back (nothing where patch had not changed it)."""
    forward = module.__dict__.get("forward")
    if forward is not None and _ours(getattr(forward, "__func__", None)):
        del module.__dict__["forward"]
        module.__dict__.pop(_BACKEND_KEY, None)
    if _ORIGINAL_CORE_KEY in module.__dict__:
        module.__dict__[CORE_ATTRIBUTE] = module.__dict__.pop(_ORIGINAL_CORE_KEY)


def _runs_ours(module: nn.Module) -> bool:
    """Whether module's attention runs on deformconv: patched, or replaced by enable() where transformers defines it
    (the class's forward, the module global its forward calls)."""
    if _ours(module.__dict__.get(CORE_ATTRIBUTE)):
        return True
    site = _class_site(type(module))
    if site is None:
        return False
    forward = module.__dict__.get("forward", type(module).forward)
    if _ours(getattr(forward, "__func__", forward)):
        return True
    return site[0] == "global" and _ours(type(module).forward.__globals__.get(site[1]))


def patch(model: nn.Module, *, backend: Optional[str] = None) -> nn.Module:
    r"""Run every multi-scale deformable attention inside a transformers model on deformconv, in place.

    Idempotent (a second call changes only the backend); :func:`unpatch` undoes it. The state_dict, the parameters
    and everything else of the model stay as they are.

    Args:
        model (nn.Module): a transformers model (or any module holding one).
        backend (str, optional, keyword-only): as :func:`deformconv.ms_deform_attn`'s. Default: ``None`` (automatic).

    Returns:
        model, patched. A model with nothing to patch gets a warning naming what was looked for.

    Example::

        >>> from transformers import DeformableDetrForObjectDetection  # doctest: +SKIP
        >>> from deformconv.integrations.transformers import patch  # doctest: +SKIP
        >>> name = "SenseTime/deformable-detr"
        >>> model = patch(DeformableDetrForObjectDetection.from_pretrained(name))  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    found = sum(_patch_one(m, backend) for m in model.modules())
    if not found:
        warnings.warn(f"deformconv: nothing to patch in {type(model).__name__}: looked for {LOOKED_FOR}",
                      stacklevel=2)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo :func:`patch`: every module of model back on transformers' own attention. Returns model."""
    for m in model.modules():
        _unpatch_one(m)
    return model


def patched(model: nn.Module) -> List[str]:
    """The names of model's modules that run their attention on deformconv (patched, or built while enabled)."""
    return [name for name, m in model.named_modules() if _runs_ours(m)]


# --- enable and disable: models built afterwards --------------------------------------------------------------

_ENABLED: Dict[str, object] = {"backend": None, "saved": None}


def enable(*, backend: Optional[str] = None) -> None:
    """Run the multi-scale deformable attention of every transformers model on deformconv, including models built
    afterwards: the attention classes' ``forward`` and the modules' attention functions are replaced where transformers
    defines them (each family's modeling module is imported here). :func:`disable` restores them.

    Args:
        backend (str, optional, keyword-only): as :func:`deformconv.ms_deform_attn`'s. Default: ``None``.
    """
    if _ENABLED["saved"] is not None:
        disable()
    saved: List[tuple] = []
    for family in FAMILIES:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:  # an older transformers without this family, or one of its optional needs missing
            continue
        for name, obj in list(vars(module).items()):
            function = _transformers_function(obj)
            if function is not None and not _ours(obj):
                saved.append((module, name, obj))
                setattr(module, name, _function(function, backend))
            elif isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__:
                if _class_site(obj) == ("module",) and not _ours(obj.forward):
                    saved.append((obj, "forward", obj.forward))
                    obj.forward = _module_forward
    _ENABLED["backend"], _ENABLED["saved"] = backend, saved


def disable() -> None:
    """Undo :func:`enable`: transformers' classes and functions as they were. Models patched one by one stay
    patched."""
    for owner, name, original in reversed(_ENABLED["saved"] or []):
        setattr(owner, name, original)
    _ENABLED["backend"], _ENABLED["saved"] = None, None


def enabled() -> bool:
    """Whether :func:`enable` is in force."""
    return _ENABLED["saved"] is not None


def transformers_version() -> Optional[str]:
    """The installed transformers' version, or None; read without importing it."""
    module = sys.modules.get("transformers")
    if module is not None:
        return getattr(module, "__version__", None)
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:
        return None
