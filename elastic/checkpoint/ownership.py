"""Who may write a checkpoint URI: one job claims it, others are refused up front.

Two jobs writing one ``checkpoint_uri`` overwrite each other's steps, and a later resume of
one loads the other's weights. So a job claims its URI before it writes there: an owner
record ``<root>/owner.json`` holding the job's identity (its name), created only if absent::

    {"format": "elastic-owner", "version": 1, "job": "my-job", "created": "...",
     "created_unix": 1795000000.0, "host": "node-1", "pid": 4242, "nonce": "..."}

* ``claim(store, job)`` creates the record, or finds one naming ``job`` (a restart or resume
  of the same job: allowed). A record naming another job, or, on a URI written before owner
  records existed, a newest manifest naming another job, raises ``CheckpointOwnerError``
  with the fix. Nothing is written in that case.
* ``check_owner(manifest_or_store, job)``: before resuming from the job's own URI, the
  checkpoint must be the job's (``Manifest.job``: the manifest's ``owner``, or ``extra.job``
  for older manifests).
* Forking is explicit: ``resume=`` another job's URI while writing to one's own.
  ``check_resume(source, manifest, job, own=store)`` tells a fork (allowed, whoever wrote it)
  from a resume of one's own URI (checked).
* ``release(store, job)`` deletes the record if ``job`` holds it.

Atomicity of the create-if-absent: on a local disk the record is written to a temporary file
and hard-linked into place (``link(2)`` fails if the name exists; ``O_EXCL`` where links are not
supported); on S3 it is one ``PutObject`` with ``If-None-Match: *`` (AWS S3 since 2024, MinIO,
moto 5), sent with boto3 because pyarrow's S3 filesystem has no conditional write. Where
neither is available (boto3 not installed, a store that answers ``501`` to the header, GCS
and other filesystems) the claim checks, writes, and reads the record back; two jobs starting
within that window can both believe they hold the URI, and ``commit`` (which re-reads the
record when the manifest names an owner) refuses the loser's first checkpoint.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from elastic.checkpoint.manifest import Manifest, committed_steps, read_manifest
from elastic.checkpoint.owner_record import OWNER_NAME, OwnerRecord, read_owner
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError, CheckpointOwnerError

__all__ = [
    "OWNER_NAME",
    "OwnerRecord",
    "Claim",
    "ResumeCheck",
    "claim",
    "read_owner",
    "check_owner",
    "check_resume",
    "release",
]

_NOT_SUPPORTED = object()  # the storage cannot create-if-absent: use check-then-write


@dataclass(frozen=True)
class Claim:
    """A job's hold on a checkpoint URI. ``fresh``: this call created the record (False:
    the job held it already: a restart or a resume). ``atomic``: the record was created
    by an atomic create-if-absent (False: check-then-write, or not created by this call)."""

    uri: str
    job: str
    record: OwnerRecord
    fresh: bool
    atomic: bool


@dataclass(frozen=True)
class ResumeCheck:
    """What ``check_resume`` found: ``fork`` (the source is another URI than the job's own;
    allowed whoever wrote it) and ``source_owner``: the job that wrote the checkpoint, if
    recorded (for a "forked from job X" event)."""

    fork: bool
    source_owner: str | None


def _new_record(job: str, clock: Callable[[], float]) -> OwnerRecord:
    now = clock()
    return OwnerRecord(job, datetime.fromtimestamp(now, timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"), now, socket.gethostname(), os.getpid(), uuid.uuid4().hex)


def _latest_writer(store: CheckpointStore) -> tuple[str | None, int | None]:
    """The job that wrote the newest readable committed checkpoint (for URIs written before
    owner records existed), and its step."""
    for step in reversed(committed_steps(store)):
        try:
            return read_manifest(store, step).job, step
        except CheckpointError:
            continue
    return None, None


def _refusal(store: CheckpointStore, job: str, owner: str, how: str) -> CheckpointOwnerError:
    uri = store.uri
    return CheckpointOwnerError(
        f"checkpoint URI {uri} belongs to job {owner!r} ({how}); job {job!r} may not write "
        "there: two jobs on one URI overwrite each other's checkpoints. Fix: give this job "
        f"its own checkpoint_uri; to continue job {owner!r}, run it with name: {owner}; to "
        f"start from its checkpoints, set resume: {uri} and a checkpoint_uri of this job's "
        f"own (a fork); if job {owner!r} is gone for good, delete {uri}/{OWNER_NAME}.",
        owner=owner)


def claim(store: CheckpointStore, job: str, *, clock: Callable[[], float] = time.time) -> Claim:
    """Claim ``store`` for ``job`` (its identity: the job's name) before writing anything
    there. Returns the ``Claim``; the same job claiming again is allowed (``fresh=False``)
    and takes the URI over: a new nonce, which an earlier run's commits then lack.

    Raises ``CheckpointOwnerError`` (nothing written) when another job holds the URI, or,
    without an owner record, wrote its newest committed checkpoint; ``StorageError`` when the
    storage fails; ``CheckpointError`` for an unreadable owner record.
    """
    if not job or not isinstance(job, str):
        raise CheckpointError(f"claim needs a job identity (the job's name), got {job!r}")
    held = read_owner(store)
    if held is None:
        writer, step = _latest_writer(store)
        if writer is not None and writer != job:
            raise _refusal(store, job, writer,
                           f"it wrote checkpoint step {step} there, before owner records")
        record = _new_record(job, clock)
        created = _create_if_absent(store, record.to_json())
        if created is True:
            return Claim(store.uri, job, record, fresh=True, atomic=True)
        if created is _NOT_SUPPORTED:
            created = _check_then_write(store, record)
            if created:
                return Claim(store.uri, job, record, fresh=True, atomic=False)
        held = read_owner(store)  # another claim won the race
        if held is None:
            raise store.error(f"the owner record {store.uri}/{OWNER_NAME} vanished while "
                              "claiming; another job is claiming this URI. Retry")
    if held.job != job:
        raise _refusal(store, job, held.job, f"claimed {held.created} from host {held.host}")
    # the same job again (a restart, a resume): this run takes the URI over with a nonce of
    # its own, so that an earlier run of it still going (a driver cut off, not dead) can no
    # longer commit there (``commit(..., nonce=)``); last writer wins
    record = _new_record(job, clock)
    _write_owner(store, record)
    return Claim(store.uri, job, record, fresh=False, atomic=False)


def release(store: CheckpointStore, job: str) -> bool:
    """Delete the owner record if ``job`` holds it; True if deleted. Another job's record is
    left alone (``CheckpointOwnerError``)."""
    held = read_owner(store)
    if held is None:
        return False
    if held.job != job:
        raise _refusal(store, job, held.job, f"claimed {held.created} from host {held.host}")
    try:
        store.fs.delete_file(store.path(OWNER_NAME))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        raise store.error(f"deleting {store.uri}/{OWNER_NAME} failed", e) from None
    return True


def check_owner(source: Manifest | CheckpointStore, job: str) -> str | None:
    """Before ``job`` resumes from its own URI: the checkpoint (a ``Manifest``), or the URI
    (a store: its owner record, else its newest manifest), must be ``job``'s or carry no
    owner (written before owners were recorded, or by a test). Returns the owner found
    (None: none recorded). Raises ``CheckpointOwnerError`` naming the owner and the fix."""
    if isinstance(source, Manifest):
        owner, where = source.job, f"checkpoint step {source.step}"
    else:
        held = read_owner(source)
        if held is not None:
            owner = held.job
        else:
            owner, _ = _latest_writer(source)
        where = f"checkpoint URI {source.uri}"
    if owner is not None and owner != job:
        raise CheckpointOwnerError(
            f"{where} belongs to job {owner!r}, not to job {job!r}: resuming it as this job's "
            f"own would continue another job's run. Fix: to continue job {owner!r}, run it "
            f"with name: {owner}; to start this job from that checkpoint, set resume to its "
            "URI and a checkpoint_uri of this job's own (a fork)", owner=owner)
    return owner


def check_resume(source: CheckpointStore, manifest: Manifest, job: str, *,
                 own: CheckpointStore | None) -> ResumeCheck:
    """Whether ``job``, which writes to ``own``, may resume from ``manifest`` found in
    ``source``. The same place as ``own`` (or no ``own``): the job's own checkpoints, checked
    with ``check_owner``. Another place: an explicit fork, allowed whoever wrote it. Raises
    ``CheckpointOwnerError`` for another job's checkpoint in the job's own URI."""
    if own is None or source.same_place(own):
        return ResumeCheck(False, check_owner(manifest, job))
    return ResumeCheck(True, manifest.job)


# --------------------------------------------------------------------------- create-if-absent


def _create_if_absent(store: CheckpointStore, data: bytes) -> Any:
    """True: created; False: the record exists; ``_NOT_SUPPORTED``: this storage cannot
    create-if-absent atomically."""
    if store.kind == "local":
        return _create_local(store, data)
    if store.kind == "s3":
        return _create_s3(store, data)
    return _NOT_SUPPORTED


def _create_local(store: CheckpointStore, data: bytes) -> Any:
    path = store.path(OWNER_NAME)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        store.ensure_dir(store.root)
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)  # atomic, fails if the name exists, the content is whole
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                               errno.EMLINK):
                raise
        try:  # no hard links here: exclusive create (a reader may see it before it is whole)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    except (OSError, ValueError) as e:
        raise store.error(f"claiming {store.uri} (writing {OWNER_NAME}) failed", e) from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _s3_client(store: CheckpointStore) -> Any:
    """A boto3 S3 client with the store's endpoint, region, credentials and timeouts; None
    when boto3 is missing, the store's options are unknown (built on a given filesystem), or
    an option has no boto3 equivalent (an assumed role, a proxy)."""
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        return None
    opts = store.options
    if opts is None or {"role_arn", "session_name", "external_id", "proxy_options"} & set(opts):
        return None
    cfg: dict[str, Any] = {}
    kw: dict[str, Any] = {}
    if opts.get("endpoint_override"):
        kw["endpoint_url"] = f"{opts.get('scheme', 'https')}://{opts['endpoint_override']}"
        cfg["s3"] = {"addressing_style": "virtual" if opts.get("force_virtual_addressing")
                     else "path"}
    if opts.get("region"):
        kw["region_name"] = opts["region"]
    for ours, theirs in (("access_key", "aws_access_key_id"),
                         ("secret_key", "aws_secret_access_key"),
                         ("session_token", "aws_session_token")):
        if opts.get(ours):
            kw[theirs] = opts[ours]
    if opts.get("anonymous"):
        cfg["signature_version"] = UNSIGNED
    if opts.get("connect_timeout") is not None:
        cfg["connect_timeout"] = float(opts["connect_timeout"])
    if opts.get("request_timeout") is not None:
        cfg["read_timeout"] = float(opts["request_timeout"])
    if opts.get("retries") is not None:
        cfg["retries"] = {"max_attempts": int(opts["retries"]), "mode": "standard"}
    if opts.get("tls_ca_file_path"):
        kw["verify"] = opts["tls_ca_file_path"]
    return boto3.client("s3", config=Config(**cfg), **kw)


def _create_s3(store: CheckpointStore, data: bytes) -> Any:
    client = _s3_client(store)
    if client is None:
        return _NOT_SUPPORTED
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = store.root.partition("/")
    key = f"{prefix}/{OWNER_NAME}" if prefix else OWNER_NAME
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        if code == "NotImplemented" or status == 501:
            return _NOT_SUPPORTED
        raise store.error(f"claiming {store.uri} (writing {OWNER_NAME}) failed",
                          OSError(f"{code}: {e}")) from None
    except BotoCoreError as e:
        raise store.error(f"claiming {store.uri} (writing {OWNER_NAME}) failed",
                          OSError(str(e))) from None


def _write_owner(store: CheckpointStore, record: OwnerRecord) -> None:
    path = store.path(OWNER_NAME)
    try:
        store.ensure_dir(store.root)
        # replaced whole or not at all (was: rewritten in place, so a full disk left a
        # truncated record that failed every later claim and commit)
        store.write_atomic(path, record.to_json())
    except (OSError, ValueError) as e:
        raise store.error(f"claiming {store.uri} (writing {OWNER_NAME}) failed", e) from None


def _check_then_write(store: CheckpointStore, record: OwnerRecord) -> bool:
    """The best a store without create-if-absent allows: write if absent, then read back;
    True if the record read back is ours."""
    if read_owner(store) is not None:
        return False
    _write_owner(store, record)
    back = read_owner(store)
    return back is not None and back.nonce == record.nonce
