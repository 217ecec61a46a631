"""Which order should srpt rank jobs by? Least remaining work (worker-seconds at the job's
smallest size: A-SRPT's single-machine instance; the policy's ``key`` since 2026-12-02)
against the remaining time at the size the job asked for (before), in the simulator over
random traces like bench/scheduler.py's live one.

For each setting (8 or 16 jobs on 4 workers, load 0.7/1.0/1.5, warm or cold starts) it runs
``--seeds`` traces (``random_trace``, seeds from ``--first-seed``: 5000 by default, apart
from the 1000-1199 that bench/scheduler.py prints) and prints each order's mean JCT against
FIFO-static, the mean and the spread of the difference, and how often one order is more
than 5 points better. A study, not a test; from the repository root:
``python bench/srpt_order.py``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.scheduler import RESIZE_S, START_S, random_trace, sim_jobs  # noqa: E402
from clusters.sched_policy import (  # noqa: E402
    FifoStatic,
    JobState,
    ShortestRemaining,
    StarvationGuard,
)
from clusters.sched_sim import SchedSimConfig, simulate_schedule  # noqa: E402


@dataclass(frozen=True)
class ByTimeAsked(ShortestRemaining):
    """srpt as it ranked before: remaining time at the size asked for."""

    name: str = "srpt-by-time"

    def key(self, j: JobState, now_s: float) -> tuple[int, float, float]:
        if self.starvation.starving(j, now_s):
            return (0, j.submitted_s, 0.0)
        ref = j.requested_size()
        return (1, j.remaining_s(ref) if ref is not None else math.inf, j.submitted_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--first-seed", type=int, default=5000)
    ap.add_argument("--ms-per-sample", type=float, default=10.0)
    ap.add_argument("--resize-s", type=float, default=5.0, help="the policies' hysteresis")
    a = ap.parse_args(argv)
    guard = StarvationGuard(120.0)
    work = ShortestRemaining(resize_s=a.resize_s, starvation=guard)
    old = ByTimeAsked(resize_s=a.resize_s, starvation=guard)
    print(f"{'start':<6}{'jobs':>5}{'load':>6}{'by work':>9}{'by time':>9}{'diff':>8}"
          f"{'p10':>7}{'p90':>7}{'work >5 better':>16}{'>5 worse':>10}")
    for warm in (True, False):
        cfg = SchedSimConfig(round_s=0.5, start_s=START_S[warm], resize_s=RESIZE_S[warm])
        for n in (8, 16):
            for load in (0.7, 1.0, 1.5):
                rw, ro, d = [], [], []
                for seed in range(a.first_seed, a.first_seed + a.seeds):
                    jobs, opts = sim_jobs(random_trace(n, seed, 4, a.ms_per_sample, load),
                                           a.ms_per_sample)
                    base = simulate_schedule(jobs, 4, FifoStatic(), opts, cfg).mean_jct_s
                    w = simulate_schedule(jobs, 4, work, opts, cfg).mean_jct_s / base - 1
                    o = simulate_schedule(jobs, 4, old, opts, cfg).mean_jct_s / base - 1
                    rw.append(w)
                    ro.append(o)
                    d.append(w - o)
                d.sort()
                k = len(d)
                print(f"{'warm' if warm else 'cold':<6}{n:>5}{load:>6.1f}"
                      f"{statistics.mean(rw):>+9.1%}{statistics.mean(ro):>+9.1%}"
                      f"{statistics.mean(d) * 100:>+7.1f}p{d[k // 10] * 100:>+6.1f}p"
                      f"{d[(9 * k) // 10] * 100:>+6.1f}p{sum(x < -0.05 for x in d) / k:>16.0%}"
                      f"{sum(x > 0.05 for x in d) / k:>10.0%}")


if __name__ == "__main__":
    main()
