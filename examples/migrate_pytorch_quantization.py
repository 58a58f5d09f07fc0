"""pytorch-quantization's recipe, unchanged but for the imports, then the same job in qdq's own calls.

Part 1 is the seed toolkit's classification recipe (histogram calibrators by default, modules swapped by
``quant_modules``, statistics collected with the quantizers' calib switches, ranges loaded with
``load_calib_amax``); part 2 does it with ``qdq.collect_stats`` and ``qdq.load_amax``; both give the same ranges.

    python examples/migrate_pytorch_quantization.py
"""

import torch
import torchvision

import qdq
from qdq import calib, quant_modules  # was: from pytorch_quantization import calib, quant_modules
from qdq import nn as quant_nn  # was: from pytorch_quantization import nn as quant_nn
from qdq.tensor_quant import QuantDescriptor  # was: from pytorch_quantization.tensor_quant import ...

torch.manual_seed(0)
batches = [torch.randn(8, 3, 64, 64) for _ in range(4)]  # your calibration images

# --- part 1: the seed's recipe --------------------------------------------------------------------------------------
quant_desc_input = QuantDescriptor(calib_method="histogram")
quant_nn.QuantConv2d.set_default_quant_desc_input(quant_desc_input)
quant_nn.QuantLinear.set_default_quant_desc_input(quant_desc_input)
quant_nn.QuantAdaptiveAvgPool2d.set_default_quant_desc_input(quant_desc_input)
with quant_modules.initialize():  # a context manager in qdq (initialize() / deactivate() also work)
    seed_model = torchvision.models.resnet18(num_classes=10).eval()  # built with quantized modules

with torch.no_grad():
    quantizers = [m for m in seed_model.modules() if isinstance(m, quant_nn.TensorQuantizer)]
    for quantizer in quantizers:  # the seed's collect_stats()
        quantizer.disable_quant()
        quantizer.enable_calib()
    for batch in batches:
        seed_model(batch)
    for quantizer in quantizers:  # the seed's compute_amax(model, method="percentile", percentile=99.99)
        if isinstance(quantizer.calibrator, calib.MaxCalibrator):
            quantizer.load_calib_amax()
        else:
            quantizer.load_calib_amax("percentile", percentile=99.99)
        quantizer.enable_quant()
        quantizer.disable_calib()

# --- part 2: qdq's calls for the same job ---------------------------------------------------------------------------
model = torchvision.models.resnet18(num_classes=10).eval()
model.load_state_dict(seed_model.state_dict(), strict=False)  # the same weights (the seed model's extra keys: ranges)
model = qdq.quantize_model(model)  # converts an existing model, no monkey patch
qdq.collect_stats(model, batches, calibrator="histogram", progress=False)  # every activation quantizer
qdq.load_amax(model, "percentile", percentile=99.99)  # weights: max per channel (weight_method="max")

seed = {name: m for name, m in seed_model.named_modules() if isinstance(m, quant_nn.TensorQuantizer)}
ours = dict(qdq.workflow.named_quantizers(model))
same = seed.keys() == ours.keys() and all(torch.equal(seed[name].amax, ours[name].amax) for name in ours)
print(f"{len(ours)} quantizers; the two recipes give the same ranges: {same}")
quant_nn.QuantConv2d.set_default_quant_desc_input(QuantDescriptor())  # the class defaults back (they are global)
quant_nn.QuantLinear.set_default_quant_desc_input(QuantDescriptor())
quant_nn.QuantAdaptiveAvgPool2d.set_default_quant_desc_input(QuantDescriptor())
print("exported:", qdq.export_onnx(model, batches[0], "resnet18_seed_recipe.onnx"))
