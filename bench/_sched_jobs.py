"""The scheduler benchmark's jobs: a small regression model whose forward sleeps a fixed time
per sample inside a worker (so a step divides among the workers as a compute-bound job's
does), its data, optimizer and loss. Top level, so Ray pickles them by reference."""

from __future__ import annotations

import torch
from torch import nn

from elastic.models import PerSampleCost, SyntheticRegression


def Data(n: int = 512, seed: int = 0) -> SyntheticRegression:  # noqa: N802 - a factory
    """n seeded samples of (x in R^8, y in R^2): the product's own dataset."""
    return SyntheticRegression(n=n, in_features=8, out_features=2, seed=seed)


def model(seconds_per_sample: float = 0.01) -> nn.Module:
    return nn.Sequential(PerSampleCost(seconds_per_sample), nn.Linear(8, 32), nn.Tanh(),
                         nn.Linear(32, 2))


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001 - torch's parameter iterable
    return torch.optim.Adam(params, lr=1e-2)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)
