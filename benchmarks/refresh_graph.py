"""Figure 14: a prototype: the refresh of many small derivations as one CUDA graph.

Figure 2b's refresh of 10,000 small derivations (4 KiB in, 1 KiB out, `out=`) launches
10,000 kernels of a microsecond or two: on a GPU it is launch-bound. The derived
buffers' addresses are stable by construction (a refresh writes into them in place), and
so are the weights' as long as loads write in place, so the whole refresh can be
captured once into a `torch.cuda.CUDAGraph` and replayed: one launch.

- 14a: CUDA only. `rt.refresh()` captured once (after a warm-up on a side stream; if
  graphsafe's refresh cannot be captured, the engine's own loop over its bound
  derivations, `fn(module, *inputs, out=buffer)`, is captured instead and the row says
  so), replayed, against the eager `rt.refresh()`, alternated in one run. Before timing,
  new weights are written in place and the buffers zeroed; the graph's replay must then
  give, bitwise, what the eager refresh gives (the figure fails otherwise). The details
  give what capturing costs: the capture itself, the first replay (which uploads the
  graph), the memory the graph holds, and after how many refreshes capturing pays off.

A replay does only the kernels: graphsafe's bookkeeping at capture (which derivations
ran, the witnesses of their inputs) is not redone, so a runtime that replays its refresh
must record its witnesses itself. This figure measures the kernels' side only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from figures import Ctx, _engine, _many_small
from harness import Row, fmt_bytes, interleave, paired, why
from torch import nn

import graphsafe as gs

__all__ = ["fig14"]


def _engine_loop(rt: gs.Runtime) -> Callable[[], None]:
    """The engine's recompute of every derivation, its arguments resolved once: what a
    refresh launches, without graphsafe's bookkeeping."""
    calls = [
        (b.fn, b.module_ref(), [c[k] for c, k in b.in_refs], b.buffers[0])
        for b in _engine(rt).bound
    ]

    def loop() -> None:
        with torch.no_grad():
            for fn, module, args, out in calls:
                fn(module, *args, out=out)

    return loop


def _capture(fn: Callable[[], object], device: torch.device) -> tuple[torch.cuda.CUDAGraph, float]:
    """`fn` captured into a CUDA graph after two warm-up calls on a side stream; the
    graph and the seconds the capture took (instantiation included)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph, time.perf_counter() - start


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [m.w_folded for m in model.layers]  # type: ignore[union-attr]


def _check_bitwise(
    ctx: Ctx, model: nn.Module, rt: gs.Runtime, replay: Callable[[], None], seed: int
) -> int:
    """New weights (of `seed`) written in place, the buffers zeroed; the replay's buffers
    against the eager refresh's, bitwise. Returns the derivations compared; raises if any
    differ."""
    gen = torch.Generator().manual_seed(seed)
    layers = list(model.layers)  # type: ignore[arg-type]
    new = torch.randn(len(layers), *layers[0].w.shape, generator=gen).to(ctx.device)
    bufs = _buffers(model)
    with torch.no_grad():
        for m, w in zip(layers, new):
            m.w.copy_(w)  # in place: the graph reads these storages
        for b in bufs:
            b.zero_()
    replay()
    ctx.clock.sync()
    replayed = torch.cat([b.flatten() for b in bufs])
    with torch.no_grad():
        for b in bufs:
            b.zero_()
    rt.refresh()
    eager = torch.cat([b.flatten() for b in bufs])
    if not bool(eager.abs().sum() > 0):
        raise AssertionError("the eager refresh left the buffers zero: nothing was compared")
    if not torch.equal(replayed, eager):
        per = replayed.view(len(bufs), -1) != eager.view(len(bufs), -1)
        differ = int(per.any(dim=1).sum())
        raise AssertionError(
            f"the replayed refresh differs from the eager one in {differ} of {len(bufs)} "
            "derivations' buffers"
        )
    return len(bufs)


def _row(ctx: Ctx, fig: str, name: str) -> Row:
    count = ctx.sizes.fig2_counts[-1]
    model, rt, _, _ = _many_small(ctx, count)
    rt.refresh_stale()
    device = ctx.device
    captured = "rt.refresh()"
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    try:
        graph, capture_s = _capture(rt.refresh, device)
    except Exception as exc:  # graphsafe's refresh did something a capture refuses
        captured = f"the engine's loop (rt.refresh() could not be captured: {why(exc)})"
        torch.cuda.synchronize(device)
        graph, capture_s = _capture(_engine_loop(rt), device)
    held = torch.cuda.memory_allocated(device) - before
    first = ctx.clock.time(graph.replay)  # uploads the graph
    compared = _check_bitwise(ctx, model, rt, graph.replay, seed=14)
    stats = interleave(
        {"replay": ctx.timer(graph.replay), "refresh": ctx.timer(rt.refresh)},
        ctx.sizes.repeats,
    )
    compared_after = _check_bitwise(ctx, model, rt, graph.replay, seed=15)  # after timing
    graph.reset()
    r, e = stats["replay"], stats["refresh"]
    saved = e.median - r.median
    return Row(
        fig, name, r.median, e.median, baseline_name="eager rt.refresh()",
        ratio=paired(r, e), ratio_def="graph replay / eager",
        details={
            "derivations": count,
            "captured": captured,
            "bitwise_equal_to_eager": f"{compared} buffers before the timing, "
            f"{compared_after} after",
            "capture_s": capture_s,
            "first_replay_s": first,
            "graph_memory": fmt_bytes(held),
            "capture_over_eager_refresh": round(capture_s / e.median, 2),
            "pays_off_after_refreshes": round(capture_s / saved, 1) if saved > 0 else None,
            "per_derivation_us": {"replay": round(r.median / count * 1e6, 3),
                                  "eager": round(e.median / count * 1e6, 3)},
            "spread": [round(r.spread, 3), round(e.spread, 3)],
        },
    )


def fig14(ctx: Ctx) -> list[Row]:
    """The refresh of figure 2b's small derivations as one CUDA graph vs eager."""
    count = ctx.sizes.fig2_counts[-1]
    name = f"refresh of {count} small derivations as one CUDA graph"
    if ctx.device.type != "cuda":
        if not ctx.wants("14a"):
            return []
        return [Row("14a", name, skipped=(
            "CUDA only: a CUDA graph of the refresh (this run is on the CPU)"
        ))]
    return ctx.attempt("14a", name, lambda: _row(ctx, "14a", name))
