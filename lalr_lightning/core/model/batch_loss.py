"""The loss and the outputs of one batch, computed outside the module's training loop -- what
data-dependent methods (Auto-RGN, the eb-criterion, L-MSA, the proximal ``lambda_o``, the NTK)
measure on, from whatever the module already computes.

The loss of a batch (:func:`batch_loss`), in this order:

1. ``loss_fn(module, batch)`` when the callback was given one;
2. the module's ``loss(output, target)`` -- called as ``module.loss(module(inputs), targets)``
   with the batch split by :func:`split_batch` -- when it has one and the batch has targets;
3. the module's own ``training_step(batch, batch_idx)`` (a scalar, or a dict's ``"loss"``),
   with its ``self.log`` / ``self.log_dict`` calls silenced and its torchmetrics states and the
   global random state put back afterwards (:func:`step_loss`), so that it neither fails
   outside the loop nor changes what the training logs;
4. a Hugging Face model's own ``outputs.loss`` on a dict batch with ``labels`` (the loss
   ``transformers.Trainer`` trains with).

The outputs of a batch (:func:`call_model`, :func:`output_tensor`): a dict batch goes to the
model as keyword arguments without its ``labels``, a tuple/list batch is ``(inputs, targets)``
(``inputs`` a tensor, or a tuple of positional arguments), a tensor batch is the input; the
model is the module itself when its class defines ``forward``, else (a LightningModule that
only holds, say, ``self.model = AutoModelForCausalLM...``) its one child that holds all its
parameters; a Hugging Face output gives its ``logits``, a tuple its first tensor.

A module can override the split with ``split_batch(batch) -> (inputs, targets)`` (the
package's modules also accept the older ``_split``). Pure PyTorch: nothing here imports
Lightning; the LightningModule is driven through its public methods only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["LABEL_KEYS", "LossFn", "batch_loss", "call_model", "forward_module", "loss_source", "output_tensor",
           "split_batch", "step_loss", "to_device"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]

#: keys of a dict batch that hold the targets, not model inputs (Hugging Face's ``labels``)
LABEL_KEYS = ("labels",)


def _own_split(module: nn.Module) -> Callable | None:
    split = getattr(module, "split_batch", None) or getattr(module, "_split", None)
    return split if callable(split) else None


def split_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch: the module's ``split_batch`` (or ``_split``); else a
    dict's entries without ``labels`` and its ``labels`` (``None`` when absent); the first two
    items of a tuple/list (a one-item tuple: no targets); a tensor is the input alone."""
    split = _own_split(module)
    if split is not None:
        return split(batch)
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k not in LABEL_KEYS}, batch.get("labels")
    if isinstance(batch, (list, tuple)) and len(batch) >= 1:
        return batch[0], (batch[1] if len(batch) >= 2 else None)
    if isinstance(batch, torch.Tensor):
        return batch, None
    raise TypeError(
        f"cannot split a training batch of type {type(batch).__name__} into (inputs, targets); give "
        f"{type(module).__name__} a split_batch(batch) -> (inputs, targets) method"
    )


def _defines_forward(module: nn.Module) -> bool:
    """Whether the module's class (not ``nn.Module`` or a Lightning base class) defines ``forward``."""
    owner = next((c for c in type(module).__mro__ if "forward" in c.__dict__), nn.Module)
    return owner is not nn.Module and not owner.__module__.startswith(("lightning.", "pytorch_lightning."))


def forward_module(module: nn.Module) -> nn.Module:
    """The module whose call gives the outputs: ``module`` when its class defines ``forward``; else
    its one child holding all of its parameters (a LightningModule around a Hugging Face or timm
    model that never wrote a ``forward``); else a TypeError naming what to add."""
    if _defines_forward(module):
        return module
    own = {id(p) for p in module.parameters()}
    whole = [c for c in module.children() if own and {id(p) for p in c.parameters()} == own]
    if len(whole) == 1:
        return whole[0]
    raise TypeError(
        f"{type(module).__name__} defines no forward() and no single submodule holds all of its parameters, so "
        f"its outputs on a batch are unknown; define {type(module).__name__}.forward(inputs) returning the logits"
    )


def call_model(module: nn.Module, inputs: Any) -> Any:
    """The raw output of :func:`forward_module` on ``inputs``: a dict as keyword arguments, a
    tuple/list as positional ones, anything else as the one argument."""
    model = forward_module(module)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def output_tensor(out: Any) -> torch.Tensor:
    """The outputs in a model's return value: the tensor itself, a Hugging Face output's (or a
    dict's) ``logits``, or the first tensor of a tuple/list (or of an output without logits)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if callable(getattr(out, "to_tuple", None)):  # a Hugging Face output without logits: its first field
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the outputs in a {type(out).__name__}; the model should return a tensor, a "
                    "tuple starting with one, or an object with .logits")


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor (in dicts, lists and tuples) on ``device``; a mapping comes back
    as a plain dict."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch) if type(batch) in (list, tuple) else \
            [to_device(v, device) for v in batch]
    return batch


# --------------------------------------------------------------------------- training_step


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _is_metric(m: nn.Module) -> bool:
    # a torchmetrics Metric, recognised by its state registry (torchmetrics is not imported here)
    return isinstance(getattr(m, "_defaults", None), dict) and hasattr(m, "_update_count")


_METRIC_FIELDS = ("_update_count", "_computed", "_forward_cache", "_update_called")


@contextlib.contextmanager
def _quiet(module: nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing; the torchmetrics states the step
    updates and the global random state are put back on exit."""
    saved = {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}
    metrics = [m for m in module.modules() if _is_metric(m)]
    states = [(m, {k: copy.deepcopy(m.__dict__[k]) for k in (*m._defaults, *_METRIC_FIELDS) if k in m.__dict__})
              for m in metrics]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    for k in ("log", "log_dict"):
        module.__dict__[k] = _ignore  # an instance attribute shadows the bound method
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for k in ("log", "log_dict"):
            if k in saved:
                module.__dict__[k] = saved[k]
            else:
                module.__dict__.pop(k, None)
        for m, state in states:
            m.__dict__.update(state)


def step_loss(module: nn.Module, batch: Any, batch_idx: int = 0) -> torch.Tensor:
    """The loss ``module.training_step(batch, batch_idx)`` returns (a scalar tensor, or a dict's
    ``"loss"``), with its logging silenced and its metric and random states kept (module
    docstring)."""
    with _quiet(module):
        out = module.training_step(batch, batch_idx)
    value = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = "None" if value is None else type(value).__name__ if not isinstance(value, torch.Tensor) \
            else f"a tensor of shape {tuple(value.shape)}"
        raise TypeError(
            f"{type(module).__name__}.training_step returned {got}, not the scalar loss (or a dict with 'loss') "
            "the callback measures on; pass loss_fn=f with f(module, batch) -> the scalar training loss"
        )
    return value.reshape(())


# --------------------------------------------------------------------------- the chain


def _has_loss(module: nn.Module) -> bool:
    return callable(getattr(module, "loss", None))


def loss_source(module: nn.Module, loss_fn: LossFn | None = None) -> str:
    """Which loss :func:`batch_loss` uses, in words (for logs and errors)."""
    name = type(module).__name__
    if loss_fn is not None:
        return f"loss_fn={getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"
    if _has_loss(module):
        return f"{name}.loss(output, target)"
    if callable(getattr(module, "training_step", None)):
        return f"{name}.training_step"
    return f"{name}(**batch).loss"


def _own_loss(module: nn.Module, batch: Any) -> torch.Tensor | None:
    """A Hugging Face model's own loss: ``model(**batch).loss`` of a dict batch with ``labels``
    (what ``transformers.Trainer`` trains on); None for any other model or batch."""
    if not (isinstance(batch, Mapping) and batch.get("labels") is not None):
        return None
    out = forward_module(module)(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    return loss.reshape(()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def batch_loss(module: nn.Module, batch: Any, loss_fn: LossFn | None = None, *, batch_idx: int = 0) -> torch.Tensor:
    """The scalar loss of ``batch`` (module docstring: ``loss_fn``, else ``loss(output, target)``,
    else ``training_step``).

    A ``loss`` that runs the model itself (one taking ``(x, y)`` instead of ``(output, target)``)
    would run every forward hook twice; that is detected and named.
    """
    if loss_fn is not None:
        return loss_fn(module, batch)
    if _has_loss(module):
        x, y = split_batch(module, batch)
        if y is not None or not callable(getattr(module, "training_step", None)):
            out = call_model(module, x) if not _own_split(module) else module(x)
            calls = []
            handle = module.register_forward_pre_hook(lambda *_: calls.append(1))
            try:
                value = module.loss(out, y)
            finally:
                handle.remove()
            if calls:
                raise TypeError(
                    f"{type(module).__name__}.loss(output, target) ran the model itself: the default batch loss "
                    "calls module.loss(module(inputs), targets), so a loss taking (x, y) runs the model twice. Pass "
                    "loss_fn=f with f(module, batch) -> the scalar training loss"
                )
            return value
    if callable(getattr(module, "training_step", None)):
        return step_loss(module, batch, batch_idx)
    own = _own_loss(module, batch)
    if own is not None:
        return own
    raise TypeError(
        f"{type(module).__name__} has no training_step and no loss(output, target) method to measure a batch's loss "
        "with; pass loss_fn=f with f(module, batch) -> the scalar training loss"
    )
