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

The commands' shared parts are :mod:`.common` (the command list, one-line errors), the
shipped configs :mod:`.configs`, ``analyze`` :mod:`.analyze`; LightningCLI's side is
:mod:`lalr_lightning.lightning_cli`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

from lalr_lightning.cli import common
from lalr_lightning.cli.analyze import _streamed, analyze_main, load_for_analysis
from lalr_lightning.cli.common import (
    COMMANDS,
    ConfigError,
    _first_line,
    _one_line,
    _prog,
    _raised_by_library,
    _show_traceback,
)
from lalr_lightning.cli.configs import config_dirs, configs_main, packaged_configs, resolve_config

if TYPE_CHECKING:  # imported on first use (module __getattr__): they load Lightning
    from lalr_lightning.lightning_cli import LalrCLI, SaveRunConfig, run_dir  # noqa: F401

__all__ = ["COMMANDS", "ConfigError", "LalrCLI", "SaveRunConfig", "analyze_main", "config_dirs", "load_for_analysis", "main",
           "packaged_configs", "resolve_config", "run_dir"]


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
    args = list(sys.argv[1:] if argv is None else argv)
    if "--traceback" in args:
        common._TRACEBACK = True
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
