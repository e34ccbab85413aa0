"""`run_verify`: `graphsafe verify` in one process.

Capture the forward with a guarded graph, refit it in random buckets several times;
after each, replay, audit the model's derived tensors and compare the replay with a
model built fresh from the refit's checkpoint (`oracle`); then the naive variant,
unguarded and guarded.

What every verify run shares, the `--pp` mode too, is here: the graph backend it picks
(`choose_backend`), how it says each phase as it goes (`Phases`), and what it measures
(`pointers`, `max_abs_diff`).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn

from graphsafe import _native
from graphsafe._errors import GraphSafetyError
from graphsafe._graphs.graph import Graph
from graphsafe._runtime.runtime import runtime, weight_update
from graphsafe._verify.report.format import quote
from graphsafe._verify.report.rows import (
    TOLERANCE,
    ControlRow,
    RefitRow,
    VerifyReport,
    passed,
    verdict,
)
from graphsafe._verify.single.oracle import Oracle, audit_model, differing, fresh_model
from graphsafe._verify.target import Checkpoint, VerifyTarget

__all__ = ["Phases", "choose_backend", "max_abs_diff", "pointers", "run_verify"]

Inputs = tuple[torch.Tensor, ...]


def run_verify(
    target: VerifyTarget,
    *,
    preset: str = "tiny",
    backend: str = "auto",
    refits: int = 3,
    seed: int = 0,
    oracle: Oracle = "fresh",
    audit: bool = True,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Capture, refit, replay and compare; then the naive control.

    Args:
        target: The model family.
        preset: Its size preset.
        backend: `auto`, `cuda` or `cpu`.
        refits: How many refits of the managed model.
        seed: Seed of weights, inputs and bucket splits.
        oracle: What each replay is compared with: `fresh`, a model built anew from the
            checkpoint after every refit (its parameters and declared derived buffers
            compared with the model's too); `self`, the model's own eager forward, which
            reads the same derived state as the replay (the check before the fresh
            oracle, blind to writes graphsafe does not see).
        audit: Run the content audit (`graphsafe.audit`) after every refit.
        progress: Called with a line of text as the run goes.

    Returns:
        The report; `report.ok` says whether everything held.

    Raises:
        GraphSafetyError: An unknown backend.
    """
    say = progress or (lambda line: None)
    chosen = choose_backend(backend)
    run = _Run(target, preset, torch.device(chosen), seed, random.Random(seed), say,
               oracle, audit)
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
        oracle=oracle,
        audit=audit,
        oracle_seconds=run.oracle_seconds,
        audit_seconds=run.audit_seconds,
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
    oracle: Oracle = "fresh"
    audit: bool = True
    oracle_seconds: float = 0.0
    audit_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.phase = Phases(self.say)

    def build(self, naive: bool) -> tuple[nn.Module, Inputs]:
        """A model of the preset with its first weights loaded, and its input."""
        model = self.target.build(self.preset, naive, self.device)
        model.load_weights(self.target.checkpoint(model, self.seed))  # type: ignore[operator]
        return model, self.target.example_input(model, self.seed)

    def refit(self, model: nn.Module, k: int, critical_last: bool) -> tuple[Checkpoint, int]:
        """Load refit `k`'s weights in random buckets, in one update; the checkpoint and
        the bucket count."""
        ck = self.target.checkpoint(model, self.seed + 1 + k)
        buckets = _buckets(ck, self.rng, self.target.critical, critical_last)
        with weight_update(model):
            for bucket in buckets:
                model.load_weights(bucket)  # type: ignore[operator]
        return ck, len(buckets)

    def judge(self, model: nn.Module, ck: Checkpoint, x: Inputs) -> _Judged:
        """After a refit's replay: the audit, then the oracle's output and the tensors
        of `model` that differ from the fresh model's."""
        audited = audit_model(model) if self.audit else None
        self.audit_seconds += audited.seconds if audited is not None else 0.0
        t0 = time.perf_counter()
        stale: list[str] = []
        problems: list[str] = []
        if self.oracle == "fresh":
            fresh = fresh_model(self.target, self.preset, self.device, ck)
            eager = fresh(*x)
            wrong = differing(model, fresh, self.target.name)
            del fresh
            if wrong is not None:
                stale += wrong.paths
                problems.append(quote(wrong))
        else:
            eager = model(*x)
        self.oracle_seconds += time.perf_counter() - t0
        if audited is not None:
            stale += [p for p in audited.stale if p not in stale]
            problems += [audited.problem] if audited.problem else []
        return _Judged(eager, tuple(stale), "; ".join(problems) or None,
                       audited.checked if audited is not None else None,
                       audited.unchecked if audited is not None else 0)


class _Judged(NamedTuple):
    """What the oracle and the audit made of one refit."""

    eager: torch.Tensor
    stale: tuple[str, ...]
    problem: str | None
    audited: int | None
    unaudited: int


def _refits(
    run: _Run, graph: Graph, out: torch.Tensor, model: nn.Module, x: Inputs, refits: int
) -> list[RefitRow]:
    """The managed model's refits, each replayed and compared with the oracle."""
    rows: list[RefitRow] = []
    previous = model(*x).clone()
    checks = ", ".join([*(["audit"] if run.audit else []),
                        "fresh model" if run.oracle == "fresh" else "eager"])
    for k in range(refits):
        critical_last = k == 0
        before = pointers(model)
        try:
            with run.phase(f"refit {k + 1}/{refits}: bucketed load, replay, {checks}"):
                ck, nb = run.refit(model, k, critical_last)
                report = runtime(model).last_report
                graph.replay()
                judged = run.judge(model, ck, x)
        except GraphSafetyError as exc:
            rows.append(RefitRow(
                refit=k + 1, buckets=0, critical_last=critical_last, refreshed=(),
                storage_held=False, max_abs_diff=float("inf"), weights_effect=0.0,
                verdict="error", error=quote(exc),
            ))
            run.say(f"refit {k + 1}: {quote(exc)}")
            continue
        eager = judged.eager
        diff, effect = max_abs_diff(out, eager), max_abs_diff(eager, previous)
        previous = eager.clone()
        rows.append(RefitRow(
            refit=k + 1, buckets=nb, critical_last=critical_last,
            refreshed=report.refreshed if report is not None else (),
            storage_held=pointers(model) == before, max_abs_diff=diff, weights_effect=effect,
            verdict=verdict(diff, effect, judged.stale), error=judged.problem,
            stale=judged.stale, audited=judged.audited, unaudited=judged.unaudited,
        ))
        run.say(f"refit {k + 1}: {rows[-1].verdict}"
                + (f": {judged.problem}" if judged.problem else ""))
    return rows


def _control(run: _Run, backend: Literal["cuda", "cpu"]) -> ControlRow:
    """The naive variant refitted once under an unguarded and a guarded graph, each step
    said as it goes (on the flash preset the whole takes tens of seconds)."""
    with run.phase("control 1/5: build the naive variant and load its first weights"):
        naive, nx = run.build(naive=True)
    plain = Graph(backend=backend)
    with run.phase("control 2/5: capture it unguarded"), plain.capture(
        warmup=lambda: naive(*nx)
    ):
        plain_out = naive(*nx)
    guarded = Graph(backend=backend, guard=naive)
    with run.phase("control 3/5: capture it guarded"), guarded.capture(
        warmup=lambda: naive(*nx)
    ):
        naive(*nx)
    with run.phase("control 4/5: refit it once (bucketed load)"):
        run.refit(naive, 0, critical_last=True)
    with run.phase("control 5/5: replay unguarded, run eagerly, replay guarded"):
        plain.replay()
        ndiff = max_abs_diff(plain_out, naive(*nx))
        guard_error: str | None = None
        try:
            guarded.replay()
        except GraphSafetyError as exc:
            guard_error = quote(exc)
    return ControlRow(
        unguarded_max_abs_diff=ndiff,
        stale_read=ndiff > TOLERANCE,
        guard_error=guard_error,
        caught=guard_error is not None,
    )


def _buckets(
    ck: Checkpoint, rng: random.Random, critical: Sequence[str], critical_last: bool
) -> list[Checkpoint]:
    """The checkpoint shuffled into 2 to 5 buckets (fewer only for a checkpoint of fewer
    entries); the critical entries last if asked, their bucket one of the count."""
    entries = list(ck)
    rng.shuffle(entries)
    crit = [e for e in entries if critical_last and e[0].endswith(tuple(critical))]
    rest = [e for e in entries if e not in crit] if crit else entries
    n = rng.randint(2, 5) - (1 if crit and len(rest) > 1 else 0)  # buckets of `rest`
    cuts = sorted(rng.sample(range(1, len(rest)), max(0, min(n - 1, len(rest) - 1))))
    out = [rest[i:j] for i, j in zip([0, *cuts], [*cuts, len(rest)])]
    if crit:
        out.append(crit)
    return [b for b in out if b]


def choose_backend(backend: str) -> Literal["cuda", "cpu"]:
    """`cuda` or `cpu` as asked; `auto`: `cuda` where a GPU is visible.

    Raises:
        GraphSafetyError: Any other name.
    """
    if backend not in ("auto", "cuda", "cpu"):
        raise GraphSafetyError(
            f"unknown backend {backend!r}", expected="auto, cuda or cpu", got=backend,
            fix="pass --backend auto, cuda or cpu",
        )
    if backend == "cuda" or (backend == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


class Phases:
    """Says each phase of the run as it starts and ends, with its wall time."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._say(f"[{t0 - self._start:7.2f}s] {name} ...")
        yield
        self._say(f"[{time.perf_counter() - self._start:7.2f}s] {name}: done in "
                  f"{time.perf_counter() - t0:.2f}s")


def pointers(model: nn.Module) -> list[int]:
    """The data pointers of every parameter and buffer: equal lists, no tensor moved."""
    return [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|."""
    return float((a - b).abs().max().item())
