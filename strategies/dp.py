"""Data parallel: a full replica per rank, gradients all-reduced by DDP (bucketed, overlapped)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import LossFn, OptimizerFactory, Runtime, Strategy, grad_sq_sum
from .canonical import (
    CanonicalState,
    model_state_to_canonical,
    optimizer_state_from_canonical,
    optimizer_state_to_canonical,
)
from .spec import StrategySpec

__all__ = ["DataParallel"]


class DataParallel(Strategy):
    name = "dp"

    def __init__(
        self,
        spec: StrategySpec,
        rt: Runtime,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        loss_fn: LossFn,
    ) -> None:
        super().__init__(spec, rt, model, optimizer_factory, loss_fn)
        self.model = model.to(rt.device)
        self.params_by_fqn = dict(self.model.named_parameters())
        self.fqn_of = {id(p): n for n, p in self.params_by_fqn.items()}
        ids = [rt.device.index] if rt.device.type == "cuda" else None
        # init_sync=False when the caller loads a full state right after (a switch, a restore):
        # DDP's parameter broadcast at construction would only be overwritten.
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets instead of being
        # copied into them and back every step (measured 3-5 % of a step of the overhead
        # benchmark's model on one CPU thread; also one gradient copy less in memory).
        self.ddp = DDP(self.model, device_ids=ids, broadcast_buffers=False,
                       init_sync=spec.options.init_sync,
                       gradient_as_bucket_view=spec.options.bucket_view)
        self.optimizer = optimizer_factory(self.model.parameters())
        # DDP averages gradients over world size; scale so the result is the mean over G.
        self._scale = self.share * rt.world_size / spec.global_batch_size

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self._wrapped_step(self.ddp, self.optimizer, inputs, targets, self._scale)

    def accumulate(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.ddp.no_sync()  # the last micro-batch's backward all-reduces the sum

    def clip_grads(self) -> None:
        """DDP leaves every rank the full averaged gradient: the norm needs no communication."""
        grads = [p.grad for p in self.model.parameters()]
        self._clip_by(grad_sq_sum(grads, self.rt.device), grads, reduce=False)

    def full_state(self) -> CanonicalState:
        out = model_state_to_canonical(self.model.state_dict().items())
        out.update(optimizer_state_to_canonical(self.optimizer, self.fqn_of))
        return out

    def local_state(self) -> CanonicalState:
        """Local, no copies on CPU: the live model and optimizer tensors."""
        out = model_state_to_canonical(self.model.state_dict().items(), copy=False)
        out.update(optimizer_state_to_canonical(self.optimizer, self.fqn_of, copy=False))
        return out

    def load_full_state(self, state: CanonicalState) -> None:
        msd = {k[len("model/"):]: v for k, v in state.items() if k.startswith("model/")}
        self.model.load_state_dict(msd)
        optimizer_state_from_canonical(self.optimizer, self.params_by_fqn, state)

    def memory_counts(self) -> dict[str, int]:
        params = sum(p.numel() for p in self.model.parameters())
        grads = sum(p.grad.numel() for p in self.model.parameters() if p.grad is not None)
        optim = sum(
            v.numel()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return {"params": params, "grads": grads, "optim": optim}

    def local_model(self) -> nn.Module:
        return self.model

    def close(self) -> None:
        del self.ddp, self.optimizer, self.model
