"""The single-process PyTorch reference that every strategy, failure and switch is held to.

Same seed, same model factory, same step sampler, the whole global batch in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from .data import StepSampler, fetch_batch

__all__ = ["reference_train", "build_model", "seed_rank"]


def build_model(model_factory: Callable[[], nn.Module], seed: int, rank: int = 0) -> nn.Module:
    """Build the model exactly as every worker does: seeded, on the CPU. The generators then
    go on as one process's on rank 0 and from a seed of their own on each other ``rank``
    (dropout's masks; was the same stream on every rank, so ranks of equal shares drew the
    same masks for their i-th samples: found by review, session 44)."""
    torch.manual_seed(seed)
    model = model_factory()
    if rank > 0:
        seed_rank(seed, rank)
    return model


def seed_rank(seed: int, rank: int, generation: int = 0) -> None:
    """Seed this process's generators for ``rank`` of the job seeded ``seed`` (a rank that
    joins later: also its ``generation``, so that it does not replay another rank's
    stream)."""
    torch.manual_seed((seed * 1_000_003 + rank + 7_919 * generation) % 2**63)


def build_model_for_load(model_factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """A model whose every state entry is about to be overwritten (a switch, a restore):
    built on the meta device and materialized without initializing (the seeded random init of
    a 50 MB model took ~0.15 s of a switch), when that is safe: every parameter and buffer is
    in the state dict and no other tensor attribute exists (it would stay uninitialized).
    Otherwise, or if the factory cannot run on the meta device, as ``build_model``. The global
    RNG state is left as it was either way (a switch must not reset dropout's stream)."""
    rng = torch.get_rng_state()
    try:
        with torch.device("meta"):
            model = model_factory()
        if _loadable_in_full(model):
            return _materialized(model)
    except Exception:  # noqa: BLE001 - anything the factory cannot do on meta: build normally
        pass
    finally:
        torch.set_rng_state(rng)
    model = build_model(model_factory, seed)
    torch.set_rng_state(rng)
    return model


def _materialized(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device) on the CPU, uninitialized, each tensor it shares
    between modules shared again: ``to_empty`` gives every module its own copy, and a
    language model's output head tied to its embedding came out of a switch, a resize or a
    resume as two parameters, trained apart from then on (a user's model, 2026-12-05)."""
    groups = _shared(model)
    model.to_empty(device="cpu")
    for holders in groups:  # (from a parameter's slot where one holds it: never a buffer's)
        m0, slot0, name0 = min(holders, key=lambda h: h[1] != "_parameters")
        for m, slot, name in holders[1:]:
            getattr(m, slot)[name] = getattr(m0, slot0)[name0]
    return model


def _shared(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Each tensor held by more than one (module, slot) of ``model``: its holders, as
    (module, "_parameters" or "_buffers", name)."""
    held: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for m in model.modules():
        for slot in ("_parameters", "_buffers"):
            for name, t in getattr(m, slot).items():
                if t is not None:
                    held.setdefault(id(t), []).append((m, slot, name))
    return [h for h in held.values() if len(h) > 1]


def _loadable_in_full(model: nn.Module) -> bool:
    """Whether loading a state dict sets every tensor of ``model``."""
    names = set(model.state_dict(keep_vars=True))
    if any(n not in names for n, _ in model.named_buffers(remove_duplicate=False)):
        return False  # a non-persistent buffer
    if any(n not in names for n, _ in model.named_parameters(remove_duplicate=False)):
        return False
    for m in model.modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and k not in ("_parameters", "_buffers"):
                return False  # a plain tensor attribute
    return True


def reference_train(
    model_factory: Callable[[], nn.Module],
    optimizer_factory: Callable[[Any], torch.optim.Optimizer],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dataset: Any,
    global_batch_size: int,
    steps: int,
    seed: int,
    max_grad_norm: float | None = None,
    lr_schedule: Callable[[int], float] | None = None,
    grad_norms: list[float] | None = None,
    precision: str = "fp32",
    skip_steps: Collection[int] = (),
    parts: int = 1,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``steps`` steps in one process; return (model state_dict, per-step losses).

    ``max_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` before each update;
    ``lr_schedule``: ``torch.optim.lr_scheduler.LambdaLR`` stepped after each update (the
    update of step s uses ``lr * lr_schedule(s)``). ``grad_norms``: if given, each step's
    gradient norm (before clipping) is appended to it. ``precision="bf16"``: forward and loss
    under ``torch.autocast(dtype=torch.bfloat16)``, weights and optimizer in fp32.
    ``skip_steps``: steps whose batch is drawn and whose loss is recorded but whose update
    is skipped (no optimizer step: what the layouts do with a non-finite gradient); the lr
    schedule still follows the step number, as the job's does. ``parts``: each step's
    gradient summed from that many contiguous pieces of the batch, each loss weighted by its
    piece's size (as ranks' all-reduce sums it): the same run but for the order of float
    additions, which Adam amplifies over a long run (tests/integration/test_replan.py)."""
    model = build_model(model_factory, seed)
    opt = optimizer_factory(list(model.parameters()))  # as every layout gives it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule) if lr_schedule else None
    sampler = StepSampler(len(dataset), global_batch_size, seed)
    losses = []
    for step in range(steps):
        x, y = fetch_batch(dataset, sampler.indices(step))
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for i in range(parts):
            lo, hi = len(x) * i // parts, len(x) * (i + 1) // parts
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                part = loss_fn(model(x[lo:hi]), y[lo:hi])
            if parts > 1:
                part = part * ((hi - lo) / len(x))
            part.backward()
            loss = loss + part.detach() if parts > 1 else part
        if max_grad_norm is not None or grad_norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_grad_norm if max_grad_norm is not None else float("inf"))
            if grad_norms is not None:
                grad_norms.append(float(norm))
        if step not in skip_steps:
            opt.step()
        if sched is not None:
            sched.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
