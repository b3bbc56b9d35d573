"""A 2:4 checkpoint that runs on sparse tensor cores.

``prune --n 2 --m 4`` writes dense weights with zeros: the right file format (compressed-tensors
marks its sparse formats as legacy), but the same size and speed as the dense model. Loaded here,
every linear weight of the decoder blocks that holds the 2:4 pattern (at least two zeros in every
four consecutive input weights of each row) becomes a ``torch.sparse.SparseSemiStructuredTensor``
(``torch.sparse.to_sparse_semi_structured``: half the values plus metadata), which ``F.linear``
multiplies on the sparse tensor cores of GPUs of compute capability 8.0 and up. Torch's own
tensor is used rather than torchao's ``sparsify_(model, semi_sparse_weight())``: it is the same
kernel (CUTLASS, or cuSPARSELt where torch has it) without another dependency.

On a CPU, or a GPU below 8.0, :func:`semi_structured_unsupported` says so in one line and nothing
is converted. Outputs equal the dense-with-zeros model's within float tolerance
(``tests/gpu/test_gpu_sparse24.py``); ``benchmarks/sparse24.py`` measures the speed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

#: the dtypes the semi-structured kernels take for a model's weights
SPARSE_DTYPES = (torch.float16, torch.bfloat16)


class SemiStructuredLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is semi-structured: the input is flattened to rows first.

    The sparse tensor takes only a 2-D matrix product: ``F.linear`` on a 3-D input whose size-1
    dimension has an unusual stride (a decode step, one token per sequence) goes through a batched
    product that expands the weight, which the sparse tensor refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


def semi_structured_unsupported(device: torch.device | str) -> str | None:
    """Why 2:4 semi-structured tensors cannot run on ``device`` (one line), or None when they can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        here = "no CUDA device is available" if device.type == "cuda" else f"this is the {device.type.upper()}"
        return ("2:4 semi-structured sparse tensors run on the sparse tensor cores of a CUDA GPU of compute "
                f"capability 8.0 or higher; {here}: the 2:4 model runs dense (weights with zeros), at the dense "
                "model's speed")
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return (f"2:4 semi-structured sparse tensors need a GPU of compute capability 8.0 or higher; "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}: the 2:4 model runs dense")
    return None


def is_2_4(weight: torch.Tensor) -> bool:
    """Whether every row's consecutive groups of four input weights hold at least two zeros."""
    if weight.ndim != 2 or weight.shape[1] % 4:
        return False
    return bool(((weight.reshape(-1, 4) == 0).sum(1) >= 2).all())


def to_semi_structured(model: nn.Module) -> dict[str, str]:
    """Convert, in place, every ``nn.Linear`` of the decoder blocks whose weight is 2:4 (on a CUDA
    device of capability >= 8.0, in float16 or bfloat16) to a semi-structured sparse weight.
    Returns ``{name: "sparse"}`` for the converted ones and ``{name: why}`` for the ones left dense
    (not 2:4, or a shape the kernels refuse). Raises a one-line ``ValueError`` where nothing can
    run (:func:`semi_structured_unsupported`, or another dtype)."""
    from torch.sparse import to_sparse_semi_structured

    from lalr_lightning.core.pruning.calibration import decoder_blocks

    device = next(model.parameters()).device
    why = semi_structured_unsupported(device)
    if why:
        raise ValueError(why)
    dtype = next(model.parameters()).dtype
    if dtype not in SPARSE_DTYPES:
        raise ValueError(f"2:4 semi-structured tensors take float16 or bfloat16 weights, the model is {dtype}; "
                         "load it with --dtype float16 (or bfloat16)")
    path, blocks = decoder_blocks(model)
    done: dict[str, str] = {}
    for i, block in enumerate(blocks):
        for name, mod in block.named_modules():
            if type(mod) is not nn.Linear:
                continue
            qual = f"{path}.{i}.{name}"
            if not is_2_4(mod.weight.data):
                done[qual] = "not 2:4"
                continue
            try:
                sparse = to_sparse_semi_structured(mod.weight.data)
            except (RuntimeError, ValueError) as e:  # e.g. a shape below the kernels' minimum
                done[qual] = f"dense ({str(e).strip().splitlines()[0][:80]})"
                continue
            mod.weight = nn.Parameter(sparse, requires_grad=False)
            mod.__class__ = SemiStructuredLinear
            done[qual] = "sparse"
    if not any(v == "sparse" for v in done.values()):
        raise ValueError("no linear weight of the model is 2:4 (two zeros in every four inputs): prune it with "
                         "--n 2 --m 4 first")
    return done


def load_semi_structured(model_dir: str | os.PathLike, device: str = "cuda", dtype: str = "float16"):
    """``(model, converted)``: the 2:4 checkpoint in ``model_dir`` loaded (checked as ``perplexity``
    loads it) in ``dtype`` on ``device``, its 2:4 linear weights made semi-structured
    (:func:`to_semi_structured`)."""
    from lalr_lightning.oneshot.checkpoint import _load_config, _resolve_device
    from lalr_lightning.oneshot.evaluate import _load_evaluated

    dev = _resolve_device(device)
    why = semi_structured_unsupported(dev)
    if why:
        raise ValueError(why)
    folder = Path(model_dir)
    model = _load_evaluated(folder, _load_config(folder), dev, dtype)
    model.eval()
    return model, to_semi_structured(model)
