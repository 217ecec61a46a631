"""The controller's layouts: the spec for a strategy on the workers there are (balanced
shares, speed-aware stage splits, the planner for ``auto``), re-balancing, and laying the job
out or switching it live."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from strategies import StrategyError, StrategySpec
from strategies import get as get_strategy

from ._ctl_base import (
    ControllerBase,
    ControllerState,
    spec_dict,
    unwrap,
)
from .data import even_shares
from .errors import ConfigError, SwitchError

__all__ = ["LayoutMixin"]


class LayoutMixin(ControllerBase):
    """Choosing and applying layouts."""

    def _make_spec(self, name: str, world: int) -> StrategySpec:
        """The layout for ``name`` on ``world`` workers: batch shares follow measured speeds
        when balancing (dp and ZeRO), pipeline stages follow layer costs and stage speeds,
        and ``auto`` asks the planner. It carries the job's settings that every layout
        applies (``JobConfig.strategy_options``: clipping, precision, micro-batch size), so
        validating it validates them too."""
        spec = self._plan_spec(name, world)
        return dataclasses.replace(spec, options=spec.options.over(self.cfg.strategy_options()))

    def _plan_spec(self, name: str, world: int) -> StrategySpec:
        from .planning import auto_spec, balanced_shares, speed_stage_split

        cfg = self.cfg
        g = cfg.global_batch_size
        placed = bool(self.workers) and len(self.workers) == world
        if name == "auto":
            if not placed:  # before placement: validated again once workers exist
                return StrategySpec("dp", world, even_shares(g, world))
            speeds = self._speeds()
            details, links = self._measure_details()
            spec, why = auto_spec(self._probe_model, cfg.optimizer, [w.info for w in self.workers],
                                  speeds, g, details=details, links=links,
                                  precision=cfg.precision)
            self._emit("plan", why.splitlines()[0], data={"explanation": why,
                                                          "speeds": speeds, "links": links})
            return spec
        pp = cfg.pp_degree
        if name == "pipeline" and pp == 1:
            pp = world
        shares = even_shares(g, world)
        split = None
        if placed and self._balancing():
            speeds = self._speeds()
            if name in ("dp", "zero1", "zero2", "zero3"):
                shares = balanced_shares(g, speeds)
                self._used_speeds = speeds
            elif name == "pipeline" and cfg.schedule != "interleaved" and world % pp == 0:
                d = world // pp
                try:
                    split = speed_stage_split(self._probe_model,
                                              [min(speeds[s * d:(s + 1) * d]) for s in range(pp)])
                except Exception:  # fewer blocks than stages: the strategy's check says so
                    split = None
        return StrategySpec(
            name=name, world_size=world, shares=shares, pp_degree=pp,
            micro_batches=cfg.micro_batches, schedule=cfg.schedule, dp_mode=cfg.dp_mode,
            stage_split=split,
        )

    def _fit_spec(self, name: str, world: int) -> StrategySpec:
        """A valid layout for ``name`` on ``world`` workers after a membership change: the
        same strategy if it can run there (a pipeline keeps its degree when it divides the
        world, else takes the nearest degree that does), else the planner's choice."""
        candidates = [self._make_spec(name, world)]
        if name == "pipeline":
            want = candidates[0].pp_degree
            degrees = sorted((d for d in range(2, world + 1) if world % d == 0),
                             key=lambda d: (abs(d - want), d))
            candidates += [dataclasses.replace(candidates[0], pp_degree=d) for d in degrees]
        for spec in candidates:
            try:
                get_strategy(spec.name).validate(spec, self._probe_model)
                if spec is not candidates[0]:
                    self._emit("replanned", f"{name} with pp_degree {spec.pp_degree} on {world} "
                               f"workers (pp_degree {candidates[0].pp_degree} does not fit)")
                return spec
            except StrategyError:
                continue
        spec = self._make_spec("auto", world)
        self._emit("replanned", f"{name} cannot run on {world} workers; the planner chose "
                   f"{spec.name}")
        return spec

    def _balancing(self) -> bool:
        if self.cfg.balance == "on":
            return True
        if self.cfg.balance == "off":
            return False
        kinds = {(w.info.get("device_name"), w.info.get("emulated")) for w in self.workers}
        return len(kinds) > 1 or any(w.info.get("emulated") for w in self.workers)

    def _speeds(self, force: bool = False) -> list[float]:
        """Measured samples/s of each worker, in rank order. Profiled once per worker (or
        taken from the profile cache, keyed by device, emulation, model and batch); ``force``
        measures again (drift checks)."""
        import ray

        from .profiles import ProfileCache

        batch = max(1, self.cfg.global_batch_size // max(1, len(self.workers)))
        cache = ProfileCache() if self.cfg.profile_cache else None
        todo = []
        for w in self.workers:
            if w.worker_id in self._speed and not force:
                continue
            key = ProfileCache.key(w.info, self._probe_model, batch)
            hit = cache.get(key) if cache is not None and not force else None
            if hit is not None:
                self._speed[w.worker_id] = hit
                w.info["profiled_samples_per_s"] = hit
            else:
                todo.append((w, key))
        if todo:
            outs = ray.get([w.handle.profile.remote(batch) for w, _ in todo])
            for (w, key), o in zip(todo, outs, strict=True):
                self._speed[w.worker_id] = o["samples_per_s"]
                w.info["profiled_samples_per_s"] = o["samples_per_s"]
                if cache is not None:
                    cache.put(key, o["samples_per_s"])
            self._emit("profiled", "samples/s per worker: " + ", ".join(
                f"{w.worker_id}:{self._speed[w.worker_id]:.0f}" for w in self.workers))
        return [self._speed[w.worker_id] for w in self.workers]

    def _measure_details(self) -> tuple[list[dict[str, Any]], list[tuple[int, float]]]:
        """For the planner: per-block timings and activation sizes on every worker, and the
        all-reduce time between them for a few sizes (alpha-beta fit of the live links)."""
        import ray

        batch = max(1, self.cfg.global_batch_size // max(1, len(self.workers)))
        details = ray.get([w.handle.profile.remote(batch, True) for w in self.workers])
        links: list[tuple[int, float]] = []
        if len(self.workers) > 1:
            sizes = [4 << 10, 256 << 10, 4 << 20]
            outs = ray.get([w.handle.measure_collectives.remote(sizes) for w in self.workers])
            links = [(n, max(o[i][1] for o in outs)) for i, (n, _) in enumerate(outs[0])]
            self._emit("links", "all-reduce " + ", ".join(
                f"{n >> 10} KiB {t * 1e3:.2f} ms" for n, t in links), data={"points": links})
        return details, links

    def _maybe_rebalance(self) -> None:
        """Every ``rebalance_every`` steps while balancing dp/ZeRO shares: measure the speeds
        again and re-cut the shares if they drifted (``clusters.rebalance_decision``)."""
        from clusters import rebalance_decision

        spec = self.spec
        every = self.cfg.rebalance_every
        if (spec is None or every <= 0 or self.step % every or not self._balancing()
                or spec.name not in ("dp", "zero1", "zero2", "zero3")):
            return
        used = self._used_speeds or [1.0] * spec.world_size
        measured = self._speeds(force=True)
        decision = rebalance_decision(spec.shares, used, measured)
        if not decision.rebalance:
            return
        self._used_speeds = measured
        self._layout(dataclasses.replace(spec, shares=decision.shares),
                     reason=f"rebalance: {decision.reason}")
        self._emit("rebalanced", f"shares {list(spec.shares)} -> {list(decision.shares)}: "
                   f"{decision.reason}", data={"from": list(spec.shares),
                                               "to": list(decision.shares),
                                               "drift": decision.drift, "gain": decision.gain})

    def _validate_spec(self, spec: StrategySpec, field_name: str) -> None:
        try:
            get_strategy(spec.name).validate(spec, self._probe_model)
        except StrategyError as e:
            raise ConfigError(field_name, f"{spec.name} cannot run here: {e}",
                              "choose another strategy, world size or batch settings") from None

    def _layout(self, spec: StrategySpec, reason: str) -> None:
        """Lay the workers out as ``spec`` (first build, or a live in-memory switch)."""
        import ray

        old = self.spec
        first = old is None
        self.state = ControllerState.RUNNING if first else ControllerState.SWITCHING
        t0 = time.perf_counter()
        try:
            outs = ray.get([w.handle.build.remote(spec) for w in self.workers])
        except Exception as e:
            cause = unwrap(e)
            if first:
                raise cause from None
            raise SwitchError(f"switch to {spec.name} failed: {cause}") from None
        dt = time.perf_counter() - t0
        if first:
            self.spec = spec
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
        self._emit("switch", f"{old.name if old else '-'} -> {spec.name} ({reason}) in {dt:.2f}s"
                   f"{moved}, state digest {sorted(hashes)[0][0]} {check}",
                   data={"from": old.name if old else None, "to": spec.name, "reason": reason,
                         "seconds": dt, "hashes": sorted(hashes), "state_preserved": same,
                         "check": mode, "move": move, "bytes_moved": sent,
                         "problems": problems[:10]})
        if not same:  # the workers kept (or went back to) the old layout
            assert old is not None
            raise SwitchError(f"state changed during the switch to {spec.name}: "
                              f"{problems[:3] or sorted(hashes)}; the job stays on {old.name}")
        self.spec = spec

    def switch(self, name: str, reason: str) -> None:
        spec = self._make_spec(name, len(self.workers))
        try:
            get_strategy(name).validate(spec, self._probe_model)
        except StrategyError as e:
            self._emit("switch_refused", f"{name}: {e}")
            raise SwitchError(f"cannot switch to {name}: {e}") from None
        self._layout(spec, reason)
