"""The guard: what stands between a captured graph and a replay of stale or moved memory.

A `Guard` holds a graph's pin on the model and the ledger snapshot of what the graph may
read; before each replay the runtime, under the model's lock, runs the ledger's flat
check and its own freshness check (witnesses and journal).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._memory.ledger import Ledger
from graphsafe._memory.walk import Site, storage_key, storage_paths
from graphsafe._runtime.runtime import Runtime, runtime

__all__ = ["Guard"]


class _Holder(int):
    """A graph's pin token: its id, not the graph, so the pin does not keep it alive."""

    __slots__ = ()


def _on_device(keep: Callable[[Site], bool] | None, site: Site) -> bool:
    """Whether a CUDA graph reads `site`'s tensor by address (and `keep` keeps it)."""
    kind = site.tensor.device.type
    return kind in ("cuda", "meta") and (keep is None or keep(site))


class Guard:
    """The guard of one captured graph over one model.

    Taking it pins `model` (refreshing what moved first) and snapshots it, so it is taken
    right before the body is captured. The pin is released with the guard or when `owner`
    (the graph) is garbage-collected. `repair` refreshes stale derived buffers before a
    replay instead of refusing it; `keep` picks the tensors the ledger pins (all if None).
    A CUDA graph (`device="cuda"`) reads only device memory by address: host tensors are
    taken by value at capture, and are not pinned.
    """

    __slots__ = ("_release", "_repair", "inputs", "ledger", "reads", "runtime")

    def __init__(
        self,
        model: nn.Module,
        owner: object,
        *,
        repair: bool,
        keep: Callable[[Site], bool] | None = None,
        device: str = "cpu",
    ) -> None:
        if device == "cuda":
            keep = functools.partial(_on_device, keep)
        rt = runtime(model)
        token = _Holder(id(owner))
        rt.pin(holder=token)
        self._release: weakref.finalize[Any, Any] = weakref.finalize(owner, rt.unpin, token)
        self._repair = repair
        self.runtime: Runtime = rt
        self.ledger = Ledger.snapshot(model, label="graph capture", keep=keep)
        self.reads: frozenset[int] | None = None
        """Storage keys the graph reads (None: not known, the whole model is checked)."""
        self.inputs: tuple[torch.Tensor, ...] = ()
        """What the graph reads that the model does not hold (static inputs, caches)."""

    def narrow(self, reads: frozenset[int] | None, outside: Sequence[torch.Tensor]) -> None:
        """After capture: check only what the graph reads (`reads`, when known), and list
        the tensors it reads from `outside` the capture that the model does not hold."""
        model = self.runtime.model
        owned = set(storage_paths(model))
        self.inputs = tuple(t for t in outside if storage_key(t) not in owned)
        self.runtime.take_inputs(self.inputs)  # those computed from the weights: guarded
        if reads is not None:
            self.reads = reads
            self.ledger = self.ledger.restricted(reads)

    @staticmethod
    def check_capturable(model: nn.Module) -> None:
        """Refuse (`StaleError`) a never-materialized model, before any warm-up runs it."""
        runtime(model).check_pinnable()

    def release(self) -> None:
        """Release the pin (once; later calls do nothing)."""
        self._release()

    def assert_stable(self) -> None:
        """The check of the ledger as it is now, narrowed or not (for a check bound before
        `narrow`, such as a load check). A tensor object rebound to another over the same
        memory and geometry is none: the ledger pins the new one from then on.

        Raises:
            StorageMovedError: A tensor or submodule the ledger holds was rebound.
        """
        self.ledger = self.ledger.checked()

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """Check the model, then hold it still for the replay (it and loads wait on each other).

        Raises:
            StorageMovedError: A tensor or submodule the graph reads was rebound.
            StaleError: Derived buffers are stale (and not repaired), or the last weight
                update failed or has not ended.
        """
        return self.runtime.replaying(
            self.assert_stable, repair=self._repair, reads=self.reads)
