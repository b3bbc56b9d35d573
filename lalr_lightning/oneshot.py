"""One-shot pruning and perplexity of a Hugging Face causal-LM directory (``prune``, ``perplexity``).

``python -m lalr_lightning prune MODEL_DIR --out OUT_DIR --sparsity 0.7 --criterion wanda
--preset alphapruning --calibration FILE`` streams the checkpoint: the model is built on the
meta device (no memory), only the modules before the first block (embeddings, rotary
position embeddings) are loaded to capture the calibration inputs, and then each block is
loaded from the safetensors files, calibrated, pruned, re-run (its outputs feed the next block)
and written to its own output shard before the next one is read
(:func:`lalr_lightning.core.calibration.run_blocks`). Memory: one block's weights, the
calibration activations and the embedding. ``--in-memory`` loads the whole model instead (the
same numbers; for comparison).

``python -m lalr_lightning perplexity MODEL_DIR --data FILE --seq-len 2048``: the evaluation of
Wanda / SparseGPT / AlphaPruning (``lib/eval.py``): the text tokenized as one sequence, cut into
``numel // seq_len`` non-overlapping windows (the remainder dropped), perplexity
``exp(sum_w seq_len * mean NLL_w / (n_windows * seq_len))``.

Conventions and the places they differ from the reference code: ``docs/llm_pruning.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lalr_lightning.core import llm_pruning
from lalr_lightning.core.calibration import (
    capture_block_inputs,
    decoder_blocks,
    linear_modules,
    run_blocks,
    set_weight_matrix,
    weight_matrix,
)

__all__ = [
    "calibration_samples",
    "perplexity",
    "perplexity_main",
    "prune_checkpoint",
    "prune_main",
    "prune_model",
    "read_text",
    "PruneReport",
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# files of a model directory that are weights (never copied: the output has its own shards)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")
_INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- text and samples


def read_text(path: str | os.PathLike, text_field: str = "text") -> tuple[list[str], bool]:
    """(documents, verbatim) of a text file: a ``.txt`` is one document, its content verbatim
    (save WikiText's split joined as the reference joins it and the tokens are the same); a
    ``.json`` / ``.jsonl`` gives one document per record (its ``text_field``), as C4's shards."""
    from lalr_lightning.data.causal_lm import read_records

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such file: {p}")
    if p.suffix.lower() not in (".txt", ".json", ".jsonl", ".ndjson"):
        raise ValueError(f"{p}: calibration and evaluation text must be a .txt, .json or .jsonl file")
    try:
        if p.suffix.lower() == ".txt":
            return [p.read_text(encoding="utf-8")], True
        records = read_records(str(p))
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); give a text "
                         "file (.txt) or JSON lines (.jsonl) in UTF-8") from None
    docs = []
    for i, rec in enumerate(records):
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{p}: record {i} has no string field {text_field!r}; name the field with --text-field")
        docs.append(text)
    if not docs:
        raise ValueError(f"{p} holds no records")
    return docs, False


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.as_tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def calibration_samples(tokenizer, path, n_samples: int, seq_len: int, seed: int = 0,
                        text_field: str = "text") -> torch.Tensor:
    """``(n_samples, seq_len)`` token windows drawn as AlphaPruning's ``lib/data.py`` draws them,
    with Python's ``random`` seeded by ``seed``:

    * documents (``.json`` / ``.jsonl``, C4's convention): draw a document uniformly until one has
      more than ``seq_len`` tokens, then a window start uniformly in ``[0, len - seq_len - 1]``;
    * one text (``.txt``, WikiText's convention): a window start uniformly in
      ``[0, len - seq_len - 1]`` of the whole file's tokens.
    """
    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"--n-samples and --seq-len must be >= 1, got {n_samples} and {seq_len}")
    docs, verbatim = read_text(path, text_field)
    rng = random.Random(seed)
    out = []
    if verbatim:
        ids = _encode(tokenizer, docs[0])
        if ids.numel() <= seq_len:
            raise ValueError(f"{path} has {ids.numel()} tokens, a calibration window needs more than --seq-len "
                             f"{seq_len}; lower --seq-len or use a longer file")
        for _ in range(n_samples):
            i = rng.randint(0, ids.numel() - seq_len - 1)
            out.append(ids[i:i + seq_len])
        return torch.stack(out)
    cache: dict[int, torch.Tensor] = {}
    longest = 0
    while len(out) < n_samples:
        d = rng.randint(0, len(docs) - 1)
        if d not in cache:
            cache[d] = _encode(tokenizer, docs[d])
            longest = max(longest, cache[d].numel())
        ids = cache[d]
        if ids.numel() > seq_len:
            i = rng.randint(0, ids.numel() - seq_len - 1)
            out.append(ids[i:i + seq_len])
        elif len(cache) == len(docs) and longest <= seq_len:
            raise ValueError(f"no record of {path} has more than --seq-len {seq_len} tokens (the longest has "
                             f"{longest}); lower --seq-len or use a file with longer documents")
    return torch.stack(out)


# ----------------------------------------------------------------------------- checkpoint access


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


def _load_config(model_dir: Path):
    from transformers import AutoConfig

    if not model_dir.is_dir():
        raise FileNotFoundError(f"no such model directory: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; give a Hugging Face model directory "
                                "(save_pretrained's output)")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError by what is wrong
        raise ValueError(f"{model_dir / 'config.json'}: not a readable Hugging Face config ({_first_line(e)})") from None


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / TypeError by tokenizer kind
        raise ValueError(f"{model_dir}: cannot load its tokenizer ({_first_line(e)}); save the tokenizer next to the "
                         "weights (tokenizer.save_pretrained(MODEL_DIR))") from None


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite. A NaN or Inf anywhere makes the sum NaN or Inf, and
    one reduction is ~100x faster than ``isfinite(t).all()`` on a CPU (no bool tensor); a sum that
    overflows although every value is finite is settled by the exact check."""
    return not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _unreadable(file, e: BaseException) -> ValueError:
    # safetensors' SafetensorError is a bare Exception: one line naming the file instead of its traceback
    return ValueError(f"{file}: not a readable safetensors file ({_first_line(e)}); the file is damaged or "
                      "incomplete: copy or download it again")


class _Checkpoint:
    """The tensors of a safetensors model directory, by key, read one at a time. Every shard's
    header is read here (a damaged file is one line naming it); :meth:`check_values` reads every
    value."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        from lalr_lightning.core.checkpoints import safetensors_files

        self.files = safetensors_files(model_dir)
        self.where: dict[str, tuple[Path, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        self.where[k] = (f, sl.get_dtype())
                        self.shapes[k] = tuple(sl.get_shape())
            except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
                raise _unreadable(f, e) from None
        index = model_dir / _INDEX
        if index.is_file():  # the index must name every tensor where it is
            weight_map = json.loads(index.read_text())["weight_map"]  # readable: safetensors_files parsed it
            wrong = [k for k, f in weight_map.items() if k not in self.where or self.where[k][0].name != f]
            if wrong:
                raise ValueError(f"{index} names {len(wrong)} tensor(s) its shards do not hold where it says "
                                 f"(first: {wrong[0]!r} in {weight_map[wrong[0]]}); the index and the shards do not match")

    def get(self, key: str, device="cpu") -> torch.Tensor:
        from safetensors import safe_open

        f, _ = self.where[key]
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as h:
                return h.get_tensor(key)
        except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
            raise _unreadable(f, e) from None

    def dtype(self, key: str) -> torch.dtype:
        return _ST_DTYPES.get(self.where[key][1], torch.float32)

    def stored_dtype(self) -> torch.dtype | None:
        return next((self.dtype(k) for k in self.where if self.dtype(k).is_floating_point), None)

    def check_values(self, keys=None, log=None) -> None:
        """Read every tensor (of ``keys``; default all) once and refuse a non-finite one, naming it."""
        from safetensors import safe_open

        todo = set(self.where if keys is None else keys)
        t0 = time.perf_counter()
        for f in self.files:
            mine = [k for k in self.where if self.where[k][0] == f and k in todo]
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in mine:
                        t = h.get_tensor(k)
                        if not _finite(t):
                            bad = int((~torch.isfinite(t)).sum())
                            raise ValueError(f"{k} in {f.name} holds {bad} NaN or Inf value(s) of {t.numel()}: the "
                                             "checkpoint itself is broken (nothing has run yet); fix or re-export it")
                        del t
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
                raise _unreadable(f, e) from None
        if log is not None and time.perf_counter() - t0 > 2:  # say where the time went on a large checkpoint
            log(f"checked {len(todo)} tensors: all finite ({time.perf_counter() - t0:.1f} s)")


@dataclass
class PruneReport:
    """What :func:`prune_checkpoint` / :func:`prune_model` did: the target ratio and the achieved
    zero fraction of every pruned matrix (by parameter-module name), the metric values used for
    the ratios (empty: uniform), and the matrices' sizes."""

    ratios: dict[str, float] = field(default_factory=dict)
    sparsity: dict[str, float] = field(default_factory=dict)
    numels: dict[str, int] = field(default_factory=dict)
    metric: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def overall(self) -> float:
        total = sum(self.numels.values())
        return sum(self.sparsity[k] * self.numels[k] for k in self.sparsity) / max(total, 1)

    def table(self) -> str:
        width = max((len(k) for k in self.sparsity), default=5)
        lines = [f"{'layer':<{width}}  {'target':>7}  {'sparsity':>8}"]
        lines += [f"{k:<{width}}  {self.ratios[k]:7.4f}  {v:8.4f}" for k, v in self.sparsity.items()]
        lines.append(f"{'overall':<{width}}  {self._target():7.4f}  {self.overall:8.4f}")
        return "\n".join(lines)

    def _target(self) -> float:
        total = sum(self.numels.values())
        return sum(self.ratios[k] * self.numels[k] for k in self.ratios) / max(total, 1)


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the meta device (no memory), or one line saying why not."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # e.g. BERT's "add is_decoder=True" advice: the block check below speaks
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError, TypeError):  # no causal-LM class for this config (T5, ...)
        raise ValueError(f"{getattr(config, 'model_type', '?')} ({type(config).__name__}) is not a causal language "
                         "model: AutoModelForCausalLM has no class for it; prune and perplexity take decoder-only LMs "
                         "(LLaMA, OPT, GPT-2, GPT-NeoX layouts)") from None
    finally:
        hf_logging.set_verbosity(level)
    return model.eval()


class _Streamed:
    """A causal LM built on the meta device whose tensors are loaded from the checkpoint on demand."""

    def __init__(self, model_dir: Path, config, device: torch.device, dtype: torch.dtype,
                 ckpt: _Checkpoint | None = None, blocks: bool = True):
        from lalr_lightning.core.calibration import _check_uniform_attention

        self.ckpt = ckpt or _Checkpoint(model_dir)
        self.model_dir = model_dir
        self.config = config
        self.device, self.dtype = device, dtype
        self.model = _meta_model(config, dtype)
        self.path, self.blocks = None, nn.ModuleList()
        if blocks:  # streaming needs the block layout; checking what a directory holds does not (perplexity)
            self.path, self.blocks = decoder_blocks(self.model)
            _check_uniform_attention(self.model)
        names = set(self.model.state_dict(keep_vars=True))
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        # checkpoints written by a base model (GPT-2 on the Hub: "h.0...") lack the head's prefix
        self.strip = bool(prefix) and not any(k.startswith(prefix + ".") for k in self.ckpt.where) \
            and any(n.startswith(prefix + ".") for n in names)
        self.prefix = prefix

    def key(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.strip and name.startswith(self.prefix + ".") else name

    def validate(self) -> None:
        """Refuse a checkpoint that lacks a tensor the config implies (a tied head may be stored
        once, under either name), holds one with another shape, or holds more blocks than the
        config has: each would give a model with randomly initialised or dropped weights."""
        named = self.model.state_dict(keep_vars=True)
        where = self.ckpt.where
        missing = []
        for name, t in named.items():
            key = self.key(name)
            if key not in where:
                if not any(u is t and self.key(o) in where for o, u in named.items() if o != name):
                    missing.append(key)
                continue
            shape = self.ckpt.shapes[key]
            if shape != tuple(t.shape):
                raise ValueError(
                    f"{key} has shape {shape} in {where[key][0].name}, but config.json implies {tuple(t.shape)}: the "
                    "config does not describe these weights (check hidden_size, intermediate_size, the head counts "
                    "and vocab_size)")
        if missing:
            head = self.model.get_output_embeddings()
            untied = head is not None and any(self.key(n) in missing and u is head.weight for n, u in named.items())
            hint = (" config.json has tie_word_embeddings=False, so the output head is a tensor of its own;"
                    if untied else "")
            raise ValueError(
                f"{self.model_dir}: the weights do not cover the model: {len(missing)} tensor(s) that "
                f"{type(self.model).__name__} needs are not in the checkpoint ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''});{hint} a model built from it would hold randomly "
                "initialised tensors")
        if self.path is None:
            return
        pre = self.key(self.path) + "."
        found = {int(k[len(pre):].split(".", 1)[0]) for k in where
                 if k.startswith(pre) and k[len(pre):].split(".", 1)[0].isdigit()}
        if found and max(found) >= len(self.blocks):
            raise ValueError(f"the checkpoint holds blocks {self.path}.0-{max(found)}, config.json describes "
                             f"{len(self.blocks)} (num_hidden_layers): the config does not match the weights")

    def _load_module(self, module: nn.Module, qual: str) -> None:
        """Load every persistent tensor of ``module`` (qualified name ``qual``) from the checkpoint;
        rebuild the submodules that hold computed (non-persistent) buffers from the config."""
        for name, sub in list(module.named_modules()):
            if getattr(sub, "_non_persistent_buffers_set", None):
                self._rebuild(module, name, sub)
        for name, t in module.state_dict(keep_vars=True).items():
            full = f"{qual}.{name}" if qual else name
            key = self.key(full)
            if key not in self.ckpt.where:
                raise ValueError(f"the checkpoint has no tensor {key!r} (needed by {type(self.model).__name__})")
            value = self.ckpt.get(key).to(self.device, self.dtype if t.is_floating_point() else t.dtype)
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if attr in owner._parameters:
                owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[attr] = value
    def _rebuild(self, root: nn.Module, name: str, sub: nn.Module) -> None:
        try:
            with torch.device(self.device):
                fresh = type(sub)(config=self.config)
        except Exception as e:
            raise ValueError(f"cannot stream {type(self.model).__name__}: its {type(sub).__name__} holds computed "
                             f"buffers it cannot rebuild from the config ({e}); use --in-memory") from None
        if name:
            parent_name, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent_name), attr, fresh.to(self.device))
        else:
            raise ValueError(f"cannot stream a block that holds computed buffers ({type(sub).__name__}); use --in-memory")

    def load_stem(self) -> None:
        """Everything outside the blocks but the output head (not needed before the last block)."""
        head = self.model.get_output_embeddings()
        skip = {id(m) for m in self.blocks.modules()} | ({id(head)} if head is not None else set())
        for qual, mod in list(self.model.named_modules()):
            if id(mod) in skip:
                continue
            own = [n for n in list(mod._parameters) + list(mod._buffers) if n not in mod._non_persistent_buffers_set]
            for n in own:
                full = f"{qual}.{n}" if qual else n
                t = mod._parameters.get(n, mod._buffers.get(n))
                if t is None:
                    continue
                key = self.key(full)
                if key not in self.ckpt.where:
                    raise ValueError(f"the checkpoint has no tensor {key!r} (needed by {type(self.model).__name__})")
                value = self.ckpt.get(key).to(self.device, self.dtype if t.is_floating_point() else t.dtype)
                if n in mod._parameters:
                    mod._parameters[n] = nn.Parameter(value, requires_grad=False)
                else:
                    mod._buffers[n] = value
            if mod._non_persistent_buffers_set and qual:
                self._rebuild(self.model, qual, mod)

    def block(self, i: int) -> nn.Module:
        blk = self.blocks[i]
        self._load_module(blk, f"{self.path}.{i}")
        return blk

    def block_keys(self, i: int) -> list[str]:
        pre = self.key(f"{self.path}.{i}") + "."
        return [k for k in self.ckpt.where if k.startswith(pre)]

    def free(self, i: int) -> None:
        self.blocks[i].to("meta")

    def free_stem(self) -> None:
        """Drop what :meth:`load_stem` loaded (the embedding and the rest): once the first block's
        inputs are captured the calibration needs only the blocks, and the output copies the
        stem's tensors from the checkpoint."""
        inside = {id(m) for m in self.blocks.modules()}
        for mod in self.model.modules():
            if id(mod) in inside:
                continue
            for table in (mod._parameters, mod._buffers):
                for k, t in table.items():
                    if t is not None and t.device.type != "meta":
                        table[k] = nn.Parameter(t.to("meta"), requires_grad=False) if isinstance(t, nn.Parameter) \
                            else t.to("meta")


# ----------------------------------------------------------------------------- ratios


def _check_prune_args(sparsity: float | None, criterion: str, n: int, m: int, preset, metric, epsilon=None,
                      blocksize: int | None = None, percdamp: float | None = None) -> float:
    """Every argument of a prune that needs no file, checked before anything is read or written;
    returns the target sparsity (``n / m`` for N:M; 0.5 when left out)."""
    from lalr_lightning.core.pruning import PRUNING_METRICS

    n, m = llm_pruning.check_nm(n, m)
    if criterion not in llm_pruning.CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; valid: {', '.join(llm_pruning.CRITERIA)}")
    if m and (preset is not None or metric is not None):
        raise ValueError(f"N:M sparsity prunes every layer to n/m = {n}/{m}; per-layer ratios (--preset / --metric) "
                         "do not apply (AlphaPruning's ratios are for unstructured sparsity)")
    if m and sparsity is not None and not math.isclose(float(sparsity), n / m):
        raise ValueError(f"N:M sparsity {n}:{m} prunes exactly n/m = {n / m:g} of every layer; --sparsity {sparsity} "
                         "does not apply: leave it out")
    sparsity = n / m if m else 0.5 if sparsity is None else float(sparsity)
    if not m and not (0.0 <= sparsity < 1.0):
        raise ValueError(f"--sparsity must be in [0, 1) (the fraction of the blocks' linear weights set to zero), "
                         f"got {sparsity}")
    if metric is not None and metric not in PRUNING_METRICS:
        raise ValueError(f"unknown --metric {metric!r}; valid: {', '.join(PRUNING_METRICS)}")
    if epsilon is not None:
        if preset is None and metric is None:
            raise ValueError("--epsilon spreads per-layer ratios (--preset or --metric); uniform pruning has none: "
                             "leave it out or add --preset alphapruning")
        if not 0.0 <= float(epsilon) <= 1.0:  # NaN fails too
            raise ValueError(f"--epsilon must be in [0, 1] (ratios spread over [1 - eps, 1 + eps] x the target), "
                             f"got {epsilon}")
    used = criterion == "sparsegpt"
    for flag, value in (("--blocksize", blocksize), ("--percdamp", percdamp)):
        if value is not None and not used:
            raise ValueError(f"{flag} is SparseGPT's; --criterion {criterion} does not use it: leave it out")
    if blocksize is not None and (isinstance(blocksize, bool) or int(blocksize) != blocksize or blocksize < 1):
        raise ValueError(f"--blocksize must be an integer >= 1 (SparseGPT's columns per block), got {blocksize}")
    if percdamp is not None and not (0.0 <= float(percdamp) < math.inf):
        raise ValueError(f"--percdamp must be >= 0 (SparseGPT adds percdamp x mean(diag H) to the diagonal), "
                         f"got {percdamp}")
    if used and m and (blocksize or 128) % m:
        raise ValueError(f"N:M sparsity with m={m} needs --blocksize ({blocksize or 128}) to be a multiple of m")
    return sparsity


def _ratio_settings(preset, metric, epsilon):
    """(metric, epsilon, fit, filter_zeros, block_average) or None for uniform ratios."""
    if preset is None and metric is None:
        return None
    from lalr_lightning.callbacks.pruning import PRESETS

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(repr(p) for p in PRESETS if p)}")
    fill = PRESETS[preset]
    eps = fill["epsilon"] if epsilon is None else float(epsilon)
    return (fill["metric"] if metric is None else metric, eps, fill["fit"], fill["filter_zeros"],
            fill["block_average"])


def _block_metric(block: nn.Module, qual: str, metric: str, fit: str, filter_zeros: bool) -> dict[str, float]:
    import warnings

    from lalr_lightning.core import spectral
    from lalr_lightning.core.layers import Layer

    layers = [Layer(f"{qual}.{n}", "hf_conv1d" if type(mod).__name__ == "Conv1D" else "linear", mod)
              for n, mod in linear_modules(block).items()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        df = spectral.analyze(layers, fit=fit, metrics=[metric], min_evals=1, filter_zeros=filter_zeros)
    values = dict(zip(df["name"], df[metric].astype(float)))
    bad = {k: v for k, v in values.items() if not math.isfinite(v)}
    if bad:
        raise ValueError(f"metric {metric!r} is not finite for {sorted(bad)[:3]} (all-zero or constant weights?); "
                         "choose another metric or prune uniformly")
    return values


def _ratios(settings, metric_values: dict[str, float], groups: list[list[str]], numels: dict[str, int],
            sparsity: float) -> dict[str, float]:
    from lalr_lightning.core.pruning import block_average_values, pruning_ratios

    names = list(numels)
    if settings is None:
        return {k: float(sparsity) for k in names}
    _, eps, _, _, block_average = settings
    values = block_average_values(metric_values, groups) if block_average else dict(metric_values)
    r = pruning_ratios([values[k] for k in names], [numels[k] for k in names], sparsity, eps)
    return dict(zip(names, r.tolist()))


# ----------------------------------------------------------------------------- prune


def _pruner(report: PruneReport, qual_of, criterion: str, n: int, m: int, blocksize: int, percdamp: float):
    def prune_block(index: int, block: nn.Module, stats) -> None:
        for name, mod in linear_modules(block).items():
            qual = qual_of(index, name)
            w = weight_matrix(mod)
            st = None if stats is None else stats.pop(name)
            new, _ = llm_pruning.prune_weight(w, criterion, report.ratios[qual], st, n=n, m=m,
                                              blocksize=blocksize, percdamp=percdamp)
            del st
            set_weight_matrix(mod, new)
            del new
            if not _finite(weight_matrix(mod)):  # e.g. SparseGPT's update overflowing float16
                raise ValueError(f"pruning made {qual} non-finite in {w.dtype}; prune with --dtype float32")
            report.sparsity[qual] = float((weight_matrix(mod) == 0).sum()) / w.numel()
    return prune_block


def _batches(samples: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [samples[i:i + batch_size] for i in range(0, samples.shape[0], batch_size)]


def prune_model(
    model: nn.Module,
    samples: torch.Tensor | None,
    *,
    sparsity: float | None = None,
    criterion: str = "wanda",
    n: int = 0,
    m: int = 0,
    preset: str | None = None,
    metric: str | None = None,
    epsilon: float | None = None,
    batch_size: int = 8,
    blocksize: int | None = None,
    percdamp: float | None = None,
) -> PruneReport:
    """Prune a loaded Hugging Face causal LM in place, block by block (the in-memory twin of
    :func:`prune_checkpoint`; the same ratios and masks). ``samples``: ``(n, seq_len)`` token ids
    (None for magnitude). ``sparsity``: default 0.5 (``n / m`` with N:M, which fixes it);
    ``blocksize`` / ``percdamp``: SparseGPT's (default 128 and 0.01)."""
    sparsity = _check_prune_args(sparsity, criterion, n, m, preset, metric, epsilon, blocksize, percdamp)
    blocksize, percdamp = 128 if blocksize is None else int(blocksize), 0.01 if percdamp is None else float(percdamp)
    settings = _ratio_settings(preset, metric, epsilon)
    t0 = time.perf_counter()
    path, blocks = decoder_blocks(model)
    report = PruneReport()
    groups = []
    for i, blk in enumerate(blocks):
        mods = linear_modules(blk)
        groups.append([f"{path}.{i}.{k}" for k in mods])
        report.numels.update({f"{path}.{i}.{k}": mod.weight.numel() for k, mod in mods.items()})
        if settings is not None:
            report.metric.update(_block_metric(blk, f"{path}.{i}", settings[0], settings[2], settings[3]))
    report.ratios = _ratios(settings, report.metric, groups, report.numels, sparsity)
    needs = llm_pruning.needs_stats(criterion)
    if needs and samples is None:
        raise ValueError(f"criterion {criterion!r} needs calibration samples")
    use_cache = getattr(model.config, "use_cache", None)
    was_training = model.training
    model.eval()
    try:
        inputs = []
        if needs:
            device = next(model.parameters()).device
            inputs = capture_block_inputs(model, _batches(samples, batch_size), device=device)
        run_blocks(blocks, inputs, _pruner(report, lambda i, k: f"{path}.{i}.{k}", criterion, n, m, blocksize,
                                           percdamp),
                   stats=needs, hessian=criterion == "sparsegpt")
        del inputs
    finally:
        model.train(was_training)
        if use_cache is not None:
            model.config.use_cache = use_cache
    report.seconds = time.perf_counter() - t0
    return report


def _resolve_device(device: str | None) -> torch.device:
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {_first_line(e)}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA GPU is available; use --device cpu")
    return dev


def _resolve_dtype(dtype: str, device: torch.device, stored: torch.dtype | None) -> torch.dtype:
    if dtype == "auto":
        return (stored or torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _check_out(model_dir: Path, out_dir: Path) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise ValueError("--out must be a new directory, not the model directory itself")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"--out {out_dir} exists and is not an empty directory; choose a new one")


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on ``device`` now (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None


def _check_calibration_memory(n_samples: int, seq_len: int, hidden: int, dtype: torch.dtype,
                              device: torch.device) -> None:
    """Refuse a calibration whose activations (one copy: ``run_blocks`` replaces each batch by
    its output) cannot fit, before drawing it: a clear line instead of an allocator's."""
    size = torch.finfo(dtype).bits // 8
    need = n_samples * seq_len * (hidden * size + 8)  # hidden states and the token ids
    free = _available_bytes(device)
    if free is not None and need > free:
        raise ValueError(
            f"--n-samples {n_samples} x --seq-len {seq_len} calibration tokens need {need / 2**30:.1f} GiB for their "
            f"activations (hidden {hidden} x {size} bytes each, plus the ids) and {device} has {free / 2**30:.1f} GiB "
            "free; lower --n-samples or --seq-len")


def _copy_side_files(model_dir: Path, out_dir: Path, overwrite: bool = True) -> None:
    """config, generation config, tokenizer files: everything but the weights and their index."""
    for f in model_dir.iterdir():
        if (f.is_file() and f.suffix not in _WEIGHT_SUFFIXES and not f.name.endswith(".index.json")
                and (overwrite or not (out_dir / f.name).exists())):
            shutil.copy2(f, out_dir / f.name)


def _write_report(out_dir: Path, report: PruneReport, settings: dict) -> None:
    (out_dir / "pruning.json").write_text(json.dumps(
        {**settings, "ratios": report.ratios, "achieved": report.sparsity, "overall": report.overall,
         "metric_values": report.metric}, indent=2) + "\n")


def _verify_output(out_dir: Path, source: _Checkpoint | None, config) -> None:
    """The written directory before it is renamed into place: every shard readable, every tensor
    the config implies present with its shape (and, for a streamed prune, exactly the source's
    tensors in their stored dtypes)."""
    written = _Checkpoint(out_dir)
    check = _Streamed(out_dir, config, torch.device("cpu"), torch.float32, ckpt=written)
    check.validate()
    if source is None:
        return
    lost = sorted(set(source.where) - set(written.where))
    extra = sorted(set(written.where) - set(source.where))
    changed = [k for k in source.where if k in written.where
               and (written.shapes[k] != source.shapes[k] or written.where[k][1] != source.where[k][1])]
    if lost or extra or changed:
        raise RuntimeError(f"the written model differs from the source in its tensors (missing {lost[:3]}, extra "
                           f"{extra[:3]}, other shape or dtype {changed[:3]}); please report this")


def prune_checkpoint(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    sparsity: float | None = None,
    criterion: str = "wanda",
    n: int = 0,
    m: int = 0,
    preset: str | None = None,
    metric: str | None = None,
    epsilon: float | None = None,
    calibration: str | os.PathLike | None = None,
    n_samples: int = 128,
    seq_len: int = 2048,
    seed: int = 0,
    text_field: str = "text",
    device: str | None = None,
    dtype: str = "auto",
    batch_size: int = 8,
    blocksize: int | None = None,
    percdamp: float | None = None,
    in_memory: bool = False,
    log=None,
) -> PruneReport:
    """Prune the causal LM in ``model_dir`` and write the pruned model to ``out_dir`` (module
    docstring). Returns the :class:`PruneReport`; ``log`` receives progress lines.

    Everything that can be checked is checked before the first block: the arguments, the
    architecture, every tensor the config implies (present, with its shape) and every value
    (finite), the calibration file and whether its activations fit. The output is written to a
    temporary sibling of ``out_dir`` and renamed into place once complete and checked
    (:class:`lalr_lightning.outdir.OutputClaim`): a failure or an interrupt leaves no ``out_dir``
    (or the empty one that was there), and a second run into the same ``out_dir`` is refused.
    """
    from lalr_lightning.outdir import OutputClaim

    say = log or (lambda s: None)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    # 1. arguments, the architecture and every tensor: nothing is written, nothing calibrated yet
    sparsity = _check_prune_args(sparsity, criterion, n, m, preset, metric, epsilon, blocksize, percdamp)
    given = dict(blocksize=blocksize, percdamp=percdamp)  # prune_model checks them again (None: not given)
    blocksize, percdamp = 128 if blocksize is None else int(blocksize), 0.01 if percdamp is None else float(percdamp)
    for flag, value in (("--n-samples", n_samples), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    settings = _ratio_settings(preset, metric, epsilon)
    dev = _resolve_device(device)
    config = _load_config(model_dir)
    _check_out(model_dir, out_dir)
    needs = llm_pruning.needs_stats(criterion)
    if needs and calibration is None:
        raise ValueError(f"criterion {criterion!r} needs --calibration FILE (text or JSON lines, e.g. a C4 shard)")
    if calibration is not None and not Path(calibration).is_file():
        raise FileNotFoundError(f"no such calibration file: {calibration}" + (
            "" if needs else f" (--criterion {criterion} does not read one: leave --calibration out)"))
    if not needs and calibration is not None:
        say(f"note: --criterion {criterion} prunes by the weights alone; --calibration {calibration} (and --n-samples, "
            "--seq-len, --seed, --batch-size) are not used")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if needs and max_pos and seq_len > max_pos:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's {max_pos} positions; lower --seq-len")
    ckpt = _Checkpoint(model_dir)
    cdtype = _resolve_dtype(dtype, dev, ckpt.stored_dtype())
    sm = _Streamed(model_dir, config, dev, cdtype, ckpt=ckpt)
    sm.validate()
    ckpt.check_values(log=say)
    if needs:
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
        _check_calibration_memory(int(n_samples), int(seq_len), int(hidden), cdtype, dev)
    written = {"criterion": criterion, "sparsity": sparsity, "n": n, "m": m, "preset": preset,
               "metric": None if settings is None else settings[0], "epsilon": None if settings is None else settings[1]}
    # 2. claim --out (or learn who holds it), then work in a temporary sibling
    claim = OutputClaim(out_dir, command=f"prune {model_dir} --out {out_dir} --criterion {criterion} --sparsity "
                                         f"{sparsity:g}", log=say)
    with claim as tmp:
        samples = None
        if needs:
            tokenizer = _load_tokenizer(model_dir)
            samples = calibration_samples(tokenizer, calibration, n_samples, seq_len, seed, text_field)
            say(f"calibration: {samples.shape[0]} windows of {samples.shape[1]} tokens from {calibration}")
        t0 = time.perf_counter()
        if in_memory:
            report = _prune_in_memory(model_dir, tmp, samples, cdtype, dev, ckpt.stored_dtype(), sparsity=sparsity,
                                      criterion=criterion, n=n, m=m, preset=preset, metric=metric, epsilon=epsilon,
                                      batch_size=batch_size, **given)
        else:
            report = _prune_streamed(sm, tmp, samples, settings, sparsity, criterion, n, m, batch_size, blocksize,
                                     percdamp, say)
        _copy_side_files(model_dir, tmp, overwrite=not in_memory)  # save_pretrained wrote its own config
        report.seconds = time.perf_counter() - t0
        _write_report(tmp, report, written)
        _verify_output(tmp, None if in_memory else ckpt, config)
        claim.commit()
    return report


def _prune_in_memory(model_dir: Path, tmp: Path, samples, cdtype, dev, stored, **kw) -> PruneReport:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=cdtype).to(dev)
    report = prune_model(model, samples, **kw)
    model.to(stored or torch.float32).save_pretrained(str(tmp))
    return report


def _prune_streamed(sm: _Streamed, tmp: Path, samples, settings, sparsity, criterion, n, m, batch_size, blocksize,
                    percdamp, say) -> PruneReport:
    from safetensors.torch import save_file

    nb = len(sm.blocks)
    report = PruneReport()
    groups = []
    for i in range(nb):  # sizes from the meta skeleton; metric from each block loaded in turn
        mods = linear_modules(sm.blocks[i])
        groups.append([f"{sm.path}.{i}.{k}" for k in mods])
        report.numels.update({f"{sm.path}.{i}.{k}": weight_matrix(mod).numel() for k, mod in mods.items()})
    if settings is not None:
        for i in range(nb):
            report.metric.update(_block_metric(sm.block(i), f"{sm.path}.{i}", settings[0], settings[2], settings[3]))
            sm.free(i)
    report.ratios = _ratios(settings, report.metric, groups, report.numels, sparsity)
    width = len(str(nb + 1))
    total = nb + 1

    def shard(j: int) -> str:
        return f"model-{j:0{max(5, width)}d}-of-{total:0{max(5, width)}d}.safetensors"

    weight_map: dict[str, str] = {}
    size = 0

    def write(j: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal size
        name = shard(j)
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / name), metadata={"format": "pt"})
        except Exception as e:  # noqa: BLE001 -- OSError (full disk), SafetensorError
            raise OSError(f"cannot write {tmp / name}: {_first_line(e)}") from None
        weight_map.update({k: name for k in tensors})
        size += sum(v.numel() * v.element_size() for v in tensors.values())

    def release(i: int, block: nn.Module) -> None:
        keys = sm.block_keys(i)
        state = {sm.key(f"{sm.path}.{i}.{k}"): v for k, v in block.state_dict().items()}
        out = {}
        for k in keys:  # every stored tensor of the block, in its stored dtype
            out[k] = state[k].detach().to("cpu", sm.ckpt.dtype(k)) if k in state else sm.ckpt.get(k)
        write(i + 2, out)
        del state, out
        sm.free(i)
        say(f"block {i + 1}/{nb} pruned")

    stats = llm_pruning.needs_stats(criterion)
    inputs = []
    if stats:
        sm.load_stem()
        inputs = capture_block_inputs(sm.model, _batches(samples, batch_size), device=sm.device)
        sm.free_stem()
    # run_blocks replaces each batch by the block's output in this list: one copy of the activations
    run_blocks(nb, inputs, _pruner(report, lambda i, k: f"{sm.path}.{i}.{k}", criterion, n, m, blocksize, percdamp),
               stats=stats, hessian=criterion == "sparsegpt", materialize=sm.block, release=release)
    del inputs
    block_keys = {k for i in range(nb) for k in sm.block_keys(i)}
    write(1, {k: sm.ckpt.get(k) for k in sm.ckpt.where if k not in block_keys})
    (tmp / _INDEX).write_text(json.dumps({"metadata": {"total_size": size},
                                          "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    return report


# ----------------------------------------------------------------------------- perplexity


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int, batch_size: int = 1,
               max_windows: int | None = None) -> tuple[float, int]:
    """(perplexity, windows) of a causal LM on the token sequence ``ids`` (1-D or ``(1, N)``):
    ``N // seq_len`` non-overlapping windows, the remainder dropped; each window's mean next-token
    NLL (over its ``seq_len - 1`` predictions) weighted by ``seq_len``, as ``lib/eval.py``.
    ``max_windows``: only the first ones (the reference's C4 evaluation keeps 256). A loss that is
    not finite is an error naming the windows, never a ``nan`` perplexity."""
    ids = ids.reshape(-1)
    windows = ids.numel() // seq_len
    if max_windows is not None:
        windows = min(windows, int(max_windows))
    if windows < 1:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}; "
                         "lower --seq-len or use a longer file")
    if seq_len < 2:
        raise ValueError("--seq-len must be >= 2 (a window predicts its tokens after the first)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        for start in range(0, windows, batch_size):
            stop = min(start + batch_size, windows)
            x = ids[start * seq_len:stop * seq_len].reshape(stop - start, seq_len).to(device)
            logits = model(input_ids=x, use_cache=False).logits.float()
            nll = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                          x[:, 1:].reshape(-1)))
            if not math.isfinite(nll):
                dtype = next(model.parameters()).dtype
                fix = ("evaluate with --dtype float32" if dtype in (torch.float16, torch.bfloat16)
                       else "the weights are finite but too large for it: check how they were produced")
                raise ValueError(f"the loss of window(s) {start}-{stop - 1} is {nll}: the forward overflows "
                                 f"{str(dtype).replace('torch.', '')} (a perplexity would be meaningless); {fix}")
            total += nll * seq_len * (stop - start)
    finally:
        model.train(was_training)
    ppl = math.exp(float(total) / (windows * seq_len))
    return ppl, windows


def _check_loaded(model: nn.Module, sm: _Streamed, dtype: torch.dtype) -> None:
    """Every floating tensor of the loaded model finite, or one line naming the first that is not and
    whether the checkpoint holds the bad value or the cast to ``dtype`` made it."""
    for name, t in model.state_dict().items():
        if _finite(t):
            continue
        key = sm.key(name)
        stored = sm.ckpt.get(key) if key in sm.ckpt.where else None
        if stored is None or not _finite(stored):
            raise ValueError(f"{key} holds NaN or Inf values in the checkpoint: the model is broken, a perplexity "
                             "of it means nothing; fix or re-export the weights")
        raise ValueError(f"{key} overflows {dtype} (its largest |value| is {float(stored.abs().max()):.3g}); "
                         "evaluate with --dtype float32")


def _load_evaluated(model_dir: Path, config, dev: torch.device, dtype_name: str):
    """The model to evaluate, loaded only from a checkpoint that covers it (no randomly
    initialised tensor) and whose values are finite in the compute dtype."""
    from transformers import AutoModelForCausalLM

    ckpt = _Checkpoint(model_dir)
    dtype = _resolve_dtype(dtype_name, dev, ckpt.stored_dtype())
    sm = _Streamed(model_dir, config, dev, dtype, ckpt=ckpt, blocks=False)
    sm.validate()
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype,
                                                       output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):  # validate() should have said so already
        raise ValueError(f"{model_dir}: the weights do not cover the model (missing "
                         f"{sorted(info.get('missing_keys') or [])[:3]}, mismatched "
                         f"{[k[0] if isinstance(k, tuple) else k for k in info.get('mismatched_keys') or []][:3]})")
    _check_loaded(model, sm, dtype)
    return model.to(dev)


# ----------------------------------------------------------------------------- commands


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
    from lalr_lightning.core.pruning import PRUNING_METRICS

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
    p.add_argument("--criterion", default="wanda", choices=llm_pruning.CRITERIA,
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
    args = p.parse_args(argv)
    _quiet_transformers()
    out = Path(args.out).absolute()
    import signal
    import threading

    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        report = prune_checkpoint(
            args.model, args.out, sparsity=args.sparsity, criterion=args.criterion, n=args.n, m=args.m,
            preset=args.preset, metric=args.metric, epsilon=args.epsilon, calibration=args.calibration,
            n_samples=args.n_samples, seq_len=args.seq_len, seed=args.seed, text_field=args.text_field,
            device=args.device, dtype=args.dtype, batch_size=args.batch_size, blocksize=args.blocksize,
            percdamp=args.percdamp, in_memory=args.in_memory, log=lambda s: print(s, file=sys.stderr),
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
    args = p.parse_args(argv)
    _quiet_transformers()
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
