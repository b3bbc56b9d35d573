"""Layer-wise fine-tuning callbacks for PyTorch Lightning.

model -> layers (core.layers) -> measurements (core.spectral, ...) -> per-layer decisions
(one callback per method) -> control (core.control: LR multipliers and freezing that compose).

The names below are imported on first use (PEP 562), so ``import lalr_lightning`` -- and the one-shot
commands, ``python -m lalr_lightning prune`` / ``perplexity`` / ``zeroshot`` / ``analyze`` -- load
neither Lightning nor torchvision unless a callback is asked for.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_WHERE = {
    **dict.fromkeys(
        ("AutoRGN", "BlockSchedule", "HTSRPruning", "LALRScheduleCallback", "LayerLRMultiplier", "LMSAStepper",
         "NTKDiagnostics", "NTKSelect", "ProximalRegularizer", "SurgicalBlocks", "SurgicalLayerSelect",
         "TempBalanceCallback"), "lalr_lightning.callbacks"),
    "LayerControl": "lalr_lightning.core.runtime.control",
    "DivergenceError": "lalr_lightning.core.runtime.errors",
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
