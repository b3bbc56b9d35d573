"""CIFAR datamodules: CIFAR-10/100 (optionally label-flipped or e^x-transformed) and CIFAR-10-C.

Tasks of surgical fine-tuning / L-MSA ("L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0), appendix A.2.1):

* **CIFAR-10 / CIFAR-100** -- the source data (:class:`CIFARDataModule`).
* **CIFAR-Flip** -- CIFAR-10 with ``y -> 9 - y`` on every split:
  ``CIFARDataModule(name="cifar10", label_flip=True, train_n=...)``. "L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0) gives no
  sample size for CIFAR-Flip; ``train_n`` takes a class-balanced subset of the training set.
* **CIFAR-100 with the L-MSA input transform** -- every input multiplied element-wise by
  ``e^x``, ``x ~ N(0, 1)`` of shape ``(3, 32, 32)`` drawn once from ``input_transform_seed``:
  ``CIFARDataModule(name="cifar100", input_transform=True)``. The paper says only that "the
  input data" is multiplied; we multiply the *normalized* tensor the network receives (after
  augmentation and normalization), so the transform is a fixed per-pixel rescaling of the
  network's input.
* **CIFAR-10-C** -- :class:`CIFAR10CDataModule`. The paper tunes on 1000 images at severity 5
  and keeps a held-out validation subset of the labeled target data for early stopping; we cut
  the 10,000 images of the chosen severity per class into ``train_n/10`` train, 10 val and 90
  test images (SPEC), all three sizes configurable.

Files on disk:

* CIFAR-10: ``<data_dir>/cifar-10-batches-py/{data_batch_1..5, test_batch}``;
  CIFAR-100: ``<data_dir>/cifar-100-python/{train, test}`` (the python-pickle releases that
  ``torchvision.datasets.CIFAR10/100`` download; ``download=True`` fetches them).
* CIFAR-10-C: ``<data_dir>/<corruption>.npy`` (``5 * 10,000 x 32 x 32 x 3`` uint8, severity
  ``s`` in rows ``(s-1)*10,000 : s*10,000``) and ``<data_dir>/labels.npy``.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch
from torchvision import datasets as tvd
from torchvision.datasets.utils import check_integrity
from torchvision.transforms import v2

from ._common import (
    CORRUPTIONS_C,
    ImageDataModule,
    TensorImageDataset,
    check_choice,
    check_holdout,
    check_severity,
    download,
    per_class_count,
    require_path,
    split_per_class,
)
from .shifts import ExpInputTransform, label_flip

__all__ = ["CIFAR_STATS", "CIFAR10CDataModule", "CIFARDataModule", "CIFARTransform", "load_cifar"]

# Per-channel mean / std of the training images.
CIFAR_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
_TORCHVISION = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100}
CIFAR10C_URL = "https://zenodo.org/record/2535967 (CIFAR-10-C.tar, Hendrycks & Dietterich 2019)"


class CIFARTransform:
    """uint8 ``(3, 32, 32)`` -> float32: optional random crop (pad 4) and flip, normalization,
    then the optional e^x input transform."""

    def __init__(self, mean, std, augment: bool, input_transform: ExpInputTransform | None = None):
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        self.augment = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip()]) if augment else None
        self.input_transform = input_transform

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if self.augment is not None:
            img = self.augment(img)
        x = (img.float() / 255.0 - self.mean) / self.std
        if self.input_transform is not None:
            x = self.input_transform(x)
        return x


def load_cifar(data_dir: str, name: str, train: bool, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the python-pickle CIFAR batches: uint8 images ``(N, 3, 32, 32)`` and int64 labels.

    File names and md5 sums are torchvision's (``CIFAR10.train_list`` ...). ``verify=False``
    skips the md5 check, for files you made yourself (tests) or re-packed copies.
    """
    cls = _TORCHVISION[check_choice(name, list(_TORCHVISION), "CIFAR name")]
    folder = os.path.join(data_dir, cls.base_folder)
    images, labels = [], []
    for fname, md5 in cls.train_list if train else cls.test_list:
        path = os.path.join(folder, fname)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{name} file {path!r} not found. Pass download=True to fetch {cls.url} into "
                f"data_dir={data_dir!r}, or place the extracted '{cls.base_folder}' folder there."
            )
        if verify and not check_integrity(path, md5):
            raise RuntimeError(
                f"{path!r} does not have the md5 of the official {name} release; delete it and use "
                f"download=True, or pass verify=False to use it anyway."
            )
        with open(path, "rb") as f:
            try:
                entry = _ArraysOnly(f, encoding="latin1").load()
            except pickle.UnpicklingError as e:
                raise RuntimeError(f"{path!r}: {e}") from None
        images.append(np.asarray(entry["data"], dtype=np.uint8))
        labels.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
    x = torch.from_numpy(np.concatenate(images).reshape(-1, 3, 32, 32))
    return x, torch.tensor(labels, dtype=torch.long)


class _ArraysOnly(pickle.Unpickler):
    """Unpickles a CIFAR batch file (a dict of numpy arrays, lists, strings) and nothing else: a
    file naming any other function or class is refused, so no file runs code here (``verify=False``
    reads files whose md5 was not checked)."""

    _ALLOWED = frozenset({("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                          ("numpy._core.multiarray", "_reconstruct")})

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, but a CIFAR batch file holds only numpy arrays "
                                         "and lists; refusing to load it (delete it and use download=True)")
        if name == "_reconstruct":
            try:
                from numpy._core.multiarray import _reconstruct
            except ImportError:  # numpy < 2
                from numpy.core.multiarray import _reconstruct
            return _reconstruct
        return getattr(np, name)


class CIFARDataModule(ImageDataModule):
    """CIFAR-10 or CIFAR-100; with ``label_flip`` it is CIFAR-Flip, with ``input_transform`` the
    L-MSA e^x task.

    Validation is ``val_n`` class-balanced images held out of the training set; the test set is
    the official test set. Shifts (flip, e^x) apply to train, val and test alike.

    Args:
        name: ``cifar10`` or ``cifar100``.
        data_dir: folder holding ``cifar-10-batches-py`` / ``cifar-100-python``.
        download: fetch the files through torchvision in ``prepare_data`` if absent.
        verify: check the files' md5 against the official release.
        label_flip: ``y -> num_classes - 1 - y`` (CIFAR-Flip on CIFAR-10).
        input_transform: multiply inputs by ``e^x`` with the fixed ``x`` of ``input_transform_seed``.
        train_n: class-balanced number of training images; ``None`` = all not held out for val.
        val_n: class-balanced number of training images held out for validation.
        augment: random crop (padding 4) and horizontal flip for the training images.
    """

    in_channels = 3
    image_size = 32

    def __init__(
        self,
        name: str = "cifar10",
        data_dir: str = "data",
        download: bool = False,
        verify: bool = True,
        label_flip: bool = False,
        input_transform: bool = False,
        input_transform_seed: int = 0,
        train_n: int | None = None,
        val_n: int = 5000,
        augment: bool = True,
        batch_size: int = 128,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.save_hyperparameters()
        self.name = check_choice(name, list(_TORCHVISION), "CIFAR name")
        self.num_classes = 10 if name == "cifar10" else 100
        self.data_dir = data_dir
        self.download = download
        self.verify = verify
        self.label_flip = label_flip
        self.augment = augment
        self.val_per_class = per_class_count(val_n, self.num_classes, "val_n")
        if self.val_per_class == 0:
            raise ValueError("val_n must be positive: validation images are held out of the training set")
        self.train_per_class = None if train_n is None else per_class_count(train_n, self.num_classes, "train_n")
        self.input_transform = ExpInputTransform((3, 32, 32), seed=input_transform_seed) if input_transform else None
        self.indices: dict[str, np.ndarray] = {}

    def prepare_data(self) -> None:
        if self.download:
            cls = _TORCHVISION[self.name]
            download(
                lambda: cls(self.data_dir, train=False, download=True), cls.url,
                f"extract it into data_dir={self.data_dir!r} (giving {os.path.join(self.data_dir, cls.base_folder)}), "
                "then run with download=False",
            )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = load_cifar(self.data_dir, self.name, train=True, verify=self.verify)
        x_test, y_test = load_cifar(self.data_dir, self.name, train=False, verify=self.verify)
        val, train = split_per_class(y, [self.val_per_class, self.train_per_class], self.seed, names=["val", "train"])
        self.indices = {"train": train, "val": val}
        if self.label_flip:
            y, y_test = label_flip(y, self.num_classes), label_flip(y_test, self.num_classes)
        mean, std = CIFAR_STATS[self.name]
        train_tf = CIFARTransform(mean, std, self.augment, self.input_transform)
        eval_tf = CIFARTransform(mean, std, False, self.input_transform)
        self.train_set = TensorImageDataset(x[train], y[train], train_tf)
        self.val_set = TensorImageDataset(x[val], y[val], eval_tf)
        self.test_set = TensorImageDataset(x_test, y_test, eval_tf)


class CIFAR10CDataModule(ImageDataModule):
    """One corruption at one severity of CIFAR-10-C, cut per class into train / val / test.

    Per class, a permutation seeded by ``seed`` is cut into ``val_per_class``, then
    ``test_per_class`` (``None`` = all that ``train_n`` leaves), then ``train_n / 10`` images, so
    the val and test images do not change with ``train_n``. ``indices`` holds the chosen rows
    relative to the severity block; ``rows`` is the block ``(start, stop)`` in the file.

    The published files hold 10,000 images per severity; any ``.npy`` whose row count is five
    equal blocks is accepted (labels either one per row, or one block shared by all severities).
    """

    num_classes = 10
    in_channels = 3
    image_size = 32

    def __init__(
        self,
        data_dir: str = "data/CIFAR-10-C",
        corruption: str = "gaussian_noise",
        severity: int = 5,
        train_n: int = 1000,
        val_per_class: int = 10,
        test_per_class: int | None = 90,
        augment: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.corruption = check_choice(corruption, CORRUPTIONS_C, "CIFAR-10-C corruption")
        self.severity = check_severity(severity)
        self.train_per_class = per_class_count(train_n, self.num_classes, "train_n")
        check_holdout(val_per_class, test_per_class)
        self.val_per_class = val_per_class
        self.test_per_class = test_per_class
        self.augment = augment
        self.indices: dict[str, np.ndarray] = {}
        self.rows: tuple[int, int] = (0, 0)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hint = (
            f"Download CIFAR-10-C from {CIFAR10C_URL}, extract it and pass its folder (the one "
            f"holding <corruption>.npy and labels.npy) as data_dir."
        )
        img_path = require_path(os.path.join(self.data_dir, f"{self.corruption}.npy"), "CIFAR-10-C images", hint)
        lab_path = require_path(os.path.join(self.data_dir, "labels.npy"), "CIFAR-10-C labels", hint)
        images = np.load(img_path, mmap_mode="r")  # ~150 MB per corruption: read only the rows used
        labels = np.load(lab_path)
        if images.ndim != 4 or images.shape[1:] != (32, 32, 3) or len(images) % 5:
            raise ValueError(f"{img_path}: expected 5 severities x N x 32 x 32 x 3 images, got shape {images.shape}")
        block = len(images) // 5
        lo, hi = (self.severity - 1) * block, self.severity * block
        if len(labels) == len(images):
            labels = labels[lo:hi]
        elif len(labels) != block:
            raise ValueError(f"{lab_path} has {len(labels)} labels; expected {len(images)} or {block}")
        y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        try:
            val, test, train = split_per_class(
                y,
                [self.val_per_class, self.test_per_class, self.train_per_class],
                self.seed,
                names=["val_per_class", "test_per_class", "train_n/10"],
            )
        except ValueError as e:
            raise ValueError(f"CIFAR-10-C split does not fit (train_n={self.hparams.train_n}): {e}") from e
        self.indices = {"train": train, "val": val, "test": test}
        self.rows = (lo, hi)
        mean, std = CIFAR_STATS["cifar10"]

        def subset(idx: np.ndarray, augment: bool) -> TensorImageDataset:
            x = torch.from_numpy(np.ascontiguousarray(images[lo + idx])).permute(0, 3, 1, 2).contiguous()
            return TensorImageDataset(x, y[idx], CIFARTransform(mean, std, augment))

        self.train_set = subset(train, self.augment)
        self.val_set = subset(val, False)
        self.test_set = subset(test, False)
