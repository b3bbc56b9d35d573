"""A method's traits are declared once (``Traits``, issue 44): checked as declared, the old class
attributes folded in with one DeprecationWarning, and the base a method author reads kept small."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from lalr_lightning.callbacks import LayerwiseCallback, TempBalanceCallback
from lalr_lightning.callbacks.host import Traits
from tests._toys import MemLogger, ToyMLP, make_trainer

ROOT = Path(__file__).resolve().parents[1]


def _base_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("_base_names", ROOT / "benchmarks" / "base_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.public_names(LayerwiseCallback)


def test_the_base_a_method_author_reads_has_at_most_25_public_names():
    names = _base_names()
    assert len(names) <= 25, names
    assert "traits" in names and "cadence" in names
    for gone in ("log_prefix", "decision_attr", "readable", "reject", "check_finite"):
        assert gone not in names


def test_traits_refuse_a_bad_declaration_in_one_line():
    with pytest.raises(ValueError, match=r"^Traits: measures must be 'weights' or 'data', got 'batches'$"):
        Traits(measures="batches")
    with pytest.raises(TypeError, match="unexpected keyword argument 'log_prefx'"):
        Traits(log_prefx="mine")
    with pytest.raises(TypeError, match=r"Traits has no field 'log_prefx'; the fields: .*log_prefix"):
        Traits().but(log_prefx="mine")
    with pytest.raises(ValueError, match=r"^Traits: heatmap must be None or \(key, title, colour-bar label\)"):
        Traits(heatmap=("only a key",))
    with pytest.raises(ValueError, match=r"^Traits: history_limit must be an integer >= 1, got 0$"):
        Traits(history_limit=0)
    with pytest.raises(ValueError, match=r"^Traits: readable must be a tuple of attribute names"):
        Traits(readable=["scores"])


def test_a_subclass_changes_some_traits_and_keeps_the_parents_others():
    @dataclass(eq=False, repr=False)
    class Mine(TempBalanceCallback):
        traits = TempBalanceCallback.traits.but(log_prefix="mine")

    assert Mine.traits.log_prefix == "mine" and Mine().prefix == "mine"
    assert Mine.traits.score_key == "alpha" and Mine.traits.esd_plots  # the parent's
    assert TempBalanceCallback.traits.log_prefix == "tempbalance"  # the parent's own are untouched


def test_importing_every_callback_warns_nothing():
    # the package's own classes declare ``traits``: none trips the fold of the old class attributes
    code = ("import importlib, pkgutil, warnings; warnings.simplefilter('error');"
            "import lalr_lightning.callbacks as c;"
            "[importlib.import_module(m.name) for m in pkgutil.iter_modules(c.__path__, 'lalr_lightning.callbacks.')]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_old_class_attributes_are_folded_into_traits_with_one_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        @dataclass(eq=False, repr=False)
        class OldStyle(TempBalanceCallback):  # as the last release's docs wrote a method
            log_prefix = "old_style"
            score_key = "a"
            logs_lr = False

    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    message = str(deprecations[0].message)
    assert message.startswith("OldStyle: setting log_prefix, score_key, logs_lr as class attributes is deprecated")
    assert "traits = TempBalanceCallback.traits.but(log_prefix='old_style', score_key='a', logs_lr=False)" in message
    assert deprecations[0].filename == __file__  # attributed to the class's own module
    assert OldStyle.traits == TempBalanceCallback.traits.but(log_prefix="old_style", score_key="a", logs_lr=False)
    assert "log_prefix" not in vars(OldStyle)  # held once, in traits

    # the folded values are the ones the run uses: its keys, and no lr_eff (logs_lr=False)
    logger = MemLogger()
    make_trainer([OldStyle()], max_epochs=1, logger=logger, log_every_n_steps=1).fit(ToyMLP())
    keys = {k for _, row in logger.rows for k in row}
    assert any(k.startswith("old_style/a/") for k in keys), sorted(keys)
    assert not [k for k in keys if k.startswith(("tempbalance/", "lr_eff/")) or "/alpha/" in k], sorted(keys)


def test_an_old_computed_trait_is_refused_naming_the_new_spelling():
    with pytest.raises(TypeError, match=r"^Computed: needs_whole_model must be values; set one that depends on the "
                                        r"settings in __post_init__: self.traits = self.traits.but\(needs_whole_model"):
        class Computed(TempBalanceCallback):
            @property
            def needs_whole_model(self) -> bool:
                return True
