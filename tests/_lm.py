"""Tiny randomly initialized Hugging Face causal LMs, built offline from a config (no download).

Three families -- GPT-2 (``transformer.h.N``, HF ``Conv1D``), OPT (``model.decoder.layers.N``,
``fc1``/``fc2``) and LLaMA (``model.layers.N``, gated MLP) -- each with input and output
embeddings tied (one shared matrix: GPT-2's and OPT's default) or untied (LLaMA's default).

Tokenizer: a ``tokenizers`` WordLevel model over a fixed word list, wrapped in
``PreTrainedTokenizerFast`` (``lalr_lightning.data.causal_lm.word_tokenizer``). Chosen over the packaged MiniLM tokenizer because its vocabulary is
small (the models stay tiny: the embedding and head are ``vocab x hidden``), it has the
``<s>``/``</s>``/``<pad>`` tokens of LLaMA-style tokenizers (MiniLM's BERT tokenizer has no
BOS/EOS), and saved next to the model as ``tokenizer.json`` it exercises the same
``AutoTokenizer`` path as a real checkpoint directory. The MiniLM tokenizer is covered by the
datamodule's own default.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("gpt2", "opt", "llama")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
# the words of the offline corpus's grammar (lalr_lightning.data.causal_lm) and of the test files
WORDS = (
    "the a one two three four five six seven eight nine ten zero plus minus is are and or not "
    "cat cats dog dogs bird birds fox foxes child children robot robots teacher teachers "
    "red blue green small big quick lazy happy old young "
    "sees see likes like follows follow helps help chases chase finds find "
    "today quietly quickly often slowly . , ? ! : # instruction input response answer question "
    "add count name list repeat say word words number numbers sum of what after before"
).split()


def tiny_tokenizer(words: list[str] | None = None):
    """The package's word-level tokenizer (``<pad> <unk> <s> </s>`` + words, ``<s>`` prepended)."""
    from lalr_lightning.data.causal_lm import word_tokenizer

    return word_tokenizer(words or WORDS)


def vocab_size() -> int:
    return len(dict.fromkeys(SPECIALS + WORDS))


def tiny_config(family: str, tied: bool, *, vocab: int | None = None, hidden: int = 32, layers: int = 2,
                heads: int = 2, dropout: float = 0.0, positions: int = 64):
    """A config of ``family`` with ``tie_word_embeddings=tied``; special ids match :func:`tiny_tokenizer`."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    vocab = vocab or vocab_size()
    ids = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=positions,
                          resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=tied, **ids)
    if family == "opt":
        return OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         ffn_dim=2 * hidden, max_position_embeddings=positions, word_embed_proj_dim=hidden,
                         dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
                         tie_word_embeddings=tied, **ids)
    if family == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                           max_position_embeddings=positions, attention_dropout=dropout, tie_word_embeddings=tied,
                           **ids)
    raise ValueError(f"unknown family {family!r}; valid: {FAMILIES}")


def tiny_lm(family: str, tied: bool, *, seed: int = 0, **kw):
    """A randomly initialized ``...ForCausalLM`` (deterministic for a seed), in train mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied, **kw))
    return model.train()


def save_tiny_lm(path: str | Path, family: str = "llama", tied: bool = False, *, seed: int = 0,
                 max_shard_size: str | None = None, **kw) -> Path:
    """Write a tiny model and its tokenizer as a Hugging Face directory (safetensors; sharded
    with an index file when ``max_shard_size`` is given, e.g. ``"40KB"``)."""
    path = Path(path)
    model = tiny_lm(family, tied, seed=seed, **kw)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    tiny_tokenizer().save_pretrained(path)
    return path


def lm_module(family: str = "llama", tied: bool = False, *, lr: float = 0.1, samples: int = 8, length: int = 8,
              **kw):
    """A LightningModule training ``tiny_lm(family, tied, **kw)`` with SGD(``lr``) on ``samples``
    fixed random sequences of ``length`` tokens, batches of 4 (``lr=0``: the weights stay put)."""
    import lightning.pytorch as pl

    class TinyLMModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_lm(family, tied, **kw)

        def training_step(self, batch, _):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

        def train_dataloader(self):
            ids = torch.randint(4, 60, (samples, length), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

    return TinyLMModule()


#: the vocabulary's words without punctuation: calibration and task text
ALPHA_WORDS = [w for w in WORDS if w.isalpha()]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``python -m lalr_lightning ARGV`` in this process: (exit code, stdout, stderr)."""
    import pytest

    from lalr_lightning.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def write_calibration_text(path: Path, rng, lines: int = 30, words: int = 25) -> Path:
    """A plain-text calibration file: ``lines`` lines of ``words`` words drawn by ``rng``."""
    path.write_text("\n".join(" ".join(rng.choice(ALPHA_WORDS) for _ in range(words)) for _ in range(lines)))
    return path
