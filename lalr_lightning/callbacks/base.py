"""The decision cycle every layer-wise callback shares.

A callback says *when* it decides (its Lightning hooks and cadence) and *what*: ``measure()``
(per-layer numbers from the weights or the data) and ``decide()`` (per-layer decisions from
them), then ``apply()`` (hand the decision to :class:`~lalr_lightning.core.control.LayerControl`).
This class does the rest, the same way for all of them:

1. measure -- on rank zero when the numbers come from the weights (identical on every rank),
   on every rank when they come from data (the subclass reduces them);
2. decide on rank zero and broadcast, so ranks cannot drift apart (an error raised there is
   raised on every rank, so none waits forever);
3. store the decision, append it to a bounded ``history``, apply it;
4. log every per-layer number as ``<prefix>/<quantity>/<layer>``, and a layers x decisions
   heatmap at fit end;
5. keep it all in a versioned ``state_dict`` that knows it was restored and refuses a
   checkpoint written with other settings (naming the setting; ``strict_resume=False`` opts out).

The constructor convention (as scikit-learn's): every constructor argument is kept under its
own name, so ``settings()`` can read them back for the checkpoint check and for loggers.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import tempfile
import uuid
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from lightning.pytorch.callbacks import Callback

from lalr_lightning.core.control import LayerControl
from lalr_lightning.core.decision import Decision
from lalr_lightning.core.errors import DivergenceError
from lalr_lightning.core.layers import Layer
from lalr_lightning.core.shards import assign_shares, gather_objects, whole_weights

__all__ = ["Decision", "LayerwiseCallback", "SettingsMismatchError", "check_strategy", "renamed", "stop_on_sigterm",
           "warn_deprecated"]


#: settings of what is logged only: a resumed run may change them
_LOGGING_SETTINGS = ("plot_every_n_epochs",)


class SettingsMismatchError(ValueError):
    """A checkpoint's callback state was written with other settings than this callback's."""


def check_strategy(trainer: pl.Trainer, who: str, *, fsdp: bool = False) -> None:
    """Raise a clear error for strategies whose parameter handling the callback cannot follow."""
    name = type(trainer.strategy).__name__
    if "DeepSpeed" in name:
        raise RuntimeError(
            f"{who} works on the optimizer's parameter groups and whole parameters, which DeepSpeed "
            "owns and partitions; use strategy='ddp' (or 'fsdp' where supported)"
        )
    if "FSDP" in name and not fsdp:
        raise RuntimeError(f"{who} reads whole weight matrices, which FSDP shards across ranks; use strategy='ddp'")


def stop_on_sigterm(trainer: pl.Trainer):
    """A check for long measurements to call between chunks of work: it raises Lightning's
    ``SIGTERMException`` once the trainer received SIGTERM (Lightning's handler only sets a flag,
    which its loops read between batches; a measurement in a hook would otherwise run to its end).
    Ctrl-C needs nothing: ``KeyboardInterrupt`` is raised between the chunks."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    return check


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside this package, so that
    Python's default filters show it in the user's own script (``__main__``)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


class renamed:  # noqa: N801 -- used like ``property``
    """A deprecated attribute name, kept for one release: reading it warns and reads ``new``
    (``alphas = renamed("scores")``)."""

    def __init__(self, new: str):
        self.new = new
        self.old = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        warn_deprecated(f"{type(obj).__name__}.{self.old} is deprecated and will be removed in the next release; "
                        f"use .{self.new}")
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.old} is a deprecated, read-only name of .{self.new}")


def _plain(value: Any) -> Any:
    """A setting as plain Python (checkpoints load with ``weights_only=True``; loggers take it)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


class _Missing:
    """Reading any attribute is a clear error: the callback asked a fit for it in :meth:`plan`."""

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
    """What :meth:`LayerwiseCallback.plan` hands to ``configure`` and ``measure`` in place of a
    Trainer: one process, at the start of training, and nothing else (no optimizer, no data, no
    logger). Its strategy's type name tells ``measure_shards`` the weights are whole."""

    world_size, global_rank, is_global_zero = 1, 0, True
    current_epoch, global_step = 0, 0

    def __init__(self, who: str):
        super().__init__(who, "trainer")
        self.strategy = _Missing(who, "trainer.strategy")


def _planners() -> list[str]:
    """The callback classes that have a decision without a fit (:meth:`LayerwiseCallback.plan`)."""
    out, todo = [], [LayerwiseCallback]
    while todo:
        cls = todo.pop(0)
        todo += cls.__subclasses__()
        if cls.decides_from_weights and cls.__name__ not in out:
            out.append(cls.__name__)
    return sorted(out)


class LayerwiseCallback(Callback):
    """Base of every callback of this package (module docstring: the cycle it owns).

    Subclasses set the class attributes below, call ``super().__init__(name=..., strict_resume=...)``
    and implement ``measure``, ``decide`` and ``apply``; ``_state`` / ``_load_state`` carry
    anything else a resumed run needs.
    """

    log_prefix: ClassVar[str] = "layerwise"
    #: the attribute holding the per-layer decision (``multipliers``, ``selected``, ``ratios``)
    decision_attr: ClassVar[str] = "multipliers"
    #: its per-layer log quantity (``<prefix>/<decision_key>/<layer>``)
    decision_key: ClassVar[str] = "multiplier"
    #: the log quantity of ``scores`` (``alpha``, ``rgn``, ``j_hat``, ...)
    score_key: ClassVar[str] = "score"
    #: what ``measure`` reads (it runs on every rank): ``"weights"`` (shared out among the ranks
    #: with :meth:`measure_shards`) or ``"data"`` (each rank its own batches, then reduced)
    measures: ClassVar[str] = "weights"
    #: whether ``configure`` + ``measure`` + ``decide`` need the model's weights alone (and change
    #: nothing): then :meth:`plan` gives the decision without a fit
    decides_from_weights: ClassVar[bool] = False
    #: heatmap of the decisions at fit end: (key under the prefix, title, colour-bar label)
    heatmap: ClassVar[tuple[str, str, str] | None] = None
    #: the fewest history entries worth a heatmap
    heatmap_min_entries: ClassVar[int] = 2
    #: whether it changes learning rates (then ``lr_eff/<layer>`` is logged every logging step)
    logs_lr: ClassVar[bool] = True
    #: settings that may differ between the run that wrote a checkpoint and the one resuming
    volatile_settings: ClassVar[tuple[str, ...]] = ()
    #: deprecated constructor argument -> the argument that replaces it (kept for one release)
    deprecated: ClassVar[dict[str, str]] = {}
    state_version: ClassVar[int] = 1
    #: at most this many history entries are kept (and checkpointed), the newest
    history_limit: ClassVar[int] = 1000
    #: attributes a user reads after ``fit``; brought back to the main process after ddp_spawn
    readable: ClassVar[tuple[str, ...]] = ("scores", "measurements", "history")

    def __init__(self, *, name: str | None = None, strict_resume: bool = True):
        super().__init__()
        self.plot_every_n_epochs: int | None = None  # set by the subclass's constructor (__init_subclass__)
        self.name = name
        self.strict_resume = bool(strict_resume)
        self.layers: list[Layer] = []
        self.scores: dict[str, float] = {}
        self.measurements: dict[str, dict[str, float]] = {}
        self.history: list[dict] = []
        self.restored = False
        self._sizes: dict[str, int] | None = None
        self._handoff: str | None = None
        self._handoff_pending = False

    # ------------------------------------------------------------------ identity

    @property
    def state_key(self) -> str:
        # several instances of one callback keep separate state when given different names
        return f"{type(self).__name__}" + (f"[{self.name}]" if self.name else "")

    @property
    def prefix(self) -> str:
        return self.name or self.log_prefix

    def settings(self) -> dict[str, Any]:
        """The constructor settings (plain Python), as stored in checkpoints and logger configs."""
        out = {}
        for arg, p in inspect.signature(type(self).__init__).parameters.items():
            if arg in ("self", "name", "strict_resume") or arg in self.deprecated:
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            out[arg] = _plain(getattr(self, arg))
        return out

    @staticmethod
    def _alias(value: Any, old_value: Any, old: str, new: str, default: Any = None) -> Any:
        """Resolve a deprecated argument: warn, and use it unless the new one was given too."""
        if old_value is None:
            return value
        warn_deprecated(f"{old}= is deprecated and will be removed in the next release; use {new}=")
        if value is not None and value != default:
            raise ValueError(f"give {new}= or the deprecated {old}=, not both")
        return old_value

    def reject(self, mode_arg: str, mode: str, given: Mapping[str, Any], valid: Mapping[str, Iterable[str]]) -> None:
        """ValueError for arguments given (not None) that the chosen mode does not use, listing
        which arguments go with which mode."""
        allowed = set(valid.get(mode, ()))
        stray = sorted(k for k, v in given.items() if v is not None and k not in allowed)
        if stray:
            combos = "; ".join(f"{mode_arg}={m!r}: {', '.join(sorted(a)) or '(none)'}" for m, a in valid.items())
            raise ValueError(
                f"{type(self).__name__}({mode_arg}={mode!r}) does not use {', '.join(stray)}; the arguments "
                f"each {mode_arg} takes are: {combos}"
            )

    # ------------------------------------------------------------------ the cycle

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """Per-layer numbers for ``decide`` (see ``measures`` for where it runs)."""
        return None

    def decide(self, measured: Any) -> Decision:
        """The decision from what ``measure`` returned (rank zero only; keep it pure)."""
        raise NotImplementedError

    def apply(self, trainer: pl.Trainer) -> dict | None:
        """Hand the current decision to the layer control; may return fields for the history
        entry (what the decision achieved, e.g. the sparsity)."""
        raise NotImplementedError

    def receive(self, decision: Decision) -> None:
        """Store a decision (every rank, after the broadcast). The default keeps ``scores``,
        ``measurements`` and the values under ``decision_attr``."""
        self.scores = dict(decision.scores)
        self.measurements = {k: dict(v) for k, v in decision.measurements.items()}
        setattr(self, self.decision_attr, dict(decision.values))

    def update(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Decision:
        """Measure (every rank: a share of the weights each, or its data), decide on rank zero,
        broadcast, record, apply, log: one decision."""
        return self.conclude(trainer, self.measure(trainer, pl_module))

    # ------------------------------------------------------------------ the decision without a fit

    def plan(self, model: torch.nn.Module) -> pd.DataFrame:
        """The decision this callback would make next for ``model`` -- for a fresh callback, the
        one it makes at the start of a fit -- from the weights alone: no Trainer, no data.

        One row per layer it decides about: ``layer``, what :meth:`plan_columns` adds (Spectrum's
        module ``type``), the score (``alpha``, ``metric``, ``snr``), the other measurements
        (LALR's ``svd``, ``ce``, ``cs``) and the decision (``multiplier``, ``ratio``,
        ``selected``); ``attrs`` holds the model-wide numbers (``summary``) and the history
        fields (``record``: LALR's ``phase``). The model and the callback are left as they were:
        no ``requires_grad`` change, no mask, no optimizer, nothing logged, no history entry.
        Callbacks that decide from anything else (data, the fit's progress), or whose settings
        need the fit's optimizer, raise a ``ValueError`` saying so.
        """
        who = type(self).__name__
        if not self.decides_from_weights:
            how = ("decides from the training data (it measures on batches during the fit)" if self.measures == "data"
                   else "does not decide from the model's weights alone (it reads data, follows the fit or applies "
                        "its settings)")
            raise ValueError(
                f"{who} {how}, so it has no decision without a fit; run a fit and read its "
                f"decision (scores, history). plan() is for the callbacks that decide from the weights alone: "
                f"{', '.join(_planners())}"
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{who}.plan() takes the model (a torch.nn.Module), got {type(model).__name__}")
        probe = self._probe()
        context = _NoFit(who)
        with torch.no_grad():
            probe.configure(context, model)
            decision = probe.plan_decision(probe.measure(context, model))
        return probe.plan_frame(decision)

    def plan_decision(self, measured: Any) -> Decision:
        """The decision :meth:`plan` reports: :meth:`decide`, unless that does more than decide
        (HTSRPruning's masks), when the subclass returns the decision alone."""
        return self.decide(measured)

    def plan_columns(self) -> dict[str, dict[str, Any]]:
        """Per-layer columns the plan shows after ``layer`` (``{column: {layer: value}}``)."""
        return {}

    def plan_frame(self, decision: Decision) -> pd.DataFrame:
        """One decision as a table: the rows and columns :meth:`plan` describes."""
        layers = list(decision.values) + [n for n in decision.scores if n not in decision.values]
        columns = {"layer": layers}
        for key, values in self.plan_columns().items():
            columns[key] = [values.get(n) for n in layers]
        if decision.scores:
            columns[self.score_key] = [decision.scores.get(n, math.nan) for n in layers]
        for quantity, values in decision.measurements.items():
            if quantity not in columns:
                columns[quantity] = [values.get(n, math.nan) for n in layers]
        columns[self.decision_key] = [decision.values.get(n, math.nan) for n in layers]
        frame = pd.DataFrame(columns)
        frame.attrs.update({"callback": type(self).__name__, "summary": dict(decision.summary),
                            "record": dict(decision.record)})
        return frame

    def _probe(self) -> LayerwiseCallback:
        """A shallow copy to plan with: ``configure`` and ``measure`` set attributes on it, not
        on this callback (which may be about to fit, or hold a finished fit's state)."""
        _ = self.history  # a ddp_spawn worker's state is read into this object, not the copy
        probe = object.__new__(type(self))
        probe.__dict__.update(self.__dict__)
        probe._handoff, probe._handoff_pending = None, False
        return probe

    def weight_of(self, layer: Layer) -> torch.Tensor:
        """The weight ``measure_shards`` hands to the measurement (LALR: LoRA's merged weight)."""
        return layer.weight.detach()

    def measure_shards(self, trainer: pl.Trainer, pl_module: pl.LightningModule, units: list[list[Layer]],
                       fn) -> dict:
        """``fn(layers) -> {name: value}`` over every unit of layers, the units shared out among
        the ranks (balanced by size; under FSDP each rank gathers the whole weights of its own
        share only) and the results all-gathered: the same dict on every rank. An error on any
        rank is raised on all of them."""
        everything = [layer for unit in units for layer in unit]
        world = trainer.world_size
        if world == 1 and not self._sharded_weights(trainer):
            return fn(everything)
        sizes = self._sizes or {}
        owner = assign_shares([sum(sizes.get(la.name, 1) for la in unit) for unit in units], world)
        mine = {la.name for unit, o in zip(units, owner) if o == trainer.global_rank for la in unit}
        try:
            layers = whole_weights(pl_module, everything, mine, self.weight_of)
            part = ("ok", fn(layers) if layers else {})
        except Exception as err:  # noqa: BLE001 -- raised on every rank below
            part = ("error", err)
        merged: dict = {}
        for status, value in gather_objects(part):
            if status == "error":
                raise value
            merged.update(value)
        return {la.name: merged[la.name] for la in everything if la.name in merged}

    @staticmethod
    def _sharded_weights(trainer: pl.Trainer) -> bool:
        return "FSDP" in type(trainer.strategy).__name__

    def conclude(self, trainer: pl.Trainer, measured: Any) -> Decision:
        """Decide on rank zero from ``measured``, broadcast, record, apply and log. An error on
        rank zero is raised on every rank."""
        decision = self.decide_everywhere(trainer, measured)
        self.commit(trainer, decision)
        return decision

    def decide_everywhere(self, trainer: pl.Trainer, measured: Any) -> Decision:
        """Decide on rank zero from ``measured`` and broadcast: the same decision on every rank
        (not yet stored or applied). An error on rank zero is raised on every rank."""
        result: tuple[str, Any] | None = None
        if trainer.is_global_zero:
            try:
                result = ("ok", self.decide(measured))
            except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
                result = ("error", err)
        status, payload = trainer.strategy.broadcast(result, src=0)
        if status == "error":
            raise payload
        return payload

    def commit(self, trainer: pl.Trainer, decision: Decision) -> None:
        self.receive(decision)
        achieved = self.apply(trainer) or {}
        entry = {"epoch": trainer.current_epoch, "step": trainer.global_step,
                 self.decision_attr: dict(decision.values)}
        if decision.scores:
            entry["scores"] = dict(decision.scores)
        entry.update(decision.record)
        entry.update(achieved)
        self.record(entry)
        self.log_decision(trainer, decision, achieved)
        self._publish(trainer, "decision", decision)

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        if len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]

    # ------------------------------------------------------------------ divergence

    def check_finite(self, trainer: pl.Trainer | None, named: Mapping[str, Any], what: str) -> None:
        """Raise :class:`DivergenceError` naming the entries of ``named`` (a tensor, a list of
        tensors or a number each) that hold NaN or Inf."""

        def finite(v) -> bool:
            if isinstance(v, torch.Tensor):
                return bool(torch.isfinite(v).all())
            if isinstance(v, (list, tuple)):
                return all(finite(t) for t in v)
            return math.isfinite(float(v))

        bad = [k for k, v in named.items() if not finite(v)]
        if bad:
            raise DivergenceError(type(self).__name__, what, bad,
                                  epoch=None if trainer is None else trainer.current_epoch,
                                  step=None if trainer is None else trainer.global_step)

    # ------------------------------------------------------------------ control

    def controls(self, trainer: pl.Trainer) -> list[LayerControl]:
        if not trainer.optimizers:
            raise RuntimeError(f"{type(self).__name__}: the LightningModule configured no optimizer")
        return [LayerControl.of(opt) for opt in trainer.optimizers]

    def _per_param(self, per_layer: Mapping[str, Any]) -> tuple[dict, dict]:
        values, names = {}, {}
        for layer in self.layers:
            if layer.name in per_layer:
                for p in layer.params.values():
                    values[p] = per_layer[layer.name]
                    names[p] = layer.name
        return values, names

    def apply_multipliers(self, trainer: pl.Trainer, per_layer: Mapping[str, float]) -> None:
        mults, names = self._per_param(per_layer)
        for ctl in self.controls(trainer):
            ctl.set_multipliers(self.state_key, mults, names)

    def apply_frozen(self, trainer: pl.Trainer, frozen_layers: Iterable[str]) -> None:
        frozen = set(frozen_layers)
        params, _ = self._per_param({n: True for n in frozen})
        _, names = self._per_param({layer.name: True for layer in self.layers})  # trained ones are reported too
        for ctl in self.controls(trainer):
            ctl.name_params(names)
            ctl.set_frozen(self.state_key, list(params), names)

    # ------------------------------------------------------------------ Lightning hooks

    #: whether the callback works under FSDP (``check_strategy``)
    fsdp_ok: ClassVar[bool] = False

    def configure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Find ``self.layers`` (and anything else that depends on the model) at the start of a
        fit, before the model is wrapped: a function of the architecture and the settings only,
        so it is the same on every rank and after resume."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._handoff_pending = False  # this instance runs the fit itself
        if stage == "fit":
            check_strategy(trainer, type(self).__name__, fsdp=self.fsdp_ok)
            self.configure(trainer, pl_module)
            # sizes while the weights are whole (before any FSDP wrap), to share work out evenly
            self._sizes = {la.name: la.weight.numel() for la in self.layers if la.module is not None
                           and isinstance(getattr(la.module, "weight", None), torch.Tensor)}
            self._publish(trainer, "start")  # settings into the run config, W&B's step axis

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.restored:  # continue with the checkpoint's decision
            self.apply(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.logs_lr:
            self.log_effective_lrs(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        # gradients are final (unscaled, all-reduced) and not yet clipped: masked entries go now
        ctl = LayerControl.existing(optimizer)
        if ctl is not None:
            ctl.mask_gradients()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(trainer, "end")  # the heatmap (unless the last decision logged it), last ESDs, summary

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for opt in trainer.optimizers or []:
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.clear(self.state_key)
        LayerControl.restore_requires_grad(self.state_key)
        if stage == "fit":
            self._hand_over(trainer)

    # ------------------------------------------------------------------ logging

    @staticmethod
    def log_step(trainer: pl.Trainer) -> int:
        # the step LearningRateMonitor uses, so our curves line up with its
        return trainer.fit_loop.epoch_loop._batches_that_stepped

    def log_values(self, trainer: pl.Trainer, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send per-layer values straight to every logger (rank zero only, as loggers are);
        non-finite values are left out."""
        metrics = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        if not metrics or not trainer.loggers:
            return
        metrics.setdefault("epoch", float(trainer.current_epoch))  # as Lightning's own rows carry it
        step = self.log_step(trainer) if step is None else step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def decision_metrics(self, decision: Decision, achieved: Mapping[str, Any] | None = None) -> dict[str, float]:
        """``<prefix>/<quantity>/<layer>`` for the scores, the measurements and the decision, and
        ``<prefix>/<key>`` for the summary."""
        p = self.prefix
        out = {f"{p}/{self.score_key}/{k}": v for k, v in decision.scores.items()}
        for quantity, values in decision.measurements.items():
            out.update({f"{p}/{quantity}/{k}": v for k, v in values.items()})
        out.update({f"{p}/{self.decision_key}/{k}": v for k, v in decision.values.items()})
        out.update({f"{p}/{k}": v for k, v in decision.summary.items()})
        return out

    def log_decision(self, trainer: pl.Trainer, decision: Decision, achieved: Mapping[str, Any]) -> None:
        self.log_values(trainer, self.decision_metrics(decision, achieved))

    def _publish(self, trainer: pl.Trainer, event: str, decision: Decision | None = None) -> None:
        """Tables, heatmaps, ESD plots, settings and summary for the loggers that show them
        (:mod:`lalr_lightning.dashboards`); ``event``: ``start``, ``decision`` or ``end``."""
        if trainer.loggers and trainer.is_global_zero:
            from lalr_lightning import dashboards

            dashboards.publish(trainer, self, event, decision)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every callback takes ``plot_every_n_epochs`` (how often the dashboards redraw the ESD
        # plots; None: first and last decision only) without repeating it in its constructor: the
        # constructor is wrapped once and its signature shows the argument (for settings() and
        # LightningCLI).
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or "plot_every_n_epochs" in inspect.signature(init).parameters:
            return

        @functools.wraps(init)
        def __init__(self, *args: Any, plot_every_n_epochs: int | None = None, **kw: Any) -> None:
            if plot_every_n_epochs is not None and (isinstance(plot_every_n_epochs, bool) or
                                                    not isinstance(plot_every_n_epochs, int) or plot_every_n_epochs < 1):
                raise ValueError(f"plot_every_n_epochs must be None (first and last decision only) or an integer "
                                 f">= 1, got {plot_every_n_epochs!r}")
            init(self, *args, **kw)
            self.plot_every_n_epochs = plot_every_n_epochs

        sig = inspect.signature(init)
        params = list(sig.parameters.values())
        at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
        params.insert(at, inspect.Parameter("plot_every_n_epochs", inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=int | None))
        __init__.__signature__ = sig.replace(parameters=params)
        cls.__init__ = __init__

    def log_effective_lrs(self, trainer: pl.Trainer) -> None:
        """``lr_eff/<layer>`` for every controlled layer, once per logging step even when
        several callbacks share an optimizer."""
        if not trainer.loggers or not trainer._logger_connector.should_update_logs:
            return
        step = self.log_step(trainer)
        out: dict[str, float] = {}
        for ctl in self.controls(trainer):
            if ctl.take_report(step):
                out.update({f"lr_eff/{k}": v for k, v in ctl.effective_lrs().items()})
        self.log_values(trainer, out, step)

    def heatmap_columns(self) -> list[str]:
        """Column labels of the heatmap, one per history entry."""
        by_step = getattr(self, "every_n_steps", None) is not None
        return [str(h["step"] if by_step else h["epoch"]) for h in self.history]

    def heatmap_xlabel(self) -> str:
        return "step" if getattr(self, "every_n_steps", None) is not None else "epoch"

    def heatmap_values(self) -> tuple[list[str], np.ndarray]:
        """(row labels, layers x history values) of the decisions."""
        names: list[str] = []
        for h in self.history:
            names += [n for n in h[self.decision_attr] if n not in names]
        values = np.array([[h[self.decision_attr].get(n, np.nan) for h in self.history] for n in names], dtype=float)
        return names, values

    def log_heatmap(self, trainer: pl.Trainer) -> None:
        if (self.heatmap is None or len(self.history) < self.heatmap_min_entries or not trainer.is_global_zero
                or not trainer.loggers):
            return
        from lalr_lightning import viz

        key, title, label = self.heatmap
        names, values = self.heatmap_values()
        fig = viz.plot_heatmap(values, names, self.heatmap_columns()[-values.shape[1]:],
                               title=title.format(self=self), cbar_label=label, xlabel=self.heatmap_xlabel())
        viz.log_figure(trainer, f"{self.prefix}/{key}", fig)

    # Lightning assigns ``callback.log_dict = lightning_module.log_dict`` on every callback at fit
    # start; this property keeps ``log_dict`` meaning ``log_values`` here and ignores that write.
    log_dict = property(lambda self: self.log_values, lambda self, value: None)

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        """Everything beyond the history a resumed run needs (plain containers and tensors)."""
        return {}

    def _load_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        decision = getattr(self, self.decision_attr)
        return {"version": self.state_version, "settings": self.settings(), "history": list(self.history),
                "scores": dict(self.scores), "measurements": {k: dict(v) for k, v in self.measurements.items()},
                self.decision_attr: list(decision) if isinstance(decision, list) else dict(decision), **self._state()}

    def load_state_dict(self, state_dict: dict) -> None:
        version = state_dict.get("version")
        if version is not None and version > self.state_version:
            raise SettingsMismatchError(
                f"{self.state_key}: the checkpoint's state has version {version}, this lalr_lightning reads up "
                f"to {self.state_version}; upgrade lalr_lightning to resume it"
            )
        saved = state_dict.get("settings")
        if saved is not None and self.strict_resume:
            mine = self.settings()
            for key in mine:
                if key in saved and key not in self.volatile_settings + _LOGGING_SETTINGS and saved[key] != mine[key]:
                    raise SettingsMismatchError(
                        f"{self.state_key}: the checkpoint was written with {key}={saved[key]!r}, this callback "
                        f"has {key}={mine[key]!r}; resume with the same setting, or pass strict_resume=False "
                        "to continue with the new one"
                    )
        self.history = list(state_dict.get("history", []))
        self.scores = dict(state_dict.get("scores", {}))
        self.measurements = {k: dict(v) for k, v in state_dict.get("measurements", {}).items()}
        if self.decision_attr in state_dict:
            saved = state_dict[self.decision_attr]
            setattr(self, self.decision_attr, list(saved) if isinstance(saved, list) else dict(saved))
        self._load_state(state_dict)
        self.restored = True

    # ------------------------------------------------------------------ ddp_spawn

    def __getstate__(self) -> dict:
        # Pickled to be sent to spawned worker processes (ddp_spawn): give the worker a file to
        # leave its final state in, and remember here to read it back on first access.
        if self._handoff is None:
            self._handoff = os.path.join(tempfile.gettempdir(), f"lalr_lightning_{uuid.uuid4().hex}.pt")
        self._handoff_pending = True
        state = dict(self.__dict__)
        state["_handoff_pending"] = False
        state["_handoff_pid"] = os.getpid()
        return state

    def _hand_over(self, trainer: pl.Trainer) -> None:
        pid = self.__dict__.get("_handoff_pid")
        if self._handoff is None or pid is None or pid == os.getpid() or not trainer.is_global_zero:
            return
        torch.save({k: getattr(self, k) for k in self.readable if hasattr(self, k)}, self._handoff)

    def __getattribute__(self, attr: str):
        d = object.__getattribute__(self, "__dict__")
        if d.get("_handoff_pending") and attr in type(self).readable:
            path = d.get("_handoff")
            if path and os.path.exists(path):
                d["_handoff_pending"] = False
                state = torch.load(path, weights_only=False)  # written by this callback's own worker
                os.remove(path)
                d.update(state)
        return object.__getattribute__(self, attr)
