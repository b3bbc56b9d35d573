"""TempBalanceCallback: TempBalance's formulas, the update it causes, resume, DDP, bad input."""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import TempBalanceCallback
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.spectral.tempbalance import ASSIGN, assign_multipliers
from lalr_lightning.models.cnn import SmallCNN
from tests._dist import ddp_spawn
from tests._oracles import ShadowOracle
from tests._toys import make_trainer

# ----------------------------------------------------------------------------- assignments


def test_linear_map_is_tempbalance_interp():
    a = np.array([2.0, 4.0, 3.0, 6.0])
    m = assign_multipliers(a, "linear_map", lr_min_ratio=0.5, lr_max_ratio=1.5)
    np.testing.assert_allclose(m, np.interp(a, [2.0, 6.0], [0.5, 1.5]))
    # constant alphas: nothing to balance, the scheduled LR stays
    np.testing.assert_allclose(assign_multipliers(np.full(3, 4.0)), [1.0, 1.0, 1.0])


def test_step_is_tempbalance_tb_step_by_rank():
    # TempBalance's tb_step: the j-th smallest of n alphas gets lr_min + (lr_max - lr_min) * j / n
    a = np.array([3.0, 1.0, 7.0, 2.0])
    m = assign_multipliers(a, "step", lr_min_ratio=0.5, lr_max_ratio=1.5)
    np.testing.assert_allclose(m, [0.5 + 0.5, 0.5, 0.5 + 0.75, 0.5 + 0.25])  # ranks 2, 0, 3, 1 of 4
    # by rank, not by value: a far outlier does not squeeze the others
    np.testing.assert_allclose(assign_multipliers(np.array([1.0, 2.0, 100.0]), "step", lr_min_ratio=0.0,
                                                  lr_max_ratio=3.0), [0.0, 1.0, 2.0])
    # ties are ranked in model order
    np.testing.assert_allclose(assign_multipliers(np.full(4, 4.0), "step"), [0.5, 0.75, 1.0, 1.25])
    with pytest.raises(ValueError, match="std"):
        TempBalanceCallback(assign="step", std=1.0)
    assert TempBalanceCallback(assign="step", lr_min_ratio=0.2).settings()["lr_min_ratio"] == 0.2


@pytest.mark.parametrize(
    "name,f",
    [("identity", lambda a: a), ("square", lambda a: a**2), ("cube", lambda a: a**3), ("sqrt", np.sqrt),
     ("cbrt", lambda a: a ** (1 / 3)), ("log2", np.log2), ("softmax", np.exp)],
)
def test_weighted_forms(name, f):
    a = np.array([2.5, 3.0, 4.5, 7.0, 1.5])
    m = assign_multipliers(a, name)
    np.testing.assert_allclose(m, len(a) * f(a) / f(a).sum(), rtol=1e-12)
    assert m.mean() == pytest.approx(1.0)


def test_neg_pow2_by_alpha_rank():
    a = np.array([3.0, 1.0, 2.0])
    # probabilities [1/8, 1/4, 1/2 + residue 1/8]; the smallest alpha gets the smallest
    np.testing.assert_allclose(assign_multipliers(a, "neg_pow2"), 3 * np.array([5 / 8, 1 / 8, 1 / 4]))


def test_sampling_assignments_are_seeded_and_normalized():
    a = np.array([2.0, 5.0, 3.0, 4.0])
    m1 = assign_multipliers(a, "sample_alpha", rng=np.random.default_rng(7))
    y = np.random.default_rng(7).normal(a, 1.0)
    np.testing.assert_allclose(m1, 4 * np.clip(y, 0, None) / np.clip(y, 0, None).sum())
    m2 = assign_multipliers(a, "sample_lr", rng=np.random.default_rng(3), base_lr=2.0)
    x = np.sort(np.random.default_rng(3).normal(2.0, 1.0, size=4))
    want = np.empty(4)
    want[np.argsort(a)] = x  # j-th largest alpha <- j-th largest draw
    want = np.clip(want, 0, None)
    np.testing.assert_allclose(m2, 4 * want / want.sum())
    m3 = assign_multipliers(a, "emg", rng=np.random.default_rng(5))
    assert m3.mean() == pytest.approx(1.0) and np.all(np.diff(m3[np.argsort(a)]) >= 0)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="linear_map, identity"):
        TempBalanceCallback(assign="nope")
    with pytest.raises(ValueError, match="median, ks, peak"):
        TempBalanceCallback(fit="nope")
    with pytest.raises(ValueError, match="valid"):
        assign_multipliers([1.0, 2.0], "nope")
    assert set(ASSIGN) >= {"linear_map", "neg_pow2", "sample_alpha", "sample_lr", "emg", "softmax"}


# ----------------------------------------------------------------------------- on a Trainer


def _loader(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _model(**kw):
    torch.manual_seed(0)
    # partials, not lambdas: ddp_spawn pickles the module
    opt = kw.pop("optimizer", partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4))
    sched = kw.pop("scheduler", partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=4))
    return SmallCNN(width=16, optimizer=opt, scheduler=sched, **kw)


_trainer = partial(make_trainer, max_epochs=2)


def _tempbalance_by_hand(weight: torch.Tensor) -> float:
    """TempBalance's reference recipe, written out in numpy: conv (out,in,k,k) -> k*k matrices
    scaled by sqrt(0.5), squared singular values pooled and sorted, median xmin, MLE alpha."""
    w = weight.detach().double().numpy()
    if w.ndim == 4:
        mats = [w[:, :, i, j] * np.sqrt(0.5) for i in range(w.shape[2]) for j in range(w.shape[3])]
    else:
        mats = [w]
    ev = np.sort(np.concatenate([np.linalg.svd(m, compute_uv=False) ** 2 for m in mats]))
    i = len(ev) // 2
    tail = ev[i:]
    return 1 + len(tail) / (np.log(tail).sum() - len(tail) * np.log(ev[i]))


class Capture(Callback):
    """Records, at each epoch start (after TempBalance ran), the multiplier the controller holds
    for every parameter, and the callback's own view."""

    def __init__(self, tb):
        self.tb = tb
        self.seen = []

    def on_train_epoch_start(self, trainer, pl_module):
        ctl = LayerControl.of(trainer.optimizers[0])
        self.seen.append(({n: ctl.multiplier(p) for n, p in pl_module.named_parameters()}, dict(self.tb.multipliers),
                          {n: p.detach().clone() for n, p in pl_module.named_parameters()}))


def test_multipliers_follow_tempbalance_formula_and_reach_the_update():
    tb = TempBalanceCallback()
    cap = Capture(tb)
    oracle = ShadowOracle()
    model = _model()
    _trainer([tb, cap, oracle]).fit(model, _loader())
    assert oracle.steps == 2 * 6
    # eligible: the middle convs (first conv and the head are excluded)
    assert list(tb.multipliers) == ["model.layer2.conv", "model.layer3.conv", "model.layer4.conv"]
    assert set(tb.excluded) == {"model.layer1.conv", "model.fc"}
    for per_param, mults, weights in cap.seen:
        alphas = {n: _tempbalance_by_hand(weights[n + ".weight"]) for n in mults}
        lo, hi = min(alphas.values()), max(alphas.values())
        for n, a in alphas.items():
            assert mults[n] == pytest.approx(0.5 + (a - lo) / (hi - lo), rel=1e-4)
            # weight and the BatchNorm tied to it (layerN.bn) carry the conv's multiplier
            bn = n.replace("conv", "bn")
            assert per_param[n + ".weight"] == pytest.approx(mults[n])
            assert per_param[bn + ".weight"] == pytest.approx(mults[n])
            assert per_param[bn + ".bias"] == pytest.approx(mults[n])
        assert per_param["model.fc.weight"] == 1.0 and per_param["model.layer1.conv.weight"] == 1.0
    # recomputed each epoch from the weights of that moment
    assert cap.seen[0][1] != cap.seen[1][1]


def test_every_n_steps():
    tb = TempBalanceCallback(every_n_steps=4)
    _trainer([tb], max_epochs=2).fit(_model(), _loader())
    # fit start (step 0), then steps 4, 8 (12 steps in all)
    assert [h["step"] for h in tb.history] == [0, 4, 8]


def _ckpt_trainer(tmp_path, callbacks, max_epochs):
    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1, save_top_k=-1)
    return _trainer(callbacks + [ck], max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=tmp_path)


@pytest.mark.parametrize("assign", ["linear_map", "sample_alpha"])
def test_resume_equals_uninterrupted(tmp_path, assign):
    full = TempBalanceCallback(assign=assign)
    m_full = _model()
    _trainer([full], max_epochs=4).fit(m_full, _loader())

    first = TempBalanceCallback(assign=assign)
    _ckpt_trainer(tmp_path / "a", [first], 2).fit(_model(), _loader())
    resumed = TempBalanceCallback(assign=assign)
    m_res = _model()
    _ckpt_trainer(tmp_path / "b", [resumed], 4).fit(m_res, _loader(), ckpt_path=str(tmp_path / "a" / "last.ckpt"))

    assert len(resumed.history) == len(full.history) == 4
    for a, b in zip(resumed.history, full.history):
        assert a["epoch"] == b["epoch"]
        for k in a["multipliers"]:
            assert a["multipliers"][k] == pytest.approx(b["multipliers"][k], rel=1e-5, abs=1e-6)
    for (n, p), q in zip(m_res.named_parameters(), m_full.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_two_instances_keep_separate_state(tmp_path):
    """Two named instances save under their own keys and each resumes its own history (a swap
    would be caught twice: the histories differ, and the settings check refuses the other's)."""
    a, b = TempBalanceCallback(name="a"), TempBalanceCallback(assign="sqrt", name="b")
    assert a.state_key != b.state_key
    _ckpt_trainer(tmp_path / "a", [a, b], 2).fit(_model(), _loader())
    assert a.history != b.history
    a2, b2 = TempBalanceCallback(name="a"), TempBalanceCallback(assign="sqrt", name="b")
    _ckpt_trainer(tmp_path / "b", [a2, b2], 3).fit(_model(), _loader(), ckpt_path=str(tmp_path / "a" / "last.ckpt"))
    assert a2.history[:2] == a.history and b2.history[:2] == b.history


# ----------------------------------------------------------------------------- DDP


class SameOnEveryRank(Callback):
    def on_train_epoch_start(self, trainer, pl_module):  # after TempBalance measured (it is listed first)
        # each rank fitted its share of the layers: the merged alphas equal a fit of all of them here
        from lalr_lightning.core.spectral import htsr

        tb = next(c for c in trainer.callbacks if isinstance(c, TempBalanceCallback))
        whole = htsr.alphas(tb.layers, fit="median")
        assert tb.scores == pytest.approx(whole, rel=1e-6) and trainer.world_size == 2

    def on_train_epoch_end(self, trainer, pl_module):
        tb = next(c for c in trainer.callbacks if isinstance(c, TempBalanceCallback))
        mine = torch.tensor([tb.multipliers[k] for k in sorted(tb.multipliers)], dtype=torch.float64)
        every = trainer.strategy.all_gather(mine)
        assert every.shape[0] == 2 and torch.equal(every[0], every[1]), every
        ctl = LayerControl.of(trainer.optimizers[0])
        p = dict(pl_module.named_parameters())["module.model.layer3.conv.weight"
                                               if "module.model.layer3.conv.weight" in dict(pl_module.named_parameters())
                                               else "model.layer3.conv.weight"]
        assert ctl.multiplier(p) == pytest.approx(tb.multipliers["model.layer3.conv"])
        pl_module.log("ddp_checked", 1.0, sync_dist=True)
        pl_module.log("layer3_multiplier", tb.multipliers["model.layer3.conv"])  # rank 0's reaches the parent


def test_ddp_ranks_use_identical_multipliers():
    tb = TempBalanceCallback()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[tb, SameOnEveryRank()])
    trainer.fit(_model(), _loader())
    assert trainer.callback_metrics["ddp_checked"] == 1.0
    # the decisions are readable in the main process too (handed back by rank 0)
    assert tb.multipliers["model.layer3.conv"] == pytest.approx(float(trainer.callback_metrics["layer3_multiplier"]))
    assert len(tb.history) == 2 and set(tb.scores) == set(tb.multipliers)


# ----------------------------------------------------------------------------- bad input


class OnlyTiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def training_step(self, batch, i):
        return self.c(self.b(self.a(batch[0]))).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ----------------------------------------------------------------------------- the first layer

# what first=False (TempBalance's rule) and first="block" leave out, by model family
FIRST = {
    "sequential": (["0"], ["0"]),
    "smallcnn": (["model.layer1.conv"], ["model.layer1.conv"]),
    "resnet18": (["conv1"], ["conv1"]),
    "vit": (["patch_embed.proj"], ["patch_embed.proj"]),
    "bert": (["bert.encoder.layer.0.attention.self.query"],
             [f"bert.encoder.layer.0.{m}" for m in ("attention.self.query", "attention.self.key",
                                                    "attention.self.value", "attention.output.dense",
                                                    "intermediate.dense", "output.dense")]),
    "gpt2": (["transformer.h.0.attn.c_attn"],
             [f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]),
    "opt": (["model.decoder.layers.0.self_attn.k_proj"],
            [f"model.decoder.layers.0.{m}" for m in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj",
                                                     "self_attn.out_proj", "fc1", "fc2")]),
    "llama": (["model.layers.0.self_attn.q_proj"],
              [f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                               "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]),
}


def _family(name: str, tied: bool = False) -> nn.Module:
    import timm
    from transformers import BertConfig, BertForSequenceClassification

    from tests._lm import tiny_lm

    torch.manual_seed(0)
    if name == "sequential":
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 4))
    if name == "smallcnn":
        return SmallCNN(width=16, in_channels=1)
    if name == "resnet18":
        return timm.create_model("resnet18", num_classes=10)
    if name == "vit":
        return timm.models.vision_transformer.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2,
                                                                num_heads=2, num_classes=10)
    if name == "bert":
        return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=128, num_labels=2))
    return tiny_lm(name, tied, hidden=64)


@pytest.mark.parametrize("family", [*FIRST, "gpt2-untied", "opt-untied", "llama-tied"])
def test_first_leaves_out_what_the_docs_say(family):
    """TempBalance's rule (the first Conv2d/Linear in module order) leaves out a CNN's or ViT's stem
    but one projection of a language model's first layer; first="block" leaves out the whole first
    block that holds a balanced matrix. Both as docs/tempbalance.md's table says."""
    import re
    from pathlib import Path

    from lalr_lightning.core.model.layers import DEFAULT_KINDS
    from lalr_lightning.core.spectral.tempbalance import eligible_layers

    name, _, tie = family.partition("-")
    tied = {"tied": True, "untied": False}.get(tie, name in ("gpt2", "opt"))  # the family's default
    model = _family(name, tied)
    layer_default, layer_block = FIRST[name]
    for first, expected in ((False, layer_default), ("block", layer_block)):
        eligible, excluded = eligible_layers(model, DEFAULT_KINDS, first=first, min_evals=2)
        left_out = [n for n, why in excluded.items() if why.startswith("first")]
        assert left_out == expected, (family, first)
        assert not {la.name for la in eligible} & set(expected)
    _, balanced = eligible_layers(model, DEFAULT_KINDS, first=True, min_evals=2)
    assert not any(why.startswith("first") for why in balanced.values())
    if name == "llama":  # the callback's decision leaves them out: the second layer's seven matrices remain
        plan = TempBalanceCallback(first="block", min_evals=2).plan(model)
        assert list(plan["layer"]) == [n.replace("layers.0.", "layers.1.") for n in layer_block]
    # docs/tempbalance.md's table says the same
    text = (Path(__file__).resolve().parents[1] / "docs" / "tempbalance.md").read_text()
    table = text.split("## Which layer is \"first\"")[1]
    rows = {r.split("|")[1].strip(): r.split("|")[2:4] for r in table.splitlines() if r.startswith("| ")}
    label = {"sequential": "plain `nn.Sequential` MLP", "smallcnn": "`SmallCNN` (this package)",
             "resnet18": "timm ResNet-18", "vit": "timm ViT", "bert": "BERT (`BertForSequenceClassification`)",
             "gpt2": "GPT-2 (q, k, v in one `c_attn`)", "opt": "OPT (registers `k_proj` before `q_proj`)",
             "llama": "LLaMA (tied or untied head)"}[name]
    assert [re.findall(r"`([^`]+)`", cell) for cell in rows[label]] == [layer_default, layer_block]


def test_first_takes_true_false_or_block():
    for bad in ("blocks", 1, None):
        with pytest.raises(ValueError, match="first must be False .*, True .* or 'block'"):
            TempBalanceCallback(first=bad)
    assert TempBalanceCallback(first="block").settings()["first"] == "block"


def test_model_without_eligible_layers_is_a_clear_error():
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    with pytest.raises(ValueError, match="min_evals"):
        _trainer([TempBalanceCallback()], max_epochs=1).fit(OnlyTiny(), data)
    with pytest.raises(ValueError, match="layer_types"):
        _trainer([TempBalanceCallback(layer_types=["embedding"])], max_epochs=1).fit(OnlyTiny(), data)


def test_a_model_whose_balanced_layers_all_are_frozen_is_refused_naming_lora():
    """peft LoRA: the base layers are frozen and the adapters have too few eigenvalues, so the
    multipliers would act on nothing (the fit ran, decided and changed nothing)."""
    model = _model()
    for p in model.model.parameters():
        p.requires_grad_(False)
    model.model.fc.weight.requires_grad_(True)  # the head trains, outside TempBalance's layers
    with pytest.raises(ValueError, match=r"none of its 3 layers trains .*LoRA.*LALRScheduleCallback"):
        _trainer([TempBalanceCallback(min_evals=100, first=True, head=True)], max_epochs=1).fit(model, _loader())
    tb = TempBalanceCallback(min_evals=100, first=True, head=True)
    assert set(tb.plan(model)["layer"]) == {"model.layer2.conv", "model.layer3.conv", "model.layer4.conv"}  # no fit


def test_too_few_eigenvalues_are_excluded_with_the_reason():
    # width 16: layer2 and layer3 have 9*16 = 144 eigenvalues, layer4 9*32 = 288
    with pytest.raises(ValueError, match="144 eigenvalues < min_evals=200"):
        _trainer([TempBalanceCallback(min_evals=200)], max_epochs=1).fit(_model(), _loader())
    tb = TempBalanceCallback(min_evals=100, exclude_first_last=False)
    _trainer([tb], max_epochs=1).fit(_model(), _loader())
    assert list(tb.multipliers) == ["model.layer2.conv", "model.layer3.conv", "model.layer4.conv"]
    assert tb.excluded == {"model.layer1.conv": "9 eigenvalues < min_evals=100",
                           "model.fc": "10 eigenvalues < min_evals=100"}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_weights_are_a_clear_error(bad):
    model = _model()
    with torch.no_grad():
        model.model.layer3.conv.weight[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match="layer3"):
        _trainer([TempBalanceCallback()], max_epochs=1).fit(model, _loader())


def test_all_zero_weights_are_a_clear_error():
    model = _model()
    with torch.no_grad():
        model.model.layer3.conv.weight.zero_()
    # the message says what happened to the spectrum (the analysis' reason), not a guess
    with pytest.raises(ValueError, match=r"layer3.*above the zero filter|layer3.*eigenvalue"):
        _trainer([TempBalanceCallback()], max_epochs=1).fit(model, _loader())


def test_huge_and_tiny_weights_give_the_alpha_of_the_unscaled_layer():
    """Alpha is scale-free: weights ~1e25 (eigenvalues past float32) or ~1e-30 (below it) fit the
    same alpha as the same layer at unit scale, instead of a plausible wrong 1.0 or a NaN."""
    alphas = {}
    for scale in (1.0, 1e25, 1e-30):
        model = _model()
        with torch.no_grad():
            model.model.layer3.conv.weight.mul_(scale)
        tb = TempBalanceCallback()
        _trainer([tb], max_epochs=1, limit_train_batches=1).fit(model, _loader())  # one decision, before the step
        alphas[scale] = tb.scores["model.layer3.conv"]
    assert alphas[1e25] == pytest.approx(alphas[1.0], rel=1e-4)
    assert alphas[1e-30] == pytest.approx(alphas[1.0], rel=1e-4) and 1.5 < alphas[1.0] < 10
