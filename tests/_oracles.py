"""Oracles shared by the tests (module level, so ddp_spawn can pickle them)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lalr_lightning.core.runtime.control import LayerControl


class ShadowOracle(Callback):
    """Replays every real step on a shadow copy of each parameter with its own one-group
    optimizer whose hyperparameters are the real group's, with ``lr = scheduled lr x
    multiplier``; afterwards each real parameter must equal its shadow."""

    def __init__(self, expected: dict[str, float] | None = None):
        self.expected = expected  # layer-name prefix -> multiplier the test expects
        self.steps = 0
        self.max_err = 0.0
        self.seen_lrs: list[float] = []

    def on_train_start(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        self.ctl = LayerControl.of(opt)
        self.shadows = {}
        for group in opt.param_groups:
            for p in group["params"]:
                s = p.detach().clone().requires_grad_(True)
                hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                self.shadows[p] = (s, type(opt)([{"params": [s], **hyper}]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        names = dict(pl_module.named_parameters())
        inv = {id(p): n for n, p in names.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                s, sopt = self.shadows[p]
                m = self.ctl.multiplier(p)
                if self.expected is not None:
                    want = 1.0
                    for prefix, v in self.expected.items():
                        if inv[id(p)].startswith(prefix):
                            want *= v
                    assert m == pytest.approx(want), inv[id(p)]
                sg = sopt.param_groups[0]
                sg.update({k: v for k, v in group.items() if k != "params"})
                sg["lr"] = group["lr"] * m
                s.grad = p.grad.detach().clone()
                sopt.step()
        self.seen_lrs.append(float(optimizer.param_groups[0]["lr"]))
        self.last_eff = (self.ctl.effective_lrs(), float(optimizer.param_groups[0]["lr"]))
        self.steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for p, (s, _) in self.shadows.items():
            err = (p.detach() - s.detach()).abs().max().item()
            self.max_err = max(self.max_err, err)
            assert torch.allclose(p.detach(), s.detach(), rtol=1e-5, atol=1e-6), err
