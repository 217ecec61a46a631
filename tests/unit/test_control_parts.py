"""The controller's pure parts: restore planning, requests and the inbox."""

from __future__ import annotations

import queue

import pytest

from elastic.control.regroup import peer_plan, required_keys, roll_forward_ranks
from elastic.control.requests import Inbox, Request, RequestError, parse
from elastic.errors import (
    CheckpointCorruptError,
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
        assert isinstance(worker_error(e, 0), GroupError)
    health.record("all-reduce failed")
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            assert isinstance(worker_error(e, 0, health.failed()), GroupError)
    finally:
        health.reset()


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
