"""Provenance: which tensors an observed load computed from which storages, by which ops.

While a load runs, a dispatch mode (`Recorder`) notes each op as a `Call`: the op, its
arguments (a tensor argument as an `Arg`: the storage it views, the geometry of the view,
and what last wrote that storage in the recording) and what it wrote. Every storage an op
writes (a new result, or an argument the op mutates) gets the call as its latest writer;
a view shares its base's storage and writer. Results that leave torch (an op returning an
int that becomes a kernel handle, as vLLM's `torch.tensor(<int from the op>)`) keep the
call that made them: a small int64 tensor whose values an op returned is written by it.
A Python number taken from a tensor (`.item()`, `float()`, `int()`, `bool()`, each number
of `.tolist()`, seen by a hook on the method, which returns the very object the caller
keeps: `graphsafe._lineage.record.hooks`) and any other value an op
other than aten's returns
(a `ScriptObject` of prepacked weights, an opaque object, a list) is kept with the call
that made it (`Lineage.values`), so that where the model keeps it can be found by
identity once the load ends. A tensor read as a NumPy array (`.numpy()`) is noted
(`Lineage.unfollowed`): what is made from the array cannot be followed.

Storages are told apart by identity (`_cdata`), never by address, and each is held by a
weak reference for as long as the recording lives (`_Held`; an `Arg` of a storage made
before the recording keeps a `StorageWeakRef` of its own), so an identity freed meanwhile
is never reused under it. What the recording means for a model is resolved once the load
ends (`graphsafe._lineage.resolve`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from graphsafe._lineage.record.hooks import NUMPY, TOLIST, Hooks
from graphsafe._lineage.record.threads import STRAYS, Stray, followed

__all__ = [
    "DERIVED_COPY", "RECORDING", "Arg", "Call", "Lineage", "Recorder", "Scopes", "ambiguous",
    "record", "schema_name", "sid_of",
]

def _mode(value: str) -> str:
    value = value.strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return "all" if value == "all" else "first"


RECORDING = [_mode(os.environ.get("GRAPHSAFE_PROVENANCE", "first"))]
"""Which observed loads record provenance: "first" (the default: a model's first
observed load, where an engine runs its post-load step), "all" (every load: a dispatch
mode on every op, which costs a small-tensor load several times its untracked time), or
"off" (nothing an engine derives undeclared is discovered, nor checked). Set with
`GRAPHSAFE_PROVENANCE=first|all|0`."""

_VIEW_FREE = frozenset({"aten::detach", "aten::lift_fresh", "aten::alias"})
"""Ops whose result is their argument for lineage: the result keeps the writer."""


class Arg(NamedTuple):
    """A tensor argument of a recorded call: the storage `sid` it views, with `size`,
    `stride`, `offset` and `dtype`, and `writer` (the call that last wrote the storage in
    the recording, None for a storage made before it). `keep` holds a weak reference to
    the storage for one made before the recording (a constant it may be replayed with;
    never a reference to the tensor, which `torch.utils.swap_tensors` would refuse)."""

    sid: int
    writer: Call | None
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    keep: StorageWeakRef | None


class Call:
    """One recorded op: `func` with `args`/`kwargs` (tensors as `Arg`), the storages it
    wrote (`outs`: result position -> the result's `Arg`), and whether it returned values
    that left torch (`opaque`)."""

    __slots__ = ("args", "epoch", "func", "kwargs", "mutated", "opaque", "outs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 epoch: int = 0) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.outs: dict[int, Arg] = {}
        self.mutated: tuple[int | str, ...] = ()
        """The arguments the op wrote: positions, or names of keyword arguments (`out=`)."""
        self.opaque = False
        self.epoch = epoch
        """When it ran: 0 in a load, k in the k-th forward the bring-up recorded."""

    @property
    def name(self) -> str:
        """The op's name for messages (`aten.t`, `_C.convert_weight_packed`)."""
        func = self.func
        if type(func) is _OpOverload:  # most: named once per op
            named = _OP_NAMES.get(id(func))
            if named is None:
                named = _OP_NAMES[id(func)] = (func, _name_of(func))
            return named[1]
        return _name_of(func)

    def inputs(self) -> list[Arg]:
        """Every tensor argument."""
        return _args(self.args, self.kwargs, _NONE)

    def reads(self) -> list[Arg]:
        """Every tensor argument the op reads: not what it only overwrites (the
        destination of `copy_`, `fill_`, `zero_`; an `out=`)."""
        mutated = self.mutated
        if not mutated:
            return _args(self.args, self.kwargs, _NONE)
        overwritten = frozenset(mutated) if self.name in _OVERWRITES else frozenset(
            w for w in mutated if isinstance(w, str))
        return _args(self.args, self.kwargs, overwritten)


_NONE: frozenset[int | str] = frozenset()
_OpOverload = torch._ops.OpOverload
_OP_NAMES: dict[int, tuple[Any, str]] = {}
"""`Call.name` of each op, by the op's `id` (an `OpOverload` hashes in Python), with the
op held so that its id is never another's (torch's ops live as long as the process)."""


def _name_of(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    if schema is None and getattr(func, "__objclass__", None) is torch._C.TensorBase:
        # A number or an array taken in Python: named as the caller wrote it.
        return _TAKEN_NAMES.get(func.__name__, f"Tensor.{func.__name__}()")
    name = schema.name if schema is not None else str(func)
    ns, _, op = name.partition("::")
    return f"{ns}.{op}" if op else name


_TAKEN_NAMES = {"__float__": "float()", "__int__": "int()", "__bool__": "bool()",
                "__index__": "operator.index()"}
"""How messages name the Tensor methods that are called through Python's builtins."""


def _args(args: tuple[Any, ...], kwargs: dict[str, Any], skip: frozenset[int | str]
          ) -> list[Arg]:
    """The tensor arguments (`Arg`s, in lists too), but those at the positions or
    keywords of `skip`."""
    out: list[Arg] = []
    if skip:
        values: Any = [a for where, a in (*enumerate(args), *kwargs.items()) if where not in skip]
    else:  # most: every argument (no tuple of pairs built)
        values = (*args, *kwargs.values()) if kwargs else args
    for a in values:
        if type(a) is Arg:  # an `Arg` is a tuple: told apart first
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += [x for x in a if type(x) is Arg]
    return out


_OVERWRITES = frozenset({"aten.copy_", "aten.fill_", "aten.zero_"})
"""Ops whose written argument's old value does not matter (`Call.name`s)."""


def sid_of(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (0 for a tensor without one)."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return 0


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """`t`'s storage, read once per tensor an op touches (None for a tensor without one)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _key(storage: torch.UntypedStorage) -> int:
    """`storage_key` of a tensor whose storage is `storage`."""
    return storage.data_ptr() if storage.nbytes() else 0


class _Held:
    """Weak references to storages (`c10::weak_intrusive_ptr`s, as the ints
    `UntypedStorage._weak_ref` gives) by identity, released when this dies: a storage
    freed while they are held keeps its identity (its `StorageImpl` is not freed), so
    that identity is never reused under the recording. One object for them all: a
    `StorageWeakRef` each costs a Python object and a finalizer per storage."""

    __slots__ = ("refs",)

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}

    def __del__(self, free: Callable[[int], None] = torch.UntypedStorage._free_weak_ref
                ) -> None:  # `free` kept: the `torch` module may be gone at shutdown
        for ref in self.refs.values():
            free(ref)


class Lineage:
    """What a recording found: the latest writer of each storage it saw written, and the
    values that left torch, with the call that made each."""

    __slots__ = ("__weakref__", "_atoms", "_held", "_kept", "_log", "before", "copied", "epoch",
                 "foreign", "handles", "replaced", "scopes", "strays", "unfollowed", "values",
                 "weight_writes", "writers")

    def __init__(self) -> None:
        self.writers: dict[int, tuple[Call, Arg]] = {}
        """Storage identity -> (the call that last wrote it, the written tensor's `Arg`)."""
        self.handles: dict[int, Call] = {}
        """An int an op returned -> that op's call."""
        self.values: dict[int, list[tuple[Call, object]]] = {}
        """`id` of a value that left torch (a Python number from `.item()`, a handle) ->
        each (call that made it, the value) with that identity; the values are held, so
        that an identity is never reused while the recording lives."""
        self.copied: dict[int, int] = {}
        """A storage copied whole into a weight -> that weight's storage (a staging copy:
        what was computed from it was computed from the weight)."""
        self.weight_writes: dict[int, list[tuple[str, bool, Call | None]]] = {}
        """A weight's storage -> each op that wrote it, in order (`schema_name`), whether
        it was a load (a copy from what the recording did not compute), and its call
        (None for a load)."""
        self.foreign: frozenset[int] = frozenset()
        """Storage keys of other models' weights: a weight copied from one is derived
        from it (a draft copying the target's head), not loaded."""
        self.replaced: dict[int, int] = {}
        """A parameter bound in place of another (`register_parameter`, `setattr`) ->
        the one it replaced, by storage identity: a prepacked copy put where the loaded
        weight was."""
        self.scopes: dict[int, dict[str, Any]] = {}
        """The global namespaces of the code that took numbers from tensors (by `id`):
        where a number the model does not keep is looked for (a module's registry)."""
        self.unfollowed: list[Call] = []
        """Reads of a tensor's memory that left torch as a NumPy array (`Tensor.numpy()`):
        what is made from the array is not followed."""
        self.strays: list[Stray] = []
        """Ops of threads the recording did not follow that read or wrote the weights
        while it ran (`threads.Strays`): what they made is not recorded."""
        self.before: dict[str, object] | None = None
        """Where the model kept the values that do not tell one occurrence from another
        (`bool`s, small `int`s), and floats, taken before the recording made the first
        number: a place that held the same value then was not set by the recording (a
        float it set that is none it took was computed in Python: not followed)."""
        self._held = _Held()
        self._kept: dict[int, StorageWeakRef] = {}
        self._atoms: Callable[[], dict[str, object]] | None = None
        self._log: Any = None
        """The compiled recording that fills it (`native._Log`), if one does."""
        self.epoch = 0
        """0 while a load records; k while the k-th forward of the bring-up does."""

    def __len__(self) -> int:
        return len(self.writers) + len(self.handles) + len(self.values)

    def note_places(self, atoms: Callable[[], dict[str, object]]) -> None:
        """How to read, by path, where the model keeps `bool`s and small `int`s: read
        once, just before the recording makes the first such value (`before`)."""
        self._atoms = atoms

    def note_replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Parameter `new` was bound where `old` was (see `replaced`)."""
        was, now = sid_of(old), sid_of(new)
        if was and now and was != now:
            self.hold(old.untyped_storage(), was)
            self.replaced[now] = was

    def note_scope(self, frame: FrameType | None) -> None:
        """The code of `frame` (or of the first caller outside torch and graphsafe) took
        a number: its module's globals are where a number it keeps is looked for."""
        for _ in range(8):
            if frame is None:
                return
            space = frame.f_globals
            if not str(space.get("__name__", "")).startswith(_INSIDE):
                self.scopes.setdefault(id(space), space)
                return
            frame = frame.f_back

    def wrote_weight(self, sid: int, op: str, call: Call | None) -> None:
        """Weight storage `sid` was written by `op`: by `call`, or, None, a copy of
        loaded values."""
        self.weight_writes.setdefault(sid, []).append((op, call is None, call))

    def keep(self, call: Call, value: object) -> None:
        """`value` left torch from `call` (see `values`)."""
        if self.before is None and self._atoms is not None and type(value) in _NUMBERS:
            self.before = self._atoms()
        self.values.setdefault(id(value), []).append((call, value))

    def hold(self, storage: torch.UntypedStorage, sid: int) -> None:
        """Keep `sid` (the identity of `storage`) from being reused while the recording
        lives."""
        refs = self._held.refs
        if sid not in refs:
            ref: int = storage._weak_ref()  # type: ignore[assignment]
            if refs.setdefault(sid, ref) != ref:  # a thread it follows held it meanwhile
                _FREE(ref)  # type: ignore[no-untyped-call]

    def kept(self, storage: torch.UntypedStorage, sid: int) -> StorageWeakRef:
        """A weak reference to `storage` (identity `sid`), one per storage, for an `Arg`
        to keep: it holds the identity as long as the `Arg` lives, and gives the storage
        back while it is alive (`resolve` replays a call with it)."""
        ref = self._kept.get(sid)
        if ref is None:
            ref = self._kept[sid] = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        return ref

    def alive(self) -> set[int]:
        """Identities of the written storages that are still alive."""
        refs, expired = self._held.refs, _EXPIRED
        return {sid for sid in self.writers if not expired(refs[sid])}

    def release(self) -> None:
        """Forget everything (the storages' identities may be reused from now on)."""
        self.writers.clear()
        self.handles.clear()
        self.values.clear()
        self.weight_writes.clear()
        self.copied.clear()
        self._held = _Held()
        self._kept.clear()
        self.before = None
        self._atoms = None
        self.strays.clear()
        self._log = None
        STRAYS.release(self)


def schema_name(func: Any) -> str:
    """An op's name with its overload, as the compiled tracker reports it too
    (`aten::mul_.Tensor`, `aten::copy_`)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return str(func)
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


_NUMBERS = (bool, int, float)
_INSIDE = ("torch.", "graphsafe._")

DERIVED_COPY = "aten::copy_ (computed from the weights)"
"""How the recording and both write trackers name a `copy_` into a weight of values
computed from the model's own weights (a post-load rewrite: `w.copy_(1 + w)`), told from
a copy of loaded values (`aten::copy_`) by what its source was computed from. The
compiled tracker (`tracker.cpp`) spells it the same."""


def ambiguous(value: object) -> bool:
    """Whether `value`'s identity does not tell it from an equal value made elsewhere
    (`bool`s and the `int`s Python keeps one object of)."""
    return type(value) is bool or (type(value) is int and -5 <= value <= 256)


def _mutated(func: Any) -> tuple[int, ...]:
    """Positions of the arguments `func` writes, by its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        i for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _is_view(func: Any) -> bool:
    """Whether `func` only returns views of its arguments and writes nothing (nothing to
    record: a view shares its base's storage and writer)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns or _mutated(func):
        return False
    return all(r.alias_info is not None for r in schema.returns)


_PLAIN = (int, float, bool, str, bytes, torch.dtype, torch.device, torch.Size)

_OPS: dict[int, tuple[Any, Any, bool]] = {}
"""`id` of an op -> (the op, what calling it runs, whether it only views: `_is_view`).
Keyed by identity, not by the op (whose `__hash__` is Python code), and checked against
the op held (the ops the dispatcher hands a mode live as long as the process)."""


def _op_entry(func: Any) -> tuple[Any, Any, bool]:
    """`_OPS`'s entry of `func`: an `OpOverload` is called through its `_op` (what its
    `__call__` runs), past the hook a recording sets on that `__call__` (`hooks`)."""
    entry = _OPS[id(func)] = (func, getattr(func, "_op", func), _is_view(func))
    return entry


class _OpInfo(NamedTuple):
    """What the recorder needs of an op's schema, read once per op."""

    view_free: bool
    """Its result is its argument for lineage (`_VIEW_FREE`)."""
    aten: bool
    """An op of aten (its non-tensor results are never handles)."""
    mutated: tuple[tuple[int, str], ...]
    """The arguments it writes: (position, name), by its schema."""
    schema_name: str
    """`schema_name(func)`."""

    @classmethod
    def of(cls, func: Any) -> _OpInfo:
        schema = getattr(func, "_schema", None)
        name = "" if schema is None else str(schema.name)
        mutated = tuple((pos, "" if schema is None else str(schema.arguments[pos].name))
                        for pos in _mutated(func))
        return cls(name in _VIEW_FREE, name.startswith("aten::"), mutated, schema_name(func))


_INFO: dict[int, tuple[Any, _OpInfo]] = {}
"""`id` of an op -> (the op, its `_OpInfo`), as `_OPS` is keyed."""


class Scopes:
    """What a recorder (of either kind) enters around its own recording, in order, and
    leaves in reverse, each even if the one before failed: the watch of threads nothing
    here started (first: the compiled build's first use checks itself with a thread of
    its own, which nothing follows); the hooks that see above the dispatcher (numbers the
    caller keeps, ops registered CompositeImplicitAutograd such as vLLM's
    `create_onednn_mm_handler`, parameters replaced); the following of threads and pool
    tasks started here."""

    __slots__ = ("_here", "_hooks", "_lineage", "_strays", "_weights", "_what")

    def __init__(self, recorder: Any) -> None:
        # Not the recorder itself: a recorder holds its scopes, and a cycle would keep it
        # (and what it holds) until a collection.
        self._lineage, self._weights = recorder.lineage, recorder.weights
        self._strays = STRAYS.enter(self._lineage, self._weights)
        self._hooks = Hooks.enter(recorder)
        self._what = weakref.ref(recorder)
        # A recorder that must not follow threads (a bring-up's tail: the threads the
        # caller starts then may live on, a pool's, a monitor's) leaves them to the watch
        # of threads not followed.
        self._here = (followed(recorder) if getattr(recorder, "follows", True)
                      else contextlib.nullcontext())
        self._here.__enter__()

    def exit(self, *, here: bool = True) -> None:
        """Leave them, in the thread that entered them (`here`) or from another."""
        try:
            self._here.__exit__(None, None, None)
        finally:
            try:
                Hooks.exit(self._hooks, self._what())
            finally:
                STRAYS.exit(self._strays, self._lineage, self._weights, here=here)


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every op run under it into `lineage` (see the module)."""

    def __init__(self, lineage: Lineage | None = None,
                 weights: frozenset[int] = frozenset()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.lineage = lineage if lineage is not None else Lineage()
        self.weights = weights
        """Storage keys of the model's weights: a write into one alone (the loader's
        `copy_`) is not recorded, since lineage stops at a weight."""

    def _arg(self, t: torch.Tensor) -> Arg:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return _new(Arg, (0, None, tuple(t.shape), tuple(t.stride()),
                              int(t.storage_offset()), t.dtype, None))
        sid = storage._cdata
        known = self.lineage.writers.get(sid)
        return _new(Arg, (sid, None if known is None else known[0], tuple(t.shape),
                          tuple(t.stride()), int(t.storage_offset()), t.dtype,
                          None if known is not None else self.lineage.kept(storage, sid)))

    def _note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        lineage = self.lineage
        held = _INFO.get(id(func))
        if held is None or held[0] is not func:
            held = _INFO[id(func)] = (func, _OpInfo.of(func))
        info = held[1]
        if info.view_free:
            self._handle_tensor(out)
            return
        # No closure here: a recursive one is a reference cycle, and would keep the
        # arguments alive (and `torch.utils.swap_tensors` refusing them) until a collection.
        # The arguments are converted inline (the hot path of a recorded load): `seen`
        # and `in_sids` are gathered as they go.
        in_sids: set[int] = set()  # of every tensor argument (0: one without storage)
        conv = self._conv_into
        call = Call(func, tuple([conv(a, in_sids) for a in args]),
                    {k: conv(v, in_sids) for k, v in kwargs.items()} if kwargs else {},
                    lineage.epoch)
        seen = bool(in_sids)
        writers = lineage.writers
        wrote: list[int | str] = []
        for pos, kw in info.mutated:
            where: int | str = pos
            if pos < len(args):
                t = args[pos]
            else:  # passed by keyword, as `out=` is
                where, t = kw, kwargs.get(kw)
            if isinstance(t, torch.Tensor) and not t.is_meta:
                wrote.append(where)
                storage = _storage(t)
                if storage is not None:
                    sid = storage._cdata
                    lineage.hold(storage, sid)
                    writers[sid] = (call, self._arg_written(t, sid))
                    if self.weights and _key(storage) in self.weights:
                        lineage.wrote_weight(sid, info.schema_name, call)
        call.mutated = tuple(wrote)
        aten = info.aten
        results = out if isinstance(out, (list, tuple)) else (out,)
        for i, r in enumerate(results):
            if isinstance(r, torch.Tensor):
                if r.is_meta or (storage := _storage(r)) is None:
                    continue
                sid = storage._cdata
                if sid in in_sids:  # a view of (or the mutated) argument
                    continue
                arg = self._arg_written(r, sid)
                call.outs[i] = arg
                lineage.hold(storage, sid)
                writers[sid] = (call, arg)
            elif aten or not seen:
                continue
            elif isinstance(r, int) and not isinstance(r, bool):
                call.opaque = True
                lineage.handles[r] = call
            elif r is not None and not isinstance(r, _PLAIN):
                # a handle of another kind: a ScriptObject, an object
                call.opaque = True
                lineage.keep(call, r)
        if (not aten and seen and isinstance(out, (list, tuple)) and out
                and not any(isinstance(r, torch.Tensor) for r in out)):
            call.opaque = True  # a list of handles kept as one (an op's int list)
            lineage.keep(call, out)
        if not seen and not call.outs and not info.mutated:
            return
        self._handle_tensor(out)

    def _dispatch(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _compiling():  # dynamo traces a compiled function: its ops are recorded as
            return func(*args, **kwargs)  # the compiled code runs them, not while tracing
        entry = _OPS.get(id(func))
        if entry is None or entry[0] is not func:
            entry = _op_entry(func)
        out = entry[1](*args, **kwargs)
        view = entry[2]
        if view and not self.lineage.handles:
            return out  # a view shares its base's storage and writer: nothing to record
        with _NO_FUNCTION_MODES():  # what the recorder reads of tensors is not recorded
            return self._after(func, args, kwargs, out, view)

    def _after(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
               view: bool) -> Any:
        if view:
            self._handle_tensor(out)  # `torch.tensor(<int>)` is a `lift_fresh`
            return out
        weights = self.weights
        if weights and func is _COPY and (dst := _storage(args[0])) is not None and _key(
                dst) in weights:
            self._copied_into(func, args, kwargs, out, dst._cdata)
            return out
        # A tensor without a storage (a wrapper subclass) has no lineage to follow.
        with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
            self._note(func, args, kwargs, out)
        return out

    def _copied_into(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     out: Any, written: int) -> None:
        """`copy_` into the weight whose storage is `written`: a load, or a rewrite."""
        src = args[1]
        lineage = self.lineage
        storage = _storage(src) if isinstance(src, torch.Tensor) else None
        sid = 0 if storage is None else storage._cdata
        if storage is not None and (
                sid in lineage.writers  # computed here: maybe a post-load rewrite
                or (lineage.foreign  # another model's weight
                    and _key(storage) in lineage.foreign)):
            with contextlib.suppress(RuntimeError, NotImplementedError, TypeError):
                self._note(func, args, kwargs, out)
        else:  # a weight loaded: what reads it stops there
            lineage.writers.pop(written, None)
            lineage.wrote_weight(written, _COPY_NAME, None)
        if storage is not None and src.shape == args[0].shape:
            lineage.hold(storage, sid)
            lineage.copied[sid] = written

    def __enter__(self) -> Recorder:
        self._scopes = Scopes(self)
        return super().__enter__()  # type: ignore[no-any-return,no-untyped-call]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            self._scopes.exit()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """dynamo compiles the functions a recorded load calls (without this it would
        skip them, and remember the skip): the mode is off while it compiles, and the
        ops the compiled code runs through the dispatcher are recorded."""
        return True

    def fork(self) -> Recorder:
        """A recorder into the same lineage, for a thread this one started."""
        return Recorder(self.lineage, self.weights)

    def took(self, func: Any, t: torch.Tensor, out: Any, frame: FrameType | None) -> None:
        """`func` (a `hooks.TAKEN` method, `tolist`, or a `hooks.NUMPY` one) returned `out`
        from `t` to the code of `frame`: the very numbers the caller keeps, or memory that
        leaves as a NumPy array."""
        lineage = self.lineage
        with _NO_FUNCTION_MODES():  # what the recorder reads of tensors is not recorded
            if func in NUMPY:  # what is made of the array is not followed
                lineage.unfollowed.append(Call(func, (self._conv(t),), {}, lineage.epoch))
                return
            arg = self._conv(t)
            if func is TOLIST:  # numbers read without any op: each element the caller keeps
                for i, number in enumerate(_leaves(out)):
                    lineage.keep(Call(Element(i), (arg,), {}, lineage.epoch), number)
            else:  # the number the caller gets (the dispatcher's is a copy)
                lineage.keep(Call(func, (arg,), {}, lineage.epoch), out)
            lineage.note_scope(frame)

    def returned(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        """`op`, called from Python, returned `out` (no tensor, no plain value): a handle,
        when an op of another library than aten took tensors (one registered
        CompositeImplicitAutograd never reaches the dispatch mode)."""
        if (not any(isinstance(a, torch.Tensor) for a in args)
                or str(op.name() if callable(getattr(op, "name", None)) else op
                       ).startswith("aten::")):
            return
        lineage = self.lineage
        with _NO_FUNCTION_MODES():
            call = Call(op, tuple(self._conv(a) for a in args),
                        {k: self._conv(v) for k, v in kwargs.items()}, lineage.epoch)
        call.opaque = True
        if isinstance(out, int):
            lineage.handles[out] = call  # made into a tensor: `torch.tensor(handle)`
        if id(out) not in lineage.values:  # the dispatch mode may have kept it
            lineage.keep(call, out)  # the object the caller keeps (an int too)

    def replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Parameter `new` was bound where `old` was."""
        self.lineage.note_replaced(old, new)

    def _conv_into(self, a: Any, sids: set[int]) -> Any:
        """`_conv`, adding the storage of each tensor argument (in a list too) to `sids`."""
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return None
            arg = self._arg(a)
            sids.add(arg.sid)
            return arg
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            conv = type(a)(self._conv(x) for x in a)
            sids.update(x.sid for x in conv if isinstance(x, Arg))
            return conv
        return a

    def _conv(self, a: Any) -> Any:
        """An argument as recorded: a tensor as its `Arg` (None for a meta tensor)."""
        if isinstance(a, torch.Tensor):
            return None if a.is_meta else self._arg(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(self._conv(x) for x in a)
        return a

    @staticmethod
    def _arg_written(t: torch.Tensor, sid: int) -> Arg:
        return _new(Arg, (sid, None, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()),
                          t.dtype, None))

    def _handle_tensor(self, out: Any) -> None:
        """A small int64 tensor holding an int an op returned: written by that op."""
        handles = self.lineage.handles
        if (not handles or not isinstance(out, torch.Tensor) or out.dtype != torch.int64
                or out.numel() > 4 or out.device.type != "cpu"):
            return
        for v in out.reshape(-1).tolist():
            call = handles.get(v)
            if call is not None:
                storage = _storage(out)
                if storage is not None:
                    sid = storage._cdata
                    self.lineage.hold(storage, sid)
                    self.lineage.writers[sid] = (call, self._arg_written(out, sid))
                return


_NO_FUNCTION_MODES = torch._C.DisableTorchFunction
_new = tuple.__new__
"""Makes an `Arg` from a tuple of its fields, as its `__new__` does (without a Python
frame: an `Arg` per tensor argument is the recorder's hot path)."""
_EXPIRED = torch.UntypedStorage._expired
_FREE = torch.UntypedStorage._free_weak_ref
_compiling = torch.compiler.is_compiling


class Element:
    """`Tensor.tolist()`'s `index`-th number (in the tensor's row-major order), as a call
    that takes it again from the tensor."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, t: torch.Tensor) -> object:
        return t.reshape(-1)[self.index].item()

    def __str__(self) -> str:
        return f"Tensor.tolist()[{self.index}]"


def _leaves(value: object) -> list[object]:
    """The numbers of `tolist()`'s nested lists, in order (one for a 0-d tensor)."""
    if not isinstance(value, list):
        return [value]
    out: list[object] = []
    stack = [value]
    while stack:
        top = stack.pop()
        if isinstance(top, list):
            stack.extend(reversed(top))
        else:
            out.append(top)
    return out


# Set after the class is made, so that TorchDispatchMode does not wrap it in a
# dynamo-disabling frame at every op (a load is never compiled).
Recorder.__torch_dispatch__ = Recorder._dispatch  # type: ignore[method-assign,assignment]
_COPY = torch.ops.aten.copy_.default
_COPY_NAME = "aten::copy_"


@contextlib.contextmanager
def record(lineage: Lineage | None = None) -> Iterator[Lineage]:
    """`native.record_lineage` with the Python recorder always (the reference the compiled one is
    held to)."""
    with Recorder(lineage) as rec:
        yield rec.lineage
