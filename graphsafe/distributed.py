"""Weight sync over `torch.distributed`: one rank sends, the others load, graph-safe.

The trainer calls `send_weights` with checkpoint-named tensors; every other rank of the
group calls `receive_weights` with its own model, collectively. The sender never needs
the receivers' models: each receiver's own loader (`model.load_weights(pairs)`) decides
what it holds, so a pipeline rank skips the layers another rank owns.

The wire protocol, in order:

1. **Metadata**, one `broadcast_object_list`: a sync id, the protocol version, and per
   entry its name, shape, dtype, bucket and byte offset; the byte size of every bucket.
   A sender that fails before this point broadcasts an abort record instead.
2. **Buckets**, one `broadcast` each, of a flat byte buffer: the entries of the bucket,
   each at an offset aligned to 64 bytes, then a 32-byte trailer (a magic number, the
   sync id, the bucket index, a status). A bucket holds at most `bucket_bytes` of data;
   a tensor larger than that travels alone in a bucket of its own size (never split, so
   the loader always gets whole tensors). A sender that fails while packing a bucket
   broadcasts that bucket with the status *abort* in its trailer, then the error text.
3. **Handshake**, one `all_gather` of one integer per rank: every rank says whether it
   applied the sync, so the sender learns which receivers failed.

A receiver runs the whole sync inside one `gs.weight_update(model)`: collectives write
into its staging buffer (never into parameters), the loader copies from views of that
buffer with its tracked `copy_`, the staging buffer's writes are declared to the journal
with `gs.mark_written` (graphsafe cannot see c10d writes), and the derived buffers are
refreshed once, when the block exits. Any failure inside the block leaves the model
failed closed: its guarded graphs refuse to replay until a later sync completes.

The copies overlap the transfer (`overlap=True`, the default): the staging buffer holds
two bucket slots, the sender packs bucket k+1 into one while bucket k's broadcast runs
from the other, and the receiver has bucket k+1's broadcast posted into one slot while
the loader copies bucket k out of the other. A slot is reused only after its broadcast
completed (sender) or its loader call returned (receiver). Overlap is each side's own
choice: the bytes on the wire are the same either way.

The staging buffer is allocated once per (model, group) and reused by every later sync
whose buckets fit in it (`staging_buffer`, `release_staging`); the sender keeps one per
group likewise. When the sync overlaps and has more than one bucket it holds two slots
(the largest even bucket and the largest odd one, trailers included: at most two
buckets), else one bucket; `overlap=False` keeps it at one.
With gloo the staging buffers live in CPU memory; with NCCL on the current CUDA device.
"""

from __future__ import annotations

import secrets
import time
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn

from graphsafe._errors import GraphSafetyError, WeightLoadError
from graphsafe._journal import mark_written
from graphsafe._runtime import runtime, weight_update
from graphsafe._spec import RefreshReport

__all__ = [
    "ReceiveReport",
    "RejectedEntry",
    "SendReport",
    "WeightSyncError",
    "receive_weights",
    "release_staging",
    "send_weights",
    "staging_buffer",
]

_PROTOCOL = 1
_MAGIC = 0x6773_5359_4E43  # "gsSYNC"
_ALIGN = 64
_TRAILER = 32  # four int64: magic, sync id, bucket index, status
_DATA, _ABORT = 1, 2


# -----------------------------------------------------------------------------
# reports and the error


class RejectedEntry(BaseModel):
    """A checkpoint entry the receiver's loader refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The entry's checkpoint name."""
    bucket: int
    """The bucket it arrived in (0-based)."""
    error: str
    """What the loader raised: class and message."""


class SendReport(BaseModel):
    """What one `send_weights` call did, on the sending rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    """The sending rank (global)."""
    sync: int
    """The id drawn for this sync; every receiver's report carries the same one."""
    receivers: int
    """How many other ranks of the group took part."""
    entries: int
    """Checkpoint entries sent."""
    bytes: int
    """Tensor bytes sent (without alignment padding and trailers)."""
    buckets: int
    """Broadcasts of data: one per bucket."""
    bucket_bytes: int
    """The bucket limit asked for; a tensor larger than it travelled alone."""
    largest_bucket: int
    """Data bytes of the largest bucket."""
    staging_bytes: int
    """Size of the sender's staging buffer: two bucket slots (trailers included) when
    `overlap` was on and the sync had several buckets, else one bucket."""
    overlap: bool
    """Whether packing overlapped the broadcasts (two staging slots in use)."""
    seconds: float
    """Wall time of the call, handshake included."""
    throughput: float
    """`bytes / seconds`, in bytes per second."""


class ReceiveReport(BaseModel):
    """What one `receive_weights` call did, on one receiving rank."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    rank: int
    """This rank (global)."""
    src: int
    """The sending rank."""
    sync: int
    """The id the sender drew for this sync."""
    entries: int
    """Checkpoint entries in the sync (all of them, held here or not)."""
    bytes: int
    """Tensor bytes received."""
    buckets: int
    """Buckets received."""
    seconds: float
    """Wall time from the metadata's arrival to the end of the refresh (time spent
    waiting for the sender to start is not counted)."""
    refresh_seconds: float
    """Wall time of the end of the `weight_update` block: the one refresh of the derived
    buffers, and the journal's bookkeeping."""
    throughput: float
    """`bytes / seconds`, in bytes per second."""
    staging_bytes: int
    """Size of the staging buffer (two bucket slots when `overlap`, else one)."""
    overlap: bool
    """Whether receiving overlapped loading (two staging slots in use)."""
    staging_reused: bool
    """Whether the staging buffer of an earlier sync was reused (no allocation)."""
    accepted: tuple[str, ...]
    """Names the loader reported loading (its own naming: what `load_weights` returned;
    the entries given, for a loader that returns None)."""
    rejected: tuple[RejectedEntry, ...]
    """Entries the loader refused; when not empty the call raised `WeightSyncError`."""
    refresh: RefreshReport | None
    """`gs.runtime(model).last_report` of the refresh this sync ran; None when the sync
    did not complete or ran no refresh."""
    failed_ranks: tuple[int, ...]
    """Receivers that did not apply this sync (from the handshake); empty on success."""


class WeightSyncError(GraphSafetyError):
    """A weight sync did not complete: the sender failed or died, a collective failed,
    or the receiver's loader refused entries.

    On a receiver the model is left failed closed (guarded replays raise `StaleError`)
    until a later sync completes.

    Args:
        summary: One line saying what went wrong.
        bucket: The bucket (0-based) being sent or received, if any.
        entry: The checkpoint entry involved, if one is known.
        rejected: Entries the loader refused.
        failed_ranks: Ranks that did not apply the sync.
        report: The report of the call, where the sync reached its end.
        **kwargs: As for `gs.GraphSafetyError`.
    """

    def __init__(
        self,
        summary: str,
        *,
        bucket: int | None = None,
        entry: str | None = None,
        rejected: Sequence[RejectedEntry] = (),
        failed_ranks: Sequence[int] = (),
        report: SendReport | ReceiveReport | None = None,
        **kwargs: Any,
    ) -> None:
        self.bucket = bucket
        self.entry = entry
        self.rejected = tuple(rejected)
        self.failed_ranks = tuple(failed_ranks)
        self.report = report
        super().__init__(summary, **kwargs)


# -----------------------------------------------------------------------------
# the plan: which entry goes where


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


# -----------------------------------------------------------------------------
# staging buffers


def _group_key(group: dist.ProcessGroup | None) -> object:
    return group if group is not None else dist.group.WORLD


_RECV_STAGING: weakref.WeakKeyDictionary[nn.Module, dict[object, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
_SEND_STAGING: dict[object, torch.Tensor] = {}


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


def _staging(
    table: dict[object, torch.Tensor], key: object, device: torch.device, need: int
) -> tuple[torch.Tensor, bool]:
    buf = table.get(key)
    if buf is not None and buf.device == device and buf.numel() >= need:
        return buf, True
    table.pop(key, None)  # free the old one before allocating the new one
    del buf
    buf = torch.empty(need, dtype=torch.uint8, device=device)
    table[key] = buf
    return buf, False


def staging_buffer(
    model: nn.Module | None = None, *, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """The staging buffer kept for `model` on `group`, or the sender's for `group`.

    Args:
        model: A model that received weights; None for this process's sending buffer.
        group: The process group of the syncs; the default group when None.

    Returns:
        The flat `uint8` buffer, or None if no sync allocated one.

    Examples:
        >>> staging_buffer(nn.Linear(2, 2)) is None
        True
    """
    if model is None:
        return _SEND_STAGING.get(_group_key(group))
    return _RECV_STAGING.get(model, {}).get(_group_key(group))


def release_staging(
    model: nn.Module | None = None, *, group: dist.ProcessGroup | None = None
) -> int:
    """Free the staging buffer kept for `model` (or the sender's) on `group`.

    The next sync allocates a new one.

    Args:
        model: A model that received weights; None for this process's sending buffer.
        group: The process group of the syncs; the default group when None.

    Returns:
        The bytes released (0 when there was none).

    Examples:
        >>> release_staging(nn.Linear(2, 2))
        0
    """
    table = _SEND_STAGING if model is None else _RECV_STAGING.get(model, {})
    buf = table.pop(_group_key(group), None)
    return 0 if buf is None else buf.numel()


# -----------------------------------------------------------------------------
# collectives


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where collectives of `group` want their tensors: CUDA for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check(src: int, group: dist.ProcessGroup | None, *, sending: bool) -> int:
    """This rank, after checking that it takes the role it was called for."""
    what = "send_weights" if sending else "receive_weights"
    if not dist.is_available() or not dist.is_initialized():
        raise WeightSyncError(
            f"{what} needs an initialized process group",
            expected="torch.distributed.init_process_group(...) called on every rank",
            got="no default process group",
            fix="call dist.init_process_group(backend, rank=..., world_size=...) first",
        )
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if rank not in ranks or src not in ranks:
        raise WeightSyncError(
            f"{what}: rank {rank} and source {src} must both belong to the group",
            expected=f"ranks among {ranks}",
            got=f"rank {rank}, src {src}",
            fix="pass the group that holds the trainer and the receivers, and src as a "
            "global rank",
        )
    if sending != (rank == src):
        raise WeightSyncError(
            f"{what} called on rank {rank} with src={src}",
            expected="send_weights on the rank src, receive_weights on every other rank",
            got=f"{what} on rank {rank}",
            fix="call send_weights on the trainer and receive_weights on the others",
        )
    return rank


def _handshake(
    ok: bool, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[int, ...]:
    """Every rank says whether it applied the sync; returns the ranks that did not."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    mine = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(every, mine, group=group)
    return tuple(r for r, flag in zip(ranks, torch.cat(every).tolist()) if flag)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# -----------------------------------------------------------------------------
# sending


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
    pending: list[tuple[int, Any] | None] = field(default_factory=lambda: [None, None])
    """Per slot: (bucket, work) of a broadcast not yet waited for."""

    def wait(self, slot: int) -> None:
        """Wait for the broadcast from `slot`, if one is in flight."""
        item = self.pending[slot]
        if item is None:
            return
        self.wire, work = item
        self.in_collective = True
        work.wait()
        self.pending[slot] = None
        self.in_collective = False
        self.wire = -1

    def drain(self) -> None:
        """Wait for every broadcast in flight, in bucket order."""
        for slot in sorted((0, 1), key=lambda s: p[0] if (p := self.pending[s]) else -1):
            self.wait(slot)


def send_weights(
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = 256 << 20,
    overlap: bool = True,
) -> SendReport:
    """Broadcast checkpoint entries to every other rank of `group`, bucket by bucket.

    Call it on rank `src` while every other rank of the group calls `receive_weights`.
    Entries are packed in the given order into flat buckets of at most `bucket_bytes`
    data bytes; a tensor larger than that is sent alone in a bucket of its own size.
    Tensors may live on any device; they are copied into the staging buffer. With
    `overlap`, bucket k+1 is packed into one staging slot while bucket k is broadcast
    from the other.

    Args:
        weights: `(name, tensor)` pairs in checkpoint names, or a mapping (a state dict).
        src: This rank (global), the source of the broadcasts.
        group: The process group; the default group when None. Give it a timeout
            (`dist.new_group(timeout=...)`): a receiver that died is detected by it.
        bucket_bytes: Data bytes per bucket.
        overlap: Pack the next bucket while the current one is broadcast; the staging
            buffer then holds two buckets. False: one bucket, packing and broadcasts in
            turn.

    Returns:
        The report.

    Raises:
        WeightSyncError: A collective failed (a receiver died or timed out), or some
            receivers did not apply the sync (`.failed_ranks`; their errors say why).
        Exception: Whatever reading or packing the weights raised, after the receivers
            were told to abort (they raise `WeightSyncError`).

    Examples:
        >>> # on the trainer, rank 0, while ranks 1.. call receive_weights:
        >>> # report = send_weights(model.state_dict(), src=0, group=group)
    """
    start = time.perf_counter()
    rank = _check(src, group, sending=True)
    device = _device(group)
    sync = secrets.randbits(62) + 1
    state = _SendProgress()
    plan: _Plan | None = None
    try:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        plan = _plan(items, bucket_bytes, sync)
        state.in_collective = True
        dist.broadcast_object_list([plan.record()], src=src, group=group)
        state.in_collective = False
        state.meta_sent = True
        wires = plan.wires
        stride, need = _slots(wires, overlap)
        staging, _ = _staging(_SEND_STAGING, _group_key(group), device, need)
        state.staging = staging
        tensors = dict(items)
        for b, size in enumerate(plan.sizes):
            i = b % 2 if stride else 0
            state.wait(i)  # the slot's previous broadcast has read it
            state.bucket, state.slot = b, _slot(staging, stride, wires, b)
            with torch.no_grad():  # trainer parameters require grad; the copy is no op of it
                for e in plan.bucket(b):
                    state.entry = e.name
                    _view(state.slot, e).copy_(tensors[e.name])
            state.entry = None
            _trailer(state.slot, size).copy_(torch.tensor([_MAGIC, sync, b, _DATA]))
            state.in_collective, state.wire = True, b
            work = dist.broadcast(state.slot, src=src, group=group, async_op=True)
            state.pending[i] = (b, work)
            state.in_collective, state.wire = False, -1
            if not stride:
                state.wait(0)
        state.drain()
        state.bucket = -1
        state.in_collective = True
        failed = _handshake(True, group, device)
        state.in_collective = False
    except BaseException as exc:
        if any(state.pending) and _SEND_STAGING.get(_group_key(group)) is state.staging:
            # A broadcast may still read it: no later sync may pack into it.
            del _SEND_STAGING[_group_key(group)]
        if state.in_collective:
            where = f"bucket {state.wire}" if state.wire >= 0 else (
                "the handshake" if state.meta_sent else "the metadata")
            raise WeightSyncError(
                f"send_weights: the broadcast of {where} failed",
                bucket=state.wire if state.wire >= 0 else None,
                expected="every receiver taking part until the end of the sync",
                got=_first_line(exc),
                fix="a receiver died, timed out or called something else; see its log. "
                "Recreate the process group before the next sync",
            ) from exc
        _abort(exc, state, plan, src, group, sync)
        raise
    seconds = time.perf_counter() - start
    total = sum(e.nbytes for e in plan.entries)
    report = SendReport(
        rank=rank, sync=sync, receivers=len(dist.get_process_group_ranks(
            group if group is not None else dist.group.WORLD)) - 1,
        entries=len(plan.entries), bytes=total, buckets=len(plan.sizes),
        bucket_bytes=bucket_bytes, largest_bucket=max(plan.sizes, default=0),
        staging_bytes=staging.numel(), overlap=stride > 0, seconds=seconds,
        throughput=total / seconds if seconds > 0 else 0.0,
    )
    if failed:
        raise WeightSyncError(
            f"receiver rank(s) {', '.join(map(str, failed))} did not apply the sync",
            failed_ranks=failed,
            report=report,
            expected="every receiver to load every entry it holds",
            got=f"{len(failed)} receiver(s) failed; each raised WeightSyncError naming why",
            fix="read the receivers' errors (rejected entries name the checkpoint names to "
            "fix), then sync again: until then those models refuse to replay",
        )
    return report


def _abort(
    exc: BaseException,
    state: _SendProgress,
    plan: _Plan | None,
    src: int,
    group: dist.ProcessGroup | None,
    sync: int,
) -> None:
    """Tell the receivers that the sender failed, so that they raise instead of waiting."""
    what = _first_line(exc)
    if state.entry is not None:
        what = f"{what} (while packing entry {state.entry!r})"
    try:
        if not state.meta_sent or plan is None:
            record = {"protocol": _PROTOCOL, "sync": sync, "abort": what}
            dist.broadcast_object_list([record], src=src, group=group)
            return
        if not plan.sizes:
            return
        state.drain()  # the buckets before the failure go out whole, then the abort
        b = max(state.bucket, 0)  # a failure before the first bucket aborts that one
        slot = state.slot
        if slot is None or state.bucket < 0:
            slot = torch.empty(plan.wires[b], dtype=torch.uint8, device=_device(group))
        _trailer(slot, plan.sizes[b]).copy_(torch.tensor([_MAGIC, sync, b, _ABORT]))
        dist.broadcast(slot, src=src, group=group)
        dist.broadcast_object_list([what], src=src, group=group)
    except Exception:  # the receivers then fail by the group's timeout
        return


# -----------------------------------------------------------------------------
# receiving


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


def receive_weights(
    model: nn.Module, *, src: int, group: dist.ProcessGroup | None = None,
    overlap: bool = True,
) -> ReceiveReport:
    """Receive one sync from rank `src` and load it into `model`, graph-safely.

    Call it on every rank of `group` but `src` while `src` calls `send_weights`. Runs
    one `gs.weight_update(model)` around the whole sync: each bucket is broadcast into
    the staging buffer, then `model.load_weights(pairs)` gets views of it (valid during
    the call only: the loader must copy, as loaders do). The loader decides what this
    rank holds; the derived buffers are refreshed once, at the end. With `overlap`, the
    broadcast of bucket k+1 is posted into one staging slot before the loader runs on
    bucket k in the other.

    Entries the loader refuses (`gs.WeightLoadError`) are collected, not fatal on the
    wire: the remaining entries of the bucket are retried and the later buckets still
    load, so that every refusal is named; then the call raises `WeightSyncError` with
    `.rejected`, and the model stays failed closed.

    Args:
        model: The model to load into; it needs a `load_weights(pairs)` method.
        src: The sending rank (global).
        group: The process group; the default group when None. Give it a timeout: a
            sender that died is detected by it.
        overlap: Receive the next bucket while the loader runs on the current one; the
            staging buffer then holds two buckets. False: one bucket, receiving and
            loading in turn.

    Returns:
        The report; `report.failed_ranks` names other receivers that failed.

    Raises:
        WeightSyncError: The sender aborted or died, a collective failed, the model has
            no loader, or the loader refused entries. The model's guarded graphs refuse
            to replay until a later sync completes.

    Examples:
        >>> # on every rollout rank, while rank 0 calls send_weights:
        >>> # report = receive_weights(model, src=0, group=group)
    """
    rank = _check(src, group, sending=False)
    device = _device(group)
    rt = runtime(model)
    before = rt.last_report
    state = _ReceiveProgress()
    try:
        with weight_update(model):
            _receive(model, src, group, device, state, overlap)
            state.loaded = time.perf_counter()
            if state.rejected:
                raise _rejected_error(model, state, rank, src)
    except BaseException as exc:
        if state.completed and isinstance(exc, Exception):
            try:
                _handshake(False, group, device)
            except Exception as hs:
                raise _handshake_error(src, hs, applied=False) from exc
        raise
    end = time.perf_counter()
    try:
        failed = _handshake(True, group, device)
    except Exception as exc:
        raise _handshake_error(src, exc, applied=True) from exc
    return _receive_report(state, rank, src, rt.last_report, before, end, failed)


def _receive_report(
    state: _ReceiveProgress,
    rank: int,
    src: int,
    last: RefreshReport | None,
    before: RefreshReport | None,
    end: float,
    failed: tuple[int, ...],
) -> ReceiveReport:
    plan = state.plan
    assert plan is not None
    seconds = (end if end else time.perf_counter()) - state.started
    total = sum(e.nbytes for e in plan.entries)
    return ReceiveReport(
        rank=rank, src=src, sync=plan.sync, entries=len(plan.entries), bytes=total,
        buckets=len(plan.sizes), seconds=seconds,
        refresh_seconds=max(0.0, end - state.loaded) if end else 0.0,
        throughput=total / seconds if seconds > 0 else 0.0,
        staging_bytes=state.staging_bytes, staging_reused=state.reused, overlap=state.overlap,
        accepted=tuple(state.accepted or ()), rejected=tuple(state.rejected or ()),
        refresh=last if last is not before else None, failed_ranks=failed,
    )


def _rejected_error(
    model: nn.Module, state: _ReceiveProgress, rank: int, src: int
) -> WeightSyncError:
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


def _handshake_error(src: int, exc: BaseException, *, applied: bool) -> WeightSyncError:
    held = ("this rank's model holds the complete new weights" if applied
            else "this rank's model refuses to replay until a complete sync")
    return WeightSyncError(
        "receive_weights: the end-of-sync handshake failed",
        expected=f"every rank of the group, rank {src} included, at the handshake",
        got=_first_line(exc),
        fix=f"{held}; another rank died or timed out: see its log, and recreate the "
        "process group before the next sync",
    )


def _receive(
    model: nn.Module,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    state: _ReceiveProgress,
    overlap: bool,
) -> None:
    """The body of the sync: metadata, then each bucket into staging and the loader."""
    box: list[Any] = [None]
    try:
        dist.broadcast_object_list(box, src=src, group=group)
    except Exception as exc:
        raise WeightSyncError(
            f"receive_weights: the metadata of the sync did not arrive from rank {src}",
            expected="the sender's metadata within the group's timeout",
            got=_first_line(exc),
            fix="the sender died, timed out or called something else; see its log. The "
            "model refuses to replay until a complete sync; recreate the process group",
        ) from exc
    record = box[0]
    state.started = time.perf_counter()
    if not isinstance(record, dict) or record.get("protocol") != _PROTOCOL:
        got = record.get("protocol") if isinstance(record, dict) else type(record).__name__
        raise WeightSyncError(
            "receive_weights: the sender speaks another sync protocol",
            expected=f"protocol {_PROTOCOL}",
            got=got,
            fix="run the same graphsafe version on the sender and the receivers",
        )
    if record["abort"] is not None:
        raise WeightSyncError(
            f"receive_weights: the sender (rank {src}) aborted the sync before sending any "
            "weights",
            expected="the weights",
            got=f"the sender raised {record['abort']}",
            fix="fix the error on the sender, then sync again; the model refuses to "
            "replay until a complete sync",
        )
    plan = state.plan = _Plan.from_record(record)
    wires = plan.wires
    stride, need = _slots(wires, overlap)
    table, key = _RECV_STAGING.setdefault(model, {}), _group_key(group)
    staging, state.reused = _staging(table, key, device, need)
    state.staging_bytes, state.overlap = staging.numel(), stride > 0
    loader = getattr(model, "load_weights", None)
    state.accepted, state.rejected = [], []
    pending: Any = None  # the work of the broadcast posted and not yet waited for

    def post(b: int) -> Any:
        try:
            return dist.broadcast(_slot(staging, stride, wires, b), src=src, group=group,
                                  async_op=True)
        except Exception as exc:
            raise _lost(b, exc) from exc

    def _lost(b: int, exc: BaseException) -> WeightSyncError:
        entries = plan.bucket(b)
        return WeightSyncError(
            f"receive_weights: bucket {b} of {len(plan.sizes)} did not arrive from rank "
            f"{src}",
            bucket=b,
            entry=entries[0].name if entries else None,
            expected=f"{wires[b]} bytes within the group's timeout",
            got=_first_line(exc),
            fix="the sender died or timed out; see its log. The model refuses to replay "
            "until a complete sync; recreate the process group before the next one",
        )

    try:
        pending = post(0) if plan.sizes else None
        for b, size in enumerate(plan.sizes):
            entries = plan.bucket(b)
            work, pending = pending, None
            try:
                work.wait()
            except Exception as exc:
                raise _lost(b, exc) from exc
            mark_written(staging)  # a c10d write: declared, whatever the tracker saw
            slot = _slot(staging, stride, wires, b)
            _check_trailer(slot, size, plan, b, src, group)
            if stride and b + 1 < len(plan.sizes):
                pending = post(b + 1)  # into the other slot, while the loader runs
            pairs = [(e.name, _view(slot, e)) for e in entries]
            if loader is None or not callable(loader):
                state.rejected.extend(
                    RejectedEntry(name=n, bucket=b, error=f"{type(model).__name__} has no "
                                  "load_weights(pairs) method") for n, _ in pairs
                )
            else:
                _load(loader, pairs, b, state.accepted, state.rejected)
            if not stride and b + 1 < len(plan.sizes):
                pending = post(b + 1)
    finally:
        if pending is not None and table.get(key) is staging:
            # A broadcast still writes into it: no later sync may reuse it.
            del table[key]
    state.completed = True


def _check_trailer(
    slot: torch.Tensor, size: int, plan: _Plan, b: int, src: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Check bucket `b`'s trailer; raise the sender's abort if it says so."""
    magic, sync, index, status = _trailer(slot, size).tolist()
    if (magic, sync, index) != (_MAGIC, plan.sync, b) or status not in (_DATA, _ABORT):
        raise WeightSyncError(
            f"receive_weights: bucket {b} arrived with a wrong trailer",
            bucket=b,
            expected=f"magic {_MAGIC:#x}, sync {plan.sync}, bucket {b}",
            got=f"magic {magic:#x}, sync {sync}, bucket {index}, status {status}",
            fix="every rank of the group must take part in the same sync: a rank called "
            "another collective in between",
        )
    if status == _ABORT:
        entries = plan.bucket(b)
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=src, group=group)
        except Exception as exc:
            box = [f"(its error did not arrive: {_first_line(exc)})"]
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
    bucket: int,
    accepted: list[str],
    rejected: list[RejectedEntry],
) -> None:
    """Load one bucket; a refused entry is recorded and the others are loaded anyway."""
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
                rejected.extend(RejectedEntry(name=n, bucket=bucket, error=_first_line(exc))
                                for n in names)
                continue
            i = names.index(exc.name)
            rejected.append(RejectedEntry(name=exc.name, bucket=bucket, error=_first_line(exc)))
            # The entries before it may or may not have been written: load them again.
            queue.extend(part for part in (chunk[i + 1 :], chunk[:i]) if part)
            continue
        except Exception as exc:
            rejected.extend(RejectedEntry(name=n, bucket=bucket, error=_first_line(exc))
                            for n, _ in chunk)
            continue
        if isinstance(result, (set, frozenset, list, tuple)) and all(
            isinstance(n, str) for n in result
        ):
            accepted.extend(sorted(result) if isinstance(result, (set, frozenset)) else result)
        else:
            accepted.extend(n for n, _ in chunk)

