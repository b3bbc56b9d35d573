"""The Lightning side of the command line: ``fit`` / ``validate`` / ``test`` / ``predict`` through
:class:`LalrCLI` (a LightningCLI). Kept apart from :mod:`lalr_lightning.cli` so the other commands
(``analyze``, ``prune``, ``perplexity``, ``zeroshot``, ``report``, ``configs``) and ``--help`` start
without importing Lightning; ``lalr_lightning.cli`` still exports these names.
"""

from __future__ import annotations

import os
import sys

import lightning.pytorch as pl
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lalr_lightning.cli.common import COMMANDS, ConfigError, _first_line, _prog, _show_traceback, parse_error_line
from lalr_lightning.cli.configs import _missing_checkpoint_message, _resolve_config_args
from lalr_lightning.models.base import CheckpointFileError, check_checkpoint_file, load_checkpoint_file

__all__ = ["LalrCLI", "SaveRunConfig", "run_dir"]


def run_dir(trainer: pl.Trainer) -> str:
    """The directory of this run: the logger's version directory, where Lightning also puts the
    run's ``checkpoints/`` (``save_dir/name/version``; for W&B the version is the run id)."""
    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        return logger.log_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version)


class SaveRunConfig(SaveConfigCallback):
    """Saves the parsed config as ``config.yaml`` in the run's own directory (:func:`run_dir`) and,
    with a ``WandbLogger``, into the W&B run config under ``cli`` (``cli.trainer.callbacks`` ...).

    Lightning's default writes to ``trainer.log_dir``, which for W&B (and any logger without a
    version directory) is the ``save_dir`` every run shares: each run overwrote the previous
    run's config, and the settings never reached W&B.
    """

    def __init__(self, parser, config, config_filename: str = "config.yaml", overwrite: bool = False,
                 multifile: bool = False, save_to_log_dir: bool = True) -> None:
        # the file is written by save_config below, into the run's directory
        super().__init__(parser, config, config_filename, overwrite, multifile, save_to_log_dir=False)

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        out = run_dir(trainer)  # rank zero only (Lightning calls save_config there)
        os.makedirs(out, exist_ok=True)
        self.parser.save(self.config, os.path.join(out, self.config_filename), skip_none=False,
                         overwrite=self.overwrite, multifile=self.multifile)
        wandb_loggers = [lg for lg in trainer.loggers if type(lg).__name__ == "WandbLogger"]
        if wandb_loggers:
            settings = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
            settings.pop("config", None)  # the paths of the YAML files given, not settings
            for lg in wandb_loggers:  # under one key: Lightning adds the module's hparams beside it
                lg.experiment.config.update({"cli": settings}, allow_val_change=True)


class _Parser(LightningArgumentParser):
    """LightningCLI's parser, whose errors are one line (with ``--traceback``: jsonargparse's usage
    and full message, then the one line)."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = parse_error_line(message, parser)
        if _show_traceback():
            try:
                super().error(message, ex)
            finally:
                sys.stderr.write(f"{_prog()}: error: {line}\n")
        sys.stderr.write(f"{_prog()}: error: {line}\n")
        self.exit(2)


class LalrCLI(LightningCLI):
    """LightningCLI over any LightningModule and LightningDataModule (``class_path`` in YAML).

    The datamodule knows its number of classes; the model takes it from there, so a config
    names the dataset once. After ``fit`` it prints where the logs and checkpoints went.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_callback", SaveRunConfig)
        # each run has its own directory, so overwriting only ever replaces the run's own file
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", _Parser)
        prog = _prog()
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("prog", prog)
        parser_kwargs.setdefault("description", (
            f"Commands: {', '.join(COMMANDS)} ({prog} COMMAND --help for each). "
            f"Train, validate, test or predict from a config: {prog} fit --config configs/quickstart.yaml "
            f"(or a shipped config by name: --config quickstart; {prog} configs lists them). "
            f"Per-layer spectral report (HT-SR alpha, ESD plots) of a model or checkpoint: {prog} analyze MODEL "
            f"(see {prog} analyze --help). "
            f"Prune a Hugging Face causal LM one shot (Wanda, SparseGPT, magnitude; AlphaPruning's ratios): "
            f"{prog} prune MODEL_DIR --out OUT_DIR; its perplexity on a text: {prog} perplexity MODEL_DIR --data FILE. "
            f"HTML page of a run's per-layer decisions: {prog} report RUN_DIR. "
            "Errors are one line; --traceback (or LALR_TRACEBACK=1) shows the traceback."
        ))
        kwargs["parser_kwargs"] = parser_kwargs
        super().__init__(pl.LightningModule, pl.LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def _subconfig(self):
        sub = self.config.get("subcommand")
        return self.config[sub] if sub else self.config

    def parse_arguments(self, parser, args) -> None:
        if args is None:  # the command line; parsed here so LightningCLI does not warn about args
            self.config = parser.parse_args(_resolve_config_args(sys.argv[1:]))
        else:
            super().parse_arguments(parser, _resolve_config_args(args) if isinstance(args, list) else args)
        # Lightning reads --ckpt_path right after parsing (its hyper-parameters) and again in
        # fit; check the file first so a broken one is named in one line.
        ckpt = self._subconfig().get("ckpt_path")
        if ckpt and str(ckpt) not in ("last", "best", "hpc") and not str(ckpt).startswith("registry") \
                and "://" not in str(ckpt):
            try:
                load_checkpoint_file(ckpt, mmap=True, unsafe_hint=(
                    "resume from Python instead: Trainer.fit(model, datamodule, ckpt_path=..., weights_only=False) "
                    "(the CLI reads checkpoints with weights_only=True)"))
            except FileNotFoundError:
                raise ConfigError(f"--ckpt_path {ckpt}: no such file") from None
            except CheckpointFileError as e:
                raise ConfigError(f"--ckpt_path: {e}") from None

    def before_instantiate_classes(self) -> None:
        cfg = self._subconfig()
        accumulate = cfg.get("trainer.accumulate_grad_batches")
        if accumulate is not None and accumulate < 1:  # Lightning takes it, then divides by it in the first step
            raise ConfigError(f"trainer.accumulate_grad_batches must be an integer >= 1 (batches per optimizer "
                              f"step), got {accumulate}")
        ckpt = cfg.get("model.init_args.checkpoint")
        if not ckpt:
            return
        try:
            check_checkpoint_file(ckpt)
        except FileNotFoundError:
            raise ConfigError(_missing_checkpoint_message(str(ckpt), cfg.get("config") or [])) from None
        except CheckpointFileError as e:
            raise ConfigError(f"model.init_args.checkpoint: {e}") from None

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except MisconfigurationException as e:  # the Trainer's own checks of its arguments: the message is the fix
            raise ConfigError(f"trainer: {_first_line(e)}") from e
        except ValueError as e:
            # jsonargparse reports a constructor's error inside a many-line "Does not validate
            # against any of the Union subtypes" message; the constructor's own line is the cause
            cause = e.__cause__
            if isinstance(cause, (ValueError, TypeError, OSError, ImportError)):
                raise ConfigError(_first_line(cause)) from cause
            raise

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        val = {k: float(v) for k, v in sorted(trainer.callback_metrics.items())
               if k.startswith("val") and getattr(v, "numel", lambda: 1)() == 1}
        if val:  # the last validation's metrics, so a run shows its result without opening a file
            print("\nvalidation: " + ", ".join(f"{k} {v:.4g}" for k, v in val.items()))
        logger = trainer.logger
        if isinstance(logger, CSVLogger):
            print(f"\nmetrics: {os.path.abspath(logger.experiment.metrics_file_path)}")
        else:
            print(f"\nlogs: {os.path.abspath(run_dir(trainer)) if trainer.loggers else '(no logger)'}")
        if type(logger).__name__ == "WandbLogger":
            print(f"wandb run: {os.path.abspath(os.path.dirname(logger.experiment.dir))}")
        ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or getattr(
            trainer.checkpoint_callback, "last_model_path", "")
        if ckpt:
            print(f"checkpoint: {os.path.abspath(ckpt)}")


