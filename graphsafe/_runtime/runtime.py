"""The runtime: the lifecycle of one model's derived buffers.

One `Runtime` per model instance (`gs.runtime(model)`; `gs.Runtime(model)` returns the
same one). It decides *when* derived buffers follow the weights: it holds the model's
lock and the pins graphs take, and answers the guard. It is made of components, each
handed what it needs: binding is its `Binder`'s, loads its `LoadDriver`'s, what the
model's loads derived undeclared its `Discovery`'s, and what to recompute, and the
recomputing, the engine's.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Sequence
from typing import Any, Final

import torch
from torch import nn

from graphsafe._declare.forgotten import ATTACHED
from graphsafe._declare.registry import Registry
from graphsafe._declare.spec import DerivationInfo, RefreshReport
from graphsafe._errors import GraphSafetyError, RegistrationError
from graphsafe._lineage.discovery import AuditItem, Discovered, Discovery
from graphsafe._lineage.record.recorder import Lineage
from graphsafe._lineage.resolve import Foreign, foreign_of
from graphsafe._memory.journal import JOURNAL
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.freshness import (
    check_fresh,
    in_update_error,
    unmaterialized_error,
)
from graphsafe._runtime.frozen import refuse_frozen
from graphsafe._runtime.loads.driver import LoadDriver
from graphsafe._runtime.refresh.binder import Binder, tensor_at
from graphsafe._runtime.refresh.engine import Engine
from graphsafe._runtime.writes.observer import OBSERVER

__all__ = ["Runtime", "runtime", "weight_update"]

_MANUAL = "manual"
_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
"""Model -> the runtime made for it."""
_OWNERS: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
"""Module of a bound tree -> the runtime that bound it (last), for a submodule's loads."""
_CREATE = threading.Lock()


class _OnePerModel(type):
    """`Runtime(model)` gives the model's one runtime: a second would refresh it too."""

    def __call__(
        cls, model: nn.Module, registry: Registry | None = None, *, strict: bool | None = None
    ) -> Any:
        with _CREATE:
            rt = _RUNTIMES.get(model) or _OWNERS.get(model)
            if rt is not None and not rt._binder.alive:
                # A submodule kept after the model that bound it was dropped: the dead
                # model's runtime is forgotten, and the submodule gets one of its own.
                del _OWNERS[model]
                rt = None
            if rt is None:
                rt = super().__call__(model, registry, strict=bool(strict))
                _RUNTIMES[model] = rt
                return rt
        conflict = []
        if registry is not None and not rt._binder.consults(registry):
            conflict.append("a registry it does not consult")
        if strict is not None and strict != rt.strict:
            conflict.append(f"strict={strict} (it has strict={rt.strict})")
        if conflict:
            raise runtime_conflict_error(type(model), conflict)
        return rt


class Runtime(metaclass=_OnePerModel):
    """Derived buffers of one model instance, kept correct across weight loads.

    Get it with `gs.runtime(model, registry, strict=...)`; `gs.Runtime(model)` returns the
    same object, or raises `GraphSafetyError` when that runtime does not consult `registry`
    or has another `strict`. A `gs.graphsafe` class's loading method uses it unasked.

    Examples:
        >>> import torch, graphsafe as gs
        >>> from torch import nn
        >>> reg = gs.Registry()
        >>> @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
        ... def weight_t(m, w, *, out=None):
        ...     return torch.transpose(w, 0, 1).contiguous() if out is None else out.copy_(w.t())
        >>> lin = nn.Linear(3, 2)
        >>> rt = gs.runtime(lin, reg)
        >>> _ = rt.refresh()
        >>> torch.equal(lin.weight_t, lin.weight.t()), gs.Runtime(lin) is rt
        (True, True)
    """

    def __init__(
        self, model: nn.Module, registry: Registry | None = None, *, strict: bool = False
    ) -> None:
        self._lock: Final = threading.RLock()  # the model's: its loads and replays take it
        self._binder: Final = Binder(model, registry, strict=strict, journal=JOURNAL, own=self._own,
                              on_bind=self._on_bind)
        self._holders: Final[dict[object, int]] = {}
        # The holders among them whose graphs read no address (an engine that captures no
        # graphs): moved tensors are followed for them, not refused.
        self._followers: Final[set[object]] = set()
        self._capturing = 0  # graphs capturing now (the bring-up ends when they end)
        # Every model storage while pinned: poison on any refuses the graphs' replays.
        self._pinned_keys: frozenset[int] = frozenset()
        self._discovery: Final = Discovery(JOURNAL, others=_others_weights,
                                           declared=self._declared_paths)
        self._loads: Final = LoadDriver(self._lock, JOURNAL, self._binder,
                                 pinned=lambda: self.holds_addresses,
                                 discovery=self._discovery)
        self._watched = -1  # the discovery's generation the observer last watched
        self._loads.add_load_check(self._watch_sources)

    # -- binding ---------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The root module (raises if it was garbage-collected)."""
        return self._binder.model

    @property
    def registries(self) -> list[Registry]:
        """The registries consulted, besides those the model's classes name."""
        return self._binder.registries

    @property
    def strict(self) -> bool:
        """Whether every refresh checks purity, not only materialization."""
        return self._binder.strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._binder.set_strict(value)

    def _bound_engine(self) -> Engine:
        return self._binder.engine(self.holds_addresses)

    def _on_bind(self, model: nn.Module, engine: Engine) -> None:
        self._loads.hook_state_dict(model, engine)

    @contextlib.contextmanager
    def holding(self) -> Iterator[Engine]:
        """Hold the model still (its lock: loads wait) and give the bound engine, for a
        reader of every derivation (the content audit)."""
        with self._lock:
            yield self._bound_engine()

    def _own(self, module: nn.Module) -> None:
        _OWNERS[module] = self

    def add_registry(self, registry: Registry) -> None:
        """Also bind the derivations of `registry` (rebinding if already bound); refused
        with `RegistrationError` once a graph holds addresses (new buffers no captured graph
        knows)."""
        with self._lock:
            if self._binder.consults(registry):
                return
            if self.holds_addresses:
                raise pinned_registry_error(type(self.model))
            self._binder.add(registry)

    # -- what the user reads -----------------------------------------------------------

    def _declared_paths(self) -> list[str]:
        """The output paths of the derivations bound now (none before the first bind)."""
        engine = self._binder.current
        return [] if engine is None else [p for b in engine.bound for p in b.out_paths]

    @property
    def derivations(self) -> tuple[DerivationInfo, ...]:
        """The bound derivations with their paths, inputs, shapes, dtypes and bytes."""
        with self._lock:
            return tuple(b.info() for b in self._bound_engine().bound)

    @property
    def discovered(self) -> tuple[Discovered, ...]:
        """What the model's observed loads computed from its weights without a
        declaration (packed, transposed, absorbed copies; kernel handles), where each is
        held, from which weights, how, and whether it is stale or exempted."""
        with self._lock:
            self._discovery.rehome(self.model)  # a module replaced since: its weights moved
            return self._discovery.info()

    def exempt(self, path: str, *, why: str) -> None:
        """Never check the discovered tensor at `path` (one meant to differ from its
        sources, such as a copy deliberately frozen); `why` is listed with it.

        Raises:
            GraphSafetyError: `path` is not a discovered tensor, or `why` is empty.
        """
        with self._lock:
            self._discovery.exempt(path, why, type(self.model))

    def untie(self, *paths: str) -> None:
        """Forget the ties at `paths` (weights at several paths over one memory when the
        model was bound, such as an LM head tied to its embedding): for a model meant to
        be untied, whose loads bind or write each side apart. A load that breaks any
        other tie stays refused.

        Raises:
            GraphSafetyError: A path is in no tie recorded at bind.
        """
        with self._lock:
            for path in paths:
                self._binder.ties.untie(path, type(self.model).__name__)

    def expert_layout(
        self,
        path: str,
        *,
        physical_to_logical: str | Callable[[], torch.Tensor],
        weights: Sequence[str] | None = None,
        experts: int | None = None,
    ) -> None:
        """Declare that the module at `path` holds stacked expert weights whose physical
        slots a balancer maps to logical experts, for an engine that keeps the map under
        a name graphsafe does not know (`physical_to_logical_map`,
        `logical_to_physical_map` are found). A load that writes the weights with loaded
        values in checkpoint order while the map moved experts is then refused.

        Args:
            path: The module's dotted path (`"layers.3.mlp.experts"`).
            physical_to_logical: The logical expert of each physical slot: an attribute
                path under the module (`"dispatch.p2l"`), or a callable returning the
                tensor (a map kept outside the model), read as each load begins and ends.
            weights: The names of the stacked weights under the module (None: each
                parameter whose first dimension is the number of slots; empty: none, for
                weights kept in logical order beside a map of the names graphsafe finds).
            experts: The number of logical experts (None: the map's largest plus one).

        Raises:
            GraphSafetyError: No module at `path`, no 1-D integer map, or a named weight
                the module does not hold.

        Examples:
            >>> import graphsafe as gs
            >>> model = nn.Module()
            >>> model.moe = nn.Module()
            >>> model.moe.w = nn.Parameter(torch.zeros(3, 2))  # [slots, ...]
            >>> model.moe.slot_expert = torch.tensor([2, 0, 1])
            >>> gs.runtime(model).expert_layout("moe", physical_to_logical="slot_expert")
        """
        with self._lock:
            self._binder.experts.declare(self.model, path, physical_to_logical, weights,
                                         experts)

    def adopt(self, *paths: str) -> tuple[Discovered, ...]:
        """Refresh the discovered tensors at `paths` (all if none) in place when they are
        stale and a replay repairs (`on_stale="refresh"`), like declared derivations.

        Only a chain that is a pure function of its sources is adopted: it is run twice
        now, and both results must equal what the model holds, bitwise. A handle (a value
        that left torch) is refused. Returns the entries asked for, each with `adopted`
        and, if refused, why (`refused`)."""
        with self._lock:
            self._discovery.adopt(paths or None)
            infos = self._discovery.info()
            return tuple(d for d in infos if not paths or d.path in paths)

    def adopt_lineage(self, lineage: Lineage) -> None:
        """Take what an engine's first load recorded before the model was known
        (`gs.record_lineage()`): the tensors it computed from the model's
        weights are discovered now, and checked from now on."""
        with self._lock:
            self._discovery.take(lineage, self.model, self._binder.walked,
                                 bring_up=self._binder.model_map().weight_keys)

    def audit_items(self) -> list[AuditItem]:
        """The discovered tensors the content audit recomputes (not exempted)."""
        with self._lock:
            return self._discovery.audit_items()

    @property
    def last_report(self) -> RefreshReport | None:
        """The report of the last refresh, including those run by loads."""
        engine = self._binder.current
        return engine.last_report if engine is not None else None

    @property
    def pinned(self) -> bool:
        """Whether any graph (or a manual `pin()`) holds the model pinned."""
        return bool(self._holders)

    @property
    def holds_addresses(self) -> bool:
        """Whether a holder of the pin reads the model's memory by address (a captured
        graph, a manual `pin()`): then a rebound tensor is refused, not followed."""
        return any(h not in self._followers for h in self._holders)

    @property
    def stale(self) -> tuple[str, ...]:
        """Paths of derived buffers that do not match their inputs (never materialized,
        failed, or whose input was rebound or written since the last refresh), then of
        what the model derived undeclared that is stale (`discovered`), not exempted."""
        with self._lock:
            engine = self._bound_engine()
            load = self._loads.current
            in_update = load.written_so_far() if load is not None else set()
            stale = engine.stale_reasons(in_update)
            found = (() if not self._discovery else
                     tuple(d.path for d in self._discovery.info() if d.stale and not d.exempt))
            return (*(p for i in sorted(stale) for p in engine.bound[i].out_paths), *found)

    @property
    def materialized(self) -> bool:
        """Whether every owned derived buffer has been allocated."""
        with self._lock:
            return all(b.buffers is not None for b in self._bound_engine().bound)

    def assert_fresh(
        self, *, repair: bool = False, reads: frozenset[int] | None = None
    ) -> None:
        """Raise unless every derived buffer matches its inputs and the last update held,
        and no tensor the model derived without a declaration (`discovered`) is stale.

        Args:
            repair: Refresh stale buffers in place instead of raising for them (and the
                discovered tensors `adopt`ed). A failed or unfinished update is never
                repaired.
            reads: Storage keys a graph reads: discovered tensors outside it are not
                checked (None: all are).

        Raises:
            StaleError: Naming the stale buffers and how their inputs were written, or
                the failed or unfinished weight update.
            StorageMovedError: A discovered number or handle a graph holds changed since
                its capture (checked before anything is repaired).
        """
        with self._lock:
            self._check_values()  # what a graph holds changed: refused before any repair
            self._assert_fresh(repair, reads)

    def _assert_fresh(self, repair: bool, reads: frozenset[int] | None) -> None:
        """`assert_fresh` once the numbers and handles a graph holds are checked (the
        caller holds the lock)."""
        load = self._loads.current
        if load is not None and load.written_so_far():
            raise in_update_error(type(self.model), len(load.written_so_far()))
        # Module swaps: the ledger checks them.
        engine = self._binder.current or self._bound_engine()
        self._loads.settle_state_dict()  # a load_state_dict that raised after its hooks
        # The witnesses of every input and buffer in one flat comparison, what a failed
        # update still owes, then the journal's poisoned storages.
        owed = self._loads.owed
        if (engine.stale or not engine.witnesses.unchanged() or owed
                or engine.reads_poisoned(self._pinned_keys)):
            keys = engine.watch.storage_keys() | self._pinned_keys
            check_fresh(engine, keys, type(self.model), repair=repair, owed=owed)
        tie = self._binder.tie_error()
        if tie is not None:  # a load broke a tie, or wrote one side of a broken one
            raise tie
        layout = self._binder.expert_error()
        if layout is not None:  # a load wrote expert slots in checkpoint order
            raise layout
        if self._discovery:
            if not self._holders:  # pinned, the ledger sees a replaced module
                self._discovery.rehome(self.model)
            self._discovery.check(type(self.model), reads, repair=repair)

    def replaying(
        self, check: Callable[[], None], *, repair: bool, reads: frozenset[int] | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Hold the model still for one replay: `check()` (a graph's ledger) and the
        numbers and handles the graph holds, then what loads left stale under
        `lazy_refresh` refreshed once, then `assert_fresh(repair=repair, reads=reads)`,
        under the lock that loads of the model take. What moves refuses before anything
        is refreshed."""
        return _Replaying(self, check, repair, reads)

    def _checked_for_replay(
        self, check: Callable[[], None], repair: bool, reads: frozenset[int] | None
    ) -> None:
        """`replaying`'s checks, in its order (the caller holds the lock)."""
        check()
        self._check_values()
        self._loads.refresh_deferred()
        self._assert_fresh(repair, reads)

    def _check_values(self) -> None:
        """Refuse (`StorageMovedError`) a discovered number or handle a graph holds that
        changed since its capture."""
        if self._discovery:
            self._discovery.check_values(type(self.model))

    # -- loads (the `LoadDriver`'s) ------------------------------------------------------

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
        return self._loads.lazy_refresh

    @lazy_refresh.setter
    def lazy_refresh(self, value: bool) -> None:
        self._loads.set_lazy_refresh(value)

    def refresh_deferred(self) -> None:
        """Refresh what loads left stale under `lazy_refresh`, once (nothing if none, or
        if a failed load left buffers stale: the freshness check refuses those)."""
        self._loads.refresh_deferred()

    def add_load_check(self, check: Callable[[], None]) -> None:
        """Run `check` whenever a load or update of this model ends normally, so that
        what it finds raises through the call that made the load (an engine's ledger)."""
        self._loads.add_load_check(check)

    def run_load(
        self, fn: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a loading method (`fn(module, *args, **kwargs)`) as one tracked load, then
        refresh what it wrote (see `LoadDriver.run_load`)."""
        return self._loads.run_load(fn, module, args, kwargs)

    def run_generator_load(
        self, fn: Callable[..., Any], module: nn.Module, args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Generator[Any, None, Any]:
        """A generator loader as one tracked load over its whole iteration (see
        `LoadDriver.run_generator_load`)."""
        return self._loads.run_generator_load(fn, module, args, kwargs)

    async def run_async_load(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], module: nn.Module,
        args: tuple[Any, ...], kwargs: dict[str, Any],
    ) -> Any:
        """An async loader as one tracked load over its whole run (see
        `LoadDriver.run_async_load`)."""
        return await self._loads.run_async_load(fn, module, args, kwargs)

    @contextlib.contextmanager
    def weight_update(self, *, writes: Iterable[str] | None = None) -> Iterator[Runtime]:
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
        with self._loads.weight_update(writes=writes):
            yield self

    def expect_writes(self, paths: Iterable[str] | None) -> None:
        """Name, inside a `weight_update` block, every tensor it writes from now on: if it
        fails, only these (and what it wrote besides) are owed. None: any tensor of the
        model (the default).

        Raises:
            GraphSafetyError: No update of this model runs in this thread, or a path names
                no tensor of the model.
        """
        self._loads.expect_writes(paths)

    # -- refresh ---------------------------------------------------------------------

    def refresh(self, changed: Iterable[str] | None = None) -> RefreshReport:
        """Recompute derived buffers in place; return what was done, per derivation.

        Args:
            changed: Dotted paths (from the model root) of tensors that changed; only the
                derivations reading their storage (under any name: tied weights share
                one), and those downstream, are recomputed. None: all of them.

        Raises:
            DerivationDriftError: A result does not fit its buffer (nothing written).
            StorageMovedError: After `pin()`, an input or buffer was rebound.
            ImpureDerivationError: A derivation wrote into a model tensor.
            GraphSafetyError: `changed` names no tensor of the model.
        """
        with self._lock:
            engine = self._bound_engine()
            if changed is None:
                return engine.refresh(self.holds_addresses)
            paths = list(changed)
            keys = [storage_key(tensor_at(self.model, path)) for path in paths]
            return engine.refresh(self.holds_addresses, keys, paths=paths)

    def refresh_stale(self) -> RefreshReport:
        """Recompute exactly what is stale: never materialized, failed, or whose inputs
        were written (by any path the witnesses see) since their last refresh."""
        with self._lock:
            return self._bound_engine().refresh(self.holds_addresses, ())

    # -- pins --------------------------------------------------------------------------

    def check_pinnable(self) -> None:
        """Raise `StaleError` unless the derived buffers exist (a graph can be captured)."""
        with self._lock:
            missing = [b.path for b in self._bound_engine().bound if b.buffers is None]
            if missing:
                raise unmaterialized_error(type(self.model), missing)

    def pin(self, holder: object = _MANUAL, *, addresses: bool = True) -> None:
        """Declare storage addresses fixed from now on, as a captured graph requires.

        Derivations whose inputs moved since the last refresh (e.g. after `.to()`) are
        refreshed first. While any holder keeps its pin, rebinding an input, a derived buffer
        or a submodule raises `StorageMovedError` at the next load, refresh or guarded replay.
        A graph pins with itself as `holder`; `pin()` is the manual pin `unpin()` releases.
        While pinned, writes into what the derivations read or write, outside any tracked
        load and in any thread, are seen (`gs.observe_writes`; the compiled build).
        Raises `StaleError` if the derived buffers were never materialized, and
        `FrozenWeightsError` if compiled code froze weights of the model into constants.

        `addresses=False`: the holder reads no address (an engine that captures no graphs
        and runs the model's code at each step): writes are still seen and stale state
        refused, but a rebound input or buffer is taken as before a pin (its derivations
        are stale until refreshed), and the scalars and handles the model derived are not
        held at their value.
        """
        with self._lock:
            self.check_pinnable()
            refuse_frozen(self.model)  # compiled code no load reaches
            if not self._holders:
                self._bound_engine().refresh_readers(False, ())
            self._discovery.rehome(self.model)  # a module replaced before the capture
            if not self._capturing:  # an engine pins once its own graphs are captured
                self._discovery.close_window(self.model, self._binder.walked)
            if addresses:
                self._discovery.pin()  # the numbers and handles a graph holds from now on
            elif holder not in self._holders:
                self._followers.add(holder)
            self._holders[holder] = self._holders.get(holder, 0) + 1
            self._pinned_keys = frozenset(self._binder.model_tensors())
            # A write declared through another storage object of their memory finds them.
            JOURNAL.know(t.untyped_storage() for t in self._binder.tensors())
            # Writes into what the derivations read or write, outside any tracked load and
            # in any thread, are seen from now on (`_runtime.writes.observer`).
            self._watched = -1
            self._watch_sources()

    def _watch_sources(self) -> None:
        """While pinned: the observer watches what the derivations read or write and the
        sources of every discovered entry, those found since the pin too (a cache the
        capture read, state the bring-up's forwards made, what a later load made)."""
        with self._lock:
            generation = self._discovery.generation
            if not self._holders or generation == self._watched:
                return
            OBSERVER.watch(self, self._bound_engine().watch.storage_keys()
                           | self._discovery.source_keys(), self._binder.tensors)
            self._watched = generation

    def take_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """A capture read `tensors`, which the model does not hold: those its bring-up
        computed from the weights are guarded (`Discovery.take_inputs`)."""
        with self._lock:
            self._discovery.take_inputs(self.model, tensors)
            self._watch_sources()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """A graph of the model captures inside the block (it pins at its start): the
        bring-up's recording of forwards ends when the block does, the capture's own
        forward included (what it writes again is recomputed by every replay)."""
        with self._lock:
            self._capturing += 1
        try:
            yield
        finally:
            with self._lock:
                self._capturing -= 1
                if not self._capturing:
                    self._discovery.close_window(self.model, self._binder.walked)
                    self._watch_sources()

    def unpin(self, holder: object = _MANUAL) -> None:
        """Release `holder`'s pin (graphs captured under it must be re-captured)."""
        with self._lock:
            count = self._holders.get(holder, 0)
            if count <= 1:
                self._holders.pop(holder, None)
                self._followers.discard(holder)
            else:
                self._holders[holder] = count - 1
            if not self.holds_addresses:
                self._discovery.unpin()
            if not self._holders:
                self._pinned_keys = frozenset()
                OBSERVER.unwatch(self)


def runtime(
    model: nn.Module, registry: Registry | None = None, *, strict: bool | None = None
) -> Runtime:
    """The runtime of `model`, created on first use (one per model instance).

    Args:
        model: The root module.
        registry: Where derivations are declared; `gs.default_registry` by default.
        strict: If given, sets whether every refresh checks purity.

    Returns:
        The model's runtime; a submodule of a model that has one gets that one.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)  # the runtime holds the model weakly: keep it
        >>> runtime(model).stale
        ()
    """
    rt: Runtime = Runtime(model)
    if registry is not None:
        rt.add_registry(registry)
    if strict is not None:
        rt.strict = strict
    return rt


class _Replaying:
    """`Runtime.replaying`'s context: the model's lock held from the checks through the
    replay, released if a check raises. A plain class, not a generator: a guarded replay
    enters one per step, and a generator's context costs several times as much."""

    __slots__ = ("_check", "_reads", "_repair", "_rt")

    def __init__(self, rt: Runtime, check: Callable[[], None], repair: bool,
                 reads: frozenset[int] | None) -> None:
        self._rt, self._check, self._repair, self._reads = rt, check, repair, reads

    def __enter__(self) -> None:
        rt = self._rt
        rt._lock.acquire()
        try:
            rt._checked_for_replay(self._check, self._repair, self._reads)
        except BaseException:
            rt._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._rt._lock.release()


def _others_weights(model: nn.Module) -> list[Foreign]:
    """The weights of every model a live runtime binds but `model` (the sources of what
    it derives from them), each kept with its model's walk. One that is loading in
    another thread is read as it is, not kept: its walk is its load's."""
    with _CREATE:
        runtimes = list(_RUNTIMES.items())
    out = []
    for other, rt in runtimes:
        if other is model or not rt._binder.alive:
            continue
        if rt._lock.acquire(blocking=False):
            try:
                out.append(rt._binder.foreign())
            finally:
                rt._lock.release()
        else:
            out.append(foreign_of(other, loading=True))
    return out


def _consults(module: nn.Module, registry: Registry) -> bool | None:
    """Whether the runtime `module` is bound by consults `registry` (None: it has none)."""
    rt = _RUNTIMES.get(module) or _OWNERS.get(module)
    if rt is None or not rt._binder.alive:
        return None
    return rt._binder.consults(registry)


ATTACHED[:] = [_consults]


def weight_update(
    model: nn.Module, *, writes: Iterable[str] | None = None
) -> contextlib.AbstractContextManager[Runtime]:
    """Shortcut for `gs.runtime(model).weight_update(writes=writes)`.

    Args:
        model: The model to update.
        writes: Dotted paths of every tensor the update writes, if known: should it
            fail, only these (and what it wrote besides) must be loaded again, instead
            of every weight of the model.

    Raises:
        GraphSafetyError: `writes` names a tensor the model does not have.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> with weight_update(model) as rt:
        ...     assert rt is runtime(model)
        >>> with weight_update(model, writes=["weight"]):
        ...     _ = model.weight.data.fill_(1.0)
    """
    return runtime(model).weight_update(writes=writes)


def runtime_conflict_error(model_class: type, conflict: list[str]) -> GraphSafetyError:
    """The error for `Runtime(model, ...)` whose arguments the model's runtime lacks."""
    return GraphSafetyError(
        f"{model_class.__name__} already has a runtime; Runtime() cannot make another",
        module_class=model_class.__name__,
        expected="one runtime per model, found with gs.runtime(model)",
        got="Runtime(model, ...) with " + " and ".join(conflict),
        fix="call gs.runtime(model, registry, strict=...): it returns the model's runtime, "
        "adding the registry and setting strict",
    )


def pinned_registry_error(model_class: type) -> RegistrationError:
    """The error for a registry added once graphs pinned the model (nothing moved: new
    buffers would be made that no captured graph knows)."""
    return RegistrationError(
        "a registry was added after graph capture",
        module_class=model_class.__name__,
        expected="registries added before graphs are captured (its derivations make new "
        "buffers, which no captured graph reads)",
        got="gs.runtime(model, registry) or rt.add_registry(registry) on a model a graph "
        "has pinned",
        fix="pass the registry at the first gs.runtime(model, registry) call, before "
        "capturing; or release the graphs (Graph.reset()), add it, and capture again",
    )
