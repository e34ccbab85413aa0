"""The CUDA graph backend: a real `torch.cuda.CUDAGraph`.

Warm-up runs on a side stream, so that lazy initialisation, cuBLAS workspaces and
autotuning happen there and not in the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from graphsafe._errors import CaptureError
from graphsafe._graphs.capture import CaptureState
from graphsafe._graphs.reads import ReadTracker
from graphsafe._graphs.source import user_frame_of

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

__all__ = ["CUDABackend"]

# Substrings of CUDA and PyTorch errors raised when an op is not allowed during stream
# capture (a sync such as `.item()`, a blocking copy to the host, a new RNG seed).
_CAPTURE_ERROR_MARKS = ("captur", "not permitted")


def _capture_failure(error: BaseException) -> str | None:
    """The first line of the original capture error in `error`'s chain, or None.

    When the body fails inside a capture, `capture_end()` fails too and its error hides
    the original one in `__context__`; report the original.
    """
    found: str | None = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).strip()
        if isinstance(current, RuntimeError) and any(m in text for m in _CAPTURE_ERROR_MARKS):
            found = text.splitlines()[0] if text else type(current).__name__
        current = current.__cause__ or current.__context__
    return found


class CUDABackend:
    """Captures CUDA work into a `torch.cuda.CUDAGraph` and replays it, for
    `Graph(backend="cuda")`.

    Args:
        pool: Memory pool to capture into; None gives the graph a pool of its own.

    Raises:
        CaptureError: CUDA is not available.
    """

    __slots__ = ("_graph", "_pool", "_reads", "_state")

    def __init__(self, pool: PoolHandle | None = None) -> None:
        if not torch.cuda.is_available():
            raise CaptureError(
                "the cuda backend needs a CUDA device",
                expected="torch.cuda.is_available() is True",
                got="no CUDA device (or a CPU-only torch build)",
                fix='use Graph(backend="cpu"), or backend="auto" to pick what is there',
            )
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool
        self._state = CaptureState()
        self._reads = ReadTracker()

    @property
    def reads(self) -> frozenset[int] | None:
        """Storage keys the captured ops read; None when compiled code ran in the capture
        (its kernels read memory no op names)."""
        return self._reads.reads

    def outside(self) -> list[torch.Tensor]:
        """A tensor per storage the captured ops read that they did not make."""
        return self._reads.outside()

    def warmup(self, fn: Callable[[], object], iters: int) -> None:
        """Run `fn` `iters` times on a side stream, then join the current stream."""
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stubs
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(iters):
                fn()
        torch.cuda.current_stream().wait_stream(side)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the body's kernels (not run: outputs hold values after the first replay).

        Raises:
            CaptureError: The graph was already captured, or the body did something a
                stream capture does not allow (`.item()`, a blocking copy to the CPU).
        """
        with self._state.capturing():
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(self._graph, pool=self._pool), self._reads:
                    yield
            except BaseException as error:
                reason = _capture_failure(error)
                if reason is None:
                    raise
                raise CaptureError(
                    "the body did something a CUDA graph capture does not allow",
                    source=user_frame_of(error),
                    expected="device work only, with no host synchronization",
                    got=reason,
                    fix="keep values on the device: no `.item()`, `.tolist()`, `print(t)`, "
                    "`.cpu()` or Python branches on tensor values inside capture; read "
                    "results after `replay()`",
                ) from error

    def replay(self) -> None:
        """Launch the captured graph on the current stream (`CaptureError` if none succeeded)."""
        self._state.check_replay()
        self._graph.replay()

    def pool(self) -> PoolHandle:
        """The graph's memory pool, for later graphs to share (`CaptureError` before capture)."""
        if self._state.state == "new":
            raise CaptureError(
                "pool() before capture",
                expected="a graph that has begun capturing",
                got="an uncaptured graph",
                fix="capture first, or pass `torch.cuda.graph_pool_handle()` to every graph",
            )
        return self._graph.pool()

    @property
    def cuda_graph(self) -> torch.cuda.CUDAGraph:
        """The underlying `torch.cuda.CUDAGraph`."""
        return self._graph
