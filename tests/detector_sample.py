"""The shipped detector activation (``tests/data/detector_head_histogram.npz``) as test data.

The fixture is the 4096-bin histogram (``qdq.calib.HistogramCalibrator()``, range [0, 4)) of the 400,000 values of
``shared/data/detector_head_input.npz``: the input of a pretrained text detector's last 1x1 convolution, after
ReLU (64 % zeros; the 1 % above 0.165 carry the text). Keys: ``counts`` (int64, 4096), ``bin_width`` (2**-10),
``max`` (2.0980, the sample's largest value), ``full_max`` (2.1159, the whole tensor's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

FIXTURE = Path(__file__).parent / "data" / "detector_head_histogram.npz"


def detector_values(n: int = 400_000, seed: int = 0) -> np.ndarray:
    """``n`` float32 values drawn from the histogram: a bin by its count, then uniformly within the bin (the
    last non-empty bin ends at the sample's max). Their histogram has the fixture's shape."""
    data = np.load(FIXTURE)
    counts, width = data["counts"], float(data["bin_width"])
    rng = np.random.default_rng(seed)
    bins = rng.choice(counts.size, size=n, p=counts / counts.sum())
    values = (bins + rng.random(n)) * width
    return np.minimum(values, float(data["max"])).astype(np.float32)


def tail_signal_data(
    n: int, seed: int, features: int = 64, groups: int = 4, ratio: float = 1.5, cut: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor]:
    """A task whose signal is in the activation's sparse tail: ``n`` rows of ``features`` values, the body drawn
    from the detector activation below ``cut``, plus one value per group of ``features / groups`` drawn from its
    tail above ``cut`` (the largest times ``ratio**-k`` for the group ranked ``k``). The label is the group holding
    the largest value. Returns float32 ``(n, features)`` inputs and int64 labels."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.from_numpy(detector_values(400_000, seed=seed))
    body, tail = values[values <= cut], values[values > cut]
    x = body[torch.randint(0, body.numel(), (n, features), generator=gen)]
    top = tail[torch.randint(0, tail.numel(), (n,), generator=gen)]
    rank = torch.stack([torch.randperm(groups, generator=gen) for _ in range(n)]).float()
    width = features // groups
    position = torch.arange(groups) * width + torch.randint(0, width, (n, groups), generator=gen)
    x.scatter_(1, position, top[:, None] * ratio**-rank)
    return x, rank.argmin(1)
