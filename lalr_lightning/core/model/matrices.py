"""Which modules hold a layer weight matrix in the HT-SR sense -- the one predicate the layer
listing (:mod:`~lalr_lightning.core.model.layers`) and the forward-pass block finder
(:mod:`~lalr_lightning.core.model.forward_blocks`) share, so neither imports the other for it."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["is_matrix_module"]


def is_matrix_module(module: nn.Module) -> bool:
    """A module whose ``weight`` is a layer weight matrix in the HT-SR sense."""
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)):
        return isinstance(getattr(module, "weight", None), torch.Tensor)
    # Hugging Face GPT-2 style Conv1D (a transposed Linear); matched by name so that
    # transformers stays an optional dependency.
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and module.weight.ndim == 2
