"""Block schedules: LIFT and LISA (baselines of "L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)) -- which blocks
train changes every ``every_n_steps`` optimizer steps.

* ``lift`` -- LIFT (Zhu et al. 2023): one block trains at a time, the others are frozen; the
  block changes in the order ``front_to_end``, ``end_to_front`` or ``random`` (a fresh random
  permutation of all blocks per cycle of ``len(blocks)`` switches, drawn from ``(seed,
  cycle)``, so every block trains once per cycle).
* ``lisa`` -- LISA (Pan et al. 2024): the stem (embedding) and the head are always trainable;
  ``gamma`` of the middle blocks, sampled uniformly without replacement from ``(seed, switch
  index)``, train for ``every_n_steps`` optimizer steps, from step 0 on. The stem is kept
  separate (``join_stem=False``) in this schedule; the head holds everything after the last
  block (final norm included).

Every rank computes the same draw and rank zero's is the decision, so DDP ranks train the same
blocks; the switch index, selection and history are in ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

from torch import nn

from lalr_lightning.callbacks.base import Decision, deprecated_arg
from lalr_lightning.callbacks.host import Cadence, Host, say, warn
from lalr_lightning.callbacks.selection import LayerSelection, register_mode
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import describe_blocks, output_layer, suggest_blocks
from lalr_lightning.core.model.probe import forward_order
from lalr_lightning.core.runtime.checks import check_counts, reject_stray
from lalr_lightning.core.runtime.decision import history_table
from lalr_lightning.core.selection.surgical import LIFT_ORDERS, lisa_warnings, scheduled_blocks

__all__ = ["BlockSchedule", "SCHEDULES"]

SCHEDULES = ("lift", "lisa")


@dataclass(eq=False, repr=False)
class BlockSchedule(LayerSelection):
    """LIFT or LISA: the trained blocks change every ``every_n_steps`` optimizer steps.

    Example::

        >>> from lalr_lightning.callbacks import BlockSchedule, SurgicalLayerSelect
        >>> lisa = BlockSchedule(schedule="lisa", gamma=2, every_n_steps=20)   # LMFlow's LISA setting
        >>> lift = SurgicalLayerSelect(mode="lift", order="front_to_end", every_n_steps=1)
        >>> (type(lift).__name__, lift.schedule)
        ('BlockSchedule', 'lift')

    Args:
        schedule: ``lift`` or ``lisa`` (module docstring).
        every_n_steps: optimizer steps between switches (K). the L-MSA paper describes LIFT as one block
            per iteration (``every_n_steps=1``); LMFlow's LISA uses 20.
        order: ``lift`` only: ``front_to_end`` (default), ``end_to_front`` or ``random``.
        gamma: ``lisa`` only: middle blocks trained at a time (default 2).
        seed: seeds LIFT ``random`` and LISA draws.
        blocks, join_stem: how blocks are found (default ``join_stem``: yes for LIFT, no for
            LISA, whose stem is always trainable).
        norm_eval: norm layers of frozen blocks keep their statistics.
        save_compute: ``requires_grad`` follows the schedule, so the blocks that do not train
            get no weight gradient. Under DDP the switching blocks (LISA: the middle blocks;
            LIFT: every block, the smallest parameter staying in DDP) are kept out of DDP, so
            its gradient buckets hold only what always trains (LISA's stem and head), and their
            gradients are averaged across ranks by hand -- only the active blocks', once per
            optimizer step, before any hook or clipping reads them -- and broadcast from rank 0
            at fit start (``core.runtime.handsync``); ``setup`` sets ``find_unused_parameters=True``.
            ``static_graph=True`` and other multi-process strategies are refused: pass ``False``
            there, then every block stays in DDP and frozen blocks' gradients are computed,
            all-reduced and dropped before the step (DDP's buckets the whole model's size).
        optimizer_state: ``"release"`` (default): the optimizer state (AdamW's two moments and
            step count) of a block that stops training is freed, so the state never exceeds
            what trains now, and the block starts afresh when drawn again -- the paper's
            restart per interval, for the switched blocks; ``"keep"``: the state of every block
            ever trained is kept and resumed (LMFlow's LISA callback, step for step).
        name, strict_resume: as every callback of the package.
        switch_every: deprecated name of ``every_n_steps``.

    Readable: ``selected`` (block names), ``multipliers`` (block -> 1.0 / 0.0), ``history``
    (one entry per switch, the newest 1000). Logged: ``<prefix>/selected/<block>`` at every
    logging step, ``lr_eff/<layer>``, and a blocks x switches heatmap
    ``<prefix>/selection`` at fit end.
    """

    traits = LayerSelection.traits.but(
        log_prefix="surgical",
    )
    switches = True

    schedule: str = "lift"
    every_n_steps: int | None = None
    order: str | None = None
    gamma: int | None = None
    seed: int = 0
    blocks: Sequence[str | Sequence[str]] | None = None
    join_stem: bool | None = None
    norm_eval: str = "frozen"
    save_compute: bool = True
    optimizer_state: str = "release"
    _: KW_ONLY
    switch_every: int | None = deprecated_arg("every_n_steps")

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise unknown("schedule", self.schedule, SCHEDULES)
        if self.join_stem is None:  # LISA trains its stem always, apart from the blocks
            self.join_stem = self.schedule != "lisa"
        super().validate()
        reject_stray(type(self).__name__, "schedule", self.schedule, {"order": self.order, "gamma": self.gamma},
                    {"lift": ("order",), "lisa": ("gamma",)})
        self.every_n_steps = 20 if self.every_n_steps is None else self.every_n_steps
        self.order = "front_to_end" if self.order is None else self.order
        self.gamma = 2 if self.gamma is None else self.gamma
        if self.order not in LIFT_ORDERS:
            raise unknown("LIFT order", self.order, LIFT_ORDERS)
        check_counts({"every_n_steps (switch_every)": self.every_n_steps, "gamma": self.gamma})
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def title(self) -> str:
        return self.schedule.upper()

    def switching_units(self):
        """LIFT: every block; LISA: the middle blocks (its stem and head always train)."""
        if self.schedule == "lisa":
            return [b for b in self.layers if b.role == "block"]
        return list(self.layers)

    # ------------------------------------------------------------------ when

    def configure(self, host: Host, module: nn.Module) -> None:
        self.layers = self.find_blocks(module, host=host)
        say(f"{self.title} blocks of {type(module).__name__}: {describe_blocks(self.layers)}")
        if self.schedule == "lisa":  # errors for a LISA that cannot sample, warnings for one that cannot switch
            hint = f"e.g. blocks={suggest_blocks(module)!r}" if self.blocks is not None else ""
            out = output_layer(module, self.layers, forward_order(host, module, getattr(self, "loss_fn", None)))
            for line in lisa_warnings(self.layers, self.gamma, out, hint):
                warn(line)

    @property
    def cadence(self) -> Cadence:
        return Cadence(every_n_steps=self.every_n_steps)

    def after_wrap(self, host: Host) -> None:
        super().after_wrap(host)
        missing = [b.name for b in self.layers if any(id(p) not in self._held for p in b.params.values())]
        if missing:
            raise ValueError(
                f"{self.schedule.upper()} switches blocks on and off, so every block must be in the optimizer; "
                f"{missing} are not (the optimizer was built over the parameters that required grad: "
                "configure_optimizers filtered them, or a peft LoRA model keeps its base weights frozen); build it "
                f"over every parameter, or train the LoRA adapters without {self.schedule.upper()}"
            )

    # ------------------------------------------------------------------ what

    def measure(self, host: Host, module: nn.Module) -> int:
        """The switch index now."""
        return host.global_step // self.every_n_steps

    def decide(self, switch: int) -> Decision:
        chosen = scheduled_blocks(self.schedule, self.layers, switch, order=self.order, gamma=self.gamma,
                                  seed=self.seed)
        return Decision(values={b: float(b in chosen) for b in self.block_names}, record={"switch": switch})

    def heatmap_columns(self) -> list[str]:
        return [str(h["step"]) for h in self.history]

    def heatmap_values(self):
        names, values = history_table(self.history, self.traits.decision_attr)
        return names, values[:, -200:]  # a readable width; the full history is in state_dict

    # ------------------------------------------------------------------ state

    def _state(self) -> dict:  # the latest switch index (the history has every one)
        return {"switch": self.history[-1].get("switch") if self.history else None}


register_mode("lift", BlockSchedule, schedule="lift")
register_mode("lisa", BlockSchedule, schedule="lisa")
