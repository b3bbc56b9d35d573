"""Auto-RGN and the eb-criterion: per-tensor learning rates from gradients measured at every
epoch start (the surgical fine-tuning authors' ``auto_tune``; baselines of
"L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)).

* ``criterion="rgn"`` -- Auto-RGN: per *tensor* the relative gradient norm
  ``RGN = ||g||_2 / ||theta||_2`` of the training loss, averaged over the first ``n_batches``
  (5) batches of the train loader, divided by its maximum over tensors, is that tensor's
  learning-rate multiplier.
* ``criterion="eb"`` -- the eb-criterion of the authors' code (L-MSA only names it): per tensor
  ``score = mean_k g_k^2 / (Var_0(g)_k + 1e-8)``, where ``Var_0`` is the (unbiased) variance of
  the gradient along the tensor's first dimension, broadcast back over it: a signal-to-noise
  ratio of the gradient entries, averaged over the same batches. Tensors with
  ``score >= eb_threshold`` (0.95) train at the full LR, the others are frozen for the epoch.
  (A tensor whose first dimension has one entry uses the variance over all its entries; a
  one-element tensor always passes.) Mahsereci et al.'s evidence-based early-stopping
  criterion, which this score is named after, uses the per-example gradient variance instead;
  the authors' code, and so this callback, does not.

Decided here (the paper and the reference are explicit about the rest):

* the measurement is a *separate* forward/backward pass over the first ``n_batches`` batches
  of a fresh iterator over the train loader, before the epoch trains, at the epoch-start
  weights and with no update -- as the reference code does; every batch of the epoch then
  trains. Buffers (norm layers' running statistics) and the global random state are restored
  after the pass, so measuring leaves the model and the epoch's data order exactly as they were;
* tensors whose name contains one of ``exclude`` (``"bn"``) are excluded as in the reference,
  whose re-built optimizer holds only the other tensors: they get ``excluded_multiplier``
  (0 = not trained, the reference; 1.0 trains them at the scheduled LR). The substring rule is
  the reference's: a BatchNorm named ``downsample.1`` is *not* excluded by it;
* a tensor with ``||theta|| = 0`` has no relative gradient norm; it gets multiplier 1 and does
  not enter the maximum;
* the reference rebuilds Adam every epoch (its moments restart); here the optimizer and its
  state are the user's, only the per-tensor LR changes (through :mod:`core.runtime.control`);
* under DDP each rank measures on its own shard and the per-tensor values are averaged over
  ranks (mean) before the decision, which is made on rank zero and broadcast. Under FSDP the
  same: each rank's own gradient of each tensor is read whole in the backward before FSDP
  reduce-scatters it (:func:`~lalr_lightning.core.model.taps.gradient_taps`), with no more gradient
  memory than a training step; each measured batch costs a forward and backward of the
  strategy's, whose reduced gradients are dropped. Under DeepSpeed ZeRO-3 the model's own forward
  gathers the weights and ``torch.autograd.grad`` returns each rank's whole gradients without
  reaching the engine's gradient partitions; ``||theta||`` comes from the ranks' partitions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, stop_on_sigterm
from lalr_lightning.callbacks.host import Cadence, Host, warn
from lalr_lightning.callbacks.selection import LayerSelection, register_mode
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.batch_loss import batch_loss
from lalr_lightning.core.model.taps import gradient_taps, preserve_buffers
from lalr_lightning.core.runtime.checks import check_counts, check_finite, check_loss_fn, lora_zero, reject_stray
from lalr_lightning.core.runtime.shards import (
    all_sum,
    backward_discarded,
    local_tensor,
    loss_through_root,
    partitioned,
    sharded,
)
from lalr_lightning.core.selection import surgical

__all__ = ["AutoRGN", "CRITERIA"]

CRITERIA = surgical.CRITERIA


@dataclass(eq=False, repr=False)
class AutoRGN(LayerSelection):
    """Per-tensor learning rates (``rgn``) or per-tensor freezing (``eb``) from gradients
    measured at every N-th epoch start (module docstring).

    Example::

        >>> from lalr_lightning.callbacks import AutoRGN, SurgicalLayerSelect
        >>> rgn = AutoRGN()                                   # Auto-RGN, 5 batches per epoch
        >>> eb = SurgicalLayerSelect(mode="eb_criterion", eb_threshold=0.95)
        >>> (type(eb).__name__, eb.criterion)
        ('AutoRGN', 'eb')

    Args:
        criterion: ``rgn`` (Auto-RGN) or ``eb`` (eb-criterion).
        n_batches: batches averaged per measurement (the reference: 5).
        every_n_epochs: measure at the start of every N-th epoch (reference: 1).
        exclude: tensors whose name contains one of these substrings are not measured
            (reference: ``"bn"``).
        excluded_multiplier: the multiplier of excluded tensors (reference: 0).
        eb_threshold: ``eb`` only: minimum score to train (reference: 0.95).
        loss_fn: ``(module, batch) -> loss``; default :func:`~lalr_lightning.core.model.batch_loss.batch_loss`:
            the module's ``loss(module(x), y)``, else the loss its own ``training_step`` returns
            (its logging silenced).
        blocks, join_stem: how blocks are found; they only label the per-block log.
        norm_eval: ``frozen``, ``all`` or ``none`` (:mod:`lalr_lightning.core.model.norm_modes`).
        name, strict_resume: as every callback of the package.

    Readable: ``multipliers`` (tensor -> multiplier), ``scores`` (tensor -> RGN or eb score),
    ``selected`` (tensors with a non-zero multiplier), ``history``. Logged at every
    measurement: ``<prefix>/rgn/<tensor>`` or ``<prefix>/eb/<tensor>`` and
    ``<prefix>/multiplier/<tensor>``; at every logging step ``<prefix>/selected/<block>`` (1
    when any tensor of the block trains) and ``lr_eff/<tensor>``.
    """

    traits = LayerSelection.traits.but(
        log_prefix="surgical",
        decision_attr="multipliers",
        decision_key="multiplier",
        measures="data",
        heatmap=None,
        readable=LayerSelection.traits.readable + ("multipliers",),
    )
    title = "Auto-RGN"
    multipliers = None  # a per-tensor dict here (set in __init__), not the base's 0/1 view

    criterion: str = "rgn"
    n_batches: int = 5
    every_n_epochs: int = 1
    exclude: Sequence[str] = ("bn",)
    excluded_multiplier: float = 0.0
    eb_threshold: float | None = None
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    blocks: Sequence[str | Sequence[str]] | None = None
    join_stem: bool = True
    norm_eval: str = "frozen"
    save_compute = False  # (no setting) it measures every tensor's gradient: nothing is left out of the backward

    def validate(self) -> None:
        super().validate()
        if self.criterion not in CRITERIA:
            raise unknown("criterion", self.criterion, CRITERIA)
        reject_stray(type(self).__name__, "criterion", self.criterion, {"eb_threshold": self.eb_threshold},
                    {"rgn": (), "eb": ("eb_threshold",)})
        check_counts({"n_batches": self.n_batches, "every_n_epochs": self.every_n_epochs})
        eb_threshold = 0.95 if self.eb_threshold is None else self.eb_threshold
        if not math.isfinite(eb_threshold):
            raise ValueError(f"eb_threshold must be finite, got {eb_threshold}")
        if not (math.isfinite(self.excluded_multiplier) and self.excluded_multiplier >= 0):
            raise ValueError(f"excluded_multiplier must be finite and >= 0, got {self.excluded_multiplier}")
        self.loss_fn = check_loss_fn(self.loss_fn)
        self.exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        self.excluded_multiplier = float(self.excluded_multiplier)
        self.eb_threshold = float(eb_threshold)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.traits = self.traits.but(score_key=self.criterion)  # its scores are the criterion's
        self.multipliers: dict[str, float] = {}
        self._block_of: dict[str, str] = {}
        self._weights: list[str] = []  # the conv/linear weight tensors (the degeneracy warning counts them)
        self._zero_scales: list[str] = []
        self._sharded = False  # FSDP: frozen tensors stop requiring grad (apply)
        self._partitioned = False  # ZeRO-3: the weights' norms from the ranks' partitions
        self._theta_norms: list[float] = []

    def selected_blocks(self) -> list[str]:
        on = {self._block_of.get(t) for t in self.selected}
        return [b for b in self.block_names if b in on]

    # ------------------------------------------------------------------ when

    def configure(self, host: Host, module: nn.Module) -> None:
        try:
            self.find_blocks(module, min_blocks=0, host=host)
        except ValueError:
            self.block_list = []  # tensors are the units; blocks only label the logs
        self.layers = surgical.tensor_layers(module)
        self._sharded = sharded(host)
        self._partitioned = partitioned(host)
        self._block_of = {n: b.name for b in self.block_list for n in b.params}
        self._weights = surgical.weight_tensors(module, self.layers, self.exclude)

    @property
    def cadence(self) -> Cadence:
        return Cadence(every_n_epochs=self.every_n_epochs)

    def first_decision(self, host: Host) -> None:
        # until the first measurement (before any step): excluded tensors at their fixed
        # multiplier, so that norm layers are in the same mode for every measurement
        self.multipliers = surgical.with_excluded([u.name for u in self.layers], {}, self.exclude,
                                                  self.excluded_multiplier)
        self.selected = [k for k, v in self.multipliers.items() if v > 0]
        self.apply(host)

    # ------------------------------------------------------------------ what

    def measure(self, host: Host, module: nn.Module) -> dict[str, float]:
        """The mean score per measured tensor over ``n_batches`` batches, averaged over ranks."""
        loader = host.batches()
        units = surgical.measured_units(self.criterion, loader, self.layers, self.exclude)
        params = [next(iter(u.params.values())) for u in units]
        if self._partitioned:  # the candidate scales (1-D, LoRA's B) whole; the weights' norms from the partitions
            small = [p for u in self.layers for n, p in u.params.items()
                     if len(getattr(p, "ds_shape", p.shape)) == 1 or lora_zero([n])]
            with host.gathered(small):
                self._zero_scales = surgical.zero_scales(self.layers)
            self._theta_norms = [] if self.criterion == "eb" else (
                all_sum(torch.stack([local_tensor(p).detach().double().square().sum() for p in params])).sqrt().tolist())
        else:
            self._zero_scales = surgical.zero_scales(self.layers)  # the degeneracy warning names them
        frozen = [u for u in units if u.name not in set(self.selected)] if self._sharded else []
        self.set_requires_grad(frozen, True)  # FSDP: the tensors frozen now are measured too (see apply)
        check = stop_on_sigterm(host)
        device = module.device
        rng = [device.index or 0] if device.type == "cuda" else []
        # buffers and the random state (the loader's shuffle, dropout) are put back: the epoch that
        # follows trains as it would without the measurement
        with torch.enable_grad(), preserve_buffers(module), torch.random.fork_rng(devices=rng):
            scores = [self._batch_scores(host, module, batch, i, units, params, check)
                      for i, batch in enumerate(itertools.islice(loader, self.n_batches))]
        self.set_requires_grad(frozen, False)
        if not scores:
            raise ValueError(f"{self.criterion}: the training dataloader yielded no batch to measure on")
        # each rank measured its own shard: average over ranks (inf, from zero-norm tensors, stays inf)
        mean = host.mean((sum(scores, torch.zeros(len(units), dtype=torch.float64)) / len(scores)).to(device)).cpu()
        return {u.name: float(v) for u, v in zip(units, mean.tolist())}

    def _batch_scores(self, host: Host, module: nn.Module, batch: Any, batch_idx: int, units: list, params: list,
                      check: Callable[[], None]) -> torch.Tensor:
        """One batch's score per measured tensor, from its gradients (under FSDP: :meth:`_sharded_scores`)."""
        check()
        batch = host.to_device(batch)
        if self._sharded:
            return self._sharded_scores(host, module, batch, batch_idx, units, params)
        loss = batch_loss(module, batch, self.loss_fn, batch_idx=batch_idx)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        check_finite(type(self).__name__, host, {u.name: g for u, g in zip(units, grads) if g is not None},
                          f"the gradients measured for {self.criterion}")
        if self._partitioned:  # whole gradients, the weights partitioned: their norms from the measure's start
            stats = {u.name: surgical.gradient_stat(self.criterion, g) for u, g in zip(units, grads) if g is not None}
            return surgical.sharded_scores(self.criterion, stats, [u.name for u in units], self._theta_norms)
        return surgical.batch_scores(self.criterion, grads, params)

    def _sharded_scores(self, host: Host, module: nn.Module, batch: Any, batch_idx: int,
                        units: list, params: list) -> torch.Tensor:
        """One batch's scores under FSDP, equal to DDP's: this rank's own gradient of each tensor is
        read whole in the backward, as FSDP computes it and before it reduce-scatters it
        (``gradient_taps``; no more gradient is held than the backward holds), through a forward
        and backward of the strategy's own (whose reduced gradients are then dropped); the
        weights' norms from the ranks' pieces."""
        keys = {id(p): u.name for u, p in zip(units, params)}
        with gradient_taps(module, keys, lambda g: surgical.gradient_stat(self.criterion, g)) as got:
            loss = loss_through_root(host, module,
                                     lambda b: batch_loss(module, b, self.loss_fn, batch_idx=batch_idx), batch)
            backward_discarded(module, loss)
        check_finite(type(self).__name__, host, {k: v[0] for k, v in got.items()}, f"the gradients measured for {self.criterion}")
        norms = [] if self.criterion == "eb" else (  # ||theta|| from the squared norms of the ranks' pieces
            all_sum(torch.stack([local_tensor(p.detach()).double().square().sum() for p in params])).sqrt().tolist())
        return surgical.sharded_scores(self.criterion, got, [u.name for u in units], norms)

    def decide(self, scores: dict[str, float]) -> Decision:
        mults = surgical.criterion_multipliers(self.criterion, scores, self.eb_threshold)
        if self.criterion == "eb" and not any(mults.values()):
            warn(f"eb_criterion: no tensor reaches eb_threshold={self.eb_threshold} (max score "
                 f"{max(scores.values()):.3g}); all measured tensors are frozen this epoch")
        values = surgical.with_excluded([u.name for u in self.layers], mults, self.exclude, self.excluded_multiplier)
        note = surgical.zero_gradient_warning(values, scores, self._weights, self._zero_scales, self.exclude)
        if note is not None:
            warn(note)
        return Decision(values=values, scores=dict(scores))

    def apply(self, host: Host) -> None:
        self.apply_multipliers(host, self.multipliers)
        self.apply_frozen(host, [k for k, v in self.multipliers.items() if v == 0])
        if self._sharded:
            # FSDP1 saves optimizer state per unit and wants it for every tensor there that requires
            # grad: a frozen tensor that never stepped has none, so it stops requiring grad (FSDP
            # follows requires_grad at every backward)
            self.follow_requires_grad()
        self.apply_norm_modes()

    def resumed(self, late: bool) -> None:
        super().resumed(late)
        if self._sharded and late:  # FSDP restores after fit start: before the optimizer state
            self.follow_requires_grad()

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:  # the epoch of the latest measurement
        return {"measured_epoch": self.history[-1]["epoch"] if self.history else None}

    def _load_state(self, state: dict) -> None:
        self.selected = [k for k, v in self.multipliers.items() if v > 0]


register_mode("auto_rgn", AutoRGN, criterion="rgn")
register_mode("eb_criterion", AutoRGN, criterion="eb")
