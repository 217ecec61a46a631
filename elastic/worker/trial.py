"""The profiler's trial steps: a layout's real steps as the step loop runs them (the data
fetch, the strategy's step, the control all-reduce issued after it and waited for after the
next one), timed on every rank. ``elastic.worker.measure.profile_terms`` runs dp's (with and
without the optimizer's update, in alternating blocks), zero1's, zero3's, and a pipeline's
over every rank at two micro-batch counts (``pipeline_trial``), each in rotation with dp's, so
that a slow phase of a shared host falls on both alike instead of on whichever ran in it (on
this 2-core VM, phases 1.3-2x slower for 10-40 steps come and go during any run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .spans import SpanHooks, median, sync_fn

__all__ = ["trial_steps", "pipeline_trial", "rotation", "alternating", "kept", "of_kind",
           "layout_at", "room_beside", "every_rank_has_room"]


def rotation(i: int, kinds: int) -> int:
    """Which of ``kinds`` kinds trial step i is: blocks of 3 of each, in turn."""
    return (i // 3) % kinds


def alternating(i: int) -> bool:
    """Whether trial step i is of the first of two kinds (``rotation``)."""
    return rotation(i, 2) == 0


def layout_at(step: int, layouts: int) -> int:
    """Which of ``layouts`` instances runs trial step ``step`` (warm-up included): 2 warm-up
    steps of each in turn, then blocks of 3 of each in turn (``rotation``)."""
    warm = 2 * layouts
    return step // 2 if step < warm else rotation(step - warm, layouts)


def kept(secs: Sequence[float], kinds: int = 2) -> list[tuple[int, float]]:
    """(kind, seconds) of the rotating trial steps that count: each block's first step,
    which follows another kind, does not (with one kind, every step counts)."""
    return [(rotation(i, kinds), t) for i, t in enumerate(secs) if kinds == 1 or i % 3]


def of_kind(secs: Sequence[float], kinds: int, kind: int) -> list[float]:
    """The counted seconds of one kind (``kept``)."""
    return [t for k, t in kept(secs, kinds) if k == kind]


ROOM_MARGIN = 1.25  # free device memory over what holding dp's replica beside needs


def room_beside(free_bytes: float | None, replica_bytes: float, world: int,
                other: float | None = None) -> bool:
    """Whether a device with ``free_bytes`` free (None: host memory, not measured) can hold
    dp's replica (``replica_bytes``: parameters, gradients and two optimizer moments) beside
    another layout holding ``other`` times it (default: zero3's shards or two pipeline
    stages, each about 1/world of it), with a margin."""
    if free_bytes is None:
        return True
    beside = 2 / max(1, world) if other is None else other
    return free_bytes >= ROOM_MARGIN * replica_bytes * (1 + beside)


def every_rank_has_room(replica_bytes: float, world: int, device: torch.device,
                        other: float | None = None) -> bool:
    """``room_beside`` on every rank (``on_every_rank``): the rotation with dp's steps runs
    on every rank or on none. Free device memory counts what the caching allocator holds
    unused (the layouts before it were closed, their blocks kept for reuse)."""
    free = None
    if device.type == "cuda":
        free = float(torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                     - torch.cuda.memory_allocated(device))
    return on_every_rank([room_beside(free, replica_bytes, world, other)], device)[0]


def on_every_rank(flags: Sequence[bool], device: torch.device) -> list[bool]:
    """Each of ``flags`` where it holds on every rank (one MIN all-reduce), so that every
    rank takes the same branch of a collective."""
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(f) for f in t.tolist()]


def rank0_says(yes: bool, device: torch.device) -> bool:
    """Rank 0's ``yes`` on every rank (one broadcast; the others' value is not read): what
    rank 0 alone decides from its own timings, every rank then does alike."""
    go = torch.tensor([float(yes)], device=device)
    dist.broadcast(go, src=0)
    return bool(go.item())


def pipeline_trial(pairs: int, n_blocks: int, block_secs: Sequence[Sequence[float]],
                   run: dict[str, Any], autocast: Callable[[], Any],
                   beside_dp: bool = True,
                   settle: Callable[[Sequence[int], int], Callable[[Sequence[float]], int]]
                   | None = None) -> dict[str, Any] | None:
    """Steps of a pipeline over every rank (pp = world, 1F1B; stages cut by rank 0's
    ``block_secs``, as the planner cuts equal devices) at the fewest micro-batches that divide
    the global batch, at least world, and at the most that divide it from twice to 4 times
    that (a schedule's per-micro-batch work shows at many small micro-batches: mixer on 2
    CPU ranks took 132, 113, 116 and 154 ms at m = 2, 4, 8, 16, and a fit to 2 and 4 missed
    16 by -25 %; the planner considers m up to 64), with dp's
    in rotation, ``pairs`` blocks of each (2 counted steps per block): each step's seconds
    and its schedule's (micro-batches, p2p, bubble) on this rank, and dp's seconds beside them
    (a slow phase of the host falls on all alike: ``clusters.measured`` takes each layout at
    the dp trial's level). What a schedule costs per micro-batch and beyond, and what the
    step's other messages cost. The layouts are held at once: dp's replica and both counts'
    stages (2/world of the model's states more than dp's; ``beside_dp`` False: without dp's,
    and no level). ``settle(kinds, k)``: the ``more`` rule of ``trial_steps`` for ``k``
    layouts in rotation, on until the figures of ``kinds`` settle (both counts'). None when
    the model has fewer blocks than ranks or cannot be pipelined."""
    from strategies.pipeline import balanced_split

    world, shares, device = run["world"], [int(s) for s in run["shares"]], run["device"]
    g = sum(shares)
    m1 = next((k for k in range(world, g + 1) if g % k == 0), 0)
    if not m1 or n_blocks < world:
        return None
    far = [k for k in range(min(4 * m1, g), 2 * m1 - 1, -1) if g % k == 0]  # most first
    cut = [0] * world
    if run["rank"] == 0:  # one split for every rank
        cut = list(balanced_split([1 + int(1e7 * median(ts)) for ts in block_secs], world))
    split = torch.tensor(cut, dtype=torch.int64, device=device)
    dist.broadcast(split, src=0)
    stage_split = tuple(int(x) for x in split.tolist())
    # the second count: the most of those that every rank's stages take (a batch norm
    # refuses 1 sample)
    oks = every_rank_runs([g // m for m in (m1, *far)], run, autocast)
    counts = [m1] * oks[0] + [m for m, ok in zip(far, oks[1:], strict=True) if ok][:1]
    if not counts:
        return None
    pipes = [{"pp_degree": world, "micro_batches": m, "schedule": "1f1b",
              "stage_split": stage_split} for m in counts]
    first = int(beside_dp)
    layouts: list[tuple[str, dict[str, Any]]] = [("dp", {})] * first
    layouts += [("pipeline", kw) for kw in pipes]
    k = len(layouts)
    sched: list[float] = []
    more = settle(range(first, k), k) if settle is not None else None
    secs = trial_steps(layouts, 3 * k * pairs, schedule_secs=sched, more=more, **run)
    if not secs:  # (refused on every rank alike)
        return None
    runs = [{"micro_batches": m, "seconds": of_kind(secs, k, i + first),
             "schedule_seconds": of_kind(sched, k, i + first)} for i, m in enumerate(counts)]
    out = {"shares": shares, "schedule": "1f1b", "split": list(stage_split), "runs": runs}
    return {**out, "dp_seconds": of_kind(secs, k, 0)} if beside_dp else out


def every_rank_runs(sizes: Sequence[int], run: dict[str, Any],
                    autocast: Callable[[], Any]) -> list[bool]:
    """For each micro-batch size, whether the whole model takes a forward and backward of
    that many of this rank's samples on every rank (one model, one MIN all-reduce of every
    rank's answers). A pipeline's stages run different code: one that raises (a batch norm
    on 1 sample, out of memory) would leave the others waiting in a receive until the
    group's timeout."""
    ok = [0.0] * len(sizes)
    try:
        torch.manual_seed(0)
        model = run["model_factory"]().to(run["device"])
        x, y = run["batch"](0)
        for i, b in enumerate(sizes):
            try:
                idx = torch.arange(b) % max(1, int(x.shape[0]))
                with autocast():
                    loss = run["loss_fn"](model(x[idx].to(run["device"])),
                                          y[idx].to(run["device"]))
                loss.backward()
                ok[i] = 1.0
            except Exception:  # noqa: BLE001 - any failure: that run is skipped on every rank
                pass
        del model
    except Exception:  # noqa: BLE001 - no model here: every run is skipped
        pass
    return on_every_rank([bool(f) for f in ok], run["device"])


def trial_steps(layouts: Sequence[tuple[str, dict[str, Any]]], n: int, *,
                shares: Sequence[int], world: int, rank: int, device: torch.device,
                model_factory: Callable[[], nn.Module], optimizer_factory: Callable[[Any], Any],
                loss_fn: Any, batch: Callable[[int], Any], control: Callable[[], Any] | None,
                slowdown: float, update_at: Callable[[int], bool] | None = None,
                more: Callable[[Sequence[float]], int] | None = None,
                schedule_secs: list[float] | None = None) -> list[float]:
    """Seconds of ``n`` steps of ``layouts`` ((strategy, the spec's other fields), held at
    once) as the step loop runs them, after 2 warm-up steps of each: the data fetch, the
    strategy's step, the control all-reduce issued after it and waited for after the next
    one. Step i runs on layout ``rotation(i, len(layouts))``. ``update_at(i)``: whether step
    i runs the optimizer's update (default: every step). When they are done, ``more(seconds
    so far)`` (called on every rank alike) gives how many steps to run on, until it gives 0.
    ``schedule_secs``: appended with each counted step's pipeline schedule seconds
    (``schedule.step``; 0 for a layout without one). [] when a layout refuses the model (on
    every rank alike: ``validate`` is deterministic)."""
    from strategies import Runtime, StrategySpec
    from strategies import get as get_strategy
    from strategies.blocks import blocks_of
    from strategies.errors import StrategyError

    sync = sync_fn(device)
    specs = [StrategySpec(name, world, tuple(int(s) for s in shares), **kw)
             for name, kw in layouts]
    live = [True]
    factory = optimizer_factory if update_at is None else _switchable(optimizer_factory, live)
    strats: list[Any] = []
    hooks: list[SpanHooks] = []
    try:
        calls: list[float] = []  # the schedules' seconds, this step's
        for spec in specs:
            torch.manual_seed(0)
            model = model_factory()
            try:
                get_strategy(spec.name).validate(spec, model)
            except StrategyError:
                return []
            strat: Any = get_strategy(spec.name)(spec, Runtime(rank, world, device), model,
                                                 factory, loss_fn)
            strats.append(strat)
            if schedule_secs is not None and hasattr(strat, "schedule"):  # a pipeline's
                _time_calls(strat.schedule, "step", calls, sync)
            hooks.append(SpanHooks())
            hooks[-1].install(blocks_of(strat.local_model()), slowdown, device,
                              time_forward=False)
        warm = 2 * len(strats)
        steps: list[float] = []
        pending: Any = None
        step = 0
        while True:
            if step == n + warm:
                extra = more(steps[warm:]) if more is not None else 0
                if extra <= 0:
                    break
                n += extra
            i = step - warm
            live[0] = update_at is None or i < 0 or update_at(i)
            strat = strats[layout_at(step, len(strats))]
            t0 = time.perf_counter()
            xs, ys = batch(step)
            strat.train_step(xs, ys)
            if control is not None:  # as the step loop: issued now, waited for a step on
                work = control()
                if pending is not None:
                    pending.wait()
                pending = work
            sync()
            steps.append(time.perf_counter() - t0)
            if schedule_secs is not None and i >= 0:
                schedule_secs.append(sum(calls))
            calls.clear()
            step += 1
        if pending is not None:
            pending.wait()
        return steps[warm:]
    finally:
        for h in hooks:
            h.remove()
        for s in strats:
            s.close()


def _time_calls(obj: Any, name: str, into: list[float], sync: Callable[[], None]) -> None:
    """Append the seconds of each call of ``obj.name`` to ``into``, the device synchronized
    on both sides (the instance's method is replaced)."""
    real = getattr(obj, name)

    def timed(*a: Any, **k: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            sync()
            into.append(time.perf_counter() - t0)
    setattr(obj, name, timed)


def _switchable(factory: Callable[[Any], Any], live: list[bool]) -> Callable[[Any], Any]:
    """``factory``'s optimizers, whose step leaves the parameters as they are while
    ``live[0]`` is False. The instance's ``step`` is replaced: fine for the strategies'
    direct ``optimizer.step()`` (torch's step hooks still run when live); a torch
    ``LRScheduler`` attached to it would not accept the wrapper."""
    def make(params: Any) -> Any:
        opt = factory(params)
        real = opt.step
        opt.step = lambda *a, **k: real(*a, **k) if live[0] else None
        return opt
    return make
