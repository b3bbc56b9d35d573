"""The command line starts lean: ``--help`` lists every command, argument errors of the non-Lightning
commands come before torch is imported, and ``prune`` / ``perplexity`` / ``zeroshot`` / ``analyze DIR``
never import Lightning or torchvision (``sys.modules`` of a real ``python -m lalr_lightning`` process).
The latency itself is measured in ``benchmarks/cli_latency.py``, not asserted here."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests._lm import WORDS, save_tiny_lm

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning", "lightning.pytorch", "pytorch_lightning", "torchvision")

# runs ``python -m lalr_lightning ARGS`` in this process, then reports what it imported
_PROBE = f"""
import json, runpy, sys
sys.argv = ["lalr_lightning", *json.loads(sys.argv[1])]
code = 0
try:
    runpy.run_module("lalr_lightning", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("PROBE " + json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if sys.modules.get(m) is not None]}}))
"""


def _probe(args: list[str], cwd: Path | None = None) -> tuple[int, list[str], str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(args)], capture_output=True, text=True, env=env,
                       cwd=cwd, timeout=600)
    line = next(ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("PROBE "))
    report = json.loads(line[len("PROBE "):])
    return report["code"], report["loaded"], r.stderr


def test_help_lists_every_command_with_one_line(capsys):
    from lalr_lightning.cli import COMMANDS, main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    listed = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    expected = ("fit", "validate", "test", "predict", "analyze", "prune", "perplexity", "zeroshot", "report", "configs")
    assert tuple(COMMANDS) == expected and tuple(listed) == expected
    assert all(len(ln.split(None, 1)[1]) > 20 for ln in listed.values())  # a description, on its line


@pytest.mark.parametrize("args", [
    ["analyze"], ["analyze", "x", "--fit", "nope"], ["prune", "x"], ["prune", "x", "--out", "y", "--criterion", "z"],
    ["perplexity", "x"], ["zeroshot", "x"], ["zeroshot", "x", "--task", "t.jsonl", "--batch-size", "0"],
    ["report"], ["configs", "a", "b"], ["--help"],
])
def test_argument_errors_come_before_torch(args):
    code, loaded, err = _probe(args)
    assert code == (0 if args == ["--help"] else 2), err
    assert loaded == [], f"{args}: imported {loaded}"
    if args != ["--help"]:
        assert "error:" in err.strip().splitlines()[-1]


def test_one_shot_commands_never_import_lightning_or_torchvision(tmp_path):
    model = save_tiny_lm(tmp_path / "llama", "llama", False)
    rng = random.Random(0)
    words = [w for w in WORDS if w.isalpha()]
    (tmp_path / "text.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(20)))
    (tmp_path / "task.jsonl").write_text("\n".join(json.dumps({"context": "the cat", "choices": ["sees", "red dog"],
                                                               "label": i % 2}) for i in range(3)) + "\n")
    runs = [
        ["prune", str(model), "--out", str(tmp_path / "p"), "--calibration", str(tmp_path / "text.txt"),
         "--n-samples", "4", "--seq-len", "16", "--preset", "owl"],
        ["perplexity", str(tmp_path / "p"), "--data", str(tmp_path / "text.txt"), "--seq-len", "16"],
        ["zeroshot", str(tmp_path / "p"), "--task", str(tmp_path / "task.jsonl"), "--out", str(tmp_path / "z.json")],
        ["analyze", str(model), "--out", str(tmp_path / "a"), "--no-plots"],
    ]
    for args in runs:
        code, loaded, err = _probe(args, cwd=tmp_path)
        assert code == 0, err
        assert "torch" in loaded  # they did run
        assert not set(loaded) & {"lightning", "lightning.pytorch", "pytorch_lightning", "torchvision"}, \
            f"{args[0]} imported {loaded}"
    # analyze --pruning asks HTSRPruning (Lightning, torchmetrics, torchvision): it keeps them
    code, loaded, err = _probe(["analyze", str(model), "--out", str(tmp_path / "b"), "--no-plots", "--pruning", "0.5"],
                               cwd=tmp_path)
    assert code == 0 and "lightning" in loaded, err


def test_import_lalr_lightning_is_lazy():
    code = ("import sys, lalr_lightning; assert 'torch' not in sys.modules; "
            "from lalr_lightning import HTSRPruning, analyze; print(HTSRPruning.__module__, analyze.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["lalr_lightning.callbacks.pruning", "lalr_lightning.core.spectral.htsr"]


def test_choice_lists_match_the_library():
    from lalr_lightning import choices
    from lalr_lightning.core.pruning import criteria as llm_pruning
    from lalr_lightning.core.pruning.alphapruning import PRUNING_METRICS
    from lalr_lightning.core.pruning.settings import PRESETS
    from lalr_lightning.core.spectral import htsr as spectral
    from lalr_lightning.oneshot.checkpoint import DTYPES

    assert choices.FITS == spectral.FITS and choices.CRITERIA == llm_pruning.CRITERIA
    assert choices.PRUNING_METRICS == PRUNING_METRICS and choices.DTYPES == tuple(DTYPES)
    assert {p for p in PRESETS if p} == set(choices.PRESETS)  # prune's presets are HTSRPruning's (OWL included)
