"""The package's callbacks on Hugging Face's ``transformers.Trainer`` and TRL's ``SFTTrainer``
(``lalr_lightning.hf``): every method runs, decides as under Lightning, logs under the same keys,
resumes exactly, and LISA steps as LMFlow's ``DynamicLayerActivationCallback`` does."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import lalr_lightning.callbacks as C  # noqa: E402
from lalr_lightning.hf import STATE_FILE, trainer_callback  # noqa: E402
from tests._lm import tiny_lm, tiny_tokenizer  # noqa: E402

LAYERS, HIDDEN, SEQ, N = 4, 16, 10, 16


def _model(seed: int = 0):
    return tiny_lm("llama", False, layers=LAYERS, hidden=HIDDEN, seed=seed)


def _ids(n: int = N, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 60, (n, SEQ), generator=g).tolist()


def _rows(n: int = N) -> list[dict]:
    return [{"input_ids": torch.tensor(x), "labels": torch.tensor(x)} for x in _ids(n)]


class _Logs:
    """A TrainerCallback keeping every ``on_log`` (what the report_to integrations receive)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def __init__(self):
                self.rows: list[dict] = []

            def on_log(self, args, state, control, logs=None, **kwargs):
                self.rows.append(dict(logs or {}))

        return Keep()


def _args(tmp_path, steps: int, *, sft: bool = False, **kw):
    from transformers import TrainingArguments

    opts = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, report_to="none",
                use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0, learning_rate=1e-3)
    opts.update(kw)
    if sft:
        from trl import SFTConfig

        return SFTConfig(**opts)
    return TrainingArguments(**opts)


def _trainer(tmp_path, callbacks, *, steps: int = 4, sft: bool = False, model=None, **kw):
    logs = _Logs()
    model = model if model is not None else _model()
    cbs = [*callbacks, logs]
    if sft:
        import datasets
        from trl import SFTTrainer

        ds = datasets.Dataset.from_dict({"input_ids": _ids()})
        t = SFTTrainer(model=model, args=_args(tmp_path, steps, sft=True, **kw), train_dataset=ds,
                       processing_class=tiny_tokenizer(), callbacks=cbs)
    else:
        from transformers import Trainer

        t = Trainer(model=model, args=_args(tmp_path, steps, **kw), train_dataset=_rows(), callbacks=cbs)
    return t, logs


def _torch_opt(trainer):
    opt = trainer.optimizer
    return getattr(opt, "optimizer", opt)


PRUNE = dict(target_sparsity=0.5, min_numel=1, min_evals=3)

#: name -> (factory, what it must have done); the settings of test_fsdp's cases, on a tiny LLaMA
CASES = {
    "tempbalance": lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2),
    "lalr": lambda: C.LALRScheduleCallback(),
    "layer_lr": lambda: C.LayerLRMultiplier({"model.layers.0.*": 0.5, "lm_head": 2.0}),
    "spectrum": lambda: C.SpectrumSelect(top_percent=25),
    "surgical": lambda: C.SurgicalBlocks(select="block:1"),
    "lift": lambda: C.BlockSchedule("lift", every_n_steps=1),
    "lisa": lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1),
    "autorgn": lambda: C.AutoRGN(n_batches=2),
    "ntkselect": lambda: C.NTKSelect(probe_size=4, max_layers=1, kappa_max=1e12),
    "ntk": lambda: C.NTKDiagnostics(probe_size=4),
    "proximal_lambda_o": lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=1),
    "lmsa": lambda: C.LMSAStepper(update="optimizer", every_n_epochs=1),
    "magnitude": lambda: C.HTSRPruning(**PRUNE),
    "wanda": lambda: C.HTSRPruning(criterion="wanda", n_calibration=8, **PRUNE),
    "sparsegpt": lambda: C.HTSRPruning(criterion="sparsegpt", n_calibration=8, **PRUNE),
    "nm": lambda: C.HTSRPruning(n=2, m=4, **PRUNE),
}
#: under SFTTrainer (slower to build): one of each kind of method
SFT_CASES = ["tempbalance", "lalr", "layer_lr", "spectrum", "surgical", "lift", "lisa", "autorgn", "ntkselect", "ntk",
             "proximal_lambda_o", "magnitude", "wanda", "sparsegpt", "nm"]


def _check_run(name, cb, trainer, logs, before):
    assert cb.history, f"{name} made no decision"
    after = dict(trainer.model.named_parameters())
    moved = [n for n, p in after.items() if not torch.equal(p.detach(), before[n])]
    assert moved, f"{name}: nothing trained"
    keys = {k for row in logs.rows for k in row}
    prefix = cb.prefix + "/"
    assert any(k.startswith(prefix) for k in keys), f"{name} logged nothing under {prefix}: {sorted(keys)[:10]}"
    opt = _torch_opt(trainer)
    if isinstance(cb, (C.SpectrumSelect, C.SurgicalBlocks)):
        frozen = [p for u in cb.layers if u.name not in set(cb.selected) for p in u.params.values()]
        assert frozen, f"{name} froze nothing"
        assert all(p not in opt.state for p in frozen), f"{name}: frozen parameters got optimizer state"
        ids = {id(p) for p in frozen}
        assert all(torch.equal(p.detach(), before[n]) for n, p in after.items() if id(p) in ids)
    if isinstance(cb, C.HTSRPruning):
        zero = sum(int((la.weight == 0).sum()) for la in cb.layers)
        assert zero > 0, f"{name} pruned nothing"
        if cb.m:
            w = cb.layers[0].weight.detach().reshape(-1, cb.m)
            assert int((w != 0).sum(1).max()) <= cb.n
    if name == "proximal_lambda_o":
        assert any(k.startswith(prefix + "lambda_o") for k in keys), sorted(k for k in keys if k.startswith(prefix))


@pytest.mark.parametrize("name", list(CASES))
def test_every_method_runs_under_the_trainer(tmp_path, name):
    cb = CASES[name]()
    trainer, logs = _trainer(tmp_path, [trainer_callback(cb)], gradient_accumulation_steps=2, max_grad_norm=1.0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    _check_run(name, cb, trainer, logs, before)


@pytest.mark.parametrize("name", SFT_CASES)
def test_methods_run_under_trl_sft_trainer(tmp_path, name):
    pytest.importorskip("trl")
    cb = CASES[name]()
    # TRL turns gradient checkpointing on by default (torch.func and double backward need it off), and bf16
    # autocast (float32 here, as the Trainer's runs: NTK's torch.func Jacobians are not run under autocast)
    trainer, logs = _trainer(tmp_path, [trainer_callback(cb)], sft=True, activation_checkpointing=False, bf16=False)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    _check_run(name, cb, trainer, logs, before)


@pytest.mark.parametrize("name", ["ntk", "ntkselect", "proximal_lambda_o"])
def test_torch_func_methods_run_under_sft_trainers_bf16_autocast(tmp_path, name):
    """TRL's default bf16: accelerate puts the model's forward under autocast, which torch.func's
    Jacobians cannot run under (a dtype error in the backward); the host measures on the original
    forward, without autocast, and gives the patched forward back for training."""
    pytest.importorskip("trl")
    cb = CASES[name]()
    trainer, logs = _trainer(tmp_path, [trainer_callback(cb)], sft=True, activation_checkpointing=False, bf16=True)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    _check_run(name, cb, trainer, logs, before)
    model = trainer.model
    if "_original_forward" in model.__dict__:  # accelerate's autocast forward is back in place
        assert model.__dict__["forward"] is not model.__dict__["_original_forward"]


def test_lmsa_hamiltonian_update_runs_under_the_trainer(tmp_path):
    cb = C.LMSAStepper(update="msa", every_n_epochs=1)
    trainer, logs = _trainer(tmp_path, [trainer_callback(cb)], steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert cb.history and cb.selected
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any(n.startswith(("model.layers.", "model.embed", "model.norm", "lm_head")) for n in moved)


@pytest.mark.parametrize("name", ["ntk", "ntkselect", "proximal_lambda_o"])
def test_second_derivatives_under_gradient_checkpointing_are_refused_in_one_line(tmp_path, name):
    pytest.importorskip("trl")
    trainer, _ = _trainer(tmp_path, [trainer_callback(CASES[name]())], sft=True, steps=1)
    with pytest.raises(RuntimeError, match=r"activation checkpointing breaks; pass activation_checkpointing=False"):
        trainer.train()


@pytest.mark.parametrize("update", ["optimizer", "msa"])
def test_lmsa_under_sft_trainer_is_refused_in_one_line(tmp_path, update):
    pytest.importorskip("trl")
    trainer, _ = _trainer(tmp_path, [trainer_callback(C.LMSAStepper(update=update))], sft=True, steps=1)
    with pytest.raises(RuntimeError, match=r"^LMSAStepper under TRL's SFTTrainer: .*run L-MSA on transformers\.Trainer"):
        trainer.train()


def test_a_frozen_selection_gets_no_optimizer_state_and_no_gradient(tmp_path):
    cb = C.SurgicalBlocks(select="block:1")
    trainer, _ = _trainer(tmp_path, [trainer_callback(cb)], steps=2)
    grads: dict[str, bool] = {}

    from transformers import TrainerCallback

    class Peek(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for n, p in trainer.model.named_parameters():
                grads[n] = grads.get(n, False) or p.grad is not None

    trainer.add_callback(Peek())
    trainer.train()
    opt = _torch_opt(trainer)
    on = set(cb.selected)
    frozen = {id(p) for u in cb.layers if u.name not in on for p in u.params.values()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert frozen and all(not grads[names[i]] for i in frozen)
    held = {id(p) for p in opt.state}
    assert not held & frozen
    assert held == {id(p) for u in cb.layers if u.name in on for p in u.params.values()}


def test_several_callbacks_multiply_their_multipliers(tmp_path):
    a = C.LayerLRMultiplier({"model.layers.0.*": 0.5})
    b = C.LayerLRMultiplier({"model.layers.0.*": 0.5}, name="again")
    trainer, logs = _trainer(tmp_path, trainer_callback([a, b]), steps=2, learning_rate=1e-3,
                             lr_scheduler_type="constant")
    trainer.train()
    lrs = {k: v for row in logs.rows for k, v in row.items() if k.startswith("lr_eff/")}
    layer0 = [v for k, v in lrs.items() if k.startswith("lr_eff/model.layers.0")]
    assert layer0 and all(v == pytest.approx(0.25e-3) for v in layer0)


def test_a_callback_added_after_the_trainer_was_built_is_told_where_to_pass_it(tmp_path):
    trainer, _ = _trainer(tmp_path, [], steps=1)
    trainer.add_callback(trainer_callback(C.SpectrumSelect(top_percent=25)))
    with pytest.raises(RuntimeError, match=r"callbacks=\[trainer_callback"):
        trainer.train()


def test_not_a_callback_of_the_package_is_refused():
    with pytest.raises(TypeError, match="callback of lalr_lightning"):
        trainer_callback(object())


def test_two_unnamed_callbacks_with_one_state_key_are_refused_naming_name(tmp_path):
    """As Lightning refuses them: under the Trainer their learning-rate multipliers would not
    multiply (0.5e-3, not 0.25e-3) and one state would overwrite the other in the checkpoint."""
    a, b = C.LayerLRMultiplier({"model.layers.0.*": 0.5}), C.LayerLRMultiplier({"model.layers.0.*": 0.5})
    with pytest.raises(ValueError, match=r"two LayerLRMultiplier .* name="):
        _trainer(tmp_path, trainer_callback([a, b]), steps=2)


def test_one_callback_wrapped_twice_is_refused(tmp_path):
    """Each event would reach it twice (ProximalRegularizer measured lambda_o twice an epoch)."""
    cb = C.ProximalRegularizer(lam=0.5, every_n_epochs=1)
    with pytest.raises(ValueError, match=r"ProximalRegularizer is passed to the Trainer twice"):
        _trainer(tmp_path, [trainer_callback(cb), trainer_callback(cb)], steps=2)


def test_a_lightning_callback_given_to_the_trainer_unwrapped_names_trainer_callback(tmp_path):
    with pytest.raises(AttributeError, match=r"TempBalanceCallback is a Lightning callback.*trainer_callback\("):
        _trainer(tmp_path, [C.TempBalanceCallback(min_evals=5)], steps=1)
    trainer, _ = _trainer(tmp_path, [], steps=1)
    trainer.add_callback(C.SpectrumSelect(top_percent=25))
    with pytest.raises(AttributeError, match=r"SpectrumSelect is a Lightning callback.*trainer_callback\("):
        trainer.train()
    assert not hasattr(C.TempBalanceCallback(), "on_init_end")  # still an attribute error to hasattr


def test_a_trainer_callback_given_to_lightning_names_the_callback_itself():
    cb = trainer_callback(C.TempBalanceCallback(min_evals=5))
    with pytest.raises(TypeError, match=r"for transformers.Trainer; pass TempBalanceCallback itself"):
        _lightning_first_decision(cb, _model())


def test_a_callback_class_instead_of_an_instance_is_told_to_construct_it():
    with pytest.raises(TypeError, match=r"the class SpectrumSelect; construct it: trainer_callback\(SpectrumSelect\(\.\.\.\)\)"):
        trainer_callback(C.SpectrumSelect)



def test_lisa_on_a_peft_lora_model_is_refused_naming_lora(tmp_path):
    """The Trainer builds its optimizer over what requires grad: a LoRA model's adapters only."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer, _ = _trainer(tmp_path, [trainer_callback(C.BlockSchedule("lisa", gamma=1, every_n_steps=1))], steps=1,
                          model=model)
    with pytest.raises(ValueError, match=r"every block must be in the optimizer.*LoRA.*without LISA"):
        trainer.train()



@pytest.mark.parametrize("make, phrase", [
    (lambda: C.SpectrumSelect(top_percent=25), "SpectrumSelect on the model without LoRA"),
    (lambda: C.HTSRPruning(**PRUNE), "prune the model without LoRA"),
])
def test_spectrum_and_pruning_on_a_peft_lora_model_name_lora_b(tmp_path, make, phrase):
    """The SNR / alpha of a zero lora_B is NaN: the error said 'all-zero weights?; leave them out with
    layer_types', which no layer_types can do (the adapters are Linear layers as the base ones)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer, _ = _trainer(tmp_path, [trainer_callback(make())], steps=1, model=model)
    with pytest.raises(ValueError, match=rf"lora_B.*start at zero.*{phrase}"):
        trainer.train()



class _Stream(torch.utils.data.IterableDataset):
    """A streamed train_dataset (``datasets``' ``streaming=True``, a generator): no length, no sampler."""

    def __iter__(self):
        yield from _rows()


@pytest.mark.parametrize("name", ["autorgn", "wanda"])
def test_methods_that_measure_on_batches_take_a_streamed_train_dataset(tmp_path, name):
    """They measured through a DataLoader with a sampler, which torch refuses for an IterableDataset
    ('expected unspecified sampler option'); the batches are the map-style dataset's, in order."""
    streamed_cb, listed_cb = CASES[name](), CASES[name]()
    streamed, _ = _trainer(tmp_path / "a", [trainer_callback(streamed_cb)], steps=1)
    streamed.train_dataset = _Stream()
    streamed.train()
    listed, _ = _trainer(tmp_path / "b", [trainer_callback(listed_cb)], steps=1)
    listed.train()
    attr = listed_cb.traits.decision_attr
    assert streamed_cb.history[0][attr] == pytest.approx(listed_cb.history[0][attr])



def test_a_ranks_share_of_a_streamed_dataset_is_every_nth_batch_at_each_iteration():
    from types import SimpleNamespace

    from lalr_lightning.hf import HFHost

    def host(rank: int, world: int):
        args = SimpleNamespace(world_size=world, process_index=rank, per_device_train_batch_size=4)
        return HFHost(SimpleNamespace(args=args, train_dataset=_Stream(), data_collator=None,
                                      _get_collator_with_removed_columns=lambda collate, description: collate))

    whole = [b["input_ids"] for b in host(0, 1).batches()]
    assert len(whole) == N // 4
    share = host(1, 2).batches()
    for _ in range(2):  # a new pass over the stream each time
        got = [b["input_ids"] for b in share]
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, whole[1::2]))
    assert len(list(host(1, 2).batches(as_given=True))) == len(whole)



def test_a_train_that_raises_gives_the_model_its_flags_back(tmp_path):
    """The Trainer has no exception event: a train() that raised left the selection's
    requires_grad flags on the model (Lightning's teardown runs after an error); now as after a
    finished fit, and a second train() starts from the user's flags."""
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                raise RuntimeError("boom")

    model = _model()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    trainer, _ = _trainer(tmp_path, [trainer_callback(C.SpectrumSelect(top_percent=25)), Boom()], model=model)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    trainer.callback_handler.pop_callback(Boom)
    trainer.train()  # the same Trainer again, to the end
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_a_pattern_naming_a_tied_head_says_which_layer_it_is(tmp_path):
    """GPT-2's lm_head shares transformer.wte's weight: one layer, found under the embedding's name;
    'matches no layer' alone sent the user looking for a missing head."""
    model = tiny_lm("gpt2", True, layers=2, hidden=16)
    cb = C.LayerLRMultiplier({"lm_head": 2.0})
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with 'transformer.wte'.*"
                                         r"use 'transformer.wte'"):
        _trainer(tmp_path, [trainer_callback(cb)], steps=1, model=model)[0].train()


# ---------------------------------------------------------------------- the same decisions as Lightning


def _lightning_first_decision(cb, model):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Wrap(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, **batch):
            return self.model(**batch)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(Wrap(), DataLoader(_rows(), batch_size=4))
    return cb.history[0]


def _strip(d: dict) -> dict:
    """The Lightning side's names without the wrapper's ``model.`` (in each ``+``-joined part)."""
    return {"+".join(part.removeprefix("model.") for part in k.split("+")): v for k, v in d.items()}


@pytest.mark.parametrize("name", ["tempbalance", "spectrum", "lisa", "autorgn", "magnitude", "lalr"])
def test_the_first_decision_equals_the_lightning_hosts(tmp_path, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning = _lightning_first_decision(CASES[name](), _model())
    cb = CASES[name]()
    trainer, _ = _trainer(tmp_path, [trainer_callback(cb)], steps=1)
    trainer.train()
    ours = cb.history[0]
    attr = cb.traits.decision_attr
    theirs = _strip(lightning[attr])
    assert set(theirs) == set(ours[attr]), (sorted(theirs), sorted(ours[attr]))
    for k, v in ours[attr].items():
        assert v == pytest.approx(theirs[k], rel=1e-5, abs=1e-7), k


def test_every_later_decision_is_the_methods_own_on_the_weights_of_that_moment(tmp_path):
    """TempBalance every 2 steps: at each decision, the multipliers recomputed from a copy of the
    weights the run had then equal what the run decided."""
    from transformers import TrainerCallback

    cb = C.TempBalanceCallback(min_evals=5, every_n_steps=2)
    copies: dict[int, dict] = {}

    class Snap(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step % 2 == 0:
                copies[state.global_step] = copy.deepcopy(model.state_dict())

    trainer, _ = _trainer(tmp_path, [trainer_callback(cb), Snap()], steps=6)
    trainer.train()
    assert [h["step"] for h in cb.history] == [0, 2, 4]
    for entry in cb.history:
        twin = _model()
        twin.load_state_dict(copies[entry["step"]])
        again = C.TempBalanceCallback(min_evals=5, every_n_steps=2).plan(twin).set_index("layer")["multiplier"]
        assert set(again.index) == set(entry["multipliers"])
        for k, v in entry["multipliers"].items():
            assert again[k] == pytest.approx(v, rel=1e-6), (entry["step"], k)


# ---------------------------------------------------------------------- resume


@pytest.mark.parametrize("name", ["tempbalance", "lisa"])
def test_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path, name):
    whole_cb = CASES[name]()
    whole, _ = _trainer(tmp_path / "a", [trainer_callback(whole_cb)], steps=4, save_strategy="steps", save_steps=2)
    whole.train()
    ckpt = tmp_path / "a" / "out" / "checkpoint-2"
    assert (ckpt / STATE_FILE).is_file()
    again_cb = CASES[name]()
    again, _ = _trainer(tmp_path / "b", [trainer_callback(again_cb)], steps=4, model=_model(seed=5))
    again.train(resume_from_checkpoint=str(ckpt))
    for (n, p), q in zip(whole.model.named_parameters(), again.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7, rtol=0), n
    assert again_cb.history == whole_cb.history


def test_a_checkpoint_written_with_other_settings_is_refused_naming_them(tmp_path):
    first, _ = _trainer(tmp_path / "a", [trainer_callback(C.BlockSchedule("lisa", gamma=1, every_n_steps=1))],
                        steps=2, save_strategy="steps", save_steps=2)
    first.train()
    other, _ = _trainer(tmp_path / "b", [trainer_callback(C.BlockSchedule("lisa", gamma=2, every_n_steps=1))],
                        steps=4)
    with pytest.raises(C.SettingsMismatchError, match="gamma=1"):
        other.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))


@pytest.mark.parametrize("content", [b"garbage", "list"])
def test_a_damaged_state_file_in_the_checkpoint_is_one_line_naming_it(tmp_path, content):
    first, _ = _trainer(tmp_path / "a", [trainer_callback(C.TempBalanceCallback(min_evals=5, every_n_steps=2))],
                        steps=2, save_strategy="steps", save_steps=2)
    first.train()
    ckpt = tmp_path / "a" / "out" / "checkpoint-2"
    if content == "list":
        torch.save([1, 2], ckpt / STATE_FILE)
    else:
        (ckpt / STATE_FILE).write_bytes(content)
    again, _ = _trainer(tmp_path / "b", [trainer_callback(C.TempBalanceCallback(min_evals=5, every_n_steps=2))],
                        steps=4)
    with pytest.raises(ValueError, match=rf"{STATE_FILE} .* not the callbacks' states written by lalr_lightning.*"
                                         rf"delete it"):
        again.train(resume_from_checkpoint=str(ckpt))


# ---------------------------------------------------------------------- LISA against LMFlow's callback


def _lmflow_lisa(model, n_layers: int, interval: int, draw):
    """A harness written from the behaviour of LMFlow's ``DynamicLayerActivationCallback``
    (src/lmflow/pipeline/finetuner.py): at ``on_step_begin``, when ``global_step % interval == 0``,
    every decoder layer's parameters stop requiring grad and ``n_layers`` drawn layers start
    again; embeddings, the final norm and the head are never touched. The optimizer is the
    Trainer's, built before the first switch over every parameter (AdamW keeps the state of every
    layer ever trained). ``draw(switch) -> indices`` replaces LMFlow's ``np.random.choice`` so both
    runs sample the same layers."""
    from transformers import TrainerCallback

    layers = model.model.layers

    class LMFlowLISA(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % interval == 0:
                for layer in layers:
                    for p in layer.parameters():
                        p.requires_grad = False
                for i in draw(state.global_step // interval):
                    for p in layers[i].parameters():
                        p.requires_grad = True

    return LMFlowLISA()


def _active(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if all(p.requires_grad for p in layer.parameters())]


def test_lisa_steps_as_lmflows_callback(tmp_path):
    from transformers import TrainerCallback

    from lalr_lightning.core.selection.surgical import lisa_sample

    gamma, interval, seed, steps = 2, 2, 3, 8

    def run(cb_for):
        model = _model()
        seen: list[list[int]] = []

        class Peek(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                seen.append(_active(model))

        trainer, _ = _trainer(tmp_path / str(len(runs)), [cb_for(model), Peek()], steps=steps, weight_decay=0.01,
                              model=model)
        trainer.train()
        runs.append(trainer)
        return seen, {n: p.detach().clone() for n, p in model.named_parameters()}

    runs: list = []
    ref_active, ref_w = run(lambda m: _lmflow_lisa(m, gamma, interval, lambda s: lisa_sample(LAYERS, gamma, s, seed)))
    ours_cb = C.BlockSchedule("lisa", gamma=gamma, every_n_steps=interval, seed=seed, optimizer_state="keep")
    our_active, our_w = run(lambda m: trainer_callback(ours_cb))
    assert len(ref_active) == steps and our_active == ref_active
    assert len({tuple(a) for a in ref_active}) > 1  # it switched
    worst = max(float((ref_w[n] - our_w[n]).abs().max()) for n in ref_w)
    moved = max(float((ref_w[n] - _model().state_dict()[n]).abs().max()) for n in ref_w)
    print(f"LISA vs LMFlow's callback: {steps} steps, active layers {ref_active}; largest weight difference "
          f"{worst:.3g} (largest change from the start {moved:.3g})")
    assert worst <= 1e-6 and moved > 1e-4, (worst, moved)
    held_ref = {n for n, p in runs[0].model.named_parameters() if p in _torch_opt(runs[0]).state}
    held_our = {n for n, p in runs[1].model.named_parameters() if p in _torch_opt(runs[1]).state}
    assert held_ref == held_our
    np.testing.assert_equal(len(held_ref) > 0, True)


# ---------------------------------------------------------------------- two processes


TWO_RANK_CASES = ["spectrum", "lisa", "tempbalance", "autorgn"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One ``torch.distributed.run`` of tests/_hf_ddp.py for every case (once per session, whatever
    the number of pytest-xdist workers): ``(return code, stderr, its output directory)``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from filelock import FileLock

    from tests._dist import free_port

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    out = root / "hf_two_ranks"
    with FileLock(str(root / "hf_two_ranks.lock")):
        if not (out / "done.txt").exists():
            out.mkdir(exist_ok=True)
            script = Path(__file__).with_name("_hf_ddp.py")
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                  "--master_port", str(free_port()), str(script), str(out),
                                  *TWO_RANK_CASES], capture_output=True, text=True, timeout=600)
            (out / "done.txt").write_text(f"{run.returncode}\n{run.stderr[-3000:]}")
    code, stderr = (out / "done.txt").read_text().split("\n", 1)
    return int(code), stderr, out


@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_two_ranks_decide_alike_and_frozen_parameters_get_no_gradient_nor_ddp_bucket(two_ranks, name):
    code, stderr, out = two_ranks
    if not all((out / f"{name}_rank{r}.pt").exists() for r in (0, 1)):
        pytest.fail(f"{name} wrote no result (return code {code}): {stderr}")
    a, b = (torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1))
    assert a["is_ddp"] == "DistributedDataParallel" and a["world"] == 2
    assert a["history"] and a["history"] == b["history"]
    for n in a["weights"]:
        assert torch.equal(a["weights"][n], b["weights"][n]), n
    for rank in (a, b):  # at every step, what did not require grad then got no gradient
        assert len(rank["grads"]) == 4
        assert all(not set(frozen) & set(g) for g, frozen in rank["grads"]), "a frozen parameter got a gradient"
    if name in ("spectrum", "lisa"):
        assert all(frozen for _, frozen in a["grads"])
    if name == "spectrum":  # frozen from the start: outside DDP's buckets
        assert a["frozen"] and a["reduced"] == sum(v for n, v in a["bytes"].items() if n not in set(a["frozen"]))
    if name == "lisa":  # the switching blocks are kept out of DDP; stem and head reduce in its buckets
        stem_head = sum(v for n, v in a["bytes"].items() if ".layers." not in n)
        assert a["reduced"] == stem_head
    assert code == 0, stderr  # the run as a whole ended cleanly (every case's results checked above first)


def test_a_batch_loss_is_the_models_own_outputs_loss_from_a_batch_with_labels():
    from lalr_lightning.core.model.batch_loss import batch_loss

    model = _model()
    batch = {"input_ids": torch.tensor(_ids(4)), "labels": torch.tensor(_ids(4))}
    assert float(batch_loss(model, batch)) == pytest.approx(float(model(**batch).loss))
    with pytest.raises(TypeError, match="pass loss_fn=f"):
        batch_loss(model, {"input_ids": batch["input_ids"]})  # no labels: no loss of its own


def test_two_wrapped_callbacks_draw_no_already_one_warning(tmp_path):
    """Issue 42 row 9: ``callbacks=trainer_callback([a, b])``, as docs/hf.md shows it, drew
    transformers' "You are adding a LayerwiseTrainerCallback ... but there is already one"."""
    import logging
    import pickle

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("transformers.trainer_callback").addHandler(handler)
    try:
        a, b = C.TempBalanceCallback(min_evals=4), C.SpectrumSelect(top_percent=25)
        wrapped = trainer_callback([a, b])
        trainer, _ = _trainer(tmp_path, wrapped, steps=1)
    finally:
        logging.getLogger("transformers.trainer_callback").removeHandler(handler)
    assert not [m for m in said if "already one" in m], said
    assert [type(c).__name__ for c in wrapped] == ["LayerwiseTrainerCallback[TempBalanceCallback]",
                                              "LayerwiseTrainerCallback[SpectrumSelect]"]
    assert all(c in trainer.callback_handler.callbacks for c in wrapped)
    again = pickle.loads(pickle.dumps(wrapped[0]))
    assert type(again).__name__ == "LayerwiseTrainerCallback[TempBalanceCallback]" and again.method.min_evals == 4


def test_report_reads_a_trainer_runs_tensorboard_directory(tmp_path, capsys):
    """Issue 42 row 10: the Trainer's TensorBoard integration logs ``train/tempbalance/alpha/...``,
    and ``report`` (where docs/hf.md points) said the run "holds no per-layer metrics"."""
    pytest.importorskip("tensorboard")
    from lalr_lightning.report import methods, read_run, report_main

    tb = C.TempBalanceCallback(min_evals=4, every_n_steps=1)
    trainer, _ = _trainer(tmp_path, [trainer_callback(tb)], steps=2, report_to="tensorboard")
    trainer.train()  # the writer is closed at the end: every event is on disk
    (run_dir,) = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}  # output_dir/runs/<date>
    run = read_run(run_dir)
    assert "tempbalance" in methods(run)
    assert {k.split("/", 2)[2] for k in run.scalars if k.startswith("tempbalance/alpha/")} == set(tb.scores)
    assert any(k.startswith("lr_eff/") for k in run.scalars) and "train/loss" in run.scalars
    capsys.readouterr()
    assert report_main([str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert "no per-layer metrics" not in capsys.readouterr().err
    assert '<section id="tempbalance">' in (tmp_path / "r.html").read_text()
