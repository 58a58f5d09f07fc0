"""Distributed calibration and QAT: one script for plain ``python`` and for ``torchrun`` on N processes.

Each rank calibrates on its share of the batches (the statistics are all-reduced, so every rank loads the same
ranges, equal to one process calibrating on all of them), then fine-tunes the model wrapped in
DistributedDataParallel; rank 0 alone writes files.

    python examples/distributed.py                                    # one process
    torchrun --standalone --nproc_per_node 2 examples/distributed.py  # two CPU processes (gloo)
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import qdq
from qdq.workflow import distributed as qd

qd.init_distributed()  # under torchrun: NCCL on cuda:LOCAL_RANK if CUDA, else gloo; a no-op otherwise
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)  # the same model and data on every rank
images, labels = torch.randn(256, 3, 16, 16), torch.randint(0, 10, (256,))
dataset = TensorDataset(images, labels)
model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))  # fmt: skip
model = qdq.quantize_model(model, qdq.QuantConfig(target="tensorrt")).to(device)

# Each rank: the single-process batches, dealt in turn (rank 0 gets batches 0, N, 2N, ...).
qdq.calibrate(model, qd.shard_batches(dataset, batch_size=32), method="entropy", progress=False)
amax = qd.unwrap(model)[0]._input_quantizer.amax  # the same on every rank, bit for bit
print(f"rank {qd.rank()} of {qd.world_size()}: first input range {float(amax):.6f}")

if qd.is_distributed():
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
# qd.shard: a DistributedSampler, the same number of batches on every rank (DDP needs it); qat calls set_epoch.
result = qdq.qat(model, qd.shard(dataset, batch_size=32, shuffle=True), None, epochs=1, lr=0.1, progress=False)
model = qd.unwrap(model)  # drop the DDP wrapper: it holds the process group that shutdown_distributed destroys
if qd.is_main_process():  # files on rank 0 only
    torch.save(model.state_dict(), "quantized.pt")
    print(f"QAT loss (mean over ranks): {result.epochs[-1]['loss']:.4f}; wrote quantized.pt")
qd.shutdown_distributed()
