"""The runner: one owner of the timeline, holding a method by composition.

A host (Lightning's hooks in :mod:`~lalr_lightning.callbacks.lightning_host`, Hugging Face's
``TrainerCallback`` in :mod:`lalr_lightning.hf`) calls the runner's events, and the runner calls
the method: ``configure`` and ``measure``/``decide``/``apply`` through the shared cycle, and
whichever of the optional steps the method defines (:data:`STEPS`). The runner keeps what the
timeline needs between events (whether the model is wrapped, the start ran, the first decision
ran; the sizes of the layers while whole; under FSDP the whole copy) and the plumbing every
method shares (the history entry, the logs, the layer control given back at teardown). The method
holds none of it, and keeps no host: each event hands it one (docs/design.md, "The timeline").

``Runner.of(method)`` is the method's runner, made on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lalr_lightning.callbacks.host import Host
from lalr_lightning.core.model.layers import Layer
from lalr_lightning.core.runtime import shards
from lalr_lightning.core.runtime.checks import lazy_error, lazy_parameters
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.decision import Decision
from lalr_lightning.core.runtime.shards import parameter_names, rebind

__all__ = ["STEPS", "Runner"]

#: the optional steps a method may define, each called at its point of the timeline with the host
#: (``resumed`` with ``late``: whether the checkpoint's state came after the wrap):
#: ``prepare`` (right after ``configure``, before the wrap: static decisions), ``after_wrap`` (the
#: model is wrapped, the optimizers exist), ``resumed`` (the checkpoint's state is back),
#: ``first_decision`` (a fresh fit's first decision, in place of the runner's: the one made in
#: ``prepare``, ``method.early``, or a measurement where the cadence starts at the fit's start),
#: ``after_start`` (after the first decision, or the checkpoint's applied), ``each_epoch`` /
#: ``each_batch`` (every epoch's / batch's start, after any decision due there), ``after_backward``,
#: ``before_step`` (gradients final, masked entries dropped), ``after_batch``, ``after_epoch``,
#: ``finish`` (a fit that ran to its end), ``release`` (teardown, the layer control given back)
STEPS = ("prepare", "after_wrap", "resumed", "first_decision", "after_start", "each_epoch", "each_batch",
         "after_backward", "before_step", "after_batch", "after_epoch", "finish", "release")


class Runner:
    """Drives one method through the timeline (module docstring)."""

    def __init__(self, method: Any):
        self.method = method
        # the model is wrapped; the start ran; a fresh fit's first decision ran
        self.wrapped = self.started = self.first_done = False
        self.sizes: dict[str, int] | None = None  # the layers' sizes while whole, to share work out evenly
        self.names_before_wrap: dict[int, str] | None = None  # FSDP2: the parameters setup saw, by name
        self.whole_copy: shards.WholeCopy | None = None
        self.steps: dict[str, Callable | None] = {}
        self._find_steps()

    @classmethod
    def of(cls, method: Any) -> Runner:
        """The method's runner (made on first use, then kept with the method)."""
        runner = method.__dict__.get("_runner")
        if runner is None or runner.method is not method:  # a copy of a method gets its own
            runner = method.__dict__["_runner"] = cls(method)
        return runner

    def _find_steps(self) -> None:
        # looked up once per fit: a step a method lacks costs nothing per batch
        self.steps = {name: getattr(self.method, name, None) for name in STEPS}

    def step(self, name: str, *args: Any) -> None:
        """The method's optional step ``name`` (:data:`STEPS`), where it defines one."""
        fn = self.steps.get(name)
        if fn is not None:
            fn(*args)

    # ------------------------------------------------------------------ the cycle

    def update(self, host: Host, module: nn.Module) -> Decision:
        """Measure (every rank: a share of the weights each, or its data), decide on rank zero,
        broadcast, record, apply, log: one decision."""
        m = self.method
        if not m.traits.plain_forward:
            return m.conclude(host, m.measure(host, module))
        with host.plain_forward():
            measured = m.measure(host, module)
        return m.conclude(host, measured)

    def conclude(self, host: Host, measured: Any) -> Decision:
        decision = self.decide_everywhere(host, measured)
        self.method.commit(host, decision)
        return decision

    def decide_everywhere(self, host: Host, measured: Any, decide: Callable[[Any], Decision] | None = None) -> Decision:
        return shards.decide_on_zero(host, decide or self.method.decide, measured)

    def commit(self, host: Host, decision: Decision) -> None:
        """Store the decision (every rank), apply it, append the history entry, log it."""
        m = self.method
        m.receive(decision)
        achieved = m.apply(host) or {}
        entry = {"epoch": host.current_epoch, "step": host.global_step, m.traits.decision_attr: dict(decision.values)}
        if decision.scores:
            entry["scores"] = dict(decision.scores)
        entry.update(decision.record)
        entry.update(achieved)
        self.record(entry)
        own = getattr(m, "log_decision", None)  # a method may log its decision its own way (pruning)
        if own is not None:
            own(host, decision, achieved)
        else:
            self.log_values(host, decision.metrics(m.prefix, m.traits.score_key, m.traits.decision_key))
        host.publish(m, "decision", decision)

    def record(self, entry: dict) -> None:
        history = self.method.history
        history.append(entry)
        if len(history) > self.method.traits.history_limit:
            del history[: len(history) - self.method.traits.history_limit]

    def measure_shards(self, host: Host, module: nn.Module, units: list[list[Layer]], fn) -> dict:
        return shards.measure_shards(host, module, units, fn, self.sizes, self.method.weight_of)

    def with_whole_model(self, host: Host, fn: Callable[[nn.Module], Any], frozen: bool = False) -> Any:
        if self.whole_copy is None:
            return fn(host.module)
        return self.whole_copy.run(host, host.module, fn, frozen)

    # ------------------------------------------------------------------ logs

    @staticmethod
    def log_values(host: Host, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Per-layer values to every logger (rank zero only); non-finite values are left out."""
        host.log({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step)

    def log_effective_lrs(self, host: Host) -> None:
        """``lr_eff/<layer>`` for every controlled layer, once per logging step even when several
        methods share an optimizer."""
        if not host.should_log():
            return
        step = host.log_step
        out: dict[str, float] = {}
        for ctl in self.method.controls(host):
            if ctl.take_report(step):
                out.update({f"lr_eff/{k}": v for k, v in ctl.effective_lrs().items()})
        self.log_values(host, out, step)

    # ------------------------------------------------------------------ the timeline

    def _lazy_guarded(self, module: nn.Module, fn: Callable[[], Any]) -> dict:
        """Run ``fn``; where the model has lazy parameters and ``fn`` fails, one line naming them and
        the fix (:func:`~lalr_lightning.core.runtime.checks.lazy_error`). Returns the lazy parameters."""
        lazy = lazy_parameters(module)
        try:
            fn()
        except (ValueError, RuntimeError) as err:
            if lazy:
                raise lazy_error(type(self.method).__name__, lazy) from err
            raise
        return lazy

    def _configure_checked(self, host: Host, module: nn.Module) -> None:
        """``configure``, and where the model has lazy parameters (``nn.LazyLinear`` before its
        first forward) that the method's layers need, one line naming them and the fix instead of
        torch's error from deep inside (a method whose layers leave them out works)."""
        m = self.method
        lazy = self._lazy_guarded(module, lambda: m.configure(host, module))
        if not lazy:
            return
        held = getattr(m, "_params", None)
        used = {id(p) for la in m.layers for p in la.params.values()}
        used |= {id(p) for p in held.values()} if isinstance(held, dict) else set()
        mine = {n: t for n, t in lazy.items() if id(module.get_parameter(n)) in used}
        if mine and not m.traits.lazy_ok:
            raise lazy_error(type(m).__name__, mine)

    def begin(self, host: Host) -> None:
        """The fit's setup: configure, the sizes while whole, the whole copy (FSDP), ``prepare``."""
        m = self.method
        self._find_steps()
        self.wrapped = self.started = self.first_done = False
        m.early = None
        self._configure_checked(host, host.module)
        # sizes while the weights are whole (before any FSDP wrap; ZeRO-3's partitioned ones by
        # their ds_numel), to share work out evenly
        self.sizes = {la.name: int(getattr(la.weight, "ds_numel", la.weight.numel())) for la in m.layers
                      if la.module is not None and isinstance(getattr(la.module, la.weight_name, None), torch.Tensor)}
        # FSDP2 puts new parameters in place of these: everything held follows them after the wrap
        self.names_before_wrap = parameter_names(host.module) if host.sharding == "fsdp2" else None
        self.whole_copy = shards.WholeCopy(host.module, type(m).__name__) \
            if m.traits.needs_whole_model and host.sharded else None
        self._lazy_guarded(host.module, lambda: self.step("prepare", host))  # a static selection freezes here
        host.publish(m, "start")  # settings into the run config, W&B's step axis

    def wrapped_now(self, host: Host, final: bool) -> None:
        """The model is wrapped; ``final``: the checkpoint's state (if any) is already back."""
        names, self.names_before_wrap = self.names_before_wrap, None
        if names:
            rebind(self.method.__dict__, names, host.module)
        self.wrapped = True
        self.step("after_wrap", host)
        if final:
            self._start(host)

    def restore(self, state_dict: dict) -> None:
        """The checkpoint's state, restored once, where the strategy brings it (before the wrap
        under one device and DDP, after it under FSDP: ``resumed(late=True)``)."""
        self.method._restore(state_dict)
        self.step("resumed", self.wrapped)
        # a host that restores after the start (a state loaded by hand after on_fit_start): the
        # checkpoint's state is applied at the train start instead
        self.started = False

    def train_start(self, host: Host) -> None:
        m = self.method
        if not self.started:  # the checkpoint's state came after the wrap, or never came
            self._start(host)
        if not m.restored and not self.first_done:
            # a fresh fit's first decision: here, where the host can stop a long measurement
            self.first_done = True
            if self.steps.get("first_decision") is not None:
                self.step("first_decision", host)
            else:
                self.first_decision(host)
            m.early = None
            self.step("after_start", host)

    def first_decision(self, host: Host) -> None:
        """The runner's first decision: the one made in ``prepare`` (``method.early``), or a
        measurement where the cadence starts at the fit's start."""
        m = self.method
        if m.early is not None:
            m.commit(host, m.early)
        elif m.cadence.start:
            m.update(host, host.module)

    def _start(self, host: Host) -> None:
        """The checkpoint's state is final: a resumed fit continues with its decision (before the
        optimizer state loads where the host restores it before the wrap)."""
        self.started = True
        m = self.method
        if m.restored:
            m.early = None
            m.apply(host)
            self.step("after_start", host)

    def _due(self, host: Host, where: str) -> bool:
        now = host.current_epoch if where == "epoch" else host.global_step
        history = self.method.history
        return self.method.cadence.due(where, now, history[-1] if history else None)

    def epoch_start(self, host: Host) -> None:
        if self._due(host, "epoch"):
            self.method.update(host, host.module)
        self.step("each_epoch", host)

    def batch_start(self, host: Host, batch: Any) -> None:
        if self._due(host, "step"):
            self.method.update(host, host.module)
        self.step("each_batch", host, batch)
        if self.method.traits.logs_lr:
            self.log_effective_lrs(host)

    def after_backward(self, host: Host) -> None:
        for opt in host.optimizers or []:  # new gradients: masked entries go again before the next step
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.gradients_changed()
        self.step("after_backward", host)

    def before_step(self, host: Host, optimizer: Any) -> None:
        # gradients are final (unscaled, all-reduced) and not yet clipped: masked entries go now
        ctl = LayerControl.existing(optimizer)
        if ctl is not None:
            ctl.mask_gradients()
        self.step("before_step", host, optimizer)

    def batch_end(self, host: Host, outputs: Any, batch: Any) -> None:
        # a step that raised and was caught (manual optimization) gives the groups back before the
        # schedulers step them
        self.abandon_steps(host)
        self.step("after_batch", host, outputs, batch)

    @staticmethod
    def abandon_steps(host: Host) -> None:
        for opt in host.optimizers or []:
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.abandon_step()

    def epoch_end(self, host: Host) -> None:
        self.step("after_epoch", host)

    def end(self, host: Host) -> None:
        self.step("finish", host)
        host.publish(self.method, "end")  # the heatmap (unless the last decision logged it), last ESDs, summary

    def teardown(self, host: Host) -> None:
        key = self.method.state_key
        for opt in host.optimizers or []:
            ctl = LayerControl.existing(opt)
            if ctl is not None:
                ctl.clear(key)
        LayerControl.restore_requires_grad(key)
        self.step("release", host)
        self.whole_copy = None
