"""Score a TensorRT 11 float16 file as TensorRT computes it, on a CPU: float32 arithmetic, every float tensor
rounded to float16.

ONNX Runtime's CPU kernels run a float16 file's ops in float16 where they have float16 kernels (with float16
accumulation in some), which TensorRT does not: its float16 kernels accumulate in float32. So the task metric of a
float16 file on ONNX Runtime's CPU mixes the file's float16 storage with the CPU kernels' arithmetic. This script
rewrites the file into its emulation (initializers and casts to float32, a float16 round trip after every op that
writes a float tensor; the Q/DQ steps keep the float16 values they hold) and scores it with ``onnx_in.py``'s task
metric beside the file itself.

Usage: ``PYTHONPATH=src python benchmarks/fp16_emulated.py nudenet WORKDIR/nudenet/qdq-trt-fp16/int8.onnx``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
import onnx_in

_NOT_ROUNDED = ("QuantizeLinear", "Shape", "Range", "ConstantOfShape")  # integer or index outputs


def _to_float32(model: onnx.ModelProto) -> None:
    """Every float16 initializer, constant, cast target and declared type made float32 (values unchanged)."""
    graph = model.graph
    for tensor in graph.initializer:
        if tensor.data_type == TensorProto.FLOAT16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    for info in [*graph.input, *graph.output]:
        if info.type.tensor_type.elem_type == TensorProto.FLOAT16:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    del graph.value_info[:]
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name in ("to", "output_dtype") and attribute.i == TensorProto.FLOAT16:
                attribute.i = TensorProto.FLOAT
            if attribute.name == "value" and attribute.t.data_type == TensorProto.FLOAT16:
                value = numpy_helper.to_array(attribute.t).astype(np.float32)
                attribute.t.CopyFrom(numpy_helper.from_array(value, attribute.t.name))


def emulate(source: Path, out: Path) -> Path:
    """Write the float32-arithmetic, float16-storage emulation of the float16 file ``source`` to ``out``."""
    model = onnx.load(str(source))
    _to_float32(model)
    floats = {v.name for v in onnx.shape_inference.infer_shapes(model).graph.value_info
              if v.type.tensor_type.elem_type == TensorProto.FLOAT}  # fmt: skip
    nodes = []
    for node in model.graph.node:
        nodes.append(node)
        if node.op_type in _NOT_ROUNDED:
            continue
        for index, name in enumerate(list(node.output)):
            if name not in floats:
                continue
            node.output[index] = f"{name}.float32"
            nodes.append(helper.make_node("Cast", [f"{name}.float32"], [f"{name}.float16"], to=TensorProto.FLOAT16))
            nodes.append(helper.make_node("Cast", [f"{name}.float16"], [name], to=TensorProto.FLOAT))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(onnx_in.CASES))
    parser.add_argument("file", type=Path, help="a float16 file written by qdq for TensorRT 11")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    onnx_in.RUN_OPTIONS["uint8_weights"] = None  # int8 weights computed exactly on any CPU
    calib, evals = onnx_in.DEFAULT_IMAGES[args.model]
    case = onnx_in.CASES[args.model](calib, evals)
    reference = onnx_in.outputs_of(case.source, case.evaluation, args.threads)
    with tempfile.TemporaryDirectory() as folder:
        emulated = emulate(args.file, Path(folder) / "emulated.onnx")
        for label, path in (("the file on ONNX Runtime's CPU kernels", args.file),
                            ("float32 arithmetic, float16 tensors (TensorRT's)", emulated)):  # fmt: skip
            metrics = case.score(onnx_in.outputs_of(path, case.evaluation, args.threads), reference)
            print(f"{args.model}: {label}: {case.describe(metrics, False)}")


if __name__ == "__main__":
    main()
