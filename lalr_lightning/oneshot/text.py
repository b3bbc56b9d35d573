"""The text the one-shot commands read: ``prune``'s calibration, ``perplexity``'s evaluation.

:func:`read_text` gives the documents of a ``.txt`` (one, verbatim) or a ``.json`` / ``.jsonl``
(one per record); :func:`calibration_samples` draws the calibration windows from them.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch


def read_text(path: str | os.PathLike, text_field: str = "text") -> tuple[list[str], bool]:
    """(documents, verbatim) of a text file: a ``.txt`` is one document, its content verbatim
    (save WikiText's split joined as the reference joins it and the tokens are the same); a
    ``.json`` / ``.jsonl`` gives one document per record (its ``text_field``), as C4's shards."""
    from lalr_lightning.records import read_records

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{p} is a directory; give one text file (.txt, .json or .jsonl) in it")
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
