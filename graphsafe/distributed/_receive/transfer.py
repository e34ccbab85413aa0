"""The transfer on the receiving side: each bucket broadcast into staging segment by
segment, each segment's part of the entries fingerprinted as it arrives, the trailer
checked, then the entries given to the loader. The fingerprints are compared with the
sender's at the handshake, where both are said (`_mismatches` names the entries that
differ here)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from graphsafe._errors import one_line
from graphsafe._fingerprint.digest import Digest, Pieces, hexdigest
from graphsafe._memory.journal import mark_written
from graphsafe._runtime.runtime import runtime
from graphsafe.distributed._control.channel import _Channel, _recovery_of, _ToldError
from graphsafe.distributed._protocol.exchange import _SHOWN, _names
from graphsafe.distributed._protocol.layout import (
    _ABORT,
    _DATA,
    _MAGIC,
    _dtype,
    _Entry,
    _Plan,
    _Ring,
    _trailer,
)
from graphsafe.distributed._receive.loading import _load_run
from graphsafe.distributed._reports import RejectedEntry, WeightSyncError
from graphsafe.distributed._staging import _drop_busy, _staging


class _Mismatch(NamedTuple):
    """An entry whose bytes arrived other than the sender's tensor held them."""

    name: str
    bucket: int
    got: str
    """The fingerprint of what arrived here."""
    sent: str
    """The sender's, of the tensor it was given."""


@dataclass(frozen=True)
class _Transfer:
    """What the transfer of one sync did on this rank (`_receive` returns it)."""

    staging_bytes: int
    """Size of the staging buffer it received into."""
    reused: bool
    """Whether that buffer was an earlier sync's."""
    overlap: bool
    """Whether receiving overlapped loading (`overlap`, and more than one bucket)."""
    accepted: tuple[str, ...]
    """Names the loader reported loading."""
    rejected: tuple[RejectedEntry, ...]
    """Entries the loader refused."""
    fingerprints: tuple[Digest, ...] | None
    """The fingerprint of every entry, of the bytes that arrived here, in the plan's
    order (None: not verified)."""
    fingerprint_seconds: float
    """Time spent taking them."""

    @property
    def fingerprinted(self) -> int:
        """Entries whose fingerprint is compared with the sender's (0: not verified)."""
        return 0 if self.fingerprints is None else len(self.fingerprints)


def _receive(
    model: nn.Module,
    plan: _Plan,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    overlap: bool,
    channel: _Channel,
) -> _Transfer | WeightSyncError:
    """The transfer: each bucket into staging, its entries' fingerprints and the loader,
    then the sender's fingerprints.

    Returns:
        What it did; or the sender's abort, read in a bucket's trailer, which every rank
        raises in step (the caller raises it and posts no abort).

    Raises:
        WeightSyncError: A bucket or the fingerprints did not arrive, or a trailer is
            wrong.
    """
    runtime(model).expect_writes(_sync_writes(model, plan))
    wires = plan.wires
    buckets = len(plan.sizes)
    ring = _Ring(wires, _Ring.size(wires, plan.bucket_bytes, overlap))
    staging, reused = _staging(model, group, device, ring.capacity)
    loader = getattr(model, "load_weights", None)
    accepted: list[str] = []
    rejected: list[RejectedEntry] = []
    by_bucket: list[list[_Entry]] = [[] for _ in plan.sizes]
    for e in plan.entries:
        by_bucket[e.bucket].append(e)
    check = _Fingerprints(plan, by_bucket) if plan.verify else None
    flight = _InFlight(plan, wires, ring, staging, src, group, overlap, channel,
                       check.segment if check is not None else None)
    group_bytes = ring.capacity // 2  # one group loads while the next one arrives
    try:
        flight.post_ahead()
        done = 0
        while done < buckets:
            run = flight.arrived_run(group_bytes)
            if flight.aborted is not None:
                return flight.aborted
            mark_written(staging)  # c10d writes: declared, whatever the tracker saw
            flight.post_ahead()  # the next buckets arrive while the loader runs
            # Every segment of the run was fingerprinted as it arrived (`_InFlight.
            # arrived`): the bytes received, before the loader can touch them.
            loaded, refused = _load_run(model, loader, run, by_bucket)
            accepted.extend(loaded)
            rejected.extend(refused)
            flight.release(len(run))
            done += len(run)
            flight.post_ahead()
    finally:
        if flight.works:  # a broadcast still writes into it: no later sync may reuse it
            _drop_busy(model, group, staging)
    return _Transfer(staging_bytes=staging.numel(), reused=reused,
                     overlap=overlap and buckets > 1, accepted=tuple(accepted),
                     rejected=tuple(rejected),
                     fingerprints=tuple(check.done()) if check is not None else None,
                     fingerprint_seconds=check.seconds if check is not None else 0.0)


def _mismatches(plan: _Plan, transfer: _Transfer, sent: Sequence[Digest],
                changed: Sequence[int]) -> tuple[_Mismatch, ...]:
    """The entries (plan indices `changed`) whose fingerprint here differs from the
    sender's (`sent`), as the handshake found them."""
    mine = transfer.fingerprints or ()
    return tuple(_Mismatch(plan.entries[i].name, plan.entries[i].bucket, hexdigest(mine[i]),
                           hexdigest(sent[i])) for i in changed)


class _Fingerprints:
    """The fingerprints of a verified sync's entries, taken on this rank from the bytes
    received, segment by segment as each arrives (`segment`), so that only the last
    segment's waits after the last byte; `done` gives each entry's, in the plan's order.
    """

    def __init__(self, plan: _Plan, by_bucket: list[list[_Entry]]) -> None:
        self.plan: Final = plan
        self.by_bucket: Final = [sorted(es, key=lambda e: e.offset) for es in by_bucket]
        self.index: Final = {e.name: i for i, e in enumerate(plan.entries)}
        self.pieces: Final = Pieces(len(plan.entries))
        self.first = [0] * len(plan.sizes)  # per bucket: its first entry not all arrived
        self.seconds = 0.0
        """Time spent taking them."""

    def segment(self, b: int, slot: torch.Tensor, lo: int, hi: int) -> None:
        """Bytes `[lo, hi)` of bucket `b` arrived in `slot`: add their part of each entry
        (segments of a bucket arrive in order, its entries lie in order of offset)."""
        start = time.perf_counter()
        entries = self.by_bucket[b]
        j = self.first[b]
        while j < len(entries) and entries[j].offset < hi:
            e = entries[j]
            end = e.offset + e.nbytes
            at = max(lo, e.offset)
            if at < min(hi, end):
                self.pieces.add(self.index[e.name], slot[at : min(hi, end)], at - e.offset)
            if end <= hi:
                self.first[b] = j + 1
            j += 1
        self.seconds += time.perf_counter() - start

    def done(self) -> list[Digest]:
        """Every entry's fingerprint, in the plan's order."""
        start = time.perf_counter()
        got = self.pieces.done([(_dtype(e.dtype), e.shape) for e in self.plan.entries])
        self.seconds += time.perf_counter() - start
        return got


def _sync_writes(model: nn.Module, plan: _Plan) -> list[str] | None:
    """The tensors the sync writes, should it fail: its entries, when each names a tensor
    of the model; None (any tensor) when the loader maps names (stacked projections) or
    keeps only some entries (a pipeline stage)."""
    names = [e.name for e in plan.entries]
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known.update(n for n, _ in model.named_buffers(remove_duplicate=False))
    return names if known.issuperset(names) else None


class _InFlight:
    """The buckets posted into a receiver's staging and not loaded yet, oldest first.

    Buckets are posted as far ahead as the staging ring has room for, but never past a
    packed bucket whose trailer is not read yet: if it says the sender aborted, the
    sender sends nothing after it but its error, and a broadcast posted beyond it would
    take that error's place.
    """

    def __init__(
        self, plan: _Plan, wires: tuple[int, ...], ring: _Ring, staging: torch.Tensor,
        src: int, group: dist.ProcessGroup | None, overlap: bool, channel: _Channel,
        on_segment: Callable[[int, torch.Tensor, int, int], None] | None = None,
    ) -> None:
        self.plan: Final = plan
        self.wires: Final = wires
        self.ring: Final = ring
        self.staging: Final = staging
        self.src: Final = src
        self.group: Final = group
        self.overlap: Final = overlap
        self.channel: Final = channel
        self.on_segment: Final = on_segment
        """Called with (bucket, slot, start, end) as each segment arrives."""
        # (bucket, its slot, (start, end, work) per segment), oldest first.
        self.works: collections.deque[
            tuple[int, torch.Tensor, list[tuple[int, int, Any]]]] = collections.deque()
        self.next = 0  # the first bucket not posted yet
        self.aborted: WeightSyncError | None = None
        """The sender's abort, once a trailer said it: nothing arrives after that bucket."""

    def post_ahead(self) -> None:
        """Post the next buckets that fit in staging now (one at a time without
        `overlap`)."""
        plan, wires, works = self.plan, self.wires, self.works
        b = self.next
        while (
            b < len(wires)
            and (self.overlap or not works)
            and all(plan.direct[i] for i, _, _ in works)
        ):
            at = self.ring.place(b)
            if at is None:
                break
            slot = self.staging[at : at + wires[b]]
            if not plan.direct[b]:  # a stale trailer never passes for this one
                _trailer(slot, plan.sizes[b]).zero_()
            try:
                segments = [(lo, hi, dist.broadcast(slot[lo:hi], src=self.src,
                                                    group=self.group, async_op=True))
                            for lo, hi in plan.segments(b)]
            except Exception as exc:
                raise self.lost(b, exc) from exc
            works.append((b, slot, segments))
            b += 1
        self.next = b

    def arrived(self) -> tuple[int, torch.Tensor]:
        """Wait for the oldest bucket in flight, segment by segment, each one given to
        `on_segment` as it arrives; check its trailer if it has one (a trailer that says
        the sender aborted sets `aborted`)."""
        b, slot, segments = self.works[0]  # held until every segment arrived: a failure
        # before that leaves the rest in flight, and `works` says so (`_drop_busy`)
        for lo, hi, work in segments:
            try:
                self.channel.wait(work, f"receiving bucket {b}")
            except _ToldError:
                raise
            except Exception as exc:
                raise self.lost(b, exc) from exc
            if self.on_segment is not None:
                self.on_segment(b, slot, lo, hi)
        self.works.popleft()
        if not self.plan.direct[b]:  # a direct bucket has none: the next trailer tells
            self.aborted = _check_trailer(slot, self.plan.sizes[b], self.plan, b, self.src,
                                          self.channel)
        return b, slot

    def arrived_run(self, limit: int) -> list[tuple[int, torch.Tensor]]:
        """The oldest bucket once arrived, with the direct buckets after it while the run
        stays within `limit` bytes: one loader call for them all, as a call of a model's
        loader has a cost of its own."""
        direct, wires, works = self.plan.direct, self.wires, self.works
        b, slot = self.arrived()
        run = [(b, slot)]
        size = wires[b]
        while direct[b] and works and direct[works[0][0]] and size + wires[works[0][0]] <= limit:
            b, slot = self.arrived()
            run.append((b, slot))
            size += wires[b]
        return run

    def release(self, n: int) -> None:
        """The `n` oldest buckets held were loaded: their staging may take others."""
        for _ in range(n):
            self.ring.release()

    def lost(self, b: int, exc: BaseException) -> WeightSyncError:
        """The error for bucket `b`, whose broadcast failed."""
        entries = self.plan.bucket(b)
        return WeightSyncError(
            f"receive_weights: bucket {b} of {len(self.wires)} did not arrive from rank "
            f"{self.src}",
            bucket=b,
            entry=entries[0].name if entries else None,
            expected=f"{self.wires[b]} bytes within the group's timeout",
            got=one_line(exc),
            fix="the sender died or timed out; see its log (the other ranks were told to "
            "abort). The model refuses to replay until a complete sync",
            recovery=_recovery_of(exc),
        )


def _check_trailer(
    slot: torch.Tensor, size: int, plan: _Plan, b: int, src: int, channel: _Channel
) -> WeightSyncError | None:
    """Check bucket `b`'s trailer: raise if it is wrong; return the sender's abort if it
    says so (every rank raises that one in step), else None."""
    magic, sync, index, status = _trailer(slot, size).tolist()
    if (magic, sync, index) != (_MAGIC, plan.sync, b) or status not in (_DATA, _ABORT):
        raise WeightSyncError(
            f"receive_weights: bucket {b} arrived with a wrong trailer",
            bucket=b,
            expected=f"magic {_MAGIC:#x}, sync {plan.sync}, bucket {b}",
            got=f"magic {magic:#x}, sync {sync}, bucket {index}, status {status}",
            fix="a bucket arrived short, long or torn, or a rank called another collective "
            "in between: every rank of the group must take part in the same sync",
            recovery="group",
        )
    if status == _ABORT:
        entries = plan.bucket(b)
        box = [channel.get("error") or "(its error did not arrive)"]
        return WeightSyncError(
            f"receive_weights: the sender (rank {src}) aborted the sync at bucket {b} of "
            f"{len(plan.sizes)}",
            bucket=b,
            entry=entries[0].name if entries else None,
            expected="every bucket of the sync",
            got=f"the sender raised {box[0]}",
            fix="fix the error on the sender, then sync again; the model refuses to "
            "replay until a complete sync",
        )
    return None


def _mismatch_error(
    mismatched: tuple[_Mismatch, ...], rank: int, src: int, report: Any
) -> WeightSyncError:
    """The error naming the entries whose bytes arrived other than the sender's tensors
    held them."""
    n = len(mismatched)
    shown = "\n".join(f"    {m.name!r} (bucket {m.bucket}): fingerprint {m.got}, the "
                      f"sender's {m.sent}" for m in mismatched[:_SHOWN])
    more = f"\n    ... and {n - _SHOWN} more" if n > _SHOWN else ""
    return WeightSyncError(
        f"rank {rank}: {n} entr{'y' if n == 1 else 'ies'} of the sync arrived other than "
        f"the sender was given {'it' if n == 1 else 'them'}: "
        f"{_names([m.name for m in mismatched])}",
        entry=mismatched[0].name,
        bucket=mismatched[0].bucket,
        mismatched=[m.name for m in mismatched],
        report=report,
        expected=f"the fingerprints rank {src} took of the tensors it was given, before "
        "packing them",
        got=f"the fingerprints of the bytes this rank received:\n{shown}{more}",
        fix="bytes changed between the trainer's tensors and this rank (in the sender's "
        "staging buffer, on the wire, or a bucket arrived short or torn): send the sync "
        "again; until a complete sync every receiver's model refuses to replay",
    )
