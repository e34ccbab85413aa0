"""Weight sync over gloo: `graphsafe.distributed` side by side with raw broadcasts.

    python benchmarks/dist_sync.py [--mib 64] [--repeats 5] [--preset flash] [--json]

1. Two processes on loopback. The same bytes several ways, interleaved in each repeat:
   one `dist.broadcast` of a flat tensor (the floor), a per-tensor broadcast loop into
   the receiver's parameters (what a hand-written refit loop does, with no graphsafe;
   waited for one by one, and all posted at once with `async_op=True`),
   the same flat broadcast with the tensors packed into it and copied out of it by hand
   (the copies any staging-buffer sync makes), and `send_weights`/`receive_weights` into
   a graphsafe model: with one bucket, with buckets of a quarter of the payload (packing
   and loading overlapped with the broadcasts, the default, and not, `overlap=False`),
   and with buckets of a sixteenth.
   Each time runs from a barrier to a barrier, so it ends when the receiver has the
   data (and, for the sync, has loaded and refreshed). Every sync checks its
   completeness (the receivers' verdict on the metadata) before any data moves, and is
   fingerprinted end to end (`verify`, the default); the same syncs with `verify=False`
   give the fingerprints' cost (the ratio of the two, and seconds per GiB), in wall
   time and in the CPU time of both processes (which the wall time follows where other
   work keeps every core busy), and their fixed cost, which the bytes hide: a sync of
   64 entries of 1 KiB against the same unverified, and the CPU each side adds.
2. A trainer and two pipeline stages of DeepSeek V4 (`--preset`, flash by default): the
   stages' refresh time against their whole sync time, and the staging memory.
3. Faults, each in a world of its own (the tiny DeepSeek V4 on a trainer and two
   stages, group timeout `--fault-timeout`): the trainer SIGKILLed mid-sync, a receiver
   SIGKILLed mid-sync, a receiver refusing the sync's entries, a receiver stalled past
   the timeout in its loader. For each: the time from the fault to the verdict (the
   error) of the slowest other rank, and what each rank was told to do next.

Prints medians and ratios; `--json` prints them as JSON. The exit status is always 0.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import queue as queue_mod
import signal
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import graphsafe as gs
import graphsafe.distributed as gsd


@gs.graphsafe
class Flat(nn.Module):
    """`n` weights of [256, cols] and one derived buffer, loaded by name."""

    def __init__(self, n: int, cols: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"w{i}", nn.Parameter(torch.zeros(256, cols),
                                                          requires_grad=False))

    @gs.derive("w0_t", inputs=["w0"])
    def _w0_t(self, w0: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return w0.t().contiguous() if out is None else out.copy_(w0.t())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        own = dict(self.named_parameters())
        with torch.no_grad():
            for name, w in weights:
                own[name].data.copy_(w)
        return {name for name, _ in weights}


_SMALL_PER_REPEAT = 8
"""Small syncs (verified, then not) per repeat of figure 1: each costs milliseconds."""


def _timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> float:
    """Seconds from a barrier to a barrier around `fn`; with `cpu`, this process's CPU
    seconds in `fn` (every thread's: gloo's, the kernel's socket copies) appended."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    dist.barrier()
    return time.perf_counter() - t0


def _figure1(rank: int, mib: int, repeats: int, tensor_mib: int) -> dict[str, Any] | None:
    tensor = tensor_mib << 20  # bytes per tensor: [256, 1024 * tensor_mib] float32
    cols = 1024 * tensor_mib
    n = max(1, mib * (1 << 20) // tensor)
    g = torch.Generator().manual_seed(0)
    ck = [(f"w{i}", torch.randn(256, cols, generator=g)) for i in range(n)]
    flat = torch.cat([t.view(-1) for _, t in ck]) if rank == 0 else torch.empty(n * 256 * cols)
    model = Flat(n, cols) if rank else None
    params = dict(model.named_parameters()) if model is not None else {}
    quarter = max(tensor, n * tensor // 4)
    sixteenth = max(tensor, n * tensor // 16)

    def raw() -> None:
        dist.broadcast(flat, src=0)

    def loop() -> None:
        for name, t in ck:
            dist.broadcast(t if rank == 0 else params[name].data, src=0)

    def loop_async() -> None:
        # All posted at once, then waited for: gloo pipelines them, no copies at all.
        works = [dist.broadcast(t if rank == 0 else params[name].data, src=0, async_op=True)
                 for name, t in ck]
        for w in works:
            w.wait()

    packed = torch.empty_like(flat)
    sizes = [t.numel() for _, t in ck]

    def copies() -> None:
        # What any sync through one staging buffer must do besides the broadcast: the
        # sender packs every tensor into it, the receiver copies every tensor out of it.
        if rank == 0:
            torch.cat([t.view(-1) for _, t in ck], out=packed)
            dist.broadcast(packed, src=0)
        else:
            dist.broadcast(packed, src=0)
            with torch.no_grad():
                for (name, _), part in zip(ck, packed.split(sizes)):
                    params[name].data.copy_(part.view_as(params[name]))

    def sync(bucket: int, overlap: bool = True, direct: bool = True,
             verify: bool = True) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                gsd.send_weights(ck, src=0, bucket_bytes=bucket, overlap=overlap,
                                 direct_bytes=16 << 20 if direct else None, verify=verify)
            else:
                reports.append(gsd.receive_weights(model, src=0,  # type: ignore[arg-type]
                                                   overlap=overlap))
        return run

    reports: list[gsd.ReceiveReport] = []
    sync(256 << 20)()  # first sync: materialize the derived buffer, allocate staging
    sync(quarter)()
    # The fingerprints' fixed cost, which the bytes hide: a sync of 64 entries of 1 KiB.
    tiny = [(f"w{i}", torch.randn(256, 1, generator=g)) for i in range(64)]
    tiny_model = Flat(64, 1) if rank else None

    def small(verify: bool) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                gsd.send_weights(tiny, src=0, verify=verify)
            else:
                gsd.receive_weights(tiny_model, src=0)  # type: ignore[arg-type]
        return run

    small(True)()
    runs = {"raw": raw, "loop": loop, "loop_async": loop_async, "copies": copies,
            "one": sync(256 << 20), "one_unverified": sync(256 << 20, verify=False),
            "one_packed": sync(256 << 20, direct=False),
            "one_packed_unverified": sync(256 << 20, direct=False, verify=False),
            "quarter": sync(quarter), "quarter_unverified": sync(quarter, verify=False),
            "quarter_serial": sync(quarter, overlap=False), "sixteenth": sync(sixteenth)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    smalls = {"small": small(True), "small_unverified": small(False)}
    times.update({k: [] for k in smalls})
    cpu.update({k: [] for k in smalls})
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(_timed(run, cpu[key]))
        for _ in range(_SMALL_PER_REPEAT):
            for key, run in smalls.items():
                times[key].append(_timed(run, cpu[key]))
    box: list[Any] = [cpu]
    dist.broadcast_object_list(box, src=0)  # the sender's CPU seconds, to the receiver
    if rank == 0:
        return None
    both = {k: [a + b for a, b in zip(box[0][k], cpu[k])] for k in times}
    med = {k: statistics.median(v) for k, v in times.items()}
    # The fingerprints' cost: per repeat, the sync over the same sync unverified (the
    # two ran next to each other), then the median of those ratios.
    ratios = {k: statistics.median(a / b for a, b in zip(times[k], times[f"{k}_unverified"]))
              for k in ("one", "one_packed", "quarter")}
    # The same for the CPU time both processes spent: what the wall time follows where
    # other work keeps every core busy, and what no overlap can hide there.
    cpu_ratios = {k: statistics.median(a / b for a, b in zip(both[k], both[f"{k}_unverified"]))
                  for k in ("one", "one_packed", "quarter")}
    # Per side: the CPU a verified small sync adds to the same sync unverified, run next
    # to it (the median of the differences).
    added = {side: statistics.median(a - b for a, b in zip(got["small"], got["small_unverified"]))
             for side, got in (("sender", box[0]), ("receiver", cpu))}
    return {
        "fingerprint_fixed": {
            "entries": len(tiny), "cpu_added_s": added,
            "ratio": statistics.median(a / b for a, b in zip(times["small"],
                                                              times["small_unverified"])),
            "seconds": statistics.median(times["small"]),
            "seconds_unverified": statistics.median(times["small_unverified"])},
        "fingerprint_ratio": ratios,
        "fingerprint_cpu_ratio": cpu_ratios,
        "cpu_seconds": {k: statistics.median(v) for k, v in both.items()},
        "bytes": n * tensor, "tensors": n, "tensor_bytes": tensor, "quarter_bucket": quarter,
        "sixteenth_bucket": sixteenth,
        "seconds": med,
        "refresh_seconds": statistics.median(r.refresh_seconds for r in reports[2:]),
        "staging_bytes": gsd.staging_buffer(model).numel(),  # type: ignore[union-attr]
    }


def _figure2(rank: int, preset: str, repeats: int) -> dict[str, Any] | None:
    from graphsafe.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, random_checkpoint

    config = DeepseekV4Config.preset(preset)
    cks: list[list[tuple[str, torch.Tensor]]] = []
    box: list[Any] = [None]
    if rank == 0:
        cks = [random_checkpoint(config, seed) for seed in range(2)]
        box = [[t.numel() for _, t in cks[0]]]
    dist.broadcast_object_list(box, src=0)
    flat = torch.cat([t.view(-1) for _, t in cks[0]]) if rank == 0 else torch.empty(sum(box[0]))
    model = None if rank == 0 else DeepseekV4Model(
        DeepseekV4Config.preset(preset, pp_rank=rank - 1, pp_size=2))
    sends: list[gsd.SendReport] = []
    receives: list[gsd.ReceiveReport] = []
    sync_s: list[float] = []
    raw_s: list[float] = []
    for k in range(repeats + 1):  # the first sync materializes and allocates: not counted
        if rank == 0:
            sync_s.append(_timed(lambda k=k: sends.append(gsd.send_weights(cks[k % 2], src=0))))
        else:
            sync_s.append(_timed(lambda: receives.append(gsd.receive_weights(model, src=0))))
        raw_s.append(_timed(lambda: dist.broadcast(flat, src=0)))
    mine = None if rank == 0 else {
        "stage": rank - 1,
        "accepted": len(receives[-1].accepted),
        "seconds": statistics.median(r.seconds for r in receives[1:]),
        "refresh_seconds": statistics.median(r.refresh_seconds for r in receives[1:]),
        "refreshed": list(receives[-1].refresh.refreshed) if receives[-1].refresh else [],
        "staging_bytes": receives[-1].staging_bytes,
    }
    stages: list[Any] = [None] * 3 if rank == 0 else []
    dist.gather_object(mine, stages if rank == 0 else None, dst=0)
    if rank:
        return None
    return {
        "preset": preset, "bytes": sends[-1].bytes, "entries": sends[-1].entries,
        "buckets": sends[-1].buckets, "sync_seconds": statistics.median(sync_s[1:]),
        "raw_seconds": statistics.median(raw_s[1:]),
        "sender_staging_bytes": sends[-1].staging_bytes,
        "stages": [s for s in stages if s is not None],
    }


_FAULTS = ("trainer_killed", "receiver_killed", "receiver_refuses", "receiver_stalls")


class _Dies(torch.Tensor):
    """A tensor the process dies (SIGKILL) packing: the trainer killed mid-sync."""

    queue: Any = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.Tensor.copy_:
            _died(_Dies.queue, 0)
        return super().__torch_function__(func, types, args, kwargs or {})


def _died(results: Any, rank: int) -> None:
    results.put(("fault", rank, time.monotonic(), "SIGKILL"))
    results.close()
    results.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def _fault_child(rank: int, port: int, fault: str, timeout: float, results: Any) -> None:
    from graphsafe.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, random_checkpoint

    code = 0
    try:
        torch.set_num_threads(1)
        delta = datetime.timedelta(seconds=timeout)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=3, timeout=delta)
        group = dist.new_group(timeout=delta)
        full = DeepseekV4Config.preset("tiny")
        model = None if rank == 0 else DeepseekV4Model(
            DeepseekV4Config.preset("tiny", pp_rank=rank - 1, pp_size=2))
        expects = None
        if rank == 0:
            gsd.send_weights(random_checkpoint(full, 0), src=0, group=group, bucket_bytes=16 << 10)
        else:
            gsd.receive_weights(model, src=0, group=group)  # type: ignore[arg-type]
        dist.barrier(group=group)
        if rank == 2 and fault in ("receiver_killed", "receiver_stalls"):
            real, calls = model.load_weights, [0]  # type: ignore[union-attr]

            def loader(pairs: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3:
                    if fault == "receiver_killed":
                        _died(results, rank)
                    results.put(("fault", rank, time.monotonic(), "stalled"))
                    time.sleep(timeout + 2)
                return real(pairs)

            model.load_weights = loader  # type: ignore[union-attr, method-assign]
        if rank == 2 and fault == "receiver_refuses":
            expects = {n for n, _ in model.named_parameters()} | {"needed.by.rank2"}  # type: ignore[union-attr]
        try:
            if rank == 0:
                ck = random_checkpoint(full, 1)
                if fault == "trainer_killed":
                    _Dies.queue = results
                    ck = [(n, t.as_subclass(_Dies) if n == "layers.2.hc_ffn_fn" else t)
                          for n, t in ck]
                if fault == "receiver_refuses":
                    results.put(("fault", rank, time.monotonic(), "sync begins"))
                gsd.send_weights(ck, src=0, group=group, bucket_bytes=16 << 10)
            else:
                gsd.receive_weights(model, src=0, group=group,  # type: ignore[arg-type]
                                    expects=expects)
            results.put(("verdict", rank, time.monotonic(), "no error"))
        except gsd.WeightSyncError as exc:
            results.put(("verdict", rank, time.monotonic(), exc.recovery))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)


def _figure3(timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods()
                         else "spawn")
    out: dict[str, Any] = {"timeout": timeout, "faults": {}}
    for fault in _FAULTS:
        results = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=_fault_child, args=(r, port, fault, timeout, results))
                 for r in range(3)]
        for p in procs:
            p.start()
        events: list[tuple[str, int, float, str]] = []
        end = time.monotonic() + 120
        while time.monotonic() < end and not all(p.exitcode is not None for p in procs):
            with contextlib.suppress(queue_mod.Empty):
                events.append(results.get(timeout=0.2))
        while True:
            try:
                events.append(results.get(timeout=0.2))
            except queue_mod.Empty:
                break
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join(timeout=10)
        at = min((t for kind, _, t, _ in events if kind == "fault"), default=float("nan"))
        # The faulty rank's own verdict is not counted (the refusing sync's start is no
        # rank's fault).
        faulty = {r for kind, r, _, what in events if kind == "fault" and what != "sync begins"}
        verdicts = {r: (t - at, what) for kind, r, t, what in events
                    if kind == "verdict" and r not in faulty}
        out["faults"][fault] = {"verdicts": verdicts,
                                "slowest": max((v for v, _ in verdicts.values()),
                                               default=float("nan"))}
    return out


def _child(rank: int, world: int, port: int, figure: str, args: dict[str, Any],
           results: Any) -> None:
    code = 0
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        if figure == "1":
            out = _figure1(rank, args["mib"], args["repeats"], args["tensor_mib"])
        else:
            out = _figure2(rank, args["preset"], args["repeats"])
        if out is not None:
            results.put(out)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        results.close()
        results.join_thread()
        os._exit(code)


def _run(figure: str, world: int, args: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods()
                         else "spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(r, world, port, figure, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=900)  # type: ignore[no-any-return]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.exitcode is None:
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="payload of figure 1 (MiB)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--preset", default="flash", help="DeepSeek V4 preset of figure 2")
    parser.add_argument("--tensor-mib", default="1,16",
                        help="tensor sizes of figure 1 (MiB, comma-separated): one run each")
    parser.add_argument("--fault-timeout", type=float, default=5.0,
                        help="group timeout of figure 3's worlds (seconds)")
    parser.add_argument("--figures", default="1,2,3", help="which figures to run")
    parser.add_argument("--json", action="store_true", help="print JSON, nothing else")
    a = parser.parse_args()
    figures = a.figures.split(",")
    f1s = [_run("1", 2, {"mib": a.mib, "repeats": a.repeats, "tensor_mib": int(t)})
           for t in a.tensor_mib.split(",")] if "1" in figures else []
    f2 = _run("2", 3, {"preset": a.preset, "repeats": a.repeats}) if "2" in figures else None
    f3 = _figure3(a.fault_timeout) if "3" in figures else None
    if a.json:
        print(json.dumps({"figure1": f1s, "figure2": f2, "figure3": f3}, indent=2))
    else:
        print("\n\n".join([*(_table1(f1) for f1 in f1s), *([_table2(f2)] if f2 else []),
                            *([_table3(f3)] if f3 else [])]))


def _table1(f1: dict[str, Any]) -> str:
    s = f1["seconds"]
    mib = f1["bytes"] / 2**20
    rows = [
        f"1. gloo, 2 processes, {mib:.0f} MiB in {f1['tensors']} tensors of "
        f"{f1['tensor_bytes'] >> 20} MiB (median of barrier-to-barrier times)",
        f"   {'path':<58} {'seconds':>9} {'GiB/s':>7} {'/ raw':>7}",
    ]
    for key, what in (
        ("raw", "raw dist.broadcast of one flat tensor (the floor)"),
        ("loop", "per-tensor dist.broadcast into param.data (no graphsafe)"),
        ("loop_async", "  the same, async_op=True, all posted then waited for"),
        ("copies", "pack, one broadcast, unpack, by hand (no graphsafe)"),
        ("one", "send_weights/receive_weights, one bucket"),
        ("one_unverified", "  the same, verify=False (no fingerprints)"),
        ("one_packed", "  the same, direct_bytes=None (every tensor packed)"),
        ("one_packed_unverified", "  the same, packed, verify=False"),
        ("quarter", f"send_weights/receive_weights, {f1['quarter_bucket'] >> 20} MiB buckets"),
        ("quarter_unverified", "  the same, verify=False"),
        ("quarter_serial", "  the same, overlap=False (copies not overlapped)"),
        ("sixteenth",
         f"send_weights/receive_weights, {f1['sixteenth_bucket'] >> 20} MiB buckets"),
    ):
        rows.append(f"   {what:<58} {s[key]:>9.4f} {f1['bytes'] / s[key] / 2**30:>7.2f} "
                    f"{s[key] / s['raw']:>6.2f}x")
    best = min(s["one"], s["one_packed"], s["quarter"], s["sixteenth"])
    rows.append(f"   fastest sync / hand-written pack-broadcast-unpack: {best / s['copies']:.2f}x "
                "(the packing and unpacking copies are what separates a sync from raw)")
    gib = f1["bytes"] / 2**30
    r = f1["fingerprint_ratio"]
    rows.append(f"   fingerprints (the default against verify=False, median of per-repeat "
                f"ratios): {r['one']:.3f}x with one bucket, {r['one_packed']:.3f}x packed, "
                f"{r['quarter']:.3f}x with {f1['quarter_bucket'] >> 20} MiB buckets; "
                f"{(s['one'] - s['one_unverified']) / gib:+.3f} s/GiB with one bucket")
    c, cs = f1["fingerprint_cpu_ratio"], f1["cpu_seconds"]
    rows.append(f"   their CPU time (both processes, every thread; the same ratios): "
                f"{c['one']:.3f}x with one bucket, {c['one_packed']:.3f}x packed, "
                f"{c['quarter']:.3f}x with {f1['quarter_bucket'] >> 20} MiB buckets; "
                f"{(cs['one'] - cs['one_unverified']) / gib:+.3f} CPU s/GiB with one bucket")
    fx = f1["fingerprint_fixed"]
    rows.append(f"   their fixed cost, a sync of {fx['entries']} entries of 1 KiB: "
                f"{fx['seconds'] * 1e3:.2f} ms against {fx['seconds_unverified'] * 1e3:.2f} ms "
                f"unverified ({fx['ratio']:.2f}x); CPU added "
                f"{fx['cpu_added_s']['sender'] * 1e3:+.2f} ms on the sender, "
                f"{fx['cpu_added_s']['receiver'] * 1e3:+.2f} ms on the receiver")
    rows.append(f"   receiver refresh (one derived buffer) {f1['refresh_seconds'] * 1e3:.2f} ms; "
                f"staging {f1['staging_bytes'] / 2**20:.1f} MiB (the one-bucket sync's; "
                "the smaller buckets' two slots fit in it)")
    return "\n".join(rows)


def _table2(f2: dict[str, Any]) -> str:
    rows = [
        f"2. DeepSeek V4 {f2['preset']}: trainer + 2 pipeline stages, {f2['entries']} entries, "
        f"{f2['bytes'] / 2**20:.1f} MiB, {f2['buckets']} bucket(s) of at most 256 MiB",
        f"   sync {f2['sync_seconds']:.4f} s vs raw flat broadcast {f2['raw_seconds']:.4f} s "
        f"({f2['sync_seconds'] / f2['raw_seconds']:.2f}x); sender staging "
        f"{f2['sender_staging_bytes'] / 2**20:.1f} MiB",
        f"   {'stage':>5} {'entries':>8} {'sync s':>9} {'refresh s':>10} {'refresh/sync':>13} "
        f"{'staging MiB':>12}  refreshed",
    ]
    for st in f2["stages"]:
        rows.append(
            f"   {st['stage']:>5} {st['accepted']:>8} {st['seconds']:>9.4f} "
            f"{st['refresh_seconds']:>10.5f} {st['refresh_seconds'] / st['seconds']:>12.2%} "
            f"{st['staging_bytes'] / 2**20:>12.1f}  {', '.join(st['refreshed']) or '-'}"
        )
    return "\n".join(rows)



def _table3(f3: dict[str, Any]) -> str:
    rows = [
        f"3. faults: tiny DeepSeek V4, trainer + 2 stages, group timeout {f3['timeout']:.0f} s; "
        "time from the fault to each other rank's error",
        f"   {'fault':<18} {'slowest s':>10}  per rank (seconds, recovery it names)",
    ]
    for fault, got in f3["faults"].items():
        per = ", ".join(f"rank {r}: {t:.3f} {what}" for r, (t, what) in sorted(
            got["verdicts"].items()))
        rows.append(f"   {fault:<18} {got['slowest']:>10.3f}  {per}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
