"""The runtime: the lifecycle of one model's derived buffers.

One `Runtime` per model instance (`gs.runtime(model)`; `gs.Runtime(model)` returns the
same one). It decides *when* derived buffers follow the weights: it binds the registered
derivations to the module tree (and binds again when the tree changed before pin), drives
every load and `weight_update` block as one tracked `Load`, holds the pins graphs take,
and answers the guard. It alone takes the model's lock. What to recompute, and the
recomputing, is the engine's; how one load watches, refreshes and ends, the `Load`'s.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from graphsafe._declare.decorators import class_registries
from graphsafe._declare.registry import Registry, default_registry
from graphsafe._declare.spec import Derivation, DerivationInfo, RefreshReport
from graphsafe._errors import GraphSafetyError, StaleError, StorageMovedError
from graphsafe._memory.journal import JOURNAL, Journal
from graphsafe._memory.walk import storage_key, storage_paths, walk_tensors
from graphsafe._runtime.binding import bind
from graphsafe._runtime.checks import swapped_error
from graphsafe._runtime.engine import Engine
from graphsafe._runtime.freshness import check_fresh, fresh_fix
from graphsafe._runtime.load import Load
from graphsafe._runtime.state_dict import hook_state_dict
from graphsafe._runtime.tree import derivations_for, swapped_modules, tensor_at

__all__ = ["Runtime", "runtime", "weight_update"]

_MANUAL = "manual"
_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
"""Model -> the runtime made for it."""
_OWNERS: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
"""Module of a bound tree -> the runtime that bound it (last), for a submodule's loads."""
_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()
"""Every runtime alive: a load that ended tells them what it wrote."""
_CREATE = threading.Lock()


class _OnePerModel(type):
    """`Runtime(model)` gives the model's one runtime: a second would refresh it too."""

    def __call__(
        cls, model: nn.Module, registry: Registry | None = None, *, strict: bool | None = None
    ) -> Any:
        with _CREATE:
            rt = _RUNTIMES.get(model) or _OWNERS.get(model)
            if rt is None:
                rt = super().__call__(model, registry, strict=bool(strict))
                _RUNTIMES[model] = rt
                return rt
        conflict = []
        if registry is not None and not rt._consults(registry):
            conflict.append("a registry it does not consult")
        if strict is not None and strict != rt.strict:
            conflict.append(f"strict={strict} (it has strict={rt.strict})")
        if conflict:
            raise GraphSafetyError(
                f"{type(model).__name__} already has a runtime; Runtime() cannot make another",
                module_class=type(model).__name__,
                expected="one runtime per model, found with gs.runtime(model)",
                got="Runtime(model, ...) with " + " and ".join(conflict),
                fix="call gs.runtime(model, registry, strict=...): it returns the model's "
                "runtime, adding the registry and setting strict",
            )
        return rt


class Runtime(metaclass=_OnePerModel):
    """Derived buffers of one model instance, kept correct across weight loads.

    Get it with `gs.runtime(model)` (or `gs.Runtime(model)`, the same object); classes
    decorated with `gs.graphsafe` use it from their loading method without being asked.

    Args:
        model: The root module.
        registry: Where the derivations are declared, besides `gs.default_registry` and
            the registries named by `gs.graphsafe(registry=...)` on the model's classes.
        strict: Check purity on every refresh, not only at materialization.

    Raises:
        GraphSafetyError: The model has a runtime whose registries or `strict` differ.

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
        self._model_ref = weakref.ref(model)
        self.registries: list[Registry] = [default_registry]
        if registry is not None and registry is not default_registry:
            self.registries.append(registry)
        self._strict = strict
        self._journal: Journal = JOURNAL
        self._lock = threading.RLock()
        self._engine: Engine | None = None
        self._holders: dict[object, int] = {}
        self._load: Load | None = None
        # Checks run when a load or update ends normally (an engine integration's
        # ledger), so that what they find raises through that call.
        self._load_checks: list[Callable[[], None]] = []
        # Storages of every model tensor while pinned: a failed load's poison on any of
        # them refuses the graphs' replays.
        self._pinned_keys: frozenset[int] = frozenset()
        _LIVE.add(self)

    # -- binding ---------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The root module (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafetyError(
                "the model of this runtime no longer exists",
                expected="a model that is still referenced",
                got="the model was garbage-collected",
                fix="keep a reference to the model while using its runtime, e.g. "
                "`model = M(); gs.runtime(model)` rather than `gs.runtime(M())`",
            )
        return model

    @property
    def strict(self) -> bool:
        """Whether every refresh checks purity, not only materialization."""
        return self._strict

    @strict.setter
    def strict(self, value: bool) -> None:
        self._strict = value
        if self._engine is not None:
            self._engine.strict = value

    def _bound(self) -> Engine:
        """The engine of the current binding; binds (again, after the module tree changed
        before pin) on first use. Raises `StorageMovedError` if pinned and swapped."""
        engine = self._engine
        if engine is not None:
            swapped = swapped_modules(engine.binding)
            if not swapped:
                return engine
            if self.pinned:
                raise swapped_error(self.model, engine.binding, swapped)
        model = self.model
        binding = bind(model, self._derivations_for, self._own)
        self._engine = engine = Engine(
            binding, self._model_tensors, journal=self._journal, strict=self._strict
        )
        hook_state_dict(
            model, engine, weakref.WeakMethod(self._before_state_dict_load),
            weakref.WeakMethod(self._after_state_dict_load),
        )
        return engine

    def _own(self, module: nn.Module) -> None:
        _OWNERS[module] = self

    def _model_tensors(self) -> dict[int, str]:
        return storage_paths(self.model)

    def _tensors(self) -> Iterator[torch.Tensor]:
        return (site.tensor for site in walk_tensors(self.model))

    def _derivations_for(self, cls: type) -> list[Derivation]:
        return derivations_for(self.registries, cls)

    def _consults(self, registry: Registry) -> bool:
        return registry in self.registries or any(
            registry in class_registries(type(m)) for m in self.model.modules()
        )

    def add_registry(self, registry: Registry) -> None:
        """Also bind the derivations of `registry` (rebinding if already bound).

        Raises:
            StorageMovedError: If the runtime is pinned; rebinding would allocate buffers
                that captured graphs do not know.
        """
        with self._lock:
            if self._consults(registry):
                return
            if self.pinned:
                raise StorageMovedError(
                    "cannot add a registry to a pinned runtime",
                    module_class=type(self.model).__name__,
                    expected="registries added before graphs are captured",
                    got="runtime pinned by a capture",
                    fix="pass the registry at the first gs.runtime(model, registry) call",
                )
            self.registries.append(registry)
            self._engine = None  # rebound on next use; existing buffers keep their storage

    def add_load_check(self, check: Callable[[], None]) -> None:
        """Run `check` whenever a load or update of this model ends normally, so that
        what it finds raises through the call that made the load (an engine's ledger)."""
        with self._lock:
            self._load_checks.append(check)

    # -- what the user reads -----------------------------------------------------------

    @property
    def derivations(self) -> tuple[DerivationInfo, ...]:
        """The bound derivations with their paths, inputs, shapes, dtypes and bytes."""
        with self._lock:
            return tuple(b.info() for b in self._bound().bound)

    @property
    def last_report(self) -> RefreshReport | None:
        """The report of the last refresh, including those run by loads."""
        return self._engine.last_report if self._engine is not None else None

    @property
    def pinned(self) -> bool:
        """Whether any graph (or a manual `pin()`) holds the storage fixed."""
        return bool(self._holders)

    @property
    def stale(self) -> tuple[str, ...]:
        """Paths of derived buffers that do not currently match their inputs.

        A buffer is stale before it is first materialized, after its derivation failed,
        after a load that raised wrote its inputs, when an input was rebound, written in
        place (its version moved) or written through the journal since the last refresh.
        """
        with self._lock:
            engine = self._bound()
            in_update = self._load.written_so_far() if self._load is not None else set()
            stale = engine.stale_reasons(in_update)
            return tuple(p for i in sorted(stale) for p in engine.bound[i].out_paths)

    @property
    def materialized(self) -> bool:
        """Whether every owned derived buffer has been allocated."""
        with self._lock:
            return all(b.buffers is not None for b in self._bound().bound)

    def assert_fresh(self, *, repair: bool = False) -> None:
        """Raise unless every derived buffer matches its inputs and the last update held.

        The witnesses of every input and buffer (identity, pointer, version, journal
        epoch) in one flat comparison, then the journal's poisoned storages.

        Args:
            repair: Refresh stale buffers in place instead of raising for them. A failed
                or unfinished update is never repaired.

        Raises:
            StaleError: Naming the stale buffers and how their inputs were written, or
                the failed or unfinished weight update.
        """
        with self._lock:
            load = self._load
            if load is not None and load.written_so_far():
                raise StaleError(
                    "a weight update is in progress; the model holds a mix of old and new "
                    "weights",
                    module_class=type(self.model).__name__,
                    expected="the weight_update block (or load) to have ended",
                    got=f"{len(load.written_so_far())} tensor storage(s) written so far",
                    fix="run the model after the `with gs.weight_update(model):` block exits",
                )
            engine = self._engine or self._bound()  # module swaps: the ledger checks them
            if engine.stale or not engine.witnesses.unchanged() or self._poisoned(engine):
                keys = engine.storage_keys() | self._pinned_keys
                check_fresh(engine, keys, type(self.model), repair=repair)

    @contextlib.contextmanager
    def replaying(self, check: Callable[[], None], *, repair: bool) -> Iterator[None]:
        """Hold the model still for one replay: `check()` (a graph's ledger), then
        `assert_fresh(repair=repair)`, under the lock that loads of the model take."""
        with self._lock:
            check()
            self.assert_fresh(repair=repair)
            yield

    def _poisoned(self, engine: Engine) -> bool:
        """Whether a failure poisoned storage this model reads (not another model's)."""
        poisoned = self._journal.poisoned  # few keys: each is looked up, nothing is built
        return bool(poisoned) and not (
            engine.storage_keys().isdisjoint(poisoned) and self._pinned_keys.isdisjoint(poisoned)
        )

    # -- refresh ---------------------------------------------------------------------

    def refresh(self, changed: Iterable[str] | None = None) -> RefreshReport:
        """Recompute derived buffers in place.

        Args:
            changed: Dotted paths (from the model root) of tensors that changed; only the
                derivations reading their storage (under any name: tied weights share
                one), and those downstream, are recomputed. None: all of them.

        Returns:
            What was done, per derivation.

        Raises:
            DerivationDriftError: A result does not fit its buffer (nothing written).
            StorageMovedError: After `pin()`, an input or buffer was rebound.
            ImpureDerivationError: A derivation wrote into a model tensor.
            GraphSafetyError: `changed` names no tensor of the model.
        """
        with self._lock:
            engine = self._bound()
            dirty = engine.scan_moved(self.pinned)
            try:
                if changed is None:
                    # A failed update stays flagged: a refresh cannot repair half-loaded
                    # weights. Derivations whose transient inputs are released are left
                    # as they are: only a load can give them their inputs.
                    return engine.run(range(len(engine.bound)), skip_blocked=True)
                dirty.update(engine.witness_dirty())
                keys = []
                for path in changed:
                    dirty.update(engine.binding.by_path.get(path, ()))
                    keys.append(storage_key(tensor_at(self.model, path)))
                dirty.update(engine.consumers_of(keys))
                return engine.run(engine.closure(dirty))
            finally:
                engine.transients.release()

    def refresh_stale(self) -> RefreshReport:
        """Recompute exactly what is stale: never materialized, failed, or whose inputs
        were written (by any path the witnesses see) since their last refresh."""
        with self._lock:
            engine = self._bound()
            dirty = engine.scan_moved(self.pinned)
            dirty.update(engine.witness_dirty())
            try:
                return engine.run(engine.closure(dirty))
            finally:
                engine.transients.release()

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
            engine = self._bound()  # binds again if its tree changed (before pin)
            dirty = engine.scan_moved(self.pinned) | engine.consumers_of(keys)
            if dirty:
                engine.run(engine.closure(dirty))
        finally:
            self._lock.release()

    # -- pins --------------------------------------------------------------------------

    def check_pinnable(self) -> None:
        """Raise `StaleError` unless the derived buffers exist, so that a graph can be
        captured."""
        with self._lock:
            missing = [b.path for b in self._bound().bound if b.buffers is None]
            if missing:
                raise StaleError(
                    "cannot pin: derived buffers were never materialized",
                    paths=missing,
                    path=", ".join(missing[:8]),
                    expected="derived buffers allocated by a first load or refresh()",
                    got="not materialized",
                    fix=fresh_fix(type(self.model), True),
                )

    def pin(self, holder: object = _MANUAL) -> None:
        """Declare storage addresses fixed from now on, as a captured graph requires.

        Derivations whose inputs moved since the last refresh (e.g. after `.to()`) are
        refreshed first. While any holder keeps its pin, rebinding an input, a derived
        buffer or a submodule raises `StorageMovedError` at the next load, refresh or
        guarded replay. A graph pins with itself as the holder and releases its pin when
        it is reset, dropped or its capture fails; `pin()` without a holder is the
        manual pin that `unpin()` releases.

        Args:
            holder: Who holds the pin.

        Raises:
            StaleError: If the derived buffers were never materialized.
        """
        with self._lock:
            self.check_pinnable()
            engine = self._bound()
            if not self._holders:
                dirty = engine.scan_moved(False)
                if dirty:
                    engine.run(engine.closure(dirty))
            self._holders[holder] = self._holders.get(holder, 0) + 1
            self._pinned_keys = frozenset(self._model_tensors())

    def unpin(self, holder: object = _MANUAL) -> None:
        """Release `holder`'s pin (graphs captured under it must be re-captured)."""
        with self._lock:
            count = self._holders.get(holder, 0)
            if count <= 1:
                self._holders.pop(holder, None)
            else:
                self._holders[holder] = count - 1
            if not self._holders:
                self._pinned_keys = frozenset()

    # -- loads -------------------------------------------------------------------------

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
                while True:
                    with load.tracker:
                        try:
                            item = next(inner)
                        except StopIteration as stop:
                            return stop.value
                    try:
                        yield item
                    except GeneratorExit:
                        inner.close()
                        raise _Closed("the loader was closed before it ended") from None

        return steps()

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[Runtime]:
        """A block of writes (the bucketed RL weight sync): refresh once at the end.

        Load calls inside do not refresh; every write into a model tensor inside the
        block is tracked (worker threads' loads join it), writes declared with
        `gs.mark_written` and in-place writes the version counters see are picked up,
        and when the block exits normally the affected derivations are refreshed once.
        An exception leaves the model failed closed until a load completes.

        Yields:
            This runtime.
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
        engine = self._bound()
        load = self._load = Load.begin(
            engine, self._journal, pinned=self.pinned,
            everything=self._model_tensors() if everything else None,
        )
        try:
            yield load
        except BaseException as exc:
            self._end(load, what, GeneratorExit(str(exc)) if isinstance(exc, _Closed) else exc)
            if isinstance(exc, _Closed):
                raise GeneratorExit from None
            raise
        self._end(load, what, None, witnesses=everything)

    def _end(
        self, load: Load, what: str, exc: BaseException | None, *, witnesses: bool = False
    ) -> None:
        try:
            written = load.end(
                what, exc, pinned=self.pinned, model_tensors=self._tensors, witnesses=witnesses
            )
        finally:
            self._load = None
        if exc is None:
            if written:
                for rt in list(_LIVE):
                    if rt is not self and rt._engine is not None:
                        with contextlib.suppress(GraphSafetyError):  # its guard reports it
                            rt._refresh_written_elsewhere(written)
            for check in self._load_checks:
                check()

    # -- load_state_dict (hooks installed on the model) --------------------------------

    def _before_state_dict_load(self, module: nn.Module, state_dict: dict[str, Any],
                                prefix: str) -> None:
        # Transient inputs the state dict holds get their bytes back before torch copies
        # into them; the post-hook refreshes their readers and releases them again.
        engine = self._engine
        if engine is not None and self.model is module:
            for tr in engine.transients:
                if prefix + tr.input.path in state_dict:
                    engine.transients.hold_whole(tr)

    def _after_state_dict_load(self, module: nn.Module, incompatible: Any) -> None:
        engine = self._engine
        if engine is not None and self.model is module:
            # What a transient input's model cannot give back, it does not ask for either.
            released = {tr.input.path for tr in engine.transients}
            incompatible.missing_keys[:] = [
                k for k in incompatible.missing_keys if k not in released
            ]
        with self._lock:
            if self._load is not None or self._engine is None:
                return  # inside a tracked load or update: refreshed when it ends
            # Ended as any load ends; what it wrote, the witnesses (versions) and the
            # transient inputs the pre-hook gave memory to say what to refresh.
            load = Load.of_state_dict(self._bound(), self._journal)
            self._end(load, "load_state_dict", None, witnesses=True)


class _Closed(Exception):
    """A generator loader closed before it ended (raised as GeneratorExit to the caller)."""


def _name(fn: Callable[..., Any], module: Any) -> str:
    return f"{type(module).__name__}.{getattr(fn, '__name__', 'load')}"


def runtime(
    model: nn.Module, registry: Registry | None = None, *, strict: bool | None = None
) -> Runtime:
    """The runtime of `model`, created on first use (one per model instance).

    A submodule of a model that already has a runtime gets that runtime.

    Args:
        model: The root module.
        registry: Where derivations are declared; `gs.default_registry` by default.
        strict: If given, sets whether every refresh checks purity.

    Returns:
        The runtime.

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


def weight_update(model: nn.Module) -> contextlib.AbstractContextManager[Runtime]:
    """Shortcut for `gs.runtime(model).weight_update()`.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> with weight_update(model):
        ...     pass
    """
    return runtime(model).weight_update()
