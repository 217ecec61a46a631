"""Where checkpoints live: a pyarrow filesystem plus a path prefix, from a parsed location.

``CheckpointStore(uri, options)`` (or ``CheckpointStore(location)``, a ``StorageLocation``
parsed before) is the one handle every other module of this package takes. It resolves local
paths, ``file://``, ``s3://`` (AWS or any S3-compatible store through ``endpoint_override``),
``gs://`` and whatever else ``pyarrow.fs.FileSystem.from_uri`` knows.

Secrets: explicit credentials (``access_key``, ``secret_key``, ``session_token``,
``access_token``, ``s3://KEY:SECRET@...``, a proxy's password) are passed to pyarrow and
otherwise kept private. ``repr()``, ``uri``, every ``CheckpointError`` this package raises and
everything it writes go through ``redact()`` (``elastic.checkpoint.location``: one
implementation), which replaces their literal values with ``***``. Errors are raised ``from
None`` so a pyarrow message is never chained unredacted. Without explicit keys, pyarrow uses the
usual chain (environment, ``~/.aws``, instance metadata).

Thread safety: a store is immutable after construction; pyarrow filesystems are thread-safe,
so one store may be shared by a writer thread, reader threads and the caller. A store pickles
as its parsed location and builds a filesystem on the other side (a Ray actor, say) without
parsing the URI again.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow.fs as pafs

from elastic.checkpoint.location import (
    SECRET_OPTIONS,
    StorageLocation,
    collect_secrets,
    resolve_filesystem,
)
from elastic.errors import CheckpointCorruptError, CheckpointError, StorageError

__all__ = ["CheckpointStore", "StorageLocation", "resolve_filesystem", "SECRET_OPTIONS",
           "corrupt_error"]

_NO_DIRS = frozenset({"s3", "gcs"})  # object stores: no directory markers needed


class CheckpointStore:
    """A filesystem and a root prefix under which checkpoints are ``step-<12 digits>/``.

    Construct with ``CheckpointStore(uri, options)``, ``CheckpointStore(location)`` or, for
    tests, with an existing ``filesystem=`` and ``uri`` as its path. Immutable and
    thread-safe.
    """

    def __init__(
        self,
        uri: str | StorageLocation,
        options: Mapping[str, Any] | None = None,
        *,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        """``uri``: a URI (parsed here, with ``options``) or a ``StorageLocation`` parsed
        before (not parsed again). ``filesystem``: use this filesystem (tests), with ``uri``
        as the root path inside it. Raises ``ConfigError`` for a URI or options that cannot
        be used."""
        if isinstance(uri, StorageLocation):
            if options:
                raise TypeError("options belong to the location; give them to its parse()")
            self.location = uri
        elif filesystem is not None:
            secrets = collect_secrets(uri, options)
            self.location = StorageLocation(
                filesystem.type_name, uri.rstrip("/"), uri.split("?", 1)[0], None, secrets
            )
        else:
            self.location = StorageLocation.parse(uri, options)
        self._given_fs = filesystem
        self.fs: pafs.FileSystem = (
            filesystem if filesystem is not None else self.location.filesystem()
        )
        self.root: str = self.location.root
        self.kind: str = self.fs.type_name
        self.endpoint: str | None = self.location.endpoint

    # ------------------------------------------------------------------ identity & secrets
    @property
    def uri(self) -> str:
        """The URI without query string or user info, secrets redacted (safe to log)."""
        return self.redact(self.location.shown)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.location, self._given_fs))

    def redact(self, text: str) -> str:
        """``text`` with every known secret value replaced by ``***``."""
        return self.location.redact(text)

    def error(self, message: str, exc: BaseException | None = None) -> CheckpointError:
        """The error for ``message``, redacted: a ``StorageError`` (plus a diagnosis) when the
        filesystem raised ``exc``, else a plain ``CheckpointError`` (a refused operation, say
        a commit with a rank missing). Callers ``raise store.error(...) from None`` so
        pyarrow's text is never chained."""
        if exc is None:
            return CheckpointError(self.redact(message))
        return StorageError(self.redact(f"{message}: {self.explain(exc)}"))

    def corrupt(
        self, message: str, *, step: int | None = None, shard: str | None = None
    ) -> CheckpointCorruptError:
        """A ``CheckpointCorruptError``: a committed checkpoint's bytes or files do not match
        its manifest. ``step`` and ``shard`` (the shard file, relative to the step directory;
        None for the manifest) name the bad object and travel as attributes of the same
        names, through pickling too."""
        return corrupt_error(self.redact(message), step=step, shard=shard)

    def explain(self, exc: BaseException) -> str:
        """Say what a storage exception means and how to fix it (redacted)."""
        text = str(exc) or type(exc).__name__
        low = text.lower()
        where = f"endpoint {self.endpoint}" if self.endpoint else f"{self.kind} storage"
        bucket = self.root.split("/", 1)[0]
        if "no_such_bucket" in low or "nosuchbucket" in low or "bucket does not exist" in low:
            hint = (
                f"bucket {bucket!r} does not exist on {where}. Fix: create the bucket or "
                "correct the bucket name in the checkpoint URI"
            )
        elif any(
            s in low
            for s in (
                "network_connection",
                "curlcode",
                "could not connect",
                "couldn't connect",
                "couldn't resolve",
                "timed out",
                "connection refused",
            )
        ):
            hint = (
                f"cannot reach {where}. Fix: check that the storage server is up and that "
                "endpoint_override, scheme (http/https) and region are right"
            )
        elif any(
            s in low
            for s in (
                "access_denied",
                "accessdenied",
                "invalidaccesskeyid",
                "invalid_access_key_id",  # (pyarrow's spelling of S3's InvalidAccessKeyId)
                "signaturedoesnotmatch",
                "forbidden",
                "invalid_credentials",
                "expiredtoken",
            )
        ):
            hint = (
                "access denied. Fix: check the credentials (access_key/secret_key options, "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and the bucket "
                "policy"
            )
        elif isinstance(exc, PermissionError):
            hint = f"permission denied under {self.root}. Fix: choose a writable directory"
        elif isinstance(exc, (FileExistsError, NotADirectoryError)):
            hint = (f"a file stands where a directory must be ({text}). Fix: point the "
                    "checkpoint URI at a directory (new or holding checkpoints), or move "
                    "the file")
        elif isinstance(exc, FileNotFoundError):
            hint = f"not found ({text})"
        else:
            hint = f"{type(exc).__name__}: {text}"
        return self.redact(hint)

    @property
    def options(self) -> dict[str, Any] | None:
        """The parsed options of an object store location (with secrets: never log them),
        {} for other stores, None for a store built on a given ``filesystem`` (its options
        are unknown)."""
        if self._given_fs is not None:
            return None
        return dict(self.location.fs_options)

    def same_place(self, other: CheckpointStore) -> bool:
        """Whether ``other`` names the same root on the same storage (kind, endpoint,
        path), whatever the spelling of its URI and options."""
        return (self.kind, self.endpoint, self.root) == (other.kind, other.endpoint, other.root)

    # ------------------------------------------------------------------ paths
    @staticmethod
    def step_name(step: int) -> str:
        return f"step-{int(step):012d}"

    def path(self, *parts: str) -> str:
        """Absolute path inside ``fs`` of ``root/parts...``."""
        return "/".join([self.root, *(p.strip("/") for p in parts)])

    def step_dir(self, step: int) -> str:
        return self.path(self.step_name(step))

    def ensure_dir(self, path: str) -> None:
        """Create ``path`` where the filesystem has real directories (not on object stores)."""
        if self.kind not in _NO_DIRS:
            self.fs.create_dir(path, recursive=True)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``path`` whole or not at all: on local storage a temporary file renamed over
        it (``rename(2)``, atomic on one filesystem), elsewhere one write (an object appears
        whole or not). Raises the filesystem's ``OSError``/``ValueError``; a failed write
        leaves what ``path`` held before, and no temporary file where it can be deleted."""
        if self.kind != "local":
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open_output_stream(tmp) as f:
                f.write(data)
            self.fs.move(tmp, path)
        except BaseException:
            self._discard(tmp)
            raise

    def _discard(self, path: str) -> None:
        """Delete ``path`` if it is there; best effort (a failure is not reported)."""
        try:
            self.fs.delete_file(path)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ probe
    def check_writable(self) -> None:
        """Cheap probe: write a tiny object under the root, replace it as a commit does
        (``write_atomic``: a rename on local storage), stat and delete it.

        Called by the controller before workers start. Raises ``StorageError`` saying what
        is wrong (missing bucket, unreachable endpoint, denied credentials, unwritable
        directory, storage that cannot rename, as some FUSE mounts of a bucket) and how to
        fix it.
        """
        probe = self.path(f".elastic-probe-{uuid.uuid4().hex}")
        try:
            self.ensure_dir(self.root)
            with self.fs.open_output_stream(probe) as f:
                f.write(b"elastic probe\n")
        except (OSError, ValueError) as e:
            self._discard(probe)
            raise self.error(f"checkpoint storage {self.uri} is not writable", e) from None
        try:
            # a write-only probe passed on storage that cannot rename, then every commit
            # failed (its manifest is a temporary file renamed into place; an object store's
            # is one write, which the probe's first did already)
            if self.kind == "local":
                self.write_atomic(probe, b"elastic probe, replaced\n")
        except (OSError, ValueError) as e:
            self._discard(probe)
            raise self.error(
                f"checkpoint storage {self.uri} cannot rename a file over another, which every "
                "checkpoint commit does (some FUSE mounts of a bucket cannot). Fix: use a "
                "filesystem that can rename, or the bucket's s3:// or gs:// URI instead of its "
                "mount", e) from None
        try:
            info = self.fs.get_file_info(probe)
            if info.type != pafs.FileType.File:
                raise OSError(f"probe object {probe} not visible after writing it")
            self.fs.delete_file(probe)
        except (OSError, ValueError) as e:
            self._discard(probe)
            raise self.error(f"checkpoint storage {self.uri} is not writable", e) from None


def _rebuild(location: StorageLocation, filesystem: pafs.FileSystem | None) -> CheckpointStore:
    return CheckpointStore(location, filesystem=filesystem)


def corrupt_error(
    message: str, *, step: int | None = None, shard: str | None = None
) -> CheckpointCorruptError:
    """``CheckpointCorruptError(message)`` with ``step`` and ``shard`` attributes (the bad
    object; ``shard`` None means the manifest). Exceptions pickle their ``__dict__``, so the
    attributes survive a trip through a Ray actor."""
    err = CheckpointCorruptError(message)
    err.step = step  # type: ignore[attr-defined]
    err.shard = shard  # type: ignore[attr-defined]
    return err


_STEP_RE = re.compile(r"^step-(\d{12})$")


def parse_step_name(name: str) -> int | None:
    """The step of a ``step-<12 digits>`` directory name, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None
