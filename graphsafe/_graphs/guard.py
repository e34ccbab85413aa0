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
from typing import Any, Final

import torch
from torch import nn

from graphsafe._declare.spec import Drift
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

    `holds_addresses=False` guards an engine that captures no graphs, whose every step
    runs the model's code and reads whatever is bound: a tensor rebound to new memory is
    then followed (pinned where it is now, and listed in `followed`), not refused; stale
    content is refused as ever.
    """

    __slots__ = ("_release", "_repair", "followed", "holds_addresses", "inputs", "ledger",
                 "reads", "runtime")

    def __init__(
        self,
        model: nn.Module,
        owner: object,
        *,
        repair: bool,
        keep: Callable[[Site], bool] | None = None,
        device: str = "cpu",
        holds_addresses: bool = True,
    ) -> None:
        if device == "cuda":
            keep = functools.partial(_on_device, keep)
        rt = runtime(model)
        token = _Holder(id(owner))
        rt.pin(holder=token, addresses=holds_addresses)
        self._release: weakref.finalize[Any, Any] = weakref.finalize(owner, rt.unpin, token)
        self._repair = repair
        self.runtime: Runtime = rt
        self.ledger = Ledger.snapshot(model, label="graph capture", keep=keep)
        self.reads: frozenset[int] | None = None
        """Storage keys the graph reads (None: not known, the whole model is checked)."""
        self.inputs: tuple[torch.Tensor, ...] = ()
        """What the graph reads that the model does not hold (static inputs, caches)."""
        self.holds_addresses: Final = holds_addresses
        """Whether what runs under the guard reads the pinned tensors by address (a
        captured graph): then a moved tensor is refused, else followed."""
        self.followed: dict[str, tuple[str, ...]] = {}
        """Path -> what moved (`storage`, `shape`, `holder`, ...), for every move followed
        since the pin (only where `holds_addresses` is False); written by `assert_stable`."""

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
        memory and geometry is none: the ledger pins the new one from then on. Without
        `holds_addresses`, no moved tensor is either: the ledger pins it where it is now,
        the guard's read set takes its storage, and `followed` lists it.

        Raises:
            StorageMovedError: A tensor or submodule the ledger holds was rebound (without
                `holds_addresses`: a submodule was replaced).
        """
        if self.holds_addresses:
            self.ledger = self.ledger.checked()
            return
        self.ledger, moved = self.ledger.followed()
        if moved:
            self._note(moved)

    def _note(self, moved: Sequence[Drift]) -> None:
        """Record the moves followed, and read the new storages where a read set is kept."""
        for d in moved:
            was = self.followed.get(d.path, ())
            if d.what not in was:
                self.followed[d.path] = (*was, d.what)
        if self.reads is not None:
            self.reads = self.reads | self.ledger.storages

    def faults(self) -> dict[str, tuple[str, ...]]:
        """Path -> what moved, for every tensor or submodule the guard would refuse now
        because a graph holds its address (empty where `holds_addresses` is False:
        moves are followed there)."""
        if not self.holds_addresses:
            return {}
        out: dict[str, tuple[str, ...]] = {}
        for d in self.ledger.verify():
            if d.what != "object":
                out[d.path] = (*out.get(d.path, ()), d.what)
        return out

    def replaying(self) -> contextlib.AbstractContextManager[None]:
        """Check the model, then hold it still for the replay (it and loads wait on each other).

        Raises:
            StorageMovedError: A tensor or submodule the graph reads was rebound.
            StaleError: Derived buffers are stale (and not repaired), or the last weight
                update failed or has not ended.
        """
        return self.runtime.replaying(
            self.assert_stable, repair=self._repair, reads=self.reads)
