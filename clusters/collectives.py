"""Alpha-beta times of collectives, and the messages each data-parallel layout sends per step.

All-reduce 2 h alpha + 2(n-1)/n S beta; all-gather / reduce-scatter h alpha + (n-1)/n S beta
(S = unsharded bytes); reduce / broadcast h alpha + S beta; point-to-point alpha + S beta. The
bandwidth term is a ring's; the latency hops h are the fewer of a ring's (n-1) and a tree's
(ceil(log2 n)), as NCCL picks per call.

A step's communication is a list of ``Messages`` (kind, how many, bytes each), counted from
the layout as the strategies send them (``layout_messages``): DDP's gradient buckets (1 MiB
first, then 25 MiB); ZeRO-1/2 one message per parameter tensor, or per bucket once they
communicate in buckets (``CommConfig.zero_bucket_bytes``: then zero2 too all-reduces each
bucket and keeps its owned sums), plus the owners' broadcasts of the updated parameters, of
kind ``broadcast_burst`` (every chunk in flight at once, ``ShardedUpdate.step``: each one
costs what a chunk of such a burst costs, not a broadcast alone); ZeRO-3 (FSDP2) an
all-gather per unit in forward, another in backward and a reduce-scatter per unit, per
micro-batch. So a model of 130 small tensors pays 130 latencies where it sends 130 messages,
and one where it sends one. docs/cost-model.md has the sources.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from strategies.traits import DP_MODES

__all__ = ["collective_time", "sync_collectives_time", "SYNC_MODES", "KINDS", "Messages",
           "CommConfig", "bucket_sizes", "assign_owners", "owner_loads", "layout_messages",
           "messages_time", "per_micro_batch", "sync_points", "burst_points", "BROADCAST_BURST",
           "FALLBACK_KIND", "latency_hops", "volume_factor"]

SYNC_MODES = DP_MODES  # layouts whose step ends in a data-parallel gradient sync
# one broadcast of a burst in which every rank broadcasts its chunk at once (ZeRO-1/2's
# update): its (alpha, beta) is per message, the burst's time over its messages
BROADCAST_BURST = "broadcast_burst"
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast", "p2p",
         BROADCAST_BURST)
# the kind whose measured figures stand in for one that was not measured (older profiles)
FALLBACK_KIND = {BROADCAST_BURST: "broadcast"}

_MIB = 1 << 20


def latency_hops(kind: str, n: int) -> float:
    """How many latencies (alpha) one message of ``kind`` over ``n`` ranks pays: the fewer of
    a ring's (all-reduce 2(n-1), the others n-1) and a tree's (all-reduce 2 ceil(log2 n), the
    others ceil(log2 n)), as NCCL picks per call; equal up to 3 ranks. Without the tree, a
    layout's hundreds of bucket messages over 10,000 ranks would each pay 20,000 latencies."""
    if kind == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    tree = float(math.ceil(math.log2(n)))
    if kind == "all_reduce":
        return 2.0 * min(n - 1, tree)
    if kind in ("all_gather", "reduce_scatter", "reduce", "broadcast", BROADCAST_BURST):
        return min(float(n - 1), tree)
    raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")


def volume_factor(kind: str, n: int) -> float:
    """Bytes on the bottleneck per byte of (unsharded) payload for ``kind`` over ``n`` ranks."""
    if kind == "p2p":
        return 1.0
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if kind in ("reduce", "broadcast", BROADCAST_BURST):
        return 1.0
    raise ValueError(f"unknown collective {kind!r}; use one of {KINDS}")


def collective_time(kind: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of one collective of ``nbytes`` (unsharded size) over ``n`` ranks.

    ``kind``: one of ``KINDS``. ``beta`` is seconds per byte. Raises ``ValueError`` for an
    unknown kind.
    """
    hops = latency_hops(kind, n)
    if nbytes <= 0 or (kind != "p2p" and n <= 1):
        return 0.0
    return hops * alpha + volume_factor(kind, n) * nbytes * beta


@dataclass(frozen=True)
class Messages:
    """``count`` messages of ``kind``, ``nbytes`` each (unsharded payload), per step."""

    kind: str
    count: int
    nbytes: float


@dataclass(frozen=True)
class CommConfig:
    """How the layouts' software groups its messages (not a cost: what is sent).

    ``ddp_bucket_bytes`` / ``first_bucket_bytes``: DDP's gradient buckets (``bucket_cap_mb``
    25 MiB, the first 1 MiB). ``zero_bucket_bytes``: ZeRO-1/2's gradient buckets and
    broadcast chunks (DeepSpeed's and the strategies' 25 MiB by default); ``None`` = one
    message per parameter tensor (this project's strategies before they bucketed: the live
    planner sets what the installed strategies do, ``elastic.planning.comm_config``).
    """

    ddp_bucket_bytes: float = 25 * _MIB
    first_bucket_bytes: float = 1 * _MIB
    zero_bucket_bytes: float | None = 25 * _MIB


def bucket_sizes(tensor_bytes: Sequence[float], cap: float, first_cap: float | None = None,
                 close_after: bool = False) -> tuple[float, ...]:
    """Bytes of each bucket when tensors are taken in reverse order (backward's) into buckets
    of at most ``cap`` (``first_cap`` for the first). ``close_after``: DDP's rule, a bucket
    closes once it reaches its cap (the tensor that crosses it is inside); otherwise the
    strategies' rule, a bucket closes before a tensor would pass its cap (a larger tensor
    alone)."""
    out: list[float] = []
    used = 0.0
    for b in reversed(tensor_bytes):
        limit = first_cap if (first_cap is not None and not out) else cap
        if not close_after and used > 0 and used + b > limit:
            out.append(used)
            used = 0.0
        used += b
        if close_after and used >= limit:
            out.append(used)
            used = 0.0
    if used > 0:
        out.append(used)
    return tuple(out)


def assign_owners(numels: Sequence[float], n: int) -> list[int]:
    """ZeRO-1/2's ownership (``strategies._gather.assign_owners``, mirrored here because
    clusters imports no torch; a test holds them equal): the largest tensor first goes to
    the least loaded owner; ties by position and owner index. O(T log T + T log n)."""
    return list(_owners(tuple(float(x) for x in numels), n))


@functools.lru_cache(maxsize=1024)
def _owners(numels: tuple[float, ...], n: int) -> tuple[int, ...]:
    owner = [0] * len(numels)
    order = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
    if n >= len(numels):  # every tensor to a fresh (empty, lowest-index) owner
        for r, i in enumerate(order):
            owner[i] = r
        return tuple(owner)
    heap = [(0.0, r) for r in range(n)]  # (load, owner): the least loaded, lowest index
    for i in order:
        load, o = heapq.heappop(heap)
        owner[i] = o
        heapq.heappush(heap, (load + numels[i], o))
    return tuple(owner)


def owner_loads(numels: Sequence[float], n: int) -> tuple[tuple[int, float], ...]:
    """(tensors, elements) of every owner that owns something under ``assign_owners``
    (at most one entry per tensor, whatever ``n``)."""
    return _owner_loads(tuple(float(x) for x in numels), n)


@functools.lru_cache(maxsize=1024)
def _owner_loads(numels: tuple[float, ...], n: int) -> tuple[tuple[int, float], ...]:
    loads: dict[int, tuple[int, float]] = {}
    for x, o in zip(numels, _owners(numels, n), strict=True):
        t, e = loads.get(o, (0, 0.0))
        loads[o] = (t + 1, e + x)
    return tuple(loads[o] for o in sorted(loads))


def _chunks(owner_bytes: Sequence[Sequence[float]], cap: float | None) -> list[float]:
    """The owners' broadcasts: each owner's tensors in flat chunks of at most ``cap``
    (``None``: one chunk per owner)."""
    out: list[float] = []
    for tensors in owner_bytes:
        if not tensors:
            continue
        if cap is None:
            out.append(sum(tensors))
            continue
        used = 0.0
        for b in tensors:
            if used > 0 and used + b > cap:
                out.append(used)
                used = 0.0
            used += b
        out.append(used)
    return out


def _group(kind: str, sizes: Sequence[float], times: int = 1) -> list[Messages]:
    """Messages of ``kind`` of the given sizes (equal sizes merged), ``times`` each."""
    counts: dict[float, int] = {}
    for s in sizes:
        if s > 0:
            counts[s] = counts.get(s, 0) + times
    return [Messages(kind, c, s) for s, c in sorted(counts.items())]


@functools.lru_cache(maxsize=4096)
def _layout_messages(mode: str, n: int, tensors: tuple[float, ...], units: tuple[float, ...],
                     m: int, comm: CommConfig, hooks: bool) -> tuple[Messages, ...]:
    if n <= 1:
        return ()
    if mode == "dp":
        if hooks:  # DDP's reducer
            return tuple(_group("all_reduce", bucket_sizes(
                tensors, comm.ddp_bucket_bytes, comm.first_bucket_bytes, close_after=True)))
        if comm.zero_bucket_bytes is None:  # a pipeline stage's one flat all-reduce
            return tuple(_group("all_reduce", [sum(tensors)]))
        return tuple(_group("all_reduce", bucket_sizes(tensors, comm.zero_bucket_bytes,
                                                       comm.first_bucket_bytes)))
    if mode == "zero3":
        return tuple(_group("all_gather", units, 2 * m) + _group("reduce_scatter", units, m))
    if mode not in ("zero1", "zero2"):
        raise KeyError(f"unknown data-parallel mode {mode!r}; use one of {SYNC_MODES}")
    owner = assign_owners(tensors, n)
    groups: dict[int, list[float]] = {}
    for b, o in zip(tensors, owner, strict=True):
        groups.setdefault(o, []).append(b)
    per_owner = [groups[r] for r in sorted(groups)]  # owners with nothing send nothing
    cap = comm.zero_bucket_bytes
    out: list[Messages] = []
    if mode == "zero1":
        if cap is None:  # one all-reduce per tensor from the hooks, or one flat one
            out += _group("all_reduce", list(tensors) if hooks else [sum(tensors)])
        else:
            out += _group("all_reduce", bucket_sizes(tensors, cap, comm.first_bucket_bytes))
    else:
        if cap is None:  # one reduce per tensor per micro-batch, or one per owner
            sizes = list(tensors) if hooks else [sum(t) for t in per_owner]
            out += _group("reduce", sizes, m if hooks else 1)
        else:  # per bucket one all-reduce, each rank keeping its owned sums (and with them
            # every rank the global norm: no scalar all-reduce), every micro-batch
            out += _group("all_reduce", bucket_sizes(tensors, cap, comm.first_bucket_bytes),
                          m if hooks else 1)
    out += _group(BROADCAST_BURST, _chunks(per_owner, cap))  # all in flight at once
    return tuple(out)


def layout_messages(
    mode: str,
    n: int,
    tensor_bytes: Sequence[float],
    unit_bytes: Sequence[float] = (),
    *,
    micro_batches: int = 1,
    comm: CommConfig | None = None,
    hooks: bool = True,
) -> tuple[Messages, ...]:
    """The messages one data-parallel group of ``n`` ranks sends per step under ``mode``.

    ``tensor_bytes``: each parameter tensor's bytes, in the model's order (the strategies'
    bucket and owner rules read that order). ``unit_bytes``: each FSDP unit's parameter bytes
    (zero3; one unit per block that has parameters). ``micro_batches``: accumulation passes
    (dp and zero1 reduce once per step, zero2 and zero3 once per micro-batch). ``hooks``:
    False for a pipeline stage's reduction, which runs once after the schedule (one flat
    message, per owner for zero2, until the strategies bucket; zero3's FSDP units still
    gather per micro-batch). Raises ``KeyError`` for an unknown mode.
    """
    m = max(1, micro_batches) if per_micro_batch(mode, hooks) else 1
    return _layout_messages(mode, n, tuple(float(b) for b in tensor_bytes),
                            tuple(float(b) for b in unit_bytes), m,
                            comm or CommConfig(), hooks)


def per_micro_batch(mode: str, hooks: bool = True) -> bool:
    """Whether ``mode``'s messages grow with the micro-batches: zero3's gathers and
    reduce-scatters, zero2's reductions from the hooks. dp and zero1 reduce once a step, and
    a pipeline stage's reduction after its schedule (``hooks`` False) once but for zero3;
    ``layout_messages`` passes the count on only where this is True (``sync_points`` reads
    it only there)."""
    return mode == "zero3" or (mode == "zero2" and hooks)


def sync_points(mode: str, n: int, units: int = 1, micro_batches: int = 1,
                hooks: bool = True) -> int:
    """How many times per step the ranks of a data-parallel group meet right after
    computing, each waiting there for the slowest peer's compute: dp once (its last gradient
    bucket), zero1 twice (the gradients; the broadcasts after the owners' optimizer steps),
    zero2 once per micro-batch (its buckets go every micro-batch) and once for the broadcasts,
    zero3 at every gather and reduce-scatter (3 per unit per micro-batch, each after a
    block's compute). A pipeline stage's reduction after its schedule (``hooks`` False) meets
    once, and zero1/zero2 once more for the broadcasts. The other messages of a step follow
    one another and pay the idle alpha only. Raises ``KeyError`` for an unknown mode.

    zero1/zero2 still meet at the broadcasts: every rank receives every owner's chunk, so the
    burst ends after the last owner's optimizer step (``burst_points``; what that wait costs
    is the burst's own measured figure when the profiler has one)."""
    if n <= 1:
        return 0
    m = max(1, micro_batches)
    if mode == "dp":
        return 1
    if mode == "zero1":
        return 2
    if mode == "zero2":
        return (m if hooks else 1) + 1
    if mode == "zero3":
        return 3 * max(1, units) * m
    raise KeyError(f"unknown data-parallel mode {mode!r}; use one of {SYNC_MODES}")


def burst_points(mode: str, n: int) -> int:
    """Of ``sync_points``, how many are zero1/zero2's broadcast burst (after the owners'
    optimizer steps): 1 for zero1 and zero2 over n > 1 ranks (hooks or not), else 0."""
    return 1 if n > 1 and mode in ("zero1", "zero2") else 0


def messages_time(messages: Sequence[Messages], n: int,
                  alpha_beta: dict[str, tuple[float, float]]) -> float:
    """Seconds of ``messages`` over ``n`` ranks, each kind at its (alpha, beta)."""
    return sum(m.count * collective_time(m.kind, m.nbytes, n, *alpha_beta[m.kind])
               for m in messages)


def sync_collectives_time(
    mode: str,
    n: int,
    param_bytes: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    micro_batches: int = 1,
    units: int = 1,
) -> float:
    """Seconds of ``mode``'s collectives per step for a group of ``n`` ranks when all that is
    known is the model's total size and its number of FSDP units (``units`` equal blocks, each
    one tensor): ``layout_messages`` on that, at one (alpha, beta). Raises ``KeyError``."""
    u = max(1, units)
    tensors = [grad_bytes / u] * u
    msgs = layout_messages(mode, n, tensors, [param_bytes / u] * u, micro_batches=micro_batches)
    return messages_time(msgs, n, dict.fromkeys(KINDS, (alpha, beta)))
