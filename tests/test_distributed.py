"""Weight sync over torch.distributed: `graphsafe.distributed` and `verify --pp`.

One world of three processes on loopback with gloo (rank 0 the trainer, ranks 1 and 2
two pipeline stages of DeepSeek V4) runs every scenario in order, each with its checks
made where they happen (in the processes); each test below reads its scenario's
outcome. The last scenario kills the sender, so the world ends there. Every process
ends: collectives have a timeout of a few seconds and the fixture kills what is left.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import queue as queue_mod
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import graphsafe as gs
import graphsafe.distributed as gsd
from graphsafe._verify import VerifyReport, run_verify_pp
from graphsafe._verify.pp.processes import free_port as _free_port
from graphsafe.cli import main
from graphsafe.models.deepseek_v4 import (
    DeepseekV4Config,
    DeepseekV4Model,
    fold_streams,
    random_checkpoint,
    verify_target,
)

_TIMEOUT = 15.0  # seconds a collective may wait
_HEALTHY_TIMEOUT = 60.0  # the same, in a run where no rank fails: never waited out there,
# so it only keeps a machine busy with other work from failing the run
_DEADLINE = 240.0  # seconds the whole world may take before the fixture kills it
_BUCKET = 16 << 10  # smaller than hc_attn_fn [24, 256] fp32 (24 KiB) and others
_WORLD = 3
_DIES = 17  # exit code of the sender that dies


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "graphsafe.distributed", "graphsafe.models.deepseek_v4"])
    return ctx



# -----------------------------------------------------------------------------
# what the processes share


def _stage_config(rank: int) -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", pp_rank=rank - 1, pp_size=2)


def _checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    return random_checkpoint(DeepseekV4Config(), seed)


def _forward(model: DeepseekV4Model, rank: int) -> Callable[[], torch.Tensor]:
    """The stage's forward on static inputs (token ids on stage 0, streams on stage 1)."""
    if rank == 1:
        ids = torch.arange(8)
        return lambda: model(ids)
    streams = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(0))
    return lambda: model(hidden_states=streams)


def _reference(rank: int, ck: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The stage's output with `ck` loaded into a fresh model."""
    model = DeepseekV4Model(_stage_config(rank))
    model.load_weights(ck)
    return _forward(model, rank)()


CALLS = [0]  # calls of Small's derivation in this process


@gs.graphsafe
class Small(nn.Module):
    """A model with parameters of several dtypes and one derivation reading two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(40, 30), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(30), requires_grad=False)
        self.h = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    @gs.derive("scaled", inputs=["a", "b"])
    def _scaled(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None
                ) -> torch.Tensor:
        CALLS[0] += 1
        return torch.mul(a, b, out=out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded = set()
        with torch.no_grad():
            for name, w in weights:
                if name not in own or own[name].shape != w.shape:
                    raise gs.WeightLoadError(f"cannot load {name!r}", name=name)
                own[name].data.copy_(w)
                loaded.add(name)
        return loaded


def _small_checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    """In this order, with 256-byte buckets: [b, h], [a] (larger than a bucket), [steps].

    `a` is a transposed view that requires grad, as a trainer's parameter may be.
    """
    g = torch.Generator().manual_seed(seed)
    return [
        ("b", torch.randn(30, generator=g)),
        ("h", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("a", torch.randn(30, 40, generator=g).t().requires_grad_()),
        ("steps", torch.randint(100, (3,), generator=g)),
    ]


class _Dies(torch.Tensor):
    """A tensor whose data the process dies reading: a sender killed mid-sync."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.Tensor.copy_:
            _QUEUE[0].close()
            _QUEUE[0].join_thread()  # what this rank reported so far reaches the parent
            os._exit(_DIES)
        return super().__torch_function__(func, types, args, kwargs or {})


_QUEUE: list[Any] = [None]


# -----------------------------------------------------------------------------
# the scenarios, run in order on every rank; `ctx` carries state between them


def pp_round_trip(rank: int, ctx: dict[str, Any]) -> None:
    group = ctx["group"]
    if rank == 0:
        ck = _checkpoint(1)
        first = gsd.send_weights(ck, src=0, group=group, bucket_bytes=_BUCKET)
        assert first.entries == len(ck) == 66 and first.receivers == 2
        assert first.bytes == sum(t.numel() * 4 for _, t in ck)
        assert first.buckets > 3
        assert first.largest_bucket == max(t.numel() * 4 for _, t in ck) > _BUCKET  # alone
        ptr = gsd.staging_buffer(group=group).data_ptr()
        second = gsd.send_weights(_checkpoint(2), src=0, group=group, bucket_bytes=_BUCKET)
        assert gsd.staging_buffer(group=group).data_ptr() == ptr
        assert second.sync != first.sync
        return
    model = DeepseekV4Model(_stage_config(rank))
    ck = dict(_checkpoint(1))
    first = gsd.receive_weights(model, src=0, group=group)
    params = dict(model.named_parameters())
    assert set(first.accepted) == set(params)  # this stage's entries and no others
    assert first.entries == 66 and first.rejected == () and first.failed_ranks == ()
    for name, p in params.items():
        assert torch.equal(p, ck[name]), name
    assert not first.staging_reused
    if rank == 1:
        assert first.refresh is not None
        assert first.refresh.materialized == ("layers.0.hc_attn_fn_broadcast",)
    call = _forward(model, rank)
    graph = gs.Graph(backend="cpu", guard=model)
    with graph.capture(warmup=call):
        out = call()
    ptr = gsd.staging_buffer(model, group=group).data_ptr()

    second = gsd.receive_weights(model, src=0, group=group)
    assert second.staging_reused and second.staging_bytes == first.staging_bytes
    assert gsd.staging_buffer(model, group=group).data_ptr() == ptr
    assert second.sync != first.sync
    if rank == 1:  # one refresh for the whole sync, in place
        assert second.refresh is not None
        assert second.refresh.refreshed == ("layers.0.hc_attn_fn_broadcast",)
        assert second.refresh.ran == 1
        new = dict(_checkpoint(2))["layers.0.hc_attn_fn"]
        assert torch.equal(model.layers["0"].hc_attn_fn_broadcast, fold_streams(new, 4, 64))
    graph.replay()
    assert torch.equal(out, call())  # the replay reads the new weights
    ctx.update(model=model, graph=graph, out=out, call=call)


def small_model(rank: int, ctx: dict[str, Any]) -> None:
    group = ctx["group"]
    if rank == 0:
        for seed in (1, 2):
            report = gsd.send_weights(_small_checkpoint(seed), src=0, group=group,
                                      bucket_bytes=256)
            assert report.buckets == 3 and report.largest_bucket == 40 * 30 * 4
            assert report.overlap
        for overlap in (False, True):  # each side chooses: the bytes on the wire are the same
            report = gsd.send_weights(_small_checkpoint(4), src=0, group=group,
                                      bucket_bytes=256, overlap=overlap)
            assert report.overlap == overlap
        return
    model = Small()
    for seed in (1, 2):
        calls = CALLS[0]
        report = gsd.receive_weights(model, src=0, group=group)
        assert CALLS[0] == calls + 1  # a and b came in different buckets: one refresh
        ck = dict(_small_checkpoint(seed))
        for name, t in ck.items():
            have = getattr(model, name)
            assert have.dtype == t.dtype and torch.equal(have, t), name
        assert torch.equal(model.scaled, ck["a"] * ck["b"])
        assert sorted(report.accepted) == ["a", "b", "h", "steps"]
        assert report.buckets == 3 and report.bytes == 120 + 14 + 4800 + 24
    for overlap in (True, False):
        fresh = Small()
        report = gsd.receive_weights(fresh, src=0, group=group, overlap=overlap)
        assert report.overlap == overlap and not report.staging_reused
        # Wires of the buckets [b, h], [a], [steps]: 224, 4832 and 96 bytes, 256, 4864
        # and 128 aligned. Overlapped, staging holds what fits in two of the largest: here
        # all three at once; otherwise the largest alone.
        assert report.staging_bytes == (256 + 4864 + 128 if overlap else 4864)
        for name, t in _small_checkpoint(4):
            assert torch.equal(getattr(fresh, name), t), name
        assert torch.equal(fresh.scaled, fresh.a * fresh.b)
    # Control: the same buckets loaded one call each, without the sync's update block,
    # refresh after every bucket, and the first refresh reads half-updated inputs.
    old = dict(_small_checkpoint(2))
    ck = _small_checkpoint(3)
    calls = CALLS[0]
    model.load_weights(ck[:2])  # b and h
    assert torch.equal(model.scaled, old["a"] * dict(ck)["b"])  # new b, old a
    model.load_weights(ck[2:3])
    model.load_weights(ck[3:])
    assert CALLS[0] == calls + 2


def naive_broadcast_control(rank: int, ctx: dict[str, Any]) -> None:
    """`dist.broadcast(param.data)` without graphsafe: the guard cannot see the write,
    so the replay silently reads a stale derived buffer, until `gs.mark_written`."""
    group = ctx["group"]
    ck = _checkpoint(3)
    if rank == 0:
        for _, t in ck:
            dist.broadcast(t, src=0, group=group)
        return
    model, graph, out, call = ctx["model"], ctx["graph"], ctx["out"], ctx["call"]
    params = dict(model.named_parameters())
    was = gs.observe_writes(False)  # the guard without the process-wide observer
    try:
        for name, t in ck:
            dist.broadcast(params[name].data if name in params else torch.empty_like(t), src=0,
                           group=group)
    finally:
        gs.observe_writes(was)
    for name, p in params.items():
        assert torch.equal(p, dict(ck)[name])
    if rank == 2:
        assert gs.runtime(model).derivations == ()  # nothing derived on this stage
        return
    new = dict(ck)["layers.0.hc_attn_fn"]
    assert not torch.equal(model.layers["0"].hc_attn_fn_broadcast, fold_streams(new, 4, 64))
    reference = _reference(rank, ck)
    graph.replay()  # not refused: nothing recorded the write
    assert not torch.equal(out, reference)  # the stale read (eager reads it too)
    gs.mark_written(*params.values())
    with pytest.raises(gs.StaleError, match="hc_attn_fn_broadcast"):
        graph.replay()
    gs.runtime(model).refresh_stale()
    graph.replay()
    assert torch.equal(out, reference) and torch.equal(call(), reference)


def sender_raises(rank: int, ctx: dict[str, Any]) -> None:
    group = ctx["group"]
    ck = _checkpoint(5)
    bad = "layers.2.hc_attn_fn"
    if rank == 0:
        broken = [(n, torch.empty(t.shape, device="meta") if n == bad else t) for n, t in ck]
        # Its fingerprint, taken before packing, is the first read of it that fails.
        with pytest.raises(TypeError, match=f"cannot fingerprint {bad!r}: a meta tensor"):
            gsd.send_weights(broken, src=0, group=group, bucket_bytes=_BUCKET)
        gsd.send_weights(_checkpoint(6), src=0, group=group, bucket_bytes=_BUCKET)
        return
    model, graph, out, call = ctx["model"], ctx["graph"], ctx["out"], ctx["call"]
    with pytest.raises(gsd.WeightSyncError,
                       match=r"aborted the sync at bucket \d+ of \d+") as caught:
        gsd.receive_weights(model, src=0, group=group)
    assert f"while packing entry {bad!r}" in str(caught.value)
    assert "TypeError: cannot fingerprint" in str(caught.value)
    assert caught.value.bucket is not None and caught.value.bucket > 0
    params = dict(model.named_parameters())
    new = dict(ck)
    if rank == 1:  # its entries came before the failure: new weights, stale derived buffer
        assert all(torch.equal(p, new[n]) for n, p in params.items())
        assert not torch.equal(model.layers["0"].hc_attn_fn_broadcast,
                               fold_streams(new["layers.0.hc_attn_fn"], 4, 64))
    else:  # the entries before the failure are new, the rest old
        assert torch.equal(params["hc_head_fn"], new["hc_head_fn"])
        assert not torch.equal(params["head.weight"], new["head.weight"])
    with pytest.raises(gs.StaleError, match="failed"):
        graph.replay()  # fail closed
    gsd.receive_weights(model, src=0, group=group)  # a complete sync heals
    graph.replay()
    assert torch.equal(out, call())


def rejection(rank: int, ctx: dict[str, Any]) -> None:
    """Stage 0's loader refuses an entry of the wrong shape: it is named, the rest of
    the sync still loads there, and every receiver (stage 1 too, which loaded all of its
    entries) fails closed, as the sender is told."""
    group = ctx["group"]
    ck = _checkpoint(7)
    bad = "layers.0.hc_attn_fn"
    wrong = [(n, torch.zeros(24, 255) if n == bad else t) for n, t in ck]
    if rank == 0:
        with pytest.raises(gsd.WeightSyncError,
                           match=r"receiver rank\(s\) 1 did not apply the sync") as caught:
            gsd.send_weights(wrong, src=0, group=group, bucket_bytes=_BUCKET)
        assert caught.value.failed_ranks == (1,) and caught.value.recovery == "resend"
        gsd.send_weights(_checkpoint(8), src=0, group=group, bucket_bytes=_BUCKET)
        return
    model, graph, out, call = ctx["model"], ctx["graph"], ctx["out"], ctx["call"]
    params = dict(model.named_parameters())
    if rank == 1:
        with pytest.raises(gsd.WeightSyncError,
                           match=r"rank 1: the loader of DeepseekV4Model rejected 1 entry"
                           ) as caught:
            gsd.receive_weights(model, src=0, group=group)
        assert [r.name for r in caught.value.rejected] == [bad]
        assert "wrong shape" in str(caught.value)
        report = caught.value.report
        assert isinstance(report, gsd.ReceiveReport)
        assert set(report.accepted) == set(params) - {bad}  # collected: the rest was loaded
        # Control: the model really is half-applied, so a replay would mix old and new.
        assert torch.equal(params["layers.0.attn_norm.weight"],
                           dict(ck)["layers.0.attn_norm.weight"])
        assert not torch.equal(params[bad], dict(ck)[bad])
    else:  # every entry of this stage loaded, but the sync did not land everywhere
        with pytest.raises(gsd.WeightSyncError,
                           match=r"rank 2: receiver rank\(s\) 1 did not apply the sync"):
            gsd.receive_weights(model, src=0, group=group)
        assert all(torch.equal(p, dict(ck)[n]) for n, p in params.items())
    with pytest.raises(gs.StaleError, match="failed"):
        graph.replay()
    gsd.receive_weights(model, src=0, group=group)
    graph.replay()
    assert torch.equal(out, call())


def direct_round_trip(rank: int, ctx: dict[str, Any]) -> None:
    """Entries of 8 KiB and more go as they are (no packing copy), the rest packed: the
    stages load exactly what they hold and the replay reads it. Control: the same sync
    with `direct_bytes=None` packs every entry, with the same result."""
    group = ctx["group"]
    cks = {seed: _checkpoint(seed) for seed in (10, 11)}
    if rank == 0:
        first = gsd.send_weights(cks[10], src=0, group=group, bucket_bytes=_BUCKET,
                                 direct_bytes=8 << 10)
        assert 3 < first.direct_buckets < first.buckets
        second = gsd.send_weights(cks[11], src=0, group=group, bucket_bytes=_BUCKET,
                                  direct_bytes=None)
        assert second.direct_buckets == 0
        return
    model, graph, out, call = ctx["model"], ctx["graph"], ctx["out"], ctx["call"]
    params = dict(model.named_parameters())
    for seed, direct in ((10, True), (11, False)):
        report = gsd.receive_weights(model, src=0, group=group)
        assert (report.direct_buckets > 3) == direct
        new = dict(cks[seed])
        assert all(torch.equal(p, new[n]) for n, p in params.items())
        graph.replay()
        assert torch.equal(out, call()) and torch.equal(out, _reference(rank, cks[seed]))


class _Interrupted(BaseException):
    """Stands for a KeyboardInterrupt on the trainer in the middle of a sync."""


def direct_abort(rank: int, ctx: dict[str, Any]) -> None:
    """The sender stops in a run of direct buckets (nothing is packed there, so no
    trailer follows at once): it sends zeros for the direct buckets the receivers wait
    for and the abort in the next trailer. The receivers raise naming it, fail closed,
    and the next complete sync heals them."""
    group = ctx["group"]
    from graphsafe.distributed import _sender

    if rank == 0:
        real, calls = _sender._wire_of, [0]

        def interrupted(t: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 3:
                raise _Interrupted("stopped by the operator")
            return real(t)

        _sender._wire_of = interrupted  # type: ignore[assignment]
        try:
            with pytest.raises(_Interrupted):
                gsd.send_weights(_checkpoint(12), src=0, group=group, bucket_bytes=_BUCKET,
                                 direct_bytes=8 << 10)
        finally:
            _sender._wire_of = real  # type: ignore[assignment]
        gsd.send_weights(_checkpoint(13), src=0, group=group, bucket_bytes=_BUCKET,
                         direct_bytes=8 << 10)
        return
    model, graph, out, call = ctx["model"], ctx["graph"], ctx["out"], ctx["call"]
    with pytest.raises(gsd.WeightSyncError,
                       match=r"aborted the sync at bucket \d+ of \d+") as caught:
        gsd.receive_weights(model, src=0, group=group)
    assert "_Interrupted: stopped by the operator" in str(caught.value)
    with pytest.raises(gs.StaleError, match="failed"):
        graph.replay()  # fail closed
    gsd.receive_weights(model, src=0, group=group)  # a complete sync heals
    params, new = dict(model.named_parameters()), dict(_checkpoint(13))
    assert all(torch.equal(p, new[n]) for n, p in params.items())
    graph.replay()
    assert torch.equal(out, call())


def dead_sender(rank: int, ctx: dict[str, Any]) -> None:
    """The sender dies (os._exit) while packing a bucket: the receivers raise at once
    (the store rank 0 served is gone, or the bucket's broadcast fails), say that a new
    world is needed, and fail closed. The world ends here."""
    group = ctx["group"]
    ck = _checkpoint(9)
    if rank == 0:
        dying = [(n, t.as_subclass(_Dies) if n == "layers.2.hc_ffn_fn" else t) for n, t in ck]
        gsd.send_weights(dying, src=0, group=group, bucket_bytes=_BUCKET)
        raise AssertionError("the sender should have died")
    graph = ctx["graph"]
    with pytest.raises(gsd.WeightSyncError,
                       match=r"bucket \d+ of \d+ did not arrive from rank 0|the store of the "
                       r"default group is gone") as caught:
        gsd.receive_weights(ctx["model"], src=0, group=group)
    assert caught.value.recovery == "world"  # rank 0 served the store: a new world heals
    with pytest.raises(gs.StaleError, match="failed"):
        graph.replay()


_SCENARIOS = (pp_round_trip, small_model, naive_broadcast_control, sender_raises, rejection,
              direct_round_trip, direct_abort, dead_sender)


def _child(rank: int, port: int, results: Any) -> None:
    _QUEUE[0] = results
    code = 0
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        timeout = datetime.timedelta(seconds=_TIMEOUT)
        dist.init_process_group("gloo", rank=rank, world_size=_WORLD, timeout=timeout)
        ctx: dict[str, Any] = {"group": dist.new_group(timeout=timeout)}
        for scenario in _SCENARIOS:
            try:
                scenario(rank, ctx)
                results.put((rank, scenario.__name__, None))
            except BaseException:
                results.put((rank, scenario.__name__, traceback.format_exc()))
    except BaseException:
        results.put((rank, "setup", traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)


@dataclass
class World:
    outcomes: dict[str, dict[int, str | None]]
    exitcodes: list[int | None]

    def check(self, scenario: str) -> None:
        seen = self.outcomes.get(scenario, {})
        problems = [f"rank {r}:\n{seen[r]}" for r in sorted(seen) if seen[r] is not None]
        for rank in range(_WORLD):
            if rank not in seen and not (scenario == "dead_sender" and rank == 0):
                setup = self.outcomes.get("setup", {}).get(rank)
                problems.append(f"rank {rank} never reported (exit code "
                                f"{self.exitcodes[rank]}){setup or ''}")
        if problems:
            pytest.fail(f"{scenario}:\n" + "\n".join(problems), pytrace=False)


@pytest.fixture(scope="module")
def world() -> World:
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(rank, port, results), daemon=True)
             for rank in range(_WORLD)]
    for p in procs:
        p.start()
    outcomes: dict[str, dict[int, str | None]] = {}
    deadline = time.monotonic() + _DEADLINE
    while time.monotonic() < deadline:
        try:
            rank, name, error = results.get(timeout=0.2)
            outcomes.setdefault(name, {})[rank] = error
        except queue_mod.Empty:
            if all(p.exitcode is not None for p in procs):
                break
    for p in procs:  # whatever is left after the deadline
        if p.exitcode is None:
            p.kill()
        p.join(timeout=10)
    return World(outcomes, [p.exitcode for p in procs])


# -----------------------------------------------------------------------------
# the tests


def test_round_trip_to_pipeline_stages_loads_what_each_holds_and_reuses_staging(world):
    world.check("pp_round_trip")


def test_small_model_of_several_dtypes_refreshes_once_per_sync_and_control_per_bucket(world):
    world.check("small_model")


def test_control_naive_broadcast_into_param_data_replays_stale_until_marked_written(world):
    world.check("naive_broadcast_control")


def test_sender_that_raises_makes_receivers_raise_and_fail_closed_until_a_complete_sync(world):
    world.check("sender_raises")


def test_loader_rejections_are_named_collected_and_fail_closed_and_the_sender_knows(world):
    world.check("rejection")


def test_direct_entries_go_without_the_packing_copy_and_control_packed(world):
    world.check("direct_round_trip")


def test_sender_stopped_in_a_run_of_direct_entries_makes_receivers_raise_and_fail_closed(world):
    world.check("direct_abort")


def test_sender_that_dies_makes_receivers_raise_and_every_process_ends(world):
    world.check("dead_sender")
    assert world.exitcodes == [_DIES, 0, 0]


def test_sync_without_a_process_group_says_so():
    assert not dist.is_initialized()
    with pytest.raises(gsd.WeightSyncError, match="needs an initialized process group"):
        gsd.send_weights([("w", torch.zeros(2))], src=0)
    with pytest.raises(gsd.WeightSyncError, match="needs an initialized process group"):
        gsd.receive_weights(nn.Linear(2, 2), src=0)


def test_verify_pp_two_stages_is_exact_and_catches_the_naive_control(capsys):
    assert main(["verify", "--pp", "2", "--refits", "2", "--json", "--backend", "cpu",
                 "--timeout", str(_HEALTHY_TIMEOUT)]) == 0
    captured = capsys.readouterr()
    report = VerifyReport.model_validate(json.loads(captured.out))
    assert report.ok and report.pp == 2 and report.backend == "cpu"
    assert [r.verdict for r in report.refits] == ["exact", "exact"]
    assert all(r.max_abs_diff <= report.tolerance and r.weights_effect > 0
               for r in report.refits)
    assert all(r.refreshed == ("layers.0.hc_attn_fn_broadcast",) for r in report.refits)
    assert all(r.storage_held and r.buckets > 1 for r in report.refits)
    assert [(s.refit, s.stage, s.layers) for s in report.syncs] == [
        (1, 0, "0-1"), (1, 1, "2-3"), (2, 0, "0-1"), (2, 1, "2-3")]
    assert sum(s.accepted for s in report.syncs[:2]) == 66  # every entry, on one stage
    assert report.control.stale_read and report.control.caught
    assert "stage 0: StorageMovedError" in (report.control.guard_error or "")
    for name in ("first sync", "capture (cpu graph)", "refit 1/2", "control"):
        assert any(name in line and "done in" in line for line in captured.err.splitlines())


def test_verify_pp_refuses_more_stages_than_layers_before_starting_processes(capsys):
    assert main(["verify", "--pp", "5", "--backend", "cpu"]) == 1  # the tiny model has 4
    err = capsys.readouterr().err
    assert "cannot have 5 stages" in err and "num_layers (4) < pp_size (5)" in err
    assert multiprocessing.active_children() == []
    assert main(["verify", "--pp", "0"]) == 2


@dataclass(frozen=True)
class BrokenStageTarget:
    """DeepSeek V4, except that stage 1 cannot be built."""

    name: str = "broken"
    presets: tuple[str, ...] = ("tiny",)
    critical: tuple[str, ...] = ("hc_attn_fn",)

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        return verify_target.build(preset, naive, device)

    def build_stage(self, preset: str, naive: bool, device: torch.device, *, pp_rank: int,
                    pp_size: int) -> nn.Module:
        if pp_rank == 1:
            raise RuntimeError("stage 1 cannot be built")
        with torch.device(device):
            return DeepseekV4Model(DeepseekV4Config.preset(preset, pp_rank=pp_rank,
                                                           pp_size=pp_size))

    def checkpoint(self, model: nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
        return verify_target.checkpoint(model, seed)

    def example_input(self, model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
        return verify_target.example_input(model, seed)


def test_verify_pp_a_stage_that_fails_ends_every_process_and_names_the_error():
    with pytest.raises(gs.GraphSafetyError, match="ended without a report") as caught:
        run_verify_pp(BrokenStageTarget(), pp=2, refits=1, backend="cpu", timeout=_TIMEOUT)
    assert "rank 2" in str(caught.value) and "stage 1 cannot be built" in str(caught.value)
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verify_pp_two_stages_with_cuda_graphs(capsys):
    assert main(["verify", "--pp", "2", "--refits", "2", "--json", "--backend", "cuda"]) == 0
    report = VerifyReport.model_validate(json.loads(capsys.readouterr().out))
    assert report.ok and report.backend == "cuda" and report.pp == 2
    assert report.control.caught and report.control.stale_read
