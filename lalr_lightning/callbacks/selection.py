"""What every callback that chooses which layers train shares, and ``SurgicalLayerSelect``, the
one name that builds any of them by ``mode``.

A selection callback decides ``selected`` -- the units (blocks; tensors for Auto-RGN) that
train -- and this base turns that into control: the others are frozen through
:class:`~lalr_lightning.core.control.LayerControl` (DDP-safe), their ``requires_grad`` is
turned off where that saves compute safely (``save_compute``: in ``setup`` before the model
is wrapped, or at every switch on a single device; given back at teardown), and norm layers
that cannot change keep their running statistics (:mod:`lalr_lightning.core.norms`).
Logged at every logging step: ``<prefix>/selected/<block>`` (1 when the block trains).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, renamed
from lalr_lightning.core.control import LayerControl
from lalr_lightning.core.layers import Layer, block_layers
from lalr_lightning.core.norms import NORM_EVAL, norm_layers, set_norm_modes

__all__ = ["LayerSelection", "SurgicalLayerSelect", "MODES", "register_mode"]

#: ``SurgicalLayerSelect`` modes, each built by the callback registered for it.
MODES: tuple[str, ...] = ()
_REGISTRY: dict[str, tuple[type, dict[str, Any]]] = {}


_ORDER = ("blocks", "auto_rgn", "eb_criterion", "lift", "lisa", "ntk")  # how the modes are listed


def register_mode(mode: str, cls: type, **fixed: Any) -> None:
    """Make ``SurgicalLayerSelect(mode=mode, ...)`` build ``cls(**fixed, ...)``."""
    global MODES
    _REGISTRY[mode] = (cls, fixed)
    MODES = tuple(sorted(_REGISTRY, key=lambda m: (_ORDER.index(m) if m in _ORDER else len(_ORDER), m)))


class LayerSelection(LayerwiseCallback):
    """Base of the selection callbacks (module docstring). Subclasses find ``self.layers`` (the
    units) in ``setup`` -- :meth:`find_blocks` for blocks -- and decide ``values`` of 1.0
    (trains) / 0.0 (frozen) per unit."""

    decision_attr = "selected"
    decision_key = "selected"
    heatmap = ("selection", "{self.title} selection", "selected")
    readable = LayerwiseCallback.readable + ("selected",)
    volatile_settings = ("norm_eval", "save_compute")
    title: ClassVar[str] = "layer"

    def __init__(self, *, blocks: Sequence[str | Sequence[str]] | None = None, join_stem: bool = True,
                 norm_eval: str = "frozen", save_compute: bool = True, name: str | None = None,
                 strict_resume: bool = True):
        super().__init__(name=name, strict_resume=strict_resume)
        if norm_eval not in NORM_EVAL:
            raise ValueError(f"unknown norm_eval {norm_eval!r}; valid: {', '.join(NORM_EVAL)}")
        self.blocks = None if blocks is None else list(blocks)
        self.join_stem = bool(join_stem)
        self.norm_eval = norm_eval
        self.save_compute = bool(save_compute)
        self.selected: list[str] = []
        self.block_list: list[Layer] = []  # the model's blocks (the units, or their labels)
        self._norms: list = []
        self._module: pl.LightningModule | None = None
        self._ctls: list[LayerControl] | None = None
        self._held: set[int] = set()  # ids of the parameters some optimizer holds

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

    def find_blocks(self, pl_module: nn.Module, *, head: bool = True, min_blocks: int = 2) -> list[Layer]:
        """The model's blocks (``blocks`` patterns, or found: timm groups / repeated children); a
        clear error when there are fewer than ``min_blocks`` to choose between."""
        self.block_list = block_layers(pl_module, self.blocks, join_stem=self.join_stem, head=head)
        if len(self.block_list) < min_blocks:
            raise ValueError(
                f"{type(pl_module).__name__} has a single block ({self.block_names}), so there is nothing to "
                "select; pass blocks=[...] (one module-name prefix or ^regex per block) to split it, or "
                "fine-tune without a selection callback"
            )
        return self.block_list

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._module = pl_module
        super().setup(trainer, pl_module, stage)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._norms = norm_layers(pl_module, self.block_list)
        self._ctls = self.controls(trainer)
        self._held = {id(p) for ctl in self._ctls for p in ctl.params}
        super().on_fit_start(trainer, pl_module)

    # ------------------------------------------------------------------ the decision

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.selected = [u.name for u in self.layers if decision.values.get(u.name, 0.0) > 0]

    def apply(self, trainer: pl.Trainer) -> None:
        """Freeze every unit not selected; on a single device also turn its gradients off."""
        on = set(self.selected)
        self.apply_frozen(trainer, [u.name for u in self.layers if u.name not in on])
        if self.save_compute and self.switches and isinstance(trainer.strategy, SingleDeviceStrategy):
            self.set_requires_grad([u for u in self.layers if u.name in on], True)
            self.set_requires_grad([u for u in self.layers if u.name not in on], False)
        self.apply_norm_modes()

    #: whether the selection changes during training (then ``requires_grad`` follows it on one device)
    switches: ClassVar[bool] = False

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

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.apply_norm_modes()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.apply_norm_modes()  # cheap; guards against a train() call since epoch start
        if trainer.loggers and trainer._logger_connector.should_update_logs and self.block_list:
            on = set(self.selected_blocks())
            self.log_values(trainer, {f"{self.prefix}/selected/{b}": float(b in on) for b in self.block_names})
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if stage == "fit":
            for n in self._norms:
                n.module.train(pl_module.training)
            self._ctls, self._module = None, None


class SurgicalLayerSelect(Callback):
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

    def __new__(  # explicit arguments, so LightningCLI (jsonargparse) can read them
        cls,
        mode: str = "blocks",
        select: str | int | Sequence[str | int] | None = None,
        blocks: Sequence[str | Sequence[str]] | None = None,
        join_stem: bool | None = None,
        order: str | None = None,
        every_n_steps: int | None = None,
        gamma: int | None = None,
        n_batches: int | None = None,
        every_n_epochs: int | None = None,
        exclude: Sequence[str] | None = None,
        excluded_multiplier: float | None = None,
        eb_threshold: float | None = None,
        loss_fn: Any = None,
        norm_eval: str | None = None,
        save_compute: bool | None = None,
        seed: int | None = None,
        kappa_max: float | None = None,
        sigma: float | None = None,
        max_layers: int | None = None,
        probe_size: int | None = None,
        kernel: str | None = None,
        top_percent: float | None = None,
        types: dict[str, str] | None = None,
        head: bool | None = None,
        embeddings: bool | None = None,
        layer_types: Sequence[str] | None = None,
        plot_every_n_epochs: int | None = None,
        name: str | None = None,
        strict_resume: bool | None = None,
        switch_every: int | None = None,
    ):
        given = {k: v for k, v in locals().items() if k not in ("cls", "mode") and v is not None}
        if mode not in _REGISTRY:
            raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        target, fixed = _REGISTRY[mode]
        params = inspect.signature(target).parameters
        stray = sorted(set(given) - set(params))
        if stray:
            valid = sorted(k for k in params if k not in fixed and k != "self")
            raise ValueError(f"SurgicalLayerSelect(mode={mode!r}) builds {target.__name__}, which does not take "
                             f"{', '.join(stray)}; it takes: {', '.join(valid)}")
        return target(**fixed, **given)
