"""An image classifier around any timm model, offline by default.

Weights come from one of three places, chosen explicitly:

* nothing (``pretrained=False``, the default): random initialization, no network;
* ``checkpoint=<local file>``: a timm/torch state dict (``.pth``, ``.bin``, ``.safetensors``),
  loaded by timm itself (``pretrained_cfg_overlay=dict(file=...)``, so timm's own key filters
  and input-channel adaptation apply), or a Lightning ``.ckpt`` of one of our modules;
  a classifier of another size is dropped either way, and the log says so;
* ``pretrained=True`` without a checkpoint: timm's hub download (needs a network).

A fine-tuned model is reloaded with
``ImageClassifier.load_from_checkpoint(path, checkpoint=None, pretrained=False)`` so the
pretraining file (or the hub) is not needed again: the fine-tuned weights replace them anyway.
"""

from __future__ import annotations

import logging
from pathlib import Path

import timm
from torch import nn

from .base import ClassifierModule, _read_weights, head_name, load_pretrained, unsafe_hint_for

__all__ = ["ImageClassifier", "apply_cifar_stem", "load_pretrained"]

log = logging.getLogger(__name__)


def apply_cifar_stem(net: nn.Module, in_chans: int = 3) -> None:
    """Make a ResNet-style ``net`` fit 32x32 inputs: ``conv1`` becomes a 3x3 stride-1 conv and
    ``maxpool`` is removed (the CIFAR ResNet-18 of TempBalance and most CIFAR papers)."""
    conv = getattr(net, "conv1", None)
    if not isinstance(conv, nn.Conv2d):
        kind = "no conv1" if conv is None else f"conv1 is a {type(conv).__name__}, not a single Conv2d"
        raise ValueError(
            f"cifar_stem=True needs a ResNet-style model with a single Conv2d stem `conv1`, but "
            f"{type(net).__name__} has {kind}. Use a plain ResNet (resnet18, resnet34, resnet50, ...) or "
            "cifar_stem=False"
        )
    net.conv1 = nn.Conv2d(in_chans, conv.out_channels, kernel_size=3, stride=1, padding=1, bias=conv.bias is not None)
    if isinstance(getattr(net, "maxpool", None), nn.Module):
        net.maxpool = nn.Identity()


class ImageClassifier(ClassifierModule):
    """Any timm model as a classifier; ``self.model`` is the timm model (names ``model.layer1.0.conv1``).

    Args:
        model_name: a timm model name (``timm.list_models()``).
        num_classes: classes of the task; a loaded head of another size is dropped.
        in_chans: input channels (1 for digits; timm adapts pretrained RGB stems).
        pretrained: download timm's weights from the hub (needs a network) when no
            ``checkpoint`` is given.
        checkpoint: a local weights file (see the module docstring). A file holding Python
            objects besides tensors is refused (reading it runs code named in the file).
        unsafe_load: read such a ``checkpoint`` anyway (``fit --model.init_args.unsafe_load
            true``), for files you trust. Not stored in the module's hyper-parameters.
        cifar_stem: 3x3 stride-1 ``conv1`` and no max-pool, for 32x32 ResNets.
        drop_rate: dropout before the classifier (timm's ``drop_rate``).
        **kwargs: :class:`~lalr_lightning.models.base.ClassifierModule` arguments.
    """

    def __init__(self, model_name: str = "resnet18", num_classes: int = 10, in_chans: int = 3,
                 pretrained: bool = False, checkpoint: str | None = None, cifar_stem: bool = False,
                 drop_rate: float = 0.0, unsafe_load: bool = False, **kwargs) -> None:
        super().__init__(num_classes=num_classes, **kwargs)
        if not timm.is_model(model_name):
            close = timm.list_models(f"*{model_name.split('.')[0][:8]}*")[:10]
            raise ValueError(f"unknown timm model {model_name!r}; similar names: {close}")
        common = dict(num_classes=num_classes, in_chans=in_chans, drop_rate=drop_rate)
        path = None if checkpoint is None else Path(checkpoint).expanduser()
        if path is not None and not path.is_file():
            raise FileNotFoundError(
                f"checkpoint file {checkpoint!r} does not exist; pass the path of a local timm/torch state dict "
                "(.pth, .bin, .safetensors) or a Lightning .ckpt"
            )
        if path is None and pretrained:
            self.model = self._from_hub(model_name, common)
            if cifar_stem:
                log.warning("cifar_stem=True replaces the pretrained conv1 of %s with a fresh 3x3 conv", model_name)
                apply_cifar_stem(self.model, in_chans)
            return
        file_classes = None
        if path is not None:
            sd, lightning = _read_weights(path, weights_only=not unsafe_load,
                                         unsafe_hint=unsafe_hint_for(type(self).__name__))
            cfg = timm.models.get_pretrained_cfg(model_name)
            clf = getattr(cfg, "classifier", None) if cfg is not None else None
            head = sd.get(f"{clf}.weight") if isinstance(clf, str) else None
            if not (cifar_stem or lightning or head is None):
                file_classes = int(head.shape[0])
                del sd
        if file_classes is not None:
            # a timm/torch state dict with a classifier: timm's own loader (key filters,
            # input-channel adaptation) does the work
            self._from_timm_file(model_name, path, file_classes, common)
            return
        self.model = timm.create_model(model_name, pretrained=False, **common)
        if cifar_stem:
            apply_cifar_stem(self.model, in_chans)
        if path is not None:
            # Our loader: a Lightning checkpoint, a replaced stem (conv1 may differ) or a
            # headless backbone file (timm's strict load would fail on the missing head).
            load_pretrained(self, sd, droppable=("conv1",) if cifar_stem else ())

    def _from_hub(self, model_name: str, common: dict) -> nn.Module:
        try:
            return timm.create_model(model_name, pretrained=True, **common)
        except Exception as err:
            raise RuntimeError(
                f"could not fetch pretrained weights for {model_name!r} from the hub ({type(err).__name__}: {err}). "
                "Offline, download them elsewhere and pass checkpoint=<local file> (a timm/torch .pth, .bin, "
                ".safetensors state dict or a Lightning .ckpt) with pretrained=False"
            ) from err

    def _from_timm_file(self, model_name: str, path: Path, file_classes: int, common: dict) -> None:
        """Let timm load a state-dict file; tell it the file's head size so that timm drops the
        head only when it really differs (timm compares with its config's class count)."""
        self.model = timm.create_model(
            model_name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=file_classes), **common
        )
        if file_classes != self.num_classes:
            head = head_name(self.model)
            log.warning("loaded %s into %s; dropped the classifier %s (file: %d classes, model: %d) and kept its "
                        "fresh initialization", path, model_name, head, file_classes, self.num_classes)
        else:
            log.info("loaded %s into %s (classifier included)", path, model_name)
