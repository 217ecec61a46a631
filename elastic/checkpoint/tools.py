"""Checkpoint tools as plain functions (the ``elastic`` CLI wires them): list, inspect, verify,
export. Each returns plain data; ``format_*`` helpers render it as text. None of them unpickles
anything, and ``export`` writes a file any PyTorch can read with ``weights_only=True``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.checkpoint.manifest import (
    Manifest,
    committed_steps,
    nothing_found,
    read_manifest,
    resolve_step,
)
from elastic.checkpoint.reader import CheckpointReader
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError

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
) -> ExportResult:
    """Assemble full tensors and write ONE file, as ``fmt``: ``"torch"`` (``torch.save``) or
    ``"safetensors"``; by default, safetensors for a ``dest`` ending in ``.safetensors``.

    torch: without ``include_optimizer`` the file is the model's state dict ``{fqn: Tensor}``
    (the ``model/`` prefix stripped); with it, ``{"model": {fqn: Tensor}, "optimizer":
    {"<fqn>/<key>": Tensor}}``. It loads with ``torch.load(path, weights_only=True)``.
    safetensors: one flat table, the model's tensors under their FQNs (what
    ``safetensors.torch.load_file`` and ``model.load_state_dict`` take) and, with
    ``include_optimizer``, ``optimizer/<fqn>/<key>`` beside them; the metadata holds the step,
    strategy and world size. Either loads without elastic. ``dest``: a local path (written
    whole, then renamed into place), or a URI (with ``dest_options``) for pyarrow.
    """
    fmt = fmt or ("safetensors" if dest.endswith(".safetensors") else "torch")
    if fmt not in ("torch", "safetensors"):
        raise ValueError(f"export format {fmt!r}: use 'torch' or 'safetensors'")
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
    if "://" in dest and not dest.startswith("file://"):
        out = CheckpointStore(dest, dest_options)
        try:
            with out.fs.open_output_stream(out.root) as f:
                write(f)
        except (OSError, ValueError, RuntimeError) as e:
            raise out.error(f"exporting step {step} to {out.uri} failed", e) from None
    else:
        path = os.path.abspath(dest.removeprefix("file://"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):  # a failed export leaves nothing behind
                os.remove(tmp)
    return ExportResult(dest, step, len(state), nbytes, fmt)
