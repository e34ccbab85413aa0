"""Lazy refresh: what loads of one model left stale for the next replay to refresh once.

Under `Runtime.lazy_refresh` a load only marks the derivations it makes stale
(`Load.deferred`). `Deferred` keeps them, with the engine whose derivations their indices
number, until the check before the next replay (or turning lazy refresh off) refreshes
them together. The model's `LoadDriver` holds one and calls it under the model's lock.
"""

from __future__ import annotations

from graphsafe._runtime.loads.load import Load
from graphsafe._runtime.refresh.engine import Engine

__all__ = ["Deferred"]


class Deferred:
    """Whether loads defer their refresh, and what they deferred, in which engine."""

    __slots__ = ("_engine", "_indices", "_lazy")

    def __init__(self) -> None:
        self._lazy = False
        self._engine: Engine | None = None
        self._indices: set[int] = set()

    @property
    def lazy(self) -> bool:
        """Whether loads only mark what they make stale (`Load.end(lazy=...)`)."""
        return self._lazy

    def set_lazy(self, lazy: bool) -> None:
        """Defer the refresh of loads from now on, or not (what was deferred stays until
        `refresh`)."""
        self._lazy = bool(lazy)

    def take(self, load: Load) -> None:
        """Keep what `load` left stale; what loads deferred in another engine (the model
        was bound anew since) is dropped: the new binding refreshes on its own."""
        if not load.deferred:
            return
        if self._engine is not load.engine:
            self._indices = set()
        self._engine = load.engine
        self._indices |= set(load.deferred)

    def refresh(self, current: Engine | None) -> None:
        """Refresh what was deferred, once, in `current` (the engine bound now), and
        forget it. Nothing if none was, if `current` is another engine than the one the
        loads deferred in, or if a failed load left buffers stale: the freshness check
        refuses those."""
        engine, deferred = self._engine, self._indices
        if not deferred:
            return
        self._engine, self._indices = None, set()
        if engine is not current or current is None:
            return  # bound anew since: the new binding refreshes on its own
        if any(i in current.reasons for i in current.stale):
            return
        plan = sorted(i for i in deferred if i in current.stale)
        if plan:
            current.recompute(current.closure(plan))
