"""Everything about a job that can be checked before any worker starts (no Ray needed): the
model builds, the datasets hold enough samples, the code resolves, the checkpoint store is
writable, and the run directory is the job's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import JobConfig
from ..config.checks import did_you_mean
from ..config.datasets import is_ray_dataset
from ..data import ColumnError
from ..errors import ConfigError
from ..preflight import check_sample
from ..reference import build_model
from ..trackers import check_trackers_here

__all__ = ["Preflight", "preflight", "built_model", "run_directory", "check_dataset_object",
           "check_sync_norms"]


@dataclass
class Preflight:
    """What the checks built: the job's model (for validation and planning) and its
    checkpoint store (None without checkpoints)."""

    model: Any
    store: Any


def built_model(cfg: JobConfig) -> Any:
    """The job's model as every worker builds it; a factory that raises is
    ``ConfigError("model", ...)`` (``elastic plan`` builds it so too)."""
    try:
        return build_model(cfg.model_factory(), cfg.seed)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError("model", f"the model factory raised {type(e).__name__}: {e}",
                          "fix the factory; it must return an nn.Module") from e


def preflight(cfg: JobConfig, emit: Callable[..., Any]) -> Preflight:
    """Check the job; ``ConfigError`` naming the field and the fix for anything wrong."""
    model = built_model(cfg)
    _check_dense(model)
    left = _check_datasets(cfg, model)
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        emit("parameters_left_out",
             f"a training pass on a few samples left {', '.join(left[:3])}{more} without a "
             "gradient: dp looks for unused parameters each step and zero3 drops gradients "
             "no rank made (find_unused_parameters on; false turns it off)",
             {"parameters": left[:20], "count": len(left)})
    _say_batch_norms(model, cfg, emit)
    if cfg.sample_prompt:  # the text generated after the run: tried now on one token
        from ..models import generate

        try:
            generate(model, cfg.dataset_object(), cfg.sample_prompt, max_new_tokens=1)
        except (ValueError, TypeError, KeyError) as e:  # (was: a traceback after the run)
            raise ConfigError("sample_prompt", f"cannot be generated from: {e}.",
                              "give a prompt of the dataset's characters, for a model with "
                              "an elastic.models.Embedding block, or drop it") from None
    if cfg.activation_checkpointing:  # (every layout refuses it: not the strategy's fault)
        from strategies.blocks import checkpointable

        why = checkpointable(model)
        if why:
            raise ConfigError("activation_checkpointing", f"works block by block: {why}.",
                              "set activation_checkpointing: false, or mend the model's "
                              "blocks as it says (strategies/blocks.py)")
    try:  # its values too (a negative lr, betas past 1, nesterov without momentum): on a
        # stand-in parameter, as a sweep's factories are tried (was: on the workers, as
        # "user code failed", naming no setting)
        cfg.optimizer_factory()([torch.nn.Parameter(torch.zeros(2))])
    except (ValueError, TypeError, RuntimeError) as e:
        raise ConfigError("optimizer", f"building it failed: {type(e).__name__}: {e}.",
                          "correct the value it names (torch.optim's own check)") from None
    cfg.loss_fn()
    check_trackers_here(cfg.trackers)
    addr = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if addr and addr not in ("local", "auto"):
        from ..ray_address import check_reachable

        check_reachable(addr)
    if unused := cfg.unused_settings():  # (said, not refused: a hand switch reads them)
        emit("settings_unused", unused)
    cfg.run_dir = run_directory(cfg)  # the workers' default checkpoint root follows it
    _check_writable_dir(cfg.run_dir)
    store = None
    if cfg.checkpoint_every > 0 or cfg.checkpoint_uri:
        from ..checkpoint_io import job_store

        store = job_store(cfg)
        store.check_writable()
    return Preflight(model, store)


def _batch_norms(model: Any) -> list[tuple[str, Any]]:
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def _say_batch_norms(model: Any, cfg: JobConfig, emit: Callable[..., Any]) -> None:
    """A model with BatchNorm trains a model that depends on the world size, the shares and
    the micro-batches (each replica normalises by its own samples, each micro-batch updates
    the running statistics): said once, at the start (``batch_dependent``). A SyncBatchNorm
    on CPU workers (``use_gpu: false``) is refused by name (``check_sync_norms``)."""
    norms = _batch_norms(model)
    if not norms:
        return
    if cfg.use_gpu is False:
        check_sync_norms(model, [{"device": "cpu"}])
    names = [n for n, _ in norms]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    emit("batch_dependent",
         f"the model's BatchNorm layers ({', '.join(names[:3])}{more}) normalise by each "
         "replica's own samples, as under DDP (an nn.SyncBatchNorm on GPUs: by its group's), "
         "and a tracked running statistic takes each micro-batch in: what it trains depends "
         "on the world size, the shares and the micro-batches, not one process's (elastic "
         "averages the running statistics over the replicas every step; a resize, a pipeline "
         "or a resume on another world changes it)",
         {"layers": names[:20], "count": len(names)})


def check_sync_norms(model: Any, infos: list[dict[str, Any]]) -> None:
    """``ConfigError`` when the model has an ``nn.SyncBatchNorm`` and a worker is a CPU
    (torch runs it on CUDA devices only). Was: its first step failed, read as the process
    group failing (found by a new user, session 49)."""
    sync = [n for n, m in _batch_norms(model) if isinstance(m, torch.nn.SyncBatchNorm)]
    if sync and any(str(i.get("device", "cpu")).startswith("cpu") for i in infos):
        raise ConfigError("model", f"its layer {sync[0] or '(the model)'!r} is an "
                          "nn.SyncBatchNorm, which "
                          "torch runs on CUDA devices only, and this job's workers are CPUs.",
                          "use nn.BatchNorm (each replica normalises by its own samples; "
                          "elastic averages the running statistics), or run on GPUs")


def _check_dense(model: Any) -> None:
    """No layout reduces sparse gradients (dp's bucketed all-reduce, the ZeRO stages' flat
    shards and FSDP2 take dense ones): an embedding with ``sparse=True`` is refused here,
    by name (was: each layout failed in its first step, as "user code failed")."""
    sparse = [(name, type(m).__name__) for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        name, kind = sparse[0]
        more = f" (and {len(sparse) - 1} more)" if len(sparse) > 1 else ""
        raise ConfigError("model", f"{name or 'the model'} ({kind}){more} makes sparse "
                          "gradients (sparse=True), and no layout reduces those (dp's bucketed "
                          "all-reduce, ZeRO's flat shards and FSDP take dense ones).",
                          "build it with sparse=False: its gradients are then dense, and any "
                          "optimizer takes them (Adam for SparseAdam)")


def _check_datasets(cfg: JobConfig, model: Any) -> list[str]:
    """Enough samples, and the model and loss on a few of them. A Ray dataset (or, with
    ``dataset_format: ray``, any factory) is left to ``elastic.ray_dataset.prepare``, which
    runs it once Ray is up and then checks it here (``check_dataset_object``)."""
    if cfg.dataset_format == "ray":
        return []
    left: list[str] = []
    for field, given in (("dataset", cfg.dataset), ("eval_dataset", cfg.eval_dataset)):
        if given is None:
            continue
        try:
            ds = cfg.dataset_object() if field == "dataset" else cfg.eval_dataset_object()
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(field, f"building it failed: {type(e).__name__}: {e}",
                              "fix the dataset's factory") from e
        if is_ray_dataset(ds):
            if not is_ray_dataset(given):  # a factory of one: it must run with Ray up
                raise ConfigError(
                    "dataset_format", f"{field}'s factory returned a Ray dataset.",
                    "set dataset_format: ray (the factory is then called once Ray is up, and "
                    "its pipeline runs once, on the cluster), or pass the dataset itself")
            continue
        left += check_dataset_object(cfg, model, field, ds)
    return left


def check_dataset_object(cfg: JobConfig, model: Any, field: str, ds: Any) -> list[str]:
    """``field``'s dataset object: its length (at least one global batch for ``dataset``; at
    least one sample for ``eval_dataset``), recorded for the workers to agree with, and the
    model and the loss on a few samples read as workers read them. Returns the parameters
    a training pass left without a gradient (``check_sample``)."""
    try:
        n = len(ds)
    except ColumnError as e:  # (was: "cannot read the dataset's length", naming dataset)
        near = did_you_mean(e.column, e.have)
        if field == "eval_dataset":  # (the settings name a Parquet training set's too)
            raise ConfigError(field, f"{e}.", f"give it columns {cfg.input_column!r} and "
                              f"{cfg.target_column!r}, which input_column and target_column "
                              "name (a Parquet training set's columns too)") from None
        raise ConfigError(e.setting, f"{e}.", f"did you mean {near}?" if near else
                          f"use one of {e.have}") from None
    except Exception as e:
        raise ConfigError(field, f"cannot read the dataset's length ({e}).",
                          "check the dataset URI or object") from e
    if field == "eval_dataset":
        if n < 1:
            raise ConfigError("eval_dataset", "is empty.", "give it samples, or drop it")
        cfg.eval_dataset_length = n  # every rank scores all of it together: workers agree
        check_sample(cfg, model, ds, field)  # (was: at the first evaluation, or the run's end)
        return []
    if n < cfg.global_batch_size:
        raise ConfigError(
            "dataset", f"has {n} samples, fewer than one global batch "
            f"({cfg.global_batch_size}).",
            f"use global_batch_size <= {n} or a larger dataset")
    cfg.dataset_length = n  # the sample order is a permutation of n: every worker must agree
    return check_sample(cfg, model, ds)  # the model and the loss on a few samples, as workers
    # read (and the parameters a training pass leaves out: ``find_unused_parameters``)


def _holds_run(path: str) -> bool:
    ev = os.path.join(path, "events.jsonl")
    return os.path.isfile(ev) and os.path.getsize(ev) > 0


def run_directory(cfg: JobConfig) -> str:
    """The job's run directory, never another run's: ``run_dir`` (or ``./runs/<name>``),
    which a resumed job continues. A default path that holds an earlier run gets a numbered
    sibling (``runs/<name>.2``), so two runs never interleave their logs; an explicit
    ``run_dir`` that holds one is refused with the fix."""
    path = cfg.run_path
    fresh = False  # ``auto`` with no checkpoint to go on from in ./runs: a fresh start
    if cfg.resume in ("latest", "auto") and not cfg.run_dir and cfg.checkpoints.location is None:
        newest = _newest_run(path)
        if newest is not None or cfg.resume == "latest":
            return newest or path  # (latest with none: refused by the resume's plan)
        fresh = True
    if not _holds_run(path):
        return path
    owner = _run_owner(path)
    if cfg.resume and not fresh and owner in (None, cfg.job_name):
        return path
    if cfg.run_dir and owner not in (None, cfg.job_name):  # (was: continued whatever the
        # resume: another job's config.json overwritten, two jobs' metrics in one file)
        raise ConfigError(
            "run_dir", f"{path} holds a run of job {owner!r}, not of this job "
            f"({cfg.job_name!r}).",
            f"give this job a run_dir of its own, or resume that job under its name "
            f"(name: {owner})")
    if cfg.run_dir:
        raise ConfigError(
            "run_dir", f"{path} holds an earlier run (its events.jsonl).",
            "resume it with resume: latest, or give a new run_dir (or drop run_dir: a new "
            "numbered directory under ./runs is then made)")
    i = 2
    while _holds_run(f"{path}.{i}"):
        i += 1
    return f"{path}.{i}"


def _check_writable_dir(path: str) -> None:
    """The run directory can be made and written, before Ray starts or a checkpoint URI is
    claimed. Was: a traceback from the run log's first write, after both (a path under a
    file, a read-only filesystem; found by a new user, session 47)."""
    probe = os.path.join(path, f".elastic-write-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        raise ConfigError("run_dir", f"{path} cannot be written: {e.strerror or e}.",
                          "give a run_dir in a directory you can write (the default is "
                          "./runs/<name> under the directory the job starts in)") from None


def _run_owner(path: str) -> str | None:
    """The name of the job whose run ``path`` holds (its ``config.json``), None where it
    does not say."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            name = json.load(f).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def _newest_run(path: str) -> str | None:
    """Of a default run directory and its numbered siblings (``runs/<name>.2``, ...), the
    newest whose checkpoints (the default location) hold a committed step: what a resume of
    the job goes on from (None: none has one). Was: always the first, so a second run's checkpoints were passed
    over for the first run's (found by review, session 44)."""
    from ..checkpoint import CheckpointStore, committed_steps

    runs, i = [path], 2
    while _holds_run(f"{path}.{i}"):
        runs.append(f"{path}.{i}")
        i += 1
    for run in reversed(runs):
        ck = os.path.join(run, "checkpoints")
        if os.path.isdir(ck) and committed_steps(CheckpointStore(os.path.abspath(ck))):
            return run
    return None
