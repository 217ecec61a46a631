"""What a worker measures for the planner, repeated so that each figure knows its noise, and
the per-block hooks that time (and, for emulated devices, slow) a rank's compute.

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
charged in series), and a few trial dp steps with the step loop's data
fetch and control all-reduce, and a few of zero3 (its per-unit gathers meet busy peers:
what they wait beyond their messages is measured, not assumed). Each
figure is a list of repeated seconds; ``clusters.measured.terms_model`` reduces them to
medians and spreads and builds the cost model.

``SpanHooks`` wraps every compute block of a layout: it sums the seconds spent inside the
blocks' forwards (this rank's own compute, without the collectives between blocks, which the
controller's closed loop reads per rank) and, on an emulated slower device, sleeps ``(slowdown
- 1) x`` each forward's and each backward's time where it happens.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from clusters.collectives import BROADCAST_BURST, KINDS
from clusters.measured import more_update_steps

__all__ = ["SpanHooks", "profile_terms", "COLLECTIVE_SIZES"]

COLLECTIVE_SIZES = (4 << 10, 256 << 10, 4 << 20)
_KINDS = KINDS  # every kind the cost model charges (clusters.collectives), each measured


def _sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


class SpanHooks:
    """Forward (and, when slowed, backward) hooks on a layout's compute blocks.

    ``take()`` returns the seconds spent inside the blocks' forwards since the last call
    (emulated sleep included). Not thread-safe: the step loop owns it."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._fwd = 0.0

    def install(self, blocks: Sequence[nn.Module], slowdown: float, device: torch.device,
                time_forward: bool = True) -> None:
        """(Re)install on ``blocks`` (no reference to them is kept beyond the hooks)."""
        self.remove()
        extra = max(0.0, slowdown - 1.0)
        if extra <= 0 and not time_forward:
            return
        sync = _sync_fn(device)
        started: dict[tuple[int, str], float] = {}

        def start(phase: str) -> Callable[..., None]:
            def hook(mod: Any, *_args: Any) -> None:
                if extra > 0:
                    sync()
                started[(id(mod), phase)] = time.perf_counter()
            return hook

        def stop(phase: str) -> Callable[..., None]:
            def hook(mod: Any, *_args: Any) -> None:
                t = started.pop((id(mod), phase), None)
                if t is None:
                    return
                if extra > 0:
                    sync()
                    time.sleep(extra * (time.perf_counter() - t))
                if phase == "fwd":
                    self._fwd += time.perf_counter() - t
            return hook

        for m in blocks:
            self._handles += [m.register_forward_pre_hook(start("fwd")),
                              m.register_forward_hook(stop("fwd"))]
            if extra > 0:
                # the first block's inputs need no gradient: its backward hook then fires on
                # the gradients of its outputs, which torch warns about; that timing is wanted
                warnings.filterwarnings("ignore",
                                        message="Full backward hook is firing when gradients")
                self._handles += [m.register_full_backward_pre_hook(start("bwd")),
                                  m.register_full_backward_hook(stop("bwd"))]

    def take(self) -> float:
        out, self._fwd = self._fwd, 0.0
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._fwd = 0.0


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
    sync = _sync_fn(device)
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
    half as many of zero3, and as many of a pipeline over every rank at each of two
    micro-batch counts, its schedule timed apart (``_pipeline_trial``). Every rank must call
    it with the same ``rounds``, ``trial_steps`` and ``shares``."""
    from strategies.blocks import blocks_of

    sync = _sync_fn(device)
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
    blocks = blocks_of(model)
    block_secs, bounds = _block_times(blocks, x, autocast, sync, slowdown, rounds)
    report: dict[str, Any] = {
        "rank": rank, "world": world,
        "compute": {"batches": [share, small][:len(compute)], "seconds": compute,
                    "forward": times[1]},
        "blocks": {"batch": share, "seconds": block_secs, "boundary_bytes": bounds,
                   "tensors": [[p.numel() for p in b.parameters()] for b in blocks]},
        "optimizer": _optimizer_times(model, optimizer_factory, world, rank, rounds),
    }
    if world > 1:
        busy_s = min(0.005, max(0.0005, statistics_median(compute[0]) / max(1, len(blocks))))
        report["collectives"], report["collectives_idle"] = _collective_times(
            world, rank, device, rounds, busy_s, COLLECTIVE_SIZES)
    # trial steps: the real strategy and the step loop's data fetch and control all-reduce;
    # dp's set the per-step overhead, zero3's its per-unit wait (FSDP's gathers under load)
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
        alone = statistics_median(report["optimizer"]["plain"][0][2])

        def more(secs: Sequence[float]) -> int:
            kept = _kept(secs)
            go = torch.tensor([float(rank == 0 and more_update_steps(
                [t for u, t in kept if u], [t for u, t in kept if not u], alone))],
                device=device)
            dist.broadcast(go, src=0)
            return 6 if go.item() else 0  # another pair of blocks

        secs = _trial_steps("dp", 6 * max(2, -(-trial_steps // 2)), update_at=_alternating,
                            more=more, **run)
        kept = _kept(secs)
        report["trial"] = {"shares": [int(s) for s in shares],
                           "seconds": [t for u, t in kept if u]}
        report["trial_no_update"] = {"shares": [int(s) for s in shares],
                                     "seconds": [t for u, t in kept if not u]}
        secs = _trial_steps("zero3", max(2, trial_steps // 2), **run)
        if secs:
            report["trial_zero3"] = {"shares": [int(s) for s in shares], "seconds": secs}
        pipe = _pipeline_trial(max(2, trial_steps // 2), len(blocks), block_secs, run,
                               autocast)
        if pipe:
            report["trial_pipeline"] = pipe
    else:
        report["trial"] = {"shares": [int(s) for s in shares],
                           "seconds": _trial_steps("dp", trial_steps, **run)}
    return report


def _pipeline_trial(n: int, n_blocks: int, block_secs: Sequence[Sequence[float]],
                    run: dict[str, Any], autocast: Callable[[], Any]) -> dict[str, Any] | None:
    """``n`` steps of a pipeline over every rank (pp = world, 1F1B; stages cut by rank 0's
    ``block_secs``, as the planner cuts equal devices) at the fewest micro-batches that
    divide the global batch, at least world, and again at the fewest of at least twice that:
    each step's seconds and its schedule's (micro-batches, p2p, bubble) on this rank. What a
    schedule costs per micro-batch and beyond, and what the step's other messages cost.
    None when the model has fewer blocks than ranks or cannot be pipelined."""
    from strategies.pipeline import balanced_split

    world, shares, device = run["world"], [int(s) for s in run["shares"]], run["device"]
    g = sum(shares)
    m1 = next((k for k in range(world, g + 1) if g % k == 0), 0)
    if not m1 or n_blocks < world:
        return None
    m2 = next((k for k in range(2 * m1, g + 1) if g % k == 0), 0)
    cut = [0] * world
    if run["rank"] == 0:  # one split for every rank
        cut = list(balanced_split([1 + int(1e7 * statistics_median(ts)) for ts in block_secs],
                                  world))
    split = torch.tensor(cut, dtype=torch.int64, device=device)
    dist.broadcast(split, src=0)
    stage_split = tuple(int(x) for x in split.tolist())
    counts = (m1, m2) if m2 else (m1,)
    runs = []
    for m, ok in zip(counts, _every_rank_runs([g // m for m in counts], run, autocast),
                     strict=True):
        if not ok:
            continue
        kw = {"pp_degree": world, "micro_batches": m, "schedule": "1f1b",
              "stage_split": stage_split}
        sched: list[float] = []
        secs = _trial_steps("pipeline", n, spec_kw=kw, schedule_secs=sched, **run)
        if secs:  # (refused on every rank alike)
            runs.append({"micro_batches": m, "seconds": secs,
                         "schedule_seconds": sched[-len(secs):]})
    if not runs:
        return None
    return {"shares": shares, "schedule": "1f1b", "split": list(stage_split), "runs": runs}


def _every_rank_runs(sizes: Sequence[int], run: dict[str, Any],
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
    flags = torch.tensor(ok, device=run["device"])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [bool(f) for f in flags.tolist()]


def _trial_steps(name: str, n: int, *, shares: Sequence[int], world: int, rank: int,
                 device: torch.device, model_factory: Callable[[], nn.Module],
                 optimizer_factory: Callable[[Any], Any], loss_fn: Any,
                 batch: Callable[[int], Any], control: Callable[[], Any] | None,
                 slowdown: float, update_at: Callable[[int], bool] | None = None,
                 more: Callable[[Sequence[float]], int] | None = None,
                 spec_kw: dict[str, Any] | None = None,
                 schedule_secs: list[float] | None = None) -> list[float]:
    """Seconds of ``n`` steps of layout ``name`` (after 2 warm-up steps) as the step loop
    runs them: the data fetch, the strategy's step, the control all-reduce issued after it
    and waited for after the next one; ``update_at(i)``: whether step i runs the optimizer's
    update (default: every step). When they are done, ``more(seconds so far)`` (called on
    every rank alike) gives how many steps to run on, until it gives 0.
    ``spec_kw``: the spec's other fields (a pipeline's); ``schedule_secs``: appended with
    each step's pipeline schedule (``schedule.step``), warm-up steps included. [] when the
    layout refuses the model (on every rank alike: ``validate`` is deterministic)."""
    from strategies import Runtime, StrategySpec
    from strategies import get as get_strategy
    from strategies.blocks import blocks_of
    from strategies.errors import StrategyError

    sync = _sync_fn(device)
    spec = StrategySpec(name, world, tuple(int(s) for s in shares), **(spec_kw or {}))
    torch.manual_seed(0)
    model = model_factory()
    try:
        get_strategy(name).validate(spec, model)
    except StrategyError:
        return []
    live = [True]
    factory = optimizer_factory if update_at is None else _switchable(optimizer_factory, live)
    strat = get_strategy(name)(spec, Runtime(rank, world, device), model, factory, loss_fn)
    hooks = SpanHooks()
    try:
        if schedule_secs is not None:
            _time_calls(strat.schedule, "step", schedule_secs, sync)  # type: ignore[attr-defined]
        hooks.install(blocks_of(strat.local_model()), slowdown, device, time_forward=False)
        steps: list[float] = []
        pending: Any = None
        step = 0
        while True:
            if step == n + 2:
                extra = more(steps[2:]) if more is not None else 0
                if extra <= 0:
                    break
                n += extra
            live[0] = update_at is None or step < 2 or update_at(step - 2)
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
            step += 1
        if pending is not None:
            pending.wait()
        return steps[2:]
    finally:
        hooks.remove()
        strat.close()


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


def _alternating(i: int) -> bool:
    """Whether trial step i runs the update: blocks of 3 with, 3 without, in turn."""
    return (i // 3) % 2 == 0


def _kept(secs: Sequence[float]) -> list[tuple[bool, float]]:
    """(update?, seconds) of the alternating trial steps that count: each block's first
    step, which follows the other kind, does not."""
    return [(_alternating(i), t) for i, t in enumerate(secs) if i % 3]


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


def statistics_median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0.0
