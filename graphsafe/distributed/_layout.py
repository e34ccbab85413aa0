"""The layout of a sync on the wire: which entry goes into which bucket, and where.

Every rank agrees on a `_Plan` (broadcast as the sync's metadata) before any data moves:
each entry's bucket and its byte offset, aligned to `_ALIGN`, and each bucket's data
size; a bucket travels with a `_TRAILER` after its data. A staging buffer holds one
bucket slot, or two when the transfer overlaps the copies (`_slots`, `_slot`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from graphsafe.distributed._reports import WeightSyncError

_PROTOCOL = 1
_MAGIC = 0x6773_5359_4E43  # "gsSYNC"
_ALIGN = 64
_TRAILER = 32  # four int64: magic, sync id, bucket index, status
_DATA, _ABORT = 1, 2


class _Entry(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class _Plan:
    """The metadata every rank agrees on before any data moves."""

    sync: int
    entries: tuple[_Entry, ...]
    sizes: tuple[int, ...]
    """Data bytes per bucket."""

    @property
    def wires(self) -> tuple[int, ...]:
        """Bytes broadcast per bucket: data, padding, trailer."""
        return tuple(_align(s) + _TRAILER for s in self.sizes)

    def bucket(self, index: int) -> tuple[_Entry, ...]:
        return tuple(e for e in self.entries if e.bucket == index)

    def record(self) -> dict[str, Any]:
        return {"protocol": _PROTOCOL, "sync": self.sync, "abort": None,
                "entries": [tuple(e) for e in self.entries], "sizes": list(self.sizes)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> _Plan:
        entries = tuple(_Entry(n, tuple(s), d, b, o, nb) for n, s, d, b, o, nb in record["entries"])
        return cls(sync=record["sync"], entries=entries, sizes=tuple(record["sizes"]))


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(
            f"the sync carries an entry of unknown dtype {name!r}",
            expected="a dtype this build of torch knows",
            got=name,
            fix="run the same torch version on the sender and the receivers",
        )
    return dtype


def _plan(items: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int, sync: int) -> _Plan:
    """Pack entries in order into buckets of at most `bucket_bytes` data bytes."""
    entries: list[_Entry] = []
    sizes: list[int] = []
    seen: set[str] = set()
    fill = -1  # data bytes of the open bucket; -1: none open
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"weights must be (name, tensor) pairs, got {type(item).__name__}")
        name, t = item
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(
                f"weights must be (str, Tensor) pairs, got ({type(name).__name__}, "
                f"{type(t).__name__})"
            )
        if t.layout != torch.strided:
            raise TypeError(f"entry {name!r} is a {t.layout} tensor; only dense tensors sync")
        if name in seen:
            raise ValueError(f"entry {name!r} appears twice in one sync")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        if fill < 0 or (fill > 0 and _align(fill) + nbytes > bucket_bytes):
            if fill >= 0:
                sizes.append(fill)
            fill = 0
        offset = _align(fill) if fill else 0
        entries.append(_Entry(name, tuple(t.shape), _dtype_name(t.dtype), len(sizes), offset,
                              nbytes))
        fill = offset + nbytes
        if fill >= bucket_bytes:  # full, or one tensor larger than a bucket: close it
            sizes.append(fill)
            fill = -1
    if fill >= 0:
        sizes.append(fill)
    return _Plan(sync=sync, entries=tuple(entries), sizes=tuple(sizes))


def _view(staging: torch.Tensor, e: _Entry) -> torch.Tensor:
    return staging[e.offset : e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def _trailer(staging: torch.Tensor, size: int) -> torch.Tensor:
    at = _align(size)
    return staging[at : at + _TRAILER].view(torch.int64)  # [4]


def _slots(wires: Sequence[int], overlap: bool) -> tuple[int, int]:
    """The staging layout of a sync: (offset of the second slot, 0 for one slot; bytes).

    Even buckets go to the first slot, odd ones to the second: each slot is as large as
    the largest bucket it holds, so a sync of one large bucket and smaller ones needs
    less than two large buckets.
    """
    if overlap and len(wires) > 1:
        stride = _align(max(wires[0::2]))
        return stride, stride + max(wires[1::2])
    return 0, max(wires, default=0)


def _slot(staging: torch.Tensor, stride: int, wires: Sequence[int], b: int) -> torch.Tensor:
    """Bucket `b`'s slot: its data, padding and trailer."""
    at = stride * (b % 2)
    return staging[at : at + wires[b]]
