"""Spectrum selection: the trained set is the top p% of matrices by SNR within each module type
(SNR by Spectrum's formula, computed here by hand), the head and the embeddings always train;
``analyze --spectrum`` writes Spectrum's YAML, which round-trips to the same parameters."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lalr_lightning.callbacks import SpectrumSelect, SurgicalLayerSelect
from lalr_lightning.cli import analyze_main
from lalr_lightning.core.spectral.spectrum_snr import module_type, read_unfrozen_yaml, top_by_type, unfrozen_yaml
from tests._lm import lm_module, save_tiny_lm, tiny_lm
from tests._toys import make_trainer

pytest.importorskip("transformers")


def _snr(w: torch.Tensor) -> float:
    """Spectrum's SNR: singular values above the MP edge over those at or below it, over the largest."""
    s = torch.linalg.svdvals(w.detach().double())
    sigma = float(torch.quantile(s, 0.75) - torch.quantile(s, 0.25)) / 1.349
    beta = min(w.shape) / max(w.shape)
    thr = sigma * (1 + math.sqrt(beta))
    signal = float(s[s > thr].sum()) if bool((s > thr).any()) else 0.0
    noise = float(s[s <= thr].sum()) if bool((s <= thr).any()) else 1.0
    return signal / noise / float(s.max())


def _hand_top(named_weights: dict[str, torch.Tensor], percent: float) -> set[str]:
    by_type: dict[str, list[tuple[float, str]]] = {}
    for name, w in named_weights.items():
        parts = name.split(".")
        i = next(k for k, p in enumerate(parts) if p.isdigit())
        by_type.setdefault(".".join(parts[i + 1:]), []).append((_snr(w), name))
    out = set()
    for items in by_type.values():
        items.sort(key=lambda t: -t[0])
        out |= {n for _, n in items[: int(len(items) * percent / 100)]}
    return out


def test_module_types_follow_spectrum_and_a_mapping():
    assert module_type("model.layers.3.self_attn.q_proj") == "self_attn.q_proj"
    assert module_type("model.decoder.layers.10.fc1") == "fc1"
    assert module_type("lm_head") == "lm_head" and module_type("model.embed_tokens") == "model.embed_tokens"
    mapping = {"q_proj": "attn", "self_attn.k_proj": "attn"}
    assert module_type("model.layers.0.self_attn.k_proj", mapping) == "attn"
    assert module_type("model.layers.0.mlp.up_proj", mapping) == "mlp.up_proj"
    chosen = top_by_type({"a.0.q": 1.0, "a.1.q": 3.0, "a.2.q": 2.0, "a.0.v": 5.0}, 70)
    assert chosen == {"q": ["a.1.q", "a.2.q"], "v": []}  # floor(3 * 0.7) = 2, floor(0.7) = 0
    with pytest.raises(ValueError, match="top_percent"):
        SpectrumSelect(top_percent=150)


def _module():
    return lm_module("llama", False, lr=0.1, hidden=64, layers=4)


def test_trained_set_is_the_top_percent_per_type_by_snr_on_a_tiny_llama():
    module = _module()
    blocks = {f"model.{n}": m.weight.detach().clone() for n, m in module.model.named_modules()
              if isinstance(m, torch.nn.Linear) and ".layers." in n}
    expected = _hand_top(blocks, 50) | {"model.lm_head", "model.model.embed_tokens"}
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    spectrum = SurgicalLayerSelect(mode="spectrum", top_percent=50)
    assert isinstance(spectrum, SpectrumSelect)
    make_trainer([spectrum], max_steps=2).fit(module)
    assert set(spectrum.selected) == expected and len(spectrum.selected) == 2 + 7 * 2
    for name in blocks:
        assert spectrum.scores[name] == pytest.approx(_snr(blocks[name]), rel=1e-6)
        changed = not torch.equal(module.get_submodule(name).weight, before[f"{name}.weight"])
        assert changed == (name in expected), name  # trained iff selected
    assert spectrum.module_types["model.model.layers.2.mlp.down_proj"] == "mlp.down_proj"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_analyze_streams_every_matrix_and_writes_a_spectrum_yaml_that_round_trips(tmp_path, tied, capsys):
    from safetensors import safe_open

    path = save_tiny_lm(tmp_path / "lm", "llama", tied, hidden=64, layers=4, max_shard_size="60KB")
    stored = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            stored.update({k[: -len(".weight")]: fh.get_tensor(k) for k in fh.keys() if k.endswith("weight")
                           and fh.get_slice(k).get_shape().__len__() == 2})
    assert ("lm_head" in stored) != tied
    out = tmp_path / "report"
    assert analyze_main([str(path), "--out", str(out), "--spectrum", "50", "--no-plots", "--min-evals", "2",
                         "--device", "cpu"]) == 0
    import pandas as pd

    names = list(pd.read_csv(out / "spectral.csv")["name"])
    assert sorted(names) == sorted(stored)  # every matrix, lm_head included, under the checkpoint's names
    patterns = read_unfrozen_yaml((out / "spectrum_50percent.yaml").read_text())
    model = tiny_lm("llama", tied, hidden=64, layers=4)
    unfrozen = {n for n, _ in model.named_parameters() if any(re.match(p, n) for p in patterns)}
    expected = _hand_top({k: v for k, v in stored.items() if ".layers." in k}, 50)
    always = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    assert unfrozen == {f"{n}.weight" for n in expected} | always
    assert ("15 of 29" if tied else "16 of 30") in capsys.readouterr().out
    # the writer and the reader agree on an explicit choice
    text = unfrozen_yaml({"mlp.up_proj": ["model.layers.1.mlp.up_proj"]}, ["lm_head.weight"])
    assert read_unfrozen_yaml(text) == ["^lm_head.weight$", "model.layers.1.mlp.up_proj"]


@pytest.mark.parametrize("percent", [50, 100])
def test_analyze_spectrum_ranks_the_matrices_min_evals_leaves_out_of_the_table(tmp_path, percent, capsys):
    """k_proj/v_proj of hidden 16 (8 eigenvalues) are under analyze's --min-evals 10: the YAML left
    them frozen even at 100 %, a choice SpectrumSelect (no min_evals) does not make."""
    path = save_tiny_lm(tmp_path / "lm", "llama", False, hidden=16, layers=2)
    out = tmp_path / "report"
    assert analyze_main([str(path), "--out", str(out), "--spectrum", str(percent), "--no-plots", "--quiet"]) == 0
    assert " of 16 matrices unfrozen" in capsys.readouterr().out  # 14 matrices in 2 blocks, embedding, head
    import pandas as pd

    assert not any("k_proj" in n for n in pd.read_csv(out / "spectral.csv")["name"])  # the table keeps min_evals
    patterns = read_unfrozen_yaml((out / f"spectrum_{percent}percent.yaml").read_text())
    model = tiny_lm("llama", False, hidden=16, layers=2)
    unfrozen = {n for n, _ in model.named_parameters() if any(re.match(p, n) for p in patterns)}
    plan = SpectrumSelect(top_percent=percent).plan(model)
    chosen = {f"{n}.weight" for n in plan.loc[plan["selected"].astype(bool), "layer"]}
    assert unfrozen == chosen


def test_grouping_report_and_always_trained_matrices():
    from lalr_lightning.core.model.blocks import output_layer
    from lalr_lightning.core.model.layers import matrix_layers
    from lalr_lightning.core.spectral import htsr
    from lalr_lightning.core.spectral.spectrum_snr import always_trained, grouping_report, snr_of

    groups = {"l.0.q": "q", "l.1.q": "q", "l.0.v": "v", "fc": "linear (pooled)"}
    line, warning = grouping_report("S", groups, 50, ["lm_head"])
    assert line == ("S: 4 ranked matrices in 3 type(s), trained at top_percent=50: q: 1 of 2, v: 0 of 1, linear "
                    "(pooled): 0 of 1; linear (pooled): matrices without a repeated-block name (Spectrum's rule would "
                    "give each its own type), pooled by kind; always trained: lm_head")
    assert warning.startswith("S(top_percent=50) selects no matrix of type(s) v (l.0.v), linear (pooled) (fc)")
    _, warning = grouping_report("S", {"a": "q", "b": "v"}, 50, [])
    assert warning.startswith("S(top_percent=50) selects none of the 2 ranked matrices")
    assert "no matrix trains" in warning
    assert grouping_report("S", {"a": "q", "b": "q"}, 50, [])[1] is None
    assert grouping_report("S", {"a": "q"}, 0, [])[1] is None  # top_percent=0 asks for none: no warning
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10))
    layers = matrix_layers(model)
    out = output_layer(model, layers)
    assert always_trained(layers, out, True, True) == ["0", "2"]
    assert always_trained(layers, out, False, True) == ["0"] and always_trained(layers, None, True, False) == []
    df = htsr.analyze(layers[1:], metrics=["snr"], min_evals=1)
    assert snr_of(layers[1:]) == dict(zip(df["name"], df["snr"].astype(float)))


def test_ranked_types_groups_the_ranked_matrices_and_types_every_one():
    from lalr_lightning.core.model.layers import matrix_layers
    from lalr_lightning.core.spectral.spectrum_snr import group_types, ranked_types

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 10))
    layers = matrix_layers(model)
    groups, types = ranked_types(layers, ["0"])
    assert sorted(groups) == ["1", "2"]  # the always-trained embedding is not ranked
    assert groups == group_types(["1", "2"], {"1": "linear", "2": "linear"})
    assert types == {"0": module_type("0"), **groups}  # every matrix typed, the ranked ones as ranked
    assert ranked_types(layers, ["0"], {"1": "a", "2": "a"}, "spectrum")[0] == {"1": "a", "2": "a"}
