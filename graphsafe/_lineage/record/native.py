"""The compiled recorder: the `Lineage` a `Recorder` fills, without Python per op.

Where the compiled checks are built, a recording runs `NativeRecorder`: a thread-local
RecordFunction callback (`graphsafe/_native/recorder.cpp`) notes, per op, what the
dispatch mode would (the op as the dispatch mode sees it, its arguments with tensors
reduced to their storage's identity, geometry and latest writer, what it wrote), keeps
only the ops that wrote something, and builds the `Call`s and `Arg`s from them in one
pass, in C++ too (`_Log.apply`): when the recording ends, and before each hook (`hooks`:
a number taken, a handle returned from Python, a parameter replaced) hands its result to
the Python recorder's own notes, which read the writers the records up to then set. A
recording of 8,700 ops of which 3,600 wrote builds 3,600 records, and takes no Python
call per op.

The Python `Recorder` stays the reference, and what runs where the compiled checks are
not (`GRAPHSAFE_NATIVE=0`) or `NATIVE_RECORDER` is off.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphsafe import _native
from graphsafe._errors import GraphSafetyWarning
from graphsafe._lineage.record.hooks import NUMPY
from graphsafe._lineage.record.recorder import RECORDING, Arg, Call, Lineage, Recorder, Scopes

__all__ = ["NATIVE_RECORDER", "NativeRecorder", "record_lineage", "recorder", "recording"]

NATIVE_RECORDER = [True]
"""Whether a recording runs the compiled recorder where the compiled checks are built
(an internal switch: the Python `Recorder` is the reference it is compared with)."""


class _Unrecordable:
    """Stands for an argument the compiled recorder cannot hand back (a generator): a
    call with it is never replayed (calling an op with it raises `TypeError`)."""

    def __repr__(self) -> str:
        return "<an argument not recorded>"


_UNRECORDABLE = _Unrecordable()
_FREE = torch.UntypedStorage._free_weak_ref
_FUNCS: dict[int, tuple[Any, str]] = {}
"""An op's index in the compiled recorder's table -> (the `OpOverload`, its schema name)."""
_SET_UP: list[bool] = []


class _Log:
    """One lineage's compiled recording, and the calls built from its records so far
    (by record index; None for a load), with the calls Python made whose int results
    are handles (`externals`, written -2 - i in the records)."""

    __slots__ = ("calls", "externals", "id", "lock", "native")

    def __init__(self, native: _native.Native) -> None:
        self.native = native
        self.id: int = native.recorder_new()
        self.calls: list[Call | None] = []
        self.externals: list[Call] = []
        self.lock = threading.Lock()

    def __del__(self) -> None:
        # Closed first: a thread that still has it pushed (a bring-up's tail, left in the
        # thread that loaded) records nothing more into it, and drops it.
        self.native.recorder_close((self.id, True))
        self.native.recorder_free(self.id)

    def apply(self, lineage: Lineage) -> None:
        """Build what the records since the last call say into `lineage` (in C++: a
        `Call` per record of an op, an `Arg` per tensor, each into the dicts the Python
        recorder fills, as it fills them)."""
        with self.lock:
            self.native.recorder_apply((
                self.id, self.calls, self.externals, lineage.writers, lineage._held.refs,
                lineage._kept, lineage.weight_writes, lineage.copied, lineage.handles, Call,
                Arg, StorageWeakRef, _FREE, _FUNCS, self._func))

    def _func(self, index: int) -> tuple[Any, str]:
        """The op of index `index` in the compiled recorder's table, and its schema name
        (looked up once per op: `_FUNCS`)."""
        qualified, overload = self.native.recorder_op(index)
        ns, _, name = qualified.partition("::")
        func = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
        found = _FUNCS[index] = (func, f"{qualified}.{overload}" if overload else qualified)
        return found


class NativeRecorder:
    """Records every op run in its block (this thread, and the threads it starts) into
    `lineage`, with the compiled recorder (see the module); `weights` as
    `Recorder.weights`."""

    def __init__(self, native: _native.Native, lineage: Lineage | None = None,
                 weights: frozenset[int] = frozenset()) -> None:
        self.lineage = lineage if lineage is not None else Lineage()
        self.weights = weights
        self._native = native
        # What the hooks hand over is noted as the Python recorder notes it, over the
        # writers the records up to then set (it is never entered as a dispatch mode).
        self._notes = Recorder(self.lineage, weights)
        log = self.lineage._log
        if log is None or log.native is not native:
            log = self.lineage._log = _Log(native)
        self._log: _Log = log
        self._scopes: Scopes | None = None  # entered by `__enter__`, left once
        self.follows = True
        """Whether threads and pool tasks started while it records are recorded too (see
        `threads.followed`)."""
        self.numpy = True
        """Whether weights read as NumPy arrays are noted (`Lineage.unfollowed`): not by
        a bring-up's tail, which records the caller's own code as well (a weight looked
        at through NumPy is as often inspection as derivation)."""
        self.closed = False
        """Set by `drop` (maybe from a finalizer, before the hooks are left): what the
        hooks hand over is not noted any more."""

    def __enter__(self) -> NativeRecorder:
        self._scopes = Scopes(self)
        self._native.recorder_push(
            (self._log.id, self.weights, self.lineage.foreign, self.lineage.epoch))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._scopes is None:  # left already (`drop`, `detach`)
            return
        try:
            if not self._native.recorder_pop(self._log.id):
                warnings.warn(
                    "graphsafe's compiled recorder missed ops of this recording (RecordFunction "
                    "was turned off, or an op could not be noted): what the load derived from "
                    "its weights may go undiscovered and unguarded; run it with "
                    "GRAPHSAFE_NATIVE=0 to record with the Python recorder",
                    GraphSafetyWarning, stacklevel=2)
            self._log.apply(self.lineage)
        finally:
            self._leave(here=True)

    def limit(self, records: int) -> None:
        """Keep at most `records` records from now on: then it records nothing more
        (`capped` says so)."""
        self._native.recorder_limit((self._log.id, records))

    @property
    def capped(self) -> bool:
        """Whether its `limit` stopped it."""
        return bool(self._native.recorder_close((self._log.id, False)))

    def close(self, *, pop: bool = False) -> None:
        """From any thread, even a finalizer: the compiled callback records nothing more
        into its lineage (the threads that pushed it drop it at their next push or pop;
        `pop`: this one, which pushed it, now)."""
        self._native.recorder_close((self._log.id, True))
        if pop:
            self._native.recorder_pop(self._log.id)

    def drop(self, *, here: bool) -> None:
        """Stop, for a lineage no one will read (its model is gone): nothing applied; the
        hooks and the following of threads it entered left (`here`: in the thread that
        entered it, which stops recording now; from another, that thread's callback
        stops at its next push or pop). Once, whichever of `__exit__`, `drop` and
        `detach` comes first."""
        self.closed = True
        self.close(pop=here and self._scopes is not None)
        self._leave(here=here)

    def detach(self) -> None:
        """Leave it from a thread other than the one that entered it: the records so far
        applied, the hooks and the following of threads it entered left; the compiled
        callback records on in that thread until the lineage is released (it is closed
        then) or its `limit`."""
        if self._scopes is None:
            return
        self._log.apply(self.lineage)
        self._leave(here=False)

    def _leave(self, *, here: bool) -> None:
        scopes, self._scopes = self._scopes, None
        if scopes is not None:
            scopes.exit(here=here)

    def fork(self) -> NativeRecorder:
        """A recorder into the same lineage, for a thread this one started."""
        return NativeRecorder(self._native, self.lineage, self.weights)

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """The records so far applied; the ops the notes run are not recorded."""
        self._log.apply(self.lineage)
        self._native.recorder_quiet(True)
        try:
            yield
        finally:
            self._native.recorder_quiet(False)

    def took(self, func: Any, t: torch.Tensor, out: Any, frame: FrameType | None) -> None:
        """As `Recorder.took` (nothing once its `limit` or `drop` stopped it)."""
        if self.closed or self.capped or (func in NUMPY and not self.numpy):
            return
        with self._quiet():
            self._notes.took(func, t, out, frame)

    def returned(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        """As `Recorder.returned`; an int handle it notes is told to the compiled
        recorder (a small tensor made of it is written by that call). Nothing once its
        `limit` or `drop` stopped it."""
        if self.closed or self.capped:
            return
        with self._quiet():
            handles = self.lineage.handles
            before = handles.get(out) if isinstance(out, int) else None
            self._notes.returned(op, args, kwargs, out)
            if isinstance(out, int) and (call := handles.get(out)) is not before and call:
                log = self._log
                log.externals.append(call)
                self._native.recorder_handle(
                    (log.id, out, -1 - len(log.externals)))

    def replaced(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Parameter `new` was bound where `old` was (not noted once its `limit`
        stopped it)."""
        if not (self.closed or self.capped):
            self.lineage.note_replaced(old, new)


def recorder(lineage: Lineage | None = None, weights: frozenset[int] = frozenset()
             ) -> Recorder | NativeRecorder:
    """A recorder into `lineage`: the compiled one where the compiled checks are built
    (and `NATIVE_RECORDER` is on), else the Python one."""
    native = _native.get() if NATIVE_RECORDER[0] else None
    if native is None or not hasattr(native, "recorder_new"):
        return Recorder(lineage, weights)
    if not _SET_UP:
        native.recorder_setup(_UNRECORDABLE)
        _SET_UP.append(True)
    return NativeRecorder(native, lineage, weights)


def recording(
    lineage: Lineage, weights: frozenset[int] = frozenset()
) -> contextlib.AbstractContextManager[object]:
    """What a recording load runs its loader's code under: a recorder into `lineage`
    (`weights`: see `Recorder.weights`), unless recording is off."""
    if RECORDING[0] != "off":
        return recorder(lineage, weights)
    return contextlib.nullcontext()


@contextlib.contextmanager
def record_lineage(lineage: Lineage | None = None) -> Iterator[Lineage]:
    """Record the lineage of every op run in the block (this thread), for a model not
    known yet: an engine's first load and post-load step. Hand the result to
    `gs.runtime(model).adopt_lineage(lineage)` once the model exists.

    Examples:
        >>> from graphsafe._lineage.record.recorder import sid_of
        >>> w = torch.ones(2, 2)
        >>> with record_lineage() as lin:
        ...     packed = w.t().contiguous()
        >>> sid_of(packed) in lin.writers
        True
    """
    rec = recorder(lineage)
    with rec:
        yield rec.lineage
