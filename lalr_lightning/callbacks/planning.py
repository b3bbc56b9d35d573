"""The decision without a fit: ``callback.plan(model)`` runs a callback's ``configure``,
``measure`` and ``decide`` on a copy of it, with a stand-in for the trainer (one process, no
optimizer, no data), and returns the decision as a table (``docs/naming.md``).

:meth:`~lalr_lightning.callbacks.base.LayerwiseCallback.plan` calls :func:`plan` (imported when
asked, so reading a method loads neither pandas nor this); the callbacks whose decision needs the
model's weights alone set ``decides_from_weights = True``.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from lalr_lightning.callbacks.host import Host
from lalr_lightning.core.runtime.checks import DivergenceError
from lalr_lightning.core.runtime.decision import Decision

__all__ = ["plan"]


class _Missing:
    """Reading any attribute is a clear error: the callback asked a fit for it in :func:`plan`."""

    def __init__(self, who: str, path: str):
        self._who, self._path = who, path

    def __getattr__(self, attr: str) -> Any:  # only for what the class and __init__ do not set
        if attr.startswith("__"):  # Python's own protocol lookups (copy, pickle): plainly absent
            raise AttributeError(attr)
        raise ValueError(
            f"{self._who}.plan() decides from the model's weights alone, but with these settings it reads "
            f"{self._path}.{attr}, which only a fit has; run a fit and read the callback's decision instead"
        )


class _NoFit(_Missing):
    """What :func:`plan` hands to ``configure`` and ``measure`` in place of a
    Trainer: one process, at the start of training, and nothing else (no optimizer, no data, no
    logger). Its ``sharding`` tells ``measure_shards`` the weights are whole."""

    world_size, global_rank, is_global_zero, sharding, sharded = 1, 0, True, "none", False
    current_epoch, global_step, max_epochs, has_data = 0, 0, None, False

    def __init__(self, who: str):
        super().__init__(who, "trainer")
        self.strategy = _Missing(who, "trainer.strategy")

    controls = Host.controls  # as every host: it reads ``optimizers``, which only a fit has (the error names it)


def _planners(root: type) -> list[str]:
    """The callback classes under ``root`` that have a decision without a fit (:func:`plan`)."""
    out, todo = [], list(root.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo += cls.__subclasses__()
        if cls.traits.decides_from_weights and cls.__name__ not in out:
            out.append(cls.__name__)
    return sorted(out)


def plan(method: Any, model: torch.nn.Module, root: type) -> pd.DataFrame:
    """The decision ``method`` would make next for ``model`` -- for a fresh callback, the one it
    makes at the start of a fit -- from the weights alone: no Trainer, no data (``root``: the base
    of every method, whose subclasses the error for a method that cannot plan lists).

    One row per layer it decides about: ``layer``, what the method's ``plan_columns()`` adds
    (Spectrum's module ``type``), the score (``alpha``, ``metric``, ``snr``), the other
    measurements (LALR's ``svd``, ``ce``, ``cs``) and the decision (``multiplier``, ``ratio``,
    ``selected``); ``attrs`` holds the model-wide numbers (``summary``) and the history fields
    (``record``: LALR's ``phase``). The model and the callback are left as they were: no
    ``requires_grad`` change, no mask, no optimizer, nothing logged, no history entry. Callbacks
    that decide from anything else (data, the fit's progress), or whose settings need the fit's
    optimizer, raise a ``ValueError`` saying so. A method whose ``decide`` does more than decide
    (HTSRPruning's masks) gives the decision alone with ``plan_decision(measured)``.
    """
    who = type(method).__name__
    if not method.traits.decides_from_weights:
        how = ("decides from the training data (it measures on batches during the fit)" if method.traits.measures == "data"
               else "does not decide from the model's weights alone (it reads data, follows the fit or applies "
                    "its settings)")
        raise ValueError(
            f"{who} {how}, so it has no decision without a fit; run a fit and read its "
            f"decision (scores, history). plan() is for the callbacks that decide from the weights alone: "
            f"{', '.join(_planners(root))}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{who}.plan() takes the model (a torch.nn.Module), got {type(model).__name__}")
    probe = _probe(method)
    context = _NoFit(who)
    try:
        with torch.no_grad():
            probe.configure(context, model)
            measured = probe.measure(context, model)
            decide = getattr(probe, "plan_decision", None) or probe.decide
            decision = decide(measured)
    except DivergenceError as err:  # nothing was trained: the model came this way
        shown = ", ".join(err.layers[:5]) + (", ..." if len(err.layers) > 5 else "")
        raise ValueError(f"{who}.plan(): {err.what} of {shown} hold NaN or Inf in the model as given (nothing "
                         "has been trained); check the checkpoint or the code that built the model") from None
    return _plan_frame(probe, decision)


def _plan_frame(method: Any, decision: Decision) -> pd.DataFrame:
    """One decision as a table: the rows and columns :func:`plan` describes."""
    layers = list(decision.values) + [n for n in decision.scores if n not in decision.values]
    columns = {"layer": layers}
    own = getattr(method, "plan_columns", None)
    for key, values in (own() if own is not None else {}).items():
        columns[key] = [values.get(n) for n in layers]
    if decision.scores:
        columns[method.traits.score_key] = [decision.scores.get(n, math.nan) for n in layers]
    for quantity, values in decision.measurements.items():
        if quantity not in columns:
            columns[quantity] = [values.get(n, math.nan) for n in layers]
    columns[method.traits.decision_key] = [decision.values.get(n, math.nan) for n in layers]
    frame = pd.DataFrame(columns)
    frame.attrs.update({"callback": type(method).__name__, "summary": dict(decision.summary),
                        "record": dict(decision.record)})
    return frame


def _probe(method: Any) -> Any:
    """A shallow copy to plan with: ``configure`` and ``measure`` set attributes on it, not on the
    method (which may be about to fit, or hold a finished fit's state); a runner of its own."""
    probe = object.__new__(type(method))
    probe.__dict__.update({k: v for k, v in method.__dict__.items() if k != "_runner"})
    return probe
