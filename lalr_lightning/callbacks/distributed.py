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
:mod:`lalr_lightning.core.runtime.shards`.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from lalr_lightning.callbacks.host import Host
from lalr_lightning.core.model.layers import Layer, clean_name
from lalr_lightning.core.runtime.decision import Decision
from lalr_lightning.core.runtime.shards import (
    ShardLayout,
    assign_shares,
    gather_objects,
    materialize,
    skeleton,
    whole_weights,
)

__all__ = ["SpawnHandoff", "WholeCopy", "backward_discarded", "decide_on_zero", "loss_through_root", "on_rank_zero",
           "measure_shards", "model_root", "replaces_parameters", "shard_layout", "sharded"]


def sharded(host: Host) -> bool:
    """Whether the strategy holds the parameters in shards across the ranks (FSDP1 or FSDP2)."""
    return getattr(host, "sharding", "none") in ("fsdp1", "fsdp2")  # None: no host (a bare configure)


def replaces_parameters(host: Host) -> bool:
    """Whether the model's parameters are replaced after the callbacks' ``setup``: FSDP2's
    ``fully_shard`` puts a new, sharded parameter in place of every one it shards."""
    return getattr(host, "sharding", "none") == "fsdp2"


def model_root(host: Host, module: nn.Module) -> torch.nn.Module:
    """The outermost module of the model: under FSDP1 the root unit, which wraps the
    LightningModule from outside (units found inside ``module`` miss it)."""
    return host.root if sharded(host) else module


def loss_through_root(host: Host, module: nn.Module, fn: Callable[[Any], torch.Tensor],
                      batch: Any) -> torch.Tensor:
    """``fn(batch)`` (a loss computed with ``module``) run inside the forward of the strategy's
    root module where that wraps ``module``, ``batch`` passed through it, as Lightning runs
    ``training_step``: FSDP1's root unit gathers its own parameters in its forward, prepares the
    backward and casts the batch's floating tensors to its mixed precision's parameter dtype.
    Elsewhere ``fn(batch)``. Both under the precision plugin's forward context (autocast)."""
    root = model_root(host, module)
    if root is module:
        with host.forward_context():
            return fn(batch)
    had = module.__dict__.get("forward")  # an instance attribute (None: the class's forward)

    def put_back() -> None:
        if had is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = had

    def forward(cast: Any, *_args, **_kwargs):
        put_back()  # the loss inside calls the module's own forward
        return fn(cast)

    module.__dict__["forward"] = forward
    try:
        with host.forward_context():
            return root(batch)
    finally:
        put_back()


def backward_discarded(module: nn.Module, loss: torch.Tensor) -> None:
    """A backward whose gradients are only observed (hooks): the strategy reduces them as in a
    step (FSDP's reduce-scatter runs in its backward hooks), and the result is dropped."""
    loss.backward()
    for p in module.parameters():
        p.grad = None


def shard_layout(host: Host, module: nn.Module) -> ShardLayout:
    """How the strategy cuts the parameters, to cut masks and anchors the same way."""
    return ShardLayout(model_root(host, module))


def measure_shards(host: Host, module: nn.Module, units: list[list[Layer]],
                   fn: Callable[[list[Layer]], dict], sizes: Mapping[str, int] | None,
                   weight_of: Callable[[Layer], torch.Tensor]) -> dict:
    """``fn(layers) -> {name: value}`` over every unit of layers, the units shared out among the
    ranks (balanced by ``sizes``, the weights' sizes while they were whole; under FSDP each rank
    gathers the whole weights of its own share only, through ``weight_of``) and the results
    all-gathered: the same dict on every rank. An error on any rank is raised on all of them."""
    everything = [layer for unit in units for layer in unit]
    world = host.world_size
    if world == 1 and not sharded(host):
        return fn(everything)
    sizes = sizes or {}
    owner = assign_shares([sum(sizes.get(la.name, 1) for la in unit) for unit in units], world)
    mine = {la.name for unit, o in zip(units, owner) if o == host.global_rank for la in unit}
    try:
        layers = whole_weights(model_root(host, module), everything, mine, weight_of)
        part = ("ok", fn(layers) if layers else {})
    except Exception as err:  # noqa: BLE001 -- raised on every rank below
        part = ("error", err)
    merged: dict = {}
    for status, value in gather_objects(part):
        if status == "error":
            raise value
        merged.update(value)
    return {la.name: merged[la.name] for la in everything if la.name in merged}


class WholeCopy:
    """The LightningModule whole on rank zero, for the measurements that run the whole model
    through ``torch.func`` or run blocks alone (the NTK and the linearization gap, ``lambda_o``,
    the L-MSA metric) and for pruning that calibrates block by block and prunes as it goes (Wanda,
    SparseGPT, N:M during training). FSDP's own forward cannot host them: FSDP1 allows no forward
    inside ``summon_full_params``, and FSDP2's forward hooks fail on parameters ``torch.func``
    substitutes (torch 2.14).

    Made in ``setup``, before the strategy wraps the model, every rank keeps a skeleton of it
    (:func:`~lalr_lightning.core.runtime.shards.skeleton`: no memory for the weights). A measurement
    (:meth:`run`) gathers the whole state dict to rank zero's CPU (a collective: every rank calls
    it), fills a copy of the skeleton on the module's device, measures there and drops the copy,
    and broadcasts the result: rank zero holds the whole model for the length of a measurement,
    as ``summon_full_params`` would, and the other ranks wait."""

    def __init__(self, module: nn.Module, who: str):
        try:
            self.skeleton = skeleton(module)
        except Exception as err:  # noqa: BLE001 -- anything deepcopy refuses, said in one line
            raise RuntimeError(
                f"{who} under FSDP measures on a whole copy of {type(module).__name__}, made with copy.deepcopy "
                f"before the model is sharded, and copying it failed ({type(err).__name__}: {err}); keep objects that "
                "cannot be copied (open files, locks, clients) off the module, or use strategy='ddp'") from err

    @staticmethod
    def state(host: Host) -> dict[str, torch.Tensor]:
        """The whole state dict on rank zero's CPU, ``{}`` on the other ranks (collective)."""
        model = host.root
        if host.sharding == "fsdp2":
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

    def run(self, host: Host, module: nn.Module, fn: Callable[[nn.Module], Any],
            frozen: bool = False) -> Any:
        """``fn(whole copy of module)`` computed on rank zero and broadcast: the same result on
        every rank; an error on rank zero is raised on every rank. ``frozen``: the copy's
        parameters do not require grad."""
        state = self.state(host)

        def on_zero() -> Any:
            whole = materialize(self.skeleton, state, module.device, frozen)
            state.clear()
            # every module in the mode the live one is in (a frozen block's norm layers in eval)
            modes = {clean_name(n): m.training for n, m in module.named_modules()}
            for name, part in whole.named_modules():
                part.training = modes.get(clean_name(name), part.training)
            return fn(whole)

        return on_rank_zero(host, on_zero)


def on_rank_zero(host: Host, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank zero, broadcast: the same result on every rank. An error on rank zero is
    raised on every rank, so none waits for a broadcast that never comes."""
    result: tuple[str, Any] | None = None
    if host.is_global_zero:
        try:
            result = ("ok", fn())
        except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
            result = ("error", err)
    status, payload = host.broadcast(result, src=0)
    if status == "error":
        raise payload
    return payload


def decide_on_zero(host: Host, decide: Callable[[Any], Decision], measured: Any) -> Decision:
    """``decide(measured)`` on rank zero, broadcast (:func:`on_rank_zero`)."""
    return on_rank_zero(host, lambda: decide(measured))


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

    def _hand_over(self, host: Host) -> None:
        """In a spawned worker (rank zero): leave the readable state for the main process."""
        pid = self.__dict__.get("_handoff_pid")
        if self._handoff is None or pid is None or pid == os.getpid() or not host.is_global_zero:
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
