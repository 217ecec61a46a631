"""The closed loop's policy (re-exported by ``clusters.policy``): while a job runs, keep its
layout, switch to a faster plan, re-cut the shares around a straggler, or try a plan the model
cannot order against the running one. Pure, as every policy there: the live controller
(``elastic.control.replan``) and the simulator (``clusters.sim_replan``) build the same
observation (``clusters.refit.observe``) and carry the decision out."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from .spread import Spread, moved, phase_drift, robust

__all__ = ["ReplanObservation", "KeepPlan", "SwitchPlan", "TryPlan", "RecutShares",
           "ReplanPolicy", "LoopMemory"]


@dataclass(frozen=True)
class ReplanObservation:
    """What the running job measured since its layout started, and what the re-fitted model
    predicts (``clusters.refit``).

    ``current``: the running plan's label; ``step_s`` / ``step_sd`` / ``steps``: its measured
    step time (median, robust standard deviation) over ``steps`` steps. ``candidates``:
    (label, predicted seconds per step) of the other plans, from the re-fitted model.
    ``remaining``: steps left. ``switch_s``: the measured (or estimated) seconds of one
    re-layout. ``rank_s``: each rank's own compute seconds per sample (median over the
    window; empty when not measured) and ``rank_rel_sd`` their relative spreads;
    ``shares``: the running shares; ``recut``: the shares that follow the measured speeds
    (empty when the layout's shares are not cut by speed); ``recut_step_s``: the step the
    model predicts with them. ``cut``: what ``shares`` and ``recut`` cut, "shares" or, for
    a pipeline, "stage split" (blocks per stage; its ``rank_s`` are then each rank's compute
    against its stage's at the layout's first window: stages do different work);
    ``own_split``: the running split is one the loop re-cut (``LoopMemory.resplit``). ``untried``: the labels of candidates that never ran in this
    job and do no more work than another candidate (``plan.more_work``): predicted, not
    measured. ``tried_from``: when the running layout is a ``TryPlan``'s, the label of the
    one it was tried from (its measured figure is among the candidates). ``recut_from`` /
    ``recut_from_s``: when the running shares are a ``RecutShares``' (the decision after it),
    the shares it left and their measured step. ``ran``: the labels among the candidates
    whose figure is their own measured median from an earlier segment; ``stale``: other
    labels whose figure stands on an earlier segment (a prediction scaled by the level of
    another family's layouts that ran); ``switched_from``: the layout the last ``SwitchPlan``
    left (its figure is adjacent to the running one's); ``drift``: how far the job has seen
    a figure move without a change of layout (``LoopMemory.drift``, relative): what a figure
    measured in another phase may be off by. ``notes``: (label, what its plan is beyond its
    label: "at shares [63, 1]") for candidates whose label leaves out what they would run
    (``name``)."""

    current: str
    step_s: float
    step_sd: float
    steps: int
    candidates: tuple[tuple[str, float], ...]
    remaining: int
    switch_s: float
    rank_s: tuple[float, ...] = ()
    rank_rel_sd: tuple[float, ...] = ()
    shares: tuple[int, ...] = ()
    recut: tuple[int, ...] = ()
    recut_step_s: float = 0.0
    untried: tuple[str, ...] = ()
    tried_from: str = ""
    recut_from: tuple[int, ...] = ()
    cut: str = "shares"
    own_split: bool = False
    recut_from_s: float = 0.0
    ran: tuple[str, ...] = ()
    stale: tuple[str, ...] = ()
    switched_from: str = ""
    drift: float = 0.0
    notes: tuple[tuple[str, str], ...] = ()

    def name(self, label: str) -> str:
        """``label`` with its note, as decisions name a candidate: "dp (at shares [63, 1])"."""
        note = dict(self.notes).get(label)
        return f"{label} ({note})" if note else label


@dataclass(frozen=True)
class KeepPlan:
    """Stay on the running layout. ``stragglers``: ranks persistently slower than their peers
    (named even when re-cutting does not pay). ``checking``: after a try that measured
    slower than the layout it left but within the noise, that layout: the next decision,
    on a longer window, checks again."""

    reason: str
    stragglers: tuple[int, ...] = ()
    checking: str = ""


@dataclass(frozen=True)
class SwitchPlan:
    """Switch to the plan labelled ``target``: ``gain_s`` per step over ``remaining`` steps
    against a re-layout of ``cost_s``. ``measured``: the target's figure was its own measured
    one (a way back, a layout that ran earlier), not a prediction."""

    target: str
    gain_s: float
    cost_s: float
    reason: str
    measured: bool = False


@dataclass(frozen=True)
class TryPlan(SwitchPlan):
    """Switch to ``target`` to measure it: a plan predicted close to the running one that
    never ran (``gain_s``: what the model predicts, maybe below 0); the next decision compares
    the two measured figures and switches back when that pays."""


@dataclass(frozen=True)
class RecutShares:
    """Re-cut the shares to ``shares`` (the same layout): ``gain_s`` per step against a
    re-layout of ``cost_s``; ``stragglers`` named. ``back``: the shares a re-cut left, which
    measured faster than the re-cut did (the loop re-cuts this layout no more). ``cut``:
    "shares", or "stage split" for a pipeline (``shares`` are then blocks per stage)."""

    shares: tuple[int, ...]
    stragglers: tuple[int, ...]
    gain_s: float
    cost_s: float
    reason: str
    back: bool = False
    cut: str = "shares"


def peer_median(rank_s: Sequence[float], r: int) -> float:
    """The median of every rank's figure but ``r``'s (0 with no peer): what a straggler is
    measured against (``ReplanPolicy.slower``, ``refit.peer_ratios``)."""
    peers = [t for i, t in enumerate(rank_s) if i != r]
    return statistics.median(peers) if peers else 0.0


@dataclass(frozen=True)
class ReplanPolicy:
    """Act only on what pays: a change of layout (a faster plan, or shares re-cut around a
    straggler) is made when its predicted gain per step times the remaining steps exceeds
    ``margin`` x the measured cost of a re-layout, and the gain per step is at least
    ``min_gain`` of the step and beyond the noise (``z`` standard errors of the measured
    median). A rank is a straggler when its compute per sample exceeds its peers' median by
    more than ``straggler`` (relative) and by ``z`` times its spread. At least ``min_steps``
    measured steps are needed before anything but ``KeepPlan``.

    When nothing pays, a candidate that never ran (``untried``) and is predicted within
    ``explore`` of the running step is tried (``TryPlan``): the model cannot order plans that
    close (on 3 CPU ranks dlrm's zero1 was predicted 1.03-1.04x dp and measured 0.85-0.89x in
    three runs), and a measured figure can. It is tried only where finding a plan ``min_gain``
    faster would pay, over the remaining steps, for going there and back plus a window as
    long as the running one's at up to ``explore`` slower. At the decision after a try, the
    layout it was tried from comes back when it measured faster beyond the noise and the
    switch pays (not held to ``min_gain``: the try was the loop's, not the model's). 0 turns
    it off.

    A switch to a layout that ran earlier, on its measured figure (or a prediction scaled
    by earlier segments' level), must also gain more than that figure may have moved since
    (``drift`` x the step): on 3 CPU ranks gpt went zero1 (120 ms) -> dp (113 ms, measured
    100 steps before) -> dp measured 138 -> zero1, each time comparing two phases of the
    host, not two layouts. The way back after a try, and to the layout the last switch
    left, is exempt: the two figures are adjacent. Every candidate is weighed against its
    own bar; the largest gain that clears it is taken, save that a switch must beat the
    re-cut on offer (paying or not) by the same bar, and a try be near the re-cut's step:
    the re-cut keeps the layout, and while a straggler is named the share-balanced
    candidates are judged at its shares (``refit.observe``), so their gain is mostly the
    re-cut's, and a switch 3 % faster than the re-cut is noise, not a reason to change
    strategy."""

    min_steps: int = 10
    min_gain: float = 0.05
    margin: float = 1.0
    straggler: float = 0.1
    z: float = 3.0
    explore: float = 0.10

    def stragglers(self, obs: ReplanObservation) -> tuple[int, ...]:
        """``slower`` of the observation's ranks (a pipeline's relative to its start)."""
        return self.slower(obs.rank_s, obs.rank_rel_sd, obs.cut == "stage split")

    def slower(self, rank_s: Sequence[float], rank_rel_sd: Sequence[float] = (),
               relative: bool = False) -> tuple[int, ...]:
        """Ranks slower than their peers' median (see the class docstring); with
        ``relative`` figures (a pipeline's: each rank against its stage at the layout's
        start) also slower than at its own start, so that peers that did not change are not
        named when a straggler recovered. Needs only the ranks' figures: the loop asks it
        before it builds the observation (which depends on it)."""
        n = len(rank_s)
        if n < 2:
            return ()
        out = []
        for r, t in enumerate(rank_s):
            ref = peer_median(rank_s, r)
            rel = rank_rel_sd[r] if r < len(rank_rel_sd) else 0.0
            bar = 1 + max(self.straggler, self.z * rel)
            if ref > 0 and t > ref * bar and (not relative or t > bar):
                out.append(r)
        return tuple(out)

    def decide(self, obs: ReplanObservation) -> KeepPlan | SwitchPlan | RecutShares:
        if obs.steps < self.min_steps:
            return KeepPlan(f"{obs.steps} steps measured on {obs.current}, "
                            f"{self.min_steps} needed")
        slow = self.stragglers(obs)
        named = (f"; rank{'s' if len(slow) > 1 else ''} {', '.join(map(str, slow))} "
                 f"slower than {'their' if len(slow) > 1 else 'its'} peers") if slow else ""
        noise = self.z * 1.2533 * obs.step_sd / max(1, obs.steps) ** 0.5
        cost = self.margin * obs.switch_s

        def pays(gain: float) -> bool:
            return (gain > noise and gain >= self.min_gain * obs.step_s
                    and gain * obs.remaining > cost)

        if obs.recut_from and obs.recut_from != obs.shares and obs.recut_from_s > 0:
            gain = obs.step_s - obs.recut_from_s  # a re-cut that measured slower goes back
            if gain > noise and gain * obs.remaining > cost:
                return RecutShares(
                    obs.recut_from, slow, gain, obs.switch_s,
                    f"the re-cut to {list(obs.shares)} measured {obs.step_s * 1e3:.1f} ms/step "
                    f"(sd {obs.step_sd * 1e3:.1f} ms, {obs.steps} steps) against "
                    f"{list(obs.recut_from)}'s {obs.recut_from_s * 1e3:.1f} ms: back, "
                    f"{gain * 1e3:.1f} ms x {obs.remaining} steps = "
                    f"{gain * obs.remaining:.1f} s > re-layout {obs.switch_s:.2f} s{named}",
                    back=True, cut=obs.cut)
        options: list[SwitchPlan | RecutShares] = []
        best = min(obs.candidates, key=lambda c: c[1], default=None)
        back = dict(obs.candidates).get(obs.tried_from) if obs.tried_from else None
        if back is not None:  # measured against measured, whatever the model predicts
            gain = obs.step_s - back
            if gain > noise and gain * obs.remaining > cost:
                return SwitchPlan(
                    obs.tried_from, gain, obs.switch_s, measured=True, reason=(
                    f"the try of {obs.current} measured {obs.step_s * 1e3:.1f} ms/step (sd "
                    f"{obs.step_sd * 1e3:.1f} ms, {obs.steps} steps) against "
                    f"{obs.tried_from}'s {back * 1e3:.1f} ms: back, {gain * 1e3:.1f} ms x "
                    f"{obs.remaining} steps = {gain * obs.remaining:.1f} s > switch "
                    f"{obs.switch_s:.2f} s{named}"))
        # slower within the noise: undecided; the next decision checks on more steps
        back_s = back if back is not None else 0.0
        undecided = (obs.tried_from if back is not None and 0 < obs.step_s - back_s <= noise
                     else "")
        old = set(obs.ran) | set(obs.stale)

        def stale(label: str) -> float:  # what an earlier phase may have moved its figure
            return (obs.drift * obs.step_s if label in old and label != obs.switched_from
                    else 0.0)

        passing = [(obs.step_s - t, lab, t) for lab, t in obs.candidates
                   if lab != obs.current and pays(obs.step_s - t)
                   and obs.step_s - t > noise + stale(lab)]
        if passing:
            gain, lab, t = max(passing)
            how = "measured earlier" if lab in obs.ran else "predicted"
            past = f", beyond the host's {obs.drift:.1%} drift" if stale(lab) else ""
            options.append(SwitchPlan(
                lab, gain, obs.switch_s, measured=lab in obs.ran, reason=(
                f"{obs.name(lab)} {how} {t * 1e3:.1f} ms/step against {obs.current}'s "
                f"measured {obs.step_s * 1e3:.1f} ms (sd {obs.step_sd * 1e3:.1f} ms, "
                f"{obs.steps} steps{past}): {gain * 1e3:.1f} ms x {obs.remaining} steps = "
                f"{gain * obs.remaining:.1f} s > switch {obs.switch_s:.2f} s{named}")))
        # re-cut on a straggler's evidence only (shares: a rank the OS starves for a while
        # misled them; a split: blocks' weights measured off misled it), but a split the loop
        # re-cut follows its stages' times (a straggler that recovered leaves no rank slower
        # than its peers, and the split must come back)
        recut_gain = 0.0  # what the re-cut on offer saves, paying or not
        if obs.recut and obs.recut != obs.shares and (slow or obs.own_split):
            gain = recut_gain = obs.step_s - obs.recut_step_s
            if pays(gain):
                options.append(RecutShares(
                    obs.recut, slow, gain, obs.switch_s,
                    f"{obs.cut} {list(obs.shares)} -> {list(obs.recut)}{named}: predicted "
                    f"{obs.recut_step_s * 1e3:.1f} ms/step against {obs.step_s * 1e3:.1f} ms "
                    f"measured, {gain * 1e3:.1f} ms x {obs.remaining} steps = "
                    f"{gain * obs.remaining:.1f} s > re-layout {obs.switch_s:.2f} s",
                    cut=obs.cut))
        # a switch must beat the re-cut on offer (paying or not) by the same bar: the re-cut
        # keeps the layout, and while a straggler is named the share-balanced candidates are
        # judged at its shares (``refit.observe``), their gain mostly the re-cut's
        beaten: SwitchPlan | None = None
        first = options[0] if options else None
        if isinstance(first, SwitchPlan) and recut_gain > 0:
            extra = first.gain_s - recut_gain
            if not (extra > noise and extra >= self.min_gain * obs.recut_step_s
                    and extra * obs.remaining > cost):
                beaten = first
                options.remove(first)
        if options:
            return max(options, key=lambda o: o.gain_s)
        tried = None if undecided or beaten else self._to_try(  # one try at a time, near
            obs, min(obs.step_s, obs.step_s - recut_gain))  # the re-cut's step if offered
        if tried is not None:
            return replace(tried, reason=tried.reason + named)
        def short(gain: float, bar: float = 0.0) -> str:  # why a gain is not taken
            why = [f"{gain * obs.remaining:.1f} s over {obs.remaining} steps does not pay for "
                   f"a re-layout of {obs.switch_s:.2f} s"] if gain * obs.remaining <= cost else []
            if gain <= noise + bar:
                why.append(f"within the noise ({noise * 1e3:.1f} ms" + (
                    f" and the {obs.drift:.1%} the host's phases moved a measured figure: "
                    f"{(noise + bar) * 1e3:.1f} ms" if bar else "") + ")")
            if gain < self.min_gain * obs.step_s:
                why.append(f"under {self.min_gain:.0%} of the step")
            return ", ".join(why) or "not taken"

        if beaten is not None:
            extra = beaten.gain_s - recut_gain
            why = (f"{obs.name(beaten.target)} predicted "
                   f"{(obs.step_s - beaten.gain_s) * 1e3:.1f} ms/step "
                   f"against {obs.current}'s measured {obs.step_s * 1e3:.1f} ms, a gain of "
                   f"{beaten.gain_s * 1e3:.1f} ms of which the {obs.cut} re-cut to "
                   f"{list(obs.recut)} is {recut_gain * 1e3:.1f} ms: the {extra * 1e3:.1f} ms "
                   f"beyond it is under the bar (noise {noise * 1e3:.1f} ms, "
                   f"{self.min_gain:.0%} of the re-cut's step)")
        elif best is None or best[0] == obs.current:
            why = f"{obs.current} is the fastest plan ({obs.step_s * 1e3:.1f} ms/step measured)"
        else:
            gain = obs.step_s - best[1]
            how = "measured earlier" if best[0] in obs.ran else "predicted"
            why = (f"{obs.name(best[0])} {how} {best[1] * 1e3:.1f} ms/step against "
                   f"{obs.current}'s "
                   f"{obs.step_s * 1e3:.1f} ms: a gain of {gain * 1e3:.1f} ms, "
                   + short(gain, stale(best[0])))
        if recut_gain and slow and not any(isinstance(o, RecutShares) for o in options):
            why += (f"; the {obs.cut} re-cut to {list(obs.recut)} predicted "
                    f"{obs.recut_step_s * 1e3:.1f} ms/step: " + short(recut_gain))
        if undecided:
            why += (f"; the try of {obs.current} measured {obs.step_s * 1e3:.1f} ms/step "
                    f"against {undecided}'s {back_s * 1e3:.1f} ms, within the noise "
                    f"({noise * 1e3:.1f} ms): checked again at the next decision")
        return KeepPlan(why + named, slow, checking=undecided)

    def _to_try(self, obs: ReplanObservation, base: float) -> TryPlan | None:
        """The untried candidate predicted fastest, if it is within ``explore`` of ``base``
        (the running step, or the re-cut's on offer) and a plan ``min_gain`` faster would pay
        for trying it."""
        near = [c for c in obs.candidates if c[0] in obs.untried and c[0] != obs.current
                and c[1] <= base * (1 + self.explore)]
        if not near or self.explore <= 0:
            return None
        label, pred = min(near, key=lambda c: c[1])
        cost = self.margin * (2 * obs.switch_s + self.explore * obs.step_s * obs.steps)
        found = self.min_gain * obs.step_s * obs.remaining
        if found <= cost:
            return None
        return TryPlan(label, obs.step_s - pred, obs.switch_s,
                       f"{obs.name(label)} never ran here and is predicted {pred * 1e3:.1f} "
                       "ms/step "
                       f"against {obs.current}'s measured {obs.step_s * 1e3:.1f} ms (within "
                       f"{self.explore:.0%}, closer than the model can order them): trying it; "
                       f"a plan {self.min_gain:.0%} faster would save "
                       f"{found:.1f} s over {obs.remaining} steps > {cost:.1f} s (there and "
                       f"back, and {obs.steps} steps up to {self.explore:.0%} slower)")


@dataclass
class LoopMemory:
    """What the loop's next decision checks of its last one, kept by the live controller
    (``elastic.control.replan``) and the simulator (``clusters.sim_replan``) alike: after a
    ``TryPlan`` the label it left (``tried_from``), after a ``SwitchPlan`` on a prediction the
    label it left (``switched_from``), after a ``RecutShares`` the shares it left and their recent
    median (``recut_from``); for the whole job the labels a try named (``tried``: never
    offered again), those whose re-cut went back (``no_recut``), the pipelines whose split it
    re-cut (``resplit``: their split follows the stages' times), and the host's drift: within
    the steps of each decision (``drifts``) and of a layout between its segments (``moves``),
    the last ``EVIDENCE`` of each. The layouts' figures themselves are the caller's (the
    observed segments it hands ``refit.observe``)."""

    EVIDENCE: ClassVar[int] = 8  # the host's phases change: the recent evidence counts
    TRY_CHECKS: ClassVar[int] = 3  # decisions that check a try measured slower within noise

    tried_from: str = ""
    try_checks: int = 0  # the checks of the try made so far (``TRY_CHECKS`` at most)
    switched_from: str = ""
    recut_from: tuple[tuple[int, ...], float] | None = None
    # (label, split) of the pipelines' splits the loop cut (the label leaves the split out)
    resplit: set[tuple[str, tuple[int, ...]]] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    no_recut: set[str] = field(default_factory=set)
    drifts: list[float] = field(default_factory=list)
    moves: list[float] = field(default_factory=list)
    # the running window's move from its layout's earlier figure (until the segment is kept)
    _move: float | None = field(default=None, init=False, repr=False, compare=False)

    def note_window(self, times: Sequence[float], least: int, earlier: Spread | None = None,
                    recent: int | None = None) -> None:
        """Before a decision: the running window's step times. The two halves of its last
        ``recent`` steps (those since the last decision: a window overlaps the one before;
        ``phase_drift``, each half at least ``least`` steps) say how far the host moved the
        layout's figure beyond the noise; ``earlier``, the same layout's figure from an
        earlier segment (same plan, shares and split), how far the whole window moved from
        it."""
        span = list(times)[-recent:] if recent else list(times)
        if len(span) >= 2 * least:  # a calm span is evidence too
            self.drifts = [*self.drifts, phase_drift(span, least)][-self.EVIDENCE:]
        self._move = moved(earlier, robust(times)) if earlier is not None and times else None

    def kept(self, earlier: Spread | None, step: Spread) -> None:
        """A segment ended and its layout measured ``step``; where that layout ran before
        (``earlier``), how far its figure moved between the two (beyond their noise) is the
        host's drift between segments, which a window of one phase cannot show (in the
        simulator a dp/zero1 pair 3 % apart, on a host alternating 1.0x and 1.3x every 130
        steps, switched every 52 steps on phases)."""
        if earlier is not None:
            self.moves = [*self.moves, moved(earlier, step)][-self.EVIDENCE:]
        self._move = None

    @property
    def drift(self) -> float:
        """How far a figure measured in another phase may be off: the larger of the median
        drift within the spans decided on and the median move of a layout between its
        segments (0 without evidence)."""
        moves = self.moves + ([self._move] if self._move is not None else [])
        return max(statistics.median(self.drifts) if self.drifts else 0.0,
                   statistics.median(moves[-self.EVIDENCE:]) if moves else 0.0)

    def after(self, decision: object, current: str, shares: tuple[int, ...],
              recent_s: float) -> None:
        """Record ``decision`` taken on the layout labelled ``current`` running ``shares``,
        whose last ``replan_every`` steps took ``recent_s`` (the span the ranks' evidence
        covers: over a whole window, a rank that had just slowed left a fast median no re-cut
        could meet)."""
        checks = self.try_checks + 1 if self.tried_from else 0
        self.forget_last()
        if isinstance(decision, KeepPlan) and decision.checking and checks < self.TRY_CHECKS:
            self.tried_from, self.try_checks = decision.checking, checks
        if isinstance(decision, TryPlan):
            self.tried_from, self.try_checks = current, 0
            self.tried.add(decision.target)
        elif isinstance(decision, SwitchPlan) and not decision.measured:
            self.switched_from = current  # on a prediction: its check is the next decision
        if isinstance(decision, RecutShares):
            if decision.cut == "stage split" and not decision.back:
                self.resplit.add((current, tuple(decision.shares)))
            if decision.back:
                self.no_recut.add(current)
            else:
                self.recut_from = (tuple(shares), recent_s)

    def new_world(self) -> LoopMemory:
        """The memory for the same job on another set of workers: nothing of its layouts
        (their labels name other layouts there), the host's drift kept."""
        return LoopMemory(drifts=list(self.drifts), moves=list(self.moves))

    def forget_last(self) -> None:
        """The layout running is not the one the last decision asked for (a user's switch, a
        node loss, a re-balance that took over): nothing of it to check."""
        self.tried_from, self.switched_from, self.recut_from = "", "", None

    def observe_args(self, current: str, split: Sequence[int] = ()) -> dict[str, Any]:
        """``refit.observe``'s keywords from this memory for the layout labelled ``current``
        (a pipeline's running ``split``: whether the loop cut it)."""
        return {"tried_from": self.tried_from, "switched_from": self.switched_from,
                "recut_from": self.recut_from, "tried": self.tried,
                "recut": current not in self.no_recut, "own_split": (current, tuple(split)) in self.resplit,
                "drift": self.drift}
