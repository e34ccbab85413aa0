"""Generator and async loaders driven step by step as one load.

A generator loader (or the generator a loading method returns) and an async loader's
coroutine are one `Load` over their whole run, but the load's tracker is on only while
the loader's own code runs: each step runs under `Load.running()`, and the code between
steps (the caller iterating the generator, the event loop's other tasks) does not. The
runtime's `Loads` drives them with `steps` and `awaited`.
"""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from typing import Any

from graphsafe._runtime.load import Load

__all__ = ["LoaderClosed", "awaited", "steps"]


class LoaderClosed(Exception):
    """A generator loader was closed before it ended (its caller sees GeneratorExit)."""


def steps(load: Load, inner: Generator[Any, None, Any]) -> Generator[Any, None, Any]:
    """Iterate a generator loader as part of `load`, each step under its tracker (the
    caller's code between steps is not); returns what it returns. Closed early:
    `LoaderClosed`."""
    while True:
        with load.running():
            try:
                item = next(inner)
            except StopIteration as stop:
                return stop.value
        try:
            yield item
        except GeneratorExit:
            inner.close()
            raise LoaderClosed("the loader was closed before it ended") from None


@types.coroutine
def awaited(load: Load, coro: Coroutine[Any, Any, Any]) -> Generator[Any, Any, Any]:
    """Drive an async loader's coroutine step by step as part of `load`, each step under
    its tracker; what it awaits is awaited outward (the event loop's other tasks run
    untracked meanwhile). Returns what it returns; raises what it raises, or what was
    thrown into it and it did not handle (a cancellation)."""
    sent: Any = None
    thrown: BaseException | None = None
    while True:
        with load.running():
            try:
                future = coro.send(sent) if thrown is None else coro.throw(thrown)
            except StopIteration as stop:
                return stop.value
        sent, thrown = None, None
        try:
            sent = yield future
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # thrown in by the event loop: the loader's turn
            thrown = exc
