"""HT-SR pruning, the pure part (AlphaPruning, "Layerwise Training of Deep Neural Networks" (https://www2.eecs.berkeley.edu/Pubs/TechRpts/2023/EECS-2023-126.html) ch. 3): per-layer pruning ratios
from a metric, magnitude and channel masks, the thesis' incremental channel budget, the gradual
schedule, and which layers are pruned. Numpy / torch only; ``callbacks/pruning.py`` decides when.

Each prunable layer gets a metric value ``m_l`` (HT-SR alpha by default, or any other column of
:func:`lalr_lightning.core.spectral.htsr.layer_fits`); the values are min-max mapped onto
``[1 - eps, 1 + eps]``::

    r_l = (m_l - min m) / (max m - min m) * 2 eps + (1 - eps)      (more_for_larger)
    r_l = (max m - m_l) / (max m - min m) * 2 eps + (1 - eps)      (more_for_smaller)

and scaled so that the parameter-weighted mean of the ratios is the target sparsity::

    ratio_l = target * r_l * sum_k n_k / sum_k r_k n_k

``epsilon=0`` gives every layer the target ratio: that *is* uniform pruning (the thesis'
"even" baseline), with exactly the same layers pruned as the HT-SR variants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import block_layers, output_layer
from lalr_lightning.core.model.forward_blocks import Trace
from lalr_lightning.core.model.layers import (
    DEFAULT_KINDS,
    MATRIX_KINDS,
    Layer,
    check_kinds,
    clean_name,
    matrix_layers,
    num_eigenvalues,
)
from lalr_lightning.core.runtime.checks import lora_zero
from lalr_lightning.core.spectral.htsr import layer_fits
from lalr_lightning.core.spectral.lalr_metrics import _is_lora  # the one test of what a peft LoRA layer is

__all__ = [
    "PRUNING_METRICS",
    "DIRECTIONS",
    "OVERFLOW",
    "metric_scores",
    "pruning_ratios",
    "block_average_values",
    "magnitude_mask",
    "incremental_channel_budgets",
    "channel_scores",
    "channel_mask",
    "channel_masks_of",
    "cubic_sparsity",
    "refuse_lora_parts",
    "prunable_layers",
    "out_dim",
    "layer_masks",
    "block_groups",
    "dense_note",
    "check_known_masks",
    "finite_metric",
    "layer_metric",
]

#: The HT-SR metrics of thesis ch. 3.2 that :func:`spectral.analyze` computes per layer.
PRUNING_METRICS = (
    "alpha",
    "alpha_weighted",
    "log_alpha_norm",
    "stable_rank",
    "entropy",
    "spectral_norm",
    "log_spectral_norm",
    "norm",
    "log_norm",
    "rand_distance",
    "snr",
)
DIRECTIONS = ("more_for_larger", "more_for_smaller")
OVERFLOW = ("redistribute", "error")
_TOL = 1e-9


# ---------------------------------------------------------------------------- ratios


def metric_scores(metric_values, epsilon: float = 0.3, direction: str = "more_for_larger") -> np.ndarray:
    """AlphaPruning's min-max map of the metric onto ``[1 - eps, 1 + eps]`` (before scaling).

    All values equal (or a single layer): every score is 1, i.e. uniform.
    """
    if direction not in DIRECTIONS:
        raise unknown("direction", direction, DIRECTIONS)
    m = np.asarray(metric_values, dtype=np.float64)
    if m.ndim != 1 or m.size == 0:
        raise ValueError("metric_values must be a non-empty 1-D sequence")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"metric values must be finite, got {m.tolist()}")
    lo, hi = float(m.min()), float(m.max())
    if hi - lo <= 0:
        return np.ones_like(m)
    unit = (m - lo) / (hi - lo) if direction == "more_for_larger" else (hi - m) / (hi - lo)
    return unit * 2.0 * epsilon + (1.0 - epsilon)


def pruning_ratios(
    metric_values,
    numels,
    target: float,
    epsilon: float = 0.3,
    direction: str = "more_for_larger",
    *,
    overflow: str = "redistribute",
    max_ratio: float = 0.99,
) -> np.ndarray:
    """Per-layer pruning ratios whose parameter-weighted mean is ``target`` (pure; numpy).

    ``ratio_l = target * r_l * sum(n) / sum(r * n)`` with ``r`` from :func:`metric_scores`.

    A ratio above ``max_ratio`` (a layer pruned away entirely would cut the network):

    * ``overflow="redistribute"`` (default): such layers are clipped to ``max_ratio`` and the
      parameters they would have lost are spread over the remaining layers in proportion to
      ``r_l * n_l`` -- i.e. the remaining layers are rescaled so the weighted mean is still
      ``target`` -- repeated until no layer exceeds the cap. The ordering of the layers by
      metric is kept.
    * ``overflow="error"``: a ValueError naming the layers' indices and the fix.

    Ratios are never negative (``r_l >= 1 - eps >= 0``).
    """
    if overflow not in OVERFLOW:
        raise unknown("overflow", overflow, OVERFLOW)
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(
            f"epsilon={epsilon} maps the metric onto [{1 - epsilon:g}, {1 + epsilon:g}]; it must be in [0, 1] "
            "so that no layer gets a negative ratio (AlphaPruning uses 0.3; 0 is uniform pruning)"
        )
    if not 0.0 < max_ratio <= 1.0:
        raise ValueError(f"max_ratio must be in (0, 1], got {max_ratio}")
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target sparsity must be in [0, 1), got {target}")
    if target > max_ratio:
        raise ValueError(f"target sparsity {target} exceeds max_ratio={max_ratio}; raise max_ratio or lower the target")
    n = np.asarray(numels, dtype=np.float64)
    r = metric_scores(metric_values, epsilon, direction)
    if n.shape != r.shape or np.any(n <= 0):
        raise ValueError(f"numels must be positive and match the metric values, got {n.tolist()}")
    total = n.sum()
    ratios = target * r * total / float((r * n).sum())
    over = ratios > max_ratio + _TOL
    if not over.any():
        return ratios
    if overflow == "error":
        idx = np.flatnonzero(over).tolist()
        raise ValueError(
            f"epsilon={epsilon} at target sparsity {target} gives layers {idx} ratios "
            f"{np.round(ratios[over], 4).tolist()} above max_ratio={max_ratio}; lower epsilon or the target, "
            "or use overflow='redistribute'"
        )
    clipped = np.zeros_like(over)
    while True:
        clipped |= over
        free = ~clipped
        budget = target * total - max_ratio * n[clipped].sum()
        if not free.any():  # only possible when target == max_ratio
            return np.full_like(ratios, max_ratio)
        ratios = np.where(clipped, max_ratio, budget * r / float((r[free] * n[free]).sum()))
        over = free & (ratios > max_ratio + _TOL)
        if not over.any():
            return ratios


def block_average_values(values: Mapping[str, float], groups: Sequence[Sequence[str]]) -> dict[str, float]:
    """Replace each layer's value by the mean over its group (AlphaPruning averages the metric
    over the matrices of each transformer block). Layers in no group keep their own value."""
    out = dict(values)
    for g in groups:
        members = [k for k in g if k in values]
        if members:
            mean = float(np.mean([values[k] for k in members]))
            out.update({k: mean for k in members})
    return out


def cubic_sparsity(step: int, n_steps: int) -> float:
    """Fraction of the final sparsity reached after pruning event ``step`` (0-based) of
    ``n_steps``: Zhu & Gupta's ``s_t = s_f (1 - (1 - t / n)^3)`` with ``t = step + 1``, so the
    first event already prunes and event ``n_steps - 1`` reaches the target."""
    if n_steps < 1:
        raise ValueError("n_steps must be >= 1")
    t = min(max(step + 1, 0), n_steps)
    return 1.0 - (1.0 - t / n_steps) ** 3


# ---------------------------------------------------------------------------- masks


def magnitude_mask(weight: torch.Tensor, ratio: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask (True = kept) zeroing the ``round(ratio * numel)`` smallest-|w| entries.

    ``keep`` (a previous mask) makes the pruned set grow monotonically: entries already pruned
    stay pruned and count towards the number (gradual pruning). Ties break by position.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    flat = weight.detach().abs().flatten().to(torch.float32)
    k = int(round(ratio * flat.numel()))
    if keep is not None:
        keep_flat = keep.flatten().to(flat.device)
        flat = torch.where(keep_flat, flat, torch.full_like(flat, -1.0))
        k = max(k, int((~keep_flat).sum()))
    mask = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        idx = torch.argsort(flat, stable=True)[:k]
        mask[idx] = False
    return mask.view(weight.shape)


def incremental_channel_budgets(ratios, n_channels, step: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """The thesis' incremental budget for channel pruning (ch. 3.2), as a loop.

    Every iteration raises the pruned-channel fraction of each still-active layer by ``step``
    (0.01); a layer stops -- keeps its last fraction -- as soon as the next increment would
    exceed its ratio ``k_l`` ("rather under-prune than over-prune"). The layer then prunes
    ``floor(fraction * C_l)`` of its ``C_l`` output channels. Closed form of the result:
    ``fraction_l = floor(k_l / step) * step``, ``count_l = floor(fraction_l * C_l)``: the
    achieved channel fraction is at most ``k_l`` and less than it by under ``step + 1 / C_l``.

    Returns (fractions, channel counts).
    """
    k = np.asarray(ratios, dtype=np.float64)
    c = np.asarray(n_channels, dtype=np.int64)
    if step <= 0 or step > 1:
        raise ValueError(f"step must be in (0, 1], got {step}")
    frac = np.zeros_like(k)
    active = np.ones(k.shape, dtype=bool)
    t = 0
    while active.any():
        t += 1
        proposal = t * step  # t * step, not a running sum: no float drift over 100 iterations
        active &= proposal <= k + _TOL
        frac[active] = proposal
    counts = np.floor(frac * c + _TOL).astype(np.int64)
    return frac, counts


def out_dim(layer: Layer) -> int:
    # Hugging Face Conv1D stores (in, out): its output channels are dimension 1
    return 1 if layer.kind == "hf_conv1d" else 0


def channel_scores(weight: torch.Tensor, out_dim: int = 0) -> torch.Tensor:
    """L2 norm of each output channel's weights (the channel-pruning importance score)."""
    w = weight.detach().to(torch.float32).movedim(out_dim, 0)
    return w.reshape(w.shape[0], -1).norm(dim=1)


def channel_mask(weight: torch.Tensor, n_prune: int, out_dim: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask over output channels: the ``n_prune`` channels of smallest L2 norm pruned
    (channels already pruned in ``keep`` stay pruned and count)."""
    scores = channel_scores(weight, out_dim)
    n_prune = int(n_prune)
    if keep is not None:
        keep = keep.to(scores.device)
        scores = torch.where(keep, scores, torch.full_like(scores, -1.0))
        n_prune = max(n_prune, int((~keep).sum()))
    mask = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
    if n_prune > 0:
        mask[torch.argsort(scores, stable=True)[:n_prune]] = False
    return mask


def channel_masks_of(layer: Layer, ch_keep: torch.Tensor,
                     shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, torch.Tensor]:
    """Keep-masks for every parameter of a layer that has one entry per output channel: the
    weight (its output dimension), the bias, and the tied norm's weight and bias -- so a
    pruned channel outputs exactly 0 after its BatchNorm too. ``shapes``: the parameters'
    whole shapes by name, where the layer holds pieces of them (FSDP)."""
    out: dict[str, torch.Tensor] = {}
    n = ch_keep.numel()
    d = out_dim(layer)
    w = layer.weight
    for pname, p in layer.params.items():
        shape = tuple((shapes or {}).get(pname, p.shape))
        if p is w:
            view = [1] * len(shape)
            view[d] = n
            out[pname] = ch_keep.view(view).expand(shape).clone()
        elif len(shape) == 1 and shape[0] == n:
            out[pname] = ch_keep.clone()
    return out


# ---------------------------------------------------------------------------- layers


def _left_dense(layer: Layer, is_head: bool, min_numel: int, min_evals: int) -> str | None:
    """Why :func:`prunable_layers` leaves ``layer`` dense (None: it is pruned)."""
    if is_head:
        return "classifier head (head=False)"
    weight = layer.weight
    if not any(p is weight for p in layer.params.values()):  # torch.nn.utils.parametrize computes it
        return "parametrized weight (torch.nn.utils.parametrize): no mask holds on a computed weight"
    if weight.numel() < min_numel:
        return f"{weight.numel()} weights < min_numel={min_numel}"
    if num_eigenvalues(layer) < min_evals:
        return f"{num_eigenvalues(layer)} eigenvalues < min_evals={min_evals}"
    return None


def prunable_layers(
    model: torch.nn.Module,
    *,
    layer_types: Sequence[str] = DEFAULT_KINDS,
    head: bool = False,
    min_numel: int = 512,
    min_evals: int = 10,
    trace: Callable[[], Trace] | None = None,
) -> tuple[list[Layer], dict[str, str]]:
    """(layers to prune, {excluded layer: reason}) -- a function of the architecture only, so
    every rank and every resumed run prunes the same layers, whatever the metric (``trace``: a
    forward pass on a fixed probe batch, :func:`~lalr_lightning.core.model.blocks.output_layer`'s).

    Considered: the matrix layers of ``layer_types`` (Linear and convolutions; embeddings only
    when asked, AlphaPruning leaves them dense). Excluded: the model's output layer when
    ``head`` is False (the classifier: AlphaPruning keeps ``lm_head`` dense and channel pruning a
    head would delete classes), layers whose weight is computed (``torch.nn.utils.parametrize``:
    weight_norm, spectral_norm), layers whose weight has fewer than ``min_numel`` entries, and
    layers whose ESD has fewer than ``min_evals`` eigenvalues (too few for a power-law fit).
    """
    check_kinds(layer_types)
    every = matrix_layers(model)
    considered = [layer for layer in every if layer.kind in layer_types]
    if not considered:
        raise ValueError(
            f"HTSRPruning found no layers of types {tuple(layer_types)} in {type(model).__name__}; "
            f"widen layer_types (valid: {', '.join(MATRIX_KINDS)})"
        )
    excluded: dict[str, str] = {}
    out = output_layer(model, every, trace)  # found as the output even when tied to the input embedding
    head_name = None if out is None else out.name
    for layer in considered:
        reason = _left_dense(layer, not head and layer.name == head_name, min_numel, min_evals)
        if reason is not None:
            excluded[layer.name] = reason
    keep = [layer for layer in considered if layer.name not in excluded]
    if not keep:
        detail = "; ".join(f"{k} ({v})" for k, v in excluded.items())
        # only the remedies that would bring a layer back, each saying which
        fixes = []
        if any("min_numel" in v for v in excluded.values()):
            fixes.append("lower min_numel")
        if any("min_evals" in v for v in excluded.values()):
            fixes.append("lower min_evals")
        if head_name in excluded:
            alone = " (it alone: the only layer of these layer_types)" if len(considered) == 1 else ""
            fixes.append(f"set head=True to prune the output layer {head_name}{alone}")
        raise ValueError(
            f"HTSRPruning has no layer left to prune in {type(model).__name__} (excluded: {detail}); "
            + ("; or ".join(fixes) if fixes else "this model has nothing HTSRPruning can prune")
        )
    return keep, excluded


def layer_masks(
    layers: Sequence[Layer],
    ratios: Mapping[str, float],
    level: float = 1.0,
    *,
    structured: bool = False,
    channel_step: float = 0.01,
    previous: Mapping[str, torch.Tensor] | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Keep-masks (CPU, keyed by parameter name) for ``level`` x each layer's ratio, grown from
    the ``previous`` masks (pruned entries stay pruned), and the pruned channel count per layer
    (structured only).

    Unstructured: :func:`magnitude_mask` on the weight. Structured: the layer's incremental
    channel budget (:func:`incremental_channel_budgets`), channels by L2 norm
    (:func:`channel_mask`), spread over every parameter with one entry per output channel
    (:func:`channel_masks_of`).

    Where the layers hold pieces of their parameters (FSDP), ``weights`` gives each layer's whole
    weight by layer name and ``shapes`` every parameter's whole shape by name: the masks are
    those of the whole tensors.
    """
    previous = previous or {}
    masks: dict[str, torch.Tensor] = {}
    channels: dict[str, int] = {}
    for layer in layers:
        ratio = min(ratios[layer.name] * level, 1.0)
        wname = next(n for n, p in layer.params.items() if p is layer.weight)
        weight = (weights or {}).get(layer.name, layer.weight)
        old = previous.get(wname)
        if not structured:
            masks[wname] = magnitude_mask(weight, ratio, old).cpu()
            continue
        d = out_dim(layer)
        c = weight.shape[d]
        _, counts = incremental_channel_budgets([ratio], [c], channel_step)
        old_ch = None if old is None else old.movedim(d, 0).reshape(c, -1).any(dim=1)
        ch_keep = channel_mask(weight, int(counts[0]), d, old_ch).cpu()
        masks.update(channel_masks_of(layer, ch_keep, shapes))
        channels[layer.name] = int((~ch_keep).sum())
    return masks, channels


def block_groups(model: torch.nn.Module, layers: Sequence[Layer], blocks: Sequence[str] | None = None) -> list[list[str]]:
    """The names of ``layers`` grouped by the block (:func:`block_layers`) holding their
    parameters: what :func:`block_average_values` averages over."""
    groups = []
    for b in block_layers(model, blocks):
        pn = set(b.params)
        groups.append([layer.name for layer in layers if any(k in pn for k in layer.params)])
    return groups


def dense_note(excluded: Mapping[str, str]) -> str | None:
    """The warning naming the layers left dense for their size (the head left out by ``head=False``
    goes unsaid), or None."""
    small = {k: v for k, v in excluded.items() if not v.startswith("classifier head")}
    if not small:
        return None
    return ("HTSRPruning leaves these layers dense: " + "; ".join(f"{k} ({v})" for k, v in small.items())
            + ". Lower min_numel / min_evals to include them.")


def check_known_masks(masks: Mapping[str, object], params: Mapping[str, object]) -> None:
    """A RuntimeError for restored masks of parameters that are not in this model's pruned layers."""
    unknown = sorted(set(masks) - set(params))
    if unknown:
        raise RuntimeError(
            f"HTSRPruning state holds masks for parameters this model's prunable layers lack: {unknown[:5]}; "
            "the checkpoint belongs to another architecture or other layer settings"
        )


def layer_metric(layers: Sequence[Layer], metric: str, *, fit: str, filter_zeros: bool) -> dict[str, float]:
    """``metric`` of every layer (:func:`lalr_lightning.core.spectral.htsr.layer_fits`, which leaves
    out no layer here: the callers chose them); NaN where it cannot be measured (reported by
    :func:`finite_metric`)."""
    fits = layer_fits(layers, fit=fit, metrics=[metric], min_evals=1, filter_zeros=filter_zeros)
    return {f.name: f.value(metric) for f in fits}


def refuse_lora_parts(model: torch.nn.Module, layers: Sequence[Layer], who: str, n: int = 0, m: int = 0) -> None:
    """A one-line ValueError when a layer to prune is part of a peft LoRA layer (its ``base_layer``,
    ``lora_A`` or ``lora_B``).

    Such a layer computes with its merged weight ``W + s * B @ A``. Masks on ``W``, ``A`` and ``B``
    apart do not make that sum sparse (the issue-42 run: base and factors 0.500 each, the merged
    ``q_proj`` 16% zeros, and 0.0 after ``merge_and_unload``), and no mask on the factors can
    express one on the sum: ``B @ A`` is a dense rank-r product. So the only honest answers are
    to prune where the weight is one matrix (before the adapters, or after merging them) -- said
    here, as the alpha path says it for a zero ``lora_B``."""
    wrappers = {clean_name(raw) for raw, mod in model.named_modules() if _is_lora(mod)}
    parts = [la.name for la in layers if any(la.name.startswith(w + ".") for w in wrappers)]
    if not parts:
        return
    shape = f"not {n}:{m}" if m else "not sparse"
    raise ValueError(
        f"{who}: {len(parts)} of its layers are parts of peft LoRA layers ({', '.join(parts[:3])}"
        f"{' ...' if len(parts) > 3 else ''}): the model computes with each merged weight W + B*A, and pruning W, "
        f"lora_A and lora_B apart leaves that weight dense, {shape} (peft's lora_B matrices start at zero and "
        "train away from it); prune the model without LoRA, or after merging the adapters (model.merge_and_unload())")


def finite_metric(values: Mapping[str, float], names: Sequence[str], metric: str) -> dict[str, float]:
    """``values`` of the layers ``names``, in that order; a ValueError naming the layers whose
    ``metric`` is missing or not finite."""
    bad = {n: values.get(n) for n in names if n not in values or not math.isfinite(values[n])}
    if bad and lora_zero(bad):
        raise ValueError(f"metric {metric!r} is not finite for layers {list(bad)[:5]}: peft LoRA's lora_B matrices "
                         "start at zero; prune the model without LoRA, or after merging the adapters "
                         "(model.merge_and_unload())")
    if bad:
        raise ValueError(f"metric {metric!r} is not finite for layers {bad} (all-zero or constant weights?); "
                         "exclude them (min_numel) or choose another metric")
    return {n: values[n] for n in names}
