"""Buddy copies right after a restore, the controller's view on the fake group: every
restore now takes the restored state's copies before it returns (the workers' side, on a
process pool: ``tests/integration/test_copies_after_restore.py``), so a second loss right
after a recovery or an evacuation comes back to that step from the buddies."""

from __future__ import annotations

from typing import Any

from elastic.config import JobConfig
from tests.helpers import RegressionData, adam, mlp, mse

EVERY = 5


# ----------------------------------------------------------------------- the controller's view
# (``tests/unit/fake_group.py`` reports copies as the workers now hold them: the restored
# step's at once after every restore, then the first boundary's and every k-th)

def _controller(tmp_path: Any, **kw: Any) -> tuple[Any, Any]:
    from elastic.control import Controller
    from tests.unit.fake_group import FakeGroup

    cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                    global_batch_size=8, max_steps=20, view="none", strategy="zero3",
                    num_workers=3, min_workers=1, run_dir=str(tmp_path / "run"), name="unit",
                    peer_copies_every=EVERY, **kw)
    fake = FakeGroup(mlp())
    fake.copies_every = EVERY
    ctl = Controller(cfg, group_factory=lambda c: fake, mailbox_factory=lambda job: None)
    return ctl, fake


def _recoveries(ctl: Any) -> list[tuple[str, int, int]]:
    return [(e.data["source"], e.step, e.data["steps_lost"]) for e in ctl.events
            if e.kind == "recovered"]


def test_a_second_loss_before_any_step_after_a_buddies_recovery_comes_back_from_them(
        tmp_path):
    """Rank 1 lost at step 8: back to step 5 from the buddies. Rank 0 lost as the group
    goes on, before step 5 trains again (a wave of reclaims): back to step 5 from the
    buddies again (the copies the restore took), not to step 0 (no checkpoints here)."""
    ctl, fake = _controller(tmp_path)
    fake.fail(step=8, rank=1, kind="lost")
    restore = fake.restore_from_copies

    def then_lose(spec: Any, step: int) -> list[dict[str, Any]]:
        out = restore(spec, step)
        if len(fake.faults) == 1:  # the next loss as soon as the group goes on
            fake.fail(step=step, rank=0, kind="lost")
        return out

    fake.restore_from_copies = then_lose
    result = ctl.run()
    assert _recoveries(ctl) == [("buddies", EVERY, 3), ("buddies", EVERY, 0)]
    assert [c for c in fake.calls if c[0].startswith("restore")] == [
        ("restore_from_copies", EVERY)] * 2
    assert "restart_fresh" not in [c[0] for c in fake.calls]
    assert result.history[-1]["world_size"] == 1


def test_a_loss_right_after_an_evacuation_comes_back_to_the_evacuations_step(tmp_path):
    """A node announces its end; at the boundary (step 7) its rank's pieces are handed off
    and the survivors load zero3 from them. A survivor is lost before step 7 trains: the
    copies the evacuation's restore took bring it back to step 7, no step lost. (The old
    ring's copy of step 5 is gone with its ring: a worker used to hold none at all here.)"""
    ctl, fake = _controller(tmp_path, drain_poll_s=1e-9)
    fake.announce_at[6] = (2, 60.0)
    fake.fail(step=7, rank=1, kind="lost")
    ctl.run()
    ev = [e for e in ctl.events if e.kind == "evacuated"]
    assert len(ev) == 1 and ev[0].data["path"] == "move" and ev[0].data["step"] == 7
    assert _recoveries(ctl) == [("buddies", 7, 0)]
    assert ("restore_from_copies", 7) in fake.calls
