"""What an engine watches: where each input and buffer lives, and what changed there.

A `Watch` is built over one binding and rebuilt (`renewed`) when inputs or buffers are
taken anew. It answers the engine's questions about the model's memory: which
derivations read a storage, which inputs or buffers were rebound (one flat pass:
`Identities`), and which were written since their witnesses were taken (`Witnesses`:
identity, pointer, version, journal epoch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from graphsafe._memory.journal import Journal
from graphsafe._memory.snapshot import PLAIN, Identities, SitesRead, Witnesses
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind.binding import Binding, BoundDerivation
from graphsafe._runtime.bind.inputs import Input

__all__ = ["Watch"]


class Watch:
    """Storages, binding sites and witnesses of one binding's inputs and buffers.

    Args:
        binding: The plan from `bind`.
        journal: Whose epochs the witnesses take.
        witnesses: Witnesses to carry over (sites still here keep their record).
    """

    __slots__ = (
        "_by_key",
        "_consumers",
        "_covered",
        "_free_keys",
        "_identities",
        "_keys",
        "_own_sites",
        "_shared_sites",
        "_site_owner",
        "_site_paths",
        "_transient",
        "_unmade",
        "_with",
        "binding",
        "witnesses",
    )

    def __init__(
        self, binding: Binding, journal: Journal, witnesses: Witnesses | None = None
    ) -> None:
        self.binding = binding
        self._by_key: dict[int, list[Input]] | None = None
        self._consumers: dict[int, frozenset[int]] | None = None
        self._identities: Identities | None = None
        self._covered: tuple[Identities, Identities, bool] | None = None
        self._keys: frozenset[int] | None = None
        self._free_keys: frozenset[int] | None = None
        self._unmade: list[int] | None = None
        self._with: tuple[frozenset[int], frozenset[int]] | None = None
        self._transient = [inp for inp in binding.inputs if inp.transient]
        sites = self._sites()
        self.witnesses = (
            witnesses.rebuilt(sites) if witnesses is not None else Witnesses(sites, journal)
        )

    def renewed(self) -> Watch:
        """A watch over where the inputs and buffers are now, keeping the witnesses."""
        return Watch(self.binding, self.witnesses.journal, self.witnesses)

    def by_storage(self) -> dict[int, list[Input]]:
        """Storage key -> the inputs living in that storage (views and ties share one)."""
        if self._by_key is None:
            by_key: dict[int, list[Input]] = {}
            for inp in self.binding.inputs:
                if inp.tensor is not None and not inp.transient:  # those: see transients
                    key = storage_key(inp.tensor)
                    if key:
                        by_key.setdefault(key, []).append(inp)
            self._by_key = by_key
        return self._by_key

    def consumers_of(self, keys: Iterable[int]) -> set[int]:
        """Indices of the derivations reading any of the storages `keys` directly (one
        lookup per key: every load asks for what it wrote)."""
        readers = self._consumers
        if readers is None:
            readers = self._consumers = {
                key: frozenset(i for inp in inputs for i in inp.consumers)
                for key, inputs in self.by_storage().items()
            }
        return set().union(*filter(None, map(readers.get, keys)))

    def witness_dirty(self) -> dict[int, str]:
        """Derivation index -> how its input or buffer changed since it was refreshed."""
        changed = self.witnesses.changed()
        if not changed:
            return {}
        dirty: dict[int, str] = {}
        for site, how in changed:
            for i in self._site_owner[site]:
                dirty.setdefault(i, f"{self._site_paths[site]} {how}")
        return dirty

    def moved(self) -> tuple[list[Input], list[tuple[BoundDerivation, int]]]:
        """Inputs, and `(derivation, output index)` of buffers, rebound since recorded.

        One flat pass when nothing moved: this runs on every load and refresh.
        """
        if self._identities is None:
            self._identities = self._identity_rows()
        if self._identities.unchanged():
            return [inp for inp in self._transient if inp.moved()], []
        moved_inputs = [inp for inp in self.binding.inputs if inp.moved()]
        moved_buffers = [
            (b, j)
            for b in self.binding.bound
            for j, (name, buf, (ptr, shape, stride)) in enumerate(
                zip(b.outputs, b.buffers or (), b.geometry)
            )
            if b.container.get(name) is not buf
            or buf.data_ptr() != ptr
            or buf.shape != shape
            or buf.stride() != stride
        ]
        return moved_inputs, moved_buffers

    def recorded_in(self, rows: Identities) -> bool:
        """Whether `rows` (a walk's, see `ModelMap.rows`) record every input and buffer
        this watch checks for rebinding, with the same identity, pointer and stride: a
        walk whose check holds then proves that none was rebound. False with transient
        inputs (released and held again: `moved` looks at each)."""
        if self._transient:
            return False
        if self._identities is None:
            self._identities = self._identity_rows()
        mine = self._identities
        kept = self._covered
        if kept is not None and kept[0] is mine and kept[1] is rows:
            return kept[2]
        wanted = set(map(id, mine.holders))  # a few holders among a model's thousands
        at = {(h, k): i for i, (h, k) in enumerate(zip(map(id, rows.holders), rows.keys))
              if h in wanted}
        covered = True
        for j, (h, k) in enumerate(zip(mine.holders, mine.keys)):
            i = at.get((id(h), k))
            if (i is None or i >= rows.n_strided or rows.ids[i] != mine.ids[j]
                    or rows.ptrs[i] != mine.ptrs[j]
                    or (j < mine.n_strided and rows.strides[i] != mine.strides[j])):
                covered = False
                break
        self._covered = (mine, rows, covered)
        return covered

    def buffers_changed(self) -> None:
        """A derivation's buffers were recorded: the rebinding check reads them anew."""
        self._identities = None
        self._keys = None
        self._free_keys = None
        self._unmade = None
        self._with = None

    def take_read(self) -> SitesRead | None:
        """What the last passing rebinding check read (once), for a full rewitness."""
        identities = self._identities
        if identities is None:
            return None
        return identities.take_read()

    def rewitness(self, fresh: Sequence[int]) -> None:
        """Take the witnesses of derivations known to be fresh.

        An input's witness is taken only when every derivation reading it is among
        `fresh`: a change that one of them has not seen must stay visible.
        """
        okset = set(fresh)
        bound = self.binding.bound
        if len(okset) == len(bound):
            self.witnesses.record_all(self.take_read())
            return
        sites: list[int] = []
        own, shared = self._own_sites, self._shared_sites
        for i in fresh:
            sites.extend(own[i])
            for site, consumers in shared[i]:
                if okset.issuperset(consumers):
                    sites.append(site)
        self.witnesses.record(sites)

    def storage_keys(self) -> frozenset[int]:
        """Storage keys of every input and buffer, for the journal's poison check."""
        if self._keys is None:
            with PLAIN():  # metadata: no subclass hooks
                keys = {
                    storage_key(inp.tensor)
                    for inp in self.binding.inputs
                    if inp.tensor is not None
                }
                keys.update(storage_key(t) for b in self.binding.bound for t in b.buffers or ())
            keys.discard(0)
            self._keys = frozenset(keys)
        return self._keys

    def unmade(self) -> list[int]:
        """Indices of the derivations that have no buffers (never made, or dropped: a
        watch is renewed when buffers are dropped, told when they are recorded)."""
        if self._unmade is None:
            self._unmade = [b.index for b in self.binding.bound if b.buffers is None]
        return self._unmade

    def buffer_keys(self) -> frozenset[int]:
        """Of `storage_keys`, those no resident input lives in (the buffers, transient
        inputs): a write there makes the witnesses worth a look."""
        if self._free_keys is None:
            self._free_keys = self.storage_keys().difference(self.by_storage())
        return self._free_keys

    def watched_with(self, others: frozenset[int]) -> frozenset[int]:
        """`others` with `storage_keys`: what a load watches (the union is kept while
        `others` is the same set, as a model's walk keeps its own)."""
        kept = self._with
        if kept is not None and kept[0] is others:
            return kept[1]
        keys = self.storage_keys()
        union = others if keys <= others else others | keys
        self._with = (others, union)
        return union

    def _identity_rows(self) -> Identities:
        # Resident inputs (stride checked too), then buffers: derived buffers are
        # graphsafe's own, locked against resizing; a view bound to one changes its
        # identity, which the ids see.
        rows: list[tuple[Any, Any, object, int, tuple[int, ...]]] = [
            (inp.container, inp.key, inp.tensor, inp.geometry[0], inp.geometry[2])
            for inp in self.binding.inputs
            if not inp.transient
        ]
        n_inputs = len(rows)
        rows += [
            (b.container, name, buf, ptr, tuple(stride))
            for b in self.binding.bound
            for name, buf, (ptr, _, stride) in zip(b.outputs, b.buffers or (), b.geometry)
        ]
        return Identities(rows, n_inputs)

    def _sites(self) -> list[tuple[dict[str, Any], str]]:
        """Witness sites: every resident leaf input, then every materialized buffer; and,
        per derivation, the sites `rewitness` takes when it is fresh: its own (its buffers,
        the inputs it alone reads) and those of inputs it shares, with their readers."""
        sites: list[tuple[dict[str, Any], str]] = []
        owner: list[tuple[int, ...]] = []
        paths: list[str] = []
        input_site: dict[int, int] = {}
        for inp in self.binding.inputs:
            if inp.transient:
                continue  # released and held again by design: loads account for them
            input_site[id(inp)] = len(sites)
            sites.append((inp.container, inp.key))
            owner.append(tuple(inp.consumers))
            paths.append(inp.path)
        bound = self.binding.bound
        self._own_sites: list[list[int]] = [[] for _ in bound]
        self._shared_sites: list[list[tuple[int, frozenset[int]]]] = [[] for _ in bound]
        for b in bound:
            for inp in b.leaf_inputs:
                if inp.transient:
                    continue
                readers = frozenset(inp.consumers)
                if readers <= {b.index}:
                    self._own_sites[b.index].append(input_site[id(inp)])
                else:
                    self._shared_sites[b.index].append((input_site[id(inp)], readers))
            for j, name in enumerate(b.outputs if b.buffers is not None else ()):
                self._own_sites[b.index].append(len(sites))
                sites.append((b.container, name))
                owner.append((b.index,))
                paths.append(f"derived buffer {b.out_paths[j]}")
        self._site_owner = owner
        self._site_paths = paths
        return sites
