"""What every command of the command line shares: the command list, how the user called us,
the ``--traceback`` switch, and bad input as one ``error:`` line (a config key's typo, a missing
checkpoint, the library's own errors).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys

__all__ = [
    "COMMANDS",
    "ConfigError",
]


#: every command with its one line, as ``--help`` lists them
COMMANDS = {
    "fit": "train from a config (LightningCLI): fit --config quickstart",
    "validate": "validate a model from a config and a checkpoint (LightningCLI)",
    "test": "test a model from a config and a checkpoint (LightningCLI)",
    "predict": "predict with a model from a config and a checkpoint (LightningCLI)",
    "analyze": "per-layer HT-SR spectral report (alpha, ESD plots) of a model, checkpoint or HF directory",
    "prune": "prune a Hugging Face causal LM one shot (Wanda, SparseGPT, magnitude; uniform, OWL or AlphaPruning "
             "ratios; N:M)",
    "perplexity": "perplexity of a Hugging Face causal LM on a text file (non-overlapping windows)",
    "zeroshot": "zero-shot accuracy (acc, acc_norm) of a causal LM on multiple-choice tasks, as lm-evaluation-harness",
    "report": "one HTML page of a run's per-layer decisions",
    "configs": "list the shipped configs, or print one (configs NAME)",
}


#: the commands ``main`` runs itself, next to LightningCLI's fit / validate / test / predict
_EXTRA_COMMANDS = tuple(COMMANDS)[4:]


class ConfigError(ValueError):
    """A config the CLI cannot run; the message is one line naming the fix."""


def _prog() -> str:
    """How the user called us: the ``lalr-lightning`` console script or ``python -m lalr_lightning``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "lalr-lightning" if name.startswith("lalr-lightning") else "python -m lalr_lightning"


#: set by ``--traceback`` on the command line (``main`` takes the flag out before parsing)
_TRACEBACK = False


def _show_traceback() -> bool:
    """Whether errors keep their traceback: ``--traceback`` or ``LALR_TRACEBACK=1``."""
    return _TRACEBACK or os.environ.get("LALR_TRACEBACK", "").strip().lower() in ("1", "true", "yes", "on")


def _close(word: str, choices) -> str | None:
    found = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return found[0] if found else None


def _suggest_key(key: str, valid: list[str]) -> str | None:
    """The dotted key nearest to ``key`` among ``valid``, fixing one component at a time
    (``trainr.logger.save_dir`` -> ``trainer.logger.save_dir``); None when nothing is close."""
    parts, fixed, changed = key.split("."), [], False
    split = [v.split(".") for v in valid]
    for i, part in enumerate(parts):
        children = {v[i] for v in split if len(v) > i and v[:i] == fixed}
        if part not in children:
            close = _close(part, children)
            if close is None:  # keep what was fixed so far, the rest as given
                fixed += parts[i:]
                break
            part, changed = close, True
        fixed.append(part)
        if not any(len(v) > len(fixed) and v[: len(fixed)] == fixed for v in split):
            fixed += parts[i + 1:]  # a leaf: what follows is inside its value, not checked here
            break
    return ".".join(fixed) if changed else None


def _init_params(class_path: str) -> list[str]:
    """The constructor arguments of ``class_path`` (following ``**kwargs`` to the base classes)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", [cls]):
        init = klass.__dict__.get("__init__") if isinstance(klass, type) else klass
        if init is None:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        names += [q.name for q in params if q.name != "self" and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
        if not any(q.kind == q.VAR_KEYWORD for q in params):
            break
    return names


def _clean(lines: list[str]) -> list[str]:
    """Message lines without the type dumps, long values cut short."""
    out = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith(("Given value type", "Subtypes:"))]
    return [ln if len(ln) <= 120 else ln[:117] + "..." for ln in out]  # "Given value: {...}" can be long


def _block(lines: list[str], start: int) -> list[str]:
    """The lines indented under ``lines[start]``."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    out = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    return _clean(out)


def _parser_keys(parser) -> list[str]:
    return [s[2:] for a in parser._actions for s in a.option_strings
            if s.startswith("--") and not s.endswith(".help")]  # --KEY.help CLASS_PATH: a help flag, not a key


def parse_error_line(message: str, parser) -> str:
    """jsonargparse's many-line parse error as one line, ending with a "did you mean" where a
    close valid key, argument or class name exists."""
    lines = [ln.rstrip() for ln in message.strip().splitlines() if ln.strip()]
    first = lines[0].strip() if lines else "invalid arguments"
    keys = _parser_keys(parser)
    m = re.match(r"unrecognized arguments: (.*)", first)
    if m:
        hints = [f"--{s}" for a in m.group(1).split() if a.startswith("--")
                 for s in [_suggest_key(a[2:].split("=")[0], keys)] if s]
        return first + (f"; did you mean {', '.join(hints)}?" if hints else "")
    m = re.search(r"does not accept option '([^']+)'", first)
    if m:
        s = _suggest_key(m.group(1), keys)
        return first + (f"; did you mean '{s}'?" if s else "")
    m = re.search(r"invalid choice: '([^']+)' \(choose from (.*)\)", first)
    if m:
        choices = re.findall(r"'([^']+)'", m.group(2)) + list(_EXTRA_COMMANDS)
        s = _close(m.group(1), choices)
        return f"unknown command '{m.group(1)}'" + (f"; did you mean '{s}'?" if s else "") + \
            f" (choose from {', '.join(choices)})"
    if first.startswith('expected "subcommand"'):
        return f"{first.rstrip('.')}; or {', '.join(_EXTRA_COMMANDS)} (see --help)"
    if first.startswith("the following arguments are required") and ".model" in first:
        return f"{first}; pass --config FILE or a shipped config's name (`{_prog()} configs` lists them)"
    where = re.match(r'Parser key "([^"]+)"', first)
    where = where.group(1) if where else first.rstrip(":")
    for i, line in enumerate(lines):
        m = re.match(r"\s*- Problem with given class_path '([^']+)':", line)
        if not m:
            continue
        class_path, detail = m.group(1), " ".join(_block(lines, i)) or "invalid"
        value = _callable_value(where, detail)
        if value is not None:
            return value
        hint = None
        bad = re.search(r"Option '([^']+)' is not accepted", detail)
        if bad:
            hint = _close(bad.group(1), _init_params(class_path))
        missing = re.search(r"module '([^']+)' has no attribute '([^']+)'", detail)
        if missing:
            module = sys.modules.get(missing.group(1))
            found = _close(missing.group(2), [n for n in dir(module) if not n.startswith("_")]) if module else None
            hint = f"{missing.group(1)}.{found}" if found else None
        return f"{where}: {class_path}: {detail}" + (f"; did you mean '{hint}'?" if hint else "")
    return " ".join([first] + _clean(lines[1:]))


def _callable_value(where: str, detail: str) -> str | None:
    """An optimizer or scheduler given as a name jsonargparse cannot import (``--model.init_args.
    optimizer sgdd``): one line naming the key, the value and the nearest torch class."""
    m = re.search(r'Parser key "(\w*(?:optimizer|scheduler)\w*)":.*Expected a dot import path string: (\S+)', detail)
    if not m:
        return None
    import torch

    from lalr_lightning.choices import suggestion

    key, value = m.groups()
    if "scheduler" in key:
        module, base = torch.optim.lr_scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                                  torch.optim.lr_scheduler.ReduceLROnPlateau)
    else:
        module, base = torch.optim, (torch.optim.Optimizer,)
    names = sorted(n for n, c in vars(module).items() if isinstance(c, type) and issubclass(c, base)
                   and c not in base and not n.startswith("_"))
    hint = suggestion(value.rpartition(".")[2], names).replace("'", f"'{module.__name__}.", 1)
    example = "lr_scheduler.CosineAnnealingLR" if "scheduler" in key else "AdamW"
    return (f"--{where}.init_args.{key} {value}: not an importable class; give a class path (e.g. "
            f"torch.optim.{example}){hint}")


def _first_line(e: BaseException) -> str:
    """The message's first line; where it only introduces the cause (jsonargparse's "Problem with
    given class_path 'X':"), the first line of the cause after it, so the line names the fix."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1].lstrip('- ')}"
    return lines[0]


def _raised_by_library(e: BaseException) -> bool:
    """Whether ``e`` came from a ``raise`` statement in lalr_lightning's own code: a message
    written for the user, naming the fix (not a bug, nor another library's error)."""
    import linecache

    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:  # the innermost frame: where it was raised
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    if module != "lalr_lightning" and not module.startswith("lalr_lightning."):
        return False
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).lstrip().startswith("raise")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
