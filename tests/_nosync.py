"""Watch a callback's per-step work for device-to-host synchronisation (issue 34).

:class:`SyncWatch` wraps the per-step entry points -- the callback's batch hooks, and
``LayerControl``'s work around the optimizer step (dropping frozen gradients, masking, the
multiplier split, the post-step transforms) -- and, while one of them runs, records every
tensor-to-host read: ``.item()``, ``.tolist()``, ``bool/float/int(tensor)``, ``.nonzero()``,
``.cpu()``, ``.numpy()``. On CUDA it also turns on ``torch.cuda.set_sync_debug_mode("error")``
there. A step in which the callback decides (``conclude``) or measures (L-MSA's ``_measuring``)
is a decision step and may read; any other step must not.
"""

from __future__ import annotations

import functools
import sys

import torch
from lightning.pytorch.callbacks import Callback

from lalr_lightning.core.runtime.control import LayerControl

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")
HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
         "on_before_zero_grad", "on_train_batch_end")


class SyncWatch(Callback):
    """Put it in ``callbacks`` after ``watched``; use as a context manager around ``fit``."""

    def __init__(self, watched, cuda: bool = False, decides=None):
        self.watched = watched
        self.decides = decides or (lambda step: False)  # steps known to decide inside a batch hook
        self.cuda = cuda
        self.depth = 0
        self.step = -1
        self.reads: dict[int, list[str]] = {}
        self.deciding: set[int] = set()
        self._undo: list = []

    # --------------------------------------------------------------- the guard

    def _guard(self, fn):
        @functools.wraps(fn)
        def guarded(*a, **k):
            self.depth += 1
            mode = None
            if (self.cuda and self.depth == 1 and self.step not in self.deciding and not self._measuring()
                    and not self.decides(self.step)):
                mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                if mode is not None:
                    torch.cuda.set_sync_debug_mode(mode)

        return guarded

    def _measuring(self) -> bool:
        return bool(getattr(self.watched, "_measuring", False))

    def _read(self, name, orig):
        def read(t, *a, **k):
            # torch's optimizers keep their step counts on the CPU and read them (not a device sync)
            if self.depth and "torch/optim/" not in sys._getframe(1).f_code.co_filename:
                self.reads.setdefault(self.step, []).append(name)
            return orig(t, *a, **k)

        return read

    def __enter__(self):
        for name in READS:
            orig = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._read(name, orig))
            self._undo.append((torch.Tensor, name, orig))
        for name in ("_engage", "_after_step", "mask_gradients"):
            orig = getattr(LayerControl, name)
            setattr(LayerControl, name, self._guard(orig))
            self._undo.append((LayerControl, name, orig))
        for name in HOOKS:
            setattr(self.watched, name, self._guard(getattr(self.watched, name)))
        inner = self.watched.conclude

        def conclude(*a, **k):
            self.deciding.add(self.step)
            return inner(*a, **k)

        self.watched.conclude = conclude
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)
        self._undo = []

    # --------------------------------------------------------------- steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        if self._measuring() or self.decides(self.step):
            self.deciding.add(self.step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._measuring():
            self.deciding.add(self.step)

    def violations(self) -> dict[int, list[str]]:
        """{step: reads} of the steps that decided nothing."""
        return {s: sorted(set(r)) for s, r in self.reads.items() if s not in self.deciding}

    def quiet_steps(self, steps: int) -> int:
        return len([s for s in range(steps) if s not in self.deciding])
