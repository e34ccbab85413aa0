"""`graphsafe verify`: capture a model, refit it several times, replay, compare to eager.

A verify target (a model family) says how to build the model, make checkpoints and
inputs; the runner does the rest the same way for every target: capture the forward with
a guarded graph, load new weights bucket by bucket, replay, and check that the replay
equals eager on the new weights. A control runs the same refits on the naive variant
(a fresh tensor bound on every load) and must show the stale read and the guard
catching it.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import import_module
from importlib.metadata import entry_points
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from graphsafe import _native
from graphsafe._errors import GraphSafetyError, one_line
from graphsafe._graphs.graph import Graph
from graphsafe._runtime.runtime import runtime, weight_update

__all__ = [
    "ControlRow",
    "RefitRow",
    "SyncRow",
    "VerifyReport",
    "VerifyTarget",
    "load_target",
    "run_verify",
]

Checkpoint = list[tuple[str, torch.Tensor]]


class VerifyTarget(Protocol):
    """What a model family provides to `graphsafe verify`."""

    name: str
    presets: tuple[str, ...]
    critical: tuple[str, ...]
    """Suffixes of checkpoint names put in the last bucket of one refit."""

    def build(self, preset: str, naive: bool, device: torch.device) -> nn.Module:
        """A model of the preset; `naive` gives the pre-fix rebinding variant."""
        ...

    def checkpoint(self, model: nn.Module, seed: int) -> Checkpoint:
        """A full checkpoint of random weights for `model`."""
        ...

    def example_input(self, model: nn.Module, seed: int) -> tuple[torch.Tensor, ...]:
        """Static inputs for the captured forward."""
        ...


class RefitRow(BaseModel):
    """One refit of the managed model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refit: int
    """1-based refit number."""
    buckets: int
    """How many `load_weights` calls the checkpoint was split into."""
    critical_last: bool
    """Whether the critical tensors (e.g. `hc_attn_fn`) came in the last bucket."""
    refreshed: tuple[str, ...]
    """Derived buffers refreshed in place by this refit."""
    storage_held: bool
    """Whether every tensor the graph reads kept its storage."""
    max_abs_diff: float
    """max |replay - eager| on the new weights."""
    weights_effect: float
    """max |eager(new) - eager(old)|: how much the refit changed the output."""
    verdict: Literal["exact", "stale", "no-effect", "error"]
    """`exact`: replay equals eager; `stale`: it does not; `no-effect`: the refit did not
    change the output, so the row proves nothing; `error`: the refit raised."""
    error: str | None = None
    """The error, where one was raised."""


class ControlRow(BaseModel):
    """The naive variant (a fresh tensor bound on every load) under the same refit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unguarded_max_abs_diff: float
    """max |replay - eager| of an unguarded graph after the refit (must be > tolerance)."""
    stale_read: bool
    """Whether the unguarded replay read stale memory (the bug reproduced)."""
    guard_error: str | None
    """What the guarded replay raised (class and first line), or None if it replayed."""
    caught: bool
    """Whether the guard refused to replay stale memory."""


class SyncRow(BaseModel):
    """One pipeline stage's side of one weight sync (`graphsafe verify --pp N`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refit: int
    """1-based refit number."""
    stage: int
    """Pipeline rank (`pp_rank`) of the stage; its process is rank `stage + 1`."""
    layers: str
    """The global layer indices the stage holds, `start-stop` inclusive."""
    accepted: int
    """Checkpoint entries its loader took (the others belong to other stages)."""
    bytes: int
    """Bytes of the whole sync it received."""
    buckets: int
    """Buckets of the sync."""
    seconds: float
    """Wall time of `receive_weights` on the stage, refresh included."""
    refresh_seconds: float
    """Of which the one refresh of the derived buffers at the end."""
    refreshed: tuple[str, ...]
    """Derived buffers refreshed in place."""
    storage_held: bool
    """Whether every tensor of the stage kept its storage."""
    error: str | None = None
    """What the stage raised, if it raised."""


class VerifyReport(BaseModel):
    """The whole verify run; `ok` is the exit status."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    """The model family."""
    preset: str
    """Its size preset."""
    backend: str
    """Graph backend: `cuda` (real CUDA graphs) or `cpu` (the CPU graph)."""
    device: str
    """Device the model ran on."""
    torch_version: str
    """PyTorch version."""
    tolerance: float
    """Largest |replay - eager| counted as exact."""
    refits: tuple[RefitRow, ...]
    """One row per refit of the managed model."""
    control: ControlRow
    """The naive variant's row."""
    ok: bool
    """Every managed refit exact and the control detected."""
    pp: int | None = None
    """Pipeline stages of the distributed mode (`--pp N`: a trainer process and N stage
    processes over gloo); None for the single-process run."""
    syncs: tuple[SyncRow, ...] = ()
    """In the distributed mode, one row per refit and stage."""
    guard: str = ""
    """Which path the guard's checks took in this process: `native (...)` (compiled,
    `graphsafe native build`) or `python (...)`, with the reason."""


def load_target(spec: str) -> VerifyTarget:
    """Find a verify target by entry-point name or `module:attribute`.

    Args:
        spec: e.g. `deepseek_v4` (entry point in group `graphsafe.targets`) or
            `my_pkg.models:target`.

    Returns:
        The target object.

    Raises:
        GraphSafetyError: If no such target exists.
    """
    if ":" in spec:
        module, _, attr = spec.partition(":")
        try:
            if os.getcwd() not in sys.path:
                # Like `python -m`: a target module in the working directory is found.
                sys.path.insert(0, os.getcwd())
            return getattr(import_module(module), attr)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise GraphSafetyError(
                f"cannot load verify target {spec!r}",
                expected="module:attribute naming an importable object",
                got=f"{type(exc).__name__}: {exc}",
                fix="install the module or put its folder on PYTHONPATH, and check the "
                "attribute name",
            ) from exc
    found = {ep.name: ep for ep in entry_points(group="graphsafe.targets")}
    if spec not in found:
        raise GraphSafetyError(
            f"unknown verify target {spec!r}",
            expected="an entry point of group 'graphsafe.targets' or 'module:attribute'",
            got=f"installed targets: {', '.join(sorted(found)) or 'none'}",
            fix="install graphsafe (pip install -e .) so its entry points are registered, or "
            "pass --target module:attribute",
        )
    return found[spec].load()  # type: ignore[no-any-return]


def _buckets(
    ck: Checkpoint, rng: random.Random, critical: Sequence[str], critical_last: bool
) -> list[Checkpoint]:
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


def _pointers(model: nn.Module) -> list[int]:
    return [t.data_ptr() for t in [*model.parameters(), *model.buffers()]]


class _Phases:
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
    """
    say = progress or (lambda line: None)
    phase = _Phases(say)
    chosen: Literal["cuda", "cpu"]
    if backend == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    elif backend in ("cuda", "cpu"):
        chosen = "cuda" if backend == "cuda" else "cpu"
    else:
        raise GraphSafetyError(
            f"unknown backend {backend!r}", expected="auto, cuda or cpu", got=backend,
            fix="pass --backend auto, cuda or cpu",
        )
    device = torch.device(chosen)
    rng = random.Random(seed)
    tol = 1e-5

    def build(naive: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        model = target.build(preset, naive, device)
        model.load_weights(target.checkpoint(model, seed))  # type: ignore[operator]
        return model, target.example_input(model, seed)

    def refit(model: nn.Module, k: int, critical_last: bool) -> int:
        ck = target.checkpoint(model, seed + 1 + k)
        buckets = _buckets(ck, rng, target.critical, critical_last)
        with weight_update(model):
            for bucket in buckets:
                model.load_weights(bucket)  # type: ignore[operator]
        return len(buckets)

    with phase(f"build {target.name} ({preset}) and load its first weights"):
        model, x = build(naive=False)
    with torch.no_grad():
        graph = Graph(backend=chosen, guard=model)
        with phase(f"capture ({chosen} graph)"), graph.capture(warmup=lambda: model(*x)):
            out = model(*x)
        previous = model(*x).clone()
        rows: list[RefitRow] = []
        for k in range(refits):
            critical_last = k == 0
            before = _pointers(model)
            try:
                with phase(f"refit {k + 1}/{refits}: bucketed load, replay, eager"):
                    nb = refit(model, k, critical_last)
                    report = runtime(model).last_report
                    graph.replay()
                    eager = model(*x)
            except GraphSafetyError as exc:
                rows.append(
                    RefitRow(
                        refit=k + 1, buckets=0, critical_last=critical_last, refreshed=(),
                        storage_held=False, max_abs_diff=float("inf"), weights_effect=0.0,
                        verdict="error", error=one_line(exc),
                    )
                )
                say(f"refit {k + 1}: {one_line(exc)}")
                continue
            diff = (out - eager).abs().max().item()
            effect = (eager - previous).abs().max().item()
            previous = eager.clone()
            verdict: Literal["exact", "stale", "no-effect"] = (
                "stale" if diff > tol else "no-effect" if effect <= tol else "exact"
            )
            rows.append(
                RefitRow(
                    refit=k + 1,
                    buckets=nb,
                    critical_last=critical_last,
                    refreshed=report.refreshed if report is not None else (),
                    storage_held=_pointers(model) == before,
                    max_abs_diff=diff,
                    weights_effect=effect,
                    verdict=verdict,
                )
            )
            say(f"refit {k + 1}: {verdict}")

        with phase("control: the naive variant, unguarded and guarded"):
            naive, nx = build(naive=True)
            plain = Graph(backend=chosen)
            with plain.capture(warmup=lambda: naive(*nx)):
                plain_out = naive(*nx)
            guarded = Graph(backend=chosen, guard=naive)
            with guarded.capture(warmup=lambda: naive(*nx)):
                naive(*nx)
            refit(naive, 0, critical_last=True)
            plain.replay()
            ndiff = (plain_out - naive(*nx)).abs().max().item()
            guard_error: str | None = None
            try:
                guarded.replay()
            except GraphSafetyError as exc:
                guard_error = one_line(exc)
            control = ControlRow(
                unguarded_max_abs_diff=ndiff,
                stale_read=ndiff > tol,
                guard_error=guard_error,
                caught=guard_error is not None,
            )
    ok = bool(rows) and all(r.verdict == "exact" and r.storage_held for r in rows)
    ok = ok and control.stale_read and control.caught
    return VerifyReport(
        target=target.name,
        preset=preset,
        backend=graph.backend,
        device=str(device),
        torch_version=torch.__version__,
        guard=_native.describe(),
        tolerance=tol,
        refits=tuple(rows),
        control=control,
        ok=ok,
    )


def format_report(report: VerifyReport) -> str:
    """The report as a readable table.

    Args:
        report: A verify report.

    Returns:
        Text for a terminal.
    """
    graph = "real CUDA graphs" if report.backend == "cuda" else "the CPU graph"
    where = (f"a trainer and {report.pp} pipeline stage(s) over gloo, " if report.pp else "")
    lines = [
        f"graphsafe verify: {report.target} (preset {report.preset}) on {report.device}, "
        f"{where}{graph}, torch {report.torch_version}",
        "",
        f"{'refit':>5}  {'buckets':>7}  {'critical last':>13}  {'refreshed':>9}  "
        f"{'storage held':>12}  {'max|replay-eager|':>17}  {'max|new-old|':>12}  verdict",
    ]
    legend = (
        "(buckets: load calls; critical last: derivation inputs came last; refreshed: "
        "derivations recomputed; storage held: no tensor moved; 0 replay-eager is exact)"
    )
    if report.pp:
        legend = (
            "(buckets: broadcasts of the sync; critical last: derivation inputs came last; "
            "refreshed: derivations recomputed on all stages; storage held: no tensor of any "
            "stage moved; replay-eager: last stage's replayed logits against the trainer's "
            "eager logits)"
        )
    for r in report.refits:
        lines.append(
            f"{r.refit:>5}  {r.buckets:>7}  {'yes' if r.critical_last else 'no':>13}  "
            f"{len(r.refreshed):>9}  {'yes' if r.storage_held else 'NO':>12}  "
            f"{r.max_abs_diff:>17.3e}  {r.weights_effect:>12.3e}  "
            + (r.verdict if r.error is None else f"{r.verdict}: {r.error}")
        )
    c = report.control
    lines.append(legend)
    if report.syncs:
        lines += [
            "",
            f"{'refit':>5}  {'stage':>5}  {'layers':>6}  {'accepted':>8}  {'MiB':>8}  "
            f"{'sync s':>8}  {'refresh s':>9}  {'refreshed':>9}  storage held",
        ]
        for y in report.syncs:
            lines.append(
                f"{y.refit:>5}  {y.stage:>5}  {y.layers:>6}  {y.accepted:>8}  "
                f"{y.bytes / 2**20:>8.2f}  {y.seconds:>8.4f}  {y.refresh_seconds:>9.4f}  "
                f"{len(y.refreshed):>9}  {'yes' if y.storage_held else 'NO'}"
                + (f"  error: {y.error}" if y.error else "")
            )
    lines += [
        "",
        "control: naive variant (binds a fresh derived tensor on every load)",
        f"  unguarded replay after refit: max|replay-eager| = {c.unguarded_max_abs_diff:.3e}"
        f"  -> {'stale read reproduced' if c.stale_read else 'NOT reproduced'}",
        "  guarded replay after refit:   "
        + (f"refused ({c.guard_error})" if c.caught else "replayed stale memory: NOT caught"),
        "",
        *([f"guard checks: {report.guard}"] if report.guard else []),
        f"tolerance {report.tolerance:.0e}; "
        + ("PASS: every refit exact, control detected" if report.ok else "FAIL"),
    ]
    return "\n".join(lines)
