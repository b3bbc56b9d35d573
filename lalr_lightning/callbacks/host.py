"""What a method may ask of the training loop: the :class:`Host`, written once, with no trainer in it.

A method (TempBalance, LALR, a selection, ...) never sees the trainer. The timeline owner
(:class:`~lalr_lightning.callbacks.base.LayerwiseCallback`) hands it a ``Host``, and the host
answers in the terms below, whatever runs the loop. Lightning's ``Trainer`` is the first host
(:class:`~lalr_lightning.callbacks.lightning_host.LightningHost`); a second one (Hugging Face's
``Trainer`` through a ``TrainerCallback``) implements the same attributes and drives the same
timeline events, and no method file changes (docs/design.md, "Hosts").

:class:`Cadence` is when a method decides, declared, not written as hooks; :class:`Traits` is what
else a method declares once (its log names, where it measures, what it needs of the strategy);
``say`` and ``warn`` report once, from rank zero, with no trainer at hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

__all__ = ["SHARDINGS", "Cadence", "Host", "Traits", "rank", "say", "say_or_warn", "warn"]

#: how the strategy holds the parameters: one process or replicated (``none``, ``ddp``), or in shards
#: across the ranks (``fsdp1``: FSDP with ``use_orig_params``; ``fsdp2``: ``fully_shard``); DeepSpeed
#: ZeRO (``zero1``, ``zero2``: weights whole on every rank, optimizer state and gradients in flat
#: partitions; ``zero3``: the weights too), which only the Hugging Face host runs
SHARDINGS = ("none", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")

_log = logging.getLogger("lalr_lightning")


def rank() -> int:
    """This process's global rank (0 outside a process group), as launchers set it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


def say(message: str) -> None:
    """An info line, from rank zero only."""
    if rank() == 0:
        _log.info(message)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning (``UserWarning``), from rank zero only."""
    if rank() == 0:
        warnings.warn(message, category, stacklevel=2)


def say_or_warn(message: str, warning: bool) -> None:
    """:func:`warn` where ``warning``, else :func:`say` (a cost beyond a budget is a warning)."""
    (warn if warning else say)(message)


@dataclass(frozen=True)
class Cadence:
    """When a method decides: at the start of a fresh fit (``start``), then every
    ``every_n_epochs`` epochs (at the epoch's start) or every ``every_n_steps`` optimizer steps (at
    the batch's start), or at the start of the listed ``epochs``. A decision point is the interval
    it falls in: the owner decides at most once per point, after a resume too (the last decision's
    epoch and step are in the history). With no decision yet, the first point is due: an
    ``every_n_epochs`` cadence without ``start`` still decides at epoch 0's start."""

    start: bool = False
    every_n_epochs: int | None = None
    every_n_steps: int | None = None
    #: decide at the start of each of these epochs (ascending), once: an epoch listed decides at
    #: the first epoch start at or after it that comes before any decision of its own
    epochs: tuple[int, ...] = ()

    def due(self, where: str, now: int, last: Mapping[str, Any] | None) -> bool:
        """Whether a decision is due at ``where`` (``"epoch"`` or ``"step"``) when the counter
        is ``now``; ``last``: the last decision's history entry (None: none yet)."""
        if where == "epoch" and self.epochs:
            passed = [e for e in self.epochs if e <= now]
            if passed and (last is None or int(last["epoch"]) < passed[-1]):
                return True
        n = self.every_n_epochs if where == "epoch" else self.every_n_steps
        if n is None:
            return False
        return last is None or now // n != int(last[where]) // n


@dataclass(frozen=True)
class Traits:
    """What a method declares about itself, once, as the class attribute ``traits``
    (``traits = Traits(log_prefix="tempbalance", score_key="alpha", esd_plots=True)``); a subclass
    of a method changes some with ``Parent.traits.but(...)``. A trait that depends on the settings
    is set per instance in ``__post_init__`` (``self.traits = self.traits.but(...)``)."""

    #: the log prefix (``<prefix>/<quantity>/<layer>``) of an instance without ``name``
    log_prefix: str = "layerwise"
    #: the attribute holding the per-layer decision (``multipliers``, ``selected``, ``ratios``)
    decision_attr: str = "multipliers"
    #: its per-layer log quantity (``<prefix>/<decision_key>/<layer>``)
    decision_key: str = "multiplier"
    #: the log quantity of ``scores`` (``alpha``, ``rgn``, ``j_hat``, ...)
    score_key: str = "score"
    #: what ``measure`` reads (it runs on every rank): ``"weights"`` (shared out among the ranks
    #: with ``measure_shards``) or ``"data"`` (each rank its own batches, then reduced)
    measures: str = "weights"
    #: whether ``measure`` needs the model's forward without the loop's autocast (torch.func)
    plain_forward: bool = False
    #: heatmap of the decisions at fit end: (key under the prefix, title, colour-bar label)
    heatmap: tuple[str, str, str] | None = None
    #: the fewest history entries worth a heatmap
    heatmap_min_entries: int = 2
    #: whether it decides per weight matrix from the spectra, so its figures include the ESD
    #: log-log plot of each matrix (TempBalance, LALR, HT-SR pruning, Spectrum)
    esd_plots: bool = False
    #: whether it changes learning rates (then ``lr_eff/<layer>`` is logged every logging step)
    logs_lr: bool = True
    #: settings that may differ between the run that wrote a checkpoint and the one resuming
    volatile_settings: tuple[str, ...] = ()
    #: the version of its ``state_dict`` (a checkpoint of a newer one is refused)
    state_version: int = 1
    #: at most this many history entries are kept (and checkpointed), the newest
    history_limit: int = 1000
    #: whether it works on parameters still lazy at setup (it reads no weight before training:
    #: the parameters keep their identity when the first forward shapes them)
    lazy_ok: bool = False
    #: attributes a user reads after ``fit``; brought back to the main process after ddp_spawn
    readable: tuple[str, ...] = ("scores", "measurements", "history")
    #: why it cannot work where the strategy shards the weights (FSDP), and what to use instead
    #: (the host refuses the strategy with it); None: it can
    fsdp_refusal: str | None = None
    #: whether a measurement runs the whole model (``with_whole_model``): under FSDP a skeleton of
    #: it is kept from before the wrap, filled on rank zero for each measurement
    needs_whole_model: bool = False
    #: whether ``configure`` + ``measure`` + ``decide`` need the model's weights alone (and change
    #: nothing): then ``plan()`` gives the decision without a fit
    decides_from_weights: bool = False

    def __post_init__(self) -> None:
        if self.measures not in ("weights", "data"):
            raise ValueError(f"Traits: measures must be 'weights' or 'data', got {self.measures!r}")
        for name in ("log_prefix", "decision_attr", "decision_key", "score_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Traits: {name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.heatmap is not None and (not isinstance(self.heatmap, tuple) or len(self.heatmap) != 3):
            raise ValueError(f"Traits: heatmap must be None or (key, title, colour-bar label), got {self.heatmap!r}")
        for name in ("volatile_settings", "readable"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"Traits: {name} must be a tuple of attribute names, got {value!r}")
        for name in ("heatmap_min_entries", "state_version", "history_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Traits: {name} must be an integer >= 1, got {value!r}")

    def but(self, **changes: Any) -> Traits:
        """These traits with ``changes`` (a subclass's: ``Parent.traits.but(log_prefix="mine")``)."""
        unknown = sorted(set(changes) - TRAIT_NAMES)
        if unknown:
            raise TypeError(f"Traits has no field {', '.join(map(repr, unknown))}; the fields: {', '.join(sorted(TRAIT_NAMES))}")
        return replace(self, **changes)


#: the field names of :class:`Traits` (once, the class attributes every method set)
TRAIT_NAMES = frozenset(f.name for f in fields(Traits))


class Host(ABC):
    """What a method may ask of the loop that trains the model (module docstring).

    Counters, the world and the model are attributes; the rest are methods. Every rank has its
    own host; a collective (``broadcast``, ``gather_objects``) is called by every rank."""

    #: the model as the user wrote it (a ``LightningModule``, a ``transformers`` model)
    module: nn.Module
    #: the outermost module (the DDP wrapper; FSDP1's root unit, through which a forward gathers)
    root: nn.Module
    current_epoch: int
    global_step: int
    #: the epochs the fit runs; None where steps bound it
    max_epochs: int | None = None
    #: the step the loggers' curves use (Lightning: batches that stepped)
    log_step: int
    global_rank: int
    world_size: int
    is_global_zero: bool
    #: one of :data:`SHARDINGS`
    sharding: str
    #: the optimizers, each controlled through ``core.control.LayerControl``
    optimizers: list[torch.optim.Optimizer]
    #: whether anything takes logs
    loggers: Any
    #: whether a fit with training data runs (``batches``); False outside a fit (``plan()``: the
    #: weights alone), where a method that would draw batches says so or does without
    has_data: bool = True
    #: under DDP, the options the model will be wrapped with (a method may set
    #: ``find_unused_parameters`` before the wrap); None elsewhere
    ddp_options: dict | None = None

    @property
    def sharded(self) -> bool:
        return self.sharding in ("fsdp1", "fsdp2")

    @abstractmethod
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank."""

    @abstractmethod
    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""

    #: where the model's weights live (or go, before the wrap)
    device: torch.device
    #: batches per optimizer step (the loss is divided by it before backward)
    accumulate: int = 1
    #: the mixed-precision loss scaler (``get_scale()``), None without one
    grad_scaler: Any = None

    @abstractmethod
    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over the ranks (a collective)."""

    @abstractmethod
    def to_device(self, batch: Any, precision: bool = True) -> Any:
        """A batch a method drew itself, as the loop hands batches to the model: on its device,
        floating tensors in the precision's input dtype (``precision=False``: as they are, for a
        model not yet converted)."""

    @abstractmethod
    def forward_context(self) -> AbstractContextManager:
        """The context the loop runs the model's forward in (autocast)."""

    def plain_forward(self) -> AbstractContextManager:
        """The model's forward as written, without any autocast the loop put around it (torch.func's
        Jacobians cannot run under autocast). Lightning measures outside its autocast already."""
        return contextlib.nullcontext()

    def gathered(self, params: Iterable[nn.Parameter]) -> AbstractContextManager:
        """``params`` whole for the length of the block, read-only, where the engine holds them in
        partitions outside its forward (DeepSpeed ZeRO-3, ``sharding == "zero3"``; a collective:
        every rank, the same parameters); elsewhere they are whole already."""
        return contextlib.nullcontext()

    @abstractmethod
    def batches(self, as_given: bool = False) -> Iterable | None:
        """The training loader, to draw measurement batches from (``as_given``: as the user gave
        it, without the distributed sampler the host adds, or None without one)."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Numbers to every logger (rank zero only); ``step``: the curves' step, ``log_step`` if None."""

    @abstractmethod
    def should_log(self) -> bool:
        """Whether this step is a logging step."""

    @abstractmethod
    def publish(self, method: Any, event: str, decision: Any = None) -> None:
        """Tables, figures and settings for the loggers that show them (``start``, ``decision``, ``end``)."""

    @abstractmethod
    def stop_check(self) -> Callable[[], None]:
        """A check a long measurement calls between chunks: raises once the loop was asked to stop."""

    def controls(self, who: str) -> list:
        """The layer control of every optimizer (:class:`~lalr_lightning.core.runtime.control.LayerControl`,
        made on first use), for the method ``who``; a one-line error without an optimizer."""
        if not self.optimizers:
            raise RuntimeError(f"{who}: the LightningModule configured no optimizer")
        # imported here: a method's module reads the layer control only through its host
        from lalr_lightning.core.runtime.control import LayerControl

        return [LayerControl.of(opt) for opt in self.optimizers]

    def info(self, message: str) -> None:
        """A line the user should see, shown as the loop shows its own (Lightning: its rank-zero info,
        as its model summary); here the package's logger, rank zero only (:func:`say`)."""
        say(message)
