"""`Graph`: capture once, replay many times, on CUDA or on the CPU, optionally guarded.

Shaped like `torch.cuda.CUDAGraph` with `torch.cuda.graph`:

    g = Graph(guard=model)
    with g.capture(warmup=lambda: model(static_x)):
        out = model(static_x)
    static_x.copy_(new_x)
    g.replay()  # out now holds model(new_x)

The CPU backend (`graphsafe._graphs.cpu`) replays with a CUDA graph's semantics, so a
refit bug that would corrupt a CUDA graph shows up, reproducibly, without a GPU.

With `guard=model`, capture pins the model (the pin is the graph's own: released when the
graph is reset, dropped, or its capture fails) and takes a `Ledger` snapshot before the
body runs; every replay first checks that no tensor or submodule moved
(`StorageMovedError`) and that no derived buffer is stale (`StaleError`: the witnesses of
every input, version counters and journal epochs included), and raises instead of
replaying stale memory, or with `on_stale="refresh"` refreshes in place first. Replays
and loads of the guarded model are serialized.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from graphsafe._graphs.capture import CaptureState
from graphsafe._graphs.cpu import CPUBackend
from graphsafe._graphs.guard import Guard
from graphsafe._memory.ledger import Ledger

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

    from graphsafe._graphs.cuda import CUDABackend

__all__ = ["BackendName", "Graph"]

BackendName = Literal["auto", "cuda", "cpu"]
OnStale = Literal["raise", "refresh"]


def _choose(backend: str, guard: nn.Module | None) -> Literal["cuda", "cpu"]:
    if backend == "cuda":
        return "cuda"
    if backend == "cpu":
        return "cpu"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'cuda' or 'cpu', not {backend!r}")
    if guard is not None:
        tensors = chain(guard.parameters(), guard.buffers())
        return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class Graph:
    """A captured graph: CUDA where there is one, or the CPU recorder.

    Args:
        backend: `"cuda"` for a real `torch.cuda.CUDAGraph`, `"cpu"` for the CPU
            recorder, `"auto"` to pick: with a guard, `"cuda"` when any parameter or
            buffer of the guarded model is on a CUDA device, else `"cpu"`; without a
            guard, `"cuda"` exactly when `torch.cuda.is_available()`.
        guard: A model to guard. Capture pins it and snapshots its tensors before the
            body runs; each replay checks them first.
        pool: CUDA memory pool to capture into (`other.pool()` or
            `torch.cuda.graph_pool_handle()`). The CPU backend has none.
        on_stale: With a guard, what a replay does when derived buffers are stale:
            `"raise"` a `StaleError`, or `"refresh"` them in place and replay. Moved
            storage and a failed or unfinished weight update always raise.

    Raises:
        ValueError: Unknown backend or `on_stale`, or a pool given to the CPU backend.
        CaptureError: `backend="cuda"` where CUDA is not available.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Linear(3, 2)
        >>> x = torch.randn(4, 3)
        >>> g = Graph(backend="cpu")
        >>> with torch.no_grad(), g.capture():
        ...     out = model(x)
        >>> _ = x.copy_(torch.randn(4, 3))
        >>> g.replay()
        >>> torch.equal(out, model(x).detach())
        True
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_guard",
        "_guarded",
        "_impl",
        "_pool",
        "_repair",
        "_state",
    )

    def __init__(
        self,
        backend: BackendName = "auto",
        guard: nn.Module | None = None,
        pool: PoolHandle | None = None,
        *,
        on_stale: OnStale = "raise",
    ) -> None:
        if on_stale not in ("raise", "refresh"):
            raise ValueError(f"on_stale must be 'raise' or 'refresh', not {on_stale!r}")
        self._repair = on_stale == "refresh"
        self._backend = _choose(backend, guard)
        self._pool = pool
        if self._backend == "cpu" and pool is not None:
            raise ValueError(
                "pool is a CUDA graph memory pool; the cpu backend has none "
                "(pass pool=None, or Graph(pool=g.pool()) where g.pool() is None)"
            )
        self._impl: CPUBackend | CUDABackend = self._make_impl()
        self._guard = guard
        self._guarded: Guard | None = None
        self._state = CaptureState()

    def _make_impl(self) -> CPUBackend | CUDABackend:
        if self._backend == "cuda":
            from graphsafe._graphs.cuda import CUDABackend  # only where CUDA is wanted

            return CUDABackend(pool=self._pool)
        return CPUBackend()

    @property
    def backend(self) -> Literal["cuda", "cpu"]:
        """The backend in use.

        Returns:
            `"cuda"` or `"cpu"`.

        Examples:
            >>> Graph(backend="cpu").backend
            'cpu'
        """
        return self._backend

    @property
    def guard(self) -> nn.Module | None:
        """The guarded model, if any.

        Returns:
            The model passed as `guard`, or None.

        Examples:
            >>> Graph(backend="cpu").guard is None
            True
        """
        return self._guard

    @property
    def ledger(self) -> Ledger | None:
        """The snapshot the guard checks before each replay.

        Returns:
            The ledger taken at capture, or None without a guard or before capture.

        Examples:
            >>> Graph(backend="cpu").ledger is None
            True
        """
        return self._guarded.ledger if self._guarded is not None else None

    @property
    def captured(self) -> bool:
        """Whether a capture succeeded, so that `replay()` can run.

        Returns:
            True after a successful capture.

        Examples:
            >>> Graph(backend="cpu").captured
            False
        """
        return self._state.captured

    def pool(self) -> PoolHandle | None:
        """The memory pool, for graphs that should share it: `Graph(pool=g.pool())`.

        Returns:
            The CUDA pool handle (valid once capture began), or None on the CPU backend.

        Raises:
            CaptureError: CUDA backend, before capture.

        Examples:
            >>> Graph(backend="cpu").pool() is None
            True
        """
        if isinstance(self._impl, CPUBackend):
            return None
        return self._impl.pool()

    @contextlib.contextmanager
    def capture(
        self, warmup: Callable[[], object] | None = None, *, warmup_iters: int = 3
    ) -> Iterator[None]:
        """Capture the body as the graph.

        In order: `warmup` runs `warmup_iters` times (on a side stream for CUDA, eagerly
        on the CPU); with a guard, the model is pinned and snapshot; then the body is
        captured. On CUDA the body's outputs hold values only after the first
        `replay()`; on the CPU the body also runs eagerly.

        Args:
            warmup: Optional zero-argument callable run before capture, usually the body
                itself, so lazy initialisation happens outside the graph.
            warmup_iters: How many times to run `warmup`.

        Yields:
            None.

        Raises:
            CaptureError: The graph was already captured (or a capture failed), or the
                body cannot be captured (it reads a tensor's value into Python).
            StaleError: With a guard, when pinning finds derived buffers stale.

        Examples:
            >>> import torch
            >>> x = torch.ones(2)
            >>> g = Graph(backend="cpu")
            >>> with g.capture(warmup=lambda: x * 2):
            ...     y = x * 2
        """
        self._state.check_new()  # before warm-up and pinning
        if self._guard is not None:
            Guard.check_capturable(self._guard)  # before warm-up runs the model
        if warmup is not None:
            self._impl.warmup(warmup, warmup_iters)
        try:
            if self._guard is not None:
                # Before the body: the ledger must record the storage the graph reads.
                self._guarded = Guard(self._guard, self, repair=self._repair)
            with self._state.capturing(), self._impl.capture():
                yield
        except BaseException:
            self._release()
            raise

    def reset(self) -> None:
        """Forget the capture: release the pin and the snapshot, so that it can capture
        again (a new backend graph; the old one's memory is released).

        Examples:
            >>> import torch
            >>> g = Graph(backend="cpu")
            >>> with g.capture():
            ...     y = torch.ones(2) + 1
            >>> g.reset()
            >>> g.captured
            False
        """
        self._release()
        self._impl = self._make_impl()
        self._state = CaptureState()

    def _release(self) -> None:
        if self._guarded is not None:
            self._guarded.release()
            self._guarded = None

    def replay(self) -> None:
        """Replay the captured graph; with a guard, check the model first.

        The guard's check is one flat comparison of every pinned tensor's identity, data
        pointer, shape, stride and dtype and of every submodule's identity, then the
        freshness check (witnesses and journal), both under the model's lock.

        Raises:
            CaptureError: Nothing was captured, or the capture failed.
            StorageMovedError: With a guard, a pinned tensor was rebound after capture;
                the graph would read its old memory. Nothing is replayed.
            StaleError: With a guard, derived buffers are stale. Nothing is replayed.

        Examples:
            >>> import torch
            >>> x = torch.ones(2)
            >>> g = Graph(backend="cpu")
            >>> with g.capture():
            ...     y = x + 1
            >>> _ = x.fill_(5.0)
            >>> g.replay()
            >>> y
            tensor([6., 6.])
        """
        self._state.check_replay()
        if self._guarded is None:
            self._impl.replay()
            return
        with self._guarded.replaying():
            self._impl.replay()

