"""The commands ``python -m lalr_lightning prune`` and ``perplexity`` (``cli.py`` hands them their
arguments): the argument parsers, every failure as one ``error:`` line (exit 2), Ctrl-C and
SIGTERM (exit 130, saying what a failed ``prune`` left at ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from lalr_lightning import progress
from lalr_lightning.core.pruning import criteria
from lalr_lightning.oneshot.checkpoint import DTYPES, _first_line, _load_config, _load_tokenizer, _resolve_device
from lalr_lightning.oneshot.evaluate import _load_evaluated, perplexity
from lalr_lightning.oneshot.prune import prune_checkpoint
from lalr_lightning.oneshot.text import _encode, read_text


def _quiet_transformers() -> None:
    try:  # transformers' per-file progress bars would drown the per-layer table
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except (ImportError, AttributeError):  # pragma: no cover - older transformers
        pass


def _fail(prog: str, e: BaseException, device: str | None = None, after: str = "") -> int:
    line = _first_line(e)
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in line:
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
    """argparse whose errors are one line (no usage block), as every other error of the CLI."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def prune_main(argv: Sequence[str] | None = None, prog: str = "python -m lalr_lightning prune") -> int:
    from lalr_lightning.core.pruning.alphapruning import PRUNING_METRICS

    p = _Parser(
        prog=prog,
        description="Prune a Hugging Face causal LM one shot, block by block (Wanda, SparseGPT or magnitude; "
                    "uniform or HT-SR per-layer ratios; unstructured or N:M), streaming one block at a time, "
                    "and write the pruned model directory (docs/llm_pruning.md).",
        epilog=_EPILOG,
    )
    p.add_argument("model", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="new directory for the pruned model (must not exist, or be empty)")
    p.add_argument("--sparsity", type=float, default=None,
                   help="target fraction of the blocks' linear weights set to zero, in [0, 1) (default 0.5); "
                        "not with --n/--m (N:M fixes it at n/m)")
    p.add_argument("--criterion", default="wanda", choices=criteria.CRITERIA,
                   help="wanda: |W| x input-feature norm, needs --calibration; sparsegpt: OBS reconstruction from the "
                        "calibration Hessian, needs --calibration; magnitude: |W| alone, reads no data "
                        "(default: wanda)")
    p.add_argument("--preset", default=None, choices=["alphapruning"],
                   help="per-layer ratios from AlphaPruning's recipe (alpha by the peak fit, averaged per block, "
                        "epsilon 0.3); default: uniform")
    p.add_argument("--metric", default=None, choices=PRUNING_METRICS,
                   help="per-layer ratios from this HT-SR metric; default: uniform")
    p.add_argument("--epsilon", type=float, default=None,
                   help="spread of the per-layer ratios, [1-eps, 1+eps] x target, eps in [0, 1] (default 0.3); "
                        "only with --preset or --metric")
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
    args = p.parse_args(argv)
    _quiet_transformers()
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
            preset=args.preset, metric=args.metric, epsilon=args.epsilon, calibration=args.calibration,
            n_samples=args.n_samples, seq_len=args.seq_len, seed=args.seed, text_field=args.text_field,
            device=args.device, dtype=args.dtype, batch_size=args.batch_size, blocksize=args.blocksize,
            percdamp=args.percdamp, in_memory=args.in_memory, log=progress.write,
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
    args = p.parse_args(argv)
    _quiet_transformers()
    progress.set_quiet(args.quiet)
    try:
        if args.batch_size < 1 or args.seq_len < 2 or (args.max_windows is not None and args.max_windows < 1):
            raise ValueError(f"--batch-size and --max-windows must be >= 1 and --seq-len >= 2, got {args.batch_size}, "
                             f"{args.max_windows} and {args.seq_len}")
        model_dir = Path(args.model)
        config = _load_config(model_dir)
        dev = _resolve_device(args.device)
        max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if max_pos and args.seq_len > max_pos:
            raise ValueError(f"--seq-len {args.seq_len} exceeds the model's {max_pos} positions; lower --seq-len")
        tokenizer = _load_tokenizer(model_dir)
        docs, _ = read_text(args.data, args.text_field)
        ids = _encode(tokenizer, "\n\n".join(docs))
        model = _load_evaluated(model_dir, config, dev, args.dtype)
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
