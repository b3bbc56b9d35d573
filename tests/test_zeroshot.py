"""``zeroshot``: acc and acc_norm equal to lm-evaluation-harness's own on the same local task and model,
the papers' tasks through lm-evaluation-harness (a local dataset file; a missing one refused in one line)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._lm import ALPHA_WORDS, save_tiny_lm
from tests._lm import run_cli as _run

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[1]
_WORDS = ALPHA_WORDS


def _task_file(path: Path, n: int = 16, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            k = rng.randint(2, 4)  # choices of different lengths: acc_norm differs from acc
            choices = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5))) for _ in range(k)]
            context = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 10)))
            f.write(json.dumps({"context": context, "choices": choices, "label": rng.randrange(k)}) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("zeroshot")
    model = save_tiny_lm(root / "llama", "llama", False, seed=3)
    task = _task_file(root / "local.jsonl")
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "local.yaml").write_text("\n".join([
        "task: lalr_local", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {task}",
        "test_split: test", "output_type: multiple_choice", 'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{label}}"', "metric_list:", "  - metric: acc",
        "  - metric: acc_norm", ""]))
    return root, model, task, tasks


def test_zeroshot_equals_lm_evaluation_harness(files, tmp_path, capsys, monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from lalr_lightning.oneshot.zeroshot import encode_pair, loglikelihoods, read_task

    root, model, task, tasks = files
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ref = lm_eval.simple_evaluate(model=HFLM(pretrained=str(model), device="cpu", batch_size=8), tasks=["lalr_local"],
                                  task_manager=TaskManager(include_path=str(tasks)), num_fewshot=0, log_samples=True)
    theirs = ref["results"]["lalr_local"]
    code, out, err = _run(["zeroshot", str(model), "--task", str(task), "--out", str(tmp_path / "z.json"),
                           "--batch-size", "3"], capsys)
    assert code == 0, err
    ours = json.loads((tmp_path / "z.json").read_text())["results"]["local"]
    assert ours["acc"] == theirs["acc,none"] and ours["acc_norm"] == theirs["acc_norm,none"]
    assert ours["acc_stderr"] == pytest.approx(theirs["acc_stderr,none"])
    assert ours["n"] == theirs["sample_len"] == 16
    assert "local" in out and "mean" in out  # the table
    # every choice's log-likelihood, not only the argmax: the same tokens and the same sums
    from transformers import AutoModelForCausalLM, AutoTokenizer

    docs = read_task(task)
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    mine = loglikelihoods(lm, [encode_pair(tok, d["context"], " " + c) for d in docs for c in d["choices"]], 5)
    samples = sorted(ref["samples"]["lalr_local"], key=lambda s: s["doc_id"])
    their_lls = [float(r[0][0]) for s in samples for r in s["resps"]]
    assert mine == pytest.approx(their_lls, abs=1e-4)
    assert len(set(round(x, 3) for x in mine)) > len(mine) // 2  # not a degenerate model


def test_trailing_context_spaces_move_to_the_continuation(files):
    from transformers import AutoTokenizer

    from lalr_lightning.oneshot.zeroshot import encode_pair

    _, model, _, _ = files
    tok = AutoTokenizer.from_pretrained(model)
    assert encode_pair(tok, "the cat ", "sees") == encode_pair(tok, "the cat", " sees")
    ctx, cont = encode_pair(tok, "the cat", " sees the dog")
    assert ctx[0] == tok.bos_token_id and len(cont) == 3  # BOS from the tokenizer, as HFLM's default


def test_local_dataset_runs_through_the_harness_task(files, tmp_path, capsys, monkeypatch):
    """--tasks with --data-dir: the harness's own boolq config (prompt, choices, metric) on a local file."""
    root, model, _, _ = files
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rng = random.Random(1)
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "boolq.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"question": " ".join(rng.choice(_WORDS) for _ in range(4)),
                                "passage": " ".join(rng.choice(_WORDS) for _ in range(8)), "idx": i,
                                "label": i % 2}) + "\n")
    code, out, err = _run(["zeroshot", str(model), "--tasks", "boolq", "--data-dir", str(data), "--quiet",
                           "--out", str(tmp_path / "b.json")], capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "b.json").read_text())["results"]["boolq"]
    assert 0.0 <= res["acc"] <= 1.0 and res["acc"] * 6 == round(res["acc"] * 6)


def test_missing_dataset_offline_is_one_line(files, tmp_path):
    _, model, _, _ = files
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "lalr_lightning", "zeroshot", str(model), "--tasks", "boolq,rte",
                        "--quiet"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "task boolq" in lines[0] and "aps/super_glue/boolq" in lines[0] and "docs/zeroshot.md" in lines[0]


@pytest.mark.parametrize("line, phrase", [
    ('{"context": "the cat", "choices": ["a"], "label": 0}', "at least two"),
    ('{"context": "the cat", "choices": ["a", "b"], "label": 2}', "label"),
    ("not json", "not JSON"),
])
def test_bad_task_file_is_one_line(files, tmp_path, capsys, line, phrase):
    _, model, _, _ = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    code, _, err = _run(["zeroshot", str(model), "--task", str(bad)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and phrase in err and "line 1" in err


@pytest.mark.parametrize("where, phrase", [("dir", "is a directory"), ("missing/r.json", "no such folder")])
def test_an_out_that_cannot_be_written_is_one_line_before_the_evaluation(files, tmp_path, capsys, monkeypatch, where,
                                                                         phrase):
    """Refused before the model loads (the evaluation's results were lost to an IsADirectoryError
    traceback after it ran)."""
    import lalr_lightning.oneshot.commands as commands

    _, model, task, _ = files
    (tmp_path / "dir").mkdir()
    monkeypatch.setattr(commands, "_zeroshot_run", lambda *a: pytest.fail("evaluated before checking --out"))
    code, _, err = _run(["zeroshot", str(model), "--task", str(task), "--quiet", "--out", str(tmp_path / where)],
                        capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and phrase in err and "--out" in err


def test_a_choice_longer_than_the_models_positions_is_one_line(files, tmp_path, capsys):
    """Issue 42 row 4: a choice of more tokens than the model's 64 positions was torch's "Size does
    not match at dimension 0"; now one line names the file, the line and the length."""
    _, model, _, _ = files
    long = " ".join(_WORDS[i % len(_WORDS)] for i in range(200))
    bad = tmp_path / "long.jsonl"
    bad.write_text(json.dumps({"context": "the cat", "choices": ["a dog", "b"], "label": 0}) + "\n\n"
                   + json.dumps({"context": "the cat", "choices": ["a", long], "label": 1}) + "\n")
    code, _, err = _run(["zeroshot", str(model), "--task", str(bad), "--quiet", "--out", str(tmp_path / "r.json")],
                        capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    n = int(re.search(r"choice 1 is (\d+) tokens", err).group(1))
    assert n > 64 and "long.jsonl line 3" in err and "64 positions" in err
