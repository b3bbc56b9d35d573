"""Empirical NTK, its spectral quantities and the linearized model ("Linearization Explains Fine-Tuning in Large Language Models" (https://arxiv.org/abs/2602.08239)).

Pure ``torch.func``; no Lightning. Every function takes the model, a probe batch and the
parameters to differentiate as an ordered ``{name: tensor}`` mapping (raw
``named_parameters()`` names, so ``functional_call`` accepts them; default: the trainable
ones). Names refer to the paper ("Linearization explains fine-tuning", NeurIPS 2025):

* ``K = J J^T`` -- the empirical NTK Gram matrix on the probe batch ``x*``, ``J`` the Jacobian
  of the outputs w.r.t. the parameters at the given point (section 4, ``k(x_i, x_j) =
  grad f(x_i) grad f(x_j)^T``). Per-layer kernels ``S_l = J_l J_l^T`` (Theorem 6's
  ``[S_l]_ij = grad_{theta_l} f(x_i) grad_{theta_l} f(x_j)^T``), ``K = sum_l S_l``.
* ``kappa(K + sigma I) = (lambda_max(K) + sigma) / (lambda_min(K) + sigma)`` -- Theorem 5's
  at-initialization predictor of the fine-tuning risk.
* ``eta = ||K^{-1/2} S K^{-1/2}||_2`` -- Theorem 6's relative perturbation of the spectrum when
  a layer with kernel ``S`` joins the trained set with kernel ``K``; Theorem 7 bounds the risk
  change given ``kappa(K + sigma I) <= c``. :func:`greedy_ntk_selection` builds on both.
* ``f_lin(x) = f_{theta_0}(x) + J_{theta_0} (theta - theta_0)`` -- section 3's linearized
  fine-tuned model, by one ``torch.func.jvp``; the gap ``||f_theta(x*) - f_lin(x*)||_2`` and
  the KL divergence of their softmax outputs (the paper's Table 1 reports both).
* ``Lip(f) ~ ||J||_2`` by power iteration with JVP/VJP, and Theorem 4's guide
  ``lambda_o = 2 ||f_{theta_0}(x*) - y*|| Lip(f) / r``.

Outputs with ``C`` classes give three kernels (``mode``): ``"trace"`` (``N x N``,
``sum_c J_c J_c^T``: the class axis traced out, as neural-tangents' ``trace_axes``), ``"full"``
(``NC x NC``, row ``i*C + c`` is sample ``i``, class ``c``) and ``"sum"`` (``N x N``, the NTK
of the summed logit ``sum_c f_c``). For ``C = 1`` all three coincide.

The model is evaluated in ``eval()`` mode (restored afterwards): the NTK is a kernel only when
the outputs are deterministic and samples do not interact (dropout off, BatchNorm on its
running statistics). Attention runs on PyTorch's math SDPA kernel, because the fused CPU/GPU
kernels have no forward-mode derivative (``jvp``) or batching rule (``vmap``).

This module holds the kernel itself (:func:`empirical_ntk`, its cost and size); the parameter
groups are :mod:`.ntk_groups`', the model calls :mod:`.model_calls`', the spectra and the
selection :mod:`.ntk_spectra`', the linearized model :mod:`.linearize`', ``Lip(f)`` and
``lambda_o`` :mod:`.lambda_o`'s.
"""

from __future__ import annotations

import gc
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap

from lalr_lightning.choices import unknown
from lalr_lightning.core.linearization.anchor import trainable
from lalr_lightning.core.linearization.model_calls import (
    MODES,
    Inputs,
    _eval_math,
    _forward,
    _map,
    _num_samples,
    _on,
    _raw,
    _token_outputs,
    check_kernel,
    check_positions,
)
from lalr_lightning.core.linearization.ntk_groups import _check_groups, _check_params, layer_groups

__all__ = [
    "DEFAULT_ENTRIES",
    "NTK",
    "NTKCost",
    "ntk_cost",
    "check_outputs",
    "check_kernel_options",
    "trainable_groups",
    "sized_ntk",
    "projection",
    "empirical_ntk",
]


#: the Jacobian entries (samples x rows x parameters) the default output choice keeps J to
#: (:func:`ntk_cost`). A size, not a timing: the choice, and every number measured with it, is the
#: same on every machine, rank and rerun, whatever the load. 2**28 entries (1 GiB in fp32) give the
#: 0.7 M-parameter LM of benchmarks/any_module.py, 16 probe samples, 23 directions: about 1 s on 2
#: CPU cores (benchmarks/results/any_module.md)
DEFAULT_ENTRIES = 2**28


@dataclass
class NTK:
    """An empirical NTK on a probe batch.

    ``K``: ``M x M`` float64 (``M = N`` for ``trace``/``sum``, ``N*C`` for ``full``, row
    ``i*C + c``). ``S``: per-group kernels, same shape, ``sum(S.values()) == K`` (empty when no
    groups were given). ``num_outputs``: ``C`` of the model. ``projected``: the number of random
    directions the ``C`` outputs were projected onto (``None``: all outputs, exact).
    ``vectorized``: whether samples were vmapped (else looped); ``jacobian_blocks``: how many row
    blocks of ``J`` were computed (more than the number of blocks means recomputation under the
    memory bound).
    """

    K: Tensor
    S: dict[str, Tensor] = field(default_factory=dict)
    mode: str = "trace"
    num_samples: int = 0
    num_outputs: int = 1
    vectorized: bool = True
    jacobian_blocks: int = 1
    projected: int | None = None

    def ridge(self, fraction: float) -> float:
        """``sigma`` as ``fraction`` of the kernel's mean eigenvalue ``trace(K) / M``."""
        return fraction * float(torch.trace(self.K)) / self.K.shape[0]


@dataclass
class NTKCost:
    """What an :func:`empirical_ntk` call will compute (:func:`ntk_cost`): ``J`` has
    ``num_samples x rows_per_sample`` rows of ``num_params`` entries; ``outputs`` is what to pass
    as ``empirical_ntk(outputs=...)`` (``None``: every output, exact); ``seconds`` is the
    estimate from timing a few rows of one sample (for the log only: it follows the machine's
    load); ``budget`` the Jacobian entries the default keeps to."""

    num_samples: int
    num_outputs: int
    num_params: int
    outputs: int | None
    mode: str
    positions: str
    seconds: float
    budget: int
    tokens: bool = False  # the outputs are per token and were taken at the last one

    @property
    def rows_per_sample(self) -> int:
        if self.mode == "sum":
            return 1
        return self.num_outputs if self.outputs is None else self.outputs

    @property
    def entries(self) -> int:
        """Gradient entries of the Jacobian, ``N x rows x P``."""
        return self.num_samples * self.rows_per_sample * self.num_params

    @property
    def over_budget(self) -> bool:
        return self.entries > self.budget

    def describe(self) -> str:
        """One phrase: ``J: 16 samples x 5 random projections of 500 outputs at the last token x
        718,976 parameters = 5.8e+07 entries (0.21 GiB in fp32), about 9 s``."""
        rows = self.rows_per_sample
        if self.mode == "sum":
            what = "the summed output"
        elif rows < self.num_outputs:
            what = f"{rows} random projection{'s' if rows != 1 else ''} of {self.num_outputs} outputs"
        else:
            what = f"{self.num_outputs} outputs"
        where = " at the last token" if self.tokens else ""
        return (f"J: {self.num_samples} samples x {what}{where} x {self.num_params:,} parameters = {self.entries:.2g} "
                f"entries ({self.entries * 4 / 2**30:.2g} GiB in fp32), about {self.seconds:.2g} s")

    def report(self, who: str, asked: int | str | None) -> tuple[str, bool]:
        """(one line for the log, whether it is a warning): a warning when ``asked`` (the user's
        ``outputs``) takes ``J`` beyond the budget."""
        if asked is not None and self.over_budget:
            return (f"{who}(outputs={asked!r}): {self.describe()}, beyond the default's budget of {self.budget:.3g} "
                    "entries; outputs=None keeps it there", True)
        text = f"{who}: {self.describe()}"
        if self.outputs is not None and asked is None:
            text += (f"; the {self.num_outputs} outputs per sample are projected onto {self.outputs} random directions "
                     f"(an unbiased estimate of the trace kernel) to stay within {self.budget:.3g} entries; outputs='all' "
                     "measures every output, outputs=k more directions")
        return text, False


def check_outputs(outputs: int | str | None) -> int | str | None:
    if outputs is None or outputs == "all":
        return outputs
    if isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1:
        raise ValueError(f"outputs must be None (within the budget), 'all' or an integer >= 1, got {outputs!r}")
    return outputs


def check_kernel_options(kernel: str, positions: str,
                         outputs: int | str | None) -> tuple[str, str, int | str | None]:
    """``(kernel, positions, outputs)`` of an NTK callback checked, in that order
    (:func:`check_kernel`, :func:`check_positions`, :func:`check_outputs`)."""
    return check_kernel(kernel), check_positions(positions), check_outputs(outputs)


def trainable_groups(model: nn.Module, who: str) -> tuple[dict[str, nn.Parameter], dict[str, list[str]]]:
    """``(params, groups)``: the trainable parameters (:func:`~lalr_lightning.core.linearization.anchor.trainable`,
    a clear error when there is none) and their :func:`layer_groups`."""
    params = trainable(model, who)
    return params, layer_groups(model, params)


def ntk_cost(
    model: nn.Module,
    inputs: Inputs,
    params: Mapping[str, Tensor] | None = None,
    *,
    mode: str = "trace",
    positions: str = "all",
    outputs: int | str | None = None,
    entries: int | None = None,
    output_fn: Callable[[Any], Tensor] | None = None,
    max_jacobian_numel: int = 2**28,
    check: Callable[[], None] | None = None,
) -> NTKCost:
    """The size and time of ``J`` before computing it. The time is an estimate from timing the
    computation on one sample (one row until the runs stop getting faster, then the fastest of two
    runs of eight rows), for the log; the choice depends on sizes only.

    ``outputs``: ``None`` keeps every output while ``J`` stays within ``entries`` gradient entries
    (default :data:`DEFAULT_ENTRIES`) and otherwise (``trace`` mode) projects the ``C`` outputs onto
    as many random directions as fit, at least 1; ``"all"``: every output, whatever the size; an
    integer ``k``: ``k`` directions (all outputs when ``k >= C``). ``full`` and ``sum`` never
    project. The choice is made once per fit and stated by the callbacks.
    """
    if mode not in MODES:
        raise unknown("NTK mode", mode, MODES, show=repr)
    check_positions(positions)
    outputs = check_outputs(outputs)
    budget = DEFAULT_ENTRIES if entries is None else int(entries)
    params = _check_params(model, params)
    n = _num_samples(inputs)
    total = sum(t.numel() for t in params.values())
    inputs = _on(inputs, params)
    one = _map(inputs, lambda t: t[:1])
    with _eval_math(model), torch.no_grad():
        y = _raw(model, params, one, output_fn)
    tokens = positions == "last" and _token_outputs(y, one)
    c = (y[:, -1] if tokens else y).reshape(1, -1).shape[1]
    # the time, for the log: the real computation on one sample, after a first call that pays the
    # warm-up: one row (its forward, the call and one vmapped backward) and k rows, both taken
    # whole: t(rows) <= t(1) + rows * t(k) / k
    k = 1 if mode == "sum" else min(c, 8)
    run_mode = "sum" if mode == "sum" else "trace"

    def timed(rows: int) -> float:
        start = time.perf_counter()
        empirical_ntk(model, one, params, mode=run_mode, positions=positions, outputs=None if rows >= c else rows,
                      output_fn=output_fn, check=check)
        return time.perf_counter() - start

    # a cold process runs its first calls several times slower (kernel caches for new shapes):
    # repeat while the runs still get clearly faster (at most 6); then the fastest of two runs of
    # k rows, so that a load spike on a shared machine weighs less
    times = [timed(1), timed(1)]
    while len(times) < 6 and times[-1] < 0.7 * min(times[:-1]):
        times.append(timed(1))
    per_sample = min(times)
    per_row = min(timed(k), timed(k)) / k if k > 1 else per_sample
    # the memory bound splits J into blocks of classes (empirical_ntk's _blocks): each sample runs
    # its forward once per block, then one backward per row
    block = max(1, max_jacobian_numel // max(total, 1))

    def estimate(rows: int) -> float:
        per_block = max(1, block // n) if n <= block else 1
        return n * (math.ceil(rows / per_block) * per_sample + rows * per_row)

    if mode != "trace" or outputs == "all":
        chosen = None
    elif outputs is None:
        # the most rows per sample within the budget, and within one memory block of J per class
        # chunk (one forward per sample): sizes only, so every machine chooses the same
        fit = budget // max(n * total, 1)
        chosen = None if fit >= c else max(1, min(fit, block // n))
    else:
        chosen = outputs
    if chosen is not None and chosen >= c:
        chosen = None
    cost = NTKCost(n, c, total, chosen, mode, positions, 0.0, budget, tokens)
    cost.seconds = estimate(cost.rows_per_sample)
    return cost


def sized_ntk(
    model: nn.Module,
    inputs: Inputs,
    params: Mapping[str, Tensor],
    groups: Mapping[str, Sequence[str]],
    report: Callable[[str, bool], None],
    *,
    who: str,
    mode: str,
    positions: str,
    outputs: int | str | None,
    chosen: int | str | None = "unset",
    max_jacobian_numel: int = 2**28,
    check: Callable[[], None] | None = None,
) -> tuple[NTK, int | None]:
    """(:func:`empirical_ntk` over the outputs ``chosen``, the outputs used). ``chosen="unset"``:
    chosen now from ``outputs`` by :func:`ntk_cost`, whose line (:meth:`NTKCost.report` for
    ``who``) goes to ``report(text, is_warning)`` before ``J`` is computed."""
    if chosen == "unset":
        cost = ntk_cost(model, inputs, params, mode=mode, positions=positions, outputs=outputs,
                        max_jacobian_numel=max_jacobian_numel, check=check)
        report(*cost.report(who, outputs))
        chosen = cost.outputs
    k = empirical_ntk(model, inputs, params, groups, mode=mode, max_jacobian_numel=max_jacobian_numel,
                      positions=positions, outputs=chosen, check=check)
    return k, chosen


def projection(c: int, k: int, seed: int = 0) -> Tensor:
    """``C x k`` float64: ``k`` orthonormal random directions (QR of a Gaussian matrix drawn from
    ``seed``) scaled by ``sqrt(C / k)``, so ``E[R R^T] = I`` -- with less variance than Gaussian
    directions, and ``R R^T = I`` exactly at ``k = C``."""
    gen = torch.Generator().manual_seed(int(seed))
    q, _ = torch.linalg.qr(torch.randn(c, k, generator=gen, dtype=torch.float64))
    return q * math.sqrt(c / k)


#: models whose forward vmap could not batch (data-dependent control flow: Hugging Face attention
#: masks); they are looped over at once -- a failed vmap attempt costs seconds on a small LM
_LOOPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _blocks(n: int, c: int, rows: int) -> list[tuple[range, range]]:
    """Row blocks of J (samples x classes) with at most ``rows`` rows, class-chunk major."""
    if n * c <= rows:
        bs, bc = n, c
    elif n <= rows:
        bs, bc = n, max(1, rows // n)
    else:
        bs, bc = max(1, rows), 1
    return [(range(s, min(s + bs, n)), range(k, min(k + bc, c))) for k in range(0, c, bc) for s in range(0, n, bs)]


def empirical_ntk(
    model: nn.Module,
    inputs: Inputs,
    params: Mapping[str, Tensor] | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
    *,
    mode: str = "trace",
    output_fn: Callable[[Any], Tensor] | None = None,
    max_jacobian_numel: int = 2**28,
    vmap_chunk: int | None = None,
    vectorize: bool | None = None,
    positions: str = "all",
    outputs: int | None = None,
    seed: int = 0,
    check: Callable[[], None] | None = None,
) -> NTK:
    """The empirical NTK Gram matrix ``K = J J^T`` of ``model`` on ``inputs`` (and ``S_l``).

    Args:
        model: any ``nn.Module``; called as ``model(inputs)``, ``model(*inputs)`` or
            ``model(**inputs)``.
        inputs: the probe batch (tensor, tuple or dict of tensors, batch dimension 0).
        params: ``{name: tensor}`` to differentiate, at the values given (e.g. the anchor
            ``theta_0`` for the NTK at initialization); default: the trainable parameters at
            their current values. Parameters not listed keep the model's values.
        groups: ``{layer: [parameter names]}`` (see :func:`layer_groups`); each parameter in
            exactly one group. Gives ``S_l`` in the same pass.
        mode: ``"trace"``, ``"full"`` or ``"sum"`` (module docstring).
        output_fn: maps the model's output to the logits tensor (default: the tensor itself,
            ``.logits``, or the first element of a tuple).
        max_jacobian_numel: memory bound. ``J`` (``N*C`` rows of ``P`` entries) is computed in row
            blocks of at most ``max(1, max_jacobian_numel // P)`` rows; at most two blocks are
            alive, so the Jacobian takes at most ``2 * max(max_jacobian_numel, P)`` elements, plus
            the kernels (``(groups + 1) * M^2`` float64) and the model's activations for one
            vmapped backward (bounded by ``vmap_chunk``). When ``J`` fits in one block it is
            computed once; otherwise off-diagonal blocks are recomputed (``full`` mode: every
            pair of blocks; ``trace``/``sum``: pairs of sample chunks of one class chunk), which
            trades time for memory.
        vmap_chunk: samples per vmapped call, written into the block in place; default: as many
            as keep a call under 2**24 gradient entries.
        vectorize: ``True`` vmaps over samples, ``False`` loops over them (one forward each),
            ``None`` tries vmap and falls back to the loop when the model's forward has
            data-dependent control flow (Hugging Face attention masks). Same numbers either way.
        positions: ``"all"`` or ``"last"`` (token outputs at each sample's last real token,
            :func:`_forward`).
        outputs: ``trace`` mode only: project the ``C`` outputs onto ``k`` random directions,
            ``f(x) R`` with ``R`` = :func:`projection` ``(C, k, seed)`` (``E[R R^T] = I``, so the
            trace kernel of the projection is an unbiased estimate of the exact one); ``None``:
            every output. :func:`ntk_cost` chooses it.
        check: called between chunks of Jacobian rows (every few seconds of work at most); it
            may raise to stop the computation (a SIGTERM or Ctrl-C seen by the caller).
    """
    _check_ntk_args(mode, max_jacobian_numel, positions, outputs)
    params = _check_params(model, params)
    owner = _check_groups(groups, params) if groups is not None else {n: "" for n in params}
    n = _num_samples(inputs)
    total = sum(t.numel() for t in params.values())
    inputs = _on(inputs, params)
    with _eval_math(model):
        jac = _JacobianRows(model, params, inputs, output_fn, positions, mode, outputs, seed, vmap_chunk, vectorize,
                            check)
        kernels = _Kernels(owner, jac.names, n, jac.c, mode, jac.dev)
        computed = kernels.accumulate(jac, _blocks(n, jac.c, max(1, max_jacobian_numel // max(total, 1))))
    kern = kernels.kern
    K = sum(kern.values()) if groups is not None else kern[""]
    K = (K + K.T) / 2  # exact symmetry; the blocks are symmetric up to rounding
    S = {g: (v + v.T) / 2 for g, v in kern.items()} if groups is not None else {}
    return NTK(K=K, S=S, mode=mode, num_samples=n, num_outputs=jac.c_model, vectorized=jac.vectorize is not False,
               jacobian_blocks=computed, projected=None if jac.proj is None else jac.proj.shape[1])


def _check_ntk_args(mode: str, max_jacobian_numel: int, positions: str, outputs: int | None) -> None:
    if mode not in MODES:
        raise unknown("NTK mode", mode, MODES, show=repr)
    if max_jacobian_numel < 1:
        raise ValueError(f"max_jacobian_numel must be >= 1, got {max_jacobian_numel}")
    check_positions(positions)
    if outputs is not None and (isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 1):
        raise ValueError(f"outputs must be None (every output) or an integer >= 1, got {outputs!r}")
    if outputs is not None and mode != "trace":
        raise ValueError(f"outputs={outputs} projects the outputs of the 'trace' kernel; mode={mode!r} uses every "
                         "output (drop outputs or use mode='trace')")


def _vmap_unsupported(err: Exception) -> bool:
    """The error vmap raises for a forward it cannot batch (data-dependent control flow)."""
    msg = str(err).lower()
    return "vmap" in msg or "batching rule" in msg


class _JacobianRows:
    """Blocks of rows of ``J`` for :func:`empirical_ntk`: the gradients of some (sample, class)
    outputs w.r.t. the parameters, by ``vmap`` over chunks of samples, or one sample at a time for
    a forward that ``vmap`` cannot batch. Built inside ``_eval_math``: it runs the model once on
    the first sample to learn the number of outputs ``C`` (``c_model``; ``c`` after the projection
    or the ``sum`` mode)."""

    def __init__(self, model: nn.Module, params: dict[str, Tensor], inputs: Inputs,
                 output_fn: Callable[[Any], Tensor] | None, positions: str, mode: str, outputs: int | None,
                 seed: int, vmap_chunk: int | None, vectorize: bool | None, check: Callable[[], None] | None):
        self.model, self.params, self.inputs = model, params, inputs
        self.output_fn, self.positions, self.mode = output_fn, positions, mode
        self.names = list(params)
        self.dev = next(iter(params.values())).device
        self.check = check or (lambda: None)
        with torch.no_grad():
            probe = _forward(model, params, _map(inputs, lambda t: t[:1]), output_fn, positions)
        self.c_model, self.out_dtype = probe.shape[1], probe.dtype
        self.proj = None
        if outputs is not None and outputs < self.c_model:
            self.proj = projection(self.c_model, outputs, seed).to(device=self.dev, dtype=self.out_dtype)
        self.c = 1 if mode == "sum" else self.c_model if self.proj is None else self.proj.shape[1]
        self.vectorize = False if vectorize is None and model in _LOOPED else vectorize
        # samples per vmapped call: ``vmap_chunk``, else at most 2**24 gradient entries (a second or
        # so of work), so that ``check`` runs often enough to stop on a signal
        total = sum(t.numel() for t in params.values())
        self.step = vmap_chunk or max(1, 2**24 // max(self.c * total, 1))

    def outputs_of(self, p: Mapping[str, Tensor], x: Inputs) -> Tensor:
        y = _forward(self.model, p, x, self.output_fn, self.positions)
        if self.proj is not None:
            y = y @ self.proj
        return y.sum(1, keepdim=True) if self.mode == "sum" else y

    def rows_one(self, p: dict[str, Tensor], xi: Inputs, basis: Tensor) -> dict[str, Tensor]:
        """Gradients of the ``basis`` classes of one sample: ``{name: [k, *shape]}``."""
        _, pull = vjp(lambda q: self.outputs_of(q, _map(xi, lambda t: t.unsqueeze(0)))[0], p)
        if basis.shape[0] == 1:
            return {k: v.unsqueeze(0) for k, v in pull(basis[0])[0].items()}
        return vmap(pull)(basis)[0]

    def block(self, samples: range, classes: range) -> dict[str, Tensor]:
        """``{name: [len(samples), len(classes), *shape]}``, filled chunk by chunk in place."""
        basis = torch.zeros(len(classes), self.c, device=self.dev, dtype=self.out_dtype)
        basis[torch.arange(len(classes)), torch.tensor(list(classes))] = 1
        xb = _map(self.inputs, lambda t: t[samples.start : samples.stop])
        out: dict[str, Tensor] = {}
        at = self._vmapped(xb, basis, out, len(samples))
        for i in range(at, len(samples)):
            self.check()
            rows = self.rows_one(self.params, _map(xb, lambda t, i=i: t[i]), basis)
            self._put(out, i, {k: v.unsqueeze(0) for k, v in rows.items()}, 1, len(samples))
        return out

    def _vmapped(self, xb: Inputs, basis: Tensor, out: dict[str, Tensor], n: int) -> int:
        """Fill ``out`` by vmapped chunks of samples while ``vmap`` works; the first sample left."""
        at = 0
        while self.vectorize is not False and at < n:
            self.check()
            count = min(self.step, n - at)
            try:
                chunk = _map(xb, lambda t, at=at, count=count: t[at : at + count])
                self._put(out, at, vmap(self.rows_one, in_dims=(None, 0, None))(self.params, chunk, basis), count, n)
                self.vectorize = True
                at += count
            except (RuntimeError, NotImplementedError) as err:
                if self.vectorize is True or not _vmap_unsupported(err):
                    raise
                self.vectorize = False  # data-dependent forward: loop over samples
                _LOOPED[self.model] = True
            if self.vectorize is False:
                # the failed vmap leaves reference cycles (through its traceback) that keep
                # functorch's state alive and slow every later op down ~100x until collected
                gc.collect()
        return at

    def _put(self, out: dict[str, Tensor], at: int, rows: dict[str, Tensor], count: int, n: int) -> None:
        if count == n:
            out.update(rows)  # one chunk: no copy
            return
        for k in self.names:
            if k not in out:
                out[k] = rows[k].new_empty((n, *rows[k].shape[1:]))
            out[k][at : at + count] = rows[k]


class _Kernels:
    """The float64 Gram matrices of :func:`empirical_ntk`, one per group (``""``: every parameter),
    summed block pair by block pair of Jacobian rows."""

    def __init__(self, owner: Mapping[str, str], names: list[str], n: int, c: int, mode: str, dev: torch.device):
        self.owner, self.names, self.c, self.mode, self.dev = owner, names, c, mode, dev
        m = n * c if mode == "full" else n
        self.kern = {g: torch.zeros(m, m, dtype=torch.float64, device=dev) for g in dict.fromkeys(owner.values())}

    def accumulate(self, jac: _JacobianRows, blocks: list[tuple[range, range]]) -> int:
        """Every pair of blocks that meets in the kernel; the number of Jacobian blocks computed."""
        computed = 0
        for i, a in enumerate(blocks):
            ja = jac.block(*a)
            computed += 1
            self.contract(ja, ja, a, a)
            for b in blocks[i + 1 :]:
                if self.mode != "full" and b[1] != a[1]:
                    continue  # trace/sum: different class chunks never meet
                self.contract(ja, jac.block(*b), a, b)
                computed += 1
            del ja
        return computed

    def index(self, samples: range, classes: range) -> Tensor:
        s = torch.arange(samples.start, samples.stop, device=self.dev)
        if self.mode != "full":
            return s
        k = torch.arange(classes.start, classes.stop, device=self.dev)
        return (s[:, None] * self.c + k[None, :]).reshape(-1)

    def contract(self, ja: dict[str, Tensor], jb: dict[str, Tensor], a: tuple[range, range],
                 b: tuple[range, range]) -> None:
        ia, ib = self.index(*a), self.index(*b)
        for name in self.names:
            x, y = ja[name], jb[name]
            ct = torch.promote_types(x.dtype, torch.float32)
            if self.mode == "full":  # rows (sample, class), columns the tensor's entries
                xa, yb = x.reshape(x.shape[0] * x.shape[1], -1), y.reshape(y.shape[0] * y.shape[1], -1)
            else:  # rows samples; the class axis is summed with the entries (trace)
                xa, yb = x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1)
            g = (xa.to(ct) @ yb.to(ct).T).to(torch.float64)
            self.kern[self.owner[name]][ia[:, None], ib[None, :]] += g
            if a != b:
                self.kern[self.owner[name]][ib[:, None], ia[None, :]] += g.T
