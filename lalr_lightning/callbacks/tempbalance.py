"""TempBalance: per-layer learning rates from heavy-tailed self-regularization (HT-SR) alpha.

"Layerwise Training of Deep Neural Networks" (https://www2.eecs.berkeley.edu/Pubs/TechRpts/2023/EECS-2023-126.html) ch. 2. Every epoch (or every N optimizer steps) the power-law
exponent ``alpha`` of each layer's ESD is measured on the current weights and mapped to a
learning-rate multiplier on top of whatever the scheduler sets: layers whose spectra look
less trained (larger alpha) get larger learning rates. The assignment functions and the layer
rule are in :mod:`lalr_lightning.core.spectral.tempbalance`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import numpy as np
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, deprecated_arg, renamed
from lalr_lightning.callbacks.host import Cadence, Host, Traits, warn
from lalr_lightning.core.model.layers import DEFAULT_KINDS
from lalr_lightning.core.runtime.checks import check_finite
from lalr_lightning.core.spectral import tempbalance as core
from lalr_lightning.core.spectral.settings import tempbalance_settings
from lalr_lightning.core.spectral.tempbalance import ASSIGN, assign_multipliers

__all__ = ["TempBalanceCallback", "assign_multipliers", "ASSIGN"]


@dataclass(eq=False, repr=False)
class TempBalanceCallback(LayerwiseCallback):
    """Per-layer learning rates from HT-SR alpha, relative to the scheduled learning rate.

    Example (a tiny run on scikit-learn's digits)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import TempBalanceCallback
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> tb = TempBalanceCallback(assign="linear_map", lr_min_ratio=0.5, lr_max_ratio=1.5)
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[tb])
        >>> trainer.fit(SmallCNN(width=16, in_channels=1), DigitsDataModule(batch_size=32))
        >>> sorted(tb.multipliers) == sorted(tb.scores)  # {layer: multiplier}, {layer: alpha}
        True
        >>> 0.5 <= min(tb.multipliers.values()) <= max(tb.multipliers.values()) <= 1.5
        True

    Args:
        assign: how alphas become multipliers: ``linear_map`` (TempBalance's ``tb_linear_map``:
            alpha mapped linearly by value onto ``[lr_min_ratio, lr_max_ratio]``; when every
            alpha is the same, every layer gets the middle of the range, 1.0 by default, where
            the reference's ``np.interp`` gives ``lr_max_ratio``), ``step`` (TempBalance's
            ``tb_step``: by rank, the j-th smallest of n alphas gets
            ``lr_min + (lr_max - lr_min) j / n``, ties in model order), the weighted forms
            ``identity``, ``square``, ``cube``, ``sqrt``, ``cbrt``, ``log2``, ``softmax``
            (``n f(alpha_i) / sum f(alpha)``), ``neg_pow2``, ``sample_alpha``, ``sample_lr``,
            ``emg``.
        fit: power-law fit (``median`` as TempBalance, ``ks`` as WeightWatcher, ``peak``).
        lr_min_ratio, lr_max_ratio: ``linear_map`` and ``step`` only: the range (default 0.5, 1.5).
        every_n_epochs: recompute at the start of every N-th epoch (TempBalance: 1).
        every_n_steps: recompute every N optimizer steps instead of per epoch.
        first: ``False`` (default): the first Conv2d/Linear in module order keeps the scheduled LR,
            as in TempBalance (a CNN's stem conv, a ViT's patch embedding, but only ``q_proj`` of
            a LLaMA's first decoder layer: docs/tempbalance.md lists it per model family);
            ``"block"``: every balanced matrix of the first stem or block that holds one keeps it
            (all seven of a LLaMA's first layer); ``True``: the first matrix is balanced too.
        head: whether the output layer (the last) is balanced too (TempBalance: no).
        min_evals: layers whose ESD has fewer eigenvalues are left at the scheduled LR (50).
        layer_types: matrix kinds considered (``linear``, ``conv1d``, ``conv2d``,
            ``hf_conv1d``, ``embedding``); embeddings are off by default, as in TempBalance.
        filter_zeros: drop near-zero eigenvalues before fitting (TempBalance keeps them).
        std: sampling assignments only (``sample_alpha``, ``sample_lr``, ``emg``): the
            standard deviation of the draws (default 1).
        seed: seeds the sampling assignments; the draw at update k depends only on
            ``(seed, k)``, so resumed and distributed runs draw the same numbers.
        name: distinguishes several instances (checkpoint state and log prefix).
        strict_resume: refuse a checkpoint written with other settings (default).
        exclude_first_last: deprecated: ``first = head = not exclude_first_last``.

    Norm layers follow the conv they normalize (TempBalance's ``bn -> conv`` rule); biases
    follow their weight; every other parameter keeps the scheduled LR.
    Readable: ``multipliers`` and ``scores`` (layer name -> multiplier / alpha, eligible layers
    only), ``excluded`` (layer -> why it is left alone), ``history``.
    Logged: ``<prefix>/alpha/<layer>``, ``<prefix>/multiplier/<layer>`` at each update,
    ``lr_eff/<layer>`` at every logging step; with ``figures`` set (``"first_last"``, ``"every"``),
    a layers x updates heatmap and the ESD plots (docs/dashboards.md).
    """

    traits = Traits(
        log_prefix="tempbalance",
        score_key="alpha",
        decides_from_weights=True,  # plan(model): the decision without a fit
        heatmap=("multipliers", "TempBalance LR multipliers", "x scheduled LR"),
        esd_plots=True,
        readable=LayerwiseCallback.traits.readable + ("multipliers", "excluded"),
    )

    assign: str = "linear_map"
    fit: str = "median"
    lr_min_ratio: float | None = None
    lr_max_ratio: float | None = None
    every_n_epochs: int = 1
    every_n_steps: int | None = None
    first: bool | str = False
    head: bool = False
    min_evals: int = 50
    layer_types: Sequence[str] = DEFAULT_KINDS
    filter_zeros: bool = False
    std: float | None = None
    seed: int = 0
    _: KW_ONLY
    exclude_first_last: bool | None = deprecated_arg("first, head", lambda v: {"first": not v, "head": not v})

    _checked_by = staticmethod(tempbalance_settings)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.multipliers: dict[str, float] = {}
        self.excluded: dict[str, str] = {}
        self._n_updates = 0

    alphas = renamed("scores")  # deprecated name of ``scores`` (alpha per layer)

    # ------------------------------------------------------------------ when

    def configure(self, host: Host, module: nn.Module) -> None:
        self.layers, self.excluded = core.eligible_layers(module, self.layer_types, first=self.first, head=self.head,
                                                          min_evals=self.min_evals)
        note = core.few_evals_note(self.excluded, type(self).__name__)
        if note:  # as HTSRPruning names the layers it leaves dense
            warn(note, category=UserWarning)

    def prepare(self, host: Host) -> None:
        # in a fit only (plan() measures frozen weights as they are): multipliers on frozen layers change nothing
        if self.layers and not any(p.requires_grad for la in self.layers for p in la.params.values()):
            raise ValueError(
                f"{type(self).__name__}: none of its {len(self.layers)} layers trains (requires_grad is False for "
                "all; a peft LoRA model trains only its adapters, whose few eigenvalues leave them out), so its "
                "learning-rate multipliers would change nothing; train the layers, or for LoRA use "
                "LALRScheduleCallback (a LoRA layer measured on its merged weight)")

    @property
    def cadence(self) -> Cadence:  # the first allocation comes from the initial weights
        return Cadence(start=True, every_n_epochs=self.every_n_epochs if self.every_n_steps is None else None,
                       every_n_steps=self.every_n_steps)

    # ------------------------------------------------------------------ what

    def measure(self, host: Host, module: nn.Module) -> tuple[dict[str, float], float]:
        """(alpha per eligible layer, the first group's scheduled LR for ``assign="sample_lr"``,
        else 1.0) from the current weights, each rank fitting a share of the layers."""

        def fit(layers):
            check_finite(type(self).__name__, host, {layer.name: layer.weight for layer in layers}, "the weights")
            return core.fit_alphas(layers, self.fit, self.filter_zeros)  # degenerate layers: an error below, with why

        alphas = core.finite_alphas(self.measure_shards(host, module, [[layer] for layer in self.layers], fit),
                                    type(self).__name__)
        # the scheduled LR matters to sample_lr alone: the other assignments (and plan()) need no optimizer
        return alphas, self.controls(host)[0].scheduled_lrs()[0] if self.assign == "sample_lr" else 1.0

    def decide(self, measured: tuple[dict[str, float], float]) -> Decision:
        alphas, base_lr = measured
        a = np.array(list(alphas.values()), dtype=np.float64)
        rng = np.random.default_rng([self.seed, self._n_updates])
        m = assign_multipliers(a, self.assign, lr_min_ratio=self.lr_min_ratio, lr_max_ratio=self.lr_max_ratio,
                               rng=rng, std=self.std, base_lr=base_lr)
        return Decision(values=dict(zip(alphas, m.tolist())), scores=dict(zip(alphas, a.tolist())))

    def commit(self, host: Host, decision: Decision) -> None:
        self._n_updates += 1
        super().commit(host, decision)

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        return {"n_updates": self._n_updates}

    def _load_state(self, state: dict) -> None:
        self.scores = self.scores or dict(state.get("alphas", {}))  # a checkpoint of version 0
        self._n_updates = state["n_updates"]

