"""Loading: read only the keys and dim-0 rows a rank needs, verify what is read, never unpickle.

``want`` says what to read, in canonical (full-tensor) coordinates:
  - ``None``: every key, full tensors;
  - an iterable of keys: those keys, full tensors;
  - a mapping ``{key: (start, stop) | None}``: rows ``start:stop`` of dim 0 (``None``: whole).
The result is a ``dict[str, Tensor]`` (CPU, contiguous) in the order asked; a ranged entry has
shape ``(stop - start, *full_shape[1:])``.

What is checked: each shard's size against the manifest, its index against the manifest's
SHA-256, and the CRC-32 of every data chunk a read touches (reads are widened to chunk
boundaries, so a partial read is still verified; at most two extra chunks per item). Reads are
ranged (``open_input_file`` + positional reads), one request per run of nearby items, in
parallel across shards.

Errors: a committed checkpoint whose files do not match its manifest (missing or truncated
shard, bad footer, index or chunk checksum mismatch, rows no shard holds) raises
``CheckpointCorruptError`` with ``step`` and ``shard`` attributes naming the bad object; the
storage failing raises ``StorageError``. Choosing which checkpoint to load, and falling back
past a bad one, is ``fallback.py``'s.

Thread safety: a ``CheckpointReader`` may be used from several threads; it caches indices and
open files (one lock per shard file).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from elastic.checkpoint.manifest import Manifest, ShardRecord
from elastic.checkpoint.manifest import resolve_step as _resolve
from elastic.checkpoint.shard_format import (
    FOOTER,
    MAGIC,
    ItemEntry,
    ShardIndex,
    checksum_fn,
    dtype_from_name,
)
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import CheckpointCorruptError, CheckpointError

__all__ = ["Want", "TensorMeta", "ReadStats", "CheckpointReader", "load"]

Want = Iterable[str] | Mapping[str, "tuple[int, int] | None"] | None


@dataclass(frozen=True)
class TensorMeta:
    key: str
    dtype: torch.dtype
    full_shape: tuple[int, ...]
    pieces: int


@dataclass
class ReadStats:
    """Bytes and requests of data reads (indices not counted in ``bytes_read``)."""

    bytes_read: int = 0
    requests: int = 0
    index_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, index: bool = False) -> None:
        with self._lock:
            self.requests += 1
            if index:
                self.index_bytes += nbytes
            else:
                self.bytes_read += nbytes


@dataclass(frozen=True)
class _Seg:
    """One item's rows to copy: file bytes [lo, hi) are read and verified (whole chunks);
    bytes [src, src + n) of the file go to ``dest``."""

    rank: int
    item: ItemEntry
    lo: int
    hi: int
    src: int
    n: int
    dest: torch.Tensor


class CheckpointReader:
    """Reads one committed checkpoint. ``which``: a Manifest, a step or ``"latest"``."""

    def __init__(
        self,
        store: CheckpointStore,
        which: int | str | Manifest = "latest",
        *,
        max_workers: int = 4,
        coalesce_gap: int = 256 << 10,
        max_read: int = 64 << 20,
    ) -> None:
        self.store = store
        self.manifest = _resolve(store, which)
        self.max_workers = max(1, max_workers)
        self.coalesce_gap = coalesce_gap
        self.max_read = max_read
        self.stats = ReadStats()
        self._records = {r.rank: r for r in self.manifest.shards}
        self._indices: dict[int, ShardIndex] = {}
        self._files: dict[int, Any] = {}
        self._locks = {r: threading.Lock() for r in self._records}
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.manifest.step

    def _where(self, rec: ShardRecord) -> str:
        return f"shard {rec.path} (rank {rec.rank}) of step {self.step}"

    def _corrupt(self, rec: ShardRecord, message: str) -> CheckpointCorruptError:
        return self.store.corrupt(message, step=self.step, shard=rec.path)

    # ------------------------------------------------------------------ files & indices
    def _file(self, rank: int) -> Any:
        with self._lock:
            f = self._files.get(rank)
        if f is not None:
            return f
        rec = self._records[rank]
        path = self.store.path(self.store.step_name(self.step), rec.path)
        try:
            f = self.store.fs.open_input_file(path)
            size = f.size()
        except FileNotFoundError:
            raise self._corrupt(rec, f"{self._where(rec)} is missing") from None
        except (OSError, ValueError) as e:
            raise self.store.error(f"opening {self._where(rec)} failed", e) from None
        if size != rec.size:
            raise self._corrupt(
                rec,
                f"{self._where(rec)} is {size} bytes but the manifest says "
                f"{rec.size}: truncated or replaced",
            )
        with self._lock:
            self._files.setdefault(rank, f)
            return self._files[rank]

    def _read(self, rank: int, offset: int, n: int, index: bool = False) -> bytearray:
        rec = self._records[rank]
        f = self._file(rank)
        buf = bytearray(n)
        try:
            with self._locks[rank]:
                f.seek(offset)
                got = f.readinto(buf)
        except (OSError, ValueError) as e:
            raise self.store.error(f"reading {self._where(rec)} failed", e) from None
        if got != n:
            raise self._corrupt(
                rec,
                f"{self._where(rec)}: short read ({got} of {n} bytes at "
                f"{offset}); the shard is truncated",
            )
        self.stats.add(n, index)
        return buf

    def index(self, rank: int) -> ShardIndex:
        """The (verified) index of ``rank``'s shard; cached."""
        with self._lock:
            if rank in self._indices:
                return self._indices[rank]
        rec = self._records[rank]
        where = self._where(rec)
        if rec.index_offset + rec.index_length + FOOTER.size != rec.size:
            raise self._corrupt(rec, f"manifest entry of {where} is inconsistent")
        raw = self._read(rank, rec.index_offset, rec.index_length + FOOTER.size, index=True)
        body, footer = bytes(raw[: rec.index_length]), bytes(raw[rec.index_length :])
        length, magic = FOOTER.unpack(footer)
        if magic != MAGIC or length != rec.index_length:
            raise self._corrupt(rec, f"{where} has a bad footer: not an elastic shard or corrupt")
        if "sha256:" + hashlib.sha256(body).hexdigest() != rec.checksum:
            raise self._corrupt(rec, f"{where}: index checksum mismatch; the shard is corrupt")
        try:
            idx = ShardIndex.from_bytes(body, self.store.redact(where))
        except CheckpointError as e:
            raise self._corrupt(rec, str(e)) from None
        if idx.step != self.step or idx.rank != rank:
            raise self._corrupt(rec, f"{where} holds step {idx.step} rank {idx.rank}")
        if idx.data_bytes > rec.index_offset:
            raise self._corrupt(rec, f"{where}: its index points past the data region")
        with self._lock:
            self._indices[rank] = idx
        return idx

    def indices(self) -> list[ShardIndex]:
        """Every shard's index (fetched in parallel), by rank."""
        ranks = sorted(self._records)
        with ThreadPoolExecutor(min(self.max_workers, len(ranks))) as pool:
            return list(pool.map(self.index, ranks))

    def tensors(self) -> dict[str, TensorMeta]:
        """Every key in the checkpoint with its dtype and full shape (reads indices only)."""
        out: dict[str, TensorMeta] = {}
        for key, items in self._by_key().items():
            it = items[0][1]
            out[key] = TensorMeta(key, dtype_from_name(it.dtype), it.full_shape, len(items))
        return dict(sorted(out.items()))

    def _by_key(self) -> dict[str, list[tuple[int, ItemEntry]]]:
        by_key: dict[str, list[tuple[int, ItemEntry]]] = {}
        for idx in self.indices():
            for it in idx.items:
                by_key.setdefault(it.key, []).append((idx.rank, it))
        for key, items in by_key.items():
            first = items[0][1]
            for _, it in items[1:]:
                if it.dtype != first.dtype or it.full_shape != first.full_shape:
                    raise self.store.corrupt(
                        f"key {key!r} of step {self.step} has pieces with "
                        f"different dtypes or full shapes",
                        step=self.step,
                    )
        return by_key

    # ------------------------------------------------------------------ reading
    def read(self, want: Want = None, *, strict: bool = True) -> dict[str, torch.Tensor]:
        """Read ``want`` (see the module docstring). Raises ``CheckpointError`` for a key that
        is not in the checkpoint (skipped with ``strict=False``), a range outside the tensor,
        rows no shard holds, a missing, truncated or corrupt shard, or a storage error."""
        by_key = self._by_key()
        if want is None:
            wanted: dict[str, tuple[int, int] | None] = dict.fromkeys(sorted(by_key))
        elif isinstance(want, Mapping):
            wanted = dict(want)
        else:
            wanted = dict.fromkeys(want)
        out: dict[str, torch.Tensor] = {}
        segs: list[_Seg] = []
        for key, rows in wanted.items():
            if key not in by_key:
                if strict:
                    raise CheckpointError(
                        f"key {key!r} is not in checkpoint step {self.step} "
                        f"({len(by_key)} keys); pass strict=False to skip it"
                    )
                continue
            out[key], new = self._plan_key(key, rows, by_key[key])
            segs.extend(new)
        per_rank: dict[int, list[_Seg]] = {}
        for s in segs:
            per_rank.setdefault(s.rank, []).append(s)
        if per_rank:
            with ThreadPoolExecutor(min(self.max_workers, len(per_rank))) as pool:
                for _ in pool.map(lambda r: self._fetch(r, per_rank[r]), sorted(per_rank)):
                    pass
        return out

    def _plan_key(
        self, key: str, rows: tuple[int, int] | None, items: list[tuple[int, ItemEntry]]
    ) -> tuple[torch.Tensor, list[_Seg]]:
        first = items[0][1]
        dtype, full = dtype_from_name(first.dtype), first.full_shape
        if not full:  # 0-dim: one whole item
            if rows is not None:
                raise CheckpointError(f"key {key!r} is a 0-dim tensor; ask for it whole (None)")
            out = torch.empty((), dtype=dtype)
            rank, it = items[0]
            return out, [
                _Seg(rank, it, it.offset, it.offset + it.length, it.offset, it.length, out)
            ] if it.length else []
        a, b = (0, full[0]) if rows is None else (int(rows[0]), int(rows[1]))
        if not 0 <= a <= b <= full[0]:
            raise CheckpointError(f"rows {a}:{b} of {key!r} are outside its dim 0 ({full[0]})")
        out = torch.empty((b - a, *full[1:]), dtype=dtype)
        segs: list[_Seg] = []
        covered = a
        for rank, it in sorted(items, key=lambda x: (x[1].start, x[0])):
            r0, r1 = max(it.start, covered), min(it.stop, b)
            if r1 <= r0:
                continue
            if r0 > covered:
                break
            rb = it.row_bytes
            chunk = self.index(rank).chunk_bytes
            lo_b, hi_b = (r0 - it.start) * rb, (r1 - it.start) * rb
            lo_c = lo_b // chunk * chunk
            hi_c = min(-(-hi_b // chunk) * chunk, it.length)
            if hi_b > lo_b:
                segs.append(
                    _Seg(
                        rank,
                        it,
                        it.offset + lo_c,
                        it.offset + hi_c,
                        it.offset + lo_b,
                        hi_b - lo_b,
                        out[r0 - a : r1 - a],
                    )
                )
            covered = r1
        if covered < b:
            have = sorted((it.start, it.stop) for _, it in items)
            raise self.store.corrupt(
                f"rows {covered}:{b} of {key!r} are in no shard of step "
                f"{self.step} (shards hold rows {have}); the checkpoint is "
                "incomplete",
                step=self.step,
            )
        return out, segs

    def _fetch(self, rank: int, segs: list[_Seg]) -> None:
        segs.sort(key=lambda s: s.lo)
        group: list[_Seg] = []
        for s in segs:
            if group and (
                s.lo - group[-1].hi > self.coalesce_gap
                or max(s.hi, group[-1].hi) - group[0].lo > self.max_read
            ):
                self._fetch_group(rank, group)
                group = []
            group.append(s)
        if group:
            self._fetch_group(rank, group)

    def _fetch_group(self, rank: int, group: list[_Seg]) -> None:
        start = group[0].lo
        end = max(s.hi for s in group)
        buf = self._read(rank, start, end - start)
        view = memoryview(buf)
        data = torch.frombuffer(buf, dtype=torch.uint8)
        index = self.index(rank)
        chunk = index.chunk_bytes
        crc = checksum_fn(index.checksum)
        rec = self._records[rank]
        for s in group:
            it = s.item
            for pos in range(s.lo, s.hi, chunk):
                ci = (pos - it.offset) // chunk
                stop = min(pos + chunk, it.offset + it.length)
                if crc(view[pos - start : stop - start]) != it.crc32[ci]:
                    raise self._corrupt(
                        rec,
                        f"{self._where(rec)}: checksum mismatch in {it.key!r} (bytes "
                        f"{pos - it.offset}..{stop - it.offset} of the item); the shard is "
                        "corrupt",
                    )
            if s.n:
                src = data[s.src - start : s.src - start + s.n].view(s.dest.dtype)
                s.dest.copy_(src.view(s.dest.shape))

    def verify(self) -> list[str]:
        """Read every byte of every shard and check every checksum. Returns the problems
        found (empty: all good); never raises for corruption."""
        return [str(e) for e in self.verify_errors()]

    def verify_errors(self) -> list[CheckpointError]:
        """``verify()``'s problems as the errors themselves, one per bad shard (a
        ``CheckpointCorruptError`` names its ``shard``; a ``StorageError`` is the storage
        failing, not the checkpoint)."""
        problems: list[CheckpointError] = []
        for rank in sorted(self._records):
            try:
                idx = self.index(rank)
                segs = [
                    _Seg(rank, it, it.offset, it.offset + it.length, it.offset, 0, torch.empty(0))
                    for it in idx.items
                    if it.length
                ]
                self._fetch(rank, segs)
            except CheckpointError as e:
                problems.append(e)
        return problems or self._coverage_errors()

    def _coverage_errors(self) -> list[CheckpointError]:
        """What ``read`` would refuse across shards, whose every byte is sound: pieces of one
        key that disagree on dtype or full shape, and rows of a key no shard holds."""
        try:
            by_key = self._by_key()
        except CheckpointError as e:
            return [e]
        problems: list[CheckpointError] = []
        for key, items in sorted(by_key.items()):
            full = items[0][1].full_shape
            covered = 0
            for _, it in sorted(items, key=lambda x: x[1].start):
                if it.start > covered:
                    break
                covered = max(covered, it.stop)
            if full and covered < full[0]:
                have = sorted((it.start, it.stop) for _, it in items)
                problems.append(self.store.corrupt(
                    f"rows {covered}:{full[0]} of {key!r} are in no shard of step "
                    f"{self.step} (shards hold rows {have}); the checkpoint is incomplete",
                    step=self.step))
        return problems

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(
    store: CheckpointStore,
    which: int | str | Manifest = "latest",
    want: Want = None,
    *,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """One call: read ``want`` from checkpoint ``which`` (see ``CheckpointReader.read``)."""
    with CheckpointReader(store, which) as r:
        return r.read(want, strict=strict)
