"""The LightningModule every image model of the package shares.

A subclass only builds ``self.model`` (an ``nn.Module`` from images to logits). Keeping the
network in one attribute gives every model the same parameter-name shape
(``model.layer1.0.conv1.weight``), which is what the layer-wise callbacks and the
``core.model.layers`` helpers see.

Optimizer and scheduler are injected as callables, the LightningCLI way, so a YAML config picks
them without code::

    model:
      class_path: lalr_lightning.models.SmallResNet
      init_args:
        optimizer:
          class_path: torch.optim.SGD
          init_args: {lr: 0.1, momentum: 0.9, weight_decay: 5.0e-4}
        scheduler:
          class_path: torch.optim.lr_scheduler.CosineAnnealingLR
          init_args: {T_max: 200}        # = trainer.max_epochs (cosine over the whole run)
        scheduler_interval: epoch

Cosine annealing over the run (the TempBalance reference setting) is ``CosineAnnealingLR``
with ``T_max`` equal to ``trainer.max_epochs`` and ``scheduler_interval: epoch``; the scheduler
callable only receives the optimizer, so ``T_max`` is written in the config. A mismatch with
``trainer.max_epochs`` is reported as a warning when the optimizers are configured. ``ReduceLROnPlateau`` watches
``scheduler_monitor`` (default ``val/loss``).
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from ..core.model.layers import clean_name, matrix_layers

__all__ = [
    "CheckpointFileError",
    "ClassifierModule",
    "UnsafeCheckpointError",
    "check_checkpoint_file",
    "default_optimizer",
    "load_checkpoint_file",
    "load_pretrained",
    "read_state_dict",
    "unsafe_weights_in",
]

log = logging.getLogger(__name__)


def default_optimizer(params) -> torch.optim.Optimizer:
    """SGD(lr=0.1, momentum=0.9, weight_decay=5e-4): the CIFAR recipe of the TempBalance paper.

    A module-level function rather than a lambda so the module pickles (``ddp_spawn``,
    checkpoints' hyper-parameters).
    """
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def _weights_only_safe(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` -- torch's default since 2.6, used by Lightning to
    resume and by ``load_from_checkpoint`` -- can read ``value`` back from a checkpoint."""
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:
        return False
    return True


class ClassifierModule(pl.LightningModule):
    """Cross-entropy classifier over ``self.model`` with accuracy metrics and injected optimizer.

    Args:
        num_classes: number of classes (sets the metrics; subclasses size their head with it).
        optimizer: ``params -> Optimizer``; in YAML ``{class_path: torch.optim.SGD, init_args: {...}}``,
            in Python a ``functools.partial`` or a module-level function (``ddp_spawn`` pickles the
            module, which a lambda prevents).
        scheduler: ``optimizer -> LRScheduler`` or ``None`` for a constant LR.
        scheduler_interval: ``"epoch"`` or ``"step"``: when Lightning steps the scheduler.
        scheduler_monitor: the logged metric ``ReduceLROnPlateau`` watches.
    """

    model: nn.Module

    def __init__(
        self,
        num_classes: int = 10,
        optimizer: OptimizerCallable = default_optimizer,
        scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "epoch",
        scheduler_monitor: str = "val/loss",
    ) -> None:
        super().__init__()
        if int(num_classes) < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a callable params -> Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not callable(scheduler):
            raise TypeError(f"scheduler must be a callable optimizer -> LRScheduler, got {type(scheduler).__name__}")
        # Collects the arguments of the subclasses' __init__ too (Lightning walks the frames).
        self.save_hyperparameters()
        self._keep_checkpoints_loadable()
        self.num_classes = int(num_classes)
        self.optimizer_fn = optimizer
        self.scheduler_fn = scheduler
        self.scheduler_interval = scheduler_interval
        self.scheduler_monitor = scheduler_monitor
        # micro average = the fraction of correct predictions (torchmetrics defaults to macro)
        self.train_acc = MulticlassAccuracy(self.num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(self.num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(self.num_classes, average="micro")

    def _keep_checkpoints_loadable(self) -> None:
        """Drop hyper-parameters that ``torch.load(weights_only=True)`` cannot read back.

        Under LightningCLI the saved hyper-parameters are the parsed config (``class_path``
        dicts of plain values), which load safely and let ``load_from_checkpoint`` rebuild the
        optimizer and scheduler callables. Outside the CLI the callables themselves (functions,
        partials, lambdas) would make every checkpoint of the module unreadable with torch's
        default ``weights_only=True``, and break resuming with ``Trainer.fit(ckpt_path=...)``:
        those are left out of ``hparams`` (the module still uses them; pass them again to
        ``load_from_checkpoint`` if needed). Paths are stored as strings. ``unsafe_load`` is not
        stored: it opted in for this run's ``checkpoint`` file, and a checkpoint must not carry
        that opt-in to whoever loads it next.
        """
        stores = [self.hparams]
        if isinstance(getattr(self, "_hparams_initial", None), dict):
            stores.append(self._hparams_initial)  # what loggers record
        for key in list(self.hparams):
            value = self.hparams[key]
            if isinstance(value, PurePath):
                for store in stores:
                    store[key] = str(value)
            elif key == "unsafe_load" or not _weights_only_safe(value):
                for store in stores:
                    store.pop(key, None)

    # ------------------------------------------------------------------ forward and loss

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._trainer is not None:  # resuming a fit: pruning masks without their callback are a warning
            from lightning.pytorch.utilities import rank_zero_warn

            from lalr_lightning.core.runtime.checks import orphaned_masks

            msg = orphaned_masks(checkpoint, {c.state_key for c in self._trainer.callbacks})
            if msg is not None:
                rank_zero_warn(msg, category=UserWarning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training objective; callbacks that need a loss on a probe batch call this."""
        return F.cross_entropy(logits, target)

    @staticmethod
    def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(batch, (list, tuple)):
            return batch[0], (batch[1] if len(batch) > 1 else None)
        if isinstance(batch, dict):
            return batch["image"] if "image" in batch else batch["x"], batch.get("label", batch.get("y"))
        return batch, None

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = self._split(batch)
        if y is None:
            raise ValueError(f"{stage} batches must be (images, labels); got a batch without labels")
        logits = self(x)
        loss = self.loss(logits, y)
        metric = {"train": self.train_acc, "val": self.val_acc, "test": self.test_acc}[stage]
        metric(logits, y)
        on_step = stage == "train"
        # synced on every stage: a scheduler or callback monitoring a loss must see the same
        # value on every rank (torchmetrics objects sync themselves)
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True,
                 sync_dist=True, batch_size=x.shape[0])
        self.log(f"{stage}/acc", metric, on_step=on_step, on_epoch=True, prog_bar=stage != "train",
                 batch_size=x.shape[0])
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Logits (apply ``softmax``/``argmax`` outside)."""
        x, _ = self._split(batch)
        return self(x)

    # ------------------------------------------------------------------ optimization

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_fn(self.parameters())
        if self.scheduler_fn is None:
            return optimizer
        scheduler = self.scheduler_fn(optimizer)
        config: dict[str, Any] = {"scheduler": scheduler, "interval": self.scheduler_interval}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.scheduler_monitor
        self._check_cosine(scheduler)
        return {"optimizer": optimizer, "lr_scheduler": config}

    def _check_cosine(self, scheduler: Any) -> None:
        """Warn when a cosine schedule will not end where the run ends (a common config slip)."""
        if not isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR) or self._trainer is None:
            return
        trainer = self.trainer
        if self.scheduler_interval == "epoch":
            horizon = trainer.max_epochs
        else:
            horizon = trainer.estimated_stepping_batches if trainer.max_steps == -1 else trainer.max_steps
        if horizon is None or not math.isfinite(horizon) or horizon <= 0:
            return
        if scheduler.T_max != horizon:
            rank_zero_warn(
                f"CosineAnnealingLR has T_max={scheduler.T_max} but the run is {horizon} "
                f"{self.scheduler_interval}s long; set T_max to {horizon} in the config for one cosine over the run"
            )


# ---------------------------------------------------------------------- checkpoint loading


class CheckpointFileError(ValueError):
    """A file that cannot be read as a torch checkpoint; the message names the file and the problem."""


class UnsafeCheckpointError(CheckpointFileError):
    """A checkpoint holding Python objects beyond tensors and plain containers: unpickling them
    runs code named in the file, so it is loaded only on explicit request."""


def check_checkpoint_file(path: str | Path) -> str:
    """Check that ``path`` looks like a complete ``torch.save`` file, without unpickling it.

    Returns ``"zip"`` (torch's format since 1.6), ``"legacy"`` (a bare pickle) or, by its suffix,
    ``"safetensors"`` (checked when it is read). Raises
    ``FileNotFoundError`` for a missing file and :class:`CheckpointFileError` (one line naming the
    file) for a directory, an empty file, a truncated or corrupt zip archive, or anything else.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"no such checkpoint file: {path}")
    if not p.is_file():
        raise CheckpointFileError(f"{path} is a directory, not a checkpoint file")
    if p.stat().st_size == 0:
        raise CheckpointFileError(f"{path} is empty (0 bytes), not a checkpoint; was it written completely?")
    if p.suffix == ".safetensors":
        return "safetensors"
    with open(p, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError, EOFError):
            raise CheckpointFileError(
                f"{path} is truncated or corrupt: its zip archive cannot be read (an interrupted save or copy?); "
                "save or copy it again"
            ) from None
        if not any(n.endswith("data.pkl") for n in names):
            raise CheckpointFileError(f"{path} is a zip archive but not a torch checkpoint (no data.pkl inside)")
        return "zip"
    if head[:1] == b"\x80":  # pickle protocol >= 2: torch's pre-1.6 format
        return "legacy"
    kind = "text" if all(32 <= b < 127 or b in b"\t\r\n" for b in head) else "binary data"
    raise CheckpointFileError(
        f"{path} is not a torch checkpoint: it holds {kind} starting with {head!r}, "
        "not a torch.save zip archive or pickle"
    )


def load_checkpoint_file(
    path: str | Path,
    *,
    weights_only: bool = True,
    mmap: bool = False,
    unsafe_hint: str = "pass weights_only=False",
) -> Any:
    """``torch.load(path, map_location="cpu")`` (``.safetensors``: safetensors' ``load_file``) with one
    clear error line per broken file.

    The one place the package reads checkpoints (``analyze``, ``fit --ckpt_path`` and models'
    ``checkpoint=``). ``weights_only=True`` (the default) refuses files holding Python objects
    beyond tensors and plain containers, since unpickling them runs code named in the file; the
    :class:`UnsafeCheckpointError` lists those objects and ends with ``unsafe_hint`` (how the
    caller opts in). ``mmap=True`` maps the tensors instead of reading them (a cheap check of a
    zip checkpoint). Missing file: ``FileNotFoundError``; empty, truncated or not a checkpoint:
    :class:`CheckpointFileError`.
    """
    kind = check_checkpoint_file(path)
    if kind == "safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(Path(path).expanduser()), device="cpu")
        except SafetensorError as e:
            raise CheckpointFileError(f"{path} is not a readable safetensors file ({_first_line(e)})") from None
    try:
        return torch.load(Path(path).expanduser(), map_location="cpu", weights_only=weights_only,
                          mmap=mmap and kind == "zip")
    except pickle.UnpicklingError as e:
        if weights_only and "Weights only load failed" in str(e):
            try:
                names = torch.serialization.get_unsafe_globals_in_checkpoint(str(Path(path).expanduser()))
            except Exception:
                names = []
            what = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") if names else "Python objects"
            raise UnsafeCheckpointError(
                f"{path} holds Python objects besides tensors ({what}); loading it runs code named in the file. "
                f"Only if you trust the file, {unsafe_hint}"
            ) from None
        raise CheckpointFileError(f"{path} is corrupt: unpickling failed ({_first_line(e)})") from None
    except EOFError:
        raise CheckpointFileError(f"{path} is truncated: the file ends in the middle of the checkpoint") from None
    except (AttributeError, ImportError) as e:  # weights_only=False: a class the file names is not importable
        raise CheckpointFileError(
            f"{path} names Python code that cannot be imported here ({_first_line(e)}); "
            "load it where the classes it was saved with are importable"
        ) from None
    except RuntimeError as e:
        msg = str(e)
        if "PytorchStreamReader" in msg or "magic number" in msg or "zip archive" in msg:
            raise CheckpointFileError(f"{path} is truncated or corrupt ({_first_line(e)})") from None
        raise


def unsafe_weights_in(directory: str | Path, err: BaseException) -> CheckpointFileError:
    """The one-line error for a Hugging Face ``directory`` that transformers refused to read
    (``err``, its ``UnpicklingError``): names the torch weights file holding Python objects and
    those objects. transformers reads ``.bin`` files with ``weights_only=True`` only, so no flag
    of ours opts in there."""
    for f in sorted(Path(directory).expanduser().iterdir()):
        if f.suffix not in (".bin", ".pt", ".pth") or not f.is_file():
            continue
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
        except Exception:  # noqa: BLE001 -- not a zip checkpoint: transformers' own line below
            continue
        if names:
            what = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
            return UnsafeCheckpointError(
                f"{f} holds Python objects besides tensors ({what}); loading it runs code named in the file, so "
                "transformers refuses it. Only if you trust the file, convert it to safetensors first")
    return CheckpointFileError(f"{directory}: transformers cannot read its weights safely ({_first_line(err)})")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def unsafe_hint_for(owner: str) -> str:
    """How a model's ``checkpoint=`` opts in to a file holding Python objects: ``unsafe_load``
    (``fit``: ``--model.init_args.unsafe_load true``), the model's own argument."""
    return (f"pass unsafe_load=True to {owner} (fit: --model.init_args.unsafe_load true; "
            "analyze: --unsafe-load)")


def _read_weights(path: str | Path, *, weights_only: bool = True,
                  unsafe_hint: str = "pass weights_only=False to read_state_dict"
                  ) -> tuple[dict[str, torch.Tensor], bool]:
    """(tensors of the file with clean names, whether it is a Lightning checkpoint/module state dict).

    A file holding Python objects besides tensors is refused (:class:`UnsafeCheckpointError`,
    ending with ``unsafe_hint``) unless ``weights_only=False``: unpickling it runs code the file
    names, so it is read only where the caller opted in."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"checkpoint file {str(path)!r} does not exist; pass the path of a local Lightning .ckpt or a "
            "state-dict file (.pth, .pt, .bin, .safetensors)"
        )
    obj: Any = load_checkpoint_file(p, weights_only=weights_only, unsafe_hint=unsafe_hint)
    lightning = isinstance(obj, Mapping) and "pytorch-lightning_version" in obj
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{p} holds no state dict (expected a Lightning checkpoint or a mapping name -> tensor)")
    sd = {clean_name(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if any(k.startswith("model.") for k in sd):
        lightning = True
        other = [k for k in sd if not k.startswith("model.")]
        if other:
            log.info("%s: ignoring %d entries outside `model.` (%s)", p, len(other), ", ".join(other[:5]))
        sd = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    return sd, lightning


def read_state_dict(path: str | Path, *, weights_only: bool = True) -> dict[str, torch.Tensor]:
    """The network weights stored in ``path``, keyed like ``module.model.state_dict()``.

    Accepts a Lightning ``.ckpt`` (its ``state_dict``; keys ``model.*`` of our modules, the
    prefix removed, other entries ignored), a torch file holding a state dict (bare, or under
    ``state_dict`` / ``model``) or a ``.safetensors`` file. Wrapper prefixes (``module.``,
    ``_orig_mod.``) are removed. A file holding Python objects besides tensors (custom classes,
    a pickled module) is refused in one :class:`UnsafeCheckpointError` line, since reading it
    runs code named in the file; ``weights_only=False`` reads it (only files you trust).
    """
    return _read_weights(path, weights_only=weights_only)[0]


def head_name(net: nn.Module) -> str | None:
    """The module name of the classifier: timm's ``get_classifier()``, else the last weight matrix."""
    get = getattr(net, "get_classifier", None)
    if callable(get):
        clf = get()
        if isinstance(clf, nn.Module):
            for name, mod in net.named_modules():
                if mod is clf and any(True for _ in mod.parameters()):
                    return name
    layers = matrix_layers(net, tie_norms=False)
    return layers[-1].name if layers else None


def _under(key: str, prefix: str | None) -> bool:
    return prefix is not None and (key == prefix or key.startswith(prefix + "."))


def load_pretrained(
    module: nn.Module, path: str | Path | Mapping[str, torch.Tensor], *, droppable: Sequence[str] = (),
    unsafe_load: bool = False,
) -> dict[str, list[str]]:
    """Load the weights of a checkpoint of the same architecture into ``module.model``.

    For pretrain-then-fine-tune: the classifier head (timm's ``get_classifier()`` or the last
    weight matrix) is dropped and keeps its fresh initialization when its shape differs (another
    number of classes) or the file has none; modules listed in ``droppable`` (e.g. ``conv1``
    for a replaced stem) likewise. Any other mismatch is an error, since it means a checkpoint
    of another architecture. ``path`` may also be a state dict already read by
    :func:`read_state_dict`. Returns ``{"loaded": [...], "dropped": [...]}`` and logs what was
    dropped. A file holding Python objects besides tensors is refused unless ``unsafe_load``
    (the models' argument of the same name).
    """
    net = module.model if isinstance(getattr(module, "model", None), nn.Module) else module
    sd = dict(path) if isinstance(path, Mapping) else _read_weights(
        path, weights_only=not unsafe_load, unsafe_hint=unsafe_hint_for(type(module).__name__))[0]
    if isinstance(path, Mapping):
        path = "the given state dict"
    target = net.state_dict()
    head = head_name(net)
    allowed = [head, *droppable]
    dropped, wrong = [], []
    for k in list(sd):
        if k in target and sd[k].shape != target[k].shape:
            if any(_under(k, a) for a in allowed):
                dropped.append(f"{k} {tuple(sd.pop(k).shape)} -> {tuple(target[k].shape)}")
            else:
                wrong.append(f"{k}: file {tuple(sd[k].shape)}, model {tuple(target[k].shape)}")
    missing = [k for k in target if k not in sd and not k.endswith("num_batches_tracked")]
    fresh = [k for k in missing if any(_under(k, a) for a in allowed)]
    missing = [k for k in missing if k not in fresh]
    unexpected = [k for k in sd if k not in target]
    if wrong or missing or unexpected:
        parts = [f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                 for label, items in (("shape mismatch", wrong), ("missing", missing), ("unexpected", unexpected))
                 if items]
        raise ValueError(
            f"{path} does not fit {type(net).__name__} ({'; '.join(parts)}). Is it a checkpoint of the same "
            "architecture (model name, width, in_channels, cifar_stem)?"
        )
    net.load_state_dict(sd, strict=False)
    if fresh:
        log.warning("loaded %s into %s; not from the checkpoint (kept their fresh initialization): %s",
                    path, type(net).__name__, "; ".join(dropped) if dropped else ", ".join(fresh))
    else:
        log.info("loaded %s into %s: all %d tensors", path, type(net).__name__, len(sd))
    return {"loaded": sorted(sd), "dropped": sorted(fresh)}
