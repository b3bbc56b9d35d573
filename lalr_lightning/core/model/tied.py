"""Tied parameters in a selection: units that hold one tensor are one unit.

A parameter shared by two modules (``net[4].weight = net[2].weight``) is listed once, under the
first module that registers it (:func:`~lalr_lightning.core.model.blocks.block_layers`). A selection
that froze ``net.2`` and trained ``net.4`` would then freeze the shared weight (``net.4`` trains
its bias alone), and training ``net.2`` would move ``net.4`` too: neither the freeze nor the
training would be what the selection says. So the units that hold one tensor are joined into one
unit (``net.2+net.4``), trained or frozen together: every freeze is real, and so is every
training. A module whose weight is tied and that holds no other parameter of its own (a tied
``lm_head``) belongs to no unit, so the unit of the module that registered the tensor first (the
input embedding) decides for both; nothing is joined there.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lalr_lightning.core.model.layers import Layer, clean_name

__all__ = ["join_tied", "tied_pairs"]

_ROLES = ("stem", "head", "block")  # a joined unit keeps the first of these its parts have


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _unit_of(name: str, units: Sequence[Layer]) -> int | None:
    """The unit a parameter name (an alias of a shared tensor) sits in: the unit holding another
    parameter of the same module, else one whose name parts are module prefixes of it."""
    module = _module_of(name)
    for i, u in enumerate(units):
        if any(_module_of(n) == module for n in u.params):
            return i
    for i, u in enumerate(units):
        if any(part and (name.startswith(part + ".")) for part in u.name.split("+")):
            return i
    return None


def tied_pairs(model: nn.Module, units: Sequence[Layer]) -> list[tuple[int, int, str]]:
    """``(owner unit, other unit, parameter)`` for every tensor that ``units[owner]`` holds and that a
    module of ``units[other]`` uses under another name."""
    owner = {id(p): i for i, u in enumerate(units) for p in u.params.values()}
    first: dict[int, str] = {}
    out = []
    for raw, p in model.named_parameters(remove_duplicate=False):
        name = clean_name(raw)
        if id(p) not in first:
            first[id(p)] = name
            continue
        if id(p) not in owner or name == first[id(p)]:
            continue
        other = _unit_of(name, units)
        if other is not None and other != owner[id(p)]:
            out.append((owner[id(p)], other, first[id(p)]))
    return out


def join_tied(model: nn.Module, units: list[Layer]) -> tuple[list[Layer], list[str]]:
    """``(units, notes)``: the units with every group that shares a tensor joined into one (named
    ``a+b``, at the place of its first part; its parameters, modules and role from its parts), and
    one note per joined unit naming the shared parameters. Unchanged when nothing is tied."""
    pairs = tied_pairs(model, units)
    if not pairs:
        return units, []
    parent = list(range(len(units)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    shared: dict[int, list[str]] = {}
    for a, b, _ in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    for a, _, pname in pairs:
        names = shared.setdefault(root(a), [])
        if pname not in names:
            names.append(pname)
    groups: dict[int, list[int]] = {}
    for i in range(len(units)):
        groups.setdefault(root(i), []).append(i)
    out: list[Layer] = []
    notes: list[str] = []
    for r in sorted(groups):
        members = [units[i] for i in groups[r]]
        if len(members) == 1:
            out.append(members[0])
            continue
        role = next(x for x in _ROLES if any(m.role == x for m in members))
        params = {n: p for m in members for n, p in m.params.items()}
        modules = [mod for m in members for mod in m.modules]
        joined = Layer(name="+".join(m.name for m in members), kind=members[0].kind, module=None, params=params,
                       modules=modules, role=role)
        out.append(joined)
        notes.append(f"{' and '.join(m.name for m in members)} share {', '.join(shared.get(r, []))}: one unit "
                     f"{joined.name!r}, trained or frozen together")
    for i, u in enumerate(out):
        u.index = i
    return out, notes
