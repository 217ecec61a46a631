"""Warm workers: the pool's decisions, ``PoolPolicy.decide(observation) -> decision`` (pure).

A pool keeps worker processes that are already up (torch imported, the process group's
machinery loaded, on a GPU host CUDA initialised) between jobs, so a job's or a trial's first
step does not wait for processes to start. Each decision observes the idle workers, the
workers coming back from a job (with what their reset reported), what a job asks for, and
how many bundles the cluster has free, and returns which idle workers to hand out, which
returned ones to keep, which workers to retire (and why), and how many new ones to start.
The live pool (``elastic.control.pool``) carries it out; nothing here imports torch or Ray
or reads a clock (``PoolObservation.now_s`` is given).

Rules:

* a worker is shared only between jobs of the same ``PoolKey``: resource shape, device kind
  and runtime environment (a worker's process was started with them);
* a worker on a draining node (a preemption or maintenance notice: Ray places nothing new
  there, and the node goes at its deadline) is retired, idle or returned, never handed out:
  a job given it would only have to evacuate it;
* a dead worker, one whose reset failed, one whose job failed in *user code*, one that still
  runs threads its job started, and one that served ``max_jobs`` jobs are retired, never
  kept. A user error is retired rather than reset because the process may hold what a
  reset cannot undo: a sticky CUDA error (every later CUDA call fails), a library the user's
  code patched, a half-imported module. A job that failed for an infrastructure reason (a
  peer lost) leaves its healthy workers clean: they are reset and kept;
* a job takes idle workers of its key, most on one node first (its ranks talk over local
  sockets), then the most recently returned (its memory is warm); what is missing starts
  cold, and idle workers of *other* keys are retired, longest idle first, when the cluster
  has no free bundle for it (bundles that earlier hand-outs left other jobs to start cold in
  count as taken: two jobs asking at once both saw the one free bundle, and the second waited
  for it until its placement timed out; a job's bundles stay counted there from its
  hand-out until its workers are up, so for that while a bundle already reserved counts
  twice, and at worst an idle worker more than needed is retired); room is counted in
  resources, node by node, not in workers: a job of 4-CPU bundles short of one needs four
  1-CPU workers of one node retired (fewer where that node has CPUs free), on the node
  where the fewest must go; four CPUs freed on four nodes host no 4-CPU bundle; and what a
  node has free is not lacking there (a GPU job lacks the GPU, not the CPU beside it), so
  a worker that holds none of what the job lacks is not retired for it. What this pool
  cannot free is ``room_short`` (a resource amount: beyond the free totals, else whole
  bundles), and the pool asks the other pools of its process for it, which count it in
  totals, not per node;
* a pool asked to make ``room`` (resources) for a job of another pool of the same process
  retires idle workers that hold some of it, longest idle first, of any key, until it is
  covered (what it could not cover is its ``room_short``): a job waiting for resources comes
  before a cache of processes (a sweep's trials waited 60 s and failed while the session's
  default pool kept every CPU idle); it then starts no refill while ``room_held`` (the
  live pool holds it for a placement timeout, ``ROOM_HOLD_S``), or the refill could take
  the room back before the job asks for its bundles;
* at most ``max_idle`` workers are kept idle (other keys' and the pool's own beyond
  ``min_idle`` go first, the longest idle first), and none idle longer than
  ``idle_timeout_s``, except the ``min_idle`` of the pool's own key (retiring those would
  only start them again);
* ``min_idle`` workers of the pool's own key are kept started ahead of demand, while the
  pool's workers (idle, lent and starting) stay within ``max_total``, and not while a job
  is placing the workers a hand-out left it to start cold (they need the room).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DRAINING = "its node is draining (a preemption or maintenance notice)"
ROOM = "room for a job of another pool"
ROOM_HOLD_S = 60.0  # no refill this long after making room (a job's default placement timeout)

__all__ = ["DRAINING", "ROOM", "ROOM_HOLD_S", "PoolKey", "IdleWorker", "Returned", "Want",
           "PoolObservation", "PoolDecision", "PoolPolicy", "Room", "room_of", "fitting"]

Room = tuple[tuple[str, float], ...]  # resource amounts (name, amount > 0), sorted by name


@dataclass(frozen=True, order=True)
class PoolKey:
    """What a worker process was started with; only jobs of the same key may share it."""

    resources: tuple[tuple[str, float], ...]
    gpu: bool = False
    env: str = "{}"  # the runtime environment, canonical JSON

    @staticmethod
    def of(resources: Mapping[str, float], gpu: bool,
           runtime_env: Mapping[str, Any] | None = None) -> PoolKey:
        """The key of a bundle of ``resources`` (zero amounts dropped), GPU or not, in
        ``runtime_env`` (None and {} are the same environment)."""
        res = tuple(sorted((str(k), float(v)) for k, v in resources.items() if v))
        env = json.dumps(dict(runtime_env or {}), sort_keys=True, default=str)
        return PoolKey(res, bool(gpu), env)

    def describe(self) -> str:
        res = ", ".join(f"{k}={v:g}" for k, v in self.resources)
        env = "" if self.env == "{}" else f", env {self.env}"
        return f"{{{res}}}{' gpu' if self.gpu else ''}{env}"


@dataclass(frozen=True)
class IdleWorker:
    """A worker in the pool: ``alive`` as last seen, idle since ``idle_since_s``."""

    id: int
    key: PoolKey
    node: str
    idle_since_s: float
    jobs: int = 0
    alive: bool = True


@dataclass(frozen=True)
class Returned:
    """A worker coming back from a job, with what its reset said (``reset_ok`` False when
    the reset failed or did not answer)."""

    id: int
    key: PoolKey
    node: str
    alive: bool = True
    reset_ok: bool = True
    user_error: bool = False
    leaked_threads: int = 0
    jobs: int = 1
    segment_ran: bool = False  # a training segment still ran at its reset, its group gone
    cuda_left: int = 0  # GPU bytes still allocated past the process's own at its start


@dataclass(frozen=True)
class Want:
    """A job asks for ``n`` workers of ``key``; ``free_bundles``: how many more bundles of
    its shape the cluster has free now (for the workers that must start cold); ``free``: each
    node's free resources, ``(node, Room)`` pairs (None: not known)."""

    key: PoolKey
    n: int
    free_bundles: int = 0
    free: tuple[tuple[str, Room], ...] | None = None


@dataclass(frozen=True)
class PoolObservation:
    now_s: float
    idle: tuple[IdleWorker, ...] = ()
    returned: tuple[Returned, ...] = ()
    want: Want | None = None
    lent: int = 0  # workers out with jobs
    starting: int = 0  # of the pool's own key, not up yet
    draining: frozenset[str] = frozenset()  # ids of the nodes Ray is draining
    # workers jobs were told to start cold by earlier hand-outs and have not placed yet
    cold_pending: int = 0
    # resources a job of another pool of this process is short of: idle workers to retire
    room: Room = ()
    # this pool made room for another pool's job lately: its refill would take it back
    room_held: bool = False


@dataclass(frozen=True)
class PoolDecision:
    hand_out: tuple[int, ...] = ()
    keep: tuple[int, ...] = ()  # returned workers kept (now idle)
    retire: tuple[tuple[int, str], ...] = ()  # (worker id, why)
    start: int = 0  # new workers of the pool's own key
    reasons: tuple[str, ...] = field(default=())
    # resources the wanting job (or the job ``room`` was asked for) still lacks after this
    # pool's retirements: the other pools' turn
    room_short: Room = ()

    def retired(self) -> dict[int, str]:
        return dict(self.retire)


class PoolPolicy:
    """The pool's rules (see the module docstring). ``key``: the pool's own key, which
    ``min_idle`` workers are started ahead of demand for; ``max_total`` None: no bound."""

    def __init__(self, key: PoolKey, *, min_idle: int = 0, max_idle: int = 8,
                 max_total: int | None = None, idle_timeout_s: float = 600.0,
                 max_jobs: int = 100) -> None:
        if min_idle < 0 or max_idle < 0 or max_jobs < 1:
            raise ValueError("min_idle and max_idle must be >= 0 and max_jobs >= 1")
        self.key = key
        self.min_idle = min_idle
        self.max_idle = max(max_idle, min_idle)
        self.max_total = max_total
        self.idle_timeout_s = idle_timeout_s
        self.max_jobs = max_jobs
        self.cuda_left_ok = 64 * 2**20  # GPU bytes a returned worker may hold past its start

    def _returned_verdict(self, r: Returned, draining: frozenset[str]) -> str | None:
        """Why a returned worker is retired, or None to keep it."""
        if not r.alive:
            return "died in its job"
        if r.node in draining:
            return DRAINING
        if r.user_error:
            return "its job failed in user code (the process may be left inconsistent)"
        if not r.reset_ok:
            return "its reset failed"
        if r.leaked_threads:
            return f"{r.leaked_threads} thread(s) its job started still run"
        if r.segment_ran:  # its old step would err into the next job, or hold a thread
            return "a training segment of its job still ran"
        if r.cuda_left > self.cuda_left_ok:  # a tensor kept alive (a module global, a
            # cycle through a C++ object): the next job would have that much less memory
            return "its job left memory allocated on the GPU"
        if r.jobs >= self.max_jobs:
            return f"served {r.jobs} jobs (max_jobs)"
        return None

    def decide(self, obs: PoolObservation) -> PoolDecision:
        retire: list[tuple[int, str]] = []
        idle: list[IdleWorker] = []
        expired: list[IdleWorker] = []
        for w in obs.idle:
            if not w.alive:
                retire.append((w.id, "died while idle"))
            elif w.node in obs.draining:
                retire.append((w.id, DRAINING))
            elif obs.now_s - w.idle_since_s > self.idle_timeout_s:
                expired.append(w)
            else:
                idle.append(w)
        # the pool's own min_idle stay however long they idle (the most recent first)
        spare = max(0, self.min_idle - sum(1 for w in idle if w.key == self.key))
        stay = sorted((w for w in expired if w.key == self.key),
                      key=lambda w: (-w.idle_since_s, w.id))[:spare]
        idle += stay
        retire += [(w.id, f"idle for more than {self.idle_timeout_s:g}s")
                   for w in expired if w not in stay]
        keep: list[int] = []
        for r in obs.returned:
            why = self._returned_verdict(r, obs.draining)
            if why is None:
                keep.append(r.id)
                idle.append(IdleWorker(r.id, r.key, r.node, obs.now_s, r.jobs))
            else:
                retire.append((r.id, why))
        hand: list[int] = []
        reasons: list[str] = []
        cold = 0
        room_short: Room = ()
        if obs.want is not None and obs.want.n > 0:
            hand = self._pick(idle, obs.want.key, obs.want.n)
            idle = [w for w in idle if w.id not in hand]
            cold = obs.want.n - len(hand)
            short = cold - max(obs.want.free_bundles - obs.cold_pending, 0)
            if short > 0:  # room for the cold ones: other keys' idle workers go first
                others, room_short = _make_room([w for w in idle if w.key != obs.want.key],
                                                obs.want, cold, short, obs.cold_pending)
                retire += [(w.id, f"room for a job of {obs.want.key.describe()}")
                           for w in others]
                idle = [w for w in idle if w not in others]
            reasons.append(f"{len(hand)} warm, {cold} cold for {obs.want.key.describe()}")
        if obs.room:  # another pool's job waits for resources these idle workers hold
            freed, room_short = _free(idle, obs.room)
            retire += [(w.id, ROOM) for w in freed]
            idle = [w for w in idle if w not in freed]
            reasons.append(f"{len(freed)} retired for another pool's job short of "
                           f"{_describe(obs.room)}")
        if len(idle) > self.max_idle:
            over = self._over(idle, len(idle) - self.max_idle)
            retire += [(w.id, f"more than max_idle={self.max_idle} idle") for w in over]
            idle = [w for w in idle if w not in over]
        own = sum(1 for w in idle if w.key == self.key)
        start = max(0, self.min_idle - own - obs.starting)
        if self.max_total is not None:
            total = len(idle) + obs.lent + len(hand) + cold + obs.starting
            start = max(0, min(start, self.max_total - total))
        if start and cold and obs.want is not None:
            # the job starts `cold` workers now: a refill must leave them the room they need
            # (a pool of 2 warm on 3 CPUs took the last one, and a 3-worker job failed)
            free = obs.want.free_bundles - cold if obs.want.key == self.key else 0
            if free < start:
                reasons.append(f"refill {max(free, 0)} of {start}: {cold} start cold")
                start = max(free, 0)
        if start and (obs.cold_pending > 0 or obs.room or obs.room_held):
            # an earlier hand-out left a job to start workers cold, or another pool's job
            # waits for room (or was given room lately, ``room_held``: it may still be
            # waiting for its warm workers before it asks for the bundles): a refill now
            # would take the room they are about to be placed in
            reasons.append(f"refill waits: {obs.cold_pending} start cold for a job")
            start = 0
        if start:
            reasons.append(f"start {start} to keep {self.min_idle} warm")
        return PoolDecision(tuple(hand), tuple(keep), tuple(retire), start, tuple(reasons),
                            room_short)

    def _over(self, idle: list[IdleWorker], n: int) -> list[IdleWorker]:
        """The ``n`` idle workers ``max_idle`` retires: other keys' and the pool's own beyond
        ``min_idle`` (its most recent stay), longest idle first, before its ``min_idle``.
        Was: the longest idle of any key, so the pool's own warm workers (spared by the idle
        timeout, so the longest idle) went while another key's returned worker stayed, and
        were started again (at ``max_total``, not: the pool ran cold)."""
        own = sorted((w for w in idle if w.key == self.key),
                     key=lambda w: (-w.idle_since_s, w.id))
        warm = {w.id for w in own[:self.min_idle]}
        return sorted(idle, key=lambda w: (w.id in warm, w.idle_since_s, w.id))[:max(n, 0)]

    @staticmethod
    def _pick(idle: list[IdleWorker], key: PoolKey, n: int) -> list[int]:
        """Up to ``n`` idle workers of ``key``: from the node with the most of them first,
        then the most recently returned."""
        match = [w for w in idle if w.key == key]
        per_node: dict[str, int] = {}
        for w in match:
            per_node[w.node] = per_node.get(w.node, 0) + 1
        match.sort(key=lambda w: (-per_node[w.node], w.node, -w.idle_since_s, w.id))
        return [w.id for w in match[:n]]


def _by_idle(idle: list[IdleWorker]) -> list[IdleWorker]:
    """``idle``, the longest idle first (the first to retire)."""
    return sorted(idle, key=lambda w: (w.idle_since_s, w.id))


def room_of(key: PoolKey, bundles: int) -> Room:
    """The resources of ``bundles`` bundles of ``key``'s shape."""
    return tuple((r, a * bundles) for r, a in key.resources if a * bundles > 0)


def fitting(key: PoolKey, free: tuple[tuple[str, Room], ...]) -> int:
    """How many bundles of ``key``'s shape the nodes' ``free`` resources hold, node by node."""
    shape = [(r, a) for r, a in key.resources if a > 0]
    if not shape:
        return 0
    return sum(int(min((dict(room).get(r, 0.0) + 1e-9) // a for r, a in shape))
               for _, room in free)


def _make_room(cands: list[IdleWorker], want: Want, cold: int, short: int, pending: int
               ) -> tuple[list[IdleWorker], Room]:
    """Idle workers of ``cands`` to retire so that ``short`` more bundles of ``want.key``
    fit, and what is still lacking (the other pools' turn). Node by node when each node's
    free resources are known: the bundles that fit now are claimed first (``pending`` left
    to earlier cold starts, then this job's own ``cold - short``, counted in this shape),
    then each missing bundle goes where the fewest idle workers, longest idle first, must
    go for it to fit; a worker holding nothing the node lacks for it stays (a GPU job whose
    CPUs are free retires no CPU-only worker). Else from the free totals (``_free``)."""
    if want.free is None:
        return _free(cands, room_of(want.key, short))
    shape = dict(want.key.resources)
    free = {n: dict(room) for n, room in want.free}

    def fits(f: dict[str, float]) -> bool:
        return all(f.get(r, 0.0) + 1e-9 >= a for r, a in shape.items())

    def claim(f: dict[str, float]) -> None:
        for r, a in shape.items():
            f[r] = f.get(r, 0.0) - a

    for _ in range(pending + cold - short):
        node = next((n for n in sorted(free) if fits(free[n])), None)
        if node is None:
            break
        claim(free[node])
    by_node: dict[str, list[IdleWorker]] = {}
    for w in _by_idle(cands):
        by_node.setdefault(w.node, []).append(w)
    out: list[IdleWorker] = []
    placed = 0
    for _ in range(short):
        best: tuple[str, list[IdleWorker], dict[str, float]] | None = None
        for node in sorted(set(free) | set(by_node)):
            f = dict(free.get(node, {}))
            picks: list[IdleWorker] = []
            for w in by_node.get(node, []):
                if fits(f):
                    break
                held = dict(w.key.resources)
                if any(held.get(r, 0.0) > 0 and f.get(r, 0.0) + 1e-9 < a
                       for r, a in shape.items()):
                    picks.append(w)
                    for r, v in held.items():
                        f[r] = f.get(r, 0.0) + v
            if fits(f) and (best is None or len(picks) < len(best[1])):
                best = (node, picks, f)
        if best is None:
            break
        node, picks, f = best
        claim(f)
        free[node] = f
        by_node[node] = [w for w in by_node.get(node, []) if w not in picks]
        out += picks
        placed += 1
    left = short - placed
    if left <= 0:
        return out, ()
    total = {r: sum(max(0.0, f.get(r, 0.0)) for f in free.values()) for r in shape}
    lacking = tuple((r, v) for r, a in want.key.resources
                    if (v := left * a - total[r]) > 1e-9)
    # free enough in total but on no one node: whole bundles are lacking
    return out, lacking or room_of(want.key, left)


def _free(idle: list[IdleWorker], need: Room) -> tuple[list[IdleWorker], Room]:
    """Idle workers to retire, longest idle first, that together free ``need``: each holds
    some resource still lacking (one that holds none of it would free nothing the job can
    use). Returns them and what is still lacking after them."""
    left = dict(need)
    out: list[IdleWorker] = []
    for w in _by_idle(idle):
        if all(v <= 1e-9 for v in left.values()):
            break
        held = dict(w.key.resources)
        if not any(held.get(r, 0.0) > 0 and v > 1e-9 for r, v in left.items()):
            continue
        out.append(w)
        for r in left:
            left[r] -= held.get(r, 0.0)
    return out, tuple((r, v) for r, v in sorted(left.items()) if v > 1e-9)


def _describe(room: Room) -> str:
    return "{" + ", ".join(f"{r}={v:g}" for r, v in room) + "}"
