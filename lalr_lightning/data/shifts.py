"""Distribution shifts as pure functions, shared by the digits and CIFAR datamodules.

Three kinds, matching the shift types of surgical fine-tuning / L-MSA ("L-MSA: Layer-wise Fine-tuning using the Method of Successive Approximations" (https://openreview.net/forum?id=xi3sDtf8A0)):

* output-level -- :func:`label_flip`, ``y -> num_classes - 1 - y`` (CIFAR-Flip: ``9 - y``);
* input-level, fixed -- :class:`ExpInputTransform`, element-wise ``img * e^x`` with one fixed
  ``x ~ N(0, 1)`` of the image's shape (the L-MSA CIFAR-100 transform);
* input-level, corruptions -- :func:`gaussian_noise`, :func:`gaussian_blur`, :func:`contrast` at
  severities 1..5, on float images in ``[0, 1]`` of shape ``(..., C, H, W)``.

Corruption parameters (ours, chosen so that an 8x8 digit is still recognizable at 1 and hard
at 5; the distance to the clean image grows with severity):

============  =================================  ==============================
corruption    parameter                           severity 1, 2, 3, 4, 5
============  =================================  ==============================
noise         std of additive N(0, std), clipped  0.08, 0.16, 0.24, 0.32, 0.40
blur          sigma of the Gaussian kernel (px)   0.50, 0.75, 1.00, 1.25, 1.50
contrast      factor c in ``m + c (x - m)``       0.80, 0.60, 0.45, 0.30, 0.15
============  =================================  ==============================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ._common import check_choice, check_severity

__all__ = [
    "BLUR_SIGMA",
    "CONTRAST_FACTOR",
    "CORRUPTIONS",
    "NOISE_STD",
    "ExpInputTransform",
    "contrast",
    "corrupt",
    "gaussian_blur",
    "gaussian_noise",
    "label_flip",
]

NOISE_STD = (0.08, 0.16, 0.24, 0.32, 0.40)
BLUR_SIGMA = (0.50, 0.75, 1.00, 1.25, 1.50)
CONTRAST_FACTOR = (0.80, 0.60, 0.45, 0.30, 0.15)


def label_flip(y, num_classes: int):
    """Reverse the class order: ``y -> num_classes - 1 - y`` (ints, numpy arrays or tensors)."""
    return num_classes - 1 - y


class ExpInputTransform:
    """Multiply inputs element-wise by ``e^x``; ``x ~ N(0, 1)`` of shape ``shape`` drawn once.

    ``x`` comes from its own ``torch.Generator`` seeded with ``seed``, so every instance with the
    same ``(shape, seed)`` -- in any process or DataLoader worker -- applies the same factor.
    Works on one image ``shape`` or a batch ``(N, *shape)``.
    """

    def __init__(self, shape: Sequence[int], seed: int = 0):
        self.shape = tuple(shape)
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(self.shape, generator=gen)
        self.factor = self.x.exp()

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        if tuple(img.shape[-len(self.shape) :]) != self.shape:
            raise ValueError(f"ExpInputTransform built for shape {self.shape}, got input of shape {tuple(img.shape)}")
        return img * self.factor.to(img.device, img.dtype)

    def __repr__(self) -> str:
        return f"ExpInputTransform(shape={self.shape}, seed={self.seed})"


def gaussian_noise(x: torch.Tensor, severity: int, seed: int = 0) -> torch.Tensor:
    """Additive Gaussian noise, clipped to ``[0, 1]``. One seeded draw scaled by the severity's
    std, so a higher severity moves every pixel at least as far from the clean value."""
    std = NOISE_STD[check_severity(severity) - 1]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
    return (x + std * noise).clamp(0.0, 1.0)


def _gaussian_kernel(sigma: float, dtype: torch.dtype) -> torch.Tensor:
    radius = max(1, math.ceil(3 * sigma))
    t = torch.arange(-radius, radius + 1, dtype=dtype)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(x: torch.Tensor, severity: int) -> torch.Tensor:
    """Separable Gaussian blur of every channel; borders replicate the edge pixels."""
    sigma = BLUR_SIGMA[check_severity(severity) - 1]
    k = _gaussian_kernel(sigma, x.dtype).to(x.device)
    r = len(k) // 2
    shape = x.shape
    y = x.reshape(-1, 1, *shape[-2:])
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))
    return y.reshape(shape)


def contrast(x: torch.Tensor, severity: int) -> torch.Tensor:
    """Shrink every image towards its own mean (over channels and pixels) by a factor c < 1."""
    c = CONTRAST_FACTOR[check_severity(severity) - 1]
    m = x.mean(dim=(-3, -2, -1), keepdim=True)
    return m + c * (x - m)


CORRUPTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "gaussian_noise": gaussian_noise,
    "blur": gaussian_blur,
    "contrast": contrast,
}


def corrupt(x: torch.Tensor, name: str, severity: int, seed: int = 0) -> torch.Tensor:
    """Apply the corruption ``name`` (one of :data:`CORRUPTIONS`) at ``severity`` 1..5."""
    fn = CORRUPTIONS[check_choice(name, list(CORRUPTIONS), "corruption")]
    return fn(x, severity, seed=seed) if fn is gaussian_noise else fn(x, severity)
