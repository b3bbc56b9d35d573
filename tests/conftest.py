"""Test-wide settings: offline, headless, quiet; one worker per shared launch."""

import logging
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("MPLBACKEND", "Agg")

logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

# One intra-op thread per test process: pytest-xdist already runs one process per core, and
# small LAPACK calls slow down badly when threads oversubscribe the cores.
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_ignore_collect(collection_path, config):
    """``pytest -m smoke`` imports only the test files that hold a smoke test: collecting (importing)
    every file costs more than the quick check runs."""
    if (config.getoption("markexpr") == "smoke" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "pytest.mark.smoke" not in collection_path.read_text()
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks (--dist loadgroup, pyproject.toml)
def pytest_collection_modifyitems(config, items):
    """The tests that share a module-scoped fixture (a pair of processes run once for many tests, a
    torch.distributed.run launch, a model written once) run on one pytest-xdist worker: spread over
    two, each worker set the fixture up, and a file-locked launch (tests/_dist.py's run_pair_once)
    left the second worker waiting for as long as the first one's launch ran.
    xdist's loadgroup sends the largest groups first; every other test goes to whichever worker is
    free, one at a time."""
    shared, root = {}, {}

    def find(key):
        while root.setdefault(key, key) != key:
            key = root[key]
        return key

    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        names = sorted(name for name, defs in (info.name2fixturedefs.items() if info else ())
                       if defs and defs[-1].scope == "module" and not defs[-1]._autouse)
        if names:
            keys = [f"{item.module.__name__}:{name}" for name in names]
            shared[item] = keys
            for key in keys[1:]:  # a fixture built on another (test_cli's broken_files): one group
                root[find(key)] = find(keys[0])
    for item, keys in shared.items():
        item.add_marker(pytest.mark.xdist_group(find(keys[0])))


@pytest.fixture(autouse=True)
def _logging_restored():
    """A test that runs a benchmark's ``main`` in-process quietens logging the way the script does
    (``logging.disable``, logger levels); put it back, or a later test on the same xdist worker
    sees no info line (the selection summary tests did)."""
    manager = logging.root.manager
    disabled = manager.disable
    levels = {name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    yield
    if manager.disable != disabled:
        logging.disable(disabled)
    for name, lg in list(manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and name in levels and lg.level != levels[name]:
            lg.setLevel(levels[name])
