"""The benchmarks' quick modes run, so the scripts cannot rot; their counts are checked against
hand-computed byte totals (never their timings)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from tests._dist import preloaded_start_method

pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_memory_benchmark_quick_counts_what_each_arm_trains(tmp_path):
    bench = _load("memory")
    out = tmp_path / "memory.md"
    results = {r["arm"]: r for r in bench.main(["--quick", "--inline", "--out", str(out)])}
    assert set(results) == set(bench.ARMS) and not any("error" in r for r in results.values())
    cfg = bench.MODELS["tiny"]
    h, layers, v, m = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["intermediate_size"]
    per_layer = 4 * h * h + 3 * h * m + 2 * h  # q k v o, gate up down, two RMSNorms
    n = 2 * v * h + layers * per_layer + h  # embedding, untied head, final norm
    tensors = 3 + 9 * layers
    full = results["full"]
    assert full["params"] == n and full["trained"] == n
    assert full["grads"] == 4 * n  # fp32 gradient of every parameter
    assert full["state"] == 8 * n + 4 * tensors  # AdamW's two moments + a float32 step count per tensor
    # LoRA on q and v (peft's LLaMA default): r x (in + out) per adapted matrix
    for r in (8, 16):
        lora = results[f"lora{r}"]
        assert lora["trained"] == layers * 2 * r * (h + h)
        assert lora["grads"] == 4 * lora["trained"]
    # the selection arms hold no more than what their trained parameters need (L-MSA: see the README)
    for arm in ("spectrum25", "spectrum50", "lisa", "surgical"):
        r = results[arm]
        assert 0 < r["trained"] < n
        assert r["ratio"] <= 1.10, (arm, r["ratio"])
    assert results["spectrum25"]["trained"] < results["spectrum50"]["trained"]
    # LMFlow's keep mode holds the state of both draws; release only the current one
    assert results["lisa_keep"]["state"] > results["lisa"]["state"]
    assert results["lisa_keep"]["ratio"] > 1.10
    assert all(math.isfinite(r["loss"]) for r in results.values())
    text = out.read_text()
    assert "| spectrum25 | 1 process |" in text and "(grads + state) / need" in text


def test_memory_benchmark_hf_arm_holds_what_the_lightning_host_holds(tmp_path):
    """The Hugging Face Trainer arm: the same model, batch and AdamW as the Lightning arm, so the
    same bytes of gradients and optimizer state and the same loss, arm by arm."""
    pytest.importorskip("transformers")
    bench = _load("memory")
    arms = ["full", "lora8", "spectrum25", "lisa", "surgical"]
    res = bench.main(["--quick", "--inline", "--modes", "single", "hf", "--arms", *arms,
                      "--out", str(tmp_path / "m.md")])
    by = {(r["mode"], r["arm"]): r for r in res}
    assert not any("error" in r for r in res) and len(by) == 2 * len(arms)
    for arm in arms:
        pl_, hf = by[("single", arm)], by[("hf", arm)]
        for key in ("trained", "grads", "state", "params"):
            assert hf[key] == pl_[key], (arm, key, hf[key], pl_[key])
        assert hf["loss"] == pytest.approx(pl_["loss"], rel=1e-4), arm
    assert "| spectrum25 | HF Trainer |" in (tmp_path / "m.md").read_text()


def test_selection_shards_fsdp_counts_what_each_strategy_holds(monkeypatch):
    """benchmarks/selection_shards.py's FSDP table, checked against the model's own sizes: both
    strategies halve the parameters and keep AdamW state for what trains only; FSDP2 allocates
    gradients for exactly what trains, FSDP1 for every parameter of a unit where anything trains."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # imported by name: the spawned ranks import it too
    bench = importlib.import_module("selection_shards")
    rows = {(r["kind"], r["arm"]): r for r in bench.fsdp_rows()}
    cfg = bench.CONFIG
    h, m, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    n = 2 * v * h + h + layers * (4 * h * h + 3 * h * m + 2 * h)  # untied embedding and head, norms
    full, spectrum, lisa, surgical = (f"{k}" for k in bench.FSDP_ARMS)
    for kind in ("FSDP1", "FSDP2"):
        for arm in bench.FSDP_ARMS:
            r = rows[kind, arm]
            assert r["params"] == 4 * n / 2, (kind, arm)  # fp32, half on each rank
            assert r["state"] == 2 * r["need"], (kind, arm)  # two AdamW moments of what trains
        assert rows[kind, full]["grads"] == rows[kind, full]["need"] == 4 * n / 2
        assert rows[kind, lisa]["grads"] == rows[kind, lisa]["need"]  # undrawn layers: units with no gradient
        # surgical's first block: the embedding and decoder layer 0
        assert rows[kind, surgical]["need"] == 4 * (v * h + 4 * h * h + 3 * h * m + 2 * h) / 2
    for arm in (spectrum, surgical):
        assert rows["FSDP2", arm]["grads"] == rows["FSDP2", arm]["need"]
    # FSDP1: Spectrum trains something in every decoder layer, so every flat gradient is allocated
    assert rows["FSDP1", spectrum]["grads"] == 4 * n / 2 > 2 * rows["FSDP1", spectrum]["need"]
    # the root unit holds the trained embedding next to the frozen lm_head and final norm
    assert rows["FSDP1", surgical]["grads"] == rows["FSDP1", surgical]["need"] + 4 * (v * h + h) / 2


def test_whole_copy_measures_every_arm_under_each_strategy(monkeypatch):
    """benchmarks/whole_copy.py: every measurement ran under DDP, FSDP1 and FSDP2, and under FSDP rank
    zero held exactly the whole model (fp32) while it measured, twice its own half."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # imported by name: the spawned ranks import it too
    bench = importlib.import_module("whole_copy")
    # the ranks fork from the tests' preloaded server (tests/_dist.py), not a fresh spawn each
    rows = {(r["arm"], r["kind"]): r for r in bench.rows(preloaded_start_method())}
    cfg = importlib.import_module("selection_shards").CONFIG
    h, m, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    n = 2 * v * h + h + layers * (4 * h * h + 3 * h * m + 2 * h)
    assert set(rows) == {(a, k) for a in bench.ARMS for k in ("DDP", "FSDP1", "FSDP2")}
    for (arm, kind), r in rows.items():
        assert r["seconds"] > 0, (arm, kind)
        assert r["own"] == 4 * n / (1 if kind == "DDP" else 2), (arm, kind)
        assert r["whole"] == (0 if kind == "DDP" else 4 * n), (arm, kind)


def test_step_overhead_quick_prints_every_row(capsys):
    """benchmarks/step_overhead.py's quick mode: a row per callback of issue 34's table, the
    decision steps counted apart (never the timings)."""
    bench = _load("step_overhead")
    rows = {r["callback"]: r for r in bench.main(["--steps", "12", "--repeats", "1"])}
    out = capsys.readouterr().out
    assert set(rows) == set(bench.variants(12)) - {"none"}
    for name, r in rows.items():
        assert f"| {name}" in out and r["other"] > 0 and r["total"] > 0, name
        if name not in (bench.PER_LAYER, bench.AGAIN):  # its own hooks' time: a part of each of its steps
            assert 0 < r["own"] < r["other"] and r["ops"] >= 0, name
            if "other_without_msa" not in r:  # the own time less its tensor operations
                assert r["bookkeeping"] == pytest.approx(r["own"] - r["ops"]), name
    # the tensor operations: the pull and the stretch of the update run some on every step; a
    # LayerLRMultiplier of two patterns splits the groups on a CPU, which is no tensor operation
    assert rows["ProximalRegularizer (lam=1)"]["ops"] > 0 and rows["LALR (one decision)"]["ops"] > 0
    assert rows["LayerLRMultiplier"]["ops"] == 0
    assert rows["LALR (one decision)"]["n_decide"] == 1  # its epoch-start decision falls in the first step
    assert rows["AutoRGN"]["n_decide"] == 1
    # the methods that give layers their own LR are also set against one AdamW group per layer
    assert "other_per_layer" in rows["LALR (one decision)"] and "other_per_layer" not in rows["HTSRPruning (masks after every step)"]
    assert rows["LayerLRMultiplier"]["n_decide"] == 0 and rows["LayerLRMultiplier"]["outside"] == 0
    assert rows["TempBalance every epoch (one decision)"]["outside"] == 1  # at fit start
    # at fit start (step 0), then steps 2, 4, ..., 10
    assert rows["TempBalance every 2 steps"]["n_decide"] == 5 and rows["TempBalance every 2 steps"]["outside"] == 1
    lmsa = rows['LMSAStepper (update="msa")']
    assert lmsa["n_decide"] == 2 and lmsa["msa_ms"] > 0 and "other_without_msa" in lmsa  # its update apart


def test_depth_pruning_quick_cuts_times_and_heals(tmp_path):
    """benchmarks/depth_pruning.py's quick mode: every block criterion cuts K = 1/4 of the blocks, the
    cut model holds fewer bytes at its peak, the surgical heal trains the seam blocks alone and LISA's
    heal (the HF Trainer) lowers the cut model's held-out perplexity."""
    import torch
    from safetensors.torch import load_file

    bench = _load("depth_pruning")
    res = bench.main(["--quick", "--dir", str(tmp_path), "--heal", "angular", "--devices", "cpu"])
    n = res["blocks"]
    assert res["ks"] == [1] and n == 4
    rows = {(r["criterion"], r["k"]): r for r in res["quality"]}
    assert set(rows) == {("dense", 0)} | {(c, 1) for c in bench.CRITERIA}
    for (_, k), r in rows.items():
        assert len(r["removed"]) == k and math.isfinite(r["ppl"]) and 0 <= r["acc"] <= 1
    assert rows["last", 1]["removed"] == [n - 2]
    speed = {r["k"]: r for r in res["speed"]}
    assert (speed[0]["blocks"], speed[1]["blocks"]) == (n, n - 1)
    assert speed[1]["weights_mib"] < speed[0]["weights_mib"] and speed[1]["peak_mib"] < speed[0]["peak_mib"]
    (heal,) = res["heal"]
    cut, seam, lisa = ({k: v for f in sorted(Path(heal["dirs"][d]).glob("*.safetensors")) for k, v in load_file(f).items()}
                       for d in ("cut", "seam_lightning", "lisa_hf"))
    assert cut.keys() == seam.keys() == lisa.keys()
    changed = {k for k in cut if not torch.equal(cut[k], seam[k])}
    assert changed and {k.split(".")[2] for k in changed} == {str(j) for j in heal["seam"]}
    assert all(k.startswith("model.layers.") for k in changed)
    assert not torch.equal(cut["model.embed_tokens.weight"], lisa["model.embed_tokens.weight"])  # LISA: stem trains
    assert heal["lisa_hf"]["ppl"] < heal["cut"]["ppl"]
