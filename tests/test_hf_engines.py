"""The package's callbacks on Hugging Face's Trainer under DeepSpeed ZeRO-2 and ZeRO-3, two CPU ranks
(gloo): one ``torch.distributed.run`` of tests/_hf_engines.py runs every case below, each rank
writing what the engine held and the weights after every step.

What must hold (issue 41): a static selection's frozen parameters get no fp32 partition and no
optimizer state; a switching one (LISA) never moves a frozen block and trains an activated one,
holding optimizer state only for what trains; per-layer learning rates reach the update; pruning
masks hold on the partitions; a resume from the engine's own checkpoint continues exactly; and
what cannot work under ZeRO is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import hf_launch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed", reason="the DeepSpeed tests need deepspeed (pip install -e '.[dev]')")

#: the pruning modes that write weights under ZeRO-1/2, each against a plain run of the same pruning
#: (magnitude is zero2-pruning; sparsegpt1 prunes at epoch 1's start, after two optimizer steps)
ZERO12_PRUNING = ["zero2-wanda", "zero2-sparsegpt", "zero1-sparsegpt", "zero2-nm", "zero2-owl", "zero2-sparsegpt1"] + [
    "zero2-sparsegpt-bf16", "zero1-sparsegpt-bf16"]
#: run in this order in one launch: a resume reads the checkpoint its uninterrupted run wrote
CASES = ["zero2-none", "zero2-none-resume", "zero2-lisa", "zero2-lisa-resume", "zero2-spectrum", "zero2-spectrum-resume",
         "zero2-surgical", "zero2-multiplier", "zero2-tempbalance", "zero2-tempbalance-resume", "zero2-pruning",
         "zero2-pruning-resume", "zero2-proximal", "zero2-lmsa", "zero2-ntk", "zero2-lalr", "zero2-rgn", "zero2-eb",
         *ZERO12_PRUNING,
         "zero3-none", "zero3-none-resume", "zero3-tempbalance", "zero3-tempbalance-resume", "zero3-spectrum-init",
         "zero3-spectrum", "zero3-spectrum-resume", "zero3-ntkselect", "zero3-lisa", "zero3-lisa-resume",
         "zero3-pruning", "zero3-pruning-resume", "zero3-gradual", "zero3-lalr", "zero3-rgn", "zero3-eb", "zero3-wanda",
         "zero3-tempbalance-init"]
#: refused in one line: (case, a phrase naming what works)
REFUSED = {"zero2-proximal": "DDP", "zero2-lmsa": "DDP", "zero2-ntk": "DDP",
           "zero3-spectrum-init": "create the model before the TrainingArguments", "zero3-wanda": "ZeRO-2",
           "zero3-tempbalance-init": "create the model before the TrainingArguments", "zero1-sparsegpt-bf16": "ZeRO-2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return hf_launch(tmp_path_factory, "hf_engines", Path(__file__).with_name("_hf_engines.py"), CASES, timeout_s=900)


def _frozen(rec: dict, selected: list[str]) -> list[str]:
    return [n for u, names in rec["layers"].items() if u not in selected for n in names]


def _moved(a: dict, b: dict, names) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


@pytest.mark.parametrize("case", [c for c in CASES if c not in REFUSED])
def test_the_real_engine_runs_each_case_on_two_ranks(runs, case):
    for rank in (0, 1):
        rec = runs(case, rank)
        assert rec["error"] is None, rec["error"]
        counts = rec["end_counts"]
        stage3 = case.startswith("zero3")
        assert counts["engine"] == "DeepSpeedEngine" and counts["world"] == 2
        assert counts["zero"] == ("DeepSpeedZeroOptimizer_Stage3" if stage3 else "DeepSpeedZeroOptimizer")
        # each rank holds its half of every flat partition (a DDP fallback would hold all of it)
        trained = sum(rec["numel"][n] for _, _, names in counts["flats"] for n in names)
        assert 0 <= 2 * counts["fp32"] - trained < 2 * 16 * len(counts["flats"])


@pytest.mark.parametrize("case", ["zero2-spectrum", "zero3-spectrum", "zero2-surgical", "zero3-ntkselect"])
def test_a_static_selection_leaves_frozen_parameters_out_of_the_partitions(runs, case):
    full = runs("zero2-none")["end_counts"]
    for rank in (0, 1):
        rec = runs(case, rank)
        selected = rec["steps"][-1][1]
        frozen = _frozen(rec, selected)
        assert frozen and selected
        counts = rec["end_counts"]
        held = {n for _, _, names in counts["flats"] for n in names}
        assert not held & set(frozen)  # no fp32 partition, hence no optimizer state nor gradient buffer
        trainable = sum(n for name, n in rec["numel"].items() if name not in frozen)
        assert 2 * counts["fp32"] - trainable < 2 * 16 * len(counts["flats"]) < full["fp32"]
        assert counts["state"] == 2 * counts["fp32"]  # AdamW's two moments of what trains, nothing else
        assert max(rec["grads"]) <= max(f for f, _, _ in counts["flats"])
        start, end = rec["start"], rec["steps"][-1][2]
        assert _moved(start, end, frozen) == 0.0
        assert _moved(start, end, [n for n in held]) > 0


@pytest.mark.parametrize("case", ["zero2-lisa", "zero3-lisa"])
def test_lisa_switches_under_zero_a_frozen_block_never_moves_an_activated_one_trains(runs, case):
    for rank in (0, 1):
        rec = runs(case, rank)
        middle = [u for u in rec["layers"] if u.startswith("model.layers.")]
        prev, activated = rec["start"], set()
        for step, selected, w, counts, _ in rec["steps"]:
            on = [u for u in middle if u in selected]
            assert len(on) == 1
            for u in middle:
                moved = _moved(prev, w, rec["layers"][u])
                assert (moved > 0) == (u in on), (step, u, moved)
            activated |= set(on)
            # optimizer state only for the stem, head and the block that trains now
            for _, has_state, names in counts["flats"]:
                block = {u for u in middle if set(names) <= set(rec["layers"][u])}
                assert has_state == (not block or block <= set(on)), (step, names)
            prev = w
        assert len(activated) >= 2  # it switched, and the block switched on trained


def test_lisa_under_zero3_matches_zero2(runs):
    b = runs("zero3-lisa")["steps"]  # ZeRO-3 runs 3 steps (its steps are the slow ones)
    a = runs("zero2-lisa")["steps"][len(b) - 1][2]
    b = b[-1][2]
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-5)  # the engines reduce in another order


@pytest.mark.parametrize("case", ["zero2-multiplier", "zero2-tempbalance", "zero2-lalr", "zero2-rgn", "zero3-tempbalance",
                                  "zero3-lalr", "zero3-rgn"])
def test_per_layer_learning_rates_reach_the_engines_update(runs, case):
    rec, plain = runs(case), runs(f"{case.split('-')[0]}-none")
    mults = rec["steps"][0][4]  # the multipliers of the first step (decided at the fit's start)
    assert mults and any(abs(m - 1) > 1e-3 for m in mults.values())
    start, first = rec["start"], rec["steps"][0][2]
    base = plain["steps"][0][2]
    checked = 0
    for layer, names in rec["layers"].items():
        m = float(mults.get(layer, 1.0))
        for n in names:
            torch.testing.assert_close(first[n] - start[n], m * (base[n] - plain["start"][n]), rtol=1e-4, atol=1e-7)
            checked += m != 1.0
    assert checked


def test_pruning_masks_hold_on_the_partitions_and_after_a_resume(runs):
    rec, again = runs("zero2-pruning"), runs("zero2-pruning-resume")
    start = rec["start"]
    pruned = {n: start[n] == 0 for n in start if start[n].dim() == 2 and (start[n] == 0).float().mean() > 0.2}
    assert pruned
    for run in (rec, again):
        for _, _, w, _, _ in run["steps"]:
            for n, zero in pruned.items():
                assert not w[n][zero].any(), n
                assert (w[n] != start[n]).any()


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
@pytest.mark.parametrize("method", ["none", "lisa", "spectrum", "tempbalance", "pruning"])
def test_resume_from_the_engines_checkpoint_continues_exactly(runs, stage, method):
    for rank in (0, 1):
        whole, resumed = runs(f"{stage}-{method}", rank), runs(f"{stage}-{method}-resume", rank)
        assert [s[0] for s in whole["steps"]] == [1, 2, 3, 4] and [s[0] for s in resumed["steps"]] == [3, 4]
        for (step, _, a, _, _), (_, _, b, _, _) in zip(whole["steps"][2:], resumed["steps"]):  # steps 3 and 4
            for n in a:
                assert torch.equal(a[n], b[n]), (method, step, n, float((a[n] - b[n]).abs().max()))
        if method != "none":  # the callback's decisions go on as in the run that never stopped
            assert resumed["history"] == whole["history"]


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_zero_cannot_run_is_refused_in_one_line_naming_what_works(runs, case):
    err = runs(case)["error"]
    assert err is not None and "\n" not in err and REFUSED[case] in err


def _decisions(rec: dict) -> list[tuple]:
    return [(h["step"], h["multipliers"], h.get("scores")) for h in rec["history"]]


@pytest.mark.parametrize("method", ["tempbalance", "lalr", "rgn", "eb"])
def test_measuring_under_zero3_gathers_the_layers_and_decides_as_zero2(runs, method):
    two = runs(f"zero2-{method}")
    for rank in (0, 1):
        three = runs(f"zero3-{method}", rank)
        # every weight was an empty placeholder between forwards: what was measured was gathered,
        # one layer at a time, never more than the largest weight (of 12,272 parameters; Auto-RGN
        # gathers only the 1-D tensors, for its zero-scale check: its forward gathers the rest)
        assert three["placeholders"] == len(three["numel"])
        assert three["gathered"] and max(three["gathered"]) <= max(three["numel"].values())
        a, b = _decisions(two), _decisions(three)
        assert len(a) == len(b) >= 1 and [s for s, _, _ in a] == [s for s, _, _ in b]
        # the first decision is on the initial weights: the same numbers (AutoRGN's from the
        # gradients the two engines' forwards give, equal to rounding); later ones follow the weights,
        # which the engines reduce in another order
        for i, ((_, ma, sa), (_, mb, sb)) in enumerate(zip(a, b)):
            assert ma.keys() == mb.keys() and (sa or {}).keys() == (sb or {}).keys()
            tol = ({"rtol": 0, "atol": 0} if method in ("tempbalance", "lalr") else {"rtol": 1e-6, "atol": 1e-12}) \
                if i == 0 else {"rtol": 1e-5, "atol": 1e-9}
            for k in ma:
                assert ma[k] == pytest.approx(mb[k], rel=tol["rtol"], abs=tol["atol"]), (method, i, k)
            for k in sa or {}:
                if sa[k] != sb[k]:  # inf == inf
                    assert sa[k] == pytest.approx(sb[k], rel=tol["rtol"], abs=tol["atol"]), (method, i, k)


@pytest.mark.parametrize("case", ["zero2-eb", "zero3-eb"])
def test_eb_under_zero_a_frozen_tensor_never_moves_an_activated_one_trains(runs, case):
    for rank in (0, 1):
        rec = runs(case, rank)
        assert len(rec["history"]) == 2  # measured at the start of each of the two epochs
        prev, frozen_seen, switched = rec["start"], 0, set()
        for step, _, w, _, mults in rec["steps"]:
            for tensor, names in rec["layers"].items():
                moved = _moved(prev, w, names)
                assert (moved > 0) == (mults[tensor] > 0), (step, tensor, mults[tensor], moved)
                frozen_seen += mults[tensor] == 0
            prev = w
        first, second = (h["multipliers"] for h in rec["history"])
        switched = {t for t in first if (first[t] > 0) != (second[t] > 0)}
        assert frozen_seen and switched  # some tensors frozen, and the second epoch changed the selection


def test_pruning_under_zero3_masks_hold_on_the_partitions_and_after_a_resume(runs):
    two = runs("zero2-pruning")
    for rank in (0, 1):
        rec, again = runs("zero3-pruning", rank), runs("zero3-pruning-resume", rank)
        start = rec["start"]
        weights = [f"{layer}.weight" for layer in rec["layers"]]
        # the masks are those ZeRO-2 computes from the same weights, and prune the target fraction
        for n in weights:
            assert torch.equal(start[n] == 0, two["start"][n] == 0), n
        zeros = sum(int((start[n] == 0).sum()) for n in weights)
        total = sum(start[n].numel() for n in weights)
        assert zeros / total == pytest.approx(0.5, abs=len(weights) / total)
        # the callback's own count, from the partitions, is the gathered weights' count
        for layer, frac in rec["history"][0]["sparsity"].items():
            w = start[f"{layer}.weight"]
            assert frac == pytest.approx(float((w == 0).float().mean()), abs=1e-9), layer
        for run in (rec, again):
            for step, _, w, _, _ in run["steps"]:
                for n in weights:
                    assert not w[n][start[n] == 0].any(), (step, n)
                    assert (w[n] != start[n]).any(), (step, n)


#: the settings of tests/_hf_engines.py's pruning cases (importing it sets DeepSpeed's environment),
#: each pruning at the fit's start, for the plain run
PLAIN = {"pruning": dict(target_sparsity=0.5, min_numel=1, min_evals=3),
         "wanda": dict(target_sparsity=0.5, criterion="wanda", min_numel=1, min_evals=3, n_calibration=8),
         "sparsegpt": dict(target_sparsity=0.5, criterion="sparsegpt", min_numel=1, min_evals=3, n_calibration=8),
         "sparsegpt1": dict(target_sparsity=0.5, criterion="sparsegpt", min_numel=1, min_evals=3, n_calibration=8),
         "nm": dict(target_sparsity=0.5, n=2, m=4, min_numel=1, min_evals=3),
         "owl": dict(preset="owl", target_sparsity=0.5, criterion="sparsegpt", n_calibration=8)}
LR, WEIGHT_DECAY = 1e-2, 0.1  # the launch's AdamW


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same pruning on one process without ZeRO, from the weights the ZeRO run pruned: the
    model's weights right after the event (at the fit's start)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import lalr_lightning.callbacks as C
    from lalr_lightning.hf import trainer_callback
    from tests._lm import tiny_lm

    def run(method: str, before: dict, rows: int) -> dict:
        model = tiny_lm("llama", False, layers=4, hidden=16, seed=0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(4, 60, (16, 10), generator=g)][:rows]
        got: dict = {}

        class Peek(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                got.update({n: p.detach().clone() for n, p in model.named_parameters()})

        args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("plain")), max_steps=1,
                                 per_device_train_batch_size=2, report_to="none", use_cpu=True, save_strategy="no",
                                 disable_tqdm=True, seed=0, learning_rate=LR)
        cb = trainer_callback(C.HTSRPruning(**PLAIN[method]))
        Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, Peek()]).train()
        return got

    return run


def _event(rec: dict, method: str) -> tuple[dict, dict, dict, int]:
    """(the weights before the pruning event, the model's after it, the engine's fp32 master copy
    after it, the steps done before it)."""
    if method == "sparsegpt1":  # at epoch 1's start, after the two steps of epoch 0
        return rec["before"][1], *rec["after"][1], 2
    return rec["before"]["start"], rec["start"], rec["master_start"], 0


@pytest.mark.parametrize("case", ["zero2-pruning", *ZERO12_PRUNING[:6]])
def test_pruning_under_zero12_writes_the_master_weights_as_a_plain_run_prunes(runs, plain, case):
    """Every pruning mode under ZeRO-1/2: at the event the model holds what the same pruning gives
    without ZeRO (SparseGPT's OBS update of the kept weights included), and so does the engine's
    fp32 master copy, which the next step starts from; the masks hold on both after every step."""
    method = case.split("-")[1]
    expected = None
    for rank in (0, 1):
        rec = runs(case, rank)
        before, after, master, done = _event(rec, method)
        pruned = sorted(rec["masks"])
        assert pruned and rec["history"][0]["step"] == done
        if expected is None:
            expected = plain(method, before, 8 if method == "sparsegpt1" else 16)
        for n in after:
            # the engine's master copy is the model's weights (fp32 both): SparseGPT's update is in it
            assert torch.equal(master[n], after[n]), (n, float((master[n] - after[n]).abs().max()))
            if n not in rec["masks"]:
                assert torch.equal(after[n], before[n]), n
        for n in pruned:
            assert torch.equal(after[n] == 0, expected[n] == 0), n
            torch.testing.assert_close(after[n], expected[n], rtol=1e-5, atol=1e-6)
        if method in ("sparsegpt", "sparsegpt1", "owl"):  # it moved kept weights (by more than a step would)
            assert max(float(((after[n] - before[n]) * (after[n] != 0)).abs().max()) for n in pruned) > 2 * LR
        for (step, _, w, _, _), m in zip(rec["steps"][done:], rec["master_steps"][done:]):
            for n in pruned:
                assert not w[n][~rec["masks"][n]].any() and not m[n][~rec["masks"][n]].any(), (step, n)
                assert torch.equal(w[n], m[n]), (step, n)
        if done == 0:
            # the first step starts from the pruned weights: Adam's first update moves each weight by
            # at most the learning rate (and its decoupled weight decay), never back to the dense values
            first = rec["steps"][0][2]
            moved = max(float(((first[n] - after[n]) * rec["masks"][n]).abs().max()) for n in pruned)
            assert moved <= LR * (1 + WEIGHT_DECAY) + 1e-7, moved


def test_gradual_magnitude_pruning_under_zero3_follows_the_cubic_schedule(runs):
    """``when="gradual"`` under ZeRO-3 (2 epochs of 2 steps): at each epoch's start every layer loses
    the ``round(level x ratio x numel)`` smallest |w| of the weights trained so far (the first
    event's level 1 - (1 - 1/2)^3), the earlier masks kept; the partitions and the engine's fp32
    master copy hold them after every step."""
    for rank in (0, 1):
        rec = runs("zero3-gradual", rank)
        first, second = rec["history"]
        assert (first["step"], first["level"], second["step"], second["level"]) == (0, 0.875, 2, 1.0)
        masks = {}
        for epoch, event in ((0, first), (1, second)):
            before, (after, master) = rec["before"][epoch], rec["after"][epoch]
            for layer, ratio in first["ratios"].items():
                n = f"{layer}.weight"
                gone = after[n] == 0
                assert int(gone.sum()) == round(min(ratio * event["level"], 1.0) * gone.numel()), (epoch, n)
                assert float(before[n].abs()[gone].max()) <= float(before[n].abs()[~gone].min()), (epoch, n)
                if epoch:
                    assert gone[masks[n]].all(), n  # pruned weights stay pruned
                masks[n] = gone
                assert torch.equal(master[n], after[n]), (epoch, n)
            for (step, _, w, _, _), m in zip(rec["steps"][2 * epoch:2 * epoch + 2], rec["master_steps"][2 * epoch:]):
                for n, gone in masks.items():
                    assert not w[n][gone].any() and not m[n][gone].any(), (step, n)
                    assert (w[n] != after[n]).any(), (step, n)


def test_sparsegpt_under_zero2_bf16_writes_its_update_into_the_fp32_master_copy(runs):
    """bf16 weights, fp32 master copy: SparseGPT calibrates on the bf16 weights, and its update
    reaches the master copy (as bf16 values); the masks hold on both, and the first step starts
    from the pruned weights."""
    for rank in (0, 1):
        rec = runs("zero2-sparsegpt-bf16", rank)
        before, after, master = rec["before"]["start"], rec["start"], rec["master_start"]
        pruned = sorted(rec["masks"])
        assert pruned and after[pruned[0]].dtype == torch.bfloat16 and master[pruned[0]].dtype == torch.float32
        for n in after:
            assert torch.equal(master[n], after[n].float()), n
        assert max(float(((after[n] - before[n]).float() * (after[n] != 0)).abs().max()) for n in pruned) > 2 * LR
        for (step, _, w, _, _), m in zip(rec["steps"], rec["master_steps"]):
            for n in pruned:
                assert not w[n][~rec["masks"][n]].any() and not m[n][~rec["masks"][n]].any(), (step, n)
        first = rec["steps"][0][2]
        moved = max(float(((first[n] - after[n]).float() * rec["masks"][n]).abs().max()) for n in pruned)
        assert moved <= LR * (1 + WEIGHT_DECAY) * 1.02, moved  # bf16 rounds the updated weight (8 bits)
