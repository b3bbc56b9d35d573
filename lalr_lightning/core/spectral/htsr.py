"""Heavy-tailed self-regularization (HT-SR) spectral analysis, batched and on the weights' device.

The numbers follow the two reference implementations (docs/internals.md, "Conventions (matching
the reference implementations)"):

* ESD: eigenvalues of ``W^T W`` (squared singular values), ascending, no ``1/N``, float64 in the
  true scale (computed on a power-of-two rescaled copy; routes and error model: comment "ESDs"
  below). A Conv2d
  weight ``(out, in, kh, kw)`` is ``kh*kw`` matrices ``out x in`` scaled by ``sqrt(0.5)``
  (eigenvalues x 0.5) and pooled; Conv1d ``(out, in, k)`` likewise with ``k`` slices.
  WeightWatcher does the same for Conv2d; it counts an ``nn.Conv1d`` weight's eigenvalues by the
  tensor's smallest dimension (usually the kernel size) and so mostly skips it: conv1d rows have
  no WW twin.
* Power-law alpha by MLE ``alpha = 1 + n / (sum_{j>=i} ln l_j - n ln l_i)`` with three ways of
  choosing ``xmin = l_i`` (:data:`FITS`):

  - ``median``: TempBalance, ``i = N // xmin_pos`` (``xmin_pos=2``);
  - ``ks``: WeightWatcher, every eigenvalue but the last is a candidate; KS distance
    ``D_i = max_{k>=i} |1 - (l_k/l_i)^(1-alpha_i) - (k-i)/n_i|`` (one-sided ``k/n`` step, as WW),
    ``D_i = 1`` where ``alpha_i <= 1``; the first argmin wins. For fewer than 20 eigenvalues WW
    switches to its small-sample rule (tails of at least 8, bias-corrected
    ``alpha = 1 + (n-1)/S``, smallest D), and so do we (``small_n=0`` turns it off);
  - ``peak``: fix-fingers as TempBalance's ``xmin_peak``: 100 bins of ``log10(l)``, ``p`` = left
    edge of the tallest bin, candidates with ``log10(0.95 p) <= l_i <= 1.5 p`` (the lower bound
    is a log value compared with eigenvalues: upstream's quirk, kept so the numbers agree),
    then as ``ks``. WW's ``fix_fingers='xmin_peak'`` hands the same range to the ``powerlaw``
    package, which also drops the highest candidate and refines alpha numerically outside
    ``(1.5, 3]``; with WW 0.7.7 it fails outright (``pl_package='ww'`` cannot take a range and
    powerlaw 2.0 no longer accepts WW's arguments), so TempBalance is the reference here.

  The KS search is exact but does not evaluate all ``N^2/2`` terms: a branch-and-bound on
  per-candidate lower/upper bounds (the fitted and empirical CDFs are both monotone between
  sample points) discards candidates that cannot win, and only the survivors get the full
  distance. No Python loop over candidates; ESDs of equal length (a transformer's blocks, a
  ResNet stage) are fitted as one batch.
* Metrics (WeightWatcher ``analyze()`` column names): see :data:`METRICS` and :func:`analyze`;
  a value that cannot be computed is NaN, with the reason in the table's ``warning`` column.
* Checkpoints: :func:`analyze` also takes a safetensors path and streams it one tensor at a time
  (:mod:`lalr_lightning.core.runtime.safetensors_checkpoints`).
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from lalr_lightning import progress
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import Layer, matrix_layers
from lalr_lightning.core.runtime.safetensors_checkpoints import is_checkpoint_path, load_matrix, stored_matrices

__all__ = [
    "FITS",
    "METRICS",
    "DEFAULT_METRICS",
    "EVALS_THRESH",
    "layer_esd",
    "compute_esds",
    "fit_power_law",
    "analyze",
    "alphas",
]

FITS = ("median", "ks", "peak")

#: Every column :func:`analyze` can compute (WeightWatcher's names where the quantity is the same).
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
EVALS_THRESH = 1e-5  # WW keeps eigenvalues > 1e-5 for the fit (CPU; 1e-4 on its CUDA path)
CONV_SCALE = 0.5  # eigenvalue factor of conv slices (W * sqrt(0.5))
SMALL_N = 20  # WW's small-sample cutoff
_SMALL_N_TAIL = 8  # WW's minimum tail in the small-sample rule
MIN_FIT_EVALS = 3  # below this no tail has two points beyond xmin
_KINDS = ("linear", "conv1d", "conv2d", "embedding", "hf_conv1d")
_FIT_COLS = ("alpha", "xmin", "xmax", "D", "sigma", "num_pl_spikes")
_NEEDS_FIT = {"alpha", "xmin", "xmax", "D", "sigma", "num_pl_spikes", "alpha_weighted", "log_alpha_norm"}
_MAX_STACK = 1 << 25  # elements per batched solver call (256 MB in float64)
_CPU_STACK = 1 << 14  # on CPU only matrices up to this size are stacked (call overhead matters)
_EXACT_WORK = 1 << 16  # candidate-x-tail elements below which the exact KS is cheaper than bounds
_BOUND_LEVELS = (32,)  # sample points per candidate for the bounds (one level: measured fastest)


class DegenerateSpectrumError(ValueError):
    """The eigenvalues cannot be fitted (too few positive values, or ``xmin <= 0``)."""


# --------------------------------------------------------------------------- ESDs
#
# Each layer's matrices are scaled by a power of two near 1/max|w| (exact in binary floating
# point), solved, and the eigenvalues brought back to the true scale in float64: alpha does not
# depend on the scale, and a float32 square cannot overflow (|w| > 1.8e19) or underflow
# (|w| < 1e-23) on the way. Routes (see :func:`analyze`, ``dtype``):
#
# * ``svd64``: float64 ``svdvals`` squared (WeightWatcher's route; ``dtype=torch.float64``);
# * ``svd32``: float32 ``svdvals`` squared;
# * ``gram64``: ``eigvalsh`` of the smaller Gram matrix ``W^T W`` formed in float64.
#
# Error model (absolute, per eigenvalue ``l``): an SVD in precision ``eps`` is accurate to about
# ``d = eps * s_max`` in each singular value (LAPACK Users' Guide 4.9.1's approximate bound), so
# ``err(l) = 2 sqrt(l) d + d^2``; the Gram route is accurate to ``E = 4 eps64 ||W||_F^2`` (per
# slice; measured: 0.1-0.3 eps64 ||W||_F^2) in every eigenvalue (forming ``W^T W`` costs small
# eigenvalues their relative accuracy; large ones keep it). ``dtype=float32`` takes the cheaper route per shape, accepts a Gram result only where
# ``E`` is no worse than the float32 SVD's error on every eigenvalue the fit uses (else float32
# SVD), and sends a layer to ``svd64`` when one of its eigenvalues is within ``err`` of the 1e-5
# zero filter (the filter's decision would depend on rounding). An SVD result is never
# discarded for its bound: it is often far more accurate (e.g. on row-graded matrices). The
# numerical rank (entropy; SNR's zeros) keeps WW's tolerance ``s <= maxdim * eps * s_max``.

_EPS32 = float(torch.finfo(torch.float32).eps)
_EPS64 = float(torch.finfo(torch.float64).eps)
_GRAM_ASPECT = 1.5  # slices with m >= this * n always start on the Gram route (measured faster)
_GRAM_BLOCK = 1 << 22  # float64 elements per block when forming a big Gram matrix (32 MB)
_SAFE_EXP = 60  # weights with max|w| in 2**+-60 are solved unscaled (bit-identical to no rescaling)


@dataclass
class _Esd:
    """One layer's eigenvalues: float64, ascending, true scale, and their error model."""

    evals: Tensor
    route: str  # svd32 | svd64 | gram64
    maxdim: int  # the slices' larger dimension
    a: float  # svd: d = eps * s_max; gram: E = 4 * eps64 * max over slices of sum(l)
    eps_w: float  # eps of the weights' own dtype: storing them already rounds at this level
    eps_rank: float  # eps of the requested dtype, for WW's numerical-rank tolerance

    def err(self, x, *, stored: bool = False):
        """Absolute error bound of a computed eigenvalue ``x`` (float or tensor) from the solver;
        ``stored``: also from the rounding of the stored weights (spectral norm <= eps_w * s_max),
        which is part of the matrix and no solver removes."""
        root = math.sqrt(max(x, 0.0)) if isinstance(x, float) else x.clamp_min(0).sqrt()
        out = (self.a + 0 * root) if self.route == "gram64" else 2 * self.a * root + self.a**2
        if stored:
            dw = self.eps_w * math.sqrt(float(self.evals[-1]))
            out = out + 2 * dw * root + dw**2
        return out

    def flat(self, x: Tensor) -> bool:
        """All of ``x`` (ascending) equal up to rounding: a relative spread within
        ``4 (sqrt(maxdim) eps + eps_w)`` (measured on rounded orthogonal matrices: about
        ``1.6 sqrt(maxdim) eps`` from a float32 SVD, ``1.2 eps_w`` from storing the weights)."""
        eps = _EPS32 if self.route == "svd32" else _EPS64
        return float(x[-1] - x[0]) <= 4 * (math.sqrt(self.maxdim) * eps + self.eps_w) * float(x[-1])

    def rank_floor(self) -> float:
        """Eigenvalues at or below this count as zero for the numerical rank: WW's tolerance
        ``s <= maxdim * eps * s_max`` with the eps of the requested dtype, whatever the route."""
        return (self.maxdim * self.eps_rank) ** 2 * float(self.evals[-1])


def _slices(weight: Tensor, kind: str) -> tuple[Tensor, float]:
    """The weight as a stack of matrices ``(B, m, n)`` with ``m >= n``, and the eigenvalue factor."""
    w = weight.detach()
    if kind == "conv2d":
        if w.ndim != 4:
            raise ValueError(f"a conv2d weight has 4 dimensions, got shape {tuple(w.shape)}")
        mats, scale = w.permute(2, 3, 0, 1).reshape(-1, w.shape[0], w.shape[1]), CONV_SCALE
    elif kind == "conv1d":
        if w.ndim != 3:
            raise ValueError(f"a conv1d weight has 3 dimensions, got shape {tuple(w.shape)}")
        mats, scale = w.permute(2, 0, 1), CONV_SCALE
    elif kind in ("linear", "embedding", "hf_conv1d"):
        if w.ndim != 2:
            raise ValueError(f"a {kind} weight has 2 dimensions, got shape {tuple(w.shape)}")
        mats, scale = w.unsqueeze(0), 1.0
    else:
        raise ValueError(f"unknown layer kind {kind!r}; spectral analysis takes {_KINDS}")
    if mats.shape[1] < mats.shape[2]:  # singular values do not care; groups get larger
        mats = mats.mT
    return mats, scale


def _slice_shape(shape: Sequence[int], kind: str) -> tuple[int, int, int]:
    """``(B, m, n)`` of :func:`_slices` from the weight's shape alone."""
    s = tuple(shape)
    b, m, n = (s[2] * s[3], s[0], s[1]) if kind == "conv2d" else (s[2], s[0], s[1]) if kind == "conv1d" else (1, *s)
    return b, max(m, n), min(m, n)


def _num_evals(shape: Sequence[int], kind: str) -> int:
    b, _, n = _slice_shape(shape, kind)
    return b * n


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 (fast) or torch.float64 (WeightWatcher's route), got {dtype}")


def _route(dtype: torch.dtype, m: int, n: int, device: torch.device) -> str:
    """The first route tried (float32 analyses: the Gram route, but for near-square slices of
    128..768 columns on one CPU thread, where a float32 SVD measured as fast or up to 10% faster)."""
    if dtype == torch.float64:
        return "svd64"
    if device.type == "cpu" and m < _GRAM_ASPECT * n and 128 <= n <= 768 and torch.get_num_threads() == 1:
        return "svd32"
    return "gram64"


def _times_pow2(t: Tensor, k: int) -> Tensor:
    """``t * 2**k`` in place, exact: steps small enough for each factor to be a normal float."""
    lim = 1000 if t.dtype == torch.float64 else 100
    while k:
        step = max(-lim, min(lim, k))
        t.mul_(2.0**step)
        k -= step
    return t


def _scaled(mats: Tensor, e: int, dtype: torch.dtype) -> Tensor:
    """``mats * 2**-e`` in ``dtype`` (for ``e = 0`` possibly the weights themselves: read only)."""
    return mats.to(dtype) if e == 0 else _times_pow2(mats.to(dtype, copy=True), -e)


def _exponent(mats: Tensor) -> int | None:
    """``e`` with ``max|w| = f * 2**e``, ``0.5 <= f < 1`` (0 for all-zero), None if not finite."""
    lo, hi = torch.aminmax(mats)  # no copy: abs() would double the memory of a big matrix
    amax = max(-float(lo), float(hi))
    if not math.isfinite(amax):
        return None
    return math.frexp(amax)[1]


def _solve(items: list[tuple[Tensor, int]], route: str) -> list[Tensor]:
    """Eigenvalues of ``W^T W`` of each item's scaled slices ``(mats * 2**-e)``: float64 ``(B_i, n)``."""
    sizes = [m.shape[0] for m, _ in items]
    if route == "gram64" and len(items) == 1:  # a big matrix comes alone: form its Gram in row blocks
        mats, e = items[0]
        B, m, n = mats.shape
        rows = max(1, _GRAM_BLOCK // (B * n))
        G = None
        for a in range(0, m, rows):
            blk = _scaled(mats[:, a : a + rows], e, torch.float64)
            g = blk.mT @ blk
            G = g if G is None else G.add_(g)
        return [torch.linalg.eigvalsh(G)]
    if route == "gram64":
        stack = torch.cat([_scaled(m, e, torch.float64) for m, e in items])
        ev = torch.linalg.eigvalsh(stack.mT @ stack)
    else:
        dt = torch.float32 if route == "svd32" else torch.float64
        stack = torch.cat([_scaled(m, e, dt) for m, e in items]) if len(items) > 1 else _scaled(*items[0], dt)
        ev = torch.linalg.svdvals(stack).to(torch.float64).square_()
    return list(ev.split(sizes))


def _finish(name: str, ev: Tensor, e: int, scale: float, route: str, m: int, wdtype: torch.dtype,
            eps_rank: float) -> _Esd:
    """Back to the true scale (float64), pooled, sorted; raises ValueError if not representable.
    ``ev``: ``(B, n)``, one row per slice."""
    ev = _times_pow2(ev.clamp_min(0), 2 * e)  # eigvalsh may give -1e-17 for a zero
    if scale != 1.0:
        ev.mul_(scale)
    slice_sum = float(ev.sum(1).max()) if route == "gram64" else 0.0
    ev = ev.flatten().sort().values
    top = float(ev[-1])
    if not math.isfinite(top) or not bool(torch.isfinite(ev[0])):
        raise ValueError(
            f"layer {name!r}: its eigenvalues are not finite in float64 (largest |weight| about 2**{e}); "
            "they cannot be represented, so the layer has no spectrum: rescale its weights or leave it out"
        )
    if top == 0 and e != 0:
        raise ValueError(
            f"layer {name!r}: its eigenvalues underflow float64 (largest |weight| about 2**{e}); "
            "rescale its weights or leave it out"
        )
    eps = _EPS32 if route == "svd32" else _EPS64
    a = 4 * eps * slice_sum if route == "gram64" else eps * math.sqrt(top)
    eps_w = float(torch.finfo(wdtype).eps) if wdtype.is_floating_point else 0.0
    return _Esd(ev, route, m, a, eps_w, eps_rank)


def _gram_ok(r: _Esd, thr: float | None) -> bool:
    """The Gram result is at least as accurate as a float32 SVD on every eigenvalue the fit uses
    (above the zero filter, and above the float32 SVD's own noise floor ``d32**2``)."""
    d32 = _EPS32 * math.sqrt(float(r.evals[-1]))
    used = r.evals[r.evals > max(thr or 0.0, d32**2)]
    if used.numel() == 0:
        return True
    lo = float(used[0])
    return r.a <= 2 * math.sqrt(lo) * d32 + d32**2


def _undecided(r: _Esd, thr: float) -> bool:
    """Some eigenvalue is within its error bound of the zero filter's threshold."""
    return bool(((r.evals - thr).abs() <= r.err(r.evals)).any())


class _Entry:
    """A matrix to analyse: name, kind, shape, and how to get the weight (stored ones load late)."""

    __slots__ = ("name", "kind", "shape", "get")

    def __init__(self, name: str, kind: str, shape: tuple[int, ...], get):
        self.name, self.kind, self.shape, self.get = name, kind, tuple(shape), get


def _layer_entries(layers: Sequence[Layer]) -> list[_Entry]:
    out = []
    for layer in layers:
        if layer.kind not in _KINDS:
            raise ValueError(f"layer {layer.name!r} is a {layer.kind!r}, not a weight matrix {_KINDS}")
        out.append(_Entry(layer.name, layer.kind, tuple(layer.weight.shape), lambda lay=layer: lay.weight))
    return out


def _shuffled(mats: Tensor, name: str, seed: int) -> Tensor:
    """Each slice's entries shuffled (WW's randomized ESD), seeded per layer name."""
    g = torch.Generator(device=mats.device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    flat = mats.reshape(mats.shape[0], -1)
    perm = torch.rand(flat.shape, generator=g, device=mats.device).argsort(dim=1)
    return flat.gather(1, perm).reshape(mats.shape)


def _esds_of(
    entries: Sequence[_Entry],
    dtype: torch.dtype,
    *,
    thr: float | None = None,
    device: torch.device | str | None = None,
    shuffle_seed: int | None = None,
    bar=None,
) -> list[_Esd]:
    """ESDs of many matrices, batched: one solver call per (device, slice shape, route) group
    (on CPU only for small matrices: LAPACK loops over a batch anyway, so stacking big ones only
    copies). ``thr``: the zero filter the fit will apply (guards the routes, see above).

    With ``shuffle_seed`` each matrix's entries are shuffled first (WW's randomized ESD).
    """
    _check_dtype(dtype)
    prepared: list[tuple[Tensor, float]] = []
    for entry in entries:
        mats, scale = _slices(entry.get(), entry.kind)
        if device is not None:
            mats = mats.to(device)
        if shuffle_seed is not None:
            mats = _shuffled(mats, entry.name, shuffle_seed)
        prepared.append((mats, scale))
    batch = _EsdBatch(entries, prepared, dtype)
    with torch.no_grad():
        batch.run_groups(bar)
        if not batch.bad:
            batch.guard(thr)
    if batch.bad:
        names = [entries[k].name for k in sorted(batch.bad)]
        raise ValueError(
            f"layer(s) {names} have NaN or Inf weights, so they have no spectrum; fix the training "
            "instability (lower LR, gradient clipping) or leave these layers out of the analysis"
        )
    return batch.out  # type: ignore[return-value]


class _EsdBatch:
    """The solver calls of :func:`_esds_of`: ``prepared[k]`` (slices, scale) of ``entries[k]`` go
    to ``out[k]``; ``bad`` collects the matrices with NaN or Inf weights (nothing more is solved
    once one is found)."""

    def __init__(self, entries: Sequence[_Entry], prepared: list[tuple[Tensor, float]], dtype: torch.dtype):
        self.entries, self.prepared, self.dtype = entries, prepared, dtype
        self.eps_rank = float(torch.finfo(dtype).eps)
        self.exps: dict[int, int | None] = {}
        self.bad: set[int] = set()
        self.out: list[_Esd | None] = [None] * len(entries)

    def exponent(self, k: int, route: str) -> int:
        """The rescaling exponent: 0 unless max|w| is outside 2**+-60 (nothing to protect)."""
        mats = self.prepared[k][0]
        if mats.dtype != torch.float64 and (route == "gram64" or (route in ("svd32", "svd64") and mats.device.type == "cpu")):
            # a float32/16 weight cannot leave float64's range when squared, and LAPACK's gesdd
            # rescales extreme inputs itself; NaN/Inf weights show in the result
            return 0
        if k not in self.exps:
            self.exps[k] = _exponent(mats)
        e = self.exps[k]
        if e is None:
            self.bad.add(k)
            return 0
        return e if abs(e) > _SAFE_EXP else 0

    def run(self, ks: list[int], route: str) -> None:
        es = [self.exponent(k, route) for k in ks]
        if self.bad:
            return
        try:
            evs = _solve([(self.prepared[k][0], e) for k, e in zip(ks, es)], route)
        except RuntimeError:  # LAPACK refuses non-finite input
            for k in ks:
                self.exponent(k, "check")
            if self.bad:
                return
            raise
        for k, e, ev in zip(ks, es, evs):
            mats, scale = self.prepared[k]
            if not bool(torch.isfinite(ev).all()):
                self.exponent(k, "check")  # look at the weights: NaN/Inf ones are reported below
                if k in self.bad:
                    continue
            self.out[k] = _finish(self.entries[k].name, ev, e, scale, route, mats.shape[1], mats.dtype, self.eps_rank)

    def run_groups(self, bar) -> None:
        """One solver call per (device, slice shape, route) group, split by the memory cap."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        for k, (mats, _) in enumerate(self.prepared):
            _, m, n = mats.shape
            groups[(mats.device, m, n, _route(self.dtype, m, n, mats.device))].append(k)
        for (dev, m, n, route), members in groups.items():
            per = max(1, _MAX_STACK // (m * n))  # slices per solver call (memory cap)
            if dev.type == "cpu" and m * n > _CPU_STACK:
                per = 1
            chunk: list[int] = []
            count = 0
            for k in members:
                b = self.prepared[k][0].shape[0]
                if chunk and count + b > per:
                    self.run(chunk, route)
                    chunk, count = [], 0
                chunk.append(k)
                count += b
            if chunk:
                self.run(chunk, route)
            if bar is not None:
                bar.update(len(members))

    def guard(self, thr: float | None) -> None:
        """Accuracy guards (rare: ill-conditioned or near-threshold layers)."""
        for k, r in enumerate(self.out):
            if r.route == "gram64" and not _gram_ok(r, thr):
                self.run([k], "svd32")
                r = self.out[k]
            if thr is not None and r.route != "svd64" and _undecided(r, thr):
                self.run([k], "svd64")


def layer_esd(weight: Tensor, kind: str, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """Eigenvalues of ``W^T W`` of one weight, ascending, float64 (conv: pooled slices x 0.5).

    ``dtype`` is the precision of the computation (see :func:`analyze`); the result is float64
    whatever it is, because float32 cannot hold the square of a weight above 1.8e19.
    """
    return _esds_of([_Entry("weight", kind, tuple(weight.shape), lambda: weight)], dtype)[0].evals


def compute_esds(layers: Sequence[Layer], *, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """ESDs of many layers, batched: matrices of the same shape (and device) share one solver call.

    Returns one ascending float64 eigenvalue tensor per layer (true scale, whatever ``dtype``,
    the computation's precision: float32 cannot hold 1e50), on the layer's device. Raises
    ValueError naming the layers whose weights hold NaN or Inf, or whose eigenvalues are not
    representable.
    """
    return [r.evals for r in _esds_of(_layer_entries(list(layers)), dtype)]


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


def _check_fit(fit: str) -> None:
    if fit not in FITS:
        raise unknown("fit", fit, FITS)


def fit_power_law(
    evals: Tensor | Sequence[Tensor],
    fit: str = "median",
    *,
    xmin_pos: float | None = None,
    small_n: int = SMALL_N,
) -> dict:
    """MLE power-law fit of one ESD or a list of ESDs (see the module docstring for the rules).

    ``xmin_pos`` is TempBalance's divisor for ``median`` (``i = N // xmin_pos``, default 2).
    ``small_n``: the ``ks`` fit uses WW's small-sample rule below this many eigenvalues (0: never).
    The values are fitted as given (no zero filtering: :func:`analyze` filters). Returns
    ``alpha, xmin, xmax, D, sigma, num_pl_spikes, xmin_index``: floats for one tensor, numpy
    arrays (one entry per ESD) for a list. ValueError for an unknown fit, or an ESD with fewer
    than 3 values or a non-positive xmin (the message says which one).
    """
    _check_fit(fit)
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


# --------------------------------------------------------------------------- entry points


def _resolve_layers(model_or_layers, layer_types: Iterable[str] | None) -> list[Layer]:
    if isinstance(model_or_layers, nn.Module):
        layers = matrix_layers(model_or_layers)
        what = type(model_or_layers).__name__
    elif isinstance(model_or_layers, Layer):
        layers, what = [model_or_layers], "the given layer"
    else:
        layers, what = list(model_or_layers), "the given layers"
        bad = [layer.name for layer in layers if getattr(layer, "kind", None) not in _KINDS]
        if bad:
            raise ValueError(f"layers {bad} are not weight matrices; spectral analysis takes kinds {_KINDS}")
    return _keep_kinds(layers, layer_types, what)


def _keep_kinds(items: list, layer_types: Iterable[str] | None, what: str) -> list:
    if layer_types is not None:
        kinds = {layer_types} if isinstance(layer_types, str) else set(layer_types)
        unknown = kinds - set(_KINDS)
        if unknown:
            raise ValueError(f"unknown layer_types {sorted(unknown)}; valid: {_KINDS}")
        items = [it for it in items if it.kind in kinds]
    if not items:
        raise ValueError(
            f"{what} has no layer for spectral analysis: it needs nn.Linear, nn.Conv1d, nn.Conv2d, "
            "nn.Embedding or Hugging Face Conv1D modules (stored: 2-4 dimensional float tensors named *.weight)"
            + ("" if layer_types is None else f" of kinds {sorted(set(layer_types))}")
        )
    return items


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


def _check_device(device) -> torch.device | None:
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} but no CUDA GPU is available; use device='cpu'")
    return dev


def _progress(enabled: bool | None, total: int):
    # True (an API caller asked): drawn wherever stderr goes; None (the command line): only on a
    # terminal (lalr_lightning.progress), so no bar in CI logs or redirected output; False: none
    if enabled is False:
        return None
    return progress.bar(total=total, desc="spectral analysis", unit="matrix", always=enabled is True)


def _entries(source, layer_types, device) -> list[_Entry]:
    if not is_checkpoint_path(source):
        return _layer_entries(_resolve_layers(source, layer_types))
    stored = stored_matrices(source)
    entries = [_Entry(m.name, m.kind, m.shape, functools.partial(load_matrix, m, device or "cpu")) for m in stored]
    return _keep_kinds(entries, layer_types, str(source))


def _analyze(
    source,
    *,
    fit: str = "ks",
    metrics=None,
    min_evals: int = 10,
    max_evals: int | None = None,
    dtype: torch.dtype = torch.float32,
    filter_zeros: bool = True,
    layer_types=None,
    rand_seed: int = 0,
    xmin_pos: float | None = None,
    device=None,
    progress: bool = False,
) -> tuple[pd.DataFrame, dict[str, Tensor]]:
    _check_fit(fit)
    _check_dtype(dtype)
    wanted = _check_metrics(metrics)
    device = _check_device(device)
    streamed = is_checkpoint_path(source)
    entries = _within_counts(_entries(source, layer_types, device), min_evals, max_evals)
    cols = ["name", "kind", "shape", *wanted, "warning"]
    if not entries:
        return pd.DataFrame(columns=cols), {}
    wset = set(wanted)
    fitting = bool(wset & _NEEDS_FIT)
    thr = EVALS_THRESH if filter_zeros and fitting else None
    bar = _progress(progress, len(entries))
    try:
        if streamed:  # one stored matrix in memory at a time
            esds, rand = _streamed_esds(entries, dtype, thr, device, "rand_distance" in wset, rand_seed, bar)
        else:
            esds = _esds_of(entries, dtype, thr=thr, device=device, bar=bar)
            rand = _esds_of(entries, dtype, device=device, shuffle_seed=rand_seed) if "rand_distance" in wset else []
    finally:
        if bar is not None:
            bar.close()
    fits = _fit_esds(esds, fit, xmin_pos, filter_zeros) if fitting else [None] * len(entries)
    rows = _metric_table_rows(entries, esds, fits, wset)
    for k, r in enumerate(rand):
        x = esds[k].evals
        rows[k]["rand_distance"] = _js_distance(x, r.evals) if float(x[-1]) > 0 else math.nan
    for e, row in zip(entries, rows):
        row.update(name=e.name, kind=e.kind, shape=e.shape)
    table = pd.DataFrame([{c: row[c] for c in cols} for row in rows], columns=cols)
    degenerate = [f"{e.name} ({f})" for e, f in zip(entries, fits) if isinstance(f, str)]
    if degenerate:
        warnings.warn(
            "no power-law fit (NaN alpha and fit columns) for: " + "; ".join(degenerate)
            + ". The table's 'warning' column says why for each layer.",
            stacklevel=3,
        )
    return table, {e.name: r.evals for e, r in zip(entries, esds)}


def _within_counts(entries: list[_Entry], min_evals: int, max_evals: int | None) -> list[_Entry]:
    """The entries with ``min_evals`` to ``max_evals`` eigenvalues; a warning names the others
    (at the caller of :func:`analyze`: ``stacklevel`` counts this frame and ``_analyze``'s)."""
    counts = [_num_evals(e.shape, e.kind) for e in entries]
    few = [e.name for e, c in zip(entries, counts) if c < min_evals]
    many = [e.name for e, c in zip(entries, counts) if max_evals is not None and c > max_evals]
    if few:
        warnings.warn(f"spectral analysis skips {len(few)} layer(s) with fewer than min_evals={min_evals} eigenvalues: {few}", stacklevel=4)
    if many:
        warnings.warn(f"spectral analysis skips {len(many)} layer(s) with more than max_evals={max_evals} eigenvalues: {many}", stacklevel=4)
    skip = set(few) | set(many)
    return [e for e in entries if e.name not in skip]


def _streamed_esds(entries: list[_Entry], dtype: torch.dtype, thr: float | None, device, shuffled: bool,
                   rand_seed: int, bar) -> tuple[list[_Esd], list[_Esd]]:
    """The ESDs (and, when ``shuffled``, those of the shuffled weights) of stored matrices,
    loading one matrix at a time."""
    esds, rand = [], []
    for entry in entries:
        w = entry.get()
        one = [_Entry(entry.name, entry.kind, entry.shape, lambda w=w: w)]
        esds += _esds_of(one, dtype, thr=thr, device=device)
        if shuffled:
            rand += _esds_of(one, dtype, device=device, shuffle_seed=rand_seed)
        del w, one
        if bar is not None:
            bar.update(1)
    return esds, rand


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


def analyze(
    model_or_path,
    *,
    fit: str = "ks",
    metrics: Sequence[str] | str | None = None,
    min_evals: int = 10,
    max_evals: int | None = None,
    dtype: torch.dtype = torch.float32,
    filter_zeros: bool = True,
    layer_types: Iterable[str] | None = None,
    rand_seed: int = 0,
    xmin_pos: float | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Per-layer HT-SR metrics as one tidy table (WeightWatcher ``analyze()`` column names).

    ``model_or_path``: an ``nn.Module`` (its :func:`matrix_layers`), a list of matrix
    :class:`Layer`, or a checkpoint path: a ``.safetensors`` file or a Hugging Face model
    directory (single or sharded safetensors). A path is streamed: one stored tensor is loaded,
    measured and dropped at a time, the model is never built, and memory stays bounded by the
    largest matrix; names are the checkpoint's parameter names without ``.weight``, and which
    tensors count as matrices (and as embeddings) is described in :mod:`.checkpoints`.

    Columns: ``name, kind, shape``, the requested ``metrics`` (``None``: :data:`DEFAULT_METRICS`,
    all but ``rand_distance``; ``"all"``: everything), then ``warning``. Every value is in the
    range given here or NaN (``snr`` may be inf, see below), and ``warning`` says why for each
    NaN or inf in the row ("" when there is none); it also flags alpha outside [2, 6] as
    WeightWatcher's ``warning`` column does ("over-trained" below 2, "under-trained" above 6):

    * ``alpha`` (> 1), ``xmin`` and ``xmax`` (> 0), ``D`` ([0, 1]), ``sigma`` (>= 0),
      ``num_pl_spikes`` (>= 1): the power-law fit ``fit`` (:data:`FITS`); with ``filter_zeros``
      only eigenvalues > 1e-5 are fitted (WW); every other column uses all. NaN when fewer than 3
      eigenvalues are left, for all-zero weights, and for a flat spectrum (all fitted eigenvalues
      equal up to rounding, e.g. an orthogonal matrix: alpha is unbounded);
    * ``num_evals``; ``spectral_norm`` (lambda_max >= 0) and ``log_spectral_norm`` (log10);
      ``norm`` (squared Frobenius = sum of eigenvalues) and ``log_norm``; ``stable_rank``
      (norm / spectral_norm, in [1, rank]); the logs and ratios are NaN for all-zero weights;
    * ``entropy`` in [0, 1] (WW: ``-sum p ln p / ln rank``, ``p = l/sum l + 1e-10``, rank by the
      ``max(s) * max_dim * eps(dtype)`` tolerance; NaN below rank 2, where ``ln rank`` is 0);
      ``alpha_weighted`` (``alpha * log10 lambda_max``); ``log_alpha_norm`` (``log10 sum
      l^alpha``, computed in log space so it does not overflow where WW gives inf);
    * ``rand_distance`` in [0, 1]: WW's Jensen-Shannon distance between the sorted eigenvalue
      vector and that of an element-shuffled copy of each matrix (seeded by ``rand_seed`` and the
      layer name). Costs a second eigen-solve, hence not in the default set;
    * ``snr`` >= 0: Spectrum's ``sum(s > thr) / sum(s <= thr) / s_max`` (sums of singular values)
      with ``thr = IQR(s)/1.349 * (1 + sqrt(beta))``, ``beta`` the slice's aspect ratio; as in
      Spectrum's ``spectrum.py``, an empty noise set (every singular value above ``thr``, as in
      an orthogonal matrix) counts as a noise sum of 1, and a noise set of exact zeros gives inf.
      Conv layers use the pooled, 0.5-scaled singular values.

    Layers with fewer than ``min_evals`` (or more than ``max_evals``) eigenvalues are skipped with a
    warning naming them (WW's defaults are 8 and 15000). ``dtype`` is the precision: float64 runs
    a float64 SVD (WW's route: alpha equal to WW's to ~1e-12); float32 (default) takes, per
    matrix shape, the cheaper of a float32 SVD and an eigen-solve of the smaller Gram matrix
    formed in float64, and falls back to an SVD where the Gram's squaring would cost accuracy on
    the eigenvalues the fit uses, or where an eigenvalue is too close to the 1e-5 filter to
    decide (module comment "ESDs"). Either way each matrix is rescaled by a power of two before
    the solve and the eigenvalues are returned to the true scale in float64, so weights of any
    finite size work; eigenvalues that float64 cannot hold raise a ValueError naming the layer.
    ``layer_types`` keeps only these kinds (``linear, conv1d, conv2d, embedding, hf_conv1d``).
    ``device``: where the eigenvalues are computed (default: each weight's own device; ``"cpu"``
    for a path; ``"cuda"`` for a GPU). ``progress``: a tqdm bar on stderr. Raises ValueError for
    an unknown fit or metric, NaN/Inf weights, a model or checkpoint without eligible layers, or
    a path that is not a safetensors checkpoint (FileNotFoundError if it does not exist).
    """
    return _analyze(
        model_or_path,
        fit=fit,
        metrics=metrics,
        min_evals=min_evals,
        max_evals=max_evals,
        dtype=dtype,
        filter_zeros=filter_zeros,
        layer_types=layer_types,
        rand_seed=rand_seed,
        xmin_pos=xmin_pos,
        device=device,
        progress=progress,
    )[0]


def alphas(
    layers,
    *,
    fit: str = "median",
    filter_zeros: bool = False,
    dtype: torch.dtype = torch.float32,
    xmin_pos: float | None = None,
) -> dict[str, float]:
    """Alpha per layer name: the callbacks' fast path (TempBalance defaults: median fit, no filter).

    Accepts an ``nn.Module`` or a list of matrix layers. Layers that cannot be fitted get NaN and
    one warning naming them and the reason (as :func:`analyze`'s ``warning`` column).
    """
    _check_fit(fit)
    _check_dtype(dtype)
    layers = _resolve_layers(layers, None)
    esds = _esds_of(_layer_entries(layers), dtype, thr=EVALS_THRESH if filter_zeros else None)
    out: dict[str, float] = {}
    bad = []
    for layer, r in zip(layers, _fit_esds(esds, fit, xmin_pos, filter_zeros)):
        if isinstance(r, str):
            out[layer.name] = math.nan
            bad.append(f"{layer.name} ({r})")
        else:
            out[layer.name] = r["alpha"]
    if bad:
        warnings.warn("alpha is NaN (no power-law fit) for: " + "; ".join(bad), stacklevel=2)
    return out
