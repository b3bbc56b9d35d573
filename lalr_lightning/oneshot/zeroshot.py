"""``zeroshot``: multiple-choice accuracy of a causal LM, computed as lm-evaluation-harness computes it.

``python -m lalr_lightning zeroshot MODEL_DIR --task FILE.jsonl``: one example a line,
``{"context": str, "choices": [str, ...], "label": int}``. Each choice is scored by the
log-likelihood of ``" " + choice`` as a continuation of the context (lm-evaluation-harness's
``target_delimiter``), tokenized as its ``HFLM`` does for a causal model: the context and
context + continuation are encoded with the tokenizer's own special tokens (a leading BOS, for
LLaMA-style tokenizers), the continuation's tokens are those of the whole past the context's,
trailing spaces of the context move to the continuation, and an input longer than the model's
positions keeps its last ``max_length`` tokens. Then, per example:

* ``acc``: 1 when the choice of largest log-likelihood is the label;
* ``acc_norm``: the same with each log-likelihood divided by the choice's length in characters
  (``len(choice)``, without the delimiter), lm-evaluation-harness's ``acc_norm``;

and the task's value is their mean, with the standard error of the mean (sample standard
deviation / sqrt(n)) as ``acc_stderr`` / ``acc_norm_stderr``. ``tests/test_zeroshot.py`` runs
lm-evaluation-harness itself on the same file and model and compares.

The papers' seven tasks (``--tasks boolq,rte,...``) run through lm-evaluation-harness
(:func:`harness_tasks`), on the same loaded model.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from lalr_lightning.choices import PAPER_TASKS  # noqa: F401 -- re-exported


class TaskDocs(list):
    """:func:`read_task`'s examples (a list of dicts) that remember where each came from, so an
    example found too long only once tokenized is named by its file and line."""

    def __init__(self, docs: Sequence[dict] = (), source: str = "", lines: Sequence[int] = ()):
        super().__init__(docs)
        self.source, self.lines = source, list(lines)

    def where(self, i: int) -> str:
        """``FILE line N`` of example ``i`` (``example i`` for docs read from no file)."""
        if self.source and i < len(self.lines):
            return f"{self.source} line {self.lines[i]}"
        return f"example {i}"


def read_task(path: str | os.PathLike) -> TaskDocs:
    """The examples of a ``--task`` file, each checked: a ``context`` string, a non-empty list of
    ``choices`` strings and an integer ``label`` indexing them (one line naming the first bad one).
    A list of dicts that knows each one's line (:class:`TaskDocs`)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such --task file: {path}")
    docs, lines = [], []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p.name} line {i}: not JSON ({e.msg}); one example a line: "
                             '{"context": str, "choices": [str, ...], "label": int}') from None
        _check_doc(doc, f"{p.name} line {i}")
        docs.append(doc)
        lines.append(i)
    if not docs:
        raise ValueError(f"{path} holds no examples; one a line: " + '{"context": str, "choices": [...], "label": int}')
    return TaskDocs(docs, p.name, lines)


def _check_doc(doc, where: str) -> None:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object with context, choices and label")
    ctx, choices, label = doc.get("context"), doc.get("choices"), doc.get("label")
    if not isinstance(ctx, str) or not ctx:
        raise ValueError(f"{where}: \"context\" must be a non-empty string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"{where}: \"choices\" must be a list of at least two non-empty strings")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise ValueError(f"{where}: \"label\" must be an integer index into the {len(choices)} choices, got {label!r}")


def _encode(tokenizer, text: str) -> list[int]:
    """HFLM's ``tok_encode`` for a causal model: the tokenizer's own special tokens, unless the text
    already starts with the BOS token."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-evaluation-harness splits them (module docstring)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = _encode(tokenizer, context + continuation), _encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def _max_length(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        if getattr(cfg, attr, None):
            return int(getattr(cfg, attr))
    return 2048


@torch.no_grad()
def loglikelihoods(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]], batch_size: int = 16,
                   progress: Callable[[int], None] | None = None) -> list[float]:
    """The summed log-probability of each continuation given its context (token lists), as
    lm-evaluation-harness's ``_loglikelihood_tokens``: the input is context + continuation without its
    last token, left-truncated to the model's positions; right padding, which a causal model never
    attends to."""
    device = next(model.parameters()).device
    max_len = _max_length(model)
    out: list[float] = [0.0] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        rows = []
        for i in chunk:
            ctx, cont = requests[i]
            if not cont:
                raise ValueError("a choice encodes to no tokens; check the task's choices")
            rows.append(((ctx + cont)[-(max_len + 1):][:-1], len(cont)))
        width = max(len(r) for r, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for j, (r, _) in enumerate(rows):
            ids[j, :len(r)] = torch.tensor(r)
        logp = torch.log_softmax(model(input_ids=ids.to(device), use_cache=False).logits.float(), dim=-1)
        for j, ((r, n), i) in enumerate(zip(rows, chunk)):
            target = torch.tensor(requests[i][1][-n:], device=device)
            value = float(logp[j, len(r) - n:len(r)].gather(1, target[:, None]).sum())
            if not math.isfinite(value):
                raise ValueError(f"the log-likelihood of example request {i} is {value}: the forward overflows; "
                                 "evaluate with --dtype float32")
            out[i] = value
        if progress is not None:
            progress(len(chunk))
    return out


def _stderr(values: list[float]) -> float:
    n = len(values)
    if n < 2:
        return float("nan")
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def zeroshot(model: nn.Module, tokenizer, docs: Sequence[dict], batch_size: int = 16,
             progress: Callable[[int], None] | None = None) -> dict[str, float]:
    """``{"acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "n"}`` of ``model`` on ``docs``
    (:func:`read_task`'s examples), computed as lm-evaluation-harness does (module docstring)."""
    requests, owner = [], []
    max_len = _max_length(model)
    for d, doc in enumerate(docs):
        for k, choice in enumerate(doc["choices"]):
            requests.append(encode_pair(tokenizer, doc["context"], " " + choice))
            owner.append(d)
            n = len(requests[-1][1])
            if n > max_len:  # no window holds it whole: lm-evaluation-harness refuses it too (an assert)
                where = docs.where(d) if isinstance(docs, TaskDocs) else f"example {d}"
                raise ValueError(f"{where}: choice {k} is {n} tokens, longer than the model's {max_len} positions; "
                                 "shorten it, or evaluate a model with more positions")
    was_training = model.training
    model.eval()
    try:
        lls = loglikelihoods(model, requests, batch_size, progress)
    finally:
        model.train(was_training)
    acc, acc_norm, k = [], [], 0
    for doc in docs:
        scores = lls[k:k + len(doc["choices"])]
        k += len(doc["choices"])
        normed = [s / len(c) for s, c in zip(scores, doc["choices"])]
        acc.append(1.0 if _argmax(scores) == doc["label"] else 0.0)
        acc_norm.append(1.0 if _argmax(normed) == doc["label"] else 0.0)
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm), "acc_stderr": _stderr(acc),
            "acc_norm_stderr": _stderr(acc_norm), "n": len(docs)}


def _argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (numpy's argmax, which lm-evaluation-harness uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ----------------------------------------------------------------------------- the papers' tasks


class MissingDataset(RuntimeError):
    """A task's dataset is neither a local file nor in the Hugging Face cache, and the hub is offline."""


_MANAGER = None


def _task_config(name: str) -> dict:
    """An lm-evaluation-harness task's resolved YAML config ({} when unknown)."""
    global _MANAGER
    if _MANAGER is None:
        from lm_eval.tasks import TaskManager

        _MANAGER = TaskManager()
    entry = _MANAGER.task_index.get(name)
    return dict(getattr(entry, "cfg", None) or {})


def _task_dataset(name: str) -> str:
    """``dataset_path[/dataset_name]`` of an lm-evaluation-harness task."""
    try:
        cfg = _task_config(name)
    except Exception:  # noqa: BLE001 -- only for the message
        return name
    return "/".join(str(v) for v in (cfg.get("dataset_path"), cfg.get("dataset_name")) if v) or name


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _local_override(name: str, data_dir: Path | None) -> dict | str:
    """The task, or its config with the dataset read from ``data_dir/<task>.jsonl`` (the split the task
    evaluates, in the dataset's own fields) when that file exists."""
    if data_dir is None or not (data_dir / f"{name}.jsonl").is_file():
        return name
    cfg = _task_config(name)
    key = "test_split" if cfg.get("test_split") else "validation_split"
    split = cfg.get(key) or "test"
    return {**cfg, "task": name, "dataset_path": "json", "dataset_name": None, key: split, "training_split": None,
            "fewshot_split": None,
            "dataset_kwargs": {"data_files": {split: str(data_dir / f"{name}.jsonl")}}}


def check_datasets(tasks: Sequence[str], data_dir: str | os.PathLike | None = None) -> None:
    """Offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), refuse before anything loads a task whose
    dataset is neither ``data_dir/<task>.jsonl`` nor in the Hugging Face cache (:class:`MissingDataset`);
    an unknown task name is a ``ValueError`` naming the closest."""
    import difflib

    folder = Path(data_dir) if data_dir is not None else None
    for name in tasks:
        cfg = _task_config(name)
        if not cfg:
            close = difflib.get_close_matches(name, list(_MANAGER.task_index), n=1)
            raise ValueError(f"unknown lm-evaluation-harness task {name!r}" + (f"; did you mean {close[0]}?" if close
                                                                                else ""))
        if not _offline() or (folder is not None and (folder / f"{name}.jsonl").is_file()):
            continue
        try:
            import datasets

            datasets.load_dataset_builder(cfg.get("dataset_path"), cfg.get("dataset_name"))
        except Exception:  # noqa: BLE001 -- offline and not cached: datasets raises one of many types
            raise MissingDataset(_missing_line(name, folder)) from None


def harness_tasks(model: nn.Module, tokenizer, tasks: Sequence[str], batch_size: int = 16,
                  data_dir: str | os.PathLike | None = None, limit: int | None = None) -> dict[str, dict]:
    """``{task: {"acc", "acc_norm", ...}}`` of lm-evaluation-harness's tasks on the loaded model
    (``HFLM`` wrapping it). Datasets come from ``data_dir/<task>.jsonl`` when present, else the
    Hugging Face cache (or the hub when online). A dataset that is not there, offline, is a
    :class:`MissingDataset` naming it and how to get it (``docs/zeroshot.md``)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError:
        raise ImportError('--tasks runs lm-evaluation-harness: pip install "lm-eval>=0.4.5" (or use --task FILE.jsonl)'
                          ) from None
    import logging

    for logger in ("lm-eval", "lm_eval"):  # its per-task notes would drown the table
        logging.getLogger(logger).setLevel(logging.ERROR)
    folder = Path(data_dir) if data_dir is not None else None
    results = {}
    for name in tasks:
        spec = _local_override(name, folder)
        try:
            out = lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size),
                                          tasks=[spec], num_fewshot=0, limit=limit, log_samples=False)
        except Exception as e:  # noqa: BLE001 -- datasets' many offline errors (ConnectionError, FileNotFoundError...)
            if spec == name and (_offline() or _looks_offline(e)):
                raise MissingDataset(_missing_line(name, folder)) from None
            raise
        res = out["results"][name]
        results[name] = {k.split(",")[0]: v for k, v in res.items() if "," in k and isinstance(v, (int, float))}
    return results


def _looks_offline(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("offline", "connection", "couldn't reach", "could not reach", "not found in cache",
                                   "doesn't exist on the hub", "no such file", "max retries", "name resolution"))


def _missing_line(name: str, folder: Path | None) -> str:
    where = f"no {folder / (name + '.jsonl')}, " if folder is not None else ""
    return (f"task {name}: its dataset {_task_dataset(name)} is not available offline ({where}not in the Hugging Face "
            f"cache {os.environ.get('HF_DATASETS_CACHE') or os.environ.get('HF_HOME') or '~/.cache/huggingface'}); "
            f"download it once online, or pass --data-dir with {name}.jsonl, or use --task FILE.jsonl "
            "(docs/zeroshot.md)")


def table(results: dict[str, dict], metric: str = "acc") -> str:
    """The papers' table: one column per task and the mean, in percent."""
    names = list(results)
    values = [100 * results[n].get(metric, float("nan")) for n in names]
    mean = sum(values) / len(values) if values else float("nan")
    widths = [max(len(n), 6) for n in names] + [6]
    head = "  ".join(f"{n:>{w}}" for n, w in zip([*names, "mean"], widths))
    row = "  ".join(f"{v:>{w}.2f}" for v, w in zip([*values, mean], widths))
    return f"{metric}\n{head}\n{row}"


def _bar(total: int, label: str, quiet: bool):
    """A progress callback (tqdm on a terminal; nothing otherwise, or with ``quiet``)."""
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None, lambda: None
    bar = tqdm(total=total, desc=label, unit="choice", file=sys.stderr, leave=False)
    return bar.update, bar.close
