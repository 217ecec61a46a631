"""ZeRO-1/2's update as the strategy sends it (issue 16: auto must pick the fastest plan): every
owner's chunk broadcast at once, a burst, charged at what the profiler measured for such a
burst (per message), else at a broadcast's figures; the burst's meeting point at its own
measured wait."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from clusters import CostModel, Measurement, ModelProfile, Plan, calibrate, plan
from clusters.collectives import (
    BROADCAST_BURST as BURST,
)
from clusters.collectives import (
    KINDS,
    burst_points,
    collective_time,
    layout_messages,
    sync_points,
)
from clusters.measured import Spread, terms_model
from clusters.refit import Observed, refit
from tests.unit.test_clusters_measured import _base, _live, _reports

MB = 1e6


def _many_tensors() -> ModelProfile:
    """A small MLP-like model of 130 tensors (4000 elements each, 2.08 MB in all)."""
    return ModelProfile(block_params=(52_000,) * 10, block_tensors=((4000,) * 13,) * 10,
                        bytes_per_param=4, optimizer_bytes_per_param=8, precision="fp32")


def _model(ids, burst: tuple[float, float] | None, burst_wait: float | None) -> CostModel:
    """Equal compute; an optimizer-bound step (6.5 ms over every tensor); broadcasts of 1 ms +
    1 ns/byte each; 1 ms waited at each meeting point."""
    coll = {"all_reduce": (1e-4, 1e-10), "broadcast": (1e-3, 1e-9)}
    if burst is not None:
        coll[BURST] = burst
    return CostModel(seconds_per_sample={i: 1e-4 for i in ids}, collectives=coll,
                     optimizer_fit={i: (1e-5, 1e-8, 1e-5) for i in ids}, pass_overhead_s=0.0,
                     sync_wait_s=1e-3, burst_wait_s=burst_wait)


def test_the_burst_is_charged_its_own_figures_else_a_broadcasts():
    cluster, ids = _live()
    path = cluster.path([cluster.device(i) for i in ids])
    old = CostModel(collectives={"broadcast": (1e-3, 2e-9)})
    assert old.alpha_beta(path, BURST) == (1e-3, 2e-9)  # an older profile: no burst timed
    new = replace(old, collectives={**old.collectives, BURST: (1e-4, 1e-9)})
    assert new.alpha_beta(path, BURST) == (1e-4, 1e-9)
    assert new.alpha_beta(path, "broadcast") == (1e-3, 2e-9)
    # the closed loop's factor is the burst's own, also on the figures it falls back to
    scaled = replace(old, comm_scale={BURST: 2.0})
    assert scaled.alpha_beta(path, BURST) == (2e-3, 4e-9)
    assert scaled.alpha_beta(path, "broadcast") == (1e-3, 2e-9)
    # catalog-only planning (and the simulator): the link's figures, as for a broadcast
    assert CostModel().alpha_beta(path, BURST) == CostModel().alpha_beta(path, "broadcast")
    for n in (2, 3, 8, 1000):  # one message of a burst is a broadcast of its bytes
        assert collective_time(BURST, MB, n, 1e-3, 1e-9) == collective_time(
            "broadcast", MB, n, 1e-3, 1e-9)
    # every other layout's messages are unchanged; zero1/zero2 send their update as a burst
    t = [4000.0 * 4] * 130
    assert not any(m.kind == BURST for s in ("dp", "zero3")
                   for m in layout_messages(s, 2, t, [52_000.0 * 4] * 10))
    for s in ("zero1", "zero2"):
        for hooks in (True, False):
            kinds = {m.kind for m in layout_messages(s, 2, t, hooks=hooks)}
            assert BURST in kinds and "broadcast" not in kinds
            assert burst_points(s, 2) == 1 <= sync_points(s, 2, hooks=hooks) - 1
    assert burst_points("dp", 2) == burst_points("zero3", 2) == burst_points("zero1", 1) == 0


def test_zero1_on_an_optimizer_bound_model_pays_the_burst_not_serial_broadcasts():
    """The issue's misses: zero1 measured 1.08-1.26x faster than dp on mlp/dlrm, predicted
    2-6 % slower, because its two owners' broadcasts were charged one after the other plus a
    wait. With a burst measured at the cost of one broadcast (both chunks in flight), zero1's
    update costs half as much, and auto picks it."""
    cluster, ids = _live()
    prof = _many_tensors()
    serial = _model(ids, None, None)
    # the whole burst of 2 took what one broadcast takes: half of it per message
    burst = _model(ids, (0.5e-3, 0.5e-9), 0.2e-3)
    z1 = Plan(strategy="zero1", world_size=2, shares=(32, 32), devices=tuple(ids))
    dp = Plan(strategy="dp", world_size=2, shares=(32, 32), devices=tuple(ids))
    chunk = 4 * 4000 * 65  # each owner's 65 tensors in one chunk
    bcast = collective_time("broadcast", chunk, 2, 1e-3, 1e-9)
    e_serial, e_burst = serial.estimate(z1, cluster, prof), burst.estimate(z1, cluster, prof)
    # the same all-reduce and first wait; the update: 2 broadcasts + a wait, against 2 half
    # broadcasts + the burst's own wait
    assert e_serial.comm - e_burst.comm == pytest.approx(2 * bcast - bcast + 1e-3 - 0.2e-3)
    assert e_burst.comm < 0.6 * e_serial.comm
    e_dp = serial.estimate(dp, cluster, prof)
    assert burst.estimate(dp, cluster, prof).step_time == e_dp.step_time  # dp sends no burst
    assert e_serial.step_time > e_dp.step_time > e_burst.step_time
    picks = [plan(cluster, prof, 64, model=m, subsets=False, strategies=("dp", "zero1"),
                  tie_tolerance=0.0).plan.strategy for m in (serial, burst)]
    assert picks == ["dp", "zero1"]


def test_a_pipeline_stages_zero1_and_zero2_use_the_same_rule():
    cluster, ids = _live()
    prof = _many_tensors()
    serial, burst = _model(ids, None, None), _model(ids, (0.5e-3, 0.5e-9), 0.0)
    blocks = range(3, 7)  # a middle stage: 52 tensors, 26 per owner
    bcast = collective_time("broadcast", 4 * 4000 * 26, 2, 1e-3, 1e-9)
    for mode in ("zero1", "zero2"):
        a = serial.sync_over(mode, blocks, 2, None, prof, micro_batches=4, hooks=False)[0]
        b = burst.sync_over(mode, blocks, 2, None, prof, micro_batches=4, hooks=False)[0]
        assert a - b == pytest.approx(2 * bcast - bcast + 1e-3)
    assert (serial.sync_over("dp", blocks, 2, None, prof, 4, hooks=False)
            == burst.sync_over("dp", blocks, 2, None, prof, 4, hooks=False))
    # a stage's burst and its wait go after the update, as a whole layout's do
    after = burst.sync_over("zero1", blocks, 2, None, prof, 4, hooks=False)[1]
    assert after > 0 and after == burst.sync_over("zero2", blocks, 2, None, prof, 4,
                                                  hooks=False)[1]
    assert burst.sync_over("dp", blocks, 2, None, prof, 4, hooks=False)[1] == 0


def _with_series(reports, kinds, wait, burst_whole=None, burst_wait=None):
    """Each report with idle and loaded series: the kinds at alpha 1 ms, beta 1 ns/byte
    (loaded = idle + ``wait``), and a burst whose whole time is ``burst_whole(bytes)``
    (loaded = idle + ``burst_wait``)."""
    sizes = (4096, 262144, 4 << 20)
    for r in reports:
        n = r["world"]
        idle = {k: [[s, [collective_time(k, s, n, 1e-3, 1e-9)] * 9] for s in sizes]
                for k in kinds}
        loaded = {k: [[s, [t[0] + wait] * 9] for s, t in rows] for k, rows in idle.items()}
        if burst_whole is not None:
            idle[BURST] = [[s, [burst_whole(s)] * 9] for s in sizes]
            loaded[BURST] = [[s, [burst_whole(s) + burst_wait] * 9] for s in sizes]
        r["collectives"], r["collectives_idle"] = loaded, idle
    return reports


def test_the_profilers_burst_is_fitted_per_message_with_its_own_wait():
    for n in (2, 3):
        cluster, ids = _live(n)
        kinds = ("all_reduce", "broadcast", "all_gather")
        def whole(s: float, n: int = n) -> float:  # n messages, two at a time (gloo)
            return collective_time("broadcast", s, n, 1e-3, 1e-9) * ((n + 1) // 2)

        reps = _with_series(_reports(n=n, c=(1e-3,) * n), kinds, 3e-3, whole, 0.5e-3)
        m = terms_model(reps, ids, _base(), cluster=cluster).model
        per = (n + 1) // 2 / n
        assert m.collectives[BURST] == pytest.approx((1e-3 * per, 1e-9 * per), rel=1e-6)
        assert m.collectives["broadcast"] == pytest.approx((1e-3, 1e-9), rel=1e-6)
        assert m.burst_wait_s == pytest.approx(0.5e-3)
        assert m.sync_wait_s == pytest.approx(3e-3)  # the other kinds' median, as before
    # an older profile (no burst timed): the broadcast's figures and the common wait
    cluster, ids = _live()
    reps = _with_series(_reports(trial_extra=20e-3), ("all_reduce", "broadcast"), 3e-3)
    mm = terms_model(reps, ids, _base(), cluster=cluster)
    assert BURST not in mm.model.collectives and mm.model.burst_wait_s is None
    assert mm.spreads["burst_wait"] is None and mm.model.overlap == 0
    z1 = Plan(strategy="zero1", world_size=2, shares=(32, 32), devices=tuple(ids))
    prof = mm.profile
    tensors = [prof.grad_bytes * t for t in prof.tensors(range(prof.n_blocks))]
    msgs = layout_messages("zero1", 2, tensors, comm=mm.model.comm)
    fig = {"all_reduce": (1e-3, 1e-9), BURST: (1e-3, 1e-9)}  # the burst at a broadcast's
    assert mm.model.estimate(z1, cluster, prof).comm == pytest.approx(
        2 * 3e-3 + sum(x.count * collective_time(x.kind, x.nbytes, 2, *fig[x.kind])
                       for x in msgs))
    # a burst timed after compute only: its figure holds the wait, none charged beside it
    reps = _with_series(_reports(), ("all_reduce",), 3e-3,
                        lambda s: collective_time("broadcast", s, 2, 1e-3, 1e-9), 0.0)
    for r in reps:
        del r["collectives_idle"][BURST]
    assert terms_model(reps, ids, _base(), cluster=cluster).model.burst_wait_s == 0.0


def test_the_closed_loop_refits_the_burst_as_a_kind_no_trial_step_checked():
    cluster, ids = _live()
    prof = _many_tensors()
    m = replace(_model(ids, (0.5e-3, 0.5e-9), 0.0), trial_kinds=("all_reduce",))
    assert BURST in KINDS
    z1 = Plan(strategy="zero1", world_size=2, shares=(32, 32), devices=tuple(ids))
    dp = Plan(strategy="dp", world_size=2, shares=(32, 32), devices=tuple(ids))
    before = {p.strategy: m.estimate(p, cluster, prof).step_time for p in (z1, dp)}
    slow = before["zero1"] + 2e-3
    fitted = refit(m, prof, cluster, [Observed(z1, Spread(slow, 1e-4, 50))])
    assert fitted.comm_scale[BURST] > 1.5 and set(fitted.comm_scale) == {BURST}
    assert fitted.estimate(z1, cluster, prof).step_time == pytest.approx(slow, rel=1e-3)
    assert fitted.estimate(dp, cluster, prof).step_time == pytest.approx(before["dp"],
                                                                         rel=0.02)
    # calibration takes the kind like any other
    c = calibrate([Measurement(device="*", samples=0, step_time=2e-3 + 1e-9 * s, world_size=2,
                               comm_bytes=s, collective=BURST) for s in (1e5, 1e6, 4e6)])
    assert c.links["*"] == pytest.approx((2e-3, 1e-9), rel=1e-6)


def test_the_profiler_sends_the_burst_as_the_strategy_does(monkeypatch):
    """measure._collective's burst: one async broadcast per rank as root (rank r's chunk from
    src=r, each of the size asked), every one issued before any is waited for, as
    ``ShardedUpdate.step``; and the report it feeds has the kind the cost model reads."""
    import torch

    from elastic.worker import measure

    log: list[tuple[str, int, int]] = []

    def broadcast(t, src, async_op=False, group=None):
        log.append(("issue", src, t.numel()))
        return SimpleNamespace(wait=lambda: log.append(("wait", src, t.numel())))

    monkeypatch.setattr(measure.dist, "broadcast", broadcast)
    measure._collective("broadcast_burst", 4096, 3, 1, torch.device("cpu"))()
    assert log == [("issue", r, 1024) for r in range(3)] + [("wait", r, 1024) for r in range(3)]
    assert set(measure._KINDS) <= set(KINDS) and BURST in measure._KINDS


def test_overlap_hides_the_gradients_messages_not_the_burst_after_the_update():
    """``overlap`` is the part of backward that hides the gradients' messages (DDP's buckets
    go from the hooks). zero1's and zero2's broadcasts go after the owners' optimizer steps,
    when no backward is left to hide them: with every message hidden (overlap 1 and a long
    backward), dp exposes none of its messages and zero1 still its whole burst and the
    burst's wait."""
    cluster, ids = _live()
    prof = _many_tensors()
    base = replace(_model(ids, (1e-3, 1e-9), 2e-3), seconds_per_sample={i: 1e-2 for i in ids})
    hidden = replace(base, overlap=1.0)
    devs = [cluster.device(i) for i in ids]
    path = cluster.path(devs)
    for mode in ("dp", "zero1", "zero2"):
        p = Plan(strategy=mode, world_size=2, shares=(32, 32), devices=tuple(ids))
        e0, e1 = base.estimate(p, cluster, prof), hidden.estimate(p, cluster, prof)
        burst = [m for m in layout_messages(mode, 2, [t * prof.grad_bytes for t in
                                                      prof.tensors(range(prof.n_blocks))],
                                            comm=base.comm) if m.kind == BURST]
        after = sum(m.count * collective_time(BURST, m.nbytes, 2, *base.alpha_beta(path, BURST))
                    for m in burst) + (2e-3 if burst else 0.0)
        assert e0.comm > after  # the gradients' messages are there to hide
        assert e1.comm == pytest.approx(after), mode
        assert (after > 0) == (mode != "dp")
