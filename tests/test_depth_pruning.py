"""``prune --remove-blocks K --block-criterion ...``: removing whole decoder blocks (core/pruning/depth.py,
oneshot/prune.py) on tiny LLaMA, GPT-2, OPT and Qwen2 directories built offline."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from lalr_lightning.core.pruning import depth
from lalr_lightning.oneshot import calibration_samples
from tests._lm import ALPHA_WORDS, save_tiny_lm, tiny_tokenizer, vocab_size, write_calibration_text
from tests._lm import run_cli as _run

pytest.importorskip("transformers")

_WORDS = ALPHA_WORDS
N_SAMPLES, SEQ = 5, 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth")
    rng = random.Random(0)
    write_calibration_text(root / "calib.txt", rng)
    models = {fam: save_tiny_lm(root / fam, fam, fam != "llama", layers=5, seed=1) for fam in ("llama", "gpt2", "opt")}
    return root, models


def _prune(files, tmp_path, capsys, family, *extra, name="cut"):
    root, models = files
    out = tmp_path / name
    code, stdout, err = _run(["prune", str(models[family]), "--out", str(out), "--calibration", str(root / "calib.txt"),
                              "--n-samples", str(N_SAMPLES), "--seq-len", str(SEQ), "--quiet", *extra], capsys)
    assert code == 0, err
    return out, json.loads((out / "pruning.json").read_text()), stdout


def _states(model, samples):
    """Every block's input and output on the samples, by hooks (the output before the final norm)."""
    from lalr_lightning.core.pruning.calibration import decoder_blocks

    _, blocks = decoder_blocks(model)
    ins, outs, hooks = {}, {}, []

    def keep(i):
        def hook(_m, args, kwargs, out):
            ins[i] = (args[0] if args else kwargs["hidden_states"]).detach()
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    for i, b in enumerate(blocks):
        hooks.append(b.register_forward_hook(keep(i), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=samples, use_cache=False)
    for h in hooks:
        h.remove()
    return [ins[i] for i in range(len(blocks))], [outs[i] for i in range(len(blocks))]


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_influence_and_angular_scores_are_the_papers_formulas_by_hand(files, tmp_path, capsys, family):
    """ShortGPT's BI = 1 - mean over every token of cos(block input, block output); Gromov et al.'s
    d(l, l+K) = mean over samples of arccos(cos(h_l, h_{l+K})) / pi at the last token, h_L the last
    block's output before the final norm; the removed blocks follow from them."""
    from transformers import AutoModelForCausalLM

    root, models = files
    dense = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).eval()
    samples = calibration_samples(tiny_tokenizer(), root / "calib.txt", N_SAMPLES, SEQ, seed=0)
    ins, outs = _states(dense, samples)
    n = len(ins)
    bi = []
    for x, y in zip(ins, outs):
        cos = (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))
        bi.append(1 - cos.mean().item())
    h = [x[:, -1] for x in ins] + [outs[-1][:, -1]]
    k = 2
    d = []
    for l in range(n - k + 1):  # noqa: E741
        cos = (h[l] * h[l + k]).sum(-1) / (h[l].norm(dim=-1) * h[l + k].norm(dim=-1))
        d.append((torch.arccos(cos.clamp(-1, 1)) / math.pi).mean().item())

    _, inf, stdout = _prune(files, tmp_path, capsys, family, "--remove-blocks", str(k), "--block-criterion",
                            "influence", name="inf")
    assert inf["block_scores"] == pytest.approx(bi, abs=2e-5)
    assert inf["removed_blocks"] == sorted(sorted(range(n), key=lambda i: bi[i])[:k])
    assert "removed" in stdout and str(inf["removed_blocks"]) in stdout
    _, ang, _ = _prune(files, tmp_path, capsys, family, "--remove-blocks", str(k), "--block-criterion", "angular",
                       name="ang")
    assert ang["block_scores"][: n - k + 1] == pytest.approx(d, abs=2e-5)
    assert ang["block_scores"][n - k + 1:] == [None] * (k - 1)
    start = min(range(n - k + 1), key=lambda l: d[l])  # noqa: E741
    assert ang["removed_blocks"] == [start, start + 1]
    assert ang["blocks_before"] == n and ang["blocks_after"] == n - k


def test_alpha_is_the_blocks_mean_alpha_highest_first_and_last_keeps_the_final_block(files, tmp_path, capsys):
    """alpha: each block's mean of its matrices' alphas (AlphaPruning's peak fit, through the package's
    analyze), the highest removed; a block of i.i.d. Gaussian weights (no learned correlations: the
    random-matrix spectrum) scores above blocks whose weights hold a heavy-tailed spectrum.
    last: blocks L-1-K ... L-2."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from lalr_lightning.core.model.layers import Layer
    from lalr_lightning.core.spectral.htsr import analyze

    root, models = files
    src = tmp_path / "heavy"
    src.mkdir()
    for f in models["llama"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    state = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for key, w in state.items():
        if w.ndim == 2 and ".layers." in key:  # heavy-tailed (Student-t, 1.5 dof) everywhere but block 3
            gauss = torch.randn(w.shape, generator=g)
            chi = torch.distributions.Chi2(torch.tensor(1.5)).sample(w.shape)
            state[key] = (gauss if ".layers.3." in key else gauss / (chi / 1.5).sqrt()) * 0.02
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "alpha"
    code, _, err = _run(["prune", str(src), "--out", str(out), "--remove-blocks", "1", "--block-criterion", "alpha",
                         "--quiet"], capsys)
    assert code == 0, err
    report = json.loads((out / "pruning.json").read_text())
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    want = []
    for i, block in enumerate(dense.model.layers):
        layers = [Layer(f"b{i}.{n}", "linear", m) for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        df = analyze(layers, fit="peak", metrics=["alpha"], min_evals=1, filter_zeros=False)
        want.append(float(df["alpha"].mean()))
    assert report["block_scores"] == pytest.approx(want, rel=1e-6)
    assert report["removed_blocks"] == [3] == [max(range(5), key=lambda i: want[i])]

    out = tmp_path / "last"
    code, _, err = _run(["prune", str(models["gpt2"]), "--out", str(out), "--remove-blocks", "2", "--block-criterion",
                         "last", "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((out / "pruning.json").read_text())["removed_blocks"] == [2, 3]  # 5 blocks: the final, 4, stays


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_cut_model_loads_with_the_dense_weights_and_the_dense_models_skip_forward(files, tmp_path, capsys, family):
    """The output is a plain transformers directory: K fewer blocks, every tensor the dense model's
    (renamed), and its logits those of the dense model run with the removed blocks skipped."""
    from transformers import AutoModelForCausalLM

    from lalr_lightning.core.pruning.calibration import decoder_blocks

    root, models = files
    out, report, _ = _prune(files, tmp_path, capsys, family, "--remove-blocks", "2", "--block-criterion", "angular")
    removed = report["removed_blocks"]
    kept = [i for i in range(5) if i not in removed]
    assert report["kept_blocks"] == kept and report["remove_blocks"] == 2
    cut = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    dense = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).eval()
    assert cut.config.num_hidden_layers == 3
    path, _ = decoder_blocks(dense)
    dsd, csd = dense.state_dict(), cut.state_dict()
    for key, value in csd.items():
        src = key
        if key.startswith(path + "."):
            j, rest = key[len(path) + 1:].split(".", 1)
            src = f"{path}.{kept[int(j)]}.{rest}"
        assert torch.equal(value, dsd[src]), key
    assert len(csd) == len(dsd) - 2 * len([k for k in dsd if k.startswith(f"{path}.0.")])
    ids = torch.tensor([[2, 5, 6, 7, 9, 11]])
    _, blocks = decoder_blocks(dense)
    for i in sorted(removed, reverse=True):
        del blocks[i]
    with torch.no_grad():
        torch.testing.assert_close(cut(ids, use_cache=False).logits, dense(ids, use_cache=False).logits)


def test_per_block_config_lists_are_cut_with_the_blocks(tmp_path, capsys):
    """A Qwen2 mixing full and sliding-window attention: layer_types cut to the kept blocks,
    max_window_layers counted again, and each loaded block attends as the dense block it came from.
    The data-free criteria run on it (no calibration, so no mask to capture)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, use_sliding_window=True,
                      sliding_window=4, max_window_layers=2, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg).eval()
    src = tmp_path / "qwen"
    dense.save_pretrained(src)
    tiny_tokenizer().save_pretrained(src)
    assert json.loads((src / "config.json").read_text())["layer_types"] == ["full_attention"] * 2 + [
        "sliding_attention"] * 2
    out = tmp_path / "cut"
    code, _, err = _run(["prune", str(src), "--out", str(out), "--remove-blocks", "2", "--block-criterion", "last",
                         "--quiet"], capsys)
    assert code == 0, err
    written = json.loads((out / "config.json").read_text())
    assert written["layer_types"] == ["full_attention", "sliding_attention"]  # kept: 0 and 3
    assert written["max_window_layers"] == 1 and written["num_hidden_layers"] == 2
    cut = AutoModelForCausalLM.from_pretrained(out)
    assert [b.self_attn.sliding_window for b in cut.model.layers] == [None, 4]
    assert [dense.model.layers[i].self_attn.sliding_window for i in (0, 3)] == [None, 4]
    # wanda on such a model still needs one mask for every block: refused, nothing written
    code, _, err = _run(["prune", str(src), "--out", str(tmp_path / "no"), "--remove-blocks", "1", "--block-criterion",
                         "influence", "--calibration", str(src / "config.json"), "--seq-len", "8"], capsys)
    assert code == 2 and "mixes attention types" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "no").exists()


def test_cut_config_cuts_renumbers_and_recounts():
    config = {"num_hidden_layers": 4, "layer_types": ["a", "b", "c", "d"], "no_rope_layers": [1, 0, 1, 1],
              "mlp_only_layers": [0, 2, 3], "max_window_layers": 3, "eos_token_id": [5, 6, 7, 8],
              "sliding_window": 4, "rope_scaling": {"factor": [1, 2, 3, 4]}}
    got = depth.cut_config(config, [0, 2], 4)
    assert got == {"num_hidden_layers": 2, "layer_types": ["a", "c"], "no_rope_layers": [1, 1],
                   "mlp_only_layers": [0, 1], "max_window_layers": 2, "eos_token_id": [5, 6, 7, 8],
                   "sliding_window": 4, "rope_scaling": {"factor": [1, 2, 3, 4]}}
    assert config["layer_types"] == ["a", "b", "c", "d"]  # the source's dict untouched
    with pytest.raises(ValueError, match="no block count equal to the model's 4 blocks"):
        depth.cut_config({"num_hidden_layers": 3}, [0], 4)


def test_seam_blocks_are_the_cut_models_blocks_next_to_each_cut():
    assert depth.seam_blocks([2, 3], 6) == [1, 2]  # kept 0 1 | 4 5: new 1 and 2 meet at the cut
    assert depth.seam_blocks([0, 1], 5) == [0]  # the cut is before the first kept block
    assert depth.seam_blocks([4], 5) == [3]
    assert depth.seam_blocks([1, 3], 5) == [0, 1, 2]


def test_remove_blocks_with_sparsity_equals_the_two_commands_in_turn(files, tmp_path, capsys):
    """--remove-blocks with --sparsity prunes the kept blocks, calibrated on the cut model: the same
    weights as pruning the cut model's directory with Wanda afterwards."""
    root, models = files
    one, report, stdout = _prune(files, tmp_path, capsys, "llama", "--remove-blocks", "2", "--block-criterion",
                                 "influence", "--sparsity", "0.5", "--criterion", "wanda", name="one")
    assert set(report["ratios"]) == {f"model.layers.{j}.{k}" for j in range(3) for k in
                                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "overall" in stdout and "influence" in stdout
    cut, _, _ = _prune(files, tmp_path, capsys, "llama", "--remove-blocks", "2", "--block-criterion", "influence",
                       name="cut2")
    two = tmp_path / "two"
    code, _, err = _run(["prune", str(cut), "--out", str(two), "--sparsity", "0.5", "--criterion", "wanda",
                         "--calibration", str(root / "calib.txt"), "--n-samples", str(N_SAMPLES), "--seq-len", str(SEQ),
                         "--quiet"], capsys)
    assert code == 0, err
    from safetensors.torch import load_file

    a = {k: v for f in one.glob("*.safetensors") for k, v in load_file(f).items()}
    b = {k: v for f in two.glob("*.safetensors") for k, v in load_file(f).items()}
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert report["overall"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("argv,phrase", [
    (["--remove-blocks", "0", "--block-criterion", "last"], "--remove-blocks must be an integer >= 1"),
    (["--remove-blocks", "1.5", "--block-criterion", "last"], "--remove-blocks must be an integer >= 1"),
    (["--remove-blocks", "two", "--block-criterion", "last"], "--remove-blocks must be an integer >= 1"),
    (["--remove-blocks", "inf", "--block-criterion", "last"], "--remove-blocks must be an integer >= 1"),
    (["--remove-blocks", "5", "--block-criterion", "last"], "the model has 5 decoder blocks; remove at most 4"),
    (["--remove-blocks", "2"], "--remove-blocks needs --block-criterion"),
    (["--block-criterion", "alpha"], "add --remove-blocks K"),
    (["--remove-blocks", "2", "--block-criterion", "angular"], "needs --calibration FILE"),
    (["--remove-blocks", "2", "--block-criterion", "last", "--criterion", "wanda"], "add --sparsity S"),
    (["--remove-blocks", "2", "--block-criterion", "last", "--in-memory"], "--in-memory does not apply"),
])
def test_bad_remove_blocks_is_one_line_and_writes_nothing(files, tmp_path, capsys, argv, phrase):
    _, models = files
    out = tmp_path / "never"
    code, _, err = _run(["prune", str(models["llama"]), "--out", str(out), *argv], capsys)
    assert code == 2 and phrase in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("python -m lalr_lightning prune: error:")
    assert not out.exists()
