"""The package's callbacks on Hugging Face's ``transformers.Trainer`` (and what is built on it: TRL's
``SFTTrainer``, ...): the second :class:`~lalr_lightning.callbacks.host.Host`.

    from lalr_lightning.callbacks import BlockSchedule
    from lalr_lightning.hf import trainer_callback

    lisa = BlockSchedule(schedule="lisa", gamma=2, every_n_steps=20)   # constructed as for Lightning
    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[trainer_callback(lisa)])
    trainer.train()

:func:`trainer_callback` wraps any callback of the package (or a list: a list back, whose
multipliers multiply as under Lightning) in a ``transformers.TrainerCallback`` that drives the
same method object through its runner's timeline events (``callbacks/runner.py``) on an
:class:`HFHost`. No method file knows which trainer runs it.

Where the timeline's events happen under the Trainer (``Trainer.train`` in transformers 5):

* ``begin`` (configure, prepare: a static selection freezes) and the checkpoint's state
  (``restore``) run when the Trainer creates its optimizer (``create_optimizer``, wrapped for the
  fit): after the model's checkpoint is loaded, before the optimizer exists and before the model
  is wrapped in DDP, so frozen parameters get no optimizer state and no DDP bucket. The optimizer
  is built over the parameters the user left trainable (a switching selection needs all of
  them in it), the selection's flags put back right after;
* the wrap (``wrapped_now``): before the Trainer loads the optimizer state on a resume, else at
  ``on_train_begin``;
* every micro-batch (``training_step``, wrapped): the batch's start before, ``after_backward``
  after; ``after_batch`` at ``on_substep_end`` / ``on_step_end``;
* before the optimizer step: before gradient clipping (``_clip_grad_norm``, wrapped), else at
  ``on_pre_optimizer_step``;
* ``on_epoch_begin`` / ``on_epoch_end`` / ``on_train_end``; the state goes to
  ``<checkpoint>/lalr_lightning.pt`` at ``on_save``.

Under the Trainer's DeepSpeed ZeRO the host hands the methods the engine's torch optimizer with a view of
its flat partitions (core/runtime/flat.py's FlatControl, docs/sharded.md), and under ZeRO-3 gathers the
parameters of one layer at a time for a measurement (``HFHost.gathered``). Under accelerate's FSDP2
(``fsdp_config={"version": 2}``) the Trainer creates the optimizer on the whole model and then
``fully_shard`` puts DTensor parameters in place of the model's: the methods follow them by name at the
wrap, as under Lightning's FSDP2; accelerate's FSDP1 is refused.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lalr_lightning.callbacks import keys
from lalr_lightning.callbacks.base import LayerwiseCallback
from lalr_lightning.callbacks.host import Host
from lalr_lightning.callbacks.runner import Runner
from lalr_lightning.core.model.batch_loss import to_device
from lalr_lightning.core.runtime.shards import gather_objects

__all__ = ["STATE_FILE", "HFHost", "trainer_callback"]

#: the file of the callbacks' states in each of the Trainer's checkpoint folders
STATE_FILE = "lalr_lightning.pt"


def _transformers():
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the text extra installs it
        raise ImportError("lalr_lightning.hf needs transformers: pip install 'lalr_lightning[text]'") from err
    return transformers


class HFHost(Host):
    """A ``transformers.Trainer`` fit as a :class:`Host` (module docstring)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.epoch: int | None = None  # set at each epoch's start (the Trainer's own is a float)
        self.sharding = _sharding_of(trainer)
        self._ddp_options: dict | None = None

    # ---------------------------------------------------------------- counters, world, model

    module = property(lambda self: self.trainer.model)
    global_step = property(lambda self: int(self.trainer.state.global_step))
    log_step = property(lambda self: int(self.trainer.state.global_step))
    global_rank = property(lambda self: int(self.trainer.args.process_index))
    world_size = property(lambda self: int(self.trainer.args.world_size))
    is_global_zero = property(lambda self: self.trainer.is_world_process_zero())
    device = property(lambda self: self.trainer.args.device)
    accumulate = property(lambda self: int(self.trainer.args.gradient_accumulation_steps))
    loggers = True  # the Trainer's log reaches its report_to integrations and its log_history

    @property
    def max_epochs(self) -> int | None:
        """The epochs the fit runs (None when ``max_steps`` bounds it, as Lightning's -1)."""
        args = self.trainer.args
        return None if args.max_steps and args.max_steps > 0 else int(math.ceil(args.num_train_epochs))

    @property
    def current_epoch(self) -> int:
        if self.epoch is not None:
            return self.epoch
        return int(math.floor(self.trainer.state.epoch or 0))

    @property
    def root(self) -> nn.Module:
        wrapped = getattr(self.trainer, "model_wrapped", None)
        return wrapped if isinstance(wrapped, nn.Module) else self.trainer.model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        opt = self.trainer.optimizer
        if opt is None:
            return []
        if self.sharding.startswith("zero"):
            return _zero_optimizers(self.trainer)
        # accelerate's AcceleratedOptimizer steps the torch optimizer inside it: that one owns the hooks
        return [getattr(opt, "optimizer", opt)]

    @property
    def ddp_options(self) -> dict | None:
        """The options accelerate wraps the model in DDP with (a method may ask for
        ``find_unused_parameters`` before the wrap; the session hands it on)."""
        if self.sharding != "ddp":
            return None
        if self._ddp_options is None:
            handler = getattr(self.trainer.accelerator, "ddp_handler", None)
            self._ddp_options = {k: getattr(handler, k) for k in ("find_unused_parameters", "static_graph")
                                 if handler is not None and hasattr(handler, k)}
        return self._ddp_options

    @property
    def grad_scaler(self) -> Any:
        return getattr(self.trainer.accelerator, "scaler", None)

    # ---------------------------------------------------------------- collectives

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        return gather_objects(obj)

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return tensor
        out = tensor.detach().clone()
        torch.distributed.all_reduce(out)
        return out / self.world_size

    # ---------------------------------------------------------------- batches

    def to_device(self, batch: Any, precision: bool = True) -> Any:
        return to_device(batch, self.device)  # the Trainer hands the model its batches as collated

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.trainer.autocast_smart_context_manager()

    @contextlib.contextmanager
    def plain_forward(self):
        """accelerate's mixed precision replaces the model's ``forward`` with one under autocast
        (keeping the original as ``_original_forward``): the original, and no autocast, meanwhile."""
        model = self.module
        patched, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
        if patched is not None and original is not None:
            model.forward = original
        try:
            with torch.autocast(self.device.type, enabled=False):
                yield
        finally:
            if patched is not None and original is not None:
                model.forward = patched

    def gathered(self, params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager:
        """Under ZeRO-3, DeepSpeed's ``GatheredParameters`` of ``params`` (read-only: no rank's
        change is written back); elsewhere nothing to do."""
        held = [p for p in params if hasattr(p, "ds_tensor")]
        if self.sharding != "zero3" or not held:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(held, modifier_rank=None)

    def batches(self, as_given: bool = False) -> Iterable | None:
        """The training data as the Trainer collates it, in order (its own loader is accelerate's,
        whose iteration drives gradient accumulation: a measurement must not draw from it); under
        DDP each rank its share (``as_given``: every rank all of it)."""
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

        trainer = self.trainer
        data, collate = trainer.train_dataset, trainer.data_collator
        if data is None:
            raise ValueError("the Trainer has no train_dataset to measure on; pass train_dataset=...")
        try:
            import datasets

            if isinstance(data, datasets.Dataset):
                data = trainer._remove_unused_columns(data, description="training")
            else:
                collate = trainer._get_collator_with_removed_columns(collate, description="training")
        except ImportError:  # pragma: no cover
            pass
        size = trainer.args.per_device_train_batch_size
        if isinstance(data, IterableDataset):  # streamed: in its own order, no sampler; under DDP every n-th batch
            loader = DataLoader(data, batch_size=size, collate_fn=collate)
            return _Strided(loader, self.global_rank, self.world_size) if self.world_size > 1 and not as_given \
                else loader
        sampler = DistributedSampler(data, self.world_size, self.global_rank, shuffle=False) \
            if self.world_size > 1 and not as_given else SequentialSampler(data)
        return DataLoader(data, batch_size=size, sampler=sampler, collate_fn=collate)

    # ---------------------------------------------------------------- logs

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        # the Trainer's log: its report_to integrations (TensorBoard, W&B, ...) at its global step
        if not metrics or not self.is_global_zero:
            return
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        # the integrations only (TensorBoard, W&B, ...): not the console, not trainer_state.json
        logs = {**metrics, "epoch": float(self.trainer.state.epoch or 0.0)}
        trainer = self.trainer
        for cb in trainer.callback_handler.callbacks:
            if not isinstance(cb, (PrinterCallback, ProgressCallback)):
                cb.on_log(trainer.args, trainer.state, trainer.control, logs=dict(logs),
                          model=trainer.model, processing_class=trainer.processing_class,
                          optimizer=trainer.optimizer, lr_scheduler=trainer.lr_scheduler)

    def should_log(self) -> bool:
        args = self.trainer.args
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        if strategy != "steps":
            return False
        every = args.logging_steps
        every = max(1, math.ceil(every * self.trainer.state.max_steps)) if every < 1 else int(every)
        return self.global_step % every == 0

    def publish(self, method: Any, event: str, decision: Any = None) -> None:
        """Tables and figures go to Lightning's loggers only; the numbers reach the Trainer's."""

    def stop_check(self) -> Callable[[], None]:
        """Nothing to check: the Trainer stops between steps (its ``should_training_stop``, also set
        when ``max_steps`` is reached), and Ctrl-C raises between chunks by itself."""
        return lambda: None


class _Strided:
    """Batches ``start``, ``start + step``, ... of ``loader``, anew at each iteration (a rank's share
    of a streamed dataset, which no sampler can split)."""

    def __init__(self, loader: Iterable, start: int, step: int):
        self.loader, self.start, self.step = loader, start, step

    def __iter__(self):
        return itertools.islice(iter(self.loader), self.start, None, self.step)


def _find_trainer() -> Any:
    """The ``transformers.Trainer`` whose ``__init__`` (or training loop) is calling us."""
    trainer_cls = _transformers().Trainer
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, trainer_cls):
            return obj
        frame = frame.f_back
    return None


# ---------------------------------------------------------------- the Trainer's engines (DeepSpeed ZeRO)

#: methods that change whole parameters after every step (a post-step transform) or measure the
#: model through torch.func at every epoch: under ZeRO the engine holds the trained values only in
#: flat fp32 partitions, which they do not read
_NOT_UNDER_ZERO = {"ProximalRegularizer": "pulls whole parameters toward their pretrained values after every step",
                   "LMSAStepper": "replaces the optimizer's update of whole blocks after every step",
                   "NTKDiagnostics": "differentiates the whole model's outputs at every epoch (torch.func)"}
#: methods that find their layers from the weights' shapes, or measure them, before the engine is
#: built: under ZeRO-3 the model must still be whole then (not partitioned by zero.Init); during
#: the fit they gather one layer at a time (HFHost.gathered, docs/sharded.md)
_WHOLE_BEFORE_ZERO3 = ("SpectrumSelect", "NTKSelect", "TempBalanceCallback", "LALRScheduleCallback", "AutoRGN",
                       "HTSRPruning")


def _zero_stage(trainer: Any) -> int:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return int(getattr(plugin, "zero_stage", 0) or 0)


def _fsdp_version(trainer: Any) -> int:
    """accelerate's FSDP version under the Trainer's FSDP (``fsdp_config={"version": ...}``), else 0."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return 0
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # accelerate's default is FSDP1
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def _sharding_of(trainer: Any) -> str:
    """The host's ``sharding``: ``zero1``..``zero3`` under the Trainer's DeepSpeed, ``fsdp2`` under
    accelerate's FSDP2, else DDP or one process."""
    if getattr(trainer, "is_deepspeed_enabled", False) and _zero_stage(trainer) in (1, 2, 3):
        return f"zero{_zero_stage(trainer)}"
    if _fsdp_version(trainer) == 2:
        return "fsdp2"
    return "ddp" if trainer.args.world_size > 1 else "none"


def _zero_optimizers(trainer: Any) -> list[torch.optim.Optimizer]:
    """Under ZeRO, the torch optimizer the engine steps (its groups hold this rank's flat fp32
    partitions), given a view of which parameter each range holds (``FlatView`` in ``core/runtime/control.py``) so
    that ``LayerControl.of`` controls it; none before the engine is built."""
    from lalr_lightning.core.runtime.control import FLAT_VIEW
    from lalr_lightning.core.runtime.flat import FlatView, attach_flat_view

    zero = getattr(getattr(trainer, "model_wrapped", None), "optimizer", None)
    base = getattr(zero, "optimizer", None)
    if not isinstance(base, torch.optim.Optimizer):
        return []
    if not (hasattr(zero, "bit16_groups") or hasattr(zero, "fp32_partitioned_groups_flat")):
        # ZeRO-1 with bf16 and fp32 gradient accumulation steps DeepSpeed's BF16_Optimizer, another layout:
        # the methods would control nothing (masks unenforced, nothing frozen)
        raise RuntimeError(f"the engine steps DeepSpeed's {type(zero).__name__}, whose partitions lalr_lightning "
                           "does not read (ZeRO-1 with bf16 and data_types.grad_accum_dtype='fp32'); drop "
                           "grad_accum_dtype, or use ZeRO-2 (zero_optimization.stage=2)")
    if getattr(base, FLAT_VIEW, None) is None:
        group = getattr(zero, "dp_process_group", None)
        rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
        attach_flat_view(base, FlatView.of_zero(zero, rank))
    return [base]


def _refuse_engine(trainer: Any, cb: LayerwiseCallback) -> None:
    """One line for what the Trainer's engines cannot run (docs/sharded.md)."""
    who = type(cb).__name__
    version = _fsdp_version(trainer)
    if version == 1:
        raise RuntimeError(f"{who} under the Trainer's FSDP1 follows no flat parameter; use FSDP2 "
                           "(fsdp_config={'version': 2}, transformers' default), DeepSpeed ZeRO-2 or ZeRO-3 "
                           "(deepspeed=...), or Lightning's FSDPStrategy (docs/sharded.md)")
    if version == 2:
        refusal = cb.traits.fsdp_refusal  # what no sharded model can run (as under Lightning's FSDP2)
        if refusal:
            raise RuntimeError(f"{who} under the Trainer's FSDP2: {refusal}")
        return
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return
    stage = _zero_stage(trainer)
    if stage not in (1, 2, 3):
        raise RuntimeError(f"{who} under DeepSpeed needs ZeRO stage 1, 2 or 3 (the config has stage {stage}); set "
                           "zero_optimization.stage, or train with DDP")
    if who in _NOT_UNDER_ZERO:
        raise RuntimeError(f"{who} {_NOT_UNDER_ZERO[who]}, which DeepSpeed ZeRO holds only in flat partitions; run it "
                           "on one device or DDP, under the Trainer's FSDP2 (fsdp_config={'version': 2}) or "
                           "Lightning's FSDPStrategy (docs/sharded.md)")
    if stage == 3 and who in _WHOLE_BEFORE_ZERO3 and any(
            hasattr(p, "ds_tensor") for p in trainer.model.parameters()):
        raise RuntimeError(f"{who} reads the weights before the engine is built, and ZeRO-3 partitioned them when "
                           "the model was created (zero.Init: TrainingArguments made before from_pretrained); create "
                           "the model before the TrainingArguments, or use ZeRO-2")
    if stage == 3 and who == "HTSRPruning" and (getattr(cb, "criterion", "magnitude") != "magnitude"
                                                 or getattr(cb, "m", None) or getattr(cb, "preset", None) == "owl"):
        # Wanda, SparseGPT, N:M and OWL calibrate block by block on the whole model, pruning as they go
        raise RuntimeError("HTSRPruning under ZeRO-3 prunes by magnitude only (criterion='magnitude', no N:M, no "
                           "preset='owl'): the others calibrate on whole blocks, which ZeRO-3 holds in partitions; "
                           "use ZeRO-2 (zero_optimization.stage=2) or DDP for them")


def _split_for_switching(optimizer: Any, methods: list[LayerwiseCallback]) -> None:
    """Under ZeRO, one parameter group per unit a switching selection turns on and off (LISA's
    blocks), before the engine flattens each group into one partition: a frozen unit's partition
    then gets no gradient, no update and no optimizer state (released at each switch), while
    every unit keeps its fp32 master weights for when it trains again (docs/sharded.md)."""
    units = [u for cb in methods if getattr(cb, "switches", False) for u in cb.switching_units()]
    if not units:
        return
    owner: dict[int, int] = {}
    for i, u in enumerate(units):
        for p in u.params.values():
            owner.setdefault(id(p), i)
    groups = []
    for g in optimizer.param_groups:
        rest = [p for p in g["params"] if id(p) not in owner]
        by_unit: dict[int, list] = {}
        for p in g["params"]:
            if id(p) in owner:
                by_unit.setdefault(owner[id(p)], []).append(p)
        groups += [{**g, "params": ps} for ps in ([rest] if rest else []) + list(by_unit.values())]
    optimizer.param_groups = groups


def _refuse_unsupported(trainer: Any, cb: LayerwiseCallback) -> None:
    who = type(cb).__name__
    _refuse_engine(trainer, cb)
    model = trainer.model
    through_func = who in ("NTKDiagnostics", "NTKSelect") or (
        who == "ProximalRegularizer" and getattr(cb, "every_n_epochs", None) is not None)
    if through_func and (getattr(model, "is_activation_checkpointing", False)
                         or getattr(model, "is_gradient_checkpointing", False)):
        raise RuntimeError(f"{who} differentiates the model's outputs again (torch.func, a second backward), which "
                           "the model's activation checkpointing breaks; pass activation_checkpointing=False to the "
                           "Trainer's arguments (gradient_checkpointing=False before transformers 5; TRL's "
                           "SFTConfig turns it on by default)")
    if who == "LMSAStepper" and any(c.__module__.startswith("trl.") and c.__name__ == "SFTTrainer"
                                    for c in type(trainer).__mro__):
        # TRL's fused LM head: the loss comes from lm_head.weight in tiles, the head never runs as a module
        raise RuntimeError("LMSAStepper under TRL's SFTTrainer: its fused LM head computes the loss from "
                           "lm_head.weight directly, so L-MSA cannot capture the head block's states; run L-MSA on "
                           "transformers.Trainer (or Lightning)")


class _Session:
    """The methods on one Trainer and the Trainer methods wrapped for its fit (module docstring)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.host = HFHost(trainer)
        self.methods: list[LayerwiseCallback] = []
        self.resume: str | None = None
        self.begun = False
        self.stepped = False  # the before-step event ran for this optimizer step
        self.last: tuple[Any, Any] = (None, None)  # (loss, inputs) of the last micro-batch
        self._wrap("train", self._train)
        self._wrap("create_optimizer", self._create_optimizer)
        self._wrap("training_step", self._training_step)
        self._wrap("_clip_grad_norm", self._clip_grad_norm)
        self._wrap("_load_optimizer_and_scheduler", self._load_optimizer)
        self._wrap("_wrap_model", self._wrap_model)

    @classmethod
    def of(cls, trainer: Any) -> _Session:
        session = trainer.__dict__.get("_lalr_session")
        if session is None:
            session = trainer.__dict__["_lalr_session"] = cls(trainer)
        return session

    def _wrap(self, name: str, around: Callable) -> None:
        inner = getattr(self.trainer, name)
        self.trainer.__dict__[name] = functools.wraps(inner)(functools.partial(around, inner))

    # ---------------------------------------------------------------- the wrapped Trainer methods

    def _train(self, inner, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bool):
            if resume_from_checkpoint:
                from transformers.trainer_utils import get_last_checkpoint

                found = get_last_checkpoint(self.trainer.args.output_dir)
                resume_from_checkpoint = found if found is not None else resume_from_checkpoint
            else:
                resume_from_checkpoint = None
        self.resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        self.begun = False
        self.host.epoch = None
        try:
            return inner(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """A fit that raised: undo what ``on_train_end`` would (the Trainer has no exception event;
        Lightning's teardown runs after an error too), so the model keeps no selection's
        ``requires_grad`` flags and the optimizer no step's split groups."""
        if not self.begun:
            return
        self.begun = False
        Runner.abandon_steps(self.host)  # the optimizers' controllers, once for all methods
        for cb in self.methods:
            Runner.of(cb).teardown(self.host)

    def _create_optimizer(self, inner, *args, **kwargs):
        if self.begun:
            return inner(*args, **kwargs)
        self.begun = True
        for cb in self.methods:
            _refuse_unsupported(self.trainer, cb)
        model = self.trainer.model
        before = {id(p): p.requires_grad for p in model.parameters()}
        for cb in self.methods:
            Runner.of(cb).begin(self.host)
        self._restore()
        # the optimizer holds every parameter the user left trainable (a switching selection turns
        # them on later); those the selection froze get no gradient, hence no optimizer state
        after = {id(p): p.requires_grad for p in model.parameters()}
        for p in model.parameters():
            p.requires_grad_(before[id(p)])
        try:
            optimizer = inner(*args, **kwargs)
            if self.host.sharding.startswith("zero"):
                _split_for_switching(optimizer, self.methods)
            return optimizer
        finally:
            # FSDP2: the user's flags go into fully_shard's new parameters (which copy them, and
            # which the owners would take as the user's); the selections set theirs after the wrap
            if self.host.sharding != "fsdp2":
                for p in model.parameters():
                    p.requires_grad_(after[id(p)])

    def _wrap_model(self, inner, *args, **kwargs):
        options = self.host._ddp_options
        handler = getattr(self.trainer.accelerator, "ddp_handler", None)
        if options and options.get("find_unused_parameters") and handler is not None:
            handler.find_unused_parameters = True
        return inner(*args, **kwargs)

    def _restore(self) -> None:
        if self.resume is None:
            return
        path = os.path.join(self.resume, STATE_FILE)
        states: Any = {}
        if os.path.isfile(path):
            damaged = f"{path} is not the callbacks' states written by lalr_lightning"
            fix = ("; delete it to resume without them (each callback starts afresh), or resume from another "
                   "checkpoint")
            try:
                states = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 -- any unreadable file: truncated, another format, pickled code
                raise ValueError(f"{damaged} ({type(e).__name__}){fix}") from e
            if not isinstance(states, dict):
                raise ValueError(f"{damaged} (a {type(states).__name__}, not a dict){fix}")
        owners = SimpleNamespace(callbacks=self.methods)
        for cb in self.methods:
            keys.adopt(cb, owners, {"callbacks": states})  # an entry written under an earlier key
            if cb.state_key in states:
                Runner.of(cb).restore(states[cb.state_key])
        _say_unclaimed(states, self.methods)

    def _wrapped(self) -> None:
        for cb in self.methods:
            if not Runner.of(cb).wrapped:
                Runner.of(cb).wrapped_now(self.host, final=True)

    def _load_optimizer(self, inner, checkpoint=None, *args, **kwargs):
        self._wrapped()  # as Lightning: the decision is applied before the optimizer state comes back
        if self.host.sharding != "fsdp2" or checkpoint is None:
            return inner(checkpoint, *args, **kwargs)
        from lalr_lightning.core.runtime.control import LayerControl

        # torch's set_optimizer_state_dict takes its template from the flags when it loads (as
        # under Lightning's FSDP2: OptimizerResume): exactly the parameters with saved state, or,
        # with none saved yet, every one, its made-up state dropped after
        saved = _fsdp2_saved(checkpoint, self.trainer.model)
        on, made_up = ((lambda p: id(p) in saved), None) if saved else ((lambda p: True), (lambda p: True))
        with LayerControl.grad_flags_of(self.host.optimizers, on, made_up=made_up):
            return inner(checkpoint, *args, **kwargs)

    def _training_step(self, inner, model, inputs, *args, **kwargs):
        for cb in self.methods:
            Runner.of(cb).batch_start(self.host, inputs)
        loss = inner(model, inputs, *args, **kwargs)
        for cb in self.methods:
            Runner.of(cb).after_backward(self.host)
        self.last = (loss, inputs)
        return loss

    def before_step(self) -> None:
        if self.stepped:
            return
        self.stepped = True
        for opt in self.host.optimizers:
            for cb in self.methods:
                Runner.of(cb).before_step(self.host, opt)

    def _clip_grad_norm(self, inner, *args, **kwargs):
        self.before_step()  # gradients final (accelerate unscales in the clip), not yet clipped
        return inner(*args, **kwargs)

    def after_batch(self, step_end: bool) -> None:
        loss, inputs = self.last
        for cb in self.methods:
            Runner.of(cb).step("after_batch", self.host, loss, inputs)
        if step_end:
            self.stepped = False

    def save(self, folder: str) -> None:
        if self.host.is_global_zero and os.path.isdir(folder):
            torch.save({cb.state_key: cb.state_dict() for cb in self.methods}, os.path.join(folder, STATE_FILE))


def _fsdp2_saved(folder: str, model: nn.Module) -> set[int]:
    """``id`` of every parameter of ``model`` with optimizer state in the Trainer's FSDP2 checkpoint
    ``folder`` (accelerate's ``optimizer.bin``, a full state dict by name, or ``optimizer_0/``, a
    distributed checkpoint whose metadata names every entry)."""
    from lalr_lightning.callbacks.lightning_host import OptimizerResume

    named = [(OptimizerResume._bare(n), p) for n, p in model.named_parameters()]
    one, dcp = os.path.join(folder, "optimizer.bin"), os.path.join(folder, "optimizer_0")
    if os.path.isdir(dcp):
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(dcp).read_metadata().state_dict_metadata
        states = [k.split(".state.", 1)[1] for k in keys if ".state." in k]
        return {id(p) for n, p in named if any(k.startswith(n + ".") for k in states)}
    if not os.path.isfile(one):
        return set()
    state = torch.load(one, map_location="cpu", mmap=True, weights_only=True).get("state", {})
    return {id(p) for n, p in named if n in state}


def _say_unclaimed(states: dict, methods: list[LayerwiseCallback]) -> None:
    """A warning for the states in the checkpoint that no callback of this fit takes (as under
    Lightning: HTSRPruning's masks no longer enforced, another method's state left unused)."""
    from lalr_lightning.callbacks.host import warn
    from lalr_lightning.core.runtime.checks import orphaned_masks, unclaimed_states

    claimed = {cb.state_key for cb in methods}
    checkpoint = {"callbacks": states}
    for msg in (orphaned_masks(checkpoint, claimed),
                unclaimed_states(checkpoint, claimed, [cb.state_key for cb in methods if cb.state_key not in states])):
        if msg is not None:
            warn(msg, category=UserWarning)


def _event(fn: Callable) -> Callable:
    """A TrainerCallback hook that does nothing until the adapter is bound to its Trainer."""

    @functools.wraps(fn)
    def hook(self: LayerwiseTrainerCallback, args, state, control, **kwargs):
        if self.session is not None:
            fn(self, args, state, control, **kwargs)
        return None

    return hook


def _callback_base() -> type:
    return _transformers().TrainerCallback


class LayerwiseTrainerCallback(_callback_base()):
    """A ``transformers.TrainerCallback`` driving one method of the package (:func:`trainer_callback`)."""

    def __init__(self, method: LayerwiseCallback):
        self.method = method
        self.session: _Session | None = None

    def __repr__(self) -> str:
        return f"trainer_callback({type(self.method).__name__})"

    #: Lightning names each callback by it before its hooks (so the refusal in :meth:`setup` is reached)
    state_key = property(lambda self: repr(self))

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Lightning's first hook on a callback: this adapter is the Trainer's, not Lightning's
        who = type(self.method).__name__
        raise TypeError(f"trainer_callback({who}) is for transformers.Trainer; pass {who} itself to Lightning's "
                        f"Trainer: pl.Trainer(..., callbacks=[{who}(...)])")

    def on_exception(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's hook as the error of :meth:`setup` leaves the fit: nothing to undo."""

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _find_trainer()
        if trainer is None:  # pragma: no cover - Trainer.__init__ is always the caller
            raise RuntimeError("trainer_callback(...) found no transformers.Trainer calling on_init_end")
        self._bind(trainer)

    def _bind(self, trainer: Any) -> None:
        if self.session is not None and self.session.trainer is trainer:
            return
        session = _Session.of(trainer)
        who = type(self.method).__name__
        if any(m is self.method for m in session.methods):  # every event would reach it twice
            raise ValueError(f"{who} is passed to the Trainer twice (two trainer_callback(...) of one callback); "
                             "pass each callback once")
        same = [m for m in session.methods if m.state_key == self.method.state_key]
        if same:  # as Lightning refuses them: one state would overwrite the other, one control the other's
            raise ValueError(f"two {who} with the same settings share the state key {self.method.state_key!r}; "
                             f"pass name='...' to each ({who}(..., name='a'), {who}(..., name='b')) to tell them apart")
        self.session = session
        session.methods.append(self.method)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.session is None or not self.session.begun:
            raise RuntimeError(f"trainer_callback({type(self.method).__name__}) joined the Trainer after it was "
                               "built (add_callback), too late to freeze before the optimizer exists; pass it as "
                               "Trainer(..., callbacks=[trainer_callback(...)])")
        runner = Runner.of(self.method)
        if not runner.wrapped:
            runner.wrapped_now(self.session.host, final=True)
        runner.train_start(self.session.host)

    @_event
    def on_epoch_begin(self, args, state, control, **kwargs):
        host = self.session.host
        if self.session.methods[0] is self.method:
            host.epoch = int(math.floor(state.epoch or 0))
        Runner.of(self.method).epoch_start(host)

    @_event
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.before_step()

    @_event
    def on_substep_end(self, args, state, control, **kwargs):
        if self.session.methods[-1] is self.method:
            self.session.after_batch(step_end=False)

    @_event
    def on_step_end(self, args, state, control, **kwargs):
        if self.session.methods[-1] is self.method:
            self.session.after_batch(step_end=True)

    @_event
    def on_epoch_end(self, args, state, control, **kwargs):
        Runner.of(self.method).epoch_end(self.session.host)

    @_event
    def on_save(self, args, state, control, **kwargs):
        if self.session.methods[-1] is self.method:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            self.session.save(os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    @_event
    def on_train_end(self, args, state, control, **kwargs):
        host = self.session.host
        Runner.of(self.method).end(host)
        Runner.of(self.method).teardown(host)
        self.session.begun = False


def trainer_callback(callback: LayerwiseCallback | Iterable[LayerwiseCallback]) -> Any:
    """A ``transformers.TrainerCallback`` running ``callback`` (any callback of the package,
    constructed exactly as for Lightning) on the Trainer it is passed to; a list gives a list.
    Pass it in ``Trainer(..., callbacks=[...])`` (module docstring: where each event happens)."""
    if isinstance(callback, LayerwiseCallback):
        return _adapter_class(callback)(callback)
    if isinstance(callback, (list, tuple)):
        return [trainer_callback(c) for c in callback]
    if isinstance(callback, type) and issubclass(callback, LayerwiseCallback):
        raise TypeError(f"trainer_callback takes a callback, got the class {callback.__name__}; construct it: "
                        f"trainer_callback({callback.__name__}(...))")
    raise TypeError(f"trainer_callback takes a callback of lalr_lightning (or a list of them), got "
                    f"{type(callback).__name__}")


def _adapter_class(method: LayerwiseCallback) -> type:
    """A class of its own for each adapter: ``Trainer.add_callback`` warns "You are adding a ...
    but there is already one" for a second callback of one class, which two wrapped methods are
    not (``callbacks=trainer_callback([a, b])``). Named after the method, as the Trainer's list of
    callbacks shows it; pickled as the call that made it."""
    return type(f"LayerwiseTrainerCallback[{type(method).__name__}]", (LayerwiseTrainerCallback,),
                {"__module__": __name__, "__reduce__": lambda self: (trainer_callback, (self.method,))})
