"""The controller's loop, driven step by step without Ray over a fake worker group: runs,
switches, recoveries, give-ups, requests and scaling, each decided by the same code that
drives a live job (the fake stands in for the workers only)."""

from __future__ import annotations

import queue

import pytest

from elastic.config import JobConfig
from elastic.control import Controller, Request
from elastic.control import sizing as sizing_mod
from elastic.errors import InfrastructureError, SwitchError, WorkerError
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


def test_user_code_error_fails_at_once_with_its_traceback(tmp_path):
    ctl, fake = _controller(tmp_path)
    fake.fail(step=3, rank=1, kind="user")
    with pytest.raises(WorkerError, match="bad on purpose"):
        ctl.run()
    assert "recovered" not in _kinds(ctl) and _kinds(ctl)[-1] == "failed"
    assert fake.closed and ctl.state.value == "failed"


def test_failure_budget_gives_up_with_the_fix(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1, max_failures=1)
    fake.fail(step=3, rank=2)
    fake.fail(step=9, rank=1)
    with pytest.raises(InfrastructureError, match="giving up after 2 failures.*max_failures"):
        ctl.run()


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


def test_scale_up_takes_spares_in_at_a_boundary(tmp_path):
    ctl, fake = _controller(tmp_path, room=1, min_workers=1, max_workers=3)
    q = _ask(ctl, "scale", 3)
    result = ctl.run()
    assert q.get_nowait() == 3
    assert result.history[-1]["world_size"] == 3
    scaled = next(e for e in ctl.events if e.kind == "scaled")
    assert scaled.data["source"] == "peers"


def test_scale_down(tmp_path):
    ctl, fake = _controller(tmp_path, num_workers=3, min_workers=1)
    q = _ask(ctl, "scale", 1)
    result = ctl.run()
    assert q.get_nowait() == 1 and result.history[-1]["world_size"] == 1


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
