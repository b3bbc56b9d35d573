"""Causal LMs of every family, tied and untied: the output layer is the head, never a block
matrix, so TempBalance balances and AlphaPruning prunes the last block's matrices."""

from __future__ import annotations

import pytest

from lalr_lightning.callbacks import HTSRPruning, TempBalanceCallback
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.pruning.alphapruning import prunable_layers
from lalr_lightning.core.spectral.tempbalance import eligible_layers
from tests._lm import FAMILIES, lm_module, tiny_lm

pytest.importorskip("transformers")

# the last block's matrices, by family (2 blocks: index 1)
LAST_BLOCK = {
    "gpt2": ("transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj", "transformer.h.1.mlp.c_fc",
             "transformer.h.1.mlp.c_proj"),
    "opt": ("model.decoder.layers.1.self_attn.q_proj", "model.decoder.layers.1.fc1", "model.decoder.layers.1.fc2"),
    "llama": ("model.layers.1.self_attn.q_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_last_block_is_balanced_and_pruned_and_the_head_is_not(family, tied):
    model = tiny_lm(family, tied, hidden=64)
    names = [layer.name for layer in matrix_layers(model)]
    assert ("lm_head" in names) != tied  # a tied head shares the embedding's weight
    kinds = ("linear", "hf_conv1d")
    balanced, left_out = eligible_layers(model, kinds, min_evals=2)
    pruned, dense = prunable_layers(model, layer_types=kinds, min_numel=1, min_evals=2)
    for name in LAST_BLOCK[family]:
        assert name in [la.name for la in balanced], (name, left_out)
        assert name in [la.name for la in pruned], (name, dense)
    if tied:  # the head is the embedding, which neither touches: nothing else stands in for it
        assert "last layer (the model's output)" not in left_out.values()
        assert not any("head" in reason for reason in dense.values())
    else:
        assert left_out["lm_head"] == "last layer (the model's output)"
        assert dense["lm_head"] == "classifier head (head=False)"
    with_embeddings, _ = prunable_layers(model, layer_types=(*kinds, "embedding"), min_numel=1, min_evals=2)
    embedding = next(la.name for la in matrix_layers(model) if la.kind == "embedding")
    assert (embedding in [la.name for la in with_embeddings]) != tied  # tied: the embedding IS the head


@pytest.mark.parametrize("family", FAMILIES)
def test_callbacks_act_on_the_last_block_of_a_tied_model(family):
    tb = TempBalanceCallback(min_evals=2, layer_types=("linear", "hf_conv1d"))
    pruner = HTSRPruning(target_sparsity=0.3, min_numel=1, min_evals=2, layer_types=("linear", "hf_conv1d"))
    from tests._toys import make_trainer

    make_trainer([tb, pruner], max_steps=2).fit(lm_module(family, True, lr=1e-3, length=12, hidden=64))
    last = f"model.{LAST_BLOCK[family][-1]}"
    assert last in tb.multipliers and last in pruner.ratios and pruner.sparsity[last] > 0.1
