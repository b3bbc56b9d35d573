"""How the NTK code calls a model: eval mode on the math attention kernel, the outputs as one
tensor, token positions, and the checks of ``mode`` and ``positions`` (:mod:`.ntk`'s docstring).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lalr_lightning.choices import unknown
from lalr_lightning.core.model.batch_loss import call_model, forward_module, output_tensor
from lalr_lightning.core.model.taps import call_with_params

__all__ = [
    "MODES",
    "POSITIONS",
    "check_positions",
    "check_kernel",
]


MODES = ("trace", "full", "sum")


#: which positions of token outputs ``[N, T, V]`` count as outputs: every one, or each sample's last
#: real token (the next-token prediction at the end of the sequence)
POSITIONS = ("all", "last")


Inputs = Tensor | Sequence[Tensor] | Mapping[str, Tensor]


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
