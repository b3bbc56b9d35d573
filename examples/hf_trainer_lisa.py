"""LISA on Hugging Face's ``transformers.Trainer``: the package's ``BlockSchedule`` as a
``TrainerCallback`` (``lalr_lightning.hf.trainer_callback``), on the Trainer's own AdamW and
warmup schedule, with gradient accumulation and clipping as the Trainer does them.

    python examples/hf_trainer_lisa.py                       # a tiny LLaMA built offline (seconds)
    python examples/hf_trainer_lisa.py --model meta-llama/Llama-3.2-1B --steps 200

The state of the callback goes into each checkpoint folder (``lalr_lightning.pt``) and comes
back with ``trainer.train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from lalr_lightning.callbacks import BlockSchedule
from lalr_lightning.data.causal_lm import offline_corpus, word_tokenizer
from lalr_lightning.hf import trainer_callback


def tiny_llama(vocab: int, layers: int = 4) -> torch.nn.Module:
    """A small LLaMA from its config (no download): what CI runs the example on."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg)


def token_rows(tokenizer, n: int, length: int = 16) -> list[dict]:
    """Sentences of the package's offline corpus as fixed-length causal-LM rows (labels = inputs,
    padding ignored)."""
    rows = []
    for text in offline_corpus(n):
        ids = tokenizer(text, max_length=length, truncation=True, padding="max_length")["input_ids"]
        ids = torch.tensor(ids)
        rows.append({"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).long(),
                     "labels": ids.masked_fill(ids == tokenizer.pad_token_id, -100)})
    return rows


def main(argv: list[str] | None = None) -> tuple[Trainer, BlockSchedule]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face causal LM (default: a tiny LLaMA built offline)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gamma", type=int, default=2, help="middle blocks trained at a time")
    p.add_argument("--every", type=int, default=2, help="optimizer steps between switches (LMFlow: 20)")
    p.add_argument("--output-dir", default="hf_lisa_out")
    a = p.parse_args(argv)

    if a.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(a.model)
    else:
        tokenizer = word_tokenizer()
        model = tiny_llama(len(tokenizer))
    lisa = BlockSchedule(schedule="lisa", gamma=a.gamma, every_n_steps=a.every)   # as for Lightning
    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=1e-3, warmup_steps=2,
                             logging_steps=2, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(tokenizer, 64),
                      callbacks=[trainer_callback(lisa)])
    trainer.train()
    for entry in lisa.history:
        print(f"step {entry['step']}: trains {[b for b, on in entry['selected'].items() if on]}")
    return trainer, lisa


if __name__ == "__main__":
    main()
