"""Steps per second of full fine-tuning against static selections, side by side.

A LLaMA-shaped causal LM built from its config (random weights, offline), AdamW, CPU. Each arm's
trained set is what its callback decides in ``setup`` during a fit (``requires_grad=False`` on
the frozen matrices, before the optimizer exists); then the arms take optimizer steps (forward +
backward + AdamW) in turn, step by step, so a load change on the machine hits them all alike. A
frozen matrix costs no weight-gradient matmul in the backward pass (its input gradient is still
computed for the layers below) and no AdamW update.

    python benchmarks/selection_speed.py [--hidden 512] [--layers 6] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import SpectrumSelect, SurgicalBlocks

ARMS = {
    "full fine-tuning": None,
    "SpectrumSelect(top_percent=25)": lambda: SpectrumSelect(top_percent=25),
    "SpectrumSelect(top_percent=50)": lambda: SpectrumSelect(top_percent=50),
    "SurgicalBlocks(select='first')": lambda: SurgicalBlocks(select="first"),
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
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self):
        ids = torch.randint(0, self.model.config.vocab_size, (self.batch, self.seq),
                            generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=self.batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arms = {}
    for arm, make in ARMS.items():
        module = LM(args.hidden, args.layers, args.vocab, args.batch, args.seq)
        if make is not None:  # the callback's own setup: the decision a fit makes before the wrap
            make().setup(pl.Trainer(accelerator="cpu", devices=1, logger=False), module, "fit")
        arms[arm] = (module, module.configure_optimizers())
    batch = next(iter(arms["full fine-tuning"][0].train_dataloader()))
    times: dict[str, list[float]] = {a: [] for a in arms}
    for i in range(args.warmup + args.steps):
        for arm, (module, opt) in arms.items():
            t0 = time.perf_counter()
            module.training_step(batch, 0).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times[arm].append(time.perf_counter() - t0)
    base = statistics.median(times["full fine-tuning"])
    tokens = args.batch * args.seq
    total = sum(p.numel() for p in arms["full fine-tuning"][0].parameters())
    print(f"LLaMA-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {total / 1e6:.1f} M "
          f"parameters; batch {args.batch} x {args.seq} tokens, AdamW, {args.threads} thread(s), median of "
          f"{args.steps} interleaved steps\n")
    print("| arm | trained parameters | s / step | tokens / s | speed vs full |")
    print("|---|---|---|---|---|")
    for arm, (module, _) in arms.items():
        t = statistics.median(times[arm])
        n = sum(p.numel() for p in module.parameters() if p.requires_grad)
        print(f"| {arm} | {n / 1e6:.1f} M ({n / total:.0%}) | {t:.3f} | {tokens / t:.0f} | {base / t:.2f}x |")


if __name__ == "__main__":
    main()
