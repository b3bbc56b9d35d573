"""Pieces shared by the image datamodules: per-class splits, datasets, loaders, checks.

Kept here so that CIFAR-10-C, ImageNet-C, Living-17 and digits cut their data the same way and
report bad arguments with the same wording.
"""

from __future__ import annotations

import http.client
import os
import urllib.error
from collections.abc import Callable, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from lalr_lightning.choices import unknown

__all__ = [
    "CORRUPTIONS_C",
    "DownloadError",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageDataModule",
    "ImageListDataset",
    "TensorImageDataset",
    "check_choice",
    "check_severity",
    "download",
    "imagenet_transform",
    "per_class_count",
    "require_path",
    "split_per_class",
]

# The 15 benchmark corruptions of Hendrycks & Dietterich (CIFAR-10-C, ImageNet-C), then the 4
# "extra" ones of the same release (used for validation in the original paper).
CORRUPTIONS_C: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
    "speckle_noise", "gaussian_blur", "spatter", "saturate",
)  # fmt: skip

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def check_choice(value: str, valid: Sequence[str], what: str) -> str:
    """Return ``value`` if it is one of ``valid``; otherwise a ValueError listing them."""
    if value not in valid:
        raise unknown(what, value, valid)
    return value


def check_severity(severity: int) -> int:
    """Corruption benchmarks have severities 1..5."""
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)) or not 1 <= severity <= 5:
        raise ValueError(f"severity must be an integer in 1..5, got {severity!r}")
    return int(severity)


def per_class_count(total: int, num_classes: int, what: str) -> int:
    """Turn a balanced total (e.g. ``train_n``) into a per-class count; it must divide evenly."""
    if total < 0 or total % num_classes:
        raise ValueError(
            f"{what}={total} must be a non-negative multiple of the {num_classes} classes "
            f"(it is split evenly between them)"
        )
    return total // num_classes


def check_holdout(val_per_class: int, test_per_class: int | None) -> None:
    """Per-class validation/test counts of the corruption benchmarks (test None = the rest)."""
    if val_per_class < 0 or (test_per_class is not None and test_per_class < 0):
        raise ValueError("val_per_class and test_per_class must be >= 0")


def split_per_class(
    labels: Sequence[int] | np.ndarray | torch.Tensor,
    sizes: Sequence[int | float | None],
    seed: int,
    names: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """Cut every class into disjoint blocks; return one index array per block.

    Each class's indices are shuffled with ``numpy.random.default_rng(seed)`` (classes in
    ascending order, so the result depends only on the labels and the seed) and cut into
    consecutive blocks. A size is an ``int`` (images per class), a ``float`` (fraction of the
    class, rounded) or ``None`` (everything left; at most one). Returned indices are sorted.
    """
    labels = np.asarray(labels)
    names = list(names) if names is not None else [f"block {i}" for i in range(len(sizes))]
    if sum(s is None for s in sizes) > 1:
        raise ValueError("at most one block may take 'the rest' (size None)")
    rng = np.random.default_rng(seed)
    blocks: list[list[np.ndarray]] = [[] for _ in sizes]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = len(idx)
        counts = [round(s * n) if isinstance(s, float) else s for s in sizes]
        fixed = sum(k for k in counts if k is not None)
        if any(k is not None and k < 0 for k in counts):
            raise ValueError(f"negative split size in {dict(zip(names, sizes))}")
        if fixed > n:
            asked = ", ".join(f"{nm}={k}" for nm, k in zip(names, counts) if k is not None)
            raise ValueError(
                f"class {c} has {n} images but the split asks for {fixed} per class ({asked}); "
                f"lower train_n / val / test sizes"
            )
        counts = [n - fixed if k is None else k for k in counts]
        start = 0
        for b, k in enumerate(counts):
            blocks[b].append(idx[start : start + k])
            start += k
    return [np.sort(np.concatenate(b)) if b else np.zeros(0, dtype=np.int64) for b in blocks]


class TensorImageDataset(Dataset):
    """Images held in memory as one tensor ``(N, C, H, W)``, an optional per-item transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Callable | None = None):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


def _load_rgb(path: str) -> Image.Image:
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


class ImageListDataset(Dataset):
    """Image files given as ``(path, label)`` pairs, decoded on access (ImageFolder-style)."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable | None = None):
        self.samples = list(samples)
        self.labels = torch.tensor([y for _, y in self.samples], dtype=torch.long)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, y = self.samples[i]
        img = _load_rgb(path)
        if self.transform is not None:
            img = self.transform(img)
        return img, y


def imagenet_transform(image_size: int, train: bool) -> Callable:
    """ImageNet preprocessing: eval = resize to 256/224 of the size then center crop (the standard
    resize 256 / crop 224); train = random resized crop and flip. Both normalized."""
    from torchvision import transforms as T

    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if train:
        return T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), *norm])
    return T.Compose([T.Resize(round(image_size * 256 / 224)), T.CenterCrop(image_size), *norm])


class DownloadError(ConnectionError):
    """A dataset download that failed; the message names the URL and where to put the files by hand."""


def download(fetch: Callable[[], object], url: str, manual: str) -> None:
    """Run ``fetch()`` (a download of ``url``); a network failure becomes one :class:`DownloadError`
    line saying so, from which URL, and ``manual``: where to place the files by hand."""
    try:
        fetch()
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise DownloadError(
            f"download from {url} failed ({type(e).__name__}: {reason}). Without network access, download it "
            f"elsewhere and {manual}"
        ) from e


def require_path(path: str, what: str, hint: str) -> str:
    """Fail early, naming the missing file or folder and how to get it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found at {path!r}. {hint}")
    return path


def check_loader_args(batch_size: int, num_workers: int, val_split: float | None = None,
                      **max_samples: int | None) -> None:
    """The arguments every datamodule shares: batch size, workers, the validation hold-out
    (a fraction in (0, 1) or a number of examples) and ``max_*_samples`` limits."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if val_split is not None and not (0 < val_split < 1 or (val_split >= 1 and float(val_split).is_integer())):
        raise ValueError(f"val_split must be a fraction in (0, 1) or a number of examples >= 1, got {val_split}")
    for name, v in max_samples.items():
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {v}")


class SplitLoaders:
    """The four dataloader hooks over ``train_set`` / ``val_set`` / ``test_set`` (predict = test),
    through the subclass's ``_loader(dataset, shuffle)``."""

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class ImageDataModule(SplitLoaders, pl.LightningDataModule):
    """Common loader plumbing; subclasses fill ``train_set``, ``val_set``, ``test_set`` in ``setup``.

    ``num_classes``, ``in_channels`` and ``image_size`` are plain attributes set in ``__init__``
    so the CLI can link ``data.num_classes`` to the model before any file is read.
    """

    num_classes: int
    in_channels: int
    image_size: int

    def __init__(self, batch_size: int, num_workers: int, seed: int):
        super().__init__()
        check_loader_args(batch_size, num_workers)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )
