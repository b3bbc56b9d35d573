"""Lightning strategies that run a sharded fit on CPU processes, for tests and debugging.

Lightning's ``FSDPStrategy`` refuses ``accelerator="cpu"`` (a check on the exact class) and hands
torch FSDP ``device_id=None`` there. :class:`CPUFSDPStrategy` is the same strategy -- the same
hooks, wrapping, checkpointing and auto-wrap policy -- with torch FSDP told to compute on the CPU
and the process group on gloo, so a multi-GPU FSDP config runs on ``--trainer.accelerator cpu
--trainer.devices 2`` to check it before a GPU job (slowly: it is for correctness, not speed).

FSDP2 needs nothing of the kind: ``ModelParallelStrategy(data_parallel_size=N,
tensor_parallel_size=1, process_group_backend="gloo")`` runs ``fully_shard`` on CPU as it is.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

__all__ = ["CPUFSDPStrategy"]


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` on CPU processes with gloo (module docstring); every argument is
    ``FSDPStrategy``'s. Use it with ``accelerator="cpu"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(*args, **kwargs)

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
