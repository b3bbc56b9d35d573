"""HT-SR pruning: layer-wise pruning ratios from a spectral metric (AlphaPruning, thesis ch. 3).

"Layerwise Training of Deep Neural Networks" (https://www2.eecs.berkeley.edu/Pubs/TechRpts/2023/EECS-2023-126.html) ch. 3 and AlphaPruning. The ratios, masks and channel budgets are
pure functions in :mod:`lalr_lightning.core.pruning.alphapruning`; this callback decides when to prune, and
hands the masks to :class:`~lalr_lightning.core.runtime.control.LayerControl`, which enforces them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, deprecated_arg, renamed
from lalr_lightning.callbacks.host import Cadence, Host, Traits, warn
from lalr_lightning.core.model.layers import DEFAULT_KINDS
from lalr_lightning.core.model.probe import forward_order
from lalr_lightning.core.pruning import alphapruning as ap
from lalr_lightning.core.pruning import by_criterion as bc
from lalr_lightning.core.pruning.alphapruning import DIRECTIONS, PRUNING_METRICS, pruning_ratios
from lalr_lightning.core.pruning.criteria import CRITERIA, needs_stats
from lalr_lightning.core.pruning.owl import owl_layer_ratios
from lalr_lightning.core.pruning.settings import PRESETS, check_when, pruning_settings
from lalr_lightning.core.runtime.checks import check_finite
from lalr_lightning.core.runtime.shards import (
    all_sum,
    layer_paths,
    layers_in,
    local_tensor,
    partitioned,
    shard_layout,
    sharded,
)

__all__ = ["HTSRPruning", "PRESETS", "PRUNING_METRICS", "DIRECTIONS", "CRITERIA", "pruning_ratios"]


@dataclasses.dataclass
class _Event:
    """What one pruning event's decision reads, taken from the host by ``measure`` (the decision
    runs on rank zero with only what ``measure`` returned): the metric (None once the ratios are
    fixed), the schedule's ``level``, the counters an error names, the world size, and the
    calibration data (``batches``: the training loader as given; None outside a fit)."""

    metric: dict[str, float] | None
    level: float
    current_epoch: int
    global_step: int
    world_size: int
    batches: Callable[[], Any] | None
    to_device: Callable[[Any], Any]
    #: the calibration samples, taken once per event: OWL's ratios and the masks share them
    samples: list | None = None


@dataclass(eq=False, repr=False)
class HTSRPruning(LayerwiseCallback):
    """Prune each layer by a ratio set by an HT-SR metric; mean sparsity equals the target.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import HTSRPruning
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> pruner = HTSRPruning(metric="alpha", target_sparsity=0.5, epsilon=0.3, min_evals=5)
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[pruner])
        >>> trainer.fit(SmallCNN(width=16, in_channels=1), DigitsDataModule(batch_size=32))
        >>> round(pruner.overall_sparsity(), 2)  # parameter-weighted over the pruned layers
        0.5

    AlphaPruning's LLM recipe is ``HTSRPruning(preset="alphapruning", target_sparsity=0.7,
    epsilon=0.2, criterion="wanda")`` (``docs/alphapruning.md``: what it sets, how the criteria
    are calibrated, and what still differs from the reference code).

    Args:
        preset: ``"alphapruning"`` fills in the arguments left out (``None``) with AlphaPruning's
            LLM settings: ``metric="alpha"``, ``fit="peak"``, ``filter_zeros=False``,
            ``block_average=True``, ``epsilon=0.3``, ``min_numel=1``, ``min_evals=3``. Arguments
            given explicitly win. ``"owl"``: OWL's ratios (``owl_m``, ``owl_lambda``) instead of an HT-SR
            metric (``docs/llm_pruning.md``). ``None`` (default): the defaults listed below.
        metric: the per-layer metric (:data:`PRUNING_METRICS`: ``alpha``, ``alpha_weighted``,
            ``log_alpha_norm``, ``stable_rank``, ``entropy``, ``spectral_norm``,
            ``log_spectral_norm``, ``norm``, ``log_norm``, ``rand_distance``, ``snr``).
        target_sparsity: the parameter-weighted mean of the ratios over the pruned layers'
            weights, in ``[0, 1)``; default 0.5 (with N:M: ``n / m``, the only value accepted).
        epsilon: half-width of the ``[1 - eps, 1 + eps]`` map (AlphaPruning: 0.3).
            ``epsilon=0`` is uniform pruning (the metric is then not even computed).
        direction: ``more_for_larger`` (AlphaPruning: higher alpha, less trained, prunes more;
            the thesis' table 3.1 settings 1/3) or ``more_for_smaller`` (settings 2/4).
        structured: ``False``: per-layer pruning of single weights by ``criterion`` (magnitude:
            the smallest-|w| ``round(ratio_l * numel)`` weights of each layer). ``True``: output-channel pruning by
            channel L2 norm under the thesis' incremental budget (see
            :func:`incremental_channel_budgets`: a layer prunes
            ``floor(floor(ratio_l / channel_step) * channel_step * C_l)`` channels). A pruned
            channel's weight row, bias entry and tied BatchNorm weight/bias are all zeroed.
            The next layer's weights that read a pruned channel stay as they are (they see
            zeros); sparsity is counted per layer, on its own output channels, as the thesis.
        when: ``"fit_start"`` (one shot, before the first step and before the sanity check),
            an epoch number (one shot at the start of that epoch, on the weights trained so
            far), or ``"gradual"``.
        gradual_epochs: with ``when="gradual"``: at the start of epochs ``0 .. n-1`` the model
            is pruned to ``target * (1 - (1 - (e + 1) / n)^3)`` (Zhu & Gupta's cubic schedule);
            each layer's ratio is scaled by the same factor, pruned weights stay pruned, and
            the metric (hence the ratios) is measured once, at the first event.
        block_average: average the metric over the pruned matrices of each block
            (:func:`block_layers`; AlphaPruning's default for transformers). ``blocks``: the
            block patterns for :func:`block_layers` when auto-detection does not fit.
        fit: the power-law fit for alpha-based metrics (default ``ks``, as WeightWatcher; AlphaPruning's
            ``alpha_peak`` is ``peak``).
        filter_zeros: alpha-based metrics only: fit only eigenvalues above 1e-5 (default True, as
            WeightWatcher; AlphaPruning fits all of them).
        min_numel, min_evals, layer_types, head: which layers (defaults 512, 10) are pruned (``head``: the output
            layer too; AlphaPruning keeps it dense); see :func:`~lalr_lightning.core.pruning.alphapruning.prunable_layers`.
            Excluded layers are reported in a warning.
        overflow, max_ratio: a ratio above ``max_ratio`` is clipped and the excess
            redistributed (default) or an error; see :func:`pruning_ratios`.
        channel_step: ``structured`` only: the increment of the incremental budget (thesis: 0.01).
        make_permanent: at fit end, apply the masks a last time and then drop them: the
            callback stops enforcing them (later training may revive weights) and its state
            no longer carries them. The weights themselves are always plain zeros in the
            model's own tensors (no ``torch.nn.utils.prune`` reparametrization, state-dict
            keys never change), so there is nothing else to "make permanent". Default False:
            the masks stay and are enforced in any later ``fit`` with this callback.
        name: distinguishes several instances (checkpoint state and log prefix).
        strict_resume: refuse a checkpoint written with other settings (default).
        criterion: which weights of a layer go (keyword-only, as the arguments below):
            ``"magnitude"`` (default; the smallest |w|, no data), ``"wanda"`` (|w| times the norm
            of its input feature over calibration tokens, the ``int(ratio * in)`` lowest of every
            output row) or ``"sparsegpt"`` (one-shot OBS: the mask from ``w^2 / [H^-1]_jj`` and the
            kept weights of the row updated to compensate, ``H`` from the calibration inputs).
            Wanda and SparseGPT prune the rows of Linear layers, and convolutions (``groups=1``) as
            ``(out, in x kh x kw)`` matrices against their unfolded inputs (unstructured only; N:M
            takes Linear layers: ``layer_types=("linear",)``), once (not ``when="gradual"``).
        n, m: N:M semi-structured sparsity: ``n`` of every ``m`` consecutive input weights of each
            row pruned (2:4, 4:8), any criterion. Every layer is then pruned at ``n / m``: the HT-SR
            per-layer ratios do not apply (AlphaPruning's code ignores them under N:M too), so a
            ``preset``, ``epsilon > 0`` or another ``target_sparsity`` is an error. ``n = m = 0``
            (default): unstructured.
        n_calibration: ``wanda`` / ``sparsegpt``: the number of sequences (samples) calibrated on,
            the first ones of the calibration loader (default 128, as Wanda and AlphaPruning); fewer
            available: all of them, with a warning.
        calibration: ``wanda`` / ``sparsegpt``: an iterable of batches to calibrate on (default:
            the fit's training loader, as given to the host -- without the DDP sampler). Causal
            LM batches: ``input_ids`` tensors, ``(input_ids, ...)`` tuples or dicts with
            ``input_ids`` (and ``attention_mask``: padding is left out of the statistics).
            A Hugging Face causal LM (LLaMA, OPT, GPT-2, GPT-NeoX layouts) is calibrated block by
            block in the order it runs them: each block's inputs are the outputs of the blocks
            before it, already pruned. A model without such blocks runs its ``forward`` on ``x``
            of each ``(x, ...)`` batch (or a tensor batch, or a dict as keyword arguments), once,
            dense, and every layer is pruned from those inputs.
        blocksize, percdamp: ``sparsegpt`` only: the columns per lazy-update block (128) and the
            Hessian dampening as a fraction of its mean diagonal (0.01), SparseGPT's defaults.
        owl_m, owl_lambda: ``preset="owl"`` only (defaults 5 and 0.08, as ``prune --preset owl``): at the
            pruning event each transformer block's outlier share ``D`` (its Wanda scores above ``owl_m`` x
            their mean) is measured on the dense model from the calibration data (``n_calibration``,
            ``calibration``, as Wanda's, whatever ``criterion``), and
            :func:`~lalr_lightning.core.pruning.owl.owl_ratios` gives every matrix of the block its ratio
            (unweighted mean over the blocks = ``target_sparsity``, span ``2 x owl_lambda``); ``scores``
            holds each matrix's block ``D``. Needs a Hugging Face causal LM; every matrix of the blocks
            is pruned (``min_numel=1``, ``min_evals=1``); HT-SR's ``metric``, ``epsilon``, ``fit``,
            ``filter_zeros``, ``block_average``, ``blocks`` are refused.
        exclude_head: deprecated: ``head = not exclude_head``.

    Calibrated pruning happens on rank zero (the block-by-block pass needs each block pruned
    before the next is measured, so it prunes rank zero's weights as it goes); the masks -- and
    SparseGPT's updated weights -- are broadcast, so every rank holds the same bits. A resumed run
    takes the masks (and the weights) from the checkpoint and does not calibrate again.

    Enforcement (by :class:`~lalr_lightning.core.runtime.control.LayerControl`): the gradients of
    pruned entries are zeroed in ``on_before_optimizer_step`` (after DDP's all-reduce and
    before gradient clipping, so momentum and Adam moments never see them), the optimizer
    states of newly pruned entries are zeroed at each pruning event, and the masks are
    re-applied right after each update, after every other post-step transform. Masks are in
    :meth:`state_dict`, so a resumed run keeps enforcing them.

    Readable: ``ratios`` and ``scores`` (layer -> ratio / metric value; ``metric_values`` is the
    deprecated name of ``scores``), ``sparsity`` (layer ->
    achieved fraction of zero weights), ``channels`` (structured: layer -> pruned channels),
    ``masks`` (parameter name -> bool keep-mask), ``excluded`` (layer -> reason).
    Logged: ``<prefix>/ratio/<layer>``, ``<prefix>/sparsity/<layer>``,
    ``<prefix>/metric/<layer>``, ``<prefix>/overall_sparsity`` (over all pruned layers' weights) at each
    pruning event and at fit end; with ``figures`` set, a heatmap of the per-layer ratios and sparsities.
    """

    traits = Traits(
        log_prefix="pruning",
        decision_attr="ratios",
        decision_key="ratio",
        score_key="metric",
        logs_lr=False,
        decides_from_weights=True,  # plan(model): the decision without a fit
        esd_plots=True,
        volatile_settings=("make_permanent", "calibration"),  # a resumed run does not calibrate again
        readable=LayerwiseCallback.traits.readable + ("ratios", "sparsity", "channels", "masks", "excluded"),
        heatmap=("ratios", "HT-SR pruning ({self.metric}, {self.direction})", "fraction pruned"),
        heatmap_min_entries=1,
    )

    metric: str | None = None
    target_sparsity: float | None = None
    epsilon: float | None = None
    direction: str = "more_for_larger"
    structured: bool = False
    when: str | int = "fit_start"
    gradual_epochs: int | None = None
    block_average: bool | None = None
    blocks: Sequence[str] | None = None
    fit: str | None = None
    filter_zeros: bool | None = None
    min_numel: int | None = None
    min_evals: int | None = None
    layer_types: Sequence[str] = DEFAULT_KINDS
    head: bool = False
    overflow: str = "redistribute"
    max_ratio: float = 0.99
    channel_step: float | None = None
    make_permanent: bool = False
    preset: str | None = None
    _: KW_ONLY
    criterion: str = "magnitude"
    n: int = 0
    m: int = 0
    n_calibration: int | None = None
    calibration: Iterable | None = None
    blocksize: int | None = None
    percdamp: float | None = None
    owl_m: float | None = None
    owl_lambda: float | None = None
    exclude_head: bool | None = deprecated_arg("head", lambda v: {"head": not v})

    _checked_by = staticmethod(pruning_settings)  # the preset's values and the defaults filled in

    def __post_init__(self) -> None:
        super().__post_init__()
        # under FSDP, masks from whole layers, run during training
        self.traits = self.traits.but(needs_whole_model=self.when != "fit_start" and (
            self.criterion != "magnitude" or bool(self.m) or self.preset == "owl"))
        self.ratios: dict[str, float] = {}
        self.sparsity: dict[str, float] = {}
        self.channels: dict[str, int] = {}
        self.masks: dict[str, torch.Tensor] = {}
        self.excluded: dict[str, str] = {}
        self._model: torch.nn.Module | None = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._fresh = False
        self._weights: dict[str, torch.Tensor] = {}  # SparseGPT's updated weights, from rank zero
        self._paths: dict[str, tuple] = {}  # where each layer sits in the model (core.shards.layer_paths)

    metric_values = renamed("scores")  # deprecated name of ``scores`` (the metric per pruned layer)

    # ------------------------------------------------------------------ when

    @property
    def cadence(self) -> Cadence:
        """The pruning events: at the fit's start (``"fit_start"``), at the start of epoch ``when``
        (or the first epoch after it a resumed fit starts before pruning), or at the start of each
        of the ``gradual_epochs`` epochs; each once, a resumed fit too."""
        if self.when == "fit_start":
            return Cadence(start=True)
        if self.when == "gradual":
            return Cadence(epochs=tuple(range(self.gradual_epochs)))
        return Cadence(epochs=(int(self.when),))

    def _level(self, epoch: int) -> float:
        """The fraction of each ratio pruned at an event of ``epoch`` (Zhu & Gupta's cubic schedule)."""
        return ap.cubic_sparsity(epoch, self.gradual_epochs) if self.when == "gradual" else 1.0

    def configure(self, host: Host, module: nn.Module) -> None:
        check_when(type(self).__name__, self.when, self.gradual_epochs, host.max_epochs)  # plan(): no max_epochs
        self._model = module
        layers, self.excluded = ap.prunable_layers(module, layer_types=self.layer_types, head=self.head,
                                                   min_numel=self.min_numel, min_evals=self.min_evals,
                                                   trace=forward_order(host, module, getattr(self, "loss_fn", None)))
        ap.refuse_lora_parts(module, layers, type(self).__name__, self.n, self.m)
        self.layers, packed = bc.readable_layers(layers, self.criterion, self.n, self.m)
        self.excluded.update(packed)
        note = ap.dense_note(self.excluded)
        if note:
            warn(note, category=UserWarning)
        self._params = {n: p for layer in self.layers for n, p in layer.params.items()}
        # the whole weights' sizes, read here, before any FSDP wrap (then each rank holds a piece)
        self._whole_numel = {la.name: int(getattr(la.weight, "ds_numel", la.weight.numel())) for la in self.layers}

    def prepare(self, host: Host) -> None:
        if self.whole is not None:
            self._paths = layer_paths(host.module, self.layers)
        elif sharded(host) and self.when == "fit_start":
            self._prune_whole(host)

    def _prune_whole(self, host: Host) -> None:
        """Under FSDP: the pruning event of ``when="fit_start"`` on the whole weights, here in
        ``setup``, before the strategy shards them (calibration runs block by block on rank zero,
        which a sharded model cannot do alone); recorded and enforced, on each rank's shards, at
        fit start. A resumed run decides again here and the checkpoint's masks then replace it
        (Lightning restores FSDP checkpoints only after fit start)."""
        if self.masks:
            return  # kept from an earlier fit: enforced at fit start
        self._model.to(host.device)  # where the strategy shards it next (and the batches go)
        decision = self.decide_everywhere(host, self.measure(host, self._model))
        masks, channels, weights = decision.payload
        if weights and not host.is_global_zero:  # SparseGPT moved the kept weights: before the cut
            bc.load_weights(self._params, weights)
        self.early = dataclasses.replace(decision, payload=(masks, channels, {}))

    def first_decision(self, host: Host) -> None:
        if self.early is not None:
            self.commit(host, self.early)  # decided in setup (FSDP): recorded, enforced and logged now
        elif self.masks:  # kept from a previous fit: enforce at once
            ap.check_known_masks(self.masks, self._params)
            self.apply(host)
        elif self.cadence.start:
            self.update(host, host.module)  # when="fit_start": the cadence's start

    def resumed(self, late: bool) -> None:
        if self._params:  # configured: the owner enforces the checkpoint's masks where the strategy's restore is done
            ap.check_known_masks(self.masks, self._params)

    def finish(self, host: Host) -> None:
        if not self.masks:
            return
        for ctl in self.controls(host):
            ctl.apply_masks()
        self.sparsity = self._measure(host)
        self.log_values(host, self._sparsity_metrics())
        if self.make_permanent:
            for ctl in self.controls(host):
                ctl.set_masks(self.state_key, {})
            self.masks = {}

    # ------------------------------------------------------------------ what

    def update(self, host: Host, module: nn.Module) -> Decision:
        """One pruning event (each one the cadence makes due): the ratios (the first event only),
        the masks at the schedule's level x ratio, applied. Where the masks come from depends on
        how the weights are held: the live model, FSDP shards or ZeRO-3 partitions
        (:meth:`_prune_sharded`) or rank zero's whole copy (:meth:`_prune_on_copy`)."""
        if self.whole is not None:
            return self._prune_on_copy(host)
        if sharded(host) or partitioned(host):
            return self._prune_sharded(host)
        return super().update(host, self._model)

    def _prune_sharded(self, host: Host) -> Decision:
        """A magnitude pruning event during training under FSDP or ZeRO-3: the ratios decided on rank zero
        from the metric (measured on whole weights, a share of the layers per rank), then each
        rank computes the masks of its share of the layers on their whole weights (one
        threshold per layer, as on one device) and the masks are all-gathered; each rank then
        enforces its piece of every mask (``apply``)."""
        # rank zero decides the ratios alone: the ranks compute the masks after the broadcast
        event = self.measure(host, self._model)
        decision = self.decide_everywhere(host, event,
                                          lambda ev: self._decide(ev, self._model, self.layers, masks=False))
        layout = shard_layout(host, self._model)
        shapes = {k: layout.shape(p) for k, p in self._params.items()}
        real = {la.name: la for la in self.layers}

        def masks_of(stand_ins):
            return {s.name: ap.layer_masks([real[s.name]], decision.values, event.level, structured=self.structured,
                                           channel_step=self.channel_step, previous=self.masks,
                                           weights={s.name: s.weight}, shapes=shapes)
                    for s in stand_ins}

        masks, channels = {}, {}
        for m, c in self.measure_shards(host, self._model, [[la] for la in self.layers], masks_of).values():
            masks.update(m)
            channels.update(c)
        decision = dataclasses.replace(decision, payload=(masks, channels, {}))
        self.commit(host, decision)
        return decision

    def _prune_on_copy(self, host: Host) -> Decision:
        """A Wanda / SparseGPT / N:M pruning event during training under FSDP: the metric measured
        as for magnitude (a share of the layers per rank), then the masks decided on rank zero's
        whole copy of the model (calibration runs block by block and prunes as it goes, which a
        sharded model cannot do) and broadcast with SparseGPT's weights; each rank keeps its
        piece of both (``apply``)."""
        event = self.measure(host, self._model)

        def on_copy(whole: torch.nn.Module) -> Decision:
            decision = self._decide(event, whole, layers_in(whole, self.layers, self._paths))
            masks, channels, weights = decision.payload
            return dataclasses.replace(decision, payload=({k: v.cpu() for k, v in masks.items()}, channels, weights))

        decision = self.with_whole_model(host, on_copy)
        self.commit(host, decision)
        return decision

    def measure(self, host: Host, module: nn.Module) -> _Event:
        """The event: the metric of every pruned layer on the current weights (block-averaged if
        asked), None once the ratios are fixed (the first event decides them): the weights are then
        only checked, as a later gradual event masks what diverged otherwise (under FSDP each rank
        checks its share of the layers, whole, and an error on one is raised on all); and what the
        decision needs of the fit (:class:`_Event`)."""
        batches = functools.partial(host.batches, as_given=True) if host.has_data else None
        return _Event(self._metric(host, module), self._level(host.current_epoch), host.current_epoch,
                      host.global_step, host.world_size, batches, host.to_device if host.has_data else None)

    def _metric(self, host: Host, module: nn.Module) -> dict[str, float] | None:
        fixed = bool(self.ratios)
        if not fixed and (self.epsilon == 0 or self.preset == "owl"):  # uniform, or OWL: from the activations
            return {}

        def metric(layers):
            check_finite(type(self).__name__, host, {layer.name: layer.weight for layer in layers}, "the weights")
            return {} if fixed else ap.layer_metric(layers, self.metric, fit=self.fit, filter_zeros=self.filter_zeros)

        values = self.measure_shards(host, module, [[layer] for layer in self.layers], metric)
        if fixed:
            return None
        values = ap.finite_metric(values, [layer.name for layer in self.layers], self.metric)
        if self.block_average:
            values = ap.block_average_values(values, ap.block_groups(self._model, self.layers, self.blocks))
        return values

    def _ratio_array(self, metric: dict[str, float]) -> np.ndarray:
        """The ratio of every pruned layer (model order) from its metric."""
        return pruning_ratios([metric.get(la.name, 0.0) for la in self.layers], [self._numel(la) for la in self.layers],
                              self.target_sparsity, self.epsilon, self.direction, overflow=self.overflow,
                              max_ratio=self.max_ratio)

    def plan(self, model: torch.nn.Module):
        """The ratios this callback would prune ``model`` with, without a fit (no mask is computed,
        the model is not touched; :meth:`LayerwiseCallback.plan`): one row per pruned layer with
        ``layer``, ``numel`` (the weights of the layer's matrix), ``metric`` and ``ratio``.

        ``target_sparsity`` is the mean of ``ratio`` weighted by ``numel``,
        ``(plan.ratio * plan.numel).sum() / plan.numel.sum()``, the fraction of the pruned layers'
        weights that goes; not the plain mean of the column, which is lower when the larger layers
        get the larger ratios (about 0.63 for a 0.7 target on a randomly initialised timm ResNet-18).
        """
        return super().plan(model)

    def plan_columns(self) -> dict[str, dict[str, int]]:
        # the sizes the ratios are weighted by, so the table shows the target is met
        return {"numel": {la.name: la.weight.numel() for la in self.layers}}

    def plan_decision(self, event: _Event) -> Decision:
        """The ratios alone, for :meth:`plan`: no mask is computed (nor, for the data criteria, a
        calibration run), so the model is not touched."""
        decision = self._decide(event, self._model, self.layers, masks=False)  # OWL: a forward pass, no more
        return Decision(values=decision.values, scores=decision.scores)

    def decide(self, event: _Event) -> Decision:
        return self._decide(event, self._model, self.layers)

    def _decide(self, event: _Event, module: nn.Module, layers: list, masks: bool = True) -> Decision:
        """The decision on ``module`` (the live model, or rank zero's whole copy of it) and its
        ``layers``; without ``masks``, the ratios alone (the ranks compute the masks)."""
        names = [layer.name for layer in layers]
        record: dict = {"level": event.level}
        metric = event.metric
        if metric is None:  # later events of a gradual schedule: the ratios stand
            metric, ratios = dict(self.scores), dict(self.ratios)
        elif self.preset == "owl":  # on rank zero (its whole copy under FSDP), the dense model
            ratios, metric = self._owl(event, module, layers, record)
        else:
            ratios = dict(zip(names, self._ratio_array(metric).tolist()))
        weights: dict[str, torch.Tensor] = {}
        if not masks:
            found, channels = {}, {}
        elif self.criterion == "magnitude" and not self.m:
            found, channels = ap.layer_masks(layers, ratios, event.level, structured=self.structured,
                                             channel_step=self.channel_step, previous=self.masks)
        else:
            found, channels = self._criterion_masks(event, ratios, record, module, layers), {}
            if self.criterion == "sparsegpt" and event.world_size > 1:
                # it moved the kept weights too: the other ranks copy them
                params = {n: p for la in layers for n, p in la.params.items()}
                weights = {k: params[k].detach().cpu().clone() for k in found}
        return Decision(values=ratios, scores=metric, record=record, payload=(found, channels, weights))

    def _criterion_masks(self, event: _Event, ratios: dict[str, float], record: dict, module: nn.Module,
                         layers: list) -> dict[str, torch.Tensor]:
        """Rank zero: Wanda / SparseGPT / N:M masks. Calibrating block by block needs each block
        pruned before the next is measured, so this prunes rank zero's weights in place as it
        goes; the other ranks get the masks (and SparseGPT's weights) in the broadcast decision."""
        batches = self._calibration_batches(event, record) if needs_stats(self.criterion) else None
        check_finite(type(self).__name__, event, {la.name: la.weight for la in layers}, "the weights")
        # blocksize and percdamp: sparsegpt's own (its defaults filled in by the settings), None for the others
        return bc.criterion_prune(module, layers, ratios, self.criterion, batches, n=self.n, m=self.m,
                                  blocksize=self.blocksize, percdamp=self.percdamp,
                                  forward=functools.partial(self._forward, event, module), convolutions=True)

    def _owl(self, event: _Event, module: nn.Module, layers: list,
             record: dict) -> tuple[dict[str, float], dict[str, float]]:
        """OWL's ratio and block outlier share ``D`` of every pruned layer (``prune --preset owl``'s
        :func:`~lalr_lightning.core.pruning.owl.owl_layer_ratios`), from the calibration batches the
        masks then use too."""
        check_finite(type(self).__name__, event, {la.name: la.weight for la in layers}, "the weights")
        return owl_layer_ratios(module, layers, self._calibration_batches(event, record), self.target_sparsity,
                                self.owl_m, self.owl_lambda, who="HTSRPruning(preset='owl')")

    def _calibration_batches(self, event: _Event, record: dict) -> list:
        """The first ``n_calibration`` samples of the calibration data, taken once per pruning event:
        ``calibration``, else the training loader as the user gave it (datamodule, module or fit()
        argument), without the DistributedSampler a DDP run adds, so rank zero calibrates on the
        same data at any world size."""
        if event.samples is None:
            who = "preset='owl'" if self.preset == "owl" and not needs_stats(self.criterion) else \
                f"criterion={self.criterion!r}"
            event.samples = bc.calibration_samples(self.calibration, event.batches, self.n_calibration, who)
        record["calibration_samples"] = bc.sample_count(event.samples)
        return event.samples

    def _forward(self, event: _Event, module: nn.Module, batch) -> None:
        """Run a model without transformer blocks on one calibration batch, on the fit's device."""
        bc.calibration_forward(module, event.to_device(batch), self.criterion)

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        masks, channels, weights = decision.payload
        self.masks = {k: v.cpu().bool() for k, v in masks.items()}
        self.channels = dict(channels)
        self._weights = dict(weights)
        self._fresh = True

    def apply(self, host: Host) -> dict:
        """Hand the masks to the layer control (which zeroes the weights now and after every
        step); at a new pruning event the optimizer state of the pruned entries is zeroed too."""
        layout = shard_layout(host, self._model)  # under FSDP each rank keeps its piece of every mask
        if self._weights:  # SparseGPT's updated weights (rank zero already holds them, but on a whole copy)
            with torch.no_grad():
                bc.load_weights(self._params, {k: layout.local(self._params[k], v) for k, v in self._weights.items()})
            self._weights = {}
        moved = self._fresh and self.criterion == "sparsegpt"  # the kept weights too, on every rank by now
        masks = {self._params[k]: layout.local(self._params[k], v) for k, v in self.masks.items()}
        names = {self._params[k]: k for k in self.masks}
        for ctl in self.controls(host):
            if moved:  # under ZeRO the engine's fp32 master copy takes them, or the next step reverts them
                ctl.weights_written(list(masks))
            ctl.set_masks(self.state_key, masks, names, zero_state=self._fresh)
        self._fresh = False
        self.sparsity = self._measure(host)
        return {"sparsity": dict(self.sparsity)}

    # ------------------------------------------------------------------ reporting

    def _measure(self, host: Host) -> dict[str, float]:
        # the zeros of every layer, read in one transfer; under FSDP (ZeRO-3) each rank counts those of
        # its shards (partitions), and the counts are summed over the ranks
        zeros = torch.stack([(local_tensor(la.weight).detach() == 0).sum() for la in self.layers]).double()
        if sharded(host) or partitioned(host):
            zeros = all_sum(zeros)
        return {la.name: float(z) / self._numel(la) for la, z in zip(self.layers, zeros.tolist())}

    def _numel(self, layer) -> int:
        """The whole weight's size (under FSDP1 ``layer.weight`` is this rank's piece)."""
        return self._whole_numel.get(layer.name) or layer.weight.numel()

    def overall_sparsity(self) -> float:
        """Zero fraction over all pruned layers' weights (the quantity the target is about)."""
        n = sum(self._numel(layer) for layer in self.layers)
        return sum(self.sparsity.get(layer.name, 0.0) * self._numel(layer) for layer in self.layers) / max(n, 1)

    def _sparsity_metrics(self) -> dict[str, float]:  # <prefix>/{ratio,sparsity,metric}/<layer>, overall_sparsity
        return Decision(values=self.ratios, scores=self.scores, measurements={"sparsity": self.sparsity},
                        summary={"overall_sparsity": self.overall_sparsity()}).metrics(
            self.prefix, self.traits.score_key, self.traits.decision_key)

    def log_decision(self, host: Host, decision: Decision, achieved) -> None:
        self.log_values(host, self._sparsity_metrics())

    def heatmap_values(self) -> tuple[list[str], np.ndarray]:
        names = list(self.ratios)
        return names, np.array([[self.ratios[n]] + [h["sparsity"].get(n, np.nan) for h in self.history]
                                for n in names])

    def heatmap_xlabel(self) -> str:
        return "target, then the sparsity after each pruning event"

    def heatmap_columns(self) -> list[str]:
        return ["target ratio"] + [f"epoch {h['epoch']}" for h in self.history]

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        return {
            "masks": {k: v.cpu() for k, v in self.masks.items()},
            "sparsity": dict(self.sparsity),
            "channels": dict(self.channels),
        }

    def _load_state(self, state: dict) -> None:
        self.masks = {k: v.bool() for k, v in state.get("masks", {}).items()}
        self.scores = self.scores or dict(state.get("metric_values", {}))  # a checkpoint of version 0
        self.sparsity = dict(state.get("sparsity", {}))
        self.channels = dict(state.get("channels", {}))
