"""The storage ledger: pins where every tensor of a model lives.

A captured graph reads raw addresses. `Ledger.snapshot(model)` records, for every tensor
reachable from the module tree (parameters, buffers, plain tensor attributes, and tensors
held in lists, tuples and dicts stored as attributes), its storage pointer, offset, shape,
stride, dtype and device. `Ledger.verify()` re-resolves each tensor through the container
it lives in and reports every `Drift`; `Ledger.assert_stable()` raises
`StorageMovedError` naming them all.

`verify()` runs before every guarded replay, so the clean case is a flat comparison: the
current data pointers, shapes, strides and dtypes of all tensors, each field built in one
list and compared with the saved list in one `==`. Only a mismatch pays for the detailed
diff.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from graphsafe.errors import StorageMovedError

__all__ = ["Drift", "DriftKind", "Ledger"]

DriftKind = Literal["storage", "offset", "shape", "stride", "dtype", "device", "removed"]

# The attributes every nn.Module has in its __dict__: registries and hook tables, never
# user tensors. `_parameters` and `_buffers` are walked on their own.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))

_FIX = (
    "write new values into the existing tensor with `copy_` (e.g. "
    "`module.weight.data.copy_(new)`, or `module.x.copy_(new)` under `torch.no_grad()`) "
    "instead of rebinding it; if the tensor must change storage, re-capture the graph "
    "(which takes a new snapshot)"
)

# Raised while re-resolving a path whose container entry is gone or is no tensor.
_RESOLVE_ERRORS = (KeyError, IndexError, TypeError, AttributeError)
# Also raised by the flat check, by `data_ptr()` of a tensor that has no storage.
_CHECK_ERRORS = (*_RESOLVE_ERRORS, RuntimeError)


class Drift(BaseModel):
    """One way in which a pinned tensor no longer matches its snapshot.

    A tensor that moved in several ways (a `.to(torch.float16)` copy changes both its
    storage and its dtype) gives one `Drift` per way.

    Examples:
        >>> d = Drift(path="layers.0.weight", module_class="Linear", what="storage",
        ...           old="0x1000", new="0x2000")
        >>> d.what
        'storage'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    """Dotted path of the tensor from the model root (`layers.0.cache.1` for a list item,
    `layers.0.tables.k` for a dict entry)."""

    module_class: str
    """Class name of the module that holds the tensor."""

    what: DriftKind
    """What moved: `storage` (the storage's data pointer), `offset`, `shape`, `stride`,
    `dtype`, `device`, or `removed` (the path no longer holds a tensor)."""

    old: str
    """The value at snapshot time."""

    new: str
    """The value now."""


class _Pin(NamedTuple):
    """Where one tensor lives and what it looked like at snapshot time."""

    path: str
    module: nn.Module
    container: Any  # the dict the first key indexes: _parameters, _buffers or __dict__
    key: Any
    chain: tuple[Any, ...]  # further keys into nested lists, tuples and dicts
    storage_ptr: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


# The flat check reads these four per tensor, one field over all tensors at a time:
# `map` over a C method is faster than a comprehension building a tuple per tensor.
# data_ptr covers storage, offset and device: the ledger keeps the pinned storages
# alive, so no new storage can be given one of their addresses.
_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")
_STRIDE = torch.Tensor.stride
_DTYPE = operator.attrgetter("dtype")


def _has_storage(t: torch.Tensor) -> bool:
    """Whether `t` has a storage to pin: sparse and other storage-less tensors have none.

    Such tensors are not pinned (a graph reads their parts, which are tensors of their
    own).
    """
    if t.layout is not torch.strided:
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Ledger:
    """Pins the storage of every tensor reachable from a module tree.

    Build it with `Ledger.snapshot(model)`. The ledger holds the module containers and
    keys, never the tensors themselves, so every verify sees what the model holds now.
    It does keep the pinned storages alive: no later allocation can then reuse one of
    their addresses, so a rebound tensor always shows a new data pointer (and a graph
    that still reads the old memory reads valid, if stale, memory). Their memory is
    released with the ledger.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Linear(4, 4)
        >>> ledger = Ledger.snapshot(model)
        >>> ledger.verify()
        ()
        >>> model.weight.data = torch.zeros(4, 4)
        >>> [(d.path, d.what) for d in ledger.verify()]
        [('weight', 'storage')]
    """

    __slots__ = (
        "_chained",
        "_containers",
        "_dtypes",
        "_held",
        "_keys",
        "_label",
        "_pins",
        "_ptrs",
        "_shapes",
        "_strides",
    )

    def __init__(
        self, pins: tuple[_Pin, ...], held: tuple[torch.UntypedStorage, ...], label: str
    ) -> None:
        """Use `Ledger.snapshot`; this constructor is internal.

        Args:
            pins: One pin per tensor, entries without a chain first.
            held: The pinned storages, kept alive with the ledger.
            label: What took the snapshot, for messages.
        """
        self._pins = pins
        self._held = held
        self._label = label
        flat = [p for p in pins if not p.chain]
        self._containers = [p.container for p in flat]
        self._keys = [p.key for p in flat]
        self._chained = [(p.container, p.key, p.chain) for p in pins if p.chain]
        tensors = [_resolve(p) for p in pins]
        self._ptrs: list[int] = list(map(_DATA_PTR, tensors))
        self._shapes: list[torch.Size] = list(map(_SHAPE, tensors))
        self._strides: list[tuple[int, ...]] = list(map(_STRIDE, tensors))
        self._dtypes: list[torch.dtype] = list(map(_DTYPE, tensors))

    @classmethod
    def snapshot(cls, model: nn.Module, *, label: str = "the snapshot") -> Ledger:
        """Pin every tensor reachable from `model`'s module tree.

        Parameters and buffers are pinned through `module._parameters` and
        `module._buffers`; plain tensor attributes through `module.__dict__`, following
        lists, tuples and dicts. `None` entries are skipped. A module shared by several
        parents is walked once, under its first path.

        Args:
            model: The root module.
            label: What the snapshot stands for, in error messages ("moved after
                {label}"), e.g. `"graph capture"`.

        Returns:
            A ledger of every tensor found.

        Examples:
            >>> from torch import nn
            >>> Ledger.snapshot(nn.Linear(2, 3)).paths
            ('weight', 'bias')
        """
        pins: list[_Pin] = []
        for prefix, module in model.named_modules():
            head = f"{prefix}." if prefix else ""
            for container in (module._parameters, module._buffers):
                for name, value in container.items():
                    if isinstance(value, torch.Tensor) and _has_storage(value):
                        pins.append(_pin(head + name, module, container, name, (), value))
            attrs = module.__dict__
            for name, value in attrs.items():
                if name in _MODULE_INTERNALS:
                    continue
                for chain, path, tensor in _walk(value, (), head + name, set()):
                    if _has_storage(tensor):
                        pins.append(_pin(path, module, attrs, name, chain, tensor))
        # Entries without a chain first: `_current` resolves them with one `map`.
        ordered = tuple(p for p in pins if not p.chain) + tuple(p for p in pins if p.chain)
        held: dict[int, torch.UntypedStorage] = {}
        for p in ordered:
            storage = _resolve(p).untyped_storage()
            held.setdefault(id(storage), storage)
        return cls(ordered, tuple(held.values()), label)

    @property
    def paths(self) -> tuple[str, ...]:
        """The dotted path of every pinned tensor.

        Returns:
            Paths in pin order: parameters, buffers and direct attributes first, then
            tensors inside lists, tuples and dicts.

        Examples:
            >>> from torch import nn
            >>> len(Ledger.snapshot(nn.Linear(2, 3)).paths)
            2
        """
        return tuple(p.path for p in self._pins)

    def __len__(self) -> int:
        return len(self._pins)

    def _unchanged(self) -> bool:
        """The flat check: True when every path holds a tensor with the pinned data
        pointer, shape, stride and dtype."""
        try:
            tensors: list[torch.Tensor] = list(map(operator.getitem, self._containers, self._keys))
            for container, key, chain in self._chained:
                value = container[key]
                for k in chain:
                    value = value[k]
                tensors.append(value)
            return (
                list(map(_DATA_PTR, tensors)) == self._ptrs
                and list(map(_SHAPE, tensors)) == self._shapes
                and list(map(_STRIDE, tensors)) == self._strides
                and list(map(_DTYPE, tensors)) == self._dtypes
            )
        except _CHECK_ERRORS:
            return False  # a path holds no tensor (or one without storage) now

    def verify(self) -> tuple[Drift, ...]:
        """Compare every pinned tensor with its snapshot.

        Returns:
            Every drift found, in pin order; empty when nothing moved. Writing new values
            into a tensor (`copy_`, `mul_`, `x[...] = v`) is not a drift.

        Examples:
            >>> import torch
            >>> from torch import nn
            >>> model = nn.Linear(2, 2)
            >>> ledger = Ledger.snapshot(model)
            >>> with torch.no_grad():
            ...     _ = model.weight.copy_(torch.ones(2, 2))
            >>> ledger.verify()
            ()
        """
        if self._unchanged():
            return ()
        return tuple(d for p in self._pins for d in _diff(p))

    def assert_stable(self) -> None:
        """Raise unless every pinned tensor is where the snapshot found it.

        Raises:
            StorageMovedError: Naming every drift, each with its expected and got
                values, and how to fix it. `.drifts` holds the `Drift`s.

        Examples:
            >>> import torch
            >>> from torch import nn
            >>> model = nn.Linear(2, 2)
            >>> ledger = Ledger.snapshot(model)
            >>> model.bias = nn.Parameter(torch.zeros(2))
            >>> try:
            ...     ledger.assert_stable()
            ... except StorageMovedError as e:
            ...     e.drifts[0].path
            'bias'
        """
        drifts = self.verify()
        if drifts:
            raise _moved_error(drifts, self._label)


def _walk(
    value: object, chain: tuple[Any, ...], path: str, seen: set[int]
) -> Iterator[tuple[tuple[Any, ...], str, torch.Tensor]]:
    """Yield `(chain, path, tensor)` for every tensor in `value`, through containers."""
    if isinstance(value, torch.Tensor):
        yield chain, path, value
        return
    if isinstance(value, nn.Module) or id(value) in seen:
        return  # submodules are walked by named_modules; cycles end here
    items: Iterator[tuple[Any, object]]
    if isinstance(value, (list, tuple)):
        items = iter(enumerate(value))
    elif isinstance(value, dict):
        items = iter(value.items())
    else:
        return
    seen.add(id(value))
    for key, item in items:
        yield from _walk(item, (*chain, key), f"{path}.{key}", seen)
    seen.discard(id(value))


def _pin(
    path: str,
    module: nn.Module,
    container: Any,
    key: Any,
    chain: tuple[Any, ...],
    t: torch.Tensor,
) -> _Pin:
    return _Pin(
        path=path,
        module=module,
        container=container,
        key=key,
        chain=chain,
        storage_ptr=t.untyped_storage().data_ptr(),
        offset=int(t.storage_offset()),
        shape=tuple(t.shape),
        stride=t.stride(),
        dtype=t.dtype,
        device=t.device,
    )


def _resolve(p: _Pin) -> Any:
    value = p.container[p.key]
    for k in p.chain:
        value = value[k]
    return value


def _resolve_loose(p: _Pin) -> tuple[object, str]:
    """What the path holds now, looked up through the container, then by attribute.

    A plain attribute that became a parameter (`m.x = nn.Parameter(...)`) leaves
    `__dict__` but is still reachable as `m.x`; describing what is there now beats
    reporting it removed.

    Returns:
        The value (None when there is none) and, when there is none, why.
    """
    try:
        return _resolve(p), ""
    except _RESOLVE_ERRORS:
        pass
    if not isinstance(p.key, str):
        return None, "missing"
    try:
        value: Any = getattr(p.module, p.key)
        for k in p.chain:
            value = value[k]
    except _RESOLVE_ERRORS:
        return None, "missing"
    return value, ""


def _diff(p: _Pin) -> list[Drift]:
    value, why = _resolve_loose(p)
    cls = type(p.module).__name__
    if not isinstance(value, torch.Tensor) or not _has_storage(value):
        old = f"tensor {p.shape} {p.dtype} on {p.device}"
        if isinstance(value, torch.Tensor):
            new = f"a tensor without storage (layout {value.layout})"
        else:
            new = why or ("None" if value is None else f"a {type(value).__name__}, not a tensor")
        return [Drift(path=p.path, module_class=cls, what="removed", old=old, new=new)]
    pairs: tuple[tuple[DriftKind, object, object], ...] = (
        ("storage", p.storage_ptr, value.untyped_storage().data_ptr()),
        ("offset", p.offset, value.storage_offset()),
        ("shape", p.shape, tuple(value.shape)),
        ("stride", p.stride, value.stride()),
        ("dtype", p.dtype, value.dtype),
        ("device", p.device, value.device),
    )
    return [
        Drift(path=p.path, module_class=cls, what=what, old=_fmt(what, a), new=_fmt(what, b))
        for what, a, b in pairs
        if a != b
    ]


def _fmt(what: DriftKind, value: object) -> str:
    if what == "storage" and isinstance(value, int):
        return f"0x{value:x}"
    return str(value)


def _values(d: Drift) -> tuple[str, str]:
    """The expected and got lines of one drift."""
    if d.what == "removed":
        return d.old, d.new
    return f"{d.what} {d.old}", f"{d.what} {d.new}"


def _moved_error(drifts: tuple[Drift, ...], label: str) -> StorageMovedError:
    paths = list(dict.fromkeys(d.path for d in drifts))
    if len(drifts) == 1:
        (d,) = drifts
        expected, got = _values(d)
        summary = (
            f"{d.path} was removed after {label}"
            if d.what == "removed"
            else f"{d.path} was rebound after {label}: its {d.what} moved"
        )
        return StorageMovedError(
            summary,
            drifts=drifts,
            module_class=d.module_class,
            path=d.path,
            expected=expected,
            got=got,
            fix=_FIX,
        )
    noun = "tensor" if len(paths) == 1 else "tensors"
    lines = [f"{len(paths)} pinned {noun} moved after {label} ({len(drifts)} drifts):"]
    for d in drifts:
        expected, got = _values(d)
        change = "removed" if d.what == "removed" else f"{d.what} moved"
        lines.append(f"  {d.path} ({d.module_class}): {change}")
        lines.append(f"    expected: {expected}")
        lines.append(f"    got:      {got}")
    return StorageMovedError(
        "\n".join(lines),
        drifts=drifts,
        path=paths[0] if len(paths) == 1 else None,
        fix=_FIX,
    )
