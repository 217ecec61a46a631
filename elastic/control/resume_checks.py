"""Checks on a job's start against the checkpoints it would go on from or write over:
one run's steps per URI (``refuse_newer``, ``check_claimed``), the same model
(``model_unlike``) and the same sample stream (``sampling_changed``, ``recheck_length``).
``CheckpointTracker`` (``checkpoints.py``) runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..checkpoint import CheckpointStore, committed_steps
from ..errors import ConfigError

__all__ = ["refuse_newer", "model_unlike", "sampling_changed", "recheck_length",
           "check_claimed"]

Emit = Callable[..., Any]


def refuse_newer(store: CheckpointStore, step: int, field: str, bad: set[int]) -> None:
    """A job's own URI holds one run's steps: refuse to go on from ``step`` there while
    checkpoints newer than it (and not in ``bad``) are committed (a rewind would write its
    steps over them; retention keeps the newest steps, theirs; a recovery or a later
    ``resume: latest`` would take them)."""
    newer = _newer(store, step, bad)
    if not newer:
        return
    there = (f"steps {newer[0]} .. {newer[-1]}" if len(newer) > 1 else f"step {newer[0]}")
    first = f"{store.uri}/{store.step_name(newer[0])}"
    if step < 0:
        raise ConfigError(
            field, f"{store.uri} already holds committed checkpoints ({there}); a run "
            "that does not go on from them (a fresh start, or a fork from another URI) "
            "would write its steps over them, and mix with them in retention, recovery "
            "and a later resume.",
            f"set resume: latest to go on from step {newer[-1]} (resume: auto also starts "
            "fresh where none is), give this run another checkpoint_uri, or delete the step-* "
            f"directories there ({first} ...)")
    raise ConfigError(
        field, f"step {step} is not the newest checkpoint at {store.uri}: {there} came "
        "after it, and going on from it there would write over them and mix with them in "
        "retention, recovery and a later resume.",
        f"keep resume and give this run a checkpoint_uri of its own (a fork), or delete "
        f"the newer step-* directories ({first} ...) to go back to step {step} here")


def model_unlike(store: Any, manifest: Any, model: Any) -> None:
    """``ConfigError`` naming ``resume`` when the checkpoint's model entries (``model/<name>``,
    read from its shards' indices only) are not ``model``'s state at its shapes. Was: found
    on the workers, at the load, after the cluster was up (found by review, session 43)."""
    from ..checkpoint import CheckpointReader

    with CheckpointReader(store, manifest) as reader:
        have = {k[len("model/"):]: tuple(m.full_shape) for k, m in reader.tensors().items()
                if k.startswith("model/")}
    from torch.nn.parameter import is_lazy

    state = model.state_dict()
    want = {k: tuple(v.shape) for k, v in state.items() if not is_lazy(v)}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(state))  # (a lazy module's: its shape is the data's)
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    if not (missing or extra or shapes):
        return
    said = [f"{k} is {list(have[k])} there, {list(want[k])} here" for k in shapes[:3]]
    said += [f"it lacks {', '.join(missing[:3])}"] if missing else []
    said += [f"it has {', '.join(extra[:3])}, which this model does not"] if extra else []
    raise ConfigError("resume", f"checkpoint step {manifest.step} ({store.uri}) holds another "
                      f"model than this job's: {'; '.join(said)}.",
                      "resume with the model (and its settings) the checkpoint was trained "
                      "with, or drop resume to start this model fresh")


def sampling_changed(manifest: Any, cfg: Any) -> tuple[str, str, str] | None:
    """Whether ``cfg`` draws its samples otherwise than the run that wrote ``manifest``: a
    step number is a place in the sample stream (step s trains positions s*G .. s*G+G-1 of
    the seeded order, a permutation of the dataset's length) only under the global batch
    size, seed and length it was trained with. (field, problem, fix), or None."""
    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    rng = manifest.rng if isinstance(manifest.rng, dict) else {}
    step = manifest.step
    fork = ("fork into a checkpoint_uri of this run's own to start a new run from its "
            "weights")
    for field, was, now in (("global_batch_size", extra.get("global_batch_size"),
                             cfg.global_batch_size), ("seed", rng.get("seed"), cfg.seed)):
        if was is not None and was != now:
            return (field, f"is {now}, but checkpoint step {step} was trained with {field} "
                    f"{was}: going on from step {step} under {now} would skip samples of its "
                    "order or train some twice, not the run it continues.",
                    f"resume with {field}: {was} (the global batch stays whatever the world "
                    f"size; each worker's share follows it), or {fork}")
    was, now = extra.get("dataset_length"), getattr(cfg, "dataset_length", None)
    if was is not None and now is not None and was != now:
        return ("dataset", f"has {now} samples, but checkpoint step {step} was trained on "
                f"{was}: the sample order is a permutation of the length, so going on from "
                f"step {step} would draw another order, not the run it continues.",
                f"resume with the dataset it was trained on, or {fork}")
    return None


def recheck_length(resume: tuple[CheckpointStore, int], cfg: Any, own: CheckpointStore | None,
                   emit: Emit) -> None:
    """The planned resume (store, step) against ``cfg``'s dataset length once it is known (a
    Ray dataset's pipeline ran after the plan): refused as ``find_resume`` refuses, or said
    for a fork. Was: not checked, so a Ray dataset that changed length between runs drew
    another order from the resumed step, some samples twice and some never (found by review,
    session 44)."""
    from ..checkpoint import read_manifest

    store, step = resume
    why = sampling_changed(read_manifest(store, step), cfg)
    if why is None or why[0] != "dataset":  # (the batch and seed were checked at the plan)
        return
    if own is not None and store.same_place(own):
        raise ConfigError(why[0], why[1], why[2])
    emit("resume_sampling", f"{why[0]}: {why[1]}", data={"field": why[0]})


def check_claimed(store: CheckpointStore, planned: tuple[CheckpointStore, int] | None,
                  bad: set[int], job: str) -> None:
    """Until the claim an earlier run of the job still alive (a driver cut off, a pod
    terminating) could commit steps the start's plan (``planned``: a resume's store and step,
    None: a fresh start) did not see: one that did is refused (its commits are now; the next
    start goes on from its newest). Was: this run went on from the older step, and
    retention, a recovery or the next resume took the other run's newer ones (found by
    review, session 44)."""
    at = planned[1] if planned is not None and planned[0].same_place(store) else -1
    newer = _newer(store, at, bad)
    if newer:
        raise ConfigError(
            "resume" if at >= 0 else "checkpoint_uri",
            f"{store.uri}: step {newer[-1]} was committed by an earlier run of job {job} "
            "while this one started (it holds the URI no more: its later commits are "
            "refused).", f"start the job again once that run has ended: resume: latest goes "
            f"on from step {newer[-1]}")


def _newer(store: CheckpointStore, step: int, bad: set[int]) -> list[int]:
    """Committed steps of ``store`` after ``step`` and not found corrupt, oldest first."""
    return [s for s in committed_steps(store) if s > step and s not in bad]
