"""Which layers train, the pure part: the surgical fine-tuning authors' per-tensor criteria
(Auto-RGN's relative gradient norm, the eb-criterion), fixed block choices, LIFT's block
orders and LISA's draws (baselines of "L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)). Numpy / torch only; the selection
callbacks decide when.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import numpy as np
import torch
from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import Layer, clean_name

__all__ = [
    "LIFT_ORDERS",
    "relative_grad_norms",
    "eb_scores",
    "rgn_multipliers",
    "eb_multipliers",
    "check_selection",
    "select_blocks",
    "lift_block",
    "lisa_sample",
    "tensor_layers",
]

LIFT_ORDERS = ("front_to_end", "end_to_front", "random")


# ---------------------------------------------------------------------------- measurements


def relative_grad_norms(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||g||_2 / ||theta||_2`` per tensor (float64); ``inf`` where ``||theta|| = 0``, 0 where
    the loss does not reach the tensor (``g is None``)."""
    out = torch.empty(len(params), dtype=torch.float64)
    for i, (g, p) in enumerate(zip(grads, params)):
        gn = 0.0 if g is None else torch.linalg.vector_norm(g.detach().double()).item()
        pn = torch.linalg.vector_norm(p.detach().double()).item()
        out[i] = math.inf if pn == 0.0 else gn / pn
    return out


def eb_scores(grads: Sequence[torch.Tensor | None], eps: float = 1e-8) -> torch.Tensor:
    """The surgical fine-tuning code's eb-criterion score per tensor (float64):
    ``mean(g^2 / (var(g, dim=0, keepdim=True) + eps))``. A tensor with a single entry along
    dim 0 uses the variance over all entries; a one-element tensor scores ``inf`` (passes)."""
    out = torch.empty(len(grads), dtype=torch.float64)
    for i, g in enumerate(grads):
        if g is None:
            out[i] = 0.0
            continue
        g = g.detach().double()
        if g.numel() < 2:
            out[i] = math.inf
            continue
        if g.ndim == 0 or g.shape[0] < 2:
            var = g.var()
        else:
            var = g.var(dim=0, keepdim=True)
        out[i] = (g * g / (var + eps)).mean().item()
    return out


def rgn_multipliers(rgn: Mapping[str, float]) -> dict[str, float]:
    """RGN divided by its maximum over tensors; a tensor with infinite RGN (zero weight norm)
    gets 1 and is left out of the maximum."""
    finite = [v for v in rgn.values() if math.isfinite(v)]
    top = max(finite) if finite else 0.0
    if finite and top <= 0.0:
        raise RuntimeError(
            "every measured gradient is zero, so relative gradient norms cannot rank the tensors; "
            "check that the loss depends on the parameters (and that they require grad)"
        )
    return {k: (1.0 if not math.isfinite(v) else v / top) for k, v in rgn.items()}


def zero_gradient_warning(multipliers: Mapping[str, float], scores: Mapping[str, float], weights: Sequence[str],
                          zero_scales: Sequence[str], exclude: Sequence[str]) -> str | None:
    """One line when most weight matrices (``weights``: the tensor names of the conv/linear
    weights) get multiplier 0 because their measured gradient is exactly 0 (score 0), naming the
    cause when it is visible: norm-layer scales that are all zeros (``zero_scales``; timm
    zero-initialises the last BatchNorm of each residual branch), which block the gradient of
    their branch -- for good when the exclusion keeps them at multiplier 0. ``None`` when at most
    half of the weight matrices are affected."""
    dead = [w for w in weights if multipliers.get(w, 1.0) == 0.0 and scores.get(w) == 0.0]
    if not weights or 2 * len(dead) <= len(weights):
        return None
    head = (f"AutoRGN: {len(dead)} of {len(weights)} weight matrices get multiplier 0.0 and do not train "
            f"(e.g. {dead[0]}): their measured gradient is exactly 0")
    if not zero_scales:
        return f"{head} on the measured batches; check that the loss depends on them"
    cause = (f"{head}, because {len(zero_scales)} norm-layer scales are all zeros (e.g. {zero_scales[0]}; timm "
             "zero-initialises the last BatchNorm of each residual branch)")
    frozen = [n for n in zero_scales if multipliers.get(n, 0.0) == 0.0]
    if frozen:
        return (f"{cause} and exclude={tuple(exclude)!r} keeps {len(frozen)} of them at multiplier 0.0, so they never "
                "move and no gradient reaches their branches; pass exclude=() or excluded_multiplier=1.0 to train them "
                "(the branches then get gradients from the next measurement)")
    return f"{cause}; they train now, so their branches get gradients from the next measurement on"


def eb_multipliers(scores: Mapping[str, float], threshold: float = 0.95) -> dict[str, float]:
    """1 for tensors whose eb score is at least ``threshold``, else 0 (frozen), as the reference."""
    return {k: (1.0 if v >= threshold else 0.0) for k, v in scores.items()}


# ---------------------------------------------------------------------------- selections


def _block_list(names: Sequence[str]) -> str:
    return ", ".join(f"{i}: {n!r}" for i, n in enumerate(names))


def _check_item(item: Any) -> None:
    if isinstance(item, bool) or not isinstance(item, (str, int)):
        raise TypeError(f"a block selection item must be a str or an int, got {item!r}")
    if isinstance(item, str) and item.startswith("block:"):
        try:
            int(item[len("block:"):])
        except ValueError:
            raise ValueError(f"{item!r}: write 'block:N' with an integer N (e.g. 'block:0', 'block:-1')") from None


def select_blocks(select: str | int | Sequence[str | int], names: Sequence[str]) -> list[str]:
    """Resolve a fixed selection against the model's block names (returned in block order).

    Items: ``"first"``, ``"last"``, ``"all"``, ``"block:N"`` or an int ``N`` (index, negative
    from the end), a block name, or a glob pattern over block names (``"*layer3*"``).
    """
    items = [select] if isinstance(select, (str, int)) else list(select)
    if not items:
        raise ValueError(f"select is empty; choose at least one block of: {_block_list(names)}")
    chosen: set[str] = set()
    for item in items:
        _check_item(item)
        hits = _hits(item, names)
        if not hits:
            raise ValueError(
                f"block {item!r} does not exist; the model's blocks are: {_block_list(names)} "
                "(use a name, a glob pattern, 'first', 'last', 'all' or 'block:N')"
            )
        chosen.update(hits)
    return [n for n in names if n in chosen]


def _hits(item: str | int, names: Sequence[str]) -> list[str]:
    """The block names one checked item of a fixed selection names (maybe none)."""
    if isinstance(item, int) or item.startswith("block:"):
        idx = item if isinstance(item, int) else int(item[len("block:"):])
        if not -len(names) <= idx < len(names):
            raise ValueError(f"block index {idx} does not exist; the model's blocks are: {_block_list(names)}")
        return [names[idx]]
    if item == "first":
        return [names[0]]
    if item == "last":
        return [names[-1]]
    if item == "all":
        return list(names)
    return [n for n in names if n == item or fnmatchcase(n, item)]


def lift_block(order: str, switch: int, n_blocks: int, seed: int = 0) -> int:
    """Index of the block LIFT trains during switch number ``switch``."""
    pos = switch % n_blocks
    if order == "front_to_end":
        return pos
    if order == "end_to_front":
        return n_blocks - 1 - pos
    if order == "random":
        perm = np.random.default_rng([seed, switch // n_blocks]).permutation(n_blocks)
        return int(perm[pos])
    raise unknown("LIFT order", order, LIFT_ORDERS)


def lisa_sample(n_middle: int, gamma: int, switch: int, seed: int = 0) -> list[int]:
    """Indices (sorted) of the ``gamma`` middle blocks LISA trains during switch ``switch``:
    uniform without replacement, from a generator seeded by ``(seed, switch)``."""
    rng = np.random.default_rng([seed, switch])
    return sorted(int(i) for i in rng.choice(n_middle, size=gamma, replace=False))


def check_selection(select: str | int | Sequence[str | int]) -> None:
    """Raise a clear error for a malformed fixed selection (before any model is seen)."""
    for item in [select] if isinstance(select, (str, int)) else list(select):
        _check_item(item)


def tensor_layers(model: nn.Module) -> list[Layer]:
    """One unit per trainable parameter tensor (clean names): what Auto-RGN and the eb-criterion
    score and scale."""
    units, seen = [], set()
    for raw, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        name = clean_name(raw)
        units.append(Layer(name=name, kind="tensor", module=None, params={name: p}, role="tensor"))
    if not units:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to measure")
    return units
