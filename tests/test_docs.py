"""The runnable examples that open every callback's docstring, and the measured figures of
docs/results.md (moved there from the README): each names the command that gave it and its date,
and the test count it quotes is the suite's."""

from __future__ import annotations

import doctest
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lalr_lightning.callbacks as cbs

EXAMPLES = sorted(n for n in cbs.__all__ if inspect.isclass(getattr(cbs, n)) and ">>>" in (getattr(cbs, n).__doc__ or ""))


@pytest.mark.smoke
def test_every_callback_has_an_example():
    callbacks = {n for n in cbs.__all__ if inspect.isclass(getattr(cbs, n))
                 and issubclass(getattr(cbs, n), cbs.LayerwiseCallback)
                 and getattr(cbs, n) not in (cbs.LayerwiseCallback, cbs.LayerSelection)}
    assert callbacks <= set(EXAMPLES)


@pytest.mark.smoke
@pytest.mark.parametrize("name", EXAMPLES)
def test_docstring_example_runs(name):
    torch.manual_seed(0)
    cls = getattr(cbs, name)
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(cls, name, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result.failed} of {result.attempted} failed"


ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _measured_results() -> list[str]:
    """The paragraphs of docs/results.md's first section that open with a bold title."""
    section = ("\n" + RESULTS.read_text()).split("\n# Measured results\n")[1].split("\n## ")[0]
    return [p for p in re.split(r"\n\s*\n", section) if p.startswith("**")]


def test_every_measured_figure_names_its_command_and_date():
    paragraphs = _measured_results()
    assert len(paragraphs) >= 8
    for paragraph in paragraphs:
        title = paragraph.split("**")[1]
        # a paragraph of one-line bullets: each bullet is a figure of its own
        figures = [line for line in paragraph.splitlines() if line.startswith("- ")] or [paragraph]
        for figure in figures:
            where = f"docs/results.md, {title!r}: {figure[:60]!r}"
            assert re.search(r"`[^`]*\b(python|pytest|du|time)\b[^`]*`", figure), f"{where} names no command"
            assert DATE.search(figure), f"{where} has no date (YYYY-MM-DD) of its measurement"


def _quoted_test_count() -> int:
    counts = re.findall(r"\*\*([\d,]+) tests\*\*", RESULTS.read_text())
    assert len(counts) == 1, "docs/results.md quotes the test count once, as **N tests**"
    return int(counts[0].replace(",", ""))


def _collected(request) -> int:
    """How many tests the suite has: this session's count when it collected every test file with no
    selection (the full run, CI's), else ``pytest --collect-only`` in a subprocess."""
    config, items = request.config, request.session.items
    files = {Path(str(item.path)).resolve() for item in items}
    everything = {p.resolve() for p in (ROOT / "tests").rglob("test_*.py")}
    selected = (config.getoption("keyword") or config.getoption("markexpr") or config.getoption("deselect")
                or config.getoption("lf", default=False) or any("::" in str(a) for a in config.args))
    if files == everything and not selected:
        return len(items)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    total = re.search(r"^(\d+) tests? collected", done.stdout, flags=re.M)
    if total:
        return int(total.group(1))
    per_file = [int(n) for n in re.findall(r"^\S+\.py: (\d+)$", done.stdout, flags=re.M)]
    assert per_file, done.stdout[-2000:] + done.stderr[-2000:]
    return sum(per_file)


def test_the_readme_test_count_is_the_suites(request):
    quoted, collected = _quoted_test_count(), _collected(request)
    assert abs(quoted - collected) <= 0.1 * collected, (
        f"docs/results.md says **{quoted} tests**, the suite has {collected} (python -m pytest --collect-only -q): "
        f"update the number and its date there")


_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):`~?([\w.]+)`")


def _resolves(target: str) -> bool:
    import importlib

    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_reference_in_the_package_resolves():
    """Issue 42 row 13: docstrings cited a ``DESIGN.md`` the repository does not have, base.py a
    ``callbacks.shards`` module, commands.py a ``docs/criteria.md``. Every full-path cross-reference
    (``:func:`~lalr_lightning...```, which the API reference turns into a link) names an object that
    exists, every ``docs/X.md`` a page that exists, and nothing cites the project's private notes."""
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted((root / "lalr_lightning").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(root)
        bad += [f"{where}: {t}" for t in _ROLE.findall(text) if t.startswith("lalr_lightning.") and not _resolves(t)]
        bad += [f"{where}: docs/{p}" for p in re.findall(r"docs/([\w-]+\.md)", text) if not (root / "docs" / p).is_file()]
        bad += [f"{where}: DESIGN" for _ in re.findall(r"\bDESIGN\b", text)]
    assert not bad, bad


def test_the_docs_home_page_says_how_to_install_and_git_ignores_the_built_site():
    """Issue 42 row 13: docs/index.md had no install command; ``mkdocs build`` writes ``site/``,
    which git showed as untracked."""
    root = Path(__file__).resolve().parents[1]
    home = (root / "docs" / "index.md").read_text(encoding="utf-8")
    assert re.search(r"^pip install -e \.", home, re.M) and "configs/quickstart.yaml" in home
    ignored = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=root)
    assert ignored.returncode == 0


def test_the_site_hook_turns_roles_into_references_and_keeps_the_steps_off_the_callbacks_page():
    """Issue 42 row 12, without a build: scripts/mkdocs_hooks.py (mkdocs.yml's ``hooks:``)."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", root / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    out = hooks.on_page_content('<p>see :func:<code>~lalr_lightning.core.model.layers.block_layers</code> and '
                                ':mod:<code>.base</code>; Example::</p>', None)
    assert out == ('<p>see <autoref identifier="lalr_lightning.core.model.layers.block_layers" optional><code>'
                   'block_layers</code></autoref> and <code>base</code>; Example:</p>')
    directive = hooks.callbacks_directive()
    members = re.findall(r"^        - (\w+)$", directive, re.M)
    assert set(members) == set(cbs.__all__) - {"LayerwiseCallback", "LayerSelection", "Decision"}
    hidden = set(re.findall(r'"!\^(\w+)\$"', directive))
    assert {"measure", "decide", "after_wrap", "apply", "configure", "decide_in_setup"} <= hidden
    assert not hidden & {"plan", "selected_blocks", "prune", "overall_sparsity"}
    assert "mkdocs_hooks.py" in (root / "mkdocs.yml").read_text() and hooks.MARKER in (
        root / "docs/api/callbacks.md").read_text()
