"""The write journal: one process-wide record of writes into tensor storages.

Every write graphsafe observes (a tracked load, a `weight_update` block, its own receive
paths) or is told about (`gs.mark_written`) advances that storage's epoch, whichever
model it went through. A refresh records a witness of each input it read (identity,
storage pointer, `_version`, journal epoch): one that no longer matches was written or
rebound since, so every runtime reading a storage sees its writes. Storages a failure
left unusable are `poison`ed, and guards whose graphs read them refuse to replay until a
refresh (of a derived buffer) or a completed load that writes them heals them. What the
journal holds of a storage dies with it: a later storage at the same address starts
clean, and a long job's journal does not grow. Poison follows a storage whose bytes move
while it lives (`share_memory_()`), and leaves the address they left.

A load that writes the same storages as the load before it is handed the same frozenset
by the compiled tracker; the journal records such a write again as one step (`advance`),
so that a steady run of loads costs it nothing per storage.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch

from graphsafe._errors import GraphSafetyError
from graphsafe._memory.walk import storage_key

__all__ = ["JOURNAL", "Journal", "mark_written"]

StorageOf = Callable[[int], "torch.UntypedStorage | None"]
"""Finds the live storage of a key, for the journal to forget it when it dies."""


class Journal:
    """Epochs of written storages, and storages poisoned by a failure.

    Examples:
        >>> j = Journal()
        >>> w = torch.zeros(2)
        >>> j.advance([storage_key(w)], "a load", lambda key: w.untyped_storage())
        >>> j.epochs_of([storage_key(w)]) == [j.clock], j.how_written(storage_key(w))
        (True, 'a load')
        >>> del w
        >>> len(j)
        0
    """

    __slots__ = ("_dead", "_drain", "_epochs", "_how", "_key_of", "_last", "_lock",
                 "_tracked", "clock", "poisoned")

    def __init__(self) -> None:
        self.clock = 0
        """Advanced by every recorded write: a witness taken at this clock is current
        while the clock has not moved."""
        self.poisoned: dict[int, str] = {}
        """Storage key -> why it must not be read by a replay."""
        self._epochs: dict[int, int] = {}  # storage key -> the clock of its last write
        self._last: tuple[frozenset[int], int, bool] | None = None
        """The last write, while it is the most recent one and was given as a frozenset:
        (its keys, its clock, whether all of them are tracked). Its keys' epochs are its
        clock (their entries in `_epochs` are older); the same frozenset written again
        moves them all at once. `_settle` writes them into `_epochs`."""
        self._how: dict[int, str] = {}  # clock -> what wrote at it, for messages
        self._tracked: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        """Key -> the storage tracked there (its death, or its bytes moving elsewhere,
        frees the key)."""
        self._lock = threading.Lock()
        self._dead: list[weakref.ref[torch.UntypedStorage]] = []
        """The references of tracked storages that died, forgotten at the next sweep: each
        reference's callback is this list's `append` (one callback for all: a first load
        tracks thousands)."""
        self._key_of: dict[int, int] = {}
        """`id` of each reference in `_tracked` -> its key (the references live while they
        are tracked or dead, so an id is not reused while it is here)."""
        self._drain: Callable[[], None] = _nothing  # the write observer's, while it runs

    def sync(self) -> None:
        """Record the writes seen elsewhere and not recorded yet; witnesses call it before
        they compare or record epochs. It runs the drain of the process-wide write
        observer (`graphsafe._runtime.writes.observer`) while one is set."""
        self._drain()

    def sweep(self) -> None:
        """Forget the storages that died since the journal was last used (what its next
        use does first)."""
        with self._lock:
            self._sweep()

    def set_drain(self, drain: Callable[[], None] | None) -> None:
        """What `sync` runs from now on (None: nothing)."""
        self._drain = _nothing if drain is None else drain

    def __len__(self) -> int:
        """How many storages the journal holds anything of."""
        with self._lock:
            self._sweep()
            self._settle()
            return len(self._tracked.keys() | self._epochs.keys() | self.poisoned.keys())

    def advance(self, keys: Iterable[int], how: str, storage_of: StorageOf | None = None) -> None:
        """Record a write by `how` ("Model.load_weights", ...) into each storage of `keys`
        (key 0 is ignored). `storage_of(key)` gives the live storage, asked once per storage
        so that the journal forgets it when it dies; without it, the entry stays.

        The same frozenset as the last write (a load writing what the load before it
        wrote: the compiled tracker hands the same object back) is recorded in one step,
        whatever its size, while it is the most recent write and its storages are
        tracked. A write of nothing moves the clock alone."""
        written = keys if isinstance(keys, (set, frozenset)) else set(keys)
        if 0 in written:
            written = written - {0}
        with self._lock:
            self._sweep()
            last = self._last
            if not written or (last is not None and keys is last[0]
                               and (last[2] or storage_of is None)):
                self.clock += 1
                if written:
                    assert last is not None
                    self._last = (last[0], self.clock, last[2])
                self._note_how(how)
                return
            self._settle()
            self.clock += 1
            if type(keys) is frozenset and written is keys:
                self._last = (keys, self.clock, False)  # its epochs: see `_last`
            else:
                # A load of every tensor of a large model: one pass, in C.
                self._epochs.update(dict.fromkeys(written, self.clock))
            self._note_how(how)
            if storage_of is not None:
                untracked = written.difference(self._tracked)
                self._track_all(untracked, storage_of)
                if self._last is not None and self._last[0] is keys:
                    self._last = (keys, self.clock, self._tracked.keys() >= untracked)

    def _note_how(self, how: str) -> None:
        """What wrote at the clock now, for messages; what no epoch holds is forgotten."""
        self._how[self.clock] = how
        last = self._last
        if len(self._how) > 2 * len(self._epochs) + 64:
            live = set(self._epochs.values())
            if last is not None:
                live.add(last[1])
            self._how = {c: h for c, h in self._how.items() if c in live}

    def _settle(self) -> None:
        """Write the epochs of the last write given as a frozenset into `_epochs` (before
        any other write, or anything that moves or forgets an entry)."""
        last = self._last
        if last is not None:
            self._last = None
            self._epochs.update(dict.fromkeys(last[0], last[1]))

    def poison(self, tensors: Iterable[torch.Tensor], why: str) -> None:
        """Mark the storages of `tensors` unusable until healed (or until they die)."""
        with self._lock:
            self._sweep()
            for t in tensors:
                key = storage_key(t)
                if key and key not in self.poisoned:
                    self.poisoned[key] = why
                    if not self._holds(key):  # the poison dies with this storage
                        self._track(key, t.untyped_storage())

    def heal(self, keys: Iterable[int]) -> None:
        """Clear the poison of the storages `keys` (refreshed, or written by a load that
        completed), and of no other."""
        if not self.poisoned:
            return
        with self._lock:
            self._sweep()
            self._relocate()
            for key in keys:
                self.poisoned.pop(key, None)

    def written_since(self, clock: int) -> set[int]:
        """Storage keys written after the journal's clock read `clock` (by any path)."""
        with self._lock:
            self._sweep()
            since = {key for key, epoch in self._epochs.items() if epoch > clock}
            last = self._last
            if last is not None and last[1] > clock:
                since.update(last[0])
            return since

    def poisoned_among(self, keys: frozenset[int]) -> dict[int, str]:
        """The poisoned storages among `keys` (key -> why; cheap when nothing is)."""
        if not self.poisoned:
            return {}
        with self._lock:
            self._sweep()
            self._relocate()
            poisoned = self.poisoned
            return {k: poisoned[k] for k in keys.intersection(poisoned)}

    def epochs_of(self, keys: Sequence[int]) -> list[int]:
        """The epoch of each storage of `keys` (0: never written)."""
        if self._dead:
            with self._lock:
                self._sweep()
        last = self._last
        found = list(map(self._epochs.get, keys, itertools.repeat(0)))
        if last is None or last[0].isdisjoint(keys):
            return found
        written, clock, _ = last
        return [clock if key in written else epoch for key, epoch in zip(keys, found)]

    def how_written(self, key: int) -> str:
        """What last wrote the storage `key`, for messages."""
        last = self._last
        epoch = last[1] if last is not None and key in last[0] else self._epochs.get(key, -1)
        return self._how.get(epoch, "a recorded write")

    def know(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Track `storages` (a pinned model's) without recording a write: a write declared
        through another storage object of their memory is matched to them."""
        with self._lock:
            self._sweep()
            for storage in storages:
                key = storage.data_ptr() if storage.nbytes() else 0
                if key and key not in self._tracked:
                    self._track(key, storage)

    def containing(self, start: int, end: int) -> set[int]:
        """The storages it knows (`advance`d with their storage) whose bytes hold all of
        `[start, end)`: a view over another storage object of the same memory (NumPy's,
        `torch.from_numpy` of it) is a write into them."""
        with self._lock:
            self._sweep()
            # The extents are read here, not kept (a first load tracks thousands).
            return {k for k, ref in self._tracked.items() if k <= start
                    and (s := ref()) is not None and s.data_ptr() == k and end <= k + s.nbytes()}

    def poisoned_keys(self) -> frozenset[int]:
        """The poisoned storages, each at the address its bytes are at now."""
        if not self.poisoned:
            return frozenset()
        with self._lock:
            self._sweep()
            self._relocate()
            return frozenset(self.poisoned)

    def _track(self, key: int, storage: torch.UntypedStorage | None) -> None:
        self._track_all((key,), lambda _: storage)

    def _track_all(self, keys: Iterable[int], storage_of: StorageOf) -> None:
        """Track the live storage `storage_of(key)` of each of `keys` (a first load tracks
        thousands). The callback runs only while the reference is the one tracked at its
        key: one replaced (its storage's bytes moved) is dropped, and never fires."""
        tracked, key_of, ref, died = self._tracked, self._key_of, weakref.ref, self._dead.append
        bulk = getattr(storage_of, "track", None)  # most of a first load's, in one call
        if bulk is not None:
            keys = bulk(keys, tracked, key_of, died)
        for key in keys:
            storage = storage_of(key)
            if storage is not None and storage.data_ptr() == key:
                old = tracked.get(key)
                if old is not None:
                    key_of.pop(id(old), None)
                r = tracked[key] = ref(storage, died)
                key_of[id(r)] = key

    def _holds(self, key: int) -> bool:
        """Whether the storage tracked at `key` still has its bytes there (another
        storage object of the same bytes, NumPy's, does not replace it)."""
        ref = self._tracked.get(key)
        storage = None if ref is None else ref()
        return storage is not None and storage.data_ptr() == key and storage.nbytes() > 0

    def _forget(self, key: int) -> None:
        self._forget_all([key])

    def _sweep(self) -> None:
        # Callbacks run wherever the garbage collector runs, this journal's own code
        # included: they only append (atomic); the storage is forgotten here, always
        # before a new storage at its address can be recorded.
        dead = self._dead
        if not dead:
            return
        tracked, key_of = self._tracked, self._key_of
        keys = []
        while dead:
            ref = dead.pop()
            key = key_of.get(id(ref))
            if key is not None and tracked.get(key) is ref:
                keys.append(key)
        self._forget_all(keys)

    def _forget_all(self, keys: list[int]) -> None:
        """`_forget` of each of `keys`, in one pass (a dropped model's thousands): the
        clock moves once if any had an epoch."""
        last = self._last
        if last is not None and not last[0].isdisjoint(keys):
            self._settle()
        tracked, key_of, poisoned, epochs = self._tracked, self._key_of, self.poisoned, self._epochs
        had = False
        for key in keys:
            ref = tracked.pop(key, None)
            if ref is not None:
                key_of.pop(id(ref), None)
            poisoned.pop(key, None)
            had = epochs.pop(key, None) is not None or had
        if had:
            self.clock += 1  # witnesses of those epochs look again

    def _relocate(self) -> None:
        """Poison follows its storage: a storage whose bytes moved while it lives
        (`share_memory_()`, a resize) is poisoned at its new address, and the old one,
        free for any new storage, is forgotten."""
        self._settle()
        for key in [k for k in self.poisoned if k in self._tracked]:
            storage = self._tracked[key]()
            if storage is None:  # dying: its callback forgets it
                continue
            now = storage.data_ptr() if storage.nbytes() else 0
            if now == key:
                continue
            why, epoch = self.poisoned[key], self._epochs.get(key)
            self._forget(key)
            if now:
                self.poisoned.setdefault(now, why)
                if epoch is not None:
                    self._epochs[now] = max(epoch, self._epochs.get(now, 0))
                if not self._holds(now):
                    self._track(now, storage)


def _nothing() -> None:
    """`Journal.sync` when nothing records writes elsewhere."""


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
        *tensors: The tensors written (any view of the storage will do; a tensor over
            another storage object of the same memory, such as `torch.from_numpy` of a
            NumPy view of a weight, declares a write into the weight's storage).

    Raises:
        GraphSafetyError: An argument is not a tensor (a list, a generator, a NumPy
            array, a module); nothing is recorded.

    Examples:
        >>> w = torch.zeros(3)
        >>> w.numpy()[:] = 1.0  # invisible to torch
        >>> mark_written(w)
    """
    for position, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):  # all checked before anything is recorded
            raise _not_a_tensor(position, len(tensors), t)
    storages: dict[int, torch.UntypedStorage | None] = {}
    for t in tensors:
        key = storage_key(t)
        if key:
            storages[key] = t.untyped_storage()
            # Matched by address: the same bytes under another storage object.
            end = key + max(int(t.untyped_storage().nbytes()), 1)
            for known in JOURNAL.containing(key, end) - storages.keys():
                storages[known] = None  # the journal tracks it already
    JOURNAL.advance(storages, "a write declared with gs.mark_written", storages.get)


def _not_a_tensor(position: int, count: int, value: object) -> GraphSafetyError:
    """The refusal of `mark_written`'s argument `position` (of `count`), with its fix."""
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else (
        f"{kind.__module__}.{kind.__qualname__}"
    )
    if isinstance(value, torch.nn.Module):
        fix = "pass its tensors: `gs.mark_written(*module.parameters())`"
    elif isinstance(value, dict):
        fix = "pass its tensors: `gs.mark_written(*the_dict.values())`"
    elif kind.__module__ == "numpy":
        fix = ("pass the torch tensor the array views: after writing `w.numpy()`, "
               "`gs.mark_written(w)`")
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        var = f"the_{kind.__name__}" if kind.__module__ == "builtins" else "the_tensors"
        fix = f"unpack it: `gs.mark_written(*{var})`"
    else:
        fix = "pass the tensors that were written: `gs.mark_written(*tensors)`"
    return GraphSafetyError(
        f"gs.mark_written takes tensors; argument {position + 1} of {count} is of type "
        f"{name}",
        expected="torch.Tensor arguments: `gs.mark_written(*tensors)`",
        got=f"argument {position + 1}: {name}",
        fix=f"{fix}; nothing was recorded",
    )
