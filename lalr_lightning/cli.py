"""Command line: ``python -m lalr_lightning fit|validate|test|predict --config X.yaml`` (a
LightningCLI), ``python -m lalr_lightning analyze MODEL`` (a spectral report) and
``python -m lalr_lightning report RUN_DIR`` (an HTML page of a run, :mod:`lalr_lightning.report`).

Bad input (a broken or missing checkpoint, a config value a constructor refuses, a failed
download) ends the command with one ``error:`` line rather than a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lalr_lightning.data._common import DownloadError
from lalr_lightning.models.base import CheckpointFileError, check_checkpoint_file, load_checkpoint_file

__all__ = ["ConfigError", "LalrCLI", "SaveRunConfig", "analyze_main", "load_for_analysis", "main", "run_dir"]


class ConfigError(ValueError):
    """A config the CLI cannot run; the message is one line naming the fix."""


def _prog() -> str:
    """How the user called us: the ``lalr-lightning`` console script or ``python -m lalr_lightning``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "lalr-lightning" if name.startswith("lalr-lightning") else "python -m lalr_lightning"


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
        prog = _prog()
        parser_kwargs = dict(kwargs.pop("parser_kwargs", None) or {})
        parser_kwargs.setdefault("prog", prog)
        parser_kwargs.setdefault("description", (
            f"Train, validate, test or predict from a config: {prog} fit --config configs/quickstart.yaml. "
            f"Per-layer spectral report (HT-SR alpha, ESD plots) of a model or checkpoint: {prog} analyze MODEL "
            f"(see {prog} analyze --help). "
            f"HTML page of a run's per-layer decisions: {prog} report RUN_DIR."
        ))
        kwargs["parser_kwargs"] = parser_kwargs
        super().__init__(pl.LightningModule, pl.LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.num_classes", "model.init_args.num_classes", apply_on="instantiate")

    def _subconfig(self):
        sub = self.config.get("subcommand")
        return self.config[sub] if sub else self.config

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
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


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


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
    writer = _writer_of(ckpt, dirs)
    if writer is None:
        return (f"model.init_args.checkpoint: {ckpt} does not exist; pass an existing checkpoint or state-dict "
                "file (--model.init_args.checkpoint PATH)")
    try:
        shown = writer.resolve().relative_to(Path.cwd())
    except ValueError:
        shown = writer
    return (f"{ckpt} does not exist: it is written by {shown}; run "
            f"`{_prog()} fit --config {shown}` first")


# ----------------------------------------------------------------------------- analyze


class _Shell(nn.Module):
    """A module tree rebuilt from a state dict: one Linear/Conv shell per weight matrix, so a
    checkpoint can be analyzed without the class that wrote it."""


def _module_from_state_dict(state: dict[str, torch.Tensor]) -> nn.Module:
    root = _Shell()
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
                parent.add_module(part, _Shell())
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
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{spec} is a directory without config.json; expected a Hugging Face model directory")
        try:
            from transformers import AutoModel, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError('analyzing a Hugging Face directory needs transformers: pip install "lalr_lightning[text]"') from e
        try:  # a causal LM keeps its lm_head; other architectures load as their base model
            return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        except ValueError:
            return AutoModel.from_pretrained(str(path), local_files_only=True)
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
    return timm.create_model(spec, pretrained=pretrained)


def _streamed(spec: str) -> bool:
    """Whether ``analyze`` reads ``spec`` tensor by tensor: a .safetensors file, or a directory
    holding a safetensors checkpoint (a Hugging Face model directory)."""
    path = Path(spec)
    if path.is_file():
        return path.suffix == ".safetensors"
    return path.is_dir() and any(path.glob("*.safetensors"))


def _spectrum_yaml(df, kinds: dict[str, str], head: str | None, top_percent: float) -> tuple[str, int]:
    """Spectrum's YAML from an analyze table: the head and the embeddings always, then the top
    ``top_percent`` % by SNR of each module type (:mod:`lalr_lightning.core.spectrum`)."""
    import math

    from lalr_lightning.core.spectrum import top_by_type, unfrozen_yaml

    always = [n for n in df["name"] if n == head or kinds.get(n) == "embedding"]
    snr = {n: float(v) for n, v in zip(df["name"], df["snr"]) if n not in always and not math.isnan(float(v))}
    chosen = top_by_type(snr, top_percent)
    return unfrozen_yaml(chosen, [f"{n}.weight" for n in always]), len(always) + sum(map(len, chosen.values()))


def analyze_main(argv: list[str] | None = None) -> int:
    from lalr_lightning import viz
    from lalr_lightning.core import spectral

    p = argparse.ArgumentParser(
        prog=f"{_prog()} analyze",
        description="Per-layer HT-SR spectral report (CSV + ESD plots) of a model.",
    )
    p.add_argument("model", help="timm model name, Lightning .ckpt / state-dict file, .safetensors file, or Hugging "
                                 "Face model directory (safetensors: read one tensor at a time, never built)")
    p.add_argument("--fit", default="ks", choices=spectral.FITS, help="power-law fit (default: ks, as WeightWatcher)")
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
    p.add_argument("--preset", default=None, choices=["alphapruning"],
                   help="with --pruning: HTSRPruning's preset (alphapruning: AlphaPruning's LLM recipe)")
    p.add_argument("--unsafe-load", action="store_true",
                   help="read torch files that hold Python objects besides tensors (torch.load weights_only=False); "
                        "this runs code named in the file: only for files you trust")
    args = p.parse_args(argv)
    if args.spectrum is not None and not 0 <= args.spectrum <= 100:
        print(f"{p.prog}: error: --spectrum takes a percentage in [0, 100], got {args.spectrum:g}", file=sys.stderr)
        return 2
    if args.preset is not None and args.pruning is None or args.pruning is not None and not 0 <= args.pruning < 1:
        print(f"{p.prog}: error: --pruning takes a target sparsity in [0, 1) (--preset goes with it), got "
              f"{args.pruning}", file=sys.stderr)
        return 2
    kw = dict(fit=args.fit, min_evals=args.min_evals, dtype=torch.float64 if args.float64 else torch.float32)
    try:
        if _streamed(args.model):  # every stored matrix, lm_head included, under the checkpoint's own names
            model = None
            df, esds = spectral._analyze(args.model, device=args.device, progress=True, **kw)
            kinds = dict(zip(df["name"], df["kind"]))
            head = "lm_head" if "lm_head" in kinds else next((n for n, k in kinds.items() if k == "embedding"), None)
        else:
            model = load_for_analysis(args.model, pretrained=args.pretrained, weights_only=not args.unsafe_load)
            df, esds = spectral._analyze(model, device=args.device, **kw)
            from lalr_lightning.core.layers import output_layer

            kinds = dict(zip(df["name"], df["kind"]))
            out_layer = output_layer(model)
            head = None if out_layer is None else out_layer.name
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as e:  # ValueError includes CheckpointFileError
        print(f"{p.prog}: error: {_first_line(e)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv = out / "spectral.csv"
    df.to_csv(csv, index=False)
    print(df[["name", "alpha", "xmin", "D", "num_evals", "spectral_norm", "stable_rank"]].to_string(index=False))
    print(f"\n{len(df)} layers -> {csv.resolve()}")
    if args.spectrum is not None:
        text, n = _spectrum_yaml(df, kinds, head, args.spectrum)
        target = out / f"spectrum_{args.spectrum:g}percent.yaml"
        target.write_text(text)
        print(f"Spectrum {args.spectrum:g}%: {n} of {len(df)} matrices unfrozen -> {target.resolve()}")
    if args.pruning is not None:
        from lalr_lightning.plans import write_pruning_plan

        try:
            whole = model if model is not None else load_for_analysis(args.model, weights_only=not args.unsafe_load)
            print(write_pruning_plan(whole, args.pruning, args.preset, out)[1])
        except (ValueError, RuntimeError) as e:
            print(f"{p.prog}: error: {_first_line(e)}", file=sys.stderr)
            return 2
    if not args.no_plots:
        written = viz.save_esd_plots(model, df, out, esds=esds)
        print(f"plots -> {Path(written).resolve() if written else out.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m lalr_lightning`` and the ``lalr-lightning`` script.

    ``argv`` defaults to the command line; it is passed to LightningCLI only when given, since
    LightningCLI warns when it gets both ``args`` and a command line.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "analyze":
        raise SystemExit(analyze_main(args[1:]))
    if args and args[0] in ("prune", "perplexity"):
        from lalr_lightning import oneshot

        run = oneshot.prune_main if args[0] == "prune" else oneshot.perplexity_main
        raise SystemExit(run(args[1:], prog=f"{_prog()} {args[0]}"))
    if args and args[0] == "report":
        from lalr_lightning.report import report_main

        raise SystemExit(report_main(args[1:], prog=f"{_prog()} report"))
    try:
        LalrCLI(args=None if argv is None else args)
    except (ConfigError, CheckpointFileError, DownloadError, FileNotFoundError) as e:
        # FileNotFoundError: the datamodules' missing-dataset messages (what to download, where)
        print(f"{_prog()}: error: {_first_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
