"""A Hugging Face model directory, read and checked before anything runs on it.

Its config and tokenizer (or one line saying why not); :class:`_Checkpoint`, its safetensors
tensors by key, read one at a time; :class:`_Streamed`, the causal LM built on the meta device
whose tensors are loaded from the checkpoint on demand, and whose :meth:`_Streamed.validate`
refuses a checkpoint that does not cover the config; the device and compute dtype a run asks for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.pruning.calibration import decoder_blocks

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_INDEX = "model.safetensors.index.json"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


def _load_config(model_dir: Path):
    from transformers import AutoConfig

    if model_dir.is_file():
        raise ValueError(f"{model_dir} is a file; give the Hugging Face model directory that holds it "
                         f"({model_dir.parent} if it is the model's weights or config.json)")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"no such model directory: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; give a Hugging Face model directory "
                                "(save_pretrained's output)")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError by what is wrong
        raise ValueError(f"{model_dir / 'config.json'}: not a readable Hugging Face config ({_first_line(e)})") from None


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises OSError / ValueError / TypeError by tokenizer kind
        raise ValueError(f"{model_dir}: cannot load its tokenizer ({_first_line(e)}); save the tokenizer next to the "
                         "weights (tokenizer.save_pretrained(MODEL_DIR))") from None


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite. A NaN or Inf anywhere makes the sum NaN or Inf, and
    one reduction is ~100x faster than ``isfinite(t).all()`` on a CPU (no bool tensor); a sum that
    overflows although every value is finite is settled by the exact check."""
    return not t.is_floating_point() or bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _unreadable(file, e: BaseException) -> ValueError:
    # safetensors' SafetensorError is a bare Exception: one line naming the file instead of its traceback
    return ValueError(f"{file}: not a readable safetensors file ({_first_line(e)}); the file is damaged or "
                      "incomplete: copy or download it again")


def _refuse_nonfinite(key: str, f: Path, t: torch.Tensor) -> None:
    if not _finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{key} in {f.name} holds {bad} NaN or Inf value(s) of {t.numel()}: the "
                         "checkpoint itself is broken (nothing has run yet); fix or re-export it")


class _Checkpoint:
    """The tensors of a safetensors model directory, by key, read one at a time. Every shard's
    header is read here (a damaged file is one line naming it); :meth:`check_values` reads every
    value."""

    def __init__(self, model_dir: Path):
        from safetensors import safe_open

        from lalr_lightning.core.runtime.safetensors_checkpoints import safetensors_files

        self.files = safetensors_files(model_dir)
        self.where: dict[str, tuple[Path, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in self.files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        self.where[k] = (f, sl.get_dtype())
                        self.shapes[k] = tuple(sl.get_shape())
            except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
                raise _unreadable(f, e) from None
        index = model_dir / _INDEX
        if index.is_file():  # the index must name every tensor where it is
            weight_map = json.loads(index.read_text())["weight_map"]  # readable: safetensors_files parsed it
            wrong = [k for k, f in weight_map.items() if k not in self.where or self.where[k][0].name != f]
            if wrong:
                raise ValueError(f"{index} names {len(wrong)} tensor(s) its shards do not hold where it says "
                                 f"(first: {wrong[0]!r} in {weight_map[wrong[0]]}); the index and the shards do not match")

    def get(self, key: str, device="cpu") -> torch.Tensor:
        from safetensors import safe_open

        f, _ = self.where[key]
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as h:
                return h.get_tensor(key)
        except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
            raise _unreadable(f, e) from None

    def dtype(self, key: str) -> torch.dtype:
        return _ST_DTYPES.get(self.where[key][1], torch.float32)

    def stored_dtype(self) -> torch.dtype | None:
        return next((self.dtype(k) for k in self.where if self.dtype(k).is_floating_point), None)

    def check_values(self, keys=None, log=None) -> None:
        """Read every tensor (of ``keys``; default all) once and refuse a non-finite one, naming it."""
        from safetensors import safe_open

        todo = set(self.where if keys is None else keys)
        t0 = time.perf_counter()
        for f in self.files:
            mine = [k for k in self.where if self.where[k][0] == f and k in todo]
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in mine:
                        _refuse_nonfinite(k, f, h.get_tensor(k))
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError
                raise _unreadable(f, e) from None
        if log is not None and time.perf_counter() - t0 > 2:  # say where the time went on a large checkpoint
            log(f"checked {len(todo)} tensors: all finite ({time.perf_counter() - t0:.1f} s)")


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` on the meta device (no memory), or one line saying why not."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # e.g. BERT's "add is_decoder=True" advice: the block check below speaks
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError, TypeError):  # no causal-LM class for this config (T5, ...)
        raise ValueError(f"{getattr(config, 'model_type', '?')} ({type(config).__name__}) is not a causal language "
                         "model: AutoModelForCausalLM has no class for it; prune and perplexity take decoder-only LMs "
                         "(LLaMA, OPT, GPT-2, GPT-NeoX layouts)") from None
    finally:
        hf_logging.set_verbosity(level)
    return model.eval()


class _Streamed:
    """A causal LM built on the meta device whose tensors are loaded from the checkpoint on demand."""

    def __init__(self, model_dir: Path, config, device: torch.device, dtype: torch.dtype,
                 ckpt: _Checkpoint | None = None, blocks: bool = True, uniform: bool = True):
        from lalr_lightning.core.pruning.calibration import _check_uniform_attention

        self.ckpt = ckpt or _Checkpoint(model_dir)
        self.model_dir = model_dir
        self.config = config
        self.device, self.dtype = device, dtype
        self.model = _meta_model(config, dtype)
        self.path, self.blocks = None, nn.ModuleList()
        if blocks:  # streaming needs the block layout; checking what a directory holds does not (perplexity)
            self.path, self.blocks = decoder_blocks(self.model)
            if uniform:  # calibrated from the first block's inputs; a data-free block removal reads none
                _check_uniform_attention(self.model)
        names = set(self.model.state_dict(keep_vars=True))
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        # checkpoints written by a base model (GPT-2 on the Hub: "h.0...") lack the head's prefix
        self.strip = bool(prefix) and not any(k.startswith(prefix + ".") for k in self.ckpt.where) \
            and any(n.startswith(prefix + ".") for n in names)
        self.prefix = prefix

    def key(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.strip and name.startswith(self.prefix + ".") else name

    def validate(self) -> None:
        """Refuse a checkpoint that lacks a tensor the config implies (a tied head may be stored
        once, under either name), holds one with another shape, or holds more blocks than the
        config has: each would give a model with randomly initialised or dropped weights."""
        named = self.model.state_dict(keep_vars=True)
        where = self.ckpt.where
        missing = []
        for name, t in named.items():
            key = self.key(name)
            if key not in where:
                if not any(u is t and self.key(o) in where for o, u in named.items() if o != name):
                    missing.append(key)
                continue
            shape = self.ckpt.shapes[key]
            if shape != tuple(t.shape):
                raise ValueError(
                    f"{key} has shape {shape} in {where[key][0].name}, but config.json implies {tuple(t.shape)}: the "
                    "config does not describe these weights (check hidden_size, intermediate_size, the head counts "
                    "and vocab_size)")
        if missing:
            head = self.model.get_output_embeddings()
            untied = head is not None and any(self.key(n) in missing and u is head.weight for n, u in named.items())
            hint = (" config.json has tie_word_embeddings=False, so the output head is a tensor of its own;"
                    if untied else "")
            raise ValueError(
                f"{self.model_dir}: the weights do not cover the model: {len(missing)} tensor(s) that "
                f"{type(self.model).__name__} needs are not in the checkpoint ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''});{hint} a model built from it would hold randomly "
                "initialised tensors")
        if self.path is None:
            return
        pre = self.key(self.path) + "."
        found = {int(k[len(pre):].split(".", 1)[0]) for k in where
                 if k.startswith(pre) and k[len(pre):].split(".", 1)[0].isdigit()}
        if found and max(found) >= len(self.blocks):
            raise ValueError(f"the checkpoint holds blocks {self.path}.0-{max(found)}, config.json describes "
                             f"{len(self.blocks)} (num_hidden_layers): the config does not match the weights")

    def _load_module(self, module: nn.Module, qual: str) -> None:
        """Load every persistent tensor of ``module`` (qualified name ``qual``) from the checkpoint;
        rebuild the submodules that hold computed (non-persistent) buffers from the config."""
        for name, sub in list(module.named_modules()):
            if getattr(sub, "_non_persistent_buffers_set", None):
                self._rebuild(module, name, sub)
        for name, t in module.state_dict(keep_vars=True).items():
            full = f"{qual}.{name}" if qual else name
            key = self.key(full)
            if key not in self.ckpt.where:
                raise ValueError(f"the checkpoint has no tensor {key!r} (needed by {type(self.model).__name__})")
            value = self.ckpt.get(key).to(self.device, self.dtype if t.is_floating_point() else t.dtype)
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if attr in owner._parameters:
                owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[attr] = value
    def _rebuild(self, root: nn.Module, name: str, sub: nn.Module) -> None:
        try:
            with torch.device(self.device):
                fresh = type(sub)(config=self.config)
        except Exception as e:
            raise ValueError(f"cannot stream {type(self.model).__name__}: its {type(sub).__name__} holds computed "
                             f"buffers it cannot rebuild from the config ({e}); use --in-memory") from None
        if name:
            parent_name, _, attr = name.rpartition(".")
            setattr(root.get_submodule(parent_name), attr, fresh.to(self.device))
        else:
            raise ValueError(f"cannot stream a block that holds computed buffers ({type(sub).__name__}); use --in-memory")

    def load_stem(self) -> None:
        """Everything outside the blocks but the output head (not needed before the last block)."""
        head = self.model.get_output_embeddings()
        skip = {id(m) for m in self.blocks.modules()} | ({id(head)} if head is not None else set())
        for qual, mod in list(self.model.named_modules()):
            if id(mod) in skip:
                continue
            own = [n for n in list(mod._parameters) + list(mod._buffers) if n not in mod._non_persistent_buffers_set]
            for n in own:
                full = f"{qual}.{n}" if qual else n
                t = mod._parameters.get(n, mod._buffers.get(n))
                if t is None:
                    continue
                key = self.key(full)
                if key not in self.ckpt.where:
                    raise ValueError(f"the checkpoint has no tensor {key!r} (needed by {type(self.model).__name__})")
                value = self.ckpt.get(key).to(self.device, self.dtype if t.is_floating_point() else t.dtype)
                if n in mod._parameters:
                    mod._parameters[n] = nn.Parameter(value, requires_grad=False)
                else:
                    mod._buffers[n] = value
            if mod._non_persistent_buffers_set and qual:
                self._rebuild(self.model, qual, mod)

    def block(self, i: int) -> nn.Module:
        blk = self.blocks[i]
        self._load_module(blk, f"{self.path}.{i}")
        return blk

    def block_keys(self, i: int) -> list[str]:
        pre = self.key(f"{self.path}.{i}") + "."
        return [k for k in self.ckpt.where if k.startswith(pre)]

    def free(self, i: int) -> None:
        self.blocks[i].to("meta")

    def free_stem(self) -> None:
        """Drop what :meth:`load_stem` loaded (the embedding and the rest): once the first block's
        inputs are captured the calibration needs only the blocks, and the output copies the
        stem's tensors from the checkpoint."""
        inside = {id(m) for m in self.blocks.modules()}
        for mod in self.model.modules():
            if id(mod) in inside:
                continue
            for table in (mod._parameters, mod._buffers):
                for k, t in table.items():
                    if t is not None and t.device.type != "meta":
                        table[k] = nn.Parameter(t.to("meta"), requires_grad=False) if isinstance(t, nn.Parameter) \
                            else t.to("meta")


def _resolve_device(device: str | None) -> torch.device:
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {_first_line(e)}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA GPU is available; use --device cpu")
    return dev


def _resolve_dtype(dtype: str, device: torch.device, stored: torch.dtype | None) -> torch.dtype:
    if dtype == "auto":
        return (stored or torch.float32) if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise unknown("dtype", dtype, ["auto", *DTYPES])
    return DTYPES[dtype]
