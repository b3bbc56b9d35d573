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
written for (DESIGN "Selective projection") is the weights *after* the optimizer step, the
point where the pull is applied, with the gradient of the step just taken.
"""

from __future__ import annotations

import math
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
    :func:`~lalr_lightning.core.linearization.ntk.layer_groups`; every tensor in exactly one layer). ``global``:
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
    """The selective proximal step over a fixed list of tensors with grouped tensor operations
    (``torch._foreach_*``, one call per device and dtype for every stage, whatever the number of
    tensors) and no device-to-host synchronisation: the decisions stay on the device.

    The same numbers as :func:`pull_decisions` + :func:`proximal_step_`: ``<g_t, d_t>`` with
    ``d_t = theta_t - theta_0`` (the products in at least float32, summed in float64, as
    ``2 sum max(g d, 0) - sum |g d|`` since torch has no grouped sum), the decision per tensor,
    layer (a sum of the layer's products) or globally, then per tensor ``theta <- lerp(theta,
    target, lam * lr)`` with ``target = theta_0`` where pulled and ``theta`` itself elsewhere
    (an exact ``lerp`` by 1 or 0), so a pulled tensor gets :func:`proximal_step_`'s update
    bitwise and the others are left bitwise untouched.

    ``layers``: the layer index of each tensor (``granularity="layer"``). Build one per set of
    tensors (it holds their grouping and the layer index on the device) and reuse it. It counts
    its steps and, on the device, the steps that pulled each tensor, until :meth:`take` reads them.
    """

    def __init__(self, params: Sequence[Tensor], layers: Sequence[int] | None = None):
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.device, p.dtype), []).append(i)
        self.groups = list(groups.values())
        #: the tensors in the order of the decisions :meth:`step_` returns (grouped by device and dtype)
        self.order = [i for g in self.groups for i in g]
        self.device = params[self.order[0]].device if self.order else torch.device("cpu")
        self.size = len(self.order)
        self._coefs: dict[int, tuple[Sequence[float], Tensor]] = {}
        self.layer_index = None
        self.n_layers = 0
        self.steps, self.pulled = 0, None  # counted since the last take(); pulled on the device
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
        """Whether ``params`` are still where this grouping was made (the model was not moved)."""
        return not self.order or params[self.order[0]].device == self.device

    @torch.no_grad()
    def step_(self, params: Sequence[Tensor], anchors: Sequence[Tensor], grads: Sequence[Tensor | None],
              coefs: Sequence[float], *, selective: bool = True, granularity: str = "tensor") -> Tensor:
        """Pull ``params`` in place; returns the decisions (bool, in :attr:`order`, on
        :attr:`device`). ``coefs``: ``lam * lr`` per tensor (:func:`coefficients`)."""
        if granularity not in GRANULARITIES:
            raise unknown("granularity", granularity, GRANULARITIES, show=repr)
        if granularity == "layer" and selective and self.layer_index is None:
            raise ValueError("granularity='layer' needs the layer of each tensor (GroupedStep(params, layers))")
        placed = []
        for g in self.groups:
            ps = [params[i] for i in g]
            an = [a if a.device == p.device and a.dtype == p.dtype else
                  a.detach().to(device=p.device, dtype=p.dtype, non_blocking=True)
                  for a, p in zip((anchors[i] for i in g), ps)]
            placed.append((g, ps, an))
        if not selective:
            for g, ps, an in placed:
                torch._foreach_lerp_(ps, an, [coefs[i] for i in g])
            return self._tally(torch.ones(self.size, dtype=torch.bool, device=self.device))
        ips = []
        for g, ps, an in placed:
            ct = torch.promote_types(ps[0].dtype, torch.float32)
            prods = torch._foreach_sub(ps, an)  # d = theta - theta_0 (the only full-size temporary)
            gs = [grads[i] if grads[i] is not None else torch.zeros_like(p) for i, p in zip(g, ps)]
            if ct != ps[0].dtype:
                prods = [d.to(ct) for d in prods]
                gs = [x.to(ct) for x in gs]
            torch._foreach_mul_(prods, gs)  # g * d, in place
            total = torch.stack(torch._foreach_norm(prods, 1, dtype=torch.float64))  # sum |g d|
            torch._foreach_clamp_min_(prods, 0.0)
            pos = torch.stack(torch._foreach_norm(prods, 1, dtype=torch.float64))  # sum max(g d, 0)
            del prods
            ips.append((2 * pos - total).to(self.device))
        ip = torch.cat(ips) if len(ips) > 1 else ips[0]
        if granularity == "tensor":
            pull = ip >= 0
        elif granularity == "global":
            pull = (ip.sum() >= 0).expand(self.size)
        else:
            per_layer = torch.zeros(self.n_layers, dtype=torch.float64, device=self.device)
            pull = (per_layer.index_add_(0, self.layer_index, ip) >= 0)[self.layer_index]
        start = 0
        for gi, (g, ps, an) in enumerate(placed):
            dtype = ps[0].dtype
            on = pull[start:start + len(g)].to(device=ps[0].device, dtype=dtype)
            start += len(g)
            if dtype in (torch.float32, torch.float64):
                # one lerp by lam * lr where pulled and 0 elsewhere (the coefficient rounds to the
                # dtype as a Python number does in lerp_)
                torch._foreach_lerp_(ps, an, list((on * self._coef_tensor(gi, coefs, dtype, ps[0].device)).unbind()))
            else:
                # a half-precision weight would round lam * lr: theta_0 where pulled, theta elsewhere
                # (a lerp by exactly 1 or 0), then the host coefficient
                target = torch._foreach_lerp(ps, an, list(on.unbind()))
                torch._foreach_lerp_(ps, target, [coefs[i] for i in g])
                del target
        return self._tally(pull)

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

    def _coef_tensor(self, gi: int, coefs: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Group ``gi``'s ``lam * lr`` on the device, copied once per new ``coefs`` list (pinned and
        asynchronous on a GPU: no synchronisation)."""
        cache = self._coefs
        hit = cache.get(gi)
        if hit is not None and hit[0] is coefs:
            return hit[1]
        out = cache[gi] = (coefs, _on_device([coefs[i] for i in self.groups[gi]], dtype, device))
        return out[1]


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
