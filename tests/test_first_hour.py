"""What a new user meets in the first hour: the README's commands, --help, a missing pre-trained
checkpoint, a download without network."""

from __future__ import annotations

import os
import re
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


def _env() -> dict[str, str]:
    """This checkout's package and this interpreter first, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", MPLBACKEND="Agg", PYTHONWARNINGS="default")
    # one intra-op thread, as conftest sets for the test processes: beside the other xdist worker
    # two threads per process oversubscribe the cores (a 15-epoch run went from ~40 s to ~250 s)
    env["OMP_NUM_THREADS"] = "1"
    return env


def readme_offline_commands(text: str) -> list[str]:
    """The commands of every ```bash block that follows an ``<!-- offline: ... -->`` marker, in order."""
    commands = []
    for block in re.findall(r"<!-- offline:[^>]*-->\s*```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_readme_offline_commands_run_verbatim_in_a_fresh_copy(tmp_path):
    """The README's quickstart, analyze on its checkpoint, and a pruning config from scratch."""
    commands = readme_offline_commands((ROOT / "README.md").read_text())
    joined = "\n".join(commands)
    assert "fit --config configs/quickstart.yaml" in joined
    assert "analyze lightning_logs/quickstart/version_0/checkpoints/last.ckpt" in joined
    assert "fit --config configs/pruning_digits_dense.yaml" in joined and "pruning_digits_alpha" in joined
    shutil.copytree(ROOT / "configs", tmp_path / "configs")  # what a fresh clone has; outputs stay here
    for command in commands:
        start = time.perf_counter()
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=_env(), capture_output=True, text=True)
        print(f"{time.perf_counter() - start:6.1f} s  {command}")
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        assert "not recommended to provide both args" not in done.stderr
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
