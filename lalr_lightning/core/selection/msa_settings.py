"""LMSAStepper's settings: the defaults its ``None`` arguments stand for (the paper's rho = 1, Adam
at lr 1e-4 for 5 inner iterations) and the checks of its numbers. Pure Python;
``callbacks/lmsa.py`` keeps what :func:`lmsa_settings` returns."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lalr_lightning.choices import unknown
from lalr_lightning.core.runtime.checks import reject_stray

__all__ = ["INNER_OPTIMIZERS", "SELECT", "UPDATE", "check_blocks", "check_restored", "lmsa_settings",
           "sharded_refusal"]

SELECT = ("min", "all")
UPDATE = ("msa", "optimizer")
INNER_OPTIMIZERS = ("adam", "sgd")


def lmsa_settings(
    *, select: str, num_blocks: int | None, update: str, rho: float | None, inner_optimizer: str | Callable | None,
    inner_lr: float | None, inner_steps: int | None, feasibility: float | None, rho_scale: float | None,
    metric_rho: float | None, output_dim: int | None, n_batches: int, every_n_epochs: int | None, head: bool,
    loss_fn: Callable | None, seed: int,
) -> dict[str, Any]:
    """The settings under their own names, defaults filled in; a ValueError (TypeError for a
    wrong kind of argument) naming the first that is out of range."""
    if select not in SELECT:
        raise unknown("select", select, SELECT)
    if update not in UPDATE:
        raise unknown("update", update, UPDATE)
    inner = ("rho", "inner_optimizer", "inner_lr", "inner_steps", "feasibility")
    reject_stray("LMSAStepper", "update", update, dict(zip(inner, (rho, inner_optimizer, inner_lr, inner_steps,
                                                                  feasibility))), {"msa": inner, "optimizer": ()})
    reject_stray("LMSAStepper", "select", select, {"num_blocks": num_blocks}, {"min": ("num_blocks",), "all": ()})
    if metric_rho is not None and rho_scale is not None:
        raise ValueError("rho_scale scales rho_hat, which metric_rho replaces; give one of them")
    rho = 1.0 if rho is None else rho
    inner_optimizer = "adam" if inner_optimizer is None else inner_optimizer
    inner_lr = 1e-4 if inner_lr is None else inner_lr
    inner_steps = 5 if inner_steps is None else inner_steps
    feasibility = 0.0 if feasibility is None else feasibility
    rho_scale = 1.0 if rho_scale is None else rho_scale
    num_blocks = 1 if num_blocks is None else num_blocks
    if isinstance(inner_optimizer, str) and inner_optimizer not in INNER_OPTIMIZERS:
        raise unknown("inner_optimizer", inner_optimizer, INNER_OPTIMIZERS,
                      note=" or a callable params -> torch.optim.Optimizer")
    if not isinstance(inner_optimizer, str) and not callable(inner_optimizer):
        raise TypeError("inner_optimizer must be 'adam', 'sgd' or a callable params -> Optimizer")
    for label, v in (("rho", rho), ("inner_lr", inner_lr), ("rho_scale", rho_scale)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{label} must be a positive finite number, got {v}")
    if metric_rho is not None and not (metric_rho > 0 and math.isfinite(metric_rho)):
        raise ValueError(f"metric_rho must be None or positive, got {metric_rho}")
    if not feasibility >= 0:
        raise ValueError(f"feasibility must be >= 0, got {feasibility}")
    for label, v in (("num_blocks", num_blocks), ("inner_steps", inner_steps),
                     ("n_batches (selection_batches)", n_batches)):
        if int(v) != v or v < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {v}")
    if every_n_epochs is not None and (int(every_n_epochs) != every_n_epochs or every_n_epochs < 1):
        raise ValueError(f"every_n_epochs (reselect_every_n_epochs) must be None or an integer >= 1, "
                         f"got {every_n_epochs}")
    if output_dim is not None and output_dim < 1:
        raise ValueError(f"output_dim must be None or >= 1, got {output_dim}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn must be a callable (pl_module, batch) -> scalar loss")
    return dict(select=select, num_blocks=int(num_blocks), update=update, rho=float(rho),
                inner_optimizer=inner_optimizer, inner_lr=float(inner_lr), inner_steps=int(inner_steps),
                feasibility=float(feasibility), rho_scale=float(rho_scale), metric_rho=metric_rho,
                output_dim=output_dim, n_batches=int(n_batches), every_n_epochs=every_n_epochs, head=head,
                loss_fn=loss_fn, seed=int(seed))



def check_blocks(trainable: Mapping[str, bool], select: str, num_blocks: int) -> str | None:
    """A ValueError for a block with no parameter that requires grad (``trainable``: block ->
    whether one does) or for more blocks asked than found; the warning when ``num_blocks``
    selects every block, else None."""
    names = list(trainable)
    frozen = [n for n in names if not trainable[n]]
    if frozen:
        raise ValueError(f"LMSAStepper: block {frozen[0]!r} has no parameter that requires grad; do not freeze blocks "
                         "with requires_grad=False (LMSAStepper freezes through the optimizer), or leave the block "
                         "out with blocks=[...]")
    if select == "min" and num_blocks > len(names):
        raise ValueError(f"num_blocks={num_blocks} but the model has {len(names)} blocks: {names}")
    if select == "min" and num_blocks == len(names):
        return (f"LMSAStepper cannot choose: num_blocks={num_blocks} selects every block ({names}) at every "
                "selection; lower num_blocks, or split the model into more blocks with blocks=[...]")
    return None


def sharded_refusal(update: str) -> str | None:
    """Why ``update`` cannot run where FSDP shards the model, and what to use instead; None: it can."""
    if update == "msa":
        return ("update='msa' moves the selected blocks by running them alone after every optimizer step, which "
                "a sharded model cannot do; pass update='optimizer' (the L-MSA metric, measured on a whole copy "
                "of the model on rank zero, picks the blocks the module's optimizer trains) or use strategy='ddp'")
    return None


def check_restored(selected: Sequence[str], blocks: Sequence[str]) -> None:
    """A ValueError for blocks a checkpoint selected that this model does not have."""
    unknown = [n for n in selected if n not in blocks]
    if unknown:
        raise ValueError(f"LMSAStepper: the checkpoint selected blocks {unknown} that this model does not have "
                         f"(blocks: {list(blocks)})")
