"""Weight matrices of a safetensors checkpoint, read one tensor at a time.

Streamed analysis (``spectral.analyze(path)``) never builds the model: it lists the stored
tensors from the files' headers, then loads one matrix, measures it and drops it, so memory stays
bounded by the largest matrix. A path is either a ``.safetensors`` file or a directory holding a
Hugging Face checkpoint: ``model.safetensors.index.json`` (sharded; its ``weight_map`` names the
shards), else ``model.safetensors``, else every ``*.safetensors`` file in it.

Which stored tensors are matrices (:func:`matrix_kind`): floating-point tensors named ``*.weight``
with 2 dimensions (``linear``, or ``embedding``, see below), 3 (``conv1d``: out, in, k) or 4
(``conv2d``: out, in, kh, kw). Everything else (1-D norms and biases, integer buffers, parameters
not called ``weight`` such as a ViT's ``pos_embed``) is skipped. A checkpoint does not record
module types, so:

* ``embedding`` is recognised by name: the tensor's module name (the key without ``.weight``)
  ends in a component containing ``embed`` (``embed_tokens``, ``embed_positions``,
  ``word_embeddings``, ``embed_in``), or is ``wte``, ``wpe`` or ``shared``; GPT-NeoX's output
  head ``embed_out`` is a ``linear``. The kind only labels the row (and filters ``layer_types``):
  the spectrum of a matrix does not depend on it.
* GPT-2's ``Conv1D`` weights are stored as plain 2-D tensors, so they come out as ``linear``
  (``hf_conv1d`` for the built model); their spectrum is the same.

Rows are in natural name order (``layers.2`` before ``layers.10``): a checkpoint does not record
the order in which the model applies its modules.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StoredMatrix", "is_checkpoint_path", "safetensors_files", "stored_matrices", "load_matrix", "matrix_kind"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
_EMBED_NAMES = {"wte", "wpe", "shared"}


@dataclass(frozen=True)
class StoredMatrix:
    """One weight matrix of a checkpoint, not yet loaded."""

    name: str  # the module name: the tensor key without ".weight"
    key: str  # the tensor's key in its file
    file: Path
    kind: str  # linear | embedding | conv1d | conv2d
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name (F32, BF16, ...)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def is_checkpoint_path(obj) -> bool:
    """Whether ``analyze`` should treat ``obj`` as a path (a ``str`` or ``os.PathLike``)."""
    return isinstance(obj, (str, os.PathLike))


def matrix_kind(key: str, shape, dtype: str = "F32") -> str | None:
    """The spectral kind of a stored tensor, or None when it is not a weight matrix."""
    if not (key == "weight" or key.endswith(".weight")) or dtype not in _FLOAT_DTYPES:
        return None
    ndim = len(shape)
    if ndim == 3:
        return "conv1d"
    if ndim == 4:
        return "conv2d"
    if ndim != 2:
        return None
    last = key[: -len("weight")].rstrip(".").rpartition(".")[2]
    if last in _EMBED_NAMES or ("embed" in last and last != "embed_out"):
        return "embedding"
    return "linear"


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p]


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint path (see the module docstring), in order.

    Raises FileNotFoundError for a missing path or shard and ValueError for a path that holds no
    safetensors checkpoint; both messages are one line naming the path.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {p}")
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(
                f"{p} is not a .safetensors file; streamed analysis reads safetensors checkpoints "
                "(load other formats into a model and pass the nn.Module)"
            )
        return [p]
    index = p / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index (no readable 'weight_map': {err})") from None
        files = [p / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return files
    if (p / SINGLE_FILE).is_file():
        return [p / SINGLE_FILE]
    files = sorted(p.glob("*.safetensors"))
    if files:
        return files
    other = sorted(f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" (it holds {', '.join(other[:3])}: load that into a model and pass the nn.Module)" if other else ""
    raise ValueError(f"{p} holds no .safetensors file (looked for {INDEX_FILE}, {SINGLE_FILE}, *.safetensors){hint}")


def _safe_open(file: Path, device: str = "cpu"):
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - safetensors comes with timm and transformers
        raise ImportError("streamed analysis needs the safetensors package: pip install safetensors") from None
    try:
        return safe_open(str(file), framework="pt", device=device)
    except Exception as err:  # safetensors raises its own error type for a bad header
        raise ValueError(f"{file} is not a readable safetensors file: {str(err).splitlines()[0]}") from None


def stored_matrices(path: str | os.PathLike) -> list[StoredMatrix]:
    """Every weight matrix of the checkpoint at ``path`` (read from the headers only)."""
    out = []
    for file in safetensors_files(path):
        with _safe_open(file) as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                kind = matrix_kind(key, shape, dtype)
                if kind is not None:
                    name = key[: -len("weight")].rstrip(".") or "weight"
                    out.append(StoredMatrix(name, key, file, kind, shape, dtype))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{path}: tensor(s) {dup[:5]} are stored in more than one shard")
    return sorted(out, key=lambda m: _natural_key(m.name))


def load_matrix(matrix: StoredMatrix, device: str | torch.device = "cpu") -> torch.Tensor:
    """Load one stored matrix onto ``device``.

    The file is opened for this tensor only: the memory map is released when it returns, so the
    pages read do not stay in the process's resident memory.
    """
    with _safe_open(matrix.file, str(device)) as f:
        return f.get_tensor(matrix.key)
