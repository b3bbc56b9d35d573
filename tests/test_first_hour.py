"""What a new user meets in the first hour: the README's commands in the README's order (torch's
build chosen before anything installs it), --help, a missing pre-trained checkpoint, a download
without network, the W&B example's paths."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

from lalr_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
OFFLINE_MARK = "<!-- offline:"
CPU_TORCH = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"


def _env() -> dict[str, str]:
    """This checkout's package and this interpreter first, offline."""
    env = dict(os.environ)
    # a W&B run earlier in this process leaves its service's address here; a user's process starts
    # its own service, in its own working directory (relative save_dirs resolve there)
    env.pop("WANDB_SERVICE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", MPLBACKEND="Agg", PYTHONWARNINGS="default")
    # one intra-op thread, as conftest sets for the test processes: beside the other xdist worker
    # two threads per process oversubscribe the cores (a 15-epoch run went from ~40 s to ~250 s)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _commands(block: str) -> list[str]:
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def readme_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(kind, commands)`` of every ```bash block that follows an ``<!-- install: ... -->`` or
    ``<!-- offline: ... -->`` marker, in the README's order."""
    return [(kind, _commands(block))
            for kind, block in re.findall(r"<!-- (install|offline):[^>]*-->\s*```bash\n(.*?)```", text, flags=re.S)]


def readme_offline_commands(text: str) -> list[str]:
    """The commands of every ```bash block that follows an ``<!-- offline: ... -->`` marker, in order."""
    return [c for kind, commands in readme_blocks(text) if kind == "offline" for c in commands]


@pytest.mark.smoke
def test_the_readme_chooses_torch_before_anything_installs_it():
    """A newcomer without a GPU runs the README top to bottom: the first install command of the
    page is the CPU build of torch, in the first block, which is marked for the test below."""
    text = (ROOT / "README.md").read_text()
    installs = [c for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for c in _commands(block)
                if c.startswith("pip install")]
    assert installs[:2] == [CPU_TORCH, "pip install -e ."], installs[:3]
    first_block = text.index("```bash")
    assert text.rfind("<!-- install:", 0, first_block) != -1 and readme_blocks(text)[0][0] == "install"


def _first_hour_text() -> str:
    """The README, then the guide it sends a newcomer to next (docs/usage.md): their marked blocks
    in that order are the first hour."""
    return (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs" / "usage.md").read_text()


def test_readme_offline_commands_run_verbatim_in_a_fresh_copy(tmp_path):
    """The README's blocks in its order, then the guide's: the install commands (pip recorded, not
    run: the test has no network and its packages are in place), then the quickstart, analyze on
    its checkpoint, and a pruning config from scratch (docs/usage.md), for real."""
    blocks = readme_blocks(_first_hour_text())
    commands = readme_offline_commands(_first_hour_text())
    assert [kind for kind, _ in blocks][:2] == ["install", "offline"]
    joined = "\n".join(commands)
    assert "fit --config configs/quickstart.yaml" in joined
    assert "analyze lightning_logs/quickstart/version_0/checkpoints/last.ckpt" in joined
    assert "fit --config configs/pruning_digits_dense.yaml" in joined and "pruning_digits_alpha" in joined
    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # what a fresh clone has; outputs stay here
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "pip").write_text('#!/bin/sh\necho "$*" >> "$PIP_LOG"\n')
    (shim / "pip").chmod(0o755)
    env = _env()
    pip_env = dict(env, PATH=os.pathsep.join([str(shim), env["PATH"]]), PIP_LOG=str(tmp_path / "pip.log"))
    for kind, block in blocks:
        for command in block:
            start = time.perf_counter()
            done = subprocess.run(command, shell=True, cwd=tmp_path, env=pip_env if kind == "install" else env,
                                  capture_output=True, text=True)
            print(f"{time.perf_counter() - start:6.1f} s  {kind}: {command}")
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            assert "not recommended to provide both args" not in done.stderr
        if kind == "install":  # torch's build is chosen before the package's install could pull one
            assert (tmp_path / "pip.log").read_text().splitlines() == [
                CPU_TORCH.removeprefix("pip "), "install -e ."]
    assert (tmp_path / "lightning_logs/quickstart/version_0/metrics.csv").exists()
    assert (tmp_path / "spectral_report/spectral.csv").exists()
    assert (tmp_path / "checkpoints/pruning_digits/dense.ckpt").exists()
    assert list((tmp_path / "lightning_logs").glob("pruning_digits_alpha_*/version_0/metrics.csv"))


@pytest.mark.parametrize(("argv0", "prog"), [
    (str(ROOT / "lalr_lightning" / "__main__.py"), "python -m lalr_lightning"),  # python -m lalr_lightning
    ("/usr/local/bin/lalr-lightning", "lalr-lightning"),                          # the console script
])
def test_help_names_analyze_and_the_program_without_lightning_warnings(argv0, prog, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit) as exit_info:
        warnings.simplefilter("always")
        main()  # as the entry points call it: the command line is sys.argv
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} ") and "__main__.py" not in out
    assert f"{prog} analyze" in " ".join(out.split())
    assert f"{prog} configs" in " ".join(out.split()) and "--traceback" in out
    # LightningCLI warns when given both args and a command line; main() passes no args of its own
    # (the README test checks the same on real subprocesses)
    assert not [w for w in caught if "not recommended" in str(w.message)]


@pytest.mark.parametrize(("config", "writer"), [
    ("pruning_digits_alpha_global.yaml", "pruning_digits_dense.yaml"),
    ("lmsa_digits.yaml", "lmsa_digits_pretrain.yaml"),
])
def test_missing_pretrained_checkpoint_names_the_command(config, writer, tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)  # a fresh clone: nothing trained yet
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", f"configs/{config}"])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "not recommended" not in line]
    assert len(err) == 1, err
    assert f"run `python -m lalr_lightning fit --config configs/{writer}` first" in err[0]
    assert "does not exist" in err[0]



def test_missing_pretrained_checkpoint_of_a_shipped_config_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the shipped one, by name
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "pruning_digits_alpha_global"])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "not recommended" not in line]
    assert len(err) == 1 and "run `python -m lalr_lightning fit --config pruning_digits_dense` first" in err[0], err


def test_download_without_network_says_where_to_put_the_files(tmp_path, monkeypatch):
    from lalr_lightning.data._common import DownloadError
    from lalr_lightning.data.cifar import CIFARDataModule

    def offline(*args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", offline)  # torchvision's downloader calls it
    data = CIFARDataModule(name="cifar10", data_dir=str(tmp_path), download=True)
    with pytest.raises(DownloadError) as err:
        data.prepare_data()
    msg = str(err.value)
    assert "\n" not in msg
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in msg
    assert "Temporary failure in name resolution" in msg
    assert str(tmp_path / "cifar-10-batches-py") in msg and "download=False" in msg


def _wandb_log(folder: Path, timeout: float = 60.0) -> Path:
    """The run's transaction log, which wandb's core process may create late on a busy machine."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        logs = sorted(folder.glob("run-*.wandb"))
        if logs:
            return logs[0]
        time.sleep(0.5)
    raise AssertionError(f"no run-*.wandb in {folder} after {timeout:g} s: {sorted(p.name for p in folder.iterdir())}")


def test_the_wandb_example_puts_the_checkpoint_under_its_project(tmp_path):
    """docs/dashboards.md's W&B commands, run as written in a fresh copy (one epoch of two batches
    appended to the fit): the checkpoint lands in ``lightning_logs/quickstart/<run id>/checkpoints/``,
    not in ``lightning_logs/lightning_logs/<run id>/``, and ``report`` reads the W&B run folder it
    names."""
    pytest.importorskip("wandb")
    from lalr_lightning.report import report_main

    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "dashboards.md").read_text(), flags=re.S).group(1)
    fit, report = _commands(block)
    assert fit.startswith("WANDB_MODE=offline python -m lalr_lightning fit ")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    fit += " --trainer.max_epochs 1 --trainer.limit_train_batches 2 --trainer.limit_val_batches 1"
    env = dict(_env(), WANDB_SILENT="true", WANDB_DIR=str(tmp_path))
    done = subprocess.run(fit, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    (ckpt,) = (tmp_path / "lightning_logs").glob("*/*/checkpoints/last.ckpt")
    run_id = ckpt.parts[-3]
    assert ckpt == tmp_path / "lightning_logs" / "quickstart" / run_id / "checkpoints" / "last.ckpt"
    assert (ckpt.parents[1] / "config.yaml").exists()  # the parsed config beside it
    assert not (tmp_path / "lightning_logs" / "lightning_logs").exists()
    # the report command, with the run folder the docs' pattern names
    pattern = shlex.split(report)[4]
    assert pattern == "lightning_logs/wandb/offline-run-<time>-<id>"
    (folder,) = tmp_path.glob(pattern.replace("<time>", "*").replace("<id>", run_id))
    from tests.test_dashboards import _wait_for_exit

    _wait_for_exit(_wandb_log(folder))
    assert report_main([str(folder), "--out", str(tmp_path / "report.html")]) == 0
    assert '<section id="tempbalance">' in (tmp_path / "report.html").read_text()
