"""The model's blocks as layers (SPEC "Layers", granularity ``block``): timm ``group_matcher``
groups, repeated children (``layers.N``, ``blocks.N``, ``layerN`` ...), a traced forward pass, or a
user list of name patterns; the stem before the first block and the head after the last, and the
model's output layer (found by name, by the tied embedding it shares a weight with, or by the last
matrix a traced forward pass ran). Also :func:`find_layers`, either granularity by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.forward_blocks import Trace, forward_blocks
from lalr_lightning.core.model.layers import Layer, clean_name, is_matrix_module, matrix_layers

__all__ = [
    "block_layers",
    "suggest_blocks",
    "describe_blocks",
    "find_layers",
    "output_layer",
]


_REPEAT = re.compile(r"^(?P<stem>[A-Za-z_]+?)(?P<num>\d+)$")


def _named_params_clean(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    out, seen = [], set()
    for raw, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append((clean_name(raw), p))
    return out


def _group_name(pnames: list[str], all_names: list[str]) -> str:
    """A readable name for a set of parameters: their common module prefix when that module
    holds nothing else (``layer2``, ``blocks.3``), else the ``+``-joined modules they come
    from (``conv1+bn1``, ``blocks.11+norm``)."""
    group = set(pnames)
    mods = [n.rsplit(".", 1)[0] if "." in n else "" for n in pnames]
    split = [m.split(".") if m else [] for m in mods]
    common: list[str] = []
    for parts in zip(*split):
        if all(p == parts[0] for p in parts):
            common.append(parts[0])
        else:
            break
    # the shortest prefix of the common one that holds nothing else (layer1, not layer1.0)
    for k in range(1, len(common) + 1):
        pre = ".".join(common[:k]) + "."
        if all(n in group for n in all_names if n.startswith(pre)):
            return ".".join(common[:k])
    heads: list[str] = []
    for n in pnames:
        parts = n.split(".")
        # the shortest module prefix that holds only this group's parameters
        k = len(common) + 1
        while k < len(parts):
            pre = ".".join(parts[:k]) + "."
            if all(m in group for m in all_names if m.startswith(pre)):
                break
            k += 1
        head = ".".join(parts[:k]) if k < len(parts) else n
        if head not in heads:
            heads.append(head)
    return "+".join(heads)


def _timm_root(model: nn.Module) -> tuple[str, nn.Module] | None:
    for raw, mod in model.named_modules():
        if callable(getattr(mod, "group_matcher", None)) and type(mod).__module__.startswith("timm."):
            return clean_name(raw), mod
    return None


def _timm_groups(prefix: str, root: nn.Module) -> list[list[str]]:
    from timm.models import group_parameters

    groups = group_parameters(root, root.group_matcher(coarse=True))
    ordered = [groups[k] for k in sorted(groups)]
    pre = f"{prefix}." if prefix else ""
    return [[pre + clean_name(n) for n in names] for names in ordered if names]


def _holds_params(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters())


def _is_container(mod: nn.Module) -> bool:
    """A module with sub-modules that hold parameters (a block), not a single layer."""
    return any(_holds_params(c) for c in mod.children())


def _layer_units(kids: list[tuple[str, nn.Module]]) -> list[list[str]]:
    """The layers of a plain ``Sequential``: every matrix module or container starts one; the
    parametrized leaves after it (a BatchNorm, a LayerNorm, a PReLU) join it
    (``Conv, BN, ReLU, Conv, BN`` -> ``[[0, 1], [3, 4]]``)."""
    units: list[list[str]] = []
    for n, c in kids:
        if not units or is_matrix_module(c) or _is_container(c):
            units.append([n])
        else:
            units[-1].append(n)
    return units


def _inside(name: str, prefixes: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _repeated_children(model: nn.Module) -> tuple[str, list[list[str]]] | None:
    """Find the model's main sequence of blocks: ``(container name, blocks)``, each block a list
    of module-name prefixes.

    Repeated structure first: a ``ModuleList``/``Sequential`` whose >= 2 children with
    parameters are all blocks (``blocks``, ``layers``, ``encoder.layer``, ``h``; a
    ``ModuleList`` of single layers too), or sibling children named ``<word><N>``
    (``layer1..layer4``); the candidate holding most parameters wins.

    Else a plain trunk: a ``Sequential`` of single layers (``Linear, ReLU, Linear, ...`` or
    ``Conv, BN, ReLU, ...``), each layer (with the norms that follow it) one block -- except
    its first layer when nothing is registered before the trunk (the input layer, i.e. the
    stem) and its last layer when no matrix comes after the trunk (the output layer, i.e. the
    head). The trunk with most such middle blocks wins (then most parameters).
    """
    best: tuple[int, str, list[list[str]]] | None = None
    flat: tuple[int, int, str, list[list[str]]] | None = None
    first_param = next((clean_name(n) for n, _ in model.named_parameters()), None)
    last_matrix = None
    for raw, mod in model.named_modules():
        if is_matrix_module(mod):
            last_matrix = clean_name(raw)
    for raw, mod in model.named_modules():
        name = clean_name(raw)
        pre = f"{name}." if name else ""
        kids = [(n, c) for n, c in mod.named_children() if _holds_params(c)]
        cands: list[list[str]] = []
        listed = isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(kids) >= 2
        if listed and all(n.isdigit() for n, _ in kids) and (
                isinstance(mod, nn.ModuleList) or all(_is_container(c) for _, c in kids)):
            cands.append([pre + n for n, _ in kids])
        elif listed and isinstance(mod, nn.Sequential):  # a plain trunk (docstring)
            trunk = _trunk_blocks(mod, name, pre, kids, first_param, last_matrix)
            if trunk is not None and (flat is None or trunk[:2] > flat[:2]):
                flat = trunk
        cands += _numbered_series(model, pre, kids)
        for names in cands:
            size = sum(p.numel() for n in names for p in model.get_submodule(_raw_path(model, n)).parameters())
            if best is None or size > best[0]:
                best = (size, name, [[n] for n in names])
    if best is not None:
        return best[1], best[2]
    return None if flat is None else (flat[2], flat[3])


def _trunk_blocks(mod: nn.Sequential, name: str, pre: str, kids: list[tuple[str, nn.Module]],
                  first_param: str | None, last_matrix: str | None) -> tuple[int, int, str, list[list[str]]] | None:
    """A plain trunk's middle blocks (:func:`_repeated_children`): ``(count, parameters, name,
    blocks)``, its first layer left out when it is the stem and its last when it is the head."""
    units = _layer_units(kids)
    lo = 1 if (not _is_container(mod.get_submodule(units[0][0])) and first_param is not None
               and _inside(first_param, [pre + n for n in units[0]])) else 0
    hi = len(units) - (1 if (not _is_container(mod.get_submodule(units[-1][0])) and last_matrix is not None
                             and _inside(last_matrix, [pre + n for n in units[-1]])) else 0)
    if hi <= lo:
        return None
    size = sum(p.numel() for u in units[lo:hi] for n in u for p in mod.get_submodule(n).parameters())
    return hi - lo, size, name, [[pre + n for n in u] for u in units[lo:hi]]


def _numbered_series(model: nn.Module, pre: str, kids: list[tuple[str, nn.Module]]) -> list[list[str]]:
    """Sibling children named ``<word><N>`` that are modules of layers (``layer1..layer4``), each
    series in number order."""
    series: dict[str, list[tuple[int, str]]] = {}
    for n, _ in kids:
        m = _REPEAT.match(n)
        if m:
            series.setdefault(m["stem"], []).append((int(m["num"]), pre + n))
    out = []
    for stem, items in series.items():
        # blocks are modules of layers (layer1..layer4); a series of single layers named c1, c2
        # (and b1, b2 beside them) says nothing about how they group: the forward pass does
        if len(items) >= 2 and stem not in ("conv", "bn", "fc", "norm", "relu", "linear", "dropout", "act") \
                and all(_is_container(model.get_submodule(_raw_path(model, n))) for _, n in items):
            out.append([n for _, n in sorted(items)])
    return out


def _resolve_trace(trace):
    return trace() if callable(trace) else trace


def _traced_blocks(model: nn.Module, trace) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(stem, blocks, head)`` as clean module names from a forward pass, or None."""
    trace = _resolve_trace(trace)
    if trace is None:
        return None
    found = forward_blocks(model, trace)
    if found is None:
        return None
    stem, blocks, head = found
    return [clean_name(n) for n in stem], [[clean_name(n) for n in b] for b in blocks], [clean_name(n) for n in head]


def suggest_blocks(model: nn.Module, trace=None) -> list[str | list[str]]:
    """A ``blocks=`` value to paste as it is, one entry (a module-name prefix, or a list of them)
    per middle block: the blocks :func:`block_layers` finds by itself when it can (with ``trace``,
    from a forward pass: :mod:`lalr_lightning.core.model.forward_blocks`); else the layers of the module
    with most of them (each layer with the norms after it), without its first layer when nothing
    comes before it (left as the stem) and its last when it holds the output layer (left as the
    head). The latter assumes children registered in forward order."""
    rep = _repeated_children(model)
    if rep is not None:
        return [b[0] if len(b) == 1 else list(b) for b in rep[1]]
    traced = _traced_blocks(model, trace) if trace is not None else None
    if traced is not None:
        return [b[0] if len(b) == 1 else list(b) for b in traced[1]]
    first_param = next((clean_name(n) for n, _ in model.named_parameters()), None)
    last_matrix = None
    for raw, mod in model.named_modules():
        if is_matrix_module(mod):
            last_matrix = clean_name(raw)
    best: list[list[str]] = []
    for raw, mod in model.named_modules():
        kids = [(n, c) for n, c in mod.named_children() if _holds_params(c)]
        if len(kids) < 2:
            continue
        name = clean_name(raw)
        pre = f"{name}." if name else ""
        units = [[pre + n for n in u] for u in _layer_units(kids)]
        lo = 1 if first_param is not None and _inside(first_param, units[0]) else 0
        hi = len(units) - (1 if last_matrix is not None and _inside(last_matrix, units[-1]) else 0)
        if hi <= lo:  # no layer between the input and the output layer: every layer a block
            lo, hi = 0, len(units)
        if hi - lo > len(best):
            best = units[lo:hi]
    if not best:
        return [clean_name(n) for n, _ in model.named_parameters()][:2]
    return [u[0] if len(u) == 1 else u for u in best]


_suggest_blocks = suggest_blocks  # the name it had


def describe_blocks(blocks: Sequence[Layer]) -> str:
    """One line: ``stem a | blocks b, c | head d``."""
    parts = []
    for role in ("stem", "block", "head"):
        names = [b.name for b in blocks if b.role == role]
        if names:
            parts.append(f"{role if role != 'block' else 'blocks'} {', '.join(names)}")
    return " | ".join(parts)


def _raw_path(model: nn.Module, clean: str) -> str:
    """Map a clean module name back to the raw path inside ``model``."""
    for raw, _ in model.named_modules():
        if clean_name(raw) == clean:
            return raw
    raise KeyError(clean)


def _pattern_groups(params: list[tuple[str, nn.Parameter]], patterns: Sequence[str | Sequence[str]]) -> list[list[str]]:
    groups: list[list[str]] = []
    taken: set[str] = set()
    for pat in patterns:
        pats = [pat] if isinstance(pat, str) else list(pat)
        # "^..." is a regex (timm style); anything else is a module-name prefix
        regs = [re.compile(p) if p.startswith("^") else re.compile("^" + re.escape(p) + r"(\.|$)") for p in pats]
        names = [n for n, _ in params if n not in taken and any(r.match(n) for r in regs)]
        if not names:
            raise ValueError(
                f"block pattern {pat!r} matches no parameter; parameter names start with: "
                f"{sorted({n.split('.')[0] for n, _ in params})}"
            )
        taken.update(names)
        groups.append(names)
    return groups


# a module named to run after the trunk (OPT's ``decoder.final_layer_norm``), wherever registered
_FINAL = re.compile(r"(^|\.)(final_layer_norm|final_norm|final_ln|ln_final)\.")


def block_layers(
    model: nn.Module,
    blocks: Sequence[str | Sequence[str]] | None = None,
    *,
    join_stem: bool = True,
    head: bool = True,
    trace=None,
) -> list[Layer]:
    """The model's blocks, in forward order.

    ``blocks`` (optional): a list of module-name prefixes (``"layer1"``) or regexes (starting
    with ``^``), one entry (or a list of entries) per block. Without it: timm's
    ``group_matcher(coarse=True)`` when the model (or a submodule) is a timm model, else the
    repeated children found by :func:`_repeated_children`, else -- with ``trace``, a
    :class:`~lalr_lightning.core.model.forward_blocks.Trace` of one forward pass or a no-argument
    callable making one (called only then) -- the layers in the order they ran
    (:func:`~lalr_lightning.core.model.forward_blocks.forward_blocks`: the first layer the stem, the
    output layer the head, each conv with its norm, a residual branch inside one block).

    Parameters not in any block and registered before the first block form the stem, joined
    to the first block when ``join_stem`` (surgical fine-tuning's ``conv1+block1``); the rest
    form one ``head`` block (``head=False`` drops it). A final norm registered before the blocks
    (OPT's ``final_layer_norm``) belongs to the head: it runs after them.
    """
    params = _named_params_clean(model)
    if not params:
        raise ValueError("the model has no parameters, so it has no blocks to select")
    order = {n: i for i, (n, _) in enumerate(params)}
    stem_names, found_blocks, head_names, ran = _split_blocks(model, params, order, blocks, trace)
    late = [n for n in stem_names if _FINAL.search(n)]
    if late:  # OPT registers its final norm before its layers; it runs after them
        stem_names = [n for n in stem_names if n not in late]
        head_names = late + [n for n in head_names if n not in late]
    out = _assemble_blocks(model, params, stem_names, [list(g) for g in found_blocks if g], head_names, ran,
                           join_stem, head)
    for i, layer in enumerate(out):
        layer.index = i
    return out


# How the parameters split: (stem names, the blocks' names, head names, and -- for blocks found in a
# forward pass -- the modules that ran, by block (a tuple of its names), "stem" and "head"; else None).
_Split = tuple[list[str], list[list[str]], list[str], "dict | None"]


def _split_blocks(model: nn.Module, params: list[tuple[str, nn.Parameter]], order: dict[str, int],
                  blocks: Sequence[str | Sequence[str]] | None, trace) -> _Split:
    """The stem, the blocks and the head, by the first source that gives blocks (:func:`block_layers`)."""
    if blocks is not None:
        return _split_by_patterns(params, order, blocks)
    timm_root = _timm_root(model)
    if timm_root is not None:
        return _split_by_timm(params, _timm_groups(*timm_root))
    rep = _repeated_children(model)
    if rep is not None:
        return _split_by_prefixes(params, order, rep[1])
    traced = _traced_blocks(model, trace) if trace is not None else None
    if traced is None:
        ran = "" if trace is None else " (nor three layers in the forward pass it ran)"
        raise ValueError(
            f"cannot find the blocks of {type(model).__name__}: it has no timm group_matcher "
            "and no repeated children (ModuleList/Sequential of blocks, children named layer1, "
            f"layer2, ..., or a Sequential trunk of layers){ran}. Pass blocks=[...] with one module-name "
            "prefix (or a list of them) per block; parameters before the first block form the stem, "
            f"those after the last the head: e.g. blocks={suggest_blocks(model)!r}"
        )
    return _split_by_trace(params, order, traced)


def _split_by_patterns(params: list[tuple[str, nn.Parameter]], order: dict[str, int],
                       blocks: Sequence[str | Sequence[str]]) -> _Split:
    groups = _pattern_groups(params, blocks)
    rest: list[str] = [n for n, _ in params if not any(n in g for g in groups)]
    first = min(order[n] for n in groups[0])
    return [n for n in rest if order[n] < first], groups, [n for n in rest if order[n] >= first], None


def _split_by_timm(params: list[tuple[str, nn.Parameter]], groups: list[list[str]]) -> _Split:
    # timm's coarse groups are stem, blocks..., head; params outside the timm model
    # (a LightningModule's own) go to the head.
    inside = {n for g in groups for n in g}
    outside = [n for n, _ in params if n not in inside]
    stem_names = groups[0] if len(groups) > 2 else []
    found_blocks = groups[1:-1] if len(groups) > 2 else groups
    head_names = (groups[-1] if len(groups) > 2 else []) + outside
    return stem_names, found_blocks, head_names, None


def _split_by_prefixes(params: list[tuple[str, nn.Parameter]], order: dict[str, int],
                       names: list[list[str]]) -> _Split:
    found_blocks = [[n for n, _ in params if _inside(n, prefixes)] for prefixes in names]
    inside = {n for g in found_blocks for n in g}
    first = min(order[n] for n in found_blocks[0])
    stem_names = [n for n, _ in params if n not in inside and order[n] < first]
    head_names = [n for n, _ in params if n not in inside and order[n] >= first]
    return stem_names, found_blocks, head_names, None


def _split_by_trace(params: list[tuple[str, nn.Parameter]], order: dict[str, int], traced) -> _Split:
    stem_mods, middle, head_mods = traced
    found_blocks = [[n for n, _ in params if _inside(n, mods)] for mods in middle]
    # the modules that ran, kept with their groups (a name like ``layers`` may be a
    # ModuleList that never runs itself)
    ran = {tuple(g): mods for g, mods in zip(found_blocks, middle)}
    ran["stem"], ran["head"] = stem_mods, head_mods
    inside = {n for g in found_blocks for n in g}
    first = min(order[n] for n in found_blocks[0])
    # the first unit that ran is the stem, the last the head; parameters of modules that
    # did not run (or of the root) go by where they are registered
    stem_names = [n for n, _ in params if n not in inside and (_inside(n, stem_mods) or (
        order[n] < first and not _inside(n, head_mods)))]
    head_names = [n for n, _ in params if n not in inside and n not in stem_names]
    return stem_names, found_blocks, head_names, ran


def _assemble_blocks(model: nn.Module, params: list[tuple[str, nn.Parameter]], stem_names: list[str],
                     blocks_names: list[list[str]], head_names: list[str], ran: dict | None, join_stem: bool,
                     head: bool) -> list[Layer]:
    """The block layers: the stem (joined to the first block when ``join_stem``), the blocks, the head."""
    lookup = dict(params)
    out: list[Layer] = []
    allp = [n for n, _ in params]

    def mods(key) -> list[str] | None:
        return None if ran is None else ran.get(key)

    if stem_names and join_stem and blocks_names:
        name0 = _group_name(stem_names, allp) + "+" + _group_name(blocks_names[0], allp)
        joined = None if ran is None else mods("stem") + mods(tuple(blocks_names[0]))
        out.append(_mk_block(model, name0, stem_names + blocks_names[0], lookup, "block", joined))
        blocks_names = blocks_names[1:]
    elif stem_names:
        out.append(_mk_block(model, _group_name(stem_names, allp), stem_names, lookup, "stem", mods("stem")))
    for g in blocks_names:
        out.append(_mk_block(model, _group_name(g, allp), g, lookup, "block", mods(tuple(g))))
    if head and head_names:
        out.append(_mk_block(model, _group_name(head_names, allp), head_names, lookup, "head", mods("head")))
    return out


def _mk_block(model: nn.Module, name: str, pnames: list[str], lookup: dict[str, nn.Parameter], role: str,
              ran: list[str] | None = None) -> Layer:
    if ran is not None:  # from a forward pass: the modules that ran, in that order
        modules = [model.get_submodule(_raw_path(model, m)) for m in ran]
        return Layer(name=name, kind="block", module=modules[0] if len(modules) == 1 else None,
                     params={n: lookup[n] for n in pnames}, modules=modules, role=role)
    module = None
    if "+" not in name:
        try:
            module = model.get_submodule(_raw_path(model, name))
        except (KeyError, AttributeError):
            module = None
    mods = []
    if module is not None:
        mods = [module]
    else:
        for part in name.split("+"):
            try:
                mods.append(model.get_submodule(_raw_path(model, part)))
            except (KeyError, AttributeError):
                pass
    return Layer(name=name, kind="block", module=module, params={n: lookup[n] for n in pnames}, modules=mods, role=role)


def find_layers(model: nn.Module, granularity: str = "matrix", **kwargs) -> list[Layer]:
    """``matrix_layers`` or ``block_layers`` by name; the error lists the valid names."""
    if granularity == "matrix":
        return matrix_layers(model, **kwargs)
    if granularity == "block":
        return block_layers(model, **kwargs)
    raise unknown("granularity", granularity, ("matrix", "block"), show=repr)


# --------------------------------------------------------------------------- output layer


def _output_weight(model: nn.Module, trace: Callable[[], Trace] | None = None) -> torch.Tensor | None:
    """The output layer's weight: the first module (outermost first) whose Hugging Face
    ``get_output_embeddings()`` or timm ``get_classifier()`` returns a module with a weight
    (peft's ``PeftModel`` forwards both to the wrapped model); else the matrix module that runs
    last in the forward pass ``trace`` gives (a model that registers its head before its trunk),
    or without one (or when it fails) the last registered -- shared weights included, so a
    hand-tied head counts -- unless that one lies inside one of the model's repeated blocks (a
    headless backbone has no output layer: a block matrix is never the head)."""
    for _, mod in model.named_modules():
        for getter in ("get_output_embeddings", "get_classifier"):
            get = getattr(mod, getter, None)
            if not callable(get):
                continue
            try:
                out = get()
            except (NotImplementedError, AttributeError, TypeError):
                continue
            w = getattr(out, "weight", None) if isinstance(out, nn.Module) else None
            if isinstance(w, torch.Tensor):
                return w
    last = _last_ran(model, trace)
    if last is None:
        for raw, mod in model.named_modules(remove_duplicate=False):
            if is_matrix_module(mod):
                last = (clean_name(raw), mod)
    if last is None:
        return None
    rep = _repeated_children(model)
    if rep is not None and any(_inside(last[0], block) for block in rep[1]):
        return None
    return last[1].weight


def _last_ran(model: nn.Module, trace: Callable[[], Trace] | None) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of the matrix module whose first call came last in ``trace``'s forward
    pass; None without a trace, when it fails (no batch, a forward that needs more) or when no
    matrix module ran."""
    if trace is None:
        return None
    try:
        order = trace().order
    except ValueError:  # forward_trace's one line: the registration order is the answer then
        return None
    modules = dict(model.named_modules())
    ran = [n for n in order if n in modules and is_matrix_module(modules[n])]
    return (clean_name(ran[-1]), modules[ran[-1]]) if ran else None


def output_layer(model: nn.Module, layers: Sequence[Layer] | None = None,
                 trace: Callable[[], Trace] | None = None) -> Layer | None:
    """The Layer of ``layers`` that owns the model's output (head) weight, or ``None``.

    The output weight is found by :func:`_output_weight` (Hugging Face ``get_output_embeddings``
    on the model, a LightningModule holding it, or a peft wrapper; timm ``get_classifier``; else
    the matrix module that runs last in ``trace``'s forward pass, or without one the last
    registered, outside the repeated blocks). ``layers`` defaults to :func:`matrix_layers` of
    ``model``; any list of Layers works (block layers too). Because a shared weight belongs to the
    first module that registers it, a head tied to the input embedding (``tie_word_embeddings=True``:
    GPT-2, OPT, many LLaMA-style models) maps to the embedding's Layer. ``None`` when the model has
    no head (a bare ``LlamaModel``) or the head weight is in none of ``layers`` (e.g. frozen and
    left out with ``include_frozen=False``).
    """
    w = _output_weight(model, trace)
    if w is None:
        return None
    if layers is None:
        layers = matrix_layers(model)
    for layer in layers:
        if any(p is w for p in layer.params.values()):
            return layer
    return None
