"""Figure 11: what recording provenance costs, and what discovered state costs a replay.

- 11a: a first load of ~2,000 small tensors (vLLM-style), tracked with provenance
  recorded, against the untracked load; the same tracked load without recording
  (`GRAPHSAFE_PROVENANCE=0`) is in the details, so the recorder's own share shows.
- 11b: the same for the first load of the flagship preset (`fig7_preset`, flash at full
  size), with a post-load step that packs a copy of every layer's attention weight, as an
  engine's would.
  Each sample of 11a and 11b loads a model built for it, after the last sample's model,
  its recording and the storages the journal tracked for it are dropped: what a first
  load pays in a fresh process.
- 11c: a guarded replay of a graph that reads the packed copies (discovered, checked at
  every replay), against the same graph over the same model whose copies were made with
  recording off (nothing discovered): the per-replay cost of discovered state.
- 11d: the same for numbers: a post-load step that takes a Python number from every 2-D
  weight (a scale, as vLLM's `_k_scale_float`), which the graph bakes in; each checked
  at every replay (changed since the capture: refused), against the same graph over the
  same model whose numbers were taken with recording off.
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_models import llm_stack_class, untracked_load
from harness import Row, Stat, interleave, paired, paired_diff, profile_per_item
from torch import nn

import graphsafe as gs
import graphsafe.models.deepseek_v4 as dsv4
from graphsafe._lineage.record.recorder import RECORDING
from graphsafe._lineage.window import end_here, sweep
from graphsafe._memory.journal import JOURNAL

__all__ = ["fig11"]


def _without_recording(fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        mode, RECORDING[0] = RECORDING[0], "off"
        try:
            return fn()
        finally:
            RECORDING[0] = mode

    return run


def _post_load(model: nn.Module) -> None:
    """An engine's post-load step: a kernel-layout copy of every 2-D weight, kept in a
    closure on its module."""
    for module in model.modules():
        for name, w in list(module._parameters.items()):
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                packed = w.detach().t().contiguous()
                setattr(module, f"{name}_kernel", lambda packed=packed: packed)


def _kernels(model: nn.Module) -> list[Callable[[], torch.Tensor]]:
    return [v for m in model.modules() for k, v in vars(m).items() if k.endswith("_kernel")]


_PHASES = ("enter", "loader", "post_load", "exit")
"""A sample's parts (`phases_ms`): `gs.weight_update`'s entry, the loader, the post-load
step and the block's exit (where the load ends: the refresh, and what the recording
found settled); the untracked case has no entry or exit (0)."""


def _load_row(ctx: Any, fig: str, name: str, make: Callable[[], nn.Module],
              ckpt: list[tuple[str, torch.Tensor]], target: float) -> Row:
    """A first load and post-load step of a model built anew for each sample."""
    last: list[nn.Module] = []
    phases: dict[str, list[tuple[float, ...]]] = {}

    def first_load(track: bool, case_name: str) -> Callable[[], float]:
        marks = phases.setdefault(case_name, [])

        def case() -> float:
            last.clear()
            gc.collect()  # the last sample's model (the figures run with gc paused)
            sweep()  # and its recording, which the next load would free (3-5 ms on 11a)
            JOURNAL.sweep()  # and its storages, which the next load would forget: a first
            # load in a fresh process has none
            model = make()  # untimed
            last.append(model)
            at: list[float] = []
            mark = at.append
            now = time.perf_counter
            if not track:

                def bare() -> None:
                    mark(now())
                    untracked_load(model, ckpt)
                    mark(now())
                    _post_load(model)
                    mark(now())

                took = ctx.clock.time(bare)
                marks.append((0.0, at[1] - at[0], at[2] - at[1], 0.0))
                return took

            def load() -> None:  # one observed load: the loader, then the post-load step
                mark(now())
                with gs.weight_update(model):
                    mark(now())
                    model.load_weights(ckpt)
                    mark(now())
                    _post_load(model)
                    mark(now())
                mark(now())

            took = ctx.clock.time(load)
            marks.append(tuple(b - a for a, b in itertools.pairwise(at)))
            return took

        return case

    stats = interleave({
        "recorded": first_load(True, "recorded"),
        "not_recorded": _without_recording(first_load(True, "not_recorded")),
        "untracked": first_load(False, "untracked"),
    }, ctx.sizes.repeats)
    r, n, u = stats["recorded"], stats["not_recorded"], stats["untracked"]
    repeats = ctx.sizes.repeats
    last.clear()
    blocks = {"untracked": _blocks_kept(lambda m: (untracked_load(m, ckpt), _post_load(m)),
                                        make)}
    probe = make()

    def recorded(model: nn.Module) -> None:
        with gs.weight_update(model):
            model.load_weights(ckpt)
            _post_load(model)

    blocks["recorded"] = _blocks_kept(recorded, make, probe)
    found = len(gs.runtime(probe).discovered)
    ratio = paired(r, u)
    details: dict[str, Any] = {
        "tensors": len(ckpt), "discovered": found,
        "not_recorded_ratio": round(paired(n, u), 3),
        "recorded_over_not_recorded": round(paired(r, n), 3),
        "python_blocks_kept": blocks,
        "phases_ms": {case: dict(zip(_PHASES, (round(statistics.median(p) * 1e3, 2)
                                              for p in zip(*samples[-repeats:])), strict=True))
                      for case, samples in phases.items()}}  # the timed samples, no warm-up
    del probe
    if ratio > target or ctx.profile:
        text, top = _profile(fig, make, ckpt)
        ctx.profiles.append(text)
        details["cprofile"] = top
    return Row(fig, f"{name}: first load + post-load, recorded", r.median, u.median,
               "untracked load + post-load", ratio=ratio,
               ratio_def="recorded / untracked", op="<=", target=target, details=details)


def _blocks_kept(load: Callable[[nn.Module], Any], make: Callable[[], nn.Module],
                 model: nn.Module | None = None) -> int:
    """The Python heap's blocks that one first load and post-load step (`load`) of a model
    (`model`, or one `make` builds first) leave allocated, the model's new ones included:
    how many objects a sample makes to keep. Untimed, and free of the machine's noise: in
    a process whose heap earlier work left used, each such object costs about a cache miss
    to make (`benchmarks/README.md`), which is what separates 11a run alone from 11a in a
    full run."""
    model = make() if model is None else model
    gc.collect()
    before = sys.getallocatedblocks()
    load(model)
    end_here()  # the bring-up's tail: not left recording
    gc.collect()
    return sys.getallocatedblocks() - before


def _profile(fig: str, make: Callable[[], nn.Module], ckpt: list[tuple[str, torch.Tensor]],
             rounds: int = 3) -> tuple[str, list[tuple[str, int, float]]]:
    """A cProfile of recorded first loads + post-load steps, each of a model built before
    the profiler starts, per 1,000 checkpoint tensors."""
    models = [make() for _ in range(rounds)]

    def one() -> None:
        model = models.pop()
        with gs.weight_update(model):
            model.load_weights(ckpt)
            _post_load(model)

    gc.collect()
    return profile_per_item(one, len(ckpt), f"{fig}'s recorded first load + post-load",
                            "tensor", rounds=rounds, per=1000)


def fig11(ctx: Any) -> list[Row]:
    """Provenance on a first load (small tensors, the flagship), and per replay.

    An engine's bring-up runs in a process of its own: the models earlier figures keep
    bound for later ones (figure 2's 12,000 modules) are dropped first, since a recorded
    load reads every other bound model's weights (a copy from one is a derivation)."""
    ctx.drop_shared()
    reg = gs.Registry()
    layers = ctx.sizes.fig4_small_layers
    gen = torch.Generator().manual_seed(3)

    def small() -> nn.Module:
        return llm_stack_class(reg, 32, 32)(layers)

    probe = small()
    ckpt = [(n, torch.randn(p.shape, generator=gen)) for n, p in probe.named_parameters()]
    rows = []
    if ctx.wants("11a"):
        rows.append(_load_row(ctx, "11a", f"{len(ckpt)} small tensors", small, ckpt, 3.0))
    if ctx.wants("11b"):
        preset = ctx.sizes.fig7_preset
        config = dsv4.DeepseekV4Config.preset(preset)

        def flagship() -> nn.Module:
            return dsv4.DeepseekV4Model(config)

        fckpt = list(dsv4.random_checkpoint(config, seed=0))
        rows.append(_load_row(ctx, "11b", preset, flagship, fckpt, 1.2))
    if ctx.wants("11c"):
        rows.append(_replay_row(ctx, layers, reg, ckpt))
    if ctx.wants("11d"):
        rows.append(_numbers_row(ctx, layers, reg, ckpt))
    return rows


def _replay_row(ctx: Any, layers: int, reg: gs.Registry,
                ckpt: list[tuple[str, torch.Tensor]]) -> Row:
    def build(record: bool) -> tuple[nn.Module, gs.Graph]:
        model = llm_stack_class(reg, 32, 32)(layers)
        first = (lambda: _first_load(model)) if record else _without_recording(
            lambda: _first_load(model))
        first()
        kernels = _kernels(model)
        g = gs.Graph(backend="cpu", guard=model)
        with torch.no_grad(), g.capture():
            total = torch.zeros(())
            for k in kernels:
                total = total + k().sum()
        return model, g

    def _first_load(model: nn.Module) -> None:
        with gs.weight_update(model):
            model.load_weights(ckpt)
            _post_load(model)

    return _discovered_row(ctx, "11c", "guarded replay reading {} discovered tensors", 1.1,
                           build)


def _take_scales(model: nn.Module) -> None:
    """A post-load step that keeps a number taken from every 2-D weight on its module."""
    for module in model.modules():
        for name, w in list(module._parameters.items()):
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                setattr(module, f"{name}_scale", w.abs().max().item())


def _numbers_row(ctx: Any, layers: int, reg: gs.Registry,
                 ckpt: list[tuple[str, torch.Tensor]]) -> Row:
    def build(record: bool) -> tuple[nn.Module, gs.Graph]:
        model = llm_stack_class(reg, 32, 32)(layers)

        def first() -> None:
            with gs.weight_update(model):
                model.load_weights(ckpt)
                _take_scales(model)

        (first if record else _without_recording(first))()
        scaled = [(w, getattr(m, f"{n}_scale")) for m in model.modules()
                  for n, w in m._parameters.items() if w is not None and w.dim() == 2]
        g = gs.Graph(backend="cpu", guard=model)
        with torch.no_grad(), g.capture():
            total = torch.zeros(())
            for w, scale in scaled:  # each number baked into the graph
                total = total + w.sum() * scale
        return model, g

    return _discovered_row(ctx, "11d", "guarded replay holding {} discovered numbers", 1.05,
                           build)


def _discovered_row(ctx: Any, fig: str, measure: str, target: float,
                    build: Callable[[bool], tuple[nn.Module, gs.Graph]]) -> Row:
    """A row of guarded replays: the graph `build(True)` makes over a model whose state
    was discovered (`measure` takes how much), against `build(False)`'s, the same model
    with recording off (nothing discovered)."""
    found_model, found = build(True)
    plain_model, plain = build(False)
    n_found = len(gs.runtime(found_model).discovered)
    assert n_found > 0 and not gs.runtime(plain_model).discovered
    d, n, guard = _side_by_side(ctx, (found_model, found), (plain_model, plain))
    return Row(fig, measure.format(n_found), d.median, n.median,
               "the same replay, nothing discovered", ratio=paired(d, n),
               ratio_def="discovered / none", op="<=", target=target,
               details={"discovered": n_found, **guard})


def _side_by_side(ctx: Any, found: tuple[nn.Module, gs.Graph], plain: tuple[nn.Module, gs.Graph]
                  ) -> tuple[Stat, Stat, dict[str, Any]]:
    """The guarded replays of the two graphs, interleaved, and each model's guard alone
    (an empty graph's guarded replay: the checks of the model's state, discovered state
    included; the ledger of what the real graphs read is the same on both sides). Every
    graph is reset at the end: no pin of this row is left for the next to pay for.

    Returns:
        The replays' samples (discovered, none), and the guards' medians and their
        paired difference over the plain replay, for the details.
    """
    guards = []
    for model, _ in (found, plain):
        empty = gs.Graph(backend="cpu", guard=model)
        with empty.capture():
            pass
        guards.append(empty)
    stats = interleave({
        "discovered": ctx.timer(found[1].replay, number=20),
        "none": ctx.timer(plain[1].replay, number=20),
        "guard_discovered": ctx.timer(guards[0].replay, number=20),
        "guard_none": ctx.timer(guards[1].replay, number=20),
    }, ctx.sizes.repeats)
    for graph in (found[1], plain[1], *guards):
        graph.reset()
    d, n = stats["discovered"], stats["none"]
    gd, gn = stats["guard_discovered"], stats["guard_none"]
    return d, n, {
        "guard": {"discovered_s": gd.median, "none_s": gn.median},
        "guard_difference_over_replay": round(paired_diff(gd, gn) / n.median, 4),
    }
