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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from graphsafe._lineage.record.native import NativeRecorder, recorder
from graphsafe._lineage.record.recorder import Lineage, Recorder

__all__ = ["FORWARDS", "Window"]

FORWARDS = 64
"""The most forwards a bring-up records (an engine's profile run, its warm-ups, one
capture per batch size)."""


class Window:
    """The recording of a model's forwards until its first capture ends (see the module).

    Args:
        model: The root module (held by the hooks it installs, which `close` removes).
        lineage: The first load's recording, continued.
        weights: Storage keys of the model's weights (see `Recorder.weights`).
        full: Called when the `FORWARDS`-th forward ended (the owner closes it).
    """

    __slots__ = ("_full", "_handles", "_local", "closed", "lineage", "weights")

    def __init__(self, model: nn.Module, lineage: Lineage, weights: frozenset[int],
                 full: Callable[[], None]) -> None:
        self.lineage = lineage
        self.weights = weights
        self.closed = False
        self._full = full  # called once the last forward it records has ended
        self._local = threading.local()
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._before),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def _stack(self) -> list[Recorder | NativeRecorder | None]:
        stack: list[Recorder | NativeRecorder | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.closed:
            return
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
            if self.lineage.epoch:
                settle(self.lineage)
        finally:
            self.lineage.release()
