"""core/model/layers.py: which layers a model has, what each owns, and what they are called."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

from lalr_lightning.core.model.blocks import block_layers, find_layers
from lalr_lightning.core.model.layers import clean_name, matrix_layers


def test_clean_name_drops_wrappers_only():
    assert clean_name("_orig_mod.layer1.0.conv1") == "layer1.0.conv1"
    assert clean_name("module._forward_module.net.0") == "net.0"
    assert clean_name("_fsdp_wrapped_module.blocks.3._fsdp_wrapped_module.attn") == "blocks.3.attn"
    assert clean_name("net.module.fc") == "net.module.fc"  # a user's own submodule called "module"


def test_matrix_layers_of_resnet18_with_bn_tie():
    m = torchvision.models.resnet18()
    layers = matrix_layers(m)
    assert [layer.name for layer in layers][:3] == ["conv1", "layer1.0.conv1", "layer1.0.conv2"]
    assert layers[-1].name == "fc" and layers[-1].kind == "linear"
    by = {layer.name: layer for layer in layers}
    assert set(by["conv1"].params) == {"conv1.weight", "bn1.weight", "bn1.bias"}
    # Sequential(conv, bn): the BN at index 1 follows the conv at index 0
    assert set(by["layer2.0.downsample.0"].params) == {
        "layer2.0.downsample.0.weight", "layer2.0.downsample.1.weight", "layer2.0.downsample.1.bias"}
    # every parameter belongs to exactly one layer
    owned = [id(p) for layer in layers for p in layer.params.values()]
    assert len(owned) == len(set(owned)) == len(list(m.parameters()))


def test_kinds_and_tied_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.c1 = nn.Conv1d(8, 8, 3)
            self.hf = Conv1D(16, 8)
            self.out = nn.Linear(8, 50, bias=False)
            self.out.weight = self.emb.weight  # tied

    layers = matrix_layers(M())
    assert [(layer.name, layer.kind) for layer in layers] == [
        ("emb", "embedding"), ("c1", "conv1d"), ("hf", "hf_conv1d")]
    del transformers


def test_a_tied_modules_own_bias_joins_the_layer_that_holds_its_weight():
    """A tied decoder with a bias (BERT's masked-LM head): the bias is in the layer of the shared
    matrix, so a multiplier scales it and a selection freezes it with that matrix."""
    net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 10))
    net[2].weight = net[0].weight
    layers = {la.name: la for la in matrix_layers(net)}
    assert list(layers) == ["0", "1"] and list(layers["0"].params) == ["0.weight", "2.bias"]
    assert {id(p) for la in layers.values() for p in la.params.values()} == {id(p) for p in net.parameters()}


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_a_parametrized_weight_brings_the_tensors_it_is_computed_from(kind):
    """torch.nn.utils.parametrize: the layer's weight is computed from ``parametrizations.weight.*``,
    so those are the layer's parameters (what a multiplier scales and a selection freezes)."""
    net = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    getattr(nn.utils.parametrizations, kind)(net[0])
    layers = {la.name: la for la in matrix_layers(net)}
    owned = {id(p) for la in layers.values() for p in la.params.values()}
    assert owned == {id(p) for p in net.parameters()}  # every parameter in a layer, none twice
    assert set(layers["0"].params) == {"0.bias", *(f"0.parametrizations.{n}" for n, _ in net[0].parametrizations.named_parameters())}
    assert layers["0"].weight.shape == (6, 6)


def test_names_are_the_same_under_compile_and_ddp_style_wrappers():
    m = torchvision.models.resnet18()
    plain = [layer.name for layer in matrix_layers(m)]
    compiled = torch.compile(m)  # OptimizedModule: parameters under _orig_mod. (compiles lazily)
    assert [layer.name for layer in matrix_layers(compiled)] == plain

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert [layer.name for layer in matrix_layers(Wrapper(m))] == plain
    assert [b.name for b in block_layers(Wrapper(m))] == [b.name for b in block_layers(m)]


def test_blocks_of_timm_and_torchvision_resnets():
    names = ["conv1+bn1+layer1", "layer2", "layer3", "layer4", "fc"]
    assert [b.name for b in block_layers(timm.create_model("resnet18"))] == names
    assert [b.name for b in block_layers(torchvision.models.resnet18())] == names
    split = block_layers(torchvision.models.resnet18(), join_stem=False)
    assert [b.role for b in split] == ["stem", "block", "block", "block", "block", "head"]
    assert split[0].name == "conv1+bn1"


def test_blocks_of_vit_come_from_group_matcher():
    blocks = block_layers(timm.create_model("vit_tiny_patch16_224"))
    assert len(blocks) == 13  # 12 transformer blocks (stem joined to the first) + head
    assert blocks[0].name == "cls_token+pos_embed+patch_embed+blocks.0"
    assert blocks[5].name == "blocks.5" and blocks[-1].name == "head" and blocks[-1].role == "head"


def test_user_patterns_and_errors():
    m = torchvision.models.resnet18()
    blocks = block_layers(m, blocks=["layer1", ["layer2", "layer3"], "^layer4\\.1\\."])
    assert [b.name for b in blocks] == ["conv1+bn1+layer1", "layer2+layer3", "layer4.1", "layer4.0+fc"]
    with pytest.raises(ValueError, match="matches no parameter"):
        block_layers(m, blocks=["nope"])
    with pytest.raises(ValueError, match="blocks="):
        block_layers(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="valid: 'matrix', 'block'"):
        find_layers(m, "tensor")


@pytest.mark.parametrize("family,head", [("llama", "model.norm+lm_head"), ("gpt2", "transformer.ln_f+lm_head"),
                                         ("opt", "model.decoder.final_layer_norm+lm_head")])
def test_causal_lm_blocks_end_with_the_final_norm_in_the_head(family, head):
    """OPT registers ``final_layer_norm`` before its layers, but it runs after them: it is part
    of the head (with the untied output layer), never of the stem joined to the first block."""
    from tests._lm import tiny_lm

    blocks = block_layers(tiny_lm(family, tied=False))
    assert blocks[-1].name == head and blocks[-1].role == "head"
    # (each OPT layer has its own final_layer_norm too: those stay in their layer)
    assert not any(n.startswith(("model.decoder.final_layer_norm", "model.norm", "transformer.ln_f"))
                   for b in blocks[:-1] for n in b.params)
    assert [b.role for b in blocks] == ["block", "block", "head"]


# ----------------------------------------------------------------------------- today's blocks, pinned

def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=32))


def _pinned_models():
    from lalr_lightning.models import SmallCNN, SmallResNet
    from tests._lm import tiny_lm
    from tests.test_plain_models import PlainCNN, PlainMLP

    yield "timm test_resnet", lambda: timm.create_model("test_resnet"), [
        ("conv1+bn1+layer1", "block", 15), ("layer2", "block", 9), ("layer3", "block", 12), ("layer4", "block", 9),
        ("fc", "head", 2)]
    yield "torchvision resnet18", torchvision.models.resnet18, [
        ("conv1+bn1+layer1", "block", 15), ("layer2", "block", 15), ("layer3", "block", 15), ("layer4", "block", 15),
        ("fc", "head", 2)]
    yield "timm test_vit", lambda: timm.create_model("test_vit"), [
        ("cls_token+pos_embed+patch_embed+blocks.0", "block", 16)] + [(f"blocks.{i}", "block", 12) for i in (1, 2, 3, 4)] \
        + [("blocks.5+norm", "block", 14), ("head", "head", 2)]
    yield "bert", _bert, [("bert.embeddings+bert.encoder.layer.0", "block", 21), ("bert.encoder.layer.1", "block", 16),
                          ("bert.pooler+classifier", "head", 4)]
    heads = {"gpt2": ("transformer.ln_f", 2), "opt": ("model.decoder.final_layer_norm", 2), "llama": ("model.norm", 1)}
    firsts = {"gpt2": ("transformer.wte+transformer.wpe+transformer.h.0", 14, "transformer.h.1", 12),
              "opt": ("model.decoder.embed_tokens+model.decoder.embed_positions+model.decoder.layers.0", 18,
                      "model.decoder.layers.1", 16),
              "llama": ("model.embed_tokens+model.layers.0", 10, "model.layers.1", 9)}
    for family in ("gpt2", "opt", "llama"):
        for tied in (True, False):
            first, n0, second, n1 = firsts[family]
            head, nh = heads[family]
            want = [(first, "block", n0), (second, "block", n1),
                    (head if tied else head + "+lm_head", "head", nh + (0 if tied else 1))]
            yield f"{family} tied={tied}", (lambda f=family, t=tied: tiny_lm(f, t)), want
    yield "Sequential MLP", PlainMLP, [("trunk.0+trunk.2", "block", 4), ("trunk.4", "block", 2),
                                       ("trunk.6", "block", 2), ("classifier", "head", 2)]
    yield "Sequential CNN", PlainCNN, [("features.0+features.1+features.3+features.4", "block", 6),
                                       ("features.6+features.7", "block", 3), ("features.9+features.10", "block", 3),
                                       ("head", "head", 2)]
    yield "SmallCNN", lambda: SmallCNN(width=8, in_channels=1), [
        (f"model.layer{i}", "block", 3) for i in (1, 2, 3, 4)] + [("model.fc", "head", 2)]
    yield "SmallResNet", lambda: SmallResNet(width=4, blocks_per_group=1, in_channels=1), [
        ("model.conv1+model.bn1+model.layer1", "block", 9), ("model.layer2", "block", 9), ("model.layer3", "block", 9),
        ("model.fc", "head", 2)]


@pytest.mark.parametrize("label,build,want", list(_pinned_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_blocks_of_every_family_that_worked_stay_as_they_were(label, build, want):
    """Pinned before blocks could come from a forward pass: the models whose blocks come from a
    registry, repeated children or a Sequential trunk keep exactly these blocks."""
    blocks = block_layers(build())
    assert [(b.name, b.role, len(b.params)) for b in blocks] == want, label
