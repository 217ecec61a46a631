"""Workload of bench/hetero.py: an MLP whose blocks stand for accelerator compute.

Each block is ``Linear(WIDTH, WIDTH) + Tanh`` followed by a wait of ``ms_per_sample / depth /
3`` per sample in forward and twice that in backward (a custom autograd function sleeping),
so one forward+backward of the whole model costs about ``ms_per_sample`` per sample of wall
time but almost no CPU: like a host thread waiting for a GPU. That is what lets 4 emulated
workers share 2 real cores without being CPU-bound (the real matmuls are 64 x 64). The
worker's emulated slowdown (``emulate=[{slowdown: k}]``) then sleeps ``(k - 1)`` times the
profiled forward+backward on top, as for any model.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from elastic.models import SyntheticRegression

WIDTH = 64
DEPTH = 8
MS_PER_SAMPLE = 4.0
DATA_N = 2048
OPTIM = {"name": "adam", "lr": 1e-3}
LOSS = "mse"
SEED = 0


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s_per_sample):  # type: ignore[override]
        ctx.s = s_per_sample * x.shape[0]
        time.sleep(ctx.s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        time.sleep(2 * ctx.s)
        return g, None


class DeviceBlock(nn.Module):
    def __init__(self, width: int, s_per_sample_fwd: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.s = s_per_sample_fwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(torch.tanh(self.lin(x)), self.s)


def device_mlp(width: int = WIDTH, depth: int = DEPTH,
               ms_per_sample: float = MS_PER_SAMPLE) -> nn.Module:
    fwd = ms_per_sample / 1000 / depth / 3
    return nn.Sequential(*[DeviceBlock(width, fwd) for _ in range(depth)])


model_factory = functools.partial(device_mlp)
dataset_factory = functools.partial(SyntheticRegression, n=DATA_N, in_features=WIDTH,
                                    out_features=WIDTH, seed=SEED)


def n_params(width: int = WIDTH, depth: int = DEPTH) -> int:
    return depth * (width * width + width)
