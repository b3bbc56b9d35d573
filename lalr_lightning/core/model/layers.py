"""Turn any ``nn.Module`` into an ordered list of layers.

Two granularities (SPEC "Layers"):

* ``matrix`` -- every weight matrix (``Linear``, ``Conv1d/2d``, ``Embedding``, Hugging Face
  ``Conv1D``), which is what HT-SR calls a layer. Each matrix layer owns its weight, its bias
  and, by the TempBalance ``bn -> conv`` rule, the normalization layer that follows it.
* ``block`` -- (:mod:`.blocks`) the model's blocks: timm ``group_matcher`` groups, repeated children
  (``layers.N``, ``blocks.N``, ``layerN`` ...), or a user list of name patterns. Parameters
  before the first block form a *stem* (joined to the first block unless asked otherwise),
  parameters after the last block form the *head*.

Names are the modules' qualified names with wrapper prefixes removed (``_orig_mod.``,
``module.``, ``_fsdp_wrapped_module.``, ``_forward_module.``), so they are the same on every
rank, under ``torch.compile`` and across runs.

This module holds :class:`Layer` and the matrix layers; the blocks are :mod:`.blocks`', the
model's output layer too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "MATRIX_KINDS",
    "Layer",
    "clean_name",
    "matrix_layers",
    "is_matrix_module",
    "params_of",
    "num_eigenvalues",
    "check_kinds",
    "attention_layers",
    "inside_attention",
    "warn_left_out",
]


#: The kinds of weight matrix HT-SR analyses (``Layer.kind`` of matrix layers).
MATRIX_KINDS = ("linear", "conv1d", "conv2d", "hf_conv1d", "embedding")


#: The kinds the spectral callbacks use unless told otherwise (TempBalance and AlphaPruning
#: leave embeddings alone).
DEFAULT_KINDS = ("linear", "conv1d", "conv2d", "hf_conv1d")


def is_matrix_module(module: nn.Module) -> bool:
    """A module whose ``weight`` is a layer weight matrix in the HT-SR sense."""
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)):
        return isinstance(getattr(module, "weight", None), torch.Tensor)
    # Hugging Face GPT-2 style Conv1D (a transposed Linear); matched by name so that
    # transformers stays an optional dependency.
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor) \
        and module.weight.ndim == 2


def check_kinds(kinds, who: str = "layer_types") -> tuple[str, ...]:
    """``kinds`` as a tuple, or a ValueError listing the valid ones."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = sorted(set(kinds) - set(MATRIX_KINDS))
    if unknown:
        raise ValueError(f"unknown {who} {unknown}; valid: {', '.join(MATRIX_KINDS)}")
    return kinds


_NORM_TYPES = (
    nn.modules.batchnorm._BatchNorm,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.modules.instancenorm._InstanceNorm,
)


def clean_name(name: str) -> str:
    """Drop wrapper components (DDP's ``module``, ``torch.compile``'s ``_orig_mod``, FSDP's ...).

    ``module`` is only dropped when it is a wrapper, i.e. a leading component; a user's own
    submodule called ``module`` deeper in the tree keeps its name.
    """
    parts = name.split(".")
    out = []
    leading = True
    for p in parts:
        if p in ("_orig_mod", "_fsdp_wrapped_module", "_forward_module", "_checkpoint_wrapped_module"):
            continue
        if p == "module" and leading:
            continue
        leading = False
        out.append(p)
    return ".".join(out)


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Conv2d):
        return "conv2d"
    if isinstance(module, nn.Conv1d):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D":
        return "hf_conv1d"
    return "block"


@dataclass
class Layer:
    """One layer: a clean name, what it is, and the parameters it owns.

    ``params`` maps clean parameter names to parameters; every parameter belongs to at most
    one layer of a list. For matrix layers ``module`` is the weight's module; for blocks it is
    the block's main module (``None`` when the block spans several top-level modules).
    """

    name: str
    kind: str
    module: nn.Module | None
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    modules: list[nn.Module] = field(default_factory=list)
    index: int = 0
    role: str = "matrix"  # matrix | stem | block | head
    #: the module's attribute holding the matrix: ``weight``, or for a projection packed into a
    #: module that is not a Linear, its own name (``nn.MultiheadAttention``'s ``in_proj_weight``)
    weight_name: str = "weight"

    @property
    def weight(self) -> torch.Tensor:
        w = None if self.module is None else getattr(self.module, self.weight_name, None)
        if not isinstance(w, torch.Tensor):
            raise AttributeError(f"layer {self.name!r} ({self.kind}) has no single weight matrix")
        return w

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def __repr__(self) -> str:  # short: layers are printed in error messages
        return f"Layer({self.name!r}, kind={self.kind!r}, params={len(self.params)})"


def params_of(layers: Iterable[Layer]) -> list[nn.Parameter]:
    return [p for layer in layers for p in layer.params.values()]


def num_eigenvalues(layer: Layer) -> int:
    """Eigenvalue count of a matrix layer's ESD, from its shape alone (conv: kernel slices pooled)."""
    w = layer.weight
    if w.ndim == 2:
        return min(w.shape)
    return math.prod(w.shape[2:]) * min(w.shape[0], w.shape[1])


def _norm_partner(norm_name: str, matrix_names: set[str], order: list[str]) -> str | None:
    """Which matrix layer a normalization layer follows.

    TempBalance's rule first (``bn`` -> ``conv`` in the name: ``layer1.0.bn2`` ->
    ``layer1.0.conv2``), then, for BatchNorm in a ``Sequential(conv, bn)``
    (``downsample.1``), the sibling just before it.
    """
    if "bn" in norm_name:
        cand = norm_name.replace("bn", "conv")
        if cand in matrix_names:
            return cand
    head, _, last = norm_name.rpartition(".")
    if last.isdigit() and int(last) > 0:
        sib = f"{head}.{int(last) - 1}" if head else str(int(last) - 1)
        if sib in matrix_names:
            return sib
    return None


def matrix_layers(
    model: nn.Module,
    *,
    types: Sequence[type] | None = None,
    tie_norms: bool = True,
    include_frozen: bool = True,
) -> list[Layer]:
    """Every weight matrix of ``model`` in registration order.

    A parameter shared by several modules (tied embeddings) belongs to the first module that
    registers it; later modules reusing it are skipped. ``types`` restricts the module types
    (default: Linear, Conv1d, Conv2d, Embedding, HF Conv1D). With ``tie_norms`` a BatchNorm
    (or another norm matched by the ``bn -> conv`` rule) joins its conv's parameters.
    """
    seen: set[int] = set()
    layers: list[Layer] = []
    by_name: dict[str, Layer] = {}
    by_weight: dict[int, Layer] = {}
    names_in_order: list[str] = []
    norms: list[tuple[str, nn.Module]] = []
    for raw, mod in model.named_modules():
        name = clean_name(raw)
        if types is not None:
            ok = isinstance(mod, tuple(types)) and isinstance(getattr(mod, "weight", None), torch.Tensor)
        else:
            ok = is_matrix_module(mod)
        if ok:
            w = mod.weight
            if id(w) in seen:
                # tied: its other parameters (a decoder's bias) go with the layer holding the weight
                _join_tied(mod, name, by_weight.get(id(w)), seen)
                continue
            if not include_frozen and not w.requires_grad:
                continue
            params = {}
            # a parametrized weight (weight_norm, spectral_norm, ...) is computed from the tensors
            # under ``parametrizations``: they are what trains, so they are the layer's
            own = list(mod.named_parameters(recurse=False))
            if parametrize.is_parametrized(mod):
                own += [(f"parametrizations.{n}", p) for n, p in mod.parametrizations.named_parameters()]
            for pname, p in own:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params[f"{name}.{pname}" if name else pname] = p
            layer = Layer(name=name, kind=_kind(mod), module=mod, params=params, modules=[mod])
            layers.append(layer)
            by_name[name] = layer
            by_weight[id(w)] = layer
            names_in_order.append(name)
        elif types is None and isinstance(mod, nn.MultiheadAttention):
            for layer in attention_layers(name, mod, seen, include_frozen):
                layers.append(layer)
                by_name[layer.name] = layer
                names_in_order.append(layer.name)
        elif isinstance(mod, _NORM_TYPES):
            norms.append((name, mod))
    if tie_norms:
        for name, mod in norms:
            partner = _norm_partner(name, set(by_name), names_in_order)
            if partner is None:
                continue
            layer = by_name[partner]
            for pname, p in mod.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    layer.params[f"{name}.{pname}" if name else pname] = p
            layer.modules.append(mod)
    for i, layer in enumerate(layers):
        layer.index = i
    if types is None and include_frozen:
        warn_left_out(model, seen)
    return layers


def _join_tied(mod: nn.Module, name: str, owner: Layer | None, seen: set[int]) -> None:
    """Give the layer that holds a tied module's weight that module's other parameters."""
    if owner is None:
        return
    for pname, p in mod.named_parameters(recurse=False):
        if id(p) not in seen:
            seen.add(id(p))
            owner.params[f"{name}.{pname}" if name else pname] = p


#: nn.MultiheadAttention's input projections: (the parameter holding the matrix, the layer's
#: name suffix); packed (q, k and v stacked, ``in_proj_weight``) or separate (``kdim != embed_dim``)
_ATTENTION = (("in_proj_weight", "in_proj"), ("q_proj_weight", "q_proj"), ("k_proj_weight", "k_proj"),
              ("v_proj_weight", "v_proj"))


def attention_layers(name: str, mod: nn.MultiheadAttention, seen: set[int], include_frozen: bool = True
                     ) -> list[Layer]:
    """The input projections of an ``nn.MultiheadAttention`` as matrix layers (kind ``linear``): its
    packed ``in_proj_weight`` (the q, k and v projections stacked, ``(3 E, E)``: one layer, as one
    parameter takes one learning rate and one mask), or its separate ``q/k/v_proj_weight``. The
    input bias (and ``bias_k``/``bias_v``) go with the first. Its output projection is an
    ``nn.Linear`` (``out_proj``), listed as every Linear. ``seen`` is updated."""
    out: list[Layer] = []
    for attr, suffix in _ATTENTION:
        w = getattr(mod, attr, None)
        if not isinstance(w, nn.Parameter) or id(w) in seen or (not include_frozen and not w.requires_grad):
            continue
        params = {f"{name}.{attr}" if name else attr: w}
        seen.add(id(w))
        if not out:  # the input bias and the extra key/value biases follow the first projection
            for extra in ("in_proj_bias", "bias_k", "bias_v"):
                b = getattr(mod, extra, None)
                if isinstance(b, nn.Parameter) and id(b) not in seen:
                    seen.add(id(b))
                    params[f"{name}.{extra}" if name else extra] = b
        out.append(Layer(name=f"{name}.{suffix}" if name else suffix, kind="linear", module=mod, params=params,
                         modules=[mod], weight_name=attr))
    return out


def inside_attention(layer: Layer) -> bool:
    """Whether ``nn.MultiheadAttention`` applies the layer's matrix itself (its input projections,
    and its ``out_proj``, which it reads as a tensor without calling the Linear): no hook on the
    layer's module sees its inputs."""
    return layer.weight_name != "weight" or isinstance(layer.module, nn.modules.linear.NonDynamicallyQuantizableLinear)


_WARNED: set[tuple] = set()


def warn_left_out(model: nn.Module, seen: set[int]) -> list[str]:
    """Warn, once per model type and set of parameters, about the weight matrices (parameters
    with two or more dimensions) of ``model`` that no matrix layer holds -- a user's own
    ``nn.Parameter(torch.randn(d, d))``, a ``ConvTranspose2d``, a ``Conv3d``, a position table --
    with their share of the model's parameters: no callback measures, scales or prunes them.
    Returns their names."""
    total, left = 0, []
    done: set[int] = set()
    for raw, p in model.named_parameters():
        if id(p) in done:
            continue
        done.add(id(p))
        total += p.numel() if not isinstance(p, nn.parameter.UninitializedParameter) else 0
        if id(p) not in seen and p.ndim >= 2 and not isinstance(p, nn.parameter.UninitializedParameter) \
                and min(p.shape) > 1:
            left.append((clean_name(raw), tuple(p.shape), p.numel()))
    if not left:
        return []
    key = (type(model).__name__, tuple(n for n, _, _ in left))
    if key not in _WARNED:
        _WARNED.add(key)
        import warnings

        share = sum(k for _, _, k in left) / max(total, 1)
        shown = ", ".join(f"{n} ({'x'.join(map(str, shape))})" for n, shape, _ in left[:6]) + (
            f" and {len(left) - 6} more" if len(left) > 6 else "")
        warnings.warn(f"{len(left)} weight matrices of {type(model).__name__} are in no layer the callbacks treat "
                      f"(not a Linear, Conv1d/2d, Embedding, HF Conv1D or attention projection): {shown}, "
                      f"{share:.1%} of its parameters; they keep the scheduled learning rate and are never measured "
                      "or pruned. Wrap them in nn.Linear to include them", UserWarning, stacklevel=3)
    return [n for n, _, _ in left]
