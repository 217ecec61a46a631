"""The controller's loop, driven step by step without Ray over a fake worker group: runs,
switches, recoveries, give-ups, requests and scaling, each decided by the same code that
drives a live job (the fake stands in for the workers only)."""

from __future__ import annotations

import os
import queue

import pytest

from elastic.config import JobConfig
from elastic.control import Controller, Request
from elastic.control import sizing as sizing_mod
from elastic.control.hooks import StepHook
from elastic.errors import ConfigError, InfrastructureError, SwitchError, WorkerError
from tests.helpers import RegressionData, adam, mlp, mse
from tests.unit.fake_group import FakeGroup

STEPS = 20


def _cfg(tmp_path, **kw) -> JobConfig:
    base = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                global_batch_size=8, max_steps=STEPS, num_workers=2, view="none",
                run_dir=str(tmp_path / "run"), name="unit")
    base.update(kw)
    return JobConfig(**base)


def _controller(tmp_path, room: int = 0, **kw) -> tuple[Controller, FakeGroup]:
    fake = FakeGroup(mlp(), room=room)
    ctl = Controller(_cfg(tmp_path, **kw), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None)
    return ctl, fake


def _kinds(ctl: Controller) -> list[str]:
    return [e.kind for e in ctl.events if e.kind != "state"]


def test_a_job_runs_to_its_end_through_explicit_states(tmp_path):
    ctl, fake = _controller(tmp_path)
    result = ctl.run()
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert result.final_state == {"model/final": STEPS}
    kinds = _kinds(ctl)
    assert kinds[0] == "start" and kinds[-1] == "finished"
    assert {"placed", "group", "layout"} <= set(kinds)
    moves = [(e.data["from"], e.data["to"]) for e in ctl.events if e.kind == "state"]
    assert moves[:4] == [("starting", "placing"), ("placing", "forming"),
                         ("forming", "running"), ("running", "at_boundary")]
    assert moves[-2:] == [("at_boundary", "finishing"), ("finishing", "finished")]
    assert fake.closed
    assert (tmp_path / "run" / "events.jsonl").read_text().count('"kind": "state"') == len(moves)


def test_switch_at_switches_at_its_step(tmp_path):
    ctl, fake = _controller(tmp_path, switch_at={8: "zero3"})
    result = ctl.run()
    assert ("segment", (0, 8)) in fake.calls and ("segment", (8, STEPS)) in fake.calls
    assert [c for c in fake.calls if c[0] == "build"] == [("build", "dp"), ("build", "zero3")]
    assert result.history[-1]["strategy"] == "zero3"
    sw = [e for e in ctl.events if e.kind == "switch"]
    assert len(sw) == 1 and sw[0].step == 8 and sw[0].data["state_preserved"]


def test_node_lost_under_dp_recovers_from_peers_losing_no_step(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, max_workers=3)
    fake.fail(step=7, rank=1, kind="lost")
    result = ctl.run()
    assert [h["step"] for h in result.history] == list(range(STEPS))
    rec = [e for e in ctl.events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["source"] == "peers" and rec[0].data["steps_lost"] == 0
    assert rec[0].data["world_size"] == 2 and ("restore_from_peers", 7) in fake.calls
    fail = next(e for e in ctl.events if e.kind == "failure")
    assert fail.data["kind"] == "node_lost" and fail.data["dead_ranks"] == [1]
    assert result.history[-1]["world_size"] == 2 and ctl.failures == 1
    # the events say where training was, not the segment's first step (0 here)
    assert (fail.step, rec[0].step) == (7, 7), (fail.step, rec[0].step)


def test_a_worker_lost_during_a_scheduled_switch_is_a_failure_and_the_switch_still_runs(
        tmp_path, monkeypatch):
    """A worker dies while the job switches to zero1 at step 4 (``switch_at``): a loss,
    recovered, and the switch then runs. Was: reported as a refused switch
    (``switch_failed``), the job trained on in dp, and the switch was skipped for the rest
    of the run."""
    from elastic.errors import WorkerLostError

    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, switch_at={4: "zero1"})
    build, lost = fake.build, []

    def lost_in_switch(spec):
        if spec.name == "zero1" and not lost:
            lost.append(spec.name)
            fake.fw(fake.workers[1]).alive = False
            raise WorkerLostError("rank 1's process is gone", rank=1)
        return build(spec)

    monkeypatch.setattr(fake, "build", lost_in_switch)
    result = ctl.run()
    assert "recovered" in _kinds(ctl) and "switch_failed" not in _kinds(ctl)
    assert [h["strategy"] for h in result.history][4:] == ["zero1"] * (STEPS - 4)
    assert [h["step"] for h in result.history] == list(range(STEPS))
    # torch.distributed refusing the layout itself (every worker alive): a refused switch,
    # not a recovery that would switch into the same refusal and give up
    from elastic.errors import GroupError

    ctl, fake = _controller(tmp_path / "b", num_workers=3, min_workers=1,
                            switch_at={4: "zero1"})
    build = fake.build

    def refused(spec):
        if spec.name == "zero1":
            err = GroupError("rank 0: the process group failed (ValueError: bad mesh)")
            err.transport = False
            raise err
        return build(spec)

    monkeypatch.setattr(fake, "build", refused)
    result = ctl.run()
    assert "switch_failed" in _kinds(ctl) and "recovered" not in _kinds(ctl)
    assert {h["strategy"] for h in result.history} == {"dp"} and len(result.history) == STEPS


def test_a_node_lost_during_the_final_gather_is_recovered(tmp_path, monkeypatch):
    """The last step is done and rank 1's node goes while the final state is gathered (seen
    in bench/stress_node_loss.py: the job failed after training every step): the job
    recovers as after any loss and gathers the final state from the survivors."""
    from elastic.errors import WorkerLostError

    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, max_workers=3)
    real, lost = fake.final_state, []

    def final_state():
        if not lost:
            lost.append(1)
            fake.fw(fake.workers[1]).alive = False
            raise WorkerLostError("worker rank 1 died with its node", rank=1, node_lost=True)
        return real()

    monkeypatch.setattr(fake, "final_state", final_state)
    result = ctl.run()
    rec = [e for e in ctl.events if e.kind == "recovered"]
    assert len(rec) == 1 and rec[0].data["world_size"] == 2 and rec[0].data["steps_lost"] == 0
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert result.final_state == {"model/final": STEPS} and ctl.state.value == "finished"


def test_a_lost_shard_without_checkpoint_restarts_from_scratch_and_says_so(tmp_path):
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=1)
    fake.fail(step=5, rank=0, kind="lost")
    result = ctl.run()
    rec = next(e for e in ctl.events if e.kind == "recovered")
    assert rec.data["source"] == "scratch" and rec.data["steps_lost"] == 5
    assert ("restart_fresh", 0) in fake.calls
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_a_lost_shard_restores_the_newest_checkpoint(tmp_path, monkeypatch):
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=1)
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", lambda self: (4, 2))
    fake.fail(step=6, rank=1, kind="lost")
    ctl.run()
    rec = next(e for e in ctl.events if e.kind == "recovered")
    assert rec.data["source"] == "checkpoint" and rec.data["steps_lost"] == 2
    assert ("restore_checkpoint", 4) in fake.calls


def test_a_storage_outage_in_a_recovery_ends_the_job_instead_of_restarting_it(tmp_path,
                                                                              monkeypatch):
    """A lost shard while the storage fails (a listing, or every read): the job ends on the
    ``StorageError``, its checkpoints untouched and none taken for corrupt. Was: each step
    read was marked bad and the job restarted from step 0 (a listing failure: at once),
    writing its steps over the intact checkpoints as it went."""
    from elastic.errors import StorageError

    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=1)
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", lambda self: (4, 2))

    def unreachable(spec, step, store=None):
        fake.calls.append(("restore_checkpoint", step))
        raise StorageError("reading step-000000000004 failed: connection refused")

    monkeypatch.setattr(fake, "restore_checkpoint", unreachable)
    fake.fail(step=6, rank=1, kind="lost")
    with pytest.raises(StorageError, match="connection refused"):
        ctl.run()
    assert ("restore_checkpoint", 4) in fake.calls and ("restart_fresh", 0) not in fake.calls
    assert ctl.tracker.bad_steps == set() and "recovered" not in _kinds(ctl)

    def no_listing(self):
        raise StorageError("listing checkpoints failed: connection refused")

    ctl, fake = _controller(tmp_path / "b", strategy="zero2", num_workers=2, min_workers=1)
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", no_listing)
    fake.fail(step=6, rank=1, kind="lost")
    with pytest.raises(StorageError, match="listing"):
        ctl.run()
    assert ("restart_fresh", 0) not in fake.calls
    # under dp every entry has a live holder: the outage does not matter, it recovers
    ctl, fake = _controller(tmp_path / "c", strategy="dp", num_workers=2, min_workers=1)
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", no_listing)
    fake.fail(step=6, rank=1, kind="lost")
    ctl.run()
    assert next(e for e in ctl.events if e.kind == "recovered").data["source"] == "peers"


def test_user_code_error_fails_at_once_with_its_traceback(tmp_path):
    ctl, fake = _controller(tmp_path)
    fake.fail(step=3, rank=1, kind="user")
    with pytest.raises(WorkerError, match="bad on purpose"):
        ctl.run()
    assert "recovered" not in _kinds(ctl) and _kinds(ctl)[-1] == "failed"
    assert fake.closed and ctl.state.value == "failed"


def test_a_user_code_error_keeps_the_steps_done_before_it_and_says_where(tmp_path):
    """Rank 1's loss raises at step 5; the controller last heard from the workers before
    step 0 (live, polls are seconds apart). Was: steps 0-4 lost (no history, no
    metrics.jsonl, ``on_step`` never called) and the failure said step 0."""
    seen: list[int] = []
    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=lambda h: seen.append(h["step"]))
    fake.steps_per_poll = 10
    fake.fail(step=5, rank=1, kind="user")
    with pytest.raises(WorkerError, match="at step 5: ValueError: bad on purpose"):
        ctl.run()
    assert [h["step"] for h in ctl.history] == seen == [0, 1, 2, 3, 4]
    assert [(e.kind, e.step) for e in ctl.events if e.kind in ("failure", "failed")] == [
        ("failure", 5), ("failed", 5)]


def test_a_lost_workers_failure_keeps_the_steps_done_before_it_and_says_where(tmp_path):
    """Rank 2 is lost at step 5 while the controller last heard from the workers before step
    0; then, under max_failures 1, rank 1 at step 9. Each failure event says where the job
    was (5; 9), the recovery counts the steps run again from there, and the steps trained
    before the give-up are kept. Was: 'failure' at step 0 and 'failed' at step 5, steps 5-8
    missing from the history (found by a new user, session 48)."""
    seen: list[int] = []
    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path, num_workers=3, min_workers=1, max_failures=1),
                     group_factory=lambda cfg: fake, mailbox_factory=lambda job: None,
                     on_step=lambda h: seen.append(h["step"]))
    fake.steps_per_poll = 10
    fake.fail(step=5, rank=2)
    fake.fail(step=9, rank=1)
    with pytest.raises(InfrastructureError, match="giving up after 2 failures"):
        ctl.run()
    assert [h["step"] for h in ctl.history] == seen == list(range(9))
    assert [(e.kind, e.step) for e in ctl.events if e.kind in ("failure", "failed")] == [
        ("failure", 5), ("failure", 9), ("failed", 9)], [
        (e.kind, e.step, e.message[:80]) for e in ctl.events]


def test_failure_budget_gives_up_with_the_fix(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, max_failures=1)
    fake.fail(step=3, rank=2)
    fake.fail(step=9, rank=1)
    with pytest.raises(InfrastructureError, match="giving up after 2 failures.*max_failures"):
        ctl.run()


@pytest.mark.parametrize("max_failures", [-1, 5])
def test_a_failure_that_comes_back_where_it_was_ends_the_job_as_the_jobs(tmp_path, max_failures):
    # a collective refusing what a layout handed it fails the group at the same step with
    # every worker alive, again after every recovery: it was retried to the budget, then
    # blamed on the cluster (and never ended at max_failures: -1)
    ctl, fake = _controller(tmp_path, num_workers=2, min_workers=1, max_failures=max_failures)
    for rank in (1, 0, 1):  # whichever rank reports it first
        fake.fail(step=5, rank=rank, kind="refused")
    with pytest.raises(InfrastructureError, match="same failure came back at step 5 after a "
                       "recovery, 2 times in a row, and no worker was lost.*not the cluster"):
        ctl.run()
    assert len([e for e in ctl.events if e.kind == "recovered"]) == 1


def test_group_failures_at_other_steps_or_with_a_worker_lost_are_recovered(tmp_path):
    # a refusal at another step, a transport's failure (a degraded link times out at the
    # same step again), a worker lost: none is the job's
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, max_failures=-1)
    fake.fail(step=4, rank=1, kind="refused")
    fake.fail(step=7, rank=1, kind="refused")
    for _ in range(3):
        fake.fail(step=8, rank=1, kind="group")
    fake.fail(step=9, rank=2, kind="lost")
    fake.fail(step=9, rank=1, kind="lost")
    result = ctl.run()
    assert len([e for e in ctl.events if e.kind == "recovered"]) == 7
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_below_min_workers_waits_then_gives_up(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=2, min_workers=2, min_workers_timeout_s=0.01)
    fake.fail(step=4, rank=1)
    with pytest.raises(InfrastructureError, match="fewer than min_workers=2"):
        ctl.run()
    assert "waiting" in _kinds(ctl)


def test_below_min_workers_a_replacement_placed_in_the_wait_saves_the_job(tmp_path):
    ctl, fake = _controller(tmp_path, room=1, num_workers=2, min_workers=2,
                            min_workers_timeout_s=5)
    fake.fail(step=4, rank=1)
    result = ctl.run()
    assert result.history[-1]["world_size"] == 2
    assert "waiting" in _kinds(ctl) and "joined" in _kinds(ctl)


def test_a_hung_rank_is_treated_as_lost(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1)
    fake.fail(step=6, rank=2, kind="hang")
    ctl.run()
    assert "hang" in _kinds(ctl)
    fail = next(e for e in ctl.events if e.kind == "failure")
    assert fail.data["kind"] == "hang" and fail.data["dead_ranks"] == [2]


def _ask(ctl: Controller, kind: str, value=None) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    ctl.post(Request(kind, value, "test", reply=q))
    return q


def test_malformed_requests_are_refused_and_the_job_goes_on(tmp_path):
    ctl, fake = _controller(tmp_path, min_workers=1, max_workers=3)
    bad = [_ask(ctl, "scale", "abc"), _ask(ctl, "scale", None), _ask(ctl, "scale", 2.9),
           _ask(ctl, "explode"), _ask(ctl, "switch", 7), _ask(ctl, "scale", 9)]
    result = ctl.run()
    assert len(result.history) == STEPS
    answers = [q.get_nowait() for q in bad]
    assert all(isinstance(a, Exception) for a in answers), answers
    assert "whole number" in str(answers[0]) and "outside min_workers..max_workers" in str(
        answers[5])


def test_stop_request_ends_the_job_at_a_boundary(tmp_path):
    ctl, fake = _controller(tmp_path)
    q = _ask(ctl, "stop")
    result = ctl.run()
    assert q.get_nowait() == "stopped" and len(result.history) < STEPS
    assert "stopped" in _kinds(ctl)


def test_on_step_true_stops_the_job(tmp_path):
    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=lambda e: e["step"] >= 4)
    result = ctl.run()
    assert len(result.history) < STEPS


class _Pauses(StepHook):
    def __init__(self, at: list[int]) -> None:
        self.at = at

    def pause_after(self, step: int) -> int | None:
        return next((g for g in self.at if g >= step), None)


def test_pause_after_ends_segments_there_and_a_stop_then_costs_no_step(tmp_path):
    """A sweep's pruner decides at known steps: the workers pause after each, so the stop
    ``on_step`` returns there lands before any further step."""
    fake = FakeGroup(mlp())
    gates = [3, 7, 11]
    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=lambda e: e["step"] == 7,
                     hook=_Pauses(gates))
    result = ctl.run()
    assert [h["step"] for h in result.history] == list(range(8))  # nothing past step 7
    assert [c[1] for c in fake.calls if c[0] == "segment"] == [(0, 4), (4, 8)]
    # without a stop the job runs to its end, pausing at each decision step
    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path, run_dir=str(tmp_path / "run2")), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=lambda e: False,
                     hook=_Pauses(gates))
    assert len(ctl.run().history) == STEPS
    assert [c[1] for c in fake.calls if c[0] == "segment"] == [(0, 4), (4, 8), (8, 12),
                                                             (12, STEPS)]


def test_a_pruners_gate_reaches_the_workers_before_the_segment_and_once_per_version(tmp_path):
    """``gate(step)`` (a sweep's median pruner, decided by the workers): handed to the group
    before a segment starts (the decision step may come before the first poll), and again
    only when the hook has a new one."""
    from clusters.sweep_policy import PruneGate

    class Gates(_Pauses):
        def gate(self, next_step: int) -> PruneGate:
            return PruneGate(9, 1.0, None, next_step - 1, False, 1 if next_step < 5 else 2)

    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=lambda e: False,
                     hook=Gates([4]))
    assert len(ctl.run().history) == STEPS
    order = [c for c in fake.calls if c[0] in ("gate", "segment")]
    assert order == [("gate", 1), ("segment", (0, 5)), ("gate", 2), ("segment", (5, STEPS))]


def test_scale_up_waits_for_spares_without_pausing_then_refuses(tmp_path, monkeypatch):
    """A growth the cluster cannot meet is refused after a bounded wait, saying why; training
    went on meanwhile (no placement wait at the boundary)."""
    monkeypatch.setattr(sizing_mod, "SCALE_WAIT_S", 0.0)
    ctl, fake = _controller(tmp_path, room=0, min_workers=1, max_workers=4)
    q = _ask(ctl, "scale", 4)
    result = ctl.run()
    ans = q.get_nowait()
    assert isinstance(ans, SwitchError) and "cannot scale to 4" in str(ans)
    assert len(result.history) == STEPS and result.history[-1]["world_size"] == 2


@pytest.mark.parametrize("strategy", ["dp", "auto"])
def test_scale_up_takes_spares_in_at_a_boundary(tmp_path, strategy):
    """Under ``auto`` the grown group is planned for anew (it had failed: the traits table
    has no "auto")."""
    ctl, fake = _controller(tmp_path, room=1, min_workers=1, max_workers=3, strategy=strategy)
    q = _ask(ctl, "scale", 3)
    result = ctl.run()
    assert q.get_nowait() == 3
    assert result.history[-1]["world_size"] == 3
    scaled = next(e for e in ctl.events if e.kind == "scaled")
    assert scaled.data["source"] == "peers"
    if strategy == "auto":
        plans = _events(ctl, "plan")
        assert len(plans) == 2 and " on 3 x " in plans[1].message, [e.message for e in plans]


def _frozen_mlp():
    model = mlp()
    for p in model[0].parameters():  # fine-tuning: the first layer frozen
        p.requires_grad_(False)
    return model


def test_a_model_with_a_frozen_layer_recovers_from_peers(tmp_path):
    """A frozen parameter has no optimizer state on any rank: the state is whole without
    it. After a loss the survivors' replicas restore it. Was: the restore asked for Adam's
    entries of every parameter, found no holder of the frozen one's, and trained again from
    the last checkpoint (or from step 0 without one) though every survivor held the state."""
    fake = FakeGroup(_frozen_mlp())
    ctl = Controller(_cfg(tmp_path, model=_frozen_mlp, num_workers=3, min_workers=1),
                     group_factory=lambda cfg: fake, mailbox_factory=lambda job: None)
    fake.fail(step=7, rank=1, kind="lost")
    result = ctl.run()
    rec = next(e for e in ctl.events if e.kind == "recovered")
    assert rec.data["source"] == "peers", rec.message
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_a_growth_takes_the_state_there_is_when_a_parameter_has_no_optimizer_state(tmp_path):
    """zero1: a trainable parameter that never had a gradient has no Adam state on any rank.
    A planned growth holds everything there is (every old rank took the full snapshot), so
    its state comes from the peers. Was: the restore asked for Adam's entries of every
    trainable parameter, found none for that one, and restarted the job from step 0 (its
    history then kept the discarded run's steps)."""
    fake = FakeGroup(mlp(), room=1)
    fake.params = fake.params[:-1]  # the last parameter has no optimizer state anywhere
    ctl = Controller(_cfg(tmp_path, strategy="zero1", min_workers=1, max_workers=3),
                     group_factory=lambda cfg: fake, mailbox_factory=lambda job: None)
    q = _ask(ctl, "scale", 3)
    result = ctl.run()
    assert q.get_nowait() == 3 and result.history[-1]["world_size"] == 3
    scaled = next(e for e in ctl.events if e.kind == "scaled")
    assert scaled.data["source"] == "peers", scaled.message
    assert ("restart_fresh", 0) not in fake.calls


def test_a_resize_lets_the_checkpoint_in_flight_end_and_one_that_gives_up_keeps_the_group(
        tmp_path, monkeypatch):
    """When a resize gives up (the spare that was up is gone), the group goes on and its later
    checkpoints are tracked as before. An earlier version of the resize's wait for the
    checkpoint in flight voided every report of the group's checkpoints there, so none was
    ever committed again (found in review). The wait itself: tests/integration/
    test_checkpoint_job.py::test_a_resize_during_an_upload_keeps_checkpointing."""
    monkeypatch.setattr(sizing_mod, "SCALE_WAIT_S", 0.0)
    for spare_dies in (False, True):
        ctl, fake = _controller(tmp_path / str(spare_dies), room=1, min_workers=1,
                                max_workers=3, checkpoint_every=5)
        fake.checkpoint_every = 5
        if spare_dies:
            monkeypatch.setattr(fake, "take_spares", lambda n: [])
        _ask(ctl, "scale", 3)
        result = ctl.run()
        ended = [c[1][0] for c in fake.calls if c[0] == "checkpoint_done"]
        assert ended == [5, 10, 15, 20], (spare_dies, fake.calls)  # each carried to its end
        assert result.history[-1]["world_size"] == (2 if spare_dies else 3)


class _Roomy:
    """A worker group of 2 for ``Sizing.check``: ``spares`` ready, ``room`` to start more."""

    workers = [0, 1]

    def __init__(self, spares: int = 2, room: bool = True) -> None:
        self.spares, self.roomy, self.kept = spares, room, -1

    def spares_ready(self) -> int:
        return self.spares

    def spares_starting(self) -> int:
        return 0

    def room(self) -> bool:
        return self.roomy

    def trim_slots(self, keep: int) -> int:
        self.kept = keep
        return 0


def test_a_job_that_grows_only_when_asked_leaves_room_alone(tmp_path):
    """``grow_when_room: false`` (an elastic scheduler's jobs): its target is ``num_workers``,
    so room and ready spares do not grow it; by default a job grows toward ``max_workers``.
    A scheduled job grew by itself into workers its scheduler had given the next job, which
    then could not be placed (bench/scheduler.py with warm workers)."""
    from elastic.control.requests import Inbox
    from elastic.control.sizing import Sizing

    for grow, target, kind in ((True, 4, "grow"), (False, 2, None)):
        cfg = _cfg(tmp_path, min_workers=1, max_workers=4, grow_when_room=grow)
        sizing = Sizing(cfg, Inbox(None, lambda *a, **k: None))
        group = _Roomy()
        req = sizing.check(group)
        assert sizing.target == target and (req.kind if req else None) == kind, grow
        # the reserved slots it keeps: what it may still grow into (none at its target)
        assert group.kept == target - 2, grow


def test_a_growth_that_carries_out_a_scale_asked_for_says_so(tmp_path):
    """A scale up asked through the SDK is parked until its spares are up; the growth that
    then takes them in carries the scale's reason. Was: "(a node with room joined)" in the
    ``scaled`` event, naming no request (found by new users, sessions 48 and 49)."""
    from elastic.control.requests import Inbox, Request
    from elastic.control.sizing import Sizing

    inbox = Inbox(None, lambda *a, **k: None)
    sizing = Sizing(_cfg(tmp_path, min_workers=1, max_workers=3), inbox)
    assert sizing.check(_Roomy(1, False)).reason == "a node with room joined"  # none asked
    inbox.park(Request("scale", 3, reason="requested by the SDK"), 1e18)
    assert sizing.check(_Roomy(1, False)).reason == "requested by the SDK"


def test_a_recovery_replaces_workers_up_to_the_size_asked_for_not_past_it(tmp_path):
    """A job of 3 scaled down to 2 (the scheduler gave a worker to another job) loses one: the
    recovery places a replacement up to 2, not 3. Was: up to ``num_workers``, taking back the
    worker the scheduler had given away."""
    ctl, fake = _controller(tmp_path, room=4, num_workers=3, min_workers=1,
                            replacement_timeout_s=5)
    q = _ask(ctl, "scale", 2)
    fake.fail(step=10, rank=0, kind="lost")
    result = ctl.run()
    assert q.get_nowait() == 2 and "recovered" in _kinds(ctl)
    assert [h["world_size"] for h in result.history][-1] == 2
    assert max(h["world_size"] for h in result.history[10:]) == 2


def test_scale_down(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1)
    q = _ask(ctl, "scale", 1)
    result = ctl.run()
    assert q.get_nowait() == 1 and result.history[-1]["world_size"] == 1


def test_a_request_whose_handling_fails_is_answered_and_the_job_recovers(tmp_path,
                                                                         monkeypatch):
    """A worker is lost while a scale-down takes its snapshot: the asker hears why at once and
    the job recovers, to the survivors (its target back to what it was before the request). Was: the request, taken off the inbox, was never answered (the SDK
    waited out its 300 s; the scheduler's tick, which waits on its shrinks, with it)."""
    from elastic.errors import GroupError

    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1)

    def lost_meanwhile() -> None:
        fake.fw(fake.workers[2]).alive = False
        raise GroupError("rank 2 left the group during the snapshot")

    monkeypatch.setattr(fake, "snapshot_full", lost_meanwhile)
    q = _ask(ctl, "scale", 1)
    result = ctl.run()
    answer = q.get_nowait()
    assert isinstance(answer, GroupError) and "snapshot" in str(answer)
    assert "recovered" in _kinds(ctl) and len(result.history) == STEPS
    # the asker was told the scale failed: the job's target is what it was before it (was:
    # 1, and the recovery shrank the job to the size it had been told it did not get)
    assert ctl.sizing.target == 3 and result.history[-1]["world_size"] == 2


def test_a_request_taken_and_never_answered_is_answered_when_the_job_ends():
    """A request whose handling gave up (an evacuation's ``GiveUp`` ends the job) was taken
    off the inbox: the job's end answers it too. Was: only queued and parked ones were, and
    its asker waited out its timeout."""
    from elastic.control.requests import Inbox

    inbox = Inbox(None, lambda *a, **k: None)
    q: queue.Queue = queue.Queue()
    inbox.post(Request("evacuate", {"node": "abc"}, "test", reply=q))
    assert inbox.take() is not None
    inbox.close(SwitchError("the job ended (failed) before the request was handled"), {})
    assert isinstance(q.get_nowait(), SwitchError)


def test_sigterm_stops_at_a_boundary_with_a_record_and_a_distinct_code(tmp_path):
    import os
    import signal

    from elastic.errors import InterruptedJobError

    fake = FakeGroup(mlp())

    def on_step(entry):
        if entry["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=on_step)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(InterruptedJobError) as info:
        ctl.run()
    assert info.value.exit_code == 128 + signal.SIGTERM
    assert info.value.result.status == "interrupted" and 4 <= len(info.value.result.history) < 8
    assert "interrupted" in _kinds(ctl) and fake.closed
    assert signal.getsignal(signal.SIGTERM) is before  # the program's handler is back
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"kind": "interrupted"' in events


def test_a_second_signal_stops_at_once(tmp_path):
    import os
    import signal

    fake = FakeGroup(mlp())

    def on_step(entry):
        if entry["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    ctl = Controller(_cfg(tmp_path), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None, on_step=on_step)
    with pytest.raises(KeyboardInterrupt):
        ctl.run()
    assert fake.closed


def test_a_checkpoint_of_non_finite_state_is_never_committed(tmp_path):
    fake = FakeGroup(mlp())
    fake.checkpoint_every = 5
    fake.nonfinite_at = {10: ["model/0.weight"]}
    ctl = Controller(_cfg(tmp_path, checkpoint_every=5), group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: None)
    ctl.run()
    refused = [e for e in ctl.events if e.kind == "checkpoint_refused"]
    assert len(refused) == 1 and refused[0].data["step"] == 10
    assert "model/0.weight" in refused[0].message
    assert ("checkpoint_done", (10, False)) in fake.calls
    assert all(e.data["step"] != 10 for e in ctl.events if e.kind == "checkpoint")


def test_a_non_finite_step_stops_the_job_naming_step_and_rank(tmp_path):
    from elastic.errors import NonFiniteError

    ctl, fake = _controller(tmp_path, on_nonfinite="stop")
    fake.fail(step=6, rank=1, kind="nonfinite")
    with pytest.raises(NonFiniteError, match="step 6") as info:
        ctl.run()
    assert info.value.rank == 1 and info.value.step == 6
    assert "recovered" not in _kinds(ctl) and fake.closed
    # a failure in a step, not a WorkerError, is no failure "before any step ran"
    failed, = [e for e in ctl.events if e.kind == "failed"]
    assert failed.data["in_step"] is True


def test_a_failure_before_any_step_is_said_so(tmp_path):
    """A check of the start (here a layout that cannot run) fails before any step; the
    ``failed`` event says so (the plain view prints "failed before any step ran")."""
    from elastic.errors import ElasticError

    ctl, _ = _controller(tmp_path, strategy="pipeline", pp_degree=3)
    with pytest.raises(ElasticError):
        ctl.run()
    failed, = [e for e in ctl.events if e.kind == "failed"]
    assert failed.data["in_step"] is False


def test_rollback_restores_the_newest_checkpoint_once_per_step(tmp_path, monkeypatch):
    from elastic.errors import NonFiniteError

    ctl, fake = _controller(tmp_path, on_nonfinite="rollback")
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", lambda self: (10, 5))
    fake.fail(step=7, rank=0, kind="nonfinite-rollback")
    fake.fail(step=12, rank=1, kind="nonfinite-rollback")
    result = ctl.run()
    back = [e for e in ctl.events if e.kind == "rolled_back"]
    assert [(e.data["from"], e.data["to"]) for e in back] == [(7, 5), (12, 10)]
    assert ("restore_checkpoint", 5) in fake.calls and ("restore_checkpoint", 10) in fake.calls
    assert [h["step"] for h in result.history] == list(range(STEPS))
    assert ctl.failures == 0  # a rollback is not a lost worker
    # the same step non-finite again after its rollback: the data brings it back, stop
    ctl2, fake2 = _controller(tmp_path / "again", on_nonfinite="rollback")
    monkeypatch.setattr(type(ctl2.tracker), "valid_steps", lambda self: (5,))
    fake2.fail(step=7, rank=0, kind="nonfinite-rollback")
    fake2.fail(step=7, rank=0, kind="nonfinite-rollback")
    with pytest.raises(NonFiniteError):
        ctl2.run()
    assert len([e for e in ctl2.events if e.kind == "rolled_back"]) == 1


# ------------------------------------------------------------------ the closed loop


def test_auto_replans_to_a_faster_plan_when_the_running_one_measures_slow(tmp_path):
    """``strategy: auto`` plans zero1 from what the workers measured (a dear optimizer that
    ZeRO shares out, its owners' broadcasts cheap; zero1 and zero2 predicted alike, and the
    simpler one wins the tie); its steps then measure 5x what dp's take. At the closed loop's
    cadence the re-fitted model puts the excess on zero1's own messages, predicts dp faster,
    and the switch is carried out and said with the numbers."""
    ctl, fake = _controller(tmp_path, strategy="auto", max_steps=60, replan_every=10)
    fake.alpha.update(all_reduce=3e-3, reduce=1e-5, broadcast=1e-5, all_gather=20e-3,
                      reduce_scatter=20e-3, p2p=50e-3)
    fake.opt_cost = (5e-5, 5e-6)  # zero1 predicted ~9 % under dp: beyond the trial tolerance
    fake.step_times = {"zero1": 0.05, "dp": 0.01}
    result = ctl.run()
    plan = next(e for e in ctl.events if e.kind == "plan")
    assert plan.message.startswith("chose zero1"), plan.message
    assert plan.data["profile_s"] > 0 and plan.data["plan_s"] > 0  # what auto's start cost
    assert [c for c in fake.calls if c[0] == "build"][:2] == [("build", "zero1"), ("build", "dp")]
    replans = [e for e in ctl.events if e.kind == "replan"]
    # decided while the segment runs, once 10 steps past the 2 of warm-up are measured
    switch = replans[0]
    assert switch.step == 12 and switch.data["decision"] == "SwitchPlan"
    assert switch.data["current"] == "zero1" and switch.data["step_s"] == pytest.approx(0.05)
    dp = dict(switch.data["candidates"])["dp"]
    assert dp < 0.02 and "dp predicted" in switch.message and "> switch" in switch.message
    sw = next(e for e in ctl.events if e.kind == "switch")
    assert sw.data["reason"] == "replan" and sw.step == 13  # the workers stopped a step on
    assert [h["strategy"] for h in result.history][13:] == ["dp"] * 47
    assert [h["strategy"] for h in result.history][:13] == ["zero1"] * 13
    # dp measures faster than zero1 did: the loop keeps it
    later = [e for e in replans if e.step > 13]
    assert later and all(e.data["decision"] == "KeepPlan" for e in later)
    assert "zero1" in later[-1].data["observed"]


def test_a_straggler_is_named_and_its_share_re_cut(tmp_path):
    """Rank 1 computes 3x slower per sample than rank 0 on alike devices: the closed loop
    names it and re-cuts the dp shares by the measured speeds."""
    ctl, fake = _controller(tmp_path, max_steps=40, replan_every=10)
    fake.compute = {0: 1e-3, 1: 3e-3}
    fake.step_times = {"dp": 0.02}
    result = ctl.run()
    strag = [e for e in ctl.events if e.kind == "straggler"]
    assert strag and strag[0].data["ranks"] == [1] and strag[0].step == 12
    assert len(strag) == 1  # named once while it stays one, though every decision sees it
    assert len([e for e in ctl.events if e.kind == "replan"]) >= 2
    recut = next(e for e in ctl.events if e.kind == "replan")
    assert recut.data["decision"] == "RecutShares" and recut.data["recut"] == [6, 2]
    assert "rank 1 slower than its peers" in recut.message
    assert next(e for e in ctl.events if e.kind == "switch").data["reason"] == "replan"
    assert fake.spec.shares == (6, 2) and result.history[-1]["strategy"] == "dp"


def test_a_pipeline_straggler_is_named_and_the_stages_re_split(tmp_path):
    """A named pipeline's ranks do different work: each is compared with its stage's figure
    at the layout's start. Rank 1 slows 3x from step 25 and the step with it: the loop names
    it and moves its blocks to rank 0 (the stage split re-cut, the same layout otherwise).
    Was: a pipeline's ranks were not compared (nothing named, nothing re-cut)."""
    ctl, fake = _controller(tmp_path, strategy="pipeline", max_steps=120, replan_every=10)
    fake.block_seconds = [1e-4] * 5  # the blocks weigh alike
    fake.step_times = {"pipeline": 0.02}
    fake.compute = {0: 1e-3, 1: 1e-3}
    fake.compute_from = {25: {0: 1e-3, 1: 3e-3}}
    fake.phases = {25: 2.0}
    result = ctl.run()
    strag = [e for e in ctl.events if e.kind == "straggler"]
    assert len(strag) == 1 and strag[0].data["ranks"] == [1], [e.message for e in strag]
    assert 25 < strag[0].step <= 50 and "their stage's figure" in strag[0].message
    recut = next(e for e in ctl.events if e.kind == "replan"
                 and e.data["decision"] == "RecutShares")
    assert recut.message.startswith("RecutShares: stage split ")
    old, new = recut.data["shares"], recut.data["recut"]
    assert sum(old) == sum(new) == 5 and new[0] > old[0], (old, new)
    # the fake's compute follows its blocks: the loop settles on the split where a 3x
    # slower rank 1 holds one block of five (4 against 3), and stays
    assert fake.spec.stage_split == (4, 1) and fake.spec.name == "pipeline"
    assert fake.spec.shares == (4, 4) and result.history[-1]["step"] == 119


@pytest.mark.parametrize("room", [0, 1])  # the job shrinks; a replacement keeps its size
def test_a_slow_worker_after_a_loss_is_named_though_it_has_the_rank_named_before(tmp_path,
                                                                                  room):
    """Rank 1 is named a straggler; rank 0 is lost, and the worker that becomes rank 1 is
    slow too: it is another worker, named again. Was: compared by rank number, it was
    taken for the one named before and not said."""
    ctl, fake = _controller(tmp_path, room=room, num_workers=3, min_workers=1, max_steps=60,
                            replan_every=10)
    fake.compute = {0: 1e-3, 1: 3e-3, 2: 1e-3}
    fake.step_times = {"dp": 0.02}
    fake.fail(step=25, rank=0, kind="lost")
    ctl.run()
    strag = [e for e in ctl.events if e.kind == "straggler"]
    assert len(strag) >= 2 and strag[0].data["workers"] != strag[-1].data["workers"], [
        (e.step, e.data) for e in strag]


@pytest.mark.parametrize("scheduled", ["dp", "zero1"])
def test_the_loops_change_decided_before_a_switch_at_step_is_not_left_pending(tmp_path,
                                                                            scheduled):
    """The loop decides a re-cut at step 12 and a ``switch_at`` falls at 13: a switch to
    another strategy overtakes it (void), one naming the running strategy lets it go on;
    either way the loop decides on after. Was: the change stayed pending and the loop went
    silent for the rest of the run (and with ``dp`` the re-cut was never applied)."""
    ctl, fake = _controller(tmp_path, max_steps=60, replan_every=10,
                            switch_at={13: scheduled})
    fake.compute = {0: 1e-3, 1: 3e-3}
    fake.step_times = {"dp": 0.02, "zero1": 0.02}
    ctl.run()
    replans = [e.step for e in ctl.events if e.kind == "replan"]
    assert any(s > 20 for s in replans), replans
    if scheduled == "dp":
        assert fake.spec.shares == (6, 2)


def test_a_change_the_strategy_refuses_is_not_asked_for_again(tmp_path, monkeypatch):
    """The loop's re-cut is refused when laid out (zero2 with micro-batches the small
    share cannot fill): said once, then not decided again every ``replan_every`` steps (a
    stop and a refused build each time, seven times over the run)."""
    ctl, fake = _controller(tmp_path, max_steps=80, replan_every=10)
    fake.compute = {0: 1e-3, 1: 7e-3}
    fake.step_times = {"dp": 0.02}
    build = fake.build

    def refusing(spec):
        if tuple(spec.shares) != (4, 4):
            raise SwitchError("zero2 needs 4 micro-batches of the smallest share 1")
        return build(spec)

    monkeypatch.setattr(fake, "build", refusing)
    ctl.run()
    failed = [e for e in ctl.events if e.kind == "switch_failed"]
    assert len(failed) == 1, [e.message for e in failed]
    assert fake.spec.shares == (4, 4)


def test_a_plan_switch_the_strategy_refuses_is_not_decided_again(tmp_path, monkeypatch):
    """``auto`` runs zero1 and the loop decides dp pays (a ``SwitchPlan``); dp refuses to be
    laid out here (stood in for by the build raising). Said once; the plan leaves the loop's
    candidates. Was: decided and refused again every ``replan_every`` steps."""
    ctl, fake = _controller(tmp_path, strategy="auto", max_steps=80, replan_every=10)
    fake.alpha.update(all_reduce=3e-3, reduce=1e-5, broadcast=1e-5, all_gather=20e-3,
                      reduce_scatter=20e-3, p2p=50e-3)
    fake.opt_cost = (5e-5, 5e-6)
    fake.step_times = {"zero1": 0.05, "dp": 0.01}
    build = fake.build

    def refusing(spec):
        if spec.name == "dp":
            raise SwitchError("dp cannot run here (stood in for)")
        return build(spec)

    monkeypatch.setattr(fake, "build", refusing)
    ctl.run()
    failed = [e for e in ctl.events if e.kind == "switch_failed"]
    assert len(failed) == 1, [(e.step, e.message) for e in failed]


def test_a_switch_the_loop_did_not_ask_for_is_no_try(tmp_path):
    """The loop tries zero1 from dp; before its next decision the user's switch_at moves the
    job to zero2. zero2 is no try of the loop's: no decision says "the try of zero2" and
    takes it back on the try's lower bar."""
    ctl, fake = _controller(tmp_path, strategy="auto", max_steps=300, replan_every=10,
                            switch_at={16: "zero2"})
    fake.alpha.update(reduce=1e-4, broadcast=1e-4)
    fake.step_times = {"zero1": 0.012, "zero2": 0.0104, "dp": 0.01}
    ctl.run()
    changes = [e for e in ctl.events if e.kind == "replan" and e.data["decision"] != "KeepPlan"]
    assert changes[0].step == 12 and changes[0].data["decision"] == "TryPlan"
    assert not any("the try of" in e.message for e in changes), [e.message for e in changes]


def test_a_re_cut_that_measures_slower_goes_back_and_is_not_made_again(tmp_path):
    """Rank 1 computes 3x slower per sample, but the step is bound elsewhere: the shares
    re-cut around it measure slower (a rank the OS starves for a while, on a crowded host).
    At the next decision the shares it left come back, said with both figures, and the loop
    re-cuts this layout no more (it had re-cut the same way every 130 steps: mixer on 2 CPU
    ranks, predicted 82.6 ms, measured 97.2)."""
    ctl, fake = _controller(tmp_path, max_steps=80, replan_every=10)
    fake.compute = {0: 1e-3, 1: 3e-3}
    fake.step_times = {"dp": 0.02, ("dp", (6, 2)): 0.03}
    result = ctl.run()
    changes = [e for e in ctl.events if e.kind == "replan" and e.data["decision"] != "KeepPlan"]
    assert changes[0].data["decision"] == "RecutShares" and changes[0].data["recut"] == [6, 2]
    assert len(changes) == 2 and changes[1].data["decision"] == "RecutShares"
    assert "the re-cut to [6, 2] measured 30.0 ms/step" in changes[1].message
    assert "against [4, 4]'s 20.0 ms: back" in changes[1].message
    assert fake.spec.shares == (4, 4) and result.history[-1]["strategy"] == "dp"


def test_the_closed_loop_keeps_a_plan_when_a_change_does_not_pay(tmp_path):
    """Equal ranks, the running plan the fastest: every decision is to keep it, with why."""
    ctl, fake = _controller(tmp_path, max_steps=40, replan_every=10)
    ctl.run()
    replans = [e for e in ctl.events if e.kind == "replan"]
    assert [e.step for e in replans] == [12, 22, 32]
    assert all(e.data["decision"] == "KeepPlan" for e in replans)
    assert not [e for e in ctl.events if e.kind in ("straggler", "switch")]
    # decided while the segment runs: keeping the plan costs no boundary
    assert [c for c in fake.calls if c[0] == "segment"] == [("segment", (0, 40))]


def test_replan_every_zero_turns_the_loop_off(tmp_path):
    ctl, fake = _controller(tmp_path, max_steps=40, replan_every=0)
    fake.compute = {0: 1e-3, 1: 3e-3}
    ctl.run()
    assert not [e for e in ctl.events if e.kind in ("replan", "straggler", "switch")]


# ------------------------------------------------------------------ per-block stage splits


def test_a_named_pipeline_cuts_its_stages_by_the_measured_block_times(tmp_path):
    """Issue 16 point 4: the workers time each block (``profile(detail=True)``); the first
    block is 5x the others, so it is a stage of its own, whatever the parameter counts say."""
    ctl, fake = _controller(tmp_path, strategy="pipeline", pp_degree=2, micro_batches=2)
    fake.block_seconds = [5e-3, 1e-3, 1e-3, 1e-3, 1e-3]
    ctl.run()
    assert fake.spec.stage_split == (1, 4)
    # nothing timed: the strategy's own split (parameters), as before
    ctl2, fake2 = _controller(tmp_path / "flat", strategy="pipeline", pp_degree=2,
                              micro_batches=2)
    ctl2.run()
    assert fake2.spec.stage_split is None


@pytest.mark.parametrize("given, want", [
    ({}, (4, "1f1b")),                                  # 8 samples, 2 stages: m = 2 pp
    ({"micro_batches": 1}, (1, "gpipe")),               # a count below pp: GPipe
    ({"schedule": "gpipe"}, (4, "gpipe")),
    ({"micro_batches": 2, "schedule": "interleaved"}, (2, "interleaved")),
])
def test_a_named_pipeline_left_unset_runs_1f1b_and_a_given_setting_is_kept(tmp_path, given,
                                                                           want):
    """`strategy: pipeline` alone had run GPipe on one micro-batch: the stages took turns."""
    ctl, fake = _controller(tmp_path, strategy="pipeline", **given)
    ctl.run()
    assert (fake.spec.micro_batches, fake.spec.schedule, fake.spec.pp_degree) == (*want, 2)
    layout = _events(ctl, "layout")[0].data
    assert (layout["spec"]["micro_batches"], layout["spec"]["schedule"]) == want


# ------------------------------------------------------------------ notices and evacuation


def _events(ctl: Controller, kind: str) -> list:
    return [e for e in ctl.events if e.kind == kind]


@pytest.mark.parametrize("strategy", ["zero3", "dp", "zero2", "auto"])
def test_a_preemption_notice_moves_the_state_at_the_next_boundary(tmp_path, strategy):
    """A node announces its end (60 s left): at the next step boundary its ranks hand their
    pieces off, are released, and the survivors load the layout from pieces: no step lost,
    no checkpoint read, nobody restarted. Under ``auto`` the survivors are planned for anew,
    after the leaving ranks were released (it had failed: the traits table has no "auto")."""
    ctl, fake = _controller(tmp_path, strategy=strategy, num_workers=3, min_workers=1,
                            drain_poll_s=1e-9)
    fake.announce_at[6] = (2, 60.0)
    result = ctl.run()
    assert [h["step"] for h in result.history] == list(range(STEPS))
    notice = _events(ctl, "preemption_notice")
    assert len(notice) == 1 and notice[0].data["ranks"] == [2]
    assert 50 < notice[0].data["left_s"] <= 60 and "s left" in notice[0].message
    assert 6 <= notice[0].step <= 8  # the steps done when it was seen
    ev = _events(ctl, "evacuated")
    assert len(ev) == 1 and ev[0].data["path"] == "move" and ev[0].data["steps_lost"] == 0
    at = ev[0].data["step"]
    assert 6 <= at <= 8 and ev[0].data["world_size"] == 2 and ev[0].data["state_preserved"]
    assert ev[0].data["left_at_release_s"] > 50
    i = fake.calls.index(("hand_off", [2]))
    assert fake.calls[i + 1:i + 4] == [("leave", 2), ("release", [2]), ("form", 2)]
    assert ("restore_from_pieces", at) in fake.calls
    assert not [c for c in fake.calls if c[0] in ("restore_checkpoint", "restart_fresh")]
    assert "recovered" not in _kinds(ctl) and ctl.failures == 0
    # the workers are asked for the boundary at once: a due checkpoint waiting for a slow
    # upload's commit gives up its wait (test_worker_components)
    assert ("request_stop", True) in fake.calls[:i]
    moves = [(e.data["from"], e.data["to"]) for e in ctl.events if e.kind == "state"]
    assert ("at_boundary", "evacuating") in moves and ("evacuating", "at_boundary") in moves
    assert result.history[-1]["world_size"] == 2
    if strategy == "auto":
        plans = _events(ctl, "plan")
        assert len(plans) == 2 and " on 2 x " in plans[1].message


def test_a_notice_is_acted_on_before_a_scale_down_queued_at_the_same_boundary(tmp_path):
    """A scale to 2 and a node's notice wait at one boundary: the notice goes first (its
    rank is released, its state moved), then the scale finds 2 workers. Was: first in,
    first out: the shrink let a healthy worker go and kept the leaving one, whose evacuation
    then left the job on 1 worker of the 2 asked for."""
    ctl, fake = _controller(tmp_path, strategy="dp", num_workers=3, min_workers=1,
                            max_workers=3, drain_poll_s=1e-9)
    fake.announce_at[6] = (0, 60.0)
    asked: list[queue.Queue] = []

    def on_step(entry):
        if entry["step"] == 5 and not asked:
            asked.append(_ask(ctl, "scale", 2))

    ctl.steps.on_step = on_step
    result = ctl.run()
    assert len(_events(ctl, "evacuated")) == 1
    assert asked and asked[0].get_nowait() == 2
    assert result.history[-1]["world_size"] == 2, [e.message for e in ctl.events
                                                  if e.kind != "state"]


def test_a_notice_is_acted_on_before_a_switch_at_the_same_boundary(tmp_path):
    """A node's notice and a scheduled switch fall at one boundary: the evacuation goes
    first (the deadline is not spent on the switch's build), then the switch runs."""
    ctl, fake = _controller(tmp_path, strategy="dp", num_workers=3, min_workers=1,
                            drain_poll_s=1e-9, switch_at={8: "zero1"})
    fake.announce_at[7] = (2, 60.0)  # seen as the segment reaches the switch's step
    result = ctl.run()
    kinds = [e.kind for e in ctl.events if e.kind in ("evacuated", "switch")]
    assert kinds[:2] == ["evacuated", "switch"], kinds
    assert result.history[-1]["strategy"] == "zero1"


def test_a_notice_whose_evacuation_a_failure_cut_short_is_acted_on_after_the_recovery(
        tmp_path, monkeypatch):
    """Another rank is lost during the hand-off of an announced node's state: the job
    recovers (the draining rank lives, so it stays), and the notice is acted on at the next
    boundary: the node's rank is released before its deadline. Was: the notice was marked
    done before the work, so the node later went as an unannounced loss mid-step."""
    from elastic.errors import GroupError

    ctl, fake = _controller(tmp_path, strategy="dp", num_workers=3, min_workers=1,
                            drain_poll_s=1e-9)
    fake.announce_at[6] = (2, 60.0)
    hand_off = fake.hand_off
    failed: list[bool] = []

    def peer_lost(leaving):
        if not failed:
            failed.append(True)
            fake.fw(fake.workers[0]).alive = False
            raise GroupError("rank 0 left the group during the hand-off")
        return hand_off(leaving)

    monkeypatch.setattr(fake, "hand_off", peer_lost)
    result = ctl.run()
    assert failed and "recovered" in _kinds(ctl)
    assert [h["step"] for h in result.history] == list(range(STEPS))
    ev = _events(ctl, "evacuated")
    assert len(ev) == 1 and ev[0].data["path"] == "move"
    assert any(c[0] == "release" for c in fake.calls)
    assert result.history[-1]["world_size"] == 1


def test_a_deadline_too_short_for_the_move_lets_the_node_go_and_says_why(tmp_path):
    """0.5 s left, 1 s kept in reserve, no checkpoint store: the fastest safe path is to let
    the node go now and recover (here: zero2 without copies, from scratch: said so)."""
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=3, min_workers=1,
                            drain_poll_s=1e-9)
    fake.announce_at[4] = (1, 0.5)
    result = ctl.run()
    ev = _events(ctl, "evacuating")
    assert ev[0].data["path"] == "recover" and "no checkpoint store" in ev[0].message
    done = _events(ctl, "evacuated")[0]
    assert done.data["path"] == "recover" and done.data["source"] == "scratch"
    assert ("hand_off", [1]) not in fake.calls and ("release", [1]) in fake.calls
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_a_deadline_too_short_recovers_from_the_buddies_copies(tmp_path):
    ctl, fake = _controller(tmp_path, strategy="zero3", num_workers=3, min_workers=1,
                            drain_poll_s=1e-9, peer_copies_every=4)
    fake.copies_every = 4
    fake.announce_at[6] = (0, 0.2)
    ctl.run()
    ev = _events(ctl, "evacuating")[0]
    assert ev.data["path"] == "recover" and "buddies' copies" in ev.message
    done = _events(ctl, "evacuated")[0]
    assert done.data["source"] == "buddies" and done.data["steps_lost"] <= 4
    assert any(c[0] == "restore_from_copies" for c in fake.calls)


def test_evacuate_by_hand_drains_the_node_through_ray_and_answers(tmp_path):
    ctl, fake = _controller(tmp_path, strategy="zero3", num_workers=3, min_workers=1)
    q = _ask(ctl, "evacuate", {"node": "node1", "deadline_s": 120})
    bad = _ask(ctl, "evacuate", "nodeX")
    result = ctl.run()
    assert ("drain_node", ("node1", 120.0)) in fake.calls
    ans = q.get_nowait()
    assert ans["workers"] == 2 and ans["source"] == "evacuation"
    err = bad.get_nowait()
    assert isinstance(err, SwitchError) and "no node of this job matches 'nodeX'" in str(err)
    notice = _events(ctl, "preemption_notice")[0]
    assert notice.data["reason"] == "maintenance" and notice.data["ranks"] == [1]
    assert len(result.history) == STEPS and result.history[-1]["world_size"] == 2


def test_a_node_evacuated_by_hand_whose_drain_ray_refused_is_evacuated_again_on_a_notice(
        tmp_path):
    """Ray refused the hand drain of node1, so a replacement could land there later; when
    that node then announces its end, the replacement is evacuated too. Was: the node stayed
    marked evacuated, the notice was ignored and the worker lost unannounced."""
    ctl, fake = _controller(tmp_path, room=1, strategy="zero3", num_workers=3, min_workers=1,
                            max_workers=3, drain_poll_s=1e-9)
    fake.drain_refused = "node busy"
    fake.node_of[3] = "node1"  # the replacement is placed where the evacuated worker was
    _ask(ctl, "evacuate", {"node": "node1"})
    _ask(ctl, "scale", 3)
    fake.announce_at[12] = (2, 60.0)  # rank 2 by then: the replacement, on node1
    result = ctl.run()
    assert "drain_refused" in _kinds(ctl)
    notices = _events(ctl, "preemption_notice")
    assert [n.data["node"] for n in notices] == ["node1", "node1"], notices
    assert len(_events(ctl, "evacuated")) == 2
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_malformed_evacuations_are_refused_where_they_enter(tmp_path):
    ctl, _ = _controller(tmp_path)
    qs = [_ask(ctl, "evacuate"), _ask(ctl, "evacuate", 7),
          _ask(ctl, "evacuate", {"node": "n", "deadline_s": -1}),
          _ask(ctl, "evacuate", {"node": "n", "when": 1})]
    answers = [q.get_nowait() for q in qs]
    assert all(isinstance(a, Exception) and "evacuate" in str(a) for a in answers), answers


def test_a_node_that_goes_before_the_boundary_is_a_loss_said_as_such(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, drain_poll_s=1e-9)
    fake.announce_at[5] = (2, 30.0)
    fake.fail(step=5, rank=2, kind="lost")  # gone in the very next step
    result = ctl.run()
    assert "recovered" in _kinds(ctl) and "preemption_missed" in _kinds(ctl)
    assert "evacuated" not in _kinds(ctl)
    assert [h["step"] for h in result.history] == list(range(STEPS))


@pytest.mark.parametrize("wait", [0.0, 0.3])
def test_below_min_workers_the_evacuation_checkpoints_then_recovers(tmp_path, wait):
    """No room for a replacement: with ``min_workers_timeout_s`` 0 the job checkpoints at
    once; with 0.3 s it first waits that long for one (a drain by hand is acted on at the
    boundary, the wait paid there), says none came, then checkpoints."""
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=2,
                            drain_poll_s=1e-9, min_workers_timeout_s=wait,
                            checkpoint_every=100)
    asked: list[queue.Queue] = []

    def on_step(entry):
        if entry["step"] == 3 and not asked:
            asked.append(_ask(ctl, "evacuate", {"node": "node1"}))

    ctl.steps.on_step = on_step
    with pytest.raises(InfrastructureError, match="fewer than min_workers=2"):
        ctl.run()
    *first, ev = _events(ctl, "evacuating")
    if wait:  # replacements first, for up to min_workers_timeout_s: none came (no room)
        assert [e.data["path"] for e in first] == ["replace"], first
        missing = _events(ctl, "replacement_missing")
        assert len(missing) == 1 and "within 0.3s" in missing[0].message
    assert ev.data["path"] == "checkpoint" and "fewer than min_workers=2" in ev.message
    assert ("checkpoint_now", 5) in fake.calls
    # and it is carried to its end (the fake's shards are not on disk: not committed). It was
    # ignored for a while: the evacuation's abandon of the one in flight voided every report
    # of the group's checkpoints, this one's too
    assert [c for c in fake.calls if c[0] == "checkpoint_done"] == [("checkpoint_done",
                                                                      (5, False))]
    failed = _events(ctl, "checkpoint_failed")
    assert len(failed) == 1 and "step 5 not committed" in failed[0].message, failed


@pytest.mark.parametrize("strategy", ["zero3", "dp"])
def test_below_min_workers_a_notice_takes_in_replacements_and_moves_the_state(tmp_path,
                                                                              strategy):
    """min_workers = num_workers = 3, one node announces its end (60 s left) and there is
    room for one more worker: the replacement starts at the notice while training goes on,
    joins at the boundary (its state from its peers), and the draining rank's state moves
    onto the survivors: no step lost, no checkpoint, 3 workers at the end. Was: the node was
    let go at once (a checkpoint, then a recovery that waited below min_workers for a
    replacement that came only after the node had gone)."""
    ctl, fake = _controller(tmp_path, strategy=strategy, num_workers=3, min_workers=3,
                            max_workers=3, drain_poll_s=1e-9)
    fake.room_left = 1
    fake.announce_at[6] = (2, 60.0)
    result = ctl.run()
    assert [h["step"] for h in result.history] == list(range(STEPS))
    rep = _events(ctl, "replacing")
    assert len(rep) == 1 and rep[0].data["need"] == 1 and ("start_spares", 1) in fake.calls
    paths = [e.data["path"] for e in _events(ctl, "evacuating")]
    assert paths == ["replace", "move"], paths
    scaled = _events(ctl, "scaled")
    assert scaled and scaled[0].data["from"] == 3 and scaled[0].data["to"] == 4
    assert "before they go" in scaled[0].message and scaled[0].data["source"] == "peers"
    done = _events(ctl, "evacuated")
    assert len(done) == 1 and done[0].data["path"] == "move"
    assert done[0].data["steps_lost"] == 0 and done[0].data["world_size"] == 3
    assert not [c for c in fake.calls if c[0] in ("restore_checkpoint", "restart_fresh",
                                                   "checkpoint_now")]
    assert "recovered" not in _kinds(ctl) and "waiting" not in _kinds(ctl)
    assert result.history[-1]["world_size"] == 3


def test_a_replacement_the_global_batch_has_no_sample_for_is_not_joined(tmp_path):
    """Global batch 8 on 8 workers, min_workers 8, one node draining, room for one more:
    a ninth worker beside the draining one would have no sample (found by review). The
    join is not tried: ``replacement_missing`` says why, the checkpoint path follows, and
    the recovery takes the spare in the draining worker's place."""
    ctl, fake = _controller(tmp_path, strategy="dp", num_workers=8, min_workers=8,
                            max_workers=8, drain_poll_s=1e-9, min_workers_timeout_s=0.3,
                            checkpoint_every=100)
    fake.room_left = 1
    fake.announce_at[4] = (7, 60.0)
    result = ctl.run()
    missing = _events(ctl, "replacement_missing")
    assert missing and "has no sample for a worker beside the 8" in missing[0].message
    assert not _events(ctl, "scaled")
    assert _events(ctl, "evacuating")[-1].data["path"] == "checkpoint"
    assert result.history[-1]["world_size"] == 8


def test_an_unannounced_zero3_loss_restores_from_the_buddies_copies(tmp_path):
    ctl, fake = _controller(tmp_path, strategy="zero3", num_workers=3, min_workers=1,
                            peer_copies_every=5)
    fake.copies_every = 5
    fake.fail(step=8, rank=1, kind="lost")
    result = ctl.run()
    rec = _events(ctl, "recovered")[0]
    assert rec.data["source"] == "buddies" and rec.data["steps_lost"] == 3
    assert ("restore_from_copies", 5) in fake.calls
    assert [h["step"] for h in result.history] == list(range(STEPS))


def test_a_corrupt_copy_falls_back_to_storage(tmp_path, monkeypatch):
    ctl, fake = _controller(tmp_path, strategy="zero3", num_workers=3, min_workers=1,
                            peer_copies_every=5)
    monkeypatch.setattr(type(ctl.tracker), "valid_steps", lambda self: (4,))
    fake.copies_every = 5
    fake.corrupt_copies = True
    fake.fail(step=8, rank=1, kind="lost")
    ctl.run()
    assert "peer_copies_refused" in _kinds(ctl)
    rec = _events(ctl, "recovered")[0]
    assert rec.data["source"] == "checkpoint" and ("restore_checkpoint", 4) in fake.calls


def test_requests_are_answered_after_the_end_even_when_closing_the_group_failed(tmp_path):
    ctl, fake = _controller(tmp_path)

    def broken_close() -> None:
        raise RuntimeError("a worker would not go")

    fake.close = broken_close  # type: ignore[method-assign]
    try:
        ctl.run()
    except RuntimeError:
        pass
    late = _ask(ctl, "scale", 1)  # nobody would ever have answered it
    assert isinstance(late.get(timeout=1), Exception)


@pytest.mark.parametrize("kw, said", [
    (dict(strategy="zero3"), True),
    (dict(strategy="zero1"), True),  # the optimizer's shards live on one rank each
    (dict(strategy="zero3", peer_copies_every=5), False),
    (dict(strategy="zero3", checkpoint_every=5), False),
    (dict(strategy="dp"), False),  # every survivor holds it all
    (dict(strategy="zero3", num_workers=1, min_workers=1, max_workers=1), False),
    (dict(strategy="pipeline", pp_degree=2, num_workers=4), False),  # stages replicated
    (dict(strategy="pipeline", pp_degree=2, num_workers=4, dp_mode="zero1"), True),
    (dict(strategy="pipeline", pp_degree=2, num_workers=2), True),  # no replica of a stage
])
def test_a_layout_no_lost_node_can_be_recovered_from_says_so_once(tmp_path, kw, said):
    """A job under a sharded layout with neither checkpoints nor peer copies would go back
    to step 0 on the first lost node: the user is told at the layout, with the fix."""
    ctl, _ = _controller(tmp_path, **kw)
    ctl.run()
    got = _events(ctl, "unprotected")
    assert len(got) == int(said), [e.message for e in got]
    if said:
        assert "peer_copies_every" in got[0].message and "step 0" in got[0].message


def test_a_recovery_into_an_unrecoverable_layout_says_so(tmp_path):
    """pp2 x dp2 loses a worker: on 3 workers the pipeline keeps no replica of a stage, so
    the next loss would send the job back to step 0; the regroup says it."""
    ctl, fake = _controller(tmp_path, strategy="pipeline", pp_degree=2, num_workers=4,
                            min_workers=1)
    fake.fail(step=4, rank=3, kind="lost")
    ctl.run()
    kinds = _kinds(ctl)
    assert kinds.count("unprotected") == 1 and "recovered" in kinds, kinds
    assert kinds.index("failure") < kinds.index("unprotected")  # said by the regroup
    # pp2 does not divide 3: pp3, with the micro-batches and schedule of that degree (8
    # samples: 4 micro-batches of 1F1B), not pp2's defaults carried over
    s = fake.spec
    assert (s.world_size, s.pp_degree, s.micro_batches, s.schedule, s.stage_split) == \
        (3, 3, 4, "1f1b", None)


@pytest.mark.parametrize("zero1_s, final", [(0.008, "zero1"), (0.012, "dp")])
def test_auto_tries_a_plan_predicted_too_close_to_order_and_keeps_the_faster(
        tmp_path, zero1_s, final):
    """``auto`` plans dp, zero1 predicted within 10 % of dp's measured step (its owners'
    broadcasts cheap). The model cannot order them; the loop tries zero1 (a ``TryPlan``
    decision that says so) and, at the next decision, goes back to dp if zero1 measured
    slower beyond the noise, else stays."""
    ctl, fake = _controller(tmp_path, strategy="auto", max_steps=300, replan_every=10)
    fake.alpha.update(reduce=1e-4, broadcast=1e-4)
    fake.step_times = {"zero1": zero1_s, "dp": 0.01}
    result = ctl.run()
    assert next(e for e in ctl.events if e.kind == "plan").message.startswith("chose dp")
    changes = [e for e in ctl.events if e.kind == "replan" and e.data["decision"] != "KeepPlan"]
    assert changes[0].step == 12 and changes[0].data["decision"] == "TryPlan"
    assert "zero1 never ran here" in changes[0].message
    strategies = [h["strategy"] for h in result.history]
    assert strategies[:13] == ["dp"] * 13 and strategies[13] == "zero1"
    if final == "dp":
        back = changes[1]
        assert back.step == 25 and back.data["decision"] == "SwitchPlan"
        assert "the try of zero1 measured 12.0 ms/step" in back.message
    assert len(changes) == (1 if final == "zero1" else 2)  # each plan tried once
    assert strategies[-1] == final


def test_auto_does_not_switch_on_a_phase_of_the_host(tmp_path):
    """dp 10 ms, zero1 10.3: the loop tries zero1 and goes back. From step 26 every step of
    the host takes 1.3x: dp now measures 13 ms against zero1's 10.3 from before the phase.
    dp's move from its own earlier figure (30 %) is the host's drift; the loop stays on dp
    (it had switched to zero1 on the phase, the live path of ``LoopMemory.drift``)."""
    ctl, fake = _controller(tmp_path, strategy="auto", max_steps=300, replan_every=10)
    fake.alpha.update(reduce=1e-4, broadcast=1e-4)
    fake.step_times = {"zero1": 0.0103, "dp": 0.01}
    fake.phases = {26: 1.3}
    result = ctl.run()
    changes = [e for e in ctl.events if e.kind == "replan" and e.data["decision"] != "KeepPlan"]
    assert [e.data["decision"] for e in changes] == ["TryPlan", "SwitchPlan"], \
        [e.message for e in changes]
    assert "the try of zero1" in changes[1].message
    kept = [e for e in ctl.events if e.kind == "replan" and e.step > changes[1].step]
    assert kept and "the 30.0% the host's phases moved a measured figure" in kept[0].message, \
        kept[0].message
    assert result.history[-1]["strategy"] == "dp"


def test_an_auto_job_that_loses_a_node_plans_again_and_its_loop_goes_on(tmp_path):
    """``strategy: auto`` on 3 workers tries zero1 and goes back (a figure of each); at step
    40 a node goes. The survivors are planned for anew, and the closed loop decides on the
    new world's figures only. Was: the recovery asked the traits table about "auto"
    (StrategyError), and then the loop re-fitted the 3-worker figures on 2 devices
    (PlanError: "devices must list world_size distinct device ids")."""
    ctl, fake = _controller(tmp_path, strategy="auto", num_workers=3, min_workers=2,
                            max_steps=120, replan_every=10)
    fake.alpha.update(reduce=1e-4, broadcast=1e-4)
    fake.step_times = {"zero1": 0.0103, "dp": 0.01}
    fake.fail(step=40, rank=2, kind="lost")
    result = ctl.run()
    assert [h["step"] for h in result.history][-1] == 119
    plans = [e for e in ctl.events if e.kind == "plan"]
    assert len(plans) == 2 and " on 2 x " in plans[1].message
    after = [e for e in ctl.events if e.kind == "replan" and e.step > 40]
    assert after and after[0].data["decision"] == "TryPlan"  # zero1 is untried on 2 workers
    assert all(e.data["observed"] and len(e.data["observed"]) <= 2 for e in after)


def test_a_stop_posted_from_another_thread_reaches_ray_from_a_thread_of_this_session() -> None:
    """``WorkerGroup._tell`` from a thread other than the job's goes through a thread started
    in this Ray session (``Teller``). Was: the SDK's thread called Ray itself; after an
    earlier ``fit`` on that thread (an earlier Ray session), its call reused a task id the
    job's thread had taken, and Ray aborted the process at the second ``switch`` (a user's
    script)."""
    import threading

    from elastic.control.teller import Teller
    from elastic.control.worker_group import WorkerGroup

    seen: list[tuple[str, tuple[object, ...]]] = []
    arrived = threading.Event()

    class _Method:
        def remote(self, *args: object) -> None:
            seen.append((threading.current_thread().name, args))
            arrived.set()

    class _Handle:
        request_stop = _Method()

    class _Rec:
        handle = _Handle()

    group = WorkerGroup.__new__(WorkerGroup)  # its Ray parts are not what is tested
    group.workers = [_Rec()]  # type: ignore[list-item]
    group._teller = Teller()  # made on the job's thread, as __init__ makes it

    group._tell("request_stop", 1)  # the job's own thread: at once, on it
    assert seen == [(threading.current_thread().name, (1,))]
    arrived.clear()
    sdk = threading.Thread(target=group._tell, args=("request_stop", 2), name="sdk-thread")
    sdk.start()
    sdk.join()
    assert arrived.wait(5)
    assert seen[1][1] == (2,) and seen[1][0].startswith("elastic-tell"), seen
    group._teller.close()  # (what close does first); a later post from elsewhere is dropped
    late = threading.Thread(target=group._tell, args=("request_stop", 3))
    late.start()
    late.join()
    assert group._teller._pool is None and len(seen) == 2  # no thread started again


@pytest.mark.parametrize("kw, said", [
    (dict(micro_batches=4, schedule="gpipe"), "micro_batches: 4, schedule: gpipe: a pipeline's "
     "settings, not read by strategy dp (kept for a switch to a pipeline by hand; to "
     "accumulate gradients under dp set micro_batch_size"),
    (dict(strategy="zero2", pp_degree=2), "pp_degree: 2: a pipeline's setting, not read by "
     "strategy zero2"),
    (dict(strategy="zero2", dp_mode="zero1", switch_at={3: "pipeline"}), None),
    (dict(strategy="pipeline", micro_batches=2), None),
    (dict(strategy="zero1"), None),
])
def test_a_pipelines_settings_under_another_strategy_are_said_at_the_start(tmp_path, kw, said):
    """``micro_batches: 4`` under dp (a user who meant gradient accumulation) is said, with
    the setting that does that; a pipeline's settings a switch_at or the strategy reads are
    not. Was: taken silently (found by review, session 43)."""
    ctl, _ = _controller(tmp_path, **kw)
    ctl.run()
    got = _events(ctl, "settings_unused")
    assert [e.message[:len(said)] for e in got] == ([said] if said else []), got


def _source(uri: str, step: int) -> None:
    """A committed checkpoint ``step`` of the test model at ``uri`` (another job's run)."""
    from elastic.checkpoint import CheckpointMeta, CheckpointStore, commit, write_shard

    store = CheckpointStore(uri)
    state = {f"model/{k}": v for k, v in mlp().state_dict().items()}
    commit(store, step, [write_shard(store, step, 0, state)], CheckpointMeta())


@pytest.mark.parametrize("own_uri", [True, False])
def test_a_fork_that_loses_a_shard_before_its_own_checkpoint_restores_its_source(tmp_path,
                                                                                 own_uri):
    """A job resumed from another run's checkpoint (step 4 of another URI; with a URI of its
    own, or none) loses a zero2 shard at step 6, before it has committed anything: the
    recovery restores its source's step 4, not the seeded initial model. Was: the
    recovery listed only the job's own (empty) URI and restarted from step 0: a fine-tune
    silently trained from random weights (found by review, session 44)."""
    src = str(tmp_path / "source")
    _source(src, 4)
    kw = dict(checkpoint_uri=str(tmp_path / "own")) if own_uri else {}
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=1,
                            resume=src, **kw)
    fake.fail(step=6, rank=0, kind="lost")
    result = ctl.run()
    rec = next(e for e in ctl.events if e.kind == "recovered")
    assert rec.data["source"] == "checkpoint" and rec.data["steps_lost"] == 2, rec.message
    assert "the run this job was forked from" in rec.message
    assert ("restart_fresh", 0) not in fake.calls
    assert fake.calls.count(("restore_checkpoint", 4)) == 2  # the resume, the recovery
    assert result.history[-1]["step"] == STEPS - 1


def test_resume_latest_goes_on_from_the_newest_run_of_the_name(tmp_path, monkeypatch):
    """Job ``x`` ran twice in ./runs (the second run, started fresh, in ``runs/x.2``), then a
    third run without checkpoints (``runs/x.3``): ``resume: latest`` goes on from the newest
    run that has them, ``x.2``'s step 12, not the first run's step 8. Was: always
    ``runs/x``, the second run's training passed over (found by review, session 44)."""
    monkeypatch.chdir(tmp_path)
    for run, step in (("x", 8), ("x.2", 12), ("x.3", None)):
        os.makedirs(tmp_path / "runs" / run)
        (tmp_path / "runs" / run / "events.jsonl").write_text('{"kind": "start"}\n')
        if step is not None:
            _source(str(tmp_path / "runs" / run / "checkpoints"), step)
    ctl, fake = _controller(tmp_path, name="x", resume="latest", run_dir=None)
    ctl.run()
    resumed = next(e for e in ctl.events if e.kind == "resumed")
    assert resumed.data["step"] == 12 and "runs/x.2/checkpoints" in resumed.data["uri"]
    assert ctl.sink.log.run_dir == str(tmp_path / "runs" / "x.2")


def test_a_step_an_earlier_run_commits_while_this_one_starts_is_not_passed_over(tmp_path):
    """``resume: latest`` plans step 8 of the job's URI; before this run claims the URI an
    earlier run of the job still alive commits step 12: the start is refused naming it (the
    next start goes on from 12). Was: this run went on from 8 beside the other run's 12,
    which retention, a recovery or the next resume then took (found by review, session 44)."""
    from elastic.errors import ConfigError

    uri = str(tmp_path / "ck")
    _source(uri, 8)
    fake = FakeGroup(mlp())
    ctl = Controller(_cfg(tmp_path, checkpoint_uri=uri, resume="latest"),
                     group_factory=lambda cfg: fake,
                     mailbox_factory=lambda job: _source(uri, 12))  # (between plan and claim)
    with pytest.raises(ConfigError, match=r"step 12 was committed by an earlier run of job "
                                          r"unit while this one started") as ei:
        ctl.run()
    assert not fake.calls
    assert ei.value.fix.startswith("start the job again once that run has ended")  # (it
    # is refused its next commit and told so: both stop; session 47)


@pytest.mark.parametrize("how", ["poll error", "poll raises"])
def test_a_node_lost_while_the_last_checkpoint_uploads_costs_that_checkpoint_not_the_run(
        tmp_path, how):
    """zero3 on 3 workers completes all its steps; while the last step's checkpoint uploads,
    rank 1's node goes (its shard never comes: an upload error, or the group's call fails).
    The run ends finished with its final state (taken before that wait) and a
    ``checkpoint_failed``. Was: the state was taken after the wait, from a group missing a
    rank: a recovery re-ran steps of a run that had completed every one (below min_workers
    it failed) (found by review, session 44)."""
    from elastic.control.states import ControllerState
    from elastic.errors import WorkerLostError

    ctl, fake = _controller(tmp_path, strategy="zero3", num_workers=3, min_workers=1,
                            checkpoint_every=5, checkpoint_uri=str(tmp_path / "ck"))
    fake.checkpoint_every = 5  # (the fake begins them itself, as the workers do)
    dead: list[int] = []
    real_poll, real_final = fake.checkpoint_poll, fake.final_state

    def poll() -> list:
        if fake._ckpt == STEPS and ctl.phase is not ControllerState.FINISHING:  # noqa: SLF001
            return [None for _ in fake.workers]  # still uploading
        if fake._ckpt == STEPS:  # noqa: SLF001
            dead.append(1)
            if how == "poll raises":
                raise WorkerLostError("rank 1's node is gone")
            return [{"error": "worker 1 did not answer"} if w.rank == 1 else None
                    for w in fake.workers]
        return real_poll()

    def final() -> dict:
        if dead:
            raise WorkerLostError("rank 1's node is gone")
        return real_final()

    fake.checkpoint_poll, fake.final_state = poll, final
    result = ctl.run()
    assert dead and "recovered" not in _kinds(ctl)
    assert result.history[-1]["step"] == STEPS - 1
    failed = [e for e in ctl.events if e.kind == "checkpoint_failed"]
    assert failed and failed[-1].data["step"] == STEPS, [e.message for e in failed]
    # said in the result (and by `elastic run`, which keeps the final state on disk; was:
    # "done", exit 0, the steps since the newest committed checkpoint lost; session 47)
    newest = max((e.data["step"] for e in ctl.events if e.kind == "checkpoint"), default=0)
    assert newest < STEPS and result.unsaved == (
        f"the checkpoint of step {STEPS} was not committed: the newest committed checkpoint "
        f"is {f'step {newest}' if newest else 'none'}")
    from elastic import cli

    assert cli._kept_final(result) == 1  # noqa: SLF001
    import torch

    assert torch.load(os.path.join(result.run_dir, "final_state.pt")) == result.final_state


def test_a_recovery_from_peers_lists_no_checkpoint(tmp_path, monkeypatch):
    """dp on 3 workers loses one: the survivors hold every entry, so the recovery lists no
    checkpoint (a storage that does not answer, a hard-mounted NFS, would hold it up with
    nothing to read). Was: listed first, at every recovery and resize (found by review,
    session 44). A lost zero2 shard still lists them."""
    listed: list[int] = []
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1,
                            checkpoint_uri=str(tmp_path / "ck"))
    monkeypatch.setattr(type(ctl.tracker), "valid_steps",
                        lambda self: listed.append(1) or ())
    fake.fail(step=4, rank=1, kind="lost")
    ctl.run()
    rec = next(e for e in ctl.events if e.kind == "recovered")
    assert rec.data["source"] == "peers" and listed == []
    ctl, fake = _controller(tmp_path, strategy="zero2", num_workers=2, min_workers=1,
                            run_dir=str(tmp_path / "run2"))
    fake.fail(step=4, rank=1, kind="lost")
    ctl.run()
    assert listed == [1]


def test_resume_auto_with_no_checkpoint_in_runs_starts_fresh_in_a_run_dir_of_its_own(
        tmp_path, monkeypatch):
    """``resume: auto`` of job ``x`` whose earlier run in ``runs/x`` left no checkpoint: a
    fresh start, in ``runs/x.2``. Was: in ``runs/x``, appending to the earlier run's
    events and writing over its config (found by review, session 44)."""
    monkeypatch.chdir(tmp_path)
    os.makedirs(tmp_path / "runs" / "x")
    (tmp_path / "runs" / "x" / "events.jsonl").write_text('{"kind": "start"}\n')
    ctl, _ = _controller(tmp_path, name="x", resume="auto", run_dir=None)
    ctl.run()
    assert ctl.sink.log.run_dir == str(tmp_path / "runs" / "x.2")
    assert "resumed" not in _kinds(ctl)
    assert (tmp_path / "runs" / "x" / "events.jsonl").read_text() == '{"kind": "start"}\n'


def test_a_run_dir_of_another_jobs_run_is_refused_whatever_the_resume(tmp_path, monkeypatch):
    """A job given ``run_dir`` of another job's run (its config.json names that job) is
    refused before anything is written there, with ``resume: auto``/``latest``, a fork or
    none; the job that owns it resumes it as before. Was: a resume of any kind continued in
    it: the owner's config.json overwritten, both jobs' metrics in one file, the owner's
    TensorBoard curve purged (found by a new user, session 47)."""
    import json

    from elastic.control.preflight import run_directory

    monkeypatch.chdir(tmp_path)
    owned = tmp_path / "runs" / "trk"
    os.makedirs(owned)
    (owned / "events.jsonl").write_text('{"kind": "start"}\n')
    (owned / "config.json").write_text(json.dumps({"name": "trk"}))
    for resume in ("auto", "latest", None):
        cfg = _cfg(tmp_path, name="trkB", run_dir=str(owned), resume=resume,
                   checkpoint_uri=str(tmp_path / "ckB"))
        with pytest.raises(ConfigError) as ei:
            run_directory(cfg)
        assert ei.value.field == "run_dir"
        assert "holds a run of job 'trk'" in str(ei.value) and "name: trk" in ei.value.fix
    mine = _cfg(tmp_path, name="trk", run_dir=str(owned), resume="latest",
                checkpoint_uri=str(tmp_path / "ck"))
    assert run_directory(mine) == str(owned)
    assert json.loads((owned / "config.json").read_text()) == {"name": "trk"}


def test_a_run_dir_that_cannot_be_written_is_refused_before_ray(tmp_path):
    """A run_dir under a file (or on a read-only filesystem): one ConfigError naming
    run_dir, before Ray starts or the checkpoint URI is claimed. Was: a traceback from the
    run log's first write, after both (found by a new user, session 47)."""
    from elastic.control.preflight import preflight

    (tmp_path / "afile").write_text("x")
    cfg = _cfg(tmp_path, run_dir=str(tmp_path / "afile" / "run"))
    with pytest.raises(ConfigError) as ei:
        preflight(cfg, lambda *a, **k: None)
    assert ei.value.field == "run_dir" and "cannot be written" in str(ei.value)
