"""The bring-up: what a model's forwards make from its weights between its first load and
its first capture.

Engines make state outside any load: a kernel that packs its weight on first use (during
the profile or dummy run, the warm-up), a per-layer cache keyed by the weight's identity.
A `Window` keeps the first load's recording open over every forward of the root module
until the model's first capture ends (or it is pinned without one of graphsafe's graphs:
an engine pins once its own graphs are captured), until a later load begins (the
bring-up is over), or for `FORWARDS` forwards at most (a model no graph ever captures
must not pay a dispatch mode on every op of every forward). Each forward is an epoch of its own
(`Lineage.epoch`). When the window closes, a tensor the model holds whose last writer ran
in an earlier forward, computed from the weights, was made lazily and is kept: it is
discovered like what the load made. One written again by the last forward (the capture,
or a step that recomputes it every time) is part of what each forward computes: a graph
recomputes it on every replay, and it is not discovered.

A forward that dynamo compiles is not recorded (its hooks run at trace time only), nor
is one in a thread other than the one that runs it: each thread enters its own recorder.

Between the first load's end and the model's first forward, the thread that ran the load
stays recorded (`Tail`): a post-load step the engine runs after the load returned (vLLM's
loader calls `process_weights_after_loading` after `load_weights`; a model whose
`load_weights` alone graphsafe wraps) is recorded like one inside it, and what it derives
from the weights is discovered, by the load's own rules, when the first forward begins
(or the window closes, or `discovered` or the audit is read: then with what it recorded
so far). A thread records one tail at a time: a later model's first load ends the tail
of the one before (a model loaded and never run, a test's, must not leave its thread
recording). Only the compiled recorder records a tail (a dispatch mode left on a thread
between calls would stack under whatever the caller enters next; the Python path says so
in its one warning). It does not follow the threads started meanwhile (an engine's
own, a pool's, which may live on): what they read of the weights is named by the watch
of threads not followed, and what they leave where the model holds it is found by its
taint, as for any such thread. It records `TAIL_RECORDS` ops at most (a model that is loaded and
then used without a forward of its own must not pay for a recording forever). Where the
first forward runs in another thread, the tail's records so far are settled there; the
loading thread's compiled callback records on into the lineage, and stops when the
window closes.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from graphsafe._errors import GraphSafetyWarning
from graphsafe._lineage.record.native import NativeRecorder, recorder
from graphsafe._lineage.record.recorder import RECORDING, Call, Lineage, Recorder
from graphsafe._lineage.resolve import sources_of

__all__ = ["FORWARDS", "TAIL_EPOCH", "TAIL_RECORDS", "Tail", "Window", "end_here", "sweep"]

FORWARDS = 64
"""The most forwards a bring-up records (an engine's profile run, its warm-ups, one
capture per batch size)."""

TAIL_EPOCH = -1
"""The epoch of what a tail records (`Lineage.epoch`): neither the load's (0) nor a
forward's (1 on)."""

TAIL_RECORDS = 250_000
"""The most ops that wrote something a bring-up's tail records (a post-load step of a
model of thousands of layers and experts runs tens of thousands)."""


class Tail:
    """The first load's recording, continued in the thread that ran it until the model's
    first forward (see the module). Entered when made, where the compiled recorder runs
    (`active` says whether it records)."""

    __slots__ = ("_fed", "_finalizer", "_mark", "_model", "_recorder", "_thread",
                 "_weights", "lineage")

    def __init__(self, model: nn.Module, lineage: Lineage, weights: frozenset[int]) -> None:
        self.lineage = lineage
        self._thread = threading.get_ident()
        self._model = weakref.ref(model)
        self._weights: set[int] | None = None  # the weights' storage identities, when asked
        self._fed: set[int] = set()  # the calls it recorded that the weights reach (ids)
        rec = recorder(lineage, weights) if RECORDING[0] != "off" else None
        self._recorder = rec if isinstance(rec, NativeRecorder) else None
        self._mark = self._size()
        sweep()
        if self._recorder is not None:
            lineage.epoch = TAIL_EPOCH  # until `end`
            self._recorder.numpy = False  # see `NativeRecorder.numpy`
            # Threads the caller starts now may live on (an engine's, a pool's): left to
            # the watch of threads not followed, which names what they read of the weights.
            self._recorder.follows = False
            self._recorder.limit(TAIL_RECORDS)
            self._recorder.__enter__()
            # A model dropped before its first forward: its tail records nothing more
            # from then on, and is left at the next `sweep` (a finalizer runs wherever a
            # collection does: inside the recorder's own code, under its locks).
            self._finalizer = weakref.finalize(model, Tail._orphan, self._recorder,
                                               self._thread)

    @property
    def active(self) -> bool:
        """Whether it records (until `end`)."""
        return self._recorder is not None

    def _size(self) -> tuple[int, ...]:
        """How much the lineage holds: grown since the last mark, the tail recorded."""
        lin = self.lineage
        log = lin._log
        return (len(log.calls) if log is not None else 0, len(lin.values),
                sum(map(len, lin.values.values())), len(lin.handles), len(lin.replaced),
                sum(map(len, lin.weight_writes.values())), len(lin.unfollowed),
                len(lin.strays))

    def grew(self) -> bool:
        """The records so far applied: whether the lineage grew since the last call (or
        the tail's start) by anything the weights may reach (an op none of whose inputs
        they reach, `torch.ones(...)`, makes nothing to discover)."""
        rec = self._recorder
        if rec is not None:
            rec._log.apply(self.lineage)
        size, mark = self._size(), self._mark
        self._mark = size
        if size[1:] != mark[1:]:  # numbers, handles, replaced parameters: few, all looked at
            return True
        log = self.lineage._log
        return log is not None and self._reached(log.calls[mark[0]:size[0]])

    def _reached(self, calls: list[Call | None]) -> bool:
        """Whether the weights reach any of `calls` (in the order they ran): through an
        argument that is a weight, or that the load or a call they reach wrote."""
        weights = self._weights
        if weights is None:
            model = self._model()
            weights = self._weights = set() if model is None else set(sources_of(model))
        fed, reached = self._fed, False
        for call in calls:
            if call is not None and any(
                    a.sid in weights or (a.writer is not None and (
                        a.writer.epoch != TAIL_EPOCH or id(a.writer) in fed))
                    for a in call.reads()):
                fed.add(id(call))
                reached = True
        return reached

    def end(self) -> bool:
        """Stop recording (from any thread); returns whether its limit stopped it
        first."""
        rec, self._recorder = self._recorder, None
        if rec is None:
            return False
        if self.lineage.epoch == TAIL_EPOCH:
            self.lineage.epoch = 0  # the first forward's is 1
        self._finalizer.detach()
        if rec.closed:  # its model was dropped: `sweep` leaves it
            return False
        capped = rec.capped
        Tail._stop(rec, self._thread)
        return capped

    @staticmethod
    def _stop(rec: NativeRecorder, thread: int) -> None:
        if threading.get_ident() == thread:
            rec.__exit__(None, None, None)
        else:
            rec.detach()

    @staticmethod
    def _orphan(rec: NativeRecorder, thread: int) -> None:
        rec.closed = True  # the hooks hand it nothing more
        # The compiled callback records nothing more into it, and in this thread is gone
        # now (C++ alone: no lock Python code may hold while a collection runs).
        rec.close(pop=threading.get_ident() == thread)
        _ORPHANS.append((rec, thread))


_HERE = threading.local()
"""The window whose tail this thread records (`window`: a weak reference)."""

_ORPHANS: list[tuple[NativeRecorder, int]] = []
"""The tails of models dropped before their first forward, not left yet."""


def end_here() -> None:
    """End the tail this thread records, if any (`Window.end_tail`)."""
    ref = getattr(_HERE, "window", None)
    window = ref() if ref is not None else None
    if window is not None:
        window.end_tail()
    sweep()


def sweep() -> None:
    """Leave the tails of models dropped before their first forward (see `Tail`):
    each is dropped where its thread is this one, detached from elsewhere."""
    here = threading.get_ident()
    while _ORPHANS:
        rec, thread = _ORPHANS.pop()
        rec.drop(here=thread == here)


class Window:
    """The recording of a model's forwards until its first capture ends (see the module).

    Args:
        model: The root module (held by the hooks it installs, which `close` removes).
        lineage: The first load's recording, continued.
        weights: Storage keys of the model's weights (see `Recorder.weights`).
        full: Called when the `FORWARDS`-th forward ended (the owner closes it).
    """

    __slots__ = ("__weakref__", "_full", "_handles", "_local", "_settle_tail", "closed",
                 "lineage", "tail", "weights")

    def __init__(self, model: nn.Module, lineage: Lineage, weights: frozenset[int],
                 full: Callable[[], None], settle_tail: Callable[[Lineage], None]) -> None:
        self.lineage = lineage
        self.weights = weights
        self.closed = False
        self._full = full  # called once the last forward it records has ended
        self._settle_tail = settle_tail  # what the tail recorded is taken as the load's
        self._local = threading.local()
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after, always_call=True),
        ]
        earlier = getattr(_HERE, "window", None)
        earlier = earlier() if earlier is not None else None
        if earlier is not None:  # one tail per thread: a later bring-up ends the last one
            earlier.end_tail()
        tail = Tail(model, lineage, weights)
        self.tail = tail if tail.active else None
        if self.tail is not None:
            _HERE.window = weakref.ref(self)

    def flush_tail(self) -> None:
        """What the tail recorded so far is settled (it records on)."""
        tail = self.tail
        if tail is not None and tail.grew():
            self._settle_tail(self.lineage)

    def end_tail(self) -> None:
        """The tail ends (the first forward, the window's close): what it recorded since
        the last flush is settled."""
        tail, self.tail = self.tail, None
        if tail is None:
            return
        here = getattr(_HERE, "window", None)
        if here is not None and here() is self:
            _HERE.window = None
        capped = tail.end()
        if tail.grew():
            self._settle_tail(self.lineage)
        if capped:
            warnings.warn(
                f"graphsafe stopped recording the bring-up outside its loads and forwards "
                f"after {TAIL_RECORDS:,} ops that wrote something, before the model's first "
                "forward: what the rest of that code derived from the weights is not "
                "discovered, and a captured graph that reads it is not guarded; run the "
                "post-load step inside the load (`with gs.weight_update(model): ...`)",
                GraphSafetyWarning, stacklevel=3)

    def _stack(self) -> list[Recorder | NativeRecorder | None]:
        stack: list[Recorder | NativeRecorder | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.closed:
            return
        if self.tail is not None:
            self.end_tail()
        stack = self._stack()
        if stack:  # the root called again inside its own forward: one epoch
            stack.append(None)
            return
        self.lineage.epoch += 1
        rec = recorder(self.lineage, self.weights)
        rec.__enter__()
        stack.append(rec)

    def _after(self, module: nn.Module, args: Any, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = self._stack()
        if not stack:
            return
        recorder = stack.pop()
        if recorder is not None:
            recorder.__exit__(None, None, None)
            if self.lineage.epoch >= FORWARDS and not self.closed:
                self._full()

    def close(self, settle: Callable[[Lineage], None]) -> None:
        """Stop recording, hand what the forwards made to `settle`, then forget it."""
        if self.closed:
            return
        self.closed = True
        for handle in self._handles:
            handle.remove()
        try:
            self.end_tail()
            if self.lineage.epoch:
                settle(self.lineage)
        finally:
            self.lineage.release()
