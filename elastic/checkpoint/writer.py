"""Worker side: copy this rank's pieces to host memory, then upload one shard in the background.

Usage on a worker (rank r, once per checkpoint)::

    writer = ShardWriter(store, rank=r)          # once; keeps a reusable host buffer
    writer.begin(step, pieces)                   # blocks only for the host copy
    ...train on...
    info = writer.poll()                         # None while uploading; ShardInfo when done
    # send info.to_dict() to the controller; when it has committed the step:
    writer.committed(step)                       # or writer.abandon() if it never will

One checkpoint at a time: ``begin()`` refuses (``CheckpointError``) while the previous one is
uploading, uploaded but not yet ``committed()``, or failed with its error not yet collected by
``poll()``/``wait()``. ``begin(..., wait_s=t)`` waits up to ``t`` seconds for that instead.
A collected failure counts as abandoned.

Thread safety: the methods may be called from any thread (a Ray actor's concurrent calls);
state changes are guarded by one lock. Uploads run on one long-lived daemon thread per writer
(started by the first ``begin()``, stopped by ``close()``) that touches only the host buffer,
never the caller's tensors. Upload errors never escape the thread: they are
turned into a redacted ``CheckpointError`` returned by ``poll()``/``wait()`` (raised there).
The time an upload can take is bounded by the store's timeouts and retries (S3 options
``connect_timeout``, ``request_timeout``, ``retries``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elastic.checkpoint.shard_format import (
    CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    FOOTER,
    MAGIC,
    ItemEntry,
    Piece,
    ShardIndex,
    as_pieces,
    checksum_fn,
    dtype_name,
    index_checksum,
    layout,
)
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointError

__all__ = ["ShardInfo", "ShardWriter", "write_shard", "shard_file_name"]

ProgressFn = Callable[[int, int], None]
log = logging.getLogger("elastic.checkpoint")


def shard_file_name(rank: int) -> str:
    return f"shard-{int(rank):05d}.bin"


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

    @property
    def throughput(self) -> float:
        """Upload bytes per second (0 if unknown)."""
        return self.size / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ShardInfo:
        return ShardInfo(**{k: d[k] for k in ShardInfo.__dataclass_fields__ if k in d})


class _Abandoned(Exception):
    pass


_IDLE, _UPLOADING, _UPLOADED, _FAILED = "idle", "uploading", "uploaded", "failed"


class ShardWriter:
    """Asynchronous writer of one rank's shard per checkpoint (see the module docstring).

    ``on_progress(bytes_written, total)`` is called on the upload thread after each write; an
    exception it raises aborts the upload like a storage error would (a fault-injection hook
    for tests, and a place for metrics). ``block_bytes`` is the size of each sequential write.
    ``checksum_threads`` compute chunk CRCs beside the writing thread, and ``copy_threads``
    share the host copy of CPU tensors in ``begin()`` (each defaults to half the cores, 1 to
    4; GPU tensors are copied asynchronously by the copy engine instead).
    """

    def __init__(
        self,
        store: CheckpointStore,
        rank: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        block_bytes: int = 8 << 20,
        on_progress: ProgressFn | None = None,
        checksum_threads: int | None = None,
        copy_threads: int | None = None,
    ) -> None:
        if chunk_bytes < 64 or chunk_bytes % 64:
            raise CheckpointError(f"chunk_bytes must be a multiple of 64, got {chunk_bytes}")
        self.store = store
        self.rank = int(rank)
        self.chunk_bytes = chunk_bytes
        self.block_bytes = max(block_bytes, chunk_bytes)
        helpers = max(1, min(4, (os.cpu_count() or 2) // 2))
        self.checksum_threads = checksum_threads or helpers
        self.copy_threads = copy_threads or helpers
        self._copy_pool: ThreadPoolExecutor | None = None
        self.on_progress = on_progress
        self.last_blocked_s = 0.0
        self._staging: torch.Tensor | None = None
        self._cv = threading.Condition()
        self._state = _IDLE
        self._step: int | None = None
        self._info: ShardInfo | None = None
        self._error: CheckpointError | None = None
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._staged = threading.Event()  # set: no deferred host copy pending
        self._staged.set()
        self._cancel = threading.Event()

    # ------------------------------------------------------------------ status
    @property
    def state(self) -> str:
        """``idle``, ``uploading``, ``uploaded`` (awaiting commit) or ``failed``."""
        return self._state

    @property
    def step(self) -> int | None:
        """The step of the checkpoint in flight or awaiting commit, else None."""
        return self._step

    # ------------------------------------------------------------------ host buffer
    def reserve(self, nbytes: int, *, pinned: bool = False) -> None:
        """Allocate and touch the host buffer now, so the first ``begin()`` does not pay for
        page faults. Optional; the buffer grows on demand and is reused."""
        with self._cv:
            if self._state == _UPLOADING:
                raise CheckpointError("cannot resize the host buffer while uploading")
            self._ensure_staging(nbytes, pinned)
            self._staging.zero_()  # type: ignore[union-attr]

    def _ensure_staging(self, nbytes: int, pinned: bool) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.numel() < nbytes or (pinned and not buf.is_pinned()):
            self._staging = None  # free the old one first
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            self._staging = buf
        return buf

    # ------------------------------------------------------------------ protocol
    def begin(
        self,
        step: int,
        pieces: Mapping[str, torch.Tensor] | Iterable[Piece],
        *,
        wait_s: float = 0.0,
        later: Callable[[str], bool] | None = None,
    ) -> float:
        """Copy ``pieces`` to host memory, start uploading them as this rank's shard of
        ``step``, and return the seconds the caller was blocked.

        After this returns the caller may modify its tensors, except the CPU pieces whose key
        ``later(key)`` accepts: those are copied on the upload thread, before it uploads, and
        the caller must call ``staged()`` before it modifies them (training overlaps that copy
        with the next step's forward and backward). Raises ``CheckpointError`` if the previous
        checkpoint is not released within ``wait_s`` seconds, or a piece is invalid.
        """
        t0 = time.perf_counter()
        plist = as_pieces(pieces)
        with self._cv:
            if not self._cv.wait_for(lambda: self._state == _IDLE, timeout=max(wait_s, 0.0)):
                raise CheckpointError(self._busy_message(step))
            placed, total = layout(plist)
            cuda = any(p.tensor.is_cuda for p in plist)
            buf = self._ensure_staging(total, cuda and torch.cuda.is_available())
            copies: list[tuple[torch.Tensor, torch.Tensor]] = []
            deferred: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (offset, dst, src)
            end = 0
            for p, off in placed:
                if off > end:
                    buf[end:off].zero_()  # padding: keep files deterministic
                n = p.nbytes
                if n:
                    dst = buf[off : off + n].view(p.tensor.dtype).view(p.tensor.shape)
                    if later is not None and not p.tensor.is_cuda and later(p.key):
                        deferred.append((off, dst, p.tensor.detach()))
                    else:
                        copies.extend(_split_copy(dst, p.tensor.detach()))
                end = off + n
            if total > end:
                buf[end:total].zero_()
            if cuda:
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
            elif self.copy_threads > 1 and total >= 4 * _COPY_SPLIT:
                if self._copy_pool is None:
                    self._copy_pool = ThreadPoolExecutor(
                        self.copy_threads, thread_name_prefix=f"elastic-ckpt-copy-r{self.rank}"
                    )
                list(self._copy_pool.map(lambda c: c[0].copy_(c[1]), copies))
            else:
                for dst, src in copies:
                    dst.copy_(src)
            items = [
                ItemEntry(
                    p.key,
                    dtype_name(p.tensor.dtype),
                    tuple(p.tensor.shape),
                    tuple(p.full_shape or ()),
                    p.start,
                    p.stop,
                    off,
                    p.nbytes,
                )
                for p, off in placed
            ]
            self._state, self._step = _UPLOADING, int(step)
            self._info, self._error = None, None
            self._staged = threading.Event()
            if not deferred:
                self._staged.set()
            self._cancel.clear()
            if self._thread is None:  # one long-lived thread: no thread start per checkpoint
                self._thread = threading.Thread(
                    target=self._serve, daemon=True, name=f"elastic-ckpt-upload-r{self.rank}"
                )
                self._thread.start()
            self._jobs.put((int(step), buf, items, total, deferred, self._staged))
        self.last_blocked_s = time.perf_counter() - t0
        return self.last_blocked_s

    def staged(self, timeout: float | None = None) -> float:
        """Block until the copies ``begin(..., later=...)`` deferred are done (at once if
        none are pending); return the seconds waited. Call it before changing those tensors."""
        ev = self._staged
        if ev.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not ev.wait(timeout):
            raise CheckpointError(f"rank {self.rank}: host copy of step {self._step} not done "
                                  f"after {timeout} s")
        return time.perf_counter() - t0

    def _busy_message(self, step: int) -> str:
        if self._state == _FAILED:
            return (
                f"rank {self.rank}: checkpoint of step {self._step} failed and its error was "
                f"not collected ({self._error}); call poll()/wait() or abandon() before "
                f"starting step {step}"
            )
        return (
            f"rank {self.rank}: checkpoint of step {self._step} is still {self._state}; "
            f"wait for it and call committed({self._step}) or abandon() before starting "
            f"step {step}"
        )

    def poll(self) -> ShardInfo | None:
        """None while uploading (or idle); the ShardInfo once uploaded. Raises the upload's
        ``CheckpointError`` once if it failed (the writer is then idle)."""
        with self._cv:
            return self._collect()

    def wait(self, timeout: float | None = None) -> ShardInfo:
        """Block until the upload ends; return its ShardInfo or raise its ``CheckpointError``.
        Raises ``CheckpointError`` if nothing is in flight or ``timeout`` seconds pass."""
        with self._cv:
            if self._state == _IDLE:
                raise CheckpointError(f"rank {self.rank}: no checkpoint in flight")
            if not self._cv.wait_for(lambda: self._state != _UPLOADING, timeout=timeout):
                raise CheckpointError(
                    f"rank {self.rank}: shard of step {self._step} still "
                    f"uploading after {timeout} s"
                )
            info = self._collect()
            assert info is not None
            return info

    def _collect(self) -> ShardInfo | None:
        if self._state == _FAILED:
            err = self._error
            self._state, self._step, self._error = _IDLE, None, None
            assert err is not None
            raise err
        return self._info if self._state == _UPLOADED else None

    def committed(self, step: int) -> None:
        """The controller committed ``step``: release it so the next ``begin()`` may start."""
        with self._cv:
            if self._state != _UPLOADED or self._step != step:
                raise CheckpointError(
                    f"rank {self.rank}: committed({step}) but the writer is "
                    f"{self._state} with step {self._step}"
                )
            self._state, self._step, self._info = _IDLE, None, None
            self._cv.notify_all()

    def abandon(self, timeout: float = 60.0) -> None:
        """Give up the checkpoint in flight or awaiting commit. An upload in progress is
        cancelled at its next write and its partial file deleted; this blocks until the upload
        has stopped, at most ``timeout`` s (then ``CheckpointError``, and the writer stays busy
        until the upload does stop). A completed shard
        is left in place: it may have been committed already; retention removes orphans."""
        with self._cv:
            self._cancel.set()
            if not self._cv.wait_for(lambda: self._state != _UPLOADING, timeout=timeout):
                raise CheckpointError(
                    f"rank {self.rank}: upload of step {self._step} did not "
                    f"stop within {timeout} s; check the storage timeouts"
                )
            self._state, self._step, self._info, self._error = _IDLE, None, None, None
            self._cv.notify_all()

    def close(self) -> None:
        """Abandon anything in flight, stop the upload thread and free the host buffer."""
        self.abandon()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(10.0)
            self._thread = None
        if self._copy_pool is not None:
            self._copy_pool.shutdown()
            self._copy_pool = None
        self._staging = None

    # ------------------------------------------------------------------ upload thread
    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)

    def _run(self, step: int, buf: torch.Tensor, items: list[ItemEntry], total: int,
             deferred: list[tuple[int, torch.Tensor, torch.Tensor]], staged: threading.Event
             ) -> None:
        info: ShardInfo | None = None
        err: CheckpointError | None = None
        try:
            t_copy = time.perf_counter()
            try:  # the host copies begin() left to this thread, before anything is uploaded
                known = _copy_with_crcs(buf, deferred, self.chunk_bytes, self.block_bytes,
                                        self._copy_pool)
            finally:
                deferred.clear()  # drop the references to the caller's tensors
                staged.set()
            t_copy = time.perf_counter() - t_copy
            info = _upload(
                self.store,
                step,
                self.rank,
                buf,
                items,
                total,
                self.chunk_bytes,
                self.block_bytes,
                self.on_progress,
                self._cancel,
                self.checksum_threads,
                known,
            )
            info = dataclasses.replace(info, copy_seconds=t_copy)
        except _Abandoned:
            pass
        except CheckpointError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - any failure of the thread becomes state
            err = self.store.error(f"rank {self.rank}: uploading shard of step {step} failed", e)
        if err is not None:
            log.warning("%s", err)
        elif info is not None:
            log.debug(
                "rank %d: shard of step %d uploaded, %d bytes in %.3f s",
                self.rank,
                step,
                info.size,
                info.seconds,
            )
        with self._cv:
            if self._cancel.is_set():  # abandoned: its result no longer matters
                self._state, self._step, self._info, self._error = _IDLE, None, None, None
            elif err is not None:
                self._state, self._error = _FAILED, err
            else:
                self._state, self._info = _UPLOADED, info
            self._cv.notify_all()


_COPY_SPLIT = 16 << 20


def _split_copy(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) pairs of at most ~16 MiB, cut along dim 0, so copies can share threads."""
    nbytes = src.numel() * src.element_size()
    if src.dim() == 0 or nbytes <= _COPY_SPLIT or src.shape[0] < 2:
        return [(dst, src)]
    rows = max(1, src.shape[0] * _COPY_SPLIT // nbytes)
    return [(dst[i : i + rows], src[i : i + rows]) for i in range(0, src.shape[0], rows)]


def _copy_with_crcs(buf: torch.Tensor, deferred: list[tuple[int, torch.Tensor, torch.Tensor]],
                    chunk: int, block: int, pool: ThreadPoolExecutor | None) -> dict[int, int]:
    """Copy each deferred piece (byte offset, typed view of ``buf``, source) into ``buf`` one
    checksum chunk at a time and take each chunk's CRC right after its copy, while it is in
    cache: the upload then reads those bytes only to write them. Returns {chunk start: CRC}.
    A non-contiguous source is copied whole; its chunks are checksummed at upload."""
    data = memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")  # type: ignore[arg-type]
    crc = checksum_fn(CHECKSUM)
    flat = buf.view(torch.uint8)
    tasks: list[tuple[int, int, torch.Tensor, int]] = []  # (chunk start, end, source bytes, at)
    for off, dst, src in deferred:
        if not src.is_contiguous() or src.dim() == 0:
            dst.copy_(src)
            continue
        sb = src.reshape(-1).view(torch.uint8)
        n = sb.numel()
        tasks += [(off + a, off + min(a + chunk, n), sb, a) for a in range(0, n, chunk)]

    def run(batch: list[tuple[int, int, torch.Tensor, int]]) -> list[tuple[int, int]]:
        out = []
        for a, e, sb, at in batch:
            flat[a:e].copy_(sb[at: at + (e - a)])
            out.append((a, crc(data[a:e])))
        return out

    per = max(1, block // chunk)
    batches = [tasks[i: i + per] for i in range(0, len(tasks), per)]
    if pool is not None and len(batches) > 1:
        results = list(pool.map(run, batches))
    else:
        results = [run(b) for b in batches]
    return {a: c for r in results for a, c in r}


def _upload(
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
) -> ShardInfo:
    """Write ``buf[:total]`` then the index and footer to the shard path in ``block``-sized
    sequential writes, while ``threads`` helper threads compute the chunk CRCs of the same
    (immutable) buffer that ``known`` (chunk start -> CRC, taken during the host copy) does
    not hold; all release the GIL, so on spare cores checksums cost no upload time. Deletes
    the partial file and raises on any failure."""
    t0 = time.perf_counter()
    name = shard_file_name(rank)
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
            batches = [
                pool.submit(_crc_batch, data, ranges[i : i + per], stop, cancel)
                for i in range(0, len(ranges), per)
            ]
            try:
                store.ensure_dir(store.step_dir(step))
                with store.fs.open_output_stream(path) as out:
                    for pos in range(0, total, block):
                        if cancel.is_set():
                            raise _Abandoned
                        end = min(pos + block, total)
                        out.write(data[pos:end])
                        written = end
                        if on_progress is not None:
                            on_progress(written, total)
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
                            for it, c in zip(items, _per_item(items, chunk, ranges, batches,
                                                              known), strict=True)
                        ),
                        CHECKSUM,
                    )
                    raw = index.to_bytes()
                    out.write(raw)
                    out.write(FOOTER.pack(len(raw), MAGIC))
            finally:
                stop.set()
    except Exception as e:
        _delete_quietly(store, path)
        if isinstance(e, (_Abandoned, CheckpointError)):
            raise
        raise store.error(
            f"rank {rank}: uploading shard {name} of step {step} to "
            f"{store.uri} failed after {written} of {total} bytes",
            e,
        ) from None
    size = total + len(raw) + FOOTER.size
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
    )


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
) -> list[int]:
    if stop.is_set() or cancel.is_set():
        raise _Abandoned
    crc = checksum_fn(CHECKSUM)
    return [crc(data[a:e]) for a, e in ranges]


def _delete_quietly(store: CheckpointStore, path: str) -> None:
    try:
        store.fs.delete_file(path)
    except (OSError, ValueError):
        pass  # best effort: the file is invisible without a manifest; retention removes it


def write_shard(
    store: CheckpointStore,
    step: int,
    rank: int,
    pieces: Mapping[str, torch.Tensor] | Iterable[Piece],
    **writer_options: Any,
) -> ShardInfo:
    """Synchronous convenience: write one shard and return its ShardInfo (raises on failure)."""
    w = ShardWriter(store, rank, **writer_options)
    w.begin(step, pieces)
    return w.wait()
