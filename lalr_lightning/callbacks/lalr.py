"""LALR: layer-adaptive learning rates from sequential SVD / CE / CS weight metrics.

"LALR: Layer-Adaptive Learning Rate Fine-Tuning Using Sequential Scaling Metrics". At the start of every epoch the layers' SVD, CE and CS metrics
are measured on the current weights (``core/spectral/lalr_metrics.py``); the epoch's phase picks one
of them (``svd -> ce -> cs -> svd ...``) and it becomes each layer's multiplier of whatever
learning rate the optimizer and scheduler set: ``lr_{l,e} = lr_e x scale_{l,e}`` (paper 3.2).

The paper's Appendix A as a Lightning callback::

    trainer = Trainer(max_epochs=3, callbacks=[LALRScheduleCallback()])
    trainer.fit(my_module)   # any LightningModule, its own AdamW / scheduler unchanged
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback
from lalr_lightning.callbacks.host import Cadence, Host, Traits, warn
from lalr_lightning.core.runtime.checks import check_finite
from lalr_lightning.core.spectral import lalr_metrics as lm
from lalr_lightning.core.spectral.lalr_metrics import DEFAULT_LAYER_TYPES, METRICS
from lalr_lightning.core.spectral.settings import lalr_layer_checks, lalr_settings

__all__ = ["LALRScheduleCallback"]


@dataclass(eq=False, repr=False)
class LALRScheduleCallback(LayerwiseCallback):
    """Per-layer learning-rate scales from LALR's SVD, CE and CS metrics, recomputed every epoch.

    Example (phases svd -> ce -> cs over three epochs on digits)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import LALRScheduleCallback
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> lalr = LALRScheduleCallback(groups="histogram", floor=0.1)
        >>> trainer = pl.Trainer(max_epochs=3, limit_train_batches=1, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[lalr])
        >>> trainer.fit(SmallCNN(width=16, in_channels=1), DigitsDataModule(batch_size=32))
        >>> [h["phase"] for h in lalr.history]
        ['svd', 'ce', 'cs']
        >>> min(lalr.multipliers.values())  # min-max gives 0 to one layer; the floor keeps it learning
        0.1

    Args:
        phases: ``mode="sequential"`` only: the metric of each epoch, cycled: epoch ``e`` uses ``phases[e % len(phases)]``
            (counted from the first epoch this callback sees, and continued on resume). Any
            order or subset of ``"svd"``, ``"ce"``, ``"cs"``; the paper's is the default.
        mode: ``"sequential"`` (the paper: one metric per epoch), ``"weighted"`` (B.4.4: the
            weighted sum of the three metrics every epoch) or ``"hessian"`` (B.4.5.3:
            ``eta_l ~ k / ((1 - M_SVD) e^{M_CE} M_CS)``). See
            :func:`~lalr_lightning.core.spectral.lalr_metrics.lalr_multipliers` for the formulas.
        floor: the multiplier is ``floor + (1 - floor) * metric``, so it spans ``[floor, 1]``.
            Min-max normalization gives exactly 0 to one layer in every phase, which would
            freeze that layer for the epoch; the default 0.1 keeps every layer learning at
            >= 10% of the scheduled rate (the paper's own B.4.5.2 asks for ``0 < f <= 1``)
            while keeping the metric's ordering and spread. ``floor=0`` is the paper exactly.
        weights: ``mode="weighted"`` only: ``{"svd": w, "ce": w, "cs": w}`` (missing = 0) or
            three numbers; default equal weights. B.4.4's relative mix is ``{"ce": .., "cs": ..}``.
        hessian_delta: ``mode="hessian"`` only (default 0.1): maps ``1 - M_SVD`` and ``M_CS`` onto
            ``[delta, 1]`` so that the layers min-max sets to 0 do not divide by zero.
        groups: ``"shape"`` (CE/CS between layers of the same weight shape, as transformer
            blocks are built; layers alone in their shape get ``singleton_value``) or
            ``"histogram"`` (every layer against every other through weight histograms; use it
            for CNNs, whose layer shapes are mostly unique).
        bins, hist_range: ``groups="histogram"`` only (default 64, 8.0); singleton_value:
            ``groups="shape"`` only (default 0.5); eps: see
            :func:`~lalr_lightning.core.spectral.lalr_metrics.lalr_metrics`.
        layer_types: matrix kinds scaled (``linear``, ``conv1d``, ``conv2d``, ``hf_conv1d``,
            ``embedding``); all by default -- the paper scales every weight of the LM.
        trainable_only: leave out layers with no trainable parameter (frozen base weights
            under LoRA; LoRA-wrapped layers count, measured on their merged weight).
        name: distinguishes several instances (checkpoint state and log prefix).
        strict_resume: refuse a checkpoint written with other settings (default).

    Biases and tied BatchNorms follow their layer; other parameters (LayerNorm, ...) keep the
    scheduled rate. Readable: ``phase`` (this epoch's), ``metrics`` (the DataFrame of
    :func:`lalr_metrics` at this epoch's start), ``multipliers`` (layer name -> multiplier),
    ``history``. Logged every epoch: ``<prefix>/svd/<layer>``, ``<prefix>/ce/<layer>``,
    ``<prefix>/cs/<layer>`` (final metrics), ``<prefix>/multiplier/<layer>``,
    ``<prefix>/phase`` (index in ``("svd", "ce", "cs")``, sequential mode), and
    ``lr_eff/<layer>`` at every logging step; with ``figures`` set, a layers x epochs heatmap of the
    multipliers goes to image loggers (W&B, TensorBoard).
    """

    traits = Traits(
        log_prefix="lalr",
        score_key="metric",
        decides_from_weights=True,  # plan(model): the decision without a fit
        heatmap=("multipliers", "LALR LR multipliers (epoch:phase)", "x scheduled LR"),
        esd_plots=True,
        readable=LayerwiseCallback.traits.readable + ("multipliers", "phase", "metrics"),
    )

    phases: Sequence[str] | None = None
    mode: str = "sequential"
    floor: float = 0.1
    weights: Mapping[str, float] | Sequence[float] | None = None
    hessian_delta: float | None = None
    groups: str = "shape"
    bins: int | None = None
    hist_range: float | None = None
    eps: float = 1e-12
    singleton_value: float | None = None
    layer_types: Sequence[str] = DEFAULT_LAYER_TYPES
    trainable_only: bool = True

    _checked_by = staticmethod(lalr_settings)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.multipliers: dict[str, float] = {}
        self.metrics: pd.DataFrame | None = None
        self.phase: str | None = None
        self._position = 0  # updates done = position in the phase cycle

    # ------------------------------------------------------------------ when

    def configure(self, host: Host, module: nn.Module) -> None:
        self.layers = lm.lalr_layers(module, layer_types=self.layer_types, trainable_only=self.trainable_only)
        note = lalr_layer_checks(type(self).__name__, type(module).__name__, self.layers, layer_types=self.layer_types,
                                 trainable_only=self.trainable_only, groups=self.groups,
                                 singleton_value=self.singleton_value)
        self._units = lm.lalr_units(self.layers, self.groups)  # the work units, while the weights are whole
        if note:
            warn(note)

    # every epoch, from the weights at its start; resumed inside an epoch already measured, the
    # checkpoint's decision stays (the cadence decides once per epoch)
    cadence = Cadence(every_n_epochs=1)

    # ------------------------------------------------------------------ what

    @property
    def next_phase(self) -> str:
        """The phase the next update will use (``mode`` itself outside sequential mode)."""
        return self.phases[self._position % len(self.phases)] if self.mode == "sequential" else self.mode

    def measure(self, host: Host, module: nn.Module) -> pd.DataFrame:
        """:func:`lalr_metrics` of the layers on the current weights, each rank measuring a
        share (whole shape groups, or single layers in histogram mode)."""

        def raw(layers):
            check_finite(type(self).__name__, host, {la.name: la.weight for la in layers}, "the weights")
            return lm.lalr_raw(layers, groups=self.groups, bins=self.bins, hist_range=self.hist_range, eps=self.eps)

        measured = self.measure_shards(host, module, self._units, raw)
        return lm.lalr_table(self.layers, measured, groups=self.groups, bins=self.bins, eps=self.eps,
                             singleton_value=self.singleton_value)

    def weight_of(self, layer) -> torch.Tensor:
        return lm.layer_weight(layer)  # a LoRA layer is measured on W + s BA

    def decide(self, metrics: pd.DataFrame) -> Decision:
        phase = self.next_phase
        kw = dict(mode=self.mode, phase=phase if self.mode == "sequential" else "svd", weights=self.weights,
                  hessian_delta=self.hessian_delta)
        mults = lm.lalr_multipliers(metrics, floor=self.floor, **kw)
        raw = lm.lalr_multipliers(metrics, floor=0.0, **kw)  # the metric behind the multiplier, in [0, 1]
        measured = {m: dict(zip(metrics["name"], metrics[m].astype(float))) for m in METRICS}
        summary = {"phase": float(METRICS.index(phase))} if self.mode == "sequential" else {}
        return Decision(values=mults, scores=raw, measurements=measured, record={"phase": phase}, summary=summary,
                        payload=metrics)

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.metrics = decision.payload
        self.phase = decision.record["phase"]

    def commit(self, host: Host, decision: Decision) -> None:
        self._position += 1
        super().commit(host, decision)

    def heatmap_xlabel(self) -> str:
        return "epoch:phase"

    def heatmap_columns(self) -> list[str]:
        return [f"{h['epoch']}:{h['phase']}" for h in self.history]

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        # plain Python containers only (pandas gives Python numbers), so checkpoints load with
        # torch.load(weights_only=True)
        metrics = None if self.metrics is None else self.metrics.to_dict("list")
        last_epoch = self.history[-1]["epoch"] if self.history else None  # kept in the state as it always was
        return {"position": self._position, "last_epoch": last_epoch, "phase": self.phase, "metrics": metrics}

    def _load_state(self, state: dict) -> None:
        self._position = int(state["position"])
        self.phase = state.get("phase")
        m = state.get("metrics")
        self.metrics = pd.DataFrame(m) if m is not None else None
