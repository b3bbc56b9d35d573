"""Small CNNs that train on CPU in seconds (8x8 digits) and still have layers worth analysing.

Both networks name a BatchNorm after its conv (``conv`` -> ``bn``, ``conv1`` -> ``bn1``) so the
TempBalance ``bn -> conv`` rule of :func:`lalr_lightning.core.model.layers.matrix_layers` ties them,
and both have repeated children ``layer1..layerN`` so
:func:`~lalr_lightning.core.model.blocks.block_layers` finds their blocks without configuration.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import ClassifierModule, load_pretrained

__all__ = ["SmallCNN", "SmallResNet", "ConvBlock", "BasicBlock"]


class ConvBlock(nn.Module):
    """3x3 conv -> BatchNorm -> ReLU, named ``conv``/``bn`` (the ``bn -> conv`` rule ties them)."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class SmallCNNNet(nn.Module):
    """``layer1..layer4`` conv blocks (widths w, w, 2w, 2w), a 2x2 max-pool after ``layer2``,
    global average pooling and a linear ``fc``.

    With width 32 the middle convs have 288, 288 and 576 eigenvalues (``k*k*min(out, in)``), so
    HT-SR methods, which skip the first and last layer and layers under 50 eigenvalues, have
    three layers to work on.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        w = int(width)
        self.layer1 = ConvBlock(in_channels, w)
        self.layer2 = ConvBlock(w, w)
        self.pool = nn.MaxPool2d(2)
        self.layer3 = ConvBlock(w, 2 * w)
        self.layer4 = ConvBlock(2 * w, 2 * w)
        self.fc = nn.Linear(2 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.layer2(self.layer1(x)))
        x = self.layer4(self.layer3(x))
        return self.fc(x.mean(dim=(2, 3)))


class BasicBlock(nn.Module):
    """The ResNet basic block (two 3x3 convs and a shortcut), with torchvision/timm names."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            # Sequential(conv, bn): the BN at index 1 is tied to the conv at index 0
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + shortcut)


class SmallResNetNet(nn.Module):
    """CIFAR-style ResNet: ``conv1``+``bn1`` stem, groups ``layer1..layer3`` (widths w, 2w, 4w;
    stride 1, 2, 2), global average pooling, ``fc`` -- the block structure
    ``conv1+block1 | block2 | block3 | fc`` that surgical fine-tuning uses on CIFAR."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16, blocks_per_group: int = 2) -> None:
        super().__init__()
        w = int(width)
        self.conv1 = nn.Conv2d(in_channels, w, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.layer1 = self._group(w, w, 1, blocks_per_group)
        self.layer2 = self._group(w, 2 * w, 2, blocks_per_group)
        self.layer3 = self._group(2 * w, 4 * w, 2, blocks_per_group)
        self.fc = nn.Linear(4 * w, num_classes)

    @staticmethod
    def _group(cin: int, cout: int, stride: int, n: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(cin, cout, stride), *[BasicBlock(cout, cout) for _ in range(n - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(x.mean(dim=(2, 3)))


class SmallCNN(ClassifierModule):
    """A four-conv CNN for 8x8 digits (``in_channels=1``) or 32x32 images (``in_channels=3``).

    Blocks: ``model.layer1 | model.layer2 | model.layer3 | model.layer4 | model.fc``. Matrix
    layers: ``model.layerN.conv`` (with ``model.layerN.bn``) and ``model.fc``.
    ``checkpoint``: a Lightning ``.ckpt`` (or a state-dict file) of a model with the same
    architecture to start from; a head of a different size is dropped (see
    :func:`~lalr_lightning.models.base.load_pretrained`). A file holding Python objects besides
    tensors is refused, since reading it runs code named in the file; ``unsafe_load=True``
    (``fit --model.init_args.unsafe_load true``) reads it, for files you trust. Other arguments:
    :class:`~lalr_lightning.models.base.ClassifierModule`.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32,
                 checkpoint: str | None = None, unsafe_load: bool = False, **kwargs) -> None:
        super().__init__(num_classes=num_classes, **kwargs)
        if width < 1 or in_channels < 1:
            raise ValueError(f"width and in_channels must be positive, got width={width}, in_channels={in_channels}")
        self.model = SmallCNNNet(num_classes, in_channels, width)
        if checkpoint is not None:
            load_pretrained(self, checkpoint, unsafe_load=unsafe_load)


class SmallResNet(ClassifierModule):
    """A small ResNet (widths w, 2w, 4w) for surgical fine-tuning on digits or CIFAR.

    Blocks: ``model.conv1+model.bn1+model.layer1 | model.layer2 | model.layer3 | model.fc``.
    ``blocks_per_group`` BasicBlocks per group (1 or 2 keep it fast on CPU). ``checkpoint`` and
    ``unsafe_load`` as in :class:`SmallCNN`.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 16, blocks_per_group: int = 2,
                 checkpoint: str | None = None, unsafe_load: bool = False, **kwargs) -> None:
        super().__init__(num_classes=num_classes, **kwargs)
        if width < 1 or in_channels < 1 or blocks_per_group < 1:
            raise ValueError(
                f"width, in_channels and blocks_per_group must be positive, got {width}, {in_channels}, {blocks_per_group}"
            )
        self.model = SmallResNetNet(num_classes, in_channels, width, blocks_per_group)
        if checkpoint is not None:
            load_pretrained(self, checkpoint, unsafe_load=unsafe_load)
