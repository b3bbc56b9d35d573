"""Layer-wise fine-tuning callbacks for PyTorch Lightning.

model -> layers (core.model.layers) -> measurements (core.spectral.htsr, ...) -> per-layer decisions
(one callback per method) -> control (core.runtime.control: LR multipliers and freezing that compose).
"""

from lalr_lightning.callbacks import (
    AutoRGN,
    BlockSchedule,
    HTSRPruning,
    LALRScheduleCallback,
    LayerLRMultiplier,
    LMSAStepper,
    NTKDiagnostics,
    NTKSelect,
    ProximalRegularizer,
    SurgicalBlocks,
    SurgicalLayerSelect,
    TempBalanceCallback,
)
from lalr_lightning.core.model.layers import Layer, block_layers, find_layers, matrix_layers
from lalr_lightning.core.runtime.control import LayerControl
from lalr_lightning.core.runtime.errors import DivergenceError
from lalr_lightning.core.spectral.htsr import analyze
from lalr_lightning.core.spectral.lalr_metrics import lalr_metrics

__version__ = "0.1.0"

__all__ = [
    "AutoRGN",
    "BlockSchedule",
    "DivergenceError",
    "HTSRPruning",
    "LALRScheduleCallback",
    "LMSAStepper",
    "Layer",
    "LayerControl",
    "LayerLRMultiplier",
    "NTKDiagnostics",
    "NTKSelect",
    "ProximalRegularizer",
    "SurgicalBlocks",
    "SurgicalLayerSelect",
    "TempBalanceCallback",
    "analyze",
    "block_layers",
    "find_layers",
    "lalr_metrics",
    "matrix_layers",
]
