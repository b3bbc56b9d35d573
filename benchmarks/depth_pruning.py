"""Removing whole decoder blocks (``prune --remove-blocks K``), then healing: speed, perplexity, zero-shot.

On the trained offline LLaMA of ``benchmarks/llm_pruning.py --recipes`` (trained here on the offline
grammar, or ``--model DIR``), in one process:

* for each ``K`` (``--fractions``: 1/4 and 1/3 of the blocks) and each block criterion (angular,
  influence, alpha, last): ``oneshot.prune_checkpoint(..., remove_blocks=K, block_criterion=...)``,
  then the cut model's perplexity on held-out text of the grammar and its zero-shot accuracy on the
  generated local task (``a plus b is``, four choices, as ``benchmarks/llm_pruning.py --recipes``);
* the speed of dense against cut on every ``--devices`` entry present (cpu; cuda where a GPU is):
  prefill tokens/s (one forward of ``--prefill-batch x --prefill-len`` tokens), decode tokens/s
  (greedy ``generate`` of ``--decode-tokens`` tokens with the KV cache, batch 1) and peak memory
  (CPU: the weights plus the peak of live tensor bytes during a prefill and a decode, counted by a
  ``TorchDispatchMode``; CUDA: ``torch.cuda.max_memory_allocated``). The speed depends on K, not on
  which blocks go, so it is measured once per K;
* healing (``--heal-steps``) at the first K, for the ``--heal`` criteria: on the Hugging Face Trainer
  with LISA (``BlockSchedule(schedule="lisa")`` through ``lalr_lightning.hf.trainer_callback``), and in
  Lightning with surgical training of the blocks either side of the cut (``SurgicalBlocks`` on
  ``core.pruning.depth.seam_blocks``): perplexity and zero-shot before the cut, after it, after healing.

Usage::

    python benchmarks/depth_pruning.py --threads 1                   # ~15 min on 2 busy cores
    python benchmarks/depth_pruning.py --quick                       # seconds: the test's mode
    python benchmarks/depth_pruning.py --shape 1024,2816,8 --threads 1   # speed alone, a larger LLaMA shape
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CRITERIA = ("angular", "influence", "alpha", "last")


# ----------------------------------------------------------------------------- speed and memory


def _live_bytes_peak(fn) -> int:
    """Peak of the live bytes of the tensors ``fn`` creates (each storage counted once until freed)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Tracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.now, self.peak = {}, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    st = t.untyped_storage()
                    key = st._cdata
                    if key not in self.live:
                        self.live[key] = st.nbytes()
                        self.now += st.nbytes()
                        self.peak = max(self.peak, self.now)
                        weakref.finalize(st, self._free, key)
            return out

        def _free(self, key):
            self.now -= self.live.pop(key)

    tracker = Tracker()
    with tracker:
        fn()
    return tracker.peak


def speeds(dirs: dict[int, Path], device: str, args) -> list[dict]:
    """Prefill tokens/s, decode tokens/s and peak memory of each model (``{K: directory}``) on
    ``device``. The models' timings are interleaved, repeat by repeat (the median kept), so a change
    of the machine's load during the run falls on all of them alike."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.float16
    models = {k: AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(device).eval() for k, d in dirs.items()}
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prefill = torch.randint(4, vocab, (args.prefill_batch, args.prefill_len), generator=g).to(device)
    prompt = torch.randint(4, vocab, (1, 16), generator=g).to(device)

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    def run_prefill(model):
        with torch.no_grad():
            model(input_ids=prefill, use_cache=False)

    def run_decode(model):
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                           do_sample=False, pad_token_id=0)

    for model in models.values():  # warm-up
        run_prefill(model)
        run_decode(model)
    times = {(k, what): [] for k in models for what in ("prefill", "decode")}
    cpu = {key: [] for key in times}  # this process's CPU seconds: on a shared machine, the work alone
    for _ in range(args.repeats):
        for k, model in models.items():
            for what, fn in (("prefill", run_prefill), ("decode", run_decode)):
                sync()
                t, c = time.perf_counter(), time.process_time()
                fn(model)
                sync()
                times[k, what].append(time.perf_counter() - t)
                cpu[k, what].append(time.process_time() - c)
    rows = []
    for k, model in models.items():
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        if device == "cpu":
            peak = weights + max(_live_bytes_peak(functools.partial(run_prefill, model)),
                                 _live_bytes_peak(functools.partial(run_decode, model)))
        else:
            torch.cuda.reset_peak_memory_stats()
            run_prefill(model)
            run_decode(model)
            peak = torch.cuda.max_memory_allocated()
        rows.append({"device": device, "k": k, "prefill_tok_s": prefill.numel() / statistics.median(times[k, "prefill"]),
                     "decode_tok_s": args.decode_tokens / statistics.median(times[k, "decode"]),
                     "prefill_cpu_s": statistics.median(cpu[k, "prefill"]),
                     "decode_cpu_s": statistics.median(cpu[k, "decode"]),
                     "peak_mib": peak / 2**20, "weights_mib": weights / 2**20,
                     "blocks": model.config.num_hidden_layers})
    return rows


# ----------------------------------------------------------------------------- quality


class Evaluator:
    """Perplexity on held-out text of the grammar and zero-shot on the local ``a plus b is`` task."""

    def __init__(self, root: Path, tokenizer_dir: Path, args):
        import torch
        from llm_pruning import _arith_task
        from transformers import AutoTokenizer

        from lalr_lightning.data.causal_lm import offline_corpus
        from lalr_lightning.oneshot import read_task

        heldout, task = root / "heldout.txt", root / "task.jsonl"
        heldout.write_text(" ".join(offline_corpus(args.heldout_sentences, seed=2)))
        _arith_task(task, args.task_questions, seed=3)
        self.docs = read_task(task)
        self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.ids = torch.tensor(self.tok(heldout.read_text())["input_ids"])
        self.args = args

    def __call__(self, folder) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        from lalr_lightning.oneshot import perplexity, zeroshot

        lm = folder if not isinstance(folder, (str, Path)) else AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32)
        lm.eval()
        ppl = perplexity(lm, self.ids, self.args.seq_len, self.args.ppl_windows)[0]
        z = zeroshot(lm, self.tok, self.docs, 32)
        return {"ppl": ppl, "acc": z["acc"], "acc_norm": z["acc_norm"]}


# ----------------------------------------------------------------------------- healing


def _heal_windows(tokenizer_dir: Path, args):
    """Training windows of the grammar (a seed neither the calibration nor the held-out text uses)."""
    import torch
    from transformers import AutoTokenizer

    from lalr_lightning.data.causal_lm import offline_corpus

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = torch.tensor(tok(" ".join(offline_corpus(args.heal_sentences, seed=4)))["input_ids"])
    return ids[: ids.numel() // args.seq_len * args.seq_len].reshape(-1, args.seq_len)


def heal_hf_lisa(cut: Path, out: Path, windows, args) -> None:
    """The cut model fine-tuned on the HF Trainer with LISA: embedding and head always, ``gamma`` of the
    blocks at a time, redrawn every ``every_n_steps`` steps."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from lalr_lightning.callbacks import BlockSchedule
    from lalr_lightning.hf import trainer_callback

    model = AutoModelForCausalLM.from_pretrained(cut, dtype=torch.float32)
    data = [{"input_ids": w, "labels": w} for w in windows]
    lisa = BlockSchedule(schedule="lisa", gamma=max(1, model.config.num_hidden_layers // 4),
                         every_n_steps=max(1, args.heal_steps // 5), seed=0)
    targs = TrainingArguments(output_dir=str(out / "_trainer"), max_steps=args.heal_steps,
                              per_device_train_batch_size=args.heal_batch, learning_rate=args.heal_lr,
                              lr_scheduler_type="constant", weight_decay=0.0, report_to=[], save_strategy="no",
                              logging_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                              disable_tqdm=True)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[trainer_callback(lisa)]).train()
    shutil.rmtree(out / "_trainer", ignore_errors=True)
    model.save_pretrained(out)


def heal_lightning_seam(cut: Path, out: Path, windows, removed: list[int], n_blocks: int, args) -> list[int]:
    """The cut model fine-tuned in Lightning with only the blocks either side of the cut trained
    (``SurgicalBlocks``); returns their indices in the cut model."""
    import lightning.pytorch as pl
    import torch

    from lalr_lightning.callbacks import SurgicalBlocks
    from lalr_lightning.core.pruning.depth import seam_blocks
    from lalr_lightning.models.causal_lm import CausalLMModule

    seam = seam_blocks(removed, n_blocks)
    module = CausalLMModule(model_name=str(cut), optimizer=lambda p: torch.optim.AdamW(p, lr=args.heal_lr,
                                                                                         weight_decay=0.0))
    batches = [{"input_ids": w, "attention_mask": torch.ones_like(w), "labels": w}
               for w in windows.split(args.heal_batch)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(max_steps=args.heal_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SurgicalBlocks(select=[f"*layers.{j}" for j in seam], join_stem=False)])
    trainer.fit(module, train_dataloaders=loader)
    module.model.save_pretrained(out)
    return seam


# ----------------------------------------------------------------------------- the run


def shape_speed(root: Path, args, devices: list[str]) -> dict:
    """``--shape H,I,L``: speed alone, dense against cut, on a randomly initialised LLaMA of that shape
    (the block removal's speed does not depend on the weights; a larger shape than the trained model's
    shows it where the matrix products, not the per-block overhead, take the time)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lalr_lightning.data.causal_lm import word_tokenizer
    from lalr_lightning.oneshot import prune_checkpoint

    hidden, inter, layers = (int(x) for x in args.shape.split(","))
    tok = word_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=max(256, args.prefill_len + 32))
    torch.manual_seed(0)
    dense = root / "shape_dense"
    LlamaForCausalLM(cfg).save_pretrained(dense)
    tok.save_pretrained(dense)
    ks = sorted({max(1, min(layers - 1, round(float(f) * layers))) for f in args.fractions.split(",")})
    dirs = {0: dense}
    for k in ks:
        dirs[k] = root / f"shape_cut_{k}"
        shutil.rmtree(dirs[k], ignore_errors=True)
        prune_checkpoint(dense, dirs[k], remove_blocks=k, block_criterion="last")
    return {"blocks": layers, "ks": ks, "speed": [r for d in devices for r in speeds(dirs, d, args)]}


def _train_args(args) -> argparse.Namespace:
    return argparse.Namespace(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                              train_steps=args.train_steps)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a trained model directory (default: train the offline LLaMA here)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=344)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--train-steps", type=int, default=600)
    p.add_argument("--fractions", default="0.25,0.3333", help="K as fractions of the blocks (rounded, >= 1)")
    p.add_argument("--criteria", default=",".join(CRITERIA))
    p.add_argument("--heal", default="angular,influence", help="criteria healed at the first K (empty: none)")
    p.add_argument("--heal-steps", type=int, default=150)
    p.add_argument("--heal-lr", type=float, default=1e-3)
    p.add_argument("--heal-batch", type=int, default=16)
    p.add_argument("--heal-sentences", type=int, default=6000)
    p.add_argument("--samples", type=int, default=16, help="calibration windows")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--ppl-windows", type=int, default=8)
    p.add_argument("--heldout-sentences", type=int, default=2000)
    p.add_argument("--task-questions", type=int, default=200)
    p.add_argument("--devices", default="cpu,cuda", help="speed on each present device")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps: that the script runs")
    p.add_argument("--shape", default=None, metavar="H,I,L",
                   help="instead: speed alone of a random LLaMA of hidden H, MLP I, L blocks, dense against cut")
    p.add_argument("--dir", default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in dict(hidden=32, intermediate=64, layers=4, train_steps=30, heal_steps=6, samples=4, seq_len=32,
                         ppl_windows=2, heldout_sentences=300, task_questions=20, heal_sentences=400, prefill_batch=2,
                         prefill_len=32, decode_tokens=4, repeats=1, heal_batch=8).items():
            setattr(args, k, v)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from llm_pruning import _train

    from lalr_lightning.data.causal_lm import offline_corpus
    from lalr_lightning.oneshot import prune_checkpoint

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="depth_pruning_"))
    devices = [d for d in args.devices.split(",") if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]
    t0 = time.perf_counter()
    if args.shape:
        try:
            result = shape_speed(root, args, devices)
            print_speed(result)
            return result
        finally:
            if not args.keep and not args.dir:
                shutil.rmtree(root, ignore_errors=True)
    try:
        dense = Path(args.model) if args.model else root / "dense"
        if not args.model and not (dense / "config.json").exists():
            _train(dense, _train_args(args))
        calib = root / "calib.txt"
        calib.write_text(" ".join(offline_corpus(4000, seed=1)))
        evaluate = Evaluator(root, dense, args)
        n_blocks = json.loads((dense / "config.json").read_text())["num_hidden_layers"]
        ks = sorted({max(1, min(n_blocks - 1, round(float(f) * n_blocks))) for f in args.fractions.split(",")})
        result = {"blocks": n_blocks, "ks": ks, "quality": [], "speed": [], "heal": []}
        base = evaluate(dense)
        result["quality"].append({"criterion": "dense", "k": 0, "removed": [], **base})
        cuts = {}
        for k in ks:
            for crit in args.criteria.split(","):
                out = root / f"{crit}_{k}"
                shutil.rmtree(out, ignore_errors=True)
                report = prune_checkpoint(dense, out, remove_blocks=k, block_criterion=crit, calibration=calib,
                                          n_samples=args.samples, seq_len=args.seq_len)
                cuts[crit, k] = (out, report.removed_blocks)
                result["quality"].append({"criterion": crit, "k": k, "removed": report.removed_blocks, **evaluate(out)})
                print(f"K={k} {crit}: removed {report.removed_blocks} {result['quality'][-1]}", flush=True)
        # the cut architecture is the same whichever blocks went: one cut model per K
        dirs = {0: dense, **{k: cuts[args.criteria.split(",")[0], k][0] for k in ks}}
        result["speed"] = [r for dev in devices for r in speeds(dirs, dev, args)]
        windows = _heal_windows(dense, args)
        for crit in [c for c in args.heal.split(",") if c]:
            cut, removed = cuts[crit, ks[0]]
            after = next(r for r in result["quality"] if r["criterion"] == crit and r["k"] == ks[0])
            hf_out, pl_out = root / f"heal_lisa_{crit}", root / f"heal_seam_{crit}"
            heal_hf_lisa(cut, hf_out, windows, args)
            seam = heal_lightning_seam(cut, pl_out, windows, removed, n_blocks, args)
            result["heal"].append({"criterion": crit, "k": ks[0], "removed": removed, "seam": seam,
                                   "dense": base, "cut": {k: after[k] for k in ("ppl", "acc", "acc_norm")},
                                   "lisa_hf": evaluate(hf_out), "seam_lightning": evaluate(pl_out),
                                   "dirs": {"cut": str(cut), "lisa_hf": str(hf_out), "seam_lightning": str(pl_out)}})
            print(f"healed {crit}: {result['heal'][-1]}", flush=True)
        result["seconds"] = time.perf_counter() - t0
        print_tables(result)
        return result
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def print_tables(result: dict) -> None:
    print(f"\n{result['blocks']} blocks; K = {result['ks']}\n")
    print("| criterion | K | removed | perplexity | acc | acc_norm |\n|---|---|---|---|---|---|")
    for r in result["quality"]:
        print(f"| {r['criterion']} | {r['k']} | {r['removed'] or '-'} | {r['ppl']:.3f} | {r['acc']:.3f} | "
              f"{r['acc_norm']:.3f} |")
    print_speed(result)
    if result["heal"]:
        print("\n| criterion | K | model | perplexity | acc | acc_norm |\n|---|---|---|---|---|---|")
        for h in result["heal"]:
            for label, key in (("dense", "dense"), ("cut", "cut"), ("healed: HF Trainer + LISA", "lisa_hf"),
                               (f"healed: Lightning + surgical {h['seam']}", "seam_lightning")):
                r = h[key]
                print(f"| {h['criterion']} | {h['k']} | {label} | {r['ppl']:.3f} | {r['acc']:.3f} | "
                      f"{r['acc_norm']:.3f} |")
    print(f"\ntotal {result['seconds']:.0f} s")


def _by_cpu(dense: dict, row: dict, what: str) -> str:
    return f" / {dense[what + '_cpu_s'] / row[what + '_cpu_s']:.2f}" if row["device"] == "cpu" else ""


def print_speed(result: dict) -> None:
    """Tokens/s by the wall clock; the speed-ups by the wall clock and (CPU) by this process's CPU
    seconds, which a machine shared with other work leaves far less noisy (one thread: the work)."""
    print("\n| device | K | blocks | prefill tok/s | decode tok/s | peak MiB | prefill x (wall / CPU s) | "
          "decode x (wall / CPU s) | peak x |\n|---|---|---|---|---|---|---|---|---|")
    for r in result["speed"]:
        d = next(x for x in result["speed"] if x["device"] == r["device"] and x["k"] == 0)
        print(f"| {r['device']} | {r['k']} | {r['blocks']} | {r['prefill_tok_s']:,.0f} | {r['decode_tok_s']:,.1f} | "
              f"{r['peak_mib']:.1f} | {r['prefill_tok_s'] / d['prefill_tok_s']:.2f}{_by_cpu(d, r, 'prefill')} | "
              f"{r['decode_tok_s'] / d['decode_tok_s']:.2f}{_by_cpu(d, r, 'decode')} | {r['peak_mib'] / d['peak_mib']:.2f} |")


if __name__ == "__main__":
    main()
