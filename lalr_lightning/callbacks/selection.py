"""What every callback that chooses which layers train shares, and ``SurgicalLayerSelect``, the
one name that builds any of them by ``mode``.

A selection callback decides ``selected`` -- the units (blocks; tensors for Auto-RGN) that
train -- and this base turns that into control: the others are frozen through
:class:`~lalr_lightning.core.runtime.control.LayerControl` (DDP-safe), and norm layers that cannot
change keep their running statistics (:mod:`lalr_lightning.core.model.norm_modes`). Training less then
costs less (``save_compute``, ``optimizer_state``):

* a *static* selection (Spectrum, NTK, fixed blocks) decides in ``setup``, before the strategy
  wraps the model, and turns ``requires_grad`` off there: the frozen matrices get no gradient,
  no DDP all-reduce and no optimizer state. A checkpoint's selection, restored after ``setup``
  but still before the wrap (single device, DDP), replaces it at no cost;
* a *switching* selection (LIFT, LISA, L-MSA) turns ``requires_grad`` on and off at every
  switch, and with ``optimizer_state="release"`` frees the optimizer state of the blocks that
  stop training. Under DDP its switching blocks are kept out of DDP (set in ``setup``, before
  the wrap), so DDP's gradient buckets hold only what always trains, and their gradients are
  averaged across ranks by hand, only the active blocks', once per optimizer step
  (:class:`~lalr_lightning.core.runtime.handsync.HandSync`); DDP gets ``find_unused_parameters=True``.

``requires_grad`` is given back at teardown. Logged at every logging step:
``<prefix>/selected/<block>`` (1 when the block trains).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, renamed
from lalr_lightning.callbacks.host import Host, Traits, say
from lalr_lightning.callbacks.lightning_host import LightningHooks
from lalr_lightning.callbacks.summary import selection_counts, selection_summary
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.layers import Layer
from lalr_lightning.core.model.norm_modes import NORM_EVAL, norm_layers, set_norm_modes
from lalr_lightning.core.model.probe import forward_trace
from lalr_lightning.core.model.tied import join_tied
from lalr_lightning.core.runtime.checks import check_taken, union_signature
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.handsync import HandSync, ddp_for_switching
from lalr_lightning.core.runtime.shards import replaces_parameters

__all__ = ["LayerSelection", "SurgicalLayerSelect", "MODES", "OPTIMIZER_STATE", "register_mode"]

#: what a switching selection does with the optimizer state of blocks that stop training
OPTIMIZER_STATE = ("release", "keep")

#: ``SurgicalLayerSelect`` modes, each built by the callback registered for it.
MODES: tuple[str, ...] = ()
_REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {}


_ORDER = ("blocks", "auto_rgn", "eb_criterion", "lift", "lisa", "ntk")  # how the modes are listed


def register_mode(mode: str, cls: type, **fixed: Any) -> None:
    """Make ``SurgicalLayerSelect(mode=mode, ...)`` build ``cls(**fixed, ...)``."""
    global MODES
    _REGISTRY[mode] = (cls, fixed)
    MODES = tuple(sorted(_REGISTRY, key=lambda m: (_ORDER.index(m) if m in _ORDER else len(_ORDER), m)))
    SurgicalLayerSelect.__new__.__signature__ = _modes_signature()


@dataclass(eq=False, repr=False)
class LayerSelection(LayerwiseCallback):
    """Base of the selection callbacks (module docstring). Subclasses find ``self.layers`` (the
    units) in ``setup`` -- :meth:`find_blocks` for blocks -- and decide ``values`` of 1.0
    (trains) / 0.0 (frozen) per unit."""

    traits = Traits(
        decision_attr="selected",
        decision_key="selected",
        heatmap=("selection", "{self.title} selection", "selected"),
        readable=LayerwiseCallback.traits.readable + ("selected",),
        volatile_settings=("norm_eval", "save_compute", "optimizer_state"),
    )
    title: ClassVar[str] = "layer"

    # The settings a selection may take; each subclass declares as fields the ones it takes (in
    # its own order), and these class values stand for the others (Auto-RGN saves no compute).
    # (not annotated: no field here, so that each subclass's fields keep its own order)
    blocks = None
    join_stem = True
    norm_eval = "frozen"
    save_compute = True
    optimizer_state = "keep"

    def validate(self) -> None:
        super().validate()
        if self.norm_eval not in NORM_EVAL:
            raise unknown("norm_eval", self.norm_eval, NORM_EVAL)
        if self.optimizer_state not in OPTIMIZER_STATE:
            raise unknown("optimizer_state", self.optimizer_state, OPTIMIZER_STATE,
                          note=" ('keep' matches LMFlow's LISA callback)")
        self.blocks = None if self.blocks is None else list(self.blocks)
        self.join_stem, self.save_compute = bool(self.join_stem), bool(self.save_compute)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.selected: list[str] = []
        self.block_list: list[Layer] = []  # the model's blocks (the units, or their labels)
        self._norms: list = []
        self._module: nn.Module | None = None
        self._ctls: list[LayerControl] | None = None
        self._held: set[int] = set()  # ids of the parameters some optimizer holds
        self._toggle = False  # requires_grad may change after the wrap
        self._past_wrap = False  # the strategy has wrapped the model (requires_grad no longer reaches DDP)
        self._handsync: HandSync | None = None  # DDP: the switching units' gradients averaged by hand
        self.summary: str | None = None  # the last decision's trainable / total parameters (callbacks/summary.py)
        self.summary_counts: dict[str, int | str] = {}  # the numbers of that line
        self._summarized = False  # this fit's summary was shown

    # ------------------------------------------------------------------ views

    @property
    def block_names(self) -> list[str]:
        return [b.name for b in self.block_list]

    @property
    def multipliers(self) -> dict[str, float]:
        """The selection as learning-rate factors: 1 for the selected units, 0 for the others."""
        return {u.name: float(u.name in self.selected) for u in self.layers}

    trainable = renamed("selected")  # deprecated name of ``selected``

    def selected_blocks(self) -> list[str]:
        """The blocks with at least one trained unit."""
        return list(self.selected)

    # ------------------------------------------------------------------ setup

    def find_blocks(self, module: nn.Module, *, head: bool = True, min_blocks: int = 2,
                    host: Host | None = None) -> list[Layer]:
        """The model's blocks (``blocks`` patterns, or found: timm groups / repeated children / with
        ``host``, the forward pass on a probe batch,
        :func:`~lalr_lightning.core.model.probe.forward_trace`); a clear error when
        there are fewer than ``min_blocks`` to choose between."""
        trace = None if host is None else (lambda: forward_trace(module, host.batches, getattr(self, "loss_fn", None)))
        self.block_list = block_layers(module, self.blocks, join_stem=self.join_stem, head=head, trace=trace)
        self.block_list, tied = join_tied(module, self.block_list)  # a shared tensor: its holders are one unit
        for note in tied:
            say(f"{type(self).__name__}: {note}")
        if len(self.block_list) < min_blocks:
            raise ValueError(
                f"{type(module).__name__} has a single block ({self.block_names}), so there is nothing to "
                "select; pass blocks=[...] (one module-name prefix or ^regex per block) to split it, or "
                "fine-tune without a selection callback"
            )
        return self.block_list

    #: whether the selection changes during training (then ``requires_grad`` follows it at
    #: every switch, and under DDP the switching units are kept out of DDP's buckets)
    switches: ClassVar[bool] = False

    def switching_units(self) -> list[Layer]:
        """The units a switching selection turns on and off (LISA: the middle blocks, not its
        always-trained stem and head): under DDP with ``save_compute`` their parameters are
        kept out of DDP and their gradients averaged by hand."""
        return list(self.layers)

    def decide_in_setup(self, host: Host, module: nn.Module) -> Decision | None:
        """A static selection's decision, made in ``setup`` before the model is wrapped (the
        same on every rank: :meth:`decide_everywhere`), or None to decide later."""
        return None

    def prepare(self, host: Host) -> None:
        self._module, self._summarized, self._past_wrap = host.module, False, False
        if self._handsync is not None:  # a fit that ended without teardown
            self._handsync.stop()
        self._handsync = None
        self._toggle = self._prepare_toggle(host)
        self.early = self.decide_in_setup(host, host.module)
        if self.early is not None:
            self.receive(self.early)
            if self.save_compute and not replaces_parameters(host):  # FSDP2: at fit start, on its own
                self.follow_requires_grad()

    def _prepare_toggle(self, host: Host) -> bool:
        """Whether ``requires_grad`` may change after the strategy wraps the model: on one device
        and under FSDP it may; under DDP a switching selection makes it so (its switching units
        kept out of DDP, the rest with ``find_unused_parameters=True``); other multi-process
        strategies are refused."""
        if host.sharding != "ddp":
            # FSDP (use_orig_params) and FSDP2 follow requires_grad at every backward: a unit whose
            # parameters all stop training gets no gradient, and every rank switches the same ones
            return True
        if not (self.switches and self.save_compute):
            return False
        who = f"{type(self).__name__}(save_compute=True)"
        kwargs = host.ddp_options  # read when the model is wrapped, after every setup hook
        if kwargs is None:
            raise RuntimeError(f"{who} turns requires_grad on and off at every switch, which this multi-process "
                               "strategy cannot follow; use strategy='ddp' or pass save_compute=False")
        note = ddp_for_switching(kwargs, who)
        if note is not None:
            say(note)
        # the switching units' parameters kept out of DDP's buckets (before the wrap)
        switching = self.switching_units()
        names = {u.name for u in switching}
        self._handsync = HandSync.keep_out(self._module, [u.params.values() for u in switching],
                                           [u.params.values() for u in self.layers if u.name not in names])
        if self._handsync is not None:
            say(f"{who}: {len(self._handsync.params)} parameter tensors of the switching blocks kept out "
                "of DDP's gradient buckets; their gradients are averaged across ranks by hand")
        return True

    def after_wrap(self, host: Host) -> None:
        self._past_wrap = True
        if self._handsync is not None:  # wrapped now: equal starting values, averaging from here on
            self._handsync.start(host.root)
        self._norms = norm_layers(host.module, self.block_list)
        self._ctls = self.controls(host)
        self._held = {id(p) for ctl in self._ctls for p in ctl.params}

    def resumed(self, late: bool) -> None:
        if self.layers and self.save_compute and not self.switches and self._decides_early:
            # the checkpoint's choice wins; single device and DDP restore before the wrap, so the
            # flags follow it at no cost
            self.follow_requires_grad(strict=True)
        elif late and self._toggle and self.save_compute:
            # FSDP: the flags follow the checkpoint's choice before the host restores the optimizer
            # state, which holds state for what trained then (and torch's loader wants it so)
            self.follow_requires_grad()

    @property
    def _decides_early(self) -> bool:
        return type(self).decide_in_setup is not LayerSelection.decide_in_setup

    # ------------------------------------------------------------------ the decision

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.selected = [u.name for u in self.layers if decision.values.get(u.name, 0.0) > 0]

    def apply(self, host: Host) -> None:
        """Freeze every unit not selected, turn its gradients off (``save_compute``, where safe)
        and release its optimizer state (``optimizer_state="release"``)."""
        on = set(self.selected)
        off = [u for u in self.layers if u.name not in on]
        self.apply_frozen(host, [u.name for u in off])
        if self.save_compute:
            self.follow_requires_grad()
        self.release_state(host, off)
        self.apply_norm_modes()
        self._summarize(host)

    def _summarize(self, host: Host) -> None:
        """After each decision, what trains as :func:`selection_summary` says it (``summary``);
        shown once per fit, at the first, since Lightning's model summary came before it, and as
        the host shows its own lines (``Host.info``: on Lightning, its rank-zero info)."""
        if self._module is None:
            return
        self.summary_counts = selection_counts(self)
        self.summary = selection_summary(type(self).__name__, self.summary_counts)
        if not self._summarized:
            self._summarized = True
            (host.info if isinstance(host, Host) else say)(self.summary)  # plan(): no loop to show it

    def release_state(self, host: Host, units: Sequence[Layer]) -> None:
        """With ``optimizer_state="release"``: free the optimizer state of these (frozen) units."""
        if self.optimizer_state == "release":
            params = [p for u in units for p in u.params.values()]
            for ctl in self.controls(host):
                ctl.release_state(params)

    def follow_requires_grad(self, strict: bool = False) -> None:
        """``requires_grad`` off for the units not selected, back on for the selected ones: in
        ``setup`` and at restore before the wrap, or after it where ``requires_grad`` may change
        (one device; DDP configured for a switching selection). Elsewhere the frozen units'
        gradients are only dropped before the step; ``strict``: that is an error."""
        on = set(self.selected)
        off = [u for u in self.layers if u.name not in on]
        want = {id(p) for u in off for p in u.params.values()}
        if want == {id(p) for p in LayerControl.grad_off_by(self.state_key)}:
            return
        if self._past_wrap and not self._toggle:
            if strict:
                raise RuntimeError(
                    f"{type(self).__name__}: the checkpoint's selection differs from the one made in setup from the "
                    "model's weights, and this strategy restores it after wrapping the model, when requires_grad "
                    "can no longer change; resume from the same initial weights, or pass save_compute=False"
                )
            return
        self.set_requires_grad([u for u in self.layers if u.name in on], True)
        self.set_requires_grad(off, False)

    def set_requires_grad(self, units: Sequence[Layer], flag: bool) -> None:
        LayerControl.set_requires_grad(self.state_key, [p for u in units for p in u.params.values()], flag)

    # ------------------------------------------------------------------ norm layers

    def trains(self, p: nn.Parameter) -> bool:
        """Whether ``p`` can change: not frozen by anyone (this callback, another owner of the
        optimizer's control, ``requires_grad=False``), and in an optimizer."""
        if not p.requires_grad:
            return False
        if self._ctls is None:
            return True
        return id(p) in self._held and not any(ctl.is_frozen(p) for ctl in self._ctls)

    def apply_norm_modes(self) -> None:
        if self._module is not None and self._norms:
            set_norm_modes(self._norms, self.norm_eval, self._module.training, self.trains,
                           set(self.selected_blocks()))

    def each_epoch(self, host: Host) -> None:
        self.apply_norm_modes()

    def each_batch(self, host: Host, batch: Any) -> None:
        self.apply_norm_modes()  # cheap; guards against a train() call since epoch start
        if host.should_log() and self.block_list:
            on = set(self.selected_blocks())
            self.log_values(host, {f"{self.prefix}/selected/{b}": float(b in on) for b in self.block_names})

    def release(self, host: Host) -> None:
        for n in self._norms:
            n.module.train(host.module.training)
        if self._handsync is not None:
            self._handsync.stop()
        self._ctls, self._module, self._handsync, self._norms = None, None, None, []


class SurgicalLayerSelect(LightningHooks):
    """``SurgicalLayerSelect(mode=...)`` builds the selection callback of that mode (every
    config and script written for the single class it once was keeps working):

    * ``blocks`` -> :class:`~lalr_lightning.callbacks.surgical.SurgicalBlocks` (fixed blocks);
    * ``auto_rgn``, ``eb_criterion`` -> :class:`~lalr_lightning.callbacks.autorgn.AutoRGN`;
    * ``lift``, ``lisa`` -> :class:`~lalr_lightning.callbacks.schedule.BlockSchedule`;
    * ``ntk`` -> :class:`~lalr_lightning.callbacks.ntkselect.NTKSelect` (Theorems 6-7 of the
      linearization paper);
    * ``spectrum`` -> :class:`~lalr_lightning.callbacks.spectrum.SpectrumSelect`;

    and any mode registered later (:func:`register_mode`). Arguments a mode does not take are
    an error listing the ones it does. ``switch_every`` is the deprecated name of
    ``every_n_steps``.

    Example (surgical fine-tuning of the first block, for an input-level shift)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import SurgicalLayerSelect
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> surgical = SurgicalLayerSelect(mode="blocks", select="first")
        >>> type(surgical).__name__  # the callback of that mode
        'SurgicalBlocks'
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[surgical])
        >>> trainer.fit(SmallCNN(width=16, in_channels=1), DigitsDataModule(batch_size=32))
        >>> surgical.selected == surgical.block_names[:1]  # the first block trains, the others are frozen
        True
        >>> type(SurgicalLayerSelect(mode="lisa", gamma=1, every_n_steps=5)).__name__
        'BlockSchedule'
    """

    def __new__(cls, mode: str = "blocks", **kwargs: Any):
        given = {k: v for k, v in kwargs.items() if v is not None}
        if mode not in _REGISTRY:
            raise unknown("mode", mode, MODES)
        target, fixed = _REGISTRY[mode]
        check_taken(f"SurgicalLayerSelect(mode={mode!r})", target, fixed, given)
        return target(**fixed, **given)


def _modes_signature() -> inspect.Signature:
    """``SurgicalLayerSelect``'s arguments: ``mode`` and every argument of the registered modes'
    own constructors (None: not given), so LightningCLI (jsonargparse) reads them; a new mode adds
    its own by registering."""
    mode = [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("mode", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="blocks", annotation=str)]
    return union_signature(mode, [_REGISTRY[m] for m in MODES])
