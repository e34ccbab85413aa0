"""The receiving side of a sync: `receive_weights`, `sync_pending`, and the end of a
sync: the handshake, the errors of a sync that was not applied, the abort it posts."""

from __future__ import annotations

import time
from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from graphsafe._errors import one_line
from graphsafe._runtime.runtime import runtime, weight_update
from graphsafe.distributed._control.channel import _Channel, _recovery_of, _ToldError
from graphsafe.distributed._protocol.exchange import (
    _APPLIED,
    _FAILED,
    _check,
    _device,
    _handshake,
    _names,
)
from graphsafe.distributed._receive.metadata import _agree, _Agreed
from graphsafe.distributed._receive.report import _receive_report
from graphsafe.distributed._receive.transfer import (
    _mismatch_error,
    _mismatches,
    _receive,
    _Transfer,
)
from graphsafe.distributed._reports import ReceiveReport, WeightSyncError

__all__ = ["receive_weights"]


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

    A verified sync (the sender's default) is checked end to end: before the loader
    runs on an entry, this rank takes the fingerprint of the bytes it received for it,
    and at the end-of-sync handshake compares them with the sender's, taken from the
    tensors it was given. An entry that arrived changed fails the sync on every rank, naming it
    (`.mismatched`); `report.verified` and `report.fingerprinted` say what was checked.

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
            model has no loader, the loader refused entries, an entry arrived other
            than the sender was given it (its fingerprint differs), or
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
    begin = time.perf_counter()
    if not channel.posted(wait_timeout):
        raise WeightSyncError(
            f"receive_weights: no sync began within {wait_timeout} s",
            expected=f"rank {src} calling send_weights within wait_timeout",
            got=f"nothing after {wait_timeout} s",
            fix="call receive_weights again (the model is untouched), or give a longer "
            "wait_timeout (None waits until the sender begins)",
        )
    waited = time.perf_counter() - begin
    try:
        agreed = _agree(model, expects, src, group, device, channel)
    except BaseException as exc:
        _tell(exc, channel)
        raise
    if isinstance(agreed, WeightSyncError):
        raise agreed  # the sender's abort or the refusal: every rank raises it in step
    transfer, loaded = _apply(model, agreed, waited, rank, src, group, device, overlap,
                              channel)
    end = time.perf_counter()
    refresh = rt.last_report if rt.last_report is not before else None
    return _receive_report(rank, src, agreed, transfer, waited, end=end, loaded=loaded,
                           refresh=refresh)


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


def _apply(
    model: nn.Module,
    agreed: _Agreed,
    waited: float,
    rank: int,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    overlap: bool,
    channel: _Channel,
) -> tuple[_Transfer, float]:
    """Run the sync inside one `weight_update`; every rank says at the handshake, still
    inside it, whether it applied the sync, so that one failure fails them all. A
    failure the other ranks cannot see is posted to the store, so that they fail too.

    Returns:
        What the transfer did, and when the loader's last call returned.
    """
    known = False  # every rank knows of the failure being raised: nothing to post
    try:
        with weight_update(model):
            transfer = _receive(model, agreed.plan, src, group, device, overlap, channel)
            if isinstance(transfer, WeightSyncError):
                known = True
                raise transfer  # the sender's abort, read in a trailer
            loaded = time.perf_counter()
            plan = agreed.plan
            try:  # says this rank's fingerprints, and reads the sender's
                outcome = _handshake(
                    _FAILED if transfer.rejected else _APPLIED, group, device, channel,
                    src=src, plan=plan, fingerprints=transfer.fingerprints)
            except _ToldError:
                raise
            except Exception as exc:
                raise _handshake_error(src, exc) from exc
            known = True  # past the handshake every rank knows which ranks applied it
            if transfer.rejected:
                raise _rejected_error(model, agreed, transfer, waited, rank, src)
            if outcome.mine:
                raise _mismatch_error(_mismatches(plan, transfer, outcome.sent, outcome.mine),
                                      rank, src,
                                      _receive_report(rank, src, agreed, transfer, waited))
            if outcome.failed:
                raise _others_failed(outcome.failed, outcome.mismatched, rank)
    except BaseException as exc:
        if not known:
            _tell(exc, channel)
        raise
    return transfer, loaded


def _tell(exc: BaseException, channel: _Channel) -> None:
    """Post this rank's failure to the store, unless this rank learned it there (every
    rank knows of it then)."""
    if isinstance(exc, _ToldError):
        return
    recovery = exc.recovery if isinstance(exc, WeightSyncError) else "group"
    channel.abort("group" if recovery == "resend" else recovery,  # type: ignore[arg-type]
                  f"receive_weights raised {one_line(exc)}")


def _rejected_error(
    model: nn.Module, agreed: _Agreed, transfer: _Transfer, waited: float, rank: int,
    src: int,
) -> WeightSyncError:
    """The error naming the entries the loader refused: the first eight, then a count."""
    rejected = transfer.rejected
    shown = "\n".join(f"    {r.name!r} (bucket {r.bucket}): {r.error}" for r in rejected[:8])
    more = f"\n    ... and {len(rejected) - 8} more" if len(rejected) > 8 else ""
    return WeightSyncError(
        f"rank {rank}: the loader of {type(model).__name__} rejected {len(rejected)} "
        f"entr{'y' if len(rejected) == 1 else 'ies'} of the sync",
        entry=rejected[0].name,
        bucket=rejected[0].bucket,
        rejected=rejected,
        report=_receive_report(rank, src, agreed, transfer, waited),
        module_class=type(model).__name__,
        expected="every entry loaded, or skipped as held by another rank",
        got=f"rejected:\n{shown}{more}",
        fix="the model refuses to replay until a complete sync: fix these entries' names, "
        "shapes or dtypes on the sender (or the receiver's config), then sync again",
    )


def _others_failed(failed: tuple[int, ...], mismatched: tuple[str, ...], rank: int
                   ) -> WeightSyncError:
    """The error of a receiver that applied the sync when others did not."""
    changed = _names(list(mismatched))
    return WeightSyncError(
        f"rank {rank}: receiver rank(s) {', '.join(map(str, failed))} did not apply the "
        "sync" + (f": {changed} arrived changed there" if mismatched else ""),
        entry=mismatched[0] if mismatched else None,
        mismatched=mismatched,
        failed_ranks=failed,
        expected="every receiver applying the sync",
        got=f"{len(failed)} receiver(s) failed; each raised WeightSyncError naming why"
        + (f"; entries that arrived other than the sender was given them: {changed}"
           if mismatched else ""),
        fix="read their errors, then sync again: until then every receiver's model "
        "refuses to replay",
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
