"""The parameters the NTK differentiates and their per-layer groups (raw ``named_parameters()``
names, peft's wrappers folded into their base layer), for :mod:`.ntk` and the proximal regularizer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from torch import Tensor, nn

from lalr_lightning.core.model.blocks import output_layer
from lalr_lightning.core.model.layers import Layer, clean_name, matrix_layers

__all__ = [
    "trainable_parameters",
    "layer_groups",
    "matching_groups",
    "group_layers",
    "head_group",
    "selectable_head",
]


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``{name: parameter}`` of the parameters with ``requires_grad``, in registration order.

    Names are the raw ``named_parameters()`` names (what ``functional_call`` expects); values are
    detached views, so the functions here never build autograd graphs into the live model.
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (all requires_grad=False); unfreeze the "
            "layers to analyse or pass params={name: tensor} explicitly"
        )
    return params


# peft adapter parts that belong to the module they adapt: lora_A/lora_B of `query` are one layer
_PEFT_PART = re.compile(
    r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.[^.]+)?(\.(weight|bias))?$"
)


_PEFT_SAVED = re.compile(r"\.modules_to_save\.[^.]+")


def _layer_key(name: str) -> str:
    """``...query.lora_A.default`` -> ``...query``; ``classifier.modules_to_save.default`` -> ``classifier``."""
    name = _PEFT_SAVED.sub("", clean_name(name))
    return _PEFT_PART.sub("", name)


def layer_groups(
    model: nn.Module,
    params: Mapping[str, Tensor] | None = None,
    layers: Sequence[Layer] | None = None,
) -> dict[str, list[str]]:
    """``{layer name: [parameter names]}`` covering every parameter of ``params`` exactly once.

    Layers come from ``layers`` (default :func:`~lalr_lightning.core.model.layers.matrix_layers`: one
    weight matrix with its bias and tied norm), restricted to the parameters in ``params``
    (default: the trainable ones); layers with none of them are dropped. A peft LoRA pair
    (``lora_A``/``lora_B`` of one module, also DoRA's magnitude and embedding adapters) is one
    layer named after the adapted module; ``modules_to_save`` copies are named after the
    original module. Parameters that no layer owns (an untied LayerNorm, a bare
    ``nn.Parameter``) form one group per owning module, so ``sum_l S_l = K`` always holds.
    """
    params = trainable_parameters(model) if params is None else params
    layers = matrix_layers(model) if layers is None else layers
    wanted = set(params)
    # parameters are matched by identity; the mapping's values may be detached views of them
    by_id = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in wanted:
            by_id[id(p)] = n
    groups: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for layer in layers:
        key = _layer_key(layer.name)
        for p in layer.params.values():
            raw = by_id.get(id(p))
            if raw is None or raw in owner:
                continue
            groups.setdefault(key, []).append(raw)
            owner[raw] = key
    for raw in params:
        if raw not in owner:
            module = raw.rsplit(".", 1)[0] if "." in raw else raw
            key = _layer_key(module) or raw
            groups.setdefault(key, []).append(raw)
            owner[raw] = key
    # order groups and their members as the parameters are ordered
    order = {n: i for i, n in enumerate(params)}
    out = {k: sorted(v, key=order.__getitem__) for k, v in groups.items()}
    return dict(sorted(out.items(), key=lambda kv: order[kv[1][0]]))


def matching_groups(groups: Mapping[str, list[str]], include: Sequence[str] | None) -> dict[str, list[str]]:
    """The groups whose layer name matches one of the glob patterns ``include`` (all when None); a
    ValueError for a pattern that matches none."""
    if include is None:
        return dict(groups)
    for pat in include:
        if not any(fnmatchcase(g, pat) for g in groups):
            raise ValueError(f"include pattern {pat!r} matches no trainable layer; layers are: {list(groups)}")
    return {g: m for g, m in groups.items() if any(fnmatchcase(g, pat) for pat in include)}


def group_layers(groups: Mapping[str, Sequence[str]], params: Mapping[str, Tensor]) -> list[Layer]:
    """One :class:`~lalr_lightning.core.model.layers.Layer` per group, holding its parameters."""
    return [Layer(name=g, kind="layer", module=None, params={n: params[n] for n in members})
            for g, members in groups.items()]


def head_group(model: nn.Module, groups: Mapping[str, Sequence[str]], trace: Callable[[], Any] | None = None
               ) -> str | None:
    """The group holding the model's output layer (peft's trainable ``modules_to_save`` copy
    included; ``trace``: :func:`~lalr_lightning.core.model.blocks.output_layer`'s), or None."""
    out = output_layer(model, trace=trace)
    if out is None:
        return None
    ids = {id(p) for p in out.params.values()}
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
    return next((g for g, members in groups.items() if names & set(members)), None)


def selectable_head(model: nn.Module, groups: Mapping[str, Sequence[str]], head: bool,
                    trace: Callable[[], Any] | None = None) -> str | None:
    """NTKSelect's head group (:func:`head_group`; None without ``head``), or a ValueError where the
    groups leave nothing to select between."""
    name = type(model).__name__
    if len(groups) < 2:
        raise ValueError(f"{name} has one trainable layer ({list(groups)}); there is nothing to select between")
    if not head:
        return None
    found = head_group(model, groups, trace)
    if found is None:
        raise ValueError(f"NTKSelect(head=True): no trainable output layer found in {name} (its classifier is frozen "
                         "or not recognised); use head=False to rank every layer")
    if len(groups) < 3:
        raise ValueError(f"{name} has one trainable layer besides the head; there is nothing to select between "
                         "(head=False ranks the head too)")
    return found


def _check_params(model: nn.Module, params: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    if params is None:
        return trainable_parameters(model)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for n, t in params.items():
        if n not in names:
            close = [m for m in names if m.endswith(n.rsplit(".", 1)[-1])][:3]
            raise ValueError(
                f"parameter {n!r} is not a parameter of {type(model).__name__}; use model.named_parameters() "
                f"names (e.g. {close or sorted(names)[:3]})"
            )
        if not isinstance(t, Tensor):
            raise TypeError(f"params[{n!r}] must be a tensor, got {type(t).__name__}")
    if not params:
        raise ValueError("params is empty: pass at least one parameter to differentiate")
    return {n: t.detach() for n, t in params.items()}


def _check_groups(groups: Mapping[str, Sequence[str]], params: Mapping[str, Tensor]) -> dict[str, str]:
    """tensor name -> group name; every parameter in exactly one group."""
    owner: dict[str, str] = {}
    for g, names in groups.items():
        for n in names:
            if n not in params:
                raise ValueError(f"group {g!r} lists {n!r}, which is not among the parameters being differentiated")
            if n in owner:
                raise ValueError(f"parameter {n!r} is in two groups ({owner[n]!r} and {g!r}); each belongs to one")
            owner[n] = g
    missing = [n for n in params if n not in owner]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters are in no group (first: {missing[0]!r}), so sum_l S_l would miss part of K; "
            "build the groups with layer_groups(model, params) or restrict params to the grouped ones"
        )
    return owner
