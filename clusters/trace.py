"""Failure traces: which node fails or is preempted when, and how; read from files or generated.

A trace is a list of ``FailureEvent(time, node, kind, repair_s)``, sorted by time. Failure
kinds (the recoverable ``elastic.failures.FailureKind`` values a cluster produces):

* ``node_lost``: the node is gone until repaired (``repair_s``, default the simulation's
  ``SimConfig.repair_s``) or until a spare node takes its place;
* ``process_lost``: a worker process died and its node starts it again (``repair_s``,
  default ``SimConfig.process_restart_s``);
* ``hang``: a collective stopped making progress; it is seen only when the group's timeout
  expires (the policy's ``hang_detection_s``), then it is a ``process_lost``.

Preemption kinds (spot or preemptible nodes, which the cloud takes back with a warning):

* ``notice``: the cloud announced that the node goes (AWS: 2 min before, GCP and Azure: 30 s);
  its deadline is the time of the node's next ``preempted`` event, which must follow;
* ``preempted``: the node is gone (at the notice's deadline, or unannounced without one)
  until the capacity comes back (``repair_s``, default ``SimConfig.preemption_return_s``).

File formats (``load_trace`` / ``save_trace``; the extension picks one):

* CSV (``.csv``): a header row naming the columns, then one event per row; blank lines and
  lines starting with ``#`` are skipped::

      time,node,kind,repair_s
      3600.5,a100-17,node_lost,
      7200,a100-3,process_lost,120

* JSON Lines (``.jsonl`` or ``.ndjson``): one object per line, e.g.
  ``{"time": 3600.5, "node": "a100-17", "kind": "node_lost"}``.

``time``: seconds from the job's start, >= 0. ``node``: a node id of the cluster
(``<pool>-<i>`` in cluster files). ``kind`` (optional, default ``node_lost``) and ``repair_s``
(optional, seconds > 0) as above. A ``notice`` without a later ``preempted`` of its node, a
second notice before it, or a notice with a ``repair_s`` is an error too. Anything else is a
``TraceError`` naming the file, the line and the fix. Generators: ``poisson_trace``
(exponential gaps from per-pool MTBFs), ``preemption_trace`` (preemptions at a rate per pool,
each announced a lead time before), ``failure_trace`` (both, from a ``SimConfig``) and
``llama3_trace`` (the interruption rate of Llama 3's pre-training, scaled to the cluster's
GPU count).
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import TraceError
from .topology import Cluster

if TYPE_CHECKING:
    from .sim_config import SimConfig

__all__ = [
    "FAILURE_KINDS",
    "NOTICE_KINDS",
    "TRACE_KINDS",
    "FailureEvent",
    "LLAMA3_KINDS",
    "failure_trace",
    "job_mttf_s",
    "llama3_gpu_mtbf_s",
    "llama3_trace",
    "load_trace",
    "poisson_trace",
    "preemption_trace",
    "save_trace",
    "validate_trace",
]

FAILURE_KINDS = ("node_lost", "process_lost", "hang")
NOTICE_KINDS = ("notice", "preempted")
TRACE_KINDS = FAILURE_KINDS + NOTICE_KINDS

# Llama 3 (Dubey et al. 2024, sec. 3.3.4): 419 unexpected interruptions in a 54-day snapshot
# of pre-training on 16,384 H100 GPUs (a job-level MTTF of 3.1 h), about 78 % of them
# attributed to hardware. The split of the other 22 % into software crashes and hangs below is
# this project's assumption, not the paper's table.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_GPUS = 16384
LLAMA3_KINDS: Mapping[str, float] = {"node_lost": 0.78, "process_lost": 0.20, "hang": 0.02}

_COLUMNS = ("time", "node", "kind", "repair_s")


@dataclass(frozen=True)
class FailureEvent:
    """Node ``node`` fails (or is announced to go, or goes) at ``time`` s in the way ``kind``
    says and is back ``repair_s`` later (None: the simulation's default for that kind; a
    ``notice`` has none)."""

    time: float
    node: str
    repair_s: float | None = None
    kind: str = "node_lost"


# --------------------------------------------------------------------------- generators


def poisson_trace(
    cluster: Cluster,
    duration_s: float,
    node_mtbf_s: Mapping[str, float],
    *,
    seed: int = 0,
    kinds: Mapping[str, float] | None = None,
    repair_s: float = 3600.0,
    restart_s: float = 60.0,
) -> list[FailureEvent]:
    """Failures over ``duration_s``: per node, exponential gaps with mean its pool's MTBF
    (``node_mtbf_s`` by pool name, ``"*"`` for every pool; a pool without one never fails),
    counted from the node's return. ``kinds``: probability of each kind (default: all
    ``node_lost``); a ``node_lost`` node is out ``repair_s``, any other kind ``restart_s``
    (the events leave ``repair_s`` unset, so the simulation's settings apply). Deterministic
    for a given ``seed``."""
    mix = _kind_mix(kinds)
    rng = random.Random(seed)
    out = []
    for node in cluster.nodes:
        mtbf = node_mtbf_s.get(node.pool, node_mtbf_s.get("*"))
        if not mtbf or math.isinf(mtbf):  # (0 or inf: this pool never fails)
            continue
        t = rng.expovariate(1.0 / mtbf)
        while t < duration_s:
            kind = "node_lost" if mix is None else _draw(rng, mix)
            out.append(FailureEvent(t, node.id, kind=kind))
            t += (repair_s if kind == "node_lost" else restart_s) + rng.expovariate(1.0 / mtbf)
    return sorted(out, key=_order)


def failure_trace(cluster: Cluster, config: SimConfig) -> list[FailureEvent]:
    """``poisson_trace`` with ``config``'s duration, per-pool MTBFs, repair time and seed
    (every failure a ``node_lost``), merged with ``preemption_trace`` at ``config``'s
    preemption rates and notice times (none by default)."""
    out = poisson_trace(cluster, config.duration_s, config.node_mtbf_s, seed=config.seed,
                        repair_s=config.repair_s, restart_s=config.process_restart_s)
    if config.preemption_per_h:
        out += preemption_trace(cluster, config.duration_s, config.preemption_per_h,
                                notice_s=config.notice_s, return_s=config.preemption_return_s,
                                seed=config.seed)
    return sorted(out, key=_order)


def preemption_trace(
    cluster: Cluster,
    duration_s: float,
    rate_per_h: Mapping[str, float],
    *,
    notice_s: Mapping[str, float] | float = 120.0,
    return_s: float = 1800.0,
    seed: int = 0,
) -> list[FailureEvent]:
    """Preemptions of spot or preemptible nodes over ``duration_s``.

    ``rate_per_h``: preemptions per node-hour by pool name (``"*"``: every pool; a pool
    without one is never preempted). Per node, exponential gaps with mean 1 / rate hours,
    counted from the node's return (``return_s`` after a loss). Each loss is a ``preempted``
    event, announced by a ``notice`` event ``notice_s`` before it (by pool name or ``"*"``,
    or one number; 0: unannounced; a notice never comes before the node is back). Raises
    ``TraceError`` for a negative or non-finite rate or notice time. Deterministic for a
    given ``seed`` (and independent of ``poisson_trace``'s draws)."""
    for key, r in rate_per_h.items():
        if not (math.isfinite(r) and r >= 0):
            raise TraceError("rate_per_h", f"pool {key!r}: a rate must be a finite number of "
                             f"preemptions per node-hour >= 0, got {r!r}.")
    if not (math.isfinite(return_s) and return_s >= 0):
        raise TraceError("return_s", f"must be a finite number of seconds >= 0, got {return_s!r}.")
    rng = random.Random(seed * 1_000_003 + 7919)
    out = []
    for node in cluster.nodes:
        rate = rate_per_h.get(node.pool, rate_per_h.get("*", 0.0))
        if not rate:
            continue
        lead = _lead(notice_s, node.pool)
        back = 0.0
        t = rng.expovariate(rate / 3600.0)
        while t < duration_s:
            if lead > 0:
                out.append(FailureEvent(max(back, t - lead), node.id, kind="notice"))
            out.append(FailureEvent(t, node.id, kind="preempted"))
            back = t + return_s
            t = back + rng.expovariate(rate / 3600.0)
    return sorted(out, key=_order)


def _lead(notice_s: Mapping[str, float] | float, pool: str) -> float:
    lead = notice_s if isinstance(notice_s, (int, float)) else notice_s.get(
        pool, notice_s.get("*", 0.0))
    if not (math.isfinite(lead) and lead >= 0):
        raise TraceError("notice_s", f"pool {pool!r}: a notice lead time must be a finite "
                         f"number of seconds >= 0, got {lead!r}.")
    return float(lead)


def _order(e: FailureEvent) -> tuple[float, str, int]:
    """Trace order: by time and node; a notice before a loss at the same instant."""
    return (e.time, e.node, 0 if e.kind == "notice" else 1)


def llama3_gpu_mtbf_s(job_mttf_h: float | None = None) -> float:
    """Seconds between failures of one GPU such that a 16,384-GPU job is interrupted every
    ``job_mttf_h`` hours; None: Llama 3's 419 interruptions in 54 days (3.09 h)."""
    job_s = LLAMA3_DAYS * 86400.0 / LLAMA3_INTERRUPTIONS if job_mttf_h is None else (
        job_mttf_h * 3600.0)
    if not job_s > 0:
        raise TraceError("llama3_trace", f"job_mttf_h must be > 0, got {job_mttf_h!r}.")
    return job_s * LLAMA3_GPUS


def llama3_trace(
    cluster: Cluster,
    duration_s: float,
    *,
    seed: int = 0,
    job_mttf_h: float | None = None,
    kinds: Mapping[str, float] = LLAMA3_KINDS,
    repair_s: float = 3600.0,
    restart_s: float = 60.0,
) -> list[FailureEvent]:
    """A trace at Llama 3's interruption rate per GPU (``llama3_gpu_mtbf_s(job_mttf_h)``):
    each node fails at its device count times that rate, with Llama 3's share of hardware
    failures as ``node_lost`` (``LLAMA3_KINDS``). On 10,000 GPUs that is one interruption
    every 5.1 h (every 2.95 h with ``job_mttf_h=1.8``)."""
    gpu = llama3_gpu_mtbf_s(job_mttf_h)
    mtbf = {p.name: gpu / p.devices_per_node for p in cluster.pools if p.devices_per_node}
    return poisson_trace(cluster, duration_s, mtbf, seed=seed, kinds=kinds, repair_s=repair_s,
                         restart_s=restart_s)


def job_mttf_s(cluster: Cluster, node_mtbf_s: Mapping[str, float]) -> float:
    """Mean time between failures of a job on every node of ``cluster`` (1 / sum of the nodes'
    rates); ``math.inf`` when no node fails."""
    rate = 0.0
    for node in cluster.nodes:
        mtbf = node_mtbf_s.get(node.pool, node_mtbf_s.get("*"))
        if mtbf:
            rate += 1.0 / mtbf
    return 1.0 / rate if rate else math.inf


def _kind_mix(kinds: Mapping[str, float] | None) -> list[tuple[str, float]] | None:
    if kinds is None:
        return None
    bad = [k for k in kinds if k not in FAILURE_KINDS]
    if bad or not kinds or any(not (p >= 0) for p in kinds.values()) or sum(kinds.values()) <= 0:
        raise TraceError("kinds", f"must map {', '.join(FAILURE_KINDS)} to probabilities >= 0 "
                         f"with a positive sum, got {dict(kinds)}.")
    total = sum(kinds.values())
    acc, out = 0.0, []
    for k, p in kinds.items():
        acc += p / total
        out.append((k, acc))
    return out


def _draw(rng: random.Random, mix: list[tuple[str, float]]) -> str:
    x = rng.random()
    return next((k for k, edge in mix if x < edge), mix[-1][0])


# --------------------------------------------------------------------------- files


def validate_trace(
    events: Iterable[FailureEvent], cluster: Cluster | None = None, source: str = "events"
) -> list[FailureEvent]:
    """The events sorted by (time, node), each checked: time finite and >= 0, a known kind,
    ``repair_s`` None or > 0, (with ``cluster``) a node of it, and every notice followed by
    its node's loss (module docstring). Raises ``TraceError``."""
    nodes = {n.id for n in cluster.nodes} if cluster is not None else None
    out = []
    for i, e in enumerate(events):
        where = f"{source}[{i}]"
        _check_time(e.time, where)
        _check_kind(e.kind, where)
        if e.repair_s is not None:
            _check_repair(e.repair_s, where)
        _check_node(e.node, nodes, where)
        out.append((where, e))
    return _checked_notices(out)


def load_trace(path: str | os.PathLike[str], cluster: Cluster | None = None) -> list[FailureEvent]:
    """Read a CSV or JSON Lines trace (module docstring); with ``cluster``, every node must be
    one of its nodes. Sorted by (time, node), a notice before a loss at the same instant.
    Raises ``TraceError`` (file, line, fix) or ``FileNotFoundError``."""
    name = os.fspath(path)
    fmt = _format_of(name)
    with open(name, encoding="utf-8") as f:
        text = f.read()
    rows = _csv_rows(text, name) if fmt == "csv" else _jsonl_rows(text, name)
    nodes = {n.id for n in cluster.nodes} if cluster is not None else None
    out = []
    for where, row in rows:
        unknown = [k for k in row if k not in _COLUMNS]
        if unknown:
            close = difflib.get_close_matches(unknown[0], _COLUMNS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"use {', '.join(_COLUMNS)}."
            raise TraceError(where, f"unknown field {unknown[0]!r}.", hint)
        for key in ("time", "node"):
            if row.get(key) in (None, ""):
                raise TraceError(where, f"{key} is required.", "every event needs time and node.")
        t = _number(row["time"], "time", where)
        _check_time(t, where)
        node = row["node"]
        if not isinstance(node, str):
            raise TraceError(where, f"node must be a node id (a string), got {node!r}.")
        _check_node(node, nodes, where)
        kind = row.get("kind") or "node_lost"
        _check_kind(kind, where)
        repair = row.get("repair_s")
        rep = None if repair in (None, "") else _number(repair, "repair_s", where)
        if rep is not None:
            _check_repair(rep, where)
        out.append((where, FailureEvent(t, node, rep, str(kind))))
    return _checked_notices(out)


def _checked_notices(rows: list[tuple[str, FailureEvent]]) -> list[FailureEvent]:
    """The events in trace order, after checking that each ``notice`` is followed by its
    node's ``preempted`` event with no second notice between, and carries no ``repair_s``."""
    rows.sort(key=lambda r: _order(r[1]))
    pending: dict[str, tuple[str, FailureEvent]] = {}
    for where, e in rows:
        if e.kind == "notice":
            if e.repair_s is not None:
                raise TraceError(where, f"a notice has no repair_s (got {e.repair_s!r}).",
                                 "put repair_s on the node's 'preempted' event.")
            if e.node in pending:
                first = pending[e.node][0]
                raise TraceError(where, f"a second notice for node {e.node!r} before it is "
                                 f"preempted (the first is at {first}).",
                                 "remove one, or add the 'preempted' event between them.")
            pending[e.node] = (where, e)
        elif e.kind == "preempted":
            pending.pop(e.node, None)
    if pending:
        where, e = min(pending.values(), key=lambda r: _order(r[1]))
        raise TraceError(where, f"notice for node {e.node!r} at {e.time:g} s has no "
                         "'preempted' event of that node after it.",
                         f"add the loss at the deadline, e.g. {e.time + 120:g},{e.node},"
                         "preempted (a notice's lead time is the gap to it).")
    return [e for _, e in rows]


def save_trace(events: Sequence[FailureEvent], path: str | os.PathLike[str]) -> None:
    """Write ``events`` as CSV or JSON Lines (by extension); ``load_trace`` reads it back."""
    name = os.fspath(path)
    fmt = _format_of(name)
    with open(name, "w", encoding="utf-8", newline="") as f:
        if fmt == "csv":
            w = csv.writer(f)
            w.writerow(_COLUMNS)
            for e in events:
                w.writerow([repr(e.time), e.node, e.kind, "" if e.repair_s is None else e.repair_s])
        else:
            for e in events:
                row: dict[str, Any] = {"time": e.time, "node": e.node, "kind": e.kind}
                if e.repair_s is not None:
                    row["repair_s"] = e.repair_s
                f.write(json.dumps(row) + "\n")


def _format_of(name: str) -> str:
    ext = os.path.splitext(name)[1].lower()
    if ext == ".csv":
        return "csv"
    if ext in (".jsonl", ".ndjson"):
        return "jsonl"
    raise TraceError(name, f"unknown trace format {ext or '(no extension)'!r}.",
                     "name the file *.csv or *.jsonl.")


def _csv_rows(text: str, name: str) -> list[tuple[str, dict[str, Any]]]:
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1)
             if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise TraceError(name, "is empty.", "start with a header row: time,node,kind,repair_s.")
    head_no, head = lines[0]
    header = [h.strip() for h in next(csv.reader(io.StringIO(head)))]
    if "time" not in header or "node" not in header:
        raise TraceError(f"{name}:{head_no}", f"the header {head!r} does not name the columns.",
                         "start with a header row: time,node,kind,repair_s.")
    out = []
    for no, ln in lines[1:]:
        cells = [c.strip() for c in next(csv.reader(io.StringIO(ln)))]
        if len(cells) > len(header):
            raise TraceError(f"{name}:{no}", f"{len(cells)} values for {len(header)} columns.")
        out.append((f"{name}:{no}", dict(zip(header, cells + [""] * (len(header) - len(cells)),
                                             strict=True))))
    return out


def _jsonl_rows(text: str, name: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for no, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        where = f"{name}:{no}"
        try:
            row = json.loads(ln)
        except json.JSONDecodeError as e:
            raise TraceError(where, f"is not JSON ({e.msg}).",
                             'write one object per line: {"time": 0, "node": "a100-0"}.') from None
        if not isinstance(row, dict):
            raise TraceError(where, f"must be a JSON object, got {type(row).__name__}.")
        out.append((where, row))
    return out


def _number(v: Any, key: str, where: str) -> float:
    if isinstance(v, bool):
        raise TraceError(where, f"{key} must be a number of seconds, got {v!r}.")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TraceError(where, f"{key} must be a number of seconds, got {v!r}.") from None


def _check_time(t: float, where: str) -> None:
    if not (math.isfinite(t) and t >= 0):
        raise TraceError(where, f"time must be a finite number of seconds >= 0, got {t!r}.")


def _check_repair(r: float, where: str) -> None:
    if not (math.isfinite(r) and r > 0):
        raise TraceError(where, f"repair_s must be a finite number of seconds > 0, got {r!r}.",
                         "leave it empty for the simulation's default.")


def _check_kind(kind: object, where: str) -> None:
    if kind not in TRACE_KINDS:
        close = difflib.get_close_matches(str(kind), TRACE_KINDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(TRACE_KINDS)}."
        raise TraceError(where, f"unknown kind {kind!r}.", hint)


def _check_node(node: str, nodes: set[str] | None, where: str) -> None:
    if nodes is not None and node not in nodes:
        close = difflib.get_close_matches(node, sorted(nodes), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "use the cluster's node ids."
        raise TraceError(where, f"node {node!r} is not in the cluster.", hint)
