"""Loads: one load or `weight_update` block as a tracked write, start to end.

A `Load` watches the storages a load may write (derivation inputs, or every tensor of
the model for an update block) at the dispatcher, in the thread that runs it and in
worker threads that join it. `end` records what was written in the journal and brings
the derived buffers up to date, or, when the load raised, leaves them failed closed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Protocol

import torch

from graphsafe._declare.spec import RefreshReport
from graphsafe._errors import one_line
from graphsafe._memory.journal import JOURNAL, storage_key
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.tracking import write_tracker
from graphsafe._runtime.transient import Transient, Transients

__all__ = ["Load", "LoadOwner", "end", "tracked_block", "tracked_call", "tracked_generator"]


class Load:
    """One load or `weight_update` block in progress: what it has written so far.

    Args:
        watch: Storage keys to track, mapped to anything (e.g. paths).
    """

    __slots__ = (
        "clock",
        "done",
        "early",
        "lock",
        "moved",
        "reports",
        "thread",
        "tracker",
        "transient_written",
        "transients",
        "watch",
        "workers",
        "written",
    )

    def __init__(self, watch: dict[int, Any], transients: Transients | None = None) -> None:
        self.thread = threading.get_ident()
        self.watch = watch
        self.transients = transients or None
        self.tracker = write_tracker(watch, self.transients)
        self.written: set[int] = set()
        self.transient_written: set[Transient] = set()
        self.moved: set[int] = set()
        """Derivations whose inputs were found rebound (and taken) when the load began."""
        self.reports: list[RefreshReport] = []
        """Reports of the refreshes run in the middle of the load."""
        self.early: dict[int, frozenset[int]] = {}
        """Derivations refreshed in the middle of the load (their transient inputs were
        complete), with what the load had written by then."""
        self.lock = threading.Condition(threading.Lock())
        self.done = False
        self.workers = 0
        self.clock = JOURNAL.clock

    def written_so_far(self) -> set[int]:
        """Storage keys written so far, by the load's thread and by workers that joined."""
        return self.written | self.tracker.written

    def transients_written(self) -> set[Transient]:
        """Transient inputs written so far."""
        return self.transient_written | self.tracker.transient_written

    def close(self) -> set[int]:
        """End the load, once the worker threads that joined it have returned.

        Returns:
            What it wrote, workers' writes included.
        """
        with self.lock:
            while self.workers:
                self.lock.wait()
            self.done = True
            return self.written_so_far()

    def enter_worker(self) -> bool:
        """Join this load from another thread; False once it has ended."""
        with self.lock:
            if self.done:
                return False
            self.workers += 1
            return True

    def run_worker(
        self, fn: Callable[..., Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a loader in a worker thread that joined this load (`enter_worker`).

        The load does not end before the worker returns, so no replay can run between
        its refresh and the worker's writes.

        Args:
            fn: The unwrapped loading method.
            module: The module it is called on.
            args: Positional arguments.
            kwargs: Keyword arguments.

        Returns:
            What the loader returned.
        """
        tracker = write_tracker(self.watch, self.transients)
        try:
            with tracker:
                return fn(module, *args, **kwargs)
        finally:
            with self.lock:
                self.written |= tracker.written
                self.transient_written |= tracker.transient_written
                self.workers -= 1
                self.lock.notify_all()


def refresh_ready(engine: Engine, load: Load, *, within_call: bool = False) -> None:
    """In the middle of a load: refresh the derivations whose transient inputs are now
    completely written, then release those inputs (the layer-by-layer bound).

    Args:
        engine: The engine of the model's binding.
        load: The load in progress.
        within_call: Called right after an op, inside a loader call: only derivations
            that read nothing but transient inputs run now (a resident input may still
            be written later in the same call); the rest wait for the call to end.
    """
    transients = engine.transients
    written = [tr for tr in load.transients_written() if tr.held and tr.complete]
    if not written:
        return
    candidates = {i for tr in written for i in transients.readers[id(tr)]} - set(load.early)
    ready = transients.ready(candidates, engine.bound)
    if within_call:
        bound = engine.bound
        ready = [
            i for i in ready
            if not bound[i].deps and all(inp.transient for inp in bound[i].leaf_inputs)
        ]
    if not ready:
        return
    so_far = frozenset(load.written_so_far())
    for i in ready:
        # One at a time, with what reads its outputs, each input released as soon as
        # its last reader ran: the least memory held at once.
        load.reports.append(engine.run(engine.bound[i].downstream))
        load.early[i] = so_far
        done = set(load.early)
        transients.release(
            tr for tr in transients.of(engine.bound[i])
            if tr.held and done.issuperset(transients.readers[id(tr)])
        )


def end(
    engine: Engine,
    load: Load,
    what: str,
    exc: BaseException | None,
    *,
    pinned: bool,
    model_tensors: Callable[[], Iterable[torch.Tensor]],
    witnesses: bool = False,
    since: int | None = None,
) -> None:
    """Record a finished load in the journal and bring the buffers up to date.

    Args:
        engine: The engine of the model's binding.
        load: The load that ended (closed: its workers have returned).
        what: The load, for the journal and messages ("Model.load_weights").
        exc: What it raised, if it raised.
        pinned: Whether a graph holds the model's storage.
        model_tensors: Every tensor of the model.
        witnesses: Also refresh what the witnesses see changed (update blocks, where
            `gs.mark_written` and in-place writes count).
        since: The journal's clock when the load began: if anything was recorded
            since (a `gs.mark_written` in the loader), the witnesses are checked too.

    Raises:
        StorageMovedError: Pinned, and something was rebound.
        Exception: Whatever a derivation raised (the rest is marked stale).
    """
    written = load.close()
    JOURNAL.advance(written, what)
    transients = engine.transients
    # Those refreshed and released in the middle of the load are done with.
    touched = {tr for tr in load.transients_written() if tr.held}
    if exc is not None:
        why = f"{what} raised {one_line(exc)}"
        dirty = engine.consumers_of(written) | load.moved
        dirty.update(i for inp in engine.find_moved()[0] for i in inp.consumers)
        dirty.update(i for tr in touched for i in transients.readers[id(tr)])
        engine.mark_stale(dirty, why)
        transients.release()
        # Every weight of the tree may be half-written; derived buffers are stale only
        # where marked above.
        buffers = {storage_key(t) for b in engine.bound for t in b.buffers or ()}
        JOURNAL.poison(
            (t for t in model_tensors() if storage_key(t) not in buffers),
            f"the last weight update failed ({why})",
        )
        return
    dirty = engine.scan_moved(pinned) | engine.consumers_of(written) | load.moved
    if witnesses or (since is not None and JOURNAL.clock != since + 1):
        dirty.update(engine.witness_dirty())
    dirty.update(b.index for b in engine.bound if b.buffers is None)
    partial: dict[int, str] = {}
    incomplete = [tr for tr in touched if not tr.complete]
    for tr in touched:
        readers = transients.readers[id(tr)]
        if not tr.complete:
            why = (f"its transient input {tr.input.path} was only partly written by {what} "
                   f"({min(tr.written, tr.numel)} of {tr.numel} elements)")
            partial.update((i, why) for i in readers)
        else:
            dirty.update(i for i in readers if i not in load.early)
    kept = []
    for i, at in load.early.items():  # refreshed mid-load: stale only if written since
        if i not in engine.consumers_of(written - at):
            dirty.discard(i)
            kept.append(i)
    engine.rewitness(kept)  # their inputs' journal epochs moved with this load
    for i, why in partial.items():
        engine.mark_stale([i], why)
        dirty.discard(i)
    transients.release(incomplete)  # so that nothing computes from half their values
    try:
        final = engine.run(engine.closure(dirty))
    finally:
        transients.release()
    if load.reports:  # the whole load's refreshes in one report
        engine.last_report = RefreshReport.combined([*load.reports, final])
    if JOURNAL.poisoned:  # a completed load heals what a failed one poisoned
        JOURNAL.heal(storage_key(t) for t in model_tensors())



class LoadOwner(Protocol):
    """What runs loads: the runtime of one model."""

    _lock: threading.RLock
    _load: Load | None

    def _begin(self, *, full_watch: bool) -> Load: ...

    def _between_loads(self, load: Load) -> None: ...

    def _end(
        self, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False
    ) -> None: ...



def _name(fn: Callable[..., Any], module: Any) -> str:
    return f"{type(module).__name__}.{getattr(fn, '__name__', 'load')}"


def tracked_call(
    owner: LoadOwner,
    fn: Callable[..., Any],
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run a loader as one tracked load (or inside the load already running).

    Args:
        owner: The runtime.
        fn: The unwrapped loading method.
        module: The module it is called on.
        args: Positional arguments.
        kwargs: Keyword arguments.

    Returns:
        What the loader returned.
    """
    load = owner._load
    if load is not None:
        if load.thread == threading.get_ident():
            result = fn(module, *args, **kwargs)  # nested: the outer load tracks it
            owner._between_loads(load)
            return result
        if load.enter_worker():  # a worker thread of that load
            return load.run_worker(fn, module, args, kwargs)
    with owner._lock:
        load = owner._begin(full_watch=False)
        try:
            with load.tracker:
                result = fn(module, *args, **kwargs)
        except BaseException as exc:
            owner._end(load, _name(fn, module), exc)
            raise
        owner._end(load, _name(fn, module), None)
        return result


def tracked_generator(
    owner: LoadOwner,
    fn: Callable[..., Any],
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Generator[Any, None, Any]:
    """A generator loader as one tracked load over its whole iteration.

    Each step runs under the tracker; the caller's code between steps does not. The load
    ends when the loader is exhausted; closed early, it ends as a failure.

    Args:
        owner: The runtime.
        fn: The unwrapped generator function.
        module: The module it is called on.
        args: Positional arguments.
        kwargs: Keyword arguments.

    Returns:
        A generator yielding what the loader yields.
    """
    what = _name(fn, module)

    def steps() -> Generator[Any, None, Any]:
        inner = fn(module, *args, **kwargs)
        with owner._lock:
            load = owner._begin(full_watch=False)
            try:
                while True:
                    with load.tracker:
                        try:
                            item = next(inner)
                        except StopIteration as stop:
                            result = stop.value
                            break
                    yield item
            except GeneratorExit:
                inner.close()
                owner._end(load, what, GeneratorExit("the loader was closed before it ended"))
                raise
            except BaseException as exc:
                owner._end(load, what, exc)
                raise
            owner._end(load, what, None)
            return result

    return steps()


@contextlib.contextmanager
def tracked_block(owner: LoadOwner) -> Iterator[None]:
    """A `weight_update` block as one tracked load (or inside the one running).

    Args:
        owner: The runtime.

    Yields:
        None.
    """
    load = owner._load
    if load is not None and load.thread == threading.get_ident():
        yield
        return
    with owner._lock:
        load = owner._begin(full_watch=True)
        try:
            with load.tracker:
                yield
        except BaseException as exc:
            owner._end(load, "weight_update", exc)
            raise
        owner._end(load, "weight_update", None, witnesses=True)
