"""Local data files shared by the text datamodules: split names, existence checks, atomic writes of
generated corpora and the default cache directory."""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "val": "validation",
    "valid": "validation",
    "dev": "validation",
    "eval": "validation",
    "test": "test",
    "testing": "test",
}


def split_map(data_files: Mapping[str, Any] | str | os.PathLike | Sequence[str]) -> dict[str, list[str]]:
    """``{"train": [...], "validation": [...], "test": [...]}`` from a path (= train), a list of
    paths (= train) or a mapping whose keys may use the aliases of :data:`SPLIT_ALIASES`."""
    if isinstance(data_files, (str, os.PathLike)):
        items = [("train", data_files)]
    elif isinstance(data_files, Mapping):
        items = list(data_files.items())
    else:
        items = [("train", list(data_files))]
    out: dict[str, list[str]] = {}
    for key, val in items:
        split = SPLIT_ALIASES.get(str(key).lower())
        if split is None:
            raise ValueError(f"unknown split name {key!r} in data_files; use train, validation (or val/dev) and test")
        if split in out:
            raise ValueError(f"data_files gives the {split} split twice (as {key!r} and an alias of it)")
        paths = [val] if isinstance(val, (str, os.PathLike)) else list(val)
        if not paths:
            raise ValueError(f"data_files[{split!r}] is empty; give a file, a list of files or a glob pattern")
        out[split] = [os.path.expanduser(os.fspath(p)) for p in paths]
    if "train" not in out:
        raise ValueError(f"data_files needs a 'train' entry; got splits {sorted(out)}")
    return out


def expand(split: str, paths: Sequence[str]) -> list[str]:
    """The files of one split: each path must exist; glob patterns expand (sorted) and must match."""
    out = []
    for p in paths:
        if glob.has_magic(p):
            hits = sorted(glob.glob(p))
            if not hits:
                raise FileNotFoundError(f"data_files[{split!r}]: the pattern {p!r} matches no file")
            out.extend(hits)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"data_files[{split!r}]: file not found: {p!r}")
    return out


def default_cache_dir() -> str:
    """``$LALR_LIGHTNING_CACHE``, else ``$XDG_CACHE_HOME/lalr_lightning`` (``~/.cache/lalr_lightning``)."""
    env = os.environ.get("LALR_LIGHTNING_CACHE")
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "lalr_lightning")


def write_lines_atomic(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` (newline-terminated) to ``path`` through a temporary file and a rename, so
    that concurrent ranks never read a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)
