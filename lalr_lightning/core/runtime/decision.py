"""One decision of a layer-wise callback, as plain data.

Its own module so that both the decision cycle (:mod:`lalr_lightning.callbacks.base`) and the
dashboards that show decisions (:mod:`lalr_lightning.dashboards`) import it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Decision"]


@dataclass
class Decision:
    """One decision of a callback, as rank zero made it."""

    values: dict[str, float]  # the decision per layer: multiplier, selected (0/1) or ratio
    scores: dict[str, float] = field(default_factory=dict)  # the measurement it was made from
    measurements: dict[str, dict[str, float]] = field(default_factory=dict)  # other per-layer numbers
    record: dict[str, Any] = field(default_factory=dict)  # more history fields (phase, level, ...)
    summary: dict[str, float] = field(default_factory=dict)  # model-wide numbers: <prefix>/<key>
    payload: Any = None  # what is not a number per layer (pruning masks)
