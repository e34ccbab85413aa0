"""The processes of `graphsafe verify --pp N`: start, join a gloo group, relay, end."""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphsafe._errors import GraphSafetyError, one_line

__all__ = [
    "RANK_NAME",
    "Results",
    "context",
    "describe_failure",
    "end",
    "free_port",
    "in_rank_process",
    "init_group",
    "main_rerun",
    "quiet_native_logs",
    "wait",
]

Results: TypeAlias = "Queue[tuple[str, int, str]]"
"""What the processes tell the parent: `(kind, rank, text)`, kind `started` (the rank's
own code began), `say`, `report` or `error`."""

RANK_NAME = "graphsafe-verify-rank"
"""The name of each rank process, followed by its rank."""

_TORCH_DIR = os.path.dirname(torch.__file__)
_CPP_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")  # gloo's "[.../pair.cc:553] "


def context() -> Any:
    """A fork server that has imported torch once, where the platform has one: each rank
    then starts in a fraction of a second instead of importing torch anew."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Ignored once the server runs; fork-safe, since importing starts no worker threads.
    # `torch._dynamo` is what building a model on the meta device imports (seconds).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                "graphsafe.distributed", "graphsafe._verify.pp.pipeline"])
    return ctx


def main_rerun() -> str | None:
    """The main module a rank process imports again before it runs (as `spawn` and
    `forkserver` do, under the name `__mp_main__`), if any: "the script PATH" or "the
    module NAME"; None for an interactive session, `python -c` or a package's
    `__main__` (pytest's, say), which are not imported again."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else f"the module {name}"
    path = getattr(main, "__file__", None)
    return f"the script {path}" if path else None


def in_rank_process() -> bool:
    """Whether this process is one of verify's rank processes (its name is set before it
    imports the main module again)."""
    return mp.current_process().name.startswith(RANK_NAME)


@contextmanager
def quiet_native_logs() -> Iterator[None]:
    """While processes start: silence torch's C++ logs in them, unless
    TORCH_CPP_LOG_LEVEL is set. c10d logs each failure with its C++ stack (a hundred
    lines per rank), and every rank reports its errors itself. The level is read when a
    process loads torch (the fork server does, once), so it is set in this process's
    environment while they start."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def describe_failure(exc: BaseException) -> str:
    """A rank's failure in one line: the error, what first caused it, and (for an error
    that is not graphsafe's, which says where itself) the innermost frame outside torch.

    Examples:
        >>> try:
        ...     raise RuntimeError("[/src/gloo/pair.cc:553] Connection closed by peer")
        ... except RuntimeError as exc:
        ...     describe_failure(exc).split(", at ")[0]
        'RuntimeError: Connection closed by peer'
    """
    text = _CPP_SOURCE.sub("", one_line(exc))
    root, seen = exc, {id(exc)}
    while (cause := root.__cause__ or (
        None if root.__suppress_context__ else root.__context__
    )) is not None and id(cause) not in seen:
        root = cause
        seen.add(id(cause))
    if root is not exc:
        text += f" (from {_CPP_SOURCE.sub('', one_line(root))})"
    if not isinstance(exc, GraphSafetyError):
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(_TORCH_DIR)]
        if frames:
            text += f", at {frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name}"
    return text


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, world: int, port: int, timeout: float) -> None:
    """Join the run's gloo group on loopback."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )


def wait(
    procs: Sequence[BaseProcess],
    results: Results,
    errors: dict[int, str],
    started: set[int],
    say: Callable[[str], None],
    deadline: float,
) -> str | None:
    """Relay progress until every process ended; a failure gives the others a grace.
    `errors` and `started` take each rank's failure and the ranks whose code began."""
    report: str | None = None
    grace: float | None = None
    while True:
        try:
            kind, rank, text = results.get(timeout=0.1)
        except queue_mod.Empty:
            kind = ""
        if kind == "started":
            started.add(rank)
        elif kind == "say":
            say(text)
        elif kind == "report":
            report = text
        elif kind == "error":
            errors[rank] = text
            say(f"rank {rank} failed: {text}")
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


def end(procs: Sequence[BaseProcess]) -> None:
    """Stop every process still running: terminate, then kill."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)
