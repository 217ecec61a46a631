"""Checkpoint storage: sharded, pickle-free, asynchronous, committed by a manifest.

Worker side (each rank, every K steps)::

    writer = ShardWriter(store, rank)                  # once per worker
    writer.begin(step, owned_pieces(state, rank, world))  # host copy only, then background
    info = writer.poll()                               # later: ShardInfo, None, or raises
    writer.committed(step)                             # when the controller says so

Controller side::

    store = CheckpointStore(uri, options); store.check_writable()   # before workers start
    manifest = commit(store, step, infos, CheckpointMeta(plan=..., data_position=...))
    apply_retention(store, keep_last=3, keep_every=1000)
    manifest, notes = find_latest_valid(store)          # at (re)start
    state = load(store, manifest, want={key: (start, stop), ...})    # on each rank

No Ray imports here; see docs/checkpoints.md for the format and the commit protocol.
"""

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
    read_manifest,
    resolve_step,
)
from elastic.checkpoint.reader import (
    CheckpointReader,
    CheckpointWarning,
    LoadResult,
    ReadStats,
    TensorMeta,
    Want,
    find_latest_valid,
    load,
    load_latest_valid,
)
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
    "CheckpointMeta",
    "CheckpointReader",
    "CheckpointStore",
    "CheckpointSummary",
    "CheckpointWarning",
    "ExportResult",
    "LoadResult",
    "Manifest",
    "Piece",
    "ReadStats",
    "ShardInfo",
    "ShardRecord",
    "ShardWriter",
    "StorageLocation",
    "TensorMeta",
    "VerifyReport",
    "Want",
    "apply_retention",
    "assign_owners",
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
    "owned_pieces",
    "read_manifest",
    "resolve_filesystem",
    "resolve_step",
    "verify",
    "write_shard",
]
