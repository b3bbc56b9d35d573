"""The distributed part of the decision cycle, the same for every callback:

* which strategies a callback can follow (:func:`check_strategy`);
* measuring the weights with the work shared out among the ranks, each gathering the whole
  weights of its own share only where the strategy shards them (:func:`measure_shards`);
* deciding on rank zero and broadcasting, so ranks cannot drift apart (:func:`decide_on_zero`);
* handing a ``ddp_spawn`` worker's final state back to the callback object in the main process
  (:class:`SpawnHandoff`);
* where the strategy shards the weights (FSDP1's ``FSDPStrategy``, FSDP2's
  ``ModelParallelStrategy``): the root to gather through (:func:`model_root`), how to cut tensors
  kept next to the weights like them (:func:`shard_layout`), and following the parameters FSDP2
  puts in place of the old ones after ``setup`` (:func:`rebind`), and resuming a selection under
  FSDP2 (:class:`OptimizerResume`), and the whole model on rank zero for measurements that run
  the whole model through ``torch.func`` (:class:`WholeCopy`).

:class:`~lalr_lightning.callbacks.base.LayerwiseCallback` calls these at the steps of its cycle;
the pure parts (who measures what, gathering one unit's whole weights) are
:mod:`lalr_lightning.core.shards`.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lalr_lightning.core.control import LayerControl
from lalr_lightning.core.decision import Decision
from lalr_lightning.core.layers import Layer, clean_name
from lalr_lightning.core.shards import ShardLayout, assign_shares, gather_objects, materialize, skeleton, whole_weights

__all__ = ["OptimizerResume", "SpawnHandoff", "WholeCopy", "backward_discarded", "check_strategy", "decide_on_zero", "loss_through_root",
           "measure_shards", "model_root", "parameter_names", "rebind", "replaces_parameters", "shard_layout", "sharded"]


def sharded(trainer: pl.Trainer) -> bool:
    """Whether the strategy holds the parameters in shards across the ranks: Lightning's
    ``FSDPStrategy`` (FSDP1) or ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in
    ``configure_model``)."""
    return isinstance(getattr(trainer, "strategy", None), (FSDPStrategy, ModelParallelStrategy))


def check_strategy(trainer: pl.Trainer, who: str, *, refusal: str | None = None) -> None:
    """Raise a one-line error for the strategies whose parameter handling the callback cannot
    follow: DeepSpeed; FSDP1 without ``use_orig_params`` or with hybrid sharding; and any sharded
    strategy where the callback gives a ``refusal`` (why, and what to use instead)."""
    strategy = trainer.strategy
    name = type(strategy).__name__
    if "DeepSpeed" in name:
        raise RuntimeError(
            f"{who} works on the optimizer's parameter groups and whole parameters, which DeepSpeed "
            "owns and partitions; use strategy='ddp' or 'fsdp'"
        )
    if not sharded(trainer):
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


def replaces_parameters(trainer: pl.Trainer) -> bool:
    """Whether the model's parameters are replaced after the callbacks' ``setup``: FSDP2's
    ``fully_shard`` (in ``configure_model``, under ``ModelParallelStrategy``) puts a new, sharded
    parameter in place of every one it shards."""
    return isinstance(getattr(trainer, "strategy", None), ModelParallelStrategy)


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of every parameter of ``module`` (shared ones under each name)."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def rebind(obj: Any, names: Mapping[int, str], module: torch.nn.Module) -> Any:
    """``obj`` with every parameter named in ``names`` (``parameter_names`` taken before the
    strategy replaced them) swapped for the parameter of that name in ``module`` now, in place
    in dicts, lists and :class:`Layer` parameter tables (where the callbacks keep parameters)."""
    live = dict(module.named_parameters(remove_duplicate=False))

    def swap(x: Any) -> Any:
        if isinstance(x, torch.nn.Parameter):
            name = names.get(id(x))
            return live.get(name, x) if name is not None else x
        if isinstance(x, Layer):
            swap(x.params)
        elif isinstance(x, dict):
            for k in list(x):
                x[k] = swap(x[k])
        elif isinstance(x, list):
            x[:] = [swap(v) for v in x]
        return x

    return swap(obj)


def model_root(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module:
    """The outermost module of the model: under FSDP1 the root unit, which wraps the
    LightningModule from outside (units found inside ``pl_module`` miss it)."""
    if sharded(trainer) and isinstance(getattr(trainer.strategy, "model", None), torch.nn.Module):
        return trainer.strategy.model
    return pl_module


def loss_through_root(trainer: pl.Trainer, pl_module: pl.LightningModule, fn: Callable[[Any], torch.Tensor],
                      batch: Any) -> torch.Tensor:
    """``fn(batch)`` (a loss computed with ``pl_module``) run inside the forward of the strategy's
    root module where that wraps ``pl_module``, ``batch`` passed through it, as Lightning runs
    ``training_step``: FSDP1's root unit gathers its own parameters in its forward, prepares the
    backward and casts the batch's floating tensors to its mixed precision's parameter dtype.
    Elsewhere ``fn(batch)``. Both under the precision plugin's forward context (autocast)."""
    root = model_root(trainer, pl_module)
    if root is pl_module:
        with trainer.precision_plugin.forward_context():
            return fn(batch)
    had = pl_module.__dict__.get("forward")  # an instance attribute (None: the class's forward)

    def put_back() -> None:
        if had is None:
            pl_module.__dict__.pop("forward", None)
        else:
            pl_module.__dict__["forward"] = had

    def forward(cast: Any, *_args, **_kwargs):
        put_back()  # the loss inside calls the module's own forward
        return fn(cast)

    pl_module.__dict__["forward"] = forward
    try:
        with trainer.precision_plugin.forward_context():
            return root(batch)
    finally:
        put_back()


def backward_discarded(pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
    """A backward whose gradients are only observed (hooks): the strategy reduces them as in a
    step (FSDP's reduce-scatter runs in its backward hooks), and the result is dropped."""
    loss.backward()
    for p in pl_module.parameters():
        p.grad = None


def shard_layout(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ShardLayout:
    """How the strategy cuts the parameters, to cut masks and anchors the same way."""
    return ShardLayout(model_root(trainer, pl_module))


def measure_shards(trainer: pl.Trainer, pl_module: pl.LightningModule, units: list[list[Layer]],
                   fn: Callable[[list[Layer]], dict], sizes: Mapping[str, int] | None,
                   weight_of: Callable[[Layer], torch.Tensor]) -> dict:
    """``fn(layers) -> {name: value}`` over every unit of layers, the units shared out among the
    ranks (balanced by ``sizes``, the weights' sizes while they were whole; under FSDP each rank
    gathers the whole weights of its own share only, through ``weight_of``) and the results
    all-gathered: the same dict on every rank. An error on any rank is raised on all of them."""
    everything = [layer for unit in units for layer in unit]
    world = trainer.world_size
    if world == 1 and not sharded(trainer):
        return fn(everything)
    sizes = sizes or {}
    owner = assign_shares([sum(sizes.get(la.name, 1) for la in unit) for unit in units], world)
    mine = {la.name for unit, o in zip(units, owner) if o == trainer.global_rank for la in unit}
    try:
        layers = whole_weights(model_root(trainer, pl_module), everything, mine, weight_of)
        part = ("ok", fn(layers) if layers else {})
    except Exception as err:  # noqa: BLE001 -- raised on every rank below
        part = ("error", err)
    merged: dict = {}
    for status, value in gather_objects(part):
        if status == "error":
            raise value
        merged.update(value)
    return {la.name: merged[la.name] for la in everything if la.name in merged}


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
    def saved(cls, path: str, pl_module: pl.LightningModule, n_optimizers: int) -> set[int]:
        """``id`` of every parameter of ``pl_module`` with optimizer state in the checkpoint at
        ``path`` (one file, or a distributed checkpoint's folder)."""
        named = [(cls._bare(n), p) for n, p in pl_module.named_parameters()]
        if Path(path).is_dir():  # a distributed checkpoint: its metadata lists every flattened key
            from torch.distributed.checkpoint import FileSystemReader

            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            states = [k.split(".state.", 1)[1] for k in keys if k.startswith("optimizer_") and ".state." in k]
            return {id(p) for n, p in named if any(k.startswith(n + ".") for k in states)}
        ckpt = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
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

        def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
            cls.forget(trainer)
            saved = cls.saved(checkpoint_path, strategy.lightning_module, len(strategy.optimizers))
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


class WholeCopy:
    """The LightningModule whole on rank zero, for the measurements that run the whole model
    through ``torch.func`` or run blocks alone (the NTK and the linearization gap, ``lambda_o``,
    the L-MSA metric) and for pruning that calibrates block by block and prunes as it goes (Wanda,
    SparseGPT, N:M during training). FSDP's own forward cannot host them: FSDP1 allows no forward
    inside ``summon_full_params``, and FSDP2's forward hooks fail on parameters ``torch.func``
    substitutes (torch 2.14).

    Made in ``setup``, before the strategy wraps the model, every rank keeps a skeleton of it
    (:func:`~lalr_lightning.core.shards.skeleton`: no memory for the weights). A measurement
    (:meth:`run`) gathers the whole state dict to rank zero's CPU (a collective: every rank calls
    it), fills a copy of the skeleton on the module's device, measures there and drops the copy,
    and broadcasts the result: rank zero holds the whole model for the length of a measurement,
    as ``summon_full_params`` would, and the other ranks wait."""

    def __init__(self, pl_module: pl.LightningModule, who: str):
        try:
            self.skeleton = skeleton(pl_module)
        except Exception as err:  # noqa: BLE001 -- anything deepcopy refuses, said in one line
            raise RuntimeError(
                f"{who} under FSDP measures on a whole copy of {type(pl_module).__name__}, made with copy.deepcopy "
                f"before the model is sharded, and copying it failed ({type(err).__name__}: {err}); keep objects that "
                "cannot be copied (open files, locks, clients) off the module, or use strategy='ddp'") from err

    @staticmethod
    def state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """The whole state dict on rank zero's CPU, ``{}`` on the other ranks (collective)."""
        model = trainer.strategy.model
        if isinstance(trainer.strategy, ModelParallelStrategy):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # no "offload" from a CPU compute device (CPUFSDPStrategy): there it moves nothing, and
        # torch 2.13 cloned freed memory after it (SIGSEGV, strategies.py)
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=not on_cpu, rank0_only=True)):
            return model.state_dict()

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule, fn: Callable[[pl.LightningModule], Any],
            frozen: bool = False) -> Any:
        """``fn(whole copy of pl_module)`` computed on rank zero and broadcast: the same result on
        every rank; an error on rank zero is raised on every rank. ``frozen``: the copy's
        parameters do not require grad."""
        state = self.state(trainer)
        result: tuple[str, Any] | None = None
        if trainer.is_global_zero:
            try:
                whole = materialize(self.skeleton, state, pl_module.device, frozen)
                del state
                # every module in the mode the live one is in (a frozen block's norm layers in eval)
                modes = {clean_name(n): m.training for n, m in pl_module.named_modules()}
                for name, module in whole.named_modules():
                    module.training = modes.get(clean_name(name), pl_module.training)
                result = ("ok", fn(whole))
            except Exception as err:  # noqa: BLE001 -- raised on every rank below
                result = ("error", err)
        status, payload = trainer.strategy.broadcast(result, src=0)
        if status == "error":
            raise payload
        return payload


def decide_on_zero(trainer: pl.Trainer, decide: Callable[[Any], Decision], measured: Any) -> Decision:
    """``decide(measured)`` on rank zero, broadcast: the same decision on every rank. An error on
    rank zero is raised on every rank, so none waits for a broadcast that never comes."""
    result: tuple[str, Any] | None = None
    if trainer.is_global_zero:
        try:
            result = ("ok", decide(measured))
        except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
            result = ("error", err)
    status, payload = trainer.strategy.broadcast(result, src=0)
    if status == "error":
        raise payload
    return payload


class SpawnHandoff:
    """A callback whose ``readable`` attributes come back from a ``ddp_spawn`` worker: pickling it
    for the worker gives it a file to leave its final state in (:meth:`_hand_over`, rank zero, at
    the end of the fit), and the object in the main process reads that file on the first access
    to one of those attributes."""

    #: attributes a user reads after ``fit``; brought back to the main process after ddp_spawn
    readable: ClassVar[tuple[str, ...]] = ()

    _handoff: str | None = None
    _handoff_pending = False

    def __getstate__(self) -> dict:
        # Pickled to be sent to spawned worker processes (ddp_spawn): give the worker a file to
        # leave its final state in, and remember here to read it back on first access.
        if self._handoff is None:
            self._handoff = os.path.join(tempfile.gettempdir(), f"lalr_lightning_{uuid.uuid4().hex}.pt")
        self._handoff_pending = True
        state = dict(self.__dict__)
        state["_handoff_pending"] = False
        state["_handoff_pid"] = os.getpid()
        return state

    def _hand_over(self, trainer: pl.Trainer) -> None:
        """In a spawned worker (rank zero): leave the readable state for the main process."""
        pid = self.__dict__.get("_handoff_pid")
        if self._handoff is None or pid is None or pid == os.getpid() or not trainer.is_global_zero:
            return
        torch.save({k: getattr(self, k) for k in self.readable if hasattr(self, k)}, self._handoff)

    def __getattribute__(self, attr: str):
        d = object.__getattribute__(self, "__dict__")
        if d.get("_handoff_pending") and attr in type(self).readable:
            path = d.get("_handoff")
            if path and os.path.exists(path):
                d["_handoff_pending"] = False
                state = torch.load(path, weights_only=False)  # written by this callback's own worker
                os.remove(path)
                d.update(state)
        return object.__getattribute__(self, attr)
