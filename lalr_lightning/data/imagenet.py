"""ImageNet-scale datamodules: ImageNet-C and BREEDS Living-17.

**ImageNet-C** (:class:`ImageNetCDataModule`) reads one corruption at one severity from the
Hendrycks & Dietterich release, laid out as ``<data_dir>/<corruption>/<severity>/<wnid>/*.JPEG``
(50 images per class, 1000 wnid folders). Class indices are the sorted wnids, which is the
standard ImageNet order of pretrained torchvision/timm models. The paper ("L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)) tunes
on 5000 images, 5 per class; by default we cut every class into 5 val, 5 train and the other
40 test images (``val_per_class``, ``train_n``, ``test_per_class`` change that), with the same
per-class split as CIFAR-10-C.

**Living-17** (:class:`Living17DataModule`) is the BREEDS benchmark of Santurkar et al.: 17
superclasses of living things, each with two ImageNet subclasses (wnids) in the *source* domain
and two others in the *target* domain. It needs

* ``<data_dir>/train/<wnid>/*`` and ``<data_dir>/val/<wnid>/*`` -- ImageNet ILSVRC-2012 with the
  validation images also sorted into wnid folders (as ``torchvision.datasets.ImageNet`` leaves
  them), only the 68 wnids of Living-17 need be present;
* ``split_file`` -- a small JSON file naming the subclasses::

    {"superclasses": [
        {"name": "salamander", "wnid": "n01627424",
         "source": ["n0...", "n0..."], "target": ["n0...", "n0..."]},
        ... 17 entries, in label order 0..16 ...]}

  ``name`` and ``wnid`` are optional. Subclasses may also be ImageNet class numbers (0..999) if
  ``info_dir`` points at the BREEDS information folder: its ``dataset_class_info.json`` (a list of
  ``[number, wnid, name]``) turns numbers into wnids.

Producing ``split_file`` with the ``robustness`` package (``pip install robustness``; its
``setup_breeds(info_dir)`` downloads the three BREEDS files into ``info_dir``)::

    import json
    from robustness.tools.breeds_helpers import make_living17, setup_breeds
    setup_breeds("breeds_info")
    supers, (src, tgt), names = make_living17("breeds_info", split="rand")
    json.dump({"superclasses": [
        {"name": names[i], "wnid": w, "source": [int(c) for c in src[i]], "target": [int(c) for c in tgt[i]]}
        for i, w in enumerate(supers)]}, open("living17.json", "w"), indent=1)

and pass ``split_file="living17.json", info_dir="breeds_info"``. (Porting the BREEDS hierarchy
walk itself was left out: without the real files it could not be checked against
``make_living17``.)

Splits: ``source`` uses the source subclasses, ``target`` the target ones; labels are the
superclass index. Per superclass, ``val_per_class`` images of the ImageNet *train* folders are
held out for validation and ``train_n / 17`` train (``None`` = the rest; the paper tunes on the
target with ``train_n=850``); the test set is every ImageNet *val* image of those subclasses.
"""

from __future__ import annotations

import json
import os

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from ._common import (
    CORRUPTIONS_C,
    ImageDataModule,
    ImageListDataset,
    check_choice,
    check_holdout,
    check_severity,
    imagenet_transform,
    per_class_count,
    require_path,
    split_per_class,
)

__all__ = ["ImageNetCDataModule", "Living17DataModule", "read_breeds_split"]

IMAGENET_C_URL = "https://zenodo.org/record/2235448 (ImageNet-C, Hendrycks & Dietterich 2019)"
IMAGENET_HINT = (
    "Living-17 is built from ImageNet ILSVRC-2012 (https://image-net.org): train/ and val/ with one folder per wnid."
)


class ImageNetCDataModule(ImageDataModule):
    """One corruption at one severity of ImageNet-C, cut per class into train / val / test.

    Args:
        data_dir: the ImageNet-C root, holding ``<corruption>/<severity>/<wnid>/``.
        train_n: class-balanced number of training images (multiple of ``num_classes``).
        val_per_class / test_per_class: images per class for val / test (``None`` = the rest).
        num_classes: number of wnid folders expected (1000 for the real data).
        image_size: crop size; eval transform resizes to ``image_size * 256 / 224`` first.
        augment: random resized crop and flip for the training images instead of the eval transform.
    """

    in_channels = 3

    def __init__(
        self,
        data_dir: str = "data/ImageNet-C",
        corruption: str = "gaussian_noise",
        severity: int = 5,
        train_n: int = 5000,
        val_per_class: int = 5,
        test_per_class: int | None = None,
        num_classes: int = 1000,
        image_size: int = 224,
        augment: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.corruption = check_choice(corruption, CORRUPTIONS_C, "ImageNet-C corruption")
        self.severity = check_severity(severity)
        self.num_classes = num_classes
        self.image_size = image_size
        self.train_per_class = per_class_count(train_n, num_classes, "train_n")
        check_holdout(val_per_class, test_per_class)
        self.val_per_class = val_per_class
        self.test_per_class = test_per_class
        self.augment = augment
        self.indices: dict[str, np.ndarray] = {}
        self.classes: list[str] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        root = os.path.join(self.data_dir, self.corruption, str(self.severity))
        require_path(
            root,
            "ImageNet-C folder",
            f"Download ImageNet-C from {IMAGENET_C_URL} (noise/blur/weather/digital tars), extract into "
            f"data_dir so that <data_dir>/<corruption>/<severity>/<wnid>/*.JPEG exists.",
        )
        self.classes, class_to_idx = find_classes(root)
        if len(self.classes) != self.num_classes:
            raise ValueError(f"{root} has {len(self.classes)} class folders but num_classes={self.num_classes}")
        samples = make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS)
        labels = np.array([y for _, y in samples])
        try:
            val, test, train = split_per_class(
                labels,
                [self.val_per_class, self.test_per_class, self.train_per_class],
                self.seed,
                names=["val_per_class", "test_per_class", f"train_n/{self.num_classes}"],
            )
        except ValueError as e:
            raise ValueError(f"ImageNet-C split does not fit (train_n={self.hparams.train_n}): {e}") from e
        self.indices = {"train": train, "val": val, "test": test}
        eval_tf = imagenet_transform(self.image_size, train=False)
        train_tf = imagenet_transform(self.image_size, train=True) if self.augment else eval_tf
        self.train_set = ImageListDataset([samples[i] for i in train], train_tf)
        self.val_set = ImageListDataset([samples[i] for i in val], eval_tf)
        self.test_set = ImageListDataset([samples[i] for i in test], eval_tf)


def read_breeds_split(split_file: str, info_dir: str | None = None) -> list[dict]:
    """Read and check a Living-17-style split file (format in the module docstring).

    Returns one dict per superclass, in label order, with ``name``, ``source`` and ``target``
    (lists of wnids).
    """
    require_path(
        split_file,
        "BREEDS split file",
        "Write it as described in lalr_lightning.data.imagenet (e.g. from robustness' make_living17).",
    )
    with open(split_file) as f:
        spec = json.load(f)
    entries = spec.get("superclasses") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{split_file}: expected {{'superclasses': [{{'source': [...], 'target': [...]}}, ...]}}")

    number_to_wnid: dict[int, str] | None = None

    def to_wnid(c) -> str:
        nonlocal number_to_wnid
        if isinstance(c, str):
            return c
        if number_to_wnid is None:
            if info_dir is None:
                raise ValueError(f"{split_file} names subclasses by number ({c}); pass info_dir to map them to wnids")
            path = require_path(
                os.path.join(info_dir, "dataset_class_info.json"),
                "BREEDS dataset_class_info.json",
                "robustness' setup_breeds(info_dir) downloads it.",
            )
            with open(path) as f:
                number_to_wnid = {int(num): wnid for num, wnid, *_ in json.load(f)}
        if int(c) not in number_to_wnid:
            raise ValueError(f"class number {c} is not in {info_dir}/dataset_class_info.json")
        return number_to_wnid[int(c)]

    out, seen = [], {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not e.get("source") or not e.get("target"):
            raise ValueError(f"{split_file}: superclass {i} needs non-empty 'source' and 'target' lists")
        item = {
            "name": str(e.get("name", e.get("wnid", f"superclass_{i}"))),
            "source": [to_wnid(c) for c in e["source"]],
            "target": [to_wnid(c) for c in e["target"]],
        }
        for w in item["source"] + item["target"]:
            if w in seen:
                raise ValueError(f"{split_file}: subclass {w} appears twice (superclasses {seen[w]} and {i})")
            seen[w] = i
        out.append(item)
    return out


class Living17DataModule(ImageDataModule):
    """BREEDS Living-17 source or target domain from ImageNet folders and a split file.

    Args:
        data_dir: ImageNet root with ``train/<wnid>/`` and ``val/<wnid>/``.
        split_file: JSON naming each superclass's source and target subclasses (module docstring).
        split: ``source`` or ``target``.
        info_dir: BREEDS info folder, only needed when ``split_file`` uses class numbers.
        train_n: class-balanced number of training images (multiple of 17); ``None`` = all.
        val_per_class: images per superclass held out of ImageNet train for validation.
        augment: random resized crop and flip for training; eval transform otherwise.
    """

    in_channels = 3

    def __init__(
        self,
        data_dir: str = "data/imagenet",
        split_file: str = "data/living17.json",
        split: str = "source",
        info_dir: str | None = None,
        train_n: int | None = None,
        val_per_class: int = 10,
        image_size: int = 224,
        augment: bool = True,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.split = check_choice(split, ("source", "target"), "split")
        self.superclasses = read_breeds_split(split_file, info_dir)  # small; read now so num_classes is known
        self.num_classes = len(self.superclasses)
        self.class_names = [s["name"] for s in self.superclasses]
        self.image_size = image_size
        self.train_per_class = None if train_n is None else per_class_count(train_n, self.num_classes, "train_n")
        if val_per_class < 0:
            raise ValueError("val_per_class must be >= 0")
        self.val_per_class = val_per_class
        self.augment = augment
        self.indices: dict[str, np.ndarray] = {}

    def _samples(self, folder: str) -> list[tuple[str, int]]:
        root = require_path(os.path.join(self.data_dir, folder), f"ImageNet {folder} folder", IMAGENET_HINT)
        wnid_to_label = {w: i for i, s in enumerate(self.superclasses) for w in s[self.split]}
        missing = sorted(w for w in wnid_to_label if not os.path.isdir(os.path.join(root, w)))
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} Living-17 {self.split} subclass folders missing under {root!r}: "
                f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}. {IMAGENET_HINT}"
            )
        return make_dataset(root, wnid_to_label, extensions=IMG_EXTENSIONS)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        pool = self._samples("train")
        labels = np.array([y for _, y in pool])
        try:
            val, train = split_per_class(
                labels,
                [self.val_per_class, self.train_per_class],
                self.seed,
                names=["val_per_class", f"train_n/{self.num_classes}"],
            )
        except ValueError as e:
            raise ValueError(f"Living-17 {self.split} split does not fit (train_n={self.hparams.train_n}): {e}") from e
        self.indices = {"train": train, "val": val}
        eval_tf = imagenet_transform(self.image_size, train=False)
        train_tf = imagenet_transform(self.image_size, train=True) if self.augment else eval_tf
        self.train_set = ImageListDataset([pool[i] for i in train], train_tf)
        self.val_set = ImageListDataset([pool[i] for i in val], eval_tf)
        self.test_set = ImageListDataset(self._samples("val"), eval_tf)
