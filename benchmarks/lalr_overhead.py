"""What LALR adds to an epoch: its per-epoch metric computation against one training epoch.

Two workloads, both on random / generated data so the script runs offline:

* ``minilm``: full fine-tuning of the packaged MiniLM-L6 (``TextClassifier("minilm-l6")``,
  AdamW) on a generated two-class text set (``--text-n`` examples, padded to ``--max-length``
  tokens, batch 32). LALR measures all 41 weight matrices, the 30522 x 384 word embedding
  included.
* ``resnet18``: timm ResNet-18 with the CIFAR stem (``ImageClassifier``, 100 classes, SGD) on
  ``--image-n`` random 32 x 32 images, batch 64.

For each it reports, wall-clock and process CPU seconds (on a shared machine CPU time is the
steadier number):

* ``epoch``: one training epoch without LALR (Lightning ``fit``, no validation, no logger);
* ``metrics``: what the callback computes at each epoch start -- ``lalr_metrics`` of the
  trainable layers plus the multipliers -- best of ``--repeats``, for ``groups="shape"`` and
  ``groups="histogram"``;
* ``epoch+LALR``: the same epoch with ``LALRScheduleCallback`` (metrics at the epoch start and
  the per-layer LR split at every step);

and the ratios ``metrics / epoch`` and ``epoch+LALR / epoch``. The same epochs are also rebuilt from
their steps -- the epoch-start interval (where LALR decides) plus the median step times the
number of steps -- which leaves out the spikes that make two identical epochs differ by several
per cent on a shared host. Real epochs are far longer than
these few hundred examples (SST-2 has 67k sentences, CIFAR-100 50k images) while the metric
cost does not depend on the data, so the real overhead is smaller by that factor.

    python benchmarks/lalr_overhead.py --threads 1
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lalr_lightning.callbacks.lalr import LALRScheduleCallback  # noqa: E402
from lalr_lightning.core.spectral.lalr_metrics import lalr_metrics, lalr_multipliers  # noqa: E402


class EpochClock(Callback):
    """Wall and CPU seconds of the training epoch, from its start hooks to its end, and the wall
    time between consecutive batch starts (the first interval holds the epoch-start work, an
    LALR decision included)."""

    def on_train_epoch_start(self, trainer, pl_module):
        self.t0 = (time.perf_counter(), time.process_time())
        self.marks = [self.t0[0]]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx > 0:
            self.marks.append(time.perf_counter())

    def on_train_epoch_end(self, trainer, pl_module):
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.synchronize()  # the epoch's kernels are part of its time
        self.wall = time.perf_counter() - self.t0[0]
        self.cpu = time.process_time() - self.t0[1]
        self.marks.append(time.perf_counter())
        self.steps = [b - a for a, b in zip(self.marks, self.marks[1:])]


ACCELERATOR = "cpu"


def one_epoch(make_model, loader, extra=()) -> tuple[float, float, list[float]]:
    """(wall, cpu, per-step wall times) of one training epoch of a fresh model. The clock callback
    goes first, so an LALR callback's epoch-start work is inside the measured time."""
    clock = EpochClock()
    trainer = pl.Trainer(max_epochs=1, accelerator=ACCELERATOR, devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[clock, *extra])
    trainer.fit(make_model(), train_dataloaders=loader)
    return clock.wall, clock.cpu, clock.steps


def by_medians(runs: list[tuple]) -> float:
    """An epoch's wall time rebuilt from its steps, the spikes of a shared machine left out: its
    first interval (the epoch-start work) plus the median of the others times their count; the
    best over the runs."""
    return min(steps[0] + statistics.median(steps[1:]) * (len(steps) - 1) for _, _, steps in runs)


def per_layer_groups(model):
    """The model's own optimizer, with one parameter group per weight matrix (its bias with it) and
    one for the rest: the optimizer steps once per group, as under LALR's per-layer LRs, with no
    callback (how the reference code sets per-layer LRs)."""
    make = model.optimizer_fn

    def grouped(params):
        owned = [list(m.parameters(recurse=False)) for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
        seen = {id(p) for ps in owned for p in ps}
        rest = [p for p in model.parameters() if id(p) not in seen]
        return make([{"params": ps} for ps in owned + [rest] if ps])

    model.optimizer_fn = grouped
    return model


def metrics_cost(model, groups: str, repeats: int) -> tuple[float, float]:
    best_w = best_c = float("inf")
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        df = lalr_metrics(model, groups=groups, trainable_only=True)
        lalr_multipliers(df, phase="svd")
        best_w, best_c = min(best_w, time.perf_counter() - w), min(best_c, time.process_time() - c)
    return best_w, best_c


def text_loader(n: int, max_length: int) -> DataLoader:
    from transformers import AutoTokenizer

    from lalr_lightning.text_assets import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    rng = random.Random(0)
    words = "good bad great awful fine dull film plot cast scene story music long short".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(n)]
    enc = tok(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    labels = torch.tensor([i % 2 for i in range(n)])
    rows = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
             "token_type_ids": enc["token_type_ids"][i], "labels": labels[i]} for i in range(n)]
    return DataLoader(rows, batch_size=32, shuffle=True)


def image_loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 100, (n,), generator=g)),
                      batch_size=64, shuffle=True)


def report(name: str, make_model, loader, repeats: int, epochs: int = 1) -> None:
    if ACCELERATOR == "gpu":
        one_epoch(make_model, loader)  # warm-up: CUDA context, cuDNN's choice of kernels
    arms = {"none": lambda: one_epoch(make_model, loader),
            "lalr": lambda: one_epoch(make_model, loader, [LALRScheduleCallback()]),
            "groups": lambda: one_epoch(lambda: per_layer_groups(make_model()), loader),
            "again": lambda: one_epoch(make_model, loader)}  # no LALR again: the noise floor
    runs: dict[str, list] = {k: [] for k in arms}
    order = list(arms)
    for r in range(epochs):  # interleaved, each round in another order; the best of each counts
        for k in order[r % len(order):] + order[:r % len(order)]:
            runs[k].append(arms[k]())
    epoch = min(runs["none"])
    with_cb = min(runs["lalr"])
    split = min(runs["groups"])
    model = make_model().to("cuda" if ACCELERATOR == "gpu" else "cpu")
    print(f"\n{name}: {len(loader)} steps per epoch")
    print(f"  {'':28s} {'wall s':>8s} {'cpu s':>8s} {'wall ratio':>11s} {'cpu ratio':>10s}")
    print(f"  {'one epoch':28s} {epoch[0]:8.2f} {epoch[1]:8.2f}")
    for groups in ("shape", "histogram"):
        m = metrics_cost(model, groups, repeats)
        print(f"  {'metrics, groups=' + groups:28s} {m[0]:8.2f} {m[1]:8.2f} {m[0] / epoch[0]:11.3f} {m[1] / epoch[1]:10.3f}")
    print(f"  {'one epoch with LALR':28s} {with_cb[0]:8.2f} {with_cb[1]:8.2f} "
          f"{with_cb[0] / epoch[0]:11.3f} {with_cb[1] / epoch[1]:10.3f}")
    print(f"  {'one group per layer, no LALR':28s} {split[0]:8.2f} {split[1]:8.2f} "
          f"{split[0] / epoch[0]:11.3f} {split[1] / epoch[1]:10.3f}")
    again = min(runs["again"])
    print(f"  {'no LALR again (noise floor)':28s} {again[0]:8.2f} {again[1]:8.2f} "
          f"{again[0] / epoch[0]:11.3f} {again[1] / epoch[1]:10.3f}")
    print(f"  {'LALR / one group per layer':28s} {'':8s} {'':8s} {with_cb[0] / split[0]:11.3f} "
          f"{with_cb[1] / split[1]:10.3f}")
    # the same arms from their step times (median step x steps + the epoch-start interval)
    med = {k: by_medians(v) for k, v in runs.items()}
    print(f"  by median steps (wall s):    none {med['none']:.2f}, again {med['again']:.2f} "
          f"({med['again'] / med['none']:.3f}x), LALR {med['lalr']:.2f} ({med['lalr'] / med['none']:.3f}x), "
          f"one group per layer {med['groups']:.2f} ({med['groups'] / med['none']:.3f}x)")
    first = {k: min(r[2][0] for r in v) for k, v in runs.items()}
    print(f"  epoch-start interval (s):    none {first['none']:.3f}, LALR {first['lalr']:.3f} "
          f"(its decision: {first['lalr'] - first['none']:.3f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["minilm", "resnet18"], choices=["minilm", "resnet18"])
    ap.add_argument("--text-n", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--image-n", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs with and without LALR, interleaved; the best of each counts")
    args = ap.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    where = torch.cuda.get_device_name() if ACCELERATOR == "gpu" else "CPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {where}")
    if "minilm" in args.workloads:
        from lalr_lightning.models.text import TextClassifier

        report("MiniLM-L6 full fine-tune", lambda: TextClassifier("minilm-l6"),
               text_loader(args.text_n, args.max_length), args.repeats, args.epochs)
    if "resnet18" in args.workloads:
        from lalr_lightning.models.image import ImageClassifier

        report("ResNet-18 (CIFAR stem, 100 classes)",
               lambda: ImageClassifier("resnet18", num_classes=100, cifar_stem=True), image_loader(args.image_n),
               args.repeats, args.epochs)


if __name__ == "__main__":
    main()
