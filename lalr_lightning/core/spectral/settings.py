"""The settings of the spectral learning-rate callbacks (``LALRScheduleCallback``,
``TempBalanceCallback``): the defaults their ``None`` arguments stand for, and the checks of their
values and of the layers they find, each failing in one line that names the fix. Pure Python;
the callbacks keep what :func:`lalr_settings` and :func:`tempbalance_settings` return under the
arguments' own names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import Layer, check_kinds
from lalr_lightning.core.runtime.checks import check_min_evals, reject_stray
from lalr_lightning.core.spectral.lalr_metrics import GROUPS, METRICS, MODES, check_weights, weight_shape
from lalr_lightning.core.spectral.powerlaw import check_fit
from lalr_lightning.core.spectral.tempbalance import ASSIGN, RANGED, SAMPLING, check_first

__all__ = ["lalr_layer_checks", "lalr_settings", "tempbalance_settings"]


def _phases(phases: Sequence[str] | str | None) -> tuple[str, ...]:
    phases = METRICS if phases is None else (phases,) if isinstance(phases, str) else tuple(phases)
    if not phases:
        raise ValueError("phases is empty: give at least one of svd, ce, cs (e.g. phases=['svd', 'ce', 'cs'])")
    bad = [p for p in phases if p not in METRICS]
    if bad:
        raise ValueError(f"unknown phase name(s) {bad} in phases={list(phases)}; valid: {', '.join(METRICS)} "
                         "(any order or subset, e.g. phases=['svd', 'ce', 'cs'])")
    return phases


def lalr_settings(
    who: str, *, phases: Sequence[str] | str | None, mode: str, floor: float,
    weights: Mapping[str, float] | Sequence[float] | None, hessian_delta: float | None, groups: str,
    bins: int | None, hist_range: float | None, eps: float, singleton_value: float | None,
    layer_types: Sequence[str], trainable_only: bool,
) -> dict[str, Any]:
    """LALRScheduleCallback's settings under their own names, defaults filled in; a ValueError
    naming the first that is out of range or does not go with ``mode`` / ``groups``."""
    if mode not in MODES:
        raise unknown("mode", mode, MODES)
    if groups not in GROUPS:
        raise unknown("groups", groups, GROUPS)
    if weights is not None and mode != "weighted":
        raise ValueError(f"weights only apply to mode='weighted' (got mode={mode!r}); drop weights or set the mode")
    reject_stray(who, "mode", mode, {"phases": phases, "weights": weights, "hessian_delta": hessian_delta},
                 {"sequential": ("phases",), "weighted": ("weights",), "hessian": ("hessian_delta",)})
    reject_stray(who, "groups", groups, {"bins": bins, "hist_range": hist_range, "singleton_value": singleton_value},
                 {"shape": ("singleton_value",), "histogram": ("bins", "hist_range")})
    phases = _phases(phases)
    hessian_delta = 0.1 if hessian_delta is None else hessian_delta
    bins = 64 if bins is None else bins
    hist_range = 8.0 if hist_range is None else hist_range
    singleton_value = 0.5 if singleton_value is None else singleton_value
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1] (0 = the paper exactly), got {floor}")
    if not 0.0 < hessian_delta <= 1.0:
        raise ValueError(f"hessian_delta must be in (0, 1], got {hessian_delta}")
    if int(bins) < 2 or not hist_range > 0 or not eps > 0 or not 0.0 <= singleton_value <= 1.0:
        raise ValueError(f"need bins >= 2, hist_range > 0, eps > 0, 0 <= singleton_value <= 1; got bins={bins}, "
                         f"hist_range={hist_range}, eps={eps}, singleton_value={singleton_value}")
    return dict(phases=phases, mode=mode, floor=float(floor), weights=check_weights(weights) if mode == "weighted"
                else None, hessian_delta=float(hessian_delta), groups=groups, bins=int(bins),
                hist_range=float(hist_range), eps=float(eps), singleton_value=float(singleton_value),
                layer_types=check_kinds(layer_types), trainable_only=bool(trainable_only))


def lalr_layer_checks(who: str, model_name: str, layers: Sequence[Layer], *, layer_types: Sequence[str],
                      trainable_only: bool, groups: str, singleton_value: float) -> str | None:
    """A ValueError when fewer than two ``layers`` are found (LALR compares layers with each
    other); with ``groups="shape"``, the warning when most layers have no same-shaped peer (they
    all get ``singleton_value``), else None."""
    if len(layers) < 2:
        found = f"only {layers[0].name!r}" if layers else "none"
        trains = " that train" if trainable_only else ""
        widen = ", set trainable_only=False" if trainable_only else ""
        raise ValueError(f"{who} compares layers with each other and needs at least 2 weight matrices{trains}; "
                         f"{model_name} has {found} of types {layer_types}. Widen layer_types{widen}, or use a model "
                         "with more layers.")
    if groups != "shape":
        return None
    shapes = [weight_shape(la) for la in layers]
    alone = [la.name for la, s in zip(layers, shapes) if shapes.count(s) == 1]
    if len(alone) * 2 <= len(layers):
        return None
    return (f"{who}(groups='shape'): {len(alone)} of {len(layers)} layers have no same-shaped peer and get "
            f"ce = cs = {singleton_value} ({', '.join(alone[:5])}{' ...' if len(alone) > 5 else ''}); "
            "groups='histogram' compares every layer with every other")


def tempbalance_settings(
    who: str, *, assign: str, fit: str, lr_min_ratio: float | None, lr_max_ratio: float | None, every_n_epochs: int,
    every_n_steps: int | None, first: bool | str, head: bool, min_evals: int, layer_types: Sequence[str],
    filter_zeros: bool, std: float | None, seed: int,
) -> dict[str, Any]:
    """TempBalanceCallback's settings under their own names, defaults filled in; a ValueError
    naming the first that is out of range or does not go with ``assign``."""
    if assign not in ASSIGN:
        raise unknown("assign", assign, ASSIGN)
    check_fit(fit)
    ranged = ("lr_min_ratio", "lr_max_ratio")
    reject_stray(who, "assign", assign, {"lr_min_ratio": lr_min_ratio, "lr_max_ratio": lr_max_ratio, "std": std},
                 {a: ranged if a in RANGED else ("std",) if a in SAMPLING else () for a in ASSIGN})
    lr_min_ratio = 0.5 if lr_min_ratio is None else lr_min_ratio
    lr_max_ratio = 1.5 if lr_max_ratio is None else lr_max_ratio
    if not 0 <= lr_min_ratio <= lr_max_ratio:
        raise ValueError(f"need 0 <= lr_min_ratio <= lr_max_ratio, got {lr_min_ratio}, {lr_max_ratio}")
    if every_n_epochs < 1 or (every_n_steps is not None and every_n_steps < 1):
        raise ValueError("every_n_epochs and every_n_steps must be >= 1")
    check_min_evals(who, min_evals)
    check_first(first)
    return dict(assign=assign, fit=fit, lr_min_ratio=float(lr_min_ratio), lr_max_ratio=float(lr_max_ratio),
                every_n_epochs=every_n_epochs, every_n_steps=every_n_steps, first=first, head=bool(head),
                min_evals=min_evals, layer_types=check_kinds(layer_types), filter_zeros=filter_zeros,
                std=1.0 if std is None else float(std), seed=seed)
