"""The trainer side of `graphsafe verify --pp N`: rank 0, with the full model.

For each refit the trainer draws a checkpoint, sends it to the stages with
`graphsafe.distributed.send_weights` and runs the oracle on it: a full model built fresh
from the checkpoint (`oracle="fresh"`), or its own model with the checkpoint loaded
(`"self"`); the last stage's logits come back and are compared with the oracle's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphsafe._verify.pp.job import Job
from graphsafe._verify.pp.messages import gather_rows, recv_stream
from graphsafe._verify.report.rows import (
    TOLERANCE,
    ControlRow,
    RefitRow,
    SyncRow,
    VerifyReport,
    passed,
    verdict,
)
from graphsafe._verify.single.oracle import fresh_model
from graphsafe._verify.single.run import Phases, max_abs_diff
from graphsafe._verify.target import Checkpoint
from graphsafe.distributed import SendReport, send_weights

__all__ = ["trainer"]

Inputs = tuple[torch.Tensor, ...]


def trainer(job: Job, say: Callable[[str], None]) -> VerifyReport:
    """Rank 0: the full model, the checkpoints, the comparisons, the report."""
    phase = Phases(say)
    target = job.target
    with phase(f"trainer: build {target.name} ({job.preset}) and load its first weights"):
        full = target.build(job.preset, False, torch.device(job.device))
        ck = target.checkpoint(full, job.seed)
        full.load_weights(ck)  # type: ignore[operator]
        x = target.example_input(full, job.seed)
    with phase(f"first sync to {job.pp} stage(s), build there, eager pipeline pass"):
        _send(ck, job.seed)
        eager = full(*x)
        recv_stream(job.pp)
    with phase(f"stages: capture ({job.backend} graph)"):
        dist.barrier()
    rows: list[RefitRow] = []
    syncs: list[SyncRow] = []
    previous = eager.clone()
    oracle_seconds = 0.0
    checks = "stages audit, " if job.audit else ""
    checks += "fresh model" if job.oracle == "fresh" else "eager"
    for k in range(job.refits):
        with phase(f"refit {k + 1}/{job.refits}: sync, pipeline replay, {checks}"):
            eager, logits, sent, stage_rows, seconds = _refit(job, full, x, k)
        oracle_seconds += seconds
        syncs += [SyncRow(refit=k + 1, **r) for r in stage_rows]
        rows.append(_refit_row(k + 1, sent.buckets, stage_rows, logits, eager, previous))
        if rows[-1].verdict != "error":
            previous = eager.clone()
        say(f"refit {k + 1}: {rows[-1].verdict}"
            + (f": {rows[-1].error}" if rows[-1].error else ""))
    with phase("control: the naive variant on every stage, unguarded and guarded"):
        control = _control(job, full, x, phase)
    return VerifyReport(
        target=target.name, preset=job.preset, backend=job.backend, device=job.device,
        torch_version=torch.__version__, tolerance=TOLERANCE, refits=tuple(rows),
        control=control, ok=passed(rows, control), pp=job.pp, syncs=tuple(syncs),
        oracle=job.oracle, audit=job.audit, oracle_seconds=oracle_seconds,
        audit_seconds=sum(y.audit_seconds for y in syncs),
    )


def _send(ck: Checkpoint, seed: int) -> SendReport:
    """Sync the checkpoint in about four buckets, so that every sync is split (and some
    tensors span none)."""
    total = sum(t.numel() * t.element_size() for _, t in ck)
    bucket_bytes = max(1 << 12, total // random.Random(seed).randint(3, 6))
    return send_weights(ck, src=0, bucket_bytes=bucket_bytes)


def _refit(
    job: Job, full: nn.Module, x: Inputs, k: int
) -> tuple[torch.Tensor, torch.Tensor | None, SendReport, list[dict[str, Any]], float]:
    """Sync refit `k`, run the oracle on it while the stages replay; the oracle's logits,
    the logits and rows that came back, and the oracle's wall time."""
    ck = job.target.checkpoint(full, job.seed + 1 + k)
    if k == 0:  # the first refit sends the derivations' inputs last
        crit = [e for e in ck if e[0].endswith(job.target.critical)]
        ck = [e for e in ck if not e[0].endswith(job.target.critical)] + crit
    sent = _send(ck, job.seed + 1 + k)
    t0 = time.perf_counter()
    if job.oracle == "fresh":
        eager = fresh_model(job.target, job.preset, torch.device(job.device), ck)(*x)
    else:
        full.load_weights(ck)  # type: ignore[operator]
        eager = full(*x)
    seconds = time.perf_counter() - t0
    logits = recv_stream(job.pp)
    return eager, logits, sent, gather_rows(None), seconds


def _refit_row(
    refit: int, buckets: int, stage_rows: list[dict[str, Any]], logits: torch.Tensor | None,
    eager: torch.Tensor, previous: torch.Tensor,
) -> RefitRow:
    """The refit judged on the stages' rows and the logits that came back."""
    held = all(r["storage_held"] for r in stage_rows)
    errors = [f"stage {r['stage']}: {r['error']}" for r in stage_rows
              if r["error"] and not r["stale"]]
    found = [f"stage {r['stage']}: {r['error']}" for r in stage_rows if r["stale"]]
    if logits is None or errors:
        return RefitRow(
            refit=refit, buckets=buckets, critical_last=refit == 1, refreshed=(),
            storage_held=held, max_abs_diff=float("inf"), weights_effect=0.0,
            verdict="error", error="; ".join(errors) or "no logits came back",
        )
    diff = max_abs_diff(logits.to(eager.device), eager)
    effect = max_abs_diff(eager, previous)
    stale = tuple(sorted({p for r in stage_rows for p in r["stale"]}))
    audited = [r["audited"] for r in stage_rows]
    return RefitRow(
        refit=refit, buckets=buckets, critical_last=refit == 1,
        refreshed=tuple(sorted({p for r in stage_rows for p in r["refreshed"]})),
        storage_held=held, max_abs_diff=diff, weights_effect=effect,
        verdict=verdict(diff, effect, stale), error="; ".join(found) or None, stale=stale,
        audited=None if None in audited else sum(audited),
        unaudited=sum(r["unaudited"] for r in stage_rows),
    )


def _control(job: Job, full: nn.Module, x: Inputs, phase: Phases) -> ControlRow:
    """The naive stages: a first sync before their capture, then one refit; each step
    said as it goes."""
    with phase("control 1/3: first sync to the naive stages, built there, eager pass"):
        _send(job.target.checkpoint(full, job.seed), job.seed)
        recv_stream(job.pp)  # the naive stages' eager pass, before their capture
    with phase("control 2/3: stages capture it unguarded and guarded"):
        dist.barrier()
    with phase("control 3/3: refit sync, replay unguarded and guarded, oracle"):
        ck = job.target.checkpoint(full, job.seed + 1)
        _send(ck, job.seed + 1)
        if job.oracle == "fresh":
            eager = fresh_model(job.target, job.preset, torch.device(job.device), ck)(*x)
        else:
            full.load_weights(ck)  # type: ignore[operator]
            eager = full(*x)
        logits = recv_stream(job.pp)
        rows = gather_rows(None)
    refused = [f"stage {r['stage']}: {r['error']}" for r in rows if r["error"]]
    ndiff = float("inf") if logits is None else max_abs_diff(logits.to(eager.device), eager)
    return ControlRow(
        unguarded_max_abs_diff=ndiff, stale_read=ndiff > TOLERANCE,
        guard_error=refused[0] if refused else None, caught=bool(refused),
    )
