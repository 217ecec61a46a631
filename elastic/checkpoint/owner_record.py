"""The owner record of a checkpoint URI: ``<root>/owner.json``, which job may write there.

Plain data and one reader, shared by ``ownership`` (claims) and ``manifest`` (a commit that
names an owner re-reads the record, so a job that lost a non-atomic claim race cannot commit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError

__all__ = ["OWNER_NAME", "OwnerRecord", "read_owner"]

OWNER_NAME = "owner.json"
FORMAT = "elastic-owner"
VERSION = 1


@dataclass(frozen=True)
class OwnerRecord:
    """The owner record of a checkpoint URI (plain data)."""

    job: str
    created: str
    created_unix: float
    host: str
    pid: int
    nonce: str

    def to_json(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, **self.__dict__}
        return json.dumps(doc, indent=1).encode()

    @staticmethod
    def from_json(raw: bytes, where: str) -> OwnerRecord:
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else doc!r}")
            if doc.get("version") != VERSION:
                raise CheckpointError(f"{where}: owner record version {doc.get('version')!r} "
                                      f"is not supported (this elastic reads {VERSION}); "
                                      "upgrade elastic")
            return OwnerRecord(str(doc["job"]), str(doc["created"]), float(doc["created_unix"]),
                               str(doc.get("host", "?")), int(doc.get("pid", 0)),
                               str(doc.get("nonce", "")))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{where} is not an elastic owner record ({type(e).__name__}: {e}). Fix: "
                "delete it if no job writes to this URI any more") from None


def read_owner(store: CheckpointStore) -> OwnerRecord | None:
    """The owner record of ``store``, or None if it has none. ``CheckpointError`` for a
    record that is not one; ``StorageError`` if the storage fails."""
    path = store.path(OWNER_NAME)
    try:
        with store.fs.open_input_file(path) as f:
            raw = f.read_at(min(f.size(), 1 << 20), 0) if f.size() else b""
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise store.error(f"reading the owner record {store.uri}/{OWNER_NAME} failed", e) from None
    return OwnerRecord.from_json(raw, f"{store.uri}/{OWNER_NAME}")
