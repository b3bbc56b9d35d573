"""The package's own exception types, and the check of mode-dependent arguments every callback
shares."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DivergenceError", "SettingsMismatchError", "check_settings", "deprecated_alias", "reject_stray", "renamed",
           "warn_deprecated"]


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


class SettingsMismatchError(ValueError):
    """A checkpoint's callback state was written with other settings than this callback's."""

def check_settings(key: str, saved: Mapping[str, Any], mine: Mapping[str, Any], ignore: Iterable[str]) -> None:
    """:class:`SettingsMismatchError` naming the first setting (not in ``ignore``) a checkpoint's
    state was written with that differs from this callback's, and how to go on."""
    for arg, value in mine.items():
        if arg in saved and arg not in ignore and saved[arg] != value:
            raise SettingsMismatchError(
                f"{key}: the checkpoint was written with {arg}={saved[arg]!r}, this callback has {arg}={value!r}; "
                "resume with the same setting, or pass strict_resume=False to continue with the new one")


#: the package's folder: a deprecation warning names the first caller outside it
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside this package, so that
    Python's default filters show it in the user's own script (``__main__``)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


class renamed:  # noqa: N801 -- used like ``property``
    """A deprecated attribute name, kept for one release: reading it warns and reads ``new``
    (``alphas = renamed("scores")``)."""

    def __init__(self, new: str):
        self.new = new
        self.old = "?"

    def __set_name__(self, owner: type, name: str) -> None:
        self.old = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        warn_deprecated(f"{type(obj).__name__}.{self.old} is deprecated and will be removed in the next release; "
                        f"use .{self.new}")
        return getattr(obj, self.new)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.old} is a deprecated, read-only name of .{self.new}")


def deprecated_alias(value: Any, old_value: Any, old: str, new: str, default: Any = None) -> Any:
    """Resolve a deprecated argument: warn, and use it unless the new one was given too."""
    if old_value is None:
        return value
    warn_deprecated(f"{old}= is deprecated and will be removed in the next release; use {new}=")
    if value is not None and value != default:
        raise ValueError(f"give {new}= or the deprecated {old}=, not both")
    return old_value
