"""Figures for spectral analysis and per-layer schedules, and logging them from a Lightning trainer.

Figures are plain ``matplotlib.figure.Figure`` objects drawn with the Agg canvas, never pyplot,
so nothing touches pyplot's global figure list or the user's backend.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter

__all__ = ["plot_esd", "plot_heatmap", "plot_alphas", "figure_to_array", "log_figure", "save_esd_plots"]


def _new_figure(figsize=(5.0, 4.0)) -> Figure:
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _to_numpy(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64).ravel()


def plot_esd(
    evals,
    *,
    alpha: float | None = None,
    xmin: float | None = None,
    title: str = "",
    ax: Axes | None = None,
) -> Figure:
    """Log-log ESD: density on log-spaced bins, the fitted tail ``p(l) ~ l^-alpha`` and ``xmin``.

    The tail line is the power-law density above ``xmin`` times the fraction of eigenvalues in
    the tail, so it sits on the histogram where the fit holds.
    """
    ev = _to_numpy(evals)
    ev = ev[np.isfinite(ev) & (ev > 0)]
    fig = _new_figure() if ax is None else ax.figure
    ax = fig.add_subplot() if ax is None else ax
    if ev.size == 0:
        ax.text(0.5, 0.5, "no positive eigenvalues", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        return fig
    lo, hi = ev.min(), ev.max()
    bins = np.logspace(math.log10(lo), math.log10(hi), 60) if hi > lo else 10
    ax.hist(ev, bins=bins, density=True, color="tab:blue", alpha=0.55, label=f"ESD ({ev.size} evals)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    if hi < 10 * lo:  # less than a decade: label 1-2-5 ticks only (the default labels every minor tick, overlapping)
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
    if xmin is not None and math.isfinite(xmin) and xmin > 0:
        ax.axvline(xmin, color="tab:red", ls="--", lw=1.2, label=f"xmin = {xmin:.3g}")
        if alpha is not None and math.isfinite(alpha) and alpha > 1 and hi > xmin:
            frac = float(np.mean(ev >= xmin))
            xs = np.logspace(math.log10(xmin), math.log10(hi), 100)
            pdf = frac * (alpha - 1) / xmin * (xs / xmin) ** (-alpha)
            ax.plot(xs, pdf, color="tab:red", lw=1.5, label=f"power law, alpha = {alpha:.2f}")
    ax.set_xlabel("eigenvalue of $W^TW$")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def _thin_ticks(n: int, max_ticks: int = 40) -> np.ndarray:
    step = max(1, math.ceil(n / max_ticks))
    return np.arange(0, n, step)


def plot_heatmap(
    values,
    row_labels: Sequence[str],
    col_labels: Sequence,
    *,
    title: str = "",
    cbar_label: str = "",
    cmap: str = "viridis",
    xlabel: str = "decision (epoch)",
) -> Figure:
    """Heatmap of a ``layers x decisions`` table (LR multipliers, selection masks, alphas); the
    columns are labelled ``xlabel`` (epoch, step or switch).

    NaN cells (a layer not measured that epoch) are left blank. Labels are thinned to at most 40
    ticks per axis so large models stay readable.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"plot_heatmap takes a 2-D array (layers x columns), got shape {arr.shape}")
    if len(row_labels) != arr.shape[0] or len(col_labels) != arr.shape[1]:
        raise ValueError(
            f"labels do not fit the values: {arr.shape[0]} rows / {arr.shape[1]} columns, "
            f"got {len(row_labels)} row labels and {len(col_labels)} column labels"
        )
    h = min(2.0 + 0.22 * arr.shape[0], 14.0)
    w = min(3.0 + 0.35 * arr.shape[1], 16.0)
    fig = _new_figure((max(w, 4.5), max(h, 3.0)))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(arr), aspect="auto", interpolation="nearest", cmap=cmap)
    rt, ct = _thin_ticks(arr.shape[0]), _thin_ticks(arr.shape[1], 30)
    ax.set_yticks(rt, [str(row_labels[i]) for i in rt], fontsize="x-small")
    ax.set_xticks(ct, [str(col_labels[i]) for i in ct], fontsize="small")
    ax.set_xlabel(xlabel)
    cb = fig.colorbar(im, ax=ax)
    if cbar_label:
        cb.set_label(cbar_label)
    ax.set_title(title)
    return fig


def plot_alphas(df, *, metric: str = "alpha", title: str = "") -> Figure:
    """Bar chart of one metric per layer (in the table's order) from :func:`~lalr_lightning.core.spectral.htsr.analyze`.

    Dashed lines at alpha = 2 and 6 mark HT-SR's well-trained range when ``metric == "alpha"``.
    """
    vals = np.asarray(df[metric], dtype=np.float64)
    names = [str(n) for n in df["name"]]
    fig = _new_figure((min(3.0 + 0.18 * len(vals), 18.0), 4.0))
    ax = fig.add_subplot()
    ax.bar(np.arange(len(vals)), np.nan_to_num(vals, nan=0.0), color="tab:blue")
    ticks = _thin_ticks(len(vals), 60)
    ax.set_xticks(ticks, [names[i] for i in ticks], rotation=90, fontsize="x-small")
    if metric == "alpha":
        ax.axhline(2.0, color="gray", ls="--", lw=0.8, label="alpha = 2 and 6: HT-SR's well-trained range")
        ax.axhline(6.0, color="gray", ls="--", lw=0.8)
        ax.legend(fontsize="small", loc="upper right")
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} per layer")
    return fig


def figure_to_array(fig: Figure) -> np.ndarray:
    """Render a figure to an ``H x W x 3`` uint8 array (what image loggers take)."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _close(fig: Figure) -> None:
    if "matplotlib.pyplot" in sys.modules:  # only if the caller made it with pyplot
        import matplotlib.pyplot as plt

        if plt.fignum_exists(getattr(fig, "number", -1)):
            plt.close(fig)
    fig.clear()


def log_figure(trainer, key: str, fig: Figure, step: int | None = None, *, close: bool = True) -> int:
    """Send ``fig`` to every logger of ``trainer`` that takes images; returns how many took it.

    WandbLogger: ``log_image``; TensorBoardLogger: ``add_image`` of the rendered figure. Loggers
    without images (CSVLogger, ...) are skipped silently. ``step`` defaults to the trainer's
    global step. The figure is closed afterwards unless ``close=False``.
    """
    try:
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
    except ImportError:  # pragma: no cover - lightning is a dependency
        TensorBoardLogger = WandbLogger = ()
    step = int(getattr(trainer, "global_step", 0)) if step is None else int(step)
    loggers = list(getattr(trainer, "loggers", None) or ([trainer.logger] if getattr(trainer, "logger", None) else []))
    if getattr(trainer, "is_global_zero", True) is False:
        loggers = []  # loggers only write on rank 0
    done = 0
    img = None
    try:
        for logger in loggers:
            if isinstance(logger, WandbLogger):
                img = figure_to_array(fig) if img is None else img
                logger.log_image(key=key, images=[img], step=step)
                done += 1
            elif isinstance(logger, TensorBoardLogger):
                img = figure_to_array(fig) if img is None else img
                logger.experiment.add_image(key, img, global_step=step, dataformats="HWC")
                done += 1
    finally:
        if close:
            _close(fig)
    return done


def _file_stem(index: int, name: str) -> str:
    return f"{index:03d}_" + (re.sub(r"[^A-Za-z0-9_.+-]+", "_", name) or "layer")


def save_esd_plots(
    model_or_layers,
    df=None,
    out_dir: str | Path = "esd_plots",
    *,
    fit: str = "ks",
    dtype: torch.dtype = torch.float32,
    min_evals: int = 10,
    summary: bool = True,
    dpi: int = 100,
    esds=None,
) -> Path:
    """Write one ESD plot per layer and an alpha-per-layer summary into ``out_dir``; returns ``out_dir``.

    Files: ``NNN_<layer name>.png`` (``NNN`` = row of the table, so they sort in layer order) and
    ``alpha_summary.png``. ``model_or_layers``: an ``nn.Module`` or a list of matrix layers, as for
    ``analyze``. ``df``: a table from ``analyze`` to take ``alpha``/``xmin`` from (only its layers
    are plotted; the fit is not redone); ``None``: the layers are analysed here with ``fit``,
    ``dtype`` and ``min_evals``. The ESDs are computed once, batched; ``esds`` (``{name:
    eigenvalues}``, with ``df``) skips that, e.g. for a streamed checkpoint (``model_or_layers``
    is then not read).
    """
    from .core.spectral.esd import _resolve_layers, compute_esds
    from .core.spectral.htsr import _analyze

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if df is None:
        df, esds = _analyze(model_or_layers, fit=fit, metrics=("alpha", "xmin", "D"), min_evals=min_evals, dtype=dtype)
    elif esds is None:
        if "name" not in df or "alpha" not in df:
            raise ValueError("df must be an analyze() table with 'name' and 'alpha' columns")
        wanted = set(df["name"])
        layers = [lay for lay in _resolve_layers(model_or_layers, None) if lay.name in wanted]
        esds = dict(zip([lay.name for lay in layers], compute_esds(layers, dtype=dtype)))
    for i, row in enumerate(df.to_dict("records")):
        name = row["name"]
        if name not in esds:
            continue
        alpha = float(row.get("alpha", math.nan))
        xmin = float(row["xmin"]) if "xmin" in row else None
        fig = plot_esd(esds[name], alpha=alpha, xmin=xmin, title=f"{name}  alpha={alpha:.2f}")
        fig.savefig(out / f"{_file_stem(i, name)}.png", dpi=dpi)
        _close(fig)
    if summary and len(df):
        fig = plot_alphas(df)
        fig.savefig(out / "alpha_summary.png", dpi=dpi)
        _close(fig)
    return out
