"""Text classification data: SST-2, CoLA, IMDb, Yelp-polarity, your own files, or a generated
offline sentiment corpus.

Everything goes through Hugging Face ``datasets`` so that one code path serves the Hub, the
local HF cache (``HF_HUB_OFFLINE=1`` after one online run) and plain local CSV / JSON /
Parquet files. Texts are tokenized once (``datasets.map``, cached by fingerprint) and padded
per batch with ``DataCollatorWithPadding``, so short batches stay short.

Split conventions:

* SST-2 and CoLA (GLUE): the GLUE test labels are hidden (stored as ``-1``), so the
  validation split doubles as the test split -- the usual practice in fine-tuning papers.
  More generally, any test split whose labels contain negatives is replaced by validation.
* IMDb and Yelp-polarity have no validation split: ``val_split`` of train is held out
  (seeded, so every run and every DDP rank gets the same split).
* ``dataset="files"``: ``data_files`` maps split names (``train``, ``validation``/``val``/
  ``dev``, ``test``) to files; a single path is the train split. Missing validation is carved
  from train; missing test reuses validation.
* ``dataset="sentiment"``: a generated binary sentiment task (:func:`sentiment_corpus`) written
  once as JSON lines to ``cache_dir`` and read back like any file, so offline configs and tests
  need nothing downloaded; train and validation come from different seeds.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from lalr_lightning.choices import unknown
from lalr_lightning.data._common import SplitLoaders, check_loader_args
from lalr_lightning.data._files import default_cache_dir, expand, split_map, write_lines_atomic
from lalr_lightning.text_assets import is_local, resolve_model_name

__all__ = ["TextDataModule", "DATASETS", "sentiment_corpus"]


@dataclass(frozen=True)
class _Named:
    hub: tuple[tuple[str, str | None], ...]  # (path, config) candidates, canonical id first
    text_field: str
    label_field: str
    num_classes: int


#: The named datasets. The Hub moved the legacy ids (``glue``, ``imdb``, ``yelp_polarity``)
#: under organisations; both spellings are tried because the offline cache is keyed by the
#: spelling that was used when the data was downloaded.
DATASETS: dict[str, _Named] = {
    "sst2": _Named((("nyu-mll/glue", "sst2"), ("glue", "sst2")), "sentence", "label", 2),
    "cola": _Named((("nyu-mll/glue", "cola"), ("glue", "cola")), "sentence", "label", 2),
    "imdb": _Named((("stanfordnlp/imdb", None), ("imdb", None)), "text", "label", 2),
    "yelp_polarity": _Named((("fancyzhx/yelp_polarity", None), ("yelp_polarity", None)), "text", "label", 2),
}
_VALID = (*DATASETS, "files", "sentiment")

# The generated sentiment task: every word is in the packaged MiniLM tokenizer's vocabulary.
_POS = ("good", "great", "wonderful", "delightful", "moving", "superb", "charming", "brilliant")
_NEG = ("bad", "awful", "boring", "dreadful", "dull", "terrible", "clumsy", "tedious")
_SUBJECTS = ("the movie", "this film", "the plot", "the acting", "the ending", "the soundtrack", "the story",
             "the cast")
_FILLERS = ("", "honestly ", "really ", "quite ", "at times ", "overall ")
_CORPUS_VERSION = 1


def sentiment_corpus(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` generated ``(sentence, label)`` pairs, the same for the same ``(n, seed)``: a subject,
    an optional filler and an adjective whose polarity is the label (1 = positive); a "not"
    (30% of sentences) flips it, so a bag of words cannot solve the task alone."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        positive = rng.random() < 0.5
        adjective = rng.choice(_POS if positive else _NEG)
        negated = rng.random() < 0.3
        text = f"{rng.choice(_SUBJECTS)} was {rng.choice(_FILLERS)}{'not ' if negated else ''}{adjective}"
        out.append((text, int(positive != negated)))
    return out


def _write_sentiment(cache_dir: str, n_train: int, n_val: int, seed: int) -> dict[str, list[str]]:
    root = Path(cache_dir) / f"sentiment_v{_CORPUS_VERSION}_n{n_train}_{n_val}_s{seed}"
    out = {}
    for split, n, s in (("train", n_train, seed), ("validation", n_val, seed + 1_000_003)):
        path = root / f"{split}.jsonl"
        if not path.is_file():
            write_lines_atomic(path, [json.dumps({"text": t, "label": y}) for t, y in sentiment_corpus(n, s)])
        out[split] = [str(path)]
    return out

# extension -> (datasets builder, extra builder kwargs)
_FORMATS: dict[str, tuple[str, dict[str, Any]]] = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".tab": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
    ".ndjson": ("json", {}),
    ".parquet": ("parquet", {}),
    ".pq": ("parquet", {}),
    ".arrow": ("arrow", {}),
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".zip")


def _file_format(path: str) -> tuple[str, dict[str, Any]]:
    """Builder for a file from its extension (compression suffixes are looked through)."""
    low = path.lower()
    for c in _COMPRESSION:
        if low.endswith(c):
            low = low[: -len(c)]
            break
    ext = os.path.splitext(low)[1]
    if ext not in _FORMATS:
        raise ValueError(
            f"cannot tell the format of {path!r} from its extension {ext or '(none)'!r}; "
            f"supported: {', '.join(sorted(_FORMATS))} (optionally compressed: {', '.join(_COMPRESSION)})"
        )
    return _FORMATS[ext]


def _tokenize(batch: dict[str, list], *, tokenizer: Any, text_field: str, max_length: int) -> dict[str, list]:
    texts = ["" if t is None else str(t) for t in batch[text_field]]
    return tokenizer(texts, truncation=True, max_length=max_length)


def _index_labels(batch: dict[str, list], *, index: dict[str, int], field: str) -> dict[str, list]:
    return {"labels": [index[str(v)] for v in batch[field]]}


class TextDataModule(SplitLoaders, L.LightningDataModule):
    """Tokenized, dynamically padded text classification batches.

    Batches are dicts with ``input_ids``, ``attention_mask`` (plus ``token_type_ids`` for BERT
    tokenizers) and ``labels``, ready for ``TextClassifier`` (or any Hugging Face
    ``...ForSequenceClassification``).

    Args:
        dataset: ``"sst2"``, ``"cola"``, ``"imdb"``, ``"yelp_polarity"``, ``"files"`` or
            ``"sentiment"`` (generated offline). Named datasets load through
            ``datasets.load_dataset`` (Hub or local cache); with ``data_files`` they load from
            those local files instead, keeping the dataset's column names and number of classes.
        data_files: local files, ``{"train": ..., "validation": ..., "test": ...}`` or one
            path (= train). CSV, TSV, JSON / JSON lines, Parquet; the format comes from the
            extension. Required for ``dataset="files"``.
        text_field, label_field: column names (defaults: ``sentence``/``label`` for GLUE,
            ``text``/``label`` otherwise and for files). Labels may be integers ``0..C-1`` or
            strings (mapped to integers in sorted order; see ``label_names``).
        tokenizer: tokenizer name or directory, resolved like ``TextClassifier.model_name``
            (``"minilm-l6"`` is the packaged offline MiniLM).
        max_length: truncation length in tokens.
        val_split: held out of train when there is no validation split: a fraction in (0, 1)
            or a number of examples.
        max_train_samples, max_eval_samples: random subsets (seeded) for quick runs; the eval
            limit applies to validation and test.
        num_classes: only for ``"files"`` (default 2); the named datasets have 2.
        corpus_size: ``"sentiment"`` only: training sentences (validation: a quarter, at least 64).
        cache_dir: ``datasets`` cache directory (default: the HF datasets cache); the generated
            corpus is written under it (default: ``$LALR_LIGHTNING_CACHE`` or
            ``~/.cache/lalr_lightning``).
        seed: for the validation hold-out and the subsets.
    """

    def __init__(
        self,
        dataset: str = "sst2",
        data_files: dict[str, str] | str | None = None,
        text_field: str | None = None,
        label_field: str | None = None,
        tokenizer: str = "minilm-l6",
        max_length: int = 128,
        batch_size: int = 32,
        num_workers: int = 0,
        val_split: float = 0.1,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        num_classes: int | None = None,
        corpus_size: int = 2048,
        cache_dir: str | None = None,
        seed: int = 42,
    ) -> None:
        super().__init__()
        key = str(dataset).strip().lower().replace("-", "_")
        key = {"sst_2": "sst2", "yelp": "yelp_polarity", "file": "files"}.get(key, key)
        if key not in _VALID:
            raise unknown("dataset", dataset, _VALID, show=repr)
        named = DATASETS.get(key)
        if key == "files" and data_files is None:
            raise ValueError(
                "dataset='files' needs data_files, e.g. data_files={'train': 'train.csv', 'validation': 'dev.csv'} "
                "(CSV/TSV/JSON/JSON lines/Parquet with a text and a label column)"
            )
        if key == "sentiment" and data_files is not None:
            raise ValueError("dataset='sentiment' is generated; to read your own files use dataset='files'")
        if corpus_size < 8:
            raise ValueError(f"corpus_size must be >= 8 sentences, got {corpus_size}")
        if named is not None:
            if num_classes is not None and num_classes != named.num_classes:
                raise ValueError(f"{key} has {named.num_classes} classes; got num_classes={num_classes}")
            num_classes = named.num_classes
        elif num_classes is None:
            num_classes = 2
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 tokens, got {max_length}")
        check_loader_args(batch_size, num_workers, val_split, max_train_samples=max_train_samples,
                          max_eval_samples=max_eval_samples)
        # num_classes is logged by the model (LightningCLI links it from here); the argument given
        # (often None) would clash with the resolved count in the logger's merge of the two
        self.save_hyperparameters(ignore=["num_classes"])
        self.dataset_name = key
        self._named = named
        self._files = split_map(data_files) if data_files is not None else None
        if self._files is not None:
            self._files = {split: expand(split, paths) for split, paths in self._files.items()}
        self.text_field = text_field or (named.text_field if named else "text")
        self.label_field = label_field or (named.label_field if named else "label")
        self.tokenizer_name = tokenizer
        self.max_length = int(max_length)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.val_split = val_split
        self.max_train_samples = max_train_samples
        self.max_eval_samples = max_eval_samples
        self.num_classes = int(num_classes)
        self.corpus_size = int(corpus_size)
        self.cache_dir = cache_dir
        self.seed = int(seed)
        self.label_names: list[str] | None = None
        self._tokenizer = None
        self._collator = None
        self.train_set = self.val_set = self.test_set = None

    # ------------------------------------------------------------------ loading

    @property
    def tokenizer(self):
        """The tokenizer, loaded on first use (offline for local directories)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            path = resolve_model_name(self.tokenizer_name)
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=is_local(path))
        return self._tokenizer

    @property
    def collator(self):
        if self._collator is None:
            from transformers import DataCollatorWithPadding

            self._collator = DataCollatorWithPadding(self.tokenizer, return_tensors="pt")
        return self._collator

    def _load_raw(self):
        """The raw splits (``{name: Dataset}``) from local files or the Hub / HF cache."""
        import datasets

        if self.dataset_name == "sentiment" and self._files is None:
            self._files = _write_sentiment(self.cache_dir or default_cache_dir(), self.corpus_size,
                                           max(64, self.corpus_size // 4), self.seed)
        if self._files is not None:
            # one load per split, so that splits may differ in format (train.csv + dev.jsonl)
            out = {}
            for split, paths in self._files.items():
                fmts = [_file_format(p) for p in paths]
                if any(f != fmts[0] for f in fmts):
                    raise ValueError(f"the files of data_files[{split!r}] must share one format; got {paths}")
                builder, extra = fmts[0]
                out[split] = datasets.load_dataset(
                    builder, data_files={split: paths}, split=split, cache_dir=self.cache_dir, **extra
                )
            return out
        errors = []
        for path, config in self._named.hub:
            try:
                return datasets.load_dataset(path, config, cache_dir=self.cache_dir)
            except (ConnectionError, FileNotFoundError) as e:  # offline / not cached / hub unreachable
                errors.append(f"{path}{'/' + config if config else ''}: {e}")
        cache = self.cache_dir or datasets.config.HF_DATASETS_CACHE
        raise FileNotFoundError(
            f"dataset {self.dataset_name!r} is not in the Hugging Face datasets cache ({cache}) and the Hub "
            "cannot be reached (HF_HUB_OFFLINE is set or there is no network). Either run once with network "
            "access so it gets cached, or use local files: dataset='files' with data_files={'train': ..., "
            f"'validation': ...}} (or keep dataset={self.dataset_name!r} and pass data_files to use its column "
            f"names). Tried: {'; '.join(errors)}"
        )

    def prepare_data(self) -> None:
        """Download once (rank 0) so that ``setup`` on every rank reads the cache."""
        self._load_raw()
        _ = self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        raw = self._load_raw()
        splits = dict(raw)
        train = splits.get("train")
        if train is None:
            raise ValueError(f"the dataset has no train split; splits: {sorted(splits)}")
        if len(train) == 0:
            raise ValueError("the train split is empty")
        self._check_columns(train, "train")
        val, test = splits.get("validation"), splits.get("test")
        for name, ds in (("validation", val), ("test", test)):
            if ds is not None:
                self._check_columns(ds, name)
        if test is not None and any(v is None or (_is_int(v) and v < 0) for v in test.unique(self.label_field)):
            # GLUE hides its test labels as -1: evaluate on validation instead
            test = None
        if val is None:
            n_val = self.val_split if self.val_split >= 1 else max(1, round(self.val_split * len(train)))
            if n_val >= len(train):
                raise ValueError(f"val_split={self.val_split} leaves no training data ({len(train)} examples)")
            parts = train.train_test_split(test_size=int(n_val), seed=self.seed, shuffle=True)
            train, val = parts["train"], parts["test"]
        test_is_val = test is None
        train = self._subset(train, self.max_train_samples)
        val = self._subset(val, self.max_eval_samples)
        self._set_label_names(train)
        self.train_set = self._prepare(train, "train")
        self.val_set = self._prepare(val, "validation")
        self.test_set = self.val_set if test_is_val else self._prepare(self._subset(test, self.max_eval_samples), "test")

    def _check_columns(self, ds, split: str) -> None:
        cols = list(ds.column_names)
        for what, col in (("text_field", self.text_field), ("label_field", self.label_field)):
            if col not in cols:
                raise ValueError(
                    f"the {split} split has no {what.split('_')[0]} column {col!r}; its columns are {cols}. "
                    f"Pass {what}=<column name>."
                )

    def _subset(self, ds, n: int | None):
        if n is None or n >= len(ds):
            return ds
        # shuffled first: some eval splits (IMDb test) are sorted by label
        return ds.shuffle(seed=self.seed).select(range(n))

    def _set_label_names(self, train) -> None:
        feat = train.features.get(self.label_field)
        names = getattr(feat, "names", None)
        if names:
            self.label_names = list(names)
            if len(names) != self.num_classes:
                raise ValueError(
                    f"the label column {self.label_field!r} has {len(names)} classes {names}; "
                    f"num_classes is {self.num_classes}"
                )
            return
        values = train.unique(self.label_field)
        if any(isinstance(v, str) for v in values):
            labels = sorted(str(v) for v in values)
            if len(labels) != self.num_classes:
                raise ValueError(
                    f"the train split has {len(labels)} distinct labels {labels[:10]}; num_classes is "
                    f"{self.num_classes}. Pass num_classes={len(labels)}."
                )
            self.label_names = labels

    def _prepare(self, ds, split: str):
        """Labels as ints in ``0..C-1`` named ``labels``, then tokenize and drop other columns."""
        if self.label_names is not None and any(isinstance(v, str) for v in ds.unique(self.label_field)):
            index = {n: i for i, n in enumerate(self.label_names)}
            unknown = sorted({str(v) for v in ds.unique(self.label_field)} - set(index))
            if unknown:
                raise ValueError(f"the {split} split has labels not seen in train: {unknown[:10]}")
            ds = ds.map(_index_labels, batched=True, fn_kwargs={"index": index, "field": self.label_field})
        else:
            bad = [v for v in ds.unique(self.label_field) if not _is_int(v) or not 0 <= int(v) < self.num_classes]
            if bad:
                raise ValueError(
                    f"the {split} split has labels {sorted(bad, key=str)[:10]} outside 0..{self.num_classes - 1}; "
                    "set num_classes or fix the label column"
                )
            if self.label_field != "labels":
                if "labels" in ds.column_names:
                    ds = ds.remove_columns("labels")
                ds = ds.rename_column(self.label_field, "labels")
            feat = ds.features["labels"]
            if getattr(feat, "dtype", "int64") != "int64" and type(feat).__name__ == "Value":
                # e.g. 0.0/1.0 read from a CSV: cross-entropy needs integer targets
                from datasets import Value

                ds = ds.cast_column("labels", Value("int64"))
        text_field = self.text_field
        if text_field == "labels":
            raise ValueError("text_field cannot be 'labels' (that name is reserved for the targets)")
        drop = [c for c in ds.column_names if c != "labels"]
        return ds.map(
            _tokenize,
            batched=True,
            remove_columns=drop,
            fn_kwargs={"tokenizer": self.tokenizer, "text_field": text_field, "max_length": self.max_length},
            desc=f"tokenizing {split}",
        )

    # ------------------------------------------------------------------ loaders

    def _loader(self, ds, shuffle: bool) -> DataLoader:
        if ds is None:
            raise RuntimeError("call setup() (or let the Trainer do it) before asking for dataloaders")
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=self.collator,
            persistent_workers=self.num_workers > 0,
        )


def _is_int(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, float) and v.is_integer()

