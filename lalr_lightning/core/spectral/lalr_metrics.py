"""LALR's per-layer weight metrics and the learning-rate multipliers made from them.

"LALR: Layer-Adaptive Learning Rate Fine-Tuning Using Sequential Scaling Metrics" sections 2.1-2.4 and B.1.4 (metrics), 3.0 and Appendix A
(sequential phases), B.4.4 (weighted sum) and B.4.5.3 (Hessian proxy). Pure torch / numpy /
pandas: no Lightning here. The callback (``callbacks/lalr.py``) only decides when to call
these and logs what they return.

For every layer ``l`` (a weight matrix, see :func:`lalr_layers`):

* ``raw_svd`` = the mean of the nonzero singular values of ``W_l`` (B.1.4: ``(1/r) sum_i
  sigma_i`` over the ``r = rank(W)`` nonzero ones). Section 2.1 writes ``1/(L-1) sum_{k<L}``
  instead, which would drop the smallest singular value; we follow B.1.4, the paper's list of
  definitions. Rank: singular values above ``sigma_max * max(m, n) * eps_float32`` (the
  ``torch.linalg.matrix_rank`` rule). An all-zero matrix has rank 0 and ``raw_svd = 0``.
  Convolutions are read as their ``out x (in * k * k)`` matrix (the map from a receptive field
  to one output pixel).
* ``raw_ce`` = the mean over the layer's peers ``j`` of ``CE(p_l, p_j) = -sum_k p_l(k)
  log(p_j(k) + eps)``, minus ``ln(n)``, where ``p = |w| / sum |w|`` is the layer's flattened
  weight magnitude distribution over its ``n`` entries (``groups="shape"``) or its histogram
  over ``bins`` shared bins (``groups="histogram"``, then ``n = bins``).
* ``raw_cs`` = the mean cosine similarity of the flattened weights to the peers'
  (``groups="shape"``), or of the histograms (``groups="histogram"``).

and the final metrics, the per-layer learning-rate scales of the paper:
``svd = 1 - minmax(raw_svd)``, ``ce = 1 - minmax(raw_ce)``, ``cs = minmax(raw_cs)``.

Choices where the paper is silent (also in ``docs/lalr.md``):

* **Weights to probabilities**: ``|w| / sum|w|``. It is a proper distribution for signed
  weights, invariant to the layer's scale (like the cosine), and keeps each entry's relative
  magnitude. A softmax of weights ~ 0.02 is uniform to five digits (every CE equals ``ln n``),
  and shifting by the minimum makes the distribution hinge on one outlier. An all-zero layer
  has no magnitude pattern: it gets the uniform distribution ``1/n``.
* **Which layers are compared** (``groups``): CE and CS compare flattened weights entry by
  entry, which needs equal shapes. ``"shape"`` (default) compares each layer with the other
  layers of exactly its weight shape -- how transformers are built: the q/k/v/o projections of
  all blocks share one shape, the two MLP matrices two more. A layer with no same-shaped peer
  (a singleton) has no CE/CS: ``raw_ce = raw_cs = NaN`` and ``ce = cs = singleton_value``
  (0.5, the middle of the others' range: neither favoured nor held back). Scoring a singleton
  by histograms instead would put it on another scale (histogram cosines are ~0.9, weight
  cosines ~0), so min-max would always send it to an extreme. ``"histogram"`` compares every
  layer with every other through fixed-bin histograms of its normalized magnitudes ``n p =
  |w| / mean|w|`` (mean 1, so layers of any size share one scale) over ``[0, hist_range]``,
  the last bin also counting everything above; it works for any architecture (CNNs, whose
  shapes are mostly unique) and has no singletons.
* **``- ln(n)`` in ``raw_ce``**: ``CE(p, q) = ln n - sum_k p(k) ln(n q(k))``: every CE carries
  ``ln n``, the CE of any distribution against the uniform one. Layers of different sizes would
  otherwise be ranked by size alone (MiniLM: 1.4 nats between attention and MLP matrices, far
  more than the at most ~0.05 nats that separate layers of one shape). Subtracting it changes nothing
  after min-max when all compared layers have one size (a shift), so one shape group or the
  histogram mode give exactly the paper's normalized metric; the paper's value is
  ``raw_ce + ln(n)``.
* **Zero range**: when every layer has the same raw value (up to 1e-9 relative), no layer can
  be told apart; the final metric is 1 for all (``svd``, ``ce`` and ``cs`` alike), so LALR
  leaves the scheduled learning rate unchanged.
* **Zero weights**: ``raw_svd = 0``; uniform distribution for CE (above); cosine similarity
  with a zero vector is defined as 0 (no direction).
* **NaN / Inf weights**: a ``ValueError`` naming the layer. **Fewer than two layers**: a
  ``ValueError`` (CE and CS compare a layer with the others; with one layer they do not
  exist).

Batched: singular values are computed per shape group in stacked ``svdvals`` calls; CE and CS
of a group are two Gram-matrix products (``P @ log(P + eps)^T`` and ``W @ W^T``) accumulated
over chunks of the flattened weights, so memory stays bounded for large models; no Python loop
over pairs of layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import MATRIX_KINDS, Layer, clean_name, matrix_layers

__all__ = [
    "METRICS",
    "GROUPS",
    "MODES",
    "LAYER_TYPES",
    "DEFAULT_LAYER_TYPES",
    "lalr_layers",
    "lalr_metrics",
    "lalr_multipliers",
    "layer_weight",
    "minmax",
    "weight_shape",
]

#: The paper's three metrics, in its phase order.
METRICS = ("svd", "ce", "cs")
#: How layers are compared for CE and CS.
GROUPS = ("shape", "histogram")
#: How the metrics become one multiplier per layer.
MODES = ("sequential", "weighted", "hessian")
LAYER_TYPES = MATRIX_KINDS
#: Every weight matrix, embeddings included: the paper works on language models and its
#: Appendix A scales every weight tensor of the model, embeddings among them.
DEFAULT_LAYER_TYPES = LAYER_TYPES

_CHUNK = 1 << 24  # elements per stacked block (x 8 bytes in float64)


# ----------------------------------------------------------------------------- layers


def _is_lora(module: nn.Module | None) -> bool:
    """A peft LoRA wrapper (``lora.Linear``, ``lora.Conv2d``, ``lora.Embedding``)."""
    return (
        module is not None
        and isinstance(getattr(module, "base_layer", None), nn.Module)
        and callable(getattr(module, "get_delta_weight", None))
    )


def _adapters(module: nn.Module) -> list[str]:
    names: list[str] = []
    for attr in ("lora_A", "lora_embedding_A"):
        names += [k for k in getattr(module, attr, {}) if k not in names]
    active = getattr(module, "active_adapters", names)
    return [a for a in ([active] if isinstance(active, str) else active) if a in names]


def layer_weight(layer: Layer) -> torch.Tensor:
    """The weight LALR measures, detached: the module's weight, or for a peft LoRA layer the
    merged weight ``W + scaling * B A`` the layer actually applies."""
    mod = layer.module
    if _is_lora(mod):
        with torch.no_grad():
            w = mod.base_layer.weight.detach()
            if getattr(mod, "merged", False) or getattr(mod, "disable_adapters", False):
                return w
            for a in _adapters(mod):
                w = w + mod.get_delta_weight(a).detach().to(w.dtype)
            return w
    return layer.weight.detach()


def weight_shape(layer: Layer) -> tuple[int, ...]:
    mod = layer.module
    if _is_lora(mod):
        return tuple(mod.base_layer.weight.shape)
    return tuple(layer.weight.shape)


def lalr_layers(
    model: nn.Module,
    *,
    layer_types: Sequence[str] = DEFAULT_LAYER_TYPES,
    trainable_only: bool = False,
) -> list[Layer]:
    """The layers LALR measures and scales: ``core.model.layers.matrix_layers`` of the given kinds.

    A peft LoRA wrapper counts as one layer named like the wrapped module (``...query``, not
    ``...query.base_layer`` / ``...query.lora_A.default``): it is measured on its merged weight
    (:func:`layer_weight`) and its multiplier applies to its adapters (the base weight is
    frozen). With ``trainable_only``, layers none of whose parameters require gradients are
    left out (they would not move, and would only stretch the others' min-max range).
    Biases and norm layers tied by the ``bn -> conv`` rule follow their layer; every other
    parameter (LayerNorm, ...) keeps the scheduled learning rate.
    """
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"unknown layer_types {bad}; valid: {', '.join(LAYER_TYPES)}")
    wrappers = {clean_name(raw): mod for raw, mod in model.named_modules() if _is_lora(mod)}
    out: list[Layer] = []
    for layer in matrix_layers(model):
        owner = next((w for w in wrappers if layer.name.startswith(w + ".")), None)
        if owner is None:
            out.append(layer)
            continue
        if layer.name != f"{owner}.base_layer":
            continue  # lora_A / lora_B of a wrapper: part of the wrapper's layer
        mod = wrappers[owner]
        params = {f"{owner}.{n}" if owner else n: p for n, p in mod.named_parameters()}
        params.update({k: p for k, p in layer.params.items() if all(p is not q for q in params.values())})
        out.append(Layer(name=owner, kind=layer.kind, module=mod, params=params, modules=[mod, *layer.modules[1:]]))
    out = [la for la in out if la.kind in set(layer_types)]
    if trainable_only:
        out = [la for la in out if any(p.requires_grad for p in la.params.values())]
    for i, la in enumerate(out):
        la.index = i
    return out


# ----------------------------------------------------------------------------- normalization


def minmax(values: Sequence[float] | np.ndarray, *, flip: bool = False) -> np.ndarray:
    """The paper's min-max normalization (2.4), ``1 - x`` when ``flip``; NaN entries stay NaN.

    Zero range (all finite values equal up to 1e-9 relative): every entry becomes 1, for
    ``flip`` or not -- the layers cannot be told apart, so none is slowed down.
    """
    x = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(x)
    out = np.full_like(x, np.nan)
    if not ok.any():
        return out
    lo, hi = float(x[ok].min()), float(x[ok].max())
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi)):
        out[ok] = 1.0
        return out
    n = (x[ok] - lo) / (hi - lo)
    out[ok] = 1.0 - n if flip else n
    return out


# ----------------------------------------------------------------------------- raw metrics


def _chunks(total: int, rows: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK // max(rows, 1))
    return [(a, min(a + step, total)) for a in range(0, total, step)]


def _singular_values(stack: torch.Tensor) -> torch.Tensor:
    """Singular values of a stack of matrices ``(g, r, c)``, descending.

    On CPU: square roots of the eigenvalues of the float64 Gram matrix of the smaller side
    (about twice as fast as ``svdvals`` and, in float64, accurate far below the float32 rank
    tolerance). Elsewhere: float32 ``svdvals`` (GPUs are slow in float64).
    """
    if stack.device.type != "cpu":
        return torch.linalg.svdvals(stack.float())
    m = stack.to(torch.float64)
    if m.shape[1] < m.shape[2]:
        m = m.mT
    ev = torch.linalg.eigvalsh(m.mT @ m)  # ascending
    return ev.clamp(min=0).sqrt().flip(-1)


def _mean_singular_values(weights: list[torch.Tensor]) -> np.ndarray:
    """Mean of the nonzero singular values of each (matrix view of a) weight, batched by shape."""
    mats = [w.reshape(w.shape[0], -1) for w in weights]
    out = np.zeros(len(mats))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        by_shape.setdefault(tuple(m.shape), []).append(i)
    tiny = torch.finfo(torch.float32).eps  # the weights' precision sets the rank tolerance
    for (r, c), idx in by_shape.items():
        per = max(1, _CHUNK // (r * c))
        for a in range(0, len(idx), per):
            part = idx[a : a + per]
            s = _singular_values(torch.stack([mats[i] for i in part])).to(torch.float64)  # (g, min(r, c))
            tol = s[:, :1] * max(r, c) * tiny
            keep = s > tol
            rank = keep.sum(1)
            total = (s * keep).sum(1)
            mean = torch.where(rank > 0, total / rank.clamp(min=1), torch.zeros_like(total))
            out[part] = mean.cpu().numpy()
    return out


def _pair_means(mat: torch.Tensor) -> torch.Tensor:
    """Row means over the off-diagonal entries: ``(1/(g-1)) sum_{j != i} M[i, j]``."""
    g = mat.shape[0]
    return (mat.sum(1) - mat.diagonal()) / (g - 1)


def _ce_cs_by_shape(weights: list[torch.Tensor], eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CE and CS of each layer against the other layers of exactly its shape."""
    n_layers = len(weights)
    raw_ce = np.full(n_layers, np.nan)
    raw_cs = np.full(n_layers, np.nan)
    peers = np.zeros(n_layers, dtype=np.int64)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, w in enumerate(weights):
        by_shape.setdefault(tuple(w.shape), []).append(i)
    for idx in by_shape.values():
        g = len(idx)
        peers[idx] = g - 1
        if g < 2:
            continue
        flat = [weights[i].reshape(-1) for i in idx]
        n = flat[0].numel()
        dev = flat[0].device
        mass = torch.stack([f.abs().sum(dtype=torch.float64) for f in flat])  # sum |w| per layer
        zero = mass == 0
        ce_sum = torch.zeros(g, g, dtype=torch.float64, device=dev)  # sum_k p_i(k) log(p_j(k) + eps)
        gram = torch.zeros(g, g, dtype=torch.float64, device=dev)  # w_i . w_j
        for a, b in _chunks(n, g):
            w = torch.stack([f[a:b] for f in flat]).to(torch.float64)
            p = w.abs() / torch.where(zero, 1.0, mass)[:, None]
            p[zero] = 1.0 / n  # an all-zero layer: uniform distribution
            ce_sum += p @ torch.log(p + eps).T
            gram += w @ w.T
        ce = -ce_sum
        norm = gram.diagonal().clamp(min=0).sqrt()
        denom = norm[:, None] * norm[None, :]
        cos = torch.where(denom > 0, gram / torch.where(denom > 0, denom, 1.0), torch.zeros_like(gram))
        cos = (cos + cos.T) / 2  # exactly symmetric, as CS is
        raw_ce[idx] = (_pair_means(ce) - math.log(n)).cpu().numpy()
        raw_cs[idx] = _pair_means(cos).cpu().numpy()
    return raw_ce, raw_cs, peers


def _histograms(weights: list[torch.Tensor], bins: int, hist_range: float) -> torch.Tensor:
    """Each layer's distribution of ``|w| / mean|w|`` over ``bins`` bins of ``[0, hist_range]``
    (values above go to the last bin), as probabilities; one row per layer."""
    rows = []
    for w in weights:
        v = w.reshape(-1).abs().float()
        mean = float(v.sum(dtype=torch.float64)) / v.numel()
        v = v / mean if mean > 0 else torch.ones_like(v)  # all-zero layer: uniform p, n p = 1
        h = torch.histc(v.clamp(max=hist_range), bins=bins, min=0.0, max=hist_range)
        rows.append(h.to(torch.float64).cpu() / v.numel())
    return torch.stack(rows)


def _ce_cs_by_histogram(p: torch.Tensor, bins: int, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CE and CS between every pair of layers' histograms (one row of ``p`` per layer)."""
    ce = -(p @ torch.log(p + eps).T)
    unit = p / p.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    cos = (cos + cos.T) / 2
    peers = np.full(p.shape[0], p.shape[0] - 1, dtype=np.int64)
    return (_pair_means(ce) - math.log(bins)).numpy(), _pair_means(cos).numpy(), peers


# ----------------------------------------------------------------------------- public


def lalr_metrics(
    model: nn.Module | None = None,
    *,
    layers: Sequence[Layer] | None = None,
    groups: str = "shape",
    bins: int = 64,
    hist_range: float = 8.0,
    eps: float = 1e-12,
    singleton_value: float = 0.5,
    layer_types: Sequence[str] = DEFAULT_LAYER_TYPES,
    trainable_only: bool = False,
) -> pd.DataFrame:
    """LALR's SVD, CE and CS metrics of every layer, raw and normalized (see the module doc).

    Args:
        model: the network; its layers come from :func:`lalr_layers` (with ``layer_types``
            and ``trainable_only``) unless ``layers`` is given.
        layers: an explicit list of ``core.model.layers.Layer`` to measure.
        groups: ``"shape"`` (CE/CS between same-shaped layers) or ``"histogram"`` (between
            all layers, through histograms).
        bins, hist_range: the histogram of ``|w| / mean|w|`` (``groups="histogram"``).
        eps: added to probabilities inside the logarithm of CE.
        singleton_value: ``ce`` and ``cs`` of a layer without a same-shaped peer.

    Returns:
        A DataFrame, one row per layer in model order, with columns ``name``, ``kind``,
        ``shape``, ``peers`` (how many layers it was compared with), ``raw_svd``, ``raw_ce``,
        ``raw_cs``, ``svd``, ``ce``, ``cs``.
    """
    if groups not in GROUPS:
        raise unknown("groups", groups, GROUPS)
    if int(bins) < 2:
        raise ValueError(f"bins must be >= 2, got {bins}")
    if not hist_range > 0:
        raise ValueError(f"hist_range must be > 0 (in units of the layer's mean |w|), got {hist_range}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps log(0) out of the cross-entropy), got {eps}")
    if not 0.0 <= singleton_value <= 1.0:
        raise ValueError(f"singleton_value must be in [0, 1], got {singleton_value}")
    if layers is None:
        if model is None:
            raise ValueError("pass a model or layers=[...]")
        layers = lalr_layers(model, layer_types=layer_types, trainable_only=trainable_only)
    layers = list(layers)
    what = type(model).__name__ if model is not None else "the given layers"
    if len(layers) < 2:
        found = f"only {layers[0].name!r}" if layers else "none"
        raise ValueError(
            f"LALR compares each layer with the others (CE, CS) and normalizes over layers, so it needs at "
            f"least 2 weight matrices; {what} has {found} of types {tuple(layer_types)}"
            f"{' that train' if trainable_only else ''}. Widen layer_types or use a model with more layers."
        )
    raw = lalr_raw(layers, groups=groups, bins=bins, hist_range=hist_range, eps=eps)
    return lalr_table(layers, raw, groups=groups, bins=bins, eps=eps, singleton_value=singleton_value)


def lalr_units(layers: Sequence[Layer], groups: str = "shape") -> list[list[Layer]]:
    """The layers in units that :func:`lalr_raw` can measure apart from each other: each shape
    group (``groups="shape"``: CE and CS compare a group's layers among themselves) or each
    layer (``groups="histogram"``: per-layer histograms, compared afterwards). Sharding these
    units across ranks gives the same table as measuring all of them in one place."""
    if groups == "histogram":
        return [[la] for la in layers]
    by_shape: dict[tuple[int, ...], list[Layer]] = {}
    for la in layers:
        by_shape.setdefault(weight_shape(la), []).append(la)
    return list(by_shape.values())


def lalr_raw(
    layers: Sequence[Layer], *, groups: str = "shape", bins: int = 64, hist_range: float = 8.0, eps: float = 1e-12
) -> dict[str, dict]:
    """The per-layer part of :func:`lalr_metrics`: ``{layer: {"raw_svd", "raw_ce", "raw_cs",
    "peers"}}`` (shape groups: CE and CS among the given layers of each shape) or ``{layer:
    {"raw_svd", "hist"}}`` (histogram mode; compared by :func:`lalr_table`)."""
    weights = [layer_weight(la) for la in layers]
    for la, w in zip(layers, weights):
        if w.numel() == 0:
            raise ValueError(f"layer {la.name!r} has an empty weight {tuple(w.shape)}; leave it out via layers=[...]")
        if not bool(torch.isfinite(w).all()):
            bad = "NaN" if bool(torch.isnan(w).any()) else "Inf"
            raise ValueError(
                f"layer {la.name!r} has {bad} weights; LALR cannot measure it. The run has diverged "
                "(lower the learning rate, clip gradients) or the checkpoint is corrupt."
            )
    raw_svd = _mean_singular_values(weights) if weights else np.zeros(0)
    if groups == "shape":
        raw_ce, raw_cs, peers = _ce_cs_by_shape(weights, eps)
        return {la.name: {"shape": list(weight_shape(la)), "raw_svd": float(s), "raw_ce": float(c),
                          "raw_cs": float(k), "peers": int(n)}
                for la, s, c, k, n in zip(layers, raw_svd, raw_ce, raw_cs, peers)}
    hists = _histograms(weights, int(bins), float(hist_range)) if weights else torch.zeros(0, int(bins))
    return {la.name: {"shape": list(weight_shape(la)), "raw_svd": float(s), "hist": h.tolist()}
            for la, s, h in zip(layers, raw_svd, hists)}


def lalr_table(
    layers: Sequence[Layer], raw: dict[str, dict], *, groups: str = "shape", bins: int = 64, eps: float = 1e-12,
    singleton_value: float = 0.5,
) -> pd.DataFrame:
    """:func:`lalr_metrics`' table from :func:`lalr_raw`'s per-layer results (of all layers)."""
    rows = [raw[la.name] for la in layers]
    raw_svd = np.array([r["raw_svd"] for r in rows])
    if groups == "shape":
        raw_ce = np.array([r["raw_ce"] for r in rows])
        raw_cs = np.array([r["raw_cs"] for r in rows])
        peers = np.array([r["peers"] for r in rows], dtype=np.int64)
    else:
        hists = torch.tensor([r["hist"] for r in rows], dtype=torch.float64)
        raw_ce, raw_cs, peers = _ce_cs_by_histogram(hists, int(bins), eps)
    svd = minmax(raw_svd, flip=True)
    ce = np.nan_to_num(minmax(raw_ce, flip=True), nan=singleton_value)
    cs = np.nan_to_num(minmax(raw_cs), nan=singleton_value)
    return pd.DataFrame({
        "name": [la.name for la in layers],
        "kind": [la.kind for la in layers],
        "shape": ["x".join(map(str, r["shape"])) for r in rows],
        "peers": peers,
        "raw_svd": raw_svd,
        "raw_ce": raw_ce,
        "raw_cs": raw_cs,
        "svd": svd,
        "ce": ce,
        "cs": cs,
    })


def check_weights(weights: Mapping[str, float] | Sequence[float] | None) -> dict[str, float]:
    """``weights`` of the weighted mode as ``{metric: w}``; default equal weights."""
    if weights is None:
        return dict.fromkeys(METRICS, 1.0)
    if isinstance(weights, Mapping):
        bad = sorted(set(weights) - set(METRICS))
        if bad:
            raise ValueError(f"unknown metric names in weights: {bad}; valid: {', '.join(METRICS)}")
        out = {m: float(weights.get(m, 0.0)) for m in METRICS}
    else:
        vals = [float(v) for v in weights]
        if len(vals) != len(METRICS):
            raise ValueError(f"weights as a list needs {len(METRICS)} values for {METRICS}, got {len(vals)}")
        out = dict(zip(METRICS, vals))
    if not all(math.isfinite(v) and v >= 0 for v in out.values()) or sum(out.values()) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {out}")
    return out


def lalr_multipliers(
    metrics: pd.DataFrame,
    *,
    mode: str = "sequential",
    phase: str = "svd",
    weights: Mapping[str, float] | Sequence[float] | None = None,
    floor: float = 0.1,
    hessian_delta: float = 0.1,
) -> dict[str, float]:
    """Per-layer learning-rate multipliers ``floor + (1 - floor) * f`` with ``f`` in [0, 1]:

    * ``sequential``: ``f`` = the final metric of ``phase`` (``svd``, ``ce`` or ``cs``) -- the
      paper's ``lr_{l,e} = lr x scale_{l,e}`` (3.2, Appendix A).
    * ``weighted`` (B.4.1/B.4.4, ``eta ~ sum_j w_j M_j``): ``f = sum_j w_j M_j / sum_j w_j``;
      ``weights`` maps metric names to ``w_j`` (default all 1; B.4.4's relative-only mix is
      ``{"ce": w_CE, "cs": w_CS}``).
    * ``hessian`` (B.4.5.3, ``eta_l ~ k / ((1 - M_SVD) e^{M_CE} M_CS)``):
      ``g_l = (d + (1-d)(1 - M_SVD)) e^{M_CE} (d + (1-d) M_CS)`` with ``d = hessian_delta``,
      and ``f = k / g_l`` with ``k = min_l g_l``. Min-max gives ``1 - M_SVD = 0`` and
      ``M_CS = 0`` to some layer, a division by zero; ``d`` maps both factors onto ``[d, 1]``
      (the largest ratio between two layers is then ``e / d^2``). ``k`` makes the largest
      ``f`` exactly 1, so no layer exceeds the scheduled rate (B.4.5.2: ``0 < f <= 1``). Note
      that, as written, this formula lowers the rate of layers with high ``M_CE`` / ``M_CS``,
      the opposite of the CE and CS phases.

    ``floor`` keeps every layer learning: min-max gives exactly 0 to one layer per phase, which
    would freeze it (``floor=0`` is the paper exactly). The affine map keeps every distinction
    the metric makes (a clip at ``floor`` would merge all layers below it).
    """
    if mode not in MODES:
        raise unknown("mode", mode, MODES)
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    if mode == "sequential":
        if phase not in METRICS:
            raise unknown("phase", phase, METRICS)
        f = metrics[phase].to_numpy(dtype=np.float64)
    elif mode == "weighted":
        w = check_weights(weights)
        f = sum(w[m] * metrics[m].to_numpy(dtype=np.float64) for m in METRICS) / sum(w.values())
    else:
        if not 0.0 < hessian_delta <= 1.0:
            raise ValueError(f"hessian_delta must be in (0, 1], got {hessian_delta}")
        d = hessian_delta
        svd, ce, cs = (metrics[m].to_numpy(dtype=np.float64) for m in METRICS)
        g = (d + (1 - d) * (1 - svd)) * np.exp(ce) * (d + (1 - d) * cs)
        f = g.min() / g
    mult = floor + (1.0 - floor) * f
    return {str(n): float(v) for n, v in zip(metrics["name"], mult)}
