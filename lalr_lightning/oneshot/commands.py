"""The commands ``python -m lalr_lightning prune``, ``perplexity`` and ``zeroshot`` (``cli/__init__.py`` hands
them their arguments): the argument parsers, every failure as one ``error:`` line (exit 2), Ctrl-C and
SIGTERM (exit 130, saying what a failed ``prune`` left at ``--out``). The arguments are parsed before
torch is imported (an argument error takes a fraction of a second), and nothing here imports
Lightning or torchvision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lalr_lightning import progress
from lalr_lightning.choices import BLOCK_CRITERIA, CRITERIA, DTYPES, PRESETS, PRUNING_METRICS


def _quiet_transformers() -> None:
    try:  # transformers' per-file progress bars would drown the per-layer table
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        pass


def _fail(prog: str, e: BaseException, device: str | None = None, after: str = "") -> int:
    from lalr_lightning.oneshot.checkpoint import _first_line

    line = _first_line(e)
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in line:
        line = (f"out of memory on {device or 'cpu'} ({line.split(':', 1)[0] or type(e).__name__}); lower "
                "--batch-size, --n-samples or --seq-len")
    print(f"{prog}: error: {line}{'; ' + after if after else ''}", file=sys.stderr)
    return 2


def _outcome(out: Path) -> str:
    """What a failed ``prune`` left at ``--out`` (never a partial model; see outdir.py)."""
    if not out.exists():
        return f"nothing was written to --out {out}"
    if out.is_dir() and not any(out.iterdir()):
        return f"--out {out} was left empty"
    return ""


class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C: the temporary output is removed on the way out."""


def _on_sigterm(signum, frame):
    raise _Terminated


_EPILOG = ("Wanda and SparseGPT need --calibration; magnitude reads no data. N:M (--n, --m) fixes every layer at "
           "n/m, so --sparsity, --preset and --metric do not apply to it. The model is written to a temporary "
           "directory next to --out and renamed into place once every tensor is written and checked: a failed or "
           "interrupted run leaves no --out, and a second run into the same --out is refused while the first runs.")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), as every other error of the CLI, with
    the nearest flag or choice for a mistyped one (as ``fit`` gives)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}{self._nearest(message)} (see --help)\n")

    def _nearest(self, message: str) -> str:
        import difflib
        import re

        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            hints = [close[0] for a in unknown.group(1).split() if a.startswith("--")
                     for close in [difflib.get_close_matches(a.split("=")[0], flags, n=1, cutoff=0.6)] if close]
            return f"; did you mean {', '.join(hints)}?" if hints else ""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            close = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)), n=1)
            return f"; did you mean '{close[0]}'?" if close else ""
        return ""


def _prune_parser(prog: str) -> _Parser:
    p = _Parser(
        prog=prog,
        description="Prune a Hugging Face causal LM one shot, block by block (Wanda, SparseGPT or magnitude; "
                    "uniform, OWL, HT-SR (AlphaPruning) or explicit per-layer ratios; unstructured or N:M), "
                    "streaming one block at a time, "
                    "and write the pruned model directory (docs/llm_pruning.md).",
        epilog=_EPILOG,
    )
    p.add_argument("model", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="new directory for the pruned model (must not exist, or be empty)")
    p.add_argument("--sparsity", type=float, default=None,
                   help="target fraction of the blocks' linear weights set to zero, in [0, 1) (default 0.5); "
                        "not with --n/--m (N:M fixes it at n/m)")
    p.add_argument("--criterion", default=None, choices=CRITERIA,
                   help="wanda: |W| x input-feature norm, needs --calibration; sparsegpt: OBS reconstruction from the "
                        "calibration Hessian, needs --calibration; magnitude: |W| alone, reads no data "
                        "(default: wanda)")
    p.add_argument("--preset", default=None, choices=PRESETS,
                   help="per-layer ratios: alphapruning (AlphaPruning's recipe: alpha by the peak fit, averaged per "
                        "block, epsilon 0.3) or owl (OWL: each block's share of outlier Wanda scores in the "
                        "calibration activations; needs --calibration); default: uniform")
    p.add_argument("--owl-m", type=float, default=None,
                   help="OWL's M: a score is an outlier above M x its block's mean score (default 5)")
    p.add_argument("--owl-lambda", type=float, default=None,
                   help="OWL's lambda: the blocks' ratios span 2 x lambda around --sparsity (default 0.08)")
    p.add_argument("--ratios", default=None, metavar="FILE",
                   help="explicit per-layer ratios: JSON list (one per decoder block), JSON {name: ratio} (block or "
                        "matrix names; a previous run's pruning.json too), or one number per block a line")
    p.add_argument("--metric", default=None, choices=PRUNING_METRICS,
                   help="per-layer ratios from this HT-SR metric; default: uniform")
    p.add_argument("--epsilon", type=float, default=None,
                   help="spread of the per-layer ratios, [1-eps, 1+eps] x target, eps in [0, 1] (default 0.3); "
                        "only with --preset or --metric")
    p.add_argument("--remove-blocks", default=None, metavar="K",
                   help="remove K whole decoder blocks (1 <= K < the number of blocks): the written model has K "
                        "fewer, renumbered, and runs faster on every device; with --sparsity or --n/--m the kept "
                        "blocks are pruned too, in the same run")
    p.add_argument("--block-criterion", default=None, choices=BLOCK_CRITERIA,
                   help="which blocks --remove-blocks removes: angular (the run of K whose input and output differ "
                        "least, Gromov et al.; needs --calibration), influence (ShortGPT's Block Influence, lowest "
                        "first; needs --calibration), alpha (highest mean HT-SR alpha first: the least trained; no "
                        "data) or last (the K blocks before the final one; no data)")
    p.add_argument("--n", type=int, default=0,
                   help="N:M sparsity: prune n of every m consecutive input weights of each row (with --m)")
    p.add_argument("--m", type=int, default=0, help="N:M sparsity: the group size m")
    p.add_argument("--calibration", default=None,
                   help="calibration text for wanda and sparsegpt (required by them; magnitude does not read it): "
                        ".txt (one text, drawn from as WikiText) or .jsonl (one document per record, as C4)")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--n-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration window (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration windows (default 0)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype (auto: the checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="calibration windows per forward (default 8); memory grows with it, the result does not "
                        "depend on it beyond float rounding")
    p.add_argument("--blocksize", type=int, default=None, help="SparseGPT's column block size (default 128); "
                                                              "sparsegpt only")
    p.add_argument("--percdamp", type=float, default=None, help="SparseGPT's dampening, >= 0 (default 0.01); "
                                                               "sparsegpt only")
    p.add_argument("--in-memory", action="store_true", help="load the whole model instead of streaming blocks")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    return p


def prune_main(argv: Sequence[str] | None = None, prog: str = "python -m lalr_lightning prune") -> int:
    args = _prune_parser(prog).parse_args(argv)
    _quiet_transformers()
    from lalr_lightning.oneshot.prune import prune_checkpoint

    out = Path(args.out).absolute()
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    progress.set_quiet(args.quiet)
    try:
        report = prune_checkpoint(
            args.model, args.out, sparsity=args.sparsity, criterion=args.criterion, n=args.n, m=args.m,
            preset=args.preset, metric=args.metric, epsilon=args.epsilon, remove_blocks=args.remove_blocks,
            block_criterion=args.block_criterion, calibration=args.calibration,
            n_samples=args.n_samples, seq_len=args.seq_len, seed=args.seed, text_field=args.text_field,
            device=args.device, dtype=args.dtype, batch_size=args.batch_size, blocksize=args.blocksize,
            percdamp=args.percdamp, in_memory=args.in_memory, owl_m=args.owl_m, owl_lambda=args.owl_lambda,
            ratios=args.ratios, log=progress.write,
        )
    except KeyboardInterrupt as e:
        what = "terminated" if isinstance(e, _Terminated) else "interrupted"
        print(f"{prog}: {what}; {_outcome(out) or 'nothing was written'}", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, ImportError, RuntimeError, OSError, MemoryError) as e:
        return _fail(prog, e, args.device, _outcome(out))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if report.removed_blocks:
        print(report.blocks_table())
    if report.sparsity or not report.removed_blocks:
        print(report.table())
    print(f"\npruned model -> {out.resolve()} ({report.seconds:.1f} s)")
    return 0


def perplexity_main(argv: Sequence[str] | None = None, prog: str = "python -m lalr_lightning perplexity") -> int:
    p = _Parser(
        prog=prog,
        description="Perplexity of a Hugging Face causal LM on a text file: non-overlapping windows of --seq-len "
                    "tokens over the whole tokenized text (the Wanda / SparseGPT / AlphaPruning evaluation).",
        epilog="The directory's weights must cover the model and be finite (nothing is randomly initialised); a "
               "loss that is not finite is an error, never a nan perplexity.",
    )
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("--data", required=True, help=".txt (tokenized verbatim) or .json/.jsonl (records joined by "
                                                 "blank lines) file, e.g. WikiText-2's test split")
    p.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--max-windows", type=int, default=None,
                   help="evaluate only the first N windows (the reference's C4 evaluation: 256)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype (auto: the checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    _semi_structured_flag(p)
    args = p.parse_args(argv)
    _quiet_transformers()
    progress.set_quiet(args.quiet)
    from lalr_lightning.oneshot.checkpoint import _load_config, _load_tokenizer, _resolve_device
    from lalr_lightning.oneshot.evaluate import perplexity
    from lalr_lightning.oneshot.text import _encode, read_text

    try:
        if args.batch_size < 1 or args.seq_len < 2 or (args.max_windows is not None and args.max_windows < 1):
            raise ValueError(f"--batch-size and --max-windows must be >= 1 and --seq-len >= 2, got {args.batch_size}, "
                             f"{args.max_windows} and {args.seq_len}")
        data = Path(args.data)
        if data.is_dir():  # before the model's checks: the file is the first thing to fix
            raise ValueError(f"--data {data} is a directory; give one text file (.txt, .json or .jsonl) in it")
        if not data.is_file():
            raise FileNotFoundError(f"no such --data file: {args.data}")
        model_dir = Path(args.model)
        config = _load_config(model_dir)
        dev = _resolve_device(args.device)
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if max_pos and args.seq_len > max_pos:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {max_pos} positions; lower --seq-len")
        tokenizer = _load_tokenizer(model_dir)
        docs, _ = read_text(args.data, args.text_field)
        ids = _encode(tokenizer, "\n\n".join(docs))
        model = _model(model_dir, config, dev, args.dtype, args.semi_structured)
        t0 = time.perf_counter()
        ppl, windows = perplexity(model, ids, args.seq_len, args.batch_size, args.max_windows)
        dt = time.perf_counter() - t0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, ImportError, RuntimeError, OSError, MemoryError) as e:
        return _fail(prog, e, args.device)
    print(f"perplexity {ppl:.4f} ({windows} windows of {args.seq_len} tokens, {windows * args.seq_len / dt:.0f} "
          f"tokens/s)")
    return 0


# ----------------------------------------------------------------------------- 2:4 and zeroshot


def _semi_structured_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--semi-structured", action="store_true",
                   help="run a 2:4 checkpoint's linear weights as semi-structured sparse tensors (sparse tensor "
                        "cores: a CUDA GPU of compute capability >= 8.0, --dtype float16/bfloat16); elsewhere it "
                        "says so in one line and runs dense. It checks the sparse kernels' numbers; for speed "
                        "it pays off on decoding, not here: on an H200 prefill ran 5x slower (docs/llm_pruning.md)")


def _model(model_dir: Path, config, dev, dtype: str, semi_structured: bool):
    """The evaluated model; with ``--semi-structured``, its 2:4 weights made semi-structured where the
    device can run them (one line on stderr where it cannot)."""
    from lalr_lightning.oneshot.evaluate import _load_evaluated

    model = _load_evaluated(model_dir, config, dev, dtype)
    if semi_structured:
        from lalr_lightning.oneshot.sparse24 import semi_structured_unsupported, to_semi_structured

        why = semi_structured_unsupported(dev)
        if why:
            print(f"note: {why}", file=sys.stderr)
        else:
            done = to_semi_structured(model)
            sparse = sum(v == "sparse" for v in done.values())
            print(f"2:4: {sparse} of {len(done)} linear weights semi-structured", file=sys.stderr)
    return model


def _zeroshot_parser(prog: str) -> _Parser:
    from lalr_lightning.choices import PAPER_TASKS

    p = _Parser(
        prog=prog,
        description="Zero-shot accuracy (acc, acc_norm) of a Hugging Face causal LM on multiple-choice tasks, as "
                    "lm-evaluation-harness computes them: each choice scored by the log-likelihood of ' ' + choice "
                    "after the context; acc_norm divides it by the choice's length (docs/zeroshot.md).",
        epilog=f"The papers' seven tasks: --tasks {','.join(PAPER_TASKS)} (through lm-evaluation-harness: "
               "datasets from --data-dir DIR/<task>.jsonl or the Hugging Face cache). A local task: --task FILE.jsonl, "
               'one example a line: {"context": str, "choices": [str, ...], "label": int}.',
    )
    p.add_argument("model", help="Hugging Face model directory")
    p.add_argument("--task", action="append", default=[], metavar="FILE.jsonl",
                   help="a local task file (repeatable); its name in the table is the file's stem")
    p.add_argument("--tasks", default=None, help=f"lm-evaluation-harness task names, comma-separated (the papers': "
                                                 f"{','.join(PAPER_TASKS)})")
    p.add_argument("--data-dir", default=None, help="--tasks: a folder of <task>.jsonl files (the task's evaluation "
                                                    "split in the dataset's own fields), used instead of the hub")
    p.add_argument("--limit", type=int, default=None, help="--tasks: only the first N examples of each task")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward (default 16)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="compute dtype (auto: the checkpoint's on CUDA, float32 on CPU)")
    p.add_argument("--out", default=None, help="write the results as JSON here (default: zeroshot.json in the "
                                               "current directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _semi_structured_flag(p)
    return p


def zeroshot_main(argv: Sequence[str] | None = None, prog: str = "python -m lalr_lightning zeroshot") -> int:
    p = _zeroshot_parser(prog)
    args = p.parse_args(argv)
    if not args.task and not args.tasks:
        p.error("give --task FILE.jsonl or --tasks boolq,rte,... (or both)")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        p.error(f"--batch-size and --limit must be >= 1, got {args.batch_size} and {args.limit}")
    out = Path(args.out or "zeroshot.json")
    if out.is_dir():  # checked before the evaluation, whose results the write would lose
        p.error(f"--out {out} is a directory; --out names the JSON file to write: pass a file path")
    if not out.resolve().parent.is_dir():
        p.error(f"--out {out}: no such folder {out.resolve().parent}; create it or pass another path")
    names = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    _quiet_transformers()
    try:
        results = _zeroshot_run(args, names)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, ImportError, RuntimeError, OSError, MemoryError) as e:
        return _fail(prog, e, args.device)
    from lalr_lightning.oneshot.zeroshot import table

    print(table(results, "acc"))
    print(table(results, "acc_norm"))
    try:
        out.write_text(json.dumps({"model": str(Path(args.model).resolve()), "results": results}, indent=2) + "\n")
    except OSError as e:  # the tables above keep the numbers
        print(f"{prog}: error: cannot write --out {out} ({e.strerror or type(e).__name__}); the results are above",
              file=sys.stderr)
        return 1
    print(f"\nresults -> {out.resolve()}")
    return 0


def _zeroshot_run(args, names: list[str]) -> dict[str, dict]:
    from lalr_lightning.oneshot.checkpoint import _load_config, _load_tokenizer, _resolve_device
    from lalr_lightning.oneshot.zeroshot import _bar, check_datasets, harness_tasks, read_task, zeroshot

    files = {Path(f).stem: read_task(f) for f in args.task}  # every file checked before the model loads
    if names:
        check_datasets(names, args.data_dir)
    model_dir = Path(args.model)
    config = _load_config(model_dir)
    dev = _resolve_device(args.device)
    tokenizer = _load_tokenizer(model_dir)
    model = _model(model_dir, config, dev, args.dtype, args.semi_structured)
    results = {}
    for name, docs in files.items():
        t0 = time.perf_counter()
        update, close = _bar(sum(len(d["choices"]) for d in docs), name, args.quiet)
        try:
            results[name] = zeroshot(model, tokenizer, docs, args.batch_size, update)
        finally:
            close()
        if not args.quiet:
            print(f"{name}: {len(docs)} examples, acc {results[name]['acc']:.4f}, acc_norm "
                  f"{results[name]['acc_norm']:.4f} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if names:
        results.update(harness_tasks(model, tokenizer, names, args.batch_size, args.data_dir, args.limit))
    return results
