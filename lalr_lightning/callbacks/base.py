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

The timeline (which step runs when, for every host and strategy) and this cycle's plumbing are the
method's runner, :mod:`lalr_lightning.callbacks.runner`, which the hosts drive and which holds the
method by composition; what happens across ranks (sharded measurement, deciding on rank zero, the
whole copy under FSDP) is :mod:`lalr_lightning.core.runtime.shards`; strategy checks and the
``ddp_spawn`` hand-back are :mod:`lalr_lightning.callbacks.lightning_host`; ``plan(model)`` is
:mod:`lalr_lightning.callbacks.planning`. None of them is imported here: reading a method loads
only what the method itself uses.

Settings are declared once: every method is a dataclass (``@dataclass(eq=False, repr=False)``)
whose fields are its constructor arguments, with their types and defaults. The fields this base
declares (``name``, ``strict_resume``, ``figures``) are keyword-only; ``validate()`` checks the
settings (in one place per method), ``settings()`` and the checkpoint's check read the fields,
and the state key of an unnamed instance is its settings that differ from the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lalr_lightning.callbacks import keys
from lalr_lightning.callbacks.host import TRAIT_NAMES, Cadence, Host, Traits
from lalr_lightning.callbacks.lightning_host import LightningHooks, SpawnHandoff
from lalr_lightning.core.model.layers import Layer
from lalr_lightning.core.runtime.checks import (
    DEFAULT_FIGURES,
    FIGURES,
    SettingsMismatchError,
    check_figures,
    check_settings,
    coerce_fields,
    deprecated_arg,
    renamed,
    resolve_deprecated,
    setting_fields,
    settings_of,
    warn_deprecated,
)
from lalr_lightning.core.runtime.decision import Decision

__all__ = ["DEFAULT_FIGURES", "FIGURES", "Decision", "LayerwiseCallback", "SettingsMismatchError", "check_figures",
           "deprecated_arg", "renamed", "stop_on_sigterm", "warn_deprecated"]


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
class LayerwiseCallback(SpawnHandoff, LightningHooks):
    """Base of every callback of this package (module docstring: the cycle it owns).

    Subclasses are dataclasses (``@dataclass(eq=False, repr=False)``) that declare their settings
    as fields, check them in ``validate()``, set the class attributes below, and implement
    ``measure``, ``decide`` and ``apply``; ``_state`` / ``_load_state`` carry anything else a
    resumed run needs, and ``__post_init__`` (calling the base's first) makes what they hold.
    """

    #: what the method declares about itself (callbacks.host.Traits: log names, where it
    #: measures, what it needs of the strategy); a method sets ``traits = Traits(...)``
    traits: ClassVar[Traits] = Traits()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # a method written against the last release sets the traits as class attributes: fold them
        # into its ``traits``, once, with a DeprecationWarning (only that; to be removed next release)
        super().__init_subclass__(**kwargs)
        old = {n: v for n, v in vars(cls).items() if n in TRAIT_NAMES}
        if not old:
            return
        computed = sorted(n for n, v in old.items() if hasattr(v, "__get__"))
        if computed:
            raise TypeError(f"{cls.__name__}: {', '.join(computed)} must be values; set one that depends on the "
                            f"settings in __post_init__: self.traits = self.traits.but({computed[0]}=...)")
        for n in old:
            delattr(cls, n)
        cls.traits = cls.traits.but(**old)
        parent = next(b for b in cls.__mro__[1:] if issubclass(b, LayerwiseCallback)).__name__
        spelled = ", ".join(f"{n}={v!r}" for n, v in old.items())
        warn_deprecated(f"{cls.__name__}: setting {', '.join(old)} as class attributes is deprecated; declare "
                        f"traits = {parent}.traits.but({spelled}) (lalr_lightning.callbacks.host.Traits)")

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
        self.early: Decision | None = None  # decided in ``prepare``, committed at the start

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
        return self.name or self.traits.log_prefix

    def settings(self) -> dict[str, Any]:
        """The settings (the fields but ``name``, ``strict_resume`` and deprecated names; plain
        Python), as stored in checkpoints and logger configs."""
        return settings_of(self, last=("figures",))

    # ------------------------------------------------------------------ the cycle
    # A method writes ``configure``, ``measure``, ``decide`` and (unless it sets multipliers)
    # ``apply``; the optional steps it may add are listed in ``callbacks.runner.STEPS``. The runner
    # (``callbacks.runner``) calls them; what the method calls back is below.

    def configure(self, host: Host, module: nn.Module) -> None:
        """Find ``self.layers`` (and anything else that depends on the model) at the start of a
        fit, before the model is wrapped: a function of the architecture and the settings only,
        so it is the same on every rank and after resume."""

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
        if self.traits.decision_attr != "multipliers":
            raise NotImplementedError
        self.apply_multipliers(host, self.multipliers)

    def receive(self, decision: Decision) -> None:
        """Store a decision (every rank, after the broadcast). The default keeps ``scores``,
        ``measurements`` and the values under ``decision_attr``."""
        self.scores = dict(decision.scores)
        self.measurements = {k: dict(v) for k, v in decision.measurements.items()}
        setattr(self, self.traits.decision_attr, dict(decision.values))

    @property
    def _runner(self) -> Any:
        # the runner that drives this method (made by the host at setup; here on first use, as
        # for a method called outside a fit): imported on use, so reading a method loads none of it
        runner = self.__dict__.get("_runner")
        if runner is None or runner.method is not self:
            from lalr_lightning.callbacks.runner import Runner

            runner = Runner.of(self)
        return runner

    def update(self, host: Host, module: nn.Module) -> Decision:
        """Measure (every rank: a share of the weights each, or its data), decide on rank zero,
        broadcast, record, apply, log: one decision."""
        return self._runner.update(host, module)

    def conclude(self, host: Host, measured: Any) -> Decision:
        """Decide on rank zero from ``measured``, broadcast, then :meth:`commit`. An error on rank
        zero is raised on every rank."""
        return self._runner.conclude(host, measured)

    def commit(self, host: Host, decision: Decision) -> None:
        """Store ``decision`` (``receive``), apply it, append the history entry, log it."""
        self._runner.commit(host, decision)

    def decide_everywhere(self, host: Host, measured: Any, decide: Callable[[Any], Decision] | None = None) -> Decision:
        """Decide on rank zero from ``measured`` (with ``decide``, else :meth:`decide`) and broadcast:
        the same decision on every rank (not yet stored or applied). An error on rank zero is
        raised on every rank."""
        return self._runner.decide_everywhere(host, measured, decide)

    def measure_shards(self, host: Host, module: nn.Module, units: list[list[Layer]], fn) -> dict:
        """``fn(layers) -> {name: value}`` over every unit of layers, shared out among the ranks
        (:func:`~lalr_lightning.core.runtime.shards.measure_shards`; each measured on
        ``weight_of(layer)``, LALR's the merged LoRA weight): the same dict on every rank."""
        return self._runner.measure_shards(host, module, units, fn)

    def weight_of(self, layer: Layer) -> torch.Tensor:
        return layer.weight.detach()

    @property
    def whole(self) -> Any:
        """Under FSDP, the whole copy the runner keeps for ``needs_whole_model`` (None elsewhere);
        ``with_whole_model(host, fn)`` runs ``fn`` on it (or on the live model where there is none)."""
        return self._runner.whole_copy

    def with_whole_model(self, host: Host, fn: Callable[[nn.Module], Any], frozen: bool = False) -> Any:
        return self._runner.with_whole_model(host, fn, frozen)

    # ------------------------------------------------------------------ control

    def controls(self, host: Host) -> list:
        """The layer control of every optimizer (:class:`~lalr_lightning.core.runtime.control.LayerControl`)."""
        return host.controls(type(self).__name__)

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

    def log_values(self, host: Host, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Send per-layer values straight to every logger (rank zero only, as loggers are);
        non-finite values are left out."""
        host.log({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step)

    def plan(self, model: nn.Module) -> Any:
        """The decision this callback would make next for ``model`` from the weights alone: no
        Trainer, no data (a pandas DataFrame, one row per layer; :func:`lalr_lightning.callbacks.planning.plan`).
        Callbacks that decide from anything else raise a ``ValueError`` saying so."""
        from lalr_lightning.callbacks.planning import plan

        return plan(self, model, LayerwiseCallback)

    #: when it decides (the runner calls ``update`` at each point due, once per point); a
    #: property where it depends on the settings
    cadence: ClassVar[Cadence] = Cadence()

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        """Everything beyond the history a resumed run needs (plain containers and tensors)."""
        return {}

    def _load_state(self, state: dict) -> None:
        pass

    def state_dict(self) -> dict:
        decision = getattr(self, self.traits.decision_attr)
        return {"version": self.traits.state_version, "settings": self.settings(), "history": list(self.history),
                "scores": dict(self.scores), "measurements": {k: dict(v) for k, v in self.measurements.items()},
                self.traits.decision_attr: list(decision) if isinstance(decision, list) else dict(decision), **self._state()}

    def _restore(self, state_dict: dict) -> None:
        """The checkpoint's state (the runner's ``restore`` calls this where the host brings it)."""
        version = state_dict.get("version")
        if version is not None and version > self.traits.state_version:
            raise SettingsMismatchError(
                f"{self.state_key}: the checkpoint's state has version {version}, this lalr_lightning reads up "
                f"to {self.traits.state_version}; upgrade lalr_lightning to resume it"
            )
        saved = state_dict.get("settings")
        if saved is not None and self.strict_resume:  # what is logged only (figures) may change
            check_settings(self.state_key, saved, self.settings(), self.traits.volatile_settings + ("figures",))
        self.history = list(state_dict.get("history", []))
        self.scores = dict(state_dict.get("scores", {}))
        self.measurements = {k: dict(v) for k, v in state_dict.get("measurements", {}).items()}
        if self.traits.decision_attr in state_dict:
            saved = state_dict[self.traits.decision_attr]
            setattr(self, self.traits.decision_attr, list(saved) if isinstance(saved, list) else dict(saved))
        self._load_state(state_dict)
        self.restored = True


# The class carries no value of the base's settings (they live on the instance, as the dataclass
# sets them): the names a method author sees on the class are its methods and declarations.
for _field in ("name", "strict_resume", "figures", "plot_every_n_epochs"):
    delattr(LayerwiseCallback, _field)
