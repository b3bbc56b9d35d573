"""The one owner of every change to parameters and optimizers: per-layer learning-rate
multipliers, freezing, pruning masks and post-step parameter transforms, composed across owners.

One :class:`LayerControl` per torch optimizer. Callbacks (the *owners*, named by a string) each
state what they want per parameter; the controller combines them:

* **multipliers** -- the effective multiplier of a parameter is the product over owners;
* **freezing** -- a parameter is frozen when any owner freezes it: its gradient is dropped right
  before the update, so the optimizer skips it (no update, no weight decay, no momentum). That
  works under DDP, where toggling ``requires_grad`` after wrapping would desynchronize ranks
  (Lightning #20340);
* **masks** -- keep-masks (pruning): the weights are zeroed when a mask is set, the masked
  gradient entries are zeroed before the step (:meth:`mask_gradients`, so clipping and the
  optimizer's moments never see them) and the weights are re-masked after every step, after
  every transform;
* **post-step transforms** -- ``fn(step)`` run after each optimizer step in ``order``, with the
  learning rate each parameter's update actually used (:class:`PostStep`): the proximal pull
  toward the pretrained weights, L-MSA's block update;
* **requires_grad** -- :meth:`set_requires_grad` turns gradients off per owner (the
  compute-saving freeze: in ``setup`` before the model is wrapped, on one device, or under DDP
  with ``find_unused_parameters=True`` for parameters registered while they required grad) and
  gives back the user's flags when the owner is cleared;
* **optimizer state** -- :meth:`release_state` deletes the per-parameter state (Adam's moments,
  momentum buffers, step counts) of frozen parameters, so a selection that switches holds state
  only for what trains now; a released parameter starts afresh when it trains again, as under a
  restarted optimizer.

How the multipliers reach the update -- two ways to the same update, chosen per step:

* **rescaling** (the fast path): the optimizer steps with the user's groups, and each scaled
  parameter's update is then stretched by its multiplier, ``theta <- theta_old + m (theta_new -
  theta_old)`` (one ``torch._foreach_copy_`` before the step, one ``torch._foreach_lerp_`` after,
  per device and dtype). That is the update at ``lr x m`` whenever the update is linear in the
  LR and the optimizer's state does not depend on it -- true of torch's SGD, Adam, AdamW,
  Adamax, NAdam, RAdam, RMSprop, Adadelta and Adagrad without ``lr_decay`` (:data:`LINEAR_IN_LR`),
  weight decay included -- up to rounding: the stretch scales the step's own rounding by ``m``
  too (about ``(m + 1) / 2`` ulps of the weight instead of half of one), so it is used for
  multipliers up to :data:`RESCALE_MAX_MULTIPLIER`. So the
  optimizer steps once per group whatever the number of layers: one group per layer costs a
  Python pass per group in every torch optimizer (1.26x a 50-matrix model's step on a CPU).
  It holds a copy of the scaled parameters; it is used when the optimizer is one of
  those, the scaled parameters are float32 or float64 plain tensors (a low-precision weight
  rounds its update before the stretch), the copy stays under :data:`RESCALE_MAX_BYTES`, and on
  a CPU the split would add enough groups to cost more (:data:`SPLIT_GROUP_TENSORS`).
* **a transient split** (otherwise; docs/design.md, "Control"): a step pre-hook replaces the
  optimizer's ``param_groups`` by per-multiplier sub-groups whose ``lr`` is ``scheduled lr x
  multiplier``, and a step post-hook puts the original groups back.

Either way every LR scheduler (Lambda, Step, Cosine, OneCycle, Plateau, Sequential, timm) keeps
seeing and stepping the groups it was built with, ``LearningRateMonitor`` logs the scheduled LR,
checkpoints hold the user's groups, and nothing needs to be re-wired on resume. Per-parameter
optimizer state is keyed by parameter, so Adam's moments do not care about the split.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat

import torch
from torch import nn

from lalr_lightning.core.runtime.placement import follow

_DTYPE = operator.attrgetter("dtype")

__all__ = ["FLAT_VIEW", "LINEAR_IN_LR", "RESCALE_MAX_BYTES", "RESCALE_MAX_MULTIPLIER", "SPLIT_GROUP_TENSORS",
           "LayerControl", "PostStep", "set_requires_grad"]

#: the attribute of a torch optimizer that carries its engine's flat partitions
#: (:class:`~lalr_lightning.core.runtime.flat.FlatView`, whose ``controller`` is its LayerControl)
FLAT_VIEW = "_lalr_flat_view"

#: torch optimizers whose update is ``lr x`` something the LR does not change (their state
#: included), so an update at ``lr x m`` is ``m`` times the update at ``lr``; by exact type (a
#: subclass may step differently). Adagrad only without ``lr_decay`` (checked per group)
LINEAR_IN_LR = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta,
                          torch.optim.Adagrad})
#: on a CPU, one more group in the optimizer costs about as much as stretching this many tensors
#: (``benchmarks/step_overhead.py``: AdamW, 23 us per group against 3.3 us per tensor); the split is
#: used there when it adds fewer groups than the tensors to stretch / this. On an accelerator a
#: group costs a dozen kernel launches and the stretch two per device and dtype: always the stretch
SPLIT_GROUP_TENSORS = 7
#: the largest copy of the scaled parameters the rescaling path keeps; above it the groups are split
#: (on a model that large a step outweighs the optimizer's pass per group)
RESCALE_MAX_BYTES = 1 << 30
#: the largest multiplier the rescaling path stretches by: it stretches the rounding of the step
#: as well, to about ``(m + 1) / 2`` ulps of the weight (a head at 100x a fine-tuning LR of 1e-5 was
#: off by 5e-4 of its update after 20 AdamW steps); above it the split steps at ``lr x m`` exactly.
#: TempBalance's and LALR's multipliers stay well below it
RESCALE_MAX_MULTIPLIER = 8.0

_ATTR = "_lalr_layer_control"

# id(parameter) -> (weak reference, the user's requires_grad, owners that turned it off); global
# because requires_grad belongs to the parameter, not to an optimizer (and setup runs before any)
_GRAD_OFF: dict[int, tuple[weakref.ref, bool, set[str]]] = {}


#: one device and dtype of the rescaling path: the scaled parameters, their copies taken right
#: before the step, and ``1 - multiplier`` of each
_Rescale = tuple[list[nn.Parameter], list[torch.Tensor], list[float]]


@dataclass
class PostStep:
    """What a post-step transform is told about the optimizer step just taken."""

    optimizer: torch.optim.Optimizer
    control: LayerControl
    _lrs: dict[int, float]

    def lr(self, p: nn.Parameter) -> float:
        """The learning rate ``p``'s update used: scheduled LR x every owner's multiplier (0 when
        frozen or not in this optimizer)."""
        return self._lrs.get(id(p), 0.0)

    def stepped(self, p: nn.Parameter) -> bool:
        """Whether this step updated ``p`` (in this optimizer, not frozen)."""
        return id(p) in self._lrs

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters this step updated (in this optimizer, not frozen)."""
        held = {id(p): p for p in self.control.params}
        return [held[i] for i in self._lrs]


class LayerControl:
    """Multipliers, freezing, masks and post-step transforms for one optimizer. Get it with
    :meth:`LayerControl.of`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        # LBFGS works on exactly one parameter group; a split would break it
        self._single_group_only = type(optimizer).__name__ == "LBFGS"
        self._opt_ref = weakref.ref(optimizer)
        self._mults: dict[str, dict[int, float]] = {}
        self._frozen: dict[str, set[int]] = {}
        self._masks: dict[str, dict[int, torch.Tensor]] = {}
        self._transforms: dict[str, tuple[float, int, Callable[[PostStep], None]]] = {}
        self._names: dict[int, str] = {}
        self._params: dict[int, nn.Parameter] = {}
        self._saved_groups: list[dict] | None = None
        self._split_runs: list[tuple[int, list[nn.Parameter], float]] = []
        self._split_cache: tuple[tuple, list[tuple[int, list[nn.Parameter], float]]] | None = None
        # the rescaling path: per device and dtype (params, their copies before the step, 1 - m)
        self._rescale_cache: tuple[tuple, list[_Rescale] | None] | None = None
        self._rescaling: list[_Rescale] | None = None  # the plan of the step under way
        # per version (bumped by every owner's change): the frozen ids, whether any multiplier is
        # not 1, the masks grouped for the foreach ops, the step's LRs -- nothing rebuilt per step
        self._plan: tuple[tuple, frozenset[int], bool] | None = None
        self._frozen_params: list[nn.Parameter] = []
        self._mask_groups: tuple[int, list[tuple[list[nn.Parameter], list[torch.Tensor]]]] | None = None
        self._lrs_cache: tuple[tuple, dict[int, float]] | None = None
        self._version = 0
        self._grads_masked = False
        self._reported_step: int | None = None
        self._transform_seq = 0
        self._suspended = False  # a step that is not training (grad_flags_of): nothing engages
        self._pre = optimizer.register_step_pre_hook(self._before_step)
        self._post = optimizer.register_step_post_hook(self._after_step)
        _guard_step(optimizer)

    # ------------------------------------------------------------------ construction

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> LayerControl:
        """The optimizer's controller, created (and its hooks installed) on first use.

        Lightning wraps optimizers in ``LightningOptimizer``; the wrapped torch optimizer is
        the one that owns the hooks. A wrapper sharing its inner optimizer's ``param_groups``
        (timm's ``Lookahead``, which skips ``Optimizer.__init__`` and so never runs step hooks)
        is controlled through the inner one, whose step it calls.
        """
        optimizer = _unwrap(optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"layer-wise control needs a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "an engine that owns the parameter groups is controlled through its torch optimizer (the Hugging "
                "Face Trainer's DeepSpeed: lalr_lightning.hf.trainer_callback)"
            )
        if not getattr(type(optimizer).step, "hooked", False):
            raise TypeError(
                f"{type(optimizer).__name__}.step does not run torch's optimizer step hooks (its constructor "
                "skips Optimizer.__init__), so layer-wise learning rates, freezing and masks cannot reach its "
                "updates; call super().__init__(params, defaults) in it"
            )
        ctl = getattr(optimizer, _ATTR, None)
        if ctl is None:
            view = getattr(optimizer, FLAT_VIEW, None)  # an engine's flat partitions (core/runtime/flat.py)
            ctl = cls(optimizer) if view is None else view.controller(optimizer)
            setattr(optimizer, _ATTR, ctl)
        return ctl

    @classmethod
    def existing(cls, optimizer: torch.optim.Optimizer) -> LayerControl | None:
        """The optimizer's controller if one was created, else None (creates nothing)."""
        return getattr(_unwrap(optimizer), _ATTR, None)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        opt = self._opt_ref()
        if opt is None:
            raise RuntimeError("the optimizer of this LayerControl no longer exists")
        return opt

    def _groups(self) -> list[dict]:
        return self._saved_groups or self.optimizer.param_groups

    def _owned(self) -> set[int]:
        return {id(p) for g in self._groups() for p in g["params"]}

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters of this optimizer, in its groups' order."""
        return [p for g in self._groups() for p in g["params"]]

    def remove(self) -> None:
        """Detach from the optimizer (hooks removed, groups restored)."""
        self._restore()
        self._pre.remove()
        self._post.remove()
        opt = self._opt_ref()
        if opt is not None and getattr(opt, _ATTR, None) is self:
            delattr(opt, _ATTR)

    # ------------------------------------------------------------------ owners' API

    def _adopt(self, p: nn.Parameter, names: Mapping[nn.Parameter, str] | None) -> None:
        self._params[id(p)] = p
        if names is not None and p in names:
            self._names[id(p)] = names[p]

    def set_multipliers(
        self,
        owner: str,
        multipliers: Mapping[nn.Parameter, float],
        names: Mapping[nn.Parameter, str] | None = None,
    ) -> None:
        """Replace ``owner``'s multipliers. Parameters this optimizer does not hold yet are kept
        for when ``add_param_group`` brings them (a model with several optimizers gets one
        controller each; each steps only its own)."""
        table: dict[int, float] = {}
        for p, m in multipliers.items():
            m = float(m)
            if not math.isfinite(m) or m < 0:
                name = (names or {}).get(p, self._names.get(id(p), "?"))
                raise ValueError(f"{owner}: learning-rate multiplier for {name!r} is {m}; it must be finite and >= 0")
            table[id(p)] = m
            self._adopt(p, names)
        self._mults[owner] = table
        self._version += 1

    def name_params(self, names: Mapping[nn.Parameter, str]) -> None:
        """Report these parameters' effective LRs under these (layer) names."""
        for p in names:
            self._adopt(p, names)

    def set_frozen(self, owner: str, params: Iterable[nn.Parameter], names: Mapping[nn.Parameter, str] | None = None) -> None:
        """Replace the set of parameters ``owner`` keeps frozen (one this optimizer does not hold
        yet stays frozen when it joins)."""
        ids = set()
        for p in params:
            ids.add(id(p))
            self._adopt(p, names)
        self._frozen[owner] = ids
        self._version += 1

    @torch.no_grad()
    def set_masks(
        self,
        owner: str,
        masks: Mapping[nn.Parameter, torch.Tensor],
        names: Mapping[nn.Parameter, str] | None = None,
        *,
        zero_state: bool = True,
    ) -> None:
        """Replace ``owner``'s keep-masks (True = kept) and enforce them at once.

        The masked weights are zeroed now and after every later step; with ``zero_state`` the
        optimizer's per-parameter state (momentum buffers, Adam moments) is zeroed at the masked
        entries too, so a weight pruned mid-training gets no update from old momentum. A weight
        no optimizer holds (a frozen backbone left out of it) is pruned and kept pruned too.
        """
        table: dict[int, torch.Tensor] = {}
        for p, keep in masks.items():
            if tuple(keep.shape) != tuple(p.shape):
                name = (names or {}).get(p, "?")
                raise ValueError(f"{owner}: the mask of {name!r} has shape {tuple(keep.shape)}, the "
                                 f"parameter {tuple(p.shape)}")
            table[id(p)] = keep.to(device=p.device, dtype=torch.bool)
            self._adopt(p, names)
        self._masks[owner] = table
        self._version += 1
        state = self.optimizer.state
        for pid, keep in table.items():
            p = self._params[pid]
            p.masked_fill_(~keep, 0)
            if zero_state:
                for v in (state.get(p) or {}).values():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        v.masked_fill_(~keep, 0)

    def weights_written(self, params: Iterable[nn.Parameter]) -> None:
        """``params``' values were written outside the optimizer (SparseGPT's update of the kept
        weights): an engine that steps master copies of them takes the new values
        (:class:`~lalr_lightning.core.runtime.flat.FlatControl`); here the optimizer steps the
        parameters themselves, so there is nothing to do."""

    def set_transform(self, owner: str, fn: Callable[[PostStep], None] | None, *, order: float = 0.0) -> None:
        """Run ``fn(step)`` after every optimizer step (one transform per owner; ``None`` removes
        it). Transforms run by ascending ``order`` (then in the order they were set); masks are
        re-applied after all of them, so a pruned weight stays zero whatever moves it."""
        if fn is None:
            self._transforms.pop(owner, None)
            return
        self._transform_seq += 1
        self._transforms[owner] = (float(order), self._transform_seq, fn)

    def clear(self, owner: str) -> None:
        """Forget everything ``owner`` set here, and give back the ``requires_grad`` flags it
        turned off."""
        self._mults.pop(owner, None)
        self._frozen.pop(owner, None)
        self._masks.pop(owner, None)
        self._transforms.pop(owner, None)
        self._version += 1
        LayerControl.restore_requires_grad(owner)

    def release_state(self, params: Iterable[nn.Parameter]) -> int:
        """Delete this optimizer's per-parameter state of those ``params`` that are frozen now
        (a parameter some owner still trains keeps its state). Returns the number of state
        elements freed (tensor entries: Adam holds two per weight plus a step count)."""
        owned = self._owned()
        state = self.optimizer.state
        freed = 0
        for p in params:
            if id(p) in owned and p in state and self.is_frozen(p):
                freed += sum(v.numel() for v in state[p].values() if isinstance(v, torch.Tensor))
                del state[p]
        return freed

    @staticmethod
    def set_requires_grad(owner: str, params: Iterable[nn.Parameter], flag: bool) -> None:
        """``flag=False``: ``owner`` turns ``requires_grad`` off (saves the backward compute of
        frozen layers); ``flag=True``: it withdraws that, and the parameter gets its user's flag
        back once no owner keeps it off (a parameter the user froze stays frozen).

        Safe before the model is wrapped (callback ``setup``), on a single device, and under DDP
        with ``find_unused_parameters=True`` for parameters that required grad when DDP wrapped
        the model (DDP registers only those; a parameter off at wrap time is never all-reduced).
        Otherwise freeze with :meth:`set_frozen`. Works before any optimizer exists.
        """
        for p in params:
            rec = _GRAD_OFF.get(id(p))
            if rec is not None and rec[0]() is not p:  # a dead parameter's id reused
                rec = None
            if rec is None:
                if flag:
                    continue
                rec = (weakref.ref(p), p.requires_grad, set())
            (rec[2].discard if flag else rec[2].add)(owner)
            p.requires_grad_(rec[1] and not rec[2])
            # recorded once the flag changed: a parameter that refused it (a lazy one) leaves no stale record
            if rec[2]:
                _GRAD_OFF[id(p)] = rec
            else:
                _GRAD_OFF.pop(id(p), None)

    @staticmethod
    def grad_off_by(owner: str) -> list[nn.Parameter]:
        """The parameters whose ``requires_grad`` ``owner`` keeps off."""
        out = [rec[0]() for rec in list(_GRAD_OFF.values()) if owner in rec[2]]
        return [p for p in out if p is not None]

    @staticmethod
    def restore_requires_grad(owner: str) -> None:
        """Withdraw every ``requires_grad=False`` that ``owner`` set."""
        LayerControl.set_requires_grad(owner, LayerControl.grad_off_by(owner), True)

    @staticmethod
    @contextmanager
    def grad_flags_of(optimizers: Iterable[torch.optim.Optimizer], on: Callable[[nn.Parameter], bool],
                      made_up: Callable[[nn.Parameter], bool] | None = None) -> Iterator[None]:
        """Within: of the parameters ``optimizers`` hold, exactly those where ``on(p)`` require
        grad, and the optimizers' steps run bare (no owner's freezing, multipliers, masks or
        transforms); every flag is put back after, whatever the owners set. For torch's
        optimizer-state loaders, which take their template from the flags at the moment they load
        and build it with a zero-learning-rate step. ``made_up(p)``: ``p``'s state after a load
        came from that step, not from the checkpoint: dropped (a fresh parameter has none)."""
        optimizers = list(optimizers)
        flags = {p: p.requires_grad for opt in optimizers for g in opt.param_groups for p in g["params"]}
        controls = [c for c in map(LayerControl.existing, optimizers) if c is not None]
        try:
            for c in controls:
                c._suspended = True
            for p in flags:
                p.requires_grad_(on(p))
            yield
            if made_up is not None:
                for opt in optimizers:
                    for p in [p for p in opt.state if made_up(p)]:
                        del opt.state[p]
        finally:
            for c in controls:
                c._suspended = False
            for p, flag in flags.items():
                p.requires_grad_(flag)

    # ------------------------------------------------------------------ queries

    def multiplier(self, p: nn.Parameter) -> float:
        """Product of every owner's multiplier for ``p`` (1 when nobody set one)."""
        m = 1.0
        for table in self._mults.values():
            m *= table.get(id(p), 1.0)
        return m

    def is_frozen(self, p: nn.Parameter) -> bool:
        return any(id(p) in s for s in self._frozen.values())

    def mask(self, p: nn.Parameter) -> torch.Tensor | None:
        """The combined keep-mask of ``p`` (None when no owner masks it), on ``p``'s device."""
        self._place_masks()
        return self._combined_mask(p)

    def _combined_mask(self, p: nn.Parameter) -> torch.Tensor | None:
        """Every owner's keep-mask of ``p``, and-ed where they are (None when no owner masks it)."""
        out = None
        for table in self._masks.values():
            keep = table.get(id(p))
            if keep is not None:
                out = keep if out is None else out & keep
        return out

    def scheduled_lr(self, p: nn.Parameter) -> float | None:
        """The LR the scheduler set for ``p``'s group right now (None if not in this optimizer)."""
        for g in self._groups():
            if any(q is p for q in g["params"]):
                return float(g["lr"])
        return None

    def scheduled_lrs(self) -> list[float]:
        """The LR the scheduler set for each of the optimizer's own groups."""
        return [float(g["lr"]) for g in self._groups()]

    def effective_lr(self, p: nn.Parameter) -> float | None:
        lr = self.scheduled_lr(p)
        if lr is None:
            return None
        return 0.0 if self.is_frozen(p) else lr * self.multiplier(p)

    def effective_lrs(self) -> dict[str, float]:
        """``{layer name: scheduled lr x multiplier}`` for every named parameter under control
        (a layer's first registered parameter -- its weight -- speaks for it)."""
        out: dict[str, float] = {}
        group_lr = {id(p): float(g["lr"]) for g in self._groups() for p in g["params"]}
        for pid, name in self._names.items():
            if name in out or pid not in group_lr:
                continue
            p = self._params[pid]
            out[name] = 0.0 if self.is_frozen(p) else group_lr[pid] * self.multiplier(p)
        return out

    def take_report(self, step: int) -> bool:
        """True the first time it is asked for ``step``: several owners sharing this optimizer
        report its effective LRs once per logging step."""
        if self._reported_step == step:
            return False
        self._reported_step = step
        return True

    # ------------------------------------------------------------------ around the step

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Zero the gradients of masked entries (once per step). Call it where gradients are
        final but not yet clipped (Lightning: ``on_before_optimizer_step``); the step does it
        anyway if nobody did. One ``torch._foreach_mul_`` by the keep-masks per device and dtype
        (a kept entry is multiplied by 1, exactly itself; a masked one becomes 0; the masks in
        the weights' dtype)."""
        if self._grads_masked or not self._masks:
            return
        for params, keeps in self._grouped_masks():
            pairs = [(p.grad, k) for p, k in zip(params, keeps) if p.grad is not None]
            if pairs:
                grads, ks = zip(*pairs)
                torch._foreach_mul_(list(grads), list(ks))
        self._grads_masked = True

    def gradients_changed(self) -> None:
        """A backward ran: the next :meth:`mask_gradients` masks again. The step clears its
        once-per-step mark too, but a step the mixed-precision scaler skips (an overflow) never
        comes, and the next step's gradients would reach clipping and the optimizer unmasked."""
        self._grads_masked = False

    @torch.no_grad()
    def apply_masks(self) -> None:
        """Zero every masked weight now (one ``torch._foreach_mul_`` per device and dtype)."""
        for params, keeps in self._grouped_masks():
            torch._foreach_mul_(params, keeps)

    def _grouped_masks(self) -> list[tuple[list[nn.Parameter], list[torch.Tensor]]]:
        """``[(params, combined keep-masks in the params' dtype)]`` per (device, dtype), built once per
        change of the masks; rebuilt when the model moved or was cast (Lightning moves it after the
        masks were made)."""
        cached = self._mask_groups
        if cached is not None and cached[0] == self._version and all(
                (ps[0].device, ps[0].dtype) == (ks[0].device, ks[0].dtype) for ps, ks in cached[1]):
            return cached[1]
        self._place_masks()
        combined: dict[int, torch.Tensor] = {}
        for table in self._masks.values():
            for pid, keep in table.items():
                combined[pid] = keep if pid not in combined else combined[pid] & keep
        groups: dict[tuple, tuple[list[nn.Parameter], list[torch.Tensor]]] = {}
        for pid, keep in combined.items():
            p = self._params[pid]
            ps, ks = groups.setdefault((p.device, p.dtype), ([], []))
            ps.append(p)
            # in the weight's dtype: a multiply by a bool tensor casts on every call (5x slower
            # on a CPU, and the slow per-tensor path on a GPU); a copy of the weight's size, as
            # torch.nn.utils.prune keeps
            ks.append(keep.to(p.dtype))
        out = list(groups.values())
        self._mask_groups = (self._version, out)
        return out

    def _place_masks(self) -> None:
        # Lightning moves the model after the masks were made (to the GPU in setup, back to the
        # CPU at teardown, before on_fit_end): each mask follows its parameter, once per move
        for table in self._masks.values():
            follow(table, self._params, dtype=False)

    # ------------------------------------------------------------------ the split

    def _partition(self, groups: list[dict]) -> list[tuple[int, list[nn.Parameter], float]]:
        """(group index, params, multiplier) runs, params in their original order. Cached until
        an owner changes something."""
        key = (self._version, _layout(groups))
        if self._split_cache is not None and self._split_cache[0] == key:
            return self._split_cache[1]
        runs: list[tuple[int, list[nn.Parameter], float]] = []
        for gi, g in enumerate(groups):
            by_mult: dict[float, list[nn.Parameter]] = {}
            for p in g["params"]:
                by_mult.setdefault(self.multiplier(p), []).append(p)
            for m, ps in by_mult.items():
                runs.append((gi, ps, m))
        self._split_cache = (key, runs)
        return runs

    def _before_step(self, optimizer, args, kwargs):
        if self._suspended:
            return None
        self.abandon_step()  # the last step raised after it engaged, and the caller went on
        # With a closure (Lightning's automatic optimization), the gradients only exist once
        # the optimizer has called it, and the user's training_step / on_before_optimizer_step
        # run inside it: engage after the closure, so they all see the user's groups.
        if "closure" in kwargs and kwargs["closure"] is not None:
            kwargs = {**kwargs, "closure": self._wrap(optimizer, kwargs["closure"])}
            return args, kwargs
        if args and callable(args[0]):
            return (self._wrap(optimizer, args[0]), *args[1:]), kwargs
        self._engage(optimizer)
        return None

    def abandon_step(self) -> None:
        """Put the user's groups back and drop the copies of a step that raised after it engaged
        (its post-hook never ran): else a scheduler stepped before the next step would schedule the
        split groups (its change then lost), the next step would stretch from stale copies, and a
        checkpoint taken meanwhile would hold the split groups. Run by the step guard as the error
        leaves ``step`` (:func:`_guard_step`), and again before the next step. Nothing when no step
        was left half done."""
        if self._saved_groups is None and self._rescaling is None:
            return
        self._grads_masked = False
        self._rescaling = None
        self._restore()

    def _wrap(self, optimizer, closure):
        def closure_then_engage():
            out = closure()
            self._engage(optimizer)
            return out

        return closure_then_engage

    def _engage(self, optimizer) -> None:
        """Drop frozen gradients, mask gradients, and copy the scaled parameters (rescaling) or
        split the groups by multiplier (idempotent within a step)."""
        if self._saved_groups is not None or self._rescaling is not None:
            return
        _, frozen, scaled = self._step_plan()
        if frozen:
            for p in self._frozen_params:
                p.grad = None
        self.mask_gradients()
        if not scaled:
            return
        plan = self._rescale_plan(optimizer)
        if plan is not None:
            with torch.no_grad():
                for params, before, _ in plan:
                    torch._foreach_copy_(before, params)
            self._rescaling = plan
            return
        groups = optimizer.param_groups
        runs = self._partition(groups)
        if len(runs) == len(groups) and all(m == 1.0 for _, _, m in runs):
            return
        if self._single_group_only and len(runs) > 1:
            raise RuntimeError(
                "LBFGS keeps a single parameter group, so layer-wise learning rates cannot be applied; "
                "use another optimizer (SGD, Adam, AdamW, ...)"
            )
        split = []
        for gi, ps, m in runs:
            g = groups[gi]
            sub = dict(g)  # the group's settings as the scheduler left them (a C-level copy)
            sub["params"] = ps
            sub["lr"] = g["lr"] * m
            split.append(sub)
        self._saved_groups = groups
        self._split_runs = runs
        optimizer.param_groups = split

    def _rescale_plan(self, optimizer) -> list[_Rescale] | None:
        """The rescaling path's plan (module docstring), or None where the split must be used;
        once per change of the owners, and again when the model moved."""
        key = (self._version, _layout(optimizer.param_groups))
        cached = self._rescale_cache
        if cached is not None and cached[0] == key and all(_placed_as(ps, cs[0]) for ps, cs, _ in cached[1] or ()):
            return cached[1]
        plan = self._build_rescale(optimizer)
        self._rescale_cache = (key, plan)
        return plan

    def _build_rescale(self, optimizer) -> list[_Rescale] | None:
        if type(optimizer) not in LINEAR_IN_LR or any(
                g.get("lr_decay") or g.get("differentiable") for g in optimizer.param_groups):
            return None
        _, frozen, _ = self._step_plan()
        by_place: dict[tuple, tuple[list[nn.Parameter], list[float]]] = {}
        size = 0
        for g in optimizer.param_groups:
            for p in g["params"]:
                m = self.multiplier(p)
                if m == 1.0 or id(p) in frozen:
                    continue
                if m > RESCALE_MAX_MULTIPLIER:
                    return None
                # a low-precision weight rounds its update before the stretch; a DTensor shard is
                # left to the split (torch's grouped ops on it are the strategy's business)
                if p.dtype not in (torch.float32, torch.float64) or type(p.data) is not torch.Tensor:
                    return None
                size += p.numel() * p.element_size()
                params, weights = by_place.setdefault((p.device, p.dtype), ([], []))
                params.append(p)
                weights.append(1.0 - m)  # lerp(new, old, 1 - m) = old + m (new - old)
        if size > RESCALE_MAX_BYTES:
            return None
        # on a CPU an extra optimizer pass costs about what stretching SPLIT_GROUP_TENSORS tensors does:
        # a split into a few groups (a pattern or two of LayerLRMultiplier) is then the cheaper path
        extra = len(self._partition(optimizer.param_groups)) - len(optimizer.param_groups)
        scaled = sum(len(ps) for ps, _ in by_place.values())
        if all(device.type == "cpu" for device, _ in by_place) and extra * SPLIT_GROUP_TENSORS < scaled:
            return None
        # the copies of the last plan are reused where they still fit (TempBalance re-decides every few steps)
        spare = {id(p): c for ps, cs, _ in (self._rescale_cache or (None, None))[1] or () for p, c in zip(ps, cs)}

        def copy_of(p: nn.Parameter) -> torch.Tensor:
            c = spare.get(id(p))
            fits = c is not None and (c.shape, c.dtype, c.device) == (p.shape, p.dtype, p.device)
            return c if fits else torch.empty_like(p, requires_grad=False)

        return [(ps, [copy_of(p) for p in ps], ws) for ps, ws in by_place.values()]

    def _step_plan(self) -> tuple[tuple, frozenset[int], bool]:
        """(key, ids of frozen parameters, whether any multiplier is not 1), once per change."""
        key = (self._version, _layout(self._groups()))
        if self._plan is None or self._plan[0] != key:
            frozen = frozenset().union(*self._frozen.values()) if self._frozen else frozenset()
            self._frozen_params = [p for g in self._groups() for p in g["params"] if id(p) in frozen]
            scaled = any(any(m != 1.0 for m in t.values()) for t in self._mults.values())
            self._plan = (key, frozen, scaled)
        return self._plan

    def _step_lrs(self, optimizer) -> dict[int, float]:
        """id(p) -> the LR ``p``'s update used in the step just taken (frozen: left out); the same
        dict while neither the owners nor the scheduled LRs change."""
        _, frozen, _ = self._step_plan()
        split = self._saved_groups is not None
        key = (self._version, split, _layout(optimizer.param_groups), tuple(float(g["lr"]) for g in optimizer.param_groups))
        if self._lrs_cache is not None and self._lrs_cache[0] == key:
            return self._lrs_cache[1]
        out = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in frozen:
                    out[id(p)] = float(g["lr"]) if split else float(g["lr"]) * self.multiplier(p)
        self._lrs_cache = (key, out)
        return out

    def _after_step(self, optimizer, args, kwargs):
        if self._suspended:
            return
        try:
            if self._rescaling is not None:
                with torch.no_grad():
                    for params, before, weights in self._rescaling:
                        torch._foreach_lerp_(params, before, weights)
            if self._transforms:
                step = PostStep(optimizer, self, self._step_lrs(optimizer))
                for _, _, fn in sorted(self._transforms.values(), key=lambda t: (t[0], t[1])):
                    fn(step)
            if self._masks:
                self.apply_masks()
        finally:
            self._grads_masked = False
            self._rescaling = None
            self._restore()

    def _restore(self) -> None:
        if self._saved_groups is None:
            return
        opt = self.optimizer
        split = opt.param_groups
        # carry back anything the optimizer wrote into its groups during the step (some keep a
        # step counter there); lr and params stay the scheduler's
        for (gi, _, _), sub in zip(self._split_runs, split):
            orig = self._saved_groups[gi]
            for k, v in sub.items():
                if k not in ("params", "lr") and orig.get(k, v) is not v:
                    orig[k] = v
        opt.param_groups = self._saved_groups
        self._saved_groups = None


def _guard_step(optimizer: torch.optim.Optimizer) -> None:
    """Wrap the instance's ``step`` (as torch's LR schedulers do) so that a step that raises gives
    the user's groups back as the error leaves it: torch's step hooks have no error hook, and a
    user who catches the error in a manual-optimization ``training_step`` may step a scheduler
    before the next optimizer step. It stays a bound method, which the schedulers' own wrapping
    (``step.__func__``) needs; a scheduler's earlier wrapping stays inside it. The controller is
    looked up at the error, so a removed one is not called."""
    inner = optimizer.step

    def step(self, *args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except BaseException:
            ctl = getattr(self, _ATTR, None)
            if ctl is not None:
                ctl.abandon_step()
            raise

    if hasattr(inner, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # a scheduler made later does not wrap it twice
    optimizer.step = step.__get__(optimizer)


def _unwrap(optimizer: object) -> object:
    """The optimizer whose step updates the parameters: through Lightning's ``LightningOptimizer``
    (``_optimizer``) and wrappers that share their inner optimizer's groups (timm's Lookahead)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    inner = getattr(optimizer, "_base_optimizer", None) or getattr(optimizer, "base_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and getattr(optimizer, "param_groups", None) is inner.param_groups:
        return _unwrap(inner)
    return optimizer


def _placed_as(params: list[nn.Parameter], copy: torch.Tensor) -> bool:
    """Whether the parameters are still in the dtype of the plan's copies, and the first on their
    device: a part of the model cast mid-fit (one layer kept in float64) re-plans. The dtypes are
    compared by C-level iteration (``map``; about 0.07 us a parameter on a CPU, per step) -- a
    device read costs twice that, so a move is caught by the first parameter, as a model moves
    whole."""
    return params[0].device == copy.device and all(map(operator.is_, map(_DTYPE, params), repeat(copy.dtype)))


def _layout(groups: list[dict]) -> tuple[int, ...]:
    """The number of parameters in each group: what the plans are cached for besides the owners'
    version (``add_param_group`` mid-fit adds a group, a hand-made change may add parameters)."""
    return tuple(len(g["params"]) for g in groups)


def set_requires_grad(params: Iterable[nn.Parameter], flag: bool) -> None:
    """Toggle ``requires_grad`` directly (for user code outside any owner; callbacks use
    :meth:`LayerControl.set_requires_grad`, which gives the flags back)."""
    for p in params:
        p.requires_grad_(flag)
