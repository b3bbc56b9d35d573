"""Every shipped config's callbacks parse and build through jsonargparse, as LightningCLI builds
them (so a renamed or rejected argument shows up here, not on a user's cluster); the offline
Wanda configs and the multi-GPU FSDP configs run through the CLI (the FSDP ones on 2 CPU ranks)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch.distributed
import yaml
from jsonargparse import ArgumentParser
from lightning.pytorch.callbacks import Callback

from lalr_lightning.callbacks import LayerwiseCallback

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_callbacks_build(path):
    specs = (yaml.safe_load(path.read_text()).get("trainer") or {}).get("callbacks") or []
    ours = [s for s in specs if s["class_path"].startswith("lalr_lightning.")]
    for spec in ours:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_argument("--callback", type=Callback)
        cfg = parser.parse_object({"callback": spec})
        cb = parser.instantiate_classes(cfg).callback
        assert isinstance(cb, LayerwiseCallback), spec["class_path"]
        for key, value in (spec.get("init_args") or {}).items():  # every YAML setting arrived
            if key in cb.settings():
                got = cb.settings()[key]
                assert got == value or (isinstance(value, list) and got == list(value)), (key, got, value)


@pytest.mark.parametrize("config, sparsity", [("alphapruning_tinyllama_offline.yaml", 0.7),
                                              ("wanda_tinyllama_offline.yaml", 0.5)])
def test_offline_wanda_configs_prune_and_fine_tune(tmp_path, config, sparsity):
    """The tiny Wanda configs end to end through the CLI: calibrated at fit start, then trained with
    the masks kept (a few steps; nothing downloaded)."""
    import pandas as pd

    from lalr_lightning.cli import main

    main(["fit", "--config", str(CONFIGS[0].parent / config), "--trainer.max_steps", "3",
          "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
          "--data.init_args.cache_dir", str(tmp_path / "cache"), "--data.init_args.corpus_size", "100",
          "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path)])
    df = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    overall = df["pruning/overall_sparsity"].dropna()
    assert len(overall) >= 2  # at the pruning event and at fit end, after training: still pruned
    # Wanda prunes int(ratio * columns) weights of every row: short of the ratio by < 1 / columns (64 here)
    assert overall.le(sparsity + 1e-9).all() and overall.gt(sparsity - 1 / 64).all()
    per_layer = [c for c in df.columns if c.startswith("pruning/sparsity/model.model.layers.")]
    assert len(per_layer) == 4 * 7
    if config.startswith("wanda"):
        assert df[per_layer].dropna().eq(0.5).all().all()  # 2:4: exactly half of every matrix
    assert df["val/ppl"].dropna().gt(1).all()


# ---------------------------------------------------------------------- the multi-GPU FSDP configs on 2 CPU ranks

FSDP_CONFIGS = ("lisa_llama2_7b_fsdp.yaml", "spectrum_llama3_8b_fsdp.yaml", "lalr_llama_fsdp.yaml")

#: what the CI run changes: CPUs instead of GPUs (the same FSDP strategy and wrap policy, through
#: CPUFSDPStrategy), a tiny LLaMA instead of the 7-8B checkpoint, the offline corpus instead of
#: Alpaca, a few steps. The callbacks and every other setting are the config's own.
TINY = {
    "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": 3, "max_epochs": None, "limit_val_batches": 0,
                "val_check_interval": None, "enable_progress_bar": False, "enable_model_summary": False,
                "strategy": {"class_path": "lalr_lightning.strategies.CPUFSDPStrategy"}},
    "model": {"init_args": {"model_name": None, "model_kwargs": {"dtype": "bfloat16"},
                            "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                       "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
                                       "max_position_embeddings": 32, "tie_word_embeddings": False}}},
    "data": {"init_args": {"data_files": None, "tokenizer": "offline-words", "block_size": 16, "batch_size": 2,
                           "val_split": 0.1, "num_workers": 0, "corpus_size": 64}},
}


def _configs_pair(rank, record, work, names):
    import warnings

    from lalr_lightning.callbacks import LayerwiseCallback
    from lalr_lightning.cli import LalrCLI
    from lalr_lightning.core.runtime.shards import fsdp_units

    warnings.filterwarnings("ignore")
    tiny = f"{work}/tiny.yaml"
    if rank == 0:
        Path(tiny).write_text(yaml.safe_dump(TINY))
    torch.distributed.barrier()
    for name in names:
        cli = LalrCLI(args=["fit", "--config", str(CONFIGS[0].parent / name), "--config", tiny,
                            "--data.init_args.cache_dir", f"{work}/cache",
                            "--trainer.logger.init_args.save_dir", f"{work}/{name}",
                            "--trainer.default_root_dir", f"{work}/{name}"])
        trainer = cli.trainer
        cb = next(c for c in trainer.callbacks if isinstance(c, LayerwiseCallback))
        units = fsdp_units(trainer.strategy.model)
        record(name, {"strategy": type(trainer.strategy).__name__, "precision": trainer.precision,
                      "units": [type(u.module).__name__ for u in units], "steps": trainer.global_step,
                      "loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
                      "history": [{k: v for k, v in h.items() if k != "scores"} for h in cb.history]})


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    from _dist import run_pair_once

    return run_pair_once("fsdp_configs", tmp_path_factory, _configs_pair, FSDP_CONFIGS, timeout_s=300)


@pytest.mark.parametrize("name", FSDP_CONFIGS)
def test_fsdp_config_runs_on_two_cpu_ranks_as_on_eight_gpus(fsdp_runs, name):
    """The 8-GPU FSDP config, its strategy and callbacks unchanged, on a tiny LLaMA over 2 CPU
    ranks: FSDP wraps each decoder layer in its own unit inside the root one, the run trains in
    bf16, and both ranks make the same decisions."""
    cfg = yaml.safe_load((CONFIGS[0].parent / name).read_text())["trainer"]
    assert cfg["strategy"]["class_path"] == "lightning.pytorch.strategies.FSDPStrategy" and cfg["devices"] == 8
    assert cfg["precision"].startswith("bf16")
    runs = [fsdp_runs[rank].get(name) for rank in (0, 1)]
    assert all(runs), f"{name}: the pair of processes stopped before it (see the output)"
    got = runs[0]
    assert got["strategy"] == "CPUFSDPStrategy" and got["precision"] == cfg["precision"]
    # one unit per decoder layer, inside the root unit that wraps the LightningModule
    assert got["units"] == ["LlamaDecoderLayer"] * 4 + ["CausalLMModule"], got["units"]
    assert got["steps"] == 3 and math.isfinite(got["loss"])
    assert got["history"] and runs[1]["history"] == got["history"]
