"""Lightning's ``Trainer`` as a :class:`~lalr_lightning.callbacks.host.Host`, and the Lightning hooks
that drive the timeline owner's events (the one module of the method layer that knows Lightning).

* :class:`LightningHost` answers a method's questions from the trainer and the LightningModule;
* :func:`check_strategy` refuses the strategies whose parameter handling no method can follow;
* :class:`OptimizerResume` resumes a selection under FSDP2, whose ``load_checkpoint`` loads the
  optimizer state before any callback state is back;
* :class:`LightningHooks` is the ``Callback`` half of every method: each hook Lightning calls is
  one event of :class:`~lalr_lightning.callbacks.base.LayerwiseCallback`'s timeline, and the
  restore order of each strategy is read here (``restores_after_wrap``), nowhere else.
"""

from __future__ import annotations

import contextlib
import io
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lalr_lightning.callbacks.host import Host

__all__ = ["LightningHooks", "LightningHost", "OptimizerResume", "SpawnHandoff", "check_strategy", "sharding_of"]


def sharding_of(trainer: Any) -> str:
    """The host's ``sharding`` for a Lightning strategy (``none`` for anything not a trainer)."""
    strategy = getattr(trainer, "strategy", None)
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp1"
    # replicated across processes (DDP; any other multi-process strategy, whose options are unknown)
    return "none" if strategy is None or isinstance(strategy, SingleDeviceStrategy) else "ddp"


class LightningHost(Host):
    """The host of a Lightning fit: every answer from the trainer and the LightningModule."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule):
        self.trainer, self.module = trainer, module
        self.sharding = sharding_of(trainer)

    # ---------------------------------------------------------------- counters, world, model

    current_epoch = property(lambda self: self.trainer.current_epoch)
    global_step = property(lambda self: self.trainer.global_step)
    max_epochs = property(lambda self: self.trainer.max_epochs)
    global_rank = property(lambda self: self.trainer.global_rank)
    world_size = property(lambda self: self.trainer.world_size)
    is_global_zero = property(lambda self: self.trainer.is_global_zero)
    optimizers = property(lambda self: self.trainer.optimizers)
    loggers = property(lambda self: self.trainer.loggers)
    # the step LearningRateMonitor uses, so our curves line up with its
    log_step = property(lambda self: self.trainer.fit_loop.epoch_loop._batches_that_stepped)

    @property
    def root(self) -> torch.nn.Module:
        model = getattr(self.trainer.strategy, "model", None)
        return model if isinstance(model, torch.nn.Module) else self.module

    @property
    def ddp_options(self) -> dict | None:
        strategy = self.trainer.strategy
        return strategy._ddp_kwargs if isinstance(strategy, DDPStrategy) else None

    @property
    def restores_after_wrap(self) -> bool:
        """Whether a checkpoint's model and callback state come after ``on_fit_start`` (FSDP; which
        checkpoint, if any, no hook learns before it loads)."""
        return self.trainer.strategy.restore_checkpoint_after_setup

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.trainer.strategy.broadcast(obj, src=src)

    def gather_objects(self, obj: Any) -> list[Any]:
        from lalr_lightning.core.runtime.shards import gather_objects

        return gather_objects(obj)

    # ---------------------------------------------------------------- batches

    device = property(lambda self: self.trainer.strategy.root_device)
    accumulate = property(lambda self: self.trainer.accumulate_grad_batches)
    grad_scaler = property(lambda self: getattr(self.trainer.precision_plugin, "scaler", None))

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor, reduce_op="mean")

    def to_device(self, batch: Any, precision: bool = True) -> Any:
        batch = self.trainer.strategy.batch_to_device(batch)
        # bf16-true: a bfloat16 conv refuses a float32 input
        return self.trainer.precision_plugin.convert_input(batch) if precision else batch

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.trainer.precision_plugin.forward_context()

    def batches(self, as_given: bool = False) -> Any:
        source = self.trainer.fit_loop._data_source
        if as_given:
            return source.dataloader() if source.instance is not None and source.is_defined() else None
        loader = self.trainer.train_dataloader
        # before the fit loop set it up (setup): the data source's own
        return source.dataloader() if loader is None else loader

    # ---------------------------------------------------------------- logs

    def log(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if not metrics or not self.trainer.loggers:
            return
        metrics = {**metrics}
        metrics.setdefault("epoch", float(self.trainer.current_epoch))  # as Lightning's own rows carry it
        for logger in self.trainer.loggers:
            logger.log_metrics(metrics, step=self.log_step if step is None else step)

    def should_log(self) -> bool:
        return bool(self.trainer.loggers) and self.trainer._logger_connector.should_update_logs

    def publish(self, method: Any, event: str, decision: Any = None) -> None:
        if self.trainer.loggers and self.trainer.is_global_zero:
            from lalr_lightning import dashboards

            dashboards.publish(self.trainer, method, event, decision)

    def info(self, message: str) -> None:
        """Through Lightning's rank-zero info, the way its own callbacks show their lines (the model
        summary, "GPU available"): seen on a plain Trainer, where the package's logger is not."""
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(message)

    def stop_check(self) -> Callable[[], None]:
        """Raises Lightning's ``SIGTERMException`` once the trainer received SIGTERM (its handler only
        sets a flag, read between batches); Ctrl-C needs nothing."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        def check() -> None:
            if getattr(self.trainer, "received_sigterm", False):
                raise SIGTERMException()

        return check


def check_strategy(host: LightningHost, who: str, *, refusal: str | None = None) -> None:
    """Raise a one-line error for the strategies whose parameter handling the callback cannot
    follow: DeepSpeed; FSDP1 without ``use_orig_params`` or with hybrid sharding; and any sharded
    strategy where the callback gives a ``refusal`` (why, and what to use instead)."""
    strategy = host.trainer.strategy
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        # Lightning's DeepSpeedStrategy refuses a CPU, so its checks wait for the GPU lane
        # (tests/gpu/test_deepspeed_gpu.py); the Trainer's DeepSpeed runs the same engine, tested
        raise RuntimeError(
            f"{who} under Lightning's DeepSpeedStrategy is untested until the GPU lane runs it; run DeepSpeed "
            "ZeRO through Hugging Face's Trainer with lalr_lightning.hf.trainer_callback (docs/sharded.md), or "
            "use strategy='ddp' or 'fsdp'"
        )
    if not host.sharded:
        return
    if refusal:
        raise RuntimeError(f"{who} under {name}: {refusal}")
    if isinstance(strategy, FSDPStrategy):
        if strategy.kwargs.get("use_orig_params") is False:
            raise RuntimeError(f"{who} follows the model's own parameters, which FSDPStrategy(use_orig_params=False) "
                               "hides inside flat ones; drop use_orig_params=False (Lightning's default is True)")
        if "HYBRID" in str(strategy.sharding_strategy):
            raise RuntimeError(f"{who} cuts its own tensors like the weights across all ranks, which hybrid sharding "
                               f"({strategy.sharding_strategy}) does not; use sharding_strategy='FULL_SHARD', or "
                               "ModelParallelStrategy with fully_shard on a 2-D mesh")


class OptimizerResume:
    """Resuming a selection under FSDP2 (``ModelParallelStrategy``), whose ``load_checkpoint``
    loads the optimizer state through torch's ``set_optimizer_state_dict`` before any callback's
    state is back.

    That loader builds its template from the parameters that require grad *when it loads* (a
    zero-learning-rate step) and places the saved state on that template: a saved tensor whose
    parameter is frozen at that moment comes back whole instead of sharded (the next step on it
    fails), a parameter that requires grad with nothing saved keeps the template's made-up state
    (Adam's step count 1), and with no parameter requiring grad it stops ("Expected device to be
    set"). A selection's flags at that moment are the fresh run's, not the saved run's.

    So for the load, and only for it, exactly the parameters with saved state require grad and the
    optimizers step bare (:meth:`LayerControl.grad_flags_of`: no owner's freezing drops the
    template's gradients): the strategy's ``load_checkpoint`` is wrapped at ``on_fit_start``
    (:meth:`prepare`; Lightning gives the checkpoint's path to no hook before it loads), and every
    flag is put back when it returns, before the callbacks restore their own selections."""

    @staticmethod
    def _bare(name: str) -> str:
        # torch names optimizer state by the parameter's name without activation-checkpoint or
        # torch.compile wrappers
        return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")

    @classmethod
    def saved(cls, path: str, pl_module: pl.LightningModule, n_optimizers: int, *,
              weights_only: bool = True) -> set[int]:
        """``id`` of every parameter of ``pl_module`` with optimizer state in the checkpoint at
        ``path`` (one file, or a distributed checkpoint's folder).

        Read before the strategy's own load, so with the same safety: a file holding Python
        objects besides tensors is refused in one line unless the fit opted in
        (``Trainer.fit(..., weights_only=False)``, which is then passed here)."""
        named = [(cls._bare(n), p) for n, p in pl_module.named_parameters()]
        if Path(path).is_dir():  # a distributed checkpoint: its metadata lists every flattened key
            from torch.distributed.checkpoint import FileSystemReader

            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            states = [k.split(".state.", 1)[1] for k in keys if k.startswith("optimizer_") and ".state." in k]
            return {id(p) for n, p in named if any(k.startswith(n + ".") for k in states)}
        from lalr_lightning.models.base import load_checkpoint_file

        ckpt = load_checkpoint_file(path, mmap=True, weights_only=weights_only, unsafe_hint=(
            "pass weights_only=False to Trainer.fit"))
        keys = [k for state in ckpt.get("optimizer_states", [])[:n_optimizers] for k in state.get("state", {})]
        # a full checkpoint names the state by parameter, or numbers it in ``parameters()`` order
        by_index = [p for _, p in named]
        return {id(p) for n, p in named if n in keys} | {id(by_index[k]) for k in keys
                                                         if isinstance(k, int) and k < len(by_index)}

    @classmethod
    def prepare(cls, trainer: pl.Trainer) -> None:
        """Wrap the strategy's ``load_checkpoint`` once (every callback of the fit calls this)."""
        strategy = trainer.strategy
        if not isinstance(strategy, ModelParallelStrategy) or "load_checkpoint" in vars(strategy):
            return
        load = type(strategy).load_checkpoint
        from lalr_lightning.core.runtime.control import LayerControl

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            cls.forget(trainer)
            # Trainer.fit(weights_only=...): None is torch's default (True), False the user's opt-in
            weights_only = kwargs.get("weights_only", args[0] if args else None)
            saved = cls.saved(checkpoint_path, strategy.lightning_module, len(strategy.optimizers),
                              weights_only=weights_only is not False)
            if not saved and not Path(checkpoint_path).is_dir():
                # no state saved yet (nothing had stepped): a one-file load stops without a template,
                # so every parameter gets one, and that made-up state is dropped after
                with LayerControl.grad_flags_of(strategy.optimizers, lambda p: True, made_up=lambda p: True):
                    return load(strategy, checkpoint_path, *args, **kwargs)
            with LayerControl.grad_flags_of(strategy.optimizers, lambda p: id(p) in saved):
                return load(strategy, checkpoint_path, *args, **kwargs)

        strategy.load_checkpoint = load_checkpoint

    @staticmethod
    def forget(trainer: pl.Trainer) -> None:
        """Undo :meth:`prepare` (the load came, or the fit ends)."""
        vars(trainer.strategy).pop("load_checkpoint", None)


class _HFEvent:
    """One of the events ``transformers.Trainer`` calls on every callback it holds, on a Lightning
    callback: reading it is an ``AttributeError`` naming the wrapper (``hasattr`` stays False). The
    two that reach a callback first are enough: ``on_init_end`` (a callback given to the
    ``Trainer``) and ``on_train_begin`` (one added later). A descriptor, not ``__getattr__``: a
    class with ``__getattr__`` pays on every attribute read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        who = (owner or type(obj)).__name__
        raise AttributeError(f"{who} is a Lightning callback; on transformers.Trainer (or TRL's trainers) wrap it: "
                             f"Trainer(..., callbacks=[trainer_callback(cb)]) with "
                             "`from lalr_lightning.hf import trainer_callback`")


class LightningHooks(Callback):
    """Lightning's hooks, each one event of the method's runner
    (:class:`~lalr_lightning.callbacks.runner.Runner`: ``begin``, ``wrapped_now``, ``restore``,
    ``train_start``, ``epoch_start``, ``batch_start``, ...). Mixed into the base of every method; a
    method overrides none of these. The restore order of each strategy is read here
    (``restores_after_wrap``), nowhere else."""

    on_init_end = _HFEvent()
    on_train_begin = _HFEvent()

    def _host(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LightningHost:
        host = self.__dict__.get("_lightning_host")
        if host is None or host.trainer is not trainer or host.module is not pl_module:
            host = self.__dict__["_lightning_host"] = LightningHost(trainer, pl_module)
        return host

    def _run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[Any, LightningHost]:
        """(this method's runner, the host of this fit)."""
        runner = self.__dict__.get("_runner")
        if runner is None or runner.method is not self:
            # the runner's module loads on the first hook, not when a method's module is read
            from lalr_lightning.callbacks.runner import Runner

            runner = Runner.of(self)
        return runner, self._host(trainer, pl_module)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            runner, host = self._run(trainer, pl_module)
            check_strategy(host, type(self).__name__, refusal=self.traits.fsdp_refusal)
            runner.begin(host)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        OptimizerResume.prepare(trainer)  # FSDP2 loads the optimizer state right after this
        runner, host = self._run(trainer, pl_module)
        runner.wrapped_now(host, final=not host.restores_after_wrap)

    def load_state_dict(self, state_dict: dict) -> None:
        from lalr_lightning.callbacks.runner import Runner

        Runner.of(self).restore(state_dict)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        from lalr_lightning.callbacks import keys

        keys.adopt(self, trainer, checkpoint)  # an entry written under an earlier key
        from lightning.pytorch.utilities import rank_zero_warn

        from lalr_lightning.core.runtime.checks import orphaned_masks, unclaimed_states

        ours = [c for c in trainer.callbacks if isinstance(c, LightningHooks)]
        for cb in ours:  # every entry an instance will take, before saying which none takes
            keys.adopt(cb, trainer, checkpoint)
        claimed = {c.state_key for c in trainer.callbacks}
        states = checkpoint.get("callbacks") or {}
        for msg in (orphaned_masks(checkpoint, claimed),  # masks no callback enforces
                    unclaimed_states(checkpoint, claimed, [c.state_key for c in ours if c.state_key not in states])):
            if msg is not None:
                rank_zero_warn(msg, category=UserWarning)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.train_start(host)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.epoch_start(host)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.batch_start(host, batch)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.after_backward(host)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.before_step(host, optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.batch_end(host, outputs, batch)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # an optimizer step that raised: its groups back before OnExceptionCheckpoint saves them
        runner, host = self._run(trainer, pl_module)
        runner.abandon_steps(host)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.epoch_end(host)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.end(host)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        runner, host = self._run(trainer, pl_module)
        runner.teardown(host)
        OptimizerResume.forget(trainer)
        self.__dict__.pop("_lightning_host", None)


#: the key that marks a pandas DataFrame carried as plain data (``_loadable`` / ``_unloaded``)
_FRAME = "__lalr_lightning_dataframe__"


def _loadable(value: Any) -> Any:
    """``value`` as ``torch.load(weights_only=True)`` reads it back: numpy scalars as Python
    numbers, numpy arrays as tensors, a pandas DataFrame (LALR's metric table) as its plain
    ``tight`` dict and dtypes, containers rebuilt (the main process reads the handed-back bytes
    that way, so a worker's value must not make them unreadable; :func:`_unloaded` undoes it)."""
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if type(value).__name__ == "DataFrame" and hasattr(value, "to_dict"):
        return {_FRAME: _loadable(value.to_dict(orient="tight")), "dtypes": [str(d) for d in value.dtypes]}
    if isinstance(value, Mapping):
        return {k: _loadable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_loadable(v) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    return value


def _unloaded(value: Any) -> Any:
    """The DataFrames :func:`_loadable` carried as plain data, rebuilt (with their dtypes)."""
    if isinstance(value, Mapping):
        if _FRAME in value:
            import pandas as pd

            frame = pd.DataFrame.from_dict(value[_FRAME], orient="tight")
            return frame.astype(dict(zip(frame.columns, value["dtypes"])))
        return {k: _unloaded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out = [_unloaded(v) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    return value


class SpawnHandoff:
    """A callback whose ``traits.readable`` attributes come back from a ``ddp_spawn`` worker with
    Lightning's own results of that worker: rank zero's worker adds them to the launcher's
    ``extra`` results (``get_extra_results``, after the fit), and the main process puts them back
    on the callback, once, where the launcher recovers those results
    (``update_main_process_results``), before ``fit`` returns (:func:`_carry_readable_back`).
    Nothing happens on an attribute read."""

    def __init__(self) -> None:
        super().__init__()
        # which callback of the worker's trainer is this one (the worker's list may be reordered)
        self._handback_token = uuid.uuid4().hex

    def _handback_state(self) -> dict:
        """In the worker: the readable state the main process's callback takes back."""
        return {k: _loadable(getattr(self, k)) for k in self.traits.readable if hasattr(self, k)}

    def _take_back(self, state: Mapping[str, Any]) -> None:
        """In the main process: the worker's readable state, in place of this callback's own."""
        self.__dict__.update(_unloaded(dict(state)))


#: the key of the callbacks' readable state in the launcher's ``extra`` results
_HANDBACK = "lalr_lightning_readable_bytes"


def _carry_readable_back() -> None:
    """Make Lightning's spawn launcher carry every :class:`SpawnHandoff` callback's readable state
    back with the worker's results (once per process; the launcher's two documented extension
    points, each calling Lightning's own first)."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as launcher

    if getattr(launcher, "_lalr_handback", False):
        return
    collect, recover = launcher.get_extra_results, launcher.update_main_process_results

    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = collect(self, trainer)
        states = {cb._handback_token: cb._handback_state() for cb in trainer.callbacks
                  if isinstance(cb, SpawnHandoff) and hasattr(cb, "_handback_token")}
        if states:
            buffer = io.BytesIO()  # as bytes, as Lightning sends its metrics: no shared memory across the queue
            torch.save(states, buffer)
            extra[_HANDBACK] = buffer.getvalue()
        return extra

    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        recover(self, trainer, extra)
        if _HANDBACK not in extra:
            return
        # tensors and plain containers only (the readable attributes, numpy turned into them by
        # _loadable): read as every file is, so nothing in them runs
        states = torch.load(io.BytesIO(extra[_HANDBACK]), weights_only=True)
        for cb in trainer.callbacks:
            if isinstance(cb, SpawnHandoff) and getattr(cb, "_handback_token", None) in states:
                cb._take_back(states[cb._handback_token])

    launcher.get_extra_results, launcher.update_main_process_results = get_extra_results, update_main_process_results
    launcher._lalr_handback = True


_carry_readable_back()
