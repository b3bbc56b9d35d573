"""The one-shot ``prune`` and ``perplexity`` commands (lalr_lightning/oneshot/) on tiny
Hugging Face directories built offline."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch

from lalr_lightning.oneshot import calibration_samples, perplexity, prune_checkpoint
from tests._lm import ALPHA_WORDS, save_tiny_lm, tiny_tokenizer, write_calibration_text
from tests._lm import run_cli as _run

_WORDS = ALPHA_WORDS


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("oneshot")
    rng = random.Random(0)
    write_calibration_text(root / "calib.txt", rng)
    with open(root / "calib.jsonl", "w") as f:
        for _ in range(20):
            f.write(json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))}) + "\n")
    (root / "short.jsonl").write_text(json.dumps({"text": "the cat sees the dog ."}) + "\n")
    models = {
        "llama": save_tiny_lm(root / "llama", "llama", False),
        "llama_tied": save_tiny_lm(root / "llama_tied", "llama", True, max_shard_size="40KB"),
        "opt": save_tiny_lm(root / "opt", "opt", True),
        "gpt2": save_tiny_lm(root / "gpt2", "gpt2", True),
    }
    return root, models


# ---------------------------------------------------------------------------- calibration windows


def test_calibration_windows_follow_the_reference_draws(files):
    root, _ = files
    tok = tiny_tokenizer()
    got = calibration_samples(tok, root / "calib.jsonl", 6, 16, seed=3)
    # C4's convention (AlphaPruning lib/data.py get_c4), written out
    docs = [json.loads(line)["text"] for line in (root / "calib.jsonl").read_text().splitlines()]
    rng, want = random.Random(3), []
    for _ in range(6):
        while True:
            ids = tok(docs[rng.randint(0, len(docs) - 1)])["input_ids"]
            if len(ids) > 16:
                break
        i = rng.randint(0, len(ids) - 16 - 1)
        want.append(ids[i:i + 16])
    assert got.tolist() == want
    # WikiText's convention for a .txt: one text, the file verbatim
    ids = tok((root / "calib.txt").read_text())["input_ids"]
    rng = random.Random(0)
    want = [ids[(i := rng.randint(0, len(ids) - 17)):i + 16] for _ in range(4)]
    assert calibration_samples(tok, root / "calib.txt", 4, 16).tolist() == want


def test_calibration_too_short_is_clear(files):
    root, _ = files
    with pytest.raises(ValueError, match="no record .* more than --seq-len 16 tokens"):
        calibration_samples(tiny_tokenizer(), root / "short.jsonl", 2, 16)


# ---------------------------------------------------------------------------- prune end to end


def _linear_weights(model):
    from lalr_lightning.core.pruning.calibration import decoder_blocks, linear_modules, weight_matrix

    path, blocks = decoder_blocks(model)
    return {f"{path}.{i}.{k}": weight_matrix(m).detach() for i, b in enumerate(blocks) for k, m in linear_modules(b).items()}


@pytest.mark.parametrize("family,criterion,extra", [
    ("llama", "wanda", ["--preset", "alphapruning"]),
    ("llama_tied", "sparsegpt", []),
    ("opt", "wanda", ["--n", "2", "--m", "4"]),
    ("gpt2", "magnitude", ["--metric", "stable_rank", "--epsilon", "0.2"]),
])
def test_prune_command_writes_a_loadable_pruned_model(files, tmp_path, capsys, family, criterion, extra):
    from transformers import AutoModelForCausalLM

    root, models = files
    out = tmp_path / "pruned"
    target = [] if "--m" in extra else ["--sparsity", "0.6"]  # N:M fixes the sparsity at n/m
    code, stdout, err = _run(["prune", str(models[family]), "--out", str(out), *target, "--criterion",
                              criterion, "--calibration", str(root / "calib.jsonl"), "--n-samples", "6", "--seq-len",
                              "16", *extra], capsys)
    assert code == 0, err
    assert "overall" in stdout
    dense = AutoModelForCausalLM.from_pretrained(models[family])
    pruned = AutoModelForCausalLM.from_pretrained(out)
    report = json.loads((out / "pruning.json").read_text())
    before, after = _linear_weights(dense), _linear_weights(pruned)
    assert set(after) == set(report["ratios"])
    numel = {k: w.numel() for k, w in after.items()}
    for k, w in after.items():
        zeros = int((w == 0).sum()) / w.numel()
        assert zeros == pytest.approx(report["achieved"][k], abs=1e-12)
        if criterion == "wanda" and "--m" not in extra:  # int(ratio * columns) in every row
            per_row = (w == 0).sum(1)
            assert (per_row == int(report["ratios"][k] * w.shape[1])).all(), k
            assert abs(zeros - report["ratios"][k]) < 1 / w.shape[1]
        if criterion == "sparsegpt":  # int(ratio * numel) over the matrix
            assert int((w == 0).sum()) == int(report["ratios"][k] * w.numel())
        if criterion == "magnitude":  # round(ratio * numel) smallest |w| over the matrix
            assert int((w == 0).sum()) == round(report["ratios"][k] * w.numel())
            assert w.abs()[w != 0].min() >= before[k].abs()[w == 0].max()
        if "--m" in extra:
            assert ((w == 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all()
        if criterion == "wanda":  # kept weights are the dense ones (no update)
            assert torch.equal(w[w != 0], before[k][w != 0])
    # the ratios' parameter-weighted mean is the target
    mean = sum(report["ratios"][k] * numel[k] for k in numel) / sum(numel.values())
    assert mean == pytest.approx(0.5 if "--m" in extra else 0.6, abs=1e-9)
    if "--preset" in extra:  # AlphaPruning: block-averaged alphas, so one ratio per block
        per_block = {}
        for k, r in report["ratios"].items():
            per_block.setdefault(k.split(".")[2], set()).add(round(r, 12))
        assert all(len(v) == 1 for v in per_block.values()) and len({min(v) for v in per_block.values()}) == 2
    # everything outside the blocks' linear layers is untouched
    for k, v in dense.state_dict().items():
        if k.rsplit(".", 1)[0] not in after:
            assert torch.equal(v, pruned.state_dict()[k]), k
    with torch.no_grad():
        assert torch.isfinite(pruned(torch.tensor([[2, 5, 6, 7]])).logits).all()


@pytest.mark.parametrize("criterion", ["sparsegpt", "wanda"])
def test_streamed_and_in_memory_pruning_agree(files, tmp_path, criterion):
    from transformers import AutoModelForCausalLM

    root, models = files
    kw = dict(sparsity=0.5, criterion=criterion, preset="alphapruning", calibration=root / "calib.txt", n_samples=4,
              seq_len=16, batch_size=3)
    a = prune_checkpoint(models["llama_tied"], tmp_path / "streamed", **kw)
    b = prune_checkpoint(models["llama_tied"], tmp_path / "memory", in_memory=True, **kw)
    assert a.ratios == b.ratios and a.sparsity == b.sparsity
    sa = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed").state_dict()
    sb = AutoModelForCausalLM.from_pretrained(tmp_path / "memory").state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------- perplexity


def test_perplexity_is_the_exp_of_the_mean_window_nll_by_hand(files, capsys):
    from transformers import AutoModelForCausalLM

    root, models = files
    code, stdout, err = _run(["perplexity", str(models["opt"]), "--data", str(root / "calib.txt"), "--seq-len", "20"],
                             capsys)
    assert code == 0, err
    printed = float(re.search(r"perplexity ([0-9.]+)", stdout).group(1))
    model = AutoModelForCausalLM.from_pretrained(models["opt"]).eval()
    ids = torch.tensor(tiny_tokenizer()((root / "calib.txt").read_text())["input_ids"])
    windows = ids.numel() // 20
    assert f"{windows} windows" in stdout
    nll = []
    with torch.no_grad():
        for w in range(windows):
            x = ids[w * 20:(w + 1) * 20]
            logp = torch.log_softmax(model(x[None]).logits[0, :-1].double(), -1)
            nll.append(-logp.gather(1, x[1:, None]).mean())
    want = math.exp(float(torch.stack(nll).mean()))
    assert printed == pytest.approx(want, rel=1e-4)
    got, n = perplexity(model, ids, 20, batch_size=3)
    assert n == windows and got == pytest.approx(want, rel=1e-6)
    got, n = perplexity(model, ids, 20, max_windows=2)
    assert n == 2 and got == pytest.approx(math.exp(float(torch.stack(nll[:2]).mean())), rel=1e-6)


# ---------------------------------------------------------------------------- bad inputs


def _one_line_error(code, err, phrase):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error:" in lines[0], err
    assert phrase in lines[0], lines[0]


def test_bad_inputs_give_one_line_errors(files, tmp_path, capsys):
    root, models = files
    model, calib = str(models["llama"]), str(root / "calib.jsonl")
    base = ["--calibration", calib, "--n-samples", "2", "--seq-len", "16"]
    cases = [
        (["prune", str(tmp_path / "missing"), "--out", str(tmp_path / "o1"), *base], "no such model directory"),
        (["prune", model, "--out", str(tmp_path / "o2"), "--n", "4", "--m", "4", *base], "0 < n < m"),
        (["prune", model, "--out", str(tmp_path / "o3"), "--sparsity", "1.0", *base], "--sparsity must be in [0, 1)"),
        (["prune", model, "--out", str(tmp_path / "o4"), "--sparsity", "-0.1", *base], "--sparsity must be in [0, 1)"),
        (["prune", model, "--out", str(tmp_path / "o5"), "--calibration", str(root / "short.jsonl"), "--n-samples",
          "2", "--seq-len", "16"], "more than --seq-len 16"),
        (["prune", model, "--out", str(tmp_path / "o6"), "--seq-len", "16"], "needs --calibration"),
        (["prune", model, "--out", str(tmp_path / "o7"), "--n", "2", "--m", "4", "--preset", "alphapruning", *base],
         "do not apply"),
        (["prune", model, "--out", str(tmp_path / "o8"), "--calibration", calib, "--seq-len", "4096"],
         "exceeds the model's 64 positions"),
        (["prune", model, "--out", model, *base], "new directory"),
        (["perplexity", model, "--data", str(root / "short.jsonl"), "--seq-len", "32"], "fewer than one window"),
        (["perplexity", str(tmp_path / "missing"), "--data", calib], "no such model directory"),
        # a directory where a file goes, a file where the model directory goes: said as such
        (["perplexity", model, "--data", str(root), "--seq-len", "16"], "is a directory; give one text file"),
        (["prune", model, "--out", str(tmp_path / "o9"), "--calibration", str(root), "--n-samples", "2",
          "--seq-len", "16"], "is a directory; give one text file"),
        (["perplexity", str(models["llama"] / "config.json"), "--data", calib], "is a file; give the Hugging Face "
                                                                                "model directory"),
    ]
    for argv, phrase in cases:
        code, _, err = _run(argv, capsys)
        _one_line_error(code, err, phrase)
    assert not (tmp_path / "o3").exists()  # nothing written on a refused run


def test_streaming_holds_one_block_at_a_time(files, tmp_path, monkeypatch):
    from lalr_lightning.oneshot.checkpoint import _Streamed

    root, models = files
    seen = []
    load = _Streamed.block

    def block(self, i):  # before each block is loaded, no other block (nor the head) holds weights
        seen.append([j for j, b in enumerate(self.blocks) if any(p.device.type != "meta" for p in b.parameters())])
        assert self.model.get_output_embeddings().weight.device.type == "meta"
        return load(self, i)

    monkeypatch.setattr(_Streamed, "block", block)
    prune_checkpoint(models["llama"], tmp_path / "o", criterion="sparsegpt", preset="alphapruning",
                     calibration=root / "calib.txt", n_samples=2, seq_len=16)
    assert len(seen) == 4 and all(s == [] for s in seen)  # 2 blocks x (metric pass, pruning pass)
