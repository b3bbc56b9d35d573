"""One decision of a layer-wise callback, as plain data.

Its own module so that both the decision cycle (:mod:`lalr_lightning.callbacks.base`) and the
dashboards that show decisions (:mod:`lalr_lightning.dashboards`) import it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Decision", "history_table"]


@dataclass
class Decision:
    """One decision of a callback, as rank zero made it."""

    values: dict[str, float]  # the decision per layer: multiplier, selected (0/1) or ratio
    scores: dict[str, float] = field(default_factory=dict)  # the measurement it was made from
    measurements: dict[str, dict[str, float]] = field(default_factory=dict)  # other per-layer numbers
    record: dict[str, Any] = field(default_factory=dict)  # more history fields (phase, level, ...)
    summary: dict[str, float] = field(default_factory=dict)  # model-wide numbers: <prefix>/<key>
    payload: Any = None  # what is not a number per layer (pruning masks)

    def metrics(self, prefix: str, score_key: str, decision_key: str) -> dict[str, float]:
        """``<prefix>/<quantity>/<layer>`` for the scores (``score_key``), the measurements and the
        decision (``decision_key``), and ``<prefix>/<key>`` for the summary: what is logged."""
        out = {f"{prefix}/{score_key}/{k}": v for k, v in self.scores.items()}
        for quantity, values in self.measurements.items():
            out.update({f"{prefix}/{quantity}/{k}": v for k, v in values.items()})
        out.update({f"{prefix}/{decision_key}/{k}": v for k, v in self.values.items()})
        out.update({f"{prefix}/{k}": v for k, v in self.summary.items()})
        return out


def history_table(history: list[dict], attr: str) -> tuple[list[str], Any]:
    """(row labels, layers x history entries array) of the decisions under ``attr`` in ``history``
    (NaN where an entry lacks a layer): the fit-end heatmap's data."""
    import numpy as np

    names: list[str] = []
    for h in history:
        names += [n for n in h[attr] if n not in names]
    return names, np.array([[h[attr].get(n, np.nan) for h in history] for n in names], dtype=float)
