"""Launch the distributed worker with torchrun (2 processes) and load what each rank wrote.

The backend is gloo (2 CPU processes) unless ``QDQ_TEST_DIST_BACKEND=nccl`` asks for NCCL, which needs
one GPU per process: with fewer GPUs the multi-process tests skip. (A machine with one GPU would
otherwise pick NCCL for 2 processes on the same GPU, which NCCL refuses or hangs on.) The single-
process references are computed on the CPU, so the bit-for-bit comparisons are meant for gloo.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_worker.py")
NPROC = 2
#: backend of the multi-process tests (read by qdq's init_distributed through $QDQ_DIST_BACKEND)
BACKEND = os.environ.get("QDQ_TEST_DIST_BACKEND", "gloo").strip().lower()


def dist_env(**extra: str) -> dict[str, str]:
    """The environment of a ``torchrun`` launch: the test backend, one thread per process; skips the
    calling test when NCCL is asked for without a GPU per process."""
    if BACKEND == "nccl" and torch.cuda.device_count() < NPROC:
        pytest.skip(f"QDQ_TEST_DIST_BACKEND=nccl needs {NPROC} GPUs, {torch.cuda.device_count()} visible")
    if BACKEND not in ("gloo", "nccl"):
        raise pytest.UsageError(f"QDQ_TEST_DIST_BACKEND must be gloo or nccl, got {BACKEND!r}")
    return {**os.environ, "QDQ_DIST_BACKEND": BACKEND, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class Launch:
    """A finished ``torchrun`` run: exit code, combined output, wall time, and each rank's results."""

    returncode: int
    output: str
    seconds: float
    out_dir: Path

    def results(self) -> list[dict[str, Any]]:
        files = [self.out_dir / f"rank{r}.pt" for r in range(NPROC)]
        assert self.returncode == 0 and all(f.exists() for f in files), self.output[-6000:]
        return [torch.load(f, weights_only=False) for f in files]


def torchrun(scenario: str, out_dir: Path, *, timeout_s: float, wall_limit_s: float = 110) -> Launch:
    """``torchrun --standalone --nproc_per_node 2 _worker.py SCENARIO OUT_DIR`` with ``$QDQ_DIST_TIMEOUT=timeout_s``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dist_env(QDQ_DIST_TIMEOUT=str(timeout_s))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
               "--monitor_interval=0.2", str(WORKER), scenario, str(out_dir)]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=wall_limit_s, check=False)
    return Launch(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, out_dir)


def load_worker() -> ModuleType:
    """The worker module, imported from its file (for the models, data and single-process references)."""
    spec = importlib.util.spec_from_file_location("qdq_distributed_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def worker() -> ModuleType:
    return load_worker()


@pytest.fixture(scope="session")
def calibrate_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return torchrun("calibrate", tmp_path_factory.mktemp("calibrate"), timeout_s=60)


@pytest.fixture(scope="session")
def qat_run(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    return torchrun("qat", tmp_path_factory.mktemp("qat"), timeout_s=60)


@pytest.fixture
def torchrun_env() -> Any:
    """:func:`dist_env`, for tests that launch ``torchrun`` themselves."""
    return dist_env


@pytest.fixture
def launch() -> Any:
    """The :func:`torchrun` launcher, for tests that run their own scenario."""
    return torchrun
