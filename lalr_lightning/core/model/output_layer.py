"""The model's output layer (the head that makes its predictions), found by name, by the tied
embedding it shares a weight with, or by the last matrix a traced forward pass ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lalr_lightning.core.model.blocks import _inside, _repeated_children
from lalr_lightning.core.model.forward_blocks import Trace
from lalr_lightning.core.model.layers import Layer, clean_name, matrix_layers
from lalr_lightning.core.model.matrices import is_matrix_module

__all__ = [
    "output_layer",
]


def _output_weight(model: nn.Module, trace: Callable[[], Trace] | None = None) -> torch.Tensor | None:
    """The output layer's weight: the first module (outermost first) whose Hugging Face
    ``get_output_embeddings()`` or timm ``get_classifier()`` returns a module with a weight
    (peft's ``PeftModel`` forwards both to the wrapped model); else the matrix module that runs
    last in the forward pass ``trace`` gives (a model that registers its head before its trunk),
    or without one (or when it fails) the last registered -- shared weights included, so a
    hand-tied head counts -- unless that one lies inside one of the model's repeated blocks (a
    headless backbone has no output layer: a block matrix is never the head)."""
    for _, mod in model.named_modules():
        for getter in ("get_output_embeddings", "get_classifier"):
            get = getattr(mod, getter, None)
            if not callable(get):
                continue
            try:
                out = get()
            except (NotImplementedError, AttributeError, TypeError):
                continue
            w = getattr(out, "weight", None) if isinstance(out, nn.Module) else None
            if isinstance(w, torch.Tensor):
                return w
    last = _last_ran(model, trace)
    if last is None:
        for raw, mod in model.named_modules(remove_duplicate=False):
            if is_matrix_module(mod):
                last = (clean_name(raw), mod)
    if last is None:
        return None
    rep = _repeated_children(model)
    if rep is not None and any(_inside(last[0], block) for block in rep[1]):
        return None
    return last[1].weight


def _last_ran(model: nn.Module, trace: Callable[[], Trace] | None) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of the matrix module whose first call came last in ``trace``'s forward
    pass; None without a trace, when it fails (no batch, a forward that needs more) or when no
    matrix module ran."""
    if trace is None:
        return None
    try:
        order = trace().order
    except ValueError:  # forward_trace's one line: the registration order is the answer then
        return None
    modules = dict(model.named_modules())
    ran = [n for n in order if n in modules and is_matrix_module(modules[n])]
    return (clean_name(ran[-1]), modules[ran[-1]]) if ran else None


def output_layer(model: nn.Module, layers: Sequence[Layer] | None = None,
                 trace: Callable[[], Trace] | None = None) -> Layer | None:
    """The Layer of ``layers`` that owns the model's output (head) weight, or ``None``.

    The output weight is found by :func:`_output_weight` (Hugging Face ``get_output_embeddings``
    on the model, a LightningModule holding it, or a peft wrapper; timm ``get_classifier``; else
    the matrix module that runs last in ``trace``'s forward pass, or without one the last
    registered, outside the repeated blocks). ``layers`` defaults to :func:`matrix_layers` of
    ``model``; any list of Layers works (block layers too). Because a shared weight belongs to the
    first module that registers it, a head tied to the input embedding (``tie_word_embeddings=True``:
    GPT-2, OPT, many LLaMA-style models) maps to the embedding's Layer. ``None`` when the model has
    no head (a bare ``LlamaModel``) or the head weight is in none of ``layers`` (e.g. frozen and
    left out with ``include_frozen=False``).
    """
    w = _output_weight(model, trace)
    if w is None:
        return None
    if layers is None:
        layers = matrix_layers(model)
    for layer in layers:
        if any(p is w for p in layer.params.values()):
            return layer
    return None
