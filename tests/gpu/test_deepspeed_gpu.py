"""The GPU lane's DeepSpeed checks (issue 41). Lightning's ``DeepSpeedStrategy`` refuses a CPU, so
what runs on two CPU ranks under the Hugging Face Trainer (tests/test_hf_engines.py) is checked
here on a CUDA device:

* Lightning's DeepSpeedStrategy stays refused in one line saying it is untested until this lane
  runs it, and naming the tested way (the Trainer's DeepSpeed through ``hf.trainer_callback``);
* that tested way on one GPU, ZeRO-2 in bf16 with the fp32 master weights on the device. LISA
  never moves a frozen block and trains an activated one. Spectrum's frozen parameters hold no
  fp32 partition.

Skipped without CUDA (and with ``LALR_GPU_LANE=cpu``: DeepSpeed's CUDA path is the point).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._lane import ON_CUDA

pytestmark = pytest.mark.skipif(not ON_CUDA, reason="DeepSpeed on a CUDA device: the GPU lane only")
deepspeed = pytest.importorskip("deepspeed", reason="the DeepSpeed checks need deepspeed (pip install -e '.[dev]')")


def test_lightnings_deepspeed_strategy_is_refused_in_one_line_naming_the_tested_way(tmp_path):
    import lightning.pytorch as pl

    from lalr_lightning.callbacks import SpectrumSelect
    from tests._lm import lm_module

    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="deepspeed_stage_2", max_steps=2,
                         callbacks=[SpectrumSelect(top_percent=25)], default_root_dir=tmp_path, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError) as err:
        trainer.fit(lm_module(layers=4, hidden=16))
    text = str(err.value)
    assert "\n" not in text and "untested until the GPU lane" in text and "hf.trainer_callback" in text


def _fit(tmp_path, cb):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lalr_lightning.hf import trainer_callback
    from tests._lm import tiny_lm

    model = tiny_lm("llama", False, layers=4, hidden=16, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(4, 60, (16, 10), generator=g)]
    steps = []

    class Peek(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            steps.append(([], {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}))

        def on_step_end(self, args, state, control, **kwargs):
            steps.append((list(getattr(cb, "selected", [])),
                          {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}))

    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-2, bf16=True,
                             deepspeed=ds, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[trainer_callback(cb), Peek()])
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    return trainer, model, steps


def test_lisa_under_the_trainers_zero2_on_a_gpu_switches_exactly(tmp_path):
    from lalr_lightning.callbacks import BlockSchedule

    cb = BlockSchedule("lisa", gamma=1, every_n_steps=1)
    _, model, steps = _fit(tmp_path, cb)
    blocks = {u.name: [n for n, p in model.named_parameters() if any(p is q for q in u.params.values())]
              for u in cb.layers if u.name.startswith("model.layers.")}
    for (_, before), (selected, after) in zip(steps, steps[1:]):
        for block, names in blocks.items():
            moved = max(float((after[n] - before[n]).abs().max()) for n in names)
            assert (moved > 0) == (block in selected), (block, selected, moved)


def test_spectrums_frozen_parameters_hold_no_fp32_partition_on_a_gpu(tmp_path):
    from lalr_lightning.callbacks import SpectrumSelect

    cb = SpectrumSelect(top_percent=25)
    trainer, model, _ = _fit(tmp_path, cb)
    zero = trainer.model_wrapped.optimizer
    held = {id(p) for group in zero.bit16_groups for p in group}
    frozen = [p for u in cb.layers if u.name not in cb.selected for p in u.params.values()]
    assert frozen and not any(id(p) in held for p in frozen)
    assert sum(f.numel() for f in zero.single_partition_of_fp32_groups) == sum(
        p.numel() for p in model.parameters() if id(p) in held)
