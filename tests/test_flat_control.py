"""LayerControl of an optimizer that steps flat partitions (DeepSpeed ZeRO's layout), on one
process with the layout built by hand: rank 1 of 2 holds the second half of one group's
parameters laid end to end (the parameters are views into the flat bit16 buffer, as in ZeRO-1/2).
The engine itself runs in tests/test_hf_engines.py; these pin the translation's arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.flat import FlatControl, FlatView, attach_flat_view


def _zero2(rank: int = 1, world: int = 2):
    torch.manual_seed(0)
    shapes = [(4, 3), (6,), (2, 5)]  # 12 + 6 + 10 = 28 elements: 14 per rank
    flat16 = torch.randn(28)
    params, off = [], 0
    for shape in shapes:
        n = int(torch.tensor(shape).prod())
        p = nn.Parameter(flat16[off:off + n].view(shape))
        p.data = flat16[off:off + n].view(shape)  # a view into the flat buffer, as the engine makes them
        params.append(p)
        off += n
    size = 28 // world
    fp32 = nn.Parameter(flat16[rank * size:(rank + 1) * size].clone())
    zero = SimpleNamespace(bit16_groups=[params], bit16_groups_flat=[flat16], single_partition_of_fp32_groups=[fp32])
    opt = torch.optim.AdamW([fp32], lr=0.1, weight_decay=0.0)
    attach_flat_view(opt, FlatView.of_zero(zero, rank))
    return params, fp32, opt, zero


def _step(fp32, opt, grad):
    fp32.grad = grad.clone()
    opt.step()


def test_the_view_finds_which_range_of_the_partition_holds_each_parameter():
    params, fp32, opt, zero = _zero2()
    view = FlatView.of_zero(zero, 1)
    got = [([id(p) for p in params].index(id(pc.param)), pc.start, pc.stop, pc.src) for pc in view.pieces]
    # rank 1 holds elements 14..27: the last 4 of the bias (12..17 -> src 2..5), all of the last matrix
    assert got == [(1, 0, 4, 2), (2, 4, 14, 0)]
    assert isinstance(LayerControl.of(opt), FlatControl)


def test_a_multiplier_stretches_its_elements_of_the_partition_and_frozen_ones_stay():
    params, fp32, opt, _ = _zero2()
    grad = torch.randn(14)
    plain_fp32 = fp32.detach().clone().requires_grad_()
    plain = torch.optim.AdamW([plain_fp32], lr=0.1, weight_decay=0.0)
    plain_fp32.grad = grad.clone()
    plain.step()
    ctl = LayerControl.of(opt)
    ctl.set_multipliers("a", {params[2]: 3.0})
    ctl.set_frozen("b", [params[1]])
    before = fp32.detach().clone()
    _step(fp32, opt, grad)
    plain_delta = plain_fp32.detach() - before
    torch.testing.assert_close(fp32.detach()[4:] - before[4:], 3.0 * plain_delta[4:], rtol=1e-5, atol=1e-7)
    assert torch.equal(fp32.detach()[:4], before[:4])


def test_a_wholly_frozen_partition_gets_no_step_and_its_state_is_released():
    params, fp32, opt, _ = _zero2()
    ctl = LayerControl.of(opt)
    _step(fp32, opt, torch.randn(14))
    assert opt.state[fp32]
    ctl.set_frozen("sel", params)
    freed = ctl.release_state(params)
    assert freed == 2 * 14 + 1 and fp32 not in opt.state
    before = fp32.detach().clone()
    _step(fp32, opt, torch.randn(14))
    assert torch.equal(fp32.detach(), before) and fp32 not in opt.state


def test_a_mask_zeroes_its_elements_in_the_partition_the_weight_and_the_moments_and_keeps_them_zero():
    params, fp32, opt, _ = _zero2()
    ctl = LayerControl.of(opt)
    _step(fp32, opt, torch.randn(14))
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 1] = keep[1, 4] = False
    ctl.set_masks("prune", {params[2]: keep})
    flat_idx = [4 + 1, 4 + 9]  # the matrix starts at 4 in rank 1's partition
    assert not params[2].detach()[~keep].any() and not fp32.detach()[flat_idx].any()
    assert not opt.state[fp32]["exp_avg"][flat_idx].any()
    for _ in range(2):
        _step(fp32, opt, torch.randn(14))
        assert not fp32.detach()[flat_idx].any() and fp32.detach()[4:].count_nonzero() == 8


def test_weights_written_into_the_model_reach_this_ranks_fp32_partition_and_the_next_step_starts_there():
    # SparseGPT's update of the kept weights: written into the model's (bit16) weights, which the
    # engine overwrites from its fp32 partition after every step
    params, fp32, opt, _ = _zero2()
    ctl = LayerControl.of(opt)
    other = fp32.detach()[:4].clone()  # the bias' elements on this rank (2..5): not written
    new = torch.randn(2, 5)
    with torch.no_grad():
        params[2].copy_(new)
    ctl.weights_written([params[2]])
    assert torch.equal(fp32.detach()[4:], new.reshape(-1)) and torch.equal(fp32.detach()[:4], other)
    grad = torch.randn(14)
    _step(fp32, opt, grad)
    # AdamW's first step moves each element by the learning rate, from the written values
    torch.testing.assert_close(fp32.detach()[4:], new.reshape(-1) - 0.1 * grad[4:].sign(), rtol=0, atol=1e-6)


def test_a_mask_of_the_wrong_shape_is_one_line_naming_the_parameter():
    params, _, opt, _ = _zero2()
    with pytest.raises(ValueError, match="'w' has shape"):
        LayerControl.of(opt).set_masks("prune", {params[2]: torch.ones(5, 2, dtype=torch.bool)}, {params[2]: "w"})


def test_a_multiplier_under_an_optimizer_not_linear_in_the_lr_is_refused_in_one_line():
    params, fp32, _, zero = _zero2()
    opt = torch.optim.Adagrad([fp32], lr=0.1, lr_decay=0.0)
    opt.__class__ = type("MyAdagrad", (torch.optim.Adagrad,), {})  # not one LINEAR_IN_LR names
    attach_flat_view(opt, FlatView.of_zero(zero, 1))
    LayerControl.of(opt).set_multipliers("a", {params[2]: 2.0})
    fp32.grad = torch.randn(14)
    with pytest.raises(RuntimeError, match="optim='adamw_torch'"):
        opt.step()


@pytest.mark.parametrize(("flags", "phrase"), [(dict(is_fsdp_enabled=True), "DeepSpeed ZeRO-2"),
                                               (dict(is_deepspeed_enabled=True, stage=0), "stage 1, 2 or 3")])
def test_the_trainers_fsdp_and_zero_stage_0_are_refused_in_one_line(flags, phrase):
    pytest.importorskip("transformers")
    from lalr_lightning.callbacks import SpectrumSelect
    from lalr_lightning.hf import _refuse_engine

    plugin = SimpleNamespace(zero_stage=flags.pop("stage", 2))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)), **flags)
    with pytest.raises(RuntimeError) as err:
        _refuse_engine(trainer, SpectrumSelect())
    assert phrase in str(err.value) and "\n" not in str(err.value)
