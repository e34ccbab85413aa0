"""The loads of one model: each driven from its beginning to its end under the model's
lock, and what they leave behind.

`LoadDriver` is the component of `Runtime` that drives loads: a loading method (and the
generator it may return), a generator or async loader, a `weight_update` block and
`load_state_dict` each run as one tracked `Load`, watching every storage of the model;
when one ends, the checks added with `add_load_check` run and every other model's driver
refreshes what reads what it wrote. A load that fails leaves the model owing what it may
have written (`Debts`) until completed loads write it again; under lazy refresh what
loads leave stale waits for the next replay (`Deferred`); a `load_state_dict` outside a
load is driven from its hooks (`StateDictCalls`); what a recorded load computed from the
weights goes to the model's `Discovery`.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Set
from typing import Any, Final

from torch import nn

from graphsafe._errors import GraphSafetyError, first_line
from graphsafe._lineage.discovery import Discovery, values_wanted
from graphsafe._lineage.resolve import atoms_of
from graphsafe._lineage.rewrites import rewritten_error
from graphsafe._memory.journal import Journal
from graphsafe._runtime.bind.experts import MapReads, without
from graphsafe._runtime.loads.debts import Debts, Owed
from graphsafe._runtime.loads.deferred import Deferred
from graphsafe._runtime.loads.load import Load, LoaderClosed, awaited, steps
from graphsafe._runtime.loads.state_dict import StateDictCalls, forgive_released, hook_state_dict
from graphsafe._runtime.refresh.binder import Binder
from graphsafe._runtime.refresh.engine import Engine
from graphsafe._runtime.writes.tracking import WriteTracker

__all__ = ["LoadDriver"]

_LIVE: weakref.WeakSet[LoadDriver] = weakref.WeakSet()
"""Every model's driver alive: a load that ended tells the others what it wrote."""


class LoadDriver:
    """The load in progress of one model, what failed loads still owe, what lazy refresh
    deferred, and the checks run after each load.

    Args:
        lock: The model's lock (the runtime's): loads and replays of the model take it.
        journal: Where loads record their writes.
        binder: The model's binder: its tree, its storages, the engine bound now.
        pinned: Whether a graph holds the model's storage fixed now.
        discovery: What the model's recorded loads computed from its weights.
    """

    __slots__ = ("__weakref__", "_binder", "_debts", "_deferred", "_discovery", "_journal",
                 "_load", "_load_checks", "_lock", "_pinned", "_state_dicts")

    def __init__(
        self, lock: threading.RLock, journal: Journal, binder: Binder, *,
        pinned: Callable[[], bool], discovery: Discovery,
    ) -> None:
        self._lock: Final = lock
        self._journal: Final = journal
        self._binder: Final = binder
        self._pinned: Final = pinned
        self._discovery: Final = discovery
        self._load: Load | None = None
        self._load_checks: Final[list[Callable[[], None]]] = []
        self._debts: Final = Debts(journal)
        # The `load_state_dict` in progress, its verdict.
        self._state_dicts: Final = StateDictCalls()
        self._deferred: Final = Deferred()  # what loads left stale for the next replay (lazy)
        _LIVE.add(self)

    @property
    def current(self) -> Load | None:
        """The load in progress, if any."""
        return self._load

    @property
    def owed(self) -> Owed:
        """What failed loads still owe (read it; loads pay it)."""
        return self._debts.owed

    @property
    def _engine(self) -> Engine | None:
        return self._binder.current

    def _bound_engine(self) -> Engine:
        return self._binder.engine(self._pinned())

    @property
    def lazy_refresh(self) -> bool:
        """Whether loads only mark what they make stale, for the next replay's check to
        refresh once (see `Runtime.lazy_refresh`)."""
        return self._deferred.lazy

    def set_lazy_refresh(self, value: bool) -> None:
        """Turn lazy refresh on or off (off: what was deferred is refreshed now)."""
        with self._lock:
            self._deferred.set_lazy(value)
            if not value:
                self.refresh_deferred()

    def refresh_deferred(self) -> None:
        """Refresh what loads left stale under `lazy_refresh`, once (nothing if none, or
        if a failed load left buffers stale: the freshness check refuses those)."""
        with self._lock:
            self._deferred.refresh(self._engine)

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
        if load is not None and _nested(load, what, type(module)):
            result = fn(module, *args, **kwargs)  # nested: the outer load tracks it
            load.between_calls()
            return result
        if load is not None and load.enter_worker():  # a worker thread of that load
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

        def iterate() -> Generator[Any, None, Any]:
            inner = fn(module, *args, **kwargs)
            if _nested(self._load, what, type(module)):
                return (yield from inner)  # iterated by the outer load's code: tracked
            with self._lock, self._loading(what) as load:
                return (yield from steps(load, inner))

        return iterate()

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
            if _nested(self._load, what, model_class):
                return await coro  # awaited by the outer load's own code: tracked
            stack.enter_context(self._lock)
            load = stack.enter_context(self._loading(what))
            return await awaited(load, coro)

    @contextlib.contextmanager
    def weight_update(self, *, writes: Iterable[str] | None = None) -> Iterator[None]:
        """A block of writes as one load (see `Runtime.weight_update`): refreshed once
        when it exits normally, failed closed when it raises; part of the load or update
        of the model in progress in this thread, if any."""
        if _nested(self._load, "weight_update", type(self._binder.model)):
            yield
            return
        with self._lock:
            named = None if writes is None else _named(self._binder, writes)
            with (self._loading("weight_update", witnesses=True, writes=named) as load,
                  load.running()):
                yield

    def expect_writes(self, paths: Iterable[str] | None) -> None:
        """Name what the update in progress in this thread writes from now on (see
        `Runtime.expect_writes`)."""
        with self._lock:
            load = self._load
            if load is None or load.thread != threading.get_ident():
                raise _outside_update(type(self._binder.model))
            load.expect_writes(None if paths is None else _named(self._binder, paths))

    @contextlib.contextmanager
    def _loading(
        self, what: str, *, witnesses: bool = False, writes: frozenset[str] | None = None
    ) -> Iterator[Load]:
        """One load, begun and ended under the lock the caller holds."""
        self.settle_state_dict()
        # A later load ends the bring-up: forwards after it are no warm-up.
        self._discovery.close_window(self._binder.model, self._binder.walked)
        engine, before = self._binder.bound(self._pinned())
        outside = self._discovery.outside_keys()  # caches the graphs read, no model holds
        untied = self._binder.ties.broken(self._binder.model)  # ties a load must not break
        sequenced, follow = self._discovery.sequenced_keys(self._binder.model), None
        experts = self._binder.experts
        experts.find(self._binder.model, before.key_set, before.by_path)
        moved = frozenset[int]()
        if experts:  # the ops writing expert weights, what is taken from their maps
            sequenced, follow = sequenced | experts.weight_keys(), experts.follow(
                before.weight_keys)
            moved = experts.moved_maps()
        load = self._load = Load.begin(
            engine, self._journal, pinned=self._pinned(),
            everything=before.key_set.union(outside) if outside else before.key_set,
            writes=writes, weights=before.weight_keys, record=self._discovery.wants_record(),
            sequenced=sequenced, walked=before.rows, follow=follow,
        )
        if moved:  # the numbers it reads out of them in Python, too
            load.map_reads = MapReads(moved)
        if load.record:  # where the model keeps bools and small ints, read when needed
            load.lineage.note_places(atoms_of(self._binder.model))
            load.lineage.foreign = self._discovery.foreign_keys(
                self._binder.model, before.table_keys, load.lineage)
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
        self._end(load, what, None, witnesses=witnesses, before=before.by_path,
                  untied=untied)

    def _end(
        self, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False,
        before: dict[str, int] | None = None, untied: frozenset[tuple[str, ...]] = frozenset(),
    ) -> None:
        """End `load` (`exc`: what it raised), then settle what the model owes; `before`:
        the storage key of each path when it began (a tensor rebound since was written),
        `untied`: the ties broken then.

        A recorded load's end walks the model once, after its refresh (whose first
        materializations walk it only if a derivation reads what it did not make or
        declare): that walk serves what the recording found and the values it keeps,
        and is kept as the map the next load checks (`Binder.walked`)."""
        ended = False
        try:
            written = load.end(what, exc, pinned=self._pinned(),
                               model_tensors=self._binder.tensors,
                               modules=self._binder.modules, witnesses=witnesses,
                               lazy=self._deferred.lazy)
            ended = True
            self._deferred.take(load)
        finally:
            self._load = None
            if exc is not None or not ended:
                self._discovery.failed()  # what it rebuilt is not taken for fresh
            self._debts.settle(self._binder, load, what, exc, before)
        if exc is None:
            experts = self._binder.experts
            maps = experts.map_keys() if experts else frozenset()
            # What it computed from the weights (and, followed apart, from expert maps).
            tainted, taken = without(maps, load.tracker.tainted(), load.tracker.taken())
            broken = self._discovery.judge_rewrites(self._binder.model, written,
                                                    load.write_ops(), before, tainted)
            if load.record:  # what it made; its forwards until the capture are recorded on
                wanted = values_wanted(load.lineage)
                self._discovery.take(load.lineage, self._binder.model,
                                     lambda: self._binder.walked(wanted),
                                     bring_up=load.weights)
            else:
                self._discovery.after_load(self._binder.model, written, tainted,
                                           self._binder.walked, taken)
            _tell_others(self, written)
            for check in self._load_checks:
                check()
            tie = None if before is None else self._binder.ties.judge(
                self._binder.model, untied, written, before, what)
            layout = None if not experts else experts.judge(
                written, load.write_ops(), load.tracker.tainted(),
                (t.sources for t in load.tracker.taken()),
                self._engine.watch.by_storage() if self._engine is not None else (),
                what, type(self._binder.model).__name__,
                read=load.map_reads.read if load.map_reads is not None else ())
            if broken:  # the weights stay refused until a load writes them whole again
                raise rewritten_error(broken)
            if tie is not None:  # refused until a load writes every side, or re-tied
                raise tie
            if layout is not None:  # until a load writes through the map
                raise layout

    # -- load_state_dict (hooks installed on the model) --------------------------------

    def hook_state_dict(self, model: nn.Module, engine: Engine) -> None:
        """Install on `model` (bound anew, to `engine`) the hooks through which its
        `load_state_dict` calls are driven as loads (held weakly)."""
        hook_state_dict(model, engine, weakref.WeakMethod(self._before_state_dict_load),
                        weakref.WeakMethod(self._after_state_dict_load))

    def _before_state_dict_load(self, module: nn.Module, state_dict: dict[str, Any],
                                prefix: str, error_msgs: list[str]) -> None:
        if self._engine is not None and self._binder.model is module:
            with self._lock:
                self._state_dicts.begin(
                    self._engine, self._binder.tensors, state_dict, prefix, error_msgs,
                    None if self._load is not None else self._state_dict_begins)

    def _state_dict_begins(self) -> tuple[dict[str, int], frozenset[tuple[str, ...]]]:
        """What a `load_state_dict` outside any load is judged against when it ends: the
        storage key at each path, and the ties broken, now (and the expert layouts
        found, as a load's beginning finds them)."""
        found = self._binder.model_map()
        self._binder.experts.find(self._binder.model, found.key_set, found.by_path)
        return found.by_path, self._binder.ties.broken(self._binder.model)

    def _after_state_dict_load(self, module: nn.Module, incompatible: Any) -> None:
        if self._engine is not None and self._binder.model is module:
            forgive_released(self._engine, incompatible)
        with self._lock:
            if self._load is not None or self._engine is None:
                self._state_dicts.drop()  # inside a tracked load or update: refreshed when it ends
                return
            self.settle_state_dict()
            # Ended as any load ends; what it wrote, the witnesses (versions) and the
            # transient inputs the pre-hook gave memory to say what to refresh.
            begun, written, raised = self._state_dicts.end(self._binder.tensors)
            load = Load.of_state_dict(self._bound_engine(), self._journal, written)
            self._end(load, "load_state_dict", raised, witnesses=raised is None,
                      before=None if begun is None else begun.paths,
                      untied=frozenset() if begun is None else begun.untied)
            if raised is None:  # else torch raises once the hooks ran
                self._state_dicts.ended(begun, incompatible)

    def settle_state_dict(self) -> None:
        """A `load_state_dict` that ended with missing or unexpected keys raised after
        its hooks (it was strict): the model failed, though what it copied was refreshed."""
        why = self._state_dicts.settle()
        if why is not None:
            self._debts.fail(self._binder, set(), None, why)

    def refresh_written_elsewhere(self, keys: Set[int]) -> None:
        """A load through another model wrote storages this one may read (tied or shared
        parameters): pay what this model owed there, and refresh their readers, if this
        runtime is free right now (one busy in another thread is skipped: its witnesses
        still see the write, and what it owes stays owed)."""
        self._discovery.written_elsewhere(keys)  # weights it rewrote in place: raw now
        if not self._lock.acquire(blocking=False):
            return
        try:
            engine = self._engine
            if engine is None or self._load is not None:
                return
            self._debts.pay(self._binder, keys, set())
            reads = engine.watch.by_storage()  # one pass over the smaller: reads few
            keys = {k for k in keys if k in reads} if len(keys) <= len(reads) else {
                k for k in reads if k in keys}
            if not engine.consumers_of(keys):
                return  # reads none of it (a storage it took since is seen by its witnesses)
            # Binds again if its tree changed (before pin).
            self._bound_engine().refresh_readers(self._pinned(), keys)
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
            return (yield from steps(load, inner))

    gen = rest()
    next(gen)
    return gen


def _nested(load: Load | None, what: str, model_class: type) -> bool:
    """Whether the load call `what` runs inside `load` (the one in progress): in its
    thread, it does, from that load's own code; between the steps of a generator or async
    loader it is refused."""
    if load is None or load.thread != threading.get_ident():
        return False
    if load.stepping:
        return True
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


def _outside_update(model_class: type) -> GraphSafetyError:
    """`expect_writes` called where no update of the model runs in the thread."""
    return GraphSafetyError(
        "expect_writes is called outside a weight update of the model",
        module_class=model_class.__name__,
        expected="a call inside `with gs.weight_update(model):`",
        got="no update of this model runs in this thread",
        fix="call it inside the block, or name the set when it begins: "
        "`gs.weight_update(model, writes=[...])`",
    )


def _named(binder: Binder, paths: Iterable[str]) -> frozenset[str]:
    """`paths`, each checked to name a tensor of `binder`'s model."""
    known = binder.model_map().by_path
    named = frozenset(paths)
    for path in sorted(named):
        if path not in known:
            raise GraphSafetyError(
                f"the update names {path!r}, which is not a tensor of the model",
                module_class=type(binder.model).__name__,
                path=path,
                expected="dotted paths from the model root, e.g. 'layers.0.weight'",
                got=repr(path),
                fix="use names from model.named_parameters() / named_buffers()",
            )
    return named


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


def _tell_others(origin: LoadDriver, written: Set[int]) -> None:
    """A load that ended refreshes, in the other models, what reads what it wrote."""
    if written:
        for other in list(_LIVE):
            if other is not origin:
                with contextlib.suppress(GraphSafetyError):  # its guard reports it
                    other.refresh_written_elsewhere(written)


def _name(fn: Callable[..., Any], module: Any) -> str:
    return f"{type(module).__name__}.{getattr(fn, '__name__', 'load')}"
