"""No device-to-host synchronisation on a step that decides nothing (issue 34): every per-step
path of every callback is watched for ``.item()`` / ``.tolist()`` / ``bool(t)`` / ``float(t)`` /
``.nonzero()`` / ``.cpu()`` (tests/_nosync.py); the GPU lane repeats this under
``torch.cuda.set_sync_debug_mode("error")`` (tests/gpu/test_step_sync_gpu.py)."""

from __future__ import annotations

import pytest
import torch

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
from lalr_lightning.core.runtime.control import LayerControl
from tests._nosync import SyncWatch
from tests._toys import ToyMLP, make_trainer

CASES = {
    "proximal_tensor": lambda: ProximalRegularizer(lam=1.0, granularity="tensor", every_n_epochs=None),
    "proximal_layer": lambda: ProximalRegularizer(lam=1.0, granularity="layer", every_n_epochs=None),
    "proximal_global": lambda: ProximalRegularizer(lam=1.0, granularity="global", every_n_epochs=None),
    "proximal_l2sp": lambda: ProximalRegularizer(lam=1.0, selective=False, every_n_epochs=None),
    "pruning": lambda: HTSRPruning(target_sparsity=0.3, min_evals=2),
    "tempbalance_steps": lambda: TempBalanceCallback(every_n_steps=3, min_evals=2),
    "tempbalance": lambda: TempBalanceCallback(min_evals=2),
    "lalr": lambda: LALRScheduleCallback(),
    "autorgn": lambda: AutoRGN(n_batches=2),
    "multiplier": lambda: LayerLRMultiplier({"net.0": 0.5, "net.6": 2.0}),
    "lisa": lambda: BlockSchedule("lisa", gamma=1, every_n_steps=4),
    "lmsa": lambda: LMSAStepper(update="msa", n_batches=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_read_on_a_step_that_decides_nothing(case):
    cb = CASES[case]()
    watch = SyncWatch(cb)
    steps = 16
    with watch:
        make_trainer([watch, cb], max_epochs=2, log_every_n_steps=1000).fit(ToyMLP(opt="adamw", lr=1e-3))
    assert watch.quiet_steps(steps) >= 4, (case, sorted(watch.deciding))  # the check saw steps to check
    assert watch.violations() == {}, case


def test_the_watch_sees_a_read():
    """The watch is not blind: a post-step transform that reads a tensor is caught."""

    class Reader(LayerLRMultiplier):
        def apply(self, trainer):
            super().apply(trainer)
            for ctl in self.controls(trainer):
                ctl.set_transform("reader", lambda step: float(step.params[0].detach().sum()))

    cb = Reader({"net.0": 0.5})
    watch = SyncWatch(cb)
    with watch:
        make_trainer([watch, cb], max_epochs=1).fit(ToyMLP())
    assert watch.violations() and all(r == ["__float__"] for r in watch.violations().values())


def test_grouped_masks_equal_masked_fill():
    """The foreach masking gives masked_fill's numbers (a kept entry times 1 is itself)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.SGD(params, lr=0.1)
    keeps = {p: torch.rand_like(p) > 0.4 for p in params}
    want = [p.detach().masked_fill(~keeps[p], 0) for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.masked_fill(~keeps[p], 0) for p in params]
    ctl = LayerControl.of(opt)
    ctl.set_masks("a", keeps, zero_state=False)
    ctl.mask_gradients()
    for p, w, g in zip(params, want, grads):
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g)
    # two owners: the intersection
    other = {params[0]: torch.rand_like(params[0]) > 0.5}
    ctl.set_masks("b", other, zero_state=False)
    assert torch.equal(params[0].detach() == 0, ~(keeps[params[0]] & other[params[0]]) | (want[0] == 0))
