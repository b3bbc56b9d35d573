"""One-shot pruning of a LLaMA-shaped checkpoint: streamed block by block against the whole model in memory.

It generates the ~0.54 B LLaMA-shaped checkpoint of ``benchmarks/llm_analysis.py`` (random init,
hidden 2048, 8 layers, MLP 5632, vocabulary 32000, untied head, bf16 on disk) with the package's
offline word tokenizer, writes a calibration text of the offline grammar, and for each criterion
(Wanda, SparseGPT) runs in a child process each:

* ``streamed``: ``oneshot.prune_checkpoint(DIR, OUT, ...)``, what ``python -m lalr_lightning
  prune`` does: one block's weights in memory at a time;
* ``in-memory``: the same call with ``in_memory=True``: ``from_pretrained`` of the whole model,
  then the same block-by-block criterion;

with 16 calibration windows of 512 tokens, float32 compute on the CPU, and reports wall time and
peak resident memory (``VmHWM`` of the child), next to the checkpoint's float32 size and a bare
``import torch`` process. Then the perplexity command's throughput (tokens per second) on the
pruned model. Usage::

    python benchmarks/llm_pruning.py                       # a few minutes per run on 2 cores
    python benchmarks/llm_pruning.py --layers 2 --hidden 512 --intermediate 1376 --vocab 8000   # quick

``--recipes`` compares instead the per-layer ratio recipes on one small trained model, in one table:
uniform, OWL (``--preset owl``) and AlphaPruning (``--preset alphapruning``), Wanda at 50% and 70%;
perplexity on held-out text of the offline grammar, and zero-shot accuracy (``zeroshot``) on a generated
local task (the answer of ``a plus b is`` among four numbers: ``acc`` and ``acc_norm``). The model is a
LLaMA (``--hidden 128 --layers 4`` by default) trained here on the offline corpus for ``--train-steps``
steps, or ``--model DIR``::

    python benchmarks/llm_pruning.py --recipes --hidden 128 --intermediate 344 --layers 4 --vocab 0 --seq-len 64 --threads 1

``--peak`` measures instead what sets the peak memory of a streamed prune (issue 23, item 6), this
checkout against ``--before REF`` (another commit's ``lalr_lightning``, extracted with ``git
archive``), side by side in one run: on CUDA ``torch.cuda.max_memory_allocated`` of the prune; on
the CPU the peak of live tensor bytes (every tensor storage an op creates, counted until it is
freed, by a ``TorchDispatchMode``: what a GPU's allocator would hold, without the caching), and
the largest tensors alive at that peak. Compute in ``--compute-dtype`` (bfloat16: what ``--dtype
auto`` gives a bf16 checkpoint on CUDA). Peaks grow linearly in the calibration samples (the
activations) on top of a per-batch part; two ``--samples`` counts give both, extrapolated to
``--extrapolate`` samples and printed as such::

    python benchmarks/llm_pruning.py --peak --before 7ede6bb --layers 2 --samples 8,16 --seq-len 2048
    python benchmarks/llm_pruning.py --peak --before 7ede6bb --layers 8 --samples 128 --seq-len 2048 --device cuda
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from llm_analysis import _HWM, _generate, _run  # noqa: E402

_CHILD_PRUNE = _HWM + r"""
import json, sys, time
import torch
from lalr_lightning.oneshot import prune_checkpoint
model, out, calib, crit, n, seq, mem, threads = sys.argv[1:9]
if int(threads):
    torch.set_num_threads(int(threads))
base = hwm_kb()
t = time.perf_counter()
r = prune_checkpoint(model, out, sparsity=0.5, criterion=crit, calibration=calib, n_samples=int(n), seq_len=int(seq),
                     device="cpu", dtype="float32", batch_size=8, in_memory=mem == "1")
wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "overall": r.overall, "base_kb": base, "peak_kb": hwm_kb()}))
"""

_CHILD_PPL = _HWM + r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
from lalr_lightning.oneshot import perplexity
from lalr_lightning.oneshot.checkpoint import _load_tokenizer
from lalr_lightning.oneshot.text import _encode
from pathlib import Path
model_dir, data, seq, windows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if int(sys.argv[5]):
    torch.set_num_threads(int(sys.argv[5]))
ids = _encode(_load_tokenizer(Path(model_dir)), Path(data).read_text())
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
t = time.perf_counter()
ppl, n = perplexity(model, ids, seq, batch_size=1, max_windows=windows)
wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "tokens": n * seq, "ppl": ppl, "peak_kb": hwm_kb()}))
"""

_CHILD_PEAK = r"""
import json, sys, time, weakref
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorBytes(TorchDispatchMode):
    # live bytes of every tensor storage created by an op, each counted once until it is freed
    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.top = {}, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.live:
                    self.live[key] = (st.nbytes(), f"{func.__name__.split('.')[0]} {tuple(t.shape)} {t.dtype}")
                    self.now += st.nbytes()
                    weakref.finalize(st, self._free, key)
                    if self.now > self.peak:
                        self.peak = self.now
                        if st.nbytes() >= 2**20:  # the tensors behind the peak, for the report
                            self.top = sorted(self.live.values(), key=lambda v: -v[0])[:6]
        return out

    def _free(self, key):
        self.now -= self.live.pop(key)[0]


from lalr_lightning.oneshot import prune_checkpoint
model, out, calib, crit, n, seq, device, dtype, batch, threads = sys.argv[1:11]
if int(threads):
    torch.set_num_threads(int(threads))
kw = dict(sparsity=0.5, criterion=crit, calibration=calib, n_samples=int(n), seq_len=int(seq), device=device,
          dtype=dtype, batch_size=int(batch))
t = time.perf_counter()
if device.startswith("cuda"):
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    r = prune_checkpoint(model, out, **kw)
    torch.cuda.synchronize()
    peak, top, what = torch.cuda.max_memory_allocated() - base, [], "torch.cuda.max_memory_allocated"
else:
    tracker = TensorBytes()
    with tracker:
        r = prune_checkpoint(model, out, **kw)
    peak, top, what = tracker.peak, tracker.top, "CPU tensor bytes"
print(json.dumps({"wall": time.perf_counter() - t, "peak": peak, "top": top, "what": what, "overall": r.overall}))
"""

_CHILD_BASE = _HWM + r"""
import json
import torch
print(json.dumps({"peak_kb": hwm_kb()}))
"""


def _extract(ref: str, dest: Path) -> Path:
    """``lalr_lightning`` as of commit ``ref`` in ``dest`` (for the side-by-side --peak run)."""
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", ref, "lalr_lightning"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _peak_run(code: str, pythonpath: Path, *args: str) -> dict:
    import os
    import subprocess

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(pythonpath) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd="/")
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_main(args, root: Path, ckpt: Path, calib: Path) -> list:
    """Peak memory of a streamed prune, this checkout against --before (module docstring)."""
    versions = [("after", HERE.parent)]
    if args.before:
        versions.insert(0, ("before", _extract(args.before, root / "before")))
    counts = [int(c) for c in str(args.samples).split(",")]
    rows = []
    for crit in args.criteria.split(","):
        for n in counts:
            got = {}
            for label, path in versions:
                out = root / f"peak_{crit}_{n}_{label}"
                shutil.rmtree(out, ignore_errors=True)
                got[label] = r = _peak_run(_CHILD_PEAK, path, str(ckpt), str(out), str(calib), crit, str(n),
                                           str(args.seq_len), args.device, args.compute_dtype, str(args.batch_size),
                                           str(args.threads))
                shutil.rmtree(out, ignore_errors=True)
                rows.append((crit, n, label, r["peak"], r["wall"]))
                print(f"{crit:9s} {n:4d} x {args.seq_len} {label:6s}: peak {r['peak'] / 2**30:6.3f} GiB ({r['what']}), "
                      f"{r['wall']:6.1f} s", flush=True)
                for nbytes, desc in r["top"]:
                    print(f"      {nbytes / 2**20:8.1f} MiB  {desc}")
            if "before" in got:
                b, a = got["before"], got["after"]
                print(f"{crit:9s} {n:4d} x {args.seq_len} after / before: peak x{a['peak'] / b['peak']:.3f}, "
                      f"time x{a['wall'] / b['wall']:.2f}", flush=True)
        if len(counts) >= 2 and args.extrapolate:  # peak = fixed + per-sample * n, from the two smallest counts
            n0, n1 = sorted(counts)[:2]
            for label, _ in versions:
                p0, p1 = (next(pk for c, k, lb, pk, _ in rows if c == crit and k == x and lb == label) for x in (n0, n1))
                slope = (p1 - p0) / (n1 - n0)
                est = p0 + slope * (args.extrapolate - n0)
                print(f"{crit:9s} {label:6s} extrapolated to {args.extrapolate} x {args.seq_len}: {est / 2**30:.3f} GiB "
                      f"({(p0 - slope * n0) / 2**30:.3f} GiB fixed + {slope / 2**20:.2f} MiB per sample)", flush=True)
    return rows


_NUMBERS = "zero one two three four five six seven eight nine ten".split()


def _arith_task(path: Path, n: int, seed: int) -> None:
    """``a plus b is`` -> the sum among four numbers (the grammar's own sentences: a trained model knows)."""
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 5), rng.randint(0, 5)
            wrong = rng.sample([x for x in range(11) if x != a + b], 3)
            choices = [_NUMBERS[x] for x in [a + b, *wrong]]
            rng.shuffle(choices)
            f.write(json.dumps({"context": f"{_NUMBERS[a]} plus {_NUMBERS[b]} is", "choices": choices,
                                "label": choices.index(_NUMBERS[a + b])}) + "\n")


def _train(out: Path, args) -> None:
    """A small LLaMA trained on the offline corpus (AdamW, windows of 64 tokens), saved with its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lalr_lightning.data.causal_lm import offline_corpus, word_tokenizer

    tok = word_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 32),
                      num_key_value_heads=max(1, args.hidden // 32), max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.tensor(tok(" ".join(offline_corpus(20000, seed=0)))["input_ids"])
    windows = ids[: ids.numel() // 64 * 64].reshape(-1, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(args.train_steps):
        batch = windows[torch.randint(0, windows.shape[0], (32,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0:
            print(f"train step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def recipes_main(args, root: Path) -> list:
    """The uniform / OWL / AlphaPruning table (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lalr_lightning.data.causal_lm import offline_corpus
    from lalr_lightning.oneshot import perplexity, prune_checkpoint, read_task, zeroshot

    model = Path(args.model) if args.model else root / "trained"
    if not args.model:
        _train(model, args)
    calib, heldout, task = root / "calib.txt", root / "heldout.txt", root / "task.jsonl"
    calib.write_text(" ".join(offline_corpus(4000, seed=1)))
    heldout.write_text(" ".join(offline_corpus(2000, seed=2)))
    _arith_task(task, 200, seed=3)
    docs = read_task(task)
    tok = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor(tok(heldout.read_text())["input_ids"])

    def evaluate(folder: Path) -> tuple[float, dict]:
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return perplexity(lm, ids, 64, 8)[0], zeroshot(lm, tok, docs, 32)

    rows = [("dense", "-", *evaluate(model))]
    for sparsity in (0.5, 0.7):
        for recipe in ("uniform", "owl", "alphapruning"):
            out = root / f"{recipe}_{sparsity}"
            shutil.rmtree(out, ignore_errors=True)
            prune_checkpoint(model, out, sparsity=sparsity, criterion="wanda", calibration=calib,
                             preset=None if recipe == "uniform" else recipe, n_samples=args.samples,
                             seq_len=args.seq_len)
            rows.append((recipe, f"{sparsity:.0%}", *evaluate(out)))
            print(f"{recipe} {sparsity}: done", flush=True)
    print(f"\n{'recipe':<13} {'sparsity':>8} {'perplexity':>10} {'acc':>6} {'acc_norm':>8}")
    for recipe, sp, ppl, z in rows:
        print(f"{recipe:<13} {sp:>8} {ppl:10.3f} {z['acc']:6.3f} {z['acc_norm']:8.3f}")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype on disk (default bf16)")
    p.add_argument("--shard-size", default="500MB")
    p.add_argument("--samples", default="16", help="calibration windows (default 16; --peak: a comma list)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--ppl-windows", type=int, default=8, help="perplexity windows (default 8)")
    p.add_argument("--criteria", default="wanda,sparsegpt")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in the children (default 0: torch's default). On a busy machine 1 is far "
                        "faster for SparseGPT: its column loop is thousands of small ops, and a 2-thread pool "
                        "waits for a descheduled thread at each")
    p.add_argument("--dir", default=None, help="work directory (default: a new temporary one)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--peak", action="store_true", help="measure the peak memory of a streamed prune instead")
    p.add_argument("--recipes", action="store_true", help="compare uniform, OWL and AlphaPruning ratios instead")
    p.add_argument("--model", default=None, help="--recipes: a trained model directory (default: train one here)")
    p.add_argument("--train-steps", type=int, default=600, help="--recipes: training steps (default 600)")
    p.add_argument("--before", default=None, help="--peak: the commit to compare with (e.g. 7ede6bb)")
    p.add_argument("--device", default="cpu", help="--peak: cpu (tensor bytes) or cuda (max_memory_allocated)")
    p.add_argument("--compute-dtype", default="bfloat16", help="--peak: prune_checkpoint's dtype (default bfloat16)")
    p.add_argument("--batch-size", type=int, default=8, help="--peak: calibration windows per forward (default 8)")
    p.add_argument("--extrapolate", type=int, default=128, help="--peak: samples to extrapolate to (default 128)")
    args = p.parse_args(argv)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="llm_pruning_"))
    ckpt = root / "model"
    if args.recipes:
        args.samples = int(args.samples)
        try:
            recipes_main(args, root)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        return
    try:
        if not (ckpt / "config.json").exists():
            params, size = _generate(ckpt, args)
            from lalr_lightning.data.causal_lm import word_tokenizer

            word_tokenizer().save_pretrained(ckpt)
        else:
            params = None
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(ckpt)
        n_params = params or 0
        calib = root / "calib.txt"
        from lalr_lightning.data.causal_lm import offline_corpus

        calib.write_text(" ".join(offline_corpus(20000, seed=1)))
        if args.peak:
            print(json.dumps({"rows": peak_main(args, root, ckpt, calib)}))
            return
        base = _run(_CHILD_BASE)["peak_kb"] / 2**20
        fp32 = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) * (2 if args.dtype == "bf16" else 1) / 2**30
        block = 4 * (4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size) / 2**30
        embed = 4 * cfg.vocab_size * cfg.hidden_size / 2**30
        args.samples = int(args.samples)
        acts = 4 * args.samples * args.seq_len * cfg.hidden_size / 2**30
        print(f"checkpoint {ckpt}: {n_params / 1e9:.3f} B parameters, {fp32:.2f} GiB in float32; one block "
              f"{block:.3f} GiB, embedding {embed:.3f} GiB, activations {acts:.3f} GiB (x2 for in/out); "
              f"bare torch {base:.2f} GiB; calibration {args.samples} x {args.seq_len} tokens", flush=True)
        rows = []
        for crit in args.criteria.split(","):
            for mem in ("0", "1"):
                out = root / f"out_{crit}_{mem}"
                shutil.rmtree(out, ignore_errors=True)
                r = _run(_CHILD_PRUNE, str(ckpt), str(out), str(calib), crit, str(args.samples), str(args.seq_len), mem,
                         str(args.threads))
                label = "in-memory" if mem == "1" else "streamed"
                rows.append((crit, label, r["wall"], r["peak_kb"] / 2**20))
                print(f"{crit:9s} {label:9s}: {r['wall']:7.1f} s, peak RSS {r['peak_kb'] / 2**20:.2f} GiB "
                      f"({r['base_kb'] / 2**20:.2f} GiB after the imports; overall sparsity {r['overall']:.4f})",
                      flush=True)
            (s, ps), (m, pm) = [(w, pk) for c, _, w, pk in rows if c == crit]
            print(f"{crit:9s} in-memory / streamed: time x{m / s:.2f}, peak RSS x{pm / ps:.2f}", flush=True)
        out = root / f"out_{args.criteria.split(',')[0]}_0"
        r = _run(_CHILD_PPL, str(out), str(calib), str(args.seq_len), str(args.ppl_windows), str(args.threads))
        print(f"perplexity: {r['tokens']} tokens in {r['wall']:.1f} s = {r['tokens'] / r['wall']:.0f} tokens/s "
              f"(ppl {r['ppl']:.1f}, peak RSS {r['peak_kb'] / 2**20:.2f} GiB)", flush=True)
        print(json.dumps({"rows": rows}))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.0f} s")
