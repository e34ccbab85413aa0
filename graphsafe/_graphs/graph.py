"""`Graph`: capture once, replay many times, on CUDA or on the CPU (which replays with a
CUDA graph's semantics, so refit bugs show up without a GPU), optionally guarded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from graphsafe._audit.audit import Auditor, AuditReport
from graphsafe._declare.forgotten import hinting
from graphsafe._graphs.capture import CaptureState
from graphsafe._graphs.cpu import CPUBackend
from graphsafe._graphs.guard import Guard
from graphsafe._memory.ledger import Ledger
from graphsafe._runtime.runtime import runtime

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as PoolHandle

    from graphsafe._graphs.cuda import CUDABackend

__all__ = ["BackendName", "Graph"]

BackendName = Literal["auto", "cuda", "cpu"]
OnStale = Literal["raise", "refresh"]


def _choose(backend: str, model: nn.Module | None) -> Literal["cuda", "cpu"]:
    if backend == "cuda":
        return "cuda"
    if backend == "cpu":
        return "cpu"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'cuda' or 'cpu', not {backend!r}")
    if model is not None:
        tensors = chain(model.parameters(), model.buffers())
        return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class Graph:
    """A captured graph: a `torch.cuda.CUDAGraph`, or the CPU recorder that replays like one.

    Args:
        backend: `"cuda"`, `"cpu"`, or `"auto"`: with a guard, `"cuda"` when a parameter
            or buffer of the model is on a CUDA device; without, when CUDA is available.
        guard: The model to guard: capture pins and snapshots it, and each replay first
            checks that no tensor moved and no derived buffer is stale.
        pool: CUDA memory pool to capture into (`other.pool()` or
            `torch.cuda.graph_pool_handle()`).
        on_stale: `"raise"` a `StaleError` when a guarded replay finds stale derived
            buffers, or `"refresh"` them in place and replay. Moved storage and a failed
            or unfinished weight update always raise.
        audit_every: With a guard, run the content audit (`gs.audit`) before every
            `audit_every`-th replay, under the model's lock after the guard's other
            checks: a derived tensor that differs from its recomputation raises
            `StaleError` and nothing is replayed, whatever `on_stale` says (the audit
            found a write no mechanism saw: there is no witness to repair from). A
            failed audit runs again at the next replay, until one passes. The graph
            keeps the audit's scratch block (as large as the largest derivation output)
            between audits. None (the default): never.

    Raises:
        ValueError: Unknown `backend` or `on_stale`, a pool given to the CPU backend, or
            an `audit_every` that is not a positive integer, or given without a guard.
        CaptureError: `backend="cuda"` where CUDA is not available.

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

    __slots__ = (
        "__weakref__",
        "_audit_every",
        "_auditor",
        "_backend",
        "_backend_name",
        "_guard",
        "_last_audit",
        "_model",
        "_pool",
        "_repair",
        "_state",
        "_until_audit",
    )

    def __init__(
        self,
        backend: BackendName = "auto",
        guard: nn.Module | None = None,
        pool: PoolHandle | None = None,
        *,
        on_stale: OnStale = "raise",
        audit_every: int | None = None,
    ) -> None:
        if on_stale not in ("raise", "refresh"):
            raise ValueError(f"on_stale must be 'raise' or 'refresh', not {on_stale!r}")
        if audit_every is not None and (
            isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 1
        ):
            raise ValueError(f"audit_every must be a positive integer or None, not {audit_every!r}")
        if audit_every is not None and guard is None:
            raise ValueError("audit_every audits the guarded model: pass guard=model too")
        self._audit_every = audit_every
        self._until_audit = audit_every or 0  # replays left before the next audit
        self._auditor = Auditor() if audit_every is not None else None
        self._last_audit: AuditReport | None = None
        self._repair = on_stale == "refresh"
        self._backend_name = _choose(backend, guard)
        self._pool = pool
        if self._backend_name == "cpu" and pool is not None:
            raise ValueError(
                "pool is a CUDA graph memory pool; the cpu backend has none "
                "(pass pool=None, or Graph(pool=g.pool()) where g.pool() is None)"
            )
        self._backend: CPUBackend | CUDABackend = self._make_backend()
        self._model = guard
        self._guard: Guard | None = None
        self._state = CaptureState()

    def _make_backend(self) -> CPUBackend | CUDABackend:
        if self._backend_name == "cuda":
            from graphsafe._graphs.cuda import CUDABackend  # only where CUDA is wanted

            return CUDABackend(pool=self._pool)
        return CPUBackend()

    @property
    def backend(self) -> Literal["cuda", "cpu"]:
        """The backend in use: `"cuda"` or `"cpu"`."""
        return self._backend_name

    @property
    def guard(self) -> nn.Module | None:
        """The guarded model, or None."""
        return self._model

    @property
    def ledger(self) -> Ledger | None:
        """The snapshot a guarded replay checks; None without a guard or before capture."""
        return self._guard.ledger if self._guard is not None else None

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """What a guarded graph reads that the model does not hold (static inputs, KV
        caches: graphsafe does not own them); empty without a guard or before capture.

        Examples:
            >>> from torch import nn
            >>> model, x = nn.Linear(2, 2), torch.ones(1, 2)
            >>> g = Graph(backend="cpu", guard=model)
            >>> with torch.no_grad(), g.capture():
            ...     y = model(x)
            >>> [t.data_ptr() for t in g.inputs] == [x.data_ptr()]
            True
        """
        return self._guard.inputs if self._guard is not None else ()

    @property
    def reads(self) -> frozenset[int] | None:
        """Storage keys a guarded graph reads, which its guard checks (and only those);
        None without a guard, before capture, or where they are not known (a CUDA capture
        that ran compiled kernels), where the guard checks the whole model."""
        return self._guard.reads if self._guard is not None else None

    @property
    def last_audit(self) -> AuditReport | None:
        """The report of the last audit a replay ran (`audit_every`), or None."""
        return self._last_audit

    @property
    def captured(self) -> bool:
        """Whether a capture succeeded, so that `replay()` can run."""
        return self._state.captured

    def pool(self) -> PoolHandle | None:
        """The memory pool, for graphs that should share it: `Graph(pool=g.pool())`.

        Returns:
            The CUDA pool handle, or None on the CPU backend.

        Raises:
            CaptureError: CUDA backend, before capture began.
        """
        if isinstance(self._backend, CPUBackend):
            return None
        return self._backend.pool()

    @contextlib.contextmanager
    def capture(
        self, warmup: Callable[[], object] | None = None, *, warmup_iters: int = 3
    ) -> Iterator[None]:
        """Capture the body as the graph (on CUDA its outputs hold values only after the
        first `replay()`; on the CPU the body also runs eagerly).

        Args:
            warmup: Zero-argument callable, usually the body, run before capture (on a
                side stream for CUDA) so that lazy initialisation stays out of the graph.
            warmup_iters: How many times to run `warmup`.

        Raises:
            CaptureError: The graph was already captured (or a capture failed), or the
                body reads a tensor's value into Python.
            StaleError: With a guard, the model's derived buffers were never materialized.
        """
        self._state.check_new()  # before warm-up and pinning
        if self._model is not None:
            Guard.check_capturable(self._model)  # before warm-up runs the model
        bring_up = (runtime(self._model).capturing() if self._model is not None
                    else contextlib.nullcontext())
        with bring_up, hinting():  # the warm-up and the capture end the model's bring-up
            if warmup is not None:
                self._backend.warmup(warmup, warmup_iters)
            try:
                if self._model is not None:
                    # Before the body: the ledger must record the storage the graph reads.
                    self._guard = Guard(
                        self._model, self, repair=self._repair, device=self._backend_name
                    )
                with self._state.capturing(), self._backend.capture():
                    yield
                if self._guard is not None:
                    self._guard.narrow(self._backend.reads, self._backend.outside())
            except BaseException:
                self._release()
                raise

    def reset(self) -> None:
        """Forget the capture, releasing its pin, snapshot and memory, so that it can capture
        again."""
        self._release()
        self._backend = self._make_backend()
        self._state = CaptureState()
        if self._auditor is not None:  # its scratch block goes with the capture
            self._auditor = Auditor()

    def _release(self) -> None:
        if self._guard is not None:
            self._guard.release()
            self._guard = None

    def replay(self) -> None:
        """Replay the captured graph; with a guard, check the model first, under its lock.

        Raises:
            CaptureError: Nothing was captured, or the capture failed.
            StorageMovedError: With a guard, a pinned tensor or submodule was rebound
                after capture. Nothing is replayed.
            StaleError: With a guard, derived buffers are stale, or the last weight update
                failed or has not ended; with `audit_every`, the audit of this replay
                found a derived tensor that differs from its recomputation. Nothing is
                replayed.
        """
        self._state.check_replay()
        if self._guard is None:
            self._backend.replay()
            return
        with self._guard.replaying():
            if self._auditor is not None:
                self._audit(self._guard)
            self._backend.replay()

    def _audit(self, guard: Guard) -> None:
        """Count this replay; on every `audit_every`-th, audit under the lock the guard
        holds, after its checks (and repairs) ran."""
        assert self._audit_every is not None and self._auditor is not None
        self._until_audit -= 1
        if self._until_audit > 0:
            return
        self._until_audit = 1  # a failed audit runs again at the next replay
        self._last_audit = self._auditor.run(guard.runtime, atol=0.0, rtol=0.0)
        self._until_audit = self._audit_every
