"""Installed like a library: the editable install beats a same-named folder in the working
directory, and a wheel-shaped install finds its shipped configs. (.ci/run also builds the real
wheel, installs it into a fresh venv without the clone and runs the quickstart from it.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH: what the interpreter finds on its own, as a user's script would."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def _editable_install_of_this_clone() -> bool:
    try:
        text = metadata.distribution("lalr_lightning").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    info = json.loads(text or "{}")
    url = info.get("url", "")
    return info.get("dir_info", {}).get("editable", False) and Path(url.removeprefix("file://")).resolve() == ROOT


@pytest.mark.skipif(not _editable_install_of_this_clone(),
                    reason="lalr_lightning is not installed editable from this clone (pip install -e .)")
@pytest.mark.smoke
def test_editable_install_imports_from_the_clones_parent_directory(tmp_path):
    # the natural layout: a script beside the clone, whose folder is named like the package; the
    # folder (no __init__.py at its top) is a namespace-package candidate on sys.path[0]
    (tmp_path / "lalr_lightning").mkdir()
    (tmp_path / "lalr_lightning" / "README.md").write_text("a clone's top folder\n")
    done = subprocess.run(
        [sys.executable, "-c", "import lalr_lightning; from lalr_lightning import analyze; print(lalr_lightning.__file__)"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip().splitlines()[-1]) == ROOT / "lalr_lightning" / "__init__.py"


def test_wheel_layout_finds_its_shipped_configs(tmp_path):
    # the wheel's layout (pyproject maps configs/ to lalr_lightning/configs), without the clone
    site = tmp_path / "site"
    shutil.copytree(ROOT / "lalr_lightning", site / "lalr_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", site / "lalr_lightning" / "configs")
    work = tmp_path / "work"
    work.mkdir()
    env = _clean_env()
    env["PYTHONPATH"] = str(site)
    code = ("import lalr_lightning.cli as c; print(c.__file__); print(c.resolve_config('quickstart')); "
            "print(c.resolve_config('configs/pruning_digits_dense.yaml')); print(len(c.packaged_configs()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    module, quickstart, dense, count = done.stdout.strip().splitlines()[-4:]
    assert Path(module) == site / "lalr_lightning" / "cli" / "__init__.py"
    assert Path(quickstart) == site / "lalr_lightning" / "configs" / "quickstart.yaml"
    assert Path(dense) == site / "lalr_lightning" / "configs" / "pruning_digits_dense.yaml"
    assert int(count) == len(list((ROOT / "configs").glob("*.yaml")))


@pytest.mark.smoke
def test_pyproject_ships_the_configs_in_the_wheel_and_builds_with_hatchling():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["build-system"]["build-backend"] == "hatchling.build"  # editable = a .pth path entry
    wheel = project["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert set(wheel["only-include"]) == {"lalr_lightning", "configs"}
    assert wheel["sources"] == {"configs": "lalr_lightning/configs"}


def test_every_callback_name_is_a_top_level_name():
    """Issue 42 row 13: ``lalr_lightning.SpectrumSelect`` raised AttributeError, the hand-written
    top-level map had missed it; the map now follows ``lalr_lightning.callbacks.__all__``."""
    import lalr_lightning
    from lalr_lightning import callbacks

    for name in callbacks.__all__:
        assert getattr(lalr_lightning, name) is getattr(callbacks, name), name
        assert name in lalr_lightning.__all__ and name in dir(lalr_lightning)
