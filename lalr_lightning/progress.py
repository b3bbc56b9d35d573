"""Progress of long work (``prune``, ``perplexity``, ``analyze`` of a checkpoint, Wanda's and
SparseGPT's block-by-block calibration): a tqdm bar with its rate and ETA on stderr, drawn only
when stderr is a terminal, so CI logs and redirected output stay clean; ``--quiet`` (or
:func:`quiet`) silences it.

No torch or lightning import: the commands use it before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["bar", "enabled", "quiet", "set_quiet", "write"]

_QUIET = False
#: seconds between redraws (tqdm's default, or TQDM_MININTERVAL; 0 shows every update of a tiny model)
MININTERVAL = float(os.environ.get("TQDM_MININTERVAL", "0.1"))


def enabled(stream: IO | None = None) -> bool:
    """Whether a bar is drawn on ``stream`` (stderr by default): a terminal, and not silenced by
    :func:`quiet` or ``LALR_QUIET=1``."""
    if _QUIET or os.environ.get("LALR_QUIET", "") not in ("", "0"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return False


def set_quiet(on: bool) -> None:
    """Silence (or not) every bar from now on: each command sets it from its ``--quiet``."""
    global _QUIET
    _QUIET = bool(on)


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """Within the block, no bar is drawn (``--quiet``)."""
    global _QUIET
    before, _QUIET = _QUIET, bool(on) or _QUIET
    try:
        yield
    finally:
        _QUIET = before


class _Off:
    """What :func:`bar` gives when nothing is drawn: iterates and counts nothing, at no cost."""

    def __init__(self, iterable: Iterable | None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
        stream: IO | None = None, always: bool = False, **kw: Any):
    """A tqdm bar over ``iterable`` (or one to ``update`` by hand, with ``total``), with its rate
    and ETA, on ``stream`` (stderr), or a silent stand-in where :func:`enabled` is false
    (``always``: drawn wherever the stream goes, as an API caller who asked for progress wants)."""
    stream = sys.stderr if stream is None else stream
    if not always and not enabled(stream):
        return _Off(iterable)
    from tqdm import tqdm

    kw.setdefault("mininterval", MININTERVAL)
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=always, **kw)


def write(message: str, stream: IO | None = None) -> None:
    """A line on ``stream`` (stderr) that does not tear a bar being drawn there."""
    stream = sys.stderr if stream is None else stream
    if enabled(stream):
        from tqdm import tqdm

        tqdm.write(message, file=stream)
    else:
        print(message, file=stream)
