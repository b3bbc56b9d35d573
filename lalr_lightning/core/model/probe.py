"""A fixed probe batch: the same samples at every epoch, on every DDP rank and after a resume.

Diagnostics that compare numbers over training (the NTK's ``kappa``, the linearization gap,
Theorem 4's ``lambda_o``) must look at the same inputs each time, so the probe is drawn from the
loader's *dataset* (not from its sampler, which DDP shards and shuffling reorders): ``n``
indices chosen by ``seed``, collated by the loader's own ``collate_fn``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lalr_lightning.core.model.batch_loss import batch_loss, split_batch, to_device
from lalr_lightning.core.model.blocks import suggest_blocks
from lalr_lightning.core.model.forward_blocks import Trace, trace_modules

__all__ = ["fixed_batch", "forward_order", "forward_trace", "probe_inputs", "take"]


def take(batch: Any, n: int) -> Any:
    """The first ``n`` samples of a batch (tensors, tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, Mapping):
        return {k: take(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(take(v, n) for v in batch) if isinstance(batch, tuple) else [take(v, n) for v in batch]
    return batch


def fixed_batch(loader: Any, n: int, seed: int = 0) -> Any:
    """``n`` samples of ``loader.dataset`` (sorted indices of a ``seed``-ed permutation; all when it
    has fewer), collated with ``loader.collate_fn``.

    An iterable dataset has no indices: its loader's first batch, cut to ``n``, is the probe
    (then it is the same on every rank only if the stream is).
    """
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"the probe batch is drawn from one training DataLoader; got {type(loader).__name__} (several train "
            "loaders, or none)"
        )
    if n < 1:
        raise ValueError(f"the probe needs at least one sample, got n={n}")
    ds = loader.dataset
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__"):
        first = next(iter(loader), None)
        if first is None:
            raise ValueError("the training dataloader yielded no batch to take the probe from")
        return take(first, n)
    size = len(ds)
    if size == 0:
        raise ValueError("the training dataset is empty; there is no probe batch to take")
    g = torch.Generator().manual_seed(int(seed))
    order = torch.randperm(size, generator=g).tolist()
    if loader.batch_size is None and loader.batch_sampler is None:
        # automatic batching off (``batch_size=None``): each item is a batch already; items in the
        # seeded order, joined until they hold ``n`` samples
        items, have = [], 0
        for i in order:
            items.append(loader.collate_fn(ds[i]))
            have += _samples(items[-1])
            if have >= n:
                break
        return take(_cat(items), n)
    idx = sorted(order[: min(n, size)])
    return loader.collate_fn([ds[i] for i in idx])


def _samples(batch: Any) -> int:
    """The leading size of a batch's first tensor (1 when it holds none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((_samples(v) for v in values if isinstance(v, (torch.Tensor, Mapping, list, tuple))), 1)


def _cat(batches: list) -> Any:
    """Batches of one structure joined along their first dimension (tensors, tuples, lists, dicts)."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(batches) if first.ndim else first
    if isinstance(first, Mapping):
        return {k: _cat([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        joined = [_cat(list(parts)) for parts in zip(*batches)]
        return tuple(joined) if isinstance(first, tuple) else joined
    return first


def probe_inputs(module: nn.Module, loader: Any, n: int, seed: int = 0,
                 to_device: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
    """``(inputs, targets)`` of the fixed probe batch (:func:`fixed_batch`), split by the module's
    ``split_batch`` (:func:`~lalr_lightning.core.model.batch_loss.split_batch`), after ``to_device``."""
    batch = fixed_batch(loader, n, seed)
    return split_batch(module, batch if to_device is None else to_device(batch))


def forward_trace(module: nn.Module, batches: Callable[[], Any], loss_fn=None) -> Trace:
    """One forward pass of ``module`` with every module hooked (:mod:`~lalr_lightning.core.model.forward_blocks`),
    for :func:`~lalr_lightning.core.model.blocks.block_layers`' ``trace`` in a callback's ``setup``: on its ``example_input_array`` when
    it has one, else on two samples of the training loader ``batches()`` gives, run through the
    module's own loss (:func:`~lalr_lightning.core.model.batch_loss.batch_loss`: ``loss_fn``, its
    ``loss(output, target)`` or its ``training_step``, logging silenced). A one-line ValueError
    naming what to set instead when there is no batch or the pass fails."""
    example = getattr(module, "example_input_array", None)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if example is not None:
        example = to_device(example, device)

        def run():  # as Lightning's model summary calls it
            if isinstance(example, dict):
                return module(**example)
            return module(*example) if isinstance(example, (tuple, list)) else module(example)
    else:
        try:
            batch = fixed_batch(batches(), 2)
        except Exception as err:  # noqa: BLE001 -- any failure: say what to add instead
            raise _no_blocks(module, "no batch to run its forward pass on in setup", err) from None
        batch = to_device(batch, device)

        def run():
            return batch_loss(module, batch, loss_fn)
    try:
        return trace_modules(module, run)
    except Exception as err:  # noqa: BLE001 -- the forward pass was for the blocks: say what else works
        raise _no_blocks(module, "its forward pass on a training batch failed", err) from err


def _no_blocks(module: nn.Module, why: str, err: Exception) -> ValueError:
    name, first = type(module).__name__, str(err).splitlines()[0][:120] if str(err) else ""
    return ValueError(f"cannot find the blocks of {name}: no timm group_matcher, repeated children or Sequential "
                      f"trunk, and {why} ({type(err).__name__}: {first}); set {name}.example_input_array, or pass "
                      f"blocks=[...], e.g. blocks={suggest_blocks(module)!r}")


def forward_order(host: Any, module: nn.Module, loss_fn: Any = None) -> Callable[[], Trace] | None:
    """One forward pass of ``module`` on a probe batch, run when first asked (side-effect free:
    :func:`forward_trace`), for finding the output layer of a model with no Hugging Face / timm
    getter by what runs last; outside a fit (``host.has_data`` False: ``plan()``) only on the
    module's ``example_input_array`` (None without one: the registration order decides)."""
    if not host.has_data and getattr(module, "example_input_array", None) is None:
        return None
    # host.batches is looked up only when no example input is there (plan()'s host has none)
    return functools.cache(lambda: forward_trace(module, lambda: host.batches(), loss_fn))
