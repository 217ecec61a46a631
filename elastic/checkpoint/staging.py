"""The host copy of a checkpoint: a rank's pieces into the writer's reusable host buffer.

``stage`` is what ``ShardWriter.begin`` blocks on: every piece is copied into the buffer at
its aligned offset (GPU pieces by the copy engine, asynchronously, then one synchronize; large
CPU copies cut into ~16 MiB row blocks over a thread pool), padding is zeroed so files are
deterministic, and the pieces the caller lets wait (``later``) are returned as deferred
copies. ``copy_with_crcs`` runs those on the upload thread, one checksum chunk at a time,
taking each chunk's CRC while it is in cache.

Ownership: the buffer belongs to the writer; the sources stay the caller's, and a deferred
source must not change until ``copy_with_crcs`` has run (``ShardWriter.staged``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from elastic.checkpoint.shard_format import CHECKSUM, ItemEntry, Piece, checksum_fn, dtype_name

__all__ = ["Deferred", "stage", "copy_with_crcs", "split_copy"]

Deferred = tuple[int, torch.Tensor, torch.Tensor]  # (byte offset in the buffer, dst view, src)

_COPY_SPLIT = 16 << 20


def stage(
    buf: torch.Tensor,
    placed: list[tuple[Piece, int]],
    total: int,
    *,
    later: Callable[[str], bool] | None = None,
    pool: Callable[[], ThreadPoolExecutor | None] | None = None,
) -> tuple[list[ItemEntry], list[Deferred]]:
    """Copy the ``placed`` pieces (piece, byte offset; ``shard_format.layout``) into ``buf``
    and return their index entries (without CRCs) and the deferred copies: the CPU pieces
    whose key ``later`` accepts. ``pool()`` gives the thread pool for large CPU copies (None:
    copy on this thread); it is asked only when the copy is large enough to share."""
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    deferred: list[Deferred] = []
    cuda = any(p.tensor.is_cuda for p, _ in placed)
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
                copies.extend(split_copy(dst, p.tensor.detach()))
        end = off + n
    if total > end:
        buf[end:total].zero_()
    executor = pool() if pool is not None and not cuda and total >= 4 * _COPY_SPLIT else None
    if cuda:
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    elif executor is not None:
        list(executor.map(lambda c: c[0].copy_(c[1]), copies))
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
    return items, deferred


def split_copy(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) pairs of at most ~16 MiB, cut along dim 0, so copies can share threads."""
    nbytes = src.numel() * src.element_size()
    if src.dim() == 0 or nbytes <= _COPY_SPLIT or src.shape[0] < 2:
        return [(dst, src)]
    rows = max(1, src.shape[0] * _COPY_SPLIT // nbytes)
    return [(dst[i : i + rows], src[i : i + rows]) for i in range(0, src.shape[0], rows)]


def copy_with_crcs(
    buf: torch.Tensor,
    deferred: list[Deferred],
    chunk: int,
    block: int,
    pool: ThreadPoolExecutor | None,
    checksum: str = CHECKSUM,
) -> dict[int, int]:
    """Copy each deferred piece (byte offset, typed view of ``buf``, source) into ``buf`` one
    checksum chunk at a time and take each chunk's CRC (algorithm ``checksum``) right after
    its copy, while it is in cache: the upload then reads those bytes only to write them.
    Returns {chunk start: CRC}. A non-contiguous source is copied whole; its chunks are
    checksummed at upload."""
    data = memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")  # type: ignore[arg-type]
    crc = checksum_fn(checksum)
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
            flat[a:e].copy_(sb[at : at + (e - a)])
            out.append((a, crc(data[a:e])))
        return out

    per = max(1, block // chunk)
    batches = [tasks[i : i + per] for i in range(0, len(tasks), per)]
    if pool is not None and len(batches) > 1:
        results = list(pool.map(run, batches))
    else:
        results = [run(b) for b in batches]
    return {a: c for r in results for a, c in r}
