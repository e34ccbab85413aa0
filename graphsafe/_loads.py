"""Loads: one load or `weight_update` block as a tracked write, start to end.

A `Load` watches the storages a load may write (derivation inputs, or every tensor of
the model for an update block) at the dispatcher, in the thread that runs it and in
worker threads that join it. `end` records what was written in the journal and brings
the derived buffers up to date, or, when the load raised, leaves them failed closed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from graphsafe._engine import Engine
from graphsafe._journal import JOURNAL, storage_key
from graphsafe._tracking import WriteTracker

__all__ = ["Load", "end"]


class Load:
    """One load or `weight_update` block in progress: what it has written so far.

    Args:
        watch: Storage keys to track, mapped to anything (e.g. paths).
    """

    __slots__ = ("done", "lock", "thread", "tracker", "watch", "written")

    def __init__(self, watch: dict[int, Any]) -> None:
        self.thread = threading.get_ident()
        self.watch = watch
        self.tracker = WriteTracker(watch)
        self.written: set[int] = set()
        self.lock = threading.Lock()
        self.done = False

    def written_so_far(self) -> set[int]:
        """Storage keys written so far, by the load's thread and by workers that joined."""
        return self.written | self.tracker.written

    def close(self) -> set[int]:
        """End the load.

        Returns:
            What it wrote, workers' writes included.
        """
        with self.lock:
            self.done = True
            return self.written_so_far()

    def join(
        self, fn: Callable[..., Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, set[int]]:
        """Run a loader in a worker thread as part of this load.

        Args:
            fn: The unwrapped loading method.
            module: The module it is called on.
            args: Positional arguments.
            kwargs: Keyword arguments.

        Returns:
            The loader's result, and what it wrote if this load had already ended (the
            caller must then refresh for it); else an empty set.
        """
        tracker = WriteTracker(self.watch)
        with tracker:
            result = fn(module, *args, **kwargs)
        with self.lock:
            if not self.done:
                self.written |= tracker.written
                return result, set()
        return result, tracker.written


def end(
    engine: Engine,
    written: set[int],
    what: str,
    exc: BaseException | None,
    *,
    pinned: bool,
    model_tensors: Callable[[], dict[int, str]],
    witnesses: bool = False,
) -> None:
    """Record a finished load in the journal and bring the buffers up to date.

    Args:
        engine: The engine of the model's binding.
        written: Storage keys the load wrote.
        what: The load, for the journal and messages ("Model.load_weights").
        exc: What it raised, if it raised.
        pinned: Whether a graph holds the model's storage.
        model_tensors: `{storage key: path}` of every tensor of the model.
        witnesses: Also refresh what the witnesses see changed (update blocks, where
            `gs.mark_written` and in-place writes count).

    Raises:
        StorageMovedError: Pinned, and something was rebound.
        Exception: Whatever a derivation raised (the rest is marked stale).
    """
    JOURNAL.advance(written, what)
    if exc is not None:
        why = f"{what} raised {type(exc).__name__}: {_first_line(exc)}"
        dirty = engine.consumers_of(written)
        dirty.update(i for inp in engine.find_moved()[0] for i in inp.consumers)
        engine.mark_stale(dirty, why)
        # Every weight of the tree may be half-written; derived buffers are stale only
        # where marked above.
        buffers = {storage_key(t) for b in engine.bound for t in b.buffers or ()}
        JOURNAL.poison(
            (k for k in model_tensors() if k not in buffers),
            f"the last weight update failed ({why})",
        )
        return
    dirty = engine.scan_moved(pinned) | engine.consumers_of(written)
    if witnesses:
        dirty.update(engine.witness_dirty())
    dirty.update(b.index for b in engine.bound if b.buffers is None)
    engine.run(engine.closure(dirty))
    if JOURNAL.poisoned:  # a completed load heals what a failed one poisoned
        JOURNAL.heal(model_tensors())


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""
