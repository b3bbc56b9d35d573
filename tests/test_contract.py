"""What every exported callback promises: the naming table (docs/naming.md), the state contract
(save -> load -> the same decisions; a checkpoint with other settings is refused by name), one
exception type for divergence, and arguments of other modes rejected."""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lalr_lightning.callbacks as cbs
from lalr_lightning import DivergenceError
from lalr_lightning.callbacks import LayerwiseCallback, SettingsMismatchError
from lalr_lightning.core.runtime.checks import deprecated_names
from lalr_lightning.models.cnn import SmallResNet
from tests._toys import make_trainer


def _model(seed=0):
    torch.manual_seed(seed)
    return SmallResNet(num_classes=4, width=4, blocks_per_group=1,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9))


def _loader(n=24):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)),
                      batch_size=8)


# one instance of every exported callback, with a setting that another instance changes
CASES = {
    "TempBalanceCallback": (dict(min_evals=5), "min_evals", 6),
    "LALRScheduleCallback": (dict(groups="histogram"), "floor", 0.2),
    "HTSRPruning": (dict(target_sparsity=0.3, min_numel=16, min_evals=3), "target_sparsity", 0.4),
    "LayerLRMultiplier": (dict(patterns={"model.fc": 2.0}), "granularity", "block"),
    "SurgicalBlocks": (dict(select="last"), "select", "first"),
    "AutoRGN": (dict(n_batches=2), "n_batches", 3),
    "BlockSchedule": (dict(schedule="lisa", gamma=1, every_n_steps=2), "gamma", 2),
    "LMSAStepper": (dict(update="optimizer"), "num_blocks", 2),
    "ProximalRegularizer": (dict(lam=0.5), "granularity", "layer"),
    "NTKDiagnostics": (dict(probe_size=8), "sigma", 1e-2),
    "NTKSelect": (dict(max_layers=3, probe_size=8), "kappa_max", 500.0),
    "SpectrumSelect": (dict(top_percent=50), "top_percent", 25.0),
}
EXPORTED = sorted(n for n in cbs.__all__ if inspect.isclass(getattr(cbs, n)) and issubclass(getattr(cbs, n), LayerwiseCallback)
                  and getattr(cbs, n) not in (LayerwiseCallback, cbs.LayerSelection))


def test_every_exported_callback_is_covered():
    assert set(EXPORTED) == set(CASES)


# ----------------------------------------------------------------------------- naming table

OLD_NAMES = {"exclude_head", "exclude_first_last", "switch_every", "reselect_every_n_epochs", "selection_batches",
             "block_patterns", "multipliers"}


@pytest.mark.parametrize("name", EXPORTED)
def test_constructor_follows_the_naming_table(name):
    cls = getattr(cbs, name)
    params = inspect.signature(cls).parameters
    for arg, p in params.items():
        if arg in OLD_NAMES:  # an old name survives only as a deprecated, keyword-only alias
            assert arg in deprecated_names(cls) and p.kind is p.KEYWORD_ONLY, arg
        elif "every" in arg:
            assert arg in ("every_n_epochs", "every_n_steps", "plot_every_n_epochs"), arg
        elif "batches" in arg:
            assert arg == "n_batches", arg
        assert not arg.startswith("exclude_") or arg == "exclude" or arg in deprecated_names(cls), arg
    if "blocks" in params:
        assert "Sequence" in str(params["blocks"].annotation)  # blocks are always patterns
    assert "name" in params and "strict_resume" in params
    # a decision: LR factors, a selection, pruning ratios, the share of steps pulled toward
    # theta_0 (ProximalRegularizer), per-layer NTK perturbations (NTKDiagnostics, which decides nothing)
    assert cls.traits.decision_attr in ("multipliers", "selected", "ratios", "regularized_fraction", "etas")
    cb = cls(**CASES[name][0])
    settings = cb.settings()  # every argument readable under its own name, as plain Python
    assert set(settings) == {a for a in params if a not in ("name", "strict_resume") and a not in deprecated_names(cls)}
    for attr in ("scores", "history", "restored", cls.traits.decision_attr):
        assert hasattr(cb, attr), attr
    assert cls.__doc__ and ">>>" in cls.__doc__  # opens with a runnable example (tests/test_docs.py runs it)


def test_deprecated_names_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="exclude_first_last"):
        tb = cbs.TempBalanceCallback(exclude_first_last=False)
    assert tb.first and tb.head
    with pytest.warns(DeprecationWarning, match="exclude_head"):
        assert cbs.HTSRPruning(exclude_head=False).head
    with pytest.warns(DeprecationWarning, match="switch_every"):
        assert cbs.SurgicalLayerSelect(mode="lisa", switch_every=3).every_n_steps == 3
    with pytest.warns(DeprecationWarning):
        lm = cbs.LMSAStepper(selection_batches=2, reselect_every_n_epochs=3)
    assert (lm.n_batches, lm.every_n_epochs) == (2, 3)
    with pytest.warns(DeprecationWarning, match="multipliers"):
        assert cbs.LayerLRMultiplier(multipliers={"a": 2.0}).patterns == {"a": 2.0}
    with pytest.raises(ValueError, match="not both"):
        cbs.BlockSchedule(every_n_steps=4, switch_every=3)
    # readable aliases
    tb, pruner, blocks = cbs.TempBalanceCallback(), cbs.HTSRPruning(), cbs.SurgicalBlocks()
    tb.scores, pruner.scores, blocks.selected = {"a": 2.5}, {"b": 3.0}, ["c"]
    with pytest.warns(DeprecationWarning, match=r"TempBalanceCallback\.alphas .*use \.scores"):
        assert tb.alphas == {"a": 2.5}
    with pytest.warns(DeprecationWarning, match=r"HTSRPruning\.metric_values .*use \.scores"):
        assert pruner.metric_values == {"b": 3.0}
    with pytest.warns(DeprecationWarning, match=r"SurgicalBlocks\.trainable .*use \.selected"):
        assert blocks.trainable == ["c"]
    with pytest.raises(AttributeError, match="read-only"):
        tb.alphas = {}


# every deprecated name of docs/naming.md's table, read or passed as a user's script would
DEPRECATED = {
    "exclude_first_last": lambda: cbs.TempBalanceCallback(exclude_first_last=True),
    "exclude_head": lambda: cbs.HTSRPruning(exclude_head=True),
    "switch_every": lambda: cbs.SurgicalLayerSelect(mode="lisa", switch_every=3),
    "selection_batches": lambda: cbs.LMSAStepper(selection_batches=2),
    "reselect_every_n_epochs": lambda: cbs.LMSAStepper(reselect_every_n_epochs=2),
    "multipliers": lambda: cbs.LayerLRMultiplier(multipliers={"a": 2.0}),
    "alphas": lambda: cbs.TempBalanceCallback().alphas,
    "metric_values": lambda: cbs.HTSRPruning().metric_values,
    "trainable": lambda: cbs.SurgicalLayerSelect(mode="lisa").trainable,
    "plot_every_n_epochs": lambda: cbs.TempBalanceCallback(plot_every_n_epochs=2),
}


@pytest.mark.parametrize("old", DEPRECATED)
def test_every_deprecated_name_warns_once_at_the_users_line(old):
    """Under the strictest filter each old name gives exactly one DeprecationWarning, and it
    points at the caller's line, not into the package (Python's default filters show
    DeprecationWarnings only where they point into ``__main__``)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DEPRECATED[old]()
    dep = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(dep) == 1 and old in str(dep[0].message), [str(w.message) for w in dep]
    assert dep[0].filename == __file__, dep[0].filename


def test_deprecated_names_of_the_docs_are_the_ones_tested():
    """docs/naming.md's deprecated table lists exactly the names tested above."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "naming.md").read_text()
    section = text.split("## Deprecated names")[1].split("\n## ")[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    olds = {m for row in rows for m in re.findall(r"[.(](\w+)\b(?==|`)", row)}
    assert olds == set(DEPRECATED)


@pytest.mark.parametrize("make, stray", [
    (lambda: cbs.TempBalanceCallback(assign="sqrt", lr_min_ratio=0.3), "lr_min_ratio"),
    (lambda: cbs.TempBalanceCallback(assign="linear_map", std=2.0), "std"),
    (lambda: cbs.BlockSchedule(schedule="lift", gamma=2), "gamma"),
    (lambda: cbs.BlockSchedule(schedule="lisa", order="random"), "order"),
    (lambda: cbs.SurgicalLayerSelect(mode="blocks", gamma=2), "gamma"),
    (lambda: cbs.SurgicalLayerSelect(mode="auto_rgn", order="random"), "order"),
    (lambda: cbs.AutoRGN(criterion="rgn", eb_threshold=0.5), "eb_threshold"),
    (lambda: cbs.LMSAStepper(update="optimizer", inner_lr=1e-3), "inner_lr"),
    (lambda: cbs.LMSAStepper(select="all", num_blocks=2), "num_blocks"),
    (lambda: cbs.LALRScheduleCallback(mode="weighted", phases=["svd"]), "phases"),
    (lambda: cbs.LALRScheduleCallback(groups="shape", bins=32), "bins"),
    (lambda: cbs.HTSRPruning(metric="norm", fit="ks"), "fit"),
    (lambda: cbs.HTSRPruning(structured=False, channel_step=0.02), "channel_step"),
])
def test_arguments_of_another_mode_are_rejected_with_the_valid_combinations(make, stray):
    with pytest.raises(ValueError, match=f"{stray}.*(takes|each)"):
        make()


# ----------------------------------------------------------------------------- state contract


def _fit(cb, tmp_path, epochs, ckpt=None, model_seed=0):
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([cb, saver], max_epochs=epochs, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        _model(model_seed), _loader(), ckpt_path=ckpt)
    return tmp_path / "last.ckpt"


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


@pytest.mark.parametrize("name", EXPORTED)
def test_state_contract(name, tmp_path):
    """save -> load -> equal decisions; a resumed run continues as an uninterrupted one; the
    checkpoint loads with weights_only=True; other settings are refused, naming the setting."""
    cls = getattr(cbs, name)
    kw, key, other = CASES[name]
    full = cls(**kw)
    _fit(full, tmp_path / "full", 3)
    first = cls(**kw)
    ckpt = _fit(first, tmp_path / "first", 2)
    state = torch.load(ckpt, weights_only=True)["callbacks"][first.state_key]  # plain containers only
    assert state["version"] == cls.traits.state_version and state["settings"] == first.settings()

    loaded = cls(**kw)
    assert not loaded.restored
    loaded.load_state_dict(state)
    assert loaded.restored
    for attr in ("history", "scores", cls.traits.decision_attr):
        assert _same(getattr(loaded, attr), getattr(first, attr)), attr

    resumed = cls(**kw)
    _fit(resumed, tmp_path / "resumed", 3, ckpt=str(ckpt), model_seed=123)  # other init: all from the checkpoint
    assert _same(resumed.history, full.history)
    assert _same(getattr(resumed, cls.traits.decision_attr), getattr(full, cls.traits.decision_attr))

    with pytest.raises(SettingsMismatchError, match=f"{key}="):
        cls(**{**kw, key: other}).load_state_dict(state)
    lenient = cls(**{**kw, key: other}, strict_resume=False)
    lenient.load_state_dict(state)
    assert lenient.restored


def test_history_is_bounded():
    sched = cbs.BlockSchedule(schedule="lift", every_n_steps=1)
    sched.traits = sched.traits.but(history_limit=4)
    make_trainer([sched], max_epochs=3).fit(_model(), _loader())  # 9 switches
    assert len(sched.history) == 4 and [h["switch"] for h in sched.history] == [5, 6, 7, 8]


# ----------------------------------------------------------------------------- divergence


class _NaNAfterFirstStep(Callback):
    """Puts a NaN into a middle conv's weights once the first epoch ends."""

    def on_train_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            pl_module.model.layer2[0].conv1.weight[0, 0, 0, 0] = float("nan")


@pytest.mark.parametrize("make", [
    lambda: cbs.TempBalanceCallback(min_evals=5),
    lambda: cbs.LALRScheduleCallback(groups="histogram"),
    lambda: cbs.HTSRPruning(when=1, min_numel=16, min_evals=3),
    lambda: cbs.AutoRGN(),
], ids=["tempbalance", "lalr", "pruning", "autorgn"])
def test_divergence_is_one_exception_naming_the_layer_and_the_step(make):
    with pytest.raises(DivergenceError, match=r"layer2\.0\.conv1.*NaN or Inf at epoch 1, step 3"):
        make_trainer([_NaNAfterFirstStep(), make()], max_epochs=2).fit(_model(), _loader())


def test_changelog_names_where_every_removed_name_went():
    """CHANGELOG.md's table of removed names: each old name is really gone (no silent shim) and
    each replacement it names imports."""
    import importlib
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    section = text.split("### Removed")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.split("|")[1:3]] for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 18
    checked = 0
    for old, new in rows:
        m = re.match(r"`(?:lalr_lightning\.)?callbacks\.(\w+)\.(\w+)", old)
        if m:  # a module-level name of a callback module: gone
            module = importlib.import_module(f"lalr_lightning.callbacks.{m.group(1)}")
            assert not hasattr(module, m.group(2)), old
        m = re.match(r"`(HTSRPruning|TempBalanceCallback)\.(\w+)\(", old)
        if m:  # a method: gone
            assert not hasattr(getattr(cbs, m.group(1)), m.group(2)), old
        for path in re.findall(r"`(lalr_lightning(?:\.\w+)+)", new):
            module, _, attr = path.rpartition(".")
            try:
                target = importlib.import_module(path)
            except ModuleNotFoundError:
                target = getattr(importlib.import_module(module), attr, None)
            assert target is not None, path
            checked += 1
    assert checked >= 18


@pytest.mark.parametrize("name", EXPORTED)
def test_plan_gives_the_decision_or_says_there_is_none(name):
    """Every exported callback's plan(model): a table of its decision (the callbacks that
    decide from the weights alone) or a ValueError naming those that do; the model unchanged
    either way (tests/test_plan.py checks the tables against fits)."""
    cls = getattr(cbs, name)
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.requires_grad for p in model.parameters()]
    if cls.traits.decides_from_weights:
        plan = cls(**CASES[name][0]).plan(model)
        assert list(plan.columns)[0] == "layer" and cls.traits.decision_key in plan.columns and len(plan) >= 2
    else:
        with pytest.raises(ValueError, match="no decision without a fit.*TempBalanceCallback"):
            cls(**CASES[name][0]).plan(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert grads == [p.requires_grad for p in model.parameters()]
    assert sorted(n for n in EXPORTED if getattr(cbs, n).traits.decides_from_weights) == [
        "HTSRPruning", "LALRScheduleCallback", "SpectrumSelect", "TempBalanceCallback"]
