"""The simulator's inputs and outputs: ``SimConfig`` (the job and its environment) and
``PolicyResult`` (where one policy's time went), with the table that prints results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import SimulationError

__all__ = ["SimConfig", "PolicyResult", "format_sim_table"]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Job and environment. Mappings by pool name take ``"*"`` for every pool.

    ``node_mtbf_s``: mean time between failures of one node (for generated traces); the
    default, ~260 days per 8-GPU node, is the order of magnitude of published large runs
    (Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs; ``trace.llama3_trace``).
    ``repair_s``: a lost node is back (repaired) this long after it failed;
    ``process_restart_s``: a crashed or hung worker process is running again this long after.
    ``spare_nodes``: idle nodes per pool that take a lost node's place ``spare_start_s`` after
    the failure (a repaired node becomes a spare again); without a free spare the place waits
    for the next repaired node of its pool.
    Checkpoints: every ``checkpoint_every`` steps, training blocked ``checkpoint_stall_s``,
    committed once uploaded (``upload_s``, default state bytes / ``storage_bandwidth``).
    Restores: ``restore_s`` from storage (default state bytes / ``storage_bandwidth``),
    ``peer_restore_s`` from live peers (default one node's share of the state over its NICs).
    Preemptions (generated traces; ``trace.preemption_trace``): ``preemption_per_h``,
    preemptions per node-hour by pool (spot pools; none by default), each announced
    ``notice_s`` before (by pool; AWS gives 120 s, GCP and Azure 30 s; 0: unannounced); a
    preempted node's capacity is back ``preemption_return_s`` after its loss.
    ``target_steps``: stop once the job has kept that many steps (time to a fixed amount of
    training; ``duration_s`` is then the longest it may take), None: run ``duration_s``.
    Raises ``SimulationError`` for a value that cannot be simulated.
    """

    duration_s: float = 7 * 86400.0
    checkpoint_every: int = 500
    checkpoint_stall_s: float = 0.0
    upload_s: float | None = None
    restore_s: float | None = None
    peer_restore_s: float | None = None
    storage_bandwidth: float = 5e9  # bytes/s, all workers together, object storage
    repair_s: float = 3600.0
    process_restart_s: float = 60.0
    spare_nodes: Mapping[str, int] = field(default_factory=dict)
    spare_start_s: float = 300.0
    node_mtbf_s: Mapping[str, float] = field(default_factory=lambda: {"*": 260 * 86400.0})
    preemption_per_h: Mapping[str, float] = field(default_factory=dict)
    notice_s: Mapping[str, float] = field(default_factory=lambda: {"*": 120.0})
    preemption_return_s: float = 1800.0
    target_steps: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> SimulationError:
            return SimulationError(f"SimConfig.{name} must be {want}, got "
                                   f"{getattr(self, name)!r}. Fix: pass a value that is.")

        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise bad("duration_s", "a finite number of seconds > 0")
        if isinstance(self.checkpoint_every, bool) or not isinstance(
                self.checkpoint_every, int) or self.checkpoint_every < 1:
            raise bad("checkpoint_every", "an integer >= 1 (steps)")
        for name in ("checkpoint_stall_s", "repair_s", "process_restart_s", "spare_start_s",
                     "preemption_return_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise bad(name, "a finite number of seconds >= 0")
        for name in ("upload_s", "restore_s", "peer_restore_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise bad(name, "None or a finite number of seconds >= 0")
        if not self.storage_bandwidth > 0:
            raise bad("storage_bandwidth", "> 0 (bytes/s)")
        if any(not isinstance(n, int) or n < 0 for n in self.spare_nodes.values()):
            raise bad("spare_nodes", "a mapping of pool name to an integer >= 0")
        for name in ("preemption_per_h", "notice_s"):
            if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)
                   for v in getattr(self, name).values()):
                raise bad(name, "a mapping of pool name to a finite number >= 0")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0
               for v in self.node_mtbf_s.values()):  # (NaN fails v >= 0 too)
            raise bad("node_mtbf_s", "a mapping of pool name to seconds >= 0 (0 or math.inf: "
                      "never fails)")
        if self.target_steps is not None and (isinstance(self.target_steps, bool) or not
                                              isinstance(self.target_steps, int)
                                              or self.target_steps < 1):
            raise bad("target_steps", "None or an integer >= 1 (steps)")

    def check_pools(self, pools: Sequence[str]) -> None:
        """Every pool-keyed setting names a pool of the cluster (or ``"*"``). Raises
        ``SimulationError`` naming the key and the pools (was: a typo such as ``"A"`` for pool
        ``a`` silently meant no failures, no spares)."""
        for name in ("spare_nodes", "node_mtbf_s", "preemption_per_h", "notice_s"):
            for key in getattr(self, name):
                if key != "*" and key not in pools:
                    raise SimulationError(
                        f"SimConfig.{name} names pool {key!r}, which the cluster does not "
                        f"have. Fix: use one of {', '.join(map(repr, pools))} or '*'")

    def spares(self, pool: str) -> int:
        """Spare nodes of ``pool`` (its own entry, else ``"*"``, else 0)."""
        return self.spare_nodes.get(pool, self.spare_nodes.get("*", 0))


@dataclass(frozen=True)
class PolicyResult:
    """Outcome of one policy. Times in seconds; ``goodput`` in [0, 1].

    ``rollbacks``: restores that took the state back to a checkpoint (or to step 0);
    ``lost_steps``: steps computed and then lost (rollbacks, the steps since the buddies'
    copy a restore from them runs again, and the step in flight at an in-place failure). ``ended``: why the job stopped early (its failure budget), else ``""``.
    ``failures`` counts every loss the job recovered from, preemptions included;
    ``preemptions``: preempted nodes of the job (announced or not, evacuated or not);
    ``evacuations``: those whose state moved onto the survivors before their deadline (not
    failures: nothing was lost).
    ``cost_usd``: what the nodes held cost (every node up, used or idle, spares included, at
    its pool's price per device-hour; nothing once the job has ended), None when a pool has no
    price. ``reached_target``: with ``SimConfig.target_steps``, whether the job got there
    (``duration_s`` is then the time it took); None without a target.
    """

    policy: str
    duration_s: float
    steps: float
    ideal_steps: float
    failures: int
    rollbacks: int
    lost_steps: float
    downtime_s: float
    recompute_s: float
    degraded_s: float
    checkpoint_s: float
    ended: str = ""
    preemptions: int = 0
    evacuations: int = 0
    cost_usd: float | None = None
    reached_target: bool | None = None

    @property
    def goodput(self) -> float:
        return self.steps / self.ideal_steps if self.ideal_steps else 0.0

    @property
    def cost_per_1k_steps(self) -> float | None:
        """US dollars per 1,000 kept steps (``math.inf`` with none kept; None without prices)."""
        if self.cost_usd is None:
            return None
        return self.cost_usd / self.steps * 1000.0 if self.steps > 0 else math.inf

    @property
    def time_lost_s(self) -> float:
        """Wall time not turned into kept full-speed steps."""
        return self.downtime_s + self.recompute_s + self.degraded_s + self.checkpoint_s


def format_sim_table(results: Sequence[PolicyResult]) -> str:
    """One row per policy: goodput, steps, failures, and where the time went (hours); with
    preemptions, the evacuations; with prices, the cost and the cost per 1,000 steps."""
    w = max([14] + [len(r.policy) + 2 for r in results])
    evac = any(r.preemptions or r.evacuations for r in results)
    cost = any(r.cost_usd is not None for r in results)
    hdr = (
        f"{'policy':<{w}}{'goodput':>8}{'steps':>11}{'failures':>9}{'rollbacks':>10}"
        f"{'lost steps':>11}{'down h':>8}{'redo h':>8}{'slow h':>8}{'ckpt h':>8}"
        + (f"{'preempt':>8}{'evac':>6}" if evac else "")
        + (f" {'cost $':>13} {'$/1k steps':>12}" if cost else "")
    )
    rows = [hdr, "-" * len(hdr)]
    for r in results:
        per_k = r.cost_per_1k_steps
        rows.append(
            f"{r.policy:<{w}}{r.goodput:>8.1%}{r.steps:>11.0f}{r.failures:>9}"
            f"{r.rollbacks:>10}{r.lost_steps:>11.0f}{r.downtime_s / 3600:>8.2f}"
            f"{r.recompute_s / 3600:>8.2f}{r.degraded_s / 3600:>8.2f}"
            f"{r.checkpoint_s / 3600:>8.2f}"
            + (f"{r.preemptions:>8}{r.evacuations:>6}" if evac else "")
            + ((f" {r.cost_usd:>13,.0f} {per_k:>12,.2f}" if r.cost_usd is not None and per_k
                is not None else f" {'-':>13} {'-':>12}") if cost else "")
        )
        if r.ended:
            rows.append(f"  {r.policy} stopped early: {r.ended}")
    return "\n".join(rows)
