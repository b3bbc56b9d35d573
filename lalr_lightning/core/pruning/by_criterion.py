"""Prune a model's chosen layers by a criterion at given per-layer ratios (pure PyTorch).

The glue between the per-layer ratios of :mod:`lalr_lightning.core.pruning.alphapruning` (what
``HTSRPruning`` decides) and the criteria of :mod:`lalr_lightning.core.pruning.criteria`:

* ``magnitude`` needs no data (``criterion_prune`` is only used for it with N:M; unstructured
  magnitude stays :func:`lalr_lightning.core.pruning.alphapruning.layer_masks`).
* ``wanda`` and ``sparsegpt`` need each layer's calibration inputs. In a Hugging Face causal LM
  (:func:`find_causal_lm`) they are taken block by block in the order the model runs its blocks
  (:func:`lalr_lightning.core.pruning.calibration.run_blocks`): each block is calibrated on what the
  already-pruned blocks before it produce, as Wanda's and SparseGPT's own code. In any other
  model (no transformer blocks) every pruned layer must be a ``Linear`` -- or, with
  ``convolutions=True``, a ``Conv2d`` (``groups=1``), pruned as its ``(out, in x kh x kw)``
  matrix against its unfolded inputs (``F.unfold``: every patch a row; SparseGPT's reference
  treats convolutions so); the inputs are recorded in one pass of ``forward`` over the
  calibration batches on the dense model, then every layer is pruned -- there is no block
  order to follow.

The layers are pruned in place (weights set to zero; SparseGPT also updates the kept weights),
and the keep-masks are returned in the parameters' own layout, keyed by parameter name, ready for
``LayerControl.set_masks``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from lalr_lightning.core.model.batch_loss import call_model, split_batch, step_loss
from lalr_lightning.core.model.layers import Layer, inside_attention
from lalr_lightning.core.model.probe import take
from lalr_lightning.core.pruning.calibration import (
    capture_block_inputs,
    decoder_blocks,
    run_blocks,
    set_weight_matrix,
    weight_matrix,
)
from lalr_lightning.core.pruning.criteria import InputStats, check_nm, needs_stats, prune_weight

__all__ = ["LINEAR_KINDS", "take_samples", "sample_count", "calibration_samples", "find_causal_lm", "weight_name", "criterion_prune",
           "load_weights", "readable_layers", "calibration_forward"]

#: layer kinds the row-wise criteria (Wanda, SparseGPT, N:M) prune: ``(out, in)`` matrices
LINEAR_KINDS = ("linear", "hf_conv1d")


def _rows(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return _rows(next(v for v in batch.values() if isinstance(v, torch.Tensor)))
    if isinstance(batch, (tuple, list)):
        return _rows(batch[0])
    raise ValueError(f"calibration batches must be tensors, tuples/lists or dicts of tensors, got {type(batch).__name__}")


def take_samples(batches: Iterable, n: int) -> list:
    """The first ``n`` samples (sequences) of ``batches``, as batches (the last one cut short)."""
    if int(n) < 1:
        raise ValueError(f"the number of calibration samples must be >= 1, got {n}")
    out, have = [], 0
    for batch in batches:
        rows = _rows(batch)
        if have + rows > n:
            batch, rows = take(batch, n - have), n - have
        out.append(batch)
        have += rows
        if have >= n:
            break
    return out


def sample_count(batches: Iterable) -> int:
    """The number of samples (rows) in ``batches``."""
    return sum(_rows(b) for b in batches)


def calibration_samples(given: Iterable | None, loader: Callable[[], Iterable | None] | None, n: int,
                        who: str) -> list:
    """The first ``n`` samples of the calibration data: ``given``, else the fit's training loader
    (``loader()``; ``loader`` None: there is no fit, as in ``plan()``); a warning when there are fewer."""
    if given is None:
        if loader is None:
            raise ValueError(f"HTSRPruning({who}) decides from calibration data, and plan() has no fit to take it "
                             "from; pass calibration=<a DataLoader> to HTSRPruning")
        given = loader()
        if given is None:
            raise ValueError(f"HTSRPruning({who}) needs calibration data: the fit has no training loader; pass "
                             "calibration=<a DataLoader>")
    batches = take_samples(given, n)
    got = sample_count(batches)
    if got < n:
        warnings.warn(f"HTSRPruning({who}) calibrates on {got} samples, all the calibration data has; "
                      f"n_calibration={n} asked for more", UserWarning, stacklevel=3)
    return batches


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The outermost module of ``model`` (itself included) that is a Hugging Face model with
    transformer blocks (:func:`~lalr_lightning.core.pruning.calibration.decoder_blocks`), or None."""
    for mod in model.modules():
        if getattr(mod, "config", None) is None:
            continue
        try:
            decoder_blocks(mod)
        except ValueError:
            continue
        return mod
    return None


def weight_name(layer: Layer) -> str:
    """The name of the layer's weight among its parameters (the key of its mask)."""
    return next(n for n, p in layer.params.items() if p is layer.weight)


def _unfolds(layer: Layer) -> bool:
    """A convolution the row-wise criteria prune through its unfolded inputs."""
    mod = layer.module
    return isinstance(mod, nn.Conv2d) and mod.groups == 1 and mod.padding_mode == "zeros" \
        and not isinstance(mod.padding, str)


def _matrix(mod: nn.Module) -> torch.Tensor:
    return mod.weight.reshape(mod.weight.shape[0], -1) if isinstance(mod, nn.Conv2d) else weight_matrix(mod)


def _set_matrix(mod: nn.Module, new: torch.Tensor) -> None:
    if isinstance(mod, nn.Conv2d):
        with torch.no_grad():
            mod.weight.copy_(new.reshape(mod.weight.shape).to(mod.weight.dtype))
    else:
        set_weight_matrix(mod, new)


def _unfolded(mod: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The conv's input patches as rows ``(batch x positions, in x kh x kw)``, ordered as the
    weight's flattened columns."""
    cols = torch.nn.functional.unfold(x, mod.kernel_size, dilation=mod.dilation, padding=mod.padding,
                                      stride=mod.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _check_layers(layers: Sequence[Layer], criterion: str, m: int, convolutions: bool = False) -> None:
    if convolutions and not m:
        grouped = [f"{la.name} (groups={la.module.groups})" for la in layers
                   if la.kind == "conv2d" and not _unfolds(la) and getattr(la.module, "groups", 1) != 1]
        if grouped:
            raise ValueError(
                f"criterion={criterion!r} prunes a convolution as its (out, in x kh x kw) matrix against its unfolded "
                f"inputs, which grouped convolutions do not have: {', '.join(grouped[:5])}; prune by magnitude "
                "(criterion='magnitude'), or leave the convolutions dense with layer_types=('linear',)"
            )
    bad = [f"{la.name} ({la.kind})" for la in layers
           if la.kind not in LINEAR_KINDS and not (convolutions and not m and _unfolds(la))]
    if bad:
        what = f"criterion={criterion!r}" if not m else "N:M sparsity"
        linear = [la.name for la in layers if la.kind in LINEAR_KINDS]
        # where layer_types=('linear',) leads, said now: the Linear layers not among ``layers`` were
        # left out as the output layer (head=False) or as too small
        then = (f"prunes only {', '.join(linear[:5])}" if linear else
                "prunes none of these: any Linear layer this model has is the output layer, pruned only with "
                "head=True, or below min_numel / min_evals")
        raise ValueError(
            f"{what} prunes the rows of Linear layers; these prunable layers are not Linear: {', '.join(bad[:5])}; "
            f"use criterion='magnitude' without n/m, or layer_types=('linear',) (which {then})"
        )


def _prune_one(layer: Layer, ratio: float, criterion: str, stats: InputStats | None, n: int, m: int,
               blocksize: int, percdamp: float) -> torch.Tensor:
    """Prune one layer in place; its keep-mask in the weight's own layout."""
    mod = layer.module
    w = _matrix(mod)
    try:
        new, keep = prune_weight(w, criterion, ratio, stats, n=n, m=m, blocksize=blocksize, percdamp=percdamp)
    except ValueError as err:
        raise ValueError(f"layer {layer.name}: {err}") from None
    _set_matrix(mod, new)
    if isinstance(mod, nn.Conv2d):
        return keep.reshape(mod.weight.shape).cpu()
    return (keep.T if w is not mod.weight else keep).cpu()


@torch.no_grad()
def criterion_prune(
    model: nn.Module,
    layers: Sequence[Layer],
    ratios: Mapping[str, float],
    criterion: str,
    batches: Sequence | None = None,
    *,
    n: int = 0,
    m: int = 0,
    blocksize: int = 128,
    percdamp: float = 0.01,
    forward: Callable[[object], object] | None = None,
    convolutions: bool = False,
) -> dict[str, torch.Tensor]:
    """Prune ``layers`` of ``model`` in place by ``criterion`` at ``ratios[layer.name]`` (unused
    with N:M); returns ``{weight parameter name: keep-mask}`` (CPU, bool, the weight's shape).

    ``batches``: the calibration batches (``wanda`` / ``sparsegpt``): ``input_ids`` tensors,
    ``(input_ids, ...)`` tuples or dicts with ``input_ids`` for a causal LM; for a model without
    transformer blocks, whatever ``forward(batch)`` runs the model on (module docstring).
    The model is run in eval mode (no dropout); every module's mode is put back afterwards.
    ``convolutions``: also prune ``Conv2d`` layers (``groups=1``) by Wanda / SparseGPT, as
    ``(out, in x kh x kw)`` matrices against their unfolded inputs (module docstring); without it
    they are refused, as the reference criteria prune Linear rows only.
    """
    n, m = check_nm(n, m)
    if criterion != "magnitude" or m:
        _check_layers(layers, criterion, m, convolutions)

    def one(la: Layer, stats: InputStats | None) -> torch.Tensor:
        return _prune_one(la, ratios[la.name], criterion, stats, n, m, blocksize, percdamp)

    if not needs_stats(criterion):
        return {weight_name(la): one(la, None) for la in layers}
    if not batches:
        raise ValueError(f"criterion={criterion!r} needs calibration batches; none were given")
    hessian = criterion == "sparsegpt"
    lm = find_causal_lm(model)
    modes = {mod: mod.training for mod in model.modules()}  # put back as they were (some may be in eval)
    model.eval()
    try:
        if lm is not None:
            masks = _prune_block_by_block(lm, layers, batches, criterion, hessian, one)
        else:
            masks = _prune_with_hooks(model, layers, batches, hessian, forward, one)
    finally:
        for mod, training in modes.items():
            mod.training = training
    return {weight_name(la): masks[weight_name(la)] for la in layers}


def _prune_block_by_block(lm: nn.Module, layers: Sequence[Layer], batches: Sequence, criterion: str, hessian: bool,
                          one: Callable[[Layer, InputStats], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A causal LM's layers pruned as its transformer blocks are calibrated one after another."""
    _, blocks = decoder_blocks(lm)
    inside = {id(mod) for block in blocks for mod in block.modules()}
    outside = [la.name for la in layers if id(la.module) not in inside]
    if outside:
        raise ValueError(
            f"criterion={criterion!r} calibrates the transformer blocks one after another; these pruned "
            f"layers lie outside them: {', '.join(outside[:5])}; leave them dense (head=False, or "
            "min_numel above their size) or prune by magnitude"
        )
    by_module = {id(la.module): la for la in layers}
    masks: dict[str, torch.Tensor] = {}

    def prune_block(_index, block, stats):
        for rel, mod in block.named_modules():
            la = by_module.get(id(mod))
            if la is not None:
                masks[weight_name(la)] = one(la, stats[rel])

    run_blocks(blocks, capture_block_inputs(lm, batches), prune_block, stats=True, hessian=hessian)
    return masks


def _prune_with_hooks(model: nn.Module, layers: Sequence[Layer], batches: Sequence, hessian: bool,
                      forward: Callable[[object], object] | None,
                      one: Callable[[Layer, InputStats], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model without transformer blocks: every layer's inputs gathered over ``forward(batch)``
    of all the batches, then each layer pruned."""
    if forward is None:
        raise ValueError(
            f"{type(model).__name__} has no transformer blocks and no forward function was given to run "
            "it on the calibration batches"
        )
    stats = {la.name: InputStats(_matrix(la.module).shape[1], hessian=hessian,
                                 device=la.weight.device) for la in layers}
    handles = [la.module.register_forward_pre_hook(_stats_hook(stats[la.name])) for la in layers]
    try:
        for batch in batches:
            forward(batch)
    finally:
        for h in handles:
            h.remove()
    return {weight_name(la): one(la, stats[la.name]) for la in layers}


def _stats_hook(stats: InputStats) -> Callable:
    """A forward pre-hook adding a layer's inputs to ``stats``."""

    def add(mod, args):
        x = args[0]
        if isinstance(mod, nn.Conv2d):  # every patch a row; the samples are the images
            stats.add(_unfolded(mod, x if x.ndim == 4 else x.unsqueeze(0)), samples=x.shape[0] if x.ndim == 4 else 1)
        else:
            stats.add(x)

    return add


@torch.no_grad()
def load_weights(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """Copy ``values[name]`` into ``params[name]`` in place (their dtype and device): the weights
    another rank computed (SparseGPT updates the kept weights, not only the mask)."""
    for name, value in values.items():
        params[name].copy_(value.to(params[name].device, params[name].dtype))


def readable_layers(layers: Sequence[Layer], criterion: str, n: int, m: int) -> tuple[list[Layer], dict[str, str]]:
    """(the ``layers`` whose inputs ``criterion`` -- or N:M -- can read, {left out: why}): the
    row-wise criteria hook a Linear's own inputs, which the projections packed inside
    ``nn.MultiheadAttention`` do not have; a ValueError when none is left."""
    if criterion == "magnitude" and not m:
        return list(layers), {}
    packed = [la.name for la in layers if inside_attention(la)]
    nm = f" (n={n}, m={m})" if m else ""
    why = (f"a projection inside nn.MultiheadAttention, whose inputs criterion={criterion!r}{nm} cannot read: "
           "criterion='magnitude' prunes it")
    kept = [la for la in layers if la.name not in packed]
    if not kept:
        raise ValueError(f"HTSRPruning(criterion={criterion!r}) has no layer left to prune: {', '.join(packed)} are "
                         "projections inside nn.MultiheadAttention, whose inputs it cannot read; use "
                         "criterion='magnitude'")
    return kept, dict.fromkeys(packed, why)


def calibration_forward(module: nn.Module, batch, criterion: str) -> None:
    """Run a model without transformer blocks on one calibration batch: its inputs (``x`` of a
    ``(x, ...)`` batch, a tensor batch, a dict's entries but ``labels`` as keyword arguments)
    through its ``forward`` (or the one child holding its parameters), else its own
    ``training_step`` (logging silenced): :mod:`lalr_lightning.core.model.batch_loss`. A batch
    that does not fit the model is a one-line ValueError."""
    try:
        try:
            call_model(module, split_batch(module, batch)[0])
        except TypeError:  # no forward to call with these inputs: the step the module trains with
            if not callable(getattr(module, "training_step", None)):
                raise
            step_loss(module, batch)
    except Exception as err:  # noqa: BLE001 -- any failure means the batches do not fit the model
        raise ValueError(
            f"HTSRPruning(criterion={criterion!r}) could not run {type(module).__name__} on a calibration batch "
            f"({type(err).__name__}: {err}); pass calibration=<a loader whose batches are (x, ...) tuples of the "
            "model's input>"
        ) from err
