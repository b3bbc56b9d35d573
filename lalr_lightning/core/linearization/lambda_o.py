"""``Lip(f) ~ ||J||_2`` by power iteration with JVP/VJP, and Theorem 4's guide
``lambda_o = 2 ||f_{theta_0}(x*) - y*|| Lip(f) / r`` (:mod:`.ntk`'s docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp, vjp

from lalr_lightning.choices import unknown
from lalr_lightning.core.linearization.model_calls import (
    Inputs,
    _default_output,
    _eval_math,
    _forward,
    _num_samples,
    _on,
    check_positions,
)
from lalr_lightning.core.linearization.ntk_groups import _check_params
from lalr_lightning.core.model.batch_loss import batch_loss, forward_module, split_batch
from lalr_lightning.core.model.taps import call_with_params

__all__ = [
    "jacobian_spectral_norm",
    "lambda_o",
    "estimate_lambda_o",
    "unit_lambda_o",
    "output_gradient_norm",
]


def jacobian_spectral_norm(
    model: nn.Module,
    inputs: Inputs,
    params: Mapping[str, Tensor] | None = None,
    *,
    iters: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    output_fn: Callable[[Any], Tensor] | None = None,
    positions: str = "all",
    check: Callable[[], None] | None = None,
) -> float:
    """``||J||_2``: the largest singular value of the Jacobian of the stacked outputs
    ``f(x*) in R^{N C}`` w.r.t. ``params``, by power iteration on ``J^T J`` (one ``jvp`` and one
    ``vjp`` per iteration; ``J`` is never formed). ``||J||_2^2 = lambda_max`` of the ``full``
    NTK.

    This is the local Lipschitz constant of ``theta -> f_theta(x*)`` at ``params``; the
    paper's ``Lip(f)`` is its supremum over the ``r``-ball around ``theta_0``, which no probe
    can compute, so this is the estimate. Stops when the estimate changes by less than
    ``tol`` (relative) or after ``iters`` iterations; ``seed`` fixes the start vector so
    every rank gets the same number. ``positions`` as in :func:`empirical_ntk`; ``check`` is
    called before every iteration and may raise to stop.
    """
    check_positions(positions)
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    params = _check_params(model, params)
    inputs = _on(inputs, params)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    v = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64).to(device=p.device, dtype=p.dtype)
         for n, p in params.items()}

    def norm(d: Mapping[str, Tensor]) -> Tensor:
        return torch.sqrt(sum((t.double() ** 2).sum() for t in d.values()))

    sig = 0.0
    with _eval_math(model), torch.no_grad():
        f = lambda p: _forward(model, p, inputs, output_fn, positions)  # noqa: E731
        _, pull = vjp(f, params)
        nv = norm(v)
        v = {n: t / nv.to(t.dtype) for n, t in v.items()}
        for _ in range(iters):
            if check is not None:
                check()
            _, u = jvp(f, (params,), (v,))
            new = float(torch.linalg.vector_norm(u.double()))
            w = pull(u)[0]
            nw = norm(w)
            if float(nw) == 0:
                return 0.0
            v = {n: t / nw.to(t.dtype) for n, t in w.items()}
            if abs(new - sig) <= tol * max(new, 1e-30):
                return new
            sig = new
    return sig


def lambda_o(residual_norm: float, lip: float, r: float) -> float:
    """Theorem 4's threshold ``lambda_o = 2 ||f_{theta_0}(x*) - y*|| Lip(f) / r``.

    With ``lambda >= lambda_o`` the regularized flow stays in the ``r``-ball around
    ``theta_0`` for all time (Theorem 2), so the linearization bound of Theorem 3 holds.
    """
    for name, val in (("residual_norm", residual_norm), ("lip", lip)):
        if not math.isfinite(val) or val < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {val}")
    if not math.isfinite(r) or r <= 0:
        raise ValueError(f"r (the radius around theta_0) must be finite and > 0, got {r}")
    return 2.0 * residual_norm * lip / r


def estimate_lambda_o(
    model: nn.Module,
    inputs: Inputs,
    targets: Tensor | None,
    r: float,
    params: Mapping[str, Tensor] | None = None,
    *,
    reduction: str = "mean",
    output_fn: Callable[[Any], Tensor] | None = None,
    iters: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    loss: Callable[[], Tensor] | None = None,
    check: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Theorem 4's ``lambda_o`` on a probe batch: ``{"lambda_o", "residual_norm", "lip"}``.

    ``residual_norm = ||f(x*) - y*||_2`` over the batch, with ``y*`` one-hot for integer class
    targets (the squared loss of the paper on the logits) or ``targets`` itself when it has the
    outputs' shape; ``lip = ||J||_2`` (:func:`jacobian_spectral_norm`). Both are evaluated at
    ``params`` -- Theorem 4 states them at ``theta_0``, so pass the anchor for the paper's
    quantity, or the current weights for a running estimate.

    ``reduction="sum"`` is the theorem verbatim for the sum-of-squares loss ``R~`` over these
    ``N`` samples. ``"mean"`` (default) divides by ``N``: it is the threshold for a loss
    *averaged* over samples, the way trainers reduce it (rescaling the loss by ``1/N`` rescales
    the gradient-flow time, so the equivalent ``lambda`` is ``lambda / N``), and it does not
    grow with the probe size, so it compares with the ``lam`` a proximal callback uses.

    ``loss`` (a no-argument callable running the model on these inputs and returning the scalar
    loss, a batch mean, as the module trains with it): for models trained on another loss than a
    squared one on class scores -- a language model's token cross-entropy -- the residual is that
    loss's gradient with respect to the outputs, ``residual_norm = N ||dL/df||``
    (:func:`output_gradient_norm`; for ``L = ||f - y||^2 / (2N)`` it is ``||f - y||`` again);
    ``targets`` is then not used. ``check`` as in :func:`jacobian_spectral_norm`.
    """
    if reduction not in ("mean", "sum"):
        raise unknown("reduction", reduction, ("mean", "sum"), show=repr)
    params = _check_params(model, params)
    inputs = _on(inputs, params)
    if loss is not None:
        n = _num_samples(inputs)
        res = n * output_gradient_norm(model, loss, params, output_fn=output_fn)
        lip = jacobian_spectral_norm(model, inputs, params, iters=iters, tol=tol, seed=seed, output_fn=output_fn,
                                     check=check)
        lam = lambda_o(res, lip, r)
        return {"lambda_o": lam / n if reduction == "mean" else lam, "residual_norm": res, "lip": lip}
    if targets is None:
        raise ValueError("estimate_lambda_o needs the targets of the probe batch, or loss=<the batch loss>")
    with _eval_math(model), torch.no_grad():
        f = _forward(model, params, inputs, output_fn)
    n, c = f.shape
    if targets.shape[0] != n:
        raise ValueError(f"targets has {targets.shape[0]} rows but the batch has {n} samples")
    if not targets.is_floating_point():
        if targets.ndim != 1:
            raise ValueError(f"integer targets must be class indices of shape [N], got {tuple(targets.shape)}")
        if int(targets.min()) < 0 or int(targets.max()) >= c:
            raise ValueError(f"class targets must lie in [0, {c}), got [{int(targets.min())}, {int(targets.max())}]")
        y = torch.nn.functional.one_hot(targets.to(f.device).long(), c).to(f.dtype)
    else:
        y = targets.to(device=f.device, dtype=f.dtype).reshape(n, -1)
        if y.shape != f.shape:
            raise ValueError(f"float targets must match the outputs' shape {tuple(f.shape)}, got {tuple(targets.shape)}")
    res = float(torch.linalg.vector_norm((f - y).double()))
    lip = jacobian_spectral_norm(model, inputs, params, iters=iters, tol=tol, seed=seed, output_fn=output_fn,
                                 check=check)
    lam = lambda_o(res, lip, r)
    return {"lambda_o": lam / n if reduction == "mean" else lam, "residual_norm": res, "lip": lip}


def unit_lambda_o(model: nn.Module, batch: Any, theta0: Mapping[str, Tensor],
                  loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
                  check: Callable[[], None] | None = None) -> tuple[float, bool]:
    """(``lambda_o`` at ``r = 1`` and ``theta0`` on a probe ``batch``, whether its residual came from
    the module's own loss). The paper's squared loss reads class-index targets ``[N]`` or float
    targets; for any other (token labels, no targets) or a given ``loss_fn`` the residual is
    ``N ||dL/df||`` of the module's loss (:func:`estimate_lambda_o`'s ``loss``)."""
    x, y = split_batch(model, batch)
    if loss_fn is None and isinstance(y, Tensor) and (y.is_floating_point() or y.ndim == 1):
        return estimate_lambda_o(model, x, y, 1.0, theta0, check=check)["lambda_o"], False
    loss = lambda: batch_loss(model, batch, loss_fn)  # noqa: E731
    return estimate_lambda_o(model, x, None, 1.0, theta0, check=check, loss=loss)["lambda_o"], True


def output_gradient_norm(
    model: nn.Module,
    loss: Callable[[], Tensor],
    params: Mapping[str, Tensor] | None = None,
    *,
    output_fn: Callable[[Any], Tensor] | None = None,
) -> float:
    """``||dL/df||_2``: the gradient of the scalar ``loss()`` (which runs ``model``, e.g. the
    module's own training step) with respect to the outputs ``f`` of the model's forward
    (:func:`~lalr_lightning.core.model.batch_loss.forward_module`; ``output_fn`` or ``.logits`` of its
    output), at ``params``, in eval mode."""
    params = _check_params(model, params)
    target = forward_module(model)
    seen: list[Tensor] = []

    def grab(_module, _args, out):
        y = (output_fn or _default_output)(out)
        if y.requires_grad:
            seen.append(y)

    handle = target.register_forward_hook(grab)
    try:
        with _eval_math(model), torch.enable_grad():
            theta = {n: p.detach().requires_grad_(True) for n, p in params.items()}
            value = call_with_params(model, theta, loss)
            if not seen:
                raise RuntimeError(f"the loss did not run {type(target).__name__} (the model's forward) with "
                                   "gradients, so dL/df is unknown; pass loss_fn=f computing the loss from its outputs")
            if len(seen) > 1:
                raise RuntimeError(f"the loss ran {type(target).__name__} {len(seen)} times; dL/df needs one output "
                                   "per batch: pass loss_fn=f computing the loss from one forward pass")
            (g,) = torch.autograd.grad(value, seen[0])
    finally:
        handle.remove()
    return float(torch.linalg.vector_norm(g.double()))
