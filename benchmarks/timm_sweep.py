"""No crash on architectures nobody here tuned to: timm's image models (random weights: the graphs, not the
accuracy) through both doors and both targets, with the default calibration.

For each architecture, in its own process: the float model exported to ONNX at a fixed batch of 4 (a static-batch
file, as many exporters write), quantized by ``quantize_onnx`` for ``onnxruntime`` and for ``tensorrt`` with a
float16 remainder; the same model through ``quantize_model`` + ``calibrate`` + ``export_onnx`` for both targets.
Calibration: 4 batches of 4 ``skimage.data`` photos. Every TensorRT file goes through ``qdq check``; the
``onnxruntime`` files of the ONNX door run on ONNX Runtime against the FP32 file (SQNR of the logits on one batch,
a sanity figure of random weights, not an accuracy). A cell is the seconds, or the error.

Usage (repository root; needs ``timm`` and ``scikit-image``)::

    PYTHONPATH=src:benchmarks python benchmarks/timm_sweep.py [--archs resnet18d,dla34] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

ARCHS = {  # name -> input size: CNNs of many families, hybrids and vision transformers
    "tf_efficientnet_lite0": 160, "mobilenetv3_small_100": 160, "efficientnet_b0": 160, "regnetx_002": 160,
    "resnet18d": 160, "convnext_atto": 160, "ghostnet_100": 160, "mixnet_s": 160, "dla34": 160,
    "hrnet_w18_small": 160, "vit_tiny_patch16_224": 224, "levit_128s": 224, "mobilevit_xxs": 256, "repvgg_a0": 160,
    "rexnet_100": 160, "edgenext_xx_small": 160, "fastvit_t8": 160, "efficientformer_l1": 224, "mobileone_s0": 160,
    "lcnet_050": 160, "tinynet_e": 160, "semnasnet_050": 160, "densenet121": 128, "inception_v3": 299,
    "res2net50_14w_8s": 128, "coat_lite_tiny": 224, "pvt_v2_b0": 224, "swin_tiny_patch4_window7_224": 224,
}  # fmt: skip


def _batches(size: int) -> list[Any]:
    import numpy as np
    import skimage.data
    import torch

    photos = [skimage.data.astronaut(), skimage.data.coffee(), skimage.data.chelsea(), skimage.data.rocket()]
    tensors = [torch.from_numpy(np.ascontiguousarray(p)).permute(2, 0, 1).float()[None] / 255 for p in photos]
    tensors = [torch.nn.functional.interpolate(t, size=(size, size), mode="bilinear") for t in tensors]
    return [(torch.cat(tensors[i:] + tensors[:i]) - 0.45) / 0.25 for i in range(4)]


def _sqnr(reference: Any, other: Any) -> float:
    import numpy as np

    noise = float(((reference - other) ** 2).sum())
    return float(10 * np.log10(float((reference**2).sum()) / max(noise, 1e-30)))


def _error(err: BaseException) -> str:
    where = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]} ({Path(where.filename).name}:{where.lineno})"


def run_one(arch: str, size: int, folder: Path) -> dict[str, Any]:
    """Every door and target on ``arch``: ``{cell: seconds and what was checked, or the error}``."""
    import onnxruntime as ort
    import timm
    import torch

    import qdq
    from qdq.targets.tensorrt.check import check_tensorrt

    torch.manual_seed(0)
    data = _batches(size)
    row: dict[str, Any] = {"arch": arch}
    fp32 = folder / "fp32.onnx"
    torch.onnx.export(timm.create_model(arch, pretrained=False).eval(), data[0], fp32, input_names=["x"],
                      opset_version=17, dynamo=False)  # fmt: skip
    feeds = [{"x": batch.numpy()} for batch in data]
    for target, options in (("onnxruntime", None), ("tensorrt", {"float": "float16"})):
        cell, path, start = f"onnx {target}", folder / f"onnx-{target}.onnx", time.perf_counter()
        try:
            qdq.quantize_onnx(fp32, feeds, path, target=target, target_options=options, progress=False)
            row[cell] = f"{time.perf_counter() - start:.0f} s"
            if target == "tensorrt":
                row[cell] += " check " + ("PASS" if check_tensorrt(path).ok else "FAIL")
            else:
                out, ref = (ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, feeds[0])[0]
                            for p in (path, fp32))  # fmt: skip
                row[cell] += f", {_sqnr(ref, out):.0f} dB"
        except Exception as err:  # a crash is the finding
            row[cell] = "CRASH " + _error(err)
    for target in ("onnxruntime", "tensorrt"):
        cell, path, start = f"torch {target}", folder / f"torch-{target}.onnx", time.perf_counter()
        try:
            model = qdq.quantize_model(timm.create_model(arch, pretrained=False).eval(), qdq.QuantConfig(target=target))
            qdq.calibrate(model, data, progress=False)
            qdq.export_onnx(model, data[0], path)
            row[cell] = f"{time.perf_counter() - start:.0f} s"
            if target == "tensorrt":
                row[cell] += " check " + ("PASS" if check_tensorrt(path).ok else "FAIL")
        except Exception as err:
            row[cell] = "CRASH " + _error(err)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated timm names (default: all)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one architecture
    args = parser.parse_args()
    if args.one:
        warnings.simplefilter("ignore")
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run_one(args.one, ARCHS.get(args.one, 224), Path(folder))))
        return
    rows = []
    for arch in args.archs.split(","):
        print(f"{arch}: running", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--one", arch], capture_output=True, text=True, timeout=1800)
        lines = done.stdout.strip().splitlines()
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    {"arch": arch, "onnx onnxruntime": f"CRASH process exit {done.returncode}: "
                                                       f"{done.stderr.strip().splitlines()[-1:]}"})  # fmt: skip
    cells = ["onnx onnxruntime", "onnx tensorrt", "torch onnxruntime", "torch tensorrt"]
    print("| architecture | " + " | ".join(cells) + " |\n|" + " --- |" * (len(cells) + 1))
    for row in rows:
        print(f"| {row['arch']} | " + " | ".join(str(row.get(cell, "")) for cell in cells) + " |")
    crashes = sum(str(row.get(cell, "")).startswith("CRASH") for row in rows for cell in cells)
    checks = [str(row.get(cell, "")) for row in rows for cell in cells if "tensorrt" in cell]
    print(f"\n{len(rows)} architectures, {crashes} crashes; qdq check PASS on "
          f"{sum('PASS' in c for c in checks)} of {sum('check' in c for c in checks)} TensorRT files.")
    print("Legend: seconds to quantize (ONNX door) or quantize + calibrate + export (PyTorch door); dB: SQNR of the "
          "onnxruntime file's logits against FP32 on one batch (random weights); check: qdq check of the TensorRT "
          "file.")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
