"""What each ended load of one model leaves owed: a failed one owes what it may have
written, a completed one pays for what it wrote.

A load that raised (or a generator or async loader closed early, a `load_state_dict`
that raised once it had copied) may have left any tensor it was to write half old, half
new. Unless the update named what it writes (`gs.weight_update(model, writes=...)`), that
is every weight of the model. The debt (`Owed`) is kept by tensor path, not by storage
address, so that moving the model (`.to()`, `share_memory_()`) does not forgive it; each
completed load pays for what it wrote, whichever model it went through, and the guard
refuses while anything is owed. `Debts` keeps the model's `Owed` and poisons, in the
journal, the storages a failed load may have left half written, so that other models
sharing them see the failure too. The model's `LoadDriver` holds one and settles each
load through it under the model's lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Final

from graphsafe._errors import one_line
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.loads.load import Load
from graphsafe._runtime.refresh.binder import Binder

__all__ = ["Debts", "Owed"]


class Debts:
    """The model's debts after failed loads (`owed`) and the journal they poison.

    Args:
        journal: Where a failed load's storages are poisoned.
    """

    __slots__ = ("_journal", "owed")

    def __init__(self, journal: Journal) -> None:
        self._journal: Final = journal
        self.owed: Final = Owed()
        """The tensor paths owed since a failure, and why."""

    def settle(
        self, binder: Binder, load: Load, what: str, exc: BaseException | None,
        before: dict[str, int] | None,
    ) -> None:
        """`load` (the loader `what`'s) ended, raising `exc` (None: it completed): pay for
        what it wrote, or owe what it may have written. `before`: the storage key of each
        path when it began (a tensor rebound since was written)."""
        paths = {tr.input.path for tr in load.transients_written()}
        if before is not None and (self.owed or exc is not None):
            now = binder.model_map().by_path
            paths.update(p for p, key in now.items() if before.get(p, key) != key)
        if exc is None:  # every weight it wrote is whole, whatever a derivation did
            self.pay(binder, load.rewritten(), paths)
        else:
            self.fail(binder, load.rewritten(), load.writes, f"{what} raised {one_line(exc)}",
                      paths)

    def fail(
        self, binder: Binder, written: Set[int], named: frozenset[str] | None, why: str,
        written_paths: Iterable[str] = (),
    ) -> None:
        """A load or update failed (`why`: "Model.load_weights raised ..."): what it may
        have written is owed (every weight, or what it `named`, and what it wrote:
        `written` storages, `written_paths`), and the storages are poisoned for every
        other model reading them."""
        found = binder.model_map()
        engine = binder.current
        buffers = {storage_key(t) for b in engine.bound for t in b.buffers or ()} if (
            engine is not None) else set()
        buffers.discard(0)
        paths = dict.fromkeys(found.weights if named is None else sorted(named))
        paths.update(dict.fromkeys(found.paths_of(written)))
        paths.update(dict.fromkeys(p for p in written_paths if p in found.by_path))
        owed = [p for p in paths if found.by_path[p] not in buffers]  # derived: not weights
        self.owed.owe(owed, why)
        keys = {found.by_path[p] for p in owed} - {0}
        self._journal.poison((t for t in binder.tensors() if storage_key(t) in keys),
                             f"the last weight update failed ({why})")

    def pay(self, binder: Binder, written: Set[int], written_paths: set[str]) -> None:
        """A load completed: what it wrote is no longer owed."""
        if self.owed:
            self.owed.pay(written, written_paths, binder.model_map().by_path)


class Owed:
    """The tensor paths owed since a failure, and why."""

    __slots__ = ("paths", "why")

    def __init__(self) -> None:
        self.paths: dict[str, None] = {}
        """Dotted paths still owed, in the order they were found (an ordered set)."""
        self.why = ""
        """What failed ("Model.load_weights raised KeyError: ..."), for messages."""

    def __bool__(self) -> bool:
        return bool(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    def owe(self, paths: Iterable[str], why: str) -> None:
        """A load or update failed: `paths` are owed (besides what still was)."""
        self.paths.update(dict.fromkeys(paths))
        self.why = why

    def pay(self, written: Set[int], written_paths: Set[str], keys: Mapping[str, int]) -> None:
        """A load completed: what it wrote is paid.

        Args:
            written: Storage keys it wrote.
            written_paths: Paths it wrote (transient inputs, which have no storage
                between loads).
            keys: The model's path -> storage key now; a path no longer there is paid
                (there is nothing left to write).
        """
        if not self.paths or not (written or written_paths):
            return
        self.paths = {
            p: None
            for p in self.paths
            if p not in written_paths and (k := keys.get(p)) is not None and k not in written
        }
