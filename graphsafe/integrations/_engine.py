"""What every engine integration shares: how registry names resolve in an engine's
processes, patches installed once, the weight update an engine's entry points open and
close on one attached model, the status and the fingerprints it reports
(`EngineAttachment`), and how a loaded model is attached once (`attach_once`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from graphsafe._declare.registry import Registry
from graphsafe._errors import GraphSafetyError, RegistrationError
from graphsafe._fingerprint.digest import fingerprint
from graphsafe._graphs.guard import Guard
from graphsafe._graphs.reads import ReadTracker
from graphsafe._lineage import Lineage
from graphsafe._memory.walk import Site, storage_key
from graphsafe._runtime.freshness import in_update_error
from graphsafe._runtime.runtime import Runtime, runtime

__all__ = [
    "EngineAttachment",
    "Once",
    "attach_once",
    "no_registry",
    "read_by_address",
    "resolve_registries",
]


def no_registry() -> Registry:
    """An empty registry: what an engine's plugin is told to use when it should check only
    what the engine's own code derives from the weights (found by provenance)."""
    return Registry()


def resolve_registries(
    spec: str | Iterable[str | Registry], *, env: str, engine: str
) -> list[Registry]:
    """The registries named by `spec`: comma-separated `module:attribute` names (the
    format of the environment variable `env`) or registries and names.

    Each name is a `gs.Registry` or a function returning one, imported anew in every
    process of the `engine` (names, not objects, travel between its processes).

    Raises:
        RegistrationError: A name does not resolve to a registry.
    """
    items = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else spec
    out: list[Registry] = []
    for item in items:
        if isinstance(item, Registry):
            out.append(item)
            continue
        mod, _, attr = item.partition(":")
        try:
            obj: Any = getattr(importlib.import_module(mod), attr) if attr else None
        except (ImportError, AttributeError) as exc:
            obj = exc
        if callable(obj) and not isinstance(obj, Registry):
            obj = obj()
        if not isinstance(obj, Registry):
            raise RegistrationError(
                f"{env} names {item!r}, which is not a graphsafe registry",
                expected="'module:attribute' naming a gs.Registry or a function returning one",
                got=repr(obj) if not isinstance(obj, Exception) else f"{type(obj).__name__}: "
                f"{obj}",
                fix=f"make the module importable in every {engine} process (on its path) and "
                "name the registry object",
            )
        out.append(obj)
    return out


class Once:
    """The patches of one integration, each installed once per process."""

    __slots__ = ("_lock", "done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.done: set[str] = set()
        """The names of the patches installed."""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[bool]:
        """Hold the patch lock; yield whether the patch `name` is installed for the first
        time."""
        with self._lock:
            first = name not in self.done
            self.done.add(name)
            yield first


def read_by_address(site: Site) -> bool:
    """Whether a graph reads the tensor at `site` by its address: all but host scalars kept
    as plain module attributes (kernels take them by value, so a graph bakes in their value
    at capture, and engines' reloads bind them anew)."""
    t = site.tensor
    host_scalar = t.device.type == "cpu" and t.dim() == 0
    return not (host_scalar and site.container is site.module.__dict__)


class EngineAttachment:
    """graphsafe's state on one engine model: its runtime, the guard once pinned, and the
    weight update the engine's entry points keep open (one per outermost entry point, or
    per session).

    Args:
        model: The loaded model.
        registries: Where its derived buffers are declared.
    """

    recorded_forwards: ClassVar[int] = 1
    """How many forwards after a pin with `record_reads` are recorded (their reads joined)
    before the bring-up ends: 1 where the engine runs a warm-up forward before the pin
    (state made on first use is made there, and the first step after it reads it); 2
    where none runs, so that the second step reads, as made before it, what the first
    made and kept (a cache packed on first use)."""

    loads_tracked: ClassVar[bool] = False
    """Whether the engine's `model.load_weights` writes the model only through torch ops,
    which graphsafe's tracker sees: then a bare load that raised before writing anything
    (the engine refused its first entry) leaves nothing owed. Otherwise a failed load owes
    every weight, as any failed update does."""

    def __init__(self, model: nn.Module, registries: Iterable[Registry]) -> None:
        rt = runtime(model)
        for reg in registries:
            rt.add_registry(reg)
        self.runtime: Runtime = rt
        self.guard: Guard | None = None
        self.updates = 0
        """Updates completed since the attachment."""
        self._open: contextlib.ExitStack | None = None
        self._owner: object = None
        self.recording = False
        """Whether the next guarded forward is recorded (an engine that runs op by op)."""
        self._reads: frozenset[int] | None = frozenset()  # what the recorded forwards read
        self._outside: dict[int, torch.Tensor] = {}  # storage key -> a tensor read there
        self._forwards = 0  # forwards recorded so far
        self._bring_up = contextlib.ExitStack()
        """Holds the model's bring-up open from the pin of an engine that records its
        first forward until that forward ends: a cache outside the model that it reads
        (packed on first use or before) is matched against what the bring-up computed
        from the weights."""

    @property
    def model(self) -> nn.Module:
        """The attached model."""
        return self.runtime.model

    @property
    def updating_now(self) -> bool:
        """Whether a graphsafe weight update of this model is open."""
        return self._open is not None

    def begin(self, owner: object) -> None:
        """Open a weight update owned by `owner` (only its `end` closes it), unless one is
        open already (`owner` then owns nothing)."""
        if self._open is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.runtime.weight_update())
        self._open, self._owner = stack, owner

    def end(
        self, owner: object, exc: BaseException | None = None, *, tracked: bool = False
    ) -> None:
        """Close the update `owner` opened: refresh once, or fail closed on `exc`.

        Args:
            owner: Who opened it (`begin`); anyone else closes nothing.
            exc: What the update raised, if it failed.
            tracked: The update ran only code that writes through torch ops (an engine's
                weight loaders): if it failed before writing anything, it owes nothing,
                since the model holds its old weights, whole.

        Raises:
            GraphSafetyError: What the update's end found (a rebound tensor, a failed
                derivation); the model then stays failed closed.
        """
        stack = self._open
        if stack is None or self._owner is not owner:
            return
        if exc is not None:
            if tracked and not _wrote_anything(self.runtime):
                # Nothing was written: the update names no tensor as written from now
                # on, so only what it did write (a rebound tensor, none here) is owed.
                self.runtime.expect_writes(())
            self._open, self._owner = None, None
            stack.__exit__(type(exc), exc, exc.__traceback__)
            return
        self._open, self._owner = None, None
        stack.close()
        self.updates += 1
        self._updated()

    def _updated(self) -> None:
        """Called after each update that completed (a hook for the engine's attachment)."""

    # -- pin and guard -----------------------------------------------------------

    def pin(self, *, record_reads: bool = False, graphs: bool = True) -> None:
        """Pin the model as the engine's graphs saw it (after capture or warm-up).

        Every parameter, buffer, derived buffer and tensor attribute is pinned except
        host scalars kept as plain attributes (`read_by_address`): kernels take them by
        value, so a graph bakes in their value at capture, never their address, and the
        engines' own reloads bind them anew.

        Args:
            record_reads: The engine captures no graphs and runs op by op: its first
                guarded forward (`recorded`) is recorded, and the bring-up stays open
                until it ends; what it reads outside the model that the bring-up computed
                from the weights is guarded from then on.
            graphs: The engine captured graphs that read the model by address: a moved
                tensor is refused. False (a CPU engine, an eager one): each step reads
                what is bound, so a tensor rebound to new memory (a packed copy the
                engine's post-load step rebuilt) is followed and listed in the status
                (`moved`); stale content is refused either way.
        """
        if self.guard is not None:
            return
        if record_reads:  # no capture ends the bring-up: the first recorded forward does
            self._bring_up.enter_context(self.runtime.capturing())
        guard = self.guard = Guard(self.model, self, repair=False, keep=read_by_address,
                                   holds_addresses=graphs)
        self.recording = record_reads
        # Every pinned tensor the guard checks, not only derivation inputs, is checked when
        # a load or update ends, so a rebinding raises through the call that made it (the
        # guard's ledger as it is then: narrowed after the first forward).
        self.runtime.add_load_check(guard.assert_stable)

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """One forward under the guard's checks, recorded while `recording`. Once
        `recorded_forwards` have been: what they read that the model does not hold and
        no op of the same forward made is listed (`guard.inputs`), those tensors the
        bring-up computed from the weights (a kernel library's cache of packed weights)
        are guarded, the engine's `_narrowed` hook gets the read set, and the bring-up
        ends. Later forwards are not recorded. A forward that raises is not counted.

        Raises:
            StorageMovedError: A tensor or submodule the guard checks was rebound.
            StaleError: Derived buffers are stale, or the last weight update failed or has
                not ended.
        """
        guard = self.guard
        if guard is None:
            yield
            return
        with guard.replaying():
            if not self.recording:
                yield
                return
            with self._read_tracker() as rec:
                yield
            # Keys and what was read outside only: not the forward's activations.
            reads = rec.reads
            self._reads = None if reads is None or self._reads is None else self._reads | reads
            for t in rec.outside():
                self._outside.setdefault(storage_key(t), t)
            self._forwards += 1
            if self._forwards < self.recorded_forwards:
                return
            self.recording = False
            reads, outside = self._reads, list(self._outside.values())
            self._outside = {}
            try:
                self._narrowed(guard, reads, outside)
            finally:
                self._bring_up.close()  # the bring-up ends with the last recorded forward

    def _read_tracker(self) -> ReadTracker:
        """The recorder of a forward (an engine's own knows its opaque ops)."""
        return ReadTracker()

    def _narrowed(self, guard: Guard, reads: frozenset[int] | None,
                  outside: list[torch.Tensor]) -> None:
        """After the recorded forwards: take what they read outside the model (the whole
        model stays checked: a later forward may read what these did not)."""
        guard.narrow(None, outside)

    def _describe(self, *, read_set: bool = False) -> dict[str, Any]:
        """What graphsafe holds for this model, as plain data: an engine's `status()`.

        Args:
            read_set: Also say whether the guard checks only what a recorded forward read
                (`read_set`) and how many tensors that forward read that the model does not
                hold (`inputs`): for an engine whose guard narrows to a read set.
        """
        rt = self.runtime
        report = rt.last_report
        guard = self.guard
        found = rt.discovered
        # How many of the model's tensors the guard checks; with `read_set`, whether only
        # those the first forward read, and how many tensors it read that the model does
        # not hold (input buffers, attention metadata).
        checks: dict[str, bool | int] = {
            "checked": 0 if guard is None else len(guard.ledger),
            # Whether forwards after the pin are still recorded (an engine that runs op by
            # op: its first `recorded_forwards`, with the bring-up open until they end).
            "recording": self.recording,
        }
        if read_set:
            checks = {
                "read_set": guard is not None and guard.reads is not None,
                **checks,
                "inputs": 0 if guard is None else len(guard.inputs),
            }
        return {
            "pinned": rt.pinned,
            # Declared derived buffers, then discovered tensors, whose inputs were
            # written since they were computed (read by the engine's forward or not).
            "stale": list(
                dict.fromkeys([*rt.stale, *(d.path for d in found if d.stale and not d.exempt)])
            ),
            "updates": self.updates,
            "derived": [p for d in rt.derivations for p in d.outputs],
            # What the engine's own code derived from the weights without a declaration
            # (found by provenance), each with the weights it was computed from.
            "discovered": {d.path: list(d.sources) for d in found},
            "last_refresh_bytes": None if report is None else report.bytes_written,
            **checks,
            # Whether the engine's captured graphs read the pinned tensors by address; then
            # a moved one is a fault (`faults`: refused at the next step), else it is
            # followed (`moved`: every move since the pin, the step reads what is bound).
            "graphs": guard is not None and guard.holds_addresses,
            "moved": {} if guard is None else {p: list(w) for p, w in guard.followed.items()},
            "faults": {} if guard is None else {p: list(w) for p, w in guard.faults().items()},
        }

    def fingerprint(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """The engine model's fingerprints (`gs.fingerprint`): of its parameters and
        persistent buffers by the engine's own names, or of `names` among them.

        What a trainer compares with `gs.fingerprint(policy)` after a sync, name by name
        where the names map one to one (a fused `qkv_proj` has no counterpart in the
        policy's `q_proj`, `k_proj`, `v_proj`: see `docs/rl-weight-sync.md`).

        Raises:
            KeyError: `names` holds a name the model does not hold.
        """
        return dict(fingerprint(self.model, names))

    def updating(
        self, owner: object, fn: Callable[..., Any], *, tracked: bool = False
    ) -> Callable[..., Any]:
        """`fn` run as one weight update (or inside the one open); `tracked`: as `end`
        takes it."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.begin(owner)
            try:
                ret = fn(*args, **kwargs)
            except BaseException as exc:
                self.end(owner, exc, tracked=tracked)
                raise
            self.end(owner)
            return ret

        return run


_IN_UPDATE = in_update_error(nn.Module, 0).summary


def _wrote_anything(rt: Runtime) -> bool:
    """Whether the weight update open in this thread has written a tensor of the model.

    `Runtime.assert_fresh` refuses an open update before anything else, and only once it
    has written something (its `in_update_error`); any other refusal (a stale buffer, a
    debt of an earlier failure) comes after, so the update wrote nothing.
    """
    try:
        rt.assert_fresh()
    except GraphSafetyError as exc:
        return exc.summary == _IN_UPDATE
    return False


_A = TypeVar("_A", bound=EngineAttachment)


def attach_once(
    attached: MutableMapping[nn.Module, _A],
    model: nn.Module,
    make: Callable[[], _A],
    *,
    lineage: Lineage | None = None,
    lazy_refresh: bool | None = None,
) -> _A:
    """Attach `model` once: the attachment `make` returns, its derived buffers
    materialized, what `lineage` recorded discovered, and `model.load_weights` made a
    graphsafe load (a weight update of its own, or part of the one open); on a later call,
    the same attachment, adopting `lineage`.

    Args:
        attached: The engine's map of attached models, where a new attachment is put.
        model: The model, after the engine loaded it.
        make: A new attachment of `model` (called on the first call only).
        lineage: What `gs.record_lineage()` recorded around the engine's first load.
        lazy_refresh: A new attachment's `gs.Runtime.lazy_refresh` (None: as it is).

    Raises:
        RegistrationError: A bound tensor does not fit its derived buffer.
    """
    have = attached.get(model)
    if have is not None:
        if lineage is not None:
            have.runtime.adopt_lineage(lineage)
        return have
    att = make()
    att.runtime.refresh()
    if lazy_refresh is not None:
        att.runtime.lazy_refresh = lazy_refresh
    if lineage is not None:  # after the refresh: declared buffers are not discovered
        att.runtime.adopt_lineage(lineage)
    attached[model] = att
    load: Callable[..., Any] = getattr(model, "load_weights")  # noqa: B009 (the engine's)
    token = object()

    @functools.wraps(load)
    def load_weights(*args: Any, **kwargs: Any) -> Any:
        return att.updating(token, load, tracked=att.loads_tracked)(*args, **kwargs)

    setattr(model, "load_weights", load_weights)  # noqa: B010 (on the instance)
    return att
