"""What DDP and FSDP still hold when a selection freezes matrices (2 CPU ranks, gloo).

* DDP (Lightning ``ddp_spawn``, the callbacks as a user runs them): per arm, the bytes of DDP's
  gradient buckets (allocated at the wrap for every parameter that requires grad then and that
  DDP does not ignore), the gradients averaged by hand instead (a switching selection's active
  blocks, kept out of DDP: ``core/handsync.py``), the gradient entries on rank 0 at
  ``on_before_optimizer_step`` and the AdamW state entries after the last step, against the
  parameters the arm trains (half its AdamW state entries: two moments each).
* FSDP (torch ``FullyShardedDataParallel``, ``use_orig_params=True`` as Lightning sets it, one
  unit per decoder layer; Lightning runs FSDP on GPUs only): a Spectrum-like freeze made before
  the wrap; per rank the flat gradient shards, the original parameters' gradients and AdamW's
  state.

    python benchmarks/selection_shards.py
"""

from __future__ import annotations

import json
import os
import socket
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


def _fsdp_worker(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = llama()
    for n, p in model.named_parameters():  # 1 of 4 per matrix type trains, as Spectrum 25 would
        if (".self_attn." in n and ".layers.0." not in n) or (".mlp." in n and ".layers.3." not in n):
            p.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"),
                   auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(rank))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    flat = [m._handle.flat_param for m in wrapped.modules() if isinstance(m, FSDP) and m._handle is not None]
    if rank == 0:
        out.put({"params": total, "trained": trained, "flat_grads": sum(f.grad.numel() for f in flat if f.grad is not None),
                 "orig_grads": sum(p.grad.numel() for p in wrapped.parameters() if p.grad is not None),
                 "adamw": sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")})
    dist.destroy_process_group()


def fsdp_table() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").Queue()
    mp.start_processes(_fsdp_worker, args=(port, out), nprocs=2, start_method="spawn")
    r = out.get(timeout=120)
    print(f"\nFSDP, 2 ranks, {r['trained']:,} of {r['params']:,} parameters trained (frozen before the wrap), "
          "entries per rank:\n")
    print("| flat gradient shards | gradients of the trained parameters | AdamW state | trained / 2 ranks |")
    print("|---|---|---|---|")
    print(f"| {r['flat_grads']:,} | {r['orig_grads']:,} | {r['adamw']:,} | {r['trained'] // 2:,} |")


if __name__ == "__main__":
    ddp_table()
    fsdp_table()
