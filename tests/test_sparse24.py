"""The 2:4 loader where no sparse tensor core is at hand: one line says so, and the model runs dense
with the same numbers (the GPU equality: tests/gpu/test_gpu_sparse24.py)."""

from __future__ import annotations

import random

import pytest
import torch

from lalr_lightning.cli import main
from lalr_lightning.oneshot.sparse24 import is_2_4, semi_structured_unsupported
from tests._lm import WORDS, save_tiny_lm


def test_is_2_4():
    w = torch.tensor([[1.0, 0, 2, 0, 0, 0, 3, 4], [0, 0, 0, 1, 5, 0, 0, 6]])
    assert is_2_4(w)
    w[0, 1] = 7.0  # three non-zeros in a group of four
    assert not is_2_4(w)
    assert not is_2_4(torch.zeros(2, 6))  # not a multiple of four inputs


def test_cpu_says_so_in_one_line_and_runs_dense(tmp_path, capsys):
    why = semi_structured_unsupported("cpu")
    assert "compute capability 8.0" in why and "\n" not in why
    model = save_tiny_lm(tmp_path / "m", "llama", False)
    rng = random.Random(0)
    words = [w for w in WORDS if w.isalpha()]
    (tmp_path / "t.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(20)) for _ in range(10)))
    outs = []
    for extra in ([], ["--semi-structured"]):
        with pytest.raises(SystemExit) as info:
            main(["perplexity", str(model), "--data", str(tmp_path / "t.txt"), "--seq-len", "16", *extra])
        assert info.value.code == 0
        outs.append(capsys.readouterr())
    assert outs[1].err.count("compute capability 8.0") == 1
    assert outs[0].out.split()[1] == outs[1].out.split()[1]  # the same perplexity


def test_semi_structured_linear_flattens_its_input_to_rows():
    """The converted Linear multiplies a 2-D matrix (the one product the sparse weight takes) and
    gives nn.Linear's output for a decode step's input, whose size-1 dimension has a stride of its own."""
    from lalr_lightning.oneshot.sparse24 import SemiStructuredLinear

    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 6)
    conv = torch.nn.Linear(8, 6)
    conv.load_state_dict(plain.state_dict())
    conv.__class__ = SemiStructuredLinear
    x = torch.randn(3, 8, 1).transpose(1, 2)  # (3, 1, 8), strides (8, 1, 1)
    real = torch.nn.functional.linear
    calls = []
    torch.nn.functional.linear = lambda a, *rest: calls.append(tuple(a.shape)) or real(a, *rest)
    try:
        out = conv(x)
    finally:
        torch.nn.functional.linear = real
    assert calls == [(3, 8)] and out.shape == (3, 1, 6) and isinstance(conv, torch.nn.Linear)
    torch.testing.assert_close(out, plain(x))
