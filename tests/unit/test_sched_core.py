"""elastic.sched_core: the live scheduler's loop over a scripted runner (no Ray): admission,
shrink before anyone takes the workers, grow when a job ends, cancel, a failing job alone."""

from __future__ import annotations

import math
from typing import Any

import pytest

from clusters.sched_policy import (
    FifoStatic,
    JobState,
    Observation,
    ShortestRemaining,
    StarvationGuard,
)
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
        return type("R", (), {"history": [{"step": i} for i in range(int(h.step))]})()

    def stop(self, h: Job) -> None:
        self.log.append(("stop", h.name, h.workers))
        h.stopped = True

    def ended_at(self, h: Job) -> float | None:
        return h.ended_at

    def partial(self, h: Job) -> tuple[list[dict[str, Any]], str | None]:
        return [{"step": i} for i in range(int(h.step))], f"/runs/{h.name}"


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


def test_fifo_static_runs_a_job_asking_for_more_than_the_capacity_within_it():
    """A job asking for 8 workers (min 2, max 8) is accepted by a 4-worker scheduler (its
    min fits): FIFO-static runs it at 4, and the job behind it starts when it ends. Was: it
    was never admitted (8 never free) and blocked every job behind it on an empty cluster."""
    big = JobState("big", 0.0, 100, live_options(1, 8, {}, 32, 1e-3, "dp"), 1, 8, 8)
    assert FifoStatic().decide(Observation(0.0, 4, (big,))).of("big").workers == 4
    c, s = core(FifoStatic())
    c.submit(cfg("big", 40, n=8, lo=2, hi=8))
    c.submit(cfg("next", 10, n=2))
    c.tick()
    assert state(c) == {"big": ("running", 4), "next": ("queued", 0)}
    s.advance(10)  # big: 40 steps at 4 a second
    c.tick()
    assert state(c) == {"big": ("finished", 0), "next": ("running", 2)}
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
    s.advance(1)  # one step trained, then it fails
    s.jobs["c"].fail = True
    c.tick()
    assert state(c)["c"] == ("failed", 0) and "boom" in (c.jobs["c"].error or "")
    # what it trained before it failed is kept (was: steps 0, no history, no run directory)
    res = c.jobs["c"].result
    assert res is not None and len(res.history) == 1 and res.run_dir == "/runs/c"
    assert c.jobs["c"].step == 1
    assert state(c)["a"] == ("running", 2)
    c.submit(cfg("a2", 10, n=2))
    c.tick()
    assert state(c)["a2"] == ("running", 2)


def test_a_job_whose_config_the_scheduler_cannot_rebuild_fails_alone(monkeypatch):
    """A job submitted from a directory whose model module the scheduler's process cannot
    import: its config's check at the start raises. That job fails with the reason; the
    others start. Was: the error left every tick, and every queued job stayed queued behind
    it with workers free (found by a new user, session 48)."""
    from elastic.errors import ConfigError

    real = JobConfig.replace

    def replace(self: JobConfig, **kw: Any) -> JobConfig:
        if self.name == "bad":
            raise ConfigError("model", "cannot import 'mymod_b:slow'", "run from its directory")
        return real(self, **kw)

    monkeypatch.setattr(JobConfig, "replace", replace)
    c, s = core(FifoStatic(backfill=True), capacity=4)
    c.submit(cfg("bad", 10))
    c.submit(cfg("good", 10, n=2))
    c.tick()
    assert state(c) == {"bad": ("failed", 0), "good": ("running", 2)}
    assert "cannot import 'mymod_b:slow'" in (c.jobs["bad"].error or "")


def test_a_queued_jobs_run_directory_is_where_it_was_submitted(tmp_path, monkeypatch):
    """``elastic queue submit`` from one directory to a scheduler started in another: the
    default ``./runs/<name>`` and a relative ``run_dir`` are made absolute where submitted
    (the CLI says where). Was: under the scheduler's (``ray start``'s) directory, found by a
    new user, session 48."""
    from elastic.sched_core import placed

    monkeypatch.chdir(tmp_path)
    default = placed(cfg("jdef", 5))
    assert default.run_dir == str(tmp_path / "runs" / "jdef") and default.job_name == "jdef"
    rel = placed(cfg("jrel", 5).replace(run_dir="myrun"))
    assert rel.run_dir == str(tmp_path / "myrun")
    unnamed = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                        global_batch_size=8, max_steps=5, view="none")
    got = placed(unnamed)
    assert got.job_name == unnamed.job_name and got.run_dir == str(
        tmp_path / "runs" / unnamed.job_name)
    monkeypatch.chdir("/")  # the scheduler's process, elsewhere
    assert got.run_path == str(tmp_path / "runs" / unnamed.job_name)
    fixed = cfg("jabs", 5).replace(run_dir=str(tmp_path / "abs"))
    assert placed(fixed) is fixed


@pytest.mark.parametrize("kw, field", [
    ({"workers": 0}, "workers"), ({"workers": -2}, "workers"), ({"workers": 1.5}, "workers"),
    ({"round_s": -1}, "round_s"), ({"round_s": 0}, "round_s"),
    ({"round_s": float("nan")}, "round_s"), ({"resize_s": -1}, "resize_s"),
    ({"max_wait_s": float("inf")}, "max_wait_s"), ({"warm": -1}, "warm"),
])
def test_a_schedulers_start_settings_are_checked_before_its_actor(kw, field):
    """``elastic.scheduler.start`` checks what the CLI checks (it calls ``check_start``
    first). Was: ``workers=0`` an actor's death with a stack dump, ``round_s=-1`` a
    scheduler spinning a core (found by a new user, session 48)."""
    from elastic.errors import ConfigError
    from elastic.sched_core import check_start

    args = {"workers": 2, "round_s": 2.0, "resize_s": 10.0, "max_wait_s": 1800.0, "warm": 0}
    check_start(**args)
    with pytest.raises(ConfigError) as e:
        check_start(**{**args, **kw})
    assert e.value.field == field and e.value.fix
    with pytest.raises(ConfigError) as e:
        check_start(**{**args, **kw}, cli=True)
    assert e.value.field == "--" + field.replace("_", "-")


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


def _short_then_growing(s: Any) -> SchedulerCore:
    """A core of 4 workers running a short 1-worker job "a" and a long job "b" on the other 3
    that can grow to 4 when "a" ends."""
    c = SchedulerCore(ShortestRemaining(resize_s=0.0, starvation=StarvationGuard(None)), 4, s,
                      clock=lambda: s.t)
    c.submit(cfg("a", 400, n=1, hi=1))
    c.submit(cfg("b", 100_000, n=1, hi=4))
    c.tick()
    assert state(c) == {"a": ("running", 1), "b": ("running", 3)}
    return c


def test_growth_reserves_its_workers_and_the_loop_goes_on_meanwhile():
    s = SlowGrow()
    c = _short_then_growing(s)
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
    assert restore(c2, again, pickle.loads, pickle.dumps) == 2
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
    assert restore(c3, broken, pickle.loads, pickle.dumps) == 0
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
    # a re-run interrupted again before its first checkpoint: the next number (was:
    # <run>.rerun1.rerun1)
    rerun1 = plain.replace(run_dir=str(tmp_path / "p.rerun1"))
    assert _rerun(rerun1).run_path == str(tmp_path / "p.rerun2")


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


def _commit(conf: JobConfig, step: int) -> None:
    import torch

    from elastic.checkpoint import CheckpointMeta, commit, write_shard
    from elastic.checkpoint_io import job_store

    store = job_store(conf)
    commit(store, step, [write_shard(store, step, 0, {"model/w": torch.ones(2)})],
           CheckpointMeta())


def test_a_restored_job_reruns_the_same_way_after_a_second_restart(tmp_path):
    """How a restart runs an interrupted job again is stored with it: a second restart, before
    it was admitted again or while it ran again, goes on from there, with the steps it had.
    Was: decided in memory only, so a job queued again over its own checkpoints started
    with ``resume`` unset (refused: it would write over them, the job failed), one that
    started over in ``<run>.rerun1`` looked in ``<run>`` again and started over in
    ``.rerun2``; and a restored job's step was 0 (SRPT saw all its steps left)."""
    import pickle

    from elastic.sched_store import QueueStore, restore

    db = str(tmp_path / "q.sqlite")

    def scheduler(restart: bool) -> tuple[SchedulerCore, Script, QueueStore]:
        store, s = QueueStore(db), Script()
        c = SchedulerCore(FifoStatic(), 2, s, clock=lambda: s.t,
                          on_change=lambda j: store.update(j.name, j.state, j.row()))
        if restart:
            assert restore(c, store, pickle.loads, pickle.dumps) == 2
        return c, s, store

    c, s, store = scheduler(False)
    for name in ("fresh", "ck"):  # (fifo: fresh first)
        c.submit(cfg(name, 100, n=1, hi=1).replace(run_dir=str(tmp_path / name),
                                                   checkpoint_every=5))
        store.add(name, pickle.dumps(c.jobs[name].cfg), 1000.0 + len(c.jobs))
    c.tick()
    s.advance(30)
    c.tick()
    assert state(c) == {"fresh": ("running", 1), "ck": ("running", 1)}
    _commit(c.jobs["ck"].cfg, 25)  # ck committed a checkpoint; fresh none
    store.close()

    c, s, store = scheduler(True)  # 1st restart: ck resumes, fresh starts over in .rerun1
    assert c.jobs["ck"].cfg.resume == "latest" and c.jobs["ck"].step == 30
    assert c.jobs["fresh"].cfg.run_path == str(tmp_path / "fresh.rerun1")
    assert c.jobs["fresh"].step == 0
    c.capacity = 1
    c.tick()  # fresh runs again (in .rerun1), ck waits
    s.advance(20)
    c.tick()
    assert state(c) == {"fresh": ("running", 1), "ck": ("queued", 0)}
    _commit(c.jobs["fresh"].cfg, 15)  # in .rerun1
    store.close()

    c, s, store = scheduler(True)  # 2nd restart
    assert c.jobs["ck"].cfg.resume == "latest" and c.jobs["ck"].step == 30
    fresh = c.jobs["fresh"]
    assert fresh.cfg.run_path == str(tmp_path / "fresh.rerun1"), "started over again"
    assert fresh.cfg.resume == "latest" and fresh.step == 20
    store.close()


class Model:
    """Stands for a model's tensors (weakly referenced by the test)."""


def test_an_ended_job_keeps_neither_its_controller_nor_its_model():
    """An ended job keeps its history and run directory; its controller (the runner's handle)
    and its final state's other tensors go at once, its final parameters once read (the
    scheduler's ``result``). Was: every ended job's whole result and controller, for the
    life of the scheduler (a sweep of hundreds of trials: a model a trial)."""
    import gc
    import weakref
    from types import SimpleNamespace

    from elastic.scheduler import SchedulerActor

    class Holding(Script):
        def start(self, name: str, conf: Any, workers: int) -> Job:
            h = super().start(name, conf, workers)
            h.controller = Model()  # type: ignore[attr-defined]
            return h

        def result(self, h: Job) -> Any:
            hist = [{"step": i} for i in range(int(h.step))]
            final = {"model/w": Model(), "optimizer/m": Model()}
            self.optimizer = weakref.ref(final["optimizer/m"])
            return SimpleNamespace(history=hist, run_dir="/runs/a", final_state=final,
                                   state_dict=lambda: {"w": final["model/w"]})

    s = Holding()
    c = SchedulerCore(FifoStatic(), 2, s, clock=lambda: s.t)
    c.submit(cfg("a", 10, n=1, hi=1))
    c.tick()
    controller = weakref.ref(s.jobs["a"].controller)  # type: ignore[attr-defined]
    s.advance(20)
    c.tick()
    assert state(c)["a"] == ("finished", 0)
    s.jobs.clear()  # (the scripted runner's own references)
    gc.collect()
    assert controller() is None, "the ended job's controller is kept"
    assert s.optimizer() is None, "the ended job's final state is kept whole"
    res = c.jobs["a"].result
    assert res is not None and res.history[-1] == {"step": 9} and res.run_dir == "/runs/a"
    assert res.params is not None and isinstance(res.params["w"], Model)
    model = weakref.ref(res.params["w"])
    actor = SimpleNamespace(core=c, name="t")
    out = SchedulerActor.result(actor, "a")  # type: ignore[arg-type]
    assert out is not None and out["steps"] == 10 and out["run_dir"] == "/runs/a"
    assert out["state_dict"]["w"] is model()
    del out, res
    gc.collect()
    assert model() is None, "the ended job's parameters are kept after they were read"
    again = SchedulerActor.result(actor, "a")  # type: ignore[arg-type]
    assert again is not None and again["state_dict"] is None and len(again["history"]) == 10
    assert "handed out by an earlier result() call" in again["note"]  # said, not just None


def test_ended_jobs_histories_are_bounded_oldest_let_go_first(monkeypatch):
    """The scheduler keeps ``HISTORY_KEPT`` steps of ended jobs' histories in all: past it,
    the oldest ended jobs keep only their last step (and say where every step is), the job
    that just ended keeps all of its. Was: every ended job's whole history for the
    scheduler's life (~0.45 KB a step: a shared scheduler of a thousand 10k-step jobs held
    4.5 GB in the process that runs the live jobs' controllers)."""
    from types import SimpleNamespace

    import elastic.sched_core as sc
    from elastic.scheduler import SchedulerActor

    monkeypatch.setattr(sc, "HISTORY_KEPT", 25)
    c, s = core(FifoStatic(), capacity=1)
    for name in ("a", "b", "c"):  # one at a time: a ends before b starts
        c.submit(cfg(name, 10, n=1, hi=1))
    for _ in range(3):
        c.tick()
        s.advance(20)
        c.tick()
    assert [state(c)[n][0] for n in "abc"] == ["finished"] * 3
    hist = {n: c.jobs[n].result.history for n in "abc"}  # type: ignore[union-attr]
    assert hist["a"] == [{"step": 9}] and len(hist["b"]) == 10 and len(hist["c"]) == 10
    assert c.jobs["a"].result.dropped == 9  # type: ignore[union-attr]
    assert c.jobs["a"].row()["step"] == 10  # its steps still said
    actor = SimpleNamespace(core=c, name="t")
    out = SchedulerActor.result(actor, "a")  # type: ignore[arg-type]
    assert out is not None and out["steps"] == 10 and out["history"] == [{"step": 9}]
    assert "metrics.jsonl" in out["note"] and "last step" in out["note"]
    assert out["history_dropped"] == 9
    kept = SchedulerActor.result(actor, "c")  # type: ignore[arg-type]
    assert kept is not None and len(kept["history"]) == 10 and "note" not in kept
    # a job whose result was read goes before an older unread one (a sweep's late reader)
    c.submit(cfg("e", 10, n=1, hi=1))
    c.tick()
    s.advance(20)
    c.tick()  # e ended: b (unread) or c (read above) must go; c goes
    assert len(c.jobs["b"].result.history) == 10  # type: ignore[union-attr]
    assert c.jobs["c"].result.history == [{"step": 9}]  # type: ignore[union-attr]
    # one job longer than the bound alone: kept whole while it is the newest
    c.submit(cfg("d", 40, n=1, hi=1))
    c.tick()
    s.advance(60)
    c.tick()
    assert len(c.jobs["d"].result.history) == 40  # type: ignore[union-attr]
    assert all(len(c.jobs[n].result.history) == 1 for n in "abc")  # type: ignore[union-attr]


def test_an_ended_job_keeps_its_configs_numbers_not_its_dataset():
    """A job's config (an SDK job's: its in-memory dataset and code) goes when the job ends,
    whether it finished, failed to start or was cancelled queued; its row and the speed prior
    new jobs get keep reading its numbers. Was: every config for the scheduler's life."""
    import gc
    import weakref

    class Data(RegressionData):
        pass

    c, s = core(FifoStatic(), capacity=1)
    s.refuse_start.add("b")
    refs = []
    for name in ("a", "b", "c", "d"):
        data = Data()
        refs.append(weakref.ref(data))
        conf = cfg(name, 10, n=1, hi=1).replace(dataset=data)
        del data
        c.submit(conf)
        del conf
    c.tick()  # a starts
    s.advance(5)
    c.tick()  # a measured
    assert c.cancel("d") == "queued"
    s.advance(20)
    for _ in range(3):
        c.tick()
    c.cancel("c")
    c.tick()
    s.advance(20)
    c.tick()
    assert [state(c)[n][0] for n in "abcd"] == ["finished", "failed", "cancelled", "cancelled"]
    s.jobs.clear()  # (the scripted runner's own references)
    gc.collect()
    assert [r() for r in refs] == [None] * 4, "an ended job's dataset is kept"
    row = c.jobs["a"].row()
    assert row["max_steps"] == 10 and row["min_workers"] == 1 and row["max_workers"] == 1
    assert c._prior_s_per_sample() > 0  # (a's measured speed, read with its batch size)
    # the scheduler's hook of a job cancelled queued (a trial's pruner) goes too
    import threading
    from types import SimpleNamespace

    from elastic.scheduler import SchedulerActor

    c.submit(cfg("e", 10, n=1, hi=1))
    c.submit(cfg("f", 10, n=1, hi=1))
    c.tick()  # e runs, f waits
    actor = SimpleNamespace(core=c, hooks={"f": object()}, _wake=threading.Event())
    assert SchedulerActor.cancel(actor, "f") == "queued"  # type: ignore[arg-type]
    assert actor.hooks == {}


class LateGrow(Script):
    """The first growth is not answered in time (the runner gives up), and the job grows
    anyway when the test says (its request was still in the controller's inbox)."""

    def __init__(self) -> None:
        super().__init__()
        self.late: tuple[Job, int] | None = None

    def scale(self, h: Job, workers: int) -> int:
        if workers > h.workers and self.late is None:
            self.late = (h, workers)
            raise TimeoutError(f"scale {workers} not answered within 300 s")
        return super().scale(h, workers)

    def answer_late(self) -> None:
        assert self.late is not None
        h, n = self.late
        h.workers = n


def test_a_resize_carried_out_after_its_asker_gave_up_is_counted_where_it_runs():
    """A growth whose answer timed out is carried out later by the job: the next tick counts
    the job at the size it runs at (its status), so its workers are not handed to another
    job. Was: the size from before, for good: a job admitted on workers the grown one
    held (5 of 4)."""
    s = LateGrow()
    c = _short_then_growing(s)
    s.advance(400)  # a ends; b's growth to 4 times out
    c.tick()
    c.wait_resizes(5)
    assert state(c)["b"] == ("running", 3) and "not answered within 300 s" in c.jobs["b"].reason
    s.answer_late()  # ... and b grows at its next boundary
    c.submit(cfg("x", 5, n=1, hi=1))
    c.tick()
    c.wait_resizes(5)
    held = sum(h.workers for n, h in s.jobs.items() if c.jobs[n].state == "running")
    assert held <= 4, state(c)
    assert state(c) == {"a": ("finished", 0), "b": ("running", 3), "x": ("running", 1)}


def test_the_runners_timeout_says_so_and_its_stop_does_not_wait(monkeypatch):
    """A scale the job does not answer in time is a TimeoutError saying so (was: an empty
    queue.Empty: "resize to 4 refused: "); a stop is posted, not waited for (was: up to
    300 s of the scheduler's tick, for a job still placing its workers)."""
    import threading

    import elastic.sched_runner as runner_mod
    from elastic.sched_runner import ControllerRunner, RunningJob

    posted: list[Any] = []
    h = object.__new__(RunningJob)
    h.controller = type("Silent", (), {"post": lambda self, req: posted.append(req)})()
    monkeypatch.setattr(runner_mod, "REPLY_S", 0.05)
    runner = ControllerRunner()
    with pytest.raises(TimeoutError, match="scale 4 not answered within 0.05 s"):
        runner.scale(h, 4)
    done = threading.Event()
    threading.Thread(target=lambda: (runner.stop(h), done.set()), daemon=True).start()
    assert done.wait(2.0), "the stop waited for its answer"
    assert [r.kind for r in posted] == ["scale", "stop"]


def test_a_resumed_jobs_steps_are_its_last_step_not_its_history_length():
    """A job that resumed from its step-50 checkpoint has a history of the steps it ran (50
    to 99): it completed 100. Was: 50 (the history's length)."""

    class Resumed(Script):
        def result(self, h: Job) -> Any:
            return type("R", (), {"history": [{"step": i} for i in range(50, int(h.step))]})()

    s = Resumed()
    c = SchedulerCore(FifoStatic(), 2, s, clock=lambda: s.t)
    c.submit(cfg("a", 100, n=1, hi=1))
    c.tick()
    s.advance(200)
    c.tick()
    assert c.rows()[0]["state"] == "finished" and c.rows()[0]["step"] == 100


def test_a_submitted_job_is_stored_before_a_tick_can_start_it(tmp_path):
    """The scheduler's submit writes the job's row before the loop can see the job: a tick
    that starts it at once leaves it stored running. Was: the row was written after the
    core had the job, so a tick in between started it and the row then said queued (a
    restart then ran it again with its first config, over its own checkpoints)."""
    import threading
    from types import SimpleNamespace

    from elastic.sched_store import QueueStore
    from elastic.scheduler import SchedulerActor

    store = QueueStore(str(tmp_path / "q.sqlite"))
    s = Script()
    ticked: list[bool] = []

    def persist(j):  # the loop's tick comes right after the core has the job
        if not ticked:
            ticked.append(True)
            c.tick()
        store.update(j.name, j.state, j.row())

    c = SchedulerCore(FifoStatic(), 2, s, clock=lambda: s.t, on_change=persist)
    actor = SimpleNamespace(core=c, hooks={}, store=store, _wake=threading.Event())
    actor._stored = lambda blob, j: SchedulerActor._stored(actor, blob, j)  # type: ignore[arg-type]
    unnamed = cfg("x", 10, n=1, hi=1).replace(name=None)
    name = SchedulerActor.submit(actor, unnamed)  # type: ignore[arg-type]
    assert state(c) == {name: ("running", 1)}
    ((stored_name, _, stored, blob, _),) = store.load()
    assert (stored_name, stored) == (name, "running")
    import pickle  # (Ray's cloudpickle: plain pickle reads it)

    assert pickle.loads(blob).name == name  # the name it runs under, chosen once


def test_the_schedulers_shutdown_stops_every_job_at_once_and_waits_for_their_ends():
    """The stops are posted to every running job together (a stop no longer waits for its
    answer), then each job's end is waited for (bounded), its final checkpoint included."""
    import threading
    from types import SimpleNamespace

    from elastic.sched_core import QueuedJob
    from elastic.sched_runner import ControllerRunner, RunningJob
    from elastic.scheduler import SchedulerActor

    c = SchedulerCore(FifoStatic(), 4, ControllerRunner(), clock=lambda: 0.0)
    ends: list[str] = []

    def job(name: str) -> RunningJob:  # ends 0.2 s after its stop is posted
        stopped = threading.Event()
        h = object.__new__(RunningJob)
        h.ended_at = None
        h.controller = SimpleNamespace(post=lambda req: stopped.set())
        h.thread = threading.Thread(target=lambda: stopped.wait(5) and (
            threading.Event().wait(0.2), ends.append(name)), daemon=True)
        h.thread.start()
        return h

    for name in ("a", "b"):
        c.jobs[name] = QueuedJob(name, cfg(name, 10), 0.0, state="running", handle=job(name))
    loop = threading.Thread(target=lambda: None)
    loop.start()
    actor = SimpleNamespace(_stop=threading.Event(), _wake=threading.Event(), _thread=loop,
                            core=c, pool=None)
    SchedulerActor.shutdown(actor)  # type: ignore[arg-type]
    assert sorted(ends) == ["a", "b"]
