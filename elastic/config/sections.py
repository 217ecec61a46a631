"""The sections of a job's configuration. Each is a small frozen dataclass that checks its own
values when it is built (``__post_init__``) and raises one ``ConfigError`` naming the setting
(by its flat name, the one a job file uses) and the fix.

A section's field usually has the flat setting's name; where the section gives the context
the flat name spelled out, the field is shorter (``checkpoints.every`` is ``checkpoint_every``):
``FLAT`` of each class lists those. Rules between sections (a batch against the workers, a
switch step against ``max_steps``, the schedule over the run) are ``JobConfig``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from elastic.errors import ConfigError

from .checks import (
    did_you_mean,
    flag,
    integer,
    number,
    on_off,
    one_of,
    optional_flag,
    optional_integer,
    text,
    unknown,
)
from .code import (
    check_code,
    check_loss,
    check_model,
    check_optimizer,
    loss_function,
    model_factory,
    optimizer_factory,
    resolve_callable,
)
from .datasets import DTYPES, check_dataset, dataset_object, is_parquet
from .schedule_check import schedule_values
from .trackers import check_trackers

__all__ = ["Section", "Training", "Data", "Evaluation", "Scaling", "Parallelism", "Failures",
           "Preemption", "Output", "SWITCH_CHECKS", "SWITCH_MOVES"]

SWITCH_CHECKS = ("pieces", "rehash", "off")
SWITCH_MOVES = ("reshard", "gather")
_EMULATION_KEYS = ("slowdown", "memory_gb", "stands_for")


class Section:
    """Base of the sections: the flat name of each field, and a checked ``replace``."""

    NAME: ClassVar[str] = ""
    FLAT: ClassVar[dict[str, str]] = {}  # field -> flat setting name, where they differ

    @classmethod
    def flat_name(cls, field_name: str) -> str:
        return cls.FLAT.get(field_name, field_name)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]

    @classmethod
    def required(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.init and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]

    def set(self, name: str, value: Any) -> Section:
        """A copy with ``name`` set to ``value``, checked like the rest."""
        return dataclasses.replace(self, **{name: value})  # type: ignore[type-var]

    def _put(self, name: str, value: Any) -> None:  # normalise a field of a frozen section
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class Training(Section):
    """What is trained and how each update is computed."""

    NAME: ClassVar[str] = "training"

    model: Any
    optimizer: Any
    loss: Any
    seed: int = 0
    # clip the gradient to this global L2 norm before each update (None: off)
    max_grad_norm: float | None = None
    # step -> multiplier of the optimizer's lr (elastic.schedules): a callable, an import
    # string, {target: ...}, or a built-in {name: cosine|linear|constant, warmup_steps, ...}
    lr_schedule: Any = None
    # fp32, or bf16 (forward and loss under torch.autocast; weights and optimizer state fp32)
    precision: str = "fp32"
    # gradient accumulation under dp and ZeRO: micro-batches of at most this many samples
    micro_batch_size: int | None = None
    # recompute each block's activations in backward (the model must name its blocks)
    activation_checkpointing: bool = False
    # DDP's (None: on where preflight's training pass leaves a parameter out)
    find_unused_parameters: bool | None = None

    def __post_init__(self) -> None:
        check_model(self.model)
        check_optimizer(self.optimizer)
        check_loss(self.loss)
        integer(self.seed, "seed", 0, "use a seed >= 0, e.g. seed: 0")
        if self.seed >= 2**63:
            raise ConfigError("seed", f"{self.seed} is too large.", "use a seed below 2**63")
        if self.max_grad_norm is not None:
            number(self.max_grad_norm, "max_grad_norm", above=True,
                          fix="e.g. max_grad_norm: 1.0, or leave it out")
        _check_schedule_form(self.lr_schedule)
        if self.precision not in ("fp32", "bf16"):
            fix = ("fp16 needs loss scaling, which elastic does not do: use bf16 (A100, H100, "
                   "L4, MI300X, CPUs) or fp32 (T4, V100)" if self.precision == "fp16"
                   else "use fp32 or bf16")
            raise ConfigError("precision", f"unknown precision {self.precision!r}.", fix)
        optional_integer(self.micro_batch_size, "micro_batch_size",
                                fix="e.g. micro_batch_size: 8, or leave it out (one pass per "
                                    "share)")
        flag(self.activation_checkpointing, "activation_checkpointing")
        optional_flag(self.find_unused_parameters, "find_unused_parameters", "the default "
                      "(on where a training pass on a few samples leaves a parameter out)")

    def model_factory(self) -> Callable[[], Any]:
        """The model factory (imported now); what it builds is checked to be an nn.Module."""
        return model_factory(self.model)

    def optimizer_factory(self) -> Callable[[Any], Any]:
        """``params -> Optimizer``."""
        return optimizer_factory(self.optimizer)

    def loss_fn(self) -> Callable[[Any, Any], Any]:
        """``(outputs, targets) -> loss``."""
        return loss_function(self.loss)

    def lr_schedule_fn(self, max_steps: int) -> Callable[[int], float] | None:
        """``step -> multiplier`` of the optimizer's lr, or None (elastic.schedules); a
        built-in schedule's ``total_steps`` defaults to ``max_steps``."""
        spec = self.lr_schedule
        if spec is None:
            return None
        from elastic.schedules import BUILT_IN, make_schedule

        if isinstance(spec, str) and spec.lower() in BUILT_IN:
            spec = {"name": spec}
        if isinstance(spec, dict) and "name" in spec and "target" not in spec:
            try:  # its name and keys first, then each value by its name
                fn = make_schedule(spec, max_steps)
            except ValueError as e:
                raise ConfigError("lr_schedule", f"{e}.", "e.g. {name: cosine, warmup_steps: "
                                  "100, min_ratio: 0.1}") from None
            schedule_values(spec, max_steps)
            return fn
        return resolve_callable(spec, "lr_schedule")  # type: ignore[no-any-return]

    def strategy_options(self) -> dict[str, Any]:
        """Settings every layout applies itself (``StrategySpec.options``)."""
        out: dict[str, Any] = {}
        if self.max_grad_norm is not None:
            out["max_grad_norm"] = float(self.max_grad_norm)
        if self.precision != "fp32":
            out["precision"] = self.precision
        if self.micro_batch_size is not None:
            out["micro_batch_size"] = self.micro_batch_size
        if self.activation_checkpointing:
            out["activation_checkpointing"] = True
        if self.find_unused_parameters:
            out["find_unused_parameters"] = True
        return out


def _check_schedule_form(spec: Any) -> None:
    from elastic.schedules import BUILT_IN

    if spec is None or (isinstance(spec, str) and spec.lower() in BUILT_IN):
        return
    if isinstance(spec, dict) and "name" in spec and "target" not in spec:
        return  # its arguments are checked against max_steps (JobConfig)
    if isinstance(spec, str) and ":" not in spec:
        near = did_you_mean(spec.lower(), BUILT_IN)
        raise ConfigError("lr_schedule", f"unknown schedule {spec!r}.",
                          (f"did you mean {near}? " if near else "")
                          + f"use {', '.join(BUILT_IN)}, or an import string")
    check_code(spec, "lr_schedule")


@dataclass(frozen=True)
class Data(Section):
    """The training data, the global batch and the run's length."""

    NAME: ClassVar[str] = "data"
    FLAT: ClassVar[dict[str, str]] = {"format": "dataset_format"}

    dataset: Any
    global_batch_size: int
    max_steps: int
    format: str | None = None  # "parquet" (a directory), "ray" (a factory of a Ray dataset)
    # Parquet: which columns, and the dtypes their values are read as
    input_column: str = "x"
    target_column: str = "y"
    input_dtype: str = "float32"
    target_dtype: str = "float32"
    # before workers start, run the model and the loss on a sample on the driver
    check_sample: bool = True

    def __post_init__(self) -> None:
        if self.format is not None:
            one_of(self.format, "dataset_format", ("parquet", "ray"),
                          "use dataset_format: parquet or ray, or leave it out")
        check_dataset(self.dataset, "dataset", self.format)
        integer(self.global_batch_size, "global_batch_size")
        integer(self.max_steps, "max_steps")
        text(self.input_column, "input_column", optional=False)
        text(self.target_column, "target_column", optional=False)
        one_of(self.input_dtype, "input_dtype", DTYPES)
        one_of(self.target_dtype, "target_dtype", DTYPES)
        flag(self.check_sample, "check_sample")

    def dataset_object(self) -> Any:
        """The training dataset (see ``elastic.config.datasets``)."""
        return dataset_object(self.dataset, "dataset", self.format, self.input_column,
                              self.target_column, self.input_dtype, self.target_dtype)


@dataclass(frozen=True)
class Evaluation(Section):
    """The mean loss over ``eval_dataset`` (same forms as ``dataset``), forward only, every
    ``eval_every`` steps (0: after the last step only), in batches of ``eval_batch_size``
    samples (default: ``global_batch_size``; pipelines: always the global batch)."""

    NAME: ClassVar[str] = "evaluation"
    FLAT: ClassVar[dict[str, str]] = {"dataset": "eval_dataset", "every": "eval_every",
                                      "batch_size": "eval_batch_size"}

    dataset: Any = None
    every: int = 0
    batch_size: int | None = None

    def __post_init__(self) -> None:
        # (its form is checked with the data's format: JobConfig.validate)
        integer(self.every, "eval_every", 0, "0 evaluates after the last step only")
        if self.every > 0 and self.dataset is None:
            raise ConfigError("eval_every", "is set but eval_dataset is not.",
                              "give eval_dataset (same forms as dataset), or drop eval_every")
        optional_integer(self.batch_size, "eval_batch_size",
                                fix="e.g. eval_batch_size: 8, or leave it out "
                                    "(global_batch_size)")

    def dataset_object(self, data: Data) -> Any:
        """The evaluation dataset, or None; Parquet is read with ``data``'s columns."""
        if self.dataset is None:
            return None
        fmt = data.format  # (a Parquet path stays Parquet beside a Ray training set)
        if fmt == "ray" and is_parquet(self.dataset, None):
            fmt = None
        return dataset_object(self.dataset, "eval_dataset", fmt, data.input_column,
                              data.target_column, data.input_dtype, data.target_dtype)


@dataclass(frozen=True)
class Scaling(Section):
    """How many workers, on which cluster, with which resources."""

    NAME: ClassVar[str] = "scaling"

    num_workers: int = 2
    min_workers: int | None = None
    max_workers: int | None = None
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    use_gpu: bool | None = None  # None: use GPUs when the cluster has them
    ray_address: str | None = None  # default: $RAY_ADDRESS, else the cluster `ray start`
    # runs on this machine, else a private local one ("local": always a private one)
    placement_timeout_s: float = 60.0
    scale_check_s: float = 5.0  # how often to look for room for more workers (up to max)
    # False: the job grows only when asked (a scale request: the SDK, the CLI, an elastic
    # scheduler, whose jobs it sizes), not by itself toward max_workers when there is room
    grow_when_room: bool = True
    # gang: one placement group for the starting workers (reserved together, packed);
    # per_worker: one each, so that a shrink gives the bundles back to the cluster (the
    # scheduler's jobs use it)
    placement: str = "gang"

    def __post_init__(self) -> None:
        integer(self.num_workers, "num_workers")
        one_of(self.placement, "placement", ("gang", "per_worker"))
        optional_integer(self.min_workers, "min_workers",
                                fix="set min_workers: 1 or more, or leave it out (num_workers)")
        optional_integer(self.max_workers, "max_workers",
                                fix="set max_workers: 1 or more, or leave it out (num_workers)")
        if not 1 <= self.min_world <= self.num_workers <= self.max_world:
            raise ConfigError(
                "num_workers",
                f"needs min_workers <= num_workers <= max_workers, got "
                f"{self.min_world} <= {self.num_workers} <= {self.max_world}.",
                "adjust min_workers/max_workers",
            )
        res = self.resources_per_worker
        if not isinstance(res, dict) or any(
            not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
            or v < 0 for k, v in res.items()
        ):
            raise ConfigError("resources_per_worker", f"must map resource names to "
                              f"non-negative numbers, got {res!r}.",
                              'e.g. {"CPU": 1} or {"GPU": 1}')
        self._put("resources_per_worker", dict(res))
        for k, v in res.items():  # Ray's names are case-sensitive: {gpu: 1} is a custom
            # resource no node has (was: the job waited out placement_timeout_s)
            if k.upper() in ("CPU", "GPU") and k != k.upper():
                raise ConfigError("resources_per_worker", f"names {k!r}: Ray's resource names "
                                  f"are case-sensitive, so it would be a custom resource no "
                                  f"node has.", f"did you mean {k.upper()}? write "
                                  f"{{{k.upper()}: {v:g}}}")
        if res.get("CPU", 1) == 0:
            raise ConfigError("resources_per_worker", "asks for 0 CPU per worker: Ray would "
                              "reserve no core for its training process (and refuses a "
                              "bundle of zeros).",
                              "ask for CPU: 1 (or more), or leave CPU out (1)")
        optional_flag(self.use_gpu, "use_gpu", "GPUs when the cluster has them")
        gpu = res.get("GPU", 0)  # one worker per device (was: rounded up, or dropped, silently)
        if gpu and self.use_gpu is False:
            raise ConfigError("resources_per_worker", f"asks for {gpu} GPU per worker, but "
                              "use_gpu is false.", "drop GPU from it, or set use_gpu: true")
        if gpu and gpu != int(gpu):
            raise ConfigError("resources_per_worker", f"asks for {gpu} of a GPU per worker: "
                              "each worker drives one whole device (NCCL needs a GPU of its "
                              "own for each rank).", "ask for GPU: 1 (or a whole number)")
        text(self.ray_address, "ray_address",
                    fix="e.g. ray_address: 10.0.0.1:6379, or leave it out ($RAY_ADDRESS, "
                        "else the cluster `ray start` runs here, else a local one)")
        if self.ray_address not in (None, "local", "auto"):  # its form; reached in preflight
            from elastic.ray_address import host_port

            try:
                host_port(self.ray_address)
            except ValueError as e:
                raise ConfigError("ray_address", f"{e.args[0]}.", e.args[1]) from None
        number(self.placement_timeout_s, "placement_timeout_s", above=True)
        number(self.scale_check_s, "scale_check_s", above=True)
        flag(self.grow_when_room, "grow_when_room")

    @property
    def min_world(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_world(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers


@dataclass(frozen=True)
class Parallelism(Section):
    """The layout (strategy) and its details, switches, and heterogeneous balancing."""

    NAME: ClassVar[str] = "parallelism"

    strategy: str = "dp"
    pp_degree: int = 1
    # a pipeline's micro-batches and schedule (gpipe | 1f1b | interleaved); unset, 1f1b at
    # about 2 x pp micro-batches (strategies.spec.pipeline_defaults)
    micro_batches: int | None = None
    schedule: str | None = None
    dp_mode: str = "dp"
    switch_at: dict[int, str] = field(default_factory=dict)  # step -> strategy
    # how a switch proves the state unchanged: pieces | rehash | off
    switch_check: str = "pieces"
    # how a switch moves the state: reshard (only the pieces kept) | gather (full first)
    switch_move: str = "reshard"
    balance: str = "auto"  # auto | on | off
    emulate: list[dict[str, Any]] | None = None  # per worker: {slowdown, memory_gb, stands_for}
    rebalance_every: int = 200  # while balancing: re-measure speeds every N steps (0: never)
    # the closed loop: every N steps re-fit the cost model to the job's own step timings;
    # strategy auto may switch plans, balanced shares are re-cut around a straggler (0: never)
    replan_every: int = 50
    profile_cache: bool = True  # reuse measured speeds per (device, model, batch) across runs

    def __post_init__(self) -> None:
        from strategies import names as strategy_names

        known = [*strategy_names(), "auto"]
        _strategy(self.strategy, "strategy", known)
        integer(self.pp_degree, "pp_degree")
        optional_integer(self.micro_batches, "micro_batches",
                         fix="set micro_batches: 1 or more, or leave it out (about 2 x pp_degree)")
        from strategies.traits import DP_MODES, SCHEDULES

        if self.schedule is not None:
            one_of(self.schedule, "schedule", SCHEDULES)
        one_of(self.dp_mode, "dp_mode", DP_MODES)  # (was: any text, refused later by the
        # pipeline as a strategy that cannot run, or at a switch_at to one, mid-run)
        self._put("switch_at", _switch_at(self.switch_at, known))
        # (YAML reads unquoted off/on as booleans: stored as the words)
        self._put("switch_check", on_off(self.switch_check, "switch_check", SWITCH_CHECKS))
        one_of(self.switch_move, "switch_move", SWITCH_MOVES)
        self._put("balance", on_off(self.balance, "balance", ("auto", "on", "off")))
        if self.emulate is not None:
            if not isinstance(self.emulate, list):
                raise ConfigError("emulate", f"must be a list (one entry per worker), got "
                                  f"{self.emulate!r}.", "e.g. emulate: [{slowdown: 2.0}, {}]")
            for i, emu in enumerate(self.emulate):
                _emulation(i, emu)
        integer(self.rebalance_every, "rebalance_every", 0, "0 never re-measures")
        integer(self.replan_every, "replan_every", 0, "0 turns the closed loop off")
        flag(self.profile_cache, "profile_cache")


def _strategy(value: Any, key: str, known: list[str]) -> None:
    if not isinstance(value, str) or value not in known:
        near = did_you_mean(str(value), known)
        raise ConfigError(key, f"unknown strategy {value!r}.",
                          (f"did you mean {near}? " if near else "")
                          + f"use one of: {', '.join(known)}")


def _switch_at(value: Any, known: list[str]) -> dict[int, str]:
    """``{step: strategy}``; steps may arrive as text (JSON, ``--set``) and become ints."""
    if not isinstance(value, dict):
        raise ConfigError("switch_at", f"must map steps to strategies, got {value!r}.",
                          "e.g. switch_at: {100: zero2}")
    out: dict[int, str] = {}
    for k, v in value.items():
        step = k
        if isinstance(k, str) and k.strip().isdigit():
            step = int(k)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(f"switch_at[{k!r}]", "is not a step number (an integer >= 1).",
                              "key each switch by the step it happens at, e.g. {100: zero2}")
        _strategy(v, f"switch_at[{step}]", known)
        out[step] = v
    return out


FAULT_ACTIONS = ("exit", "pause", "pause_silent", "hang", "raise", "nan",  # worker/faults.py
                 "pause_upload", "corrupt_copy", "slow", "slow_upload",
                 "hang_restore", "slowdown", "exit_final")


def _faults(faults: Any) -> None:
    if faults is None:
        return
    fix = ("give {rank: int >= 0, step: int >= 0, action: "
           f"{'|'.join(FAULT_ACTIONS)}, dir: optional directory, seconds: for slow and "
           "slow_upload, factor: for slowdown}")
    if not isinstance(faults, list):
        raise ConfigError("faults", f"must be a list of faults, got {faults!r}.", fix)
    for i, f in enumerate(faults):
        key = f"faults[{i}]"
        if not isinstance(f, dict) or set(f) - {"rank", "step", "action", "dir", "seconds",
                                                "factor"} or \
                not {"rank", "step", "action"} <= set(f):
            raise ConfigError(key, f"{f!r} is not a fault.", fix)
        if f["action"] not in FAULT_ACTIONS:  # first: a misspelt action is not a "slowdown"
            near = did_you_mean(str(f["action"]), list(FAULT_ACTIONS))
            raise ConfigError(key, f"unknown action {f['action']!r}.",
                              (f"did you mean {near}? " if near else "")
                              + f"use one of: {', '.join(FAULT_ACTIONS)}")
        if (f.get("action") in ("slow", "slow_upload")) != ("seconds" in f):
            raise ConfigError(key, "seconds goes with actions slow and slow_upload, and they "
                              "need it.", fix)
        if "seconds" in f:
            number(f["seconds"], f"{key}.seconds", above=True, fix=fix)
        if (f.get("action") == "slowdown") != ("factor" in f):
            raise ConfigError(key, "factor goes with action slowdown, and it needs it.", fix)
        if "factor" in f:
            number(f["factor"], f"{key}.factor", 1.0, fix=fix)
        for k in ("rank", "step"):
            v = f[k]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(key, f"{k} must be an integer >= 0, got {v!r}.", fix)
        if f.get("dir") is not None and not isinstance(f["dir"], str):
            raise ConfigError(key, f"dir must be a path, got {f['dir']!r}.", fix)


def _emulation(i: int, emu: Any) -> None:
    key = f"emulate[{i}]"
    fix = "give {slowdown: >= 1, memory_gb: budget, stands_for: name}"
    if not isinstance(emu, dict):
        raise ConfigError(key, f"{emu!r} is not an emulation.", fix)
    extra = sorted(set(emu) - set(_EMULATION_KEYS))
    if extra:
        raise unknown(f"{key}.{extra[0]}", extra[0], _EMULATION_KEYS,
                             "an emulation setting")
    if "slowdown" in emu:
        number(emu["slowdown"], f"{key}.slowdown", 1.0, fix=fix)
    if "memory_gb" in emu:
        number(emu["memory_gb"], f"{key}.memory_gb", above=True, fix=fix)
    if "stands_for" in emu:
        text(emu["stands_for"], f"{key}.stands_for", fix=fix)


@dataclass(frozen=True)
class Failures(Section):
    """The failure budget and how long to wait for lost or hung workers."""

    NAME: ClassVar[str] = "failures"

    max_failures: int = 3
    hang_timeout_s: float = 60.0
    # after a loss: wait this long for replacement workers before going on (0: go on with
    # the survivors at once; replacements join at a step boundary)
    replacement_timeout_s: float = 0.0
    min_workers_timeout_s: float = 60.0  # below min_workers: wait this long, then fail
    # test aid: inject a failure at the start of a step on a rank, once per job:
    # [{rank, step, action: exit|pause|hang|raise|nan|pause_upload|corrupt_copy|slow, dir: marker
    # directory (default <run_path>/faults), seconds: how long a slow step waits}] (elastic/worker/faults.py, docs/architecture.md)
    faults: list[dict[str, Any]] | None = None
    # a step whose loss or gradient norm is NaN or inf: skip (drop its update on every rank;
    # more than max_nonfinite_skips in a row stop the job), rollback (restore the newest
    # checkpoint and go on; the same step again stops the job) or stop (at once)
    on_nonfinite: str = "skip"
    max_nonfinite_skips: int = 5
    # peer redundancy: every N steps each rank copies the part of the state only it holds
    # into a buddy rank's host memory on another node (checksummed), so that a loss under a
    # sharded layout restores from the survivors' memory, N steps at most run again (0: off)
    peer_copies_every: int = 0
    # host memory the copies may use per worker (its own snapshot and its buddy's copy);
    # a layout that needs more turns the copies off, with an event (None: no limit)
    peer_copies_memory_gb: float | None = None
    # a worker whose liveness connection closes, or stays silent this long, is lost
    heartbeat_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        _faults(self.faults)
        integer(self.peer_copies_every, "peer_copies_every", 0,
                "e.g. peer_copies_every: 10 (0 turns the copies off)")
        if self.peer_copies_memory_gb is not None:
            number(self.peer_copies_memory_gb, "peer_copies_memory_gb", above=True,
                   fix="e.g. peer_copies_memory_gb: 8, or leave it out (no limit)")
        number(self.heartbeat_timeout_s, "heartbeat_timeout_s", above=True,
               fix="e.g. heartbeat_timeout_s: 1.0 (seconds of silence before a worker is lost)")
        integer(self.max_failures, "max_failures", -1,
                "0 fails at the first loss, -1 recovers without limit")
        one_of(self.on_nonfinite, "on_nonfinite", ("skip", "rollback", "stop"))
        integer(self.max_nonfinite_skips, "max_nonfinite_skips", 0,
                "e.g. max_nonfinite_skips: 5 (0: the first non-finite step stops the job)")
        number(self.hang_timeout_s, "hang_timeout_s", above=True,
                      fix="e.g. hang_timeout_s: 60 (seconds a collective may take)")
        number(self.replacement_timeout_s, "replacement_timeout_s")
        number(self.min_workers_timeout_s, "min_workers_timeout_s")


@dataclass(frozen=True)
class Preemption(Section):
    """Nodes that announce their end (a cloud's preemption notice, a maintenance drain):
    the job watches Ray's draining nodes that host its workers and evacuates them at the
    next step boundary (``clusters.policy.EvacuationPolicy`` decides how)."""

    NAME: ClassVar[str] = "preemption"
    FLAT: ClassVar[dict[str, str]] = {"watch": "watch_drains", "poll_s": "drain_poll_s",
                                      "margin": "evacuation_margin",
                                      "slack_s": "evacuation_slack_s"}

    watch: bool = True  # poll Ray's draining nodes while training
    poll_s: float = 1.0  # how often (one GCS call, ~1 ms)
    # a move must take at most deadline / margin by its measured cost, ending slack_s before
    # the deadline; otherwise the fastest safe path (a checkpoint, or letting the node go)
    margin: float = 2.0
    slack_s: float = 1.0

    def __post_init__(self) -> None:
        flag(self.watch, "watch_drains")
        number(self.poll_s, "drain_poll_s", above=True, fix="e.g. drain_poll_s: 1.0")
        number(self.margin, "evacuation_margin", 1.0,
               fix="e.g. evacuation_margin: 2 (the move's measured cost taken twice)")
        number(self.slack_s, "evacuation_slack_s",
               fix="e.g. evacuation_slack_s: 1.0 (seconds kept before the deadline)")


@dataclass(frozen=True)
class Output(Section):
    """The job's name, its run directory and what it shows."""

    NAME: ClassVar[str] = "output"

    name: str | None = None
    run_dir: str | None = None  # default: ./runs/<name>
    log_every: int = 1
    view: str = "auto"  # auto | rich | plain | none
    sample_prompt: str | None = None  # demo: print a generated sample at the end
    # TensorBoard, MLflow or a class of the user's (elastic.config.trackers); normalised
    trackers: Any = ()

    def __post_init__(self) -> None:
        self._put("trackers", check_trackers(self.trackers))
        text(self.name, "name")
        text(self.run_dir, "run_dir")
        integer(self.log_every, "log_every")
        one_of(self.view, "view", ("auto", "rich", "plain", "none"),
                      "use auto, rich, plain or none")
        if self.sample_prompt is not None and not isinstance(self.sample_prompt, str):
            raise ConfigError("sample_prompt", f"must be text, got {self.sample_prompt!r}.",
                              "give a prompt string, or leave it out")
