"""The selective proximal step of "Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239) as pure tensor functions.

The paper splits regularized fine-tuning ``min R~(theta) + lambda/2 ||theta - theta_0||^2`` into a
gradient step on ``R~`` followed by a gradient step on the regularizer (section 2):

    theta~_t = theta_{t-1} - eta grad R~(theta_{t-1})
    theta_t  = theta~_t - lambda eta (theta~_t - theta_0)

and Theorem 1 (under the squared loss, ``d/dt ||f_theta(x*) - y*||^2 <= 0``) makes the second
step *selective*: apply it only where ``grad R~(theta) . (theta - theta_0) >= 0``, because then
``-(theta - theta_0)`` is itself a descent direction and pulling toward the anchor cannot raise
the training loss (to first order); otherwise ``lambda = 0`` for that step.

Here ``eta`` is whatever learning rate the optimizer step used for the tensor (a scheduled LR
times any per-layer multiplier), the decision is taken per tensor, per layer (the sum of the
inner products of the layer's tensors) or globally (the sum over all), and the step is
decoupled from the optimizer, as AdamW decouples weight decay: it is not folded into the
gradient, so Adam's normalization does not rescale it.

Which ``theta`` goes into the inner product is the caller's choice; the one this module is
written for (the authors' selective projection; docs/proximal.md, "Choices where the paper is
silent") is the weights *after* the optimizer step, the point where the pull is applied, with the
gradient of the step just taken.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from lalr_lightning.choices import unknown
from lalr_lightning.core.runtime.checks import check_number

__all__ = ["GRANULARITIES", "GroupedStep", "check_lam", "coefficients", "deltas", "distances", "inner_products",
           "pull_decisions", "proximal_step_", "pulled_fractions", "selective_step_", "stepped"]

GRANULARITIES = ("tensor", "layer", "global")


def deltas(params: Mapping[str, Tensor], anchors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: theta - theta_0}`` (new tensors on the parameter's device and dtype).

    The anchor may live elsewhere (CPU offload); it is moved per tensor. Computed as one
    ``torch._foreach_sub`` per device.
    """
    _check_same(params, anchors, "anchors")
    names = list(params)
    out: dict[str, Tensor] = {}
    for dev_names in _by_device(params, names).values():
        ps = [params[n].detach() for n in dev_names]
        an = [anchors[n].detach().to(device=p.device, dtype=p.dtype, non_blocking=True) for n, p in zip(dev_names, ps)]
        out.update(zip(dev_names, torch._foreach_sub(ps, an)))
    return {n: out[n] for n in names}


def distances(deltas: Mapping[str, Tensor], groups: Mapping[str, Sequence[str]] | None = None, *,
              reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
    """``||theta - theta_0||_2`` per group (``{layer: [tensor names]}``; default: per tensor), float64.

    The l2 norm over all entries of the group's tensors, ``sqrt(sum_t ||d_t||^2)``; one
    ``torch._foreach_norm`` and one host transfer per device. The norm of the whole vector
    (Table 1's ``||theta_t - theta_0||_2``) is ``distances(d, {"all": list(d)})["all"]``.
    ``reduce``: where each rank holds a piece of every tensor (FSDP), the sum over the ranks of
    the float64 vector of squared norms (one collective, every rank with the same names).
    """
    names = list(deltas)
    sq: dict[str, float] = {}
    for members in _by_device(deltas, names).values():
        norms = torch._foreach_norm([deltas[n].detach().to(torch.promote_types(deltas[n].dtype, torch.float32))
                                     for n in members])
        sq.update(zip(members, (torch.stack(norms).double() ** 2).cpu().tolist()))
    if reduce is not None and names:
        device = deltas[names[0]].device
        sq = dict(zip(names, reduce(torch.tensor([sq[n] for n in names], dtype=torch.float64, device=device))
                      .cpu().tolist()))
    if groups is None:
        return {n: math.sqrt(sq[n]) for n in names}
    out = {}
    for g, members in groups.items():
        missing = [n for n in members if n not in sq]
        if missing:
            raise ValueError(f"layer {g!r} lists {missing[0]!r}, which has no theta - theta_0")
        out[g] = math.sqrt(math.fsum(sq[n] for n in members))
    return out


def inner_products(grads: Mapping[str, Tensor | None], deltas: Mapping[str, Tensor], *,
                   reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, float]:
    """``{name: <g_t, d_t>}`` in float64 for every tensor of ``deltas``.

    A missing or ``None`` gradient (a parameter the loss did not reach) counts as 0. Each
    product is accumulated in at least float32 (bf16/fp16 tensors are upcast, so the sign is
    reliable), and all of them reach the host in one transfer. ``reduce``: as in
    :func:`distances` (the pieces' products summed over the ranks).
    """
    names = list(deltas)
    vals: dict[str, Tensor] = {}
    for n in names:
        d = deltas[n]
        g = grads.get(n)
        if g is None:
            vals[n] = torch.zeros((), dtype=torch.float64, device=d.device)
            continue
        if g.shape != d.shape:
            raise ValueError(f"gradient of {n!r} has shape {tuple(g.shape)} but theta - theta_0 has {tuple(d.shape)}")
        ct = torch.promote_types(torch.promote_types(g.dtype, d.dtype), torch.float32)
        gd = torch.dot(g.detach().reshape(-1).to(ct), d.detach().reshape(-1).to(device=g.device, dtype=ct))
        vals[n] = gd.to(torch.float64)
    if reduce is not None and names:
        device = vals[names[0]].device
        return dict(zip(names, reduce(torch.stack([vals[n].to(device) for n in names])).cpu().tolist()))
    out: dict[str, float] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for n, v in vals.items():
        by_dev.setdefault(v.device, []).append(n)
    for members in by_dev.values():  # one device-to-host transfer per device
        out.update(zip(members, torch.stack([vals[n] for n in members]).cpu().tolist()))
    return {n: out[n] for n in names}


def pull_decisions(
    grads: Mapping[str, Tensor | None],
    deltas: Mapping[str, Tensor],
    granularity: str = "tensor",
    groups: Mapping[str, Sequence[str]] | None = None,
    *,
    selective: bool = True,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, bool]:
    """Which tensors the proximal step pulls toward the anchor: ``{name: bool}``.

    ``tensor``: ``<g_t, d_t> >= 0``. ``layer``: ``sum_{t in l} <g_t, d_t> >= 0`` decides for every
    tensor of layer ``l`` (``groups = {layer: [tensor names]}``, e.g. from
    :func:`~lalr_lightning.core.linearization.ntk_groups.layer_groups`; every tensor in exactly one layer). ``global``:
    ``sum_t <g_t, d_t> >= 0`` decides for all -- Theorem 1's condition verbatim, on the whole
    parameter vector. Ties (``= 0``, also a zero gradient) pull, as in the theorem.
    ``selective=False`` pulls everything (plain L2-SP) and ignores the gradients. ``reduce``: as
    in :func:`inner_products` (each rank then decides from the same sums).
    """
    if granularity not in GRANULARITIES:
        raise unknown("granularity", granularity, GRANULARITIES, show=repr)
    names = list(deltas)
    if not selective:
        return dict.fromkeys(names, True)
    ip = inner_products(grads, deltas, reduce=reduce)
    if granularity == "tensor":
        return {n: ip[n] >= 0 for n in names}
    if granularity == "global":
        return dict.fromkeys(names, math.fsum(ip.values()) >= 0)
    if groups is None:
        raise ValueError("granularity='layer' needs groups={layer name: [tensor names]} (see ntk.layer_groups)")
    owner: dict[str, str] = {}
    for layer, members in groups.items():
        for n in members:
            if n not in deltas:
                raise ValueError(f"layer {layer!r} lists {n!r}, which has no theta - theta_0 (not a regularized tensor)")
            if n in owner:
                raise ValueError(f"tensor {n!r} is in two layers ({owner[n]!r} and {layer!r})")
            owner[n] = layer
    missing = [n for n in names if n not in owner]
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is in no layer of groups; every regularized tensor needs a layer")
    per_layer = {layer: math.fsum(ip[n] for n in members) >= 0 for layer, members in groups.items()}
    return {n: per_layer[owner[n]] for n in names}


def proximal_step_(
    params: Mapping[str, Tensor],
    anchors: Mapping[str, Tensor],
    lam: float,
    lrs: Mapping[str, float] | float,
    pull: Mapping[str, bool] | None = None,
) -> dict[str, float]:
    """In place: ``theta_t <- theta_t - lam * lr_t * (theta_t - theta_0)`` for every pulled tensor.

    ``lrs``: the learning rate each tensor's optimizer step used (one number for all, or per
    name); ``pull``: :func:`pull_decisions` (default: every tensor). Returns the coefficient
    ``lam * lr_t`` applied per tensor (0 where not pulled). One ``torch._foreach_lerp_`` per
    device (``theta + c (theta_0 - theta)``, the same update), no temporary copies. A
    coefficient above 1 would step past the anchor (and above 2 diverge), so it is an error.
    """
    _check_same(params, anchors, "anchors")
    names = list(params)
    coef = coefficients(lam, lrs, names)
    if pull is not None:
        coef = {n: c if bool(_get(pull, n, "pull")) else 0.0 for n, c in coef.items()}
    active = [n for n in names if coef[n] > 0]
    with torch.no_grad():
        for dev_names in _by_device(params, active).values():
            ps = [params[n] for n in dev_names]
            an = [anchors[n].detach().to(device=p.device, dtype=p.dtype, non_blocking=True)
                  for n, p in zip(dev_names, ps)]
            torch._foreach_lerp_(ps, an, [coef[n] for n in dev_names])
    return coef


def stepped(params: Mapping[str, Tensor], reduce: Callable[[Tensor], Tensor] | None = None) -> list[str]:
    """The names of ``params`` whose ``.grad`` is set; with ``reduce`` (a sum over the ranks, a
    collective every rank calls with the same names), set on at least one rank: under FSDP a rank
    may hold no piece of a tensor that stepped."""
    names = list(params)
    if reduce is None or not names:
        return [n for n in names if params[n].grad is not None]
    got = reduce(torch.tensor([params[n].grad is not None for n in names], dtype=torch.float64,
                              device=params[names[0]].device))
    return [n for n, k in zip(names, got.tolist()) if k > 0]


def selective_step_(
    params: Mapping[str, Tensor],
    anchors: Mapping[str, Tensor],
    grads: Mapping[str, Tensor | None],
    lam: float,
    lrs: Mapping[str, float] | float,
    *,
    selective: bool = True,
    granularity: str = "tensor",
    groups: Mapping[str, Sequence[str]] | None = None,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, bool]:
    """:func:`pull_decisions` (``groups`` cut to the tensors of ``params``), then
    :func:`proximal_step_` in place; returns the decisions. ``selective=False`` pulls every tensor
    without computing ``theta - theta_0``."""
    pull = dict.fromkeys(params, True)
    if selective:
        kept = None if groups is None else {
            g: m for g, members in groups.items() if (m := [n for n in members if n in params])}
        pull = pull_decisions(grads, deltas(params, anchors), granularity, kept, reduce=reduce)
    proximal_step_(params, anchors, lam, lrs, pull)
    return pull


def pulled_fractions(steps: Mapping[str, int], pulled: Mapping[str, int],
                     groups: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Per group, the share of its tensors' steps that pulled (0 before any step)."""
    out = {}
    for g, members in groups.items():
        total = sum(steps[n] for n in members)
        out[g] = sum(pulled[n] for n in members) / total if total else 0.0
    return out


def check_lam(lam: float) -> float:
    """``lam`` as a float, or a ValueError when it is not a finite number >= 0."""
    return check_number("lam", float(lam), low=0)


def coefficients(lam: float, lrs: Mapping[str, float] | float, names: Sequence[str]) -> dict[str, float]:
    """``{name: lam * lr}`` (host numbers), checked: ``lam`` and each LR finite and >= 0, and no
    coefficient above 1 (the step would overshoot the anchor)."""
    lam = check_lam(lam)
    coef: dict[str, float] = {}
    for n in names:
        lr = float(lrs if not isinstance(lrs, Mapping) else _get(lrs, n, "lrs"))
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"the learning rate of {n!r} must be finite and >= 0, got {lr}")
        c = lam * lr
        if c > 1:
            raise ValueError(
                f"lam * lr = {lam} * {lr} = {c:.4g} > 1 for {n!r}: the proximal step would overshoot the anchor "
                f"(theta - theta_0 changes sign; above 2 it diverges). Use lam <= {1 / lr:.4g} at this learning rate"
            )
        coef[n] = c
    return coef


class GroupedStep:
    """The selective proximal step over a fixed list of tensors with a fixed number of tensor
    operations per step, per device and dtype, whatever the number of tensors, no per-tensor
    Python loop and no device-to-host synchronisation: the decisions stay on the device.

    The same numbers as :func:`pull_decisions` + :func:`proximal_step_`: ``d_t = theta_t -
    theta_0`` in the weights' dtype, the products ``g d`` and their sum ``<g_t, d_t>`` per
    tensor in at least float32 (:func:`inner_products`' convention: its ``dot`` accumulates in
    that precision too; a float64 weight sums in float64), then in float64 the sum per layer or
    over all; the decision per tensor, layer or globally; then per tensor ``theta <- lerp(theta,
    target, lam * lr)`` with ``target = theta_0`` where pulled and ``theta`` itself elsewhere (an
    exact ``lerp`` by 1 or 0), so a pulled tensor gets :func:`proximal_step_`'s update bitwise
    and the others are left bitwise untouched. (The sums were float64 before, as ``2 sum max(g
    d, 0) - sum |g d|`` from two ``torch._foreach_norm``; a float32 sum of float32 products is
    what the reference's ``dot`` does, and a decision only reads its sign.)

    Where the time goes (issue 34): on a CPU a grouped ``torch._foreach_*`` op is a loop of
    per-tensor ops (about a microsecond each, several for a reduction such as
    ``torch._foreach_norm``), so the tensors are ordered by shape within a device and dtype and
    each run of equal-shape tensors (a chunk: at most ``CHUNK`` elements, a larger tensor alone)
    is handled as one matrix. On a CPU (``KEEP``) per chunk ``theta`` and ``g`` are stacked (one
    op each) into two buffers kept between steps, as large as the largest chunk, ``d`` is one
    subtraction of the chunk's stacked ``theta_0`` (kept while the anchors are the same tensors;
    :meth:`adopt` lets the caller hold views of it instead of a second copy), then ``g d`` and
    its row sums: a new temporary at every step would be faulted in afresh. On an accelerator,
    whose multi-tensor kernels take a list in one launch and whose allocator reuses memory,
    ``d`` is a grouped temporary and each chunk is stacked into one such buffer for its sums.
    The pull is one grouped ``lerp`` whose weights live in one buffer per group with 0-dim views
    made once; the anchors are checked for their place only when they are not the tensors
    found in place at the last step. What is left is memory traffic: ``theta``, ``theta_0`` and
    ``g`` are each read about twice, ``theta`` rewritten.

    ``layers``: the layer index of each tensor (``granularity="layer"``). Build one per set of
    tensors (it holds their grouping and the layer index on the device) and reuse it. It counts
    its steps and, on the device, the steps that pulled each tensor, until :meth:`take` reads them.
    """

    #: at most this many elements of equal-shape tensors are summed as one matrix
    CHUNK = 1 << 22
    #: on a CPU, stack each chunk into buffers kept between steps (the accelerators' path otherwise)
    KEEP = True

    def __init__(self, params: Sequence[Tensor], layers: Sequence[int] | None = None):
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        # within a device and dtype, tensors of one size side by side (stable: the caller's order otherwise)
        self.groups = [sorted(g, key=lambda i: (params[i].numel(), tuple(params[i].shape))) for g in groups.values()]
        #: the tensors in the order of the decisions :meth:`step_` returns (by device and dtype, then size)
        self.order = [i for g in self.groups for i in g]
        self.device = params[self.order[0]].device if self.order else torch.device("cpu")
        self.size = len(self.order)
        self._places = [(params[g[0]].device, params[g[0]].dtype) for g in self.groups]
        self._pick = [_picker(g) for g in self.groups]
        self._chunks = [_chunks([tuple(params[i].shape) for i in g], self.CHUNK) for g in self.groups]
        self._buffers: dict[int, Tensor] = {}
        self._kept_bufs: dict[int, list[tuple]] = {}
        self._anchor_rows: dict[int, tuple[tuple, list[Tensor]]] = {}
        self._coefs: dict[int, tuple[Sequence[float], Tensor, Tensor, list[Tensor]]] = {}
        self._host: dict[int, tuple[Sequence[float], list[float]]] = {}
        self._anchored: list[tuple | None] = [None] * len(self.groups)  # the anchors last found in place
        self.layer_index = None
        self.n_layers = 0
        self.steps, self.pulled = 0, None  # counted since the last take(); pulled on the device
        self._all: Tensor | None = None
        self._host_coefs: tuple[object, list[float]] | None = None
        if layers is not None:
            self.n_layers = max(layers, default=-1) + 1
            self.layer_index = _on_device([layers[i] for i in self.order], torch.long, self.device)

    def coefficients(self, lam: float, token: object, lrs: Callable[[], Mapping[str, float]]) -> list[float]:
        """``lam * lr`` per tensor (:func:`coefficients`, checked) from ``lrs()``, ``{name: learning
        rate}`` of the tensors in the caller's order; computed again only when ``token`` (the object
        holding the step's learning rates) is a new one."""
        if self._host_coefs is None or self._host_coefs[0] is not token:
            named = lrs()
            self._host_coefs = (token, list(coefficients(lam, named, list(named)).values()))
        return self._host_coefs[1]

    def placed(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` are still where and in the dtype this grouping was made for (the model
        was not moved or cast)."""
        return all((params[g[0]].device, params[g[0]].dtype) == place for g, place in zip(self.groups, self._places))

    @torch.no_grad()
    def step_(self, params: Sequence[Tensor], anchors: Sequence[Tensor], grads: Sequence[Tensor | None],
              coefs: Sequence[float], *, selective: bool = True, granularity: str = "tensor") -> Tensor:
        """Pull ``params`` in place; returns the decisions (bool, in :attr:`order`, on
        :attr:`device`). ``coefs``: ``lam * lr`` per tensor (:func:`coefficients`). ``anchors`` are
        read as constants while they are the same tensors (a CPU keeps them stacked): pass new
        tensors for a new ``theta_0``, not the old ones changed in place."""
        if granularity not in GRANULARITIES:
            raise unknown("granularity", granularity, GRANULARITIES, show=repr)
        if granularity == "layer" and selective and self.layer_index is None:
            raise ValueError("granularity='layer' needs the layer of each tensor (GroupedStep(params, layers))")
        if not self.size:
            return torch.zeros(0, dtype=torch.bool, device=self.device)
        placed = [(gi, self._pick[gi](params), self._anchors(gi, self._pick[gi](anchors)))
                  for gi in range(len(self.groups))]
        if not selective:
            for gi, ps, an in placed:
                torch._foreach_lerp_(ps, an, self._host_list(gi, coefs))
            if self._all is None:
                self._all = torch.ones(self.size, dtype=torch.bool, device=self.device)
            return self._tally(self._all)
        ips = []
        for gi, ps, an in placed:
            gs = self._pick[gi](grads)
            if any(map(operator.is_, gs, itertools.repeat(None))):  # no gradient: a product of 0
                gs = [torch.zeros_like(p) if x is None else x for x, p in zip(gs, ps)]
            ct = torch.promote_types(ps[0].dtype, torch.float32)
            blocks = self._blocks(gi, ps, ct)
            if blocks is not None:  # on a CPU: chunk by chunk through one buffer kept between steps
                sums = []
                anchor = self._stacked_anchor(gi, an) if ct == ps[0].dtype else None
                for c, (s, e, stacked, prods, rows, g_stacked, g_rows) in enumerate(blocks):
                    if anchor is not None:  # one op per chunk for each of theta, d, g and g d
                        torch.stack(ps[s:e], out=stacked)
                        rows.sub_(anchor[c])
                        torch.stack(gs[s:e], out=g_stacked)
                        rows.mul_(g_rows)
                    else:  # bf16 / fp16: d rounded to the dtype (as deltas()), g d in float32
                        torch._foreach_copy_(prods, torch._foreach_sub(ps[s:e], an[s:e]))
                        torch._foreach_mul_(prods, gs[s:e])
                    sums.append(rows.sum(1))
                ips.append((torch.cat(sums) if len(sums) > 1 else sums[0]).to(device=self.device, dtype=torch.float64))
                continue
            prods = torch._foreach_sub(ps, an)  # d = theta - theta_0 (the only full-size temporary)
            if ct != ps[0].dtype:  # bf16 / fp16: d rounded to the dtype (as deltas()), g d in float32
                prods = [d.to(ct) for d in prods]
                gs = [x.to(ct) for x in gs]
            torch._foreach_mul_(prods, gs)  # g d, in place
            ips.append(self._sums(gi, prods).to(device=self.device, dtype=torch.float64))
            del prods
        ip = torch.cat(ips) if len(ips) > 1 else ips[0]
        if granularity == "tensor":
            pull = ip >= 0
        elif granularity == "global":
            pull = (ip.sum() >= 0).expand(self.size)
        else:
            per_layer = torch.zeros(self.n_layers, dtype=torch.float64, device=self.device)
            pull = (per_layer.index_add_(0, self.layer_index, ip) >= 0)[self.layer_index]
        start = 0
        for gi, ps, an in placed:
            n = len(ps)
            on = pull[start:start + n]
            start += n
            coef, weights, views = self._weights(gi, coefs)
            if ps[0].dtype in (torch.float32, torch.float64):
                # one lerp by lam * lr where pulled and 0 elsewhere (the coefficient rounds to the
                # dtype as a Python number does in lerp_)
                torch.mul(on.to(weights.device), coef, out=weights)
                torch._foreach_lerp_(ps, an, views)
            else:
                # a half-precision weight would round lam * lr: theta_0 where pulled, theta elsewhere
                # (a lerp by exactly 1 or 0), then the host coefficient
                weights.copy_(on, non_blocking=True)
                target = torch._foreach_lerp(ps, an, views)
                torch._foreach_lerp_(ps, target, self._host_list(gi, coefs))
                del target
        return self._tally(pull)

    def _sums(self, gi: int, prods: Sequence[Tensor]) -> Tensor:
        """``sum(g d)`` per tensor of group ``gi`` (in its order), on an accelerator: one row sum per
        chunk of equal-shape tensors, stacked into one buffer kept between steps (the chunks go
        through it one after the other, in stream order)."""
        out = []
        for s, e in self._chunks[gi]:
            if e - s == 1:
                rows = prods[s].reshape(1, -1)
            else:
                first = prods[s]
                out_rows = self._stack(gi, (e - s) * first.numel(), first.dtype).view(e - s, *first.shape)
                rows = torch.stack(prods[s:e], out=out_rows).view(e - s, -1)
            out.append(rows.sum(1))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _blocks(self, gi: int, ps: Sequence[Tensor], ct: torch.dtype) -> list[tuple] | None:
        """On a CPU (``KEEP``), group ``gi``'s chunks, each as ``(start, end, [tensors, *shape], its views
        shaped as the tensors, [tensors, elements])`` over one buffer in ``ct``, and the same two views
        of a second one (for ``g``), both kept between steps and as large as the largest chunk (the
        chunks go through them one after the other), made once; elsewhere None."""
        if not self.KEEP or self._places[gi][0].type != "cpu":
            return None
        hit = self._kept_bufs.get(gi)
        if hit is None:
            spans = self._chunks[gi]
            size = max((e - s) * ps[s].numel() for s, e in spans)
            buf, g_buf = torch.empty(size, dtype=ct), torch.empty(size, dtype=ct)
            hit = []
            for s, e in spans:
                k, n = e - s, ps[s].numel()
                stacked = buf[:k * n].view(k, *ps[s].shape)
                hit.append((s, e, stacked, list(stacked.unbind(0)), buf[:k * n].view(k, n),
                            g_buf[:k * n].view(k, *ps[s].shape), g_buf[:k * n].view(k, n)))
            self._kept_bufs[gi] = hit
        return hit

    def _stacked_anchor(self, gi: int, an: Sequence[Tensor]) -> list[Tensor]:
        """On a CPU, group ``gi``'s ``theta_0`` stacked per chunk as ``[tensors, elements]``, kept while the
        anchors are the same tensors (``d`` is then one subtraction per chunk). A copy of the anchors,
        unless the caller takes its views in their place (:meth:`adopt`)."""
        hit = self._anchor_rows.get(gi)
        if hit is None or len(hit[0]) != len(an) or not all(map(operator.is_, an, hit[0])):
            rows = [torch.stack(an[s:e]).view(e - s, -1) for s, e in self._chunks[gi]]
            hit = self._anchor_rows[gi] = (tuple(an), rows)
        return hit[1]

    def adopt(self, anchors: Sequence[Tensor]) -> list[Tensor]:
        """``anchors`` (in the caller's order, placed as the tensors) as this step keeps them: on a CPU,
        views of its stacked copy (equal, bitwise), which the caller should hold instead of its own so
        that ``theta_0`` is in memory once; elsewhere (or in bf16 / fp16) the same tensors."""
        out = list(anchors)
        for gi, g in enumerate(self.groups):
            device, dtype = self._places[gi]
            if not self.KEEP or device.type != "cpu" or torch.promote_types(dtype, torch.float32) != dtype:
                continue
            an = self._pick[gi](anchors)
            if any(a.device != device or a.dtype != dtype for a in an):
                continue
            self._anchor_rows.pop(gi, None)
            rows = self._stacked_anchor(gi, an)
            views = [v.view(an[s + j].shape) for r, (s, e) in zip(rows, self._chunks[gi]) for j, v in enumerate(r)]
            self._anchor_rows[gi] = (tuple(views), rows)
            for i, v in zip(g, views):
                out[i] = v
        return out

    def _stack(self, gi: int, numel: int, dtype: torch.dtype) -> Tensor:
        """A flat buffer of ``numel`` elements on group ``gi``'s device (one per group, grown as needed, at
        most ``CHUNK`` elements: the chunks are summed one after the other)."""
        buf = self._buffers.get(gi)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[gi] = torch.empty(numel, dtype=dtype, device=self._places[gi][0])
        return buf[:numel]

    def _anchors(self, gi: int, an: Sequence[Tensor]) -> Sequence[Tensor]:
        """Group ``gi``'s anchors on its device and in its dtype (moved per tensor where they are not,
        e.g. offloaded to the CPU); checked per tensor only when they are not the ones found in place
        at the last step."""
        last = self._anchored[gi]
        if last is not None and len(last) == len(an) and all(map(operator.is_, an, last)):
            return an
        device, dtype = self._places[gi]
        moved = [a if a.device == device and a.dtype == dtype else
                 a.detach().to(device=device, dtype=dtype, non_blocking=True) for a in an]
        self._anchored[gi] = tuple(an) if all(map(operator.is_, moved, an)) else None
        return moved

    def _tally(self, pull: Tensor) -> Tensor:
        self.steps += 1
        self.pulled = pull.long() if self.pulled is None else self.pulled.add_(pull)
        return pull

    def take(self) -> tuple[int, list[int]]:
        """(the steps since the last call, and per tensor in the caller's order the steps of those that
        pulled it), with one device-to-host transfer; the counts start again from 0."""
        steps, pulled = self.steps, [0] * self.size
        if self.pulled is not None:
            for i, k in zip(self.order, self.pulled.tolist()):
                pulled[i] = k
        self.steps, self.pulled = 0, None
        return steps, pulled

    def _host_list(self, gi: int, coefs: Sequence[float]) -> list[float]:
        """Group ``gi``'s ``lam * lr`` as host numbers, picked once per new ``coefs`` list."""
        hit = self._host.get(gi)
        if hit is None or hit[0] is not coefs:
            hit = self._host[gi] = (coefs, [float(coefs[i]) for i in self.groups[gi]])
        return hit[1]

    def _weights(self, gi: int, coefs: Sequence[float]) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Group ``gi``'s ``lam * lr`` on the device (copied once per new ``coefs`` list: pinned and
        asynchronous on a GPU, no synchronisation), and the buffer of its per-tensor ``lerp`` weights
        with its 0-dim views (made once: the step writes the buffer in place)."""
        hit = self._coefs.get(gi)
        if hit is not None and hit[0] is coefs:
            return hit[1:]
        device, dtype = self._places[gi]
        if hit is None:
            weights = torch.zeros(len(self.groups[gi]), dtype=dtype, device=device)
            views = list(weights.unbind())
        else:
            weights, views = hit[2], hit[3]
        coef = _on_device([coefs[i] for i in self.groups[gi]], dtype, device)
        self._coefs[gi] = (coefs, coef, weights, views)
        return coef, weights, views


def _picker(indices: Sequence[int]) -> Callable[[Sequence], Sequence]:
    """``seq -> [seq[i] for i in indices]`` in C (``operator.itemgetter``), always a sequence."""
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


def _chunks(shapes: Sequence[tuple[int, ...]], limit: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of equal ``shapes`` (sorted), each at most ``limit`` elements in all
    (a larger tensor alone)."""
    out, s = [], 0
    while s < len(shapes):
        numel, e = math.prod(shapes[s]), s + 1
        while e < len(shapes) and shapes[e] == shapes[s] and (e + 1 - s) * numel <= limit:
            e += 1
        out.append((s, e))
        s = e
    return out


def _on_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host numbers as a tensor on ``device``, copied from pinned memory without a synchronisation
    (``torch.tensor(..., device="cuda")`` waits for the copy: a sync on every new plan)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _get(m: Mapping, n: str, what: str):
    if n not in m:
        raise ValueError(f"{what} has no entry for {n!r}; it needs one per parameter")
    return m[n]


def _check_same(params: Mapping[str, Tensor], anchors: Mapping[str, Tensor], what: str) -> None:
    for n, p in params.items():
        if n not in anchors:
            raise ValueError(f"{what} has no value for {n!r}; the anchor needs every regularized parameter")
        if anchors[n].shape != p.shape:
            raise ValueError(f"{what}[{n!r}] has shape {tuple(anchors[n].shape)} but the parameter has {tuple(p.shape)}")


def _by_device(params: Mapping[str, Tensor], names: Sequence[str]) -> dict[tuple, list[str]]:
    out: dict[tuple, list[str]] = {}
    for n in names:
        p = params[n]
        out.setdefault((p.device, p.dtype), []).append(n)
    return out
