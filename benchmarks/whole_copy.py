"""What measuring on a whole copy costs under FSDP (2 CPU ranks, gloo), side by side with DDP.

NTKDiagnostics, ProximalRegularizer's lambda_o and L-MSA's metric (``update="optimizer"``) run the
whole model through ``torch.func`` or run blocks alone; under FSDP rank zero measures on a whole
copy of the model (``core/runtime/shards.WholeCopy``): the state dict gathered to its CPU, a copy
filled on the device, the result broadcast. Per strategy, on the 1.05 M-parameter LLaMA of
``selection_shards.py``: the seconds of the first measurement (rank zero's clock, the gather
included; lambda_o is estimated once per fit, at the first) and the bytes of the whole copy rank
zero holds while one runs (its parameters, counted from the copy), against the bytes of its own parameters.

    python benchmarks/whole_copy.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp

from lalr_lightning.callbacks import LMSAStepper, NTKDiagnostics, ProximalRegularizer
from lalr_lightning.core.runtime import shards

ARMS = {
    "NTKDiagnostics(probe_size=4)": lambda: NTKDiagnostics(probe_size=4),
    "ProximalRegularizer lambda_o": lambda: ProximalRegularizer(lam=0.5, probe_size=4, every_n_epochs=1),
    "LMSAStepper(update='optimizer')": lambda: LMSAStepper(update="optimizer", every_n_epochs=1),
}


def _timed(cb):
    """``cb`` with its measurements timed: ``measure`` (L-MSA: ``on_after_backward`` while it
    measures, where its metric runs)."""
    cb.seconds = []
    name = "on_after_backward" if isinstance(cb, LMSAStepper) else "measure"
    inner = getattr(cb, name)

    def timed(*args, **kwargs):
        measuring = getattr(cb, "_measuring", True)
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        if measuring:
            cb.seconds.append(time.perf_counter() - t)
        return out

    setattr(cb, name, timed)
    return cb


class CopyBytes(pl.Callback):
    """Bytes of this rank's parameter pieces, and of the parameters of every whole copy built."""

    def __init__(self):
        self.copies: list[int] = []

    def setup(self, trainer, pl_module, stage):
        from lalr_lightning.core.runtime import shards as distributed

        build = distributed.materialize

        def counted(*args, **kwargs):
            whole = build(*args, **kwargs)
            self.copies.append(sum(p.numel() * p.element_size() for p in whole.parameters()))
            return whole

        distributed.materialize = counted  # WholeCopy builds its copies with it
        self._put_back = lambda: setattr(distributed, "materialize", build)

    def on_train_end(self, trainer, pl_module):
        self.own = sum(shards.local_tensor(p).numel() * p.element_size() for p in pl_module.parameters())
        self._put_back()


def _pair(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from selection_shards import ShardedLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lalr_lightning.strategies import CPUFSDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    strategies = {
        "DDP": lambda: DDPStrategy(process_group_backend="gloo"),
        "FSDP1": lambda: CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}),
        "FSDP2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                               process_group_backend="gloo"),
    }
    rows = []
    for arm, make in ARMS.items():
        for kind, strategy in strategies.items():
            cb, count = _timed(make()), CopyBytes()
            pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(), max_epochs=2, limit_train_batches=2,
                       logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       enable_model_summary=False, callbacks=[cb, count]).fit(ShardedLM(fsdp2=kind == "FSDP2"))
            rows.append({"arm": arm, "kind": kind, "seconds": cb.seconds[0], "whole": max(count.copies, default=0),
                         "own": count.own})
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def rows(start_method: str = "spawn") -> list[dict]:
    """Rank zero's rows: every arm under DDP, FSDP1 and FSDP2, from one pair of processes
    (``start_method="forkserver"``: forked from a server that has imported torch and Lightning,
    as the tests do; the seconds are the measurement's own either way)."""
    work = tempfile.mkdtemp()
    out = os.path.join(work, "copy.json")
    mp.start_processes(_pair, args=(os.path.join(work, "store"), out), nprocs=2, start_method=start_method)
    return json.load(open(f"{out}.0"))


def main() -> None:
    table = rows()
    print("\nMeasuring on a whole copy under FSDP, 2 CPU ranks (gloo), the 1.05 M-parameter LLaMA; rank zero's\n"
          "seconds for the first measurement, the bytes of the copy it holds while one runs, and the bytes\n"
          "of its own parameters\n")
    print("| measurement | strategy | seconds | vs DDP | copy on rank 0 | own parameters |")
    print("|---|---|---|---|---|---|")
    base = {r["arm"]: r["seconds"] for r in table if r["kind"] == "DDP"}
    for r in table:
        print(f"| {r['arm']} | {r['kind']} | {r['seconds']:.3f} | {r['seconds'] / base[r['arm']]:.2f}x | "
              f"{r['whole']:,} | {r['own']:,} |")


if __name__ == "__main__":
    main()
