"""The layout of a sync on the wire: which entry goes into which bucket, and where.

Every rank agrees on a `_Plan` (posted as the sync's metadata) before any data moves:
each entry's bucket and its byte offset, aligned to `_ALIGN`, and each bucket's data
size. A packed bucket travels with a `_TRAILER` after its data. A direct bucket is one
large entry broadcast straight from the sender's tensor, with no copy into staging and
no trailer; the next packed bucket's trailer (the plan ends with one) says whether the
sender held up, so a failure in a run of direct buckets is still told. A staging buffer
holds one bucket slot, or two when the transfer overlaps the copies (`_slots`, `_slot`).
In a verified sync (the default) every rank says every entry's fingerprint at the
end-of-sync handshake (`_FINGERPRINT_WORDS` int64 per entry, in the plan's order, after
its status word): no collective of their own.

The last bucket that carries entries travels in segments that halve toward its end,
down to `segment_bytes` (`_segments`), one broadcast each, so that a receiver
fingerprints each segment as it arrives, while the next ones are on the way, and only
the last segment's fingerprint waits after the last byte. Every other bucket is one
broadcast: a receiver fingerprints it while the next bucket arrives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import torch

from graphsafe._fingerprint.digest import Digest
from graphsafe.distributed._reports import WeightSyncError

_PROTOCOL = 6  # 6: the fingerprints travel in the handshake (5: in a broadcast of their
# own, after the last bucket, whose last bucket travels in segments as here)
_MAGIC = 0x6773_5359_4E43  # "gsSYNC"
_ALIGN = 64
_TRAILER = 32  # four int64: magic, sync id, bucket index, status
_DATA, _ABORT = 1, 2
_FINGERPRINT_WORDS = 2  # a fingerprint on the wire: its two 64-bit words
_SEGMENT = 1 << 20  # the last segment's bytes, a multiple of _ALIGN: its fingerprint
# is what waits after the last byte (tens of microseconds), and a broadcast's own cost
# (about 0.1 ms on loopback) is paid once per halving


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
    direct: tuple[bool, ...]
    """Per bucket: one entry sent from the sender's own tensor, without a trailer."""
    bucket_bytes: int = 0
    """The sender's bucket size: what a receiver may hold in flight at once."""
    partial: bool = False
    """The sender says the sync carries only some entries: receivers do not require
    every entry they expect (each still refuses entries no rank expects)."""
    verify: bool = False
    """Every entry's fingerprint, taken by the sender from the tensor it was given,
    follows the last bucket, for the receivers to compare with theirs."""
    segment_bytes: int = _SEGMENT
    """The size of the last bucket's last segments (its earlier ones halve down to it)."""

    @property
    def wires(self) -> tuple[int, ...]:
        """Bytes broadcast per bucket: data, then padding and trailer unless direct."""
        return tuple(s if d else _align(s) + _TRAILER for s, d in zip(self.sizes, self.direct))

    def bucket(self, index: int) -> tuple[_Entry, ...]:
        return tuple(e for e in self.entries if e.bucket == index)

    def segments(self, index: int) -> list[tuple[int, int]]:
        """Bucket `index`'s segments on the wire: `(start, end)` byte ranges, in order;
        one unless it is the last bucket that carries entries."""
        last = self.entries[-1].bucket if self.entries else -1
        if index != last:
            return [(0, self.wires[index])]
        return _segments(self.wires[index], self.segment_bytes)

    def record(self) -> dict[str, Any]:
        return {"protocol": _PROTOCOL, "sync": self.sync, "abort": None,
                "entries": [tuple(e) for e in self.entries], "sizes": list(self.sizes),
                "direct": list(self.direct), "bucket_bytes": self.bucket_bytes,
                "partial": self.partial, "verify": self.verify,
                "segment_bytes": self.segment_bytes}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> _Plan:
        entries = tuple(_Entry(n, tuple(s), d, b, o, nb) for n, s, d, b, o, nb in record["entries"])
        return cls(sync=record["sync"], entries=entries, sizes=tuple(record["sizes"]),
                   direct=tuple(bool(d) for d in record["direct"]),
                   bucket_bytes=int(record["bucket_bytes"]),
                   partial=bool(record["partial"]), verify=bool(record["verify"]),
                   segment_bytes=int(record["segment_bytes"]))

    def __post_init__(self) -> None:
        if self.segment_bytes < _ALIGN or self.segment_bytes % _ALIGN:
            raise ValueError(f"a sync's segments hold a positive multiple of {_ALIGN} "
                             f"bytes, not {self.segment_bytes}")


def _fingerprints_wire(digests: Sequence[Digest], device: torch.device) -> torch.Tensor:
    """The fingerprints as they travel: int64 [entries, 2], the same bits."""
    signed = [[w - (1 << 64) if w >> 63 else w for w in d] for d in digests]
    return torch.tensor(signed, dtype=torch.int64, device=device).reshape(
        len(digests), _FINGERPRINT_WORDS)


def _fingerprints_read(wire: torch.Tensor) -> list[Digest]:
    """The fingerprints as `_fingerprints_wire` sent them, as unsigned words."""
    mask = (1 << 64) - 1
    return [(a & mask, b & mask) for a, b in wire.cpu().tolist()]


def _segments(wire: int, segment: int) -> list[tuple[int, int]]:
    """`[0, wire)` cut in segments that halve toward its end (at multiples of `_ALIGN`)
    until less than `2 * segment` bytes are left: 64 MiB in 32, 16, 8, 4, 2, 1 and 1 MiB."""
    out: list[tuple[int, int]] = []
    lo = 0
    while wire - lo >= 2 * segment:
        half = (wire - lo) // 2 // _ALIGN * _ALIGN
        out.append((lo, lo + half))
        lo += half
    out.append((lo, wire))
    return out


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


def _sendable(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` can be broadcast as it is: a plain dense tensor, contiguous, on the
    group's device (a subclass may run code on reads: it is copied like the rest)."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device == device
        and t.is_contiguous()
        and t.numel() > 0
    )


def _plan(
    items: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    sync: int,
    direct_bytes: int | None = None,
    device: torch.device | None = None,
    *,
    partial: bool = False,
    verify: bool = False,
    segment_bytes: int | None = None,
) -> _Plan:
    """Pack entries in order into buckets of at most `bucket_bytes` data bytes; entries
    of `direct_bytes` and more that can be broadcast as they are go in direct buckets.
    The last bucket travels in segments down to `segment_bytes` (None: `_SEGMENT`)."""
    entries: list[_Entry] = []
    sizes: list[int] = []
    direct: list[bool] = []
    fill = -1  # data bytes of the open bucket; -1: none open

    def close() -> None:
        nonlocal fill
        if fill >= 0:
            sizes.append(fill)
            direct.append(False)
        fill = -1

    for name, t in _checked(items):
        nbytes = t.numel() * t.element_size()
        dtype = _dtype_name(t.dtype)
        if (direct_bytes is not None and device is not None and nbytes >= direct_bytes
                and _sendable(t, device)):
            close()
            entries.append(_Entry(name, tuple(t.shape), dtype, len(sizes), 0, nbytes))
            sizes.append(nbytes)
            direct.append(True)
            continue
        if fill > 0 and _align(fill) + nbytes > bucket_bytes:
            close()
        if fill < 0:
            fill = 0
        offset = _align(fill) if fill else 0
        entries.append(_Entry(name, tuple(t.shape), dtype, len(sizes), offset, nbytes))
        fill = offset + nbytes
        if fill >= bucket_bytes:  # full, or one tensor larger than a bucket: close it
            close()
    close()
    if direct and direct[-1]:
        # The trailer after the last direct bucket: it says whether the sender held up.
        sizes.append(0)
        direct.append(False)
    return _Plan(sync=sync, entries=tuple(entries), sizes=tuple(sizes), direct=tuple(direct),
                 bucket_bytes=bucket_bytes, partial=partial, verify=verify,
                 segment_bytes=_SEGMENT if segment_bytes is None else segment_bytes)


def _checked(
    items: Sequence[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The items, each checked as it is reached: (str, dense Tensor) pairs, no name twice."""
    seen: set[str] = set()
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
        yield name, t


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


class _Ring:
    """Where a receiver puts each bucket in its staging buffer: in order, wrapping
    around, never over a bucket still held (posted and not yet loaded). Many small
    buckets can then be in flight at once, in the memory of one large one.

    Args:
        wires: Bytes of each bucket on the wire.
        capacity: Bytes of staging.
    """

    def __init__(self, wires: Sequence[int], capacity: int) -> None:
        self.wires: Final = wires
        self.capacity: Final = capacity
        self.cursor = 0
        self.held: list[tuple[int, int]] = []  # (start, end) of buckets held, oldest first

    @staticmethod
    def size(wires: Sequence[int], bucket_bytes: int, overlap: bool) -> int:
        """Staging bytes: the largest bucket, or with `overlap` two of them, or as many
        buckets as one of the sender's buckets holds, whichever is more (never more than
        the whole sync)."""
        largest = _align(max(wires, default=0))
        if not overlap or len(wires) < 2:
            return largest
        total = sum(_align(w) for w in wires)
        return max(min(2 * largest, total), min(bucket_bytes, total))

    def place(self, b: int) -> int | None:
        """The offset of bucket `b`, now held; None while it does not fit yet."""
        w = _align(self.wires[b])
        start = self.cursor if self.cursor + w <= self.capacity else 0
        end = start + w
        if any(start < e and s < end for s, e in self.held):
            return None
        self.held.append((start, end))
        self.cursor = end
        return start

    def release(self) -> None:
        """The oldest bucket held was loaded: its memory may take another."""
        self.held.pop(0)
