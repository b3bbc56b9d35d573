"""One-shot pruning and evaluation of a Hugging Face causal-LM directory (``prune``, ``perplexity``,
``zeroshot``).

One concern a module, each importing only the ones listed before it:

* ``text``: the calibration and evaluation text, and the calibration windows drawn from it;
* ``checkpoint``: a model directory (config, tokenizer, safetensors read one tensor at a time, the
  model on the meta device loaded from them) and its checks before anything runs;
* ``outdir``: the all-or-nothing output directory and its lock;
* ``prune``: the per-layer ratios and the prune, streamed one block at a time or in memory;
* ``evaluate``: the windowed perplexity and the model it evaluates;
* ``owl``: OWL's per-layer ratios from the calibration activations (outlier-weighted layerwise sparsity);
* ``zeroshot``: multiple-choice accuracy (``acc``, ``acc_norm``) as lm-evaluation-harness computes it;
* ``sparse24``: a 2:4 checkpoint's linear weights as semi-structured sparse tensors;
* ``commands``: ``prune_main`` / ``perplexity_main`` / ``zeroshot_main``, their arguments and one-line
  errors; they parse the arguments before importing torch.

Conventions and the places they differ from the reference code: ``docs/llm_pruning.md``.
"""

import importlib

#: public name -> its module; imported on first use (PEP 562), so the commands parse their arguments
#: before torch is imported
_WHERE = {
    "perplexity_main": "commands", "prune_main": "commands", "zeroshot_main": "commands",
    "perplexity": "evaluate",
    "PruneReport": "prune", "prune_checkpoint": "prune", "prune_model": "prune",
    "owl_ratios": "owl", "outlier_ratios": "owl",
    "calibration_samples": "text", "read_text": "text",
    "zeroshot": "zeroshot", "read_task": "zeroshot",
    "load_semi_structured": "sparse24", "to_semi_structured": "sparse24",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lalr_lightning.oneshot' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lalr_lightning.oneshot.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
