"""The process-wide write observer: writes into pinned models' storages outside any load.

A tracked load sees the writes of its own thread, and version counters see writes
through the tensor a derivation reads. What neither sees still reaches the dispatcher:
`p.data.copy_(w)` in a script, the steps of fused optimizers (`AdamW(..., fused=True)`
writes the parameters without moving their versions), writes in threads a loader
starts. While any model is pinned, the compiled build (`observer.cpp`) notes every write
into a storage its derivations read or write, in every thread, except in tracked loads
(which record their own writes) and in graphsafe's own refreshes (`quiet`). It sees
them through kernels at ADInplaceOrView, where torch bumps versions, which only the ops
that write pay; where a watched tensor was made in inference mode (such tensors skip
that key), on torch before 2.10, or with `GRAPHSAFE_OBSERVER=callback`, through a
global RecordFunction callback, which every op pays. The last unpin takes the kernels
back where no other thread runs (`_native.only_thread`); else they stay, idle, since
taking one back under a thread that dispatches its op is not safe. The journal takes
the writes in (`Journal.sync`, which the witnesses call before they compare or record
epochs) as written by "<op> outside any tracked load (seen by the process-wide write
observer)": a guarded replay then raises `StaleError` naming the input and the op, or
repairs with `on_stale="refresh"`. Since the drain runs before a refresh records its
witnesses, a write seen before a refresh is one that refresh read.

`GRAPHSAFE_OBSERVER=0` (or `gs.observe_writes(False)`) turns it off. Without the compiled
build there is none, since dispatch modes are per thread: with `GRAPHSAFE_NATIVE=0` the
first pin says so, once; where the build failed, the loader's one warning has said it.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Set
from types import TracebackType

import torch

from graphsafe import _native
from graphsafe._errors import GraphSafetyWarning
from graphsafe._memory.journal import JOURNAL, Journal
from graphsafe._memory.walk import storage_key

__all__ = ["BLIND", "HOW", "OBSERVER", "Observer", "Quiet", "observe_writes", "quiet"]

HOW = "{op} outside any tracked load (seen by the process-wide write observer)"
"""How the journal names an observed write, for messages."""

BLIND = (
    "writes the process-wide write observer may have missed (torch's RecordFunction was "
    "turned off while it observed through its callback)"
)

_NO_KERNELS = (
    "graphsafe's process-wide write observer could not place its kernels ({why}): it "
    "observes through a RecordFunction callback instead, which sees the same writes but "
    "costs every op of the process while a model is pinned, not only the ops that write"
)

_UNAVAILABLE = (
    "graphsafe's process-wide write observer needs the compiled build, which is not "
    "loaded here: writes into pinned models outside tracked loads that move no version "
    "counter (`p.data.copy_(w)` in a script, fused optimizer steps, threads a loader "
    "starts) go unseen; and so do the ops of threads a recorded bring-up does not follow "
    "(one that existed before it and gets work through a queue, a C++ library's own "
    "threads): what they derive from the weights is neither discovered nor said. Unset "
    "GRAPHSAFE_NATIVE (the first use then builds it, or run "
    "`graphsafe native build`), or declare such writes with gs.mark_written(...)"
)


class Observer:
    """The storages pinned runtimes watch, and the compiled observer that watches them.

    A pin's release may run in a garbage-collection finalizer (a dropped graph), at any
    allocation of any thread, the journal's own code included: `unwatch` therefore never
    waits for a lock and never writes the journal. It stops the callback when the lock is
    free (else the holder does, before it lets go), and what the callback saw until then
    waits in `_taken` for the next `sync`, which the journal runs before any witness
    reads an epoch.

    Args:
        journal: Where observed writes are recorded.
    """

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._lock = threading.Lock()
        self._watched: dict[int, dict[int, torch.UntypedStorage]] = {}
        """Per watching runtime (by id): storage key -> its storage, held while watched
        (so that no other tensor takes its address)."""
        self._inference: set[int] = set()
        """The watching runtimes (by id) that watch a tensor made in inference mode, which
        the kernels cannot see written: the callback observes while there is one."""
        self.door: str | None = None
        """How it observes now: "kernels", "callback", or None (it does not)."""
        self._finalizers: dict[int, weakref.finalize[[int], object]] = {}
        self._gone: list[int] = []  # watchers unpinned or collected, dropped at `_settle`
        # (written, blind, storages watched then) drained from the callback, not yet
        # recorded in the journal.
        self._taken: list[tuple[dict[int, str], bool, dict[int, torch.UntypedStorage]]] = []
        self._draining = False  # between a drain and its journal entries
        self._native: _native.Native | None = None  # the module observing, while it does
        self.lib: _native.Native | None = None
        """The module the observer first ran in (quiet scopes count there), or None."""
        self.enabled, self.by_callback = _from_env()
        """Whether it observes while a model is pinned; whether through the callback
        alone (`GRAPHSAFE_OBSERVER=callback`), not the kernels."""
        self._warned = False

    @property
    def running(self) -> bool:
        """Whether the callback observes now."""
        return self._native is not None

    def watch(
        self, owner: object, keys: Set[int], tensors: Callable[[], Iterable[torch.Tensor]]
    ) -> None:
        """Watch the storages `keys` for `owner` (a pinned runtime), replacing what it
        watched; `tensors()` gives them (the model's tensors; others are skipped)."""
        storages = {}
        inference = False
        for t in tensors():
            key = storage_key(t)
            if key in keys:
                storages[key] = t.untyped_storage()
                inference = inference or t.is_inference()
        token = id(owner)
        with self._lock:
            self._take()
            self._forget_gone()
            if token not in self._finalizers:
                self._finalizers[token] = weakref.finalize(owner, self._gone.append, token)
            self._watched[token] = storages
            if inference:
                self._inference.add(token)
            else:
                self._inference.discard(token)
            self._apply()
            self._flush()
        self._settle()

    def unwatch(self, owner: object) -> None:
        """Stop watching what `owner` watched (its last pin was released); safe in a
        finalizer (see the class)."""
        finalizer = self._finalizers.pop(id(owner), None)
        if finalizer is not None:
            finalizer.detach()
        self._gone.append(id(owner))
        self._settle()

    def set_enabled(self, enabled: bool) -> bool:
        """Turn the observer on or off (off: what it saw so far is still recorded);
        returns whether it was on."""
        with self._lock:
            was = self.enabled
            self._take()
            self.enabled = enabled
            self._apply()
            self._flush()
        self._settle()
        return was

    def sync(self) -> None:
        """Record what the callback saw in the journal (`Journal.sync` while it runs, or
        while something it saw is not recorded): one compiled call when nothing is."""
        native = self._native
        if self._taken or self._draining or (native is not None and native.observer_pending()):
            with self._lock:  # a drain under way in another thread is waited for
                self._take()
                self._flush()
            self._settle()

    def _settle(self) -> None:
        """Drop the watchers that are gone, if the lock is free (its holder calls this
        again once it let go); never waits, never writes the journal."""
        while self._gone and self._lock.acquire(blocking=False):
            try:
                self._take()  # with the storages watched until now
                self._forget_gone()
                self._apply()
            finally:
                self._lock.release()

    def _forget_gone(self) -> None:
        while self._gone:
            token = self._gone.pop()
            self._finalizers.pop(token, None)
            self._watched.pop(token, None)
            self._inference.discard(token)

    def _apply(self) -> None:
        """Start, update or stop observing what is watched now (under the lock): through
        the kernels, or the callback while a tensor made in inference mode is watched."""
        keys = {key for storages in self._watched.values() for key in storages}
        native = self._native
        if not keys or not self.enabled:
            if native is not None:
                native.observer_stop(_native.only_thread())
                self._take()  # what it saw up to the stop
                native.observer_watch(())
                self._native = None
                self.door = None
                if not self._taken:
                    self._journal.set_drain(None)
            return
        if native is None:
            native = _native.get()
            if native is None:
                self._warn()
                return
        native.observer_watch(keys)
        callback = self.by_callback or bool(self._inference)
        if self._native is None or (self.door == "callback") != callback:
            try:
                self.door = native.observer_start(callback, _native.only_thread())
            except RuntimeError as exc:  # the dispatcher refused a kernel: the callback
                warnings.warn(_NO_KERNELS.format(why=exc), GraphSafetyWarning, stacklevel=5)
                self.door = native.observer_start(True, _native.only_thread())
            self._native = self.lib = native
            self._journal.set_drain(self.sync)

    def _storages(self) -> dict[int, torch.UntypedStorage]:
        """Every storage watched now, by key."""
        return {k: s for watched in self._watched.values() for k, s in watched.items()}

    def _take(self) -> None:
        """Drain the callback into `_taken` (under the lock)."""
        native = self._native
        if native is None:
            return
        self._draining = True  # a sync that finds nothing pending waits for this
        try:
            written, blind = native.observer_drain()
            if written or blind:
                self._taken.append((written, blind, self._storages()))
        finally:
            self._draining = False

    def _flush(self) -> None:
        """Record `_taken` in the journal (under the lock, never in a finalizer)."""
        self._draining = True
        try:
            while self._taken:
                written, blind, storages = self._taken[0]
                if blind:
                    self._journal.advance(storages, BLIND, storages.get)
                by_op: dict[str, list[int]] = {}
                for key, op in written.items():
                    by_op.setdefault(op, []).append(key)
                for op, keys in by_op.items():
                    self._journal.advance(keys, HOW.format(op=op), storages.get)
                del self._taken[0]
        finally:
            self._draining = False
        if self._native is None:
            self._journal.set_drain(None)

    def _warn(self) -> None:
        # Where the compiled build could not be built or loaded, the loader's one warning
        # of the process has said this already; this one is for `GRAPHSAFE_NATIVE=0`.
        if not self._warned and not _native.announced():
            self._warned = True
            warnings.warn(_UNAVAILABLE, GraphSafetyWarning, stacklevel=5)


def _from_env() -> tuple[bool, bool]:
    """`GRAPHSAFE_OBSERVER`: off for 0, off, false or no; through the callback alone for
    callback; on otherwise (the default). Returns (on, through the callback)."""
    value = os.environ.get("GRAPHSAFE_OBSERVER", "1").strip().lower()
    return value not in ("0", "off", "false", "no"), value == "callback"


OBSERVER = Observer(JOURNAL)
"""The process-wide observer, recording into the process-wide journal."""


def observe_writes(enabled: bool) -> bool:
    """Turn the process-wide write observer on or off (on by default; the environment
    variable `GRAPHSAFE_OBSERVER=0` starts a process with it off).

    While on and any model is pinned (a guarded graph was captured), every write into a
    storage the pinned models' derivations read or write is seen, in every thread, even
    where no version counter moves (`p.data.copy_(w)` in a script, fused optimizer
    steps): a guarded replay raises `StaleError` naming it, or repairs it with
    `on_stale="refresh"`. It needs the compiled build (`graphsafe native build`). Off,
    such writes are seen only when declared with `gs.mark_written`; what it saw before
    it was turned off is still recorded.

    Args:
        enabled: Whether to observe.

    Returns:
        Whether it was on, to restore it.

    Examples:
        >>> import graphsafe as gs
        >>> was = gs.observe_writes(False)  # e.g. to measure what it costs
        >>> _ = gs.observe_writes(was)
    """
    return OBSERVER.set_enabled(bool(enabled))


class Quiet:
    """A scope of this thread whose writes the observer skips: graphsafe's own writes
    (a refresh writing derived buffers), which are not writes outside a load. Cheap
    enough to enter per refresh: one compiled call each way once the observer has run,
    none before."""

    __slots__ = ("_native",)

    def __init__(self) -> None:
        self._native: _native.Native | None = None

    def __enter__(self) -> None:
        native = self._native = OBSERVER.lib
        if native is not None:
            native.observer_quiet(True)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._native is not None:
            self._native.observer_quiet(False)


quiet = Quiet
"""`with quiet():` skips this thread's writes (see `Quiet`)."""
