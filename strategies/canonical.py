"""The canonical state: one flat, layout-independent form of a job's training state.

``CanonicalState`` is a flat ``dict[str, Tensor]`` of CPU tensors:
  - ``"model/<fqn>"``: every parameter and buffer of the full model, by its fully qualified
    name in the *original* model (pipeline stages keep these names);
  - ``"optim/<fqn>/<key>"``: each per-parameter optimizer state entry (``exp_avg``,
    ``momentum_buffer``, ``step``...), full-sized, keyed by the parameter's FQN.
Any strategy's ``full_state()`` loads into any other strategy's ``load_full_state()`` on any
world size; that is what makes live switches and resharding checkpoints possible. The
helpers here convert a module's and an optimizer's state to and from that form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "CanonicalState",
    "model_state_to_canonical",
    "optimizer_state_to_canonical",
    "optimizer_state_from_canonical",
    "probe_state",
    "state_hash",
    "state_keys",
]

CanonicalState = dict[str, torch.Tensor]


def model_state_to_canonical(named: Iterable[tuple[str, torch.Tensor]],
                             copy: bool = True) -> CanonicalState:
    """``copy=False``: CPU tensors are the live ones (views), not copies."""
    return {f"model/{k}": v.detach().to("cpu", copy=copy) for k, v in named}


def optimizer_state_to_canonical(
    optimizer: torch.optim.Optimizer, fqn_of: dict[int, str], copy: bool = True
) -> CanonicalState:
    """Per-parameter optimizer state keyed by the parameter's FQN. ``fqn_of`` maps
    ``id(param)`` to its FQN; parameters without state are skipped, and so are frozen ones
    (``requires_grad=False``: never stepped, and zero1/zero2/pipelines never hold their
    state; Adagrad makes it at construction). ``copy=False``: CPU tensors are the live ones."""
    out: CanonicalState = {}
    for p, st in optimizer.state.items():
        if not p.requires_grad:
            continue
        fqn = fqn_of[id(p)]
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"optim/{fqn}/{k}"] = t.detach().to("cpu", copy=copy)
    return out


def optimizer_state_from_canonical(
    optimizer: torch.optim.Optimizer,
    params_by_fqn: dict[str, nn.Parameter],
    state: CanonicalState,
    slicer: Callable[[str, torch.Tensor, nn.Parameter], torch.Tensor] | None = None,
    owned: bool = False,
) -> None:
    """Fill ``optimizer.state`` for the given parameters from canonical entries.

    ``slicer(fqn, full_tensor, param)`` cuts the full entry down to what this rank holds
    (identity by default); ``owned``: it returns a new tensor on the parameter's device,
    kept as it is (else a copy is taken). A ``step`` stays on the CPU unless its group is
    fused or capturable (torch's rule); other 0-dim entries (a scalar parameter's moments)
    go to the parameter's device. Entries of frozen parameters are not loaded (no layout
    exports them: ``optimizer_state_to_canonical``).
    """
    optimizer.state.clear()
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        if not key.startswith("optim/"):
            continue
        fqn, _, k = key[len("optim/"):].rpartition("/")
        if fqn in params_by_fqn and params_by_fqn[fqn].requires_grad:
            by_param.setdefault(fqn, {})[k] = t
    # another optimizer's state (a resume under a new factory): only what this one keeps,
    # and a parameter missing any of it starts fresh (was: Adam's moments carried along
    # under SGD for good, or RMSprop's step failing on a missing square_avg)
    group_of = {id(q): g for g in optimizer.param_groups for q in g["params"]}
    for fqn in list(by_param):
        p = params_by_fqn[fqn]
        keeps = state_keys(optimizer, tuple(p.shape), group_of.get(id(p)))
        if keeps is None:
            continue
        if keeps <= set(by_param[fqn]):
            by_param[fqn] = {k: t for k, t in by_param[fqn].items() if k in keeps}
        else:
            del by_param[fqn]
    on_device = {id(q) for g in optimizer.param_groups if g.get("fused") or g.get("capturable")
                 for q in g["params"]}
    for fqn, entries in by_param.items():
        p = params_by_fqn[fqn]
        st: dict[str, Any] = {}
        for k, t in entries.items():
            if k == "step" and t.dim() == 0:  # torch's own rule: on the CPU, unless the
                st[k] = (t.clone().to(p.device, torch.float32) if id(p) in on_device  # group
                         else t.clone())  # is fused or capturable
            elif t.dim() == 0:  # a scalar parameter's moments: on its device
                st[k] = t.clone().to(p.device)
            else:
                if slicer is not None and owned:
                    st[k] = slicer(fqn, t, p)
                else:
                    st[k] = (slicer(fqn, t, p) if slicer else t).clone().to(p.device)
        optimizer.state[p] = st


_KEYS: dict[tuple[type, str, tuple[int, ...]], frozenset[str] | None] = {}


def state_keys(optimizer: torch.optim.Optimizer, shape: tuple[int, ...] = (2,),
               group: dict[str, Any] | None = None) -> frozenset[str] | None:
    """The per-parameter state entries ``optimizer`` keeps, once it has stepped, for a
    parameter of ``shape`` in ``group`` (default its first; Adam: ``step``, ``exp_avg``,
    ``exp_avg_sq``, and ``max_exp_avg_sq`` with amsgrad; SGD with momentum:
    ``momentum_buffer``; Adafactor's factored ones for a matrix): one of its type and the
    group's settings stepped on a stand-in of that shape, each dim capped at 64 (a factored
    optimizer's size rule sees what it would). None where that cannot be built (every entry
    is then loaded)."""
    if group is None:
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
    settings = {k: v for k, v in group.items() if k != "params"}
    probe_shape = tuple(min(int(d), 64) for d in shape)
    key = (type(optimizer), repr(sorted((k, v) for k, v in settings.items()
                                        if k not in ("lr", "initial_lr"))), probe_shape)
    if key not in _KEYS:
        kind: Any = type(optimizer)
        try:
            _KEYS[key] = frozenset(probe_state(
                lambda ps: kind([{"params": ps, **settings}]), probe_shape))
        except Exception:  # noqa: BLE001 - an optimizer that needs more: load what is there
            _KEYS[key] = None
    return _KEYS[key]


def probe_state(build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                shape: tuple[int, ...]) -> dict[str, Any]:
    """The state the optimizer ``build([param])`` keeps for a stand-in parameter of
    ``shape`` (zeros) after one step with a gradient of ones. Raises what building or
    stepping it raises."""
    q = nn.Parameter(torch.zeros(shape))
    opt = build([q])
    q.grad = torch.ones_like(q)
    opt.step()
    return dict(opt.state[q])


def state_hash(state: CanonicalState) -> str:
    """A short, order-independent digest of a canonical state (bit-exact comparison)."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        if t.numel():  # the tensor's own buffer, no copy
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()[:16]
