"""Worlds of real processes for the weight-sync fault tests: gloo on loopback.

`run_world(scenario, ...)` starts one process per rank (forkserver, torch preloaded),
each of which initializes a gloo world on `127.0.0.1` with a timeout of `TIMEOUT` and runs
`scenario(rank, ctx)`; what the scenario returns, or the traceback it raised, comes
back per rank. A hard deadline kills every process left and fails: a fault test never
hangs. A scenario may end its own process (`die`), or have gloo abort it: each rank
writes its reports into a pipe of its own, and a report is in the pipe when `report`
returns, so what a rank reported reaches the parent whatever ends it next.

The fault suite runs the tiny DeepSeek V4 split into two pipeline stages: rank 0 is the
trainer (the full checkpoint), ranks 1 and 2 the stages.
"""

from __future__ import annotations

import datetime
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphsafe as gs
from graphsafe._verify.pp.processes import free_port
from graphsafe.models.deepseek_v4 import DeepseekV4Config, DeepseekV4Model, random_checkpoint

TIMEOUT = 30.0
"""Seconds a collective may wait for the other ranks, and a new world for its ranks to
join: generous, as between two collectives a rank of these tests may build a stage and a
reference model, or start a process, seconds of work on a loaded two-core machine (a
wait meant to time out uses a group with a short timeout of its own)."""
WORLD = 3
Scenario = Callable[[int, dict[str, Any]], Any]


def _context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "graphsafe.distributed", "graphsafe.models.deepseek_v4"])
    return ctx


_PIPE: list[Connection | None] = [None]


def report(key: str, value: Any) -> None:
    """Send `value` to the parent under `key`: written into this rank's pipe before it
    returns (no feeder thread), so it arrives even if the process dies next."""
    pipe = _PIPE[0]
    assert pipe is not None
    pipe.send((key, value))


def die() -> None:
    """SIGKILL this process, after reporting when."""
    report("killed_at", time.monotonic())
    os.kill(os.getpid(), signal.SIGKILL)


def init_world(rank: int, port: int, world: int = WORLD) -> dist.ProcessGroup:
    """Join a gloo world on loopback; returns a group of all its ranks."""
    timeout = datetime.timedelta(seconds=TIMEOUT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timeout)
    group: dist.ProcessGroup = dist.new_group(timeout=timeout)
    return group


def _child(scenario: Scenario, rank: int, ports: list[int], world: int, pipe: Connection,
           args: dict[str, Any]) -> None:
    _PIPE[0] = pipe
    code = 0
    try:
        ctx: dict[str, Any] = dict(args, ports=ports, world=world)
        if not args.get("late"):
            ctx["group"] = init_world(rank, ports[0], world)
        report("result", scenario(rank, ctx))
    except BaseException:
        report("error", traceback.format_exc())
        code = 1
    finally:
        pipe.close()
        os._exit(code)


@dataclass
class World:
    """What each rank of a finished world reported, and how each process ended."""

    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    exitcodes: dict[int, int | None] = field(default_factory=dict)

    def ok(self, *ranks: int) -> dict[int, Any]:
        """The results of `ranks`; fails the test naming every rank that raised or never
        reported."""
        problems = []
        for r in ranks:
            got = self.reports.get(r, {})
            if "error" in got:
                problems.append(f"rank {r}:\n{got['error']}")
            elif "result" not in got:
                problems.append(f"rank {r} never reported (exit code {self.exitcodes.get(r)})")
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)
        return {r: self.reports[r]["result"] for r in ranks}


def run_world(scenario: Scenario, *, world: int = WORLD, deadline: float = 180.0,
              extra: Iterable[tuple[int, Scenario]] = (), start_extra_after: str = "",
              **args: Any) -> World:
    """Run `scenario` on every rank of a new world; kill what is left at `deadline`.

    Args:
        scenario: Called as `scenario(rank, ctx)`; `ctx` holds `group` (a group of all
            ranks, timeout `TIMEOUT`), `ports` (two free ports: the world's, and one for
            a world made after a failure), `world` and `args`.
        world: The number of ranks.
        deadline: Seconds the whole world may take: a guard against a hang, not a
            measure (a loaded machine takes several times the usual time).
        extra: (rank, scenario) of processes started later, once some rank reported
            `start_extra_after` (a restarted trainer); they join no world by themselves
            (`late`: they call `init_world` with `ctx["ports"][1]`). Their reports are
            kept under `100 + rank`.
        start_extra_after: The report key that starts them.
        **args: Put into `ctx`.
    """
    ctx = _context()
    ports = [free_port(), free_port()]
    readers: dict[Any, int] = {}  # the parent's end of each process's pipe -> its key
    every: dict[int, Any] = {}  # key -> process

    def start(key: int, rank: int, fn: Scenario, kwargs: dict[str, Any]) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, ports, world, writer, kwargs),
                        daemon=True)
        p.start()
        writer.close()  # the child holds it now: when it ends, this end reads EOF
        readers[reader] = key
        every[key] = p

    for r in range(world):
        start(r, r, scenario, args)
    pending = list(extra)
    out = World()
    end = time.monotonic() + deadline
    try:
        while readers and time.monotonic() < end:
            ready = wait(list(readers), timeout=0.1)
            if not ready and not pending and all(p.exitcode is not None
                                                 for p in every.values()):
                readers.clear()  # every process ended and nothing is left to read
            for conn in ready:
                key = readers[conn]
                try:
                    name, value = conn.recv()  # type: ignore[union-attr]
                except EOFError:  # the process ended: everything it reported was read
                    del readers[conn]
                    continue
                out.reports.setdefault(key, {})[name] = value
                if pending and name == start_extra_after:
                    for r, fn in pending:
                        start(100 + r, r, fn, dict(args, late=True))
                    pending = []
    finally:
        for p in every.values():
            if p.exitcode is None and readers:
                p.kill()
        for key, p in every.items():
            p.join(timeout=10)
            out.exitcodes[key] = p.exitcode
    leftover = [key for key, p in every.items() if p.exitcode is None]
    if leftover:
        pytest.fail(f"ranks {leftover} did not end", pytrace=False)
    if readers:
        pytest.fail(f"the world ran past its deadline of {deadline} s; reports: "
                    f"{out.reports}", pytrace=False)
    return out


# -----------------------------------------------------------------------------
# the model of the fault suite


def stage_config(rank: int) -> DeepseekV4Config:
    return DeepseekV4Config.preset("tiny", pp_rank=rank - 1, pp_size=2)


def checkpoint(seed: int) -> list[tuple[str, torch.Tensor]]:
    return random_checkpoint(DeepseekV4Config(), seed)


def forward(model: DeepseekV4Model, rank: int) -> Callable[[], torch.Tensor]:
    """The stage's forward on static inputs (token ids on stage 0, streams on stage 1)."""
    if rank == 1:
        ids = torch.arange(8)
        return lambda: model(ids)
    streams = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(0))
    return lambda: model(hidden_states=streams)


def reference(rank: int, ck: Iterable[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The stage's output with `ck` loaded into a model built from scratch."""
    model = DeepseekV4Model(stage_config(rank))
    model.load_weights(list(ck))
    with torch.no_grad():
        return forward(model, rank)()


@dataclass
class Stage:
    """A pipeline stage with its graph captured on its first weights."""

    rank: int
    model: DeepseekV4Model
    graph: gs.Graph
    out: torch.Tensor

    @classmethod
    def build(cls, rank: int, ck: list[tuple[str, torch.Tensor]]) -> Stage:
        model = DeepseekV4Model(stage_config(rank))
        model.load_weights(ck)
        call = forward(model, rank)
        graph = gs.Graph(backend="cpu", guard=model)
        with torch.no_grad(), graph.capture(warmup=call):
            out = call()
        return cls(rank, model, graph, out)

    def replays(self, ck: Iterable[tuple[str, torch.Tensor]]) -> bool:
        """Replay; whether the output equals that of a model built from `ck`."""
        self.graph.replay()
        return torch.equal(self.out, reference(self.rank, ck))

    def refused(self) -> str:
        """Replay, which must refuse; returns the error's class name."""
        try:
            self.graph.replay()
        except gs.GraphSafetyError as exc:
            return type(exc).__name__
        raise AssertionError(f"rank {self.rank}: the replay was not refused")
