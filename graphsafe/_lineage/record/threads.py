"""What watches a thread follows the threads its code starts and the tasks it hands to
pools; what a recording cannot follow, it sees and names.

Dispatch modes and load trackers are per thread: a post-load step that packs its layers
in a thread pool would run unseen. While a thread is followed (a `Recorder` records it, a
`Load` tracks it), a thread it starts runs its whole `run`, and a task it submits to a
`concurrent.futures.ThreadPoolExecutor` (whenever that pool was made) runs, under a fork
of each: a recorder into the same lineage, a tracker whose writes join the load. The
hooks into `threading.Thread.start` and `ThreadPoolExecutor.submit` are installed while
any thread is followed, and removed when the last one ends; they act only for the
threads that are followed. A task torch's inter-op pool runs for a followed thread
(`torch.jit.fork` inside a scripted function: `at::launch`) carries the thread's dispatch
mode over, and is recorded.

Threads that no followed code starts are not followed: one that existed before the
recording and gets its work through a queue, a C++ library's own threads. While a
recording runs, the compiled build sees their ops (`Strays`, over `strays.cpp`): an op of
such a thread that reads or writes the recorded weights is noted by thread and op
(`Stray`), and what it computes from them is tainted with them, so that a tensor the
model holds that such a thread made is found with its sources (`Strays.tainted`). Without
the compiled build they are not seen, and the process is told so once (the process-wide
observer's warning, or the loader's).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import thread as _pool_thread
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

from graphsafe import _native

__all__ = ["STRAYS", "Stray", "Strays", "followed", "following", "remove_innermost"]

_LOCAL = threading.local()
_LOCK = threading.Lock()
_ACTIVE = [0]  # recordings running now, in every thread
_ORIGINAL: dict[str, Any] = {}


def _stack() -> list[Any]:
    stack: list[Any] | None = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


@contextmanager
def followed(watcher: Any) -> Iterator[None]:
    """`watcher` (with `fork()`: a context manager to run a started thread or a task
    under) watches this thread inside the block: threads and tasks started here follow
    it."""
    stack = _stack()
    stack.append(watcher)
    _install()
    try:
        yield
    finally:  # it may end in another thread, after others entered
        remove_innermost(stack, watcher)
        _uninstall()


def remove_innermost(stack: list[Any], item: Any) -> None:
    """Remove the innermost entry of `stack` that is `item` (by identity), whatever was
    entered after it."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is item:
            del stack[i]
            return


def following(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run under a fork of everything that watches this thread now (forked now,
    entered where `fn` runs; `fn` itself if nothing does)."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        return fn
    forks = [watcher.fork() for watcher in stack]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with ExitStack() as scopes:
            for fork in forks:
                scopes.enter_context(fork)
            return fn(*args, **kwargs)

    return run


def _install() -> None:
    with _LOCK:
        _ACTIVE[0] += 1
        if _ACTIVE[0] > 1:
            return
        _ORIGINAL["start"] = threading.Thread.start
        _ORIGINAL["submit"] = _pool_thread.ThreadPoolExecutor.submit
        threading.Thread.start = _start  # type: ignore[method-assign]
        _pool_thread.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign]


def _uninstall() -> None:
    with _LOCK:
        _ACTIVE[0] -= 1
        if _ACTIVE[0]:
            return
        threading.Thread.start = _ORIGINAL.pop("start")  # type: ignore[method-assign]
        _pool_thread.ThreadPoolExecutor.submit = _ORIGINAL.pop("submit")  # type: ignore[method-assign]


def _start(self: threading.Thread) -> None:
    # A pool's worker runs the tasks it is handed: `_submit` follows each of them.
    worker = getattr(self, "_target", None) is _pool_thread._worker
    if getattr(_LOCAL, "stack", None) and not worker:
        self.run = following(self.run)  # type: ignore[method-assign]
    _ORIGINAL.get("start", _THREAD_START)(self)


def _submit(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    return _ORIGINAL.get("submit", _POOL_SUBMIT)(self, following(fn), *args, **kwargs)


_THREAD_START = threading.Thread.start
_POOL_SUBMIT = _pool_thread.ThreadPoolExecutor.submit


class Stray(NamedTuple):
    """An op of a thread no recording followed that read or wrote recorded weights while
    a recording ran."""

    thread: str
    """The thread, as messages name it (`thread 'worker' (OS thread 1234)`)."""
    op: str
    """The op (`aten::t`)."""
    weights: tuple[int, ...]
    """The storage keys of the weights it read or wrote."""
    wrote: bool
    """Whether it wrote one of them."""


class Strays:
    """The ops of threads no recording follows, while recordings run (see the module).

    A recording is open from the first time its recorder is entered (with the weights'
    storage keys) until every recorder of it in every thread has left; while any is, the
    compiled callback watches the union of their weights. When one closes, what the
    callback noted is handed to each open or closing recording whose weights it touched
    (`lineage.strays`). Taints stay until no recording that watched is alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[Any, frozenset[int], int]] = {}
        """id(lineage) -> (the lineage, its weights' keys, recorders entered, not left)."""
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        """The lineages that watched and are not released."""
        self._watched: tuple[Any, frozenset[int]] = (None, frozenset())
        """The compiled module last handed keys, and those keys: it keeps them while its
        callback is stopped (a load's recording and then its tail's watch the same
        weights: a first load's thousands are not handed over again)."""

    def enter(self, lineage: Any, weights: frozenset[int]) -> _native.Native | None:
        """A recorder of `lineage` (recording the weights `weights`) begins in this thread:
        its ops are followed; the weights are watched in the threads that are not.
        Returns the compiled module to hand `exit` (None where there is none)."""
        native = _native.get()
        if native is None:
            return None
        native.strays_follow(True)
        if not weights:
            return native
        with self._lock:
            if not self._live:
                native.strays_forget()  # what recordings gone since noted
            self._live.add(lineage)
            entry = self._open.get(id(lineage))
            if entry is None:
                self._open[id(lineage)] = (lineage, weights, 1)
                self._apply(native)
            else:
                self._open[id(lineage)] = (lineage, entry[1] | weights, entry[2] + 1)
        return native

    def exit(self, native: _native.Native | None, lineage: Any, weights: frozenset[int],
             *, here: bool = True) -> None:
        """That recorder ended (`native`: what `enter` returned); the last of its
        lineage's takes what was noted. `here`: in the thread that entered it (else that
        thread stays followed: its ops are the recording's, not strays)."""
        if native is None:
            return
        if here:
            native.strays_follow(False)
        if not weights:
            return
        with self._lock:
            entry = self._open.get(id(lineage))
            if entry is None:
                return
            if entry[2] > 1:
                self._open[id(lineage)] = (entry[0], entry[1], entry[2] - 1)
                return
            del self._open[id(lineage)]
            takers = [(lineage, entry[1]), *((e[0], e[1]) for e in self._open.values())]
            for tid, op, keys, wrote in native.strays_reads():
                stray = Stray(_thread_name(tid), op, keys, wrote)
                for taker, watched in takers:
                    if not watched.isdisjoint(keys) and stray not in taker.strays:
                        taker.strays.append(stray)
            self._apply(native)

    def tainted(self) -> dict[int, tuple[tuple[int, ...], str]]:
        """Each storage still alive that a thread not followed computed from recorded
        weights -> (their keys, the last op)."""
        native = _native.get()
        return {} if native is None else native.strays_tainted()

    def release(self, lineage: Any) -> None:
        """`lineage` is forgotten: once no recording that watched is alive, neither is
        what threads not followed computed."""
        with self._lock:
            self._live.discard(lineage)
            if not self._live and not self._open:
                native = _native.get()
                if native is not None:
                    native.strays_forget()

    def _apply(self, native: _native.Native) -> None:
        """Watch the weights of the open recordings, or stop (under the lock)."""
        open_ = list(self._open.values())
        keys = open_[0][1] if len(open_) == 1 else frozenset().union(*(e[1] for e in open_))
        if not keys:
            native.strays_stop()
            return
        by, watched = self._watched
        if by is not native or (keys is not watched and keys != watched):
            native.strays_watch(keys)
            self._watched = (native, keys)
        native.strays_start()


STRAYS = Strays()
"""The process's."""


def _thread_name(tid: int) -> str:
    """How messages name the thread whose OS id is `tid`."""
    for t in threading.enumerate():
        if t.native_id == tid and not isinstance(t, threading._DummyThread):
            return f"thread {t.name!r} (OS thread {tid})"
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = ""
    named = f" {comm!r}" if comm else ""
    return f"a thread no Python code started{named} (OS thread {tid})"
