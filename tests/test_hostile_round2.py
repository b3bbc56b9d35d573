"""Issue 34, the second hostile round: one test per row of its table (the rows of helper 34a),
each written to fail on the code before the fix. Every bad input ends in one line that names the
cause and the fix, or works."""

from __future__ import annotations

import re
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lalr_lightning import DivergenceError
from lalr_lightning.callbacks import (
    AutoRGN,
    BlockSchedule,
    HTSRPruning,
    LALRScheduleCallback,
    LayerLRMultiplier,
    ProximalRegularizer,
    SpectrumSelect,
    SurgicalBlocks,
    TempBalanceCallback,
)
from tests._toys import ToyMLP, make_data, make_trainer

# ----------------------------------------------------------------------------- gradual pruning, NaN


class _NaNLossFrom(ToyMLP):
    """The loss is NaN from optimizer step ``start`` on (so are the gradients, then the weights)."""

    def __init__(self, start: int = 3, **kw):
        super().__init__(**kw)
        self.start = start

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step >= self.start else loss


def test_gradual_pruning_with_the_loss_nan_from_step_3_raises_divergence_error():
    pruner = HTSRPruning(when="gradual", gradual_epochs=3, min_numel=16, min_evals=3, target_sparsity=0.5)
    module = _NaNLossFrom(start=3)
    with pytest.raises(DivergenceError, match=r"HTSRPruning: the weights of .*NaN or Inf at epoch 1, step 8"):
        make_trainer([pruner], max_epochs=3, limit_val_batches=0).fit(module)
    assert [h["epoch"] for h in pruner.history] == [0]  # the event of epoch 0 only: no masks from NaN weights


def test_gradual_pruning_still_prunes_every_epoch_when_nothing_diverges():
    pruner = HTSRPruning(when="gradual", gradual_epochs=3, min_numel=16, min_evals=3, target_sparsity=0.5)
    make_trainer([pruner], max_epochs=3, limit_val_batches=0).fit(_NaNLossFrom(start=10**9))
    assert [h["epoch"] for h in pruner.history] == [0, 1, 2]
    assert pruner.overall_sparsity() == pytest.approx(0.5, abs=0.02)


# ----------------------------------------------------------------------------- LazyLinear


class _Lazy(pl.LightningModule):
    """An MLP whose second layer is an ``nn.LazyLinear`` (its shape comes at the first forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.LazyLinear(64), nn.ReLU(), nn.Linear(64, 64),
                                 nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(make_data(32, 16), batch_size=8)


LAZY = {
    "SpectrumSelect": lambda: SpectrumSelect(top_percent=50),
    "LISA": lambda: BlockSchedule("lisa", gamma=1, every_n_steps=2),
    "HTSRPruning": lambda: HTSRPruning(min_numel=16, min_evals=3),
    "ProximalRegularizer": lambda: ProximalRegularizer(lam=0.5),
    "AutoRGN": lambda: AutoRGN(n_batches=1),
    "LALR": lambda: LALRScheduleCallback(),
    "LayerLRMultiplier": lambda: LayerLRMultiplier({"net.2": 0.5}),
}


@pytest.mark.parametrize("label", list(LAZY))
def test_a_model_with_lazylinear_gets_one_line_naming_the_callback_the_layer_and_the_fix(label):
    cb = LAZY[label]()
    with pytest.raises(ValueError) as info:
        make_trainer([cb], max_steps=2).fit(_Lazy())
    msg = str(info.value)
    assert "\n" not in msg and "Attempted to use an uninitialized" not in msg
    assert msg.startswith(type(cb).__name__ + ": ") and "net.2.weight (LazyLinear)" in msg
    assert "forward pass" in msg and "nn.Linear(" in msg


@pytest.mark.parametrize("label", list(LAZY))
def test_a_lazy_model_works_once_a_forward_pass_has_shaped_it(label):
    module = _Lazy()
    module(torch.zeros(1, 16))  # the fix the message names
    make_trainer([LAZY[label]()], max_steps=2).fit(module)


def test_callbacks_that_never_read_the_lazy_weights_still_work_with_them():
    """TempBalance leaves the first matrix out and SurgicalBlocks trains blocks by name: both ran on
    a lazy first layer before, and still do; freezing it (requires_grad_) cannot, and says so."""
    for cb in (TempBalanceCallback(min_evals=2), SurgicalBlocks(select="first")):
        module = _Lazy()
        module.net[0], module.net[2] = nn.LazyLinear(64), nn.Linear(64, 64)
        make_trainer([cb], max_steps=2).fit(module)
        assert not isinstance(module.net[0].weight, nn.parameter.UninitializedParameter)
    module = _Lazy()
    module.net[0], module.net[2] = nn.LazyLinear(64), nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"^SurgicalBlocks: net.0.weight \(LazyLinear\).* not initialized yet"):
        make_trainer([SurgicalBlocks(select="last")], max_steps=2).fit(module)


# ----------------------------------------------------------------------------- min_evals < 2


@pytest.mark.parametrize("make", [lambda: HTSRPruning(min_evals=1), lambda: HTSRPruning(min_evals=0),
                                  lambda: HTSRPruning(preset="alphapruning", min_evals=1),
                                  lambda: TempBalanceCallback(min_evals=1)])
def test_min_evals_below_two_is_refused_at_construction_with_the_reason(make):
    with pytest.raises(ValueError, match=r"min_evals must be .*>= 2.*(two|power-law fit)"):
        make()


def test_min_evals_one_stays_allowed_where_no_fit_is_made():
    # N:M and uniform pruning compute no metric; a norm needs no fit: one eigenvalue is enough there
    assert HTSRPruning(n=2, m=4, min_numel=1, min_evals=1).min_evals == 1
    assert HTSRPruning(epsilon=0.0, min_evals=1).min_evals == 1
    assert HTSRPruning(metric="norm", min_evals=1).min_evals == 1


# ----------------------------------------------------------------------------- argument types


def test_argument_types_are_checked_at_construction_naming_the_argument():
    with pytest.raises(TypeError, match=r"^TempBalanceCallback: every_n_steps must be an integer or None, got 'five'"):
        TempBalanceCallback(every_n_steps="five")
    with pytest.raises(TypeError, match=r"^TempBalanceCallback: every_n_epochs must be an integer, got 1.5"):
        TempBalanceCallback(every_n_epochs=1.5)
    with pytest.raises(TypeError, match=r"^LayerLRMultiplier: patterns maps names to numbers; "
                                        r"patterns\['net.0'\] is 'half'"):
        LayerLRMultiplier({"net.0": "half"})
    with pytest.raises(TypeError, match=r"^HTSRPruning: target_sparsity must be a number or None"):
        HTSRPruning(target_sparsity=[0.5])
    with pytest.raises(TypeError, match=r"^ProximalRegularizer: lam must be a number, got None"):
        ProximalRegularizer(lam=None)


def test_numbers_given_as_text_are_read_as_a_command_line_gives_them():
    # the convention of check_figures: a command line gives numbers as text
    assert TempBalanceCallback(every_n_steps="5").every_n_steps == 5
    assert LayerLRMultiplier({"net.0": "0.5"}).patterns == {"net.0": 0.5}
    assert HTSRPruning(target_sparsity="0.3").target_sparsity == 0.3


def test_coerce_reads_numbers_as_their_annotation_says():
    from collections.abc import Mapping

    from lalr_lightning.core.runtime.checks import coerce

    assert coerce("C", "k", "1e8", int) == 10**8 and coerce("C", "k", 2.0, int) == 2
    assert coerce("C", "k", None, int | None) is None and coerce("C", "k", "0.25", float | None) == 0.25
    assert coerce("C", "k", {"a": "2"}, Mapping[str, float] | None) == {"a": 2.0}
    assert coerce("C", "k", "anything", str) == "anything"  # other annotations pass through
    for value, hint in ((True, int), (1.5, int), ("1.5", int), ("x", float), (None, float), ([1], float | None)):
        with pytest.raises(TypeError, match=r"^C: k must be"):
            coerce("C", "k", value, hint)


def test_a_string_step_count_trains_as_the_number():
    tb = TempBalanceCallback(every_n_steps="2", min_evals=2)
    make_trainer([tb], max_steps=4).fit(ToyMLP())
    assert [h["step"] for h in tb.history] == [0, 2]


# ----------------------------------------------------------------------------- when= beyond max_epochs


def test_pruning_at_an_epoch_the_fit_never_reaches_is_refused_at_setup():
    with pytest.raises(ValueError, match=r"^HTSRPruning\(when=50\) prunes at the start of epoch 50, but the fit "
                                         r"runs epochs 0 to 1 \(max_epochs=2\), so it would never prune"):
        make_trainer([HTSRPruning(when=50, min_numel=16, min_evals=3)], max_epochs=2).fit(ToyMLP())
    with pytest.raises(ValueError, match=r"gradual_epochs=5\) .* max_epochs=2, so it would stop short"):
        make_trainer([HTSRPruning(when="gradual", gradual_epochs=5, min_numel=16, min_evals=3)],
                     max_epochs=2).fit(ToyMLP())
    pruner = HTSRPruning(when=1, min_numel=16, min_evals=3)  # the last epoch is fine
    make_trainer([pruner], max_epochs=2).fit(ToyMLP())
    assert [h["epoch"] for h in pruner.history] == [1]


# ----------------------------------------------------------------------------- report and analyze


def _csv_run(tmp_path, data: bytes):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.csv").write_bytes(data)
    return folder


_GOOD = (b"epoch,step,train_loss,tempbalance/multiplier/net.2\n"
         b"0,0,1.25,0.75\n0,1,1.125,\n")


def test_report_on_a_metrics_csv_with_non_utf8_bytes_is_one_line(tmp_path, capsys):
    from lalr_lightning.report import report_main

    folder = _csv_run(tmp_path, _GOOD.replace(b"1.125", b"1.1\xff5"))
    assert report_main([str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert re.fullmatch(r".*report: error: .*metrics\.csv is not UTF-8 text \(byte 0xff at offset \d+\).*", err)
    assert not (folder / "report.html").exists()


@pytest.mark.parametrize("data, what", [(b"epoch,step,train_loss\n", "holds a header and no row"),
                                        (b"", "is empty"), (b"epoch,st", "holds a header and no row")],
                         ids=["header_only", "empty", "cut_in_header"])
def test_report_on_a_metrics_csv_without_rows_fails_saying_what_is_missing(tmp_path, capsys, data, what):
    from lalr_lightning.report import report_main

    folder = _csv_run(tmp_path, data)
    assert report_main([str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"metrics.csv {what}: the run logged nothing (yet)" in err
    assert not (folder / "report.html").exists()  # no page with a title only


def test_report_on_a_truncated_metrics_csv_leaves_the_cut_row_out_and_says_so(tmp_path, capsys):
    from lalr_lightning.report import read_run, report_main

    folder = _csv_run(tmp_path, _GOOD + b"0,2,1.0")  # the run stopped while writing "1.0625,0.8125"
    assert report_main([str(folder)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "last row is cut short (3 of 4 fields, no line end): left out" in err
    run = read_run(folder)
    assert run.scalars["train_loss"] == [(0, 1.25), (1, 1.125)]  # not the cut 1.0 of step 2
    assert "tempbalance" in (folder / "report.html").read_text()


def test_report_on_a_run_without_callback_metrics_says_so(tmp_path, capsys):
    from lalr_lightning.report import report_main

    folder = _csv_run(tmp_path, b"epoch,step,train_loss\n0,0,1.5\n")
    assert report_main([str(folder)]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "holds no per-layer metrics of lalr_lightning callbacks" in err


def test_analyze_a_model_directory_whose_config_is_not_json_is_one_line(tmp_path, capsys):
    from lalr_lightning.cli import analyze_main

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{not json")
    assert analyze_main([str(tmp_path / "model"), "--out", str(tmp_path / "rep"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "config.json: not a readable Hugging Face config" in err


def test_analyze_with_out_an_existing_file_is_one_line(tmp_path, capsys):
    from lalr_lightning.cli import analyze_main

    ckpt = tmp_path / "m.ckpt"
    torch.save({"state_dict": nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).state_dict()}, ckpt)
    (tmp_path / "taken").write_text("mine")
    assert analyze_main([str(ckpt), "--out", str(tmp_path / "taken"), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--out " in err and "is an existing file" in err
    assert (tmp_path / "taken").read_text() == "mine"


# ----------------------------------------------------------------------------- two instances of one callback


class _LRs(pl.Callback):
    """The effective learning rate of each controlled layer at the last training batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lalr_lightning.core.runtime.control import LayerControl

        self.lrs = LayerControl.of(trainer.optimizers[0]).effective_lrs()


def test_two_layer_lr_multipliers_with_different_patterns_coexist_and_multiply():
    a, b = LayerLRMultiplier({"net.2": 0.5}), LayerLRMultiplier({"net.2": 4.0, "net.4": 2.0})
    assert a.state_key != b.state_key
    assert a.state_key == "LayerLRMultiplier{'patterns': {'net.2': 0.5}}"
    lrs = _LRs()
    make_trainer([a, b, lrs], max_steps=2).fit(ToyMLP(lr=0.05))
    assert lrs.lrs["net.2"] == pytest.approx(0.05 * 0.5 * 4.0) and lrs.lrs["net.4"] == pytest.approx(0.1)
    assert "net.0" not in lrs.lrs  # no multiplier: the scheduled rate


def test_a_default_instance_keeps_its_key_and_settings_that_only_log_do_not_count():
    assert TempBalanceCallback().state_key == "TempBalanceCallback"
    assert HTSRPruning(figures="every", make_permanent=True).state_key == "HTSRPruning"  # logged / volatile only
    assert TempBalanceCallback(name="a").state_key == "TempBalanceCallback[a]"
    assert TempBalanceCallback(assign="sqrt").state_key == "TempBalanceCallback{'assign': 'sqrt'}"
    with pytest.raises(Exception, match="more than one stateful callback"):  # the same settings twice: name them
        make_trainer([LayerLRMultiplier({"net.2": 0.5}), LayerLRMultiplier({"net.2": 0.5})])


def _tb_fit(tmp_path, callbacks, max_epochs, ckpt=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ck = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer(callbacks + [ck], max_epochs=max_epochs, enable_checkpointing=True, limit_val_batches=0,
                 default_root_dir=tmp_path).fit(ToyMLP(), ckpt_path=ckpt)
    return tmp_path / "last.ckpt"


def test_two_unnamed_instances_resume_each_their_own_state(tmp_path):
    a, b = TempBalanceCallback(min_evals=2), TempBalanceCallback(assign="sqrt", min_evals=2)
    ckpt = _tb_fit(tmp_path / "a", [a, b], 2)
    assert a.history != b.history
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    assert {a.state_key, b.state_key} <= set(saved)
    a2, b2 = TempBalanceCallback(min_evals=2), TempBalanceCallback(assign="sqrt", min_evals=2)
    _tb_fit(tmp_path / "b", [b2, a2], 3, ckpt=str(ckpt))  # listed the other way round: keys, not order
    assert a2.history[:2] == a.history and b2.history[:2] == b.history and len(a2.history) == 3


def test_a_checkpoint_written_under_the_bare_type_name_still_resumes(tmp_path):
    """Before, an unnamed instance saved under ``TempBalanceCallback`` whatever its settings: such a
    checkpoint resumes into the instance (and its settings are still checked)."""
    a = TempBalanceCallback(assign="sqrt", min_evals=2)
    ckpt = _tb_fit(tmp_path / "a", [a], 2)
    old = torch.load(ckpt, weights_only=False)
    old["callbacks"] = {("TempBalanceCallback" if k == a.state_key else k): v for k, v in old["callbacks"].items()}
    torch.save(old, tmp_path / "old.ckpt")
    a2 = TempBalanceCallback(assign="sqrt", min_evals=2)
    _tb_fit(tmp_path / "b", [a2], 3, ckpt=str(tmp_path / "old.ckpt"))
    assert a2.history[:2] == a.history and len(a2.history) == 3
    from lalr_lightning.callbacks import SettingsMismatchError

    with pytest.raises(SettingsMismatchError, match="written with assign='sqrt'"):
        _tb_fit(tmp_path / "c", [TempBalanceCallback(assign="linear_map", min_evals=2)], 3,
                ckpt=str(tmp_path / "old.ckpt"))
    # strict_resume=False: the new settings continue from the checkpoint's state, as before
    a3 = TempBalanceCallback(assign="linear_map", min_evals=2, strict_resume=False)
    _tb_fit(tmp_path / "d", [a3], 3, ckpt=str(ckpt))
    assert a3.history[:2] == a.history


# ----------------------------------------------------------------------------- pruning resumed without its callback


def _pruned_checkpoint(tmp_path, module) -> str:
    from lightning.pytorch.callbacks import ModelCheckpoint

    pruner = HTSRPruning(min_numel=16, min_evals=3)
    make_trainer([pruner, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1, enable_checkpointing=True,
                 limit_val_batches=0).fit(module)
    assert pruner.masks
    return str(tmp_path / "last.ckpt")


def _orphan_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "HTSRPruning masks" in str(w.message)]


def test_a_pruning_checkpoint_resumed_without_htsrpruning_warns_that_masks_are_no_longer_enforced(tmp_path):
    ckpt = _pruned_checkpoint(tmp_path, ToyMLP())
    with pytest.warns(UserWarning) as record:  # another callback of the package sees the checkpoint
        make_trainer([LayerLRMultiplier({"net.2": 0.5})], max_epochs=2, limit_val_batches=0).fit(ToyMLP(),
                                                                                                 ckpt_path=ckpt)
    (msg,) = _orphan_warnings(record)
    assert "\n" not in msg and "HTSRPruning{'min_numel': 16, 'min_evals': 3} (3 masked parameters)" in msg
    assert "no longer enforced" in msg and "add the HTSRPruning callback" in msg
    with warnings.catch_warnings(record=True) as kept:  # with the callback: enforced, no warning
        warnings.simplefilter("always")
        pruner = HTSRPruning(min_numel=16, min_evals=3)
        make_trainer([pruner], max_epochs=2, limit_val_batches=0).fit(ToyMLP(), ckpt_path=ckpt)
    assert not _orphan_warnings(kept) and pruner.masks


def test_a_pruning_checkpoint_resumed_into_a_package_model_without_callbacks_warns(tmp_path):
    from lalr_lightning.models import SmallCNN

    def module():
        torch.manual_seed(0)
        return SmallCNN(width=8, in_channels=1, num_classes=4)

    data = DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 1, 8, 8), torch.randint(0, 4, (16,))),
                      batch_size=8)
    from lightning.pytorch.callbacks import ModelCheckpoint

    pruner = HTSRPruning(min_numel=16, min_evals=3)
    make_trainer([pruner, ModelCheckpoint(dirpath=tmp_path, save_last=True)], max_epochs=1,
                 enable_checkpointing=True).fit(module(), data)
    with pytest.warns(UserWarning) as record:
        make_trainer([], max_epochs=2).fit(module(), data, ckpt_path=str(tmp_path / "last.ckpt"))
    assert len(_orphan_warnings(record)) == 1


# ----------------------------------------------------------------------------- tied weights in a selection


class _Tied(ToyMLP):
    """Five Linear layers; the third and the fourth hold one weight tensor (``net.6`` uses ``net.4``'s)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64),
                                 nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.net[6].weight = self.net[4].weight


class _Moves(pl.Callback):
    """Per step: the blocks selected and whether each of net.4 / net.6's parameters moved."""

    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        self._selected = list(trainer.callbacks[0].selected)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        moved = {n: not torch.equal(p.detach(), self._before[n]) for n, p in pl_module.named_parameters()}
        self.rows.append((self._selected, moved))


def test_tied_weights_with_lisa_are_one_unit_so_the_freeze_is_real():
    lisa = BlockSchedule("lisa", gamma=1, every_n_steps=1, seed=0)
    moves = _Moves()
    make_trainer([lisa, moves], max_steps=8).fit(_Tied())
    assert [b.name for b in lisa.layers if b.role == "block"] == ["net.2", "net.4+net.6"]
    seen = set()
    for selected, moved in moves.rows:
        on = "net.4+net.6" in selected
        seen.add(on)
        # the shared weight and both layers' biases move exactly when their unit trains
        assert moved["net.4.weight"] == moved["net.4.bias"] == moved["net.6.bias"] == on, (selected, moved)
        assert moved["net.2.weight"] == ("net.2" in selected)
    assert seen == {True, False}  # both draws happened


def test_tied_units_join_in_every_block_selection():
    from lalr_lightning.core.model.blocks import block_layers
    from lalr_lightning.core.model.tied import join_tied

    model = _Tied()
    units, notes = join_tied(model, block_layers(model))
    assert [u.name for u in units] == ["net.0+net.2", "net.4+net.6", "net.8"]
    assert set(units[1].params) == {"net.4.weight", "net.4.bias", "net.6.bias"}
    assert notes == ["net.4 and net.6 share net.4.weight: one unit 'net.4+net.6', trained or frozen together"]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_trainer([SurgicalBlocks(select="net.4+net.6")], max_steps=2).fit(model)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])}
    assert moved == {"net.4.weight", "net.4.bias", "net.6.bias"}
    untied = ToyMLP()
    assert [u.name for u in join_tied(untied, block_layers(untied))[0]] == [u.name for u in block_layers(untied)]
    assert join_tied(untied, block_layers(untied))[1] == []


# ----------------------------------------------------------------------------- attention's own matrices


class _Encoder(pl.LightningModule):
    """A user's own transformer: a Linear input layer, two ``nn.TransformerEncoderLayer`` and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(8, 64)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0), 2,
                                         enable_nested_tensor=False)
        self.fc = nn.Linear(64, 4)

    def forward(self, x):
        return self.fc(self.enc(self.emb(x)).mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 6, 8, generator=g),
                                                         torch.randint(0, 4, (32,), generator=g)), batch_size=8)


IN_PROJ = "enc.layers.0.self_attn.in_proj"


def test_multihead_attention_in_proj_weight_is_a_matrix_layer():
    from lalr_lightning.core.model.layers import matrix_layers

    model = _Encoder()
    layers = {la.name: la for la in matrix_layers(model)}
    la = layers[IN_PROJ]
    assert la.kind == "linear" and tuple(la.weight.shape) == (192, 64)
    assert set(la.params) == {f"{IN_PROJ}_weight", f"{IN_PROJ}_bias"}
    assert la.weight is model.enc.layers[0].self_attn.in_proj_weight
    order = [n for n in layers if n.startswith("enc.layers.0.")]
    assert order == [IN_PROJ, "enc.layers.0.self_attn.out_proj", "enc.layers.0.linear1", "enc.layers.0.linear2"]
    # separate q/k/v projections (kdim, vdim != embed_dim): three layers
    sep = {la.name: tuple(la.weight.shape) for la in matrix_layers(nn.MultiheadAttention(32, 2, kdim=16, vdim=8))}
    assert sep == {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 8), "out_proj": (32, 32)}


def test_pruning_spectrum_and_tempbalance_treat_the_attention_projections():
    pruner = HTSRPruning(min_numel=16, min_evals=3, target_sparsity=0.5)
    module = _Encoder()
    make_trainer([pruner], max_steps=3).fit(module)
    assert pruner.sparsity[IN_PROJ] > 0.2  # it was 0.0: never pruned
    keep = pruner.masks[f"{IN_PROJ}_weight"]
    assert torch.all(module.enc.layers[0].self_attn.in_proj_weight.detach()[~keep] == 0)  # enforced after steps

    spectrum = SpectrumSelect(top_percent=50)
    make_trainer([spectrum], max_steps=1).fit(_Encoder())
    assert IN_PROJ in spectrum.scores  # ranked by its SNR with the other in_proj

    tb = TempBalanceCallback(min_evals=2)
    make_trainer([tb], max_steps=1).fit(_Encoder())
    assert IN_PROJ in tb.multipliers


def test_data_criteria_leave_attention_projections_dense_saying_why():
    pruner = HTSRPruning(criterion="wanda", n_calibration=8, min_evals=3, min_numel=16, target_sparsity=0.5)
    with pytest.warns(UserWarning, match=r"leaves these layers dense: .*self_attn\.in_proj \(a projection inside "
                                         r"nn\.MultiheadAttention, whose inputs criterion='wanda' cannot read"):
        make_trainer([pruner], max_steps=1).fit(_Encoder())
    assert IN_PROJ in pruner.excluded and "enc.layers.0.self_attn.out_proj" in pruner.excluded
    assert pruner.sparsity["enc.layers.0.linear1"] > 0.2


def test_proximal_regularizer_runs_through_pytorch_transformer_layers():
    # its probe takes a jvp in eval mode, where the layers' fused path has no forward-mode derivative
    prox = ProximalRegularizer(lam=0.5, probe_size=4)
    make_trainer([prox], max_steps=2).fit(_Encoder())
    assert IN_PROJ in prox.distances


class _OwnMatrix(ToyMLP):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        h = self.net[:4](x)
        return self.net[4:](h @ self.mix)


def test_a_matrix_no_layer_covers_is_warned_once_with_its_share():
    from lalr_lightning.core.model import layers as L

    L._WARNED.clear()
    with pytest.warns(UserWarning) as record:
        tb = TempBalanceCallback(min_evals=2)
        make_trainer([tb, LayerLRMultiplier({"net.2": 0.5})], max_steps=2).fit(_OwnMatrix())
    msgs = [str(w.message) for w in record if "in no layer the callbacks treat" in str(w.message)]
    total = sum(p.numel() for p in _OwnMatrix().parameters())
    assert msgs == [f"1 weight matrices of _OwnMatrix are in no layer the callbacks treat (not a Linear, Conv1d/2d, "
                    f"Embedding, HF Conv1D or attention projection): mix (64x64), {64 * 64 / total:.1%} of its "
                    "parameters; they keep the scheduled learning rate and are never measured or pruned. Wrap them "
                    "in nn.Linear to include them"]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        L.matrix_layers(ToyMLP())  # nothing left out: no warning
        L.matrix_layers(_Encoder())
    assert not [w for w in again if "in no layer" in str(w.message)]


def test_argument_checks_name_the_argument_and_what_it_takes():
    import math

    from lalr_lightning.core.runtime.checks import check_counts, check_loss_fn, check_number

    check_counts({"a": 1, "b": None}, optional=("b",))
    for bad in (0, True, 1.5, None, "2"):
        with pytest.raises(ValueError, match=rf"^a must be an integer >= 1, got {re.escape(repr(bad))}$"):
            check_counts({"a": bad})
    assert check_number("s", 0, low=0) == 0.0 and check_number("k", 2, low=1, strict=True) == 2.0
    for value, strict in ((-1e-9, False), (0.0, True), (math.inf, False), (math.nan, False)):
        with pytest.raises(ValueError, match=r"^s must be a finite number >=? 0 \(why\), got "):
            check_number("s", value, low=0, strict=strict, note=" (why)")
    assert check_loss_fn(None) is None and check_loss_fn(len) is len
    with pytest.raises(TypeError, match="loss_fn must be a callable .* got str"):
        check_loss_fn("mse")
