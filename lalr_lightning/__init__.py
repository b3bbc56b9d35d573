"""Layer-wise fine-tuning callbacks for PyTorch Lightning.

model -> layers (core.layers) -> measurements (core.spectral, ...) -> per-layer decisions
(one callback per method) -> control (core.control: LR multipliers and freezing that compose).

The names below are imported on first use (PEP 562), so ``import lalr_lightning`` -- and the one-shot
commands, ``python -m lalr_lightning prune`` / ``perplexity`` / ``zeroshot`` / ``analyze`` -- load
neither Lightning nor torchvision unless a callback is asked for.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

__version__ = "0.1.0"


def _exported(package: str) -> tuple[str, ...]:
    """``package``'s ``__all__``, read from its ``__init__.py`` without importing it (importing the
    callbacks loads Lightning): the top-level names follow the package's list, never a copy of it."""
    spec = importlib.util.find_spec(package)
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ImportError(f"{package} defines no __all__")  # pragma: no cover - the package's own layout


#: public name -> the module that defines it: every callback name, and a few of core's
_WHERE = {
    **dict.fromkeys(_exported("lalr_lightning.callbacks"), "lalr_lightning.callbacks"),
    "LayerControl": "lalr_lightning.core.runtime.control",
    "DivergenceError": "lalr_lightning.core.runtime.checks",
    "lalr_metrics": "lalr_lightning.core.spectral.lalr_metrics",
    **dict.fromkeys(("Layer", "matrix_layers"), "lalr_lightning.core.model.layers"),
    **dict.fromkeys(("block_layers", "find_layers"), "lalr_lightning.core.model.blocks"),
    "analyze": "lalr_lightning.core.spectral.htsr",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lalr_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
