"""The single-process PyTorch reference that every strategy, failure and switch is held to.

Same seed, same model factory, same step sampler, the whole global batch in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .data import StepSampler, fetch_batch

__all__ = ["reference_train", "build_model"]


def build_model(model_factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build the model exactly as every worker does: seeded, on the CPU."""
    torch.manual_seed(seed)
    return model_factory()


def reference_train(
    model_factory: Callable[[], nn.Module],
    optimizer_factory: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dataset: Any,
    global_batch_size: int,
    steps: int,
    seed: int,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``steps`` steps in one process; return (model state_dict, per-step losses)."""
    model = build_model(model_factory, seed)
    opt = optimizer_factory(model.parameters())
    sampler = StepSampler(len(dataset), global_batch_size, seed)
    losses = []
    for step in range(steps):
        x, y = fetch_batch(dataset, sampler.indices(step))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
