"""The per-layer HT-SR metrics beside the fit (norms, ranks, entropy, SNR, ...) of equal-length ESDs,
batched, and the rows of :func:`.htsr.analyze`'s table with their ``warning`` notes."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from lalr_lightning.core.spectral.esd import _Entry, _Esd, _slice_shape
from lalr_lightning.core.spectral.powerlaw import FIT_FIELDS as _FIT_COLS

__all__ = ["METRICS", "DEFAULT_METRICS"]

#: Every column :func:`.htsr.analyze` can compute (WeightWatcher's names where the quantity is the same).
METRICS = (
    "alpha",
    "xmin",
    "xmax",
    "D",
    "sigma",
    "num_evals",
    "num_pl_spikes",
    "spectral_norm",
    "log_spectral_norm",
    "norm",
    "log_norm",
    "stable_rank",
    "entropy",
    "alpha_weighted",
    "log_alpha_norm",
    "rand_distance",
    "snr",
)
#: ``metrics=None``: everything but ``rand_distance``, whose shuffled copy doubles the SVD cost.
DEFAULT_METRICS = tuple(m for m in METRICS if m != "rand_distance")

ALPHA_LOW, ALPHA_HIGH = 2.0, 6.0  # WW's 'over-trained' / 'under-trained' thresholds (warning column)
_NEEDS_FIT = {"alpha", "xmin", "xmax", "D", "sigma", "num_pl_spikes", "alpha_weighted", "log_alpha_norm"}


# --------------------------------------------------------------------------- metrics


def _metric_rows(X: Tensor, alpha: Tensor, wanted: set, floor: Tensor, beta: Tensor) -> list[tuple[dict, list[str]]]:
    """The norm metrics of a batch of equal-length ESDs (B, N), batched, with a note for each
    value that is NaN or infinite (the table's ``warning`` column). ``floor``: per row, the
    eigenvalue at or below which a value counts as zero (:meth:`_Esd.rank_floor`; for an SVD in
    precision eps, WW's numerical-rank tolerance ``s <= max(s) * max_dim * eps``)."""
    lam = X[:, -1]
    norm = X.sum(1)
    alive = lam > 0  # all-zero weights: logs, ratios and fits are undefined
    nan = torch.full_like(lam, math.nan)
    cols: dict[str, Tensor] = {
        "num_evals": torch.full_like(lam, X.shape[1]),
        "spectral_norm": lam,
        "log_spectral_norm": torch.where(alive, torch.log10(lam), nan),
        "norm": norm,
        "log_norm": torch.where(alive, torch.log10(norm), nan),
        "stable_rank": torch.where(alive, norm / lam, nan),
    }
    notes: list[list[str]] = [[] if ok else ["all-zero weights: no spectrum"] for ok in alive.tolist()]
    nonzero = X > floor[:, None]
    sv = torch.where(nonzero, X, 0).sqrt()  # singular values, those below the floor as exact zeros
    if "entropy" in wanted:  # WW: Shannon entropy of l/sum(l) (+1e-10) over ln(numerical rank)
        rank = nonzero.sum(1)
        p = X / norm[:, None] + 1e-10
        ent = (-(p * torch.log(p)).sum(1) / torch.log(rank.to(X.dtype) + 1e-10)).clamp(0, 1)  # +1e-10 can pass 1
        cols["entropy"] = torch.where(alive & (rank >= 2), ent, nan)
        for r, (ok, rk) in enumerate(zip(alive.tolist(), rank.tolist())):
            if ok and rk < 2:
                notes[r].append(f"entropy: numerical rank {rk}, it needs 2")
    if "snr" in wanted:  # Spectrum: sums of singular values above / at-or-below the MP edge, over the max
        q = torch.quantile(sv, torch.tensor([0.25, 0.75], dtype=X.dtype, device=X.device), dim=1)
        thr = (q[1] - q[0]) / 1.349 * (1 + beta.sqrt())
        above = sv > thr[:, None]
        signal = (sv * above).sum(1)
        noise = torch.where(above.all(1), torch.ones_like(lam), (sv * ~above).sum(1))  # Spectrum: empty noise = 1
        snr = torch.where(noise != 0, signal / noise, torch.full_like(lam, math.inf)) / lam.sqrt()
        cols["snr"] = torch.where(alive, snr, nan)
        for r, (ok, v) in enumerate(zip(alive.tolist(), snr.tolist())):
            if ok and math.isinf(v):
                notes[r].append("snr inf: the singular values at or below the MP threshold are all 0 (Spectrum's rule)")
    cols["alpha_weighted"] = alpha * cols["log_spectral_norm"]
    if "log_alpha_norm" in wanted:  # log10(sum l^alpha), in log space: no overflow where WW gives inf
        lan = torch.logsumexp(alpha[:, None] * torch.log(X), 1) / math.log(10)
        cols["log_alpha_norm"] = torch.where(alive, lan, nan)
    lists = {k: v.tolist() for k, v in cols.items()}
    rows = []
    for r in range(X.shape[0]):
        row = {k: v[r] for k, v in lists.items()}
        row["num_evals"] = int(row["num_evals"])
        rows.append((row, notes[r]))
    return rows


def _js_distance(x: Tensor, y: Tensor) -> float:
    """WW's ``rand_distance``: JS distance of the two sorted eigenvalue vectors as distributions."""
    m = x + y
    p, q, m = x / x.sum(), y / y.sum(), m / m.sum()

    def kl(a: Tensor, b: Tensor) -> Tensor:
        mask = a > 0
        return (a[mask] * torch.log(a[mask] / b[mask])).sum()

    return float(((kl(p, m) + kl(q, m)) / 2).clamp_min(0).sqrt())


def _check_metrics(metrics) -> list[str]:
    if metrics is None:
        return list(DEFAULT_METRICS)
    if metrics == "all":
        return list(METRICS)
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; valid: {METRICS} (or 'all')")
    return [m for m in METRICS if m in metrics]


def _metric_table_rows(entries: list[_Entry], esds: list[_Esd], fits: list, wset: set) -> list[dict]:
    """One row of metrics and fit columns per entry (with its ``warning``), computed batched over
    the ESDs of one length and device."""
    rows: list[dict] = [{} for _ in entries]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, r in enumerate(esds):
        groups[(r.evals.numel(), r.evals.device)].append(k)
    for ks in groups.values():
        dev = esds[ks[0]].evals.device
        sh = [_slice_shape(entries[k].shape, entries[k].kind) for k in ks]
        floor = torch.tensor([esds[k].rank_floor() for k in ks], dtype=torch.float64, device=dev)
        beta = torch.tensor([n / m for _, m, n in sh], dtype=torch.float64, device=dev)
        alpha = torch.tensor([f["alpha"] if isinstance(f, dict) else math.nan for f in (fits[k] for k in ks)],
                             dtype=torch.float64, device=dev)
        out = _metric_rows(torch.stack([esds[k].evals for k in ks]), alpha, wset, floor, beta)
        for k, (row, notes) in zip(ks, out):
            f = fits[k]
            row.update({c: f[c] for c in _FIT_COLS} if isinstance(f, dict) else {c: math.nan for c in _FIT_COLS})
            row["warning"] = "; ".join(notes + _fit_notes(f, wset))
            rows[k] = row
    return rows


def _fit_notes(f: dict | str | None, wset: set) -> list[str]:
    """The warning column's notes on a layer's fit: why there is none, or alpha out of WW's range."""
    if isinstance(f, str) and f != "all-zero weights":
        return [f"no power-law fit: {f}"]
    if isinstance(f, dict) and "alpha" in wset:
        if f["alpha"] < ALPHA_LOW:
            return [f"alpha < {ALPHA_LOW:g}: very heavy tail (WeightWatcher's 'over-trained')"]
        if f["alpha"] > ALPHA_HIGH:
            return [f"alpha > {ALPHA_HIGH:g}: no heavy tail (WeightWatcher's 'under-trained')"]
    return []
