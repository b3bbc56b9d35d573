"""Which normalization layers keep their running statistics while part of a model trains.

One rule for every method that trains some blocks and not others (surgical fine-tuning keeps
BatchNorm in eval mode; L-MSA, LIFT and LISA do the same for the blocks that do not train): a
norm layer with running statistics (BatchNorm, InstanceNorm) runs in eval mode when nothing of
it can change -- none of its parameters trains, or, for a norm layer without parameters, its
block does not train -- so a frozen block's statistics stay exactly as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.layers import Layer

__all__ = ["NORM_EVAL", "NormLayer", "norm_layers", "set_norm_modes"]

#: ``frozen``: eval where nothing trains (the rule above); ``all``: every such norm layer in eval
#: (the surgical fine-tuning code's ``train_mode: eval``); ``none``: modes as Lightning sets them.
NORM_EVAL = ("frozen", "all", "none")
_RUNNING_STATS = (nn.modules.batchnorm._NormBase,)  # BatchNorm*, InstanceNorm*


@dataclass
class NormLayer:
    module: nn.Module
    params: list[nn.Parameter]
    block: str | None  # the block holding it (by its parameters, else by module), None outside blocks


def norm_layers(model: nn.Module, blocks: Sequence[Layer] = ()) -> list[NormLayer]:
    """Every norm layer with running statistics in ``model``, with the block it belongs to."""
    block_of_param = {id(p): b.name for b in blocks for p in b.params.values()}
    block_of_module: dict[int, str] = {}
    for b in blocks:
        for m in b.modules:
            for sub in m.modules():
                block_of_module.setdefault(id(sub), b.name)
    out = []
    for mod in model.modules():
        if not isinstance(mod, _RUNNING_STATS):
            continue
        params = list(mod.parameters(recurse=False))
        block = block_of_param.get(id(params[0])) if params else block_of_module.get(id(mod))
        out.append(NormLayer(mod, params, block))
    return out


def set_norm_modes(
    norms: Iterable[NormLayer],
    policy: str,
    training: bool,
    trains: Callable[[nn.Parameter], bool],
    live_blocks: set[str],
) -> None:
    """Put each norm layer in train mode iff the model trains and something of it can change
    (``trains(p)`` for its parameters, or its block in ``live_blocks`` when it has none)."""
    if policy not in NORM_EVAL:
        raise unknown("norm_eval", policy, NORM_EVAL)
    if policy == "none":
        return
    for n in norms:
        if policy == "all":
            live = False
        elif n.params:
            live = any(trains(p) for p in n.params)
        else:
            live = n.block in live_blocks
        want = training and live
        if n.module.training != want:
            n.module.train(want)
