"""Layout: how the job's state is laid out on this rank (the live strategy), and changing it.

A layout is built fresh (a seeded model, or every entry loaded from a canonical state or a
checkpoint) or from the live one: a live switch through a gather, or a reshard that moves
only the pieces the new layout keeps (docs/architecture.md, Live switches). The learning-rate
schedule lives on the optimizers the layouts build, so it is kept here too.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from strategies import Strategy, StrategySpec, check_layout, reshard, state_hash
from strategies import get as get_strategy

from ..config import JobConfig, WorkerConfig
from ..errors import PeerReadError, StateMoveError, SwitchError
from ..reference import build_model, build_model_for_load, seed_rank
from .held_state import HeldState
from .inputs import JobData
from .membership import Membership

__all__ = ["Layout", "LrSchedule", "compute_blocks"]


def compute_blocks(strategy: Any) -> list[torch.nn.Module]:
    """The modules whose forward is this rank's compute, finest first: the blocks of its
    pipeline stages, else the model's pipeline blocks, else the whole local model."""
    from strategies.blocks import pipeline_blocks_or_none

    stages = getattr(strategy, "stages", None)
    if stages:
        return [b for st in stages for b in st.stage_blocks]
    model = strategy.local_model()
    blocks = pipeline_blocks_or_none(model)
    return [b for _, b in blocks] if blocks else [model]


class LrSchedule:
    """The job's ``lr_schedule`` applied to every live optimizer: base lr x f(step), from the
    step alone, so a switch, a recovery or a resume continues the schedule (no scheduler
    state to move). Optimizers are held weakly: a layout that closes drops its own."""

    def __init__(self, fn: Callable[[int], float] | None) -> None:
        self._fn = fn
        # each optimizer's factory-set lr per param group (the schedule multiplies those)
        self._base_lrs: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()

    def wrap(self, factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``factory``, recording each optimizer's base lrs when there is a schedule."""
        if self._fn is None:
            return factory
        base_lrs = self._base_lrs

        def build(params: Any) -> Any:
            opt = factory(params)
            base_lrs[opt] = [g["lr"] for g in opt.param_groups]
            return opt
        return build

    def apply(self, step: int) -> float | None:
        """Set every live optimizer's lr for the update of ``step``. Returns the first param
        group's lr (None without a schedule, or on a rank with no optimizer: a ZeRO rank that
        owns nothing)."""
        if self._fn is None:
            return None
        mult = float(self._fn(step))
        lr = None
        for opt, bases in list(self._base_lrs.items()):
            for group, base in zip(opt.param_groups, bases, strict=True):
                group["lr"] = base * mult
            lr = float(bases[0]) * mult if lr is None else lr
        return lr


class Layout:
    """The live strategy and its spec, and the data position of this rank's state
    (``next_step``: the first step not yet applied to it, live or held).

    Every layout built replaces what ``held`` keeps, and is handed to ``on_built`` (the
    emulated slowdown's hooks). Not thread-safe: the actor's RPC thread and the step loop
    never change it at once (the controller's protocol).
    """

    def __init__(self, config: JobConfig | WorkerConfig, membership: Membership, held: HeldState,
                 data: JobData, model_factory: Callable[[], Any], loss_fn: Callable[..., Any],
                 on_built: Callable[[Strategy], None] = lambda s: None) -> None:
        self._config = config
        self._membership = membership
        self._held = held
        self._data = data
        self._model_factory = model_factory
        self._loss_fn = loss_fn
        self._on_built = on_built
        self.schedule = LrSchedule(config.lr_schedule_fn())
        self._optimizer_factory = self.schedule.wrap(config.optimizer_factory())
        self.strategy: Any = None
        self._seeded = False  # this process's generators seeded for the job (dropout)
        self.spec: StrategySpec | None = None
        self.next_step = 0
        self.param_keys: set[str] = set()  # "model/<fqn>" of parameters (not buffers)

    # ------------------------------------------------------------------ building

    def build(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None = None
              ) -> dict[str, Any]:
        """Lay the job out as ``spec``: from the live state when a strategy already runs
        (an in-memory switch), else from a fresh seeded model, then ``state`` if given.
        A switch that fails or does not prove the state unchanged leaves the old layout."""
        t0 = time.perf_counter()
        if state is not None or self.strategy is None:
            self.build_fresh(spec, state)
            return {"seconds": time.perf_counter() - t0, "hash_before": None, "hash_after": None}
        mode = self._config.switch_check
        if self._config.switch_move == "reshard" and mode != "rehash":
            return self._reshard_to(spec, t0)
        return self._gather_to(spec, t0)

    def restart(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None,
                next_step: int) -> None:
        """Drop any live or held state and lay out ``spec`` from ``state`` (the full
        canonical state) or, if None, from the seeded model; the state is at ``next_step``."""
        self.build_fresh(spec, state)
        self.next_step = next_step

    def from_pieces(self, spec: StrategySpec, pieces: list[Any], next_step: int
                    ) -> dict[str, Any]:
        """Collective over the (new) group: lay out ``spec`` from host-memory pieces the
        ranks hold (``strategies.move_pieces``: each rank receives only what its new layout
        keeps, every piece checked as a switch's are); the state is at ``next_step``. On a
        failed check nothing is kept and the held state stays (``StateMoveError``)."""
        from strategies import move_pieces

        t0 = time.perf_counter()
        self.drop()
        strat = self._new_strategy(spec, for_load=True)
        try:
            res = move_pieces(pieces, strat, check=self._config.switch_check != "off")
        except BaseException:
            strat.close()
            raise
        if res.problems:
            strat.close()
            raise StateMoveError(f"moving the state from held pieces into {spec.name} failed "
                                 f"its check: {res.problems[0]}")
        self._held.clear()
        self.strategy, self.spec, self.next_step = strat, spec, next_step
        self._on_built(strat)
        return {"seconds": time.perf_counter() - t0, "bytes_sent": res.bytes_sent,
                "bytes_kept": res.bytes_kept, "hash_before": res.hash_before,
                "hash_after": res.hash_after, "moves": res.moves}

    def trains_on(self) -> None:
        """A segment begins on the live layout: a full snapshot kept from before is stale."""
        if self.strategy is not None and self._held.has_state():
            self._held.drop_snapshot()

    def build_fresh(self, spec: StrategySpec, state: dict[str, torch.Tensor] | None,
                    read: Callable[[Strategy], dict[str, torch.Tensor]] | None = None) -> None:
        """Lay out ``spec`` from ``state`` (the full canonical state), from ``read(strategy)``
        (only what the built layout ``needs``: a checkpoint restore), else from the seeded
        model, replacing any live or held state."""
        self.drop()
        strat = self._new_strategy(spec, for_load=state is not None or read is not None)
        try:
            if state is not None:
                strat.load_full_state(state)
            elif read is not None:
                strat.load_state(self._read_agreed(read, strat))
        except BaseException:
            strat.close()
            raise
        # only now: a build that fails (a peer lost in its collectives) leaves the held
        # state for the next recovery (cleared first, it was gone on every survivor)
        self._held.clear()
        self.strategy, self.spec = strat, spec
        self._on_built(strat)

    def _read_agreed(self, read: Callable[[Strategy], dict[str, torch.Tensor]],
                     strat: Strategy) -> dict[str, torch.Tensor]:
        """Collective: read this rank's part of a checkpoint, then agree that every rank read
        its part before any rank starts loading (a load is collective in some layouts: a rank
        that failed to read would leave its peers blocked there until the group timeout).
        A rank whose read failed raises its error; the others raise a ``PeerReadError`` (a
        ``CheckpointCorruptError`` that gives way to the peer's own error), so the controller
        falls back to an older checkpoint on every rank alike."""
        try:
            got: dict[str, torch.Tensor] | None = read(strat)
            failed: BaseException | None = None
        except Exception as e:  # noqa: BLE001 - said to every rank first, then raised
            got, failed = None, e
        if not self._membership.all_ranks(failed is None):
            if failed is not None:
                raise failed
            raise PeerReadError("another rank could not read its part of the "
                                         "checkpoint; none of the ranks loaded it")
        assert got is not None
        return got

    def drop(self) -> None:
        """Close the live strategy (and every reference it had to the group), if any."""
        if self.strategy is not None:
            self.strategy.close()
            self.strategy = None

    def _new_strategy(self, spec: StrategySpec, for_load: bool) -> Strategy:
        """A new layout ``spec`` of a fresh model: seeded, or (``for_load``: every entry is
        overwritten next) built without initializing and with no init broadcast."""
        self._data.load()
        cls = get_strategy(spec.name)
        seed = self._config.seed
        m = self._membership
        if for_load:
            model = build_model_for_load(self._model_factory, seed)
            if not self._seeded:  # a process new to the job (a spare, a replacement): a
                seed_rank(seed, m.rank, m.generation)  # stream of its own (a checkpoint's
                # saved one for its rank replaces it)
        else:
            model = build_model(self._model_factory, seed, m.rank)
        self._seeded = True
        self.param_keys = {f"model/{n}" for n, _ in model.named_parameters()}
        # the job's settings every layout applies (the controller's specs carry them already)
        opts = spec.options.over(self._config.strategy_options())
        if for_load:
            opts = dataclasses.replace(opts, init_sync=False)
        spec = dataclasses.replace(spec, options=opts)
        cls.validate(spec, model)
        return cls(spec, self._membership.runtime(), model, self._optimizer_factory,
                   self._loss_fn)

    # ------------------------------------------------------------------ live switches

    def _gather_to(self, spec: StrategySpec, t0: float) -> dict[str, Any]:
        """Live switch through a gather: the full canonical state on every rank, then the new
        layout keeps its part; the proof that nothing changed follows ``switch_check``
        (docs/architecture.md, Switches)."""
        mode = self._config.switch_check
        old_spec = self.spec
        assert old_spec is not None
        state = self.strategy.full_state()
        before = state_hash(state)
        kept = transient_buffers(self.strategy.local_model())
        self.drop()
        try:
            self.build_fresh(spec, state)
            put_buffers(self.strategy.local_model(), kept)
        except Exception:
            # a failed switch leaves the job in its old layout, with the same state; when the
            # group broke (a peer lost), that fails too: the state is held for the recovery
            try:
                self.build_fresh(old_spec, state)
            except Exception:
                self._held.hold_full(state)
                raise
            raise
        problems: list[str] = []
        if mode == "rehash":  # a second gather and hash of the whole state
            after = state_hash(self.strategy.full_state())
        elif mode == "pieces":  # each rank's pieces bit-equal to the hashed state, no gather
            problems = check_layout(self.strategy, state)
            after = before if not problems else f"differs: {problems[0]}"
        else:
            after = before
        if after != before:  # keep the job on its old layout, from the state hashed before
            self.build_fresh(old_spec, state)
        return {"seconds": time.perf_counter() - t0, "hash_before": before, "hash_after": after,
                "verified": mode != "off", "check": mode, "problems": problems[:10]}

    def _reshard_to(self, spec: StrategySpec, t0: float) -> dict[str, Any]:
        """Live switch by moving pieces (``strategies.reshard``): the new layout is built
        beside the old one, each rank receives only what its new layout keeps, and the old
        layout is dropped only once every piece has been checked; if anything fails the job
        stays on the old layout, untouched."""
        assert self.strategy is not None
        old = self.strategy
        check = self._config.switch_check
        try:
            new: Strategy | None = self._new_strategy(spec, for_load=True)
            built = None
        except Exception as e:  # said to every rank below: none may wait in the move for it
            new, built = None, e
        if not self._membership.all_ranks(built is None):
            if new is not None:
                new.close()
            if built is not None:
                raise built
            raise SwitchError(f"another rank could not build {spec.name}; the job stays on "
                              f"{self.spec.name if self.spec else 'its old layout'}")
        assert new is not None
        try:
            res = reshard(old, new, check=check != "off")
        except BaseException:
            new.close()
            raise
        if res.problems:  # the old layout still runs, unchanged
            new.close()
            after = f"differs: {res.problems[0]}"
        else:
            put_buffers(new.local_model(), transient_buffers(old.local_model()))
            old.close()
            self._held.clear()
            self.strategy, self.spec = new, spec
            self._on_built(new)
            after = res.hash_after
        return {"seconds": time.perf_counter() - t0, "hash_before": res.hash_before,
                "hash_after": after, "verified": check != "off", "check": check,
                "move": "reshard", "problems": res.problems[:10], "bytes_sent": res.bytes_sent,
                "bytes_kept": res.bytes_kept}


def transient_buffers(model: Any) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s non-persistent buffers (``persistent=False``: in no state dict,
    so no canonical state or checkpoint carries them), by name."""
    if model is None:
        return {}
    saved = set(model.state_dict().keys())
    return {n: b.detach().clone() for n, b in model.named_buffers() if n not in saved}


def put_buffers(model: Any, kept: dict[str, torch.Tensor]) -> None:
    """A live switch's new model takes the old one's non-persistent buffers this rank held
    (same name and shape). Was: back at their initial values after every switch, where a
    forward updates one (found by a new user, session 47)."""
    if model is None or not kept:
        return
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in kept and kept[n].shape == b.shape:
                b.copy_(kept[n])
