"""Removing whole decoder blocks (``prune --remove-blocks K``): the checks of its arguments, the
stored keys' renumbering, the kept blocks as a checkpoint of their own, and what the cut model's
config and ``pruning.json`` record. The scores and the choice are :mod:`lalr_lightning.core.pruning.depth`;
the streamed pass that writes the kept blocks is :mod:`lalr_lightning.oneshot.prune`'s."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from lalr_lightning.oneshot.checkpoint import _Streamed

__all__ = ["Kept", "block_key_test", "check_depth_args", "depth_record", "renamer", "write_cut_config"]


def check_depth_args(remove_blocks, block_criterion, in_memory, sparsity, criterion, n, m, recipe,
                      blocksize, percdamp) -> bool:
    """Whether the prune removes blocks (``--remove-blocks``), its arguments checked before any file is
    read; the pruning flags that need ``--sparsity`` or ``--n``/``--m`` refused without them."""
    if remove_blocks is None and block_criterion is None:
        return False
    from lalr_lightning.core.pruning.depth import check_block_criterion, check_remove_blocks

    if remove_blocks is None:
        raise ValueError(f"--block-criterion {block_criterion} chooses the blocks --remove-blocks K removes; add "
                         "--remove-blocks K")
    check_remove_blocks(remove_blocks, None)
    if block_criterion is None:
        raise ValueError("--remove-blocks needs --block-criterion: angular, influence, alpha or last (how the blocks "
                         "to remove are chosen; docs/llm_pruning.md)")
    check_block_criterion(block_criterion)
    if in_memory:
        raise ValueError("--remove-blocks streams the checkpoint block by block; --in-memory does not apply: leave "
                         "it out")
    if sparsity is None and not m and not n and recipe.ratios is None:
        given = [flag for flag, v in (("--criterion", criterion), ("--preset", recipe.preset),
                                      ("--metric", recipe.metric), ("--epsilon", recipe.epsilon),
                                      ("--owl-m", recipe.owl_m), ("--owl-lambda", recipe.owl_lambda),
                                      ("--blocksize", blocksize), ("--percdamp", percdamp)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} prune the kept blocks' weights, which --remove-blocks alone copies "
                             f"as they are: add --sparsity S (or --n N --m M) to prune them too, or leave "
                             f"{given[0]} out")
    return True


def block_key_test(sm):
    """``key -> bool``: whether a stored key belongs to a decoder block (any, removed or kept)."""
    pre = sm.key(sm.path) + "."
    return lambda k: k.startswith(pre) and k[len(pre):].split(".", 1)[0].isdigit()


def renamer(sm, kept: list[int]):
    """A stored key's name in the cut model: a kept block's renumbered, a removed block's None."""
    pre = sm.key(sm.path) + "."
    index = {old: new for new, old in enumerate(kept)}
    in_blocks = block_key_test(sm)

    def rename(k: str) -> str | None:
        if not in_blocks(k):
            return k
        head, _, rest = k[len(pre):].partition(".")
        new = index.get(int(head))
        return None if new is None else f"{pre}{new}.{rest}"

    return rename


class Kept:
    """The kept blocks of a :class:`_Streamed` as if they were its only ones (``blocks[j]`` is dense
    block ``kept[j]``); its stored keys are renamed to the new indices by :attr:`rename`."""

    def __init__(self, sm: _Streamed, kept: list[int]):
        self._sm, self.kept = sm, list(kept)
        self.blocks = nn.ModuleList([sm.blocks[i] for i in self.kept])
        self.rename = renamer(sm, self.kept)

    def __getattr__(self, name):
        return getattr(self._sm, name)

    def dense_index(self, j: int) -> int:
        return self.kept[j]

    def block(self, j: int) -> nn.Module:
        return self._sm.block(self.kept[j])

    def free(self, j: int) -> None:
        self._sm.free(self.kept[j])

    def block_keys(self, j: int) -> list[str]:
        return self._sm.block_keys(self.kept[j])


def write_cut_config(model_dir: Path, tmp: Path, kept: list[int], n_blocks: int) -> None:
    from lalr_lightning.core.pruning.depth import cut_config

    config = json.loads((model_dir / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(cut_config(config, kept, n_blocks), indent=2) + "\n")


def depth_record(report, kept: list[int], k: int) -> dict:
    """What pruning.json records of a block removal."""
    return {"remove_blocks": k, "block_criterion": report.block_criterion, "removed_blocks": report.removed_blocks,
            "kept_blocks": kept, "block_scores": report.block_scores, "blocks_before": len(report.block_scores),
            "blocks_after": len(kept)}
