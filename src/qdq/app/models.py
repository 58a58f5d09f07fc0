"""Models of the qdq application: two small CNNs for the digits task, and ``load_model`` for user specs.

The two CNNs take ``[N, 3, 28, 28]`` float32 images (MNIST; any size ≥ 8 works: they end in global average
pooling) and return ``[N, num_classes]`` logits. They use only plain ``nn`` modules and Python ``+`` / ``*``
in ``forward``, with no data-dependent control flow, so ``qdq.quantize_model`` can replace their modules
and ``torch.fx.symbolic_trace`` can trace them (the Q/DQ placement pass relies on it).

Model specs understood by :func:`load_model`:
    * ``"digits_resnet"``, ``"digits_mobilenet"``: the CNNs below (10 classes unless ``num_classes``).
    * ``"digits_vit"``, ``"digits_bert"``: the transformers of :mod:`qdq.app.digit_transformers`, for 28×28
      images (MNIST); ``digits_bert`` needs Hugging Face transformers.
    * ``"torchvision:<name>"``: any torchvision classification model (``torchvision:resnet50``), randomly
      initialised: nothing is ever downloaded; pass ``weights`` for trained values.
    * ``"path/to/file.py:<function>"``: the file is imported and ``function()`` (or
      ``function(num_classes=...)`` when ``num_classes`` is given) must return an ``nn.Module``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qdq.app import digit_transformers
from qdq.errors import QdqConfigError, did_you_mean
from qdq.utils.modes import eval_mode
from qdq.utils.user_code import first_line, load_function

__all__ = [
    "BasicBlock",
    "DigitsMobileNet",
    "DigitsResNet",
    "InvertedResidual",
    "SqueezeExcite",
    "check_input_compatible",
    "digits_mobilenet",
    "digits_resnet",
    "is_zoo_model",
    "load_model",
    "load_weights",
    "model_names",
]


# ------------------------------------------------------------------------------------------- ResNet-style
def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    """``Conv2d`` (no bias, "same" padding for odd kernels) followed by ``BatchNorm2d``."""
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False)
    return [conv, nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """ResNet basic block: two 3×3 conv-BN, ``out + identity``, ReLU (torchvision's attribute names).

    When ``stride != 1`` or the channel count changes, the identity goes through ``downsample``
    (1×1 conv with that stride, then BN); otherwise ``downsample`` is None.
    """

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + identity
        return self.relu2(out)


#: The digits ResNet's default shape: stem conv (channels, stride), then each basic block's channels.
DIGITS_RESNET_STEM = (32, 2)
DIGITS_RESNET_WIDTHS = (32, 64, 128)


class DigitsResNet(nn.Module):
    """Stem (3×3 conv-BN-ReLU) → BasicBlocks → global average pool → Linear.

    Args:
        num_classes: number of output logits.
        widths: output channels of each block; block ``i > 0`` halves the resolution (stride 2) when its
            width differs from the previous one.
        stem_width: channels of the stem conv.
        stem_stride: stride of the stem conv (2: the 28² input is processed at 14² and below, as ImageNet
            ResNets downsample early).
    """

    def __init__(
        self, num_classes: int = 10, widths: tuple[int, ...] = DIGITS_RESNET_WIDTHS,
        stem_width: int = DIGITS_RESNET_STEM[0], stem_stride: int = DIGITS_RESNET_STEM[1],
    ):  # fmt: skip
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, stem_width, 3, stem_stride)
        self.relu = nn.ReLU(inplace=True)
        blocks, cin = [], stem_width
        for cout in widths:
            blocks.append(BasicBlock(cin, cout, stride=1 if cout == cin else 2))
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        x = self.avgpool(x)
        return self.fc(torch.flatten(x, 1))


def digits_resnet(num_classes: int = 10) -> DigitsResNet:
    """The ResNet-style digits CNN (309 k parameters, 10.3 M multiply-adds per 28×28 image).

    For a 28×28 input: stem conv stride 2 → 32 ch @14²; BasicBlocks 32 @14², 64 @7², 128 @4² (the last two
    with stride 2 and a 1×1 conv shortcut); global average pool; Linear 128 → ``num_classes``. Sized so that
    int8 kernels pay on a 2-core CPU (benchmarks/RESULTS.md, demo) while training it takes seconds per epoch.
    """
    return DigitsResNet(num_classes)


# ------------------------------------------------------------------------------------ MobileNet-style
class SqueezeExcite(nn.Module):
    """Squeeze-excitation: ``x * sigmoid(conv(silu(conv(avgpool(x)))))`` (EfficientNet's form)."""

    def __init__(self, channels: int, squeeze: int):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.act = nn.SiLU(inplace=True)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.act(self.fc1(self.avgpool(x)))))
        return x * scale


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"silu": lambda: nn.SiLU(inplace=True),
                                                     "relu6": lambda: nn.ReLU6(inplace=True)}  # fmt: skip


def _activation(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise QdqConfigError(f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()


class InvertedResidual(nn.Module):
    """MobileNetV2 / EfficientNet MBConv block.

    1×1 expand conv-BN-act (skipped when ``expand == 1``) → 3×3 depthwise conv-BN-act (``stride``) →
    optional squeeze-excitation (squeeze to ``max(1, cin // 4)`` channels) → 1×1 project conv-BN (no
    activation) → ``out + x`` when ``stride == 1`` and ``cin == cout``. ``act``: ``"silu"`` (EfficientNet)
    or ``"relu6"`` (MobileNetV2).
    """

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 4, se: bool = True, act: str = "silu"):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [*_conv_bn(cin, hidden, 1), _activation(act)]
        layers += [*_conv_bn(hidden, hidden, 3, stride, groups=hidden), _activation(act)]
        if se:
            layers.append(SqueezeExcite(hidden, max(1, cin // 4)))
        layers += _conv_bn(hidden, cout, 1)
        self.block = nn.Sequential(*layers)
        self.use_residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_residual:
            out = out + x
        return out


# (out channels, stride, expansion) of each InvertedResidual after the stem.
_MOBILENET_BLOCKS: tuple[tuple[int, int, int], ...] = ((32, 1, 1), (64, 2, 4), (64, 1, 4), (128, 2, 4), (128, 1, 4))


class DigitsMobileNet(nn.Module):
    """Stem (3×3 conv-BN-act) → InvertedResiduals → 1×1 head conv-BN-act → global average pool → Linear.

    Args:
        num_classes: number of output logits.
        se: use squeeze-excitation in every block (EfficientNet-style); False gives MobileNetV2-style blocks.
        blocks: ``(out_channels, stride, expansion)`` per block.
        stem_width, head_width: channels of the stem conv and of the last 1×1 conv.
        stem_stride: stride of the stem conv.
        act: the activation, ``"silu"`` (EfficientNet) or ``"relu6"`` (MobileNetV2).
    """

    def __init__(
        self, num_classes: int = 10, se: bool = False, blocks: tuple[tuple[int, int, int], ...] = _MOBILENET_BLOCKS,
        stem_width: int = 32, head_width: int = 512, stem_stride: int = 2, act: str = "relu6",
    ):  # fmt: skip
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, stem_width, 3, stem_stride), _activation(act))
        layers, cin = [], stem_width
        for cout, stride, expand in blocks:
            layers.append(InvertedResidual(cin, cout, stride, expand, se, act))
            cin = cout
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Sequential(*_conv_bn(cin, head_width, 1), _activation(act))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(head_width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        x = self.avgpool(x)
        return self.fc(torch.flatten(x, 1))


def digits_mobilenet(num_classes: int = 10, se: bool = False, act: str = "relu6") -> DigitsMobileNet:
    """The MobileNetV2-style digits CNN (315 k parameters, 8.0 M multiply-adds per 28×28 image).

    For a 28×28 input: stem conv stride 2 → 32 ch @14²; inverted residual blocks 32 @14² (no expansion),
    64 @7² ×2, 128 @4² ×2 (expansion 4, depthwise 3×3, ReLU6, residual add in the second block of each
    pair); 1×1 head conv 512 ch; global average pool; Linear. Sized so that int8 kernels pay on a 2-core CPU:
    at half these widths the NHWC Transposes and the unfused QLinearAdds took back what ONNX Runtime's int8
    convolutions gained (benchmarks/RESULTS.md, demo: "Why the MobileNet was widened").
    ``se=True, act="silu"`` gives the EfficientNet-style variant (squeeze-excitation, SiLU).
    """
    return DigitsMobileNet(num_classes, se=se, act=act)


_BUILTIN: dict[str, Callable[..., nn.Module]] = {
    "digits_resnet": digits_resnet, "digits_mobilenet": digits_mobilenet,
    "digits_vit": digit_transformers.digits_vit, "digits_bert": digit_transformers.digits_bert,  # 28x28 (MNIST)
}  # fmt: skip
_SPEC_FORMS = "'digits_resnet', 'digits_mobilenet', 'torchvision:<name>' or 'path/to/file.py:<function>'"


# ------------------------------------------------------------------------------------------ load_model
def _torchvision_names() -> list[str]:
    import torchvision.models as tvm

    return sorted(tvm.list_models(module=tvm))


def is_zoo_model(spec: str) -> bool:
    """Whether ``spec`` names a model built here with random weights (the digits CNNs, ``torchvision:NAME``),
    as opposed to a factory file, which may load trained weights itself."""
    spec = str(spec).strip()
    return spec in _BUILTIN or spec.startswith("torchvision:")


def model_names() -> list[str]:
    """Every model name :func:`load_model` accepts without a file: the digits CNNs and torchvision's classifiers."""
    return [*_BUILTIN, *(f"torchvision:{n}" for n in _torchvision_names())]


def _torchvision_model(name: str, num_classes: int | None) -> nn.Module:
    import torchvision.models as tvm

    names = _torchvision_names()
    if name not in names:
        raise QdqConfigError(f"unknown torchvision classification model {name!r}.{did_you_mean(name, names)}")
    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    return tvm.get_model(name, weights=None, **kwargs)


def _file_model(file: str, function: str, num_classes: int | None) -> nn.Module:
    factory = load_function(f"{file}:{function}", what="model file")
    try:
        model = factory() if num_classes is None else factory(num_classes=num_classes)
    except Exception as err:
        raise QdqConfigError(f"{file}:{function}() failed: {first_line(err)}") from err
    if not isinstance(model, nn.Module):
        raise QdqConfigError(f"{file}:{function}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def _build_model(spec: str, num_classes: int | None) -> nn.Module:
    if spec in _BUILTIN:
        return _BUILTIN[spec](**({} if num_classes is None else {"num_classes": num_classes}))
    if spec.startswith("torchvision:"):
        return _torchvision_model(spec.split(":", 1)[1], num_classes)
    file, sep, function = spec.rpartition(":")
    if sep and file.endswith(".py") and function:
        return _file_model(file, function, num_classes)
    if spec.endswith(".py"):
        raise QdqConfigError(f"model spec {spec!r} names no function; expected 'path/to/file.py:<function>'")
    hint = did_you_mean(spec, [*_BUILTIN, *_torchvision_names()])
    raise QdqConfigError(f"unknown model {spec!r}; expected {_SPEC_FORMS}.{_torchvision_hint(hint)}")


def _torchvision_hint(hint: str) -> str:
    """Turn "Did you mean 'resnet50'?" into "Did you mean 'torchvision:resnet50'?" for bare torchvision names."""
    if hint and not any(f"'{b}'" in hint for b in _BUILTIN) and "torchvision:" not in hint:
        return hint.replace(" Did you mean '", " Did you mean 'torchvision:")
    return hint


def load_model(spec: str, weights: str | os.PathLike[str] | None = None, num_classes: int | None = None) -> nn.Module:
    """Build the model named by ``spec`` (see the module docstring) and optionally load local weights.

    Args:
        spec: ``"digits_resnet"``, ``"digits_mobilenet"``, ``"torchvision:<name>"`` or
            ``"path/to/file.py:<function>"``.
        weights: path of a ``state_dict`` saved with ``torch.save`` (or a checkpoint dict holding it under
            ``"state_dict"`` or ``"model"``); None keeps the random initialisation. Never downloads.
        num_classes: number of output classes; None keeps the model's default (10 for the digits CNNs,
            1000 for torchvision, the factory's own default for a file).

    Returns:
        The model on the CPU, in eval mode.

    Raises:
        QdqConfigError: unknown name, missing file or function, missing or mismatching weights (one line).
    """
    model = _build_model(str(spec).strip(), num_classes)
    if weights is not None:
        load_weights(model, weights)
    return model.eval()


# --------------------------------------------------------------------------------------------- weights
def _read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    if not path.is_file():
        raise QdqConfigError(f"weights file {str(path)!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise QdqConfigError(f"cannot read weights file {str(path)!r}: {first_line(err)}") from None
    for key in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise QdqConfigError(f"weights file {str(path)!r} holds no state_dict (a dict of tensors)")
    if obj and all(k.startswith("module.") for k in obj):  # saved from DataParallel / DDP
        obj = {k.removeprefix("module."): v for k, v in obj.items()}
    return obj


def _mismatch_message(model_sd: Mapping[str, torch.Tensor], file_sd: Mapping[str, torch.Tensor]) -> str:
    """``""`` when the keys and shapes agree, else a one-line summary (first 3 keys of each kind)."""
    ignorable = ("num_batches_tracked",)
    missing = [k for k in model_sd if k not in file_sd and not k.endswith(ignorable)]
    unexpected = [k for k in file_sd if k not in model_sd]
    shapes = [
        f"{k} {list(file_sd[k].shape)} vs {list(v.shape)}"
        for k, v in model_sd.items()
        if k in file_sd and file_sd[k].shape != v.shape
    ]
    parts = [
        f"{label} ({len(keys)}): {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
        for label, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape file vs model", shapes))
        if keys
    ]
    return "; ".join(parts)


def load_weights(model: nn.Module, weights: str | os.PathLike[str]) -> nn.Module:
    """Load a local state_dict file into ``model`` (strict: same keys and shapes), in place; returns ``model``.

    Missing ``num_batches_tracked`` buffers (old checkpoints) are tolerated; a ``"module."`` prefix on
    every key (DataParallel) is removed.

    Raises:
        QdqConfigError: the file is missing, unreadable, not a state_dict, or does not match the model.
    """
    path = Path(weights).expanduser()
    state = _read_state_dict(path)
    problem = _mismatch_message(model.state_dict(), state)
    if problem:
        raise QdqConfigError(f"weights {str(path)!r} do not match the model: {problem}")
    model.load_state_dict(state, strict=False)
    return model


# --------------------------------------------------------------------------------------------- checks
def check_input_compatible(
    model: nn.Module, example_input: torch.Tensor, num_classes: int | None = None
) -> torch.Tensor:
    """Run one forward pass of ``model`` on ``example_input`` (no grad, eval mode) and return the output.

    The model's train/eval mode is restored afterwards, and BatchNorm statistics are not updated.

    Args:
        model: the model to check.
        example_input: a batch as the data will feed it, e.g. ``[N, 3, 32, 32]`` float32.
        num_classes: if given, the output must be ``[N, K]`` logits with ``K >= num_classes``.

    Raises:
        QdqConfigError: ``model does not accept input of shape (...): <first line of the original error>``,
            or the output is not logits for ``num_classes`` classes.
    """
    shape = tuple(example_input.shape)
    try:
        with eval_mode(model), torch.no_grad():
            out = model(example_input)
    except Exception as err:
        raise QdqConfigError(f"model does not accept input of shape {shape}: {first_line(err)}") from None
    if num_classes is not None:
        _check_logits(out, shape, num_classes)
    return out


def _check_logits(out: Any, shape: tuple[int, ...], num_classes: int) -> None:
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != shape[0]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise QdqConfigError(f"model output for input of shape {shape} is {got}, expected logits [N, classes]")
    if out.shape[1] < num_classes:
        raise QdqConfigError(f"model outputs {out.shape[1]} logits but the data has {num_classes} classes")
