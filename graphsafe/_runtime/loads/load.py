"""One load or `weight_update` block of one model, from its beginning to its end.

A `Load` watches every storage of the model at the dispatcher, in its thread (while the
loader's own code runs: not between the steps of a generator or async loader) and in
worker threads that join it. Mid-load it refreshes derivations whose transient inputs
became complete; at its end it records the writes in the journal, heals the poison of
what it wrote and brings the derived buffers up to date, or, when the load raised,
leaves them failed closed. The model's `LoadDriver` drives it (`Load.begin`, `load.end`)
under the model's lock; nothing else changes its fields.

A generator loader (or the generator a loading method returns) and an async loader's
coroutine are one `Load` over their whole run, but its tracker is on only while the
loader's own code runs: each step runs under `Load.running()`, and the code between steps
(the caller iterating the generator, the event loop's other tasks) does not (`steps`,
`awaited`).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Set
from typing import Any, Final

import torch
from torch import nn

from graphsafe import _native
from graphsafe._declare.spec import RefreshReport
from graphsafe._errors import one_line
from graphsafe._lineage.record.native import recording
from graphsafe._lineage.record.recorder import RECORDING, Lineage
from graphsafe._lineage.record.threads import followed
from graphsafe._memory.journal import Journal
from graphsafe._memory.snapshot import Identities
from graphsafe._memory.walk import storage_key, storage_keys
from graphsafe._runtime.bind.experts import MapReads
from graphsafe._runtime.refresh.engine import Engine
from graphsafe._runtime.transient.transients import Transient
from graphsafe._runtime.writes.tracking import (
    NativeWriteTracker,
    WriteTracker,
    write_tracker,
)

__all__ = ["Load", "LoaderClosed", "awaited", "steps"]


class Load:
    """One load or `weight_update` block in progress: what it has written so far.

    `watch` holds the storage keys to track; `taken` holds the
    derivations whose inputs were found rebound (and taken) when it began; `writes` the
    paths an update named as all it writes (None: it may write any tensor).
    """

    __slots__ = (
        "_cond",
        "_done",
        "_early",
        "_reports",
        "_transient_written",
        "_worker_ops",
        "_workers",
        "_written",
        "clock",
        "deferred",
        "engine",
        "journal",
        "lineage",
        "map_reads",
        "record",
        "sequenced",
        "stepping",
        "taken",
        "thread",
        "tracker",
        "watch",
        "weights",
        "writes",
    )

    def __init__(
        self,
        engine: Engine,
        watch: frozenset[int],
        journal: Journal,
        taken: set[int] | None = None,
        sequenced: frozenset[int] = frozenset(),
    ) -> None:
        self.engine: Final = engine
        self.thread: Final = threading.get_ident()
        self.watch: Final = watch
        self.journal: Final = journal
        self.clock: Final = journal.clock
        self.taken: Final = taken or set()
        self.writes: frozenset[str] | None = None
        self.stepping = False
        """Whether the loader's own code runs now (its tracker is on)."""
        transients = engine.transients or None
        self.sequenced: Final = sequenced
        """Storage keys whose writers are kept in order (weights the post-load step
        rewrites in place)."""
        self.tracker: Final = write_tracker(watch, transients, sequenced)
        self._worker_ops: list[dict[int, list[str]]] = []
        self.lineage: Final = Lineage()
        """What the loader's own code computed from what (`graphsafe._lineage`)."""
        self.record = False
        """Whether the loader's ops are recorded (`_lineage.record.recorder.RECORDING`)."""
        self.weights: frozenset[int] = frozenset()
        """Storage keys of the model's weights when it began (for the recorder)."""
        self.map_reads: MapReads | None = None
        """The numbers its threads read out of expert maps that moved experts (set as
        it begins, when there are such maps)."""
        self._written: Set[int] = set()
        self._transient_written: set[Transient] = set()
        self._reports: Final[list[RefreshReport]] = []  # refreshes run in the middle of the load
        # Derivations refreshed in the middle of the load (their transient inputs were
        # complete), with what the load had written by then.
        self._early: Final[dict[int, frozenset[int]]] = {}
        self.deferred: list[int] = []
        """Derivations this load left stale for the next replay to refresh (lazy)."""
        self._cond: Final = threading.Condition(threading.Lock())
        self._done = False
        self._workers = 0
        if engine.transients:
            # Derivations of transient inputs run as soon as an op completes their last
            # input, in this thread (which holds the lock), not only between loader calls.
            self.tracker.on_complete = lambda: self.refresh_ready(within_call=True)

    @classmethod
    def begin(
        cls,
        engine: Engine,
        journal: Journal,
        *,
        pinned: bool,
        everything: frozenset[int],
        writes: frozenset[str] | None = None,
        weights: frozenset[int] = frozenset(),
        record: bool = False,
        sequenced: frozenset[int] = frozenset(),
        walked: Identities | None = None,
        follow: frozenset[int] | None = None,
    ) -> Load:
        """Begin a load: take (before pin) or refuse (after) what was rebound, and watch
        all of `everything` (the storage key of every model tensor), the derivations'
        inputs and their buffers; `writes`: see the class. `walked`: the rows of a walk
        whose check held just now (`ModelMap.rows`): where they record every input and
        buffer as the engine does, nothing was rebound and the engine's own pass is not
        run again. `follow`: the storages whose derivatives its tracker follows (None:
        `weights`; an expert layout's maps are followed too)."""
        # Watch where the inputs are now: one rebound (before pin) through another model
        # sharing it is taken here, so that this load's writes into it are seen. The
        # inputs and buffers are watched whatever `everything` missed.
        unmoved = walked is not None and engine.watch.recorded_in(walked)
        taken = set() if unmoved else engine.scan_moved(pinned)
        load = cls(engine, engine.watch.watched_with(everything), journal, taken, sequenced)
        load.writes = writes
        load.weights = weights
        load.record = record
        if sequenced or (not record and RECORDING[0] != "off"):
            # What a later load makes from the weights in a new place (a LoRA merged into
            # a kernel's copy) is found without recording it: its tracker follows it. And
            # a weight rewritten in place by `copy_` is told from one loaded by it so.
            load.tracker.taint(weights if follow is None else follow)
        return load

    @classmethod
    def of_state_dict(cls, engine: Engine, journal: Journal, written: Set[int]) -> Load:
        """The load `load_state_dict` made: its writes (`written`) are seen by versions,
        and the transient inputs its pre-hook held were written whole."""
        load = cls(engine, frozenset(), journal)
        load._written = written
        load._transient_written = {tr for tr in engine.transients if tr.held}
        return load

    def expect_writes(self, paths: frozenset[str] | None) -> None:
        """The update names every tensor it writes from now on (None: any tensor)."""
        self.writes = paths

    def written_so_far(self) -> Set[int]:
        """Storage keys written so far, by the load's thread and by workers that joined
        (once it stopped: all it wrote)."""
        if self._done:
            return self._written
        written = self.tracker.written
        if not self._written:  # no worker joined: the tracker's set, if no write moves it
            return written if isinstance(written, frozenset) else set(written)
        return self._written | written

    def rewritten(self) -> Set[int]:
        """Once the load recorded its writes: the storage keys it wrote, with those
        declared written (`gs.mark_written`) or written by other loads while it ran."""
        written = self.written_so_far()
        if self.journal.clock > self.clock + 1:  # more than this load's own record
            written = written | self.journal.written_since(self.clock)
        return written

    def write_ops(self) -> dict[int, list[str]]:
        """Of the `sequenced` keys, the ops that wrote each (the load's thread's in
        order, then each worker's)."""
        ops = {k: list(v) for k, v in self.tracker.ops.items()}
        for worker in self._worker_ops:
            for key, names in worker.items():
                ops.setdefault(key, []).extend(names)
        return ops

    def transients_written(self) -> set[Transient]:
        """Transient inputs written so far."""
        return self._transient_written | self.tracker.transient_written

    def enter_worker(self) -> bool:
        """Join this load from another thread; False once it has ended."""
        with self._cond:
            if self._done:
                return False
            self._workers += 1
            return True

    def run_worker(
        self, fn: Callable[..., Any], module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run a loader in a worker thread that joined this load (`enter_worker`).

        The load does not end before the worker returns, so no replay can run between
        its refresh and the worker's writes.
        """
        tracker = self._worker_tracker(self.engine.transients or None)
        try:
            with tracker:
                return fn(module, *args, **kwargs)
        finally:
            with self._cond:
                self._written |= tracker.written
                if self.sequenced:
                    self._worker_ops.append(tracker.ops)
                self._transient_written |= tracker.transient_written
                self._workers -= 1
                self._cond.notify_all()

    def _worker_tracker(self, transients: Any) -> WriteTracker | NativeWriteTracker:
        """The tracker of a thread that joins the load: a rewrite by `copy_` it runs over
        the weights is told from a load as in the load's own thread."""
        tracker = write_tracker(self.watch, transients, self.sequenced)
        if self.sequenced:
            tracker.taint(self.weights)
        return tracker

    def _close(self) -> Set[int]:
        """Wait for the workers that joined, then stop; returns everything written."""
        with self._cond:
            while self._workers:
                self._cond.wait()
            self._written = self.written_so_far()
            self._done = True
            return self._written

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The loader's own code runs: under the tracker, `stepping` set; threads and pool
        tasks it starts are tracked too (`fork`)."""
        with self.tracker, followed(self), (
                recording(self.lineage, self.weights) if self.record
                else contextlib.nullcontext()), self._reading():
            self.stepping = True
            try:
                yield
            finally:
                self.stepping = False

    def _reading(self) -> contextlib.AbstractContextManager[Any]:
        """Note the numbers read out of expert maps in this thread, if any are watched."""
        return self.map_reads if self.map_reads is not None else contextlib.nullcontext()

    def fork(self) -> contextlib.AbstractContextManager[None]:
        """What a thread the loader starts, or a task it hands to a pool, runs under: a
        tracker of its own, whose writes join the load (written after the load ended,
        they are recorded in the journal as writes outside it)."""
        return self._tracked_thread()

    @contextlib.contextmanager
    def _tracked_thread(self) -> Iterator[None]:
        tracker = self._worker_tracker(None)
        try:
            with tracker, self._reading():
                yield
        finally:
            with self._cond:
                late = self._done
                if not late:
                    self._written |= tracker.written
                    if self.sequenced:
                        self._worker_ops.append(tracker.ops)
            if late and tracker.written:
                self.journal.advance(tracker.written, "a thread a load started, after the "
                                     "load ended")

    def between_calls(self) -> None:
        """Between two loader calls of the load: refresh what transient inputs completed."""
        if self.engine.transients:
            self.refresh_ready()

    def refresh_ready(self, *, within_call: bool = False) -> None:
        """Refresh the derivations whose transient inputs are now completely written, then
        release those inputs (the layer-by-layer bound on memory). `within_call` (right
        after an op, inside a loader call): only derivations reading nothing but transient
        inputs run now, as a resident input may still be written later in the same call."""
        engine = self.engine
        transients = engine.transients
        written = [tr for tr in self.transients_written() if tr.held and tr.complete]
        if not written:
            return
        candidates = {i for tr in written for i in transients.readers[id(tr)]}
        ready = transients.ready(candidates - set(self._early), engine.bound)
        if within_call:
            bound = engine.bound
            ready = [
                i for i in ready
                if not bound[i].deps and all(inp.transient for inp in bound[i].leaf_inputs)
            ]
        so_far = frozenset(self.written_so_far())
        for i in ready:
            # One at a time, with what reads its outputs, each input released as soon as
            # its last reader ran: the least memory held at once.
            self._reports.append(engine.recompute(engine.bound[i].downstream))
            self._early[i] = so_far
            done = set(self._early)
            transients.release(
                tr for tr in transients.of(engine.bound[i])
                if tr.held and done.issuperset(transients.readers[id(tr)])
            )

    def end(
        self,
        what: str,
        exc: BaseException | None,
        *,
        pinned: bool,
        model_tensors: Callable[[], Iterable[torch.Tensor]],
        modules: Callable[[], list[nn.Module]] | None = None,
        witnesses: bool = False,
        lazy: bool = False,
    ) -> Set[int]:
        """Record the finished load `what` ("Model.load_weights") in the journal and bring
        the buffers up to date (or fail them, if it raised `exc`); returns the keys written.

        Args:
            model_tensors: Every tensor of the model (a walk).
            modules: Its modules, whose parameters and buffers are looked in first (the
                journal asks for the storage of each storage it has not seen: a first
                load asks for all it wrote, and walks the model only for one not found
                there).
            witnesses: Also refresh what the witnesses see changed (update blocks, where
                `gs.mark_written` and in-place writes count).
            lazy: Leave what it made dirty stale (`deferred`) for the next replay to
                refresh, instead of refreshing it now; a model with transient inputs,
                which only a load can give, refreshes now.

        Raises:
            StorageMovedError: Pinned, and something was rebound.
            Exception: Whatever a derivation raised (the rest is marked stale).
        """
        written = self._close()
        self.journal.advance(written, what, _StorageFinder(model_tensors, modules))
        # Those refreshed and released in the middle of the load are done with.
        touched = {tr for tr in self.transients_written() if tr.held}
        if exc is not None:
            self._fail(written, touched, f"{what} raised {one_line(exc)}")
            return written
        self.journal.heal(self.rewritten())  # written again: no longer what a failure left
        engine = self.engine
        dirty = engine.scan_moved(pinned) | _consumers(engine, written) | self.taken
        # Anything recorded since the load began (a `gs.mark_written` in the loader), or
        # a write into a derived buffer itself: the witnesses are checked too.
        if (witnesses or self.journal.clock != self.clock + 1
                or not written.isdisjoint(engine.watch.buffer_keys())):
            dirty.update(engine.witness_dirty())
        dirty.update(engine.watch.unmade())
        dirty, incomplete = self._sort_transients(dirty, touched, what)
        kept = []
        for i, at in self._early.items():  # refreshed mid-load: stale only if written since
            if i not in _consumers(engine, written - at):
                dirty.discard(i)
                kept.append(i)
        engine.watch.rewitness(kept)  # their inputs' journal epochs moved with this load
        if lazy and not engine.transients:
            self.deferred = engine.closure(dirty)
            engine.defer(self.deferred)
            return written
        engine.transients.release(incomplete)  # so that nothing computes from half their values
        try:
            final = engine.recompute(engine.closure(dirty))
        finally:
            engine.transients.release()
        if self._reports:  # the whole load's refreshes in one report
            engine.report(RefreshReport.combined([*self._reports, final]))
        return written

    def _sort_transients(
        self, dirty: set[int], touched: set[Transient], what: str
    ) -> tuple[set[int], list[Transient]]:
        """Readers of completely written transient inputs run; those of partly written
        ones are marked stale (and do not run)."""
        engine = self.engine
        incomplete = []
        for tr in touched:
            readers = engine.transients.readers[id(tr)]
            if tr.complete:
                dirty.update(i for i in readers if i not in self._early)
                continue
            incomplete.append(tr)
            why = (f"its transient input {tr.input.path} was only partly written by {what} "
                   f"({tr.coverage.describe()})")
            engine.mark_stale(readers, why)
            dirty.difference_update(readers)
        return dirty, incomplete

    def _fail(self, written: Set[int], touched: set[Transient], why: str) -> None:
        """A load that raised: the derived buffers reading what it wrote are stale (what
        the model owes, and the poison of its storages, are the runtime's)."""
        engine = self.engine
        dirty = _consumers(engine, written) | self.taken
        dirty.update(i for inp in engine.watch.moved()[0] for i in inp.consumers)
        dirty.update(i for tr in touched for i in engine.transients.readers[id(tr)])
        engine.mark_stale(dirty, why)
        engine.transients.release()


def _consumers(engine: Engine, written: Set[int]) -> set[int]:
    """The derivations reading any of `written` (a load's writes may be every storage of a
    large model, its derivations' inputs a few, or the other way round: the smaller side
    is gone through, in one pass)."""
    inputs = engine.watch.by_storage()
    if len(written) <= len(inputs):
        return engine.consumers_of(written)
    return engine.consumers_of([key for key in inputs if key in written])


class _StorageFinder:
    """Key -> the model's live storage there, looked for only if asked (the journal asks
    once per storage it has not seen): among the parameters and buffers of `modules()`
    first, then, for a key not found there, in a walk of the model (once). `track` is the
    journal's bulk lookup of a first load's thousands (`Journal._track_all`)."""

    __slots__ = ("_found", "_model_tensors", "_modules", "_walked")

    def __init__(self, model_tensors: Callable[[], Iterable[torch.Tensor]],
                 modules: Callable[[], list[nn.Module]] | None = None) -> None:
        self._model_tensors = model_tensors
        self._modules = modules
        self._found: dict[int, torch.UntypedStorage] | None = None
        self._walked = modules is None

    def __call__(self, key: int) -> torch.UntypedStorage | None:
        found = self._found
        if found is None:
            found = self._found = _storages(self._model_tensors() if self._modules is None
                                            else _table_tensors(self._modules()))
        storage = found.get(key)
        if storage is None and not self._walked:
            self._walked = True
            for t in self._model_tensors():
                found.setdefault(storage_key(t), t.untyped_storage())
            storage = found.get(key)
        return storage

    def track(self, keys: Set[int], tracked: dict[int, Any], key_of: dict[int, int],
              died: Callable[[Any], object]) -> Set[int]:
        """Track the storage of each of `keys` the modules' tables hold, in one compiled
        call where the compiled checks are built (`track_storages`, as the journal's
        loop does it); returns the keys left to look up one by one."""
        native = _native.get()
        if native is None or self._modules is None or self._found is not None:
            return keys
        left = native.track_storages(self._modules(), keys, tracked, key_of, died)
        if left is None:
            return keys
        self._found = {}  # the tables hold none of the rest: a walk looks for them
        return left


def _table_tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Every tensor the modules' parameter and buffer tables hold."""
    return [t for m in modules for table in (m._parameters, m._buffers)
            for t in table.values() if isinstance(t, torch.Tensor)]


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """`{storage_key(t): t.untyped_storage()}` of `tensors`, in flat passes (maps of C
    calls: a first load asks for thousands); one by one where one cannot be read so."""
    tensors = list(tensors)
    try:
        keys = storage_keys(tensors)  # one compiled call, where built
        storages = list(map(_UNTYPED, tensors))
        if keys is None:
            keys = [ptr if size else 0 for ptr, size in
                    zip(map(_STORAGE_PTR, storages), map(_NBYTES, storages))]
    except (RuntimeError, NotImplementedError):
        return {storage_key(t): t.untyped_storage() for t in tensors}
    return dict(zip(keys, storages))


_UNTYPED = torch.Tensor.untyped_storage
_NBYTES = torch.UntypedStorage.nbytes
_STORAGE_PTR = torch.UntypedStorage.data_ptr


class LoaderClosed(Exception):
    """A generator loader was closed before it ended (its caller sees GeneratorExit)."""


def steps(load: Load, inner: Generator[Any, None, Any]) -> Generator[Any, None, Any]:
    """Iterate a generator loader as part of `load`, each step under its tracker (the
    caller's code between steps is not); returns what it returns. Closed early:
    `LoaderClosed`."""
    while True:
        with load.running():
            try:
                item = next(inner)
            except StopIteration as stop:
                return stop.value
        try:
            yield item
        except GeneratorExit:
            inner.close()
            raise LoaderClosed("the loader was closed before it ended") from None


@types.coroutine
def awaited(load: Load, coro: Coroutine[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """Drive an async loader's coroutine step by step as part of `load`, each step under
    its tracker; what it awaits is awaited outward (the event loop's other tasks run
    untracked meanwhile). Returns what it returns; raises what it raises, or what was
    thrown into it and it did not handle (a cancellation)."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        with load.running():
            try:
                future = coro.send(sent) if thrown is None else coro.throw(thrown)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield future
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # thrown in by the event loop: the loader's turn
            thrown = exc
