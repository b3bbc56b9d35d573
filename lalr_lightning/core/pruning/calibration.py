"""Block-by-block calibration of a Hugging Face causal LM, as Wanda and SparseGPT prune it.

The model is run on the calibration batches only up to its first transformer block, whose inputs
are captured (the hidden states, and the arguments the model passes to every block: attention
mask, position ids, rotary position embeddings). Then, for each block in order:

1. its linear layers are hooked and the block is run on the captured inputs, accumulating an
   :class:`~lalr_lightning.core.pruning.criteria.InputStats` per layer (skipped when no criterion
   needs them, e.g. magnitude);
2. ``prune_block(index, block, stats)`` prunes it (the caller's function);
3. the *pruned* block is run again, and its outputs become the next block's inputs -- so every
   block is calibrated on what the already-pruned blocks before it produce (AlphaPruning's
   ``prune_wanda`` / ``prune_sparsegpt``, after Wanda's and SparseGPT's own code).

``materialize(index)`` / ``release(index, block)`` let a caller that streams the weights from disk
build a block just before step 1 and free it after step 3, so only one block's weights and the
calibration activations are in memory (``lalr_lightning/oneshot/prune.py``).

API (pure PyTorch; ``transformers`` is only touched through the model object):

* :func:`decoder_blocks` ``(model)`` -> ``(path, ModuleList)``: ``model.layers`` (LLaMA family),
  ``model.decoder.layers`` (OPT), ``transformer.h`` (GPT-2), ``gpt_neox.layers``.
* :func:`linear_modules` ``(block)`` -> ``{name: module}``: its ``nn.Linear`` and GPT-2 ``Conv1D``
  modules in registration order (AlphaPruning's ``find_layers``).
* :func:`weight_matrix` / :func:`set_weight_matrix`: a layer's weight as ``(out, in)``.
* :func:`capture_block_inputs` ``(model, batches, *, device=None)`` -> ``list[BlockBatch]``.
* :func:`run_blocks` ``(blocks, inputs, prune_block, *, stats=True, hessian=False,
  materialize=None, release=None)`` -> the last block's outputs as ``list[BlockBatch]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from lalr_lightning import progress
from lalr_lightning.core.pruning.criteria import InputStats

__all__ = [
    "BLOCK_PATHS",
    "BlockBatch",
    "decoder_blocks",
    "linear_modules",
    "weight_matrix",
    "set_weight_matrix",
    "capture_block_inputs",
    "run_blocks",
]

#: Where the transformer blocks of the supported causal-LM families live.
BLOCK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")


@dataclass
class BlockBatch:
    """One calibration batch at a block's input: the hidden states ``(b, seq, hidden)``, the other
    positional and keyword arguments the model passes to its blocks, and which tokens are real
    (``(b, seq)`` bool, None: all; padding does not count in the statistics)."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict
    tokens: torch.Tensor | None = None


def _get(model: nn.Module, path: str):
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's transformer blocks and their attribute path (:data:`BLOCK_PATHS`)."""
    for path in BLOCK_PATHS:
        blocks = _get(model, path)
        if isinstance(blocks, nn.ModuleList) and len(blocks):
            return path, blocks
    raise ValueError(
        f"{type(model).__name__} has none of the block lists {', '.join(BLOCK_PATHS)}; block-by-block calibration "
        "supports Hugging Face causal LMs of the LLaMA, OPT, GPT-2 and GPT-NeoX layouts"
    )


def _is_linear(module: nn.Module) -> bool:
    # Hugging Face's GPT-2 Conv1D is matched by name so that transformers stays optional
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None)


def linear_modules(block: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of a block, ``{relative name: module}``, in registration order."""
    return {name: mod for name, mod in block.named_modules() if name and _is_linear(mod)}


def weight_matrix(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``(out, in)`` (a GPT-2 ``Conv1D`` stores ``(in, out)``: its transpose)."""
    w = module.weight
    return w.T if type(module).__name__ == "Conv1D" else w


def set_weight_matrix(module: nn.Module, weight: torch.Tensor) -> None:
    """Write an ``(out, in)`` matrix into the layer's weight, in place (its dtype and layout)."""
    target = module.weight
    value = weight.T if type(module).__name__ == "Conv1D" else weight
    with torch.no_grad():
        target.copy_(value.to(target.dtype))


class _Captured(Exception):
    """Raised by the hook on the first block: the rest of the model is not run."""


def _strip_cache(value):
    # the KV cache is not a property of the batch; blocks run without one
    name = type(value).__name__
    return None if name.endswith("Cache") else value


def _model_inputs(batch, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)):
        ids, mask = batch[0], None
    else:
        ids, mask = batch, None
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ValueError("calibration batches must hold input_ids of shape (batch, seq_len)")
    return ids.to(device), None if mask is None else mask.to(device)


def _check_uniform_attention(model: nn.Module) -> None:
    types = getattr(getattr(model, "config", None), "layer_types", None)
    if types and len(set(types)) > 1:
        raise ValueError(
            f"{type(model).__name__} mixes attention types across blocks ({sorted(set(types))}): each block needs its own "
            "mask, which block-by-block calibration from the first block's inputs does not capture"
        )


@torch.no_grad()
def capture_block_inputs(model: nn.Module, batches: Iterable, *, device=None) -> list[BlockBatch]:
    """Run ``model`` on each batch (``input_ids`` tensors, ``(ids, ...)`` tuples or dicts with
    ``input_ids`` and optionally ``attention_mask``) up to its first block and return that
    block's inputs. The blocks themselves never run (they may still be on the meta device)."""
    _check_uniform_attention(model)
    _, blocks = decoder_blocks(model)
    if device is None:
        device = next(p.device for p in model.parameters() if p.device.type != "meta")
    seen: dict = {}

    def grab(_module, args, kwargs):
        if args:
            hidden, rest = args[0], tuple(_strip_cache(a) for a in args[1:])
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        seen["batch"] = BlockBatch(hidden, rest, {k: _strip_cache(v) for k, v in kwargs.items()})
        raise _Captured

    handle = blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    out: list[BlockBatch] = []
    try:
        for batch in batches:
            ids, mask = _model_inputs(batch, device)
            seen.clear()
            try:
                model(input_ids=ids, attention_mask=mask, use_cache=False)
            except _Captured:
                pass
            if "batch" not in seen:
                raise RuntimeError(f"{type(model).__name__} did not call its first block")
            tokens = None if mask is None or bool(mask.all()) else mask.bool()
            out.append(replace(seen["batch"], tokens=tokens))
    finally:
        handle.remove()
    if not out:
        raise ValueError("no calibration batches: give at least one sequence")
    return out


def _run(block: nn.Module, batch: BlockBatch) -> torch.Tensor:
    out = block(batch.hidden, *batch.args, **batch.kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _recorder(stats: InputStats, state: dict):
    """A forward pre-hook adding a layer's inputs to ``stats``; ``state`` holds the current batch's
    token mask and sequence count."""

    def record(_module, args):
        # samples = the batch's sequences, whatever shape the layer sees (OPT flattens the
        # tokens before its MLP)
        x, tokens = args[0], state["tokens"]
        if tokens is not None and x.shape[:-1] == tokens.shape:
            x = x[tokens]
        elif tokens is not None:
            x = x.reshape(-1, x.shape[-1])[tokens.reshape(-1)]
        stats.add(x, samples=state["samples"])

    return record


@torch.no_grad()
def run_blocks(
    blocks: Sequence[nn.Module] | int,
    inputs: list[BlockBatch],
    prune_block: Callable[[int, nn.Module, dict[str, InputStats] | None], None],
    *,
    stats: bool = True,
    hessian: bool = False,
    stats_dtype: torch.dtype = torch.float32,
    materialize: Callable[[int], nn.Module] | None = None,
    release: Callable[[int, nn.Module], None] | None = None,
) -> list[BlockBatch]:
    """Calibrate and prune the blocks in order (module docstring); returns the inputs the block
    after the last would see.

    ``inputs`` is updated in place: each batch is replaced by the block's output as soon as it is
    computed, so the calibration activations are held once (the largest memory of a streamed
    prune), not as inputs and outputs side by side. Pass a copy (``list(inputs)``) to keep them.
    Activations stay in the dtype the model computes in.

    ``blocks``: the block modules, or their number when ``materialize`` builds each one.
    ``stats``: collect :class:`InputStats` of every linear layer (``hessian``: also ``X^T X``,
    for SparseGPT); ``False`` gives ``prune_block`` None and skips the first pass. Blocks run in
    eval mode (no dropout) and are put back in their previous mode.
    """
    n_blocks = blocks if isinstance(blocks, int) else len(blocks)
    if materialize is None:
        if isinstance(blocks, int):
            raise ValueError("run_blocks needs the block modules or a materialize function")
        materialize = blocks.__getitem__
    current = inputs
    # a bar with rate and ETA on a terminal only (lalr_lightning.progress)
    for index in progress.bar(range(n_blocks), desc="calibrating blocks" if stats else "pruning blocks", unit="block"):
        block = materialize(index)
        was_training = block.training
        block.eval()
        collected = None
        if stats:
            layers = linear_modules(block)
            collected = {
                name: InputStats(weight_matrix(mod).shape[1], hessian=hessian, dtype=stats_dtype,
                                 device=weight_matrix(mod).device, name=f"block {index}'s {name}")
                for name, mod in layers.items()
            }
            state: dict = {}
            handles = [mod.register_forward_pre_hook(_recorder(collected[name], state)) for name, mod in layers.items()]
            try:
                for batch in current:
                    state["tokens"], state["samples"] = batch.tokens, batch.hidden.shape[0]
                    _run(block, batch)
            finally:
                for h in handles:
                    h.remove()
        prune_block(index, block, collected)
        del collected
        for j, batch in enumerate(current):  # each output replaces its input at once: one copy in memory
            current[j] = replace(batch, hidden=_run(block, batch))
            del batch
        block.train(was_training)
        if release is not None:
            release(index, block)
    return current
