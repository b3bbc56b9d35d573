"""One-shot pruning and perplexity of a Hugging Face causal-LM directory (``prune``, ``perplexity``).

One concern a module, each importing only the ones listed before it:

* ``text``: the calibration and evaluation text, and the calibration windows drawn from it;
* ``checkpoint``: a model directory (config, tokenizer, safetensors read one tensor at a time, the
  model on the meta device loaded from them) and its checks before anything runs;
* ``outdir``: the all-or-nothing output directory and its lock;
* ``prune``: the per-layer ratios and the prune, streamed one block at a time or in memory;
* ``evaluate``: the windowed perplexity and the model it evaluates;
* ``commands``: ``prune_main`` / ``perplexity_main``, their arguments and one-line errors.

Conventions and the places they differ from the reference code: ``docs/llm_pruning.md``.
"""

from lalr_lightning.oneshot.commands import perplexity_main, prune_main
from lalr_lightning.oneshot.evaluate import perplexity
from lalr_lightning.oneshot.prune import PruneReport, prune_checkpoint, prune_model
from lalr_lightning.oneshot.text import calibration_samples, read_text

__all__ = [
    "calibration_samples",
    "perplexity",
    "perplexity_main",
    "prune_checkpoint",
    "prune_main",
    "prune_model",
    "read_text",
    "PruneReport",
]
