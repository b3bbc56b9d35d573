"""Which checkpoint entry is whose: the state keys of several instances of one callback, and
what a resumed fit finds in a checkpoint that none of its callbacks takes.

Lightning keeps each callback's state under its ``state_key`` and refuses two callbacks with one
key. A named instance keys as ``Type[name]``; an unnamed one as ``Type`` plus, in Lightning's own
style (``ModelCheckpoint{'monitor': ...}``), the settings in which it differs from the default
instance: ``LayerLRMultiplier{'patterns': {'fc': 2.0}}``. So a default instance keeps the key it
always had, and two instances with other settings coexist. Settings a resumed run may change
(what is only logged, the volatile ones) are not part of the key.

A checkpoint written before (under the bare ``Type``), or by the same callback with other
settings under ``strict_resume=False``, still finds its instance: an instance whose key the
checkpoint lacks takes the one entry of its type that no other callback of the fit claims
(:func:`adopt`); the settings check then runs on it as before."""

from __future__ import annotations

from typing import Any

from lalr_lightning.core.runtime import checks

__all__ = ["adopt", "default_settings", "distinct_settings", "state_key"]

#: settings of what is only logged: never part of a key
_LOGGED = ("figures",)


def default_settings(cls: type) -> dict:
    """The settings of ``cls``'s default instance, as its constructor resolves them (a preset's
    metric filled in), once per class; no instance is built
    (:func:`~lalr_lightning.core.runtime.checks.default_settings`)."""
    return checks.default_settings(cls, cls._settle, last=_LOGGED)


def distinct_settings(cb: Any) -> dict:
    """The settings of ``cb`` that set it apart from its class's default instance, less the ones a
    resumed run may change."""
    return checks.distinct_settings(cb.settings(), default_settings(type(cb)), (*cb.traits.volatile_settings, *_LOGGED))


def state_key(cb: Any) -> str:
    """``Type[name]``, else ``Type`` with the settings that set ``cb`` apart (module docstring).
    Kept on the instance once computed (a step's bookkeeping reads it)."""
    adopted = cb.__dict__.get("_adopted_key")
    if adopted is not None:
        return adopted
    memo = cb.__dict__.get("_key_memo")
    if memo is not None and memo[0] == cb.name:
        return memo[1]
    base = type(cb).__name__
    if cb.name:
        key = f"{base}[{cb.name}]"
    else:
        diff = distinct_settings(cb)
        key = base + (repr(diff) if diff else "")
    cb.__dict__["_key_memo"] = (cb.name, key)
    return key


def _family(key: Any, cb: Any) -> bool:
    base = type(cb).__name__
    if cb.name:
        return key == f"{base}[{cb.name}]"
    return isinstance(key, str) and (key == base or key.startswith(base + "{"))


def adopt(cb: Any, trainer: Any, checkpoint: dict) -> None:
    """Before Lightning hands out the checkpoint's callback states: where the checkpoint has no
    entry under ``cb``'s key, ``cb`` takes the one entry of its type that no callback of this fit
    claims (a checkpoint of an earlier release, or settings changed under ``strict_resume=False``).
    Two or more such entries: none is taken (Lightning warns that they are left over)."""
    states = checkpoint.get("callbacks") or {}
    if cb.state_key in states:
        return
    claimed = {c.state_key for c in trainer.callbacks}
    free = [k for k in states if _family(k, cb) and k not in claimed]
    if len(free) == 1:
        cb.__dict__["_adopted_key"] = free[0]
