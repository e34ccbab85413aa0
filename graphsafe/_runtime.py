"""The runtime: materialize derived buffers once, refresh them in place forever after.

One `Runtime` per model instance (`gs.runtime(model)`). It binds the registered
derivations to the module tree, allocates each derived buffer on the first load, and on
every later load recomputes, straight into the same storage, exactly the derivations
whose inputs the load wrote (and everything downstream of them). It fails closed: a
derivation that raises or returns a result that does not fit leaves its buffers in
`stale`, never half-written or rebound.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphsafe._binding import Bound, Input, bind, describe, join, model_tensors, pin_storage
from graphsafe._checks import (
    as_results,
    check_results,
    geometry_held,
    impurity_refusal,
    moved_error,
    refuse_resized,
)
from graphsafe._declare import class_registries
from graphsafe._errors import (
    DerivationDriftError,
    GraphSafetyError,
    RegistrationError,
    StaleError,
    StorageMovedError,
)
from graphsafe._registry import Registry, default_registry
from graphsafe._spec import Derivation, DerivationInfo, RawEntry, RawIdentity, RefreshReport
from graphsafe._tracking import WriteTracker, storage_key

__all__ = ["Runtime", "runtime", "weight_update"]

_MATERIALIZED, _REFRESHED, _FAILED = 0, 1, 3
_FAST, _SLOW, _NONE = 0, 1, 2


class Runtime:
    """Derived buffers of one model instance, kept correct across weight loads.

    Create it with `gs.runtime(model)`; classes decorated with `gs.graphsafe` use it from
    their loading method without being asked.

    Args:
        model: The root module.
        registry: Where the derivations are declared, besides `gs.default_registry` and
            the registries named by `gs.graphsafe(registry=...)` on the model's classes.
        strict: Check purity on every refresh, not only at materialization.

    Examples:
        >>> import torch, graphsafe as gs
        >>> from torch import nn
        >>> reg = gs.Registry()
        >>> @reg.derive(nn.Linear, "weight_t", inputs=["weight"])
        ... def weight_t(m, w, *, out=None):
        ...     return torch.transpose(w, 0, 1).contiguous() if out is None else out.copy_(w.t())
        >>> lin = nn.Linear(3, 2)
        >>> rt = gs.runtime(lin, reg)
        >>> _ = rt.refresh()
        >>> torch.equal(lin.weight_t, lin.weight.t())
        True
    """

    def __init__(
        self, model: nn.Module, registry: Registry | None = None, *, strict: bool = False
    ) -> None:
        self._model_ref = weakref.ref(model)
        self.registries: list[Registry] = [default_registry]
        if registry is not None and registry is not default_registry:
            self.registries.append(registry)
        self.strict = strict
        self.pinned = False
        self._lock = threading.RLock()
        self._bound: list[Bound] | None = None
        self._inputs: list[Input] = []
        self._by_path: dict[str, list[int]] = {}
        self._identities: list[RawIdentity] = []
        self._stale: set[int] = set()
        self._failed_update: str | None = None
        self._watch: dict[int, list[Input]] | None = None
        self._reallocated: set[int] = set()
        self._buffer_checks: list[tuple[Any, ...]] | None = None
        self._depth = 0
        self._update: WriteTracker | None = None
        self.last_report: RefreshReport | None = None
        """The report of the last refresh, including those run by loads."""

    # -- binding -------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The root module (raises if it was garbage-collected)."""
        model = self._model_ref()
        if model is None:
            raise GraphSafetyError(
                "the model of this runtime no longer exists",
                expected="a model that is still referenced",
                got="the model was garbage-collected",
                fix="keep a reference to the model while using its runtime, e.g. "
                "`model = M(); gs.runtime(model)` rather than `gs.runtime(M())`",
            )
        return model

    def _ensure_bound(self) -> list[Bound]:
        if self._bound is None:
            binding = bind(self.model, self._derivations_for, self._own)
            self._bound = binding.bound
            self._inputs = binding.inputs
            self._by_path = binding.by_path
            self._identities = [(b.path, b.spec.name, b.out_paths, 0) for b in binding.bound]
            self._stale = {b.index for b in binding.bound}
            self._watch = None
            self._buffer_checks = None
        return self._bound

    def _own(self, module: nn.Module) -> None:
        _OWNERS[module] = self

    def _derivations_for(self, cls: type) -> list[Derivation]:
        registries = list(self.registries)
        for reg in class_registries(cls):
            if reg not in registries:
                registries.append(reg)
        found: list[Derivation] = []
        taken: dict[str, Derivation] = {}
        for reg in registries:
            for d in reg.derivations_for(cls):
                for name in d.outputs:
                    if name in taken and taken[name] is not d:
                        raise RegistrationError(
                            f"two registries declare output {name!r} on {cls.__name__}",
                            module_class=cls.__name__,
                            derivation=d.name,
                            expected=f"one derivation producing {name!r}",
                            got=f"{taken[name].name!r} and {d.name!r}",
                            fix="register the derivation in one registry only",
                        )
                    taken[name] = d
                if d not in found:
                    found.append(d)
        return found

    def add_registry(self, registry: Registry) -> None:
        """Also bind the derivations of `registry` (rebinding if already bound).

        Args:
            registry: A registry to consult from now on.

        Raises:
            StorageMovedError: If the runtime is pinned; rebinding would allocate buffers
                that captured graphs do not know.
        """
        with self._lock:
            if registry in self.registries or any(
                registry in class_registries(type(m)) for m in self.model.modules()
            ):
                return  # already consulted
            if self.pinned:
                raise StorageMovedError(
                    "cannot add a registry to a pinned runtime",
                    module_class=type(self.model).__name__,
                    expected="registries added before graphs are captured",
                    got="runtime pinned by a capture",
                    fix="pass the registry at the first gs.runtime(model, registry) call",
                )
            self.registries.append(registry)
            self._bound = None  # rebound on next use; existing buffers keep their storage

    # -- public API ------------------------------------------------------------------

    @property
    def derivations(self) -> tuple[DerivationInfo, ...]:
        """The bound derivations with their paths, inputs, shapes, dtypes and bytes."""
        with self._lock:
            return tuple(
                DerivationInfo(
                    derivation=b.spec.name,
                    module=b.module_path,
                    module_class=b.module_class,
                    outputs=b.out_paths,
                    inputs=b.inputs,
                    shapes=tuple(tuple(t.shape) for t in b.buffers or ()),
                    dtypes=tuple(str(t.dtype) for t in b.buffers or ()),
                    nbytes=b.nbytes,
                    fast_path=b.accepts_out,
                )
                for b in self._ensure_bound()
            )

    @property
    def stale(self) -> tuple[str, ...]:
        """Paths of derived buffers that do not currently match their inputs.

        A buffer is stale before it is first materialized, after its derivation failed,
        after a load that raised wrote its inputs, and when an input was rebound since the
        last refresh.
        """
        with self._lock:
            bound = self._ensure_bound()
            indices = set(self._stale)
            moved_inputs, moved_buffers = self._find_moved()
            for inp in moved_inputs:
                for i in inp.consumers:
                    indices.update(bound[i].downstream)
            for b, _ in moved_buffers:
                indices.update(b.downstream)
            if self._update is not None:  # inside a weight_update block: not yet refreshed
                for i in self._written_consumers(self._update.written):
                    indices.update(bound[i].downstream)
            return tuple(p for i in sorted(indices) for p in bound[i].out_paths)

    @property
    def materialized(self) -> bool:
        """Whether every owned derived buffer has been allocated."""
        with self._lock:
            return all(b.buffers is not None for b in self._ensure_bound())

    def assert_fresh(self) -> None:
        """Raise unless every derived buffer matches its inputs and the last update held.

        Raises:
            StaleError: Naming the stale buffers, or the failed weight update.
        """
        stale = self.stale
        if stale:
            first = next(b for b in self._ensure_bound() if stale[0] in b.out_paths)
            raise StaleError(
                f"{len(stale)} derived buffer(s) do not match their inputs",
                paths=stale,
                module_class=first.module_class,
                derivation=first.spec.name,
                path=", ".join(stale[:8]) + (" ..." if len(stale) > 8 else ""),
                expected="every derived buffer refreshed from the current weights",
                got="stale: " + ", ".join(stale[:8]),
                fix="complete a weight update (a load or weight_update block that finishes) "
                "before running the model; gs.runtime(model).refresh() recomputes the buffers "
                "but cannot repair a load that failed",
            )
        update = self._update
        if update is not None and update.written:
            raise StaleError(
                "a weight update is in progress; the model holds a mix of old and new weights",
                module_class=type(self.model).__name__,
                expected="the weight_update block to have exited",
                got=f"{len(update.written)} tensor storage(s) written so far in the block",
                fix="run the model after the `with gs.weight_update(model):` block exits",
            )
        if self._failed_update is not None:
            raise StaleError(
                "the last weight update failed; the model holds a mix of old and new weights",
                expected="a weight update that completed",
                got=self._failed_update,
                fix="load the weights again; the model is usable once a load completes",
            )

    def refresh(self, changed: Iterable[str] | None = None) -> RefreshReport:
        """Recompute derived buffers in place.

        Args:
            changed: Dotted paths (from the model root) of tensors that changed; only
                derivations downstream of them are recomputed. None: all of them.

        Returns:
            What was done, per derivation.

        Raises:
            DerivationDriftError: A result does not fit its buffer (nothing written).
            StorageMovedError: After `pin()`, an input or buffer was rebound.
            ImpureDerivationError: A derivation wrote into a model tensor.
            GraphSafetyError: `changed` names no tensor of the model.
        """
        with self._lock:
            bound = self._ensure_bound()
            dirty = self._scan_moved()
            if changed is None:
                # A failed update stays flagged: a refresh cannot repair half-loaded weights.
                return self._run(range(len(bound)))
            for path in changed:
                consumers = self._by_path.get(path)
                if consumers is None:
                    self._check_tensor_path(path)
                    continue
                dirty.update(consumers)
            return self._run(self._plan(dirty))

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[Runtime]:
        """A block of writes (the bucketed RL weight sync): refresh once at the end.

        Load calls inside do not refresh; every write into a derivation input inside the
        block is tracked, and when the block exits normally the affected derivations are
        refreshed once. An exception leaves what was written marked stale.

        Yields:
            This runtime.

        Examples:
            >>> # with gs.weight_update(model):
            >>> #     for bucket in buckets:
            >>> #         model.load_weights(bucket)
        """
        with self._lock:
            if self._update is not None:
                yield self
                return
            self._ensure_bound()
            # Watch every tensor of the model, not only derivation inputs, so that a
            # replay inside the block is refused as soon as anything was written.
            watched: dict[int, object] = dict(self._purity_watch())
            watched.update(self._watch_map())
            tracker = WriteTracker(watched)
            self._update = tracker
            try:
                with tracker:
                    yield self
            except BaseException as exc:
                self._fail_update(tracker.written, exc)
                raise
            finally:
                self._update = None
            self._finish_update(tracker.written)

    def pin(self) -> None:
        """Declare storage addresses fixed from now on, as a captured graph requires.

        Derivations whose inputs moved since the last refresh (e.g. after `.to()`) are
        refreshed first. After pinning, rebinding an input or a derived buffer raises
        `StorageMovedError` at the next load, refresh or guarded replay.

        Raises:
            StaleError: If the derived buffers were never materialized.
        """
        with self._lock:
            bound = self._ensure_bound()
            missing = [b.path for b in bound if b.buffers is None]
            if missing:
                raise StaleError(
                    "cannot pin: derived buffers were never materialized",
                    paths=missing,
                    path=", ".join(missing[:8]),
                    expected="derived buffers allocated by a first load or refresh()",
                    got="not materialized",
                    fix="load the weights (or call refresh()) before capturing a graph",
                )
            dirty = self._scan_moved()
            if dirty:
                self._run(self._plan(dirty))
            self.pinned = True

    def unpin(self) -> None:
        """Allow storage to move again (graphs captured before must be re-captured)."""
        with self._lock:
            self.pinned = False

    # -- loads -----------------------------------------------------------------------

    def run_load(
        self,
        fn: Callable[..., Any],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run a loading method with write tracking, then refresh what it wrote.

        Args:
            fn: The unwrapped loading method.
            module: The module it is called on.
            args: Positional arguments.
            kwargs: Keyword arguments.

        Returns:
            What the loading method returned.
        """
        with self._lock:
            if self._depth or self._update is not None:
                self._depth += 1
                try:
                    return fn(module, *args, **kwargs)
                finally:
                    self._depth -= 1
            self._ensure_bound()
            tracker = WriteTracker(self._watch_map())
            self._depth += 1
            try:
                with tracker:
                    result = fn(module, *args, **kwargs)
            except BaseException as exc:
                self._fail_update(tracker.written, exc)
                raise
            finally:
                self._depth -= 1
            self._finish_update(tracker.written)
            return result

    def _fail_update(self, written: set[int], exc: BaseException) -> None:
        dirty = self._written_consumers(written)
        for inp in self._find_moved()[0]:
            dirty.update(inp.consumers)
        self._stale.update(self._plan(dirty))
        first = str(exc).splitlines()[0] if str(exc) else ""
        self._failed_update = f"{type(exc).__name__}: {first}"

    def _finish_update(self, written: set[int]) -> None:
        bound = self._ensure_bound()
        dirty = self._scan_moved() | self._written_consumers(written)
        dirty.update(b.index for b in bound if b.buffers is None)
        self._run(self._plan(dirty))  # _plan retries what is stale
        self._failed_update = None

    def _written_consumers(self, written: set[int]) -> set[int]:
        watch = self._watch_map()
        dirty: set[int] = set()
        for key in written:
            for inp in watch.get(key, ()):
                dirty.update(inp.consumers)
        return dirty

    def _watch_map(self) -> dict[int, list[Input]]:
        if self._watch is None:
            watch: dict[int, list[Input]] = {}
            for inp in self._inputs:
                if inp.tensor is not None:
                    key = storage_key(inp.tensor)
                    if key:
                        watch.setdefault(key, []).append(inp)
            self._watch = watch
        return self._watch

    def _scan_moved(self) -> set[int]:
        """Derivations whose inputs or buffers were rebound since the last refresh.

        Before `pin()` the new tensors are accepted (and the derivations must be
        recomputed); after it, a rebinding raises `StorageMovedError` and marks them stale.
        """
        bound = self._ensure_bound()
        moved_inputs, moved_buffers = self._find_moved()
        dirty: set[int] = set()
        if not moved_inputs and not moved_buffers:
            return dirty
        if self.pinned:
            for inp in moved_inputs:
                for i in inp.consumers:
                    self._stale.update(bound[i].downstream)
            for b, _ in moved_buffers:
                self._stale.update(b.downstream)
            raise moved_error(moved_inputs, moved_buffers, bound)
        for inp in moved_inputs:
            inp.accept()
            dirty.update(inp.consumers)
        for b, j in moved_buffers:
            self._adopt_moved_buffer(b, j)
            dirty.add(b.index)
        self._watch = None
        return dirty

    def _find_moved(self) -> tuple[list[Input], list[tuple[Bound, int]]]:
        """Inputs, and (derivation, output index) of buffers, rebound since recorded.

        One flat pass each, comparing identity, pointer (and a buffer's shape): this
        runs on every load and refresh.
        """
        bound = self._ensure_bound()
        moved_inputs = [
            inp
            for inp in self._inputs
            if (t := inp.container.get(inp.key)) is not inp.tensor
            or t is None
            or t.data_ptr() != inp.ptr
        ]
        checks = self._buffer_checks
        if checks is None:
            checks = self._buffer_checks = [
                (b.container, name, buf, ptr, shape, b, j)
                for b in bound
                for j, (name, buf, (ptr, shape, _)) in enumerate(
                    zip(b.outputs, b.buffers or (), b.geometry)
                )
            ]
        moved_buffers = [
            (b, j)
            for c, name, buf, ptr, shape, b, j in checks
            if c.get(name) is not buf or buf.data_ptr() != ptr or buf.shape != shape
        ]
        return moved_inputs, moved_buffers

    def _plan(self, dirty: Iterable[int]) -> list[int]:
        bound = self._ensure_bound()
        todo: set[int] = set()
        # Buffers left stale by an earlier failure are retried with whatever is refreshed.
        for i in (*dirty, *self._stale):
            todo.update(bound[i].downstream)
        return sorted(todo)

    def _check_tensor_path(self, path: str) -> None:
        obj: Any = self.model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if not isinstance(obj, torch.Tensor):
            raise GraphSafetyError(
                f"refresh(changed=...) names {path!r}, which is not a tensor of the model",
                module_class=type(self.model).__name__,
                path=path,
                expected="dotted paths from the model root, e.g. 'layers.0.weight'",
                got=repr(path),
                fix="use names from model.named_parameters() / named_buffers()",
            )

    # -- the hot loop ------------------------------------------------------------------

    def _run(self, plan: Sequence[int]) -> RefreshReport:
        """Materialize or refresh the derivations of `plan`, in its (topological) order.

        Every caller has run `_scan_moved` first, so buffers and inputs are where the
        bound derivations expect them.
        """
        bound = self._ensure_bound()
        clock = time.perf_counter
        start = clock()
        raw: list[RawEntry] = []
        append = raw.append
        failed: set[int] = set()
        first_error: BaseException | None = None
        # Storages of every model tensor, for the purity check (once per run, not per
        # derivation: walking the model is O(model)).
        pending = self.strict or any(bound[i].buffers is None for i in plan)
        watch = self._purity_watch() if pending else None
        realloc = self._reallocated  # adopted by _scan_moved: these buffers moved
        # Buffers made under inference_mode would be inference tensors, which a later
        # refresh outside inference_mode may not write: always make normal tensors.
        with torch.inference_mode(False), torch.no_grad():
            for i in plan:
                b = bound[i]
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
                        append((i, _MATERIALIZED, _SLOW, clock() - t0, True))
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
        realloc.clear()
        stale = self._stale
        stale.difference_update(plan)
        for i in failed:
            stale.update(bound[i].downstream)
        if first_error is not None:
            raise first_error
        report = RefreshReport.from_raw(self._identities, raw, clock() - start)
        self.last_report = report
        return report

    def _inputs_of(self, b: Bound) -> list[torch.Tensor]:
        return [c[k] for c, k in b.in_refs]

    def _copy_apart(self, b: Bound, ret: Any) -> int:
        """A function that accepts `out=` returned another tensor: validate, copy in."""
        assert b.buffers is not None
        b.buffers[0].copy_(check_results(b, ret)[0])
        b.fast = False  # from now on through _refresh_checked
        return _SLOW

    def _refresh_checked(self, b: Bound, purity: dict[int, str] | None) -> int:
        """Every other case: several outputs, no `out=`, strict purity."""
        module = b.module_ref()
        buffers = b.buffers  # where _scan_moved, run by every caller, left them
        assert module is not None and buffers is not None
        args = self._inputs_of(b)
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

    def _adopt_moved_buffer(self, b: Bound, j: int) -> None:
        """A derived buffer was replaced (e.g. `model.to()`): adopt it unless pinned."""
        name = b.outputs[j]
        new = b.container.get(name)
        old = b.buffers[j] if b.buffers is not None else None
        if self.pinned or not isinstance(new, torch.Tensor):
            raise b.error(
                StorageMovedError,
                f"derived buffer {b.out_paths[j]!r} was rebound after pin()",
                path=b.out_paths[j],
                drifts=(b.out_paths[j],),
                expected=describe(old) if old is not None else "the materialized buffer",
                got=describe(new) if isinstance(new, torch.Tensor) else repr(new),
                fix="never assign derived buffers: graphsafe writes them in place; to move "
                "the model, unpin(), move it, refresh() and re-capture",
            )
        locked = pin_storage(new)
        b.container[name] = locked
        assert b.buffers is not None
        buffers = list(b.buffers)
        buffers[j] = locked
        self._record(b, buffers)
        self._reallocated.add(b.index)

    def _materialize(self, b: Bound, watch: dict[int, str]) -> None:
        module = b.module_ref()
        assert module is not None
        with WriteTracker(watch, impurity_refusal(b, watch)):
            ret = b.fn(module, *self._inputs_of(b))
        results = as_results(b, ret)
        buffers: list[torch.Tensor] = []
        for name, r in zip(b.outputs, results):
            t = r.detach()
            if storage_key(t) in watch or t.untyped_storage().nbytes() != t.nbytes:
                # Shares memory with a model tensor (a view of an input): own a copy.
                t = t.clone(memory_format=torch.contiguous_format)
            existing = module._buffers.get(name)
            if (
                isinstance(existing, torch.Tensor)
                and existing.shape == t.shape
                and existing.dtype == t.dtype
                and existing.device == t.device
            ):
                existing.copy_(t)  # a previous runtime's buffer: keep its storage
                t = existing
            else:
                t = pin_storage(t)
                if module.__dict__.get(name, 0) is None:
                    del module.__dict__[name]  # a `self.x = None` placeholder from __init__
                module.register_buffer(name, t, persistent=False)
            buffers.append(t)
            watch.setdefault(storage_key(t), join(b.module_path, name))
        self._record(b, buffers)

    def _record(self, b: Bound, buffers: list[torch.Tensor]) -> None:
        b.set_buffers(buffers)
        self._buffer_checks = None
        self._identities[b.index] = (b.path, b.spec.name, b.out_paths, b.nbytes)

    def _purity_watch(self) -> dict[int, str]:
        watch: dict[int, str] = {}
        for path, t in model_tensors(self.model):
            key = storage_key(t)
            if key:
                watch.setdefault(key, path)
        return watch

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
_OWNERS: weakref.WeakKeyDictionary[nn.Module, Runtime] = weakref.WeakKeyDictionary()
_CREATE = threading.Lock()


def runtime(
    model: nn.Module, registry: Registry | None = None, *, strict: bool | None = None
) -> Runtime:
    """The runtime of `model`, created on first use (one per model instance).

    A submodule of a model that already has a runtime gets that runtime.

    Args:
        model: The root module.
        registry: Where derivations are declared; `gs.default_registry` by default.
        strict: If given, sets whether every refresh checks purity.

    Returns:
        The runtime.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)  # the runtime holds the model weakly: keep it
        >>> rt = runtime(model)
        >>> rt.stale
        ()
    """
    with _CREATE:
        rt = _RUNTIMES.get(model) or _OWNERS.get(model)
        if rt is None:
            rt = Runtime(model, registry)
            _RUNTIMES[model] = rt
    if registry is not None:
        rt.add_registry(registry)
    if strict is not None:
        rt.strict = strict
    return rt


def weight_update(model: nn.Module) -> contextlib.AbstractContextManager[Runtime]:
    """Shortcut for `gs.runtime(model).weight_update()`.

    Args:
        model: The model being updated.

    Returns:
        A context manager: loads inside do not refresh; one refresh happens at the end.

    Examples:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> with weight_update(model):
        ...     pass
    """
    return runtime(model).weight_update()
