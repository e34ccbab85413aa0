"""Engine-derived state of one model: what its loads computed from its weights without a
declaration, kept like a derivation.

After every observed load the runtime hands its recorded lineage here (`settle`). Each
tensor the model holds that the load computed from its weights is an entry, with a
witness of each source (identity, pointer, `_version`, journal epoch) taken then. An
entry is stale once a source is written or rebound after that (a bare `load_weights` that
skips the engine's post-load step); one the next load computes again (re-derived in
place, or made anew) is witnessed anew. Entries are checked with the guard's freshness
check, through one flat comparison of all witnesses; an entry no graph reads blocks
nothing, and an exempted one is never checked.

Entries are of three kinds: a tensor; a Python number taken from the weights (`.item()`,
`float()`, `int()`, `bool()`) that the model keeps where its forward reads it (a
`scalar`: a captured graph bakes it into its kernels' arguments); and a value an engine's
op made from the weights that left torch (a `handle`: a `ScriptObject` of prepacked
weights, an opaque object). A graph holds a scalar's value and a handle's identity as it
holds a tensor's address: from the pin on, a scalar whose value changed, or a handle
rebuilt, is refused like a moved tensor (`StorageMovedError`), naming where it is kept
and the weight it came from. A load that writes a scalar's sources and leaves the value
the sources give now is not a fault (the scalar is recomputed to tell).

A weight the recorded load rewrote in place after loading it, by ops over the model's
state (a scale folded in, `1 + w`, a layout interleaved or prepacked: `rewritten`), holds
derived state in the parameter itself. Every later load must write it the way the first
did: loaded values, then the same rewrite. A load whose last writes into it are not
(raw values with the rewrite not re-applied, or the rewrite alone, over its own output:
a fold applied twice) is refused naming the weight and the ops, and the weight stays
refused until a load writes it whole again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from graphsafe._errors import GraphSafetyError
from graphsafe._lineage.entries import (
    AuditItem,
    Entry,
    PinnedValues,
    read_place,
    ref_to,
    refusal,
    still_held,
)
from graphsafe._lineage.later import LaterValues, Taken, taken_again
from graphsafe._lineage.outside import find_outside, find_outside_values
from graphsafe._lineage.record.recorder import RECORDING, Lineage
from graphsafe._lineage.record.threads import STRAYS
from graphsafe._lineage.refusals import (
    STRAY,
    UNFOLLOWED,
    moved_error,
    stale_error,
    strays,
    unfollowed,
    warn_strays,
    warn_unfollowed,
    warn_untraced,
)
from graphsafe._lineage.resolve import (
    Foreign,
    Source,
    find,
    find_rewrites,
    find_tainted,
    find_values,
    foreign_keys,
    foreign_sources,
    made_sources,
    sources_of,
    staged_sources,
    trace,
    untraced_numbers,
)
from graphsafe._lineage.rewrites import Rewrites, Rewritten, rewritten_error
from graphsafe._lineage.window import TAIL_EPOCH, Window, sweep
from graphsafe._memory.journal import Journal
from graphsafe._memory.snapshot import PLAIN, Witnesses
from graphsafe._memory.walk import Reach, ValueSite, Wanted, storage_key

__all__ = ["AuditItem", "Discovered", "Discovery", "moved_error", "stale_error", "values_wanted"]


class Discovered(BaseModel):
    """One tensor a model derived from its weights without a declaration
    (`Runtime.discovered`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Where the model holds it (`lm_head.quant_method.kernel.packed`, `<cell>` steps for
    closures)."""
    kind: str = "tensor"
    """`tensor`, `scalar` (a Python number taken from the weights), `handle` (a value
    that left torch: a kernel handle, a `ScriptObject`) or `rewritten` (a weight the
    post-load step rewrote in place: every later load must write it the same way)."""
    module_class: str
    """Class of the module it hangs off."""
    sources: tuple[str, ...]
    """Dotted paths of the weights it was computed from (another model's led by its
    class: `Target:lm_head.weight`)."""
    chain: str
    """How: the op chain from the first source (shortened)."""
    opaque: bool
    """Whether a value left torch on the way (a kernel handle): it cannot be recomputed."""
    exempt: str | None
    """Why it is exempted (`Runtime.exempt`), or None: checked."""
    stale: str | None
    """Why it no longer matches its sources (a source written since), or None."""
    adopted: bool
    """Whether stale values are recomputed in place (`Runtime.adopt`)."""
    refused: str | None
    """Why `Runtime.adopt` refused it, if it did."""


class Discovery:
    """The discovered entries of one model, their witnesses and exemptions.

    Args:
        journal: Whose epochs the witnesses take.
    """

    def __init__(self, journal: Journal,
                 others: Callable[[nn.Module], Iterable[Foreign]] = lambda _: (),
                 declared: Callable[[], Iterable[str]] = tuple) -> None:
        self._journal = journal
        self._others = others
        """The weights of the other models graphsafe binds, given this one: they are
        sources too (a draft that packs or copies its head from the target's, by
        reference)."""
        self._declared = declared
        """Paths of the model's declared derived buffers (sources, never discovered)."""
        # The recording of the load in progress, and the other models' weights as it began.
        self._began: tuple[weakref.ref[Lineage], list[Foreign]] | None = None
        self._entries: list[Entry] = []
        self._values: list[Entry] = []  # the numbers and handles among them
        # Their check before each replay while pinned; built at the first, dropped
        # whenever the entries or their pins change.
        self._pinned_values: PinnedValues | None = None
        self._exempt: dict[str, str] = {}
        self._witnesses: Witnesses | None = None
        self._owner: list[int] = []  # witness row -> entry index
        self._recorded = False
        self._rewritten = Rewrites(journal)  # weight path -> its rewrite
        self._window: Window | None = None  # the bring-up's forwards, until the capture
        # What a recording could not follow (weights read as NumPy arrays, numbers made
        # in Python from taken ones) -> (the weights' paths, why), for the audit.
        self._unfollowed: dict[str, tuple[tuple[str, ...], str]] = {}
        self._later = LaterValues()  # what a later load's numbers are told new against
        self.generation = 0
        """Bumped whenever the entries or the rewritten weights change (what the
        process-wide write observer must watch: `source_keys`)."""

    def __len__(self) -> int:
        return len(self._entries) + len(self._rewritten)

    # -- after a load -----------------------------------------------------------------

    def wants_record(self) -> bool:
        """Whether the model's next load is recorded: the first observed one (every one
        under `GRAPHSAFE_PROVENANCE=all`; none under `off`)."""
        mode = RECORDING[0]
        return mode == "all" or (mode == "first" and not self._recorded)

    def take(
        self, lineage: Lineage, model: nn.Module, reach: Callable[[], Reach], *,
        bring_up: frozenset[int] | None = None,
    ) -> None:
        """A recorded load of the model completed (or an engine's first load, recorded
        before the model was known): settle what `lineage` found; the model counts as
        recorded from now on. With `bring_up` (the storage keys of its weights), the
        first recording stays open over the model's forwards until its first capture
        (`close_window`); else it is forgotten. `reach()` walks the model (called once:
        what it gives is shared by every step; values it found for `values_wanted`
        spare their walks)."""
        once = _once(reach)  # not kept past this call: the walk holds the model's modules
        self.settle(lineage, model, once, weights=bring_up)
        self._recorded = True
        self._later.walked(model, lambda: once().values)
        if bring_up is not None and self._window is None and RECORDING[0] != "off":
            ref = weakref.ref(model)

            def full() -> None:  # the most forwards a bring-up records: it ends
                now = ref()
                if now is not None:
                    self.close_window(now, reach)

            def tail(lineage: Lineage) -> None:  # recorded after the load: as the load's
                now = ref()
                if now is not None:
                    walked = _once(reach)
                    self.settle(lineage, now, walked, weights=bring_up, tail=True)
                    self._later.walked(now, lambda: walked().values)

            self._window = Window(model, lineage, bring_up, full, tail)
        else:
            lineage.release()

    def flush_tail(self) -> None:
        """What the bring-up recorded after its first load so far is settled (see
        `Window.flush_tail`)."""
        if self._window is not None:
            self._window.flush_tail()

    def close_window(self, model: nn.Module, reach: Callable[[], Reach]) -> None:
        """The model's bring-up ended (its first capture ended, an engine that captured
        its own graphs pinned it, a later load began, or it ran `FORWARDS` forwards): what
        its forwards made lazily from the weights is discovered."""
        sweep()  # the tails of dropped models: left at the next load, pin or capture
        window, self._window = self._window, None
        if window is not None:
            window.close(lambda lineage: self.settle(lineage, model, reach, lazily=True))

    def sequenced_keys(self, model: nn.Module) -> frozenset[int]:
        """`Rewrites.sequenced_keys` of a load of `model` that begins, each weight read
        where the model holds it now (`Rewrites.rehome`)."""
        self._rehome_rewrites(model)
        self._rewritten.written_outside()  # before this load's own writes
        return self._rewritten.sequenced_keys()

    def _rehome_rewrites(self, model: nn.Module) -> None:
        if self._rewritten:
            self._rewritten.rehome({s.path: s for s in sources_of(model).values()})

    def judge_rewrites(
        self, model: nn.Module, written: Set[int], ops: Mapping[int, Sequence[str]],
        before: Mapping[str, int] | None = None,
        tainted: Mapping[int, tuple[tuple[int, ...], str]] | None = None,
    ) -> list[Rewritten]:
        """`Rewrites.judge` of a load of `model` that ended, exemptions left out; each
        weight and input read where the model holds it now (`Rewrites.rehome`)."""
        self._rehome_rewrites(model)
        broken = self._rewritten.judge(written, ops, before, tainted, self._exempt)
        self._rewritten.witness()  # this load's writes are judged
        return broken

    def written_elsewhere(self, keys: Set[int]) -> None:
        """`Rewrites.written_elsewhere`: a load of another model wrote `keys`."""
        self._rewritten.written_outside()
        self._rewritten.written_elsewhere(keys)
        self._rewritten.witness()

    def after_load(self, model: nn.Module, written: Set[int],
                   tainted: Mapping[int, tuple[tuple[int, ...], str]] | None = None,
                   reach: Callable[[], Reach] | None = None,
                   taken: Sequence[Taken] = ()) -> None:
        """A load that was not recorded completed, writing the storages `written`: each
        source is read where the model holds it now (`rehome`), and what the load
        re-derived or rebuilt is witnessed anew (`follow`). What it computed from the
        weights (`tainted`, its tracker's) that the model holds in a new place (`reach()`)
        is taken as found, with the weights it came from (its ops are not known); so are
        the numbers it took from them and the handles ops made of them (`taken`) that the
        model keeps in a new place (`LaterValues.found`)."""
        if self._entries:
            self.rehome(model)
            self.follow(written, taken)
        known = {e.path for e in self._entries} | self._rewritten.keys()
        if taken:
            self._add(self._later.found(model, taken, known))
        if tainted and reach is not None:
            found = find_tainted(reach().sites, sources_of(model), tainted, known)
            self._add(Entry.many(found))

    def settle(
        self, lineage: Lineage, model: nn.Module, reach: Callable[[], Reach], *,
        lazily: bool = False, weights: frozenset[int] | None = None, tail: bool = False,
    ) -> None:
        """Take what a completed load recorded: entries it computed (anew or again) are
        witnessed now; the rest keep their witnesses. `reach()` gives every tensor the
        model holds (a walk, called once), and the values it keeps where `values_wanted`
        asked for them. `weights`: the storage keys of the model's weights when the
        recorded load began (a parameter it created is no weight, where the recording
        computed it from them). `lazily`: what the bring-up's forwards recorded: only
        tensors last written before the last forward, and not found already, are taken
        (what the last forward wrote again, every forward computes). `tail`: what the
        bring-up recorded after the load returned (`Window.tail`, its records of epoch
        `TAIL_EPOCH`), taken as the load's, but for weights rewritten in place (a step that
        rewrites weights there runs again after each load, where no load sees it) and
        floats set in Python, which are not found; an entry found already that it did not
        write again keeps its state (adopted, witnesses)."""
        began, self._began = self._began, None  # not held past the load it began with
        alive = lineage.alive()
        if (not alive and not lineage.values and not lineage.weight_writes
                and not lineage.unfollowed and not lineage.strays):
            return
        sources = sources_of(model)
        foreign = self._foreign(model, sources, None if tail or lazily or began is None
                                or began[0]() is not lineage else began[1])
        modules = list(model.modules())
        derived = frozenset(
            sid for m in modules for name in m._non_persistent_buffers_set
            if isinstance(b := m._buffers.get(name), torch.Tensor) and (sid := _sid(b)))
        rewrites = find_rewrites(lineage, sources, derived) if not (tail or lazily) else ()
        if rewrites:  # few loads rewrite weights: their modules' classes named for them
            classes = {id(m._parameters): type(m).__name__ for m in modules}
            classes.update((id(m._buffers), type(m).__name__) for m in modules)
            for rewrite in rewrites:
                self._rewritten[rewrite.weight.path] = Rewritten(
                    rewrite, classes.get(id(rewrite.weight.holder), type(model).__name__))
        if not (tail or lazily) and self._rewritten:
            self._rewritten.witness()
            self.generation += 1
        for sid in made_sources(lineage, model, sources, foreign, alive, weights,
                                set(self._declared())):
            del sources[sid]  # derived state the model holds as a buffer: found below
        if foreign:
            # A weight of its own last written from another model's weights (a draft
            # copying the target's head into its own) is derived from them, not loaded.
            for sid in [sid for sid in sources if sid in lineage.writers and sid in alive]:
                if trace(lineage.writers[sid][0], foreign)[0]:
                    del sources[sid]
        sources.update(staged_sources(lineage.copied, sources, foreign))
        sources = {**foreign, **sources}
        reads = unfollowed(lineage, sources)
        if reads:  # what is made of them cannot be followed: said, and listed unchecked
            self._unfollowed.update((how, (p, UNFOLLOWED)) for how, p in reads.items())
            warn_unfollowed(reads, type(model).__name__)
        stray = strays(lineage, sources)
        candidates = alive - sources.keys()
        if not candidates and not lineage.values and not stray:
            return
        reach = _once(reach)
        found = {f.site.path: f for f in find(lineage, reach().sites, sources, candidates)}
        if stray:  # what threads not followed made, held by the model: found by its taint
            known = {e.path for e in self._entries} | found.keys()
            made = find_tainted(reach().sites, sources, STRAYS.tainted(), known)
            self._unfollowed.update((how, (p, STRAY)) for how, p in stray.items())
            warn_strays(stray, [f.site.path for f in made], type(model).__name__)
        else:
            made = []
        if lazily:
            known = {e.path for e in self._entries}
            found = {p: f for p, f in found.items()
                     if f.writer and 1 <= f.writer[0].epoch < lineage.epoch
                     and p not in known}
            found.update((f.site.path, f) for f in made)
            # A number or handle a forward took and the model keeps (cached on first use:
            # `self._s = self.k_scale.item()`) is baked into a graph whichever forward
            # took it, the capture's included: no replay takes it again.
            found.update((f.site.path, f) for f in find_values(
                lineage, model, sources, reach().values)
                if f.writer and f.writer[0].epoch >= 1 and f.site.path not in known)
            if not found:
                return
        else:
            found.update((f.site.path, f) for f in made)
            held = reach().values
            values = find_values(lineage, model, sources, held)
            values += find_outside_values(lineage, model, sources,
                                          (id(f.site.value) for f in values
                                           if isinstance(f.site, ValueSite)))
            found.update((f.site.path, f) for f in values)
            # After the load returned, floats set in Python are the caller's as often as
            # the post-load step's: not taken for numbers computed from taken ones.
            untraced = [] if tail else untraced_numbers(lineage, model, sources, found, held)
            if tail:  # what the load found, and the tail did not write again, stays as is
                known = {e.path for e in self._entries}
                found = {p: f for p, f in found.items() if p not in known or (
                    f.writer is not None and f.writer[0].epoch == TAIL_EPOCH)}
                if not found:
                    return
            if untraced:  # numbers computed in Python from taken ones: said, guarded
                found.update((f.site.path, f) for f in untraced)
                warn_untraced({f.site.path: tuple(s.path for s in f.sources)
                               for f in untraced}, type(model).__name__)
        kept = [e for e in self._entries if e.path not in found and still_held(e)]
        fresh = Entry.many(found.values())
        if self._later.pinned:  # found at the capture's end: the graph holds them now
            for e in fresh:
                if e.kind != "tensor":
                    e.pinned = ref_to(e.value())
        self._add(fresh, kept)

    def _foreign(self, model: nn.Module, own: dict[int, Source],
                 given: list[Foreign] | None = None) -> dict[int, Source]:
        """The other bound models' weights `model` does not hold (`own`: its sources): as
        they were `given` to a load's recording as it began (`foreign_keys`), but where
        one of them was loading in another thread then (read again)."""
        if given is not None and not any(other.loading for other in given):
            return foreign_sources(given, own)
        return foreign_sources(self._others(model), own)

    def take_inputs(self, model: nn.Module, tensors: Sequence[torch.Tensor]) -> None:
        """A capture of `model` read `tensors`, which no model holds: those the bring-up
        saw computed from the weights (a process-wide cache of packed weights) are
        guarded from now on, like what the model holds."""
        window = self._window
        if window is None or not tensors:
            return
        sources = sources_of(model)
        sources = {**self._foreign(model, sources), **sources}
        known = {e.path for e in self._entries}
        fresh = Entry.many(f for f in find_outside(window.lineage, model, tensors, sources)
                           if f.site.path not in known)
        self._add(fresh)

    def outside_keys(self) -> dict[int, str]:
        """Storage key -> path of each tensor held outside the model (a load watches
        them: one it re-derives in place is witnessed anew)."""
        return {k: e.path for e in self._entries
                if e.site.outside is not None and (k := e.key())}

    def foreign_keys(self, model: nn.Module, own: frozenset[int],
                     lineage: Lineage | None = None) -> frozenset[int]:
        """Storage keys of the other bound models' weights `model` does not hold (`own`:
        the storage keys of its parameters and buffers); for a recording: a copy from
        one is a derivation. Kept for `lineage`'s settle (see `_foreign`)."""
        others = list(self._others(model))
        if lineage is not None:
            self._began = (weakref.ref(lineage), others)
        return foreign_keys(others, own)

    def follow(self, written: Set[int], taken: Sequence[Taken] = ()) -> None:
        """After a load that was not recorded: an entry it wrote (re-derived in place), or
        whose place now holds a tensor the last load that ended did not leave there
        (rebuilt by this load's post-load step, from the same sources), is witnessed
        anew; the others keep their witnesses. Told apart by the tensor objects (held
        weakly), never by address: a storage freed in the load may be reused by the new
        one. A number found without its ops holds when the load took it again from its
        sources (`taken`)."""
        rows = self._rows_by_entry()
        again: list[int] = []
        for i, e in enumerate(self._entries):
            now = read_place(e.site)
            if e.kind == "scalar":
                # Its sources written, or the number taken again (the post-load step
                # re-ran over sources this load did not write): the value they give now.
                again_taken = now is not e.seen()
                if (again_taken or not written.isdisjoint(e.source_keys())) and (
                        e.scalar_holds() if e.writer is not None
                        else taken_again(e, now, taken)):
                    e.tensor = e.seen = ref_to(now)
                    again.extend(rows.get(i, []))
            elif e.kind == "handle":
                if now is not e.seen():  # made anew where it was, by this load
                    e.tensor = e.seen = ref_to(now)
                    again.extend(rows.get(i, []))
            elif isinstance(now, torch.Tensor) and now is not e.seen():
                e.tensor = e.seen = weakref.ref(now)  # rebuilt where it was, by this load
                again.extend(rows.get(i, []))
            elif e.key() in written:
                again.extend(rows.get(i, []))
        if again and self._witnesses is not None:
            self._witnesses.record(again)

    def failed(self) -> None:
        """A load failed: what it left at each entry's place is seen, and not taken for
        fresh by the next load (its witnesses stay as stale as the failure left them)."""
        self._began = None
        for e in self._entries:
            now = read_place(e.site)
            if e.kind != "tensor":
                e.seen = ref_to(now)
            elif isinstance(now, torch.Tensor):
                e.seen = weakref.ref(now)

    def rehome(self, model: nn.Module) -> None:
        """Read each source where the model holds it now: a module replaced since (a new
        `emb`) shows as its weights rebound, so what was computed from the old one is
        stale; a weight rewritten in place whose module, or a module of an input of its
        rewrite, was replaced is left wrong (`Rewrites.rehome`)."""
        if not self._entries and not self._rewritten:
            return
        now = {s.path: s for s in sources_of(model).values()}
        self._rewritten.rehome(now)
        moved = False
        for e in self._entries:
            srcs = []
            for s in e.sources:
                here = now.get(s.path)
                if here is not None and here.holder is not s.holder:
                    s, moved = s._replace(holder=here.holder), True
                srcs.append(s)
            e.sources = tuple(srcs)
        if moved and self._witnesses is not None:
            rows = list(range(len(self._owner)))
            sites = [(s.holder, s.key) for e in self._entries for s in e.sources]
            self._witnesses = self._witnesses.carried(sites, rows)

    def _add(self, fresh: list[Entry], kept: list[Entry] | None = None) -> None:
        """Entries `fresh` join those `kept` (None: all held now); each kept one keeps
        its witnesses."""
        if not fresh and kept is None:
            return
        by_entry = self._rows_by_entry()
        old_rows = {id(e): by_entry.get(i, []) for i, e in enumerate(self._entries)}
        self._entries = (self._entries if kept is None else kept) + fresh
        self._rebuild(old_rows)
        self.generation += 1

    def _rows_by_entry(self) -> dict[int, list[int]]:
        by_entry: dict[int, list[int]] = {}
        for row, i in enumerate(self._owner):
            by_entry.setdefault(i, []).append(row)
        return by_entry

    def _rebuild(self, old_rows: dict[int, list[int]]) -> None:
        self._values = [e for e in self._entries if e.kind != "tensor"]
        self._pinned_values = None
        sources = [e.sources for e in self._entries]
        sites: list[tuple[dict[str, object], str]] = [
            (src.holder, src.key) for each in sources for src in each]
        owner = [i for i, each in enumerate(sources) for _ in each]
        rows: list[int | None] = [None] * len(sites)  # none kept: recorded now
        if any(old_rows.values()):  # entries kept: each keeps its own sites' rows
            rows = []
            for e, each in zip(self._entries, sources, strict=True):
                before = old_rows.get(id(e), [])
                rows += [before[j] if j < len(before) else None for j in range(len(each))]
        old = self._witnesses
        if old is None or not sites:
            self._witnesses = Witnesses(sites, self._journal) if sites else None
        else:
            self._witnesses = old.carried(sites, rows)
        self._owner = owner

    # -- what the user reads and decides ---------------------------------------------

    def exempt(self, path: str, why: str, model_class: type) -> None:
        """Exempt the entry at `path` from every check (and the audit)."""
        if not why.strip():
            raise GraphSafetyError(
                "an exemption needs a reason",
                module_class=model_class.__name__, path=path,
                expected='`rt.exempt(path, why="...")` with why it may differ from its sources',
                got="an empty reason",
                fix="say why: the reason is listed with the exemption in `rt.discovered`",
            )
        if not any(e.path == path for e in self._entries) and path not in self._rewritten:
            known = ", ".join(e.path for e in self._entries[:6]) or "none"
            raise GraphSafetyError(
                f"{path!r} is not a tensor the model derived without a declaration",
                module_class=model_class.__name__, path=path,
                expected=f"one of the discovered paths: {known}",
                got=path,
                fix="pick a path from `gs.runtime(model).discovered`",
            )
        self._exempt[path] = why

    def adopt(self, paths: Iterable[str] | None) -> None:
        """Recompute stale values of the entries at `paths` (None: all) in place from now
        on, where the recorded chain is a pure function of its sources: run twice, both
        results must equal what the model holds, bitwise. Refusals are kept (`refused`)."""
        wanted = None if paths is None else set(paths)
        for e in self._entries:
            if wanted is not None and e.path not in wanted:
                continue
            e.adopted, e.refused = False, refusal(e)
            if e.refused is None:
                e.adopted = True

    def info(self) -> tuple[Discovered, ...]:
        """What was discovered, with sources, how, and why stale (what the bring-up's
        tail recorded so far included)."""
        self.flush_tail()
        stale = dict(self._stale_rows(None, exempted=True))
        out = []
        for i, e in enumerate(self._entries):
            out.append(Discovered(
                path=e.path, kind=e.kind, module_class=e.module_class,
                sources=e.source_paths(), chain=e.chain, opaque=e.opaque,
                exempt=self._exempt.get(e.path), stale=stale.get(i),
                adopted=e.adopted, refused=e.refused,
            ))
        for r in self._rewritten.values():
            out.append(Discovered(
                path=r.path, kind="rewritten", module_class=r.module_class,
                sources=r.sources, chain=r.chain, opaque=False,
                exempt=self._exempt.get(r.path), stale=r.broken, adopted=False,
                refused="a weight rewritten in place holds no input to recompute it from",
            ))
        return tuple(out)

    def source_keys(self) -> frozenset[int]:
        """Storage keys of every source, and of every weight rewritten in place and what
        its rewrite reads (for the process-wide write observer)."""
        sites = [(s.holder, s.key) for e in self._entries for s in e.sources]
        for r in self._rewritten.values():
            sites.append(r.site)
            sites.extend((holder, key) for _, holder, key in r.inputs)
        with PLAIN():
            return frozenset(
                storage_key(t) for holder, key in sites
                if isinstance(t := holder.get(key), torch.Tensor)
            )

    def audit_items(self) -> list[AuditItem]:
        """Every entry not exempted, for the content audit, each with why the guard
        holds it stale (where it does)."""
        self.flush_tail()
        broken = {r.path: r.broken for r in self.broken_rewrites()}
        items: list[AuditItem | None] = [
            AuditItem(r.path, torch.empty(0), lambda: None, r.sources, False,
                      why="a weight the post-load step rewrote in place: the loaded values "
                      "it was computed from are gone (the guard checks every later load's "
                      "writes into it instead)", stale=broken.get(r.path) or "")
            for r in self._rewritten.values() if r.path not in self._exempt
        ]
        items += [AuditItem(what, torch.empty(0), lambda: None, paths, True, why=why)
                  for what, (paths, why) in self._unfollowed.items()]
        stale = dict(self._stale_rows(None))
        for i, e in enumerate(self._entries):
            item = e.audit_item() if e.path not in self._exempt else None
            items.append(item if item is None or i not in stale
                         else item._replace(stale=stale[i]))
        return [i for i in items if i is not None]

    # -- the guard's check ------------------------------------------------------------

    def pin(self) -> None:
        """A graph holds the model from now on: what each scalar and handle is now is what
        it holds (and the numbers the model keeps are what a later load's are told new
        against)."""
        for e in self._values:
            if e.pinned is None:
                e.pinned = ref_to(e.value())
        self._pinned_values = None
        self._later.pin()

    def unpin(self) -> None:
        """No graph holds the model any more."""
        self._later.unpin()
        for e in self._entries:
            e.pinned = None
        self._pinned_values = None

    def unchanged(self) -> bool:
        """The flat check: no source of any entry written or rebound since."""
        w = self._witnesses
        return w is None or w.unchanged()

    def broken_rewrites(self) -> list[Rewritten]:
        """The weights rewritten in place that a load, or a write outside any load, left
        wrong, not exempted."""
        if self._rewritten:
            self._rewritten.written_outside()
        return self._rewritten.broken(self._exempt)

    def _stale_rows(
        self, reads: frozenset[int] | None, *, exempted: bool = False
    ) -> list[tuple[int, str]]:
        """(entry index, why) per stale entry that is checked (read; not exempted, unless
        `exempted`)."""
        w = self._witnesses
        if w is None or w.unchanged():
            return []
        out: dict[int, str] = {}
        rows = self._rows_by_entry()
        for row, how in w.changed(by_journal=True):
            i = self._owner[row]
            e = self._entries[i]
            if i in out or (e.path in self._exempt and not exempted):
                continue
            if reads is not None and e.kind == "tensor" and e.key() not in reads:
                continue  # a graph reads a number or a handle through its kernels' arguments
            src = e.sources[rows[i].index(row)]
            out[i] = f"its source {src.path} was {how}"
        return sorted(out.items())

    def check_values(self, model_class: type) -> None:
        """Raise `StorageMovedError` for a scalar whose value, or a handle whose object,
        changed since the pin (a graph holds the old one). Like a moved tensor, checked
        before anything is repaired: a refused replay refreshes nothing."""
        pinned = self._pinned_values
        if pinned is None:
            pinned = self._pinned_values = PinnedValues(self._values)
        values = pinned.unmoved()  # one compiled pass where nothing moved
        moved = [(e, how) for e in (self._values if values is None else values)
                 if e.pinned is not None and e.path not in self._exempt
                 and (how := e.moved()) is not None]
        if moved:
            raise moved_error(model_class, moved)

    def check(self, model_class: type, reads: frozenset[int] | None, *, repair: bool) -> None:
        """Raise `StaleError` for a weight rewritten in place that a load left wrong, then
        for every checked stale entry (repairing adopted ones first when `repair`); the
        caller ran `check_values` first."""
        broken = self.broken_rewrites()
        if broken:
            raise rewritten_error(broken)
        if self.unchanged():
            return
        stale = self._stale_rows(reads)
        if repair:
            stale = [(i, why) for i, why in stale if not self._repair(i)]
        if stale:
            stale = [(i, why) for i, why in stale if not self._again(i)]
        if stale:
            raise stale_error(model_class, [(self._entries[i], why) for i, why in stale])

    def _again(self, i: int) -> bool:
        """Entry `i`, stale by its witnesses, holds what its sources give now (a
        post-load step run after the load re-derived it in place): witnessed anew."""
        if not self._entries[i].holds_again():
            return False
        assert self._witnesses is not None
        self._witnesses.record(self._rows_by_entry().get(i, []))
        return True

    def _repair(self, i: int) -> bool:
        e = self._entries[i]
        held = e.held()
        if not e.adopted or held is None:
            return False
        value = e.recompute()
        if value is None:
            return False
        with torch.no_grad():
            held.copy_(value)
        assert self._witnesses is not None
        self._witnesses.record(self._rows_by_entry().get(i, []))
        return True


def values_wanted(lineage: Lineage) -> Wanted:
    """What `Discovery.take` reads of the values a model keeps, after a recorded load
    that made `lineage`: its numbers, and the values the recording saw leave torch (a walk
    that finds them as it finds tensors spares a walk of its own for each)."""
    return Wanted(_NUMBERS, lineage.values)


_NUMBERS = frozenset({int, float, bool})


def _once(fn: Callable[[], Reach]) -> Callable[[], Reach]:
    """`fn`, called at most once: every later call gives the first call's walk."""
    done: list[Reach] = []

    def once() -> Reach:
        if not done:
            done.append(fn())
        return done[0]

    return once


def _sid(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return 0


