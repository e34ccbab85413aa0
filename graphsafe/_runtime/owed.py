"""What a failed load or update of one model still owes: the tensors it wrote or may
have written that no completed load has written since.

A load that raised (or a generator or async loader closed early, a `load_state_dict`
that raised once it had copied) may have left any tensor it was to write half old, half
new. Unless the update named what it writes (`gs.weight_update(model, writes=...)`), that
is every weight of the model. The debt is kept by tensor path, not by storage address,
so that moving the model (`.to()`, `share_memory_()`) does not forgive it; each completed
load pays for what it wrote, whichever model it went through, and the guard refuses while
anything is owed. Other models sharing a storage see the failure through the journal's
poison of that storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

__all__ = ["Owed"]


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
