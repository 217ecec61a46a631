"""Data parallel: a full replica per rank, gradients all-reduced by DDP (bucketed, overlapped).

DDP's bucket all-reduce runs through a comm hook of ours (``recording_allreduce``): it sums
each bucket over the group in place (so ``gradient_as_bucket_view`` keeps working) and records
a failure in ``strategies.health`` before it propagates (DDP's reducer re-raises it from the
autograd engine, where nothing tells it from a user's error). Two passes over the gradient
that DDP's built-in hook and a separate norm would make are left out:

* The built-in hook divides every bucket by the world size before the sum. Here the loss
  carries that factor (``share / G`` instead of ``share * N / G``): the same gradient, exact
  for a world size that is a power of two and within a rounding otherwise.
* On CPU the hook also takes each reduced bucket's squared norm as it arrives (``BucketNorms``):
  the global gradient norm every step needs (clipping, the non-finite check) is then their
  sum, without another pass over the gradient (together ~4 % of the overhead benchmark's
  step, docs/benchmarks.md). On CUDA the norm stays one fused ``_foreach_norm`` after the
  backward: cheap there, and a reduction inside NCCL's future callback has never been run.
"""

# No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations against
# the real classes (dist.GradBucket, Future[Tensor]), and strings would fail that check.
import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import LossFn, OptimizerFactory, Runtime, Strategy, grad_sq_sum
from .canonical import (
    CanonicalState,
    model_state_to_canonical,
    optimizer_state_from_canonical,
    optimizer_state_to_canonical,
)
from .errors import StrategyError
from .health import record
from .spec import StrategySpec

__all__ = ["BucketNorms", "DataParallel", "no_forward_buffer_sync", "recording_allreduce"]


def no_forward_buffer_sync() -> dict[str, Any]:
    """DDP's keyword that keeps the buffers out of a broadcast at every forward (the layouts
    keep replicas equal themselves): ``forward_sync_buffers`` since torch 2.13, which deprecates
    ``broadcast_buffers``; torch 2.11, which GPU images ship, knows only the older one (that one
    also leaves the buffers out of the sync at construction: every rank builds them alike)."""
    import inspect

    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


class BucketNorms:
    """One step's reduced gradient buckets' squared norms, filled by ``recording_allreduce``
    (DDP's callbacks may run on the process group's threads: a dict store each). ``take``
    gives their float64 sum once the buckets cover every gradient element, else None (a
    step that failed part-way, a backward that reached only some buckets).

    A bucket's squared norm is the float64 sum of its rows' squared norms, ``CHUNK``
    elements a row (one kernel for all rows): one float32 norm of a 25 MB bucket is off by
    ~4e-4 relative, this by ~1e-8, for ~15 % more time than the one norm (a norm per
    chunk, ``_foreach_norm``, paid ~10 us a chunk). The buckets are added in index order,
    not in the order their callbacks ran (which may differ between ranks): every rank gets
    the same bits, so every rank clips and skips alike."""

    CHUNK = 4096

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.sq: dict[int, tuple[int, torch.Tensor]] = {}

    def add(self, index: int, reduced: torch.Tensor) -> None:
        flat = reduced.reshape(-1)
        n = flat.numel()
        rows = n // self.CHUNK
        parts = []
        if rows:
            parts.append(torch.linalg.vector_norm(
                flat[:rows * self.CHUNK].view(rows, self.CHUNK), dim=1))
        if n > rows * self.CHUNK:
            parts.append(torch.linalg.vector_norm(flat[rows * self.CHUNK:]).reshape(1))
        self.sq[index] = (n, torch.cat(parts).double().square().sum() if parts
                          else torch.zeros((), dtype=torch.float64))

    def clear(self) -> None:
        self.sq = {}

    def take(self) -> torch.Tensor | None:
        got, self.sq = self.sq, {}
        if sum(n for n, _ in got.values()) != self.numel:
            return None
        return torch.stack([got[i][1] for i in sorted(got)]).sum()


def recording_allreduce(state: "BucketNorms | None", bucket: dist.GradBucket
                        ) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the sum of one gradient bucket over the default group, in place (the
    loss carries DDP's 1 / world size), recording a failure with
    ``strategies.health.record`` before it is raised; with ``state``, the reduced bucket's
    squared norm goes there. The group is the default group when the hook runs, so the hook
    keeps no reference to a group."""
    group = dist.group.WORLD
    buf = bucket.buffer()
    index = bucket.index()
    try:
        work = dist.all_reduce(buf, group=group, async_op=True)
    except Exception as e:
        record(f"DDP gradient all-reduce of bucket {index}: {_what(e)}")
        raise

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            out = fut.value()[0]
        except Exception as e:
            record(f"DDP gradient all-reduce of bucket {index}: {_what(e)}")
            raise
        if state is not None:
            state.add(index, out)
        return out

    return work.get_future().then(done)  # type: ignore[no-any-return]


def _what(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


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
        self.ddp = DDP(self.model, device_ids=ids, **no_forward_buffer_sync(),
                       init_sync=spec.options.init_sync,
                       gradient_as_bucket_view=spec.options.bucket_view,
                       find_unused_parameters=spec.options.find_unused_parameters)
        self.norms = (BucketNorms(sum(p.numel() for p in self.model.parameters()
                                      if p.requires_grad))
                      if rt.device.type == "cpu" else None)
        self.ddp.register_comm_hook(self.norms, recording_allreduce)
        self.optimizer = optimizer_factory(list(self.model.parameters()))  # (a factory may
        # go over its parameters twice: weight decay for matrices only, say)
        # the hook sums the buckets (no 1 / world size): the loss's scale makes it the mean
        # over G
        self._scale = self.share / spec.global_batch_size

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.norms is not None:
            self.norms.clear()  # what a failed step left
        return self._wrapped_step(self.ddp, self.optimizer, inputs, targets, self._scale)

    def check_reduced(self) -> None:
        """DDP's reducer reduced every bucket (``_check_reducer_finalized``, which DDP offers
        for a call after ``backward``): a trainable parameter the forward left out keeps its
        bucket from being reduced. Was: the step's update applied unreduced gradients there,
        and the next step's forward raised DDP's error inside DDP (read as the group failing:
        recoveries, then "the same failure came back"), or, where a peer's forward used the
        parameter, its bucket's all-reduce paired with another collective."""
        if self.spec.options.find_unused_parameters:
            return
        try:
            self.ddp._check_reducer_finalized()  # noqa: SLF001
        except RuntimeError:
            left = [n for n, p in self.model.named_parameters()
                    if p.requires_grad and p.grad is None]
            said = f" ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})" if left else ""
            raise StrategyError(
                f"dp: this step's forward on rank {self.rt.rank} left trainable parameters out"
                f"{said}, and DDP reduces only what the forward used. Fix: set "
                "find_unused_parameters: true (DDP's: each step looks for them; the default "
                "turns it on by itself where a training pass on a few samples leaves any out), "
                "or use zero1 or zero2, which take such a model as it is",
                setting="find_unused_parameters") from None

    def accumulate(self, module: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return self.ddp.no_sync()  # the last micro-batch's backward all-reduces the sum

    def clip_grads(self) -> None:
        """DDP leaves every rank the full reduced gradient: the norm needs no communication
        (on CPU the hook has taken it bucket by bucket)."""
        grads = [p.grad for p in self.model.parameters()]
        sq = self.norms.take() if self.norms is not None else None
        if sq is None:
            sq = grad_sq_sum(grads, self.rt.device)
        self._clip_by(sq, grads, reduce=False)

    def full_state(self) -> CanonicalState:
        out = model_state_to_canonical(self.model.state_dict().items())
        out.update(optimizer_state_to_canonical(self.optimizer, self.fqn_of))
        return out

    def local_state(self) -> CanonicalState:
        """Local, no copies on CPU: the live model and optimizer tensors."""
        out = model_state_to_canonical(self.model.state_dict().items(), copy=False)
        out.update(optimizer_state_to_canonical(self.optimizer, self.fqn_of, copy=False))
        return out

    def needs(self, key: str, shape: tuple[int, ...]) -> bool | tuple[int, int]:
        """Every entry whole, but no optimizer entry of a frozen parameter (never exported,
        never loaded: ``strategies.canonical``)."""
        if key.startswith("optim/"):
            p = self.params_by_fqn.get(key[len("optim/"):].rpartition("/")[0])
            return p is None or p.requires_grad
        return True

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
