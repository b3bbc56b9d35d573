"""HTSRPruning's settings: the presets, and every check of the constructor's arguments, with the
defaults each choice fills in. Pure Python; ``callbacks/pruning.py`` keeps what this returns."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import check_kinds
from lalr_lightning.core.pruning.alphapruning import DIRECTIONS, OVERFLOW, PRUNING_METRICS
from lalr_lightning.core.pruning.criteria import CRITERIA, check_nm, needs_stats
from lalr_lightning.core.runtime.checks import check_min_evals, reject_stray
from lalr_lightning.core.spectral.powerlaw import check_fit

__all__ = ["FITTED", "OWL_LAMBDA", "OWL_M", "PRESETS", "check_when", "pruning_settings"]

#: metrics that come from a power-law fit (``fit`` and ``filter_zeros`` apply to them)
FITTED = ("alpha", "alpha_weighted", "log_alpha_norm")

#: what each preset fills in for the arguments left out (``None``); ``None``: no preset
PRESETS: dict[str | None, dict] = {
    None: dict(metric="alpha", epsilon=0.3, block_average=False, fit="ks", filter_zeros=True, min_numel=512,
               min_evals=10),
    # AlphaPruning's LLM recipe (lib/esd_utils.py, lib/prune.py): alpha_peak on every eigenvalue (no zero
    # filter), averaged over each block's matrices, mapped onto [1 - eps, 1 + eps], scaled to the target
    # mean; every matrix of the blocks is pruned, whatever its size (docs/alphapruning.md)
    "alphapruning": dict(metric="alpha", epsilon=0.3, block_average=True, fit="peak", filter_zeros=False,
                         min_numel=1, min_evals=3),
    # OWL (core/pruning/owl.py, as ``prune --preset owl``): one ratio per transformer block from the share of
    # its Wanda scores above M x their mean on calibration activations; no spectral metric, every matrix pruned
    "owl": dict(metric=None, epsilon=None, block_average=False, fit=None, filter_zeros=False, min_numel=1,
                min_evals=1),
}

#: OWL's defaults, as the prune command's: the paper's M = 5 and llm-compressor's example lambda 0.08
OWL_M, OWL_LAMBDA = 5.0, 0.08


def pruning_settings(
    who: str, *, metric: str | None, target_sparsity: float | None, epsilon: float | None, direction: str,
    structured: bool, when: str | int, gradual_epochs: int | None, block_average: bool | None,
    blocks: Sequence[str] | None, fit: str | None, filter_zeros: bool | None, min_numel: int | None,
    min_evals: int | None, layer_types: Sequence[str], head: bool, overflow: str, max_ratio: float,
    channel_step: float | None, make_permanent: bool, preset: str | None, criterion: str, n: int, m: int,
    n_calibration: int | None, calibration: Iterable | None, blocksize: int | None, percdamp: float | None,
    owl_m: float | None = None, owl_lambda: float | None = None,
) -> dict[str, Any]:
    """The settings of ``HTSRPruning(...)`` under their own names, the preset's and the defaults
    filled in (``docs`` of the callback); a ``ValueError`` naming the fix for a bad combination."""
    if preset not in PRESETS:
        raise unknown("preset", preset, PRESETS, show=repr)
    given_fit = {"fit": fit, "filter_zeros": filter_zeros}
    fill = PRESETS[preset]
    if criterion not in CRITERIA:
        raise unknown("criterion", criterion, CRITERIA)
    n, m = check_nm(n, m)
    owl = _owl_settings(who, preset, owl_m, owl_lambda, metric=metric, epsilon=epsilon, fit=fit,
                        filter_zeros=filter_zeros, block_average=block_average, blocks=blocks)
    reject_stray(who, "criterion", criterion,
                 {"n_calibration": n_calibration, "calibration": calibration, "blocksize": blocksize,
                  "percdamp": percdamp},
                 {"magnitude": ("n_calibration", "calibration") if owl else (),  # OWL calibrates its ratios
                  "wanda": ("n_calibration", "calibration"),
                  "sparsegpt": ("n_calibration", "calibration", "blocksize", "percdamp")})
    if m:
        target_sparsity, epsilon = _nm_ratios(n, m, target_sparsity, epsilon, preset)
    target_sparsity = 0.5 if target_sparsity is None else target_sparsity
    metric = fill["metric"] if metric is None else metric
    epsilon = fill["epsilon"] if epsilon is None else epsilon
    block_average = fill["block_average"] if block_average is None else block_average
    min_numel = fill["min_numel"] if min_numel is None else min_numel
    min_evals = fill["min_evals"] if min_evals is None else min_evals
    _check_choices(metric, direction, overflow, fit, owl)
    if not owl:
        reject_stray(who, "metric", metric, given_fit,
                     {m: ("fit", "filter_zeros") if m in FITTED else () for m in PRUNING_METRICS})
    reject_stray(who, "structured", structured, {"channel_step": channel_step}, {True: ("channel_step",), False: ()})
    if blocks is not None and not block_average:
        raise ValueError("blocks only applies with block_average=True (the blocks the metric is averaged over)")
    _check_ratios(max_ratio, target_sparsity, 0.0 if owl else epsilon)
    _check_when(when, structured, criterion, n, m)
    _check_calibration(n_calibration, blocksize, percdamp, m)
    if when == "gradual":
        if gradual_epochs is None or int(gradual_epochs) < 1:
            raise ValueError("when='gradual' needs gradual_epochs >= 1 (the number of pruning epochs)")
    elif gradual_epochs is not None:
        raise ValueError(f"gradual_epochs only applies to when='gradual' (got when={when!r})")
    if metric in FITTED and not owl and epsilon > 0 and min_evals < 2:  # the metric is measured, by a power-law fit
        check_min_evals(who, min_evals, f"metric={metric!r} comes from a power-law fit of each layer's eigenvalues, "
                                        "which needs at least two")
    if min_numel < 1 or min_evals < 1:
        raise ValueError("min_numel and min_evals must be >= 1")
    channel_step = 0.01 if channel_step is None else channel_step
    if not 0.0 < channel_step <= 1.0:
        raise ValueError(f"channel_step must be in (0, 1], got {channel_step}")
    layer_types = check_kinds(layer_types)
    if structured and "embedding" in layer_types:
        raise ValueError("structured=True prunes output channels, which embeddings do not have; "
                         "drop 'embedding' from layer_types")
    calibrated = needs_stats(criterion) or bool(owl)
    return dict(
        metric=metric, target_sparsity=float(target_sparsity), epsilon=None if owl else float(epsilon),
        direction=direction, owl_m=owl[0] if owl else None, owl_lambda=owl[1] if owl else None,
        structured=bool(structured), when=when, gradual_epochs=None if gradual_epochs is None else int(gradual_epochs),
        block_average=bool(block_average), blocks=None if blocks is None else list(blocks),
        fit=fill["fit"] if fit is None else fit,
        filter_zeros=bool(fill["filter_zeros"] if filter_zeros is None else filter_zeros), preset=preset,
        min_numel=int(min_numel), min_evals=int(min_evals), layer_types=layer_types, head=bool(head),
        overflow=overflow, max_ratio=float(max_ratio), channel_step=float(channel_step),
        make_permanent=bool(make_permanent), criterion=criterion, n=n, m=m,
        n_calibration=(128 if n_calibration is None else int(n_calibration)) if calibrated else None,
        calibration=calibration,
        blocksize=(128 if blocksize is None else int(blocksize)) if criterion == "sparsegpt" else None,
        percdamp=(0.01 if percdamp is None else float(percdamp)) if criterion == "sparsegpt" else None,
    )


def _nm_ratios(n: int, m: int, target_sparsity: float | None, epsilon: float | None,
               preset: str | None) -> tuple[float, float]:
    """N:M sparsity's one ratio, ``n / m``, and ``epsilon = 0``; an error for anything that asks otherwise."""
    # N:M prunes n of every m weights of every row: one ratio, n/m, for every layer. AlphaPruning's
    # own code does the same (its N:M branches never read the per-layer ratios).
    if target_sparsity is not None and abs(float(target_sparsity) - n / m) > 1e-9:
        raise ValueError(
            f"n={n}, m={m} prunes {n / m:g} of every layer, but target_sparsity={target_sparsity}; "
            f"drop target_sparsity (or set it to {n / m:g})"
        )
    if epsilon is not None and epsilon > 0:
        raise ValueError(
            f"N:M sparsity (n={n}, m={m}) prunes every layer at n/m, so HT-SR's per-layer ratios "
            f"(epsilon={epsilon}) cannot apply; drop epsilon (or n/m for per-layer ratios)"
        )
    if preset is not None:  # as the prune command: a preset is per-layer ratios
        raise ValueError(
            f"N:M sparsity (n={n}, m={m}) prunes every layer at n/m, so preset={preset!r}'s per-layer "
            "ratios cannot apply; drop preset (min_numel=1, min_evals=1 prune every matrix as it does)"
        )
    return n / m, 0.0


def _owl_settings(who: str, preset: str | None, owl_m: float | None, owl_lambda: float | None,
                  **ht_sr: Any) -> tuple[float, float] | None:
    """``(M, lambda)`` of ``preset="owl"`` (the defaults filled in), None for another preset; a one-line
    error for OWL's arguments without it, or HT-SR's (metric, epsilon, ...) with it."""
    if preset != "owl":
        if owl_m is not None or owl_lambda is not None:
            raise ValueError(f"{who}: owl_m and owl_lambda are OWL's; add preset='owl', or leave them out")
        return None
    stray = sorted(k for k, v in ht_sr.items() if v is not None)
    if stray:
        raise ValueError(f"{who}(preset='owl') takes its ratios from the activations' outliers (owl_m, owl_lambda), "
                         f"not from an HT-SR metric: leave out {', '.join(stray)}")
    m = OWL_M if owl_m is None else owl_m
    lam = OWL_LAMBDA if owl_lambda is None else owl_lambda
    if isinstance(m, bool) or not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
        raise ValueError(f"{who}: owl_m must be a number > 0 (outliers: scores above M x the block's mean), got {m}")
    if isinstance(lam, bool) or not (isinstance(lam, (int, float)) and 0 <= lam < 0.5):
        raise ValueError(f"{who}: owl_lambda must be in [0, 0.5) (the ratios span 2 x lambda around the target), "
                         f"got {lam}")
    return float(m), float(lam)


def _check_choices(metric: str | None, direction: str, overflow: str, fit: str | None, owl=None) -> None:
    if not owl and metric not in PRUNING_METRICS:
        raise unknown("metric", metric, PRUNING_METRICS)
    if direction not in DIRECTIONS:
        raise unknown("direction", direction, DIRECTIONS)
    if overflow not in OVERFLOW:
        raise unknown("overflow", overflow, OVERFLOW)
    if fit is not None:
        check_fit(fit)


def _check_ratios(max_ratio: float, target_sparsity: float, epsilon: float) -> None:
    if not 0.0 < max_ratio <= 1.0:
        raise ValueError(f"max_ratio must be in (0, 1], got {max_ratio}")
    if not 0.0 <= target_sparsity < 1.0:
        raise ValueError(
            f"target_sparsity must be in [0, 1) (the fraction of the pruned layers' weights set to zero), "
            f"got {target_sparsity}"
        )
    if target_sparsity > max_ratio:
        raise ValueError(f"target_sparsity {target_sparsity} exceeds max_ratio={max_ratio}; raise max_ratio")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(
            f"epsilon must be in [0, 1] (ratios spread over [1 - eps, 1 + eps] x target; a larger eps gives "
            f"negative ratios), got {epsilon}; AlphaPruning uses 0.3, 0 is uniform pruning"
        )


def _check_when(when: str | int, structured: bool, criterion: str, n: int, m: int) -> None:
    """When and how the criterion prunes: ``structured`` and ``when='gradual'`` are magnitude's alone."""
    if isinstance(when, bool) or not (when in ("fit_start", "gradual") or (isinstance(when, int) and when >= 0)):
        raise ValueError(f"when must be 'fit_start', 'gradual' or an epoch number >= 0, got {when!r}")
    if structured and (criterion != "magnitude" or m):
        raise ValueError(
            f"structured=True prunes whole output channels by their L2 norm; criterion={criterion!r}"
            + (f" with n={n}, m={m}" if m else "") + " prunes single weights: drop structured=True"
        )
    if when == "gradual" and (criterion != "magnitude" or m):
        raise ValueError(
            f"when='gradual' grows magnitude masks over epochs; criterion={criterion!r}"
            + (f" with n={n}, m={m}" if m else "") + " prunes once: use when='fit_start' or an epoch number"
        )


def _check_calibration(n_calibration: int | None, blocksize: int | None, percdamp: float | None, m: int) -> None:
    if n_calibration is not None and (isinstance(n_calibration, bool) or int(n_calibration) < 1):
        raise ValueError(f"n_calibration must be >= 1 (calibration sequences), got {n_calibration}")
    if blocksize is not None and int(blocksize) < 1:
        raise ValueError(f"blocksize must be >= 1, got {blocksize}")
    if blocksize is not None and m and int(blocksize) % m:
        raise ValueError(f"blocksize ({blocksize}) must be a multiple of m={m}")
    if percdamp is not None and not float(percdamp) >= 0:
        raise ValueError(f"percdamp must be >= 0 (SparseGPT's dampening, 0.01), got {percdamp}")


def check_when(who: str, when: str | int, gradual_epochs: int | None, max_epochs: int | None) -> None:
    """A one-line ValueError when the fit's ``max_epochs`` ends before the pruning does: an epoch
    number ``when`` the fit never starts (it would never prune), or a gradual schedule longer than the
    fit (it would stop short of the target). ``max_epochs`` None or negative (a fit bounded by steps
    alone): nothing to check."""
    if max_epochs is None or max_epochs < 0:
        return
    if isinstance(when, int) and not isinstance(when, bool) and when >= max_epochs:
        raise ValueError(f"{who}(when={when}) prunes at the start of epoch {when}, but the fit runs epochs 0 to "
                         f"{max_epochs - 1} (max_epochs={max_epochs}), so it would never prune; use when < "
                         f"{max_epochs}, or raise max_epochs")
    if when == "gradual" and gradual_epochs is not None and gradual_epochs > max_epochs:
        raise ValueError(f"{who}(when='gradual', gradual_epochs={gradual_epochs}) reaches its target at the start of "
                         f"epoch {gradual_epochs - 1}, but the fit has max_epochs={max_epochs}, so it would stop short "
                         f"of the target; use gradual_epochs <= {max_epochs}, or raise max_epochs")
