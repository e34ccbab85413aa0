"""The guard: what stands between a captured graph and a replay of stale or moved memory.

A `Guard` holds a graph's pin on the model and the ledger snapshot of what the graph may
read; before each replay the runtime, under the model's lock, runs the ledger's flat
check and its own freshness check (witnesses and journal).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from graphsafe._memory.ledger import Ledger
from graphsafe._memory.walk import Site
from graphsafe._runtime.runtime import Runtime, runtime

__all__ = ["Guard"]


class _Holder(int):
    """A graph's pin token: its id, not the graph, so the pin does not keep it alive."""

    __slots__ = ()


class Guard:
    """The guard of one captured graph over one model.

    Taking it pins `model` (refreshing what moved first) and snapshots it, so it is taken
    right before the body is captured. The pin is released with the guard or when `owner`
    (the graph) is garbage-collected. `repair` refreshes stale derived buffers before a
    replay instead of refusing it; `keep` picks the tensors the ledger pins (all if None).
    """

    __slots__ = ("_release", "_repair", "ledger", "runtime")

    def __init__(
        self,
        model: nn.Module,
        owner: object,
        *,
        repair: bool,
        keep: Callable[[Site], bool] | None = None,
    ) -> None:
        rt = runtime(model)
        token = _Holder(id(owner))
        rt.pin(holder=token)
        self._release: weakref.finalize[Any, Any] = weakref.finalize(owner, rt.unpin, token)
        self._repair = repair
        self.runtime: Runtime = rt
        self.ledger = Ledger.snapshot(model, label="graph capture", keep=keep)

    @staticmethod
    def check_capturable(model: nn.Module) -> None:
        """Refuse (`StaleError`) a never-materialized model, before any warm-up runs it."""
        runtime(model).check_pinnable()

    def release(self) -> None:
        """Release the pin (once; later calls do nothing)."""
        self._release()

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """Check the model, then hold it still for the replay (it and loads wait on each other).

        Raises:
            StorageMovedError: A tensor or submodule the graph reads was rebound.
            StaleError: Derived buffers are stale (and not repaired), or the last weight
                update failed or has not ended.
        """
        return self.runtime.replaying(self.ledger.assert_stable, repair=self._repair)
