"""output_layer(): the model's output layer, tied to the input embedding or not, never a block matrix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lalr_lightning.core.model.blocks import block_layers, output_layer
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.models.cnn import SmallCNN

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

from _lm import FAMILIES, tiny_config, tiny_lm  # noqa: E402

EMBEDDING = {"gpt2": "transformer.wte", "opt": "model.decoder.embed_tokens", "llama": "model.embed_tokens"}
# the last matrix of the last block: what "the last matrix layer" is when lm_head is tied (and so
# dropped by matrix_layers), i.e. what a head rule must never pick
LAST_BLOCK_MATRIX = {"gpt2": "transformer.h.1.mlp.c_proj", "opt": "model.decoder.layers.1.fc2",
                     "llama": "model.layers.1.mlp.down_proj"}
CASES = [(f, t) for f in FAMILIES for t in (True, False)]


class Wrapper(pl.LightningModule):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.model = net


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_output_layer_tied_and_untied(family, tied):
    model = tiny_lm(family, tied)
    layers = matrix_layers(model)
    head = output_layer(model, layers)
    assert head is not None and head.weight is model.lm_head.weight
    if tied:
        # lm_head shares the embedding's matrix, which matrix_layers keeps once, under the embedding
        assert head.name == EMBEDDING[family] and head.kind == "embedding"
        assert layers[-1].name == LAST_BLOCK_MATRIX[family]  # the naive "last layer" is a block matrix
    else:
        assert head.name == "lm_head" and head is layers[-1]
    assert output_layer(model) is not None and output_layer(model).name == head.name  # default layers


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_output_layer_inside_a_lightning_module(family, tied):
    module = Wrapper(tiny_lm(family, tied))
    head = output_layer(module)
    assert head.name == ("model." + EMBEDDING[family] if tied else "model.lm_head")
    assert head.weight is module.model.lm_head.weight
    # block granularity: the Layer holding the output weight is the stem (tied) or the head block
    blocks = block_layers(module, join_stem=False)
    owner = output_layer(module, blocks)
    assert owner.role == ("stem" if tied else "head")
    assert any(p is module.model.lm_head.weight for p in owner.params.values())


@pytest.mark.parametrize("family,tied", CASES)
def test_hf_output_layer_under_peft_lora(family, tied):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=2)
    model = peft.get_peft_model(tiny_lm(family, tied), config)
    prefix = "base_model.model."
    head = output_layer(model)
    assert head.name == prefix + (EMBEDDING[family] if tied else "lm_head")
    assert head.weight is model.get_output_embeddings().weight
    # LoRA freezes the head: among the trainable layers alone there is no output layer
    trainable = matrix_layers(model, include_frozen=False)
    assert trainable and all(".lora_" in la.name for la in trainable)
    assert output_layer(model, trainable) is None
    # wrapped once more, in a LightningModule
    assert output_layer(Wrapper(model)).name == "model." + head.name


def test_hf_base_model_without_head_has_none():
    """A bare decoder (AutoModel: LlamaModel) has no output layer; its last matrix is a block's."""
    from transformers import AutoModel

    model = AutoModel.from_config(tiny_config("llama", False))
    assert matrix_layers(model)[-1].name == "layers.1.mlp.down_proj"
    assert output_layer(model) is None


def test_hf_sequence_classifier_head():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     num_labels=3)
    model = BertForSequenceClassification(cfg)
    assert output_layer(model).name == "classifier"


def test_plain_sequential_head_is_last_linear():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    assert output_layer(net).name == "4"
    assert output_layer(Wrapper(net)).name == "model.4"


class HandTied(nn.Module):
    """A non-HF LM whose head reuses the embedding matrix: the fallback must still find it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)) for _ in range(3))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def test_hand_tied_head_maps_to_the_embedding_and_headless_backbone_to_none():
    model = HandTied()
    layers = matrix_layers(model)
    assert layers[-1].name == "blocks.2.2"
    assert output_layer(model, layers).name == "embed"
    del model.head  # a backbone: the last matrix is inside a repeated block, so no head
    assert output_layer(model) is None


def test_timm_resnet_head_is_fc():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    layers = matrix_layers(model)
    assert output_layer(model, layers).name == "fc" and output_layer(model, layers) is layers[-1]
    assert output_layer(Wrapper(model)).name == "model.fc"
    # without a classifier (num_classes=0: fc is Identity) the last conv is a block's: no head
    assert output_layer(timm.create_model("resnet18", pretrained=False, num_classes=0)) is None


def test_small_cnn_head_is_fc():
    module = SmallCNN(width=8)
    assert output_layer(module).name == "model.fc"
    assert output_layer(module, matrix_layers(module, include_frozen=False)).name == "model.fc"
