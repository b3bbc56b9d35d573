"""SurgicalLayerSelect: fixed blocks, Auto-RGN, eb-criterion, LIFT, LISA -- what trains, the
multipliers the formulas give, DDP agreement, resume, bad input."""

from __future__ import annotations

import copy
import functools
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning import viz
from lalr_lightning.callbacks import LayerSelection, SurgicalLayerSelect
from lalr_lightning.callbacks.selection import MODES
from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.selection.surgical import (
    eb_scores,
    lift_block,
    lisa_sample,
    relative_grad_norms,
    select_blocks,
)
from lalr_lightning.models.cnn import SmallResNet
from tests._dist import ddp_spawn
from tests._oracles import ShadowOracle
from tests._toys import MemLogger, ToyMLP, make_trainer


def _model(seed=0, lr=1e-2, wd=1e-4, classes=4):
    torch.manual_seed(seed)
    opt = functools.partial(torch.optim.Adam, lr=lr, weight_decay=wd)
    return SmallResNet(num_classes=classes, width=4, blocks_per_group=1, optimizer=opt)


# SmallResNet(blocks_per_group=1) blocks: conv1+bn1+layer1 | layer2 | layer3 | fc (join_stem=True),
# conv1+bn1 | layer1 | layer2 | layer3 | fc (LISA); names as core.model.layers gives them
BLOCKS = [b.name for b in block_layers(_model())]
B0, B1, B2, HEAD = BLOCKS
LISA_BLOCKS = [b.name for b in block_layers(_model(), join_stem=False)]
STEM, MIDDLE = LISA_BLOCKS[0], LISA_BLOCKS[1:4]
assert B0.startswith("model.conv1+") and "layer2" in B1 and "layer3" in B2 and HEAD == "model.fc"


def _data(n=40, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g))


def _loader(n=40, batch_size=8, seed=0):
    return DataLoader(_data(n, seed=seed), batch_size=batch_size, shuffle=False)


_trainer = partial(make_trainer, max_epochs=2)


def _params_by_block(module):
    return {b.name: b.params for b in block_layers(module)}


class StepRecorder(Callback):
    """After SurgicalLayerSelect in the list: records the selection of every step and checks
    that exactly the trainable blocks' parameters move during the step."""

    def __init__(self, cb):
        self.cb = cb
        self.steps: list[tuple[int, list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append((trainer.global_step, list(self.cb.selected)))
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        on = set(self.cb.selected)
        for b in self.cb.layers:
            moved = [n for n in b.params if not torch.equal(b.params[n].detach(), self.before[n])]
            if b.name in on:
                assert moved, f"trainable block {b.name} did not move"
            else:
                assert not moved, f"{moved} of frozen block {b.name} moved"


# ----------------------------------------------------------------------------- pure functions


def test_relative_grad_norm_and_eb_score_closed_forms():
    g = [torch.tensor([3.0, 4.0]), None, torch.tensor([1.0])]
    p = [torch.tensor([0.0, 10.0]), torch.tensor([1.0]), torch.tensor([0.0])]
    # ||g|| / ||theta||: 5 / 10; a tensor the loss does not reach: 0; zero weight: inf
    assert relative_grad_norms(g, p).tolist() == [0.5, 0.0, float("inf")]
    # columns [1, 3] and [2, 4] both have unbiased variance 2 -> mean of g^2 / 2 = 30 / 4 / 2
    eb = eb_scores([torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([2.0])])
    assert eb[0].item() == pytest.approx(3.75, rel=1e-7) and eb[1].item() == float("inf")


def test_select_blocks_resolves_every_form():
    names = ["a+b", "l2", "l3", "fc"]
    assert select_blocks("first", names) == ["a+b"]
    assert select_blocks("last", names) == ["fc"]
    assert select_blocks(["block:-2", 1], names) == ["l2", "l3"]
    assert select_blocks(["fc", "l*"], names) == ["l2", "l3", "fc"]
    assert select_blocks("all", names) == names


def test_lift_orders():
    assert [lift_block("front_to_end", s, 3) for s in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [lift_block("end_to_front", s, 3) for s in range(7)] == [2, 1, 0, 2, 1, 0, 2]
    for cycle in range(20):  # random: a permutation per cycle, differing between cycles
        assert sorted(lift_block("random", cycle * 5 + k, 5, seed=3) for k in range(5)) == list(range(5))
    orders = {tuple(lift_block("random", c * 5 + k, 5, seed=3) for k in range(5)) for c in range(20)}
    assert len(orders) > 5


def test_lisa_draws_are_uniform_and_distinct():
    n, gamma, switches = 5, 2, 4000
    counts = np.zeros(n)
    for s in range(switches):
        draw = lisa_sample(n, gamma, s, seed=0)
        assert len(set(draw)) == gamma and all(0 <= i < n for i in draw)
        counts[draw] += 1
    expected = switches * gamma / n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 18.5, (counts, chi2)  # chi-square, 4 dof: P(chi2 > 18.5) ~ 1e-3
    assert lisa_sample(n, gamma, 7, seed=0) == lisa_sample(n, gamma, 7, seed=0)


# ----------------------------------------------------------------------------- fixed blocks


@pytest.mark.parametrize("select,save_compute", [("first", True), ("last", False), (["block:1", "last"], True)])
def test_fixed_blocks_train_exactly_the_chosen_ones(select, save_compute):
    model = _model()
    before = copy.deepcopy(model.state_dict())
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    cb = SurgicalLayerSelect(mode="blocks", select=select, save_compute=save_compute)
    _trainer([cb]).fit(model, _loader())
    chosen = set(select_blocks(select, [B0, B1, B2, HEAD]))
    assert set(cb.selected) == chosen and cb.multipliers == {b: float(b in chosen) for b in (B0, B1, B2, HEAD)}
    after = model.state_dict()
    for block, params in _params_by_block(model).items():
        prefixes = {n.rsplit(".", 1)[0] for n in params}
        keys = [k for k in after if k.rsplit(".", 1)[0] in prefixes]  # params and BN buffers of the block
        buffers = [k for k in keys if "running" in k or "num_batches" in k]
        if block in chosen:
            assert all(not torch.equal(after[n], before[n]) for n in params), block
            assert all(not torch.equal(after[k], before[k]) for k in buffers if "running" in k), block
        else:
            assert all(torch.equal(after[k], before[k]) for k in keys), block  # bitwise, buffers included
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # restored at teardown


# ----------------------------------------------------------------------------- Auto-RGN / eb


class EpochSnapshot(Callback):
    """Before SurgicalLayerSelect in the list: the network (weights and module modes) as the
    measurement at this epoch start sees it."""

    def __init__(self):
        self.nets = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.nets.append(copy.deepcopy(pl_module.model))


def _hand_scores(net, loader, n_batches, kind):
    names = [n for n, _ in net.named_parameters() if "bn" not in n]
    params = [p for n, p in net.named_parameters() if "bn" not in n]
    total = {n: 0.0 for n in names}
    for i, (x, y) in enumerate(loader):
        if i == n_batches:
            break
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), params)
        for n, g, p in zip(names, grads, params):
            if kind == "rgn":
                total[n] += (g.norm() / p.norm()).item()
            else:
                total[n] += (g * g / (g.var(dim=0, keepdim=True) + 1e-8)).mean().item() if g.shape[0] > 1 \
                    else (g * g / (g.var() + 1e-8)).mean().item()
    return {"model." + n: v / n_batches for n, v in total.items()}


def test_auto_rgn_equals_hand_computation_and_drives_the_update():
    model = _model(lr=3e-3)
    cb = SurgicalLayerSelect(mode="auto_rgn")
    snap, oracle, log = EpochSnapshot(), ShadowOracle(), MemLogger()
    _trainer([snap, cb, oracle], max_epochs=2, logger=log, log_every_n_steps=1).fit(model, _loader())
    assert oracle.steps == 2 * 5
    measured = [h for h in cb.history if "scores" in h]
    assert len(measured) == 2 and len(snap.nets) == 2
    for epoch, (h, net) in enumerate(zip(measured, snap.nets)):
        rgn = _hand_scores(net, _loader(), 5, "rgn")
        # the reference's "bn" substring rule leaves downsample.1 (a BatchNorm) in; its bias starts at
        # zero, so it has no relative gradient norm (inf) at first: multiplier 1, outside the maximum
        assert (rgn["model.layer2.0.downsample.1.bias"] == float("inf")) == (epoch == 0)
        top = max(v for v in rgn.values() if v != float("inf"))
        assert h["scores"] == pytest.approx(rgn, rel=1e-6)
        for name, m in h["multipliers"].items():
            want = 0.0 if name not in rgn else 1.0 if rgn[name] == float("inf") else rgn[name] / top
            assert m == pytest.approx(want, rel=1e-6), name
    logged = {k: v for _, row in log.rows for k, v in row.items() if k.startswith("surgical/rgn/")}
    assert logged == pytest.approx({f"surgical/rgn/{k}": v for k, v in measured[-1]["scores"].items()})
    assert any(k == f"surgical/selected/{HEAD}" for _, row in log.rows for k in row)
    # BN tensors excluded (the reference): they never moved, and their running stats froze too
    assert all(torch.equal(p, q) for (n, p), (_, q) in
               zip(model.model.named_parameters(), snap.nets[0].named_parameters()) if "bn" in n)
    assert torch.equal(model.model.bn1.running_mean, snap.nets[0].bn1.running_mean)


def test_auto_rgn_multipliers_reach_the_optimizer():
    """The multiplier the optimizer applies to each tensor equals RGN / max RGN computed by hand
    from the epoch-start weights (excluded BN tensors: 1.0 here); the ShadowOracle checks the
    update is scheduled LR x that multiplier."""
    model = _model(lr=3e-3)
    cb = SurgicalLayerSelect(mode="auto_rgn", excluded_multiplier=1.0)

    class Check(Callback):
        seen: list = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            ctl = LayerControl.of(optimizer)
            self.seen.append({n: (ctl.multiplier(p), ctl.is_frozen(p)) for n, p in pl_module.named_parameters()})

    snap, check, oracle = EpochSnapshot(), Check(), ShadowOracle()
    _trainer([snap, cb, check, oracle], max_epochs=1).fit(model, _loader())
    rgn = _hand_scores(snap.nets[0], _loader(), 5, "rgn")
    top = max(v for v in rgn.values() if v != float("inf"))
    want = {n: 1.0 if n not in rgn or rgn[n] == float("inf") else rgn[n] / top for n in check.seen[0]}
    assert len(check.seen) == oracle.steps == 5
    for step in check.seen:
        assert {n: m for n, (m, _) in step.items()} == pytest.approx(want, rel=1e-6)
        assert not any(frozen for _, frozen in step.values())
    assert all(v == 1.0 for k, v in cb.multipliers.items() if "bn" in k)


def test_eb_criterion_equals_hand_computation():
    model = _model()
    cb = SurgicalLayerSelect(mode="eb_criterion", eb_threshold=1.0)
    snap = EpochSnapshot()
    _trainer([snap, cb], max_epochs=1).fit(model, _loader())
    want = _hand_scores(snap.nets[0], _loader(), 5, "eb")
    h = cb.history[0]
    assert h["scores"] == pytest.approx(want, rel=1e-6)
    for name, m in h["multipliers"].items():
        assert m == (float(want[name] >= 1.0) if name in want else 0.0)
    assert 0 < sum(h["multipliers"].values()) < len(want)  # the threshold splits this model's tensors


# ----------------------------------------------------------------------------- LIFT / LISA


@pytest.mark.parametrize("order", ["front_to_end", "end_to_front", "random"])
def test_lift_visits_blocks_in_order(order, monkeypatch):
    cb = SurgicalLayerSelect(mode="lift", order=order, switch_every=2, seed=1, figures="first_last")
    rec = StepRecorder(cb)
    log = MemLogger()
    figures = []
    monkeypatch.setattr(viz, "log_figure", lambda trainer, key, fig, **kw: figures.append((key, fig)))
    _trainer([cb, rec], max_epochs=4, logger=log, log_every_n_steps=1).fit(_model(), _loader())  # 20 steps
    blocks = [B0, B1, B2, HEAD]
    assert len(rec.steps) == 20
    for step, trainable in rec.steps:
        assert trainable == [blocks[lift_block(order, step // 2, 4, seed=1)]], step
    if order == "front_to_end":
        assert [t[0] for _, t in rec.steps[:8:2]] == blocks
    if order == "random":  # every cycle of 4 switches trains every block once
        seq = [t[0] for _, t in rec.steps[::2]]
        assert sorted(seq[:4]) == sorted(blocks) and sorted(seq[4:8]) == sorted(blocks)
    # the block x switch heatmap at fit end is the selection history
    (key, fig), = figures
    shown = np.asarray(fig.axes[0].images[0].get_array())
    want = [[float(b == blocks[lift_block(order, s, 4, seed=1)]) for s in range(10)] for b in blocks]
    assert key == "surgical/selection" and shown.tolist() == want
    # the per-step log says the same
    for step, row in log.rows:
        if f"surgical/selected/{HEAD}" in row:
            on = [b for b in blocks if row[f"surgical/selected/{b}"] == 1.0]
            assert on == dict(rec.steps)[step]


def test_lisa_samples_gamma_middle_blocks_with_stem_and_head_on():
    cb = SurgicalLayerSelect(mode="lisa", gamma=2, switch_every=3, seed=5)
    rec = StepRecorder(cb)
    _trainer([cb, rec], max_epochs=3).fit(_model(), _loader())  # 15 steps
    middle = MIDDLE
    assert cb.block_names == LISA_BLOCKS and len(LISA_BLOCKS) == 5
    for step, trainable in rec.steps:
        chosen = [middle[i] for i in lisa_sample(3, 2, step // 3, seed=5)]
        assert set(trainable) == {STEM, HEAD, *chosen}, step
    assert [h["step"] for h in cb.history] == [0, 3, 6, 9, 12]


def test_switching_keeps_user_frozen_parameters_frozen():
    model = _model()
    model.model.fc.bias.requires_grad_(False)
    bias = model.model.fc.bias.detach().clone()
    cb = SurgicalLayerSelect(mode="lift", switch_every=1)
    _trainer([cb], max_epochs=1).fit(model, _loader())  # 5 steps: the head (last of 4) trains at step 3
    assert torch.equal(model.model.fc.bias, bias) and not model.model.fc.bias.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "model.fc.bias")


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("mode", ["lift", "lisa", "auto_rgn"])
def test_resume_continues_the_schedule_exactly(mode, tmp_path):
    def make():  # each mode takes only its own arguments
        kw = {"lift": dict(order="random", every_n_steps=2, seed=4), "lisa": dict(gamma=1, every_n_steps=2, seed=4),
              "auto_rgn": {}}[mode]
        return SurgicalLayerSelect(mode=mode, **kw)

    full_cb, full = make(), _model()
    _trainer([full_cb], max_epochs=4).fit(full, _loader())  # 5 steps/epoch: switches straddle epochs

    first_cb, first = make(), _model()
    t1 = _trainer([first_cb], max_epochs=2)
    t1.fit(first, _loader())
    ckpt = tmp_path / "mid.ckpt"
    t1.save_checkpoint(ckpt)
    resumed_cb, resumed = make(), _model(seed=123)  # other init: the checkpoint must restore everything
    _trainer([resumed_cb], max_epochs=4).fit(resumed, _loader(), ckpt_path=str(ckpt))

    assert resumed_cb.history == full_cb.history and len(full_cb.history) > len(first_cb.history)
    for (k, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k


# ----------------------------------------------------------------------------- DDP


class SameSelectionOnEveryRank(Callback):
    """Runs on every rank after the SurgicalLayerSelect instances: all-gathers each one's 0/1
    selection, and checks that every parameter frozen by any of them stays bitwise unchanged
    through each step while the others move."""

    def _frozen(self, trainer):
        cbs = [c for c in trainer.callbacks if isinstance(c, LayerSelection)]
        for cb in cbs:
            sel = torch.tensor([float(b in cb.selected) for b in cb.block_names])
            gathered = trainer.strategy.all_gather(sel)
            assert gathered.shape[0] == 2 and torch.equal(gathered[0], gathered[1]), (cb.name, gathered)
        return {n for cb in cbs for b in cb.layers if b.name not in cb.selected for n in b.params}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.frozen = self._frozen(trainer)
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for n, p in pl_module.named_parameters():
            assert torch.equal(p.detach(), self.before[n]) == (n in self.frozen), n
        pl_module.log("ddp_checked", 1.0, sync_dist=True)


def test_ddp_ranks_train_the_same_blocks_and_frozen_ones_stay_put():
    """One ddp_spawn fit (spawning is the slow part): a fixed selection freezes the first block
    statically (requires_grad off before DDP wraps the model) and LISA samples among the rest
    every step; the two compose (a parameter frozen by either does not move)."""
    model = _model()
    before = copy.deepcopy(model.state_dict())
    fixed = SurgicalLayerSelect(mode="blocks", select=[B1, B2, HEAD], name="fixed")
    lisa = SurgicalLayerSelect(mode="lisa", gamma=1, switch_every=1, seed=2, name="lisa")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[fixed, lisa, SameSelectionOnEveryRank()])
    trainer.fit(model, _loader(n=64))
    assert trainer.callback_metrics["ddp_checked"] == 1.0
    after = model.state_dict()  # rank 0's weights, returned to the parent
    first = {k for k in after if k.startswith(("model.conv1.", "model.bn1.", "model.layer1."))}
    assert first and all(torch.equal(after[k], before[k]) for k in first)  # buffers included
    assert not torch.equal(after["model.fc.weight"], before["model.fc.weight"])


# ----------------------------------------------------------------------------- bad input


def _setup(cb, module):
    cb.setup(_trainer([]), module, "fit")


def test_bad_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid: " + ", ".join(MODES)):
        SurgicalLayerSelect(mode="surgery")
    with pytest.raises(ValueError, match="front_to_end, end_to_front, random"):
        SurgicalLayerSelect(mode="lift", order="middle_out")
    with pytest.raises(ValueError, match="frozen, all, none"):
        SurgicalLayerSelect(norm_eval="sometimes")
    with pytest.raises(ValueError, match="block:N"):
        SurgicalLayerSelect(select="block:two")
    with pytest.raises(ValueError, match="switch_every"):
        SurgicalLayerSelect(mode="lisa", switch_every=0)


def test_mode_arguments_a_target_does_not_take_and_the_union_of_their_signatures():
    import inspect
    import typing

    from lalr_lightning.core.runtime.checks import check_taken, union_signature

    class A:
        def __init__(self, kind: str = "a", x: int = 1, *args, **kwargs):
            pass

    class B:
        def __init__(self, y: float = 2.0, x: int = 3):
            pass

    check_taken("W(mode='a')", A, {"kind": "a"}, {"x": 2})
    with pytest.raises(ValueError, match=r"^W\(mode='b'\) builds B, which does not take kind, z; it takes: x, y$"):
        check_taken("W(mode='b')", B, {}, {"z": 1, "kind": "a", "y": 1.0})
    first = [inspect.Parameter("mode", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="a", annotation=str)]
    sig = union_signature(first, [(A, {"kind": "a"}), (B, {})])
    assert list(sig.parameters) == ["mode", "x", "y"]  # fixed, *args and **kwargs left out; x once
    assert all(p.default is None and p.kind is p.KEYWORD_ONLY for p in list(sig.parameters.values())[1:])
    assert sig.parameters["x"].annotation == typing.Optional[int]  # noqa: UP045
    assert sig.parameters["y"].annotation == typing.Optional[float]  # noqa: UP045


def test_missing_block_lists_the_models_blocks():
    with pytest.raises(ValueError, match=r"'layer9' does not exist.*1: 'model\.layer2"):
        _setup(SurgicalLayerSelect(select="layer9"), _model())
    with pytest.raises(ValueError, match="index 4 does not exist"):
        _setup(SurgicalLayerSelect(select="block:4"), _model())


def test_gamma_larger_than_the_middle_blocks():
    with pytest.raises(ValueError, match="gamma=4 is larger than the number of middle blocks \\(3"):
        _setup(SurgicalLayerSelect(mode="lisa", gamma=4), _model())


def test_single_block_model_is_a_clear_error():
    with pytest.raises(ValueError, match="single block"):
        _setup(SurgicalLayerSelect(mode="lift", blocks=["net"]), ToyMLP())


# ----------------------------------------------------------------------------- the pure helpers of the callbacks


def test_criterion_scores_multipliers_and_fsdp_scores_agree_with_the_closed_forms():
    from lalr_lightning.core.selection import surgical as S

    g = [torch.tensor([3.0, 4.0]), None, torch.tensor([[1.0, 2.0], [3.0, 5.0]])]
    p = [torch.tensor([0.0, 10.0]), torch.ones(2), torch.zeros(2, 2)]
    assert S.batch_scores("rgn", g, p).tolist() == relative_grad_norms(g, p).tolist() == [0.5, 0.0, float("inf")]
    assert torch.equal(S.batch_scores("eb", g, p), eb_scores(g))
    # the FSDP path: (||g||, eb score) per tensor read whole, ||theta|| from the ranks' pieces -> the same scores
    stats = {n: S.gradient_stat(c, t) for c in ("eb",) for n, t in (("a", g[0]), ("c", g[2]))}
    assert stats["a"][0] == 5.0 and stats["c"][1] == pytest.approx(float(eb_scores([g[2]])[0]))
    assert S.sharded_scores("eb", stats, ["a", "b", "c"], []).tolist() == eb_scores(g).tolist()
    rgn = {n: S.gradient_stat("rgn", t) for n, t in (("a", g[0]), ("c", g[2]))}
    assert rgn["a"] == (5.0, 0.0) and S.sharded_scores("rgn", rgn, ["a", "b", "c"], [10.0, 1.0, 0.0]).tolist() == [
        0.5, 0.0, float("inf")]
    assert S.criterion_multipliers("rgn", {"a": 0.5, "b": 0.25, "c": float("inf")}, 0.95) == {"a": 1.0, "b": 0.5,
                                                                                            "c": 1.0}
    assert S.criterion_multipliers("eb", {"a": 0.96, "b": 0.9}, 0.95) == {"a": 1.0, "b": 0.0}


def test_tensor_rules_exclusions_zero_scales_and_weight_tensors():
    from lalr_lightning.core.selection import surgical as S

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    torch.nn.init.zeros_(model[1].weight)
    units = S.tensor_layers(model)
    assert S.excluded("1.bn.weight", ("bn",)) and not S.excluded("downsample.1.weight", ("bn",))
    assert S.zero_scales(units) == ["1.weight"]  # the zeroed norm scale; a zero bias is no scale
    assert S.weight_tensors(model, units, ()) == ["0.weight", "2.weight"]
    assert S.weight_tensors(model, units, ("2.",)) == ["0.weight"]
    loader = range(2)  # any one iterable of batches; a list or a dict is several loaders
    assert [u.name for u in S.measured_units("rgn", loader, units, ("1.",))] == ["0.weight", "0.bias", "2.weight",
                                                                                 "2.bias"]
    for several in (None, {"a": [1]}, [[1], [2]]):
        with pytest.raises(ValueError, match="rgn measures gradients on the training dataloader and needs exactly"):
            S.measured_units("rgn", several, units, ())
    with pytest.raises(ValueError, match=r"every trainable tensor is excluded by exclude=\['\.'\]"):
        S.measured_units("eb", loader, units, (".",))
    assert S.with_excluded(["a.bn", "b"], {}, ("bn",), 0.0) == {"a.bn": 0.0, "b": 1.0}  # before any measurement
    assert S.with_excluded(["a.bn", "b", "c"], {"b": 0.5, "c": 0.0}, ("bn",), 0.3) == {"a.bn": 0.3, "b": 0.5, "c": 0.0}


def test_scheduled_blocks_and_lisa_checks():
    from lalr_lightning.core.model.layers import Layer
    from lalr_lightning.core.selection import surgical as S

    roles = ["stem", "block", "block", "block", "head"]
    blocks = [Layer(name=f"b{i}", kind="block", module=None, params={}, role=r) for i, r in enumerate(roles)]
    for switch in range(7):
        assert S.scheduled_blocks("lift", blocks, switch, order="end_to_front") == {f"b{4 - switch % 5}"}
        drawn = {f"b{i + 1}" for i in lisa_sample(3, 2, switch, seed=3)}
        assert S.scheduled_blocks("lisa", blocks, switch, gamma=2, seed=3) == {"b0", "b4"} | drawn
    assert S.lisa_warnings(blocks, 2, None, "") == []
    with pytest.raises(ValueError, match=r"gamma=4 is larger than the number of middle blocks \(3"):
        S.lisa_warnings(blocks, 4, None, "")
    with pytest.raises(ValueError, match="are all stem or head; pass blocks=.* e.g. x$"):
        S.lisa_warnings([blocks[0], blocks[4]], 1, None, "e.g. x")
    lines = S.lisa_warnings(blocks, 3, blocks[2], "e.g. x")
    assert lines[0].startswith("LISA cannot switch: gamma=3") and lines[0].endswith("smaller blocks (e.g. x)")
    assert lines[1].startswith("LISA: the model's output layer is in the middle block 'b2'")


def test_auto_rgn_on_a_fresh_lora_adapter_trains_b_and_says_why_a_waits():
    """peft LoRA before its first step: ``lora_B`` is zero (infinite RGN) and ``lora_A`` gets no
    gradient (RGN 0). That used to stop the fit with "every measured gradient is zero"; RGN over
    its infinite maximum gives B 1 and A 0, and a warning names LoRA. From the second epoch B has
    moved, so A gets a finite, non-zero multiplier."""
    from peft import LoraConfig, get_peft_model

    from lalr_lightning.callbacks import AutoRGN
    from lalr_lightning.core.selection import surgical as S
    from tests._lm import lm_module

    assert S.rgn_multipliers({"a": 0.0, "b": float("inf")}) == {"a": 0.0, "b": 1.0}
    with pytest.raises(RuntimeError, match="every measured gradient is zero"):
        S.rgn_multipliers({"a": 0.0, "b": 0.0})  # nothing would train
    module = lm_module("llama", lr=1e-2)
    module.model = get_peft_model(module.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    seen = []

    class Record(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(dict(cb.multipliers))

    cb = AutoRGN()
    trainer = pl.Trainer(max_epochs=2, callbacks=[cb, Record()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match=r"AutoRGN: 4 of 8 weight matrices .* 4 LoRA B matrices are all zeros"):
        trainer.fit(module)
    first, second = seen
    assert {k: v for k, v in first.items() if "lora_A" in k} == dict.fromkeys(
        [k for k in first if "lora_A" in k], 0.0) and all(v == 1.0 for k, v in first.items() if "lora_B" in k)
    assert all(0.0 < v < 1.0 for k, v in second.items() if "lora_A" in k) and max(second.values()) == 1.0
