"""The CUDA graph backend: a real `torch.cuda.CUDAGraph`.

Warm-up runs on a side stream (lazy initialisation, cuBLAS workspaces and autotuning
happen there, not in the graph), then the body is captured with `torch.cuda.graph` and
`replay()` launches the whole graph at once. Several graphs can share one memory pool
(`pool=other.pool()`), as with `torch.cuda.graph`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from graphsafe._errors import CaptureError
from graphsafe._graphs.capture import CaptureState
from graphsafe._graphs.source import user_frame_of

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

__all__ = ["CUDABackend"]

# Substrings of CUDA and PyTorch errors raised when an op is not allowed during stream
# capture (a sync such as `.item()`, a blocking copy to the host, a new RNG seed).
_CAPTURE_ERROR_MARKS = ("captur", "not permitted")


def _capture_failure(error: BaseException) -> str | None:
    """The first line of the capture error in `error`'s chain, or None if it has none.

    When the body fails inside a capture, `capture_end()` fails too and its error
    hides the original one in `__context__`; report the original.
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
    """Captures CUDA work into a `torch.cuda.CUDAGraph` and replays it.

    Use it through `graphsafe._graph.Graph(backend="cuda")`; it can also be used alone.

    Args:
        pool: Memory pool to capture into, from `other.pool()` or
            `torch.cuda.graph_pool_handle()`; None gives the graph a pool of its own.

    Raises:
        CaptureError: CUDA is not available.

    Examples:
        >>> import torch
        >>> if torch.cuda.is_available():
        ...     x = torch.ones(4, device="cuda")
        ...     g = CUDABackend()
        ...     g.warmup(lambda: x * 2, 3)
        ...     with g.capture():
        ...         y = x * 2
        ...     _ = x.fill_(3.0)
        ...     g.replay()
    """

    __slots__ = ("_graph", "_pool", "_state")

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

    def warmup(self, fn: Callable[[], object], iters: int) -> None:
        """Run `fn` `iters` times on a side stream, then join the current stream.

        Args:
            fn: Zero-argument callable, usually the body about to be captured.
            iters: How many times to run it.

        Examples:
            >>> import torch
            >>> if torch.cuda.is_available():
            ...     CUDABackend().warmup(lambda: torch.ones(1, device="cuda") + 1, 3)
        """
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stubs
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(iters):
                fn()
        torch.cuda.current_stream().wait_stream(side)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Capture the CUDA work of the body into the graph.

        The body's kernels are recorded, not run: its outputs hold meaningful values only
        after the first `replay()`.

        Yields:
            None.

        Raises:
            CaptureError: The graph was already captured, or the body did something a
                stream capture does not allow (`.item()`, a blocking copy to the CPU).

        Examples:
            >>> import torch
            >>> if torch.cuda.is_available():
            ...     x = torch.ones(4, device="cuda")
            ...     g = CUDABackend()
            ...     with g.capture():
            ...         y = x + 1
        """
        with self._state.capturing():
            torch.cuda.synchronize()
            try:
                with torch.cuda.graph(self._graph, pool=self._pool):
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
        """Launch the captured graph on the current stream.

        Raises:
            CaptureError: Nothing was captured, or the capture failed.

        Examples:
            >>> import torch
            >>> if torch.cuda.is_available():
            ...     g = CUDABackend()
            ...     with g.capture():
            ...         y = torch.ones(1, device="cuda") + 1
            ...     g.replay()
        """
        self._state.check_replay()
        self._graph.replay()

    def pool(self) -> PoolHandle:
        """The graph's memory pool, to share with graphs captured later.

        Returns:
            An opaque pool handle for `Graph(pool=...)` or `torch.cuda.graph(pool=...)`.

        Raises:
            CaptureError: Called before a capture began.

        Examples:
            >>> import torch
            >>> if torch.cuda.is_available():
            ...     g = CUDABackend()
            ...     with g.capture():
            ...         y = torch.ones(1, device="cuda") + 1
            ...     g2 = CUDABackend(pool=g.pool())
        """
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
        """The underlying `torch.cuda.CUDAGraph`.

        Returns:
            The graph object.

        Examples:
            >>> import torch
            >>> if torch.cuda.is_available():
            ...     isinstance(CUDABackend().cuda_graph, torch.cuda.CUDAGraph)
        """
        return self._graph
