"""Controller side: the manifest, the atomic commit, listing and retention.

A checkpoint is ``<root>/step-<12 digits>/`` holding ``shard-<rank>-<attempt>.bin`` files
(``shard-<rank>.bin`` before the attempt part) and, once committed, ``manifest.json``. The
manifest is written last, in one piece (one PUT on an object store; a temporary file renamed
into place on a local disk), so it is either absent or complete. Each upload writes files
of its own, so a step committed again (a replay) keeps its earlier commit whole until the new
manifest replaces it; the files no manifest names are then deleted. Only directories with a
manifest are checkpoints: listing, loading and tools ignore everything else. Retention
deletes a checkpoint's manifest before its shards, so a half-deleted checkpoint is never
visible.

Manifest (``manifest.json``, UTF-8 JSON)::

    {"format": "elastic-checkpoint", "version": 1, "step": 120, "world_size": 2,
     "created": "2026-11-29T12:00:00Z", "created_unix": 1795000000.0, "owner": "my-job",
     "strategy": "ddp", "plan": {...}, "data_position": {...}, "rng": {...}, "extra": {...},
     "shards": [{"rank": 0, "path": "shard-00000-1f2e3d4c.bin", "size": 123, "checksum": "sha256:..",
                 "index_offset": 64, "index_length": 40, "items": 3, "data_bytes": 64}, ...]}

Thread safety: these are plain functions over an immutable store; concurrent ``commit`` of the
same step from two controllers is not supported (there is one controller per job).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from elastic.checkpoint.location import is_secret_key
from elastic.checkpoint.owner_record import read_owner
from elastic.checkpoint.store import CheckpointStore, corrupt_error, parse_step_name
from elastic.checkpoint.upload import ShardInfo
from elastic.errors import CheckpointError, CheckpointOwnerError

__all__ = [
    "MANIFEST_NAME",
    "CheckpointMeta",
    "ShardRecord",
    "Manifest",
    "commit",
    "committed_steps",
    "read_manifest",
    "resolve_step",
    "nothing_found",
    "discard",
    "apply_retention",
]

log = logging.getLogger("elastic.checkpoint")

MANIFEST_NAME = "manifest.json"
FORMAT = "elastic-checkpoint"
VERSION = 1
_SAFE_PATH = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


@dataclass(frozen=True)
class CheckpointMeta:
    """What the controller knows about a step, stored in the manifest as plain JSON.

    ``rng`` holds JSON-able RNG states (seeds, counters); large RNG tensors (torch's 5 KB
    generator state) go into a shard under keys such as ``"rng/rank0/cpu"`` instead.
    Values under keys that look like secrets are replaced by ``***`` when written.
    ``owner`` is the identity of the job that wrote the checkpoint (``ownership.claim``);
    resume checks it (``ownership.check_owner``).
    """

    plan: Mapping[str, Any] = field(default_factory=dict)
    world_size: int | None = None
    data_position: Any = None
    rng: Any = None
    strategy: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    owner: str | None = None

    @staticmethod
    def of(meta: CheckpointMeta | Mapping[str, Any] | None) -> CheckpointMeta:
        if meta is None:
            return CheckpointMeta()
        if isinstance(meta, CheckpointMeta):
            return meta
        known = set(CheckpointMeta.__dataclass_fields__)
        unknown = sorted(set(meta) - known)
        if unknown:
            raise CheckpointError(
                f"unknown checkpoint meta field(s) {unknown}; use "
                f"{sorted(known)} (put anything else under 'extra')"
            )
        return CheckpointMeta(**dict(meta))


@dataclass(frozen=True)
class ShardRecord:
    rank: int
    path: str
    size: int
    checksum: str
    index_offset: int
    index_length: int
    items: int
    data_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ShardRecord.__dataclass_fields__}


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's manifest (immutable)."""

    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    created: str
    created_unix: float
    strategy: str | None = None
    plan: Mapping[str, Any] = field(default_factory=dict)
    data_position: Any = None
    rng: Any = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    owner: str | None = None
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def job(self) -> str | None:
        """The job that wrote this checkpoint: ``owner``, or for manifests written before
        owners were recorded, the ``extra["job"]`` the controller has always stored."""
        if self.owner:
            return self.owner
        job = self.extra.get("job") if isinstance(self.extra, Mapping) else None
        return str(job) if job else None

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "created_unix": self.created_unix,
            "owner": self.owner,
            "strategy": self.strategy,
            "plan": self.plan,
            "data_position": self.data_position,
            "rng": self.rng,
            "extra": self.extra,
            "shards": [s.to_json() for s in self.shards],
        }
        return json.dumps(doc, indent=1, allow_nan=False)

    @staticmethod
    def from_json(text: str | bytes, where: str, step: int | None = None) -> Manifest:
        """Parse and validate. ``CheckpointCorruptError`` naming ``where`` (and ``step``) for
        anything foreign, malformed, or with a shard path that escapes the checkpoint
        directory; a plain ``CheckpointError`` for a newer format version."""
        try:
            doc = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise corrupt_error(
                f"{where} is not JSON ({e}); it is not an elastic checkpoint manifest", step=step
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise corrupt_error(
                f"{where} is not an elastic checkpoint manifest (format "
                f"{got!r}, expected {FORMAT!r})",
                step=step,
            )
        if doc.get("version") != VERSION:
            raise CheckpointError(
                f"{where}: manifest version {doc.get('version')!r} is not "
                f"supported (this elastic reads version {VERSION}); "
                "upgrade elastic"
            )
        try:
            shards = tuple(_shard_record(s) for s in doc["shards"])
            m = Manifest(
                step=_int(doc["step"]),
                world_size=_int(doc["world_size"], 1),
                shards=shards,
                created=str(doc["created"]),
                created_unix=float(doc["created_unix"]),
                strategy=doc.get("strategy"),
                plan=doc.get("plan") or {},
                data_position=doc.get("data_position"),
                rng=doc.get("rng"),
                extra=doc.get("extra") or {},
                owner=_owner(doc.get("owner")),
            )
        except CheckpointError as e:
            raise corrupt_error(f"{where}: {e}", step=step) from None
        except (KeyError, TypeError, ValueError) as e:
            raise corrupt_error(
                f"{where}: malformed manifest ({type(e).__name__}: {e})", step=step
            ) from None
        ranks = sorted(s.rank for s in shards)
        if ranks != list(range(len(shards))) or not shards:
            raise corrupt_error(f"{where}: shard ranks {ranks} are not 0..n-1", step=step)
        if len(shards) != m.world_size:
            raise corrupt_error(
                f"{where}: {len(shards)} shards for world size {m.world_size}", step=step
            )
        return m


def _owner(x: Any) -> str | None:
    if x is None or isinstance(x, str):
        return x or None
    raise ValueError(f"owner {x!r} is not a string")


def _int(x: Any, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"expected an integer >= {low}, got {x!r}")
    return x


def check_shard_path(path: Any) -> str:
    """A shard path must be relative and stay inside the checkpoint directory: no ``..``, no
    absolute path, no URI or other bucket. Raises ``CheckpointError`` otherwise."""
    if (
        not isinstance(path, str)
        or not _SAFE_PATH.match(path)
        or any(part in (".", "..") for part in path.split("/"))
    ):
        raise CheckpointError(
            f"shard path {path!r} escapes the checkpoint directory; refusing to read it"
        )
    return path


def _shard_record(d: Any) -> ShardRecord:
    if not isinstance(d, dict):
        raise ValueError(f"shard entry {d!r} is not an object")
    checksum = d["checksum"]
    if not isinstance(checksum, str) or not checksum.startswith("sha256:"):
        raise ValueError(f"checksum {checksum!r} is not 'sha256:<hex>'")
    return ShardRecord(
        rank=_int(d["rank"]),
        path=check_shard_path(d["path"]),
        size=_int(d["size"]),
        checksum=checksum,
        index_offset=_int(d["index_offset"]),
        index_length=_int(d["index_length"], 1),
        items=_int(d["items"]),
        data_bytes=_int(d["data_bytes"]),
    )


def _scrub(obj: Any, store: CheckpointStore | None = None) -> Any:
    """A JSON-able copy with values under secret-looking keys replaced by ``***``, and the
    store's secrets redacted in every string."""
    if isinstance(obj, Mapping):
        return {
            str(k): (
                "***"
                if is_secret_key(k) and obj[k] is not None
                else _scrub(obj[k], store)
            )
            for k in obj
        }
    if isinstance(obj, (list, tuple)):
        return [_scrub(v, store) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        raise CheckpointError(f"checkpoint meta holds {obj}, which JSON cannot store")
    if isinstance(obj, str) and store is not None:
        return store.redact(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise CheckpointError(
        f"checkpoint meta holds a {type(obj).__name__}, which is not plain "
        "JSON data; store tensors in a shard (e.g. key 'rng/rank0/cpu')"
    )


# --------------------------------------------------------------------------- commit


def commit(
    store: CheckpointStore,
    step: int,
    shards: Sequence[ShardInfo | Mapping[str, Any]],
    meta: CheckpointMeta | Mapping[str, Any] | None = None,
    *,
    clock: Callable[[], float] = time.time,
    nonce: str | None = None,
) -> Manifest:
    """Make ``step`` visible: check every rank's shard is there with its reported size, then
    write the manifest (last, atomically). Returns the manifest written. ``nonce``: the
    writing run's claim (``Claim.record.nonce``); when given, a URI that a later run of the
    same job has taken over since is refused (``CheckpointOwnerError``).

    ``shards``: one ``ShardInfo`` (or its ``to_dict()``) per rank 0..n-1, as the workers'
    writers reported them. Raises ``CheckpointError`` (nothing is written) if a rank is
    missing or duplicated, a shard belongs to another step, a file is missing or has another
    size, or ``meta`` is not plain JSON data; ``CheckpointOwnerError`` if ``meta.owner`` is
    set and the URI's owner record names another job. Re-committing a step replaces its
    manifest.
    """
    infos = [s if isinstance(s, ShardInfo) else ShardInfo.from_dict(s) for s in shards]
    m = CheckpointMeta.of(meta)
    world = m.world_size if m.world_size is not None else len(infos)
    ranks = sorted(i.rank for i in infos)
    if ranks != list(range(world)):
        raise CheckpointError(
            f"cannot commit step {step}: shards from ranks {ranks}, "
            f"expected 0..{world - 1}; wait for every rank or abandon it"
        )
    wrong = [i.rank for i in infos if i.step != step]
    if wrong:
        raise CheckpointError(
            f"cannot commit step {step}: ranks {wrong} sent shards of another step"
        )
    records = tuple(
        ShardRecord(
            i.rank,
            check_shard_path(i.path),
            i.size,
            i.checksum,
            i.index_offset,
            i.index_length,
            i.items,
            i.data_bytes,
        )
        for i in sorted(infos, key=lambda i: i.rank)
    )
    paths = [store.path(store.step_name(step), r.path) for r in records]
    try:
        found = store.fs.get_file_info(paths)
    except (OSError, ValueError) as e:
        raise store.error(f"cannot commit step {step}: listing its shards failed", e) from None
    for r, fi in zip(records, found, strict=True):
        if fi.type != pafs.FileType.File or fi.size != r.size:
            have = "missing" if fi.type != pafs.FileType.File else f"{fi.size} bytes"
            raise store.error(
                f"cannot commit step {step}: shard {r.path} of rank {r.rank} is "
                f"{have}, expected {r.size} bytes; abandon this checkpoint"
            )
    if m.owner:
        held = read_owner(store)
        if held is not None and nonce is not None and held.job == m.owner \
                and held.nonce != nonce:
            raise CheckpointOwnerError(
                store.redact(
                    f"cannot commit step {step}: another run of job {m.owner!r} took "
                    f"{store.uri} over (claimed {held.created} from host {held.host}, pid "
                    f"{held.pid}); this run is an earlier one and must not write there. "
                    "Fix: stop this run; the newer one goes on (where it stopped at its "
                    "start, as this run committed while it started: start the job again "
                    "with resume: latest once this run has ended)"
                ),
                owner=held.job,
            )
        if held is not None and held.job != m.owner:
            raise CheckpointOwnerError(
                store.redact(
                    f"cannot commit step {step}: {store.uri} belongs to job {held.job!r} "
                    f"(claimed {held.created} from host {held.host}), not to job "
                    f"{m.owner!r}; two jobs started on one URI. Fix: give this job its own "
                    "checkpoint_uri"
                ),
                owner=held.job,
            )
    now = clock()
    strategy = m.strategy or (m.plan.get("strategy") if isinstance(m.plan, Mapping) else None)
    manifest = Manifest(
        step=int(step),
        world_size=world,
        shards=records,
        created=datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        created_unix=now,
        strategy=strategy,
        plan=_scrub(m.plan, store),
        data_position=_scrub(m.data_position, store),
        rng=_scrub(m.rng, store),
        extra=_scrub(m.extra, store),
        owner=m.owner,
    )
    # the free-form values are redacted one by one above; redacting the whole text (as
    # before) replaced a short secret inside numbers, checksums or the owner's name too,
    # and wrote a manifest that no longer read back (over a good one, on a replay)
    text = manifest.to_json()
    manifest = Manifest.from_json(text, f"manifest of step {step}", step)  # before writing
    _write_atomic(store, store.path(store.step_name(step), MANIFEST_NAME), text.encode())
    _drop_other_shards(store, step, {r.path for r in records})
    log.info(
        "committed checkpoint step %d (%d shards, %d bytes) at %s",
        step,
        len(records),
        manifest.total_bytes,
        store.uri,
    )
    return manifest


def _write_atomic(store: CheckpointStore, path: str, data: bytes) -> None:
    try:
        store.write_atomic(path, data)  # the rule ``check_writable`` probes
    except (OSError, ValueError) as e:
        raise store.error(f"writing {path} failed; the checkpoint is not committed", e) from None


_SHARD_FILE = re.compile(r"^shard-\d{5}(-[0-9a-f]+)?\.bin$")


def _drop_other_shards(store: CheckpointStore, step: int, keep: set[str]) -> None:
    """After ``step``'s manifest is written: delete the shard files of its directory that
    the manifest does not name (an earlier commit of the same step that this one replaced,
    an abandoned upload's leftovers). Best effort: a file left is invisible to every reader
    and goes with its step at retention."""
    try:
        infos = store.fs.get_file_info(pafs.FileSelector(store.step_dir(step)))
        for fi in infos:
            if (fi.type == pafs.FileType.File and _SHARD_FILE.match(fi.base_name)
                    and fi.base_name not in keep):
                store.fs.delete_file(fi.path)
    except (OSError, ValueError) as e:
        log.warning("step %d committed; removing its superseded shard files failed: %s", step,
                    store.redact(str(e)))


# --------------------------------------------------------------------------- listing


def _step_dirs(store: CheckpointStore, attempts: int = 3) -> dict[int, str]:
    for attempt in range(attempts):
        try:
            infos = store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))
            break
        except (OSError, ValueError) as e:
            # Arrow's local listing of a missing folder fails when the folder appears
            # between its failed listing and its existence check (a concurrent job's first
            # write, found by 8 concurrent claims): listed again, it is there
            if attempt == attempts - 1:
                raise store.error(f"listing checkpoints under {store.uri} failed", e) from None
    out = {}
    for fi in infos:
        step = parse_step_name(fi.base_name)
        if step is not None and fi.type == pafs.FileType.Directory:
            out[step] = fi.path
    return out


def committed_steps(store: CheckpointStore) -> list[int]:
    """Steps that have a manifest (committed checkpoints), ascending. Does not validate the
    manifests (``read_manifest`` does)."""
    dirs = _step_dirs(store)
    steps = sorted(dirs)
    try:
        infos = store.fs.get_file_info([f"{dirs[s]}/{MANIFEST_NAME}" for s in steps])
    except (OSError, ValueError) as e:
        raise store.error(f"listing checkpoints under {store.uri} failed", e) from None
    return [s for s, fi in zip(steps, infos, strict=True) if fi.type == pafs.FileType.File]


def read_manifest(store: CheckpointStore, step: int) -> Manifest:
    """Read and validate the manifest of ``step``. ``CheckpointError`` if it is missing (not
    committed, or deleted meanwhile); ``StorageError`` if the storage fails;
    ``CheckpointCorruptError`` if it is foreign, malformed, for another step, or escapes the
    checkpoint directory."""
    path = store.path(store.step_name(step), MANIFEST_NAME)
    where = f"manifest of step {step} ({store.uri}/{store.step_name(step)}/{MANIFEST_NAME})"
    try:
        with store.fs.open_input_file(path) as f:
            size = f.size()
            if size > 64 << 20:
                raise store.corrupt(f"{where} is {size} bytes, too large for a manifest", step=step)
            raw = f.read_at(size, 0) if size else b""
    except FileNotFoundError:
        raise CheckpointError(
            f"{where} does not exist: step {step} is not a committed checkpoint"
        ) from None
    except (OSError, ValueError) as e:
        raise store.error(f"reading {where} failed", e) from None
    m = Manifest.from_json(raw, store.redact(where), step)
    if m.step != step:
        raise store.corrupt(f"{where} says step {m.step}", step=step)
    return m


def nothing_found(store: CheckpointStore) -> str:
    """Why ``store`` holds no committed checkpoint, as one sentence with the fix: the path
    does not exist, is a file, is one checkpoint's own directory, holds no step directory,
    or holds only uncommitted ones. ``StorageError`` if the storage fails."""
    uri = store.uri
    try:
        kind = store.fs.get_file_info(store.root).type
        marker = store.fs.get_file_info(store.path(MANIFEST_NAME)).type
    except (OSError, ValueError) as e:
        raise store.error(f"looking for checkpoints under {uri} failed", e) from None
    if marker == pafs.FileType.File:
        step = parse_step_name(store.root.rsplit("/", 1)[-1])
        return (f"{uri} is one checkpoint's directory, not a checkpoint root. Fix: pass its "
                "parent directory" + (f" (and --which {step})" if step is not None else ""))
    if kind == pafs.FileType.NotFound:
        return f"nothing found: {uri} does not exist. Fix: check the path or URI"
    if kind == pafs.FileType.File:
        return f"{uri} is a file, not a checkpoint directory. Fix: check the path"
    dirs = sorted(_step_dirs(store))
    if not dirs:
        return (f"no checkpoint under {uri}: it holds no step-<12 digits> directory. Fix: "
                "check the path (the job's checkpoint_uri, or <run dir>/checkpoints)")
    return (f"no committed checkpoint under {uri}: {len(dirs)} step director"
            f"{'y' if len(dirs) == 1 else 'ies'} ({', '.join(map(str, dirs[:5]))}"
            f"{', ...' if len(dirs) > 5 else ''}) without a {MANIFEST_NAME}: uploads that were "
            "never committed")


def resolve_step(store: CheckpointStore, which: int | str | Manifest) -> Manifest:
    """``which``: a Manifest (returned as is), a step number, or ``"latest"``."""
    if isinstance(which, Manifest):
        return which
    if which == "latest":
        steps = committed_steps(store)
        if not steps:
            raise CheckpointError(nothing_found(store))
        return read_manifest(store, steps[-1])
    if isinstance(which, str) and which.isdigit():
        which = int(which)
    if isinstance(which, int) and not isinstance(which, bool):
        return read_manifest(store, which)
    raise CheckpointError(f"{which!r} names no checkpoint; give a step number or 'latest'")


# --------------------------------------------------------------------------- deletion


def discard(store: CheckpointStore, step: int) -> None:
    """Delete a checkpoint: its manifest first (it stops being visible), then its files."""
    d = store.step_dir(step)
    try:
        fi = store.fs.get_file_info(f"{d}/{MANIFEST_NAME}")
        if fi.type == pafs.FileType.File:
            store.fs.delete_file(f"{d}/{MANIFEST_NAME}")
        if store.fs.get_file_info(d).type != pafs.FileType.NotFound:
            store.fs.delete_dir(d)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise store.error(f"deleting checkpoint step {step} failed", e) from None


def apply_retention(
    store: CheckpointStore, keep_last: int, keep_every: int = 0, *, remove_orphans: bool = True,
    bad: Iterable[int] = (),
) -> list[int]:
    """Carry out ``clusters.policy.RetentionPolicy``: keep the newest ``keep_last`` committed
    checkpoints, every one whose step is a multiple of ``keep_every`` (0: none), and the newest
    one not in ``bad`` (steps known non-finite or unverified), so that a run whose last
    checkpoints went bad keeps its last good one; delete the others (manifest first). With
    ``remove_orphans``, also delete uncommitted step directories older than the newest
    committed one (abandoned uploads); newer ones may still be uploading and are kept.
    Returns the deleted steps. ``CheckpointError`` if ``keep_last < 1``."""
    from clusters.policy import CheckpointRecord, RetentionPolicy

    if keep_last < 1:
        raise CheckpointError(
            f"keep_last must be >= 1 (got {keep_last}); the newest checkpoint is never deleted"
        )
    steps = committed_steps(store)
    bad_steps = set(bad)
    records = [CheckpointRecord(s, finite=s not in bad_steps) for s in steps]
    doomed = list(RetentionPolicy(keep_last, keep_every).decide(records))
    if remove_orphans and steps:
        committed = set(steps)
        doomed += [s for s in _step_dirs(store) if s not in committed and s < steps[-1]]
    for s in sorted(doomed):
        discard(store, s)
        log.info("retention: deleted checkpoint step %d at %s", s, store.uri)
    return sorted(doomed)
