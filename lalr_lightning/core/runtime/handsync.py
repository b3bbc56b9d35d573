"""Parameters kept out of DDP, their gradients averaged across ranks by hand.

DDP allocates a gradient bucket for every parameter that requires grad when it wraps the model,
and keeps it for the whole fit. A selection that switches blocks on and off (LISA, LIFT, L-MSA)
trains a few blocks at a time, so those buckets would hold the whole model. :class:`HandSync`
takes the switching blocks' parameters out of DDP (``exclude``, before the wrap: DDP's own
``_set_params_and_buffers_to_ignore_for_model``) and, once per synchronizing backward -- the
last micro-batch of an optimizer step; DDP's ``no_sync`` micro-batches are skipped -- averages
the gradients that exist, at the end of that backward, where DDP finishes its own all-reduce. So
every hook after the backward (``on_after_backward``, ``on_before_optimizer_step``, clipping,
the optimizer) sees averaged gradients, as under plain DDP; AMP's scaled gradients average
linearly, so unscaling later is unchanged.

DDP does not broadcast the parameters it ignores at the wrap: :meth:`HandSync.start` does,
from rank 0, so ranks that built their models separately start equal.

Limits: the backward must be one autograd graph task, so reentrant activation checkpointing is
not supported (plain DDP has the same limit); DDP communication hooks do not apply to these
parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

__all__ = ["HandSync", "average_gradients", "broadcast_parameters", "ddp_names", "ddp_for_switching", "kept_out"]

_IGNORE = "_ddp_params_and_buffers_to_ignore"  # where DDP reads the names it leaves alone
_MISSING = object()
#: bytes per all-reduce: DDP's own bucket size (bucket_cap_mb=25), so the transient flat copy stays small
BUCKET_BYTES = 25 * 1024 * 1024


def ddp_for_switching(kwargs: dict, who: str) -> str | None:
    """DDP's keyword arguments ``kwargs`` (changed in place) made fit for a selection that turns
    ``requires_grad`` on and off at every switch: ``find_unused_parameters=True``, and a one-line
    ValueError where they forbid it. Returns the line that says DDP was changed, or None."""
    if kwargs.get("static_graph"):
        raise ValueError(f"{who} turns requires_grad on and off at every switch, which DDP's "
                         "static_graph=True forbids; drop static_graph or pass save_compute=False")
    if kwargs.get("find_unused_parameters", True) is False:
        raise ValueError(f"{who} turns requires_grad on and off at every switch, which needs DDP's "
                         "find_unused_parameters=True; drop find_unused_parameters=False or pass "
                         "save_compute=False")
    if kwargs.get("find_unused_parameters"):
        return None
    kwargs["find_unused_parameters"] = True
    return (f"{who}: DDP set to find_unused_parameters=True, so the blocks that do not train "
            "get no weight gradient (save_compute=False keeps DDP's default)")


def kept_out(module: nn.Module, switching: Iterable[Iterable[nn.Parameter]],
             always: Iterable[Iterable[nn.Parameter]]) -> list[nn.Parameter]:
    """The parameters of the ``switching`` units (each an iterable of parameters) that are in no
    ``always`` unit: what to keep out of DDP's buckets. DDP refuses a model with nothing to reduce,
    so when they are all of ``module``'s trainable parameters, the smallest trainable one stays in
    (a few bytes, toggled under ``find_unused_parameters=True``); none when none trains."""
    kept = {id(p) for unit in always for p in unit}
    out = {id(p): p for unit in switching for p in unit if id(p) not in kept}
    if not any(p.requires_grad and id(p) not in out for p in module.parameters()):
        trainable = [p for p in out.values() if p.requires_grad]
        if not trainable:
            return []  # nothing trains at all; DDP says so at the wrap
        del out[id(min(trainable, key=lambda p: p.numel()))]
    return list(out.values())


def ddp_names(module: nn.Module, params: Iterable[nn.Parameter]) -> list[str]:
    """Every name under which DDP looks ``params`` up in ``module``: ``module_name.param_name``
    per module holding it (a shared parameter has one per module; DDP's reducer skips it only
    when every alias is ignored), and ``named_parameters``' form for the root's own."""
    ids = {id(p) for p in params}
    names: set[str] = set()
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in ids:
                names.add(f"{mname}.{pname}")
                names.add(f"{mname}.{pname}" if mname else pname)
    return sorted(names)


def _buckets(tensors: list[torch.Tensor], cap: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of ``tensors`` in runs of one dtype and device, each at most ``cap`` bytes (a
    larger tensor alone)."""
    out: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        run, size = open_.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > cap:
            out.append(run)
            run, size = [], 0
        run.append(i)
        open_[key] = (run, size + nbytes)
    out.extend(run for run, _ in open_.values() if run)
    return out


@torch.no_grad()
def broadcast_parameters(params: Iterable[nn.Parameter], src: int = 0, group=None) -> None:
    """Copy ``src``'s values of ``params`` to every rank, in flat buckets."""
    tensors = [p.detach() for p in params]
    for run in _buckets(tensors):
        ts = [tensors[i] for i in run]
        flat = _flatten_dense_tensors(ts)
        dist.broadcast(flat, src, group=group)
        for t, v in zip(ts, _unflatten_dense_tensors(flat, ts)):
            t.copy_(v)


@torch.no_grad()
def average_gradients(params: list[nn.Parameter], group=None) -> int:
    """Average the gradients of ``params`` across ranks, in place. The set averaged is decided
    together: a parameter with a gradient on any rank is averaged, a rank without one adding
    zeros (as DDP does for a parameter unused on that rank). Returns how many were averaged."""
    if not params:
        return 0
    world = dist.get_world_size(group)
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, group=group)
    active = [p for p, n in zip(params, present.tolist()) if n]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in active]
    for run in _buckets(grads):
        gs = [grads[i] for i in run]
        flat = _flatten_dense_tensors(gs)
        flat.div_(world)  # before the sum, as DDP does
        dist.all_reduce(flat, group=group)
        for i, v in zip(run, _unflatten_dense_tensors(flat, gs)):
            p = active[i]
            if p.grad is None:
                p.grad = v.clone()
            else:
                p.grad.copy_(v)
    return len(active)


class HandSync:
    """``params`` of ``module`` kept out of DDP, their gradients averaged by hand (module
    docstring). ``exclude()`` before DDP wraps ``module``, ``start(ddp)`` after, ``stop()`` at
    the end (restores DDP's ignore list as it was)."""

    def __init__(self, module: nn.Module, params: Iterable[nn.Parameter]):
        seen: set[int] = set()
        self.module = module
        self.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        self.names = ddp_names(module, self.params)
        self.averaged = 0  # averaging passes run (one per optimizer step that had a backward)
        self._saved: object = _MISSING  # the ignore list before exclude (_MISSING: none)
        self._excluded = False
        self._hooks: list = []
        self._queued = False
        self._sync: Callable[[], bool] = lambda: True
        self._group = None

    @classmethod
    def keep_out(cls, module: nn.Module, switching: Iterable[Iterable[nn.Parameter]],
                 always: Iterable[Iterable[nn.Parameter]]) -> HandSync | None:
        """The switching units' parameters that go out of DDP (:func:`kept_out`), excluded now
        (before the wrap); None when none does."""
        out = kept_out(module, switching, always)
        if not out:
            return None
        sync = cls(module, out)
        sync.exclude()
        return sync

    def exclude(self) -> None:
        """Add ``params`` to DDP's ignore list of ``module`` (call before the wrap)."""
        prev = getattr(self.module, _IGNORE, _MISSING)
        if not self._excluded:
            self._saved, self._excluded = prev, True
        names = set(() if prev is _MISSING else prev) | set(self.names)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.module, sorted(names))

    def start(self, ddp: nn.Module | None = None, group=None) -> None:
        """After the wrap: make the ranks' values equal (rank 0's) and average from now on.
        ``ddp``: the wrapper, whose ``require_backward_grad_sync`` (off inside ``no_sync``)
        says which backward ends an optimizer step."""
        self.stop_hooks()
        self._group = group
        self._sync = (lambda: getattr(ddp, "require_backward_grad_sync", True)) if ddp is not None else (lambda: True)
        broadcast_parameters(self.params, group=group)
        # any gradient of the model triggers: some parameter gets one in every training backward
        triggers = [p for p in self.module.parameters() if p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in triggers]
        self._queued = False

    def _on_grad(self, _p: torch.Tensor) -> None:
        if self._queued or not self._sync():
            return
        self._queued = True
        # run at the end of this backward (the graph task), after every gradient is accumulated
        torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        self._queued = False
        average_gradients(self.params, self._group)
        self.averaged += 1

    def stop_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def stop(self) -> None:
        """Remove the hooks and take this object's names out of DDP's ignore list of ``module``
        (the names that were there before stay; an ignore list that did not exist goes)."""
        self.stop_hooks()
        if not self._excluded:
            return
        before = set(()) if self._saved is _MISSING else set(self._saved)
        mine = set(self.names) - before
        now = [n for n in getattr(self.module, _IGNORE, ()) if n not in mine]
        self.module.__dict__.pop(_IGNORE, None)
        if now or self._saved is not _MISSING:
            setattr(self.module, _IGNORE, now)
        self._saved, self._excluded = _MISSING, False
