"""A fixed probe batch: the same samples at every epoch, on every DDP rank and after a resume.

Diagnostics that compare numbers over training (the NTK's ``kappa``, the linearization gap,
Theorem 4's ``lambda_o``) must look at the same inputs each time, so the probe is drawn from the
loader's *dataset* (not from its sampler, which DDP shards and shuffling reorders): ``n``
indices chosen by ``seed``, collated by the loader's own ``collate_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lalr_lightning.core.model.batch_loss import split_batch

__all__ = ["fixed_batch", "probe_inputs", "take"]


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
