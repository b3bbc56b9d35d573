"""What a researcher sees of a run: W&B (offline, read back from its transaction log) and
TensorBoard (EventAccumulator) hold a decision table per decision, the heatmap and ESD plots when
the callback's ``figures`` setting says (every decision, the first and last, never), the settings
in the run config and a final summary; the report page is built from CSV, TensorBoard and W&B run
directories, labels every image by its method, says truly why a section has no ESD plots, and
renders in a real headless browser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

import lalr_lightning.callbacks as cbs
from lalr_lightning import report
from lalr_lightning.dashboards import decision_table, markdown_table
from tests._browser import CHROMIUM, NO_CHROMIUM, render
from tests._toys import make_trainer
from tests.test_contract import _loader, _model

wandb = pytest.importorskip("wandb")

# Two fits cover every callback (the selection callbacks cannot share a fit with L-MSA, which
# refuses blocks others turned off) and every ``figures`` setting; each entry: (how to build it,
# ESD plots expected when figures are drawn: its layers are weight matrices).
FITS = {
    "spectral": [
        (lambda: cbs.TempBalanceCallback(min_evals=5, figures="every"), True),
        (lambda: cbs.LALRScheduleCallback(groups="histogram", figures="first_last"), True),
        (lambda: cbs.HTSRPruning(target_sparsity=0.3, min_numel=16, min_evals=3, figures="first_last"), True),
        (lambda: cbs.LMSAStepper(update="optimizer", figures="every"), False),
    ],
    "selection": [
        (lambda: cbs.SurgicalLayerSelect(mode="blocks", select="last", name="blocks"), False),  # figures="never"
        (lambda: cbs.SurgicalLayerSelect(mode="auto_rgn", n_batches=2, name="auto_rgn", figures="every"), False),
        (lambda: cbs.SurgicalLayerSelect(mode="lisa", gamma=1, every_n_steps=2, name="lisa", figures="first_last"),
         False),
    ],
}


def _drawn_at(cb, n_dec: int) -> list[int]:
    """The history lengths (1 = the first decision) at which ``cb`` draws its figures."""
    return {"every": list(range(1, n_dec + 1)), "first_last": sorted({1, n_dec}), "never": []}[cb.figures]


def _wait_for_exit(log: Path, timeout: float = 60.0) -> None:
    """wandb's core process may still be writing the log after ``finish`` returns on a busy
    machine: wait for the exit record and a file size that stays put."""
    import time

    end, size = time.monotonic() + timeout, -1
    while time.monotonic() < end:
        now = log.stat().st_size
        if now == size and any(r.WhichOneof("record_type") == "exit" for r in report.wandb_records(log)):
            return
        size = now
        time.sleep(0.5)


def _expected_esd_layers(cb) -> int:
    return len([la for la in cb.layers if la.role == "matrix" and la.name in (cb.scores or {})])


@pytest.mark.parametrize("fit", list(FITS))
def test_wandb_and_tensorboard_hold_tables_heatmaps_esds_settings_and_summary(fit, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    callbacks = [(make(), spectral) for make, spectral in FITS[fit]]
    wb = WandbLogger(save_dir=str(tmp_path), project="dash")
    tb = TensorBoardLogger(str(tmp_path / "tb"), name="", version="run")
    make_trainer([cb for cb, _ in callbacks], max_epochs=2, logger=[wb, tb], log_every_n_steps=1).fit(
        _model(), _loader())
    wandb.finish()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    _wait_for_exit(next(folder.glob("run-*.wandb")))
    run = report.read_run(folder)
    records = report.wandb_records(next(folder.glob("run-*.wandb")))
    globs = {r.metric.glob_name: r.metric.step_metric for r in records if r.WhichOneof("record_type") == "metric"}
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            report.wandb_items(r.summary.update, summary)
    acc = EventAccumulator(str(tmp_path / "tb" / "run"), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    pages = [report.render_html(run), report.render_html(report.read_run(tmp_path / "tb" / "run"))]

    assert len({cb.prefix for cb, _ in callbacks}) == len(callbacks)
    for cb, spectral in callbacks:
        p, n_dec = cb.prefix, len(cb.history)
        assert n_dec >= 1, p
        last = cb.history[-1][cb.traits.decision_attr]
        last = {u: float(u in last) for u in cb.selected} if isinstance(last, list) else last

        # ---- W&B, read back from the offline run
        tables = run.tables[f"{p}/decisions"]
        assert len(tables) == n_dec, p  # one table per decision
        _, columns, rows = tables[-1]
        assert columns[0] == "layer" and columns[-1] == cb.traits.decision_key
        assert (cb.traits.score_key in columns) == bool(cb.history[-1].get("scores")), p
        assert {r[0]: r[-1] for r in rows} == pytest.approx(last), p
        assert type(cb).traits.esd_plots is spectral, p
        heatmap = f"{p}/{cb.traits.heatmap[0]}" if cb.traits.heatmap else None
        drawn = _drawn_at(cb, n_dec)
        n_maps = len([e for e in drawn if e >= cb.traits.heatmap_min_entries]) if heatmap else 0
        assert len(run.images.get(heatmap, [])) == n_maps, p  # re-logged at each drawing decision
        esd = run.images.get(f"{p}/esd", [])
        n_esd = len(esd)
        if spectral and drawn:
            sets = sorted({s for s, _, _ in esd})
            per_set = _expected_esd_layers(cb)
            assert per_set >= 3 and len(esd) == per_set * len(sets), p
            assert len(sets) == len(drawn), p  # every decision, or the first and the last (or fit end)
            assert {c for s, c, _ in esd if s == sets[0]} == set(cb.scores), p
            assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for _, _, png in esd)
        else:
            assert esd == [], p
        assert run.config[f"callbacks/{cb.state_key}"] == json.loads(json.dumps(cb.settings())), p
        assert globs[f"{p}/*"] == "trainer/global_step" and globs["lr_eff/*"] == "trainer/global_step"
        assert f"{p}/final" in summary, sorted(summary)
        final = summary[f"{p}/final"]
        assert {k: v[cb.traits.decision_key] for k, v in final.items()} == pytest.approx(last), p
        assert summary[f"{p}/decisions_made"] == n_dec

        # ---- TensorBoard
        texts = acc.Tensors(f"{p}/decisions/text_summary")
        assert len(texts) == n_dec, p
        md = texts[-1].tensor_proto.string_val[0].decode().splitlines()
        assert md[0] == "| " + " | ".join(columns) + " |" and len(md) == 2 + len(rows), p
        assert (len(acc.Images(heatmap)) if heatmap in tags["images"] else 0) == n_maps, p
        esd_tags = [t for t in tags["images"] if t.startswith(f"{p}/esd/")]
        assert len(esd_tags) == (_expected_esd_layers(cb) if spectral and drawn else 0), p
        assert any(t.startswith(f"{p}/{cb.traits.decision_key}/") for t in tags["scalars"]), p
        assert f"{p}/final/text_summary" in tags["tensors"] and f"{p}/settings/text_summary" in tags["tensors"]

        # ---- the report of both runs: the method's section with its table and images
        for page in pages:
            section = page.split(f'<section id="{p}">')[1].split("</section>")[0]
            assert f"<td>{rows[0][0]}</td>" in section, p
            # the last heatmap, a curve per quantity, the ESDs of the first and last set
            assert section.count("<img") >= min(n_maps, 1) + len(_per_layer_quantities(run, p)) + (
                n_esd), p
    for page in pages:
        assert "http://" not in page and "https://" not in page  # nothing to fetch


def _per_layer_quantities(run, prefix):
    return {k.split("/")[1] for k in run.scalars if k.startswith(prefix + "/") and k.count("/") >= 2}


class _Refusing(Logger):
    """A logger that takes scalars only and refuses everything else."""

    name, version = "refusing", 0

    def __init__(self):
        super().__init__()
        self.metrics = []

    @property
    def experiment(self):
        return None

    def log_hyperparams(self, params, *args, **kwargs):
        if any(str(k).startswith("callbacks/") for k in params):  # ours; Lightning's own pass
            raise TypeError("no nested hyperparameters here")

    def log_metrics(self, metrics, step=None):
        self.metrics.append(dict(metrics))


def test_csv_and_unknown_loggers_get_scalars_and_settings_and_never_fail_the_run(tmp_path):
    import yaml

    tb = cbs.TempBalanceCallback(min_evals=5)
    other = _Refusing()
    make_trainer([tb], max_epochs=2, logger=[CSVLogger(str(tmp_path), name="", version="csv"), other],
                 log_every_n_steps=1).fit(_model(), _loader())
    assert any("tempbalance/alpha/model.layer1.0.conv1" in m for m in other.metrics)
    hparams = yaml.safe_load((tmp_path / "csv" / "hparams.yaml").read_text())
    assert hparams[f"callbacks/{tb.state_key}"] == tb.settings()  # TempBalanceCallback{'min_evals': 5}
    run = report.read_run(tmp_path / "csv")
    assert run.kind == "csv" and not run.images and not run.tables  # CSV keeps the scalars only
    page = report.render_html(run)
    assert '<section id="tempbalance">' in page and "last logged values" in page
    assert "CSVLogger keeps scalars only" in page  # why there are no ESD plots
    # a heatmap and a curve per quantity (alpha, multiplier), the lr_eff curves, all drawn here
    assert page.count("<img") == 5
    table = page.split("Decision table")[1].split("</table>")[0]
    for layer, mult in tb.multipliers.items():
        assert f"<td>{layer}</td>" in table and f"<td>{mult:.4g}</td>" in table


def test_report_of_a_tensorboard_lisa_run_labels_by_method_and_gives_the_true_reasons(tmp_path):
    """LISA logs under the shared ``surgical/`` prefix: its section is titled ``lisa`` and every
    image in it is labelled ``lisa: ...``; its missing ESD plots are explained by what LISA is
    (it selects blocks), not by the logger, and TempBalance's by its ``figures`` setting."""
    import re

    lisa = cbs.BlockSchedule(schedule="lisa", gamma=1, every_n_steps=2, figures="every")
    tb = cbs.TempBalanceCallback(min_evals=5)  # figures="never", the default
    logger = TensorBoardLogger(str(tmp_path), name="", version="tb")
    make_trainer([lisa, tb], max_epochs=2, logger=logger, log_every_n_steps=1).fit(_model(), _loader())
    assert len(lisa.history) >= 3
    page = report.render_html(report.read_run(tmp_path / "tb"))
    section = page.split('<section id="surgical">')[1].split("</section>")[0]
    assert section.startswith("<h2>lisa</h2>")
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", section)
    assert captions and all(c.startswith("lisa: ") for c in captions), captions
    assert any("logged as surgical/selection" in c for c in captions)  # the heatmap LISA drew
    esd = section.split("<h3>ESD plots</h3>")[1]
    assert "BlockSchedule makes no ESD plots: it decides about blocks or tensors" in esd
    assert "CSVLogger" not in page
    tempbalance = page.split('<section id="tempbalance">')[1].split("</section>")[0]
    assert "ran with <code>figures='never'</code>" in tempbalance
    assert all(c.startswith("tempbalance: ") for c in re.findall(r"<figcaption>(.*?)</figcaption>", tempbalance))


def test_decision_table_and_markdown_are_the_decision():
    from lalr_lightning.callbacks.base import Decision

    tb = cbs.TempBalanceCallback()
    d = Decision(values={"a": 0.5, "b": 1.5}, scores={"a": 2.0, "b": float("nan")}, measurements={"xmin": {"a": 0.1}})
    cols, rows = decision_table(tb, d)
    assert cols == ["layer", "alpha", "xmin", "multiplier"]
    assert rows == [["a", 2.0, 0.1, 0.5], ["b", None, None, 1.5]]
    assert markdown_table(cols, rows).splitlines() == [
        "| layer | alpha | xmin | multiplier |", "|---|---|---|---|", "| a | 2 | 0.1 | 0.5 |", "| b |  |  | 1.5 |"]


@pytest.mark.parametrize("name", sorted(n for n in cbs.__all__ if isinstance(getattr(cbs, n), type)
                                         and issubclass(getattr(cbs, n), cbs.LayerwiseCallback)
                                         and getattr(cbs, n) not in (cbs.LayerwiseCallback, cbs.LayerSelection)))
def test_figures_is_one_setting_every_callback_takes_and_a_resume_may_change(name):
    from tests.test_contract import CASES

    cls, kw = getattr(cbs, name), CASES[name][0]
    assert cls(**kw).settings()["figures"] == "never"  # the default: figures cost more than a decision
    for figures in ("every", "first_last", "never", 3):
        cb = cls(**kw, figures=figures)
        assert cb.figures == figures and cb.settings()["figures"] == figures
    state = cls(**kw, figures=3).state_dict()
    cls(**kw, figures="every").load_state_dict(state)  # only what is drawn: not refused
    # the deprecated name keeps its meaning (ESD plots every N epochs, and the first and last)
    with pytest.warns(DeprecationWarning, match="plot_every_n_epochs= is deprecated .* use figures="):
        assert cls(**kw, plot_every_n_epochs=2).figures == 2
    with pytest.raises(ValueError, match="plot_every_n_epochs must be None .* or an integer >= 1, got 0"):
        cls(**kw, plot_every_n_epochs=0)
    with pytest.raises(ValueError, match=r"figures must be 'every' .*, 'first_last' .*, 'never', or a number of "
                                         r"epochs N >= 1 .*; got 'sometimes'"):
        cls(**kw, figures="sometimes")
    assert cls(**kw, figures="2").figures == 2  # as a command line gives it


def test_report_command_names_what_it_needs(tmp_path, capsys):
    from lalr_lightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.csv, TensorBoard event file or offline W&B run" in err[0]



@pytest.mark.parametrize("where, phrase", [("dir", "is a directory; --out names the HTML file"),
                                           ("file/page.html", "cannot write --out")])
def test_report_with_an_out_it_cannot_write_names_the_fix(tmp_path, capsys, where, phrase):
    from lalr_lightning.report import report_main

    run = tmp_path / "version_0"
    run.mkdir()
    (run / "metrics.csv").write_text("step,tempbalance/alpha/model.layer2\n0,3.0\n5,2.5\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("mine")
    assert report_main([str(run), "--out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0] and "pass " in err[0], err
    assert (tmp_path / "file").read_text() == "mine"


# ----------------------------------------------------------------------------- a real browser

@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
def test_report_renders_in_a_headless_browser(tmp_path):
    logger = CSVLogger(str(tmp_path), name="", version="csv")
    make_trainer([cbs.TempBalanceCallback(min_evals=5)], max_epochs=2, logger=logger, log_every_n_steps=1).fit(
        _model(), _loader())
    out = report.write_report(tmp_path / "csv", tmp_path / "report.html")
    n_img = out.read_text().count("<img")
    assert n_img == 5  # 2 heatmaps, 2 curves, lr_eff
    url = out.resolve().as_uri()
    _, dom, shot_err, dom_err = render(url, tmp_path)
    assert f'data-images="{n_img}/{n_img}"' in dom  # every image decoded
    console = [ln for ln in (shot_err + dom_err).splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert console == []
