"""Kept state follows its parameter: masks, anchors theta_0 and the other tensors a callback keeps
live on their parameter's device and in its dtype when they are used, across Lightning's moves
(setup to the accelerator, teardown back to the CPU before ``on_fit_end``) and a user's re-cast;
and the batches a callback draws itself are converted as Lightning converts training batches.

On a CPU the device move is the meta device (what a move keeps: the Parameter objects); the GPU
lane (tests/gpu) runs the real moves."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lalr_lightning.callbacks import AutoRGN, HTSRPruning, NTKDiagnostics, NTKSelect, ProximalRegularizer
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.placement import follow, placed
from tests._toys import ToyMLP, make_trainer


def test_placed_moves_only_what_differs():
    p = torch.zeros(3, dtype=torch.float64)
    same = torch.ones(3, dtype=torch.float64)
    assert placed(same, p) is same
    moved = placed(torch.ones(3), p)
    assert moved.dtype == torch.float64 and torch.equal(moved, torch.ones(3, dtype=torch.float64))
    mask = torch.ones(3, dtype=torch.bool)
    assert placed(mask, p, dtype=False) is mask  # a mask stays bool
    offloaded = placed(torch.ones(3), p.to("meta"), device=False)
    assert offloaded.device.type == "cpu" and offloaded.dtype == torch.float64
    kept = {"a": torch.ones(2), "b": torch.ones(2), "gone": torch.ones(2)}
    params = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)}
    b = kept["b"]
    follow(kept, params)
    assert kept["a"].dtype == torch.float64 and kept["b"] is b and kept["gone"].dtype == torch.float32


def test_masks_follow_their_parameter_to_another_device():
    """HTSRPruning crashed at the end of every GPU fit: Lightning had moved the weights back to
    the CPU (teardown) while LayerControl's masks stayed on the GPU. On a CPU-only machine the
    mirror state is made: the weight on the meta device (standing in for the accelerator), its
    mask still on the CPU where it was made. The GPU lane runs the real move."""
    lin = nn.Linear(4, 3, device="meta")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    ctl = LayerControl.of(opt)
    keep = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) > 0.5
    ctl.set_masks("pruning", {lin.weight: keep})
    assert ctl.mask(lin.weight).device.type == "meta"  # placed when set
    ctl._masks["pruning"][id(lin.weight)] = keep  # where it was made, before the weight moved
    ctl.apply_masks()
    assert ctl.mask(lin.weight).device.type == "meta"
    ctl._masks["pruning"][id(lin.weight)] = keep
    lin.weight.grad = torch.ones(3, 4, device="meta")
    ctl.mask_gradients()
    assert ctl.mask(lin.weight).device.type == "meta"


class _Recast(Callback):
    """Re-casts the module to float64 after every callback made its state (at fit start)."""

    def on_train_start(self, trainer, pl_module):
        pl_module.double()


class _Float64Ready(ToyMLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x.to(self.dtype)), y)

    def forward(self, x):
        return self.net(x.to(self.dtype))


def test_a_fit_whose_module_is_recast_after_the_decisions_uses_state_in_the_new_dtype():
    """Pruning masks (fit start), the proximal anchor and the NTK anchor (snapshots at fit start)
    are used after the module turned float64: the run finishes, the anchors are float64 and equal
    the float32 snapshot, the pruned weights stay zero, and the proximal pull is computed in
    float64 (the distance to theta_0 matches one computed by hand)."""
    module = _Float64Ready(n=32, batch_size=8, seed=3)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    pruning = HTSRPruning(metric="alpha", target_sparsity=0.5, when="fit_start", min_evals=1, min_numel=1,
                          plot_every_n_epochs=None)
    proximal = ProximalRegularizer(lam=0.5, selective=False, every_n_epochs=None)
    ntk = NTKDiagnostics(probe_size=4, every_n_epochs=1)
    make_trainer([pruning, _Recast(), proximal, ntk], max_epochs=1).fit(module)
    params = dict(module.named_parameters())
    assert all(p.dtype == torch.float64 for p in params.values())
    for n, a in proximal._anchor.items():
        assert a.dtype == torch.float64 and a.device == params[n].device, n
        # masked entries of theta_0 are the snapshot's: the snapshot was taken after pruning
        assert torch.equal(a, a.float().double()), n  # float32 values, held in float64
    for n, a in ntk._anchor.items():
        assert a.dtype == torch.float64, n
    by_hand = {n: float((params[n].detach() - proximal._anchor[n]).norm()) for n in proximal._anchor}
    for layer, members in proximal._groups.items():
        expected = sum(by_hand[n] ** 2 for n in members) ** 0.5
        assert abs(proximal.distances[layer] - expected) <= 1e-9 * max(1.0, expected), layer
    for name, keep in pruning.masks.items():
        w = params[name].detach()
        assert torch.all(w[~keep] == 0), name
    assert any(not torch.equal(start[n].double(), params[n].detach()) for n in start)


@pytest.mark.parametrize("make", [
    lambda: AutoRGN(n_batches=1),
    lambda: NTKDiagnostics(probe_size=4),
    lambda: NTKSelect(probe_size=4, max_layers=2),
    lambda: ProximalRegularizer(lam=0.5, probe_size=4),
    lambda: HTSRPruning(criterion="wanda", target_sparsity=0.5, n_calibration=8, layer_types=("linear",), head=True,
                        min_evals=1, min_numel=1),
], ids=["autorgn", "ntk", "ntkselect", "proximal", "wanda"])
def test_callbacks_drawing_their_own_batches_convert_them_as_lightning_does_under_bf16_true(make):
    """Lightning converts each training batch to the precision's input dtype before
    training_step; a callback that draws batches from the loader itself (probes, Auto-RGN's
    batches, calibration) must too, or a bfloat16 conv refuses the float32 input."""
    from lalr_lightning.data.digits import DigitsDataModule
    from lalr_lightning.models.cnn import SmallCNN

    torch.manual_seed(0)
    module = SmallCNN(num_classes=10, width=4)
    cb = make()
    trainer = make_trainer([cb], max_steps=2, limit_val_batches=0, precision="bf16-true")
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=16))
    assert trainer.global_step == 2 and cb.history
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p.float()).all() for p in module.parameters())
