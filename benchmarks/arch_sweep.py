"""No crash on architectures nobody here tuned to: timm's image models and Hugging Face transformers (random
weights: the graphs, not the accuracy) through both doors and both targets, with the default calibration.

For each architecture, in its own process: the float model exported to ONNX with fixed shapes (batch 4: a
static-batch file, as many exporters write; TorchScript exporter, opset 17), quantized by ``quantize_onnx`` for
``onnxruntime`` and for ``tensorrt`` with a float16 remainder; the same model through ``quantize_model`` +
``calibrate`` + ``export_onnx`` for both targets. Calibration: 4 batches of 4 samples (``skimage.data`` photos,
seeded token ids with padded rows, seeded audio). Every TensorRT file goes through ``qdq check``; the
``onnxruntime`` files of both doors run on ONNX Runtime against the FP32 file (SQNR of the first output on one
batch, a sanity figure of random weights, not an accuracy). A cell is the seconds, or the error.

Families (``--family``): ``timm`` (28 image architectures: CNNs of many families, hybrids, vision transformers;
needs ``timm``), ``torchvision`` (13: channel shuffle, fire modules, inception, dense segmentation heads, video
models with 3-D convolutions, MaxViT, Swin V2, a one-stage and a two-stage detector: their first output, the
boxes of the first image), ``transformers`` (tiny random configs of 20 Hugging Face
architectures: encoders, decoders, vision and audio models, their default attention; needs ``transformers``) and
``keras`` (16 of ``keras.applications``, through the Keras door: ``qk.quantize_model`` + ``qk.calibrate`` +
``qk.export_onnx`` in the "torch" columns, the float export ``qk.export_float_onnx`` through ``quantize_onnx`` in
the "onnx" ones; needs ``tensorflow``).
``scikit-image`` for the photos.

Usage (repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/arch_sweep.py [--family timm] [--archs resnet18d,dla34] [--out F]
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

TIMM = {  # name -> input size: CNNs of many families, hybrids and vision transformers
    "tf_efficientnet_lite0": 160, "mobilenetv3_small_100": 160, "efficientnet_b0": 160, "regnetx_002": 160,
    "resnet18d": 160, "convnext_atto": 160, "ghostnet_100": 160, "mixnet_s": 160, "dla34": 160,
    "hrnet_w18_small": 160, "vit_tiny_patch16_224": 224, "levit_128s": 224, "mobilevit_xxs": 256, "repvgg_a0": 160,
    "rexnet_100": 160, "edgenext_xx_small": 160, "fastvit_t8": 160, "efficientformer_l1": 224, "mobileone_s0": 160,
    "lcnet_050": 160, "tinynet_e": 160, "semnasnet_050": 160, "densenet121": 128, "inception_v3": 299,
    "res2net50_14w_8s": 128, "coat_lite_tiny": 224, "pvt_v2_b0": 224, "swin_tiny_patch4_window7_224": 224,
}  # fmt: skip

_TEXT = {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "max_position_embeddings": 64}  # fmt: skip
_VISION = {"image_size": 64, "patch_size": 8, "num_channels": 3}
TRANSFORMERS = {  # name -> (model class, config class, config overrides, input kind)
    "bert": ("BertForSequenceClassification", "BertConfig", _TEXT, "text"),
    "distilbert": ("DistilBertModel", "DistilBertConfig", {"vocab_size": 1000, "dim": 64, "n_layers": 2, "n_heads": 4,
                                                          "hidden_dim": 128, "max_position_embeddings": 64}, "text"),
    "roberta": ("RobertaModel", "RobertaConfig", {**_TEXT, "max_position_embeddings": 80}, "text"),
    "albert": ("AlbertModel", "AlbertConfig", {**_TEXT, "embedding_size": 32}, "text"),
    "electra": ("ElectraModel", "ElectraConfig", {**_TEXT, "embedding_size": 32}, "text"),
    "deberta-v2": ("DebertaV2Model", "DebertaV2Config", _TEXT, "text"),
    "mpnet": ("MPNetModel", "MPNetConfig", _TEXT, "text"),
    "gpt2": ("GPT2Model", "GPT2Config", {"vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4,
                                         "n_positions": 64, "use_cache": False}, "text"),
    "llama": ("LlamaModel", "LlamaConfig", {**_TEXT, "num_key_value_heads": 2, "use_cache": False}, "text"),
    "qwen2": ("Qwen2Model", "Qwen2Config", {**_TEXT, "num_key_value_heads": 2, "use_cache": False}, "text"),
    "gemma2": ("Gemma2Model", "Gemma2Config", {**_TEXT, "num_key_value_heads": 2, "head_dim": 16, "use_cache": False},
               "text"),
    "t5-encoder": ("T5EncoderModel", "T5Config", {"vocab_size": 1000, "d_model": 64, "d_kv": 16, "d_ff": 128,
                                                  "num_layers": 2, "num_heads": 4}, "text"),
    "vit": ("ViTModel", "ViTConfig", {**_TEXT, **_VISION}, "image"),
    "dinov2": ("Dinov2Model", "Dinov2Config", {**_TEXT, **_VISION}, "image"),
    "swin": ("SwinModel", "SwinConfig", {"image_size": 64, "patch_size": 4, "embed_dim": 32, "depths": [1, 1],
                                         "num_heads": [2, 4], "window_size": 4}, "image"),
    "convnext": ("ConvNextModel", "ConvNextConfig", {"hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1]},
                 "image"),
    "mobilevit": ("MobileViTModel", "MobileViTConfig", {"image_size": 64, "hidden_sizes": [32, 48, 64],
                                                        "neck_hidden_sizes": [8, 16, 24, 32, 48, 64, 96]}, "image"),
    "segformer": ("SegformerForSemanticSegmentation", "SegformerConfig", {"hidden_sizes": [16, 32, 40, 64],
                                                                          "decoder_hidden_size": 64}, "image"),
    "wav2vec2": ("Wav2Vec2Model", "Wav2Vec2Config", {**_TEXT, "conv_dim": [32, 32], "conv_kernel": [10, 3],
                                                     "conv_stride": [5, 2], "num_conv_pos_embeddings": 16,
                                                     "num_conv_pos_embedding_groups": 4}, "audio"),
    "whisper-encoder": ("WhisperForAudioClassification", "WhisperConfig", {
        "vocab_size": 1000, "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4,
        "encoder_ffn_dim": 128, "decoder_layers": 1, "decoder_attention_heads": 4, "decoder_ffn_dim": 128,
        "num_mel_bins": 16, "max_source_positions": 50}, "features"),
}  # fmt: skip
TORCHVISION = {  # name -> input shape: the families the other two lack (channel shuffle, 3-D convs, dense heads)
    "shufflenet_v2_x0_5": (3, 128, 128), "squeezenet1_1": (3, 128, 128), "googlenet": (3, 128, 128),
    "mnasnet0_5": (3, 128, 128), "lraspp_mobilenet_v3_large": (3, 128, 128),
    "deeplabv3_mobilenet_v3_large": (3, 128, 128), "fcn_resnet50": (3, 96, 96), "r3d_18": (3, 8, 64, 64),
    "r2plus1d_18": (3, 8, 64, 64), "maxvit_t": (3, 224, 224), "swin_v2_t": (3, 128, 128),
    "ssdlite320_mobilenet_v3_large": (3, 320, 320), "fasterrcnn_mobilenet_v3_large_320_fpn": (3, 320, 320),
}  # fmt: skip
KERAS = {  # keras.applications name -> input size (NHWC): the Keras door's families
    "MobileNet": 96, "MobileNetV2": 96, "MobileNetV3Small": 96, "EfficientNetB0": 96, "EfficientNetV2B0": 96,
    "ResNet50V2": 96, "DenseNet121": 96, "NASNetMobile": 96, "Xception": 96, "InceptionV3": 96, "MobileNetV3Large": 96,
    "ConvNeXtTiny": 64, "InceptionResNetV2": 96, "ResNet50": 64, "VGG16": 64, "EfficientNetV2S": 64,
}  # fmt: skip
FAMILIES = {"timm": TIMM, "transformers": TRANSFORMERS, "torchvision": TORCHVISION, "keras": KERAS}


def _photos(size: int) -> list[Any]:
    import numpy as np
    import skimage.data
    import torch

    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    tensors = [torch.from_numpy(np.ascontiguousarray(p)).permute(2, 0, 1).float()[None] / 255 for p in photos]
    tensors = [torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear") for t in tensors]
    return [(torch.cat(tensors[i:] + tensors[:i]) - 0.45) / 0.25 for i in range(4)]


def _inputs(kind: str, size: int = 64) -> list[dict[str, Any]]:
    """4 batches of 4 samples of ``kind`` (``image``: photos; ``text``: seeded token ids, rows 2 and 3 padded;
    ``audio``: 0.25 s of seeded tones and noise at 16 kHz; ``features``: a log-spectrum-like [4, 16, 100])."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if kind == "image":
        return [{"pixel_values": batch} for batch in _photos(size)]
    if kind == "timm":
        return [{"x": batch} for batch in _photos(size)]
    if kind == "clips":  # 8 frames: the photos panning
        return [{"x": torch.stack([batch.roll(4 * t, dims=-1) for t in range(size)], dim=2)} for batch in _photos(64)]
    batches = []
    for _ in range(4):
        if kind == "text":
            ids = torch.randint(5, 1000, (4, 16), generator=generator)
            mask = torch.ones(4, 16, dtype=torch.int64)
            mask[2, 10:], mask[3, 6:] = 0, 0
            batches.append({"input_ids": ids * mask, "attention_mask": mask})
        elif kind == "audio":
            t = torch.arange(4000) / 16000
            f0 = 100 + 300 * torch.rand(4, 1, generator=generator)
            tone = torch.sin(2 * torch.pi * f0 * t) + 0.1 * torch.randn(4, 4000, generator=generator)
            batches.append({"input_values": tone})
        else:
            batches.append({"input_features": torch.randn(4, 16, 100, generator=generator).abs().log1p()})
    return batches


def _build(family: str, arch: str) -> tuple[Any, list[dict[str, Any]]]:
    """The float model (eval mode, seeded random weights) and its 4 calibration batches."""
    import torch

    torch.manual_seed(0)
    if family == "timm":
        import timm

        return timm.create_model(arch, pretrained=False).eval(), _inputs("timm", TIMM[arch])
    if family == "torchvision":
        import torchvision

        shape = TORCHVISION[arch]
        options = {"aux_logits": False, "init_weights": True} if arch == "googlenet" else {}
        heads = (torchvision.models.segmentation, torchvision.models.detection)
        if any(arch in torchvision.models.list_models(module) for module in heads):
            options = {"weights_backbone": None}  # nothing downloads
        model = torchvision.models.get_model(arch, weights=None, **options).eval()
        batches = _inputs("clips", shape[1]) if len(shape) == 4 else _inputs("timm", shape[-1])
        name = next(iter(inspect.signature(model.forward).parameters))  # x; the segmentation models' input
        return model, [{name: batch["x"]} for batch in batches]
    import transformers

    model_class, config_class, options, kind = TRANSFORMERS[arch]
    config = getattr(transformers, config_class)(**options)
    return getattr(transformers, model_class)(config).eval(), _inputs(kind)


def _first_output(model: Any, keys: list[str]) -> Any:
    """``model`` called with its batch's tensors as positional arguments (``keys``, in order), returning its first
    output tensor: what the ONNX door's FP32 file is exported from."""
    import torch

    from qdq.utils.batches import flatten_outputs

    class FirstOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return flatten_outputs(self.model(**dict(zip(keys, args, strict=True))))[0]

    return FirstOutput().eval()


def _first_outputs(paths: tuple[Path, ...], feed: dict[str, Any]) -> list[Any]:
    """The first output of each file on ONNX Runtime (its default optimizations: the int8 kernels) for ``feed``."""
    import onnxruntime as ort

    return [ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, feed)[0] for p in paths]


def _sqnr(reference: Any, other: Any) -> str:
    import numpy as np

    signal, noise = float((reference**2).sum()), float(((reference - other) ** 2).sum())
    return f"{10 * np.log10(signal / max(noise, 1e-30)):.0f} dB" if signal else "FP32 output all 0"


def _error(err: BaseException) -> str:
    where = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]} ({Path(where.filename).name}:{where.lineno})"


def run_one_keras(arch: str, folder: Path) -> dict[str, Any]:
    """The Keras door's cells of a ``keras.applications`` model (random weights): ``qk.quantize_model`` +
    ``qk.calibrate`` + ``qk.export_onnx`` for each target (the "torch" cells of the table), and its float export
    (``qk.export_float_onnx``) through ``quantize_onnx`` (the "onnx" cells)."""
    import keras
    import qdq.keras as qk

    keras.utils.set_random_seed(0)
    size = KERAS[arch]
    images = [b["x"].permute(0, 2, 3, 1).numpy() for b in _inputs("timm", size)]
    row: dict[str, Any] = {"arch": arch}
    model = getattr(keras.applications, arch)(
        weights=None, input_shape=(size, size, 3), classes=10, classifier_activation=None
    )  # logits: a softmax of 10 hides errors
    fp32 = qk.export_float_onnx(model, folder / "fp32.onnx", "onnxruntime")
    name = _input_name(fp32)
    _onnx_cells(row, fp32, [{name: x} for x in images], folder)
    for target in ("onnxruntime", "tensorrt"):
        cell, path, start = f"torch {target}", folder / f"keras-{target}.onnx", time.perf_counter()
        try:
            quantized = qk.quantize_model(model, target=target)
            qk.calibrate(quantized, images)
            qk.export_onnx(quantized, images[0], path, target=target)
            row[cell] = f"{time.perf_counter() - start:.0f} s" + _checked(path, target, fp32, {name: images[0]})
        except Exception as err:
            row[cell] = "CRASH " + _error(err)
    return row


def _input_name(path: Path) -> str:
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def _checked(path: Path, target: str, fp32: Path, feed: dict[str, Any]) -> str:
    """What a written file was checked with: ``qdq check`` (TensorRT), or its SQNR against FP32 on ONNX Runtime."""
    from qdq.targets.tensorrt.check import check_tensorrt

    if target == "tensorrt":
        return " check " + ("PASS" if check_tensorrt(path).ok else "FAIL")
    return f", {_sqnr(*_first_outputs((fp32, path), feed))}"


def _onnx_cells(row: dict[str, Any], fp32: Path, feeds: list[dict[str, Any]], folder: Path) -> None:
    """The ONNX door's two cells: ``quantize_onnx`` of ``fp32`` for each target, the file checked."""
    import qdq

    for target, options in (("onnxruntime", None), ("tensorrt", {"float": "float16"})):
        cell, path, start = f"onnx {target}", folder / f"onnx-{target}.onnx", time.perf_counter()
        try:
            qdq.quantize_onnx(fp32, feeds, path, target=target, target_options=options, progress=False)
            row[cell] = f"{time.perf_counter() - start:.0f} s" + _checked(path, target, fp32, feeds[0])
        except Exception as err:  # a crash is the finding
            row[cell] = "CRASH " + _error(err)


def run_one(family: str, arch: str, folder: Path) -> dict[str, Any]:
    """Every door and target on ``arch``: ``{cell: seconds and what was checked, or the error}``."""
    if family == "keras":
        return run_one_keras(arch, folder)
    import torch

    import qdq

    model, data = _build(family, arch)
    keys = list(data[0])
    row: dict[str, Any] = {"arch": arch}
    fp32 = folder / "fp32.onnx"
    with torch.no_grad():
        torch.onnx.export(_first_output(model, keys), tuple(data[0].values()), fp32, input_names=keys,
                          opset_version=17, dynamo=False)  # fmt: skip
    feeds = [{k: v.numpy() for k, v in batch.items()} for batch in data]
    _onnx_cells(row, fp32, feeds, folder)
    for target in ("onnxruntime", "tensorrt"):
        cell, path, start = f"torch {target}", folder / f"torch-{target}.onnx", time.perf_counter()
        try:
            quantized = qdq.quantize_model(_build(family, arch)[0], qdq.QuantConfig(target=target))
            qdq.calibrate(quantized, data, progress=False)
            qdq.export_onnx(quantized, data[0], path)
            row[cell] = f"{time.perf_counter() - start:.0f} s" + _checked(path, target, fp32, feeds[0])
        except Exception as err:
            row[cell] = "CRASH " + _error(err)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="timm", help="which architectures (default timm)")
    parser.add_argument("--archs", default=None, help="comma-separated names of the family (default: all)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one architecture
    args = parser.parse_args()
    if args.one:
        warnings.simplefilter("ignore")
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run_one(args.family, args.one, Path(folder))))
        return
    rows = []
    for arch in (args.archs or ",".join(FAMILIES[args.family])).split(","):
        print(f"{arch}: running", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--family", args.family, "--one", arch],
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
        lines = done.stdout.strip().splitlines()
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"arch": arch, "onnx onnxruntime": f"CRASH process exit {done.returncode}: "
                                                       f"{done.stderr.strip().splitlines()[-1:]}"})  # fmt: skip
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    cells = ["onnx onnxruntime", "onnx tensorrt", "torch onnxruntime", "torch tensorrt"]
    door = "keras" if args.family == "keras" else "torch"  # the second door's columns, by what it is
    shown = [cell.replace("torch", door) for cell in cells]
    print("| architecture | " + " | ".join(shown) + " |\n|" + " --- |" * (len(cells) + 1))
    for row in rows:
        print(f"| {row['arch']} | " + " | ".join(str(row.get(cell, "")) for cell in cells) + " |")
    crashes = sum(str(row.get(cell, "")).startswith("CRASH") for row in rows for cell in cells)
    checks = [str(row.get(cell, "")) for row in rows for cell in cells if "tensorrt" in cell]
    print(
        f"\n{len(rows)} architectures, {crashes} crashes; qdq check PASS on "
        f"{sum('PASS' in c for c in checks)} of {sum('check' in c for c in checks)} TensorRT files."
    )
    print("Legend: seconds to quantize (ONNX door) or quantize + calibrate + export (PyTorch door; for keras, the "
          "Keras door); dB: SQNR of the "
          "onnxruntime files' first output against FP32 on one batch (random weights); check: qdq check of the "
          "TensorRT file.")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
