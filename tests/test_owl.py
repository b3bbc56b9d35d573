"""OWL's per-layer ratios (``prune --preset owl`` and ``HTSRPruning(preset="owl")``) against the paper's
formula, and explicit ratios (``prune --ratios FILE``)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from lalr_lightning.core.pruning.owl import outlier_share, owl_ratios
from tests._lm import ALPHA_WORDS, save_tiny_lm, write_calibration_text
from tests._lm import run_cli as _run

_WORDS = ALPHA_WORDS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("owl")
    rng = random.Random(0)
    write_calibration_text(root / "calib.txt", rng)
    model = save_tiny_lm(root / "llama", "llama", False, layers=4, hidden=32, seed=1)
    return root, model


# ---------------------------------------------------------------------------- the formula by hand


def test_outlier_share_by_hand():
    # scores 1, 1, 1, 9 and 1, 1: mean 14/6; M = 2 puts the threshold at 4.67: one of six is an outlier
    scores = [torch.tensor([[1.0, 1.0, 1.0, 9.0]]), torch.tensor([[1.0], [1.0]])]
    assert outlier_share(scores, 2.0) == pytest.approx(100 / 6)
    assert outlier_share(scores, 4.0) == 0.0  # 9 < 4 x 2.33 = 9.33
    assert outlier_share([torch.tensor([2.0, 2.0, 2.0])], 1.0) == 0.0  # above, strictly


def test_owl_ratios_follow_the_paper_by_hand():
    # D = 1, 2, 4, 3 -> (D - 1) / 3 x 2 lambda = 0, 1/15, 1/5, 2/15 (lambda 0.1); mean 0.1;
    # ratios 0.6 - (r - 0.1): the block with the most outliers is pruned least
    got = owl_ratios([1.0, 2.0, 4.0, 3.0], 0.6, 0.1)
    assert got == pytest.approx([0.7, 0.6 + 0.1 - 1 / 15, 0.5, 0.6 + 0.1 - 2 / 15])
    assert sum(got) / 4 == pytest.approx(0.6)
    assert max(got) - min(got) == pytest.approx(0.2)  # the span is 2 lambda
    assert owl_ratios([5.0, 5.0, 5.0], 0.7, 0.08) == [0.7, 0.7, 0.7]  # no spread: uniform
    with pytest.raises(ValueError, match="lower --owl-lambda"):
        owl_ratios([0.0, 1.0], 0.05, 0.2)  # a negative ratio


# ---------------------------------------------------------------------------- the command


def _dense_shares(model_dir, samples, m):
    """OWL's D per block from one forward of the whole dense model (hooks on every linear input)."""
    from transformers import AutoModelForCausalLM

    return _shares_of(AutoModelForCausalLM.from_pretrained(model_dir).eval(), samples, m)


def _shares_of(model, samples, m):
    """OWL's D per block of a dense Hugging Face causal LM from one forward on ``samples``."""
    sq, handles = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in name:
            def hook(mod, args, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                sq[name] = sq.get(name, 0) + x.square().sum(0)
            handles.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=samples, use_cache=False)
    for h in handles:
        h.remove()
    blocks = {}
    for name, s in sq.items():
        w = model.get_submodule(name).weight.detach().double()
        blocks.setdefault(int(name.split(".")[2]), []).append(w.abs() * (s / samples.shape[0]).sqrt())
    return [outlier_share(blocks[i], m) for i in sorted(blocks)]


@pytest.mark.parametrize("in_memory", [False, True])
def test_prune_preset_owl_gives_the_formula_on_the_dense_activations(files, tmp_path, capsys, in_memory):
    from transformers import AutoTokenizer

    from lalr_lightning.oneshot.text import calibration_samples

    root, model = files
    out = tmp_path / "owl"
    code, _, err = _run(["prune", str(model), "--out", str(out), "--sparsity", "0.6", "--preset", "owl",
                         "--owl-m", "3", "--owl-lambda", "0.1", "--calibration", str(root / "calib.txt"),
                         "--n-samples", "8", "--seq-len", "16", *(["--in-memory"] if in_memory else [])], capsys)
    assert code == 0, err
    report = json.loads((out / "pruning.json").read_text())
    assert report["preset"] == "owl" and report["owl_m"] == 3 and report["owl_lambda"] == 0.1
    samples = calibration_samples(AutoTokenizer.from_pretrained(model), root / "calib.txt", 8, 16, 0, "text")
    shares = _dense_shares(model, samples, 3.0)
    assert len(set(shares)) > 1  # the blocks differ: the ratios are not uniform
    expected = owl_ratios(shares, 0.6, 0.1)
    for k, r in report["ratios"].items():
        block = int(k.split(".")[2])
        assert report["metric_values"][k] == pytest.approx(shares[block], abs=1e-6)
        assert r == pytest.approx(expected[block], abs=1e-6), k
        assert report["achieved"][k] == pytest.approx(r, abs=1 / 16)  # Wanda: int(ratio x columns) a row


def test_explicit_ratios_per_block_and_per_matrix(files, tmp_path, capsys):
    root, model = files
    listed = tmp_path / "r.json"
    listed.write_text(json.dumps([0.2, 0.4, 0.6, 0.8]))
    code, _, err = _run(["prune", str(model), "--out", str(tmp_path / "a"), "--criterion", "magnitude",
                         "--ratios", str(listed)], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "a" / "pruning.json").read_text())
    for k, r in report["ratios"].items():
        assert r == [0.2, 0.4, 0.6, 0.8][int(k.split(".")[2])]
        assert report["achieved"][k] == pytest.approx(r, abs=1e-3)
    # a previous run's pruning.json, one matrix changed: {name: ratio} of matrices
    report["ratios"]["model.layers.0.mlp.down_proj"] = 0.5
    (tmp_path / "p.json").write_text(json.dumps(report))
    code, _, err = _run(["prune", str(model), "--out", str(tmp_path / "b"), "--criterion", "magnitude",
                         "--ratios", str(tmp_path / "p.json")], capsys)
    assert code == 0, err
    again = json.loads((tmp_path / "b" / "pruning.json").read_text())
    assert again["ratios"] == report["ratios"]


@pytest.mark.parametrize("args, phrase", [
    (["--ratios", "LIST3"], "lists 3 ratios, the model has 4 decoder blocks"),
    (["--ratios", "UNKNOWN"], "no layer named ['model.layers.9']"),
    (["--ratios", "LIST3", "--sparsity", "0.5"], "--sparsity does not apply"),
    (["--preset", "owl", "--n", "2", "--m", "4"], "do not apply"),
    (["--owl-m", "5"], "add --preset owl"),
    (["--preset", "owl", "--owl-lambda", "0.7"], "--owl-lambda must be in [0, 0.5)"),
    (["--preset", "owl", "--metric", "alpha"], "leave them out"),
    (["--preset", "owl", "--criterion", "magnitude"], "--preset owl needs --calibration"),
])
def test_bad_recipes_are_one_line(files, tmp_path, capsys, args, phrase):
    root, model = files
    (tmp_path / "l3.json").write_text("[0.1, 0.2, 0.3]")
    (tmp_path / "u.json").write_text(json.dumps({"model.layers.9": 0.5}))
    args = [str(tmp_path / "l3.json") if a == "LIST3" else str(tmp_path / "u.json") if a == "UNKNOWN" else a
            for a in args]
    crit = [] if "--criterion" in args else ["--criterion", "magnitude"] if "--ratios" in args else []
    calib = [] if "magnitude" in args + crit else ["--calibration", str(root / "calib.txt")]
    code, _, err = _run(["prune", str(model), "--out", str(tmp_path / "o"), *crit, *calib, "--n-samples", "4",
                         "--seq-len", "16", *args], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert phrase in err, err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------- the callback


def _fit_owl(pruner, layers=4):
    from tests.test_pruning_criteria import LM, _fit

    module = LM(layers=layers)
    _fit(pruner, module)  # lr 0: the weights stay as pruning left them
    return module


@pytest.mark.parametrize("criterion", ["wanda", "magnitude"])
def test_callback_preset_owl_gives_the_formula_on_the_training_batches(criterion):
    from lalr_lightning.callbacks import HTSRPruning
    from lalr_lightning.oneshot.prune import prune_model
    from tests.test_pruning_criteria import LM

    pruner = HTSRPruning(preset="owl", target_sparsity=0.6, owl_m=3.0, owl_lambda=0.1, criterion=criterion,
                         n_calibration=6)
    module = _fit_owl(pruner)
    assert pruner.history[0]["calibration_samples"] == 6
    # the oracle: the first 6 training sequences through the dense model, hooks on every linear input
    dense = LM(layers=4)
    samples = next(iter(torch.utils.data.DataLoader(dense.train_dataloader().dataset, batch_size=6)))[0]
    shares = _shares_of(dense.model.eval(), samples, 3.0)
    assert len(set(shares)) > 1  # the blocks differ: the ratios are not uniform
    expected = owl_ratios(shares, 0.6, 0.1)
    assert len(pruner.ratios) == 4 * 7  # every matrix of the 4 blocks, none outside them
    for k, r in pruner.ratios.items():
        block = int(k.split(".")[3])
        assert r == pytest.approx(expected[block], abs=1e-9), k
        assert pruner.scores[k] == pytest.approx(shares[block], abs=1e-9)
        # magnitude: round(ratio x numel) of the layer; Wanda: int(ratio x columns) of every row
        assert pruner.sparsity[k] == pytest.approx(r, abs=1e-3 if criterion == "magnitude" else 1 / 32), k
    # equal-size blocks: the target is the ratios' mean, parameter-weighted or not
    assert pruner.overall_sparsity() == pytest.approx(0.6, abs=1e-3 if criterion == "magnitude" else 1 / 32)
    weights = dict(module.named_parameters())
    assert all(torch.all(weights[name][~keep] == 0) for name, keep in pruner.masks.items())
    # the one-shot command's OWL on the same model and samples: the same ratios
    report = prune_model(LM(layers=4).model, samples, sparsity=0.6, criterion="wanda", preset="owl", owl_m=3.0,
                         owl_lambda=0.1)
    assert {f"model.{k}": v for k, v in report.ratios.items()} == pytest.approx(pruner.ratios, abs=1e-9)


def test_callback_preset_owl_plan_reads_the_calibration_loader():
    from lalr_lightning.callbacks import HTSRPruning
    from tests.test_pruning_criteria import LM

    module = LM(layers=4)
    loader = module.train_dataloader()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    plan = HTSRPruning(preset="owl", target_sparsity=0.5, calibration=loader, n_calibration=8).plan(module)
    samples = torch.cat([b[0] for b in loader])
    expected = owl_ratios(_shares_of(LM(layers=4).model.eval(), samples, 5.0), 0.5, 0.08)
    assert plan.ratio.tolist() == pytest.approx([expected[int(k.split(".")[3])] for k in plan.layer], abs=1e-9)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # not touched


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(preset="owl", metric="alpha"), "leave out metric"),
    (dict(preset="owl", epsilon=0.2), "leave out epsilon"),
    (dict(preset="owl", fit="peak", block_average=True), "leave out block_average, fit"),
    (dict(owl_m=5.0), "add preset='owl'"),
    (dict(preset="alphapruning", owl_lambda=0.1), "add preset='owl'"),
    (dict(preset="owl", owl_lambda=0.7), "owl_lambda must be in [0, 0.5)"),
    (dict(preset="owl", owl_m=0), "owl_m must be a number > 0"),
    (dict(preset="owl", criterion="wanda", n=2, m=4), "drop preset"),
    (dict(preset="owl", owl_m=float("inf")), "owl_m must be a number > 0"),
])
def test_callback_bad_owl_arguments_are_one_line(kwargs, phrase):
    from lalr_lightning.callbacks import HTSRPruning

    with pytest.raises(ValueError) as info:
        HTSRPruning(**kwargs)
    assert phrase in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_callback_owl_without_calibration_or_blocks_is_one_line():
    from lalr_lightning.callbacks import HTSRPruning
    from tests._toys import ToyMLP, make_trainer
    from tests.test_pruning_criteria import LM

    with pytest.raises(ValueError, match=r"pass calibration=<a DataLoader>") as info:
        HTSRPruning(preset="owl").plan(LM(layers=2))  # no fit to take the training batches from
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"has none: use another preset") as info:
        make_trainer([HTSRPruning(preset="owl", min_numel=1)], max_steps=1).fit(ToyMLP())
    assert "\n" not in str(info.value)
    # OWL's ratios keep a magnitude prune's calibration arguments; other criteria's arguments stay refused
    assert HTSRPruning(preset="owl", n_calibration=4).n_calibration == 4
    with pytest.raises(ValueError, match="does not use percdamp"):
        HTSRPruning(preset="owl", percdamp=0.1)


def test_callback_owl_gradual_measures_once_and_reaches_the_target():
    from lalr_lightning.callbacks import HTSRPruning
    from tests.test_pruning_criteria import LM, _fit

    pruner = HTSRPruning(preset="owl", target_sparsity=0.5, when="gradual", gradual_epochs=2, n_calibration=6)
    _fit(pruner, LM(layers=4), max_steps=-1, max_epochs=2)
    assert [h["level"] for h in pruner.history] == pytest.approx([0.875, 1.0])  # the cubic schedule
    assert len(set(pruner.ratios.values())) == 4  # one ratio per block, from the first event's dense model
    assert sum(pruner.ratios.values()) / len(pruner.ratios) == pytest.approx(0.5)
    assert pruner.overall_sparsity() == pytest.approx(0.5, abs=1e-3)
