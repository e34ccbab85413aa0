"""`graphsafe verify --pp N`: the refit check across processes, as RL training runs it.

N + 1 processes on loopback with gloo: rank 0 is the trainer with the full model
(`trainer`); ranks 1..N are pipeline stages (`pp_rank = rank - 1`, `stage`), each
holding its layers only and each captured as a graph (CUDA graphs where there is a GPU,
the CPU graph otherwise). For each refit the trainer syncs a checkpoint with
`graphsafe.distributed.send_weights`; every stage receives it with `receive_weights`,
then the stages replay in order, handing the streams on, and the last stage's logits go
back to the trainer, which compares them with its eager logits. The naive control runs
the same syncs into the naive variant and must be caught by the guard.

Every process ends by itself: collectives have the run's timeout, a process that fails
reports it and exits, and the parent kills whatever is left.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import torch

from graphsafe._errors import GraphSafetyError
from graphsafe._verify.backend import choose_backend
from graphsafe._verify.job import Job
from graphsafe._verify.processes import Results, context, end, free_port, init_group, wait
from graphsafe._verify.report import VerifyReport
from graphsafe._verify.stage import check_stages, stage
from graphsafe._verify.target import VerifyTarget
from graphsafe._verify.trainer import trainer

__all__ = ["run_verify_pp"]


def run_verify_pp(
    target: VerifyTarget,
    *,
    pp: int,
    preset: str = "tiny",
    backend: str = "auto",
    refits: int = 3,
    seed: int = 0,
    timeout: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Run verify with a trainer process and `pp` pipeline-stage processes over gloo.

    Args:
        target: The model family (picklable: the processes rebuild it from the pickle).
        pp: Pipeline stages.
        preset: Its size preset.
        backend: `auto`, `cuda` or `cpu`.
        refits: How many refits.
        seed: Seed of weights, inputs and bucket sizes.
        timeout: Seconds every collective may wait before it fails.
        progress: Called with a line of text as the run goes.

    Returns:
        The report; `report.ok` says whether everything held.

    Raises:
        GraphSafetyError: `pp` below 1, an unknown backend, a target that cannot be
            split into `pp` stages; a process failed before the report was made (its
            error is quoted), or the run outlasted its deadline.
    """
    say = progress or (lambda line: None)
    if pp < 1:
        raise GraphSafetyError("--pp needs at least one stage", expected=">= 1", got=pp,
                               fix="pass --pp 2 for a trainer and two pipeline stages")
    chosen = choose_backend(backend)
    job = Job(target=target, preset=preset, device=chosen, backend=chosen, pp=pp,
              refits=refits, seed=seed, timeout=timeout)
    check_stages(job)
    report, errors, procs = _run(job, say)
    if report is None:
        raise _no_report(pp, errors, procs)
    return VerifyReport.model_validate_json(report)


def _run(
    job: Job, say: Callable[[str], None]
) -> tuple[str | None, dict[int, str], list[BaseProcess]]:
    """Start the processes, relay what they say until they end, stop what is left; the
    trainer's report (JSON) if it came, each rank's error, the processes."""
    ctx = context()
    results: Results = ctx.Queue()
    port = free_port()
    world = job.pp + 1
    procs: list[BaseProcess] = [
        ctx.Process(target=_worker, args=(rank, world, port, job, results), daemon=True,
                    name=f"graphsafe-verify-rank{rank}")
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    errors: dict[int, str] = {}
    try:
        report = wait(procs, results, errors, say,
                      deadline=time.monotonic() + job.timeout * (job.refits + 4) + 60)
    finally:
        end(procs)
    return report, errors, procs


def _no_report(pp: int, errors: dict[int, str], procs: list[BaseProcess]) -> GraphSafetyError:
    shown = "\n".join(f"    rank {r}: {e}" for r, e in sorted(errors.items()))
    codes = ", ".join(f"rank {i}: {p.exitcode}" for i, p in enumerate(procs))
    return GraphSafetyError(
        f"verify --pp {pp}: the run ended without a report",
        expected="the trainer's report",
        got=(f"errors:\n{shown}" if shown else "no error reported") + f"\n  exit codes: "
        f"{codes}",
        fix="read the first error above. A timeout means that a rank waited longer than "
        "--timeout for another (raise it for large presets on slow machines) or that "
        "another rank died",
    )


def _worker(rank: int, world: int, port: int, job: Job, results: Results) -> None:
    """One process of the run; always ends with `os._exit` (gloo's teardown may abort
    when a peer died)."""
    code = 0
    try:
        init_group(rank, world, port, job.timeout)
        with torch.no_grad():
            if rank == 0:
                report = trainer(job, lambda line: results.put(("say", 0, line)))
                results.put(("report", 0, report.model_dump_json()))
            else:
                stage(rank, job)
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
