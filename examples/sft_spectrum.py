"""Spectrum on TRL's ``SFTTrainer``: ``SpectrumSelect(top_percent=25)`` picks the quarter of each
kind of weight matrix with the highest signal-to-noise ratio (random-matrix theory, from the
weights alone) and freezes the rest before the trainer builds its optimizer, so the frozen ones
get no gradient and no optimizer state.

    python examples/sft_spectrum.py                          # a tiny LLaMA built offline (seconds)
    python examples/sft_spectrum.py --model Qwen/Qwen2.5-0.5B --steps 100

``lalr_lightning analyze MODEL --spectrum 25`` writes the same choice, made once, as axolotl's
``unfrozen_parameters`` YAML; this callback makes it on the model the trainer holds (docs/hf.md).
"""

from __future__ import annotations

import argparse

import datasets
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig, SFTTrainer

from lalr_lightning.callbacks import SpectrumSelect
from lalr_lightning.data.causal_lm import offline_corpus, word_tokenizer
from lalr_lightning.hf import trainer_callback


def tiny_llama(vocab: int, layers: int = 4) -> torch.nn.Module:
    """A small LLaMA from its config (no download): what CI runs the example on."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg)


def main(argv: list[str] | None = None) -> tuple[SFTTrainer, SpectrumSelect]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face causal LM (default: a tiny LLaMA built offline)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top-percent", type=float, default=25)
    p.add_argument("--output-dir", default="sft_spectrum_out")
    a = p.parse_args(argv)

    if a.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model)
    else:
        tokenizer = word_tokenizer()
        model = tiny_llama(len(tokenizer))
    data = datasets.Dataset.from_dict({"text": offline_corpus(64)})
    spectrum = SpectrumSelect(top_percent=a.top_percent)
    args = SFTConfig(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                     max_length=32, logging_steps=2, save_strategy="no", report_to="none",
                     use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         callbacks=[trainer_callback(spectrum)])
    trainer.train()
    print(f"Spectrum {a.top_percent:g}%: trains {len(spectrum.selected)} of {len(spectrum.layers)} layers")
    return trainer, spectrum


if __name__ == "__main__":
    main()
