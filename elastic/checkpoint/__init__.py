"""Checkpoint storage: sharded, pickle-free, asynchronous, committed by a manifest.

Worker side (each rank, every K steps)::

    writer = ShardWriter(store, rank)                  # once per worker
    writer.begin(step, owned_pieces(state, rank, world))  # host copy only, then background
    info = writer.poll()                               # later: ShardInfo, None, or raises
    writer.committed(step)                             # when the controller says so

Controller side::

    store = CheckpointStore(uri, options); store.check_writable()   # before workers start
    claim(store, job_name)               # CheckpointOwnerError: another job writes there
    plan = plan_resume(resume, job_name, own=store, max_steps=n)    # if resuming: the step,
                                         # fork or own, the corrupt steps skipped
    manifest = commit(store, step, infos, CheckpointMeta(plan=..., owner=job_name, ...))
    apply_retention(store, keep_last=3, keep_every=1000)
    manifest, notes = find_latest_valid(store, exclude=bad_steps)   # an in-run restore
    state = load(store, manifest, want={key: (start, stop), ...})    # on each rank

Errors: ``CheckpointCorruptError`` (a committed checkpoint does not match its manifest; its
``step`` and ``shard`` name the bad object), ``StorageError`` (the storage failed),
``CheckpointOwnerError`` (another job's URI or checkpoint), plain ``CheckpointError`` else.

No Ray imports here; see docs/checkpoints.md for the format and the commit protocol.
"""

from elastic.checkpoint.fallback import (
    CheckpointWarning,
    LoadResult,
    StepCheck,
    check_steps,
    find_latest_valid,
    load_latest_valid,
)
from elastic.checkpoint.location import StorageLocation
from elastic.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointMeta,
    Manifest,
    ShardRecord,
    apply_retention,
    commit,
    committed_steps,
    discard,
    nothing_found,
    read_manifest,
    resolve_step,
)
from elastic.checkpoint.owner_record import OWNER_NAME, OwnerRecord, read_owner
from elastic.checkpoint.ownership import (
    Claim,
    ResumeCheck,
    check_owner,
    check_resume,
    claim,
    release,
)
from elastic.checkpoint.reader import CheckpointReader, ReadStats, TensorMeta, Want, load
from elastic.checkpoint.resume import ResumePlan, plan_resume, resume_store
from elastic.checkpoint.shard_format import Piece, assign_owners, owned_pieces
from elastic.checkpoint.store import CheckpointStore, resolve_filesystem
from elastic.checkpoint.tools import (
    CheckpointSummary,
    ExportResult,
    VerifyReport,
    export,
    format_inspect,
    format_list,
    inspect,
    list_checkpoints,
    verify,
)
from elastic.checkpoint.writer import ShardInfo, ShardWriter, write_shard

__all__ = [
    "MANIFEST_NAME",
    "OWNER_NAME",
    "CheckpointMeta",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointSummary",
    "CheckpointWarning",
    "Claim",
    "ExportResult",
    "LoadResult",
    "Manifest",
    "OwnerRecord",
    "Piece",
    "ReadStats",
    "ResumeCheck",
    "ResumePlan",
    "ShardInfo",
    "ShardRecord",
    "ShardWriter",
    "StepCheck",
    "StorageLocation",
    "TensorMeta",
    "VerifyReport",
    "Want",
    "apply_retention",
    "assign_owners",
    "check_owner",
    "check_resume",
    "check_steps",
    "claim",
    "commit",
    "committed_steps",
    "discard",
    "export",
    "find_latest_valid",
    "format_inspect",
    "format_list",
    "inspect",
    "list_checkpoints",
    "load",
    "load_latest_valid",
    "nothing_found",
    "owned_pieces",
    "plan_resume",
    "read_manifest",
    "read_owner",
    "release",
    "resolve_filesystem",
    "resolve_step",
    "resume_store",
    "verify",
    "write_shard",
]
