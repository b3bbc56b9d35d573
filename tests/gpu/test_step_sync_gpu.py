"""The GPU lane's check of issue 34: on a step that decides nothing, no callback's per-step work
synchronises the device with the host. Every per-step entry point (the callback's batch hooks,
LayerControl's masking, multiplier split and post-step transforms) runs under
``torch.cuda.set_sync_debug_mode("error")`` (tests/_nosync.py), which raises on ``.item()``,
``bool(t)``, ``.nonzero()``, a blocking copy to the host and the like; the host reads are
recorded too (and are all that is checked with ``LALR_GPU_LANE=cpu``)."""

from __future__ import annotations

import pytest

from lalr_lightning.callbacks import (
    AutoRGN,
    BlockSchedule,
    HTSRPruning,
    LALRScheduleCallback,
    LayerLRMultiplier,
    LMSAStepper,
    ProximalRegularizer,
    TempBalanceCallback,
)
from tests._nosync import SyncWatch
from tests._toys import ToyMLP, make_trainer
from tests.gpu._lane import ON_CUDA

CASES = {  # name: (callback, steps that decide inside a batch hook)
    "proximal_tensor": (lambda: ProximalRegularizer(lam=1.0, granularity="tensor", every_n_epochs=None), None),
    "proximal_layer": (lambda: ProximalRegularizer(lam=1.0, granularity="layer", every_n_epochs=None), None),
    "proximal_global": (lambda: ProximalRegularizer(lam=1.0, granularity="global", every_n_epochs=None), None),
    "proximal_l2sp": (lambda: ProximalRegularizer(lam=1.0, selective=False, every_n_epochs=None), None),
    "pruning": (lambda: HTSRPruning(target_sparsity=0.3, min_evals=2), None),
    "tempbalance_steps": (lambda: TempBalanceCallback(every_n_steps=3, min_evals=2), lambda s: s % 3 == 0),
    "tempbalance": (lambda: TempBalanceCallback(min_evals=2), None),
    "lalr": (lambda: LALRScheduleCallback(), None),
    "autorgn": (lambda: AutoRGN(n_batches=2), None),
    "multiplier": (lambda: LayerLRMultiplier({"net.0": 0.5, "net.6": 2.0}), None),
    "lisa": (lambda: BlockSchedule("lisa", gamma=1, every_n_steps=4), lambda s: s % 4 == 0),
    "lmsa": (lambda: LMSAStepper(update="msa", n_batches=2), None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_sync_on_a_step_that_decides_nothing(case, precision, accelerator):
    make, decides = CASES[case]
    cb = make()
    watch = SyncWatch(cb, cuda=ON_CUDA, decides=decides)
    with watch:
        make_trainer([watch, cb], max_epochs=2, accelerator=accelerator, precision=precision,
                     log_every_n_steps=1000).fit(ToyMLP(opt="adamw", lr=1e-3))
    assert watch.quiet_steps(16) >= 4, (case, sorted(watch.deciding))
    assert watch.violations() == {}, case
