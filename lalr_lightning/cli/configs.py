"""The shipped configs: where they are (the clone's ``configs/`` or the wheel's copy), ``--config
NAME`` resolved to a file, and ``python -m lalr_lightning configs``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path

import yaml

from lalr_lightning.cli.common import ConfigError, _prog

__all__ = [
    "config_dirs",
    "packaged_configs",
    "resolve_config",
]


def config_dirs() -> list[Path]:
    """Where bare config names are looked up: ``lalr_lightning/configs`` (an installed wheel) and
    the clone's ``configs/`` beside the package (an editable install, or ``PYTHONPATH``)."""
    pkg = Path(__file__).resolve().parents[1]  # lalr_lightning/, above this cli/ folder
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
