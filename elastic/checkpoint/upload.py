"""One shard's upload: a host buffer written to the store with its chunk CRCs, index and footer.

``upload_shard`` runs on a writer's upload thread (``writer.ShardWriter``). It writes the
buffer in ``block``-sized sequential writes (one multipart upload on S3) while helper threads
compute the CRC-32C of every chunk the host copy did not already checksum, then appends the
index and the footer (``shard_format``) and returns the ``ShardInfo`` a worker reports to the
controller. On any failure it deletes the partial file and raises: ``Abandoned`` when the
writer cancelled the upload, a redacted ``StorageError`` when the storage failed.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic.checkpoint.shard_format import (
    CHECKSUM,
    FOOTER,
    MAGIC,
    ItemEntry,
    ShardIndex,
    checksum_fn,
    dtype_from_name,
    index_checksum,
)
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError

__all__ = ["ShardInfo", "Abandoned", "shard_file_name", "upload_shard"]

ProgressFn = Callable[[int, int], None]


def shard_file_name(rank: int, attempt: str | None = None) -> str:
    """``shard-<rank>-<attempt>.bin``: each upload writes a file of its own, so an upload of
    a step that is committed already (a replay after a restore or a resume), or an abandoned
    one whose storage call returns late, never writes over or deletes a committed shard (the
    manifest names the files; checkpoints written before the attempt part still load)."""
    return f"shard-{int(rank):05d}" + (f"-{attempt}" if attempt else "") + ".bin"


@dataclass(frozen=True)
class ShardInfo:
    """What a worker reports to the controller for one uploaded shard (plain, picklable).

    ``path`` is relative to the checkpoint directory; ``checksum`` is the SHA-256 of the
    shard's index, which holds a CRC-32 of every data chunk.
    """

    step: int
    rank: int
    path: str
    size: int
    checksum: str
    index_offset: int
    index_length: int
    items: int
    data_bytes: int
    seconds: float = 0.0
    copy_seconds: float = 0.0  # the deferred host copy (and its CRCs) on the upload thread
    # keys of floating-point entries holding NaN or inf (at most 5): the controller never
    # commits such a checkpoint (its state is not one to resume from)
    nonfinite: tuple[str, ...] = ()

    @property
    def throughput(self) -> float:
        """Upload bytes per second (0 if unknown)."""
        return self.size / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ShardInfo:
        kw = {k: d[k] for k in ShardInfo.__dataclass_fields__ if k in d}
        kw["nonfinite"] = tuple(kw.get("nonfinite", ()))
        return ShardInfo(**kw)


class Abandoned(Exception):
    """The writer cancelled the upload (``ShardWriter.abandon``); not an error."""


def upload_shard(
    store: CheckpointStore,
    step: int,
    rank: int,
    buf: torch.Tensor,
    items: list[ItemEntry],
    total: int,
    chunk: int,
    block: int,
    on_progress: ProgressFn | None,
    cancel: threading.Event,
    threads: int,
    known: dict[int, int] | None = None,
    checksum: str = CHECKSUM,
) -> ShardInfo:
    """Write ``buf[:total]`` then the index and footer to the shard path in ``block``-sized
    sequential writes, while ``threads`` helper threads compute the chunk CRCs (algorithm
    ``checksum``) of the same (immutable) buffer that ``known`` (chunk start -> CRC, taken
    during the host copy) does not hold; all release the GIL, so on spare cores checksums
    cost no upload time. Deletes the partial file and raises on any failure."""
    t0 = time.perf_counter()
    name = shard_file_name(rank, uuid.uuid4().hex[:8])
    path = store.path(store.step_name(step), name)
    data = memoryview(buf.numpy()).cast("B") if total else memoryview(b"")  # type: ignore[arg-type]
    stop = threading.Event()
    written = 0
    try:
        # CRCs of every chunk, in batches of ~one write block, over `threads` helper threads
        known = known or {}
        ranges = [
            (a, min(a + chunk, it.offset + it.length))
            for it in items
            for a in range(it.offset, it.offset + it.length, chunk)
            if a not in known
        ]
        per = max(1, block // chunk)
        with ThreadPoolExecutor(threads, thread_name_prefix=f"elastic-ckpt-crc-r{rank}") as pool:
            # the non-finite scan reads the buffer beside the write (after it, it was ~half a
            # local upload's time), ahead of the CRCs the host copy did not take
            finite = pool.submit(nonfinite_keys, buf, items)
            batches = [
                pool.submit(_crc_batch, data, ranges[i : i + per], stop, cancel, checksum)
                for i in range(0, len(ranges), per)
            ]
            try:
                store.ensure_dir(store.step_dir(step))
                with store.fs.open_output_stream(path) as out:
                    for pos in range(0, total, block):
                        if cancel.is_set():
                            raise Abandoned
                        end = min(pos + block, total)
                        out.write(data[pos:end])
                        written = end
                        if on_progress is not None:
                            on_progress(written, total)
                    crcs = _per_item(items, chunk, ranges, batches, known)
                    index = ShardIndex(
                        step,
                        rank,
                        chunk,
                        tuple(
                            ItemEntry(
                                it.key,
                                it.dtype,
                                it.shape,
                                it.full_shape,
                                it.start,
                                it.stop,
                                it.offset,
                                it.length,
                                c,
                            )
                            for it, c in zip(items, crcs, strict=True)
                        ),
                        checksum,
                    )
                    raw = index.to_bytes()
                    out.write(raw)
                    out.write(FOOTER.pack(len(raw), MAGIC))
            finally:
                stop.set()
    except Exception as e:
        _delete_quietly(store, path)
        if isinstance(e, (Abandoned, CheckpointError)):
            raise
        raise store.error(
            f"rank {rank}: uploading shard {name} of step {step} to "
            f"{store.uri} failed after {written} of {total} bytes",
            e,
        ) from None
    size = total + len(raw) + FOOTER.size
    bad = finite.result()
    return ShardInfo(
        step,
        rank,
        name,
        size,
        index_checksum(raw),
        total,
        len(raw),
        len(items),
        total,
        time.perf_counter() - t0,
        nonfinite=bad,
    )


def nonfinite_keys(buf: torch.Tensor, items: list[ItemEntry], most: int = 5) -> tuple[str, ...]:
    """Keys of the floating-point items of ``buf`` that hold NaN or inf (at most ``most``).
    Runs on an upload helper thread, after the host copy: training never waits for it."""
    bad: list[str] = []
    for it in items:
        dt = dtype_from_name(it.dtype)
        if not dt.is_floating_point or it.length == 0:
            continue
        if not all_finite(buf[it.offset : it.offset + it.length].view(dt)):
            bad.append(it.key)
            if len(bad) >= most:
                break
    return tuple(bad)


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of floating-point ``t`` is finite, in one read pass: a NaN or
    inf element makes any sum NaN or inf, so a finite sum proves them all finite; a
    non-finite sum (a NaN or inf, or finite values whose sum overflowed) takes the exact
    element-wise check. ``isfinite(t).all()`` alone wrote and read a byte per element: a
    500 MB shard's upload ran at a quarter of the raw write (bench/checkpoint.py)."""
    acc = torch.float32 if t.element_size() <= 4 else t.dtype
    try:
        total = float(t.sum(dtype=acc))
    except (RuntimeError, TypeError):  # a type without a sum (float8): the exact check
        total = math.nan
    return math.isfinite(total) or bool(torch.isfinite(t).all())


def _per_item(
    items: list[ItemEntry], chunk: int, ranges: list[tuple[int, int]],
    batches: list[Future[list[int]]], known: dict[int, int],
) -> list[tuple[int, ...]]:
    crcs = dict(known)
    crcs.update(zip((a for a, _ in ranges), (c for f in batches for c in f.result()),
                    strict=True))
    return [tuple(crcs[a] for a in range(it.offset, it.offset + it.length, chunk))
            for it in items]


def _crc_batch(
    data: memoryview,
    ranges: list[tuple[int, int]],
    stop: threading.Event,
    cancel: threading.Event,
    checksum: str,
) -> list[int]:
    if stop.is_set() or cancel.is_set():
        raise Abandoned
    crc = checksum_fn(checksum)
    return [crc(data[a:e]) for a, e in ranges]


def _delete_quietly(store: CheckpointStore, path: str) -> None:
    try:
        store.fs.delete_file(path)
    except (OSError, ValueError):
        pass  # best effort: the file is invisible without a manifest; retention removes it
