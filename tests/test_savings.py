"""Training less costs less: the selection callbacks leave frozen matrices without a gradient and
without optimizer state, on one device and under DDP, and give the same updates as the plain
algorithms they implement (written here as torch loops: the oracles)."""

from __future__ import annotations

import time
import traceback
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lalr_lightning.callbacks import BlockSchedule, LayerSelection, NTKSelect, SpectrumSelect
from lalr_lightning.core.model.blocks import block_layers
from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.selection.surgical import lift_block, lisa_sample
from tests._dist import ddp, ddp_spawn, pair_record, run_pair_once
from tests._lm import tiny_lm
from tests._toys import ToyMLP, make_trainer

pytest.importorskip("transformers")

MLP_BLOCKS = ["net.0", "net.2", "net.4", "net.6"]


class LM(pl.LightningModule):
    """A tiny LLaMA (4 blocks) with AdamW; module level, so ddp_spawn can pickle it."""

    def __init__(self, seed: int = 0, lr: float = 1e-2, samples: int = 16, batch_size: int = 4):
        super().__init__()
        self.model = tiny_lm("llama", False, seed=seed, hidden=32, layers=4)
        self.lr, self.samples, self.batch_size = lr, samples, batch_size

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self):
        ids = torch.randint(4, 60, (self.samples, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)


class MLP(pl.LightningModule):
    """A plain ``nn.Sequential`` MLP (blocks named by the test) with AdamW."""

    def __init__(self, samples: int = 16, batch_size: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                                 nn.ReLU(), nn.Linear(16, 4))
        self.samples, self.batch_size = samples, batch_size

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(self.samples, 8, generator=g), torch.randint(0, 4, (self.samples,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)


def _schedule(kind: str, **kw) -> BlockSchedule:
    if kind == "llama":
        return BlockSchedule("lisa", gamma=1, every_n_steps=2, seed=17, **kw)
    return BlockSchedule("lift", every_n_steps=2, blocks=MLP_BLOCKS, **kw)


def _chosen(kind: str, module: nn.Module, switch: int) -> set[str]:
    """The blocks LISA (tiny LLaMA) or LIFT (MLP) trains during ``switch``, from the pure rules."""
    if kind == "llama":
        blocks = block_layers(module, join_stem=False)
        middle = [b.name for b in blocks if b.role == "block"]
        return {b.name for b in blocks if b.role != "block"} | {middle[i] for i in lisa_sample(4, 1, switch, 17)}
    return {MLP_BLOCKS[lift_block("front_to_end", switch, 4)]}


def _units(kind: str, module: nn.Module):
    return block_layers(module, join_stem=False) if kind == "llama" else block_layers(module, MLP_BLOCKS)


def _oracle(kind: str, steps: int, accumulate: int, release: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The schedule as a plain loop: requires_grad follows the selection, one AdamW over all
    parameters; ``release``: the state of the blocks that do not train is deleted at each
    switch, else kept (LMFlow's LISA callback)."""
    module = LM() if kind == "llama" else MLP()
    opt = module.configure_optimizers()
    batches = list(module.train_dataloader())
    units = _units(kind, module)
    i = 0
    for step in range(steps):
        on = _chosen(kind, module, step // 2)
        for u in units:
            for p in u.params.values():
                p.requires_grad_(u.name in on)
                if release and u.name not in on:
                    opt.state.pop(p, None)
        for _ in range(accumulate):
            (module.training_step(batches[i % len(batches)], 0) / accumulate).backward()
            i += 1
        opt.step()
        opt.zero_grad(set_to_none=True)
    return module, opt


class StateCheck(Callback):
    """After every step: the optimizer holds state exactly for the parameters that trained in it
    (``release``), and those are the selected blocks' plus what is outside every block."""

    def __init__(self, cb: LayerSelection):
        self.cb, self.visited, self.entries, self.step = cb, set(), [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:  # accumulating: no step yet
            return
        self.step = trainer.global_step
        opt = trainer.optimizers[0]
        on = {id(p) for u in self.cb.layers if u.name in self.cb.selected for p in u.params.values()}
        outside = {id(p) for p in pl_module.parameters()} - {id(p) for u in self.cb.layers for p in u.params.values()}
        held = {id(p) for p in opt.state}
        self.visited |= set(self.cb.selected)
        self.entries.append(sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step"))
        if getattr(self.cb, "optimizer_state", "release") == "release":
            assert held == on | outside, (len(held), len(on | outside))


@pytest.mark.parametrize("kind", ["llama", "mlp"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("state", ["release", "keep"])
def test_switching_equals_the_plain_loop_bit_for_bit(kind, accumulate, state):
    """LISA on a tiny LLaMA, LIFT on a plain Sequential MLP, with and without gradient
    accumulation: weights and AdamW state equal the plain loop's, bit for bit. ``keep`` is
    today's (and LMFlow's) algorithm; ``release`` frees what stops training."""
    steps = 8
    module = LM() if kind == "llama" else MLP()
    cb = _schedule(kind, optimizer_state=state)
    check = StateCheck(cb)
    make_trainer([cb, check], max_steps=steps, accumulate_grad_batches=accumulate).fit(module)
    want, want_opt = _oracle(kind, steps, accumulate, release=state == "release")
    for (n, a), b in zip(module.named_parameters(), want.parameters()):
        assert torch.equal(a, b), n
    opt = module.trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    got = {names[id(p)]: s for p, s in opt.state.items()}
    ref = {n: want_opt.state[p] for n, p in want.named_parameters() if p in want_opt.state}
    assert got.keys() == ref.keys()
    for n in got:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[n][k], ref[n][k]), (n, k)
    assert check.visited == {u.name for u in cb.layers}  # every block trained at some point
    if state == "release":  # the state never exceeded what trained at that step
        trained = [sum(p.numel() for u in cb.layers if u.name in _chosen(kind, module, s // 2)
                       for p in u.params.values()) for s in range(steps)]
        assert check.entries == [2 * t for t in trained]
    else:  # today's: it grows with every block visited, up to the whole model
        assert check.entries[-1] == 2 * sum(p.numel() for p in module.parameters())


def test_lisa_state_after_visiting_every_block_is_the_active_blocks_plus_stem_and_head():
    module = LM()
    cb = BlockSchedule("lisa", gamma=2, every_n_steps=1, seed=0)
    check = StateCheck(cb)
    make_trainer([cb, check], max_steps=8).fit(module)
    assert check.visited == set(cb.block_names)
    blocks = {u.name: sum(p.numel() for p in u.params.values()) for u in cb.layers}
    always = sum(n for u, n in blocks.items() if "layers" not in u)
    assert always == 2912 + 2944 and set(blocks.values()) == {2912, 9280, 2944}  # embed | 4 x block | norm + head
    # AdamW: two moments per trained weight; 2 of 4 blocks + stem + head, not the whole model
    assert check.entries == [2 * (always + 2 * 9280)] * 8
    assert check.entries[-1] < 2 * sum(p.numel() for p in module.parameters())  # 2 x 42,976 with "keep"


@pytest.mark.parametrize("state", ["release", "keep"])
def test_resume_mid_interval_equals_the_uninterrupted_run(state, tmp_path):
    """5 steps per epoch, a switch every 3: the checkpoint after epoch 1 falls mid-interval."""
    def make():
        return BlockSchedule("lisa", gamma=1, every_n_steps=3, seed=1, optimizer_state=state)

    full = LM(samples=20)
    make_trainer([make()], max_epochs=3).fit(full)
    first = LM(samples=20)
    t1 = make_trainer([make()], max_epochs=1)
    t1.fit(first)
    t1.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = LM(seed=7, samples=20)  # other weights: the checkpoint restores them
    make_trainer([make()], max_epochs=3).fit(resumed, ckpt_path=str(tmp_path / "mid.ckpt"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    sa, sb = (m.trainer.optimizers[0].state_dict()["state"] for m in (full, resumed))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


class FlagsAtConfigure(pl.LightningModule):
    """ToyMLP-like: records requires_grad when configure_optimizers runs (after setup, at the
    wrap) and optimizes only what requires grad then."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.model = tiny_lm("llama", False, seed=seed, hidden=32, layers=4)
        self.flags: dict[str, bool] = {}

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        self.flags = {n: p.requires_grad for n, p in self.named_parameters()}
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        ids = torch.randint(4, 60, (8, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)


def test_spectrum_decides_before_the_optimizer_and_a_resumed_run_takes_the_checkpoints_choice(tmp_path):
    module = FlagsAtConfigure()
    cb = SpectrumSelect(top_percent=25)
    t1 = make_trainer([cb], max_steps=2)
    t1.fit(module)
    off = {n for n, f in module.flags.items() if not f}
    frozen = {n for u in cb.layers if u.name not in cb.selected for n, p in module.named_parameters()
              if any(p is q for q in u.params.values())}
    assert off == frozen and len(frozen) == 21  # 3 of 4 per type (7 types) frozen before the wrap
    # the optimizer never held them; and requires_grad is given back at teardown
    assert all(p.requires_grad for p in module.parameters())
    t1.save_checkpoint(tmp_path / "s.ckpt")

    other = FlagsAtConfigure(seed=5)  # other weights: setup decides otherwise, the checkpoint's choice wins
    fresh = SpectrumSelect(top_percent=25, save_compute=False)
    fresh.setup(make_trainer([]), other, "fit")
    assert fresh.selected != cb.selected
    resumed_cb, resumed = SpectrumSelect(top_percent=25), FlagsAtConfigure(seed=5)
    make_trainer([resumed_cb], max_steps=4).fit(resumed, ckpt_path=str(tmp_path / "s.ckpt"))
    assert resumed_cb.selected == cb.selected
    assert {n for n, f in resumed.flags.items() if not f} == frozen  # restored before configure_optimizers


def test_ntk_select_decides_in_setup_when_the_loader_exists():
    class Flags(ToyMLP):
        def configure_optimizers(self):
            self.flags = {n: p.requires_grad for n, p in self.named_parameters()}
            return super().configure_optimizers()

    module = Flags()
    sel = NTKSelect(kappa_max=100.0, sigma=0.1, max_layers=2, probe_size=16)
    make_trainer([sel], max_epochs=1).fit(module)
    assert len(sel.selected) == 2 and len(sel.history) == 1
    assert {n.rsplit(".", 1)[0] for n, f in module.flags.items() if f} == set(sel.selected)


def test_ddp_is_configured_for_switching_and_refuses_what_cannot_follow():
    module = LM()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    BlockSchedule("lisa", gamma=1).setup(trainer, module, "fit")
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    BlockSchedule("lisa", gamma=1, save_compute=False).setup(trainer, module, "fit")
    assert "find_unused_parameters" not in trainer.strategy._ddp_kwargs  # DDP's default kept
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(static_graph=True), logger=False)
    with pytest.raises(ValueError, match="static_graph=True forbids; drop static_graph or pass save_compute=False"):
        BlockSchedule("lisa", gamma=1).setup(trainer, module, "fit")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_false", logger=False)
    with pytest.raises(ValueError, match="needs DDP's find_unused_parameters=True; drop find_unused_parameters=False"):
        BlockSchedule("lisa", gamma=1).setup(trainer, module, "fit")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    SpectrumSelect(top_percent=25).setup(trainer, module, "fit")  # static: decided before the wrap, DDP as it was
    assert "find_unused_parameters" not in trainer.strategy._ddp_kwargs
    with pytest.raises(ValueError, match="unknown optimizer_state 'drop'; valid: release, keep"):
        BlockSchedule("lisa", optimizer_state="drop")


# ----------------------------------------------------------------------------- DDP


class NoGradientForFrozen(Callback):
    """On every rank: at ``on_before_optimizer_step`` the frozen units of every selection have no
    gradient and the trained ones have one; the optimizer holds state only for trained
    parameters; after the step both ranks' weights are equal."""

    grads = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        cbs = [c for c in trainer.callbacks if isinstance(c, LayerSelection)]
        off = {id(p) for c in cbs for u in c.layers if u.name not in c.selected for p in u.params.values()}
        with_grad = [p for p in pl_module.parameters() if p.grad is not None]
        assert not any(id(p) in off for p in with_grad)
        assert {id(p) for p in pl_module.parameters()} - off == {id(p) for p in with_grad}
        assert all(id(p) not in off for p in optimizer.state)
        self.grads = sum(p.numel() for p in with_grad)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        both = trainer.strategy.all_gather(flat)
        assert torch.equal(both[0], both[1])
        pl_module.log("grads", float(self.grads), reduce_fx="max")
        pl_module.log("ddp_checked", 1.0, sync_dist=True)


def test_ddp_frozen_matrices_get_no_gradient_and_ranks_stay_equal():
    """One ddp_spawn fit (spawning is the slow part), both kinds composed, with gradient
    accumulation (DDP's no_sync between steps): SpectrumSelect freezes in setup, before DDP
    wraps the model; LISA switches a block every step after it. A parameter either freezes gets
    no gradient (so no all-reduce), the others all get one."""
    spectrum = SpectrumSelect(top_percent=25)
    lisa = BlockSchedule("lisa", gamma=1, every_n_steps=1, seed=21)  # blocks 1, 2, 3 in three steps
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=2, callbacks=[spectrum, lisa, NoGradientForFrozen()])
    trainer.fit(LM())
    assert trainer.callback_metrics["ddp_checked"] == 1.0
    # the gradients of the last step, counted on rank 0, against the two selections handed back
    module = LM()
    blocks = block_layers(module, join_stem=False)
    lisa_off = [u for u in blocks if u.name not in lisa.selected]
    spectrum_off = [la for la in matrix_layers(module) if la.name not in spectrum.selected]
    off = {id(p) for u in lisa_off + spectrum_off for p in u.params.values()}
    want = sum(p.numel() for p in module.parameters() if id(p) not in off)
    assert lisa.selected == ["model.model.embed_tokens", "model.model.layers.3", blocks[-1].name]
    assert trainer.callback_metrics["grads"] == want and 9216 // 4 < want < 42976 // 4


class RestoreAfterFitStart(Callback):
    """Loads a saved state into the callback after its on_fit_start, as Lightning does under
    FSDP (``restore_checkpoint_after_setup``): the model is wrapped by then."""

    def __init__(self, cb, state):
        self.cb, self.state = cb, state

    def on_fit_start(self, trainer, pl_module):
        self.cb.load_state_dict(self.state)


def test_a_checkpoint_restored_after_the_wrap_wins_or_is_refused(monkeypatch):
    first = SpectrumSelect(top_percent=25, save_compute=False)
    make_trainer([first], max_steps=1).fit(FlagsAtConfigure())
    state = first.state_dict()
    # other weights, so setup decides otherwise; without save_compute the checkpoint's choice trains
    module = FlagsAtConfigure(seed=5)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    late = SpectrumSelect(top_percent=25, save_compute=False)
    make_trainer([late, RestoreAfterFitStart(late, state)], max_steps=1).fit(module)
    assert late.selected == first.selected
    moved = {n.rsplit(".", 1)[0] for n, p in module.named_parameters()
             if not torch.equal(p, before[n]) and n.rsplit(".", 1)[0] in late.module_types}
    assert moved == set(first.selected)
    # with save_compute the frozen flags were set before the wrap; where they cannot change after it
    # (FSDP: a multi-process strategy, not DDP), a different choice is refused
    monkeypatch.setattr(SpectrumSelect, "_prepare_toggle", lambda self, trainer: False)
    late = SpectrumSelect(top_percent=25)
    with pytest.raises(RuntimeError, match="restores it after wrapping the model.*resume from the same initial weights"):
        make_trainer([late, RestoreAfterFitStart(late, state)], max_steps=1).fit(FlagsAtConfigure(seed=5))


# ----------------------------------------------------------------------------- DDP: switching blocks averaged by hand

#: bytes DDP's buckets hold with save_compute=True: LISA's stem (embedding) and head (final norm
#: and lm_head) of the tiny LLaMA; for LIFT on the MLP, whose blocks are every parameter, the
#: smallest one stays in DDP (net.6.bias, 4 entries), as DDP refuses a model with nothing to reduce
KEPT_IN_DDP = {"llama": 4 * (2912 + 2944), "mlp": 4 * 4}


class AveragedByHand(Callback):
    """On every rank under DDP: at fit start the ranks' weights are equal (``perturb``: rank 1's
    were changed before the wrap) and DDP's buckets hold ``bucket_bytes``; at every
    ``on_before_optimizer_step`` the frozen units have no gradient (``save_compute``), and every gradient equals
    the mean over ranks of the local gradients, computed here again from the step's
    micro-batches; one averaging by hand per optimizer step; after each step equal weights."""

    def __init__(self, cb: LayerSelection, bucket_bytes: int, perturb: tuple[str, ...] = ()):
        self.cb, self.bucket_bytes, self.perturb, self.batches, self.checked = cb, bucket_bytes, perturb, [], 0

    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:  # before the wrap: DDP broadcasts what it holds, HandSync the rest
            with torch.no_grad():
                for n, p in pl_module.named_parameters():
                    if n.startswith(self.perturb):
                        p.add_(1.0)

    @staticmethod
    def _equal_on_ranks(trainer, pl_module):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        both = trainer.strategy.all_gather(flat)
        assert torch.equal(both[0], both[1])

    def on_fit_start(self, trainer, pl_module):
        self._equal_on_ranks(trainer, pl_module)
        assert trainer.strategy.model._get_ddp_logging_data()["total_parameter_size_bytes"] == self.bucket_bytes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        off = {id(p) for u in self.cb.layers if u.name not in self.cb.selected for p in u.params.values()}
        with_grad = [p for p in pl_module.parameters() if p.grad is not None]
        if self.cb.save_compute:  # without, DDP computes them all, and the frozen ones are dropped at the step
            assert not any(id(p) in off for p in with_grad)
            assert {id(p) for p in pl_module.parameters()} - off == {id(p) for p in with_grad}
        with trainer.precision_plugin.forward_context():  # autocast under bf16-mixed, as the step ran
            loss = sum(pl_module.training_step(b, 0) for b in self.batches) / len(self.batches)
        local = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, with_grad)])
        mean = trainer.strategy.all_gather(local).mean(0)
        got = torch.cat([p.grad.reshape(-1) for p in with_grad])
        assert torch.allclose(got, mean, rtol=1e-5, atol=1e-7), (got - mean).abs().max()
        sync = self.cb._handsync
        assert (sync is None) == (not self.cb.save_compute)
        if sync is not None:
            assert sync.averaged == trainer.global_step + 1  # once per optimizer step, after the last micro-batch
        self.batches = []
        self.checked += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._equal_on_ranks(trainer, pl_module)
        pl_module.log("steps_checked", float(self.checked), reduce_fx="max")


def _ddp_fit(kind: str, save_compute: bool, accumulate: int, steps: int = 6,
             precision: str = "32-true") -> tuple[nn.Module, float]:
    """One fit under DDP inside the pair of processes (:func:`_switching_pair`): the trained
    module and the steps AveragedByHand checked on this rank."""
    module = LM() if kind == "llama" else MLP(samples=32)
    cb = _schedule(kind, save_compute=save_compute)
    full = 4 * sum(p.numel() for p in module.parameters())
    perturb = ("model.model.embed_tokens", "model.model.layers.2") if kind == "llama" else ("net.2",)
    check = AveragedByHand(cb, KEPT_IN_DDP[kind] if save_compute else full, perturb if save_compute else ())
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ddp(), max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, precision=precision, callbacks=[cb, check])
    trainer.fit(module)
    return module, float(trainer.callback_metrics["steps_checked"])


#: (kind, accumulate, precision) of the switching test, each fitted with and without save_compute
SWITCHING = [("llama", 1, "32-true"), ("llama", 2, "32-true"), ("mlp", 2, "32-true"), ("llama", 2, "bf16-mixed")]


def _switching_pair(rank, record, workdir, faildir):
    """Every fit of the switching test in one pair of processes (spawning is the slow part):
    per rank, ``(weights, steps_checked)`` (weights on rank 0 only, as numpy), or the failure's
    text, AveragedByHand's assertions included (:func:`_failed_together` decides what follows)."""
    warnings.filterwarnings("ignore")
    for case in SWITCHING:
        for save_compute in (True, False):
            kind, accumulate, precision = case
            key = (*case, save_compute)
            try:
                module, checked = _ddp_fit(kind, save_compute, accumulate, precision=precision)
                weights = {n: p.detach().cpu().numpy().copy() for n, p in module.named_parameters()} if rank == 0 else {}
                record(key, (weights, checked))
            except Exception as err:  # noqa: BLE001 -- recorded; the test names it, and where it failed
                at = traceback.extract_tb(err.__traceback__)[-1]
                text = f"{type(err).__name__}: {err} (at {Path(at.filename).name}:{at.lineno} in {at.name}: {at.line})"
                record(key, text)
                _failed_together(rank, Path(faildir), key, text)


def _failed_together(rank: int, faildir: Path, key: tuple, text: str, wait_s: float = 30.0) -> None:
    """A fit failed on this rank: the next fit runs only if it failed on the other rank too
    (both have left it, in step). Else the other rank waits in one of its collectives, and this
    one raises, which ends the pair; what failed is written in ``faildir`` for the fixture."""
    line = f"{key} failed on rank {rank}: {text}\n"
    with open(faildir / f"rank{rank}.txt", "a") as f:
        f.write(line)
    peer, deadline = faildir / f"rank{1 - rank}.txt", time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if peer.exists() and f"{key} failed on rank {1 - rank}:" in peer.read_text():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{key} failed on rank {rank} only: {text}")


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    """{rank: {(kind, accumulate, precision, save_compute): (weights, steps_checked) or failure text}}."""
    faildir = tmp_path_factory.mktemp("switching_failures")
    try:
        return run_pair_once("savings_switching", tmp_path_factory, _switching_pair, str(faildir))
    except Exception as err:  # noqa: BLE001 -- a fit failed on one rank only: name it
        said = "".join(sorted(p.read_text() for p in faildir.glob("rank*.txt"))) or "nothing recorded (see the output)"
        pytest.fail(f"the pair of processes stopped ({type(err).__name__}: {err}); {said}")


@pytest.mark.parametrize(("kind", "accumulate", "precision"), SWITCHING)
def test_ddp_switching_blocks_stay_out_of_ddps_buckets_and_train_as_under_ddp(switching, kind, accumulate, precision):
    """LISA (tiny LLaMA) and LIFT (MLP) under DDP, with and without gradient accumulation:
    with save_compute DDP's buckets hold only what always trains, the switching blocks'
    gradients are averaged by hand (AveragedByHand checks them against the ranks' own), ranks
    that start different are made equal, and the weights after 6 steps with switches equal
    those of save_compute=False, where DDP all-reduces everything; under bf16 autocast too.
    The eight fits run in one pair of processes (Lightning's DDP joins its group);
    ddp_spawn with blocks averaged by hand stays covered by
    test_ddp_resume_mid_interval_equals_the_uninterrupted_run."""
    steps = 6
    for save_compute in (True, False):
        for rank in (0, 1):  # AveragedByHand ran on every step on both ranks
            assert pair_record(switching, rank, (kind, accumulate, precision, save_compute))[1] == steps
    new = {n: torch.from_numpy(a) for n, a in pair_record(switching, 0, (kind, accumulate, precision, True))[0].items()}
    old = {n: torch.from_numpy(a) for n, a in pair_record(switching, 0, (kind, accumulate, precision, False))[0].items()}
    start = LM() if kind == "llama" else MLP()
    names = [n for n, _ in start.named_parameters()]
    assert list(new) == names and list(old) == names
    for n in names:
        assert torch.allclose(new[n], old[n], rtol=1e-5, atol=1e-6), n
    name_of = {id(p): n for n, p in start.named_parameters()}
    trained = {name_of[id(p)] for s in range(3) for u in _units(kind, start) if u.name in _chosen(kind, start, s)
               for p in u.params.values()}
    moved = {n for n, c in start.named_parameters() if not torch.equal(new[n], c)}
    assert moved == trained and len(trained) > len(names) // 2  # the switches took effect


def test_ddp_resume_mid_interval_equals_the_uninterrupted_run(tmp_path):
    """LISA with its blocks averaged by hand, under ddp_spawn: 3 steps per epoch (10 samples a
    rank, batches of 4), a switch every 2, so the checkpoint after epoch 1 falls mid-interval;
    the resumed run (other initial weights) ends where the uninterrupted one does."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(module, ckpt_path=None, save=False):
        cbs = [BlockSchedule("lisa", gamma=1, every_n_steps=2, seed=1)]
        if save:
            cbs.append(ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1))
        pl.Trainer(accelerator="cpu", devices=2, strategy=ddp_spawn(), max_epochs=3, logger=False,
                   enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=cbs).fit(module, ckpt_path=ckpt_path)
        return module

    full = fit(LM(samples=20), save=True)
    resumed = fit(LM(seed=7, samples=20), ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), n


def test_hand_sync_leaves_every_alias_of_a_shared_parameter_out_of_ddp_and_gives_the_ignore_list_back(tmp_path):
    """A tied embedding and head (one parameter, two names): DDP itself, wrapping in a 1-rank
    group, registers neither alias; the user's own ignore list is kept and given back."""
    import torch.distributed as dist

    from lalr_lightning.core.runtime.handsync import HandSync

    module = tiny_lm("llama", True, hidden=32, layers=2)
    emb, up = module.model.embed_tokens.weight, module.model.layers[0].mlp.up_proj.weight
    assert module.lm_head.weight is emb
    module._ddp_params_and_buffers_to_ignore = ["model.norm.weight"]
    sync = HandSync(module, [emb, up, emb])
    assert sync.names == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    sync.exclude()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(module)
        held = ddp._get_ddp_logging_data()["total_parameter_size_bytes"]
        norm = module.model.norm.weight
        assert held == 4 * sum(p.numel() for p in module.parameters() if all(p is not q for q in (emb, up, norm)))
    finally:
        dist.destroy_process_group()
    sync.stop()
    assert module._ddp_params_and_buffers_to_ignore == ["model.norm.weight"]
    del module._ddp_params_and_buffers_to_ignore
    sync = HandSync(module, [up])
    sync.exclude()
    sync.stop()
    assert not hasattr(module, "_ddp_params_and_buffers_to_ignore")


def test_hand_sync_buckets_split_by_dtype_and_size():
    from lalr_lightning.core.runtime.handsync import _buckets

    ts = [torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(20), torch.zeros(30), torch.zeros(5)]
    # float32 runs of at most 100 bytes (25 entries), in order; a tensor larger than that alone
    assert _buckets(ts, cap=100) == [[0], [2], [3], [4], [1]]
    assert _buckets(ts, cap=4 * 30) == [[0, 2], [3], [4], [1]]
    assert _buckets(ts) == [[0, 2, 3, 4], [1]]


def test_ddp_options_and_the_parameters_a_switching_selection_keeps_out_of_ddp():
    from lalr_lightning.core.runtime.handsync import HandSync, ddp_for_switching, kept_out

    kwargs = {}
    assert ddp_for_switching(kwargs, "W").startswith("W: DDP set to find_unused_parameters=True")
    assert kwargs == {"find_unused_parameters": True} and ddp_for_switching(kwargs, "W") is None
    with pytest.raises(ValueError, match="W turns requires_grad on and off .* static_graph=True forbids"):
        ddp_for_switching({"static_graph": True}, "W")
    with pytest.raises(ValueError, match="drop find_unused_parameters=False or pass save_compute=False"):
        ddp_for_switching({"find_unused_parameters": False}, "W")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 8), nn.Linear(8, 1))
    a, b, c = (list(m.parameters()) for m in model)
    # a and c always train: b's tensors (and the one shared with a always-trained unit, kept in) go out
    assert kept_out(model, [b, a[:1]], [a, c]) == b
    # everything switches: the smallest trainable tensor stays in, so DDP has something to reduce
    out = kept_out(model, [a, b, c], [])
    assert len(out) == 5 and all(p is not c[1] for p in out)
    for p in model.parameters():
        p.requires_grad_(False)
    assert kept_out(model, [a, b, c], []) == []  # nothing trains: DDP says so at the wrap
    assert HandSync.keep_out(model, [a, b, c], []) is None
    for p in model.parameters():
        p.requires_grad_(True)
    sync = HandSync.keep_out(model, [b, a[:1]], [a, c])  # kept_out's parameters, excluded from DDP at once
    assert sync.params == b and model._ddp_params_and_buffers_to_ignore == ["1.bias", "1.weight"]
    sync.stop()
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
