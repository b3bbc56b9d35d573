"""``prune --ratios FILE``: per-block or per-matrix pruning ratios read from a file, checked, and
spread over every matrix of the model's blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["explicit_ratios", "read_ratios"]


def read_ratios(source) -> list[float] | dict[str, float]:
    """``--ratios FILE``: JSON, either a list (one ratio per decoder block, in order) or ``{name: ratio}``
    (names of blocks, ``model.layers.3``, or of matrices, ``model.layers.3.mlp.down_proj``; a ``prune``
    run's ``pruning.json`` works too: its ``ratios``), or plain text with one number per block a line.
    A list or dict passes through (checked the same way)."""
    data = source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no such --ratios file: {source}")
        text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = [float(x) for x in text.split()]
            except ValueError:
                raise ValueError(f"--ratios {source}: expected JSON (a list of per-block ratios, or {{name: ratio}}) "
                                 "or one number a line") from None
    if isinstance(data, dict) and isinstance(data.get("ratios"), dict):
        data = data["ratios"]  # a pruning.json written by prune
    values = data.values() if isinstance(data, dict) else data if isinstance(data, list) else None
    if values is None or not data:
        raise ValueError(f"--ratios: expected a non-empty list of per-block ratios or {{name: ratio}}, got "
                         f"{type(data).__name__}")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1]
    if bad:
        raise ValueError(f"--ratios: every ratio must be a number in [0, 1), got {bad[:3]}")
    return data


def explicit_ratios(data, groups: list[list[str]], path: str) -> dict[str, float]:
    """Every matrix's ratio from ``read_ratios``' list (per block) or dict (per block or per matrix)."""
    if isinstance(data, list):
        if len(data) != len(groups):
            raise ValueError(f"--ratios lists {len(data)} ratios, the model has {len(groups)} decoder blocks: give one "
                             "per block (or {name: ratio})")
        return {k: float(r) for r, names in zip(data, groups) for k in names}
    out, missing = {}, []
    for i, names in enumerate(groups):
        for k in names:
            r = data.get(k, data.get(f"{path}.{i}"))
            if r is None:
                missing.append(k)
            else:
                out[k] = float(r)
    known = {f"{path}.{i}" for i in range(len(groups))} | {k for g in groups for k in g}
    unknown = sorted(set(data) - known)
    if unknown or missing:
        raise ValueError(f"--ratios: {'no layer named ' + str(unknown[:3]) if unknown else ''}"
                         f"{'; ' if unknown and missing else ''}{'no ratio for ' + str(missing[:3]) if missing else ''}"
                         f" (names: {path}.0 ... {path}.{len(groups) - 1}, or their matrices, e.g. {groups[0][0]})")
    return out
