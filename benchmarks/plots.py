"""Refit cost as figures: graphsafe's refresh, a hand-written refresh, and a re-capture.

    python benchmarks/plots.py [--out docs/img] [--quick] [--device cpu|cuda]
                               [--threads N] [--no-draw]

Measures, then draws two figures (PNG, with matplotlib, the `bench` extra) and prints
the numbers as a table:

1. `refit_vs_size.png`: refit cost against the number of derivations of a synthetic
   model (one 4 KiB parameter and one derivation per layer), after a load of every
   weight.
2. `refit_vs_fraction.png`: refit cost against the fraction of the weights loaded, on
   one model.

Each point measures, side by side in one interleaved loop (`harness.interleave`):

- `graphsafe`: the refresh run by a tracked `load_weights`, as its
  `RefreshReport.seconds`;
- `graphsafe, all it adds`: the median of paired (tracked load - the same load
  unwrapped): tracking, the per-load scan and the refresh;
- `hand-written`: the loop a user writes without graphsafe, recomputing every derived
  buffer (it cannot know which weights changed);
- `re-capture`: capturing a new `gs.Graph` of a forward that reads every derived buffer
  once (CPU recorder on the CPU, CUDA graph on a GPU), without a guard, as a user
  without graphsafe would; only the capture, not the recompute it would also need.

`--quick` runs tiny sizes (a smoke run; its numbers mean nothing). Drawing needs
matplotlib; the measurement does not (`--no-draw` prints the table only). The exit
status is 0 whatever the numbers say.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_models import fold_stack_class, untracked_load
from harness import Clock, add_machine_args, interleave, machine
from torch import nn

import graphsafe as gs

__all__ = [
    "Point",
    "PlotSizes",
    "draw",
    "fraction_sweep",
    "main",
    "size_sweep",
    "stale_layers",
    "table",
]

N, C, ROWS = 4, 64, 4  # per layer: w [4, 256] f32 (4 KiB) -> w_folded [4, 64] (1 KiB)


@dataclasses.dataclass(frozen=True)
class PlotSizes:
    """Model sizes, fractions and repeats; `full()` for the docs, `quick()` to smoke."""

    counts: tuple[int, ...]
    """Derivations (= parameters = layers) of each model of figure 1."""
    fraction_count: int
    """Derivations of the model of figure 2."""
    fractions: tuple[float, ...]
    """Fractions of the weights loaded in figure 2."""
    repeats: int
    """Samples per case and point."""

    @classmethod
    def full(cls) -> PlotSizes:
        return cls(
            counts=(250, 500, 1000, 2000, 4000),
            fraction_count=2000,
            fractions=(1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0),
            repeats=11,
        )

    @classmethod
    def quick(cls) -> PlotSizes:
        return cls(counts=(8, 16), fraction_count=16, fractions=(1 / 8, 1.0), repeats=2)


@dataclasses.dataclass(frozen=True)
class Point:
    """One x of a figure: the median seconds of each line, and what was checked."""

    x: float
    """Derivations (figure 1) or fraction of the weights loaded (figure 2)."""
    derivations: int
    """Derivations of the model."""
    loaded: int
    """Parameters written by each measured load."""
    graphsafe_s: float
    """The load's refresh, `RefreshReport.seconds`."""
    added_s: float
    """Median of paired (tracked load - untracked load)."""
    hand_s: float
    """The hand-written loop over every derivation."""
    capture_s: float
    """A new graph's capture of the forward."""
    refreshed: int
    """Derivations the load's refresh ran (should be `loaded`)."""
    fresh: bool
    """Every derived buffer equals a fresh recompute after a final tracked load."""


def _model(count: int, device: torch.device) -> tuple[nn.Module, gs.Runtime]:
    """`count` layers of the mHC fold, loaded once (buffers materialized)."""
    reg = gs.Registry()
    with torch.device(device):
        model = fold_stack_class(reg, N, C)([ROWS] * count)
    rt = gs.runtime(model, reg)
    rt.refresh()
    return model, rt


def _layers(model: nn.Module) -> list[Any]:
    """The stack's layers (their tensors are attributes mypy cannot see)."""
    return list(cast(nn.ModuleList, model.layers))


def _loader(model: nn.Module) -> Callable[[list[tuple[str, torch.Tensor]]], None]:
    """The model's tracked `load_weights` (graphsafe's wrapper around it)."""
    return cast(Callable[[list[tuple[str, torch.Tensor]]], None], model.load_weights)


def stale_layers(model: nn.Module) -> list[int]:
    """Indices of the layers whose `w_folded` differs from a fresh `w.view(-1, n, C).sum(1)`.

    Args:
        model: A stack built by `bench_models.fold_stack_class(reg, N, C)`.

    Returns:
        The stale layers, in order; empty when every derived buffer is fresh.
    """
    with torch.no_grad():
        return [
            i for i, m in enumerate(_layers(model))
            if not torch.equal(m.w_folded, torch.sum(m.w.view(-1, N, C), dim=1))
        ]


def _measure(
    clock: Clock, model: nn.Module, rt: gs.Runtime, loaded: int, x: float, repeats: int
) -> Point:
    """Measure the four cases side by side for a load of the first `loaded` parameters."""
    device = clock.device
    named = list(model.named_parameters())[:loaded]
    gen = torch.Generator().manual_seed(loaded)
    # Two checkpoints taken in turn, so that every load changes the values it writes.
    ckpts = [
        [(n, torch.randn(p.shape, generator=gen).to(device)) for n, p in named]
        for _ in range(2)
    ]
    layers = _layers(model)
    load = _loader(model)
    probe = torch.randn(C, device=device)
    graphs: list[tuple[gs.Graph, list[torch.Tensor]]] = []
    reports: list[float] = []
    pairs: dict[str, list[float]] = {"tracked": [], "untracked": []}
    turn = [0]

    def tracked() -> float:
        turn[0] += 1
        ckpt = ckpts[turn[0] % 2]
        t = clock.time(lambda: load(ckpt))
        assert rt.last_report is not None
        reports.append(rt.last_report.seconds)
        pairs["tracked"].append(t)
        return t

    def untracked() -> float:
        ckpt = ckpts[turn[0] % 2]
        t = clock.time(lambda: untracked_load(model, ckpt))
        pairs["untracked"].append(t)
        return t

    def hand_loop() -> None:
        with torch.no_grad():
            for m in layers:
                torch.sum(m.w.view(-1, N, C), dim=1, out=m.w_folded)

    def forward() -> list[torch.Tensor]:
        return [torch.mv(m.w_folded, probe) for m in layers]  # [ROWS] each

    def recapture() -> None:
        for g, _ in graphs:  # release the previous graph first, as a re-capture would
            g.reset()
        graphs.clear()
        graph = gs.Graph(backend="cuda" if device.type == "cuda" else "cpu")
        warmup = forward if device.type == "cuda" else None
        with torch.no_grad(), graph.capture(warmup=warmup, warmup_iters=1):
            outs = forward()
        graphs.append((graph, outs))

    stats = interleave(
        {
            "tracked": tracked,
            "untracked": untracked,
            "hand": lambda: clock.time(hand_loop),
            "capture": lambda: clock.time(recapture),
        },
        repeats,
    )
    for g, _ in graphs:
        g.reset()
    # The untracked case leaves its layers stale; a tracked load must make them fresh.
    load(ckpts[0])
    assert rt.last_report is not None
    refreshed = rt.last_report.ran
    fresh = not stale_layers(model)
    k = repeats  # the lists hold the warm-up samples too: keep the timed ones
    added = [a - b for a, b in zip(pairs["tracked"][-k:], pairs["untracked"][-k:])]
    return Point(
        x=x,
        derivations=len(layers),
        loaded=loaded,
        graphsafe_s=statistics.median(reports[-k:]),
        added_s=statistics.median(added),
        hand_s=stats["hand"].median,
        capture_s=stats["capture"].median,
        refreshed=refreshed,
        fresh=fresh,
    )


def size_sweep(sizes: PlotSizes, clock: Clock) -> list[Point]:
    """Figure 1: a load of every weight, for each model size of `sizes.counts`."""
    points = []
    for count in sizes.counts:
        model, rt = _model(count, clock.device)
        points.append(_measure(clock, model, rt, count, float(count), sizes.repeats))
    return points


def fraction_sweep(sizes: PlotSizes, clock: Clock) -> list[Point]:
    """Figure 2: a load of each fraction of the weights of one model."""
    model, rt = _model(sizes.fraction_count, clock.device)
    points = []
    for frac in sizes.fractions:
        loaded = max(1, round(frac * sizes.fraction_count))
        points.append(_measure(clock, model, rt, loaded, frac, sizes.repeats))
    return points


_COLUMNS = (
    ("graphsafe", "graphsafe_s"),
    ("graphsafe all", "added_s"),
    ("hand-written", "hand_s"),
    ("re-capture", "capture_s"),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def table(title: str, xname: str, points: Sequence[Point]) -> str:
    """One figure's numbers as a text table, in milliseconds."""
    head = (xname, "derivations", "loaded", *(f"{c} ms" for c, _ in _COLUMNS),
            "refreshed", "fresh")
    rows = [
        (
            f"{p.x:g}" if p.x >= 1 else f"1/{round(1 / p.x)}",
            str(p.derivations), str(p.loaded),
            *(_ms(getattr(p, f)) for _, f in _COLUMNS),
            str(p.refreshed), "yes" if p.fresh else "NO",
        )
        for p in points
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [title] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows]]
    return "\n".join(lines)


def _machine(clock: Clock) -> str:
    if clock.device.type == "cuda":
        return torch.cuda.get_device_name(clock.device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} torch threads)"


def draw(
    by_size: Sequence[Point],
    by_fraction: Sequence[Point],
    out: Path,
    machine: str,
    backend: str = "cpu",
) -> list[Path]:
    """Draw the two figures as PNGs into `out` (needs matplotlib).

    Args:
        by_size: Points of figure 1.
        by_fraction: Points of figure 2.
        out: Folder to write into (created if missing).
        machine: Where it was measured, for the titles.
        backend: The graph backend of the re-capture, `"cpu"` or `"cuda"`.

    Returns:
        The paths written.
    """
    import matplotlib  # optional: only drawing needs it (the `bench` extra)

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    styles: dict[str, dict[str, Any]] = {
        "graphsafe_s": {"label": "graphsafe: the load's refresh", "marker": "o", "color": "C0"},
        "added_s": {"label": "graphsafe: all it adds to the load", "marker": "o",
                    "color": "C0", "linestyle": "--"},
        "hand_s": {"label": "hand-written refresh of every buffer", "marker": "s",
                   "color": "C1"},
        "capture_s": {"label": "re-capture (capture alone)", "marker": "^", "color": "C3"},
    }
    recorder = "CUDA graph" if backend == "cuda" else "CPU graph"
    paths = []
    figures: tuple[tuple[str, Sequence[Point], str, str, Callable[[Any], None]], ...] = (
        (
            "refit_vs_size.png", by_size, "derivations (= parameters) in the model",
            f"Refit after loading every weight ({recorder}; {machine})",
            lambda ax: ax.set_xscale("log", base=2),
        ),
        (
            "refit_vs_fraction.png", by_fraction,
            "fraction of the weights loaded",
            f"Refit of {by_fraction[0].derivations if by_fraction else 0} derivations "
            f"({recorder}; {machine})",
            lambda ax: ax.set_xscale("log", base=2),
        ),
    )
    for name, points, xlabel, title, xscale in figures:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
        xs = [p.x for p in points]
        for field, style in styles.items():
            ax.plot(xs, [getattr(p, field) * 1e3 for p in points], **style)
        xscale(ax)
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" if x >= 1 else f"1/{round(1 / x)}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("milliseconds (median)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, format="png")
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Parse the options, measure both figures, print the tables, draw the PNGs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"),
                        help="folder for the PNGs (default docs/img)")
    add_machine_args(parser)
    parser.add_argument("--no-draw", action="store_true",
                        help="print the tables only (no matplotlib needed)")
    args = parser.parse_args(argv)
    device = machine(args, parser)
    sizes = PlotSizes.quick() if args.quick else PlotSizes.full()
    clock = Clock(device)
    _measure(clock, *_model(4, device), 2, 2.0, 1)  # one-time costs, before any figure
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    by_size = size_sweep(sizes, clock)
    by_fraction = fraction_sweep(sizes, clock)
    where = _machine(clock)
    print(f"graphsafe refit figures: {where}, torch {torch.__version__}, "
          f"{sizes.repeats} repeats, loadavg {load:.2f} on {os.cpu_count()} cores")
    print(table("\nfigure 1: load of every weight", "x", by_size))
    print(table(f"\nfigure 2: load of a fraction of {sizes.fraction_count}", "fraction",
                by_fraction))
    if not args.no_draw:
        for path in draw(by_size, by_fraction, args.out, where, device.type):
            print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
