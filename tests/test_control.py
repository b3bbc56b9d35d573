"""core/runtime/control.py: the update a parameter receives is scheduled LR x multiplier."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

from lalr_lightning.callbacks.fixed import LayerLRMultiplier
from lalr_lightning.core.runtime.control import LayerControl
from tests._oracles import ShadowOracle
from tests._toys import ToyMLP, make_trainer

_trainer = partial(make_trainer, max_epochs=3)


MULTS = {"net.0": 0.5, "net.2": 2.0, "net.4": 1.5}


@pytest.mark.parametrize("opt", ["sgd", "adamw", "adamw_groups"])
@pytest.mark.parametrize("sched", [None, "lambda", "step", "cosine", "onecycle", "plateau", "sequential"])
def test_update_is_scheduled_lr_times_multiplier(opt, sched):
    oracle = ShadowOracle(MULTS)
    model = ToyMLP(opt=opt, sched=sched)
    _trainer([LayerLRMultiplier(MULTS), oracle]).fit(model)
    assert oracle.steps == 3 * 8
    if sched not in (None, "plateau"):
        assert len(set(oracle.seen_lrs)) > 1  # the scheduler really moved the LR
    # the optimizer the scheduler sees still has the user's groups
    assert len(model.trainer.optimizers[0].param_groups) == (2 if opt == "adamw_groups" else 1)


def test_gradient_accumulation():
    oracle = ShadowOracle(MULTS)
    _trainer([LayerLRMultiplier(MULTS), oracle], accumulate_grad_batches=2).fit(ToyMLP(opt="adamw", sched="onecycle"))
    assert oracle.steps == 3 * 4


def test_two_callbacks_compose_multiplicatively():
    a = LayerLRMultiplier({"net.2": 2.0, "net.0": 0.5}, name="a")
    b = LayerLRMultiplier({"net.2": 3.0}, name="b")
    oracle = ShadowOracle({"net.0": 0.5, "net.2": 6.0})
    _trainer([a, b, oracle], max_epochs=1).fit(ToyMLP(opt="sgd", sched="cosine"))
    eff, lr = oracle.last_eff
    assert eff["net.2"] == pytest.approx(6.0 * lr) and eff["net.0"] == pytest.approx(0.5 * lr)


def test_frozen_parameters_do_not_move():
    model = ToyMLP(opt="adamw")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    ctl = LayerControl.of(opt)
    ctl.set_frozen("t", [model.net[0].weight])
    before = model.net[0].weight.detach().clone()
    other = model.net[2].weight.detach().clone()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    assert torch.equal(model.net[0].weight, before)
    assert not torch.equal(model.net[2].weight, other)
    assert "exp_avg" not in opt.state.get(model.net[0].weight, {})


def test_invalid_multiplier_is_a_clear_error():
    model = ToyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = LayerControl.of(opt)
    with pytest.raises(ValueError, match="finite and >= 0"):
        ctl.set_multipliers("t", {model.net[0].weight: float("nan")}, {model.net[0].weight: "net.0"})


@pytest.mark.parametrize("patterns, match", [
    ({"net.0": float("inf")}, r"finite.*'net\.0': inf"),
    ([("net.0", 2.0)], r"patterns=\{glob over layer names: LR factor\}, got a list"),
    ("net.0", r"patterns=\{glob over layer names: LR factor\}, got a str"),
])
def test_layer_lr_multiplier_refuses_bad_patterns_at_construction(patterns, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LayerLRMultiplier(patterns)


def test_unknown_pattern_lists_layers():
    cb = LayerLRMultiplier({"nope*": 2.0})
    with pytest.raises(ValueError, match="net.0"):
        _trainer([cb], max_epochs=1).fit(ToyMLP())


class TiedMLP(ToyMLP):
    def __init__(self):
        super().__init__(width=16, d=16)
        self.net[4].weight = self.net[2].weight  # one matrix, two modules


def test_a_pattern_naming_a_tied_module_says_which_layer_holds_its_weight():
    with pytest.raises(ValueError, match=r"'net\.4' shares its weight with 'net\.2'.*use 'net\.2'"):
        _trainer([LayerLRMultiplier({"net.0": 2.0, "net.4": 0.5})], max_epochs=1).fit(TiedMLP())


@pytest.mark.parametrize("path", ["rescale", "split"])
def test_timm_lookahead_steps_its_inner_optimizer_at_lr_times_the_multiplier(path, monkeypatch):
    """timm's Lookahead skips Optimizer.__init__, so torch's step hooks never run on it: the
    layer control goes on the optimizer it wraps (whose param_groups it shares)."""
    import lalr_lightning.core.runtime.control as control

    timm_optim = pytest.importorskip("timm.optim")
    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 0 if path == "split" else 10**9)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    opt_a = timm_optim.Lookahead(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), k=3)
    ctl = LayerControl.of(opt_a)
    ctl.set_multipliers("t", {a[0].weight: 3.0, a[1].weight: 0.5})
    ctl.set_frozen("f", [a[1].bias])
    opt_b = timm_optim.Lookahead(torch.optim.SGD([{"params": [b[0].weight], "lr": 0.3}, {"params": [b[1].weight], "lr": 0.05},
                                                  {"params": [b[0].bias]}], lr=0.1, momentum=0.9), k=3)
    x = torch.randn(8, 4)
    for _ in range(7):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert LayerControl.existing(opt_a) is ctl and (ctl._rescale_cache[1] is None) == (path == "split")
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_an_optimizer_whose_step_runs_no_hooks_is_refused():
    class NoInit(torch.optim.SGD):
        def __init__(self, params):  # builds itself without Optimizer.__init__: torch never hooks its step
            self.param_groups = [{"params": list(params), "lr": 0.1}]
            self.state = {}
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

        def step(self, closure=None):
            pass

    with pytest.raises(TypeError, match="NoInit.*step hooks"):
        LayerControl.of(NoInit(ToyMLP().parameters()))


def test_lbfgs_refuses_a_split():
    model = ToyMLP()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1)
    LayerControl.of(opt).set_multipliers("t", {model.net[0].weight: 2.0})
    x = torch.randn(4, 16)

    def closure():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="LBFGS"):
        opt.step(closure)


def test_mixed_precision():
    oracle = ShadowOracle(MULTS)
    _trainer([LayerLRMultiplier(MULTS), oracle], max_epochs=1, precision="bf16-mixed").fit(
        ToyMLP(opt="adamw", sched="cosine"))
    assert oracle.steps == 8


# ----------------------------------------------------------------------------- rescaling vs the split

_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2, weight_decay=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-2, decoupled_weight_decay=True),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, weight_decay=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True, weight_decay=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5, weight_decay=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, weight_decay=1e-2),
    # the implementations a flag picks step the same update: fused and grouped kernels, maximize,
    # a tensor LR
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_tensor_lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), foreach=False),
    "sgd_fused_maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True, fused=True),
}


def _controlled_vs_per_layer_groups(make, mults, steps=6, dtype=torch.float32):
    """The same model twice: one optimizer under a LayerControl with ``mults`` (by layer index),
    one built with a group per layer at ``lr x m`` (the split's update by construction)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    b = copy.deepcopy(a)
    opt_a = make(list(a.parameters()))
    ctl = LayerControl.of(opt_a)
    ctl.set_multipliers("t", {p: mults[i // 2] for i, p in enumerate(a.parameters())})
    base = opt_a.param_groups[0]["lr"]
    opt_b = make([{"params": list(b[2 * i].parameters()), "lr": base * m} for i, m in enumerate(mults)])
    x, y = torch.randn(32, 8, dtype=dtype), torch.randint(0, 3, (32,))
    for _ in range(steps):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return a, b, ctl, opt_a


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_rescaling_gives_every_layer_the_update_at_lr_times_its_multiplier(name):
    """For every optimizer whose update is linear in the LR, stretching the update by m after a
    one-group step equals a step with a group per layer at lr x m, to the rounding of a weight."""
    a, b, ctl, opt = _controlled_vs_per_layer_groups(_OPTIMIZERS[name], [0.0, 2.5, 0.3])
    assert ctl._rescale_cache[1] is not None and len(opt.param_groups) == 1  # the fast path ran
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)  # the ShadowOracle's tolerance
    assert torch.equal(a[0].weight, b[0].weight)  # m = 0: bitwise untouched, as at lr 0
    # the copies are per parameter, in its dtype and on its device, and only of scaled ones
    (params, before, weights), = ctl._rescale_cache[1]
    assert len(params) == 6 and weights == pytest.approx([1.0, 1.0, -1.5, -1.5, 0.7, 0.7])
    assert all(c.shape == p.shape and c.dtype == p.dtype for p, c in zip(params, before))


def test_the_split_stays_where_rescaling_would_be_wrong(monkeypatch):
    """bf16 weights (their update rounds before the stretch), an optimizer not known to be
    linear in the LR (a subclass may step differently), Adagrad's lr_decay, a copy above
    RESCALE_MAX_BYTES, and on a CPU a split that adds few groups step with per-multiplier
    groups: the update at lr x m exactly."""
    import lalr_lightning.core.runtime.control as control

    class MyAdamW(torch.optim.AdamW):
        pass

    cases = {
        "bf16": (_OPTIMIZERS["adamw"], torch.bfloat16),
        "subclass": (lambda ps: MyAdamW(ps, lr=1e-2, weight_decay=0.1), torch.float32),
        "lr_decay": (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01), torch.float32),
        # one multiplier for every tensor: the split adds no group, cheaper than six stretches on a CPU
        "few groups": (_OPTIMIZERS["adamw"], torch.float32),
    }
    for case, (make, dtype) in cases.items():
        mults = [2.0, 2.0, 2.0] if case == "few groups" else [0.0, 2.5, 0.3]
        a, b, ctl, _ = _controlled_vs_per_layer_groups(make, mults, dtype=dtype)
        assert ctl._rescale_cache[1] is None, case
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb), case
    monkeypatch.setattr(control, "RESCALE_MAX_BYTES", 100)
    a, b, ctl, _ = _controlled_vs_per_layer_groups(_OPTIMIZERS["adamw"], [0.0, 2.5, 0.3])
    assert ctl._rescale_cache[1] is None
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_a_multiplier_far_above_one_is_stepped_by_the_split(monkeypatch):
    """The stretch multiplies the rounding of the step by m as well (``m/2`` ulps of the weight
    instead of half of one): a head at 100x a fine-tuning LR of 1e-5 got its update wrong by
    5e-4 of itself after 20 AdamW steps. Above RESCALE_MAX_MULTIPLIER the split steps, exactly."""
    import lalr_lightning.core.runtime.control as control

    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 10**9)  # the stretch wherever it is allowed
    a, b, ctl, _ = _controlled_vs_per_layer_groups(_OPTIMIZERS["adamw"], [0.5, control.RESCALE_MAX_MULTIPLIER, 1.0])
    assert ctl._rescale_cache[1] is not None
    a, b, ctl, _ = _controlled_vs_per_layer_groups(_OPTIMIZERS["adamw"], [0.5, 100.0, 1.0])
    assert ctl._rescale_cache[1] is None
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


def test_rescaling_follows_frozen_masked_and_moved_parameters():
    """A frozen parameter is left out of the copies; masks are enforced after the stretch; a
    change of the owners or a parameter moved to another dtype rebuilds the copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctl = LayerControl.of(opt)
    w0, w1 = model[0].weight, model[1].weight
    ctl.set_multipliers("m", {w0: 2.0, w1: 3.0})
    ctl.set_frozen("f", [w1])
    keep = torch.rand_like(w0) > 0.5
    ctl.set_masks("p", {w0: keep})
    frozen = w1.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    (params, copies, _), = ctl._rescale_cache[1]
    assert [id(p) for p in params] == [id(w0)]
    assert torch.equal(w1, frozen) and torch.all(w0[~keep] == 0) and torch.count_nonzero(w0[keep]) > 0
    ctl.set_multipliers("m", {w0: 0.5, w1: 3.0})  # a new decision: new weights, the same copies
    opt.step()
    (_, again, weights), = ctl._rescale_cache[1]
    assert again[0] is copies[0] and weights == [0.5]
    model.double()
    opt.zero_grad()
    model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
    opt.step()
    (params, before, _), = ctl._rescale_cache[1]
    assert before[0].dtype == torch.float64


@pytest.mark.parametrize("path", ["rescale", "split"])
def test_a_group_added_mid_fit_gets_its_layers_multipliers_and_freezing(path, monkeypatch):
    """``optimizer.add_param_group`` mid-fit (Lightning's BackboneFinetuning unfreezes that way):
    the added parameters step at lr x their multiplier, a frozen one stays, on either path."""
    import lalr_lightning.core.runtime.control as control

    if path == "split":  # a split is chosen whatever it adds (bf16 weights, an unknown optimizer)
        monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 0)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    mults = {0: 0.5, 1: 2.0, 2: 3.0}
    opt_a = torch.optim.SGD([*a[1].parameters(), *a[2].parameters()], lr=0.1, momentum=0.9)
    ctl = LayerControl.of(opt_a)
    # set while the backbone is in no optimizer yet: kept for when it joins
    ctl.set_multipliers("t", {p: mults[i] for i in mults for p in a[i].parameters()})
    ctl.set_frozen("f", [a[0].bias])
    opt_b = torch.optim.SGD([{"params": list(b[i].parameters()), "lr": 0.1 * mults[i]} for i in (1, 2)],
                            lr=0.1, momentum=0.9)
    x = torch.randn(8, 4)
    weight, bias = a[0].weight.detach().clone(), a[0].bias.detach().clone()
    for step in range(5):
        if step == 2:
            opt_a.add_param_group({"params": list(a[0].parameters())})
            opt_b.add_param_group({"params": [b[0].weight], "lr": 0.1 * mults[0]})
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert not torch.equal(a[0].weight, weight)
    for pa, pb in zip([a[0].weight, *a[1].parameters(), *a[2].parameters()],
                      [b[0].weight, *b[1].parameters(), *b[2].parameters()]):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[0].bias, bias) and len(opt_a.param_groups) == 2
    assert ctl.effective_lr(a[0].weight) == pytest.approx(0.05) and ctl.effective_lr(a[0].bias) == 0.0


@pytest.mark.parametrize("path", ["rescale", "split"])
def test_a_step_that_raised_and_was_caught_leaves_no_trace_on_the_next_steps(path, monkeypatch):
    """A user who catches an optimizer error and goes on (skip the batch): the next steps take
    fresh copies and the user's groups, as a per-layer-group optimizer does."""
    import lalr_lightning.core.runtime.control as control

    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 0 if path == "split" else 10**9)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    ctl = LayerControl.of(opt_a)
    ctl.set_multipliers("t", {a[0].weight: 2.0, a[1].weight: 0.5})
    ctl.set_masks("p", {a[1].weight: torch.rand(2, 4) > 0.3})
    opt_b = torch.optim.Adam([{"params": [b[0].weight], "lr": 0.2}, {"params": [b[1].weight], "lr": 0.05},
                              {"params": [b[0].bias, b[1].bias], "lr": 0.1}])
    b[1].weight.data.mul_(a[1].weight != 0)
    x = torch.randn(8, 4)
    for step in range(5):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if step == 2:  # Adam refuses a sparse gradient, after the step began
                model[0].weight.grad = model[0].weight.grad.to_sparse()
                with pytest.raises(RuntimeError, match="sparse"):
                    opt.step()
                with torch.no_grad():  # the caller goes back to weights it trusts
                    for p in model.parameters():
                        p.mul_(0.9)
                continue
            if model is b:
                b[1].weight.grad.mul_(a[1].weight != 0)
            opt.step()
            if model is b:
                b[1].weight.data.mul_(a[1].weight != 0)
        assert len(opt_a.param_groups) == 1  # given back as the error left step (the step guard)
    ctl_path = "rescale" if ctl._rescale_cache[1] else "split"
    assert ctl_path == path
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


class SkipOnErrorMLP(ToyMLP):
    """Manual optimization that skips a batch whose step raises; per-layer groups at lr x m when
    ``mults`` are given (the oracle), the user's one group otherwise."""

    def __init__(self, mults=None, *, schedule_in_step=False, **kw):
        super().__init__(**kw)
        self.mults = mults
        self.schedule_in_step = schedule_in_step
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(batch[0]), batch[1]))
        if batch_idx == 2:  # Adam refuses a sparse gradient, after the step began
            self.net[0].weight.grad = self.net[0].weight.grad.to_sparse()
        try:
            opt.step()
        except RuntimeError as e:
            assert "sparse" in str(e)
        if self.schedule_in_step:  # right after the caught error: the split must be gone already
            self.lr_schedulers().step()

    def on_train_batch_end(self, *args):
        if not self.schedule_in_step:  # after the callbacks' own
            self.lr_schedulers().step()

    def configure_optimizers(self):
        if self.mults is None:
            groups = [{"params": list(self.parameters())}]
        else:
            groups = [{"params": list(self.net[int(k[-1])].parameters()), "lr": 0.05 * m} for k, m in self.mults.items()]
            groups.append({"params": [p for i in (4, 6) for p in self.net[i].parameters()]})
        opt = torch.optim.Adam(groups, lr=0.05)
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8**step)]


@pytest.mark.parametrize("in_step", [False, True], ids=["scheduled_after", "scheduled_in_training_step"])
@pytest.mark.parametrize("path", ["rescale", "split"])
def test_a_caught_step_error_in_manual_optimization_leaves_the_scheduler_the_users_groups(path, in_step, monkeypatch):
    """Also with the scheduler stepped inside training_step right after the caught error: the
    step guard gave the groups back as the error left ``step`` (before it, the split's scheduled
    LR was lost on the split path)."""
    import lalr_lightning.core.runtime.control as control

    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 0 if path == "split" else 10**9)
    mults = {"net.0": 2.0, "net.2": 0.5}
    a, b = SkipOnErrorMLP(schedule_in_step=in_step), SkipOnErrorMLP(mults, schedule_in_step=in_step)
    _trainer([LayerLRMultiplier(mults)], max_epochs=1).fit(a)
    _trainer([], max_epochs=1).fit(b)
    assert len(a.trainer.optimizers[0].param_groups) == 1
    for pa, pb in zip(a.parameters(), b.parameters()):  # Adam's 1/sqrt(v) magnifies the stretch's rounding
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-5)


class StepFailsMLP(ToyMLP):
    def on_before_optimizer_step(self, optimizer):
        if self.global_step == 2:
            self.net[0].weight.grad = self.net[0].weight.grad.to_sparse()  # the step will raise

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def test_a_checkpoint_saved_on_an_optimizer_error_holds_the_users_groups(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    import lalr_lightning.core.runtime.control as control

    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 0)  # the split
    model = StepFailsMLP()
    trainer = _trainer([LayerLRMultiplier({"net.0": 2.0, "net.2": 0.5}), OnExceptionCheckpoint(tmp_path)],
                       max_epochs=1, enable_checkpointing=True)
    with pytest.raises(RuntimeError, match="sparse"):
        trainer.fit(model)
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert len(saved["optimizer_states"][0]["param_groups"]) == 1
    assert len(trainer.optimizers[0].param_groups) == 1


def test_rescaling_follows_part_of_the_model_cast_mid_fit(monkeypatch):
    """A cast of one layer (not the one a plan is checked by first) re-plans: torch's grouped
    lerp would refuse the old copies' dtype with an error from deep inside."""
    import lalr_lightning.core.runtime.control as control

    monkeypatch.setattr(control, "SPLIT_GROUP_TENSORS", 10**9)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ctl = LayerControl.of(opt_a)
    ctl.set_multipliers("t", {**{p: 2.0 for p in a[0].parameters()}, **{p: 3.0 for p in a[1].parameters()}})
    opt_b = torch.optim.SGD([{"params": list(b[0].parameters()), "lr": 0.2},
                             {"params": list(b[1].parameters()), "lr": 0.3}], momentum=0.9)
    x = torch.randn(8, 4)
    for step in range(4):
        if step == 2:
            a[1].double()
            b[1].double()
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model[1](model[0](x).to(model[1].weight.dtype)).pow(2).mean().backward()
            opt.step()
    assert a[1].weight.dtype == torch.float64 and len(ctl._rescale_cache[1]) == 2  # float32 and float64
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- masks


def _sgd_toy(momentum=0.9):
    model = ToyMLP()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=1e-3)


def test_masks_zero_weights_gradients_and_state_and_compose():
    model, opt = _sgd_toy()
    w = model.net[2].weight
    model(torch.randn(8, 16)).sum().backward()
    opt.step()  # momentum buffers exist now
    a = torch.rand_like(w) > 0.5
    b = torch.rand_like(w) > 0.5
    ctl = LayerControl.of(opt)
    ctl.set_masks("a", {w: a})
    assert torch.all(w[~a] == 0)  # zeroed at once
    assert torch.all(opt.state[w]["momentum_buffer"][~a] == 0)  # and their momentum
    ctl.set_masks("b", {w: b}, zero_state=False)
    assert torch.equal(ctl.mask(w), a & b)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        ctl.mask_gradients()  # what the callbacks' on_before_optimizer_step does
        assert torch.all(w.grad[~(a & b)] == 0)
        opt.step()
        assert torch.all(w[~(a & b)] == 0) and torch.count_nonzero(w[a & b]) > 0
    model.double()  # the cached masks follow the weights' dtype: a pass in float64, exactly as before
    opt.zero_grad()
    model(torch.randn(8, 16, dtype=torch.float64)).sum().backward()
    opt.step()
    assert all(k.dtype == torch.float64 for _, ks in ctl._grouped_masks() for k in ks)
    assert torch.all(w[~(a & b)] == 0) and torch.count_nonzero(w[a & b]) > 0
    ctl.clear("a")
    assert torch.equal(ctl.mask(w), b)
    with pytest.raises(ValueError, match="shape"):
        ctl.set_masks("c", {w: a[:2]})


# ----------------------------------------------------------------------------- post-step transforms


def test_transforms_run_in_order_with_the_lr_each_parameter_used_then_masks():
    model, opt = _sgd_toy(momentum=0.0)
    ctl = LayerControl.of(opt)
    w0, w2, w4 = model.net[0].weight, model.net[2].weight, model.net[4].weight
    ctl.set_multipliers("m", {w2: 3.0})
    ctl.set_frozen("f", [w4])
    keep = torch.ones_like(w2, dtype=torch.bool)
    keep[0] = False
    ctl.set_masks("p", {w2: keep})
    calls = []

    def late(step):
        calls.append(("late", step.lr(w0), step.lr(w2), step.lr(w4), any(p is w4 for p in step.params)))
        with torch.no_grad():
            w2.fill_(1.0)  # a transform that writes every entry: the mask wins afterwards

    def early(step):
        calls.append(("early",))

    ctl.set_transform("late", late, order=1.0)
    ctl.set_transform("early", early, order=-1.0)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    assert calls == [("early",), ("late", 0.1, pytest.approx(0.3), 0.0, False)]
    assert torch.all(w2[0] == 0) and torch.all(w2[1:] == 1.0)
    ctl.set_transform("late", None)
    opt.step()
    assert len(calls) == 3  # only "early" ran


# ----------------------------------------------------------------------------- requires_grad


def test_requires_grad_is_tracked_per_owner_and_given_back():
    model = ToyMLP()
    w, b = model.net[0].weight, model.net[0].bias
    b.requires_grad_(False)  # the user's own choice
    LayerControl.set_requires_grad("a", [w, b], False)
    LayerControl.set_requires_grad("b", [w], False)
    assert not w.requires_grad and not b.requires_grad
    LayerControl.restore_requires_grad("a")
    assert not w.requires_grad  # "b" still keeps it off
    LayerControl.set_requires_grad("b", [w], True)
    assert w.requires_grad and not b.requires_grad  # the user's flags, never more
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LayerControl.set_requires_grad("c", [w], False)
    LayerControl.of(opt).clear("c")  # clearing an owner gives its flags back too
    assert w.requires_grad


def test_release_state_frees_frozen_parameters_only_and_they_restart_fresh():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([a, b], lr=0.1)
    ctl = LayerControl.of(opt)
    for _ in range(2):
        (a.sum() ** 2 + (b**2).sum()).backward()
        opt.step()
        opt.zero_grad()
    assert ctl.release_state([a, b]) == 0  # nothing frozen: nothing released
    ctl.set_frozen("t", [a])
    assert ctl.release_state([a, b]) == 2 * 12 + 1  # two moments and the step count of a
    assert a not in opt.state and set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
    ctl.set_frozen("t", [])
    # a trains again from a fresh state: its next update is a new AdamW's first step
    fresh = a.detach().clone().requires_grad_(True)
    ref = torch.optim.AdamW([fresh], lr=0.1)
    (a.sum() ** 2 + (b**2).sum()).backward()
    (fresh.sum() ** 2).backward()
    opt.step()
    ref.step()
    assert torch.equal(a, fresh) and int(opt.state[a]["step"]) == 1


def test_grad_off_by_lists_what_an_owner_keeps_off():
    model = ToyMLP()
    w, v = model.net[0].weight, model.net[2].weight
    v.requires_grad_(False)  # the user's
    LayerControl.set_requires_grad("x", [w, v], False)
    LayerControl.set_requires_grad("y", [w], False)
    assert {id(p) for p in LayerControl.grad_off_by("x")} == {id(w), id(v)}
    LayerControl.restore_requires_grad("x")
    assert not w.requires_grad and not v.requires_grad  # y still keeps w off; v is the user's
    LayerControl.restore_requires_grad("y")
    assert w.requires_grad and not v.requires_grad and LayerControl.grad_off_by("y") == []


def test_grad_flags_of_sets_exactly_the_chosen_parameters_and_puts_every_flag_back():
    # torch's FSDP2 optimizer-state loader takes its template from these flags while it loads
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(net.parameters())
    net[0].bias.requires_grad_(False)  # a user's own choice, and one only an owner made
    LayerControl.set_requires_grad("owner", [net[1].weight], False)
    before = [p.requires_grad for p in net.parameters()]
    chosen = {id(net[0].bias), id(net[1].weight)}
    ctl = LayerControl.of(opt)
    ctl.set_frozen("owner", [net[1].weight])
    with pytest.raises(RuntimeError, match="loader failed"):
        with LayerControl.grad_flags_of([opt], lambda p: id(p) in chosen):
            assert [p.requires_grad for p in net.parameters()] == [id(p) in chosen for p in net.parameters()]
            for p in net.parameters():  # the loader's zero-learning-rate step: state for what it chose
                p.grad = torch.zeros_like(p) if p.requires_grad else None
            opt.step()
            assert {id(p) for p in opt.state} == chosen  # a frozen parameter too: the step ran bare
            raise RuntimeError("loader failed")
    assert [p.requires_grad for p in net.parameters()] == before == [True, False, False, True]
    net[1].weight.grad = torch.ones_like(net[1].weight)
    opt.step()  # the layer control engages again: the frozen weight keeps its value
    assert not opt.state[net[1].weight]["exp_avg"].any()
    ctl.clear("owner")
    LayerControl.restore_requires_grad("owner")
    assert net[1].weight.requires_grad


def test_grad_flags_of_drops_the_state_a_load_made_up():
    # a checkpoint with no optimizer state yet: every parameter gets a template, none keeps it
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net.weight.requires_grad_(False)
    with LayerControl.grad_flags_of([opt], lambda p: True, made_up=lambda p: p is net.weight):
        for p in net.parameters():  # the loader's zero-learning-rate step
            p.grad = torch.zeros_like(p)
        opt.step()
        assert set(opt.state) == {net.weight, net.bias}
    assert set(opt.state) == {net.bias} and not net.weight.requires_grad and net.bias.requires_grad
