"""The receiving side of a sync: `receive_weights`, its loader calls and its errors."""

from __future__ import annotations

import collections
import time
import types
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphsafe._declare.spec import RefreshReport
from graphsafe._errors import WeightLoadError, one_line
from graphsafe._memory.journal import mark_written
from graphsafe._runtime.runtime import runtime, weight_update
from graphsafe.distributed._buffers import _RECV_STAGING, _group_key, _staging
from graphsafe.distributed._control import _Channel, _recovery_of, _ToldError
from graphsafe.distributed._layout import (
    _ABORT,
    _DATA,
    _MAGIC,
    _PROTOCOL,
    _checksum,
    _Entry,
    _Plan,
    _Ring,
    _trailer,
    _view,
)
from graphsafe.distributed._reports import ReceiveReport, RejectedEntry, WeightSyncError
from graphsafe.distributed._wire import _check, _device, _handshake, _names, _verdicts

__all__ = ["receive_weights"]


@dataclass
class _ReceiveProgress:
    plan: _Plan | None = None
    started: float = 0.0
    completed: bool = False
    """Every bucket arrived and the sender reached the handshake."""
    loaded: float = 0.0
    staging_bytes: int = 0
    reused: bool = False
    overlap: bool = False
    accepted: list[str] | None = None
    rejected: list[RejectedEntry] | None = None
    expected: int = 0
    waited: float = 0.0
    sums: list[int] = field(default_factory=list)
    """Per bucket arrived: its checksum (when the sync is verified)."""
    mismatched: list[int] = field(default_factory=list)
    """Buckets whose checksum differs from the sender's."""
    told: bool = False
    """The error being raised is known to every rank (they raise in step): no abort is
    posted for it."""


def receive_weights(
    model: nn.Module, *, src: int, group: dist.ProcessGroup | None = None,
    overlap: bool = True, expects: Collection[str] | None = None,
    wait_timeout: float | None = None,
) -> ReceiveReport:
    """Receive one sync from rank `src` and load it into `model`, graph-safely.

    Call it on every rank of `group` but `src` while `src` calls `send_weights`. First it
    waits for the sender to begin (`wait_timeout`; the group's timeout bounds only the
    transfer, so a train step may take any time). Then it checks the sync's metadata
    against what the model expects, with every other rank, before any data moves: an
    entry it expects that the sync lacks (unless the sync is partial), or an entry no
    receiver expects, fails the sync on every rank, naming the entries. The transfer
    runs inside one `gs.weight_update(model)`: each bucket is broadcast into the staging
    buffer, then `model.load_weights(pairs)` gets views of it (valid during the call
    only: the loader must copy, as loaders do). The loader decides what this rank holds;
    the derived buffers are refreshed once, at the end, if every rank applied the sync.
    With `overlap`, the broadcast of bucket k+1 is posted into one staging slot before
    the loader runs on bucket k in the other.

    Entries the loader refuses (`gs.WeightLoadError`) are collected, not fatal on the
    wire: the remaining entries of the bucket are retried and the later buckets still
    load, so that every refusal is named; then the call raises `WeightSyncError` with
    `.rejected`, and the model stays failed closed (so do the other receivers' models).
    A failed sync whose entries all name tensors of the model owes only those
    (`Runtime.expect_writes`): a later sync of them heals it; otherwise every weight of
    the model must be loaded again.

    Args:
        model: The model to load into; it needs a `load_weights(pairs)` method.
        src: The sending rank (global).
        group: The process group; the default group when None. Give it a timeout: it
            bounds each transfer.
        overlap: Receive the next buckets while the loader runs on the current one (see
            above for the staging this takes). False: one bucket, receiving and loading
            in turn.
        expects: The checkpoint names this rank loads. None: `model.checkpoint_names()`
            when the model has it, else the names of its parameters and persistent
            buffers (derived tensors excluded), which is right for a loader that takes
            its own tensor names; a loader that maps names (stacked projections) needs
            one of the other two.
        wait_timeout: Seconds to wait for the sender to begin the sync; None waits until
            it does (a sender that dies is noticed at once: its store goes with it).

    Returns:
        The report.

    Raises:
        WeightSyncError: No sync began within `wait_timeout` (the model is untouched),
            the sync was refused, the sender aborted or died, a collective failed, the
            model has no loader, the loader refused entries, a checksum differed, or
            another rank failed. The model's guarded graphs then refuse to replay until
            a later sync completes. `.recovery` says what the next sync needs
            (`gsd.recover`).

    Examples:
        >>> # on every rollout rank, while rank 0 calls send_weights:
        >>> # report = receive_weights(model, src=0, group=group)
    """
    rank = _check(src, group, sending=False)
    device = _device(group)
    channel = _Channel(group, rank)
    rt = runtime(model)
    before = rt.last_report
    state = _ReceiveProgress()
    begin = time.perf_counter()
    if not channel.posted(wait_timeout):
        raise WeightSyncError(
            f"receive_weights: no sync began within {wait_timeout} s",
            expected=f"rank {src} calling send_weights within wait_timeout",
            got=f"nothing after {wait_timeout} s",
            fix="call receive_weights again (the model is untouched), or give a longer "
            "wait_timeout (None waits until the sender begins)",
        )
    state.waited = time.perf_counter() - begin
    try:
        expected = _expected(model, expects)
        state.plan = _metadata(src, channel, state)
        _verdict(state.plan, expected, group, device, channel, state)
    except BaseException as exc:
        _tell(exc, state, channel)
        raise
    _apply(model, rank, src, group, device, state, overlap, channel)
    end = time.perf_counter()
    return _receive_report(state, rank, src, rt.last_report, before, end, ())


def sync_pending(
    *, src: int, group: dist.ProcessGroup | None = None, timeout: float | None = 0.0
) -> bool:
    """Whether the sender has begun the next sync of `group`: the barrier between an RL
    job's phases, without a collective (so it never times the group out).

    A rollout rank may call it between its own steps, or wait in it for the trainer,
    then call `receive_weights`, which then starts at once.

    Args:
        src: The sending rank (global).
        group: The process group of the syncs; the default group when None.
        timeout: Seconds to wait; 0 looks once; None waits until the sync begins.

    Returns:
        True once the sender posted the next sync's metadata.

    Raises:
        WeightSyncError: The store is gone (rank 0 died: `.recovery` is `"world"`).

    Examples:
        >>> # while not gsd.sync_pending(src=0, group=group):
        >>> #     rollout_step()
        >>> # gsd.receive_weights(model, src=0, group=group)
    """
    rank = _check(src, group, sending=False)
    return _Channel(group, rank).posted(timeout)


def _expected(model: nn.Module, expects: Collection[str] | None) -> frozenset[str]:
    """The checkpoint names `model` expects (see `receive_weights`)."""
    if expects is None:
        declared = getattr(model, "checkpoint_names", None)
        if callable(declared):
            expects = list(declared())
    if expects is not None:
        names = list(expects)
        if isinstance(expects, str) or not all(isinstance(n, str) for n in names):
            raise TypeError("expects must be a collection of checkpoint names (str), got "
                            f"{type(expects).__name__}")
        return frozenset(names)
    derived = {o for d in runtime(model).derivations for o in d.outputs}
    found = {n for n, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module._buffers.items():
            if b is not None and name not in skip:
                found.add(f"{prefix}.{name}" if prefix else name)
    return frozenset(found - derived)


def _apply(
    model: nn.Module,
    rank: int,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    state: _ReceiveProgress,
    overlap: bool,
    channel: _Channel,
) -> None:
    """Run the sync inside one `weight_update`; every rank says at the handshake, still
    inside it, whether it applied the sync, so that one failure fails them all. A
    failure the other ranks cannot see is posted to the store, so that they fail too."""
    try:
        with weight_update(model):
            _receive(model, src, group, device, state, overlap, channel)
            state.loaded = time.perf_counter()
            ok = not state.rejected and not state.mismatched
            try:
                failed = _handshake(ok, group, device, channel)
            except _ToldError:
                raise
            except Exception as exc:
                raise _handshake_error(src, exc) from exc
            state.told = True
            if state.rejected:
                raise _rejected_error(model, state, rank, src)
            if state.mismatched:
                raise _mismatch_error(state, rank, src)
            if failed:
                raise WeightSyncError(
                    f"rank {rank}: receiver rank(s) {', '.join(map(str, failed))} did not "
                    "apply the sync",
                    failed_ranks=failed,
                    expected="every receiver applying the sync",
                    got=f"{len(failed)} receiver(s) failed; each raised WeightSyncError "
                    "naming why",
                    fix="read their errors, then sync again: until then every receiver's "
                    "model refuses to replay",
                )
    except BaseException as exc:
        _tell(exc, state, channel)
        raise


def _tell(exc: BaseException, state: _ReceiveProgress, channel: _Channel) -> None:
    """Post this rank's failure to the store unless every rank knows of it already."""
    if state.told or isinstance(exc, _ToldError):
        return
    recovery = exc.recovery if isinstance(exc, WeightSyncError) else "group"
    channel.abort("group" if recovery == "resend" else recovery,  # type: ignore[arg-type]
                  f"receive_weights raised {one_line(exc)}")


def _mismatch_error(state: _ReceiveProgress, rank: int, src: int) -> WeightSyncError:
    """The error naming the buckets whose checksum differs from the sender's."""
    plan = state.plan
    assert plan is not None
    names = [e.name for b in state.mismatched for e in plan.bucket(b)]
    return WeightSyncError(
        f"rank {rank}: {len(state.mismatched)} bucket(s) arrived with a checksum other "
        "than the sender's",
        bucket=state.mismatched[0],
        entry=names[0] if names else None,
        expected=f"the checksums rank {src} computed before sending",
        got=f"buckets {state.mismatched} differ (entries {_names(names)})",
        fix="bytes were torn or changed on the way: the sender changed a tensor during "
        "the sync, or the transport corrupts data. Every receiver's model refuses to "
        "replay until a complete sync",
    )


def _receive_report(
    state: _ReceiveProgress,
    rank: int,
    src: int,
    last: RefreshReport | None,
    before: RefreshReport | None,
    end: float,
    failed: tuple[int, ...],
) -> ReceiveReport:
    """The report of the sync; `end` is 0.0 for the report a rejection error carries."""
    plan = state.plan
    assert plan is not None
    seconds = (end if end else time.perf_counter()) - state.started
    total = sum(e.nbytes for e in plan.entries)
    return ReceiveReport(
        rank=rank, src=src, sync=plan.sync, entries=len(plan.entries), bytes=total,
        buckets=len(plan.sizes), direct_buckets=sum(plan.direct), seconds=seconds,
        refresh_seconds=max(0.0, end - state.loaded) if end else 0.0,
        throughput=total / seconds if seconds > 0 else 0.0,
        staging_bytes=state.staging_bytes, staging_reused=state.reused, overlap=state.overlap,
        accepted=tuple(state.accepted or ()), rejected=tuple(state.rejected or ()),
        refresh=last if last is not before else None, failed_ranks=failed,
        expected=state.expected, partial=plan.partial, verified=plan.verify,
        waited_seconds=state.waited,
    )


def _rejected_error(
    model: nn.Module, state: _ReceiveProgress, rank: int, src: int
) -> WeightSyncError:
    """The error naming the entries the loader refused: the first eight, then a count."""
    rejected = tuple(state.rejected or ())
    shown = "\n".join(f"    {r.name!r} (bucket {r.bucket}): {r.error}" for r in rejected[:8])
    more = f"\n    ... and {len(rejected) - 8} more" if len(rejected) > 8 else ""
    return WeightSyncError(
        f"rank {rank}: the loader of {type(model).__name__} rejected {len(rejected)} "
        f"entr{'y' if len(rejected) == 1 else 'ies'} of the sync",
        entry=rejected[0].name,
        bucket=rejected[0].bucket,
        rejected=rejected,
        report=_receive_report(state, rank, src, None, None, 0.0, ()),
        module_class=type(model).__name__,
        expected="every entry loaded, or skipped as held by another rank",
        got=f"rejected:\n{shown}{more}",
        fix="the model refuses to replay until a complete sync: fix these entries' names, "
        "shapes or dtypes on the sender (or the receiver's config), then sync again",
    )


def _handshake_error(src: int, exc: BaseException) -> WeightSyncError:
    """The error of a failed handshake."""
    return WeightSyncError(
        "receive_weights: the end-of-sync handshake failed",
        expected=f"every rank of the group, rank {src} included, at the handshake",
        got=one_line(exc),
        fix="another rank died or timed out: see its log. This rank's model refuses to "
        "replay until a complete sync",
        recovery=_recovery_of(exc),
    )


def _receive(
    model: nn.Module,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    state: _ReceiveProgress,
    overlap: bool,
    channel: _Channel,
) -> None:
    """The transfer: each bucket into staging and the loader, then the checksums."""
    plan = state.plan
    assert plan is not None
    runtime(model).expect_writes(_sync_writes(model, plan))
    wires = plan.wires
    buckets = len(plan.sizes)
    ring = _Ring(wires, _Ring.size(wires, plan.bucket_bytes, overlap))
    table, key = _RECV_STAGING.setdefault(model, {}), _group_key(group)
    staging, state.reused = _staging(table, key, device, ring.capacity)
    state.staging_bytes, state.overlap = staging.numel(), overlap and buckets > 1
    loader = getattr(model, "load_weights", None)
    accepted: list[str] = []
    rejected: list[RejectedEntry] = []
    state.accepted, state.rejected = accepted, rejected
    flight = _InFlight(plan, wires, ring, staging, src, group, overlap, channel, state)
    by_bucket: list[list[_Entry]] = [[] for _ in plan.sizes]
    for e in plan.entries:
        by_bucket[e.bucket].append(e)
    group_bytes = ring.capacity // 2  # one group loads while the next one arrives
    try:
        flight.post_ahead()
        done = 0
        while done < buckets:
            run = flight.arrived_run(group_bytes)
            mark_written(staging)  # c10d writes: declared, whatever the tracker saw
            flight.post_ahead()  # the next buckets arrive while the loader runs
            if plan.verify:
                state.sums.extend(_checksum(slot[: plan.sizes[b]]) for b, slot in run)
            _load_run(model, loader, run, by_bucket, accepted, rejected)
            flight.release(len(run))
            done += len(run)
            flight.post_ahead()
    finally:
        if flight.works and table.get(key) is staging:
            # A broadcast still writes into it: no later sync may reuse it.
            del table[key]
    if plan.verify:
        sums = torch.zeros(buckets, dtype=torch.int64, device=device)
        try:
            channel.wait(dist.broadcast(sums, src=src, group=group, async_op=True),
                         "receiving the checksums")
        except _ToldError:
            raise
        except Exception as exc:
            raise flight.lost(buckets, exc) from exc
        state.mismatched = [b for b, (want, got) in enumerate(zip(sums.tolist(), state.sums))
                            if want != got]
    state.completed = True


def _sync_writes(model: nn.Module, plan: _Plan) -> list[str] | None:
    """The tensors the sync writes, should it fail: its entries, when each names a tensor
    of the model; None (any tensor) when the loader maps names (stacked projections) or
    keeps only some entries (a pipeline stage)."""
    names = [e.name for e in plan.entries]
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known.update(n for n, _ in model.named_buffers(remove_duplicate=False))
    return names if known.issuperset(names) else None


def _metadata(src: int, channel: _Channel, state: _ReceiveProgress) -> _Plan:
    """The sync's plan, from the sender's metadata; raises its abort, or a mismatch."""
    record = channel.meta()
    channel.count()
    state.started = time.perf_counter()
    if not isinstance(record, dict) or record.get("protocol") != _PROTOCOL:
        got = record.get("protocol") if isinstance(record, dict) else type(record).__name__
        raise WeightSyncError(
            "receive_weights: the sender speaks another sync protocol",
            expected=f"protocol {_PROTOCOL}",
            got=got,
            fix="run the same graphsafe version on the sender and the receivers",
            recovery="group",
        )
    if record["abort"] is not None:
        state.told = True
        raise WeightSyncError(
            f"receive_weights: the sender (rank {src}) aborted the sync before sending any "
            "weights",
            expected="the weights",
            got=f"the sender raised {record['abort']}",
            fix="fix the error on the sender, then sync again; nothing was written: the "
            "model keeps its previous weights",
        )
    return _Plan.from_record(record)


def _verdict(
    plan: _Plan,
    expected: frozenset[str],
    group: dist.ProcessGroup | None,
    device: torch.device,
    channel: _Channel,
    state: _ReceiveProgress,
) -> None:
    """Check the plan against what this rank expects, with every other rank; raise the
    refusal every rank raises."""
    names = {e.name for e in plan.entries}
    claims = [e.name in expected for e in plan.entries]
    missing = [] if plan.partial else sorted(expected - names)
    state.expected = len(expected)
    try:
        refused = _verdicts((claims, missing), plan, group, device, channel)
    except _ToldError:
        raise
    except Exception as exc:
        raise WeightSyncError(
            f"rank {channel.rank}: the verdicts on the sync's metadata were not exchanged",
            expected="every rank of the group at the exchange, within the group's timeout",
            got=one_line(exc),
            fix="another rank died, timed out or called something else; see its log. "
            "Nothing was written",
            recovery=_recovery_of(exc),
        ) from exc
    if refused is not None:
        state.told = True
        raise refused


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
        state: _ReceiveProgress,
    ) -> None:
        self.plan, self.wires, self.ring, self.staging = plan, wires, ring, staging
        self.src, self.group, self.overlap = src, group, overlap
        self.channel, self.state = channel, state
        # (bucket, its slot, its work), oldest first.
        self.works: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()
        self.next = 0  # the first bucket not posted yet

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
                work = dist.broadcast(slot, src=self.src, group=self.group, async_op=True)
            except Exception as exc:
                raise self.lost(b, exc) from exc
            works.append((b, slot, work))
            b += 1
        self.next = b

    def arrived(self) -> tuple[int, torch.Tensor]:
        """Wait for the oldest bucket in flight; check its trailer if it has one."""
        b, slot, work = self.works.popleft()
        try:
            self.channel.wait(work, f"receiving bucket {b}")
        except _ToldError:
            raise
        except Exception as exc:
            raise self.lost(b, exc) from exc
        if not self.plan.direct[b]:  # a direct bucket has none: the next trailer tells
            _check_trailer(slot, self.plan.sizes[b], self.plan, b, self.src, self.channel,
                           self.state)
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
        entries = self.plan.bucket(b) if b < len(self.wires) else ()
        what = (f"bucket {b} of {len(self.wires)}" if b < len(self.wires)
                else "the checksums of the buckets")
        size = self.wires[b] if b < len(self.wires) else 8 * len(self.wires)
        return WeightSyncError(
            f"receive_weights: {what} did not arrive from rank {self.src}",
            bucket=b if b < len(self.wires) else None,
            entry=entries[0].name if entries else None,
            expected=f"{size} bytes within the group's timeout",
            got=one_line(exc),
            fix="the sender died or timed out; see its log (the other ranks were told to "
            "abort). The model refuses to replay until a complete sync",
            recovery=_recovery_of(exc),
        )


def _load_run(
    model: nn.Module,
    loader: Any,
    run: list[tuple[int, torch.Tensor]],
    by_bucket: list[list[_Entry]],
    accepted: list[str],
    rejected: list[RejectedEntry],
) -> None:
    """Give the entries of a run of arrived buckets to the model's loader, in one call."""
    pairs = [(e.name, _view(s, e)) for b, s in run for e in by_bucket[b]]
    where = {e.name: b for b, _ in run for e in by_bucket[b]}
    if not pairs:
        return  # the trailer closing a run of direct buckets
    if loader is None or not callable(loader):
        rejected.extend(
            RejectedEntry(name=n, bucket=where[n], error=f"{type(model).__name__} "
                          "has no load_weights(pairs) method") for n, _ in pairs
        )
        return
    _load(loader, pairs, where, accepted, rejected)


def _check_trailer(
    slot: torch.Tensor, size: int, plan: _Plan, b: int, src: int, channel: _Channel,
    state: _ReceiveProgress,
) -> None:
    """Check bucket `b`'s trailer; raise the sender's abort if it says so."""
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
        state.told = True
        raise WeightSyncError(
            f"receive_weights: the sender (rank {src}) aborted the sync at bucket {b} of "
            f"{len(plan.sizes)}",
            bucket=b,
            entry=entries[0].name if entries else None,
            expected="every bucket of the sync",
            got=f"the sender raised {box[0]}",
            fix="fix the error on the sender, then sync again; the model refuses to "
            "replay until a complete sync",
        )


def _load(
    loader: Any,
    pairs: list[tuple[str, torch.Tensor]],
    bucket: dict[str, int],
    accepted: list[str],
    rejected: list[RejectedEntry],
) -> None:
    """Load buckets' entries (`bucket`: each entry's bucket); a refused entry is recorded
    and the others are loaded anyway."""
    queue = [pairs]
    while queue:
        chunk = queue.pop()
        try:
            result = loader(chunk)
            if isinstance(result, types.GeneratorType):
                result = list(result)
        except WeightLoadError as exc:
            names = [n for n, _ in chunk]
            if exc.name not in names:
                rejected.extend(RejectedEntry(name=n, bucket=bucket[n], error=one_line(exc))
                                for n in names)
                continue
            i = names.index(exc.name)
            rejected.append(RejectedEntry(name=exc.name, bucket=bucket[exc.name],
                                          error=one_line(exc)))
            # The entries before it may or may not have been written: load them again.
            queue.extend(part for part in (chunk[i + 1 :], chunk[:i]) if part)
            continue
        except Exception as exc:
            rejected.extend(RejectedEntry(name=n, bucket=bucket[n], error=one_line(exc))
                            for n, _ in chunk)
            continue
        if isinstance(result, (set, frozenset, list, tuple)) and all(
            isinstance(n, str) for n in result
        ):
            accepted.extend(sorted(result) if isinstance(result, (set, frozenset)) else result)
        else:
            accepted.extend(n for n, _ in chunk)
