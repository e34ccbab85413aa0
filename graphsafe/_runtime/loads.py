"""The loads of one model: the lock its loads and replays take, each load driven from
its beginning to its end, and what a failed one still owes.

`Loads` is the part of `Runtime` that drives loads: a loading method (and the generator
it may return), a generator or async loader, a `weight_update` block and
`load_state_dict` each run as one tracked `Load` under the model's lock, watching every
storage of the model; when one ends, the checks added with `add_load_check` run and every
other runtime reading what it wrote refreshes. A load that fails leaves the model owing
what it may have written (`Owed`) until completed loads write it again. The rest of the
runtime (binding, pins, freshness) builds on it.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator
from typing import Any, TypeVar

from torch import nn

from graphsafe._errors import GraphSafetyError, first_line, one_line
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.binder import Binder
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.load import Load, LoaderClosed
from graphsafe._runtime.owed import Owed
from graphsafe._runtime.state_dict import StateDictLoad, forgive_released, hold_in_state_dict
from graphsafe._runtime.tracking import WriteTracker

__all__ = ["Loads"]

_L = TypeVar("_L", bound="Loads")

_LIVE: weakref.WeakSet[Loads] = weakref.WeakSet()
"""Every runtime alive: a load that ended tells them what it wrote."""


class Loads:
    """The model's lock, the load in progress, what failed loads still owe, and the
    checks run after each load.

    Args:
        journal: Where loads record their writes.
    """

    _binder: Binder

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._lock = threading.RLock()
        self._load: Load | None = None
        self._load_checks: list[Callable[[], None]] = []
        self._owed = Owed()
        self._state_dict: StateDictLoad | None = None  # a `load_state_dict` in progress
        # The errors of the last `load_state_dict` that ended with missing or unexpected
        # keys: torch adds its strict refusal there once the hooks ran, then raises.
        self._verdict: list[str] | None = None
        self._lazy = False
        # What loads left stale for the next replay (lazy refresh), and the engine whose
        # derivations those indices number.
        self._deferred: tuple[Engine | None, set[int]] = (None, set())
        _LIVE.add(self)

    @property
    def pinned(self) -> bool:
        """Whether a graph holds the model's storage fixed."""
        raise NotImplementedError

    def _bound_engine(self) -> Engine:
        raise NotImplementedError

    def _records(self) -> bool:
        """Whether the next load records provenance (the runtime decides)."""
        return False

    def _settle_lineage(self, load: Load, written: set[int]) -> None:
        """What `load` computed from the weights (the runtime's discovery takes it);
        `written`: the storage keys it wrote."""

    def _lineage_failed(self) -> None:
        """A load failed: what it rebuilt is not taken for fresh by the next one."""

    @property
    def _engine(self) -> Engine | None:
        return self._binder.current

    @property
    def lazy_refresh(self) -> bool:
        """Whether loads only mark the derived buffers they make stale, and the check
        before the next replay (a guarded graph's, an engine's step) refreshes them once.

        For loaders that come in many small calls (one per parameter, each its own load):
        each call costs its tracking only, and a derivation that reads several of the
        written tensors is computed once per sync instead of once per call. The cost: the
        buffers are stale between the sync and the next replay (`stale` lists them, and
        `assert_fresh` outside a replay refuses), the refresh runs in the replay's path,
        and a write outside any load into an input they read is refreshed with them
        rather than refused. A model with transient inputs refreshes at each load's end.
        Off by default.
        """
        return self._lazy

    @lazy_refresh.setter
    def lazy_refresh(self, value: bool) -> None:
        with self._lock:
            self._lazy = bool(value)
            if not value:
                self.refresh_deferred()

    def refresh_deferred(self) -> None:
        """Refresh what loads left stale under `lazy_refresh`, once (nothing if none, or
        if a failed load left buffers stale: the freshness check refuses those)."""
        with self._lock:
            engine, deferred = self._deferred
            if not deferred:
                return
            self._deferred = (None, set())
            current = self._engine
            if engine is not current or current is None:
                return  # bound anew since: the new binding refreshes on its own
            if any(i in current.reasons for i in current.stale):
                return
            plan = sorted(i for i in deferred if i in current.stale)
            if plan:
                current.recompute(current.closure(plan))

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
        A generator it returns is iterated as the rest of the same load, step by step; a
        coroutine it returns is run, when awaited, as a load of its own (as an async
        loader is).
        """
        what = _name(fn, module)
        load = self._load
        if load is not None:
            if load.thread == threading.get_ident():
                _check_nested(load, what, type(module))
                result = fn(module, *args, **kwargs)  # nested: the outer load tracks it
                load.between_calls()
                return result
            if load.enter_worker():  # a worker thread of that load
                return load.run_worker(fn, module, args, kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._lock)
            load = stack.enter_context(self._loading(what))
            with load.running():
                result = fn(module, *args, **kwargs)
            if isinstance(result, Generator):  # its writes are still to come
                return _rest(stack.pop_all(), load, result)
        if inspect.iscoroutine(result):  # so are its: tracked once it is awaited
            return self._awaited(what, type(module), result)
        return result

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
            load = self._load
            if load is not None and load.thread == threading.get_ident():
                _check_nested(load, what, type(module))
                return (yield from inner)  # iterated by the outer load's code: tracked
            with self._lock, self._loading(what) as load:
                return (yield from load.steps(inner))

        return steps()

    async def run_async_load(
        self,
        fn: Callable[..., Coroutine[Any, Any, Any]],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """An async loader as one tracked load over its whole run: its coroutine is
        driven step by step, under the tracker only while the loader's own code runs (not
        while the event loop runs other tasks). The load ends when it returns or raises;
        cancelled, it leaves the model failed closed."""
        return await self._awaited(_name(fn, module), type(module), fn(module, *args, **kwargs))

    async def _awaited(
        self, what: str, model_class: type, coro: Coroutine[Any, Any, Any]
    ) -> Any:
        """Run `coro` (the loader `what`'s) as one tracked load, step by step."""
        with contextlib.ExitStack() as stack:
            stack.callback(coro.close)  # one never started is closed, not left unawaited
            load = self._load
            if load is not None and load.thread == threading.get_ident():
                _check_nested(load, what, model_class)
                return await coro  # awaited by the outer load's own code: tracked
            stack.enter_context(self._lock)
            load = stack.enter_context(self._loading(what))
            return await load.awaited(coro)

    @contextlib.contextmanager
    def weight_update(self: _L, *, writes: Iterable[str] | None = None) -> Iterator[_L]:
        """A block of writes (the bucketed RL weight sync), yielding this runtime: load
        calls inside do not refresh; every write into a model tensor inside is tracked
        (worker threads' loads join it), writes declared with `gs.mark_written` and
        in-place writes the version counters see are picked up, and when the block exits
        normally the affected derivations are refreshed once. An exception leaves the
        model failed closed until completed loads have written again every tensor it may
        have written: every weight of the model, or only `writes` (dotted tensor paths)
        if given, and what it wrote besides. See `expect_writes`. Inside another load or
        update of the model, the block is part of it (and `writes` is the outer one's).
        """
        load = self._load
        if load is not None and load.thread == threading.get_ident():
            _check_nested(load, "weight_update", type(self._binder.model))
            yield self
            return
        with self._lock:
            named = None if writes is None else self._named(writes)
            with (self._loading("weight_update", witnesses=True, writes=named) as load,
                  load.running()):
                yield self

    def expect_writes(self, paths: Iterable[str] | None) -> None:
        """Name, inside a `weight_update` block, every tensor it writes from now on: if it
        fails, only these (and what it wrote besides) are owed. None: any tensor of the
        model (the default).

        Raises:
            GraphSafetyError: No update of this model runs in this thread, or a path names
                no tensor of the model.
        """
        with self._lock:
            load = self._load
            if load is None or load.thread != threading.get_ident():
                raise GraphSafetyError(
                    "expect_writes is called outside a weight update of the model",
                    module_class=type(self._binder.model).__name__,
                    expected="a call inside `with gs.weight_update(model):`",
                    got="no update of this model runs in this thread",
                    fix="call it inside the block, or name the set when it begins: "
                    "`gs.weight_update(model, writes=[...])`",
                )
            load.writes = None if paths is None else self._named(paths)

    @contextlib.contextmanager
    def _loading(
        self, what: str, *, witnesses: bool = False, writes: frozenset[str] | None = None
    ) -> Iterator[Load]:
        """One load, begun and ended under the lock the caller holds."""
        self._settle_state_dict()
        self._verdict = None
        engine = self._bound_engine()
        before = self._binder.model_map()
        load = self._load = Load.begin(
            engine, self._journal, pinned=self.pinned, everything=before.keys, writes=writes,
            weights=before.weight_keys, record=self._records(),
        )
        try:
            yield load
        except LoaderClosed as exc:
            self._end(load, what, GeneratorExit(str(exc)), before=before.by_path)
            raise GeneratorExit from None
        except BaseException as exc:
            self._end(load, what, exc, before=before.by_path)
            refused = _compile_refused(load, what, exc, type(self._binder.model))
            if refused is not None:
                raise refused from exc
            raise
        self._end(load, what, None, witnesses=witnesses, before=before.by_path)

    def _end(
        self, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False,
        before: dict[str, int] | None = None,
    ) -> None:
        """End `load` (`exc`: what it raised), then settle what the model owes; `before`:
        the storage key of each path when it began (a tensor rebound since was written)."""
        ended = False
        try:
            written = load.end(what, exc, pinned=self.pinned,
                               model_tensors=self._binder.tensors, witnesses=witnesses,
                               lazy=self._lazy)
            ended = True
            if load.deferred:
                engine, deferred = self._deferred
                if engine is not load.engine:
                    deferred = set()
                self._deferred = (load.engine, deferred | set(load.deferred))
        finally:
            self._load = None
            if exc is not None or not ended:
                self._lineage_failed()
            paths = {tr.input.path for tr in load.transients_written()}
            if before is not None and (self._owed or exc is not None):
                now = self._binder.model_map().by_path
                paths.update(p for p, key in now.items() if before.get(p, key) != key)
            if exc is None:  # every weight it wrote is whole, whatever a derivation did
                self._pay(load.rewritten(), paths)
            else:
                self._fail(load.rewritten(), load.writes, f"{what} raised {one_line(exc)}",
                           paths)
        if exc is None:
            self._settle_lineage(load, written)
            _tell_others(self, written)
            for check in self._load_checks:
                check()

    # -- what a failed load owes -------------------------------------------------------

    def _fail(
        self, written: set[int], named: frozenset[str] | None, why: str,
        written_paths: Iterable[str] = (),
    ) -> None:
        """A load or update failed (`why`: "Model.load_weights raised ..."): what it may
        have written is owed (every weight, or what it `named`, and what it wrote:
        `written` storages, `written_paths`), and the storages are poisoned for every
        other model reading them."""
        found = self._binder.model_map()
        engine = self._engine
        buffers = {storage_key(t) for b in engine.bound for t in b.buffers or ()} if (
            engine is not None) else set()
        buffers.discard(0)
        paths = dict.fromkeys(found.weights if named is None else sorted(named))
        paths.update(dict.fromkeys(found.paths_of(written)))
        paths.update(dict.fromkeys(p for p in written_paths if p in found.by_path))
        owed = [p for p in paths if found.by_path[p] not in buffers]  # derived: not weights
        self._owed.owe(owed, why)
        keys = {found.by_path[p] for p in owed} - {0}
        self._journal.poison((t for t in self._binder.tensors() if storage_key(t) in keys),
                             f"the last weight update failed ({why})")

    def _pay(self, written: set[int], written_paths: set[str]) -> None:
        """A load completed: what it wrote is no longer owed."""
        if self._owed:
            self._owed.pay(written, written_paths, self._binder.model_map().by_path)

    def _named(self, paths: Iterable[str]) -> frozenset[str]:
        """`paths`, each checked to name a tensor of the model."""
        known = self._binder.model_map().by_path
        named = frozenset(paths)
        for path in sorted(named):
            if path not in known:
                raise GraphSafetyError(
                    f"the update names {path!r}, which is not a tensor of the model",
                    module_class=type(self._binder.model).__name__,
                    path=path,
                    expected="dotted paths from the model root, e.g. 'layers.0.weight'",
                    got=repr(path),
                    fix="use names from model.named_parameters() / named_buffers()",
                )
        return named

    # -- load_state_dict (hooks installed on the model) --------------------------------

    def _before_state_dict_load(self, module: nn.Module, state_dict: dict[str, Any],
                                prefix: str, error_msgs: list[str]) -> None:
        if self._engine is not None and self._binder.model is module:
            hold_in_state_dict(self._engine, state_dict, prefix)
            if self._load is None:  # inside a load, the load's tracker sees the copies
                self._state_dict = StateDictLoad(self._binder.tensors(), error_msgs)

    def _after_state_dict_load(self, module: nn.Module, incompatible: Any) -> None:
        if self._engine is not None and self._binder.model is module:
            forgive_released(self._engine, incompatible)
        with self._lock:
            begun, self._state_dict = self._state_dict, None
            if self._load is not None or self._engine is None:
                return  # inside a tracked load or update: refreshed when it ends
            self._settle_state_dict()
            # Ended as any load ends; what it wrote, the witnesses (versions) and the
            # transient inputs the pre-hook gave memory to say what to refresh.
            written = begun.written(self._binder.tensors()) if begun is not None else set()
            load = Load.of_state_dict(self._bound_engine(), self._journal, written)
            if begun is not None and begun.errors:  # torch raises once the hooks ran
                self._end(load, "load_state_dict", RuntimeError(begun.errors[0]))
                return
            self._end(load, "load_state_dict", None, witnesses=True)
            if begun is not None and (incompatible.missing_keys or incompatible.unexpected_keys):
                self._verdict = begun.errors  # strict or not: known once torch returns

    def _settle_state_dict(self) -> None:
        """A `load_state_dict` that ended with missing or unexpected keys raised after
        its hooks (it was strict): the model failed, though what it copied was refreshed."""
        errors = self._verdict
        if errors:
            self._verdict = None
            self._fail(set(), None, f"load_state_dict raised {one_line(RuntimeError(errors[0]))}")

    def _refresh_written_elsewhere(self, keys: set[int]) -> None:
        """A load through another model wrote storages this one may read (tied or shared
        parameters): pay what this model owed there, and refresh their readers, if this
        runtime is free right now (one busy in another thread is skipped: its witnesses
        still see the write, and what it owes stays owed)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            engine = self._engine
            if engine is None or self._load is not None:
                return
            self._pay(keys, set())
            keys = keys.intersection(engine.watch.by_storage())  # one pass: reads few
            if not engine.consumers_of(keys):
                return  # reads none of it (a storage it took since is seen by its witnesses)
            # Binds again if its tree changed (before pin).
            self._bound_engine().refresh_readers(self.pinned, keys)
        finally:
            self._lock.release()


def _rest(stack: contextlib.ExitStack, load: Load, inner: Generator[Any, Any, Any]
          ) -> Generator[Any, Any, Any]:
    """The generator a loading method returned, iterated as the rest of its load
    (`stack` ends the load and releases the lock when it is exhausted or closed)."""

    def rest() -> Generator[Any, Any, Any]:
        with stack:
            try:
                yield None  # primed: the load is open from here, iterated or not
            except GeneratorExit:
                inner.close()
                raise
            return (yield from load.steps(inner))

    gen = rest()
    next(gen)
    return gen


def _check_nested(load: Load, what: str, model_class: type) -> None:
    """A load call in the thread of a load in progress runs inside it only from that
    load's own code; between the steps of a generator or async loader it is refused."""
    if load.stepping:
        return
    raise GraphSafetyError(
        f"{what} was called while another load of the model is suspended in this thread",
        module_class=model_class.__name__,
        expected="one load of a model at a time in a thread, or a load called from the "
        "running loader's own code",
        got="a generator or async loader of the same model between two of its steps "
        "(another task of the event loop, or the code iterating the generator)",
        fix="let the first load end (exhaust the generator, await the loader) before the "
        "next one, or call the second from inside the first",
    )


def _compile_refused(
    load: Load, what: str, exc: BaseException, model_class: type
) -> GraphSafetyError | None:
    """The refusal of a `torch.compile(fullgraph=True)` call inside a load tracked in
    Python, whose dispatch mode dynamo will not compile under (None: not that)."""
    text = str(exc)
    if not (isinstance(load.tracker, WriteTracker) and isinstance(exc, RuntimeError)
            and "torch.compile" in text and "fullgraph" in text):
        return None
    return GraphSafetyError(
        f"{what} called a torch.compile(fullgraph=True) function while graphsafe tracked "
        "its writes in Python",
        module_class=model_class.__name__,
        expected="a loader whose compiled functions run under the compiled write tracker",
        got=f"dynamo refused to compile under graphsafe's dispatch mode ({first_line(exc)})",
        fix="build graphsafe's compiled tracker (`graphsafe native build`; a model with "
        "transient inputs keeps the Python one), or call the compiled function outside "
        "the load and copy its result in (`gs.load_into`): dynamo does not compile a "
        "function it refused again until `torch._dynamo.reset()`. The load failed closed",
    )


def _tell_others(origin: Loads, written: set[int]) -> None:
    """A load that ended refreshes the other runtimes reading what it wrote."""
    if written:
        for rt in list(_LIVE):
            if rt is not origin and rt._engine is not None:
                with contextlib.suppress(GraphSafetyError):  # its guard reports it
                    rt._refresh_written_elsewhere(written)


def _name(fn: Callable[..., Any], module: Any) -> str:
    return f"{type(module).__name__}.{getattr(fn, '__name__', 'load')}"
