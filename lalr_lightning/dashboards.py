"""What a callback's decisions look like in the run's loggers (W&B, TensorBoard, CSV, others).

Every :class:`~lalr_lightning.callbacks.base.LayerwiseCallback` calls :func:`publish` at fit
start, at every decision and at fit end (rank zero only). Scalars go to every logger through the
callback's own ``log_values``; this module adds what each logger can show beyond them:

* W&B: a ``wandb.Table`` ``<prefix>/decisions`` per decision (layer, measurement(s), decision),
  ``define_metric`` so all per-layer curves share ``trainer/global_step``, the constructor
  settings in the run config (``callbacks/<state key>``) and a per-layer summary
  (``<prefix>/final``) in the run summary; and, as the callback's ``figures`` setting says
  (``every`` decision, ``first_last``, every N epochs, or ``never``, the default), the heatmap of
  the decisions so far and ESD log-log plots with the fitted power law under one key
  ``<prefix>/esd``;
* TensorBoard: the same images (``add_image``; ESDs as ``<prefix>/esd/<layer>``) and a markdown
  table (``add_text``) per decision, the settings and the final table as text;
* CSV and any other logger: the scalars, and the settings through ``log_hyperparams``.

A logger that cannot take something is skipped silently: dashboards never fail a run.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lalr_lightning.choices import unknown
from lalr_lightning.core.runtime.decision import Decision, history_table

__all__ = ["decision_table", "esd_figures", "markdown_table", "publish"]

#: which ESD sets were plotted, per callback, for the current fit (not checkpoint state)
_plotted: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class _FitLog:
    trainer: Any = None  # a weak reference to the fit's trainer
    esd_epochs: set = field(default_factory=set)
    esd_at_entry: int = -1  # len(history) when ESDs were last plotted
    heatmap_at_entry: int = -1  # len(history) when the heatmap was last logged


def _log_step(trainer) -> int:
    # the step LearningRateMonitor uses, so the curves line up with its
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def _sharded(trainer) -> bool:
    """Whether rank zero lacks the whole weights (FSDP1 or FSDP2)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(getattr(trainer, "strategy", None), (FSDPStrategy, ModelParallelStrategy))


def _log_of(cb, trainer) -> _FitLog:
    """What was drawn for ``cb`` in this fit (a new record for a new trainer)."""
    log = _plotted.get(cb)
    if log is None or log.trainer() is not trainer:
        log = _plotted[cb] = _FitLog(weakref.ref(trainer))
    return log


def _kinds(trainer) -> tuple[list, list, list]:
    """(W&B loggers, TensorBoard loggers, the others) of the trainer."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    wb, tb, other = [], [], []
    for lg in trainer.loggers:
        (wb if isinstance(lg, WandbLogger) else tb if isinstance(lg, TensorBoardLogger) else other).append(lg)
    return wb, tb, other


def _quiet(fn, *args, **kwargs) -> None:
    """Call a logger method; a logger that cannot take it is skipped (dashboards never fail a run)."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 -- unknown loggers may refuse anything
        pass


# ----------------------------------------------------------------------------- pure parts


def _cell(v: Any) -> Any:
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, float, np.integer, np.floating)):
        v = float(v)
        return v if math.isfinite(v) else None
    return v


def decision_table(cb, decision) -> tuple[list[str], list[list]]:
    """(columns, rows) of one decision: ``layer``, the score, every other measurement, the
    decision value; one row per layer (missing numbers are ``None``)."""
    quantities = [q for q in decision.measurements if q not in (cb.traits.score_key, cb.traits.decision_key)]
    columns = ["layer"] + ([cb.traits.score_key] if decision.scores else []) + quantities + [cb.traits.decision_key]
    layers: list[str] = []
    for source in (decision.values, decision.scores, *decision.measurements.values()):
        layers += [n for n in source if n not in layers]
    rows = []
    for n in layers:
        row = [n] + ([decision.scores.get(n)] if decision.scores else [])
        row += [decision.measurements[q].get(n) for q in quantities] + [decision.values.get(n)]
        rows.append([_cell(v) for v in row])
    return columns, rows


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table (TensorBoard's text plugin renders it); numbers with 4 significant digits."""

    def fmt(v):
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _matrix_layers(cb, names) -> list:
    wanted = set(names)
    out = []
    for la in cb.layers:
        if la.name in wanted and la.role == "matrix" and la.kind in ("linear", "conv1d", "conv2d", "hf_conv1d",
                                                                      "embedding"):
            try:
                cb.weight_of(la)
            except AttributeError:
                continue
            out.append(la)
    return out


def esd_figures(cb, names: Sequence[str], title: str) -> list[tuple[str, Any]]:
    """``[(layer, figure)]``: the ESD of each matrix layer among ``names`` (log-log) with its
    power-law fit (the callback's ``fit`` when it has one, else ``ks``); layers that are blocks
    or have no single weight are left out."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    from lalr_lightning import viz
    from lalr_lightning.core.spectral import esd, powerlaw

    fit = getattr(cb, "fit", "ks")
    fit = fit if fit in powerlaw.FITS else "ks"
    out = []
    for la in _matrix_layers(cb, names):
        ev = esd.layer_esd(cb.weight_of(la).detach(), la.kind).cpu()
        if getattr(cb, "filter_zeros", False):
            ev = ev[ev > esd.EVALS_THRESH]
        try:
            res = powerlaw.fit_power_law(ev, fit)
            alpha, xmin = float(res["alpha"]), float(res["xmin"])
        except ValueError:  # degenerate spectrum: the histogram alone
            alpha = xmin = None
        label = f"alpha={alpha:.2f}" if alpha is not None else "no fit"
        # fixed margins: matplotlib's layout engines take most of the drawing time of a log-log plot
        fig = Figure(figsize=(5.0, 4.0))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.15, right=0.97, bottom=0.13, top=0.86)
        ax = fig.add_subplot()
        viz.plot_esd(ev, alpha=alpha, xmin=xmin, title=f"{la.name}  {label}\n{title}", ax=ax)
        pos = ev[ev > 0]
        if pos.numel() and float(pos.max()) >= 10 * float(pos.min()):  # a decade or more: label decades only
            ax.xaxis.set_minor_formatter(NullFormatter())
        out.append((la.name, fig))
    return out


# ----------------------------------------------------------------------------- publishing


def publish(trainer, cb, event: str, decision=None) -> None:
    """Publish ``event`` (``"start"``, ``"decision"`` with the decision, or ``"end"``) of ``cb``
    to every logger of ``trainer``; rank zero only."""
    if not trainer.loggers or not trainer.is_global_zero:
        return
    if event == "start":
        _start(trainer, cb)
    elif event == "decision":
        _decision(trainer, cb, decision)
    elif event == "end":
        _end(trainer, cb)
    else:
        raise unknown("event", event, ("start", "decision", "end"))


def _start(trainer, cb) -> None:
    wb, tb, _ = _kinds(trainer)
    settings = cb.settings()
    key = f"callbacks/{cb.state_key}"
    for lg in trainer.loggers:
        if lg in tb:  # TensorBoard's hparams would add another hp_metric point: text and hparams.yaml only
            if isinstance(lg.hparams, dict):
                lg.hparams[key] = settings
            lg.experiment.add_text(f"{cb.prefix}/settings", markdown_table(
                ["setting", "value"], [[k, repr(v)] for k, v in settings.items()]), global_step=0)
        else:
            _quiet(lg.log_hyperparams, {key: settings})
    for lg in wb:
        exp = lg.experiment
        exp.define_metric("trainer/global_step")
        for glob in (f"{cb.prefix}/*", "lr_eff/*"):
            exp.define_metric(glob, step_metric="trainer/global_step", step_sync=True)


def _figures_due(cb, trainer, log: _FitLog) -> bool:
    """Whether this decision's figures are drawn, by the callback's ``figures`` setting."""
    mode = getattr(cb, "figures", "never")
    if mode == "never":
        return False
    if mode == "every" or log.esd_at_entry < 0:  # every decision, or the first of this fit
        return True
    epoch = trainer.current_epoch
    return isinstance(mode, int) and epoch % mode == 0 and epoch not in log.esd_epochs


def _log_esds(trainer, cb, names, wb, tb, title: str) -> None:
    log = _log_of(cb, trainer)
    log.esd_epochs.add(trainer.current_epoch)
    log.esd_at_entry = len(cb.history)
    if not cb.traits.esd_plots or _sharded(trainer):  # blocks or tensors; or rank zero lacks whole weights
        return
    from lalr_lightning import viz

    figs = esd_figures(cb, names, title)
    if not figs:
        return
    step = _log_step(trainer)
    images = [(name, viz.figure_to_array(fig)) for name, fig in figs]
    for _, fig in figs:
        viz._close(fig)
    for lg in wb:
        lg.log_image(key=f"{cb.prefix}/esd", images=[img for _, img in images], step=step,
                     caption=[name for name, _ in images])
    for lg in tb:
        for name, img in images:
            lg.experiment.add_image(f"{cb.prefix}/esd/{name}", img, global_step=step, dataformats="HWC")


def _decision(trainer, cb, decision) -> None:
    wb, tb, _ = _kinds(trainer)
    if not (wb or tb):
        return  # the scalars are all the others take
    step = _log_step(trainer)
    columns, rows = decision_table(cb, decision)
    for lg in wb:
        lg.log_table(key=f"{cb.prefix}/decisions", columns=columns, data=rows, step=step)
    for lg in tb:
        lg.experiment.add_text(f"{cb.prefix}/decisions", markdown_table(columns, rows), global_step=step)
    log = _log_of(cb, trainer)
    if _figures_due(cb, trainer, log):
        log_heatmap(trainer, cb)
        log.heatmap_at_entry = len(cb.history)
        names = list(decision.scores or decision.values)
        _log_esds(trainer, cb, names, wb, tb, f"decision at epoch {trainer.current_epoch}, step {trainer.global_step}")


def _end(trainer, cb) -> None:
    wb, tb, _ = _kinds(trainer)
    log = _log_of(cb, trainer)
    if not cb.history:
        return
    drawn = getattr(cb, "figures", "never") != "never"
    if drawn and log.heatmap_at_entry != len(cb.history):
        log_heatmap(trainer, cb)
    if not (wb or tb):
        return
    if drawn and log.esd_at_entry != len(cb.history):  # the last decision's ESDs were not shown
        names = list(cb.scores or getattr(cb, cb.traits.decision_attr) or [])
        if isinstance(names, dict):
            names = list(names)
        _log_esds(trainer, cb, names, wb, tb, f"fit end, epoch {trainer.current_epoch}, step {trainer.global_step}")
    final = _final_table(cb)
    if final is None:
        return
    columns, rows = final
    for lg in wb:
        lg.experiment.summary[f"{cb.prefix}/final"] = {r[0]: dict(zip(columns[1:], r[1:])) for r in rows}
        lg.experiment.summary[f"{cb.prefix}/decisions_made"] = len(cb.history)
    for lg in tb:
        lg.experiment.add_text(f"{cb.prefix}/final", markdown_table(columns, rows), global_step=_log_step(trainer))


def _final_table(cb) -> tuple[list[str], list[list]] | None:
    """The last decision as (columns, rows), from what the callback holds after fit."""
    values = getattr(cb, cb.traits.decision_attr, None)
    if isinstance(values, list):  # selection callbacks keep the selected units
        values = {u.name: float(u.name in values) for u in cb.layers}
    if not values:
        return None
    return decision_table(cb, Decision(values=dict(values), scores=dict(cb.scores),
                                       measurements={k: dict(v) for k, v in cb.measurements.items()}))


def log_heatmap(trainer, cb) -> None:
    """The layers x decisions heatmap (``cb.traits.heatmap``: key, title, colour-bar label), once the history
    has ``heatmap_min_entries``; a method shapes it with ``heatmap_values()``, ``heatmap_columns()``,
    ``heatmap_xlabel()`` where it defines them, and adds figures of its own with ``log_heatmap(trainer)``."""
    if not trainer.is_global_zero or not trainer.loggers:
        return
    if cb.traits.heatmap is not None and len(cb.history) >= cb.traits.heatmap_min_entries:
        from lalr_lightning import viz

        key, title, label = cb.traits.heatmap
        own = getattr(cb, "heatmap_values", None)
        names, values = own() if own is not None else history_table(cb.history, cb.traits.decision_attr)
        fig = viz.plot_heatmap(values, names, heatmap_columns(cb)[-values.shape[1]:], title=title.format(self=cb),
                               cbar_label=label, xlabel=heatmap_xlabel(cb))
        viz.log_figure(trainer, f"{cb.prefix}/{key}", fig)
    extra = getattr(cb, "log_heatmap", None)
    if extra is not None:
        extra(trainer)


def heatmap_columns(cb) -> list[str]:
    """Column labels of the heatmap, one per history entry (the method's ``heatmap_columns()`` if any)."""
    own = getattr(cb, "heatmap_columns", None)
    if own is not None:
        return own()
    by_step = getattr(cb, "every_n_steps", None) is not None
    return [str(h["step"] if by_step else h["epoch"]) for h in cb.history]


def heatmap_xlabel(cb) -> str:
    own = getattr(cb, "heatmap_xlabel", None)
    if own is not None:
        return own()
    return "step" if getattr(cb, "every_n_steps", None) is not None else "epoch"
