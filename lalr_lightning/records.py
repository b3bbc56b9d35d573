"""Reading text records from a file (``.txt``, ``.jsonl``, ``.json``): shared by the causal-LM
datamodule and the one-shot commands, so the latter read their text without importing Lightning."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["read_records"]


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of one file: ``{"text": line}`` per non-empty line of a ``.txt``; the objects of
    a ``.jsonl`` / ``.json`` (a list, or LMFlow's ``{"instances": [...]}``). Strings in a JSON list
    are text records."""
    ext = os.path.splitext(path)[1].lower()
    with open(path, encoding="utf-8") as f:
        if ext == ".txt":
            return [{"text": line.rstrip("\r\n")} for line in f if line.strip()]
        if ext in (".jsonl", ".ndjson"):
            rows = []
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: invalid JSON ({e.msg}); a .jsonl file holds one JSON object per line") from None
            return rows
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("instances"), list):
        obj = obj["instances"]
    if not isinstance(obj, list):
        raise ValueError(
            f"{path}: a .json file must hold a list of records or an object with an 'instances' list; "
            f"got a {type(obj).__name__}" + (f" with keys {sorted(obj)[:8]}" if isinstance(obj, Mapping) else "")
        )
    return [{"text": r} if isinstance(r, str) else r for r in obj]
