"""Strategies for the multi-process tests (module level, so spawned workers can unpickle them).

Lightning destroys a gloo process group only when the process exits. Rank 0 hosts the TCP store,
and when it exits first, rank 1's store thread can abort it at exit ("terminate called without an
active exception", SIGABRT), which fails a test that has already checked everything. These
strategies have the ranks leave together: a barrier, then the group is destroyed, at teardown.
"""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy


def leave_together() -> None:
    """Barrier, then destroy the process group (a no-op outside one: the parent process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class SpawnDDP(DDPStrategy):
    """``strategy="ddp_spawn"`` whose ranks leave together (module docstring)."""

    def __init__(self, **kw):
        kw.setdefault("start_method", "spawn")
        super().__init__(**kw)

    def teardown(self) -> None:
        super().teardown()
        leave_together()


def ddp_spawn(**kw) -> SpawnDDP:
    """What the tests pass for ``strategy="ddp_spawn"``."""
    return SpawnDDP(**kw)
