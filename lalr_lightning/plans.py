"""Decisions without a fit, written as files: ``analyze MODEL --pruning 0.7 [--preset alphapruning]``.

The numbers are :meth:`~lalr_lightning.callbacks.base.LayerwiseCallback.plan`'s, so they are the
ratios ``HTSRPruning`` with the same settings decides at the start of a fit on these weights.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
from torch import nn

__all__ = ["pruning_plan", "write_pruning_plan"]


def pruning_plan(model: nn.Module, target_sparsity: float, preset: str | None = None, *,
                 head: bool = False) -> tuple[pd.DataFrame, dict]:
    """(``HTSRPruning(target_sparsity=..., preset=..., head=...).plan(model)``, whose ``numel`` column
    weights the mean, the layers left dense and why). Raises ``ValueError`` for a target outside [0, 1)."""
    from lalr_lightning.callbacks.pruning import HTSRPruning
    from lalr_lightning.core.pruning.alphapruning import prunable_layers

    pruner = HTSRPruning(target_sparsity=target_sparsity, preset=preset, head=head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the layers left dense are reported with the summary
        table = pruner.plan(model)
    # the same layer rule the callback applies, for the layers left dense
    _, dense = prunable_layers(model, layer_types=pruner.layer_types, head=pruner.head,
                               min_numel=pruner.min_numel, min_evals=pruner.min_evals)
    table.attrs["settings"] = {"metric": pruner.metric, "fit": pruner.fit, "epsilon": pruner.epsilon,
                               "block_average": pruner.block_average, "max_ratio": pruner.max_ratio}
    return table, dense


def write_pruning_plan(model: nn.Module, target_sparsity: float, preset: str | None, out: str | Path, *,
                       head: bool = False) -> tuple[Path, str]:
    """Write the per-layer ratios as ``pruning_<preset>_<target>.csv`` in ``out`` (columns
    ``layer, numel, metric, ratio``); return its path and a one-paragraph summary."""
    table, dense = pruning_plan(model, target_sparsity, preset, head=head)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"pruning_{preset or 'htsr'}_{target_sparsity:g}.csv"
    table.to_csv(path, index=False)
    s = table.attrs["settings"]
    mean = float((table["ratio"] * table["numel"]).sum() / max(int(table["numel"].sum()), 1))
    how = f"metric {s['metric']}" + (f" ({s['fit']} fit)" if s["metric"].startswith(("alpha", "log_alpha")) else "")
    how += f", epsilon {s['epsilon']:g}" + (", averaged per block" if s["block_average"] else "")
    lines = [
        f"HTSRPruning(target_sparsity={target_sparsity:g}" + (f", preset={preset!r}" if preset else "") + f"): {how}",
        f"  {len(table)} layers pruned, ratios {table['ratio'].min():.3f} to {table['ratio'].max():.3f}, "
        f"parameter-weighted mean {mean:.3f} -> {path.resolve()}",
    ]
    capped = int((table["ratio"] >= table.attrs["settings"]["max_ratio"] - 1e-12).sum())
    if capped:
        lines.append(f"  {capped} layers capped at max_ratio {table.attrs['settings']['max_ratio']:g} (the rest take "
                     "up what they could not lose)")
    if dense:
        shown = "; ".join(f"{k} ({v})" for k, v in list(dense.items())[:5]) + (" ..." if len(dense) > 5 else "")
        lines.append(f"  left dense: {len(dense)}: {shown}")
    return path, "\n".join(lines)
