"""The stage side of `graphsafe verify --pp N`: ranks 1..N, one pipeline stage each.

A stage model is built with the target's `build_stage(preset, naive, device, pp_rank,
pp_size)` where the target has one; otherwise from `target.build(...)`'s model, whose
`config` must be a pydantic model with `pp_rank` and `pp_size` fields, rebuilt as
`type(model)(config)` for each stage. The first stage is called with the target's
example input; the others as `model(hidden_states=streams)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ValidationError
from torch import nn

from graphsafe._errors import GraphSafetyError
from graphsafe._graphs.graph import Graph
from graphsafe._verify.pp.job import Job
from graphsafe._verify.pp.messages import gather_rows, recv_stream, send_stream
from graphsafe._verify.report.format import quote
from graphsafe._verify.single.oracle import audit_model
from graphsafe._verify.single.run import pointers
from graphsafe.distributed import ReceiveReport, receive_weights

__all__ = ["check_stages", "stage", "stage_model"]


def stage(rank: int, job: Job) -> None:
    """Ranks 1..pp: a pipeline stage that receives every sync and replays its graph."""
    me = _Stage(rank, job)
    pipe = me.build(naive=False)
    graph = Graph(backend=job.backend, guard=pipe.model)
    with graph.capture(warmup=pipe.call):
        out = pipe.call()
    dist.barrier()
    for _ in range(job.refits):
        gather_rows(me.sync(graph, out, pipe))
    me.control()


def check_stages(job: Job) -> None:
    """Before any process starts: every stage can be configured (convention only)."""
    if getattr(job.target, "build_stage", None) is None:
        for pp_rank in range(job.pp):
            _stage_config(job, False, pp_rank)


def stage_model(job: Job, naive: bool, pp_rank: int) -> nn.Module:
    """The model of stage `pp_rank`, by the target's `build_stage` or by convention."""
    device = torch.device(job.device)
    build_stage = getattr(job.target, "build_stage", None)
    if build_stage is not None:
        return build_stage(job.preset, naive, device, pp_rank=pp_rank,  # type: ignore[no-any-return]
                           pp_size=job.pp)
    cls, config = _stage_config(job, naive, pp_rank)
    with torch.device(device):
        return cls(config)


def _stage_config(job: Job, naive: bool, pp_rank: int) -> tuple[type[nn.Module], BaseModel]:
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


@dataclass
class _Pipe:
    """One stage's captured forward and where its input and output live."""

    model: nn.Module
    call: Callable[[], torch.Tensor]
    static: torch.Tensor | None
    """The static input streams (None on the first stage, whose input ids are static)."""


class _Stage:
    """One stage process: where it sits in the pipeline, and its steps."""

    def __init__(self, rank: int, job: Job) -> None:
        self.rank, self.job = rank, job
        self.pp_rank = rank - 1
        self.next = rank + 1 if self.pp_rank < job.pp - 1 else 0  # the last one: trainer
        self.layers = "?"

    def build(self, naive: bool) -> _Pipe:
        """Build the stage, take the first sync, run it eagerly and hand its output on."""
        model = stage_model(self.job, naive, self.pp_rank)
        receive_weights(model, src=0)
        config: Any = getattr(model, "config", None)
        if config is not None and hasattr(config, "layer_range"):
            start, stop = config.layer_range
            self.layers = f"{start}-{stop - 1}"
        if self.pp_rank == 0:
            inputs = self.job.target.example_input(model, self.job.seed)
            pipe = _Pipe(model, lambda: model(*inputs), None)
        else:
            h = recv_stream(self.rank - 1)
            if h is None:
                raise GraphSafetyError(f"stage {self.pp_rank - 1} failed its first pass",
                                       fix="see its error")
            static = h.to(self.job.device)
            pipe = _Pipe(model, lambda: model(hidden_states=static), static)
        send_stream(pipe.call(), self.next)
        return pipe

    def forward(self, graph: Graph, out: torch.Tensor, pipe: _Pipe,
                error: str | None) -> str | None:
        """Take the streams in, replay, hand them on; returns the error, if any."""
        if pipe.static is not None:
            h = recv_stream(self.rank - 1)
            if h is None:
                error = error or "an earlier stage failed"
            elif error is None:
                pipe.static.copy_(h)
        if error is None:
            try:
                graph.replay()
            except GraphSafetyError as exc:
                error = quote(exc)
        send_stream(out if error is None else None, self.next)
        return error

    def sync(self, graph: Graph, out: torch.Tensor, pipe: _Pipe) -> dict[str, Any]:
        """One refit: receive the sync, replay in turn, audit; the stage's row for the
        trainer."""
        before = pointers(pipe.model)
        report: ReceiveReport | None = None
        error: str | None = None
        try:
            report = receive_weights(pipe.model, src=0)
        except GraphSafetyError as exc:
            error = quote(exc)
        error = self.forward(graph, out, pipe, error)
        audited = audit_model(pipe.model) if self.job.audit and error is None else None
        return {
            "stage": self.pp_rank, "layers": self.layers,
            "accepted": len(report.accepted) if report else 0,
            "bytes": report.bytes if report else 0,
            "buckets": report.buckets if report else 0,
            "seconds": report.seconds if report else 0.0,
            "refresh_seconds": report.refresh_seconds if report else 0.0,
            "refreshed": report.refresh.refreshed if report and report.refresh else (),
            "storage_held": pointers(pipe.model) == before,
            "error": error if audited is None else audited.problem,
            "stale": audited.stale if audited is not None else (),
            "audited": audited.checked if audited is not None else None,
            "unaudited": audited.unchecked if audited is not None else 0,
            "audit_seconds": audited.seconds if audited is not None else 0.0,
        }

    def control(self) -> None:
        """The naive variant, unguarded and guarded, through one sync."""
        naive = self.build(naive=True)
        plain = Graph(backend=self.job.backend)
        with plain.capture(warmup=naive.call):
            plain_out = naive.call()
        guarded = Graph(backend=self.job.backend, guard=naive.model)
        with guarded.capture(warmup=naive.call):
            naive.call()
        dist.barrier()
        receive_weights(naive.model, src=0)
        self.forward(plain, plain_out, naive, None)
        refused: str | None = None
        try:
            guarded.replay()
        except GraphSafetyError as exc:
            refused = quote(exc)
        gather_rows({"stage": self.pp_rank, "error": refused})
