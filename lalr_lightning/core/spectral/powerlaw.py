"""Power-law fits of ESDs (MLE alpha, xmin by ``median``, ``ks`` or ``peak``) and the one typed
per-layer result, :class:`LayerFit`, that every reader of a layer's fit gets (TempBalance's
alphas, pruning's metrics, :func:`.htsr.analyze`'s table).

The rules (and how they match WeightWatcher and TempBalance) are in :mod:`.htsr`'s docstring.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from lalr_lightning.choices import unknown
from lalr_lightning.core.spectral.esd import (
    EVALS_THRESH,
    _check_dtype,
    _Esd,
    _esds_of,
    _layer_entries,
    _resolve_layers,
)

__all__ = ["FITS", "SMALL_N", "MIN_FIT_EVALS", "DegenerateSpectrumError", "LayerFit", "check_fit", "fit_power_law",
           "fit_layers", "alphas"]

FITS = ("median", "ks", "peak")
SMALL_N = 20  # WW's small-sample cutoff
_SMALL_N_TAIL = 8  # WW's minimum tail in the small-sample rule
MIN_FIT_EVALS = 3  # below this no tail has two points beyond xmin
_EXACT_WORK = 1 << 16  # candidate-x-tail elements below which the exact KS is cheaper than bounds
_BOUND_LEVELS = (32,)  # sample points per candidate for the bounds (one level: measured fastest)
#: the fit's own fields of :class:`LayerFit` (the table's fit columns, in its order)
FIT_FIELDS = ("alpha", "xmin", "xmax", "D", "sigma", "num_pl_spikes")


class DegenerateSpectrumError(ValueError):
    """The eigenvalues cannot be fitted (too few positive values, or ``xmin <= 0``)."""


# --------------------------------------------------------------------------- power-law fits
#
# The fits run on a batch X (B, N) of ascending float64 ESDs of equal length N (layers of a
# transformer or of a ResNet stage share N), so the per-layer cost is a few batched ops.


def _ks_rows(L: Tensor, alpha: Tensor, n: Tensor, b: Tensor, i: Tensor) -> Tensor:
    """Exact KS distance of the candidates ``(b, i)`` (row ``b`` of the batch, xmin index ``i``)."""
    N = L.shape[1]
    out = torch.empty(b.numel(), dtype=L.dtype, device=L.device)
    ar = torch.arange(N, dtype=L.dtype, device=L.device)
    a = 0
    while a < b.numel():
        lo = int(i[a])  # i ascends, so the chunk's widest row is its first
        rows = max(1, _EXACT_WORK // max(1, N - lo))
        bb, ii = b[a : a + rows], i[a : a + rows]
        dL = (L[bb, lo:] - L[bb, ii][:, None]).clamp_min_(0)  # k < i gives F = e = 0
        F = 1 - torch.exp(dL.mul_((1 - alpha[bb, ii])[:, None]))
        e = (ar[None, lo:] - ii[:, None].to(L.dtype)).clamp_min_(0).div_(n[ii][:, None])
        out[a : a + rows] = (F - e).abs_().amax(1)
        a += rows
    return out


def _ks_bounds(L: Tensor, alpha: Tensor, n: Tensor, b: Tensor, i: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Lower/upper bounds of the KS distance from ``m`` points spread over each candidate's tail.

    Between two sample points ``k1 < k2`` both CDFs are non-decreasing, so
    ``F(k) - e(k) <= F(k2) - e(k1)`` and ``e(k) - F(k) <= e(k2) - F(k1)``.
    """
    nt = n[i]
    j = torch.arange(m, dtype=L.dtype, device=L.device)
    K = i[:, None] + torch.floor(j[None, :] * ((nt - 1) / (m - 1))[:, None]).long()
    dL = L[b[:, None], K] - L[b, i][:, None]
    F = 1 - torch.exp(dL.mul_((1 - alpha[b, i])[:, None]))
    e = (K - i[:, None]).to(L.dtype).div_(nt[:, None])
    lower = (F - e).abs().amax(1)
    upper = torch.maximum(F[:, 1:] - e[:, :-1], e[:, 1:] - F[:, :-1]).amax(1)
    return lower, torch.maximum(upper, lower)


def _ks_search(X: Tensor, cand: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: index of the first candidate with the smallest KS distance, that distance, and
    whether any candidate had alpha > 1 (WW: D = 1 otherwise). ``cand``: (B, N-1) mask or None."""
    B, N = X.shape
    L = torch.log(X)
    Lc = L - L[:, -1:]  # centred: the suffix sums of short tails stay accurate
    S = Lc.flip(1).cumsum(1).flip(1)
    n = torch.arange(N, 0, -1, dtype=X.dtype, device=X.device)
    alpha = (1 + n / (S - n * Lc))[:, :-1]
    n = n[:-1]
    valid = alpha > 1
    if cand is not None:
        valid &= cand
    b, i = valid.nonzero(as_tuple=True)
    for m in _BOUND_LEVELS:
        if b.numel() == 0 or float(n[i].sum()) <= _EXACT_WORK * 4:
            break
        lower, upper = _ks_bounds(L, alpha, n, b, i, m)
        best = torch.full((B,), math.inf, dtype=X.dtype, device=X.device).scatter_reduce(0, b, upper, "amin")
        keep = lower <= best[b] * (1 + 1e-9) + 1e-15  # slack: only keeps more
        b, i = b[keep], i[keep]
    D = torch.full((B, N - 1), math.inf, dtype=X.dtype, device=X.device)
    if b.numel():
        order = torch.argsort(i, stable=True)  # chunks of similar tail length
        b, i = b[order], i[order]
        D[b, i] = _ks_rows(L, alpha, n, b, i)
    dmin, best_i = D.min(1)  # first index of the minimum
    return best_i, dmin, torch.isfinite(dmin)


def _tail_alpha(X: Tensor, i: Tensor, *, bias_corrected: bool = False) -> Tensor:
    """MLE alpha of the tails ``X[b, i_b:]`` with a direct (pairwise) sum per row."""
    N = X.shape[1]
    L = torch.log(X)
    s = (L - L.gather(1, i[:, None])).clamp_min(0).sum(1)  # k < i contribute 0
    nt = (N - i).to(X.dtype)
    return 1 + (nt - 1 if bias_corrected else nt) / s


def _tail_D(X: Tensor, i: Tensor, alpha: Tensor) -> Tensor:
    N = X.shape[1]
    k = torch.arange(N, dtype=X.dtype, device=X.device)
    ratio = (X / X.gather(1, i[:, None])).clamp_min(1)  # k < i: ratio 1, F = 0, e = 0
    F = 1 - ratio ** (1 - alpha[:, None])
    e = (k[None, :] - i[:, None].to(X.dtype)).clamp_min(0) / (N - i)[:, None].to(X.dtype)
    return (F - e).abs().amax(1)


def _small_n_fit(x: Tensor) -> tuple[int, float, float]:
    """WW's small-sample rule (N < 20): tails of >= 8, bias-corrected alpha, smallest D.

    WW 0.7.7 scores candidates by ``D - 0.868/sqrt(n)`` but its caller then re-selects by the
    smallest ``D``; the latter decides, so it is what we do.
    """
    N = x.numel()
    L = torch.log(x)
    best, best_d = None, math.inf
    for i in range(N - _SMALL_N_TAIL + 1):  # N < 20: a tiny loop
        nt = N - i
        s = float((L[i:] - L[i]).sum())
        if s <= 1e-12:
            continue
        a = 1.0 + (nt - 1.0) / s
        if a <= 1.0:
            continue
        F = 1 - (x[i:] / x[i]) ** (1 - a)
        D = float((torch.arange(nt, dtype=x.dtype, device=x.device) / nt - F).abs().max())
        if D < best_d:
            best, best_d = (i, a, D), D
    if best is not None:
        return best
    if float((L - L[0]).sum()) <= 1e-12:
        return 0, 1.0, 1.0
    i0 = torch.zeros(1, dtype=torch.long, device=x.device)
    a = _tail_alpha(x[None], i0, bias_corrected=True)
    return 0, float(a), float(_tail_D(x[None], i0, a))


def _peak_candidates(x: Tensor) -> Tensor:
    """Candidate mask of the ``peak`` fit (TempBalance's ``xmin_peak`` range)."""
    lx = torch.log10(x[x > 0])  # exact zeros (unfiltered ESDs) have no log bin
    lo, hi = float(lx.min()), float(lx.max())
    counts = torch.histc(lx, bins=100, min=lo, max=hi)
    edges = torch.linspace(lo, hi, 101, dtype=x.dtype, device=x.device)
    peak = 10 ** float(edges[int(torch.argmax(counts))])
    c = x[:-1]
    return (c >= math.log10(0.95 * peak)) & (c <= 1.5 * peak)


def _fit_rows(X: Tensor, fit: str, xmin_pos: float | None, small_n: int) -> list[dict | str]:
    """Fit every row of ``X`` (B, N); a row that cannot be fitted gets the reason as a string."""
    B, N = X.shape
    if N < MIN_FIT_EVALS:
        return [f"{N} eigenvalue(s) to fit; a power-law fit needs at least {MIN_FIT_EVALS}"] * B
    dev = X.device
    if fit == "median":
        i = min(max(int(N // (2 if xmin_pos is None else xmin_pos)), 0), N - 2)
        idx = torch.full((B,), i, dtype=torch.long, device=dev)
        bad = ~(X[:, i] > 0)
        why = f"xmin = eigenvalue {i} of {N} is 0 (too many zero eigenvalues)"
    else:
        bad = ~(X[:, -2] > 0)
        why = "fewer than 2 positive eigenvalues"
    flat = X[:, -1] == X[:, 0]
    out: list[dict | str] = [why] * B
    for k in (flat & ~bad).nonzero().flatten().tolist():
        out[k] = "all eigenvalues are equal, so alpha is unbounded"
    bad |= flat
    ok = (~bad).nonzero().flatten()
    if ok.numel() == 0:
        return out
    Xo = X[ok]
    D = None
    if fit == "median":
        idx = idx[ok]
        alpha = _tail_alpha(Xo, idx)
    elif fit == "ks" and N < small_n:
        res = [_small_n_fit(x) for x in Xo]
        idx = torch.tensor([r[0] for r in res], device=dev)
        alpha = torch.tensor([r[1] for r in res], dtype=X.dtype, device=dev)
        D = torch.tensor([r[2] for r in res], dtype=X.dtype, device=dev)
    else:
        cand = torch.stack([_peak_candidates(x) for x in Xo]) if fit == "peak" else None
        idx, D, found = _ks_search(Xo, cand)
        if not bool(found.all()):  # no candidate with alpha > 1: WW keeps the first (positive) one, D = 1
            first = (Xo[:, :-1] > 0) if cand is None else (cand & (Xo[:, :-1] > 0))
            first = torch.where(first.any(1), first.float().argmax(1), torch.full_like(idx, N - 2))
            idx = torch.where(found, idx, first)
            D = torch.where(found, D, torch.ones_like(D))
        alpha = _tail_alpha(Xo, idx)
    if D is None:
        D = _tail_D(Xo, idx, alpha)
    xmin = Xo.gather(1, idx[:, None])[:, 0]
    nt = (N - idx).to(X.dtype)
    spikes = (Xo >= xmin[:, None]).sum(1)
    cols = zip(alpha.tolist(), xmin.tolist(), Xo[:, -1].tolist(), D.tolist(),
               ((alpha - 1) / nt.sqrt()).tolist(), spikes.tolist(), idx.tolist())
    for k, (a, xm, xx, d, sg, sp, ix) in zip(ok.tolist(), cols):
        out[k] = {"alpha": a, "xmin": xm, "xmax": xx, "D": d, "sigma": sg, "num_pl_spikes": sp, "xmin_index": ix}
    return out


def _fit_many(xs: Sequence[Tensor], fit: str, xmin_pos: float | None, small_n: int) -> list[dict | str]:
    """Fit many ascending float64 ESDs, batching those of equal length (and device)."""
    out: list[dict | str | None] = [None] * len(xs)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, x in enumerate(xs):
        groups[(x.numel(), x.device)].append(k)
    for ks in groups.values():
        for k, r in zip(ks, _fit_rows(torch.stack([xs[k] for k in ks]), fit, xmin_pos, small_n)):
            out[k] = r
    return out  # type: ignore[return-value]


def check_fit(fit: str) -> None:
    """An error naming the choices unless ``fit`` is one of :data:`FITS` (the one check of ``fit``)."""
    if fit not in FITS:
        raise unknown("fit", fit, FITS)


def fit_power_law(
    evals: Tensor | Sequence[Tensor],
    fit: str = "median",
    *,
    xmin_pos: float | None = None,
    small_n: int = SMALL_N,
) -> dict:
    """MLE power-law fit of one ESD or a list of ESDs (the rules: :mod:`.htsr`'s docstring).

    ``xmin_pos`` is TempBalance's divisor for ``median`` (``i = N // xmin_pos``, default 2).
    ``small_n``: the ``ks`` fit uses WW's small-sample rule below this many eigenvalues (0: never).
    The values are fitted as given (no zero filtering: :func:`analyze` filters). Returns
    ``alpha, xmin, xmax, D, sigma, num_pl_spikes, xmin_index``: floats for one tensor, numpy
    arrays (one entry per ESD) for a list. ValueError for an unknown fit, or an ESD with fewer
    than 3 values or a non-positive xmin (the message says which one).
    """
    check_fit(fit)
    single = isinstance(evals, Tensor)
    seq = [evals] if single else list(evals)
    xs = []
    for k, ev in enumerate(seq):
        x = torch.as_tensor(ev).detach().flatten().to(torch.float64).sort().values
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"ESD {k} holds NaN or Inf eigenvalues")
        xs.append(x)
    rows = _fit_many(xs, fit, xmin_pos, small_n)
    for k, r in enumerate(rows):
        if isinstance(r, str):
            raise DegenerateSpectrumError(r if single else f"ESD {k}: {r}")
    if single:
        return rows[0]  # type: ignore[return-value]
    return {key: np.array([r[key] for r in rows]) for key in rows[0]} if rows else {}



def _fit_esds(esds: Sequence[_Esd], fit: str, xmin_pos: float | None, filter_zeros: bool) -> list[dict | str]:
    """Fit each layer's ESD (after the zero filter); a layer that cannot be fitted gets the reason.

    Beyond :func:`fit_power_law`'s own checks: all-zero weights, a flat spectrum (every fitted
    eigenvalue equal within the route's error: alpha is then set by rounding, not by the
    weights), and, without the zero filter, an xmin at the rounding level (:meth:`_Esd.err`).
    """
    out: list[dict | str | None] = [None] * len(esds)
    xs, idx = [], []
    for k, r in enumerate(esds):
        ev = r.evals
        x = ev[ev > EVALS_THRESH] if filter_zeros else ev
        if float(ev[-1]) == 0:
            out[k] = "all-zero weights"
        elif filter_zeros and x.numel() < MIN_FIT_EVALS:
            out[k] = (f"{x.numel()} of {ev.numel()} eigenvalue(s) above the zero filter ({EVALS_THRESH:g}); a power-law "
                      f"fit needs at least {MIN_FIT_EVALS} (rank-deficient or tiny weights)")
        elif x.numel() >= MIN_FIT_EVALS and r.flat(x):
            out[k] = ("flat spectrum: the fitted eigenvalues are all equal up to rounding (e.g. an orthogonal "
                      "matrix), so alpha is unbounded")
        else:
            xs.append(x)
            idx.append(k)
    for k, res in zip(idx, _fit_many(xs, fit, xmin_pos, SMALL_N)):
        if isinstance(res, dict) and not filter_zeros and res["xmin"] <= esds[k].err(0.0, stored=True):
            res = (f"xmin {res['xmin']:.3g} is at the rounding level of the weights or of the solver "
                   f"(rank-deficient layer); filter_zeros=True fits only eigenvalues above {EVALS_THRESH:g}")
        out[k] = res
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------- the per-layer result


@dataclass(frozen=True)
class LayerFit:
    """One layer's power-law fit, or why it has none -- the data, where a warning only tells a person.

    ``status``: ``"fitted"``; ``"failed"`` (the spectrum cannot be fitted: all-zero weights, too few
    eigenvalues above the zero filter, a flat spectrum, an xmin at the rounding level); or
    ``"skipped"`` (left out before measuring, e.g. outside ``min_evals``/``max_evals``); or
    ``"unfitted"`` (only metrics that need no fit were asked for). ``reason`` says why for all but
    the first ("" when fitted); the fit's fields are then NaN (``num_pl_spikes``
    and ``xmin_index`` -1). ``num_evals``: the ESD's eigenvalues before the zero filter (0 when
    skipped). ``metrics``: the other per-layer values measured with it (:func:`.htsr.layer_fits`'
    ``metrics``; empty from :func:`fit_layers`).
    """

    name: str
    num_evals: int
    alpha: float = math.nan
    xmin: float = math.nan
    xmax: float = math.nan
    D: float = math.nan
    sigma: float = math.nan
    num_pl_spikes: int = -1
    xmin_index: int = -1
    status: str = "fitted"
    reason: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "fitted"

    def value(self, metric: str) -> float:
        """The fit's field ``metric``, else that measured metric (NaN where the fit failed); a
        KeyError for a metric that was not measured."""
        if metric in FIT_FIELDS:
            return float(getattr(self, metric)) if self.ok else math.nan
        return float(self.metrics[metric])

    @classmethod
    def of(cls, name: str, num_evals: int, fitted: dict | str | None, metrics: Mapping[str, float] | None = None,
           ) -> LayerFit:
        """From a fit's row (a dict), or its reason (a string; None: no fit was asked for)."""
        extra = dict(metrics or {})
        if isinstance(fitted, dict):
            return cls(name, num_evals, **{k: fitted[k] for k in (*FIT_FIELDS, "xmin_index")}, metrics=extra)
        if fitted is None:
            return cls(name, num_evals, status="unfitted", reason="no fit was asked for", metrics=extra)
        return cls(name, num_evals, status="failed", reason=fitted, metrics=extra)


def fit_layers(
    layers,
    *,
    fit: str = "median",
    filter_zeros: bool = False,
    dtype: torch.dtype = torch.float32,
    xmin_pos: float | None = None,
) -> list[LayerFit]:
    """The fit of each layer (an ``nn.Module``'s matrix layers, or a list of them), in order: the
    callbacks' fast path (TempBalance defaults: median fit, no filter), with no table and no
    warning -- a layer that cannot be fitted has ``status="failed"`` and its ``reason``."""
    check_fit(fit)
    _check_dtype(dtype)
    layers = _resolve_layers(layers, None)
    esds = _esds_of(_layer_entries(layers), dtype, thr=EVALS_THRESH if filter_zeros else None)
    return [LayerFit.of(layer.name, r.evals.numel(), f)
            for layer, r, f in zip(layers, esds, _fit_esds(esds, fit, xmin_pos, filter_zeros))]


def alphas(
    layers,
    *,
    fit: str = "median",
    filter_zeros: bool = False,
    dtype: torch.dtype = torch.float32,
    xmin_pos: float | None = None,
) -> dict[str, float]:
    """Alpha per layer name (:func:`fit_layers`' alphas).

    Accepts an ``nn.Module`` or a list of matrix layers. Layers that cannot be fitted get NaN and
    one warning naming them and the reason (as :func:`.htsr.analyze`'s ``warning`` column); a
    program that needs the reasons reads :func:`fit_layers`.
    """
    fits = fit_layers(layers, fit=fit, filter_zeros=filter_zeros, dtype=dtype, xmin_pos=xmin_pos)
    bad = [f"{f.name} ({f.reason})" for f in fits if not f.ok]
    if bad:
        warnings.warn("alpha is NaN (no power-law fit) for: " + "; ".join(bad), stacklevel=2)
    return {f.name: f.alpha for f in fits}
