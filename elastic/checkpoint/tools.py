"""Checkpoint tools as plain functions (the ``elastic`` CLI wires them): list, inspect, verify,
export. Each returns plain data; ``format_*`` helpers render it as text. None of them unpickles
anything, and ``export`` writes a file any PyTorch can read with ``weights_only=True``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch

from elastic.checkpoint.location import local_path
from elastic.checkpoint.manifest import (
    Manifest,
    committed_steps,
    nothing_found,
    read_manifest,
    resolve_step,
)
from elastic.checkpoint.reader import CheckpointReader
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError, ConfigError

__all__ = [
    "CheckpointSummary",
    "VerifyReport",
    "ExportResult",
    "list_checkpoints",
    "format_list",
    "inspect",
    "format_inspect",
    "verify",
    "export",
]


@dataclass(frozen=True)
class CheckpointSummary:
    step: int
    created: str
    size_bytes: int
    world_size: int
    strategy: str | None
    error: str | None = None  # set when the manifest cannot be read


def list_checkpoints(store: CheckpointStore) -> list[CheckpointSummary]:
    """Committed checkpoints by step; a bad manifest is listed with its ``error``."""
    out = []
    for step in committed_steps(store):
        try:
            m = read_manifest(store, step)
            out.append(CheckpointSummary(step, m.created, m.total_bytes, m.world_size, m.strategy))
        except CheckpointError as e:
            out.append(CheckpointSummary(step, "?", 0, 0, None, str(e)))
    return out


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_list(rows: list[CheckpointSummary], nothing: str | None = None) -> str:
    """The table of ``list_checkpoints``; with no rows, ``nothing`` (see
    ``manifest.nothing_found``) instead of an empty table."""
    if not rows:
        return nothing or "no committed checkpoint"
    lines = [f"{'step':>10}  {'created':20}  {'size':>10}  {'world':>5}  strategy"]
    for r in rows:
        if r.error:
            lines.append(f"{r.step:>10}  BAD: {r.error}")
        else:
            lines.append(
                f"{r.step:>10}  {r.created:20}  {_size(r.size_bytes):>10}  "
                f"{r.world_size:>5}  {r.strategy or '-'}"
            )
    return "\n".join(lines)


def inspect(store: CheckpointStore, which: int | str | Manifest = "latest") -> dict[str, Any]:
    """Manifest summary plus every key with dtype, full shape and number of pieces."""
    with CheckpointReader(store, which) as r:
        m = r.manifest
        keys = {
            k: {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.full_shape),
                "pieces": t.pieces,
            }
            for k, t in r.tensors().items()
        }
    return {
        "step": m.step,
        "created": m.created,
        "world_size": m.world_size,
        "strategy": m.strategy,
        "size_bytes": m.total_bytes,
        "plan": dict(m.plan),
        "data_position": m.data_position,
        "rng": m.rng,
        "extra": dict(m.extra),
        "shards": [s.to_json() for s in m.shards],
        "keys": keys,
    }


def format_inspect(info: Mapping[str, Any]) -> str:
    lines = [
        f"step {info['step']}  created {info['created']}  world {info['world_size']}  "
        f"strategy {info['strategy'] or '-'}  size {_size(info['size_bytes'])}",
        f"plan: {info['plan']}",
        f"data position: {info['data_position']}",
        f"shards: {len(info['shards'])}",
        f"keys ({len(info['keys'])}):",
    ]
    for k, v in info["keys"].items():
        lines.append(
            f"  {k}  {v['dtype']}{v['shape']}"
            + (f"  ({v['pieces']} pieces)" if v["pieces"] > 1 else "")
        )
    return "\n".join(lines)


@dataclass
class VerifyReport:
    """What ``verify`` found. ``nothing`` says why no checkpoint was checked (the path does
    not exist, holds no committed checkpoint, ...); a report that checked nothing is not
    a pass."""

    steps: list[int] = field(default_factory=list)
    problems: dict[int, list[str]] = field(default_factory=dict)
    bytes_read: int = 0
    nothing: str | None = None

    @property
    def ok(self) -> bool:
        """Every checked checkpoint is intact, and at least one was checked."""
        return not self.problems and bool(self.steps)

    @property
    def exit_code(self) -> int:
        """0 when checkpoints were found and every one is intact, 1 otherwise (for the CLI:
        a CI gate on an empty or misspelled path must not pass)."""
        return 0 if self.ok else 1


def verify(store: CheckpointStore, which: int | str = "all") -> VerifyReport:
    """Read every byte of the chosen checkpoints (``"all"``, ``"latest"`` or a step) and check
    sizes and every checksum. Problems are collected, not raised (except a missing step, or
    no checkpoint at all for ``"latest"``). Finding no checkpoint is reported in
    ``nothing`` and is not ``ok``."""
    report = VerifyReport()
    steps = committed_steps(store) if which == "all" else [resolve_step(store, which).step]
    if not steps:
        report.nothing = nothing_found(store)
    for step in steps:
        report.steps.append(step)
        try:
            with CheckpointReader(store, read_manifest(store, step)) as r:
                problems = r.verify()
                report.bytes_read += r.stats.bytes_read
        except CheckpointError as e:
            problems = [str(e)]
        if problems:
            report.problems[step] = problems
    return report


@dataclass(frozen=True)
class ExportResult:
    path: str
    step: int
    keys: int
    bytes: int
    format: str = "torch"  # or "safetensors"


def _safetensors_bytes(model: dict[str, torch.Tensor], optim: dict[str, torch.Tensor],
                       about: dict[str, str]) -> bytes:
    try:
        from safetensors.torch import save
    except ImportError:
        raise CheckpointError("exporting to safetensors needs the safetensors package. Fix: "
                              "pip install safetensors (or elastic[export]), or export to a "
                              ".pt file") from None
    flat = {k: v.contiguous() for k, v in model.items()}
    flat.update({f"optimizer/{k}": v.contiguous() for k, v in optim.items()})
    return save(flat, metadata={"format": "pt", "producer": "elastic", **about})


def export(
    store: CheckpointStore,
    dest: str,
    which: int | str | Manifest = "latest",
    *,
    include_optimizer: bool = False,
    dest_options: Mapping[str, Any] | None = None,
    fmt: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Assemble full tensors and write ONE file, as ``fmt``: ``"torch"`` (``torch.save``) or
    ``"safetensors"``; by default, safetensors for a ``dest`` ending in ``.safetensors``.

    torch: without ``include_optimizer`` the file is the model's state dict ``{fqn: Tensor}``
    (the ``model/`` prefix stripped); with it, ``{"model": {fqn: Tensor}, "optimizer":
    {"<fqn>/<key>": Tensor}}``. It loads with ``torch.load(path, weights_only=True)``.
    safetensors: one flat table, the model's tensors under their FQNs (what
    ``safetensors.torch.load_file`` and ``model.load_state_dict`` take) and, with
    ``include_optimizer``, ``optimizer/<fqn>/<key>`` beside them; the metadata holds the step,
    strategy and world size. Either loads without elastic.

    ``dest``: a local path, or a URI (with ``dest_options``) for pyarrow. An existing file
    there is refused unless ``overwrite``. The destination is touched only once the whole
    file is made: a local one is written beside it, then renamed into place; for a URI, the
    file is made on local disk first, then uploaded, under a temporary name moved into
    place when it replaces an object (one that did not exist is removed if its upload
    fails). A failed export leaves the destination as it was. ``ExportResult.path`` is the
    destination as it may be shown (a URI without credentials).
    """
    fmt = fmt or ("safetensors" if dest.endswith(".safetensors") else "torch")
    if fmt not in ("torch", "safetensors"):
        raise ConfigError("fmt", f"unknown export format {fmt!r}.", "use 'torch' or 'safetensors'")
    remote = "://" in dest and not dest.startswith("file://")
    out = CheckpointStore(dest, dest_options) if remote else None
    try:
        path = "" if remote else os.path.abspath(local_path(dest))
    except ValueError as e:  # (a ConfigError is a ValueError too, as before)
        raise ConfigError("dest", *e.args) from None
    shown = out.uri if out is not None else path
    if out is None:
        check_local_dest(dest, path)
    try:
        existed = (out.fs.get_file_info(out.root).type != pafs.FileType.NotFound
                   if out is not None else os.path.lexists(path))
    except OSError as e:
        raise (out.error(f"exporting to {shown} failed", e) if out is not None else e) from None
    if existed and not overwrite:
        raise CheckpointError(f"{shown} exists already: the export would replace it. Fix: give "
                              "another destination, or replace it on purpose (elastic "
                              "checkpoints export --force; export(..., overwrite=True))")
    with CheckpointReader(store, which) as r:
        keys = [
            k
            for k in r.tensors()
            if k.startswith("model/") or (include_optimizer and k.startswith("optim/"))
        ]
        if not any(k.startswith("model/") for k in keys):
            raise CheckpointError(f"checkpoint step {r.step} holds no 'model/' keys to export")
        state = r.read(keys)
        step = r.step
        about = {"step": str(step), "strategy": str(r.manifest.strategy),
                 "world_size": str(r.manifest.world_size)}
    model = {k[len("model/") :]: v for k, v in state.items() if k.startswith("model/")}
    optim = {k[len("optim/") :]: v for k, v in state.items() if k.startswith("optim/")}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    if fmt == "safetensors":
        def write(f: Any) -> None:
            f.write(_safetensors_bytes(model, optim, about))
    else:
        obj: Any = {"model": model, "optimizer": optim} if include_optimizer else model

        def write(f: Any) -> None:
            torch.save(obj, f)
    where = os.path.dirname(path) if out is None else None
    tmp = ""
    try:
        if where is not None:
            os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path) or 'export'}.tmp-",
                                   dir=where)
        with os.fdopen(fd, "wb") as f:
            if out is None:  # as open() makes it (mkstemp's: the owner's only), or the old one's
                os.fchmod(f.fileno(), os.stat(path).st_mode & 0o7777 if os.path.exists(path)
                          else 0o666 & ~_UMASK)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if out is None:
            os.replace(tmp, path)
        else:
            _upload(out, tmp, existed, f"exporting step {step} to {shown} failed")
    except OSError as e:  # a read-only or full file system (was: a traceback)
        if out is not None:
            raise  # (a remote export's own failures are StorageErrors: this is its scratch)
        raise CheckpointError(
            f"exporting step {step} to {shown} failed: {e.strerror or e}. Fix: give a "
            f"destination on a writable file system with room for {nbytes / 1e6:.1f} MB "
            "(elastic checkpoints export --out; export(store, dest))") from None
    finally:
        if tmp and os.path.exists(tmp):  # a failed export leaves nothing behind
            os.remove(tmp)
    return ExportResult(shown, step, len(state), nbytes, fmt)


def check_local_dest(dest: str, path: str) -> None:
    """A local export's destination (``path``: ``dest`` made absolute) is a file that can be
    made: ``ConfigError("dest")`` for a directory (``newdir/`` too, not there yet) or a path
    under a file. Was: a file named ``newdir`` written and reported done; a FileExistsError
    traceback (found by a new user, session 47)."""
    if dest.endswith(("/", os.sep)) or os.path.isdir(path):
        raise ConfigError("dest", f"{dest} is a directory.",
                          f"give a file in it, e.g. {os.path.join(dest, 'model.pt')}")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if parent and os.path.exists(parent) and not os.path.isdir(parent):
        raise ConfigError("dest", f"{parent} is a file, so {dest} cannot be made under it.",
                          "give a path whose directories are directories")


S3_COPY_MAX = 5 * 2**30  # S3's CopyObject (pyarrow's move) takes objects up to this


def _read_umask() -> int:
    """The process's umask, read once at import (setting it to read it is not thread-safe)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _upload(out: CheckpointStore, local: str, replace: bool, failed: str) -> None:
    """The finished file ``local`` to ``out``'s root: straight there when nothing is there
    (removed again if the upload fails: pyarrow completes a stream it closes on an error),
    else under a temporary name, then moved over the old object."""
    name = f"{out.root}.tmp-{uuid.uuid4().hex[:8]}" if replace else out.root
    if replace and out.kind == "s3" and os.path.getsize(local) > S3_COPY_MAX:
        raise CheckpointError(
            f"{out.uri} exists and the export is {os.path.getsize(local) / 2**30:.1f} GiB: "
            "S3 moves an object by copying it in one request, up to 5 GiB, so it cannot be "
            "put in place of the old one. Fix: export to a new name, or delete the old object "
            "first")
    try:
        with open(local, "rb") as src, out.fs.open_output_stream(name) as f:
            shutil.copyfileobj(src, f, 8 << 20)
        if replace:
            out.fs.move(name, out.root)
    except BaseException as e:
        try:
            out.fs.delete_file(name)
        except Exception:  # noqa: BLE001 - not there, or the storage is down: said below
            pass
        if isinstance(e, (OSError, ValueError, RuntimeError)):
            raise out.error(failed + (" (the object there is as it was)" if replace else ""),
                            e) from None
        raise
