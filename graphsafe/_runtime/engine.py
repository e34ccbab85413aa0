"""The engine: executes one binding (materialize, refresh in place, check).

The runtime decides *when* (loads, updates, pins); the engine decides *what* and does
it: which derivations a set of writes makes dirty, the order to run them, the hot loop
that writes each result straight into its buffer, and the checks that refuse a result
or a write before it lands. It owns the state of the derived buffers: which are stale,
their witnesses, and the report of the last refresh.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from graphsafe._declare.spec import RawEntry, RawIdentity, RefreshReport
from graphsafe._errors import DerivationDriftError, one_line
from graphsafe._memory.journal import JOURNAL, Witnesses, storage_key
from graphsafe._memory.snapshot import Flat
from graphsafe._runtime.binding import Binding, Bound, Input, join, pin_storage
from graphsafe._runtime.checks import (
    adoptee,
    as_results,
    check_results,
    geometry_held,
    impurity_refusal,
    moved_error,
    read_refusal,
    refuse_resized,
)
from graphsafe._runtime.tracking import ReadGuard, WriteTracker
from graphsafe._runtime.transient import Transients

__all__ = ["Engine"]

_MATERIALIZED, _REFRESHED, _FAILED = 0, 1, 3
_FAST, _SLOW, _NONE = 0, 1, 2


class Engine:
    """Derived buffers of one binding, and how to bring them up to date.

    Args:
        binding: The plan from `bind`.
        model_tensors: Returns `{storage key: path}` of every tensor of the model, for
            the purity and read checks.
        strict: Check purity on every refresh, not only at materialization.
    """

    def __init__(
        self,
        binding: Binding,
        model_tensors: Callable[[], dict[int, str]],
        *,
        strict: bool = False,
    ) -> None:
        self.binding = binding
        self.bound = binding.bound
        self.inputs = binding.inputs
        self.strict = strict
        self._model_tensors = model_tensors
        self.stale: set[int] = {b.index for b in self.bound}
        """Derivations whose buffers do not match their inputs (failed, never made)."""
        self.reasons: dict[int, str] = {}
        """Why each stale derivation is stale, when known."""
        self.last_report: RefreshReport | None = None
        self._identities: list[RawIdentity] = [
            (b.path, b.spec.name, b.out_paths, 0) for b in self.bound
        ]
        self._frozen_identities: tuple[RawIdentity, ...] | None = None
        self._reallocated: set[int] = set()
        self._watch: dict[int, list[Input]] | None = None
        self._flat: Flat | None = None
        self._keys: frozenset[int] | None = None
        self._site_owner: list[tuple[int, ...]] = []
        self._input_site: dict[int, int] = {}
        self._buffer_sites: list[list[int]] = [[] for _ in self.bound]
        self.transients = Transients(self.bound)
        """The transient inputs: held only while a load writes them."""
        self.witnesses = Witnesses(self._sites())

    # -- what is dirty ---------------------------------------------------------------

    def watch_map(self) -> dict[int, list[Input]]:
        """Storage key -> the inputs living in that storage (views and ties share one)."""
        if self._watch is None:
            watch: dict[int, list[Input]] = {}
            for inp in self.inputs:
                if inp.tensor is not None and not inp.transient:  # those: see transients
                    key = storage_key(inp.tensor)
                    if key:
                        watch.setdefault(key, []).append(inp)
            self._watch = watch
        return self._watch

    def consumers_of(self, keys: Iterable[int]) -> set[int]:
        """Derivations reading any of the storages `keys`.

        Args:
            keys: Storage keys written.

        Returns:
            Indices of the derivations that read them directly.
        """
        watch = self.watch_map()
        dirty: set[int] = set()
        for key in keys:
            for inp in watch.get(key, ()):
                dirty.update(inp.consumers)
        return dirty

    def witness_dirty(self) -> dict[int, str]:
        """Derivations whose inputs or buffers changed since they were refreshed.

        Returns:
            Derivation index -> how its input or buffer changed; empty when none did.
        """
        changed = self.witnesses.changed()
        if not changed:
            return {}
        dirty: dict[int, str] = {}
        for site, how in changed:
            for i in self._site_owner[site]:
                dirty.setdefault(i, f"{self._site_path(site)} {how}")
        return dirty

    def find_moved(self) -> tuple[list[Input], list[tuple[Bound, int]]]:
        """Inputs, and `(derivation, output index)` of buffers, rebound since recorded.

        One flat pass each: this runs on every load and refresh.

        Returns:
            The moved inputs and buffers.
        """
        flat = self._flat
        if flat is None:
            flat = self._flat = Flat(self.inputs, self.bound)
        if flat.unchanged():
            moved_inputs = [inp for inp in flat.transient if inp.moved()]
            return moved_inputs, []
        moved_inputs = [inp for inp in self.inputs if inp.moved()]
        moved_buffers = [
            (b, j)
            for b in self.bound
            for j, (name, buf, (ptr, shape, stride)) in enumerate(
                zip(b.outputs, b.buffers or (), b.geometry)
            )
            if b.container.get(name) is not buf
            or buf.data_ptr() != ptr
            or buf.shape != shape
            or buf.stride() != stride
        ]
        return moved_inputs, moved_buffers

    def scan_moved(self, pinned: bool) -> set[int]:
        """Derivations whose inputs or buffers were rebound since the last refresh.

        Before pin the new tensors are taken (inputs) or the buffers made anew from the
        derivation (a buffer converted by `.half()` or `.to()`), and the derivations must
        run; after it, a rebinding marks them stale and raises.

        Args:
            pinned: Whether a graph holds the storage fixed.

        Returns:
            Indices of the derivations to recompute.

        Raises:
            StorageMovedError: Pinned, and something moved.
            RegistrationError: An input is gone (deleted, None, parametrized).
        """
        moved_inputs, moved_buffers = self.find_moved()
        dirty: set[int] = set()
        if not moved_inputs and not moved_buffers:
            return dirty
        if pinned:
            err = moved_error(moved_inputs, moved_buffers, self.bound)
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
            b.buffers = None
            self._flat = None
            self._reallocated.add(b.index)
            dirty.add(b.index)
        self._watch = None
        self._keys = None
        self._flat = None
        self.witnesses = self.witnesses.rebuilt(self._sites())
        return dirty

    def closure(self, dirty: Iterable[int]) -> list[int]:
        """`dirty`, everything downstream of it, and whatever is stale, in order.

        Args:
            dirty: Derivation indices.

        Returns:
            Sorted indices (topological order).
        """
        bound = self.bound
        todo: set[int] = set()
        for i in (*dirty, *self.stale):
            todo.update(bound[i].downstream)
        return sorted(todo)

    def mark_stale(self, indices: Iterable[int], why: str) -> None:
        """Mark derivations, and what lies downstream of them, stale; poison buffers.

        Args:
            indices: Derivation indices.
            why: The reason, for messages.
        """
        bound = self.bound
        buffers: list[torch.Tensor] = []
        for i in indices:
            for j in bound[i].downstream:
                self.stale.add(j)
                self.reasons.setdefault(j, why)
                buffers.extend(bound[j].buffers or ())
        JOURNAL.poison(buffers, why)

    # -- the hot loop ----------------------------------------------------------------

    def run(self, plan: Sequence[int], *, skip_blocked: bool = False) -> RefreshReport:
        """Materialize or refresh the derivations of `plan`, in its (topological) order.

        The caller has run `scan_moved` first, so buffers and inputs are where the bound
        derivations expect them. Any exception, `KeyboardInterrupt` included, leaves the
        derivations that did not complete stale.

        Args:
            plan: Sorted derivation indices, closed downstream (see `closure`).
            skip_blocked: A derivation whose transient inputs are released cannot run:
                True leaves it as it is (a full refresh of a fresh model); False marks
                it, and what is downstream of it, stale (its inputs changed).

        Returns:
            The report.

        Raises:
            BaseException: The first failure, after the whole plan was tried.
        """
        bound = self.bound
        clock = time.perf_counter
        start = clock()
        raw: list[RawEntry] = []
        append = raw.append
        failed: set[int] = set()
        first_error: BaseException | None = None
        if self.transients:
            plan = self._unblocked(plan, skip_blocked)
        pending = self.strict or any(bound[i].buffers is None for i in plan)
        watch = self._model_tensors() if pending else None
        realloc = self._reallocated
        done = 0
        sites_changed = False
        try:
            # Buffers made under inference_mode would be inference tensors, which a later
            # refresh outside inference_mode may not write: always make normal tensors.
            with torch.inference_mode(False), torch.no_grad():
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
                            taken = _FAST if ret is buf else self._copy_apart(b, ret)
                            append((i, _REFRESHED, taken, clock() - t0, i not in realloc))
                        elif b.buffers is None:
                            assert watch is not None
                            self._materialize(b, watch)
                            sites_changed = True
                            append((i, _MATERIALIZED, _SLOW, clock() - t0, i not in realloc))
                        else:
                            taken = self._refresh_checked(b, watch if self.strict else None)
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
        if self._frozen_identities is None:
            self._frozen_identities = tuple(self._identities)
        report = RefreshReport.from_raw(self._frozen_identities, tuple(raw), clock() - start)
        self.last_report = report
        return report

    def _unblocked(self, plan: Sequence[int], skip: bool) -> list[int]:
        """`plan` without the derivations whose transient inputs are released."""
        bound = self.bound
        out: list[int] = []
        blocked: set[int] = set()
        for i in plan:
            b = bound[i]
            tr = self.transients.blocked(b)
            if tr is None and b.deps.isdisjoint(blocked):
                out.append(i)
                continue
            blocked.add(i)
            if skip and i not in self.stale:
                continue
            why = (
                f"its transient input {tr.input.path} is released: it is recomputed only by "
                "a load that writes that input completely"
                if tr is not None
                else "it reads a derivation that could not be recomputed"
            )
            self.mark_stale([i], why)
        if skip:  # what reads a skipped derivation's (unchanged) buffers can still run
            return [i for i in plan if self.transients.blocked(bound[i]) is None]
        return out

    def _settle(self, ran: Sequence[int], failed: set[int], sites_changed: bool) -> None:
        """After a run: clear what succeeded, take its witnesses, heal its buffers."""
        ok = [i for i in ran if i not in failed] if failed else ran
        bound = self.bound
        if self.stale:
            self.stale.difference_update(ok)
        if self.reasons:
            for i in ok:
                self.reasons.pop(i, None)
        if sites_changed:
            self._keys = None
            self.witnesses = self.witnesses.rebuilt(self._sites())
        # An input's witness is taken only when every derivation reading it ran: a change
        # that one of them has not seen must stay visible.
        self.rewitness(ok)
        if JOURNAL.poisoned:
            JOURNAL.heal(storage_key(t) for i in ok for t in bound[i].buffers or ())

    def rewitness(self, fresh: Sequence[int]) -> None:
        """Take the witnesses of derivations known to be fresh.

        An input's witness is taken only when every derivation reading it is among
        `fresh`: a change that one of them has not seen must stay visible.

        Args:
            fresh: Indices of derivations that match their inputs now.
        """
        okset = set(fresh)
        if len(okset) == len(self.bound):
            flat, seen = self._flat, None
            if flat is not None:
                seen, flat.seen = flat.seen, None
            self.witnesses.record_all(seen)
            return
        sites: list[int] = []
        for i in fresh:
            b = self.bound[i]
            sites.extend(self._buffer_sites[i])
            for inp in b.leaf_inputs:
                if not inp.transient and okset.issuperset(inp.consumers):
                    sites.append(self._input_site[id(inp)])
        self.witnesses.record(sites)

    def _copy_apart(self, b: Bound, ret: Any) -> int:
        """A function that accepts `out=` returned another tensor: validate, copy in."""
        assert b.buffers is not None
        b.buffers[0].copy_(check_results(b, ret)[0])
        b.fast = False  # from now on through _refresh_checked
        return _SLOW

    def _refresh_checked(self, b: Bound, purity: dict[int, str] | None) -> int:
        """Every other case: several outputs, no `out=`, strict purity."""
        module = b.module_ref()
        buffers = b.buffers
        assert module is not None and buffers is not None
        args = [c[k] for c, k in b.in_refs]
        guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if purity is not None:
            own = {storage_key(t) for t in buffers}
            guard = WriteTracker(
                {k: p for k, p in purity.items() if k not in own}, impurity_refusal(b, purity)
            )
        if b.accepts_out:
            out = b.out_arg
            try:
                with guard:
                    ret = b.fn(module, *args, out=out)
            except Exception as exc:
                refuse_resized(b, exc)
                raise
            refuse_resized(b, None)
            if ret is out or (
                isinstance(ret, (tuple, list))
                and len(ret) == len(buffers)
                and all(r is o for r, o in zip(ret, buffers))
            ):
                return _FAST
        else:
            with guard:
                ret = b.fn(module, *args)
        results = check_results(b, ret)
        if len(results) == 1:
            buffers[0].copy_(results[0])
        else:
            torch._foreach_copy_(buffers, results)
        return _SLOW

    def _materialize(self, b: Bound, watch: dict[int, str]) -> None:
        """First call: refuse impure writes and undeclared reads, then allocate."""
        module = b.module_ref()
        assert module is not None
        args = [c[k] for c, k in b.in_refs]
        declared = {storage_key(t) for t in args}
        with ReadGuard(watch, impurity_refusal(b, watch), declared, read_refusal(b, watch)):
            ret = b.fn(module, *args)
        results = as_results(b, ret)
        fresh: list[torch.Tensor] = []
        for r in results:
            t = r.detach()
            key = storage_key(t)
            if (key and key in watch) or t.untyped_storage().nbytes() != t.nbytes:
                # Shares memory with a model tensor (a view of an input): own a copy.
                t = t.clone(memory_format=torch.contiguous_format)
            if t.is_inference():  # computed under inference_mode: keep a versioned copy
                with torch.inference_mode(False):
                    t = t.clone()
            fresh.append(t)
        # Every output is checked before any is written: a refusal leaves the module as is.
        adopted = [adoptee(b, module, n, t, watch) for n, t in zip(b.outputs, fresh)]
        buffers: list[torch.Tensor] = []
        for name, t, have in zip(b.outputs, fresh, adopted):
            existing = module._buffers.get(name)
            if have is not None:
                have.copy_(t)  # the class's own tensor: a graph may hold its address
                del module.__dict__[name]
                module.register_buffer(name, have, persistent=False)
                t = have
            elif (
                isinstance(existing, torch.Tensor)
                and existing.shape == t.shape
                and existing.dtype == t.dtype
                and existing.device == t.device
                and existing.is_contiguous() == t.is_contiguous()
            ):
                existing.copy_(t)  # an earlier binding's buffer: keep its storage
                t = existing
            else:
                t = pin_storage(t)
                if name in module.__dict__ and module.__dict__[name] is None:
                    del module.__dict__[name]  # a `self.x = None` placeholder from __init__
                module.register_buffer(name, t, persistent=False)
            buffers.append(t)
            watch.setdefault(storage_key(t), join(b.module_path, name))
        self.record(b, buffers)

    def record(self, b: Bound, buffers: list[torch.Tensor]) -> None:
        """Take `buffers` as the storage of `b`'s outputs.

        Args:
            b: The bound derivation.
            buffers: One tensor per output.
        """
        b.set_buffers(buffers)
        self._flat = None
        self._identities[b.index] = (b.path, b.spec.name, b.out_paths, b.nbytes)
        self._frozen_identities = None

    # -- witnesses -------------------------------------------------------------------

    def _sites(self) -> list[tuple[dict[str, Any], str]]:
        """Witness sites: every leaf input, then every materialized buffer."""
        sites: list[tuple[dict[str, Any], str]] = []
        owner: list[tuple[int, ...]] = []
        self._input_site = {}
        for inp in self.inputs:
            if inp.transient:
                continue  # released and held again by design: loads account for them
            self._input_site[id(inp)] = len(sites)
            sites.append((inp.container, inp.key))
            owner.append(tuple(inp.consumers))
        self._buffer_sites = [[] for _ in self.bound]
        for b in self.bound:
            for name in b.outputs if b.buffers is not None else ():
                self._buffer_sites[b.index].append(len(sites))
                sites.append((b.container, name))
                owner.append((b.index,))
        self._site_owner = owner
        return sites

    def _site_path(self, site: int) -> str:
        for inp in self.inputs:
            if self._input_site.get(id(inp)) == site:
                return inp.path
        for b in self.bound:
            for j, s in enumerate(self._buffer_sites[b.index]):
                if s == site:
                    return f"derived buffer {b.out_paths[j]}"
        return "a tensor"

    def storage_keys(self) -> frozenset[int]:
        """Storage keys of every input and buffer, for the journal's poison check."""
        if self._keys is None:
            with torch._C.DisableTorchFunctionSubclass():  # metadata: no subclass hooks
                keys = {
                    storage_key(inp.tensor) for inp in self.inputs if inp.tensor is not None
                }
                keys.update(storage_key(t) for b in self.bound for t in b.buffers or ())
            keys.discard(0)
            self._keys = frozenset(keys)
        return self._keys

