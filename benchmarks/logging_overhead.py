"""What the dashboards cost, side by side: the same TempBalance fit with no logger and with each
logger and ``figures`` setting, and the cost of a decision itself.

Two workloads:

* ``quickstart``: ``configs/quickstart.yaml``'s SmallCNN (width 32) on scikit-learn's digits,
  TempBalance every epoch, 10 epochs (10 decisions, 3 balanced layers);
* ``resnet18``: a short run, timm's ResNet-18 (10 classes) on random 32x32 images, 6 optimizer
  steps, TempBalance every 2 steps (3 decisions, 19 balanced layers), like the run of issue 26.

Arms: ``none`` (``logger=False``), ``csv``, then TensorBoard and offline W&B with
``figures="never"`` (scalars and decision tables), ``"first_last"`` (ESD plots of the first and
last decision, heatmap at the last) and ``"every"`` (ESD plots and heatmap at every decision).
Each fit is timed from the first callback's ``on_fit_start`` to the last one's ``on_fit_end``
(W&B's process start-up and shut-down are outside it), and inside it the time the dashboards take
(``LayerwiseCallback._publish``: tables, heatmaps, ESD plots, settings, summary). A *decision* is
TempBalance's own ``update`` without the dashboards (measure, decide, apply, record, scalars).
Printed per arm: seconds per fit and its ratio to ``none``; the dashboards' seconds per fit, per
decision, and per decision as a multiple of a decision of the same fit. The dashboards' share is
measured inside each fit, so it holds on a loaded machine where the fit times, compared across
fits, move by tens of percent. Arms are interleaved within each repeat; medians over repeats.

    python benchmarks/logging_overhead.py [--repeats 3] [--workloads quickstart resnet18] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", MPLBACKEND="Agg", HF_HUB_OFFLINE="1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lalr_lightning.callbacks import TempBalanceCallback  # noqa: E402

ARMS = ("none", "csv", "tensorboard:never", "tensorboard:first_last", "tensorboard:every",
        "wandb:never", "wandb:first_last", "wandb:every")


class _Clock(Callback):
    def __init__(self, marks: dict, which: str):
        self.marks, self.which = marks, which

    def on_fit_start(self, trainer, pl_module):
        if self.which == "start":
            self.marks["start"] = time.perf_counter()

    def on_fit_end(self, trainer, pl_module):
        if self.which == "end":
            self.marks["end"] = time.perf_counter()


class _Timed(TempBalanceCallback):
    """TempBalance that times its decisions (``update``) and its dashboards (``_publish``)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.update_s: list[float] = []
        self.publish_s: list[float] = []

    def update(self, trainer, pl_module):
        t0, published = time.perf_counter(), sum(self.publish_s)
        try:
            return super().update(trainer, pl_module)
        finally:  # the decision alone: what its own dashboards took is counted apart
            self.update_s.append(time.perf_counter() - t0 - (sum(self.publish_s) - published))

    def _publish(self, trainer, event, decision=None):
        t0 = time.perf_counter()
        try:
            return super()._publish(trainer, event, decision)
        finally:
            self.publish_s.append(time.perf_counter() - t0)


class _ResNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        import timm

        torch.manual_seed(0)
        self.net = timm.create_model("resnet18", num_classes=10)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _workload(name: str):
    """(module, datamodule or loader, Trainer arguments)."""
    if name == "quickstart":
        from lalr_lightning.data import DigitsDataModule
        from lalr_lightning.models import SmallCNN

        torch.manual_seed(0)
        return SmallCNN(width=32, in_channels=1), DigitsDataModule(batch_size=64), dict(max_epochs=10,
                                                                                       log_every_n_steps=5)
    if name == "resnet18":
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(48, 3, 32, 32, generator=g), torch.randint(0, 10, (48,), generator=g))
        return _ResNet(), DataLoader(data, batch_size=8), dict(max_steps=6, log_every_n_steps=1,
                                                               limit_val_batches=0)
    raise ValueError(f"unknown workload {name!r}; valid: quickstart, resnet18")


def _callback(workload: str, figures: str) -> _Timed:
    if workload == "resnet18":
        return _Timed(figures=figures, every_n_steps=2)
    return _Timed(figures=figures)


def _logger(arm: str, work: Path):
    kind = arm.split(":")[0]
    if kind == "none":
        return False
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(str(work), name="csv")
    if kind == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        return TensorBoardLogger(str(work), name="tb")
    from lightning.pytorch.loggers import WandbLogger

    return WandbLogger(save_dir=str(work), project="overhead")


def run(workload: str, arm: str, work: Path) -> tuple[float, list[float], float]:
    """(seconds of the fit, seconds of each decision, seconds of the dashboards) of one fit."""
    model, data, opts = _workload(workload)
    figures = arm.split(":")[1] if ":" in arm else "never"
    tb = _callback(workload, figures)
    marks: dict = {}
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=_logger(arm, work), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[_Clock(marks, "start"), tb, _Clock(marks, "end")], **opts)
    trainer.fit(model, data)
    if arm.startswith("wandb"):
        import wandb

        wandb.finish()
    return marks["end"] - marks["start"], tb.update_s, sum(tb.publish_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fits per arm (medians are shown)")
    p.add_argument("--workloads", nargs="+", default=["quickstart", "resnet18"])
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging intervals, every fit
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["WANDB_DIR"] = tmp
        os.chdir(tmp)  # Lightning's and W&B's side files stay in the temporary directory
        for workload in args.workloads:
            fits: dict[str, list[float]] = {a: [] for a in args.arms}
            dashboards: dict[str, list[float]] = {a: [] for a in args.arms}
            decisions: dict[str, list[float]] = {a: [] for a in args.arms}
            n_dec = 0
            for r in range(args.repeats):
                for arm in args.arms:  # interleaved
                    fit, dec, dash = run(workload, arm, Path(tmp) / f"{workload}-{r}-{arm.replace(':', '-')}")
                    fits[arm].append(fit)
                    dashboards[arm].append(dash)
                    decisions[arm].append(statistics.median(dec))
                    n_dec = len(dec)
            base = statistics.median(fits[args.arms[0]])
            print(f"\n{workload}: {n_dec} decision(s) per fit, {args.repeats} fit(s) per arm (medians); "
                  f"a decision takes {statistics.median(decisions[args.arms[0]]):.3f} s ({args.arms[0]})")
            print(f"{'arm':<24}{'fit s':>8}{'vs ' + args.arms[0]:>9}{'dashboards s':>14}{'per decision':>14}"
                  f"{'x a decision':>14}")
            for arm in args.arms:
                f, d = statistics.median(fits[arm]), statistics.median(dashboards[arm])
                shares = [dash / max(n_dec, 1) / dec for dash, dec in zip(dashboards[arm], decisions[arm])]
                print(f"{arm:<24}{f:>8.2f}{f / base:>9.2f}{d:>14.3f}{d / max(n_dec, 1):>14.3f}"
                      f"{statistics.median(shares):>14.2f}")

if __name__ == "__main__":
    main()
