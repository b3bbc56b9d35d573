"""The front door: the README is short and in the order a newcomer needs it, its commands are what CI
runs, its usage example runs as written, the papers are cited by title and link (no seed file
names anywhere), and the documentation site builds without a broken link."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._browser import CHROMIUM, NO_CHROMIUM, render

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 200
SECTIONS = ["Set up", "Methods", "On your own Trainer", "Where to go next"]


@pytest.mark.smoke
def test_the_readme_is_short_and_in_order():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES} (the rest goes to docs/)"
    assert re.findall(r"^## (.+)$", README, flags=re.M) == SECTIONS
    assert lines[0].startswith("# ") and not re.findall(r"^### ", README, flags=re.M)
    # what the package does, in one paragraph, before the first section
    intro = README.split("\n## ")[0].split("\n", 1)[1].strip()
    assert intro and "\n\n" not in intro, intro
    setup = README.split("\n## Set up\n")[1].split("\n## ")[0]
    # the set-up commands: the quickstart, then the tests, the quick check offered first
    quick, smoke, suite = (setup.index(s) for s in ("fit --config configs/quickstart.yaml", "python -m pytest -m smoke",
                                                    "python -m pytest -n 2"))
    assert quick < smoke < suite
    methods = README.split("\n## Methods\n")[1].split("\n## ")[0]
    assert re.search(r"^\| callback or command \| paper \| use it when \|$", methods, flags=re.M)
    assert "mkdocs serve" in README.split("\n## Where to go next\n")[1]


@pytest.mark.smoke
def test_ci_runs_the_readme_test_command():
    """The stop hook takes the README's first pytest command (grep -Eo '(python -m )?pytest[^`]*' |
    head -n 1): it must hold the full suite, and .ci/run must run both it and the site's build."""
    first = re.findall(r"(?:python -m )?pytest[^`\n]*", README)[0]
    assert "python -m pytest -n 2" in first and "-m smoke" in first, first
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -m smoke" in ci and "python -m pytest -n 2" in ci and "mkdocs build --strict" in ci
    assert 'pip install -q -e ".[dev,text]"' in ci and 'pip install -e ".[dev,text]"' in README


def test_every_method_cites_its_paper_by_title_and_link():
    methods = README.split("\n## Methods\n")[1].split("\n## ")[0]
    rows = [r for r in methods.splitlines() if r.startswith("| `")]
    assert len(rows) >= 10
    for row in rows:
        cells = row.strip("|").split(" | ")
        assert len(cells) == 3 and cells[2].strip(), row
        linked = re.findall(r"\[([^\]]{12,})\]\((https://(?:arxiv\.org/abs/\d{4}\.\d{5}|openreview\.net/forum\?id=\w+))\)",
                            cells[1])
        assert linked or "no public link" in cells[1], row


SEED = re.compile(r"\b00[0-4]_[\w*]*\.txt|seeds/00[0-4]|\bseeds/\b|`00[0-4]`|\(00[0-4]\b|\b00[0-4] (?:ch\.|Thm|A\.\d|baseline)")


def test_no_seed_file_names_in_the_package_docs_or_configs():
    hits = []
    for folder, pattern in (("lalr_lightning", "*.py"), ("docs", "*.md"), ("configs", "*.yaml"), (".", "README.md"),
                            (".", "mkdocs.yml")):
        for path in sorted((ROOT / folder).rglob(pattern) if folder != "." else [ROOT / pattern]):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if SEED.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "cite the paper by title and link instead:\n" + "\n".join(hits)


@pytest.mark.smoke
def test_the_usage_example_runs_as_written():
    """The README's Python block with the user's module put in: a tiny MLP, one epoch."""
    from tests._toys import ToyMLP

    (block,) = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert "max_epochs=200" in block
    code = block.replace("max_epochs=200", "max_epochs=1, accelerator='cpu', logger=False, enable_checkpointing=False, "
                                           "enable_progress_bar=False, enable_model_summary=False")
    scope = {"my_module": ToyMLP(), "my_datamodule": None}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 -- the README's own example
    assert scope["tempbalance"].multipliers and scope["tempbalance"].history
    assert scope["trainer"].current_epoch == 1


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The documentation site, built once for the tests that read it."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
    built = os.environ.get("LALR_BUILT_SITE")  # .ci/run's own strict build of this tree, just before the tests
    if built and (Path(built) / "index.html").is_file():
        return Path(built)
    out = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_documentation_site_builds_strictly(site):
    """mkdocs build --strict, as CI runs it: a broken link or anchor, a page missing from the nav or an
    API page whose module cannot be rendered fails. Skipped where the dev extra's mkdocs is missing."""
    pages = {p.relative_to(site).parent.as_posix() for p in site.rglob("index.html")}
    assert {"usage", "results", "fsdp", "gpu", "surgical", "api/callbacks"} <= pages, sorted(pages)


_RAW = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):|\w::</p>")


def test_the_api_reference_shows_links_not_markup_and_no_internal_steps(site):
    """Issue 42 row 12: the API pages printed Sphinx roles as text (``:mod:``, ``:func:``,
    ``Example::``), and the Callbacks page's table of contents listed the steps a method implements
    (``decide``, ``measure``, ``after_wrap``, ...)."""
    for page in site.joinpath("api").rglob("index.html"):
        text = page.read_text(encoding="utf-8")
        assert not _RAW.findall(text), (page, _RAW.findall(text)[:5])
    callbacks = (site / "api/callbacks/index.html").read_text(encoding="utf-8")
    toc = re.findall(r'<a href="#([^"]+)" class="md-nav__link">', callbacks)
    assert "lalr_lightning.callbacks.TempBalanceCallback" in toc and "lalr_lightning.callbacks.HTSRPruning.plan" in toc
    steps = {"measure", "decide", "after_wrap", "apply", "receive", "configure", "prepare", "decide_in_setup"}
    assert not [t for t in toc if t.rpartition(".")[2] in steps], toc
    assert "lalr_lightning.callbacks.LayerwiseCallback" not in toc  # on "Writing your own callback"
    extending = (site / "api/extending/index.html").read_text(encoding="utf-8")
    assert 'id="lalr_lightning.callbacks.LayerwiseCallback.decide"' in extending
    # a role became a link to the object's entry: BlockSchedule's ":class:`LayerSelection`" and the like
    links = re.findall(r'<a class="autorefs autorefs-internal"[^>]*href="([^"]+)"', callbacks)
    assert any(h.endswith("#lalr_lightning.callbacks.LayerSelection") for h in links), links[:10]


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_an_api_page_renders_in_a_headless_browser(site, tmp_path):
    """The Callbacks page in a real browser: drawn (a screenshot that is not blank), its text free of
    raw roles, its cross-references live links, and no script error."""
    url = (site / "api/callbacks/index.html").resolve().as_uri()
    _, dom, shot_err, _ = render(url, tmp_path)
    assert "TempBalanceCallback" in dom and not _RAW.findall(dom), _RAW.findall(dom)[:5]
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="[^"]*#lalr_lightning\.callbacks\.LayerSelection"', dom)
    console = [ln for ln in shot_err.splitlines() if "Uncaught" in ln]
    assert console == []


def test_the_quickstart_says_how_to_choose_the_thread_count():
    """Issue 42 row 13: the quickstart took 57 s on a busy 2-core machine against 14 s with one thread;
    the README's quickstart block says which variable chooses it."""
    block = README.split("<!-- offline:")[1].split("```", 2)[1]
    assert "OMP_NUM_THREADS=1" in block and "quickstart" in block
