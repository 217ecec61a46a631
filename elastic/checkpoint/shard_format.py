"""The shard file format (no pickle) and who writes what.

A shard file is::

    [item bytes, each item at a 64-byte aligned offset][index: UTF-8 JSON][footer: 16 bytes]

The footer is ``<u64 little-endian index length><b"ELSHARD1">``. The index is::

    {"format": "elastic-shard", "version": 2, "step": s, "rank": r, "byteorder": "little",
     "chunk_bytes": 1048576, "checksum": "crc32c",
     "items": [{"key": "model/fc.weight", "dtype": "float32", "shape": [3, 8],
                "full_shape": [10, 8], "start": 4, "stop": 7,
                "offset": 0, "length": 96, "crc": [...]}, ...]}

An item is the raw little-endian bytes of a C-contiguous tensor. ``start``/``stop`` locate it
along dim 0 of the full tensor (``0``/``full_shape[0]`` for a whole tensor, ``0``/``0`` for a
0-dim one), so a shard may hold a slice of a sharded (FSDP-style) parameter. ``crc`` holds
the CRC-32C (Castagnoli, hardware-accelerated: ~14 GB/s per core here against ~4 GB/s for
zlib's CRC-32) of each ``chunk_bytes`` chunk of the item, counted from the item's start: a
reader checks exactly the chunks it reads. Version 1 (read, no longer written) had no
``checksum`` field and zlib CRC-32 values under ``crc32``. The manifest records the SHA-256 of the index bytes,
so the manifest covers the index and the index covers every data byte.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import struct
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastic.errors import CheckpointError

__all__ = [
    "ALIGN",
    "CHECKSUM",
    "DEFAULT_CHUNK_BYTES",
    "FOOTER",
    "Piece",
    "ItemEntry",
    "ShardIndex",
    "assign_owners",
    "owned_pieces",
    "as_pieces",
    "dtype_name",
    "dtype_from_name",
    "checksum_fn",
]

ALIGN = 64
DEFAULT_CHUNK_BYTES = 1 << 20
MAGIC = b"ELSHARD1"
FOOTER = struct.Struct("<Q8s")
FORMAT = "elastic-shard"
VERSION = 2
CHECKSUM = "crc32c"  # what this version writes; version 1 files hold zlib's "crc32"

_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n)
    for n in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, n, None), torch.dtype)
}
_NAMES = {v: k for k, v in _DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("elastic.checkpoint writes little-endian shards; this host is big-endian")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(
            f"dtype {dtype} cannot be checkpointed; supported: {sorted(_DTYPES)}"
        ) from None


def dtype_from_name(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in shard index")
    return _DTYPES[name]


@dataclass(frozen=True)
class Piece:
    """One tensor (or a dim-0 slice of one) that a rank writes.

    ``tensor`` holds rows ``start .. start + tensor.shape[0]`` of a full tensor of shape
    ``full_shape`` (``None``: the tensor is the full tensor). 0-dim tensors are always whole.
    The tensor may be on any device and need not be contiguous; it is copied by ``begin()``.
    """

    key: str
    tensor: torch.Tensor
    start: int = 0
    full_shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.tensor.shape)
        full = shape if self.full_shape is None else tuple(int(d) for d in self.full_shape)
        object.__setattr__(self, "full_shape", full)
        bad = ""
        if not isinstance(self.key, str) or not self.key:
            bad = "key must be a non-empty string"
        elif len(shape) != len(full) or shape[1:] != full[1:]:
            bad = f"shape {list(shape)} is not a dim-0 slice of full shape {list(full)}"
        elif not shape and self.start != 0:
            bad = "a 0-dim tensor cannot have a start offset"
        elif shape and not (0 <= self.start and self.start + shape[0] <= full[0]):
            bad = f"rows {self.start}..{self.start + shape[0]} exceed dim 0 of {list(full)}"
        if bad:
            raise CheckpointError(f"bad checkpoint piece {self.key!r}: {bad}")
        dtype_name(self.tensor.dtype)

    @property
    def stop(self) -> int:
        return self.start + self.tensor.shape[0] if self.tensor.dim() else 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True)
class ItemEntry:
    """Where one piece lies in a shard file and how to check it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    start: int
    stop: int
    offset: int
    length: int
    crc32: tuple[int, ...] = ()

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (of the whole item for a 0-dim tensor)."""
        n = dtype_from_name(self.dtype).itemsize
        for d in self.shape[1:]:
            n *= d
        return n

    def to_json(self, crc_key: str = "crc") -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "full_shape": list(self.full_shape),
            "start": self.start,
            "stop": self.stop,
            "offset": self.offset,
            "length": self.length,
            crc_key: list(self.crc32),
        }


@dataclass(frozen=True)
class ShardIndex:
    step: int
    rank: int
    chunk_bytes: int
    items: tuple[ItemEntry, ...]
    checksum: str = CHECKSUM  # the chunk checksum of ``ItemEntry.crc32``: crc32c or crc32

    @property
    def data_bytes(self) -> int:
        return max((it.offset + it.length for it in self.items), default=0)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "rank": self.rank,
            "byteorder": "little",
            "chunk_bytes": self.chunk_bytes,
            "checksum": self.checksum,
            "items": [it.to_json() for it in self.items],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(raw: bytes, where: str) -> ShardIndex:
        """Parse and validate an index; ``CheckpointError`` naming ``where`` if it is bad."""
        try:
            doc = json.loads(raw)
            version = doc.get("version")
            if doc.get("format") != FORMAT or version not in (1, VERSION):
                raise ValueError(f"format {doc.get('format')!r} v{version!r}")
            checksum = "crc32" if version == 1 else str(doc["checksum"])
            crc_key = "crc32" if version == 1 else "crc"
            checksum_fn(checksum)  # a known algorithm
            if doc.get("byteorder") != "little":
                raise ValueError(f"byteorder {doc.get('byteorder')!r}")
            chunk = _int(doc["chunk_bytes"], 1)
            items = []
            for d in doc["items"]:
                it = ItemEntry(
                    key=str(d["key"]),
                    dtype=str(d["dtype"]),
                    shape=tuple(_int(x) for x in d["shape"]),
                    full_shape=tuple(_int(x) for x in d["full_shape"]),
                    start=_int(d["start"]),
                    stop=_int(d["stop"]),
                    offset=_int(d["offset"]),
                    length=_int(d["length"]),
                    crc32=tuple(_int(x) for x in d[crc_key]),
                )
                _check_item(it, chunk)
                items.append(it)
            return ShardIndex(_int(doc["step"]), _int(doc["rank"]), chunk, tuple(items),
                              checksum)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: not a valid elastic shard index ({e})") from None


def checksum_fn(name: str) -> Callable[[Any], int]:
    """The chunk checksum ``name`` as a function of a bytes-like object."""
    if name == "crc32c":
        import crc32c

        return crc32c.crc32c
    if name == "crc32":
        import zlib

        return zlib.crc32
    raise ValueError(f"unknown checksum {name!r}")


def _int(x: Any, low: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"expected an integer >= {low}, got {x!r}")
    return x


def _check_item(it: ItemEntry, chunk: int) -> None:
    dt = dtype_from_name(it.dtype)
    numel = 1
    for d in it.shape:
        numel *= d
    if len(it.shape) != len(it.full_shape) or it.shape[1:] != it.full_shape[1:]:
        raise CheckpointError(f"item {it.key!r}: shape {it.shape} vs full shape {it.full_shape}")
    if it.shape and (it.stop - it.start != it.shape[0] or it.stop > it.full_shape[0]):
        raise CheckpointError(f"item {it.key!r}: rows {it.start}..{it.stop} do not fit")
    if it.length != numel * dt.itemsize:
        raise CheckpointError(f"item {it.key!r}: length {it.length} != {numel} x {dt.itemsize}")
    if len(it.crc32) != -(-it.length // chunk):
        raise CheckpointError(f"item {it.key!r}: {len(it.crc32)} checksums for {it.length} bytes")


def index_checksum(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def layout(pieces: Iterable[Piece]) -> tuple[list[tuple[Piece, int]], int]:
    """Assign each piece an aligned offset; return ``[(piece, offset)]`` and the data size.
    Raises ``CheckpointError`` if two pieces of one key overlap."""
    placed: list[tuple[Piece, int]] = []
    seen: dict[str, list[tuple[int, int]]] = {}
    off = 0
    for p in pieces:
        rows = (p.start, p.stop) if p.tensor.dim() else (0, 1)
        for a, b in seen.setdefault(p.key, []):
            if (rows[0] < b and a < rows[1]) or rows == (a, b):
                raise CheckpointError(f"piece {p.key!r} rows {rows} given twice in one shard")
        seen[p.key].append(rows)
        placed.append((p, off))
        off += -(-p.nbytes // ALIGN) * ALIGN
    return placed, off


def as_pieces(pieces: Mapping[str, torch.Tensor] | Iterable[Piece]) -> list[Piece]:
    """Accept ``{key: full tensor}`` or an iterable of ``Piece``."""
    if isinstance(pieces, Mapping):
        return [Piece(k, t) for k, t in pieces.items()]
    out = list(pieces)
    for p in out:
        if not isinstance(p, Piece):
            raise CheckpointError(f"expected Piece objects or a dict of tensors, got {type(p)}")
    return out


def assign_owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Give each key one owner rank, balancing bytes (largest first onto the least loaded
    rank; ties go to the lowest rank). Deterministic: depends only on ``sizes`` and
    ``world_size``, never on dict order, so every rank computes the same answer."""
    if world_size < 1:
        raise CheckpointError(f"world_size must be >= 1, got {world_size}")
    load = [(0, r) for r in range(world_size)]
    owners: dict[str, int] = {}
    for key, size in sorted(sizes.items(), key=lambda kv: (-int(kv[1]), kv[0])):
        total, rank = heapq.heappop(load)
        owners[key] = rank
        heapq.heappush(load, (total + int(size), rank))
    return {k: owners[k] for k in sizes}


def owned_pieces(
    state: Mapping[str, torch.Tensor],
    rank: int,
    world_size: int,
    owners: Mapping[str, int] | None = None,
) -> list[Piece]:
    """The pieces of a replicated (data-parallel) state that ``rank`` writes: the keys
    ``assign_owners`` gives it (or the ``owners`` map passed in)."""
    if owners is None:
        owners = assign_owners(
            {k: t.numel() * t.element_size() for k, t in state.items()}, world_size
        )
    return [Piece(k, t) for k, t in state.items() if owners[k] == rank]
