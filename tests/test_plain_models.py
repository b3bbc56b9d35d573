"""A user's own model, with no transformer or ResNet naming: a ``Sequential`` MLP trunk + a
``classifier`` (AdamW + StepLR), a small Conv/BN/ReLU ``Sequential`` CNN + a linear head, and an
MLP of named attributes (``fc1 .. fc4``, ``out``). The block callbacks find their blocks (or
give a one-line hint that works when pasted), LISA switches the middle blocks and always trains
the stem and the head, Spectrum trains more than the head (or says why not), and a schedule that
cannot switch warns."""

from __future__ import annotations

import ast
import warnings
from collections import OrderedDict

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import BlockSchedule, LMSAStepper, SpectrumSelect, SurgicalBlocks
from lalr_lightning.core.model.blocks import block_layers, output_layer, suggest_blocks
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.spectral.spectrum_snr import module_type
from tests._toys import make_data, make_trainer


class Classifier(pl.LightningModule):
    """Cross-entropy on fixed random data; AdamW + StepLR, as a user would write it."""

    d = 8

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    def training_step(self, batch, _):
        x, y = batch
        return self.loss(self(x), y)

    def train_dataloader(self):
        return DataLoader(self.data(), batch_size=8)

    def data(self):
        return make_data(48, self.d, 3)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class PlainMLP(Classifier):
    """The issue's model: ``trunk = Sequential(Linear, ReLU, Linear, ReLU, Linear, ReLU, Linear)``, ``classifier``."""

    def __init__(self, w: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(self.d, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w),
                                   nn.ReLU(), nn.Linear(w, w))
        self.classifier = nn.Linear(w, 3)

    def forward(self, x):
        return self.classifier(torch.relu(self.trunk(x)))


class PlainCNN(Classifier):
    """``features = Sequential(Conv, BN, ReLU) x 4 + pool``, ``head = Linear``."""

    def __init__(self, extra_fc: bool = False):
        super().__init__()
        torch.manual_seed(0)
        layers = []
        for cin, cout in ((1, 8), (8, 8), (8, 16), (16, 16)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, 16) if extra_fc else nn.Identity()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.fc(self.features(x)))

    def data(self):
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(48, 1, 6, 6, generator=g), torch.randint(0, 3, (48,), generator=g))


class NamedMLP(Classifier):
    """No Sequential: ``fc1 .. fc4`` and ``out`` attributes, used in that order."""

    def __init__(self, w: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3, self.fc4 = (nn.Linear(self.d, w), nn.Linear(w, w), nn.Linear(w, w),
                                                  nn.Linear(w, w))
        self.out = nn.Linear(w, 3)

    def forward(self, x):
        for fc in (self.fc1, self.fc2, self.fc3, self.fc4):
            x = torch.relu(fc(x))
        return self.out(x)


def _roles(model, **kw):
    return [(b.name, b.role) for b in block_layers(model, **kw)]


# ----------------------------------------------------------------------------- finding blocks


def test_blocks_of_a_plain_mlp_trunk_and_a_plain_cnn():
    mlp = PlainMLP()
    assert _roles(mlp, join_stem=False) == [("trunk.0", "stem"), ("trunk.2", "block"), ("trunk.4", "block"),
                                            ("trunk.6", "block"), ("classifier", "head")]
    assert _roles(mlp) == [("trunk.0+trunk.2", "block"), ("trunk.4", "block"), ("trunk.6", "block"),
                           ("classifier", "head")]
    assert output_layer(mlp).name == "classifier"
    cnn = PlainCNN()
    blocks = block_layers(cnn, join_stem=False)
    assert [(b.name, b.role) for b in blocks] == [
        ("features.0+features.1", "stem"), ("features.3+features.4", "block"), ("features.6+features.7", "block"),
        ("features.9+features.10", "block"), ("head", "head")]
    # each conv block owns its conv and the BatchNorm after it
    assert set(blocks[1].params) == {"features.3.weight", "features.4.weight", "features.4.bias"}
    owned = [id(p) for b in blocks for p in b.params.values()]
    assert len(owned) == len(set(owned)) == len(list(cnn.parameters()))
    # the patterns suggest_blocks gives rebuild the same blocks
    for model in (mlp, cnn):
        hint = suggest_blocks(model)
        assert _roles(model, blocks=hint, join_stem=False) == _roles(model, join_stem=False)
    assert suggest_blocks(mlp) == ["trunk.2", "trunk.4", "trunk.6"]
    assert suggest_blocks(cnn)[0] == ["features.3", "features.4"]


def test_where_a_plain_trunk_starts_and_ends():
    # a bare Sequential ending in its output layer: first layer stem, last layer head (the
    # output layer stays the head, as TempBalance and AlphaPruning read it)
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                        nn.Linear(8, 2))
    assert _roles(seq, join_stem=False) == [("0", "stem"), ("2", "block"), ("4", "block"), ("6", "head")]
    assert output_layer(seq).name == "6"

    class EmbedTrunk(nn.Module):  # something before the trunk: it is the stem, the trunk's first layer a block
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.trunk = nn.Sequential(OrderedDict(fc1=nn.Linear(8, 8), act=nn.GELU(), fc2=nn.Linear(8, 8),
                                                   norm=nn.LayerNorm(8), fc3=nn.Linear(8, 8)))
            self.out = nn.Linear(8, 10)

    assert _roles(EmbedTrunk(), join_stem=False) == [
        ("emb", "stem"), ("trunk.fc1", "block"), ("trunk.fc2+trunk.norm", "block"), ("trunk.fc3", "block"),
        ("out", "head")]
    # a Sequential of blocks followed by its output layer: no stem, the blocks, the head
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(3)],
                           nn.Linear(8, 2))
    assert _roles(blocks, join_stem=False) == [("0", "block"), ("1", "block"), ("2", "block"), ("3", "head")]
    # too short to have a middle: the clear error, with a hint
    with pytest.raises(ValueError, match=r"blocks=\["):
        block_layers(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))


def test_the_hint_for_a_model_without_a_sequential_is_one_line_and_pasted_makes_lisa_work():
    with pytest.raises(ValueError) as err:
        block_layers(NamedMLP())
    msg = str(err.value)
    assert "\n" not in msg
    hint = ast.literal_eval(msg.rsplit("blocks=", 1)[1])
    assert hint == ["fc2", "fc3", "fc4"]  # the input layer left as the stem, the output layer as the head
    _check_lisa(NamedMLP(), blocks=hint, stem="fc1", head="out", middle=["fc2", "fc3", "fc4"])


# ----------------------------------------------------------------------------- LISA


class Moved(Callback):
    """After the schedule in the callback list: which blocks' parameters moved in each step."""

    def __init__(self, cb):
        self.cb = cb
        self.steps: list[set[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = {n: p.detach().clone() for b in self.cb.layers for n, p in b.params.items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({b.name for b in self.cb.layers
                           if any(not torch.equal(p.detach(), self.before[n]) for n, p in b.params.items())})


def _check_lisa(module, *, stem, head, middle, steps=6, **kw):
    lisa = BlockSchedule("lisa", gamma=1, every_n_steps=1, **kw)
    moved = Moved(lisa)
    make_trainer([lisa, moved], max_steps=steps).fit(module)
    assert lisa.block_names == [stem, *middle, head]
    assert len(moved.steps) == steps
    for step in moved.steps:  # the stem and the head always train, one middle block at a time
        assert stem in step and head in step and len(step & set(middle)) == 1, step
    assert len({b for step in moved.steps for b in step} & set(middle)) >= 2  # it switches


def test_lisa_without_blocks_switches_the_middle_of_a_plain_mlp():
    _check_lisa(PlainMLP(), stem="trunk.0", head="classifier", middle=["trunk.2", "trunk.4", "trunk.6"])


def test_lisa_without_blocks_switches_the_middle_of_a_plain_cnn():
    _check_lisa(PlainCNN(), stem="features.0+features.1", head="head",
                middle=["features.3+features.4", "features.6+features.7", "features.9+features.10"])


# ----------------------------------------------------------------------------- cannot switch


def _configure(cb, module):
    cb.setup(make_trainer([]), module, "fit")
    return cb


def _messages(record) -> str:
    return "\n".join(str(w.message) for w in record)


def test_a_schedule_that_cannot_switch_warns():
    # the hint the issue followed: two blocks, both sampled by gamma=2, the head among them
    with pytest.warns(UserWarning) as record:
        _configure(BlockSchedule("lisa", blocks=["trunk", "classifier"]), PlainMLP())
    text = _messages(record)
    assert "LISA cannot switch: gamma=2 equals the number of middle blocks" in text
    assert "output layer is in the middle block 'classifier'" in text
    assert "blocks=['trunk.2', 'trunk.4', 'trunk.6']" in text  # what to write instead
    with pytest.warns(UserWarning, match="LISA cannot switch: gamma=3"):
        _configure(BlockSchedule("lisa", gamma=3), PlainMLP())
    with pytest.warns(UserWarning, match="num_blocks=4 selects every block"):
        _configure(LMSAStepper(update="optimizer", num_blocks=4), PlainMLP())
    with pytest.warns(UserWarning, match="nothing is frozen"):
        _configure(SurgicalBlocks(select=[0, 1, 2, 3]), PlainMLP())
    # the same callbacks with room to choose: no warning of ours
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _configure(BlockSchedule("lisa", blocks=["trunk.2", "trunk.4", "trunk.6"]), PlainMLP())
        _configure(BlockSchedule("lisa", gamma=2), PlainCNN())
        _configure(LMSAStepper(update="optimizer", num_blocks=1), PlainMLP())
        _configure(SurgicalBlocks(select="first"), PlainCNN())
    assert not any(k in _messages(record) for k in ("cannot", "every block", "output layer", "frozen"))


# ----------------------------------------------------------------------------- Spectrum


def test_spectrum_on_a_plain_mlp_trains_the_top_half_of_the_trunk_by_snr():
    from tests.test_spectrum import _snr

    module = PlainMLP()
    trunk = {f"trunk.{i}": module.trunk[i].weight.detach().clone() for i in (0, 2, 4, 6)}
    spectrum = SpectrumSelect(top_percent=50)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([spectrum], max_steps=1).fit(module)
    assert "SpectrumSelect" not in _messages(record)
    top2 = sorted(trunk, key=lambda n: -_snr(trunk[n]))[:2]  # int(4 * 50 / 100) = 2, by Spectrum's SNR
    assert set(spectrum.selected) == set(top2) | {"classifier"}
    assert {spectrum.module_types[n] for n in trunk} == {"linear (pooled)"}
    assert "linear (pooled): 2 of 4" in spectrum.grouping_summary
    assert "always trained: classifier" in spectrum.grouping_summary


def test_spectrum_with_spectrums_own_grouping_on_a_plain_mlp_warns_that_only_the_head_trains():
    spectrum = SpectrumSelect(top_percent=50, grouping="spectrum")
    with pytest.warns(UserWarning, match=r"selects none of the 4 ranked matrices .* only classifier trains"):
        make_trainer([spectrum], max_steps=1).fit(PlainMLP())
    assert spectrum.selected == ["classifier"]
    assert spectrum.module_types["trunk.2"] == "trunk.2"  # Spectrum's rule: each its own type
    with pytest.raises(ValueError, match="valid: auto, spectrum"):
        SpectrumSelect(grouping="kind")


def test_spectrum_on_a_plain_cnn_and_a_lone_matrix_of_its_kind():
    spectrum = SpectrumSelect(top_percent=50)
    make_trainer([spectrum], max_steps=1).fit(PlainCNN())
    convs = [la.name for la in matrix_layers(PlainCNN()) if la.kind == "conv2d"]
    assert {spectrum.module_types[n] for n in convs} == {"conv2d (pooled)"}
    assert len(set(spectrum.selected) & set(convs)) == 2 and "head" in spectrum.selected
    # one hidden Linear besides the head: alone of its kind, it can never be chosen -- said
    with pytest.warns(UserWarning, match=r"selects no matrix of type\(s\) linear \(pooled\) \(fc\)"):
        _configure(SpectrumSelect(top_percent=50), PlainCNN(extra_fc=True))


class Wrap(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model


def _families():
    from lalr_lightning.models import SmallCNN, SmallResNet
    from tests._lm import tiny_lm

    out = {"plain_mlp": PlainMLP, "plain_cnn": PlainCNN, "small_cnn": lambda: SmallCNN(width=8),
           "small_resnet": lambda: SmallResNet(width=4, blocks_per_group=2)}
    for family in ("gpt2", "opt", "llama"):
        out[family] = lambda family=family: Wrap(tiny_lm(family, family != "llama", hidden=32, layers=2))

    def bert():
        from transformers import BertConfig, BertForSequenceClassification

        return Wrap(BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            num_labels=3)))

    out["bert"] = bert
    return out


@pytest.mark.parametrize("family", list(_families()))
def test_spectrum_trains_more_than_the_head_on_every_family_or_warns(family):
    pytest.importorskip("transformers")
    module = _families()[family]()
    spectrum = SpectrumSelect(top_percent=50)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _configure(spectrum, module)
    ranked = {n: t for n, t in spectrum.module_types.items() if n not in spectrum._always}
    by_type: dict[str, list[str]] = {}
    for n, t in ranked.items():
        by_type.setdefault(t, []).append(n)
    assert sum(int(len(ns) * 50 / 100) for ns in by_type.values()) > 0  # more than the head trains
    lone = [t for t, ns in by_type.items() if len(ns) == 1]
    assert bool(lone) == ("selects no matrix of type" in _messages(record)), (lone, _messages(record))
    # names with repeated structure keep Spectrum's own types (the YAML of analyze --spectrum)
    for n, t in ranked.items():
        if len(by_type[t]) > 1 and not t.endswith("(pooled)"):
            assert t == module_type(n)
    if family in ("gpt2", "opt", "llama"):
        assert ranked == {n: module_type(n) for n in ranked}  # no pooling at all on transformer LMs


class HeadFirstMLP(pl.LightningModule):
    """A user's model that registers its classifier before its trunk: the last registered matrix
    is a trunk layer, the output layer is what runs last."""

    def __init__(self, example: bool = False):
        super().__init__()
        self.classifier = nn.Linear(32, 4)
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
        if example:
            self.example_input_array = torch.randn(2, 16)

    def forward(self, x):
        return self.classifier(self.trunk(x))

    def training_step(self, batch, _):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(make_data(16), batch_size=8)


def test_the_output_layer_of_a_model_that_registers_its_head_first_is_what_runs_last():
    """HTSRPruning leaves the classifier dense, and SpectrumSelect and NTKSelect(head=True) always
    train it, though a trunk layer is registered last; a plan without a batch has only the registration order, and one with
    ``example_input_array`` runs it."""
    from lalr_lightning.callbacks import HTSRPruning, NTKSelect

    prune = dict(target_sparsity=0.5, min_numel=1, min_evals=3)
    pruning, spectrum = HTSRPruning(**prune), SpectrumSelect(top_percent=50)
    make_trainer([pruning, spectrum], max_steps=1).fit(HeadFirstMLP())
    ntk = NTKSelect(head=True, probe_size=8, max_layers=1)
    make_trainer([ntk], max_steps=1).fit(HeadFirstMLP())
    assert ntk.head_layer == "classifier"  # kept trainable as the head, not trunk.4
    assert pruning.excluded == {"classifier": "classifier head (head=False)"}
    assert [la.name for la in pruning.layers] == ["trunk.0", "trunk.2", "trunk.4"]
    assert "classifier" in spectrum.selected and "always trained: classifier" in spectrum.grouping_summary
    assert "classifier" not in set(HTSRPruning(**prune).plan(HeadFirstMLP(example=True))["layer"])
    assert "trunk.4" not in set(HTSRPruning(**prune).plan(HeadFirstMLP())["layer"])  # the registration order
    assert output_layer(HeadFirstMLP()).name == "trunk.4"
