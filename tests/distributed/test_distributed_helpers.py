"""qdq.workflow.distributed without a process group: single-process behaviour, data sharding, errors."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import BatchSampler, SequentialSampler, TensorDataset

import qdq
from qdq.descriptor import QuantDescriptor
from qdq.errors import QdqConfigError, QdqDistributedError, QdqError
from qdq.quantizer import TensorQuantizer
from qdq.workflow import distributed as D
from qdq.workflow.fine_tuning import qat


def _model() -> nn.Module:
    return qdq.quantize_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)))


def test_single_process_defaults_and_no_ops(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not D.init_distributed()  # plain `python script.py`: nothing to join
    assert (D.is_distributed(), D.rank(), D.world_size(), D.is_main_process()) == (False, 0, 1, True)
    model = _model()
    D.barrier()
    D.assert_in_sync(model, parameters=True, buffers=True)
    D.broadcast_quantizer_state(model)
    D.assert_same_across_ranks([1, 2], "anything")
    assert D.all_reduce_sum([1.5, 2]) == [1.5, 2.0]
    D.shutdown_distributed()


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan"])
def test_bad_timeout_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(D.TIMEOUT_ENV, value)
    with pytest.raises(QdqConfigError, match=r"seconds|positive"):
        D.init_distributed()
    assert not D.is_distributed()


@pytest.mark.parametrize(
    ("argument", "env", "cuda", "expected"),
    [
        (None, None, False, "gloo"),  # no CUDA: gloo
        (None, None, True, "nccl"),  # CUDA: NCCL
        (None, "gloo", True, "gloo"),  # $QDQ_DIST_BACKEND beats the CUDA default
        ("nccl", "gloo", True, "nccl"),  # an explicit argument beats the environment
    ],
)
def test_backend_precedence(monkeypatch, argument, env, cuda, expected):
    if env is None:
        monkeypatch.delenv(D.BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(D.BACKEND_ENV, env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert D._backend(argument) == expected


def test_nccl_without_a_gpu_per_process_is_a_config_error(monkeypatch):
    """torchrun --nproc_per_node 2 on a 1-GPU machine: rank 1 has no GPU; NCCL would refuse or hang."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(D.BACKEND_ENV, "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(QdqConfigError, match=r"LOCAL_RANK is 1 and 1 GPU\(s\) are visible.*QDQ_DIST_BACKEND=gloo"):
        D.init_distributed()
    assert not D.is_distributed()


def test_main_process_only_as_decorator_and_context():
    calls = []

    @D.main_process_only
    def write(path: str) -> str:
        calls.append(path)
        return path

    @D.main_process_only(wait=False)
    def write_nowait() -> int:
        return 7

    assert write("a") == "a" and calls == ["a"] and write.__name__ == "write"
    assert write_nowait() == 7
    with D.main_process_only() as main:
        assert main is True


def test_unwrap_finds_the_module_inside_wrappers():
    model = _model()
    assert D.unwrap(nn.DataParallel(model)) is model
    assert D.unwrap(model) is model


def test_quantizer_state_lists_ranges_and_modes():
    model = _model()
    model[0].input_quantizer.amax = 2.0
    state = D.quantizer_state(nn.DataParallel(model))
    assert torch.equal(state["0._input_quantizer.amax"], torch.tensor(2.0))
    assert state["3._input_quantizer.amax"].numel() == 0  # not calibrated: dynamic
    assert state["0._input_quantizer.modes"] == (False, True, False, False)


def test_round_robin_batches_deal_the_single_process_batches():
    batches = BatchSampler(SequentialSampler(range(10)), 3, drop_last=False)  # [0,1,2] [3,4,5] [6,7,8] [9]
    shards = [list(D.RoundRobinBatchSampler(batches, 3, r)) for r in range(3)]
    assert shards == [[[0, 1, 2], [9]], [[3, 4, 5]], [[6, 7, 8]]]
    assert [len(D.RoundRobinBatchSampler(batches, 3, r)) for r in range(3)] == [2, 1, 1]
    with pytest.raises(QdqConfigError, match="rank must be in"):
        D.RoundRobinBatchSampler(batches, 2, 2)


def test_shard_helpers_are_whole_dataset_in_one_process():
    data = TensorDataset(torch.arange(10.0))
    assert [b[0].tolist() for b in D.shard_batches(data, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader = D.shard(data, batch_size=5, shuffle=True, seed=3)
    first = torch.cat([b[0] for b in loader])
    assert sorted(first.tolist()) == list(range(10))
    loader.sampler.set_epoch(0)
    assert torch.equal(torch.cat([b[0] for b in loader]), first)  # the order depends on (seed, epoch) only


def test_collective_turns_backend_errors_into_a_clear_error():
    lost = pytest.raises(QdqDistributedError, match=r"rank 0 of 1: syncing x failed .* Connection closed by peer")
    with lost, D.collective("syncing x"):
        raise RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:1234.\nmore detail")
    with pytest.raises(QdqConfigError), D.collective("syncing x"):  # qdq's own errors pass through
        raise QdqConfigError("bad")
    assert issubclass(QdqDistributedError, QdqError) and issubclass(QdqDistributedError, RuntimeError)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of one process (this one), destroyed afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_qat_refuses_learned_ranges_that_ddp_does_not_average(one_rank_group):
    torch.manual_seed(0)
    config = qdq.QuantConfig(quant_desc_input=QuantDescriptor(learn_amax=True, amax=4.0))
    model = qdq.quantize_model(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), config)
    for module in model.modules():
        if isinstance(module, TensorQuantizer) and module.learn_amax:
            module.disable_clip()  # not requiring grad when DDP registers the parameters
    ddp = nn.parallel.DistributedDataParallel(model)
    data = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    with pytest.raises(QdqConfigError, match="did not require grad when DistributedDataParallel wrapped"):
        qat(ddp, data, None, epochs=1, lr=1.0, learn_ranges=True, progress=False)
    result = qat(ddp, data, None, epochs=1, lr=1.0, learn_ranges=False, progress=False)  # frozen ranges: fine
    assert len(result.epochs) == 1
    assert D.is_distributed() and D.world_size() == 1
    D.barrier()
    D.assert_in_sync(ddp, parameters=True, buffers=True)
