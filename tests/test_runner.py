"""The runner owns the timeline and holds the method by composition (issue 44, item 1): the base a
method author reads is small, and reading a method's module loads none of the machinery."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import lalr_lightning
from lalr_lightning.callbacks import LayerwiseCallback, TempBalanceCallback
from lalr_lightning.callbacks.host import Cadence, Traits
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.runtime.decision import Decision
from tests._toys import ToyMLP, make_trainer

ROOT = Path(lalr_lightning.__file__).resolve().parents[1]  # the checkout whose code runs (its scripts read it)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_base_carries_the_method_authors_names_only():
    """The hooks a host calls, the history entry, the logs, the heatmap and plan plumbing are the
    runner's (68 public names before; issue 44's goal is 25)."""
    names = _script("benchmarks/base_names.py").public_names(LayerwiseCallback)
    assert len(names) <= 42, names
    machinery = {"after_batch", "each_batch", "finish", "first_decision", "record", "log_heatmap", "heatmap_values",
                 "decision_metrics", "log_decision", "plan_decision", "plan_columns", "is_wrapped", "device_batch",
                 "forward_order", "log_dict"}
    assert not machinery & set(names), machinery & set(names)
    assert not [n for n in dir(LayerwiseCallback) if n in ("_begin", "_train_start", "_batch_start", "_teardown")]


def test_a_method_module_loads_no_timeline_machinery():
    """``callbacks/tempbalance.py`` reads 15 package modules (21 before): the runner, the planner,
    the layer control and the cross-rank code load with the host that drives it."""
    behind = _script("scripts/reading_path.py").behind("lalr_lightning.callbacks.tempbalance")
    assert len(behind) <= 15, behind
    for machinery in ("runner", "planning", "control", "shards", "dashboards"):
        assert not [m for m in behind if m.endswith("." + machinery)], behind


class _Steps(LayerwiseCallback):
    """A method that decides at each epoch's start and counts the optional steps it defines."""

    traits = Traits(log_prefix="steps")
    cadence = Cadence(every_n_epochs=1)

    def __init__(self, name: str | None = None, strict_resume: bool = True):
        super().__init__(name=name, strict_resume=strict_resume)
        self.multipliers: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def configure(self, host, module) -> None:
        self.layers = matrix_layers(module)

    def decide(self, measured) -> Decision:
        return Decision(values={la.name: 1.0 for la in self.layers})

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def each_batch(self, host, batch) -> None:
        self._count("each_batch")

    def after_batch(self, host, outputs, batch) -> None:
        self._count("after_batch")

    def finish(self, host) -> None:
        self._count("finish")


def test_the_runner_drives_the_steps_a_method_defines_and_holds_the_method():
    from lalr_lightning.callbacks.runner import Runner

    cb, plain = _Steps(name="a"), TempBalanceCallback(every_n_epochs=1, min_evals=2)
    make_trainer([cb, plain], max_epochs=2, limit_train_batches=3).fit(ToyMLP())
    # 2 epochs x 3 batches; one decision per epoch start; finish once at the fit's end
    assert cb.calls == {"each_batch": 6, "after_batch": 6, "finish": 1}
    assert [h["epoch"] for h in cb.history] == [0, 1]
    assert [h["epoch"] for h in plain.history] == [0, 1]  # a method with no optional step runs the same cycle
    runner = Runner.of(cb)
    assert runner.method is cb and Runner.of(cb) is runner and runner.whole_copy is None and runner.wrapped
    assert not [k for k, v in vars(cb).items() if type(v).__name__ in ("Trainer", "LightningHost")]
