"""Streamed spectral analysis of safetensors checkpoints: the same table as the built model,
one tensor in memory at a time, and one-line errors for paths that are not checkpoints."""

from __future__ import annotations

import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from lalr_lightning.core.runtime import safetensors_checkpoints
from lalr_lightning.core.runtime.safetensors_checkpoints import matrix_kind, safetensors_files, stored_matrices
from lalr_lightning.core.spectral import htsr
from lalr_lightning.core.spectral.htsr import analyze

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

COMPARE = ("alpha", "xmin", "xmax", "D", "sigma", "num_evals", "num_pl_spikes", "spectral_norm", "norm",
           "stable_rank", "entropy", "alpha_weighted", "log_alpha_norm", "snr")


def _config(family: str, tied: bool):
    common = dict(vocab_size=96, tie_word_embeddings=tied)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, **common)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=40, bos_token_id=0,
                                       eos_token_id=0, **common)
    return transformers.OPTConfig(hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=40, word_embed_proj_dim=32, **common)


def _saved(tmp_path, family: str, tied: bool, **save_kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(_config(family, tied)).eval()
        model.save_pretrained(tmp_path, **save_kw)
    return model


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama", True), ("gpt2", True), ("opt", False),
                                         ("opt", True)])
def test_streamed_table_equals_built_model(tmp_path, family, tied):
    model = _saved(tmp_path, family, tied, max_shard_size="20KB")
    assert len(safetensors_files(tmp_path)) >= 3  # sharded, read through the index
    streamed = analyze(tmp_path, metrics="all").set_index("name")
    built = analyze(model, metrics="all").set_index("name")
    # every matrix the checkpoint holds, with its own names; the head exactly when it is stored
    assert sorted(streamed.index) == sorted(built.index)
    assert ("lm_head" in streamed.index) == (not tied)
    assert len(streamed) == len({m.name for m in stored_matrices(tmp_path)})
    built = built.loc[streamed.index]
    kinds = built["kind"].replace({"hf_conv1d": "linear"})  # GPT-2's Conv1D is a plain 2-D tensor on disk
    assert list(streamed["kind"]) == list(kinds)
    assert list(streamed["shape"]) == list(built["shape"])
    for col in COMPARE:
        np.testing.assert_allclose(streamed[col].to_numpy(float), built[col].to_numpy(float), rtol=1e-9, err_msg=col)
    np.testing.assert_allclose(streamed["rand_distance"], built["rand_distance"], rtol=1e-9)
    assert list(streamed["warning"]) == list(built["warning"])


def test_single_file_and_unsharded_directory(tmp_path):
    model = _saved(tmp_path / "one", "llama", False)
    assert [p.name for p in safetensors_files(tmp_path / "one")] == ["model.safetensors"]
    full = analyze(tmp_path / "one", metrics=["alpha", "stable_rank"])
    assert full.equals(analyze(str(tmp_path / "one" / "model.safetensors"), metrics=["alpha", "stable_rank"]))
    assert set(full["name"]) == {layer.name for layer in htsr._resolve_layers(model, None)}
    # names sort naturally: layers.2 before layers.10
    names = [m.name for m in stored_matrices(tmp_path / "one")]
    assert names == sorted(names, key=safetensors_checkpoints._natural_key)
    assert safetensors_checkpoints._natural_key("layers.2.q") < safetensors_checkpoints._natural_key("layers.10.q")


def test_only_one_tensor_is_alive_at_a_time(tmp_path, monkeypatch):
    _saved(tmp_path, "llama", False, max_shard_size="20KB")
    alive: list[weakref.ref] = []
    real = safetensors_checkpoints.load_matrix

    def tracking(matrix, device="cpu"):  # freed by reference counting, no gc needed
        assert all(r() is None for r in alive), "a previously loaded matrix is still referenced"
        t = real(matrix, device)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(htsr, "load_matrix", tracking)
    df = analyze(tmp_path, metrics="all")
    assert len(alive) == len(df) == 16


def test_progress_bar_and_device(tmp_path, capsys):
    _saved(tmp_path, "gpt2", True)
    analyze(tmp_path, metrics=["alpha"], progress=True, device="cpu")
    err = capsys.readouterr().err
    assert "spectral analysis" in err and "10/10" in err
    analyze(tmp_path, metrics=["alpha"])
    assert capsys.readouterr().err == ""
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is available; use device='cpu'"):
            analyze(tmp_path, device="cuda")


def test_conv_checkpoint_kinds_and_layer_types(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.Conv1d(16, 24, 5), nn.Linear(24, 40))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(state, str(tmp_path / "m.safetensors"))
    streamed = analyze(tmp_path / "m.safetensors", min_evals=1).set_index("name")
    built = analyze(model, min_evals=1).set_index("name")
    assert list(streamed["kind"]) == ["conv2d", "conv1d", "linear"] == list(built["kind"])
    for col in ("alpha", "spectral_norm", "stable_rank", "snr"):
        np.testing.assert_allclose(streamed[col], built[col], rtol=1e-9)
    only = analyze(tmp_path / "m.safetensors", layer_types=["conv1d"], min_evals=1)
    assert list(only["name"]) == ["2"]


def test_bf16_checkpoint_is_analysed_in_float(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(64, 32)
    safetensors_torch.save_file({"proj.weight": w.bfloat16(), "norm.weight": torch.ones(32)}, str(tmp_path / "b.safetensors"))
    df = analyze(tmp_path / "b.safetensors")
    assert list(df["name"]) == ["proj"]
    ev = np.sort(np.linalg.svd(w.bfloat16().double().numpy(), compute_uv=False) ** 2)
    assert df.loc[0, "spectral_norm"] == pytest.approx(ev.max(), rel=1e-9)
    # bf16 rounding (eps 0.0078) is far below a real spectrum's spread: the fit is WW's
    from test_spectral import ww_loop_fit

    assert df.loc[0, "alpha"] == pytest.approx(ww_loop_fit(ev[ev > 1e-5])[1], rel=1e-6)


def test_matrix_kind_rule():
    assert matrix_kind("model.embed_tokens.weight", (100, 8)) == "embedding"
    assert matrix_kind("transformer.wte.weight", (100, 8)) == "embedding"
    assert matrix_kind("transformer.wpe.weight", (40, 8)) == "embedding"
    assert matrix_kind("bert.embeddings.word_embeddings.weight", (100, 8)) == "embedding"
    assert matrix_kind("embed_out.weight", (100, 8)) == "linear"  # GPT-NeoX's head
    assert matrix_kind("lm_head.weight", (100, 8)) == "linear"
    assert matrix_kind("model.layers.0.mlp.down_proj.weight", (8, 16)) == "linear"
    assert matrix_kind("conv.weight", (4, 3, 5)) == "conv1d"
    assert matrix_kind("conv.weight", (4, 3, 3, 3)) == "conv2d"
    assert matrix_kind("norm.weight", (8,)) is None
    assert matrix_kind("lin.bias", (8, 8)) is None
    assert matrix_kind("pos_embed", (1, 197, 8)) is None  # not a module weight
    assert matrix_kind("embeddings.position_ids.weight", (1, 40), "I64") is None


def test_bad_paths_give_one_line_errors(tmp_path):
    def one_line(exc_info):
        assert "\n" not in str(exc_info.value)

    with pytest.raises(FileNotFoundError, match="no such file or directory") as e:
        analyze(tmp_path / "missing")
    one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no \.safetensors file") as e:
        analyze(tmp_path / "empty")
    one_line(e)
    (tmp_path / "bin").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"holds no \.safetensors file .*pytorch_model\.bin") as e:
        analyze(str(tmp_path / "bin"))
    one_line(e)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match=r"bad\.safetensors is not a readable safetensors file") as e:
        analyze(tmp_path / "bad.safetensors")
    one_line(e)
    (tmp_path / "model.ckpt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"model\.ckpt is not a \.safetensors file") as e:
        analyze(tmp_path / "model.ckpt")
    one_line(e)
    safetensors_torch.save_file({"norm.weight": torch.ones(4)}, str(tmp_path / "norms.safetensors"))
    with pytest.raises(ValueError, match="has no layer for spectral analysis") as e:
        analyze(tmp_path / "norms.safetensors")
    one_line(e)
    _saved(tmp_path / "sharded", "llama", False, max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="lists shard\\(s\\) that do not exist") as e:
        analyze(tmp_path / "sharded")
    one_line(e)
