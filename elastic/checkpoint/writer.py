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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from elastic.checkpoint.shard_format import (
    CHECKSUM,
    DEFAULT_CHUNK_BYTES,
    ItemEntry,
    Piece,
    as_pieces,
    checksum_fn,
    layout,
)
from elastic.checkpoint.staging import Deferred, copy_with_crcs, stage
from elastic.checkpoint.store import CheckpointStore
from elastic.checkpoint.upload import (
    Abandoned,
    ProgressFn,
    ShardInfo,
    shard_file_name,
    upload_shard,
)
from elastic.errors import CheckpointError

__all__ = ["ShardInfo", "ShardWriter", "write_shard", "shard_file_name"]

log = logging.getLogger("elastic.checkpoint")


_IDLE, _UPLOADING, _UPLOADED, _FAILED = "idle", "uploading", "uploaded", "failed"


class ShardWriter:
    """Asynchronous writer of one rank's shard per checkpoint (see the module docstring).

    ``on_progress(bytes_written, total)`` is called on the upload thread after each write; an
    exception it raises aborts the upload like a storage error would (a fault-injection hook
    for tests, and a place for metrics). ``block_bytes`` is the size of each sequential write.
    ``checksum_threads`` compute chunk CRCs beside the writing thread, and ``copy_threads``
    share the host copy of CPU tensors in ``begin()`` (each defaults to half the cores, 1 to
    4; GPU tensors are copied asynchronously by the copy engine instead). ``checksum``
    names the chunk checksum written (``crc32c``; ``crc32`` is format version 1's, still
    read).
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
        checksum: str = CHECKSUM,
    ) -> None:
        if chunk_bytes < 64 or chunk_bytes % 64:
            raise CheckpointError(f"chunk_bytes must be a multiple of 64, got {chunk_bytes}")
        checksum_fn(checksum)  # ValueError for an unknown name
        self.checksum = checksum
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
    def cancelled(self) -> bool:
        """Whether the checkpoint in flight was given up (``abandon``)."""
        return self._cancel.is_set()

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
            items, deferred = stage(buf, placed, total, later=later, pool=self._pool)
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

    def _pool(self) -> ThreadPoolExecutor | None:
        """The thread pool shared by large host copies (created on first use; None with one
        copy thread)."""
        if self.copy_threads <= 1:
            return None
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(
                self.copy_threads, thread_name_prefix=f"elastic-ckpt-copy-r{self.rank}"
            )
        return self._copy_pool

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
             deferred: list[Deferred], staged: threading.Event) -> None:
        info: ShardInfo | None = None
        err: CheckpointError | None = None
        try:
            t_copy = time.perf_counter()
            try:  # the host copies begin() left to this thread, before anything is uploaded
                known = copy_with_crcs(buf, deferred, self.chunk_bytes, self.block_bytes,
                                       self._copy_pool, self.checksum)
            finally:
                deferred.clear()  # drop the references to the caller's tensors
                staged.set()
            t_copy = time.perf_counter() - t_copy
            info = upload_shard(
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
                self.checksum,
            )
            info = dataclasses.replace(info, copy_seconds=t_copy)
        except Abandoned:
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
