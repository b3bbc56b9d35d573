"""Blocks from what runs: a model's layers in the order one forward pass calls them, grouped into
blocks -- for models whose blocks no registry (timm ``group_matcher``), repeated children or
``Sequential`` trunk gives (:func:`lalr_lightning.core.model.blocks.block_layers` asks for it last).

:func:`trace_modules` runs the model once with forward hooks on every module and records which
modules ran, in which order, and which earlier modules each one's input came from (through the
autograd graph of the pass). :func:`forward_units` then walks the model from the top:

* the children of a module are taken in the order they first ran (a ``ModuleList`` or
  ``ModuleDict`` that is never called itself is looked through: its children take its place);
  a module holding all of its parent's parameters is descended into (a LightningModule around
  ``self.net``);
* every weighted layer (a ``Linear``, a convolution, an ``Embedding``) starts a unit; the
  parametrized layers that run after it and hold no weight matrix (a BatchNorm, a LayerNorm, a
  PReLU) join it -- each conv with its norm; a child that holds several layers (a residual block
  written as its own module) is one unit, whole;
* a residual branch written inline stays inside one unit: when a unit's input comes (also) from
  a unit before the one just before it, the units in between -- the branch the skip bypasses --
  are merged;
* fewer than three units (a model of a backbone and a head): the largest one-module unit is
  opened into the units of its children.

:func:`forward_blocks` makes the first unit the stem, the last (the output layer) the head and
the units between the blocks. Pure PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from lalr_lightning.core.model.layers import is_matrix_module

__all__ = ["Trace", "trace_modules", "forward_units", "forward_blocks"]

#: autograd nodes one skip search visits at most (a model written functionally can have long
#: stretches of graph between modules; the search then stops and merges nothing)
_SEARCH_LIMIT = 20_000


@dataclass
class Trace:
    """What one forward pass showed: ``order`` -- module names (``named_modules()`` names, the
    root ``""`` left out) in the order they first ran; ``calls`` -- how often each ran;
    ``inputs_from`` -- for each module that ran, the modules whose outputs its inputs were
    computed from (the nearest ones on each path back through the autograd graph)."""

    order: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    inputs_from: dict[str, set[str]] = field(default_factory=dict)

    def first(self, name: str) -> int | None:
        """Position of ``name`` in :attr:`order` (``None``: it never ran)."""
        try:
            return self.order.index(name)
        except ValueError:
            return None


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # a Hugging Face ModelOutput
        return _tensors(obj.to_tuple())
    return []


@contextlib.contextmanager
def _hooks(model: nn.Module, trace: Trace, made_by: dict, pending: dict) -> Iterator[None]:
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(_m, args, kwargs, name=name):
            if name not in trace.calls:
                trace.order.append(name)
                nodes = [t.grad_fn for t in _tensors((args, kwargs)) if t.grad_fn is not None]
                pending[name] = nodes
            trace.calls[name] = trace.calls.get(name, 0) + 1

        def post(_m, _args, out, name=name):
            for t in _tensors(out):
                if t.grad_fn is not None:
                    made_by.setdefault(t.grad_fn, name)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sources(nodes: list, made_by: dict, own: str) -> set[str]:
    """The modules whose outputs the given autograd nodes were computed from, nearest first on
    each path (an output of ``own`` itself, or of a module inside it, does not stop the search)."""
    found: set[str] = set()
    seen: set = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > _SEARCH_LIMIT:
            return set()
        maker = made_by.get(node)
        if maker is not None and maker != own and not maker.startswith(own + "."):
            found.add(maker)
            continue
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return found


def trace_modules(model: nn.Module, run: Callable[[], object]) -> Trace:
    """Run ``run()`` (which calls ``model`` on a probe batch) once with hooks on every module, in
    eval mode (a probe of one or two samples runs through BatchNorm; dropout off), gradients
    enabled so the data flow between modules can be read from the autograd graph. Modes, buffers
    and the global random state are put back afterwards; nothing is backpropagated."""
    trace, made_by, pending = Trace(), {}, {}
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device.index or 0] if device.type == "cuda" else []
    model.eval()
    try:
        with _hooks(model, trace, made_by, pending), torch.enable_grad(), torch.random.fork_rng(devices=devices):
            run()
        trace.inputs_from = {n: _sources(nodes, made_by, n) for n, nodes in pending.items()}
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    return trace


# --------------------------------------------------------------------------- units


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())




def _children(module: nn.Module, prefix: str, trace: Trace) -> list[tuple[str, nn.Module]]:
    """The parametrized children of ``module`` that ran, in the order they first ran; a container
    that never ran itself but whose children did (``ModuleList``, ``ModuleDict``) is replaced by
    them."""
    out = []
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if not _holds_params(child):
            continue
        if trace.first(full) is None:
            inner = _children(child, full + ".", trace)
            out += inner
        else:
            out.append((full, child))
    return sorted(out, key=lambda item: trace.first(item[0]))


def _unit_of(units: list[list[str]]) -> dict[str, int]:
    return {m: i for i, u in enumerate(units) for m in u}


def _unit(where: dict[str, int], name: str) -> int | None:
    """The unit holding module ``name`` (or the module it is inside of)."""
    while name:
        if name in where:
            return where[name]
        name = name.rpartition(".")[0]
    return None


def _merge_skips(units: list[list[str]], trace: Trace) -> list[list[str]]:
    """Merge the units a skip connection bypasses (module docstring)."""
    changed = True
    while changed:
        changed = False
        where = _unit_of(units)
        for j in range(2, len(units)):
            srcs = [_unit(where, s) for s in trace.inputs_from.get(units[j][0], ())]
            srcs = [s for s in srcs if s is not None and s < j]
            if srcs and min(srcs) + 1 < j - 1:  # a skip over two or more units: they are one branch
                lo = min(srcs) + 1
                units = units[:lo] + [[m for u in units[lo:j] for m in u]] + units[j:]
                changed = True
                break
    return units


def _units(node: nn.Module, prefix: str, trace: Trace) -> list[list[str]]:
    units: list[list[str]] = []
    for name, child in _children(node, prefix, trace):
        if is_matrix_module(child) or any(_holds_params(c) for c in child.children()) or not units:
            units.append([name])
        else:  # a norm (or another parametrized leaf) joins the layer that ran before it
            units[-1].append(name)
    return units


def forward_units(model: nn.Module, trace: Trace) -> list[list[str]]:
    """The model's units in forward order, each a list of module names (module docstring). With
    fewer than three, the largest unit that is one module of several layers is opened into its
    own units (a ``LlamaForCausalLM`` of one layer: ``model`` and ``lm_head`` become the
    embedding, the layer with the final norm, and the head)."""
    prefix, node = "", model
    own = {id(p) for p in model.parameters()}
    while True:  # descend through wrappers holding everything (a LightningModule around self.net)
        kids = [(n, c) for n, c in node.named_children() if _holds_params(c)]
        if len(kids) == 1 and {id(p) for p in kids[0][1].parameters()} == own and trace.first(
                prefix + kids[0][0]) is not None and not is_matrix_module(kids[0][1]):
            prefix, node = f"{prefix}{kids[0][0]}.", kids[0][1]
            continue
        break
    units = _units(node, prefix, trace)
    while len(units) < 3:
        whole = [(i, model.get_submodule(u[0])) for i, u in enumerate(units) if len(u) == 1]
        whole = [(i, m) for i, m in whole if any(_holds_params(c) for c in m.children())]
        if not whole:
            break
        i, mod = max(whole, key=lambda im: sum(p.numel() for p in im[1].parameters()))
        inner = _units(mod, units[i][0] + ".", trace)
        if len(inner) < 2:
            break
        units = units[:i] + inner + units[i + 1:]
    return _merge_skips(units, trace)


def forward_blocks(model: nn.Module, trace: Trace) -> tuple[list[str], list[list[str]], list[str]] | None:
    """``(stem, blocks, head)`` as module names: the first unit, the units between, the last (the
    output layer); ``None`` when fewer than three units ran (no block between input and output)."""
    units = forward_units(model, trace)
    if len(units) < 3:
        return None
    return units[0], units[1:-1], units[-1]
