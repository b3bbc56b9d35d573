"""``python -m lalr_lightning report RUN_DIR``: one self-contained HTML page of a run.

Reads any run directory this package's callbacks logged to -- a CSVLogger version directory
(``metrics.csv``), a TensorBoard one (event files) or an offline W&B run folder
(``offline-run-*``, read from its transaction log ``run-*.wandb`` and its ``files/media``) -- and
writes one page with a section per method (log prefix): the final decision table, the heatmaps,
per-layer curves and the ESD plots of the first and last set; a section is titled after its
method (``lisa``, not the shared ``surgical`` prefix), with a line under the title naming the keys
it was logged as (``surgical/<quantity>/<layer>``). Every image is inlined as a base64 ``data:``
URI, so the page opens anywhere without network. By default the page is written into the run's
directory.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
import math
import re
import struct
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["RunData", "read_run", "render_html", "report_main", "wandb_config", "wandb_items", "wandb_records",
           "write_report"]

#: scalar keys that are per-layer but belong to no method section of their own
_SHARED = ("lr_eff",)
_NOT_METHODS = ("trainer", "train", "val", "test", "lr_eff", "callbacks", "_wandb")


@dataclass
class RunData:
    """What a run logged, whatever the logger: ``scalars[key] = [(step, value)]``,
    ``images[key] = [(step, caption, png bytes)]``, ``tables[key] = [(step, columns, rows)]``,
    ``config`` (hyper-parameters and ``callbacks/<state key>`` settings)."""

    kind: str
    path: Path
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: defaultdict(list))
    images: dict[str, list[tuple[int, str, bytes]]] = field(default_factory=lambda: defaultdict(list))
    tables: dict[str, list[tuple[int, list[str], list[list]]]] = field(default_factory=lambda: defaultdict(list))
    config: dict = field(default_factory=dict)
    #: what the reader left out of damaged files, one line each (``report`` prints them as warnings)
    notes: list[str] = field(default_factory=list)


class ReportError(ValueError):
    """A run directory the report cannot read; the message is one line naming the fix."""


# ----------------------------------------------------------------------------- W&B offline runs
#
# wandb (0.31) ships no Python reader for an offline run's transaction log, which its Go core
# writes: a LevelDB-style log (google/leveldb doc/log_format.md: 32 KiB blocks of chunks with a
# CRC-32, length and type) behind a 7-byte header; each entry is a wandb_internal_pb2.Record.

_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")  # checksum, length, chunk type
_FULL, _LAST = 1, 4


def wandb_records(path: str | Path) -> list:
    """All records of a ``.wandb`` file, in order, as ``wandb_internal_pb2.Record`` messages
    (every chunk's CRC-32 checked, so a changed format fails loudly)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ReportError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    out, parts, pos = [], [], 7
    while pos + _CHUNK.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK.size:  # the block's trailer is padding
            pos += room
            continue
        checksum, length, kind = _CHUNK.unpack_from(data, pos)
        chunk = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        pos += _CHUNK.size + length
        if kind == 0 and length == 0:
            continue
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != checksum:
            raise ReportError(f"{path}: checksum mismatch at byte {pos}; unknown W&B log format")
        parts.append(chunk)
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def wandb_config(path: str | Path, records: list | None = None) -> dict:
    """The run config as W&B would sync it: the run record's config, then every update."""
    config: dict = {}
    for record in wandb_records(path) if records is None else records:
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in items:
            config[item.key] = json.loads(item.value_json)
    return config


def wandb_items(items, into: dict | None = None) -> dict:
    """History or summary items as a dict; a nested value may come as one item per leaf
    (``nested_key = [key, "_type"]`` ...), so items are merged by their path."""
    values: dict = {} if into is None else into
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        node = values
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = json.loads(item.value_json)
    return values


def _read_wandb(folder: Path) -> RunData:
    logs = sorted(folder.glob("run-*.wandb"))
    run = RunData("wandb", folder)
    records = wandb_records(logs[0])
    run.config = {k: v for k, v in wandb_config(logs[0], records).items() if k != "_wandb"}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            _add_wandb_row(run, folder / "files", wandb_items(record.history.item))
    return run


def _add_wandb_row(run: RunData, files: Path, values: dict) -> None:
    """One W&B history row into ``run``: numbers as scalars, image and table files as such."""
    step = int(values.get("trainer/global_step", values.get("_step", 0)))
    for key, v in values.items():
        if key.startswith("_") or key == "trainer/global_step":
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            run.scalars[key].append((step, float(v)))
            continue
        kind = v.get("_type") if isinstance(v, dict) else None
        if kind == "images/separated":
            captions = v.get("captions") or [""] * len(v["filenames"])
            for name, cap in zip(v["filenames"], captions):
                run.images[key].append((step, str(cap), (files / name).read_bytes()))
        elif kind == "image-file":
            run.images[key].append((step, str(v.get("caption", "")), (files / v["path"]).read_bytes()))
        elif kind == "table-file":
            table = json.loads((files / v["path"]).read_text())
            run.tables[key].append((step, list(table["columns"]), table["data"]))


# ----------------------------------------------------------------------------- TensorBoard, CSV


def _parse_markdown_table(text: str) -> tuple[list[str], list[list]] | None:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return None

    def cells(line):
        return [c.strip().replace("\\|", "|") for c in line.strip("|").split(" | ")]

    def num(c):
        try:
            return float(c)
        except ValueError:
            return c if c else None

    columns = cells(lines[0])
    return columns, [[r[0]] + [num(c) for c in r[1:]] for r in (cells(ln) for ln in lines[2:])]


def _read_tensorboard(folder: Path) -> RunData:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    run = RunData("tensorboard", folder)
    tags = acc.Tags()
    for tag in tags.get("scalars", []):
        run.scalars[tag] = [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
    for tag in tags.get("images", []):
        key, _, caption = tag.rpartition("/esd/")
        key, caption = (f"{key}/esd", caption) if key else (tag, "")
        run.images[key] += [(int(e.step), caption, e.encoded_image_string) for e in acc.Images(tag)]
    for tag in tags.get("tensors", []):
        if not tag.endswith("/text_summary"):
            continue
        key = tag[: -len("/text_summary")]
        for e in acc.Tensors(tag):
            table = _parse_markdown_table(e.tensor_proto.string_val[0].decode())
            if table is not None and not key.endswith("/settings"):
                run.tables[key].append((int(e.step), *table))
    for images in run.images.values():
        images.sort(key=lambda t: t[0])
    run.config = _hparams(folder)
    return run


def _hparams(folder: Path) -> dict:
    import yaml

    path = folder / "hparams.yaml"
    try:
        return dict(yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.exists() else {}
    except (yaml.YAMLError, UnicodeDecodeError):  # objects Lightning dumped with Python tags, or damage: left out
        return {}


def _csv_rows(path: Path, notes: list[str]) -> list[dict]:
    """The rows of a CSVLogger ``metrics.csv``; a :class:`ReportError` naming the file when it is
    not UTF-8 text or holds no row, and the last row left out (with a note) when the file was cut
    inside it: a number cut short would be a plausible wrong value."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): it is not "
                          "the metrics.csv a CSVLogger writes, or it is damaged; pass the run's version directory, "
                          "or rewrite the file as UTF-8") from None
    header, _, _ = text.partition("\n")
    if "\n" in text and not text.endswith("\n"):  # cut inside the last row
        text, _, cut = text.rpartition("\n")
        notes.append(f"{path}'s last row is cut short ({len(next(csv.reader([cut])))} of "
                     f"{len(next(csv.reader([header])))} fields, no line end): left out; the file was truncated, "
                     "or the run was still writing it")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    if not rows:
        what = "is empty" if not text.strip() else "holds a header and no row"
        raise ReportError(f"{path} {what}: the run logged nothing (yet), or the file was cut short; run report once "
                          "the fit has logged a step (its loggers' log_every_n_steps), or pass another run's directory")
    return rows


def _read_csv(folder: Path) -> RunData:
    run = RunData("csv", folder)
    for row in _csv_rows(folder / "metrics.csv", run.notes):
        step = int(float(row.get("step") or 0))
        for key, value in row.items():
            if key in ("step",) or value in ("", None):
                continue
            try:
                run.scalars[key].append((step, float(value)))
            except ValueError:
                continue
    run.config = _hparams(folder)
    return run


def read_run(path: str | Path) -> RunData:
    """Read a run directory (kind found from its files); :class:`ReportError` naming what was
    expected when it is none of the three. A Hugging Face Trainer's run reads as a Lightning one
    (:func:`_without_hf_prefix`)."""
    return _without_hf_prefix(_read_any(path))


#: the prefix the Hugging Face Trainer's integrations (TensorBoard, W&B) put before each training log key
_HF_PREFIX = "train/"


def _without_hf_prefix(run: RunData) -> RunData:
    """The Trainer's ``report_to`` integrations log ``tempbalance/alpha/<layer>`` as
    ``train/tempbalance/alpha/<layer>`` (``lr_eff/<layer>`` as ``train/lr_eff/<layer>``): those keys
    under the callbacks' own names. Only per-layer keys (prefix/quantity/layer, or ``lr_eff/layer``)
    move; ``train/loss`` stays, and a key logged both ways keeps the unprefixed series."""
    for store in (run.scalars, run.images, run.tables):
        for key in [k for k in store if k.startswith(_HF_PREFIX)]:
            rest = key[len(_HF_PREFIX):]
            if rest.count("/") >= 2 or (rest.startswith("lr_eff/") and rest.count("/") == 1):
                if rest not in store:
                    store[rest] = store.pop(key)
    return run


def _read_any(path: str | Path) -> RunData:
    folder = Path(path)
    if not folder.is_dir():
        raise ReportError(f"{path}: no such directory; pass the run's directory (printed at the end of fit)")
    if list(folder.glob("run-*.wandb")):
        return _read_wandb(folder)
    runs = sorted(folder.glob("offline-run-*")) + sorted(folder.glob("wandb/offline-run-*"))
    if len(runs) == 1:
        return _read_wandb(runs[0])
    if len(runs) > 1:
        raise ReportError(f"{path} holds {len(runs)} W&B runs; pass one of them, e.g. {runs[-1]}")
    if list(folder.glob("events.out.tfevents.*")):
        return _read_tensorboard(folder)
    if (folder / "metrics.csv").exists():
        return _read_csv(folder)
    raise ReportError(f"{path}: no metrics.csv, TensorBoard event file or offline W&B run (run-*.wandb) in it; "
                      "pass the run's version directory or W&B run folder (printed at the end of fit)")


# ----------------------------------------------------------------------------- figures


def _png(fig) -> bytes:
    from lalr_lightning import viz

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    viz._close(fig)
    return buf.getvalue()


def _curves(title: str, series: dict[str, list[tuple[int, float]]]) -> bytes:
    from lalr_lightning.viz import _new_figure

    fig = _new_figure((6.4, 3.8))
    ax = fig.add_subplot()
    for name, points in series.items():
        steps, values = zip(*sorted(points))
        ax.plot(steps, values, marker="." if len(points) < 30 else None, lw=1.2, label=name)
    ax.set_xlabel("step")
    ax.set_title(title)
    if len(series) <= 12:
        ax.legend(fontsize="x-small", loc="best")
    return _png(fig)


def _heatmap(title: str, series: dict[str, list[tuple[int, float]]]) -> bytes:
    from lalr_lightning import viz

    steps = sorted({s for points in series.values() for s, _ in points})
    col = {s: i for i, s in enumerate(steps)}
    values = np.full((len(series), len(steps)), np.nan)
    for r, points in enumerate(series.values()):
        for s, v in points:
            values[r, col[s]] = v
    return _png(viz.plot_heatmap(values, list(series), steps, title=title, xlabel="step"))


# ----------------------------------------------------------------------------- the page


def _per_layer(run: RunData, prefix: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{quantity: {layer: [(step, value)]}}`` of ``<prefix>/<quantity>/<layer>`` scalars."""
    out: dict[str, dict] = defaultdict(dict)
    for key, points in run.scalars.items():
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == prefix and points:
            out[parts[1]][parts[2]] = points
    return dict(sorted(out.items()))


def methods(run: RunData) -> list[str]:
    """The log prefixes of the callbacks in the run, sorted."""
    found = {k.split("/", 1)[0] for k in run.scalars if k.count("/") >= 2}
    found |= {k.split("/", 1)[0] for k in (*run.images, *run.tables) if "/" in k}
    return sorted(p for p in found if p not in _NOT_METHODS)


def _img(png: bytes, alt: str) -> str:
    return (f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
            f"<figcaption>{html.escape(alt)}</figcaption></figure>")


def _table_html(columns: list[str], rows: list[list]) -> str:
    def fmt(v):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return ""
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _final_table(run: RunData, prefix: str, quantities: dict) -> tuple[str, list[str], list[list]] | None:
    logged = run.tables.get(f"{prefix}/decisions") or run.tables.get(f"{prefix}/final")
    if logged:
        step, columns, rows = logged[-1]
        return f"last decision (step {step})", columns, rows
    if not quantities:
        return None
    layers: list[str] = []
    for series in quantities.values():
        layers += [n for n in series if n not in layers]
    rows = [[n] + [max(q[n])[1] if n in q else None for q in quantities.values()] for n in layers]
    return "last logged values", ["layer", *quantities], rows


def callbacks_of(run: RunData) -> dict[str, tuple[str, type | None, dict]]:
    """``{log prefix: (class name, class or None, settings)}`` of the callbacks whose settings
    the run config holds (``callbacks/<Class>[<name>]``); the class is None where this
    lalr_lightning does not have it."""
    try:
        from lalr_lightning import callbacks
    except ImportError:  # pragma: no cover -- the report of a run needs no Lightning otherwise
        callbacks = None
    out: dict[str, tuple[str, type | None, dict]] = {}
    for key, settings in run.config.items():
        if not key.startswith("callbacks/") or not isinstance(settings, dict):
            continue
        rest = key.split("/", 1)[1]  # Class, Class[name] or Class{settings} (callbacks.keys)
        cls_name = re.match(r"[^\[{]*", rest).group(0)
        name = rest[len(cls_name) + 1:-1] if rest[len(cls_name):].startswith("[") else ""
        cls = getattr(callbacks, cls_name, None) if callbacks is not None else None
        prefix = name or (cls.traits.log_prefix if hasattr(cls, "traits") else None)
        if prefix:
            out[prefix] = (cls_name, cls if isinstance(cls, type) else None, settings)
    return out


def method_titles(run: RunData) -> dict[str, str]:
    """``{log prefix: method name}`` from the callbacks' settings in the run config: callbacks
    that share a prefix are told apart by the ``SurgicalLayerSelect`` mode that builds them
    (``BlockSchedule(schedule="lisa")`` logs under ``surgical/`` and is titled ``lisa``)."""
    try:
        from lalr_lightning.callbacks.selection import _REGISTRY
    except ImportError:  # pragma: no cover
        return {}
    titles: dict[str, str] = {}
    for prefix, (_, cls, settings) in callbacks_of(run).items():
        modes = [m for m, (c, fixed) in _REGISTRY.items()
                 if c is cls and fixed and all(settings.get(k) == v for k, v in fixed.items())]
        if modes:
            titles[prefix] = modes[0] if prefix == cls.traits.log_prefix else f"{prefix} ({modes[0]})"
    return titles


def _no_esd_reason(run: RunData, prefix: str) -> str:
    """Why the run holds no ESD plots of ``prefix``'s callback: the first true reason of these."""
    cls_name, cls, settings = callbacks_of(run).get(prefix, ("", None, {}))
    analyze = ("<code>python -m lalr_lightning analyze</code> on the checkpoint plots the ESD of every weight "
               "matrix")
    if cls is not None and not (cls.traits.esd_plots if hasattr(cls, "traits") else True):
        return (f"{html.escape(cls_name)} makes no ESD plots: it decides about blocks or tensors, not about single "
                f"weight matrices from their spectra; {analyze}.")
    if run.kind == "csv":
        return f"CSVLogger keeps scalars only; use WandbLogger or TensorBoardLogger, or {analyze}."
    if settings.get("figures") == "never":
        return (f"not drawn: {html.escape(cls_name)} ran with <code>figures='never'</code> (the default: a set of ESD "
                f"plots costs more than a decision); pass <code>figures='first_last'</code> or "
                f"<code>'every'</code>, or {analyze}.")
    return f"none logged; {analyze}."


def _method_section(run: RunData, prefix: str, title: str | None = None) -> str:
    # every image is labelled by its method (LISA's, not the shared "surgical/" key's) and says
    # which logged key it shows
    method = title or prefix
    quantities = _per_layer(run, prefix)
    parts = [f'<section id="{html.escape(prefix)}"><h2>{html.escape(method)}</h2>']
    if method != prefix:  # the keys to look for in TensorBoard / W&B are the prefix's, not the title's
        who = callbacks_of(run).get(prefix, ("",))[0]
        parts.append(f"<p class=keys>logged as <code>{html.escape(prefix)}/&lt;quantity&gt;/&lt;layer&gt;</code>"
                     + (f" ({html.escape(who)}'s log prefix)" if who else "") + "</p>")
    final = _final_table(run, prefix, quantities)
    if final:
        what, columns, rows = final
        parts.append(f"<h3>Decision table ({html.escape(what)})</h3>" + _table_html(columns, rows))
    heatmaps = {k: v for k, v in run.images.items() if k.startswith(prefix + "/") and k != f"{prefix}/esd" and v}
    parts.append("<h3>Heatmaps</h3><div class=grid>")
    if heatmaps:
        for key, images in sorted(heatmaps.items()):
            step, _, png = images[-1]
            parts.append(_img(png, f"{method}: {key.split('/', 1)[1]} (step {step}; logged as {key})"))
    else:  # none logged (CSV, or figures='never'): drawn here from the per-layer scalars
        for q, series in quantities.items():
            parts.append(_img(_heatmap(f"{method}: {q}", series),
                              f"{method}: {q}, layers x steps (drawn from {prefix}/{q}/<layer>)"))
    parts.append("</div><h3>Per-layer curves</h3><div class=grid>")
    for q, series in quantities.items():
        parts.append(_img(_curves(f"{method}: {q}", series), f"{method}: {q} per layer ({prefix}/{q}/<layer>)"))
    parts.append("</div>")
    esd = run.images.get(f"{prefix}/esd", [])
    parts.append("<h3>ESD plots</h3>")
    if esd:
        steps = sorted({s for s, _, _ in esd})
        for s in dict.fromkeys([steps[0], steps[-1]]):
            which = "first" if s == steps[0] else "last"
            parts.append(f"<h4>{which} set (step {s})</h4><div class=grid>")
            parts += [_img(png, f"{method}: ESD of {cap}" if cap else f"{method}: ESD") for st, cap, png in esd
                      if st == s]
            parts.append("</div>")
    else:
        parts.append(f"<p>{_no_esd_reason(run, prefix)}</p>")
    parts.append("</section>")
    return "\n".join(parts)


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h2{border-bottom:2px solid #4477aa;padding-bottom:.2em;margin-top:1.5em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#eef2f7}
.grid{display:flex;flex-wrap:wrap;gap:12px}figure{margin:0}img{max-width:560px;border:1px solid #ddd}
figcaption{font-size:.8em;color:#555}nav a{margin-right:1em}pre{background:#f6f6f6;padding:.5em}"""

# counts the images that decoded, for whoever checks the page (data-images="loaded/total")
_SCRIPT = """<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images", ok + "/" + imgs.length);
});
</script>"""


def render_html(run: RunData) -> str:
    """The report page of ``run`` (one string, every image inlined)."""
    found = methods(run)
    titles = method_titles(run)
    parts = ["<!DOCTYPE html><html lang=en><head><meta charset=utf-8>",
             f"<title>lalr_lightning report: {html.escape(run.path.name)}</title><style>{_CSS}</style></head><body>",
             f"<h1>Run report: {html.escape(run.path.name)}</h1>",
             f"<p>{html.escape(run.kind)} run in <code>{html.escape(str(run.path))}</code></p>",
             "<nav>" + "".join(f'<a href="#{html.escape(p)}">{html.escape(titles.get(p, p))}</a>' for p in found)
             + "</nav>"]
    settings = {k.split("/", 1)[1]: v for k, v in run.config.items() if k.startswith("callbacks/")}
    if settings:
        parts.append("<h2>Callback settings</h2>")
        for name, values in sorted(settings.items()):
            rows = [[k, json.dumps(v)] for k, v in values.items()] if isinstance(values, dict) else [["", str(values)]]
            parts.append(f"<h3>{html.escape(name)}</h3>" + _table_html(["setting", "value"], rows))
    if not found:
        parts.append("<p>No per-layer metrics from lalr_lightning callbacks in this run.</p>")
    parts += [_method_section(run, p, titles.get(p)) for p in found]
    shared = {k.split("/", 1)[1]: v for k, v in run.scalars.items() if k.startswith("lr_eff/") and v}
    if shared:
        parts.append("<section id=lr_eff><h2>Effective learning rates</h2><div class=grid>"
                     + _img(_curves("lr_eff/<layer>", shared), "lr_eff/<layer>") + "</div></section>")
    parts.append(_SCRIPT + "</body></html>")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None, *, run: RunData | None = None) -> Path:
    """Read ``run_dir`` (unless ``run`` is what was read from it) and write its report page to ``out``
    (default: ``report.html`` in ``run_dir``, beside the run's logs); returns ``out``."""
    page = render_html(read_run(run_dir) if run is None else run)
    out = Path(run_dir) / "report.html" if out is None else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def report_main(argv: list[str] | None = None, prog: str = "python -m lalr_lightning report") -> int:
    import sys

    p = argparse.ArgumentParser(prog=prog, description=(
        "One self-contained HTML page (no network needed) of a run's per-layer decisions: tables, heatmaps, "
        "per-layer curves, ESD plots."))
    p.add_argument("run_dir", help="a CSVLogger or TensorBoardLogger version directory, or an offline W&B run folder")
    p.add_argument("--out", default=None, help="the page to write (default: report.html in RUN_DIR)")
    args = p.parse_args(argv)
    if args.out is not None and Path(args.out).is_dir():
        print(f"{prog}: error: --out {args.out} is a directory; --out names the HTML file to write: pass "
              f"{Path(args.out) / 'report.html'}", file=sys.stderr)
        return 2
    try:
        run = read_run(args.run_dir)
    except (ReportError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        out = write_report(args.run_dir, args.out, run=run)
    except ReportError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the folder is a file, a read-only disk, ...
        print(f"{prog}: error: cannot write --out {args.out or 'report.html in the run'} ({e.strerror or e}); "
              "pass a writable path", file=sys.stderr)
        return 2
    for note in run.notes:
        print(f"{prog}: warning: {note}", file=sys.stderr)
    if not methods(run):  # the page says so too; a script reading the exit code gets a line at least
        print(f"{prog}: warning: {args.run_dir} holds no per-layer metrics of lalr_lightning callbacks "
              f"({len(run.scalars)} other series): the page shows the run's settings only", file=sys.stderr)
    print(f"report -> {out.resolve()}")
    return 0
