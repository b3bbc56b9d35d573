"""The anchor ``theta_0`` of proximal regularization and of the linearized model: a copy of the
trainable parameters, taken once, or read from a file.

A copy is exact (``clone``, same dtype), so a run resumed from a checkpoint that stored it
continues with the bitwise same anchor. Names are the raw ``named_parameters()`` names of the
module the callbacks see (the LightningModule), which is also what its ``state_dict`` uses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["snapshot", "load_anchor", "check_anchor", "check_anchor_arg", "trainable"]


def trainable(model: nn.Module, who: str) -> dict[str, nn.Parameter]:
    """``{raw name: parameter}`` with ``requires_grad`` (shared parameters once), or a clear error."""
    out, seen = {}, set()
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out[n] = p
    if not out:
        raise ValueError(
            f"{who}: {type(model).__name__} has no trainable parameters (every requires_grad is False), so there "
            "is nothing to anchor; unfreeze the layers to fine-tune (or the LoRA adapters) before fit"
        )
    return out


@torch.no_grad()
def check_anchor_arg(anchor: Any) -> str:
    """An ``anchor=`` argument (``"fit_start"`` or a path) as text, or a one-line ValueError."""
    if not isinstance(anchor, (str, os.PathLike)) or not str(anchor):
        raise ValueError(f"anchor must be 'fit_start' or the path of a checkpoint / state dict, got {anchor!r}")
    return os.fspath(anchor)


def snapshot(params: Mapping[str, Tensor], offload: bool = False) -> dict[str, Tensor]:
    """An exact copy of ``params`` (on CPU with ``offload``, else on each parameter's device)."""
    return {n: (p.detach().to("cpu", copy=True) if offload else p.detach().clone()) for n, p in params.items()}


def check_anchor(anchor: Mapping[str, Tensor], params: Mapping[str, Tensor], source: str) -> None:
    """ValueError naming the first parameter the anchor lacks or has in another shape."""
    for n, p in params.items():
        if n not in anchor:
            some = ", ".join(list(anchor)[:3]) or "nothing"
            raise ValueError(f"the anchor from {source} does not fit this model: it has no {n!r} (it holds {some}, "
                             "...); anchor the same model, with the same parameters trainable")
        if tuple(anchor[n].shape) != tuple(p.shape):
            raise ValueError(f"the anchor from {source} does not fit this model: {n!r} has shape "
                             f"{tuple(anchor[n].shape)} there and {tuple(p.shape)} here")


def load_anchor(path: str | os.PathLike, params: Mapping[str, Tensor], offload: bool = False) -> dict[str, Tensor]:
    """``theta_0`` for ``params`` from a file: a plain state dict or a Lightning checkpoint (its
    ``state_dict``), loaded with ``weights_only=True``; checked name by name and shape by shape,
    put in each parameter's dtype and (unless ``offload``) device."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"anchor file {path!r} does not exist; pass anchor='fit_start' or the path of a "
                                "checkpoint or state dict of this model")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    state = blob.get("state_dict", blob) if isinstance(blob, Mapping) else None
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"anchor file {path!r} holds no state dict ({{name: tensor}}, or a checkpoint with one)")
    check_anchor(state, params, repr(path))
    return {n: state[n].to(device="cpu" if offload else p.device, dtype=p.dtype, copy=True) for n, p in params.items()}
