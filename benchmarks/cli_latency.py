"""Start-up of the command line, this checkout against another (``--before``), side by side in one run.

For each version, in child processes (``python -m lalr_lightning ...`` with ``PYTHONPATH`` set to
that version's tree):

* ``--help``, and an argument error of ``analyze``, ``prune``, ``perplexity``, ``zeroshot``,
  ``report`` and ``configs``: wall seconds (the best of ``--repeat`` runs) and peak RSS;
* ``import lalr_lightning`` alone;
* the import baseline of ``prune`` (``prune --help``, which parses nothing and loads everything the
  command imports before it parses in the old version) and a whole ``prune`` (Wanda, 50%) of a
  generated ~5 M-parameter LLaMA with the package's word tokenizer: wall seconds and peak RSS
  (``ru_maxrss`` of the child from ``os.wait4``), with which heavy modules it imported.

Usage::

    python benchmarks/cli_latency.py --before HEAD~5          # a commit (extracted with git archive)
    python benchmarks/cli_latency.py --before /path/to/tree   # a folder holding lalr_lightning/

Only ratios within one run mean anything on a loaded machine; the seconds are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HEAVY = ("torch", "lightning", "torchvision", "transformers")

_PROBE = f"""
import json, runpy, sys
sys.argv = ["lalr_lightning", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("lalr_lightning", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
sys.stdout.flush()
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
sys.stderr.write("PROBE " + json.dumps([m for m in {HEAVY!r} if sys.modules.get(m) is not None]) + "\\n")
sys.stderr.write(f"HWM {{hwm}}\\n")
raise SystemExit(code)
"""


def _tree(ref: str, dest: Path) -> Path:
    if Path(ref).is_dir():
        return Path(ref).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "lalr_lightning", "configs"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _child(tree: Path, code: str, args: list[str], cwd: Path) -> tuple[float, float, int, list[str]]:
    """(wall seconds, peak RSS GiB, exit code, heavy modules imported) of one child process. The peak is the
    child's own ``VmHWM`` (``ru_maxrss`` of a forked child starts at its parent's, this script's, size)."""
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=env, cwd=cwd)
    err = p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    line = next((ln for ln in err.splitlines() if ln.startswith("PROBE ")), "PROBE []")
    hwm = next((int(ln.split()[1]) for ln in err.splitlines() if ln.startswith("HWM ")), 0)
    return wall, hwm / 2**20, p.returncode, json.loads(line[6:])


def _generate(root: Path, hidden: int, layers: int) -> tuple[Path, Path, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lalr_lightning.data.causal_lm import offline_corpus, word_tokenizer

    tok = word_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "calib.txt").write_text("\n".join(offline_corpus(4000, seed=1)))
    return root / "model", root / "calib.txt", sum(p.numel() for p in model.parameters())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a commit or a folder holding the other version's lalr_lightning/")
    p.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported (default 3)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="only --help, prune's argument error, the import and the "
                                                        "whole prune (a loaded machine)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cli_latency_"))
    versions = {"before": _tree(args.before, work / "before"), "after": ROOT}
    model, calib, params = _generate(work, args.hidden, args.layers)
    cases = {
        "--help": ["--help"],
        "analyze (no model)": ["analyze"],
        "prune (no --out)": ["prune", str(model)],
        "perplexity (no --data)": ["perplexity", str(model)],
        "zeroshot (bad --batch-size)": ["zeroshot", str(model), "--task", "t.jsonl", "--batch-size", "0"],
        "report (no run dir)": ["report"],
        "configs (extra argument)": ["configs", "a", "b"],
        "prune --help (import baseline)": ["prune", "--help"],
    }
    if args.quick:
        cases = {k: v for k, v in cases.items() if k in ("--help", "prune (no --out)")}
    rows = []
    print(f"{'case':<58} {'before s':>8} {'after s':>8} {'ratio':>6}  {'before GiB':>10} {'after GiB':>9}  "
          "after imported", flush=True)
    for label, cmd in cases.items():
        row = {"case": label}
        for name, tree in versions.items():
            runs = [_child(tree, _PROBE, [json.dumps(cmd)], work) for _ in range(args.repeat)]
            row[name] = min(runs)  # best wall; RSS is the same run's
        rows.append(row)
        _show(row)
    row = {"case": "import lalr_lightning"}
    for name, tree in versions.items():
        code = f"import sys, json, lalr_lightning; sys.stderr.write('PROBE ' + json.dumps([m for m in {HEAVY!r} if " \
               "sys.modules.get(m) is not None]) + '\\n'); sys.stderr.write('HWM ' + next(ln.split()[1] for ln in " \
               "open('/proc/self/status') if ln.startswith('VmHWM:')) + '\\n')"
        row[name] = min(_child(tree, code, [], work) for _ in range(args.repeat))
    rows.append(row)
    _show(row)
    prune = {"case": f"prune wanda 50% ({params / 1e6:.1f} M params, {args.samples} x {args.seq_len})"}
    for i, (name, tree) in enumerate(versions.items()):
        cmd = ["prune", str(model), "--out", str(work / f"out{i}"), "--calibration", str(calib), "--n-samples",
               str(args.samples), "--seq-len", str(args.seq_len)]
        prune[name] = _child(tree, _PROBE, [json.dumps(cmd)], work)
        if prune[name][2] != 0:
            raise SystemExit(f"prune failed under {name} (exit {prune[name][2]})")
    rows.append(prune)
    _show(prune)


def _show(r: dict) -> None:
    (bw, bm, bc, _), (aw, am, ac, heavy) = r["before"], r["after"]
    print(f"{r['case']:<58} {bw:8.2f} {aw:8.2f} {aw / bw:6.2f}  {bm:10.3f} {am:9.3f}  "
          f"{','.join(heavy) or '-'} (exit {bc}/{ac})", flush=True)


if __name__ == "__main__":
    main()
