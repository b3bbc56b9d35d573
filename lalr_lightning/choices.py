"""The command line's choice lists, as plain tuples: the commands parse their arguments (and refuse
bad ones) before torch is imported. ``tests/test_cli_lean.py`` checks each against the library's own
list (``core.spectral.FITS``, ``core.llm_pruning.CRITERIA``, ``core.pruning.PRUNING_METRICS``,
``oneshot.checkpoint.DTYPES``, ``core.pruning_settings.PRESETS``)."""

FITS = ("median", "ks", "peak")
CRITERIA = ("magnitude", "wanda", "sparsegpt")
PRUNING_METRICS = ("alpha", "alpha_weighted", "log_alpha_norm", "stable_rank", "entropy", "spectral_norm",
                   "log_spectral_norm", "norm", "log_norm", "rand_distance", "snr")
DTYPES = ("float32", "float16", "bfloat16")
#: the per-layer ratio recipes of ``prune --preset`` and ``HTSRPruning(preset=...)``
PRESETS = ("alphapruning", "owl")
#: the zero-shot tasks of the Wanda, SparseGPT and AlphaPruning papers (lm-evaluation-harness names)
PAPER_TASKS = ("boolq", "rte", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
