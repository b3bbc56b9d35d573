"""HTSRPruning(criterion="wanda" | "sparsegpt", n=, m=): the callback's masks and weights equal the
core criteria (core/llm_pruning) run by hand, block by block with full-model forwards, on the same
calibration sequences; achieved sparsity, N:M structure, block order, fine-tuning, resume, DDP,
models without transformer blocks, and bad input."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lalr_lightning.callbacks import HTSRPruning
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.pruning.by_criterion import criterion_prune, take_samples
from lalr_lightning.core.pruning.criteria import InputStats, prune_weight
from tests._dist import ddp_spawn
from tests._lm import tiny_lm
from tests._toys import ToyMLP, make_trainer

pytest.importorskip("transformers")

N_CAL = 6  # calibration sequences: one batch of 4 and two rows of the next


class LM(pl.LightningModule):
    """A tiny causal LM trained with SGD on 8 fixed random sequences, batches of 4 (module level:
    ddp_spawn pickles it)."""

    def __init__(self, family="llama", tied=False, lr=0.0, layers=2, hidden=32):
        super().__init__()
        self.model = tiny_lm(family, tied, layers=layers, hidden=hidden)
        self.lr = lr

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        ids = torch.randint(4, 60, (8, 8), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


def _block_path(hf):
    if hasattr(hf, "transformer"):
        return "transformer.h"
    return "model.decoder.layers" if hasattr(hf.model, "decoder") else "model.layers"


def _blocks(hf):
    path = _block_path(hf).split(".")
    out = hf
    for part in path:
        out = getattr(out, part)
    return out


def _linears(block):
    """(name, module, its weight as (out, in)): GPT-2's Conv1D stores (in, out)."""
    return [(name, mod, mod.weight if isinstance(mod, nn.Linear) else mod.weight.T)
            for name, mod in block.named_modules() if isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"]


@torch.no_grad()
def _block_stats(hf, block, batches, hessian):
    """InputStats of every Linear of ``block`` from full-model forwards (the blocks before it as
    the model now holds them), batch by batch as the callback's calibration batches."""
    stats = {name: InputStats(w.shape[1], hessian=hessian) for name, _, w in _linears(block)}
    handles = [mod.register_forward_pre_hook(lambda _m, a, s=stats[name]: s.add(a[0], samples=len(ids)))
               for name, mod, _ in _linears(block)]
    hf.eval()
    for (ids,) in batches:  # the hooks read ``ids``: a batch's sequences are its samples, whatever a layer sees
        hf(input_ids=ids)
    for h in handles:
        h.remove()
    return stats


@torch.no_grad()
def hand_prune(hf, ratios, criterion, batches, n=0, m=0, prefix="model."):
    """The reference procedure: for each block in order, calibrate it by full forwards of the model
    whose earlier blocks are already pruned, then prune all its Linears (core/llm_pruning)."""
    keeps = {}
    for b, block in enumerate(_blocks(hf)):
        stats = _block_stats(hf, block, batches, criterion == "sparsegpt")
        for name, mod, w in _linears(block):
            full = f"{prefix}{_block_path(hf)}.{b}.{name}"
            new, keep = prune_weight(w, criterion, ratios.get(full, 0.0), stats[name], n=n, m=m)
            w.copy_(new)
            keeps[full + ".weight"] = keep if w is mod.weight else keep.T
    return keeps


def _calibration(module):
    return take_samples(module.train_dataloader(), N_CAL)


def _fit(pruner, module, **kw):
    make_trainer([pruner], max_steps=kw.pop("max_steps", 1), **kw).fit(module)
    return pruner


def _params(module):
    return dict(module.named_parameters())


CASES = [("llama", False, "wanda", 0, 0), ("llama", False, "sparsegpt", 0, 0), ("llama", False, "wanda", 2, 4),
         ("llama", False, "sparsegpt", 2, 4), ("llama", True, "wanda", 0, 0), ("llama", True, "sparsegpt", 0, 0),
         ("opt", True, "wanda", 0, 0), ("opt", True, "sparsegpt", 4, 8), ("gpt2", True, "sparsegpt", 0, 0)]


@pytest.mark.parametrize("family, tied, criterion, n, m", CASES)
def test_callback_equals_the_criterion_run_by_hand_block_by_block(family, tied, criterion, n, m):
    nm = dict(n=n, m=m, min_numel=1, min_evals=1) if m else dict(preset="alphapruning", target_sparsity=0.6)
    pruner = HTSRPruning(criterion=criterion, n_calibration=N_CAL, **nm)
    module = LM(family, tied)
    _fit(pruner, module)  # lr 0: the weights stay as pruning left them
    assert pruner.history[0]["calibration_samples"] == N_CAL
    ref = LM(family, tied)
    keeps = hand_prune(ref.model, pruner.ratios, criterion, _calibration(ref), n, m)
    assert set(pruner.masks) == set(keeps) and len(keeps) == 2 * {"opt": 6, "llama": 7, "gpt2": 4}[family]
    got = _params(module)
    for name, keep in keeps.items():
        assert torch.equal(pruner.masks[name], keep), name
        # Wanda zeroes; SparseGPT also moves the kept weights: the model holds exactly the hand result
        torch.testing.assert_close(got[name], _params(ref)[name], rtol=1e-5, atol=1e-6)
        assert torch.all(got[name][~keep] == 0)
    # the tied embedding / output matrix is left dense
    assert not any("embed" in k or "lm_head" in k for k in pruner.masks)


def test_block_two_is_calibrated_on_the_pruned_block_one():
    pruner = HTSRPruning(preset="alphapruning", target_sparsity=0.7, criterion="wanda", n_calibration=N_CAL)
    _fit(pruner, LM())
    dense = LM()
    hf, batches = dense.model, _calibration(dense)
    # block 1's statistics from the *dense* block 0 give other masks than the callback's ...
    stats = _block_stats(hf, _blocks(hf)[1], batches, False)
    wrong = {f"model.model.layers.1.{name}.weight":
             prune_weight(w, "wanda", pruner.ratios[f"model.model.layers.1.{name}"], stats[name])[1]
             for name, _, w in _linears(_blocks(hf)[1])}
    assert any(not torch.equal(pruner.masks[k], v) for k, v in wrong.items())
    # ... and from the pruned block 0 the same masks
    keeps = hand_prune(LM().model, pruner.ratios, "wanda", batches)
    assert all(torch.equal(pruner.masks[k], keeps[k]) for k in wrong)


@pytest.mark.parametrize("criterion", ["wanda", "sparsegpt"])
def test_achieved_sparsity_per_layer_and_overall(criterion):
    target = 0.6
    pruner = _fit(HTSRPruning(preset="alphapruning", target_sparsity=target, criterion=criterion,
                              n_calibration=N_CAL), module := LM())
    params = _params(module)
    numel = {k: params[k + ".weight"].numel() for k in pruner.ratios}
    for name, ratio in pruner.ratios.items():
        rows, cols = params[name + ".weight"].shape
        # Wanda: int(ratio * columns) in every row (the reference's per-output group); SparseGPT:
        # int(ratio * numel) over the layer
        expected = rows * int(ratio * cols) if criterion == "wanda" else int(ratio * rows * cols)
        assert int((params[name + ".weight"] == 0).sum()) == expected, name
        assert abs(pruner.sparsity[name] - ratio) <= 1 / cols
    overall = sum(pruner.sparsity[k] * numel[k] for k in numel) / sum(numel.values())
    assert pruner.overall_sparsity() == pytest.approx(overall)
    assert abs(overall - target) <= max(1 / params[k + ".weight"].shape[1] for k in numel)
    assert len(set(round(r, 6) for r in pruner.ratios.values())) > 1  # HT-SR ratios, not uniform


@pytest.mark.parametrize("criterion", ["magnitude", "wanda", "sparsegpt"])
def test_n_m_structure_is_exact_and_survives_fine_tuning(criterion):
    kw = {} if criterion == "magnitude" else dict(n_calibration=N_CAL)
    pruner = HTSRPruning(criterion=criterion, n=2, m=4, min_numel=1, min_evals=3, **kw)
    assert (pruner.target_sparsity, pruner.epsilon) == (0.5, 0.0)
    module = LM(lr=0.05)
    before = {k: v.detach().clone() for k, v in _params(module).items()}
    _fit(pruner, module, max_steps=4)
    assert set(pruner.ratios.values()) == {0.5}
    for name, keep in pruner.masks.items():
        w = _params(module)[name]
        groups = (w == 0).reshape(w.shape[0], -1, 4).sum(-1)
        assert torch.all(groups == 2), name  # every group of 4 consecutive inputs of a row: exactly 2 zeros
        assert torch.equal(w != 0, keep)
        assert not torch.equal(w[keep], before[name][keep])  # the kept weights trained


def test_masks_survive_fine_tuning_and_resume_without_recalibration(tmp_path):
    pruner = HTSRPruning(preset="alphapruning", target_sparsity=0.6, criterion="sparsegpt", n_calibration=N_CAL)
    module = LM(lr=0.05)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([pruner, ckpt], max_steps=3, enable_checkpointing=True).fit(module)
    for name, keep in pruner.masks.items():
        assert torch.all(_params(module)[name][~keep] == 0)

    class NoCalibration:
        def __iter__(self):
            raise AssertionError("a resumed run must not calibrate again")

    resumed = HTSRPruning(preset="alphapruning", target_sparsity=0.6, criterion="sparsegpt", n_calibration=N_CAL,
                          calibration=NoCalibration())
    module2 = LM(lr=0.05)
    start = {}

    class Grab(Callback):
        def on_train_start(self, trainer, pl_module):
            start.update({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    make_trainer([resumed, Grab()], max_steps=6).fit(module2, ckpt_path=str(tmp_path / "last.ckpt"))
    assert len(resumed.history) == 1 and resumed.ratios == pruner.ratios
    for name, keep in pruner.masks.items():
        assert torch.equal(resumed.masks[name], keep)
        w = _params(module2)[name]
        assert torch.all(w[~keep] == 0)
        assert not torch.equal(w, start[name])  # training went on


def test_model_without_transformer_blocks_is_calibrated_through_its_forward():
    pruner = _fit(HTSRPruning(target_sparsity=0.5, criterion="wanda", n_calibration=24, min_numel=1, min_evals=2,
                              epsilon=0.2), ToyMLP(lr=0.0))
    ref = ToyMLP(lr=0.0)
    layers = [la for la in matrix_layers(ref) if la.name != "net.6"]  # the head stays dense
    x = torch.cat([b[0] for b in take_samples(ref.train_dataloader(), 24)])
    stats = {la.name: InputStats(la.weight.shape[1]) for la in layers}
    handles = [la.module.register_forward_pre_hook(lambda _m, a, s=stats[la.name]: s.add(a[0])) for la in layers]
    with torch.no_grad():
        ref(x[:8]), ref(x[8:16]), ref(x[16:])  # one pass over the dense model, as the callback's batches
    for h in handles:
        h.remove()
    for la in layers:
        _, keep = prune_weight(la.weight, "wanda", pruner.ratios[la.name], stats[la.name])
        assert torch.equal(pruner.masks[la.name + ".weight"], keep), la.name


def test_a_given_calibration_loader_is_used():
    ids = torch.randint(4, 60, (5, 8), generator=torch.Generator().manual_seed(3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)
    pruner = _fit(HTSRPruning(target_sparsity=0.5, criterion="wanda", calibration=loader, min_numel=1,
                              min_evals=3, epsilon=0.0), LM())
    assert pruner.history[0]["calibration_samples"] == 5  # fewer than n_calibration=128: all of them
    keeps = hand_prune(LM().model, pruner.ratios, "wanda", list(loader))
    assert all(torch.equal(pruner.masks[k], v) for k, v in keeps.items())


# ----------------------------------------------------------------------------- DDP


class PerturbPrunedOnRank1(Callback):
    """After DDP synced the weights, move rank 1's decoder matrices: a rank-local decision would
    then give other masks (and SparseGPT other weights)."""

    def on_fit_start(self, trainer, pl_module):
        if trainer.global_rank == 1:
            with torch.no_grad():
                for name, p in pl_module.named_parameters():
                    if ".layers." in name and p.ndim == 2:
                        p.add_(torch.randn_like(p))


class CheckRanksEqual(Callback):
    def __init__(self, pruner):
        self.pruner = pruner

    def on_train_end(self, trainer, pl_module):
        params = dict(pl_module.named_parameters())
        zeros, sums = [], []
        for name, keep in sorted(self.pruner.masks.items()):
            idx = torch.arange(keep.numel(), dtype=torch.float64)[~keep.flatten()]
            zeros.append(float((idx + 1).sqrt().sum()))
            assert torch.all(params[name][~keep] == 0)
            sums.append(float(params[name].double().abs().sum()))
        gathered = trainer.strategy.all_gather(torch.tensor([zeros, sums], dtype=torch.float64))
        trainer.callback_metrics["masks_equal"] = torch.tensor(float(torch.equal(gathered[0][0], gathered[1][0])))
        trainer.callback_metrics["weights_equal"] = torch.tensor(float(torch.equal(gathered[0][1], gathered[1][1])))


def test_ddp_spawn_ranks_hold_identical_masks_and_sparsegpt_weights():
    pruner = HTSRPruning(preset="alphapruning", target_sparsity=0.6, criterion="sparsegpt", n_calibration=N_CAL)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PerturbPrunedOnRank1(), pruner, CheckRanksEqual(pruner)])
    trainer.fit(LM(lr=0.05))
    assert float(trainer.callback_metrics["masks_equal"]) == 1.0
    # SparseGPT's updated weights came from rank zero and DDP kept them in step
    assert float(trainer.callback_metrics["weights_equal"]) == 1.0
    assert pruner.masks and pruner.history[0]["calibration_samples"] == N_CAL


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(criterion="obs"), "valid: magnitude, wanda, sparsegpt"),
        (dict(criterion="wanda", n=2, m=2), "0 < n < m"),
        (dict(criterion="wanda", n=3, m=0), "0 < n < m"),
        (dict(n=2, m=4, target_sparsity=0.7), "drop target_sparsity"),
        (dict(n=2, m=4, epsilon=0.3), "drop epsilon"),
        (dict(preset="alphapruning", criterion="wanda", n=2, m=4), "drop preset"),
        (dict(criterion="wanda", structured=True), "drop structured"),
        (dict(n=2, m=4, structured=True), "drop structured"),
        (dict(criterion="sparsegpt", when="gradual", gradual_epochs=3), "prunes once"),
        (dict(criterion="magnitude", n_calibration=8), "does not use n_calibration"),
        (dict(criterion="wanda", percdamp=0.1), "does not use percdamp"),
        (dict(criterion="wanda", n_calibration=0), "n_calibration must be >= 1"),
        (dict(criterion="sparsegpt", n=2, m=4, blocksize=10), "multiple of m"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HTSRPruning(**kwargs)


def test_n_m_prunes_every_layer_at_n_over_m():
    pruner = HTSRPruning(criterion="wanda", n=1, m=4)
    assert (pruner.target_sparsity, pruner.epsilon) == (0.25, 0.0)
    assert HTSRPruning(n=2, m=4, target_sparsity=0.5, epsilon=0).target_sparsity == 0.5  # consistent: accepted


def test_convolutions_are_refused_by_the_row_wise_criteria():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))
    layers = matrix_layers(net)
    with pytest.raises(ValueError, match=r"not Linear: 0 \(conv2d\).*layer_types=\('linear',\)"):
        criterion_prune(net, layers, {la.name: 0.5 for la in layers}, "wanda", [torch.randn(2, 3, 6, 6)],
                        forward=net)


def test_layers_outside_the_blocks_and_unrunnable_batches_are_clear_errors():
    with pytest.raises(ValueError, match="outside them: model.lm_head"):
        _fit(HTSRPruning(criterion="wanda", head=True, min_numel=1, min_evals=3, n_calibration=4), LM())
    bad = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 3)), batch_size=2)
    with pytest.raises(ValueError, match="could not run ToyMLP on a calibration batch"):
        _fit(HTSRPruning(criterion="wanda", calibration=bad, min_numel=1, min_evals=2), ToyMLP())


def test_take_samples_cuts_the_last_batch_of_any_batch_shape():
    ids = torch.arange(30).reshape(10, 3)
    dicts = [{"input_ids": ids[i:i + 4], "attention_mask": torch.ones(len(ids[i:i + 4]), 3)} for i in (0, 4, 8)]
    got = take_samples(dicts, 6)
    assert [len(b["input_ids"]) for b in got] == [4, 2] and torch.equal(got[1]["attention_mask"], torch.ones(2, 3))
    assert torch.equal(torch.cat([b["input_ids"] for b in got]), ids[:6])
    tuples = take_samples([(ids[:4], ids[:4]), (ids[4:8], ids[4:8])], 5)
    assert isinstance(tuples[1], tuple) and [len(t[0]) for t in tuples] == [4, 1]
    assert [len(t) for t in take_samples([ids[:4], ids[4:]], 100)] == [4, 6]  # all there is


def test_pruning_at_a_later_epoch_calibrates_the_trained_weights():
    pruner = HTSRPruning(target_sparsity=0.5, epsilon=0.0, criterion="wanda", when=1, n_calibration=N_CAL,
                         min_numel=1, min_evals=3)
    module = LM(lr=0.05)
    make_trainer([pruner], max_epochs=2).fit(module)
    assert [h["epoch"] for h in pruner.history] == [1] and pruner.history[0]["calibration_samples"] == N_CAL
    for name, keep in pruner.masks.items():
        w = _params(module)[name]
        assert torch.all(w[~keep] == 0) and int((~keep).sum()) == w.shape[0] * int(0.5 * w.shape[1])


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_low_precision_weights_are_calibrated_and_pruned(precision):
    """Statistics are float32 whatever the weights; SparseGPT writes back in the weights' dtype."""
    pruner = HTSRPruning(criterion="sparsegpt", n=2, m=4, min_numel=1, min_evals=1, n_calibration=N_CAL)
    module = LM(lr=0.01)
    make_trainer([pruner], max_steps=2, precision=precision).fit(module)
    for name, keep in pruner.masks.items():
        w = _params(module)[name]
        assert w.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
        assert torch.all((w == 0).reshape(w.shape[0], -1, 4).sum(-1) == 2) and torch.equal(w != 0, keep)
