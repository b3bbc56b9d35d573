"""The model summary tells the truth: after a selection decides, its one line (and ``summary``)
gives the parameters that train, which Lightning's summary, drawn at fit start before a LISA draw,
cannot (callbacks/summary.py). The oracle: the parameters one SGD step moved."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from lalr_lightning.callbacks import BlockSchedule, SpectrumSelect, SurgicalBlocks
from tests._lm import lm_module
from tests._toys import make_trainer

LINE = re.compile(r"^(\w+): trainable ([\d.]+ ?[KMB]?) of ([\d.]+ ?[KMB]?) parameters \(([\d.]+)%\), "
                  r"(\d+) of (\d+) (blocks|layers)$")


@pytest.mark.smoke
@pytest.mark.parametrize("make", [
    lambda: BlockSchedule(schedule="lisa", gamma=1, every_n_steps=5, seed=0),  # lisa_tinyllama_offline's shape
    lambda: SpectrumSelect(top_percent=25),
    lambda: SurgicalBlocks(select="first"),
], ids=["lisa", "spectrum", "surgical"])
def test_the_selection_summary_counts_what_one_step_moved(make, caplog):
    module = lm_module("llama", False, lr=0.1, hidden=32, layers=4)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    total = sum(p.numel() for p in before.values())
    cb = make()
    with caplog.at_level(logging.INFO, logger="lalr_lightning"):
        make_trainer([cb], max_steps=1, enable_model_summary=True).fit(module)
    moved = sum(p.numel() for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n]))
    counts = cb.summary_counts  # at the decision: after the fit nothing is frozen any more
    assert counts["trainable"] == moved and counts["total"] == total and counts["frozen"] == total - moved
    assert 0 < moved < total  # a selection froze something: Lightning's "Non-trainable 0" was wrong
    # the line, once, as the user sees it
    lines = [r.getMessage() for r in caplog.records if LINE.match(r.getMessage())]
    assert lines == [cb.summary], [r.getMessage() for r in caplog.records][-10:]
    name, _, _, share, k, n, kind = LINE.match(cb.summary).groups()
    assert name == type(cb).__name__ and float(share) == pytest.approx(100 * moved / total, abs=0.06)
    units = cb.block_names or [u.name for u in cb.layers]
    assert int(n) == len(units) and int(k) == (len(cb.selected_blocks()) if cb.block_names else len(cb.selected))
    assert kind == ("blocks" if cb.block_names else "layers") == counts["kind"]


@pytest.mark.parametrize("n", [0, 7, 950, 1000, 12_300, 82_431, 99_999, 100_000, 156_000, 1_234_567, 6_738_415_616])
def test_counts_read_as_lightnings_summary_writes_them(n):
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    from lalr_lightning.callbacks.summary import human_count

    assert human_count(n) == get_human_readable_count(n).rstrip()
