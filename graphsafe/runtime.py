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
from torch.utils.dlpack import from_dlpack

from graphsafe.declare import is_marked
from graphsafe.errors import (
    DerivationDriftError,
    GraphSafetyError,
    ImpureDerivationError,
    RegistrationError,
    StaleError,
    StorageMovedError,
)
from graphsafe.registry import Registry, accepts_out, check_signature, default_registry
from graphsafe.spec import Derivation, DerivationInfo, RawEntry, RawIdentity, RefreshReport
from graphsafe.tracking import WriteTracker, storage_key

__all__ = ["Runtime", "runtime", "weight_update"]

_MATERIALIZED, _REFRESHED, _FAILED = 0, 1, 3
_FAST, _SLOW, _NONE = 0, 1, 2


def _meta(t: torch.Tensor) -> str:
    return (
        f"shape {tuple(t.shape)}, stride {t.stride()}, dtype {t.dtype}, device {t.device}, "
        f"storage 0x{t.data_ptr():x}"
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _pin_storage(t: torch.Tensor) -> torch.Tensor:
    """An alias of `t` whose storage cannot be resized.

    torch resizes an `out=` tensor of the wrong shape, reallocating its memory when it
    grows; on a non-resizable storage that raises instead, so the buffer never moves.
    """
    try:
        return from_dlpack(t)
    except Exception:  # dtypes DLPack cannot express: drift is still detected afterwards
        return t


class _Input:
    """A leaf tensor (parameter, buffer or plain attribute) read by derivations."""

    __slots__ = ("consumers", "container", "key", "path", "ptr", "tensor")

    def __init__(self, path: str, container: dict[str, Any], key: str) -> None:
        self.path = path
        self.container = container
        self.key = key
        self.tensor: torch.Tensor | None = container.get(key)
        self.ptr = self.tensor.data_ptr() if self.tensor is not None else 0
        self.consumers: list[int] = []

    def moved(self) -> bool:
        t = self.container.get(self.key)
        return t is not self.tensor or t is None or t.data_ptr() != self.ptr

    def accept(self) -> None:
        self.tensor = self.container.get(self.key)
        self.ptr = self.tensor.data_ptr() if self.tensor is not None else 0


class _Bound:
    """A derivation bound to one module instance, with everything a refresh needs."""

    __slots__ = (
        "accepts_out", "buffers", "container", "deps", "downstream", "fast", "fn", "geometry",
        "in_refs", "index", "inputs", "leaf_inputs", "module_class", "module_path",
        "module_ref", "nbytes", "out_arg", "out_paths", "outputs", "spec",
    )

    def __init__(self, spec: Derivation, module: nn.Module, module_path: str) -> None:
        self.spec = spec
        self.module_ref = weakref.ref(module)
        self.module_path = module_path
        self.module_class = type(module).__name__
        self.fn = _resolve_fn(spec, module)
        self.accepts_out = accepts_out(self.fn)
        self.outputs = spec.outputs
        self.out_paths = tuple(_join(module_path, o) for o in spec.outputs)
        self.inputs = tuple(_join(module_path, i) for i in spec.inputs)
        self.container: dict[str, Any] = module._buffers
        self.in_refs: list[tuple[dict[str, Any], str]] = []
        self.leaf_inputs: list[_Input] = []
        self.deps: set[int] = set()
        self.index = -1
        self.downstream: tuple[int, ...] = ()
        self.buffers: list[torch.Tensor] | None = None
        self.geometry: list[tuple[int, torch.Size, tuple[int, ...]]] = []
        self.nbytes = 0
        self.out_arg: Any = None
        self.fast = False

    def set_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Record the buffers and precompute what the hot path needs."""
        self.buffers = buffers
        self.geometry = [(t.data_ptr(), t.shape, t.stride()) for t in buffers]
        self.nbytes = sum(t.nbytes for t in buffers)
        self.out_arg = buffers[0] if len(buffers) == 1 else tuple(buffers)
        self.fast = self.accepts_out and len(buffers) == 1

    @property
    def path(self) -> str:
        return self.out_paths[0]

    def error(self, cls: type[GraphSafetyError], summary: str, **kw: Any) -> GraphSafetyError:
        kw.setdefault("path", self.path)
        return cls(summary, module_class=self.module_class, derivation=self.spec.name, **kw)


def _resolve_fn(spec: Derivation, module: nn.Module) -> Callable[..., Any]:
    """The function to call: a subclass's plain override of a declared method wins."""
    if spec.method is None:
        return spec.fn
    override = getattr(type(module), spec.method, None)
    if override is None or override is spec.fn or is_marked(override):
        return spec.fn
    check_signature(override, spec, type(module))
    return override  # type: ignore[no-any-return]


class Runtime:
    """Derived buffers of one model instance, kept correct across weight loads.

    Create it with `gs.runtime(model)`; classes decorated with `gs.graphsafe` use it from
    their loading method without being asked.

    Args:
        model: The root module.
        registry: Where the derivations are declared.
        strict: Check purity on every refresh, not only at materialization.

    Example:
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
        self.registry = registry if registry is not None else default_registry
        self.strict = strict
        self.pinned = False
        self._lock = threading.RLock()
        self._bound: list[_Bound] | None = None
        self._inputs: list[_Input] = []
        self._by_path: dict[str, list[int]] = {}
        self._identities: list[RawIdentity] = []
        self._stale: set[int] = set()
        self._failed_update: str | None = None
        self._watch: dict[int, list[_Input]] | None = None
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
            raise GraphSafetyError("the model of this runtime no longer exists")
        return model

    def _ensure_bound(self) -> list[_Bound]:
        if self._bound is None:
            self._bound = self._bind()
        return self._bound

    def _bind(self) -> list[_Bound]:
        model = self.model
        bound: list[_Bound] = []
        produced: dict[tuple[int, str], _Bound] = {}
        absent: dict[tuple[int, str], Derivation] = {}
        for mpath, module in model.named_modules(remove_duplicate=True):
            _OWNERS[module] = self
            for spec in self.registry.derivations_for(type(module)):
                if spec.when is not None and not spec.when(module):
                    for name in spec.outputs:
                        absent[(id(module), name)] = spec
                        if name not in module._buffers and name not in module.__dict__:
                            module.register_buffer(name, None, persistent=False)
                    continue
                b = _Bound(spec, module, mpath)
                for name in spec.outputs:
                    _check_output_free(b, module, name)
                    produced[(id(module), name)] = b
                bound.append(b)
        inputs: dict[tuple[int, str], _Input] = {}
        for b in bound:
            module = b.module_ref()
            assert module is not None
            for rel, full in zip(b.spec.inputs, b.inputs):
                owner, name = _walk(b, module, rel)
                producer = produced.get((id(owner), name))
                if producer is not None:
                    b.deps.add(id(producer))
                    b.in_refs.append((owner._buffers, name))
                    continue
                if (id(owner), name) in absent:
                    raise b.error(
                        RegistrationError,
                        f"input {rel!r} is a derived buffer this module does not own",
                        path=full,
                        expected=f"{full} materialized by {absent[(id(owner), name)].name}",
                        got="its `when` is false for this module, so it stays None",
                        fix="make the `when` conditions of the two derivations agree",
                    )
                container = _container_of(b, owner, name, full)
                key = (id(container), name)
                inp = inputs.get(key)
                if inp is None:
                    inp = inputs[key] = _Input(full, container, name)
                b.in_refs.append((container, name))
                b.leaf_inputs.append(inp)
        ordered = _toposort(bound)
        for i, b in enumerate(ordered):
            b.index = i
        by_id = {id(b): b for b in ordered}
        for b in ordered:
            b.deps = {by_id[d].index for d in b.deps}
        for b in reversed(ordered):
            reach = {b.index}
            for other in ordered[b.index + 1 :]:
                if other.deps & reach:
                    reach.add(other.index)
            b.downstream = tuple(sorted(reach))
        self._inputs = list(inputs.values())
        self._by_path = {}
        for b in ordered:
            for inp in b.leaf_inputs:
                if b.index not in inp.consumers:
                    inp.consumers.append(b.index)
            for p in b.inputs:
                self._by_path.setdefault(p, []).append(b.index)
        self._identities = [(b.path, b.spec.name, b.out_paths, 0) for b in ordered]
        self._stale = {b.index for b in ordered}
        self._watch = None
        return ordered

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
            for inp in self._inputs:
                if inp.moved():
                    for i in inp.consumers:
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
            raise StaleError(
                f"{len(stale)} derived buffer(s) do not match their inputs",
                paths=stale,
                path=", ".join(stale[:8]) + (" ..." if len(stale) > 8 else ""),
                expected="every derived buffer refreshed from the current weights",
                got="stale: " + ", ".join(stale[:8]),
                fix="finish the weight update (a load that completes, or gs.runtime(model)"
                ".refresh()) before running the model",
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
                plan: Sequence[int] = range(len(bound))
                report = self._run(plan)
                self._failed_update = None
                return report
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

        Example:
            >>> # with gs.weight_update(model):
            >>> #     for bucket in buckets:
            >>> #         model.load_weights(bucket)
        """
        with self._lock:
            if self._update is not None:
                yield self
                return
            self._ensure_bound()
            tracker = WriteTracker(self._watch_map())
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
        bound = self._ensure_bound()
        dirty = self._written_consumers(written)
        for inp in self._inputs:
            if inp.moved():
                dirty.update(inp.consumers)
        for i in self._plan(dirty):
            self._stale.add(i)
        first = str(exc).splitlines()[0] if str(exc) else ""
        self._failed_update = f"{type(exc).__name__}: {first}"
        del bound

    def _finish_update(self, written: set[int]) -> None:
        bound = self._ensure_bound()
        dirty = self._scan_moved() | self._written_consumers(written)
        dirty.update(b.index for b in bound if b.buffers is None)
        dirty.update(self._stale)
        self._run(self._plan(dirty))
        self._failed_update = None

    def _written_consumers(self, written: set[int]) -> set[int]:
        watch = self._watch_map()
        dirty: set[int] = set()
        for key in written:
            for inp in watch.get(key, ()):
                dirty.update(inp.consumers)
        return dirty

    def _watch_map(self) -> dict[int, list[_Input]]:
        if self._watch is None:
            watch: dict[int, list[_Input]] = {}
            for inp in self._inputs:
                if inp.tensor is not None:
                    key = storage_key(inp.tensor)
                    if key:
                        watch.setdefault(key, []).append(inp)
            self._watch = watch
        return self._watch

    def _scan_moved(self) -> set[int]:
        """Indices of derivations whose inputs were rebound; accepts the new tensors.

        After `pin()` a rebinding raises `StorageMovedError` instead.
        """
        dirty: set[int] = set()
        moved = [inp for inp in self._inputs if inp.moved()]
        if not moved:
            return dirty
        if self.pinned:
            for inp in moved:
                for i in inp.consumers:
                    self._stale.update(self._ensure_bound()[i].downstream)
            raise _moved_error(moved, self._ensure_bound())
        for inp in moved:
            inp.accept()
            dirty.update(inp.consumers)
        self._watch = None
        return dirty

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
        bound = self._ensure_bound()
        start = time.perf_counter()
        raw: list[RawEntry] = []
        failed: set[int] = set()
        first_error: BaseException | None = None
        # Storages of every model tensor, for the purity check (once per run, not per
        # derivation: walking the model is O(model)).
        pending = self.strict or any(bound[i].buffers is None for i in plan)
        watch = self._purity_watch() if pending else None
        clock = time.perf_counter
        with torch.no_grad():
            for i in plan:
                b = bound[i]
                if failed and not b.deps.isdisjoint(failed):
                    failed.add(i)
                    continue
                t0 = clock()
                try:
                    if b.buffers is None:
                        assert watch is not None
                        self._materialize(b, watch)
                        raw.append((i, _MATERIALIZED, _SLOW, clock() - t0, True))
                    elif watch is None and b.fast:
                        self._refresh_fast(b)
                        raw.append((i, _REFRESHED, _FAST, clock() - t0, True))
                    else:
                        taken = self._refresh_checked(b, watch if self.strict else None)
                        raw.append((i, _REFRESHED, taken, clock() - t0, True))
                except Exception as exc:
                    failed.add(i)
                    raw.append((i, _FAILED, _NONE, clock() - t0, self._geometry_held(b)))
                    if first_error is None:
                        first_error = exc
        stale = self._stale
        for i in plan:
            if i in failed:
                stale.update(bound[i].downstream)
            else:
                stale.discard(i)
        if first_error is not None:
            raise first_error
        report = RefreshReport.from_raw(self._identities, raw, clock() - start)
        self.last_report = report
        return report

    def _inputs_of(self, b: _Bound) -> list[torch.Tensor]:
        return [c[k] for c, k in b.in_refs]

    def _refresh_fast(self, b: _Bound) -> None:
        """The hot path: one output, `out=`, nothing to check but the geometry."""
        buf: torch.Tensor = b.out_arg
        if b.container.get(b.outputs[0]) is not buf:
            self._refresh_checked(b, None)  # replaced, e.g. by model.to(): adopt or refuse
            return None
        try:
            ret = b.fn(b.module_ref(), *[c[k] for c, k in b.in_refs], out=buf)
        except Exception:
            self._restore_geometry(b, raise_drift=False)
            raise
        ptr, shape, _ = b.geometry[0]
        if buf.data_ptr() != ptr or buf.shape != shape:
            self._restore_geometry(b, raise_drift=True)
        if ret is not buf:
            # Computed apart after all: validate, then copy in (the slow path).
            buf.copy_(self._check_results(b, ret)[0])
            b.fast = False
        return None

    def _geometry_held(self, b: _Bound) -> bool:
        return all(
            buf.data_ptr() == ptr and buf.shape == shape
            for buf, (ptr, shape, _) in zip(b.buffers or (), b.geometry)
        )

    def _refresh_checked(self, b: _Bound, purity: dict[int, str] | None) -> int:
        """Every other case: several outputs, no `out=`, strict purity, moved buffers."""
        module = b.module_ref()
        buffers = b.buffers
        assert module is not None and buffers is not None
        for j, name in enumerate(b.outputs):
            if b.container.get(name) is not buffers[j]:
                self._adopt_moved_buffer(b, j)
        args = self._inputs_of(b)
        guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if purity is not None:
            own = {storage_key(t) for t in buffers}
            guard = WriteTracker(
                {k: p for k, p in purity.items() if k not in own}, self._impure(b, purity)
            )
        if b.accepts_out:
            out = b.out_arg
            try:
                with guard:
                    ret = b.fn(module, *args, out=out)
            except Exception:
                self._restore_geometry(b, raise_drift=False)
                raise
            self._restore_geometry(b, raise_drift=True)
            if ret is out or (
                isinstance(ret, (tuple, list))
                and len(ret) == len(buffers)
                and all(r is o for r, o in zip(ret, buffers))
            ):
                return _FAST
        else:
            with guard:
                ret = b.fn(module, *args)
        results = self._check_results(b, ret)
        if len(results) == 1:
            buffers[0].copy_(results[0])
        else:
            torch._foreach_copy_(buffers, results)
        return _SLOW

    def _check_results(self, b: _Bound, ret: Any) -> list[torch.Tensor]:
        """Validate a result computed apart against the buffers, before any write."""
        results = _as_results(b, ret)
        for j, (r, buf) in enumerate(zip(results, b.buffers or ())):
            if (
                r.shape != buf.shape
                or r.dtype != buf.dtype
                or r.device != buf.device
                or r.layout != buf.layout
            ):
                raise b.error(
                    DerivationDriftError,
                    f"result of {b.spec.name} does not fit the buffer materialized for it",
                    path=b.out_paths[j],
                    expected=f"shape {tuple(buf.shape)}, dtype {buf.dtype}, device "
                    f"{buf.device}, layout {buf.layout}",
                    got=f"shape {tuple(r.shape)}, dtype {r.dtype}, device {r.device}, "
                    f"layout {r.layout}",
                    fix="a derived buffer keeps its shape, dtype and device for its whole "
                    "life: check that the loader wrote inputs of the original shapes; if "
                    "the model really changed, build a new model and re-capture",
                )
        return results

    def _restore_geometry(self, b: _Bound, *, raise_drift: bool) -> None:
        """Undo torch's resize of an `out=` buffer of the wrong shape."""
        for j, buf in enumerate(b.buffers or ()):
            ptr, shape, stride = b.geometry[j]
            if buf.data_ptr() == ptr and buf.shape == shape and buf.stride() == stride:
                continue
            got = f"shape {tuple(buf.shape)}, stride {buf.stride()}, storage 0x{buf.data_ptr():x}"
            moved = buf.data_ptr() != ptr
            if not moved:
                buf.set_(buf.untyped_storage(), buf.storage_offset(), shape, stride)
            if not raise_drift and not moved:
                continue
            raise b.error(
                DerivationDriftError,
                f"{b.spec.name} wrote a result of the wrong shape into its buffer "
                + ("(torch reallocated it)" if moved else "(its geometry was restored)"),
                path=b.out_paths[j],
                expected=f"shape {tuple(shape)}, stride {stride}, storage 0x{ptr:x}",
                got=got,
                fix="make the derivation produce the buffer's shape; check that the loader "
                "wrote inputs of the original shapes",
            )

    def _adopt_moved_buffer(self, b: _Bound, j: int) -> None:
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
                expected=_meta(old) if old is not None else "the materialized buffer",
                got=_meta(new) if isinstance(new, torch.Tensor) else repr(new),
                fix="never assign derived buffers: graphsafe writes them in place; to move "
                "the model, unpin(), move it, refresh() and re-capture",
            )
        locked = _pin_storage(new)
        b.container[name] = locked
        assert b.buffers is not None
        buffers = list(b.buffers)
        buffers[j] = locked
        b.set_buffers(buffers)

    def _materialize(self, b: _Bound, watch: dict[int, str]) -> None:
        module = b.module_ref()
        assert module is not None
        with WriteTracker(watch, self._impure(b, watch)):
            ret = b.fn(module, *self._inputs_of(b))
        results = _as_results(b, ret)
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
                t = _pin_storage(t)
                module.register_buffer(name, t, persistent=False)
            buffers.append(t)
            watch.setdefault(storage_key(t), _join(b.module_path, name))
        b.set_buffers(buffers)
        self._identities[b.index] = (b.path, b.spec.name, b.out_paths, b.nbytes)

    def _purity_watch(self) -> dict[int, str]:
        watch: dict[int, str] = {}
        for path, t in _model_tensors(self.model):
            key = storage_key(t)
            if key:
                watch.setdefault(key, path)
        return watch

    def _impure(self, b: _Bound, watch: dict[int, str]) -> Callable[[int, str], None]:
        def refuse(key: int, op: str) -> None:
            raise b.error(
                ImpureDerivationError,
                f"{b.spec.name} wrote into {watch[key]!r}, a tensor of the model",
                path=watch[key],
                expected="a pure function: read the inputs, write only the result (or `out`)",
                got=f"{op} writing {watch[key]}",
                fix="compute into a new tensor (e.g. `w * scale` instead of `w.mul_(scale)`); "
                "the write was refused, nothing was changed",
            )

        return refuse


def _as_results(b: _Bound, ret: Any) -> list[torch.Tensor]:
    results = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    if len(results) != len(b.outputs) or not all(
        isinstance(r, torch.Tensor) for r in results
    ):
        raise b.error(
            DerivationDriftError,
            f"{b.spec.name} returned something other than one tensor per output",
            expected=f"{len(b.outputs)} tensor(s) for {b.outputs}",
            got=f"{type(ret).__name__}"
            + (f" of {len(results)}" if isinstance(ret, (tuple, list)) else ""),
            fix="return a tensor, or a tuple of tensors in the order of `outputs`",
        )
    return results


def _moved_error(moved: Sequence[_Input], bound: Sequence[_Bound]) -> StorageMovedError:
    inp = moved[0]
    b = bound[inp.consumers[0]]
    t = inp.container.get(inp.key)
    return StorageMovedError(
        f"{len(moved)} pinned input(s) were rebound to new storage: "
        + ", ".join(i.path for i in moved),
        drifts=tuple(i.path for i in moved),
        module_class=b.module_class,
        path=inp.path,
        derivation=b.spec.name,
        expected=f"storage 0x{inp.ptr:x} (pinned)",
        got=_meta(t) if isinstance(t, torch.Tensor) else repr(t),
        fix="write new weights into the existing tensors (`param.data.copy_(w)`) instead "
        "of rebinding them (`param.data = w`, attribute assignment, `set_`); or unpin(), "
        "refresh() and re-capture the graphs",
    )


def _check_output_free(b: _Bound, module: nn.Module, name: str) -> None:
    kind = None
    if name in module._parameters:
        kind = "a parameter"
    elif name in module._modules:
        kind = "a submodule"
    elif name in module._buffers and name not in module._non_persistent_buffers_set:
        kind = "a persistent buffer"
    elif module.__dict__.get(name) is not None:
        kind = "an attribute"
    if kind is not None:
        raise b.error(
            RegistrationError,
            f"output {name!r} collides with {kind} of the same name",
            path=_join(b.module_path, name),
            expected=f"a free name for the derived buffer {name!r}",
            got=f"{kind} {_join(b.module_path, name)!r} already exists",
            fix="rename the output or the existing attribute",
        )


def _walk(b: _Bound, module: nn.Module, rel: str) -> tuple[nn.Module, str]:
    parts = rel.split(".")
    owner = module
    for depth, part in enumerate(parts[:-1]):
        child = owner._modules.get(part)
        if child is None:
            raise b.error(
                RegistrationError,
                f"unknown input path {rel!r}",
                path=_join(b.module_path, rel),
                expected=f"a submodule {'.'.join(parts[: depth + 1])!r} of "
                f"{type(module).__name__}",
                got="submodules: " + (", ".join(owner._modules) or "none"),
                fix="inputs are dotted paths relative to the module that owns the derivation",
            )
        owner = child
    return owner, parts[-1]


def _container_of(b: _Bound, owner: nn.Module, name: str, full: str) -> dict[str, Any]:
    for container in (owner._parameters, owner._buffers):
        if name in container:
            if container[name] is None:
                break
            return container
    else:
        if isinstance(owner.__dict__.get(name), torch.Tensor):
            return owner.__dict__
    known = [*owner._parameters, *owner._buffers] + [
        k for k, v in owner.__dict__.items() if isinstance(v, torch.Tensor)
    ]
    raise b.error(
        RegistrationError,
        f"unknown input path {full!r}",
        path=full,
        expected=f"a parameter, buffer or tensor attribute {name!r} of {type(owner).__name__}",
        got=("tensors there: " + ", ".join(known)) if known else "no tensors there",
        fix="check the spelling of `inputs`, or create the tensor in __init__",
    )


def _toposort(bound: list[_Bound]) -> list[_Bound]:
    by_id = {id(b): b for b in bound}
    indeg = {id(b): len(b.deps) for b in bound}
    users: dict[int, list[_Bound]] = {id(b): [] for b in bound}
    for b in bound:
        for d in b.deps:
            users[d].append(b)
    ready = [b for b in bound if indeg[id(b)] == 0]
    order: list[_Bound] = []
    while ready:
        b = ready.pop(0)
        order.append(b)
        for u in users[id(b)]:
            indeg[id(u)] -= 1
            if indeg[id(u)] == 0:
                ready.append(u)
    if len(order) != len(bound):
        left = [b for b in bound if indeg[id(b)] > 0]
        names = " -> ".join(f"{x.spec.name} ({x.path})" for x in left)
        raise left[0].error(
            RegistrationError,
            "derivations depend on each other in a cycle",
            expected="an acyclic graph of derivations",
            got=names,
            fix="break the cycle: no derivation may read, directly or not, its own outputs",
        )
    del by_id
    return order


def _model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mpath, module in model.named_modules(remove_duplicate=False):
        for name, t in module._parameters.items():
            if t is not None:
                yield _join(mpath, name), t
        for name, t in module._buffers.items():
            if t is not None:
                yield _join(mpath, name), t
        for name, t in module.__dict__.items():
            if isinstance(t, torch.Tensor):
                yield _join(mpath, name), t


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

    Example:
        >>> from torch import nn
        >>> rt = runtime(nn.Linear(2, 2))
        >>> rt.stale
        ()
    """
    with _CREATE:
        rt = _RUNTIMES.get(model) or _OWNERS.get(model)
        if rt is None:
            rt = Runtime(model, registry)
            _RUNTIMES[model] = rt
    if strict is not None:
        rt.strict = strict
    return rt


def weight_update(model: nn.Module) -> contextlib.AbstractContextManager[Runtime]:
    """Shortcut for `gs.runtime(model).weight_update()`.

    Args:
        model: The model being updated.

    Returns:
        A context manager: loads inside do not refresh; one refresh happens at the end.

    Example:
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> with weight_update(model):
        ...     pass
    """
    return runtime(model).weight_update()
