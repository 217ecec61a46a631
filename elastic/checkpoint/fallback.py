"""Which checkpoint to restore: the newest one that is intact, falling back past bad ones.

``check_steps(store)`` says, for the committed steps newest first, whether each verifies
(its manifest and every shard's index; with ``deep`` every data checksum too) and, when not,
which object is bad: the step and the shard file (``None``: the manifest). It is what a
controller needs to choose, and to explain its choice in an event.

``find_latest_valid`` and ``load_latest_valid`` are built on it. A checkpoint that is corrupt
(``CheckpointCorruptError``) or otherwise unusable (a missing manifest, a newer format, a
missing key) is skipped with a ``CheckpointWarning``, a log warning and a note naming it. The
storage failing (``StorageError``: unreachable, denied) is not a bad checkpoint: it is raised,
so an outage never turns into a silent restart from an older step or from scratch.

With several ranks: the controller picks the step (``find_latest_valid``: shallow, cheap),
every rank loads its rows of that manifest, and a rank that still meets corruption in data it
reads raises ``CheckpointCorruptError`` (its ``step`` and ``shard`` attributes name the bad
object); the controller then calls ``find_latest_valid(store, exclude={step, ...})`` and
restores again, so all ranks restore the same step.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from elastic.checkpoint.manifest import Manifest, committed_steps, read_manifest
from elastic.checkpoint.reader import CheckpointReader, Want
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointCorruptError, CheckpointError, StorageError

__all__ = [
    "CheckpointWarning",
    "StepCheck",
    "LoadResult",
    "check_steps",
    "find_latest_valid",
    "load_latest_valid",
]

log = logging.getLogger("elastic.checkpoint")


class CheckpointWarning(UserWarning):
    """A committed checkpoint was skipped because it is unreadable or corrupt."""


@dataclass(frozen=True)
class StepCheck:
    """The verdict on one committed step. ``ok`` with its ``manifest``; else ``problem`` (the
    first one found, redacted), ``corrupt`` (its bytes or files do not match its manifest,
    as opposed to unusable: a manifest deleted meanwhile, a newer format), and ``shard``: the
    bad shard file relative to the step directory, None when the manifest is the bad object."""

    step: int
    ok: bool
    manifest: Manifest | None = None
    problem: str | None = None
    corrupt: bool = False
    shard: str | None = None

    @property
    def bad_object(self) -> str:
        """``step-000000000020/shard-00001-1f2e3d4c.bin`` (or ``.../manifest.json``)."""
        return f"{CheckpointStore.step_name(self.step)}/{self.shard or 'manifest.json'}"

    @property
    def note(self) -> str:
        """One line for logs and events: which checkpoint was skipped, which object, why."""
        return f"checkpoint step {self.step} skipped ({self.bad_object}): {self.problem}"

    @staticmethod
    def failed(step: int, err: CheckpointError) -> StepCheck:
        shard = getattr(err, "shard", None)
        return StepCheck(step, False, problem=str(err),
                         corrupt=isinstance(err, CheckpointCorruptError),
                         shard=shard if isinstance(shard, str) else None)


def _check(store: CheckpointStore, step: int, deep: bool) -> StepCheck:
    """One step's verdict; ``StorageError`` propagates."""
    try:
        with CheckpointReader(store, read_manifest(store, step)) as r:
            r.indices()
            problems = r.verify_errors() if deep else []
            for e in problems:
                if isinstance(e, StorageError):
                    raise e
            if problems:
                return StepCheck.failed(step, problems[0])
            return StepCheck(step, True, manifest=r.manifest)
    except StorageError:
        raise
    except CheckpointError as e:
        return StepCheck.failed(step, e)


def check_steps(
    store: CheckpointStore,
    *,
    deep: bool = False,
    exclude: Iterable[int] = (),
    until_valid: bool = False,
) -> list[StepCheck]:
    """The committed steps (except ``exclude``), newest first, each checked: its manifest
    and every shard's index (reads a few KB per shard); with ``deep``, every data byte
    against its checksum too. ``until_valid`` stops after the first intact one. Raises
    ``StorageError`` when the storage fails (listing or reading), never for a bad
    checkpoint."""
    skip = set(exclude)
    out: list[StepCheck] = []
    for step in reversed(committed_steps(store)):
        if step in skip:
            continue
        out.append(_check(store, step, deep))
        if until_valid and out[-1].ok:
            break
    return out


def _skip(check: StepCheck, notes: list[str]) -> None:
    notes.append(check.note)
    log.warning("%s", check.note)
    warnings.warn(check.note, CheckpointWarning, stacklevel=3)


def find_latest_valid(
    store: CheckpointStore, *, deep: bool = False, exclude: Iterable[int] = ()
) -> tuple[Manifest | None, list[str]]:
    """The newest committed checkpoint whose manifest and shard indices are sound (and, with
    ``deep``, every data checksum), skipping ``exclude``; plus one note per checkpoint
    skipped, naming its step, the bad object and the problem. ``(None, notes)`` if there is
    none. ``StorageError`` if the storage fails."""
    notes: list[str] = []
    for check in check_steps(store, deep=deep, exclude=exclude, until_valid=True):
        if check.ok:
            return check.manifest, notes
        _skip(check, notes)
    return None, notes


@dataclass(frozen=True)
class LoadResult:
    state: dict[str, torch.Tensor]
    manifest: Manifest
    notes: list[str]

    @property
    def step(self) -> int:
        return self.manifest.step


def load_latest_valid(
    store: CheckpointStore,
    want: Want = None,
    *,
    strict: bool = True,
    exclude: Iterable[int] = (),
) -> LoadResult | None:
    """Load ``want`` from the newest committed checkpoint that loads cleanly, falling back to
    older ones (each skip: ``CheckpointWarning``, log warning, a note in the result naming
    the step and the bad object).

    Returns None if there is no committed checkpoint at all; raises ``CheckpointError`` (with
    every note) if there are some but none loads, ``StorageError`` if the storage fails. A
    missing key with ``strict`` counts as a bad checkpoint too.
    """
    notes: list[str] = []
    skip = set(exclude)
    steps = [s for s in reversed(committed_steps(store)) if s not in skip]
    for step in steps:
        try:
            with CheckpointReader(store, read_manifest(store, step)) as r:
                return LoadResult(r.read(want, strict=strict), r.manifest, notes)
        except StorageError:
            raise
        except CheckpointError as e:
            _skip(StepCheck.failed(step, e), notes)
    if not steps:
        return None
    raise CheckpointError(
        f"no committed checkpoint under {store.uri} could be loaded: " + " | ".join(notes)
    )
