"""One place for "unknown value" errors: the valid choices and, when one is close, the nearest
(``unknown assign 'linearmap'; valid: linear_map, identity, ...; did you mean 'linear_map'?``).

Pure Python (no torch, no lightning): ``core/``, the callbacks, the datamodules and the CLI all
raise through it, so a mistyped value gets the same hint a mistyped key does.

It also holds the command line's choice lists, as plain tuples: the commands parse their arguments
(and refuse bad ones) before torch is imported. ``tests/test_cli_lean.py`` checks each against the
library's own list.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["BLOCK_CRITERIA", "CRITERIA", "DTYPES", "FITS", "PAPER_TASKS", "PRESETS", "PRUNING_METRICS", "closest", "suggestion", "unknown"]


FITS = ("median", "ks", "peak")
CRITERIA = ("magnitude", "wanda", "sparsegpt")
PRUNING_METRICS = ("alpha", "alpha_weighted", "log_alpha_norm", "stable_rank", "entropy", "spectral_norm",
                   "log_spectral_norm", "norm", "log_norm", "rand_distance", "snr")
DTYPES = ("float32", "float16", "bfloat16")
#: the per-layer ratio recipes of ``prune --preset`` and ``HTSRPruning(preset=...)``
PRESETS = ("alphapruning", "owl")
#: how ``prune --remove-blocks K`` picks the blocks (``core/pruning/depth.py``)
BLOCK_CRITERIA = ("angular", "influence", "alpha", "last")
#: the zero-shot tasks of the Wanda, SparseGPT and AlphaPruning papers (lm-evaluation-harness names)
PAPER_TASKS = ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


def closest(value: Any, valid: Iterable[Any]) -> str | None:
    """The valid choice nearest to ``value`` (difflib's ratio, cutoff 0.6, case-insensitive), or None."""
    names = [str(v) for v in valid]
    lowered = {n.lower(): n for n in names}
    found = difflib.get_close_matches(str(value).lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[found[0]] if found else None


def suggestion(value: Any, valid: Iterable[Any]) -> str:
    """``"; did you mean 'x'?"`` for the nearest valid choice, or ``""`` when none is close."""
    near = closest(value, valid)
    return f"; did you mean {near!r}?" if near is not None and near != str(value) else ""


def unknown(what: str, value: Any, valid: Iterable[Any], *, show: Callable[[Any], str] = str,
            note: str = "") -> ValueError:
    """The ValueError for a value not among ``valid``: ``unknown <what> <value!r>; valid: <list><note>``
    and the nearest choice. ``show`` formats each listed choice (``repr`` to quote them)."""
    valid = list(valid)
    listing = ", ".join(show(v) for v in valid)
    return ValueError(f"unknown {what} {value!r}; valid: {listing}{note}{suggestion(value, valid)}")
