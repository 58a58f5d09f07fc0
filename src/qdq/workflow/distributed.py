"""Running qdq under ``torch.distributed``: ``torchrun``, DistributedDataParallel, N GPUs or N nodes.

qdq starts no process of its own: launch with ``torchrun`` (or any launcher that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) and join the group with :func:`init_distributed` or
``torch.distributed.init_process_group``. Then:

* :func:`qdq.workflow.calibration.calibrate` (and ``collect_stats``/``load_amax``/``ptq``) all-reduce
  the calibration statistics before computing amax, so every rank loads the same amax, equal bit for
  bit to a single-process run over the same batches (give each rank its batches with
  :func:`shard_batches`).
* :func:`qdq.workflow.fine_tuning.qat` on a ``DistributedDataParallel`` model writes checkpoints on rank 0
  only, broadcasts the quantizer state from rank 0 before training and checks after each epoch that
  it is the same on every rank (:func:`broadcast_quantizer_state`, :func:`assert_in_sync`).

A rank that crashes or hangs must not leave the others waiting forever: every collective gives up
after the process-group timeout (:func:`init_distributed` sets it from ``timeout_s`` or the
``QDQ_DIST_TIMEOUT`` environment variable, default 30 minutes) and qdq turns the backend's error into
a :class:`QdqDistributedError` that says which step was waiting and why.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler, SequentialSampler

from qdq.errors import QdqConfigError, QdqDistributedError, QdqError
from qdq.quantizer import TensorQuantizer

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "RoundRobinBatchSampler",
    "all_reduce_sum",
    "assert_in_sync",
    "assert_same_across_ranks",
    "barrier",
    "broadcast_quantizer_state",
    "collective",
    "init_distributed",
    "is_distributed",
    "is_main_process",
    "main_process_only",
    "quantizer_state",
    "rank",
    "shard",
    "shard_batches",
    "shutdown_distributed",
    "unwrap",
    "world_size",
]

#: environment variable read by :func:`init_distributed`: the process-group timeout in seconds
TIMEOUT_ENV = "QDQ_DIST_TIMEOUT"
#: environment variable read by :func:`init_distributed`: the backend (``nccl`` or ``gloo``)
BACKEND_ENV = "QDQ_DIST_BACKEND"
#: default process-group timeout (torch's default for gloo)
DEFAULT_TIMEOUT_S = 1800.0
_MAX_LISTED = 10


# ------------------------------------------------------------------------------------ process group
def is_distributed() -> bool:
    """Whether a default ``torch.distributed`` process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Whether this process is rank 0 (always true when not distributed)."""
    return rank() == 0


def _timeout(timeout_s: float | None) -> timedelta:
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise QdqConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise QdqConfigError(f"the process-group timeout must be a positive number of seconds, got {timeout_s}.")
    return timedelta(seconds=timeout_s)


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> bool:
    """Join the process group that ``torchrun`` describes in the environment; return whether distributed.

    Does nothing (and returns False) without ``RANK`` and ``WORLD_SIZE`` in the environment, i.e. in a
    plain ``python script.py`` run; returns True at once if a group already exists.

    Args:
        backend: ``"nccl"`` (the GPU is chosen from ``LOCAL_RANK``) or ``"gloo"`` (CPU). Default:
            ``$QDQ_DIST_BACKEND``, else NCCL when CUDA is available and gloo otherwise.
        timeout_s: how long a collective waits for the other ranks before failing (default:
            ``$QDQ_DIST_TIMEOUT``, else 1800 s). It must exceed the longest time one rank can wait for
            another: the difference in calibration time between shards, rank 0 writing a checkpoint...

    Raises:
        QdqConfigError: NCCL without a GPU for this process (NCCL needs one GPU per process: with more
            processes per node than GPUs, launch fewer or use gloo), or a bad timeout.
    """
    if is_distributed():
        return True
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    timeout = _timeout(timeout_s)
    backend = _backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(_local_gpu())
    dist.init_process_group(backend=backend, timeout=timeout)
    return True


def _backend(backend: str | None) -> str:
    """The explicit backend, else ``$QDQ_DIST_BACKEND``, else NCCL with CUDA and gloo without."""
    chosen = backend or os.environ.get(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    return chosen.strip().lower()


def _local_gpu() -> int:
    """This process's GPU under NCCL: ``LOCAL_RANK``, checked against the GPUs visible."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= gpus:
        raise QdqConfigError(
            f"the NCCL backend needs one GPU per process, but LOCAL_RANK is {local_rank} and {gpus} GPU(s) are "
            f"visible: launch at most {gpus} process(es) per node, or use gloo ({BACKEND_ENV}=gloo)."
        )
    return local_rank


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the default process group (no-op without one); call it on every rank.

    The barrier keeps a rank from tearing its connections down while another still uses them. Drop the
    ``DistributedDataParallel`` wrappers first (``model = unwrap(model)``): a wrapper holds the group, and a group
    still alive when the interpreter exits can abort the process while its gloo threads are torn down
    ("terminate called without an active exception"); the garbage collection here frees what is left of it.
    """
    if is_distributed():
        barrier("shutting down")
        dist.destroy_process_group()
        gc.collect()


def _group_timeout() -> str:
    """The default group's timeout in words, as far as the backend tells it."""
    try:
        device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
        seconds = dist.group.WORLD._get_backend(device).options._timeout.total_seconds()  # type: ignore[union-attr]  # private; guarded
        return f"{seconds:g} s"
    except Exception:  # a private API: the message only loses a number
        return "the process-group timeout"


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Run collectives; turn a lost-peer or timeout error of the backend into a :class:`QdqDistributedError`.

    ``what`` names the step (e.g. ``"synchronising the statistics of conv1._input_quantizer"``). qdq's
    own errors pass through unchanged.
    """
    try:
        yield
    except QdqError:
        raise
    except RuntimeError as err:  # DistBackendError, gloo "Timed out"/"Connection closed by peer"...
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise QdqDistributedError(
            f"rank {rank()} of {world_size()}: {what} failed while waiting for the other ranks: {first_line}. "
            "Another rank probably crashed (look for its traceback) or is stuck; collectives give up after "
            f"{_group_timeout()} (init_process_group(timeout=...), or ${TIMEOUT_ENV} with "
            "qdq.workflow.distributed.init_distributed)."
        ) from err


def barrier(what: str = "a barrier") -> None:
    """Wait until every rank gets here (no-op when not distributed).

    On gloo this is ``monitored_barrier``, whose timeout error names the ranks that did not arrive.

    Raises:
        QdqDistributedError: a rank did not arrive within the timeout, or crashed.
    """
    if not is_distributed():
        return
    with collective(what):
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(wait_all_ranks=True)
        else:
            dist.barrier()


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Sum ``values`` over the ranks (float64; the same result on every rank). Identity when not distributed.

    Use it to make a sharded evaluation return the same score everywhere, e.g.
    ``hits, seen = all_reduce_sum([hits, seen]); return 100 * hits / seen``.
    """
    if not is_distributed():
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    with collective("summing values across ranks"):
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def assert_same_across_ranks(value: Any, what: str) -> None:
    """Raise on every rank unless picklable ``value`` is equal on all ranks (no-op when not distributed).

    Raises:
        QdqDistributedError: the ranks disagree; the message lists each distinct value and its ranks.
    """
    if not is_distributed():
        return
    values: list[Any] = [None] * world_size()
    with collective(f"comparing {what} across ranks"):
        dist.all_gather_object(values, value)
    if all(v == values[0] for v in values):
        return
    groups = [(v, [r for r, w in enumerate(values) if w == v]) for i, v in enumerate(values) if v not in values[:i]]
    listed = "; ".join(f"ranks {ranks}: {_short(v)}" for v, ranks in groups)
    raise QdqDistributedError(f"the ranks disagree on {what}: {listed}. Every rank must run the same model and steps.")


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class main_process_only:  # used like a function
    """Do something (write a file) on rank 0 only; with ``wait``, the other ranks then wait for it.

    As a decorator the function runs on rank 0 and returns ``None`` elsewhere; as a context manager it
    gives whether this is rank 0 (the block runs everywhere, so test it). With ``wait=True`` (default)
    every rank meets at a :func:`barrier` afterwards, so the file exists when any rank goes on; the
    barrier is skipped when the block raised (the others then fail at the timeout, not hang).

    Example:
        >>> @main_process_only
        ... def write_report(path): ...
        >>> with main_process_only() as main:
        ...     if main:
        ...         torch.save(state, path)
    """

    def __init__(self, fn: Callable[..., Any] | None = None, *, wait: bool = True) -> None:
        self._fn, self._wait = fn, wait
        if fn is not None:
            functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:  # @main_process_only(wait=...) applied to a function
            (fn,) = args
            return main_process_only(fn, wait=self._wait)
        with self:
            return self._fn(*args, **kwargs) if is_main_process() else None

    def __enter__(self) -> bool:
        return is_main_process()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and self._wait:
            barrier("waiting for rank 0 to finish writing")


# ---------------------------------------------------------------------------------------- models
def unwrap(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` / ``DataParallel`` wrappers (``model`` itself otherwise)."""
    while isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        model = model.module
    return model


def _quantizers(model: nn.Module) -> list[tuple[str, TensorQuantizer]]:
    """Every quantizer (enabled or not) of the unwrapped model, in module order."""
    return [(n, m) for n, m in unwrap(model).named_modules() if isinstance(m, TensorQuantizer)]


def _tensor_state(quantizer: TensorQuantizer) -> dict[str, torch.Tensor]:
    state = {"amax": quantizer._amax, "pre_quant_scale": quantizer._pre_quant_scale}
    if quantizer.learn_amax:
        state["clip_min"] = quantizer.clip.clip_value_min
        state["clip_max"] = quantizer.clip.clip_value_max
    return {key: value.detach() for key, value in state.items()}


def quantizer_state(model: nn.Module) -> dict[str, Any]:
    """Everything that must match across ranks, per quantizer: ``"<name>.amax"``, ``.pre_quant_scale``,
    ``.clip_min``/``.clip_max`` (learned ranges) as tensors, and ``.modes`` (disabled, quant, calib, clip)."""
    state: dict[str, Any] = {}
    for name, quantizer in _quantizers(model):
        for key, value in _tensor_state(quantizer).items():
            state[f"{name}.{key}"] = value
        state[f"{name}.modes"] = (
            not quantizer.is_enabled,
            quantizer.quant_enabled,
            quantizer.calib_enabled,
            quantizer.clip_enabled,
        )
    return state


def broadcast_quantizer_state(model: nn.Module, src: int = 0) -> None:
    """Copy every quantizer's amax, pre-quant scale and learned range from rank ``src`` to all ranks.

    A no-op when not distributed. Every rank must call it with the same model structure.

    Raises:
        QdqDistributedError: the ranks' models have different quantizers (raised on every rank).
    """
    if not is_distributed():
        return
    quantizers = _quantizers(model)
    payload = [{n: {k: v.cpu() for k, v in _tensor_state(q).items()} for n, q in quantizers} if rank() == src else None]
    with collective(f"broadcasting the quantizer state from rank {src}"):
        dist.broadcast_object_list(payload, src=src)
    state: dict[str, dict[str, torch.Tensor]] = payload[0]  # type: ignore[assignment]  # filled by the broadcast
    assert_same_across_ranks(sorted(n for n, _ in quantizers) == sorted(state), "having the same quantizers")
    for name, quantizer in quantizers:
        _load_tensor_state(quantizer, state[name])


def _load_tensor_state(quantizer: TensorQuantizer, values: dict[str, torch.Tensor]) -> None:
    quantizer.amax = values["amax"] if values["amax"].numel() else None
    quantizer.pre_quant_scale = values["pre_quant_scale"] if values["pre_quant_scale"].numel() else None
    if "clip_min" in values and quantizer.learn_amax:
        with torch.no_grad():
            quantizer.clip.clip_value_min.copy_(values["clip_min"])
            quantizer.clip.clip_value_max.copy_(values["clip_max"])


def _fingerprint(value: Any) -> str:
    """Bit-exact digest of a tensor (dtype, shape, bytes), or the repr of anything else."""
    if not isinstance(value, torch.Tensor):
        return repr(value)
    data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    return f"{value.dtype}{tuple(value.shape)}:{digest}"


def _fingerprints(model: nn.Module, parameters: bool, buffers: bool) -> dict[str, str]:
    prints = {key: _fingerprint(value) for key, value in quantizer_state(model).items()}
    inner = unwrap(model)
    if parameters:
        prints |= {f"parameter {n}": _fingerprint(p) for n, p in inner.named_parameters()}
    if buffers:
        prints |= {f"buffer {n}": _fingerprint(b) for n, b in inner.named_buffers()}
    return prints


def assert_in_sync(model: nn.Module, *, parameters: bool = False, buffers: bool = False) -> None:
    """Raise on every rank unless the quantizer state (see :func:`quantizer_state`) is identical, bit for bit,
    on all ranks; ``parameters``/``buffers`` also compare every parameter/buffer. No-op when not distributed.

    Raises:
        QdqDistributedError: names the entries (up to 10) that differ and the ranks that differ from rank 0.
    """
    if not is_distributed():
        return
    mine = _fingerprints(model, parameters, buffers)
    everyone: list[dict[str, str]] = [{}] * world_size()
    with collective("comparing the quantizer state across ranks"):
        dist.all_gather_object(everyone, mine)
    keys = sorted(set().union(*everyone))
    differ = [k for k in keys if any(prints.get(k) != everyone[0].get(k) for prints in everyone)]
    if not differ:
        return
    ranks = [r for r, prints in enumerate(everyone) if prints != everyone[0]]
    raise QdqDistributedError(
        f"the model state differs between rank 0 and rank(s) {ranks} in {len(differ)} entr(y/ies), e.g. "
        f"{differ[:_MAX_LISTED]}. Calibrate on every rank (load_amax synchronises the statistics), keep "
        "DistributedDataParallel's broadcast_buffers=True, or call broadcast_quantizer_state(model)."
    )


# ------------------------------------------------------------------------------------------ data
def shard(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over this rank's share of ``dataset``, for training and evaluation.

    Uses ``DistributedSampler``: rank ``r`` of ``N`` gets samples ``r, r + N, ...`` of the (seeded,
    per-epoch) order, padded by repeating samples so that every rank has the same number of batches,
    which DDP needs (a rank with one batch more waits forever for the gradient all-reduce).
    :func:`qdq.workflow.fine_tuning.qat` calls ``sampler.set_epoch(epoch)`` for you. Works without a process
    group too (one rank: the whole dataset).
    """
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs)


class RoundRobinBatchSampler(Sampler[list[int]]):
    """Deal the batches of ``batch_sampler`` to the ranks in turn: rank ``r`` of ``N`` gets ``r, r + N, ...``."""

    def __init__(self, batch_sampler: Iterable[list[int]], num_replicas: int, rank: int) -> None:
        if not 0 <= rank < num_replicas:
            raise QdqConfigError(f"rank must be in [0, {num_replicas}), got {rank}.")
        self.batch_sampler, self.num_replicas, self.rank = batch_sampler, num_replicas, rank

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.rank, None, self.num_replicas)

    def __len__(self) -> int:
        return len(range(self.rank, len(self.batch_sampler), self.num_replicas))  # type: ignore[arg-type]  # a BatchSampler


def shard_batches(dataset: Dataset[Any], batch_size: int, **loader_kwargs: Any) -> DataLoader[Any]:
    """A DataLoader of this rank's calibration batches: the single-process batches, dealt in turn.

    The batches of ``DataLoader(dataset, batch_size)`` (in order, last one possibly short) go to rank 0,
    1, ..., N-1, 0, ...: nothing is repeated or dropped and each batch holds the same samples as in the
    single-process run, so N-rank calibration equals it bit for bit (a sample's activations can change
    in the last bit with the batch it is in, as kernels depend on the batch size). Ranks may get one batch
    more than others: calibration has no collective per batch. Not for DDP training (use :func:`shard`).
    """
    batches = BatchSampler(SequentialSampler(dataset), batch_size, drop_last=False)  # type: ignore[arg-type]  # sized
    return DataLoader(dataset, batch_sampler=RoundRobinBatchSampler(batches, world_size(), rank()), **loader_kwargs)
