"""Two CPU ranks of Hugging Face's Trainer under accelerate's FSDP2 (``fsdp_config={"version": 2}``),
started once by ``torch.distributed.run`` from tests/test_hf_fsdp2.py for every case named, and the
CPU workaround in one place (:func:`cpu_fsdp2`).

accelerate picks FSDP only where the process group's device type looks like a GPU's: on a CPU the
Trainer's ``fsdp=`` silently stays DDP. So accelerate's state is built first, with
``PartialState(backend="gloo")``, and its distributed type set to ``MULTI_GPU`` while the Trainer
builds its ``Accelerator`` (``accelerator_config={"use_configured_state": True}``): accelerate then
takes the Trainer's FSDP plugin and sets the type to ``FSDP`` itself; the device stays the CPU, and
``fully_shard`` shards on a gloo mesh. Between cases the state is built again.

Each rank writes, per case, what FSDP2 held (the model's type, each parameter's type and the elements
of its local shard, the optimizer state and gradient elements on this rank), the weights after every
step (gathered whole) and the callback's history, for the test to compare. A fallback to DDP fails
there: the model must be an ``FSDPModule`` whose parameters are DTensors, each rank holding its half.
A case ``<method>-ddp`` runs the same fit under plain DDP, to compare.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lalr_lightning.callbacks as C  # noqa: E402
from tests._dist import hf_train, hf_trainer  # noqa: E402
from tests._lm import tiny_lm  # noqa: E402

STEPS = 4
#: the methods whose run is resumed from its step-2 checkpoint (``<method>-resume``)
RESUMED = ("none", "lisa", "lisakeep", "spectrum", "tempbalance", "pruning")

METHODS = {
    "none": lambda: None,
    "lisa": lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1, seed=0),
    # the optimizer state of a block switched off kept: saved for parameters frozen when it loads
    "lisakeep": lambda: C.BlockSchedule("lisa", gamma=1, every_n_steps=1, seed=0, optimizer_state="keep"),
    "spectrum": lambda: C.SpectrumSelect(top_percent=25),
    "surgical": lambda: C.SurgicalBlocks(select="block:1"),
    "multiplier": lambda: C.LayerLRMultiplier({"model.layers.1.*": 3.0, "lm_head": 0.5}),
    "tempbalance": lambda: C.TempBalanceCallback(min_evals=5, every_n_steps=2),
    "pruning": lambda: C.HTSRPruning(target_sparsity=0.5, min_numel=1, min_evals=3),
    "lmsa": lambda: C.LMSAStepper(),
    # not in CI's cases (each equals its DDP run, checked once: docs/sharded.md gives the command)
    "ntk": lambda: C.NTKDiagnostics(probe_size=4),
    "proximal": lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=None),
    "proximalo": lambda: C.ProximalRegularizer(lam=0.5, every_n_epochs=1, probe_size=4),
    "autorgn": lambda: C.AutoRGN(n_batches=2),
    "lmsaopt": lambda: C.LMSAStepper(update="optimizer", every_n_epochs=1),
    "lalr": lambda: C.LALRScheduleCallback(),
    "ntkselect": lambda: C.NTKSelect(probe_size=4, max_layers=1, kappa_max=1e12),
    "lift": lambda: C.BlockSchedule("lift", every_n_steps=2),
}


def cpu_fsdp2(fsdp: bool = True) -> None:
    """Build accelerate's state so that the next Trainer's ``Accelerator`` takes its FSDP plugin on
    a CPU (module docstring); once per Trainer (``fsdp=False``: plain DDP over gloo, to compare)."""
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    AcceleratorState._reset_state()
    PartialState(backend="gloo")
    # accelerate's check is for GPU-like types only; it sets FSDP itself once it takes the plugin
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU if fsdp else DistributedType.MULTI_CPU


def held(trainer) -> dict:
    """Per rank: the model's type, each parameter's (type, local elements, whole elements), and the
    elements of optimizer state."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model = trainer.model
    opt = trainer.optimizer.optimizer
    params = {n: (type(p).__name__, (p.to_local() if isinstance(p, DTensor) else p).numel(), p.numel())
              for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in s.values()
                               if torch.is_tensor(v) and v.dim())
             for p, s in opt.state.items() if s}
    return {"fsdp": isinstance(model, FSDPModule), "model": type(model).__name__, "world": trainer.args.world_size,
            "params": params, "state": state, "lr": [g["lr"] for g in opt.param_groups]}


def weights(model) -> dict[str, torch.Tensor]:
    """Every weight whole (DTensors gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def fit(out: str, case: str) -> None:
    from transformers import TrainerCallback, TrainingArguments

    method, *mode = case.split("-")
    resume, dcp = "resume" in mode, "dcp" in mode  # dcp: sharded checkpoints (torch.distributed.checkpoint)
    ddp = "ddp" in mode  # the same fit under DDP, to compare
    cpu_fsdp2(fsdp=not ddp)
    model = tiny_lm("llama", False, layers=4, hidden=16, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(4, 60, (16, 10), generator=g)]
    cb = METHODS[method]()
    names_before = {id(p): n for n, p in model.named_parameters()}
    record: dict = {"steps": [], "grads": []}

    class Peek(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["start"] = weights(trainer.model)
            record["begin"] = held(trainer)
            opt = trainer.optimizer.optimizer
            names = {id(p): n for n, p in trainer.model.named_parameters()}

            def grads(o, *_):  # the gradient elements (local shards) the optimizer gets, per step
                record["grads"].append({names[id(p)]: p.grad.to_local().numel() if hasattr(p.grad, "to_local")
                                        else p.grad.numel() for g in o.param_groups for p in g["params"]
                                        if p.grad is not None})

            opt.register_step_pre_hook(grads)

        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step == 2 and method in RESUMED and not (resume or ddp)
            record["steps"].append((state.global_step, list(getattr(cb, "selected", []) or []),
                                    weights(trainer.model), held(trainer),
                                    dict(getattr(cb, "multipliers", None) or {})))

    run_dir = f"{out}/run_{method}{'-dcp' if dcp else ''}{'-ddp' if ddp else ''}"
    sharding = {} if ddp else {"fsdp": True, "fsdp_config": {
        "version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "SHARDED_STATE_DICT" if dcp else "FULL_STATE_DICT"}}
    args = TrainingArguments(output_dir=run_dir, max_steps=STEPS, per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, save_strategy="steps", save_steps=2, disable_tqdm=True, seed=0,
                             learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.1,
                             accelerator_config={"use_configured_state": True}, **sharding)
    trainer = hf_trainer(model, args, rows, cb, Peek())
    error = hf_train(trainer, f"{run_dir}/checkpoint-2" if resume else None)
    rank = trainer.args.process_index
    # after the fit every flag is the user's again (all trained here)
    record.update(error=error, history=getattr(cb, "history", None),
                  frozen_after=[n for n, p in trainer.model.named_parameters() if not p.requires_grad])
    if cb is not None and hasattr(cb, "layers"):
        # the method's units by name, as it holds them after the wrap (its parameters are the model's DTensors)
        live = {id(p): n for n, p in trainer.model.named_parameters()}
        record["layers"] = {u.name: sorted(live.get(id(p)) or "?" + names_before.get(id(p), "")
                                           for p in u.params.values()) for u in cb.layers}
    torch.save(record, f"{out}/{case}_rank{rank}.pt")


def main(out: str, cases: list[str]) -> None:
    for case in cases:
        t = time.perf_counter()
        fit(out, case)
        print(f"case {case}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2:])
