"""clusters.sched_policy: the scheduling policies' decision tables (pure: no Ray, no clock),
and the simulator that runs the same classes over a synthetic 1,000-GPU trace."""

from __future__ import annotations

import math
import random
import time

import pytest

from clusters.job_speed import job_options
from clusters.job_trace import job_trace
from clusters.profile import ModelProfile
from clusters.sched_policy import (
    POLICIES,
    FifoStatic,
    Goodput,
    JobState,
    Observation,
    Option,
    ShortestRemaining,
    StarvationGuard,
    policy_named,
    statistical_efficiency,
)
from clusters.sched_sim import (
    SchedSimConfig,
    format_sched_table,
    simulate_schedule,
    trace_options,
)


def linear(sizes=range(1, 7), step1: float = 1.0, overhead: float = 0.0,
           layout: str = "dp") -> tuple[Option, ...]:
    """Options of a job that scales linearly (plus a fixed overhead per step)."""
    return tuple(Option(n, layout, step1 / n + overhead) for n in sizes)


def job(name: str, steps: float, *, at: float = 0.0, options=None, lo: int = 1, hi: int = 6,
        req: int = 1, workers: int = 0, layout: str | None = None, **kw) -> JobState:
    return JobState(name, at, steps, options if options is not None else linear(), lo, hi, req,
                    workers, layout if layout is not None or not workers else "dp", **kw)


def sizes(decision) -> dict[str, int]:
    return {a.job: a.workers for a in decision.allocations}


# ------------------------------------------------------------------ fifo-static


def test_fifo_admits_in_order_at_the_size_asked_and_blocks_the_line():
    obs = Observation(10.0, 6, (job("a", 100, req=4), job("b", 10, req=4, at=1),
                                job("c", 10, req=1, at=2)))
    d = FifoStatic().decide(obs)
    assert sizes(d) == {"a": 4, "b": 0, "c": 0}  # c fits but waits behind b
    assert "asked for" in d.of("a").reason and "2 in line" in d.of("c").reason
    assert d.of("a").remaining_s == pytest.approx(100 * 0.25)
    assert sizes(FifoStatic(backfill=True).decide(obs)) == {"a": 4, "b": 0, "c": 1}


def test_fifo_never_resizes_a_running_job():
    obs = Observation(0.0, 6, (job("a", 100, req=2, workers=2), job("b", 1, req=1, at=5)))
    assert sizes(FifoStatic().decide(obs)) == {"a": 2, "b": 1}  # 3 workers stay idle


def test_fifo_takes_the_next_size_that_fits_memory():
    opts = linear(sizes=(2, 4))  # one worker cannot hold the model
    d = FifoStatic().decide(Observation(0.0, 6, (job("big", 10, options=opts, req=1),)))
    assert sizes(d) == {"big": 2}


def test_fifo_takes_a_request_beyond_the_capacity_within_it():
    """A job asking for 8 workers (min 2, max 8) on 4 runs at 4, and the job behind it runs
    when it ends; in the simulator too. Was: 8 never free, it was never admitted and (no
    backfill) blocked the line: nothing ever started on an empty cluster."""
    from clusters.job_trace import TraceJob

    opts = linear(sizes=range(1, 9))
    big = job("big", 100, options=opts, lo=2, hi=8, req=8)
    d = FifoStatic().decide(Observation(0.0, 4, (big, job("next", 10, at=1))))
    assert sizes(d) == {"big": 4, "next": 0} and "asked for" in d.of("big").reason
    never = job("never", 10, options=linear(sizes=(8,)), lo=8, hi=8, req=8)
    d = FifoStatic().decide(Observation(0.0, 4, (never, job("next", 10, at=1))))
    assert sizes(d) == {"never": 0, "next": 1}  # a job that can never fit blocks nobody
    assert "passes the capacity 4" in d.of("never").reason
    trace = [TraceJob("big", 0.0, 8, 2, 8, 400.0, "m"), TraceJob("next", 1.0, 1, 1, 1, 100.0, "m")]
    r = simulate_schedule(trace, 4, FifoStatic(), lambda j: opts,
                          SchedSimConfig(round_s=60.0, start_s=0.0))
    assert r.unfinished == 0, r


def test_the_simulator_waits_for_no_job_whose_sizes_all_pass_the_capacity():
    """Options at 1 and 8 workers, min_workers 2, on 4: no size the job may run at fits, so
    the simulator holds no round for it (the policies' sizes decide, as for the others).
    Was: an option up to the capacity (1, below its min) made it placeable: a round every
    60 s while the other job ran."""
    from clusters.job_trace import TraceJob

    def options(j):
        return (Option(1, "dp", 8.0), Option(8, "dp", 1.0)) if j.name == "B" else linear(
            sizes=range(1, 5))

    trace = [TraceJob("A", 0.0, 4, 4, 4, 6000.0, "m"), TraceJob("B", 5.0, 8, 2, 8, 100.0, "m")]
    r = simulate_schedule(trace, 4, policy_named("srpt"), options,
                          SchedSimConfig(round_s=60.0, start_s=0.0))
    assert r.unfinished == 1 and r.decisions < 10, r.decisions


# ------------------------------------------------------------------ shortest remaining


def test_srpt_gives_the_shortest_job_what_it_uses_well():
    obs = Observation(0.0, 6, (job("long", 1000, req=2), job("short", 10, req=2, at=1)))
    d = ShortestRemaining(resize_s=0).decide(obs)
    # linear scaling: the short job takes every worker (finishing it first is what lowers
    # the mean completion time); the long one waits for them
    assert sizes(d) == {"short": 6, "long": 0}
    assert d.of("long").reason.startswith("queued: #2 by remaining work")
    assert d.of("short").reason.startswith("#1 by remaining work")
    assert d.allocations[0].job == "long"  # the observation's order


def test_srpt_preempts_by_shrinking_never_by_stopping():
    running = job("long", 1000, req=6, lo=2, workers=6)
    obs = Observation(100.0, 6, (running, job("short", 20, req=4, at=90)))
    d = ShortestRemaining(resize_s=1.0).decide(obs)
    assert sizes(d) == {"long": 2, "short": 4}
    assert "shrunk 6->2" in d.of("long").reason
    # with a floor of 6 it cannot shrink: the short job waits instead
    pinned = job("long", 1000, req=6, lo=6, workers=6)
    d = ShortestRemaining().decide(Observation(100.0, 6, (pinned, job("short", 20, at=90))))
    assert sizes(d) == {"long": 6, "short": 0}
    assert "queued" in d.of("short").reason


def test_srpt_grows_a_job_when_another_ends():
    obs = Observation(0.0, 6, (job("a", 1000, req=2, workers=2),))
    d = ShortestRemaining(resize_s=5.0).decide(obs)
    assert sizes(d) == {"a": 6} and "grown 2->6" in d.of("a").reason


def test_srpt_keeps_a_size_when_a_resize_is_not_worth_its_pause():
    # 30 steps at 0.5 s on 2 workers = 15 s; on 6, 5 s: saves 10 s < a 30 s resize
    obs = Observation(0.0, 6, (job("a", 30, req=2, workers=2),))
    d = ShortestRemaining(resize_s=30.0).decide(obs)
    assert sizes(d) == {"a": 2} and "keeps" in d.of("a").reason


def test_srpt_stops_growing_where_workers_stop_paying():
    flat = (Option(1, "dp", 1.0), Option(2, "dp", 0.55), Option(3, "dp", 0.5),
            Option(4, "dp", 0.48))  # 2 is nearly 2x; beyond, almost nothing
    d = ShortestRemaining(resize_s=0).decide(Observation(0.0, 4, (job("a", 100, options=flat),)))
    assert sizes(d)["a"] == 2


def test_srpt_keeps_min_and_max_workers_and_memory():
    opts = linear(sizes=(2, 3, 4, 6))  # 1 and 5 do not fit memory
    obs = Observation(0.0, 8, (job("a", 100, options=opts, lo=1, hi=4),))
    d = ShortestRemaining(resize_s=0).decide(obs)
    assert sizes(d) == {"a": 4}
    obs = Observation(0.0, 1, (job("a", 100, options=opts),))
    d = ShortestRemaining().decide(obs)
    assert sizes(d) == {"a": 0} and "needs 2 workers" in d.of("a").reason
    none = job("x", 10, options=linear(sizes=(8,)), hi=6)
    d = ShortestRemaining().decide(Observation(0.0, 8, (none,)))
    assert sizes(d) == {"x": 0} and d.of("x").reason.startswith("cannot run")


def test_starvation_guard_puts_a_long_waiting_job_first():
    long_job = job("long", 10_000, lo=4, req=4, at=0.0)
    short = job("short", 10, lo=4, req=4, at=500.0, workers=4)
    guard = ShortestRemaining(starvation=StarvationGuard(max_wait_s=600.0), resize_s=0)
    early = guard.decide(Observation(550.0, 4, (long_job, short)))
    assert sizes(early) == {"long": 0, "short": 4}  # a running job is never stopped
    both = (long_job, job("short", 10, lo=2, req=2, at=500.0, workers=4))
    late = guard.decide(Observation(700.0, 6, both))
    assert sizes(late)["long"] == 4 and late.of("long").reason.startswith("starving")
    never = ShortestRemaining(starvation=StarvationGuard(None), resize_s=0)
    assert sizes(never.decide(Observation(700.0, 6, both)))["long"] == 0


@pytest.mark.parametrize("pol", [ShortestRemaining(resize_s=0), Goodput(resize_s=0)],
                         ids=["srpt", "goodput"])
def test_a_starving_job_that_does_not_fit_holds_the_workers_it_waits_for(pol):
    """``wide`` (4 workers, queued since 0) starves at 2000 s; ``a`` (running at 2, its
    smallest 1) leaves it at most 3: nothing else is admitted and ``a`` does not grow, so
    the workers free up for ``wide`` as jobs end. Was: ``b`` took a free worker and ``a``
    grew into the rest."""
    wide = job("wide", 600, lo=4, hi=4, req=4, at=0.0)
    a = job("a", 10_000, lo=1, hi=4, workers=2, at=100.0)
    b = job("b", 10, lo=1, hi=1, at=1500.0)
    d = pol.decide(Observation(2000.0, 4, (wide, a, b)))
    assert sizes(d) == {"wide": 0, "a": 2, "b": 0}
    assert "held for it" in d.of("wide").reason
    assert "held for starving wide" in d.of("b").reason
    free = type(pol)(resize_s=0, starvation=StarvationGuard(None))
    d = free.decide(Observation(2000.0, 4, (wide, a, b)))
    assert d.of("b").workers == 1 and d.of("a").workers == 3  # no guard: no hold


@pytest.mark.parametrize("pol", [ShortestRemaining(), Goodput()], ids=["srpt", "goodput"])
def test_a_starving_wide_job_starts_beside_a_stream_of_narrow_ones(pol):
    """4 workers; ``wide`` needs all 4 for 600 s, arriving at 0 with a stream of 60
    one-worker 400 s jobs, one every 100 s: once its 1800 s guard runs out the running jobs
    drain into it (at most one job's 400 s and a round). Was: 7020 s, when the stream
    stopped."""
    from clusters.job_trace import TraceJob

    opts = linear(sizes=range(1, 5), step1=4.0)
    trace = [TraceJob(f"s{i}", 100.0 * i, 1, 1, 1, 400.0, "m") for i in range(60)]
    trace.append(TraceJob("wide", 0.0, 4, 4, 4, 600.0, "m"))  # (after s0: not admitted first)
    r = simulate_schedule(trace, 4, pol, lambda j: opts,
                          SchedSimConfig(round_s=60.0, start_s=0.0, resize_s=0.0))
    wide = next(j for j in r.jobs if j.name == "wide")
    assert wide.start_s <= 1800 + 400 + 60, wide
    assert r.unfinished == 0


def test_layouts_within_the_cost_models_error_do_not_switch():
    opts = (Option(2, "dp", 0.500), Option(2, "zero2", 0.495), Option(4, "zero3", 0.2),
            Option(4, "dp", 0.3))
    j = job("a", 100, options=opts, lo=2, hi=2, workers=2, layout="dp")
    assert ShortestRemaining().decide(Observation(0.0, 2, (j,))).of("a").layout == "dp"
    k = job("b", 100, options=opts, lo=4, hi=4)
    assert ShortestRemaining().decide(Observation(0.0, 4, (k,))).of("b").layout == "zero3"


# ------------------------------------------------------------------ goodput


def test_goodput_admits_in_arrival_order_then_feeds_the_best_scaler():
    scales = linear(sizes=range(1, 7))
    poor = (Option(1, "dp", 1.0), Option(2, "dp", 0.9), Option(3, "dp", 0.85),
            Option(4, "dp", 0.8))
    obs = Observation(0.0, 6, (job("poor", 10, options=poor), job("good", 1000, options=scales,
                                                                   at=1)))
    d = Goodput(resize_s=0).decide(obs)
    assert sizes(d) == {"poor": 1, "good": 5}
    assert "speedup 5.00x" in d.of("good").reason


def test_goodput_is_throughput_with_a_fixed_batch_and_discounted_when_it_grows():
    fixed = job("f", 100, batch=64)
    assert fixed.goodput(4) == pytest.approx(64 / 0.25)
    grows = job("g", 100, batch=64, adaptive_batch=True, batch_per_worker=32, noise_scale=64.0)
    assert grows.batch_at(4) == 128
    assert grows.goodput(4) == pytest.approx(128 / 0.25 * (64 + 64) / (64 + 128))
    assert statistical_efficiency(64, 64, 100.0) == 1.0
    assert statistical_efficiency(256, 64, None) == 1.0
    assert statistical_efficiency(256, 64, 0.0) == pytest.approx(0.25)


def test_goodput_min_gain_leaves_workers_idle_rather_than_waste_them():
    flat = (Option(1, "dp", 1.0), Option(2, "dp", 0.99))
    d = Goodput(min_gain=0.05, resize_s=0).decide(
        Observation(0.0, 4, (job("a", 10, options=flat, hi=2),)))
    assert sizes(d) == {"a": 1}


# ------------------------------------------------------------------ every policy


@pytest.mark.parametrize("name", POLICIES)
def test_every_decision_keeps_the_rules(name):
    rng = random.Random(3)
    pol = policy_named(name, resize_s=2.0, max_wait_s=50.0)
    for _ in range(300):
        jobs = []
        for i in range(rng.randint(1, 8)):
            lo = rng.randint(1, 3)
            hi = rng.randint(lo, 6)
            fits = tuple(n for n in range(1, 7) if rng.random() < 0.8)
            opts = linear(sizes=fits, step1=rng.uniform(0.1, 2), overhead=rng.uniform(0, 0.3))
            ok = [n for n in fits if lo <= n <= hi]
            running = bool(ok) and rng.random() < 0.4
            jobs.append(job(f"j{i}", rng.uniform(1, 500), at=rng.uniform(0, 100), options=opts,
                            lo=lo, hi=hi, req=rng.randint(1, 6),
                            workers=rng.choice(ok) if running else 0))
        cap = max(sum(j.workers for j in jobs), rng.randint(1, 12))
        d = pol.decide(Observation(rng.uniform(100, 200), cap, tuple(jobs)))
        assert [a.job for a in d.allocations] == [j.job for j in jobs]
        assert d.used <= cap
        for j, a in zip(jobs, d.allocations, strict=True):
            assert a.reason
            if a.workers:
                assert j.min_workers <= a.workers <= j.max_workers
                assert a.workers in j.sizes and a.layout is not None
                assert math.isfinite(a.remaining_s)
            else:
                assert not j.running, "a running job was stopped"


def test_policy_named_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="fifo-static, srpt, goodput"):
        policy_named("lottery")


# ------------------------------------------------------------------ options and simulator


def test_job_options_come_from_the_cost_model_and_respect_memory():
    tiny = ModelProfile.uniform(n_params=1000, n_blocks=2, flops_per_sample=6e3,
                                bytes_per_param=4, optimizer_bytes_per_param=8,
                                precision="fp32")
    opts = job_options(tiny, 16, "CPU", range(1, 5), network="loopback",
                       measured_s_per_sample=0.005)
    dp = {o.workers: o.step_s for o in opts if o.layout == "dp"}
    assert dp[1] == pytest.approx(16 * 0.005, rel=0.05) and dp[4] < dp[2] < dp[1]
    huge = ModelProfile.uniform(n_params=30e9, n_blocks=8, flops_per_sample=1e12)
    fits = {o.workers for o in job_options(huge, 64, "A100-80GB", (1, 2, 4, 8, 16))}
    assert 1 not in fits and 16 in fits  # 30 B parameters need the state sharded


def test_the_simulator_runs_the_policies_over_a_trace():
    trace = job_trace(duration_s=6 * 3600, capacity=64, load=0.9, seed=2)
    opts = trace_options()
    results = [simulate_schedule(trace, 64, policy_named(n), opts, SchedSimConfig())
               for n in POLICIES]
    fifo, srpt, good = results
    for r in results:
        assert r.unfinished == 0 and len(r.jobs) == len(trace)
        assert 0 < r.utilisation <= 1.0
        assert all(o.end_s >= o.start_s >= o.arrival_s for o in r.jobs)
    assert fifo.resizes == 0 and srpt.resizes > 0
    assert srpt.mean_jct_s < 0.7 * fifo.mean_jct_s and good.mean_jct_s < 0.7 * fifo.mean_jct_s
    table = format_sched_table(results)
    assert "fifo-static" in table and "srpt" in table and "%" in table


def test_a_simulated_week_on_1000_gpus_takes_under_10_seconds():
    trace = job_trace(duration_s=7 * 86400, capacity=1000, load=0.8, seed=1)
    assert len(trace) > 3000
    opts = trace_options()
    for j in trace:
        opts(j)  # the planner's tables, once per model (not the policy's time)
    for name in ("srpt", "goodput"):
        t0 = time.process_time()
        r = simulate_schedule(trace, 1000, policy_named(name), opts, SchedSimConfig())
        cpu = time.process_time() - t0
        assert r.unfinished == 0
        assert cpu < 10.0, f"{name}: {cpu:.1f} s of CPU for a simulated week"


def test_the_simulator_decides_every_round_while_a_job_waits():
    """The live scheduler decides every round; a starvation guard's wait runs out between
    arrivals and ends. Capacity 4, A (1 h at 4 workers) holding all of it, B arriving at
    10 s with a 600 s guard: B starts at the first round after its wait (660 s). Was: the
    simulator decided only at arrivals and ends, so B waited for A's end (3720 s)."""
    from clusters.job_trace import TraceJob
    from clusters.sched_policy import Option, ShortestRemaining, StarvationGuard

    opts = tuple(Option(n, "dp", 4.0 / n) for n in range(1, 5))
    trace = [TraceJob("A", 0.0, 4, 1, 4, 3600.0, "m"), TraceJob("B", 10.0, 4, 1, 4, 7200.0, "m")]
    pol = ShortestRemaining(resize_s=10.0, starvation=StarvationGuard(600.0))
    r = simulate_schedule(trace, 4, pol, lambda j: opts, SchedSimConfig(round_s=60.0))
    b = next(j for j in r.jobs if j.name == "B")
    assert b.start_s <= 10 + 600 + 60, b


def test_the_simulator_runs_a_job_at_the_layout_the_policy_chose():
    """Options (2, dp, 2 s), (4, dp, 1 s), (4, zero3, 2 s): the policy gives 4 workers on
    dp, and the job runs at dp's 1 s a step. Was: at the last option listed for 4 workers
    (zero3's 2 s), whatever the layout chosen."""
    from clusters.job_trace import TraceJob
    from clusters.sched_policy import Option

    opts = (Option(2, "dp", 2.0), Option(4, "dp", 1.0), Option(4, "zero3", 2.0))
    trace = [TraceJob("A", 0.0, 2, 1, 4, 1000.0, "m")]
    r = simulate_schedule(trace, 4, policy_named("srpt"), lambda j: opts,
                          SchedSimConfig(round_s=1.0, start_s=0.0))
    (a,) = r.jobs
    assert a.end_s == pytest.approx(a.start_s + 500.0, abs=2.0), a


@pytest.mark.parametrize("name", ["fifo-static", "srpt", "goodput"])
def test_the_simulator_ends_with_a_job_that_can_never_be_placed(name):
    """A job whose every size passes the capacity is left unfinished, and the simulation
    ends (rounds while a job waits stop once nothing can change)."""
    from clusters.job_trace import TraceJob
    from clusters.sched_policy import Option

    def options(job):
        return ((Option(8, "dp", 1.0),) if job.name == "B" else
                tuple(Option(n, "dp", 4.0 / n) for n in range(1, 5)))

    trace = [TraceJob("A", 0.0, 4, 1, 4, 100.0, "m"), TraceJob("B", 5.0, 8, 8, 8, 100.0, "m")]
    t0 = time.monotonic()
    r = simulate_schedule(trace, 4, policy_named(name), options, SchedSimConfig(round_s=1.0))
    assert time.monotonic() - t0 < 5.0 and r.unfinished == 1
