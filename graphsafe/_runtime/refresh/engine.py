"""The engine: executes one binding (materialize, refresh in place, check).

The runtime decides *when* (loads, updates, pins); the engine decides *what* and does
it: which derivations a set of writes makes dirty, the order to run them, the hot loop
that writes each result straight into its buffer, and the checks that refuse a result
or a write before it lands. It owns the state of the derived buffers: which are stale and
why, and the report of the last refresh; where they and their inputs live, and what
changed there, is its `Watch`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence, Set

import torch

from graphsafe._declare.spec import RawEntry, RawIdentity, RefreshReport
from graphsafe._errors import DerivationDriftError, one_line
from graphsafe._memory.journal import Journal
from graphsafe._memory.snapshot import Witnesses
from graphsafe._memory.walk import storage_key
from graphsafe._runtime.bind.binding import Binding, BoundDerivation
from graphsafe._runtime.bind.model_map import ModelStorages
from graphsafe._runtime.refresh.checks import geometry_held, rebound_error, refuse_resized
from graphsafe._runtime.refresh.materialize import (
    FAST,
    SLOW,
    copy_apart,
    materialize,
    refresh_checked,
)
from graphsafe._runtime.transient.transients import Transients
from graphsafe._runtime.writes.observer import quiet
from graphsafe._runtime.writes.watch import Watch

__all__ = ["Engine"]

_MATERIALIZED, _REFRESHED, _FAILED = 0, 1, 3
_NONE = 2  # no path taken: the derivation failed


class Engine:
    """Derived buffers of one binding (`bind`'s plan), and how to bring them up to date.

    `model_tensors` returns `{storage key: path}` of every model tensor (for the purity
    and read checks; a `ModelStorages` walks the model only when a check asks); failures
    poison storage in `journal`; `strict` checks purity on every refresh, not only at
    materialization.
    """

    def __init__(
        self,
        binding: Binding,
        model_tensors: Callable[[], ModelStorages | dict[int, str]],
        *,
        journal: Journal,
        strict: bool = False,
    ) -> None:
        self.binding = binding
        self.bound = binding.bound
        self.journal = journal
        self._strict = strict
        self._model_tensors = model_tensors
        # Derivations whose buffers do not match their inputs (failed, never made), and
        # why, when known.
        self.stale: set[int] = {b.index for b in self.bound}
        self.reasons: dict[int, str] = {}
        self.last_report: RefreshReport | None = None
        self._identities: list[RawIdentity] = [
            (b.path, b.spec.name, b.out_paths, 0) for b in self.bound
        ]
        self._frozen_identities: tuple[RawIdentity, ...] | None = None
        self._reallocated: set[int] = set()
        self.transients = Transients(self.bound)  # held only while a load writes them
        self.watch = Watch(binding, journal)

    # -- what is dirty ---------------------------------------------------------------

    @property
    def witnesses(self) -> Witnesses:
        """The witnesses of every resident input and buffer."""
        return self.watch.witnesses

    def consumers_of(self, keys: Iterable[int]) -> set[int]:
        """Indices of the derivations reading any of the storages `keys` directly."""
        return self.watch.consumers_of(keys)

    def witness_dirty(self) -> dict[int, str]:
        """Derivation index -> how its input or buffer changed since it was refreshed."""
        return self.watch.witness_dirty()

    def reads_poisoned(self, also: frozenset[int]) -> bool:
        """Whether a failure poisoned storage this engine (or `also`) reads."""
        poisoned = self.journal.poisoned_keys()  # few keys, where their bytes are now
        return bool(poisoned) and not (
            self.watch.storage_keys().isdisjoint(poisoned) and also.isdisjoint(poisoned)
        )

    def scan_moved(self, pinned: bool) -> set[int]:
        """Derivations whose inputs or buffers were rebound since the last refresh.

        Before pin the new tensors are taken (inputs) or the buffers made anew from the
        derivation (a buffer converted by `.half()` or `.to()`), and the derivations must
        run; after it, a rebinding marks them stale and raises `StorageMovedError`.
        `RegistrationError`: an input is gone (deleted, None, parametrized).
        """
        moved_inputs, moved_buffers = self.watch.moved()
        dirty: set[int] = set()
        if not moved_inputs and not moved_buffers:
            return dirty
        if pinned:
            err = rebound_error(moved_inputs, moved_buffers, self.bound)
            for inp in moved_inputs:
                self.mark_stale(inp.consumers, err.summary)
            self.mark_stale((b.index for b, _ in moved_buffers), err.summary)
            raise err
        for inp in moved_inputs:
            before = inp.container
            try:
                inp.accept()
            except BaseException as exc:
                self.mark_stale(inp.consumers, str(exc).splitlines()[0])
                raise
            if inp.container is not before:  # a plain attribute became a Parameter, ...
                for i in inp.consumers:
                    self.bound[i].rehome(before, inp.container, inp.key)
            dirty.update(inp.consumers)
        for b, _ in moved_buffers:
            # The derivation, not a module conversion, decides a buffer's dtype: make it
            # anew from the inputs (the old storage is no graph's: nothing is pinned).
            b.drop_buffers()
            self._reallocated.add(b.index)
            dirty.add(b.index)
        self.watch = self.watch.renewed()
        return dirty

    def stale_reasons(self, in_update: Set[int]) -> dict[int, str]:
        """Stale derivation index -> why, from every source, downstream included;
        `in_update`: storage keys written by a load or update that has not ended."""
        found = {i: self.reasons.get(i, "not materialized or not refreshed") for i in self.stale}
        for i, how in self.witness_dirty().items():
            found.setdefault(i, how)
        moved_inputs, moved_buffers = self.watch.moved()
        for inp in moved_inputs:
            for i in inp.consumers:
                found.setdefault(i, f"{inp.path} was rebound")
        for b, j in moved_buffers:
            found.setdefault(b.index, f"{b.out_paths[j]} was rebound")
        for i in self.consumers_of(in_update):
            found.setdefault(i, "written inside a weight update that has not ended")
        poisoned = self.journal.poisoned_among(self.watch.storage_keys())
        if poisoned:
            for b in self.bound:
                for t in b.buffers or ():
                    why = poisoned.get(storage_key(t))
                    if why is not None:
                        found.setdefault(b.index, why)
        out: dict[int, str] = {}
        for i in sorted(found):
            for j in self.bound[i].downstream:
                out.setdefault(j, found[i])
        return out

    def closure(self, dirty: Iterable[int]) -> list[int]:
        """`dirty`, everything downstream of it, and whatever is stale, in topological
        order."""
        bound = self.bound
        todo: set[int] = set()
        for i in (*dirty, *self.stale):
            todo.update(bound[i].downstream)
        return sorted(todo)

    def set_strict(self, strict: bool) -> None:
        """Check purity on every refresh from now on (not only at materialization), or not."""
        self._strict = strict

    def defer(self, indices: Iterable[int]) -> None:
        """Mark `indices` stale with no reason: not a failure, a refresh a later replay
        runs (lazy refresh)."""
        self.stale.update(indices)

    def mark_stale(self, indices: Iterable[int], why: str) -> None:
        """Mark derivations, and what lies downstream of them, stale; poison buffers."""
        bound = self.bound
        buffers: list[torch.Tensor] = []
        for i in indices:
            for j in bound[i].downstream:
                self.stale.add(j)
                self.reasons.setdefault(j, why)
                buffers.extend(bound[j].buffers or ())
        self.journal.poison(buffers, why)

    def report(self, report: RefreshReport) -> None:
        """Keep `report` as the last refresh's (a load's refreshes, combined)."""
        self.last_report = report

    def refresh(
        self,
        pinned: bool,
        keys: Iterable[int] | None = None,
        *,
        paths: Iterable[str] = (),
    ) -> RefreshReport:
        """Refresh what was rebound (taken before pin), what the witnesses see changed,
        and what reads the storages `keys` or the input `paths`, then release the
        transient inputs. With `keys` None, every derivation: a failed update stays
        flagged, and derivations whose transient inputs are released are left as they
        are (only a load can give them their inputs)."""
        dirty = self.scan_moved(pinned)
        try:
            if keys is None:
                return self.recompute(range(len(self.bound)), skip_blocked=True)
            dirty.update(self.witness_dirty())
            for path in paths:
                dirty.update(self.binding.by_path.get(path, ()))
            dirty.update(self.consumers_of(keys))
            return self.recompute(self.closure(dirty))
        finally:
            self.transients.release()

    def refresh_readers(self, pinned: bool, keys: Iterable[int]) -> None:
        """Refresh what was rebound and what reads the storages `keys`, if any; what is
        stale otherwise is left for the guard to report."""
        dirty = self.scan_moved(pinned) | self.consumers_of(keys)
        if dirty:
            self.recompute(self.closure(dirty))

    # -- the hot loop ----------------------------------------------------------------

    def recompute(self, plan: Sequence[int], *, skip_blocked: bool = False) -> RefreshReport:
        """Materialize or refresh the derivations of `plan` (sorted, closed downstream:
        see `closure`) in order, after `scan_moved` put buffers and inputs where they are
        expected; return the report, or raise the first failure once the whole plan was
        tried. Any exception, `KeyboardInterrupt` included, leaves what did not complete
        stale. With `skip_blocked`, a derivation whose transient inputs are released is
        left as it is (a full refresh of a fresh model), else it is marked stale."""
        bound = self.bound
        clock = time.perf_counter
        start = clock()
        if not plan:  # most loads of a large model: no grad modes entered, no model walked
            self._reallocated.clear()
            self._settle(plan, set(), False)
            return self._report((), clock() - start)
        raw: list[RawEntry] = []
        append = raw.append
        failed: set[int] = set()
        first_error: BaseException | None = None
        if self.transients:
            plan = self._unblocked(plan, skip_blocked)
        pending = self._strict or any(bound[i].buffers is None for i in plan)
        watch = self._model_tensors() if pending else None
        realloc = self._reallocated
        done = 0
        sites_changed = False
        try:
            # Buffers made under inference_mode would be inference tensors, which a later
            # refresh outside inference_mode may not write: always make normal tensors.
            # These writes are graphsafe's own, not writes outside a load: `quiet`.
            with torch.inference_mode(False), torch.no_grad(), quiet():
                for i in plan:
                    b = bound[i]
                    done += 1
                    if failed and not b.deps.isdisjoint(failed):
                        failed.add(i)
                        continue
                    t0 = clock()
                    try:
                        if watch is None and b.fast:
                            # The hot path: one output computed straight into it with out=.
                            buf = b.out_arg
                            if b.single_in is not None:
                                c, k = b.single_in
                                ret = b.fn(b.module_ref(), c[k], out=buf)
                            else:
                                ret = b.fn(b.module_ref(), *[c[k] for c, k in b.in_refs], out=buf)
                            if buf.shape != b.shape0:  # torch resized it: wrong result shape
                                refuse_resized(b, None)
                            taken = FAST if ret is buf else copy_apart(b, ret)
                            append((i, _REFRESHED, taken, clock() - t0, i not in realloc))
                        elif b.buffers is None:
                            assert watch is not None
                            self._record(b, materialize(b, watch))
                            sites_changed = True
                            append((i, _MATERIALIZED, SLOW, clock() - t0, i not in realloc))
                        else:
                            taken = refresh_checked(b, watch if self._strict else None)
                            append((i, _REFRESHED, taken, clock() - t0, i not in realloc))
                    except Exception as exc:
                        if b.buffers is not None and not isinstance(exc, DerivationDriftError):
                            try:
                                refuse_resized(b, exc)
                            except DerivationDriftError as drift:
                                exc = drift
                        failed.add(i)
                        append((i, _FAILED, _NONE, clock() - t0, geometry_held(b)))
                        if first_error is None:
                            first_error = exc
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail closed
            why = f"interrupted by {type(exc).__name__} while refreshing"
            self._settle(plan[: done - 1], failed, sites_changed)
            self.mark_stale(plan[done - 1 :], why)
            raise
        realloc.clear()
        self._settle(plan, failed, sites_changed)
        if first_error is not None:
            self.mark_stale(failed, one_line(first_error))
            raise first_error
        return self._report(tuple(raw), clock() - start)

    def _report(self, raw: tuple[RawEntry, ...], seconds: float) -> RefreshReport:
        """The report of a run (`raw`: an entry per derivation that ran), kept as the
        last one."""
        if self._frozen_identities is None:
            self._frozen_identities = tuple(self._identities)
        report = RefreshReport.from_raw(self._frozen_identities, raw, seconds)
        self.last_report = report
        return report

    def _unblocked(self, plan: Sequence[int], skip: bool) -> list[int]:
        """`plan` without the derivations whose transient inputs are released; those that
        must run and cannot are marked stale."""
        runnable, blocked = self.transients.unblocked(plan, self.bound, self.stale, skip=skip)
        for i, why in blocked.items():
            self.mark_stale([i], why)
        return runnable

    def _settle(self, ran: Sequence[int], failed: set[int], sites_changed: bool) -> None:
        """After a run: clear what succeeded, take its witnesses, heal its buffers."""
        ok = [i for i in ran if i not in failed] if failed else ran
        if self.stale:
            self.stale.difference_update(ok)
        if self.reasons:
            for i in ok:
                self.reasons.pop(i, None)
        if sites_changed:
            self.watch = self.watch.renewed()
        # An input's witness is taken only when every derivation reading it ran: a change
        # that one of them has not seen must stay visible.
        self.watch.rewitness(ok)
        if self.journal.poisoned:
            self.journal.heal(storage_key(t) for i in ok for t in self.bound[i].buffers or ())

    def _record(self, b: BoundDerivation, buffers: list[torch.Tensor]) -> None:
        """Take `buffers` as the storage of `b`'s outputs."""
        b.set_buffers(buffers)
        self.watch.buffers_changed()
        self._identities[b.index] = (b.path, b.spec.name, b.out_paths, b.nbytes)
        self._frozen_identities = None
