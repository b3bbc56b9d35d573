"""Tiny modules and data shared by the tests (module level, so ddp_spawn can pickle them)."""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_trainer(callbacks: Iterable = (), **kw) -> pl.Trainer:
    """A quiet one-CPU Trainer: no logger, checkpoints, progress bar or summary unless asked."""
    opts = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False)
    opts.update(kw)
    return pl.Trainer(callbacks=list(callbacks), **opts)


def make_data(n: int = 64, d: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class ToyMLP(pl.LightningModule):
    """A 4-matrix MLP; ``opt`` and ``sched`` name the optimizer and scheduler to build."""

    def __init__(self, d: int = 16, width: int = 64, classes: int = 4, opt: str = "sgd", sched: str | None = None,
                 lr: float = 0.05, n: int = 64, batch_size: int = 8, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes),
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def train_dataloader(self):
        return DataLoader(make_data(self.hparams.n, self.hparams.d, self.hparams.classes, self.hparams.seed),
                          batch_size=self.hparams.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(make_data(32, self.hparams.d, self.hparams.classes, 99), batch_size=16)

    def configure_optimizers(self):
        h = self.hparams
        if h.opt == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=h.lr, momentum=0.9, weight_decay=1e-3)
        elif h.opt == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=h.lr, weight_decay=1e-2)
        elif h.opt == "adamw_groups":  # two groups: no weight decay on biases
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
            opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=h.lr)
        else:
            raise ValueError(h.opt)
        if h.sched is None:
            return opt
        if h.sched == "lambda":
            s = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
        elif h.sched == "step":
            s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
        elif h.sched == "cosine":
            s = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3)
        elif h.sched == "onecycle":
            s = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=h.lr, total_steps=200)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}
        elif h.sched == "plateau":
            s = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "monitor": "train_loss_epoch"}}
        elif h.sched == "sequential":
            a = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2)
            b = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
            s = torch.optim.lr_scheduler.SequentialLR(opt, [a, b], milestones=[2])
        else:
            raise ValueError(h.sched)
        return {"optimizer": opt, "lr_scheduler": s}


class MemLogger(Logger):
    """Keeps every logged row ``(step, metrics)`` in memory (rank zero only, like real loggers)."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "mem"

    @property
    def version(self):
        return 0

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        pass


class DeepLinear(nn.Module):
    """``x_{n+1} = theta_n x_n`` (L-MSA's sec. 3 network), float64, no biases."""

    def __init__(self, dims=(5, 6, 4, 3), seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:])])
        self.double()

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
