"""HTSRPruning: AlphaPruning's ratio formula, the achieved sparsity, masks that hold through
training, resume and DDP, composition with TempBalance, and bad input."""

from __future__ import annotations

import copy
from functools import partial

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import HTSRPruning, TempBalanceCallback
from lalr_lightning.callbacks.host import Cadence
from lalr_lightning.core.pruning.alphapruning import (
    PRUNING_METRICS,
    block_average_values,
    cubic_sparsity,
    incremental_channel_budgets,
    magnitude_mask,
    pruning_ratios,
)
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.spectral import htsr
from lalr_lightning.models.cnn import SmallCNN
from tests._dist import ddp_spawn
from tests._oracles import ShadowOracle
from tests._toys import MemLogger, ToyMLP, make_trainer

# ----------------------------------------------------------------------------- the ratio formula

M = np.array([2.0, 3.0, 4.0, 6.0])
N = np.array([100.0, 200.0, 300.0, 400.0])


def _weighted_mean(r, n):
    return float((r * n).sum() / n.sum())


def test_ratios_more_for_larger_by_hand():
    # r = (m - 2) / 4 * 0.6 + 0.7 = [0.7, 0.85, 1.0, 1.3]; sum r n = 1060; scale = 0.5 * 1000 / 1060
    want = np.array([0.7, 0.85, 1.0, 1.3]) * 0.5 * 1000 / 1060
    got = pruning_ratios(M, N, 0.5, 0.3, "more_for_larger")
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert _weighted_mean(got, N) == pytest.approx(0.5, abs=0.005)


def test_ratios_more_for_smaller_by_hand():
    # r = (6 - m) / 4 * 0.6 + 0.7 = [1.3, 1.15, 1.0, 0.7]; sum r n = 940
    want = np.array([1.3, 1.15, 1.0, 0.7]) * 0.5 * 1000 / 940
    got = pruning_ratios(M, N, 0.5, 0.3, "more_for_smaller")
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert _weighted_mean(got, N) == pytest.approx(0.5, abs=0.005)


def test_epsilon_zero_is_uniform_and_constant_metric_is_uniform():
    np.testing.assert_allclose(pruning_ratios(M, N, 0.7, 0.0), np.full(4, 0.7))
    np.testing.assert_allclose(pruning_ratios(np.full(4, 3.3), N, 0.4, 0.3), np.full(4, 0.4))


def test_clipping_redistributes_excess_by_hand():
    # target 0.8: unclipped 0.8 * 1000 / 1060 * 1.3 = 0.981 > 0.95 -> layer 3 clipped to 0.95 and
    # the rest rescaled: (800 - 0.95 * 400) / (70 + 170 + 300) = 7/9
    got = pruning_ratios(M, N, 0.8, 0.3, max_ratio=0.95)
    np.testing.assert_allclose(got, [0.7 * 7 / 9, 0.85 * 7 / 9, 7 / 9, 0.95], rtol=1e-12)
    assert _weighted_mean(got, N) == pytest.approx(0.8, abs=1e-12)


def test_clipping_cascades_by_hand():
    # equal sizes, r = [0.7, 0.9, 1.1, 1.3], target 0.9, cap 0.95:
    # 0.9 r = [.63, .81, .99, 1.17] -> clip #3; (360 - 95) / 270 r = [.687, .883, 1.080] -> clip #2;
    # (360 - 190) / 160 r = [.744, .956] -> clip #1; (360 - 285) / 70 * 0.7 = 0.75
    got = pruning_ratios([0.0, 1.0, 2.0, 3.0], [100] * 4, 0.9, 0.3, max_ratio=0.95)
    np.testing.assert_allclose(got, [0.75, 0.95, 0.95, 0.95], rtol=1e-12)
    assert _weighted_mean(got, np.full(4, 100.0)) == pytest.approx(0.9, abs=1e-12)
    # the metric's order survives: more_for_smaller clips the other end
    got = pruning_ratios([3.0, 2.0, 1.0, 0.0], [100] * 4, 0.9, 0.3, "more_for_smaller", max_ratio=0.95)
    np.testing.assert_allclose(got, [0.75, 0.95, 0.95, 0.95], rtol=1e-12)


def test_overflow_error_names_the_fix():
    with pytest.raises(ValueError, match="lower epsilon"):
        pruning_ratios(M, N, 0.8, 0.3, overflow="error", max_ratio=0.95)
    # the same numbers under the cap are no error
    pruning_ratios(M, N, 0.5, 0.3, overflow="error", max_ratio=0.95)


@pytest.mark.parametrize("bad", [dict(target=1.0), dict(target=-0.1), dict(epsilon=1.2), dict(epsilon=-0.1)])
def test_bad_ratio_arguments(bad):
    kw = dict(target=0.5, epsilon=0.3) | bad
    with pytest.raises(ValueError):
        pruning_ratios(M, N, kw["target"], kw["epsilon"])


def test_block_average_and_cubic_schedule():
    v = block_average_values({"a": 1.0, "b": 3.0, "c": 5.0, "d": 7.0}, [["a", "b"], ["c"]])
    assert v == {"a": 2.0, "b": 2.0, "c": 5.0, "d": 7.0}
    # Zhu & Gupta with n = 4 events: 1 - (1 - t/4)^3 for t = 1..4
    assert [cubic_sparsity(e, 4) for e in range(4)] == pytest.approx([1 - 0.75**3, 1 - 0.5**3, 1 - 0.25**3, 1.0])


def test_incremental_channel_budget():
    ratios = [0.347, 0.05, 0.005, 0.999, 0.5]
    chans = [64, 100, 300, 10, 7]
    frac, counts = incremental_channel_budgets(ratios, chans, 0.01)
    # each layer climbs in steps of 0.01 and stops before passing its ratio, then floors channels
    np.testing.assert_allclose(frac, [0.34, 0.05, 0.0, 0.99, 0.5])
    assert counts.tolist() == [21, 5, 0, 9, 3]  # floor(21.76), 5, 0, floor(9.9), floor(3.5)


def test_magnitude_mask_counts_and_grows():
    w = torch.tensor([[0.5, -0.1, 0.3], [-0.7, 0.2, 0.05]])
    keep = magnitude_mask(w, 0.5)
    assert keep.tolist() == [[True, False, True], [True, False, False]]
    # growing: the old pruned set stays pruned even where |w| is now larger
    w2 = torch.tensor([[0.5, 9.0, 0.3], [-0.7, 0.2, 9.0]])
    keep2 = magnitude_mask(w2, 4 / 6, keep)
    assert not (keep2 & ~keep).any() and int((~keep2).sum()) == 4


# ----------------------------------------------------------------------------- helpers


_trainer = partial(make_trainer, max_epochs=2)


def _params(model):
    return dict(model.named_parameters())


class ZeroWatch(Callback):
    """Put *before* the pruner: after every optimizer step (before the pruner's own
    on_train_batch_end backstop) pruned entries of weights and optimizer states are zero."""

    def __init__(self, pruner: HTSRPruning):
        self.pruner = pruner
        self.checks = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = _params(pl_module)
        opt = trainer.optimizers[0]
        for name, keep in self.pruner.masks.items():
            p = params[name]
            assert torch.all(p.detach()[~keep] == 0), name
            for key, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    assert torch.all(v[~keep] == 0), (name, key)
            self.checks += 1


# ----------------------------------------------------------------------------- the callback acts


@pytest.mark.parametrize("direction", ["more_for_larger", "more_for_smaller"])
def test_callback_ratios_and_achieved_sparsity(direction):
    model = ToyMLP()
    initial = copy.deepcopy(model)
    pruner = HTSRPruning(target_sparsity=0.6, direction=direction)
    _trainer([pruner], max_epochs=1).fit(model)
    assert set(pruner.ratios) == {"net.0", "net.2", "net.4"} and "net.6" in pruner.excluded  # head stays dense
    # the metric is htsr.analyze's alpha (KS fit) of the weights at fit start ...
    df = htsr.analyze(initial, fit="ks", metrics=["alpha"])
    for name, v in pruner.metric_values.items():
        assert v == pytest.approx(float(df.set_index("name").loc[name, "alpha"]), rel=1e-6)
    # ... the ratios are the mapping's, with weighted mean = target
    names = list(pruner.ratios)
    n = np.array([_params(model)[f"{k}.weight"].numel() for k in names], dtype=float)
    want = pruning_ratios([pruner.metric_values[k] for k in names], n, 0.6, 0.3, direction)
    np.testing.assert_allclose([pruner.ratios[k] for k in names], want, rtol=1e-12)
    assert _weighted_mean(np.array([pruner.ratios[k] for k in names]), n) == pytest.approx(0.6, abs=0.005)
    order = np.argsort([pruner.metric_values[k] for k in names])
    r_sorted = np.array([pruner.ratios[k] for k in names])[order]
    assert np.all(np.diff(r_sorted) > 0) if direction == "more_for_larger" else np.all(np.diff(r_sorted) < 0)
    # each layer's zero fraction is its ratio to one element
    for k, numel in zip(names, n):
        zeros = int((_params(model)[f"{k}.weight"] == 0).sum())
        assert abs(zeros - pruner.ratios[k] * numel) <= 1
        assert pruner.sparsity[k] == pytest.approx(zeros / numel)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("when", ["fit_start", 1])
def test_pruned_weights_stay_zero_through_training(opt, when):
    model = ToyMLP(opt=opt)
    pruner = HTSRPruning(target_sparsity=0.5, when=when)
    watch = ZeroWatch(pruner)
    keys = set(model.state_dict())
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    _trainer([watch, pruner], max_epochs=3).fit(model)
    assert watch.checks > 0 and pruner.masks
    assert pruner.history[0]["epoch"] == (0 if when == "fit_start" else 1)
    for name, keep in pruner.masks.items():
        p = _params(model)[name]
        assert torch.all(p[~keep] == 0)
        assert not torch.equal(p[keep], before[name][keep])  # the kept weights did train
    assert set(model.state_dict()) == keys  # no weight_orig / weight_mask


class HeadOnlyMLP(ToyMLP):
    def configure_optimizers(self):  # the backbone stays frozen: only the head is in the optimizer
        return torch.optim.SGD(self.net[6].parameters(), lr=0.05)


def test_layers_no_optimizer_holds_are_pruned_too():
    model = HeadOnlyMLP()
    pruner = HTSRPruning(target_sparsity=0.5, epsilon=0.0)
    _trainer([pruner], max_epochs=1).fit(model)
    assert set(pruner.ratios) == {"net.0", "net.2", "net.4"}
    for name, keep in pruner.masks.items():
        assert torch.all(_params(model)[name][~keep] == 0) and (~keep).any()
    assert pruner.overall_sparsity() == pytest.approx(0.5, abs=0.01)


class OneOverflowMLP(ToyMLP):
    def training_step(self, batch, batch_idx):  # one batch whose gradients overflow: the scaler skips its step
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 2 else loss


def test_a_step_the_grad_scaler_skips_leaves_the_next_steps_gradients_masked():
    from lightning.pytorch.plugins import MixedPrecision

    model = OneOverflowMLP(opt="sgd")
    pruner = HTSRPruning(target_sparsity=0.5)
    scaler = torch.amp.GradScaler("cpu")  # Lightning gives a CPU run no scaler; a GPU fp16 run has one
    _trainer([pruner], max_epochs=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(model)
    assert scaler.get_scale() < 2.0**16  # the overflow was seen and its step skipped
    opt = model.trainer.optimizers[0]
    for name, keep in pruner.masks.items():
        p = _params(model)[name]
        assert torch.all(p[~keep] == 0)
        # no masked gradient reached the optimizer (nor the clipping) after the skipped step
        assert not opt.state[p]["momentum_buffer"][~keep].any(), name


class DriftSGD(torch.optim.SGD):
    """An update that moves every weight whatever its gradient (as decoupled noise or a
    proximal pull inside the step would): only the post-step mask can keep pruned weights zero."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(0.01)
        return loss


class DriftMLP(ToyMLP):
    def configure_optimizers(self):
        return DriftSGD(self.parameters(), lr=0.05)


def test_mask_is_reapplied_right_after_each_step():
    model = DriftMLP()
    pruner = HTSRPruning(target_sparsity=0.5)
    watch = ZeroWatch(pruner)  # runs before the pruner's own on_train_batch_end
    _trainer([watch, pruner], max_epochs=1).fit(model)
    assert watch.checks == 8 * 3
    for name, keep in pruner.masks.items():
        assert torch.all(_params(model)[name][~keep] == 0)


def test_resume_restores_masks_and_keeps_them(tmp_path):
    model = ToyMLP(opt="sgd")
    pruner = HTSRPruning(target_sparsity=0.5)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer([pruner, ckpt], max_epochs=2, enable_checkpointing=True).fit(model)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert set(saved["state_dict"]) == set(ToyMLP().state_dict())
    assert set(saved["callbacks"]["HTSRPruning"]["masks"]) == set(pruner.masks)

    model2 = ToyMLP(opt="sgd", seed=1)
    pruner2 = HTSRPruning(target_sparsity=0.5)
    watch = ZeroWatch(pruner2)
    resumed = {}

    class Grab(Callback):
        def on_train_start(self, trainer, pl_module):
            resumed.update({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    _trainer([watch, pruner2, Grab()], max_epochs=4).fit(model2, ckpt_path=str(tmp_path / "last.ckpt"))
    # masks came from the checkpoint, not from pruning again (on already-pruned weights)
    assert len(pruner2.history) == 1 and pruner2.metric_values == pruner.metric_values
    assert set(pruner2.masks) == set(pruner.masks)
    for name, keep in pruner.masks.items():
        assert torch.equal(pruner2.masks[name], keep)
        p = _params(model2)[name]
        assert torch.all(p[~keep] == 0)
        assert not torch.equal(p.detach(), resumed[name])  # training continued
    assert watch.checks == 2 * 8 * 3


def test_structured_channels_follow_incremental_budget():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
    model = SmallCNN(width=16)
    pruner = HTSRPruning(target_sparsity=0.5, structured=True)
    watch = ZeroWatch(pruner)
    _trainer([watch, pruner], max_epochs=1).fit(model, DataLoader(data, batch_size=16))
    assert set(pruner.ratios) == {"model.layer2.conv", "model.layer3.conv", "model.layer4.conv"}
    assert "model.layer1.conv" in pruner.excluded  # 144 weights, 9 eigenvalues
    params = _params(model)
    for layer, ratio in pruner.ratios.items():
        w = params[f"{layer}.weight"]
        c = w.shape[0]
        _, (count,) = incremental_channel_budgets([ratio], [c], 0.01)
        dead = (w.detach().reshape(c, -1) == 0).all(dim=1)
        assert int(dead.sum()) == count == pruner.channels[layer]
        assert pruner.sparsity[layer] == pytest.approx(count / c)
        bn = layer.replace("conv", "bn")
        assert torch.all(params[f"{bn}.weight"][dead] == 0) and torch.all(params[f"{bn}.bias"][dead] == 0)
    # a pruned channel outputs exactly zero after its BatchNorm
    model.eval()
    x = torch.randn(4, 1, 8, 8)
    block = model.model.layer2
    out = block(model.model.layer1(x))
    dead = (block.conv.weight.reshape(block.conv.weight.shape[0], -1) == 0).all(dim=1)
    assert dead.any() and torch.all(out[:, dead] == 0)


def test_gradual_cubic_schedule_and_logging():
    logger = MemLogger()
    pruner = HTSRPruning(target_sparsity=0.6, when="gradual", gradual_epochs=3)
    model = ToyMLP(opt="sgd")
    _trainer([ZeroWatch(pruner), pruner], max_epochs=4, logger=logger).fit(model)
    assert [h["epoch"] for h in pruner.history] == [0, 1, 2]
    assert [h["level"] for h in pruner.history] == pytest.approx([1 - (2 / 3) ** 3, 1 - (1 / 3) ** 3, 1.0])
    numel = {k: _params(model)[f"{k}.weight"].numel() for k in pruner.ratios}
    for h in pruner.history:
        for k, s in h["sparsity"].items():
            assert abs(s * numel[k] - h["level"] * pruner.ratios[k] * numel[k]) <= 1
    logged = {}
    for _, row in logger.rows:
        logged.update(row)
    for k in pruner.ratios:
        assert logged[f"pruning/ratio/{k}"] == pytest.approx(pruner.ratios[k])
        assert logged[f"pruning/sparsity/{k}"] == pytest.approx(pruner.sparsity[k])
        assert f"pruning/metric/{k}" in logged
    assert logged["pruning/overall_sparsity"] == pytest.approx(0.6, abs=0.005)


def test_make_permanent_drops_masks_keeps_zeros():
    model = ToyMLP()
    pruner = HTSRPruning(target_sparsity=0.5, epsilon=0.0, make_permanent=True)
    _trainer([pruner], max_epochs=1).fit(model)
    assert pruner.masks == {} and pruner.state_dict()["masks"] == {}
    assert set(pruner.ratios.values()) == {0.5}  # epsilon=0: uniform
    for k in pruner.ratios:
        assert int((_params(model)[f"{k}.weight"] == 0).sum()) == round(0.5 * _params(model)[f"{k}.weight"].numel())


def test_composes_with_tempbalance():
    model = ToyMLP(opt="sgd", sched="cosine")
    pruner = HTSRPruning(target_sparsity=0.5)
    tb = TempBalanceCallback()
    oracle = ShadowOracle()  # each update = scheduled LR x TempBalance's multiplier, pruned entries included
    watch = ZeroWatch(pruner)
    seen = []

    class Mults(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ctl = LayerControl.of(trainer.optimizers[0])
            seen.append(sorted(ctl.multiplier(_params(pl_module)[f"{k}.weight"]) for k in ("net.2", "net.4")))

    _trainer([watch, pruner, tb, oracle, Mults()], max_epochs=2).fit(model)
    assert oracle.steps == 16 and watch.checks > 0
    assert seen and all(m == pytest.approx([0.5, 1.5]) for m in seen)  # TempBalance's linear map of two layers
    for name, keep in pruner.masks.items():
        assert torch.all(_params(model)[name][~keep] == 0)


# ----------------------------------------------------------------------------- DDP


class PerturbRank1(Callback):
    """After DDP synced the weights, make rank 1's different: a rank-local decision would then
    give different masks."""

    def on_fit_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.add_(torch.randn_like(p))


class CheckRanksAgree(Callback):
    def __init__(self, pruner):
        self.pruner = pruner

    def on_train_end(self, trainer, pl_module):
        params = _params(pl_module.module if hasattr(pl_module, "module") else pl_module)
        code = 0.0
        for i, name in enumerate(sorted(self.pruner.masks)):
            keep = self.pruner.masks[name]
            code += float((torch.arange(keep.numel())[~keep.flatten()] + 1).double().pow(0.5).sum()) * (i + 1)
            assert torch.all(params[name][~keep] == 0)
        ratios = torch.tensor([self.pruner.ratios[k] for k in sorted(self.pruner.ratios)], dtype=torch.float64)
        codes = trainer.strategy.all_gather(torch.tensor([code], dtype=torch.float64))
        all_ratios = trainer.strategy.all_gather(ratios)
        assert codes.numel() == 2 and torch.all(codes == codes.flatten()[0]), codes
        assert torch.equal(all_ratios[0], all_ratios[1])
        trainer.callback_metrics["masks_agree"] = torch.tensor(1.0)


def test_ddp_ranks_hold_identical_masks():
    pruner = HTSRPruning(target_sparsity=0.5)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PerturbRank1(), pruner, CheckRanksAgree(pruner)])
    trainer.fit(ToyMLP(opt="sgd"))
    assert float(trainer.callback_metrics["masks_agree"]) == 1.0


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(target_sparsity=1.0), "target_sparsity"),
        (dict(target_sparsity=-0.2), "target_sparsity"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(metric="alpha_hat"), "valid: " + ", ".join(PRUNING_METRICS)),
        (dict(direction="up"), "more_for_larger"),
        (dict(when="later"), "fit_start"),
        (dict(when="gradual"), "gradual_epochs"),
        (dict(structured=True, layer_types=("linear", "embedding")), "embedding"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HTSRPruning(**kwargs)


def test_epsilon_pushing_a_ratio_past_the_cap_is_an_error_when_asked():
    pruner = HTSRPruning(target_sparsity=0.9, epsilon=1.0, overflow="error", max_ratio=0.95)
    with pytest.raises(ValueError, match="lower epsilon"):
        _trainer([pruner], max_epochs=1).fit(ToyMLP())


def test_a_parametrized_weight_is_left_dense_saying_why():
    from lalr_lightning.core.pruning.alphapruning import prunable_layers

    model = ToyMLP()
    torch.nn.utils.parametrizations.weight_norm(model.net[2])
    keep, excluded = prunable_layers(model, min_evals=2)
    assert "net.2" not in [la.name for la in keep] and "parametrize" in excluded["net.2"]
    pruner = HTSRPruning(target_sparsity=0.5, min_evals=2)
    _trainer([pruner], max_epochs=1).fit(model)
    assert set(pruner.ratios) == {"net.0", "net.4"} and min(pruner.sparsity.values()) > 0.1


def test_layers_too_small_to_prune():
    # some too small: a warning names them and the rest is pruned
    pruner = HTSRPruning(target_sparsity=0.5, min_numel=2000)
    with pytest.warns(UserWarning, match="net.0"):
        _trainer([pruner], max_epochs=1).fit(ToyMLP())
    assert set(pruner.ratios) == {"net.2", "net.4"}
    # all too small: an error naming the fix
    with pytest.raises(ValueError, match="lower min_numel"):
        _trainer([HTSRPruning(min_numel=10_000)], max_epochs=1).fit(ToyMLP())
    with pytest.raises(ValueError, match="min_evals"):
        _trainer([HTSRPruning(min_evals=100)], max_epochs=1).fit(ToyMLP())


def test_the_pruning_modes_are_schedules_of_the_shared_cycle():
    """fit-start, one epoch and gradual pruning are cadences the owner runs (no timeline of the
    method's own): once at the start, once at (or, resumed later, after) an epoch, once at each
    of the gradual epochs, never twice at one point."""
    assert HTSRPruning().cadence == Cadence(start=True)
    assert HTSRPruning(when=2).cadence == Cadence(epochs=(2,))
    assert HTSRPruning(when="gradual", gradual_epochs=3).cadence == Cadence(epochs=(0, 1, 2))
    once = Cadence(epochs=(2,))
    assert [once.due("epoch", e, None) for e in range(4)] == [False, False, True, True]
    assert not once.due("epoch", 3, {"epoch": 2, "step": 7}) and not once.due("step", 9, None)
    gradual = Cadence(epochs=(0, 1, 2))
    last = [None, {"epoch": 0, "step": 0}, {"epoch": 1, "step": 4}, {"epoch": 2, "step": 8}]
    assert [gradual.due("epoch", e, last[e]) for e in range(4)] == [True, True, True, False]
    assert not gradual.due("epoch", 1, {"epoch": 1, "step": 4})  # a resumed fit at a point already decided
