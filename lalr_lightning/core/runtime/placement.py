"""Tensors a method keeps beside a parameter (a pruning mask, the anchor ``theta_0``) live where
the parameter lives *when they are used*.

Lightning moves the model after the callbacks made their tensors: to the accelerator during
setup, back to the CPU at teardown (before ``on_fit_end``), and a user may re-cast it
(``module.double()``, bf16-true). A ``Module.to`` keeps each ``Parameter`` object and swaps its
data, so a kept tensor is re-homed lazily, at its next use, by comparing it with its parameter:
one move per change of place, nothing per step otherwise.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, MutableMapping

import torch
from torch import Tensor

__all__ = ["follow", "placed"]


def placed(kept: Tensor, param: Tensor, *, device: bool = True, dtype: bool = True) -> Tensor:
    """``kept`` on ``param``'s device and in its dtype (``device=False``: where it is, e.g. an
    anchor offloaded to the CPU; ``dtype=False``: its own dtype, e.g. a bool mask). The same
    tensor when nothing differs."""
    to_device = param.device if device and kept.device != param.device else None
    to_dtype = param.dtype if dtype and kept.dtype != param.dtype else None
    if to_device is None and to_dtype is None:
        return kept
    return kept.to(device=to_device or kept.device, dtype=to_dtype or kept.dtype)


@torch.no_grad()
def follow(
    kept: MutableMapping[Hashable, Tensor],
    params: Mapping[Hashable, Tensor],
    *,
    device: bool = True,
    dtype: bool = True,
) -> MutableMapping[Hashable, Tensor]:
    """Re-home every ``kept[k]`` to ``params[k]`` in place (:func:`placed`); returns ``kept``.
    Keys without a parameter are left alone."""
    for k, t in kept.items():
        p = params.get(k)
        if p is not None:
            moved = placed(t, p, device=device, dtype=dtype)
            if moved is not t:
                kept[k] = moved
    return kept
