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

#: run in this order in one launch: a resume reads the checkpoint its uninterrupted run wrote
CASES = ["zero2-none", "zero2-none-resume", "zero2-lisa", "zero2-lisa-resume", "zero2-spectrum", "zero2-spectrum-resume",
         "zero2-surgical", "zero2-multiplier", "zero2-tempbalance", "zero2-tempbalance-resume", "zero2-pruning",
         "zero2-pruning-resume", "zero2-proximal", "zero2-lmsa", "zero2-ntk", "zero2-lalr", "zero2-rgn", "zero2-eb",
         "zero3-none", "zero3-none-resume", "zero3-tempbalance", "zero3-tempbalance-resume", "zero3-spectrum-init",
         "zero3-spectrum", "zero3-spectrum-resume", "zero3-ntkselect", "zero3-lisa", "zero3-lisa-resume",
         "zero3-pruning", "zero3-pruning-resume", "zero3-lalr", "zero3-rgn", "zero3-eb", "zero3-wanda", "zero3-tempbalance-init"]
#: refused in one line: (case, a phrase naming what works)
REFUSED = {"zero2-proximal": "DDP", "zero2-lmsa": "DDP", "zero2-ntk": "DDP",
           "zero3-spectrum-init": "create the model before the TrainingArguments", "zero3-wanda": "ZeRO-2",
           "zero3-tempbalance-init": "create the model before the TrainingArguments"}


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
