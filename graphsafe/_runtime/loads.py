"""The loads of one model: the lock its loads and replays take, and each load driven from
its beginning to its end.

`Loads` is the part of `Runtime` that drives loads: a loading method, a generator loader,
a `weight_update` block and `load_state_dict` each run as one tracked `Load` under the
model's lock; when one ends, the checks added with `add_load_check` run and every other
runtime reading what it wrote refreshes. The rest of the runtime (binding, pins,
freshness) builds on it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from torch import nn

from graphsafe._errors import GraphSafetyError
from graphsafe._memory.journal import Journal
from graphsafe._runtime.binder import Binder
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.load import Load, LoaderClosed
from graphsafe._runtime.state_dict import forgive_released, hold_in_state_dict

__all__ = ["Loads"]

_L = TypeVar("_L", bound="Loads")

_LIVE: weakref.WeakSet[Loads] = weakref.WeakSet()
"""Every runtime alive: a load that ended tells them what it wrote."""


class Loads:
    """The model's lock, the load in progress, and the checks run after each load.

    Args:
        journal: Where loads record their writes.
    """

    _binder: Binder

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._lock = threading.RLock()
        self._load: Load | None = None
        self._load_checks: list[Callable[[], None]] = []
        _LIVE.add(self)

    @property
    def pinned(self) -> bool:
        """Whether a graph holds the model's storage fixed."""
        raise NotImplementedError

    def _bound_engine(self) -> Engine:
        raise NotImplementedError

    @property
    def _engine(self) -> Engine | None:
        return self._binder.current

    def add_load_check(self, check: Callable[[], None]) -> None:
        """Run `check` whenever a load or update of this model ends normally, so that
        what it finds raises through the call that made the load (an engine's ledger)."""
        with self._lock:
            self._load_checks.append(check)

    def run_load(
        self,
        fn: Callable[..., Any],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a loading method (`fn(module, *args, **kwargs)`) as one tracked load, then
        refresh what it wrote. A call nested in a load of the same thread runs inside it;
        a call from another thread while a load runs (a loader's worker threads) joins it.
        """
        load = self._load
        if load is not None:
            if load.thread == threading.get_ident():
                result = fn(module, *args, **kwargs)  # nested: the outer load tracks it
                load.between_calls()
                return result
            if load.enter_worker():  # a worker thread of that load
                return load.run_worker(fn, module, args, kwargs)
        with self._lock, self._loading(_name(fn, module)) as load, load.tracker:
            return fn(module, *args, **kwargs)

    def run_generator_load(
        self,
        fn: Callable[..., Any],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Generator[Any, None, Any]:
        """A generator loader as one tracked load over its whole iteration: each step runs
        under the tracker, the caller's code between steps does not. The load ends when
        the loader is exhausted; closed early, it leaves the model failed closed."""
        what = _name(fn, module)

        def steps() -> Generator[Any, None, Any]:
            inner = fn(module, *args, **kwargs)
            with self._lock, self._loading(what) as load:
                return (yield from load.steps(inner))

        return steps()

    @contextlib.contextmanager
    def weight_update(self: _L) -> Iterator[_L]:
        """A block of writes (the bucketed RL weight sync), yielding this runtime: load
        calls inside do not refresh; every write into a model tensor inside is tracked
        (worker threads' loads join it), writes declared with `gs.mark_written` and
        in-place writes the version counters see are picked up, and when the block exits
        normally the affected derivations are refreshed once. An exception leaves the
        model failed closed until a load completes.
        """
        load = self._load
        if load is not None and load.thread == threading.get_ident():
            yield self
            return
        with self._lock, self._loading("weight_update", everything=True) as load, load.tracker:
            yield self

    @contextlib.contextmanager
    def _loading(self, what: str, *, everything: bool = False) -> Iterator[Load]:
        """One load, begun and ended under the lock the caller holds."""
        engine = self._bound_engine()
        load = self._load = Load.begin(
            engine, self._journal, pinned=self.pinned,
            everything=self._binder.model_tensors() if everything else None,
        )
        try:
            yield load
        except LoaderClosed as exc:
            self._end(load, what, GeneratorExit(str(exc)))
            raise GeneratorExit from None
        except BaseException as exc:
            self._end(load, what, exc)
            raise
        self._end(load, what, None, witnesses=everything)

    def _end(
        self, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False
    ) -> None:
        try:
            written = load.end(what, exc, pinned=self.pinned,
                               model_tensors=self._binder.tensors, witnesses=witnesses)
        finally:
            self._load = None
        if exc is None:
            _tell_others(self, written)
            for check in self._load_checks:
                check()

    # -- load_state_dict (hooks installed on the model) --------------------------------

    def _before_state_dict_load(self, module: nn.Module, state_dict: dict[str, Any],
                                prefix: str) -> None:
        if self._engine is not None and self._binder.model is module:
            hold_in_state_dict(self._engine, state_dict, prefix)

    def _after_state_dict_load(self, module: nn.Module, incompatible: Any) -> None:
        if self._engine is not None and self._binder.model is module:
            forgive_released(self._engine, incompatible)
        with self._lock:
            if self._load is not None or self._engine is None:
                return  # inside a tracked load or update: refreshed when it ends
            # Ended as any load ends; what it wrote, the witnesses (versions) and the
            # transient inputs the pre-hook gave memory to say what to refresh.
            load = Load.of_state_dict(self._bound_engine(), self._journal)
            self._end(load, "load_state_dict", None, witnesses=True)


    def _refresh_written_elsewhere(self, keys: set[int]) -> None:
        """A load through another model wrote storages this one may read (tied or shared
        parameters): refresh their readers, if this runtime is free right now (one busy
        in another thread is skipped: its witnesses still see the write)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            engine = self._engine
            if engine is None or self._load is not None or not engine.consumers_of(keys):
                return  # reads none of it (a storage it took since is seen by its witnesses)
            # Binds again if its tree changed (before pin).
            self._bound_engine().refresh_readers(self.pinned, keys)
        finally:
            self._lock.release()


def _tell_others(origin: Loads, written: set[int]) -> None:
    """A load that ended refreshes the other runtimes reading what it wrote."""
    if written:
        for rt in list(_LIVE):
            if rt is not origin and rt._engine is not None:
                with contextlib.suppress(GraphSafetyError):  # its guard reports it
                    rt._refresh_written_elsewhere(written)


def _name(fn: Callable[..., Any], module: Any) -> str:
    return f"{type(module).__name__}.{getattr(fn, '__name__', 'load')}"


