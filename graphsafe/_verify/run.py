"""`run_verify`: `graphsafe verify` in one process.

Capture the forward with a guarded graph, refit it in random buckets several times,
replay and compare with eager after each; then the naive variant, unguarded and guarded.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from graphsafe import _native
from graphsafe._errors import GraphSafetyError, one_line
from graphsafe._graphs.graph import Graph
from graphsafe._runtime.runtime import runtime, weight_update
from graphsafe._verify.backend import choose_backend
from graphsafe._verify.measure import Phases, max_abs_diff, pointers
from graphsafe._verify.report import (
    TOLERANCE,
    ControlRow,
    RefitRow,
    VerifyReport,
    passed,
    verdict,
)
from graphsafe._verify.target import Checkpoint, VerifyTarget

__all__ = ["run_verify"]

Inputs = tuple[torch.Tensor, ...]


def run_verify(
    target: VerifyTarget,
    *,
    preset: str = "tiny",
    backend: str = "auto",
    refits: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Capture, refit, replay and compare; then the naive control.

    Args:
        target: The model family.
        preset: Its size preset.
        backend: `auto`, `cuda` or `cpu`.
        refits: How many refits of the managed model.
        seed: Seed of weights, inputs and bucket splits.
        progress: Called with a line of text as the run goes.

    Returns:
        The report; `report.ok` says whether everything held.

    Raises:
        GraphSafetyError: An unknown backend.
    """
    say = progress or (lambda line: None)
    chosen = choose_backend(backend)
    run = _Run(target, preset, torch.device(chosen), seed, random.Random(seed), say)
    with run.phase(f"build {target.name} ({preset}) and load its first weights"):
        model, x = run.build(naive=False)
    with torch.no_grad():
        graph = Graph(backend=chosen, guard=model)
        with run.phase(f"capture ({chosen} graph)"), graph.capture(warmup=lambda: model(*x)):
            out = model(*x)
        rows = _refits(run, graph, out, model, x, refits)
        with run.phase("control: the naive variant, unguarded and guarded"):
            control = _control(run, chosen)
    return VerifyReport(
        target=target.name,
        preset=preset,
        backend=graph.backend,
        device=str(run.device),
        torch_version=torch.__version__,
        guard=_native.describe(),
        tolerance=TOLERANCE,
        refits=tuple(rows),
        control=control,
        ok=passed(rows, control),
    )


@dataclass
class _Run:
    """What the steps of one run share: the target, where it runs, the seeded draws."""

    target: VerifyTarget
    preset: str
    device: torch.device
    seed: int
    rng: random.Random
    say: Callable[[str], None]

    def __post_init__(self) -> None:
        self.phase = Phases(self.say)

    def build(self, naive: bool) -> tuple[nn.Module, Inputs]:
        """A model of the preset with its first weights loaded, and its input."""
        model = self.target.build(self.preset, naive, self.device)
        model.load_weights(self.target.checkpoint(model, self.seed))  # type: ignore[operator]
        return model, self.target.example_input(model, self.seed)

    def refit(self, model: nn.Module, k: int, critical_last: bool) -> int:
        """Load refit `k`'s weights in random buckets, in one update; the bucket count."""
        ck = self.target.checkpoint(model, self.seed + 1 + k)
        buckets = _buckets(ck, self.rng, self.target.critical, critical_last)
        with weight_update(model):
            for bucket in buckets:
                model.load_weights(bucket)  # type: ignore[operator]
        return len(buckets)


def _refits(
    run: _Run, graph: Graph, out: torch.Tensor, model: nn.Module, x: Inputs, refits: int
) -> list[RefitRow]:
    """The managed model's refits, each replayed and compared with eager."""
    rows: list[RefitRow] = []
    previous = model(*x).clone()
    for k in range(refits):
        critical_last = k == 0
        before = pointers(model)
        try:
            with run.phase(f"refit {k + 1}/{refits}: bucketed load, replay, eager"):
                nb = run.refit(model, k, critical_last)
                report = runtime(model).last_report
                graph.replay()
                eager = model(*x)
        except GraphSafetyError as exc:
            rows.append(RefitRow(
                refit=k + 1, buckets=0, critical_last=critical_last, refreshed=(),
                storage_held=False, max_abs_diff=float("inf"), weights_effect=0.0,
                verdict="error", error=one_line(exc),
            ))
            run.say(f"refit {k + 1}: {one_line(exc)}")
            continue
        diff, effect = max_abs_diff(out, eager), max_abs_diff(eager, previous)
        previous = eager.clone()
        rows.append(RefitRow(
            refit=k + 1, buckets=nb, critical_last=critical_last,
            refreshed=report.refreshed if report is not None else (),
            storage_held=pointers(model) == before, max_abs_diff=diff, weights_effect=effect,
            verdict=verdict(diff, effect),
        ))
        run.say(f"refit {k + 1}: {rows[-1].verdict}")
    return rows


def _control(run: _Run, backend: Literal["cuda", "cpu"]) -> ControlRow:
    """The naive variant refitted once under an unguarded and a guarded graph."""
    naive, nx = run.build(naive=True)
    plain = Graph(backend=backend)
    with plain.capture(warmup=lambda: naive(*nx)):
        plain_out = naive(*nx)
    guarded = Graph(backend=backend, guard=naive)
    with guarded.capture(warmup=lambda: naive(*nx)):
        naive(*nx)
    run.refit(naive, 0, critical_last=True)
    plain.replay()
    ndiff = max_abs_diff(plain_out, naive(*nx))
    guard_error: str | None = None
    try:
        guarded.replay()
    except GraphSafetyError as exc:
        guard_error = one_line(exc)
    return ControlRow(
        unguarded_max_abs_diff=ndiff,
        stale_read=ndiff > TOLERANCE,
        guard_error=guard_error,
        caught=guard_error is not None,
    )


def _buckets(
    ck: Checkpoint, rng: random.Random, critical: Sequence[str], critical_last: bool
) -> list[Checkpoint]:
    """The checkpoint shuffled into 2 to 5 buckets; the critical entries last if asked."""
    entries = list(ck)
    rng.shuffle(entries)
    crit = [e for e in entries if critical_last and e[0].endswith(tuple(critical))]
    rest = [e for e in entries if e not in crit] if crit else entries
    n = rng.randint(2, 5)
    cuts = sorted(rng.sample(range(1, len(rest)), min(n - 1, len(rest) - 1)))
    out = [rest[i:j] for i, j in zip([0, *cuts], [*cuts, len(rest)])]
    if crit:
        out.append(crit)
    return [b for b in out if b]
