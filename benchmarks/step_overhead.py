"""What each callback costs per optimizer step, on a model where a step is mostly Python.

A deep, thin network -- a 16 -> 64 stem, 24 residual blocks of two 64 x 64 ``Linear`` and a
64 -> 4 head (50 matrices, 100 tensors) -- trained with AdamW on batches of 4 for ``--steps``
optimizer steps in one epoch. On such a model a step is a few hundred small kernel launches, so
any per-parameter Python loop a callback runs around the step shows up as host time, which is
what a GPU step pays per callback.

Every variant runs ``--repeats`` times, interleaved in one process (none, callback 1, callback
2, ..., none, callback 1, ...), so a machine shared with other work slows all of them alike; the
ratios are against the no-callback run, each the best (lowest) of the repeats; a second
no-callback run, last in each round, shows how far two identical runs land apart. Per step the time
is taken between consecutive ``on_train_batch_start`` of a clock callback placed first (the first
step starts at its ``on_train_epoch_start``, the last ends at the ``on_train_epoch_end`` of a
clock placed last), so a decision taken at the start or end of the epoch falls in a step.

A *decision step* is one in which the callback called ``update`` (measured and decided) or, for
L-MSA, measured its blocks (``n_batches`` steps of states and co-states before each selection).
Printed per callback: the median time of its other steps / the no-callback median (its per-step
bookkeeping: the goal is at most 1.05), the decision steps' count and mean time / the no-callback
median, the callback's **own time** on those steps (the time spent inside its Lightning hooks and
inside the optimizer hooks of ``LayerControl``: masks, the stretch of the update, post-step
transforms) / the no-callback median, and the whole epoch / the no-callback epoch. The own time
tells the callback's work from what the method changes in the optimizer's arithmetic (a pruned
model's Adam state is zero at the masked entries, and a CPU's vectorised ``sqrt`` is about twice
as slow on zeros). The own time is split in two by one more run of each callback, whose torch
calls that read or write tensor data are timed (a ``TorchFunctionMode``; attribute reads, sizes
and views are not such calls): **tensor ops**, the arithmetic the method asks for (the pull
toward ``theta_0``, the stretch of the update, the masks), and **bookkeeping**, the rest (the
Python around them: the goal is at most 0.05x). L-MSA's Hamiltonian update (``update="msa"``:
the selected blocks move by its own inner optimizer after every step; the module's optimizer
trains nothing there) is the method's own computation: its time is shown apart, and the ratio
without it.

    python benchmarks/step_overhead.py                 # 300 steps, best of 3 (a few minutes)
    python benchmarks/step_overhead.py --steps 20 --repeats 1   # the quick mode the tests run
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

WIDTH, BLOCKS, IN, CLASSES, BATCH = 64, 24, 16, 4, 4
#: the process's CPU time (one torch thread, no loader workers: all of a step's work is counted, and
#: the time spent waiting for a core on a shared machine is not); ``--clock wall`` for wall time
CLOCK = time.process_time


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Deep(pl.LightningModule):
    """The thin network, one fixed random batch per step (no data loading in the timings)."""

    def __init__(self, steps: int, seed: int = 0, per_layer: bool = False):
        super().__init__()
        self.per_layer = per_layer
        torch.manual_seed(seed)
        self.stem = nn.Linear(IN, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, CLASSES)
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.randn(BATCH, IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
                     for _ in range(8)]
        self.steps = steps

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        data, steps = self.data, self.steps

        class Batches(torch.utils.data.Dataset):
            def __len__(self):
                return steps

            def __getitem__(self, i):
                return data[i % len(data)]

        return torch.utils.data.DataLoader(Batches(), batch_size=None)

    def configure_optimizers(self):
        if self.per_layer:  # one group per Linear, each its own LR: how the reference codes set per-layer LRs
            layers = [m for m in self.modules() if isinstance(m, nn.Linear)]
            return torch.optim.AdamW([{"params": list(m.parameters()), "lr": 1e-3 * (1 + i / 100)}
                                      for i, m in enumerate(layers)])
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


#: the baseline of the multiplier methods' optimizer cost: no callback, one AdamW group per layer
PER_LAYER = "none, one AdamW group per layer"
#: no callback again, run last in each round: how far apart two identical runs come out (the noise floor)
AGAIN = "none, again (the noise floor)"
#: the callbacks that give layers their own LR (the optimizer then steps once per distinct LR)
SPLITS = ("TempBalance", "LALR", "AutoRGN", "LayerLRMultiplier")


def variants(steps: int) -> dict[str, callable]:
    """name -> a factory of the callback (None: no callback). Every 50 steps is every
    ``max(steps // 6, 1)`` steps in a shorter run, so it still decides several times."""
    from lalr_lightning.callbacks import (
        AutoRGN,
        HTSRPruning,
        LALRScheduleCallback,
        LayerLRMultiplier,
        LMSAStepper,
        ProximalRegularizer,
        TempBalanceCallback,
    )

    every = 50 if steps >= 300 else max(steps // 6, 1)
    return {
        "none": lambda: None,
        PER_LAYER: lambda: None,
        "ProximalRegularizer (lam=1)": lambda: ProximalRegularizer(lam=1.0, every_n_epochs=None),
        "LMSAStepper (update=\"msa\")": lambda: LMSAStepper(update="msa", n_batches=2),
        "HTSRPruning (masks after every step)": lambda: HTSRPruning(target_sparsity=0.3),
        f"TempBalance every {every} steps": lambda: TempBalanceCallback(every_n_steps=every),
        "LALR (one decision)": lambda: LALRScheduleCallback(),
        "AutoRGN": lambda: AutoRGN(n_batches=2),
        "LayerLRMultiplier": lambda: LayerLRMultiplier({"blocks.*": 0.5, "head": 2.0}),
        "TempBalance every epoch (one decision)": lambda: TempBalanceCallback(),
        AGAIN: lambda: None,
    }


#: Lightning's hooks a callback can run on a training step
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")


#: torch calls that read no tensor data: attribute reads, sizes, views, the grad mode
NO_DATA = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "element_size", "data_ptr", "is_contiguous", "stride",
    "storage_offset", "untyped_storage", "is_floating_point", "detach", "view", "view_as", "reshape", "unbind",
    "split", "flatten", "unsqueeze", "squeeze", "expand", "expand_as", "t", "as_strided", "__getitem__",
    "__len__", "__iter__", "__hash__", "requires_grad_", "_set_grad_enabled", "promote_types",
})


class TensorOps(TorchFunctionMode):
    """Adds the time spent inside torch calls that read or write tensor data (the arithmetic a
    callback asks for) to ``clock.ops``; its own dispatch is outside the timed window."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in NO_DATA:
            return func(*args, **(kwargs or {}))
        t = CLOCK()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.clock._ops += CLOCK() - t


class Clock(Callback):
    """Per-step wall times, which steps the watched callback decided in, and the time spent in
    its own code on each step (its step hooks and LayerControl's optimizer hooks)."""

    def __init__(self, watched, count_ops: bool = False):
        self.watched = watched
        self.count_ops = count_ops  # also time the tensor operations inside the own code (TensorOps)
        self.marks: list[float] = []
        self.deciding: list[bool] = []
        self.own: list[float] = []
        self.ops: list[float] = []
        self._own = self._ops = 0.0
        self._depth = 0
        self._decided = False
        self.outside = 0  # decisions taken outside the epoch's steps (at fit start)
        if watched is not None:
            inner = watched.conclude

            def conclude(*a, **k):
                self._decided = True
                self.outside += not self.marks
                return inner(*a, **k)

            watched.conclude = conclude
            for hook in STEP_HOOKS:
                if getattr(type(watched), hook) is not getattr(Callback, hook):
                    setattr(watched, hook, self.timed(getattr(watched, hook)))

    def timed(self, fn):
        def run(*a, **k):
            if self._depth:  # a hook inside another: counted there
                return fn(*a, **k)
            self._depth += 1
            t = CLOCK()
            try:
                if not self.count_ops:
                    return fn(*a, **k)
                with TensorOps(self):
                    return fn(*a, **k)
            finally:
                self._own += CLOCK() - t
                self._depth -= 1

        return run

    def mark(self) -> None:
        self.marks.append(CLOCK())
        if len(self.marks) > 1:  # the step that just ended
            self.deciding.append(self._decided or getattr(self.watched, "_measuring", False))
            self.own.append(self._own)
            self.ops.append(self._ops)
        self._own = self._ops = 0.0
        self._decided = getattr(self.watched, "_measuring", False)

    def on_train_epoch_start(self, trainer, pl_module):
        self.mark()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx > 0:
            self.mark()
        elif getattr(self.watched, "_measuring", False):
            self._decided = True


class End(Callback):
    def __init__(self, clock):
        self.clock = clock

    def on_train_epoch_end(self, trainer, pl_module):
        self.clock.mark()


def run(factory, steps: int, accelerator: str = "cpu", per_layer: bool = False, count_ops: bool = False) -> dict:
    cb = factory()
    clock = Clock(cb, count_ops)
    msa = []
    if cb is not None and hasattr(cb, "_msa_update"):  # L-MSA's Hamiltonian update, timed apart
        inner = cb._msa_update

        def timed(*a, **k):
            t, ops = CLOCK(), clock._ops
            inner(*a, **k)
            msa.append(CLOCK() - t)
            clock._ops = ops  # its arithmetic is the update's, not the bookkeeping's

        cb._msa_update = timed
    cbs = [clock] + ([cb] if cb is not None else []) + [End(clock)]
    from lalr_lightning.core.runtime.control import LayerControl

    # LayerControl's work inside the optimizer step (bound when a controller is made: patched on the class)
    saved = {k: getattr(LayerControl, k) for k in ("_engage", "_after_step")}
    for k, fn in saved.items():
        setattr(LayerControl, k, lambda self, *a, _fn=fn, **kw: clock.timed(_fn)(self, *a, **kw))
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=cbs)
    try:
        trainer.fit(Deep(steps, per_layer=per_layer))
    finally:
        for k, fn in saved.items():
            setattr(LayerControl, k, fn)
    times = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    assert len(times) == steps == len(clock.deciding), (len(times), steps, len(clock.deciding))
    return {"times": times, "deciding": clock.deciding, "msa": msa, "outside": clock.outside, "own": clock.own,
            "ops": clock.ops if count_ops else None}


def _where(accelerator: str) -> str:
    return torch.cuda.get_device_name() if accelerator == "gpu" else "CPU"


def summarize(runs: list[dict]) -> dict:
    """Best (lowest) over the repeats of: the median non-decision step (robust to the spikes of a
    shared machine), the mean decision step, the whole epoch, the median Hamiltonian update."""
    out = {"other": [], "decide": [], "total": [], "msa": [], "own": [], "n_decide": 0, "outside": 0}
    for r in runs:
        other = [t for t, d in zip(r["times"], r["deciding"]) if not d]
        own = [t for t, d in zip(r["own"], r["deciding"]) if not d]
        out["own"].append(statistics.median(own) if own else float("nan"))
        dec = [t for t, d in zip(r["times"], r["deciding"]) if d]
        out["n_decide"] = len(dec)
        out["outside"] = r["outside"]
        out["other"].append(statistics.median(other) if other else float("nan"))
        out["decide"].append(statistics.fmean(dec) if dec else float("nan"))
        out["total"].append(sum(r["times"]))
        # the update of the non-decision steps (a measuring step's update is part of its decision)
        out["msa"].append(statistics.median(r["msa"]) if r["msa"] else 0.0)
    return {k: (min(v) if isinstance(v, list) else v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (one epoch)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of every variant; the best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the host-side cost, steadily)")
    ap.add_argument("--only", nargs="*", default=None, help="substrings of the variants to run (none always runs)")
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"],
                    help="the process's CPU time (steady on a shared machine) or wall time")
    ap.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"],
                    help="gpu: the same steps on CUDA, where a step's host time is what the GPU waits for "
                         "(use --clock wall)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    table = variants(args.steps)
    if args.only:
        table = {k: v for k, v in table.items()
                 if k in ("none", PER_LAYER, AGAIN) or any(s.lower() in k.lower() for s in args.only)}
    got: dict[str, list[dict]] = {k: [] for k in table}
    for _ in range(args.repeats):
        for name, factory in table.items():  # interleaved: one of each, then again
            got[name].append(run(factory, args.steps, args.accelerator, per_layer=name == PER_LAYER))
    stats = {k: summarize(v) for k, v in got.items()}
    # one more run of each callback with its tensor operations timed (TensorOps' dispatch would
    # weigh on the timed runs' own time): the own time's arithmetic, the rest is bookkeeping
    for name, factory in table.items():
        if name not in ("none", PER_LAYER, AGAIN):
            r = run(factory, args.steps, args.accelerator, count_ops=True)
            stats[name]["ops"] = statistics.median(o for o, d in zip(r["ops"], r["deciding"]) if not d)
    base = stats["none"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {BLOCKS} residual blocks of two "
          f"{WIDTH}x{WIDTH} Linear (50 matrices), batch {BATCH}, AdamW, {args.steps} steps, best of {args.repeats}, "
          f"interleaved in one process, {args.clock} time, {_where(args.accelerator)}")
    print(f"no callback: {1e3 * base['other']:.3f} ms per step, {base['total']:.2f} s per epoch")
    groups = stats.get(PER_LAYER)
    head = (f"| {'callback':40s} | {'other steps / none':>18s} | {'own time / none':>15s} | "
            f"{'tensor ops / none':>17s} | {'bookkeeping / none':>18s} | {'/ per-layer groups':>18s} | "
            f"{'decision steps':>22s} | "
            f"{'decision step / none':>20s} | {'epoch / none':>12s} | {'msa update ms':>13s} |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    rows = []
    for name, s in stats.items():
        if name == "none":
            continue
        row = {"callback": name, "other": s["other"] / base["other"], "n_decide": s["n_decide"],
               "own": s["own"] / base["other"],
               "ops": s.get("ops", float("nan")) / base["other"],
               "bookkeeping": (s["own"] - s["msa"] - s.get("ops", float("nan"))) / base["other"],
               "outside": s["outside"],
               "decide": s["decide"] / base["other"], "total": s["total"] / base["total"], "msa_ms": 1e3 * s["msa"]}
        if s["msa"]:
            # the callback's own bookkeeping: its other steps less the Hamiltonian update
            row["other_without_msa"] = (s["other"] - s["msa"]) / base["other"]
        per_layer = "-"
        if groups is not None and any(k in name for k in SPLITS):  # the optimizer runs once per layer's LR
            row["other_per_layer"] = s["other"] / groups["other"]
            per_layer = f"{row['other_per_layer']:.3f}x"
        rows.append(row)
        other = f"{row['other']:.3f}x"
        if "other_without_msa" in row:
            other = f"{row['other_without_msa']:.3f}x + msa"
        dec = f"{row['decide']:.1f}x" if s["n_decide"] else "-"
        msa = f"{row['msa_ms']:.3f}" if s["msa"] else "-"
        n = f"{s['n_decide']}" + (f" (+{s['outside']} at fit start)" if s["outside"] else "")
        own = ops = keep = "-"
        if name not in (PER_LAYER, AGAIN):
            own, ops, keep = f"{row['own']:.3f}x", f"{row['ops']:.3f}x", f"{row['bookkeeping']:.3f}x"
        if "other_without_msa" in row:  # the Hamiltonian update runs inside its hooks
            own = f"{(s['own'] - s['msa']) / base['other']:.3f}x + msa"
        print(f"| {name:40s} | {other:>18s} | {own:>15s} | {ops:>17s} | {keep:>18s} | {per_layer:>18s} | {n:>22s} | {dec:>20s} | {row['total']:11.3f}x | {msa:>13s} |",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
