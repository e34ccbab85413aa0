"""The seven figures: each measures graphsafe and its baseline side by side.

Every `figN(ctx)` returns `Row`s; `run.py` prints them. Sizes come from `Sizes` (full or
quick). A figure that cannot run raises: `run.py` prints it as SKIP, its traceback on
stderr, and exits 1. Some cases read graphsafe internals (the engine, its witnesses, the
ledger's flat check); when one moves, its ImportError or AttributeError says which.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_models import fold_stack_class, llm_stack_class, untracked_load
from harness import (
    Clock,
    Row,
    fmt_bytes,
    gbps,
    interleave,
    paired,
    paired_diff,
    peak_extra_bytes,
    profile_per_item,
    why,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphsafe as gs
from graphsafe import _native
from graphsafe._memory.snapshot import Witnesses
from graphsafe._runtime.writes.observer import OBSERVER
from graphsafe._runtime.writes.tracking import storage_key, write_tracker
from graphsafe.models import deepseek_v4 as dsv4

__all__ = ["FIGURES", "Ctx", "Sizes"]

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes and repeats; `Sizes.full()` for the figures, `Sizes.quick()` to smoke."""

    repeats: int
    fig1_input_bytes: int  # the mHC sum's input; output is a quarter of it (n = 4)
    fig2_counts: tuple[int, int]  # small derivations: two model sizes
    fig3_count: int  # large derivations, 8 buckets
    fig3_rows: int  # rows of each, C = 1024, n = 4: rows * 16 KiB of input
    fig4_layers: int
    fig4_hidden: int
    fig4_inter: int
    fig4_small_layers: int  # blocks of hidden 32: 7 parameters of ~3 KiB each
    fig5_tensors: int  # tensors under the ledger
    fig5_replays: int  # replays per sample
    fig5_inputs: int  # small derivations under a guard (one input each)
    fig6_rows: tuple[int, ...]  # rows of each layer, C = 1024, n = 4
    fig7_preset: str
    fig13_bytes: int  # the tensor gs.fingerprint reads (and a clone copies)
    smoke: bool = False  # `quick()`'s sizes: their numbers mean nothing

    def with_repeats(self, repeats: int | None) -> Sizes:
        """The same sizes with `repeats` samples per case (None: unchanged)."""
        return self if repeats is None else dataclasses.replace(self, repeats=repeats)

    @classmethod
    def full(cls) -> Sizes:
        return cls(
            repeats=21,
            fig1_input_bytes=64 * MiB,
            fig2_counts=(2000, 10_000),
            fig3_count=64,
            fig3_rows=64,
            fig4_layers=4,
            fig4_hidden=1024,
            fig4_inter=2816,
            fig4_small_layers=300,
            fig5_tensors=10_000,
            fig5_replays=5,
            fig5_inputs=2000,
            fig6_rows=(16, 64, 256, 32),
            fig7_preset="flash",
            fig13_bytes=64 * MiB,
        )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            repeats=3,
            fig1_input_bytes=4 * MiB,
            fig2_counts=(100, 300),
            fig3_count=16,
            fig3_rows=4,
            fig4_layers=1,
            fig4_hidden=256,
            fig4_inter=512,
            fig4_small_layers=30,
            fig5_tensors=1000,
            fig5_replays=1,
            fig5_inputs=100,
            fig6_rows=(4, 16, 8),
            fig7_preset="tiny",
            fig13_bytes=4 * MiB,
            smoke=True,
        )


@dataclasses.dataclass
class Ctx:
    """What every figure gets: device, clock, sizes, and whether to print profiles.

    `rows` maps a figure to the rows asked of it (`--only 4c,5`: {"4": {"4c"}}); a figure
    not in it runs whole. `failed` collects the rows that raised (see `attempt`).
    """

    device: torch.device
    sizes: Sizes
    profile: bool = False
    rows: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    clock: Clock = dataclasses.field(init=False)
    cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    profiles: list[str] = dataclasses.field(default_factory=list)
    failed: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.clock = Clock(self.device)

    def timer(self, fn: Callable[[], Any], number: int = 1) -> Callable[[], float]:
        """A case for `interleave`: the synchronized time of `fn`."""
        return lambda: self.clock.time(fn, number)

    def drop_shared(self) -> None:
        """Drop the models figures keep for later ones (`cache`; a later figure builds them
        again): what a figure measures beside them is then its own."""
        self.cache.clear()
        gc.collect()

    def wants(self, row: str) -> bool:
        """Whether row `row` ("4c") was asked for; a figure's own id ("8") always is."""
        figure = row.rstrip("abcdefghijklmnopqrstuvwxyz")
        asked = self.rows.get(figure)
        return asked is None or row == figure or row in asked

    def attempt(self, row: str, name: str, measure: Callable[[], Row | list[Row]]) -> list[Row]:
        """Row `row` if it was asked for: `measure()`, or, if that raises, a SKIP row
        saying why (the traceback on stderr, the run's exit status 1), so that one
        broken row hides none of its figure's others."""
        if not self.wants(row):
            return []
        try:
            got = measure()
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            self.failed.append(row)
            return [Row(row, name, skipped=why(exc))]
        return got if isinstance(got, list) else [got]


# -----------------------------------------------------------------------------
# 1. large derivations


def fig1(ctx: Ctx) -> list[Row]:
    """One mHC sum over a large input: refresh vs the copy bound and vs compute-then-copy."""
    n, C = 4, 4096
    rows = ctx.sizes.fig1_input_bytes // (n * C * 4)
    reg = gs.Registry()
    with torch.device(ctx.device):
        model = fold_stack_class(reg, n, C)([rows])
    rt = gs.runtime(model, reg)
    rt.refresh()  # materialize
    layer = model.layers[0]
    w, buf = layer.w, layer.w_folded
    read, written = w.nbytes, buf.nbytes
    # The bound: a plain copy moving the same traffic, (read + written) / 2 each way.
    half = (read + written) // 2 // 4
    src = torch.randn(half, device=ctx.device)
    dst = torch.empty_like(src)

    def compute_then_copy() -> None:
        buf.copy_(torch.sum(w.view(-1, n, C), dim=1))

    stats = interleave(
        {
            "refresh": ctx.timer(rt.refresh),
            "copy_bound": ctx.timer(lambda: dst.copy_(src)),
            "compute_then_copy": ctx.timer(compute_then_copy),
            # The kernel alone, called by hand with out=: what refresh costs without graphsafe.
            "kernel_out": ctx.timer(lambda: torch.sum(w.view(-1, n, C), dim=1, out=buf)),
        },
        ctx.sizes.repeats,
    )
    r, bound, hand = stats["refresh"], stats["copy_bound"], stats["compute_then_copy"]
    kernel = stats["kernel_out"]
    traffic = read + written
    shape = (
        f"sum over n of [{rows}, {n}, {C}] f32: read {fmt_bytes(read)}, "
        f"write {fmt_bytes(written)}"
    )
    return [
        Row(
            "1a", "large derivation vs copy bound", r.median, bound.median,
            baseline_name=f"copy_ {fmt_bytes(half * 4)} -> same",
            ratio=paired(bound, r), ratio_def="bound / refresh", op=">=", target=0.8,
            details={
                "shape": shape,
                "refresh_bandwidth": gbps(traffic, r.median),
                "copy_bandwidth": gbps(traffic, bound.median),
                "kernel_alone_s": kernel.median,
                "kernel_bound_ratio": round(bound.median / kernel.median, 3),
                "spread": [round(r.spread, 3), round(bound.spread, 3)],
            },
        ),
        Row(
            "1b", "large derivation vs compute-then-copy", r.median, hand.median,
            baseline_name="buf.copy_(fn(w))",
            ratio=paired(r, hand), ratio_def="refresh / hand", op="<=", target=0.8,
            details={"shape": shape, "spread": [round(r.spread, 3), round(hand.spread, 3)]},
        ),
    ]


# -----------------------------------------------------------------------------
# 2. many small derivations (and the model shared with figure 3)


def _many_small(ctx: Ctx, count: int) -> tuple[nn.Module, gs.Runtime, float, float]:
    """`count` layers, 4 KiB in, 1 KiB out, loaded; built once per count (shared with 3).

    Returns:
        The model, its runtime, and the seconds its first load spent binding (resolving
        the derivations on the module tree) and materializing (allocating the buffers).
    """
    key = f"many_small_{count}"
    if key not in ctx.cache:
        reg = gs.Registry()
        with torch.device(ctx.device):
            model = fold_stack_class(reg, 4, 64)([4] * count)
        rt = gs.runtime(model, reg)
        start = time.perf_counter()
        _ = rt.derivations  # binds
        bound = time.perf_counter()
        rt.refresh()  # materializes
        ctx.clock.sync()
        ctx.cache[key] = (model, rt, bound - start, time.perf_counter() - bound)
    return ctx.cache[key]  # type: ignore[no-any-return]


def fig2(ctx: Ctx) -> list[Row]:
    """Thousands of small derivations: full refresh vs a hand-written Python loop."""
    rows: list[Row] = []
    firsts: list[tuple[int, float, float]] = []
    for fig, count in zip("ab", ctx.sizes.fig2_counts):
        model, rt, bind, materialize = _many_small(ctx, count)
        firsts.append((count, bind, materialize))
        layers = model.layers

        def hand_loop(layers: nn.ModuleList = layers) -> None:
            with torch.no_grad():
                for m in layers:
                    torch.sum(m.w.view(-1, 4, 64), dim=1, out=m.w_folded)

        cases = {"refresh": ctx.timer(rt.refresh), "hand_loop": ctx.timer(hand_loop)}
        cases.update(_decomposition_cases(ctx, rt))
        stats = interleave(cases, ctx.sizes.repeats)
        # The baselines wrote the buffers behind graphsafe's back; figures 3 and 5 share
        # this model and need it fresh (5c's guard refuses it otherwise).
        rt.refresh_stale()
        r, hand = stats["refresh"], stats["hand_loop"]
        ratio = paired(r, hand)
        details: dict[str, Any] = {
            "per_derivation_us": {k: round(v.median / count * 1e6, 2) for k, v in stats.items()},
            "overhead_us_per_derivation": round(paired_diff(r, hand) / count * 1e6, 2),
            "first_load_bind_s": bind,
            "first_load_materialize_s": materialize,
            "spread": [round(r.spread, 3), round(hand.spread, 3)],
        }
        if ratio > 1.25 or ctx.profile:
            text, top = profile_per_item(rt.refresh, count, "refresh()", "derivation")
            ctx.profiles.append(text)
            details["cprofile"] = top
        rows.append(
            Row(
                f"2{fig}", f"{count} small derivations (4 KiB)", r.median, hand.median,
                baseline_name="hand-written loop", ratio=ratio, ratio_def="refresh / hand",
                op="<=", target=1.25, details=details,
            )
        )
    (n0, b0, m0), (n1, b1, m1) = firsts[0], firsts[-1]
    rows.append(
        Row(
            "2c", f"first load (bind + materialize), {n0} -> {n1}", b1 + m1, b0 + m0,
            baseline_name=f"first load of {n0}", ratio=(b1 + m1) / (b0 + m0),
            ratio_def=f"growth (linear: {n1 / n0:.3g})",
            details={
                "bind_s": {str(n0): b0, str(n1): b1},
                "materialize_s": {str(n0): m0, str(n1): m1},
            },
        )
    )
    return rows


def _decomposition_cases(ctx: Ctx, rt: gs.Runtime) -> dict[str, Callable[[], float]]:
    """`fn_only`: every derivation function called directly, arguments resolved before.

    That is the torch op plus one Python call per derivation; `refresh` minus `fn_only`
    is the runtime's own bookkeeping, measured without a profiler's distortion. Reads
    the engine's bound derivations (`fn`, `module_ref`, `in_refs`, `buffers`).
    """
    calls = [
        (b.fn, b.module_ref(), [c[k] for c, k in b.in_refs], b.buffers[0])
        for b in _engine(rt).bound
    ]

    def fn_only() -> None:
        with torch.no_grad():
            for fn, module, args, out in calls:
                fn(module, *args, out=out)

    return {"fn_only": ctx.timer(fn_only)}


def _engine(rt: gs.Runtime) -> Any:
    """The runtime's engine (internal: the bound derivations and their witnesses)."""
    return rt._bound_engine()


# -----------------------------------------------------------------------------
# 3. incremental refresh


def _incremental(
    ctx: Ctx, model: nn.Module, rt: gs.Runtime, label: str, figs: tuple[str, str]
) -> list[Row]:
    """Load 1 of 8 buckets; compare what graphsafe adds with a full refresh."""
    per = len(list(model.parameters())) // 8
    gen = torch.Generator().manual_seed(1)
    bucket = [
        (n, torch.randn(p.shape, generator=gen).to(ctx.device))
        for n, p in list(model.named_parameters())[:per]
    ]
    reports: dict[str, list[float]] = {"load": [], "full": []}
    pairs: dict[str, list[float]] = {"tracked": [], "untracked": []}
    watched = {storage_key(p): n for n, p in model.named_parameters()}

    def tracked() -> float:
        t = ctx.clock.time(lambda: model.load_weights(bucket))
        assert rt.last_report is not None
        reports["load"].append(rt.last_report.seconds)
        pairs["tracked"].append(t)
        return t

    def untracked() -> float:
        t = ctx.clock.time(lambda: untracked_load(model, bucket))
        pairs["untracked"].append(t)
        return t

    def full() -> float:
        t = ctx.clock.time(rt.refresh)
        assert rt.last_report is not None
        reports["full"].append(rt.last_report.seconds)
        return t

    def tracker_only() -> None:
        with write_tracker(watched):  # the tracking loads use, without the bookkeeping
            untracked_load(model, bucket)

    stats = interleave(
        {
            "tracked": tracked,
            "untracked": untracked,
            "full": full,
            # Where "all graphsafe adds" goes: tracking, fixed cost per load, refresh.
            "tracker_only": ctx.timer(tracker_only),
            "empty_tracked": ctx.timer(lambda: model.load_weights([])),
            "empty_untracked": ctx.timer(lambda: untracked_load(model, [])),
        },
        ctx.sizes.repeats,
    )
    model.load_weights(bucket)
    assert rt.last_report is not None
    ran = rt.last_report.ran
    # The lists hold the warmup samples too; keep the timed ones (the last `repeats`).
    k = ctx.sizes.repeats
    load_rep = statistics.median(reports["load"][-k:])
    full_rep = statistics.median(reports["full"][-k:])
    added_i = [a - b for a, b in zip(pairs["tracked"][-k:], pairs["untracked"][-k:])]
    added = statistics.median(added_i)
    full_wall = stats["full"].median
    m = {name: st.median for name, st in stats.items()}
    common = {
        "derivations": len(rt.derivations),
        "refreshed_by_load": ran,
        "bucket_entries": per,
        "tracked_load_s": m["tracked"],
        "untracked_load_s": m["untracked"],
    }
    return [
        Row(
            figs[0], f"1/8 bucket, {label}: refresh (report)", load_rep, full_rep,
            baseline_name="full refresh (report)", ratio=paired(reports["load"], reports["full"]),
            ratio_def="load's refresh / full", op="<=", target=0.2,
            details={**common, "measure": "RefreshReport.seconds of both"},
        ),
        Row(
            figs[1], f"1/8 bucket, {label}: all graphsafe adds", added, full_wall,
            baseline_name="full refresh() wall", ratio=paired(added_i, stats["full"]),
            ratio_def="(tracked-untracked) / full", op="<=", target=0.2,
            details={
                "measure": "median of paired (tracked - untracked) load",
                "of_which_tracking_s": paired_diff(stats["tracker_only"], stats["untracked"]),
                "of_which_fixed_per_load_s": paired_diff(
                    stats["empty_tracked"], stats["empty_untracked"]
                ),
                "of_which_refresh_s": load_rep,
            },
        ),
    ]


def fig3(ctx: Ctx) -> list[Row]:
    """After a load of 1 of 8 buckets, only that bucket's derivations are refreshed."""
    s = ctx.sizes
    reg = gs.Registry()
    with torch.device(ctx.device):
        model = fold_stack_class(reg, 4, 1024)([s.fig3_rows] * s.fig3_count)
    rt = gs.runtime(model, reg)
    rt.refresh()
    kib = s.fig3_rows * 4 * 1024 * 4 // 1024
    rows = _incremental(ctx, model, rt, f"{s.fig3_count} x {kib} KiB", ("3a", "3b"))
    count = s.fig2_counts[0]
    small_model, small_rt, _, _ = _many_small(ctx, count)
    return rows + _incremental(ctx, small_model, small_rt, f"{count} x 4 KiB", ("3c", "3d"))


# -----------------------------------------------------------------------------
# 4. write tracking during load_weights


class _NoopMode(TorchDispatchMode):
    """A dispatch mode that does nothing: what intercepting every op costs by itself."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


def _load_rows(
    ctx: Ctx,
    layers: int,
    hidden: int,
    inter: int,
    fig: str,
    target: float | None,
    source: torch.device,
) -> Row:
    reg = gs.Registry()
    with torch.device(ctx.device):
        model = llm_stack_class(reg, hidden, inter)(layers)
    gen = torch.Generator().manual_seed(2)
    ckpt = [
        (n, torch.randn(p.shape, generator=gen).to(source)) for n, p in model.named_parameters()
    ]
    model.load_weights(ckpt)  # materialize
    rt = gs.runtime(model, reg)

    def noop_mode_load() -> None:  # the floor of any Python dispatch-level tracking
        with _NoopMode():
            untracked_load(model, ckpt)

    native = _native.get()

    def callback_floor_load() -> None:  # the floor of the compiled tracker's kind
        assert native is not None
        native.observer_floor(True, True, False, True)  # with inputs, this thread's
        try:
            untracked_load(model, ckpt)
        finally:
            native.observer_floor(False, False, False, True)

    cases = {
        "tracked": ctx.timer(lambda: model.load_weights(ckpt)),
        "untracked": ctx.timer(lambda: untracked_load(model, ckpt)),
        "noop_mode": ctx.timer(noop_mode_load),
    }
    if native is not None:
        cases["callback_floor"] = ctx.timer(callback_floor_load)
    stats = interleave(cases, ctx.sizes.repeats)
    t, u, floor = stats["tracked"], stats["untracked"], stats["noop_mode"]
    nbytes = sum(p.nbytes for p in model.parameters())
    count = len(ckpt)
    assert rt.last_report is not None
    ratio = paired(t, u)
    details: dict[str, Any] = {
        "params": count,
        "bytes": fmt_bytes(nbytes),
        "overhead_us_per_param": round(paired_diff(t, u) / count * 1e6, 2),
        "noop_dispatch_mode_us_per_param": round(paired_diff(floor, u) / count * 1e6, 2),
        **({"callback_floor_us_per_param": round(
            paired_diff(stats["callback_floor"], u) / count * 1e6, 2)}
           if "callback_floor" in stats else {}),
        "untracked_bandwidth": gbps(nbytes, u.median),
        "refresh_in_tracked_s": rt.last_report.seconds,
        "spread": [round(t.spread, 3), round(u.spread, 3)],
    }
    if (target is not None and ratio > target) or ctx.profile:
        text, top = profile_per_item(
            lambda: model.load_weights(ckpt), count, f"{fig}: tracked load_weights", "param"
        )
        ctx.profiles.append(text)
        details["cprofile"] = top
    return Row(
        fig, f"tracked load, {count} params avg {fmt_bytes(nbytes / count)} from {source.type}",
        t.median, u.median, baseline_name="same load unwrapped", ratio=ratio,
        ratio_def="tracked / untracked", op="<=" if target else "", target=target,
        details=details,
    )


def fig4(ctx: Ctx) -> list[Row]:
    """Tracked vs untracked `load_weights`: LLM-sized parameters, then ~3 KiB ones.

    The checkpoint is in host memory, as `load_weights` reads it from files; on CUDA a
    third row loads LLM-sized weights that are already on the device (RL weight sync).
    4b is the vLLM-style load of many small tensors (2,100 of ~3 KiB at full size), where
    the per-parameter cost of tracking dominates.
    """
    s = ctx.sizes
    host = torch.device("cpu")  # where a checkpoint is read into, before load_weights
    rows = []
    if ctx.wants("4a"):
        rows.append(_load_rows(ctx, s.fig4_layers, s.fig4_hidden, s.fig4_inter, "4a", 1.10, host))
    if ctx.wants("4b"):
        rows.append(_load_rows(ctx, s.fig4_small_layers, 32, 32, "4b", 1.3, host))
    # RL weight sync: the new weights are already on the GPU.
    if ctx.device.type == "cuda" and ctx.wants("4c"):
        rows.append(
            _load_rows(ctx, s.fig4_layers, s.fig4_hidden, s.fig4_inter, "4c", None, ctx.device)
        )
    elif ctx.wants("4c"):
        rows.append(Row("4c", "tracked load of weights already on the GPU", skipped=(
            "CUDA only: the new weights on the GPU (this run is on the CPU)")))
    return rows


# -----------------------------------------------------------------------------
# 5. replay guard


def _flagship(ctx: Ctx, preset: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The flagship model of `preset`, loaded, with an example input."""
    with torch.device(ctx.device):
        model = dsv4.DeepseekV4Model(dsv4.DeepseekV4Config.preset(preset))
    model.load_weights(dsv4.random_checkpoint(model.config, seed=0, device=ctx.device))
    x = dsv4.verify_target.example_input(model, seed=0)
    return model, x


def _backend(ctx: Ctx) -> str:
    return "cuda" if ctx.device.type == "cuda" else "cpu"


def _capture(ctx: Ctx, graph: Any, model: nn.Module, x: tuple[torch.Tensor, ...]) -> None:
    """Capture `model(*x)`; on CUDA after one warm-up on a side stream, as one should."""
    warmup = (lambda: model(*x)) if ctx.device.type == "cuda" else None
    with graph.capture(warmup=warmup, warmup_iters=1):
        model(*x)


def fig5(ctx: Ctx) -> list[Row]:
    """The guard a guarded replay runs: tiny flagship, Ledger.verify alone, 2,000 inputs,
    and a guarded replay of the flash preset with the compiled checks and the Python ones."""
    rows = [_guard_flagship(ctx)] if ctx.wants("5a") else []
    if ctx.wants("5b"):
        rows.append(_ledger_verify(ctx))
    if ctx.wants("5c"):
        rows.append(_guard_many(ctx))
    preset = ctx.sizes.fig7_preset
    for fig, compiled in (("5d", True), ("5e", False)):
        name = f"guarded replay, {preset} preset, {'compiled' if compiled else 'Python'} checks"
        rows += ctx.attempt(
            fig, name, lambda c=compiled, f=fig, n=name: _guard_preset(ctx, f, n, c)
        )
    return rows


def _ledger_verify(ctx: Ctx) -> Row:
    count = ctx.sizes.fig5_tensors
    with torch.device(ctx.device):
        many = nn.ModuleList(nn.Linear(2, 2) for _ in range(count // 2))
    ledger = gs.Ledger.snapshot(many)
    number = max(1, 50_000 // count)
    stats = interleave({"verify": ctx.timer(ledger.verify, number)}, ctx.sizes.repeats)
    v = stats["verify"].median
    return Row(
        "5b", f"Ledger.verify, {len(ledger)} tensors", v, None,
        details={"per_1000_tensors_us": round(v / len(ledger) * 1000 * 1e6, 2)},
    )


def _guard_only(model: nn.Module | None) -> gs.Graph:
    """A graph of an empty body, guarding `model` (None: unguarded).

    Its replay is everything `Graph.replay()` does before the backend replays (state
    check, the model's lock, ledger check, freshness check) plus the replay of nothing:
    the guard measured directly, with a conservative few microseconds on top. The
    freshness check does not depend on the body (it checks every derived buffer and its
    inputs); the ledger holds only what the capture read, nothing for an empty body (5b
    times the ledger per pinned tensor). The CPU backend on every device: the guard is
    the same whatever the backend.
    """
    graph = gs.Graph(backend="cpu", guard=model)
    with graph.capture():
        pass
    return graph


def _guard_flagship(ctx: Ctx) -> Row:
    model, x = _flagship(ctx, "tiny")
    model(*x)  # lazy initialisation (cuBLAS handles, ...) before any capture
    guarded = gs.Graph(backend=_backend(ctx), guard=model)
    _capture(ctx, guarded, model, x)
    plain = gs.Graph(backend=_backend(ctx))
    _capture(ctx, plain, model, x)
    guard, empty = _guard_only(model), _guard_only(None)
    rt = gs.runtime(model)
    ledger = guarded.ledger

    def checks() -> None:  # the two checks alone, as the previous core's replay ran them
        ledger.assert_stable()
        rt.assert_fresh()

    number = ctx.sizes.fig5_replays
    stats = interleave(
        {
            "guarded": ctx.timer(guarded.replay, number),
            "plain": ctx.timer(plain.replay, number),
            "guard": ctx.timer(guard.replay, number=200),
            "empty": ctx.timer(empty.replay, number=200),
            "checks": ctx.timer(checks, number=200),
        },
        ctx.sizes.repeats,
    )
    for graph in (guarded, plain, guard, empty):
        graph.reset()  # release the pins: the model is guarded by nothing after this figure
    g, p, guard_t = stats["guarded"], stats["plain"], stats["guard"]
    diff = paired_diff(g, p)
    return Row(
        "5a", f"guard before replay, tiny flagship ({len(ledger)} tensors)", guard_t.median,
        p.median, baseline_name="unguarded replay", ratio=paired(guard_t, p),
        ratio_def="guard / replay", op="<=", target=0.02,
        details={
            "measure": "replay of an empty-body graph guarding the model",
            "of_which_empty_replay_s": stats["empty"].median,
            "checks_s": stats["checks"].median,
            "guarded_replay_s": g.median,
            "paired_difference_s": diff,
            "difference_ratio": round(diff / p.median, 4),
            "backend": _backend(ctx),
            "spread": [round(guard_t.spread, 3), round(p.spread, 3)],
        },
    )


def _guard_preset(ctx: Ctx, fig: str, name: str, compiled: bool) -> Row:
    """A guarded replay of the flagship preset (`fig7_preset`: flash, DeepSeek V4-Flash's
    mHC sizes) against an unguarded replay of the same model, in real CUDA graphs on
    `--device cuda`; the model, its runtime and its graphs made on the compiled checks'
    path (`_native.using(True)`) or on the Python one (as `GRAPHSAFE_NATIVE=0` does)."""
    if compiled and _native.get() is None:
        return Row(fig, name, skipped=(
            "the compiled checks are not here: no C++ compiler built them, or "
            f"GRAPHSAFE_NATIVE=0 ({_native.describe()})"
        ))
    preset = ctx.sizes.fig7_preset
    with _native.using(compiled), warnings.catch_warnings():
        # Every check snapshotted inside takes this path. On the Python one the observer
        # cannot start for this model: it says so once, as without the compiled build.
        warnings.simplefilter("ignore", gs.GraphSafetyWarning)
        model, x = _flagship(ctx, preset)
        model(*x)  # lazy initialisation (cuBLAS handles, ...) before any capture
        rt = gs.runtime(model)
        rt.refresh_stale()
        guarded = gs.Graph(backend=_backend(ctx), guard=model)
        _capture(ctx, guarded, model, x)
        plain = gs.Graph(backend=_backend(ctx))
        _capture(ctx, plain, model, x)
        guard, empty = _guard_only(model), _guard_only(None)
        paths = {
            "ledger": "compiled" if guarded.ledger._native is not None else "python",
            "witnesses": "compiled" if _engine(rt).witnesses._native is not None else "python",
        }
        if paths["ledger"] != ("compiled" if compiled else "python"):
            raise AssertionError(f"the guard's ledger took the {paths['ledger']} path")
        number = ctx.sizes.fig5_replays
        stats = interleave(
            {
                "guarded": ctx.timer(guarded.replay, number),
                "plain": ctx.timer(plain.replay, number),
                "guard": ctx.timer(guard.replay, number=50),
                "empty": ctx.timer(empty.replay, number=50),
            },
            ctx.sizes.repeats,
        )
        observer, pinned = OBSERVER.running, len(guarded.ledger or ())
        for graph in (guarded, plain, guard, empty):
            graph.reset()  # unpinned: the model is guarded by nothing after this row
    g, p, guard_t = stats["guarded"], stats["plain"], stats["guard"]
    diff = paired_diff(g, p)
    return Row(
        fig, name, g.median, p.median, baseline_name="unguarded replay",
        ratio=paired(g, p), ratio_def="guarded / unguarded",
        details={
            "tensors_pinned": pinned,
            "checks": paths,
            "observer_running": observer,
            "guard_s": guard_t.median,
            "guard_over_replay": round(paired(guard_t, p), 4),
            "of_which_empty_replay_s": stats["empty"].median,
            "paired_difference_s": diff,
            "replays_per_sample": number,
            "backend": _backend(ctx),
            "spread": [round(g.spread, 3), round(p.spread, 3), round(guard_t.spread, 3)],
        },
    )


def _guard_many(ctx: Ctx) -> Row:
    """The guard over a model of many small derivations, per 1,000 inputs, with its split."""
    count = ctx.sizes.fig5_inputs
    model, rt, _, _ = _many_small(ctx, count)
    inputs = len({path for d in rt.derivations for path in d.inputs})
    guard, empty = _guard_only(model), _guard_only(None)
    ledger = guard.ledger
    cases = {
        "guard": ctx.timer(guard.replay, number=20),
        "empty": ctx.timer(empty.replay, number=20),
        "ledger": ctx.timer(ledger.assert_stable, number=20),
        "freshness": ctx.timer(rt.assert_fresh, number=20),
    }
    # Internals: the witnesses' flat check alone, part of the freshness check.
    witnesses = _engine(rt).witnesses
    cases["witnesses"] = ctx.timer(witnesses.unchanged, number=20)
    path = "python"
    if _native.get() is not None:  # built: the same two flat checks on the Python path too
        path = "native"
        with _native.using(False):
            py_ledger = gs.Ledger.snapshot(model)
            py_witnesses = Witnesses([*zip(witnesses.holders, witnesses.keys)],
                                     witnesses.journal)
        cases["python_ledger"] = ctx.timer(py_ledger._unchanged, number=20)
        cases["python_witnesses"] = ctx.timer(py_witnesses.unchanged, number=20)
    stats = interleave(cases, ctx.sizes.repeats)
    per = {k: round(v.median / inputs * 1000 * 1e6, 2) for k, v in stats.items()}
    g = stats["guard"]
    ratio = g.median / inputs * 1000 * 1e6
    details: dict[str, Any] = {
        "inputs": inputs,
        "pinned_tensors": len(ledger),
        "witness_sites": len(witnesses),
        "checks": path,
        "per_1000_inputs_us": per,
        "rest_us": round(per["guard"] - per["ledger"] - per["freshness"] - per["empty"], 2),
        "spread": [round(g.spread, 3)],
    }
    if ratio > 50 or ctx.profile:
        text, top = profile_per_item(
            guard.replay, inputs, f"5c: guarded replay of nothing ({inputs} inputs)",
            "input", rounds=50, per=1000,
        )
        ctx.profiles.append(text)
        details["cprofile"] = top
    guard.reset()
    empty.reset()
    return Row(
        "5c", f"guard, {count} small derivations ({inputs} inputs)", g.median, None,
        ratio=ratio, ratio_def="us per 1,000 inputs", op="<=", target=50, details=details,
    )


# -----------------------------------------------------------------------------
# 6. peak extra memory during a full refresh


def fig6(ctx: Ctx) -> list[Row]:
    """Measured peak memory above the baseline during `refresh()`: out= vs slow path."""
    rows = []
    for fig, out_path, label in (("6a", True, "out="), ("6b", False, "slow path")):
        reg = gs.Registry()
        with torch.device(ctx.device):
            model = fold_stack_class(reg, 4, 1024, out_path=out_path)(list(ctx.sizes.fig6_rows))
        rt = gs.runtime(model, reg)
        rt.refresh()  # materialize
        rt.refresh()  # and once more, so one-time allocations are out of the way
        largest = max(m.w_folded.nbytes for m in model.layers)
        total = sum(m.w_folded.nbytes for m in model.layers)
        peak = peak_extra_bytes(rt.refresh, ctx.device)
        allowed = 0 if out_path else largest
        rows.append(
            Row(
                fig, f"peak extra memory, {label}", peak, allowed, unit="B",
                baseline_name="allowed: 0" if out_path else "allowed: largest output",
                ratio=peak / largest, ratio_def="peak / largest output", op="<=",
                target=allowed / largest,
                details={
                    "derivations": len(ctx.sizes.fig6_rows),
                    "largest_output": fmt_bytes(largest),
                    "all_outputs": fmt_bytes(total),
                    "how": "cuda.max_memory_allocated" if ctx.device.type == "cuda"
                    else "torch.profiler allocator events (running sum)",
                },
            )
        )
    return rows


# -----------------------------------------------------------------------------
# 7. refit + refresh vs a fresh capture, at the V4-Flash mHC preset


def fig7(ctx: Ctx) -> list[Row]:
    """Refit in 8 buckets inside gs.weight_update, vs capturing the graph again."""
    preset = ctx.sizes.fig7_preset
    name = f"refit+refresh vs capture, {preset}"
    model, x = _flagship(ctx, preset)
    model(*x)  # lazy initialisation (cuBLAS handles, ...) before any capture
    rt = gs.runtime(model)
    ckpt = dsv4.random_checkpoint(model.config, seed=1, device=ctx.device)
    buckets = [ckpt[i::8] for i in range(8)]
    graphs: list[Any] = []

    def capture() -> None:
        for g in graphs:  # release the previous graph first, as a re-capture would
            g.reset()
        graphs.clear()
        g = gs.Graph(backend=_backend(ctx), guard=model)
        _capture(ctx, g, model, x)
        graphs.append(g)

    def refit() -> None:
        with gs.weight_update(model):
            for b in buckets:
                model.load_weights(b)

    refresh_s: list[float] = []

    def refit_case() -> float:
        t = ctx.clock.time(refit)
        assert rt.last_report is not None
        refresh_s.append(rt.last_report.seconds)
        return t

    def untracked_case() -> float:
        return ctx.clock.time(lambda: [untracked_load(model, b) for b in buckets])

    repeats = max(3, ctx.sizes.repeats // 2)
    stats = interleave(
        {"capture": ctx.timer(capture), "refit": refit_case, "untracked": untracked_case},
        repeats,
    )
    rt.refresh_stale()  # the untracked baseline wrote behind the guard (the observer saw it)
    graphs[0].replay()  # the last capture still replays after the refits
    graphs[0].reset()
    c, r, u = stats["capture"], stats["refit"], stats["untracked"]
    refresh = statistics.median(refresh_s[-repeats:])
    params = sum(p.nbytes for p in model.parameters())
    return [
        Row(
            "7a", name, r.median, c.median, baseline_name=f"fresh {_backend(ctx)} capture",
            ratio=paired(c, r), ratio_def="capture / refit",
            details={
                "params": fmt_bytes(params),
                "buckets": 8,
                "capture_warmup_iters": 1 if ctx.device.type == "cuda" else 0,
                "untracked_load_s": u.median,
                "spread": [round(r.spread, 3), round(c.spread, 3)],
            },
        ),
        Row(
            "7b", f"refresh alone, {preset}", refresh, r.median, baseline_name="refit+refresh",
            ratio=paired(refresh_s, r), ratio_def="refresh / refit",
            details={"derivations": len(rt.derivations)},
        ),
    ]


def warm(ctx: Ctx) -> None:
    """Pay one-time costs before any figure: torch's lazy imports on the first dispatch
    mode, allocator pools, the first refresh of a runtime."""
    reg = gs.Registry()
    with torch.device(ctx.device):
        model = fold_stack_class(reg, 4, 8)([2, 2])
    gs.runtime(model, reg)
    model.load_weights([("layers.0.w", torch.ones(2, 32, device=ctx.device))])
    model.load_weights([("layers.1.w", torch.ones(2, 32, device=ctx.device))])
    ctx.clock.sync()


FIGURES: dict[str, Callable[[Ctx], list[Row]]] = {
    "1": fig1, "2": fig2, "3": fig3, "4": fig4, "5": fig5, "6": fig6, "7": fig7,
}
"""Figure number to function; `run.py` runs them in order (2 before 3: they share)."""
