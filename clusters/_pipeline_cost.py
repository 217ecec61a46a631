"""Pipeline (and pipeline x data-parallel hybrid) part of the cost model. Private to cost.py.

Virtual stage k (of pp * v) runs on stage position k % pp. Per replica r with micro-batch
b = shares[r] / m, position j takes t_j = sum over its chunks of b x seconds-per-sample of the
chunk's blocks, plus the point-to-point sends of the chunk's boundary activation (forward)
and its gradient (backward). Replica time m max_j t_j + (sum_j t_j - max_j t_j) / v, which is
(m + p - 1) t for equal stages and v = 1. Replicas run in parallel; the step waits for the
slowest, then for the data-parallel sync of each position's parameters (positions in
parallel; contention between them on shared NICs is not modelled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cost import (
    Estimate,
    MemoryBreakdown,
    bubble_fraction,
    collective_time,
    model_state_bytes,
    stage_blocks,
)

if TYPE_CHECKING:
    from .cost import CostModel
    from .plan import Plan
    from .profile import ModelProfile
    from .topology import Cluster, Device, Path

__all__: list[str] = []


def _in_flight(schedule: str, m: int, p: int, v: int, j: int) -> float:
    """Micro-batches (in units of a whole position's activations) stage position j holds."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - j))
    # Interleaved 1F1B (Narayanan et al. 2021, Megatron's warm-up count), in chunks of 1/v.
    return min(m * v, 2 * (p - j - 1) + (v - 1) * p + 1) / v


def estimate_pipeline(
    model: CostModel, plan: Plan, cluster: Cluster, profile: ModelProfile, devs: list[Device]
) -> Estimate:
    p, dp, m, v = plan.pp_degree, plan.dp_degree, plan.micro_batches, plan.virtual_stages
    stages = stage_blocks(plan)
    n_st = len(stages)
    chunks = [[k for k in range(n_st) if k % p == j] for j in range(p)]

    def dev(j: int, r: int) -> Device:
        return devs[j * dp + r]  # plan.rank(j, r), inlined: this runs for every rank

    path_memo: dict[tuple[str, str], Path] = {}

    def p2p(a: Device, b: Device) -> Path:
        key = (a.node, b.node)
        if key not in path_memo:
            path_memo[key] = cluster.p2p_path(a, b)
        return path_memo[key]

    # Memo keyed by what decides the numbers, so 1000s of identical replicas cost one.
    st_memo: dict[tuple[object, int], float] = {}
    rep_memo: dict[tuple[object, ...], float] = {}
    replica_times = []
    for r in range(dp):
        b = plan.shares[r] // m
        row = [dev(j, r) for j in range(p)]
        keys = tuple(model.device_key(d, profile) for d in row)
        paths = tuple(p2p(row[k % p], row[(k + 1) % p]) for k in range(n_st - 1))
        sig = (b, keys, paths)
        if sig not in rep_memo:
            t = []
            for j in range(p):
                tj = 0.0
                for k in chunks[j]:
                    if (keys[j], k) not in st_memo:
                        st_memo[keys[j], k] = model.sample_time(row[j], profile, stages[k])
                    tj += b * st_memo[keys[j], k]
                    tj += len(stages[k]) * model.pass_overhead_s * row[j].slowdown
                    if k < n_st - 1:
                        a, beta = model.alpha_beta(paths[k])
                        nbytes = b * profile.boundary(stages[k][-1])
                        tj += 2 * collective_time("p2p", nbytes, 2, a, beta)
                t.append(tj)
            tmax = max(t)
            rep_memo[sig] = m * tmax + (sum(t) - tmax) / v
        replica_times.append(rep_memo[sig])
    compute = max(replica_times)

    pos_params = [
        sum(profile.block_params[i] for k in chunks[j] for i in stages[k]) for j in range(p)
    ]
    pos_big = [max(profile.block_params[i] for k in chunks[j] for i in stages[k]) for j in range(p)]
    comm, link = 0.0, "-"
    if dp > 1:
        for j in range(p):
            group = [dev(j, r) for r in range(dp)]
            # zero2/zero3 reduce-scatter (zero3 also gathers) once per micro-batch.
            units = sum(len(stages[k]) for k in chunks[j])  # zero3: one FSDP unit per block
            t_sync, name = model.sync_time(plan.dp_mode, pos_params[j], group, cluster, profile, m,
                                           units=units)
            if t_sync >= comm:
                comm, link = t_sync, name
    exposed = max(0.0, comm - model.overlap * (2 / 3) * compute)

    mem: list[MemoryBreakdown] = []
    opt = 0.0
    stored = [sum(profile.stored(i) for k in chunks[j] for i in stages[k]) for j in range(p)]
    states = [
        model_state_bytes(
            plan.dp_mode,
            pos_params[j],
            dp,
            bytes_per_param=profile.bytes_per_param,
            grad_bytes=profile.grad_bytes,
            optimizer_bytes=profile.optimizer_bytes_per_param,
        )
        for j in range(p)
    ]
    opt_memo: dict[tuple[object, int], float] = {}
    mem_memo: dict[tuple[int, int], MemoryBreakdown] = {}
    for rank in range(plan.world_size):
        j, r = divmod(rank, dp)
        if (j, plan.shares[r]) not in mem_memo:
            act = _in_flight(plan.schedule, m, p, v, j) * (plan.shares[r] // m) * stored[j]
            big = pos_big[j]
            buf = {
                "zero2": big * profile.grad_bytes,
                "zero3": 2 * big * profile.bytes_per_param + big * profile.grad_bytes,
            }
            sj = states[j]
            mem_memo[j, plan.shares[r]] = MemoryBreakdown(
                sj.params, sj.grads, sj.optimizer, act, buf.get(plan.dp_mode, 0.0)
            )
        mem.append(mem_memo[j, plan.shares[r]])
        okey = ((devs[rank].type.name, devs[rank].slowdown), j)
        if okey not in opt_memo:
            local = pos_params[j] if plan.dp_mode == "dp" else pos_params[j] / dp
            opt_memo[okey] = model.optimizer_time(devs[rank], local, profile)
        opt = max(opt, opt_memo[okey])

    step = compute + exposed + opt + model.step_overhead
    return Estimate(
        step, compute, exposed, opt, bubble_fraction(p, m, plan.schedule, v), tuple(mem), link
    )
