"""The Method of Successive Approximations (MSA) on blocks: states, co-states, the L-MSA
selection metric and the maximization of a block's augmented Hamiltonian.

"L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0) (L-MSA) sec. 2-3 and app. A.1; the derivation for non-linear
blocks is in ``docs/lmsa.md``. Pure PyTorch, no Lightning import.

Conventions (PMP, the paper's eq. 4): a block ``n`` maps its state ``x_n`` to
``x_{n+1} = g_n(x_n, theta_n)``; the co-state of its output is ``p_{n+1} = -dL/dx_{n+1}``
(so ``p_T = -grad Phi``). Tensors are *samples first* (PyTorch's layout): a block output of
shape ``(K, ...)`` holds ``K`` samples; the paper's column vectors are our rows.

The metric (eq. 8-9) generalized to any block:

* update direction ``r_n = grad_theta [p_{n+1} . g_n(x_n, theta)]`` at ``theta_n`` -- the
  gradient of the block's Hamiltonian, i.e. minus the loss gradient of the block's
  parameters on the batch (for ``g = theta x``: ``r_n = p_{n+1} x_n^T``, the paper's ``r_n``);
* output change ``delta_n = J_theta g_n . r_n`` (a Jacobian-vector product; linear block:
  ``r_n x_n = p_{n+1} x_n^T x_n``, the term of eq. 8);
* ``rho_hat_n = d'/(2J) * ||P_{n+1} Delta_n^T||_F^2 / ||r_n||^2`` with ``P``, ``Delta`` the
  co-state and output change flattened per sample (``K x D``): for a linear block this is
  ``||p_{n+1}^T r_n x_n||_F^2 / ||r_n||_F^2`` of eq. 9;
* ``J_hat_n = G_{n+1}(g_n(x_n, theta_n + r_n / rho_hat_n))``: the rest of the network run on
  the block's output after the one-step update, from the cached ``x_n``. For a linear block
  ``g_n(x_n, theta_n + r_n/rho) = x_{n+1} + (1/rho) p_{n+1} x_n^T x_n`` -- eq. 8 exactly, and
  the loss after the update of Proposition 3.1.

How a block is run as a function of its parameters and tapped for its states and co-states:
:mod:`lalr_lightning.core.model.taps`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lalr_lightning.core.model.taps import BlockFn, BlockTaps

__all__ = [
    "BlockFn",
    "BlockScore",
    "HamiltonianTerm",
    "block_direction",
    "block_score",
    "block_scores",
    "choose_blocks",
    "hamiltonian",
    "hamiltonian_terms",
    "inner_optimizer",
    "linear_j_hat",
    "linear_rho_hat",
    "linear_rho_star",
    "maximize_hamiltonian",
    "mean_flat",
    "measurement_cost",
    "nonfinite_blocks",
    "output_change",
    "rho_hat",
    "select_smallest",
    "twice_differentiable",
]


# ============================================================================ paper formulas
# Deep linear network of sec. 3, the paper's layout: x_n is d_n x K (columns are samples),
# theta_n is d_{n+1} x d_n, p_{n+1} is d_{n+1} x K.


def linear_j_hat(x: Tensor, x_next: Tensor, p_next: Tensor, rho: float, rest: Callable[[Tensor], Tensor]) -> Tensor:
    """Eq. 8: ``G_{n+1}(x_{n+1} + (1/rho) p_{n+1} x_n^T x_n)`` (``rest`` is ``G_{n+1}``)."""
    return rest(x_next + (p_next @ (x.T @ x)) / rho)


def linear_rho_hat(x: Tensor, p_next: Tensor, loss: float | Tensor, out_dim: int) -> Tensor:
    """Eq. 9: ``d'/(2J) ||p^T r x||_F^2 / ||r||_F^2`` with ``r = p x^T``."""
    r = p_next @ x.T
    return out_dim / (2.0 * loss) * (p_next.T @ r @ x).square().sum() / r.square().sum()


def linear_rho_star(beta: Tensor, x: Tensor, p_next: Tensor) -> Tensor:
    """Eq. 12: ``||beta r x||_F^2 / ||r||_F^2`` -- the ``rho`` whose one-step update minimizes
    the squared loss; ``beta = theta_{N-1} ... theta_{n+1}`` (identity for the last layer)."""
    r = p_next @ x.T
    return (beta @ r @ x).square().sum() / r.square().sum()


# ============================================================================ generic metric


def _grads(out: Tensor, inputs: Sequence[Tensor], **kw) -> list[Tensor]:
    gs = torch.autograd.grad(out, list(inputs), allow_unused=True, **kw)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, inputs)]


def block_direction(block_fn: BlockFn, theta: Sequence[Tensor], p_next: Tensor) -> list[Tensor]:
    """``r = grad_theta [p_{n+1} . g(x_n, theta)]`` at ``theta``: the ascent direction of the
    block's Hamiltonian = minus the gradient of the loss w.r.t. the block's parameters."""
    th = [t.detach().requires_grad_(True) for t in theta]
    with torch.enable_grad():
        out = block_fn(th)
        h = (p_next.to(out.dtype) * out).sum()
        return [g.detach() for g in _grads(h, th)]


def twice_differentiable():
    """Attention through PyTorch's math kernel: the fused CPU/GPU kernels that
    ``scaled_dot_product_attention`` picks by default (Hugging Face's ``sdpa`` attention) have no
    double backward, which the Jacobian-vector product and E-MSA's terms need."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def output_change(block_fn: BlockFn, theta: Sequence[Tensor], direction: Sequence[Tensor]) -> Tensor:
    """``delta = J_theta g . direction``: how the block's output moves per unit step along
    ``direction`` (a Jacobian-vector product by the double-backward trick, so it works for any
    block autograd can differentiate twice)."""
    th = [t.detach().requires_grad_(True) for t in theta]
    with torch.enable_grad(), twice_differentiable():
        out = block_fn(th)
        u = torch.zeros_like(out, requires_grad=True)
        vjp = _grads(out, th, grad_outputs=u, create_graph=True)
        dot = sum((v * d.to(v.dtype)).sum() for v, d in zip(vjp, direction))
        if not dot.requires_grad:  # the output does not depend on theta
            return torch.zeros_like(out)
        (delta,) = _grads(dot, [u])
    return delta.detach()


def rho_hat(p_next: Tensor, delta: Tensor, direction: Sequence[Tensor], loss: float, out_dim: int) -> float:
    """Eq. 9 generalized: ``d'/(2J) ||P Delta^T||_F^2 / ||r||^2``.

    ``P`` and ``Delta`` are the co-state and the output change flattened per sample (``K x
    D``), so ``P Delta^T`` is the ``K x K`` matrix ``p^T r x`` of the paper. Returns ``inf``
    when nothing can be gained (``J = 0`` or ``r = 0``: no step is taken).
    """
    r2 = float(sum(d.double().square().sum() for d in direction))
    if r2 == 0.0 or loss == 0.0:
        return math.inf
    k = p_next.shape[0]
    m = p_next.reshape(k, -1).double() @ delta.reshape(k, -1).double().T
    return out_dim / (2.0 * float(loss)) * float(m.square().sum()) / r2


@dataclass
class BlockScore:
    """The L-MSA metric of one block on one batch."""

    j_hat: float  # loss after the one-step update (eq. 8)
    rho_hat: float  # eq. 9 (times rho_scale) -- or the given rho
    rgn: float  # ||r|| / ||theta||: relative gradient norm of the block (Auto-RGN's measure)
    direction_norm: float


def block_score(
    block_fn: BlockFn,
    theta: Sequence[Tensor],
    p_next: Tensor,
    loss_after: Callable[[list[Tensor]], float],
    loss: float,
    out_dim: int,
    *,
    rho: float | None = None,
    rho_scale: float = 1.0,
) -> BlockScore:
    """``J_hat_n`` of one block: the loss after the one-step update ``theta + r / rho``.

    ``loss_after(theta_new)`` runs the rest of the network (``G_{n+1}``) on the block's output
    computed with ``theta_new`` from the cached input. ``rho`` fixes the step (Proposition 3.1:
    ``J_hat`` is then exactly the loss after that update of a linear block); ``None`` uses
    ``rho_scale * rho_hat`` (eq. 9).
    """
    r = block_direction(block_fn, theta, p_next)
    rnorm = math.sqrt(float(sum(d.double().square().sum() for d in r)))
    tnorm = math.sqrt(float(sum(t.detach().double().square().sum() for t in theta)))
    rgn = rnorm / tnorm if tnorm > 0 else math.inf
    if rho is None:
        delta = output_change(block_fn, theta, r)
        used = rho_scale * rho_hat(p_next, delta, r, loss, out_dim)
    else:
        used = float(rho)
    if not math.isfinite(used) or rnorm == 0.0:
        return BlockScore(float(loss), used, rgn, rnorm)
    # the step's weights overwrite the direction (a gradient: the parameter's dtype), so each
    # block holds one block-sized tensor, not two
    new = [d.div_(used).add_(t.detach()) for t, d in zip(theta, r)]
    del r
    j = float(loss_after(new))
    if not math.isfinite(j):
        j = math.inf  # the step diverged: never select this block
    return BlockScore(j, used, rgn, rnorm)


def block_scores(taps: BlockTaps, names: Sequence[str], run: Callable[[], Tensor], loss: float, *,
                 output_dim: int | None = None, rho: float | None = None, rho_scale: float = 1.0,
                 check: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """``[J_hat, rho_hat, rgn]`` of every block ``names`` on the batch ``taps`` captured last
    (:func:`block_score`; ``run``: that batch's loss, ``loss`` its value). ``output_dim``: ``d'``
    of eq. 9, default the per-sample size of the last block's output."""
    out_dim = output_dim or int(taps.captures[names[-1]][-1].out[0].numel())
    out = {}
    for name in names:
        if check is not None:
            check()
        cap = taps.captures[name][-1]
        score = block_score(taps.block_fn(name, cap, run), taps.theta(name), cap.p,
                            lambda th, name=name, cap=cap: float(taps.loss_with(run, {name: th}, {name: cap})),
                            loss, out_dim, rho=rho, rho_scale=rho_scale)
        out[name] = [score.j_hat, score.rho_hat, score.rgn]
    return out


def select_smallest(scores: Mapping[str, float], k: int = 1) -> list[str]:
    """The ``k`` blocks with the smallest ``J_hat`` (ties: the earlier block), in block order."""
    names = list(scores)
    order = sorted(range(len(names)), key=lambda i: (scores[names[i]], i))
    chosen = set(order[:k])
    return [n for i, n in enumerate(names) if i in chosen]


def choose_blocks(scores: Mapping[str, float], select: str, k: int = 1) -> list[str]:
    """The blocks ``select`` picks from their ``J_hat``: every one (``"all"``) or the ``k``
    smallest (``"min"``); a RuntimeError when every block's ``J_hat`` is inf or NaN."""
    if all(not math.isfinite(v) for v in scores.values()):
        raise RuntimeError("LMSAStepper: every block's one-step update diverged (J_hat is inf/NaN for all); "
                           "raise rho_scale or set metric_rho")
    return list(scores) if select == "all" else select_smallest(scores, k)


# ============================================================================ Hamiltonian


@dataclass
class HamiltonianTerm:
    """One block on one (micro-)batch: ``p_{n+1} . g_n(x_n, theta)`` plus, optionally, E-MSA's
    feasibility terms. ``index`` picks the block's tensors out of the optimized parameters."""

    block_fn: BlockFn
    index: list[int]
    p_next: Tensor
    x_next: Tensor | None = None  # the state x_{n+1} seen in the forward (feasibility)
    x_in: Tensor | None = None  # the block's first input tensor x_n (feasibility)
    p_in: Tensor | None = None  # co-state of x_n, -dL/dx_n (feasibility)
    weight: float = 1.0


def hamiltonian(
    terms: Sequence[HamiltonianTerm],
    theta: Sequence[Tensor],
    anchor: Sequence[Tensor],
    rho: float,
    feasibility: float = 0.0,
) -> Tensor:
    """The augmented Hamiltonian (paper eq. 10, plus E-MSA's terms when ``feasibility > 0``):

    ``sum_terms w * [p_{n+1} . g(x_n, theta) - f/2 ||x_{n+1} - g(x_n, theta)||^2
    - f/2 ||p_n - grad_x (p_{n+1} . g(x_n, theta))||^2] - rho/2 ||theta - anchor||^2``.

    Both feasibility terms vanish at ``theta = anchor`` (the forward and backward pass that
    produced ``x_{n+1}``, ``p_n``); the second is dropped when ``p_n`` is unknown (the block's
    input does not require grad, e.g. the network input).
    """
    total = theta[0].new_zeros(())
    for term in terms:
        th = [theta[i] for i in term.index]
        use_x = feasibility > 0 and term.p_in is not None and term.x_in is not None
        if use_x:
            x = term.x_in.detach().requires_grad_(True)
            out = term.block_fn(th, x)
        else:
            out = term.block_fn(th)
        pg = (term.p_next.to(out.dtype) * out).sum()
        h = pg
        if feasibility > 0:
            if term.x_next is not None:
                h = h - feasibility / 2 * (term.x_next.to(out.dtype) - out).square().sum()
            if use_x:
                (gx,) = torch.autograd.grad(pg, x, create_graph=True)
                h = h - feasibility / 2 * (term.p_in.to(gx.dtype) - gx).square().sum()
        total = total + term.weight * h
    prox = sum((t - a).square().sum() for t, a in zip(theta, anchor))
    return total - rho / 2 * prox


def hamiltonian_terms(taps: BlockTaps, names: Sequence[str], loss_of: Callable[[object], Tensor]
                      ) -> tuple[list[nn.Parameter], list[HamiltonianTerm], list[tuple[str, Tensor]]] | None:
    """The parameters of the blocks ``names`` and a :class:`HamiltonianTerm` per block and
    captured micro-batch (weighted ``1 / micro-batches``), with ``(block, co-state all finite)``
    per term (a device flag, read later); None when there is nothing to maximize (no block, or a
    block captured nothing for this step). ``loss_of(context)`` is the loss of a captured batch
    (it runs the rest of the network)."""
    if not names or not all(taps.captures[n] for n in names):
        return None
    params: list[nn.Parameter] = []
    terms: list[HamiltonianTerm] = []
    finite: list[tuple[str, Tensor]] = []
    for name in names:
        caps = taps.captures[name]
        theta = taps.theta(name)
        index = list(range(len(params), len(params) + len(theta)))
        params.extend(theta)
        for cap in caps:
            finite.append((name, torch.isfinite(cap.p).all()))
            run = functools.partial(loss_of, cap.context)
            terms.append(HamiltonianTerm(taps.block_fn(name, cap, run), index, cap.p, x_next=cap.out, x_in=cap.x_in,
                                         p_in=cap.p_in, weight=1.0 / len(caps)))
    return params, terms, finite


def nonfinite_blocks(flags: Sequence[tuple[str, Tensor]]) -> list[str]:
    """The blocks of ``(block, all finite)`` device flags with a false one, sorted: one
    device-to-host read for all of them."""
    if not flags:
        return []
    ok = torch.stack([flag.to(flags[0][1].device) for _, flag in flags]).tolist()
    return sorted({name for (name, _), good in zip(flags, ok) if not good})


def mean_flat(grads: Sequence[Tensor], mean: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """``grads`` averaged by ``mean`` (across processes) as one flat tensor: one collective call."""
    flat = mean(torch.cat([g.reshape(-1) for g in grads]))
    return [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]


def inner_optimizer(spec: str | Callable, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer of the Hamiltonian maximization: ``"adam"``, ``"sgd"`` (at ``lr``) or the
    user's callable ``params -> Optimizer``."""
    if callable(spec):
        return spec(params)
    return (torch.optim.Adam if spec == "adam" else torch.optim.SGD)(params, lr=lr)


def measurement_cost(sizes: Mapping[str, int], n_batches: int, limit: int, head: str | None = None
                     ) -> tuple[str, bool]:
    """(the sentence saying what a measurement holds and runs, whether that is more than
    ``limit`` bytes) from the bytes of every block's states and co-states of a batch. Over the
    limit it says what helps: ``head=False`` when the largest is the ``head`` block (a language
    model's logits), else a smaller batch."""
    total = sum(sizes.values())
    big = max(sizes, key=sizes.get)
    text = (f"L-MSA: measuring holds the states and co-states of {len(sizes)} blocks, about {total / 2**20:.3g} MiB "
            f"per batch (the most: {big!r}, {sizes[big] / 2**20:.3g} MiB), and runs the model once per block and "
            f"batch ({len(sizes)} x n_batches={n_batches} forward passes per selection)")
    if total <= limit:
        return text, False
    if big == head:
        return text + ("; head=False leaves the head to the module's optimizer and its outputs (the logits) out of "
                       "the measurement"), True
    return text + "; a smaller batch holds less", True


def maximize_hamiltonian(
    terms: Sequence[HamiltonianTerm],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    rho: float,
    feasibility: float = 0.0,
    reduce_grads: Callable[[list[Tensor]], list[Tensor]] | None = None,
    check: Callable[[], None] | None = None,
    host: bool = True,
) -> list[float] | list[Tensor]:
    """``steps`` iterations of ``optimizer`` on ``-H`` (so ``H`` increases), anchored at the
    parameters' values on entry (``theta_m`` of eq. 10), ``x_n`` and ``p_{n+1}`` held fixed.

    Updates ``params`` in place. Their ``.grad`` is used as a scratch slot for the optimizer
    and restored afterwards, so the caller's gradients are untouched. ``reduce_grads`` averages
    the gradients across processes (DDP), keeping every rank's parameters identical. ``check``
    runs before every step and may raise to stop (a signal). Returns ``H`` before each step
    (``host=False``: as 0-d tensors on the device, so the update makes no device-to-host read).
    """
    anchor = [p.detach().clone() for p in params]
    saved = [p.grad for p in params]
    values: list[Tensor] = []
    try:
        for _ in range(steps):
            if check is not None:
                check()
            th = [p.detach().requires_grad_(True) for p in params]
            with torch.enable_grad(), (twice_differentiable() if feasibility > 0 else contextlib.nullcontext()):
                h = hamiltonian(terms, th, anchor, rho, feasibility)
                grads = _grads(-h, th)
            values.append(h.detach())
            if reduce_grads is not None:
                grads = reduce_grads(grads)
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype)
            optimizer.step()
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return torch.stack(values).tolist() if host and values else values
