"""Refuse an optimizer factory whose settings depend on which parameters it is given.

dp and zero3 call the job's optimizer factory with every parameter of the model; zero1 and
zero2 with the parameters a rank owns, pipelines with a stage's. A factory that sets
hyperparameters by position or count (layer-wise lr decay,
``[{"params": [p], "lr": lr * d**i} for i, p in enumerate(params)]``) then gives a
parameter another learning rate in those layouts, silently. ``check_factory`` builds the
factory on the full list and on every subset the layout's ranks build it on, and compares
each parameter's group settings (every key but ``params``) by the parameter's identity.

Every rank checks every rank's subset, so all ranks refuse alike (none waits in a
collective for one that refused). The builds are on stand-ins on the meta device (each
parameter's shape, dtype and ``requires_grad``; the factory sees no names): an optimizer
that makes its state at construction (Adagrad) allocates nothing for them. A factory that
cannot be built on them (a fused kernel's device check) is not checked. dp and zero3 pay
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .base import OptimizerFactory
from .errors import StrategyError

__all__ = ["check_factory"]


def _settings(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """Each parameter's group settings (every key but ``params``), by the parameter's id."""
    return {id(p): {k: v for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups for p in g["params"]}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a.detach().cpu(), b.detach().cpu())))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality: by their text
        return repr(a) == repr(b)


def check_factory(factory: OptimizerFactory, model: nn.Module,
                  subsets: Sequence[tuple[str, Sequence[nn.Parameter]]], how: str) -> None:
    """Raise ``StrategyError`` if ``factory`` gives any parameter of ``subsets`` (who builds
    on it, the parameters in the order given) another setting than when built on all of
    ``model``'s parameters (what dp and zero3 give it); ``how`` says how the layout picks
    a subset. An empty subset, the full list and a repeat are not built."""
    real = list(model.parameters())
    seen = {tuple(id(p) for p in real)}  # what needs no build: the full list, a repeat
    todo = []
    for who, ps in subsets:
        key = tuple(id(p) for p in ps)
        if ps and key not in seen:
            seen.add(key)
            todo.append((who, list(ps)))
    if not todo:
        return
    stand = {id(p): nn.Parameter(torch.empty_like(p, device="meta"),
                                 requires_grad=p.requires_grad) for p in real}
    try:
        ref = _settings(factory([stand[id(p)] for p in real]))
        built = [(who, ps, _settings(factory([stand[id(p)] for p in ps]))) for who, ps in todo]
    except Exception:  # noqa: BLE001 - not buildable on stand-ins: the real builds say
        return
    names = {id(p): n for n, p in model.named_parameters()}
    for who, ps, got in built:
        for p in ps:
            a, b = ref.get(id(stand[id(p)])), got.get(id(stand[id(p)]))
            if a is None or b is None:  # a parameter the factory leaves out
                continue
            for k in sorted(set(a) | set(b)):
                if not _same(a.get(k), b.get(k)):
                    raise StrategyError(
                        f"the optimizer factory gives parameter {names.get(id(p), '?')} "
                        f"{k} {a.get(k)!r} when built on all parameters but {b.get(k)!r} "
                        f"when built on {who}'s subset ({how}): split param groups by the "
                        "parameters themselves (their shape, their module), not by their "
                        "position or count")
