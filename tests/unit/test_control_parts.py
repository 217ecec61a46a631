"""The controller's pure parts: restore planning, requests and the inbox."""

from __future__ import annotations

import functools
import pickle
import queue
from typing import Any

import pytest

from elastic.control.hooks import StepHook
from elastic.control.regroup import peer_plan, required_keys, roll_forward_ranks
from elastic.control.requests import Inbox, Request, RequestError, parse
from elastic.errors import (
    CheckpointCorruptError,
    ElasticError,
    GroupError,
    HangError,
    WorkerError,
    WorkerLostError,
)
from elastic.failures import FailureKind, classify, root_cause, worker_error


def _held(keys):
    return {k: ((2,), "float32") for k in keys}


def test_required_keys_cover_model_and_every_optimizer_entry_seen():
    need = required_keys(["w", "b"], ["w", "b"], [_held(["optim/w/exp_avg", "optim/b/step"])])
    assert need == {"model/w", "model/b", "optim/w/exp_avg", "optim/b/exp_avg", "optim/w/step",
                    "optim/b/step"}


def test_peer_plan_needs_a_holder_of_every_key_at_the_newest_step():
    need = {"model/w", "optim/w/exp_avg"}
    prog = [{"next_step": 5, "has_state": True}, {"next_step": 5, "has_state": True}]
    # a dp replica holds everything: rank 0 is the source of every key
    step, plan = peer_plan(prog, [_held(need), _held(need)], need)
    assert step == 5 and {src for _, src, _, _ in plan} == {0}
    # ZeRO-like: the optimizer entry only on the lost rank -> no plan
    assert peer_plan(prog, [_held({"model/w"}), _held({"model/w"})], need) is None
    # the only full holder is behind -> no plan at the newest step
    behind = [{"next_step": 5, "has_state": True}, {"next_step": 4, "has_state": True}]
    assert peer_plan(behind, [_held({"model/w"}), _held(need)], need) is None


def test_roll_forward_picks_survivors_one_step_behind_with_a_pending_update():
    prog = [{"next_step": 6}, {"next_step": 5, "pending_update": True},
            {"next_step": 5, "pending_update": False}]
    assert roll_forward_ranks(prog) == ([1], 5)


@pytest.mark.parametrize("kind,value,ok", [
    ("scale", 3, 3), ("scale", "4", 4), ("switch", " zero3 ", "zero3"), ("stop", None, None),
    ("scale", "abc", None), ("scale", None, None), ("scale", 2.9, None), ("scale", True, None),
    ("scale", 0, None), ("switch", 7, None), ("switch", "", None), ("explode", None, None),
    ("stop", 5, None), ("grow", None, None)])
def test_requests_are_checked_where_they_enter(kind, value, ok):
    if ok is None and not (kind == "stop" and value is None):
        with pytest.raises(RequestError):
            parse(kind, value)
    else:
        assert parse(kind, value).value == ok


def test_inbox_answers_a_malformed_request_at_once():
    inbox = Inbox(None, lambda *a, **k: None)
    q: queue.Queue = queue.Queue()
    assert not inbox.post(Request("scale", "abc", reply=q))
    assert isinstance(q.get_nowait(), RequestError) and not inbox.waiting()
    assert inbox.post(Request("grow"))  # the controller's own kind
    assert inbox.has("grow") and inbox.take().kind == "grow" and inbox.take() is None


def test_a_request_posted_after_the_job_ended_is_answered_at_once():
    """A scheduler's shrink posted as its job finished waited out its 300 s timeout (the
    scheduler's loop with it): queued after the end's drain, nobody was left to answer."""
    inbox = Inbox(None, lambda *a, **k: None)
    early: queue.Queue = queue.Queue()
    assert inbox.post(Request("scale", 2, reply=early))
    ended = ElasticError("the job ended (finished) before the request was handled")
    inbox.close(ended, {})
    assert early.get_nowait() is ended
    late: queue.Queue = queue.Queue()
    assert not inbox.post(Request("scale", 1, reply=late))
    assert late.get_nowait() is ended and not inbox.waiting()


def test_failures_are_classified_by_type_and_the_root_cause_explains_the_rest():
    lost = classify(WorkerLostError("gone", rank=2, node_lost=True))
    group = classify(GroupError("rank 0: peer gone"), rank=0)
    user = classify(WorkerError(1, "h", "ValueError: x", "tb"))
    assert lost.kind is FailureKind.NODE_LOST and lost.rank == 2 and lost.recoverable
    assert user.kind is FailureKind.USER_CODE and not user.recoverable
    assert classify(HangError("h")).kind is FailureKind.HANG
    assert classify(CheckpointCorruptError("crc")).kind is FailureKind.CORRUPT_CHECKPOINT
    assert classify(RuntimeError("store timed out")).kind is FailureKind.INTERNAL  # no text
    assert root_cause([group, user]) is user
    assert root_cause([group, user, lost]) is lost


def test_the_worker_boundary_types_errors_by_where_they_were_raised():
    import torch.distributed as dist

    from strategies import health

    try:
        raise ValueError("a timeout in the user's store")  # words that fooled text matching
    except ValueError as e:
        assert isinstance(worker_error(e, 1), WorkerError)
    try:
        dist.all_reduce(__import__("torch").ones(1))  # no group: raised inside torch.distributed
    except Exception as e:  # noqa: BLE001
        err = worker_error(e, 0)
        # refused by torch.distributed's own code (a plain exception, nothing recorded): not
        # the transport's, so a recovery that meets it again at the same step ends the job
        assert isinstance(err, GroupError) and err.transport is False
        assert pickle.loads(pickle.dumps(err)).transport is False  # as Ray carries it
    health.record("all-reduce failed")
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            err = worker_error(e, 0, health.failed())
            assert isinstance(err, GroupError) and err.transport is True
    finally:
        health.reset()
    try:
        raise TimeoutError("no answer")
    except TimeoutError as e:
        assert worker_error(e, 0).transport is True  # type: ignore[attr-defined]


def _raise_in(*modules: str) -> BaseException:
    """gloo's error raised through frames of ``modules`` (outermost first), the innermost
    raising it, as torch's C++ does below its last Python frame."""
    inner = None
    for i, mod in enumerate(reversed(modules)):
        body = ("raise RuntimeError('[gloo/transport/tcp/pair.cc:534] Connection reset by "
                "peer')") if i == 0 else "return inner()"
        ns: dict = {"__name__": mod}
        exec(compile(f"def call(inner):\n    {body}\n", mod.replace(".", "/") + ".py",
                     "exec"), ns)  # noqa: S102
        inner = functools.partial(ns["call"], inner)  # no frame of its own
    try:
        inner()
    except RuntimeError as e:
        return e
    raise AssertionError("nothing raised")


def test_a_functional_collectives_failure_past_torchs_dispatch_is_the_groups():
    """zero3's final state: a DTensor's full_tensor() fails inside torch._ops, called from
    torch.distributed's functional collectives (a worker lost then). The group's failure,
    not the user's code (was: a finished job failed as 'user code failed'); a user's own
    torch.ops call failing is still the user's."""
    funcol = _raise_in("mymodel", "torch.distributed._functional_collectives", "torch._ops",
                       "torch._library.autograd", "torch._ops")
    assert isinstance(worker_error(funcol, 0), GroupError)
    users = _raise_in("torch.distributed.tensor._api", "mymodel", "torch._ops")
    assert isinstance(worker_error(users, 0), WorkerError)
    assert isinstance(worker_error(_raise_in("mymodel", "torch._ops"), 0), WorkerError)


def test_run_logs_are_strict_json(tmp_path):
    import json

    from elastic.events import Event, RunLog

    log = RunLog(str(tmp_path))
    log.metric({"step": 0, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.1})
    log.event(Event("x", "m", data={"vals": [1.0, float("-inf")], "ok": True}))
    log.close()

    def strict_loads(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the log"))

    m = strict_loads((tmp_path / "metrics.jsonl").read_text())
    assert m["loss"] is None and m["grad_norm"] is None and m["lr"] == 0.1
    e = strict_loads((tmp_path / "events.jsonl").read_text())
    assert e["data"]["vals"] == [1.0, None]


# ------------------------------------------------------------------ notices, buddies' copies


def test_buddy_step_is_the_newest_step_every_row_is_held_at():
    from elastic.control.regroup import buddy_step

    def rows(r, n=3):  # zero3: rank r's rows of a (6, 2) entry
        return ("model/w", (6, 2), (2 * r, 2 * r + 2))

    need = {"model/w", "model/b"}
    b = ("model/b", (2,), None)
    # survivors 0 and 1; rank 2's rows come from its buddy (rank 0) at step 10 only
    s0 = {"steps": {10: [rows(0), b, rows(2)], 15: [rows(0), b]}}
    s1 = {"steps": {10: [rows(1)], 15: [rows(1), b]}}
    assert buddy_step([s0, s1], need) == 10
    # a stale copy (another step) does not count; a lost buddy leaves a hole
    assert buddy_step([{"steps": {10: [rows(0), b]}}, {"steps": {15: [rows(1), rows(2)]}}],
                      need) is None
    assert buddy_step([{"steps": {}}, {"steps": {}}], need) is None
    assert buddy_step([s0, s1], need | {"optim/w/exp_avg"}) is None


def test_drain_notices_name_the_nodes_that_host_workers():
    from elastic.control.group import WorkerRec, drain_notices

    ws = [WorkerRec(None, i, {"node_id": n}, rank=i) for i, n in enumerate("aab")]
    got = drain_notices({"a": 5_000, "c": 0, "b": 0}, ws, lambda n: ("preemption", "spot"),
                        now=1.0)
    assert [(n.node_id, n.ranks, n.deadline, n.reason) for n in got] == [
        ("a", (0, 1), 5.0, "preemption"), ("b", (2,), None, "preemption")]
    assert got[0].left_s(2.0) == 3.0 and got[1].left_s(2.0) is None


def test_a_node_is_named_by_a_unique_prefix():
    from elastic.control.evacuation import resolve_node
    from elastic.errors import SwitchError

    nodes = ["3f2a9c01aa", "3f2b0000bb", "77"]
    assert resolve_node("3f2a", nodes) == "3f2a9c01aa"
    for bad, words in [("3f2", "more than one"), ("zz", "no node"), ("", "no node")]:
        with pytest.raises(SwitchError, match=words):
            resolve_node(bad, nodes)


def test_evacuate_requests_are_parsed_where_they_enter():
    assert parse("evacuate", "abc").value == {"node": "abc", "deadline_s": None}
    assert parse("evacuate", {"node": " ab ", "deadline_s": 3}).value == {
        "node": "ab", "deadline_s": 3.0}
    for bad in (None, 3, {"node": ""}, {"node": "a", "deadline_s": True}, {"nod": "a"}):
        with pytest.raises(RequestError, match="evacuate"):
            parse("evacuate", bad)
    with pytest.raises(RequestError, match="unknown request 'notice'"):
        parse("notice")  # the controller's own


def test_the_survivor_plan_asks_the_planner_under_the_survivors_memory():
    from elastic.config import JobConfig
    from elastic.control.layouts import Layouts
    from tests.helpers import RegressionData, adam, mlp, mse

    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=4, num_workers=2, view="none")
    lay = Layouts(cfg, mlp(), lambda *a, **k: None)

    def infos(gb):
        return [{"device": "cpu", "rank": r, "emulation": {"memory_gb": gb}} for r in range(2)]

    assert lay.survivor_plan("zero3", infos(4.0)) == (True, "zero3", "")
    fits, name, why = lay.survivor_plan("dp", infos(1e-9))
    assert not fits and "no layout fits the survivors' memory" in why
    # peer copies lower a CPU worker's budget by what they keep
    copies = Layouts(cfg.replace(peer_copies_every=5), mlp(), lambda *a, **k: None)
    low = copies._budgets("zero3", infos(4.0))
    assert all(0 < i["emulation"]["memory_gb"] < 4.0 for i in low)
    assert lay._budgets("zero3", infos(4.0))[0]["emulation"]["memory_gb"] == 4.0


def test_a_call_raises_the_rank_that_failed_not_the_peers_that_echo_it():
    """Restores read then agree: rank 0 read fine but raises a ``PeerReadError`` because rank 1
    could not read; the call reports rank 1's own error (naming the bad shard)."""
    from elastic.errors import PeerReadError
    from elastic.failures import first_cause

    echo = PeerReadError("another rank could not read its part of the checkpoint")
    own = CheckpointCorruptError("shard shard-00001.bin (rank 1) of step 8: checksum mismatch")
    assert first_cause([echo, own]) is own
    assert first_cause([own, echo]) is own
    assert first_cause([echo]) is echo  # only echoes: still an error to raise
    other = WorkerLostError("worker rank 0 died")
    assert first_cause([other, own]) is other  # rank order among real causes


def test_the_chaos_demo_says_what_happened_and_what_it_cost():
    from elastic.demo import _chaos_lines
    from elastic.events import Event

    evs = [Event("preemption_notice", "", 24,
                 data={"node": "3f2a9c01aa77", "ranks": [2], "left_s": 14.6}),
           Event("evacuated", "", 25,
                 data={"step": 25, "path": "move", "pause_s": 0.31, "steps_lost": 0}),
           Event("failure", "", 32,
                 data={"dead_ranks": [1], "noticed_by": "liveness", "detect_s": 0.04}),
           Event("recovered", "", 30,
                 data={"source": "buddies", "seconds": 0.9, "steps_lost": 2, "world_size": 1}),
           Event("evacuated", "", 9, data={"step": 9, "path": "recover", "source": "checkpoint"})]
    lines = _chaos_lines(evs)
    assert lines == [
        "  step 24: node 3f2a9c01 (rank(s) [2]) announced its end, 14.6s ahead",
        "  step 25: evacuated (moved onto the other workers): training paused 0.31s, 0 step(s) "
        "lost, no checkpoint read, nobody restarted",
        "  step 32: rank(s) [1] lost without notice (noticed by liveness in 0.04s)",
        "  step 30: recovered from buddies in 0.90s, 2 step(s) run again, going on with 1 "
        "worker",
        "  step 9: evacuated (recover), state from checkpoint"]
    assert _chaos_lines([]) == ["  nothing (the run ended first)"]


def test_a_drains_reason_comes_from_the_node_info_else_it_is_a_preemption():
    from types import SimpleNamespace as NS

    from elastic.control.group import drain_reason

    def info(reason, msg=""):
        return NS(death_info=NS(reason=reason, reason_message=msg))

    class Nid(str):
        def hex(self):
            return str(self)

    infos = {Nid("a"): info(4, "idle"), Nid("b"): info(0), Nid("c"): info(3, "spot")}
    assert drain_reason(infos, "a") == ("idle termination", "idle")
    assert drain_reason(infos, "b") == ("preemption", "")  # alive and draining: no death info
    assert drain_reason(infos, "c") == ("preemption", "spot")
    assert drain_reason(infos, "zz") == ("preemption", "")


def test_a_watched_step_is_polled_at_its_end_by_the_step_period():
    """The poll for a pruner's decision step is timed by the steps' period (end to end), not
    by a step's own compute time, and for when the step's metrics exist (one step after its
    end): timed by the former it came early, found nothing and waited ``WATCH_MIN_S`` more
    (~50 ms: 2 steps of 24 ms)."""
    import math
    import time

    from elastic.control.steps import WATCH_MIN_S, WATCH_SLACK_S, StepLog
    from elastic.view import View

    class Watch(StepHook):
        def watch_at(self, step: int) -> int | None:
            return max(step, 10)

    log = StepLog(None, View(), lambda entry: False, Watch())
    assert log.watch_s() == pytest.approx(0.05)  # before the first step
    now = time.time()
    # steps of 20 ms compute that end every 80 ms (the loop's own work between them)
    log.history = [{"step": s, "time": now - (9 - s) * 0.08, "step_time": 0.02,
                    "generation": 1, "world_size": 2} for s in range(10)]
    assert log.step_period() == pytest.approx(0.08)
    # step 10 ends 80 ms after step 9 (at ``now``); its metrics exist when step 11's compute
    # ends (its control all-reduce overlaps step 11): polled then, not after 20 ms
    assert log.watch_s() == pytest.approx(0.16 + WATCH_SLACK_S, abs=0.01)
    # a group of one records a step's metrics at its end
    log.history = [dict(h, world_size=1) for h in log.history]
    assert log.watch_s() == pytest.approx(0.08 + WATCH_SLACK_S, abs=0.01)
    # a recovery between generations does not count as a long step
    log.history[-1] = dict(log.history[-1], generation=2)
    assert log.step_period() is None  # nor does a first step's time, which holds start-up
    assert log.watch_s() == WATCH_MIN_S
    assert StepLog(None, View(), lambda entry: False).watch_s() == math.inf  # nothing watched


def test_a_pooled_placement_whose_cold_part_fails_gives_its_warm_workers_back(monkeypatch):
    """A job took k warm workers and could not place the rest: the warm ones go back to the
    pool. They were dropped from the pool's books while their processes lived on, each
    holding a CPU, and the next jobs could not be placed (bench/scheduler.py, warm pool)."""
    from elastic.config import JobConfig
    from elastic.control import pooled as pooled_mod
    from elastic.control.group import WorkerRec
    from elastic.control.worker_group import Placement
    from elastic.errors import ClusterError
    from tests.helpers import RegressionData, adam, mlp, mse

    class Handle:
        def __init__(self, i: int) -> None:
            self._actor_id = type("Id", (), {"hex": lambda _self: f"a{i}"})()

    given: list[list[WorkerRec]] = []
    placed: list[int] = []

    class Pool:
        env: dict = {}

        def give_back(self, recs, lost=()):
            given.append(list(recs))

        def cold_placed(self, n):
            placed.append(n)

    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=5, num_workers=3)
    pp = pooled_mod.PooledPlacement(Pool(), cfg, None, None)
    warm = [WorkerRec(Handle(i), i, info={"warm": True}) for i in range(2)]
    pp._mine = {f"a{i}": (w.handle, None) for i, w in enumerate(warm)}
    monkeypatch.setattr(pooled_mod.PooledPlacement, "_warm", lambda self, n, wait_s=0.0: [
        (w, None) for w in warm])
    monkeypatch.setattr(pooled_mod.PooledPlacement, "_collect",
                        lambda self, launched, wait_s: [w for w, _ in launched])

    def no_room(self, n, min_workers):
        raise ClusterError("the cluster cannot host 1 workers")

    monkeypatch.setattr(Placement, "place", no_room)
    with pytest.raises(ClusterError):
        pp.place(3, 3)
    assert given == [warm] and pp._mine == {}
    assert placed == [1]  # the one left to start cold no longer holds back the pool's refill


def test_warm_workers_a_failed_assign_never_reached_go_back_to_the_pool(monkeypatch):
    """The pool lends 3 warm workers and the second one's assign raises (its config cannot
    be sent): the third, never handed the job, goes back to the pool at once, and the first
    two stay the job's (given back at its end). Was: the third stayed lent with nobody
    holding it: never reset or killed, its bundle held, the pool's size counted against it
    for good (found by review)."""
    from elastic.config import JobConfig
    from elastic.control import pooled as pooled_mod
    from tests.helpers import RegressionData, adam, mlp, mse

    class Handle:
        def __init__(self, i: int) -> None:
            self._actor_id = type("Id", (), {"hex": lambda _self: f"a{i}"})()

            def remote(*a):
                if i == 1:
                    raise TypeError("cannot pickle '_thread.lock' object")
            self.assign = type("M", (), {"remote": staticmethod(remote)})()

    given: list[list[str]] = []

    class Proc:
        def __init__(self, i: int) -> None:
            self.handle, self.pg = Handle(i), object()

    class Pool:
        env: dict = {}

        def take(self, key, n, free=None, wait_s=0.0):
            return [Proc(i) for i in range(n)]

        def cold_placed(self, n):
            pass

        def give_back(self, recs, lost=()):
            given.append([w.handle._actor_id.hex() for w in recs])

    monkeypatch.setattr(pooled_mod.PooledPlacement, "_key", lambda self: None)
    monkeypatch.setattr(pooled_mod, "free_by_node", lambda bundle: {})
    monkeypatch.setattr(pooled_mod.PooledPlacement, "bundle", lambda self: {"CPU": 1})
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=5, num_workers=3)
    pp = pooled_mod.PooledPlacement(Pool(), cfg, None, None)
    with pytest.raises(TypeError, match="pickle"):
        pp._warm(3)
    assert given == [["a2"]] and sorted(pp._mine) == ["a0", "a1"]


def test_a_pooled_jobs_end_keeps_the_bundle_a_replacement_took_over(monkeypatch):
    """A pooled worker was lost (hung, killed) and its replacement started in its one-bundle
    group (a free slot). At the job's end the lost worker's bundle was removed with it, and
    with the bundle Ray ended the replacement, which the pool had just kept as idle, or (a
    shrink having given it back first) lent to another job (chaos tests on a warm pool;
    review). A bundle taken over is now untied from the lost worker's books."""
    from elastic.config import JobConfig
    from elastic.control import pool as pool_mod
    from elastic.control import pooled as pooled_mod
    from elastic.control.group import WorkerRec
    from elastic.control.worker_group import Placement
    from tests.helpers import RegressionData, adam, mlp, mse

    class Handle:
        def __init__(self, i: int) -> None:
            self._actor_id = type("Id", (), {"hex": lambda _self: f"a{i}"})()
            self.assign = type("M", (), {"remote": staticmethod(lambda *a: None)})()

    removed: list[object] = []

    class Pool:
        env: dict = {}

        def give_back(self, recs, lost=()):
            pass

        def _start_blank(self, pg, i, bundle, gpu):
            return Handle(3)

        def adopt(self, h, pg, key):
            pass

    monkeypatch.setattr(pool_mod, "remove_bundle", removed.append)
    monkeypatch.setattr(pooled_mod, "remove_bundle", removed.append)
    monkeypatch.setattr(pool_mod, "kill", lambda handle: None)
    monkeypatch.setattr(Placement, "release", lambda self, extra: None)
    monkeypatch.setattr(Placement, "vacate", lambda self, gone, kept: None)
    monkeypatch.setattr(pooled_mod.PooledPlacement, "_key", lambda self: None)
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=5, num_workers=2)
    pg_a, pg_b = object(), object()
    alive, hung = WorkerRec(Handle(0), 0, pg=pg_a), WorkerRec(Handle(1), 1, pg=pg_b)

    def job() -> tuple[pooled_mod.PooledPlacement, WorkerRec]:
        pp = pooled_mod.PooledPlacement(Pool(), cfg, None, None)
        pp._mine = {"a0": (alive.handle, pg_a), "a1": (hung.handle, pg_b)}
        (rec, _), = pp._launch(pg_b, [0], {"CPU": 1})  # the replacement, in the hung one's
        return pp, rec

    pp, replacement = job()
    pp.release([alive, replacement])  # both go back to the pool at the job's end
    assert removed == [], "the bundle the replacement runs in was removed"
    pp, replacement = job()
    pp.vacate([replacement], [alive])  # a shrink gives it back first
    pp.release([alive])
    assert removed == [], "the bundle the replacement (now the pool's) runs in was removed"
    # a lost worker whose bundle nobody took over: its bundle goes with it
    pp = pooled_mod.PooledPlacement(Pool(), cfg, None, None)
    pp._mine = {"a0": (alive.handle, pg_a), "a1": (hung.handle, pg_b)}
    pp.release([alive])
    assert removed == [pg_b]


def test_a_pooled_jobs_end_resets_no_spare_whose_assign_still_runs(monkeypatch):
    """At a pooled job's end its spares go back to the pool, which resets them. A spare's
    ``assign`` could still be running (the worker is threaded: the reset unloaded the job's
    modules under the assign's unpickling, a ``KeyError`` seen in the suite). Only spares
    whose assign has ended are given back; one still assigning is killed."""
    from elastic.config import JobConfig
    from elastic.control import pool as pool_mod
    from elastic.control import pooled as pooled_mod
    from elastic.control.group import WorkerRec
    from elastic.control.worker_group import Placement
    from tests.helpers import RegressionData, adam, mlp, mse

    class Handle:
        def __init__(self, i: int) -> None:
            self._actor_id = type("Id", (), {"hex": lambda _self: f"a{i}"})()

    given: list[tuple[list, list]] = []
    killed: list[object] = []

    class Pool:
        env: dict = {}

        def give_back(self, recs, lost=()):
            given.append((list(recs), list(lost)))

    waited: list[float] = []
    done_ref, running_ref = object(), object()
    monkeypatch.setattr(pooled_mod, "wait_refs", lambda refs, t: waited.append(t) or (
        [r for r in refs if r is done_ref], [r for r in refs if r is not done_ref]))
    monkeypatch.setattr(pool_mod, "remove_bundle", lambda pg: None)
    monkeypatch.setattr(pooled_mod, "remove_bundle", lambda pg: None)
    monkeypatch.setattr(pool_mod, "kill", killed.append)
    monkeypatch.setattr(Placement, "release", lambda self, extra: None)
    monkeypatch.setattr(pooled_mod.PooledPlacement, "_key", lambda self: None)
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=5, num_workers=2)
    member, up, assigning = (WorkerRec(Handle(i), i, pg=object()) for i in range(3))
    pp = pooled_mod.PooledPlacement(Pool(), cfg, None, None)
    pp._mine = {f"a{i}": (w.handle, w.pg) for i, w in enumerate((member, up, assigning))}
    pp._warming = [(up, done_ref), (assigning, running_ref)]
    pp.release([member])
    assert given == [([member, up], ["a2"])] and killed == [assigning.handle]
    assert waited == [30.0]


def test_a_late_report_of_an_ended_checkpoint_starts_nothing_new():
    """A rank's metrics saying it began checkpoint 200 came after 200 had ended: that made a
    new checkpoint in flight which nothing would finish, and the end of the run waited its
    300 s for it (the demo, from a fresh clone). A checkpoint is named (generation, seq), so
    a rollback's replay of step 200 is a new one, and a late report of the first one, in
    whichever order it comes, is still the ended one."""
    tracker, group, events, done = _tracker_and_group([[{"error": "disk full"}, None]])
    first = {"generation": 1, "checkpoint_begun": 200, "checkpoint_seq": 1}
    tracker.on_metric({"rank": 0, **first, "checkpoint_blocked_s": 0.01}, None)
    tracker.tick(group)  # step 200 ends (not committed)
    assert tracker.in_flight is None and events[-1][0] == "checkpoint_failed"
    tracker.on_metric({"rank": 1, **first, "checkpoint_blocked_s": 0.02}, None)
    assert tracker.in_flight is None
    tracker.finish(group, timeout_s=0.3)
    assert not any("did not finish uploading" in m for _, m in events), events
    # after a rollback (the same group) step 200 is checkpointed again: a new name, tracked
    # as any other; the first one's late report neither ends nor replaces it
    replay = {"generation": 1, "checkpoint_begun": 200, "checkpoint_seq": 2}
    tracker.on_metric({"rank": 0, **replay, "checkpoint_blocked_s": 0.0}, None)
    assert tracker.in_flight is not None and tracker.in_flight["seq"] == 2
    tracker.on_metric({"rank": 1, **first, "checkpoint_blocked_s": 0.0}, None)
    assert tracker.in_flight["seq"] == 2 and tracker.in_flight["by_rank"] == {0: 0.0}
    tracker.finish(group, timeout_s=0.1)
    assert done[-1] == (200, False, 1, 2)  # the word names the replay's, not the first


def _tracker_and_group(polls: list[Any]) -> tuple[Any, Any, list[Any], list[Any]]:
    from types import SimpleNamespace

    from elastic.control.checkpoints import CheckpointTracker

    events: list[tuple[str, str]] = []
    done: list[tuple[int, bool, Any, Any]] = []
    it = iter(polls)
    group = SimpleNamespace(generation=1, checkpoint_poll=lambda: next(it, [None, None]),
                            checkpoint_done=lambda step, ok, gen=None, seq=None: done.append(
                                (step, ok, gen, seq)))
    cfg = SimpleNamespace(checkpoint_upload_timeout_s=3600.0, checkpoint_wait_s=30.0)
    tracker = CheckpointTracker(cfg, object(),  # type: ignore[arg-type]
                                lambda kind, msg, **kw: events.append((kind, msg)))
    return tracker, group, events, done


def test_reports_of_an_abandoned_groups_checkpoint_start_nothing():
    """At a recovery the checkpoint in flight is abandoned, then the survivors' metrics are
    drained: their report of it (generation 1) made it in flight again, with the old spec,
    and the group re-formed could never finish it (its step number comes again after a
    restore, and then counted as "ended": every later checkpoint was skipped)."""
    tracker, group, events, done = _tracker_and_group([])
    begun = {"checkpoint_begun": 10, "checkpoint_blocked_s": 0.0, "checkpoint_seq": 1}
    tracker.on_metric({"rank": 0, "generation": 1, **begun}, "old spec")
    tracker.abandon(group)
    assert done == [(10, False, 1, 1)] and tracker.in_flight is None
    assert events[-1][0] == "checkpoint_failed"
    tracker.on_metric({"rank": 1, "generation": 1, **begun}, "old spec")  # drained late
    assert tracker.in_flight is None
    tracker.formed(2)
    group.generation = 2
    tracker.on_metric({"rank": 0, "generation": 2, **begun}, "new spec")  # step 10 again
    assert tracker.in_flight["gen"] == 2 and tracker.in_flight["spec"] == "new spec"
    tracker.on_metric({"rank": 1, "generation": 1, **begun, "checkpoint_seq": 2}, None)
    assert tracker.in_flight["gen"] == 2  # an old group's unseen one: void once 2 formed
    group.checkpoint_poll = lambda: [{"error": "disk full"}, None]
    tracker.tick(group)
    assert done[-1] == (10, False, 2, 1) and tracker.ended == (2, 1)
    # an evacuation gives up the one in flight but may take one on the same group first:
    # a new name, tracked; once the next group is up (formed), that group's are void
    tracker.on_metric({"rank": 0, "generation": 2, **begun, "checkpoint_begun": 15,
                       "checkpoint_seq": 2}, None)
    tracker.abandon(group)
    tracker.on_metric({"rank": 0, "generation": 2, **begun, "checkpoint_begun": 16,
                       "checkpoint_seq": 3}, None)
    assert tracker.in_flight["step"] == 16
    tracker.formed(3)
    assert tracker.in_flight is None and "step 16 abandoned" in events[-1][1]
    tracker.on_metric({"rank": 1, "generation": 2, **begun, "checkpoint_begun": 16,
                       "checkpoint_seq": 3}, None)
    assert tracker.in_flight is None


def test_a_rank_holding_a_checkpoint_nothing_will_end_is_released():
    """A skip names what the rank still holds: while that one is in flight it is left alone;
    else nothing would ever end it (even one that ended: the rank waited checkpoint_wait_s
    for the word its end sent), the next tick releases it (an event says so), and the next
    due checkpoint is taken. A wait for one in flight that runs out gives it up on the
    workers too (it used to be forgotten by the controller alone)."""
    tracker, group, events, done = _tracker_and_group([])
    skip = {"checkpoint_skipped": 15, "checkpoint_held": 10, "checkpoint_held_gen": 1,
            "checkpoint_held_seq": 1, "generation": 1}
    tracker.on_metric({"rank": 0, "generation": 1, "checkpoint_begun": 10,
                       "checkpoint_seq": 1, "checkpoint_blocked_s": 0.0}, None)
    tracker.on_metric({"rank": 1, **skip}, None)  # in flight (a slow upload): left alone
    tracker.tick(group)
    assert done == [] and tracker.in_flight is not None
    tracker.finish(group, timeout_s=0.2, when="the rollback")  # still uploading: given up
    assert done == [(10, False, 1, 1)] and "within 0s of the rollback" in events[-1][1]
    tracker.on_metric({"rank": 1, **skip}, None)  # still held after that word: released,
    tracker.tick(group)  # without a second event (it may only have crossed that word)
    assert done[-2:] == [(10, False, 1, 1)] * 2 and "within 0s of the rollback" in events[-1][1]
    tracker.on_metric({"rank": 1, **skip, "checkpoint_held": 7, "checkpoint_held_seq": 5},
                      None)  # nothing ends it
    tracker.tick(group)
    assert done[-1] == (7, False, 1, 5) and "step 7 released: rank 1" in events[-1][1]
    tracker.tick(group)
    assert len(done) == 3  # once each


@pytest.mark.parametrize("now, since, step_s, wait", [
    (100.0, None, 0.0, 9.0),  # no sign of the ranks between steps: the full timeout + slack
    (100.0, 100.0, 0.0, 9.0),  # seen between steps just now: the same
    (100.0, 95.0, 0.0, 5.0),  # hung 5 s already (the survivors' collective timed out): 4 s
    # more would reach the timeout + slack; the slack is the least
    (100.0, 97.0, 0.0, 6.0),
    (100.0, 97.0, 1.0, 9.0),  # long steps: up to two steps past the last seen, capped at full
    (100.0, 40.0, 0.5, 5.0),  # long ago: the slack only
])
def test_a_hang_is_waited_for_from_when_the_ranks_were_last_between_steps(now, since, step_s,
                                                                         wait):
    from elastic.control.steps import hang_wait

    assert hang_wait(now, since, 4.0, step_s) == pytest.approx(wait)


def test_the_step_log_anchors_the_hang_wait_at_a_segment_start_and_each_step():
    from elastic.control.steps import StepLog
    from elastic.view import View

    class _Group:
        def send_gate(self, g):
            raise AssertionError("no hook, no gate")

    log = StepLog(None, View())
    assert log.hang_wait_s(4.0, now=1e9) == pytest.approx(9.0)  # nothing seen yet
    log.segment_starts(_Group())
    t = log.between_steps_at
    assert t is not None and log.hang_wait_s(4.0, now=t + 30) == pytest.approx(5.0)
    assert log.hang_wait_s(4.0, now=t + 1) == pytest.approx(8.0)


def test_the_views_memory_column_comes_with_the_metrics_and_never_calls_the_workers():
    """A layout's memory counts come in its first step's metrics; the view shows them from
    there. Before, the controller called every worker for them every 2 s during a segment,
    and a worker answered at its next step boundary: the controller blocked up to 2 s of
    every 2 on long steps (and a due checkpoint waited on that read for 2 s)."""
    from elastic.control.steps import StepLog
    from elastic.view import View

    class _Group:
        def __init__(self) -> None:
            self.workers = [type("W", (), {"info": {}})()]

        def memory_counts(self, timeout_s=None):
            raise AssertionError("the view must not call the workers")

    from strategies import StrategySpec

    log, g, spec = StepLog(None, View()), _Group(), StrategySpec("dp", 1, (4,))
    m = {"step": 0, "rank": 0, "loss": 1.0, "step_time": 0.1, "samples": 4, "range": [0, 4],
         "generation": 1, "global_samples": 4, "samples_per_s": 40.0, "time": 0.0}
    log.ingest(g.workers, [[dict(m, memory={"params": 3, "optim": 6})]], spec, 1)
    log.show_workers(g)
    assert g.workers[0].info["memory"] == {"params": 12, "optim": 24}  # fp32 bytes
    log.ingest(g.workers, [[dict(m, step=1)]], spec, 1)  # later steps: the counts stay
    log.show_workers(g)
    assert g.workers[0].info["memory"] == {"params": 12, "optim": 24}


def test_peer_copies_turned_off_is_said_in_the_step_metrics():
    """Copies over ``peer_copies_memory_gb`` are off on every rank, and the workers say why
    in that step's metrics: the step log used to drop the word, so a job asked for copies
    went without them and nothing said so."""
    from elastic.control.steps import StepLog
    from elastic.view import View
    from strategies import StrategySpec

    log, spec = StepLog(None, View()), StrategySpec("zero3", 1, (4,))
    w = type("W", (), {"info": {}})()
    m = {"step": 0, "rank": 0, "loss": 1.0, "step_time": 0.1, "samples": 4, "range": [0, 4],
         "generation": 1, "global_samples": 4, "samples_per_s": 40.0, "time": 0.0}
    why = "peer copies need 2.0 GB of host memory per worker, over peer_copies_memory_gb=1"
    log.ingest([w], [[dict(m, peer_copies_off=why), dict(m, step=1)]], spec, 1)
    assert log.history[0]["peer_copies_off"] == why and "peer_copies_off" not in log.history[1]


def test_peer_copies_turned_off_is_an_event():
    """The same word is an event (the view and events.jsonl): the step metrics alone did
    not reach someone watching the job."""
    tracker, _, events, _ = _tracker_and_group([])
    why = "peer copies need 2.0 GB of host memory per worker, over peer_copies_memory_gb=1"
    for rank in (0, 1):  # every rank says it; one event
        tracker.on_metric({"rank": rank, "generation": 1, "step": 3, "peer_copies_off": why},
                          None)
    tracker.on_metric({"rank": 0, "generation": 1, "step": 4}, None)
    assert [k for k, _ in events] == ["peer_copies_off"]
    assert why in events[0][1] and "step 3" in events[0][1]


def _bare_pool(monkeypatch, session: list[str]):
    """A ``WorkerPool`` with Ray stood in for: no workers, its decisions recorded."""
    from elastic.control import pool as pool_mod

    monkeypatch.setattr(pool_mod, "connect", lambda address, cpus, say=None: False)
    monkeypatch.setattr(pool_mod, "runtime_env_now", lambda: {})
    monkeypatch.setattr("elastic.ray_connect.cluster_has_gpus", lambda: False)
    monkeypatch.setattr(pool_mod, "ray_session", lambda: session[0])
    monkeypatch.setattr(pool_mod, "draining_nodes", lambda: {})
    monkeypatch.setattr(pool_mod, "wait_refs", lambda refs, timeout_s: ([], []))
    p = pool_mod.WorkerPool(0, wait=False, maintain_every_s=None)
    seen = []
    decide = p.policy.decide
    p.policy.decide = lambda obs: seen.append(obs) or decide(obs)  # type: ignore[method-assign]
    return p, seen


def test_a_pools_watch_sees_the_cold_workers_a_hand_out_left_until_they_are_placed(monkeypatch):
    """The real books behind the policy's ``cold_pending``: a hand-out that finds no idle
    worker leaves the job 3 to start cold; the watch's decisions see them (and start no
    refill) until the placement says they are placed."""
    p, seen = _bare_pool(monkeypatch, ["s"])
    assert p.take(p.key, 3, 3) == []
    assert p.maintain() and seen[-1].cold_pending == 3 and seen[-1].want is None
    p.reserve_cold(1)  # a warm worker that failed to take its job starts cold instead
    p.cold_placed(3)
    assert p.maintain() and seen[-1].cold_pending == 1
    p.cold_placed(1)
    assert p.maintain() and seen[-1].cold_pending == 0


def test_a_pools_watch_ends_with_its_ray_session_close_or_the_pool(monkeypatch):
    import threading
    import weakref

    from elastic.control import pool as pool_mod
    from elastic.control import pool_watch

    session = ["s"]
    p, seen = _bare_pool(monkeypatch, session)
    session[0] = "another ray.init"  # a reconnect: the pool's handles mean nothing there
    assert not p.maintain() and seen == []
    session[0] = "s"
    p.close()
    assert not p.maintain() and seen == []
    with pytest.raises(ValueError, match="maintain_every_s"):
        pool_mod.WorkerPool(0, maintain_every_s=0)
    p2, _ = _bare_pool(monkeypatch, ["s"])
    ref = weakref.ref(p2)
    t = threading.Thread(target=pool_watch._watch, args=(ref, threading.Event(), 0.01))
    t.start()
    del p2  # dropped without close(): collected, and its watch ends
    t.join(5.0)
    assert not t.is_alive() and ref() is None


def test_a_job_that_outlives_the_wait_says_what_it_is_doing():
    """``result(timeout)`` on a job still running names its state, step and last events (a
    chaos test that timed out said only "the job is still running")."""
    import threading

    from elastic.api import JobHandle
    from elastic.events import Event

    gate = threading.Event()

    class Ctl:
        events = [Event("recovered", "recovered 5 from buddies", step=5, time=0.0)]

        def run(self):
            gate.wait(10)

        def status(self):
            return {"state": "recovering", "step": 7}

    handle = JobHandle(Ctl())  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeoutError, match=r"recovering.*'step': 7.*recovered \(step 5\)"):
            handle.result(timeout=0.01)
    finally:
        gate.set()


def test_a_placement_timeout_says_what_is_free_of_what_a_worker_needs():
    """Ray's free resources list a wildcard per placement-group bundle (999.999 each), which
    hid that every CPU was held; the message names each resource a worker needs."""
    from elastic.control.group import capacity

    free = {"CPU": 0.0, "memory": 1e10, "bundle_group_0_ab": 999.999, "node:__internal_head__": 1}
    text = capacity({"CPU": 1.0}, {"CPU": 4.0, "memory": 2e10}, free)
    assert text.startswith("0 of 4 CPU free; the rest is held by placement groups"), text
    assert "bundle_group" not in text and "memory" not in text
    assert capacity({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0},
                    {"CPU": 8.0, "GPU": 1.0}) == "8 of 8 CPU free, 1 of 1 GPU free"


def test_a_pool_makes_room_for_another_pools_job_and_holds_its_refill(monkeypatch):
    """The live books behind ``room``: a job of one pool finds no idle worker and no free
    bundle; the other pool of the process retires its longest idle workers for it, starts
    no refill while the room is held (its watch would take it back), and a failing pool
    does not fail the job's hand-out."""
    from clusters.pool_policy import ROOM, ROOM_HOLD_S
    from elastic.control import pool as pool_mod

    class Handle:
        def __init__(self, i: int) -> None:
            self.i = i
            self._actor_id = type("Id", (), {"hex": lambda _self: f"h{i}"})()

    killed: list[int] = []
    monkeypatch.setattr(pool_mod, "kill", lambda h: killed.append(h.i))
    monkeypatch.setattr(pool_mod, "remove_bundle", lambda pg: None)
    monkeypatch.setattr(pool_mod.WorkerPool, "_ping",
                        lambda self, procs, timeout_s=2.0: {pool_mod.actor_key(p.handle): True
                                                            for p in procs})
    now = [100.0]
    full, seen = _bare_pool(monkeypatch, ["s"])
    mine, _ = _bare_pool(monkeypatch, ["s"])
    broken, _ = _bare_pool(monkeypatch, ["s"])
    monkeypatch.setattr(broken, "make_room", lambda n: 1 / 0)
    full.clock = lambda: now[0]
    full.policy.min_idle = 3
    full._idle = {f"h{i}": pool_mod._Proc(Handle(i), None, full.key, idle_since=float(i))
                  for i in range(3)}
    try:
        assert mine.take(mine.key, 2, 0) == []  # 2 to start cold, nothing free
        assert killed == [0, 1] and full.stats.retired == {ROOM: 2}
        assert sorted(full._idle) == ["h2"]
        assert full.maintain() and seen[-1].room_held and full.stats.started == 0
        now[0] += ROOM_HOLD_S + 1
        monkeypatch.setattr(pool_mod.WorkerPool, "_apply", lambda self, d: seen.append(d))
        assert full.maintain() and not seen[-2].room_held and seen[-1].start == 2
    finally:
        for p in (full, mine, broken):
            p._idle = {}
            p.close()


def test_the_default_pool_of_another_ray_connection_is_not_used(monkeypatch):
    """A default pool made in an earlier Ray connection (the driver re-initialised Ray
    without closing it) is not handed to a job or a sweep: its handles mean nothing now."""
    from elastic.control.pool import default_pool

    session = ["s"]
    p, _ = _bare_pool(monkeypatch, session)
    try:
        p.make_default()
        assert default_pool() is p
        session[0] = "t"
        assert default_pool() is None
        session[0] = None  # no Ray yet: the job's connect comes first, the pool is asked again
        assert default_pool() is p
    finally:
        p.close()
    assert default_pool() is None


def test_a_nodes_evacuation_moves_nothing_while_replicas_stay():
    """A dp node of 2 ranks (of 4) drains: the ranks that stay hold every entry, so the move
    is priced at its fixed cost, as the simulator prices it; a pipeline over dp likewise
    while each stage keeps a replica. Was: a full state transfer at the default bandwidth
    for any node of more than one rank (24 s for a 100M-parameter Adam job), so the policy
    chose a checkpoint over a move that moves nothing."""
    from elastic.control.layouts import replicas_stay
    from strategies import StrategySpec

    dp = StrategySpec("dp", 4, (8, 8, 8, 8))
    assert replicas_stay(dp, {2, 3}) and replicas_stay(dp, {0, 1, 2})
    assert not replicas_stay(dp, {0, 1, 2, 3})
    pp = StrategySpec("pipeline", 4, (4, 4, 4, 4), pp_degree=2, micro_batches=2,
                      schedule="gpipe", dp_mode="dp")
    assert replicas_stay(pp, {1, 3})  # one replica of each stage goes (ranks 1, 3)
    assert not replicas_stay(pp, {2, 3})  # stage 1's both replicas go
    z = StrategySpec("zero1", 4, (8, 8, 8, 8))
    assert not replicas_stay(z, {3})  # its shards live on one rank each
    # and the evacuation prices its move by it (no counts asked: nothing is sent)
    from types import SimpleNamespace

    from elastic.control.evacuation import FIXED_S, Evacuation

    class _NoCounts:
        def memory_counts(self, timeout_s=None):
            raise AssertionError("a move that sends nothing needs no counts")

    ev = Evacuation.__new__(Evacuation)
    ev.group, ev.bandwidth = _NoCounts(), 100e6
    leaving = [SimpleNamespace(rank=2), SimpleNamespace(rank=3)]
    assert ev._move_s(dp, leaving) == FIXED_S
    with pytest.raises(AssertionError, match="needs no counts"):
        ev._move_s(z, leaving)


def test_closing_a_pool_waits_for_the_watch_round_in_progress(monkeypatch):
    """The pool's watch pings its idle workers outside the pool's lock; ``close`` (and the
    exit hook) waited only for that lock, so it returned, and Ray was shut down, while the
    round still made Ray calls, which start a new Ray (found by review). ``close`` now waits
    for the whole round, and a round that finds the pool stopping does nothing more."""
    import threading
    import time

    from elastic.control import pool as pool_mod

    pool = pool_mod.WorkerPool.__new__(pool_mod.WorkerPool)
    pool._lock, pool._round, pool._stop = threading.RLock(), threading.Lock(), threading.Event()
    pool._closed, pool._started_ray, pool._session = False, False, None
    pool._idle, pool._starting = {}, {}
    order: list[str] = []
    pinging, go = threading.Event(), threading.Event()

    def ping(procs, timeout_s=2.0):
        order.append("ping")
        pinging.set()
        go.wait(10)
        order.append("ping done")
        return {}

    monkeypatch.setattr(pool, "_ping", ping, raising=False)
    monkeypatch.setattr(pool, "_settle", lambda: None, raising=False)
    monkeypatch.setattr(pool_mod.WorkerPool, "_draining", staticmethod(lambda: frozenset()))
    monkeypatch.setattr(pool_mod, "ray_session", lambda: None)
    rounds: list[bool] = []
    t = threading.Thread(target=lambda: rounds.append(pool.maintain()))
    t.start()
    assert pinging.wait(10)
    c = threading.Thread(target=lambda: (pool.close(), order.append("closed")))
    c.start()
    time.sleep(0.3)
    assert "closed" not in order  # the round still runs: close waits for it
    go.set()
    t.join(10)
    c.join(10)
    assert order == ["ping", "ping done", "closed"] and rounds == [False]


def test_a_planned_resume_is_checked_again_once_a_ray_datasets_length_is_known(tmp_path):
    """A Ray dataset's length is known only after its pipeline ran, after the resume was
    planned: the planned step is checked against it then, refused for the job's own URI
    and said for a fork. Was: never checked, so a pipeline that now gave 300 rows for the
    256 trained on drew another order from the resumed step (found by review, session
    44)."""
    import torch

    from elastic.checkpoint import CheckpointMeta, CheckpointStore, commit, write_shard
    from elastic.config import JobConfig
    from elastic.control.resume_checks import recheck_length
    from elastic.errors import ConfigError
    from tests.helpers import RegressionData, adam, mlp, mse

    store = CheckpointStore(str(tmp_path / "ck"))
    commit(store, 4, [write_shard(store, 4, 0, {"model/w": torch.ones(2)})],
           CheckpointMeta(extra={"dataset_length": 256, "global_batch_size": 8}))
    said: list[tuple[str, str]] = []
    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=10)
    cfg.dataset_length = 256
    recheck_length((store, 4), cfg, store, lambda k, m, **_: said.append((k, m)))
    cfg.dataset_length = 300
    with pytest.raises(ConfigError, match="has 300 samples, but checkpoint step 4 was trained "
                                          "on 256") as ei:
        recheck_length((store, 4), cfg, store, lambda k, m, **_: said.append((k, m)))
    assert ei.value.field == "dataset" and not said
    recheck_length((store, 4), cfg, CheckpointStore(str(tmp_path / "own")),  # a fork
                   lambda k, m, **_: said.append((k, m)))
    assert [k for k, _ in said] == ["resume_sampling"]


def test_an_evacuation_cut_by_a_lost_worker_is_said_to_follow_the_recovery():
    """``elastic drain NODE`` whose hand-off a lost peer cuts: the job recovers, keeps the
    node's notice and evacuates it at a later boundary, so its asker is told that, not only
    the error (was: the bare error, for a drain then carried out: found by review, session
    44). Another request cut so gets the error as it is."""
    import queue as _queue

    from elastic.errors import GroupError

    inbox = Inbox(None, lambda *a, **k: None)
    for kind, value in (("evacuate", {"node": "n1"}), ("switch", "zero2")):
        req = Request(kind, value, "by hand")
        req.reply = _queue.Queue()
        inbox.post(req)
        assert inbox.take() is req
        inbox.fail_in_hand(GroupError("rank 2: the process group failed"))
        got = req.reply.get_nowait()
        if kind == "evacuate":
            assert isinstance(got, RequestError) and "recovers first, then carries it out" \
                in str(got) and "rank 2: the process group failed" in str(got)
        else:
            assert isinstance(got, GroupError)


def test_a_parked_growth_is_answered_with_the_jobs_status():
    """``elastic scale job 2`` from 1 waits for room, then is answered with the job's status,
    as every other request is (was: ``"status": {}``, found by a new user, session 46); a
    refusal after the wait is an error."""
    from elastic.control.requests import Inbox, Request

    class Box:
        def __init__(self) -> None:
            self.replies: list[tuple[int, dict]] = []

        def reply(self, rid: int, out: dict) -> None:
            self.replies.append((rid, out))

    box = Box()
    inbox = Inbox(box, lambda *a, **k: None)
    inbox.park(Request("scale", 2, remote_id=1), deadline=10.0)
    inbox.park(Request("scale", 4, remote_id=2), deadline=10.0)
    status = {"job": "j", "world_size": 2}
    assert not inbox.settle_parked(2, 5.0, lambda n: RuntimeError(f"no {n}"), lambda: status)
    assert box.replies == [(1, {"ok": True, "result": 2, "status": status})]
    assert inbox.settle_parked(2, 11.0, lambda n: RuntimeError(f"no {n}"), lambda: status)
    assert box.replies[1] == (2, {"error": "no 4"})


def test_a_warm_only_resize_says_it_takes_the_spares_that_are_up():
    """It takes as many as are up: "resizing to 4 workers" then "scaled 2 -> 3" read as a
    failed resize (found by a new user, session 46)."""
    from elastic.control.states import Resizing

    assert Resizing(4, "a node with room joined", warm_only=True).describe() == (
        "resizing toward 4 workers with the spares up (a node with room joined)")
    assert Resizing(2, "asked").describe() == "resizing to 2 workers (asked)"


def test_what_no_checkpoint_of_a_finished_run_holds():
    """``unsaved``: a checkpoint that failed after the newest committed one is said (its
    step and the newest committed); one a later commit covers, or an orphan released, is
    not."""
    from elastic.control.checkpoints import unsaved
    from elastic.events import Event

    def ev(kind: str, step: int, **data: Any) -> Event:
        return Event(kind, "", step=step, data={"step": step, **data})

    assert unsaved([]) is None
    assert unsaved([ev("checkpoint", 10), ev("checkpoint_failed", 20)]) == (
        "the checkpoint of step 20 was not committed: the newest committed checkpoint is "
        "step 10")
    assert unsaved([ev("checkpoint_failed", 10), ev("checkpoint", 20)]) is None
    assert unsaved([ev("checkpoint", 10), ev("checkpoint_failed", 20, released=True)]) is None
    assert "is none" in str(unsaved([ev("checkpoint_failed", 5)]))
    resumed = unsaved([ev("resumed", 1000, uri="/ck"), ev("checkpoint_failed", 1050)])
    assert str(resumed).endswith("the newest committed checkpoint is step 1000 at /ck")


def test_sizes_in_events_do_not_round_a_small_model_to_nothing():
    """A small model's restore, copy or checkpoint said "0.0 MB" (23,532 bytes moved; found
    by a new user): three digits below 1 MB, one decimal above."""
    from elastic.control.checkpoints import megabytes, read_detail

    assert megabytes(23_532) == "0.0235" and megabytes(0) == "0" and megabytes(8) == "<0.001"
    assert megabytes(2_345_678) == "2.3" and megabytes(1.5e9) == "1500.0"
    assert read_detail([{"bytes": 11_766, "total_bytes": 23_532},
                        {"bytes": 11_766, "total_bytes": 23_532}]) == (
        " (each worker read 0.0118-0.0118 of 0.0235 MB)")


def test_a_switch_within_one_strategy_says_what_it_changed():
    """A re-cut or re-split is a switch from a strategy to itself: its event says the new
    shares or split (a new user read "switch dp -> dp" and "pipeline -> pipeline" with
    nothing else, session 50)."""
    from elastic.control.layouts import _within
    from strategies import StrategySpec

    dp = StrategySpec("dp", world_size=2, shares=(32, 32))
    assert _within(dp, StrategySpec("dp", world_size=2, shares=(60, 4))) == (
        "; now dp, shares [60, 4]")
    pipe = StrategySpec("pipeline", world_size=2, shares=(64, 64), pp_degree=2,
                        micro_batches=2, schedule="1f1b", stage_split=(4, 1))
    assert _within(pipe, pipe) == ("; now pipeline (pp2 1f1b m=2, stage split [4, 1], "
                                   "dp_mode dp)")
    assert _within(dp, StrategySpec("zero1", world_size=2, shares=(32, 32))) == ""
