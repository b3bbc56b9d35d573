"""Pruning's math: AlphaPruning's per-layer ratios and masks, HTSRPruning's settings, the magnitude / Wanda /
SparseGPT criteria, pruning by a criterion, and the block-by-block calibration of a causal LM."""
