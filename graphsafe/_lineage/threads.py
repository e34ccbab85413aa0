"""What watches a thread follows the threads its code starts and the tasks it hands to
pools.

Dispatch modes and load trackers are per thread: a post-load step that packs its layers
in a thread pool would run unseen. While a thread is followed (a `Recorder` records it, a
`Load` tracks it), a thread it starts runs its whole `run`, and a task it submits to a
`concurrent.futures.ThreadPoolExecutor` (whenever that pool was made) runs, under a fork
of each: a recorder into the same lineage, a tracker whose writes join the load. The
hooks into `threading.Thread.start` and `ThreadPoolExecutor.submit` are installed while
any thread is followed, and removed when the last one ends; they act only for the
threads that are followed. Threads that no Python code starts (a C++ library's own pool)
are not followed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import thread as _pool_thread
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["followed", "following"]

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
    finally:
        stack.pop()
        _uninstall()


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
