"""NTK layer selection ("Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239), Theorems 6-7): before the first step,
choose the layers to fine-tune greedily by their kernel's effect on the NTK spectrum
(largest ``eta_l`` first) while the condition number of the chosen layers' kernel stays under a
bound; the others are frozen for the whole fit. The greedy rule is
:func:`lalr_lightning.core.linearization.ntk_spectra.greedy_ntk_selection` (``docs/proximal.md``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, stop_on_sigterm
from lalr_lightning.callbacks.host import Cadence, Host, say, say_or_warn
from lalr_lightning.callbacks.selection import LayerSelection, register_mode
from lalr_lightning.core.linearization import ntk, ntk_groups, ntk_spectra
from lalr_lightning.core.model.probe import fixed_batch, forward_order, probe_inputs
from lalr_lightning.core.runtime.checks import check_counts, check_finite, check_number
from lalr_lightning.core.runtime.shards import sharded

__all__ = ["NTKSelect"]


@dataclass(eq=False, repr=False)
class NTKSelect(LayerSelection):
    """Fine-tune the layers Theorems 6-7 of the linearization paper pick on a probe batch.

    Example (digits; ``SurgicalLayerSelect(mode="ntk")`` builds the same)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import NTKSelect, SurgicalLayerSelect
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> sel = SurgicalLayerSelect(mode="ntk", kappa_max=1e3, max_layers=2, probe_size=16)
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[sel])
        >>> trainer.fit(SmallCNN(width=8, in_channels=1), DigitsDataModule(batch_size=32))
        >>> type(sel).__name__, len(sel.selected), sel.kappa <= 1e3
        ('NTKSelect', 2, True)

    At the start of training (before any step) the empirical NTK of the trainable parameters on
    the probe batch is computed with one kernel ``S_l`` per layer (a LoRA pair is one layer).
    From ``K_sel = 0``, each round takes the remaining layer with the largest
    ``eta_l = ||(K_sel + sigma I)^{-1/2} S_l (K_sel + sigma I)^{-1/2}||`` and adds it if
    ``kappa(K_sel + S_l + sigma I) <= kappa_max``; the first layer that would break the bound
    stops the selection. The other layers are frozen (through the layer control, DDP-safe).

    Args:
        kappa_max: the bound ``c`` on ``kappa(K + sigma I)`` of the chosen layers' kernel
            (Theorem 7's hypothesis).
        sigma: the ridge, as a fraction of the full kernel's mean eigenvalue ``trace(K) / M``
            (> 0: the first round compares with ``K_sel = 0``).
        max_layers: choose at most this many layers (``None``: no limit), the head not counted.
        head: the model's output layer always trains (a freshly initialized classifier must):
            it is not ranked, and the greedy rounds start from its kernel, ``K_sel = S_head``
            (Theorem 7's bound then holds for the head plus the chosen layers). ``False`` (the
            default): the head is a candidate like any other layer.
        probe_size: samples of the fixed probe batch (the same on every rank).
        kernel: ``"trace"``, ``"full"`` or ``"sum"`` (:func:`~lalr_lightning.core.linearization.ntk.empirical_ntk`).
        positions, outputs: which outputs the kernel is taken over, as for
            :class:`~lalr_lightning.callbacks.ntk.NTKDiagnostics` (a language model: its last real
            token by default; when the Jacobian exceeds ``ntk.DEFAULT_ENTRIES`` gradient entries,
            the outputs projected onto random directions, stated in the log). A SIGTERM or Ctrl-C
            stops the measurement.
        norm_eval: ``frozen``, ``all`` or ``none`` (:mod:`lalr_lightning.core.model.norm_modes`).
        save_compute: turn ``requires_grad`` off for the frozen layers: before the model is
            wrapped when the probe can be drawn in ``setup`` (then under DDP they get no
            gradient and no all-reduce), else at train start on a single device only.
        name, strict_resume: as every callback of the package.

    Readable: ``selected`` (layers, model order), ``scores`` (layer -> ``eta_l`` in the first
    round, against ``K_sel = 0``), ``chosen_eta`` (layer -> ``eta`` when it was added),
    ``kappa`` (of the chosen layers' kernel, the head's included), ``head_layer`` (with ``head=True``),
    ``history``. Logged once:
    ``<prefix>/eta/<layer>``, ``<prefix>/chosen_eta/<layer>``, ``<prefix>/selected/<layer>``,
    ``<prefix>/kappa``, ``<prefix>/num_selected``; at every logging step
    ``<prefix>/selected/<layer>``.
    """

    traits = LayerSelection.traits.but(
        log_prefix="ntk_select",
        plain_forward=True,  # torch.func Jacobians
        score_key="eta",
        heatmap_min_entries=1,
        readable=LayerSelection.traits.readable + ("chosen_eta", "kappa", "head_layer"),
    )
    title = "NTK"
    cadence = Cadence(start=True)  # no probe in setup (no decision then): decided at train start, after the wrap

    kappa_max: float = 1e3
    sigma: float = 0.1
    max_layers: int | None = None
    probe_size: int = 16
    kernel: str = "trace"
    head: bool = False
    norm_eval: str = "frozen"
    save_compute: bool = True
    positions: str = "last"
    outputs: int | str | None = None

    def validate(self) -> None:
        super().validate()
        self.kappa_max = check_number("kappa_max", self.kappa_max, low=1, note=" (a condition number is at least 1)")
        self.sigma = check_number("sigma", self.sigma, low=0, strict=True, note=" (a fraction of trace(K) / M)")
        check_counts({"max_layers": self.max_layers, "probe_size": self.probe_size}, optional=("max_layers",))
        self.probe_size = int(self.probe_size)
        self.kernel, self.positions, self.outputs = ntk.check_kernel_options(self.kernel, self.positions, self.outputs)
        self.head = bool(self.head)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.head_layer: str | None = None
        self.chosen_eta: dict[str, float] = {}
        self.kappa = math.nan
        self._params: dict[str, torch.nn.Parameter] = {}
        self._groups: dict[str, list[str]] = {}
        self._loader = None  # the training loader drawn in setup

    def configure(self, host: Host, module: nn.Module) -> None:
        self._params, self._groups = ntk.trainable_groups(module, type(self).__name__)
        trace = forward_order(host, module, getattr(self, "loss_fn", None))
        self.head_layer = ntk_groups.selectable_head(module, self._groups, self.head, trace)
        self.layers = ntk_groups.group_layers(self._groups, self._params)
        self.block_list = self.layers  # the units label the per-step log and own their norm layers

    def decide_in_setup(self, host: Host, module: nn.Module) -> Decision | None:
        """Decide before the model is wrapped when the training loader can be built already
        (a datamodule, a loader passed to ``fit``, or a module whose ``train_dataloader`` needs
        no ``setup`` of its own); else at train start, where under DDP the frozen layers' weight
        gradients are still computed and all-reduced (then dropped before the step)."""
        try:
            loader = host.batches()
            fixed_batch(loader, 1)  # the probe can be drawn from it
        except Exception as err:  # noqa: BLE001 -- any failure: decide at train start instead
            if sharded(host):
                raise RuntimeError(f"NTKSelect under {host.sharding.upper()} chooses in setup, before the "
                                   f"model is sharded, but setup could not draw the probe ({type(err).__name__}: "
                                   f"{err}); pass the data as a datamodule or a loader to fit()") from err
            if host.world_size > 1:
                say(f"{type(self).__name__}: no training loader in setup, so the layers are chosen at train "
                               "start, after DDP wrapped the model: frozen layers still get (dropped) gradients")
            return None
        module.to(host.device)  # where the strategy puts it next, before the wrap
        self._loader = loader
        return self.decide_everywhere(host, self.measure(host, module))

    def measure(self, host: Host, module: nn.Module) -> dict:
        """The per-layer kernels on the probe batch (every rank computes the same ones)."""
        in_setup = self._loader is not None
        loader = self._loader if in_setup else host.batches()
        self._loader = None
        # in setup the precision plugin has not converted the module yet (bf16-true): nor the batch
        to_device = lambda b: host.to_device(b, precision=not in_setup)  # noqa: E731
        x, _ = probe_inputs(module, loader, self.probe_size, to_device=to_device)
        params = {n: p.detach() for n, p in self._params.items()}
        k, _ = ntk.sized_ntk(module, x, params, self._groups, say_or_warn, who=type(self).__name__, mode=self.kernel,
                             positions=self.positions, outputs=self.outputs, check=stop_on_sigterm(host))
        check_finite(type(self).__name__, host, k.S, "the per-layer NTK on the probe batch")
        return {"S": {g: s.cpu() for g, s in k.S.items()}, "sigma": k.ridge(self.sigma)}

    def decide(self, measured: dict) -> Decision:
        sel, note = ntk_spectra.head_selection(measured["S"], self.head_layer, self.kappa_max, measured["sigma"],
                                       self.max_layers)
        if note is not None:
            warnings.warn(note, stacklevel=2)
        chosen = set(sel.layers) | ({self.head_layer} if self.head_layer is not None else set())
        summary = {"kappa": sel.kappa[-1], "num_selected": float(len(chosen)), "sigma": measured["sigma"]}
        return Decision(values={g: float(g in chosen) for g in self._groups}, scores=dict(sel.eta_rounds[0]),
                        measurements={"chosen_eta": dict(sel.eta)},
                        record={**summary, "stopped": sel.stopped, "order": list(sel.layers)}, summary=summary)

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.chosen_eta = dict(decision.measurements.get("chosen_eta", {}))
        self.kappa = decision.summary.get("kappa", math.nan)

    def _state(self) -> dict:
        return {"kappa": self.kappa}

    def _load_state(self, state: dict) -> None:
        self.chosen_eta = dict(self.measurements.get("chosen_eta", {}))
        self.kappa = float(state.get("kappa", math.nan))


register_mode("ntk", NTKSelect)
