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


def test_the_selection_summary_reaches_lightnings_console(monkeypatch):
    """Issue 42 row 8: the summary line went to ``logging.getLogger("lalr_lightning")``, which a
    plain Trainer does not show; it goes where Lightning's own lines go (its rank-zero info, under
    the ``lightning.pytorch`` logger that Lightning sets to INFO with a console handler)."""
    import logging

    from lalr_lightning.callbacks import SurgicalBlocks
    from tests._lm import lm_module
    from tests._toys import make_trainer

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    import lightning.pytorch  # noqa: F401 -- its import sets its logger to INFO: what a plain Trainer shows

    lightning_logger = logging.getLogger("lightning.pytorch")
    # tests/conftest.py (or another test) may have quietened it; the user's process has Lightning's INFO
    quiet = lightning_logger.level
    lightning_logger.setLevel(logging.INFO)
    handler = Keep(logging.INFO)
    lightning_logger.addHandler(handler)
    try:
        cb = SurgicalBlocks(select="first")
        make_trainer([cb], max_steps=1).fit(lm_module("llama", False, hidden=32, layers=4))
    finally:
        lightning_logger.removeHandler(handler)
        lightning_logger.setLevel(quiet)
    lines = [r.getMessage() for r in seen if r.getMessage().startswith("SurgicalBlocks: trainable ")]
    assert lines == [cb.summary] and all(r.levelno == logging.INFO for r in seen if r.getMessage() == cb.summary)


def test_tempbalance_names_the_layers_min_evals_leaves_out_once():
    """Issue 42 row 8: on a grouped-query LLaMA, ``k_proj`` / ``v_proj`` have fewer eigenvalues than
    ``min_evals`` and kept the scheduled LR without a word; one warning names them and why, as
    HTSRPruning names the layers it leaves dense."""
    import warnings

    from lalr_lightning.callbacks import TempBalanceCallback
    from tests._lm import tiny_lm

    model = tiny_lm("llama", False, layers=4, hidden=64)  # 2 heads, 1 key-value head: k/v 32 x 64
    tb = TempBalanceCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tb.plan(model)
    notes = [str(w.message) for w in caught if "min_evals" in str(w.message)]
    assert len(notes) == 1, notes
    from lalr_lightning.core.spectral.tempbalance import eligible_layers

    _, excluded = eligible_layers(model, tb.layer_types, min_evals=tb.min_evals)
    few = sorted(k for k, v in excluded.items() if "< min_evals=50" in v)
    assert few == sorted(f"model.layers.{i}.self_attn.{m}" for i in range(4) for m in ("k_proj", "v_proj"))
    assert ("model.layers.*.self_attn.k_proj (4 layers: 32 eigenvalues < min_evals=50)" in notes[0]
            and "model.layers.*.self_attn.v_proj (4 layers" in notes[0] and "Lower min_evals" in notes[0])
    assert "first layer" not in notes[0]  # TempBalance's own rule (the first, the output layer) goes unsaid


def _unclaimed(record) -> list[str]:
    return [str(w.message) for w in record if "no callback of this fit takes" in str(w.message)
            and "HTSRPruning masks" not in str(w.message)]


def test_a_resume_with_another_selection_names_the_state_it_leaves_unused(tmp_path):
    """Issue 42 row 11: LISA + TempBalance resumed as Spectrum + TempBalance dropped LISA's state
    without a word of the package's; now one warning names it, its decisions, and the callback
    that starts afresh (TempBalance, whose state is taken, is not named)."""
    import warnings

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lalr_lightning.callbacks import BlockSchedule, SpectrumSelect, TempBalanceCallback
    from tests._lm import lm_module
    from tests._toys import make_trainer

    lisa = BlockSchedule(schedule="lisa", gamma=1, every_n_steps=1, seed=0)
    make_trainer([lisa, TempBalanceCallback(min_evals=4), ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                 max_steps=2, enable_checkpointing=True).fit(lm_module("llama", False, hidden=32, layers=4))
    assert len(lisa.history) == 2
    spectrum, tb = SpectrumSelect(top_percent=25), TempBalanceCallback(min_evals=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer([spectrum, tb], max_steps=3).fit(lm_module("llama", False, hidden=32, layers=4),
                                                      ckpt_path=str(tmp_path / "last.ckpt"))
    (msg,) = _unclaimed(record)
    assert "\n" not in msg and f"{lisa.state_key} (2 decisions)" in msg and "left unused" in msg, msg
    assert f"{spectrum.state_key} of this fit found no state of its own" in msg and "TempBalance" not in msg
    assert tb.restored and not spectrum.restored
    with warnings.catch_warnings(record=True) as same:  # the same callbacks: nothing left over, nothing said
        warnings.simplefilter("always")
        make_trainer([BlockSchedule(schedule="lisa", gamma=1, every_n_steps=1, seed=0),
                      TempBalanceCallback(min_evals=4)], max_steps=3).fit(lm_module("llama", False, hidden=32, layers=4),
                                                                          ckpt_path=str(tmp_path / "last.ckpt"))
    assert not _unclaimed(same)


def test_a_trainer_resume_without_the_saved_callbacks_warns_for_state_and_masks(tmp_path):
    """Issue 42 row 11 on the Hugging Face Trainer, where nothing was said at all: another
    selection's state left unused, and HTSRPruning's masks no longer enforced (the masks case of
    the last round, which Lightning already warned about)."""
    import warnings

    pytest.importorskip("transformers")
    from lalr_lightning.callbacks import BlockSchedule, HTSRPruning, SpectrumSelect
    from lalr_lightning.hf import trainer_callback
    from tests.test_hf import _trainer

    lisa = BlockSchedule(schedule="lisa", gamma=1, every_n_steps=1, seed=0)
    pruner = HTSRPruning(min_numel=16, min_evals=3)
    trainer, _ = _trainer(tmp_path, trainer_callback([lisa, pruner]), steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    assert pruner.masks
    spectrum = SpectrumSelect(top_percent=25)
    trainer, _ = _trainer(tmp_path, [trainer_callback(spectrum)], steps=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    (msg,) = _unclaimed(record)
    assert f"{lisa.state_key} (2 decisions)" in msg and f"{spectrum.state_key} of this fit found no state" in msg
    masks = [str(w.message) for w in record if "HTSRPruning masks" in str(w.message)]
    assert len(masks) == 1 and "no longer enforced" in masks[0] and pruner.state_key in masks[0]
