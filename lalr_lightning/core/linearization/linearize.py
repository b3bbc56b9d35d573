"""Section 3's linearized fine-tuned model ``f_lin = f_0 + J_0 (theta - theta_0)`` by one
``torch.func.jvp``, and its gap to the fine-tuned model (:mod:`.ntk`'s docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import jvp

from lalr_lightning.core.linearization.model_calls import Inputs, _eval_math, _forward, _on, check_positions
from lalr_lightning.core.linearization.ntk_groups import _check_params

__all__ = [
    "LinearizationGap",
    "linearize",
    "linearization_gap",
]


def _deltas(params: Mapping[str, Tensor], anchor: Mapping[str, Tensor]) -> dict[str, Tensor]:
    missing = [n for n in params if n not in anchor]
    if missing:
        raise ValueError(f"the anchor has no value for {missing[0]!r}; it needs every parameter in params")
    out = {}
    for n, p in params.items():
        a = anchor[n]
        if a.shape != p.shape:
            raise ValueError(f"anchor[{n!r}] has shape {tuple(a.shape)} but the parameter has {tuple(p.shape)}")
        out[n] = p.detach() - a.detach().to(device=p.device, dtype=p.dtype)
    return out


def linearize(
    model: nn.Module,
    inputs: Inputs,
    anchor: Mapping[str, Tensor],
    params: Mapping[str, Tensor] | None = None,
    *,
    output_fn: Callable[[Any], Tensor] | None = None,
    positions: str = "all",
) -> tuple[Tensor, Tensor]:
    """``(f_theta(x), f_lin(x))``, ``f_lin(x) = f_{theta_0}(x) + J_{theta_0} (theta - theta_0)``.

    Section 3's linearized model (``bar f(x) = f_{theta_0}(x) + <grad f_{theta_0}(x),
    theta - theta_0>``), by one ``torch.func.jvp`` at ``theta_0 = anchor`` with tangent
    ``theta - theta_0``. ``params`` is ``theta`` (default: the current trainable parameters);
    ``anchor`` holds ``theta_0`` for the same names. Both outputs are ``[N, C]``; ``positions`` as
    in :func:`empirical_ntk`.
    """
    check_positions(positions)
    params = _check_params(model, params)
    delta = _deltas(params, anchor)
    inputs = _on(inputs, params)
    theta0 = {n: anchor[n].detach().to(device=params[n].device, dtype=params[n].dtype) for n in params}
    with _eval_math(model), torch.no_grad():
        f0, jd = jvp(lambda p: _forward(model, p, inputs, output_fn, positions), (theta0,), (delta,))
        f = _forward(model, params, inputs, output_fn, positions)
    return f, f0 + jd


@dataclass
class LinearizationGap:
    """``gap = ||f_theta(x*) - f_lin(x*)||_2`` over all ``N x C`` outputs (the paper's Table 1 row
    ``||f_{theta_t}(x*) - bar f_{theta_t}(x*)||_2``), and ``kl`` = mean over samples of
    ``KL(softmax f_theta || softmax f_lin)``."""

    gap: float
    kl: float


def linearization_gap(f: Tensor, f_lin: Tensor) -> LinearizationGap:
    """The gap and the KL divergence between the model and its linearization (see the class)."""
    if f.shape != f_lin.shape:
        raise ValueError(f"f and f_lin must have the same shape, got {tuple(f.shape)} and {tuple(f_lin.shape)}")
    f64, l64 = f.detach().double(), f_lin.detach().double()
    gap = float(torch.linalg.vector_norm(f64 - l64))
    f2, l2 = f64.reshape(f64.shape[0], -1), l64.reshape(l64.shape[0], -1)
    lp, lq = torch.log_softmax(f2, 1), torch.log_softmax(l2, 1)
    kl = float((lp.exp() * (lp - lq)).sum(1).mean())
    return LinearizationGap(gap=gap, kl=kl)
