"""What a worker measures for the planner, repeated so that each figure knows its noise.

``profile_terms`` is collective over the current group (every rank calls it at once, so each
figure is taken while the peers are as busy as they are in a step): forward+backward of the
model at two batch sizes (per sample and per pass) and block by block, the optimizer's step
(every tensor, the tensors ZeRO-1/2 would give this rank, and zero3's DTensor shards), each
collective kind at three sizes both *right after a burst of compute* (a collective that
meets busy peers waits for the slowest; timed between idle workers only, zero3's per-block
gathers were under-predicted by 42 %) and *right after another collective* (a message that
follows one in a chain does not wait again; charged the loaded figure per message, zero1 and
zero2 were over-predicted by up to 3x), plus ZeRO-1/2's update as it is sent (a burst: every
rank broadcasts its chunk, all in flight at once; timed one at a time, its broadcasts were
charged in series), and trial steps of real layouts (``elastic.worker.trial``): dp's with
the step loop's data fetch and control all-reduce, with and without the update; zero3's (its
per-unit gathers meet busy peers: what they wait beyond their messages is measured, not
assumed); zero1's (what its broadcast burst waits); a pipeline's at two micro-batch
counts. Each figure is a list of repeated seconds; ``clusters.measured.terms_model`` reduces
them to medians and spreads and builds the cost model. ``SpanHooks``
(``elastic.worker.spans``) time and slow the compute blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clusters.collectives import BROADCAST_BURST, KINDS
from clusters.measured import more_trial_steps, more_update_steps, robust

from .spans import SpanHooks, median, sync_fn
from .trial import alternating, every_rank_has_room, of_kind, pipeline_trial, rank0_says
from .trial import trial_steps as run_trial

__all__ = ["SpanHooks", "profile_terms", "COLLECTIVE_SIZES"]

COLLECTIVE_SIZES = (4 << 10, 256 << 10, 4 << 20)
_KINDS = KINDS  # every kind the cost model charges (clusters.collectives), each measured


def _interleaved(fns: Sequence[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Each of ``fns`` (returning its own seconds) ``rounds`` times, round-robin, after one
    warm-up call each: slow phases of a shared host hit every figure alike."""
    for f in fns:
        f()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, f in enumerate(fns):
            out[i].append(f())
    return out


def _fwd_bwd(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor,
             autocast: Callable[[], Any], sync: Callable[[], None], slowdown: float,
             backward: bool = True) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        with autocast(), torch.set_grad_enabled(backward):
            loss = loss_fn(model(x), y)
        if backward:
            loss.backward()
        sync()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t0) * slowdown
    return run


def _block_times(blocks: Sequence[nn.Module], x: torch.Tensor, autocast: Callable[[], Any],
                 sync: Callable[[], None], slowdown: float, rounds: int
                 ) -> tuple[list[list[float]], list[float]]:
    """Forward+backward seconds of each block on the activations the previous one hands on,
    and the bytes per sample each hands on."""
    inputs, bounds = [], []
    h = x
    with torch.no_grad(), autocast():
        for b in blocks:
            inputs.append(h)
            h = b(h)
            bounds.append(h.numel() * h.element_size() / max(1, len(x)))

    def one(i: int) -> Callable[[], float]:
        def run() -> float:
            inp = inputs[i].detach().requires_grad_(inputs[i].is_floating_point())
            t0 = time.perf_counter()
            with autocast():
                out = blocks[i](inp)
            out.backward(torch.ones_like(out))
            sync()
            blocks[i].zero_grad(set_to_none=True)
            return (time.perf_counter() - t0) * slowdown
        return run

    return _interleaved([one(i) for i in range(len(blocks))], rounds), bounds


def _optimizer_times(model: nn.Module, factory: Callable[[Any], Any], world: int, rank: int,
                     rounds: int) -> dict[str, Any]:
    """Seconds of the optimizer's step over every tensor, over the ones ZeRO-1/2 give this
    rank, and over zero3's DTensor shards (None where a mesh cannot be built)."""
    from strategies._gather import assign_owners

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    owner = assign_owners([p.numel() for p in params], max(1, world))
    own = [p for p, o in zip(params, owner, strict=True) if o == rank]
    sets = [params] + ([own] if own and world > 1 else [])
    opts = [factory(s) for s in sets]

    def step(opt: Any) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            opt.step()
            return time.perf_counter() - t0
        return run

    times = _interleaved([step(o) for o in opts], rounds)
    out: dict[str, Any] = {"plain": [[len(s), sum(p.numel() for p in s), t]
                                     for s, t in zip(sets, times, strict=True)],
                           "sharded": None}
    if world > 1 and dist.is_initialized():
        try:
            out["sharded"] = _sharded_times(params, factory, rounds)
        except Exception:  # noqa: BLE001 - no mesh here: zero3 is then charged as plain
            out["sharded"] = None
    return out


def _sharded_times(params: Sequence[torch.Tensor], factory: Callable[[Any], Any],
                   rounds: int) -> list[Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dev = params[0].device
    pg = dist.group.WORLD
    assert pg is not None
    mesh = DeviceMesh.from_group(pg, dev.type, mesh=list(range(dist.get_world_size())),
                                 mesh_dim_names=("profile",))
    shards = []
    for p in params:
        d = nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)],
                                           src_data_rank=None))
        d.grad = distribute_tensor(torch.randn_like(p) * 1e-3, mesh, [Shard(0)],
                                   src_data_rank=None)
        shards.append(d)
    opt = factory(shards)

    def run() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    ts = _interleaved([run], rounds)[0]
    local = 0
    for d in shards:
        part: Any = d
        local += int(part.to_local().numel())
    return [len(shards), local, ts]


def _busy(seconds: float) -> Callable[[], None]:
    """A fixed piece of compute of about ``seconds`` (matrix products), standing for the
    work between two collectives of a step."""
    a = torch.randn(128, 128)
    t0 = time.perf_counter()
    reps = 0
    while time.perf_counter() - t0 < seconds and reps < 10_000:
        a @ a
        reps += 1
    reps = max(1, reps)

    def run() -> None:
        for _ in range(reps):
            a @ a
    return run


def _collective(kind: str, nbytes: int, world: int, rank: int, device: torch.device
                ) -> Callable[[], None]:
    n = max(1, nbytes // 4)
    t = torch.zeros(n, device=device)
    big = torch.zeros(n * world, device=device)
    recv = torch.zeros(n, device=device)
    chunks = ([torch.zeros(n, device=device) for _ in range(world)]
              if kind == BROADCAST_BURST else [])

    def run() -> None:
        if kind == BROADCAST_BURST:
            # as ShardedUpdate.step: rank r's chunk from src=r, all issued, then waited for
            works = [dist.broadcast(c, src=r, async_op=True) for r, c in enumerate(chunks)]
            for w in works:
                if w is not None:
                    w.wait()
        elif kind == "all_reduce":
            dist.all_reduce(t)
        elif kind == "reduce":
            dist.reduce(t, dst=0)
        elif kind == "broadcast":
            dist.broadcast(t, src=0)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(big, t)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(t, big)
        else:  # p2p: each rank sends to the next and receives from the previous one
            works = [dist.isend(t, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
            for w in works:
                if w is not None:
                    w.wait()
    return run


def _collective_times(world: int, rank: int, device: torch.device, rounds: int,
                      busy_s: float, sizes: Sequence[int]) -> tuple[dict[str, Any],
                                                                   dict[str, Any]]:
    """Per kind and size, two series: ``loaded``, the seconds of one collective right after
    a burst of compute (the burst's own time, measured alone, taken off): what a message
    that waits on the peers' compute pays; and ``idle``, the seconds of one collective right
    after another one (the ranks already in step): what each further message of a chain
    pays. Their difference is the wait for the slowest peer's compute, which a step pays
    once per point where the ranks meet after computing, not once per message.
    ``broadcast_burst``'s seconds are a whole burst's (``world`` broadcasts of ``nbytes``)."""
    sync = sync_fn(device)
    busy = _busy(busy_s)
    alone = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        busy()
        alone.append(time.perf_counter() - t0)
    base = sorted(alone)[len(alone) // 2]
    loaded: dict[str, Any] = {}
    idle: dict[str, Any] = {}
    for kind in _KINDS:
        rows, rows_idle = [], []
        for nb in sizes:
            op = _collective(kind, nb, world, rank, device)
            dist.barrier()
            op()  # warm-up (buffers, connections)
            ts, ts_idle = [], []
            for _ in range(rounds):
                t0 = time.perf_counter()
                busy()
                op()
                sync()
                t1 = time.perf_counter()
                ts.append(max(0.0, t1 - t0 - base))
                op()  # right after the first: the ranks are in step
                sync()
                ts_idle.append(time.perf_counter() - t1)
            rows.append([nb, ts])
            rows_idle.append([nb, ts_idle])
        loaded[kind] = rows
        idle[kind] = rows_idle
    return loaded, idle


def profile_terms(*, model_factory: Callable[[], nn.Module], loss_fn: Any,
                  optimizer_factory: Callable[[Any], Any], batch: Callable[[int], Any],
                  shares: Sequence[int], rank: int, world: int, device: torch.device,
                  autocast: Callable[[], Any], slowdown: float = 1.0, rounds: int = 7,
                  trial_steps: int = 6, control: Callable[[], Any] | None = None
                  ) -> dict[str, Any]:
    """Collective over the current group: this rank's report for
    ``clusters.measured.terms_model`` (see there for the format).

    ``batch(step)`` returns this rank's (inputs, targets) of ``step`` under ``shares`` (one
    per rank; the step loop's own data path), which the compute figures and the trial dp
    steps use;
    ``control()``: starts the step loop's per-step control all-reduce and returns something
    to ``wait()`` on (waited for after the next step, as the loop does); ``slowdown``: an
    emulated device's factor (its compute figures are scaled by it, and the trial steps run
    under its hooks). Trial steps: ``trial_steps`` of dp; with world > 1, as many of dp
    without the optimizer's update too (each rounded up to even; more while rank 0 finds the
    difference unresolved, ``clusters.measured.more_update_steps``), in alternating blocks;
    then ``trial_steps // 3`` blocks each of zero1 and dp in rotation (blocks of 3, 2
    counted; more while rank 0 finds zero1's median unsettled,
    ``clusters.measured.more_trial_steps``), as many of zero3 and dp (alike), and of a pipeline over every rank at two micro-batch
    counts and dp, its schedule timed apart (``elastic.worker.trial.pipeline_trial``). Every rank must call it with the same
    ``rounds``, ``trial_steps`` and ``shares``."""
    from strategies.blocks import blocks_of

    sync = sync_fn(device)
    phases: dict[str, float] = {}  # this rank's seconds in each part of the profile
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - clock[0]
        clock[0] = now

    share = max(1, int(shares[rank]))
    small = max(1, share // 4)
    torch.manual_seed(0)
    model = model_factory().to(device)
    x, y = batch(0)
    x, y = x.to(device), y.to(device)
    fns = [_fwd_bwd(model, loss_fn, x, y, autocast, sync, slowdown),
           _fwd_bwd(model, loss_fn, x, y, autocast, sync, slowdown, backward=False)]
    if small < share:
        fns.append(_fwd_bwd(model, loss_fn, x[:small], y[:small], autocast, sync, slowdown))
    times = _interleaved(fns, rounds)
    compute = [times[0]] + times[2:]
    lap("compute")
    blocks = blocks_of(model)
    block_secs, bounds = _block_times(blocks, x, autocast, sync, slowdown, rounds)
    lap("blocks")
    report: dict[str, Any] = {
        "rank": rank, "world": world,
        "compute": {"batches": [share, small][:len(compute)], "seconds": compute,
                    "forward": times[1]},
        "blocks": {"batch": share, "seconds": block_secs, "boundary_bytes": bounds,
                   "tensors": [[p.numel() for p in b.parameters()] for b in blocks]},
        "optimizer": _optimizer_times(model, optimizer_factory, world, rank, rounds),
        "phases": phases,
    }
    lap("optimizer")
    if world > 1:
        busy_s = min(0.005, max(0.0005, median(compute[0]) / max(1, len(blocks))))
        report["collectives"], report["collectives_idle"] = _collective_times(
            world, rank, device, rounds, busy_s, COLLECTIVE_SIZES)
        lap("collectives")
    # trial steps: the real strategy and the step loop's data fetch and control all-reduce;
    # dp's set the per-step overhead, zero1's the wait at its burst, zero3's its per-unit
    # wait (FSDP's gathers under load), a pipeline's its schedule's terms
    # dp's replica: parameters, gradients and two optimizer moments
    replica_bytes = 4.0 * sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    run = {"shares": shares, "world": world, "rank": rank, "device": device,
           "model_factory": model_factory, "optimizer_factory": optimizer_factory,
           "loss_fn": loss_fn, "batch": batch, "control": control, "slowdown": slowdown}
    if world > 1:
        # and steps without the optimizer's update: what it costs inside a step, where the
        # state it streams through also evicts what the next forward would find cached
        # (dlrm on 3 CPU ranks: 7.5 ms, against 3.9 ms timed around its step alone). In
        # alternating blocks of 3, so that drift falls on both alike; each block's first
        # step, which follows the other kind, is not counted.
        # More pairs of blocks while the difference is unresolved where it matters
        # (``clusters.measured.more_update_steps``), as rank 0 sees it, for every rank.
        alone = median(report["optimizer"]["plain"][0][2])

        def more(secs: Sequence[float]) -> int:
            return 6 if rank0_says(rank == 0 and more_update_steps(  # another pair of blocks
                of_kind(secs, 2, 0), of_kind(secs, 2, 1), alone), device) else 0

        secs = run_trial([("dp", {})], 6 * max(2, -(-trial_steps // 2)),
                         update_at=alternating, more=more, **run)
        report["trial"] = {"shares": [int(s) for s in shares],
                           "seconds": of_kind(secs, 2, 0)}
        report["trial_no_update"] = {"shares": [int(s) for s in shares],
                                     "seconds": of_kind(secs, 2, 1)}
        lap("trial_dp")
        # zero1's, zero3's and a pipeline's in rotation with dp's: each taken at the dp
        # trial's level (where every device has room for dp's replica beside them; else each
        # alone). zero1's sets the wait at its broadcast burst: from the terms alone, zero1's
        # step less dp's was predicted 2-6 ms too high in 6 of 8 model families on 3 CPU
        # ranks (the planner bench, 2026-12-05); zero2 sends the same messages
        pairs = max(1, trial_steps // 3)
        # the host's spread per step, from dp's trial steps: a floor under a few steps' own
        noise = robust(report["trial"]["seconds"]).rel if report["trial"]["seconds"] else 0.0

        def settle(kinds: Sequence[int], k: int) -> Callable[[Sequence[float]], int]:
            """Another block of each of ``k`` layouts in rotation while rank 0 finds the
            median of any of ``kinds`` unsettled (``more_trial_steps``, at least the dp
            trial's spread; a block counts 2 of each beside another layout, 3 alone)."""
            def again(secs: Sequence[float]) -> int:
                return 3 * k if rank0_says(rank == 0 and any(more_trial_steps(
                    of_kind(secs, k, i), 2 if k > 1 else 3, noise) for i in kinds),
                    device) else 0
            return again

        # zero1 holds the parameters and gradients whole and 1/world of the moments
        for name, other in (("zero1", 0.5 + 0.5 / world), ("zero3", None)):
            beside = every_rank_has_room(replica_bytes, world, device, other=other)
            k = 1 + int(beside)
            secs = run_trial([("dp", {})] * int(beside) + [(name, {})], 3 * k * pairs,
                             more=settle([k - 1], k), **run)
            if secs:
                report[f"trial_{name}"] = {
                    "shares": [int(s) for s in shares], "seconds": of_kind(secs, k, k - 1),
                    **({"dp_seconds": of_kind(secs, k, 0)} if beside else {})}
            lap(f"trial_{name}")
        beside = every_rank_has_room(replica_bytes, world, device)  # two stages' worth
        pipe = pipeline_trial(pairs, len(blocks), block_secs, run, autocast, beside_dp=beside,
                              settle=settle)
        if pipe:
            report["trial_pipeline"] = pipe
        lap("trial_pipeline")
    else:
        report["trial"] = {"shares": [int(s) for s in shares],
                           "seconds": run_trial([("dp", {})], trial_steps, **run)}
        lap("trial_dp")
    return report
