"""A storage URI parsed once: which filesystem, the root inside it, and the secrets it carries.

``StorageLocation.parse(uri, options)`` is the only place a checkpoint URI is parsed. The
result is a plain, picklable value: a job's config holds it, a worker receives it inside the
config, and ``CheckpointStore(location)`` builds its filesystem from it without parsing again.

Secrets, one implementation for the whole product: ``collect_secrets`` finds every credential a
URI and its options carry (``s3://KEY:SECRET@bucket``, query keys such as ``?secret_key=``,
``access_key``/``secret_key``/``session_token``/``access_token`` options, a proxy's password,
and ``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN`` from the environment); ``redact`` replaces
their literal values in a text with ``***``; ``scrub`` masks the values under secret-looking
keys of a mapping (``is_secret_key``). Nothing here touches the network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import pyarrow.fs as pafs

from elastic.errors import ConfigError

__all__ = [
    "StorageLocation",
    "local_path",
    "SECRET_OPTIONS",
    "collect_secrets",
    "redact",
    "scrub",
    "is_secret_key",
    "is_secret_option",
    "env_secrets",
    "resolve_filesystem",
    "shown_uri",
    "split_step_dir",
    "OWN_RESUMES",
]

# the ``resume`` values that name the job's own checkpoint URI (``auto``: latest where a
# checkpoint is, else a fresh start); any other value is a URI
OWN_RESUMES = ("latest", "auto")
# ``step-<n>`` as a whole path component (was: any name ending so, and
# ``s3://b/exp/finetune-step-5000`` resumed step 5000 of ``s3://b/exp/finetune-``)
_STEP_DIR = re.compile(r"^(?:([^?]*)/)?step-(\d+)/?(\?.*)?$")


def split_step_dir(uri: str) -> tuple[str, int | None]:
    """A ``resume`` URI as (root, step): ``.../step-<n>`` (its options, if any, after it)
    pins step n of its parent; any other URI is a root (step None), and so is one whose
    ``step-<n>`` is its bucket or host (``s3://step-5``)."""
    m = _STEP_DIR.match(uri)
    if m is None or (m.group(1) or "").endswith(":/"):
        return uri, None
    return (m.group(1) or "") + (m.group(3) or ""), int(m.group(2))

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
_SECRETISH = re.compile(
    r"(^|_)(secret|password|passwd|token|credentials?|access_key|secret_key|api_key)$", re.I
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
# an environment variable named so holds a credential (``MLFLOW_TRACKING_PASSWORD``,
# ``WANDB_API_KEY``, ``HF_TOKEN``, ...), unless it names where one is kept (``..._PATH``)
_ENV_SECRETISH = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL", re.I)
_ENV_PLACES = re.compile(r"_(PATH|FILE|DIR|HOME)$", re.I)
# a tracker option named so carries a credential (broader than ``is_secret_key``: an
# option of a user's tracker class may be named anything)
_OPTION_SECRETISH = re.compile(
    r"(^|_)(secrets?|passwords?|passwd|pwd|passphrase|token|credentials?|creds?|api_?key|"
    r"apikey|private_?key|auth|authorization|bearer|cookie)(_|$)"
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


# --------------------------------------------------------------------------- secrets


def is_secret_key(name: object) -> bool:
    """Whether an option or meta key names a credential (its value is never written)."""
    return str(name) in SECRET_OPTIONS or bool(_SECRETISH.search(str(name)))


def collect_secrets(uri: str | None, options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Every credential value that ``uri`` and ``options`` carry (longest first, so that a
    secret holding another is replaced whole), in the forms a text may show them (as given
    and URL-encoded). See the module docstring for what counts."""
    found: set[str] = set()

    def add(value: Any) -> None:
        if isinstance(value, str) and value:
            found.update({value, quote(value, safe="")})

    for k, v in (options or {}).items():
        if is_secret_key(k):
            add(v)
        elif k == "proxy_options":
            _proxy_secrets(v, add)
    if uri:
        parts = urlsplit(uri)
        for pair in parts.query.split("&"):
            k, _, raw = pair.partition("=")
            if is_secret_key(unquote(k)):
                add(raw)
                add(unquote(raw))
        for k, v in parse_qsl(parts.query):
            if is_secret_key(k):
                add(v)
        for v in _userinfo(parts.netloc).values():
            add(v)
    found.update(env_secrets())
    return tuple(sorted(found, key=len, reverse=True))


def env_secrets() -> tuple[str, ...]:
    """The values (8 characters or more) of the environment's credential variables: a
    setting that repeats one (a tracker's option, say) is redacted wherever it is shown."""
    return tuple(v for name, v in os.environ.items() if len(v) >= 8 and (
        name in _ENV_SECRETS or (_ENV_SECRETISH.search(name) and not _ENV_PLACES.search(name))))


def is_secret_option(name: object) -> bool:
    """Whether an option of a tracker (a class of the user's, whose names elastic cannot
    know) names a credential: ``is_secret_key``, or a word of its name (split at ``_``,
    ``-`` and camelCase) is ``auth``, ``token``, ``password``, ``secret``, ``api_key``,
    ``cookie``, ... (``auth_header``, ``accessToken``, ``clientSecret``, ``auth-token``;
    not ``max_tokens``, which counts, nor ``author``)."""
    words = _CAMEL.sub("_", str(name)).replace("-", "_").lower()
    return is_secret_key(name) or bool(_OPTION_SECRETISH.search(words))


def _proxy_secrets(proxy: Any, add: Any) -> None:
    """A proxy's password: ``{..., password: ...}`` or ``scheme://user:password@host:port``."""
    if isinstance(proxy, Mapping):
        for k, v in proxy.items():
            if is_secret_key(k):
                add(v)
    elif isinstance(proxy, str):
        add(_userinfo(urlsplit(proxy).netloc).get("secret_key"))


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every value of ``secrets`` replaced by ``***``."""
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def scrub(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """A copy of a JSON-like value with values under secret-looking keys replaced by ``***``
    and ``secrets`` redacted from every string. Other values are returned as they are."""
    secrets = tuple(secrets)
    if isinstance(obj, Mapping):
        return {
            k: ("***" if is_secret_key(k) and v is not None else scrub(v, secrets))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(scrub(v, secrets) for v in obj)
    if isinstance(obj, str):
        return redact(obj, secrets)
    return obj


# --------------------------------------------------------------------------- parsing


def _normalise(options: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in options.items():
        if v is None:
            continue
        out[_ALIASES.get(k, k)] = v
    return out


def _coerce(name: str, value: Any, secrets: tuple[str, ...]) -> Any:
    """Options from a URI query string arrive as text; give pyarrow the types it expects."""
    if not isinstance(value, str):
        return value
    try:
        if name in _FLOAT_OPTIONS:
            return float(value)
        if name == "retries":
            return int(value)
    except ValueError:
        raise ConfigError(
            f"checkpoint_options.{name}",
            f"{redact(value, secrets)!r} is not a number.",
            f"give {name} as a number" + (" of seconds" if name in _FLOAT_OPTIONS else ""),
        ) from None
    if name in _BOOL_OPTIONS:
        return value.lower() in ("1", "true", "yes", "on")
    return value


def _split_endpoint(opts: dict[str, Any]) -> None:
    ep = opts.get("endpoint_override")
    if isinstance(ep, str) and "://" in ep:
        scheme, _, rest = ep.partition("://")
        opts.setdefault("scheme", scheme)
        opts["endpoint_override"] = rest.rstrip("/")


def _userinfo(netloc: str) -> dict[str, str]:
    """``s3://KEY:SECRET@bucket`` credentials, which pyarrow also accepts."""
    if "@" not in netloc:
        return {}
    key, _, secret = netloc.rpartition("@")[0].partition(":")
    return {k: unquote(v) for k, v in (("access_key", key), ("secret_key", secret)) if v}


def local_path(uri: str) -> str:
    """The local path a plain path or ``file://`` URI names (``file:///abs``, or
    ``file://localhost/abs``). ``ValueError(problem, fix)`` for a ``file://`` URI with a
    host: ``file://ckpt`` names host "ckpt" (was: dropped, so the path was / or the cwd)."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return uri
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{uri} names the host {parts.netloc!r}: a file:// URI takes an "
                         "absolute path after its two slashes",
                         f"write file:///abs/path (three slashes), or a plain path "
                         f"({parts.netloc}{parts.path}, read from the directory the job "
                         "starts in)")
    return parts.path


def shown_uri(uri: str, secrets: Iterable[str] = ()) -> str:
    """The URI for humans: no query string, no user info, ``secrets`` redacted."""
    parts = urlsplit(uri)
    base = uri.split("?", 1)[0]
    if "@" in parts.netloc:
        base = base.replace(parts.netloc, parts.netloc.rpartition("@")[2], 1)
    return redact(base, secrets)


@dataclass(frozen=True, eq=False)
class StorageLocation:
    """Where checkpoints live, parsed from a URI once (``StorageLocation.parse``).

    ``kind``: ``local``, ``s3``, ``gcs`` or another pyarrow filesystem's type name;
    ``root``: the path prefix inside that filesystem; ``shown``: the URI safe to print (no
    query string, no user info, secrets replaced by ``***``); ``endpoint``: the S3/GCS
    endpoint, redacted, or None. The credentials and filesystem options are kept out of
    ``repr``. Immutable and picklable; ``filesystem()`` builds a new pyarrow filesystem from
    the parsed options without parsing the URI again.
    """

    kind: str
    root: str
    shown: str
    endpoint: str | None = None
    secrets: tuple[str, ...] = field(default=(), repr=False)
    fs_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    prebuilt: pafs.FileSystem | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, uri: str, options: Mapping[str, Any] | None = None) -> StorageLocation:
        """Parse ``(uri, options)``.

        ``uri``: a local path, ``file://...``, ``s3://bucket/prefix``, ``gs://bucket/prefix``
        or any URI pyarrow resolves. Query parameters of an s3/gs URI are read as options and
        ``s3://KEY:SECRET@bucket`` as credentials; explicit ``options`` win. S3 options:
        ``endpoint_override`` (``http://host:port`` also sets the scheme), ``region``,
        ``scheme``, ``access_key``, ``secret_key``, ``session_token``,
        ``connect_timeout``/``request_timeout`` (seconds), ``retries`` (max attempts),
        ``proxy_options`` and the other ``pyarrow.fs.S3FileSystem`` keywords.

        Raises ``ConfigError`` (redacted) for an empty URI, an unknown option, a query value
        of the wrong type, options given for a filesystem that takes none, a ``file://`` URI
        with a host (``file://ckpt``), or a URI pyarrow cannot resolve.
        """
        if not uri or not isinstance(uri, str):
            raise ConfigError(
                "checkpoint_uri",
                f"{uri!r} is not a storage URI.",
                "give a local path, file://, s3:// or gs:// URI",
            )
        secrets = collect_secrets(uri, options)
        shown = shown_uri(uri, secrets)
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
                from difflib import get_close_matches

                near = get_close_matches(unknown[0], sorted(allowed), n=1)
                raise ConfigError(
                    "checkpoint_options",
                    f"unknown option {unknown[0]!r} for {scheme}:// ({shown}).",
                    (f"did you mean {near[0]}? " if near else "")
                    + f"use only {', '.join(sorted(allowed))}",
                )
            opts = {k: _coerce(k, v, secrets) for k, v in opts.items()}
            _split_endpoint(opts)
            bucket = parts.netloc.rpartition("@")[2]
            if not bucket:
                raise ConfigError(
                    "checkpoint_uri", f"{shown} names no bucket.", f"write {scheme}://<bucket>/<prefix>"
                )
            path = (bucket + "/" + parts.path.strip("/")).rstrip("/")
            endpoint = opts.get("endpoint_override")
            shown_ep = redact(str(endpoint), secrets) if endpoint else None
            kind = "s3" if scheme == "s3" else "gcs"
            return cls(kind, path, shown, shown_ep, secrets, opts)
        if opts:
            raise ConfigError(
                "checkpoint_options",
                f"options {sorted(opts)} given for {shown}.",
                "options apply to s3:// and gs:// URIs only; remove them",
            )
        if scheme in ("", "file"):
            try:
                path = local_path(uri)
            except ValueError as e:
                raise ConfigError("checkpoint_uri", redact(f"{e.args[0]}.", secrets),
                                  redact(e.args[1], secrets)) from None
            root = os.path.abspath(os.path.expanduser(path)).rstrip("/")
            return cls("local", root, redact(root if scheme == "" else shown, secrets), None, secrets)
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError, TypeError) as e:
            raise ConfigError(
                "checkpoint_uri",
                f"pyarrow cannot resolve {shown}: {redact(str(e), secrets)}.",
                "use a local path, file://, s3:// or gs:// URI",
            ) from None
        return cls(fs.type_name, path.rstrip("/"), shown, None, secrets, {}, fs)

    def filesystem(self) -> pafs.FileSystem:
        """A pyarrow filesystem for this location (a new one for s3/gcs, built from the
        parsed options). Raises ``ConfigError`` if pyarrow rejects an option's value."""
        if self.prebuilt is not None:
            return self.prebuilt
        if self.kind == "local":
            return pafs.LocalFileSystem()
        opts = dict(self.fs_options)
        try:
            if self.kind == "s3":
                retries = opts.pop("retries", None)
                if retries is not None:
                    opts["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(
                        max_attempts=int(retries)
                    )
                return pafs.S3FileSystem(**opts)
            return pafs.GcsFileSystem(**opts)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                "checkpoint_options",
                f"pyarrow rejects the options of {self.shown}: {self.redact(str(e))}.",
                "check each option's type (numbers for timeouts and retries, true/false "
                "for switches, a mapping or URI for proxy_options)",
            ) from None

    def redact(self, text: str) -> str:
        """``text`` with every secret of this location replaced by ``***``."""
        return redact(text, self.secrets)


def resolve_filesystem(
    uri: str, options: Mapping[str, Any] | None = None
) -> tuple[pafs.FileSystem, str]:
    """Resolve ``(uri, options)`` into a pyarrow filesystem and the path prefix inside it
    (``StorageLocation.parse`` says what is accepted and raised)."""
    loc = StorageLocation.parse(uri, options)
    return loc.filesystem(), loc.root
