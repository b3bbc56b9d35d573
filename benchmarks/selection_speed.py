"""Steps per second of full fine-tuning against the selection callbacks, side by side.

A LLaMA-shaped causal LM built from its config (random weights, offline), AdamW, Lightning on
the CPU; each arm's optimizer steps are timed after a warm-up (forward + backward + step), the
arms interleaved over rounds so a load change on the machine hits them all. A frozen matrix
(``requires_grad=False``, set before the wrap by the callbacks) costs no weight-gradient
matmul in the backward pass; its input gradient is still needed by the layers below.

    python benchmarks/selection_speed.py [--hidden 512] [--layers 6] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import BlockSchedule, SpectrumSelect

ARMS = {
    "full fine-tuning": lambda: [],
    "SpectrumSelect(top_percent=25)": lambda: [SpectrumSelect(top_percent=25)],
    "SpectrumSelect(top_percent=50)": lambda: [SpectrumSelect(top_percent=50)],
    "BlockSchedule('lisa', gamma=2)": lambda: [BlockSchedule("lisa", gamma=2, every_n_steps=2)],
}


class LM(pl.LightningModule):
    def __init__(self, hidden: int, layers: int, vocab: int, batch: int, seq: int):
        super().__init__()
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                             num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                             max_position_embeddings=seq, tie_word_embeddings=False)
        self.model = AutoModelForCausalLM.from_config(config)
        self.batch, self.seq = batch, seq

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        ids = torch.randint(0, self.model.config.vocab_size, (64 * self.batch, self.seq),
                            generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=self.batch)


class StepTimer(Callback):
    def __init__(self, warmup: int):
        self.warmup, self.times = warmup, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self.t0)


def run(arm: str, args) -> tuple[float, int, int]:
    """(median seconds per step, trained parameters, all parameters)."""
    module = LM(args.hidden, args.layers, args.vocab, args.batch, args.seq)
    timer = StepTimer(args.warmup)
    trained = {}

    class Count(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trained["n"] = sum(p.numel() for p in pl_module.parameters() if p.grad is not None)

    pl.Trainer(accelerator="cpu", devices=1, max_steps=args.warmup + args.steps, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               callbacks=[*ARMS[arm](), Count(), timer]).fit(module)
    return statistics.median(timer.times), trained["n"], sum(p.numel() for p in module.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    counts = {}
    for _ in range(args.rounds):
        for arm in ARMS:
            t, n, total = run(arm, args)
            times[arm].append(t)
            counts[arm] = (n, total)
    base = statistics.median(times["full fine-tuning"])
    tokens = args.batch * args.seq
    print(f"LLaMA-shaped, hidden {args.hidden}, {args.layers} layers, {counts['full fine-tuning'][1] / 1e6:.1f} M "
          f"parameters; batch {args.batch} x {args.seq} tokens, AdamW, {args.threads} thread(s), median of "
          f"{args.rounds} rounds x {args.steps} steps\n")
    print("| arm | weights with a gradient | s / step | tokens / s | speed vs full |")
    print("|---|---|---|---|---|")
    for arm, ts in times.items():
        t = statistics.median(ts)
        n, total = counts[arm]
        print(f"| {arm} | {n / 1e6:.1f} M ({n / total:.0%}) | {t:.3f} | {tokens / t:.0f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
