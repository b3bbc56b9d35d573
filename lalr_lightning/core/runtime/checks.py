"""Checks of what a user hands the package, each ending in one line that names the cause and the
fix: a method's settings (the fields of its dataclass: read back, checked against their
annotations, their deprecated names resolved, their defaults for the state key), models with lazy (not yet shaped)
parameters, matrices no layer listing covers, and pruning masks a resumed checkpoint holds
that no callback takes; and the package's own exception types (a divergence, a checkpoint
written with other settings) with the deprecation helpers. Pure Python and torch (no lightning)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import sys
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["ArgumentTypeError", "DEFAULT_FIGURES", "DivergenceError", "FIGURES", "IDENTITY", "SettingsMismatchError", "check_counts", "check_figures", "check_finite", "check_loss_fn", "check_min_evals", "check_number", "check_settings", "check_taken", "coerce", "coerce_fields", "default_settings", "deprecated_arg", "deprecated_names", "distinct_settings", "lazy_error", "lazy_parameters", "lora_zero", "non_finite", "orphaned_masks", "plain_setting", "reject_stray", "renamed", "resolve_deprecated", "setting_fields", "settings_of", "uninitialized", "union_signature", "warn_deprecated"]

_NUMBERS = {int: "an integer", float: "a number"}


class ArgumentTypeError(TypeError, ValueError):
    """A constructor argument of the wrong type. Also a ``ValueError``: a wrong value's type is a
    wrong value, and code that caught ``ValueError`` for bad arguments before these checks still does."""


def _number(value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (int or float), or ``None`` when it is not one. Text is read the
    way a command line gives numbers (``"5"``, ``"0.5"``), as ``check_figures`` does."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text) if kind is int else float(text)
        except ValueError:
            try:
                value = float(text)  # "1e8" for an integer: read on as the float it is
            except ValueError:
                return None
            if kind is float:
                return value
    if kind is int:  # 1e8 (a float written as a power of ten) is the integer it names; 1.5 is none
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
            return int(value) if math.isfinite(value) and float(value).is_integer() else None
        return int(value) if isinstance(value, numbers.Integral) else None
    return value if isinstance(value, numbers.Real) else None


def _plain(hint: Any) -> tuple[type | None, bool]:
    """(int or float, None allowed) for ``int``, ``float``, ``int | None`` and ``float | None``;
    ``(None, False)`` for any other annotation (not checked here)."""
    if hint in _NUMBERS:
        return hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and args[0] in _NUMBERS and len(typing.get_args(hint)) == 2:
            return args[0], True
    return None, False


def coerce(who: str, arg: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the annotation ``hint`` (numbers, optional numbers, and
    ``Mapping[str, float]``), numeric text converted; a one-line ``TypeError`` naming the argument
    and the type it takes otherwise. Other annotations pass ``value`` through."""
    kind, optional = _plain(hint)
    if kind is not None:
        if value is None and optional:
            return None
        got = _number(value, kind)
        if got is None:
            raise ArgumentTypeError(f"{who}: {arg} must be {_NUMBERS[kind]}{' or None' if optional else ''}, "
                            f"got {value!r} ({type(value).__name__})")
        return got
    # Mapping[str, float] (| None): the factors of LayerLRMultiplier
    inner = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else [hint]
    if len(inner) == 1 and typing.get_origin(inner[0]) is Mapping and typing.get_args(inner[0])[1:] == (float,):
        if value is None or not isinstance(value, Mapping):
            return value  # the constructor's own check says what it wants
        out = {}
        for k, v in value.items():
            got = _number(v, float)
            if got is None:
                raise ArgumentTypeError(f"{who}: {arg} maps names to numbers; {arg}[{k!r}] is {v!r} "
                                f"({type(v).__name__})")
            out[k] = got
        return out
    return value


def check_taken(who: str, target: type, fixed: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """A one-line ValueError when ``given`` holds arguments ``target``'s constructor does not take,
    listing the ones it takes (those in ``fixed``, set by ``who``, not among them)."""
    import inspect

    params = inspect.signature(target).parameters
    stray = sorted(set(given) - set(params))
    if stray:
        valid = sorted(k for k in params if k not in fixed and k != "self")
        raise ValueError(f"{who} builds {target.__name__}, which does not take {', '.join(stray)}; it takes: "
                         f"{', '.join(valid)}")


def union_signature(first: list, targets: list[tuple[type, Mapping[str, Any]]]):
    """The signature of a constructor that builds one of ``targets`` (a class, and the arguments
    it is given fixed): the ``first`` parameters, then every other argument of the targets'
    constructors, keyword-only, ``None`` (not given) by default and annotated as optional, so that
    LightningCLI (jsonargparse) reads them all."""
    import inspect

    out = {p.name: p for p in first}
    for target, fixed in targets:
        hints = typing.get_type_hints(target.__init__)
        for name, p in inspect.signature(target).parameters.items():
            if name not in out and name not in fixed and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                out[name] = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                              annotation=typing.Optional[hints.get(name, p.annotation)])  # noqa: UP045
    return inspect.Signature(list(out.values()))


def check_min_evals(who: str, min_evals: int, why: str = "a power-law fit needs at least two eigenvalues") -> int:
    """``min_evals`` when >= 2, else a one-line ValueError: the ESD of a matrix with one
    eigenvalue has no shape to fit."""
    if isinstance(min_evals, bool) or not isinstance(min_evals, numbers.Integral) or min_evals < 2:
        raise ValueError(f"{who}: min_evals must be an integer >= 2, got {min_evals!r}: {why} "
                         "(a layer with fewer is left out)")
    return int(min_evals)


def check_counts(values: Mapping[str, Any], optional: tuple[str, ...] = ()) -> None:
    """ValueError naming the first of ``{argument: value}`` that is not an integer >= 1 (``None``
    allowed for the arguments in ``optional``)."""
    for arg, value in values.items():
        if value is None and arg in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")


def check_number(arg: str, value: Any, *, low: float, strict: bool = False, note: str = "") -> float:
    """``value`` as a float when it is a finite number ``>= low`` (``> low`` with ``strict``), else a
    one-line ValueError: ``<arg> must be a finite number >= <low><note>, got <value>``."""
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        raise ValueError(f"{arg} must be a finite number {'>' if strict else '>='} {low:g}{note}, got {value}")
    return float(value)


def check_loss_fn(loss_fn: Any) -> Any:
    """``loss_fn`` when it is None or callable, else a one-line TypeError saying what it must be."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (module, batch) -> loss, got {type(loss_fn).__name__}")
    return loss_fn


# --------------------------------------------------------------------------- lazy modules


def lazy_parameters(model: nn.Module) -> dict[str, str]:
    """``{parameter name: module type}`` of every parameter not yet materialized
    (``nn.LazyLinear`` and the other lazy modules before their first forward)."""
    out = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                out[f"{mname}.{pname}" if mname else pname] = type(mod).__name__
    return out


def lazy_error(who: str, lazy: Mapping[str, str]) -> ValueError:
    """The one-line error for a callback that needs the shapes of ``lazy`` parameters."""
    names = list(lazy)
    shown = ", ".join(f"{n} ({lazy[n]})" for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return ValueError(
        f"{who}: {shown} {'is' if len(names) == 1 else 'are'} not initialized yet (a lazy module gets its shape at "
        "its first forward, after the callback must choose its layers); run one forward pass on an example "
        "batch before fit (model(x[:1])), or build the layer with its sizes (nn.Linear(in_features, out_features))"
    )


def uninitialized(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` that are lazy parameters not yet materialized."""
    return [n for n, t in tensors.items() if isinstance(t, nn.parameter.UninitializedParameter)]


# --------------------------------------------------------------------------- checkpoints


def orphaned_masks(checkpoint: dict, claimed: set) -> str | None:
    """The one-line warning for a checkpoint whose HTSRPruning masks no callback of the resuming fit
    takes (``claimed``: the fit's callbacks' state keys): the masks are then no longer enforced.
    Once per loaded checkpoint (whichever component of the package sees it first says it)."""
    if checkpoint.get("_lalr_orphans_checked"):
        return None
    checkpoint["_lalr_orphans_checked"] = True
    states = checkpoint.get("callbacks") or {}
    orphans = {k: len(v.get("masks") or {}) for k, v in states.items()
               if isinstance(k, str) and k.split("{")[0].split("[")[0] == "HTSRPruning" and isinstance(v, dict)
               and v.get("masks") and k not in claimed}
    if not orphans:
        return None
    shown = ", ".join(f"{k} ({n} masked parameters)" for k, n in orphans.items())
    return (f"the checkpoint holds HTSRPruning masks ({shown}) that no callback of this fit takes: the pruned "
            "weights are zero now, but the masks are no longer enforced and training revives them; add the "
            "HTSRPruning callback with the settings of the run that pruned to keep them (make_permanent=True "
            "there drops them on purpose)")


def unclaimed_states(checkpoint: dict, claimed: set, fresh: list[str]) -> str | None:
    """The one-line warning for a checkpoint holding the state of a callback of the package that no
    callback of the resuming fit takes (``claimed``: their state keys; ``fresh``: the fit's
    callbacks that found no state of their own): resuming LISA + TempBalance with Spectrum +
    TempBalance drops LISA's draws and history. HTSRPruning's masks are :func:`orphaned_masks`'.
    Once per loaded checkpoint."""
    if checkpoint.get("_lalr_unclaimed_checked"):
        return None
    checkpoint["_lalr_unclaimed_checked"] = True
    states = checkpoint.get("callbacks") or {}
    left = {k: v for k, v in states.items()
            if isinstance(k, str) and k not in claimed and isinstance(v, dict)
            and {"version", "settings", "history"} <= set(v)  # LayerwiseCallback.state_dict's entries
            and not (k.split("{")[0].split("[")[0] == "HTSRPruning" and v.get("masks"))}
    if not left:
        return None
    shown = ", ".join(f"{k} ({len(v.get('history') or [])} decisions)" for k, v in left.items())
    starts = f"; {', '.join(fresh)} of this fit found no state of its own and starts afresh" if fresh else ""
    return (f"the checkpoint holds the state of {shown}, which no callback of this fit takes: it is left unused"
            f"{starts}; to resume it, add that callback with the settings of the run that saved it")


#: when a callback draws its figures (ESD plots, heatmaps) for the loggers that take images;
#: an integer N is every N epochs, with the first and the last decision
FIGURES = ("every", "first_last", "never")
#: the default of every callback's ``figures``: a set of ESD plots costs several decisions of a
#: small model (benchmarks/logging_overhead.py), so none are drawn unless asked for
DEFAULT_FIGURES = "never"


def check_figures(value: Any, arg: str = "figures") -> str | int:
    """``value`` as a ``figures`` setting, or a one-line ValueError listing the choices."""
    if isinstance(value, str) and value.isdigit():  # a command line gives numbers as text
        value = int(value)
    if (isinstance(value, str) and value in FIGURES) or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{arg} must be 'every' (figures at every decision), 'first_last' (at the first and the last), "
                     f"'never', or a number of epochs N >= 1 (every N epochs, and the first and last); got {value!r}")


def plain_setting(value: Any) -> Any:
    """A setting as plain Python (checkpoints load with ``weights_only=True``; loggers take it)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_setting(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain_setting(v) for k, v in value.items()}
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def non_finite(named: Mapping[str, Any]) -> list[str]:
    """The keys of ``named`` (a tensor, a list of tensors or a number each) that hold NaN or Inf."""

    def finite(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return bool(torch.isfinite(v).all())
        if isinstance(v, (list, tuple)):
            return all(finite(t) for t in v)
        return math.isfinite(float(v))

    return [k for k, v in named.items() if not finite(v)]


# --------------------------------------------------------------------------- settings
# A method's settings are the fields of its (keyword-only where shared) dataclass: declared once,
# with their types and defaults; these read them.

#: the fields every method has that are no settings of its decision (never in ``settings()``)
IDENTITY = ("name", "strict_resume")


def deprecated_arg(new: str, convert: Callable[[Any], Mapping[str, Any]] | None = None) -> Any:
    """The dataclass field of a deprecated argument, kept for one release: ``None`` unless given;
    given, it warns naming ``new`` and sets the fields ``convert(value)`` returns (default:
    ``{new: value}``). Never a setting (:func:`setting_fields`)."""
    return dataclasses.field(default=None, metadata={"replaced_by": new, "convert": convert})


def deprecated_names(cls: type) -> dict[str, str]:
    """``{deprecated argument: what replaces it}`` of a settings dataclass."""
    return {f.name: f.metadata["replaced_by"] for f in dataclasses.fields(cls) if "replaced_by" in f.metadata}


def setting_fields(cls: type, last: Sequence[str] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are settings (not :data:`IDENTITY`, not deprecated), in
    declaration order, the ones named in ``last`` (shared by every method) at the end."""
    own = [f for f in dataclasses.fields(cls) if f.init and f.name not in IDENTITY and "replaced_by" not in f.metadata]
    return [f for f in own if f.name not in last] + [f for f in own if f.name in last]


_HINTS: dict[type, dict] = {}


def coerce_fields(obj: Any) -> None:
    """Every field of ``obj`` annotated as a number (or a mapping to numbers) checked and
    converted by :func:`coerce`: a word where a number is due fails here, naming the argument,
    not as a comparison deep in the checks."""
    cls = type(obj)
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 -- an annotation that does not resolve: nothing is checked
            _HINTS[cls] = {}
    hints = _HINTS[cls]
    for f in dataclasses.fields(obj):
        if f.name in hints:
            setattr(obj, f.name, coerce(cls.__name__, f.name, getattr(obj, f.name), hints[f.name]))


def resolve_deprecated(obj: Any) -> None:
    """Each deprecated argument given (:func:`deprecated_arg`): warn, and set what replaces it,
    unless that was given too (a one-line ValueError); the deprecated field goes back to None."""
    for f in dataclasses.fields(obj):
        old_value = getattr(obj, f.name)
        if "replaced_by" not in f.metadata or old_value is None:
            continue
        new = f.metadata["replaced_by"]
        warn_deprecated(f"{f.name}= is deprecated and will be removed in the next release; use "
                        f"{'= and '.join(new.split(', '))}=")
        convert = f.metadata["convert"]
        targets = convert(old_value) if convert is not None else {new: old_value}
        declared = {g.name: g for g in dataclasses.fields(obj)}
        for target, value in targets.items():
            current, default = getattr(obj, target), declared[target].default
            if current is not None and current != default:
                raise ValueError(f"give {new}= or the deprecated {f.name}=, not both")
            setattr(obj, target, value)
        setattr(obj, f.name, None)


def settings_of(obj: Any, last: Sequence[str] = ()) -> dict[str, Any]:
    """The settings of ``obj`` (:func:`setting_fields`) as plain Python."""
    return {f.name: plain_setting(getattr(obj, f.name)) for f in setting_fields(type(obj), last)}


_DEFAULTS: dict[type, dict] = {}


def default_settings(cls: type, settle: Callable[[Any], None], last: Sequence[str] = ()) -> dict:
    """The settings of ``cls``'s default instance, resolved as a constructor resolves them
    (``settle(obj)``: HTSRPruning's preset fills in its metric) without building one: the
    declared defaults, settled on a bare object, once per class. A class with a required field,
    or whose defaults alone are refused, compares with its declared defaults."""
    if cls not in _DEFAULTS:
        declared = setting_fields(cls, last)
        bare = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(cls) if f.init and (f.default is not dataclasses.MISSING
                                                                or f.default_factory is not dataclasses.MISSING)}
        _DEFAULTS[cls] = {f.name: plain_setting(bare[f.name]) for f in declared if f.name in bare}
        if all(f.name in bare for f in dataclasses.fields(cls) if f.init):
            obj = object.__new__(cls)
            obj.__dict__.update(bare)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    settle(obj)
            except (TypeError, ValueError):  # the defaults alone are no valid instance (patterns needed)
                pass
            else:
                _DEFAULTS[cls] = settings_of(obj, last)
    return _DEFAULTS[cls]


def distinct_settings(settings: Mapping[str, Any], defaults: Mapping[str, Any], skip: Sequence[str] = ()) -> dict:
    """The entries of ``settings`` (but ``skip``) that differ from ``defaults`` (or that it lacks),
    in their order."""
    return {k: v for k, v in settings.items() if k not in skip and (k not in defaults or defaults[k] != v)}


def lora_zero(names: Iterable[str]) -> bool:
    """Whether one of the layer ``names`` is a peft LoRA ``lora_B`` matrix: zero when the adapter is
    made, so no spectrum (NaN SNR, alpha) until training moves it."""
    return any(".lora_B." in n or n.endswith(".lora_B") for n in names)


# ---------------------------------------------------------------------- the package's own errors


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


def check_finite(who: str, when: Any, named: Mapping[str, Any], what: str) -> None:
    """Raise :class:`DivergenceError` for ``who`` naming the entries of ``named`` (a tensor, a list
    of tensors or a number each) that hold NaN or Inf, and when (``when``: anything with the fit's
    ``current_epoch`` and ``global_step``, as a host; None: not said)."""
    bad = non_finite(named)
    if bad:
        raise DivergenceError(who, what, bad, epoch=None if when is None else when.current_epoch,
                              step=None if when is None else when.global_step)


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


def _generated_init(code: types.CodeType) -> bool:
    # the ``__init__`` dataclasses writes for a method (no file of its own): the package's too
    return code.co_filename == "<string>" and code.co_name == "__init__"


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` attributed to the first caller outside this package, so that
    Python's default filters show it in the user's own script (``__main__``)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE) or _generated_init(frame.f_code)):
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
