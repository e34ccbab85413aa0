"""Weight sync under the faults of a real RL job, in real processes (gloo on loopback).

Each test runs one world of three processes: rank 0 the trainer (the full tiny DeepSeek
V4 checkpoint), ranks 1 and 2 its two pipeline stages, each with a graph captured on its
first weights. Transfers time out after `TIMEOUT` seconds; every world has a hard
deadline, after which the harness kills every process and fails. The outcome is checked
on every rank: a named error, a refused replay, or a replay equal to that of a model
built from scratch from the trainer's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import re
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_worlds import (
    TIMEOUT,
    Stage,
    checkpoint,
    die,
    init_world,
    report,
    run_world,
)

import graphsafe as gs
import graphsafe.distributed as gsd
from graphsafe.distributed import _sender
from graphsafe.distributed._protocol import layout
from graphsafe.distributed._protocol.layout import _TRAILER, _trailer
from graphsafe.distributed._receive import metadata, transfer

_BUCKET = 16 << 10
_SHORT = 2.0  # the transfer timeout of the long-step test's group
_STEP = _SHORT + 1.5  # a train step longer than that timeout


def _raises(fn: Any, match: str) -> gsd.WeightSyncError:
    with pytest.raises(gsd.WeightSyncError, match=match) as caught:
        fn()
    return caught.value


# -----------------------------------------------------------------------------
# a train step longer than the transfer timeout


def long_step(rank: int, ctx: dict[str, Any]) -> Any:
    # Transfers on a group with a short timeout; the phases are told apart on the world's
    # group (`TIMEOUT`), so that each train step starts when the receivers wait, however
    # long they took to get there.
    group = ctx["group"]
    short = dist.new_group(timeout=datetime.timedelta(seconds=_SHORT))
    if rank == 0:
        dist.barrier(group=group)  # the stages are built
        for seed in (2, 3):
            dist.barrier(group=group)  # the receivers wait (then poll) for the sync
            time.sleep(_STEP)  # training
            gsd.send_weights(checkpoint(seed), src=0, group=short, bucket_bytes=_BUCKET)
        # Control: the same wait inside a collective dies at the group's timeout.
        dist.barrier(group=group)
        time.sleep(_STEP)
        with pytest.raises(RuntimeError):
            dist.broadcast(torch.zeros(4), src=0, group=short)
        return None
    stage = Stage.build(rank, checkpoint(1))
    dist.barrier(group=group)
    # A receiver that gives up waiting leaves the model untouched and the group alive.
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=short,
                                              wait_timeout=0.5), "no sync began within")
    assert err.recovery == "resend"
    assert stage.replays(checkpoint(1))
    dist.barrier(group=group)
    first = gsd.receive_weights(stage.model, src=0, group=short)  # waits as long as needed
    assert first.waited_seconds > _SHORT
    assert stage.replays(checkpoint(2))
    dist.barrier(group=group)
    polls = 0  # the phase barrier: the rollout rank works until the sync is coming
    while not gsd.sync_pending(src=0, group=short, timeout=0.25):
        polls += 1
    gsd.receive_weights(stage.model, src=0, group=short)
    assert stage.replays(checkpoint(3)) and polls > 0
    dist.barrier(group=group)
    with pytest.raises(RuntimeError, match=r"(?i)timed out|timeout"):  # the control
        dist.broadcast(torch.zeros(4), src=0, group=short)
    return first.waited_seconds


def test_a_train_step_longer_than_the_transfer_timeout_syncs_and_control_a_collective_wait_dies():
    world = run_world(long_step)
    waited = world.ok(0, 1, 2)
    assert waited[1] > _SHORT and waited[2] > _SHORT


# -----------------------------------------------------------------------------
# completeness: missing, renamed, extra and misrouted entries


def _shifted(ck: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Every layer's tensors under the next layer's name: a wrong pipeline map."""
    out = []
    for name, t in ck:
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            name = f"layers.{int(i) + 1}.{rest}"
        out.append((name, t))
    return out


_DROPPED = ("layers.0.attn_norm.weight", "layers.3.ffn_norm.weight")  # one per stage


def _incomplete(ck: list[tuple[str, torch.Tensor]]) -> dict[str, list[tuple[str, Any]]]:
    return {
        "missing": [(n, t) for n, t in ck if n not in _DROPPED],
        "renamed": [("layers.0.attn_norm.scale" if n == _DROPPED[0] else n, t) for n, t in ck],
        "extra": [*ck, ("bogus.entry", torch.zeros(3))],
        "misrouted": _shifted(ck),
    }


_NAMED = {  # what every rank's error names, per case
    "missing": ("expects 1 entry the sync lacks: 'layers.0.attn_norm.weight'",
                "expects 1 entry the sync lacks: 'layers.3.ffn_norm.weight'"),
    "renamed": ("'layers.0.attn_norm.weight'", "no receiver expects 1 entry of the sync: "
                "'layers.0.attn_norm.scale'"),
    "extra": ("no receiver expects 1 entry of the sync: 'bogus.entry'",),
    "misrouted": ("'layers.0.attn_norm.weight'", "'layers.4.attn_norm.weight'"),
}


def completeness(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    new = checkpoint(2)
    cases = _incomplete(new)
    if rank == 0:
        for case, ck in cases.items():
            err = _raises(lambda ck=ck: gsd.send_weights(ck, src=0, group=group,
                                                          bucket_bytes=_BUCKET),
                          "refused before any data moved")
            assert all(s in str(err) for s in _NAMED[case]), (case, str(err))
            assert err.recovery == "resend"
        gsd.send_weights(new, src=0, group=group, bucket_bytes=_BUCKET)
        return None
    stage = Stage.build(rank, checkpoint(1))
    for case in cases:
        err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                      rf"rank {rank}: the sync was refused before any data moved")
        assert all(s in str(err) for s in _NAMED[case]), (case, str(err))
        assert stage.replays(checkpoint(1)), case  # nothing written: the old weights, whole
    report_ = gsd.receive_weights(stage.model, src=0, group=group)
    assert report_.expected == len(dict(stage.model.named_parameters()))
    assert stage.replays(new)
    # Control: the same incomplete checkpoint, loaded without the check, "succeeds" and
    # the replay runs a mix of old and new weights.
    mixes = {}
    for case, ck in cases.items():
        fresh = Stage.build(rank, checkpoint(1))
        with gs.weight_update(fresh.model):
            fresh.model.load_weights([(n, t) for n, t in ck if not n.startswith("bogus")
                                      and not n.endswith(".scale")
                                      and not n.startswith("layers.4.")])
        mixes[case] = not fresh.replays(new) and not fresh.replays(checkpoint(1))
    return mixes


def test_missing_renamed_extra_and_misrouted_entries_are_refused_by_name_on_every_rank():
    world = run_world(completeness)
    mixes = world.ok(0, 1, 2)
    # Control: loaded without the check, each case replays a mix on some stage.
    for case in ("missing", "renamed", "misrouted"):
        assert mixes[1][case] or mixes[2][case], case


# -----------------------------------------------------------------------------
# partial syncs heal only what they rewrite


def partial_heal(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    new = checkpoint(2)
    if rank == 0:
        broken = [(n, torch.empty(t.shape, device="meta") if n == "layers.2.hc_ffn_fn" else t)
                  for n, t in checkpoint(5)]
        with pytest.raises(TypeError, match="a meta tensor has no values"):
            gsd.send_weights(broken, src=0, group=group, bucket_bytes=_BUCKET)
        gsd.send_weights(new[:10], src=0, group=group, partial=True)
        gsd.send_weights([], src=0, group=group, partial=True)
        for ck in (new[:10], []):  # control: not said to be partial, refused
            _raises(lambda ck=ck: gsd.send_weights(ck, src=0, group=group),
                    "refused before any data moved")
        report_ = gsd.send_weights(new[10:], src=0, group=group, partial=True,
                                   bucket_bytes=_BUCKET)
        assert report_.partial
        return None
    stage = Stage.build(rank, checkpoint(1))
    _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group), "aborted the sync")
    assert stage.refused() == "StaleError"
    for _ in range(2):  # ten entries, then none: not a heal
        got = gsd.receive_weights(stage.model, src=0, group=group)
        assert got.partial
        assert stage.refused() == "StaleError"
    for _ in range(2):
        _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group), "lacks")
        assert stage.refused() == "StaleError"
    gsd.receive_weights(stage.model, src=0, group=group)  # the rest: every weight rewritten
    assert stage.replays(new)
    return None


def test_a_partial_sync_heals_only_what_it_rewrote_and_control_an_unsaid_partial_is_refused():
    run_world(partial_heal).ok(0, 1, 2)


# -----------------------------------------------------------------------------
# end to end: bytes changed between the trainer's tensors and the receivers


_DIRECT = 8 << 10  # these syncs send entries of 8 KiB and more as direct buckets
_FAULTS = {  # fault -> (the bucket it hits, the entry there; with _BUCKET and _DIRECT)
    "staging": (5, "layers.0.hc_ffn_base"),  # packed: bucket 5 starts with it
    "wire": (0, "hc_head_fn"),  # packed, held by the second stage
    "short": (2, "layers.0.hc_attn_fn"),  # direct: 24 KiB, alone in bucket 2
}


def _faulty(fault: str) -> Any:
    """`dist.broadcast` that damages the sender's broadcast of one bucket, below every
    check the sender makes (its fingerprints were taken, its bucket matched the plan):

    - `staging`: one byte flipped in the sender's staging slot, after packing;
    - `wire`: one byte flipped on the way (the sender's slot intact);
    - `short`: a direct bucket cut 64 bytes short on the wire (gloo takes it silently).
    """
    real = dist.broadcast
    bucket = _FAULTS[fault][0]
    calls, held = [0], []

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == bucket + 1:  # the sync's broadcasts are its buckets, in order
            if fault == "staging":
                tensor.view(torch.uint8)[3] ^= 0x40  # the exponent of the first value
            elif fault == "wire":
                tensor = tensor.clone()
                tensor.view(torch.uint8)[3] ^= 0x40
            else:
                tensor = tensor[:-64]
            held.append(tensor)  # alive until the asynchronous broadcast has read it
        return real(tensor, *args, **kwargs)

    return real, broadcast


def end_to_end(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    cks = {seed: checkpoint(seed) for seed in range(2, 9)}
    runs = [(fault, verify) for fault in _FAULTS for verify in (True, False)]
    if rank == 0:
        for (fault, verify), seed in zip(runs, cks):
            real, faulty = _faulty(fault)
            dist.broadcast = faulty
            try:
                if verify:  # the default
                    entry = _FAULTS[fault][1]
                    err = _raises(lambda seed=seed: gsd.send_weights(
                        cks[seed], src=0, group=group, bucket_bytes=_BUCKET,
                        direct_bytes=_DIRECT),
                        rf"did not apply the sync: '{entry}' arrived changed")
                    assert err.mismatched == (entry,) and err.recovery == "resend"
                    assert err.failed_ranks == (1, 2)
                else:
                    gsd.send_weights(cks[seed], src=0, group=group, bucket_bytes=_BUCKET,
                                     direct_bytes=_DIRECT, verify=False)
            finally:
                dist.broadcast = real
        report_ = gsd.send_weights(cks[8], src=0, group=group, bucket_bytes=_BUCKET,
                                   direct_bytes=_DIRECT)
        assert report_.verified and report_.fingerprinted == len(cks[8])
        return None
    stage = Stage.build(rank, checkpoint(1))
    held = {n for n, _ in stage.model.named_parameters()}
    wrong: dict[str, bool] = {}
    for (fault, verify), seed in zip(runs, cks):
        entry = _FAULTS[fault][1]
        if verify:  # every receiver names the entry, and refuses to replay
            err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                          rf"rank {rank}: 1 entry of the sync arrived other than the "
                          rf"sender was given it: '{entry}'")
            assert err.mismatched == (entry,) and err.recovery == "resend"
            assert f"the sender's {gs.fingerprint(dict(cks[seed]))[entry]}" in str(err)
            assert stage.refused() == "StaleError"
        else:  # control: unverified, the same fault reaches the model unseen
            got = gsd.receive_weights(stage.model, src=0, group=group)
            assert not got.verified and got.fingerprinted == 0
            if entry in held:
                wrong[fault] = not stage.replays(cks[seed])
    got = gsd.receive_weights(stage.model, src=0, group=group)
    assert got.verified and got.fingerprinted == len(cks[8])
    assert stage.replays(cks[8])
    return wrong


def test_bytes_changed_after_the_fingerprint_fail_every_rank_by_entry_and_control_replays():
    results = run_world(end_to_end).ok(0, 1, 2)
    wrong = {**results[1], **results[2]}  # each fault, on the stage that holds its entry
    assert wrong == {fault: True for fault in _FAULTS}


class _FlippedOnArrival:
    """A receiver's broadcast whose bytes get one bit flipped as it completes: the wire
    to this rank alone damaged (its fingerprints are taken after the wait)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor, self.flipped = work, tensor, False

    def get_future(self) -> Any:
        return self.work.get_future()

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, *args: Any) -> Any:
        done = self.work.wait(*args)
        if not self.flipped:
            self.flipped = True
            self.tensor.view(torch.uint8)[3] ^= 0x40  # the exponent of the first value
        return done


@contextlib.contextmanager
def _damaged_here(bucket: int) -> Any:
    """This receiver's broadcast of `bucket` arrives with one bit flipped."""
    real, calls = dist.broadcast, [0]

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        work = real(tensor, *args, **kwargs)
        return _FlippedOnArrival(work, tensor) if calls[0] == bucket + 1 else work

    dist.broadcast = broadcast
    try:
        yield
    finally:
        dist.broadcast = real


def one_receiver_damaged(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    cks = {seed: checkpoint(seed) for seed in (2, 3, 4)}
    bucket, entry = _FAULTS["staging"]  # packed, held by the first stage (rank 1)

    def send(seed: int, verify: bool = True) -> Any:
        return gsd.send_weights(cks[seed], src=0, group=group, bucket_bytes=_BUCKET,
                                direct_bytes=_DIRECT, verify=verify)

    if rank == 0:
        err = _raises(lambda: send(2), rf"receiver rank\(s\) 1 did not apply the sync: "
                      rf"'{entry}' arrived changed")
        assert err.failed_ranks == (1,) and err.mismatched == (entry,)
        send(3, verify=False)  # the control
        send(4)
        return None
    stage = Stage.build(rank, checkpoint(1))
    receive = functools.partial(gsd.receive_weights, stage.model, src=0, group=group)
    with _damaged_here(bucket) if rank == 1 else contextlib.nullcontext():
        if rank == 1:  # names the entry, with both fingerprints
            err = _raises(receive, rf"rank 1: 1 entry of the sync arrived other than the "
                          rf"sender was given it: '{entry}'")
            assert f"the sender's {gs.fingerprint(dict(cks[2]))[entry]}" in str(err)
        else:  # its own bytes arrived whole: fails with the rank that saw the change
            err = _raises(receive, rf"rank 2: receiver rank\(s\) 1 did not apply the sync: "
                          rf"'{entry}' arrived changed there")
            assert err.failed_ranks == (1,)
        assert err.mismatched == (entry,) and stage.refused() == "StaleError"
    with _damaged_here(bucket) if rank == 1 else contextlib.nullcontext():
        receive()  # the control: unverified, the damage reaches rank 1's model unseen
    wrong = not stage.replays(cks[3])
    got = receive()
    assert got.verified and stage.replays(cks[4])
    return wrong


def test_an_entry_changed_on_one_receiver_fails_every_rank_by_name_and_control_replays():
    """The fingerprints every rank says at the handshake tell which receiver got which
    entry changed: that receiver and the sender name it and the receiver, the other
    receiver (whose bytes arrived whole) fails with it; unverified, rank 1 replays
    wrong."""
    results = run_world(one_receiver_damaged).ok(0, 1, 2)
    assert results[1] is True and results[2] is False


_SEG = 1024  # the last segment of these syncs: the last bucket's entries span several


def _spanning(ck: list[tuple[str, torch.Tensor]]) -> tuple[int, int, str]:
    """The first segment boundary inside an entry: the sender's broadcast (its count,
    from 1) of the segment after it, its byte there, and the entry."""
    plan = layout._plan(ck, _BUCKET, 0, _DIRECT, torch.device("cpu"), segment_bytes=_SEG)
    calls = 0
    for b in range(len(plan.sizes)):
        for lo, _ in plan.segments(b):
            calls += 1
            inside = [e for e in plan.bucket(b) if e.offset < lo < e.offset + e.nbytes]
            if inside:
                return calls, lo, inside[0].name
    raise AssertionError("no entry spans two segments")


def _flipped_in(call: int) -> Any:
    """`dist.broadcast` that flips the first byte of the sender's `call`-th broadcast on
    the way (the sender's staging intact); it counts every broadcast of the sync."""
    real = dist.broadcast
    calls, held = [0], []

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            tensor = tensor.clone()
            tensor.view(torch.uint8)[0] ^= 0x40
            held.append(tensor)
        return real(tensor, *args, **kwargs)

    return real, broadcast, calls


def in_segments(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    cks = {seed: checkpoint(seed) for seed in (2, 3, 4)}
    call, at, entry = _spanning(cks[2])
    if rank == 0:
        layout._SEGMENT = _SEG  # the receivers follow the plan's segments
        plan = layout._plan(cks[2], _BUCKET, 0, _DIRECT, torch.device("cpu"))
        segments = sum(len(plan.segments(b)) for b in range(len(plan.sizes)))
        real, counting, calls = _flipped_in(-1)  # counts, flips nothing
        dist.broadcast = counting
        try:
            clean = gsd.send_weights(cks[2], src=0, group=group, bucket_bytes=_BUCKET,
                                     direct_bytes=_DIRECT)
        finally:
            dist.broadcast = real
        # One broadcast per segment (the fingerprints travel in the handshake): the last
        # bucket of entries in several.
        assert calls[0] == segments and segments > clean.buckets + 2
        for verify in (True, False):
            real, flipping, _ = _flipped_in(call)
            dist.broadcast = flipping
            try:
                if verify:
                    err = _raises(lambda: gsd.send_weights(
                        cks[3], src=0, group=group, bucket_bytes=_BUCKET,
                        direct_bytes=_DIRECT), rf"'{entry}' arrived changed")
                    assert err.mismatched == (entry,)
                else:
                    gsd.send_weights(cks[4], src=0, group=group, bucket_bytes=_BUCKET,
                                     direct_bytes=_DIRECT, verify=False)
            finally:
                dist.broadcast = real
        return at
    stage = Stage.build(rank, checkpoint(1))
    # Every entry's fingerprint, added up from the segments it arrived in, is the
    # sender's: no entry is refused, and the stage replays the new weights.
    got = gsd.receive_weights(stage.model, src=0, group=group)
    assert got.verified and got.fingerprinted == len(cks[2]) and stage.replays(cks[2])
    # A byte flipped past the entry's first segment is caught, by name, before the
    # graph can replay it.
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                  rf"1 entry of the sync arrived other than the sender was given it: "
                  rf"'{entry}'")
    assert err.mismatched == (entry,) and stage.refused() == "StaleError"
    # Control: the same flip, unverified, reaches the model unseen.
    gsd.receive_weights(stage.model, src=0, group=group)
    held = entry in {n for n, _ in stage.model.named_parameters()}
    return held, held and not stage.replays(cks[4])


def test_entries_across_segments_are_fingerprinted_piece_by_piece_and_control_unverified():
    results = run_world(in_segments).ok(0, 1, 2)
    assert results[0] > 0  # the flipped byte lies past the entry's first segment
    assert sorted(results[r] for r in (1, 2)) == [(False, False), (True, True)]


def reports_then_aborts(rank: int, ctx: dict[str, Any]) -> Any:
    report("before", rank)
    os.abort()


def test_a_report_made_just_before_the_process_aborts_reaches_the_parent():
    world = run_world(reports_then_aborts, late=True)  # no process group: nothing to wait
    assert {r: world.reports[r].get("before") for r in range(3)} == {0: 0, 1: 1, 2: 2}
    assert set(world.exitcodes.values()) == {-signal.SIGABRT}


# -----------------------------------------------------------------------------
# two checks of the plan: an unexpected entry in a partial sync; another sync's trailer


def _claiming_all() -> Any:
    """The receivers' verdict weakened: each claims every entry of the sync."""
    real = metadata._verdict

    def verdict(plan: Any, expected: frozenset[str], *args: Any) -> Any:
        return real(plan, expected | {e.name for e in plan.entries}, *args)

    return real, verdict


def _stale_trailer(bucket: int, sync: int) -> Any:
    """`dist.broadcast` that sends packed bucket `bucket` with `sync` in its trailer (a
    bucket of that sync: the data is this sync's, whole)."""
    real = dist.broadcast
    calls, held = [0], []

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == bucket + 1:
            tensor = tensor.clone()
            tensor[-_TRAILER:].view(torch.int64)[1] = sync
            held.append(tensor)
        return real(tensor, *args, **kwargs)

    return real, broadcast


def _ignoring_sync() -> Any:
    """The receivers' trailer check without its comparison of the sync id."""
    real = transfer._check_trailer

    def check(slot: torch.Tensor, size: int, plan: Any, *args: Any) -> Any:
        sync = int(_trailer(slot, size)[1])
        return real(slot, size, dataclasses.replace(plan, sync=sync), *args)

    return real, check


def plan_checks(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    cks = {seed: checkpoint(seed) for seed in (2, 3, 4, 5)}
    bogus = [*cks[3][:10], ("bogus.entry", torch.zeros(3))]
    timeout = datetime.timedelta(seconds=TIMEOUT)
    if rank == 0:
        first = gsd.send_weights(cks[2], src=0, group=group, bucket_bytes=_BUCKET)
        for _ in range(2):  # checked, then the control with every receiver claiming all
            err = _raises(lambda: gsd.send_weights(bogus, src=0, group=group, partial=True),
                          "refused before any data moved|did not apply the sync")
        assert err.failed_ranks == (1, 2)  # the control: the data moved
        gsd.send_weights(cks[3], src=0, group=group, bucket_bytes=_BUCKET)
        real, stale = _stale_trailer(3, first.sync)
        dist.broadcast = stale
        try:
            err = _raises(lambda: gsd.send_weights(cks[4], src=0, group=group,
                                                   bucket_bytes=_BUCKET), "")
            group = gsd.recover(err, group=group, timeout=timeout)
            gsd.send_weights(cks[4], src=0, group=group, bucket_bytes=_BUCKET)  # control
        finally:
            dist.broadcast = real
        gsd.send_weights(cks[5], src=0, group=group, bucket_bytes=_BUCKET)
        return err.recovery
    stage = Stage.build(rank, checkpoint(1))
    gsd.receive_weights(stage.model, src=0, group=group)
    # A partial sync carrying an entry no receiver expects: refused before any data
    # moved, the model untouched (it replays the last sync's weights).
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                  rf"rank {rank}: the sync was refused before any data moved")
    assert "no receiver expects 1 entry of the sync: 'bogus.entry'" in str(err)
    untouched = stage.replays(cks[2])
    real_verdict, claiming = _claiming_all()
    metadata._verdict = claiming  # control: the check weakened
    try:
        _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                "did not apply the sync|rejected 1 entry")
    finally:
        metadata._verdict = real_verdict
    moved = stage.refused()  # the data moved: failed closed, no longer untouched
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(cks[3])
    # A trailer carrying another sync's id fails every rank.
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group), "")
    refused_trailer = stage.refused()
    group = gsd.recover(err, group=group, timeout=timeout)
    real_check, ignoring = _ignoring_sync()
    transfer._check_trailer = ignoring  # control: the comparison removed
    try:
        gsd.receive_weights(stage.model, src=0, group=group)  # every rank applies it
    finally:
        transfer._check_trailer = real_check
    applied = stage.replays(cks[4])
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(cks[5])
    return untouched, moved, str(err), err.recovery, refused_trailer, applied


def test_unexpected_entry_in_partial_and_stale_trailer_fail_every_rank_and_controls_pass():
    results = run_world(plan_checks).ok(0, 1, 2)
    assert results[0] == "group"  # the sender failed too
    for r in (1, 2):
        untouched, moved, _, recovery, refused, applied = results[r]
        assert untouched  # refused before any data moved
        assert moved == "StaleError"  # control: with the check weakened the data moved
        assert recovery == "group" and refused == "StaleError"
        assert applied  # control: without the comparison every rank applied the sync
    # The rank that read the stale trailer names it; the other was told by the store.
    errors = results[1][2] + results[2][2]
    assert re.search(r"bucket 3 arrived with a wrong trailer", errors), errors
    assert "sync " in errors


# -----------------------------------------------------------------------------
# short and long buckets


def _resized(which: int, delta: int) -> Any:
    """`_wire_of` whose `which`-th direct entry comes `delta` bytes long or short."""
    real = _sender._wire_of
    calls = [0]

    def wire_of(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        wire = real(t)
        if calls[0] != which:
            return wire
        return wire[:delta] if delta < 0 else torch.cat([wire, torch.zeros(delta,
                                                                           dtype=torch.uint8)])

    return real, wire_of


def sizes(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    if rank == 0:
        for delta in (-64, 64):
            real, resized = _resized(2, delta)
            _sender._wire_of = resized  # type: ignore[assignment]
            try:
                err = _raises(lambda: gsd.send_weights(checkpoint(2), src=0, group=group,
                                                       bucket_bytes=_BUCKET,
                                                       direct_bytes=8 << 10),
                              "does not match the plan")
                assert err.recovery == "resend"
            finally:
                _sender._wire_of = real  # type: ignore[assignment]
        gsd.send_weights(checkpoint(3), src=0, group=group, bucket_bytes=_BUCKET,
                         direct_bytes=8 << 10)
        # Control: a raw broadcast 64 bytes short is taken silently, then one 64 bytes
        # long kills the receivers (gloo aborts the process).
        dist.broadcast(torch.ones(1024 - 64, dtype=torch.uint8), src=0, group=group)
        dist.barrier(group=group)
        with contextlib.suppress(RuntimeError):
            dist.broadcast(torch.ones(1024 + 64, dtype=torch.uint8), src=0, group=group)
        return None
    stage = Stage.build(rank, checkpoint(1))
    for _ in range(2):
        err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group),
                      r"aborted the sync at bucket \d+ of \d+")
        assert "does not match the plan" in str(err)
        assert stage.refused() == "StaleError"
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(checkpoint(3))
    buf = torch.zeros(1024, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    report("short_taken", bool(buf[: 1024 - 64].eq(1).all() and buf[1024 - 64 :].eq(0).all()))
    dist.barrier(group=group)
    dist.broadcast(torch.zeros(1024, dtype=torch.uint8), src=0, group=group)
    return "survived the long broadcast"


def test_short_and_long_direct_buckets_are_refused_before_sending_and_control_gloo_aborts():
    world = run_world(sizes)
    world.ok(0)
    for r in (1, 2):  # the syncs' checks ran (their asserts came before the control)
        assert world.reports[r].get("short_taken") is True, world.reports[r]
        assert world.exitcodes[r] == -signal.SIGABRT, world.exitcodes  # control: the crash


# -----------------------------------------------------------------------------
# a trainer killed mid-sync, restarted; a receiver killed mid-sync


class _Dies(torch.Tensor):
    """A tensor whose data the process dies reading: the trainer SIGKILLed mid-sync."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.Tensor.copy_:
            die()
        return super().__torch_function__(func, types, args, kwargs or {})


def _recover(err: gsd.WeightSyncError, rank: int, ctx: dict[str, Any]) -> Any:
    return gsd.recover(err, group=ctx["group"], timeout=datetime.timedelta(seconds=TIMEOUT),
                       init_method=f"tcp://127.0.0.1:{ctx['ports'][1]}", rank=rank,
                       world_size=ctx["world"])


def trainer_killed(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    if rank == 0:
        dying = [(n, t.as_subclass(_Dies) if n == "layers.2.hc_ffn_fn" else t)
                 for n, t in checkpoint(2)]
        gsd.send_weights(dying, src=0, group=group, bucket_bytes=_BUCKET)
        raise AssertionError("the trainer should have died")
    stage = Stage.build(rank, checkpoint(1))
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group), "")
    failed_at = time.monotonic()
    assert err.recovery == "world", str(err)
    assert "gsd.recover" in str(err)
    assert stage.refused() == "StaleError"
    group = _recover(err, rank, ctx)
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(checkpoint(3))
    return failed_at


def restarted_trainer(rank: int, ctx: dict[str, Any]) -> Any:
    group = init_world(rank, ctx["ports"][1], ctx["world"])
    gsd.send_weights(checkpoint(3), src=0, group=group, bucket_bytes=_BUCKET)
    return "healed"


def test_a_trainer_killed_mid_sync_fails_every_receiver_and_a_restarted_one_heals_them():
    world = run_world(trainer_killed, extra=[(0, restarted_trainer)],
                      start_extra_after="killed_at")
    failed = world.ok(1, 2)
    assert world.exitcodes[0] == -signal.SIGKILL
    assert world.reports[100]["result"] == "healed", world.reports.get(100)
    killed = world.reports[0]["killed_at"]
    assert all(t > killed for t in failed.values())


class _DiesLoading:
    """Wraps a stage's loader: SIGKILL on its `n`-th call."""

    def __init__(self, model: Any, n: int) -> None:
        self.real, self.n, self.calls = model.load_weights, n, 0

    def __call__(self, pairs: Any) -> Any:
        self.calls += 1
        if self.calls == self.n:
            die()
        return self.real(pairs)


def receiver_killed(rank: int, ctx: dict[str, Any]) -> Any:
    group = ctx["group"]
    if rank == 0:
        err = _raises(lambda: gsd.send_weights(checkpoint(2), src=0, group=group,
                                               bucket_bytes=_BUCKET), "")
        failed_at = time.monotonic()
        assert err.recovery == "world", str(err)
        group = _recover(err, rank, ctx)
        gsd.send_weights(checkpoint(3), src=0, group=group, bucket_bytes=_BUCKET)
        return failed_at
    stage = Stage.build(rank, checkpoint(1))
    if rank == 2:
        stage.model.load_weights = _DiesLoading(stage.model, 3)  # type: ignore[method-assign]
    err = _raises(lambda: gsd.receive_weights(stage.model, src=0, group=group), "")
    failed_at = time.monotonic()
    assert err.recovery == "world", str(err)
    assert stage.refused() == "StaleError"
    group = _recover(err, rank, ctx)
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(checkpoint(3))
    return failed_at


def restarted_receiver(rank: int, ctx: dict[str, Any]) -> Any:
    group = init_world(rank, ctx["ports"][1], ctx["world"])
    stage = Stage.build(rank, checkpoint(1))
    gsd.receive_weights(stage.model, src=0, group=group)
    assert stage.replays(checkpoint(3))
    return "healed"


def test_a_receiver_killed_mid_sync_fails_every_other_rank_and_a_new_world_heals():
    world = run_world(receiver_killed, extra=[(2, restarted_receiver)],
                      start_extra_after="killed_at")
    failed = world.ok(0, 1)
    assert world.exitcodes[2] == -signal.SIGKILL
    assert world.reports[102]["result"] == "healed", world.reports.get(102)
    killed = world.reports[2]["killed_at"]
    assert all(t > killed for t in failed.values())
