"""TempBalance's assignment of learning-rate multipliers from HT-SR alpha ("Layerwise Training of Deep Neural Networks" (https://www2.eecs.berkeley.edu/Pubs/TechRpts/2023/EECS-2023-126.html) ch. 2),
and which layers it balances. Pure numpy / torch; the callback (``callbacks/tempbalance.py``)
decides when.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import block_layers, output_layer
from lalr_lightning.core.model.layers import Layer, matrix_layers, num_eigenvalues
from lalr_lightning.core.spectral.powerlaw import LayerFit, fit_layers

__all__ = ["ASSIGN", "FIRST", "RANGED", "SAMPLING", "assign_multipliers", "check_first", "eligible_layers", "finite_alphas",
           "fit_alphas"]


# ---------------------------------------------------------------------------- assignment
# Each function maps the eligible layers' alphas (1-D array) to multipliers of the scheduled
# LR. "Weighted" forms are n * f(alpha_i) / sum_j f(alpha_j): their mean is exactly 1, so the
# model-wide learning rate is redistributed rather than changed (thesis eq. 2.13-2.19).


def _linear_map(alpha, *, lr_min_ratio, lr_max_ratio, **_):
    lo, hi = float(alpha.min()), float(alpha.max())
    if hi - lo <= 0:
        # every layer alike: nothing to redistribute, every layer gets the middle of the range
        # (1.0, the scheduled LR, for the default 0.5..1.5). The reference's np.interp over the
        # degenerate range [a, a] returns lr_max_ratio for all, a jump from a mean of about 1 when
        # the alphas differ by a hair to 1.5x everywhere when they coincide.
        return np.full_like(alpha, (lr_min_ratio + lr_max_ratio) / 2.0)
    return lr_min_ratio + (alpha - lo) / (hi - lo) * (lr_max_ratio - lr_min_ratio)


def _step(alpha, *, lr_min_ratio, lr_max_ratio, **_):
    # TempBalance's tb_step: by rank, not by value. The layer with the j-th smallest alpha
    # (j = 0 .. n-1) gets lr_min + (lr_max - lr_min) * j / n, so the largest alpha gets
    # lr_max - (lr_max - lr_min) / n, never lr_max itself (as the reference); equal alphas are
    # ranked in model order (the reference's np.argsort does not promise an order for ties)
    n = len(alpha)
    out = np.empty(n)
    out[np.argsort(alpha, kind="stable")] = lr_min_ratio + (lr_max_ratio - lr_min_ratio) * np.arange(n) / n
    return out


def _weighted(f: Callable[[np.ndarray], np.ndarray]):
    def assign(alpha, **_):
        w = f(alpha)
        total = w.sum()
        if not np.isfinite(total) or total <= 0:
            raise ValueError(f"weights f(alpha) sum to {total}; this assignment needs positive alphas")
        return len(alpha) * w / total

    return assign


def _softmax(alpha):
    e = np.exp(alpha - alpha.max())  # shift for stability; softmax is shift-invariant
    return e


def _neg_pow2(alpha, **_):
    # probabilities 2^-n, ..., 2^-1 (eq. 2.20) with the residue added to the largest (eq. 2.21);
    # the layer with the j-th smallest alpha gets the j-th smallest probability (eq. 2.22)
    n = len(alpha)
    probs = 2.0 ** -np.arange(n, 0, -1, dtype=np.float64)
    probs[-1] += 1.0 - probs.sum()
    out = np.empty(n)
    out[np.argsort(alpha, kind="stable")] = probs
    return n * out


def _normalize_nonneg(x: np.ndarray) -> np.ndarray:
    # sampled weights can be negative; a negative learning rate would ascend the loss, so they
    # are clipped at zero before normalizing (the thesis leaves this open, sec. 2.5)
    x = np.clip(x, 0.0, None)
    total = x.sum()
    if total <= 0:
        return np.ones_like(x)
    return len(x) * x / total


def _sample_alpha(alpha, *, rng, std, **_):
    # y_i ~ N(alpha_i, std^2), normalized to mean 1 (eq. 2.26-2.27)
    return _normalize_nonneg(rng.normal(alpha, std))


def _by_alpha_rank(alpha, draws):
    # the layer with the j-th largest alpha gets the j-th largest draw
    out = np.empty(len(alpha))
    out[np.argsort(alpha, kind="stable")] = np.sort(draws)
    return _normalize_nonneg(out)


def _sample_lr(alpha, *, rng, std, base_lr, **_):
    # x ~ N(lr_t, std^2), n draws permuted by alpha rank (eq. 2.28-2.29)
    return _by_alpha_rank(alpha, rng.normal(base_lr, std, size=len(alpha)))


def _emg(alpha, *, rng, std, **_):
    # alpha modeled as Exp(nu) + N(0, std^2) (eq. 2.30-2.31), nu by maximum likelihood
    # (1 / mean alpha); n draws permuted by alpha rank like sample_lr
    nu = 1.0 / float(np.mean(alpha))
    draws = rng.exponential(1.0 / nu, size=len(alpha)) + rng.normal(0.0, std, size=len(alpha))
    return _by_alpha_rank(alpha, draws)


ASSIGN: dict[str, Callable[..., np.ndarray]] = {
    "linear_map": _linear_map,
    "identity": _weighted(lambda a: a),
    "square": _weighted(np.square),
    "cube": _weighted(lambda a: a**3),
    "sqrt": _weighted(np.sqrt),
    "cbrt": _weighted(np.cbrt),
    "log2": _weighted(np.log2),
    "softmax": _weighted(_softmax),
    "neg_pow2": _neg_pow2,
    "sample_alpha": _sample_alpha,
    "sample_lr": _sample_lr,
    "emg": _emg,
    "step": _step,
}


def assign_multipliers(
    alpha: Sequence[float] | np.ndarray,
    method: str = "linear_map",
    *,
    lr_min_ratio: float = 0.5,
    lr_max_ratio: float = 1.5,
    rng: np.random.Generator | None = None,
    std: float = 1.0,
    base_lr: float = 1.0,
) -> np.ndarray:
    """Learning-rate multipliers for layers with the given alphas (pure; no torch)."""
    if method not in ASSIGN:
        raise unknown("assign", method, ASSIGN)
    a = np.asarray(alpha, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError("assign_multipliers needs a non-empty 1-D array of alphas")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"alphas must be finite, got {a.tolist()}")
    rng = rng if rng is not None else np.random.default_rng(0)
    return ASSIGN[method](a, lr_min_ratio=lr_min_ratio, lr_max_ratio=lr_max_ratio, rng=rng, std=std, base_lr=base_lr)


#: Assignments that draw random numbers (they use ``std`` and the seeded generator).
SAMPLING = ("sample_alpha", "sample_lr", "emg")
#: Assignments onto the range ``[lr_min_ratio, lr_max_ratio]`` (they use those two).
RANGED = ("linear_map", "step")


#: the values of ``first``: balance the first matrix too, leave it out (TempBalance), or leave
#: out every matrix of the first block that holds one
FIRST = (True, False, "block")


def check_first(first: object) -> bool | str:
    """``first`` if it is one of :data:`FIRST`, else a one-line ValueError saying what each means
    (the one check of it: the callback's settings and :func:`eligible_layers` both call it)."""
    if first not in FIRST or not isinstance(first, (bool, str)):
        raise ValueError(f"first must be False (leave the first matrix out, as TempBalance), True (balance it) "
                         f"or 'block' (leave out every matrix of the first block), got {first!r}")
    return first


def _first_block(model: nn.Module, considered: list[Layer], who: str) -> tuple[str, list[Layer]]:
    """(name, matrices) of the first of the model's units -- stem, blocks, head, as
    :func:`block_layers` finds them without joining the stem -- that holds a considered matrix."""
    try:
        units = block_layers(model, join_stem=False)
    except ValueError as err:
        raise ValueError(f"{who}(first='block') cannot find the blocks of {type(model).__name__} ({err}); "
                         "use first=False (the first matrix, TempBalance's rule) or first=True") from None
    for unit in units:
        inside = [la for la in considered if any(k in unit.params for k in la.params)]
        if inside:
            return unit.name, inside
    return considered[0].name, considered[:1]


def eligible_layers(
    model: nn.Module,
    kinds: Sequence[str],
    *,
    first: bool | str = False,
    head: bool = False,
    min_evals: int = 50,
    who: str = "TempBalanceCallback",
) -> tuple[list[Layer], dict[str, str]]:
    """(layers to balance, {left-out layer: reason}) -- a function of the architecture only, so
    it is the same on every rank and after resume.

    Considered: the matrix layers of ``kinds``. Left out (TempBalance): the first one in module
    order unless ``first`` (``first="block"``: every considered matrix of the first stem or block
    that holds one -- all of a LLaMA's first decoder layer, where TempBalance's rule leaves out
    its ``q_proj`` alone; docs/tempbalance.md lists both per model family), the model's output layer (:func:`~lalr_lightning.core.model.blocks.output_layer`, found
    as the output layer even when its weight is tied to the input embedding -- then it is the
    embedding, and no block matrix takes its place) unless ``head``, and layers whose ESD has
    fewer than ``min_evals`` eigenvalues.
    """
    every = matrix_layers(model)
    considered = [layer for layer in every if layer.kind in kinds]
    if not considered:
        raise ValueError(
            f"{who} found no layers of types {tuple(kinds)} in {type(model).__name__}; "
            "add the model's kinds to layer_types"
        )
    check_first(first)
    excluded: dict[str, str] = {}
    if first == "block":
        unit, inside = _first_block(model, considered, who)
        excluded.update({layer.name: f"first block ({unit})" for layer in inside})
    elif not first:
        excluded[considered[0].name] = "first layer"
    out = output_layer(model, every)
    if not head and out is not None and any(layer is out for layer in considered):
        excluded[out.name] = "last layer (the model's output)"
    for layer in considered:
        if layer.name not in excluded and num_eigenvalues(layer) < min_evals:
            excluded[layer.name] = f"{num_eigenvalues(layer)} eigenvalues < min_evals={min_evals}"
    eligible = [layer for layer in considered if layer.name not in excluded]
    if len(eligible) < 2:
        detail = ", ".join(f"{k} ({v})" for k, v in excluded.items())
        raise ValueError(
            f"{who} needs at least 2 eligible layers to balance, found {len(eligible)} "
            f"(excluded: {detail}); lower min_evals, set first=True / head=True or widen layer_types"
        )
    return eligible, excluded


# ---------------------------------------------------------------------------- alphas


def fit_alphas(layers: Sequence[Layer], fit: str, filter_zeros: bool) -> dict[str, LayerFit]:
    """``{layer: its fit}`` (:class:`~lalr_lightning.core.spectral.powerlaw.LayerFit`: a degenerate
    layer's says why it has no alpha; :func:`finite_alphas` reports that, as an error)."""
    return {f.name: f for f in fit_layers(layers, fit=fit, filter_zeros=filter_zeros)}


def finite_alphas(fitted: Mapping[str, LayerFit], who: str = "TempBalanceCallback") -> dict[str, float]:
    """The alphas of :func:`fit_alphas`; a ValueError naming the layers with no power-law fit and why."""
    alphas = {n: f.alpha for n, f in fitted.items()}
    bad = [n for n, a in alphas.items() if not np.isfinite(a)]
    if bad:
        why = "; ".join(f"{n}: {fitted[n].reason}" for n in bad if fitted[n].reason)
        raise ValueError(
            f"{who}: no power-law fit for {bad} ({why or 'degenerate spectrum'}). Pruned or low-rank layers have "
            "many zero eigenvalues: filter_zeros=True fits only the non-zero ones; or leave these layers out with "
            "layer_types / min_evals"
        )
    return alphas


def few_evals_note(excluded: Mapping[str, str], who: str = "TempBalanceCallback") -> str | None:
    """The warning naming the layers :func:`eligible_layers` leaves at the scheduled LR for too few
    eigenvalues (the first and output layers, TempBalance's own rule, go unsaid), or None. Layers
    that differ only in their block number are one entry (``model.layers.*.self_attn.k_proj``, 22
    layers: a LLaMA's grouped-query ``k_proj`` / ``v_proj``)."""
    few = {k: v for k, v in excluded.items() if "< min_evals" in v}
    if not few:
        return None
    groups: dict[tuple[str, str], list[str]] = {}
    for name, why in few.items():
        groups.setdefault((re.sub(r"(?<=\.)\d+(?=\.)", "*", name), why), []).append(name)
    shown = "; ".join(f"{names[0]} ({why})" if len(names) == 1 else f"{pattern} ({len(names)} layers: {why})"
                      for (pattern, why), names in groups.items())
    return (f"{who} leaves {len(few)} layers at the scheduled learning rate, too few eigenvalues for a "
            f"power-law fit: {shown}. Lower min_evals to balance them")
