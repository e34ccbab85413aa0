"""Flat snapshots of sites: what a holder held under a key, compared in one pass.

A site is a holder and a key: a dict and its key (`module._parameters`, `"weight"`; an
object's attribute is its `__dict__` and the name), a closure cell (key None) or an
object's slot (key `walk.Slot(name)`, the step the walk takes into it). `Sites` reads them
all at once; `Identities` (identity, pointer, stride: the every-load rebinding check) and
`Witnesses` (also version and journal epoch: the guard's freshness check) compare what
they read with what they recorded. The
compiled checks (`graphsafe native build`) read every kind of site in C++ as `read_site`
does in Python, and compare there; a dict site whose dict has not changed since their last
passing look (its version tag) is not looked up again, and its tensor's pointer, version
and strides are read from the TensorImpl remembered with it (once the object's own is found
to be that one), every time.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from types import CellType
from typing import Any, NamedTuple

import torch

from graphsafe import _native
from graphsafe._memory.journal import Journal
from graphsafe._memory.walk import Slot, storage_key

__all__ = [
    "DATA_PTR", "PLAIN", "STRIDE", "VERSION", "Identities", "Sites", "SitesRead", "Witnesses",
]

PLAIN = torch._C.DisableTorchFunctionSubclass
"""Metadata reads without subclass `__torch_function__` (vLLM's parameters have one)."""
DATA_PTR = torch.Tensor.data_ptr
STRIDE = torch.Tensor.stride
VERSION = operator.attrgetter("_version")
_ROW = 40
"""Bytes of one site's row in what the compiled witness check remembers (`Witnessed` in
`witnesses.cpp`)."""
_NO_ROW = bytes(_ROW)
_BOUND_ROW = 72
"""Bytes of one site's row in what the compiled rebinding check remembers (`Bound` in
`checks.cpp`)."""


class SitesRead(NamedTuple):
    """Sites as one flat check read them: `tensors[i]` is what `holders[i]` holds."""

    holders: list[Any]
    keys: list[Any]
    tensors: list[Any]
    ids: list[int]
    ptrs: list[int]


class Sites:
    """Holders and keys, read in one pass.

    Args:
        sites: `(holder, key)` per site.
    """

    __slots__ = ("compiled", "holders", "keys", "plain")

    def __init__(self, sites: Sequence[tuple[Any, Any]]) -> None:
        holders, keys = _columns(sites, 2)
        self._hold(holders, keys)

    def _hold(self, holders: Sequence[Any], keys: Sequence[Any]) -> None:
        self.holders: list[Any] = list(holders)
        self.keys: list[Any] = list(keys)
        self.plain = set(map(type, self.holders)) <= _DICT_ONLY
        """Every holder is a dict: read with `dict.get`, in one `map`."""
        self.compiled = self.plain or all(map(_compiled_site, self.holders, self.keys))
        """Every site is one the compiled checks read (all of the kinds above)."""

    def __len__(self) -> int:
        return len(self.keys)

    def read(self) -> list[Any]:
        """What each site holds now (None where it holds nothing)."""
        if self.plain:
            return list(map(dict.get, self.holders, self.keys))
        return [self.read_one(i) for i in range(len(self.keys))]

    def read_one(self, i: int) -> Any:
        """What site `i` holds now."""
        return read_site(self.holders[i], self.keys[i])


_DICT_ONLY = frozenset({dict})


def _columns(rows: Sequence[tuple[Any, ...]], n: int) -> list[tuple[Any, ...]]:
    """The `n` columns of `rows`, in one pass (witnesses and identities of thousands of
    sites are built as a first load ends)."""
    return list(zip(*rows, strict=True)) if rows else [()] * n


def _compiled_site(holder: Any, key: Any) -> bool:
    return type(holder) is dict or isinstance(holder, CellType) or isinstance(key, Slot)


def read_site(holder: Any, key: Any) -> Any:
    """What `holder` holds under `key`: a dict item, a cell's contents or a slot."""
    if type(holder) is dict:
        return holder.get(key)
    if isinstance(holder, CellType):
        try:
            return holder.cell_contents
        except ValueError:  # an empty cell
            return None
    if isinstance(key, Slot):
        return getattr(holder, key.name, None)
    return holder.get(key)


class Identities(Sites):
    """Identity, pointer and (for the first `n_strided`) stride of what each site held
    when recorded: the every-load check that nothing was rebound is a few `map`s and
    `==`s. Shapes are compared by the caller once something differs.

    Args:
        rows: `(holder, key, object, data pointer, stride)` per site, as recorded (not as
            read now: a rebinding before this is built must still show).
        n_strided: How many leading rows also check their stride (a `.data =` view of the
            same storage changes it).
    """

    __slots__ = ("_looked", "_seen", "ids", "n_strided", "native", "ptrs", "strides")

    def __init__(
        self, rows: Sequence[tuple[Any, Any, object, int, tuple[int, ...]]], n_strided: int
    ) -> None:
        holders, keys, objects, ptrs, strides = _columns(rows, 5)
        self._hold(holders, keys)
        self.ids = list(map(id, objects))
        self.ptrs = list(ptrs)
        self.n_strided = n_strided
        self.strides = list(map(tuple, strides[:n_strided]))
        self._seen: SitesRead | None = None  # what the last passing check read
        self.native = _native.get() if self.compiled else None
        # What the compiled check last passed at each dict site (the dict's version, the
        # tensor, its pointer and strides): the expected values never change, so neither
        # do the rows but by the check itself.
        self._looked = bytearray(_BOUND_ROW * len(rows)) if self.native is not None else None

    def unchanged(self) -> bool:
        """Whether every site holds the object it held, at the same pointer and stride."""
        if self.native is not None:  # the same comparisons, compiled
            now = self.native.same_bindings(
                self.holders, self.keys, self.ids, self.ptrs, self.strides, self._looked
            )
            if now is None:
                return False
            self._seen = SitesRead(self.holders, self.keys, now, self.ids, self.ptrs)
            return True
        tensors = self.read()
        if list(map(id, tensors)) != self.ids:
            return False
        try:
            with PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
                ok = (
                    list(map(DATA_PTR, tensors)) == self.ptrs
                    and list(map(STRIDE, tensors[: self.n_strided])) == self.strides
                )
        except (TypeError, AttributeError, RuntimeError):
            return False
        if ok:
            self._seen = SitesRead(self.holders, self.keys, tensors, self.ids, self.ptrs)
        return ok

    def take_read(self) -> SitesRead | None:
        """What the last passing check read, once (a full refresh's witnesses reuse it);
        None if nothing since."""
        seen, self._seen = self._seen, None
        return seen


class Witnesses(Sites):
    """What each watched tensor looked like when its dependents were last refreshed.

    The tensors are read through their holders, so a rebound attribute shows.
    `unchanged()` is one flat comparison per field over all of them; only a mismatch
    pays for finding which ones differ (`changed()`).

    Args:
        sites: `(holder, key)` per tensor, e.g. `(module._parameters, "weight")`.
        journal: Whose epochs the witnesses take.
    """

    __slots__ = ("_clock", "_epochs", "_ids", "_looked", "_native", "_ptrs", "_skeys",
                 "_versions", "journal")

    def __init__(self, sites: Sequence[tuple[Any, Any]], journal: Journal) -> None:
        super().__init__(sites)
        self.journal = journal
        n = len(self.keys)
        self._ids = [0] * n
        self._ptrs = [0] * n
        self._versions = [0] * n
        self._skeys = [0] * n
        self._epochs = [0] * n
        self._clock = -1
        self._native = _native.get() if self.compiled else None
        # What the compiled check last passed at each dict site (the dict's version, the
        # tensor, its pointer and version, as expected): a site whose dict did not change
        # since is not looked up again. Rows are zeroed where the expected values change,
        # or written as the compiled taking takes them.
        self._looked = bytearray(_ROW * n)
        self._take(range(n))

    def rebuilt(self, sites: Sequence[tuple[Any, Any]]) -> Witnesses:
        """New witnesses over `sites`, keeping what was recorded for sites already here.

        New sites are recorded now; sites kept keep their old record, so a change not
        yet refreshed is not forgotten.

        Args:
            sites: The new `(container, key)` list.

        Returns:
            The new witnesses.
        """
        new = Witnesses(sites, self.journal)
        old = {(id(c), k): i for i, (c, k) in enumerate(zip(self.holders, self.keys))}
        for j, (c, k) in enumerate(sites):
            i = old.get((id(c), k))
            if i is not None and self._ids[i] == new._ids[j]:
                new._ptrs[j] = self._ptrs[i]
                new._versions[j] = self._versions[i]
                new._epochs[j] = self._epochs[i]
        new._clock = -1
        new._looked = bytearray(_ROW * len(sites))  # rows of the values before this copy
        return new

    def carried(self, sites: Sequence[tuple[Any, Any]], rows: Sequence[int | None]) -> Witnesses:
        """New witnesses over `sites`; site `j` keeps the record of this one's row
        `rows[j]` (None: recorded now). Rows of one holder may repeat (one source read by
        several dependents, each witnessed on its own).

        Args:
            sites: The new `(holder, key)` list.
            rows: For each new site, the old row whose record it keeps, or None.

        Returns:
            The new witnesses.
        """
        new = Witnesses(sites, self.journal)
        for j, i in enumerate(rows):
            if i is not None:
                new._ids[j], new._ptrs[j] = self._ids[i], self._ptrs[i]
                new._versions[j], new._epochs[j] = self._versions[i], self._epochs[i]
                new._skeys[j] = self._skeys[i]
        new._clock = -1
        new._looked = bytearray(_ROW * len(sites))  # rows of the values before this copy
        return new

    def record(self, indices: Iterable[int]) -> None:
        """Take the witnesses of site `indices` anew, after their dependents were refreshed
        (the clock shortcut is left alone: other sites may still lag behind it)."""
        self._take(list(indices))

    def _take(self, indices: Sequence[int]) -> None:
        """The expected values of sites `indices`, read now; the compiled check's rows of
        those sites say so (taken compiled) or are reset (it looks again)."""
        self.journal.sync()  # writes seen before this refresh are in the epochs it records
        holders, keys, plain = self.holders, self.keys, self.plain
        ids, ptrs, versions, skeys = self._ids, self._ptrs, self._versions, self._skeys
        indices = list(indices)
        rest: Sequence[int] = indices
        if self._native is not None and plain:  # the dict sites holding tensors, compiled
            rest = self._native.take_witnesses(holders, keys, indices, ids, ptrs, versions,
                                               skeys, self._looked)
        else:
            looked = self._looked
            for i in indices:  # their expected values change: the compiled check looks again
                looked[_ROW * i:_ROW * (i + 1)] = _NO_ROW
        for i in rest:
            t = holders[i].get(keys[i]) if plain else self.read_one(i)
            if isinstance(t, torch.Tensor):
                ptr = _ptr(t)
                if id(t) != ids[i] or ptr != ptrs[i]:  # as in `record_all`: else the same
                    skeys[i] = storage_key(t)
                ptrs[i] = ptr
                versions[i] = _version(t)
            else:
                ptrs[i] = versions[i] = skeys[i] = 0
            ids[i] = id(t)
        for i, epoch in zip(indices, self.journal.epochs_of([skeys[i] for i in indices])):
            self._epochs[i] = epoch  # key 0 (no tensor) is never written: epoch 0

    def record_all(self, seen: SitesRead | None = None) -> None:
        """`record` of every site, as flat passes (a full refresh).

        Args:
            seen: What the engine's rebinding check read at the start of this refresh,
                over the same sites: its tensors, ids and pointers are taken as they are
                (a tensor rebound since then shows at the next check, as rebound).
        """
        self.journal.sync()
        if (
            seen is not None
            and seen.holders == self.holders
            and seen.keys == self.keys
        ):
            tensors, ids, ptrs = seen.tensors, seen.ids, seen.ptrs
        else:
            tensors = self.read()
            ids = list(map(id, tensors))
            try:
                ptrs = list(map(DATA_PTR, tensors))
            except (AttributeError, TypeError, RuntimeError):
                self.record(range(len(tensors)))  # a site holds no tensor: one by one
                return
        try:
            versions = list(map(VERSION, tensors))
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
        self._looked = bytearray(_ROW * len(ids))
        self._epochs = self.journal.epochs_of(skeys)

    def unchanged(self) -> bool:
        """The flat check: same tensor objects, pointers, versions and epochs."""
        self.journal.sync()  # writes seen elsewhere and not yet recorded first
        native = self._native
        if native is not None:
            if not native.same_witnesses(
                self.holders, self.keys, self._ids, self._ptrs, self._versions, self._looked
            ):
                return False
            return self._epochs_hold()
        tensors = self.read()
        if list(map(id, tensors)) != self._ids:
            return False
        try:
            with PLAIN():  # metadata reads: no subclass __torch_function__ (vLLM's)
                if list(map(VERSION, tensors)) != self._versions:
                    return False
                if list(map(DATA_PTR, tensors)) != self._ptrs:
                    return False
        except (AttributeError, TypeError, RuntimeError):
            return False
        return self._epochs_hold()

    def _epochs_hold(self) -> bool:
        """Whether no recorded write reached a watched storage (only looked at when the
        journal's clock moved since the last look)."""
        clock = self.journal.clock
        if clock != self._clock:
            if self.journal.epochs_of(self._skeys) != self._epochs:
                return False
            self._clock = clock
        return True

    def changed(self, *, by_journal: bool = False) -> list[tuple[int, str]]:
        """Which tensors changed since they were recorded, and how (`by_journal`: what
        the journal recorded as the writer first, where it recorded one).

        Returns:
            `(index, how)` per changed tensor, in site order; empty when none did.
        """
        self.journal.sync()
        if self.unchanged():
            return []
        out: list[tuple[int, str]] = []
        epochs = self.journal.epochs_of(self._skeys)
        for i, t in enumerate(self.read()):
            if id(t) != self._ids[i] or not isinstance(t, torch.Tensor):
                out.append((i, "rebound"))
            elif _ptr(t) != self._ptrs[i]:
                out.append((i, "rebound to new storage"))
            elif by_journal and epochs[i] != self._epochs[i]:  # what wrote it, by name
                out.append((i, f"written by {self.journal.how_written(self._skeys[i])}"))
            elif _version(t) != self._versions[i]:
                out.append((i, "written in place outside a tracked load (its version moved)"))
            elif epochs[i] != self._epochs[i]:
                how = self.journal.how_written(self._skeys[i])
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
