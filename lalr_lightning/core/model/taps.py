"""Forward/backward taps on a model's blocks, and running a block (or the rest of the network)
with substituted parameters -- the machinery of data-dependent block methods (L-MSA reads the
states ``x_n`` and co-states ``p_{n+1} = -dL/dx_{n+1}`` of every block with it).

How blocks are run as functions of their parameters (:class:`BlockTaps`): a block that is one
module is called with ``torch.func.functional_call`` on its cached inputs. A block that spans
several modules (a stem joined to the first block: ``conv1+bn1+layer1``) is run by the model's
own forward with the block's parameters substituted (``functional_call`` on the whole model),
the block's entry module fed the cached input ``x_n`` by a forward pre-hook, and the forward
stopped right after the block's exit module -- no re-plumbing of the architecture needed. The
rest of the network ``G_{n+1}`` is always the model's own forward with the block's parameters
substituted and its input fed from the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = [
    "BlockFn",
    "BlockTaps",
    "Capture",
    "call_with_params",
    "first_tensor",
    "fixed_rng",
    "gradient_taps",
    "preserve_buffers",
]

# A block as a function of its parameters: ``fn(theta, x=None) -> output`` where ``theta`` is
# the list of the block's parameter tensors (in the block's order) and ``x`` optionally
# replaces the block's (cached) first input tensor.
BlockFn = Callable[..., Tensor]


def first_tensor(out, where: str = "block") -> Tensor:
    """The state carried by a block's output: the tensor itself, the first element of a
    tuple/list (Hugging Face layers return ``(hidden_states, ...)``), or the first entry of a
    ``ModelOutput``."""
    if isinstance(out, Tensor):
        return out
    if hasattr(out, "to_tuple") and callable(out.to_tuple):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    raise TypeError(
        f"{where} returns {type(out).__name__}; L-MSA supports blocks whose output is a tensor, or a "
        "tuple/list (or Hugging Face ModelOutput) whose first element is the state tensor. Pass "
        "blocks=[...] naming modules that return the hidden state."
    )


def _clone_tree(obj):
    if type(obj).__name__.endswith("Cache"):
        # a Hugging Face KV cache (LLaMA makes one even in training when the config says use_cache):
        # re-running the block with it would append to it; a block's state is its hidden input
        return None
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, tuple):
        return tuple(_clone_tree(o) for o in obj)
    if isinstance(obj, list):
        return [_clone_tree(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    return obj


def _first_tensor_input(args: tuple, kwargs: dict) -> tuple[str, int | str] | None:
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            return ("args", i)
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return ("kwargs", k)
    return None


def _with_input(args: tuple, kwargs: dict, x: Tensor | None) -> tuple[tuple, dict]:
    if x is None:
        return args, kwargs
    where = _first_tensor_input(args, kwargs)
    if where is None:
        raise ValueError("the block takes no tensor input to replace")
    if where[0] == "args":
        i = where[1]
        return (*args[:i], x, *args[i + 1:]), kwargs
    return args, {**kwargs, where[1]: x}


def _buffer_copies(module: nn.Module) -> dict[str, Tensor]:
    """Copies of the buffers, to pass to ``functional_call``: running statistics updated in a
    train-mode forward land in the copies (restoring the originals in place afterwards would
    break the backward pass, which saves them)."""
    return {n: b.detach().clone() for n, b in module.named_buffers()}


@contextlib.contextmanager
def preserve_buffers(module: nn.Module) -> Iterator[None]:
    """Restore every buffer (BatchNorm running statistics, counters) on exit, so extra
    forward passes in train mode leave no trace."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


@contextlib.contextmanager
def gradient_taps(model: nn.Module, keys: Mapping[int, str],
                  stat: Callable[[Tensor], object]) -> Iterator[dict[str, object]]:
    """``stat(grad)`` of the gradient this process computes for each parameter of ``model`` whose
    ``id`` is in ``keys``, taken in the backward as the gradient arrives -- before anything a
    data-parallel strategy does with it (averaging, reduce-scattering) -- into the dict yielded
    (``keys[id] -> value``; a tensor the loss does not reach is missing). One forward and
    backward per use: a tensor read by several modules (tied) is tapped once.

    The tensors are read from their modules at each module's forward (a forward pre-hook), which
    is when a sharding strategy has them whole: FSDP1 (``use_orig_params``) puts views of the
    gathered flat parameter there, FSDP2 its unsharded parameters. So ``grad`` is the whole
    gradient of this process's batch although the modules hold pieces outside the forward, and
    no more of it is held than the backward holds anyway. ``keys`` names the parameters as the
    modules hold them outside the forward.
    """
    owners = {mod: [(attr, keys[id(p)]) for attr, p in mod.named_parameters(recurse=False) if id(p) in keys]
              for mod in model.modules()}
    owners = {mod: v for mod, v in owners.items() if v}
    out: dict[str, object] = {}
    tapped: set[int] = set()  # by tensor: a recomputing forward (activation checkpointing) has new views
    handles: list = []

    def tap(mod: nn.Module, _args) -> None:
        for attr, key in owners[mod]:
            t = getattr(mod, attr)
            if id(t) in tapped or not (isinstance(t, Tensor) and t.requires_grad):
                continue
            tapped.add(id(t))
            handles.append(t.register_hook(lambda g, key=key: out.__setitem__(key, stat(g))))

    handles += [mod.register_forward_pre_hook(tap) for mod in owners]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def fixed_rng(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run with a fixed seed (the same dropout masks in every probe) and give the global
    random state back afterwards, so probes do not change the training's random stream. Only
    the generators a probe draws from are seeded and given back: the CPU's and ``device``'s
    (``torch.manual_seed`` seeds every backend's, 90 us a call on a CUDA build, and L-MSA
    probes several times a step)."""
    gens = [torch.default_generator]
    if device is not None and device.type == "cuda":
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    saved = [g.get_state() for g in gens]
    try:
        for g in gens:
            g.manual_seed(seed)
        yield
    finally:
        for g, state in zip(gens, saved):
            g.set_state(state)


def _costate_path(t: Tensor) -> Tensor:
    """``t`` (which needs no gradient) as a non-leaf that does: the backward then reaches it
    and a hook on it reads ``dL/dt``. Added to a 0-d leaf rather than made a leaf itself, so
    in-place operations downstream (``ReLU(inplace=True)``) stay legal and no activation-sized
    ``.grad`` accumulates on a leaf."""
    anchor = torch.zeros((), dtype=t.dtype, device=t.device, requires_grad=True)
    return t + anchor


def _replace_first(out, t: Tensor):
    """``out`` (as :func:`first_tensor` reads it) with its state tensor replaced by ``t``."""
    if isinstance(out, Tensor):
        return t
    if hasattr(out, "to_tuple") and callable(out.to_tuple):
        out[next(iter(out.keys()))] = t
        return out
    if isinstance(out, tuple):
        return (t, *out[1:])
    return [t, *out[1:]]


class _StopForward(Exception):
    def __init__(self, out: Tensor):
        super().__init__("stopped after the block")
        self.out = out


class _Thunk(nn.Module):
    """Lets ``functional_call`` substitute parameters of ``model`` while an arbitrary function
    (the loss on a batch) runs it."""

    def __init__(self, model: nn.Module, fn: Callable[[], Tensor]):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self) -> Tensor:
        return self.fn()


def shared_names(module: nn.Module) -> frozenset[str]:
    """The names under which ``module`` holds a tensor that it also holds under another name (tied
    weights). ``functional_call`` keeps ties only with ``tie_weights=True``, which walks every tensor
    of the module at each call (0.2 ms on a 100-tensor model); an override that names none of these
    needs no tying."""
    names: dict[int, list[str]] = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    return frozenset(n for same in names.values() if len(same) > 1 for n in same)


def call_with_params(model: nn.Module, overrides: Mapping[str, Tensor], fn: Callable[[], Tensor],
                     shared: frozenset[str] | None = None):
    """Run ``fn()`` (which calls ``model``) with the named parameters of ``model`` replaced
    (``shared``: :func:`shared_names` of ``model``, when the caller keeps it; ties are then
    followed only where an override names a tied tensor)."""
    if not overrides:
        return fn()
    thunk = _Thunk(model, fn)
    tie = shared is None or not shared.isdisjoint(overrides)
    return functional_call(thunk, {f"model.{k}": v for k, v in overrides.items()}, (), tie_weights=tie)


# ============================================================================ taps


@dataclass
class Capture:
    """What one forward/backward pass showed of one block."""

    args: tuple
    kwargs: dict
    out: Tensor | None = None  # x_{n+1} (detached copy)
    p: Tensor | None = None  # p_{n+1} = -dL/dx_{n+1}
    p_in: Tensor | None = None  # p_n = -dL/dx_n (only with want_input_costate)
    normalized: bool = False  # set by the owner once p is rescaled to the batch loss
    context: object = None  # what the owner set as ``BlockTaps.context`` (e.g. the batch)

    @property
    def x_in(self) -> Tensor | None:
        where = _first_tensor_input(self.args, self.kwargs)
        if where is None:
            return None
        return self.args[where[1]] if where[0] == "args" else self.kwargs[where[1]]


@dataclass
class _Block:
    name: str
    params: dict[str, nn.Parameter]  # clean name -> parameter (the block's order)
    modules: list[nn.Module]
    raw: list[str] = field(default_factory=list)  # raw names in the model, same order
    module: nn.Module | None = None  # the single module of the block, when there is one
    local: list[str] = field(default_factory=list)  # names inside ``module``
    entry: nn.Module | None = None
    exit: nn.Module | None = None
    names_of_modules: list[str] = field(default_factory=list)
    state_bytes: tuple[int, int] = (0, 0)  # (input x_n, output x_{n+1}) on the discovery batch


class BlockTaps:
    """Forward/backward hooks that read states and co-states of blocks, and the machinery to
    run a block (or the rest of the network) with substituted parameters.

    ``blocks``: objects with ``.name``, ``.params`` (name -> parameter) and ``.modules`` (the
    block's top modules) -- :class:`lalr_lightning.core.model.layers.Layer` from ``block_layers``.
    ``run`` (given to :meth:`discover`, :meth:`block_fn`, :meth:`loss_with`) is a no-argument
    callable that runs the model on the current batch and returns the scalar loss.
    """

    def __init__(self, model: nn.Module, blocks: Sequence, *, want_input_costate: bool = False, seed: int = 0):
        self.model = model
        self.want_input_costate = want_input_costate
        self.seed = seed
        self._shared = shared_names(model)  # the tied tensors' names: the others are substituted untied (faster)
        raw_of: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            raw_of.setdefault(id(p), n)
        mod_name = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.blocks: dict[str, _Block] = {}
        for layer in blocks:
            params = dict(layer.params)
            if not params:
                raise ValueError(f"block {layer.name!r} has no parameters; L-MSA selects blocks by updating their "
                                 "parameters. Pass blocks=[...] naming blocks that hold parameters")
            missing = [n for n, p in params.items() if id(p) not in raw_of]
            if missing:
                raise ValueError(f"block {layer.name!r}: parameters {missing[:3]} are not in the model")
            mods = [m for m in (getattr(layer, "modules", None) or []) if isinstance(m, nn.Module)]
            if not mods:
                mods = self._owners(model, [raw_of[id(p)] for p in params.values()], layer.name)
            mods = [self._widen(model, m, mod_name) for m in mods]
            for m in mods:
                if m is model:
                    raise ValueError(
                        f"block {layer.name!r} is held by the model's root module, so it has no input and output "
                        "of its own; pass blocks=[...] with one submodule name per block"
                    )
            b = _Block(layer.name, params, mods, raw=[raw_of[id(p)] for p in params.values()])
            single = getattr(layer, "module", None)
            single = None if single is None else self._widen(model, single, mod_name)
            if single is not None and len(mods) == 1 and mods[0] is single:
                local = {id(p): n for n, p in single.named_parameters(remove_duplicate=False)}
                if all(id(p) in local for p in params.values()):
                    b.module = single
                    b.local = [local[id(p)] for p in params.values()]
            b.names_of_modules = [mod_name.get(id(m), "?") for m in mods]
            self.blocks[layer.name] = b
        self._handles: list = []
        self._capture: set[str] = set()
        self._open: dict[str, Capture] = {}
        self.captures: dict[str, list[Capture]] = {n: [] for n in self.blocks}
        self._probe: dict | None = None
        self.discovered = False
        self.context: object = None  # stored in each new Capture (the owner puts the batch here)

    @staticmethod
    def _widen(model: nn.Module, module: nn.Module, mod_name: dict[int, str]) -> nn.Module:
        """The largest submodule (never the root) holding exactly ``module``'s parameters: a
        block ``blocks.1 = Sequential(Linear, Tanh)`` is found as ``blocks.1.0``; its output is
        the output of ``blocks.1``, after the activation."""
        name = mod_name.get(id(module))
        if not name:
            return module
        own = {id(p) for p in module.parameters()}
        parts = name.split(".")
        best = module
        for k in range(len(parts) - 1, 0, -1):
            parent = model.get_submodule(".".join(parts[:k]))
            if {id(p) for p in parent.parameters()} != own or isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
                break  # (a ModuleList of one layer holds its parameters but is never called)
            best = parent
        return best

    @staticmethod
    def _owners(model: nn.Module, raw_names: list[str], block: str) -> list[nn.Module]:
        prefixes = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in raw_names})
        top = [p for p in prefixes if not any(p != q and (q == "" or p.startswith(q + ".")) for q in prefixes)]
        mods = []
        for p in top:
            mods.append(model if p == "" else model.get_submodule(p))
        if not mods:
            raise ValueError(f"cannot find the modules of block {block!r}; pass blocks=[...]")
        return mods

    # ------------------------------------------------------------------ discovery

    def discover(self, run: Callable[[], Tensor]) -> None:
        """One forward pass (no grad, buffers and random state preserved) that finds, for each
        block, the module that runs first (its entry: its input is ``x_n``) and the one that
        finishes last (its exit: its output is ``x_{n+1}``), then installs the taps there."""
        self.detach()
        calls: dict[int, list] = {}
        counter = [0]
        handles = []
        all_mods = {id(m): m for b in self.blocks.values() for m in b.modules}

        sizes: dict[int, list[int]] = {}  # module -> [input bytes, output bytes] of its first call

        def pre(m, args):
            counter[0] += 1
            calls.setdefault(id(m), [None, None, 0])
            c = calls[id(m)]
            if c[0] is None:
                c[0] = counter[0]
                x = next((a for a in args if isinstance(a, Tensor)), None)
                sizes[id(m)] = [0 if x is None else x.numel() * x.element_size(), 0]
            c[2] += 1

        def post(m, args, out):
            counter[0] += 1
            calls[id(m)][1] = counter[0]
            try:
                t = first_tensor(out)
                sizes[id(m)][1] = max(sizes[id(m)][1], t.numel() * t.element_size())
            except TypeError:
                pass

        for m in all_mods.values():
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        try:
            with torch.no_grad(), preserve_buffers(self.model), fixed_rng(self.seed, self._device()):
                run()
        finally:
            for h in handles:
                h.remove()
        for b in self.blocks.values():
            ran = [m for m in b.modules if id(m) in calls]
            if len(ran) < len(b.modules):
                idle = [n for n, m in zip(b.names_of_modules, b.modules) if id(m) not in calls]
                raise RuntimeError(
                    f"block {b.name!r}: module(s) {idle} did not run in the model's forward pass; L-MSA needs every "
                    "block to run once per forward. Pass blocks=[...] naming the modules that do run"
                )
            b.entry = min(ran, key=lambda m: calls[id(m)][0])
            b.exit = max(ran, key=lambda m: calls[id(m)][1])
            b.state_bytes = (sizes[id(b.entry)][0], sizes[id(b.exit)][1])
            for m in (b.entry, b.exit):
                if calls[id(m)][2] != 1:
                    raise RuntimeError(
                        f"block {b.name!r}: its module ran {calls[id(m)][2]} times in one forward pass (shared or "
                        "recurrent use); L-MSA needs each block to map one state to the next once per forward"
                    )
        seq = list(self.blocks.values())
        for a, b in zip(seq, seq[1:]):
            if calls[id(a.exit)][1] > calls[id(b.entry)][0]:
                raise RuntimeError(
                    f"block {a.name!r} finishes after block {b.name!r} starts in the model's forward pass (one of "
                    f"its modules, {a.names_of_modules}, runs later); L-MSA needs blocks that map one state to the "
                    "next in order. Pass blocks=[...] grouping the modules as they run"
                )
        self._attach()
        self.discovered = True

    def capture_bytes(self, names: Sequence[str] | None = None) -> dict[str, int]:
        """Bytes one captured batch holds per block (after :meth:`discover`, for its batch size):
        the input ``x_n``, the output ``x_{n+1}`` and the co-state ``p_{n+1}`` (the output's
        size), plus ``p_n`` with ``want_input_costate``."""
        out = {}
        for name in (self.blocks if names is None else names):
            x, y = self.blocks[name].state_bytes
            out[name] = x * (2 if self.want_input_costate else 1) + 2 * y
        return out

    def _device(self) -> torch.device | None:
        for p in self.model.parameters():
            return p.device
        return None

    def _attach(self) -> None:
        for b in self.blocks.values():
            self._handles.append(b.entry.register_forward_pre_hook(self._make_pre(b.name), with_kwargs=True))
            self._handles.append(b.exit.register_forward_hook(self._make_post(b.name)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.discovered = False

    def _make_pre(self, name: str):
        def pre(module, args, kwargs):
            probe = self._probe
            if probe is not None:
                sub = probe["substitute"].get(name)
                if sub is not None:
                    return sub
                return None
            if name in self._capture and torch.is_grad_enabled():
                cap = Capture(_clone_tree(args), _clone_tree(kwargs), context=self.context)
                if self.want_input_costate:
                    where = _first_tensor_input(args, kwargs)
                    if where is not None:
                        t = args[where[1]] if where[0] == "args" else kwargs[where[1]]
                        if t.requires_grad:
                            def set_p_in(g, cap=cap):
                                cap.p_in = -g.detach()
                            t.register_hook(set_p_in)
                self._open[name] = cap
            return None

        return pre

    def _make_post(self, name: str):
        def post(module, args, output):
            probe = self._probe
            if probe is not None:
                if probe["stop_at"] == name:
                    raise _StopForward(first_tensor(output, f"block {name!r}"))
                return None
            if name in self._capture and torch.is_grad_enabled():
                cap = self._open.pop(name, None)
                if cap is None:
                    raise RuntimeError(f"block {name!r}: its exit ran without its entry (or twice) in one forward")
                t = first_tensor(output, f"block {name!r}")
                cap.out = t.detach().clone()
                new_output = None
                if not t.requires_grad and t.is_floating_point():
                    # nothing before this output trains (its weights and all upstream are
                    # frozen): route the backward through it anyway, so the co-state exists
                    # without computing any weight gradient upstream
                    t = _costate_path(t)
                    new_output = _replace_first(output, t)
                if t.requires_grad:
                    def set_p(g, cap=cap):
                        cap.p = -g.detach()
                    t.register_hook(set_p)
                self.captures[name].append(cap)
                return new_output
            return None

        return post

    # ------------------------------------------------------------------ modes

    def set_capture(self, names: Sequence[str]) -> None:
        unknown = set(names) - set(self.blocks)
        if unknown:
            raise KeyError(f"unknown blocks {sorted(unknown)}; blocks are {list(self.blocks)}")
        self._capture = set(names)
        self._open = {}

    def scale_costates(self, names: Sequence[str], factor: float, who: str = "L-MSA") -> None:
        """Multiply the co-states captured since the last call by ``factor`` (once each): to
        ``-dL/dx`` of the batch loss where the backward ran on a scaled one (Lightning divides the
        loss by the accumulation steps; AMP multiplies it by its scale)."""
        for n in names:
            for cap in self.captures[n]:
                if cap.normalized:
                    continue
                if cap.p is None:
                    raise RuntimeError(
                        f"{who}: block {n!r} got no co-state in the backward pass: its output does not reach the "
                        "loss with a gradient (is the block's output detached, or were its parameters and "
                        "everything before it set to requires_grad=False?)"
                    )
                if factor != 1.0:
                    cap.p = cap.p * factor
                cap.normalized = True

    def clear(self, names: Sequence[str] | None = None) -> None:
        for n in (self.blocks if names is None else names):
            self.captures[n] = []

    @contextlib.contextmanager
    def _probing(self, substitute: Mapping[str, tuple], stop_at: str | None) -> Iterator[None]:
        old = self._probe
        self._probe = {"substitute": dict(substitute), "stop_at": stop_at}
        try:
            yield
        finally:
            self._probe = old

    # ------------------------------------------------------------------ running blocks

    def theta(self, name: str) -> list[nn.Parameter]:
        return list(self.blocks[name].params.values())

    def block_fn(self, name: str, capture: Capture, run: Callable[[], Tensor] | None) -> BlockFn:
        """``g_n(x_n, theta)`` on the captured ``x_n`` (see the module docstring)."""
        b = self.blocks[name]
        device = self._device()
        seed = self.seed
        if b.module is not None:
            module, local = b.module, b.local
            tie = bool(shared_names(module))

            def fast(theta: Sequence[Tensor], x: Tensor | None = None) -> Tensor:
                args, kwargs = _with_input(capture.args, capture.kwargs, x)
                # probe mode: the taps neither capture nor substitute during this call; buffers
                # (BatchNorm statistics) are fresh copies, so the call leaves no trace
                values = {**_buffer_copies(module), **dict(zip(local, theta))}
                with self._probing({}, stop_at=None), fixed_rng(seed, device):
                    out = functional_call(module, values, args, kwargs, tie_weights=tie)
                return first_tensor(out, f"block {name!r}")

            return fast
        if run is None:
            raise ValueError(f"block {name!r} spans several modules; running it needs the model's forward (run=...)")
        if not self.discovered:
            raise RuntimeError("call discover(run) before running blocks that span several modules")

        def through_model(theta: Sequence[Tensor], x: Tensor | None = None) -> Tensor:
            sub = _with_input(capture.args, capture.kwargs, x)
            values = {**_buffer_copies(self.model), **dict(zip(b.raw, theta))}
            with self._probing({name: sub}, stop_at=name), fixed_rng(seed, device):
                try:
                    call_with_params(self.model, values, run, self._shared)
                except _StopForward as stop:
                    return stop.out
            raise RuntimeError(f"block {name!r} did not run when the model's forward was called")

        return through_model

    def loss_with(
        self,
        run: Callable[[], Tensor],
        overrides: Mapping[str, Sequence[Tensor]] | None = None,
        substitute: Mapping[str, Capture] | None = None,
    ) -> Tensor:
        """The loss with the given blocks' parameters replaced and their inputs fed from the
        captures (``G_{n+1}`` of the updated block when both name block ``n``); no grad,
        buffers and random state preserved."""
        params: dict[str, Tensor] = {}
        for name, theta in (overrides or {}).items():
            params.update(zip(self.blocks[name].raw, theta))
        sub = {n: (c.args, c.kwargs) for n, c in (substitute or {}).items()}
        with torch.no_grad(), self._probing(sub, stop_at=None), preserve_buffers(self.model), \
                fixed_rng(self.seed, self._device()):
            return call_with_params(self.model, params, run, self._shared)
