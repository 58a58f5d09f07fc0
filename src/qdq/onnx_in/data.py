"""Calibration batches for an ONNX file from files on disk (what ``qdq quantize --model x.onnx --data ...`` reads).

``--data`` takes:

* ``PATH.npz``: arrays named after the graph's inputs, samples along axis 0 (or along the batch axis the graph names
  for an input, :mod:`qdq.onnx_in.samples`: a recurrent state ``[2, batch, 128]`` is cut along axis 1, a scalar or
  a shape the graph fixes goes whole into every batch), cut into batches of ``batch_size``, or of the batch size the
  graph fixes (every input's first dimension fixed at one size: u2netp takes one image a run; the last samples
  short of a whole batch are left out);
* ``PATH.npy``: one array for a one-input model, cut the same way;
* ``DIR`` of ``.npz`` / ``.npy`` files: one batch per file, in name order;
* ``imagefolder:DIR``: the images under ``DIR`` (PNG, JPEG, BMP; subfolders included, name order) for a one-input
  image model, preprocessed as stated: RGB, resized to the input's height and width (or ``image_size``) with
  bilinear interpolation, scaled to [0, 1], then ``(x - mean) / std`` per channel when given, channels first
  (``NCHW``), float32. Models that expect something else (BGR, other scaling, letterboxing) take ``.npz`` batches
  made by their own preprocessing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdq.errors import QdqBackendUnavailable, QdqConfigError
from qdq.graphs.onnx import feed_inputs
from qdq.graphs.onnx_types import value_dims
from qdq.onnx_in.samples import SampleAxes

__all__ = ["IMAGE_SUFFIXES", "calibration_batches", "graph_inputs"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def graph_inputs(model_path: str | Path) -> list[onnx.ValueInfoProto]:
    """The inputs of the model at ``model_path`` that are not initializers (without loading its weights)."""
    return feed_inputs(onnx.load(str(model_path), load_external_data=False))


def calibration_batches(
    spec: str,
    model_path: str | Path,
    *,
    batch_size: int = 8,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> list[dict[str, np.ndarray]]:
    """The batches ``spec`` names (module doc) for the model at ``model_path``.

    Raises:
        QdqConfigError: a missing path, an array not named after a graph input, no images, an unknown form.
    """
    model = onnx.load(str(model_path), load_external_data=False)
    inputs = feed_inputs(model)
    names = [i.name for i in inputs]
    batch_size = _fixed_batch(inputs) or batch_size
    if spec.startswith("imagefolder:"):
        return list(_image_batches(Path(spec.split(":", 1)[1]), inputs, batch_size, image_size, mean, std))
    path = Path(spec)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
        if not files:
            raise QdqConfigError(f"{path} holds no .npz or .npy batches.")
        return [_named(_load(p), names, p) for p in files]
    if path.suffix in (".npz", ".npy") and path.is_file():
        arrays = _named(_load(path), names, path)
        declared = SampleAxes.of(model)
        axes = declared or SampleAxes({k: 0 if np.ndim(v) else None for k, v in arrays.items()}, None)
        total = axes.samples(arrays)
        if total is None:
            sizes = {k: np.shape(v) for k, v in arrays.items()}
            where = ("" if declared else " The graph names no batch axis, so each array is cut along axis 0; for "
                     "inputs that hold their samples elsewhere, give a folder of .npz files, one batch each.")
            raise QdqConfigError(f"{path}: the arrays do not hold one number of samples along their batch axes "
                                 f"({axes.inputs}; shapes {sizes}).{where}")  # fmt: skip
        whole = total - total % batch_size if _fixed_batch(inputs) else total  # a fixed batch size takes no less
        return [axes.cut(arrays, slice(i, i + batch_size)) for i in range(0, whole, batch_size)]
    raise QdqConfigError(
        f"--data {spec!r}: give a .npz (arrays named after the graph inputs {names}), a .npy (one-input model), a "
        "folder of them (one batch each), or imagefolder:DIR."
    )


def _fixed_batch(inputs: Sequence[Any]) -> int | None:
    """The batch size the graph fixes: every input's first dimension fixed at one size; else None."""
    firsts = {(value_dims(value) or [None])[0] for value in inputs}
    return firsts.pop() if len(firsts) == 1 else None


def _load(path: Path) -> dict[str, np.ndarray] | np.ndarray:
    loaded = np.load(path)
    return dict(loaded) if isinstance(loaded, np.lib.npyio.NpzFile) else loaded


def _named(arrays: Any, names: list[str], path: Path) -> dict[str, np.ndarray]:
    if isinstance(arrays, np.ndarray):
        if len(names) != 1:
            raise QdqConfigError(f"{path} is one array, but the model has {len(names)} inputs {names}: use a .npz.")
        return {names[0]: arrays}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise QdqConfigError(f"{path} has no array for the graph input(s) {missing}; it holds {sorted(arrays)}.")
    return {n: arrays[n] for n in names}


def _image_batches(
    folder: Path,
    inputs: list[Any],
    batch_size: int,
    image_size: int | None,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
) -> Iterator[dict[str, np.ndarray]]:
    if len(inputs) != 1:
        raise QdqConfigError(f"imagefolder: needs a one-input model; this one has {len(inputs)}: use .npz batches.")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
    if not files:
        raise QdqConfigError(f"imagefolder:{folder}: no {'/'.join(IMAGE_SUFFIXES)} images there.")
    height, width = _size(inputs[0], image_size)
    count = len(files) - len(files) % batch_size if _fixed_batch(inputs) else len(files)
    for start in range(0, count, batch_size):
        images = np.stack([_image(p, height, width, mean, std) for p in files[start : start + batch_size]])
        yield {inputs[0].name: images}


def _size(value: Any, image_size: int | None) -> tuple[int, int]:
    dims = [d or None for d in value_dims(value) or []]
    if image_size is not None:
        return image_size, image_size
    if len(dims) != 4 or dims[2] is None or dims[3] is None:
        raise QdqConfigError(
            f"input {value.name!r} has no fixed height and width ({dims}): give --image-size for the images."
        )
    return int(dims[2]), int(dims[3])


def _image(path: Path, height: int, width: int, mean: Sequence[float] | None,
           std: Sequence[float] | None) -> np.ndarray:  # fmt: skip
    try:
        from PIL import Image
    except ImportError as err:
        raise QdqBackendUnavailable("reading an image folder needs Pillow: pip install pillow.") from err
    with Image.open(path) as image:
        rgb = image.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    x: np.ndarray = np.asarray(rgb, np.float32) / np.float32(255.0)
    if mean is not None:
        x = x - np.asarray(mean, np.float32)
    if std is not None:
        x = x / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))
