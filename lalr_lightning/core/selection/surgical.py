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
from lalr_lightning.core.model.layers import Layer, clean_name, matrix_layers
from lalr_lightning.core.runtime.checks import lora_zero

__all__ = [
    "CRITERIA",
    "LIFT_ORDERS",
    "relative_grad_norms",
    "eb_scores",
    "batch_scores",
    "gradient_stat",
    "sharded_scores",
    "rgn_multipliers",
    "eb_multipliers",
    "criterion_multipliers",
    "excluded",
    "measured_units",
    "with_excluded",
    "zero_scales",
    "weight_tensors",
    "check_selection",
    "select_blocks",
    "lift_block",
    "lisa_sample",
    "scheduled_blocks",
    "lisa_warnings",
    "tensor_layers",
]

LIFT_ORDERS = ("front_to_end", "end_to_front", "random")
#: Auto-RGN's relative gradient norm, the eb-criterion's signal-to-noise score
CRITERIA = ("rgn", "eb")


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


def batch_scores(criterion: str, grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One batch's score per tensor under ``criterion`` (:data:`CRITERIA`)."""
    return relative_grad_norms(grads, params) if criterion == "rgn" else eb_scores(grads)


def gradient_stat(criterion: str, g: torch.Tensor) -> tuple[float, float]:
    """``(||g||, the eb score of g)`` of one tensor's gradient (the score 0 under ``rgn``)."""
    score = float(eb_scores([g])[0]) if criterion == "eb" else 0.0
    return torch.linalg.vector_norm(g.detach().double()).item(), score


def sharded_scores(criterion: str, stats: Mapping[str, tuple[float, float]], names: Sequence[str],
                   weight_norms: Sequence[float]) -> torch.Tensor:
    """One batch's scores (float64, in ``names`` order) from :func:`gradient_stat` of each tensor's
    whole gradient (a tensor without one: 0) and ``||theta||`` per tensor: as :func:`batch_scores`
    (``inf`` where ``||theta|| = 0``)."""
    if criterion == "eb":
        return torch.tensor([stats[n][1] if n in stats else 0.0 for n in names], dtype=torch.float64)
    return torch.tensor([(stats[n][0] if n in stats else 0.0) / pn if pn > 0 else math.inf
                         for n, pn in zip(names, weight_norms)], dtype=torch.float64)


def rgn_multipliers(rgn: Mapping[str, float]) -> dict[str, float]:
    """RGN divided by its maximum over tensors; a tensor with infinite RGN (zero weight norm)
    gets 1 and is left out of the maximum. When every finite RGN is 0 and some tensor's is infinite
    (LoRA before its first step: ``lora_B`` is zero, so ``lora_A`` gets no gradient), each finite RGN
    over the infinite maximum is 0: the zero tensors train and the others wait for a gradient."""
    finite = [v for v in rgn.values() if math.isfinite(v)]
    top = max(finite) if finite else 0.0
    if finite and top <= 0.0:
        if len(finite) == len(rgn):
            raise RuntimeError(
                "every measured gradient is zero, so relative gradient norms cannot rank the tensors; "
                "check that the loss depends on the parameters (and that they require grad)"
            )
        return {k: (0.0 if math.isfinite(v) else 1.0) for k, v in rgn.items()}
    return {k: (1.0 if not math.isfinite(v) else v / top) for k, v in rgn.items()}


def excluded(name: str, exclude: Sequence[str]) -> bool:
    """Whether a tensor name contains one of the ``exclude`` substrings (the reference's rule)."""
    return any(s in name for s in exclude)


def measured_units(criterion: str, loader: Any, units: Sequence[Layer], exclude: Sequence[str]) -> list[Layer]:
    """The tensor ``units`` a ``criterion`` measurement runs on (those not :func:`excluded`), after
    checking it has one training ``loader`` to run on; a one-line ValueError otherwise."""
    if loader is None or isinstance(loader, (Mapping, list, tuple)):
        raise ValueError(f"{criterion} measures gradients on the training dataloader and needs exactly one; "
                         f"got {type(loader).__name__}")
    out = [u for u in units if not excluded(u.name, exclude)]
    if not out:
        raise ValueError(f"every trainable tensor is excluded by exclude={list(exclude)}; nothing to measure")
    return out


def with_excluded(names: Sequence[str], measured: Mapping[str, float], exclude: Sequence[str],
                  excluded_multiplier: float) -> dict[str, float]:
    """Every tensor's multiplier: ``excluded_multiplier`` for the :func:`excluded` ones, the
    ``measured`` one for the others (1.0 before any measurement)."""
    return {n: excluded_multiplier if excluded(n, exclude) else measured.get(n, 1.0) for n in names}


def zero_scales(units: Sequence[Layer]) -> list[str]:
    """The tensor units that are norm-layer scales at zero (timm's ``zero_init_last``), and peft
    LoRA ``lora_B`` matrices at zero (a fresh adapter): they block the gradient of what feeds them
    (:func:`zero_gradient_warning` names them)."""
    # an empty tensor is no scale: a placeholder of a weight ZeRO-3 holds in partitions
    return [u.name for u in units if u.name.endswith("weight") and all(
        p.numel() > 0 and (p.ndim == 1 or lora_zero([u.name])) and not bool(p.detach().any())
        for p in u.params.values())]


def weight_tensors(model: nn.Module, units: Sequence[Layer], exclude: Sequence[str]) -> list[str]:
    """The names of the conv/linear weight tensors among ``units`` that are not excluded."""
    names = {u.name for u in units}
    return [n for la in matrix_layers(model) for n, p in la.params.items()
            if p is la.weight and n in names and not excluded(n, exclude)]


def zero_gradient_warning(multipliers: Mapping[str, float], scores: Mapping[str, float], weights: Sequence[str],
                          zero_scales: Sequence[str], exclude: Sequence[str]) -> str | None:
    """One line when most weight matrices (``weights``: the tensor names of the conv/linear
    weights) get multiplier 0 because their measured gradient is exactly 0 (score 0), naming the
    cause when it is visible: norm-layer scales that are all zeros (``zero_scales``; timm
    zero-initialises the last BatchNorm of each residual branch), which block the gradient of
    their branch -- for good when the exclusion keeps them at multiplier 0. ``None`` when at most
    half of the weight matrices are affected."""
    dead = [w for w in weights if multipliers.get(w, 1.0) == 0.0 and scores.get(w) == 0.0]
    lora = [n for n in zero_scales if lora_zero([n])]
    if not dead or not lora and 2 * len(dead) <= len(weights):
        return None
    head = (f"AutoRGN: {len(dead)} of {len(weights)} weight matrices get multiplier 0.0 and do not train "
            f"(e.g. {dead[0]}): their measured gradient is exactly 0")
    if lora:  # the method's own outcome on a fresh adapter: said, so that a frozen lora_A is no surprise
        return (f"{head}, because {len(lora)} LoRA B matrices are all zeros (e.g. {lora[0]}; LoRA zero-initialises "
                "B, so A gets no gradient until B has moved); B trains now, so A gets gradients from the next "
                "measurement on")
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


def criterion_multipliers(criterion: str, scores: Mapping[str, float], threshold: float) -> dict[str, float]:
    """The multipliers of ``criterion``'s scores (``threshold``: the eb-criterion's)."""
    return rgn_multipliers(scores) if criterion == "rgn" else eb_multipliers(scores, threshold)


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


def scheduled_blocks(schedule: str, blocks: Sequence[Layer], switch: int, *, order: str = "front_to_end",
                     gamma: int = 2, seed: int = 0) -> set[str]:
    """The names of the blocks ``schedule`` (``lift`` or ``lisa``) trains during switch ``switch``:
    LIFT's one block; LISA's stem and head (the blocks whose role is not ``"block"``) and its draw
    of ``gamma`` middle blocks."""
    if schedule == "lift":
        return {blocks[lift_block(order, switch, len(blocks), seed)].name}
    middle = [b.name for b in blocks if b.role == "block"]
    drawn = {middle[i] for i in lisa_sample(len(middle), gamma, switch, seed)}
    return {b.name for b in blocks if b.role != "block"} | drawn


def lisa_warnings(blocks: Sequence[Layer], gamma: int, output: Layer | None, hint: str) -> list[str]:
    """ValueError for a LISA that cannot sample its middle blocks (the blocks whose role is ``"block"``);
    the warnings for one that cannot switch, or whose middle holds the model's ``output`` layer.
    ``hint``: how to pass other blocks (or empty)."""
    middle = [b.name for b in blocks if b.role == "block"]
    if not middle:
        raise ValueError(f"LISA samples middle blocks, but the blocks {[b.name for b in blocks]} are all stem or "
                         f"head; pass blocks=[...] to define the middle blocks {hint}".rstrip())
    if gamma > len(middle):
        raise ValueError(f"gamma={gamma} is larger than the number of middle blocks ({len(middle)}: "
                         f"{middle}); choose gamma <= {len(middle)}")
    out, more = [], f" ({hint})" if hint else ""
    if gamma == len(middle):
        out.append(f"LISA cannot switch: gamma={gamma} equals the number of middle blocks ({middle}), so every "
                   f"block trains at every step; choose gamma < {len(middle)} or more, smaller blocks{more}")
    if output is not None and output.role == "block":
        out.append(f"LISA: the model's output layer is in the middle block {output.name!r}, which LISA freezes "
                   "whenever it does not sample it; LISA keeps the head (what comes after the last block) always "
                   f"trainable: leave the output layer out of blocks=[...]{more}")
    return out


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
