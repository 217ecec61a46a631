"""Job configuration: one dataclass, built in Python or loaded from YAML, validated up front.

In YAML, code is named by import strings (``"package.module:attr"``); a mapping with a
``target`` key calls that target with the remaining keys as keyword arguments::

    model: {target: elastic.models:gpt, n_layer: 2}
    optimizer: {name: adamw, lr: 3.0e-4}
    loss: cross_entropy
    dataset: {target: elastic.models:demo_dataset, block_size: 64}
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = ["JobConfig", "resolve_callable", "optimizer_factory", "loss_function"]

_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad"}
_LOSSES = {"cross_entropy": "_cross_entropy", "mse": "_mse"}
SWITCH_CHECKS = ("pieces", "rehash", "off")
SWITCH_MOVES = ("reshard", "gather")
# settings of earlier releases: name -> how to say it now
_RENAMED = {
    "verify_switch": "use switch_check: pieces (verify_switch: true) or off (verify_switch: "
                     "false); rehash also gathers and hashes the state again",
}


@dataclass
class JobConfig:
    """Everything a job needs. Fields that hold code accept a callable or an import string.

    ``dataset`` is a map-style dataset of (input, target) pairs, a zero-argument factory of
    one, an import string, or a Parquet URI (``*.parquet`` / ``parquet://...`` / a directory
    given with ``dataset_format: parquet``).
    """

    model: Any
    optimizer: Any
    loss: Any
    dataset: Any
    global_batch_size: int
    max_steps: int
    seed: int = 0
    # optimization: clip the gradient to this global L2 norm before each update (None: off),
    # as torch.nn.utils.clip_grad_norm_ over the full model, under every strategy
    max_grad_norm: float | None = None
    # step -> multiplier of the optimizer's lr (elastic.schedules): a callable, an import
    # string, {target: ...}, or a built-in {name: cosine|linear|constant, warmup_steps, ...}
    lr_schedule: Any = None
    # compute precision: fp32, or bf16 (forward and loss under torch.autocast to bfloat16;
    # weights, gradients and optimizer state stay fp32)
    precision: str = "fp32"
    # gradient accumulation under dp and ZeRO: a worker runs its share of each step in
    # micro-batches of at most this many samples (None: one pass); the step is unchanged.
    # Pipelines split each step into `micro_batches` instead.
    micro_batch_size: int | None = None
    # recompute each block's activations in backward instead of keeping them (memory for
    # compute; the model must name its blocks: an nn.Sequential or pipeline_blocks())
    activation_checkpointing: bool = False
    strategy: str = "dp"
    num_workers: int = 2
    min_workers: int | None = None
    max_workers: int | None = None
    resources_per_worker: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    use_gpu: bool | None = None  # None: use GPUs when the cluster has them
    name: str | None = None
    run_dir: str | None = None  # default: ./runs/<name>
    ray_address: str | None = None  # default: $RAY_ADDRESS, else a local cluster
    # strategy details (see strategies.StrategySpec)
    pp_degree: int = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    dp_mode: str = "dp"
    switch_at: dict[int, str] = field(default_factory=dict)
    # how a switch proves the state unchanged: "pieces" (each rank's new pieces bit-equal to
    # the hashed state, no gather), "rehash" (gather and hash again), "off"
    switch_check: str = "pieces"
    # how a switch moves the state: "reshard" (each rank receives only the pieces its new
    # layout keeps; strategies.reshard) or "gather" (the full state on every rank first)
    switch_move: str = "reshard"
    # heterogeneity: balance "auto" balances when workers differ (device type or emulation)
    balance: str = "auto"  # auto | on | off
    emulate: list[dict[str, Any]] | None = None  # per worker: {slowdown, memory_gb, stands_for}
    rebalance_every: int = 200  # while balancing: re-measure speeds every N steps (0: never)
    # the closed loop: every N steps re-fit the cost model to the job's own step timings;
    # strategy auto may switch plans, balanced shares are re-cut around a straggler (0: never)
    replan_every: int = 50
    profile_cache: bool = True  # reuse measured speeds per (device, model, batch) across runs
    # failure handling
    max_failures: int = 3
    hang_timeout_s: float = 60.0
    placement_timeout_s: float = 60.0
    # after a loss: wait this long for replacement workers before going on. 0: go on with the
    # survivors at once; replacements start in the background and join at a step boundary
    replacement_timeout_s: float = 0.0
    min_workers_timeout_s: float = 60.0  # below min_workers: wait this long, then fail
    scale_check_s: float = 5.0  # how often to look for room for more workers (up to max)
    # checkpoints
    checkpoint_uri: str | None = None
    checkpoint_every: int = 0  # 0: no periodic checkpoints
    checkpoint_options: dict[str, Any] = field(default_factory=dict)
    keep_last: int = 3
    checkpoint_wait_s: float = 30.0  # a due checkpoint waits this long for the previous commit
    keep_every: int = 0
    resume: str | None = None  # "latest" or a checkpoint URI
    # evaluation: the mean loss over eval_dataset (same forms as dataset), forward only, in
    # eval mode, every eval_every steps (0: after the last step only); in batches of
    # eval_batch_size samples (default: global_batch_size; pipelines: always the global
    # batch, split like training) split across the workers
    eval_dataset: Any = None
    eval_every: int = 0
    eval_batch_size: int | None = None
    # parquet datasets
    input_column: str = "x"
    target_column: str = "y"
    dataset_format: str | None = None
    # output
    log_every: int = 1
    view: str = "auto"  # auto | rich | plain | none
    sample_prompt: str | None = None  # demo: print a generated sample at the end

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        for old, fix in _RENAMED.items():
            if old in data:
                raise ConfigError(old, "was renamed.", fix)
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                unknown[0], "is not a job setting.", f"use one of: {', '.join(sorted(names))}"
            )
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in data
        ]
        if missing:
            raise ConfigError(missing[0], "is required.", "add it to the job file")
        data = dict(data)
        if "switch_at" in data and data["switch_at"]:
            data["switch_at"] = {int(k): str(v) for k, v in data["switch_at"].items()}
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str) -> JobConfig:
        import yaml

        try:
            with open(path) as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError("job file", f"{path} does not exist.", "check the path") from None
        except yaml.YAMLError as e:
            raise ConfigError("job file", f"{path} is not valid YAML: {e}", "fix the syntax") from None
        if not isinstance(data, dict):
            raise ConfigError("job file", f"{path} must hold a mapping of settings.", "see README")
        return cls.from_dict(data)

    # ------------------------------------------------------------------ derived

    @property
    def job_name(self) -> str:
        """The ``name`` given, else the Ray job's submission id (under ``ray job submit``),
        else a time-stamped name."""
        if self.name:
            return self.name
        sub = _ray_submission_id()
        if sub:
            self.name = sub
        else:
            import time

            self.name = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000:04d}"
        return self.name

    @property
    def run_path(self) -> str:
        """``run_dir``, else ``./runs/<name>``; under ``ray job submit`` the working directory
        is a temporary copy, so the default is ``~/elastic-runs/<name>`` on the driver's node."""
        if self.run_dir:
            return self.run_dir
        if _ray_submission_id():
            return os.path.join(os.path.expanduser("~"), "elastic-runs", self.job_name)
        return os.path.join(os.getcwd(), "runs", self.job_name)

    @property
    def min_world(self) -> int:
        return self.min_workers if self.min_workers is not None else self.num_workers

    @property
    def max_world(self) -> int:
        return self.max_workers if self.max_workers is not None else self.num_workers

    def validate(self) -> None:
        """Check every field that can be checked without Ray; raise ConfigError naming it."""
        from strategies import names as strategy_names

        known = strategy_names()
        for fld, value in [("strategy", self.strategy), *[
            (f"switch_at[{k}]", v) for k, v in self.switch_at.items()
        ]]:
            if value not in known and value != "auto":
                raise ConfigError(
                    fld, f"unknown strategy {value!r}.", f"use one of: {', '.join(known)}"
                )
        for fld in ("global_batch_size", "max_steps", "num_workers", "micro_batches", "pp_degree"):
            v = getattr(self, fld)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(fld, f"must be a positive integer, got {v!r}.", f"set {fld}: 1 or more")
        if self.global_batch_size < self.num_workers:
            raise ConfigError(
                "global_batch_size",
                f"{self.global_batch_size} is smaller than num_workers={self.num_workers}, so "
                "some worker would get no sample.",
                f"use global_batch_size >= {self.num_workers} or fewer workers",
            )
        if not 1 <= self.min_world <= self.num_workers <= self.max_world:
            raise ConfigError(
                "num_workers",
                f"needs min_workers <= num_workers <= max_workers, got "
                f"{self.min_world} <= {self.num_workers} <= {self.max_world}.",
                "adjust min_workers/max_workers",
            )
        if self.seed < 0:
            raise ConfigError("seed", "must be >= 0.", "use a non-negative seed")
        if self.switch_check not in SWITCH_CHECKS:
            raise ConfigError("switch_check", f"unknown check {self.switch_check!r}.",
                              f"use one of: {', '.join(SWITCH_CHECKS)}")
        if self.switch_move not in SWITCH_MOVES:
            raise ConfigError("switch_move", f"unknown way {self.switch_move!r}.",
                              f"use one of: {', '.join(SWITCH_MOVES)}")
        for k in self.switch_at:
            if not 0 < k < self.max_steps:
                raise ConfigError(
                    f"switch_at[{k}]", f"step {k} is outside 1..{self.max_steps - 1}.",
                    "switch at a step inside the run",
                )
        if self.balance not in ("auto", "on", "off"):
            raise ConfigError("balance", f"unknown value {self.balance!r}.", "use auto, on or off")
        if not isinstance(self.replan_every, int) or isinstance(self.replan_every, bool) or \
                self.replan_every < 0:
            raise ConfigError("replan_every", f"must be an integer >= 0, got "
                              f"{self.replan_every!r}.", "0 turns the closed loop off")
        for i, emu in enumerate(self.emulate or []):
            if not isinstance(emu, dict) or set(emu) - {"slowdown", "memory_gb", "stands_for"} or \
                    float(emu.get("slowdown", 1.0)) < 1.0:
                raise ConfigError(f"emulate[{i}]", f"{emu!r} is not an emulation.",
                                  "give {slowdown: >= 1, memory_gb: budget, stands_for: name}")
        if self.view not in ("auto", "rich", "plain", "none"):
            raise ConfigError("view", f"unknown view {self.view!r}.", "use auto, rich, plain or none")
        for fld in ("resources_per_worker",):
            res = getattr(self, fld)
            if not isinstance(res, dict) or any(
                not isinstance(v, (int, float)) or v < 0 for v in res.values()
            ):
                raise ConfigError(fld, f"must map resource names to non-negative numbers, got {res!r}.",
                                  'e.g. {"CPU": 1} or {"GPU": 1}')
        if self.max_grad_norm is not None and (
                isinstance(self.max_grad_norm, bool)
                or not isinstance(self.max_grad_norm, (int, float))
                or not 0 < self.max_grad_norm < float("inf")):
            raise ConfigError("max_grad_norm", f"must be a positive number, got "
                              f"{self.max_grad_norm!r}.", "e.g. max_grad_norm: 1.0, or leave it out")
        for fld, default in (("micro_batch_size", "one pass per share"),
                             ("eval_batch_size", "global_batch_size")):
            v = getattr(self, fld)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(fld, f"must be a positive integer, got {v!r}.",
                                  f"e.g. {fld}: 8, or leave it out ({default})")
        if self.precision not in ("fp32", "bf16"):
            fix = ("fp16 needs loss scaling, which elastic does not do: use bf16 (A100, H100, "
                   "L4, MI300X, CPUs) or fp32 (T4, V100)" if self.precision == "fp16"
                   else "use fp32 or bf16")
            raise ConfigError("precision", f"unknown precision {self.precision!r}.", fix)
        if self.lr_schedule is not None:
            fn = self.lr_schedule_fn()
            assert fn is not None
            for step in sorted({0, self.max_steps // 2, self.max_steps - 1}):
                try:
                    m = float(fn(step))
                except Exception as e:  # noqa: BLE001 - the user's function: say what it did
                    raise ConfigError("lr_schedule", f"raised {type(e).__name__}: {e} at step "
                                      f"{step}.", "it is called as f(step) -> multiplier of "
                                      "the optimizer's lr") from None
                if not 0.0 <= m < float("inf"):
                    raise ConfigError("lr_schedule", f"gave {m!r} at step {step}.",
                                      "return a finite multiplier >= 0 of the optimizer's lr")
        if not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or \
                self.eval_every < 0:
            raise ConfigError("eval_every", f"must be an integer >= 0, got {self.eval_every!r}.",
                              "0 evaluates after the last step only")
        if self.eval_every > 0 and self.eval_dataset is None:
            raise ConfigError("eval_every", "is set but eval_dataset is not.",
                              "give eval_dataset (same forms as dataset), or drop eval_every")
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", "must be >= 0.", "0 disables periodic checkpoints")

    # ------------------------------------------------------------------ code resolution

    def model_factory(self) -> Callable[[], Any]:
        return resolve_callable(self.model, "model")

    def optimizer_factory(self) -> Callable[[Any], Any]:
        return optimizer_factory(self.optimizer)

    def loss_fn(self) -> Callable[[Any, Any], Any]:
        return loss_function(self.loss)

    def strategy_options(self) -> dict[str, Any]:
        """Job settings that every layout applies itself (``StrategySpec.options``)."""
        out: dict[str, Any] = {}
        if self.max_grad_norm is not None:
            out["max_grad_norm"] = float(self.max_grad_norm)
        if self.precision != "fp32":
            out["precision"] = self.precision
        if self.micro_batch_size is not None:
            out["micro_batch_size"] = self.micro_batch_size
        if self.activation_checkpointing:
            out["activation_checkpointing"] = True
        return out

    def lr_schedule_fn(self) -> Callable[[int], float] | None:
        """``step -> multiplier`` of the optimizer's lr, or None (elastic.schedules)."""
        spec = self.lr_schedule
        if spec is None:
            return None
        from .schedules import BUILT_IN, make_schedule

        if isinstance(spec, str) and spec.lower() in BUILT_IN:
            spec = {"name": spec}
        if isinstance(spec, dict) and "name" in spec and "target" not in spec:
            try:
                return make_schedule(spec, self.max_steps)
            except ValueError as e:
                raise ConfigError("lr_schedule", f"{e}.",
                                  "e.g. {name: cosine, warmup_steps: 100, min_ratio: 0.1}") from None
        return resolve_callable(spec, "lr_schedule")  # type: ignore[no-any-return]

    def dataset_object(self) -> Any:
        return _dataset(self, self.dataset, "dataset")

    def eval_dataset_object(self) -> Any:
        """The evaluation dataset, or None."""
        if self.eval_dataset is None:
            return None
        return _dataset(self, self.eval_dataset, "eval_dataset")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary (code shown as names); used in manifests and run logs."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "checkpoint_options":
                v = {k: ("***" if "key" in k or "secret" in k or "token" in k else val)
                     for k, val in v.items()}
            out[f.name] = v if isinstance(v, (str, int, float, bool, type(None), dict, list)) else _describe(v)
        return out


def _ray_submission_id() -> str | None:
    """The submission id of the Ray job this driver runs in, if any."""
    import json

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def _describe(obj: Any) -> str:
    if isinstance(obj, functools.partial):
        return f"partial({_describe(obj.func)})"
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if mod and qual:
        return f"{mod}:{qual}"
    return type(obj).__name__


def resolve_callable(spec: Any, field_name: str) -> Any:
    """Turn an import string or a {target: ..., **kwargs} mapping into a callable."""
    if callable(spec):
        return spec
    if isinstance(spec, dict) and "target" in spec:
        kwargs = {k: v for k, v in spec.items() if k != "target"}
        return functools.partial(resolve_callable(spec["target"], field_name), **kwargs)
    if isinstance(spec, str) and ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                field_name, f"cannot import {spec!r} ({e}).",
                "use 'package.module:name' of an importable callable",
            ) from None
        return obj
    raise ConfigError(
        field_name, f"{spec!r} is neither a callable nor an import string 'module:name'.",
        "pass a callable, 'package.module:name', or {target: 'package.module:name', ...}",
    )


def optimizer_factory(spec: Any) -> Callable[[Any], Any]:
    """``{name: adam, lr: 1e-3}``, ``"adam"``, an import string or a ``params -> Optimizer``."""
    if isinstance(spec, str) and spec.lower() in _OPTIMIZERS:
        spec = {"name": spec}
    if isinstance(spec, dict) and "name" in spec:
        name = str(spec["name"]).lower()
        if name not in _OPTIMIZERS:
            raise ConfigError(
                "optimizer", f"unknown optimizer {spec['name']!r}.",
                f"use one of {', '.join(_OPTIMIZERS)} or an import string",
            )
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        return functools.partial(_make_optimizer, _OPTIMIZERS[name], kwargs)
    return resolve_callable(spec, "optimizer")


def _make_optimizer(cls_name: str, kwargs: dict[str, Any], params: Any) -> Any:
    import torch

    return getattr(torch.optim, cls_name)(params, **kwargs)


def loss_function(spec: Any) -> Callable[[Any, Any], Any]:
    if isinstance(spec, str) and spec in _LOSSES:
        return globals()[_LOSSES[spec]]
    return resolve_callable(spec, "loss")


def _cross_entropy(outputs: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    if outputs.dim() > 2:
        return F.cross_entropy(outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1))
    return F.cross_entropy(outputs, targets)


def _mse(outputs: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(outputs, targets)


def _is_parquet_uri(spec: Any, fmt: str | None) -> bool:
    return isinstance(spec, str) and (
        fmt == "parquet" or spec.endswith(".parquet") or spec.startswith("parquet://")
    )


def _dataset(cfg: JobConfig, spec: Any, field_name: str) -> Any:
    from .data import ParquetDataset

    if _is_parquet_uri(spec, cfg.dataset_format):
        uri = spec[len("parquet://"):] if spec.startswith("parquet://") else spec
        return ParquetDataset(uri, cfg.input_column, cfg.target_column)
    if isinstance(spec, (str, dict)):
        spec = resolve_callable(spec, field_name)
    if not isinstance(spec, type) and hasattr(spec, "__getitem__") and hasattr(spec, "__len__"):
        return spec
    if callable(spec):
        return spec()
    raise ConfigError(
        field_name, f"{type(spec).__name__} is not a map-style dataset.",
        "pass an object with __len__ and __getitem__, a factory of one, or a Parquet URI",
    )
