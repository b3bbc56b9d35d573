"""``perplexity``: the evaluation of Wanda / SparseGPT / AlphaPruning (``lib/eval.py``).

``python -m lalr_lightning perplexity MODEL_DIR --data FILE --seq-len 2048``: the text tokenized
as one sequence, cut into ``numel // seq_len`` non-overlapping windows (the remainder dropped),
perplexity ``exp(sum_w seq_len * mean NLL_w / (n_windows * seq_len))``, of a model loaded only
from a checkpoint that covers it and whose values are finite in the compute dtype.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from lalr_lightning import progress
from lalr_lightning.oneshot.checkpoint import _Checkpoint, _finite, _resolve_dtype, _Streamed


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int, batch_size: int = 1,
               max_windows: int | None = None) -> tuple[float, int]:
    """(perplexity, windows) of a causal LM on the token sequence ``ids`` (1-D or ``(1, N)``):
    ``N // seq_len`` non-overlapping windows, the remainder dropped; each window's mean next-token
    NLL (over its ``seq_len - 1`` predictions) weighted by ``seq_len``, as ``lib/eval.py``.
    ``max_windows``: only the first ones (the reference's C4 evaluation keeps 256). A loss that is
    not finite is an error naming the windows, never a ``nan`` perplexity."""
    ids = ids.reshape(-1)
    windows = ids.numel() // seq_len
    if max_windows is not None:
        windows = min(windows, int(max_windows))
    if windows < 1:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}; "
                         "lower --seq-len or use a longer file")
    if seq_len < 2:
        raise ValueError("--seq-len must be >= 2 (a window predicts its tokens after the first)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    tokens = progress.bar(total=windows * seq_len, desc="perplexity", unit="tok", unit_scale=True)
    try:
        for start in range(0, windows, batch_size):
            stop = min(start + batch_size, windows)
            x = ids[start * seq_len:stop * seq_len].reshape(stop - start, seq_len).to(device)
            logits = model(input_ids=x, use_cache=False).logits.float()
            nll = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                          x[:, 1:].reshape(-1)))
            if not math.isfinite(nll):
                dtype = next(model.parameters()).dtype
                fix = ("evaluate with --dtype float32" if dtype in (torch.float16, torch.bfloat16)
                       else "the weights are finite but too large for it: check how they were produced")
                raise ValueError(f"the loss of window(s) {start}-{stop - 1} is {nll}: the forward overflows "
                                 f"{str(dtype).replace('torch.', '')} (a perplexity would be meaningless); {fix}")
            total += nll * seq_len * (stop - start)
            tokens.update(seq_len * (stop - start))
    finally:
        tokens.close()
        model.train(was_training)
    ppl = math.exp(float(total) / (windows * seq_len))
    return ppl, windows


def _check_loaded(model: nn.Module, sm: _Streamed, dtype: torch.dtype) -> None:
    """Every floating tensor of the loaded model finite, or one line naming the first that is not and
    whether the checkpoint holds the bad value or the cast to ``dtype`` made it."""
    for name, t in model.state_dict().items():
        if _finite(t):
            continue
        key = sm.key(name)
        stored = sm.ckpt.get(key) if key in sm.ckpt.where else None
        if stored is None or not _finite(stored):
            raise ValueError(f"{key} holds NaN or Inf values in the checkpoint: the model is broken, a perplexity "
                             "of it means nothing; fix or re-export the weights")
        raise ValueError(f"{key} overflows {dtype} (its largest |value| is {float(stored.abs().max()):.3g}); "
                         "evaluate with --dtype float32")


def _load_evaluated(model_dir: Path, config, dev: torch.device, dtype_name: str):
    """The model to evaluate, loaded only from a checkpoint that covers it (no randomly
    initialised tensor) and whose values are finite in the compute dtype."""
    from transformers import AutoModelForCausalLM

    ckpt = _Checkpoint(model_dir)
    dtype = _resolve_dtype(dtype_name, dev, ckpt.stored_dtype())
    sm = _Streamed(model_dir, config, dev, dtype, ckpt=ckpt, blocks=False)
    sm.validate()
    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype,
                                                       output_loading_info=True)
    if info.get("missing_keys") or info.get("mismatched_keys"):  # validate() should have said so already
        raise ValueError(f"{model_dir}: the weights do not cover the model (missing "
                         f"{sorted(info.get('missing_keys') or [])[:3]}, mismatched "
                         f"{[k[0] if isinstance(k, tuple) else k for k in info.get('mismatched_keys') or []][:3]})")
    _check_loaded(model, sm, dtype)
    return model.to(dev)
