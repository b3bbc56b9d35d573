"""docs/design.md's own method (``AlphaFreeze``), on one device: its size and shape, and its
decisions against the alphas computed directly. Under DDP, FSDP1 and FSDP2 (equal to DDP, exact
resume): tests/test_fsdp.py, case ``alpha_freeze``."""

from __future__ import annotations

import io
import re
import tokenize

import torch
from _own_method import SOURCE, AlphaFreeze
from _toys import ToyMLP, make_trainer

from lalr_lightning.core.model.layers import matrix_layers
from lalr_lightning.core.spectral import htsr as spectral


def _code_lines(source: str) -> int:
    """Lines holding code: no blank line, comment, docstring or import."""
    lines: set[int] = set()
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            prev = tok.type
            continue  # a docstring
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
        prev = tok.type if tok.type not in (tokenize.COMMENT, tokenize.NL) else prev
    text = source.splitlines()
    return sum(1 for n in lines if not text[n - 1].lstrip().startswith(("import ", "from ")))


def test_the_page_method_is_short_and_names_no_strategy_nor_hook():
    assert _code_lines(SOURCE) <= 60
    assert not re.search(r"fsdp|ddp|strateg|(?<!lalr_)lightning|\bon_|setup\(|load_state_dict|_late|_whole|rank", SOURCE, re.I)


def test_it_freezes_the_matrices_below_the_threshold_every_epoch():
    model = ToyMLP(width=32)
    threshold = float(torch.tensor(list(spectral.alphas(matrix_layers(model)).values())).median())
    expected = spectral.alphas(matrix_layers(model))  # the initial weights: the first decision
    cb = AlphaFreeze(threshold=threshold)
    make_trainer([cb], max_epochs=2).fit(model)
    first = cb.history[0]
    assert first["epoch"] == 0 and first["scores"] == expected
    assert first["selected"] == {n: float(not a < threshold) for n, a in expected.items()}
    assert 0 < sum(first["selected"].values()) < len(expected)  # some frozen, some train
    assert [h["epoch"] for h in cb.history] == [0, 1]  # at the start, then once per epoch (not twice at 0)
    last = spectral.alphas(matrix_layers(model))
    assert cb.selected == [n for n, v in cb.history[-1]["selected"].items() if v > 0]
    assert set(cb.history[-1]["scores"]) == set(last)


def test_the_page_names_every_concept_the_method_uses():
    """docs/design.md says what a re-deciding selection relies on, next to the code."""
    import pathlib

    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    section = page[page.index("### Write your own callback"):page.index("## Control")]
    for concept in ("`1.0` trains, `0.0` is frozen", "`block_list`", "`title`", "`start=False` still decides at epoch 0",
                    "`switches = True`", "under its own name", "A reference tensor", "`_state()`"):
        assert concept in section, concept
    assert AlphaFreeze.switches and AlphaFreeze().cadence.start is False  # re-decides; epoch 0 without start
