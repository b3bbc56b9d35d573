"""The examples a user copies: they must train the way they say they do."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lalr_example_fine_tunes_with_dropout_active():
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from lalr_lightning.text_assets import minilm_path

    example = _load_example("lalr_on_your_trainer")
    path = minilm_path()
    module = example.SentimentModule(path)
    dropouts = [m for m in module.net.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    assert dropouts, "MiniLM has dropout layers (p=0.1)"
    seen: list[bool] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append(mod.training)) for m in dropouts]

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, example.sentiment_loader(tokenizer, 16, 0, True))
    for h in hooks:
        h.remove()
    assert trainer.global_step == 1
    # the dropout layers the forward calls (attention dropout is inside SDPA) ran in training mode
    assert len(seen) >= 10 and all(seen)


def test_hf_trainer_lisa_example_switches_blocks_on_the_trainer(tmp_path):
    pytest.importorskip("transformers")
    example = _load_example("hf_trainer_lisa")
    trainer, lisa = example.main(["--steps", "4", "--every", "2", "--output-dir", str(tmp_path)])
    assert trainer.state.global_step == 4
    assert [h["step"] for h in lisa.history] == [0, 2]
    assert all(sum(h["selected"].values()) == 2 + 2 for h in lisa.history)  # gamma middle blocks + stem + head


def test_sft_spectrum_example_trains_a_quarter_on_trl(tmp_path):
    pytest.importorskip("trl")
    example = _load_example("sft_spectrum")
    trainer, spectrum = example.main(["--steps", "2", "--output-dir", str(tmp_path)])
    assert trainer.state.global_step == 2
    assert 0 < len(spectrum.selected) < len(spectrum.layers)
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    frozen = {id(p) for u in spectrum.layers if u.name not in set(spectrum.selected) for p in u.params.values()}
    assert frozen and not frozen & {id(p) for p in opt.state}
