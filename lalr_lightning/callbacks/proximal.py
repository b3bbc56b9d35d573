"""Selective proximal regularization ("Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239), "linearization explains
fine-tuning"): after every optimizer step, pull the trained parameters toward their values at
the start of fine-tuning, ``theta <- theta - lam * lr * (theta - theta_0)``, only where the pull
cannot raise the training loss, ``<g, theta - theta_0> >= 0`` for the gradient ``g`` of the step
just taken (Theorem 1). The formulas are :mod:`lalr_lightning.core.linearization.proximal`; Theorem 4's
``lambda_o`` is :func:`lalr_lightning.core.linearization.lambda_o.estimate_lambda_o`; this file decides when and
on what they run (``docs/proximal.md``).

Where the gradient comes from: the step runs as a post-step transform of
:class:`~lalr_lightning.core.runtime.control.LayerControl`, right after ``optimizer.step``, and reads
each parameter's ``.grad`` -- the gradient the step used: accumulated over the micro-batches
under gradient accumulation, all-reduced under DDP (so every rank decides the same), unscaled
under 16-bit AMP (Lightning's precision plugin unscales before ``on_before_optimizer_step``; a
step the scaler skips has no transform), clipped if the Trainer clips. The learning rate is the
one the step used for that parameter (:meth:`PostStep.lr`: scheduled LR x every callback's
multiplier); parameters that did not step (frozen, no gradient) are not pulled.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, stop_on_sigterm
from lalr_lightning.callbacks.host import Host, Traits, say
from lalr_lightning.choices import unknown
from lalr_lightning.core.linearization import proximal
from lalr_lightning.core.linearization.anchor import check_anchor, check_anchor_arg, load_anchor, snapshot, trainable
from lalr_lightning.core.linearization.lambda_o import unit_lambda_o
from lalr_lightning.core.linearization.ntk_groups import group_layers, layer_groups, matching_groups
from lalr_lightning.core.model.batch_loss import loss_source
from lalr_lightning.core.model.probe import fixed_batch
from lalr_lightning.core.runtime.checks import check_counts, check_finite, check_loss_fn, check_number
from lalr_lightning.core.runtime.control import PostStep
from lalr_lightning.core.runtime.placement import follow, placed
from lalr_lightning.core.runtime.shards import ShardLayout, all_sum, local_tensor, shard_layout, sharded

__all__ = ["ProximalRegularizer", "GRANULARITIES"]

GRANULARITIES = proximal.GRANULARITIES
_GRAD = operator.attrgetter("grad")


@dataclass(eq=False, repr=False)
class ProximalRegularizer(LayerwiseCallback):
    """Pull the weights toward ``theta_0`` after each step, where that cannot raise the loss.

    Example (a one-epoch run on digits)::

        >>> import lightning.pytorch as pl
        >>> from lalr_lightning.callbacks import ProximalRegularizer
        >>> from lalr_lightning.data import DigitsDataModule
        >>> from lalr_lightning.models import SmallCNN
        >>> prox = ProximalRegularizer(lam=1.0, granularity="global")
        >>> trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=0, logger=False,
        ...                      enable_checkpointing=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, callbacks=[prox])
        >>> trainer.fit(SmallCNN(width=8, in_channels=1), DigitsDataModule(batch_size=32))
        >>> sorted(prox.distances) == sorted(prox.regularized_fraction)  # {layer: ||theta - theta_0||}, {layer: share}
        True
        >>> all(0 <= f <= 1 for f in prox.regularized_fraction.values()), prox.lambda_o > 0
        (True, True)

    Args:
        lam: the proximal strength ``lambda`` (>= 0; the paper's grid: 0, 0.1, 0.5, 1, 2, 5, 10,
            50). The step's coefficient is ``lam * lr``; above 1 it is an error.
        selective: pull only where ``<g, theta - theta_0> >= 0`` (the paper's scheme); ``False``
            pulls at every step (plain L2-SP, decoupled).
        granularity: where the sign is taken: ``"tensor"`` (each parameter tensor), ``"layer"``
            (the sum over a layer's tensors; a LoRA pair is one layer) or ``"global"`` (the sum over
            all -- Theorem 1's condition, the only one that keeps the loss monotone step by step;
            ``docs/proximal.md``).
        anchor: ``"fit_start"`` (a copy of the trainable parameters when the fit starts, after
            the model is wrapped and a checkpoint restored) or the path of a checkpoint or state
            dict of this model (a Lightning checkpoint's ``state_dict`` is used).
        include: glob patterns over layer names; only matching layers are regularized (default:
            every trainable layer).
        offload_anchor: keep ``theta_0`` on the CPU (moved per tensor at each step) instead of on
            the parameters' device.
        radius: ``r`` of Theorem 4's ``lambda_o = 2 ||f_{theta_0}(x*) - y*|| Lip(f) / r``; default
            the current ``||theta - theta_0||``.
        probe_size: samples of the fixed probe batch ``lambda_o`` is estimated on (the same on
            every rank: drawn from the training dataset by a fixed seed).
        every_n_epochs: estimate ``lambda_o`` at the end of every N-th epoch (``None``: never).
        loss_fn: ``f(module, batch) -> loss`` for ``lambda_o``'s residual (below); default the
            module's ``loss(output, target)``, else the loss its ``training_step`` returns.
        name, strict_resume: as every callback of the package.

    ``lambda_o``'s residual ``||f(x*) - y*||``: for class-index targets ``[N]`` (or float targets
    of the outputs' shape) and no ``loss_fn``, the paper's squared loss on one-hot targets; for
    anything else (a language model's token labels, a dict batch without class labels, a given
    ``loss_fn``) the gradient of the module's own loss with respect to its outputs,
    ``N ||dL/df||`` (:func:`~lalr_lightning.core.linearization.lambda_o.output_gradient_norm`), which is
    ``||f - y||`` again for ``L = ||f - y||^2 / (2N)``. Which one is used is logged once.

    Readable: ``distances`` (layer -> ``||theta - theta_0||``, refreshed at every logging step,
    epoch end and fit end), ``regularized_fraction`` (layer -> share of its tensors' steps that
    were pulled), ``lambda_o`` (the latest estimate; NaN before one), ``history`` (one entry per
    epoch). Logged: ``<prefix>/distance/<layer>`` and ``<prefix>/regularized_fraction/<layer>`` at
    logging steps and epoch ends, ``<prefix>/total_distance`` and ``<prefix>/lambda_o`` per epoch.
    The anchor (unless read from a file, which is then re-read) and the step counts are in the
    checkpoint: a resumed run continues with the bitwise same ``theta_0``.
    """

    traits = Traits(
        log_prefix="proximal",
        plain_forward=True,  # torch.func Jacobians
        decision_attr="regularized_fraction",
        decision_key="regularized_fraction",
        score_key="distance",
        logs_lr=False,
        heatmap=("regularized_fraction", "proximal: share of steps pulled", "fraction"),
        volatile_settings=("offload_anchor",),
        readable=LayerwiseCallback.traits.readable + ("distances", "regularized_fraction", "lambda_o"),
    )

    lam: float
    selective: bool = True
    granularity: str = "tensor"
    anchor: str = "fit_start"
    include: Sequence[str] | None = None
    offload_anchor: bool = False
    radius: float | None = None
    probe_size: int = 16
    every_n_epochs: int | None = 1
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None

    def validate(self) -> None:
        super().validate()
        self.lam = proximal.check_lam(self.lam)
        if self.granularity not in GRANULARITIES:
            raise unknown("granularity", self.granularity, GRANULARITIES, show=repr)
        check_counts({"probe_size": self.probe_size, "every_n_epochs": self.every_n_epochs},
                     optional=("every_n_epochs",))
        self.loss_fn = check_loss_fn(self.loss_fn)
        self.selective = bool(self.selective)
        self.anchor = check_anchor_arg(self.anchor)
        include = self.include
        self.include = None if include is None else [include] if isinstance(include, str) else list(include)
        self.offload_anchor = bool(self.offload_anchor)
        self.radius = None if self.radius is None else check_number(
            "radius", self.radius, low=0, strict=True, note=" (or None: the current distance)")

    def __post_init__(self) -> None:
        super().__post_init__()
        # lambda_o through torch.func: under FSDP on rank zero's whole copy
        self.traits = self.traits.but(needs_whole_model=self.every_n_epochs is not None)
        self.distances: dict[str, float] = {}
        self.regularized_fraction: dict[str, float] = {}
        self.lambda_o = math.nan
        self._params: dict[str, torch.nn.Parameter] = {}
        self._groups: dict[str, list[str]] = {}
        self._layer_of: dict[str, int] = {}
        self._anchor: dict[str, torch.Tensor] | None = None
        # per set of stepped tensors its grouped step, which counts the steps and pulls on the device
        # (a step makes no device-to-host transfer) until _flush adds them to _steps and _pulled
        self._plans: dict[tuple[str, ...], proximal.GroupedStep] = {}
        # per plan, the theta_0 dict its anchor list was taken from and that list (in the plan's key order)
        self._plan_anchors: dict[tuple[str, ...], tuple[dict, list[torch.Tensor]]] = {}
        # (the step's LR dict, the names and parameters it steps): rebuilt when LayerControl's dict is a new one
        self._stepping: tuple[dict, tuple[str, ...], list[torch.nn.Parameter]] | None = None
        self._steps: dict[str, int] = {}  # per tensor, the optimizer steps it took part in
        self._pulled: dict[str, int] = {}  # of those, the steps that pulled it toward the anchor
        self._unit_lambda_o: float | None = None  # lambda_o at r = 1 (it scales as 1 / r)
        self._installed: set[int] = set()
        self._sharded = False  # the strategy shards the weights (FSDP): sums over the ranks' pieces
        self._layout = ShardLayout(torch.nn.Module())

    # ------------------------------------------------------------------ setup

    def configure(self, host: Host, module: nn.Module) -> None:
        self._sharded = sharded(host)
        params = trainable(module, type(self).__name__)
        self._groups = groups = matching_groups(layer_groups(module, params), self.include)
        self._layer_of = {n: i for i, members in enumerate(groups.values()) for n in members}
        self._params = {n: params[n] for members in groups.values() for n in members}
        self.layers = group_layers(groups, params)
        self._plans, self._plan_anchors, self._stepping, self._installed = {}, {}, None, set()

    def after_wrap(self, host: Host) -> None:
        self._layout = shard_layout(host, host.module)  # under FSDP the anchor is cut like the weights

    def after_start(self, host: Host) -> None:
        if self.restored and self._anchor is not None:  # the checkpoint's theta_0, bitwise
            self._cut_anchor()
        elif self.anchor == "fit_start":
            self._anchor = snapshot(self._params, self.offload_anchor)
        else:
            self._anchor = load_anchor(self.anchor, self._whole_shapes(), offload=True)
            self._cut_anchor()
        if not self.restored:
            self._steps, self._pulled = dict.fromkeys(self._params, 0), dict.fromkeys(self._params, 0)
        missing = [n for n in self._params if n not in self._steps]
        if missing:
            raise ValueError(f"{self.state_key}: the checkpoint has no step counts for {missing[0]!r}; resume with the "
                             "same parameters trainable")
        self.apply(host)

    def _whole_shapes(self) -> dict[str, torch.Tensor]:
        """Each parameter whole (under FSDP: not this rank's piece), on the meta device."""
        return {n: torch.empty(self._layout.shape(p), dtype=p.dtype, device="meta") for n, p in self._params.items()}

    def _cut_anchor(self) -> None:
        """A whole ``theta_0`` (a checkpoint's, a file's) put where each parameter is: on its device
        (the CPU with ``offload_anchor``), under FSDP this rank's piece of it."""
        check_anchor(self._anchor, self._whole_shapes(), "the checkpoint")
        anchor = {n: self._layout.local(p, self._anchor[n]) for n, p in self._params.items()}
        self._anchor = {n: a.cpu() for n, a in anchor.items()} if self.offload_anchor else anchor
        self._placed_anchor()  # in each parameter's dtype

    def apply(self, host: Host) -> None:
        for ctl in self.controls(host):
            if id(ctl) not in self._installed:
                ctl.set_transform(self.state_key, self._step)
                self._installed.add(id(ctl))

    # ------------------------------------------------------------------ the step

    def _step(self, step: PostStep) -> None:
        """The proximal step after one optimizer step (LayerControl calls it): grouped tensor
        operations and no device-to-host transfer (:class:`~lalr_lightning.core.linearization.proximal.GroupedStep`),
        and no Python loop over the parameters while the set that steps, the LRs and the anchor stay
        the same; under FSDP the ranks' sums go through collectives (:meth:`_sharded_step`)."""
        if self._sharded:
            return self._sharded_step(step)
        lrs = step._lrs  # the same dict while the step's LRs and every owner's settings are (LayerControl's cache)
        if self._stepping is None or self._stepping[0] is not lrs:
            names = tuple(n for n, p in self._params.items() if step.stepped(p))
            self._stepping = (lrs, names, [self._params[n] for n in names])
        _, key, params = self._stepping
        grads = list(map(_GRAD, params))
        if any(map(operator.is_, grads, itertools.repeat(None))):  # some took no part in the step
            kept = [i for i, g in enumerate(grads) if g is not None]
            key, params, grads = tuple(key[i] for i in kept), [params[i] for i in kept], [grads[i] for i in kept]
        if not key:
            return
        plan = self._plans.get(key)
        if plan is None or not plan.placed(params):
            self._flush()  # counts held on the device the model left
            plan = self._plans[key] = proximal.GroupedStep(params, [self._layer_of[n] for n in key])
            self._plan_anchors.pop(key, None)
        held = self._plan_anchors.get(key)
        if held is None or held[0] is not self._anchor:  # a new plan or a new theta_0 (restored, re-cut)
            anchor = self._placed_anchor()
            # on a CPU the plan stacks theta_0 for its sums: hold those views instead, theta_0 once in memory
            anchors = plan.adopt([anchor[n] for n in key])
            anchor.update(zip(key, anchors))
            held = self._plan_anchors[key] = (self._anchor, anchors)
        # lam * lr per tensor, the same while the step's LRs are (LayerControl keeps them)
        coefs = plan.coefficients(self.lam, lrs, lambda: {n: step.lr(self._params[n]) for n in key})
        plan.step_(params, held[1], grads, coefs, selective=self.selective, granularity=self.granularity)

    def _flush(self) -> None:
        """Add the counts the grouped steps hold on the device to ``_steps`` and ``_pulled``."""
        for key, plan in self._plans.items():
            steps, pulled = plan.take()
            for n, k in zip(key, pulled) if steps else ():  # one transfer per plan
                self._steps[n] = self._steps.get(n, 0) + steps
                self._pulled[n] = self._pulled.get(n, 0) + k

    def _sharded_step(self, step: PostStep) -> None:
        held = {id(p) for p in step.params}
        names = proximal.stepped({n: p for n, p in self._params.items() if id(p) in held}, reduce=all_sum)
        if not names:
            return
        anchor = self._placed_anchor()
        grads = {n: None if self._params[n].grad is None else local_tensor(self._params[n].grad) for n in names}
        pull = proximal.selective_step_({n: local_tensor(self._params[n]) for n in names},
                                        {n: local_tensor(anchor[n]) for n in names}, grads, self.lam,
                                        {n: step.lr(self._params[n]) for n in names}, selective=self.selective,
                                        granularity=self.granularity, groups=self._groups, reduce=all_sum)
        for n in names:
            self._steps[n] += 1
            self._pulled[n] += int(pull[n])

    def _placed_anchor(self) -> dict[str, torch.Tensor]:
        """``theta_0`` in each parameter's dtype and (unless offloaded) on its device: Lightning
        moves the model after the snapshot (back to the CPU before ``on_fit_end``)."""
        return follow(self._anchor, self._params, device=not self.offload_anchor)

    # ------------------------------------------------------------------ measurements

    def current_distances(self) -> tuple[dict[str, float], float]:
        """(``{layer: ||theta - theta_0||}``, the norm over all regularized parameters)."""
        d = proximal.deltas({n: local_tensor(p) for n, p in self._params.items()},
                            {n: local_tensor(a) for n, a in self._placed_anchor().items()})
        per_layer = proximal.distances(d, self._groups, reduce=all_sum if self._sharded else None)
        return per_layer, math.sqrt(math.fsum(v * v for v in per_layer.values()))

    def fractions(self) -> dict[str, float]:
        self._flush()
        return proximal.pulled_fractions(self._steps, self._pulled, self._groups)

    def estimate_lambda_o(self, host: Host, module: nn.Module, r: float) -> float:
        """Theorem 4's ``lambda_o`` for radius ``r``, with the residual and ``Lip(f)`` at
        ``theta_0`` on the probe batch (computed once per fit: they do not change). Under FSDP
        rank zero computes it on a whole copy of the model, from the whole ``theta_0``."""
        if self._unit_lambda_o is None:
            anchor = self._placed_anchor()  # under FSDP its pieces put together (collective, the same order everywhere)
            theta0 = {n: self._layout.whole(p, anchor[n]) for n, p in self._params.items()}
            self._unit_lambda_o = self.with_whole_model(host, lambda m: self._unit_lambda_o_on(host, m, theta0))
        return self._unit_lambda_o / r if r > 0 else math.nan

    def _unit_lambda_o_on(self, host: Host, module: nn.Module, anchor: dict[str, torch.Tensor]) -> float:
        batch = host.to_device(fixed_batch(host.batches(), self.probe_size))
        live = dict(module.named_parameters())
        value, own_loss = unit_lambda_o(module, batch, {n: placed(a, live[n]) for n, a in anchor.items()},
                                        self.loss_fn, check=stop_on_sigterm(host))
        if own_loss:  # the residual from the gradient of the module's own loss (class docstring)
            say(f"{type(self).__name__}: lambda_o's residual is N ||dL/df|| of "
                f"{loss_source(module, self.loss_fn)} (the targets are not class indices)")
        return value

    def measure(self, host: Host, module: nn.Module) -> dict[str, Any]:
        dist, total = self.current_distances()
        check_finite(type(self).__name__, host, dist, "the distance to the anchor theta_0")
        lam_o = math.nan
        if self.every_n_epochs is not None and (host.current_epoch + 1) % self.every_n_epochs == 0:
            lam_o = self.estimate_lambda_o(host, module, self.radius or total)
        return {"distances": dist, "total": total, "fractions": self.fractions(), "lambda_o": lam_o}

    def decide(self, measured: dict[str, Any]) -> Decision:
        summary = {"total_distance": measured["total"], "lambda_o": measured["lambda_o"]}
        return Decision(values=measured["fractions"], scores=measured["distances"], record=dict(summary),
                        summary=summary)

    def receive(self, decision: Decision) -> None:
        super().receive(decision)
        self.distances = dict(decision.scores)
        if math.isfinite(decision.summary.get("lambda_o", math.nan)):
            self.lambda_o = decision.summary["lambda_o"]

    # ------------------------------------------------------------------ hooks

    def after_batch(self, host: Host, outputs: Any, batch: Any) -> None:
        # under FSDP every rank takes part in the distances (each holds a piece of every tensor)
        if host.should_log() and (host.is_global_zero or self._sharded):
            self.distances, _ = self.current_distances()
            p = self.prefix
            self.log_values(host, {**{f"{p}/distance/{k}": v for k, v in self.distances.items()},
                                   **{f"{p}/regularized_fraction/{k}": v for k, v in self.fractions().items()}})

    def after_epoch(self, host: Host) -> None:
        self.update(host, host.module)

    def finish(self, host: Host) -> None:
        if self._anchor is not None:
            self.distances, _ = self.current_distances()
            self.regularized_fraction = self.fractions()

    def release(self, host: Host) -> None:
        self._installed = set()

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:
        keep = self.anchor == "fit_start" and self._anchor is not None
        # under FSDP the whole anchor (a collective: Lightning takes every rank's state at a checkpoint)
        whole = {n: self._layout.whole(self._params[n], t).detach().cpu() for n, t in self._anchor.items()} if keep \
            else None
        self._flush()
        return {"anchor": whole, "steps": dict(self._steps), "pulled": dict(self._pulled),
                "distances": dict(self.distances), "lambda_o": self.lambda_o, "unit_lambda_o": self._unit_lambda_o}

    def _load_state(self, state: dict) -> None:
        self._anchor = None if state.get("anchor") is None else dict(state["anchor"])
        self._steps, self._pulled = dict(state.get("steps", {})), dict(state.get("pulled", {}))
        self.distances = dict(state.get("distances", {}))
        self.lambda_o = float(state.get("lambda_o", math.nan))
        self._unit_lambda_o = state.get("unit_lambda_o")
