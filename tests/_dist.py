"""Strategies and a process pair for the multi-process tests (module level, so spawned workers can
unpickle them).

Lightning destroys a gloo process group only when the process exits. Rank 0 hosts the TCP store,
and when it exits first, rank 1's store thread can abort it at exit ("terminate called without an
active exception", SIGABRT), which fails a test that has already checked everything. These
strategies have the ranks leave together: a barrier, then the group is destroyed, at teardown.

:func:`run_pair` starts two CPU processes once and runs many fits in them: Lightning skips
``init_process_group`` when a group exists, and starting processes is the slow part of a
multi-process test (they fork from a server that has imported torch, Lightning and transformers). The strategies for it (:func:`ddp`, :func:`fsdp1`, :func:`fsdp2`) do not leave the group at
teardown; the pair leaves together when its function returns.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _disable_module_memory_sharing,
    _GlobalStateSnapshot,
    _MultiProcessingLauncher,
)


def leave_together() -> None:
    """Barrier, then destroy the process group (a no-op outside one: the parent process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class SpawnDDP(DDPStrategy):
    """``strategy="ddp_spawn"`` whose ranks leave together (module docstring), started by
    :class:`_PreloadedLauncher`."""

    def __init__(self, **kw):
        kw.setdefault("start_method", "spawn")
        super().__init__(**kw)

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "spawn":
            self._launcher = _PreloadedLauncher(self)

    def teardown(self) -> None:
        super().teardown()
        leave_together()


class _PreloadedLauncher(_MultiProcessingLauncher):
    """Lightning's ``ddp_spawn`` launcher whose processes fork from :func:`run_pair`'s preloaded
    server instead of importing torch, Lightning and transformers each (about 11 CPU seconds per
    process). What spawn gives them they still get: the launching process's seeds and deterministic
    flags, and a copy of the module's tensors of their own (shared, the ranks would step one model)."""

    def __init__(self, strategy):
        super().__init__(strategy, start_method="forkserver")

    def launch(self, function, *args, trainer=None, **kwargs):
        _start_server()
        self._states = _GlobalStateSnapshot.capture()  # goes to the processes with this launcher
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, return_queue, global_states=None):
        self._states.restore()
        args, kwargs = _disable_module_memory_sharing((args, kwargs))
        return super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue)


def ddp_spawn(**kw) -> SpawnDDP:
    """What the tests pass for ``strategy="ddp_spawn"``."""
    return SpawnDDP(**kw)


# ---------------------------------------------------------------------- a pair of processes, many fits

#: what every pair's processes import: a spawned process imports them afresh (torch, Lightning with
#: torchmetrics -> torchvision -> torch._dynamo, scipy.signal and transformers: ~11 CPU seconds on
#: the 2-core machine, 2026-12-02), so the pairs fork from a server that imported them once per
#: pytest process (multiprocessing's forkserver)
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "transformers",
           "transformers.models.llama.modeling_llama", "lalr_lightning.callbacks", "lalr_lightning.strategies"]
# the server's environment and directory: this process's as the tests found it, not a test's
# monkeypatched ones (the server keeps what it started with)
_START = (dict(os.environ), os.getcwd())

def ddp(**kw) -> DDPStrategy:
    """DDP inside :func:`run_pair` (the group exists: Lightning joins it)."""
    return DDPStrategy(process_group_backend="gloo", **kw)


def fsdp1(wrap: set[type] | None = None, **kw):
    """Lightning's ``FSDPStrategy`` on CPU (``CPUFSDPStrategy``), one unit per ``wrap`` class when
    given, else the whole model as one unit."""
    from lalr_lightning.strategies import CPUFSDPStrategy

    if wrap:
        kw["auto_wrap_policy"] = set(wrap)
    return CPUFSDPStrategy(**kw)


def fsdp2(ranks: int = 2, **kw):
    """Lightning's ``ModelParallelStrategy`` as FSDP2 over ``ranks`` CPU ranks (the LightningModule
    calls ``fully_shard`` in ``configure_model``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1, process_group_backend="gloo", **kw)


def run_pair(fn: Callable[..., None], workdir: str | Path, *args: Any, timeout_s: int = 120,
             nprocs: int = 2) -> dict[int, dict]:
    """Run ``fn(rank, record, *args)`` in two spawned CPU processes that share a gloo group, and
    return each rank's records ``{rank: {key: value}}`` (plain Python / numpy: tensors cross as
    files). ``record(key, value)`` saves as it goes, so what a rank recorded before a failure
    still comes back; a collective left waiting by the other rank fails after ``timeout_s``."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    _start_server()
    try:
        mp.start_processes(_pair_main, args=(fn, str(workdir), args, timeout_s, nprocs), nprocs=nprocs,
                           start_method="forkserver")
    finally:  # what the ranks printed, into this test's output (the server's own streams are an earlier test's)
        for rank in range(nprocs):
            log = workdir / f"rank{rank}.log"
            if log.exists() and log.stat().st_size:
                sys.stderr.write(f"--- rank {rank} of the pair:\n{log.read_text(errors='replace')[-20000:]}\n")
    out = {}
    for rank in range(nprocs):
        path = workdir / f"rank{rank}.pt"
        out[rank] = torch.load(path, weights_only=False) if path.exists() else {}
    return out


def preloaded_start_method() -> str:
    """The start method for a test's own ``mp.start_processes``: ``"forkserver"``, with the server
    :func:`run_pair` forks from running (its processes skip the ~11 CPU seconds of imports)."""
    _start_server()
    return "forkserver"


def _start_server() -> None:
    """The forkserver, started once with :data:`PRELOAD` imported, in the environment and directory
    this process had when the tests were collected (a no-op while it runs)."""
    env, cwd = _START
    multiprocessing.set_forkserver_preload(PRELOAD)
    now_env, now_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now_env)
        os.chdir(now_cwd)


def run_pair_once(name: str, tmp_path_factory, fn: Callable[..., None], *args: Any,
                  timeout_s: int = 120, nprocs: int = 2) -> dict[int, dict]:
    """:func:`run_pair` once per test session, whatever the number of pytest-xdist workers: a
    module's tests may be spread over the workers, and each would run its module fixture; the
    first to come runs the pair, the others wait for it and read its records. ``fn`` gets its
    work directory as its first argument after ``record``."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the session's workers
    work, done = root / f"pair_{name}", root / f"pair_{name}.pt"
    with FileLock(str(root / f"pair_{name}.lock")):
        if not done.exists():
            torch.save(run_pair(fn, work, str(work), *args, timeout_s=timeout_s, nprocs=nprocs), done)
    return torch.load(done, weights_only=False)


def pair_record(runs: dict[int, dict], rank: int, key: Any) -> Any:
    """Rank ``rank``'s record ``key`` from :func:`run_pair_once`'s result; the test fails naming it
    when the pair stopped before it or the record is a failure's text."""
    import pytest

    got = runs[rank].get(key)
    if got is None:
        pytest.fail(f"{key} has no record on rank {rank}: its pair of processes stopped before it (see the output)")
    if isinstance(got, str):
        pytest.fail(f"{key} failed on rank {rank}: {got}")
    return got


def _pair_main(rank: int, fn, workdir: str, args: tuple, timeout_s: int, nprocs: int = 2) -> None:
    # this rank's output (Python's and gloo's) to a file that run_pair prints in the test's output
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # Lightning takes the processes as launched from outside (LOCAL_RANK set) and joins the group
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(nprocs), RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=nprocs,
                            timeout=timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    records: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        records[key] = value
        torch.save(records, os.path.join(workdir, f"rank{rank}.pt"))

    code = 0
    try:
        fn(rank, record, *args)
        leave_together()
    except BaseException:  # noqa: BLE001 -- reported, and the pair ends
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # leave without running interpreter-exit destructors, where gloo's threads have aborted a
    # finished worker ("terminate called without an active exception")
    os._exit(code)


def free_port() -> int:
    """A TCP port free now on this machine, for a ``torch.distributed.run --master_port``: a fixed
    one fails the launch whenever another job holds it (EADDRINUSE)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- Hugging Face launches


def hf_launch(tmp_path_factory, name: str, script: str | Path, cases: list[str], timeout_s: int):
    """One ``torch.distributed.run`` of ``script`` on two CPU ranks for every case named (each rank
    writes ``<case>_rank<r>.pt`` under a fresh directory); the test fails with the launch's stderr
    when it does not exit cleanly. Returns ``load(case, rank=0)`` -> that rank's record."""
    import subprocess

    out = tmp_path_factory.mktemp(name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(script), str(out), *cases], env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    assert run.returncode == 0, run.stderr[-4000:]

    def load(case: str, rank: int = 0) -> dict:
        return torch.load(out / f"{case}_rank{rank}.pt", weights_only=False)

    return load


def hf_trainer(model, args, rows, cb, peek, before=None):
    """The case's ``transformers.Trainer``: the worker's ``before`` (if any, seeing each event
    before the method), the method ``cb`` (none when ``None``) as a Trainer callback, then the
    worker's ``peek`` recording what the engine holds."""
    from transformers import Trainer

    from lalr_lightning.hf import trainer_callback

    callbacks = ([] if before is None else [before]) + ([] if cb is None else [trainer_callback(cb)]) + [peek]
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=callbacks)


def hf_train(trainer, resume_from: str | None) -> str | None:
    """Train (resumed from ``resume_from`` when given); a refusal (``RuntimeError``) comes back as its
    text for the test to read, anything else fails the launch."""
    try:
        trainer.train(resume_from_checkpoint=resume_from)
    except RuntimeError as err:
        return str(err)
    return None
