"""The controller's layouts: the spec for a strategy on the workers there are (balanced
shares, speed-aware stage splits, the planner for ``auto``), re-balancing, and laying the
workers out as a spec (the first layout, or a live switch whose proof it checks).

``Layouts`` owns the measured speeds (profiled once per worker, cached per device, model and
batch), the speeds the current shares follow, the per-block costs that cut pipeline stages, and
what ``auto`` planned with (the measured cost model, the live cluster, the planner's ranking),
which the closed loop (``replan.Replanner``) re-fits.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from clusters.measured import equal_within_noise
from strategies import StrategyError, StrategySpec
from strategies import get as get_strategy
from strategies.spec import pipeline_defaults
from strategies.traits import DP_MODES, TRAITS, spec_survives_loss, traits_of

from ..data import even_shares
from ..errors import ConfigError, InfrastructureError, SwitchError
from .checkpoints import megabytes, spec_dict

__all__ = ["Layouts", "replicas_stay", "unprotected"]

_SHARE_BALANCED = DP_MODES  # layouts whose ranks each run a share of the batch


def unprotected(spec: Any, cfg: Any, nodes: Sequence[str] | None = None) -> bool:
    """Whether one lost rank, or one lost node (``nodes``: each rank's node id, when known),
    loses state no survivor holds (``spec``: zero1/2/3, a pipeline stage without a replica,
    or whose replicas share a node) while ``cfg`` takes neither periodic checkpoints nor peer
    copies: its recovery would start over from step 0 (or the checkpoint it resumed from).
    A node hosting every rank is not counted: its loss is the whole job's, whatever the
    layout."""
    if (spec.world_size <= 1 or getattr(cfg, "checkpoint_every", 0) > 0
            or getattr(cfg, "peer_copies_every", 0) > 0):
        return False
    if not spec_survives_loss(spec):
        return True
    if nodes is None or len(nodes) != spec.world_size:
        return False
    on: dict[str, set[int]] = {}
    for r, node in enumerate(nodes):
        on.setdefault(node or f"?{r}", set()).add(r)  # unknown: a node of its own
    return any(len(ranks) < spec.world_size and not replicas_stay(spec, ranks)
               for ranks in on.values())


def replicas_stay(spec: Any, leaving: set[int]) -> bool:
    """Whether every entry keeps a holder among the ranks that stay when ``leaving`` go: dp
    while one rank stays; a pipeline over dp while each stage keeps a replica (rank = stage x
    dp degree + replica); another layout only for a single rank it survives the loss of."""
    if not leaving or len(leaving) >= spec.world_size:
        return not leaving
    if spec.name == "dp":
        return True
    if spec.name == "pipeline" and spec.dp_mode == "dp":
        d = spec.world_size // max(1, spec.pp_degree)
        return all(any(s * d + j not in leaving for j in range(d))
                   for s in range(spec.pp_degree))
    return spec_survives_loss(spec) and len(leaving) == 1


def _phases(reports: list[Any]) -> dict[str, float]:
    """Each part of the profile's seconds, the most over the ranks (they run it together)."""
    out: dict[str, float] = {}
    for r in reports:
        for k, v in r.get("phases", {}).items():
            out[k] = max(out.get(k, 0.0), float(v))
    return out


class Layouts:
    """Choosing and applying layouts for one job (``probe_model``: the job's model built once
    on the driver, for validation and planning)."""

    def __init__(self, cfg: Any, probe_model: Any, emit: Callable[..., Any]) -> None:
        self.cfg = cfg
        self.probe_model = probe_model
        self._emit = emit
        self.speed: dict[int, float] = {}  # worker_id -> measured samples/s
        self.used_speeds: list[float] | None = None  # the speeds the current shares follow
        self.block_costs: list[float] | None = None  # seconds per sample of each block
        self.measured: Any = None  # clusters.measured.MeasuredModel of auto's last plan
        self.cluster: Any = None  # the live clusters.Cluster it was planned on
        self.ids: list[str] = []  # its device id per rank
        # what that model was fitted from: the workers' infos (budgets applied) and their
        # ``profile_terms`` reports (a few KB; bench/planner.py replays them)
        self.profiled: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None
        self.kinds: list[Any] = []  # what makes its devices alike (planning.device_kinds)
        self.apply_s: list[float] = []  # seconds of each re-layout (build or switch)
        self._exposed = False  # the last layout applied could not survive a lost node

    # ------------------------------------------------------------------ specs

    def make(self, name: str, world: int, group: Any = None, pp: int | None = None
             ) -> StrategySpec:
        """The layout for ``name`` on ``world`` workers, carrying the job's settings every
        layout applies (clipping, precision, micro-batch size), so validating it validates
        them too. With the live ``group`` of that size, shares follow measured speeds when
        balancing and ``auto`` asks the planner. ``pp``: a pipeline's degree instead of the
        job's."""
        spec = self._plan(name, world, group, pp)
        return dataclasses.replace(spec, options=spec.options.over(self.cfg.strategy_options()))

    def _plan(self, name: str, world: int, group: Any, pp_degree: int | None = None
              ) -> StrategySpec:
        from ..planning import balanced_shares, device_hosts, device_kinds

        cfg = self.cfg
        g = cfg.global_batch_size
        placed = group is not None and len(group.workers) == world
        if name == "auto":
            if not placed:  # before placement: validated again once workers exist
                return StrategySpec("dp", world, even_shares(g, world))
            return self._auto(group)
        pp = pp_degree or cfg.pp_degree
        pipeline = name in TRAITS and TRAITS[name].pipeline
        if pipeline and pp == 1:
            pp = world
        shares = even_shares(g, world)
        split = None
        balancing = placed and self.balancing(group)

        def equalized() -> tuple[list[float], list[Any], list[Any]]:
            raw = self.speeds(group)  # first: a profile may update the workers' infos
            infos = [w.info for w in group.workers]
            kinds, hosts = device_kinds(infos), device_hosts(infos)
            return list(equal_within_noise(raw, kinds=kinds, hosts=hosts)), kinds, hosts

        if balancing and name in _SHARE_BALANCED:
            speeds, kinds, hosts = equalized()
            shares = balanced_shares(g, speeds, kinds, hosts)
            self.used_speeds = speeds
        m, schedule = cfg.micro_batches or 1, cfg.schedule or "gpipe"  # not a pipeline: unused
        if pipeline and world % pp == 0:  # its shares are even: stages, not shares, balance
            d = world // pp
            m, schedule = pipeline_defaults([sum(shares[j::d]) for j in range(d)], pp,
                                            cfg.micro_batches, cfg.schedule,
                                            cfg.micro_batch_size)
            split = self._stage_split(group, pp, d, schedule, balancing, equalized) \
                if placed else None
        return StrategySpec(name=name, world_size=world, shares=shares, pp_degree=pp,
                            micro_batches=m, schedule=schedule,
                            dp_mode=cfg.dp_mode, stage_split=split)

    def _stage_split(self, group: Any, pp: int, d: int, schedule: str, balancing: bool,
                     equalized: Callable[[], tuple[list[float], list[Any], list[Any]]]
                     ) -> tuple[int, ...] | None:
        """Blocks per stage: by measured per-block times when there are any, else by
        parameters and (balancing) each stage's slowest device; None: the strategy's own."""
        from ..planning import block_stage_split, speed_stage_split

        stage = [1.0] * pp
        if balancing:
            speeds = equalized()[0]
            stage = [min(speeds[s * d:(s + 1) * d]) for s in range(pp)]
        v = 2 if schedule == "interleaved" else 1
        costs = self._block_costs(group)
        try:
            return (block_stage_split(costs, [stage[k % pp] for k in range(pp * v)])
                    if costs is not None else
                    speed_stage_split(self.probe_model, stage) if balancing and v == 1
                    else None)
        except Exception:  # noqa: BLE001 - fewer blocks than stages: validate says so
            return None

    def _auto(self, group: Any) -> StrategySpec:
        """The planner's choice from what the workers measure (``profile_terms``: every term
        repeated, with its spread; speeds that agree within the noise made equal)."""
        from ..planning import auto_plan, device_kinds, measured_model, plan_spec

        cfg, world = self.cfg, len(group.workers)
        g = cfg.global_batch_size
        infos = self._budgets("zero3", [w.info for w in group.workers])  # copies' share
        t0 = time.perf_counter()
        reports = group.profile_terms(list(even_shares(g, world)))
        t1 = time.perf_counter()
        cluster, mm = measured_model(self.probe_model, cfg.optimizer, infos, reports,
                                     cfg.precision)
        result = auto_plan(cluster, mm, g, **_shardable_only(self.probe_model))
        t2 = time.perf_counter()
        self.measured, self.cluster, self.ids = mm, cluster, [d.id for d in cluster.devices]
        self.profiled = (list(infos), list(reports))
        self.kinds = device_kinds(infos)
        for w, v in zip(group.workers, mm.speeds, strict=True):
            self.speed[w.worker_id] = v
            w.info["profiled_samples_per_s"] = v
        spec = plan_spec(result.plan)
        if spec.name in _SHARE_BALANCED:
            self.used_speeds = list(mm.speeds)
        why = result.explanation
        self._emit("plan", why.splitlines()[0], data={
            "explanation": why, "speeds": list(mm.speeds), "raw_speeds": list(mm.raw_speeds),
            "profile_s": t1 - t0, "plan_s": t2 - t1,  # what auto's start costs
            "profile_phases": _phases(reports),
            "spreads": mm.spreads, "predictions": [
                {"plan": c.plan.label, "step_s": c.step_time,
                 "parts": {"compute": c.estimate.compute, "comm": c.estimate.comm,
                           "optimizer": c.estimate.optimizer} if c.estimate else None}
                for c in result.ranked]})
        return spec

    def _block_costs(self, group: Any) -> list[float] | None:
        """Seconds per sample of each block: measured by ``auto``'s profile, else profiled
        once on the workers (median over them; None when they cannot time blocks)."""
        if self.block_costs is not None:
            return self.block_costs or None
        secs = self.measured.profile.block_seconds if self.measured is not None else None
        rows: list[Any] = list(secs.values()) if secs else []
        if not rows:
            batch = max(1, self.cfg.global_batch_size // max(1, len(group.workers)))
            rows = [d.get("block_seconds") for d in group.profile(batch, True)]
            rows = [r for r in rows if r]
        if not rows or len({len(r) for r in rows}) != 1:
            self.block_costs = []  # tried: no block could be timed
            return None
        self.block_costs = [statistics.median(col) for col in zip(*rows, strict=True)]
        return self.block_costs

    def segment_end(self, step: int, end: int, group: Any, pause: int | None = None) -> int:
        """Where a segment from ``step`` stops for the layouts' sake: a scheduled switch,
        the next re-balancing check while balancing, after step ``pause`` (the caller's:
        a step whose outcome it must hear before the workers go on), else ``end``."""
        ends = [end] + [s for s in self.cfg.switch_at if s > step]
        if pause is not None:
            ends.append(pause + 1)
        every = self.cfg.rebalance_every
        if every > 0 and self.balancing(group):
            ends.append((step // every + 1) * every)
        return min(ends)

    def check(self, spec: StrategySpec) -> None:
        """``StrategyError`` if ``spec`` cannot run on the job's model (``_unchained`` too)."""
        get_strategy(spec.name).validate(spec, self.probe_model)
        _unchained(spec, self.probe_model)

    def validate(self, spec: StrategySpec, field_name: str) -> None:
        """``ConfigError`` naming ``field_name`` if ``spec`` cannot run."""
        try:
            self.check(spec)
        except StrategyError as e:
            raise ConfigError(field_name, f"{spec.name} cannot run here: {e}", _OTHER) from None

    def fit(self, name: str, world: int, group: Any) -> StrategySpec:
        """A valid layout for ``name`` on ``world`` workers after a membership change: the
        same strategy if it can run there (a pipeline keeps its degree when it divides the
        world, else takes the nearest degree that does), else the planner's choice."""
        first = self.make(name, world, group)
        candidates = [first]
        if name in TRAITS and traits_of(name).pipeline:  # not "auto": the planner's anew
            degrees = sorted((d for d in range(2, world + 1) if world % d == 0),
                             key=lambda d: (abs(d - first.pp_degree), d))
            candidates += [self.make(name, world, group, pp=d) for d in degrees]
        for spec in candidates:
            try:
                self.check(spec)
            except StrategyError:
                continue
            if spec is not first:
                self._emit("replanned", f"{name} with pp_degree {spec.pp_degree} on {world} "
                           f"workers (pp_degree {first.pp_degree} does not fit)")
            self._say_exposure(spec, group)  # a regroup: a loss may now be unrecoverable
            return spec
        spec = self.make("auto", world, group)
        self._emit("replanned", f"{name} cannot run on {world} workers; the planner chose "
                   f"{spec.name}")
        self._say_exposure(spec, group)
        return spec

    def survivor_plan(self, name: str, infos: list[dict[str, Any]]) -> tuple[bool, str, str]:
        """Before a planned shrink to the workers ``infos`` (an evacuation): whether the
        planner finds a layout of the state that fits their memory, the strategy to use
        (``name`` when it fits, else the planner's choice) and a few words when it changes.
        With peer copies on, a worker whose device memory is host memory (CPU) holds them
        too: its budget is lowered by what they take."""
        from clusters import layout_memory, plan

        from ..planning import live_cluster, model_profile

        if name == "auto":
            return True, name, ""
        cluster, _ = live_cluster(self._budgets(name, infos))
        prof = model_profile(self.probe_model, self.cfg.optimizer, precision=self.cfg.precision)
        kind = name if name in _SHARE_BALANCED else "zero3"  # a stage holds ~1/n of it too
        need = layout_memory(kind, prof.n_params, len(infos), bytes_per_param=prof.bytes_per_param,
                             grad_bytes=prof.grad_bytes,
                             optimizer_bytes=prof.optimizer_bytes_per_param).model_states
        if need <= min(d.memory_bytes for d in cluster.devices):
            return True, name, ""  # the planner's first check; the layout is validated later
        try:
            other = plan(cluster, prof, self.cfg.global_batch_size, subsets=False).choice
        except Exception as e:  # noqa: BLE001 - a model the planner cannot cut
            return False, name, f"; not planned: {e}"
        if other is None:
            return False, name, "; no layout fits the survivors' memory"
        return True, other.plan.strategy, (f"; {name} does not fit the survivors' memory, "
                                           f"the planner chose {other.plan.strategy}")

    def _budgets(self, name: str, infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``infos`` with each CPU worker's memory budget lowered by the peer copies it
        keeps (its own snapshot and a buddy's: twice its share of the model state under
        ``name``): what the planner counts, for ``auto`` and for an evacuation's survivors."""
        every = getattr(self.cfg, "peer_copies_every", 0)
        if every <= 0 or not infos:
            return [dict(i, rank=r) for r, i in enumerate(infos)]
        from clusters import layout_memory

        n = len(infos)
        params = sum(p.numel() for p in self.probe_model.parameters())
        kind = name if name in _SHARE_BALANCED else "zero3"  # a stage's share is ~1/n too
        m = layout_memory(kind, params, n, bytes_per_param=4, grad_bytes=4, optimizer_bytes=8)
        copies_gb = 2 * (m.params + m.optimizer) / 1e9
        out = []
        for r, i in enumerate(infos):
            i = dict(i, rank=r)
            if i.get("device") == "cpu":
                emu = dict(i.get("emulation") or {})
                base = float(emu.get("memory_gb", 4.0))
                emu["memory_gb"] = max(0.001, base - copies_gb)
                i["emulation"] = emu
            out.append(i)
        return out

    # ------------------------------------------------------------------ speeds

    def balancing(self, group: Any) -> bool:
        if self.cfg.balance == "on":
            return True
        if self.cfg.balance == "off":
            return False
        infos = [w.info for w in group.workers]
        kinds = {(i.get("device_name"), i.get("emulated")) for i in infos}
        return len(kinds) > 1 or any(i.get("emulated") for i in infos)

    def speeds(self, group: Any, force: bool = False) -> list[float]:
        """Measured samples/s of each worker, in rank order: profiled once per worker (or
        taken from the profile cache, keyed by device, emulation, model and batch); ``force``
        measures again (drift checks)."""
        from ..profiles import ProfileCache

        batch = max(1, self.cfg.global_batch_size // max(1, len(group.workers)))
        cache = ProfileCache() if self.cfg.profile_cache else None
        todo = []
        for w in group.workers:
            if w.worker_id in self.speed and not force:
                continue
            key = ProfileCache.key(w.info, self.probe_model, batch)
            hit = cache.get(key) if cache is not None and not force else None
            if hit is not None:
                self.speed[w.worker_id] = hit
                w.info["profiled_samples_per_s"] = hit
            else:
                todo.append((w, key))
        if todo:
            outs = group.profile(batch, workers=[w for w, _ in todo])
            for (w, key), o in zip(todo, outs, strict=True):
                self.speed[w.worker_id] = o["samples_per_s"]
                w.info["profiled_samples_per_s"] = o["samples_per_s"]
                if o.get("as_info"):  # what it measured as (the emulation may change mid-run)
                    w.info.update(o["as_info"])
                    key = ProfileCache.key(w.info, self.probe_model, batch)
                if cache is not None:
                    cache.put(key, o["samples_per_s"])
            self._emit("profiled", "samples/s per worker: " + ", ".join(
                f"{w.worker_id}:{self.speed[w.worker_id]:.0f}" for w in group.workers))
        return [self.speed[w.worker_id] for w in group.workers]

    def rebalanced(self, spec: StrategySpec, step: int, group: Any) -> StrategySpec | None:
        """Every ``rebalance_every`` steps while balancing dp/ZeRO shares: the speeds again,
        and a spec with re-cut shares if they drifted (``rebalance_decision``), else None."""
        from clusters import rebalance_decision

        every = self.cfg.rebalance_every
        if (every <= 0 or step % every or not self.balancing(group)
                or spec.name not in _SHARE_BALANCED):
            return None
        from ..planning import device_hosts, device_kinds

        used = self.used_speeds or [1.0] * spec.world_size
        raw = self.speeds(group, force=True)  # first: it may update the workers' infos
        infos = [w.info for w in group.workers]
        measured = list(equal_within_noise(raw, kinds=device_kinds(infos),
                                           hosts=device_hosts(infos)))
        decision = rebalance_decision(spec.shares, used, measured)
        if not decision.rebalance:
            return None
        self.used_speeds = measured
        self._emit("rebalanced", f"shares {list(spec.shares)} -> {list(decision.shares)}: "
                   f"{decision.reason}", data={"from": list(spec.shares),
                                               "to": list(decision.shares),
                                               "drift": decision.drift, "gain": decision.gain})
        return dataclasses.replace(spec, shares=decision.shares)

    # ------------------------------------------------------------------ applying

    def switch(self, group: Any, target: str, old: StrategySpec, reason: str) -> StrategySpec:
        """Move the live job from ``old`` into strategy ``target`` on the same workers;
        returns the new spec. ``SwitchError`` when it cannot run there (refused, with an
        event) or the move fails (the workers keep ``old``)."""
        spec = self.make(target, len(group.workers), group)
        try:
            self.check(spec)
        except StrategyError as e:
            self._emit("switch_refused", f"{target}: {e}")
            raise SwitchError(f"cannot switch to {target}: {e}") from None
        self.apply(group, spec, old, reason)
        return spec

    def apply(self, group: Any, spec: StrategySpec, old: StrategySpec | None,
              reason: str) -> None:
        """Lay the workers out as ``spec``: the first build (``old`` None: errors propagate
        typed), or a live in-memory switch whose proof is checked (``SwitchError`` when it
        fails or the proof does not hold: the workers kept the old layout)."""
        t0 = time.perf_counter()
        try:
            outs = group.build(spec)
        except SwitchError:
            raise
        except Exception as e:
            if old is None or (isinstance(e, InfrastructureError)
                               and getattr(e, "transport", True)):
                raise  # a worker lost (or the group broken) while switching: recovered
            # (torch.distributed refusing the layout itself, every worker alive, is a
            # refusal: a recovery would switch again into the same refusal)
            raise SwitchError(f"switch to {spec.name} failed: {e}") from None
        dt = time.perf_counter() - t0
        self.apply_s.append(dt)
        if old is None:
            self._emit("layout", f"{_described(spec)} on {spec.world_size} workers, shares "
                       f"{list(spec.shares)} ({dt:.2f}s)",
                       data={"strategy": spec.name, "spec": spec_dict(spec)})
            self._say_exposure(spec, group)
            return
        hashes = {(o["hash_before"], o["hash_after"]) for o in outs}
        same = all(b == a for b, a in hashes) and len({b for b, _ in hashes}) == 1
        mode = outs[0].get("check", "rehash")
        how = {"pieces": "every rank's new pieces bit-equal to it",
               "rehash": "gathered and hashed again"}.get(mode)
        check = ((f"unchanged ({how})" if same else "CHANGED") if how
                 else "not re-checked (switch_check: off)")
        problems = sorted({p for o in outs for p in o.get("problems", [])})
        move = outs[0].get("move", "gather")
        sent = sum(int(o.get("bytes_sent", 0)) for o in outs)
        moved = (f", {megabytes(sent)} MB moved between ranks" if move == "reshard"
                 else ", full state gathered on every rank")
        self._emit("switch", f"{old.name} -> {spec.name} ({reason}) in {dt:.2f}s{moved}, "
                   f"state digest {sorted(hashes)[0][0]} {check}{_within(old, spec)}",
                   data={"from": old.name, "to": spec.name, "reason": reason, "seconds": dt,
                         "shares": list(spec.shares), "stage_split": list(spec.stage_split or ()),
                         "hashes": sorted(hashes), "state_preserved": same, "check": mode,
                         "move": move, "bytes_moved": sent, "problems": problems[:10]})
        if not same:  # the workers kept (or went back to) the old layout
            raise SwitchError(f"state changed during the switch to {spec.name}: "
                              f"{problems[:3] or sorted(hashes)}; the job stays on {old.name}")
        self._say_exposure(spec, group)

    def _say_exposure(self, spec: StrategySpec, group: Any) -> None:
        """An ``unprotected`` event when the job enters a layout in which one lost rank or
        node (of ``group``'s workers) loses state no survivor holds (``unprotected``): the
        recovery then starts over from step 0. Said once per such stretch."""
        exposed = unprotected(spec, self.cfg, [str(w.info.get("node_id", "")) for w in
                                               group.workers])
        if exposed and not self._exposed:
            self._emit("unprotected", f"{spec.name} on {spec.world_size} workers keeps parts "
                       "of the training state on one rank (or one node's ranks) only, and "
                       "this job takes no periodic checkpoint and no peer copy: a lost node "
                       "would send it back to step 0 (or the checkpoint it resumed from). "
                       "Fix: peer_copies_every: 10 (each rank's shard also in a buddy's host "
                       "memory; a loss then re-runs at most 10 steps) or checkpoint_every: N",
                       data={"strategy": spec.name})
        self._exposed = exposed


_OTHER = "change what it names, or choose another strategy"


def _unchained(spec: StrategySpec, model: Any) -> None:
    """A pipeline runs the blocks one after the other: refused (at the start, a
    ``switch_at``, a hand switch, a resize: every layout is ``Layouts.check``ed) for a model
    whose forward the sample check saw differ from that (``planning.chained``). Was: it
    trained another function, silently (found by a new user, session 47)."""
    from ..planning import chained

    if spec.traits.pipeline and not chained(model):
        raise StrategyError(
            "a pipeline runs the model's blocks one after the other, and this model's forward "
            "gives other outputs than that on a sample (a factor, a block applied twice, a "
            "skip around blocks?); make forward(x) the blocks applied in order "
            "(pipeline_blocks), or choose dp, zero1, zero2 or zero3, which run forward as it is")


def _shardable_only(model: Any) -> dict[str, Any]:
    """The planner's options for a model zero3 refuses (``strategies.fsdp.unshardable``): no
    zero3, alone or as a pipeline's dp_mode (its trial was skipped too); else none."""
    from clusters.plan import STRATEGIES
    from strategies.fsdp import unshardable
    from strategies.traits import DP_MODES

    if unshardable(model) is None:
        return {}
    return {"strategies": [s for s in STRATEGIES if s != "zero3"],
            "dp_modes": [m for m in DP_MODES if m != "zero3"]}


def _within(old: StrategySpec, spec: StrategySpec) -> str:
    """A switch within one strategy: what it changed (a new user read "dp -> dp")."""
    if old.name != spec.name:
        return ""
    return f"; now {_described(spec)}" + (f", shares {list(spec.shares)}"
                                          if spec.name != "pipeline" else "")


def _described(spec: StrategySpec) -> str:
    """A layout as the ``layout`` event names it: a pipeline with its degree, schedule,
    micro-batches (they change a BatchNorm's figures), stage split and dp mode."""
    if spec.name != "pipeline":
        return spec.name
    split = list(spec.stage_split) if spec.stage_split else "even"
    return (f"pipeline (pp{spec.pp_degree} {spec.schedule} m={spec.micro_batches}, stage "
            f"split {split}, dp_mode {spec.dp_mode})")


def block_weights(layouts: Layouts, group: Any) -> list[float]:
    """What each block weighs in a pipeline's split: its measured seconds per sample, as
    the start's split used them (``Layouts._block_costs``), else its parameters
    (``planning.param_costs``, as ``speed_stage_split``)."""
    from ..planning import param_costs

    return layouts._block_costs(group) or param_costs(layouts.probe_model)  # noqa: SLF001
