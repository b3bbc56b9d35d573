"""ESDs for HT-SR analysis: each weight matrix's eigenvalues of ``W^T W``, batched, on the weights' device.

The rules (conv slices, scaling, routes and their error model) are in :mod:`.htsr`'s docstring and
the comment below; the fits of these ESDs are :mod:`.powerlaw`'s, the table :mod:`.htsr`'s.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lalr_lightning.core.model.layers import Layer, matrix_layers

__all__ = ["EVALS_THRESH", "CONV_SCALE", "layer_esd", "compute_esds"]

EVALS_THRESH = 1e-5  # WW keeps eigenvalues > 1e-5 for the fit (CPU; 1e-4 on its CUDA path)
CONV_SCALE = 0.5  # eigenvalue factor of conv slices (W * sqrt(0.5))
_KINDS = ("linear", "conv1d", "conv2d", "embedding", "hf_conv1d")
_MAX_STACK = 1 << 25  # elements per batched solver call (256 MB in float64)
_CPU_STACK = 1 << 14  # on CPU only matrices up to this size are stacked (call overhead matters)


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


# --------------------------------------------------------------------------- which layers


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
