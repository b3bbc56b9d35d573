"""Causal language-model fine-tuning data from local files, or an offline generated corpus.

Files (the format comes from the extension):

* ``.txt`` -- every non-empty line is one text example.
* ``.jsonl`` / ``.ndjson`` -- one JSON object per line.
* ``.json`` -- a list of objects (Alpaca's layout), or an object with an ``instances`` list
  (LMFlow's ``{"type": ..., "instances": [...]}``).

A JSON record is a **text** example when it has ``text_field`` (``"text"``), an **instruction**
example when it has ``instruction_field`` (``"instruction"``) and a response field
(``response_field``; default ``"response"``, else ``"output"``). An instruction example becomes
``prompt + response`` with the prompt written by ``template`` (``{instruction}``) or, when the
record has a non-empty ``input_field``, by ``template_with_input`` (``{instruction}``,
``{input}``). By default both are Alpaca's prompt::

    ### Instruction:
    {instruction}

    ### Input:            <- only in template_with_input
    {input}

    ### Response:
    <response>

and the loss covers only the response (``train_on_prompt=False``: prompt tokens get label -100).

Tokenization uses the tokenizer's own special tokens (LLaMA's ``<s>``, BERT's ``[CLS] ... [SEP]``)
and appends EOS when the tokenizer has one (``add_eos``), so the model learns where an answer
ends. Examples are cut to ``block_size`` tokens (the start is kept); with ``packing`` all examples
are concatenated and cut into ``block_size`` blocks instead (for plain text corpora). Batches are
padded on the right to their longest example: ``input_ids``, ``attention_mask`` (0 on padding)
and ``labels`` (-100 on padding and masked prompt tokens).

Without ``data_files`` the datamodule generates an offline corpus (:func:`offline_corpus`):
sentences of a small deterministic grammar -- subject-verb agreement, small sums, counting --
written once as JSONL to ``cache_dir`` and read back like any other file, so the offline
configs and tests need nothing downloaded. Its words are all in the packaged MiniLM tokenizer's
vocabulary (the default ``tokenizer``).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lalr_lightning.data._common import SplitLoaders, check_loader_args
from lalr_lightning.data._files import default_cache_dir, expand, split_map, write_lines_atomic
from lalr_lightning.records import read_records
from lalr_lightning.text_assets import is_local, resolve_model_name

__all__ = [
    "CausalLMDataModule",
    "DEFAULT_TEMPLATE",
    "DEFAULT_TEMPLATE_WITH_INPUT",
    "GRAMMAR_WORDS",
    "IGNORE_INDEX",
    "TokenizedLM",
    "collate_lm",
    "default_cache_dir",
    "offline_corpus",
    "read_records",
    "word_tokenizer",
    "write_offline_corpus",
]

IGNORE_INDEX = -100
DEFAULT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
DEFAULT_TEMPLATE_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_EXTENSIONS = (".txt", ".json", ".jsonl", ".ndjson")
_CORPUS_VERSION = 1
#: ``tokenizer`` names meaning the word-level tokenizer of the offline grammar (:func:`word_tokenizer`)
OFFLINE_TOKENIZER = ("offline-words", "offline_words")

# ---------------------------------------------------------------------------- offline corpus

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_NOUNS = [("cat", "cats"), ("dog", "dogs"), ("bird", "birds"), ("fox", "foxes"), ("child", "children"),
          ("robot", "robots"), ("teacher", "teachers")]
_VERBS = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("helps", "help"), ("chases", "chase"),
          ("finds", "find")]
_ADJS = ["red", "blue", "green", "small", "big", "quick", "lazy", "happy", "old", "young"]
_ADVS = ["today", "quietly", "quickly", "often", "slowly"]
#: Every word the offline grammar uses.
GRAMMAR_WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    _NUMBERS + [w for pair in _NOUNS + _VERBS for w in pair] + _ADJS + _ADVS
    + ["the", "a", "plus", "is", "count", "from", "to", ".", ":"]
))


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # agreement: a singular subject takes "sees", a plural one "see"
        plural = rng.random() < 0.5
        subj = rng.choice(_NOUNS)[plural]
        verb = rng.choice(_VERBS)[plural]
        obj = rng.choice(_NOUNS)[rng.random() < 0.5]
        det = "the" if plural else rng.choice(["the", "a"])
        adv = f" {rng.choice(_ADVS)}" if rng.random() < 0.3 else ""
        return f"{det} {rng.choice(_ADJS)} {subj} {verb} the {rng.choice(_ADJS)} {obj}{adv} ."
    if kind == 1:  # sums up to ten
        a = rng.randrange(11)
        b = rng.randrange(11 - a)
        return f"{_NUMBERS[a]} plus {_NUMBERS[b]} is {_NUMBERS[a + b]} ."
    start = rng.randrange(8)  # counting
    stop = rng.randrange(start + 2, 11)
    return f"count from {_NUMBERS[start]} to {_NUMBERS[stop]} : {' '.join(_NUMBERS[start:stop + 1])} ."


def offline_corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of the offline grammar, the same for the same ``(n, seed)``."""
    rng = random.Random(seed)
    return [_sentence(rng) for _ in range(n)]


def word_tokenizer(words: Sequence[str] = GRAMMAR_WORDS):
    """A word-level ``PreTrainedTokenizerFast`` over ``<pad> <unk> <s> </s>`` + ``words``: lowercased,
    split at whitespace and punctuation, ``<s>`` prepended (as LLaMA's tokenizer does).

    Built in memory, nothing to download. With the grammar's words (``tokenizer="offline-words"``)
    its vocabulary has 65 tokens instead of MiniLM's 30522, which makes a tiny model's output layer
    -- and so a CPU training step -- about ten times cheaper; it maps any other word to ``<unk>``.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(dict.fromkeys(["<pad>", "<unk>", "<s>", "</s>", *words]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def write_offline_corpus(cache_dir: str | os.PathLike, n_train: int = 2000, n_val: int = 200,
                         seed: int = 0) -> dict[str, str]:
    """Write (once) the offline corpus as ``{"text": ...}`` JSONL; returns ``{split: path}``.

    Train and validation come from different seeds, so they share the grammar, not the draws.
    """
    root = Path(cache_dir) / f"offline_corpus_v{_CORPUS_VERSION}_n{n_train}_{n_val}_s{seed}"
    out = {}
    for split, n, s in (("train", n_train, seed), ("validation", n_val, seed + 1_000_003)):
        path = root / f"{split}.jsonl"
        if not path.is_file():
            write_lines_atomic(path, [json.dumps({"text": t}) for t in offline_corpus(n, s)])
        out[split] = str(path)
    return out


# ---------------------------------------------------------------------------- reading files


def _expand(split: str, paths: list[str]) -> list[str]:
    """The files of one split (globs expanded), each of a readable format."""
    out = expand(split, paths)
    for h in out:
        if os.path.splitext(h)[1].lower() not in _EXTENSIONS:
            raise ValueError(
                f"data_files[{split!r}]: cannot read {h!r}: supported extensions are {', '.join(_EXTENSIONS)} "
                "(.txt: one example per line; .jsonl: one JSON object per line; .json: a list of objects)"
            )
    return out


# ---------------------------------------------------------------------------- tokenized data


class TokenizedLM(Dataset):
    """Token id and label arrays (int32), one pair per example; items are int64 tensors."""

    def __init__(self, ids: list[np.ndarray], labels: list[np.ndarray]):
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.from_numpy(self.ids[i].astype(np.int64)),
                "labels": torch.from_numpy(self.labels[i].astype(np.int64))}


def collate_lm(items: Sequence[Mapping[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item: pads get ``pad_id`` in ``input_ids``, 0 in ``attention_mask``
    and -100 in ``labels`` (so a pad id equal to EOS never hides a real EOS from the loss)."""
    n = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    labels = torch.full((len(items), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, it in enumerate(items):
        k = len(it["input_ids"])
        ids[i, :k] = it["input_ids"]
        labels[i, :k] = it["labels"]
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class _Collate:
    """A picklable collate function (DataLoader workers)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, items):
        return collate_lm(items, self.pad_id)


class CausalLMDataModule(SplitLoaders, L.LightningDataModule):
    """Tokenized causal LM batches from local JSON / JSONL / text files or the offline corpus.

    Args:
        data_files: a file, a list of files (= train), or ``{"train": ..., "validation": ...,
            "test": ...}`` (glob patterns allowed). ``None``: the offline generated corpus.
        tokenizer: a local tokenizer / model directory, a Hub id, ``"minilm-l6"`` (the packaged
            MiniLM tokenizer, offline; the default), or ``"offline-words"`` (:func:`word_tokenizer`
            over the offline grammar's words: a 65-token vocabulary for fast tiny CPU runs on the
            offline corpus; other words become ``<unk>``).
        block_size: maximum tokens per example (the block length with ``packing``).
        batch_size, num_workers: loader settings.
        val_split: when there is no validation file: the held-out part of train (a fraction in
            (0, 1) or a number of examples), drawn with ``seed``.
        text_field, instruction_field, input_field, response_field: JSON field names (module
            docstring); ``response_field=None`` accepts ``"response"`` or ``"output"``.
        template, template_with_input: prompt templates of instruction examples.
        train_on_prompt: also train on the prompt tokens of instruction examples.
        add_eos: append the tokenizer's EOS token (when it has one) to every example.
        packing: concatenate all examples and cut them into ``block_size`` blocks.
        max_train_samples, max_eval_samples: seeded random subsets (of examples, before packing).
        corpus_size: offline corpus: train sentences (validation: a tenth of it, at least 20).
        cache_dir: where the offline corpus is written (default :func:`default_cache_dir`).
        seed: hold-out split, subsets and the offline corpus.

    ``num_classes`` is the tokenizer's vocabulary size (``len(tokenizer)``); the CLI links it to
    ``CausalLMModule(num_classes=...)``, which sizes a model built from an inline config with it.
    """

    def __init__(
        self,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        tokenizer: str = "minilm-l6",
        block_size: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        val_split: float = 0.1,
        text_field: str = "text",
        instruction_field: str = "instruction",
        input_field: str = "input",
        response_field: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        template_with_input: str = DEFAULT_TEMPLATE_WITH_INPUT,
        train_on_prompt: bool = False,
        add_eos: bool = True,
        packing: bool = False,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        corpus_size: int = 2000,
        cache_dir: str | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 tokens (an input and a next token), got {block_size}")
        check_loader_args(batch_size, num_workers, val_split, max_train_samples=max_train_samples,
                          max_eval_samples=max_eval_samples)
        if corpus_size < 10:
            raise ValueError(f"corpus_size must be >= 10 sentences, got {corpus_size}")
        for name, tpl, keys in (("template", template, {"instruction"}),
                                ("template_with_input", template_with_input, {"instruction", "input"})):
            try:
                tpl.format(instruction="", input="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"{name} {tpl!r} is not a valid template ({type(e).__name__}: {e}); use the placeholders "
                    f"{', '.join('{' + k + '}' for k in sorted(keys))} and double other braces ({{{{ }}}})"
                ) from None
            if "{instruction}" not in tpl:
                raise ValueError(f"{name} {tpl!r} must contain {{instruction}}")
        self.save_hyperparameters()
        self._files = split_map(data_files) if data_files is not None else None
        if self._files is not None:
            self._files = {split: _expand(split, paths) for split, paths in self._files.items()}
        self.tokenizer_name = tokenizer
        self.block_size = int(block_size)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.val_split = val_split
        self.text_field, self.instruction_field, self.input_field = text_field, instruction_field, input_field
        self.response_field = response_field
        self.template, self.template_with_input = template, template_with_input
        self.train_on_prompt, self.add_eos, self.packing = bool(train_on_prompt), bool(add_eos), bool(packing)
        self.max_train_samples, self.max_eval_samples = max_train_samples, max_eval_samples
        self.corpus_size = int(corpus_size)
        self.cache_dir = os.path.expanduser(cache_dir) if cache_dir else default_cache_dir()
        self.seed = int(seed)
        self._tokenizer = None
        self.train_set = self.val_set = self.test_set = None

    # ------------------------------------------------------------------ tokenizer

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first use (offline for local directories and ``minilm-l6``)."""
        if self._tokenizer is None:
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise ImportError('CausalLMDataModule needs transformers: pip install "lalr_lightning[text]"') from e
            if str(self.tokenizer_name).lower() in OFFLINE_TOKENIZER:
                self._tokenizer = word_tokenizer()
            else:
                path = resolve_model_name(self.tokenizer_name)
                self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=is_local(path))
        return self._tokenizer

    @property
    def num_classes(self) -> int:
        """The vocabulary size, ``len(tokenizer)`` (added tokens included)."""
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The id written at padded positions (masked, so any valid id): pad, else EOS, else 0."""
        tok = self.tokenizer
        for i in (tok.pad_token_id, tok.eos_token_id):
            if i is not None:
                return int(i)
        return 0

    # ------------------------------------------------------------------ files and records

    def _split_files(self) -> dict[str, list[str]]:
        if self._files is not None:
            return self._files
        n_val = max(20, self.corpus_size // 10)
        paths = write_offline_corpus(self.cache_dir, self.corpus_size, n_val, self.seed)
        return {split: [p] for split, p in paths.items()}

    def prepare_data(self) -> None:
        """Write the offline corpus (rank 0) and load the tokenizer once."""
        self._split_files()
        _ = self.tokenizer

    def _examples(self, paths: list[str]) -> list[tuple[str, int]]:
        """``(text, prompt length in characters)`` per record; 0 = train on every token."""
        out = []
        for path in paths:
            records = read_records(path)
            if not records:
                raise ValueError(f"{path} holds no examples")
            for i, rec in enumerate(records, 1):
                out.append(self._example(rec, f"{path}: record {i}"))
        return out

    def _example(self, rec: Any, where: str) -> tuple[str, int]:
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where} is a {type(rec).__name__}, expected a JSON object")
        if self.text_field in rec:
            text = rec[self.text_field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {self.text_field!r} must be a string, got {type(text).__name__}")
            return text, 0
        resp_key = self.response_field or next((k for k in ("response", "output") if k in rec), None)
        if self.instruction_field in rec and resp_key in rec:
            inst, extra, resp = rec[self.instruction_field], rec.get(self.input_field), rec[resp_key]
            for name, v in ((self.instruction_field, inst), (resp_key, resp), (self.input_field, extra)):
                if v is not None and not isinstance(v, str):
                    raise ValueError(f"{where}: field {name!r} must be a string, got {type(v).__name__}")
            if extra:
                prompt = self.template_with_input.format(instruction=inst, input=extra)
            else:
                prompt = self.template.format(instruction=inst)
            return prompt + resp, (0 if self.train_on_prompt else len(prompt))
        want_resp = repr(self.response_field) if self.response_field else "'response' or 'output'"
        raise ValueError(
            f"{where} has fields {sorted(rec)}; expected a text field {self.text_field!r}, or an instruction "
            f"field {self.instruction_field!r} with a response field {want_resp}. Set text_field / "
            "instruction_field / response_field to your field names"
        )

    # ------------------------------------------------------------------ tokenizing

    def _tokenize(self, examples: list[tuple[str, int]], split: str) -> TokenizedLM:
        tok = self.tokenizer
        need_offsets = any(n > 0 for _, n in examples)
        if need_offsets and not getattr(tok, "is_fast", False):
            raise ValueError(
                f"masking the prompt needs a fast tokenizer (offset mappings); {type(tok).__name__} is not one. "
                "Use a tokenizer with a tokenizer.json, or set train_on_prompt=True"
            )
        enc = tok([t for t, _ in examples], add_special_tokens=True, return_offsets_mapping=need_offsets,
                  return_special_tokens_mask=need_offsets, verbose=False)
        eos = tok.eos_token_id if self.add_eos else None
        ids_all, labels_all, dropped = [], [], 0
        for i, (_, n_prompt) in enumerate(examples):
            ids = list(enc["input_ids"][i])
            labels = list(ids)
            if n_prompt:
                special, offsets = enc["special_tokens_mask"][i], enc["offset_mapping"][i]
                k = 0
                # leading specials (BOS, CLS) and every token that ends inside the prompt
                while k < len(ids) and (special[k] or offsets[k][1] <= n_prompt):
                    k += 1
                labels[:k] = [IGNORE_INDEX] * k
            if eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
                labels.append(eos)
            if not self.packing:
                ids, labels = ids[: self.block_size], labels[: self.block_size]
                if all(v == IGNORE_INDEX for v in labels[1:]):
                    dropped += 1  # nothing left to predict (the prompt fills the block)
                    continue
            ids_all.append(np.asarray(ids, dtype=np.int32))
            labels_all.append(np.asarray(labels, dtype=np.int32))
        if self.packing:
            ids_all, labels_all = self._pack(ids_all, labels_all)
        if dropped:
            rank_zero_warn(
                f"{split}: {dropped} of {len(examples)} examples have no response token within block_size="
                f"{self.block_size} and were dropped; raise block_size or shorten the prompts"
            )
        if not ids_all:
            raise ValueError(f"the {split} split has no example with a token to predict; raise block_size")
        return TokenizedLM(ids_all, labels_all)

    def _pack(self, ids: list[np.ndarray], labels: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        flat_ids, flat_labels = np.concatenate(ids), np.concatenate(labels)
        b = self.block_size
        starts = range(0, len(flat_ids), b)
        out_ids = [flat_ids[s : s + b] for s in starts]
        out_labels = [flat_labels[s : s + b] for s in starts]
        if len(out_ids) > 1 and len(out_ids[-1]) < 2:
            out_ids, out_labels = out_ids[:-1], out_labels[:-1]
        return out_ids, out_labels

    # ------------------------------------------------------------------ splits

    def _subset(self, examples: list, n: int | None) -> list:
        if n is None or n >= len(examples):
            return examples
        idx = sorted(random.Random(self.seed).sample(range(len(examples)), n))
        return [examples[i] for i in idx]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        files = self._split_files()
        train = self._examples(files["train"])
        val = self._examples(files["validation"]) if "validation" in files else None
        test = self._examples(files["test"]) if "test" in files else None
        if val is None:
            n_val = int(self.val_split) if self.val_split >= 1 else max(1, round(self.val_split * len(train)))
            if n_val >= len(train):
                raise ValueError(f"val_split={self.val_split} leaves no training data ({len(train)} examples)")
            order = list(range(len(train)))
            random.Random(self.seed).shuffle(order)
            held = set(order[:n_val])
            val = [e for i, e in enumerate(train) if i in held]
            train = [e for i, e in enumerate(train) if i not in held]
        self.train_set = self._tokenize(self._subset(train, self.max_train_samples), "train")
        self.val_set = self._tokenize(self._subset(val, self.max_eval_samples), "validation")
        self.test_set = (self.val_set if test is None
                         else self._tokenize(self._subset(test, self.max_eval_samples), "test"))

    # ------------------------------------------------------------------ loaders

    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        if ds is None:
            raise RuntimeError("call setup() (or let the Trainer do it) before asking for dataloaders")
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          collate_fn=_Collate(self.pad_id), persistent_workers=self.num_workers > 0)
