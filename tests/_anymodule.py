"""Five LightningModules written the way users write them, with no glue for this package: no
``split_batch``, no ``loss(output, target)``, no ``blocks=``, no ``example_input_array``
(module level, so ddp_spawn could pickle them; shared by ``tests/test_any_module.py`` and
``benchmarks/any_module.py``).

* :class:`HFCausalLM` -- a tiny ``LlamaForCausalLM``; batches are dicts ``{input_ids,
  attention_mask, labels}``; ``training_step`` returns ``self.model(**batch).loss``; AdamW; no
  ``forward`` of its own.
* :class:`HFClassifier` -- a tiny ``BertForSequenceClassification``, the same dict batches with
  class labels.
* :class:`TimmClassifier` -- a timm ResNet (``test_resnet``, timm's own tiny ResNet: the same
  class and initialisation as ``resnet18``, zero-initialised last BatchNorm of every residual
  branch included), ``(x, y)`` batches, ``F.cross_entropy(self(x), y)``.
* :class:`AttrCNN` -- conv/BatchNorm pairs ``c1, b1, c2, b2`` and Linear ``f1, f2, f3`` as
  attributes, run in that order by ``forward``: no Sequential, no repeated block names.
* :class:`SeqMLP` -- a plain ``nn.Sequential`` MLP.

Each ``training_step`` logs its loss (``train_loss``, step and epoch) as users do.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


class DictData(Dataset):
    """Token sequences as dicts: ``input_ids``, ``attention_mask`` (the last tokens of some
    samples padded) and ``labels`` (token ids for an LM, with -100 on padding; a class for a
    classifier)."""

    def __init__(self, n: int = 16, length: int = 16, vocab: int = 64, classes: int | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(4, vocab, (n, length), generator=g)
        self.mask = torch.ones(n, length, dtype=torch.long)
        self.mask[1::3, -3:] = 0  # right padding on every third sample
        self.ids[self.mask == 0] = 0
        if classes is None:
            self.labels = self.ids.masked_fill(self.mask == 0, -100)
        else:
            self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class _Module(pl.LightningModule):
    lr = 1e-3
    batch_size = 4

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(self.data(), batch_size=self.batch_size)


class HFCausalLM(_Module):
    def __init__(self, layers: int = 4, hidden: int = 64, vocab: int = 64, tied: bool = False, length: int = 16):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=64, tie_word_embeddings=tied, pad_token_id=0)
        self.model = LlamaForCausalLM(cfg)
        self.vocab, self.length = vocab, length

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def data(self):
        return DictData(vocab=self.vocab, length=self.length)


class HFClassifier(_Module):
    def __init__(self, layers: int = 3, hidden: int = 64, vocab: int = 64, classes: int = 3):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                         intermediate_size=2 * hidden, max_position_embeddings=32, num_labels=classes)
        self.model = BertForSequenceClassification(cfg)
        self.vocab, self.classes = vocab, classes

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def data(self):
        return DictData(vocab=self.vocab, classes=self.classes)


class _Images(_Module):
    channels, size, classes = 3, 16, 10

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def data(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(16, self.channels, self.size, self.size, generator=g),
                             torch.randint(0, self.classes, (16,), generator=g))


class TimmClassifier(_Images):
    def __init__(self, name: str = "test_resnet"):
        super().__init__()
        import timm

        torch.manual_seed(0)
        self.net = timm.create_model(name, num_classes=self.classes)


class AttrCNN(_Images):
    """The issue's CNN: ``c1, b1, c2, b2`` conv/BatchNorm pairs, then ``f1, f2, f3`` Linear."""

    channels, size, classes = 1, 8, 4

    def __init__(self, width: int = 8, hidden: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(1, width, 3, padding=1)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.b2 = nn.BatchNorm2d(2 * width)
        self.f1 = nn.Linear(2 * width * (self.size // 2) ** 2, hidden)
        self.f2 = nn.Linear(hidden, hidden)
        self.f3 = nn.Linear(hidden, self.classes)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        x = F.relu(self.f1(x.flatten(1)))
        x = F.relu(self.f2(x))
        return self.f3(x)


class SeqMLP(_Images):
    """``net = Sequential(Linear, ReLU, ...)``: five Linear layers."""

    channels, size, classes = 1, 4, 4

    def __init__(self, width: int = 64):
        super().__init__()
        torch.manual_seed(0)
        d = self.channels * self.size * self.size
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(d, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, self.classes))


MODULES = {"hf_causal_lm": HFCausalLM, "hf_classifier": HFClassifier, "timm": TimmClassifier, "attr_cnn": AttrCNN,
           "seq_mlp": SeqMLP}


def callbacks():
    """Every callback of the package with its defaults (name -> a zero-argument factory)."""
    from lalr_lightning.callbacks import (
        AutoRGN,
        BlockSchedule,
        HTSRPruning,
        LALRScheduleCallback,
        LMSAStepper,
        NTKDiagnostics,
        NTKSelect,
        ProximalRegularizer,
        SpectrumSelect,
        SurgicalBlocks,
        TempBalanceCallback,
    )

    return {
        "TempBalance": TempBalanceCallback,
        "LALR": LALRScheduleCallback,
        "SurgicalBlocks": SurgicalBlocks,
        "LISA": lambda: BlockSchedule(schedule="lisa", every_n_steps=2),
        "LIFT": lambda: BlockSchedule(schedule="lift", every_n_steps=2),
        "Spectrum": SpectrumSelect,
        "HTSRPruning magnitude": HTSRPruning,
        "HTSRPruning wanda": lambda: HTSRPruning(criterion="wanda"),
        "HTSRPruning sparsegpt": lambda: HTSRPruning(criterion="sparsegpt"),
        "AutoRGN": AutoRGN,
        "ProximalRegularizer": lambda: ProximalRegularizer(lam=1.0),
        "NTKDiagnostics": NTKDiagnostics,
        "NTKSelect": NTKSelect,
        "LMSAStepper": LMSAStepper,
    }
