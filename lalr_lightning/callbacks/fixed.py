"""Fixed per-layer learning-rate multipliers (discriminative fine-tuning by hand)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from lalr_lightning.callbacks.base import Decision, LayerwiseCallback, deprecated_arg
from lalr_lightning.callbacks.host import Host, Traits
from lalr_lightning.choices import unknown
from lalr_lightning.core.model.blocks import find_layers
from lalr_lightning.core.model.layers import clean_name

__all__ = ["LayerLRMultiplier"]


@dataclass(eq=False, repr=False)
class LayerLRMultiplier(LayerwiseCallback):
    """Scale the learning rate of layers matched by name patterns.

    Example::

        >>> from lalr_lightning.callbacks import LayerLRMultiplier
        >>> cb = LayerLRMultiplier({"model.fc": 10.0, "model.layer1*": 0.1})  # head 10x, first stage 0.1x

    ``patterns`` maps glob patterns over layer names (``"layer1.*"``, ``"fc"``) to a factor of
    the scheduled LR; the first matching pattern wins, unmatched layers keep factor 1.
    Composes with the other callbacks multiplicatively, like all of them. A pattern that
    matches nothing is an error (a typo would otherwise silently change nothing).
    Readable: ``multipliers`` (layer -> factor). ``multipliers=`` as the argument's name is
    deprecated (it is the readable result's name).
    """

    traits = Traits(
        log_prefix="layer_lr",
        readable=LayerwiseCallback.traits.readable + ("multipliers",),
    )

    patterns: Mapping[str, float] | None = None
    granularity: str = "matrix"
    _: KW_ONLY
    multipliers: Mapping[str, float] | None = deprecated_arg("patterns")

    def validate(self) -> None:
        super().validate()
        patterns = self.patterns
        if patterns is not None and not isinstance(patterns, Mapping):
            raise TypeError("LayerLRMultiplier needs patterns={glob over layer names: LR factor}, got a "
                            f"{type(patterns).__name__}")
        if not patterns:
            raise ValueError("LayerLRMultiplier needs patterns={glob over layer names: LR factor}")
        bad = {k: v for k, v in patterns.items() if not (0 <= v < math.inf)}
        if bad:
            raise ValueError(f"multipliers must be finite and >= 0, got {bad}")
        if self.granularity not in ("matrix", "block"):
            raise unknown("granularity", self.granularity, ("matrix", "block"), show=repr)
        self.patterns = {str(k): float(v) for k, v in patterns.items()}

    def __post_init__(self) -> None:
        super().__post_init__()
        self.multipliers: dict[str, float] = {}  # the readable result (the deprecated argument's name)
        self._tied: dict[str, str] = {}

    def configure(self, host: Host, module: nn.Module) -> None:
        self.layers = find_layers(module, self.granularity)
        # a module whose weight another layer holds (tied) is no layer of its own: say which one
        owner = {id(p): layer.name for layer in self.layers for p in layer.params.values()}
        self._tied = {clean_name(raw): owner[id(w)] for raw, mod in module.named_modules()
                      if isinstance(w := getattr(mod, "weight", None), torch.Tensor) and id(w) in owner
                      and owner[id(w)] != clean_name(raw)}
        self.early = self.decide([layer.name for layer in self.layers])  # a typo fails here, not silently

    def resumed(self, late: bool) -> None:
        if self.early is not None:  # configured
            self.multipliers = dict(self.early.values)  # the settings check made sure they are the saved ones

    def decide(self, names: list[str]) -> Decision:
        values: dict[str, float] = {}
        for pat, m in self.patterns.items():
            if not any(fnmatchcase(n, pat) for n in names):
                tied = next((t for t in self._tied if fnmatchcase(t, pat)), None)
                if tied is not None:
                    raise ValueError(f"pattern {pat!r} matches no layer: {tied!r} shares its weight with "
                                     f"{self._tied[tied]!r} (tied weights are one layer, named by the module that "
                                     f"registers them first); use {self._tied[tied]!r}")
                raise ValueError(f"pattern {pat!r} matches no layer; layers are: {names}")
            values.update({n: m for n in names if fnmatchcase(n, pat) and n not in values})
        return Decision(values=values)

    def apply(self, host: Host) -> None:
        self.apply_multipliers(host, self.multipliers)
