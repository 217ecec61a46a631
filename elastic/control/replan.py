"""The closed loop: the running job's own step timings re-fit the cost model, and at a
configurable cadence (``replan_every``) ``clusters.policy.ReplanPolicy`` decides whether to
keep the layout, switch to a faster plan (``strategy: auto``) or re-cut the shares around a
straggler (share-balanced dp and ZeRO layouts; a pipeline's stage split, its ranks compared
with their stage's figure at the layout's start, ``clusters.refit.StageBaseline``). The decision is an event (``replan``) that
says why, with the numbers; a straggler is named in an event of its own (``straggler``).

``Replanner`` owns the window of the running layout: rank 0's step times and every rank's own
compute (``compute_s``: seconds inside its blocks' forwards, reported with each step's
metrics), the medians of the layouts the job ran before (each a measured point of the
re-fit), and the measured cost of a re-layout. It decides while the segment runs (the
controller's poll), so a decision to keep the layout costs no segment boundary; a change asks
the workers to stop at the next step, and the controller carries the new spec out at that
boundary (``Layouts.apply``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from clusters.measured import Spread, robust
from clusters.plan import Plan
from clusters.policy import (
    KeepPlan,
    LoopMemory,
    RecutShares,
    ReplanObservation,
    ReplanPolicy,
    SwitchPlan,
)
from clusters.rank_compute import moved, rank_points, whole_figures
from clusters.refit import (
    LiveScale,
    RankPoint,
    StageBaseline,
    carried,
    fixed_per_sample,
    plan_key,
    slowness,
    stage_fractions,
)
from strategies import StrategySpec
from strategies.traits import DP_MODES

__all__ = ["Replanner"]

_SHARE_BALANCED = DP_MODES  # layouts whose ranks each run a share of the batch
_WINDOW = 200  # most recent steps of a layout that count
_SKIP = 2  # first steps of a layout left out (warm-up: allocations, caches)


class Replanner:
    """The closed loop of one job (owned by the controller's thread)."""

    def __init__(self, cfg: Any, layouts: Any, emit: Callable[..., Any],
                 policy: ReplanPolicy | None = None) -> None:
        """``layouts``: the job's ``Layouts`` (attached once the controller has built it)."""
        self.cfg = cfg
        self.layouts = layouts
        self._emit = emit
        self.policy = policy or ReplanPolicy()
        self.every = int(cfg.replan_every)
        self._spec: StrategySpec | None = None
        self._start: int | None = None  # the first step of the current layout (or decision)
        self.pending: tuple[StrategySpec, StrategySpec] | None = None  # (from, to)
        self._steps: dict[int, float] = {}  # step -> rank 0's step time, current layout
        self._ranks: dict[int, dict[int, float]] = {}  # rank -> step -> compute s per sample
        self.observed: dict[tuple[Any, ...], tuple[Plan, Spread]] = {}
        # each device's compute at the layouts since (``clusters.refit.RankPoint``): its
        # fixed costs and its work told apart where it ran at several shares
        self._points: dict[str, dict[tuple[Any, ...], RankPoint]] = {}
        self.decisions: list[KeepPlan | SwitchPlan | RecutShares] = []
        self._named: tuple[int, ...] = ()  # the workers the last decision named stragglers
        # how much slower than their peers the last decision found them, and what of that
        # the running layout started with: a pipeline's footing (``StageBaseline``'s
        # ``known``; none in the re-cut that answered them)
        self._slow_by: dict[str, float] = {}
        self._known: dict[str, float] = {}
        self._unapplied: dict[str, float] = {}  # (``clusters.refit.slowness``)
        # what the next decision checks of the last one (as the simulator keeps it), kept
        # only while the layout running is the one that decision asked for (``_expect``)
        self.memory = LoopMemory()
        self._expect: StrategySpec | None = None
        self._last: tuple[Any, str] = (None, "")  # the last decision and the label it ran on
        self._refused: set[str] = set()  # plans the strategy refused to lay out (``refused``)
        self._scale = LiveScale()  # the live per-rank compute on the model's scale
        self._stages = StageBaseline()  # a pipeline's ranks on one footing (stragglers)

    # ------------------------------------------------------------------ feeding

    def active(self, spec: StrategySpec | None) -> bool:
        """Whether the loop runs for ``spec``: ``auto`` (any layout), or a share-balanced
        layout or a pipeline while balancing is not off (stragglers)."""
        if self.every <= 0 or spec is None:
            return False
        return self.cfg.strategy == "auto" or (
            (spec.name in _SHARE_BALANCED or spec.name == "pipeline")
            and self.cfg.balance != "off")

    def change(self, step: int, spec: StrategySpec, group: Any
               ) -> tuple[StrategySpec, str] | None:
        """At a step boundary: re-balanced shares (``Layouts.rebalanced``, re-profiled
        speeds) or the closed loop's pending new plan, with the reason; None to go on."""
        new = self.layouts.rebalanced(spec, step, group)
        pending, self.pending = self.pending, None
        if new is not None:
            return new, "rebalance"
        if pending is not None and pending[0] is spec:  # not overtaken by another change
            return pending[1], "replan"
        return None

    def refused(self, why: str) -> None:
        """The change ``change`` handed over for ``why`` ("replan": the last decision's; a
        re-balance is the layouts') could not be laid out (the strategy
        refused it: a re-cut too small for zero2's micro-batches, say): it is not asked for
        again (its plan leaves the candidates, its re-cut counts as gone back), and nothing
        of it is checked at the next decision. Was: decided again every ``replan_every`` steps, a
        stop and a refused build each time."""
        if why != "replan":
            return
        decision, current = self._last
        if isinstance(decision, RecutShares):
            self.memory.no_recut.add(current)
        elif isinstance(decision, SwitchPlan):  # (a TryPlan too)
            self._refused.add(decision.target)
        self.memory.forget_last()
        self._expect = None

    def poll(self, next_step: int, spec: StrategySpec | None, group: Any) -> bool:
        """While a segment runs: every ``replan_every`` steps of the current layout, the
        policy's decision on its window. True when a change is pending: the caller asks the
        workers to stop at the next step, and ``change`` hands it over at that boundary."""
        if self.pending is not None and self.pending[0] is not spec:
            self.pending = None  # another change came first (a switch_at): it is void
        if spec is None or not self.active(spec) or self.pending is not None:
            return False
        if spec is not self._spec or self._start is None:
            return False
        if next_step - self._start < self.every or next_step >= self.cfg.max_steps:
            return False
        new = self.decide(next_step, spec, group)
        if new is None:
            return False
        self.pending = (spec, new)
        return True

    def on_metric(self, m: dict[str, Any], spec: StrategySpec | None) -> None:
        """One drained metric of one rank (``StepLog.ingest``'s ``on_metric``)."""
        if spec is None:
            return
        if spec is not self._spec:
            self._new_layout(spec)
        step, rank = int(m["step"]), int(m.get("rank", 0))
        if self._start is None:
            self._start = step
        if rank == 0 and m.get("step_time"):
            self._steps[step] = float(m["step_time"])
            self._trim(self._steps)
        c, n = m.get("compute_s"), self._samples(spec, rank, m)
        if c and n:
            self._trim(d := self._ranks.setdefault(rank, {}))
            d[step] = float(c) / n

    def _trim(self, d: dict[int, float]) -> None:
        """Keep what a decision reads of a layout's steps: its first (the ranks' footing)
        and its last (the window, the ranks' span), pruned once they double (was every step
        of the layout, sorted at each decision: ~8M entries at 1M steps on 8 ranks)."""
        head, tail = _SKIP + self._recent(), max(_WINDOW, self._recent())
        if len(d) > 2 * (head + tail):
            keys = sorted(d)
            for k in keys[head:-tail]:
                del d[k]

    def _samples(self, spec: StrategySpec, rank: int, m: dict[str, Any]) -> int:
        """Samples that went through this rank's blocks in the step: its share, or for a
        pipeline stage the whole replica's batch."""
        if spec.name != "pipeline":
            return int(m.get("samples") or 0)
        d = spec.world_size // spec.pp_degree
        j = rank % d
        return sum(spec.shares[s * d + j] for s in range(spec.pp_degree))

    def _new_layout(self, spec: StrategySpec) -> None:
        """A new layout runs: keep the last one's median as a measured point, start a new
        window. One the last decision did not ask for (a user's switch, a node loss, a
        re-balance that took over) is no try and no re-cut of it."""
        asked = self._expect is not None and _same(spec, self._expect)
        if not asked:
            self.memory.forget_last()
        self._expect = None
        # the stragglers known (``refit.carried``)
        self._known, self._unapplied = carried(
            self._slow_by, asked and isinstance(self._last[0], RecutShares),
            spec.name == "pipeline")
        if self._spec is not None and spec.world_size != self._spec.world_size:
            # another world (a node lost or joined): the figures were of other devices; the
            # host's drift is the host's
            self.observed.clear()
            self._points.clear()
            self.memory = self.memory.new_world()
        elif self._spec is not None and self.layouts.ids:
            self._remember(self._spec)
        self._spec = spec
        self._start = None
        self._steps, self._ranks = {}, {}
        self._stages = StageBaseline()  # (its first window is the ranks' footing)

    def _window(self) -> list[float]:
        steps = sorted(self._steps)[_SKIP:][-_WINDOW:]
        return [self._steps[s] for s in steps]

    def _remember(self, spec: StrategySpec) -> None:
        from ..planning import spec_plan

        times = self._window()
        if self._named:  # a straggler named: the span the ranks' evidence covers (the whole
            times = times[-self._recent():]  # window holds steps from before the rank slowed)
        if len(times) >= self.policy.min_steps:
            p = spec_plan(spec, self.layouts.ids, self.layouts.probe_model)
            earlier = self.observed.get(plan_key(p))
            self.observed[plan_key(p)] = (p, robust(times))
            self.memory.kept(earlier[1] if earlier else None, self.observed[plan_key(p)][1])
            # one figure per label, the last it ran (a re-cut supersedes the shares it left:
            # the way back from a try went to dp's old [32, 32, 32], the straggler's share
            # whole, on the figure of them taken right after it slowed)
            self.observed = {k: v for k, v in self.observed.items()
                             if v[0].label != p.label or k == plan_key(p)}

    # ------------------------------------------------------------------ deciding

    def decide(self, step: int, spec: StrategySpec, group: Any) -> StrategySpec | None:
        """The policy's decision on the current window at ``step`` (an event says it); the
        spec to change to, or None. Too short a window decides nothing (and says nothing)."""
        times = self._window()
        if len(times) < self.policy.min_steps:
            return None
        self._start = step  # the next decision after another replan_every steps
        figs = self._figures(spec, group)
        slow = self.policy.slower(figs.rank_s, figs.rel, spec.name == "pipeline")
        ids = [group.workers[r].worker_id for r in slow]
        if not set(ids) <= set(self._named) or self._moved(figs, slow):  # a worker newly
            self._forget_others(figs.current)  # slower, or a straggler that slowed further
            # (or recovered) where it ran before: every other layout's figure is of before
        obs, plans, parts = self._observe(step, times, figs, group, slow)
        if self._refused:  # plans the strategy refused to lay out: never decided again
            obs = dataclasses.replace(obs, candidates=tuple(
                c for c in obs.candidates if c[0] not in self._refused or c[0] == obs.current),
                untried=tuple(u for u in obs.untried if u not in self._refused))
        decision = self.policy.decide(obs)
        self.memory.after(decision, obs.current, obs.shares,  # (a pipeline's: its split)
                          robust(times[-self.every:]).median)
        self.decisions.append(decision)
        self._last = (decision, obs.current)
        self._slow_by = slowness(figs.rank_s, slow, [w.worker_id for w in group.workers],
                                 self._unapplied, 1 + self.policy.straggler)
        kind = type(decision).__name__
        data = {"decision": kind, "current": obs.current, "step_s": obs.step_s,
                "step_sd": obs.step_sd, "steps": obs.steps, "remaining": obs.remaining,
                "switch_s": obs.switch_s, "candidates": [list(c) for c in obs.candidates[:8]],
                "rank_s_per_sample": list(obs.rank_s), "shares": list(obs.shares),
                "recut": list(obs.recut), "cut": obs.cut, **parts}
        said = f"{kind}: {decision.reason}"
        if isinstance(decision, SwitchPlan):  # where it goes: its shares, or its split
            from ..planning import plan_spec

            to = plans[decision.target]  # its shares per rank, as its spec and switch say
            data["to"] = {"label": decision.target, "shares": list(plan_spec(to).shares),
                          "stage_split": list(to.stage_split)}
        self._emit("replan", said, data=data, step=step)
        named, self._named = self._named, tuple(ids)
        if slow and tuple(ids) != named:  # named once while it stays one (by worker: a rank
            # number may be another worker's after a change)
            self._emit("straggler", f"rank(s) {list(slow)} (workers {ids}) compute "
                       + _figures(obs, slow, spec.name == "pipeline"),
                       data={"ranks": list(slow), "workers": ids,
                             "rank_s_per_sample": list(obs.rank_s)}, step=step)
        if isinstance(decision, SwitchPlan):
            from ..planning import plan_spec

            new = plan_spec(plans[decision.target])
            self._expect = dataclasses.replace(
                new, options=new.options.over(self.cfg.strategy_options()))
            return self._expect
        if isinstance(decision, RecutShares) and decision.cut == "stage split":
            self._expect = dataclasses.replace(spec, stage_split=decision.shares)
            return self._expect
        if isinstance(decision, RecutShares):
            self._expect = dataclasses.replace(spec, shares=decision.shares)
            return self._expect
        return None

    def _figures(self, spec: StrategySpec, group: Any) -> _Figures:
        """The running plan and each rank's compute per sample over the last steps: on the
        model's scale (``LiveScale``) where a model was planned; a pipeline's as each
        rank's ratio to its stage at the layout's start (``StageBaseline``), its stages'
        own figures beside them."""
        from ..planning import spec_plan

        ranks = sorted(self._ranks)
        # the ranks as they are now: the last replan_every steps (a straggler that appears
        # after a long window shows at the next decision); and at the layout's start, its
        # first steps, what fixes the scale and a pipeline's footing whenever the first
        # decision comes (it waits for the drained metrics and the controller's poll)
        frac = self._forward_fraction()
        seq = [[self._ranks[r][k] for k in sorted(self._ranks[r])] for r in ranks]
        per_rank = [robust(xs[_SKIP:][-self._recent():] or xs) for xs in seq]
        full = len(ranks) == spec.world_size
        rank_s = tuple(s.median / frac for s in per_rank) if full else ()
        first = tuple(robust(xs[_SKIP:][:self._recent()] or xs).median / frac
                      for xs in seq) if full else ()
        rel = tuple(s.rel for s in per_rank) if full else ()
        lay = self.layouts
        planned = lay.measured is not None and len(lay.ids) == spec.world_size
        ids = lay.ids if planned else [str(r) for r in range(spec.world_size)]
        current = spec_plan(spec, ids, lay.probe_model)
        mm = lay.measured if planned else None
        key = (spec.name, spec.pp_degree, spec.dp_mode, tuple(ids))  # (kept across re-splits)
        if mm is not None and rank_s:  # on the model's scale, fixed at a layout's first
            # steps; a pipeline's stages on that of the devices' whole-model figures
            # (``stage_fractions``), its factor kept across re-splits
            fr = (stage_fractions(current, mm.profile, lay.cluster) if current.is_pipeline
                  else (1.0,) * len(first))
            k = self._scale.factor(  # (a pipeline's ranks compared within a stage)
                key, [t / f for t, f in zip(first, fr, strict=True)], ids, mm.model,
                fixed_per_sample(current, mm.model, mm.profile, lay.cluster),
                [current.coords(r)[0] for r in range(len(ids))])
            rank_s, first = tuple(t * k for t in rank_s), tuple(t * k for t in first)
        if current.is_pipeline and rank_s:  # the stragglers known, and the ranks already
            # slow against the model in the layout's first window (none named before it)
            apart = self._scale.apart(key)
            known = [max(self._known.get(w.worker_id, 1.0), apart.get(r, 1.0))
                     for r, w in enumerate(group.workers)]
            return _Figures(current, mm, self._stages(current, rank_s, first, known), rel,
                            rank_s)
        return _Figures(current, mm, rank_s, rel, ())

    def _observe(self, step: int, times: list[float], figs: _Figures, group: Any,
                 slow: tuple[int, ...]
                 ) -> tuple[ReplanObservation, dict[str, Plan], dict[str, Any]]:
        """The observation for the policy (``clusters.refit.observe``, as the simulator
        builds it), the candidate plans by label, and the re-fit's figures for the event.
        ``slow``: the ranks named stragglers (then the re-fit's point of this layout is the
        span the ranks' figures cover, and their fixed costs and work may be fitted apart)."""
        from clusters.refit import Observed, observe

        from .layouts import block_weights

        lay, current, mm = self.layouts, figs.current, figs.mm
        switch_s = max(lay.apply_s[1:], default=2 * max(lay.apply_s, default=0.5))
        earlier = self.observed.get(plan_key(current))
        self.memory.note_window(times, self.policy.min_steps, earlier[1] if earlier else None,
                                recent=self.every)
        mem = self.memory.observe_args(current.label, current.stage_split)
        key = plan_key(current)
        mem["recut"] = mem["recut"] and self.cfg.balance != "off"
        view = observe(  # without a planned model: the window and the ranks' compute only
            model=mm.model if mm else None, profile=mm.profile if mm else None,
            cluster=lay.cluster if mm else None,
            global_batch=self.cfg.global_batch_size, current=current, step=robust(times),
            observed=[Observed(p, sp) for p, sp in self.observed.values()],
            remaining=max(0, self.cfg.max_steps - step), switch_s=switch_s,
            rank_s=figs.rank_s, rank_rel_sd=figs.rel,
            kinds=dict(zip(current.devices, lay.kinds, strict=False)),
            replan=self.cfg.strategy == "auto" and mm is not None, stage_s=figs.stage_s,
            rank_order=True,
            block_weights=block_weights(lay, group) if figs.stage_s else (),
            recent=robust(times[-self._recent():]) if slow else None,
            stragglers=[current.devices[r] for r in slow], least_gain=self.policy.min_gain,
            points={d: [p for k, p in by.items() if k != key]
                    for d, by in self._points.items()}, **mem)
        for d, pt in view.points.items():  # this window's, in place of the layout's last
            self._points.setdefault(d, {})[key] = pt
        parts: dict[str, Any] = {}
        if view.model is not None:
            parts = {"step_overhead_s": view.model.step_overhead,
                     "observed": sorted({p.label for p, _ in self.observed.values()}
                                        | {current.label})}
        return view.obs, dict(view.plans), parts

    def _moved(self, figs: _Figures, slow: tuple[int, ...]) -> bool:
        """Whether a straggler's compute moved (``rank_compute.moved``) since its last window
        at this layout (was: a rank that slowed 2x, was re-cut, then slowed 5x more, kept the
        layouts' figures of before: dp at [32, 32, 32] "measured earlier 12.7 ms/step" was
        switched to, and ran at 44.8)."""
        mm, cur = figs.mm, figs.current
        if mm is None or not slow:
            return False
        whole = whole_figures(cur, mm.profile, self.layouts.cluster, figs.rank_s, figs.stage_s)
        if whole is None:
            return False
        now = rank_points(cur, mm.model, mm.profile, self.layouts.cluster, whole)
        key = plan_key(cur)
        return any(moved(self._points.get(cur.devices[r], {}).get(key),
                         now.get(cur.devices[r])) for r in slow)

    def _forget_others(self, current: Plan) -> None:
        """Drop the figures of the layouts that ran before ``current`` (and what the last
        decision would check against them)."""
        self.observed = {k: v for k, v in self.observed.items() if k == plan_key(current)}
        self._points = {d: {k: p for k, p in by.items() if k == plan_key(current)}
                        for d, by in self._points.items()}
        self.memory.forget_last()

    def _recent(self) -> int:
        """The steps the ranks' figures cover (``replan_every``, at least the policy's least)."""
        return max(self.every, self.policy.min_steps)

    def _forward_fraction(self) -> float:
        """Forward's part of forward+backward, as the profiler measured it (else 1/3)."""
        mm = self.layouts.measured
        frac = getattr(mm, "spreads", {}).get("forward_fraction") if mm is not None else None
        return float(frac) if frac else 1.0 / 3.0


class _Figures(NamedTuple):
    """The running plan, its planned model (None: none) and the ranks' figures
    (``Replanner._figures``)."""

    current: Plan
    mm: Any
    rank_s: tuple[float, ...]
    rel: tuple[float, ...]
    stage_s: tuple[float, ...]


def _same(a: StrategySpec, b: StrategySpec) -> bool:
    """Whether ``a`` is the layout ``b`` asked for (options aside)."""
    return a.stage_split == b.stage_split and (a.name, a.world_size, tuple(a.shares), a.pp_degree, a.micro_batches,
                      a.schedule, a.dp_mode) == (b.name, b.world_size, tuple(b.shares),
                                                 b.pp_degree, b.micro_batches, b.schedule,
                                                 b.dp_mode)


def _figures(obs: ReplanObservation, slow: tuple[int, ...], pipeline: bool) -> str:
    """The straggler event's figures: seconds per sample, or for a pipeline (whose stages do
    different work) each rank's compute over its stage's at the layout's start."""
    if pipeline:
        return (", ".join(f"{obs.rank_s[r]:.2f}x" for r in slow) + " their stage's figure at "
                "the layout's start, peers " + ", ".join(
                    f"{t:.2f}x" for i, t in enumerate(obs.rank_s) if i not in slow))
    return (", ".join(f"{obs.rank_s[r] * 1e3:.2f}" for r in slow) + " ms/sample against "
            "peers' " + ", ".join(f"{t * 1e3:.2f}" for i, t in enumerate(obs.rank_s)
                                  if i not in slow) + " ms/sample")

