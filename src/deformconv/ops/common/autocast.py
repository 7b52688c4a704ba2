"""The ops' autocast rule, one for all: under autocast an op runs natively in the autocast dtype (float16 or
bfloat16), every floating input other than float64 (and those an op keeps, such as coordinates) cast to it.
torch.library.register_autocast fixes one dtype at registration; this rule reads the active one."""

from __future__ import annotations

import torch
from torch import Tensor

_lib = torch.library.Library("deformconv", "FRAGMENT")


def autocast_inputs(args, device_type: str, keep=()) -> list:
    """args with every floating tensor on device_type, other than float64 and those at the indices in keep, cast to
    the active autocast dtype."""
    dtype = torch.get_autocast_dtype(device_type)

    def cast(v):
        if (isinstance(v, Tensor) and v.is_floating_point() and v.device.type == device_type
                and v.dtype != torch.float64):
            return v.to(dtype)
        return v

    return [a if i in keep else cast(a) for i, a in enumerate(args)]


def register_autocast(name: str, keep=()) -> None:
    """Op ``deformconv::name``'s autocast rule on CUDA and CPU: its inputs cast by autocast_inputs (keep: indices of
    arguments that stay as they come), then the op with autocast off."""
    op = getattr(torch.ops.deformconv, name).default
    for device_type in ("cuda", "cpu"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.__members__[key])

        def kernel(_keyset, *args, device_type=device_type, excluded=excluded):
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return op(*autocast_inputs(args, device_type, keep))

        _lib.impl(name, kernel, key, with_keyset=True)
