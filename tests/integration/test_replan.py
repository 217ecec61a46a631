"""The closed loop on a live job (issue 16 point 5): ``strategy="auto"`` re-fits its cost model
to its own step timings every ``replan_every`` steps and acts on what pays. Here a worker
becomes 6x slower mid-run: the loop names it a straggler and re-cuts the shares around it, an
event says why with the numbers, and the trained parameters stay those of one process."""

from __future__ import annotations

import time

import elastic
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mse, wide_mlp

G = 64
TOL = 1e-5


def _slowed(tmp_path, strategy: str, step: int) -> elastic.JobHandle:
    """A 20,000-step job of ``strategy`` whose rank 1 computes 6x slower from ``step``."""
    return elastic.submit(
        model=wide_mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=20_000, num_workers=2, view="none", run_dir=str(tmp_path / "run"),
        strategy=strategy, replan_every=10, rebalance_every=0,
        faults=[{"rank": 1, "step": step, "action": "slowdown", "factor": 6}])


def _said(ctl) -> str:
    """What the loop said: its decisions (with the figures they stood on), stragglers and
    switches, and every other event's kind (a failure's message)."""
    def figures(e) -> str:
        d = e.data or {}
        return (f" [ranks {[float(f'{t:.3g}') for t in d.get('rank_s_per_sample', ())]}, cut "
                f"{d.get('shares')} -> {d.get('recut')}]" if e.kind == "replan" else "")

    def kept(e) -> bool:
        return e.kind == "replan" and e.data["decision"] == "KeepPlan"

    said = [f"{e.step}: {e.message}{figures(e)}" if e.kind in ("replan", "straggler", "switch")
            else f"{e.step}: ({e.kind})" for e in ctl.events]
    # every change and straggler; of the many KeepPlans, the first and last few
    keep = [i for i, e in enumerate(ctl.events) if kept(e)]
    shown = set(keep[:6] + keep[-6:]) | {i for i, e in enumerate(ctl.events) if not kept(e)}
    return "\n".join(said[i] if i in shown else "..." for i in range(len(said))
                     if i in shown or i - 1 in shown)


def _resplit_done(handle, t0: float, since: int = 0) -> tuple[object, object]:
    """Wait for the loop's first stage re-split after event ``since`` and for its layout to
    run; stop the job. Its event and the job's result."""
    ctl = handle.controller

    def resplit() -> list:
        return [e for e in ctl.events[since:] if e.kind == "replan"
                and e.data["decision"] == "RecutShares" and e.data["cut"] == "stage split"]

    while not resplit():
        assert not handle.done() and time.time() - t0 < 240, _said(ctl)
        time.sleep(0.05)
    ev = resplit()[0]
    while ctl.spec.stage_split != tuple(ev.data["recut"]):  # at the next boundary
        assert not handle.done() and time.time() - t0 < 270
        time.sleep(0.05)
    handle.stop()
    return ev, handle.result(timeout=120)


def _matches_one_process(result) -> None:
    """The job against one process on the same global batches. Adam amplifies the order of
    float additions (the only thing a layout changes) over a long run: one process against
    itself with each gradient summed from two halves of the batch (as two ranks' all-reduce
    sums it) is 3.6e-7 apart after 200 steps of this model, 4.2e-6 after 600, 3.2e-3 after
    1215, and these jobs run as many steps as the loop takes to decide (one failed at 1215
    steps with 2.6e-3, four layouts run, in CI, 2026-12-07). So: each step's loss within
    1e-4 of one process's while the two-halves run's stays within 1e-5 of it (a lost,
    repeated or mis-shared step shows there), and the final parameters within ``TOL``, or
    within 10x the two-halves run's distance when that is under 1e-3; past it the two runs
    have drifted apart and the losses are the check."""
    n = len(result.history)
    ref, ref_losses = reference_train(wide_mlp, adam, mse, RegressionData(), G, n, seed=0)
    diff = max_diff(result.state_dict(), ref)
    two, halves = reference_train(wide_mlp, adam, mse, RegressionData(), G, n, seed=0, parts=2)
    floor = max_diff(two, ref)
    close = next((s for s in range(n) if abs(halves[s] - ref_losses[s]) > 1e-5), n)
    job = [h["loss"] for h in result.history]
    off = [(s, job[s], ref_losses[s]) for s in range(close) if abs(job[s] - ref_losses[s]) > 1e-4]
    switches = [(e.data["from"], e.data["to"], e.step) for e in result.events
                if e.kind == "switch"]
    assert close >= min(n, 100) and not off, (n, close, off[:5], switches)
    assert floor >= 1e-3 or diff < max(TOL, 10 * floor), (n, diff, floor, switches)


def test_a_live_auto_job_names_a_straggler_and_re_cuts_its_share(ray_local, tmp_path):
    handle = elastic.submit(
        model=wide_mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
        max_steps=20_000, num_workers=2, view="none", run_dir=str(tmp_path / "run"),
        strategy="auto", replan_every=10, rebalance_every=0, profile_cache=False)
    ctl = handle.controller
    t0 = time.time()
    while handle.status()["step"] < 4:
        assert not handle.done() and time.time() - t0 < 120, [e.message for e in ctl.events]
        time.sleep(0.05)
    plan = next(e for e in ctl.events if e.kind == "plan")
    # every term was measured, repeated, with its spread
    assert {"all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter"} <= set(
        plan.data["spreads"]["collectives"])
    assert plan.data["spreads"]["trial"]["n"] >= 5
    # and the update's cost inside a step (a trial without it), as a factor on its timed figure
    assert plan.data["spreads"]["trial_no_update"]["n"] >= 5
    assert 0.0 <= plan.data["spreads"]["optimizer_scale"] <= 4.0
    assert plan.data["spreads"]["trial_zero1"]["n"] >= 2  # the wait at zero1's burst
    assert plan.data["spreads"]["trial_zero3"]["n"] >= 2  # zero3's per-unit wait, world > 1
    # and a pipeline's: its schedule timed apart from the rest of its step
    pipe = plan.data["spreads"]["trial_pipeline"]
    assert pipe["step"]["n"] >= 3 and 0 < pipe["schedule"]["median"] < pipe["step"]["median"]
    assert 0.0 <= pipe["msg_scale"] <= 4.0
    picked = ctl.spec.name
    ray_local.get(ctl.workers[1].handle.set_emulation.remote({"slowdown": 6}))

    def cut_down(e) -> tuple | None:
        """What a change the loop decided naming rank 1 gives it, when that is less than
        rank 0's: a re-cut of the running layout's shares (or split), or a switch (or a try)
        to a layout that carries one (dp at shares re-cut around it, a pipeline split off
        it)."""
        d = e.data or {}
        if e.kind != "replan" or "rank 1 slower than its peers" not in e.message:
            return None
        if d["decision"] == "RecutShares":
            new, how = d["recut"], d["cut"]
        elif d["decision"] in ("SwitchPlan", "TryPlan"):
            new = d["to"]["stage_split"] or d["to"]["shares"]
            how = "stage split" if d["to"]["stage_split"] else "shares"
        else:
            return None
        # rank 1's blocks (or samples) against rank 0's, and at most a third of the whole: a
        # cut that follows a rank 2x slower or more, not a layout's near-even split
        # (ranks keep their order in every live plan: stage-major, rank r on position r)
        pp = 2 if how == "stage split" else len(new)
        held = [sum(new[j::pp]) for j in range(pp)]
        return (tuple(new), how) if held[1] < held[0] and 3 * held[1] <= sum(new) else None

    def recut() -> list:
        # around rank 1 (on a loaded 2-core machine rank 0 can be named for a while too)
        return [e for e in ctl.events if cut_down(e)]

    while not recut():
        assert not handle.done() and time.time() - t0 < 240, _said(ctl)
        time.sleep(0.05)
    ev = recut()[0]
    new, how = cut_down(ev)

    def cut(spec) -> tuple:  # what the change gives: the shares, or a pipeline's split
        return spec.stage_split if how == "stage split" else spec.shares

    while cut(ctl.spec) != new:  # at the next boundary
        assert not handle.done() and time.time() - t0 < 270, _said(ctl)
        time.sleep(0.05)
    handle.stop()
    result = handle.result(timeout=120)
    strag = [e for e in result.events if e.kind == "straggler" and e.data["ranks"] == [1]]
    assert strag and strag[0].step <= ev.step
    rank_s = ev.data["rank_s_per_sample"]
    assert rank_s[1] > 2 * rank_s[0]  # the numbers say why
    assert how == "stage split" or sum(new) == G
    assert {"RecutShares": "> re-layout", "SwitchPlan": "> switch",
            "TryPlan": "trying it"}[ev.data["decision"]] in ev.message
    # the closed loop may also have moved the layout before or after the straggler appeared
    # (it learns from the job's own steps: it has found pp2 faster than dp with the
    # straggler, its split off it); the change is the replan switch at or after the decision
    sw = next(e for e in result.events if e.kind == "switch" and e.data["reason"] == "replan"
              and e.step >= ev.step)
    assert ev.data["decision"] != "RecutShares" or sw.data["from"] == sw.data["to"]
    assert cut(ctl.spec) == new
    assert picked in [e.data["from"] for e in result.events if e.kind == "switch"] + [sw.data["to"]]
    assert result.history[-1]["strategy"] == sw.data["to"]
    _matches_one_process(result)


def test_a_live_pipeline_names_a_straggler_and_re_splits_its_stages(ray_local, tmp_path):
    """A named pipeline (pp 2) whose rank 1 computes 6x slower from step 30 (the
    ``slowdown`` fault): the loop names it against its stage's figure at the layout's start
    (its first steps, whenever the first decision comes) and moves its blocks to rank 0 (the
    stage split re-cut, the same layout otherwise); the parameters stay those of one
    process. (Twice in a full suite, its steps fast on warm workers, the first decision came
    after step 30 and took the slow steps for the footing: no straggler in 3000 steps.)"""
    handle = _slowed(tmp_path, "pipeline", 30)
    t0 = time.time()

    ev, result = _resplit_done(handle, t0)
    strag = [e for e in result.events if e.kind == "straggler" and e.data["ranks"] == [1]]
    assert strag and 30 < strag[0].step <= ev.step, [e.message for e in result.events
                                                     if e.kind in ("replan", "straggler")]
    assert "their stage's figure" in strag[0].message
    old, new = ev.data["shares"], ev.data["recut"]
    assert new[0] > old[0] and sum(new) == sum(old), (old, new)
    assert all(h["strategy"] == "pipeline" for h in result.history)
    _matches_one_process(result)


def test_a_pipeline_entered_with_a_known_straggler_re_splits_its_stages(ray_local, tmp_path):
    """dp names rank 1 (6x slower from step 20) and re-cuts its share; the user then
    switches to a pipeline, whose first steps are slow already: the loop takes rank 1's known
    slowness out of the stages' footing, names it there too and moves its blocks to rank 0.
    Was: the footing was the slow first steps, rank 1 read as its stage's norm, and a split
    of [2, 3] blocks whose stage times called for [4, 1] ran on (an auto job that moved to
    pp2 after the straggler appeared ran 2800 steps so, twice in 28 runs)."""
    handle = _slowed(tmp_path, "dp", 20)
    ctl = handle.controller
    t0 = time.time()

    while not any(e.kind == "straggler" and e.data["ranks"] == [1] for e in ctl.events):
        assert not handle.done() and time.time() - t0 < 120, _said(ctl)
        time.sleep(0.05)
    handle.switch("pipeline")
    ev, result = _resplit_done(handle, t0, since=len(ctl.events))
    old, new = ev.data["shares"], ev.data["recut"]
    assert new[1] < old[1] and sum(new) == sum(old), (old, new)
    rel = ev.data["rank_s_per_sample"]
    assert rel[1] > 2 * rel[0] and "rank 1 slower than its peers" in ev.message
    _matches_one_process(result)
