"""The package's own exception types, and the check of mode-dependent arguments every callback
shares."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DivergenceError", "reject_stray"]


class DivergenceError(FloatingPointError, ValueError, RuntimeError):
    """Training diverged: a weight, gradient or score a method needs is NaN or Inf.

    One type for every callback, naming what is non-finite, where (layers) and when (epoch,
    step). It is also a ``ValueError``, ``FloatingPointError`` and ``RuntimeError``, so code that
    caught the built-in types earlier versions raised keeps working.
    """

    def __init__(self, who: str, what: str, layers=(), *, value: float | None = None, epoch: int | None = None,
                 step: int | None = None, hint: str = "lower the learning rate, clip gradients, or check the data"):
        self.who, self.what, self.layers, self.value = who, what, list(layers), value
        self.epoch, self.step, self.hint = epoch, step, hint
        shown = self.layers[:5] + (["..."] if len(self.layers) > 5 else [])
        where = f" of {shown}" if shown else ""
        state = f"is {value}" if value is not None else "are NaN or Inf" if shown else "is NaN or Inf"
        when = "" if step is None else f" at epoch {epoch}, step {step}"
        super().__init__(f"{who}: {what}{where} {state}{when}; training has diverged ({hint})")

    def __reduce__(self):  # travels between ranks (broadcast) and processes intact
        return (_rebuild, (self.who, self.what, self.layers, self.value, self.epoch, self.step, self.hint))


def _rebuild(who, what, layers, value, epoch, step, hint) -> DivergenceError:
    return DivergenceError(who, what, layers, value=value, epoch=epoch, step=step, hint=hint)


def reject_stray(who: str, mode_arg: str, mode: Any, given: Mapping[str, Any],
                 valid: Mapping[Any, Iterable[str]]) -> None:
    """ValueError for the arguments given (not None) that the chosen mode does not use, listing
    which arguments go with which mode (``who`` names the class)."""
    allowed = set(valid.get(mode, ()))
    stray = sorted(k for k, v in given.items() if v is not None and k not in allowed)
    if stray:
        combos = "; ".join(f"{mode_arg}={m!r}: {', '.join(sorted(a)) or '(none)'}" for m, a in valid.items())
        raise ValueError(
            f"{who}({mode_arg}={mode!r}) does not use {', '.join(stray)}; the arguments "
            f"each {mode_arg} takes are: {combos}"
        )
