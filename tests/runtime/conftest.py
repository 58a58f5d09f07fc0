"""Session-wide tiny ONNX models for the runtime tests (built once, in a temporary directory)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the model builders in rt_models.py

import rt_models


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runtime_models")


@pytest.fixture(scope="session")
def torch_model() -> torch.nn.Module:
    return rt_models.tiny_cnn()


@pytest.fixture(scope="session")
def fp32_onnx(model_dir: Path, torch_model: torch.nn.Module) -> Path:
    return rt_models.export_fp32(torch_model, model_dir / "tiny_fp32.onnx")


@pytest.fixture(scope="session")
def u8_onnx(model_dir: Path, fp32_onnx: Path) -> Path:
    """ORT quantize_static: QDQ, uint8 activations, int8 per-channel weights."""
    return rt_models.quantize_u8(fp32_onnx, model_dir / "tiny_u8.onnx")


@pytest.fixture(scope="session")
def trt_onnx(model_dir: Path) -> Path:
    """TensorRT-style graph: signed int8 Q/DQ on conv inputs and weights only."""
    return rt_models.export_trt_style(model_dir / "tiny_trt.onnx")


@pytest.fixture(scope="session")
def batch_input() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(7).standard_normal((3, *rt_models.INPUT_SHAPE)).astype(np.float32))


@pytest.fixture(scope="session")
def vit_fp16_onnx(model_dir: Path) -> tuple[Path, np.ndarray]:
    """A quantized torchvision ViT exported for TensorRT 11 (float16 outside its Q/DQ), and an input batch."""
    return rt_models.export_vit_fp16(model_dir / "vit_fp16.onnx")
