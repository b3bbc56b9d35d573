"""``callback.plan(model)``: the decision without a fit (no Trainer, no data) is the decision the
same callback makes at the start of a fit on the same weights -- scores and values exactly -- and
planning changes neither the model nor the callback."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

import lalr_lightning.callbacks as cbs
from lalr_lightning.models.cnn import SmallResNet
from tests._lm import lm_module
from tests._toys import ToyMLP, make_trainer


def _resnet():
    torch.manual_seed(0)
    return SmallResNet(num_classes=4, width=4, blocks_per_group=1,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _llama():
    return lm_module("llama", tied=False, hidden=32, layers=3)


def _mlp():
    return ToyMLP(width=64)


# (callback, model, the model's training data or None when the module brings its own)
CASES = {
    "tempbalance-resnet": (lambda: cbs.TempBalanceCallback(min_evals=5), _resnet, _loader),
    "tempbalance-mlp": (lambda: cbs.TempBalanceCallback(assign="step", min_evals=5), _mlp, None),
    "lalr-resnet": (lambda: cbs.LALRScheduleCallback(groups="histogram"), _resnet, _loader),
    "lalr-llama": (lambda: cbs.LALRScheduleCallback(), _llama, None),
    "pruning-resnet": (lambda: cbs.HTSRPruning(target_sparsity=0.3, min_numel=16, min_evals=3), _resnet, _loader),
    "pruning-structured": (lambda: cbs.HTSRPruning(target_sparsity=0.3, structured=True, min_numel=16, min_evals=3,
                                                   metric="stable_rank"), _resnet, _loader),
    "pruning-mlp": (lambda: cbs.HTSRPruning(target_sparsity=0.5, metric="stable_rank", min_numel=16, min_evals=3),
                    _mlp, None),
    "alphapruning-llama": (lambda: cbs.HTSRPruning(preset="alphapruning", target_sparsity=0.7), _llama, None),
    # the data criteria plan the same ratios (their masks need calibration data: not planned)
    "alphapruning-wanda-llama": (lambda: cbs.HTSRPruning(preset="alphapruning", target_sparsity=0.7,
                                                         criterion="wanda", n_calibration=4), _llama, None),
    "spectrum-llama": (lambda: cbs.SpectrumSelect(top_percent=50), _llama, None),
    "spectrum-resnet": (lambda: cbs.SpectrumSelect(top_percent=50), _resnet, _loader),
}


def _snapshot(model):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {n: p.requires_grad for n, p in model.named_parameters()},
            {n: m.training for n, m in model.named_modules()},
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()))


def _same_snapshot(a, b) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:])


def _first_decision(cb, model, data):
    """Fit one step with ``cb`` and return the first decision it commits."""
    seen = []
    commit = cb.commit

    def record(trainer, decision):
        seen.append(decision)
        commit(trainer, decision)

    cb.commit = record
    make_trainer([cb], max_epochs=1, limit_train_batches=1, limit_val_batches=0).fit(
        model, *([data()] if data else []))
    return seen[0]


@pytest.mark.parametrize("case", CASES)
def test_plan_is_the_decision_at_fit_start(case):
    make, build, data = CASES[case]
    cb, model = make(), build()
    before = _snapshot(model)
    plan = cb.plan(model)
    assert _same_snapshot(before, _snapshot(model)), "plan() changed the model"
    assert cb.layers == [] and cb.history == [] and cb.scores == {}, "plan() changed the callback"

    decision = _first_decision(cb, model, data)
    key, score = type(cb).traits.decision_key, type(cb).traits.score_key
    assert list(plan["layer"]) == list(decision.values)  # the same layers, in model order
    assert dict(zip(plan["layer"], plan[key])) == decision.values  # exactly: the same code on the same weights
    scored = dict(zip(plan["layer"], plan[score]))
    assert {n: scored[n] for n in decision.scores} == decision.scores
    assert all(np.isnan(v) for n, v in scored.items() if n not in decision.scores)  # Spectrum's always-trained
    for quantity, values in decision.measurements.items():
        assert dict(zip(plan["layer"], plan[quantity])) == values
    assert plan.attrs["record"] == {k: v for k, v in decision.record.items() if k in plan.attrs["record"]}
    if isinstance(cb, cbs.SpectrumSelect):
        assert list(plan.columns) == ["layer", "type", "snr", "selected"]
        assert dict(zip(plan["layer"], plan["type"])) == cb.module_types
        # the always-trained head and embeddings have no SNR: NaN in the table, selected
        always = plan[plan["snr"].isna()]
        assert set(always["selected"]) == {1.0} and len(always) >= 1


def test_a_plan_says_what_the_papers_rules_give():
    """By hand on the numbers of the table: TempBalance's linear map puts the smallest alpha at
    lr_min_ratio and the largest at lr_max_ratio, linearly between; HTSRPruning's ratio is the
    metric mapped linearly onto [1 - eps, 1 + eps], scaled so that the parameter-weighted mean
    is the target."""
    model = _resnet()
    tb = cbs.TempBalanceCallback(min_evals=5, lr_min_ratio=0.5, lr_max_ratio=1.5).plan(model)
    a = tb["alpha"].to_numpy()
    np.testing.assert_allclose(tb["multiplier"], 0.5 + (a - a.min()) / (a.max() - a.min()), rtol=1e-12)

    pruner = cbs.HTSRPruning(target_sparsity=0.4, epsilon=0.2, min_numel=16, min_evals=3)
    plan = pruner.plan(model)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    sizes = np.array([numel[f"{n}.weight"] for n in plan["layer"]])
    assert float((plan["ratio"] * sizes).sum() / sizes.sum()) == pytest.approx(0.4, abs=1e-12)
    m = plan["metric"].to_numpy()
    r = 0.8 + 0.4 * (m - m.min()) / (m.max() - m.min())  # the metric mapped onto [1 - eps, 1 + eps]
    np.testing.assert_allclose(plan["ratio"], 0.4 * r * sizes.sum() / (r * sizes).sum(), rtol=1e-12)
    assert list(plan.columns) == ["layer", "numel", "metric", "ratio"]
    assert list(plan["numel"]) == list(sizes)


def _weight_numel(model, layer: str) -> int:
    """The oracle: the parameter named ``<layer>.weight`` (or the tied embedding behind it)."""
    return dict(model.named_parameters())[f"{layer}.weight"].numel()


@pytest.mark.parametrize("family", ["resnet18", "gpt2-tied", "llama-alphapruning", "sequential"])
def test_pruning_plan_has_the_numel_its_target_is_weighted_by(family):
    """``plan()``'s ``numel`` column is each layer's weight count, and the ``numel``-weighted mean
    of ``ratio`` is the target (the plain mean is not: larger layers get larger ratios here)."""
    import timm
    from torch import nn

    from tests._lm import tiny_lm

    torch.manual_seed(0)
    model, pruner = {
        "resnet18": lambda: (timm.create_model("resnet18", num_classes=10), cbs.HTSRPruning(target_sparsity=0.7)),
        "gpt2-tied": lambda: (tiny_lm("gpt2", True, hidden=64),
                              cbs.HTSRPruning(target_sparsity=0.7, min_numel=16, min_evals=3)),
        "llama-alphapruning": lambda: (tiny_lm("llama", False, hidden=64, layers=3),
                                       cbs.HTSRPruning(preset="alphapruning", target_sparsity=0.5)),
        "sequential": lambda: (nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 256), nn.ReLU(),
                                             nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 4)),
                               cbs.HTSRPruning(target_sparsity=0.7, min_numel=16, min_evals=3, head=True)),
    }[family]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the layers left dense
        plan = pruner.plan(model)
    assert list(plan.columns) == ["layer", "numel", "metric", "ratio"] and len(plan) >= 4
    assert list(plan["numel"]) == [_weight_numel(model, n) for n in plan["layer"]]
    weighted = float((plan["ratio"] * plan["numel"]).sum() / plan["numel"].sum())
    assert weighted == pytest.approx(pruner.target_sparsity, abs=1e-12)
    if family == "resnet18":  # the case: the plain mean reads as if the target were missed
        assert float(plan["ratio"].mean()) == pytest.approx(0.63, abs=0.03)


def test_alphapruning_plan_averages_alpha_over_each_block():
    """The preset's block average: every matrix of a decoder block gets the block's metric and
    ratio; the head is left dense (not in the table)."""
    model = _llama()
    plan = cbs.HTSRPruning(preset="alphapruning", target_sparsity=0.5).plan(model)  # no ratio reaches max_ratio
    assert "model.lm_head" not in set(plan["layer"])
    blocks = plan["layer"].str.extract(r"layers\.(\d+)\.")[0]
    assert blocks.notna().all() and blocks.nunique() == 3
    for _, group in plan.groupby(blocks):
        assert group["metric"].nunique() == 1 and group["ratio"].nunique() == 1
    assert plan["ratio"].max() / plan["ratio"].min() == pytest.approx(1.3 / 0.7, rel=1e-12)  # eps = 0.3


def test_plan_of_a_plain_module_and_after_a_fit():
    """Any torch module will do (no LightningModule needed); after a fit the plan is the
    decision the callback would make next (LALR: the next phase), and the fit's own readable
    state is left alone."""
    lalr = cbs.LALRScheduleCallback(groups="histogram")
    lm = _resnet()
    first = lalr.plan(lm.model)  # the bare torch network inside the LightningModule
    assert first.attrs["record"] == {"phase": "svd"} and len(first) > 2
    make_trainer([lalr], max_epochs=1, limit_train_batches=1, limit_val_batches=0).fit(lm, _loader())
    history, multipliers = list(lalr.history), dict(lalr.multipliers)
    assert lalr.plan(lm).attrs["record"] == {"phase": "ce"}
    assert lalr.history == history and lalr.multipliers == multipliers and lalr.phase == "svd"


@pytest.mark.parametrize("make, match", [
    (lambda: cbs.AutoRGN(), "decides from the training data"),
    (lambda: cbs.SurgicalBlocks(select="last"), "not decide from the model's weights alone.*HTSRPruning, "
                                                "LALRScheduleCallback, SpectrumSelect, TempBalanceCallback"),
    (lambda: cbs.BlockSchedule(schedule="lisa", gamma=1, every_n_steps=2), "no decision without a fit"),
    (lambda: cbs.TempBalanceCallback(assign="sample_lr", min_evals=5), r"reads trainer\.optimizers"),
])
def test_callbacks_without_a_weights_only_decision_say_so(make, match):
    model = _resnet()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match):
        make().plan(model)
    assert _same_snapshot(before, _snapshot(model))  # SurgicalBlocks' configure would freeze: never reached


def test_plan_takes_a_module():
    with pytest.raises(TypeError, match="takes the model"):
        cbs.TempBalanceCallback().plan("resnet18")


def test_analyze_writes_the_pruning_plan(tmp_path, capsys):
    """``analyze DIR --pruning 0.7 --preset alphapruning`` writes the ratios the callback's plan
    gives the same weights, and says what it did in a few lines."""
    from transformers import AutoModelForCausalLM

    from lalr_lightning.cli import analyze_main
    from tests._lm import save_tiny_lm

    ckpt = save_tiny_lm(tmp_path / "llama", "llama", False, layers=3)
    out = tmp_path / "report"
    assert analyze_main([str(ckpt), "--pruning", "0.7", "--preset", "alphapruning", "--out", str(out),
                         "--no-plots"]) == 0
    said = capsys.readouterr().out
    table = __import__("pandas").read_csv(out / "pruning_alphapruning_0.7.csv")
    expected = cbs.HTSRPruning(preset="alphapruning", target_sparsity=0.7).plan(
        AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True))
    assert list(table.columns) == ["layer", "numel", "metric", "ratio"]
    assert list(table["layer"]) == list(expected["layer"])
    np.testing.assert_allclose(table["ratio"], expected["ratio"], rtol=1e-15)
    mean = float((table["ratio"] * table["numel"]).sum() / table["numel"].sum())
    assert mean == pytest.approx(0.7, abs=1e-12)
    assert "preset='alphapruning'" in said and "peak fit" in said and "mean 0.700" in said
    assert "left dense: 1: lm_head" in said and "capped at max_ratio 0.99" in said

    assert analyze_main([str(ckpt), "--pruning", "0.5", "--out", str(out), "--no-plots"]) == 0
    assert (out / "pruning_htsr_0.5.csv").exists()


@pytest.mark.parametrize("args", [["--preset", "alphapruning"], ["--pruning", "1.5"], ["--pruning", "-0.1"]])
def test_analyze_refuses_a_bad_pruning_request_in_one_line(args, capsys, tmp_path):
    from lalr_lightning.cli import analyze_main

    assert analyze_main(["resnet18", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--pruning takes a target sparsity in [0, 1)" in err


def test_plan_after_a_ddp_spawn_handback_leaves_the_callback_its_state():
    """After a ddp_spawn fit the worker's final state comes back with the launcher's own results
    (``extra``) and is put on the callback, once, before ``fit`` returns; planning with that
    callback plans on a copy, and no attribute read does anything (no ``__getattribute__``)."""
    import pickle
    from types import SimpleNamespace

    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    cb = cbs.TempBalanceCallback(min_evals=5)
    worker = pickle.loads(pickle.dumps(cb))  # what spawn hands the worker
    worker.history, worker.scores = [{"epoch": 0}], {"x": 2.0}
    launcher = object.__new__(_MultiProcessingLauncher)
    extra = launcher.get_extra_results(SimpleNamespace(callbacks=[worker], callback_metrics={}))
    launcher.update_main_process_results(SimpleNamespace(callbacks=[cb], callback_metrics={}), extra)
    assert cb.__dict__["history"] == [{"epoch": 0}] and cb.__dict__["scores"] == {"x": 2.0}
    cb.plan(_resnet())
    assert cb.__dict__["history"] == [{"epoch": 0}] and cb.__dict__["scores"] == {"x": 2.0}
    assert type(cb).__getattribute__ is object.__getattribute__
