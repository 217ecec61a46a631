"""Where checkpoints live: a pyarrow filesystem plus a path prefix, resolved from a URI.

``CheckpointStore(uri, options)`` is the one handle every other module of this package takes.
It resolves local paths, ``file://``, ``s3://`` (AWS or any S3-compatible store through
``endpoint_override``), ``gs://`` and whatever else ``pyarrow.fs.FileSystem.from_uri`` knows.

Secrets: explicit credentials (``access_key``, ``secret_key``, ``session_token``,
``access_token``) are passed to pyarrow and otherwise kept private. ``repr()``, ``uri``, every
``CheckpointError`` this package raises and everything it writes go through ``redact()``, which
replaces their literal values with ``***``. Errors are raised ``from None`` so a pyarrow
message is never chained unredacted. Without explicit keys, pyarrow uses the usual chain
(environment, ``~/.aws``, instance metadata).

Thread safety: a store is immutable after construction; pyarrow filesystems are thread-safe,
so one store may be shared by a writer thread, reader threads and the caller. A store pickles
as ``(uri, options)`` and is rebuilt on the other side (a Ray actor, say).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import pyarrow.fs as pafs

from elastic.errors import CheckpointCorruptError, CheckpointError, ConfigError, StorageError

__all__ = [
    "CheckpointStore",
    "resolve_filesystem",
    "object_store_options",
    "corrupt_error",
    "SECRET_OPTIONS",
]

SECRET_OPTIONS = frozenset(
    {
        "access_key",
        "secret_key",
        "session_token",
        "access_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)
_ALIASES = {
    "endpoint": "endpoint_override",
    "endpoint_url": "endpoint_override",
    "aws_access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "aws_session_token": "session_token",
    "region_name": "region",
}
_S3_OPTIONS = frozenset(
    {
        "access_key",
        "secret_key",
        "session_token",
        "anonymous",
        "role_arn",
        "session_name",
        "external_id",
        "load_frequency",
        "region",
        "request_timeout",
        "connect_timeout",
        "scheme",
        "endpoint_override",
        "background_writes",
        "proxy_options",
        "allow_bucket_creation",
        "force_virtual_addressing",
        "tls_ca_file_path",
        "retries",
    }
)
_GCS_OPTIONS = frozenset(
    {
        "anonymous",
        "access_token",
        "target_service_account",
        "credential_token_expiration",
        "default_bucket_location",
        "scheme",
        "endpoint_override",
        "project_id",
        "retry_time_limit",
    }
)
_FLOAT_OPTIONS = frozenset({"request_timeout", "connect_timeout"})
_BOOL_OPTIONS = frozenset(
    {"anonymous", "background_writes", "allow_bucket_creation", "force_virtual_addressing"}
)
_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_NO_DIRS = frozenset({"s3", "gcs"})  # object stores: no directory markers needed


def _normalise(options: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in options.items():
        if v is None:
            continue
        out[_ALIASES.get(k, k)] = v
    return out


def _coerce(name: str, value: Any) -> Any:
    """Options from a URI query string arrive as text; give pyarrow the types it expects."""
    if not isinstance(value, str):
        return value
    if name in _FLOAT_OPTIONS:
        return float(value)
    if name == "retries":
        return int(value)
    if name in _BOOL_OPTIONS:
        return value.lower() in ("1", "true", "yes", "on")
    return value


def _split_endpoint(opts: dict[str, Any]) -> None:
    ep = opts.get("endpoint_override")
    if isinstance(ep, str) and "://" in ep:
        scheme, _, rest = ep.partition("://")
        opts.setdefault("scheme", scheme)
        opts["endpoint_override"] = rest.rstrip("/")


def resolve_filesystem(
    uri: str, options: Mapping[str, Any] | None = None
) -> tuple[pafs.FileSystem, str]:
    """Resolve ``(uri, options)`` into a pyarrow filesystem and the path prefix inside it.

    ``uri``: a local path, ``file://...``, ``s3://bucket/prefix``, ``gs://bucket/prefix`` or
    any URI pyarrow resolves. Query parameters of an s3/gs URI are read as options; explicit
    ``options`` win. S3 options: ``endpoint_override`` (``http://host:port`` also sets the
    scheme), ``region``, ``scheme``, ``access_key``, ``secret_key``, ``session_token``,
    ``connect_timeout``/``request_timeout`` (seconds), ``retries`` (max attempts), and the
    other ``pyarrow.fs.S3FileSystem`` keywords. Nothing touches the network here.

    Raises ``ConfigError`` for an empty URI, an unknown option, or options given for a
    filesystem that takes none.
    """
    if not uri or not isinstance(uri, str):
        raise ConfigError(
            "checkpoint.uri",
            f"{uri!r} is not a storage URI",
            "give a local path, file://, s3:// or gs:// URI",
        )
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    opts = _normalise(options or {})
    if scheme in ("s3", "gs", "gcs"):
        query = _normalise(dict(parse_qsl(parts.query)))
        query.update(_userinfo(parts.netloc))
        opts = {**query, **opts}
        allowed = _S3_OPTIONS if scheme == "s3" else _GCS_OPTIONS
        unknown = sorted(set(opts) - allowed)
        if unknown:
            raise ConfigError(
                "checkpoint.options",
                f"unknown option(s) {unknown} for {scheme}://",
                f"use only {sorted(allowed)}",
            )
        opts = object_store_options(uri, options)
        if not parts.netloc:
            raise ConfigError(
                "checkpoint.uri",
                f"{_strip_query(uri)} names no bucket",
                f"write {scheme}://<bucket>/<prefix>",
            )
        bucket = parts.netloc.rpartition("@")[2]
        path = (bucket + "/" + parts.path.strip("/")).rstrip("/")
        if scheme == "s3":
            retries = opts.pop("retries", None)
            if retries is not None:
                opts["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=int(retries))
            return pafs.S3FileSystem(**opts), path
        return pafs.GcsFileSystem(**opts), path
    if opts:
        raise ConfigError(
            "checkpoint.options",
            f"options {sorted(opts)} given for {uri!r}",
            "options apply to s3:// and gs:// URIs only; remove them",
        )
    if scheme in ("", "file"):
        path = parts.path if scheme == "file" else uri
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)).rstrip("/")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:
        raise ConfigError(
            "checkpoint.uri",
            f"pyarrow cannot resolve {_strip_query(uri)}: {e}",
            "use a local path, file://, s3:// or gs:// URI",
        ) from None
    return fs, path.rstrip("/")


def object_store_options(uri: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options of an ``s3://``/``gs://`` URI as pyarrow takes them: query parameters and
    ``KEY:SECRET@`` credentials merged under ``options``, aliases resolved, text coerced,
    ``endpoint_override="http://host:port"`` split into ``scheme`` and ``host:port``.
    (``retries`` stays an integer here; ``resolve_filesystem`` turns it into a retry
    strategy.) Does not check the option names."""
    parts = urlsplit(uri)
    query = _normalise(dict(parse_qsl(parts.query)))
    query.update(_userinfo(parts.netloc))
    opts = {k: _coerce(k, v) for k, v in {**query, **_normalise(options or {})}.items()}
    _split_endpoint(opts)
    return opts


def _userinfo(netloc: str) -> dict[str, str]:
    """``s3://KEY:SECRET@bucket`` credentials, which pyarrow also accepts."""
    if "@" not in netloc:
        return {}
    key, _, secret = netloc.rpartition("@")[0].partition(":")
    return {k: unquote(v) for k, v in (("access_key", key), ("secret_key", secret)) if v}


def _strip_query(uri: str) -> str:
    return uri.split("?", 1)[0]


class CheckpointStore:
    """A filesystem and a root prefix under which checkpoints are ``step-<12 digits>/``.

    Construct with ``CheckpointStore(uri, options)`` or, for tests, with an existing
    ``filesystem=`` and ``uri`` as its path. Immutable and thread-safe.
    """

    def __init__(
        self,
        uri: str,
        options: Mapping[str, Any] | None = None,
        *,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        self._uri = uri
        self._options = dict(options or {})
        self._secrets = _collect_secrets(uri, self._options)
        self._given_fs = filesystem
        if filesystem is not None:
            self.fs, self.root = filesystem, uri.rstrip("/")
        else:
            self.fs, self.root = resolve_filesystem(uri, self._options)
        self.kind: str = self.fs.type_name
        endpoint = _normalise(self._options).get("endpoint_override")
        self.endpoint: str | None = self.redact(str(endpoint)) if endpoint else None

    # ------------------------------------------------------------------ identity & secrets
    @property
    def uri(self) -> str:
        """The URI without query string and with secrets redacted (safe to log)."""
        return self.redact(_strip_query(self._uri))

    def __repr__(self) -> str:
        return f"CheckpointStore({self.uri!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._uri, self._options, self._given_fs))

    def redact(self, text: str) -> str:
        """``text`` with every known secret value replaced by ``***``."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

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
        elif isinstance(exc, FileNotFoundError):
            hint = f"not found ({text})"
        else:
            hint = f"{type(exc).__name__}: {text}"
        return self.redact(hint)

    @property
    def options(self) -> dict[str, Any] | None:
        """The resolved options of an object store URI (``object_store_options``; with
        secrets: never log them), {} for other stores, None for a store built on a given
        ``filesystem`` (its options are unknown)."""
        if self._given_fs is not None:
            return None
        if self.kind not in _NO_DIRS:
            return {}
        return object_store_options(self._uri, self._options)

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

    # ------------------------------------------------------------------ probe
    def check_writable(self) -> None:
        """Cheap probe: write, stat and delete a tiny object under the root.

        Called by the controller before workers start. Raises ``CheckpointError`` saying what
        is wrong (missing bucket, unreachable endpoint, denied credentials, unwritable
        directory) and how to fix it.
        """
        probe = self.path(f".elastic-probe-{uuid.uuid4().hex}")
        try:
            self.ensure_dir(self.root)
            with self.fs.open_output_stream(probe) as f:
                f.write(b"elastic probe\n")
            info = self.fs.get_file_info(probe)
            if info.type != pafs.FileType.File:
                raise OSError(f"probe object {probe} not visible after writing it")
            self.fs.delete_file(probe)
        except (OSError, ValueError) as e:
            raise self.error(f"checkpoint storage {self.uri} is not writable", e) from None


def _rebuild(
    uri: str, options: dict[str, Any], filesystem: pafs.FileSystem | None
) -> CheckpointStore:
    return CheckpointStore(uri, options, filesystem=filesystem)


def _collect_secrets(uri: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    found: set[str] = set()
    for k, v in options.items():
        if k in SECRET_OPTIONS and isinstance(v, str) and v:
            found.add(v)
    parts = urlsplit(uri)
    for k, v in parse_qsl(parts.query):
        if k in SECRET_OPTIONS and v:
            found.add(v)
    for v in _userinfo(parts.netloc).values():
        found.update({v, quote(v, safe="")})
    for name in _ENV_SECRETS:
        v = os.environ.get(name, "")
        if len(v) >= 8:
            found.add(v)
    # longest first, so a secret containing another is replaced whole
    return tuple(sorted(found, key=len, reverse=True))


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
