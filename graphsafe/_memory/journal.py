"""The write journal: one process-wide record of writes into tensor storages.

Keyed by storage (`storage_key`). Every write graphsafe observes (a tracked load, a
`weight_update` block, graphsafe's own receive paths) or is told about
(`gs.mark_written`) advances that storage's epoch, whichever model the write went
through. A runtime records, at each refresh, a witness of every input it read: the
tensor's identity, storage pointer, `_version` and journal epoch. A witness that no
longer matches means the input was written or rebound since, by any path torch or
graphsafe records, so every runtime whose derivations read a storage sees its writes.

The journal also records storages left unusable by a failure (`poison`): a derivation
that raised, or a load or update that did not complete. Every guard whose graph reads
one of them refuses to replay until a refresh or a completed load heals them.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from graphsafe import _native
from graphsafe._memory.walk import storage_key

__all__ = ["JOURNAL", "Journal", "Seen", "Witnesses", "mark_written", "storage_key"]


class Journal:
    """Epochs of written storages, and storages poisoned by a failure.

    Examples:
        >>> j = Journal()
        >>> j.advance([0x10], "a load")
        >>> j.epochs[0x10] > 0, j.how[0x10]
        (True, 'a load')
    """

    __slots__ = ("_dead", "_lock", "clock", "epochs", "how", "poisoned")

    def __init__(self) -> None:
        self.clock = 0
        """Advanced by every recorded write: a witness taken at this clock is current
        while the clock has not moved."""
        self.epochs: dict[int, int] = {}
        """Storage key -> the clock of its last recorded write."""
        self.how: dict[int, str] = {}
        """Storage key -> what last wrote it ("Model.load_weights", ...), for messages."""
        self.poisoned: dict[int, str] = {}
        """Storage key -> why it must not be read by a replay."""
        self._lock = threading.Lock()
        self._dead: list[int] = []  # keys whose storage died, forgotten at the next sweep

    def advance(self, keys: Iterable[int], how: str) -> None:
        """Record a write into each storage of `keys` (key 0 is ignored).

        Args:
            keys: Storage keys written.
            how: How they were written ("load_weights of Model", ...).
        """
        with self._lock:
            self.clock += 1
            clock = self.clock
            for key in keys:
                if key:
                    self.epochs[key] = clock
                    self.how[key] = how

    def poison(self, tensors: Iterable[torch.Tensor], why: str) -> None:
        """Mark the storages of `tensors` unusable until healed.

        The poison dies with the storage: a storage allocated later at the same address
        (another model's) starts clean.

        Args:
            tensors: Tensors whose storage is poisoned.
            why: The failure, for messages.
        """
        with self._lock:
            self._sweep()
            for t in tensors:
                key = storage_key(t)
                if key and key not in self.poisoned:
                    self.poisoned[key] = why
                    weakref.finalize(t.untyped_storage(), self._dead.append, key)

    def _sweep(self) -> None:
        # Finalizers run wherever the garbage collector runs, this journal's own code
        # included: they only append (atomic), and the poison is forgotten here.
        dead = self._dead
        while dead:
            self.poisoned.pop(dead.pop(), None)

    def heal(self, keys: Iterable[int]) -> None:
        """Clear the poison of storages that were refreshed or completely loaded.

        Args:
            keys: Storage keys.
        """
        if not self.poisoned:
            return
        with self._lock:
            self._sweep()
            for key in keys:
                self.poisoned.pop(key, None)

    def poisoned_among(self, keys: frozenset[int]) -> dict[int, str]:
        """The poisoned storages among `keys` (cheap when nothing is poisoned).

        Args:
            keys: Storage keys a graph or runtime reads.

        Returns:
            Key -> why, for each poisoned one.
        """
        if not self.poisoned:
            return {}
        with self._lock:
            self._sweep()
            poisoned = self.poisoned
            return {k: poisoned[k] for k in keys.intersection(poisoned)}


JOURNAL = Journal()
"""The process-wide journal."""


def mark_written(*tensors: torch.Tensor) -> None:
    """Declare writes graphsafe cannot see, so that derived buffers follow them.

    Writes through NumPy views, by other processes or libraries' kernels, and (outside
    any tracked load or update) by c10d collectives (`dist.broadcast(p.data, src)`) or
    raw storage copies bypass both the load-time tracker and `_version`. Declaring them
    advances the journal: inside `gs.weight_update(model)` the derived buffers reading
    them are refreshed when the block exits; outside one, every runtime reading them
    reports them stale and a guarded replay refuses (or repairs, with
    `on_stale="refresh"`).

    Args:
        *tensors: The tensors written (any view of the storage will do).

    Examples:
        >>> import torch
        >>> w = torch.zeros(3)
        >>> w.numpy()[:] = 1.0  # invisible to torch
        >>> mark_written(w)
    """
    JOURNAL.advance((storage_key(t) for t in tensors), "a write declared with gs.mark_written")


_VERSION = operator.attrgetter("_version")
_PLAIN = torch._C.DisableTorchFunctionSubclass
_DATA_PTR = torch.Tensor.data_ptr


class Seen(NamedTuple):
    """Sites as one flat check read them: `tensors[i]` is `containers[i][keys[i]]`."""

    containers: list[dict[str, Any]]
    keys: list[str]
    tensors: list[Any]
    ids: list[int]
    ptrs: list[int]


class Witnesses:
    """What each watched tensor looked like when its dependents were last refreshed.

    The tensors are read through the dict they live in, so a rebound attribute shows.
    `unchanged()` is one flat comparison per field over all of them; only a mismatch
    pays for finding which ones differ (`changed()`).

    Args:
        sites: `(container, key)` per tensor, e.g. `(module._parameters, "weight")`.
    """

    __slots__ = ("_clock", "_epochs", "_ids", "_native", "_ptrs", "_skeys", "_versions",
                 "_zeros", "containers", "keys")

    def __init__(self, sites: Sequence[tuple[dict[str, Any], str]]) -> None:
        self.containers = [c for c, _ in sites]
        self.keys = [k for _, k in sites]
        n = len(sites)
        self._zeros = [0] * n
        self._ids = [0] * n
        self._ptrs = [0] * n
        self._versions = [0] * n
        self._skeys = [0] * n
        self._epochs = [0] * n
        self._clock = -1
        self._native = _native.get() if all(type(c) is dict for c in self.containers) else None
        self.record(range(n))

    def __len__(self) -> int:
        return len(self.keys)

    def rebuilt(self, sites: Sequence[tuple[dict[str, Any], str]]) -> Witnesses:
        """New witnesses over `sites`, keeping what was recorded for sites already here.

        New sites are recorded now; sites kept keep their old record, so a change not
        yet refreshed is not forgotten.

        Args:
            sites: The new `(container, key)` list.

        Returns:
            The new witnesses.
        """
        new = Witnesses(sites)
        old = {(id(c), k): i for i, (c, k) in enumerate(zip(self.containers, self.keys))}
        for j, (c, k) in enumerate(sites):
            i = old.get((id(c), k))
            if i is not None and self._ids[i] == new._ids[j]:
                new._ptrs[j] = self._ptrs[i]
                new._versions[j] = self._versions[i]
                new._epochs[j] = self._epochs[i]
        new._clock = -1
        return new

    def record(self, indices: Iterable[int]) -> None:
        """Take the witnesses of `indices` anew, after their dependents were refreshed.

        The clock shortcut is left alone: other sites may still lag behind it.

        Args:
            indices: Site indices.
        """
        epochs = JOURNAL.epochs
        for i in indices:
            t = self.containers[i].get(self.keys[i])
            self._ids[i] = id(t)
            if isinstance(t, torch.Tensor):
                self._ptrs[i] = _ptr(t)
                self._versions[i] = _version(t)
                key = self._skeys[i] = storage_key(t)
                self._epochs[i] = epochs.get(key, 0)
            else:
                self._ptrs[i] = self._versions[i] = self._skeys[i] = self._epochs[i] = 0

    def record_all(self, seen: Seen | None = None) -> None:
        """`record` of every site, as flat passes (a full refresh).

        Args:
            seen: What the engine's rebinding check read at the start of this refresh,
                over the same sites: its tensors, ids and pointers are taken as they are
                (a tensor rebound since then shows at the next check, as rebound).
        """
        if (
            seen is not None
            and seen.containers == self.containers
            and seen.keys == self.keys
        ):
            tensors, ids, ptrs = seen.tensors, seen.ids, seen.ptrs
        else:
            tensors = list(map(dict.get, self.containers, self.keys))
            ids = list(map(id, tensors))
            try:
                ptrs = list(map(_DATA_PTR, tensors))
            except (AttributeError, TypeError, RuntimeError):
                self.record(range(len(tensors)))  # a site holds no tensor: one by one
                return
        try:
            versions = list(map(_VERSION, tensors))
        except (AttributeError, TypeError, RuntimeError):
            self.record(range(len(tensors)))  # a site holds no tensor: one by one
            return
        # A storage key changes only with the tensor or its pointer.
        if ids == self._ids and ptrs == self._ptrs:
            skeys = self._skeys
        else:
            skeys = [
                k if i == oi and p == op else storage_key(t)
                for t, i, p, oi, op, k in zip(
                    tensors, ids, ptrs, self._ids, self._ptrs, self._skeys
                )
            ]
        self._ids, self._ptrs, self._versions, self._skeys = ids, ptrs, versions, skeys
        self._epochs = list(map(JOURNAL.epochs.get, skeys, self._zeros))

    def unchanged(self) -> bool:
        """The flat check: same tensor objects, pointers, versions and epochs."""
        native = self._native
        if native is not None:
            if not native.same_witnesses(
                self.containers, self.keys, self._ids, self._ptrs, self._versions
            ):
                return False
            return self._epochs_hold()
        tensors = list(map(dict.get, self.containers, self.keys))
        if list(map(id, tensors)) != self._ids:
            return False
        try:
            with _PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
                if list(map(_VERSION, tensors)) != self._versions:
                    return False
                if list(map(_DATA_PTR, tensors)) != self._ptrs:  # type: ignore[arg-type]
                    return False
        except (AttributeError, TypeError, RuntimeError):
            return False
        return self._epochs_hold()

    def _epochs_hold(self) -> bool:
        """Whether no recorded write reached a watched storage (only looked at when the
        journal's clock moved since the last look)."""
        clock = JOURNAL.clock
        if clock != self._clock:
            if list(map(JOURNAL.epochs.get, self._skeys, self._zeros)) != self._epochs:
                return False
            self._clock = clock
        return True

    def changed(self) -> list[tuple[int, str]]:
        """Which tensors changed since they were recorded, and how.

        Returns:
            `(index, how)` per changed tensor, in site order; empty when none did.
        """
        if self.unchanged():
            return []
        out: list[tuple[int, str]] = []
        epochs = JOURNAL.epochs
        for i, (c, k) in enumerate(zip(self.containers, self.keys)):
            t = c.get(k)
            if id(t) != self._ids[i] or not isinstance(t, torch.Tensor):
                out.append((i, "rebound"))
            elif _ptr(t) != self._ptrs[i]:
                out.append((i, "rebound to new storage"))
            elif _version(t) != self._versions[i]:
                out.append((i, "written in place outside a tracked load (its version moved)"))
            elif epochs.get(self._skeys[i], 0) != self._epochs[i]:
                how = JOURNAL.how.get(self._skeys[i], "a recorded write")
                out.append((i, f"written by {how}"))
        return out


def _version(t: torch.Tensor) -> int:
    """`t._version`, or -1 for an inference tensor (torch keeps none for it)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


def _ptr(t: object) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return int(t.data_ptr())
    except RuntimeError:
        return 0
