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
    "owl_ratios": "lalr_lightning.core.pruning.owl", "outlier_share": "lalr_lightning.core.pruning.owl",
    "calibration_samples": "text", "read_text": "text",
    "zeroshot": "zeroshot", "read_task": "zeroshot",
    "load_semi_structured": "sparse24", "to_semi_structured": "sparse24",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lalr_lightning.oneshot' has no attribute {name!r}")
    where = _WHERE[name]
    module = importlib.import_module(where if "." in where else f"lalr_lightning.oneshot.{where}")
    value = globals()[name] = getattr(module, name)
    # importing oneshot/zeroshot.py sets this package's ``zeroshot`` to the module: the function wins
    short = module.__name__.rsplit(".", 1)[1]
    if _WHERE.get(short) == short:
        globals()[short] = getattr(module, short)
    return value
