"""One small 2-rank FSDP1 fit on CPU processes (``CPUFSDPStrategy``, gloo), no callback, then a
checkpoint save: the run :mod:`scripts.exit_loop` repeats, and the tests launch.

    python scripts/fsdp1_fit.py OUT_DIR [--launch lightning|torchrun] [--state-dict full|sharded]
                                [--raise-on-rank R] [--timeout-s S]

``--launch lightning`` (default): run as a plain script, Lightning's own launcher starts the
second rank (``devices=2``), as ``lalr-lightning fit --trainer.devices 2`` does. ``--launch
torchrun``: started by ``python -m torch.distributed.run --nproc_per_node 2``, Lightning joins.

Rank 0 writes ``OUT_DIR/done.json`` once the fit and the save are over: the saved weights
checked against the model's own (gathered on every rank), so a save that wrote wrong numbers
fails here. ``--raise-on-rank R`` makes rank R raise in a callback at step 2 (the other rank must
stop, not wait at the next collective); ``--timeout-s`` sets the strategy's collective timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the clone's package when run from it

from lalr_lightning.strategies import CPUFSDPStrategy  # noqa: E402


class Net(pl.LightningModule):
    """Three Linear layers, one FSDP unit each, AdamW (its state is saved too)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, _idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RaiseAt(pl.Callback):
    """Raise on one rank at one step: a rank that dies mid-fit."""

    def __init__(self, rank: int, step: int = 2):
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, *_args):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"rank {self.rank} fails on purpose at step {self.step}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--launch", choices=("lightning", "torchrun"), default="lightning")
    ap.add_argument("--state-dict", choices=("full", "sharded"), default="full")
    ap.add_argument("--raise-on-rank", type=int, default=None)
    ap.add_argument("--timeout-s", type=float, default=None)
    ap.add_argument("--linger-s", type=float, default=0.0,
                    help="the rank that raises catches it and lives on this long (a notebook, a sweep)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--resume", action="store_true", help="then resume from the checkpoint for 2 more steps")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    kw = {"auto_wrap_policy": {nn.Linear}, "state_dict_type": args.state_dict}
    if args.timeout_s is not None:
        kw["timeout"] = timedelta(seconds=args.timeout_s)
    callbacks = [RaiseAt(args.raise_on_rank)] if args.raise_on_rank is not None else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(**kw), max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    model = Net()
    try:
        trainer.fit(model, DataLoader(data, batch_size=8))
    except Exception:
        if args.linger_s and trainer.global_rank == args.raise_on_rank:
            print(f"rank {trainer.global_rank}: fit failed; lingering {args.linger_s:g} s", file=sys.stderr, flush=True)
            time.sleep(args.linger_s)
        raise
    ckpt = out / ("model.ckpt" if args.state_dict == "full" else "model_ckpt")
    trainer.save_checkpoint(ckpt)
    same, keys = None, []
    if args.state_dict == "full":  # the saved weights against the model's, gathered again
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.strategy.model, writeback=False):
            mine = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if trainer.is_global_zero:
            saved = torch.load(ckpt, weights_only=False)["state_dict"]
            keys = sorted(saved)
            same = sorted(saved) == sorted(mine) and all(torch.equal(saved[k], v) for k, v in mine.items())
    resumed = None
    if args.resume:  # the load path: model and optimizer state back from the file, 2 more steps
        again = pl.Trainer(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(**kw), max_steps=args.steps + 2,
                           logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False)
        again.fit(Net(), DataLoader(data, batch_size=8), ckpt_path=ckpt)
        resumed = again.global_step
    if trainer.is_global_zero:
        (out / "done.json").write_text(json.dumps({"saved_equals_model": same, "keys": keys,
                                                   "torch": torch.__version__, "step": trainer.global_step,
                                                   "resumed_step": resumed}))


if __name__ == "__main__":
    main()
