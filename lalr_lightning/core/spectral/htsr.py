"""Heavy-tailed self-regularization (HT-SR) spectral analysis, batched and on the weights' device.

The numbers follow the two reference implementations (docs/internals.md, "Conventions (matching
the reference implementations)"):

* ESD: eigenvalues of ``W^T W`` (squared singular values), ascending, no ``1/N``, float64 in the
  true scale (computed on a power-of-two rescaled copy; routes and error model: comment "ESDs"
  in :mod:`.esd`). A Conv2d
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

The work is in four modules of one concern each: the ESDs (:mod:`.esd`), the power-law fits and
their per-layer result :class:`~.powerlaw.LayerFit` (:mod:`.powerlaw`), the other metrics
(:mod:`.esd_metrics`), and here the entry points that measure a model or a checkpoint:
:func:`analyze` (the table) and :func:`layer_fits` (the same per layer, typed, without warnings).
"""


from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable, Sequence

import pandas as pd
import torch
from torch import Tensor

from lalr_lightning import progress
from lalr_lightning.core.runtime.safetensors_checkpoints import is_checkpoint_path, load_matrix, stored_matrices
from lalr_lightning.core.spectral.esd import (
    EVALS_THRESH,
    _check_dtype,
    _Entry,
    _Esd,
    _esds_of,
    _keep_kinds,
    _layer_entries,
    _num_evals,
    _resolve_layers,
    compute_esds,
    layer_esd,
)
from lalr_lightning.core.spectral.esd_metrics import (
    _NEEDS_FIT,
    DEFAULT_METRICS,
    METRICS,
    _check_metrics,
    _js_distance,
    _metric_table_rows,
)
from lalr_lightning.core.spectral.powerlaw import (
    FIT_FIELDS,
    FITS,
    DegenerateSpectrumError,
    LayerFit,
    _fit_esds,
    alphas,
    check_fit,
    fit_power_law,
)

# the analysis' public names, wherever they are defined (the documented entry point is this module)
__all__ = [
    "FITS",
    "METRICS",
    "DEFAULT_METRICS",
    "EVALS_THRESH",
    "DegenerateSpectrumError",
    "LayerFit",
    "layer_esd",
    "compute_esds",
    "fit_power_law",
    "analyze",
    "layer_fits",
    "alphas",
]


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


def _prepare(source, fit: str, metrics, dtype: torch.dtype, layer_types, device):
    """(the metrics asked for, the device, every matrix of ``source``), each argument checked."""
    check_fit(fit)
    _check_dtype(dtype)
    wanted = _check_metrics(metrics)
    device = _check_device(device)
    return wanted, device, _entries(source, layer_types, device)


def _measure(source, entries: list[_Entry], wanted: list[str], *, fit: str, dtype: torch.dtype, filter_zeros: bool,
             rand_seed: int, xmin_pos: float | None, device, progress: bool | None,
             ) -> tuple[list[dict], list[dict | str | None], list[_Esd]]:
    """(a row of the table per entry, each entry's fit -- a dict, the reason it has none, or None
    when no metric needs one -- and the ESDs)."""
    if not entries:
        return [], [], []
    wset = set(wanted)
    fitting = bool(wset & _NEEDS_FIT)
    thr = EVALS_THRESH if filter_zeros and fitting else None
    bar = _progress(progress, len(entries))
    try:
        if is_checkpoint_path(source):  # one stored matrix in memory at a time
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
    return rows, fits, esds


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
    wanted, device, every = _prepare(source, fit, metrics, dtype, layer_types, device)
    entries, skipped = _within_counts(every, min_evals, max_evals)
    _warn_skipped(skipped, min_evals, max_evals)
    cols = ["name", "kind", "shape", *wanted, "warning"]
    if not entries:
        return pd.DataFrame(columns=cols), {}
    rows, fits, esds = _measure(source, entries, wanted, fit=fit, dtype=dtype, filter_zeros=filter_zeros,
                                rand_seed=rand_seed, xmin_pos=xmin_pos, device=device, progress=progress)
    table = pd.DataFrame([{c: row[c] for c in cols} for row in rows], columns=cols)
    degenerate = [f"{e.name} ({f})" for e, f in zip(entries, fits) if isinstance(f, str)]
    if degenerate:
        warnings.warn(
            "no power-law fit (NaN alpha and fit columns) for: " + "; ".join(degenerate)
            + ". The table's 'warning' column says why for each layer.",
            stacklevel=3,
        )
    return table, {e.name: r.evals for e, r in zip(entries, esds)}


def _within_counts(entries: list[_Entry], min_evals: int, max_evals: int | None,
                   ) -> tuple[list[_Entry], dict[str, list[str]]]:
    """(the entries with ``min_evals`` to ``max_evals`` eigenvalues, the names of the others:
    ``{"few": [...], "many": [...]}``)."""
    counts = [_num_evals(e.shape, e.kind) for e in entries]
    few = [e.name for e, c in zip(entries, counts) if c < min_evals]
    many = [e.name for e, c in zip(entries, counts) if max_evals is not None and c > max_evals]
    skip = set(few) | set(many)
    return [e for e in entries if e.name not in skip], {"few": few, "many": many}


def _skip_reasons(skipped: dict[str, list[str]], min_evals: int, max_evals: int | None) -> dict[str, str]:
    out = {name: f"fewer than min_evals={min_evals} eigenvalues" for name in skipped["few"]}
    out.update({name: f"more than max_evals={max_evals} eigenvalues" for name in skipped["many"]})
    return out


def _warn_skipped(skipped: dict[str, list[str]], min_evals: int, max_evals: int | None) -> None:
    """A warning naming the layers left out for their size (at the caller of :func:`analyze`:
    ``stacklevel`` counts this frame and ``_analyze``'s)."""
    few, many = skipped["few"], skipped["many"]
    if few:
        warnings.warn(f"spectral analysis skips {len(few)} layer(s) with fewer than min_evals={min_evals} eigenvalues: {few}", stacklevel=4)
    if many:
        warnings.warn(f"spectral analysis skips {len(many)} layer(s) with more than max_evals={max_evals} eigenvalues: {many}", stacklevel=4)


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


def layer_fits(
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
) -> list[LayerFit]:
    """:func:`analyze`'s measurement as one :class:`~.powerlaw.LayerFit` per matrix, in order, for a
    program to read: no table and no warning. A layer outside ``min_evals``/``max_evals`` has
    ``status="skipped"``, one that cannot be fitted ``status="failed"``, each with its ``reason``;
    ``metrics`` (the same names and defaults as :func:`analyze`'s) holds every value asked for
    beyond the fit's own fields and ``num_evals``. The same arguments raise the same errors."""
    wanted, device, every = _prepare(model_or_path, fit, metrics, dtype, layer_types, device)
    entries, skipped = _within_counts(every, min_evals, max_evals)
    rows, fits, esds = _measure(model_or_path, entries, wanted, fit=fit, dtype=dtype, filter_zeros=filter_zeros,
                                rand_seed=rand_seed, xmin_pos=xmin_pos, device=device, progress=False)
    extra = [c for c in wanted if c not in FIT_FIELDS and c != "num_evals"]
    measured = {e.name: LayerFit.of(e.name, r.evals.numel(), f, {c: row[c] for c in extra})
                for e, row, f, r in zip(entries, rows, fits, esds)}
    why = _skip_reasons(skipped, min_evals, max_evals)
    return [measured.get(e.name) or LayerFit(e.name, _num_evals(e.shape, e.kind), status="skipped", reason=why[e.name])
            for e in every]
