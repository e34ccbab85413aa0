"""A load on one runtime, from its beginning to its end, and what it tells the others.

The tracked loads of `_loads` (a loading method, a generator loader, a `weight_update`
block, `load_state_dict`) call back into their runtime when a load begins (which storages
to watch), between loader calls (derivations whose transient inputs are complete), and
when it ends (the journal, the refresh, the checks run after a load). A load that ends
normally then refreshes every other live runtime that reads a storage it wrote (tied or
shared parameters).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from graphsafe._errors import GraphSafetyError
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.load import Load, end, refresh_ready

__all__ = ["LIVE", "after_state_dict_load", "begin", "between_loads", "end_load"]


class _Owner(Protocol):
    """The runtime, as its loads use it."""

    _lock: threading.RLock
    _engine: Engine | None
    _load: Load | None
    _after_load: list[Callable[[], None]]

    @property
    def pinned(self) -> bool: ...

    def _bound(self) -> Engine: ...

    def _model_tensors(self) -> dict[int, str]: ...

    def _tensors(self) -> Iterator[torch.Tensor]: ...


LIVE: weakref.WeakSet[_Owner] = weakref.WeakSet()
"""Every runtime alive: a load that ended tells them what it wrote."""


def after_state_dict_load(rt: _Owner) -> None:
    """Refresh what `load_state_dict` wrote (its in-place copies move versions).

    Args:
        rt: The runtime of the model loaded.
    """
    with rt._lock:
        if rt._load is not None or rt._engine is None:
            return  # inside a tracked load or update: refreshed when it ends
        # Ended as any load ends; what it wrote, the witnesses (versions) and the
        # transient inputs the pre-hook gave memory to say what to refresh.
        load = Load({}, rt._bound().transients)
        load.transient_written = {tr for tr in load.transients or () if tr.held}
        end_load(rt, load, "load_state_dict", None, witnesses=True)


def begin(rt: _Owner, *, full_watch: bool) -> Load:
    """Begin a load on `rt`: watch the storages it may write.

    Args:
        rt: The runtime, its lock held.
        full_watch: Watch every tensor of the model (an update block), not only the
            derivations' inputs.

    Returns:
        The load, now `rt`'s load in progress.
    """
    engine = rt._bound()
    # Watch where the inputs are now: one rebound (before pin) through another model
    # sharing it is taken here, so that this load's writes into it are seen.
    moved = engine.scan_moved(rt.pinned)
    watch: dict[int, Any] = engine.watch_map()
    if full_watch:
        # Watch every tensor of the model, not only derivation inputs, so that a
        # replay inside the block is refused as soon as anything was written.
        watch = dict(watch)
        for key, path in rt._model_tensors().items():
            watch.setdefault(key, path)
    load = Load(watch, engine.transients)
    load.moved = moved
    if engine.transients:
        # Derivations of transient inputs run as soon as an op completes their last
        # input, in this thread (which holds the lock), not only between loader calls.
        load.tracker.on_complete = lambda: refresh_ready(engine, load, within_call=True)
    rt._load = load
    return load


def between_loads(rt: _Owner, load: Load) -> None:
    """Between two loader calls of one load: refresh what transient inputs completed.

    Args:
        rt: The runtime.
        load: Its load in progress.
    """
    if rt._engine is not None and rt._engine.transients:
        refresh_ready(rt._engine, load)


def end_load(
    rt: _Owner, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False
) -> None:
    """End `rt`'s load: the journal and the refresh, then the other runtimes and checks.

    Args:
        rt: The runtime, its lock held.
        load: Its load in progress.
        what: The load, for the journal and messages ("Model.load_weights").
        exc: What the load raised, if it raised.
        witnesses: Also refresh what the witnesses see changed.
    """
    engine = rt._engine or rt._bound()  # the tree was checked when the load began
    try:
        end(engine, load, what, exc, pinned=rt.pinned, model_tensors=rt._tensors,
            witnesses=witnesses, since=load.clock)
    finally:
        rt._load = None
    if exc is None:
        _refresh_others(rt, load.written_so_far())
        for check in rt._after_load:
            check()


def _refresh_storages(rt: _Owner, keys: set[int]) -> None:
    """Refresh the derivations of `rt` reading `keys`, if it is free right now.

    Called when a load through another model wrote storages this one reads (a tied
    or shared parameter). A runtime busy in another thread is skipped: its witnesses
    still see the write.

    Args:
        rt: The runtime.
        keys: Storage keys written.
    """
    if not rt._lock.acquire(blocking=False):
        return
    try:
        engine = rt._engine
        if engine is None or rt._load is not None or not engine.consumers_of(keys):
            return  # reads none of it (a storage it took since is seen by its witnesses)
        engine = rt._bound()  # binds again if its tree changed (before pin)
        dirty = engine.scan_moved(rt.pinned) | engine.consumers_of(keys)
        if dirty:
            engine.run(engine.closure(dirty))
    finally:
        rt._lock.release()


def _refresh_others(origin: _Owner, written: set[int]) -> None:
    if not written:
        return
    for rt in list(LIVE):
        if rt is not origin and rt._engine is not None:
            with contextlib.suppress(GraphSafetyError):  # left stale: its guard reports it
                _refresh_storages(rt, written)
