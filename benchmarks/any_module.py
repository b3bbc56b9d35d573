"""Issue 24, measured: every callback on five LightningModules written without glue, and the cost
of NTKDiagnostics' default on a small language model.

* ``--part ntk``: the issue's LM (a LLaMA of 4 layers, hidden 128, vocabulary 500, sequences of
  32 tokens, dict batches, ``training_step`` returning ``self.model(**batch).loss``; about 0.7 M
  parameters, the issue's was 0.78 M). A one-step fit with ``NTKDiagnostics()`` (its defaults:
  16 probe samples, each at its last real token, the vocabulary projected onto random directions
  when ``J`` would exceed ``ntk.DEFAULT_BUDGET``) against the same fit without it, side by side,
  on ``--threads`` CPU threads (2: the issue's bound is 30 s on 2 cores); also the size of what the
  issue ran (every position and every vocabulary entry), from ``ntk.ntk_cost``, not run.
* ``--part table``: each callback with its defaults (LISA/LIFT switching every 2 steps) fits 6
  steps on each module of ``tests/_anymodule.py``; the table says whether it ran and the first
  thing it warned.

    python benchmarks/any_module.py                 # both parts
    python benchmarks/any_module.py --part ntk --repeats 3

Writes ``benchmarks/results/any_module.md``. Timings on a shared machine are noisy: the two arms
run alternately in one process, the table gives each run, and the NTK's measurements come with the
process's CPU time (on 2 threads about twice the wall time an idle 2-core machine would take).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/_anymodule.py holds the five modules
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lalr_lightning.callbacks import NTKDiagnostics  # noqa: E402
from lalr_lightning.core.linearization import ntk  # noqa: E402
from lalr_lightning.core.model.batch_loss import split_batch  # noqa: E402
from lalr_lightning.core.model.probe import fixed_batch  # noqa: E402
from tests._anymodule import MODULES, HFCausalLM, callbacks  # noqa: E402
from tests._toys import make_trainer  # noqa: E402


def issue_lm() -> HFCausalLM:
    return HFCausalLM(layers=4, hidden=128, vocab=500, length=32)


def _fit(cbs, module, steps: int = 1) -> float:
    start = time.perf_counter()
    make_trainer(cbs, max_steps=steps, limit_val_batches=0).fit(module)
    return time.perf_counter() - start


class TimedNTK(NTKDiagnostics):
    """NTKDiagnostics with each measurement timed: the first is the one in ``on_train_start``
    (where the issue saw 8+ minutes), its cost estimate and output choice included."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def update(self, trainer, pl_module):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return super().update(trainer, pl_module)
        finally:
            self.seconds.append((time.perf_counter() - start, time.process_time() - cpu))


def part_ntk(repeats: int) -> list[str]:
    module = issue_lm()
    params = sum(p.numel() for p in module.parameters())
    x, _ = split_batch(module, fixed_batch(module.train_dataloader(), 16))
    trainable = {n: p.detach() for n, p in module.named_parameters()}
    everything = ntk.ntk_cost(module, x, trainable, positions="all", outputs="all")
    rows = []
    for i in range(repeats):
        base = _fit([], issue_lm())
        diag = TimedNTK()
        with_ntk = _fit([diag], issue_lm())
        load = os.getloadavg()[0]  # other work on the machine during the run (1-minute average)
        rows.append((i, base, with_ntk, diag.seconds, diag._chosen, diag.kappa, load))
        print(f"run {i}: fit without {base:.2f} s, with NTKDiagnostics {with_ntk:.2f} s, measurements (wall, cpu) "
              f"{[(round(a, 2), round(b, 2)) for a, b in diag.seconds]} s, outputs {diag._chosen}, "
              f"kappa {diag.kappa:.4g}, load average {load:.1f}", flush=True)
    out = [f"## NTKDiagnostics() on the issue's LM ({params:,} parameters, {torch.get_num_threads()} threads)", "",
           f"- what the issue ran (every position, every vocabulary entry; estimated, not run): {everything.describe()}",
           "- the default: each sample at its last real token; the 500 outputs projected onto as many random "
           f"directions as fit in ntk.DEFAULT_ENTRIES = {ntk.DEFAULT_ENTRIES:.3g} Jacobian entries", "",
           "| run | fit, 1 step, without (s) | with NTKDiagnostics() (s) | on_train_start measurement, estimate "
           "included: wall s (CPU s of the process) | epoch-end measurement: wall (CPU) | directions chosen | kappa | "
           "load average |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {i} | {b:.2f} | {w:.2f} | {t[0][0]:.2f} ({t[0][1]:.2f}) | "
            + (f"{t[1][0]:.2f} ({t[1][1]:.2f})" if len(t) > 1 else "-") + f" | {k} | {kap:.4g} | {load:.1f} |"
            for i, b, w, t, k, kap, load in rows]
    return out


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= n else text[: n - 3] + "..."


def part_table() -> list[str]:
    cbs = callbacks()
    out = ["## Each callback, defaults, 6 steps, no glue", "",
           "| callback | " + " | ".join(MODULES) + " |", "|---|" + "---|" * len(MODULES)]
    for label, make in cbs.items():
        cells = []
        for name, build in MODULES.items():
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                start = time.perf_counter()
                try:
                    make_trainer([make()], max_steps=6, limit_val_batches=0).fit(build())
                    cell = f"ran ({time.perf_counter() - start:.1f} s)"
                except Exception as err:  # noqa: BLE001 -- the table reports it
                    cell = f"**{type(err).__name__}**: {_short(err)}"
            ours = [w for w in said if "workers" not in str(w.message) and "LeafSpec" not in str(w.message)
                    and issubclass(w.category, UserWarning)]
            if ours:
                cell += f"; warns: {_short(ours[0].message)}"
            cells.append(cell)
            print(f"{label} | {name} | {cell}", flush=True)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("ntk", "table", "all"), default="all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "any_module.md"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    lines = ["# Any LightningModule, no glue (issue 24)", "",
             f"`python benchmarks/any_module.py --part {args.part}`, torch {torch.__version__}, "
             f"{args.threads} threads, CPU; a shared machine, so timings are noisy.", ""]
    if args.part in ("ntk", "all"):
        lines += part_ntk(args.repeats) + [""]
    if args.part in ("table", "all"):
        lines += part_table() + [""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
