"""`graphsafe verify --pp N`: the refit check across processes, as RL training runs it.

N + 1 processes on loopback with gloo: rank 0 is the trainer with the full model; ranks
1..N are pipeline stages (`pp_rank = rank - 1`), each holding its layers only and each
captured as a graph (CUDA graphs where there is a GPU, the CPU graph otherwise). For
each refit the trainer draws a checkpoint, loads it into its own model and runs it
eagerly, and sends it with `graphsafe.distributed.send_weights`; every stage receives it
with `receive_weights`, then the stages replay in order, handing the streams on with
`dist.send`/`dist.recv`, and the last stage's logits go back to the trainer, which
compares them with its eager logits. The naive control runs the same syncs into the
naive variant and must be caught by the guard.

A stage model is built with the target's `build_stage(preset, naive, device, pp_rank,
pp_size)` where the target has one; otherwise from `target.build(...)`'s model, whose
`config` must be a pydantic model with `pp_rank` and `pp_size` fields, rebuilt as
`type(model)(config)` for each stage. The first stage is called with the target's
example input; the others as `model(hidden_states=streams)`.

Every process ends by itself: collectives have the run's timeout, a process that fails
reports it and exits, and the parent kills whatever is left.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import BaseModel, ValidationError
from torch import nn

from graphsafe._errors import GraphSafetyError, one_line
from graphsafe._graphs.graph import Graph
from graphsafe._verify.run import (
    ControlRow,
    RefitRow,
    SyncRow,
    VerifyReport,
    VerifyTarget,
    _Phases,
    _pointers,
)
from graphsafe.distributed import ReceiveReport, receive_weights, send_weights

__all__ = ["run_verify_pp"]

_TOL = 1e-5
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HEADER = 12  # status, dtype code, ndim, dims...


@dataclass(frozen=True)
class _Job:
    target: VerifyTarget
    preset: str
    device: str
    backend: Literal["cuda", "cpu"]
    pp: int
    refits: int
    seed: int
    timeout: float


# -----------------------------------------------------------------------------
# the parent


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
        GraphSafetyError: A process failed before the report was made (its error is
            quoted), or the run outlasted its deadline.
    """
    say = progress or (lambda line: None)
    if pp < 1:
        raise GraphSafetyError("--pp needs at least one stage", expected=">= 1", got=pp,
                               fix="pass --pp 2 for a trainer and two pipeline stages")
    if backend not in ("auto", "cuda", "cpu"):
        raise GraphSafetyError(f"unknown backend {backend!r}", expected="auto, cuda or cpu",
                               got=backend, fix="pass --backend auto, cuda or cpu")
    chosen: Literal["cuda", "cpu"] = (
        "cuda" if backend == "cuda" or (backend == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    job = _Job(target=target, preset=preset, device=chosen, backend=chosen, pp=pp,
               refits=refits, seed=seed, timeout=timeout)
    _check_stages(job)
    ctx = _context()
    results: Queue[tuple[str, int, str]] = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, pp + 1, port, job, results), daemon=True,
                    name=f"graphsafe-verify-rank{rank}")
        for rank in range(pp + 1)
    ]
    for p in procs:
        p.start()
    report: str | None = None
    errors: dict[int, str] = {}
    try:
        report = _wait(procs, results, errors, say, deadline=time.monotonic()
                       + timeout * (refits + 4) + 60)
    finally:
        _end(procs)
    if report is None:
        shown = "\n".join(f"    rank {r}: {e}" for r, e in sorted(errors.items()))
        codes = ", ".join(f"rank {i}: {p.exitcode}" for i, p in enumerate(procs))
        raise GraphSafetyError(
            f"verify --pp {pp}: the run ended without a report",
            expected="the trainer's report",
            got=(f"errors:\n{shown}" if shown else "no error reported") + f"\n  exit codes: "
            f"{codes}",
            fix="read the first error above. A timeout means that a rank waited longer than "
            "--timeout for another (raise it for large presets on slow machines) or that "
            "another rank died",
        )
    return VerifyReport.model_validate_json(report)


def _context() -> Any:
    """A fork server that has imported torch once, where the platform has one: each rank
    then starts in a fraction of a second instead of importing torch anew."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Ignored once the server runs; fork-safe, since importing starts no worker threads.
    # `torch._dynamo` is what building a model on the meta device imports (seconds).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "graphsafe.distributed", "graphsafe._verify.pipeline"])
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(
    procs: Sequence[BaseProcess],
    results: Queue[tuple[str, int, str]],
    errors: dict[int, str],
    say: Callable[[str], None],
    deadline: float,
) -> str | None:
    """Relay progress until every process ended; a failure gives the others a grace."""
    report: str | None = None
    grace: float | None = None
    while True:
        try:
            kind, rank, text = results.get(timeout=0.1)
        except queue_mod.Empty:
            kind = ""
        if kind == "say":
            say(text)
        elif kind == "report":
            report = text
        elif kind == "error":
            errors[rank] = text
            say(f"rank {rank} failed: {text.splitlines()[-1] if text else ''}")
        now = time.monotonic()
        failed = errors or any(p.exitcode not in (None, 0) for p in procs)
        if failed and grace is None:
            grace = now + 3.0  # let the others report their side, then stop them
        if all(p.exitcode is not None for p in procs) and kind == "":
            return report
        if now > deadline or (grace is not None and now > grace):
            if now > deadline:
                errors.setdefault(-1, "the run outlasted its deadline")
            return report


def _end(procs: Sequence[BaseProcess]) -> None:
    """Stop every process still running: terminate, then kill."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)


# -----------------------------------------------------------------------------
# the processes


def _worker(
    rank: int, world: int, port: int, job: _Job, results: Queue[tuple[str, int, str]]
) -> None:
    """One process of the run; always ends with `os._exit` (gloo's teardown may abort
    when a peer died)."""
    code = 0
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=job.timeout),
        )
        with torch.no_grad():
            if rank == 0:
                report = _trainer(job, lambda line: results.put(("say", 0, line)))
                results.put(("report", 0, report.model_dump_json()))
            else:
                _stage(rank, job)
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    finally:
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send_stream(t: torch.Tensor | None, dst: int) -> None:
    """Hand a stage's output on; None says that this stage (or one before it) failed."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if t is None:
        header[0] = 1
        dist.send(header, dst)
        return
    header[1] = _DTYPES.index(t.dtype)
    header[2] = t.dim()
    header[3 : 3 + t.dim()] = torch.tensor(t.shape)
    dist.send(header, dst)
    dist.send(t.detach().cpu().contiguous(), dst)


def _recv_stream(src: int) -> torch.Tensor | None:
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.recv(header, src)
    status, code, ndim, *dims = header.tolist()
    if status:
        return None
    t = torch.empty(dims[:ndim], dtype=_DTYPES[code])
    dist.recv(t, src)
    return t


def _stage_config(job: _Job, naive: bool, pp_rank: int) -> tuple[type[nn.Module], BaseModel]:
    """The model class and the stage's config, by the `config.pp_rank` convention."""
    skeleton = job.target.build(job.preset, naive, torch.device("meta"))
    config = getattr(skeleton, "config", None)
    if not isinstance(config, BaseModel) or not {"pp_rank", "pp_size"} <= set(
        type(config).model_fields
    ):
        raise GraphSafetyError(
            f"target {job.target.name!r} cannot be split into pipeline stages",
            module_class=type(skeleton).__name__,
            expected="a target with build_stage(preset, naive, device, pp_rank=, pp_size=), "
            "or a model whose pydantic `config` has pp_rank and pp_size fields",
            got=f"config of type {type(config).__name__}",
            fix="add build_stage to the target, or run verify without --pp",
        )
    try:
        stage = type(config).model_validate(
            {**config.model_dump(), "pp_rank": pp_rank, "pp_size": job.pp}
        )
    except ValidationError as exc:
        raise GraphSafetyError(
            f"target {job.target.name!r} (preset {job.preset}) cannot have {job.pp} stages",
            module_class=type(config).__name__,
            expected="a config that validates with these pp_rank and pp_size",
            got=exc.errors()[0]["msg"],
            fix="pass a smaller --pp",
        ) from exc
    return type(skeleton), stage


def _check_stages(job: _Job) -> None:
    """Before any process starts: every stage can be configured (convention only)."""
    if getattr(job.target, "build_stage", None) is None:
        for pp_rank in range(job.pp):
            _stage_config(job, False, pp_rank)


def _stage_model(job: _Job, naive: bool, pp_rank: int) -> nn.Module:
    device = torch.device(job.device)
    build_stage = getattr(job.target, "build_stage", None)
    if build_stage is not None:
        return build_stage(job.preset, naive, device, pp_rank=pp_rank,  # type: ignore[no-any-return]
                           pp_size=job.pp)
    cls, config = _stage_config(job, naive, pp_rank)
    with torch.device(device):
        return cls(config)


def _bucket_bytes(ck: list[tuple[str, torch.Tensor]], seed: int) -> int:
    """About four buckets, so that every sync is split (and some tensors span none)."""
    total = sum(t.numel() * t.element_size() for _, t in ck)
    return max(1 << 12, total // random.Random(seed).randint(3, 6))


def _order(ck: list[tuple[str, torch.Tensor]], critical: tuple[str, ...],
           last: bool) -> list[tuple[str, torch.Tensor]]:
    if not last:
        return ck
    crit = [e for e in ck if e[0].endswith(critical)]
    return [e for e in ck if not e[0].endswith(critical)] + crit


def _trainer(job: _Job, say: Callable[[str], None]) -> VerifyReport:
    """Rank 0: the full model, the checkpoints, the comparisons, the report."""
    phase = _Phases(say)
    target, pp = job.target, job.pp
    with phase(f"trainer: build {target.name} ({job.preset}) and load its first weights"):
        full = target.build(job.preset, False, torch.device(job.device))
        ck = target.checkpoint(full, job.seed)
        full.load_weights(ck)  # type: ignore[operator]
        x = target.example_input(full, job.seed)
    with phase(f"first sync to {pp} stage(s), build there, eager pipeline pass"):
        send_weights(ck, src=0, bucket_bytes=_bucket_bytes(ck, job.seed))
        eager = full(*x)
        _recv_stream(pp)
    with phase(f"stages: capture ({job.backend} graph)"):
        dist.barrier()
    rows: list[RefitRow] = []
    syncs: list[SyncRow] = []
    previous = eager.clone()
    for k in range(job.refits):
        critical_last = k == 0
        with phase(f"refit {k + 1}/{job.refits}: sync, pipeline replay, eager"):
            ck = _order(target.checkpoint(full, job.seed + 1 + k), target.critical,
                        critical_last)
            full.load_weights(ck)  # type: ignore[operator]
            eager = full(*x)
            sent = send_weights(ck, src=0, bucket_bytes=_bucket_bytes(ck, job.seed + 1 + k))
            logits = _recv_stream(pp)
            stage_rows = _gather(None)
        syncs += [SyncRow(refit=k + 1, **r) for r in stage_rows]
        errors = [f"stage {r['stage']}: {r['error']}" for r in stage_rows if r["error"]]
        if logits is None or errors:
            rows.append(RefitRow(
                refit=k + 1, buckets=sent.buckets, critical_last=critical_last, refreshed=(),
                storage_held=all(r["storage_held"] for r in stage_rows),
                max_abs_diff=float("inf"), weights_effect=0.0, verdict="error",
                error="; ".join(errors) or "no logits came back",
            ))
            say(f"refit {k + 1}: error")
            continue
        diff = (logits.to(eager.device) - eager).abs().max().item()
        effect = (eager - previous).abs().max().item()
        previous = eager.clone()
        verdict: Literal["exact", "stale", "no-effect"] = (
            "stale" if diff > _TOL else "no-effect" if effect <= _TOL else "exact"
        )
        rows.append(RefitRow(
            refit=k + 1, buckets=sent.buckets, critical_last=critical_last,
            refreshed=tuple(sorted({p for r in stage_rows for p in r["refreshed"]})),
            storage_held=all(r["storage_held"] for r in stage_rows),
            max_abs_diff=diff, weights_effect=effect, verdict=verdict,
        ))
        say(f"refit {k + 1}: {verdict}")

    with phase("control: the naive variant on every stage, unguarded and guarded"):
        ck = target.checkpoint(full, job.seed)
        send_weights(ck, src=0, bucket_bytes=_bucket_bytes(ck, job.seed))
        _recv_stream(pp)  # the naive stages' eager pass, before their capture
        dist.barrier()
        ck = target.checkpoint(full, job.seed + 1)
        full.load_weights(ck)  # type: ignore[operator]
        eager = full(*x)
        send_weights(ck, src=0, bucket_bytes=_bucket_bytes(ck, job.seed + 1))
        logits = _recv_stream(pp)
        refused = [f"stage {r['stage']}: {r['error']}" for r in _gather(None) if r["error"]]
    ndiff = float("inf") if logits is None else (logits.to(eager.device) - eager).abs().max().item()
    control = ControlRow(
        unguarded_max_abs_diff=ndiff, stale_read=ndiff > _TOL,
        guard_error=refused[0] if refused else None, caught=bool(refused),
    )
    ok = bool(rows) and all(r.verdict == "exact" and r.storage_held for r in rows)
    ok = ok and control.stale_read and control.caught
    return VerifyReport(
        target=target.name, preset=job.preset, backend=job.backend, device=job.device,
        torch_version=torch.__version__, tolerance=_TOL, refits=tuple(rows), control=control,
        ok=ok, pp=pp, syncs=tuple(syncs),
    )


def _gather(row: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every stage's row at the trainer (rank 0); the stages get an empty list."""
    rows: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    return [r for r in rows or () if r is not None]


@dataclass
class _Pipe:
    """One stage's captured forward and where its input and output live."""

    model: nn.Module
    call: Callable[[], torch.Tensor]
    static: torch.Tensor | None
    """The static input streams (None on the first stage, whose input ids are static)."""


def _stage(rank: int, job: _Job) -> None:
    """Ranks 1..pp: a pipeline stage that receives every sync and replays its graph."""
    pp_rank = rank - 1
    nxt = rank + 1 if pp_rank < job.pp - 1 else 0
    layers = "?"

    def build(naive: bool) -> _Pipe:
        nonlocal layers
        model = _stage_model(job, naive, pp_rank)
        receive_weights(model, src=0)
        config: Any = getattr(model, "config", None)
        if config is not None and hasattr(config, "layer_range"):
            start, stop = config.layer_range
            layers = f"{start}-{stop - 1}"
        if pp_rank == 0:
            inputs = job.target.example_input(model, job.seed)
            pipe = _Pipe(model, lambda: model(*inputs), None)
        else:
            h = _recv_stream(rank - 1)
            if h is None:
                raise GraphSafetyError(f"stage {pp_rank - 1} failed its first pass",
                                       fix="see its error")
            static = h.to(job.device)
            pipe = _Pipe(model, lambda: model(hidden_states=static), static)
        _send_stream(pipe.call(), nxt)
        return pipe

    def forward(graph: Graph, out: torch.Tensor, pipe: _Pipe, error: str | None) -> str | None:
        """Take the streams in, replay, hand them on; returns the error, if any."""
        if pipe.static is not None:
            h = _recv_stream(rank - 1)
            if h is None:
                error = error or "an earlier stage failed"
            elif error is None:
                pipe.static.copy_(h)
        if error is None:
            try:
                graph.replay()
            except GraphSafetyError as exc:
                error = one_line(exc)
        _send_stream(out if error is None else None, nxt)
        return error

    pipe = build(naive=False)
    graph = Graph(backend=job.backend, guard=pipe.model)
    with graph.capture(warmup=pipe.call):
        out = pipe.call()
    dist.barrier()
    for _ in range(job.refits):
        before = _pointers(pipe.model)
        report: ReceiveReport | None = None
        error: str | None = None
        try:
            report = receive_weights(pipe.model, src=0)
        except GraphSafetyError as exc:
            error = one_line(exc)
        error = forward(graph, out, pipe, error)
        _gather({
            "stage": pp_rank, "layers": layers,
            "accepted": len(report.accepted) if report else 0,
            "bytes": report.bytes if report else 0,
            "buckets": report.buckets if report else 0,
            "seconds": report.seconds if report else 0.0,
            "refresh_seconds": report.refresh_seconds if report else 0.0,
            "refreshed": report.refresh.refreshed if report and report.refresh else (),
            "storage_held": _pointers(pipe.model) == before, "error": error,
        })

    naive = build(naive=True)
    plain = Graph(backend=job.backend)
    with plain.capture(warmup=naive.call):
        plain_out = naive.call()
    guarded = Graph(backend=job.backend, guard=naive.model)
    with guarded.capture(warmup=naive.call):
        naive.call()
    dist.barrier()
    receive_weights(naive.model, src=0)
    forward(plain, plain_out, naive, None)
    refused: str | None = None
    try:
        guarded.replay()
    except GraphSafetyError as exc:
        refused = one_line(exc)
    _gather({"stage": pp_rank, "error": refused})
