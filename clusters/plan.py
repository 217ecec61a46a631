"""The Plan: what the controller applies. A frozen value the planner produces.

Rank layout: a pipeline plan is a (pp, dp) mesh, outermost pp, as torch's
``init_device_mesh(..., (pp, dp), mesh_dim_names=("pp", "dp"))`` numbers it:
``rank = stage * dp_degree + replica``. ``devices[rank]`` is the device id that rank runs on.

Shares: one entry per data-parallel replica, summing to the global batch G. For dp/zero plans
every rank is a replica, so ``shares[rank]`` is that rank's sample count (as in
``strategies.StrategySpec``). For a pipeline, replica r's share flows through all its stages
in ``micro_batches`` micro-batches of ``shares[r] // micro_batches`` samples. For dp/zero,
``micro_batches > 1`` means gradient accumulation (ceil(share / m) samples per pass).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from strategies.traits import DP_MODES as _DP_MODES
from strategies.traits import TRAITS

from .errors import PlanError

__all__ = ["Plan", "STRATEGIES", "SCHEDULES", "DP_MODES", "more_work", "trial_ran"]

STRATEGIES = tuple(TRAITS)  # the registry's names (strategies/traits.py, torch-free)
SCHEDULES = ("gpipe", "1f1b", "interleaved")
DP_MODES = _DP_MODES  # what a pipeline stage's data-parallel group can run


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Strategy + mesh degrees + batch shares + pipeline split. See the module docstring."""

    strategy: str
    world_size: int
    shares: tuple[int, ...]
    pp_degree: int = 1
    dp_mode: str = "dp"
    micro_batches: int = 1
    schedule: str = "gpipe"
    virtual_stages: int = 1
    stage_split: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()
    reason: str = ""

    @property
    def dp_degree(self) -> int:
        return self.world_size // self.pp_degree

    @property
    def global_batch(self) -> int:
        return sum(self.shares)

    @property
    def is_pipeline(self) -> bool:
        return self.strategy == "pipeline"

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (``pp_degree * virtual_stages``); 1 for dp/zero."""
        return self.pp_degree * self.virtual_stages if self.is_pipeline else 1

    def rank(self, stage: int, replica: int) -> int:
        return stage * self.dp_degree + replica

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        return divmod(rank, self.dp_degree)

    def samples(self, rank: int) -> int:
        """Samples ``rank`` processes per step."""
        return self.shares[self.coords(rank)[1]] if self.is_pipeline else self.shares[rank]

    @property
    def label(self) -> str:
        """Short text: ``"zero2"``, ``"zero1 m=4"``, ``"pp4 x dp2(zero1) 1f1b m=8"``."""
        if not self.is_pipeline:
            return self.strategy + (f" m={self.micro_batches}" if self.micro_batches > 1 else "")
        dp = f" x dp{self.dp_degree}({self.dp_mode})" if self.dp_degree > 1 else ""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"pp{self.pp_degree}{dp} {self.schedule}{v} m={self.micro_batches}"

    def validate(self, n_blocks: int | None = None, *, distinct_devices: bool = True) -> None:
        """Raise ``PlanError`` naming the first inconsistency; ``n_blocks`` checks the split.
        ``distinct_devices=False`` skips the O(world) check that no device id repeats (for a
        caller that checked these very ids already)."""

        def bad(msg: str) -> PlanError:
            return PlanError(f"plan {self.label!r}: {msg}")

        if self.strategy not in STRATEGIES:
            raise bad(f"unknown strategy; use one of {', '.join(STRATEGIES)}")
        if self.world_size < 1 or self.pp_degree < 1 or self.micro_batches < 1:
            raise bad("world_size, pp_degree and micro_batches must be >= 1")
        if self.shares and min(self.shares) < 1:
            raise bad(f"every share must be >= 1, got {self.shares}")
        if self.devices and (
            len(self.devices) != self.world_size
            or (distinct_devices and len(set(self.devices)) != len(self.devices))
        ):
            raise bad("devices must list world_size distinct device ids")
        if not self.is_pipeline:
            if self.pp_degree != 1 or self.stage_split:
                raise bad("only a pipeline plan has pp_degree > 1 or a stage_split")
            if len(self.shares) != self.world_size:
                raise bad(f"needs one share per rank ({self.world_size}), got {len(self.shares)}")
            return
        if self.world_size % self.pp_degree:
            raise bad(f"world_size {self.world_size} is not a multiple of pp {self.pp_degree}")
        if len(self.shares) != self.dp_degree:
            raise bad(f"needs one share per replica ({self.dp_degree}), got {len(self.shares)}")
        if self.dp_mode not in DP_MODES:
            raise bad(f"dp_mode must be one of {', '.join(DP_MODES)}")
        if self.schedule not in SCHEDULES:
            raise bad(f"schedule must be one of {', '.join(SCHEDULES)}")
        if any(s % self.micro_batches for s in set(self.shares)):
            raise bad(f"every share must be a multiple of micro_batches={self.micro_batches}")
        if self.schedule == "interleaved":
            if self.virtual_stages < 2 or self.micro_batches % self.pp_degree:
                raise bad("interleaved needs virtual_stages >= 2 and micro_batches % pp == 0")
        elif self.virtual_stages != 1:
            raise bad("virtual_stages > 1 needs the interleaved schedule")
        if len(self.stage_split) != self.n_stages or any(b < 1 for b in self.stage_split):
            raise bad(f"stage_split needs {self.n_stages} entries >= 1, got {self.stage_split}")
        if n_blocks is not None and sum(self.stage_split) != n_blocks:
            raise bad(f"stage_split covers {sum(self.stage_split)} blocks, model has {n_blocks}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (tuples become lists); ``from_dict`` inverts it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        kw: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**kw)

    def spec_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``strategies.StrategySpec`` (not imported here: no torch)."""
        return {
            "name": self.strategy,
            "world_size": self.world_size,
            "shares": self.shares,
            "pp_degree": self.pp_degree,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "stage_split": self.stage_split or None,
            "dp_mode": self.dp_mode,
            "options": {"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {},
        }


_WORK_CHAIN = ("zero1", "zero2", "zero3")  # each sends what the one before sends, and more


def trial_ran(p: Plan, seen: Sequence[tuple[str, Sequence[str]]]) -> bool:
    """Whether ``p`` is a layout the profiler's trial steps ran (``seen``:
    ``CostModel.trial_layouts``, (strategy, device ids) pairs): the same data-parallel
    strategy on the same devices (the trials run data-parallel layouts, so a pipeline,
    strategy ``"pipeline"``, never is one, whatever its ``dp_mode``)."""
    return any(p.strategy == s and set(p.devices) == set(ids) for s, ids in seen)


def keeps_state(p: Plan) -> bool:
    """Whether every entry of ``p``'s training state stays on a live rank after any one rank
    is lost (``strategies.traits``: dp's replicas; a pipeline whose ``dp_mode`` is dp with at
    least two replicas): the job then recovers from its peers with no rollback. Sharded
    layouts (ZeRO) keep each shard on one rank only."""
    dp = p.dp_degree if p.is_pipeline else p.world_size
    return TRAITS[p.strategy].survives_loss(dp, p.dp_mode)


def more_work(a: Plan, b: Plan) -> bool:
    """Whether ``a`` does all that ``b`` does per step and more: the same layout on the same
    devices and shares, one ZeRO stage up (zero2 = zero1's messages + staging its gradient
    buckets and re-allocating the gradients it drops; zero3 = zero2's + per-unit gathers).
    The model predicts zero1 and zero2 alike; on a 16-core host zero2 measured 1.02x zero1 on
    average (slower in 18 of 28 configurations; docs/benchmarks.md, planner, 2026-12-04).
    dp against zero1 is no such pair: zero1 updates 1/N of the optimizer and broadcasts.
    Or a GPipe pipeline against the same 1F1B one: the same bubble and messages, with all m
    micro-batches' activations held where 1F1B holds p (its schedule measured 8-51 % slower
    on 2 CPU ranks, mlp and dlrm at m = 2 and 8; the model prices the two alike)."""
    ma = a.dp_mode if a.is_pipeline else a.strategy
    mb = b.dp_mode if b.is_pipeline else b.strategy
    same = (a.is_pipeline == b.is_pipeline and a.devices == b.devices and a.shares == b.shares
            and a.pp_degree == b.pp_degree and a.micro_batches == b.micro_batches
            and a.virtual_stages == b.virtual_stages and a.stage_split == b.stage_split)
    if not same:
        return False
    if a.schedule != b.schedule:
        return (a.is_pipeline and a.schedule == "gpipe" and b.schedule == "1f1b"
                and ma == mb)
    return (ma in _WORK_CHAIN and mb in _WORK_CHAIN
            and _WORK_CHAIN.index(ma) > _WORK_CHAIN.index(mb))
