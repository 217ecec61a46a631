"""A worker group without Ray: the controller's loop driven step by step in one process.

``FakeGroup`` implements the methods of ``elastic.control.worker_group.WorkerGroup`` over
fake workers that hold no model: each knows its data position and which canonical keys it
holds whole (all of them under ``dp``; the model and its own share of the optimizer entries
under the sharded layouts), so the controller's choices (recover from peers or not, which
step) follow from the same facts as on Ray. Failures are scripted as return values: ``fail``
makes a segment that reaches a step report a lost worker, a user error or a hang there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from elastic.control.group import DrainNotice, Segment, SegmentPoll, WorkerRec
from elastic.errors import GroupError, NonFiniteError, StateMoveError, WorkerError, WorkerLostError
from elastic.failures import classify

_OPTIM_ENTRIES = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class Fault:
    step: int
    rank: int
    kind: str  # "lost" | "user" | "hang" | "group" | "refused" | "nonfinite" | ...-rollback
    fired: bool = False


def _peer_error(rank: int, kind: str) -> GroupError:
    """What a peer of the failing rank reports: the same refusal where torch.distributed
    refused every rank's call alike, else the lost peer."""
    if kind != "refused":
        return GroupError(f"rank {rank}: peer gone")
    err = GroupError(f"rank {rank}: the process group failed")
    err.transport = False
    return err


@dataclass
class FakeWorker:
    """What the controller can ask a worker about its state."""

    next_step: int = 0
    has_state: bool = False
    strategy: str | None = None
    rank: int = -1
    world: int = 1
    alive: bool = True
    metrics: list[dict[str, Any]] = field(default_factory=list)
    restored_at: int | None = None  # the step of its last restore (copies_status)


class FakeGroup:
    """Fake workers for ``Controller(group_factory=...)``; see the module docstring."""

    def __init__(self, model: Any, room: int = 0) -> None:
        self.model_keys = [f"model/{k}" for k in model.state_dict()]
        # optimizers keep state for the trainable parameters only (a frozen one has none)
        self.params = [n for n, p in model.named_parameters() if p.requires_grad]
        self.block_tensors = [[p.numel() for p in b.parameters()] for b in model.children()]
        # what the workers "measure" (profile_terms) and how long their steps "take"
        self.alpha: dict[str, float] = {"all_reduce": 1e-3, "reduce": 1e-3, "broadcast": 1e-3,
                                        "all_gather": 1e-3, "reduce_scatter": 1e-3,
                                        "p2p": 1e-3}
        # strategy (or (strategy, shares)) -> measured step seconds
        self.step_times: dict[object, float] = {}
        self.phases: dict[int, float] = {}  # step -> every step's time x this from then on
        self.opt_cost = (1e-5, 1e-8)  # the optimizer's seconds per tensor, per element
        self.compute: dict[int, float] = {}  # rank -> compute seconds per sample (forward x 3)
        self.compute_from: dict[int, dict[int, float]] = {}  # step -> ``compute`` from then on
        self.block_seconds: list[float] | None = None  # profile(detail=True)'s per-block times
        self.spec: Any = None
        self.workers: list[WorkerRec] = []
        self.generation = 0
        self.room_left = room  # workers try_place / start_spares can still add
        self.spares: list[WorkerRec] = []  # started in the background, ready
        self.faults: list[Fault] = []
        self.hung: list[WorkerRec] = []
        self.calls: list[tuple[str, Any]] = []  # (method, argument) in order
        self.segment_id = 0  # the last segment started, as WorkerGroup numbers them
        self.stops: set[int] = set()  # the segments asked to stop (as StepLoop keeps them)
        self.gates: list[Any] = []
        self.checkpoint_every = 0  # the job's: steps after which the fake begins a checkpoint
        self.steps_per_poll = 1  # steps trained between two polls (live: often many)
        self.nonfinite_at: dict[int, list[str]] = {}  # checkpoint step -> keys with NaN
        # preemption notices: step reached -> (rank whose node drains, seconds left or None)
        self.announce_at: dict[int, tuple[int, float | None]] = {}
        self.draining: dict[str, DrainNotice] = {}  # node -> notice, visible to notices()
        self.copies_every = 0  # the job's peer_copies_every (the fake keeps whole copies)
        self.corrupt_copies = False  # restore_from_copies finds a checksum wrong
        self.drain_refused = ""  # what Ray says to drain_node ("": accepted)
        self.node_of: dict[int, str] = {}  # worker id -> its node (default: one of its own)
        self._ckpt: int | None = None  # the checkpoint step uploading
        self._ck_seq = 0  # checkpoints this generation has begun (their names, as the workers')
        self._ck_name: tuple[int, int] = (0, 0)  # the name of the one uploading
        self._ids = 0
        self._pos: dict[int, int] = {}  # segment -> the step it reached
        self.closed = False

    # ------------------------------------------------------------------ scripting

    def fail(self, step: int, rank: int, kind: str = "lost") -> None:
        self.faults.append(Fault(step, rank, kind))

    def _new(self) -> WorkerRec:
        wid = self._ids
        self._ids += 1
        return WorkerRec(handle=FakeWorker(), worker_id=wid,
                         info={"worker_id": wid, "node_id": self.node_of.get(wid, f"node{wid}"), "pid": 1000 + wid,
                               "device_name": "cpu", "device": "cpu", "ip": "127.0.0.1"})

    @staticmethod
    def fw(w: WorkerRec) -> FakeWorker:
        return w.handle  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ placement

    def place(self, n: int, min_workers: int) -> list[WorkerRec]:
        new = [self._new() for _ in range(n)]
        self.workers += new
        return new

    def spares_ready(self) -> int:
        return len(self.spares)

    def spares_starting(self) -> int:
        return 0

    def start_spares(self, n: int) -> None:
        k = max(0, min(n, self.room_left))
        self.room_left -= k
        self.spares += [self._new() for _ in range(k)]
        self.calls.append(("start_spares", k))

    def take_spares(self, n: int) -> list[WorkerRec]:
        took, self.spares = self.spares[:max(0, n)], self.spares[max(0, n):]
        self.workers += took
        return took

    def try_place(self, n: int, timeout_s: float) -> list[WorkerRec]:
        if n <= 0 or timeout_s <= 0:
            return []
        k = min(n, self.room_left)
        self.room_left -= k
        new = [self._new() for _ in range(k)]
        self.workers += new
        return new

    def room(self) -> bool:
        return self.room_left > 0

    def trim_slots(self, keep: int) -> int:
        return 0

    def form(self) -> tuple[str, int, float]:
        self.generation += 1
        self._ck_seq = 0  # a new group counts its checkpoints from 1, as the workers do
        for r, w in enumerate(self.workers):
            w.rank = r
            w.info["rank"] = r
            self.fw(w).rank, self.fw(w).world = r, len(self.workers)
        self.calls.append(("form", len(self.workers)))
        return "127.0.0.1", 29500 + self.generation, 0.0

    def remove(self, dead: list[WorkerRec]) -> None:
        gone = {id(w) for w in dead}
        self.workers = [w for w in self.workers if id(w) not in gone]

    def shrink(self, n: int) -> list[WorkerRec]:
        extra, self.workers = self.workers[n:], self.workers[:n]
        return extra

    def survivors(self, exclude: Any = ()) -> tuple[list[WorkerRec], list[WorkerRec]]:
        skip = {id(w) for w in exclude}
        alive = [w for w in self.workers if id(w) not in skip and self.fw(w).alive]
        return alive, [w for w in self.workers if w not in alive]

    # ------------------------------------------------------------------ segments

    def start_segment(self, start: int, end: int) -> Segment:
        self.calls.append(("segment", (start, end)))
        self.segment_id += 1  # as WorkerGroup: a stop names the last segment started
        seg = Segment(start, end, [(w, None) for w in self.workers])
        self._pos = {id(seg): start}  # only this segment runs (ids of dead ones are reused)
        return seg

    def poll_segment(self, seg: Segment, timeout_s: float) -> SegmentPoll:
        """One step per poll (so requests and ``on_step`` act as they would live): a stop
        asked ends the segment after the step in progress; a scripted fault at the step
        reached reports it."""
        for _ in range(self.steps_per_poll):
            at = self._pos.get(id(seg), seg.start)
            fault = next((f for f in self.faults if not f.fired and f.step == at
                          and f.rank < len(self.workers)), None)
            if fault is not None:  # (the steps before it in this poll: not drained yet)
                return self._fault(fault)
            self._train(at, at + 1)
            at += 1
            self._pos[id(seg)] = at
            if at in self.announce_at:  # a node announces its end once this step is done
                rank, left = self.announce_at.pop(at)
                w = self.workers[rank]
                node = str(w.info["node_id"])
                self.draining[node] = DrainNotice(node, (w.rank,), None if left is None else
                                                  time.time() + left, "preemption", "spot", 0.0)
            if at >= seg.end or self.segment_id in self.stops:
                return SegmentPoll(done=True, next_step=at)
        return SegmentPoll()

    def _fault(self, fault: Fault) -> SegmentPoll:
        fault.fired = True
        victim = self.workers[fault.rank]
        if fault.kind == "lost":
            self.fw(victim).alive = False
            err: BaseException = WorkerLostError("worker died", rank=fault.rank, node_lost=True)
        elif fault.kind == "user":
            err = WorkerError(fault.rank, "host", "ValueError: bad on purpose", "Traceback...",
                              step=fault.step)
        elif fault.kind == "hang":
            self.hung = [victim]
            err = GroupError(f"rank {(fault.rank + 1) % len(self.workers)}: timed out")
        elif fault.kind.startswith("nonfinite"):  # every rank raises at the same step
            rb = fault.kind.endswith("rollback")
            return SegmentPoll(failures=tuple(
                classify(NonFiniteError(f"non-finite loss or gradient at step {fault.step}",
                                        step=fault.step, rank=w.rank if w is victim else None,
                                        rollback=rb), w.rank) for w in self.workers))
        else:  # "group": the transport's; "refused": torch.distributed refused the call
            err = GroupError(f"rank {fault.rank}: the process group failed")
            err.transport = fault.kind != "refused"
        others = [classify(_peer_error(w.rank, fault.kind), w.rank)
                  for w in self.workers if w is not victim]
        return SegmentPoll(failures=(classify(err, fault.rank), *others))

    def _train(self, start: int, end: int) -> None:
        name = self.spec.name if self.spec is not None else "dp"
        shares = tuple(self.spec.shares) if self.spec is not None else ()
        dt = self.step_times.get((name, shares), self.step_times.get(name, 0.01))
        seqs = {}  # step -> the name (sequence number) of the checkpoint begun after it
        for s in range(start, end):
            if self.checkpoint_every and (s + 1) % self.checkpoint_every == 0:
                self._ck_seq += 1
                seqs[s] = self._ck_seq
        for w in self.workers:
            f = self.fw(w)
            if not f.alive:
                continue
            share = (self.spec.shares[w.rank] if self.spec is not None
                     and w.rank < len(self.spec.shares) else 4)
            for s in range(start, end):
                since = [k for k in self.phases if k <= s]  # the phase step s falls in
                level = self.phases[max(since)] if since else 1.0
                m = {"step": s, "rank": w.rank, "loss": 1.0 / (s + 1),
                     "step_time": dt * level, "samples": share, "samples_per_s": 400.0,
                     "time": 0.0, "generation": self.generation,
                     "global_samples": 4 * len(self.workers),
                     "compute_s": self._compute(s).get(w.rank, 1e-3) * share / 3
                     * self._blocks_share(w.rank)}
                if s in seqs:
                    m.update(checkpoint_begun=s + 1, checkpoint_blocked_s=0.001,
                             checkpoint_seq=seqs[s])
                    self._ckpt, self._ck_name = s + 1, (self.generation, seqs[s])
                f.metrics.append(m)
            f.next_step = max(f.next_step, end)

    def wind_down(self, seg: Segment, timeout_s: float) -> list[WorkerRec]:
        hung, self.hung = self.hung, []
        return hung

    def request_stop(self, urgent: bool = False) -> None:
        self.stops.add(self.segment_id)
        self.calls.append(("request_stop", urgent))

    def send_gate(self, gate: Any) -> None:
        self.gates.append(gate)
        self.calls.append(("gate", gate.version))

    def drain(self) -> list[list[dict[str, Any]]]:
        out = []
        for w in self.workers:
            f = self.fw(w)
            out.append(f.metrics)
            f.metrics = []
        return out

    # ------------------------------------------------------------------ typed calls

    def build(self, spec: Any) -> list[dict[str, Any]]:
        self.calls.append(("build", spec.name))
        self.spec = spec
        for w in self.workers:
            f = self.fw(w)
            f.has_state, f.strategy = True, spec.name
        return [{"seconds": 0.0, "hash_before": "h", "hash_after": "h", "check": "pieces",
                 "move": "reshard", "bytes_sent": 0} for _ in self.workers]

    def memory_counts(self, timeout_s: float | None = None) -> list[dict[str, int]]:
        self.calls.append(("memory_counts", timeout_s))
        return [{"params": 1, "grads": 1, "optim": 1} for _ in self.workers]

    def _blocks_share(self, rank: int) -> float:
        """A pipeline rank's blocks over an even split's (its compute follows its blocks)."""
        sp = self.spec
        if sp is None or sp.name != "pipeline" or not sp.stage_split:
            return 1.0
        pos = rank // (sp.world_size // sp.pp_degree)
        mine = sum(b for k, b in enumerate(sp.stage_split) if k % sp.pp_degree == pos)
        return mine * sp.pp_degree / sum(sp.stage_split)

    def _compute(self, step: int) -> dict[int, float]:
        since = [k for k in self.compute_from if k <= step]
        return self.compute_from[max(since)] if since else self.compute

    def profile(self, batch: int, detail: bool = False, workers: Any = None) -> list[Any]:
        out: dict[str, Any] = {"samples_per_s": 100.0}
        if detail and self.block_seconds is not None:
            out["block_seconds"] = list(self.block_seconds)
        return [dict(out) for _ in (workers or self.workers)]

    def profile_terms(self, shares: list[int], rounds: int = 7) -> list[dict[str, Any]]:
        """Every rank's report as ``elastic.worker.measure.profile_terms`` gives it, from ``alpha``
        (per collective kind, beta 1 ns/byte), ``compute`` (per rank; 1 ms per sample) and an
        optimizer of ``opt_cost`` (10 us per tensor + 10 ns per element); the trial dp step
        is what that model predicts plus 1 ms."""
        from clusters.collectives import assign_owners, latency_hops, volume_factor

        n = len(self.workers)
        pt, pe = self.opt_cost
        tensors = [t for b in self.block_tensors for t in b]
        owner = assign_owners(tensors, n)
        out = []
        for r in range(n):
            c = self.compute.get(r, 1e-3)
            b = int(shares[r])
            own = [t for t, o in zip(tensors, owner, strict=True) if o == r]
            coll = {k: [[nb, [latency_hops(k, 2 if k == "p2p" else n) * a
                              + volume_factor(k, 2 if k == "p2p" else n) * nb * 1e-9] * rounds]
                        for nb in (4 << 10, 256 << 10, 4 << 20)] for k, a in self.alpha.items()}
            total = sum(tensors)
            out.append({
                "rank": r, "world": n,
                "compute": {"batches": [b, max(1, b // 4)],
                            "seconds": [[c * b] * rounds, [c * max(1, b // 4)] * rounds],
                            "forward": [c * b / 3] * rounds},
                "blocks": {"batch": b, "seconds": [[c * b * sum(t) / total] * rounds
                                                   for t in self.block_tensors],
                           "boundary_bytes": [64.0] * len(self.block_tensors),
                           "tensors": self.block_tensors},
                "optimizer": {"plain": [[len(tensors), total, [pt * len(tensors)
                                                               + pe * total] * rounds],
                                        [len(own), sum(own), [pt * len(own)
                                                              + pe * sum(own)] * rounds]],
                              "sharded": [len(tensors), total / n,
                                          [2 * pt * len(tensors) + pe * total / n] * rounds]},
                "collectives": coll,
            })
        # the trial dp step: the terms of the slowest rank + 1 ms (its per-step overhead)
        ar = self.alpha["all_reduce"] * 2 * (n - 1) + 8 * sum(tensors) * 1e-9 * (n - 1) / n
        trial = (max(self.compute.get(r, 1e-3) * int(shares[r]) for r in range(n)) + ar
                 + pt * len(tensors) + pe * sum(tensors) + 1e-3)
        for rep in out:
            rep["trial"] = {"shares": list(shares), "seconds": [trial] * rounds}
        return out

    def progress(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        return [{"next_step": self.fw(w).next_step, "has_state": self.fw(w).has_state,
                 "strategy": self.fw(w).strategy, "pending_update": False}
                for w in self.workers]

    def held_keys(self) -> list[dict[str, Any]]:
        out = []
        for w in self.workers:
            f = self.fw(w)
            optim = [f"optim/{p}/{e}" for i, p in enumerate(self.params)
                     for e in _OPTIM_ENTRIES
                     if f.strategy == "dp" or f.strategy == "full" or i % f.world == f.rank]
            keys = (self.model_keys + optim) if f.has_state and f.next_step > 0 else (
                self.model_keys if f.has_state else [])
            out.append({k: ((1,), "float32") for k in keys})
        return out

    def leave(self, workers: Any = None, collect: bool = True) -> None:
        self.calls.append(("leave", len(workers) if workers is not None else len(self.workers)))

    def snapshot_full(self) -> None:
        for w in self.workers:
            self.fw(w).strategy = "full"

    def finish_pending_step(self, workers: Any) -> None:
        pass

    def restore_from_peers(self, spec: Any, plan: Any, step: int) -> list[dict[str, Any]]:
        self.calls.append(("restore_from_peers", step))
        self._set(spec, step)
        return [{"bytes": 1000} for _ in self.workers]

    def restore_checkpoint(self, spec: Any, step: int, store: Any = None) -> list[Any]:
        self.calls.append(("restore_checkpoint", step))
        self._set(spec, step)
        return [{"seconds": 0.0, "bytes": 10, "total_bytes": 20} for _ in self.workers]

    def restart_fresh(self, spec: Any) -> None:
        self.calls.append(("restart_fresh", 0))
        self._set(spec, 0)

    def _set(self, spec: Any, step: int) -> None:
        self.spec = spec
        for w in self.workers:
            f = self.fw(w)
            f.has_state, f.strategy, f.next_step = True, spec.name, step
            f.restored_at = step

    def checkpoint_poll(self) -> list[Any]:
        """Each rank's upload: done at once, naming the keys scripted as non-finite."""
        if self._ckpt is None:
            return [None for _ in self.workers]
        step, bad = self._ckpt, self.nonfinite_at.get(self._ckpt, [])
        return [{"info": {"step": step, "rank": w.rank, "path": f"shard-{w.rank:05d}.bin",
                          "size": 1, "checksum": "0" * 64, "index_offset": 0,
                          "index_length": 0, "items": 0, "data_bytes": 0,
                          "nonfinite": list(bad) if w.rank == 0 else []}}
                for w in self.workers]

    def checkpoint_now(self) -> list[dict[str, Any]]:
        """Begins a checkpoint of the step the workers are at (skipped while one uploads)."""
        step = self.fw(self.workers[0]).next_step
        self.calls.append(("checkpoint_now", step))
        if self._ckpt is not None:
            return [{"checkpoint_skipped": step, "rank": w.rank, "generation": self.generation}
                    for w in self.workers]
        self._ck_seq += 1
        self._ckpt, self._ck_name = step, (self.generation, self._ck_seq)
        return [{"checkpoint_begun": step, "checkpoint_blocked_s": 0.001, "rank": w.rank,
                 "generation": self.generation, "checkpoint_seq": self._ck_seq}
                for w in self.workers]

    def checkpoint_done(self, step: int, committed: bool, generation: int | None = None,
                        seq: int | None = None) -> None:
        self.calls.append(("checkpoint_done", (step, committed)))
        if (step, generation, seq) == (self._ckpt, *self._ck_name) or generation is None:
            self._ckpt = None  # a word acts only on the checkpoint it names, as on a worker

    def final_state(self) -> dict[str, Any]:
        return {"model/final": self.fw(self.workers[0]).next_step}

    # ------------------------------------------------------------------ notices, evacuation

    def notices(self) -> list[DrainNotice]:
        hosts = {str(w.info["node_id"]) for w in self.workers}
        return [n for node, n in self.draining.items() if node in hosts]

    def drain_node(self, node_id: str, deadline_s: float | None, message: str) -> str:
        self.calls.append(("drain_node", (node_id, deadline_s)))
        return self.drain_refused

    def release(self, workers: list[WorkerRec]) -> None:
        self.calls.append(("release", [w.rank for w in workers]))
        gone = {id(w) for w in workers}
        self.workers = [w for w in self.workers if id(w) not in gone]

    def hand_off(self, leaving: list[int]) -> list[dict[str, Any]]:
        self.calls.append(("hand_off", list(leaving)))
        return [{"bytes_sent": 100 if w.rank in leaving else 0,
                 "bytes_received": 0 if w.rank in leaving else 50, "pieces": 1,
                 "seconds": 0.001} for w in self.workers]

    def restore_from_pieces(self, spec: Any, step: int) -> list[dict[str, Any]]:
        self.calls.append(("restore_from_pieces", step))
        self._set(spec, step)
        return [{"seconds": 0.0, "bytes_sent": 10, "hash_before": "a", "hash_after": "a"}
                for _ in self.workers]

    def copies_status(self) -> list[dict[str, Any]]:
        """Every survivor holds a whole copy of the state at its newest copy step (the real
        coverage rules are tested on ``buddy_step`` itself). As on a worker, a restore drops
        the old ring's copies and takes the restored step's before it returns
        (``PeerCopies.restored``); then the first step boundary's (settled a step later)
        and every multiple of k reached."""
        out = []
        for w in self.workers:
            f = self.fw(w)
            if not self.copies_every or not f.has_state:
                out.append({"steps": {}})
                continue
            g = f.next_step // self.copies_every * self.copies_every
            r = f.restored_at
            if r is not None and g <= r:  # none since the restore but its own (and the next)
                g = r + 1 if f.next_step >= r + 2 else r
            keys = self.model_keys + [f"optim/{p}/{e}" for p in self.params
                                      for e in _OPTIM_ENTRIES]
            out.append({"steps": {g: [(k, (1,), None) for k in keys]} if g > 0 else {}})
        return out

    def restore_from_copies(self, spec: Any, step: int) -> list[dict[str, Any]]:
        self.calls.append(("restore_from_copies", step))
        if self.corrupt_copies:
            raise StateMoveError("the copy of rank 1's state held by rank 0 does not match "
                                 "its checksum")
        self._set(spec, step)
        return [{"bytes_sent": 10} for _ in self.workers]

    def close(self) -> None:
        self.closed = True
        self.workers = []
