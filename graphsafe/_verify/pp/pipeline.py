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

import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from graphsafe._errors import GraphSafetyError
from graphsafe._verify.pp.job import Job
from graphsafe._verify.pp.processes import (
    RANK_NAME,
    Results,
    context,
    describe_failure,
    end,
    free_port,
    in_rank_process,
    init_group,
    main_rerun,
    quiet_native_logs,
    wait,
)
from graphsafe._verify.pp.stage import check_stages, stage
from graphsafe._verify.pp.trainer import trainer
from graphsafe._verify.report.rows import VerifyReport
from graphsafe._verify.single.oracle import Oracle
from graphsafe._verify.single.run import choose_backend
from graphsafe._verify.target import VerifyTarget

__all__ = ["DEFAULT_TIMEOUT", "run_verify_pp"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank may wait for another, unless the run says otherwise."""

_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)  # gloo's and c10d's stores' words

_GUARD_FIX = (
    'call it under `if __name__ == "__main__":` in your script: each rank process imports '
    "the main module again before it runs, and a call at its top level starts the run "
    "again there"
)


def run_verify_pp(
    target: VerifyTarget,
    *,
    pp: int,
    preset: str = "tiny",
    backend: str = "auto",
    refits: int = 3,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    oracle: Oracle = "fresh",
    audit: bool = True,
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
        timeout: Seconds every collective (and joining the group) may wait before it
            fails; positive.
        oracle: The trainer's eager logits: `fresh`, from a model built anew from each
            refit's checkpoint; `self`, from its own model, refitted with the same
            loader as the stages (blind to writes graphsafe does not see).
        audit: Every stage runs the content audit (`graphsafe.audit`) after each sync.
        progress: Called with a line of text as the run goes.

    Returns:
        The report; `report.ok` says whether everything held.

    Raises:
        GraphSafetyError: `pp` below 1, a timeout that is not positive, an unknown
            backend, a target that cannot be split into `pp` stages; a process failed
            or timed out before the report was made (each rank's error is quoted in a
            line), or the run outlasted its deadline.
    """
    say = progress or (lambda line: None)
    if in_rank_process():
        # The rank process imports the caller's main module again, which called this at
        # its top level: a script without `if __name__ == "__main__":`.
        raise GraphSafetyError(
            "verify --pp was called again inside one of its own rank processes",
            expected="the run started once, by the main process",
            got=f"{mp.current_process().name} importing {main_rerun() or 'the main module'} "
            "again (each rank process does, before it runs), which called it at its top "
            "level",
            fix=_GUARD_FIX,
        )
    if pp < 1:
        raise GraphSafetyError("--pp needs at least one stage", expected=">= 1", got=pp,
                               fix="pass --pp 2 for a trainer and two pipeline stages")
    if not (math.isfinite(timeout) and timeout > 0):
        raise GraphSafetyError("verify --pp: the timeout must be a positive number of seconds",
                               expected="> 0 seconds", got=timeout,
                               fix=f"pass timeout={DEFAULT_TIMEOUT:g}, or what a rank may "
                               "wait for another on this machine")
    chosen = choose_backend(backend)
    job = Job(target=target, preset=preset, device=chosen, backend=chosen, pp=pp,
              refits=refits, seed=seed, timeout=timeout, oracle=oracle, audit=audit)
    check_stages(job)
    ended = _run(job, say)
    if ended.report is None:
        raise _no_report(job, ended)
    return VerifyReport.model_validate_json(ended.report)


@dataclass
class _Ended:
    """How the processes of a run ended."""

    report: str | None = None
    """The trainer's report (JSON), if it came."""
    errors: dict[int, str] = field(default_factory=dict)
    """Rank -> its failure in a line (-1: the run's own), in the order they came."""
    started: set[int] = field(default_factory=set)
    """Ranks whose own code began (past importing the main module)."""
    stopped: set[int] = field(default_factory=set)
    """Ranks still running when the run stopped them."""
    exitcodes: list[int | None] = field(default_factory=list)


def _run(job: Job, say: Callable[[str], None]) -> _Ended:
    """Start the processes, relay what they say until they end, stop what is left."""
    ctx = context()
    results: Results = ctx.Queue()
    port = free_port()
    world = job.pp + 1
    procs: list[BaseProcess] = [
        ctx.Process(target=_worker, args=(rank, world, port, job, results), daemon=True,
                    name=f"{RANK_NAME}{rank}")
        for rank in range(world)
    ]
    with quiet_native_logs():
        for p in procs:
            p.start()
    ended = _Ended()
    try:
        ended.report = wait(procs, results, ended.errors, ended.started, say,
                            deadline=time.monotonic() + job.timeout * (job.refits + 4) + 60)
    finally:
        ended.stopped = {rank for rank, p in enumerate(procs) if p.exitcode is None}
        end(procs)
        ended.exitcodes = [p.exitcode for p in procs]
    return ended


def _role(rank: int) -> str:
    """How a rank is named in messages."""
    return "rank 0 (trainer)" if rank == 0 else f"rank {rank} (stage {rank - 1})"


def _no_report(job: Job, ended: _Ended) -> GraphSafetyError:
    """One error for a run without a report: a line per rank, and a timeout named."""
    lines = []
    for rank, code in enumerate(ended.exitcodes):
        if rank in ended.errors:
            what = ended.errors[rank]
        elif rank in ended.stopped:
            what = "reported nothing: it was still running when the run stopped it"
        elif code == 0:
            what = "ended without an error"
        else:
            died = f"signal {signal.Signals(-code).name}" if code and code < 0 else code
            what = f"died ({died}) without reporting an error"
        lines.append(f"{_role(rank)}: {what}")
    if -1 in ended.errors:
        lines.append(f"the run: {ended.errors[-1]}")
    summary = f"verify --pp {job.pp}: the run ended without a report"
    fix = ("read the ranks' errors: the first one that is not about another rank (a "
           "closed connection, a sync that did not arrive) is where the run broke")
    rerun = main_rerun()
    if rerun is not None and not ended.started and all(ended.exitcodes):
        # Each rank imports the main module before its own code runs: all of them dying
        # there is what a script calling verify without a `__main__` guard does.
        summary += (f": every rank died before its own code ran, while importing {rerun} "
                    "again")
        fix = _GUARD_FIX
    timed_out = sorted(r for r, e in ended.errors.items() if r >= 0 and _TIMED_OUT.search(e))
    if timed_out:
        summary += (f": {' and '.join(map(_role, timed_out))} timed out waiting for another "
                    f"rank (--timeout {job.timeout:g} s)")
        fix = ("raise --timeout if the ranks are only slow (large presets, slow machines); "
               "otherwise see why the rank it waited for stopped: its error, or the rank "
               "that was still running")
    return GraphSafetyError(
        summary, expected="the trainer's report", got=("\n" + " " * 14).join(lines), fix=fix
    )


def _worker(rank: int, world: int, port: int, job: Job, results: Results) -> None:
    """One process of the run; always ends with `os._exit` (gloo's teardown may abort
    when a peer died)."""
    code = 0
    try:
        results.put(("started", rank, ""))
        init_group(rank, world, port, job.timeout)
        with torch.no_grad():
            if rank == 0:
                report = trainer(job, lambda line: results.put(("say", 0, line)))
                results.put(("report", 0, report.model_dump_json()))
            else:
                stage(rank, job)
    except BaseException as exc:
        results.put(("error", rank, describe_failure(exc)))
        code = 1
    finally:
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
