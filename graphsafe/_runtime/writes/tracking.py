"""Write tracking at the dispatcher.

`WriteTracker` is a `TorchDispatchMode` that sees every aten op and notes which watched
storages an op writes (its schema marks the argument `(a!)`: in-place ops, `out=` ops,
`copy_`, `set_`). It works whatever Python object the write goes through:
`param.data.copy_(w)` writes the parameter's storage although it does not bump the
parameter's version counter.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Set
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphsafe import _native
from graphsafe._lineage.record.recorder import DERIVED_COPY, schema_name
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.transient.transients import Transient, Transients
from graphsafe._runtime.writes.observer import Quiet

__all__ = [
    "NativeWriteTracker",
    "ReadGuard",
    "Taints",
    "Taken",
    "WriteTracker",
    "storage_key",
    "write_tracker",
    "written_args",
]

# Per op overload: (positional index, name) of every argument the op writes.
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_args(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument an op writes: from its schema, and for c10d's
    in-place collectives, whose schemas mark none, their first argument."""
    found = _WRITES.get(func)
    if found is None:
        schema = func._schema
        found = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        if not found and getattr(func, "namespace", "") == "c10d" and schema.name.endswith("_"):
            # c10d's in-place collectives (broadcast_, recv_, scatter_, allreduce_, ...)
            # write their first argument, tensors or lists of them, but their schemas do
            # not mark it.
            found = ((0, schema.arguments[0].name),)
        _WRITES[func] = found
    return found


class WriteTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes writes into the `watched` storage keys (a set, or a mapping of them to
    anything, e.g. paths).

    `on_write(key, op_name)` runs BEFORE a watched storage is written: raising there
    refuses the write, so nothing is changed. A write into one of `transients` (the model's
    transient inputs) holds its storage first and what it defines is noted there
    (`transient_written`).

    Examples:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> with WriteTracker({storage_key(p): "p"}) as tracker:
        ...     _ = p.data.copy_(torch.ones(3))
        >>> list(tracker.written) == [storage_key(p)]
        True
    """

    def __init__(
        self,
        watched: Collection[int],
        on_write: Callable[[int, str], None] | None = None,
        transients: Transients | None = None,
        sequenced: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.watched = watched
        self.on_write = on_write
        self.written: set[int] = set()
        self.sequenced = sequenced
        self.ops: dict[int, list[str]] = {}
        """Of the `sequenced` keys, the ops that wrote each, in order (`schema_name`)."""
        self.transients = transients
        self.transient_written: set[Transient] = set()
        self.on_complete: Callable[[], None] | None = None
        """Called after an op completed a transient input (the load's own thread only)."""
        self._completed = False
        self._quiet: list[Quiet] = []  # one per entry not yet exited
        self._taints: Taints | None = None

    def taint(self, weights: frozenset[int]) -> None:
        """Follow what the load derives from `weights` (storage keys): see `Taints`."""
        self._taints = Taints(weights)

    def tainted(self) -> dict[int, tuple[tuple[int, ...], str]]:
        """Each live storage the load computed from the weights -> (their keys, the op
        that made it); empty unless `taint` was called."""
        return {} if self._taints is None else self._taints.alive()

    def taken(self) -> list[Taken]:
        """The numbers taken from what the weights reach, and the handles ops made from
        it, in order; empty unless `taint` was called."""
        return [] if self._taints is None else list(self._taints.taken)

    def __enter__(self) -> WriteTracker:
        """Track this thread's ops. The process-wide observer skips them meanwhile: the
        load records what it wrote itself."""
        scope = Quiet()
        scope.__enter__()
        self._quiet.append(scope)
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._quiet.pop().__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._quiet.pop().__exit__(None, None, None)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        args, kwargs = self._check_writes(func, args, kwargs or {})
        taints = self._taints
        pending = None if taints is None else taints.start(func, args, kwargs)
        out = func(*args, **kwargs)
        if pending is not None:
            taints.end(pending, args, kwargs, out)  # type: ignore[union-attr]
        if self._completed:
            # A transient input is complete now that the write landed: its derivations
            # run at once, outside this mode, so the layer's inputs need not all be held.
            self._completed = False
            if self.on_complete is not None:
                with _disable_current_modes():
                    self.on_complete()
        return out

    def _check_writes(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Note (or refuse) every write of the op; returns the arguments to run it with
        (a write into a released transient input goes to its new memory instead)."""
        writes = written_args(func)
        if writes:
            nargs = len(args)
            for index, name in writes:
                arg = args[index] if index < nargs else kwargs.get(name)
                if isinstance(arg, torch.Tensor):
                    real = self._note(arg, func, args, kwargs)
                    if real is not None:
                        if index < nargs:
                            args = (*args[:index], real, *args[index + 1 :])
                        else:
                            kwargs = {**kwargs, name: real}
                elif isinstance(arg, (list, tuple)):
                    for item in arg:
                        if isinstance(item, torch.Tensor):
                            self._note(item, func, args, kwargs)
                        elif isinstance(item, (list, tuple)):  # Tensor[][] of collectives
                            for t in item:
                                if isinstance(t, torch.Tensor):
                                    self._note(t, func, args, kwargs)
        return args, kwargs

    def _note(
        self, t: torch.Tensor, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """Note that op `func` (`args`, `kwargs`) writes `t`; returns the tensor to write
        instead (a released transient input's new memory), or None."""
        if self.transients is not None:
            # A released input gets memory first; what the op defines of it is noted.
            tr, real = self.transients.on_write(t, func, args, kwargs)
            if tr is not None:
                self.transient_written.add(tr)
                self._completed = self._completed or tr.complete
                return real
        key = storage_key(t)
        if key and key in self.watched:
            if self.on_write is not None:
                self.on_write(key, str(func))
            self.written.add(key)
            if key in self.sequenced:
                self.ops.setdefault(key, []).append(self._sequenced_name(func, args))
        return None

    def _sequenced_name(self, func: Any, args: tuple[Any, ...]) -> str:
        """The op's name in a rewritten weight's order: a `copy_` of values computed
        from the weights is `DERIVED_COPY` (a rewrite, not a load)."""
        name = schema_name(func)
        taints = self._taints
        if (name == "aten::copy_" and taints is not None and len(args) > 1
                and isinstance(args[1], torch.Tensor) and taints.from_weights(args[1])):
            return DERIVED_COPY
        return name


class Taken(NamedTuple):
    """A value that left torch in a load from what the weights reach: a number
    (`aten::_local_scalar_dense`: `.item()`, `float()`, `int()`, `bool()`), or a handle a
    non-aten op returned (a `ScriptObject`, by its class's qualified name; an int)."""

    handle: bool
    value: object
    sources: tuple[int, ...]
    """The weights' storage keys, sorted."""
    op: str


class Taints:
    """What a load that is not recorded derives from the model's weights, op by op (the
    Python path of the compiled tracker's `tracker_taint`).

    The storages an op writes or returns are tainted with the weights its inputs reach (a
    weight itself, or a storage tainted before); one overwritten (`copy_`, `fill_`,
    `zero_`) by values no weight reaches is its own source (a weight the load creates:
    what is computed from it is computed from that weight, if the model holds it as one
    by the end). Each taint holds its storage weakly: one
    freed in the load, whose address is reused, is never taken for it.
    """

    def __init__(self, weights: frozenset[int]) -> None:
        self.weights = weights
        self._tainted: dict[int, tuple[StorageWeakRef, frozenset[int], str]] = {}
        self.taken: list[Taken] = []
        """Numbers taken from what the weights reach, handles ops made from it."""

    def _reach(self, t: torch.Tensor) -> frozenset[int]:
        key = storage_key(t)
        if not key:
            return frozenset()
        if key in self.weights:
            return frozenset((key,))
        found = self._tainted.get(key)
        if found is None or found[0].expired() or found[0].cdata != _cdata(t):  # type: ignore[no-untyped-call]
            return frozenset()
        return found[1]

    def from_weights(self, t: torch.Tensor) -> bool:
        """Whether `t` is a weight, or was computed from one in the load."""
        return not self._reach(t).isdisjoint(self.weights)

    def start(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[frozenset[int], str, frozenset[int]] | None:
        """Before `func` runs: taint its written arguments; what its results get."""
        name = schema_name(func)
        writes = {i for i, _ in written_args(func)}
        names = {n for _, n in written_args(func)}
        overwrites = name in _OVERWRITES
        reached: set[int] = set()
        read: set[int] = set()
        written: list[torch.Tensor] = []
        for where, arg in (*enumerate(args), *kwargs.items()):
            is_written = where in writes or where in names
            for t in _tensors(arg):
                read.add(storage_key(t))
                if is_written:
                    written.append(t)
                if not (overwrites and is_written):
                    reached |= self._reach(t)
        sources = frozenset(reached)
        for t in written:
            key = storage_key(t)
            if not key or key in self.weights:
                continue  # a weight is a source, never derived
            if sources:
                self._mark(t, key, sources, name, named=False)
            elif overwrites:  # loaded values: its own source (a weight by the end?)
                self._mark(t, key, frozenset((key,)), name, named=True)
        if not sources and name in _COPIES:  # a copy of loaded values: its own source
            return (frozenset(), name, frozenset(read))
        return (sources, name, frozenset(read)) if sources else None

    def end(self, pending: tuple[frozenset[int], str, frozenset[int]], args: tuple[Any, ...],
            kwargs: dict[str, Any], out: Any) -> None:
        """After the op: its results are tainted (named after it, unless views); a number
        or a handle it made from the weights is `taken`."""
        sources, name, read = pending
        if sources:
            self._note_taken(sources, name, out)
        for t in _tensors(out):
            key = storage_key(t)
            if key and key not in self.weights:
                self._mark(t, key, sources or frozenset((key,)), name, named=key not in read)

    def _mark(self, t: torch.Tensor, key: int, sources: frozenset[int], op: str, *,
              named: bool) -> None:
        was = self._tainted.get(key)
        if (not named and was is not None and was[1] == sources
                and not was[0].expired() and was[0].cdata == _cdata(t)):  # type: ignore[no-untyped-call]
            return  # a view of it: the op that made it names it
        try:
            ref = StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]
        except (RuntimeError, NotImplementedError):
            return
        self._tainted[key] = (ref, sources, op)

    def _note_taken(self, sources: frozenset[int], name: str, out: Any) -> None:
        keys = tuple(sorted(sources))
        if name == "aten::_local_scalar_dense":
            if type(out) in (int, float, bool):
                self.taken.append(Taken(False, out, keys, name))
            return
        if name.startswith("aten::"):
            return
        for r in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(r, torch.ScriptObject):
                self.taken.append(Taken(True, r._type().qualified_name(), keys, name))
            elif type(r) is int:
                self.taken.append(Taken(True, r, keys, name))

    def alive(self) -> dict[int, tuple[tuple[int, ...], str]]:
        """Each live tainted storage -> (the weights' keys, sorted; the op)."""
        return {key: (tuple(sorted(srcs)), op) for key, (ref, srcs, op) in self._tainted.items()
                if not ref.expired()}  # type: ignore[no-untyped-call]


_OVERWRITES = frozenset({"aten::copy_", "aten::fill_.Scalar", "aten::fill_.Tensor",
                         "aten::zero_"})
_COPIES = frozenset({"aten::clone", "aten::_to_copy", "aten::lift_fresh_copy"})
"""Ops that make a new storage of their argument's values (which the compiled tracker
sees as `empty_like` and a `copy_`, one of `_OVERWRITES`)."""


def _cdata(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return 0


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an argument or a result (in lists and tuples too, one level deep
    below the first)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        out: list[torch.Tensor] = []
        for v in value:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
        return out
    return []


class ReadGuard(WriteTracker):  # type: ignore[no-untyped-call]
    """A `WriteTracker` that also refuses reads of some storages, before the op runs.

    A derivation's first call runs under one: reading a model tensor it did not declare
    as an input would leave its buffer stale whenever that tensor changes. `on_read(key,
    op_name)` runs before an op reads a `watched` key that is not `allowed` (the inputs).
    What the function's own ops made (`fresh`) is no model tensor: reading or writing it
    asks nothing of `watched` (a `ModelStorages` walks the model only when asked).
    """

    def __init__(
        self,
        watched: Collection[int],
        on_write: Callable[[int, str], None] | None,
        allowed: Set[int],
        on_read: Callable[[int, str], None],
    ) -> None:
        super().__init__(watched, on_write)
        self.allowed = allowed
        self.on_read = on_read
        self.fresh: set[int] = set()
        """Storages that ops writing none of their arguments returned and none of their
        arguments held: made while it ran, so no storage the model held before."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._check_writes(func, args, kwargs)  # an impure write is the first thing to refuse
        if getattr(func, "is_view", False):
            return func(*args, **kwargs)  # a view reads no data (what reads it is checked)
        watched, allowed, fresh = self.watched, self.allowed, self.fresh
        read: set[int] = set()
        for arg in (*args, *kwargs.values()):
            items = arg if isinstance(arg, (list, tuple)) else (arg,)
            for item in items:
                if isinstance(item, torch.Tensor):
                    key = storage_key(item)
                    read.add(key)
                    if key and key not in allowed and key not in fresh and key in watched:
                        self.on_read(key, str(func))
        out = func(*args, **kwargs)
        if written_args(func):  # what it returns is what it wrote (`set_` may point it
            return out          # at any storage): nothing new
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key and key not in read:
                    fresh.add(key)
        return out

    def _note(
        self, t: torch.Tensor, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """A write into what the function made is its own; any other is checked."""
        if storage_key(t) in self.fresh:
            return None
        return super()._note(t, func, args, kwargs)


class NativeWriteTracker:
    """`WriteTracker`'s noting of writes, in C++ (`graphsafe native build`).

    A RecordFunction callback of the thread that enters it sees each op before it runs
    and notes the watched storages its schema says it writes: the same ops and the same
    arguments as `WriteTracker`, without a Python call per op. It only notes: loads with
    transient inputs, whose writes are redirected, keep `WriteTracker`. If torch's
    RecordFunction was turned off while it tracked, writes may have gone unseen, and it
    reports every watched storage as written (so everything is refreshed). `watched` is
    read once, at the first entry (a frozenset passed again, as loads pass their model's,
    is read once per process: its keys are shared).
    """

    def __init__(self, watched: Collection[int], native: _native.Native,
                 sequenced: frozenset[int] = frozenset()) -> None:
        self.watched = watched
        self.sequenced = sequenced
        self.transients: Transients | None = None
        self.transient_written: set[Transient] = set()
        self.on_complete: Callable[[], None] | None = None
        self._native = native
        self._id: int | None = None
        self._blind = False
        self._weights: frozenset[int] | None = None

    def taint(self, weights: frozenset[int]) -> None:
        """Follow what the load derives from `weights` (before it is entered)."""
        self._weights = weights

    def tainted(self) -> dict[int, tuple[tuple[int, ...], str]]:
        """As `WriteTracker.tainted`."""
        if self._id is None or self._weights is None:
            return {}
        return self._native.tracker_tainted(self._id)

    def taken(self) -> list[Taken]:
        """As `WriteTracker.taken`."""
        if self._id is None or self._weights is None:
            return []
        return [Taken(*row) for row in self._native.tracker_taken(self._id)]

    @property
    def written(self) -> Set[int]:
        """Storage keys written so far (any thread may ask, also while it tracks): the
        same frozenset as the last time it was asked of a tracker of the same watched set,
        when the same storages were written."""
        if self._id is None:
            return set()
        if self._blind:
            return set(self.watched)
        return self._native.tracker_written(self._id)

    @property
    def ops(self) -> dict[int, list[str]]:
        """Of the `sequenced` keys, the ops that wrote each, in order."""
        if self._id is None or not self.sequenced:
            return {}
        return self._native.tracker_ops(self._id)

    def __enter__(self) -> NativeWriteTracker:
        if self._id is None:
            self._id = self._native.tracker_new(self.watched)
            weakref.finalize(self, self._native.tracker_free, self._id)
            if self.sequenced:
                self._native.tracker_sequence((self._id, self.sequenced))
            if self._weights is not None:
                self._native.tracker_taint((self._id, self._weights))
        self._native.tracker_push(self._id)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._id is not None
        if not self._native.tracker_pop(self._id):
            self._blind = True


def write_tracker(
    watched: Collection[int], transients: Transients | None = None,
    sequenced: frozenset[int] = frozenset(),
) -> WriteTracker | NativeWriteTracker:
    """The tracker of a load: the compiled one unless there are `transients` (their writes
    are redirected, which only the Python one does) or it is not built. Of the
    `sequenced` keys it keeps the ops that wrote each, in order (`ops`)."""
    native = _native.get()
    if native is not None and not transients:
        return NativeWriteTracker(watched, native, sequenced)
    return WriteTracker(watched, transients=transients, sequenced=sequenced)
