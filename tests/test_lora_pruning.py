"""HT-SR / magnitude / N:M pruning of a peft LoRA model (issue 42, row 3): the model computes with
each LoRA layer's merged weight ``W + B @ A``, which pruning ``W``, ``lora_A`` and ``lora_B`` apart
leaves dense. It is refused in one line before anything is pruned, under the HF Trainer, under
Lightning and in ``plan()``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lalr_lightning import callbacks as C
from lalr_lightning.hf import trainer_callback
from tests._toys import make_trainer
from tests.test_hf import PRUNE, _ids, _model, _trainer

peft = pytest.importorskip("peft")

REFUSED = r"parts of peft LoRA layers \(.*q_proj.*merged weight.*{shape}.*merge_and_unload"
MAKERS = {
    "nm": (lambda: C.HTSRPruning(n=2, m=4, **PRUNE), "not 2:4"),
    "magnitude": (lambda: C.HTSRPruning(epsilon=0, **PRUNE), "not sparse"),
}


def _lora(targets=("q_proj", "v_proj")):
    return peft.get_peft_model(_model(), peft.LoraConfig(r=4, target_modules=list(targets)))


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(MAKERS))
def test_pruning_a_lora_model_under_the_hf_trainer_is_refused_before_pruning(tmp_path, name):
    make, shape = MAKERS[name]
    model = _lora()
    before = _weights(model)
    trainer, _ = _trainer(tmp_path, [trainer_callback(make())], steps=1, model=model)
    with pytest.raises(ValueError, match=REFUSED.format(shape=shape)) as info:
        trainer.train()
    assert "\n" not in str(info.value)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing pruned


class _LoraModule(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, i):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def test_pruning_a_lora_model_under_lightning_and_in_plan_is_refused():
    make, shape = MAKERS["nm"]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(_ids())), batch_size=4)
    with pytest.raises(ValueError, match=REFUSED.format(shape=shape)):
        make_trainer([make()], max_steps=1).fit(_LoraModule(_lora()), loader)
    with pytest.raises(ValueError, match=REFUSED.format(shape="not sparse")):
        MAKERS["magnitude"][0]().plan(_lora())

