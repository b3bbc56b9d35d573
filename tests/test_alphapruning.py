"""HTSRPruning(preset="alphapruning") reproduces AlphaPruning's per-layer ratios on LLaMA and OPT
shapes: a hand computation of the recipe (alpha_peak on all eigenvalues -> block mean ->
[1 - eps, 1 + eps] min-max map -> scaled to the target mean), written here from the paper's code
conventions (haiquanlu/AlphaPruning lib/esd_utils.py, lib/prune.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lalr_lightning.callbacks import HTSRPruning
from tests._lm import lm_module
from tests._toys import make_trainer

pytest.importorskip("transformers")


def _alpha_peak(w: torch.Tensor) -> float:
    """AlphaPruning's ``xmin_peak`` fit, one candidate at a time, on every eigenvalue of W^T W."""
    ev = torch.sort(torch.linalg.svdvals(w.detach().double()) ** 2).values
    n_all = ev.numel()
    lx = torch.log10(ev)
    counts = torch.histc(lx, 100, min=float(lx.min()), max=float(lx.max()))
    edges = torch.linspace(float(lx.min()), float(lx.max()), 101, dtype=torch.float64)
    peak = 10 ** float(edges[int(torch.argmax(counts))])
    lo, hi = math.log10(0.95 * peak), 1.5 * peak  # the reference compares eigenvalues with a log: kept
    best_d, best_a = 1.0, 0.0
    for i in range(n_all - 1):
        x = float(ev[i])
        if x < lo:
            continue
        if x > hi:
            break
        n = n_all - i
        a = 1 + n / float(torch.log(ev[i:]).sum() - n * math.log(x))
        if a <= 1:
            continue
        d = float(torch.max(torch.abs(1 - (ev[i:] / x) ** (1 - a) - torch.arange(n) / n)))
        if d < best_d:
            best_d, best_a = d, a
    return best_a


def _blocks(family, model):
    return model.model.decoder.layers if family == "opt" else model.model.layers


def _hand_ratios(family, model, target, eps):
    names, alphas, numels, block_of = [], [], [], []
    for b, block in enumerate(_blocks(family, model)):
        for name, m in block.named_modules():
            if isinstance(m, torch.nn.Linear):
                prefix = "model.decoder.layers" if family == "opt" else "model.layers"
                names.append(f"model.{prefix}.{b}.{name}")
                alphas.append(_alpha_peak(m.weight))
                numels.append(m.weight.numel())
                block_of.append(b)
    alphas, numels, block_of = np.array(alphas), np.array(numels, float), np.array(block_of)
    metric = np.array([alphas[block_of == b].mean() for b in block_of])  # block-wise mapping
    r = (metric - metric.min()) / (metric.max() - metric.min()) * (2 * eps) + (1 - eps)
    ratios = r * numels.sum() * target / (numels * r).sum()
    return dict(zip(names, ratios)), dict(zip(names, alphas))


class _LM:
    @staticmethod
    def module(family, tied):
        return lm_module(family, tied, lr=0.0, samples=4, hidden=64, layers=4)


@pytest.mark.parametrize("family, tied", [("llama", False), ("opt", True)])
def test_alphapruning_preset_equals_a_hand_computation_of_the_recipe(family, tied):
    module = _LM.module(family, tied)
    expected, alphas = _hand_ratios(family, module.model, 0.5, 0.3)
    pruner = HTSRPruning(preset="alphapruning", target_sparsity=0.5)
    assert (pruner.fit, pruner.filter_zeros, pruner.block_average, pruner.epsilon) == ("peak", False, True, 0.3)
    make_trainer([pruner], max_steps=1).fit(module)
    assert list(pruner.ratios) == list(expected)  # every block matrix, in order; no head, no embedding
    np.testing.assert_allclose([pruner.ratios[k] for k in expected], list(expected.values()), rtol=1e-6)
    assert len(set(np.round(list(expected.values()), 9))) == 4  # one ratio per block, and they differ
    for name, ratio in expected.items():  # magnitude pruning at that ratio (ours rounds the count)
        w = module.get_submodule(name).weight
        assert int((w == 0).sum()) == round(ratio * w.numel())
    # the block means were made from alpha_peak of every eigenvalue, not from a filtered or ks fit
    unfiltered = HTSRPruning(metric="alpha", fit="peak", filter_zeros=False, target_sparsity=0.5, min_numel=1,
                             min_evals=3)
    assert unfiltered.settings()["filter_zeros"] is False and pruner.settings()["preset"] == "alphapruning"
    assert min(alphas.values()) > 1


def test_filter_zeros_only_goes_with_fitted_metrics_and_presets_are_checked():
    with pytest.raises(ValueError, match="filter_zeros"):
        HTSRPruning(metric="stable_rank", filter_zeros=False)
    with pytest.raises(ValueError, match="unknown preset"):
        HTSRPruning(preset="alpha_pruning")
    explicit = HTSRPruning(preset="alphapruning", epsilon=0.2, block_average=False)  # given arguments win
    assert (explicit.epsilon, explicit.block_average, explicit.fit) == (0.2, False, "peak")
    assert HTSRPruning().filter_zeros and HTSRPruning().fit == "ks"
