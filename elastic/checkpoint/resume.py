"""What a job resumes from: a job's ``resume`` setting turned into one checked checkpoint.

``plan_resume(resume, job, own=store)`` reads ``resume`` (``"latest"``: the job's own
checkpoints; a URI: a checkpoint root, or one step's directory ``.../step-000000000100``),
picks the newest intact checkpoint there (falling back past corrupt ones; ``skipped`` says
which and why), checks that a checkpoint in the job's own URI is the job's, tells an
explicit fork (another URI: allowed whoever wrote it) from a resume, and refuses a
checkpoint already at or past ``max_steps``. The controller turns the plan into events and
a restore; every rank then loads ``plan.manifest``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from elastic.checkpoint.fallback import StepCheck, check_steps
from elastic.checkpoint.location import OWN_RESUMES, split_step_dir
from elastic.checkpoint.manifest import Manifest, nothing_found, read_manifest
from elastic.checkpoint.ownership import check_resume
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError, ConfigError

__all__ = ["ResumePlan", "plan_resume", "resume_store"]

log = logging.getLogger("elastic.checkpoint")


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint to resume from. ``fork``: it is in another URI than the job's own
    (``source_owner`` wrote it, if recorded); ``skipped``: newer steps passed over, each
    naming its bad object (``StepCheck.note``)."""

    store: CheckpointStore
    manifest: Manifest
    fork: bool
    source_owner: str | None
    skipped: tuple[StepCheck, ...] = ()

    @property
    def step(self) -> int:
        return self.manifest.step


def resume_store(resume: str, own: CheckpointStore | None,
                 options: Mapping[str, Any] | None = None) -> tuple[CheckpointStore, int | None]:
    """The store ``resume`` names and the step it pins (None: the newest intact one).
    ``"latest"`` (and ``"auto"``) is ``own``; a URI ending in ``step-<n>`` pins step n of
    its parent."""
    if resume in OWN_RESUMES:
        if own is None:
            raise ConfigError("resume", "'latest' needs the job's checkpoint store.",
                              "set checkpoint_uri, or resume from a URI")
        return own, None
    root, step = split_step_dir(resume)
    return CheckpointStore(root, dict(options or {})), step


def plan_resume(resume: str, job: str, *, own: CheckpointStore | None,
                options: Mapping[str, Any] | None = None, exclude: Iterable[int] = (),
                max_steps: int | None = None) -> ResumePlan:
    """Turn ``resume`` into a checked ``ResumePlan`` for ``job`` (its identity), which writes
    to ``own``; ``options`` are the store options for a ``resume`` URI, ``exclude`` steps a
    restore already found corrupt.

    Raises ``CheckpointError`` when there is no checkpoint to resume from (saying why),
    ``CheckpointCorruptError`` for a pinned step that is corrupt, ``CheckpointOwnerError``
    for another job's checkpoint in the job's own URI, ``StorageError`` when the storage
    fails, ``ConfigError`` when the checkpoint is already at or past ``max_steps``."""
    store, step = resume_store(resume, own, options)
    skipped: tuple[StepCheck, ...] = ()
    if step is not None:
        manifest = read_manifest(store, step)
    else:
        checks = check_steps(store, exclude=exclude, until_valid=True)
        good = [c for c in checks if c.ok]
        skipped = tuple(c for c in checks if not c.ok)
        for c in skipped:
            log.warning("%s", c.note)
        if not good:
            why = ("; ".join(c.note for c in skipped) if skipped else nothing_found(store))
            fix = (", or drop resume to start fresh" if "Fix:" in why  # (one fix, said once)
                   else ". Fix: check the URI, or drop resume to start fresh")
            raise CheckpointError(f"resume={store.redact(resume)!r}: no intact committed "
                                  f"checkpoint under {store.uri}: {why}{fix}")
        assert good[0].manifest is not None
        manifest = good[0].manifest
    verdict = check_resume(store, manifest, job, own=own)
    if max_steps is not None and manifest.step >= max_steps:
        raise ConfigError("max_steps", f"the checkpoint to resume from ({store.uri}, step "
                          f"{manifest.step}) is already at or past max_steps {max_steps}: "
                          "nothing would be trained.",
                          f"raise max_steps above {manifest.step}, or start from an earlier "
                          "step into a checkpoint_uri of this run's own (resume: "
                          "<uri>/step-<12 digits>, a fork)")
    return ResumePlan(store, manifest, verdict.fork, verdict.source_owner, skipped)
