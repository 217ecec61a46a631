"""Bytes per device: model states under dp/ZeRO sharding, working buffers, and how a total is
named in a message.

``layout_memory`` is the one place where what each layout shards is turned into bytes (the
ZeRO paper's accounting plus FSDP's gathered-block buffers). The cost model's data-parallel
and pipeline estimates and the planner's early memory check all call it, so that table can
later be read from ``strategies.traits`` in one place. GB = 1e9 bytes, as in the ZeRO paper.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError

__all__ = ["MemoryBreakdown", "layout_memory", "model_state_bytes", "format_bytes",
           "describe_memory"]

_GB = 1e9



@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device: model states (params, grads, optimizer) + activations + buffers."""

    params: float
    grads: float
    optimizer: float
    activations: float = 0.0
    buffers: float = 0.0

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers


def layout_memory(
    strategy: str,
    n_params: float,
    n: int,
    *,
    bytes_per_param: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    biggest_block: float = 0.0,
    activations: float = 0.0,
    units: int | None = None,
    biggest_tensor: float = 0.0,
    frozen_params: float = 0.0,
) -> MemoryBreakdown:
    """Per-device bytes of ``n_params`` parameters laid out by ``strategy`` over ``n`` ranks.

    Model states (ZeRO paper, Rajbhandari et al. 2020, Fig. 1): dp (2+2+K) psi, zero1
    2psi + 2psi + K psi/n, zero2 2psi + (2+K) psi/n, zero3 (2+2+K) psi/n. Buffers, from
    ``biggest_block`` (the largest block's parameters) and ``biggest_tensor`` (the largest
    parameter tensor's): zero1 and zero2 two gradient buckets (each up to the bucket cap, or
    the largest tensor where it passes it: a bucket of its own); zero3 two gathered blocks
    (prefetch) plus one block of unsharded gradients, one gathered where ``units`` is 1 (a
    model without blocks, wrapped whole).
    ``activations`` is passed through. ``frozen_params``: weights held as the layout holds
    weights (sharded under zero3), with no gradient or optimizer state. Raises ``PlanError``
    for an unknown strategy.
    """
    from strategies.traits import TRAITS  # torch-free: what each layout shards, once

    t = TRAITS.get(strategy)
    if t is None or t.pipeline:
        raise PlanError(f"no model-state rule for {strategy!r}; use dp or zero1..3")
    st = t.state_bytes(n_params, n, param_bytes=bytes_per_param, grad_bytes=grad_bytes,
                       optimizer_bytes=optimizer_bytes)
    buffers = t.buffer_bytes(biggest_block, param_bytes=bytes_per_param, grad_bytes=grad_bytes,
                             units=units, tensor_params=biggest_tensor)
    held = st.params
    if frozen_params:
        held += t.state_bytes(frozen_params, n, param_bytes=bytes_per_param, grad_bytes=0,
                              optimizer_bytes=0).params
    return MemoryBreakdown(held, st.grads, st.optimizer, activations, buffers)


def model_state_bytes(
    strategy: str,
    n_params: float,
    n: int,
    *,
    bytes_per_param: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> MemoryBreakdown:
    """Per-device model states only (no buffers, no activations): ``layout_memory``'s figures."""
    return layout_memory(strategy, n_params, n, bytes_per_param=bytes_per_param,
                         grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)


def format_bytes(x: float) -> str:
    """``35.6 GB``, ``0.40 GB``: one decimal from 10 GB up, two below."""
    gb = x / _GB
    return f"{gb:.1f} GB" if gb >= 10 else f"{gb:.2f} GB"


def describe_memory(m: MemoryBreakdown, *, activations: bool = True) -> str:
    """Every part a total counts, by name: ``model states 35.6 GB (params 15.0 GB, grads
    15.0 GB, optimizer 5.62 GB) + activations 1.20 GB + buffers 0.40 GB``. Parts that are zero
    (activations, buffers) are left out; ``activations=False`` leaves them out always."""
    text = (f"model states {format_bytes(m.model_states)} (params {format_bytes(m.params)}, "
            f"grads {format_bytes(m.grads)}, optimizer {format_bytes(m.optimizer)})")
    if activations and m.activations > 0:
        text += f" + activations {format_bytes(m.activations)}"
    if m.buffers > 0:
        text += f" + buffers {format_bytes(m.buffers)}"
    return text
