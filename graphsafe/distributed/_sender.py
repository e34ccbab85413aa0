"""The sending side of a sync: `send_weights`, and the abort it sends when it fails."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from graphsafe._errors import one_line
from graphsafe._fingerprint.digest import Digests
from graphsafe.distributed._control.channel import _Channel, _recovery_of
from graphsafe.distributed._protocol.exchange import (
    _APPLIED,
    _check,
    _device,
    _handshake,
    _names,
    _Outcome,
    _verdicts,
)
from graphsafe.distributed._protocol.layout import (
    _ABORT,
    _DATA,
    _MAGIC,
    _PROTOCOL,
    _Plan,
    _plan,
    _slot,
    _slots,
    _trailer,
    _view,
)
from graphsafe.distributed._reports import SendReport, WeightSyncError
from graphsafe.distributed._staging import _drop_busy, _staging

__all__ = ["send_weights"]


@dataclass
class _SendProgress:
    meta_sent: bool = False
    bucket: int = -1
    """The bucket being packed."""
    entry: str | None = None
    in_collective: bool = False
    wire: int = -1
    """The bucket whose broadcast is being posted or waited for; -1: none."""
    staging: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    """The staging slot of the bucket being packed."""
    pending: list[tuple[int, list[Any]] | None] = field(default_factory=lambda: [None, None])
    """Per slot: (bucket, works of its segments) of a broadcast not yet waited for."""
    direct: list[tuple[int, list[Any]]] = field(default_factory=list)
    """(bucket, works of its segments) of direct broadcasts not yet waited for (they read
    the caller's tensors, not staging: nothing waits for them before the end)."""
    posted: int = -1
    """The last bucket whose broadcast was posted."""
    channel: _Channel | None = None
    plan: _Plan | None = None
    phase: str = "the metadata"
    """What the sync is doing, outside the buckets: for errors."""
    refused: bool = False
    """The receivers refused the sync's entries (every rank raised, in step)."""
    digests: Digests = field(default_factory=Digests)
    """Per entry packed or posted so far: its fingerprint, taken from the caller's tensor
    before packing (when the sync is verified)."""
    fingerprint_seconds: float = 0.0
    """Time spent taking them."""

    def fingerprint(self, t: torch.Tensor, name: str, into: torch.Tensor | None = None
                    ) -> None:
        """Take the fingerprint of entry `name` from `t`, the tensor the caller gave (and
        pack it `into` its place in staging: on a CPU one pass does both)."""
        start = time.perf_counter()
        self.entry = name
        self.digests.add(t, name, into=into)
        self.fingerprint_seconds += time.perf_counter() - start

    def join(self, work: Any, what: str) -> None:
        """Wait for a collective, watching the store for another rank's abort."""
        assert self.channel is not None
        self.channel.wait(work, what)

    def wait(self, slot: int) -> None:
        """Wait for the broadcast from `slot`, if one is in flight."""
        item = self.pending[slot]
        if item is None:
            return
        self.wire, works = item
        self.in_collective = True
        for work in works:
            self.join(work, f"sending bucket {self.wire}")
        self.pending[slot] = None
        self.in_collective = False
        self.wire = -1

    def drain(self) -> None:
        """Wait for every broadcast in flight, in bucket order."""
        works = self.direct + [item for item in self.pending if item is not None]
        for b, segments in sorted(works, key=lambda item: item[0]):
            self.wire, self.in_collective = b, True
            for work in segments:
                self.join(work, f"sending bucket {b}")
            self.in_collective, self.wire = False, -1
        self.direct.clear()
        self.pending = [None, None]


def send_weights(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 256 << 20,
    overlap: bool = True,
    direct_bytes: int | None = 16 << 20,
    partial: bool = False,
    verify: bool = True,
) -> SendReport:
    """Broadcast checkpoint entries to every other rank of `group`, bucket by bucket.

    Call it on rank `src` while every other rank of the group calls `receive_weights`.
    Entries are packed in the given order into flat buckets of at most `bucket_bytes`
    data bytes; a tensor larger than that is sent alone in a bucket of its own size.
    Tensors may live on any device; they are copied into the staging buffer. With
    `overlap`, bucket k+1 is packed into one staging slot while bucket k is broadcast
    from the other. A contiguous tensor of `direct_bytes` or more on the group's device
    is broadcast as it is, with no copy (the receivers still receive it into staging),
    and the sender does not wait for it before the next bucket: keep the tensors
    unchanged until the call returns.

    The sync is complete by default: each receiver checks, before any data moves, that
    the metadata announces every entry its model expects and that every entry is
    expected by some receiver; otherwise every rank raises naming the entries, and no
    byte is written. A sync of only some entries must say so with `partial=True`; it
    then heals only what it rewrites.

    It is checked end to end by default (`verify`): this rank takes each entry's
    fingerprint (`gs.fingerprint`) from the tensor it was given, before packing it, and
    says them at the end-of-sync handshake; each receiver takes the fingerprint of the
    bytes it received for the entry before its loader runs, and says its own there. An
    entry that arrived other than it was given fails the sync on every rank, naming it.

    Args:
        weights: `(name, tensor)` pairs in checkpoint names, or a mapping (a state dict).
        src: This rank (global), the source of the broadcasts.
        group: The process group; the default group when None. Give it a timeout
            (`dist.new_group(timeout=...)`): a receiver that died is detected by it.
        bucket_bytes: Data bytes per bucket.
        overlap: Pack the next bucket while the current one is broadcast; the staging
            buffer then holds two buckets. False: one bucket, packing and broadcasts in
            turn.
        direct_bytes: Entries of at least this many bytes that can be sent as they are
            go without the packing copy (each costs a collective of its own, so small
            entries are packed); None packs every entry.
        partial: The sync carries only some of the entries the receivers expect (a
            subset a failed sync owed, or the layers that changed). Entries no receiver
            expects are refused all the same.
        verify: Fingerprint every entry end to end (above); False sends none and the
            receivers check only the plan and the trailers (a byte flipped or a bucket
            cut short on the way then reaches the model unseen).

    Returns:
        The report.

    Raises:
        WeightSyncError: A receiver refused the sync's entries (missing, extra or
            misrouted names), a collective failed (a receiver died or timed out; the
            other receivers are told at once), or some receivers did not apply the sync
            (`.failed_ranks`; their errors say why; `.mismatched` names the entries
            that arrived other than they were given). `.recovery` says what the next sync
            needs (`gsd.recover`).
        Exception: Whatever reading or packing the weights raised, after the receivers
            were told to abort (they raise `WeightSyncError`).

    Examples:
        >>> # on the trainer, rank 0, while ranks 1.. call receive_weights:
        >>> # report = send_weights(model.state_dict(), src=0, group=group)
    """
    start = time.perf_counter()
    rank = _check(src, group, sending=True)
    channel = _Channel(group, rank)
    plan, staging, stride, outcome, fingerprinting = _send(
        weights, src, group, bucket_bytes, overlap, direct_bytes, channel,
        partial=partial, verify=verify,
    )
    report = _send_report(plan, rank, group, bucket_bytes, staging, stride, start,
                          fingerprinting)
    if outcome.failed:
        raise _receivers_failed(outcome, report)
    return report


def _send(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None,
    bucket_bytes: int,
    overlap: bool,
    direct_bytes: int | None,
    channel: _Channel,
    *,
    partial: bool,
    verify: bool,
) -> tuple[_Plan, torch.Tensor, int, _Outcome, float]:
    """The sync on the wire: metadata, the receivers' verdict on it, buckets, the
    handshake (with the fingerprints); a failure tells the receivers.

    Returns the plan, the staging buffer, its second slot's offset (0: one slot), the
    receivers that did not apply the sync, and the seconds spent taking fingerprints.
    """
    device = _device(group)
    sync = secrets.randbits(62) + 1
    state = _SendProgress(channel=channel)
    plan: _Plan | None = None
    try:
        _check_sizes(bucket_bytes, direct_bytes)
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        plan = _plan(items, bucket_bytes, sync, direct_bytes, device, partial=bool(partial),
                     verify=bool(verify))
        state.plan = plan
        _send_metadata(plan, state, channel)
        state.in_collective, state.phase = True, "the exchange of the verdicts on the metadata"
        refused = _verdicts(None, plan, group, device, channel)
        state.in_collective = False
        channel.tidy()
        if refused is not None:
            state.refused = True
            raise refused
        staging, stride = _send_buckets(plan, items, state, src, group, device, overlap)
        fingerprints = None
        if plan.verify and plan.entries:
            start = time.perf_counter()
            fingerprints = state.digests.done()
            state.fingerprint_seconds += time.perf_counter() - start
        state.in_collective, state.phase = True, "the handshake"
        outcome = _handshake(_APPLIED, group, device, channel, src=src, plan=plan,
                             fingerprints=fingerprints)
        state.in_collective = False
    except BaseException as exc:
        _drop_busy_staging(state, group)
        if isinstance(exc, WeightSyncError) and (exc.recovery != "resend" or state.refused):
            raise  # every rank knows already: refused by all, or aborted through the store
        if state.in_collective:
            raise _collective_error(state, exc, channel) from exc
        _abort(exc, state, plan, src, group, sync, channel)
        raise
    return plan, staging, stride, outcome, state.fingerprint_seconds


def _check_sizes(bucket_bytes: int, direct_bytes: int | None) -> None:
    """Raise `ValueError` unless both sizes are positive ints (`direct_bytes` may be None)."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if direct_bytes is not None and (
        isinstance(direct_bytes, bool) or not isinstance(direct_bytes, int)
        or direct_bytes < 1
    ):
        raise ValueError(f"direct_bytes must be a positive int or None, got {direct_bytes!r}")


def _send_metadata(plan: _Plan, state: _SendProgress, channel: _Channel) -> None:
    """Post the plan to the store; from then on a failure is told in a trailer, not a
    record."""
    channel.post_meta(plan.record())
    state.meta_sent = True


@dataclass(frozen=True)
class _Outgoing:
    """What sending one bucket reads: the plan, the caller's tensors, the staging."""

    plan: _Plan
    wires: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    staging: torch.Tensor
    stride: int
    """The offset of the second staging slot; 0: one slot."""
    src: int
    group: dist.ProcessGroup | None


def _send_buckets(
    plan: _Plan,
    items: list[tuple[str, torch.Tensor]],
    state: _SendProgress,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    overlap: bool,
) -> tuple[torch.Tensor, int]:
    """Every bucket in order, until all went out; returns the staging and its `stride`."""
    wires = plan.wires
    # Direct buckets are sent from the caller's tensors: no staging for them.
    stride, need = _slots([0 if d else w for w, d in zip(wires, plan.direct)], overlap)
    staging, _ = _staging(None, group, device, need)
    state.staging = staging
    out = _Outgoing(plan, wires, dict(items), staging, stride, src, group)
    for b in range(len(plan.sizes)):
        if plan.direct[b]:
            _send_direct(out, b, state)
        else:
            _send_packed(out, b, state)
    state.drain()
    state.bucket = -1
    return staging, stride


def _send_direct(out: _Outgoing, b: int, state: _SendProgress) -> None:
    """Post direct bucket `b` from the caller's tensor; it is waited for at the end."""
    (e,) = out.plan.bucket(b)
    state.bucket, state.entry = b, e.name
    wire = _wire_of(out.tensors[e.name])
    if wire.numel() != out.plan.sizes[b]:
        raise WeightSyncError(
            f"send_weights: entry {e.name!r} (direct bucket {b}) does not match the plan",
            bucket=b,
            entry=e.name,
            expected=f"{out.plan.sizes[b]} bytes, as announced in the metadata "
            f"(shape {list(e.shape)}, {e.dtype})",
            got=f"{wire.numel()} bytes (shape {list(out.tensors[e.name].shape)}, "
            f"{out.tensors[e.name].dtype})",
            fix="keep the tensors unchanged until send_weights returns: a tensor was "
            "resized or replaced while the sync ran",
        )
    state.entry = None
    state.in_collective, state.wire = True, b
    state.direct.append((b, _post(wire, out.plan, b, out.src, out.group)))
    state.posted = b
    state.in_collective, state.wire = False, -1
    if out.plan.verify:  # the tensor given, read while the broadcast sends it
        state.fingerprint(out.tensors[e.name], e.name)
        state.entry = None


def _wire_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a direct entry, as they are: a view, no copy."""
    return t.detach().view(-1).view(torch.uint8)


def _send_packed(out: _Outgoing, b: int, state: _SendProgress) -> None:
    """Pack bucket `b` and its trailer into its staging slot, then post its broadcast."""
    plan, tensors = out.plan, out.tensors
    i = b % 2 if out.stride else 0
    state.wait(i)  # the slot's previous broadcast has read it
    slot = _slot(out.staging, out.stride, out.wires, b)
    state.bucket, state.slot = b, slot
    with torch.no_grad():  # trainer parameters require grad; the copy is no op of it
        for e in plan.bucket(b):
            state.entry = e.name
            if plan.verify:  # from the bytes of the tensor given, read to pack them
                state.fingerprint(tensors[e.name], e.name, into=_view(slot, e))
            else:
                _view(slot, e).copy_(tensors[e.name])
    state.entry = None
    _trailer(slot, plan.sizes[b]).copy_(torch.tensor([_MAGIC, plan.sync, b, _DATA]))
    state.in_collective, state.wire = True, b
    state.pending[i] = (b, _post(slot, plan, b, out.src, out.group))
    state.posted = b
    state.in_collective, state.wire = False, -1
    if not out.stride:
        state.wait(0)


def _post(wire: torch.Tensor, plan: _Plan, b: int, src: int,
          group: dist.ProcessGroup | None) -> list[Any]:
    """Post bucket `b`'s broadcasts from `wire`, its bytes: one per segment, in order."""
    return [dist.broadcast(wire[lo:hi], src=src, group=group, async_op=True)
            for lo, hi in plan.segments(b)]


def _drop_busy_staging(state: _SendProgress, group: dist.ProcessGroup | None) -> None:
    """Forget the staging buffer while a broadcast may still read it: no later sync may
    pack into it."""
    if (any(state.pending) or state.direct) and state.staging is not None:
        _drop_busy(None, group, state.staging)


def _collective_error(
    state: _SendProgress, exc: BaseException, channel: _Channel
) -> WeightSyncError:
    """The error of a collective that failed (a receiver died or timed out); the other
    receivers are told through the store, so they fail at once."""
    where = f"bucket {state.wire}" if state.wire >= 0 else state.phase
    recovery = _recovery_of(exc)
    channel.abort(recovery, f"the sender's broadcast of {where} failed: {one_line(exc)}")
    return WeightSyncError(
        f"send_weights: the broadcast of {where} failed" if state.wire >= 0
        else f"send_weights: {where} failed",
        bucket=state.wire if state.wire >= 0 else None,
        expected="every receiver taking part until the end of the sync",
        got=one_line(exc),
        fix="a receiver died, timed out or called something else; see its log (the other "
        "receivers were told to abort)",
        recovery=recovery,
    )


def _abort(
    exc: BaseException,
    state: _SendProgress,
    plan: _Plan | None,
    src: int,
    group: dist.ProcessGroup | None,
    sync: int,
    channel: _Channel,
) -> None:
    """Tell the receivers that the sender failed, so that they raise instead of waiting:
    in band while the ranks are in step (the group stays usable), else through the store."""
    what = one_line(exc)
    if state.entry is not None:
        what = f"{what} (while packing entry {state.entry!r})"
    if not state.meta_sent or plan is None:
        channel.post_meta({"protocol": _PROTOCOL, "sync": sync, "abort": what})
        return
    try:
        state.drain()  # the buckets before the failure go out whole, then the abort
        device = _device(group)
        b = state.posted + 1  # the first bucket the receivers still wait for
        while b < len(plan.sizes) and plan.direct[b]:
            # No trailer to carry the abort: the receivers take zeros into staging (the
            # sync fails anyway) and learn of it at the next trailer.
            zeros = torch.zeros(plan.wires[b], dtype=torch.uint8, device=device)
            for work in _post(zeros, plan, b, src, group):
                state.join(work, "aborting")
            b += 1
        if b >= len(plan.sizes):
            # Every bucket went out: the receivers wait in a later collective.
            channel.abort("group", f"the sender raised {what} after the last bucket")
            return
        slot = state.slot if state.bucket == b and state.slot is not None else None
        if slot is None:
            slot = torch.empty(plan.wires[b], dtype=torch.uint8, device=device)
        channel.put("error", what)
        _trailer(slot, plan.sizes[b]).copy_(torch.tensor([_MAGIC, sync, b, _ABORT]))
        for work in _post(slot, plan, b, src, group):
            state.join(work, "aborting")
    except Exception as failed:  # the group broke on the way: tell them through the store
        channel.abort(_recovery_of(failed), f"the sender raised {what}, and then its abort "
                      f"failed: {one_line(failed)}")


def _send_report(
    plan: _Plan,
    rank: int,
    group: dist.ProcessGroup | None,
    bucket_bytes: int,
    staging: torch.Tensor,
    stride: int,
    start: float,
    fingerprint_seconds: float,
) -> SendReport:
    """The report of a sync that reached the handshake."""
    seconds = time.perf_counter() - start
    total = sum(e.nbytes for e in plan.entries)
    return SendReport(
        rank=rank, sync=plan.sync, receivers=len(dist.get_process_group_ranks(
            group if group is not None else dist.group.WORLD)) - 1,
        entries=len(plan.entries), bytes=total, buckets=len(plan.sizes),
        direct_buckets=sum(plan.direct), bucket_bytes=bucket_bytes,
        largest_bucket=max(plan.sizes, default=0),
        staging_bytes=staging.numel(), overlap=stride > 0, partial=plan.partial,
        verified=plan.verify, fingerprinted=len(plan.entries) if plan.verify else 0,
        fingerprint_seconds=fingerprint_seconds, seconds=seconds,
        throughput=total / seconds if seconds > 0 else 0.0,
    )


def _receivers_failed(outcome: _Outcome, report: SendReport) -> WeightSyncError:
    """The error naming the receivers that said at the handshake they did not apply the
    sync, and the entries that arrived other than they were given, if any."""
    failed, mismatched = outcome.failed, outcome.mismatched
    got = f"{len(failed)} receiver(s) failed; each raised WeightSyncError naming why"
    if mismatched:
        got += (f"; {len(mismatched)} entr{'y' if len(mismatched) == 1 else 'ies'} arrived "
                f"other than this rank was given {'it' if len(mismatched) == 1 else 'them'}:"
                f" {_names(list(mismatched))}")
    return WeightSyncError(
        f"receiver rank(s) {', '.join(map(str, failed))} did not apply the sync"
        + (f": {_names(list(mismatched))} arrived changed" if mismatched else ""),
        entry=mismatched[0] if mismatched else None,
        mismatched=mismatched,
        failed_ranks=failed,
        report=report,
        expected="every receiver to load every entry it holds, as it was given here",
        got=got,
        fix="read the receivers' errors (rejected entries name the checkpoint names to "
        "fix; changed entries call for the same sync again), then sync again: until then "
        "those models refuse to replay",
    )
