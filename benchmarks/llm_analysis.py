"""Streamed spectral analysis of a LLaMA-shaped checkpoint against WeightWatcher on the loaded model.

It generates a LLaMA-shaped causal LM offline (random init from a ``LlamaConfig``; default hidden
2048, 8 layers, MLP 5632, vocabulary 32000, untied head: about 0.54 B parameters), saves it as
sharded safetensors (bf16 on disk by default) in a temporary directory, and prints:

* ``ours``: wall time of ``htsr.analyze(DIR, fit="ks")``, which streams the checkpoint one
  tensor at a time and never builds the model, and its peak resident memory (``VmHWM``),
  next to the checkpoint's size on disk and to the memory of a bare ``import torch`` process;
* ``WW``: wall time of ``weightwatcher.WeightWatcher(model).analyze(plot=False,
  randomize=False)`` on the same model loaded in memory (float32: WeightWatcher's SVDs go
  through NumPy, which has no bf16), loading time reported apart;
* the ratio WW / ours, and the largest alpha difference between the two tables (WW fits in
  float64, we in float32's route).

Each measurement runs in its own child process and reads its own ``VmHWM`` from
``/proc/self/status`` (Linux), so each peak RSS is that run's alone (``ru_maxrss`` would carry the
parent's peak over the fork). The
checkpoint is deleted at the end unless ``--keep``. Usage::

    python benchmarks/llm_analysis.py                 # ~1.1 GB on disk, a few minutes on 2 cores
    python benchmarks/llm_analysis.py --layers 2 --hidden 512 --intermediate 1376 --vocab 8000  # quick

* ``sharded``: the weight measurement of a callback (``TempBalanceCallback``'s alpha of every
  matrix, ``LayerwiseCallback.measure_shards``) inside a Lightning fit on the same checkpoint, with
  ``ddp_spawn`` and 2 ranks (each fits a size-balanced half of the matrices, the results are
  all-gathered) against 1 rank; the cores are split evenly between the ranks
  (``torch.set_num_threads``), the time is the measurement's alone (between two barriers; the
  model is loaded in each rank's ``setup``, not pickled), and the two alpha tables are compared
  (they agree to ~1e-5 relative: a rank batches the float32 eigen-solves of equal-shape matrices
  over its own share, and a batched solve rounds differently from a single one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HWM = r"""
def hwm_kb():  # this process's peak resident memory (ru_maxrss would include the parent's at fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
"""

_CHILD_OURS = _HWM + r"""
import json, sys, time
import torch
from lalr_lightning.core.spectral import htsr
base = hwm_kb()
t = time.perf_counter()
df = htsr.analyze(sys.argv[1], fit="ks", device=sys.argv[2])
wall = time.perf_counter() - t
df[["name", "alpha"]].to_csv(sys.argv[3], index=False)
print(json.dumps({"wall": wall, "rows": len(df), "base_kb": base, "peak_kb": hwm_kb()}))
"""

_CHILD_WW = _HWM + r"""
import contextlib, json, logging, sys, time, warnings
import torch
import weightwatcher as ww
from transformers import AutoModelForCausalLM
logging.getLogger("weightwatcher").setLevel(logging.ERROR)
t = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
load = time.perf_counter() - t
t = time.perf_counter()
with warnings.catch_warnings(), contextlib.redirect_stdout(None):
    warnings.simplefilter("ignore")
    df = ww.WeightWatcher(model=model).analyze(plot=False, randomize=False)
wall = time.perf_counter() - t
df[["longname", "alpha"]].rename(columns={"longname": "name"}).to_csv(sys.argv[2], index=False)
print(json.dumps({"wall": wall, "load": load, "rows": len(df), "peak_kb": hwm_kb()}))
"""

_CHILD_SHARDS = r"""
import json, os, sys, time, warnings
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lalr_lightning.callbacks import TempBalanceCallback
path, world, cores, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
warnings.filterwarnings("ignore")

class Loader(Callback):  # each rank loads the checkpoint itself (nothing large is pickled to the workers)
    def setup(self, trainer, pl_module, stage):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(max(1, cores // world))
        pl_module.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

class Clock(Callback):  # holds the TempBalance callback: workers get pickled copies, not this file's globals
    def __init__(self, start, tb=None):
        self.start, self.tb = start, tb
    def on_fit_start(self, trainer, pl_module):
        trainer.strategy.barrier()
        if self.start:
            os.environ["_T0"] = repr(time.perf_counter())
        elif trainer.is_global_zero:
            wall = time.perf_counter() - float(os.environ["_T0"])
            json.dump({"wall": wall, "alphas": self.tb.scores, "threads": torch.get_num_threads()}, open(out, "w"))

class Module(pl.LightningModule):
    def training_step(self, batch, _):
        return None
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

tb = TempBalanceCallback(fit="ks", min_evals=2, layer_types=("linear", "embedding"), first=True, head=True)
if __name__ == "__main__":  # spawned workers import this file (the classes) and stop here
    kw = dict(strategy="ddp_spawn", devices=world) if world > 1 else dict(devices=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Loader(), Clock(True), tb, Clock(False, tb)], **kw)
    trainer.fit(Module(), train_dataloaders=[torch.zeros(1)])
    print(open(out).read())
"""

_CHILD_BASE = _HWM + r"""
import json
import torch
print(json.dumps({"peak_kb": hwm_kb()}))
"""


def _run(code: str, *args: str, file: Path | None = None) -> dict:
    """Run ``code`` in a child process (from ``file`` when given: spawned workers must import it)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    root = str(Path(__file__).resolve().parents[1])  # this checkout's lalr_lightning
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if file is not None:
        file.write_text(code)
    cmd = [sys.executable, str(file)] if file is not None else [sys.executable, "-c", code]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _generate(path: Path, args) -> tuple[int, int]:
    """Random-init a LLaMA-shaped model and save it sharded; returns (parameters, bytes on disk)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size=args.shard_size)
    del model
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return n, size


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype on disk (default bf16)")
    p.add_argument("--shard-size", default="500MB", help="save_pretrained max_shard_size (default 500MB)")
    p.add_argument("--device", default="cpu", help="device of the streamed analysis (cpu or cuda)")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--no-ww", action="store_true", help="skip WeightWatcher")
    p.add_argument("--no-shards", action="store_true", help="skip the 2-rank vs 1-rank sharded measurement")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the sharded measurement (default 2)")
    args = p.parse_args(argv)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="llm_analysis_"))
    ckpt = root / "model"
    try:
        t = time.perf_counter()
        if (ckpt / "config.json").exists():
            print(f"reusing {ckpt}")
            params = None
            size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        else:
            params, size = _generate(ckpt, args)
        shards = len(list(ckpt.glob("*.safetensors")))
        print(f"checkpoint: {ckpt} ({shards} shards, {size / 2**30:.2f} GiB on disk, {args.dtype}"
              + (f", {params / 1e9:.3f} B parameters" if params else "") + f"; {time.perf_counter() - t:.0f} s to make)",
              flush=True)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, as in the children
        from lalr_lightning.core.runtime.safetensors_checkpoints import stored_matrices

        largest = max(m.numel * (2 if m.dtype in ("BF16", "F16") else 4) for m in stored_matrices(ckpt))
        base = _run(_CHILD_BASE)
        ours = _run(_CHILD_OURS, str(ckpt), args.device, str(root / "ours.csv"))
        print(f"ours (streamed, {args.device}): {ours['wall']:.1f} s for {ours['rows']} matrices; "
              f"peak RSS {ours['peak_kb'] / 2**20:.2f} GiB ({ours['peak_kb'] / 1024 / (size / 2**20):.2f}x the checkpoint; "
              f"a bare `import torch` process: {base['peak_kb'] / 2**20:.2f} GiB, after our imports: "
              f"{ours['base_kb'] / 2**20:.2f} GiB, so the analysis itself added "
              f"{(ours['peak_kb'] - ours['base_kb']) / 2**20:.2f} GiB; largest matrix: {largest / 2**20:.0f} MiB "
              f"on disk)", flush=True)
        if not args.no_ww:
            ww = _run(_CHILD_WW, str(ckpt), str(root / "ww.csv"))
            import pandas as pd

            a = pd.read_csv(root / "ours.csv").set_index("name")["alpha"]
            b = pd.read_csv(root / "ww.csv").set_index("name")["alpha"]
            common = a.index.intersection(b.index)
            diff = ((a[common] - b[common]).abs() / b[common].abs()).max()
            print(f"WeightWatcher (model in memory, float32): {ww['wall']:.1f} s for {ww['rows']} matrices "
                  f"(+{ww['load']:.1f} s to load); peak RSS {ww['peak_kb'] / 2**20:.2f} GiB", flush=True)
            print(f"WW / ours wall time: {ww['wall'] / ours['wall']:.2f}x; {len(common)} common rows, "
                  f"largest relative alpha difference {diff:.1e}", flush=True)
        import torch

        if not args.no_shards:
            cores = os.cpu_count() or 1
            one = _run(_CHILD_SHARDS, str(ckpt), "1", str(cores), str(root / "one.json"),
                       file=root / "shards.py")
            many = _run(_CHILD_SHARDS, str(ckpt), str(args.ranks), str(cores), str(root / "many.json"),
                        file=root / "shards.py")
            same = one["alphas"].keys() == many["alphas"].keys()
            diff = (max(abs(one["alphas"][k] - many["alphas"][k]) / abs(one["alphas"][k]) for k in one["alphas"])
                    if same else float("nan"))
            print(f"sharded measurement (TempBalance alphas of {len(one['alphas'])} matrices, {cores} cores): "
                  f"1 rank {one['wall']:.1f} s ({one['threads']} threads), ddp_spawn {args.ranks} ranks "
                  f"{many['wall']:.1f} s ({many['threads']} thread(s) each): {one['wall'] / many['wall']:.2f}x; "
                  f"same layers: {same}, largest relative alpha difference {diff:.1e} (float32 eigen-solves batched "
                  "differently per rank)", flush=True)

        print(f"torch threads: {torch.get_num_threads()}; load average at the end: "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if args.keep:
            print(f"kept {ckpt}")
        elif args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
