"""Surgical fine-tuning (Lee et al. 2022; a baseline of "L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)): train a
fixed choice of blocks, freeze the rest.

The reported pattern: the first block for input-level shifts (CIFAR-10-C, ImageNet-C), middle
blocks for feature-level shifts (Living-17), the last layer for output-level shifts
(CIFAR-Flip). The other selection methods of the paper's baselines are
:class:`~lalr_lightning.callbacks.autorgn.AutoRGN` and
:class:`~lalr_lightning.callbacks.schedule.BlockSchedule` (LIFT, LISA); ``SurgicalLayerSelect``
builds any of them by ``mode``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lalr_lightning.callbacks.base import Decision
from lalr_lightning.callbacks.host import Host, say, warn
from lalr_lightning.callbacks.selection import LayerSelection, SurgicalLayerSelect, register_mode
from lalr_lightning.core.model.blocks import describe_blocks
from lalr_lightning.core.selection.surgical import check_selection, select_blocks

__all__ = ["SurgicalBlocks", "SurgicalLayerSelect"]


@dataclass(eq=False, repr=False)
class SurgicalBlocks(LayerSelection):
    """Train the chosen blocks only.

    Example::

        >>> from lalr_lightning.callbacks import SurgicalBlocks, SurgicalLayerSelect
        >>> first = SurgicalBlocks(select="first")       # conv1 + the first stage (surgical fine-tuning)
        >>> head = SurgicalLayerSelect(mode="blocks", select="last")
        >>> type(head).__name__
        'SurgicalBlocks'

    Args:
        select: ``"first"``, ``"last"``, ``"all"``, ``"block:N"`` or an int ``N`` (index into the
            block list, negative from the end), a block name or a glob pattern over block names
            (``"*layer3*"``), or a list of those.
        blocks: block patterns for :func:`~lalr_lightning.core.model.blocks.block_layers` (module-name
            prefixes or ``^``-regexes, one per block); default: the model's own blocks.
        join_stem: join the stem to the first block (surgical fine-tuning's ``conv1+block1``).
        norm_eval: ``frozen`` (default: norm layers of frozen blocks keep their running
            statistics), ``all`` or ``none`` (:mod:`lalr_lightning.core.model.norm_modes`).
        save_compute: also set ``requires_grad=False`` on the frozen blocks in ``setup``, before
            the model is wrapped (safe under DDP; given back at teardown).
        name, strict_resume: as every callback of the package.

    Readable: ``selected`` (block names), ``multipliers`` (block -> 1.0 / 0.0), ``block_names``.
    """

    traits = LayerSelection.traits.but(
        log_prefix="surgical",
        logs_lr=True,
        lazy_ok=True,  # it freezes blocks by name and measures nothing: a lazy layer is shaped by the first step
    )
    title = "surgical"

    select: str | int | Sequence[str | int] = "first"
    blocks: Sequence[str | Sequence[str]] | None = None
    join_stem: bool = True
    norm_eval: str = "frozen"
    save_compute: bool = True

    def validate(self) -> None:
        super().validate()
        check_selection(self.select)

    def configure(self, host: Host, module: nn.Module) -> None:
        self.layers = self.find_blocks(module, host=host)
        self._chosen = select_blocks(self.select, self.block_names)
        say(f"surgical blocks of {type(module).__name__}: {describe_blocks(self.layers)}; "
                       f"select={self.select!r} trains {', '.join(self._chosen)}")
        if self.select != "all" and set(self._chosen) == set(self.block_names):
            warn(f"SurgicalBlocks(select={self.select!r}) selects every block ({self.block_names}), so "
                           "nothing is frozen; select fewer blocks, or split the model with blocks=[...]")

    def decide_in_setup(self, host: Host, module: nn.Module) -> Decision:
        """The configured blocks (the settings check makes sure a checkpoint holds the same)."""
        return self.decide(self._chosen)

    def decide(self, chosen: list[str]) -> Decision:
        return Decision(values={b: float(b in chosen) for b in self.block_names})


register_mode("blocks", SurgicalBlocks)
