"""The decision cycle every layer-wise callback shares.

A callback says *when* it decides (its Lightning hooks and cadence) and *what*: ``measure()``
(per-layer numbers from the weights or the data) and ``decide()`` (per-layer decisions from
them), then ``apply()`` (hand the decision to :class:`~lalr_lightning.core.runtime.control.LayerControl`).
This class does the rest, the same way for all of them:

1. measure -- from the weights, each rank a share of the layers, the results all-gathered;
   from data, every rank its own batches (the subclass reduces them);
2. decide on rank zero and broadcast, so ranks cannot drift apart (an error raised there is
   raised on every rank, so none waits forever);
3. store the decision, append it to a bounded ``history``, apply it;
4. log every per-layer number as ``<prefix>/<quantity>/<layer>``, and, as the ``figures``
   setting says, a layers x decisions heatmap and ESD plots (:mod:`lalr_lightning.dashboards`);
5. keep it all in a versioned ``state_dict`` that knows it was restored and refuses a
   checkpoint written with other settings (naming the setting; ``strict_resume=False`` opts out).

What happens across ranks (sharded measurement, deciding on rank zero, the whole copy under FSDP)
is :mod:`lalr_lightning.core.runtime.shards`; strategy checks and the ``ddp_spawn`` hand-back are
:mod:`lalr_lightning.callbacks.lightning_host`; ``plan(model)`` is
:mod:`lalr_lightning.callbacks.planning`.

Settings are declared once: every method is a dataclass (``@dataclass(eq=False, repr=False)``)
whose fields are its constructor arguments, with their types and defaults. The fields this base
declares (``name``, ``strict_resume``, ``figures``) are keyword-only; ``validate()`` checks the
settings (in one place per method), ``settings()`` and the checkpoint's check read the fields,
and the state key of an unnamed instance is its settings that differ from the defaults.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from lalr_lightning.callbacks import keys
from lalr_lightning.callbacks.host import Cadence, Host
from lalr_lightning.callbacks.lightning_host import LightningHooks, SpawnHandoff, check_strategy
from lalr_lightning.callbacks.planning import Planner
from lalr_lightning.core.model.blocks import forward_trace
from lalr_lightning.core.model.layers import Layer
from lalr_lightning.core.runtime import shards
from lalr_lightning.core.runtime.checks import (
    DEFAULT_FIGURES,
    FIGURES,
    DivergenceError,
    SettingsMismatchError,
    check_figures,
    check_settings,
    coerce_fields,
    deprecated_arg,
    lazy_error,
    lazy_parameters,
    non_finite,
    reject_stray,
    renamed,
    resolve_deprecated,
    setting_fields,
    settings_of,
    warn_deprecated,
)
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.decision import Decision
from lalr_lightning.core.runtime.shards import parameter_names, rebind

__all__ = ["DEFAULT_FIGURES", "FIGURES", "Decision", "LayerwiseCallback", "SettingsMismatchError", "check_figures",
           "check_strategy", "deprecated_arg", "renamed", "stop_on_sigterm", "warn_deprecated"]


def stop_on_sigterm(host: Host) -> Callable[[], None]:
    """A check for long measurements to call between chunks of work (:meth:`Host.stop_check`):
    it raises once the loop was asked to stop (Lightning: SIGTERM, whose handler only sets a flag
    read between batches). Ctrl-C needs nothing: ``KeyboardInterrupt`` is raised between chunks."""
    return host.stop_check()


def _plot_every(value: Any) -> dict[str, Any]:
    # the deprecated ``plot_every_n_epochs=N`` is ``figures=N``
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"plot_every_n_epochs must be None (first and last decision only) or an integer >= 1, "
                         f"got {value!r}")
    return {"figures": value}


@dataclass(eq=False, repr=False)
class LayerwiseCallback(Planner, SpawnHandoff, LightningHooks):
    """Base of every callback of this package (module docstring: the cycle it owns).

    Subclasses are dataclasses (``@dataclass(eq=False, repr=False)``) that declare their settings
    as fields, check them in ``validate()``, set the class attributes below, and implement
    ``measure``, ``decide`` and ``apply``; ``_state`` / ``_load_state`` carry anything else a
    resumed run needs, and ``__post_init__`` (calling the base's first) makes what they hold.
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
    #: whether ``measure`` needs the model's forward without the loop's autocast (torch.func)
    plain_forward: ClassVar[bool] = False
    #: heatmap of the decisions at fit end: (key under the prefix, title, colour-bar label)
    heatmap: ClassVar[tuple[str, str, str] | None] = None
    #: the fewest history entries worth a heatmap
    heatmap_min_entries: ClassVar[int] = 2
    #: whether it decides per weight matrix from the spectra, so its figures include the ESD
    #: log-log plot of each matrix (TempBalance, LALR, HT-SR pruning, Spectrum)
    esd_plots: ClassVar[bool] = False
    #: whether it changes learning rates (then ``lr_eff/<layer>`` is logged every logging step)
    logs_lr: ClassVar[bool] = True
    #: settings that may differ between the run that wrote a checkpoint and the one resuming
    volatile_settings: ClassVar[tuple[str, ...]] = ()
    state_version: ClassVar[int] = 1
    #: at most this many history entries are kept (and checkpointed), the newest
    history_limit: ClassVar[int] = 1000
    #: whether it works on parameters still lazy at setup (it reads no weight before training:
    #: the parameters keep their identity when the first forward shapes them)
    lazy_ok: ClassVar[bool] = False
    #: attributes a user reads after ``fit``; brought back to the main process after ddp_spawn
    readable: ClassVar[tuple[str, ...]] = ("scores", "measurements", "history")

    # The settings every method has (keyword-only, after the method's own).
    _: KW_ONLY
    #: distinguishes several instances: the checkpoint's state key and the log prefix
    name: str | None = None
    #: refuse a checkpoint written with other settings (False: continue with the new ones)
    strict_resume: bool = True
    #: when figures are drawn (ESD plots, heatmaps): ``"every"``, ``"first_last"``, ``"never"``, or every N epochs
    figures: int | str = DEFAULT_FIGURES
    #: deprecated name of ``figures=N``
    plot_every_n_epochs: int | None = deprecated_arg("figures", _plot_every)

    def __post_init__(self) -> None:
        super().__init__()  # the bases' own (SpawnHandoff's hand-back token); the dataclass's __init__ calls none
        self._settle()
        self.layers: list[Layer] = []
        self.scores: dict[str, float] = {}
        self.measurements: dict[str, dict[str, float]] = {}
        self.history: list[dict] = []
        self.restored = False
        self._sizes: dict[str, int] | None = None
        self._names_before_wrap: dict[int, str] | None = None  # FSDP2: the parameters setup saw, by name
        self.early: Decision | None = None  # decided in ``prepare``, committed at the start
        # the timeline's own: the model is wrapped; the start ran; a fresh fit's first decision ran
        self._wrapped = self._started = self._first_done = False
        self._whole_copy: shards.WholeCopy | None = None

    def _settle(self) -> None:
        """The settings as given, made final: numbers checked against their annotations (a word
        where a number is due fails naming it), deprecated names resolved, ``validate()``. The
        state key settles the declared defaults the same way (callbacks.keys)."""
        if type(self).__hash__ is None:  # a subclass decorated with a plain @dataclass (eq=True)
            raise TypeError(f"{type(self).__name__}: decorate it with @dataclass(eq=False, repr=False); a callback "
                            "compares by identity (the trainer and the layer control hold it by identity)")
        coerce_fields(self)
        resolve_deprecated(self)
        self.strict_resume = bool(self.strict_resume)
        self.figures = check_figures(self.figures)
        self.validate()

    #: a pure check of ``core`` that takes the method's own settings by name (after the class's
    #: name) and returns them final, for the default ``validate()``
    _checked_by: ClassVar[Callable[..., Mapping[str, Any]] | None] = None

    def validate(self) -> None:
        """Check the method's settings and bring them to their final form (``None`` defaults
        filled in): the one place a method checks them, each failure one line naming the fix.
        Runs at construction (and on the declared defaults, for the state key): it reads and sets
        only the fields. The default hands them to ``_checked_by`` where a method names one."""
        if self._checked_by is not None:
            self._final(type(self)._checked_by(type(self).__name__, **self._given()))

    def _given(self, *skip: str) -> dict[str, Any]:
        """This method's own settings as they stand (not the base's ``figures``, nor ``skip``), for
        a pure check of ``core`` that takes them by name and returns them final (:meth:`_final`)."""
        return {f.name: getattr(self, f.name) for f in setting_fields(type(self)) if f.name not in ("figures", *skip)}

    def _final(self, settings: Mapping[str, Any]) -> None:
        """Set the fields to their final values (``validate``): only declared settings."""
        names = {f.name for f in setting_fields(type(self))}
        for arg, value in settings.items():
            if arg not in names:
                raise AttributeError(f"{type(self).__name__} declares no setting {arg!r}")
            setattr(self, arg, value)

    # ------------------------------------------------------------------ identity

    @property
    def state_key(self) -> str:
        # ``Type[name]``, else ``Type`` plus the settings that set this instance apart (callbacks.keys)
        return keys.state_key(self)

    @property
    def _legacy_state_key(self) -> str:
        # Lightning reads a checkpoint's state under this key when the state_key is not there: the
        # key of every unnamed instance before keys held settings
        return f"{type(self).__name__}" + (f"[{self.name}]" if self.name else "")

    @property
    def prefix(self) -> str:
        return self.name or self.log_prefix

    def settings(self) -> dict[str, Any]:
        """The settings (the fields but ``name``, ``strict_resume`` and deprecated names; plain
        Python), as stored in checkpoints and logger configs."""
        return settings_of(self, last=("figures",))

    def reject(self, mode_arg: str, mode: str, given: Mapping[str, Any], valid: Mapping[str, Iterable[str]]) -> None:
        """ValueError for arguments given (not None) that the chosen mode does not use, listing
        which arguments go with which mode."""
        reject_stray(type(self).__name__, mode_arg, mode, given, valid)

    # ------------------------------------------------------------------ the cycle

    def measure(self, host: Host, module: nn.Module) -> Any:
        """Per-layer numbers for ``decide`` (see ``measures`` for where it runs)."""
        return None

    def decide(self, measured: Any) -> Decision:
        """The decision from what ``measure`` returned (rank zero only; keep it pure)."""
        raise NotImplementedError

    def apply(self, host: Host) -> dict | None:
        """Hand the current decision to the layer control; may return fields for the history
        entry (what the decision achieved, e.g. the sparsity). The default gives the layers their
        ``multipliers``."""
        if self.decision_attr != "multipliers":
            raise NotImplementedError
        self.apply_multipliers(host, self.multipliers)

    def receive(self, decision: Decision) -> None:
        """Store a decision (every rank, after the broadcast). The default keeps ``scores``,
        ``measurements`` and the values under ``decision_attr``."""
        self.scores = dict(decision.scores)
        self.measurements = {k: dict(v) for k, v in decision.measurements.items()}
        setattr(self, self.decision_attr, dict(decision.values))

    def update(self, host: Host, module: nn.Module) -> Decision:
        """Measure (every rank: a share of the weights each, or its data), decide on rank zero,
        broadcast, record, apply, log: one decision."""
        if not self.plain_forward:
            return self.conclude(host, self.measure(host, module))
        with host.plain_forward():
            measured = self.measure(host, module)
        return self.conclude(host, measured)

    def weight_of(self, layer: Layer) -> torch.Tensor:
        """The weight ``measure_shards`` hands to the measurement (LALR: LoRA's merged weight)."""
        return layer.weight.detach()

    def measure_shards(self, host: Host, module: nn.Module, units: list[list[Layer]],
                       fn) -> dict:
        """``fn(layers) -> {name: value}`` over every unit of layers, shared out among the ranks
        (:func:`~lalr_lightning.core.runtime.shards.measure_shards`): the same dict on every rank."""
        return shards.measure_shards(host, module, units, fn, self._sizes, self.weight_of)

    def conclude(self, host: Host, measured: Any) -> Decision:
        """Decide on rank zero from ``measured``, broadcast, record, apply and log. An error on
        rank zero is raised on every rank."""
        decision = self.decide_everywhere(host, measured)
        self.commit(host, decision)
        return decision

    def decide_everywhere(self, host: Host, measured: Any, decide: Callable[[Any], Decision] | None = None) -> Decision:
        """Decide on rank zero from ``measured`` (with ``decide``, else :meth:`decide`) and broadcast:
        the same decision on every rank (not yet stored or applied). An error on rank zero is
        raised on every rank."""
        return shards.decide_on_zero(host, decide or self.decide, measured)

    def commit(self, host: Host, decision: Decision) -> None:
        self.receive(decision)
        achieved = self.apply(host) or {}
        entry = {"epoch": host.current_epoch, "step": host.global_step,
                 self.decision_attr: dict(decision.values)}
        if decision.scores:
            entry["scores"] = dict(decision.scores)
        entry.update(decision.record)
        entry.update(achieved)
        self.record(entry)
        self.log_decision(host, decision, achieved)
        host.publish(self, "decision", decision)

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        if len(self.history) > self.history_limit:
            del self.history[: len(self.history) - self.history_limit]

    # ------------------------------------------------------------------ divergence

    def check_finite(self, host: Host | None, named: Mapping[str, Any], what: str) -> None:
        """Raise :class:`DivergenceError` naming the entries of ``named`` (a tensor, a list of
        tensors or a number each) that hold NaN or Inf, and when (``host``: anything with the
        fit's ``current_epoch`` and ``global_step``; None: not said)."""
        bad = non_finite(named)
        if bad:
            raise DivergenceError(type(self).__name__, what, bad,
                                  epoch=None if host is None else host.current_epoch,
                                  step=None if host is None else host.global_step)

    # ------------------------------------------------------------------ control

    def controls(self, host: Host) -> list[LayerControl]:
        if not host.optimizers:
            raise RuntimeError(f"{type(self).__name__}: the LightningModule configured no optimizer")
        return [LayerControl.of(opt) for opt in host.optimizers]

    @staticmethod
    def device_batch(host: Host, batch: Any) -> Any:
        """A batch the callback drew from a loader itself, as Lightning hands batches to
        ``training_step``: on the strategy's device, its floating tensors in the precision's input
        dtype (bf16-true: a bfloat16 conv refuses a float32 input)."""
        return host.to_device(batch)

    def _per_param(self, per_layer: Mapping[str, Any]) -> tuple[dict, dict]:
        values, names = {}, {}
        for layer in self.layers:
            if layer.name in per_layer:
                for p in layer.params.values():
                    values[p] = per_layer[layer.name]
                    names[p] = layer.name
        return values, names

    def apply_multipliers(self, host: Host, per_layer: Mapping[str, float]) -> None:
        mults, names = self._per_param(per_layer)
        for ctl in self.controls(host):
            ctl.set_multipliers(self.state_key, mults, names)

    def apply_frozen(self, host: Host, frozen_layers: Iterable[str]) -> None:
        frozen = set(frozen_layers)
        params, _ = self._per_param({n: True for n in frozen})
        _, names = self._per_param({layer.name: True for layer in self.layers})  # trained ones are reported too
        for ctl in self.controls(host):
            ctl.name_params(names)
            ctl.set_frozen(self.state_key, list(params), names)

    # ------------------------------------------------------------------ the timeline

    #: why the callback cannot work where the strategy shards the weights (FSDP), and what to use
    #: instead (``check_strategy`` raises it); None: it can
    fsdp_refusal: ClassVar[str | None] = None
    #: when it decides (the owner calls ``update`` at each point due, once per point)
    cadence: ClassVar[Cadence] = Cadence()
    #: whether a measurement runs the whole model (``with_whole_model``): under FSDP a skeleton of
    #: it is kept from before the wrap, filled on rank zero for each measurement
    needs_whole_model: ClassVar[bool] = False

    def configure(self, host: Host, module: nn.Module) -> None:
        """Find ``self.layers`` (and anything else that depends on the model) at the start of a
        fit, before the model is wrapped: a function of the architecture and the settings only,
        so it is the same on every rank and after resume."""

    def forward_order(self, host: Host, module: nn.Module) -> Callable[[], Any] | None:
        """One forward pass of ``module`` on a probe batch, run when first asked (side-effect free:
        :func:`~lalr_lightning.core.model.blocks.forward_trace`), for finding the output layer of a
        model with no Hugging Face / timm getter by what runs last; outside a fit (``plan()``) only
        on the module's ``example_input_array`` (None without one: the registration order decides)."""
        if not host.has_data and getattr(module, "example_input_array", None) is None:
            return None
        # host.batches is looked up only when no example input is there (plan()'s host has none)
        return functools.cache(lambda: forward_trace(module, lambda: host.batches(), getattr(self, "loss_fn", None)))

    def _lazy_guarded(self, module: nn.Module, fn: Callable[[], Any]) -> dict:
        """Run ``fn``; where the model has lazy parameters and ``fn`` fails, one line naming them and
        the fix (:func:`~lalr_lightning.core.runtime.checks.lazy_error`). Returns the lazy parameters."""
        lazy = lazy_parameters(module)
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            if lazy:
                raise lazy_error(type(self).__name__, lazy) from err
            raise
        return lazy

    def _configure_checked(self, host: Host, module: nn.Module) -> None:
        """:meth:`configure`, and where the model has lazy parameters (``nn.LazyLinear`` before its
        first forward) that this callback's layers need, one line naming them and the fix instead
        of torch's error from deep inside (a callback whose layers leave them out works)."""
        lazy = self._lazy_guarded(module, lambda: self.configure(host, module))
        if not lazy:
            return
        held = getattr(self, "_params", None)
        used = {id(p) for la in self.layers for p in la.params.values()}
        used |= {id(p) for p in held.values()} if isinstance(held, dict) else set()
        mine = {n: t for n, t in lazy.items() if id(module.get_parameter(n)) in used}
        if mine and not self.lazy_ok:
            raise lazy_error(type(self).__name__, mine)

    # The method's steps on the timeline; each a no-op unless a method needs it. The owner calls
    # them at the right point for every host and strategy (docs/design.md, "The timeline").

    def prepare(self, host: Host) -> None:
        """Right after ``configure``, before the strategy wraps the model (static decisions)."""

    def after_wrap(self, host: Host) -> None:
        """The model is wrapped and the optimizers exist; the checkpoint's state may come later."""

    def resumed(self, late: bool) -> None:
        """The checkpoint's state is back (``late``: after the wrap, before the optimizer state)."""

    def first_decision(self, host: Host) -> None:
        """A fresh fit's first decision (at the train start, nothing restored): the one made in
        ``prepare`` (``self.early``), or a measurement where the cadence starts at the fit's start."""
        if self.early is not None:
            self.commit(host, self.early)
        elif self.cadence.start:
            self.update(host, host.module)

    def after_start(self, host: Host) -> None:
        """After the first decision, or the checkpoint's applied."""

    def each_epoch(self, host: Host) -> None:
        """At every epoch's start, after any decision due there."""

    def each_batch(self, host: Host, batch: Any) -> None:
        """At every batch's start, after any decision due there."""

    def after_backward(self, host: Host) -> None:
        """After every backward."""

    def before_step(self, host: Host, optimizer: Any) -> None:
        """Before every optimizer step (gradients final; masked entries already dropped)."""

    def after_batch(self, host: Host, outputs: Any, batch: Any) -> None:
        """After every training batch."""

    def after_epoch(self, host: Host) -> None:
        """At every training epoch's end."""

    def finish(self, host: Host) -> None:
        """At the end of a fit that ran to its end."""

    def release(self, host: Host) -> None:
        """At teardown, after the layer control was given back: drop what the fit held."""

    # The owner's events (LightningHooks maps Lightning's hooks to these; another host maps its own).

    @property
    def is_wrapped(self) -> bool:
        """Whether the strategy has wrapped the model (``requires_grad`` changes then reach DDP's
        buckets no more)."""
        return self._wrapped

    def _begin(self, host: Host) -> None:
        self._wrapped = self._started = self._first_done = False
        self.early = None
        self._configure_checked(host, host.module)
        # sizes while the weights are whole (before any FSDP wrap), to share work out evenly
        self._sizes = {la.name: la.weight.numel() for la in self.layers if la.module is not None
                       and isinstance(getattr(la.module, la.weight_name, None), torch.Tensor)}
        # FSDP2 puts new parameters in place of these: everything held follows them after the wrap
        self._names_before_wrap = parameter_names(host.module) if host.sharding == "fsdp2" else None
        self._whole_copy = shards.WholeCopy(host.module, type(self).__name__) \
            if self.needs_whole_model and host.sharded else None
        self._lazy_guarded(host.module, lambda: self.prepare(host))  # a static selection freezes here
        host.publish(self, "start")  # settings into the run config, W&B's step axis

    def _wrapped_now(self, host: Host, final: bool) -> None:
        """The model is wrapped; ``final``: the checkpoint's state (if any) is already back."""
        names, self._names_before_wrap = self._names_before_wrap, None
        if names:
            rebind(self.__dict__, names, host.module)
        self._wrapped = True
        self.after_wrap(host)
        if final:
            self._start(host)

    def _train_start(self, host: Host) -> None:
        if not self._started:  # the checkpoint's state came after the wrap, or never came
            self._start(host)
        if not self.restored and not self._first_done:
            # a fresh fit's first decision: here, where the host can stop a long measurement
            self._first_done = True
            self.first_decision(host)
            self.early = None
            self.after_start(host)

    def _start(self, host: Host) -> None:
        """The checkpoint's state is final: a resumed fit continues with its decision (before the
        optimizer state loads where the host restores it before the wrap)."""
        self._started = True
        if self.restored:
            self.early = None
            self.apply(host)
            self.after_start(host)

    def _due(self, host: Host, where: str) -> bool:
        now = host.current_epoch if where == "epoch" else host.global_step
        return self.cadence.due(where, now, self.history[-1] if self.history else None)

    def _epoch_start(self, host: Host) -> None:
        if self._due(host, "epoch"):
            self.update(host, host.module)
        self.each_epoch(host)

    def _batch_start(self, host: Host, batch: Any) -> None:
        if self._due(host, "step"):
            self.update(host, host.module)
        self.each_batch(host, batch)
        if self.logs_lr:
            self._log_effective_lrs(host)

    def _after_backward(self, host: Host) -> None:
        for opt in host.optimizers or []:  # new gradients: masked entries go again before the next step
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.gradients_changed()
        self.after_backward(host)

    def _before_step(self, host: Host, optimizer: Any) -> None:
        # gradients are final (unscaled, all-reduced) and not yet clipped: masked entries go now
        ctl = LayerControl.existing(optimizer)
        if ctl is not None:
            ctl.mask_gradients()
        self.before_step(host, optimizer)

    def _batch_end(self, host: Host, outputs: Any, batch: Any) -> None:
        # a step that raised and was caught (manual optimization) gives the groups back before the
        # schedulers step them
        self._abandon_steps(host)
        self.after_batch(host, outputs, batch)

    @staticmethod
    def _abandon_steps(host: Host) -> None:
        for opt in host.optimizers or []:
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.abandon_step()

    def _end(self, host: Host) -> None:
        self.finish(host)
        host.publish(self, "end")  # the heatmap (unless the last decision logged it), last ESDs, summary

    def _teardown(self, host: Host) -> None:
        for opt in host.optimizers or []:
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.clear(self.state_key)
        LayerControl.restore_requires_grad(self.state_key)
        self.release(host)
        self._whole_copy = None

    @property
    def whole(self) -> shards.WholeCopy | None:
        """Under FSDP, the whole copy the owner keeps for ``needs_whole_model`` (None elsewhere)."""
        return self._whole_copy

    def with_whole_model(self, host: Host, fn: Callable[[nn.Module], Any], frozen: bool = False) -> Any:
        """``fn(module)`` on the whole model: the live one, or under FSDP a whole copy on rank zero,
        the result broadcast (``needs_whole_model``; ``frozen``: the copy does not require grad)."""
        if self._whole_copy is None:
            return fn(host.module)
        return self._whole_copy.run(host, host.module, fn, frozen)

    # ------------------------------------------------------------------ logging

    def log_values(self, host: Host, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send per-layer values straight to every logger (rank zero only, as loggers are);
        non-finite values are left out."""
        host.log({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step)

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

    def log_decision(self, host: Host, decision: Decision, achieved: Mapping[str, Any]) -> None:
        self.log_values(host, self.decision_metrics(decision, achieved))

    def _log_effective_lrs(self, host: Host) -> None:
        """``lr_eff/<layer>`` for every controlled layer, once per logging step even when
        several callbacks share an optimizer."""
        if not host.should_log():
            return
        step = host.log_step
        out: dict[str, float] = {}
        for ctl in self.controls(host):
            if ctl.take_report(step):
                out.update({f"lr_eff/{k}": v for k, v in ctl.effective_lrs().items()})
        self.log_values(host, out, step)

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

    def log_heatmap(self, trainer: Any) -> None:
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

    def _restore(self, state_dict: dict) -> None:
        """The checkpoint's state, restored once, where the strategy brings it (before the wrap
        under one device and DDP, after it under FSDP: ``resumed(late=True)``)."""
        version = state_dict.get("version")
        if version is not None and version > self.state_version:
            raise SettingsMismatchError(
                f"{self.state_key}: the checkpoint's state has version {version}, this lalr_lightning reads up "
                f"to {self.state_version}; upgrade lalr_lightning to resume it"
            )
        saved = state_dict.get("settings")
        if saved is not None and self.strict_resume:  # what is logged only (figures) may change
            check_settings(self.state_key, saved, self.settings(), self.volatile_settings + ("figures",))
        self.history = list(state_dict.get("history", []))
        self.scores = dict(state_dict.get("scores", {}))
        self.measurements = {k: dict(v) for k, v in state_dict.get("measurements", {}).items()}
        if self.decision_attr in state_dict:
            saved = state_dict[self.decision_attr]
            setattr(self, self.decision_attr, list(saved) if isinstance(saved, list) else dict(saved))
        self._load_state(state_dict)
        self.restored = True
        self.resumed(late=self._wrapped)
        # a host that restores after the start (a state loaded by hand after on_fit_start): the
        # checkpoint's state is applied at the train start instead
        self._started = False


# The class carries no value of the base's settings (they live on the instance, as the dataclass
# sets them): the names a method author sees on the class are its methods and declarations.
for _field in ("name", "strict_resume", "figures", "plot_every_n_epochs"):
    delattr(LayerwiseCallback, _field)
