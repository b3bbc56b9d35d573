"""L-MSA: select blocks by the MSA metric and fine-tune them by maximizing their augmented
Hamiltonian ("L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0); derivation for non-linear blocks: ``docs/lmsa.md``).

The measurements are pure functions in :mod:`lalr_lightning.core.selection.msa`, the block taps in
:mod:`lalr_lightning.core.model.taps`; this callback decides when to measure, which blocks train and
how, and logs what it decided. The Hamiltonian maximization of the selected blocks runs as a
post-step transform of :class:`~lalr_lightning.core.runtime.control.LayerControl`, right after each
optimizer step (before any mask of another callback is re-applied).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lalr_lightning.callbacks.base import Decision, deprecated_arg, stop_on_sigterm
from lalr_lightning.callbacks.host import Host, say, warn
from lalr_lightning.callbacks.selection import LayerSelection
from lalr_lightning.core.model.batch_loss import batch_loss
from lalr_lightning.core.model.blocks import describe_blocks
from lalr_lightning.core.model.taps import BlockTaps
from lalr_lightning.core.runtime.checks import DivergenceError, check_finite
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.shards import gather_objects, layer_paths, layers_in
from lalr_lightning.core.selection import msa, msa_settings
from lalr_lightning.core.selection.msa_settings import INNER_OPTIMIZERS, SELECT, UPDATE, lmsa_settings

__all__ = ["LMSAStepper", "SELECT", "UPDATE", "INNER_OPTIMIZERS"]


@dataclass(eq=False, repr=False)
class LMSAStepper(LayerSelection):
    """Layer-wise fine-tuning with the Method of Successive Approximations (L-MSA).

    Example (a one-epoch run on digits, the model's own blocks)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import LMSAStepper
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallResNet
        >>> lmsa = LMSAStepper(rho=1.0, inner_lr=1e-3, inner_steps=2)
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[lmsa])
        >>> trainer.fit(SmallResNet(width=4, blocks_per_group=1, in_channels=1), DigitsDataModule(batch_size=32))
        >>> len(lmsa.selected), lmsa.selected[0] == min(lmsa.scores, key=lmsa.scores.get)
        (1, True)

    Selection: on the first ``n_batches`` training batches of a selection epoch, forward and
    backward hooks on every block read the state ``x_n`` (the block's input), ``x_{n+1}`` (its
    output) and the co-state ``p_{n+1} = -dL/dx_{n+1}`` during the module's own training step.
    After the backward pass (still before the optimizer step, so at the weights that produced
    them) every block gets the metric ``J_hat_n`` (eq. 8, generalized: the loss after one step
    ``theta_n + r_n / rho_hat_n`` along the block's Hamiltonian gradient ``r_n``, the rest of
    the network run on the updated block output from the cached ``x_n``) with ``rho_hat_n`` of
    eq. 9 times ``rho_scale``. The values are averaged over the selection batches and over DDP
    ranks, and the ``num_blocks`` blocks with the smallest ``J_hat`` are selected
    (``select="min"``) -- or every block (``select="all"``: "MSA on all blocks"). The choice
    is made on rank 0 and broadcast. Selection happens at the first epoch and, with
    ``every_n_epochs=K``, at every epoch divisible by ``K``.

    Update:

    * ``update="msa"`` (L-MSA): the module's optimizer moves nothing of the blocks (all frozen
      through :mod:`core.runtime.control`); after each optimizer step the callback maximizes the
      selected blocks' augmented Hamiltonian ``H = p_{m+1} . g_m(x_m, theta) - rho/2
      ||theta - theta_m||^2`` (plus E-MSA's feasibility terms with ``feasibility > 0``) with
      ``x_m``, ``p_{m+1}`` of that step held fixed, by ``inner_steps`` iterations of its own
      ``inner_optimizer`` (paper: Adam, lr 1e-4, 5 iterations, rho 1). Under DDP the inner
      gradients are averaged over ranks, so every rank applies the same update.
    * ``update="optimizer"`` ("L-MSA metric + the module's optimizer"): the selected blocks
      train in the module's own optimizer, the others are frozen.

    Before the first selection is made nothing trains. During the measurement batches of a
    re-selection the previous choice keeps training. The batch on which a selection is made
    already moves the new choice with ``update="msa"`` (its states and co-states were captured);
    with ``update="optimizer"`` and ``save_compute`` the new choice's first update is on the next
    batch (the measurement's backward computed no weight gradient for it).

    Args:
        select: ``"min"`` (the ``num_blocks`` smallest ``J_hat``) or ``"all"``.
        num_blocks: ``select="min"`` only: how many blocks it picks (paper: 1).
        update: ``"msa"`` or ``"optimizer"``.
        rho, inner_optimizer, inner_lr, inner_steps, feasibility: ``update="msa"`` only: the
            proximal weight of the Hamiltonian maximization (paper: 1); ``"adam"``, ``"sgd"`` or
            a callable ``params -> Optimizer`` (paper: Adam) with its learning rate (paper:
            1e-4) and iterations per optimizer step (paper: 5); the weight of E-MSA's terms
            ``||x_{m+1} - g_m||^2`` and ``||p_m - grad_x H_m||^2`` (0 = off, the paper's
            simplified Hamiltonian).
        rho_scale: constant multiplying ``rho_hat`` for all blocks (the paper does this "when
            the loss scale varies"; default 1).
        metric_rho: use this fixed ``rho`` in the metric instead of ``rho_hat`` (then
            ``rho_scale`` does not apply).
        output_dim: ``d'`` of eq. 9; default: the per-sample size of the last block's output
            (the logits when the last block is the head).
        n_batches: batches the metric is averaged over (default 1).
        every_n_epochs: re-select at every epoch divisible by this (None: select once).
        blocks, join_stem, head: how to find the blocks (:func:`core.model.blocks.block_layers`).
            With ``head=False`` the head's parameters are left to the module's optimizer.
        loss_fn: ``f(module, batch) -> loss``, the training objective, used to run the
            rest of the network on an updated block. Default
            (:func:`~lalr_lightning.core.model.batch_loss.batch_loss`): the module's ``loss(output, target)``,
            else the loss its own ``training_step`` returns (its logging silenced).
        norm_eval: ``"frozen"`` (default): norm layers of blocks that do not train keep their
            running statistics; ``"all"``: every such norm layer in eval; ``"none"``: modes as
            Lightning sets them (:mod:`lalr_lightning.core.model.norm_modes`).
        seed: seeds the probes' random state (dropout masks); the training's random stream is
            not touched.
        save_compute: ``True`` (default): the backward computes weight gradients only for the
            blocks the module's optimizer trains (the selected ones with ``update="optimizer"``,
            none with ``update="msa"``), measurement batches included: the metric needs only the
            states and co-states, which reach every captured block output with its weights frozen,
            and it forms each block's direction ``r_n`` one block at a time. Under DDP the blocks
            are kept out of DDP's buckets and the gradients they get are averaged by hand once per
            optimizer step (:mod:`lalr_lightning.core.runtime.handsync`; ``setup`` also sets
            ``find_unused_parameters=True``). Not with ``feasibility > 0`` (E-MSA needs the input
            co-state of the selected block, which flows through the blocks before it).
        optimizer_state: ``"release"`` (default): the module optimizer's state of blocks that
            stop training (``update="optimizer"``, at a re-selection) is freed, so it covers only
            the selected blocks and what trains outside the blocks; ``"keep"``: kept, and
            resumed when a block is selected again.
        name, strict_resume: as every callback of the package.
        selection_batches, reselect_every_n_epochs: deprecated names of ``n_batches`` and
            ``every_n_epochs``.

    Readable after a selection: ``scores`` (block -> ``J_hat``), ``rho_hat`` (block ->
    ``rho_hat``, scaled), ``rgn`` (block -> ``||r_n|| / ||theta_n||``), ``selected``,
    ``history``. Logged at each selection: ``<prefix>/j_hat/<block>``,
    ``<prefix>/rho_hat/<block>``, ``<prefix>/rgn/<block>``, ``<prefix>/selected/<block>``;
    at logging steps ``<prefix>/hamiltonian_first`` / ``_last`` (first and last inner
    iteration), ``<prefix>/selected/<block>`` and ``lr_eff/*``; at fit end block x selection
    heatmaps of the choice and of ``J_hat``.

    Blocks: a block that is one module is run as ``functional_call(module, theta, x_n)``; a
    block spanning several modules (the stem joined to the first block) is run through the
    model's own forward with its parameters substituted, its first module fed ``x_n`` -- for
    the joined stem ``x_n`` is the network input -- and the forward stopped after its last
    module. Outputs: a tensor, or a tuple/list/``ModelOutput`` whose first element is the
    state (Hugging Face layers); other types raise an error.

    Gradient accumulation is supported (co-states are rescaled to the batch loss; the
    Hamiltonian averages the micro-batches of an optimizer step); manual optimization and
    DeepSpeed are not. Under FSDP (``FSDPStrategy``, ``ModelParallelStrategy``), where a block
    cannot run alone, ``update="optimizer"`` measures on rank zero's whole copy of the model
    (:class:`~lalr_lightning.core.runtime.shards.WholeCopy`): every rank's measurement batch,
    its states and co-states from a forward and backward of the copy, the same metric as under
    DDP; the selection then trains in the module's optimizer. ``update="msa"`` is refused there
    (its Hamiltonian step would run on a whole copy after every optimizer step).
    """

    traits = LayerSelection.traits.but(
        log_prefix="lmsa",
        score_key="j_hat",
        measures="data",
        logs_lr=True,
        readable=LayerSelection.traits.readable + ("multipliers",),
        heatmap_min_entries=1,
        needs_whole_model=True,  # FSDP: the metric on a whole copy of the model on rank zero (the live taps capture nothing)
    )
    title = "L-MSA"
    switches = True  # requires_grad follows the selection between measurements (save_compute)

    select: str = "min"
    num_blocks: int | None = None
    update: str = "msa"
    rho: float | None = None
    inner_optimizer: str | Callable | None = None
    inner_lr: float | None = None
    inner_steps: int | None = None
    feasibility: float | None = None
    rho_scale: float | None = None
    metric_rho: float | None = None
    output_dim: int | None = None
    n_batches: int = 1
    every_n_epochs: int | None = None
    blocks: Sequence[str | Sequence[str]] | None = None
    join_stem: bool = True
    head: bool = True
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    norm_eval: str = "frozen"
    seed: int = 0
    save_compute: bool = True
    optimizer_state: str = "release"
    _: KW_ONLY
    selection_batches: int | None = deprecated_arg("n_batches")
    reselect_every_n_epochs: int | None = deprecated_arg("every_n_epochs")

    def validate(self) -> None:
        super().validate()
        self._final(lmsa_settings(**self._given("blocks", "join_stem", "norm_eval", "save_compute", "optimizer_state")))

    def __post_init__(self) -> None:
        super().__post_init__()
        self.traits = self.traits.but(fsdp_refusal=msa_settings.sharded_refusal(self.update))
        self._measuring = False
        self._measured = 0
        self._acc: dict[str, list[float]] = {}
        self._inner: torch.optim.Optimizer | None = None
        self._inner_for: list[str] = []
        self._inner_state: dict | None = None  # restored, waiting for the inner optimizer
        self.taps: BlockTaps | None = None
        self._stepping = False
        self._costates: list[tuple[str, torch.Tensor]] = []  # (block, all finite) of updates not yet checked
        self._block_of: dict[int, str] = {}  # id of a block's parameter -> the block
        self._paths: dict[str, tuple] = {}
        self._held_back = False  # FSDP: a new choice frozen for the step of the batch that chose it

    @property
    def rho_hat(self) -> dict[str, float]:
        return self.measurements.get("rho_hat", {})

    @property
    def rgn(self) -> dict[str, float]:
        return self.measurements.get("rgn", {})

    def _loss(self, module: nn.Module, batch: Any) -> torch.Tensor:
        return batch_loss(module, batch, self.loss_fn)

    # ------------------------------------------------------------------ setup

    def configure(self, host: Host, module: nn.Module) -> None:
        if not getattr(module, "automatic_optimization", True):  # a LightningModule may opt out
            raise RuntimeError("LMSAStepper needs automatic optimization (it acts around Lightning's optimizer step)")
        try:
            self.layers = self.find_blocks(module, head=self.head, min_blocks=1, host=host)
        except ValueError as err:
            raise ValueError(f"LMSAStepper: {err}") from err
        trainable = {la.name: any(p.requires_grad for p in la.params.values()) for la in self.layers}
        note = msa_settings.check_blocks(trainable, self.select, self.num_blocks)
        say(f"L-MSA blocks of {type(module).__name__}: {describe_blocks(self.layers)}")
        if note:
            warn(note)
        self._block_of = {id(p): b.name for b in self.layers for p in b.params.values()}
        self.taps = BlockTaps(module, self.layers, want_input_costate=self.feasibility > 0, seed=self.seed)

    def prepare(self, host: Host) -> None:
        super().prepare(host)
        self._paths = layer_paths(host.module, self.layers) if self.whole is not None else {}

    def resumed(self, late: bool) -> None:
        super().resumed(late)
        if self.layers:
            msa_settings.check_restored(self.selected, self.block_names)

    def first_decision(self, host: Host) -> None:
        if self.early is not None:  # a static selection, decided in prepare (its cadence never starts the fit)
            self.commit(host, self.early)
        self.apply(host)

    def after_wrap(self, host: Host) -> None:
        super().after_wrap(host)
        if self.update == "msa":  # the Hamiltonian maximization, right after each optimizer step
            LayerControl.of(host.optimizers[0]).set_transform(self.state_key, lambda step: self._msa_update(host))

    def release(self, host: Host) -> None:
        super().release(host)
        if self.taps is not None:
            self.taps.detach()

    # ------------------------------------------------------------------ control

    def apply(self, host: Host) -> None:
        """msa: every block frozen in the module's optimizer (the Hamiltonian step moves the
        selected ones); optimizer: the others frozen. Nothing trains before a selection. With
        ``save_compute``, where the strategy lets ``requires_grad`` change, the backward computes
        weight gradients for the module optimizer's blocks only (none with msa, which reads only
        states and co-states: the taps route the backward to the captured block outputs)."""
        on = set() if self.update == "msa" else set(self.selected)
        off = [b for b in self.layers if b.name not in on]
        self.apply_frozen(host, [b.name for b in off])
        self.release_state(host, off)
        # under FSDP the first backward needs something that requires grad (the live taps anchor none)
        if self.save_compute and self._toggle and self.feasibility == 0 and (self.whole is None or self.selected):
            self.set_requires_grad([b for b in self.layers if b.name in on], True)
            self.set_requires_grad(off, False)
        if self.update == "msa" and self.selected and (self._inner is None or self._inner_for != self.selected):
            self._build_inner()
        self.apply_norm_modes()

    def trains(self, p: torch.nn.Parameter) -> bool:
        block = self._block_of.get(id(p))
        if block is not None:
            return block in self.selected
        return super().trains(p)  # outside the blocks: the module's optimizer decides

    def _build_inner(self) -> None:
        opt = msa.inner_optimizer(self.inner_optimizer, [p for n in self.selected for p in self.taps.theta(n)],
                                  self.inner_lr)
        state, self._inner_state = self._inner_state, None  # a restored state goes on for the same blocks only
        if state is not None and state.get("for") == list(self.selected):
            opt.load_state_dict(state["state"])
        self._inner, self._inner_for = opt, list(self.selected)

    # ------------------------------------------------------------------ hooks

    def _capture_names(self) -> list[str]:
        if self.whole is not None:  # FSDP: the live taps capture nothing
            return []
        return self.block_names if self._measuring else list(self.selected) if self.update == "msa" else []

    def each_epoch(self, host: Host) -> None:
        super().each_epoch(host)
        self._check_costates(host)
        epoch, k = host.current_epoch, self.every_n_epochs
        due = not self.selected or (k is not None and epoch % k == 0 and self.history[-1]["epoch"] != epoch)
        if due and not self._measuring:  # not while a measurement still runs (resumed, or longer than an epoch)
            self._measuring, self._measured, self._acc = True, 0, {}

    def each_batch(self, host: Host, batch: Any) -> None:
        self.taps.context = batch  # the batch the measurement and the Hamiltonian step run on
        self.taps.seed = self.seed * 1_000_003 + host.global_step
        if not self.taps.discovered and self.whole is None:
            self.taps.discover(lambda: self._loss(host.module, batch))
            self._report_cost()
        self.taps.set_capture(self._capture_names())
        super().each_batch(host, batch)

    #: a measurement holding more than this many bytes of states and co-states warns (with its size)
    warn_bytes: ClassVar[int] = 2 * 2**30

    def _report_cost(self) -> None:
        """State, before the first measurement, what it holds and runs: every block's states and
        co-states of a batch, and one forward pass of the model per block and batch; warn when
        the states exceed :attr:`warn_bytes`, naming the largest (a language model's logits)."""
        last = self.layers[-1]
        text, too_big = msa.measurement_cost(self.taps.capture_bytes(), self.n_batches, self.warn_bytes,
                                             head=last.name if last.role == "head" else None)
        (warn if too_big else say)(text)

    def after_backward(self, host: Host) -> None:
        if self.whole is not None:
            if self._measuring:
                self._measure_on_copy(host)
            return
        names = self._capture_names()
        if not names:
            return
        self._normalize(host, names)
        if self._measuring:
            with host.forward_context():
                self._add(host, self._scores(host, self.taps, lambda: self._loss(host.module, self.taps.context)))
        keep = set(self.selected) if self.update == "msa" else set()
        self.taps.clear([n for n in self.block_names if n not in keep])

    def before_step(self, host: Host, optimizer: Any) -> None:
        self._stepping = True

    def after_batch(self, host: Host, outputs: Any, batch: Any) -> None:
        if self._held_back:  # FSDP: the new choice steps from the next batch on, as under DDP
            self._held_back = False
            self.apply_frozen(host, [n for n in self.block_names if n not in self.selected])
        self.taps.set_capture([])  # nothing outside training steps (validation) is captured
        if self._stepping:  # the window's optimizer step is done (or was skipped): its captures go
            self._stepping = False
            self.taps.clear()

    def log_heatmap(self, trainer: Any) -> None:  # beside the selection's heatmap (dashboards.log_heatmap)
        if not self.history or not trainer.is_global_zero or not trainer.loggers:
            return
        from lalr_lightning import dashboards, viz

        names = self.block_names
        j = np.array([[h["scores"].get(n, np.nan) for h in self.history] for n in names], dtype=float)
        fig = viz.plot_heatmap(j, names, dashboards.heatmap_columns(self), title="L-MSA metric J_hat",
                               cbar_label="J_hat (lower is better)", xlabel=dashboards.heatmap_xlabel(self))
        viz.log_figure(trainer, f"{self.prefix}/j_hat", fig)

    # ------------------------------------------------------------------ co-states

    def _normalize(self, host: Host, names: Sequence[str]) -> None:
        """Bring new co-states to ``-dL/dx`` of the batch loss: Lightning divides the loss by
        ``accumulate_grad_batches`` before backward, and AMP scales it."""
        scaler = host.grad_scaler
        factor = float(host.accumulate) / (1.0 if scaler is None else float(scaler.get_scale()))
        self.taps.scale_costates(names, factor, "LMSAStepper")

    # ------------------------------------------------------------------ selection

    def _scores(self, host: Host, taps: BlockTaps, run: Callable[[], torch.Tensor]) -> dict[str, list]:
        """``[J_hat, rho_hat, rgn]`` of every block on the batch ``taps`` captured (``run``: its loss)."""
        loss = float(taps.loss_with(run))
        if not math.isfinite(loss):
            raise DivergenceError("LMSAStepper", "the training loss", value=loss, epoch=host.current_epoch,
                                  step=host.global_step, hint="L-MSA cannot rank blocks on it; lower the "
                                  "learning rate or check the data and loss_fn")
        return msa.block_scores(taps, self.block_names, run, loss, output_dim=self.output_dim, rho=self.metric_rho,
                                rho_scale=self.rho_scale, check=stop_on_sigterm(host))

    def _add(self, host: Host, scores: dict[str, list]) -> None:
        for name, values in scores.items():  # [sum J_hat, sum rho_hat, sum rgn, batches]
            self._acc[name] = [a + v for a, v in zip(self._acc.get(name, [0.0, 0.0, 0.0, 0]), [*values, 1])]
        self._measured += 1
        if self._measured >= self.n_batches:
            self.conclude(host, self._reduce(host))

    def _measure_on_copy(self, host: Host) -> None:
        """FSDP: this measurement batch of every rank, scored on rank zero's whole copy of the
        model (states and co-states from its own forward and backward) and averaged over the
        ranks, as DDP's ranks average their own batches' metric."""
        batches = gather_objects(apply_to_collection(self.taps.context, torch.Tensor, lambda t: t.cpu()))

        def on_copy(whole: torch.nn.Module) -> dict[str, list]:
            taps = BlockTaps(whole, layers_in(whole, self.layers, self._paths), seed=self.seed)
            total: dict[str, list] = {}
            try:
                for batch in batches:
                    batch = host.to_device(batch)
                    run = functools.partial(self._loss, whole, batch)
                    taps.context, taps.seed = batch, self.seed * 1_000_003 + host.global_step
                    if not taps.discovered:
                        taps.discover(run)
                    taps.set_capture(self.block_names)
                    with host.forward_context():
                        run().backward()  # the co-states (the copy is frozen: no weight gradient)
                        for name, values in self._scores(host, taps, run).items():
                            total[name] = [a + v / len(batches) for a, v in zip(total.get(name, [0.0] * 3), values)]
                    taps.set_capture([])
                    taps.clear()
            finally:
                taps.detach()
            return total

        before = set(self.selected)
        self._add(host, self.whole.run(host, host.module, on_copy, frozen=True))
        if self._measuring or set(self.selected) <= before:
            return
        # a new choice: this batch's backward computed its gradients (under DDP it computed none)
        self._held_back = True
        self.apply_frozen(host, [n for n in self.block_names if n not in before & set(self.selected)])

    def _reduce(self, host: Host) -> dict[str, dict[str, float]]:
        """The batch means of the metric, averaged over ranks."""
        names = self.block_names
        local = torch.tensor([[self._acc[n][i] / self._acc[n][3] for n in names] for i in range(3)],
                             dtype=torch.float64)
        device = next(iter(self.layers[0].params.values())).device
        mean = host.mean(local.to(device)).cpu()
        return {k: dict(zip(names, mean[i].tolist())) for i, k in enumerate(("j_hat", "rho_hat", "rgn"))}

    def decide(self, measured: dict[str, dict[str, float]]) -> Decision:
        scores = measured["j_hat"]
        chosen = msa.choose_blocks(scores, self.select, self.num_blocks)
        extra = {"rho_hat": measured["rho_hat"], "rgn": measured["rgn"]}
        return Decision(values={n: float(n in chosen) for n in self.block_names}, scores=scores,
                        measurements=extra, record={k: dict(v) for k, v in extra.items()})

    def commit(self, host: Host, decision: Decision) -> None:
        self._measuring, self._acc = False, {}
        super().commit(host, decision)

    # ------------------------------------------------------------------ MSA update

    def _msa_update(self, host: Host) -> None:
        found = msa.hamiltonian_terms(self.taps, self.selected, functools.partial(self._loss, host.module))
        if found is None:
            return  # nothing captured for this step (e.g. the selection came after it)
        params, terms, finite = found
        self._costates += finite  # read on the host only at a logging step or the next epoch (_check_costates)
        reduce = functools.partial(msa.mean_flat, mean=host.mean) if host.world_size > 1 else None
        with host.forward_context():
            values = msa.maximize_hamiltonian(terms, params, self._inner, steps=self.inner_steps, rho=self.rho,
                                              feasibility=self.feasibility, reduce_grads=reduce,
                                              check=stop_on_sigterm(host), host=False)
        if host.should_log():
            self._check_costates(host)
            if values:
                self.log_values(host, {f"{self.prefix}/hamiltonian_first": float(values[0]),
                                       f"{self.prefix}/hamiltonian_last": float(values[-1])})

    def _check_costates(self, host: Host) -> None:
        """Raise :class:`DivergenceError` for the blocks whose co-states held NaN or Inf in a
        Hamiltonian update since the last check (one device-to-host read for all of them)."""
        pending, self._costates = self._costates, []
        check_finite(type(self).__name__, host, dict.fromkeys(msa.nonfinite_blocks(pending), math.nan),
                          "the co-states (-dL/dx of the block outputs)")

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        inner = self._inner_state if self._inner is None else {"for": list(self._inner_for),
                                                                  "state": self._inner.state_dict()}
        return {
            "last_selection_epoch": self.history[-1]["epoch"] if self.history else None,  # read from the history
            "measuring": self._measuring,
            "measured": self._measured,
            "acc": {k: list(v) for k, v in self._acc.items()},
            "inner": inner,
        }

    def _load_state(self, state: dict) -> None:
        self._measuring = bool(state.get("measuring", False))
        self._measured = int(state.get("measured", 0))
        self._acc = {k: list(v) for k, v in state.get("acc", {}).items()}
        self._inner_state = state.get("inner")
        self._inner = None
