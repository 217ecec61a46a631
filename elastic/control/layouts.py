"""The controller's layouts: the spec for a strategy on the workers there are (balanced
shares, speed-aware stage splits, the planner for ``auto``), re-balancing, and laying the
workers out as a spec (the first layout, or a live switch whose proof it checks).

``Layouts`` owns the measured speeds (profiled once per worker, cached per device, model and
batch) and the speeds the current shares follow.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from strategies import StrategyError, StrategySpec
from strategies import get as get_strategy
from strategies.traits import DP_MODES, TRAITS, traits_of

from ..data import even_shares
from ..errors import ConfigError, SwitchError
from .checkpoints import spec_dict

__all__ = ["Layouts"]

_SHARE_BALANCED = DP_MODES  # layouts whose ranks each run a share of the batch


class Layouts:
    """Choosing and applying layouts for one job (``probe_model``: the job's model built once
    on the driver, for validation and planning)."""

    def __init__(self, cfg: Any, probe_model: Any, emit: Callable[..., Any]) -> None:
        self.cfg = cfg
        self.probe_model = probe_model
        self._emit = emit
        self.speed: dict[int, float] = {}  # worker_id -> measured samples/s
        self.used_speeds: list[float] | None = None  # the speeds the current shares follow

    # ------------------------------------------------------------------ specs

    def make(self, name: str, world: int, group: Any = None) -> StrategySpec:
        """The layout for ``name`` on ``world`` workers, carrying the job's settings every
        layout applies (clipping, precision, micro-batch size), so validating it validates
        them too. With the live ``group`` of that size, shares follow measured speeds when
        balancing and ``auto`` asks the planner."""
        spec = self._plan(name, world, group)
        return dataclasses.replace(spec, options=spec.options.over(self.cfg.strategy_options()))

    def _plan(self, name: str, world: int, group: Any) -> StrategySpec:
        from ..planning import auto_spec, balanced_shares, speed_stage_split

        cfg = self.cfg
        g = cfg.global_batch_size
        placed = group is not None and len(group.workers) == world
        if name == "auto":
            if not placed:  # before placement: validated again once workers exist
                return StrategySpec("dp", world, even_shares(g, world))
            speeds = self.speeds(group)
            details, links = self._measure(group)
            spec, why = auto_spec(self.probe_model, cfg.optimizer,
                                  [w.info for w in group.workers], speeds, g, details=details,
                                  links=links, precision=cfg.precision)
            self._emit("plan", why.splitlines()[0], data={"explanation": why,
                                                          "speeds": speeds, "links": links})
            return spec
        pp = cfg.pp_degree
        pipeline = name in TRAITS and TRAITS[name].pipeline
        if pipeline and pp == 1:
            pp = world
        shares = even_shares(g, world)
        split = None
        if placed and self.balancing(group):
            speeds = self.speeds(group)
            if name in _SHARE_BALANCED:
                shares = balanced_shares(g, speeds)
                self.used_speeds = speeds
            elif pipeline and cfg.schedule != "interleaved" and world % pp == 0:
                d = world // pp
                try:
                    split = speed_stage_split(self.probe_model,
                                              [min(speeds[s * d:(s + 1) * d]) for s in range(pp)])
                except Exception:  # noqa: BLE001 - fewer blocks than stages: validate says so
                    split = None
        return StrategySpec(name=name, world_size=world, shares=shares, pp_degree=pp,
                            micro_batches=cfg.micro_batches, schedule=cfg.schedule,
                            dp_mode=cfg.dp_mode, stage_split=split)

    def check(self, spec: StrategySpec) -> None:
        """``StrategyError`` if ``spec`` cannot run on the job's model."""
        get_strategy(spec.name).validate(spec, self.probe_model)

    def validate(self, spec: StrategySpec, field_name: str) -> None:
        """``ConfigError`` naming ``field_name`` if ``spec`` cannot run."""
        try:
            self.check(spec)
        except StrategyError as e:
            raise ConfigError(field_name, f"{spec.name} cannot run here: {e}",
                              "choose another strategy, world size or batch settings") from None

    def fit(self, name: str, world: int, group: Any) -> StrategySpec:
        """A valid layout for ``name`` on ``world`` workers after a membership change: the
        same strategy if it can run there (a pipeline keeps its degree when it divides the
        world, else takes the nearest degree that does), else the planner's choice."""
        first = self.make(name, world, group)
        candidates = [first]
        if traits_of(name).pipeline:
            degrees = sorted((d for d in range(2, world + 1) if world % d == 0),
                             key=lambda d: (abs(d - first.pp_degree), d))
            candidates += [dataclasses.replace(first, pp_degree=d) for d in degrees]
        for spec in candidates:
            try:
                self.check(spec)
            except StrategyError:
                continue
            if spec is not first:
                self._emit("replanned", f"{name} with pp_degree {spec.pp_degree} on {world} "
                           f"workers (pp_degree {first.pp_degree} does not fit)")
            return spec
        spec = self.make("auto", world, group)
        self._emit("replanned", f"{name} cannot run on {world} workers; the planner chose "
                   f"{spec.name}")
        return spec

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
                if cache is not None:
                    cache.put(key, o["samples_per_s"])
            self._emit("profiled", "samples/s per worker: " + ", ".join(
                f"{w.worker_id}:{self.speed[w.worker_id]:.0f}" for w in group.workers))
        return [self.speed[w.worker_id] for w in group.workers]

    def _measure(self, group: Any) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
        """For the planner: per-block timings and activation sizes on every worker, and the
        all-reduce time between them for a few sizes (alpha-beta fit of the live links)."""
        batch = max(1, self.cfg.global_batch_size // max(1, len(group.workers)))
        details = group.profile(batch, True)
        links: list[tuple[int, float]] = []
        if len(group.workers) > 1:
            sizes = [4 << 10, 256 << 10, 4 << 20]
            outs = group.measure_collectives(sizes)
            links = [(n, max(o[i][1] for o in outs)) for i, (n, _) in enumerate(outs[0])]
            self._emit("links", "all-reduce " + ", ".join(
                f"{n >> 10} KiB {t * 1e3:.2f} ms" for n, t in links), data={"points": links})
        return details, links

    def rebalanced(self, spec: StrategySpec, step: int, group: Any) -> StrategySpec | None:
        """Every ``rebalance_every`` steps while balancing dp/ZeRO shares: measure the speeds
        again; a spec with re-cut shares if they drifted (``clusters.rebalance_decision``),
        else None."""
        from clusters import rebalance_decision

        every = self.cfg.rebalance_every
        if (every <= 0 or step % every or not self.balancing(group)
                or spec.name not in _SHARE_BALANCED):
            return None
        used = self.used_speeds or [1.0] * spec.world_size
        measured = self.speeds(group, force=True)
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
            if old is None:
                raise
            raise SwitchError(f"switch to {spec.name} failed: {e}") from None
        dt = time.perf_counter() - t0
        if old is None:
            self._emit("layout", f"{spec.name} on {spec.world_size} workers, shares "
                       f"{list(spec.shares)} ({dt:.2f}s)",
                       data={"strategy": spec.name, "spec": spec_dict(spec)})
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
        moved = (f", {sent / 1e6:.1f} MB moved between ranks" if move == "reshard"
                 else ", full state gathered on every rank")
        self._emit("switch", f"{old.name} -> {spec.name} ({reason}) in {dt:.2f}s{moved}, "
                   f"state digest {sorted(hashes)[0][0]} {check}",
                   data={"from": old.name, "to": spec.name, "reason": reason, "seconds": dt,
                         "hashes": sorted(hashes), "state_preserved": same, "check": mode,
                         "move": move, "bytes_moved": sent, "problems": problems[:10]})
        if not same:  # the workers kept (or went back to) the old layout
            raise SwitchError(f"state changed during the switch to {spec.name}: "
                              f"{problems[:3] or sorted(hashes)}; the job stays on {old.name}")
