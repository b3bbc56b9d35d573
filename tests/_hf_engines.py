"""Two CPU ranks of Hugging Face's Trainer under DeepSpeed ZeRO-2 and ZeRO-3, started once by
``torch.distributed.run`` from tests/test_hf_engines.py for every case named (starting the
processes and importing DeepSpeed is the slow part), and the CPU workarounds in one place:

* ``DS_ACCELERATOR=cpu``; DeepSpeed's shared-memory all-reduce kernel (a C++ build of minutes,
  for inference) is marked not compatible, so the gloo backend reduces;
* accelerate's state built first with ``PartialState(backend="gloo")`` and
  ``ACCELERATE_USE_DEEPSPEED=true``, the Trainer given ``accelerator_config={"use_configured_state":
  True}``: else HF computes a world of 1, or never picks DeepSpeed; the state reset between cases.

Each rank writes, per case, what the engine held (its type, the fp32 partition, optimizer state
and gradient elements per rank), the weights after every step (ZeRO-3: gathered) and the
callback's history, for the test to compare. A fallback to DDP fails there: the model must be a
``DeepSpeedEngine`` with flat partitions of the size the case expects.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

import lalr_lightning.callbacks as C  # noqa: E402
from tests._dist import hf_train, hf_trainer  # noqa: E402
from tests._lm import tiny_lm  # noqa: E402

STEPS = 4
#: the methods whose run is resumed from its step-2 checkpoint (``<case>-resume``)
RESUMED = ("none", "lisa", "spectrum", "tempbalance", "pruning")
#: the methods measuring (or pruning) at an epoch's start that run on half the rows: two epochs in the 4 steps
TWO_EPOCHS = ("eb", "sparsegpt1", "gradual")
#: the pruning cases: their fp32 master weights are read too (DeepSpeed's own safe_get_full_fp32_param)
#: after the pruning event and every step, and the weights before each event
PRUNING = ("pruning", "wanda", "sparsegpt", "nm", "owl", "sparsegpt1", "gradual")

METHODS = {
    "none": lambda: None,
    "lisa": lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1, seed=0),
    "spectrum": lambda: C.SpectrumSelect(top_percent=25),
    "surgical": lambda: C.SurgicalBlocks(select="block:1"),
    "ntkselect": lambda: C.NTKSelect(probe_size=4, max_layers=1, kappa_max=1e12),
    "tempbalance": lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2),
    "multiplier": lambda: C.LayerLRMultiplier({"model.layers.1.*": 3.0, "lm_head": 0.5}),
    "pruning": lambda: C.HTSRPruning(target_sparsity=0.5, min_numel=1, min_evals=3),
    "lalr": lambda: C.LALRScheduleCallback(),
    "rgn": lambda: C.AutoRGN(n_batches=2),
    "eb": lambda: C.AutoRGN(criterion="eb", n_batches=2, eb_threshold=1.0),
    "wanda": lambda: C.HTSRPruning(target_sparsity=0.5, criterion="wanda", min_numel=1, min_evals=3,
                                   n_calibration=8),
    # SparseGPT moves the kept weights too (its OBS update): at the fit's start, and at epoch 1's
    "sparsegpt": lambda: C.HTSRPruning(target_sparsity=0.5, criterion="sparsegpt", min_numel=1, min_evals=3,
                                       n_calibration=8),
    "sparsegpt1": lambda: C.HTSRPruning(target_sparsity=0.5, criterion="sparsegpt", min_numel=1, min_evals=3,
                                        n_calibration=8, when=1),
    "nm": lambda: C.HTSRPruning(target_sparsity=0.5, n=2, m=4, min_numel=1, min_evals=3),
    "owl": lambda: C.HTSRPruning(preset="owl", target_sparsity=0.5, criterion="sparsegpt", n_calibration=8),
    "gradual": lambda: C.HTSRPruning(target_sparsity=0.5, min_numel=1, min_evals=3, when="gradual", gradual_epochs=2),
    "proximal": lambda: C.ProximalRegularizer(lam=0.5),
    "lmsa": lambda: C.LMSAStepper(update="optimizer", every_n_epochs=1),
    "ntk": lambda: C.NTKDiagnostics(probe_size=4),
}


def ds_config(stage: int, bf16: bool = False) -> dict:
    # ZeRO-3 keeps no parameter whole between forwards (by default those under 1e5 elements, all
    # of the tiny model's, would stay whole and hide a measurement that reads placeholders)
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    # bf16 ("<case>-bf16"): the model's weights in bf16, the master copy fp32; under ZeRO-1 with fp32
    # gradient accumulation DeepSpeed steps its BF16_Optimizer instead (refused)
    extra = {"data_types": {"grad_accum_dtype": "fp32"}} if bf16 and stage == 1 else {}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto" if bf16 else False}, **extra}


def cpu_deepspeed() -> None:
    """The CPU workarounds (module docstring), once per process."""
    import accelerate
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    accelerate.PartialState(backend="gloo")


def engine_counts(trainer) -> dict:
    """Per rank: the engine's type, and the elements of its fp32 partitions and optimizer state."""
    engine = trainer.model_wrapped
    zero = engine.optimizer
    flats = list(getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups)
    state = zero.optimizer.state
    members = getattr(zero, "fp16_groups", None) or zero.bit16_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {"engine": type(engine).__name__, "zero": type(zero).__name__, "world": trainer.args.world_size,
            "fp32": sum(f.numel() for f in flats),
            "state": sum(v.numel() for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()),
            # per flat partition: its elements on this rank, whether it holds optimizer state, its parameters
            "flats": [(f.numel(), any(torch.is_tensor(v) and v.dim() for v in state.get(f, {}).values()),
                       sorted(names[id(p)] for p in ps)) for f, ps in zip(flats, members)]}


def master(model) -> dict[str, torch.Tensor]:
    """Every weight's fp32 master copy as the engine's optimizer holds it (DeepSpeed's own reader,
    independent of the package's FlatView: a collective on every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()}


def weights(trainer, model) -> dict[str, torch.Tensor]:
    """Every weight whole (ZeRO-3 gathers them: a collective on every rank)."""
    params = list(model.named_parameters())
    if any(hasattr(p, "ds_tensor") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


#: the most elements a measurement held whole at once (HFHost.gathered, ZeRO-3), per case
GATHERED: list[int] = []


def count_gathers() -> None:
    """Record how much each of the host's gathers holds whole (a layer at a time, not the model)."""
    import lalr_lightning.hf as hf

    inner = hf.HFHost.gathered

    def gathered(self, params):
        params = list(params)
        GATHERED.append(sum(int(getattr(p, "ds_numel", p.numel())) for p in params))
        return inner(self, params)

    hf.HFHost.gathered = gathered


def fit(out: str, case: str) -> None:
    from accelerate.state import AcceleratorState
    from transformers import TrainerCallback, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    stage_name, method, *mode = case.split("-")
    stage = int(stage_name[-1])
    resume = bool(mode and mode[0] == "resume")
    AcceleratorState._reset_state()
    # the last case's ZeRO-3 config stays global while its arguments live: the model would be
    # partitioned as it is created (zero.Init); "init" makes it so on purpose
    gc.collect()
    unset_hf_deepspeed_config()
    init = bool(mode and mode[0] == "init")
    bf16 = bool(mode and mode[0] == "bf16")
    if init:
        held = TrainingArguments(output_dir=f"{out}/init", deepspeed=ds_config(stage), use_cpu=True, report_to="none",
                                 accelerator_config={"use_configured_state": True})
    model = tiny_lm("llama", False, layers=4, hidden=16, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(4, 60, (16, 10), generator=g)]
    rows = rows[:8] if method in TWO_EPOCHS else rows
    cb = METHODS[method]()
    record: dict = {"steps": [], "grads": []}
    GATHERED.clear()

    prunes = method in PRUNING
    record.update(before={}, after={}, master_steps=[])

    class Before(TrainerCallback):  # ahead of the method's callback: the weights a pruning event starts from
        def on_train_begin(self, args, state, control, **kwargs):
            if prunes:
                record["before"]["start"] = weights(trainer, model)

        def on_epoch_begin(self, args, state, control, **kwargs):
            if prunes:
                record["before"][int(state.epoch or 0)] = weights(trainer, model)

    class Peek(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            if prunes:  # after an epoch's pruning event: the model's weights and the engine's master copy
                record["after"][int(state.epoch or 0)] = (weights(trainer, model), master(model))

        def on_train_begin(self, args, state, control, **kwargs):
            record["start"] = weights(trainer, model)
            if prunes:
                record["master_start"] = master(model)
            record["begin_counts"] = engine_counts(trainer)
            # ZeRO-3: every parameter an empty placeholder between forwards (what a measurement must gather)
            record["placeholders"] = sum(p.numel() == 0 for p in model.parameters())
            base = trainer.model_wrapped.optimizer.optimizer

            def grads(opt, *_):  # the gradient elements the optimizer gets, per step (per sub-group)
                record["grads"].append(sum(p.grad.numel() for g in opt.param_groups for p in g["params"]
                                           if p.grad is not None))

            base.register_step_pre_hook(grads)

        def on_step_end(self, args, state, control, **kwargs):
            # a checkpoint only where a resume reads it (DeepSpeed's save is the slow part of a case)
            control.should_save = state.global_step == 2 and method in RESUMED and not resume
            record["steps"].append((state.global_step, list(getattr(cb, "selected", []) or []),
                                    weights(trainer, model), engine_counts(trainer),
                                    dict(getattr(cb, "multipliers", None) or {})))
            if prunes:
                record["master_steps"].append(master(model))

    run_dir = f"{out}/run_{stage_name}-{method}"
    args = TrainingArguments(output_dir=run_dir, max_steps=STEPS, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, save_strategy="steps", save_steps=2, save_only_model=False,
                             disable_tqdm=True, seed=0, learning_rate=1e-2, deepspeed=ds_config(stage, bf16),
                             accelerator_config={"use_configured_state": True}, lr_scheduler_type="constant",
                             weight_decay=0.1, bf16=bf16)
    trainer = hf_trainer(model, args, rows, cb, Peek(), before=Before())
    error = hf_train(trainer, f"{run_dir}/checkpoint-2" if resume else None)
    rank = trainer.args.process_index
    if init:
        del held
    if error is None:
        record["end_counts"] = engine_counts(trainer)
    record.update(error=error, history=getattr(cb, "history", None), gathered=list(GATHERED),
                  masks=dict(getattr(cb, "masks", None) or {}),
                  numel={n: int(getattr(p, "ds_numel", p.numel())) for n, p in model.named_parameters()})
    if cb is not None and hasattr(cb, "layers"):
        record["layers"] = {u.name: sorted(n for n, p in model.named_parameters()
                                           if any(p is q for q in u.params.values())) for u in cb.layers}
    torch.save(record, f"{out}/{case}_rank{rank}.pt")


def main(out: str, cases: list[str]) -> None:
    cpu_deepspeed()
    count_gathers()
    # accelerate, DeepSpeed and fit() each run gc.collect() once per case, which walks every
    # object of the imported libraries (1.5 s each on 2 loaded cores): frozen, they are skipped
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import Trainer  # noqa: F401

    gc.collect()
    gc.freeze()
    for case in cases:
        t = time.perf_counter()
        fit(out, case)
        print(f"case {case}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
