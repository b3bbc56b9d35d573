"""Command line: ``python -m lalr_lightning fit|validate|test|predict --config X.yaml`` (a
LightningCLI), ``python -m lalr_lightning analyze MODEL`` (a spectral report),
``python -m lalr_lightning report RUN_DIR`` (an HTML page of a run, :mod:`lalr_lightning.report`),
``python -m lalr_lightning prune`` / ``perplexity`` (one-shot LLM pruning, :mod:`lalr_lightning.oneshot`)
and ``python -m lalr_lightning configs`` (the shipped configs; ``--config quickstart`` runs one by
name, from a wheel as from the clone).

Bad input (a broken or missing checkpoint, a config value a constructor refuses, a typo in a key,
a failed download, an error the library raises during a run) ends the command with one
``error:`` line rather than a traceback; ``--traceback`` or ``LALR_TRACEBACK=1`` shows the
traceback (and jsonargparse's full message).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import inspect
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:  # imported on first use (module __getattr__): they load Lightning
    import torch
    from torch import nn

    from lalr_lightning.lightning_cli import LalrCLI, SaveRunConfig, run_dir  # noqa: F401

__all__ = ["COMMANDS", "ConfigError", "LalrCLI", "SaveRunConfig", "analyze_main", "config_dirs", "load_for_analysis", "main",
           "packaged_configs", "resolve_config", "run_dir"]


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


# ----------------------------------------------------------------------------- shipped configs


def config_dirs() -> list[Path]:
    """Where bare config names are looked up: ``lalr_lightning/configs`` (an installed wheel) and
    the clone's ``configs/`` beside the package (an editable install, or ``PYTHONPATH``)."""
    pkg = Path(__file__).resolve().parent
    # the clone's folder only when it holds ours: site-packages/configs may belong to anything
    return [d for d in (pkg / "configs", pkg.parent / "configs") if (d / "quickstart.yaml").is_file()]


def packaged_configs() -> dict[str, Path]:
    """``{name: path}`` of the shipped configs (``quickstart`` -> ``.../quickstart.yaml``)."""
    found: dict[str, Path] = {}
    for folder in config_dirs():
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def resolve_config(value: str) -> str:
    """A ``--config`` value as a file to read: an existing path as given; else a shipped config
    named ``value`` (``quickstart``, ``quickstart.yaml`` or ``configs/quickstart.yaml``, as in the
    README, run outside the clone). A value that names no file is refused in one line naming the
    closest shipped config; inline YAML (``--config '{trainer: ...}'``) passes through."""
    problem = _config_problem(value) if os.path.isfile(value) else None
    if problem is not None:  # jsonargparse says only "Unexpected config:", or a UnicodeDecodeError traceback
        raise ConfigError(f"--config {value} {problem}; copy a shipped config to start from: "
                          f"`{_prog()} configs quickstart > mine.yaml`")
    if os.path.exists(value) or not re.fullmatch(r"[\w./\\-]+", value):
        return value
    folder, name = os.path.split(value)
    stem = re.sub(r"\.(yaml|yml)$", "", name)
    found = packaged_configs()
    if folder in ("", "configs") and stem in found:
        return str(found[stem])
    if folder in ("", "configs") or value.endswith((".yaml", ".yml", ".json")):
        close = difflib.get_close_matches(stem, list(found), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"--config {value}: no such file, nor a shipped config of that name{hint} "
                          f"(`{_prog()} configs` lists them)")
    return value


def _config_problem(path: str) -> str | None:
    """Why the file cannot be a config (empty, not text, not a mapping of keys), or None; a YAML
    syntax error is jsonargparse's to report (it names the line)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except UnicodeDecodeError:
        return "is not a YAML file (not UTF-8 text)"
    except (OSError, yaml.YAMLError):
        return None
    if data is None:
        return "is empty (no YAML keys)"
    if not isinstance(data, dict):
        return f"holds a YAML {type(data).__name__}, not a mapping of keys (trainer:, model:, data:)"
    return None


def _resolve_config_args(args: list[str]) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("-c", "--config") and i + 1 < len(out):
            out[i + 1] = resolve_config(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg[len("--config="):])
    return out


def configs_main(argv: list[str] | None = None) -> int:
    """``configs``: list the shipped configs with their first comment line; ``configs NAME``
    prints one (to copy and edit: ``configs quickstart > mine.yaml``)."""
    p = argparse.ArgumentParser(prog=f"{_prog()} configs", description=(
        "The configs shipped with lalr_lightning; run one by name: fit --config NAME."))
    p.add_argument("name", nargs="?", help="print this config (to copy and edit)")
    args = p.parse_args(argv)
    found = packaged_configs()
    if args.name:
        try:
            path = Path(resolve_config(args.name))
            text = path.read_text()
        except ConfigError as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            return 2
        except (OSError, UnicodeDecodeError) as e:  # a directory, a binary file
            why = "a directory" if path.is_dir() else getattr(e, "strerror", None) or "not UTF-8 text"
            print(f"{p.prog}: error: {args.name} is not a config file ({why}); `{_prog()} configs` lists the "
                  "shipped ones", file=sys.stderr)
            return 2
        print(text, end="")
        return 0
    width = max(map(len, found), default=0)
    for name, path in found.items():
        comment = next((ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        print(f"{name:<{width}}  {comment}")
    where = sorted({str(path.parent) for path in found.values()})
    print(f"\n{len(found)} configs in {', '.join(where)}; run one with: {_prog()} fit --config NAME")
    return 0


# ----------------------------------------------------------------------------- parser errors


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


def _writer_of(ckpt: str, config_dirs: list[Path]) -> Path | None:
    """The config among ``config_dirs``' YAML files whose ModelCheckpoint writes ``ckpt``."""
    target = os.path.normpath(ckpt)
    for folder in config_dirs:
        for path in sorted(folder.glob("*.yaml")):
            try:
                cfg = yaml.safe_load(path.read_text())
                callbacks = cfg["trainer"]["callbacks"]
            except (OSError, yaml.YAMLError, KeyError, TypeError):  # unreadable, or no trainer callbacks
                continue
            for cb in callbacks if isinstance(callbacks, list) else [callbacks]:
                if not isinstance(cb, dict) or not str(cb.get("class_path", "")).endswith("ModelCheckpoint"):
                    continue
                args = cb.get("init_args") or {}
                if args.get("dirpath") and args.get("filename") and \
                        os.path.normpath(os.path.join(args["dirpath"], args["filename"] + ".ckpt")) == target:
                    return path
    return None


def _missing_checkpoint_message(ckpt: str, configs) -> str:
    """One line: the pre-trained checkpoint is missing, and the command that writes it."""
    dirs = []
    for c in configs:
        folder = Path(getattr(c, "absolute", None) or str(c)).parent
        if folder not in dirs:
            dirs.append(folder)
    if Path("configs").is_dir() and Path("configs").resolve() not in [d.resolve() for d in dirs]:
        dirs.append(Path("configs"))
    shipped = [d.resolve() for d in config_dirs()]
    dirs += [d for d in shipped if d not in [x.resolve() for x in dirs]]
    writer = _writer_of(ckpt, dirs)
    if writer is None:
        return (f"model.init_args.checkpoint: {ckpt} does not exist; pass an existing checkpoint or state-dict "
                "file (--model.init_args.checkpoint PATH)")
    try:
        shown = writer.resolve().relative_to(Path.cwd())
    except ValueError:  # a shipped config is run by its name
        shown = writer.stem if writer.resolve().parent in shipped else writer
    return (f"{ckpt} does not exist: it is written by {shown}; run "
            f"`{_prog()} fit --config {shown}` first")


# ----------------------------------------------------------------------------- analyze


def _shell():
    """A module tree node rebuilt from a state dict: one Linear/Conv shell per weight matrix, so a
    checkpoint can be analyzed without the class that wrote it (defined on first use: torch is
    imported only once a command needs it)."""
    global _Shell
    if _Shell is None:
        from torch import nn

        class _Shell(nn.Module):  # noqa: N801 -- the name shown by repr(module)
            pass
    return _Shell()


_Shell = None


def _module_from_state_dict(state: dict[str, torch.Tensor]) -> nn.Module:
    import torch
    from torch import nn

    root = _shell()
    for key, w in state.items():
        if not key.endswith("weight") or not isinstance(w, torch.Tensor) or w.ndim not in (2, 3, 4):
            continue
        if not w.is_floating_point():
            continue
        path = key[: -len(".weight")] if key.endswith(".weight") else key
        if w.ndim == 2:
            mod: nn.Module = nn.Linear(1, 1, bias=False)
        elif w.ndim == 3:
            mod = nn.Conv1d(1, 1, 1, bias=False)
        else:
            mod = nn.Conv2d(1, 1, 1, bias=False)
        mod.weight = nn.Parameter(w.detach().float(), requires_grad=False)
        parent = root
        parts = path.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, _shell())
            parent = getattr(parent, part)
        parent.add_module(parts[-1], mod)
    return root


def load_for_analysis(spec: str, *, pretrained: bool = False, weights_only: bool = True) -> nn.Module:
    """A module from a timm model name, a Lightning checkpoint / torch or safetensors state
    dict file, or a Hugging Face model directory.

    Torch files are read with ``weights_only=True``: a file holding other Python objects (a
    pickled ``nn.Module``, custom classes) is refused, since unpickling it runs code named in
    the file; ``weights_only=False`` (``analyze --unsafe-load``) reads it when you trust it.
    """
    from torch import nn

    from lalr_lightning.models.base import load_checkpoint_file

    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{spec} is a directory without config.json; expected a Hugging Face model directory")
        try:
            from transformers import AutoModel, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError('analyzing a Hugging Face directory needs transformers: pip install "lalr_lightning[text]"') from e
        from lalr_lightning.oneshot.checkpoint import _load_config

        config = _load_config(path)  # a config.json that does not read: one line, as prune says it
        try:  # a causal LM keeps its lm_head; other architectures load as their base model
            return AutoModelForCausalLM.from_pretrained(str(path), config=config, local_files_only=True)
        except ValueError:
            return AutoModel.from_pretrained(str(path), config=config, local_files_only=True)
    if path.is_file():
        state = load_checkpoint_file(path, weights_only=weights_only, unsafe_hint=(
            "pass --unsafe-load to analyze (Python: load_for_analysis(..., weights_only=False))"))
        if isinstance(state, dict) and "state_dict" in state:  # Lightning checkpoint
            state = state["state_dict"]
        if isinstance(state, nn.Module):
            return state
        if not isinstance(state, dict):
            raise ValueError(f"{spec}: expected a state dict or a Lightning checkpoint, found {type(state).__name__}")
        return _module_from_state_dict(state)
    if os.sep in spec or spec.endswith((".ckpt", ".pt", ".pth", ".bin", ".safetensors")):
        raise FileNotFoundError(f"no such file or directory: {spec}")
    import timm

    if not timm.is_model(spec):
        raise ValueError(
            f"{spec!r} is neither a file, a directory, nor a timm model name; "
            "see timm.list_models() for names, or pass a checkpoint path"
        )
    if not pretrained:
        return timm.create_model(spec)
    offline = _hub_offline()
    if offline:  # the weights can only come from the local cache: say so now, not after retries
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True  # read at call time by huggingface_hub
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        return timm.create_model(spec, pretrained=True)
    except Exception as e:  # noqa: BLE001 -- any download failure, offline, is the missing cache
        if not offline:
            raise
        raise RuntimeError(
            f"{spec} --pretrained: {offline}, and its weights are not in the local cache "
            f"({os.environ.get('HF_HOME') or '~/.cache/huggingface'}); run once with network, or analyze a "
            f"checkpoint file ({type(e).__name__})") from e


def _hub_offline(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE set, or no connection to it
    within ``timeout`` seconds), or None. Checked before a pretrained download, which otherwise
    retries for most of a minute before failing."""
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows; let the download try
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"no network: {host}:{port} unreachable ({e.strerror or type(e).__name__})"
    return None


def _streamed(spec: str) -> bool:
    """Whether ``analyze`` reads ``spec`` tensor by tensor: a .safetensors file, or a directory
    holding a safetensors checkpoint (a Hugging Face model directory)."""
    path = Path(spec)
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and any(path.glob("*.safetensors"))


def _with_small_matrices(args: argparse.Namespace, df, kinds: dict[str, str], model):
    """(table, kinds) with the SNR of the matrices --min-evals left out of the table too: Spectrum's
    ranking needs no fit, and SpectrumSelect ranks every matrix (a YAML without them froze them)."""
    if args.min_evals <= 1:
        return df, kinds
    import warnings

    import pandas as pd

    from lalr_lightning.core.spectral import htsr

    source = args.model if model is None else model  # None: streamed from the checkpoint
    with warnings.catch_warnings():  # "skips ... with more than max_evals": the table's own layers
        warnings.simplefilter("ignore", UserWarning)
        small, _ = htsr._analyze(source, metrics=["snr"], min_evals=1, max_evals=args.min_evals - 1,
                                 device=args.device, progress=False)
    small = small[~small["name"].isin(df["name"])]
    if small.empty:
        return df, kinds
    return (pd.concat([df[["name", "snr"]], small[["name", "snr"]]], ignore_index=True),
            {**kinds, **dict(zip(small["name"], small["kind"]))})


def _spectrum_yaml(df, kinds: dict[str, str], head: str | None, top_percent: float) -> tuple[str, int]:
    """Spectrum's YAML from an analyze table: the head and the embeddings always, then the top
    ``top_percent`` % by SNR of each module type (:mod:`lalr_lightning.core.spectral.spectrum_snr`)."""
    import math

    from lalr_lightning.core.spectral.spectrum_snr import top_by_type, unfrozen_yaml

    always = [n for n in df["name"] if n == head or kinds.get(n) == "embedding"]
    snr = {n: float(v) for n, v in zip(df["name"], df["snr"]) if n not in always and not math.isnan(float(v))}
    chosen = top_by_type(snr, top_percent)
    return unfrozen_yaml(chosen, [f"{n}.weight" for n in always]), len(always) + sum(map(len, chosen.values()))


#: which alpha fit a report used, and how to read the numbers a callback would see
_FIT_NOTES = {
    "ks": "alpha fit: ks (WeightWatcher's xmin, the KS-distance minimum). TempBalanceCallback fits 'median' by "
          "default, which gives other alphas: --fit median shows its reading",
    "median": "alpha fit: median (TempBalanceCallback's default, xmin at the median eigenvalue). WeightWatcher's "
              "fit: --fit ks",
    "peak": "alpha fit: peak (TempBalance's xmin_peak). TempBalanceCallback's default: --fit median; "
            "WeightWatcher's: --fit ks",
}


def _analyze_parser() -> argparse.ArgumentParser:
    from lalr_lightning.choices import FITS, PRESETS

    p = argparse.ArgumentParser(
        prog=f"{_prog()} analyze",
        description="Per-layer HT-SR spectral report (CSV + ESD plots) of a model.",
    )
    p.add_argument("model", help="timm model name, Lightning .ckpt / state-dict file, .safetensors file, or Hugging "
                                 "Face model directory (safetensors: read one tensor at a time, never built)")
    p.add_argument("--fit", default="ks", choices=FITS, help="power-law fit (default: ks, as WeightWatcher)")
    p.add_argument("--out", default="spectral_report", help="output directory (default: ./spectral_report)")
    p.add_argument("--pretrained", action="store_true", help="timm names: load pretrained weights (needs the hub)")
    p.add_argument("--min-evals", type=int, default=10, help="skip layers with fewer eigenvalues (default 10)")
    p.add_argument("--float64", action="store_true", help="compute in float64")
    p.add_argument("--device", default=None, help="where the eigenvalues are computed (cpu, cuda, cuda:1; default: "
                                                  "the weights' device, cpu for a checkpoint)")
    p.add_argument("--no-plots", action="store_true", help="write the CSV only")
    p.add_argument("--spectrum", type=float, default=None, metavar="P",
                   help="also write Spectrum's YAML of unfrozen parameters: the head, the embeddings and the top P%% "
                        "of matrices by SNR of each module type (spectrum_<P>percent.yaml in --out)")
    p.add_argument("--pruning", type=float, default=None, metavar="S",
                   help="also write the per-layer ratios HTSRPruning(target_sparsity=S) gives these weights "
                        "(pruning_<preset>_<S>.csv in --out; the same as callback.plan(model)); a Hugging Face "
                        "directory or .safetensors file is then loaded whole")
    p.add_argument("--preset", default=None, choices=[p for p in PRESETS if p != "owl"],
                   help="with --pruning: HTSRPruning's preset (alphapruning: AlphaPruning's LLM recipe)")
    p.add_argument("--head", action="store_true",
                   help="with --pruning: prune the output layer too (HTSRPruning(head=True); left dense by default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    p.add_argument("--unsafe-load", action="store_true",
                   help="read torch files that hold Python objects besides tensors (torch.load weights_only=False); "
                        "this runs code named in the file: only for files you trust")
    return p


def _analyze_args_error(args: argparse.Namespace) -> str | None:
    """The one-line error for arguments that need no file (checked before the work), or None."""
    if args.spectrum is not None and not 0 <= args.spectrum <= 100:
        return f"--spectrum takes a percentage in [0, 100], got {args.spectrum:g}"
    if args.head and args.pruning is None:
        return "--head goes with --pruning S (it prunes the output layer too): add --pruning S"
    if args.preset is not None and args.pruning is None:
        return f"--pruning takes a target sparsity in [0, 1), and --preset {args.preset} needs it: add --pruning S"
    if args.pruning is not None and not 0 <= args.pruning < 1:
        return f"--pruning takes a target sparsity in [0, 1), got {args.pruning}"
    if args.min_evals < 2:  # a power law is fitted to at least two eigenvalues, as the callbacks' min_evals
        return f"--min-evals must be at least 2 (a fit needs two eigenvalues), got {args.min_evals}"
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # the work would end in FileExistsError
        return (f"--out {out} is an existing file; --out names a directory (created if missing) for "
                "spectral.csv and the plots: pass another path")
    return None


def _analyze_model(args: argparse.Namespace):
    """(table, ESDs, the model or None when streamed, layer kinds, the head's name) of ``args.model``."""
    import torch

    from lalr_lightning.core.spectral import htsr

    kw = dict(fit=args.fit, min_evals=args.min_evals, dtype=torch.float64 if args.float64 else torch.float32)
    if _streamed(args.model):  # every stored matrix, lm_head included, under the checkpoint's own names
        model = None
        df, esds = htsr._analyze(args.model, device=args.device, progress=False if args.quiet else None, **kw)
        kinds = dict(zip(df["name"], df["kind"]))
        head = "lm_head" if "lm_head" in kinds else next((n for n, k in kinds.items() if k == "embedding"), None)
    else:
        model = load_for_analysis(args.model, pretrained=args.pretrained, weights_only=not args.unsafe_load)
        df, esds = htsr._analyze(model, device=args.device, progress=False if args.quiet else None, **kw)
        from lalr_lightning.core.model.layers import output_layer

        kinds = dict(zip(df["name"], df["kind"]))
        out_layer = output_layer(model)
        head = None if out_layer is None else out_layer.name
    return df, esds, model, kinds, head


def analyze_main(argv: list[str] | None = None) -> int:
    p = _analyze_parser()
    args = p.parse_args(argv)
    error = _analyze_args_error(args)
    if error is not None:
        print(f"{p.prog}: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    created = not out.exists()
    try:  # before the work: an --out that cannot be made would lose it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"{p.prog}: error: --out {out}: cannot create the directory ({e.strerror or type(e).__name__}); "
              "pass a writable path", file=sys.stderr)
        return 2
    from lalr_lightning import viz

    try:
        df, esds, model, kinds, head = _analyze_model(args)
    except (OSError, ValueError, ImportError, RuntimeError) as e:  # ValueError includes CheckpointFileError
        print(f"{p.prog}: error: {_first_line(e)}", file=sys.stderr)
        if created:  # nothing written: leave no empty folder behind
            with contextlib.suppress(OSError):
                out.rmdir()
        return 2
    csv = out / "spectral.csv"
    df.to_csv(csv, index=False)
    print(df[["name", "alpha", "xmin", "D", "num_evals", "spectral_norm", "stable_rank"]].to_string(index=False))
    print(f"\n{len(df)} layers -> {csv.resolve()}")
    print(_FIT_NOTES[args.fit])
    if args.spectrum is not None:
        ranked, ranked_kinds = _with_small_matrices(args, df, kinds, model)
        text, n = _spectrum_yaml(ranked, ranked_kinds, head, args.spectrum)
        target = out / f"spectrum_{args.spectrum:g}percent.yaml"
        target.write_text(text)
        print(f"Spectrum {args.spectrum:g}%: {n} of {len(ranked)} matrices unfrozen -> {target.resolve()}")
    if args.pruning is not None:
        from lalr_lightning.plans import write_pruning_plan

        try:
            whole = model if model is not None else load_for_analysis(args.model, weights_only=not args.unsafe_load)
            print(write_pruning_plan(whole, args.pruning, args.preset, out, head=args.head)[1])
        except (ValueError, RuntimeError) as e:  # the callback's argument names, as this command's flags
            said = _first_line(e).replace("set head=True", "pass --head")
            print(f"{p.prog}: error: {said}", file=sys.stderr)
            return 2
    if not args.no_plots:
        written = viz.save_esd_plots(model, df, out, esds=esds)
        print(f"plots -> {Path(written).resolve() if written else out.resolve()}")
    return 0


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


def _usage() -> str:
    """The top-level help: every command with one line (``python -m lalr_lightning --help``)."""
    prog = _prog()
    width = max(map(len, COMMANDS))
    lines = [f"usage: {prog} COMMAND [ARGS]", "",
             "Layer-wise fine-tuning callbacks for PyTorch Lightning, and one-shot pruning of language models.",
             f"Commands: {', '.join(COMMANDS)} ({prog} COMMAND --help for each).", ""]
    lines += [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    lines += ["", "Errors are one line; --traceback (or LALR_TRACEBACK=1) shows the traceback.",
              f"Start here: {prog} fit --config quickstart, then {prog} analyze "
              "lightning_logs/quickstart/version_0/checkpoints/last.ckpt; the shipped configs: "
              f"{prog} configs"]
    return "\n".join(lines)


def _hide_torchvision() -> None:
    """Keep torchvision out of a one-shot command's process. Transformers 5 imports it (for its image
    utilities) as soon as a config is read, whenever it is installed; a causal LM never uses it. A
    ``None`` entry in ``sys.modules`` makes ``importlib.util.find_spec`` report it missing, so
    transformers takes its no-torchvision path. Only on the command line (``main()`` without
    ``argv``): a Python process that called ``main([...])`` keeps its imports as they are."""
    if "torchvision" not in sys.modules and os.environ.get("LALR_KEEP_TORCHVISION", "") in ("", "0"):
        sys.modules["torchvision"] = None  # type: ignore[assignment]


def _lightning_main(args: list[str], given: bool) -> None:
    from lalr_lightning.data._common import DownloadError
    from lalr_lightning.lightning_cli import LalrCLI
    from lalr_lightning.models.base import CheckpointFileError

    try:
        LalrCLI(args=args if given else None)
    except (ConfigError, CheckpointFileError, DownloadError, FileNotFoundError) as e:
        # FileNotFoundError: the datamodules' missing-dataset messages (what to download, where)
        if _show_traceback():
            raise
        print(f"{_prog()}: error: {_first_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ValueError, TypeError, RuntimeError) as e:
        # the library's own errors raised inside Lightning's hooks (no layers found, a layer or
        # block that does not exist, too few layers): their message is the whole story
        if _show_traceback() or not _raised_by_library(e):
            raise
        print(f"{_prog()}: error: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m lalr_lightning`` and the ``lalr-lightning`` script.

    ``argv`` defaults to the command line; it is passed to LightningCLI only when given, since
    LightningCLI warns when it gets both ``args`` and a command line. ``--traceback`` anywhere
    (or ``LALR_TRACEBACK=1``) keeps the tracebacks the CLI otherwise turns into one line. Only
    ``fit`` / ``validate`` / ``test`` / ``predict`` import Lightning; every other command parses
    its arguments before importing torch. Output into a pipe whose reader has gone (``| head``)
    ends the command quietly with status 1.
    """
    try:
        _main(argv)
    except BrokenPipeError:
        if not _stdout_gone():  # another pipe of the run (a socket) broke: not ours to hide
            raise
        # Python flushes stdout again at exit: point it at devnull, so that says nothing either
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def _stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (poll reports an error on its write end)."""
    import select

    if not hasattr(select, "poll"):  # Windows: assume the broken pipe was stdout
        return True
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real stdout (captured): no pipe of ours broke
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(event & select.POLLERR for _, event in poll.poll(0))


def _main(argv: list[str] | None) -> None:
    global _TRACEBACK
    args = list(sys.argv[1:] if argv is None else argv)
    if "--traceback" in args:
        _TRACEBACK = True
        args = [a for a in args if a != "--traceback"]
        if argv is None:
            sys.argv = [sys.argv[0], *args]
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    command, rest, prog = args[0], args[1:], f"{_prog()} {args[0]}"
    # not for timm names or torch files (they may need torchvision), nor --pruning (HTSRPruning: Lightning)
    if argv is None and (command in ("prune", "perplexity", "zeroshot") or command == "analyze" and rest
                         and _streamed(rest[0]) and not any(a.startswith("--pruning") for a in rest)):
        _hide_torchvision()
    if command == "analyze":
        raise SystemExit(analyze_main(rest))
    if command in ("prune", "perplexity", "zeroshot"):
        from lalr_lightning.oneshot import commands

        raise SystemExit(getattr(commands, f"{command}_main")(rest, prog=prog))
    if command == "report":
        from lalr_lightning.report import report_main

        raise SystemExit(report_main(rest, prog=prog))
    if command == "configs":
        raise SystemExit(configs_main(rest))
    _lightning_main(args, argv is not None)


_LAZY = ("LalrCLI", "SaveRunConfig", "run_dir")


def __getattr__(name: str):
    # the LightningCLI classes live in lightning_cli.py: importing them here would load Lightning
    # for every command
    if name in _LAZY:
        from lalr_lightning import lightning_cli

        return getattr(lightning_cli, name)
    raise AttributeError(f"module 'lalr_lightning.cli' has no attribute {name!r}")
