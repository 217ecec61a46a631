"""elastic.sched_core: the live scheduler's loop over a scripted runner (no Ray): admission,
shrink before anyone takes the workers, grow when a job ends, cancel, a failing job alone."""

from __future__ import annotations

import math
from typing import Any

import pytest

from clusters.sched_policy import FifoStatic, ShortestRemaining, StarvationGuard
from elastic.config import JobConfig
from elastic.errors import ElasticError
from elastic.sched_core import SchedulerCore, live_options
from tests.helpers import RegressionData, adam, mlp, mse


def cfg(name: str, steps: int, *, n: int = 1, lo: int = 1, hi: int = 4, batch: int = 8
        ) -> JobConfig:
    return JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                     global_batch_size=batch, max_steps=steps, num_workers=n, min_workers=lo,
                     max_workers=hi, view="none", name=name)


class Job:
    def __init__(self, name: str, cfg: JobConfig, workers: int) -> None:
        self.name, self.cfg, self.workers, self.step = name, cfg, workers, 0.0
        self.fail = False
        self.stopped = False
        self.ended_at: float | None = None  # the end the job stamped itself (None: unknown)
        self.phase = "running"  # its controller's phase (status()["state"])


class Script:
    """A runner whose jobs take ``1 / workers`` seconds a step (linear scaling) and advance
    only when the test moves the clock; every call is logged."""

    def __init__(self) -> None:
        self.t = 0.0
        self.log: list[tuple[str, str, int]] = []
        self.jobs: dict[str, Job] = {}
        self.refuse_start: set[str] = set()

    def advance(self, dt: float) -> None:
        for j in self.jobs.values():
            if not self.done(j):
                left = j.cfg.max_steps - j.step
                j.step = min(j.cfg.max_steps, j.step + dt * j.workers)
                if j.step >= j.cfg.max_steps and j.workers:
                    j.ended_at = self.t + left / j.workers
        self.t += dt

    def start(self, name: str, cfg: Any, workers: int) -> Job:
        if name in self.refuse_start:
            raise ElasticError("cannot start")
        assert cfg.num_workers == workers and cfg.scale_check_s > 1e6
        assert cfg.placement == "per_worker"
        assert cfg.grow_when_room is False  # it grows when the scheduler asks, never alone
        self.log.append(("start", name, workers))
        self.jobs[name] = j = Job(name, cfg, workers)
        return j

    def scale(self, h: Job, workers: int) -> int:
        self.log.append(("scale", h.name, workers))
        h.workers = workers
        return workers

    def status(self, h: Job) -> dict[str, Any]:
        return {"step": int(h.step), "world_size": h.workers,
                "samples_per_s": h.cfg.global_batch_size * h.workers, "state": h.phase}

    def done(self, h: Job) -> bool:
        return h.stopped or h.fail or h.step >= h.cfg.max_steps

    def result(self, h: Job) -> Any:
        if h.fail:
            raise RuntimeError("boom")
        return type("R", (), {"history": [0] * int(h.step)})()

    def stop(self, h: Job) -> None:
        self.log.append(("stop", h.name, h.workers))
        h.stopped = True

    def ended_at(self, h: Job) -> float | None:
        return h.ended_at


def core(policy: Any, capacity: int = 4) -> tuple[SchedulerCore, Script]:
    s = Script()
    return SchedulerCore(policy, capacity, s, clock=lambda: s.t), s


def state(c: SchedulerCore) -> dict[str, tuple[str, int]]:
    return {r["job"]: (r["state"], r["workers"]) for r in c.rows()}


def test_live_options_fit_the_measured_step_times():
    # t(n) = 0.2 + 1.6 / n, measured at 1 and 4: recovered at every size
    opts = live_options(1, 8, {1: 1.8, 4: 0.6}, 8, 1e-3, "dp")
    assert [o.workers for o in opts] == list(range(1, 9))
    for o in opts:
        assert o.step_s == pytest.approx(0.2 + 1.6 / o.workers)
    # one size measured: a tenth of it fixed; nothing measured: the prior per sample
    one = {o.workers: o.step_s for o in live_options(1, 4, {2: 1.0}, 8, 1e-3, "dp")}
    assert one[2] == 1.0 and one[4] == pytest.approx(0.1 + 0.9 * 2 / 4)
    prior = {o.workers: o.step_s for o in live_options(2, 2, {}, 100, 0.01, "dp")}
    assert prior[2] == pytest.approx(0.1 + 0.9 / 2)


def test_admission_shrink_to_make_room_and_grow_when_a_job_ends():
    c, s = core(ShortestRemaining(resize_s=0.0, starvation=StarvationGuard(None)))
    c.submit(cfg("long", 400, n=4))
    c.tick()
    c.wait_resizes(5)
    assert state(c) == {"long": ("running", 4)}  # alone: grows to all it uses well
    s.advance(10)
    c.submit(cfg("short", 20, n=2))
    c.tick()
    # the short job goes first; the long one shrinks, and before the short one starts
    assert state(c) == {"long": ("running", 1), "short": ("running", 3)}
    assert s.log[1:] == [("scale", "long", 1), ("start", "short", 3)]
    assert "shrunk 4->1" in c.jobs["long"].reason and math.isfinite(c.jobs["short"].remaining_s)
    s.advance(10)  # short: 20 steps at 3 a second
    c.tick()
    assert state(c) == {"long": ("running", 4), "short": ("finished", 0)}  # reserved at once
    c.wait_resizes(5)
    assert state(c) == {"long": ("running", 4), "short": ("finished", 0)}
    assert s.log[-1] == ("scale", "long", 4)
    assert c.jobs["long"].resizes == 2
    assert c.jobs["short"].worker_s == pytest.approx(20)  # 3 workers, t=10 to its end, 16.7
    assert c.jobs["long"].worker_s == pytest.approx(4 * 10 + 1 * 10)  # to its resize at 20
    s.advance(100)
    assert c.tick() is False and state(c)["long"] == ("finished", 0)


def test_fifo_static_never_resizes():
    c, s = core(FifoStatic())
    c.submit(cfg("a", 100, n=3))
    c.submit(cfg("b", 10, n=2))
    c.tick()
    assert state(c) == {"a": ("running", 3), "b": ("queued", 0)}
    assert "needs 2 workers, 1 free" in c.jobs["b"].reason
    s.advance(40)
    c.tick()
    assert state(c) == {"a": ("finished", 0), "b": ("running", 2)}
    assert not [e for e in s.log if e[0] == "scale"]


def test_cancel_a_queued_and_a_running_job():
    c, s = core(FifoStatic(), capacity=2)
    c.submit(cfg("a", 100, n=2))
    c.submit(cfg("b", 100, n=2))
    c.tick()
    assert c.cancel("b") == "queued" and state(c)["b"] == ("cancelled", 0)
    assert c.cancel("a") == "running"
    c.tick()
    assert ("stop", "a", 2) in s.log and state(c)["a"] == ("cancelled", 0)
    with pytest.raises(ElasticError, match="no job named 'zzz'"):
        c.cancel("zzz")


def test_a_cancel_while_the_job_starts_stops_it(monkeypatch):
    """``cancel`` answers "was queued" while the tick is starting that very job: the job is
    stopped at the next tick and ends cancelled. Was: the start set it running over the
    cancel, and it trained to its end."""
    c, s = core(FifoStatic(), capacity=2)
    c.submit(cfg("a", 100, n=2))
    start = s.start

    def cancelled_meanwhile(name, conf, workers):
        assert c.cancel(name) == "queued"
        return start(name, conf, workers)

    monkeypatch.setattr(s, "start", cancelled_meanwhile)
    c.tick()
    c.tick()
    assert ("stop", "a", 2) in s.log and state(c)["a"] == ("cancelled", 0)


def test_a_cancelled_job_keeps_its_workers_until_its_final_checkpoint_is_done():
    """A cancelled running job answers the stop at its boundary and then takes its final
    checkpoint: until it has ended it is running with its workers (no other job gets them,
    it is not resized), and then it is cancelled, not failed. Was: ended at once; a final
    checkpoint longer than the runner's 60 s wait for the result marked it failed, its
    workers free while it still held them."""
    c, s = core(FifoStatic(), capacity=2)
    c.submit(cfg("a", 100, n=2))
    c.submit(cfg("b", 100, n=2))
    c.tick()
    finishing = {"a"}
    done, result = s.done, s.result

    def still_writing(h):
        return False if h.name in finishing else done(h)

    def not_yet(h):
        if h.name in finishing:
            raise TimeoutError("the job is still running")
        return result(h)

    s.done, s.result = still_writing, not_yet
    assert c.cancel("a") == "running"
    for _ in range(3):
        c.tick()
    assert [e for e in s.log if e[:2] == ("stop", "a")] == [("stop", "a", 2)]  # once
    assert state(c) == {"a": ("running", 2), "b": ("queued", 0)}
    finishing.clear()
    c.tick()
    assert state(c)["a"] == ("cancelled", 0) and state(c)["b"] == ("running", 2)


def test_refusals_and_a_failing_job_does_not_disturb_the_others():
    c, s = core(FifoStatic(backfill=True), capacity=4)
    c.submit(cfg("a", 100, n=2))
    with pytest.raises(ElasticError, match="already queued"):
        c.submit(cfg("a", 5))
    with pytest.raises(ElasticError, match="needs at least 6 workers"):
        c.submit(cfg("huge", 5, n=6, lo=6, hi=6))
    s.refuse_start.add("bad")
    c.submit(cfg("bad", 10))
    c.submit(cfg("c", 100, n=1))
    c.tick()
    assert state(c) == {"a": ("running", 2), "bad": ("failed", 0), "c": ("running", 1)}
    s.jobs["c"].fail = True
    s.advance(1)
    c.tick()
    assert state(c)["c"] == ("failed", 0) and "boom" in (c.jobs["c"].error or "")
    assert state(c)["a"] == ("running", 2)
    c.submit(cfg("a2", 10, n=2))
    c.tick()
    assert state(c)["a2"] == ("running", 2)


class SlowGrow(Script):
    """Growth is answered only when the test says so (new workers starting), or refused."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.release = threading.Event()
        self.refuse = False

    def scale(self, h: Job, workers: int) -> int:
        if workers > h.workers:
            self.log.append(("grow asked", h.name, workers))
            assert self.release.wait(5)
            if self.refuse:
                raise ElasticError(f"cannot scale to {workers} workers")
        return super().scale(h, workers)


def test_growth_reserves_its_workers_and_the_loop_goes_on_meanwhile():
    s = SlowGrow()
    c = SchedulerCore(ShortestRemaining(resize_s=0.0, starvation=StarvationGuard(None)), 4, s,
                      clock=lambda: s.t)
    c.submit(cfg("a", 400, n=1, hi=1))
    c.submit(cfg("b", 100_000, n=1, hi=4))
    c.tick()
    assert state(c) == {"a": ("running", 1), "b": ("running", 3)}
    s.advance(400)  # a ends; b is asked to grow to 4 and its new worker takes a while
    c.tick()
    assert state(c) == {"a": ("finished", 0), "b": ("running", 4)} and c.jobs["b"].busy
    c.submit(cfg("x", 5, n=1, hi=1))  # short: srpt would shrink b for it, but b is mid-resize
    c.tick()
    assert state(c)["x"] == ("queued", 0), "started beyond the free workers"
    assert "a resize to 4 is under way" in c.jobs["b"].reason
    assert c.jobs["x"].reason.startswith("queued")  # the policy saw b pinned at 4
    s.release.set()
    c.wait_resizes(5)
    assert state(c)["b"] == ("running", 4) and c.jobs["b"].resizes == 1
    c.tick()  # now b shrinks for x
    assert state(c)["x"] == ("running", 1) and state(c)["b"] == ("running", 3)


def test_a_refused_growth_leaves_the_job_at_the_size_it_has():
    s = SlowGrow()
    s.refuse = True
    s.release.set()
    c = SchedulerCore(ShortestRemaining(resize_s=0.0), 4, s, clock=lambda: s.t)
    c.submit(cfg("a", 400, n=2, lo=2, hi=2))
    c.submit(cfg("b", 100_000, n=1, hi=4))
    c.tick()
    assert state(c) == {"a": ("running", 2), "b": ("running", 2)}
    s.advance(400)
    c.tick()
    c.wait_resizes(5)
    assert state(c)["b"] == ("running", 2) and "refused" in c.jobs["b"].reason
    assert c.jobs["b"].resizes == 0


def test_the_queue_survives_a_restart_in_sqlite(tmp_path):
    import pickle

    from elastic.sched_store import QueueStore, restore

    store = QueueStore(str(tmp_path / "q.sqlite"))
    s = Script()
    c = SchedulerCore(FifoStatic(), 2, s, clock=lambda: s.t,
                      on_change=lambda j: store.update(j.name, j.state, j.row()))
    for name, n in (("ran", 2), ("waits", 2), ("done", 1)):
        c.submit(cfg(name, 10, n=n).replace(run_dir=str(tmp_path / name)))
        store.add(name, pickle.dumps(c.jobs[name].cfg), 1000.0 + len(c.jobs))
    c.cancel("done")
    c.tick()
    assert state(c) == {"ran": ("running", 2), "waits": ("queued", 0), "done": ("cancelled", 0)}
    store.close()
    # the scheduler's process is gone (and the running job's controller with it)
    again = QueueStore(str(tmp_path / "q.sqlite"))
    s2 = Script()
    c2 = SchedulerCore(FifoStatic(), 2, s2, clock=lambda: s2.t)
    assert restore(c2, again, pickle.loads) == 2
    assert state(c2) == {"ran": ("queued", 0), "waits": ("queued", 0), "done": ("cancelled", 0)}
    assert "was running when the scheduler stopped" in c2.jobs["ran"].reason
    assert c2.jobs["ran"].submitted_s < c2.jobs["waits"].submitted_s  # order kept
    c2.tick()
    assert s2.log == [("start", "ran", 2)] and c2.jobs["ran"].cfg.max_steps == 10
    # it starts over in a new run directory (no checkpoints to resume from)
    assert c2.jobs["ran"].cfg.run_path.endswith("ran.rerun1")
    assert c2.jobs["waits"].cfg.run_path == c.jobs["waits"].cfg.run_path
    broken = QueueStore(str(tmp_path / "b.sqlite"))
    broken.add("x", b"not a pickle", 1.0)
    c3 = SchedulerCore(FifoStatic(), 2, Script(), clock=lambda: 0.0)
    assert restore(c3, broken, pickle.loads) == 0
    assert c3.rows()[0]["state"] == "failed" and "no longer loads" in c3.rows()[0]["error"]


def test_an_interrupted_job_with_checkpoints_resumes_from_its_newest(tmp_path):
    """A job with a committed checkpoint of its own resumes from it (a fork too: from its own
    steps, not its source's again); one without starts as submitted, a fresh one in a new
    run directory. Was: ``resume: latest`` whenever checkpoints were configured, so a job
    interrupted before its first commit failed ("no intact committed checkpoint"), and a
    fork forked again from its source, over its own newer steps."""
    import torch

    from elastic.checkpoint import CheckpointMeta, commit, write_shard
    from elastic.checkpoint_io import job_store
    from elastic.sched_store import _rerun

    ck = cfg("c", 10).replace(run_dir=str(tmp_path / "c"), checkpoint_every=5)
    assert _rerun(ck).resume is None and _rerun(ck).run_path == str(tmp_path / "c.rerun1")
    store = job_store(ck)
    commit(store, 5, [write_shard(store, 5, 0, {"model/w": torch.ones(2)})], CheckpointMeta())
    again = _rerun(ck)
    assert again.resume == "latest" and again.run_path == ck.run_path
    fork = ck.replace(resume=str(tmp_path / "source"))
    assert _rerun(fork).resume == "latest"
    fresh_fork = cfg("f", 10).replace(run_dir=str(tmp_path / "f"), checkpoint_every=5,
                                      resume=str(tmp_path / "source"))
    assert _rerun(fresh_fork) is fresh_fork
    plain = cfg("p", 10).replace(run_dir=str(tmp_path / "p"))
    (tmp_path / "p.rerun1").mkdir()
    assert _rerun(plain).run_path == str(tmp_path / "p.rerun2")


def test_a_job_ends_when_it_ended_not_when_the_loop_noticed():
    """JCT and worker-seconds count to the job's own end: the loop notices it up to a round
    later (measured JCTs were rounded up to the 0.5 s round)."""
    c, s = core(FifoStatic(), 2)
    c.submit(cfg("a", 10, n=1, hi=1))
    c.tick()
    s.advance(15.0)  # it ended at 10 s; the loop looks at 15 s
    c.tick()
    row = c.rows()[0]
    assert row["state"] == "finished" and row["ended_s"] == pytest.approx(10.0)
    assert row["worker_s"] == pytest.approx(10.0)


def test_the_end_counts_no_worker_seconds_past_it_and_a_wrong_stamp_is_not_trusted():
    c, s = core(FifoStatic(), 4)
    c.submit(cfg("a", 10, n=2, hi=2))
    c.submit(cfg("b", 10, n=2, hi=2))
    c.tick()
    s.advance(12.0)  # both ended at 5 s
    c.jobs["a"].hold(8.0)  # counted past its end (a resize answered after it ended)
    s.jobs["b"].ended_at = 99.0  # a stamp from another clock: after "now"
    c.tick()
    a, b = (next(r for r in c.rows() if r["job"] == n) for n in ("a", "b"))
    assert a["ended_s"] == pytest.approx(5.0) and a["worker_s"] == pytest.approx(10.0)
    assert b["ended_s"] == pytest.approx(12.0)  # when the loop noticed, not 99


def test_a_job_whose_thread_is_still_ending_counts_as_done():
    """The end wakes the loop from the job's own thread, before that thread exits: the woken
    loop must see the job done (it saw it a round later)."""
    import threading
    from types import SimpleNamespace

    from elastic.sched_runner import ControllerRunner

    hold = threading.Event()
    t = threading.Thread(target=hold.wait, daemon=True)
    t.start()
    try:
        runner = ControllerRunner()
        assert not runner.done(SimpleNamespace(ended_at=None, thread=t))
        assert runner.done(SimpleNamespace(ended_at=3.0, thread=t))
    finally:
        hold.set()


def test_an_ended_job_has_nothing_left_in_the_queue_list() -> None:
    """``elastic queue list --json`` gave finished jobs the time left last predicted (0.47
    and 1.19 s in a user's queue)."""
    from elastic.sched_core import QueuedJob

    for state in ("finished", "failed", "cancelled"):
        assert QueuedJob("j", None, 0.0, state=state, remaining_s=1.19).row()["remaining_s"] == 0
    assert QueuedJob("j", None, 0.0, state="running", remaining_s=1.19).row()["remaining_s"] == 1.19


def test_a_job_whose_workers_are_still_starting_says_so_in_its_row() -> None:
    """A running job's row carries its controller's phase: "starting" from its start, what
    its status says from the next round on (a cold start took 5 s on a scheduler walked
    live, its row "running 0/300" meanwhile); none once it ended."""
    c, s = core(ShortestRemaining(resize_s=0.0, starvation=StarvationGuard(None)))
    c.submit(cfg("a", 40, n=1))
    c.tick()
    assert c.rows()[0]["phase"] == "starting"
    s.jobs["a"].phase = "placing"
    c.tick()
    assert c.rows()[0]["phase"] == "placing"
    s.jobs["a"].phase = "running"
    s.advance(5)
    c.tick()
    assert c.rows()[0]["phase"] == "running"
    s.advance(100)
    c.tick()
    assert c.rows()[0]["state"] == "finished" and c.rows()[0]["phase"] is None


def test_a_jobs_result_waits_for_its_scheduler_to_come_back(monkeypatch):
    """The scheduler goes away while a job (a sweep's trial) waits on its result, and is
    started again on its queue file: the wait goes on with the new actor; one that does not
    come back within RESTART_WAIT_S is an error naming the fix. Was: the dead actor's error
    ended the caller (a sweep: every trial after it)."""
    from types import SimpleNamespace

    import elastic.scheduler as sched_mod
    from elastic.errors import ActorGoneError

    def handle(*answers):  # an actor handle whose result() gives these in turn
        return SimpleNamespace(result=list(answers))

    def call(method, job):
        out = method.pop(0) if len(method) > 1 else method[0]  # a dead actor stays dead
        if isinstance(out, Exception):
            raise out
        return out

    def lookups(*handles):
        it = iter(handles)

        def lookup(name):
            h = next(it)
            if h is None:  # not back yet
                raise ElasticError(f"no elastic scheduler named {name!r}")
            return h
        return lookup

    monkeypatch.setattr(sched_mod, "call", call)
    monkeypatch.setattr(sched_mod.time, "sleep", lambda s: None)
    monkeypatch.setattr(sched_mod, "lookup", lookups(
        handle(None, ActorGoneError("the actor died")), None,
        handle(None, {"state": "finished"})))
    job = sched_mod.ScheduledJob("default", "t-trial-3")
    assert job.result() == {"state": "finished"}
    monkeypatch.setattr(sched_mod, "RESTART_WAIT_S", 0.0)
    monkeypatch.setattr(sched_mod, "lookup", lookups(handle(ActorGoneError("died")),
                                                     handle(ActorGoneError("died"))))
    with pytest.raises(ElasticError, match="same queue file"):
        job.result()
    # a caller's own timeout holds while the scheduler is away (was: 600 s, the restart wait)
    monkeypatch.setattr(sched_mod, "RESTART_WAIT_S", 1e9)
    monkeypatch.setattr(sched_mod, "lookup", lookups(handle(ActorGoneError("died")),
                                                     *[None] * 5))
    with pytest.raises(TimeoutError, match="not back"):
        job.result(timeout=0.0)


def test_the_queue_file_is_its_owners_only(tmp_path):
    """The queue file keeps each job's config as given, checkpoint credentials included (a
    restarted job needs them): it and its WAL are readable by their owner only. Was: the
    process's umask (0644 here: every user of the host could read the credentials)."""
    import os
    import stat

    from elastic.sched_store import QueueStore

    path = tmp_path / "q.sqlite"
    store = QueueStore(str(path))
    store.add("a", b"config with secret_key=abc", 1.0)
    for f in tmp_path.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    (tmp_path / "old.sqlite").write_bytes(b"")
    os.chmod(tmp_path / "old.sqlite", 0o644)  # a file from before: made the owner's too
    QueueStore(str(tmp_path / "old.sqlite"))
    assert stat.S_IMODE(os.stat(tmp_path / "old.sqlite").st_mode) == 0o600
