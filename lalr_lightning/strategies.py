"""Lightning strategies that run a sharded fit on CPU processes, for tests and debugging.

Lightning's ``FSDPStrategy`` refuses ``accelerator="cpu"`` (a check on the exact class) and hands
torch FSDP ``device_id=None`` there. :class:`CPUFSDPStrategy` is the same strategy -- the same
hooks, wrapping, checkpointing and auto-wrap policy -- with torch FSDP told to compute on the CPU
and the process group on gloo, so a multi-GPU FSDP config runs on ``--trainer.accelerator cpu
--trainer.devices 2`` to check it before a GPU job (slowly: it is for correctness, not speed).

FSDP2 needs nothing of the kind: ``ModelParallelStrategy(data_parallel_size=N,
tensor_parallel_size=1, process_group_backend="gloo")`` runs ``fully_shard`` on CPU as it is.

What ``FSDPStrategy`` does that fails on CPU processes, done differently here:

* Saving: Lightning gathers the whole model (and the optimizer state) with ``offload_to_cpu=True``.
  On a CPU compute device that "offload" moves nothing, and torch 2.13 then cloned freed memory in
  ``_state_dict_utils.param_hook``: rank 0 died with SIGSEGV at the first checkpoint save. This
  strategy gathers without the offload (the tensors are on the CPU already).
* Failing: a rank whose fit raised says so in one line and joins no further collective
  (:meth:`CPUFSDPStrategy.on_exception`); once its process ends, the other ranks' collective fails.
* Leaving: Lightning destroys the gloo process group only when the interpreter finalizes, where
  gloo's worker threads have aborted a finished rank ("terminate called without an active
  exception", SIGABRT). This strategy has the ranks leave together at exit, while the interpreter
  is still whole (:func:`leave_process_group`), unless the fit failed.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

__all__ = ["CPUFSDPStrategy", "leave_process_group"]


def leave_process_group() -> None:
    """Leave the default process group together with the other ranks: a barrier, then
    ``destroy_process_group`` (a no-op without a group). Call it on every rank once the multi-rank
    work is over -- after ``fit`` and anything after it that runs collectives (``test``,
    ``save_checkpoint``) -- or let :class:`CPUFSDPStrategy` call it at exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # rank 0 hosts the store: no rank tears it down while another still uses it
        dist.destroy_process_group()


_failed = False  # a fit in this process raised: its ranks are not all coming to a barrier


def _leave_at_exit() -> None:
    # an uncaught exception on the way out (sys.last_value) or a failed fit: no barrier (the other
    # ranks are not coming to it), the process simply ends and gloo tells the others
    if _failed or getattr(sys, "last_value", None) is not None:
        return
    try:
        leave_process_group()
    except Exception as err:  # noqa: BLE001 -- exiting anyway: one line, not a traceback at exit
        print(f"lalr_lightning: leaving the process group at exit failed ({type(err).__name__}: {err})",
              file=sys.stderr)


_leave_registered = False


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU processes with gloo (module docstring); every argument is
    ``FSDPStrategy``'s. Use it with ``accelerator="cpu"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)

    def setup_environment(self) -> None:
        global _leave_registered, _failed
        super().setup_environment()
        _failed = False  # a new fit (after a failed one, the group is made anew)
        if not _leave_registered:  # once per process; atexit handlers run before finalization
            atexit.register(_leave_at_exit)
            _leave_registered = True

    def on_exception(self, exception: BaseException) -> None:
        """A fit that raised on this rank says so in one line and destroys its process group, so
        this rank joins no further collective (no barrier at exit, no ``leave_process_group``):
        one that the other ranks, stopped in their own collective, would wait on or mismatch.
        When this process ends, gloo closes its connections and the other ranks' collective fails
        at once ("Connection closed by peer"). A process that lives on after a failed fit (a
        notebook, a sweep that catches the error) holds them open: the other ranks then stop at
        the group's timeout, ``CPUFSDPStrategy(timeout=timedelta(minutes=...))`` (Lightning's
        default is 30 minutes)."""
        global _failed
        import torch.distributed as dist

        _failed = True
        super().on_exception(exception)
        if dist.is_available() and dist.is_initialized():
            print(f"lalr_lightning: rank {self.global_rank} stopped ({type(exception).__name__}: {exception}); "
                  "it leaves the process group, and the other ranks stop when this process ends", file=sys.stderr, flush=True)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001,S110 -- the fit's own error is what propagates
                pass

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict as ``FSDPStrategy`` saves it, gathered without offloading to the
        CPU (module docstring: torch 2.13's offload on a CPU device crashed rank 0)."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            return self.model.state_dict()

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            return super()._setup_model(model)  # wrapped in configure_model already
        return FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),  # Lightning passes root_device.index, None on CPU
            **self.kwargs,
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state as ``FSDPStrategy`` saves it, without offloading to the CPU. On a
        CPU compute device torch's gather keeps every state of a unit as a view of one reused
        buffer and its ``.cpu()`` copies nothing, so each AdamW ``exp_avg`` came out equal to its
        ``exp_avg_sq`` (torch 2.14, ``_allgather_orig_param_states``); unoffloaded, torch clones."""
        from torch.distributed.fsdp import (
            FullOptimStateDictConfig,
            FullStateDictConfig,
            OptimStateKeyType,
            StateDictType,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # under LightningOptimizer
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
            state = FSDP.optim_state_dict(self.model, optimizer)
        if self.global_rank == 0:  # numbered by parameter, as FSDPStrategy stores it
            state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        return state

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, cpu_offload=self.cpu_offload,
                         mixed_precision=self.mixed_precision_config, sharding_strategy=self.sharding_strategy,
                         device_id=torch.device("cpu"), **self.kwargs):
            yield
