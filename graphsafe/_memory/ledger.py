"""The storage ledger: pins where every tensor of a model lives.

A captured graph reads raw addresses. `Ledger.snapshot(model)` records, for every tensor
reachable from the module tree (parameters, buffers, plain tensor attributes, and tensors
held in lists, tuples and dicts stored as attributes), the tensor object itself and its
storage pointer, offset, shape, stride, dtype and device; and which module is bound at
every path. `Ledger.verify()` reports every `Drift`; `Ledger.assert_stable()` raises
`StorageMovedError` naming them all.

`verify()` runs before every guarded replay, so the clean case is a flat check, each step
one `map` over all entries compared in one go. Only a mismatch pays for the detailed diff
(`diff`); what is recorded per tensor and per binding is in `pins`.

1. Identity. Every module binding (`parent._modules[key]`), every `_modules`,
   `_parameters` and `_buffers` dict a pin goes through, and every tensor in its
   container still holds the very object pinned. This catches any rebinding (a new
   `nn.Parameter`, `register_buffer`, `m.x = ...`, a list item, a swapped or deleted
   submodule), even one that looks the same: empty tensors all have data pointer 0.
   Tensors inside lists, tuples and dicts are looked up through them each time. A dict
   replaced by one holding the same objects (`del layers[2:2]` rebuilds `_modules`) is
   no drift, but keeps `verify()` on the detailed path until the next snapshot.
2. Geometry of the pinned tensor objects: `data_ptr()`, `stride()`, `shape` and `dtype`.
   Once identity holds, these can only change through the tensor itself: in-place
   metadata ops (`set_`, `resize_`, `as_strided_`, `t_`), `.data = ...`, or
   `torch.utils.swap_tensors`. `.data =` bumps no version counter and leaves no trace but
   the new metadata, and it can change each of the four alone (`.data = w.data.clone()`
   only the pointer, `w.data.t()` only the stride, `w.data.as_strided((2, 8), (4, 1))` of
   a 4x4 only the shape, `b.data.view(torch.int32)` only the dtype), so no cheaper probe
   (`_version`, `numel()`, `dim()`, `is_contiguous()`, ...) can stand in for any of them.
   `data_ptr()` is the storage's address plus the offset, and the ledger keeps every
   pinned storage alive, so no other live allocation can start at a pinned address (CPU
   and CUDA memory share one address space): an equal pointer is the same memory, hence
   the same device. Tensors of zero bytes and meta tensors, whose pointer is 0, get their
   device compared as well.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Set
from typing import Any

import torch
from torch import nn

from graphsafe import _native
from graphsafe._declare.spec import Drift
from graphsafe._memory.diff import holder_drift, module_drift, pin_drifts, resolve_pin
from graphsafe._memory.drift import moved_error
from graphsafe._memory.pins import CHECK_ERRORS, Pin, SubmodulePin, has_storage, pin
from graphsafe._memory.snapshot import DATA_PTR, PLAIN, STRIDE
from graphsafe._memory.walk import (
    Attr,
    Cell,
    Field,
    Ref,
    Site,
    Slot,
    step,
    walk,
    walk_modules,
)

__all__ = ["Ledger"]

# The flat check reads one field of all tensors at a time: `map` over a C method or
# getter is faster than a comprehension building a tuple per tensor.
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


class Ledger:
    """Pins every tensor reachable from a module tree, and every module along the way.

    Build it with `Ledger.snapshot(model)`. It holds the pinned modules, containers and
    tensor objects, and keeps the pinned storages alive: no later allocation can reuse
    their addresses, so a tensor given new memory always shows a new data pointer (and a
    graph still reading the old memory reads valid, if stale, memory). All of it is
    released with the ledger.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Linear(4, 4)
        >>> ledger = Ledger.snapshot(model)
        >>> with torch.no_grad():
        ...     _ = model.weight.mul_(2)  # new values in the same memory: no drift
        >>> ledger.verify()
        ()
        >>> model.weight.data = torch.zeros(4, 4)  # new memory
        >>> [(d.path, d.what) for d in ledger.verify()]
        [('weight', 'storage')]
    """

    __slots__ = (
        "_all_refs",
        "_bindings",
        "_dtypes",
        "_geometry",
        "_held",
        "_holders",
        "_keep",
        "_keys",
        "_label",
        "_looked",
        "_native",
        "_objects",
        "_odd",
        "_odd_steps",
        "_pins",
        "_ptrs",
        "_refs",
        "_root",
        "_shapes",
        "_strides",
        "_tensors",
        "_void_devices",
        "_voids",
    )

    def __init__(
        self,
        root: nn.Module,
        pins: tuple[Pin, ...],
        bindings: tuple[SubmodulePin, ...],
        held: tuple[torch.UntypedStorage, ...],
        label: str,
        refs: tuple[Ref, ...] = (),
        keep: Callable[[Site], bool] | None = None,
    ) -> None:
        """Internal: use `Ledger.snapshot`."""
        self._root = root
        self._keep = keep
        self._pins = pins
        self._bindings = bindings
        self._held = held
        self._label = label
        self._all_refs = refs
        # Only the objects on the way to a pinned tensor are checked.
        # And every other reference to those objects (a kernel object shared by two
        # layers), with what lies above it.
        needed: set[int] = set()
        todo = [p.site.via for p in pins]
        while todo:
            for via in todo:
                while via >= 0 and via not in needed:
                    needed.add(via)
                    via = refs[via].via
            objs = {id(refs[i].obj) for i in needed}
            todo = [i for i, r in enumerate(refs) if i not in needed and id(r.obj) in objs]
        self._refs = tuple(refs[i] for i in sorted(needed))
        # Identity links: `holder[key] is obj`, for modules, their dicts, the objects on the
        # way to each tensor, then tensors. Steps no item lookup reads (slots, closure
        # cells, a partial's or a bound method's fields) are checked one by one.
        links: dict[tuple[int, Any], tuple[Any, Any, object]] = {}
        odd: list[tuple[Any, Any, object]] = []
        for b in bindings:
            links[id(b.parent), "_modules"] = (vars(b.parent), "_modules", b.parent._modules)
            links[id(b.parent._modules), b.key] = (b.parent._modules, b.key, b.module)
        for i in sorted(needed):
            r = refs[i]
            _link(links, odd, *_holder_of(r.container, r.key, r.chain, r.via, refs), r.obj)
        for p in pins:
            s = p.site
            if p.slot != "__dict__":
                links[id(s.module), p.slot] = (vars(s.module), p.slot, s.container)
            _link(links, odd, *_holder_of(s.container, s.key, s.chain, s.via, refs), s.tensor)
        self._holders = [holder for holder, _, _ in links.values()]
        self._keys = [key for _, key, _ in links.values()]
        self._objects = [obj for _, _, obj in links.values()]
        # What the compiled check last found at each dict link, with the dict's version:
        # a link whose dict did not change since is not looked up again.
        self._looked = bytearray(16 * len(self._objects))
        self._odd = odd
        # The odd links as the compiled check reads them (`same_steps`): holders, each
        # step's attribute name or closure cell index, the objects.
        self._odd_steps = (
            [holder for holder, _, _ in odd],
            [key.at if type(key) is Cell else key.name for _, key, _ in odd],
            [obj for _, _, obj in odd],
        )
        # Geometry, once per tensor object (tied weights are pinned at each path).
        tensors = list({id(p.site.tensor): p.site.tensor for p in pins}.values())
        self._tensors = tensors
        self._ptrs: list[int] = list(map(DATA_PTR, tensors))
        self._strides: list[tuple[int, ...]] = list(map(STRIDE, tensors))
        self._shapes: list[torch.Size] = list(map(_SHAPE, tensors))
        self._dtypes: list[torch.dtype] = list(map(_DTYPE, tensors))
        self._voids = [t for t, ptr in zip(tensors, self._ptrs) if ptr == 0]
        self._void_devices: list[torch.device] = list(map(_DEVICE, self._voids))
        # The compiled check, when built: the same comparisons in one call each.
        self._native = _native.get()
        self._geometry = None if self._native is None else self._native.geometry(tensors)

    @classmethod
    def snapshot(
        cls,
        model: nn.Module,
        *,
        label: str = "the snapshot",
        keep: Callable[[Site], bool] | None = None,
    ) -> Ledger:
        """Pin every tensor reachable from `model`'s module tree, and every submodule.

        Tensors are pinned through the container that holds them (`_parameters`,
        `_buffers`, or `__dict__` and the lists, tuples and dicts in it); a module shared
        by several parents is walked once and pinned at each binding.

        Args:
            model: The root module.
            label: What the snapshot stands for in messages ("moved after {label}").
            keep: Which tensors to pin (all by default); an engine integration leaves
                out tensors no graph reads by address.

        Returns:
            A ledger of every tensor and submodule found.
        """
        bindings = tuple(
            SubmodulePin(s.path, s.parent, s.key, s.module)
            for s in walk_modules(model)
            if s.parent is not None
        )
        reach = walk(model)
        pins = [
            pin(s)
            for s in reach.sites
            if has_storage(s.tensor) and (keep is None or keep(s))
        ]
        # Entries without a chain first, so that `paths` lists them first.
        ordered = tuple(p for p in pins if not p.site.chain) + tuple(
            p for p in pins if p.site.chain
        )
        return cls._of(model, ordered, bindings, label, tuple(reach.refs), keep)

    @classmethod
    def _of(
        cls,
        model: nn.Module,
        pins: tuple[Pin, ...],
        bindings: tuple[SubmodulePin, ...],
        label: str,
        refs: tuple[Ref, ...],
        keep: Callable[[Site], bool] | None,
    ) -> Ledger:
        held: dict[int, torch.UntypedStorage] = {}
        for p in pins:
            if p.storage:  # 0: no bytes, so no address to hold on to
                held.setdefault(p.storage, p.site.tensor.untyped_storage())
        return cls(model, pins, bindings, tuple(held.values()), label, refs, keep)

    def restricted(self, storages: Set[int]) -> Ledger:
        """This snapshot, keeping only the tensors in `storages` (what a graph reads), the
        objects on the way to them, and every submodule binding.

        Examples:
            >>> from graphsafe._memory.walk import storage_key
            >>> m = nn.Linear(2, 2)
            >>> Ledger.snapshot(m).restricted({storage_key(m.bias)}).paths
            ('bias',)
        """
        pins = tuple(p for p in self._pins if p.storage in storages)
        # Every submodule binding stays: derivations are bound through the module tree, so
        # a module replaced under a graph leaves buffers it reads computed from the old one.
        bindings = self._bindings
        return Ledger._of(self._root, pins, bindings, self._label, self._all_refs, self._keep)

    @property
    def storages(self) -> frozenset[int]:
        """The storage keys of every pinned tensor (0, no bytes, left out)."""
        return frozenset(p.storage for p in self._pins if p.storage)

    @property
    def paths(self) -> tuple[str, ...]:
        """The dotted path of every pinned tensor; those inside lists, tuples and dicts last.

        Examples:
            >>> m = nn.Linear(2, 3)
            >>> m.cache = [torch.zeros(1)]
            >>> m.scale = torch.ones(1)
            >>> Ledger.snapshot(m).paths
            ('weight', 'bias', 'scale', 'cache.0')
        """
        return tuple(p.site.path for p in self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def _unchanged(self) -> bool:
        """The flat check: every pinned object in place, with its pinned data pointer,
        stride, shape and dtype (the module docstring says why that is complete)."""
        native, geometry = self._native, self._geometry
        if native is not None and geometry is not None:
            return (
                native.same_items(self._holders, self._keys, self._objects, self._looked)
                and self._odd_hold()
                and native.same_geometry(self._tensors, geometry)
            )
        try:
            if not all(
                map(operator.is_, map(operator.getitem, self._holders, self._keys), self._objects)
            ):
                return False
            if not self._odd_hold():
                return False
            tensors = self._tensors
            # Metadata reads only: a parameter subclass's __torch_function__ (vLLM's
            # parameters have one) would cost microseconds per field and say nothing.
            with PLAIN():
                return (
                    list(map(DATA_PTR, tensors)) == self._ptrs
                    and list(map(STRIDE, tensors)) == self._strides
                    and list(map(_SHAPE, tensors)) == self._shapes
                    and list(map(_DTYPE, tensors)) == self._dtypes
                    and list(map(_DEVICE, self._voids)) == self._void_devices
                )
        except CHECK_ERRORS:
            return False  # a path holds nothing now, or a tensor without storage

    def _odd_hold(self) -> bool:
        """Whether every slot, closure cell and builtin field on the way still holds what
        it held (the links no item lookup reads): in one compiled call when built, which
        answers only "they hold"; else, or where it does not, read here."""
        native = self._native
        if native is not None and native.same_steps(*self._odd_steps):
            return True
        try:
            for holder, key, obj in self._odd:
                if step(holder, key) is not obj:
                    return False
        except CHECK_ERRORS:
            return False
        return True

    def verify(self) -> tuple[Drift, ...]:
        """Compare every pinned tensor and submodule with its snapshot.

        Writing new values into a tensor (`copy_`, `mul_`, `x[...] = v`) is not a drift.

        Returns:
            Every drift: replaced modules first, then tensors in pin order; empty when
            nothing moved.
        """
        if self._unchanged():
            return ()
        # Only what the model still holds: a replaced module's own tensors and
        # submodules are no longer read by anything but the graph.
        live = {id(s.module) for s in walk_modules(self._root)}
        drifts = [
            d
            for b in self._bindings
            if id(b.parent) in live and (d := module_drift(b)) is not None
        ]
        tensor_drifts = [
            d for p in self._pins if id(p.site.module) in live for d in pin_drifts(p)
        ]
        # A replaced object (a kernel object rebuilt after a load) is named too, where the
        # tensors the graph reads through it moved; one holding the same tensors is none.
        # A further reference to an object entered elsewhere has no pins below its path:
        # replacing it there is a drift by itself.
        named: list[str] = []  # parents come first: a replaced object is named once
        pinned_paths = [p.site.path for p in self._pins]
        for r in self._refs:
            if id(r.module) not in live or any(r.path.startswith(f"{n}.") for n in named):
                continue
            if isinstance(r.obj, torch.Tensor) and r.path in pinned_paths:
                continue  # a parameter holding attributes: its own pin names its drift
            head = f"{r.path}."
            below = [t for t in tensor_drifts if t.path.startswith(head)]
            entered = any(p.startswith(head) for p in pinned_paths)
            if (below and not isinstance(r.obj, (list, tuple, dict))) or not entered:
                d = holder_drift(r)
                if d is not None:
                    drifts.append(d)
                    named.append(r.path)
        drifts.extend(tensor_drifts)
        return tuple(drifts)

    def assert_stable(self) -> None:
        """Raise unless every pinned tensor and submodule is where the snapshot found it
        (a tensor object rebound to another over the same memory and geometry is: a
        graph reads the same addresses).

        Raises:
            StorageMovedError: Naming every drift with its expected and got values, and
                the fix; `.drifts` holds the `Drift`s.
        """
        self.checked()

    def checked(self) -> Ledger:
        """`assert_stable`, returning the ledger to check next time: this one, or, when
        tensor objects were rebound to others over the same memory and geometry (a kernel
        object's views made anew at each load), one that pins the new objects (so that
        the next check takes the flat path again).

        Raises:
            StorageMovedError: As `assert_stable`.
        """
        if self._unchanged():
            return self
        drifts = self.verify()
        moved = [d for d in drifts if d.what != "object"]
        if moved:
            raise moved_error(tuple(moved), self._label)
        if not drifts:
            return self
        return self._rebased({d.path for d in drifts})

    def _rebased(self, paths: Set[str]) -> Ledger:
        """This snapshot with the tensor objects at `paths` read again where they are."""
        pins = []
        for p in self._pins:
            if p.site.path in paths:
                now, _ = resolve_pin(p)
                if isinstance(now, torch.Tensor):
                    p = p._replace(site=p.site._replace(tensor=now))
            pins.append(p)
        return Ledger._of(self._root, tuple(pins), self._bindings, self._label,
                          self._all_refs, self._keep)

    def followed(self) -> tuple[Ledger, tuple[Drift, ...]]:
        """`checked` for a holder that reads no address (an engine that captures no
        graphs and runs the model's code at each step): a tensor rebound to new memory or
        geometry, an object on the way replaced, a tensor removed are no fault there, since
        the next step reads whatever is bound. The ledger returned pins, at every path this
        one pins, what is bound there now (nothing, where it was removed); the drifts are
        what moved (a tensor object rebound over the same memory and geometry is left
        out). A replaced submodule is still refused: what was derived from the old one
        was bound through it.

        Raises:
            StorageMovedError: A submodule was replaced.
        """
        if self._unchanged():
            return self, ()
        drifts = self.verify()
        modules = tuple(d for d in drifts if d.what == "module")
        if modules:
            raise moved_error(modules, self._label)
        moved = tuple(d for d in drifts if d.what != "object")
        if not moved:
            return (self._rebased({d.path for d in drifts}) if drifts else self), ()
        now = Ledger.snapshot(self._root, label=self._label, keep=self._keep)
        paths = set(self.paths)
        pins = tuple(p for p in now._pins if p.site.path in paths)
        return Ledger._of(self._root, pins, now._bindings, self._label, now._all_refs,
                          self._keep), moved



def _holder_of(
    container: Any, key: Any, chain: tuple[Any, ...], via: int, refs: tuple[Ref, ...]
) -> tuple[Any, Any]:
    """The object that holds a site directly, and the step from it."""
    if not chain:
        return container, key
    return refs[via].obj, chain[-1]


def _link(
    links: dict[tuple[int, Any], tuple[Any, Any, object]],
    odd: list[tuple[Any, Any, object]],
    holder: Any,
    key: Any,
    obj: object,
) -> None:
    """Record that `holder` holds `obj` under the step `key`: as an item lookup where one
    reads it (dicts, lists, tuples, an object's `__dict__`), else as an odd link."""
    kind = type(key)
    if kind is Attr:
        attrs = vars(holder)
        links[id(attrs), key.name] = (attrs, key.name, obj)
    elif kind is Slot or kind is Field or kind is Cell:
        odd.append((holder, key, obj))
    else:
        links[id(holder), key] = (holder, key, obj)
