"""One discovered entry: a tensor, number or handle a model derived from its weights,
where it is held and how it was made.

`Place` says where (a module held weakly, its table or `__dict__`, the steps below it; or,
for a tensor no model holds, the entry's own list); `Entry` holds what was witnessed
computed there, the sources, the call that last wrote it, and, once pinned, the value or
handle a graph holds, and what the content audit recomputes for it (`AuditItem`). `refusal`
says why an entry cannot be recomputed in place. `PinnedValues` checks, before each
replay, that the numbers and handles a graph holds did not move, in one compiled call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from graphsafe import _native
from graphsafe._lineage.probes import PROBES
from graphsafe._lineage.record.recorder import Arg, Call
from graphsafe._lineage.resolve import (
    COMPUTED,
    Found,
    Source,
    arguments_now,
    recompute,
    recompute_scalar,
)
from graphsafe._memory.compare import compare
from graphsafe._memory.snapshot import PLAIN
from graphsafe._memory.walk import Site, step, storage_key

_new = tuple.__new__

__all__ = ["AFTER_CAPTURE", "UNRECORDED", "UNTRACED", "AuditItem", "Entry", "PinnedValues", "Place",
           "read_place", "ref_to", "refusal", "same_number", "still_held"]


class _AfterCapture:
    """What a graph holds of a number or handle a load made after the capture, where the
    place held no number then: not that value (refused until captured again)."""

    def __repr__(self) -> str:
        return "made by a load after the capture"


AFTER_CAPTURE = _AfterCapture()


class Place(NamedTuple):
    """Where an entry is held: the module's `table` (`_parameters`, `_buffers`, or None
    for its `__dict__`) at `key`, then each step of `chain`. The module is held weakly:
    a module's `__dict__` holds its submodules, and a runtime that held them would keep
    itself alive through `_OWNERS`."""

    module: weakref.ref[nn.Module]
    table: str | None
    key: Any
    chain: tuple[Any, ...]
    outside: Any = None
    """For what no model holds (`graphsafe._lineage.outside`): the container that holds
    it, at `key` (for a tensor a graph reads, the entry's own list; for a number, the
    module global or dict that keeps it)."""

    def container(self) -> Any:
        if self.outside is not None:
            return self.outside
        m = self.module()
        if m is None:
            return None
        return vars(m) if self.table is None else vars(m)[self.table]


def ref_to(value: object) -> Callable[[], object]:
    """A reference to `value`: weak for a tensor (a rebuilt copy must not be kept alive
    by graphsafe), strong for a number or a handle (its identity must not be reused)."""
    if isinstance(value, torch.Tensor):
        return weakref.ref(value)
    return lambda: value


class AuditItem(NamedTuple):
    """A discovered tensor for the content audit: `held` (what the model holds) and
    `recompute()` (its value from the current sources, out of place; None: cannot). A
    handle with a registered probe has `probe()`: (the kernel's result with the handle on
    a probe input, the reference result over its current sources), to agree within
    `atol`/`rtol`; None if it cannot be run."""

    path: str
    held: torch.Tensor
    recompute: Callable[[], torch.Tensor | None]
    sources: tuple[str, ...]
    opaque: bool
    probe: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] | None = None
    atol: float = 0.0
    rtol: float = 0.0
    why: str = ""
    """Why it cannot be recomputed, when that is known before trying."""
    stale: str = ""
    """Why the guard holds it stale now (a source written since, a rewrite not
    re-applied), or empty: what the audit reports where it cannot recompute it."""


class Entry:
    """One discovered tensor, scalar or handle: where it is held, from what, and how it
    was last written."""

    __slots__ = ("adopted", "chain", "kind", "module_class", "opaque", "path", "pinned",
                 "refused", "seen", "site", "sources", "tensor", "writer")

    path: str
    site: Place
    module_class: str
    kind: str
    """"tensor", "scalar" or "handle"."""
    tensor: Callable[[], object]
    """What was last witnessed computed from the sources (what is held may be another:
    rebuilt by a load that failed)."""
    seen: Callable[[], object]
    """What the last load that ended (or failed) left at the place."""
    pinned: Callable[[], object] | None
    """A scalar's value or a handle's object when the model was pinned (a graph holds it
    from then on); None: not pinned."""
    sources: tuple[Source, ...]
    chain: str
    opaque: bool
    writer: tuple[Call, Arg | None] | None
    """The call that last wrote it; None: made by a load that was not recorded."""
    adopted: bool
    refused: str | None

    @classmethod
    def many(cls, found: Iterable[Found]) -> list[Entry]:
        """An entry for each of `found`, in one pass (a first load discovers thousands:
        no call per entry)."""
        out: list[Entry] = []
        new, place, ref, join = cls.__new__, Place, weakref.ref, " -> ".join
        for f in found:
            site = f.site
            m, container = site.module, site.container
            attrs = m.__dict__
            table, outside = None, None
            if container is attrs:  # most: an attribute, or what it holds
                pass
            elif container is attrs.get("_parameters"):
                table = "_parameters"
            elif container is attrs.get("_buffers"):
                table = "_buffers"
            else:
                outside = container
            e = new(cls)
            e.path = site.path
            e.site = _new(place, (ref(m), table, site.key, site.chain, outside))
            e.module_class = type(m).__name__
            if isinstance(site, Site):
                e.kind = "tensor"
                e.tensor = e.seen = ref(site.tensor)
            else:
                e.kind = "handle" if f.opaque else "scalar"
                e.tensor = e.seen = ref_to(site.value)
            e.pinned = None
            e.sources = f.sources
            e.chain = join(f.chain)
            e.opaque = f.opaque
            e.writer = f.writer
            e.adopted = False
            e.refused = None
            out.append(e)
        return out

    def held(self) -> torch.Tensor | None:
        """The tensor the model holds at the entry's place now (None for a scalar or a
        handle, or when none is there)."""
        now = read_place(self.site)
        return now if isinstance(now, torch.Tensor) else None

    def value(self) -> object:
        """Whatever the model holds at the entry's place now."""
        return read_place(self.site)

    def recompute(self) -> torch.Tensor | None:
        if self.writer is None:
            return None
        if self.kind == "scalar":
            return recompute_scalar(self.writer[0], self.sources)
        held = self.held()
        if held is None or self.opaque or self.writer[1] is None:
            return None
        return recompute((self.writer[0], self.writer[1]), held, self.sources)

    def holds_again(self) -> bool:
        """A tensor or a number whose sources were written: whether what the model holds
        is, bit for bit, what its recorded ops give from its sources now (re-derived
        where no load saw it: a post-load step run after the load returned). False where
        it cannot be recomputed."""
        if self.kind == "scalar":
            return self.scalar_holds()
        held = self.held()
        if held is None:
            return False
        try:
            with torch.no_grad():
                again = self.recompute()
                return again is not None and compare(again, held, atol=0.0, rtol=0.0) is None
        except Exception:  # a chain that no longer runs: stale, as before
            return False

    def scalar_holds(self) -> bool:
        """A scalar: whether the value held is what its sources give now."""
        now = self.value()
        again = self.recompute()
        return again is not None and type(now) in (int, float, bool) and same_number(
            again.item(), now)

    def source_paths(self) -> tuple[str, ...]:
        """The paths of the sources, once each (a staging copy stands for its weight)."""
        return tuple(dict.fromkeys(s.path for s in self.sources))

    def key(self) -> int:
        t = self.held()
        return 0 if t is None else storage_key(t)

    def source_keys(self) -> set[int]:
        """Storage keys of the sources as the model holds them now."""
        with PLAIN():
            return {storage_key(t) for s in self.sources
                    if isinstance(t := s.holder.get(s.key), torch.Tensor)}

    def audit_item(self) -> AuditItem | None:
        """What the content audit recomputes and compares for this entry (None: nothing
        is held at its place now)."""
        why = "" if self.writer else UNTRACED if self.chain.endswith(COMPUTED) else UNRECORDED
        paths = self.source_paths()
        if self.kind == "scalar":
            now = self.value()
            if type(now) in (int, float, bool):
                return AuditItem(self.path, torch.tensor(now), self.recompute, paths, False,
                                 why=why)
            return AuditItem(self.path, torch.empty(0), lambda: None, paths, False,
                             why=f"it holds {type(now).__name__} now, no number")
        held = self.held()
        if self.kind == "handle" and held is None:  # an object, not an int in a tensor
            found = PROBES.get(self.writer[0].name) if self.writer else None
            return AuditItem(
                self.path, torch.empty(0), self.recompute, paths, True,
                None if found is None else _probing(self, self.value(), found.run),
                0.0 if found is None else found.atol, 0.0 if found is None else found.rtol,
                why=why,
            )
        if held is None:
            return None
        probe = PROBES.get(self.writer[0].name) if self.opaque and self.writer else None
        if probe is None:
            return AuditItem(self.path, held, self.recompute, paths, self.opaque, why=why)
        return AuditItem(self.path, held, self.recompute, paths, self.opaque,
                         _probing(self, held, probe.run), probe.atol, probe.rtol)

    def moved(self) -> str | None:
        """Pinned: how the value a graph holds differs from what is held now (a scalar's
        value changed, a handle rebuilt), or None."""
        if self.pinned is None:
            return None
        was, now = self.pinned(), self.value()
        if was is AFTER_CAPTURE:
            return (f"made by a load after the capture (the graph holds what its place "
                    f"held then), now {type(now).__name__} {now!r}")
        if self.kind == "scalar":
            return None if same_number(was, now) else f"{was!r} at capture, now {now!r}"
        if self.kind == "handle" and now is not was:
            return (f"{type(was).__name__} at 0x{id(was):x} at capture, now "
                    f"{type(now).__name__} at 0x{id(now):x}")
        return None


def _probing(
    e: Entry, held: object, run: Callable[..., tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[], tuple[torch.Tensor, torch.Tensor] | None]:
    def probe() -> tuple[torch.Tensor, torch.Tensor] | None:
        args = None if e.writer is None else arguments_now(e.writer[0], e.sources)
        return None if args is None else run(held, args)

    return probe


def same_number(a: object, b: object) -> bool:
    """Equal numbers of the same type (a NaN equals itself: the same bits baked in)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return a == b



class PinnedValues:
    """The numbers and handles a graph holds, checked before each replay without a Python
    call per entry where nothing moved: every one held directly in a dict (its module's
    `__dict__`, a module global's dict) whose module is alive and whose dict item is still
    the very object pinned has not moved (a number is immutable and equals itself; a
    handle is pinned by identity), which the compiled checks confirm in one pass
    (`alive`, `same_items`, skipping a dict whose version tag held). Only `rest` (held
    below a chain of steps, a number that does not equal itself, one made after the
    capture, one whose place held another object when this was built) is read entry by
    entry (`Entry.moved`), and all of them are whenever the pass does not hold. The dicts
    are those the entries' places read when this was built, as the witnesses' are: its
    owner builds it anew whenever the entries or their pins change.

    Args:
        values: The numbers and handles; those not pinned are not checked.
    """

    __slots__ = ("_holders", "_keys", "_looked", "_native", "_objects", "_refs", "rest")

    def __init__(self, values: list[Entry]) -> None:
        native = _native.get()
        self._native = native
        self._holders: list[dict[Any, Any]] = []
        self._keys: list[Any] = []
        self._objects: list[object] = []
        self._refs: list[weakref.ref[nn.Module] | None] = []
        self.rest: list[Entry] = []
        """The pinned entries the compiled pass does not cover, each read by `moved`."""
        for e in values:
            if e.pinned is None:
                continue
            was = e.pinned()
            place = e.site
            container = place.container() if place.table is None and not place.chain else None
            unchanging = e.kind == "handle" or (e.kind == "scalar" and same_number(was, was))
            if (native is None or type(container) is not dict or was is AFTER_CAPTURE
                    or not unchanging or container.get(place.key, _NOTHING) is not was):
                self.rest.append(e)
                continue
            self._holders.append(container)
            self._keys.append(place.key)
            self._objects.append(was)
            self._refs.append(place.module if place.outside is None else None)
        self._looked = bytearray(16 * len(self._holders))

    def unmoved(self) -> list[Entry] | None:
        """The entries still to read by `moved` (`rest`) when every other one holds what
        was pinned; None: the pass does not hold, read them all."""
        native = self._native
        if native is None or not self._holders:
            return self.rest
        if native.alive(self._refs) and native.same_items(
                self._holders, self._keys, self._objects, self._looked):
            return self.rest
        return None


_NOTHING = object()


def still_held(e: Entry) -> bool:
    witnessed = e.tensor()
    return witnessed is not None and read_place(e.site) is witnessed


def read_place(site: Place) -> object:
    """What `site` holds now (None if the way to it is gone)."""
    container = site.container()
    if container is None:
        return None
    try:
        value = container[site.key]
        for key in site.chain:
            value = step(value, key)
    except (KeyError, IndexError, AttributeError, ValueError, TypeError):
        return None
    return value


UNTRACED = ("a number the bring-up set in Python from numbers it took from the weights "
            "(`1.0 / s.item()`): how it was computed is not followed, so it cannot be "
            "recomputed (it is guarded: stale once its weights are written and the post-load "
            "step did not run again, refused once changed since the capture)")

UNRECORDED = ("a later load that was not recorded made it: which ops computed it from its "
               "weights is not known, so it cannot be recomputed (GRAPHSAFE_PROVENANCE=all "
               "records every load)")


def refusal(e: Entry) -> str | None:
    """Why `e` cannot be recomputed in place, or None."""
    if e.kind == "scalar":
        return ("it is a Python number a captured graph bakes in: it cannot be refreshed in "
                "place (re-run the engine's post-load processing, then re-capture)")
    held = e.held()
    if held is None:
        return "it is no longer held"
    if e.writer is None:
        return UNRECORDED
    if e.opaque:
        return ("its chain went through a value that left torch (a kernel handle): it "
                "cannot be refreshed in place")
    first, second = e.recompute(), e.recompute()
    if first is None or second is None:
        return "its recorded chain cannot be run again (a constant it read is gone)"
    if not (torch.equal(first, second) and torch.equal(first, held)):
        return "running its recorded chain again does not give what the model holds, bitwise"
    return None
