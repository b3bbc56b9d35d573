"""The distributed part of the decision cycle, the same for every callback:

* which strategies a callback can follow (:func:`check_strategy`);
* measuring the weights with the work shared out among the ranks, each gathering the whole
  weights of its own share only where the strategy shards them (:func:`measure_shards`);
* deciding on rank zero and broadcasting, so ranks cannot drift apart (:func:`decide_on_zero`);
* handing a ``ddp_spawn`` worker's final state back to the callback object in the main process
  (:class:`SpawnHandoff`).

:class:`~lalr_lightning.callbacks.base.LayerwiseCallback` calls these at the steps of its cycle;
the pure parts (who measures what, gathering one unit's whole weights) are
:mod:`lalr_lightning.core.shards`.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch

from lalr_lightning.core.decision import Decision
from lalr_lightning.core.layers import Layer
from lalr_lightning.core.shards import assign_shares, gather_objects, whole_weights

__all__ = ["SpawnHandoff", "check_strategy", "decide_on_zero", "measure_shards", "sharded"]


def check_strategy(trainer: pl.Trainer, who: str, *, fsdp: bool = False) -> None:
    """Raise a clear error for strategies whose parameter handling the callback cannot follow."""
    name = type(trainer.strategy).__name__
    if "DeepSpeed" in name:
        raise RuntimeError(
            f"{who} works on the optimizer's parameter groups and whole parameters, which DeepSpeed "
            "owns and partitions; use strategy='ddp' (or 'fsdp' where supported)"
        )
    if "FSDP" in name and not fsdp:
        raise RuntimeError(f"{who} reads whole weight matrices, which FSDP shards across ranks; use strategy='ddp'")


def sharded(trainer: pl.Trainer) -> bool:
    """Whether the strategy holds each parameter in shards across the ranks (FSDP)."""
    return "FSDP" in type(trainer.strategy).__name__


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
        layers = whole_weights(pl_module, everything, mine, weight_of)
        part = ("ok", fn(layers) if layers else {})
    except Exception as err:  # noqa: BLE001 -- raised on every rank below
        part = ("error", err)
    merged: dict = {}
    for status, value in gather_objects(part):
        if status == "error":
            raise value
        merged.update(value)
    return {la.name: merged[la.name] for la in everything if la.name in merged}


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
