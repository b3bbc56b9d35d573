"""L-MSA on the offline digits shifts, side by side with the layer-selection baselines.

Design of ``../shared/seeds/004_*.txt`` (fig. 4 and table 1), scaled to CPU minutes:

* pre-train ``SmallResNet`` (blocks ``conv1+bn1+layer1 | layer2 | layer3 | fc``) on the clean
  ``source`` split of digits, one model per seed (the seed also draws the splits);
* (a) metric check: ``J_hat_n`` of every block, measured by ``LMSAStepper`` over the first
  epoch at the pre-trained weights, against (i) the true training loss after fine-tuning that
  block alone for one epoch (Adam) -- fig. 4 -- and (ii) the best loss one full-batch
  gradient step on that block can reach (line search over the step size: what ``J_hat``
  estimates, eq. 8 with the optimal ``rho*``); Spearman rank correlation per shift and seed,
  next to the same correlations for the relative gradient norm (``-RGN``: larger = preferred);
* (b) fine-tuning: full fine-tuning, Auto-RGN, LIFT (random order), LISA, L-MSA and the two
  ablations of fig. 6 (L-MSA metric + the module's Adam; MSA on all blocks), all for the same
  number of epochs with Adam; each method at its best learning rate of a small grid (the L-MSA
  variants use it as their inner Adam LR too), chosen -- like the epoch -- by target-validation
  accuracy (the paper's early stopping); target test accuracy reported.

Run: ``python benchmarks/lmsa_digits.py`` (about 5-10 CPU minutes; ``--quick`` for a smoke
run). Prints the tables and writes ``benchmarks/results/lmsa_digits.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

import lightning.pytorch as pl  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from lalr_lightning.callbacks.lmsa import LMSAStepper  # noqa: E402
from lalr_lightning.core.model.blocks import block_layers  # noqa: E402
from lalr_lightning.data.digits import DigitsDataModule  # noqa: E402
from lalr_lightning.models.cnn import SmallResNet  # noqa: E402

try:
    from lalr_lightning.callbacks.surgical import SurgicalLayerSelect  # noqa: E402
except ImportError:  # written by another helper; the baselines are skipped without it
    SurgicalLayerSelect = None


class EpochEval(pl.Callback):
    """Target validation and test accuracy after every training epoch (eval mode, restored)."""

    def __init__(self, dm):
        self.dm = dm
        self.val: list[float] = []
        self.test: list[float] = []

    @staticmethod
    def accuracy(model, loader) -> float:
        modes = {m: m.training for m in model.modules()}
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in loader:
                correct += int((model(x).argmax(1) == y).sum())
                total += len(y)
        for m, t in modes.items():
            m.training = t
        return correct / total

    def on_train_epoch_end(self, trainer, pl_module):
        self.val.append(self.accuracy(pl_module, self.dm.val_dataloader()))
        self.test.append(self.accuracy(pl_module, self.dm.test_dataloader()))

    def at_best_val(self) -> float:
        return self.test[int(np.argmax(self.val))]  # first best epoch


def train_loss(model, dm) -> float:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    total = n = 0.0
    with torch.no_grad():
        for x, y in dm.train_dataloader():
            total += float(F.cross_entropy(model(x), y, reduction="sum"))
            n += len(y)
    for m, t in modes.items():
        m.training = t
    return total / n


def fit(model, dm, callbacks, epochs):
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.fit(model, dm)
    return trainer


def make_model(state, lr, args):
    model = SmallResNet(width=args.width, blocks_per_group=args.blocks_per_group,
                        optimizer=partial(torch.optim.Adam, lr=lr))
    if state is not None:
        model.load_state_dict(state)
    return model


def target(shift, seed, args):
    dm = DigitsDataModule(shift=shift, severity=args.severity, split="target", train_n=args.train_n,
                          batch_size=args.batch_size, seed=seed)
    dm.setup("fit")
    return dm


def pretrain(seed, args):
    pl.seed_everything(seed, verbose=False)
    model = make_model(None, args.pretrain_lr, args)
    dm = DigitsDataModule(split="source", batch_size=64, seed=seed)
    fit(model, dm, [], args.pretrain_epochs)
    dm.setup("test")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, EpochEval.accuracy(model, dm.test_dataloader())


def best_step_loss(model, dm, block) -> tuple[float, float]:
    """(min over step sizes a of the full-batch training loss after theta_b - a grad_b L, the
    minimizing a = 1/rho*), in eval mode as the measurement: the greedy one-step optimum that
    J_hat estimates."""
    model.eval()
    data = [(x, y) for x, y in dm.train_dataloader()]
    params = list(block.params.values())
    grads = [torch.zeros_like(p) for p in params]
    n = sum(len(y) for _, y in data)
    for x, y in data:
        loss = F.cross_entropy(model(x), y, reduction="sum") / n
        for g, gi in zip(grads, torch.autograd.grad(loss, params)):
            g += gi
    orig = [p.detach().clone() for p in params]
    best = (math.inf, math.nan)
    with torch.no_grad():
        for a in np.logspace(-4, 3, 141):
            for p, p0, g in zip(params, orig, grads):
                p.copy_(p0 - a * g)
            best = min(best, (sum(float(F.cross_entropy(model(x), y, reduction="sum")) for x, y in data) / n, a))
        for p, p0 in zip(params, orig):
            p.copy_(p0)
    return best


def metric_vs_truth(state, shift, seed, args):
    """(names, J_hat, RGN, loss after one epoch on the block, best one-step loss, rho_hat / rho*)
    per block."""
    dm = target(shift, seed, args)
    n_batches = len(dm.train_dataloader())
    pl.seed_everything(seed, verbose=False)
    model = make_model(state, args.lr_grid[0], args)
    cb = LMSAStepper(update="optimizer", n_batches=n_batches, rho_scale=args.rho_scale)
    fit(model, dm, [cb], 1)  # measures over the whole epoch at the pre-trained weights
    names = list(cb.scores)
    epoch, step, ratio = {}, {}, {}
    for name in names:
        model = make_model(state, args.truth_lr, args)
        step[name], alpha = best_step_loss(model, dm, next(b for b in block_layers(model) if b.name == name))
        ratio[name] = cb.rho_hat[name] * alpha
        pl.seed_everything(seed, verbose=False)
        if SurgicalLayerSelect is not None:
            fit(model, dm, [SurgicalLayerSelect(mode="blocks", select=[name])], 1)
        else:
            for b in block_layers(model):
                for p in b.params.values():
                    p.requires_grad_(b.name == name)
            fit(model, dm, [], 1)
        epoch[name] = train_loss(model, dm)
    return names, cb.scores, cb.rgn, epoch, step, ratio


def methods(args):
    lmsa = dict(rho=args.rho, inner_steps=args.inner_steps, rho_scale=args.rho_scale,
                n_batches=args.selection_batches)
    m = {
        "full fine-tuning": lambda n, lr: [],
        "L-MSA": lambda n, lr: [LMSAStepper(inner_lr=lr, **lmsa)],
        "L-MSA metric + Adam": lambda n, lr: [LMSAStepper(update="optimizer", rho_scale=args.rho_scale,
                                                          n_batches=args.selection_batches)],
        "MSA on all blocks": lambda n, lr: [LMSAStepper(select="all", inner_lr=lr, **lmsa)],
    }
    if SurgicalLayerSelect is not None:
        m["Auto-RGN"] = lambda n, lr: [SurgicalLayerSelect(mode="auto_rgn")]
        m["LIFT (random)"] = lambda n, lr: [SurgicalLayerSelect(mode="lift", order="random", every_n_steps=n)]
        m["LISA"] = lambda n, lr: [SurgicalLayerSelect(mode="lisa", gamma=1, every_n_steps=n)]
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shifts", nargs="+", default=["label_flip", "input_transform", "gaussian_noise"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--severity", type=int, default=5)
    ap.add_argument("--train-n", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--blocks-per-group", type=int, default=1)
    ap.add_argument("--pretrain-epochs", type=int, default=15)
    ap.add_argument("--pretrain-lr", type=float, default=1e-2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr-grid", nargs="+", type=float, default=[1e-2, 1e-3],
                    help="Adam LRs tried for every method (L-MSA: its inner LR; the module's Adam too)")
    ap.add_argument("--truth-lr", type=float, default=1e-2, help="Adam LR of the one-epoch single-block runs in (a)")
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--rho", type=float, default=1.0)
    ap.add_argument("--rho-scale", type=float, default=1.0)
    ap.add_argument("--selection-batches", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one shift, one seed, 2 epochs, one LR")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lmsa_digits.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.shifts, args.seeds, args.epochs, args.pretrain_epochs = args.shifts[:1], args.seeds[:1], 2, 5
        args.lr_grid = args.lr_grid[:1]
    torch.set_num_threads(1)
    t0 = time.time()
    rows_a = []
    # (shift, method) -> per seed: (best val acc, its test acc, lr)
    res: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    picks: dict[str, list[str]] = {}
    for seed in args.seeds:
        state, src_acc = pretrain(seed, args)
        print(f"seed {seed}: pre-trained, source test acc {src_acc:.3f} ({time.time() - t0:.0f}s)", flush=True)
        for shift in args.shifts:
            rows_a.append((shift, seed, *metric_vs_truth(state, shift, seed, args)))
            dm = target(shift, seed, args)
            n = len(dm.train_dataloader())
            base = make_model(state, args.lr_grid[0], args)
            res.setdefault((shift, "no adaptation"), []).append(
                (EpochEval.accuracy(base, dm.val_dataloader()), EpochEval.accuracy(base, dm.test_dataloader()), 0.0))
            for label, make in methods(args).items():
                best = None
                for lr in args.lr_grid:
                    pl.seed_everything(seed, verbose=False)
                    model = make_model(state, lr, args)
                    ev = EpochEval(dm)
                    cbs = make(n, lr)
                    fit(model, dm, [*cbs, ev], args.epochs)
                    i = int(np.argmax(ev.val))
                    if best is None or ev.val[i] > best[0]:
                        best = (ev.val[i], ev.test[i], lr)
                        if label == "L-MSA":
                            pick = "+".join(b.replace("model.", "") for b in cbs[0].selected)
                res.setdefault((shift, label), []).append(best)
                if label == "L-MSA":
                    picks.setdefault(shift, []).append(pick)
            print(f"  {shift}: done ({time.time() - t0:.0f}s)", flush=True)
    elapsed = time.time() - t0
    text = report(args, rows_a, res, picks, elapsed)
    print("\n" + text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written: {out}")


def report(args, rows_a, res, picks, elapsed) -> str:
    lines = ["# L-MSA on digits shifts", "",
             f"`python benchmarks/lmsa_digits.py` -- SmallResNet (width {args.width}, {args.blocks_per_group} "
             f"BasicBlock per group; blocks conv1+bn1+layer1 | layer2 | layer3 | fc) pre-trained on the clean "
             f"source split ({args.pretrain_epochs} epochs), fine-tuned on the shifted target split "
             f"(train_n={args.train_n}, batch {args.batch_size}, severity {args.severity} for corruptions); seeds "
             f"{args.seeds} (each seed: its own splits and pre-training). Wall time {elapsed / 60:.1f} min, one "
             "CPU thread, on a shared machine.", "",
             "## (a) The metric vs the true loss (fig. 4)", "",
             "Spearman rank correlation over the 4 blocks (higher is better) between a metric and",
             f"- *1 epoch*: the training loss after fine-tuning that block alone for one epoch (Adam, lr "
             f"{args.truth_lr}, other blocks frozen, their BatchNorm in eval);",
             "- *best step*: the lowest training loss one full-batch gradient step on that block reaches "
             "(line search over the step size) -- the greedy one-step optimum `J_hat` approximates.",
             "`J_hat`: L-MSA, averaged over the first epoch's batches at the pre-trained weights (lower = "
             "preferred); `-RGN`: the block's ||g||/||theta||, negated (larger RGN = preferred).", "",
             "| shift | seed | J_hat~1 epoch | -RGN~1 epoch | J_hat~best step | -RGN~best step | L-MSA picks | "
             "RGN picks | best (1 epoch) | best (step) |", "|---|---|---|---|---|---|---|---|---|---|"]
    corr: dict[str, list[list[float]]] = {}
    for shift, seed, names, scores, rgn, epoch, step, _ in rows_a:
        c = []
        for truth in (epoch, step):
            t = [truth[k] for k in names]
            c += [spearmanr([scores[k] for k in names], t).statistic, spearmanr([-rgn[k] for k in names], t).statistic]
        c = [c[0], c[1], c[2], c[3]]
        corr.setdefault(shift, []).append(c)
        short = {k: k.replace("model.", "") for k in names}
        lines.append(f"| {shift} | {seed} | " + " | ".join(f"{v:+.2f}" for v in c) +
                     f" | {short[min(names, key=scores.get)]} | {short[max(names, key=rgn.get)]} | "
                     f"{short[min(names, key=epoch.get)]} | {short[min(names, key=step.get)]} |")
    lines += ["", "| shift | J_hat~1 epoch | -RGN~1 epoch | J_hat~best step | -RGN~best step |", "|---|---|---|---|---|"]
    allc = []
    for shift, v in corr.items():
        a = np.array(v, dtype=float)
        allc.append(a)
        lines.append(f"| {shift} (mean over seeds) | " + " | ".join(f"{x:+.2f}" for x in np.nanmean(a, 0)) + " |")
    a = np.concatenate(allc)
    lines.append("| all | " + " | ".join(f"{x:+.2f}" for x in np.nanmean(a, 0)) + " |")
    ratios = np.array([r[k] for *_, names, _s, _g, _e, _t, r in rows_a for k in names])
    lines += ["", "`rho_hat / rho*` (eq. 9 with rho_scale 1 over the line-searched optimum, all blocks, shifts "
              f"and seeds): median {np.median(ratios):.1f}, range {ratios.min():.1f} to {ratios.max():.1f}; "
              "for a deep linear network with squared loss Prop. 3.2 bounds it by d' = 10."]
    lines += ["", "Per-block values, first seed (J_hat, RGN, loss after 1 epoch, best one-step loss):", ""]
    for shift, seed, names, scores, rgn, epoch, step, _ in rows_a:
        if seed == args.seeds[0]:
            lines.append(f"- {shift}: " + "; ".join(
                f"{k.replace('model.', '')}: {scores[k]:.3f}, {rgn[k]:.2e}, {epoch[k]:.3f}, {step[k]:.3f}"
                for k in names))

    labels = [k for (s, k) in res if s == args.shifts[0]]
    ranked = [k for k in labels if k != "no adaptation"]
    ranks = {k: [] for k in ranked}
    for shift in args.shifts:
        means = {k: float(np.mean([t for _, t, _ in res[(shift, k)]])) for k in ranked}
        for k in ranked:
            ranks[k].append(1 + sum(means[j] > means[k] for j in ranked))
    lines += ["", "## (b) Target test accuracy (%) at the best target-validation epoch and LR (table 1 design)", "",
              f"{args.epochs} epochs, Adam in the module's optimizer at the LR of {args.lr_grid} with the best "
              f"validation accuracy (per method and seed); L-MSA and MSA-on-all: inner Adam at that LR, "
              f"{args.inner_steps} iterations per batch, rho {args.rho}, selection on the first "
              f"{args.selection_batches} batches; LIFT: one block per epoch, random order; LISA: 1 middle block "
              "per epoch. Mean +- std over seeds; rank of the mean per shift, averaged (1 = best; adaptation "
              "methods only).", "",
              "| method | " + " | ".join(args.shifts) + " | average rank |", "|---|" + "---|" * (len(args.shifts) + 1)]
    for k in labels:
        cells = []
        for s in args.shifts:
            t = [100 * t for _, t, _ in res[(s, k)]]
            cells.append(f"{np.mean(t):.1f} +- {np.std(t):.1f}")
        rank = f"{np.mean(ranks[k]):.2f}" if k in ranks else "-"
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {rank} |")
    lines += ["", "Chosen LR per method (per shift, seeds in order): " + "; ".join(
        f"{k}: " + ", ".join("/".join(f"{lr:g}" for _, _, lr in res[(s, k)]) for s in args.shifts)
        for k in ranked)]
    lines += ["", "Blocks L-MSA selected (per seed): " + "; ".join(f"{s}: {', '.join(v)}" for s, v in picks.items())]
    if SurgicalLayerSelect is None:
        lines += ["", "(lalr_lightning.callbacks.surgical was not importable: Auto-RGN, LIFT and LISA skipped)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
