"""Worker of the distributed tests: ``torchrun --nproc_per_node 2 _worker.py SCENARIO OUT_DIR``.

Each rank writes ``OUT_DIR/rank<r>.pt``. The tests also import this file to build the same models and
data and to compute the single-process references. Scenarios:

* ``calibrate``: every method, ptq, a DDP-wrapped model and an unused quantizer, on round-robin shards;
* ``qat``: DDP QAT with fixed then learned ranges, a checkpoint, and a resume;
* ``crash``: rank 1 raises while calibrating;
* ``hang``: rank 1 never reaches the collective (the process-group timeout must end rank 0).

The backend comes from ``$QDQ_DIST_BACKEND`` (set by conftest: gloo unless ``QDQ_TEST_DIST_BACKEND=nccl``);
under NCCL each rank's models live on its GPU (``LOCAL_RANK``) and results are saved on the CPU.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import qdq
import qdq.workflow.fine_tuning as qat_module
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqCalibrationError, QdqDistributedError
from qdq.quantize import QuantConfig
from qdq.quantizer import TensorQuantizer
from qdq.workflow.calibration import calibrate, default_forward
from qdq.workflow.distributed import (
    assert_in_sync,
    broadcast_quantizer_state,
    init_distributed,
    quantizer_state,
    rank,
    shard,
    shard_batches,
    shutdown_distributed,
    unwrap,
)
from qdq.workflow.fine_tuning import qat
from qdq.workflow.post_training import disabled_quantizers, ptq

METHODS = ("max", "entropy", "mse", "percentile", "auto")
BATCH = 4
# per-batch max |x|: ten orders of magnitude apart, so the histograms of the ranks have different
# ranges and must be re-binned when merged; 9 batches: rank 0 gets 5 (all even ones), rank 1 gets 4
SCALES = (0.5, 3.0, 0.02, 8.0, 1.0, 2e-4, 60.0, 4.0, 1e-6)
BRANCH_THRESHOLD = 40.0  # only batch 6 (rank 0's) runs the branch


def device() -> torch.device:
    """Where this rank's models run: its GPU under NCCL, else the CPU (also for the in-process references)."""
    if os.environ.get("QDQ_DIST_BACKEND") == "nccl" and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


class Net(nn.Module):
    """A small conv net; ``branch`` runs only on batches whose max |x| exceeds BRANCH_THRESHOLD."""

    def __init__(self, branch: bool = True, unused: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        )
        self.branch = nn.Conv2d(8, 8, 1) if branch else None
        self.unused = nn.Linear(4, 4) if unused else None
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
        self.branch_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.features(x)
        if self.branch is not None and x.abs().amax() > BRANCH_THRESHOLD:
            self.branch_calls += 1
            y = y + self.branch(y)
        return self.head(y)


def build_model(branch: bool = True, unused: bool = False, learn: bool = False) -> Net:
    """The same quantized model on every rank (fixed seed); ``learn`` gives activations learned ranges."""
    torch.manual_seed(0)
    config = QuantConfig(quant_desc_input=QuantDescriptor(learn_amax=True)) if learn else None
    model = qdq.quantize_model(Net(branch, unused), config)
    with torch.no_grad():
        model.features[1].running_mean.uniform_(-0.2, 0.2)
    return model.to(device())


def calib_dataset() -> TensorDataset:
    """len(SCALES) batches of BATCH samples; batch i has max |x| == SCALES[i]."""
    gen = torch.Generator().manual_seed(1)
    parts = []
    for scale in SCALES:
        x = torch.randn(BATCH, 3, 8, 8, generator=gen)
        parts.append(x / x.abs().amax() * scale)
    x = torch.cat(parts)
    return TensorDataset(x, torch.zeros(len(x), dtype=torch.long))


def train_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 3, 8, 8, generator=gen)
    return TensorDataset(x, torch.randint(0, 4, (32,), generator=gen))


def amax_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantizer's amax (activations and weights), by name in the unwrapped model."""
    return {k: v.clone() for k, v in quantizer_state(model).items() if k.endswith(".amax")}


def fidelity(model: nn.Module) -> float:
    """Minus the mean squared error between the quantized and the float model on the whole set (same on every rank)."""
    x = calib_dataset().tensors[0].to(device())
    model.eval()
    with torch.no_grad():
        with disabled_quantizers(model):
            ref = model(x)
        return -float((model(x) - ref).pow(2).mean())


def histogram_counts(model: nn.Module) -> dict[str, int]:
    """Total count of each histogram calibrator (a double all-reduce would multiply it)."""
    counts = {}
    for name, module in unwrap(model).named_modules():
        calibrator = getattr(module, "_calibrator", None) if isinstance(module, TensorQuantizer) else None
        if calibrator is not None and getattr(calibrator, "bin_counts", None) is not None:
            counts[name] = int(calibrator.bin_counts.sum())
    return counts


def calibration_results(make_loader: Callable[[], Any]) -> dict[str, Any]:
    """amax for each method, and ptq's choice, from the batches ``make_loader()`` gives this process."""
    out: dict[str, Any] = {}
    for method in METHODS:
        model = build_model()
        calibrate(model, make_loader(), method, progress=False)
        out[method] = amax_of(model)
        out[f"{method}_branch_calls"] = model.branch_calls
        # the layers' biases (bias correction); not the norm's running mean: the model calibrates in training mode
        out[f"{method}_biases"] = {k: v.clone() for k, v in unwrap(model).state_dict().items() if k.endswith(".bias")}
    model = build_model()
    result = ptq(model, make_loader(), fidelity, percentiles=(99.9, 99.99), progress=False)
    out["ptq"] = {
        "best": result.best.label,
        "scores": [r.score for r in result.results],
        "amax": amax_of(model),
        "counts": histogram_counts(model),
    }
    return out


def reference_calibration() -> dict[str, Any]:
    """The single-process run over all the batches (one thread, like each torchrun worker)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return calibration_results(lambda: DataLoader(calib_dataset(), batch_size=BATCH))
    finally:
        torch.set_num_threads(threads)


# -------------------------------------------------------------------------------------------- scenarios
def scenario_calibrate(out: Path) -> dict[str, Any]:
    results = calibration_results(lambda: shard_batches(calib_dataset(), BATCH))
    results["num_batches"] = len(shard_batches(calib_dataset(), BATCH))
    ddp = DistributedDataParallel(build_model())
    calibrate(ddp, shard_batches(calib_dataset(), BATCH), "entropy", progress=False)
    results["ddp_entropy"] = amax_of(ddp)
    try:
        calibrate(build_model(unused=True), shard_batches(calib_dataset(), BATCH), "max", progress=False)
        results["unused_error"] = None
    except QdqCalibrationError as err:
        results["unused_error"] = str(err)
    results["mismatch_error"] = _calibrate_mismatched_models()
    return results


def _calibrate_mismatched_models() -> str | None:
    """Rank 1 disables a quantizer that rank 0 calibrates: both ranks must raise, not mix statistics."""
    model = build_model()
    if rank() == 1:
        model.head[1].input_quantizer.disable()
    try:
        calibrate(model, shard_batches(calib_dataset(), BATCH), "max", progress=False)
    except QdqDistributedError as err:
        return str(err)
    return None


def _desync_and_repair(model: nn.Module) -> dict[str, Any]:
    """Rank 1 changes one amax: assert_in_sync raises on both ranks; broadcast_quantizer_state repairs it."""
    quantizer = unwrap(model).features[3].input_quantizer
    saved = quantizer.amax.clone()
    if rank() == 1:
        quantizer.amax = saved * 2
    try:
        assert_in_sync(model)
        error = None
    except QdqDistributedError as err:
        error = str(err)
    broadcast_quantizer_state(model, src=0)
    assert_in_sync(model, parameters=True)
    return {"desync_error": error, "repaired": torch.equal(quantizer.amax, saved)}


def _count_saves() -> list[Path]:
    """Record every checkpoint this rank writes."""
    saved: list[Path] = []
    original = qat_module.save_atomic

    def counting(obj: Any, path: Any) -> Path:
        saved.append(Path(path))
        return original(obj, path)

    qat_module.save_atomic = counting
    return saved


def _clip_ranges(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in quantizer_state(model).items() if ".clip_" in k}


def scenario_qat(out: Path) -> dict[str, Any]:
    model = build_model(branch=False, learn=True)
    calibrate(model, shard_batches(calib_dataset(), BATCH), "max", progress=False)
    for module in model.modules():
        if isinstance(module, TensorQuantizer) and module.learn_amax:
            module.init_learn_amax()
    ddp = DistributedDataParallel(model)
    saved = _count_saves()
    calibrated = _clip_ranges(ddp)
    train = shard(train_dataset(), batch_size=4, shuffle=True, seed=0)
    qat(ddp, train, None, epochs=1, lr=10.0, learn_ranges=False, progress=False)
    frozen = _clip_ranges(ddp)
    checkpoint_dir = out / "checkpoints"
    qat(ddp, train, None, epochs=1, lr=10.0, learn_ranges=True, checkpoint_dir=checkpoint_dir, progress=False)
    saves_after_first = len(saved)
    resumed = qat(ddp, train, fidelity, epochs=2, lr=10.0, learn_ranges=True, checkpoint_dir=checkpoint_dir,
                  resume=True, progress=False)  # fmt: skip
    return {
        **_desync_and_repair(ddp),
        "calibrated_clip": calibrated,
        "frozen_clip": frozen,
        "quantizers": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in quantizer_state(ddp).items()},
        "parameters": {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()},
        "saves": [str(p) for p in saved],
        "saves_after_first": saves_after_first,
        "resumed_from": resumed.resumed_from_epoch,
        "history": resumed.epochs,
    }


def scenario_crash(out: Path) -> dict[str, Any]:
    def forward(model: nn.Module, batch: Any) -> Any:
        if rank() == 1:
            raise RuntimeError("simulated crash on rank 1")
        return default_forward(model, batch)

    calibrate(build_model(), shard_batches(calib_dataset(), BATCH), "entropy", forward_fn=forward, progress=False)
    return {}


def scenario_hang(out: Path) -> dict[str, Any]:
    if rank() == 1:
        time.sleep(120)  # stuck: never reaches load_amax's collectives
    calibrate(build_model(), shard_batches(calib_dataset(), BATCH), "entropy", progress=False)
    return {}


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "calibrate": scenario_calibrate,
    "qat": scenario_qat,
    "crash": scenario_crash,
    "hang": scenario_hang,
}


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


@record
def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if not init_distributed():  # backend from $QDQ_DIST_BACKEND, timeout from $QDQ_DIST_TIMEOUT
        raise SystemExit("run me under torchrun")
    results = SCENARIOS[scenario](out)
    torch.save(_to_cpu(results), out / f"rank{rank()}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main()
