"""Every shipped config's callbacks parse and build through jsonargparse, as LightningCLI builds
them (so a renamed or rejected argument shows up here, not on a user's cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
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
