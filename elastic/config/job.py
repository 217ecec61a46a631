"""``JobConfig``: a job's configuration, as nine checked sections, read by flat names too.

Built from keyword arguments (``JobConfig(model=..., checkpoint_every=50)``), a mapping
(``from_dict``) or a YAML file (``from_yaml``), in the flat form, the nested section form
(``checkpoints: {every: 50}``) or both (each setting once; see ``elastic.config.flat``).
Building it checks everything that can be checked without running the user's model or reading
the data: each section its own values, then the rules between sections. Nothing downstream
checks a value again.

``cfg.<flat name>`` reads a setting (``cfg.checkpoint_every``) and ``cfg.<section>.<field>``
too (``cfg.checkpoints.every``). Assigning ``cfg.<flat name> = v`` replaces that section by a
checked copy; the rules between sections are checked again by ``validate()`` (the controller
calls it), and only then. ``replace(**settings)`` returns a new, fully checked config.

Secrets in the checkpoint or resume URI and options never leave through ``to_dict``,
``repr`` or ``redact``. A worker gets ``for_worker()``: only what it reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Mapping
from typing import Any

from elastic.checkpoint.location import (
    OWN_RESUMES,
    StorageLocation,
    collect_secrets,
    is_secret_option,
    redact,
    scrub,
)
from elastic.errors import ConfigError

from .checkpoints import Checkpoints
from .code import describe
from .datasets import check_dataset
from .flat import FLAT, SECTIONS, Setting, merge, split
from .sections import (
    Data,
    Evaluation,
    Failures,
    Output,
    Parallelism,
    Preemption,
    Scaling,
    Section,
    Training,
)
from .worker_config import JobCode, WorkerConfig

__all__ = ["JobConfig"]


class JobConfig(JobCode):
    """Everything a job needs (see the module docstring). Not thread-safe for writes."""

    # training
    model = Setting[Any]("training")
    optimizer = Setting[Any]("training")
    loss = Setting[Any]("training")
    seed = Setting[int]("training")
    max_grad_norm = Setting[float | None]("training")
    lr_schedule = Setting[Any]("training")
    precision = Setting[str]("training")
    micro_batch_size = Setting[int | None]("training")
    activation_checkpointing = Setting[bool]("training")
    find_unused_parameters = Setting[bool | None]("training")
    # data
    dataset = Setting[Any]("data")
    global_batch_size = Setting[int]("data")
    max_steps = Setting[int]("data")
    dataset_format = Setting[str | None]("data")
    input_column = Setting[str]("data")
    target_column = Setting[str]("data")
    input_dtype = Setting[str]("data")
    target_dtype = Setting[str]("data")
    check_sample = Setting[bool]("data")
    # evaluation
    eval_dataset = Setting[Any]("evaluation")
    eval_every = Setting[int]("evaluation")
    eval_batch_size = Setting[int | None]("evaluation")
    # scaling
    num_workers = Setting[int]("scaling")
    min_workers = Setting[int | None]("scaling")
    max_workers = Setting[int | None]("scaling")
    resources_per_worker = Setting[dict[str, float]]("scaling")
    use_gpu = Setting[bool | None]("scaling")
    ray_address = Setting[str | None]("scaling")
    placement_timeout_s = Setting[float]("scaling")
    scale_check_s = Setting[float]("scaling")
    grow_when_room = Setting[bool]("scaling")
    placement = Setting[str]("scaling")
    # parallelism
    strategy = Setting[str]("parallelism")
    pp_degree = Setting[int]("parallelism")
    micro_batches = Setting[int | None]("parallelism")
    schedule = Setting[str | None]("parallelism")
    dp_mode = Setting[str]("parallelism")
    switch_at = Setting[dict[int, str]]("parallelism")
    switch_check = Setting[str]("parallelism")
    switch_move = Setting[str]("parallelism")
    balance = Setting[str]("parallelism")
    emulate = Setting[list[dict[str, Any]] | None]("parallelism")
    rebalance_every = Setting[int]("parallelism")
    replan_every = Setting[int]("parallelism")
    profile_cache = Setting[bool]("parallelism")
    # failures
    max_failures = Setting[int]("failures")
    hang_timeout_s = Setting[float]("failures")
    replacement_timeout_s = Setting[float]("failures")
    min_workers_timeout_s = Setting[float]("failures")
    faults = Setting[list[dict[str, Any]] | None]("failures")
    on_nonfinite = Setting[str]("failures")
    max_nonfinite_skips = Setting[int]("failures")
    peer_copies_every = Setting[int]("failures")
    peer_copies_memory_gb = Setting[float | None]("failures")
    heartbeat_timeout_s = Setting[float]("failures")
    # preemption
    watch_drains = Setting[bool]("preemption")
    drain_poll_s = Setting[float]("preemption")
    evacuation_margin = Setting[float]("preemption")
    evacuation_slack_s = Setting[float]("preemption")
    # checkpoints
    checkpoint_uri = Setting[str | None]("checkpoints")
    checkpoint_every = Setting[int]("checkpoints")
    checkpoint_options = Setting[dict[str, Any]]("checkpoints")
    keep_last = Setting[int]("checkpoints")
    keep_every = Setting[int]("checkpoints")
    checkpoint_wait_s = Setting[float]("checkpoints")
    checkpoint_upload_timeout_s = Setting[float]("checkpoints")
    resume = Setting[str | None]("checkpoints")
    # output
    name = Setting[str | None]("output")
    run_dir = Setting[str | None]("output")
    log_every = Setting[int]("output")
    view = Setting[str]("output")
    sample_prompt = Setting[str | None]("output")
    trackers = Setting[tuple[tuple[str, dict[str, Any]], ...]]("output")

    def __init__(self, **settings: Any) -> None:
        """Build and check a config from settings in either form. Raises ``ConfigError``."""
        self._s: dict[str, Section] = {}
        for name, part in split(settings).items():
            self._s[name] = part if isinstance(part, Section) else SECTIONS[name](**part)
        self._default_location: StorageLocation | None = None
        self.ray_blocks: dict[str, Any] = {}  # a running job's Ray datasets (elastic.ray_dataset)
        self.dataset_length: int | None = None  # what the driver read (preflight): workers agree
        self.eval_dataset_length: int | None = None  # (the same, of eval_dataset)
        self._checked = False
        self.validate()

    # ------------------------------------------------------------------ sections
    @property
    def training(self) -> Training:
        return self._s["training"]  # type: ignore[return-value]

    @property
    def data(self) -> Data:
        return self._s["data"]  # type: ignore[return-value]

    @property
    def evaluation(self) -> Evaluation:
        return self._s["evaluation"]  # type: ignore[return-value]

    @property
    def scaling(self) -> Scaling:
        return self._s["scaling"]  # type: ignore[return-value]

    @property
    def parallelism(self) -> Parallelism:
        return self._s["parallelism"]  # type: ignore[return-value]

    @property
    def failures(self) -> Failures:
        return self._s["failures"]  # type: ignore[return-value]

    @property
    def preemption(self) -> Preemption:
        return self._s["preemption"]  # type: ignore[return-value]

    @property
    def checkpoints(self) -> Checkpoints:
        return self._s["checkpoints"]  # type: ignore[return-value]

    @property
    def output(self) -> Output:
        return self._s["output"]  # type: ignore[return-value]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, data: Mapping[str, Any],
                  overrides: Mapping[str, Any] | None = None) -> JobConfig:
        """A config from a mapping of settings (either form), ``overrides`` winning."""
        if not isinstance(data, Mapping):
            raise ConfigError("job", f"must be a mapping of settings, got {type(data).__name__}.",
                              "see README")
        return cls(**merge(data, overrides or {}))

    @classmethod
    def from_yaml(cls, path: str, overrides: Mapping[str, Any] | None = None) -> JobConfig:
        """A config from a YAML job file, ``overrides`` (``--set``) winning."""
        from .yaml_file import load_mapping

        return cls.from_dict(load_mapping(path, "job file", "see README"), overrides)

    @staticmethod
    def setting_names() -> list[str]:
        """Every flat setting name."""
        return list(FLAT)

    def settings(self) -> dict[str, Any]:
        """Every setting's value under its flat name (code and datasets as given)."""
        return {name: getattr(self._s[s], f) for name, (s, f) in FLAT.items()}

    def replace(self, **settings: Any) -> JobConfig:
        """A new config: these settings (either form) over this one's. Fully checked. A
        running job's Ray dataset blocks go with it (a pooled placement's copy sends them)."""
        out = JobConfig(**merge(self.settings(), settings))
        out.ray_blocks = dict(self.ray_blocks)
        if out.dataset is self.dataset:  # the length read of this dataset (another: read anew)
            out.dataset_length = self.dataset_length
        if out.eval_dataset is self.eval_dataset:
            out.eval_dataset_length = self.eval_dataset_length
        return out

    # ------------------------------------------------------------------ checks
    def _assign(self, name: str, value: Any) -> None:
        """``cfg.<name> = value``: the section is replaced by a checked copy."""
        section, field = FLAT[name]
        self._s[section] = self._s[section].set(field, value)
        self._checked = False

    def validate(self) -> None:
        """Check the rules between sections, if a setting was assigned since they were last
        checked (a config is checked when built). Raises ``ConfigError``."""
        if self._checked:
            return
        d, p, n = self.data, self.parallelism, self.scaling.num_workers
        if d.global_batch_size < n:
            raise ConfigError(
                "global_batch_size",
                f"{d.global_batch_size} is smaller than num_workers={n}, so some worker would "
                "get no sample.",
                f"use global_batch_size >= {n} or fewer workers",
            )
        top = self.scaling.max_world
        if d.global_batch_size < top:  # the scheduler and `scale` may size the job up to it
            raise ConfigError(
                "max_workers",
                f"{top} is more than global_batch_size={d.global_batch_size}: the job could be "
                "grown to workers that get no sample.",
                f"use max_workers <= {d.global_batch_size}, or a larger global_batch_size")
        for i, f in enumerate(self.failures.faults or ()):  # (one no rank reaches never
            if f["rank"] >= top:  # fires, and said nothing: a new user, session 50)
                raise ConfigError(f"faults[{i}].rank", f"rank {f['rank']} is outside this job's "
                                  f"ranks 0..{top - 1}, so the fault would never fire.",
                                  f"use a rank below {top}, or more workers")
        for k in p.switch_at:
            if not 0 < k < d.max_steps:
                raise ConfigError(f"switch_at[{k}]", f"step {k} is outside 1..{d.max_steps - 1}.",
                                  "switch at a step inside the run")
        if self.evaluation.dataset is not None:  # a Parquet directory is one for both (was:
            # refused: checked as if dataset_format were not given)
            check_dataset(self.evaluation.dataset, "eval_dataset",
                          "parquet" if d.format == "parquet" else None)
        self._check_own_resume()
        self._check_schedule()
        self._checked = True

    def _check_own_resume(self) -> None:
        """``resume: auto|latest`` goes on from the job's own checkpoints, which carry its
        name (``checkpoint.ownership``): an unnamed job is named anew each run."""
        ck, out = self.checkpoints, self.output
        if ck.resume not in OWN_RESUMES or out.name:
            return
        if ck.uri is None and not out.run_dir:  # was: auto always fresh, latest never found
            why = ("its default checkpoint directory (<run dir>/checkpoints) is new each time, "
                   "so it would " + ("always start fresh" if ck.resume == "auto"
                                     else "never find one"))
        else:  # was: refused at the next run, by the owner check, naming a generated name
            why = ("the checkpoints an earlier run wrote there carry another name, and "
                   "resuming them is refused")
        raise ConfigError("resume", f"{ck.resume} goes on from this job's own checkpoints, but "
                          "the job has no name: each run is named anew (time-stamped, or after "
                          f"its Ray submission id): {why}.",
                          "give the job a name that stays the same from run to run, e.g. "
                          "name: my-job")

    def _check_schedule(self) -> None:
        fn = self.lr_schedule_fn()
        if fn is None:
            return
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

    # ------------------------------------------------------------------ derived
    @property
    def job_name(self) -> str:
        """The ``name`` given, else the Ray job's submission id (under ``ray job submit``),
        else a time-stamped name (chosen once, then kept)."""
        if self.output.name:
            return self.output.name
        name = _ray_submission_id()
        if name:  # a driver may run several jobs: the second unnamed one is <id>-2, ...
            n = next(_SUBMITTED)  # (one C call: atomic under the GIL)
            name = name if n == 1 else f"{name}-{n}"
        if not name:  # the process's n-th unnamed job: -n after the first (was: two in one
            import time  # second shared one name: one refused as already running, or both

            # in one run directory; found by a new user, session 48)
            n = next(_UNNAMED)
            name = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 10000:04d}" + (
                f"-{n}" if n > 1 else "")
        self._s["output"] = self.output.set("name", name)  # no rule between sections reads it
        return name

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
        return self.scaling.min_world

    @property
    def max_world(self) -> int:
        return self.scaling.max_world

    def unused_settings(self) -> str:
        """What the job was given that its layouts never read, said at its start ("" when
        nothing): a pipeline's settings (``pp_degree``, ``micro_batches``, ``schedule``,
        ``dp_mode``) under a strategy that is not one and no ``switch_at`` to one. They stay
        for a switch by hand; ``micro_batches`` is not dp's gradient accumulation."""
        par = self.parallelism
        if par.strategy in ("pipeline", "auto") or "pipeline" in par.switch_at.values():
            return ""
        given = [f"{k}: {v}" for k, v, unset in (
            ("pp_degree", par.pp_degree, 1), ("micro_batches", par.micro_batches, None),
            ("schedule", par.schedule, None), ("dp_mode", par.dp_mode, "dp")) if v != unset]
        if not given:
            return ""
        accumulate = (f"; to accumulate gradients under {par.strategy} set micro_batch_size "
                      "(samples per pass)" if par.micro_batches is not None else "")
        return (f"{', '.join(given)}: a pipeline's setting{'s' if len(given) > 1 else ''}, "
                f"not read by strategy "
                f"{par.strategy} (kept for a switch to a pipeline by hand{accumulate})")

    @property
    def checkpoint_location(self) -> StorageLocation:
        """Where this job's checkpoints live, parsed once: ``checkpoint_uri``, else
        ``<run dir>/checkpoints`` (resolved on first use, on the driver, and sent to the
        workers with the config)."""
        if self.checkpoints.location is not None:
            return self.checkpoints.location
        root = os.path.abspath(os.path.join(self.run_path, "checkpoints"))
        if self._default_location is None or self._default_location.root != root:
            # a local directory takes no options (any given are for an s3/gs resume URI)
            self._default_location = StorageLocation.parse(root)
        return self._default_location

    def for_worker(self) -> WorkerConfig:
        """What a worker reads, and nothing else (no cluster, failure or output settings)."""
        ck = self.checkpoints
        data, evaluation, blocks = self.data, self.evaluation, self.ray_blocks
        if "dataset" in blocks or data.format == "ray":  # blocks in place of Ray datasets
            data = dataclasses.replace(data, dataset=blocks.get("dataset", data.dataset),
                                       format=None)
        if "eval_dataset" in blocks:
            evaluation = dataclasses.replace(evaluation, dataset=blocks["eval_dataset"])
        return WorkerConfig(
            training=self.training, data=data, evaluation=evaluation,
            switch_check=self.switch_check, switch_move=self.switch_move,
            checkpoint_every=ck.every, checkpoint_wait_s=ck.wait_s,
            checkpoint_location=self.checkpoint_location if ck.enabled else None,
            run_path=self.run_path, on_nonfinite=self.on_nonfinite,
            max_nonfinite_skips=self.max_nonfinite_skips,
            peer_copies_every=self.peer_copies_every,
            peer_copies_memory_gb=self.peer_copies_memory_gb,
            faults=tuple(self.faults) if self.faults is not None else None,
            dataset_length=self.dataset_length, eval_dataset_length=self.eval_dataset_length)

    # ------------------------------------------------------------------ output
    @property
    def secrets(self) -> tuple[str, ...]:
        """Every credential the settings carry: the checkpoint settings' (with the
        environment's credential variables, ``collect_secrets``), and the values of the
        trackers' options named as credentials (``is_secret_option``), longest first."""
        parts = (self.checkpoints, self.trackers)  # (redact runs per event: worked out once
        memo = getattr(self, "_secrets_of", None)  # per version of the settings it reads)
        if memo is not None and memo[0][0] is parts[0] and memo[0][1] is parts[1]:
            return memo[1]
        found = set(self.checkpoints.secrets)
        for _, opts in self.trackers:
            for k, v in opts.items():
                if is_secret_option(k):
                    found.update(_texts(v))
                else:  # a URL's credentials under any name (endpoint: https://u:pw@host)
                    found.update(_url_secrets(v))
        out = tuple(sorted(found, key=len, reverse=True))
        self._secrets_of = (parts, out)
        return out

    def redact(self, text: str) -> str:
        """``text`` with every secret of the settings replaced by ``***``."""
        return redact(text, self.secrets)

    def redact_value(self, value: Any) -> Any:
        """A JSON-like value with secrets redacted and secret-looking keys masked."""
        return scrub(value, self.secrets)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary under flat names (code shown as names, secrets as ``***``);
        used in run logs (``config.json``)."""
        out: dict[str, Any] = {}
        for name, v in self.settings().items():
            if name == "trackers":  # (kind, options) pairs, as a job file gives them
                v = [{kind: {k: "***" if is_secret_option(k) and _texts(o) else o
                             for k, o in opts.items()}} for kind, opts in v]
            plain = isinstance(v, (str, int, float, bool, type(None), dict, list))
            out[name] = self.redact_value(v) if plain else describe(v)
        return out

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()
                          if k in _REQUIRED or (v != _DEFAULTS.get(k) and v != []))
        return f"JobConfig({shown})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobConfig) and self._s == other._s

    __hash__ = None  # type: ignore[assignment]


_REQUIRED = {cls.flat_name(f) for cls in SECTIONS.values() for f in cls.required()}
_DEFAULTS = {cls.flat_name(f.name): f.default for cls in SECTIONS.values()
             for f in dataclasses.fields(cls)  # type: ignore[arg-type]
             if f.init and f.default is not dataclasses.MISSING}


_UNNAMED = itertools.count(1)  # the unnamed jobs this process names by the time
_SUBMITTED = itertools.count(1)  # those this driver names after its Ray submission id


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


def _url_secrets(value: Any) -> set[str]:
    """The credentials of the URLs in ``value``: a password (``scheme://user:pw@host``, as
    given and decoded; a short one only where it stands in its URL: "pw" is in many words)
    and a query's credentials (``?token=...``: ``collect_secrets``'s rule; the user name is
    not one here, as it is for an object store's key)."""
    from urllib.parse import unquote, urlsplit

    out: set[str] = set()
    for t in _texts(value):
        if "://" not in t:
            continue
        try:
            parts = urlsplit(t.strip())
            pw = parts.password
        except ValueError:
            continue
        out.update(collect_secrets(parts._replace(netloc=parts.hostname or "").geturl()))
        for form in {pw, unquote(pw)} if pw else set():
            out.add(form if len(form) >= 4 else f":{form}@")
    return out


def _texts(value: Any) -> list[str]:
    """A credential option's values as they may be shown (texts of 4 characters or more; a
    number's digits from 6 on; a list's or mapping's each), none for a switch or None."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, str):
        return [value] if len(value) >= 4 else []
    if isinstance(value, int | float):
        return [str(value)] if len(str(value)) >= 6 else []
    items = value.values() if isinstance(value, Mapping) else (
        value if isinstance(value, list | tuple) else [])
    return [t for v in items for t in _texts(v)]
