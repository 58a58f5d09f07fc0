"""qdq.app.models: the digits CNNs (shapes, fx tracing, qdq replacement), load_model and its errors."""

from __future__ import annotations

import operator
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.fx
from torch import nn

from qdq.app.models import (
    check_input_compatible,
    digits_mobilenet,
    digits_resnet,
    load_model,
    load_weights,
    model_names,
)
from qdq.errors import QdqConfigError

CNNS = {"digits_resnet": digits_resnet, "digits_mobilenet": digits_mobilenet}


def _one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(QdqConfigError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ digits CNNs
@pytest.mark.parametrize("name", CNNS)
def test_digits_cnn_output_shape(name):
    model = CNNS[name](num_classes=7).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)  # global pooling: any input size


@pytest.mark.parametrize("name", CNNS)
def test_digits_cnn_is_fx_traceable_with_residual_adds(name):
    model = CNNS[name]().eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 3, 32, 32)
    assert torch.equal(traced(x), model(x))
    adds = [n for n in traced.graph.nodes if n.op == "call_function" and n.target in (operator.add, torch.add)]
    assert len(adds) >= 2  # Python `+` of the residual connections, visible to the placement pass


def _multiply_adds(model: nn.Module, size: int = 28) -> int:
    """Multiply-adds of one ``size``×``size`` image through the convs and linears (counted from their outputs)."""
    total = 0

    def count(module, _inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kernel = module.kernel_size[0] * module.kernel_size[1]
            total += output.numel() * module.in_channels // module.groups * kernel
        elif isinstance(module, nn.Linear):
            total += output.numel() * module.in_features

    handles = [m.register_forward_hook(count) for m in model.modules()]
    with torch.no_grad():
        model.eval()(torch.randn(1, 3, size, size))
    for handle in handles:
        handle.remove()
    return total


def test_digits_resnet_structure():
    model = digits_resnet()
    shortcuts = [m.downsample for m in model.layers if m.downsample is not None]
    assert len(shortcuts) == 2
    assert all(s[0].kernel_size == (1, 1) and s[0].stride == (2, 2) for s in shortcuts)
    assert sum(p.numel() for p in model.parameters()) == 308_650  # the docstring's "309 k"
    assert _multiply_adds(model) == 10_263_168  # "10.3 M" on a 28×28 image: enough work for int8 kernels to pay


def test_digits_mobilenet_structure():
    model = digits_mobilenet()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert any(c.groups == c.in_channels > 1 for c in convs)  # depthwise
    assert any(isinstance(m, nn.ReLU6) for m in model.modules())
    assert not any(isinstance(m, nn.SiLU) for m in model.modules())
    assert not any(type(m).__name__ == "SqueezeExcite" for m in model.modules())
    efficientnet_style = digits_mobilenet(se=True, act="silu")
    assert any(type(m).__name__ == "SqueezeExcite" for m in efficientnet_style.modules())
    assert any(isinstance(m, nn.SiLU) for m in efficientnet_style.modules())
    assert sum(p.numel() for p in model.parameters()) == 315_082
    # by hand, per 28×28 image: stem 169,344; blocks 257,152 + 1,260,672 + 1,718,528 + 1,363,968 + 2,170,880;
    # head conv 1,048,576; fc 5,120: "8.0 M", where int8 kernels pay on ONNX Runtime (half the widths did not)
    assert _multiply_adds(model) == 7_994_240
    with pytest.raises(QdqConfigError, match="unknown activation 'gelu'"):
        digits_mobilenet(act="gelu")


@pytest.mark.parametrize("name", CNNS)
def test_digits_cnn_accepts_qdq_module_replacement(name):
    from qdq import nn as quant_nn
    from qdq.quantize import quantize_model

    model = quantize_model(CNNS[name]().eval())
    assert not any(type(m) is nn.Conv2d for m in model.modules())
    assert any(isinstance(m, quant_nn.QuantConv2d) for m in model.modules())
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


# ------------------------------------------------------------------------------------------- load_model
@pytest.mark.parametrize("name", CNNS)
def test_load_model_builtin(name):
    model = load_model(name, num_classes=5)
    assert not model.training and model(torch.randn(1, 3, 32, 32)).shape == (1, 5)


def test_load_model_torchvision_random_init_and_weights_round_trip(tmp_path):
    model = load_model("torchvision:resnet18", num_classes=10)
    assert model.fc.out_features == 10
    path = tmp_path / "w.pt"
    torch.save(model.state_dict(), path)
    torch.manual_seed(123)  # a different random init, then the file's values
    loaded = load_model("torchvision:resnet18", weights=path, num_classes=10)
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    assert load_model("torchvision:resnet18").fc.out_features == 1000


@pytest.mark.parametrize("wrap", ["state_dict", "model", "module_prefix"])
def test_load_weights_accepts_checkpoint_dicts(tmp_path, wrap):
    source = digits_resnet()
    state = source.state_dict()
    if wrap == "module_prefix":
        payload = {f"module.{k}": v for k, v in state.items()}
    else:
        payload = {wrap: state, "epoch": 3}
    torch.save(payload, tmp_path / "ckpt.pt")
    loaded = load_weights(digits_resnet(), tmp_path / "ckpt.pt")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state.items())


def test_load_weights_tolerates_missing_num_batches_tracked(tmp_path):
    """An old checkpoint without BatchNorm's counters: every stored tensor is loaded, the counters keep
    a fresh model's value (0 batches), and nothing else differs."""
    source = digits_resnet()
    with torch.no_grad():
        for value in source.state_dict().values():
            if value.is_floating_point():
                value.fill_(0.25)  # a value no fresh model has
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "old.pt")
    loaded = load_weights(digits_resnet(), tmp_path / "old.pt").state_dict()
    counters = [k for k in loaded if k.endswith("num_batches_tracked")]
    assert counters and all(int(loaded[k]) == 0 for k in counters)
    assert sorted(loaded) == sorted([*state, *counters])
    assert all(bool((loaded[k] == 0.25).all()) for k in state if loaded[k].is_floating_point())


def test_load_model_file_factory(tmp_path):
    file = tmp_path / "my_model.py"
    file.write_text(
        textwrap.dedent(
            """
            from torch import nn

            def make_model(num_classes=3):
                return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))
            """
        )
    )
    model = load_model(f"{file}:make_model")
    assert model(torch.randn(2, 3, 8, 8)).shape == (2, 3)
    assert load_model(f"{file}:make_model", num_classes=4)[1].out_features == 4


def test_model_names_lists_builtins_and_torchvision():
    names = model_names()
    assert {"digits_resnet", "digits_mobilenet", "torchvision:resnet50", "torchvision:mobilenet_v2"} <= set(names)


# -------------------------------------------------------------------------------------- load_model errors
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("digits_resnt", "Did you mean 'digits_resnet'?"),
        ("resnet18", "Did you mean 'torchvision:resnet18'?"),
        ("torchvision:resnet19", "unknown torchvision classification model 'resnet19'. Did you mean 'resnet18'?"),
        ("torchvision:fasterrcnn_resnet50_fpn", "unknown torchvision classification model"),
        ("completely-unknown", "expected 'digits_resnet', 'digits_mobilenet', 'torchvision:<name>'"),
        ("model.py", "names no function"),
    ],
)
def test_load_model_unknown_name(spec, expected):
    assert expected in _one_line_error(load_model, spec)


def test_load_model_missing_file(tmp_path):
    message = _one_line_error(load_model, f"{tmp_path / 'nope.py'}:make_model")
    assert "does not exist" in message and "nope.py" in message


def _write(tmp_path, body: str):
    file = tmp_path / "user_model.py"
    file.write_text(textwrap.dedent(body))
    return file


def test_load_model_file_without_function(tmp_path):
    file = _write(tmp_path, "from torch import nn\n\ndef make_modle():\n    return nn.Linear(2, 2)\n")
    message = _one_line_error(load_model, f"{file}:make_model")
    assert "has no function 'make_model'" in message and "Did you mean 'make_modle'?" in message


def test_load_model_file_that_fails_to_import(tmp_path):
    file = _write(tmp_path, "import not_a_module_anywhere\n")
    assert "importing model file" in _one_line_error(load_model, f"{file}:make_model")


def test_load_model_factory_returning_non_module(tmp_path):
    file = _write(tmp_path, "def make_model():\n    return 42\n")
    assert "returned int, expected a torch.nn.Module" in _one_line_error(load_model, f"{file}:make_model")


def test_load_model_factory_that_raises(tmp_path):
    file = _write(tmp_path, "def make_model():\n    raise ValueError('bad config\\nmore detail')\n")
    message = _one_line_error(load_model, f"{file}:make_model", num_classes=3)
    assert "make_model() failed: make_model() got an unexpected keyword argument 'num_classes'" in message
    assert "make_model() failed: bad config" in _one_line_error(load_model, f"{file}:make_model")


def test_load_model_missing_weights(tmp_path):
    message = _one_line_error(load_model, "digits_resnet", weights=tmp_path / "missing.pt")
    assert "weights file" in message and "missing.pt" in message and "does not exist" in message


def test_load_model_weights_of_another_model(tmp_path):
    torch.save(digits_mobilenet().state_dict(), tmp_path / "mobile.pt")
    message = _one_line_error(load_model, "digits_resnet", weights=tmp_path / "mobile.pt")
    assert "do not match the model" in message
    assert "missing keys (" in message and "unexpected keys (" in message and "conv1.weight" in message


def test_load_model_weights_with_other_shapes(tmp_path):
    torch.save(digits_resnet(num_classes=10).state_dict(), tmp_path / "w.pt")
    message = _one_line_error(load_model, "digits_resnet", weights=tmp_path / "w.pt", num_classes=5)
    assert "shape file vs model" in message and "fc.weight [10, 128] vs [5, 128]" in message


@pytest.mark.parametrize("content", ["garbage", "not_a_state_dict"])
def test_load_model_unreadable_weights(tmp_path, content):
    path = tmp_path / "w.pt"
    if content == "garbage":
        path.write_bytes(b"this is not a torch file")
    else:
        torch.save([1, 2, 3], path)
    message = _one_line_error(load_model, "digits_resnet", weights=path)
    assert "cannot read weights file" in message or "holds no state_dict" in message


# ---------------------------------------------------------------------------------- check_input_compatible
def test_check_input_compatible_returns_logits_and_restores_mode():
    model = digits_resnet().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = check_input_compatible(model, torch.randn(2, 3, 32, 32), num_classes=10)
    assert out.shape == (2, 10) and model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # BN statistics untouched


def test_check_input_compatible_wrong_shape():
    message = _one_line_error(check_input_compatible, digits_resnet(), torch.randn(2, 1, 32, 32))
    assert message.startswith("model does not accept input of shape (2, 1, 32, 32): ")
    assert "channels" in message  # the first line of torch's own error


def test_check_input_compatible_too_few_outputs():
    message = _one_line_error(check_input_compatible, digits_resnet(num_classes=5), torch.randn(1, 3, 32, 32), 10)
    assert "outputs 5 logits but the data has 10 classes" in message


def test_importing_the_app_is_light():
    code = (
        "import sys, qdq.app, qdq.workflow, qdq.app.data, qdq.app.models, qdq.app.train\n"
        "heavy = [m for m in ('torchvision', 'sklearn', 'PIL') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
