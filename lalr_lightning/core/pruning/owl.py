"""OWL: outlier-weighted layerwise sparsity (Yin et al., 2023, "Outlier Weighed Layerwise Sparsity
(OWL): A Missing Secret Sauce for Pruning LLMs to High Sparsity", arXiv:2310.05175).

Per decoder block ``l``:

* ``D_l`` (the layerwise outlier distribution): the percentage of the block's Wanda scores
  ``|W_ij| * ||X_j||_2`` -- over every linear layer of the block, taken together -- that exceed
  ``M`` times their mean;
* the ratios: ``D`` mapped linearly onto ``[0, 2 * lambda]`` (``(D - min D) / (max D - min D) *
  2 lambda``), centred, and subtracted from the target: ``S_l = S - (r_l - mean r)``. A block with
  more outliers keeps more weights; the unweighted mean of the ``S_l`` is the target ``S`` and they
  span ``2 lambda``, so each lies within ``[S - 2 lambda, S + 2 lambda]`` and, for a spread
  ``D``, roughly ``[S - lambda, S + lambda]``.

This is the formula of the paper's code (its "before adjustment" / "after adjustment" step) and of
llm-compressor's ``owl_m`` / ``owl_lmbda``; the activations are the dense model's (the blocks are
measured before any is pruned). When every block has the same ``D`` the ratios are uniform (the
reference divides by ``max - min = 0``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

__all__ = ["check_owl", "outlier_share", "owl_ratios", "block_shares", "owl_layer_ratios"]


def check_owl(m: float, lam: float) -> None:
    """One line naming the fix for a bad ``M`` or ``lambda``."""
    if not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
        raise ValueError(f"--owl-m must be a number > 0 (outliers: scores above M x the block's mean), got {m}")
    if not (isinstance(lam, (int, float)) and 0 <= lam < 0.5):
        raise ValueError(f"--owl-lambda must be in [0, 0.5) (the ratios span 2 x lambda around the target), "
                         f"got {lam}")


def outlier_share(scores: Iterable[torch.Tensor], m: float) -> float:
    """``D``: the percentage of the entries of ``scores`` (one block's Wanda score matrices, taken
    together) greater than ``m`` times their mean."""
    scores = list(scores)
    total = sum(s.numel() for s in scores)
    if total == 0:
        raise ValueError("no scores: the block has no linear layers")
    # the mean over every entry, then the count above M x mean, without concatenating the matrices
    mean = sum(float(s.detach().double().sum()) for s in scores) / total
    above = sum(int((s.detach().double() > m * mean).sum()) for s in scores)
    return 100.0 * above / total


def owl_ratios(shares: Sequence[float], sparsity: float, lam: float) -> list[float]:
    """Per-block sparsity ratios from the blocks' outlier shares ``D`` (module docstring)."""
    d = torch.tensor([float(x) for x in shares], dtype=torch.float64)
    if d.numel() == 0:
        raise ValueError("no blocks to give ratios to")
    if not bool(torch.isfinite(d).all()):
        raise ValueError("an outlier share is not finite: the calibration activations or the weights hold NaN/Inf")
    spread = float(d.max() - d.min())
    if spread == 0.0:
        return [float(sparsity)] * d.numel()
    r = (d - d.min()) / spread * (2 * lam)
    out = (float(sparsity) - (r - r.mean())).tolist()
    if min(out) < 0 or max(out) >= 1:
        raise ValueError(f"OWL's ratios leave [0, 1) (from {min(out):.3f} to {max(out):.3f} around the target "
                         f"{sparsity}); lower --owl-lambda")
    return out


def block_shares(blocks, inputs: list, m: float, materialize=None, release=None) -> list[float]:
    """OWL's outlier share ``D`` of every block, measured on the dense model: each block's Wanda scores
    (every linear layer of the block) from its calibration inputs, its output (unpruned) feeding the
    next. ``inputs`` (:func:`~lalr_lightning.core.pruning.calibration.capture_block_inputs`) is consumed."""
    from lalr_lightning.core.pruning.calibration import linear_modules, run_blocks, weight_matrix
    from lalr_lightning.core.pruning.criteria import wanda_scores

    shares: list[float] = []

    def measure(index: int, block: nn.Module, stats) -> None:
        scores = [wanda_scores(weight_matrix(mod), stats[name].scaler_row)
                  for name, mod in linear_modules(block).items()]
        shares.append(outlier_share(scores, m))

    run_blocks(blocks, inputs, measure, stats=True, hessian=False, materialize=materialize, release=release)
    return shares


@torch.no_grad()
def owl_layer_ratios(model: nn.Module, layers: Sequence, batches: Sequence, sparsity: float, m: float,
                     lam: float, who: str = "preset='owl'") -> tuple[dict[str, float], dict[str, float]]:
    """OWL's ratio and outlier share ``D`` of each of ``layers`` (``Layer`` objects of ``model``, a
    Hugging Face causal LM): the shares of every transformer block on the dense model
    (:func:`block_shares`), the per-block ratios by :func:`owl_ratios` -- as ``prune --preset owl`` --
    and each layer given its block's. A layer outside the blocks is an error (it has no block)."""
    from lalr_lightning.core.pruning.by_criterion import find_causal_lm
    from lalr_lightning.core.pruning.calibration import capture_block_inputs, decoder_blocks

    lm = find_causal_lm(model)
    if lm is None:
        raise ValueError(f"{who} measures outliers per transformer block of a Hugging Face causal LM (LLaMA, OPT, "
                         f"GPT-2, GPT-NeoX layouts); {type(model).__name__} has none: use another preset")
    _, blocks = decoder_blocks(lm)
    block_of = {id(mod): i for i, block in enumerate(blocks) for mod in block.modules()}
    outside = [la.name for la in layers if id(la.module) not in block_of]
    if outside:
        raise ValueError(f"{who} gives each transformer block one ratio; these pruned layers lie outside the "
                         f"blocks: {', '.join(outside[:5])}; leave them dense (head=False, or min_numel above "
                         "their size)")
    if not batches:
        raise ValueError(f"{who} needs calibration batches; none were given")
    modes = {mod: mod.training for mod in model.modules()}
    model.eval()
    try:
        shares = block_shares(blocks, capture_block_inputs(lm, batches), m)
    finally:
        for mod, training in modes.items():
            mod.training = training
    try:
        per_block = owl_ratios(shares, sparsity, lam)
    except ValueError as err:  # its fix named as the callback's argument
        raise ValueError(f"{who}: {str(err).replace('--owl-lambda', 'owl_lambda')}") from None
    ratios = {la.name: per_block[block_of[id(la.module)]] for la in layers}
    return ratios, {la.name: shares[block_of[id(la.module)]] for la in layers}
