"""Activation-aware pruning criteria for language models: Wanda and SparseGPT (pure PyTorch).

The three criteria prune one linear layer ``y = x W^T`` (``weight`` of shape ``(out, in)``; a
GPT-2 ``Conv1D`` stores ``(in, out)``: pass its transpose) to a ratio, unstructured or N:M:

* ``magnitude``: ``|W|``, compared over the whole matrix (as ``core.pruning.alphapruning.magnitude_mask`` and
  AlphaPruning's ``prune_magnitude``); with N:M, within each group of ``m`` inputs of a row.
* ``wanda`` (Sun et al. 2023): score ``|W_ij| * ||X_j||_2``, the weight times the norm of its input
  feature over the calibration tokens; compared within each output row (prune the
  ``int(ratio * in)`` lowest of every row), or within each group of ``m`` inputs of a row (N:M).
* ``sparsegpt`` (Frantar & Alistarh 2023): one-shot OBS reconstruction. With ``H = 2 X^T X / n``
  damped by ``percdamp * mean(diag H)`` and ``U`` the upper Cholesky factor of ``H^-1``
  (``H^-1 = U^T U``), the columns are visited left to right; column ``i``'s pruned entries are
  set to 0 and the error ``e = (w_i - q_i) / U_ii`` is spread over the columns not yet visited,
  ``W[:, j] -= e U_ij`` (``j > i``) -- row ``i`` of ``U`` is the OBS update
  ``[H_F^-1]_{i,F} / sqrt([H_F^-1]_ii)`` for the set ``F`` of columns still free. The mask is
  chosen per block of ``blocksize`` columns from the *updated* weights, by ``w^2 / U_ii^2``
  (adaptive mask selection), over the whole block for unstructured sparsity and per ``m``
  columns of a row for N:M.

API (what ``callbacks/pruning.py`` and ``core/pruning/calibration.py`` use):

* :class:`InputStats` ``(columns, *, hessian=True, dtype=torch.float32, device=None)``: the
  calibration inputs of one layer. ``add(x)`` takes ``x`` of shape ``(..., in)``; a 3-D (or more)
  ``x`` counts ``x.shape[0]`` samples (sequences), a 1-D or 2-D one counts one sample, as
  AlphaPruning's ``WrappedGPT`` / ``SparseGPT.add_batch`` count them; ``samples=`` overrides the
  count. ``nsamples``; ``scaler_row`` ``(in,)``: the sum of ``x_j^2`` over every token divided by
  ``nsamples`` (WrappedGPT's ``scaler_row``); ``hessian()`` ``(in, in)``:
  ``2 / nsamples * X^T X`` (SparseGPT's ``H``), only when built with ``hessian=True``.
* :func:`wanda_scores` ``(weight, scaler_row)`` -> ``|W| * sqrt(scaler_row)`` (float32).
* :func:`keep_mask` ``(scores, ratio, *, n=0, m=0)`` -> bool keep-mask (True = kept), per-row
  (unstructured) or per ``m`` consecutive inputs of each row (N:M; ``ratio`` is then unused).
* :func:`sparsegpt_prune` ``(weight, hessian, ratio, *, n=0, m=0, blocksize=128,
  percdamp=0.01)`` -> ``(new_weight, keep)``.
* :func:`prune_weight` ``(weight, criterion, ratio, stats=None, *, n=0, m=0, blocksize=128,
  percdamp=0.01)`` -> ``(new_weight, keep)``: dispatch over :data:`CRITERIA`.

Every function returns new tensors (the inputs are not modified); ``new_weight`` has the dtype
and device of ``weight``. Differences from the reference code: ``docs/llm_pruning.md``.
"""

from __future__ import annotations

import math

import torch

from lalr_lightning.choices import unknown
from lalr_lightning.core.pruning.alphapruning import magnitude_mask

__all__ = [
    "CRITERIA",
    "InputStats",
    "wanda_scores",
    "keep_mask",
    "sparsegpt_prune",
    "prune_weight",
    "check_nm",
    "needs_stats",
]

CRITERIA = ("magnitude", "wanda", "sparsegpt")


def check_nm(n: int, m: int) -> tuple[int, int]:
    """``(n, m)`` validated: both 0 (unstructured), or ``0 < n < m``."""
    n, m = int(n), int(m)
    if (n, m) == (0, 0):
        return n, m
    if not 0 < n < m:
        raise ValueError(
            f"N:M sparsity needs 0 < n < m (n of every m consecutive weights pruned, e.g. n=2, m=4), "
            f"got n={n}, m={m}; n=m=0 is unstructured"
        )
    return n, m


def needs_stats(criterion: str) -> bool:
    """Whether ``criterion`` needs calibration inputs (:class:`InputStats`)."""
    _check_criterion(criterion)
    return criterion != "magnitude"


def _check_criterion(criterion: str) -> None:
    if criterion not in CRITERIA:
        raise unknown("criterion", criterion, CRITERIA)


def _check_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"pruning ratio must be in [0, 1], got {ratio}")
    return ratio


# ---------------------------------------------------------------------------- calibration inputs


class InputStats:
    """Running statistics of one linear layer's calibration inputs (see the module docstring).

    The sums are kept unnormalized (``sum x_j^2`` and ``X^T X``) and divided by ``nsamples`` when
    read: the same numbers as the reference's running averages, without their rescaling at
    every batch.
    """

    def __init__(self, columns: int, *, hessian: bool = True, dtype: torch.dtype = torch.float32, device=None,
                 name: str | None = None):
        if int(columns) < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.columns = int(columns)
        self.dtype = dtype
        self.name = name  # the layer, for messages
        self.nsamples = 0
        self.ntokens = 0
        self._sq = torch.zeros(self.columns, dtype=dtype, device=device)
        self._xtx = torch.zeros(self.columns, self.columns, dtype=dtype, device=device) if hessian else None

    @property
    def tracks_hessian(self) -> bool:
        return self._xtx is not None

    def add(self, x: torch.Tensor, samples: int | None = None) -> None:
        """Accumulate inputs ``x`` of shape ``(..., columns)``."""
        if x.shape[-1] != self.columns:
            raise ValueError(f"inputs have {x.shape[-1]} features, the layer takes {self.columns}")
        n = (x.shape[0] if x.ndim >= 3 else 1) if samples is None else int(samples)
        x = x.detach()
        flat = x.reshape(-1, self.columns).to(self._sq.device, self.dtype)
        # Memory: the float32 copy of a (tokens, in) batch is the largest tensor here; square it in
        # place when it is ours (a cast or a reshape copied it) instead of allocating another. The
        # values and the order of every sum are the same either way.
        own = flat.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        if self._xtx is not None:
            self._xtx.addmm_(flat.T, flat)
        part = (flat.square_() if own else flat.square()).sum(0)
        del flat
        # a NaN or Inf input makes its column's sum of squares NaN or Inf: one check on (in,)
        # numbers instead of a pass over every input
        if not bool(torch.isfinite(part).all()):
            raise ValueError(f"the calibration inputs of {self.name or 'a layer'} hold NaN or Inf (or overflow "
                             f"{self.dtype} when squared): a weight before it is not finite, or the forward "
                             "overflows in the compute dtype")
        self._sq += part
        self.nsamples += n
        self.ntokens += x.numel() // self.columns

    def _check(self) -> None:
        if self.nsamples == 0:
            raise ValueError("no calibration inputs were recorded for this layer (it did not run on the calibration data)")

    @property
    def scaler_row(self) -> torch.Tensor:
        """``sum over tokens of x_j^2 / nsamples``, shape ``(columns,)``."""
        self._check()
        return self._sq / self.nsamples

    def hessian(self) -> torch.Tensor:
        """``2 / nsamples * X^T X``, shape ``(columns, columns)`` (a new tensor)."""
        if self._xtx is None:
            raise ValueError("this InputStats was built with hessian=False; SparseGPT needs hessian=True")
        self._check()
        return self._xtx * (2.0 / self.nsamples)


# ---------------------------------------------------------------------------- Wanda


def wanda_scores(weight: torch.Tensor, scaler_row: torch.Tensor) -> torch.Tensor:
    """Wanda's score ``|W_ij| * sqrt(scaler_row_j)`` (float32, the shape of ``weight``)."""
    if weight.ndim != 2:
        raise ValueError(f"weight must be a matrix (out, in), got shape {tuple(weight.shape)}")
    if scaler_row.shape != (weight.shape[1],):
        raise ValueError(f"scaler_row has shape {tuple(scaler_row.shape)}, the weight takes {weight.shape[1]} inputs")
    s = scaler_row.to(weight.device, torch.float32).clamp_min(0).sqrt()
    return weight.detach().abs().to(torch.float32) * s.unsqueeze(0)


def keep_mask(scores: torch.Tensor, ratio: float, *, n: int = 0, m: int = 0) -> torch.Tensor:
    """Keep-mask (True = kept) from per-weight ``scores`` (lowest pruned), ties by position.

    Unstructured (``n = m = 0``): in every row the ``int(ratio * columns)`` lowest are pruned
    (Wanda's per-output comparison group). N:M: in every group of ``m`` consecutive columns of
    each row the ``n`` lowest are pruned (``ratio`` is not used); ``columns`` must be a multiple
    of ``m``.
    """
    n, m = check_nm(n, m)
    if scores.ndim != 2:
        raise ValueError(f"scores must be a matrix (out, in), got shape {tuple(scores.shape)}")
    if torch.isnan(scores).any():
        raise ValueError("pruning scores contain NaN (NaN weights or calibration inputs)")
    rows, cols = scores.shape
    if m:
        if cols % m:
            raise ValueError(f"N:M sparsity with m={m} needs the input dimension to be a multiple of m, got {cols}")
        groups = scores.reshape(rows, cols // m, m)
        order = torch.argsort(groups, dim=-1, stable=True)[..., :n]
        keep = torch.ones_like(groups, dtype=torch.bool)
        keep.scatter_(-1, order, False)
        return keep.reshape(rows, cols)
    k = int(_check_ratio(ratio) * cols)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if k:
        keep.scatter_(1, torch.argsort(scores, dim=1, stable=True)[:, :k], False)
    return keep


# ---------------------------------------------------------------------------- SparseGPT


def _inverse_hessian_factor(H: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor ``U`` of the damped ``H^-1``, dead-column mask). ``H`` is damped in
    place: pass a copy you own (the largest layer's ``H`` is ``in x in`` floats; no third copy)."""
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0  # a column never active: any positive diagonal keeps H invertible
    diag = torch.diagonal(H)
    diag += percdamp * diag.mean()
    try:
        L = torch.linalg.cholesky(H)
    except RuntimeError:
        raise ValueError(
            "SparseGPT: the calibration Hessian is not positive definite even after dampening "
            f"(percdamp={percdamp}); raise percdamp (e.g. 0.1) or use more calibration samples"
        ) from None
    inverse = torch.cholesky_inverse(L)
    del L
    return torch.linalg.cholesky(inverse, upper=True), dead


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    ratio: float,
    *,
    n: int = 0,
    m: int = 0,
    blocksize: int = 128,
    percdamp: float = 0.01,
    _owned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT on one layer: ``(new_weight, keep)`` (module docstring for the equations).

    Unstructured: each block of ``blocksize`` columns prunes its lowest ``w^2 / U_ii^2`` over
    all rows and the block's columns, as many as bring the running total to
    ``int(ratio * rows * columns_so_far)`` -- so the layer ends at exactly
    ``int(ratio * numel)`` pruned weights. N:M: in each row, the ``n`` lowest of every ``m``
    consecutive columns, chosen when the loop reaches the group's first column
    (``blocksize`` must be a multiple of ``m``). Columns whose inputs were always zero
    (``H_jj = 0``) are set to zero, as the reference does; the keep-mask reports the selection.
    Computed in float32 (float64 when the Hessian is float64).
    """
    n, m = check_nm(n, m)
    ratio = _check_ratio(ratio) if not m else 0.0
    if weight.ndim != 2:
        raise ValueError(f"weight must be a matrix (out, in), got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({cols}, {cols}) for this weight")
    if int(blocksize) < 1:
        raise ValueError(f"blocksize must be >= 1, got {blocksize}")
    if m and (blocksize % m or cols % m):
        raise ValueError(f"N:M sparsity with m={m} needs blocksize ({blocksize}) and the input dimension ({cols}) "
                         "to be multiples of m")
    if not 0.0 <= percdamp:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}")
    dtype = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    dev = hessian.device
    W = weight.detach().to(dev, dtype, copy=True)
    # _owned: the caller made ``hessian`` for this call alone (prune_weight), so it may be damped in place
    H = hessian.to(dtype, copy=not _owned)
    del hessian
    U, dead = _inverse_hessian_factor(H, percdamp)
    del H
    W[:, dead] = 0
    pruned = torch.zeros(rows, cols, dtype=torch.bool, device=dev)
    done = 0  # weights pruned so far (unstructured): the blocks share int(ratio * numel) exactly
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        d1 = torch.diagonal(U1)
        Err1 = torch.zeros_like(W1)
        mask1 = torch.zeros(rows, i2 - i1, dtype=torch.bool, device=dev)
        if not m:
            k = int(ratio * (rows * i2)) - done
            if k > 0:
                score = (W1.square() / d1.square().unsqueeze(0)).flatten()
                mask1.view(-1)[torch.argsort(score, stable=True)[:k]] = True
                done += k
        for i in range(i2 - i1):
            if m and i % m == 0:
                score = W1[:, i:i + m].square() / d1[i:i + m].square().unsqueeze(0)
                low = torch.argsort(score, dim=1, stable=True)[:, :n]
                mask1[:, i:i + m].scatter_(1, low, True)
            w = W1[:, i]
            q = torch.where(mask1[:, i], torch.zeros_like(w), w)
            err = (w - q) / d1[i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            W1[:, i] = q
            Err1[:, i] = err
        W[:, i1:i2] = W1
        pruned[:, i1:i2] = mask1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return W.to(weight.device, weight.dtype), ~pruned.to(weight.device)


# ---------------------------------------------------------------------------- dispatch


def prune_weight(
    weight: torch.Tensor,
    criterion: str,
    ratio: float,
    stats: InputStats | None = None,
    *,
    n: int = 0,
    m: int = 0,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune one ``(out, in)`` weight by ``criterion``: ``(new_weight, keep)``.

    ``magnitude``: unstructured over the whole matrix (``round(ratio * numel)`` smallest |w|, as
    ``core.pruning.alphapruning.magnitude_mask``), N:M per row group; ``wanda``: :func:`wanda_scores` and
    :func:`keep_mask`; ``sparsegpt``: :func:`sparsegpt_prune` on ``stats.hessian()``.
    """
    _check_criterion(criterion)
    n, m = check_nm(n, m)
    if not m:
        _check_ratio(ratio)
    if weight.ndim != 2:
        raise ValueError(f"weight must be a matrix (out, in), got shape {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the weight contains NaN or Inf; it cannot be pruned by score")
    if criterion != "magnitude":
        if stats is None:
            raise ValueError(f"criterion {criterion!r} needs the layer's calibration inputs (an InputStats)")
        if stats.columns != weight.shape[1]:
            raise ValueError(f"the InputStats has {stats.columns} columns, the weight takes {weight.shape[1]} inputs")
    if criterion == "sparsegpt":
        return sparsegpt_prune(weight, stats.hessian(), ratio, n=n, m=m, blocksize=blocksize, percdamp=percdamp,
                               _owned=True)
    if criterion == "wanda":
        keep = keep_mask(wanda_scores(weight, stats.scaler_row), ratio, n=n, m=m)
    elif m:
        keep = keep_mask(weight.detach().abs().to(torch.float32), ratio, n=n, m=m)
    else:
        keep = magnitude_mask(weight, ratio)
    keep = keep.to(weight.device)
    return weight.detach() * keep.to(weight.dtype), keep
