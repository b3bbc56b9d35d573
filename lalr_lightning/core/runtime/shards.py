"""Weights across ranks: each rank measures a share of the layers, and where a strategy shards the
weights (FSDP) it gathers only the whole weights of that share, one FSDP unit at a time; and
tensors kept next to sharded weights (pruning masks, proximal anchors) are cut like them.

Two kinds of sharding are understood:

* FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``): each unit holds one flat
  parameter, cut into equal contiguous pieces, one per rank; an original parameter is a 1-D view
  of the part of it this rank holds (possibly empty). Whole weights come from
  ``summon_full_params`` on each unit in turn, after the root unit -- the outermost one, which
  the caller passes -- has initialised itself;
* FSDP2 (``fully_shard``): every parameter is a ``DTensor`` cut along its first dimension; whole
  weights come from ``unshard()`` / ``reshard()`` of each unit in turn.

Pure PyTorch (``torch.distributed``); the callbacks decide when. The layers keep their clean
names, so the share a rank gets, and the merged result, are the same on every rank.

The same for every callback, through the loop's host (``host``: a
:class:`~lalr_lightning.callbacks.host.Host`, of which these read the world and the model): the
weights measured with the work shared out (:func:`measure_shards`), deciding on rank zero and
broadcasting, so ranks cannot drift apart (:func:`on_rank_zero`), the root to gather through
(:func:`model_root`), how to cut tensors kept beside the weights (:func:`shard_layout`), following
the parameters FSDP2 puts in place of the old ones (:func:`rebind`), and the whole model on rank
zero for the measurements that run it through ``torch.func`` (:class:`WholeCopy`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lalr_lightning.core.model.layers import Layer, clean_name
from lalr_lightning.core.runtime.decision import Decision

__all__ = ["ShardLayout", "WholeCopy", "all_sum", "assign_shares", "backward_discarded", "decide_on_zero",
           "fsdp_units", "gather_objects", "is_dtensor", "layer_paths", "layers_in", "local_tensor",
           "loss_through_root", "materialize", "measure_shards", "model_root", "on_rank_zero", "parameter_names", "partitioned",
           "rebind", "replaces_parameters", "shard_layout", "sharded", "skeleton", "whole_weights"]


def assign_shares(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank measuring each unit of work: largest first, each to the least loaded rank (a
    deterministic greedy balance, so every rank computes the same assignment)."""
    load = [0.0] * world_size
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` outside a process group)."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over the ranks (a new tensor; ``values`` itself outside a process group)."""
    if not _distributed():
        return values
    out = values.detach().clone()
    dist.all_reduce(out)
    return out


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter, or anything cut like one)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: an FSDP2 ``DTensor``'s local shard (sharing its
    storage); a DeepSpeed ZeRO-3 parameter's partition (``ds_tensor``, read by attribute), 1-D,
    without the padding of the last rank's; anything else itself (an FSDP1 parameter is its own
    piece already). Pass the parameter itself: ``detach()`` drops ZeRO-3's attributes."""
    if is_dtensor(t):
        return t.to_local()
    part = getattr(t, "ds_tensor", None)
    if part is None:
        return t
    size = part.numel()
    # the partition's index is the rank in the parameter's own group (the data-parallel one)
    rank = dist.get_rank(group=getattr(t, "ds_process_group", None)) if _distributed() else 0
    return part.reshape(-1)[:max(0, min(size, int(t.ds_numel) - rank * size))]


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP1 instances in ``model``, innermost first (empty when it is not FSDP-wrapped)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = [m for m in model.modules() if isinstance(m, FSDP)]
    return units[::-1]


def _fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to, innermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)][::-1]


def _owning_unit(units: list[nn.Module], p: nn.Parameter) -> nn.Module | None:
    for u in units:  # innermost first: the unit that manages p itself
        if any(q is p for q in u.parameters()):
            return u
    return None


def _stand_in(layer: Layer, weight: torch.Tensor) -> Layer:
    return Layer(layer.name, layer.kind, SimpleNamespace(weight=weight), {}, [], layer.index, layer.role)


def whole_weights(
    model: nn.Module,
    layers: Sequence[Layer],
    mine: set[str],
    weight_of: Callable[[Layer], torch.Tensor] = lambda layer: layer.weight.detach(),
) -> list[Layer]:
    """Stand-ins for the layers named in ``mine`` that hold their whole weight (``weight_of``,
    cloned), for measuring.

    ``model`` is the outermost module: under FSDP1 the root unit itself (Lightning's
    ``trainer.strategy.model``, which wraps the LightningModule from outside), so that the root
    initialises before any nested unit is gathered. Without sharding the weights are whole
    already and nothing is copied. Under FSDP every rank must call this with the same ``layers``:
    each unit holding one of them is gathered in turn (no write-back, not recursing into nested
    units), and only the ranks that measure one of its layers copy it, so a rank's memory holds
    its own share plus one unit at a time.
    """
    units = fsdp_units(model)
    if units:
        return _fsdp1_whole(model, units, layers, mine, weight_of)
    units = _fsdp2_units(model)
    if units:
        return _fsdp2_whole(units, layers, mine, weight_of)
    return [layer for layer in layers if layer.name in mine]


def _by_unit(units: list[nn.Module], layers: Sequence[Layer]) -> list[tuple[nn.Module | None, list[Layer]]]:
    """The layers grouped by the unit that manages their first parameter, in model order (None:
    in no unit, whole on every rank)."""
    by_unit: dict[int, tuple[nn.Module | None, list[Layer]]] = {}
    for layer in layers:
        unit = _owning_unit(units, next(iter(layer.params.values())))
        by_unit.setdefault(id(unit), (unit, []))[1].append(layer)
    return list(by_unit.values())


def _fsdp1_whole(model, units, layers, mine, weight_of) -> list[Layer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    # Gathering a nested unit first would make it a root: let each root initialise itself first
    # (a no-op once a forward pass has run, as it has after a training step).
    for root in FSDP.fsdp_modules(model, root_only=True):
        with FSDP.summon_full_params(root, writeback=False, recurse=False):
            pass
    out: dict[str, Layer] = {}
    for unit, members in _by_unit(units, layers):  # the same order on every rank (model order)
        if unit is None:
            raise RuntimeError(f"layer {members[0].name!r} is in no FSDP unit of the model; pass the root unit")
        with FSDP.summon_full_params(unit, writeback=False, recurse=False):
            for layer in members:
                if layer.name in mine:
                    out[layer.name] = _stand_in(layer, weight_of(layer).clone())
    return [out[layer.name] for layer in layers if layer.name in out]


def _fsdp2_whole(units, layers, mine, weight_of) -> list[Layer]:
    out: dict[str, Layer] = {}
    for unit, members in _by_unit(units, layers):
        if unit is not None:
            unit.unshard()  # this unit's own parameters whole (nested units stay sharded)
        try:
            for layer in members:
                if layer.name in mine:
                    out[layer.name] = _stand_in(layer, weight_of(layer).clone())
        finally:
            if unit is not None:
                unit.reshard()
    return [out[layer.name] for layer in layers if layer.name in out]


def _gathered_whole(host: Any, layers: Sequence[Layer], mine: set[str],
                    weight_of: Callable[[Layer], torch.Tensor]) -> list[Layer]:
    """:func:`whole_weights` where the engine partitions every parameter (:func:`partitioned`):
    each layer's parameters (its module's too: LoRA's base weight and adapters) gathered whole in
    turn through ``host.gathered`` (a collective: every rank, the same layers in the same order),
    copied by the rank that measures it and released, so a rank holds its share plus one layer."""
    out = []
    for layer in layers:
        params = {id(p): p for p in layer.params.values()}
        if layer.module is not None:
            params.update({id(p): p for p in layer.module.parameters()})
        with host.gathered(list(params.values())):
            if layer.name in mine:
                out.append(_stand_in(layer, weight_of(layer).clone()))
    return out


def _stored(module: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """``(owner, kind, name, tensor)`` of every parameter and persistent buffer (what a state
    dict holds), each owner once (``kind``: ``"_parameters"`` or ``"_buffers"``)."""
    out = []
    for m in module.modules():
        out += [(m, "_parameters", n, t) for n, t in m._parameters.items() if t is not None]
        out += [(m, "_buffers", n, t) for n, t in m._buffers.items()
                if t is not None and n not in m._non_persistent_buffers_set]
    return out


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and persistent buffers are on the meta device
    (shapes, dtypes, ``requires_grad`` and ties kept, no memory), everything else copied -- the
    non-persistent buffers (rotary frequencies) a state dict leaves out. :func:`materialize`
    fills it from a whole state dict."""
    memo: dict[int, Any] = {}
    for _, kind, _, t in _stored(module):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta
    return copy.deepcopy(module, memo)


def materialize(skel: nn.Module, state: dict[str, torch.Tensor], device: torch.device | str,
                frozen: bool = False) -> nn.Module:
    """A whole, working copy of the module :func:`skeleton` was taken from: ``skel`` copied, each
    meta tensor replaced by ``state``'s (by its name in the module, a tied one once for all its
    names), everything on ``device``; ``frozen``: no parameter requires grad (a backward through
    it computes no weight gradient)."""
    out = copy.deepcopy(skel)
    names = {}
    for name, t in [*out.named_parameters(remove_duplicate=False), *out.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    made: dict[int, torch.Tensor] = {}
    for owner, kind, attr, t in _stored(out):
        if not t.is_meta:
            continue
        if id(t) not in made:
            key = next((n for n in names.get(id(t), []) if n in state), None)
            if key is None:
                raise RuntimeError(f"the gathered state dict has no {names.get(id(t), ['?'])[0]!r}")
            value = state[key].detach().to(device)
            grad = t.requires_grad and not frozen
            made[id(t)] = nn.Parameter(value, requires_grad=grad) if kind == "_parameters" else value
        getattr(owner, kind)[attr] = made[id(t)]
    return out.to(device)


def layer_paths(model: nn.Module, layers: Sequence[Layer]) -> dict[str, tuple]:
    """Where each layer's modules and parameters sit in ``model``, by name: ``layer -> (module,
    [modules], {parameter: path})``, to find the same layers in a copy (:func:`layers_in`)."""
    mods = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    raw = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return {la.name: (mods.get(id(la.module)), [mods[id(m)] for m in la.modules],
                      {n: raw[id(p)] for n, p in la.params.items()}) for la in layers}


def layers_in(model: nn.Module, layers: Sequence[Layer], paths: dict[str, tuple]) -> list[Layer]:
    """``layers`` as they sit in ``model``, a copy of the model ``paths`` were taken from."""
    out = []
    for la in layers:
        module, modules, params = paths[la.name]
        out.append(dataclasses.replace(la, module=None if module is None else model.get_submodule(module),
                                       modules=[model.get_submodule(m) for m in modules],
                                       params={n: model.get_parameter(p) for n, p in params.items()}))
    return out


def _cat_pieces(piece: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D ``piece`` (of any length), concatenated in rank order."""
    if not _distributed():
        return piece.clone()
    if piece.dtype == torch.bool:  # gloo gathers no bools
        return _cat_pieces(piece.to(torch.uint8)).bool()
    world = dist.get_world_size()
    n = torch.tensor([piece.numel()], device=piece.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(int(k) for k in sizes))
    padded = torch.zeros(longest, dtype=piece.dtype, device=piece.device)
    padded[: piece.numel()] = piece
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[: int(k)] for o, k in zip(out, sizes)])


class ShardLayout:
    """How the parameters of ``model`` (the outermost module: under FSDP1 the root unit) are cut
    across the ranks, to cut other tensors the same way (:meth:`local`) and to put them back
    together (:meth:`whole`, collective: every rank calls it, in the same order).

    A parameter no strategy shards is whole on every rank: both are the identity for it.
    """

    def __init__(self, model: nn.Module):
        self._fsdp1: dict[int, tuple[Any, torch.Size]] = {}  # id(original parameter) -> (shard info, its shape)
        for unit in fsdp_units(model):
            handle = getattr(unit, "_handle", None)
            flat = getattr(handle, "flat_param", None)
            if flat is None or getattr(flat, "_params", None) is None:
                continue  # use_orig_params=False: no original parameters to follow
            if not handle.uses_sharded_strategy:
                continue  # NO_SHARD (FSDP1's choice on one rank): every parameter whole, in its own shape
            for p, info, shape in zip(flat._params, flat._shard_param_infos, flat._shapes):
                self._fsdp1[id(p)] = (info, shape)

    def sharded(self, p: torch.Tensor) -> bool:
        return id(p) in self._fsdp1 or is_dtensor(p)

    def shape(self, p: torch.Tensor) -> tuple[int, ...]:
        """The whole shape of ``p`` (a ZeRO-3 parameter's ``ds_shape``: its tensor is a placeholder)."""
        if id(p) in self._fsdp1:
            return tuple(self._fsdp1[id(p)][1])
        return tuple(getattr(p, "ds_shape", p.shape))

    def local(self, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (``p``'s whole shape), laid out as ``p`` holds its own:
        an FSDP1 parameter's 1-D slice, an FSDP2 parameter's ``DTensor`` shard; on ``p``'s device."""
        full = full.to(p.device)
        if id(p) in self._fsdp1:
            info, _ = self._fsdp1[id(p)]
            flat = full.reshape(-1)
            if not info.in_shard:
                return flat[:0].clone()
            return flat[info.intra_param_start_idx: info.intra_param_end_idx + 1].clone()
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            # every rank holds ``full``: each cuts its own piece, no communication
            return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        return full

    def whole(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's piece ``local`` (cut as :meth:`local` cuts it)."""
        if id(p) in self._fsdp1:
            # the ranks' pieces are consecutive runs of the flattened tensor, in rank order
            return _cat_pieces(local.detach().reshape(-1)).reshape(self._fsdp1[id(p)][1])
        if is_dtensor(local):
            return local.full_tensor()
        return local


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of every parameter of ``module`` (shared ones under each name)."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def rebind(obj: Any, names: Mapping[int, str], module: nn.Module) -> Any:
    """``obj`` with every parameter named in ``names`` (``parameter_names`` taken before the
    strategy replaced them) swapped for the parameter of that name in ``module`` now, in place
    in dicts, lists and :class:`Layer` parameter tables (where the callbacks keep parameters)."""
    live = dict(module.named_parameters(remove_duplicate=False))

    def swap(x: Any) -> Any:
        if isinstance(x, torch.nn.Parameter):
            name = names.get(id(x))
            return live.get(name, x) if name is not None else x
        if isinstance(x, Layer):
            swap(x.params)
        elif isinstance(x, dict):
            for k in list(x):
                x[k] = swap(x[k])
        elif isinstance(x, list):
            x[:] = [swap(v) for v in x]
        return x

    return swap(obj)


def sharded(host: Any) -> bool:
    """Whether the strategy holds the parameters in shards across the ranks (FSDP1 or FSDP2)."""
    return getattr(host, "sharding", "none") in ("fsdp1", "fsdp2")  # None: no host (a bare configure)


def partitioned(host: Any) -> bool:
    """Whether the engine keeps each parameter whole only inside its forward and backward, and in
    partitions across the ranks otherwise (DeepSpeed ZeRO-3: the module's parameters are empty
    placeholders). :func:`measure_shards` then gathers each layer whole through
    ``host.gathered``, and :func:`local_tensor` reads a rank's partition."""
    return getattr(host, "sharding", "none") == "zero3"


def replaces_parameters(host: Any) -> bool:
    """Whether the model's parameters are replaced after the callbacks' ``setup``: FSDP2's
    ``fully_shard`` puts a new, sharded parameter in place of every one it shards."""
    return getattr(host, "sharding", "none") == "fsdp2"


def model_root(host: Any, module: nn.Module) -> torch.nn.Module:
    """The outermost module of the model: under FSDP1 the root unit, which wraps the
    LightningModule from outside (units found inside ``module`` miss it)."""
    return host.root if sharded(host) else module


def loss_through_root(host: Any, module: nn.Module, fn: Callable[[Any], torch.Tensor],
                      batch: Any) -> torch.Tensor:
    """``fn(batch)`` (a loss computed with ``module``) run inside the forward of the strategy's
    root module where that wraps ``module``, ``batch`` passed through it, as Lightning runs
    ``training_step``: FSDP1's root unit gathers its own parameters in its forward, prepares the
    backward and casts the batch's floating tensors to its mixed precision's parameter dtype.
    Elsewhere ``fn(batch)``. Both under the precision plugin's forward context (autocast)."""
    root = model_root(host, module)
    if root is module:
        with host.forward_context():
            return fn(batch)
    had = module.__dict__.get("forward")  # an instance attribute (None: the class's forward)

    def put_back() -> None:
        if had is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = had

    def forward(cast: Any, *_args, **_kwargs):
        put_back()  # the loss inside calls the module's own forward
        return fn(cast)

    module.__dict__["forward"] = forward
    try:
        with host.forward_context():
            return root(batch)
    finally:
        put_back()


def backward_discarded(module: nn.Module, loss: torch.Tensor) -> None:
    """A backward whose gradients are only observed (hooks): the strategy reduces them as in a
    step (FSDP's reduce-scatter runs in its backward hooks), and the result is dropped."""
    loss.backward()
    for p in module.parameters():
        p.grad = None


def shard_layout(host: Any, module: nn.Module) -> ShardLayout:
    """How the strategy cuts the parameters, to cut masks and anchors the same way."""
    return ShardLayout(model_root(host, module))


def measure_shards(host: Any, module: nn.Module, units: list[list[Layer]],
                   fn: Callable[[list[Layer]], dict], sizes: Mapping[str, int] | None,
                   weight_of: Callable[[Layer], torch.Tensor]) -> dict:
    """``fn(layers) -> {name: value}`` over every unit of layers, the units shared out among the
    ranks (balanced by ``sizes``, the weights' sizes while they were whole; under FSDP each rank
    gathers the whole weights of its own share only, through ``weight_of``) and the results
    all-gathered: the same dict on every rank. An error on any rank is raised on all of them."""
    everything = [layer for unit in units for layer in unit]
    world = host.world_size
    if world == 1 and not sharded(host) and not partitioned(host):
        return fn(everything)
    sizes = sizes or {}
    owner = assign_shares([sum(sizes.get(la.name, 1) for la in unit) for unit in units], world)
    mine = {la.name for unit, o in zip(units, owner) if o == host.global_rank for la in unit}
    try:
        layers = _gathered_whole(host, everything, mine, weight_of) if partitioned(host) else \
            whole_weights(model_root(host, module), everything, mine, weight_of)
        part = ("ok", fn(layers) if layers else {})
    except Exception as err:  # noqa: BLE001 -- raised on every rank below
        part = ("error", err)
    merged: dict = {}
    for status, value in gather_objects(part):
        if status == "error":
            raise value
        merged.update(value)
    return {la.name: merged[la.name] for la in everything if la.name in merged}


class WholeCopy:
    """The LightningModule whole on rank zero, for the measurements that run the whole model
    through ``torch.func`` or run blocks alone (the NTK and the linearization gap, ``lambda_o``,
    the L-MSA metric) and for pruning that calibrates block by block and prunes as it goes (Wanda,
    SparseGPT, N:M during training). FSDP's own forward cannot host them: FSDP1 allows no forward
    inside ``summon_full_params``, and FSDP2's forward hooks fail on parameters ``torch.func``
    substitutes (torch 2.14).

    Made in ``setup``, before the strategy wraps the model, every rank keeps a skeleton of it
    (:func:`~lalr_lightning.core.runtime.shards.skeleton`: no memory for the weights). A measurement
    (:meth:`run`) gathers the whole state dict to rank zero's CPU (a collective: every rank calls
    it), fills a copy of the skeleton on the module's device, measures there and drops the copy,
    and broadcasts the result: rank zero holds the whole model for the length of a measurement,
    as ``summon_full_params`` would, and the other ranks wait."""

    def __init__(self, module: nn.Module, who: str):
        try:
            self.skeleton = skeleton(module)
        except Exception as err:  # noqa: BLE001 -- anything deepcopy refuses, said in one line
            raise RuntimeError(
                f"{who} under FSDP measures on a whole copy of {type(module).__name__}, made with copy.deepcopy "
                f"before the model is sharded, and copying it failed ({type(err).__name__}: {err}); keep objects that "
                "cannot be copied (open files, locks, clients) off the module, or use strategy='ddp'") from err

    @staticmethod
    def state(host: Any) -> dict[str, torch.Tensor]:
        """The whole state dict on rank zero's CPU, ``{}`` on the other ranks (collective)."""
        model = host.root
        if host.sharding == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # no "offload" from a CPU compute device (CPUFSDPStrategy): there it moves nothing, and
        # torch 2.13 cloned freed memory after it (SIGSEGV, strategies.py)
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=not on_cpu, rank0_only=True)):
            return model.state_dict()

    def run(self, host: Any, module: nn.Module, fn: Callable[[nn.Module], Any],
            frozen: bool = False) -> Any:
        """``fn(whole copy of module)`` computed on rank zero and broadcast: the same result on
        every rank; an error on rank zero is raised on every rank. ``frozen``: the copy's
        parameters do not require grad."""
        state = self.state(host)

        def on_zero() -> Any:
            whole = materialize(self.skeleton, state, module.device, frozen)
            state.clear()
            # every module in the mode the live one is in (a frozen block's norm layers in eval)
            modes = {clean_name(n): m.training for n, m in module.named_modules()}
            for name, part in whole.named_modules():
                part.training = modes.get(clean_name(name), part.training)
            return fn(whole)

        return on_rank_zero(host, on_zero)


def on_rank_zero(host: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank zero, broadcast: the same result on every rank. An error on rank zero is
    raised on every rank, so none waits for a broadcast that never comes."""
    result: tuple[str, Any] | None = None
    if host.is_global_zero:
        try:
            result = ("ok", fn())
        except Exception as err:  # noqa: BLE001 -- re-raised below, on every rank
            result = ("error", err)
    status, payload = host.broadcast(result, src=0)
    if status == "error":
        raise payload
    return payload


def decide_on_zero(host: Any, decide: Callable[[Any], Decision], measured: Any) -> Decision:
    """``decide(measured)`` on rank zero, broadcast (:func:`on_rank_zero`)."""
    return on_rank_zero(host, lambda: decide(measured))
