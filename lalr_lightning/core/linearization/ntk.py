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
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap

from lalr_lightning.choices import unknown
from lalr_lightning.core.linearization.anchor import trainable
from lalr_lightning.core.model.batch_loss import batch_loss, call_model, forward_module, output_tensor, split_batch
from lalr_lightning.core.model.layers import Layer, clean_name, matrix_layers, output_layer
from lalr_lightning.core.model.taps import call_with_params

__all__ = [
    "MODES",
    "POSITIONS",
    "DEFAULT_ENTRIES",
    "NTK",
    "NTKCost",
    "ntk_cost",
    "check_outputs",
    "check_kernel_options",
    "trainable_groups",
    "check_positions",
    "check_kernel",
    "sized_ntk",
    "projection",
    "NTKSelection",
    "LinearizationGap",
    "trainable_parameters",
    "layer_groups",
    "matching_groups",
    "group_layers",
    "head_group",
    "selectable_head",
    "empirical_ntk",
    "condition_number",
    "eta",
    "layer_etas",
    "greedy_ntk_selection",
    "head_selection",
    "linearize",
    "linearization_gap",
    "jacobian_spectral_norm",
    "lambda_o",
    "estimate_lambda_o",
    "unit_lambda_o",
    "output_gradient_norm",
]

MODES = ("trace", "full", "sum")
#: which positions of token outputs ``[N, T, V]`` count as outputs: every one, or each sample's last
#: real token (the next-token prediction at the end of the sequence)
POSITIONS = ("all", "last")
#: the Jacobian entries (samples x rows x parameters) the default output choice keeps J to
#: (:func:`ntk_cost`). A size, not a timing: the choice, and every number measured with it, is the
#: same on every machine, rank and rerun, whatever the load. 2**28 entries (1 GiB in fp32) give the
#: 0.7 M-parameter LM of benchmarks/any_module.py, 16 probe samples, 23 directions: about 1 s on 2
#: CPU cores (benchmarks/results/any_module.md)
DEFAULT_ENTRIES = 2**28

Inputs = Tensor | Sequence[Tensor] | Mapping[str, Tensor]


# --------------------------------------------------------------------------- parameters


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """``{name: parameter}`` of the parameters with ``requires_grad``, in registration order.

    Names are the raw ``named_parameters()`` names (what ``functional_call`` expects); values are
    detached views, so the functions here never build autograd graphs into the live model.
    """
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (all requires_grad=False); unfreeze the "
            "layers to analyse or pass params={name: tensor} explicitly"
        )
    return params


# peft adapter parts that belong to the module they adapt: lora_A/lora_B of `query` are one layer
_PEFT_PART = re.compile(
    r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.[^.]+)?(\.(weight|bias))?$"
)
_PEFT_SAVED = re.compile(r"\.modules_to_save\.[^.]+")


def _layer_key(name: str) -> str:
    """``...query.lora_A.default`` -> ``...query``; ``classifier.modules_to_save.default`` -> ``classifier``."""
    name = _PEFT_SAVED.sub("", clean_name(name))
    return _PEFT_PART.sub("", name)


def layer_groups(
    model: nn.Module,
    params: Mapping[str, Tensor] | None = None,
    layers: Sequence[Layer] | None = None,
) -> dict[str, list[str]]:
    """``{layer name: [parameter names]}`` covering every parameter of ``params`` exactly once.

    Layers come from ``layers`` (default :func:`~lalr_lightning.core.model.layers.matrix_layers`: one
    weight matrix with its bias and tied norm), restricted to the parameters in ``params``
    (default: the trainable ones); layers with none of them are dropped. A peft LoRA pair
    (``lora_A``/``lora_B`` of one module, also DoRA's magnitude and embedding adapters) is one
    layer named after the adapted module; ``modules_to_save`` copies are named after the
    original module. Parameters that no layer owns (an untied LayerNorm, a bare
    ``nn.Parameter``) form one group per owning module, so ``sum_l S_l = K`` always holds.
    """
    params = trainable_parameters(model) if params is None else params
    layers = matrix_layers(model) if layers is None else layers
    wanted = set(params)
    # parameters are matched by identity; the mapping's values may be detached views of them
    by_id = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in wanted:
            by_id[id(p)] = n
    groups: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for layer in layers:
        key = _layer_key(layer.name)
        for p in layer.params.values():
            raw = by_id.get(id(p))
            if raw is None or raw in owner:
                continue
            groups.setdefault(key, []).append(raw)
            owner[raw] = key
    for raw in params:
        if raw not in owner:
            module = raw.rsplit(".", 1)[0] if "." in raw else raw
            key = _layer_key(module) or raw
            groups.setdefault(key, []).append(raw)
            owner[raw] = key
    # order groups and their members as the parameters are ordered
    order = {n: i for i, n in enumerate(params)}
    out = {k: sorted(v, key=order.__getitem__) for k, v in groups.items()}
    return dict(sorted(out.items(), key=lambda kv: order[kv[1][0]]))


def matching_groups(groups: Mapping[str, list[str]], include: Sequence[str] | None) -> dict[str, list[str]]:
    """The groups whose layer name matches one of the glob patterns ``include`` (all when None); a
    ValueError for a pattern that matches none."""
    if include is None:
        return dict(groups)
    for pat in include:
        if not any(fnmatchcase(g, pat) for g in groups):
            raise ValueError(f"include pattern {pat!r} matches no trainable layer; layers are: {list(groups)}")
    return {g: m for g, m in groups.items() if any(fnmatchcase(g, pat) for pat in include)}


def group_layers(groups: Mapping[str, Sequence[str]], params: Mapping[str, Tensor]) -> list[Layer]:
    """One :class:`~lalr_lightning.core.model.layers.Layer` per group, holding its parameters."""
    return [Layer(name=g, kind="layer", module=None, params={n: params[n] for n in members})
            for g, members in groups.items()]


def head_group(model: nn.Module, groups: Mapping[str, Sequence[str]], trace: Callable[[], Any] | None = None
               ) -> str | None:
    """The group holding the model's output layer (peft's trainable ``modules_to_save`` copy
    included; ``trace``: :func:`~lalr_lightning.core.model.layers.output_layer`'s), or None."""
    out = output_layer(model, trace=trace)
    if out is None:
        return None
    ids = {id(p) for p in out.params.values()}
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
    return next((g for g, members in groups.items() if names & set(members)), None)


def selectable_head(model: nn.Module, groups: Mapping[str, Sequence[str]], head: bool,
                    trace: Callable[[], Any] | None = None) -> str | None:
    """NTKSelect's head group (:func:`head_group`; None without ``head``), or a ValueError where the
    groups leave nothing to select between."""
    name = type(model).__name__
    if len(groups) < 2:
        raise ValueError(f"{name} has one trainable layer ({list(groups)}); there is nothing to select between")
    if not head:
        return None
    found = head_group(model, groups, trace)
    if found is None:
        raise ValueError(f"NTKSelect(head=True): no trainable output layer found in {name} (its classifier is frozen "
                         "or not recognised); use head=False to rank every layer")
    if len(groups) < 3:
        raise ValueError(f"{name} has one trainable layer besides the head; there is nothing to select between "
                         "(head=False ranks the head too)")
    return found


def _check_params(model: nn.Module, params: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
    if params is None:
        return trainable_parameters(model)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for n, t in params.items():
        if n not in names:
            close = [m for m in names if m.endswith(n.rsplit(".", 1)[-1])][:3]
            raise ValueError(
                f"parameter {n!r} is not a parameter of {type(model).__name__}; use model.named_parameters() "
                f"names (e.g. {close or sorted(names)[:3]})"
            )
        if not isinstance(t, Tensor):
            raise TypeError(f"params[{n!r}] must be a tensor, got {type(t).__name__}")
    if not params:
        raise ValueError("params is empty: pass at least one parameter to differentiate")
    return {n: t.detach() for n, t in params.items()}


def _check_groups(groups: Mapping[str, Sequence[str]], params: Mapping[str, Tensor]) -> dict[str, str]:
    """tensor name -> group name; every parameter in exactly one group."""
    owner: dict[str, str] = {}
    for g, names in groups.items():
        for n in names:
            if n not in params:
                raise ValueError(f"group {g!r} lists {n!r}, which is not among the parameters being differentiated")
            if n in owner:
                raise ValueError(f"parameter {n!r} is in two groups ({owner[n]!r} and {g!r}); each belongs to one")
            owner[n] = g
    missing = [n for n in params if n not in owner]
    if missing:
        raise ValueError(
            f"{len(missing)} parameters are in no group (first: {missing[0]!r}), so sum_l S_l would miss part of K; "
            "build the groups with layer_groups(model, params) or restrict params to the grouped ones"
        )
    return owner


# --------------------------------------------------------------------------- model calls


@contextlib.contextmanager
def _eval_math(model: nn.Module) -> Iterator[None]:
    """eval() mode (restored per module afterwards) and the math attention kernel; PyTorch's own
    transformer layers off their fused eval path (``_transformer_encoder_layer_fwd`` has no
    forward-mode derivative, so ``jvp`` through an ``nn.TransformerEncoderLayer`` would fail)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    mha = getattr(torch.backends, "mha", None)
    fast = mha.get_fastpath_enabled() if mha is not None else None
    if fast:
        mha.set_fastpath_enabled(False)
    try:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel([SDPBackend.MATH])
        except ImportError:  # pragma: no cover - older torch
            ctx = contextlib.nullcontext()
        with ctx:
            yield
    finally:
        if fast:
            mha.set_fastpath_enabled(True)
        for m, t in modes:
            m.training = t


def _num_samples(inputs: Inputs) -> int:
    leaves = _leaves(inputs)
    if not leaves:
        raise ValueError("inputs hold no tensor; pass the probe batch as a tensor, a tuple or a dict of tensors")
    n = leaves[0].shape[0] if leaves[0].ndim else None
    for t in leaves:
        if t.ndim == 0 or t.shape[0] != n:
            raise ValueError(
                f"every input tensor needs the same batch dimension 0; got shapes {[tuple(x.shape) for x in leaves]}"
            )
    return int(n)


def _leaves(inputs: Inputs) -> list[Tensor]:
    if isinstance(inputs, Tensor):
        return [inputs]
    if isinstance(inputs, Mapping):
        vals = list(inputs.values())
    elif isinstance(inputs, (list, tuple)):
        vals = list(inputs)
    else:
        raise TypeError(f"inputs must be a tensor, a tuple/list or a dict of tensors, got {type(inputs).__name__}")
    for v in vals:
        if not isinstance(v, Tensor):
            raise TypeError(f"inputs must hold tensors only (batch dimension 0), got a {type(v).__name__}")
    return vals


def _map(inputs: Inputs, fn: Callable[[Tensor], Tensor]) -> Inputs:
    if isinstance(inputs, Tensor):
        return fn(inputs)
    if isinstance(inputs, Mapping):
        return {k: fn(v) for k, v in inputs.items()}
    return type(inputs)(fn(v) for v in inputs) if isinstance(inputs, tuple) else [fn(v) for v in inputs]


def _on(inputs: Inputs, params: Mapping[str, Tensor]) -> Inputs:
    """The probe batch on the parameters' device."""
    dev = next(iter(params.values())).device
    return _map(inputs, lambda t: t.to(dev))


def _default_output(out: Any) -> Tensor:
    try:
        return output_tensor(out)
    except TypeError:
        raise TypeError(
            f"cannot find the outputs in a {type(out).__name__}; pass output_fn=lambda out: <the logits tensor>"
        ) from None


def _last_positions(y: Tensor, inputs: Inputs) -> Tensor:
    """``[N, T, V]`` token outputs -> ``[N, V]`` at each sample's last real token (its last
    ``attention_mask`` entry that is not 0, whichever side is padded; the last position without a
    mask). A gather, so it also runs per sample under ``vmap``."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.shape[-1] != y.shape[1]:
        return y[:, -1]
    order = torch.arange(1, y.shape[1] + 1, device=y.device)
    idx = ((mask != 0).to(order.dtype) * order).argmax(-1)
    return y.gather(1, idx.reshape(-1, 1, 1).expand(-1, 1, y.shape[-1])).squeeze(1)


def _raw(
    model: nn.Module, params: Mapping[str, Tensor], inputs: Inputs, output_fn: Callable[[Any], Tensor] | None
) -> Tensor:
    """The model's output tensor on ``inputs`` with ``params`` substituted, as
    :func:`~lalr_lightning.core.model.batch_loss.call_model` calls it (a module without a ``forward`` of its own
    through its one child holding every parameter)."""
    target = forward_module(model)
    if target is not model:  # parameters are named from ``model``: substitute there, call the child
        out = call_with_params(model, dict(params), lambda: call_model(model, inputs))
    elif isinstance(inputs, Mapping):
        out = functional_call(model, dict(params), (), dict(inputs), strict=False)
    elif isinstance(inputs, Tensor):
        out = functional_call(model, dict(params), (inputs,), strict=False)
    else:
        out = functional_call(model, dict(params), tuple(inputs), strict=False)
    y = (output_fn or _default_output)(out)
    if not isinstance(y, Tensor) or y.ndim == 0:
        raise TypeError("the model output (after output_fn) must be a tensor with a batch dimension")
    return y


def _token_outputs(y: Tensor, inputs: Inputs) -> bool:
    """Whether ``y`` holds one output vector per token: ``[N, T, V]`` from a dict batch with ``input_ids``."""
    return y.ndim == 3 and isinstance(inputs, Mapping) and "input_ids" in inputs


def _forward(
    model: nn.Module, params: Mapping[str, Tensor], inputs: Inputs, output_fn: Callable[[Any], Tensor] | None,
    positions: str = "all",
) -> Tensor:
    """Model outputs as ``[batch, C]`` (trailing dimensions flattened; a 1-D output is ``C = 1``).
    ``positions="last"``: token outputs (:func:`_token_outputs`) at each sample's last real token
    (:func:`_last_positions`)."""
    y = _raw(model, params, inputs, output_fn)
    if positions == "last" and _token_outputs(y, inputs):
        y = _last_positions(y, inputs)
    return y.reshape(y.shape[0], -1) if y.ndim != 1 else y[:, None]


def check_positions(positions: str) -> str:
    if positions not in POSITIONS:
        raise unknown("positions", positions, POSITIONS, show=repr)
    return positions


def check_kernel(kernel: str) -> str:
    if kernel not in MODES:
        raise unknown("kernel", kernel, MODES, show=repr)
    return kernel


# --------------------------------------------------------------------------- the NTK


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


# --------------------------------------------------------------------------- spectra


def _sym64(a: Tensor, what: str) -> Tensor:
    if not isinstance(a, Tensor) or a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"{what} must be a square matrix, got {getattr(a, 'shape', type(a).__name__)}")
    if not torch.isfinite(a).all():
        raise ValueError(f"{what} has NaN or infinite entries")
    a = a.detach().to(torch.float64)
    return (a + a.T) / 2


def _check_sigma(sigma: float) -> float:
    sigma = float(sigma)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma}")
    return sigma


def condition_number(K: Tensor, sigma: float = 0.0) -> float:
    """``kappa(K + sigma I) = (lambda_max(K) + sigma) / (lambda_min(K) + sigma)`` (Theorem 5).

    ``K`` is PSD, so a slightly negative ``lambda_min`` from rounding is taken as 0; the result
    is ``inf`` when ``lambda_min + sigma`` is 0 (a singular ``K`` with ``sigma = 0``).
    """
    sigma = _check_sigma(sigma)
    w = torch.linalg.eigvalsh(_sym64(K, "K"))
    lo, hi = max(float(w[0]), 0.0) + sigma, max(float(w[-1]), 0.0) + sigma
    return hi / lo if lo > 0 else math.inf


def _inv_sqrt(K: Tensor, sigma: float, rcond: float) -> Tensor:
    """``(K + sigma I)^{-1/2}``; a clear error when it does not exist numerically."""
    a = _sym64(K, "K") + sigma * torch.eye(K.shape[0], dtype=torch.float64, device=K.device)
    w, u = torch.linalg.eigh(a)
    if float(w[-1]) <= 0 or float(w[0]) <= rcond * float(w[-1]):
        raise ValueError(
            f"K + sigma I is singular (lambda_min = {float(w[0]):.3g}, lambda_max = {float(w[-1]):.3g}, sigma = {sigma}), "
            "so K^{-1/2} does not exist; pass sigma > 0 (the ridge of section 4, sigma = lambda / 2), e.g. "
            f"sigma = {max(1e-6 * float(torch.trace(a)) / K.shape[0], 1e-12):.3g}"
        )
    return (u * w.rsqrt()) @ u.T


def eta(K: Tensor, S: Tensor, sigma: float = 0.0, *, rcond: float = 1e-12) -> float:
    """``eta = ||(K + sigma I)^{-1/2} S (K + sigma I)^{-1/2}||_2`` (Theorem 6; ``sigma = 0`` is verbatim).

    ``(1 - eta) lambda_i(K) <= lambda_i(K + S) <= (1 + eta) lambda_i(K)``. ``sigma > 0`` is the
    regularized kernel Theorem 7 works with and keeps ``eta`` finite for a rank-deficient ``K``
    (``N`` samples but fewer effective parameters, or a kernel of a few layers); with
    ``sigma = 0`` a numerically singular ``K`` (``lambda_min <= rcond * lambda_max``) raises.
    """
    return layer_etas(K, {"": S}, sigma, rcond=rcond)[""]


def layer_etas(K: Tensor, S: Mapping[str, Tensor], sigma: float = 0.0, *, rcond: float = 1e-12) -> dict[str, float]:
    """:func:`eta` of every ``S_l`` against one ``K`` (one inverse square root for all)."""
    sigma = _check_sigma(sigma)
    r = _inv_sqrt(K, sigma, rcond)
    out = {}
    for name, s in S.items():
        s64 = _sym64(s, f"S[{name!r}]")
        if s64.shape != r.shape:
            raise ValueError(f"S[{name!r}] is {tuple(s.shape)} but K is {tuple(K.shape)}")
        m = r @ s64 @ r
        out[name] = float(torch.linalg.eigvalsh((m + m.T) / 2).abs().max())
    return out


@dataclass
class NTKSelection:
    """Result of :func:`greedy_ntk_selection`.

    ``layers``: chosen, in order. ``eta``: each chosen layer's ``eta`` against the kernel of the
    layers chosen before it. ``eta_rounds[t]``: every remaining candidate's ``eta`` in round
    ``t``. ``kappa``: ``kappa(K_sel + sigma I)`` before any layer (index 0) and after each
    addition. ``stopped``: ``"kappa"`` (the best candidate would exceed the bound; its
    ``rejected_kappa``), ``"max_layers"`` or ``"exhausted"``.
    """

    layers: list[str]
    eta: dict[str, float]
    eta_rounds: list[dict[str, float]]
    kappa: list[float]
    stopped: str
    rejected: str | None = None
    rejected_kappa: float | None = None


def greedy_ntk_selection(
    S: Mapping[str, Tensor],
    kappa_max: float,
    sigma: float,
    *,
    base: Tensor | None = None,
    max_layers: int | None = None,
) -> NTKSelection:
    """Choose layers to fine-tune by Theorems 6-7: largest ``eta`` first, ``kappa`` bounded.

    Start from ``K_sel = base`` (the kernel of parameters always trained, e.g. the head;
    default 0). Each round computes, for every remaining candidate ``l``,
    ``eta_l = ||(K_sel + sigma I)^{-1/2} S_l (K_sel + sigma I)^{-1/2}||`` (Theorem 6 with ``K``
    the kernel of the layers already selected) and takes the candidate with the largest
    ``eta`` -- the one that moves the spectrum, hence the risk bound, most. It is added only
    if ``kappa(K_sel + S_l + sigma I) <= kappa_max``: Theorem 7 needs ``kappa(K + sigma I) <= c``
    for the trained set, and checking the kernel after the addition keeps that hypothesis
    true for the next round. Otherwise selection stops. ``sigma > 0`` is required: the first
    round has ``K_sel = 0`` (where ``eta_l = lambda_max(S_l) / sigma``).
    """
    sigma = _check_sigma(sigma)
    if sigma <= 0:
        raise ValueError("greedy_ntk_selection needs sigma > 0: the first round compares against K_sel = 0")
    if not (kappa_max >= 1):
        raise ValueError(f"kappa_max must be >= 1 (a condition number is at least 1), got {kappa_max}")
    if not S:
        raise ValueError("no candidate layers: S is empty")
    if max_layers is not None and max_layers < 1:
        raise ValueError(f"max_layers must be >= 1 or None, got {max_layers}")
    cand = {k: _sym64(v, f"S[{k!r}]") for k, v in S.items()}
    m = next(iter(cand.values())).shape[0]
    ksel = torch.zeros(m, m, dtype=torch.float64) if base is None else _sym64(base, "base")
    ksel = ksel.to(next(iter(cand.values())).device)
    chosen: list[str] = []
    etas: dict[str, float] = {}
    rounds: list[dict[str, float]] = []
    kappas = [condition_number(ksel, sigma)]
    while True:
        if not cand:
            return NTKSelection(chosen, etas, rounds, kappas, "exhausted")
        if max_layers is not None and len(chosen) >= max_layers:
            return NTKSelection(chosen, etas, rounds, kappas, "max_layers")
        e = layer_etas(ksel, cand, sigma)
        rounds.append(e)
        best = max(e, key=lambda k: e[k])  # first of equal etas, in the given order
        new = ksel + cand[best]
        kap = condition_number(new, sigma)
        if kap > kappa_max:
            return NTKSelection(chosen, etas, rounds, kappas, "kappa", best, kap)
        chosen.append(best)
        etas[best] = e[best]
        kappas.append(kap)
        ksel = new
        del cand[best]


# --------------------------------------------------------------------------- linearization


def head_selection(S: Mapping[str, Tensor], head: str | None, kappa_max: float, sigma: float,
                   max_layers: int | None = None) -> tuple[NTKSelection, str | None]:
    """NTKSelect's rule: :func:`greedy_ntk_selection` over the kernels ``S`` but the ``head``'s,
    which is the start (``K_sel = S_head``; ``None``: no head, every layer ranked). A ValueError
    when no layer fits (nor the head alone); with the selection, the warning line when only the
    head fits (else None)."""
    S = dict(S)
    base = S.pop(head) if head is not None else None
    sel = greedy_ntk_selection(S, kappa_max, sigma, base=base, max_layers=max_layers)
    if not sel.layers and (base is None or sel.kappa[0] > kappa_max):
        start = "" if base is None else f" with the head {head!r} (alone: {sel.kappa[0]:.4g})"
        raise ValueError(f"NTKSelect: no layer keeps kappa(K + sigma I) <= kappa_max={kappa_max:g}{start} "
                         f"(the best, {sel.rejected!r}, gives {sel.rejected_kappa:.4g}); raise kappa_max or sigma")
    if sel.layers:
        return sel, None
    return sel, (f"NTKSelect: only the head {head!r} trains: adding the best layer, {sel.rejected!r}, gives kappa "
                 f"{sel.rejected_kappa:.4g} > kappa_max={kappa_max:g}")


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


# --------------------------------------------------------------------------- Lip(f), lambda_o


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
