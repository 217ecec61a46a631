"""A job whose rank 1 sees NaN at one step, under ``on_nonfinite: skip`` (issue 13 point 1).

The job config's ``faults`` hook (``elastic/worker/faults.py``, action ``nan``) makes rank 1's
inputs NaN at step ``NAN_STEP``. Every rank must skip that step's update alike (the layouts
skip an update whose global gradient norm is not finite; the loop agrees the step was bad
and, under ``skip``, goes on), so the job ends where the single-process reference that draws
that batch and skips its update ends (``reference_train(skip_steps=...)``, within the 1e-5 of
test_fit.py), and every checkpoint it commits, before and after that step, is finite and is
the reference's state at its step: a NaN never reaches a committed checkpoint (nor a refused
one: no ``checkpoint_refused`` event).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import elastic
from elastic.checkpoint import CheckpointStore, committed_steps, load
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

G = 12
STEPS = 8
NAN_STEP = 3
TOL = 1e-5


def _ref(steps: int, skip: bool = True) -> dict[str, torch.Tensor]:
    state, _ = reference_train(mlp, adam, mse, RegressionData(), G, steps, seed=0,
                               skip_steps={NAN_STEP} if skip else ())
    return state


@pytest.mark.parametrize("strategy,workers", [("dp", 2), ("zero2", 3)])
def test_a_nan_step_is_skipped_everywhere_and_never_checkpointed(ray_local, tmp_path,
                                                                 strategy, workers):
    uri = str(tmp_path / "ckpt")
    faults = str(tmp_path / "faults")
    result = elastic.fit(
        model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=STEPS, num_workers=workers, strategy=strategy, view="none",
        run_dir=str(tmp_path / "run"), checkpoint_uri=uri, checkpoint_every=2, keep_last=10,
        on_nonfinite="skip", faults=[{"rank": 1, "step": NAN_STEP, "action": "nan",
                                      "dir": faults}])
    assert os.listdir(faults) == [f"fired-rank1-step{NAN_STEP}"]  # the fault did fire
    hist = {h["step"]: h for h in result.history}
    assert sorted(hist) == list(range(STEPS))
    assert [s for s, h in hist.items() if h.get("skipped")] == [NAN_STEP]
    bad_loss = hist[NAN_STEP]["loss"]
    assert bad_loss is None or not math.isfinite(bad_loss)
    assert all(math.isfinite(h["loss"]) for s, h in hist.items() if s != NAN_STEP)
    # the job ends where the reference that skipped that update ends, not where training on
    # it would (that one is finite here too, but elsewhere)
    final = result.state_dict()
    assert max_diff(final, _ref(STEPS)) < TOL
    assert max_diff(final, _ref(STEPS, skip=False)) > 100 * TOL
    # every checkpoint committed (steps 2, 4, 6, 8: before and after the NaN) is finite and
    # is the reference's state at its step; none was refused for non-finite values
    assert not [e for e in result.events if e.kind == "checkpoint_refused"]
    steps = committed_steps(CheckpointStore(uri))
    assert steps == [2, 4, 6, 8]
    for s in steps:
        saved = load(CheckpointStore(uri), s)
        assert all(bool(torch.isfinite(v).all()) for v in saved.values()), s
        model = {k[len("model/"):]: v for k, v in saved.items() if k.startswith("model/")}
        assert max_diff(model, _ref(s)) < TOL, s


def _slow_mse(out, y):
    import time

    time.sleep(0.02)  # steps run while the slow upload goes on
    return mse(out, y)


def test_a_rollback_while_a_checkpoint_uploads_goes_back_to_it(ray_local, tmp_path):
    """``on_nonfinite: rollback`` with NaN at step 12 while checkpoint 10 still uploads (rank
    0's upload is slow). That checkpoint is of a step before the bad one, so it commits first
    and the job goes back to it (2 steps again, not 7). Before, the rollback went back to 5,
    checkpoint 10 committed after, and the replay's new checkpoint 10 was taken for a late
    report of that one: the workers held it with nothing to commit it, and every later one
    was skipped, each after waiting ``checkpoint_wait_s``. The run ends on the reference (the
    fault fires once: the replayed step 12 is clean)."""
    uri = str(tmp_path / "ckpt")
    faults = str(tmp_path / "faults")
    steps = 25
    result = elastic.fit(
        model=mlp, optimizer=adam, loss=_slow_mse, dataset=RegressionData(),
        global_batch_size=G, max_steps=steps, num_workers=2, view="none",
        run_dir=str(tmp_path / "run"), checkpoint_uri=uri, checkpoint_every=5, keep_last=10,
        checkpoint_wait_s=20, on_nonfinite="rollback",
        faults=[{"rank": 0, "step": 10, "action": "slow_upload", "seconds": 1.5, "dir": faults},
                {"rank": 1, "step": 12, "action": "nan", "dir": faults}])
    kinds = [(e.kind, e.step, e.message) for e in result.events if e.kind != "state"]
    back = [e for e in result.events if e.kind == "rolled_back"]
    assert [(e.data["from"], e.data["to"]) for e in back] == [(12, 10)], kinds
    assert not [k for k in kinds if k[0] in ("checkpoint_skipped", "checkpoint_failed")], kinds
    assert committed_steps(CheckpointStore(uri)) == [5, 10, 15, 20, 25], kinds
    assert max_diff(result.state_dict(), _ref(steps, skip=False)) < TOL


def test_a_rank_hung_in_a_rollbacks_restore_is_cut_off_and_replaced(ray_local, tmp_path):
    """A rank blocks for ever reading the checkpoint a rollback goes back to (the
    ``hang_restore`` fault: a storage read that never returns), outside any training step.
    Its peer times out in the restore's agreement and raises; the hung rank is ended at the
    hang window after that (``failures.hang_timeout_s`` + slack) and the job recovers
    without it, to the reference's parameters. Before, the controller waited on the hung
    rank's call for ever (no watchdog outside segments)."""
    uri = str(tmp_path / "ckpt")
    faults = str(tmp_path / "faults")
    steps = 12
    t0 = time.monotonic()
    handle = elastic.submit(
        model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=steps, num_workers=2, min_workers=1, view="none",
        run_dir=str(tmp_path / "run"), checkpoint_uri=uri, checkpoint_every=5, keep_last=10,
        on_nonfinite="rollback", hang_timeout_s=3, replacement_timeout_s=2,
        faults=[{"rank": 1, "step": 7, "action": "nan", "dir": faults},
                {"rank": 1, "step": 5, "action": "hang_restore", "dir": faults}])
    result = handle.result(timeout=150)
    took = time.monotonic() - t0
    assert sorted(os.listdir(faults)) == ["fired-rank1-step5", "fired-rank1-step7"]
    kinds = [(e.kind, e.message) for e in result.events if e.kind != "state"]
    hung = [m for k, m in kinds if k == "failure" and "hung" in m]
    assert hung and "rank 1" in hung[0] and "restore_checkpoint" in hung[0], kinds
    assert any(k == "recovered" for k, _ in kinds), kinds
    assert took < 120, took
    assert max_diff(result.state_dict(), _ref(steps, skip=False)) < TOL
