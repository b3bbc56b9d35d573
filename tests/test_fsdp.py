"""Every callback under Lightning's sharded strategies on 2 CPU ranks (gloo): ``FSDPStrategy``
(FSDP1, through ``CPUFSDPStrategy``) with one unit per decoder layer and with the whole model as
one unit, and ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model`` (FSDP2). Each
makes the same decisions and reaches the same weights as the DDP run, on both ranks, and a run
resumed from a checkpoint equals the uninterrupted one.

Spawning is the slow part: one pair of processes runs every fit of every strategy kind (Lightning
joins the process group the pair made), records plain results (numpy, python), and the tests
compare them here.
"""

from __future__ import annotations

import functools
import math
import re
import warnings

import _own_method
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from _dist import ddp, fsdp1, fsdp2, pair_record, run_pair_once
from _lm import tiny_lm
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytestmark = pytest.mark.filterwarnings("ignore")

KINDS = ("fsdp1_wrap", "fsdp1", "fsdp2")


class LM(pl.LightningModule):
    """A tiny causal LM (4 decoder layers; LLaMA with an untied head, or GPT-2 / OPT with tied
    embeddings) trained with SGD + momentum on fixed tokens; under FSDP2 it shards each decoder
    layer and then the whole model in ``configure_model``."""

    def __init__(self, fsdp2: bool = False, lr: float = 0.05, family: str = "llama", tied: bool = False,
                 adamw: bool = False):
        super().__init__()
        self.model = tiny_lm(family, tied, hidden=32, layers=4)
        self.fsdp2, self.lr, self.adamw = fsdp2, lr, adamw

    @property
    def units(self) -> list[nn.Module]:
        """The decoder layers: one FSDP unit each."""
        m = self.model
        if hasattr(m, "transformer"):  # GPT-2
            return list(m.transformer.h)
        if hasattr(m.model, "decoder"):  # OPT
            return list(m.model.decoder.layers)
        return list(m.model.layers)  # LLaMA

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.units:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        if self.adamw:  # state with a step count: made-up state on resume would show
            return torch.optim.AdamW(self.parameters(), lr=self.lr / 10)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        ids = torch.randint(4, 60, (16, 8), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)


class MLP(pl.LightningModule):
    """A plain ``Sequential`` classifier (no transformer naming), sharded per ``Linear`` under
    FSDP2."""

    def __init__(self, fsdp2: bool = False, lr: float = 0.05):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        self.fsdp2, self.lr = fsdp2, lr

    @property
    def units(self) -> list[nn.Module]:
        return [m for m in self.net if isinstance(m, nn.Linear)]

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.units:
                fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 16, generator=g)
        return DataLoader(TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(1)), batch_size=8)


def _cases():
    """name -> (callback factory, model class, epochs of 2 steps): the callbacks as a user adds them."""
    import lalr_lightning.callbacks as C

    prune = dict(target_sparsity=0.5, min_numel=1, min_evals=3)
    return {
        "tempbalance": (lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2), LM, 2),
        "lalr": (lambda: C.LALRScheduleCallback(), LM, 2),
        "spectrum": (lambda: C.SpectrumSelect(top_percent=50), LM, 2),
        "surgical": (lambda: C.SurgicalBlocks(select="block:1"), LM, 2),
        "lisa": (lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1), LM, 2),
        "lift": (lambda: C.BlockSchedule("lift", every_n_steps=1), LM, 2),
        "lisa_adamw": (lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1),
                       functools.partial(LM, adamw=True), 2),
        "magnitude": (lambda: C.HTSRPruning(**prune), LM, 2),
        "wanda": (lambda: C.HTSRPruning(criterion="wanda", n_calibration=8, **prune), LM, 2),
        "sparsegpt": (lambda: C.HTSRPruning(criterion="sparsegpt", n_calibration=8, **prune), LM, 2),
        "proximal": (lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=None), LM, 2),
        "tempbalance_gpt2": (lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2),
                             functools.partial(LM, family="gpt2", tied=True), 2),
        "magnitude_opt": (lambda: C.HTSRPruning(**prune), functools.partial(LM, family="opt", tied=True), 2),
        # pruning during training: masks from each layer's whole weight, each rank enforcing its piece
        "magnitude_epoch": (lambda: C.HTSRPruning(when=1, **prune), LM, 2),
        "magnitude_gradual": (lambda: C.HTSRPruning(when="gradual", gradual_epochs=2, **prune), LM, 2),
        # a criterion during training: the masks from rank zero's whole copy of the model
        "wanda_epoch": (lambda: C.HTSRPruning(criterion="wanda", when=1, n_calibration=8, **prune), LM, 2),
        "sparsegpt_epoch": (lambda: C.HTSRPruning(criterion="sparsegpt", when=1, n_calibration=8, **prune), LM, 2),
        "nm_epoch": (lambda: C.HTSRPruning(when=1, n=2, m=4, **prune), LM, 2),
        "structured_gradual_mlp": (lambda: C.HTSRPruning(when="gradual", gradual_epochs=2, structured=True,
                                                         channel_step=0.1, **prune), MLP, 2),
        "autorgn": (lambda: C.AutoRGN(n_batches=2), LM, 2),
        "eb_mlp": (lambda: C.AutoRGN(criterion="eb", eb_threshold=0.975, exclude=()), MLP, 2),
        "ntkselect_mlp": (lambda: C.NTKSelect(probe_size=8, max_layers=1, kappa_max=1e6), MLP, 2),
        "tempbalance_mlp": (lambda: C.TempBalanceCallback(min_evals=3, first=True, every_n_steps=2), MLP, 2),
        "proximal_mlp": (lambda: C.ProximalRegularizer(lam=0.5, granularity="global", every_n_epochs=None), MLP, 2),
        # the whole model through torch.func: measured on a whole copy on rank zero (two probe
        # samples: the kernel's cost grows with them, what the case compares does not)
        "ntk": (lambda: C.NTKDiagnostics(probe_size=2), LM, 2),
        "ntk_mlp": (lambda: C.NTKDiagnostics(probe_size=8, kernel="full"), MLP, 2),
        "proximal_lambda_o": (lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=1), LM, 2),
        "proximal_lambda_o_mlp": (lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=1, granularity="global"),
                                  MLP, 2),
        # L-MSA's metric (blocks run alone) on the whole copy; the module's optimizer trains the choice
        "lmsa": (lambda: C.LMSAStepper(update="optimizer", every_n_epochs=1), LM, 2),
        "lmsa_mlp": (lambda: C.LMSAStepper(update="optimizer", every_n_epochs=1), MLP, 2),
        # two measurement batches fill the first epoch: its checkpoint holds no optimizer state yet
        "lmsa_mlp_2": (lambda: C.LMSAStepper(update="optimizer", every_n_epochs=2, n_batches=2), MLP, 2),
        # docs/design.md's own method, as written there: nothing in it names a strategy
        "alpha_freeze": (lambda: _own_method.AlphaFreeze(threshold=3.0), LM, 2),
    }


#: the cases also resumed from FSDP2's distributed (sharded) checkpoint: the selections whose
#: optimizer state covers only some parameters when it is saved
DCP_CASES = ("lift", "lisa_adamw", "eb_mlp", "ntk", "lmsa_mlp_2")

#: where resuming cannot work, and why (the README's FSDP table says so too)
NO_RESUME = {(case, kind): "Lightning's FSDPStrategy cannot load a checkpoint whose optimizer holds no state yet "
                           "(its load_checkpoint indexes the first saved state: IndexError, Lightning 2.6.6)"
             for case in ("lmsa_mlp_2",) for kind in ("fsdp1_wrap", "fsdp1")}


def _kinds(case: str) -> tuple[str, ...]:
    return (*KINDS, "fsdp2_dcp") if case in DCP_CASES else KINDS


def _plain(x):
    """Python / numpy only: the records cross the process boundary as files."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


class _Capture(pl.Callback):
    """The whole weights at the end of training (a collective under FSDP; rank 0 gets them)."""

    def on_train_end(self, trainer, pl_module):
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if isinstance(trainer.strategy, ModelParallelStrategy):  # whole, also where it saves sharded checkpoints
            whole = get_model_state_dict(trainer.strategy.model,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            whole = trainer.strategy.lightning_module_state_dict()
        self.weights = {k: v.detach().float().cpu().numpy().copy() for k, v in whole.items()}


def _fit(kind, make_cb, model_cls, epochs, ckpt_in=None, ckpt_dir=None, devices=2):
    model = model_cls(fsdp2=kind.startswith("fsdp2"))
    strategy = {"ddp": lambda: ddp(),
                "fsdp1_wrap": lambda: fsdp1(wrap={type(model.units[0])}),  # a unit per decoder layer / Linear
                "fsdp1": lambda: fsdp1(),
                "fsdp2": lambda: fsdp2(devices, save_distributed_checkpoint=False),
                "fsdp2_dcp": lambda: fsdp2(devices, save_distributed_checkpoint=True)}[kind]()
    cb, cap = make_cb(), _Capture()
    # a checkpoint at every epoch end, as ModelCheckpoint writes them in a user's run
    saves = [ModelCheckpoint(ckpt_dir, "{epoch}", save_top_k=-1, save_on_train_epoch_end=True)] if ckpt_dir else []
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=epochs, logger=False,
                         enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, cap, *saves])
    trainer.fit(model, ckpt_path=ckpt_in)
    decision = {"history": [{k: v for k, v in h.items() if k not in ("epoch", "step")} for h in cb.history],
                "scores": cb.scores, "decision": getattr(cb, cb.traits.decision_attr)}
    for extra in ("masks", "distances", "regularized_fraction", "sparsity"):
        if hasattr(cb, extra):
            decision[extra] = getattr(cb, extra)
    return _plain(decision), getattr(cap, "weights", {})


def _strategy_pair(rank, record, workdir, kinds):
    warnings.filterwarnings("ignore")
    for name, (make, model_cls, epochs) in _cases().items():
        for kind in [k for k in kinds if k == "ddp" or k in _kinds(name)]:
            try:
                ckpts = f"{workdir}/{name}_{kind}"
                record((name, kind), _fit(kind, make, model_cls, epochs, ckpt_dir=ckpts if kind != "ddp" else None))
                if kind != "ddp" and (name, kind) not in NO_RESUME:  # resumed from the end of the first epoch
                    record((name, kind, "resumed"), _fit(kind, make, model_cls, epochs, ckpt_in=f"{ckpts}/epoch=0.ckpt"))
            except Exception as err:  # noqa: BLE001 -- recorded; the test names it
                record((name, kind), f"{type(err).__name__}: {err}")
                raise


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case under DDP and each sharded kind: {rank: {(case, kind[, "resumed"]): (decision, weights)}}."""
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401 -- skip where FSDP is absent

    return run_pair_once("fsdp", tmp_path_factory, _strategy_pair, ("ddp", *KINDS, "fsdp2_dcp"))


def _same(a, b, tol: float, where: str = ""):
    """``a`` equals ``b`` (nested dicts / lists of numbers, strings and arrays), floats within ``tol``."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))[:5]} differ"
        for k in a:
            _same(a[k], b[k], tol, f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        if a.dtype == bool:
            assert np.array_equal(a, b), f"{where}: {int((a != b).sum())} entries differ"
        else:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=where)
    elif isinstance(a, float) and not isinstance(b, str):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=tol, abs=tol), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


CASE_KINDS = [(case, kind) for case in _cases() for kind in _kinds(case)]


@pytest.mark.parametrize("case, kind", CASE_KINDS)
def test_same_decisions_and_weights_as_ddp_on_both_ranks(runs, case, kind):
    ddp_decision, ddp_weights = pair_record(runs, 0, (case, "ddp"))
    decision, weights = pair_record(runs, 0, (case, kind))
    _same(decision, ddp_decision, 1e-4, f"{case} {kind} decision")
    _same(weights, ddp_weights, 1e-4, f"{case} {kind} weights")
    _same(pair_record(runs, 1, (case, kind))[0], decision, 0.0, f"{case} {kind} rank 1")


@pytest.mark.parametrize("case, kind", CASE_KINDS)
def test_resume_equals_the_uninterrupted_run(runs, case, kind):
    if (case, kind) in NO_RESUME:
        pytest.skip(NO_RESUME[case, kind])
    decision, weights = pair_record(runs, 0, (case, kind))
    resumed, resumed_weights = pair_record(runs, 0, (case, kind, "resumed"))
    _same(resumed, decision, 1e-6, f"{case} {kind} resumed decision")
    _same(resumed_weights, weights, 1e-6, f"{case} {kind} resumed weights")


# ---------------------------------------------------------------------- one rank

#: FSDP on one rank, as on one GPU: FSDP1 switches itself to NO_SHARD there (every parameter whole,
#: in its own shape), FSDP2 shards over a mesh of one
ONE_RANK = ("magnitude", "magnitude_epoch", "wanda_epoch", "sparsegpt", "proximal", "proximal_lambda_o", "ntk",
            "lmsa", "lisa", "autorgn", "tempbalance")


def _one_rank(rank, record, workdir):
    warnings.filterwarnings("ignore")
    for name in ONE_RANK:
        make, model_cls, epochs = _cases()[name]
        for kind in ("ddp", "fsdp1_wrap", "fsdp2"):
            try:
                record((name, kind), _fit(kind, make, model_cls, epochs, devices=1))
            except Exception as err:  # noqa: BLE001 -- recorded; the test names it
                record((name, kind), f"{type(err).__name__}: {err}")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_pair_once("fsdp_one_rank", tmp_path_factory, _one_rank, nprocs=1)[0]


@pytest.mark.parametrize("kind", ["fsdp1_wrap", "fsdp2"])
@pytest.mark.parametrize("case", ONE_RANK)
def test_one_rank_fsdp_decides_and_trains_as_ddp_on_one_rank(one_rank, case, kind):
    single, (decision, weights) = pair_record({0: one_rank}, 0, (case, "ddp")), pair_record({0: one_rank}, 0, (case, kind))
    _same(decision, single[0], 1e-4, f"{case} {kind} decision")
    _same(weights, single[1], 1e-4, f"{case} {kind} weights")


def _mixed_precision(rank, record, workdir):
    """AutoRGN's measurement batch under FSDP1 with bf16 mixed precision on a CNN (float inputs)."""
    import lalr_lightning.callbacks as C
    from lalr_lightning.data import DigitsDataModule
    from lalr_lightning.models import SmallCNN

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cb = C.AutoRGN(n_batches=1)
    try:
        pl.Trainer(accelerator="cpu", devices=1, strategy=fsdp1(), precision="bf16-mixed", max_epochs=1,
                   limit_train_batches=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[cb]).fit(SmallCNN(width=4, in_channels=1), DigitsDataModule(batch_size=16))
        record("autorgn", _plain(cb.multipliers))
    except Exception as err:  # noqa: BLE001 -- recorded; the test names it
        record("autorgn", f"{type(err).__name__}: {err}")


def test_autorgn_measures_float_batches_under_fsdp_mixed_precision(tmp_path_factory):
    # the batch goes through FSDP's root forward, which casts it to the bf16 parameters (it failed:
    # "Input type (torch.FloatTensor) and weight type (CPUBFloat16Type) should be the same")
    got = run_pair_once("fsdp_mixed", tmp_path_factory, _mixed_precision, nprocs=1)[0].get("autorgn")
    assert isinstance(got, dict), got
    assert got and all(math.isfinite(v) for v in got.values())


# ---------------------------------------------------------------------- what cannot work: one line each


def _setup_under(strategy, cb, model):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    cb.setup(trainer, model, "fit")


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2"])
def test_lmsa_hamiltonian_update_under_fsdp_says_why_in_one_line(kind):
    import lalr_lightning.callbacks as C

    strategy = fsdp1() if kind == "fsdp1" else fsdp2()
    with pytest.raises(RuntimeError) as err:
        _setup_under(strategy, C.LMSAStepper(), MLP())
    assert "pass update='optimizer'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kw, words", [(dict(use_orig_params=False), "drop use_orig_params=False"),
                                       (dict(sharding_strategy="HYBRID_SHARD", auto_wrap_policy={nn.Linear}),
                                        "sharding_strategy='FULL_SHARD'")])
def test_fsdp1_settings_the_callbacks_cannot_follow_are_refused(kw, words):
    import lalr_lightning.callbacks as C

    with pytest.raises(RuntimeError, match=re.escape(words)):
        _setup_under(fsdp1(**kw), C.TempBalanceCallback(), MLP())


def test_cpu_fsdp_strategy_is_lightnings_fsdp_strategy():
    from lightning.pytorch.strategies import FSDPStrategy

    from lalr_lightning.strategies import CPUFSDPStrategy

    s = CPUFSDPStrategy(auto_wrap_policy={nn.Linear})
    assert isinstance(s, FSDPStrategy) and s.process_group_backend == "gloo" and s.kwargs["use_orig_params"]
