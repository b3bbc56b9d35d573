"""Spectral quantities of an NTK and the selection built on them: Theorem 5's condition number,
Theorem 6's ``eta`` per layer, and the greedy selection (:mod:`.ntk`'s docstring has the formulas).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "NTKSelection",
    "condition_number",
    "eta",
    "layer_etas",
    "greedy_ntk_selection",
    "head_selection",
]


def _sym64(a: Tensor, what: str) -> Tensor:
    if not isinstance(a, Tensor) or a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{what} must be a square matrix, got {getattr(a, 'shape', type(a).__name__)}")
    if not torch.isfinite(a).all():
        raise ValueError(f"{what} has NaN or infinite entries")
    a = a.detach().to(torch.float64)
    return (a + a.T) / 2


def _check_sigma(sigma: float) -> float:
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
    return sigma


def condition_number(K: Tensor, sigma: float = 0.0) -> float:
    """``kappa(K + sigma I) = (lambda_max(K) + sigma) / (lambda_min(K) + sigma)`` (Theorem 5).

    ``K`` is PSD, so a slightly negative ``lambda_min`` from rounding is taken as 0; the result
    is ``inf`` when ``lambda_min + sigma`` is 0 (a singular ``K`` with ``sigma = 0``).
    """
    sigma = _check_sigma(sigma)
    w = torch.linalg.eigvalsh(_sym64(K, "K"))
    lo, hi = max(float(w[0]), 0.0) + sigma, max(float(w[-1]), 0.0) + sigma
    return hi / lo if lo > 0 else math.inf


def _inv_sqrt(K: Tensor, sigma: float, rcond: float) -> Tensor:
    """``(K + sigma I)^{-1/2}``; a clear error when it does not exist numerically."""
    a = _sym64(K, "K") + sigma * torch.eye(K.shape[0], dtype=torch.float64, device=K.device)
    w, u = torch.linalg.eigh(a)
    if float(w[-1]) <= 0 or float(w[0]) <= rcond * float(w[-1]):
        raise ValueError(
            f"K + sigma I is singular (lambda_min = {float(w[0]):.3g}, lambda_max = {float(w[-1]):.3g}, sigma = {sigma}), "
            "so K^{-1/2} does not exist; pass sigma > 0 (the ridge of section 4, sigma = lambda / 2), e.g. "
            f"sigma = {max(1e-6 * float(torch.trace(a)) / K.shape[0], 1e-12):.3g}"
        )
    return (u * w.rsqrt()) @ u.T


def eta(K: Tensor, S: Tensor, sigma: float = 0.0, *, rcond: float = 1e-12) -> float:
    """``eta = ||(K + sigma I)^{-1/2} S (K + sigma I)^{-1/2}||_2`` (Theorem 6; ``sigma = 0`` is verbatim).

    ``(1 - eta) lambda_i(K) <= lambda_i(K + S) <= (1 + eta) lambda_i(K)``. ``sigma > 0`` is the
    regularized kernel Theorem 7 works with and keeps ``eta`` finite for a rank-deficient ``K``
    (``N`` samples but fewer effective parameters, or a kernel of a few layers); with
    ``sigma = 0`` a numerically singular ``K`` (``lambda_min <= rcond * lambda_max``) raises.
    """
    return layer_etas(K, {"": S}, sigma, rcond=rcond)[""]


def layer_etas(K: Tensor, S: Mapping[str, Tensor], sigma: float = 0.0, *, rcond: float = 1e-12) -> dict[str, float]:
    """:func:`eta` of every ``S_l`` against one ``K`` (one inverse square root for all)."""
    sigma = _check_sigma(sigma)
    r = _inv_sqrt(K, sigma, rcond)
    out = {}
    for name, s in S.items():
        s64 = _sym64(s, f"S[{name!r}]")
        if s64.shape != r.shape:
            raise ValueError(f"S[{name!r}] is {tuple(s.shape)} but K is {tuple(K.shape)}")
        m = r @ s64 @ r
        out[name] = float(torch.linalg.eigvalsh((m + m.T) / 2).abs().max())
    return out


@dataclass
class NTKSelection:
    """Result of :func:`greedy_ntk_selection`.

    ``layers``: chosen, in order. ``eta``: each chosen layer's ``eta`` against the kernel of the
    layers chosen before it. ``eta_rounds[t]``: every remaining candidate's ``eta`` in round
    ``t``. ``kappa``: ``kappa(K_sel + sigma I)`` before any layer (index 0) and after each
    addition. ``stopped``: ``"kappa"`` (the best candidate would exceed the bound; its
    ``rejected_kappa``), ``"max_layers"`` or ``"exhausted"``.
    """

    layers: list[str]
    eta: dict[str, float]
    eta_rounds: list[dict[str, float]]
    kappa: list[float]
    stopped: str
    rejected: str | None = None
    rejected_kappa: float | None = None


def greedy_ntk_selection(
    S: Mapping[str, Tensor],
    kappa_max: float,
    sigma: float,
    *,
    base: Tensor | None = None,
    max_layers: int | None = None,
) -> NTKSelection:
    """Choose layers to fine-tune by Theorems 6-7: largest ``eta`` first, ``kappa`` bounded.

    Start from ``K_sel = base`` (the kernel of parameters always trained, e.g. the head;
    default 0). Each round computes, for every remaining candidate ``l``,
    ``eta_l = ||(K_sel + sigma I)^{-1/2} S_l (K_sel + sigma I)^{-1/2}||`` (Theorem 6 with ``K``
    the kernel of the layers already selected) and takes the candidate with the largest
    ``eta`` -- the one that moves the spectrum, hence the risk bound, most. It is added only
    if ``kappa(K_sel + S_l + sigma I) <= kappa_max``: Theorem 7 needs ``kappa(K + sigma I) <= c``
    for the trained set, and checking the kernel after the addition keeps that hypothesis
    true for the next round. Otherwise selection stops. ``sigma > 0`` is required: the first
    round has ``K_sel = 0`` (where ``eta_l = lambda_max(S_l) / sigma``).
    """
    sigma = _check_sigma(sigma)
    if sigma <= 0:
        raise ValueError("greedy_ntk_selection needs sigma > 0: the first round compares against K_sel = 0")
    if not (kappa_max >= 1):
        raise ValueError(f"kappa_max must be >= 1 (a condition number is at least 1), got {kappa_max}")
    if not S:
        raise ValueError("no candidate layers: S is empty")
    if max_layers is not None and max_layers < 1:
        raise ValueError(f"max_layers must be >= 1 or None, got {max_layers}")
    cand = {k: _sym64(v, f"S[{k!r}]") for k, v in S.items()}
    m = next(iter(cand.values())).shape[0]
    ksel = torch.zeros(m, m, dtype=torch.float64) if base is None else _sym64(base, "base")
    ksel = ksel.to(next(iter(cand.values())).device)
    chosen: list[str] = []
    etas: dict[str, float] = {}
    rounds: list[dict[str, float]] = []
    kappas = [condition_number(ksel, sigma)]
    while True:
        if not cand:
            return NTKSelection(chosen, etas, rounds, kappas, "exhausted")
        if max_layers is not None and len(chosen) >= max_layers:
            return NTKSelection(chosen, etas, rounds, kappas, "max_layers")
        e = layer_etas(ksel, cand, sigma)
        rounds.append(e)
        best = max(e, key=lambda k: e[k])  # first of equal etas, in the given order
        new = ksel + cand[best]
        kap = condition_number(new, sigma)
        if kap > kappa_max:
            return NTKSelection(chosen, etas, rounds, kappas, "kappa", best, kap)
        chosen.append(best)
        etas[best] = e[best]
        kappas.append(kap)
        ksel = new
        del cand[best]


def head_selection(S: Mapping[str, Tensor], head: str | None, kappa_max: float, sigma: float,
                   max_layers: int | None = None) -> tuple[NTKSelection, str | None]:
    """NTKSelect's rule: :func:`greedy_ntk_selection` over the kernels ``S`` but the ``head``'s,
    which is the start (``K_sel = S_head``; ``None``: no head, every layer ranked). A ValueError
    when no layer fits (nor the head alone); with the selection, the warning line when only the
    head fits (else None)."""
    S = dict(S)
    base = S.pop(head) if head is not None else None
    sel = greedy_ntk_selection(S, kappa_max, sigma, base=base, max_layers=max_layers)
    if not sel.layers and (base is None or sel.kappa[0] > kappa_max):
        start = "" if base is None else f" with the head {head!r} (alone: {sel.kappa[0]:.4g})"
        raise ValueError(f"NTKSelect: no layer keeps kappa(K + sigma I) <= kappa_max={kappa_max:g}{start} "
                         f"(the best, {sel.rejected!r}, gives {sel.rejected_kappa:.4g}); raise kappa_max or sigma")
    if sel.layers:
        return sel, None
    return sel, (f"NTKSelect: only the head {head!r} trains: adding the best layer, {sel.rejected!r}, gives kappa "
                 f"{sel.rejected_kappa:.4g} > kappa_max={kappa_max:g}")
