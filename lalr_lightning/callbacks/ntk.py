"""NTK diagnostics of fine-tuning ("Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239)): on a fixed probe batch, the
condition number of the empirical NTK (Theorem 5's predictor of the fine-tuning risk), each
layer's ``eta_l`` (Theorem 6) and how far the model has left its linearization around the
weights it started from (the gap and the KL divergence of the paper's Table 1). The formulas
are :mod:`lalr_lightning.core.linearization.ntk`; nothing here changes training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, stop_on_sigterm
from lalr_lightning.callbacks.host import Host, Traits, say_or_warn
from lalr_lightning.core.linearization import linearize, ntk, ntk_spectra
from lalr_lightning.core.linearization.anchor import check_anchor, snapshot
from lalr_lightning.core.model.probe import probe_inputs
from lalr_lightning.core.runtime.checks import check_counts, check_finite, check_number
from lalr_lightning.core.runtime.placement import follow

__all__ = ["NTKDiagnostics"]


@dataclass(eq=False, repr=False)
class NTKDiagnostics(LayerwiseCallback):
    """Log ``kappa(K + sigma I)``, every layer's ``eta_l``, the linearization gap and its KL every
    N epochs, on the same probe samples each time and on every rank.

    Example (digits, two epochs)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import NTKDiagnostics
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> diag = NTKDiagnostics(probe_size=8)
        >>> trainer = pl.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[diag])
        >>> trainer.fit(SmallCNN(width=8, in_channels=1), DigitsDataModule(batch_size=32))
        >>> [round(h["gap"], 6) for h in diag.history][0], diag.gap > 0, diag.kappa >= 1
        (0.0, True, True)

    Args:
        every_n_epochs: measure at the end of every N-th epoch (and once before the first step,
            where ``kappa`` is Theorem 5's at-initialization predictor and the gap is 0).
        probe_size: samples of the probe batch (drawn from the training dataset by a fixed seed,
            so every rank and every measurement sees the same ones).
        sigma: the ridge of ``kappa(K + sigma I)`` and ``eta_l``, as a fraction of the kernel's
            mean eigenvalue ``trace(K) / M`` (0: Theorem 5-6 verbatim; needs an invertible ``K``).
        kernel: the kernel of a C-class output (:func:`~lalr_lightning.core.linearization.ntk.empirical_ntk`):
            ``"trace"`` (N x N, classes traced out), ``"full"`` (NC x NC) or ``"sum"``.
        max_jacobian_numel: memory bound of the Jacobian blocks (see ``empirical_ntk``).
        positions: token outputs ``[N, T, V]`` (a language model on dict batches with
            ``input_ids``): ``"last"`` (default) measures each sample's last real token,
            ``"all"`` every position.
        outputs: how many outputs per sample ``J`` holds (``trace`` kernel): ``None`` (default)
            every output while the Jacobian stays within ``ntk.DEFAULT_ENTRIES`` gradient entries
            (2**28, 1 GiB in fp32), else the outputs projected onto as many random directions as
            fit (an unbiased estimate of the trace kernel); ``"all"`` every output, or an integer:
            that many directions -- beyond the budget with a warning that gives the size and the
            time estimated by timing a few rows of the real computation. The choice depends on
            sizes only (the same on every machine and rerun); it is logged, made once and kept in
            the checkpoint (``core.linearization.ntk.ntk_cost``).
        name, strict_resume: as every callback of the package.

    The cost is estimated before the first measurement and stated in the log; a SIGTERM or
    Ctrl-C stops a measurement between chunks of Jacobian rows.

    Under FSDP (``FSDPStrategy``, ``ModelParallelStrategy``) rank zero measures a whole copy of the
    model (:class:`~lalr_lightning.core.runtime.shards.WholeCopy`) and keeps ``theta_0`` whole
    on its CPU: it holds the whole model during a measurement, the other ranks wait.

    The kernel is taken w.r.t. the trainable parameters at the current weights; the gap
    ``||f_theta(x*) - f_lin(x*)||`` and ``KL(softmax f || softmax f_lin)`` compare the model with
    its linearization around the weights at fit start (kept in the checkpoint, so a resumed run
    compares with the same ones). Readable: ``etas`` (layer -> ``eta_l``), ``kappa``, ``gap``,
    ``kl``, ``history``. Logged: ``<prefix>/eta/<layer>``, ``<prefix>/kappa``, ``<prefix>/gap``,
    ``<prefix>/kl``, ``<prefix>/lambda_max``, ``<prefix>/lambda_min``.
    """

    traits = Traits(
        log_prefix="ntk",
        plain_forward=True,  # torch.func Jacobians
        decision_attr="etas",
        decision_key="eta",
        score_key="eta",
        measures="data",
        logs_lr=False,
        heatmap=("eta", "NTK: eta per layer", "eta"),
        readable=LayerwiseCallback.traits.readable + ("etas", "kappa", "gap", "kl"),
        needs_whole_model=True,  # under FSDP: measured on the model whole on rank zero
    )

    every_n_epochs: int = 1
    probe_size: int = 16
    sigma: float = 1e-3
    kernel: str = "trace"
    max_jacobian_numel: int = 2**28
    positions: str = "last"
    outputs: int | str | None = None

    def validate(self) -> None:
        super().validate()
        check_counts({"every_n_epochs": self.every_n_epochs, "probe_size": self.probe_size,
                      "max_jacobian_numel": self.max_jacobian_numel})
        self.sigma = check_number("sigma", self.sigma, low=0, note=" (a fraction of trace(K) / M)")
        self.kernel, self.positions, self.outputs = ntk.check_kernel_options(self.kernel, self.positions, self.outputs)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._chosen: int | str | None = "unset"  # the outputs used, chosen at the first measurement
        self.etas: dict[str, float] = {}
        self.kappa = self.gap = self.kl = math.nan
        self._params: dict[str, torch.nn.Parameter] = {}
        self._groups: dict[str, list[str]] = {}
        self._anchor: dict[str, torch.Tensor] | None = None

    def configure(self, host: Host, module: nn.Module) -> None:
        self._params, self._groups = ntk.trainable_groups(module, type(self).__name__)
        self._chosen = "unset"  # chosen at the first measurement (a checkpoint loaded after this restores it)

    def after_start(self, host: Host) -> None:
        if self.restored and self._anchor is not None:  # where the strategy's restore is done
            self._restore_anchor()
        elif self.restored:
            self._take_anchor(host)

    def first_decision(self, host: Host) -> None:
        self._take_anchor(host)
        self.update(host, host.module)

    def _take_anchor(self, host: Host) -> None:
        if self.whole is not None:  # theta_0 whole, on rank zero's CPU (the state gather is collective)
            state = self.whole.state(host)
            self._anchor = {n: state[n].clone() for n in self._params} if host.is_global_zero else None
        else:
            self._anchor = snapshot(self._params)

    def _restore_anchor(self) -> None:
        # checked against the parameters whole (under FSDP: the skeleton's, meta)
        whole = self._params if self.whole is None else dict(self.whole.skeleton.named_parameters())
        check_anchor(self._anchor, {n: whole[n] for n in self._params}, "the checkpoint")
        if self.whole is None:
            self._anchor = follow({n: self._anchor[n] for n in self._params}, self._params)

    def after_epoch(self, host: Host) -> None:
        if (host.current_epoch + 1) % self.every_n_epochs == 0:
            self.update(host, host.module)

    def measure(self, host: Host, module: nn.Module) -> dict[str, Any]:
        """Every rank computes the same numbers (same probe, same weights); rank zero's are used.
        Under FSDP rank zero computes them on a whole copy of the model and broadcasts them."""
        measured = self.with_whole_model(host, lambda m: self._measure_on(
            host, m, {n: p for n, p in m.named_parameters() if n in self._params}))
        self._chosen = measured.pop("outputs")  # chosen on rank zero: every rank keeps it
        return measured

    def _measure_on(self, host: Host, module: nn.Module,
                    live: dict[str, torch.Tensor]) -> dict[str, Any]:
        x, _ = probe_inputs(module, host.batches(), self.probe_size,
                            to_device=lambda b: host.to_device(b))
        params = {n: p.detach() for n, p in live.items()}
        # the size and time of J, stated before the first measurement computes it
        k, self._chosen = ntk.sized_ntk(module, x, params, self._groups, say_or_warn, who=type(self).__name__,
                                        mode=self.kernel, positions=self.positions, outputs=self.outputs,
                                        chosen=self._chosen, max_jacobian_numel=self.max_jacobian_numel,
                                        check=stop_on_sigterm(host))
        check_finite(type(self).__name__, host, {"K": k.K}, "the NTK on the probe batch")
        sigma = k.ridge(self.sigma)
        eig = torch.linalg.eigvalsh(k.K)
        # theta_0 where the weights are now (Lightning moves the model after the snapshot); under FSDP
        # a placed copy, the kept one stays on rank zero's CPU
        anchor = follow(dict(self._anchor) if self.whole is not None else self._anchor, live)
        gap = linearize.linearization_gap(*linearize.linearize(module, x, anchor, params, positions=self.positions))
        return {"etas": ntk_spectra.layer_etas(k.K, k.S, sigma), "kappa": ntk_spectra.condition_number(k.K, sigma),
                "gap": gap.gap, "kl": gap.kl, "lambda_max": float(eig[-1]), "lambda_min": float(eig[0]),
                "sigma": sigma, "outputs": self._chosen}

    def decide(self, measured: dict[str, Any]) -> Decision:
        summary = {k: v for k, v in measured.items() if k != "etas"}
        return Decision(values=measured["etas"], record=dict(summary), summary=summary)

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.kappa, self.gap, self.kl = (decision.summary[k] for k in ("kappa", "gap", "kl"))

    def apply(self, host: Host) -> None:
        """Diagnostics only: nothing to hand to the layer control."""

    def _state(self) -> dict:
        return {"anchor": None if self._anchor is None else {n: t.detach().cpu() for n, t in self._anchor.items()},
                "kappa": self.kappa, "gap": self.gap, "kl": self.kl, "outputs_used": self._chosen}

    def _load_state(self, state: dict) -> None:
        self._anchor = None if state.get("anchor") is None else dict(state["anchor"])
        self.kappa, self.gap, self.kl = (float(state.get(k, math.nan)) for k in ("kappa", "gap", "kl"))
        self._chosen = state.get("outputs_used", "unset")  # a resumed run measures the same outputs

