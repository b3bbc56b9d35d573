"""The selection's own model summary: Lightning draws its summary (``Trainable params``) when the
fit starts, before a switching selection (LISA, LIFT) has frozen anything, so after a selection
decides it states what trains, in one line::

    BlockSchedule: trainable 82.4 K of 156 K parameters (52.7%), 4 of 6 blocks

Counted on this process's module: a parameter trains when an optimizer holds it and neither the
selection nor anyone else froze it (``LayerSelection.trains``); under FSDP the counts are this
rank's shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["human_count", "selection_counts", "selection_summary"]


class _Selection(Protocol):
    """What the counts read of a ``LayerSelection`` (callbacks/selection.py, which imports this
    module: the type is spelled here so that the two do not import each other)."""

    _module: torch.nn.Module | None
    block_names: Sequence[str]
    layers: Sequence[Any]
    selected: Any

    def trains(self, p: torch.nn.Parameter) -> bool: ...

    def selected_blocks(self) -> list[str]: ...


def selection_counts(cb: _Selection) -> dict[str, int | str]:
    """``trainable``, ``frozen`` and ``total`` parameters of the callback's module now, and the
    ``selected`` of ``units`` blocks (``kind``; layers where the selection has no blocks)."""
    params = {id(p): p for p in cb._module.parameters()} if cb._module is not None else {}
    # a lazy parameter (nn.LazyLinear before its first forward) has no size yet: left out
    params = {k: p for k, p in params.items() if not isinstance(p, torch.nn.parameter.UninitializedParameter)}
    trainable = sum(p.numel() for p in params.values() if cb.trains(p))
    total = sum(p.numel() for p in params.values())
    units = cb.block_names or [u.name for u in cb.layers]
    selected = cb.selected_blocks() if cb.block_names else list(cb.selected)
    return {"trainable": trainable, "frozen": total - trainable, "total": total,
            "selected": len(selected), "units": len(units), "kind": "blocks" if cb.block_names else "layers"}


def human_count(n: int) -> str:
    """A parameter count as Lightning's summary shows one (``950``, ``82.4 K``, ``156 K``, ``6.7 B``):
    thousands-groups, one decimal below 100 of the unit, whole units from 100 on."""
    if n < 1000:
        return f"{n:d}"
    groups = min((len(str(n)) + 2) // 3, 5)  # 4 digits -> K ... 13 and more -> T
    value, unit = n / 1000 ** (groups - 1), "KMBT"[groups - 2]
    return f"{value:,.1f} {unit}" if value < 100 else f"{int(value):,d} {unit}"


def selection_summary(who: str, c: dict[str, int | str]) -> str:
    """The one line (module docstring) of :func:`selection_counts`' ``c``."""
    share = 100.0 * c["trainable"] / c["total"] if c["total"] else 0.0
    return (f"{who}: trainable {human_count(c['trainable'])} of {human_count(c['total'])} "
            f"parameters ({share:.1f}%), {c['selected']} of {c['units']} {c['kind']}")
