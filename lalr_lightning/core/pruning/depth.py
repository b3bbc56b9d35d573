"""Depth pruning: which whole decoder blocks to remove, and the config of the cut model.

Four block criteria (``prune --remove-blocks K --block-criterion ...``):

* ``influence`` -- ShortGPT's Block Influence (Men et al. 2024): ``BI_i = 1 - mean_t cos(x_i,t, y_i,t)``
  over every calibration token ``t``, ``x_i`` the block's input and ``y_i`` its output (the residual
  stream); the ``K`` blocks of lowest BI change the stream least and are removed. One pass over the
  dense model: the scores are not recomputed after a removal, as in the paper.
* ``angular`` -- Gromov et al. 2024 ("The Unreasonable Ineffectiveness of the Deeper Layers"):
  ``d(l, l + n) = arccos(cos(h_l, h_{l+n})) / pi`` between the input of block ``l`` and the input of
  block ``l + n``, at each sample's last token, averaged over the samples; with ``n = K`` the run
  ``l*, ..., l* + K - 1`` of smallest ``d`` is removed. The input of "block ``L``" (a run that ends at
  the last block) is the last block's output *before* the final norm: every ``d`` compares two states
  of the residual stream, on the same footing (Hugging Face's ``output_hidden_states[-1]`` applies the
  final norm, whose per-channel weights would change the cosine of that one run only).
* ``alpha`` -- the package's HT-SR reading, no data: a block's score is the mean power-law exponent
  alpha of its linear matrices (AlphaPruning's fit); the ``K`` blocks of *highest* mean alpha are
  removed. A heavy-tailed spectrum (small alpha) is what training leaves in a matrix that learned
  correlations; alpha grows toward the random-matrix values (above ~6, WeightWatcher's
  "under-trained") in a matrix that learned little, so AlphaPruning prunes high-alpha layers most
  and this criterion drops the least-trained blocks first.
* ``last`` -- Gromov et al.'s simple baseline: the ``K`` deepest blocks *before the final one*
  (``L-1-K ... L-2``); the final block, the one that maps onto the head, stays.

Pure PyTorch; the streamed pass takes ``materialize`` / ``release`` functions as
``calibration.run_blocks`` does, so only one block's weights are in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from lalr_lightning import progress
from lalr_lightning.choices import BLOCK_CRITERIA, unknown

__all__ = [
    "BLOCK_CRITERIA",
    "DATA_CRITERIA",
    "angular_distances",
    "check_remove_blocks",
    "choose_removed",
    "cut_config",
    "last_token_states",
    "score_pass",
    "seam_blocks",
    "token_cosines",
]

#: the criteria that read calibration activations
DATA_CRITERIA = ("angular", "influence")

# config keys that hold one entry per decoder block, cut to the kept blocks (any other top-level list
# of num_hidden_layers entries is cut too, but for the keys below, which are never per block)
_NOT_PER_BLOCK = {"architectures", "eos_token_id", "bos_token_id", "pad_token_id", "bad_words_ids", "suppress_tokens",
                  "begin_suppress_tokens", "forced_decoder_ids", "id2label", "label2id", "task_specific_params"}
# lists of block *indices* (renumbered, the removed ones dropped)
_INDEX_LISTS = ("mlp_only_layers", "moe_layers", "full_attn_idxs", "attn_layer_indices")
# counts of the first blocks with a property (the kept blocks among them)
_PREFIX_COUNTS = ("max_window_layers", "first_k_dense_replace")
# what holds the number of blocks, by family
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def check_remove_blocks(k, n_blocks: int) -> int:
    """``--remove-blocks K``: an integer in ``[1, n_blocks - 1]`` (one block at least must stay)."""
    try:
        ok = not isinstance(k, bool) and float(k) == int(float(k))
    except (TypeError, ValueError, OverflowError):  # "two", None, "nan", "inf"
        ok = False
    if not ok or int(float(k)) < 1:
        raise ValueError(f"--remove-blocks must be an integer >= 1 (the number of decoder blocks to remove), got {k}")
    k = int(float(k))
    if n_blocks is not None and k >= n_blocks:
        raise ValueError(f"--remove-blocks {k}: the model has {n_blocks} decoder blocks; remove at most {n_blocks - 1} "
                         "(one block at least must stay)")
    return k


def check_block_criterion(criterion: str) -> str:
    if criterion not in BLOCK_CRITERIA:
        raise unknown("--block-criterion", criterion, BLOCK_CRITERIA)
    return criterion


# ----------------------------------------------------------------------------- the measures


def token_cosines(x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The cosine of ``x`` and ``y`` (``(b, seq, hidden)``) at every real token (``tokens``: ``(b, seq)``
    bool, None: all), flattened; in float32. A zero vector has cosine 0 with anything (``F.cosine_similarity``'s
    epsilon)."""
    cos = torch.nn.functional.cosine_similarity(x.float(), y.float(), dim=-1, eps=1e-12)
    return cos.reshape(-1) if tokens is None else cos[tokens]


def last_token_states(h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Each sample's hidden state at its last real token, ``(b, hidden)`` float32 (right padding)."""
    if tokens is None:
        return h[:, -1].float()
    last = tokens.long().cumsum(1).argmax(1)  # the last True of each row
    return h[torch.arange(h.shape[0], device=h.device), last].float()


def angular_distances(states: Sequence[torch.Tensor], n: int) -> list[float]:
    """Gromov et al.'s ``d(l, l + n)`` for every ``l`` in ``[0, len(states) - 1 - n]``: ``states[l]`` the
    ``(samples, hidden)`` input of block ``l`` at the last token (``states[L]``: the last block's output),
    ``arccos(cos) / pi`` per sample, averaged over the samples."""
    out = []
    for l in range(len(states) - n):  # noqa: E741 -- the paper's l
        cos = torch.nn.functional.cosine_similarity(states[l], states[l + n], dim=-1, eps=1e-12)
        out.append(float(torch.arccos(cos.clamp(-1.0, 1.0)).mean() / math.pi))
    return out


def _run(block: nn.Module, hidden: torch.Tensor, batch) -> torch.Tensor:
    out = block(hidden, *batch.args, **batch.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def score_pass(n_blocks: int, inputs: list, materialize: Callable[[int], nn.Module],
               release: Callable[[int, nn.Module], None] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """One pass of the calibration batches (``calibration.BlockBatch`` list, the first block's inputs,
    replaced in place by each block's outputs) through the dense blocks: every block's Block Influence
    and the last-token states ``h_0 ... h_L`` (the angular distance's)."""
    cos_sum = [0.0] * n_blocks
    count = [0] * n_blocks
    states: list[list[torch.Tensor]] = [[] for _ in range(n_blocks + 1)]
    for i in progress.bar(range(n_blocks), desc="scoring blocks", unit="block"):
        block = materialize(i)
        was_training = block.training
        block.eval()
        for j, batch in enumerate(inputs):
            out = _run(block, batch.hidden, batch)
            c = token_cosines(batch.hidden, out, batch.tokens)
            cos_sum[i] += float(c.double().sum())
            count[i] += c.numel()
            states[i].append(last_token_states(batch.hidden, batch.tokens).cpu())
            if i == n_blocks - 1:
                states[n_blocks].append(last_token_states(out, batch.tokens).cpu())
            inputs[j] = replace(batch, hidden=out)
            del batch
        block.train(was_training)
        if release is not None:
            release(i, block)
    influence = [1.0 - s / max(c, 1) for s, c in zip(cos_sum, count)]
    return influence, [torch.cat(s) for s in states]


def choose_removed(criterion: str, scores: Sequence[float | None], k: int, n_blocks: int) -> list[int]:
    """The dense indices of the ``k`` blocks to remove, sorted (module docstring): ``influence`` the
    lowest scores, ``alpha`` the highest, ``angular`` the run starting at the smallest ``d`` (``scores[l]``
    for ``l <= n_blocks - k``), ``last`` blocks ``n_blocks-1-k ... n_blocks-2``. Ties go to the
    earlier block."""
    check_block_criterion(criterion)
    k = check_remove_blocks(k, n_blocks)
    if criterion == "last":
        return list(range(n_blocks - 1 - k, n_blocks - 1))
    if criterion == "angular":
        runs = [(s, start) for start, s in enumerate(scores[: n_blocks - k + 1])]
        start = min(runs)[1]
        return list(range(start, start + k))
    sign = 1.0 if criterion == "influence" else -1.0
    order = sorted(range(n_blocks), key=lambda i: (sign * scores[i], i))
    return sorted(order[:k])


def seam_blocks(removed: Sequence[int], n_blocks: int) -> list[int]:
    """The cut model's blocks next to a cut (its new indices): for each run of removed blocks, the kept
    block before it and the one after it, where they exist -- the blocks a surgical heal trains."""
    removed_set = set(removed)
    kept = [i for i in range(n_blocks) if i not in removed_set]
    new = {old: j for j, old in enumerate(kept)}
    out = set()
    for i in removed_set:
        if i - 1 in new:
            out.add(new[i - 1])
        if i + 1 in new:
            out.add(new[i + 1])
    return sorted(out)


# ----------------------------------------------------------------------------- the cut config


def cut_config(config: dict, kept: Sequence[int], n_blocks: int) -> dict:
    """``config.json``'s dict for the model of the ``kept`` dense blocks (in order): the block count,
    every top-level list with one entry per block (``layer_types``, per-block sliding windows or head
    counts, ``no_rope_layers``, ...) cut to the kept entries, lists of block indices renumbered, and
    counts of leading blocks (``max_window_layers``) counted again among the kept ones."""
    kept = list(kept)
    new_index = {old: new for new, old in enumerate(kept)}
    out = dict(config)
    found = [key for key in _DEPTH_KEYS if out.get(key) == n_blocks]
    if not found:
        raise ValueError(f"config.json has no block count equal to the model's {n_blocks} blocks "
                         f"({', '.join(_DEPTH_KEYS)}); cannot write the cut model's config")
    for key in found:
        out[key] = len(kept)
    for key, value in config.items():
        if key in _INDEX_LISTS and isinstance(value, list):
            out[key] = [new_index[i] for i in value if isinstance(i, int) and i in new_index]
        elif key in _PREFIX_COUNTS and isinstance(value, int) and not isinstance(value, bool):
            out[key] = sum(1 for i in kept if i < value)
        elif isinstance(value, list) and len(value) == n_blocks and key not in _NOT_PER_BLOCK:
            out[key] = [value[i] for i in kept]
    return out
