"""Issue 42, "what a newcomer met": the rough edges of a first hour with the package, each as the
user meets it (one ``error:`` line that names the fix, a line that was hidden, a warning that was
wrong)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lalr_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _err(argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as done:
        main(argv)
    return done.value.code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, says", [
    (["prune", "MODEL", "--out", "OUT", "--sparsty", "0.5"], "unrecognized arguments: --sparsty 0.5; did you mean "
                                                               "--sparsity?"),
    (["prune", "MODEL", "--out", "OUT", "--criterion", "wandaa"], "invalid choice: 'wandaa'"),
    (["perplexity", "MODEL", "--data", "DATA", "--seq-len", "16", "--batch-szie", "2"], "did you mean --batch-size?"),
])
def test_a_mistyped_flag_of_a_one_shot_command_gets_the_nearest(argv, says, tmp_path, capsys):
    """``fit`` said "did you mean"; ``prune`` / ``perplexity`` / ``zeroshot`` did not."""
    argv = [str(tmp_path / a.lower()) if a.isupper() else a for a in argv]
    code, err = _err(argv, capsys)
    assert code == 2 and len(err) == 1 and says in err[0], err
    if "invalid choice" in says:
        assert "did you mean 'wanda'?" in err[0]


def test_perplexity_names_a_missing_data_file_before_the_models_positions(tmp_path, capsys):
    """The default --seq-len 2048 is more than a tiny model's positions: the missing --data file,
    the first thing to fix, was said only after that."""
    from tests._lm import save_tiny_lm

    model = save_tiny_lm(tmp_path / "llama", "llama", False)  # 64 positions
    capsys.readouterr()  # transformers' progress bars
    code, err = _err(["perplexity", str(model), "--data", str(tmp_path / "wiki.txt")], capsys)
    assert code == 2 and len(err) == 1 and "no such --data file" in err[0] and "wiki.txt" in err[0], err


@pytest.mark.parametrize("key, value, nearest", [("optimizer", "sgdd", "torch.optim.SGD"),
                                                 ("scheduler", "cosineannealinglr",
                                                  "torch.optim.lr_scheduler.CosineAnnealingLR")])
def test_a_mistyped_optimizer_is_one_line_with_the_nearest_class(key, value, nearest, tmp_path, monkeypatch, capsys):
    """``fit ... --model.init_args.optimizer sgdd`` printed jsonargparse's own text ("Expected a path
    but sgdd either not accessible or invalid - Expected a dot import path string")."""
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["trainer"].update(max_epochs=1, logger=False, enable_checkpointing=False)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setattr("sys.argv", ["lalr-lightning", "fit", "--config", str(path), f"--model.init_args.{key}",
                                     value])
    code, err = _err(None, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"lalr-lightning: error: --model.init_args.{key} {value}: not an importable class; give a "
                      f"class path (e.g. torch.optim.{'lr_scheduler.CosineAnnealingLR' if key == 'scheduler' else 'AdamW'}"
                      f"); did you mean '{nearest}'?"), err[0]
