"""Layer-wise control where an engine steps flat partitions: DeepSpeed ZeRO-1/2/3.

Under ZeRO the torch optimizer never sees the model's parameters. Each of its groups holds one
flat fp32 tensor per rank -- this rank's partition of the group's parameters laid end to end --
and the engine copies the partition back into the model's (bit16) weights after the step. So the
owners' per-parameter wishes (freezing, multipliers, masks: keyed by the model's parameters, as
everywhere) are translated here into ranges of those flat tensors:

* :class:`FlatView` reads, once the engine is built, which range of which flat partition holds
  which elements of each parameter on this rank (from the engine's own tensors: the bit16
  weights are views into its flat buffers, so a data pointer gives the offset);
* :class:`FlatControl` is the :class:`~lalr_lightning.core.runtime.control.LayerControl` of such
  an optimizer: a flat partition all of whose pieces are frozen loses its gradient before the
  step (the optimizer skips it: no update, no weight decay, no state), a partly frozen or scaled
  one is stretched after the step, ``theta <- theta_old + m (theta_new - theta_old)`` per element
  (``m = 0`` where frozen: the rescaling path of ``control.py``, exact for the optimizers in
  ``LINEAR_IN_LR``), and keep-masks multiply the partition's gradient before and its weights
  after the step.

The engine's objects are read by attribute (no import of DeepSpeed here): stage 1/2's
``bit16_groups``, ``bit16_groups_flat``, ``single_partition_of_fp32_groups``; stage 3's
``fp16_groups``, ``fp16_partitioned_groups_flat``, ``fp32_partitioned_groups_flat`` and each
parameter's ``ds_tensor``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from lalr_lightning.core.runtime.control import FLAT_VIEW, LINEAR_IN_LR, LayerControl

__all__ = ["FlatControl", "FlatView", "Piece", "attach_flat_view"]


@dataclass(frozen=True)
class Piece:
    """Elements ``[src, src + stop - start)`` of ``param`` flattened, held at ``[start, stop)`` of
    the flat partition ``flat`` on this rank; ``weight`` is where the engine keeps this rank's
    working copy of the same elements (stage 1/2: the whole bit16 weight; stage 3: the bit16
    partition)."""

    param: nn.Parameter
    flat: torch.Tensor
    group: int
    start: int
    stop: int
    src: int


def _offset(view: torch.Tensor, base: torch.Tensor) -> int:
    off, rem = divmod(view.data_ptr() - base.data_ptr(), view.element_size())
    if rem or off < 0 or off + view.numel() > base.numel():
        raise RuntimeError("the engine's parameter is not a view into its flat buffer; this DeepSpeed version "
                           "lays out its partitions differently from the ones lalr_lightning reads")
    return off


class FlatView:
    """Which range of which flat partition holds what of each parameter, on this rank."""

    def __init__(self, pieces: list[Piece], stage: int, names: Mapping[int, str] | None = None):
        self.pieces = pieces
        self.stage = stage
        self.by_flat: dict[int, list[Piece]] = {}
        self.by_param: dict[int, list[Piece]] = {}
        self.flats: dict[int, torch.Tensor] = {}
        self.group_params: dict[int, list[nn.Parameter]] = {}
        for pc in pieces:
            self.by_flat.setdefault(id(pc.flat), []).append(pc)
            self.by_param.setdefault(id(pc.param), []).append(pc)
            self.flats[id(pc.flat)] = pc.flat
        self.params: dict[int, nn.Parameter] = {}

    @classmethod
    def of_zero(cls, zero_optimizer: object, rank: int) -> FlatView:
        """The view of a DeepSpeed ZeRO optimizer (``engine.optimizer``) on rank ``rank``."""
        pieces: list[Piece] = []
        params: dict[int, nn.Parameter] = {}
        groups: dict[int, list[nn.Parameter]] = {}
        if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # stage 3
            stage = 3
            sub_to_group = zero_optimizer.sub_group_to_group_id
            for sub, members in enumerate(zero_optimizer.fp16_groups):
                flat = zero_optimizer.fp32_partitioned_groups_flat[sub]
                base = zero_optimizer.fp16_partitioned_groups_flat[sub]
                g = int(sub_to_group[sub])
                for p in members:
                    part = p.ds_tensor
                    size = int(part.ds_numel) if hasattr(part, "ds_numel") else part.numel()
                    src = rank * size
                    held = max(0, min(size, int(p.ds_numel) - src))
                    params[id(p)] = p
                    groups.setdefault(g, []).append(p)
                    if held:
                        start = _offset(part, base)
                        pieces.append(Piece(p, flat, g, start, start + held, src))
        else:  # stage 1/2
            stage = 2
            for g, members in enumerate(zero_optimizer.bit16_groups):
                flat = zero_optimizer.single_partition_of_fp32_groups[g]
                base = zero_optimizer.bit16_groups_flat[g]
                lo, n = rank * flat.numel(), flat.numel()
                for p in members:
                    params[id(p)] = p
                    groups.setdefault(g, []).append(p)
                    off = _offset(p.data, base)
                    a, b = max(off, lo), min(off + p.numel(), lo + n)
                    if a < b:
                        pieces.append(Piece(p, flat, g, a - lo, b - lo, a - off))
        view = cls(pieces, stage)
        view.params = params
        view.group_params = groups
        return view

    def controller(self, optimizer: torch.optim.Optimizer) -> FlatControl:
        """The :class:`~lalr_lightning.core.runtime.control.LayerControl` of the optimizer this view
        is attached to (:meth:`LayerControl.of` asks the view, so control.py needs no import of this module)."""
        return FlatControl(optimizer, self)

    def slice_of(self, pc: Piece, whole: torch.Tensor) -> torch.Tensor:
        """The elements of ``whole`` (shaped as the parameter) that ``pc`` holds, flattened."""
        return whole.reshape(-1)[pc.src:pc.src + pc.stop - pc.start]


def attach_flat_view(optimizer: torch.optim.Optimizer, view: FlatView) -> None:
    """Give the engine's torch optimizer its view: :meth:`LayerControl.of` then controls it with
    a :class:`FlatControl` (an existing controller is replaced)."""
    old = LayerControl.existing(optimizer)
    if old is not None:
        old.remove()
    setattr(optimizer, FLAT_VIEW, view)


class FlatControl(LayerControl):
    """:class:`LayerControl` of an optimizer stepping flat partitions (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, view: FlatView):
        self.view = view
        super().__init__(optimizer)
        self._before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self._flat_cache: tuple[int, dict[int, tuple[bool, torch.Tensor | None, torch.Tensor | None]]] | None = None

    # ---------------------------------------------------------------- the model's parameters

    def _groups(self) -> list[dict]:
        opt = self.optimizer
        return [{"params": self.view.group_params.get(g, []), "lr": grp["lr"]} for g, grp in enumerate(opt.param_groups)]

    # ---------------------------------------------------------------- the plan per flat partition

    def _flat_plan(self) -> dict[int, tuple[bool, torch.Tensor | None, torch.Tensor | None]]:
        """id(flat) -> (all frozen, the lerp weights ``1 - m`` per element or None where every
        ``m`` is 1, the keep-mask per element or None); once per change of the owners."""
        if self._flat_cache is not None and self._flat_cache[0] == self._version:
            return self._flat_cache[1]
        plan = {}
        for fid, pieces in self.view.by_flat.items():
            flat = self.view.flats[fid]
            mults = [0.0 if self.is_frozen(pc.param) else self.multiplier(pc.param) for pc in pieces]
            frozen = all(m == 0.0 and self.is_frozen(pc.param) for m, pc in zip(mults, pieces))
            weights = None
            if not frozen and any(m != 1.0 for m in mults):
                weights = torch.zeros(flat.numel(), dtype=flat.dtype, device=flat.device)
                for m, pc in zip(mults, pieces):
                    weights[pc.start:pc.stop] = 1.0 - m
            keep = None
            masks = [(pc, self.mask(pc.param)) for pc in pieces]
            if any(k is not None for _, k in masks):
                keep = torch.ones(flat.numel(), dtype=flat.dtype, device=flat.device)
                for pc, k in masks:
                    if k is not None:
                        keep[pc.start:pc.stop] = self.view.slice_of(pc, k).to(flat.device, flat.dtype)
            plan[fid] = (frozen, weights, keep)
        self._flat_cache = (self._version, plan)
        return plan

    def _stepping(self, optimizer) -> list[torch.Tensor]:
        # stage 3 steps one sub-group at a time, with only that group's partition in param_groups
        return [p for g in optimizer.param_groups for p in g["params"] if id(p) in self.view.flats]

    def _engage(self, optimizer) -> None:
        if self._before is not None:
            return
        plan = self._flat_plan()
        before = []
        for flat in self._stepping(optimizer):
            frozen, weights, keep = plan[id(flat)]
            if frozen:
                flat.grad = None
                continue
            if keep is not None and flat.grad is not None:
                flat.grad.mul_(keep)
            if weights is not None:
                if type(optimizer) not in LINEAR_IN_LR:
                    raise RuntimeError(f"layer-wise learning rates under DeepSpeed ZeRO stretch each update, exact "
                                       f"only for {', '.join(sorted(c.__name__ for c in LINEAR_IN_LR))}; the engine "
                                       f"steps {type(optimizer).__name__}: use torch's AdamW (optim='adamw_torch')")
                before.append((flat, flat.detach().clone(), weights))
        self._before = before

    def _after_step(self, optimizer, args, kwargs):
        if self._suspended:
            return
        try:
            plan = self._flat_plan()
            with torch.no_grad():
                for flat, old, weights in self._before or ():
                    flat.lerp_(old, weights)  # lerp(new, old, 1 - m) = old + m (new - old)
                for flat in self._stepping(optimizer):
                    keep = plan[id(flat)][2]
                    if keep is not None:
                        flat.mul_(keep)
            if self._transforms:
                raise RuntimeError("a post-step transform (ProximalRegularizer, L-MSA) works on whole parameters, "
                                   "which DeepSpeed ZeRO holds only in flat partitions; run it on one device, DDP or FSDP2")
        finally:
            self._before = None

    def abandon_step(self) -> None:
        self._before = None

    def mask_gradients(self) -> None:
        """Nothing here: the engine's gradients reach the partitions inside its step, where
        :meth:`_engage` masks them."""

    def gradients_changed(self) -> None:
        pass

    @torch.no_grad()
    def apply_masks(self) -> None:
        plan = self._flat_plan()
        for fid, (_, _, keep) in plan.items():
            if keep is not None:
                self.view.flats[fid].mul_(keep)
        self._mask_working_copies()

    @torch.no_grad()
    def _mask_working_copies(self) -> None:
        """The engine's bit16 weights: stage 1/2 hold each weight whole, stage 3 this rank's
        partition (``ds_tensor``)."""
        for pid, p in self.view.params.items():
            keep = self.mask(p)
            if keep is None:
                continue
            if self.view.stage == 3:
                for pc in self.view.by_param.get(pid, ()):
                    part = p.ds_tensor.reshape(-1)[:pc.stop - pc.start]
                    part.mul_(self.view.slice_of(pc, keep).to(part.dtype))
            elif p.numel() == keep.numel():
                p.data.mul_(keep.to(p.dtype))

    @torch.no_grad()
    def weights_written(self, params: Iterable[nn.Parameter]) -> None:
        """The engine's fp32 partitions take the values just written into ``params``' working
        copies (SparseGPT's updated weights): the engine copies its partitions back into the model
        after every step, so else the next step would start from the old weights again."""
        for p in params:
            for pc in self.view.by_param.get(id(p), ()):
                src = p.ds_tensor.reshape(-1)[:pc.stop - pc.start] if self.view.stage == 3 \
                    else self.view.slice_of(pc, p.data)
                pc.flat[pc.start:pc.stop].copy_(src.to(pc.flat.dtype))

    @torch.no_grad()
    def set_masks(self, owner, masks, names=None, *, zero_state: bool = True) -> None:
        table: dict[int, torch.Tensor] = {}
        for p, keep in masks.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if tuple(keep.shape) != shape:
                name = (names or {}).get(p, "?")
                raise ValueError(f"{owner}: the mask of {name!r} has shape {tuple(keep.shape)}, the parameter {shape}")
            table[id(p)] = keep.to(dtype=torch.bool)
            self._adopt(p, names)
        self._masks[owner] = table
        self._version += 1
        self.apply_masks()
        if zero_state:
            plan = self._flat_plan()
            for fid, (_, _, keep) in plan.items():
                flat = self.view.flats[fid]
                for v in (self.optimizer.state.get(flat) or {}).values():
                    if keep is not None and isinstance(v, torch.Tensor) and v.shape == flat.shape:
                        v.mul_(keep)

    def mask(self, p: nn.Parameter) -> torch.Tensor | None:
        # the masks live on the partitions, where set_masks put them: nothing to move here
        return self._combined_mask(p)

    def release_state(self, params: Iterable[nn.Parameter]) -> int:
        """A flat partition every piece of which is frozen loses its state (the memory is freed);
        in one partly frozen, the frozen pieces' moments are zeroed (the step count is the
        partition's)."""
        ids = {id(p) for p in params if self.is_frozen(p)}
        state = self.optimizer.state
        freed = 0
        for fid, pieces in self.view.by_flat.items():
            flat = self.view.flats[fid]
            if flat not in state or not any(id(pc.param) in ids for pc in pieces):
                continue
            if all(id(pc.param) in ids or self.is_frozen(pc.param) for pc in pieces):
                freed += sum(v.numel() for v in state[flat].values() if isinstance(v, torch.Tensor))
                del state[flat]
                continue
            moments = [v for v in state[flat].values() if isinstance(v, torch.Tensor) and v.shape == flat.shape]
            for pc in pieces:
                if id(pc.param) in ids:
                    for v in moments:
                        v[pc.start:pc.stop].zero_()
                    freed += len(moments) * (pc.stop - pc.start)
        return freed
