"""Two ranks of Hugging Face's Trainer on CPU (gloo), started once by ``torch.distributed.run`` from
tests/test_hf.py for every case named: for each, each rank writes what it decided, which parameters got a gradient, what DDP
reduces and its final weights, for the test to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lalr_lightning.callbacks as C  # noqa: E402
from lalr_lightning.hf import trainer_callback  # noqa: E402
from tests._lm import tiny_lm  # noqa: E402

CASES = {
    "lisa": lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1),
    "spectrum": lambda: C.SpectrumSelect(top_percent=25),
    "tempbalance": lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2),
    "autorgn": lambda: C.AutoRGN(n_batches=2),
}


def main(out: str, names: list[str]) -> None:
    """Each case in turn, one Trainer each, in the same two processes (starting them is the slow part)."""
    for name in names:
        fit(out, name)


def fit(out: str, name: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = tiny_lm("llama", False, layers=4, hidden=16, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(4, 60, (16, 10), generator=g)]
    cb = CASES[name]()
    got: list[set[str]] = []

    class Peek(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            got.append(({n for n, p in model.named_parameters() if p.grad is not None},
                        {n for n, p in model.named_parameters() if not p.requires_grad}))

    args = TrainingArguments(output_dir=f"{out}/run_{name}", max_steps=4, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-3,
                             ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[trainer_callback(cb), Peek()])
    trainer.train()
    ddp = trainer.model_wrapped
    # the bytes of the parameters DDP put in its gradient buckets when it wrapped the model
    reduced = int(ddp._get_ddp_logging_data().get("total_parameter_size_bytes", -1))
    selected = list(getattr(cb, "selected", []))
    frozen = sorted(n for n, p in model.named_parameters()
                    if any(p is q for u in cb.layers if selected and u.name not in selected for q in u.params.values()))
    bytes_of = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    torch.save({"bytes": bytes_of, "history": cb.history, "grads": [(sorted(g), sorted(f)) for g, f in got], "frozen": frozen, "reduced": reduced,
                "is_ddp": type(ddp).__name__, "world": trainer.args.world_size,
                "weights": {n: p.detach().clone() for n, p in model.named_parameters()}},
               f"{out}/{name}_rank{trainer.args.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
