"""What DDP and FSDP still hold when a selection freezes matrices (2 CPU ranks, gloo).

* DDP (Lightning ``ddp_spawn``, the callbacks as a user runs them): per arm, the bytes of DDP's
  gradient buckets (allocated at the wrap for every parameter that requires grad then and that
  DDP does not ignore), the gradients averaged by hand instead (a switching selection's active
  blocks, kept out of DDP: ``core/runtime/handsync.py``), the gradient entries on rank 0 at
  ``on_before_optimizer_step`` and the AdamW state entries after the last step, against the
  parameters the arm trains (half its AdamW state entries: two moments each).
* FSDP1 and FSDP2 (Lightning's ``FSDPStrategy`` -- through ``CPUFSDPStrategy``, Lightning runs
  FSDP on GPUs only -- with one unit per decoder layer, and ``ModelParallelStrategy`` with
  ``fully_shard`` per decoder layer), the same arms through the callbacks: per rank the bytes of
  the parameters' pieces, of the gradients the strategy allocates (FSDP1: one flat gradient per
  unit; FSDP2: one per parameter), of the gradients of what trains, and of AdamW's state.

    python benchmarks/selection_shards.py          # both tables
    python benchmarks/selection_shards.py fsdp     # FSDP1 and FSDP2 only
"""

from __future__ import annotations

import json
import os
import tempfile

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import BlockSchedule, SpectrumSelect, SurgicalBlocks

CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
ARMS = {  # arm: (callbacks, gradient_as_bucket_view)
    "full fine-tuning": (lambda: [], False),
    "SpectrumSelect(top_percent=25)": (lambda: [SpectrumSelect(top_percent=25)], False),
    "BlockSchedule('lisa', gamma=1)": (lambda: [BlockSchedule("lisa", gamma=1, every_n_steps=1)], False),
    "same, gradient_as_bucket_view=True": (lambda: [BlockSchedule("lisa", gamma=1, every_n_steps=1)], True),
    "same, save_compute=False": (lambda: [BlockSchedule("lisa", gamma=1, every_n_steps=1, save_compute=False)], False),
    "SurgicalBlocks(select='first')": (lambda: [SurgicalBlocks(select="first")], False),
}


def llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = llama()

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        ids = torch.randint(0, 1000, (32, 16), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)


class Count(Callback):
    def __init__(self, out: str):
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = sum(p.grad.numel() for p in pl_module.parameters() if p.grad is not None)
        syncs = [c._handsync for c in trainer.callbacks if getattr(c, "_handsync", None) is not None]
        self.by_hand = sum(p.grad.numel() for s in syncs for p in s.params if p.grad is not None)

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            opt = trainer.optimizers[0]
            info = trainer.strategy.model._get_ddp_logging_data()
            with open(self.out, "w") as fh:
                json.dump({"params": sum(p.numel() for p in pl_module.parameters()), "grads": self.grads,
                           "bucket_bytes": int(info["total_parameter_size_bytes"]), "by_hand": self.by_hand,
                           "adamw": sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")},
                          fh)


def ddp_table() -> None:
    print("DDP, 2 ranks: bytes held per rank (fp32) after 3 steps; with gradient_as_bucket_view=True the\n"
          "gradients are views into the buckets (no memory of their own)\n")
    print("| arm | trained | gradients | DDP buckets | averaged by hand | AdamW state | "
          "buckets / what the trained need | (buckets + by hand) / need |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, (make, view) in ARMS.items():
        out = os.path.join(tempfile.mkdtemp(), "ddp.json")
        strategy = DDPStrategy(start_method="spawn", gradient_as_bucket_view=view)
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[*make(), Count(out)]).fit(LM())
        r = json.load(open(out))
        trained = r["adamw"] // 2  # two AdamW moments per trained entry (LISA releases what stops training)
        print(f"| {arm} | {trained:,} of {r['params']:,} | {4 * r['grads']:,} | {r['bucket_bytes']:,} | "
              f"{4 * r['by_hand']:,} | {4 * r['adamw']:,} | {r['bucket_bytes'] / (4 * trained):.2f} | "
              f"{(r['bucket_bytes'] + 4 * r['by_hand']) / (4 * trained):.2f} |")


# ---------------------------------------------------------------------- FSDP1 and FSDP2 through Lightning

FSDP_ARMS = {  # arm: callbacks (None: full fine-tuning)
    "full fine-tuning": lambda: [],
    "SpectrumSelect(top_percent=25)": lambda: [SpectrumSelect(top_percent=25)],
    "BlockSchedule('lisa', gamma=1)": lambda: [BlockSchedule("lisa", gamma=1, every_n_steps=1)],
    "SurgicalBlocks(select='first')": lambda: [SurgicalBlocks(select="first")],
}


class ShardedLM(LM):
    """``LM`` that shards itself with FSDP2 (``fully_shard`` per decoder layer, then the whole) when
    ``fsdp2``; under FSDP1 the strategy wraps it."""

    def __init__(self, fsdp2: bool = False):
        super().__init__()
        self.fsdp2 = fsdp2

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ShardCount(Callback):
    """Bytes this rank holds: parameters and gradients at the first ``on_before_optimizer_step``
    after a switch has happened (the last step), AdamW's state after the last step; and the
    entries of the parameters that train then (their pieces on this rank)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        units = [m for m in trainer.strategy.model.modules() if isinstance(m, FSDP) and m._handle is not None]
        if units:  # FSDP1: each unit's flat parameter and its flat gradient, this rank's piece
            flats = [u._handle.flat_param for u in units]
            self.params = sum(f.numel() * f.element_size() for f in flats)
            self.grads = sum(f.grad.numel() * f.grad.element_size() for f in flats if f.grad is not None)
        else:  # FSDP2: each parameter's shard and its gradient's
            self.params = sum(_local(p).numel() * p.element_size() for p in pl_module.parameters())
            self.grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in pl_module.parameters()
                             if p.grad is not None)
        # the pieces of what trains this step: gradient entries the update reads
        self.need = sum(_local(p.grad).numel() * p.grad.element_size() for p in pl_module.parameters()
                        if p.grad is not None)
        self.trained = sum(_local(p).numel() for p in pl_module.parameters() if p.requires_grad)

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.state = sum(_local(v).numel() * v.element_size() for s in opt.state.values() for k, v in s.items()
                         if k != "step" and isinstance(v, torch.Tensor))


def _fsdp_pair(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lalr_lightning.strategies import CPUFSDPStrategy

    # Lightning takes the processes as launched from outside and joins the group made here: one
    # pair of processes for every fit (spawning is the slow part)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    rows = []
    for kind in ("FSDP1", "FSDP2"):
        for arm, make in FSDP_ARMS.items():
            if kind == "FSDP1":
                strategy = CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer})
            else:
                from lightning.pytorch.strategies import ModelParallelStrategy

                strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                 process_group_backend="gloo")
            count = ShardCount()
            pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[*make(), count]).fit(ShardedLM(fsdp2=kind == "FSDP2"))
            rows.append({"kind": kind, "arm": arm, "params": count.params, "grads": count.grads,
                         "need": count.need, "state": count.state, "trained": count.trained})
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def fsdp_rows() -> list[dict]:
    """Byte counts of every arm under FSDP1 and FSDP2, per rank (``"ranks"``: each rank's row) and
    their mean over the 2 ranks, from one pair of processes."""
    work = tempfile.mkdtemp()
    out = os.path.join(work, "fsdp.json")
    mp.start_processes(_fsdp_pair, args=(os.path.join(work, "store"), out), nprocs=2, start_method="spawn")
    ranks = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    rows = []
    for r0, r1 in zip(*ranks):
        row = {k: v if isinstance(v, str) else (v + r1[k]) / 2 for k, v in r0.items()}
        rows.append({**row, "ranks": [r0, r1]})
    return rows


def fsdp_table() -> None:
    rows = fsdp_rows()
    total = int(rows[0]["params"] * 2) // 4  # fp32 entries of the whole model (both ranks' pieces)
    print(f"\nFSDP, 2 ranks, Lightning's strategies (FSDP1: FSDPStrategy, one unit per decoder layer; FSDP2:\n"
          f"ModelParallelStrategy, fully_shard per decoder layer), a {total:,}-parameter LLaMA, AdamW, fp32;\n"
          "bytes per rank (the mean of the 2: FSDP1 cuts each unit's flat parameter, not each matrix, in\n"
          "halves) at the last step; gradients: what the strategy allocates; need: the gradients of the\n"
          "parameters that train then\n")
    print("| strategy | arm | parameters | gradients | need | gradients / need | AdamW state |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['arm']} | {r['params']:,.0f} | {r['grads']:,.0f} | {r['need']:,.0f} | "
              f"{r['grads'] / max(r['need'], 1):.2f} | {r['state']:,.0f} |")


if __name__ == "__main__":
    import sys

    which = sys.argv[1:] or ["ddp", "fsdp"]
    if "ddp" in which:
        ddp_table()
    if "fsdp" in which:
        fsdp_table()
