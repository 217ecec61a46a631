"""clusters.policy: every policy's whole decision table (pure, no Ray, no clock)."""

from __future__ import annotations

import pytest

from clusters.policy import (
    Acquire,
    CheckpointRecord,
    FailureBudget,
    FailureObservation,
    GiveUp,
    InPlaceRecovery,
    NonFiniteObservation,
    NonFinitePolicy,
    Proceed,
    Recover,
    Refuse,
    Resize,
    RestartAllRecovery,
    Restore,
    RestoreObservation,
    RetentionPolicy,
    Rollback,
    ScalingObservation,
    ScalingPolicy,
    SkipStep,
    StartSpares,
    Stop,
)

# ------------------------------------------------------------------ failure budget


@pytest.mark.parametrize(
    ("max_failures", "failures", "recover"),
    [(3, 1, True), (3, 3, True), (3, 4, False), (0, 1, False), (-1, 1, True), (-1, 10**6, True)],
)
def test_failure_budget_counts_recoverable_failures(max_failures, failures, recover):
    d = FailureBudget(max_failures).decide(
        FailureObservation("node_lost", True, failures, "node a100-3 died"))
    if recover:
        assert isinstance(d, Recover) and "node lost" in d.reason
        assert ("unlimited" if max_failures < 0 else f"of {max_failures}") in d.reason
    else:
        assert isinstance(d, GiveUp)
        assert f"after {failures} failures (max_failures={max_failures})" in d.reason
        assert "node a100-3 died" in d.reason and "Fix: raise max_failures" in d.reason


@pytest.mark.parametrize("max_failures", [-1, 0, 5])
def test_failure_budget_gives_up_at_once_on_what_is_not_recoverable(max_failures):
    d = FailureBudget(max_failures).decide(
        FailureObservation("user_code", False, 1, "ZeroDivisionError"))
    assert isinstance(d, GiveUp)
    assert d.reason == "user code is not recoverable: ZeroDivisionError"


# ------------------------------------------------------------------ restore source


@pytest.mark.parametrize(
    ("peer_step", "checkpoints", "cause", "want"),
    [
        (120, (100, 50), "failure", Restore("peers", 120)),
        (120, (), "join", Restore("peers", 120)),
        (None, (50, 100, 75), "failure", Restore("checkpoint", 100)),
        (None, (), "failure", Restore("scratch", 0)),
        (None, (), "join", Restore("scratch", 0)),
    ],
)
def test_in_place_recovery(peer_step, checkpoints, cause, want):
    pol = InPlaceRecovery()
    assert pol.name == "elastic"
    got = pol.decide(RestoreObservation(130, peer_step, checkpoints, cause))
    assert got == want and not got.restart_all


@pytest.mark.parametrize(
    ("peer_step", "checkpoints", "cause", "want"),
    [
        (120, (100, 50), "failure", Restore("checkpoint", 100, restart_all=True)),
        (120, (100,), "join", Restore("checkpoint", 100, restart_all=True)),
        (None, (), "failure", Restore("scratch", 0, restart_all=True)),
        (130, (), "join", Restore("scratch", 0, restart_all=True)),
    ],
)
def test_restart_all_recovery_ignores_peers_and_restarts_every_worker(
        peer_step, checkpoints, cause, want):
    pol = RestartAllRecovery()
    assert pol.name == "restart-all"
    assert pol.decide(RestoreObservation(130, peer_step, checkpoints, cause)) == want


def test_restore_observation_defaults_to_a_failure():
    assert RestoreObservation(5, None).cause == "failure"
    assert RestoreObservation(5, None).checkpoints == ()


# ------------------------------------------------------------------ scaling


def _obs(phase, workers, target=4, lo=1, hi=4, **kw):
    return ScalingObservation(phase, workers, target, lo, hi, **kw)


@pytest.mark.parametrize(
    ("policy", "obs", "want"),
    [
        # recovery: go on when the survivors make the target size
        (ScalingPolicy(), _obs("recovery", 4), Proceed),
        (ScalingPolicy(), _obs("recovery", 5, hi=8), Proceed),
        # take ready spares; place the rest only when allowed to wait for them
        (ScalingPolicy(), _obs("recovery", 2, spares_ready=1), Acquire(1, 0, 0.0)),
        (ScalingPolicy(), _obs("recovery", 2), Acquire(0, 0, 0.0)),
        (ScalingPolicy(replacement_timeout_s=30), _obs("recovery", 2, spares_ready=1),
         Acquire(1, 1, 30.0)),
        (ScalingPolicy(replacement_timeout_s=30), _obs("recovery", 2, spares_ready=5),
         Acquire(2, 0, 0.0)),
        # the wanted size is the target within [min_workers, max_workers]
        (ScalingPolicy(replacement_timeout_s=30), _obs("recovery", 1, target=2, lo=3, hi=8),
         Acquire(0, 2, 30.0)),
        (ScalingPolicy(replacement_timeout_s=30), _obs("recovery", 6, target=10, hi=8),
         Acquire(0, 2, 30.0)),
        # recovered: below min_workers, wait for placements
        (ScalingPolicy(), _obs("recovered", 2, lo=2), Proceed),
        (ScalingPolicy(min_workers_timeout_s=45), _obs("recovered", 1, lo=3),
         Acquire(0, 2, 45.0)),
        # waited: still below min_workers, give up
        (ScalingPolicy(), _obs("waited", 3, lo=3), Proceed),
        (ScalingPolicy(), _obs("waited", 1, lo=3), GiveUp),
        # running: take ready spares in, else start spares where there is room
        (ScalingPolicy(), _obs("running", 2, spares_ready=1), Resize(3, warm_only=True)),
        (ScalingPolicy(), _obs("running", 2, spares_ready=7), Resize(4, warm_only=True)),
        (ScalingPolicy(), _obs("running", 2, spares_starting=1, room=True), StartSpares(1)),
        (ScalingPolicy(), _obs("running", 2, spares_starting=2, room=True), Proceed),
        (ScalingPolicy(), _obs("running", 2), Proceed),
        (ScalingPolicy(), _obs("running", 4, spares_ready=2, room=True), Proceed),
    ],
)
def test_scaling_policy(policy, obs, want):
    got = policy.decide(obs)
    if isinstance(want, type):
        assert isinstance(got, want)
        if want is GiveUp:
            assert "fewer than min_workers=3" in got.reason and "Fix:" in got.reason
        return
    assert type(got) is type(want)
    fields = {k: v for k, v in got.__dict__.items() if k != "reason"}
    assert fields == {k: v for k, v in want.__dict__.items() if k != "reason"}


def test_scaling_policy_reasons_and_unknown_phase():
    assert "lost workers" in ScalingPolicy(replacement_timeout_s=5).decide(
        _obs("recovery", 2)).reason
    assert "min_workers=3" in ScalingPolicy().decide(_obs("recovered", 1, lo=3)).reason
    assert ScalingPolicy().decide(_obs("running", 2, spares_ready=1)).reason
    with pytest.raises(ValueError, match="unknown scaling phase 'paused'"):
        ScalingPolicy().decide(_obs("paused", 2))


@pytest.mark.parametrize(("n", "ok"), [(1, True), (4, True), (0, False), (5, False)])
def test_scaling_requests(n, ok):
    d = ScalingPolicy.check_request(n, 1, 4)
    if ok:
        assert d == Resize(n, reason="requested")
    else:
        assert isinstance(d, Refuse) and f"cannot scale to {n} workers" in d.reason
        assert "1..4" in d.reason


# ------------------------------------------------------------------ retention


def _recs(*steps, bad=(), unverified=()):
    return [CheckpointRecord(s, finite=s not in bad, verified=s not in unverified) for s in steps]


@pytest.mark.parametrize(
    ("policy", "records", "deleted"),
    [
        (RetentionPolicy(keep_last=3), _recs(10, 20, 30, 40, 50), (10, 20)),
        (RetentionPolicy(keep_last=3), _recs(50, 10, 40, 30, 20), (10, 20)),  # any order
        (RetentionPolicy(keep_last=5), _recs(10, 20, 30), ()),
        (RetentionPolicy(keep_last=1), [], ()),
        (RetentionPolicy(keep_last=2, keep_every=20), _recs(10, 20, 30, 40, 50), (10, 30)),
        # the newest good one is kept however many bad ones came after it
        (RetentionPolicy(keep_last=2), _recs(10, 20, 30, 40, bad=(30,), unverified=(40,)),
         (10,)),
        (RetentionPolicy(keep_last=2), _recs(10, 20, 30, 40, bad=(20, 30, 40)), (20,)),
        (RetentionPolicy(keep_last=1), _recs(10, 20, 30, bad=(10, 20, 30)), (10, 20)),
    ],
)
def test_retention_policy(policy, records, deleted):
    assert policy.decide(records) == deleted


def test_retention_needs_one_checkpoint_kept():
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        RetentionPolicy(keep_last=0).decide(_recs(10))


# ------------------------------------------------------------------ non-finite steps


@pytest.mark.parametrize(
    ("policy", "consecutive", "rank", "want", "text"),
    [
        (NonFinitePolicy("stop"), 1, 3, Stop, "non-finite loss or gradient at step 7 (rank 3)"),
        (NonFinitePolicy("rollback"), 4, None, Rollback, "at step 7"),
        (NonFinitePolicy("skip", max_skips=2), 1, 0, SkipStep, "update skipped (1 in a row)"),
        (NonFinitePolicy("skip", max_skips=2), 2, 0, SkipStep, "(2 in a row)"),
        (NonFinitePolicy("skip", max_skips=2), 3, 0, Stop, "3 non-finite steps in a row"),
        (NonFinitePolicy(), 6, None, Stop, "max_nonfinite_skips=5): the run diverged"),
    ],
)
def test_nonfinite_policy(policy, consecutive, rank, want, text):
    d = policy.decide(NonFiniteObservation(7, consecutive, rank))
    assert isinstance(d, want) and text in d.reason
    if rank is None:
        assert "rank" not in d.reason


def test_nonfinite_policy_unknown_mode():
    with pytest.raises(ValueError, match="unknown on_nonfinite mode 'ignore'"):
        NonFinitePolicy("ignore").decide(NonFiniteObservation(1, 1))
